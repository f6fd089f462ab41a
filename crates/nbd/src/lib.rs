//! NBD protocol server, server side only (fixed newstyle handshake).
//!
//! Decodes requests, calls an [`Export`], encodes replies. Knows nothing of
//! deduplication. Protocol reference: `doc/proto.md` of NetworkBlockDevice/nbd.
//!
//! Modules: [`export`] (what is served), [`proto`] (wire constants and pure
//! codecs), `handshake` (option haggling), `transmission` (requests and
//! replies), `budget` (in-flight memory bound) and `server` (listeners,
//! connections, shutdown; re-exported here).

#![warn(missing_docs)]

mod budget;
pub mod export;
mod handshake;
pub mod proto;
mod server;
mod transmission;

#[cfg(test)]
mod fuzz_tests;

pub use export::{Export, ExportError, ExportInfo, ExportProvider};
pub use server::{Server, ServerConfig, ServerStats, ShutdownHandle};
