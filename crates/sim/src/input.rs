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
        let n = self
            .inner
            .read(buf)
            .map_err(|e| io::Error::new(e.kind(), FileError(e)))?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// An error reading the file itself (not decoding it), marked so that
/// [`Decoding`] passes it on unchanged; displays as the error it wraps.
#[derive(Debug)]
struct FileError(io::Error);

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for FileError {}

/// A decompressor whose own errors (corrupt or cut-short data) say so and
/// name the compression, as the decoders' messages ("incomplete frame",
/// "corrupt deflate stream") do not; errors reading the file pass as they
/// are.
struct Decoding<R> {
    inner: R,
    compression: &'static str,
}

impl<R: Read> Read for Decoding<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf).map_err(|e| {
            if e.get_ref().is_some_and(|inner| inner.is::<FileError>()) {
                e
            } else {
                io::Error::new(
                    e.kind(),
                    format!("{} data is corrupt or cut short: {e}", self.compression),
                )
            }
        })
    }
}

/// Whether `a` and `b` name the same file: the same device and inode when
/// both exist (so `t`, `./t`, a hard link to `t` and a symbolic link to it
/// are all `t`), else the same path once the directory part is made
/// canonical (a file that does not exist yet), else the same path as
/// given.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        (Ok(_), Err(_)) | (Err(_), Ok(_)) => false,
        (Err(_), Err(_)) => canonical_spelling(a) == canonical_spelling(b),
    }
}

/// `path` with its directory made canonical (the file itself may be
/// missing), or `path` as given when the directory cannot be resolved.
fn canonical_spelling(path: &Path) -> std::path::PathBuf {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(dir), path.file_name()) {
        (Ok(d), Some(name)) => d.join(name),
        _ => path.to_path_buf(),
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
    let raw = BufReader::with_capacity(
        BUF_BYTES,
        Counting {
            inner: file,
            count: consumed,
        },
    );
    let (raw, head) = peek(Box::new(raw), |h| h.len() >= 4, 4)?;
    let c = detect_compression(&head);
    let r: Box<dyn BufRead> = match c {
        Compression::None => raw,
        Compression::Gzip => Box::new(BufReader::with_capacity(
            BUF_BYTES,
            Decoding {
                inner: flate2::bufread::MultiGzDecoder::new(raw),
                compression: "gzip",
            },
        )),
        Compression::Zstd => Box::new(BufReader::with_capacity(
            BUF_BYTES,
            Decoding {
                inner: zstd::stream::read::Decoder::with_buffer(raw)?,
                compression: "zstd",
            },
        )),
    };
    Ok((r, c))
}

/// The first bytes of `input`, at least until `enough` holds of them or
/// `cap` bytes are in (or the input ends): a pipe, or a gzip file of
/// several members, may deliver them over several reads. Returns the
/// input to read from (those bytes first) and the bytes.
///
/// Errors: reading the input.
pub fn peek(
    mut input: Box<dyn BufRead>,
    enough: impl Fn(&[u8]) -> bool,
    cap: usize,
) -> io::Result<(Box<dyn BufRead>, Vec<u8>)> {
    let first = input.fill_buf()?;
    if first.is_empty() || first.len() >= cap || enough(first) {
        let head = first.to_vec();
        return Ok((input, head));
    }
    let mut head = Vec::new();
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let n = buf.len();
        head.extend_from_slice(buf);
        input.consume(n);
        if head.len() >= cap || enough(&head) {
            break;
        }
    }
    let again = io::Cursor::new(head.clone());
    Ok((Box::new(again.chain(input)), head))
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

    #[test]
    fn corrupt_or_cut_compressed_data_is_named_as_such() {
        let text: String = (0..2000)
            .map(|i| format!("{i} 1 p {i} 8 W 8 0 x\n"))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        // with a content checksum, as the zstd tool writes by default
        let mut enc = zstd::stream::Encoder::new(Vec::new(), 1).unwrap();
        enc.include_checksum(true).unwrap();
        io::Write::write_all(&mut enc, text.as_bytes()).unwrap();
        let zst = enc.finish().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        io::Write::write_all(&mut gz, text.as_bytes()).unwrap();
        let gz = gz.finish().unwrap();
        let mut flipped = zst.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0xff;
        for (name, bytes, expect) in [
            (
                "cut.zst",
                zst[..zst.len() / 2].to_vec(),
                "zstd data is corrupt or cut short",
            ),
            ("flipped.zst", flipped, "zstd data is corrupt or cut short"),
            (
                "cut.gz",
                gz[..gz.len() / 2].to_vec(),
                "gzip data is corrupt or cut short",
            ),
        ] {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            let (mut r, _) = open(&p, Arc::new(AtomicU64::new(0))).unwrap();
            match r.read_to_end(&mut Vec::new()) {
                Ok(n) => panic!("{name}: {n} bytes read without an error"),
                Err(err) => assert!(err.to_string().starts_with(expect), "{name}: {err}"),
            }
        }
    }

    /// Delivers its bytes `step` at a time, as a pipe may.
    struct Trickle(Vec<u8>, usize);

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.1.min(buf.len()).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0.drain(..n);
            Ok(n)
        }
    }

    #[test]
    fn a_peek_over_several_reads_keeps_every_byte() {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        for step in [1, 3, 4, 700, 20_000] {
            let input: Box<dyn BufRead> = Box::new(BufReader::new(Trickle(data.clone(), step)));
            let (mut r, head) = peek(input, |h| h.len() >= 1000, 5000).unwrap();
            assert!(head.len() >= 1000 && data.starts_with(&head), "step {step}");
            let mut all = Vec::new();
            r.read_to_end(&mut all).unwrap();
            assert_eq!(all, data, "step {step}");
        }
        // an input shorter than asked for: all of it
        let input: Box<dyn BufRead> = Box::new(BufReader::new(Trickle(vec![7; 3], 1)));
        let (mut r, head) = peek(input, |h| h.len() >= 4, 4).unwrap();
        assert_eq!(head, vec![7; 3]);
        let mut all = Vec::new();
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all, vec![7; 3]);
    }
}
