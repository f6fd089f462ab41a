//! NBD protocol server, server side only (fixed newstyle handshake).
//!
//! Decodes requests, calls an [`Export`], encodes replies. Knows nothing of
//! deduplication. Protocol reference: `doc/proto.md` of NetworkBlockDevice/nbd.

pub mod export;

pub use export::{Export, ExportError, ExportInfo, ExportProvider};
