//! The in-memory shape of one trace request, shared by every format.
//!
//! Addresses in traces are 512-byte sectors; the engine works in 4 KiB
//! blocks. A request keeps its sector address and length as the trace gave
//! them, and one fingerprint per 4 KiB block it covers (see
//! [`Request::first_block`] for the mapping rule).

/// Bytes per trace sector.
pub const SECTOR_SIZE: u64 = 512;
/// Sectors per 4 KiB block.
pub const SECTORS_PER_BLOCK: u64 = 8;

/// Largest end of a request's sector range: `MAX_END_SECTORS × 512`
/// bytes still fits in a `u64`.
pub const MAX_END_SECTORS: u64 = u64::MAX / 512;

/// A block's content fingerprint as it comes from a trace: 16 bytes (an MD5
/// digest, or for per-sector traces a 16-byte digest derived from the
/// sector digests). `None` in a request's block list means an all-zero block.
pub type Digest = [u8; 16];

/// MD5 of 4096 zero bytes: a per-4 KiB trace digest meaning "zero block".
pub const MD5_ZERO_4K: Digest = [
    0x62, 0x0f, 0x0b, 0x67, 0xa9, 0x1f, 0x7f, 0x74, 0x15, 0x1b, 0xc5, 0xbe, 0x74, 0x5b, 0x71, 0x10,
];
/// MD5 of 512 zero bytes: a per-sector trace digest meaning "zero sector".
pub const MD5_ZERO_512: Digest = [
    0xbf, 0x61, 0x9e, 0xac, 0x0c, 0xdf, 0x3f, 0x68, 0xd4, 0x96, 0xea, 0x93, 0x44, 0x13, 0x7e, 0x8b,
];

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Read (fingerprints, if any, describe the content read).
    Read,
    /// Write of the blocks' fingerprints.
    Write,
    /// Discard of the range (native traces only).
    Trim,
}

impl Op {
    /// One-letter code: `R`, `W` or `T`.
    pub fn letter(self) -> char {
        match self {
            Op::Read => 'R',
            Op::Write => 'W',
            Op::Trim => 'T',
        }
    }
}

/// Who issued requests, and to which disk: a process id and name and a
/// device number as the trace records them. Requests of different devices
/// address different disks: the same LBA on two devices is two blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Source {
    /// Process id (0 when the trace has none).
    pub pid: u32,
    /// Process name (empty when the trace has none).
    pub process: String,
    /// Device number, `major << 32 | minor` ([`device_number`]); 0 when
    /// the trace has none (MobileAppTraces, generated traces).
    pub device: u64,
}

/// The device number of a major and minor device number:
/// `major << 32 | minor`.
pub fn device_number(major: u32, minor: u32) -> u64 {
    (major as u64) << 32 | minor as u64
}

/// The device number `device` as `major,minor` (as blktrace prints it),
/// the inverse of [`device_number`].
pub fn device_label(device: u64) -> String {
    format!("{},{}", device >> 32, device & 0xffff_ffff)
}

/// One request of a trace. Readers fill a caller-owned `Request` in place
/// so the block list's buffer is reused from request to request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// Time stamp in nanoseconds (trace-relative; only the order matters).
    pub ts_ns: u64,
    /// Index of the issuing [`Source`] in the reader's source table.
    pub source: u32,
    /// Operation; `None` only in a default-constructed request.
    pub op: Option<Op>,
    /// First sector (512-byte units).
    pub lba_sectors: u64,
    /// Length in sectors.
    pub sectors: u64,
    /// One entry per 4 KiB block from [`Request::first_block`] on, in order:
    /// the block's digest, or `None` for an all-zero block. May be empty for
    /// reads and trims (and for traces without content).
    pub blocks: Vec<Option<Digest>>,
}

impl Request {
    /// The 4 KiB block holding the request's first sector:
    /// `lba_sectors / 8`. Mapping rule for requests not aligned to 4 KiB:
    /// block `i` of [`Request::blocks`] is block `first_block() + i`, so a
    /// request covering only part of a block is treated as writing that
    /// whole block with the digest the trace gives for it (traces record
    /// one digest per page touched; the bytes outside the request are
    /// unknown to them).
    pub fn first_block(&self) -> u64 {
        self.lba_sectors / SECTORS_PER_BLOCK
    }

    /// Checks a request's sector range `lba_sectors .. lba_sectors +
    /// sectors`: not empty, and its end in bytes fits in 64 bits (so no
    /// block or byte computation on it can overflow).
    ///
    /// Errors: a message saying which bound the range breaks.
    #[inline]
    pub fn check_sectors(lba_sectors: u64, sectors: u64) -> Result<(), String> {
        let ok = sectors != 0
            && lba_sectors
                .checked_add(sectors)
                .is_some_and(|end| end <= MAX_END_SECTORS);
        if ok {
            Ok(())
        } else {
            Err(sectors_error(lba_sectors, sectors))
        }
    }

    /// Number of 4 KiB blocks the sector range touches:
    /// `ceil((lba + sectors) / 8) − floor(lba / 8)`.
    pub fn blocks_touched(&self) -> u64 {
        if self.sectors == 0 {
            return 0;
        }
        (self.lba_sectors + self.sectors).div_ceil(SECTORS_PER_BLOCK) - self.first_block()
    }
}

/// The message of [`Request::check_sectors`] for a range it refuses.
#[cold]
#[inline(never)]
fn sectors_error(lba_sectors: u64, sectors: u64) -> String {
    if sectors == 0 {
        "size is 0".into()
    } else {
        format!("sectors {lba_sectors} + {sectors} end past the 64-bit byte address space")
    }
}
