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
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
        // a skippable frame (magic 0x184D2A50..=5F, as pzstd writes first)
        || (head.len() >= 4 && head[0] & 0xf0 == 0x50 && head[1..4] == [0x2a, 0x4d, 0x18])
    {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zstd_starting_with_a_skippable_frame_is_zstd() {
        // as pzstd writes: a skippable frame (magic 0x184D2A50, 4 bytes of
        // payload), then an ordinary frame
        let mut bytes = vec![0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 1, 2, 3, 4];
        bytes.extend(zstd::encode_all(&b"0 1 p 0 8 W 8 0 x\n"[..], 1).unwrap());
        assert_eq!(detect_compression(&bytes), Compression::Zstd);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.zst");
        std::fs::write(&p, &bytes).unwrap();
        let (mut r, c) = open(&p, Arc::new(AtomicU64::new(0))).unwrap();
        assert_eq!(c, Compression::Zstd);
        let mut text = String::new();
        r.read_to_string(&mut text).unwrap();
        assert_eq!(text, "0 1 p 0 8 W 8 0 x\n");
        // only the skippable magics count: other text starting with P
        // stays text
        assert_eq!(detect_compression(b"_*M\x18"), Compression::Zstd);
        assert_eq!(detect_compression(b"PXYZ"), Compression::None);
    }
}
