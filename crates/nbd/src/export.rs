//! What the server serves: the [`Export`] and [`ExportProvider`] traits.
//!
//! The server knows nothing of how blocks are stored; a storage engine
//! implements these traits. All offsets and lengths are in bytes.

use std::sync::Arc;

/// Error an export returns for one request; mapped to the NBD error code
/// sent to the client (`NBD_EIO`, `NBD_ENOSPC`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// Input/output error of the backing storage (`NBD_EIO`).
    #[error("I/O error: {0}")]
    Io(String),
    /// No space left in the backing storage (`NBD_ENOSPC`).
    #[error("no space left on the backing storage")]
    NoSpace,
    /// Request not valid for this export, e.g. past its end (`NBD_EINVAL`).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Export is read-only (`NBD_EPERM`).
    #[error("export is read-only")]
    ReadOnly,
}

/// One export (a volume) as seen by NBD clients.
///
/// Implementations must be safe to call from many threads at once: the
/// server runs the requests of one connection, and of many connections,
/// concurrently.
pub trait Export: Send + Sync {
    /// Size of the export in bytes (fixed for the life of a connection).
    fn size_bytes(&self) -> u64;
    /// True if writes, trims and zeroing are refused.
    fn read_only(&self) -> bool {
        false
    }
    /// Fills `buf` with the bytes at `offset..offset + buf.len()`.
    /// The server has already checked the range lies inside the export.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError>;
    /// Writes `data` at `offset`. With `fua`, the write must be durable
    /// before this returns.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;
    /// Makes every write completed before this call durable.
    fn flush(&self) -> Result<(), ExportError>;
    /// Discards `len` bytes at `offset` (they may read back as zeros).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError>;
    /// Makes `len` bytes at `offset` read back as zeros.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError>;
    /// Granule (bytes, a power of two) at which zeroing is faster than
    /// writing: a `WRITE_ZEROES` with `NBD_CMD_FLAG_FAST_ZERO` whose offset
    /// and length are multiples of it is carried out, any other gets
    /// `NBD_ENOTSUP` at once, the export unchanged. `None` (the default):
    /// `NBD_FLAG_SEND_FAST_ZERO` is not advertised, and the flag gets
    /// `NBD_EINVAL`.
    fn fast_zero_granule(&self) -> Option<u32> {
        None
    }
    /// True while a plain (not FUA) write, TRIM or zeroing may itself wait
    /// for the disk (a store that commits its metadata from the write path
    /// once enough has changed). Only a hint: a reply is not made to wait
    /// for such a request's company. Default false.
    fn writes_may_wait_for_disk(&self) -> bool {
        false
    }
}

/// One entry of the export list (`NBD_OPT_LIST`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Export name a client asks for.
    pub name: String,
    /// Human-readable description (may be empty).
    pub description: String,
}

/// The set of exports a server offers.
pub trait ExportProvider: Send + Sync {
    /// Every export, in a stable order.
    fn list(&self) -> Vec<ExportInfo>;
    /// Opens the export `name`; the empty name means the default export.
    /// Returns `None` if there is no such export.
    fn open(&self, name: &str) -> Option<Arc<dyn Export>>;
    /// The name [`ExportProvider::list`] gives the export that
    /// [`ExportProvider::open`] opens for `name` (sent as `NBD_INFO_NAME`);
    /// by default `name` itself. A provider with a default export maps
    /// the empty name to that export's name.
    fn canonical_name(&self, name: &str) -> String {
        name.to_string()
    }
    /// True if a FLUSH on any connection makes every completed write of
    /// every connection durable, so the server may advertise
    /// `NBD_FLAG_CAN_MULTI_CONN`.
    fn flush_covers_all_connections(&self) -> bool;
}
