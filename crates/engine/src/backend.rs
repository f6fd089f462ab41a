//! Block backends: where block data lives, addressed by PBA.
//!
//! The engine is generic over the backend: a file (production) or memory
//! (tests). A backend only stores bytes; all dedup logic is above it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::RwLock;

use crate::block::{Pba, BLOCK_SIZE_U64};

/// Storage for block data, addressed by PBA in 4 KiB units.
pub trait BlockBackend: Send + Sync {
    /// Reads `buf.len()` bytes (a multiple of 4 KiB) starting at block `pba`.
    /// Never-written blocks read as zeros.
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `data` (a multiple of 4 KiB) starting at block `pba`; grows the
    /// storage as needed. Fails with ENOSPC when the backing store is full.
    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()>;
    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;
    /// Bytes the backend occupies (the data file's length).
    fn len_bytes(&self) -> io::Result<u64>;
}

/// Block data in one file, PBA × 4096 = byte offset; the file grows on
/// demand (thin provisioning) and is sparse where never written.
///
/// Growth is preallocated up to 64 MiB ahead (`fallocate` with KEEP_SIZE;
/// less on a file system with little free space):
/// writing into blocks the file system has already allocated is several
/// times cheaper than writing into holes (measured on ext4: the delayed
/// allocation path dominated a sequential-write profile).
#[derive(Debug)]
pub struct FileBackend {
    file: File,
    preallocated_end: std::sync::atomic::AtomicU64,
    /// Set while one writer runs `fallocate`; the others do not queue
    /// behind it on the inode lock.
    preallocating: std::sync::atomic::AtomicBool,
    /// File offset (bytes) below which writes do not look at preallocation
    /// again: the free space is queried at most once per
    /// [`MIN_PREALLOCATE_BYTES`] of growth.
    next_preallocation_check: std::sync::atomic::AtomicU64,
    /// Held around each write of [`LARGE_WRITE_BYTES`] or more: writers of
    /// one file serialize on its inode lock anyway, and the kernel's
    /// waiters spin on that lock (burning a core for the whole copy),
    /// while waiters on this mutex sleep.
    large_writes: std::sync::Mutex<()>,
    observer: crate::observe::Observer,
}

/// Bytes preallocated ahead of the data file's end.
const PREALLOCATE_BYTES: u64 = 64 << 20;

/// Smallest preallocation made: when a quarter of the file system's free
/// space is less, the data file grows by its writes alone (and the free
/// space is looked at again once the file has grown by this much).
const MIN_PREALLOCATE_BYTES: u64 = 4 << 20;

/// Writes at least this long take [`FileBackend::large_writes`] (measured
/// on ext4 with four concurrent 1 MiB writers: 5–25 % more throughput, the
/// spinning on the inode lock gone from the profile). Small writes hold the
/// inode lock too briefly for sleeping to pay.
const LARGE_WRITE_BYTES: usize = 64 << 10;

impl FileBackend {
    /// Uses `file`, opened for reading and writing.
    pub fn new(file: File) -> Self {
        FileBackend {
            file,
            preallocated_end: std::sync::atomic::AtomicU64::new(0),
            preallocating: std::sync::atomic::AtomicBool::new(false),
            next_preallocation_check: std::sync::atomic::AtomicU64::new(0),
            large_writes: std::sync::Mutex::new(()),
            observer: crate::observe::Observer::default(),
        }
    }

    /// Reports every write and sync (as file `data`) to `observer`.
    pub fn with_observer(mut self, observer: crate::observe::Observer) -> Self {
        self.observer = observer;
        self
    }

    /// Keeps space allocated ahead of a write ending at byte `end`: up to
    /// [`PREALLOCATE_BYTES`], and never more than a quarter of the space
    /// the file system has free plus what is preallocated already. A
    /// fallocate that fails for want of space keeps (on ext4) what it
    /// allocated past the file's end until the file is truncated, and a
    /// write into a hole below the end then finds the file system full
    /// while that space sits unused: the quarter bounds what is taken so.
    /// Looks at the free space at most once per [`MIN_PREALLOCATE_BYTES`]
    /// of growth when nothing is to be done.
    fn preallocate(&self, end: u64) {
        use std::sync::atomic::Ordering;
        let have = self.preallocated_end.load(Ordering::Relaxed);
        // extend half a step ahead of need, one writer at a time
        if end + PREALLOCATE_BYTES / 2 <= have
            || end < self.next_preallocation_check.load(Ordering::Relaxed)
            || self.preallocating.swap(true, Ordering::Acquire)
        {
            return;
        }
        self.next_preallocation_check
            .store(end + MIN_PREALLOCATE_BYTES, Ordering::Relaxed);
        let ahead = have.saturating_sub(end);
        // (no figure: preallocate nothing rather than risk it)
        let target = crate::fileio::available_bytes(&self.file).map_or(0, |free| {
            ((free + ahead) / 4).min(PREALLOCATE_BYTES) & !(BLOCK_SIZE_U64 - 1)
        });
        if target >= MIN_PREALLOCATE_BYTES && ahead < target / 2 {
            let start = end.max(have);
            let new_end = end + target;
            // (a failure, no space or unsupported, leaves the writes to
            // report ENOSPC)
            if crate::fileio::allocate_keeping_size(&self.file, start, new_end).is_ok() {
                self.preallocated_end.fetch_max(new_end, Ordering::Relaxed);
            }
        }
        self.preallocating.store(false, Ordering::Release);
    }
}

impl BlockBackend for FileBackend {
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        // past the end of the file: never written, reads as zeros
        crate::fileio::read_padded(&self.file, buf, pba.0 * BLOCK_SIZE_U64)
    }

    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()> {
        let off = pba.0 * BLOCK_SIZE_U64;
        self.preallocate(off + data.len() as u64);
        if data.len() >= LARGE_WRITE_BYTES {
            let _one = self.large_writes.lock().unwrap_or_else(|e| e.into_inner());
            self.file.write_all_at(data, off)?;
        } else {
            self.file.write_all_at(data, off)?;
        }
        self.observer.emit(crate::observe::IoEvent::Write {
            file: "data",
            offset: off,
            data,
        });
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.observer
            .emit(crate::observe::IoEvent::SyncStart { file: "data" });
        self.file.sync_data()?;
        self.observer
            .emit(crate::observe::IoEvent::Sync { file: "data" });
        Ok(())
    }

    fn len_bytes(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

/// Block data in memory, for tests.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    bytes: RwLock<Vec<u8>>,
}

impl BlockBackend for MemoryBackend {
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        let b = self
            .bytes
            .read()
            .map_err(|_| io::Error::other("poisoned"))?;
        let off = (pba.0 * BLOCK_SIZE_U64) as usize;
        for (i, out) in buf.iter_mut().enumerate() {
            *out = b.get(off + i).copied().unwrap_or(0);
        }
        Ok(())
    }

    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()> {
        let mut b = self
            .bytes
            .write()
            .map_err(|_| io::Error::other("poisoned"))?;
        let off = (pba.0 * BLOCK_SIZE_U64) as usize;
        if b.len() < off + data.len() {
            b.resize(off + data.len(), 0);
        }
        b[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn len_bytes(&self) -> io::Result<u64> {
        Ok(self
            .bytes
            .read()
            .map_err(|_| io::Error::other("poisoned"))?
            .len() as u64)
    }
}

/// Stores nothing: writes are dropped, reads return zeros. For simulation,
/// where only fingerprints matter.
#[derive(Debug, Default)]
pub struct NullBackend;

impl BlockBackend for NullBackend {
    fn read_blocks(&self, _pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }

    fn write_blocks(&self, _pba: Pba, _data: &[u8]) -> io::Result<()> {
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn len_bytes(&self) -> io::Result<u64> {
        Ok(0)
    }
}

/// Block data in memory of which one chosen PBA fails to read with EIO
/// (tests of how unreadable blocks are handled). Clones share the data and
/// the choice.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct OneBadBlock {
    inner: std::sync::Arc<MemoryBackend>,
    bad: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

#[cfg(test)]
impl OneBadBlock {
    /// No block fails yet.
    pub(crate) fn new() -> Self {
        let b = OneBadBlock::default();
        b.bad.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        b
    }
    /// From now on reads of `pba` fail.
    pub(crate) fn fail(&self, pba: Pba) {
        self.bad.store(pba.0, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
impl BlockBackend for OneBadBlock {
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        let blocks = buf.len() as u64 / BLOCK_SIZE_U64;
        let bad = self.bad.load(std::sync::atomic::Ordering::Relaxed);
        if (pba.0..pba.0 + blocks).contains(&bad) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.read_blocks(pba, buf)
    }
    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()> {
        self.inner.write_blocks(pba, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn len_bytes(&self) -> io::Result<u64> {
        self.inner.len_bytes()
    }
}
