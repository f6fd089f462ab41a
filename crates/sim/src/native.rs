//! The native binary trace format (version 2; version 1 is read too);
//! specification in `docs/trace-format.md`.
//!
//! Layout: a 16-byte header (`DDTRACE\0`, u16 version, u16 flags, u32
//! reserved, little-endian), then chunks of `u32 length, u32 CRC-32C,
//! payload` (payload ≤ 1 MiB, holding whole records), then an end chunk
//! (`length = 0`) followed by the u64 record count and its u32 CRC-32C.
//! Records are a tag byte and LEB128 varints: sources (`0x01 id pid
//! name_len name`, or with a device number other than 0 `0x05 id pid
//! device name_len name`, version 2 only) and requests (`0x02` read,
//! `0x03` write, `0x04` trim: `zigzag(Δts_ns) source lba_sectors sectors
//! n_blocks` then per block `0x00` zero or `0x01` + 16-byte digest).

use std::io::{self, BufRead, Read, Write};

use crate::request::{Op, Request, Source, SECTORS_PER_BLOCK};

/// Bytes of the end marker: a chunk length of 0, the record count (8
/// bytes) and its CRC32C (4 bytes).
const END_MARKER_BYTES: u64 = 4 + 8 + 4;

/// First 8 bytes of every native trace.
pub const MAGIC: [u8; 8] = *b"DDTRACE\0";
/// Format version written. Readers accept it and [`VERSION_1`].
pub const VERSION: u16 = 2;
/// The first format version, still read: no device numbers (no record
/// tag `0x05`).
pub const VERSION_1: u16 = 1;
/// Bytes of the file header.
pub const HEADER_BYTES: usize = 16;
/// Largest chunk payload in bytes.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;
/// Longest LEB128 encoding of a `u64`.
const MAX_VARINT_BYTES: usize = 10;
/// Payload size at which the writer closes a chunk.
const CHUNK_TARGET_BYTES: usize = 64 * 1024;

const TAG_SOURCE: u8 = 0x01;
const TAG_READ: u8 = 0x02;
const TAG_WRITE: u8 = 0x03;
const TAG_TRIM: u8 = 0x04;
const TAG_SOURCE_DEVICE: u8 = 0x05;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Writes a native trace: sources first defined with
/// [`NativeWriter::define_source`], then requests in order.
pub struct NativeWriter<W: Write> {
    out: W,
    chunk: Vec<u8>,
    records: u64,
    sources: u32,
    last_ts: u64,
}

impl<W: Write> NativeWriter<W> {
    /// Starts a trace on `out` (writes the header).
    ///
    /// Errors: writing to `out` fails.
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut h = [0u8; HEADER_BYTES];
        h[..8].copy_from_slice(&MAGIC);
        h[8..10].copy_from_slice(&VERSION.to_le_bytes());
        out.write_all(&h)?;
        Ok(NativeWriter {
            out,
            chunk: Vec::with_capacity(CHUNK_TARGET_BYTES + 4096),
            records: 0,
            sources: 0,
            last_ts: 0,
        })
    }

    /// Defines the next source; returns its id (0, 1, 2, … in call order).
    /// A source with device 0 is a `0x01` record, any other a `0x05`
    /// record carrying the device.
    ///
    /// Errors: writing to the output fails.
    pub fn define_source(&mut self, s: &Source) -> io::Result<u32> {
        let id = self.sources;
        self.make_room(1 + 4 * MAX_VARINT_BYTES + s.process.len())?;
        self.chunk.push(if s.device == 0 {
            TAG_SOURCE
        } else {
            TAG_SOURCE_DEVICE
        });
        put_varint(&mut self.chunk, id as u64);
        put_varint(&mut self.chunk, s.pid as u64);
        if s.device != 0 {
            put_varint(&mut self.chunk, s.device);
        }
        put_varint(&mut self.chunk, s.process.len() as u64);
        self.chunk.extend_from_slice(s.process.as_bytes());
        self.sources += 1;
        self.records += 1;
        self.maybe_flush()?;
        Ok(id)
    }

    /// Appends a request. Its `source` must have been defined.
    ///
    /// Errors: an undefined source or a request without an operation
    /// (`InvalidInput`), or writing to the output fails.
    pub fn write(&mut self, r: &Request) -> io::Result<()> {
        if r.source >= self.sources {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("request names undefined source {}", r.source),
            ));
        }
        let tag = match r.op {
            Some(Op::Read) => TAG_READ,
            Some(Op::Write) => TAG_WRITE,
            Some(Op::Trim) => TAG_TRIM,
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "request has no operation",
                ))
            }
        };
        self.make_room(1 + 5 * MAX_VARINT_BYTES + 17 * r.blocks.len())?;
        let c = &mut self.chunk;
        c.push(tag);
        put_varint(c, zigzag(r.ts_ns.wrapping_sub(self.last_ts) as i64));
        self.last_ts = r.ts_ns;
        put_varint(c, r.source as u64);
        put_varint(c, r.lba_sectors);
        put_varint(c, r.sectors);
        put_varint(c, r.blocks.len() as u64);
        for b in &r.blocks {
            match b {
                None => c.push(0),
                Some(d) => {
                    c.push(1);
                    c.extend_from_slice(d);
                }
            }
        }
        self.records += 1;
        self.maybe_flush()
    }

    /// Writes the chunk out first if a record of up to `bytes` would take
    /// it past [`MAX_CHUNK_BYTES`] (a record larger than that alone is
    /// refused when its chunk is written).
    fn make_room(&mut self, bytes: usize) -> io::Result<()> {
        if self.chunk.len() + bytes > MAX_CHUNK_BYTES {
            self.flush_chunk()?;
        }
        Ok(())
    }

    fn maybe_flush(&mut self) -> io::Result<()> {
        if self.chunk.len() >= CHUNK_TARGET_BYTES {
            self.flush_chunk()?;
        }
        Ok(())
    }

    fn flush_chunk(&mut self) -> io::Result<()> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        if self.chunk.len() > MAX_CHUNK_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a single record is larger than a chunk (1 MiB)",
            ));
        }
        self.out
            .write_all(&(self.chunk.len() as u32).to_le_bytes())?;
        self.out
            .write_all(&crc32c::crc32c(&self.chunk).to_le_bytes())?;
        self.out.write_all(&self.chunk)?;
        self.chunk.clear();
        Ok(())
    }

    /// Writes the last chunk and the end marker; returns the output.
    ///
    /// Errors: writing or flushing the output fails.
    pub fn finish(mut self) -> io::Result<W> {
        self.flush_chunk()?;
        let count = self.records.to_le_bytes();
        self.out.write_all(&0u32.to_le_bytes())?;
        self.out.write_all(&count)?;
        self.out.write_all(&crc32c::crc32c(&count).to_le_bytes())?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Reads a native trace record by record.
pub struct NativeReader {
    input: Box<dyn BufRead>,
    chunk: Vec<u8>,
    pos: usize,
    /// Byte offset of the current chunk in the (decompressed) stream.
    offset: u64,
    next_offset: u64,
    records: u64,
    last_ts: u64,
    done: bool,
    /// The file's format version ([`VERSION`] or [`VERSION_1`]).
    version: u16,
    /// Sources defined so far; a request's `source` indexes it.
    pub sources: Vec<Source>,
}

/// A native-format error: byte offset and message.
pub type NativeError = (u64, String);

fn read_exact_or_eof(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => {
                return if done == 0 {
                    Ok(false)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                }
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Fills `buf` wholly, or says why not: `truncated WHAT` if the input
/// ends first, else the read error (a decompressor's names the
/// compression).
fn read_part(r: &mut dyn Read, buf: &mut [u8], what: &str) -> Result<(), String> {
    match read_exact_or_eof(r, buf) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("truncated {what}")),
        // (the end of the input, as read_exact_or_eof says it)
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && e.get_ref().is_none() => {
            Err(format!("truncated {what}"))
        }
        Err(e) => Err(format!("reading the {what}: {e}")),
    }
}

impl NativeReader {
    /// Reads and checks the header.
    ///
    /// Errors: not a native trace, or a version other than [`VERSION`]
    /// and [`VERSION_1`].
    pub fn new(mut input: Box<dyn BufRead>) -> Result<Self, NativeError> {
        let mut h = [0u8; HEADER_BYTES];
        match read_exact_or_eof(&mut input, &mut h) {
            Ok(true) => {}
            Ok(false) => return Err((0, "empty file".into())),
            Err(e) => return Err((0, format!("reading the header: {e}"))),
        }
        if h[..8] != MAGIC {
            return Err((0, "not a native trace (bad magic)".into()));
        }
        let v = u16::from_le_bytes([h[8], h[9]]);
        if v != VERSION && v != VERSION_1 {
            return Err((
                8,
                format!("unsupported version {v} (this build reads {VERSION_1} and {VERSION})"),
            ));
        }
        // (versions 1 and 2 define no flags and reserve the rest as zero)
        if h[10..16] != [0; 6] {
            return Err((10, "flags or reserved bytes not zero".into()));
        }
        Ok(NativeReader {
            input,
            chunk: Vec::new(),
            pos: 0,
            offset: HEADER_BYTES as u64,
            next_offset: HEADER_BYTES as u64,
            records: 0,
            last_ts: 0,
            done: false,
            version: v,
            sources: Vec::new(),
        })
    }

    /// The file's format version (from its header).
    pub fn version(&self) -> u16 {
        self.version
    }

    /// Number of records (sources and requests) read so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    fn err(&self, msg: impl Into<String>) -> NativeError {
        (self.offset, msg.into())
    }

    /// Loads the next chunk; false at the (verified) end marker.
    fn next_chunk(&mut self) -> Result<bool, NativeError> {
        self.offset = self.next_offset;
        let mut h = [0u8; 8];
        match read_exact_or_eof(&mut self.input, &mut h[..4]) {
            Ok(true) => {}
            Ok(false) => return Err(self.err("truncated: no end marker")),
            Err(e) => return Err(self.err(format!("reading a chunk: {e}"))),
        }
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        if len == 0 {
            let mut tail = [0u8; 12];
            if let Err(why) = read_part(&mut self.input, &mut tail, "end marker") {
                return Err(self.err(why));
            }
            let crc = u32::from_le_bytes([tail[8], tail[9], tail[10], tail[11]]);
            if crc32c::crc32c(&tail[..8]) != crc {
                return Err(self.err("end marker checksum mismatch"));
            }
            let count = u64::from_le_bytes(tail[..8].try_into().expect("8 bytes"));
            if count != self.records {
                return Err(self.err(format!(
                    "end marker says {count} records, read {}",
                    self.records
                )));
            }
            // the end: nothing may follow (two traces concatenated, or a
            // second gzip member, would otherwise replay as the first alone)
            let mut more = [0u8; 1];
            match read_exact_or_eof(&mut self.input, &mut more) {
                Ok(false) => {}
                Ok(true) => {
                    return Err((
                        self.offset + END_MARKER_BYTES,
                        "data after the end marker (traces concatenated? convert them into one)"
                            .into(),
                    ))
                }
                Err(e) => return Err(self.err(format!("reading past the end marker: {e}"))),
            }
            self.done = true;
            return Ok(false);
        }
        if len > MAX_CHUNK_BYTES {
            return Err(self.err(format!("chunk of {len} bytes exceeds 1 MiB")));
        }
        if let Err(why) = read_part(&mut self.input, &mut h[4..8], "chunk header") {
            return Err(self.err(why));
        }
        let crc = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        self.chunk.resize(len, 0);
        if let Err(why) = read_part(&mut self.input, &mut self.chunk, "chunk") {
            return Err(self.err(why));
        }
        if crc32c::crc32c(&self.chunk) != crc {
            return Err(self.err("chunk checksum mismatch"));
        }
        self.pos = 0;
        self.next_offset = self.offset + 8 + len as u64;
        Ok(true)
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, NativeError> {
        let b = *self
            .chunk
            .get(self.pos)
            .ok_or_else(|| self.err("record runs past its chunk"))?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn varint(&mut self) -> Result<u64, NativeError> {
        // with 10 bytes left in the chunk no byte needs a bounds check
        if let Some(bytes) = self.chunk.get(self.pos..self.pos + 10) {
            let mut v: u64 = 0;
            for (n, &b) in bytes.iter().enumerate() {
                v |= ((b & 0x7f) as u64) << (7 * n);
                if b & 0x80 == 0 {
                    // (the 10th byte holds bit 63 alone)
                    if n == 9 && b > 1 {
                        break;
                    }
                    self.pos += n + 1;
                    return Ok(v);
                }
            }
        }
        self.varint_checked()
    }

    /// [`NativeReader::varint`] byte by byte with bounds checks: near the
    /// end of a chunk, or for a malformed (over-long) varint.
    fn varint_checked(&mut self) -> Result<u64, NativeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                return Err(self.err("varint overflows 64 bits"));
            }
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    /// Reads the next request into `req`, taking in source records on the
    /// way; false at the end of the trace.
    ///
    /// Errors: a bad checksum, a truncated file, or a malformed record.
    pub fn next_into(&mut self, req: &mut Request) -> Result<bool, NativeError> {
        loop {
            if self.done {
                return Ok(false);
            }
            if self.pos >= self.chunk.len() && !self.next_chunk()? {
                return Ok(false);
            }
            let tag = self.byte()?;
            self.records += 1;
            let op = match tag {
                TAG_SOURCE | TAG_SOURCE_DEVICE => {
                    if tag == TAG_SOURCE_DEVICE && self.version == VERSION_1 {
                        return Err(self.err(format!(
                            "record tag {tag:#04x} (source with device) in a version {VERSION_1} file"
                        )));
                    }
                    let id = self.varint()?;
                    if id != self.sources.len() as u64 {
                        return Err(self.err(format!("source id {id} out of order")));
                    }
                    let pid =
                        u32::try_from(self.varint()?).map_err(|_| self.err("pid over 32 bits"))?;
                    let device = if tag == TAG_SOURCE_DEVICE {
                        self.varint()?
                    } else {
                        0
                    };
                    let len = self.varint()? as usize;
                    let end = self.pos.checked_add(len).filter(|&e| e <= self.chunk.len());
                    let Some(end) = end else {
                        return Err(self.err("source name runs past its chunk"));
                    };
                    let process = std::str::from_utf8(&self.chunk[self.pos..end])
                        .map_err(|_| self.err("source name is not UTF-8"))?
                        .to_string();
                    self.pos = end;
                    self.sources.push(Source {
                        pid,
                        process,
                        device,
                    });
                    continue;
                }
                TAG_READ => Op::Read,
                TAG_WRITE => Op::Write,
                TAG_TRIM => Op::Trim,
                t => return Err(self.err(format!("unknown record tag {t:#04x}"))),
            };
            let dts = unzigzag(self.varint()?);
            // (modulo 2^64, as the writer takes the difference: any u64
            // time stamp after any other is representable)
            self.last_ts = self.last_ts.wrapping_add(dts as u64);
            req.ts_ns = self.last_ts;
            req.op = Some(op);
            let source = self.varint()?;
            if source >= self.sources.len() as u64 {
                return Err(self.err(format!("request names undefined source {source}")));
            }
            req.source = source as u32;
            req.lba_sectors = self.varint()?;
            req.sectors = self.varint()?;
            Request::check_sectors(req.lba_sectors, req.sectors).map_err(|m| self.err(m))?;
            let n = self.varint()?;
            if n > (self.chunk.len() - self.pos) as u64 {
                return Err(self.err("block list runs past its chunk"));
            }
            // a write carries one digest per 4 KiB page of its size or per
            // block it touches, as the text formats
            if op == Op::Write
                && n != req.sectors.div_ceil(SECTORS_PER_BLOCK)
                && n != req.blocks_touched()
            {
                return Err(self.err(format!(
                    "{n} digests do not fit a write of {} sectors",
                    req.sectors
                )));
            }
            req.blocks.clear();
            for _ in 0..n {
                match self.byte()? {
                    0 => req.blocks.push(None),
                    1 => {
                        let end = self.pos + 16;
                        let Some(d) = self.chunk.get(self.pos..end) else {
                            return Err(self.err("digest runs past its chunk"));
                        };
                        req.blocks.push(Some(d.try_into().expect("16 bytes")));
                        self.pos = end;
                    }
                    t => return Err(self.err(format!("unknown block tag {t:#04x}"))),
                }
            }
            return Ok(true);
        }
    }
}
