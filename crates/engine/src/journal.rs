//! Write-ahead journal of metadata changes.
//!
//! A FLUSH (or FUA write) commits one transaction: every metadata page
//! changed since the previous commit — its whole image the first time
//! after a checkpoint, then only the byte ranges that changed (patches) —
//! plus whole small blobs (the volume table and counters), file length
//! changes and removals. Each transaction is checksummed (CRC32C over
//! header and body) and made durable with one `fdatasync` of the journal
//! file (group commit: every write completed before the FLUSH rides in
//! the same transaction).
//!
//! The metadata files themselves are written only at a checkpoint, when the
//! journal passes its size bound: the latest committed image of each page is
//! written in place, the files are synced, and the journal restarts at
//! offset 0. At open, the chain of valid transactions that starts at offset
//! 0 (consecutive sequence numbers, each with a good checksum) is replayed
//! into memory, over the pages read from the files (opening writes
//! nothing); the next checkpoint puts the result in place. A patch always
//! follows its page's image in the same chain, so replaying the chain again
//! after a crash during a checkpoint rebuilds the same pages.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use crate::block::VolumeId;
use crate::paged::PAYLOAD_SIZE;

const TXN_MAGIC: u64 = u64::from_le_bytes(*b"DDJTXN01");
const HEADER_BYTES: usize = 8 + 8 + 4 + 8; // magic, seq, record count, body length
/// A metadata file of the store, as named in journal records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetaFile {
    /// `refcounts`: one little-endian `u32` reference count per PBA.
    Refcounts,
    /// `fingerprints`: the 32-byte fingerprint stored at each PBA (reverse
    /// index PBA → fingerprint).
    Fingerprints,
    /// `state.json`: the volume table (and, in stores written before
    /// `counters.json` existed, the counters). Replaced whole, only by a
    /// transaction that changed the table.
    State,
    /// `counters.json`: persistent counters and the sequence number of the
    /// last transaction. Replaced whole by every transaction.
    Counters,
    /// `maps/<id>`: one little-endian `u64` per LBA of a volume, 0 for
    /// unmapped, PBA + 1 otherwise.
    Map(VolumeId),
}

impl MetaFile {
    fn encode(self) -> (u8, u32) {
        match self {
            MetaFile::Refcounts => (1, 0),
            MetaFile::Fingerprints => (2, 0),
            MetaFile::State => (3, 0),
            MetaFile::Map(v) => (4, v.0),
            MetaFile::Counters => (5, 0),
        }
    }

    fn decode(kind: u8, id: u32) -> Option<Self> {
        Some(match kind {
            // only maps carry an id: one encoding per file
            1..=3 | 5 if id != 0 => return None,
            1 => MetaFile::Refcounts,
            2 => MetaFile::Fingerprints,
            3 => MetaFile::State,
            4 => MetaFile::Map(VolumeId(id)),
            5 => MetaFile::Counters,
            _ => return None,
        })
    }

    /// Tag carried in the trailer of each of the file's pages (see
    /// [`crate::paged`]), so a page in the wrong file is detected.
    pub fn page_tag(self) -> u32 {
        match self {
            MetaFile::Refcounts => 1,
            MetaFile::Fingerprints => 2,
            MetaFile::State => 3,
            MetaFile::Counters => 4,
            MetaFile::Map(v) => 0x1000_0000 | v.0,
        }
    }

    /// Path of the file relative to the store directory.
    pub fn relative_path(self) -> String {
        match self {
            MetaFile::Refcounts => "refcounts".into(),
            MetaFile::Fingerprints => "fingerprints".into(),
            MetaFile::State => "state.json".into(),
            MetaFile::Counters => "counters.json".into(),
            MetaFile::Map(v) => format!("maps/{}", v.0),
        }
    }

    /// True for the small files replaced whole (`state.json`,
    /// `counters.json`), false for the paged ones.
    pub fn is_blob(self) -> bool {
        matches!(self, MetaFile::State | MetaFile::Counters)
    }
}

/// One change to a metadata file. `file` names the file; byte offsets and
/// lengths are of the file as stored (paged files: of their payload, see
/// [`Op::Patch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Write `data` (normally one 4 KiB page image) at byte `offset`.
    Write {
        /// File written.
        file: MetaFile,
        /// Byte offset in the file.
        offset: u64,
        /// Bytes written there.
        data: Vec<u8>,
    },
    /// Replace the whole content of `file` with `data`.
    Replace {
        /// File replaced (a blob: the volume table or the counters).
        file: MetaFile,
        /// Its new content.
        data: Vec<u8>,
    },
    /// Set the file's length in bytes.
    SetLen {
        /// File cut or extended.
        file: MetaFile,
        /// Its new length in bytes.
        len_bytes: u64,
    },
    /// Remove the file.
    Remove {
        /// File removed.
        file: MetaFile,
    },
    /// Change `data.len()` payload bytes of a paged file (reference
    /// counts, reverse index, a volume map) at logical byte `offset` (page
    /// `offset / PAYLOAD_SIZE`), within one page, whose trailer is then
    /// recomputed. Only after an [`Op::Write`] of that page's whole image in
    /// the same journal: replay never patches the page in place, which a
    /// crash during a checkpoint may have torn.
    Patch {
        /// Paged file changed.
        file: MetaFile,
        /// Logical payload byte offset (page trailers not counted).
        offset: u64,
        /// New payload bytes, all within one page.
        data: Vec<u8>,
    },
}

impl Op {
    /// Length of the data its journal record carries.
    pub fn data_len(&self) -> usize {
        match self {
            Op::Write { data, .. } | Op::Replace { data, .. } | Op::Patch { data, .. } => {
                data.len()
            }
            Op::SetLen { .. } | Op::Remove { .. } => 0,
        }
    }

    /// The file this operation changes.
    pub fn file(&self) -> MetaFile {
        match self {
            Op::Write { file, .. }
            | Op::Replace { file, .. }
            | Op::SetLen { file, .. }
            | Op::Remove { file }
            | Op::Patch { file, .. } => *file,
        }
    }
}

/// Bytes of a record before its data: tag, file kind, file id, argument,
/// data length.
const RECORD_HEADER_BYTES: u64 = 1 + 1 + 4 + 8 + 4;

/// Bytes [`encode_txn`] gives for a transaction whose records carry data
/// of the given lengths (one per operation), without encoding it.
pub fn txn_len(record_data_lens: impl IntoIterator<Item = usize>) -> u64 {
    let body: u64 = record_data_lens
        .into_iter()
        .map(|n| RECORD_HEADER_BYTES + n as u64)
        .sum();
    HEADER_BYTES as u64 + body + 4
}

/// Encodes one transaction: header, records, CRC32C of everything before it.
/// One buffer of exactly [`txn_len`] bytes (a commit of a large batch holds
/// no second copy of it).
pub fn encode_txn(seq: u64, ops: &[Op]) -> Vec<u8> {
    let total = txn_len(ops.iter().map(Op::data_len)) as usize;
    let body_len = total - HEADER_BYTES - 4;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&TXN_MAGIC.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    out.extend_from_slice(&(body_len as u64).to_le_bytes());
    for op in ops {
        let (tag, file, a, data): (u8, MetaFile, u64, &[u8]) = match op {
            Op::Write { file, offset, data } => (1, *file, *offset, data),
            Op::Replace { file, data } => (2, *file, 0, data),
            Op::SetLen { file, len_bytes } => (3, *file, *len_bytes, &[]),
            Op::Remove { file } => (4, *file, 0, &[]),
            Op::Patch { file, offset, data } => (5, *file, *offset, data),
        };
        let (kind, id) = file.encode();
        out.push(tag);
        out.push(kind);
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
    }
    debug_assert_eq!(out.len() + 4, total);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Why a transaction could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the header or body announce (a torn write).
    #[error("truncated transaction")]
    Truncated,
    /// Not a transaction header (stale or foreign bytes).
    #[error("bad transaction magic")]
    BadMagic,
    /// Checksum mismatch (torn or damaged).
    #[error("transaction checksum mismatch")]
    BadChecksum,
    /// Checksum matched but a record is malformed.
    #[error("malformed record: {0}")]
    Malformed(&'static str),
}

/// A decoded transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    /// Sequence number (consecutive within a journal chain).
    pub seq: u64,
    /// The changes, in order.
    pub ops: Vec<Op>,
    /// Encoded length in bytes.
    pub len_bytes: u64,
    /// Its CRC32C (the last 4 bytes).
    pub crc: u32,
}

/// Reads the length of the transaction starting at `header` (the first
/// [`HEADER_BYTES`] bytes), without checking the checksum.
fn header_len(header: &[u8]) -> Result<(u64, u64), DecodeError> {
    if header.len() < HEADER_BYTES {
        return Err(DecodeError::Truncated);
    }
    let magic = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
    if magic != TXN_MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let seq = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    // (no bound but the bytes there are: the reader checks the total
    // against the file's length before reading, so a transaction of any
    // size the writer wrote replays)
    let body = u64::from_le_bytes(header[20..28].try_into().expect("8 bytes"));
    let total = body
        .checked_add(HEADER_BYTES as u64 + 4)
        .ok_or(DecodeError::Malformed("body length"))?;
    Ok((seq, total))
}

/// Largest offset or length a record of a metadata file carries: 2^50
/// bytes (the reference counts of 2^48 blocks, a 1 EiB store, need 2^50).
pub(crate) const MAX_FILE_BYTES: u64 = 1 << 50;
/// Largest offset or length a record of `state.json` or `counters.json`
/// carries (the volume table, the counters: kilobytes).
const MAX_STATE_BYTES: u64 = 1 << 30;

/// Decodes one whole transaction from `bytes` (which may extend past it).
pub fn decode_txn(bytes: &[u8]) -> Result<Txn, DecodeError> {
    let (seq, total) = header_len(bytes)?;
    if (bytes.len() as u64) < total {
        return Err(DecodeError::Truncated);
    }
    let total = total as usize;
    let crc = u32::from_le_bytes(bytes[total - 4..total].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[..total - 4]) != crc {
        return Err(DecodeError::BadChecksum);
    }
    let count = u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let mut body = &bytes[HEADER_BYTES..total - 4];
    // every record takes at least 18 bytes: never reserve more than the body can hold
    let mut ops = Vec::with_capacity((count as usize).min(body.len() / 18));
    for _ in 0..count {
        if body.len() < 18 {
            return Err(DecodeError::Malformed("record header"));
        }
        let tag = body[0];
        let file = MetaFile::decode(
            body[1],
            u32::from_le_bytes(body[2..6].try_into().expect("4 bytes")),
        )
        .ok_or(DecodeError::Malformed("file kind"))?;
        let a = u64::from_le_bytes(body[6..14].try_into().expect("8 bytes"));
        let n = u32::from_le_bytes(body[14..18].try_into().expect("4 bytes")) as usize;
        if body.len() < 18 + n {
            return Err(DecodeError::Malformed("record length"));
        }
        // (offsets and lengths a sound writer never exceeds: a record
        // that passes its checksum with a wild value is damage, not a
        // reason to allocate or overflow)
        let limit = if file.is_blob() {
            MAX_STATE_BYTES
        } else {
            MAX_FILE_BYTES
        };
        if a.checked_add(n as u64).is_none_or(|end| end > limit) {
            return Err(DecodeError::Malformed(
                "offset or length past any metadata file",
            ));
        }
        let data = body[18..18 + n].to_vec();
        body = &body[18 + n..];
        ops.push(match tag {
            1 => Op::Write {
                file,
                offset: a,
                data,
            },
            2 | 4 if a != 0 => {
                return Err(DecodeError::Malformed("argument on a record without one"))
            }
            2 => Op::Replace { file, data },
            3 | 4 if !data.is_empty() => {
                return Err(DecodeError::Malformed("data on a record without data"))
            }
            3 => Op::SetLen { file, len_bytes: a },
            4 => Op::Remove { file },
            5 if file.is_blob() || data.is_empty() => {
                return Err(DecodeError::Malformed("patch of a file without pages"))
            }
            5 if (a % PAYLOAD_SIZE as u64) as usize + data.len() > PAYLOAD_SIZE => {
                return Err(DecodeError::Malformed("patch across a page"))
            }
            5 => Op::Patch {
                file,
                offset: a,
                data,
            },
            _ => return Err(DecodeError::Malformed("record tag")),
        });
    }
    if !body.is_empty() {
        return Err(DecodeError::Malformed("trailing bytes"));
    }
    Ok(Txn {
        seq,
        ops,
        len_bytes: total as u64,
        crc,
    })
}

/// Bytes at the start of the journal zeroed when it restarts after a
/// checkpoint ([`Journal::reset`]): one 512-byte sector, holding the first
/// transaction's header. A device writes a sector whole or not at all, so
/// a crash cannot zero part of this range and leave the rest: a longer
/// range could lose the sectors of a second transaction while the first
/// stayed readable, and recovery would replay that first one alone over
/// the newer files.
pub const INVALIDATE_BYTES: usize = 512;

/// Reads the chain of valid transactions from the start of `file`: each
/// with a good checksum and a sequence number one more than the previous.
/// Stops at the first torn, stale or foreign transaction.
pub fn read_chain(file: &File) -> io::Result<Vec<Txn>> {
    read_chain_bytes(file).map(|(chain, _)| chain)
}

/// [`read_chain`], with the bytes of the chain as they were read (the
/// transactions back to back from the file's start): what
/// [`Journal::with_replayed_chain`] writes again.
pub fn read_chain_bytes(file: &File) -> io::Result<(Vec<Txn>, Vec<u8>)> {
    let len = file.metadata()?.len();
    let mut out: Vec<Txn> = Vec::new();
    let mut bytes = Vec::new();
    let mut off = 0u64;
    while off + HEADER_BYTES as u64 <= len {
        let mut header = [0u8; HEADER_BYTES];
        file.read_exact_at(&mut header, off)?;
        let Ok((seq, total)) = header_len(&header) else {
            break;
        };
        if total > len - off {
            break;
        }
        if let Some(prev) = out.last() {
            if seq != prev.seq + 1 {
                break;
            }
        }
        // (a long one is checked before it is read whole: a length in a
        // damaged header costs no memory)
        if total > SCAN_BYTES as u64 && !verifies_at(file, off, total)? {
            break;
        }
        let mut buf = vec![0u8; total as usize];
        file.read_exact_at(&mut buf, off)?;
        match decode_txn(&buf) {
            Ok(t) => {
                off += t.len_bytes;
                bytes.extend_from_slice(&buf[..t.len_bytes as usize]);
                out.push(t);
            }
            Err(_) => break,
        }
    }
    // (grown by doubling: give back the spare capacity it holds until
    // written again)
    bytes.shrink_to_fit();
    Ok((out, bytes))
}

/// The length (bytes, as its header gives it) of the transaction at byte
/// `off` of `file` if its header is intact and numbered `seq` — the one
/// [`read_chain`] would have replayed next — but the transaction is cut
/// short or fails its checksum: what a crash while committing leaves, or
/// damage of the last commit. `None` if no such header is there.
pub fn cut_transaction_at(file: &File, off: u64, seq: u64) -> io::Result<Option<u64>> {
    let len = file.metadata()?.len();
    if off.saturating_add(HEADER_BYTES as u64) > len {
        return Ok(None);
    }
    let mut header = [0u8; HEADER_BYTES];
    file.read_exact_at(&mut header, off)?;
    Ok(match header_len(&header) {
        Ok((s, total)) if s == seq => Some(total),
        _ => None,
    })
}

/// Bytes read at a time when a long transaction is checked before it is
/// read whole, or the journal is searched for a later transaction.
const SCAN_BYTES: usize = 1 << 20;

/// True if the `total` bytes at `off` of `file` end with the CRC32C of the
/// bytes before (a transaction's checksum), read a window at a time.
fn verifies_at(file: &File, off: u64, total: u64) -> io::Result<bool> {
    if total < HEADER_BYTES as u64 + 4 {
        return Ok(false);
    }
    let covered = total - 4;
    let mut buf = vec![0u8; (covered as usize).min(SCAN_BYTES)];
    let mut crc = 0u32;
    let mut pos = 0u64;
    while pos < covered {
        let n = ((covered - pos) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..n], off + pos)?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        pos += n as u64;
    }
    let mut stored = [0u8; 4];
    file.read_exact_at(&mut stored, off + covered)?;
    Ok(u32::from_le_bytes(stored) == crc)
}

/// Looks past byte `from_bytes` of the journal (where [`read_chain`]
/// stopped) for a transaction that passes its checksum and has a sequence
/// number of at least `min_seq` (two past the last transaction known
/// committed); returns its byte offset. Transactions are written one at a
/// time, each made durable before the next is begun, so a crash tears only
/// the last one written: a later intact transaction proves that the one
/// at `from_bytes` was damaged after it was acknowledged, and that the
/// commits from it on would be lost by replaying the chain alone. (One
/// with the very next number proves nothing: a commit whose sync failed
/// is retried under the same number, elsewhere in the file.)
/// Transactions of older chains (before a checkpoint restarted the
/// journal) have lower sequence numbers and do not count. Holes are
/// skipped (`SEEK_DATA`).
///
/// Errors: reading the file.
pub fn later_transaction(file: &File, from_bytes: u64, min_seq: u64) -> io::Result<Option<u64>> {
    let len = file.metadata()?.len();
    let magic = TXN_MAGIC.to_le_bytes();
    let mut buf = vec![0u8; SCAN_BYTES];
    let page = crate::paged::PAGE_SIZE as u64;
    for (first, last) in crate::fileio::data_pages(file, len)? {
        let end = (last * page).min(len);
        let mut pos = (first * page).max(from_bytes + 1);
        while pos + HEADER_BYTES as u64 <= end {
            let n = ((end - pos) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], pos)?;
            for i in 0..n.saturating_sub(7) {
                if buf[i] != magic[0] || buf[i..i + 8] != magic {
                    continue;
                }
                let at = pos + i as u64;
                if at + HEADER_BYTES as u64 > len {
                    continue;
                }
                let mut header = [0u8; HEADER_BYTES];
                file.read_exact_at(&mut header, at)?;
                if let Ok((seq, total)) = header_len(&header) {
                    if seq >= min_seq && total <= len - at && verifies_at(file, at, total)? {
                        return Ok(Some(at));
                    }
                }
            }
            // (windows overlap by 7 bytes: a magic across two is found)
            if pos + (n as u64) >= end {
                break;
            }
            pos += n as u64 - 7;
        }
    }
    Ok(None)
}

/// The journal file being appended to.
#[derive(Debug)]
pub struct Journal {
    file: File,
    /// Byte offset where the next transaction goes.
    write_offset_bytes: u64,
    /// Bytes of transactions written since it was opened.
    written_bytes: u64,
    /// Sequence number of the next transaction.
    next_seq: u64,
    /// A restart at offset 0 was asked for and its invalidation of the old
    /// chain has not succeeded yet: the next commit retries it first (and
    /// fails if it fails), so no transaction is written after an old chain
    /// whose start may already be zeroed, nor over one still readable.
    reset_pending: bool,
    /// The file holds bytes past `write_offset_bytes` (transactions of an
    /// older chain, or of this one after a damaged transaction). The next
    /// commit cuts them off first: a new transaction ending where one of
    /// them begins could otherwise chain onto it, mixing a history that
    /// recovery dropped into the one written since.
    cut_pending: bool,
    /// Bytes the last [`Journal::reserve`] asked for, asked for again
    /// after a cut (which frees the space past the file's end).
    reserve_bytes: u64,
    /// End of the space allocated for certain (0 after a cut): a commit
    /// that leaves less than `reserve_bytes` before it allocates further.
    reserved_end_bytes: u64,
    /// The bytes of the chain replayed at open, exactly as they were read
    /// and replayed, until this process has written them again. They were
    /// read through the page cache: if an earlier process's sync of them
    /// failed (the kernel then marks the pages clean, keeping their new
    /// bytes), they may not be on disk, a sync now would not write them,
    /// and the cache may drop them at any time. The next commit, or
    /// [`Journal::make_head_durable`], writes them again from here and
    /// syncs first.
    replayed: Vec<u8>,
    observer: crate::observe::Observer,
}

impl Journal {
    /// Wraps an open journal file; the next transaction is written at
    /// `write_offset_bytes` with sequence number `next_seq`. Bytes of the
    /// file past that offset are cut off by the first commit (not here:
    /// opening a store writes nothing).
    ///
    /// Errors: the file's length cannot be read.
    pub fn new(file: File, write_offset_bytes: u64, next_seq: u64) -> io::Result<Self> {
        let cut_pending = file.metadata()?.len() > write_offset_bytes;
        Ok(Journal {
            reset_pending: false,
            cut_pending,
            reserve_bytes: 0,
            reserved_end_bytes: 0,
            file,
            write_offset_bytes,
            written_bytes: 0,
            next_seq,
            replayed: Vec::new(),
            observer: crate::observe::Observer::default(),
        })
    }

    /// Keeps `bytes`, the chain replayed at open as [`read_chain_bytes`]
    /// returned it, to be written again in place before anything is
    /// acknowledged (see [`Journal::make_head_durable`]); memory until then.
    pub fn with_replayed_chain(mut self, bytes: Vec<u8>) -> Self {
        self.replayed = bytes;
        self
    }

    /// Reports every write and sync (as file `journal`) to `observer`.
    pub fn with_observer(mut self, observer: crate::observe::Observer) -> Self {
        self.observer = observer;
        self
    }

    /// Allocates `bytes` of disk space for the journal from its start
    /// without changing its length, and keeps that much allocated ahead of
    /// where the next transaction goes as commits advance (best effort),
    /// so commits within that space never fail with ENOSPC (a full file
    /// system can still record the TRIMs that free space).
    ///
    /// Errors: the allocation's (`ENOSPC`: the file system has less room
    /// than the reserve). What a failed allocation took is given back, so
    /// a reserve larger than the free space does not fill the file system
    /// (the journal is then left with no reserve).
    pub fn reserve(&mut self, bytes: u64) -> io::Result<()> {
        self.reserve_bytes = bytes;
        let result = self.allocate(0, bytes.max(self.write_offset_bytes + bytes));
        if result.is_err() {
            let _ = self.release_reserve();
        }
        result
    }

    /// Gives back the disk space allocated past the file's end (the
    /// reserve, or part of one an allocation failed to complete): cutting
    /// a file to its own length frees the blocks past it.
    ///
    /// Errors: reading the length or cutting the file.
    pub fn release_reserve(&mut self) -> io::Result<()> {
        let len_bytes = self.file.metadata()?.len();
        self.file.set_len(len_bytes)?;
        self.reserved_end_bytes = self.reserved_end_bytes.min(len_bytes);
        Ok(())
    }

    /// Allocates `[start, end)` (keeping the length), and notes it. Fails
    /// with `ENOSPC` without allocating anything if the file system has
    /// less room than the part not allocated yet (past the file's end and
    /// the reserve so far): a preallocation that fails part way keeps
    /// what it got on ext4, which would take the file system's last free
    /// space from the data.
    fn allocate(&mut self, start: u64, end: u64) -> io::Result<()> {
        if end <= start {
            return Ok(());
        }
        // (allocated already: the file's blocks, a reserve an earlier
        // start made among them)
        let meta = self.file.metadata()?;
        let allocated_bytes = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        let needed = end.saturating_sub(
            start
                .max(meta.len())
                .max(self.reserved_end_bytes)
                .max(allocated_bytes),
        );
        if crate::fileio::available_bytes(&self.file).is_some_and(|free| free < needed) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        crate::fileio::allocate_keeping_size(&self.file, start, end)?;
        if start <= self.reserved_end_bytes {
            self.reserved_end_bytes = self.reserved_end_bytes.max(end);
        }
        Ok(())
    }

    /// Bytes of the journal in use since the last checkpoint.
    pub fn used_bytes(&self) -> u64 {
        self.write_offset_bytes
    }

    /// Bytes available on the file system holding the journal, or `None`
    /// if that cannot be told.
    pub fn available_bytes(&self) -> Option<u64> {
        crate::fileio::available_bytes(&self.file)
    }

    /// Sequence number the next transaction will carry.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Appends one transaction and makes it durable (one `fdatasync`).
    /// On error nothing is committed and the write offset is unchanged.
    pub fn commit(&mut self, ops: &[Op]) -> io::Result<u64> {
        if self.reset_pending {
            self.reset()?;
        }
        if self.cut_pending {
            self.cut_at(self.write_offset_bytes)?;
            self.cut_pending = false;
        }
        // (no transaction is acknowledged after a chain that may not be
        // on disk)
        self.make_head_durable()?;
        let seq = self.next_seq;
        let bytes = encode_txn(seq, ops);
        let write = crate::observe::IoEvent::Write {
            file: "journal",
            offset: self.write_offset_bytes,
            data: &bytes,
        };
        self.observer.check(write)?;
        self.file.write_all_at(&bytes, self.write_offset_bytes)?;
        self.observer.emit(write);
        self.observer
            .check(crate::observe::IoEvent::Sync { file: "journal" })?;
        self.file.sync_data()?;
        self.observer
            .emit(crate::observe::IoEvent::Sync { file: "journal" });
        self.write_offset_bytes += bytes.len() as u64;
        self.written_bytes += bytes.len() as u64;
        self.next_seq += 1;
        // the reserve ahead of the next transaction, extended a quarter
        // reserve at a time (not on a file system without room for it)
        if self.reserve_bytes > 0
            && self.write_offset_bytes + self.reserve_bytes > self.reserved_end_bytes
        {
            let end = self.write_offset_bytes + self.reserve_bytes + self.reserve_bytes / 4;
            let _ = self.allocate(self.reserved_end_bytes, end);
        }
        Ok(seq)
    }

    /// Makes the chain replayed at open durable, once: the bytes replayed,
    /// held in memory, are written again in place from the file's start
    /// (1 MiB at a time) and synced, then dropped. Whatever the disk or the
    /// page cache holds there now (pages of a failed sync lost since), the
    /// disk then holds what was replayed. A FLUSH with nothing new to
    /// commit, and the first write that could reuse a block the chain
    /// released, call it first.
    ///
    /// Errors: writing or syncing the file; the bytes are kept and it is
    /// tried again next time.
    pub fn make_head_durable(&mut self) -> io::Result<()> {
        if self.replayed.is_empty() {
            return Ok(());
        }
        let mut at = 0u64;
        for piece in self.replayed.chunks(1 << 20) {
            let write = crate::observe::IoEvent::Write {
                file: "journal",
                offset: at,
                data: piece,
            };
            self.observer.check(write)?;
            self.file.write_all_at(piece, at)?;
            self.observer.emit(write);
            at += piece.len() as u64;
        }
        self.observer
            .check(crate::observe::IoEvent::Sync { file: "journal" })?;
        self.file.sync_data()?;
        self.observer
            .emit(crate::observe::IoEvent::Sync { file: "journal" });
        self.replayed = Vec::new();
        Ok(())
    }

    /// Bytes of memory holding the chain replayed at open until it is
    /// durable ([`Journal::make_head_durable`]); 0 after.
    pub fn replayed_chain_bytes(&self) -> u64 {
        self.replayed.capacity() as u64
    }

    /// Bytes of transactions written since the journal was opened (across
    /// checkpoints).
    pub fn written_bytes(&self) -> u64 {
        self.written_bytes
    }

    /// Restarts the journal at offset 0 after a checkpoint put every
    /// committed transaction in place. The old chain is first made
    /// unreadable (its first [`INVALIDATE_BYTES`] zeroed and synced): the
    /// next transaction overwrites it in place, and a crash that persisted
    /// only some of that write's sectors must not leave a prefix of the old
    /// chain valid, which recovery would replay over the newer files.
    ///
    /// Errors: the write or sync fails; the next [`Journal::commit`] then
    /// tries again before it writes anything, and fails if that fails.
    pub fn reset(&mut self) -> io::Result<()> {
        self.reset_pending = true;
        let zeros = [0u8; INVALIDATE_BYTES];
        self.file.write_all_at(&zeros, 0)?;
        self.observer.emit(crate::observe::IoEvent::Write {
            file: "journal",
            offset: 0,
            data: &zeros,
        });
        self.file.sync_data()?;
        self.observer
            .emit(crate::observe::IoEvent::Sync { file: "journal" });
        self.write_offset_bytes = 0;
        self.replayed = Vec::new();
        self.reset_pending = false;
        Ok(())
    }

    /// Empties the journal file (after a checkpoint, at shutdown), so the
    /// next start has nothing to replay.
    pub fn truncate(&mut self) -> io::Result<()> {
        self.cut_at(0)?;
        self.write_offset_bytes = 0;
        self.replayed = Vec::new();
        self.cut_pending = false;
        Ok(())
    }

    /// Cuts the file to `len_bytes` and syncs it, then reserves its space
    /// again (best effort, as at open).
    fn cut_at(&mut self, len_bytes: u64) -> io::Result<()> {
        self.file.set_len(len_bytes)?;
        self.reserved_end_bytes = self.reserved_end_bytes.min(len_bytes);
        self.observer.emit(crate::observe::IoEvent::SetLen {
            file: "journal",
            len_bytes,
        });
        self.file.sync_all()?;
        self.observer
            .emit(crate::observe::IoEvent::Sync { file: "journal" });
        let _ = self.reserve(self.reserve_bytes);
        Ok(())
    }
}

#[cfg(test)]
mod txn_len_tests {
    use super::*;

    #[test]
    fn txn_len_is_the_encoded_length() {
        let ops = [
            Op::Write {
                file: MetaFile::Refcounts,
                offset: 4096,
                data: vec![7; 4096],
            },
            Op::Patch {
                file: MetaFile::Map(VolumeId(3)),
                offset: 12,
                data: vec![1; 40],
            },
            Op::Replace {
                file: MetaFile::State,
                data: vec![2; 300],
            },
            Op::SetLen {
                file: MetaFile::Fingerprints,
                len_bytes: 1 << 20,
            },
            Op::Remove {
                file: MetaFile::Map(VolumeId(9)),
            },
        ];
        for n in 0..=ops.len() {
            let want = encode_txn(5, &ops[..n]).len() as u64;
            assert_eq!(txn_len(ops[..n].iter().map(Op::data_len)), want, "{n} ops");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_ops() -> Vec<Op> {
        vec![
            Op::Write {
                file: MetaFile::Map(VolumeId(3)),
                offset: 4096,
                data: vec![7u8; 4096],
            },
            Op::Replace {
                file: MetaFile::State,
                data: b"{}".to_vec(),
            },
            Op::SetLen {
                file: MetaFile::Refcounts,
                len_bytes: 8192,
            },
            Op::Remove {
                file: MetaFile::Map(VolumeId(1)),
            },
            Op::Patch {
                file: MetaFile::Fingerprints,
                offset: 4064 * 3 + 32,
                data: vec![5u8; 32],
            },
        ]
    }

    #[test]
    fn the_reserve_stays_ahead_of_the_next_transaction() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(d.path().join("journal"))
            .unwrap();
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 1).unwrap();
        let reserve = 64 << 10;
        j.reserve(reserve).unwrap();
        let page = |k: u64| Op::Write {
            file: MetaFile::Refcounts,
            offset: k * 4096,
            data: vec![k as u8 + 1; 4096],
        };
        for k in 0..64 {
            j.commit(&[page(k)]).unwrap();
            let allocated = f.metadata().unwrap().blocks() * 512;
            assert!(
                allocated >= j.used_bytes() + reserve,
                "after {} bytes of transactions only {allocated} allocated",
                j.used_bytes()
            );
        }
        assert!(j.used_bytes() > 3 * reserve);
        // and again after a cut of the file
        j.truncate().unwrap();
        assert!(f.metadata().unwrap().blocks() * 512 >= reserve);
    }

    #[test]
    fn patches_that_cannot_be_applied_are_malformed() {
        for op in [
            Op::Patch {
                file: MetaFile::State,
                offset: 0,
                data: vec![1],
            },
            Op::Patch {
                file: MetaFile::Refcounts,
                offset: 4064 - 2,
                data: vec![1, 2, 3, 4],
            },
            Op::Patch {
                file: MetaFile::Refcounts,
                offset: 8,
                data: Vec::new(),
            },
            // offsets and lengths no metadata file reaches (checksum valid)
            Op::Write {
                file: MetaFile::Refcounts,
                offset: u64::MAX - 2,
                data: vec![1, 2, 3, 4],
            },
            Op::SetLen {
                file: MetaFile::Fingerprints,
                len_bytes: 1 << 63,
            },
            Op::SetLen {
                file: MetaFile::State,
                len_bytes: 1 << 40,
            },
        ] {
            let b = encode_txn(1, &[op]);
            assert!(matches!(decode_txn(&b), Err(DecodeError::Malformed(_))));
        }
    }

    #[test]
    fn roundtrip() {
        let b = encode_txn(9, &sample_ops());
        let t = decode_txn(&b).unwrap();
        assert_eq!(t.seq, 9);
        assert_eq!(t.ops, sample_ops());
        assert_eq!(t.len_bytes, b.len() as u64);
    }

    #[test]
    fn torn_and_flipped_are_rejected() {
        let b = encode_txn(1, &sample_ops());
        assert_eq!(decode_txn(&b[..b.len() - 1]), Err(DecodeError::Truncated));
        for i in [0usize, 9, 30, 200, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(decode_txn(&c).is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn chain_stops_at_stale_or_torn() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("j"))
            .unwrap();
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 1).unwrap();
        for _ in 0..3 {
            j.commit(&sample_ops()).unwrap();
        }
        assert_eq!(read_chain(&f).unwrap().len(), 3);
        // a checkpoint restarts at 0: the old chain is unreadable at once
        // (a torn first transaction cannot expose a prefix of it), and a
        // short new transaction leaves stale tails behind
        j.reset().unwrap();
        assert!(read_chain(&f).unwrap().is_empty());
        j.commit(&[Op::Remove {
            file: MetaFile::Map(VolumeId(2)),
        }])
        .unwrap();
        let chain = read_chain(&f).unwrap();
        assert_eq!(chain.len(), 1);
        assert_eq!(chain[0].seq, 4);
        // a torn header at 0 leaves nothing to replay
        f.write_all_at(&[0u8; 4], 0).unwrap();
        assert!(read_chain(&f).unwrap().is_empty());
        // a header announcing more bytes than the file holds (any size up
        // to 2^64) ends the chain without reading or allocating them
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 9).unwrap();
        j.commit(&sample_ops()).unwrap();
        assert_eq!(read_chain(&f).unwrap().len(), 1);
        for body in [1u64 << 40, u64::MAX - 8, u64::MAX] {
            f.write_all_at(&body.to_le_bytes(), 20).unwrap();
            assert!(read_chain(&f).unwrap().is_empty(), "body {body}");
        }
    }

    #[test]
    fn a_cut_transaction_is_the_next_number_only() {
        let dir = tempfile::tempdir().unwrap();
        let f = journal_file(dir.path());
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 1).unwrap();
        for _ in 0..3 {
            j.commit(&sample_ops()).unwrap();
        }
        let one = encode_txn(1, &sample_ops()).len() as u64;
        // after a reset, a transaction as long as the old first one: the
        // old second one (number 2) starts where the new chain ends
        j.reset().unwrap();
        j.commit(&sample_ops()).unwrap();
        let chain = read_chain(&f).unwrap();
        assert_eq!((chain.len(), chain[0].seq), (1, 4));
        assert_eq!(cut_transaction_at(&f, one, 5).unwrap(), None);
        // the next one, begun and cut: named with its length
        j.commit(&sample_ops()).unwrap();
        f.set_len(2 * one - 1).unwrap();
        assert_eq!(read_chain(&f).unwrap().len(), 1);
        assert_eq!(cut_transaction_at(&f, one, 5).unwrap(), Some(one));
        // nothing there at all
        assert_eq!(cut_transaction_at(&f, 10 * one, 5).unwrap(), None);
    }

    fn journal_file(dir: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("j"))
            .unwrap()
    }

    #[test]
    fn a_reset_torn_anywhere_leaves_no_prefix_of_the_old_chain() {
        // A first transaction shorter than a sector (a volume creation:
        // two length changes and the state) and a second one after it:
        // whatever sectors of the reset's write a crash persisted, neither
        // may replay alone over the files the checkpoint wrote.
        let dir = tempfile::tempdir().unwrap();
        let f = journal_file(dir.path());
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 1).unwrap();
        let small = [
            Op::SetLen {
                file: MetaFile::Map(VolumeId(1)),
                len_bytes: 0,
            },
            Op::SetLen {
                file: MetaFile::Map(VolumeId(1)),
                len_bytes: 8192,
            },
            Op::Replace {
                file: MetaFile::State,
                data: vec![b' '; 100],
            },
        ];
        j.commit(&small).unwrap();
        j.commit(&sample_ops()).unwrap();
        assert_eq!(read_chain(&f).unwrap().len(), 2);
        let before = {
            let mut b = vec![0u8; f.metadata().unwrap().len() as usize];
            f.read_exact_at(&mut b, 0).unwrap();
            b
        };
        let sectors = INVALIDATE_BYTES.div_ceil(512);
        for persisted in 1u32..(1 << sectors) {
            f.write_all_at(&before, 0).unwrap();
            for s in (0..sectors).filter(|s| persisted & (1 << s) != 0) {
                f.write_all_at(&[0u8; 512], s as u64 * 512).unwrap();
            }
            let chain = read_chain(&f).unwrap();
            assert!(
                chain.is_empty(),
                "sectors {persisted:b} of the reset persisted: {} transactions replay",
                chain.len()
            );
        }
    }

    #[test]
    fn a_commit_after_a_chain_cut_short_cannot_chain_onto_what_followed() {
        // Transactions 1-4 of equal length; 2 is damaged, so recovery
        // replays 1 alone and the next commit is number 2 again, at the
        // same offset and of the same length: the old 3 and 4 after it
        // must not join the new chain.
        let dir = tempfile::tempdir().unwrap();
        let f = journal_file(dir.path());
        let ops = |b: u8| {
            [Op::Replace {
                file: MetaFile::State,
                data: vec![b; 100],
            }]
        };
        let mut j = Journal::new(f.try_clone().unwrap(), 0, 1).unwrap();
        for b in 1..=4 {
            j.commit(&ops(b)).unwrap();
        }
        let len = encode_txn(1, &ops(1)).len() as u64;
        f.write_all_at(&[0xff], len + 40).unwrap();
        let chain = read_chain(&f).unwrap();
        assert_eq!(chain.len(), 1);
        let mut j = Journal::new(f.try_clone().unwrap(), len, 2).unwrap();
        // opening wrote nothing
        assert_eq!(f.metadata().unwrap().len(), 4 * len);
        j.commit(&ops(9)).unwrap();
        let chain = read_chain(&f).unwrap();
        assert_eq!(
            chain.iter().map(|t| t.seq).collect::<Vec<_>>(),
            [1, 2],
            "old transactions joined the new chain"
        );
        assert_eq!(chain[1].ops, ops(9));
        j.commit(&ops(10)).unwrap();
        assert_eq!(read_chain(&f).unwrap().len(), 3);
    }

    /// A transaction of raw records (tag, file kind, file id, argument,
    /// data) with a valid header and checksum, so that the record parser,
    /// not the checksum, decides.
    fn raw_txn(records: &[(u8, u8, u32, u64, Vec<u8>)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (tag, kind, id, a, data) in records {
            body.push(*tag);
            body.push(*kind);
            body.extend_from_slice(&id.to_le_bytes());
            body.extend_from_slice(&a.to_le_bytes());
            body.extend_from_slice(&(data.len() as u32).to_le_bytes());
            body.extend_from_slice(data);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&TXN_MAGIC.to_le_bytes());
        out.extend_from_slice(&7u64.to_le_bytes());
        out.extend_from_slice(&(records.len() as u32).to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    proptest::proptest! {
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_txn(&bytes);
        }

        /// Records with a good checksum but any tag, file, argument and
        /// length: the decoder accepts exactly what it can apply (a patch
        /// within one page of a paged file, no data on length changes and
        /// removals) and what it accepts encodes back to the same bytes.
        #[test]
        fn checksummed_records_decode_or_are_refused(
            records in proptest::collection::vec(
                (
                    0u8..7,
                    0u8..6,
                    0u32..3,
                    proptest::prop_oneof![0u64..20_000, proptest::num::u64::ANY],
                    proptest::collection::vec(proptest::num::u8::ANY, 0..40),
                ),
                0..6,
            )
        ) {
            let bytes = raw_txn(&records);
            if let Ok(t) = decode_txn(&bytes) {
                proptest::prop_assert_eq!(encode_txn(7, &t.ops), bytes);
                for op in &t.ops {
                    if let Op::Patch { file, offset, data } = op {
                        proptest::prop_assert!(*file != MetaFile::State && !data.is_empty());
                        proptest::prop_assert!(
                            (*offset % PAYLOAD_SIZE as u64) as usize + data.len() <= PAYLOAD_SIZE
                        );
                    }
                }
            }
        }
    }
}
