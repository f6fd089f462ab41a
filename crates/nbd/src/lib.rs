//! NBD protocol server, server side only (fixed newstyle handshake).
//!
//! Decodes requests, calls an [`Export`], encodes replies. Knows nothing of
//! deduplication. Protocol reference: `doc/proto.md` of NetworkBlockDevice/nbd.
//!
//! Modules: [`export`] (what is served), [`proto`] (wire constants and pure
//! codecs), `handshake` (option haggling), `transmission` (requests and
//! replies), `budget` (in-flight memory bound) and `server` (listeners,
//! connections, shutdown; re-exported here).
//!
//! # Example
//!
//! ```no_run
//! use std::net::TcpListener;
//! use std::sync::Arc;
//! use dedupd_nbd::{ExportProvider, Server, ServerConfig};
//!
//! fn run(provider: Arc<dyn ExportProvider>) -> std::io::Result<()> {
//!     let server = Arc::new(Server::new(provider, ServerConfig::default()));
//!     let stop = server.shutdown_handle();
//!     // e.g. from a signal handler thread: stop.shutdown();
//!     # let _ = stop;
//!     server.serve_tcp(TcpListener::bind("127.0.0.1:10809")?)?; // blocks until shutdown
//!     println!("{:?}", server.stats());
//!     Ok(())
//! }
//! ```
//!
//! # Protocol coverage
//!
//! Fixed newstyle handshake with `NBD_OPT_EXPORT_NAME`, `NBD_OPT_GO`,
//! `NBD_OPT_INFO`, `NBD_OPT_LIST` and `NBD_OPT_ABORT` (every other option is
//! answered `NBD_REP_ERR_UNSUP`; no TLS, no structured replies, no metadata
//! contexts). Transmission with simple replies: `READ`, `WRITE`, `FLUSH`,
//! `TRIM`, `WRITE_ZEROES` (`NO_HOLE` accepted; `FAST_ZERO` for an export
//! with a [`Export::fast_zero_granule`]), `DISC`, and `FUA` on every
//! command. READs and WRITEs longer than the advertised maximum payload
//! ([`ServerConfig::max_payload_bytes`], for every client, whether or not
//! it asked for it) are refused with `NBD_EINVAL`; a WRITE over 32 MiB
//! also closes the connection, since its payload is not read. Past the export's end,
//! READ and TRIM get `NBD_EINVAL`, WRITE and WRITE_ZEROES `NBD_ENOSPC`.
//! During shutdown, requests already sent get `NBD_ESHUTDOWN`.
//!
//! # Bounds against misbehaving clients
//!
//! At most [`ServerConfig::max_connections`] connections are open; a
//! negotiation not finished within 30 s (its reads and its sends alike;
//! option data over 8 KiB is dropped unread), or a WRITE payload (to be written,
//! or skipped after a refusal) that does not arrive within 60 s of its
//! header, ends the connection; so does a reply
//! the client does not read for 60 s, or does not take whole within 60 s
//! plus 1 s per 64 KiB of its first partial send (checked between sends,
//! each of which may wait 60 s). Idle connections in transmission are kept.

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
pub use server::{
    Server, ServerConfig, ServerStats, ShutdownHandle, NEGOTIATION_BUFFER_BYTES, READ_BUFFER_BYTES,
    TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_INTERVAL, TCP_KEEPALIVE_PROBES,
};
