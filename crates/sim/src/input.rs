//! Opening trace files: transparent decompression and progress counting.
//!
//! Compression is detected from the first bytes, not the file name: gzip
//! (`1f 8b`) through `flate2`, Zstandard (`28 b5 2f fd`) through `zstd`;
//! anything else is read as is.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Compression of a trace file, from its magic bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain bytes.
    None,
    /// gzip (RFC 1952).
    Gzip,
    /// Zstandard (RFC 8878).
    Zstd,
}

/// Detects the compression from a file's first bytes (at least 4 for zstd).
pub fn detect_compression(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// A reader that adds the bytes it passes on to a shared counter (the
/// compressed bytes consumed from disk, for progress and ETA).
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Buffer size of trace readers in bytes.
const BUF_BYTES: usize = 256 * 1024;

/// Opens `path` for reading, decompressing gzip or zstd content. Every byte
/// read from the file itself is added to `consumed`. Returns the buffered
/// decompressed stream and the compression found.
///
/// Errors: the file cannot be opened or read, or a decoder cannot start.
pub fn open(path: &Path, consumed: Arc<AtomicU64>) -> io::Result<(Box<dyn BufRead>, Compression)> {
    let file = File::open(path)?;
    let mut raw = BufReader::with_capacity(
        BUF_BYTES,
        Counting {
            inner: file,
            count: consumed,
        },
    );
    let head = raw.fill_buf()?;
    let c = detect_compression(head);
    let r: Box<dyn BufRead> = match c {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(BufReader::with_capacity(
            BUF_BYTES,
            flate2::bufread::MultiGzDecoder::new(raw),
        )),
        Compression::Zstd => Box::new(BufReader::with_capacity(
            BUF_BYTES,
            zstd::stream::read::Decoder::with_buffer(raw)?,
        )),
    };
    Ok((r, c))
}
