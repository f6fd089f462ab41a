//! The engine: volumes over one deduplicated block store.
//!
//! Write path (inline dedup, SmartDedup §3.1 / dmdedup §2): each 4 KiB
//! block is checked for zeros (unmapped, never stored), fingerprinted
//! outside any lock, then looked up in the fingerprint index. A hit maps the
//! LBA to the existing PBA (reference count + 1); a miss reserves a free PBA,
//! writes the data there, then indexes and maps it. Stored blocks are never
//! modified in place (redirect-on-write): an overwrite maps the LBA to
//! another PBA and releases the old one, which becomes reusable only after
//! the journal commit that records the remap (deferred free).
//!
//! Durability: FLUSH (and FUA) syncs the data file, then commits the changed
//! metadata pages to the journal with one `fdatasync`; a checkpoint writes
//! them in place when the journal passes its size bound. A FLUSH on any
//! connection covers every completed write of every connection.
//!
//! Concurrency: one mutex guards the metadata; hashing and data I/O run
//! outside it. Reads hold a shared "reuse guard" from map lookup to the end
//! of their data read, and freed PBAs return to the free list only under the
//! exclusive guard, so a read never sees a PBA reused under it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock};

use smallvec::SmallVec;

use crate::backend::{BlockBackend, FileBackend, MemoryBackend, NullBackend};
use crate::block::{is_zero, Lba, Pba, VolumeId, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{EngineError, Result};
use crate::fingerprint::{Fingerprint, HashAlgorithm};
use crate::index::{FileGroupStore, FingerprintIndex, MemoryGroupStore};
use crate::journal::{self, Journal, MetaFile, Op};
use crate::meta::{IndexPairs, Meta, Volume};
use crate::pagecache::{CacheGroup, CachedArray, OnLoadError};
use crate::paged::PagedArray;
use crate::sequence::Candidate;
use crate::stats::{proc_status_bytes, Stats};
use crate::store::{decode_checked, CounterState, State, StoreDir, VolumeRecord};

/// Stands for "not fingerprinted yet" (a block stored without inline
/// dedup); the reverse index keeps it until out-of-line dedup hashes the
/// block. No SHA-256 or BLAKE3 output is all zeros in practice.
pub const UNHASHED: Fingerprint = Fingerprint([0u8; 32]);

/// The skipped buffer's file in the store directory (see [`crate::skipped`]).
const SKIPPED_FILE: &str = "skipped.json";

/// Loads `<store>/skipped.json`: `None` if there is none; an error message
/// naming the file if it cannot be read or fails its checksum.
fn load_skipped(
    dir: &StoreDir,
) -> std::result::Result<Option<crate::skipped::SkippedBuffer>, String> {
    let path = dir.root().join(SKIPPED_FILE);
    // (a pass over the whole store is queued when it cannot be read: at
    // most a few records per KiB of --skipped-buffer are in it, which
    // `skipped::MAX_CAPACITY_BYTES` keeps under half this bound)
    let bytes = match crate::store::read_small(&path, 1 << 30) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    decode_checked(&bytes, &path)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Journal bytes in use past which each commit compares them with the
/// file system's free space (see the checkpoint condition in
/// [`Engine::flush`]).
const JOURNAL_ROOM_CHECK_BYTES: u64 = 1 << 20;

/// Number of locks serialising read-modify-write of partial blocks.
const RMW_STRIPES: usize = 64;

/// Read-modify-write attempts of one block that may find it remapped (or
/// any freed block reused) meanwhile and read again. Past them, each
/// attempt holds off the reuse of freed blocks from its read to its
/// write-back, so only a write of this very LBA can make it fail; after as
/// many more, the write fails ([`EngineError::Busy`]) rather than undo
/// another write.
const RMW_ATTEMPTS: u32 = 64;

/// What a read-modify-write read: the PBA its LBA mapped (None:
/// unmapped) and [`Meta::reuse_epoch`] then. While both hold, the LBA's
/// content is what was read: a mapped PBA's bytes change only after it is
/// freed and reused, which a commit's return of freed blocks marks.
#[derive(Debug, Clone, Copy)]
struct Expect {
    pba: Option<Pba>,
    reuse_epoch: u64,
}

impl Expect {
    /// True if LBA `lba` of `vol` still maps what was read.
    fn holds(&self, m: &Meta, vol: VolumeId, lba: u64) -> bool {
        m.reuse_epoch == self.reuse_epoch
            && m.volumes.get(&vol).map(|v| v.get(Lba(lba))) == Some(self.pba)
    }
}

/// Tunables of an open engine; every bound is in bytes.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Journal length that triggers a checkpoint (default 32 MiB); so do
    /// as many bytes of metadata pages changed since the last checkpoint
    /// (they stay in memory until it, and with patches the journal grows
    /// slower than they do). Bounds both.
    pub journal_size_bytes: u64,
    /// Metadata changed since the last commit that triggers a commit from
    /// the write path (default 16 MiB).
    pub max_dirty_bytes: u64,
    /// Blocks released but not yet reusable (waiting for a commit) that
    /// trigger a commit from the write path, in bytes (default 256 MiB);
    /// bounds how far the data file grows beyond what is stored under
    /// overwrites. Each commit syncs the data file, so a small bound costs
    /// write throughput under overwrite-heavy load. A write that meets a
    /// full file system (ENOSPC) while blocks wait commits at once and
    /// reuses them, whatever the bound.
    pub max_pending_free_bytes: u64,
    /// Disk space kept allocated ahead of the journal's next transaction
    /// (default 40 MiB), so the TRIMs that free space can be committed on
    /// a full file system. At least twice `max_dirty_bytes` (the write
    /// path forces a commit there: a transaction on a full file system is
    /// about that large, its pages logged whole after the checkpoint that
    /// empties the journal).
    pub journal_reserve_bytes: u64,
    /// Open a store whose reference counts or reverse index fail their
    /// checksums instead of refusing (for `fsck`). Default false.
    pub allow_damaged_metadata: bool,
    /// Byte-compare a block with the stored one on every fingerprint hit
    /// before sharing it (like ZFS `dedup=verify`). Default false: with
    /// SHA-256 a collision is far less likely than an undetected disk error.
    /// Recorded in the store ([`crate::store::State::verify`]), so that
    /// commands opening it with [`EngineConfig::settings_from_store`]
    /// (`dedupd dedup --offline` with the server stopped) verify as the
    /// server last did.
    pub verify: bool,
    /// The fingerprint index: memory budget, eviction policy, inline lookup
    /// mode; `prefix_bits` applies when a store is created (afterwards the
    /// superblock's value is used).
    pub index: crate::index::IndexConfig,
    /// Adaptive selectivity of inline dedup (duplication level, load, power).
    pub selectivity: crate::selectivity::SelectivityConfig,
    /// Bytes of the read cache keyed by PBA (SmartDedup §3.4); 0 disables
    /// it. Default 4 MiB.
    pub read_cache_bytes: u64,
    /// Bytes of the skipped buffer (blocks written without an inline match,
    /// for out-of-line dedup); default 512 KiB, at most
    /// [`crate::skipped::MAX_CAPACITY_BYTES`] ([`Engine::open`] refuses more
    /// with [`EngineError::InvalidArgument`]).
    pub skipped_buffer_bytes: usize,
    /// Sequence threshold T in blocks (iDedup; SmartDedup §4.5): inline
    /// dedup shares stored blocks only for runs of at least T consecutive
    /// duplicates with contiguous PBAs; see [`crate::sequence`]. A volume
    /// may override it. Default 1 (off).
    pub sequence_threshold_blocks: u32,
    /// [`Engine::open`] takes the settings the store records from the
    /// last open that wrote them — T (instead of
    /// `sequence_threshold_blocks`) and `verify` — instead of this
    /// configuration's: for commands that open a store between runs of
    /// the server (volume, offline dedup and fsck commands), which then
    /// run as the server last ran and leave its settings recorded.
    /// Default false (an open with other settings records them).
    pub settings_from_store: bool,
    /// Bytes of the reverse index (PBA → fingerprint, 32 bytes per block)
    /// kept in memory; the rest is paged from its file on demand (see
    /// [`crate::reverse`]). 0 keeps all of it. Default 16 MiB (about
    /// 500 000 blocks, 2 GiB of distinct data).
    pub reverse_index_cache_bytes: u64,
    /// Bytes of volume-map and reference-count pages (8 bytes per LBA, 4
    /// per block) kept in memory; the rest is paged from their files on
    /// demand (see [`crate::pagecache`]), all volumes together. 0 keeps all
    /// of them. Default 16 MiB (the map entries and reference counts of
    /// about 1.4 million blocks, 5.6 GiB written once).
    pub map_cache_bytes: u64,
    /// Bytes of CAFTL's pre-hash CRC table (see [`crate::caftl`]): only
    /// blocks whose CRC-32C was seen before are fingerprinted inline.
    /// Default 0 (off).
    pub prehash_bytes: u64,
    /// CAFTL's sampling (see [`crate::caftl`]): fingerprint the other blocks
    /// of a request only if its sample is a duplicate. Default false.
    pub sampling: bool,
    /// Receives every change made to the store's files (crash testing).
    pub observer: crate::observe::Observer,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            journal_size_bytes: 32 << 20,
            max_dirty_bytes: 16 << 20,
            max_pending_free_bytes: 256 << 20,
            journal_reserve_bytes: 40 << 20,
            allow_damaged_metadata: false,
            verify: false,
            index: crate::index::IndexConfig::default(),
            skipped_buffer_bytes: 512 << 10,
            sequence_threshold_blocks: 1,
            settings_from_store: false,
            prehash_bytes: 0,
            sampling: false,
            reverse_index_cache_bytes: 16 << 20,
            map_cache_bytes: 16 << 20,
            read_cache_bytes: 4 << 20,
            selectivity: crate::selectivity::SelectivityConfig::default(),
            observer: crate::observe::Observer::default(),
        }
    }
}

/// A volume as listed to users.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeInfo {
    /// Stable id.
    pub id: VolumeId,
    /// Name (the NBD export name).
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Bytes of the volume mapped to stored data.
    pub mapped_bytes: u64,
    /// True if it is served read-only: its metadata failed checksums (until
    /// repaired), or it is being deleted.
    pub read_only: bool,
    /// True if a delete of it began and has not finished (run `volume
    /// delete` again to finish it).
    #[serde(default)]
    pub deleting: bool,
    /// Its own sequence threshold T in blocks, if set (else the engine's).
    #[serde(default)]
    pub sequence_threshold_blocks: Option<u32>,
    /// A shrink to this many bytes began and did not finish (a crash, an
    /// error): nothing past it is written until a `volume resize`
    /// finishes or undoes it.
    #[serde(default)]
    pub shrinking_to_bytes: Option<u64>,
}

/// What [`Engine::delete_volume`] did, beyond deleting the volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeDeleted {
    /// The volume's map was damaged (missing, truncated, or with pages
    /// failing their checksums): the blocks its lost entries referenced
    /// were not released and stay allocated, leaked, until
    /// `dedupd fsck --repair` reclaims them.
    pub map_damaged: bool,
}

/// Metadata pages that failed their checksum when the store was opened,
/// a metadata file that is missing although the store needs it, or (seen
/// only by a check, `fsck`: it stops any other open) a `counters.json`
/// that is missing or fails its checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// The damaged file.
    pub file: std::path::PathBuf,
    /// Numbers of its damaged 4 KiB pages (they read as zeros).
    pub pages: Vec<u64>,
    /// The whole file is missing (all of it reads as zeros): a volume map
    /// whose volume was created before the last checkpoint, or the
    /// reference counts or reverse index of a store holding data.
    pub missing: bool,
    /// A volume map shorter than its volume (truncated): (pages it has,
    /// pages the volume needs); the LBAs past its end read as unmapped.
    pub truncated: Option<(u64, u64)>,
    /// What was made of the file instead, for the report (`state.json`:
    /// the volume table rebuilt).
    pub detail: Option<String>,
}

impl Damage {
    /// What is wrong, for messages: missing, or how many pages fail their
    /// checksum (and the first few).
    pub fn describe(&self) -> String {
        if let Some(detail) = &self.detail {
            format!("{} is damaged: {detail}", self.file.display())
        } else if self.missing {
            format!("{} is missing", self.file.display())
        } else if self.pages.is_empty() && self.truncated.is_none() {
            format!("{} fails its checksum", self.file.display())
        } else if let Some((have, want)) = self.truncated {
            format!(
                "{} ends at page {have} of the {want} its volume needs (truncated)",
                self.file.display()
            )
        } else {
            format!(
                "{}: {} page(s) fail their checksum: {:?}",
                self.file.display(),
                self.pages.len(),
                &self.pages[..self.pages.len().min(16)]
            )
        }
    }
}

/// Latest committed image of each metadata page, waiting for a checkpoint.
#[derive(Debug, Default)]
struct CheckpointBuffer {
    ops: Vec<Op>,
    position: HashMap<(MetaFile, u64), usize>,
    /// Page images (indexes into `ops`) patched since added: their
    /// trailers are recomputed before they are written.
    stale: std::collections::HashSet<usize>,
    bytes: u64,
    /// Commit generation of the last batch added (see
    /// [`crate::meta::Meta::commit_generation`]).
    generation: u64,
}

impl CheckpointBuffer {
    /// Adds committed operations: a page image replaces the previous one
    /// of the same page, a patch is folded into the page's image.
    fn add(&mut self, ops: Vec<Op>) {
        for op in ops {
            if let Op::Patch { file, offset, data } = &op {
                let payload = crate::paged::PAYLOAD_SIZE as u64;
                let key = (*file, offset / payload * crate::paged::PAGE_SIZE as u64);
                let in_page = (offset % payload) as usize;
                if let Some(&i) = self.position.get(&key) {
                    if let Op::Write { data: img, .. } = &mut self.ops[i] {
                        if img.len() == crate::paged::PAGE_SIZE
                            && in_page + data.len() <= crate::paged::PAYLOAD_SIZE
                        {
                            img[in_page..in_page + data.len()].copy_from_slice(data);
                            self.stale.insert(i);
                            continue;
                        }
                    }
                }
                // no image here (the file was cut since): patched in place
                self.bytes += data.len() as u64;
                self.ops.push(op);
                continue;
            }
            let key = match &op {
                Op::Write { file, offset, .. } => Some((*file, *offset)),
                Op::Replace { file, .. } => Some((*file, u64::MAX)),
                Op::SetLen { file, .. } | Op::Remove { file } => {
                    let f = *file;
                    self.position.retain(|(g, _), _| *g != f);
                    None
                }
                Op::Patch { .. } => unreachable!("handled above"),
            };
            let len = match &op {
                Op::Write { data, .. } | Op::Replace { data, .. } => data.len() as u64,
                _ => 0,
            };
            match key.and_then(|k| self.position.get(&k).copied()) {
                Some(i) => {
                    self.ops[i] = op;
                    self.stale.remove(&i);
                }
                None => {
                    if let Some(k) = key {
                        self.position.insert(k, self.ops.len());
                    }
                    self.bytes += len;
                    self.ops.push(op);
                }
            }
        }
    }

    /// The operations to write in place, patched images re-encoded.
    fn finished_ops(&mut self) -> &[Op] {
        for i in std::mem::take(&mut self.stale) {
            if let Op::Write { file, offset, data } = &mut self.ops[i] {
                let page = *offset / crate::paged::PAGE_SIZE as u64;
                crate::paged::reencode_page(data, file.page_tag(), page);
            }
        }
        &self.ops
    }
}

#[derive(Debug)]
struct CommitState {
    journal: Option<Journal>,
    checkpoint: CheckpointBuffer,
    durable_changes: u64,
    /// Bytes the checkpoints since start wrote in place.
    checkpoint_bytes_written: u64,
    /// The superblock and counters (as opened) of a store of an older
    /// format, to be marked [`crate::store::FORMAT_VERSION`] before the
    /// first commit.
    format_upgrade: Option<(crate::store::Superblock, CounterState)>,
}

/// LBAs looked at per hold of the metadata lock when a volume is deleted
/// or shrunk (32 MiB of volume; of them at most 1024 mapped ones are
/// released, the rest left to the next piece).
pub const RELEASE_PIECE_BLOCKS: u64 = 8192;

/// Where a block of a write ends up, decided under the metadata lock.
enum Placement {
    Done,
    /// Store at a reserved PBA; `indexed` false for a block whose
    /// fingerprint matched different bytes (a collision found by verify).
    New {
        pba: Pba,
        fp: Fingerprint,
        indexed: bool,
        /// A duplicate written as new by the sequence threshold: not
        /// queued for out-of-line dedup, which would undo the choice.
        filtered: bool,
    },
    SameAs(usize),
}

/// An open store: volumes, metadata and block data. Safe to share between
/// threads (`Arc<Engine>`); every method may be called concurrently.
pub struct Engine {
    pub(crate) dir: Option<StoreDir>,
    pub(crate) damage: Vec<Damage>,
    /// Conditions found at open that users should know about.
    notes: Vec<String>,
    pub(crate) hash: HashAlgorithm,
    pub(crate) backend: Box<dyn BlockBackend>,
    pub(crate) meta: Mutex<Meta>,
    reuse: RwLock<()>,
    commit: Mutex<CommitState>,
    rmw: Vec<Mutex<()>>,
    /// Set when a bound on uncommitted metadata or pending frees is passed.
    commit_wanted: AtomicBool,
    /// Set while the journal chain replayed at open is not yet written
    /// again ([`Journal::make_head_durable`]): blocks it released are free
    /// in memory, and none may be reused before it is durable.
    replayed_chain_pending: AtomicBool,
    /// Set at open when a journal chain was replayed, cleared by the next
    /// commit or checkpoint: until then the blocks the chain's last
    /// transaction released are not known (they are in the free set), and
    /// a write must first commit, so that damage to that transaction would
    /// be found behind an intact one instead of cutting the chain there
    /// (see [`Meta::held_free`]).
    replayed_frees_unknown: AtomicBool,
    /// Set when uncommitted metadata or pending frees pass twice their
    /// bounds: the next change commits first, waiting for a running
    /// commit, and is refused if that fails (see [`Engine::enforce_bounds`]).
    over_commit_bound: AtomicBool,
    /// Set when committed changes waiting for a checkpoint pass twice the
    /// journal size because checkpoints fail: the next change checkpoints
    /// first, and is refused if that fails.
    checkpoint_behind: AtomicBool,
    /// Set by [`Engine::drop_without_closing`]: dropping the engine then
    /// writes nothing (no commit, no checkpoint, no skipped-buffer save).
    no_close_on_drop: AtomicBool,
    /// The page cache group of the maps and reference counts (shared with
    /// [`Meta::map_cache`]): its fault count is read without the lock.
    map_cache: std::sync::Arc<CacheGroup>,
    /// The reverse index's page cache group (shared with
    /// [`Meta::reverse_cache`]): its dropped writes, read without the lock.
    reverse_cache: std::sync::Arc<CacheGroup>,
    /// Read cache keyed by PBA.
    cache: crate::cache::ReadCache,
    /// Which blocks inline dedup fingerprints.
    pub(crate) selectivity: crate::selectivity::Selectivity,
    /// CAFTL pre-hash table and sampling figures.
    caftl: Mutex<crate::caftl::PrehashTable>,
    /// Totals of the out-of-line passes.
    pub(crate) out_of_line: Mutex<crate::outofline::OutOfLineStats>,
    /// The background pass's merge scan, kept while it yields to
    /// foreground traffic so the next pass resumes it (its merges are a
    /// copy of at most `MAX_PENDING_MERGES` pending ones).
    pub(crate) merge_scan: Mutex<Option<crate::outofline::MergeScan>>,
    /// Bytes of that scan's merges (for `metadata_bytes_in_memory`; read
    /// without its lock, which a running scan holds).
    pub(crate) merge_scan_bytes: AtomicU64,
    /// Commits a write forced on a full file system to reuse the blocks
    /// released since the last commit.
    no_space_commits: AtomicU64,
    /// Client requests started (reads, writes, trims); the out-of-line
    /// worker backs off while it moves.
    foreground: AtomicU64,
    /// Set while a full offline pass ([`Engine::dedup_offline`]) runs: one
    /// at a time, as each sizes its sort buffers and merge batch to the
    /// index budget.
    pub(crate) offline_pass_running: AtomicBool,
    /// Raised by [`Engine::stop_offline_passes`]: full offline passes stop
    /// early.
    pub(crate) offline_pass_stop: AtomicBool,
    pub(crate) config: EngineConfig,
}

/// Name of the journal a repair of a store whose journal is missing
/// writes, renamed to `journal` once the repair is committed.
pub(crate) const REPAIR_JOURNAL_FILE: &str = "journal.repair";

/// Blocks a TRIM, zeroing, delete or shrink releases under one hold of
/// the metadata lock (a piece; commits may come between pieces): with
/// scattered blocks, 1024 reference-count pages (4 MiB) besides the
/// volume map's.
const MAX_PIECE_RELEASES: usize = 1024;

/// The mapped LBAs of `v` from `from` up to `end` that one piece releases
/// (at most [`MAX_PIECE_RELEASES`]), as (LBA, map entry), and where the
/// piece ends (`end`, or the first LBA left to the next piece).
fn release_piece(v: &crate::meta::Volume, from: u64, end: u64) -> (Vec<(u64, u64)>, u64) {
    let mut mapped = v.map.nonzero_u64(from..end);
    match mapped.get(MAX_PIECE_RELEASES) {
        Some(&(next, _)) => {
            mapped.truncate(MAX_PIECE_RELEASES);
            (mapped, next)
        }
        None => (mapped, end),
    }
}

/// The note of a journal reserve that could not be allocated.
fn reserve_note(journal: &Journal, reserve_bytes: u64, e: &std::io::Error) -> String {
    let advice = if e.raw_os_error() == Some(libc::ENOSPC) {
        format!(
            "{} bytes free on the file system; give a smaller reserve",
            journal
                .available_bytes()
                .map_or("unknown".to_string(), |b| b.to_string())
        )
    } else {
        "the file system cannot preallocate it".to_string()
    };
    format!(
        "the journal reserve of {reserve_bytes} bytes (--journal-reserve) could not be \
         allocated ({e}; {advice}): the store runs without one, so once the file system \
         is full a commit can fail, even one that records TRIMs freeing space"
    )
}

/// Refuses a configuration out of its documented bounds.
fn check_config(config: &EngineConfig) -> Result<()> {
    if config.skipped_buffer_bytes > crate::skipped::MAX_CAPACITY_BYTES
        || config.skipped_buffer_bytes < crate::skipped::MIN_CAPACITY_BYTES
    {
        return Err(EngineError::InvalidArgument(format!(
            "skipped buffer of {} bytes (--skipped-buffer): {} bytes (16 records) to {} MiB \
             (out-of-line dedup is turned off with --out-of-line-rate 0, not here)",
            config.skipped_buffer_bytes,
            crate::skipped::MIN_CAPACITY_BYTES,
            crate::skipped::MAX_CAPACITY_BYTES >> 20
        )));
    }
    if config.prehash_bytes > crate::caftl::MAX_PREHASH_BYTES
        || (1..8).contains(&config.prehash_bytes)
    {
        return Err(EngineError::InvalidArgument(format!(
            "pre-hash table of {} bytes (--prehash): 8 bytes (one CRC slot) to {} MiB, or 0 for off",
            config.prehash_bytes,
            crate::caftl::MAX_PREHASH_BYTES >> 20
        )));
    }
    if config.journal_reserve_bytes < config.max_dirty_bytes.saturating_mul(2) {
        return Err(EngineError::InvalidArgument(format!(
            "a journal reserve of {} bytes (--journal-reserve) is less than twice the \
             {} bytes of changed metadata that trigger a commit (--max-dirty): a commit \
             on a full file system would not fit in it; raise the reserve or lower --max-dirty",
            config.journal_reserve_bytes, config.max_dirty_bytes
        )));
    }
    Ok(())
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // a panic while holding the lock is a bug; the data is still the best we have
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    /// Creates a new, empty store at `path` with the given fingerprint
    /// algorithm and opens it. Fails if `path` exists and is not empty.
    pub fn create(path: &Path, hash: HashAlgorithm, config: EngineConfig) -> Result<Engine> {
        check_config(&config)?;
        // (locked throughout: no other process opens it half made)
        let dir = StoreDir::create(path, hash, config.index.prefix_bits)?;
        let sb = dir.superblock()?;
        Engine::open_dir(path, dir, sb, config)
    }

    /// Opens the store at `path`: replays the journal, loads the metadata and
    /// rebuilds the fingerprint index and free space.
    ///
    /// Errors: [`EngineError::NoStore`], [`EngineError::NotAStore`],
    /// [`EngineError::Locked`] (another process has it open),
    /// [`EngineError::Corrupt`] (a metadata file fails its checksum).
    pub fn open(path: &Path, config: EngineConfig) -> Result<Engine> {
        check_config(&config)?;
        let (dir, sb) = StoreDir::open(path)?;
        Engine::open_dir(path, dir, sb, config)
    }

    /// [`Engine::open`] of a store directory already opened and locked,
    /// with superblock `sb` (fsck passes one it rebuilt).
    pub(crate) fn open_dir(
        path: &Path,
        mut dir: StoreDir,
        sb: crate::store::Superblock,
        mut config: EngineConfig,
    ) -> Result<Engine> {
        dir.set_observer(config.observer.clone());
        // the journal holds the commits since the last checkpoint: without
        // it they are lost, and what they freed may have been reused
        let journal_path = dir.root().join("journal");
        let journal_missing = !journal_path.exists();
        if journal_missing && !config.allow_damaged_metadata {
            return Err(EngineError::Corrupt {
                file: journal_path,
                detail: format!(
                    "missing: the commits since the last checkpoint are lost with it; the \
                     store is not served. Run `dedupd --store {} fsck --repair --rehash` to \
                     check the store without them and create the journal anew",
                    crate::error::store_word(path)
                ),
            });
        }
        let jfile = if journal_missing {
            // (a check creates nothing: an unlinked file stands in until a
            // repair creates the journal)
            dir.stand_in("journal")?
        } else {
            dir.open_file("journal", false)?
        };
        let (chain, replayed) = journal::read_chain_bytes(&jfile)
            .map_err(|e| EngineError::io("reading the journal", e))?;
        let last_seq = chain.last().map_or(0, |t| t.seq);
        let chain_bytes: u64 = chain.iter().map(|t| t.len_bytes).sum();
        // Replay into memory, not onto the files: opening never writes, so a
        // store on a full file system still opens. The replayed changes go to
        // the next checkpoint. The large files are not read into memory:
        // their pages are checked once and then paged on demand, the
        // journal's newer pages pinned over them (crate::metaopen).
        let chain_ops: Vec<Op> = chain.into_iter().flat_map(|t| t.ops).collect();
        let state_path = dir.path(MetaFile::State);
        // (a file too long to read is damage of it as any other)
        let (state_bytes, state_read) = match dir.blob_bytes(MetaFile::State, &chain_ops) {
            Ok(bytes) => (bytes, Ok(())),
            Err(e @ EngineError::Corrupt { .. }) => (Vec::new(), Err(e)),
            Err(e) => return Err(e),
        };
        let mut state_damage = None;
        let state: State = match state_read.and_then(|()| decode_checked(&state_bytes, &state_path))
        {
            Ok(state) => state,
            // the volume table: a check rebuilds it from the volume maps
            // (and what the damaged file still says), and its repair
            // writes it anew
            Err(EngineError::Corrupt { detail, .. }) if config.allow_damaged_metadata => {
                let (state, rebuilt) =
                    crate::staterebuild::rebuild_state(path, &state_bytes, &chain_ops)
                        .map_err(|e| EngineError::io("reading the volume maps", e))?;
                state_damage = Some(Damage {
                    file: state_path.clone(),
                    pages: Vec::new(),
                    missing: false,
                    truncated: None,
                    detail: Some(format!("{detail}; {rebuilt}")),
                });
                state
            }
            Err(EngineError::Corrupt { file, detail }) => {
                return Err(EngineError::Corrupt {
                    file,
                    detail: format!(
                        "{detail}; the store is not served. Run `dedupd --store {} fsck` to \
                         see the volume table rebuilt from the volume maps, then `fsck \
                         --repair` to write it",
                        crate::error::store_word(path)
                    ),
                })
            }
            Err(e) => return Err(e),
        };
        // format 2 keeps the counters apart; format 1 in the state (a
        // counters.json beside it is left from an upgrade that did not
        // finish)
        let mut counters_damage = None;
        // (format 1 keeps the counters and the journal's sequence in the
        // state: a rebuilt state that lost them is damaged counters too)
        let format1_counters_lost =
            sb.format_version < 2 && state_damage.is_some() && state.counters.is_none();
        let counter_state = if sb.format_version < 2 {
            CounterState {
                counters: state.counters.clone().unwrap_or_default(),
                journal_seq: if format1_counters_lost {
                    last_seq
                } else {
                    state.journal_seq
                },
            }
        } else {
            let cpath = dir.path(MetaFile::Counters);
            let bytes = dir.blob_bytes(MetaFile::Counters, &chain_ops)?;
            let decoded = if bytes.is_empty() {
                Err(EngineError::Corrupt {
                    file: cpath.clone(),
                    detail: "missing or empty".into(),
                })
            } else {
                decode_checked::<CounterState>(&bytes, &cpath)
            };
            match decoded {
                Ok(c) => c,
                // statistics and a sequence number: a check goes on from
                // zero after the journal's chain (whose stale tail the first
                // commit cuts off), and its repair writes them anew
                Err(EngineError::Corrupt { .. }) if config.allow_damaged_metadata => {
                    counters_damage = Some(Damage {
                        file: cpath,
                        pages: Vec::new(),
                        missing: bytes.is_empty(),
                        truncated: None,
                        detail: Some(format!(
                            "{}; a repair writes it anew, and the statistics it holds \
                             restart at zero",
                            if bytes.is_empty() {
                                "missing or empty"
                            } else {
                                "fails its checksum or is malformed"
                            }
                        )),
                    });
                    CounterState {
                        counters: Default::default(),
                        journal_seq: last_seq,
                    }
                }
                Err(EngineError::Corrupt { file, detail }) => {
                    return Err(EngineError::Corrupt {
                        file,
                        detail: format!(
                            "{detail}; the store is not served. Run `dedupd --store {} fsck \
                             --repair` to write it anew (its counters restart at zero)",
                            crate::error::store_word(path)
                        ),
                    })
                }
                Err(e) => return Err(e),
            }
        };
        let next_seq = counter_state.journal_seq.max(last_seq) + 1;
        // the on-disk fingerprint store is derived data, rebuilt at every open
        let groups = dir.open_file("fpgroups", true)?;
        groups
            .set_len(0)
            .map_err(|e| EngineError::io("resetting the on-disk fingerprint store", e))?;
        let index = FingerprintIndex::new(
            crate::index::IndexConfig {
                prefix_bits: sb.index_prefix_bits,
                ..config.index
            },
            Box::new(FileGroupStore(groups)),
        );
        // the reverse index pages under its own budget; the volume maps and
        // reference counts share one
        let reverse_cache =
            CacheGroup::new(config.reverse_index_cache_bytes, OnLoadError::ReadAsZeros);
        let map_cache = CacheGroup::new(config.map_cache_bytes, OnLoadError::Fault);
        // a transaction that fails its checksum with an intact later one
        // behind it was damaged after its commit (only the last one written
        // can be torn): replaying the chain before it would lose the
        // commits from it on, and serve blocks they freed and reused
        let mut journal_damage = journal_missing.then(|| Damage {
            file: journal_path.clone(),
            pages: Vec::new(),
            missing: true,
            truncated: None,
            detail: None,
        });
        if counters_damage.is_none() && !format1_counters_lost && !journal_missing {
            // (past the next sequence number: a commit whose sync failed
            // may have left its transaction behind, and its retry reuses
            // the number; a crash tearing the retry is no damage)
            let later = journal::later_transaction(&jfile, chain_bytes, next_seq + 1)
                .map_err(|e| EngineError::io("reading the journal", e))?;
            if let Some(at) = later {
                if !config.allow_damaged_metadata {
                    return Err(EngineError::Corrupt {
                        file: journal_path,
                        detail: format!(
                            "the transaction at byte {chain_bytes} fails its checksum but an \
                             intact later one (at byte {at}) follows it: it was damaged after \
                             its commit, and the commits from it on cannot be replayed; the \
                             store is not served. Run `dedupd --store {} fsck --repair \
                             --rehash` to rebuild the store without them",
                            crate::error::store_word(path)
                        ),
                    });
                }
                journal_damage = Some(Damage {
                    file: journal_path.clone(),
                    pages: vec![chain_bytes / crate::paged::PAGE_SIZE as u64],
                    missing: false,
                    truncated: None,
                    detail: Some(format!(
                        "the transaction at byte {chain_bytes} fails its checksum and an intact \
                         later one (at byte {at}) follows: the commits from it on are lost \
                         (a repair needs --rehash)"
                    )),
                });
            }
        }
        let journal_intact = journal_damage.is_none();
        let mut damage: Vec<Damage> = state_damage
            .into_iter()
            .chain(counters_damage)
            .chain(journal_damage)
            .collect();
        let mut damage_notes: Vec<String> = Vec::new();
        if journal_intact {
            // the next transaction begun but not intact: taken as cut by a
            // crash while committing (so never acknowledged), which is what
            // it almost always is; said, as bit rot there loses a commit
            if let Some(len) = journal::cut_transaction_at(&jfile, chain_bytes, next_seq)
                .map_err(|e| EngineError::io("reading the journal", e))?
            {
                damage_notes.push(format!(
                    "the journal's last transaction (number {next_seq}, {len} bytes at byte \
                     {chain_bytes}) is cut short or fails its checksum: taken as a commit a \
                     crash interrupted, whose writes were never acknowledged, and not \
                     replayed. If the store did not stop while committing, this is damage, \
                     and the writes of that commit are lost"
                ));
            }
        }
        let mut ops_by_file: HashMap<MetaFile, Vec<&Op>> = HashMap::new();
        for op in &chain_ops {
            ops_by_file.entry(op.file()).or_default().push(op);
        }
        // a store holding data has reference counts and a reverse index on
        // file once a checkpoint put them there
        let data_bytes = std::fs::metadata(path.join("data")).map_or(0, |m| m.len());
        let unmarked_volumes: std::collections::HashSet<VolumeId> = state
            .volumes
            .iter()
            .filter(|r| !r.creation_marked)
            .map(|r| r.id)
            .collect();
        let load = |file: MetaFile,
                    group: &std::sync::Arc<CacheGroup>,
                    damage: &mut Vec<Damage>,
                    max_len: Option<u64>,
                    visit: &mut dyn FnMut(u64, &[u8])|
         -> Result<CachedArray> {
            let path = dir.path(file);
            let ops = ops_by_file.get(&file).map_or(&[][..], |v| &v[..]);
            // a file that should exist but does not is damage, and is not
            // created: the check of a store changes nothing. The reference
            // counts and reverse index exist once the store holds data
            // (created with the store, or by the first open, before any
            // data), whatever the journal holds: pages of them in the
            // journal over an empty file would free every other block. A
            // map may be missing only while the journal creates it (a
            // volume created since the last checkpoint, whose creation
            // journals the map cut to nothing first): changes to an
            // existing map over an empty file would read its other LBAs as
            // holes. A file the journal cuts to nothing (or removes) and
            // rebuilds whole (a repair) may be missing too. (A volume
            // created by an earlier version journaled no cut: its map may
            // be missing whenever the journal changes it.)
            let made_anew = ops
                .iter()
                .any(|op| matches!(op, Op::Remove { .. } | Op::SetLen { len_bytes: 0, .. }));
            let expected = match file {
                MetaFile::Map(id) if unmarked_volumes.contains(&id) => ops.is_empty(),
                MetaFile::Map(_) => !made_anew,
                _ => data_bytes > 0 && !made_anew,
            };
            if expected && !path.exists() {
                damage.push(Damage {
                    file: path,
                    pages: Vec::new(),
                    missing: true,
                    truncated: None,
                    detail: None,
                });
                return Ok(CachedArray::new(PagedArray::new(file.page_tag())));
            }
            // created if missing (a new store, or a volume created since the
            // last checkpoint); a file that cannot be created is replayed
            // in memory only
            let existed = path.exists();
            let f = match dir.open_file(&file.relative_path(), true) {
                Ok(f) => Some(f),
                Err(_) if !path.exists() => None,
                Err(e) => return Err(e),
            };
            if f.is_some() && !existed {
                // the new file's directory entry is durable before anything
                // (the data file growing, a commit) may depend on it
                let rel = file.relative_path();
                dir.observer()
                    .emit(crate::observe::IoEvent::Create { file: &rel });
                let parent = std::path::Path::new(&rel)
                    .parent()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                dir.sync_dir_observed(&parent)?;
            }
            let name = path.display().to_string();
            let opened = crate::metaopen::open_paged(f, file, ops, &name, group, max_len, visit)
                .map_err(|e| EngineError::io(format!("reading {name}"), e))?;
            if !opened.damaged.is_empty() {
                damage.push(Damage {
                    file: path,
                    pages: opened.damaged,
                    missing: false,
                    truncated: None,
                    detail: None,
                });
            }
            Ok(opened.array)
        };
        let mut meta = Meta {
            next_volume_id: state.next_volume_id,
            counters: counter_state.counters.clone(),
            counters_committed: counter_state.counters.clone(),
            refcounts: load(
                MetaFile::Refcounts,
                &map_cache,
                &mut damage,
                None,
                &mut |_, _| {},
            )?,
            skipped: crate::skipped::SkippedBuffer::new(config.skipped_buffer_bytes),
            map_cache: map_cache.clone(),
            reverse_cache: reverse_cache.clone(),
            ..Meta::empty(index)
        };
        // the reverse index is read once: the check of its pages also
        // collects the fingerprint index's pairs
        let mut index_pairs =
            meta.index_sorter(meta.refcounts.logical_len() / 4, dir.scratch_file());
        let fingerprints = load(
            MetaFile::Fingerprints,
            &reverse_cache,
            &mut damage,
            None,
            &mut |page, payload| meta.collect_index_pairs(&mut index_pairs, page, payload),
        )?;
        meta.fingerprints = crate::reverse::ReverseIndex::from_cached(fingerprints);
        // a damaged reference-count or reverse-index file stops the store
        // before the volume maps are read
        if !damage.is_empty() && !config.allow_damaged_metadata {
            let d = &damage[0];
            let what = if let Some(detail) = &d.detail {
                detail.clone()
            } else if d.missing {
                format!("the file is missing although the data file holds {data_bytes} bytes")
            } else {
                format!(
                    "{} page(s) fail their checksum (first: page {})",
                    d.pages.len(),
                    d.pages[0]
                )
            };
            return Err(EngineError::Corrupt {
                file: d.file.clone(),
                detail: format!(
                    "{what}; the store is not served. \
                     Run `dedupd --store {} fsck --repair` to rebuild it {}",
                    crate::error::store_word(path),
                    if d.file == dir.path(MetaFile::Fingerprints) {
                        "by fingerprinting the stored blocks again"
                    } else {
                        "from the volume maps"
                    }
                ),
            });
        }
        for rec in &state.volumes {
            // a volume of an earlier version whose map a checkpoint has put
            // in place (the file there, no journal change to it) takes the
            // rule of new ones: missing from now on, its map is lost
            let mut rec = rec.clone();
            if !rec.creation_marked
                && dir.path(MetaFile::Map(rec.id)).exists()
                && !ops_by_file.contains_key(&MetaFile::Map(rec.id))
            {
                rec.creation_marked = true;
                meta.state_dirty = true;
                meta.change_count += 1;
            }
            let mut mine = Vec::new();
            // (a length past what the volume's size needs is damage of
            // no consequence: the map is read as cut there)
            let map_len = crate::paged::disk_len(rec.size_bytes / BLOCK_SIZE_U64 * 8);
            let mut map = load(
                MetaFile::Map(rec.id),
                &map_cache,
                &mut mine,
                Some(map_len),
                &mut |_, _| {},
            )?;
            let damaged_pages = mine.first().map(|d| d.pages.clone()).unwrap_or_default();
            let map_missing = mine.first().is_some_and(|d| d.missing);
            // a map shorter than its volume (every creation and resize
            // journals the full length, so only damage makes one): the
            // LBAs past its end would read as unmapped with nothing said
            let want_pages = crate::paged::disk_len(rec.size_bytes / BLOCK_SIZE_U64 * 8)
                .div_ceil(crate::paged::PAGE_SIZE as u64);
            // (the length a map is given comes from the file as the last
            // checkpoint left it and the journal's cuts and extensions,
            // never from the pages the journal writes: those written past
            // a cut would extend the file over holes that read as unmapped)
            let sized_pages = ops_by_file
                .get(&MetaFile::Map(rec.id))
                .into_iter()
                .flatten()
                .fold(
                    std::fs::metadata(dir.path(MetaFile::Map(rec.id))).map_or(0, |m| m.len()),
                    |len, op| match op {
                        Op::SetLen { len_bytes, .. } => *len_bytes,
                        Op::Remove { .. } => 0,
                        _ => len,
                    },
                )
                .div_ceil(crate::paged::PAGE_SIZE as u64);
            let have_pages = map.page_count().min(sized_pages);
            let map_truncated_at = (!map_missing && have_pages < want_pages).then_some(have_pages);
            if let Some(have) = map_truncated_at {
                mine.push(Damage {
                    file: dir.path(MetaFile::Map(rec.id)),
                    pages: Vec::new(),
                    missing: false,
                    truncated: Some((have, want_pages)),
                    detail: None,
                });
                // the pages the journal holds past the cut go too (as they
                // go from the checkpoint below): their LBAs are lost with
                // the others, and nothing (a check, a repair, a merge)
                // counts or changes mappings there
                map.truncate(have * crate::paged::PAYLOAD_SIZE as u64);
            }
            damage.extend(mine);
            meta.insert_volume(Volume {
                record: rec.clone(),
                map,
                damaged_pages,
                map_missing,
                map_truncated_at,
                // (counted once every map is read: `rebuild_derived`)
                mapped_blocks: 0,
                // a delete cut short (crash, error, signal): finished by
                // deleting again, read-only meanwhile
                deleting: rec.deleting,
                deletes_running: 0,
                before_deletes: (false, false),
                shrinking_to: Vec::new(),
                shrinks_begun: 0,
                recent_shrinks: Default::default(),
            });
        }
        // a missing map's journaled pages are not written in place: a file
        // made of them alone would read its other LBAs as holes at the
        // next start with no damage said; the map stays missing until a
        // repair
        let lost_maps: Vec<VolumeId> = meta
            .volumes
            .iter()
            .filter(|(_, v)| v.map_missing)
            .map(|(id, _)| *id)
            .collect();
        // likewise a truncated map's journaled pages past its cut: written
        // there, they would extend the file over holes (the LBAs between
        // the cut and them) that the next start reads as never written
        let cut_maps: HashMap<VolumeId, u64> = meta
            .volumes
            .iter()
            .filter_map(|(id, v)| v.map_truncated_at.map(|page| (*id, page)))
            .collect();
        let mut chain_ops = chain_ops;
        if !lost_maps.is_empty() || !cut_maps.is_empty() {
            chain_ops.retain(|op| {
                let page = match op {
                    Op::Write { offset, .. } => offset / crate::paged::PAGE_SIZE as u64,
                    Op::Patch { offset, .. } => offset / crate::paged::PAYLOAD_SIZE as u64,
                    _ => 0,
                };
                match op.file() {
                    MetaFile::Map(id) if lost_maps.contains(&id) => false,
                    MetaFile::Map(id) => cut_maps.get(&id).is_none_or(|&cut| page < cut),
                    _ => true,
                }
            });
        }
        let mut checkpoint = CheckpointBuffer::default();
        checkpoint.add(chain_ops);
        // the skipped buffer saved at the last checkpoint, plus the LBAs of
        // every map page written since (the journal being replayed)
        match load_skipped(&dir) {
            Ok(Some(mut saved)) => {
                saved.set_capacity(config.skipped_buffer_bytes);
                // (checked again when applied: a stale one is skipped)
                meta.pending_merges.extend(
                    saved
                        .take_saved_merges()
                        .into_iter()
                        .take(crate::meta::MAX_PENDING_MERGES),
                );
                meta.skipped = saved;
            }
            Ok(None) => {}
            Err(why) => {
                damage_notes.push(format!(
                    "{why}; every volume is queued for out-of-line dedup"
                ));
                for id in meta.volumes.keys().copied().collect::<Vec<_>>() {
                    meta.skipped.record_volume(id);
                }
            }
        }
        let lbas_per_page = crate::paged::U64_PER_PAGE;
        for op in &checkpoint.ops {
            let (id, page) = match op {
                Op::Write {
                    file: MetaFile::Map(id),
                    offset,
                    ..
                } => (*id, offset / crate::paged::PAGE_SIZE as u64),
                Op::Patch {
                    file: MetaFile::Map(id),
                    offset,
                    ..
                } => (*id, offset / crate::paged::PAYLOAD_SIZE as u64),
                _ => continue,
            };
            meta.skipped
                .record_range(id, page * lbas_per_page, (page + 1) * lbas_per_page);
        }
        // Volumes that take the engine's T and ran under T > 1 had their
        // writes left out of the skipped buffer: under T = 1 they are
        // examined whole (where mapped). The store goes on recording the
        // old T until a checkpoint has saved that queue (see
        // `checkpoint_locked`): a crash before then queues them again here.
        if config.settings_from_store {
            config.sequence_threshold_blocks = state.default_sequence_threshold_blocks;
            config.verify = state.verify;
        }
        meta.verify = config.verify;
        if state.verify != config.verify {
            meta.state_dirty = true;
            meta.change_count += 1;
        }
        let (was_t, now_t) = (
            state.default_sequence_threshold_blocks.max(1),
            config.sequence_threshold_blocks.max(1),
        );
        meta.default_sequence_threshold_blocks = was_t;
        if was_t != now_t && now_t == 1 {
            let inheriting: Vec<VolumeId> = meta
                .volumes
                .iter()
                .filter(|(_, v)| v.record.sequence_threshold_blocks.is_none())
                .map(|(id, _)| *id)
                .collect();
            for id in inheriting {
                // (from the start: a queue loaded from the store may have
                // been saved by a run under T > 1, whose writes behind its
                // position were not recorded)
                meta.skipped.record_volume(id);
            }
        } else if was_t != now_t {
            meta.default_sequence_threshold_blocks = now_t;
            meta.state_dirty = true;
            meta.change_count += 1;
        }
        let data_path = dir.root().join("data");
        let data_blocks = match std::fs::metadata(&data_path) {
            // (whole blocks only: every write is of whole blocks, so a
            // partial last one is damage, its block lost)
            Ok(m) => Some(m.len() / BLOCK_SIZE_U64),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(EngineError::io("reading the data file size", e)),
        };
        let (data_missing, data_blocks) = (data_blocks.is_none(), data_blocks.unwrap_or(0));
        let references = match meta.rebuild_derived(data_blocks, IndexPairs::Collected(index_pairs))
        {
            Ok(references) => references,
            Err(e) => match EngineError::io("rebuilding the on-disk fingerprint store", e) {
                // a full file system: keep the on-disk groups in memory for
                // this run, so the store still opens and serves reads
                EngineError::NoSpace { .. } => {
                    let cfg = meta.index.config();
                    meta.index = FingerprintIndex::new(cfg, Box::new(MemoryGroupStore::default()));
                    let references = meta
                        .rebuild_derived(data_blocks, IndexPairs::Scan(None))
                        .map_err(|e| {
                            EngineError::io("rebuilding the fingerprint store in memory", e)
                        })?;
                    damage_notes.push(
                        "no space for the on-disk fingerprint store: it is kept in memory until the next start"
                            .to_string(),
                    );
                    references
                }
                other => return Err(other),
            },
        };
        // (a check of the store could not tell a data file gone, on a file
        // system not mounted say, from every block lost: it stops too)
        if data_missing && meta.high_water_blocks > 0 {
            return Err(EngineError::Corrupt {
                file: data_path,
                detail: format!(
                    "missing, while {} blocks are referenced; the store is not served, \
                     and fsck does not run without it: put the data file back",
                    meta.stored_blocks
                ),
            });
        }
        // Every LBA mapped holds one reference. Fewer references than
        // mapped LBAs (reference counts cut short or zeroed in place, which
        // no page checksum sees) would put blocks still mapped on the free
        // list, and the next writes would overwrite them: refused. More
        // (map entries lost the same way) only leak blocks: a warning.
        // (damaged maps, served read-only, only lower the mapped count: the
        // checks below hold with them)
        if !config.allow_damaged_metadata {
            // a committed reference is to data synced before the commit,
            // so it lies inside the data file: one past its end means the
            // file was cut short, and the free space below the reference
            // could not be told from the blocks lost
            if meta.high_water_blocks > data_blocks {
                return Err(EngineError::Corrupt {
                    file: data_path,
                    detail: format!(
                        "PBA {} is referenced but the data file holds {data_blocks} blocks \
                         (cut short?); the store is not served. Run `dedupd --store {} fsck` \
                         to list the LBAs that lost their data, and `fsck --repair` to unmap \
                         them",
                        meta.high_water_blocks - 1,
                        crate::error::store_word(path)
                    ),
                });
            }
            let mapped = meta.mapped_blocks;
            if references < mapped {
                return Err(EngineError::Corrupt {
                    file: dir.path(MetaFile::Refcounts),
                    detail: format!(
                        "the reference counts add up to {references} but the volume maps \
                         map {mapped} LBAs; the store is not served. Run `dedupd --store {} \
                         fsck --repair` to rebuild them from the volume maps",
                        crate::error::store_word(path)
                    ),
                });
            }
            if references > mapped && damage.is_empty() {
                damage_notes.push(format!(
                    "the reference counts add up to {references} but the volume maps map \
                     {mapped} LBAs: blocks are held that no LBA maps, leaked by a crash or \
                     held by map entries lost (a map page zeroed in place: then LBAs that \
                     held data read as zeros). `dedupd --store {} fsck` lists them; \
                     `fsck --repair` frees them for good (copy the store first if data may \
                     be missing)",
                    crate::error::store_word(path)
                ));
            }
        }
        let data_file = if data_missing && config.allow_damaged_metadata {
            // (nothing referenced; fsck creates nothing: an unlinked
            // stand-in, and the next start creates the file)
            dir.stand_in("data file")?
        } else {
            if data_missing {
                // nothing referenced: an empty data file, its entry durable
                dir.open_file("data", true)?;
                dir.observer()
                    .emit(crate::observe::IoEvent::Create { file: "data" });
                dir.sync_dir_observed("")?;
            }
            dir.open_file("data", false)?
        };
        let data = FileBackend::new(data_file).with_observer(config.observer.clone());
        // the scans above leave each array's last pages in memory
        meta.refcounts.trim();
        meta.fingerprints.trim();
        for v in meta.volumes.values() {
            v.map.trim();
        }
        let mut journal = Journal::new(jfile, chain_bytes, next_seq)
            .map_err(|e| EngineError::io("reading the journal's length", e))?
            .with_replayed_chain(replayed)
            .with_observer(config.observer.clone());
        // best effort: without the reserve the store still works (what an
        // earlier start reserved beyond it stays: see
        // `Engine::fit_journal_reserve`)
        if let Err(e) = journal.reserve(config.journal_reserve_bytes) {
            damage_notes.push(reserve_note(&journal, config.journal_reserve_bytes, &e));
        }
        let chain_pending = journal.replayed_chain_bytes() > 0;
        let mut engine = Engine::assemble(sb.hash, Box::new(data), meta, Some(journal), config);
        engine
            .replayed_chain_pending
            .store(chain_pending, Ordering::Relaxed);
        engine
            .replayed_frees_unknown
            .store(chain_pending, Ordering::Relaxed);
        engine.dir = Some(dir);
        engine.damage = damage;
        // volume operations a crash (or an error) cut short: said at every
        // open until finished, with the command that finishes them
        damage_notes.extend(unfinished_volume_notes(&engine));
        let lost_list = path.join(crate::fsck::DATA_LOST_FILE);
        if lost_list.exists() {
            damage_notes.push(format!(
                "an earlier `fsck --repair` discarded data: the list is in {} (delete it once read)",
                lost_list.display()
            ));
        }
        engine.notes = damage_notes;
        let c = engine.commit.get_mut().unwrap_or_else(|e| e.into_inner());
        c.checkpoint = checkpoint;
        c.format_upgrade =
            (sb.format_version < crate::store::FORMAT_VERSION).then_some((sb, counter_state));
        Ok(engine)
    }

    /// Creates the journal file of a store opened without one (a repair:
    /// the open used an unlinked stand-in) under a temporary name, and
    /// commits through it from now on; its directory entry is made durable
    /// when [`Engine::journal_repaired_in_place`] renames it.
    ///
    /// Errors: [`EngineError::Io`] creating it.
    pub(crate) fn create_missing_journal(&self) -> Result<()> {
        let Some(dir) = self.dir.as_ref() else {
            return Ok(());
        };
        // made under another name, which the repair's first commit puts in
        // place (`journal_repaired_in_place`): a crash before it leaves the
        // journal missing, and the store refused, not an empty journal
        // that lets it be served without the repair
        let path = dir.root().join(REPAIR_JOURNAL_FILE);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(EngineError::io(format!("removing {}", path.display()), e))
            }
            _ => {}
        }
        let file = dir.open_file(REPAIR_JOURNAL_FILE, true)?;
        let mut c = lock(&self.commit);
        let next_seq = c.journal.as_ref().map_or(1, |j| j.next_seq());
        let journal = Journal::new(file, 0, next_seq)
            .map_err(|e| EngineError::io("reading the journal's length", e))?
            .with_observer(dir.observer());
        c.journal = Some(journal);
        Ok(())
    }

    /// Puts the journal [`Engine::create_missing_journal`] made in place,
    /// once the repair it carries is committed to it.
    ///
    /// Errors: the rename or the directory's sync.
    pub(crate) fn journal_repaired_in_place(&self) -> Result<()> {
        let Some(dir) = self.dir.as_ref() else {
            return Ok(());
        };
        let (from, to) = (
            dir.root().join(REPAIR_JOURNAL_FILE),
            dir.root().join("journal"),
        );
        std::fs::rename(&from, &to).map_err(|e| {
            EngineError::io(
                format!("renaming {} to {}", from.display(), to.display()),
                e,
            )
        })?;
        crate::store::sync_dir(dir.root())
    }

    /// The parts every constructor shares; no store directory, no damage.
    fn assemble(
        hash: HashAlgorithm,
        backend: Box<dyn BlockBackend>,
        meta: Meta,
        journal: Option<Journal>,
        config: EngineConfig,
    ) -> Engine {
        let map_cache = meta.map_cache.clone();
        let reverse_cache = meta.reverse_cache.clone();
        Engine {
            dir: None,
            damage: Vec::new(),
            notes: Vec::new(),
            hash,
            backend,
            meta: Mutex::new(meta),
            reuse: RwLock::new(()),
            commit: Mutex::new(CommitState {
                journal,
                checkpoint: CheckpointBuffer::default(),
                durable_changes: 0,
                checkpoint_bytes_written: 0,
                format_upgrade: None,
            }),
            rmw: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            commit_wanted: AtomicBool::new(false),
            replayed_chain_pending: AtomicBool::new(false),
            replayed_frees_unknown: AtomicBool::new(false),
            over_commit_bound: AtomicBool::new(false),
            checkpoint_behind: AtomicBool::new(false),
            no_close_on_drop: AtomicBool::new(false),
            map_cache,
            reverse_cache,
            cache: crate::cache::ReadCache::new(config.read_cache_bytes),
            selectivity: crate::selectivity::Selectivity::new(config.selectivity),
            caftl: Mutex::new(crate::caftl::PrehashTable::new(config.prehash_bytes)),
            out_of_line: Mutex::new(crate::outofline::OutOfLineStats::default()),
            merge_scan: Mutex::new(None),
            merge_scan_bytes: AtomicU64::new(0),
            no_space_commits: AtomicU64::new(0),
            foreground: AtomicU64::new(0),
            offline_pass_running: AtomicBool::new(false),
            offline_pass_stop: AtomicBool::new(false),
            config,
        }
    }

    /// An engine whose data and metadata live only in memory (tests,
    /// simulation); FLUSH only recycles freed blocks.
    pub fn in_memory(hash: HashAlgorithm) -> Engine {
        Engine::in_memory_with(hash, EngineConfig::default())
    }

    /// [`Engine::in_memory`] with a configuration (index budget, policy,
    /// lookup mode, prefix bits, verify).
    pub fn in_memory_with(hash: HashAlgorithm, config: EngineConfig) -> Engine {
        let index = FingerprintIndex::new(config.index, Box::new(MemoryGroupStore::default()));
        let meta = Meta {
            next_volume_id: 1,
            default_sequence_threshold_blocks: config.sequence_threshold_blocks,
            verify: config.verify,
            skipped: crate::skipped::SkippedBuffer::new(config.skipped_buffer_bytes),
            ..Meta::empty(index)
        };
        Engine::assemble(hash, Box::new(MemoryBackend::default()), meta, None, config)
    }

    /// An engine that keeps metadata in memory and stores no block data
    /// (the null backend of the simulator): reads return zeros. Replaying a
    /// trace through it measures the real dedup logic. The on-disk
    /// fingerprint store is kept in memory; its I/O is counted, not done.
    pub fn simulated(hash: HashAlgorithm) -> Engine {
        Engine::simulated_with(hash, EngineConfig::default())
    }

    /// [`Engine::simulated`] with a configuration.
    pub fn simulated_with(hash: HashAlgorithm, config: EngineConfig) -> Engine {
        let mut e = Engine::in_memory_with(hash, config);
        e.backend = Box::new(NullBackend);
        e
    }

    /// An in-memory engine over a caller's block backend (fault-injection
    /// tests wrap [`MemoryBackend`] to fail chosen reads and writes).
    pub fn in_memory_over(
        hash: HashAlgorithm,
        config: EngineConfig,
        backend: Box<dyn BlockBackend>,
    ) -> Engine {
        let mut e = Engine::in_memory_with(hash, config);
        e.backend = backend;
        e
    }

    /// The store's fingerprint algorithm.
    pub fn hash_algorithm(&self) -> HashAlgorithm {
        self.hash
    }

    /// The store directory (None for an in-memory engine).
    pub fn path(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.root())
    }

    // ---- volumes ---------------------------------------------------------

    /// Every volume, ordered by id, with its mapped bytes (kept as LBAs are
    /// mapped and unmapped: no map is read).
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        let m = lock(&self.meta);
        m.volumes
            .values()
            .map(|v| VolumeInfo {
                id: v.record.id,
                name: v.record.name.clone(),
                size_bytes: v.record.size_bytes,
                mapped_bytes: v.mapped_blocks * BLOCK_SIZE_U64,
                read_only: v.read_only(),
                deleting: v.deleting,
                sequence_threshold_blocks: v.record.sequence_threshold_blocks,
                shrinking_to_bytes: v.record.shrinking_to_bytes,
            })
            .collect()
    }

    /// Every volume's name and size in bytes, ordered by id: what NBD
    /// export listing and name resolution need, without reading any map.
    pub fn volume_names(&self) -> Vec<(String, u64)> {
        let m = lock(&self.meta);
        m.volumes
            .values()
            .map(|v| (v.record.name.clone(), v.record.size_bytes))
            .collect()
    }

    /// Looks a volume up by name: (id, size in bytes).
    pub fn volume(&self, name: &str) -> Option<(VolumeId, u64)> {
        let m = lock(&self.meta);
        let id = m.volume_named(name)?;
        m.volumes.get(&id).map(|v| (id, v.record.size_bytes))
    }

    /// Size in bytes of volume `id`, or `None` if it no longer exists.
    pub fn volume_size(&self, id: VolumeId) -> Option<u64> {
        lock(&self.meta)
            .volumes
            .get(&id)
            .map(|v| v.record.size_bytes)
    }

    /// Creates a volume of `size_bytes` (a positive multiple of 4096; may
    /// exceed the physical space: thin provisioning) and makes it durable
    /// (an engine in memory commits it with its next flush instead).
    /// Names are 1–64 characters of `A-Za-z0-9._-`.
    ///
    /// Errors: [`EngineError::InvalidArgument`] (name, size),
    /// [`EngineError::VolumeExists`]; [`EngineError::DataSyncFailed`] and
    /// [`EngineError::MetadataUnreadable`] (no commit could record it:
    /// nothing is created); the commit's errors, after which the
    /// volume exists all the same, not yet durable (the next successful
    /// commit makes it so; a retry finds it existing).
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeId> {
        validate_name(name)?;
        validate_size(size_bytes)?;
        let id = {
            let mut m = lock(&self.meta);
            if m.volume_named(name).is_some() {
                return Err(EngineError::VolumeExists(name.into()));
            }
            // (no commit can succeed: see `resize_volume_with_progress`)
            fault_check(&m)?;
            let id = VolumeId(m.next_volume_id);
            m.next_volume_id += 1;
            m.insert_volume(Volume {
                record: VolumeRecord {
                    id,
                    name: name.into(),
                    size_bytes,
                    sequence_threshold_blocks: None,
                    deleting: false,
                    shrinking_to_bytes: None,
                    creation_marked: true,
                },
                map: CachedArray::new(PagedArray::new(MetaFile::Map(id).page_tag())),
                damaged_pages: Vec::new(),
                map_missing: false,
                map_truncated_at: None,
                mapped_blocks: 0,
                deleting: false,
                deletes_running: 0,
                before_deletes: (false, false),
                shrinking_to: Vec::new(),
                shrinks_begun: 0,
                recent_shrinks: Default::default(),
            });
            // the map cut to nothing marks it as created here: until a
            // checkpoint writes it, its file may be missing (see `open`).
            // (A cut, not a removal: a file opened after a crash and paged
            // from stays the file the checkpoint writes.)
            m.structural_ops.push(Op::SetLen {
                file: MetaFile::Map(id),
                len_bytes: 0,
            });
            m.structural_ops.push(Op::SetLen {
                file: MetaFile::Map(id),
                len_bytes: crate::paged::disk_len(size_bytes / BLOCK_SIZE_U64 * 8),
            });
            m.state_dirty = true;
            m.change_count += 1;
            id
        };
        // a store makes the creation durable at once; an engine in memory
        // (a replay, which creates a volume per stream) leaves it to its
        // next commit, so creating many costs no commit each
        if self.dir.is_some() {
            self.flush()?;
        }
        Ok(id)
    }

    /// Deletes a volume, releasing every block it maps, and makes it durable.
    ///
    /// The blocks are released in pieces of [`RELEASE_PIECE_BLOCKS`] LBAs
    /// (at most 1024 mapped ones each), committing as changed metadata
    /// passes `max_dirty_bytes`, so memory
    /// and the time the metadata lock is held do not grow with the volume;
    /// writes to the volume are refused meanwhile. The delete is recorded
    /// durably before the first block is released: a crash, an error or a
    /// stop part way leaves the volume read-only with some of its blocks
    /// released (consistent: each commit unmaps LBAs and releases their
    /// blocks together), listed as being deleted; deleting it again
    /// finishes.
    ///
    /// A volume whose map is damaged is deleted too; the blocks its lost
    /// map entries referenced stay allocated until `dedupd fsck --repair`
    /// (said in the returned [`VolumeDeleted`]).
    ///
    /// Errors: [`EngineError::NoSuchVolume`]; I/O errors of the commits.
    pub fn delete_volume(&self, name: &str) -> Result<VolumeDeleted> {
        self.delete_volume_with_progress(name, &mut |_, _| {})
    }

    /// [`Engine::delete_volume`], calling `progress(done, all)` after each
    /// piece, in LBAs of the volume (unmapped stretches count as done when
    /// passed over).
    ///
    /// Errors: as [`Engine::delete_volume`].
    pub fn delete_volume_with_progress(
        &self,
        name: &str,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<VolumeDeleted> {
        let (id, size_blocks, map_damaged) = {
            let mut m = lock(&self.meta);
            let id = volume_id(&m, name)?;
            let v = m.volumes.get_mut(&id).expect("looked up above");
            let map_damaged =
                v.map_missing || v.map_truncated_at.is_some() || !v.damaged_pages.is_empty();
            if v.deletes_running == 0 {
                v.before_deletes = (v.deleting, v.record.deleting);
            }
            v.deleting = true;
            v.deletes_running += 1;
            let size_blocks = v.size_blocks();
            if !v.record.deleting {
                v.record.deleting = true;
                m.state_dirty = true;
                m.change_count += 1;
            }
            (id, size_blocks, map_damaged)
        };
        // durable before any block is released: a volume cut short is never
        // served writable again
        if let Err(e) = self.flush() {
            // (nothing released by this call: the volume goes back to what
            // it was, still marked if a delete began before, or another
            // runs)
            let mut m = lock(&self.meta);
            let mut restored = false;
            if let Some(v) = m.volumes.get_mut(&id) {
                v.deletes_running -= 1;
                if v.deletes_running == 0 {
                    (v.deleting, v.record.deleting) = v.before_deletes;
                    restored = true;
                }
            }
            if restored {
                // (a commit meanwhile may have carried the mark: the table
                // is written again without it)
                m.state_dirty = true;
                m.change_count += 1;
            }
            return Err(e);
        }
        // (on an error the volume stays marked, read-only, to be deleted
        // again)
        self.release_range(id, 0, size_blocks, progress)?;
        let mut m = lock(&self.meta);
        // nothing is left mapped: since the mark, writes are refused before
        // they map anything (`place_blocks` turns back those admitted
        // before it), and the out-of-line passes only move LBAs that are
        // mapped
        #[cfg(debug_assertions)]
        if let Some(v) = m.volumes.get(&id) {
            let mut left = 0u64;
            v.map
                .for_each_nonzero_u64(0..v.size_blocks(), |_, _| left += 1);
            debug_assert_eq!(left, 0, "LBAs mapped behind a delete's release");
        }
        m.remove_volume(id);
        m.skipped.forget(id);
        m.sequences.forget(id);
        m.structural_ops.push(Op::Remove {
            file: MetaFile::Map(id),
        });
        m.state_dirty = true;
        m.change_count += 1;
        drop(m);
        self.flush()?;
        Ok(VolumeDeleted { map_damaged })
    }

    /// Unmaps LBAs `first..end` of volume `vol` in pieces, each under the
    /// metadata lock, committing between pieces as needed (see
    /// [`Engine::note_change`]); `progress(done, all)` counts LBAs from
    /// `first`.
    fn release_range(
        &self,
        vol: VolumeId,
        first: u64,
        end: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        const PER_PAGE: u64 = crate::paged::U64_PER_PAGE;
        let mut lba = first;
        while lba < end {
            let piece_end;
            {
                let mut m = lock(&self.meta);
                fault_check(&m)?;
                let Some(v) = m.volumes.get(&vol) else {
                    return Ok(());
                };
                // unmapped stretches (map holes) are passed over at once
                match v
                    .map
                    .next_present_page(lba / PER_PAGE, end.div_ceil(PER_PAGE))
                {
                    Some(page) => lba = lba.max(page * PER_PAGE),
                    None => break,
                }
                let mapped;
                (mapped, piece_end) = release_piece(v, lba, (lba + RELEASE_PIECE_BLOCKS).min(end));
                for (l, _) in mapped {
                    m.remap(vol, Lba(l), None);
                }
                self.note_change(&m);
            }
            self.after_write(false)?;
            lba = piece_end;
            progress(lba - first, end - first);
        }
        progress(end - first, end - first);
        Ok(())
    }

    /// Changes a volume's size (a positive multiple of 4096); shrinking
    /// releases the blocks past the new end, in pieces (see
    /// [`Engine::delete_volume`]). Durable on return.
    ///
    /// Errors: [`EngineError::InvalidArgument`] for a size that is not a
    /// positive multiple of 4096 or is over 1 PiB;
    /// [`EngineError::NoSuchVolume`]; [`EngineError::VolumeDeleting`];
    /// [`EngineError::ReadOnly`] (a damaged map); [`EngineError::DataSyncFailed`]
    /// and [`EngineError::MetadataUnreadable`] (nothing changed); I/O
    /// errors of the commits.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<()> {
        self.resize_volume_with_progress(name, size_bytes, &mut |_, _| {})
    }

    /// [`Engine::resize_volume`], calling `progress(done, all)` after each
    /// piece of a shrink, in LBAs past the new end.
    ///
    /// Errors: as [`Engine::resize_volume`].
    pub fn resize_volume_with_progress(
        &self,
        name: &str,
        size_bytes: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        validate_size(size_bytes)?;
        let new_blocks = size_bytes / BLOCK_SIZE_U64;
        let (id, old_blocks, mark_before) = {
            let mut m = lock(&self.meta);
            let id = volume_id(&m, name)?;
            // (after a failed data sync or an unreadable metadata page no
            // commit can succeed: a change made only in memory would be
            // shown, and lost at restart)
            fault_check(&m)?;
            if m.volumes[&id].deleting {
                return Err(EngineError::VolumeDeleting(name.into()));
            }
            // a damaged map given a new length would hide the damage (a
            // missing map made anew, a truncated one grown past its cut)
            if m.volumes[&id].read_only() {
                return Err(self.read_only_error(&m.volumes[&id]));
            }
            let v = m.volumes.get_mut(&id).expect("looked up above");
            // (a resize meanwhile would be undone when the shrink sets the
            // size it was asked for)
            if let Some(&to) = v.shrinking_to.iter().min() {
                return Err(EngineError::VolumeShrinking {
                    name: name.into(),
                    to_bytes: to * BLOCK_SIZE_U64,
                });
            }
            let old_blocks = v.size_blocks();
            let mark_before = v.record.shrinking_to_bytes;
            // shrinking: no LBA past the new end is written from now on
            // (in this critical section, so a grow meanwhile cannot let
            // one be), and the shrink is marked in the volume table
            if new_blocks < old_blocks {
                v.begin_shrink(new_blocks);
                if mark_before.is_none_or(|b| b > size_bytes) {
                    v.record.shrinking_to_bytes = Some(size_bytes);
                    m.state_dirty = true;
                    m.change_count += 1;
                }
            }
            (id, old_blocks, mark_before)
        };
        // the blocks past the new end are released in pieces first (as
        // delete_volume does), then the size changes
        let shrinking = new_blocks < old_blocks;
        if shrinking {
            // the mark durable before any block is released: a shrink cut
            // short never lets the LBAs past it be written again unnoticed
            if let Err(e) = self.flush() {
                let mut m = lock(&self.meta);
                if let Some(v) = m.volumes.get_mut(&id) {
                    v.end_shrink(new_blocks);
                    // the mark as it was, or as another shrink running
                    // meanwhile set it (never lifted from under one)
                    let running = v.shrinking_to.iter().min().map(|&b| b * BLOCK_SIZE_U64);
                    let mark = match (mark_before, running) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    if v.record.shrinking_to_bytes != mark {
                        v.record.shrinking_to_bytes = mark;
                        m.state_dirty = true;
                        m.change_count += 1;
                    }
                }
                return Err(e);
            }
            // (on an error the mark stays: the volume is written only
            // below the new end until a resize finishes the shrink)
            self.release_range(id, new_blocks, old_blocks, progress)
                .inspect_err(|_| {
                    if let Some(v) = lock(&self.meta).volumes.get_mut(&id) {
                        v.end_shrink(new_blocks);
                    }
                })?;
        }
        {
            let mut m = lock(&self.meta);
            if shrinking {
                if let Some(v) = m.volumes.get_mut(&id) {
                    v.end_shrink(new_blocks);
                }
            }
            // the volume released above, not another one that took its name
            // meanwhile (deleted and created again)
            let Some(v) = m.volumes.get(&id).filter(|v| !v.deleting) else {
                return Err(EngineError::NoSuchVolume(name.into()));
            };
            if v.read_only() {
                return Err(self.read_only_error(v));
            }
            if !shrinking && v.size_blocks() > new_blocks {
                // grown past this size meanwhile: a shrink after all, with
                // its release of blocks
                drop(m);
                return self.resize_volume_with_progress(name, size_bytes, progress);
            }
            // nothing is mapped past the new end: it was released above,
            // and since then nothing there was written (`shrinking_to`)
            #[cfg(debug_assertions)]
            {
                let mut left = 0u64;
                v.map
                    .for_each_nonzero_u64(new_blocks..v.size_blocks().max(new_blocks), |_, _| {
                        left += 1
                    });
                debug_assert_eq!(left, 0, "LBAs mapped behind a shrink's release");
            }
            m.sequences.forget(id);
            let v = m.volumes.get_mut(&id).expect("looked up above");
            let old_blocks = v.size_blocks();
            v.record.size_bytes = size_bytes;
            // done, or undone by a resize after one cut short (other
            // shrinks running keep theirs)
            v.record.shrinking_to_bytes = v.shrinking_to.iter().min().map(|&b| b * BLOCK_SIZE_U64);
            if new_blocks > old_blocks {
                // a grow: the map is cut at the old end first, in memory
                // (the last page's tail) and on file (pages a map longer
                // than its volume kept past it, read as cut at open), so
                // the grown LBAs read as unmapped now and after a restart
                v.map.truncate(old_blocks * 8);
                m.structural_ops.push(Op::SetLen {
                    file: MetaFile::Map(id),
                    len_bytes: crate::paged::disk_len(old_blocks * 8),
                });
            }
            let v = m.volumes.get_mut(&id).expect("looked up above");
            v.map.truncate(new_blocks * 8);
            m.structural_ops.push(Op::SetLen {
                file: MetaFile::Map(id),
                len_bytes: crate::paged::disk_len(new_blocks * 8),
            });
            m.state_dirty = true;
            m.change_count += 1;
        }
        self.flush()
    }

    /// Renames volume `name` to `new_name` (also its NBD export name; open
    /// connections keep their volume). Durable on return.
    ///
    /// Errors: [`EngineError::NoSuchVolume`];
    /// [`EngineError::VolumeDeleting`]; [`EngineError::VolumeExists`];
    /// [`EngineError::InvalidArgument`] for an invalid new name;
    /// [`EngineError::DataSyncFailed`] and [`EngineError::MetadataUnreadable`]
    /// (nothing changed); the commit's, after which the new name is in
    /// effect all the same, not yet durable (as [`Engine::create_volume`]).
    pub fn rename_volume(&self, name: &str, new_name: &str) -> Result<()> {
        validate_name(new_name)?;
        {
            let mut m = lock(&self.meta);
            let id = volume_id(&m, name)?;
            if m.volumes[&id].deleting {
                return Err(EngineError::VolumeDeleting(name.into()));
            }
            fault_check(&m)?;
            if name == new_name {
                return Ok(());
            }
            if m.volume_named(new_name).is_some() {
                return Err(EngineError::VolumeExists(new_name.into()));
            }
            m.volume_names.remove(name);
            m.volume_names.insert(new_name.into(), id);
            m.volumes.get_mut(&id).expect("looked up above").record.name = new_name.into();
            m.state_dirty = true;
            m.change_count += 1;
        }
        if self.dir.is_some() {
            self.flush()?;
        }
        Ok(())
    }

    /// Sets a volume's sequence threshold T in blocks (iDedup; SmartDedup
    /// §4.5), or with `None` returns it to the engine's default. Durable on
    /// return.
    ///
    /// Errors: [`EngineError::NoSuchVolume`]; [`EngineError::VolumeDeleting`];
    /// [`EngineError::InvalidArgument`] for T = 0 or T > 65536;
    /// [`EngineError::DataSyncFailed`] and [`EngineError::MetadataUnreadable`]
    /// (nothing changed); the commit's.
    pub fn set_sequence_threshold(&self, name: &str, threshold_blocks: Option<u32>) -> Result<()> {
        if let Some(t) = threshold_blocks {
            if !(1..=65536).contains(&t) {
                return Err(EngineError::InvalidArgument(format!(
                    "sequence threshold {t} blocks: must be 1 to 65536"
                )));
            }
        }
        // (held until the queue is saved: no commit can carry the new T
        // before it, nor a checkpoint write the same file meanwhile)
        let commit = lock(&self.commit);
        let (id, old_record, queued) = {
            let mut m = lock(&self.meta);
            let id = volume_id(&m, name)?;
            if m.volumes[&id].deleting {
                return Err(EngineError::VolumeDeleting(name.into()));
            }
            fault_check(&m)?;
            m.sequences.forget(id);
            let default_t = self.config.sequence_threshold_blocks;
            let v = m.volumes.get_mut(&id).expect("looked up above");
            // (a volume that took the engine's T may have run under a
            // server with another: this engine's tells nothing of it)
            let old_record = v.record.sequence_threshold_blocks;
            let inherited = old_record.is_none();
            let was = old_record.unwrap_or(default_t);
            v.record.sequence_threshold_blocks = threshold_blocks;
            let lowered_to_one = threshold_blocks.unwrap_or(default_t) <= 1;
            let queued = lowered_to_one && (was > 1 || inherited && threshold_blocks.is_some());
            if queued {
                // its writes under T > 1 were not recorded for the
                // background pass: it examines the volume whole (where
                // mapped) instead
                m.skipped.record_volume(id);
            }
            m.state_dirty = true;
            m.change_count += 1;
            (id, old_record, queued)
        };
        // the queue is saved before the new T is committed: a crash between
        // the two would leave T lowered with nothing queued, and the copies
        // stored apart under the old T would never be examined (a queue
        // saved under the old T is harmless: its pass skips them again)
        if queued && !self.save_skipped() {
            let mut m = lock(&self.meta);
            if let Some(v) = m.volumes.get_mut(&id) {
                v.record.sequence_threshold_blocks = old_record;
            }
            drop(m);
            drop(commit);
            return Err(EngineError::io(
                format!("saving {SKIPPED_FILE} before lowering the sequence threshold of {name}"),
                std::io::Error::other("the write failed; the threshold is unchanged"),
            ));
        }
        drop(commit);
        self.flush()
    }

    // ---- I/O -------------------------------------------------------------

    /// Metadata pages that failed their checksums when the store was opened.
    pub fn damage(&self) -> &[Damage] {
        &self.damage
    }

    /// Why `v` (read-only) refuses a change: a delete not finished
    /// ([`EngineError::VolumeDeleting`]) or damaged metadata
    /// ([`EngineError::ReadOnly`], naming the repair for this store).
    fn read_only_error(&self, v: &crate::meta::Volume) -> EngineError {
        if v.deleting {
            return EngineError::VolumeDeleting(v.record.name.clone());
        }
        let fsck_command = match &self.dir {
            Some(dir) => format!(
                "dedupd --store {} fsck --repair",
                crate::error::store_word(dir.root())
            ),
            None => "dedupd fsck --repair".to_string(),
        };
        EngineError::ReadOnly {
            volume: v.record.name.clone(),
            fsck_command,
        }
    }

    /// Saves a copy of the skipped buffer taken now to
    /// `<store>/skipped.json`, durably (write, fsync, rename, fsync of the
    /// directory); see [`crate::skipped`] for what this guarantees. Best
    /// effort: a failure is counted (and false returned), and a full pass
    /// finds the same duplicates.
    fn save_skipped(&self) -> bool {
        let Some(dir) = &self.dir else { return true };
        let (mut snapshot, merges) = {
            let m = lock(&self.meta);
            let merges: Vec<(u64, u64)> = m.pending_merges.iter().map(|(a, b)| (*a, *b)).collect();
            let mut snapshot = m.skipped.clone();
            // (records a running pass took and has not examined yet)
            for &(vol, lba) in &m.skipped_in_flight {
                snapshot.record(vol, lba);
            }
            (snapshot, merges)
        };
        let nothing_pending = snapshot.is_empty() && merges.is_empty();
        snapshot.set_saved_merges(merges);
        let path = dir.root().join(SKIPPED_FILE);
        let result = if nothing_pending {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        } else {
            let tmp = dir.root().join(format!("{SKIPPED_FILE}.tmp"));
            // (written as it is encoded: the buffer's copy is the only one)
            std::fs::File::create(&tmp)
                .and_then(|f| {
                    let mut w = std::io::BufWriter::with_capacity(1 << 16, f);
                    crate::store::write_checked_compact(&snapshot, &mut w)?;
                    w.into_inner().map_err(|e| e.into_error())?.sync_all()
                })
                .and_then(|()| std::fs::rename(&tmp, &path))
        }
        .and_then(|()| std::fs::File::open(dir.root())?.sync_all());
        if result.is_err() {
            let mut m = lock(&self.meta);
            m.counters.skipped_save_errors += 1;
            m.change_count += 1;
        }
        result.is_ok()
    }

    /// Conditions found when the store was opened that an operator should
    /// know about (e.g. no space for the on-disk fingerprint store).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// True if volume `id` is served read-only (damaged metadata).
    pub fn volume_read_only(&self, id: VolumeId) -> bool {
        lock(&self.meta)
            .volumes
            .get(&id)
            .is_some_and(|v| v.read_only())
    }

    /// Client requests started so far (reads, writes, trims).
    pub fn foreground_ops(&self) -> u64 {
        self.foreground.load(Ordering::Relaxed)
    }

    /// One metadata lock: the volume exists, is writable, and the range is inside it.
    fn check_write(&self, vol: VolumeId, offset: u64, len: u64) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        self.enforce_bounds()?;
        // (a write may take a block the replayed chain released: had the
        // chain not reached the disk, a crash would leave its old maps
        // pointing at the new data)
        self.make_replayed_chain_durable()?;
        let m = lock(&self.meta);
        let v = m
            .volumes
            .get(&vol)
            .ok_or_else(|| EngineError::NoSuchVolume(format!("#{}", vol.0)))?;
        // (past the new end of a shrink under way: as past the end)
        let size_bytes = v.writable_blocks() * BLOCK_SIZE_U64;
        if offset.checked_add(len).is_none_or(|end| end > size_bytes) {
            return Err(EngineError::OutOfRange {
                offset,
                len,
                size_bytes,
            });
        }
        if v.read_only() {
            return Err(self.read_only_error(v));
        }
        fault_check(&m)
    }

    fn check_range(&self, vol: VolumeId, offset: u64, len: u64) -> Result<()> {
        let size_bytes = self
            .volume_size(vol)
            .ok_or_else(|| EngineError::NoSuchVolume(format!("#{}", vol.0)))?;
        if offset.checked_add(len).is_none_or(|end| end > size_bytes) {
            return Err(EngineError::OutOfRange {
                offset,
                len,
                size_bytes,
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes of volume `vol` at byte `offset`. Unmapped
    /// and zero blocks read as zeros without I/O. Each 4 KiB block reads
    /// as it was at one instant (a write racing the read shows per block,
    /// as a client sending them together must expect); partial blocks at
    /// the edges of an unaligned read go through 4 KiB of scratch, so
    /// memory stays `buf` whatever the read's size.
    ///
    /// Errors: [`EngineError::OutOfRange`], [`EngineError::NoSuchVolume`];
    /// [`EngineError::MappingLost`] if an LBA's mapping was lost to
    /// damaged metadata (not read as zeros); I/O errors of the data file;
    /// [`EngineError::MetadataUnreadable`].
    pub fn read(&self, vol: VolumeId, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        self.check_range(vol, offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        // whole blocks go straight into `buf`; a partial block at either
        // edge through one block of scratch (no copy of the whole span)
        let mut lba = offset / BLOCK_SIZE_U64;
        let mut done = 0;
        let head_skip = (offset % BLOCK_SIZE_U64) as usize;
        if head_skip != 0 || buf.len() < BLOCK_SIZE {
            let mut block = [0u8; BLOCK_SIZE];
            self.read_blocks(vol, lba, &mut block)?;
            done = (BLOCK_SIZE - head_skip).min(buf.len());
            buf[..done].copy_from_slice(&block[head_skip..head_skip + done]);
            lba += 1;
        }
        let whole = (buf.len() - done) / BLOCK_SIZE * BLOCK_SIZE;
        if whole > 0 {
            self.read_blocks(vol, lba, &mut buf[done..done + whole])?;
            done += whole;
            lba += (whole / BLOCK_SIZE) as u64;
        }
        if done < buf.len() {
            let mut block = [0u8; BLOCK_SIZE];
            self.read_blocks(vol, lba, &mut block)?;
            let tail = buf.len() - done;
            buf[done..].copy_from_slice(&block[..tail]);
        }
        Ok(())
    }

    /// Reads whole blocks starting at `first` into `buf` (multiple of 4 KiB).
    fn read_blocks(&self, vol: VolumeId, first: u64, buf: &mut [u8]) -> Result<()> {
        self.read_mapped(vol, first, buf).map(|_| ())
    }

    /// [`Engine::read_blocks`] that also tells what it read: the mapping of
    /// the first block and the reuse epoch, as of the read (see
    /// [`Expect`]).
    fn read_mapped(&self, vol: VolumeId, first: u64, buf: &mut [u8]) -> Result<Expect> {
        let _guard = self.reuse.read().unwrap_or_else(|e| e.into_inner());
        self.read_mapped_guarded(vol, first, buf)
    }

    /// [`Engine::read_mapped`] for a caller holding the `reuse` read guard
    /// (taken once: a second read lock of one thread can deadlock with a
    /// waiting writer).
    fn read_mapped_guarded(&self, vol: VolumeId, first: u64, buf: &mut [u8]) -> Result<Expect> {
        let n = buf.len() / BLOCK_SIZE;
        let (pbas, reuse_epoch): (Vec<Option<Pba>>, u64) = {
            let m = lock(&self.meta);
            let faults = m.paging_faults();
            let v = m
                .volumes
                .get(&vol)
                .ok_or_else(|| EngineError::NoSuchVolume(format!("#{}", vol.0)))?;
            // (not zeros for an LBA whose mapping was lost to damage)
            if let Some(lba) = v.lost_mapping_in(first, n as u64) {
                return Err(EngineError::MappingLost {
                    volume: v.record.name.clone(),
                    lba,
                });
            }
            let pbas = (0..n as u64).map(|i| v.get(Lba(first + i))).collect();
            if m.paging_faults() != faults {
                // a map page of this request could not be read back
                fault_check(&m)?;
            }
            (pbas, m.reuse_epoch)
        };
        let read = Expect {
            pba: pbas.first().copied().flatten(),
            reuse_epoch,
        };
        let mut i = 0;
        while i < n {
            match pbas[i] {
                None => {
                    buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].fill(0);
                    i += 1;
                }
                Some(p)
                    if self
                        .cache
                        .get(p, &mut buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]) =>
                {
                    i += 1;
                }
                Some(p) => {
                    // coalesce a run of consecutive PBAs into one read, up
                    // to the first block the cache holds (each looked up:
                    // a miss is counted per block read)
                    let mut j = i + 1;
                    let mut cached_next = false;
                    while j < n && pbas[j] == Some(Pba(p.0 + (j - i) as u64)) {
                        let at = Pba(p.0 + (j - i) as u64);
                        if self
                            .cache
                            .get(at, &mut buf[j * BLOCK_SIZE..(j + 1) * BLOCK_SIZE])
                        {
                            cached_next = true;
                            break;
                        }
                        j += 1;
                    }
                    self.backend
                        .read_blocks(p, &mut buf[i * BLOCK_SIZE..j * BLOCK_SIZE])
                        .map_err(|e| EngineError::io(format!("reading PBA {}", p.0), e))?;
                    for k in i..j {
                        self.cache.insert(
                            Pba(p.0 + (k - i) as u64),
                            &buf[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE],
                        );
                    }
                    i = if cached_next { j + 1 } else { j };
                }
            }
        }
        Ok(read)
    }

    /// Writes `data` to volume `vol` at byte `offset`, deduplicating inline.
    /// Unaligned edges are read-modify-write. With `fua` the write is
    /// durable on return.
    ///
    /// Errors: [`EngineError::OutOfRange`], [`EngineError::NoSpace`] (the
    /// backing file system is full; what was stored stays intact),
    /// [`EngineError::Io`].
    pub fn write(&self, vol: VolumeId, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_write(vol, offset, data.len() as u64)?;
        self.write_unchecked(vol, offset, Some(data))?;
        self.after_request(fua)
    }

    /// Discards `len` bytes at `offset` (TRIM): whole blocks are unmapped and
    /// released; partial blocks are zeroed. Reads return zeros afterwards.
    pub fn trim(&self, vol: VolumeId, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_write(vol, offset, len)?;
        self.write_unchecked_zero(vol, offset, len)?;
        self.after_request(fua)
    }

    /// Makes `len` bytes at `offset` read as zeros (WRITE_ZEROES); the same
    /// as [`Engine::trim`] since zero blocks are never stored.
    pub fn write_zeroes(&self, vol: VolumeId, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.trim(vol, offset, len, fua)
    }

    /// After a client's write or TRIM, made in memory: with `fua`, as
    /// [`Engine::after_write`]; without, only a change that met unreadable
    /// metadata fails. A commit started because a bound was passed is the
    /// store's business: if it fails, the request still succeeded (it is
    /// in place, and durable only after a FLUSH, which reports the error),
    /// the commit is wanted again, and while the bounds stay passed twice
    /// over the next change is refused before it changes anything
    /// ([`Engine::check_write`]).
    fn after_request(&self, fua: bool) -> Result<()> {
        if fua || self.map_cache.load_errors() > 0 || self.reverse_cache.writes_dropped() > 0 {
            return self.after_write(fua);
        }
        if self.after_write(false).is_err() {
            self.commit_wanted.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// After a change made without holding the metadata lock any more:
    /// fails if the change met unreadable metadata, commits if `fua` or if
    /// a bound on uncommitted metadata or pending frees was passed
    /// ([`Engine::note_change`]). The out-of-line passes call it between
    /// their lock holds too, so their changes stay within those bounds.
    pub(crate) fn after_write(&self, fua: bool) -> Result<()> {
        // a write whose metadata update met an unreadable page fails (its
        // changes are never committed); one atomic load, no lock
        if self.map_cache.load_errors() > 0 || self.reverse_cache.writes_dropped() > 0 {
            return fault_check(&lock(&self.meta));
        }
        if fua {
            return self.flush();
        }
        // (between the pieces of a long TRIM, delete or out-of-line pass)
        self.enforce_bounds()?;
        if self.commit_wanted.swap(false, Ordering::Relaxed) {
            if matches!(
                self.commit.try_lock(),
                Err(std::sync::TryLockError::WouldBlock)
            ) {
                // a commit is running: leave the next one to a later writer
                // instead of queueing behind it
                self.commit_wanted.store(true, Ordering::Relaxed);
                return Ok(());
            }
            return self.flush();
        }
        Ok(())
    }

    /// True while the next write, TRIM or zeroing will commit (or
    /// checkpoint) before it returns: a bound on uncommitted changes was
    /// passed (the metadata changed, or blocks released, past `--max-dirty`
    /// or `--max-pending-free`). One atomic load each; a hint for
    /// a front end (that request waits for the disk).
    pub fn commit_due(&self) -> bool {
        self.commit_wanted.load(Ordering::Relaxed)
            || self.over_commit_bound.load(Ordering::Relaxed)
            || self.checkpoint_behind.load(Ordering::Relaxed)
    }

    /// Before a change: while uncommitted metadata or blocks waiting to be
    /// freed are past twice their bounds (`max_dirty_bytes`,
    /// `max_pending_free_bytes`: commits fail, or changes pile up while a
    /// slow one runs), commits first, waiting for a running commit; while
    /// committed changes waiting for a checkpoint are past twice the
    /// journal size (checkpoints fail), checkpoints first. A failure
    /// refuses the change with its error, so memory stays bounded whatever
    /// the files do. Within the bounds, two atomic loads.
    ///
    /// Must not be called holding the metadata lock or the `reuse` lock.
    fn enforce_bounds(&self) -> Result<()> {
        if self.over_commit_bound.load(Ordering::Relaxed) {
            self.flush()?;
        }
        if self.checkpoint_behind.load(Ordering::Relaxed) {
            let mut c = lock(&self.commit);
            if self.checkpoint_behind.load(Ordering::Relaxed) {
                self.checkpoint_locked(&mut c)?;
            }
        }
        Ok(())
    }

    /// Called with the metadata lock held after a change: asks the next
    /// writer to commit when changed metadata or blocks waiting to be freed
    /// pass their bounds (freed blocks are reused only after a commit).
    pub(crate) fn note_change(&self, m: &Meta) {
        let page_bytes = crate::paged::PAGE_SIZE as u64;
        let pending_free_bytes = m.pending_free.len() as u64 * BLOCK_SIZE_U64;
        let other_pages = (m.refcounts.dirty_count() + m.fingerprints.dirty_count()) as u64;
        let map_pages = m.map_dirty_pages() as u64;
        let dirty_bytes = (other_pages + map_pages) * page_bytes;
        if dirty_bytes > self.config.max_dirty_bytes
            || pending_free_bytes > self.config.max_pending_free_bytes
        {
            self.commit_wanted.store(true, Ordering::Relaxed);
            if dirty_bytes > self.config.max_dirty_bytes.saturating_mul(2)
                || pending_free_bytes > self.config.max_pending_free_bytes.saturating_mul(2)
            {
                self.over_commit_bound.store(true, Ordering::Relaxed);
            }
        }
    }

    fn write_unchecked_zero(&self, vol: VolumeId, offset: u64, len: u64) -> Result<()> {
        let end = offset + len;
        let first_full = offset.div_ceil(BLOCK_SIZE_U64);
        let end_full = end / BLOCK_SIZE_U64;
        if first_full >= end_full {
            // within one block, or straddling two without a whole block
            return self.write_partial_span(vol, offset, end, None);
        }
        self.write_partial_span(vol, offset, first_full * BLOCK_SIZE_U64, None)?;
        // in pieces of 8192 blocks (32 MiB), releasing at most
        // MAX_PIECE_RELEASES of them, so a huge TRIM never holds the
        // metadata lock for long, and commits between pieces once changed
        // metadata or blocks waiting to be freed pass their bounds (as a
        // write would), so neither grows with the TRIM's length; unmapped
        // stretches (map holes) are passed over at once, so a discard of a
        // whole large thin volume (mkfs) costs what it has mapped
        const PER_PAGE: u64 = crate::paged::U64_PER_PAGE;
        let mut lba = first_full;
        while lba < end_full {
            let piece_end;
            {
                let mut m = lock(&self.meta);
                let mapped = match m.volumes.get(&vol) {
                    Some(v) => match v
                        .map
                        .next_present_page(lba / PER_PAGE, end_full.div_ceil(PER_PAGE))
                    {
                        Some(page) => {
                            let from = lba.max(page * PER_PAGE).min(end_full);
                            let (mapped, end) = release_piece(v, from, (from + 8192).min(end_full));
                            piece_end = end;
                            mapped
                        }
                        None => {
                            piece_end = end_full;
                            Vec::new()
                        }
                    },
                    None => {
                        piece_end = end_full;
                        Vec::new()
                    }
                };
                for (l, _) in mapped {
                    m.remap(vol, Lba(l), None);
                }
                m.counters.blocks_trimmed += piece_end - lba;
                // (a change even if nothing was mapped: the counters go
                // with the next commit)
                m.change_count += 1;
                self.note_change(&m);
            }
            if piece_end < end_full {
                self.after_write(false)?;
            }
            lba = piece_end;
        }
        self.write_partial_span(vol, end_full * BLOCK_SIZE_U64, end, None)
    }

    fn write_unchecked(&self, vol: VolumeId, offset: u64, data: Option<&[u8]>) -> Result<()> {
        let data = data.unwrap_or(&[]);
        let end = offset + data.len() as u64;
        let first_full = offset.div_ceil(BLOCK_SIZE_U64);
        let end_full = end / BLOCK_SIZE_U64;
        if first_full >= end_full {
            return self.write_partial_span(vol, offset, end, Some(data));
        }
        let head = ((first_full * BLOCK_SIZE_U64) - offset) as usize;
        let tail_start = (end_full * BLOCK_SIZE_U64 - offset) as usize;
        self.write_partial_span(
            vol,
            offset,
            first_full * BLOCK_SIZE_U64,
            Some(&data[..head]),
        )?;
        self.write_full_blocks(vol, first_full, &data[head..tail_start], None)?;
        self.write_partial_span(
            vol,
            end_full * BLOCK_SIZE_U64,
            end,
            Some(&data[tail_start..]),
        )
    }

    /// Read-modify-write of bytes `start..end` (at most two blocks, none of
    /// them whole); `data` None writes zeros.
    fn write_partial_span(
        &self,
        vol: VolumeId,
        start: u64,
        end: u64,
        data: Option<&[u8]>,
    ) -> Result<()> {
        let mut pos = start;
        while pos < end {
            let lba = pos / BLOCK_SIZE_U64;
            let block_end = ((lba + 1) * BLOCK_SIZE_U64).min(end);
            let stripe = &self.rmw
                [((vol.0 as u64).wrapping_mul(31).wrapping_add(lba) % RMW_STRIPES as u64) as usize];
            let _g = lock(stripe);
            let mut block = vec![0u8; BLOCK_SIZE];
            let in_block = (pos - lba * BLOCK_SIZE_U64) as usize;
            let n = (block_end - pos) as usize;
            // a whole-block write or TRIM of this LBA landing between the
            // read and the write-back would be undone by it (its bytes
            // outside ours replaced by older ones): the write-back maps
            // only if the LBA still maps what was read, else it reads again
            let mut written = false;
            let mut committed_for_space = false;
            for attempt in 1..=2 * RMW_ATTEMPTS {
                // (past RMW_ATTEMPTS: no freed block is reused until the
                // write-back, so only a remap of this LBA can fail it — a
                // client's write, or out-of-line dedup moving it to a lower
                // PBA, which can happen only so often; the write path
                // takes no `reuse` lock, commits come after it)
                let no_reuse = (attempt > RMW_ATTEMPTS)
                    .then(|| self.reuse.read().unwrap_or_else(|e| e.into_inner()));
                let read = if no_reuse.is_some() {
                    self.read_mapped_guarded(vol, lba, &mut block)?
                } else {
                    self.read_mapped(vol, lba, &mut block)?
                };
                match data {
                    Some(d) => block[in_block..in_block + n]
                        .copy_from_slice(&d[(pos - start) as usize..(pos - start) as usize + n]),
                    None => block[in_block..in_block + n].fill(0),
                }
                match self.write_full_blocks(vol, lba, &block, Some(read)) {
                    Ok(true) => {
                        written = true;
                        break;
                    }
                    Ok(false) => {}
                    // full while released blocks wait for a commit: commit
                    // (without holding `reuse`, which it takes) and read again
                    Err(e @ EngineError::NoSpace { .. })
                        if !committed_for_space && lock(&self.meta).frees_waiting() =>
                    {
                        drop(no_reuse);
                        self.commit_for_space(e)?;
                        committed_for_space = true;
                    }
                    Err(e) => return Err(e),
                }
            }
            if !written {
                return Err(EngineError::Busy(format!(
                    "partial write of LBA {lba}: the block was rewritten during each of {} attempts",
                    2 * RMW_ATTEMPTS
                )));
            }
            pos = block_end;
        }
        Ok(())
    }

    /// Writes whole blocks (`data.len()` a multiple of 4 KiB) starting at
    /// LBA `first`, with inline dedup. With `expect` (one block), writes
    /// only if LBA `first` still maps what was read ([`Expect`]); returns
    /// false if it did not write for that reason.
    fn write_full_blocks(
        &self,
        vol: VolumeId,
        first: u64,
        data: &[u8],
        expect: Option<Expect>,
    ) -> Result<bool> {
        let n = data.len() / BLOCK_SIZE;
        if n == 0 {
            return Ok(true);
        }
        let block = |i: usize| &data[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
        // fingerprint outside the lock; None for zero blocks
        // blocks not selected for inline dedup (adaptive selectivity,
        // SmartDedup §3.4; CAFTL's filters) are stored unhashed and left to
        // out-of-line dedup
        let zero: Vec<bool> = (0..n).map(|i| is_zero(block(i))).collect();
        // (zero blocks, never stored, take no part: a pattern of zero and
        // data blocks must not starve the data blocks of selection)
        let mut selected = self
            .selectivity
            .select(zero.iter().filter(|z| !**z).count())
            .into_iter();
        let mut inline: Vec<bool> = zero
            .iter()
            .map(|&z| !z && selected.next().unwrap_or(true))
            .collect();
        let sample = self.caftl_filter(
            &mut inline,
            |i| crc32c::crc32c(block(i)),
            |i| self.hash.fingerprint(block(i)),
        )?;
        let fps: Vec<Option<Fingerprint>> = (0..n)
            .map(|i| match sample {
                _ if zero[i] => None,
                _ if !inline[i] => Some(UNHASHED),
                Some((s, fp)) if s == i => Some(fp),
                _ => Some(self.hash.fingerprint(block(i))),
            })
            .collect();
        self.place_blocks(vol, first, &fps, Some(data), None, expect)
    }

    /// Whether one of CAFTL's write-path filters (pre-hashing, sampling)
    /// is configured.
    fn caftl_active(&self) -> bool {
        self.config.prehash_bytes > 0 || self.config.sampling
    }

    /// CAFTL's pre-hashing and sampling ([`crate::caftl`]) over the blocks
    /// marked `inline`: clears the mark of each block they turn away.
    /// `crc(i)` gives block `i`'s CRC-32C, `fingerprint(i)` its
    /// fingerprint. Returns the sample and its fingerprint if one was
    /// taken (so it is not computed twice).
    ///
    /// Errors: [`EngineError::Io`] if looking the sample up fails.
    fn caftl_filter(
        &self,
        inline: &mut [bool],
        crc: impl Fn(usize) -> u32,
        fingerprint: impl Fn(usize) -> Fingerprint,
    ) -> Result<Option<(usize, Fingerprint)>> {
        if !self.caftl_active() {
            return Ok(None);
        }
        let prehash = self.config.prehash_bytes > 0;
        let crcs: Vec<Option<u32>> = inline
            .iter()
            .enumerate()
            .map(|(i, &on)| on.then(|| crc(i)))
            .collect();
        if prehash {
            let mut table = lock(&self.caftl);
            for (i, c) in crcs.iter().enumerate() {
                if let Some(c) = c {
                    if !table.seen_before(*c) {
                        inline[i] = false;
                    }
                }
            }
        }
        if !self.config.sampling {
            return Ok(None);
        }
        let candidates: Vec<Option<u32>> = crcs
            .iter()
            .zip(inline.iter())
            .map(|(c, &on)| c.filter(|_| on))
            .collect();
        let Some(s) = crate::caftl::sample(&candidates) else {
            return Ok(None);
        };
        let fp = fingerprint(s);
        // (an unreadable fingerprint store makes a miss, not a failed
        // write, as in `place_blocks`)
        let duplicate = {
            let mut m = lock(&self.meta);
            m.lookup(&fp).unwrap_or_else(|_| {
                m.counters.index_errors += 1;
                None
            })
        }
        .is_some();
        let mut turned_away = 0;
        if !duplicate {
            for (i, on) in inline.iter_mut().enumerate() {
                if *on && i != s {
                    *on = false;
                    turned_away += 1;
                }
            }
        }
        lock(&self.caftl).note_sample(turned_away);
        Ok(Some((s, fp)))
    }

    /// Writes blocks known only by fingerprint (`None`: a zero block)
    /// starting at LBA `first` of `vol`: the dedup logic of a write without
    /// hashing or storing data. Used to replay content-fingerprinted traces
    /// through the real engine (with [`Engine::simulated`]). No data is
    /// written: on an engine that stores data, the LBAs of new blocks read
    /// whatever their PBAs held before, so it is for simulation only.
    ///
    /// Errors: [`EngineError::OutOfRange`] if the blocks pass the volume's
    /// end; [`EngineError::ReadOnly`] for a volume served read-only;
    /// [`EngineError::MetadataUnreadable`] and
    /// [`EngineError::DataSyncFailed`] once the store stopped committing,
    /// as for [`Engine::write`].
    pub fn write_fingerprinted(
        &self,
        vol: VolumeId,
        first: Lba,
        fps: &[Option<Fingerprint>],
    ) -> Result<()> {
        // (place_blocks checks the range under its metadata lock)
        if !self.caftl_active() {
            // no CAFTL filter: every hashed block is looked up inline
            return self
                .place_blocks(vol, first.0, fps, None, None, None)
                .map(|_| ());
        }
        // CAFTL's filters see the fingerprint's CRC instead of the data's
        let mut inline: Vec<bool> = fps
            .iter()
            .map(|f| f.is_some_and(|f| f != UNHASHED))
            .collect();
        let fp = |i: usize| fps[i].unwrap_or(UNHASHED);
        self.caftl_filter(&mut inline, |i| crc32c::crc32c(&fp(i).0), fp)?;
        self.place_blocks(vol, first.0, fps, None, Some(&inline), None)
            .map(|_| ())
    }

    /// Hints that blocks with fingerprints `fps` are about to be written
    /// (a replay's next requests): the fingerprint index entries and
    /// reverse-index records their lookups read are brought into the CPU
    /// cache in one pass, so their cache misses overlap. Changes nothing
    /// and counts nothing; a batch of 8 to 32 fingerprints suits it.
    pub fn prefetch_fingerprints(&self, fps: &[Fingerprint]) {
        lock(&self.meta).prefetch_lookups(fps);
    }

    /// After a data write failed with `no_space` (ENOSPC) while released
    /// blocks wait for a commit: commits, which makes them reusable, so the
    /// caller can write once more. Must not be called holding the `reuse`
    /// lock or the metadata lock.
    ///
    /// Errors: `no_space` if the commit also met a full file system; the
    /// commit's own error otherwise (a failed data sync, unreadable
    /// metadata, journal I/O), which then stands for the store's state.
    fn commit_for_space(&self, no_space: EngineError) -> Result<()> {
        // (twice: the first commit's own releases are held back until a
        // second one is durable; should the second fail for room, what the
        // first made free is written into)
        let second = || match self.commit_changes(true) {
            Err(EngineError::NoSpace { .. }) if !lock(&self.meta).free.is_empty() => Ok(()),
            r => r,
        };
        match self.flush().and_then(|()| second()) {
            Ok(()) => {
                self.no_space_commits.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // (ENOSPC from the data sync itself is a failed sync: the
            // store stops taking writes, which the client must learn)
            Err(EngineError::NoSpace { .. }) => match lock(&self.meta).data_sync_failure.clone() {
                Some(why) => Err(EngineError::DataSyncFailed(why)),
                None => Err(no_space),
            },
            Err(e) => Err(e),
        }
    }

    /// Writes the data of `placement`'s new blocks (`data` holds the
    /// request's blocks), coalescing runs of consecutive PBAs into one
    /// backend write; the first failure, if any.
    fn write_new_blocks(&self, placement: &[Placement], data: &[u8]) -> Option<EngineError> {
        let new: SmallVec<[(usize, Pba); 4]> = placement
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                if let Placement::New { pba, .. } = p {
                    Some((i, *pba))
                } else {
                    None
                }
            })
            .collect();
        let mut k = 0;
        while k < new.len() {
            let (i0, p0) = new[k];
            let mut j = k + 1;
            while j < new.len() && new[j].0 == i0 + (j - k) && new[j].1 .0 == p0.0 + (j - k) as u64
            {
                j += 1;
            }
            if let Err(e) = self
                .backend
                .write_blocks(p0, &data[i0 * BLOCK_SIZE..(i0 + j - k) * BLOCK_SIZE])
            {
                return Some(EngineError::io(format!("writing PBA {}", p0.0), e));
            }
            k = j;
        }
        None
    }

    /// The inline dedup of whole blocks: `fps[i]` is block `first + i`'s
    /// fingerprint; `data` (if any) holds their bytes, written for misses.
    /// A block with `inline[i]` false (or fingerprint [`UNHASHED`]) is
    /// stored without an inline lookup, its fingerprint kept in the reverse
    /// index for the out-of-line pass. With `expect`, nothing is mapped
    /// unless LBA `first` still maps what a read-modify-write read
    /// ([`Expect`]); returns false if so.
    fn place_blocks(
        &self,
        vol: VolumeId,
        first: u64,
        fps: &[Option<Fingerprint>],
        data: Option<&[u8]>,
        inline: Option<&[bool]>,
        expect: Option<Expect>,
    ) -> Result<bool> {
        let n = fps.len();
        // phase 1: look every block up; hits and zeros are mapped at once
        // (after the sequence threshold has had its say); misses get a
        // reserved PBA
        let mut placement: SmallVec<[Placement; 4]> = SmallVec::with_capacity(n);
        let (mut selected_blocks, mut inline_dups) = (0u64, 0u64);
        let mut m = lock(&self.meta);
        let Some(volume) = m.volumes.get(&vol) else {
            return Err(EngineError::NoSuchVolume(format!("#{}", vol.0)));
        };
        let size_blocks = volume.writable_blocks();
        let shrinks_seen = volume.shrinks_begun;
        if first
            .checked_add(n as u64)
            .is_none_or(|end| end > size_blocks)
        {
            return Err(EngineError::OutOfRange {
                offset: first.saturating_mul(BLOCK_SIZE_U64),
                len: n as u64 * BLOCK_SIZE_U64,
                size_bytes: size_blocks * BLOCK_SIZE_U64,
            });
        }
        // (a client write checked these already; a replayed one did not)
        if volume.read_only() {
            return Err(self.read_only_error(volume));
        }
        fault_check(&m)?;
        let threshold = volume
            .record
            .sequence_threshold_blocks
            .unwrap_or(self.config.sequence_threshold_blocks)
            .max(1);
        if expect.is_some_and(|e| !e.holds(&m, vol, first)) {
            return Ok(false);
        }
        let block = |i: usize| data.map(|d| &d[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
        // first block of the request with each new content; a
        // one-block request needs no map
        let mut first_of: crate::fingerprint::FingerprintMap<usize> = Default::default();
        let mut only_block_is_new = false;
        let mut cands: SmallVec<[Candidate; 4]> = SmallVec::with_capacity(n);
        m.counters.blocks_written += n as u64;
        // (a change even if no mapping changes, zeros over holes or the
        // same bytes again: the counters go with the next commit)
        m.change_count += 1;
        if n > 1 {
            // (the cache misses of a large request's lookups overlap)
            let looked_up: Vec<Fingerprint> = fps
                .iter()
                .enumerate()
                .filter(|&(i, _)| inline.is_none_or(|on| on[i]))
                .filter_map(|(_, fp)| fp.filter(|fp| *fp != UNHASHED))
                .collect();
            m.prefetch_lookups(&looked_up);
        }
        for (i, fp) in fps.iter().enumerate() {
            let cand = match fp {
                None => Candidate::Other,
                Some(fp) if *fp == UNHASHED => Candidate::Other,
                Some(_) if inline.is_some_and(|on| !on[i]) => Candidate::Other,
                Some(fp) => {
                    selected_blocks += 1;
                    // (an unreadable fingerprint store, derived data rebuilt
                    // at every start, makes a miss, not a failed write: the
                    // block is stored as a copy of its own)
                    let hit = m.lookup(fp).unwrap_or_else(|_| {
                        m.counters.index_errors += 1;
                        None
                    });
                    let same_request = first_of.get(fp).copied();
                    if let Some(p) = hit.filter(|&p| self.verified(p, block(i), &mut m)) {
                        Candidate::Stored(p.0)
                    } else if let Some(j) =
                        same_request.filter(|&j| !self.config.verify || block(i) == block(j))
                    {
                        Candidate::InRequest(j)
                    } else {
                        if hit.is_none() && same_request.is_none() {
                            if n == 1 {
                                only_block_is_new = true;
                            } else {
                                first_of.insert(*fp, i);
                            }
                        }
                        Candidate::Other
                    }
                }
            };
            if cand != Candidate::Other {
                inline_dups += 1;
            }
            cands.push(cand);
        }
        let filtered_keep =
            (threshold > 1).then(|| m.sequences.filter(vol, first, threshold, &cands));
        let keep = |i: usize| match &filtered_keep {
            Some(k) => k[i],
            None => cands[i] != Candidate::Other,
        };
        let is_first = |fp: &Fingerprint, i: usize| {
            if n == 1 {
                only_block_is_new
            } else {
                first_of.get(fp) == Some(&i)
            }
        };
        for (i, fp) in fps.iter().enumerate() {
            let lba = Lba(first + i as u64);
            let Some(fp) = fp else {
                m.remap(vol, lba, None);
                m.counters.zero_blocks_written += 1;
                placement.push(Placement::Done);
                continue;
            };
            // an earlier block of this request may have released the
            // stored copy (overwriting its last reference): then store anew
            // (or reached the most references a count holds)
            match (cands[i], keep(i)) {
                (Candidate::Stored(p), true) if m.shareable(p) => {
                    m.remap(vol, lba, Some(Pba(p)));
                    m.counters.duplicate_blocks += 1;
                    placement.push(Placement::Done);
                }
                (Candidate::InRequest(j), true) => placement.push(Placement::SameAs(j)),
                (cand, keep) => {
                    let filtered = cand != Candidate::Other && !keep;
                    if filtered {
                        m.counters.sequence_filtered_blocks += 1;
                    }
                    let pba = m.allocate();
                    placement.push(Placement::New {
                        pba,
                        fp: *fp,
                        // unhashed blocks and filtered duplicates are
                        // not indexed (their content is, elsewhere);
                        // a released copy's content is indexed anew
                        indexed: *fp != UNHASHED
                            && (is_first(fp, i) || matches!(cand, Candidate::Stored(_)) && keep),
                        filtered,
                    });
                }
            }
        }
        let inserts_seen = m.index_inserts;

        // phase 2: write new data without the metadata lock, coalescing
        // runs of consecutive PBAs (nothing to write without data, as in a
        // replay of fingerprints, or when phase 1 mapped every block: then
        // the lock is kept throughout, and the request is done)
        let any_new = placement.iter().any(|p| matches!(p, Placement::New { .. }));
        if let Some(data) = data.filter(|_| any_new) {
            drop(m);
            let mut retried = false;
            loop {
                let failure = self.write_new_blocks(&placement, data);
                m = lock(&self.meta);
                let Some(e) = failure else { break };
                for p in &placement {
                    if let Placement::New { pba, .. } = p {
                        m.unreserve(*pba);
                    }
                }
                // a full file system while blocks released since the last
                // commit wait for it: commit, which makes them reusable,
                // and write once more into them (as ext4 retries an
                // allocation after forcing a journal commit). Not for a
                // read-modify-write: its caller may hold the `reuse` lock,
                // which a commit takes; it commits and reads again itself.
                if retried
                    || expect.is_some()
                    || !matches!(e, EngineError::NoSpace { .. })
                    || !m.frees_waiting()
                {
                    undo_unwritten(&mut m, &placement, n);
                    return Err(e);
                }
                retried = true;
                drop(m);
                if let Err(e) = self.commit_for_space(e) {
                    undo_unwritten(&mut lock(&self.meta), &placement, n);
                    return Err(e);
                }
                m = lock(&self.meta);
                for p in placement.iter_mut() {
                    if let Placement::New { pba, .. } = p {
                        *pba = m.allocate();
                    }
                }
                drop(m);
            }
            // deleted or shrunk past the request meanwhile: nothing to map
            // (an LBA past the end would hold a reference no LBA of the
            // volume accounts for), the reserved PBAs go back
            // (a volume being deleted, or shrunk past the request, counts
            // as gone: its release of blocks may have passed these LBAs)
            let gone = match m.volumes.get(&vol) {
                None => Some(EngineError::NoSuchVolume(format!("#{}", vol.0))),
                Some(v) if v.deleting => Some(EngineError::VolumeDeleting(v.record.name.clone())),
                // (or shrunk past it and grown back: the blocks phase 1
                // mapped there were released)
                Some(v)
                    if first + n as u64 > v.writable_blocks()
                        || v.lowest_shrink_since(shrinks_seen)
                            .is_some_and(|low| first + n as u64 > low) =>
                {
                    Some(EngineError::OutOfRange {
                        offset: first * BLOCK_SIZE_U64,
                        len: n as u64 * BLOCK_SIZE_U64,
                        size_bytes: v.writable_blocks() * BLOCK_SIZE_U64,
                    })
                }
                Some(_) => None,
            };
            // (or, for a read-modify-write, remapped meanwhile: read again)
            let raced = expect.is_some_and(|e| !e.holds(&m, vol, first))
                && placement.iter().any(|p| matches!(p, Placement::New { .. }));
            if gone.is_some() || raced {
                for p in &placement {
                    if let Placement::New { pba, filtered, .. } = p {
                        m.unreserve(*pba);
                        if raced && *filtered {
                            m.counters.sequence_filtered_blocks -= 1;
                        }
                    }
                }
                if raced {
                    // (written again by the retry; a read-modify-write
                    // is one block, mapped in phase 1 or not at all)
                    m.counters.blocks_written -= n as u64;
                } else {
                    // (the blocks phase 1 mapped stay counted)
                    undo_unwritten(&mut m, &placement, n);
                }
                return gone.map_or(Ok(false), Err);
            }
        }

        // phase 3: index and map the new blocks (another writer may have
        // stored the same content meanwhile: then share its copy)
        // where each new block ended up, for the copies of it in this
        // request (only kept if there are any)
        if n > 1 && any_new {
            let indexed: Vec<Fingerprint> = placement
                .iter()
                .filter_map(|p| match p {
                    Placement::New {
                        fp, indexed: true, ..
                    } => Some(*fp),
                    _ => None,
                })
                .collect();
            m.prefetch_write(vol, first, n as u64, &indexed);
        }
        let has_copies = placement.iter().any(|p| matches!(p, Placement::SameAs(_)));
        let threshold_now = m.volumes.get(&vol).map_or(threshold, |v| {
            v.record
                .sequence_threshold_blocks
                .unwrap_or(self.config.sequence_threshold_blocks)
        });
        let mut final_pba: Vec<Option<Pba>> = if has_copies {
            vec![None; n]
        } else {
            Vec::new()
        };
        // copies in this request of each block (counted once, not per
        // block: a 32 MiB request holds 8192)
        let mut copies_of: Vec<u32> = Vec::new();
        if has_copies {
            copies_of.resize(n, 0);
            for p in &placement {
                if let Placement::SameAs(j) = p {
                    copies_of[*j] += 1;
                }
            }
        }
        for (i, p) in placement.iter().enumerate() {
            if let Placement::New {
                pba, fp, indexed, ..
            } = p
            {
                // (a volume with T > 1 is left to the explicit full pass:
                // the background pass would only drop its records; T as it
                // is now: one lowered to 1 since phase 1 queued the volume,
                // whose scan may be past this LBA already)
                if threshold_now <= 1 {
                    m.skipped.record(vol, first + i as u64);
                }
                if !indexed {
                    m.record_unindexed(*pba, *fp);
                    m.remap(vol, Lba(first + i as u64), Some(*pba));
                    if has_copies {
                        final_pba[i] = Some(*pba);
                    }
                    continue;
                }
                // a miss in phase 1 still holds if nothing was indexed since
                let raced = if m.index_inserts == inserts_seen {
                    None
                } else {
                    match m.lookup(fp) {
                        Ok(r) => r,
                        // the fingerprint store cannot be read: taken as a
                        // miss (the block is written: it stays a copy of
                        // its own, which out-of-line dedup or fsck finds),
                        // so the request is mapped whole
                        Err(_) => {
                            m.counters.index_errors += 1;
                            None
                        }
                    }
                };
                // (a copy whose count cannot take this block and its
                // copies in this request is not shared: this block becomes
                // the indexed copy instead)
                let raced = raced.filter(|p| {
                    let copies = copies_of.get(i).copied().unwrap_or(0);
                    m.shareable_by(p.0, 1 + u64::from(copies))
                });
                let target = match raced {
                    Some(existing) if self.verified(existing, block(i), &mut m) => {
                        m.unreserve(*pba);
                        m.counters.duplicate_blocks += 1;
                        existing
                    }
                    Some(_) => {
                        // `verify`: same fingerprint, other bytes: kept
                        // apart, as a mismatch in phase 1 is
                        m.record_unindexed(*pba, *fp);
                        *pba
                    }
                    None => {
                        // (this request's own inserts count too: two of
                        // its blocks may carry the same new content)
                        if let Err(e) = m.index_new(*pba, *fp) {
                            // the block is stored and mapped below; only the
                            // index missed it (out-of-line dedup or fsck finds it)
                            m.counters.index_errors += 1;
                            let _ = e;
                        }
                        *pba
                    }
                };
                m.remap(vol, Lba(first + i as u64), Some(target));
                if has_copies {
                    final_pba[i] = Some(target);
                }
            }
        }
        for (i, p) in placement.iter().enumerate() {
            if let Placement::SameAs(j) = p {
                let target =
                    final_pba[*j].expect("a block's first occurrence is placed before its copies");
                m.remap(vol, Lba(first + i as u64), Some(target));
                m.counters.duplicate_blocks += 1;
            }
        }
        m.fingerprinted_inline += selected_blocks;
        self.note_change(&m);
        drop(m);
        self.selectivity.observe(selected_blocks, inline_dups);
        Ok(true)
    }

    /// With `verify` on, true only if PBA `p` holds exactly `block` (a
    /// byte compare on a fingerprint hit, like ZFS `dedup=verify`); a
    /// mismatch is counted. Without verify, or without data, true.
    #[inline]
    fn verified(&self, p: Pba, block: Option<&[u8]>, m: &mut Meta) -> bool {
        let (true, Some(block)) = (self.config.verify, block) else {
            return true;
        };
        self.compare_stored(p, block, m)
    }

    /// The byte compare of [`Engine::verified`] (out of line: rare).
    #[inline(never)]
    fn compare_stored(&self, p: Pba, block: &[u8], m: &mut Meta) -> bool {
        let mut stored = vec![0u8; BLOCK_SIZE];
        // under the metadata lock: the PBA cannot be released meanwhile
        // (a stored block that cannot be read is not shared, but is no
        // mismatch: its bytes are not known to differ)
        let readable = self.backend.read_blocks(p, &mut stored).is_ok();
        if readable && stored == block {
            return true;
        }
        if readable {
            m.counters.verify_mismatches += 1;
        }
        false
    }

    // ---- durability -------------------------------------------------------

    /// Makes the journal's reserve the configured one
    /// ([`EngineConfig::journal_reserve_bytes`]): what an earlier start
    /// reserved beyond it is given back to the file system first, so a
    /// smaller `--journal-reserve` takes effect (an open keeps a larger
    /// reserve it finds, as short commands open the store with a smaller
    /// one than the server's). For a server, once open.
    ///
    /// Errors: the allocation's, as a note for the operator (the store
    /// then runs without a reserve).
    pub fn fit_journal_reserve(&self) -> std::result::Result<(), String> {
        let mut c = lock(&self.commit);
        let Some(journal) = c.journal.as_mut() else {
            return Ok(());
        };
        let _ = journal.release_reserve();
        journal
            .reserve(self.config.journal_reserve_bytes)
            .map_err(|e| reserve_note(journal, self.config.journal_reserve_bytes, &e))
    }

    /// Makes every write completed before this call durable (group commit:
    /// concurrent flushes share one journal transaction), then releases the
    /// PBAs freed by the committed changes for reuse.
    ///
    /// Errors: [`EngineError::NoSpace`] or [`EngineError::Io`] if the
    /// journal cannot be written (the changes stay pending and the next
    /// flush retries them) or the data file cannot be synced (then every
    /// later flush and write fails with [`EngineError::DataSyncFailed`]
    /// until restart); [`EngineError::MetadataUnreadable`].
    pub fn flush(&self) -> Result<()> {
        self.commit_changes(false)
    }

    /// [`Engine::flush`] for a timer (a server's commit interval): also
    /// writes a transaction when nothing changed if blocks released by the
    /// last one wait for another to become reusable, so an idle store does
    /// not keep them pending (and counted in
    /// [`Stats::pending_free_blocks`]) until the next write.
    ///
    /// Errors: as [`Engine::flush`].
    pub fn commit_periodic(&self) -> Result<()> {
        self.commit_changes(true)
    }

    /// [`Engine::flush`]; with `force`, a transaction is written even if
    /// nothing changed, which releases the blocks held back by the last
    /// one ([`Meta::held_free`]).
    fn commit_changes(&self, force: bool) -> Result<()> {
        let entry_changes = {
            let m = lock(&self.meta);
            if let Some(why) = &m.data_sync_failure {
                return Err(EngineError::DataSyncFailed(why.clone()));
            }
            m.change_count
        };
        let mut c = lock(&self.commit);
        // (the writes this flush covers may be in the chain replayed at
        // open: made durable before anything is acknowledged)
        self.replayed_chain_durable(&mut c)?;
        let force = force
            && c.journal.is_some()
            && (!lock(&self.meta).held_free.is_empty()
                || self.replayed_frees_unknown.load(Ordering::Acquire));
        if c.durable_changes >= entry_changes && !force {
            // a flush that started after us committed everything we need
            return self.sync_data();
        }
        let seq = c.journal.as_ref().map_or(0, |j| j.next_seq());
        let was_over;
        let mut batch = {
            let mut m = lock(&self.meta);
            // never commit metadata derived from a page that could not be read
            fault_check(&m)?;
            // (changes from now on count afresh; set again if this fails)
            was_over = self.over_commit_bound.swap(false, Ordering::Relaxed);
            if c.journal.is_some() {
                m.take_commit(seq)
            } else {
                m.take_commit_unlogged(self.config.journal_size_bytes)
            }
        };
        let mut result = self
            .sync_data()
            .and_then(|()| self.commit_ops(&mut c, &batch.ops));
        if matches!(result, Err(EngineError::NoSpace { .. }))
            && c.journal.as_ref().is_some_and(|j| j.used_bytes() > 0)
        {
            // the journal cannot grow: put what it holds in place, then
            // write this transaction at its start, inside the reserve. The
            // batch may patch pages whose whole images were in the journal
            // just emptied: take it again, so they are logged whole.
            result = self.checkpoint_locked(&mut c).and_then(|()| {
                let seq = c.journal.as_ref().map_or(0, |j| j.next_seq());
                {
                    let mut m = lock(&self.meta);
                    m.restore_commit(std::mem::take(&mut batch));
                    fault_check(&m)?;
                    batch = m.take_commit(seq);
                }
                self.sync_data()?;
                self.commit_ops(&mut c, &batch.ops)
            });
        }
        if let Err(e) = result {
            lock(&self.meta).restore_commit(batch);
            if was_over {
                self.over_commit_bound.store(true, Ordering::Relaxed);
            }
            return Err(e);
        }
        c.durable_changes = batch.change_count;
        {
            // with a journal, the blocks this transaction released wait
            // for the next one, and those the previous one released are
            // free now (`Meta::held_free`)
            let frees = std::mem::take(&mut batch.frees);
            let logged = c.journal.is_some();
            let counters = std::mem::take(&mut batch.counters);
            self.release_frees(|m| {
                m.counters_committed = counters;
                m.frees_in_flight = 0;
                if logged {
                    std::mem::replace(&mut m.held_free, frees)
                } else {
                    frees
                }
            });
            self.replayed_frees_unknown.store(false, Ordering::Release);
        }
        if c.journal.is_some() {
            c.checkpoint.add(batch.ops);
            c.checkpoint.generation = batch.generation;
            let used = c.journal.as_ref().map_or(0, |j| j.used_bytes());
            // pages changed since the last checkpoint stay in memory until
            // it: bound them like the journal (patches make it grow slower)
            let pinned_bytes = {
                let m = lock(&self.meta);
                (m.map_cache.stats().pinned_pages + m.fingerprints.stats().pinned_pages)
                    * crate::paged::PAGE_SIZE as u64
            };
            let bound = self.config.journal_size_bytes;
            // a file system filling up: the checkpoint that empties the
            // journal may need new blocks for the pages it puts in place
            // (at most the journal's bytes), so it runs while they are
            // there (twice over), not once the file system is full, when
            // it could not, and the journal could not grow either. (On a
            // file system that stays full, commits then checkpoint every
            // MiB of journal: that keeps the journal inside its reserve,
            // which is what lets TRIMs commit there.)
            let short_of_room = used >= JOURNAL_ROOM_CHECK_BYTES
                && c.journal
                    .as_ref()
                    .and_then(|j| j.available_bytes())
                    .is_some_and(|free| free < used.saturating_mul(2));
            if used >= bound || pinned_bytes >= bound || short_of_room {
                // a failed checkpoint loses nothing: the journal keeps the
                // changes; past twice the bound, changes wait for one that
                // succeeds (`enforce_bounds`)
                if self.checkpoint_locked(&mut c).is_err()
                    && (used >= bound.saturating_mul(2) || pinned_bytes >= bound.saturating_mul(2))
                {
                    self.checkpoint_behind.store(true, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Makes `frees` reusable (the read cache forgets them first).
    /// The blocks are those `take` returns, taken in the same hold of the
    /// metadata lock, so that no block is on no list meanwhile.
    fn release_frees(&self, take: impl FnOnce(&mut Meta) -> Vec<u64>) {
        let _w = self.reuse.write().unwrap_or_else(|e| e.into_inner());
        let mut m = lock(&self.meta);
        let frees = take(&mut m);
        if frees.is_empty() {
            return;
        }
        // (the read cache's lock is taken under no other)
        for &p in &frees {
            self.cache.invalidate(p);
        }
        m.free.extend(frees.iter().copied());
        m.reuse_epoch += 1;
    }

    /// Syncs the data file. A failure is remembered: from then on writes,
    /// flushes and out-of-line passes fail with
    /// [`EngineError::DataSyncFailed`] (a later sync could report success
    /// for pages the kernel dropped after this one failed).
    fn sync_data(&self) -> Result<()> {
        self.backend.sync().map_err(|e| {
            lock(&self.meta)
                .data_sync_failure
                .get_or_insert_with(|| e.to_string());
            EngineError::io("syncing the data file", e)
        })
    }

    fn commit_ops(&self, c: &mut CommitState, ops: &[Op]) -> Result<()> {
        if let (Some((sb, counters)), Some(dir)) = (&c.format_upgrade, &self.dir) {
            // a reader of the old format must not meet what this
            // transaction journals (counters.json)
            dir.upgrade_format(sb, counters)?;
            c.format_upgrade = None;
        }
        match c.journal.as_mut() {
            Some(j) => j
                .commit(ops)
                .map(|_| ())
                .map_err(|e| EngineError::io("writing the journal", e)),
            None => Ok(()),
        }
    }

    /// Writes the journal chain replayed at open again and syncs it now
    /// (the first write, FLUSH or commit would otherwise do it), which also
    /// frees the memory holding it (up to the journal's length). Opening
    /// writes nothing, so a server calls this once it has opened the store.
    ///
    /// Errors: [`EngineError::Io`] writing or syncing the journal (the
    /// chain stays in memory and the next write or FLUSH tries again).
    pub fn make_replayed_chain_durable(&self) -> Result<()> {
        if self.replayed_chain_pending.load(Ordering::Acquire) {
            let mut c = lock(&self.commit);
            self.replayed_chain_durable(&mut c)?;
        }
        if self.replayed_frees_unknown.load(Ordering::Acquire) {
            // a transaction behind the chain's last one, before any block
            // that one released can be reused (see `replayed_frees_unknown`)
            self.commit_changes(true)?;
        }
        Ok(())
    }

    /// Makes the journal chain replayed at open durable, once
    /// ([`Journal::make_head_durable`]), before the first commit, FLUSH or
    /// write: until then a block the chain released must not be reused,
    /// and no write the chain holds may be acknowledged durable.
    fn replayed_chain_durable(&self, c: &mut CommitState) -> Result<()> {
        let Some(j) = c.journal.as_mut() else {
            return Ok(());
        };
        j.make_head_durable()
            .map_err(|e| EngineError::io("writing the journal", e))?;
        self.replayed_chain_pending.store(false, Ordering::Release);
        Ok(())
    }

    fn checkpoint_locked(&self, c: &mut CommitState) -> Result<()> {
        let Some(dir) = &self.dir else {
            if c.journal.is_none() {
                // in memory: count what a store's checkpoint would write
                lock(&self.meta).model_checkpoint();
            }
            return Ok(());
        };
        // every change being put in place was taken from the metadata
        // before now (commits hold `c`), so this copy of the skipped buffer
        // covers all of them; later changes stay in the journal
        let saved = self.save_skipped();
        dir.apply(c.checkpoint.finished_ops())?;
        // every page of those commits is in place: the paged arrays may
        // drop them from memory, and the maps of volumes created since the
        // last checkpoint now have files to page from
        let mut m = lock(&self.meta);
        // the queue of a lowered T is saved: the next commit records it
        let t = self.config.sequence_threshold_blocks.max(1);
        if saved && m.default_sequence_threshold_blocks != t {
            m.default_sequence_threshold_blocks = t;
            m.state_dirty = true;
            m.change_count += 1;
        }
        m.unpin_through(c.checkpoint.generation);
        let group = m.map_cache.clone();
        for (id, v) in &m.volumes {
            if !v.map.has_source() {
                if let Ok(file) = dir.open_file(&MetaFile::Map(*id).relative_path(), false) {
                    let name = dir.path(MetaFile::Map(*id)).display().to_string();
                    v.map.page_from(file, &name, &group, []);
                }
            }
        }
        drop(m);
        c.checkpoint_bytes_written += c.checkpoint.bytes;
        c.checkpoint = CheckpointBuffer::default();
        if let Some(j) = c.journal.as_mut() {
            // (the checkpoint itself is complete; on failure the next
            // commit retries the restart first)
            j.reset()
                .map_err(|e| EngineError::io("restarting the journal after a checkpoint", e))?;
        }
        self.checkpoint_behind.store(false, Ordering::Relaxed);
        // every commit is in place: no loss of a transaction can take the
        // store back before the blocks the last one released
        self.release_frees(|m| std::mem::take(&mut m.held_free));
        self.replayed_frees_unknown.store(false, Ordering::Release);
        Ok(())
    }

    /// Drops the engine without closing it: nothing is committed or written
    /// in place, and a journal replayed at open stays in the journal, to be
    /// replayed again at the next open (`fsck` without `--repair` changes
    /// nothing, as `e2fsck -n`). Uncommitted changes are lost.
    pub fn drop_without_closing(self) {
        self.no_close_on_drop.store(true, Ordering::Relaxed);
    }

    /// Flushes and writes every committed change in place, leaving the
    /// journal empty; called at shutdown.
    pub fn close(&self) -> Result<()> {
        {
            // counters that moved with no change to commit (a verify
            // mismatch that kept two copies apart) are committed too
            let mut m = lock(&self.meta);
            if m.counters != m.counters_committed {
                m.change_count += 1;
            }
        }
        self.flush()?;
        self.checkpoint()?;
        // a checkpoint may leave a change to commit (a lowered sequence
        // threshold, recorded once the queue it made is saved)
        // (one lock at a time: commits take the commit lock first)
        let durable = lock(&self.commit).durable_changes;
        let changes = lock(&self.meta).change_count;
        if changes > durable {
            // (best effort: every client change is durable already, and a
            // start that finds the old T recorded queues the volumes again)
            let _ = self.flush().and_then(|()| self.checkpoint());
        }
        Ok(())
    }

    /// Writes every committed change in place and empties the journal.
    /// Failing here (e.g. ENOSPC) loses nothing: the journal keeps the
    /// changes and the next start replays them.
    pub fn checkpoint(&self) -> Result<()> {
        let mut c = lock(&self.commit);
        self.checkpoint_locked(&mut c)?;
        if let Some(j) = c.journal.as_mut() {
            // (which reserves the journal's space again)
            j.truncate()
                .map_err(|e| EngineError::io("emptying the journal", e))?;
        }
        Ok(())
    }

    // ---- observation ---------------------------------------------------------

    /// A snapshot of the engine's figures (see [`Stats`] for definitions).
    pub fn stats(&self) -> Stats {
        // (the file's length before the allocation mark: a write
        // allocating in between is not counted free)
        let data_file_bytes = self.backend.len_bytes().unwrap_or(0);
        let (mut s, free_blocks, pending_free_blocks, high_water_blocks) = {
            let m = lock(&self.meta);
            let c = &m.counters;
            let s = Stats {
                volumes: m.volumes.len() as u64,
                volumes_damaged: m
                    .volumes
                    .values()
                    .filter(|v| v.read_only() && !v.deleting)
                    .count() as u64,
                provisioned_bytes: m.volumes.values().map(|v| v.record.size_bytes).sum(),
                logical_bytes_mapped: m.mapped_blocks * BLOCK_SIZE_U64,
                physical_blocks_stored: m.stored_blocks,
                physical_bytes_stored: m.stored_blocks * BLOCK_SIZE_U64,
                blocks_written: c.blocks_written,
                zero_blocks_written: c.zero_blocks_written,
                // (a store's journal replaces this below)
                journal_bytes_written: m.journal_model.written_bytes,
                checkpoint_bytes_written: m.journal_model.checkpoint_bytes,
                duplicate_writes_eliminated: c.duplicate_blocks,
                duplicate_writes_eliminated_percent: percent(c.duplicate_blocks, c.blocks_written),
                blocks_trimmed: c.blocks_trimmed,
                verify_mismatches: c.verify_mismatches,
                index_errors: c.index_errors,
                out_of_line_duplicates: c.out_of_line_duplicates,
                sequence_filtered_blocks: c.sequence_filtered_blocks,
                blocks_fingerprinted_inline: m.fingerprinted_inline,
                caftl: lock(&self.caftl).stats(),
                out_of_line: self.out_of_line_stats(),
                reverse_index: m.fingerprints.stats(),
                map_cache: m.map_cache.stats(),
                skipped_save_errors: c.skipped_save_errors,
                skipped: m.skipped.stats(),
                pending_merges: m.pending_merges.len() as u64,
                read_cache: self.cache.stats(),
                selectivity: self.selectivity.stats(),
                index_entries: m.index.len(),
                index_bytes_in_memory: m.index_bytes(),
                index: m.index.stats(),
                metadata_bytes_in_memory: m.array_bytes()
                    + self.merge_scan_bytes.load(Ordering::Relaxed),
                ..Stats::default()
            };
            (
                s,
                m.free.len(),
                (m.pending_free.len() + m.frees_in_flight + m.held_free.len()) as u64,
                m.high_water_blocks,
            )
        };
        s.data_file_bytes = data_file_bytes;
        // free: the free set's PBAs, and those between the highest
        // allocated PBA and the data file's end (after a restart, the
        // blocks freed at the top of the file before it)
        s.free_blocks =
            free_blocks + (s.data_file_bytes / BLOCK_SIZE_U64).saturating_sub(high_water_blocks);
        s.pending_free_blocks = pending_free_blocks;
        s.no_space_commits = self.no_space_commits.load(Ordering::Relaxed);
        s.dedup_ratio = if s.physical_bytes_stored == 0 {
            1.0
        } else {
            s.logical_bytes_mapped as f64 / s.physical_bytes_stored as f64
        };
        s.space_savings_percent = if s.logical_bytes_mapped == 0 {
            0.0
        } else {
            100.0 * (1.0 - s.physical_bytes_stored as f64 / s.logical_bytes_mapped as f64)
        };
        {
            let c = lock(&self.commit);
            s.journal_bytes = c.journal.as_ref().map_or(0, |j| j.used_bytes());
            if let Some(j) = &c.journal {
                s.journal_bytes_written = j.written_bytes();
                s.checkpoint_bytes_written = c.checkpoint_bytes_written;
            }
            s.checkpoint_buffer_bytes = c.checkpoint.bytes;
        }
        s.metadata_bytes_on_disk = self.dir.as_ref().map_or(0, |d| d.metadata_bytes_on_disk());
        s.peak_rss_bytes = proc_status_bytes("VmHWM");
        s.rss_bytes = proc_status_bytes("VmRSS");
        s
    }

    /// Bytes the fingerprint index holds in memory, prefix tree included
    /// (`Stats::index_bytes_in_memory`), without the rest of
    /// [`Engine::stats`] (which reads `/proc` for the resident set).
    pub fn index_bytes_in_memory(&self) -> u64 {
        lock(&self.meta).index_bytes()
    }

    /// Checks the metadata invariants: reference counts equal the LBAs
    /// mapping each PBA, no referenced block is free, no block is on the
    /// free lists twice, every unreferenced block below the high-water mark
    /// is free or waiting for a commit (none leaked), and no in-memory
    /// index entry is stale. Call when no request or commit is in flight
    /// (a running write holds the blocks it reserved; a commit, the frees
    /// it carries: the leak check is skipped then); returns one line per
    /// violation.
    pub fn check(&self) -> Vec<String> {
        lock(&self.meta).check()
    }

    /// Fragmentation of volume `vol`: the number of extents in its map,
    /// i.e. maximal runs of consecutive LBAs mapped to consecutive PBAs (an
    /// unmapped LBA ends a run). 0 for an unknown or empty volume.
    /// Read-only; walks the allocated map pages only, so it costs time in
    /// proportion to the mapped part of the volume.
    pub fn extents(&self, vol: VolumeId) -> u64 {
        let m = lock(&self.meta);
        let Some(v) = m.volumes.get(&vol) else {
            return 0;
        };
        let per_page = crate::paged::U64_PER_PAGE;
        let mut extents = 0;
        let mut prev = 0u64; // map entry of the previous LBA: 0 unmapped, else PBA + 1
        for page in 0..v.map.page_count() {
            if v.map.page_is_hole(page) {
                prev = 0;
                continue;
            }
            for lba in page * per_page..(page + 1) * per_page {
                let e = v.map.get_u64(lba);
                if e != 0 && (prev == 0 || e != prev + 1) {
                    extents += 1;
                }
                prev = e;
            }
        }
        extents
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.no_close_on_drop.load(Ordering::Relaxed) {
            return;
        }
        // best effort; errors were reported to whoever called flush/close
        let _ = self.close();
    }
}

/// The id of the volume named `name`.
///
/// Errors: [`EngineError::NoSuchVolume`].
/// [`EngineError::MetadataUnreadable`] once a volume-map or reference-count
/// page could not be read back while running;
/// [`EngineError::DataSyncFailed`] once the data file could not be synced.
pub(crate) fn fault_check(m: &Meta) -> Result<()> {
    if let Some(why) = &m.data_sync_failure {
        return Err(EngineError::DataSyncFailed(why.clone()));
    }
    if m.paging_faults() == 0 {
        return Ok(());
    }
    Err(EngineError::MetadataUnreadable(
        m.map_cache
            .first_error()
            .or_else(|| m.reverse_cache.first_error())
            .unwrap_or_else(|| "a metadata page could not be read back".into()),
    ))
}

fn volume_id(m: &Meta, name: &str) -> Result<VolumeId> {
    m.volume_named(name)
        .ok_or_else(|| EngineError::NoSuchVolume(name.into()))
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(EngineError::InvalidArgument(format!("invalid volume name {name:?}: use 1-64 characters of A-Z a-z 0-9 . _ - (not starting with '.')")))
    }
}

/// Takes back what phase 1 of `place_blocks` counted for the new blocks
/// (and their copies in the request) of a request of `n` blocks whose
/// data could not be written (their reserved PBAs already went back):
/// they were not written, and a retry
/// (a read-modify-write reads again) counts them anew. Hits phase 1 mapped
/// stay counted: those blocks were written.
fn undo_unwritten(m: &mut Meta, placement: &[Placement], n: usize) {
    // (copies of a new block within the request are mapped only once it
    // is written: not written either)
    let (mut new, mut filtered) = (0u64, 0u64);
    for p in placement {
        match p {
            Placement::New { filtered: f, .. } => {
                new += 1;
                filtered += u64::from(*f);
            }
            Placement::SameAs(_) => new += 1,
            Placement::Done => {}
        }
    }
    debug_assert!(new <= n as u64);
    m.counters.blocks_written -= new;
    m.counters.sequence_filtered_blocks -= filtered;
}

/// Largest volume size in bytes: 1 PiB.
pub const MAX_VOLUME_BYTES: u64 = 1 << 50;

pub(crate) fn validate_size(size_bytes: u64) -> Result<()> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_SIZE_U64) {
        return Err(EngineError::InvalidArgument(format!(
            "volume size {size_bytes} bytes is not a positive multiple of 4096"
        )));
    }
    if size_bytes > MAX_VOLUME_BYTES {
        return Err(EngineError::InvalidArgument(format!(
            "volume size {size_bytes} bytes is over the 1 PiB limit"
        )));
    }
    Ok(())
}

/// Notes on the volumes of `engine` whose delete or shrink was cut short
/// (see [`Engine::notes`]): one per volume, naming the command that
/// finishes the operation.
fn unfinished_volume_notes(engine: &Engine) -> Vec<String> {
    let m = lock(&engine.meta);
    let mut notes = Vec::new();
    // (the commands name the store: one elsewhere than the default would
    // otherwise be looked for in ./dedupd-store)
    let dedupd = match &engine.dir {
        Some(dir) => format!("dedupd --store {}", crate::error::store_word(dir.root())),
        None => "dedupd".to_string(),
    };
    for v in m.volumes.values() {
        let name = &v.record.name;
        let word = crate::error::shell_quote(name);
        if v.record.deleting {
            notes.push(format!(
                "volume {name}: a delete was cut short; the volume is served read-only, \
                 the LBAs it had released already reading as zeros, until \
                 `{dedupd} volume delete {word}` finishes it"
            ));
        } else if let Some(to) = v.record.shrinking_to_bytes {
            notes.push(format!(
                "volume {name}: a shrink to {to} bytes was cut short; it takes no writes \
                 past that size (where LBAs it had released already read as zeros) until \
                 `{dedupd} volume resize {word} {to} --shrink` finishes it"
            ));
        }
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_metadata_over_many_volumes_commits_near_max_dirty() {
        // 2 MiB: 512 pages
        let max_dirty_pages = 512u64;
        let e = Engine::in_memory_over(
            HashAlgorithm::Sha256,
            EngineConfig {
                max_dirty_bytes: max_dirty_pages * crate::paged::PAGE_SIZE as u64,
                ..EngineConfig::default()
            },
            Box::new(crate::backend::MemoryBackend::default()),
        );
        let vols: Vec<VolumeId> = (0..50)
            .map(|i| e.create_volume(&format!("v{i}"), 1 << 30).unwrap())
            .collect();
        let (mut peak, mut commits) = (0u64, 0);
        let mut last = 0u64;
        for i in 0..6000u64 {
            // each write lands in another map page
            let lba = (i * 7919) % (1 << 18);
            let mut b = vec![1u8; BLOCK_SIZE];
            b[..8].copy_from_slice(&i.to_le_bytes());
            e.write(vols[(i % 50) as usize], lba * 4096, &b, false)
                .unwrap();
            let dirty = lock(&e.meta).dirty_pages() as u64;
            if dirty < last {
                commits += 1;
            }
            last = dirty;
            peak = peak.max(dirty);
        }
        assert!(commits >= 10, "{commits} commits");
        // a write here dirties a few pages (map, reference count, reverse
        // index): the bound is passed by about the pages of the write that
        // passes it and of the next one, which commits
        assert!(peak <= max_dirty_pages + 16, "{peak} dirty pages");
        assert!(e.check().is_empty());
    }

    #[test]
    fn the_modelled_state_and_counters_are_as_long_as_those_a_store_writes() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let lens = |e: &Engine| {
            let m = lock(&e.meta);
            let model = &m.journal_model;
            (
                model.state_bytes,
                m.encoded_state().len() as u64,
                model.counters_bytes,
                m.encoded_counters(m.commit_generation).len() as u64,
            )
        };
        let a = e.create_volume("a", 1 << 20).unwrap();
        e.create_volume("b-with-a-longer-name", 1 << 30).unwrap();
        e.flush().unwrap();
        let (state, real_state, counters, real_counters) = lens(&e);
        assert_eq!(state, Some(real_state));
        assert_eq!(counters, real_counters);
        e.checkpoint().unwrap();
        // counters change, the volume table does not: only the counters
        // are logged
        for i in 0..3u8 {
            e.write(a, u64::from(i) * 4096, &[i + 1; BLOCK_SIZE], false)
                .unwrap();
            e.flush().unwrap();
            let (state, _, counters, real_counters) = lens(&e);
            assert_eq!(state, None);
            assert_eq!(counters, real_counters);
        }
        // the table changes: logged again
        e.resize_volume("a", 1 << 40).unwrap();
        e.set_sequence_threshold("b-with-a-longer-name", Some(4))
            .unwrap();
        e.flush().unwrap();
        let (state, real_state, ..) = lens(&e);
        assert_eq!(state, Some(real_state));
        e.delete_volume("b-with-a-longer-name").unwrap();
        e.flush().unwrap();
        let (state, real_state, ..) = lens(&e);
        assert_eq!(state, Some(real_state));
        assert!(real_state > 0);
    }

    #[test]
    fn a_threshold_of_one_set_on_a_volume_that_took_the_default_queues_it_whole() {
        // this engine's T is 1, but the volume may have run under a server
        // whose T was higher: its duplicates may wait for a whole pass
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        e.create_volume("v", 1 << 20).unwrap();
        assert_eq!(lock(&e.meta).skipped.stats().volumes, 0);
        e.set_sequence_threshold("v", Some(1)).unwrap();
        assert_eq!(lock(&e.meta).skipped.stats().volumes, 1);
    }

    /// On-disk fingerprint groups in memory whose reads fail once `failing`
    /// is set (a bad sector under `fpgroups`).
    struct FlakyGroups {
        groups: crate::index::MemoryGroupStore,
        failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl crate::index::GroupStore for FlakyGroups {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            if self.failing.load(Ordering::Relaxed) {
                return Err(std::io::Error::other("bad sector"));
            }
            self.groups.read_at(buf, offset)
        }
        fn write_at(&mut self, data: &[u8], offset: u64) -> std::io::Result<()> {
            self.groups.write_at(data, offset)
        }
    }

    #[test]
    fn an_unreadable_fingerprint_store_makes_misses_not_failed_writes() {
        unreadable_fingerprint_store_makes_misses(false);
    }

    #[test]
    fn an_unreadable_fingerprint_store_makes_misses_with_sampling_too() {
        // (CAFTL sampling looks a request's sample up before the rest)
        unreadable_fingerprint_store_makes_misses(true);
    }

    fn unreadable_fingerprint_store_makes_misses(sampling: bool) {
        let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let config = EngineConfig {
            sampling,
            index: crate::index::IndexConfig {
                // inline lookups read the on-disk groups; a budget of a
                // few groups, so most fingerprints are only there
                lookup: crate::index::LookupMode::Disk,
                memory_budget_bytes: 16 << 10,
                ..crate::index::IndexConfig::default()
            },
            ..EngineConfig::default()
        };
        let index = FingerprintIndex::new(
            config.index,
            Box::new(FlakyGroups {
                groups: crate::index::MemoryGroupStore::default(),
                failing: failing.clone(),
            }),
        );
        let meta = Meta {
            next_volume_id: 1,
            ..Meta::empty(index)
        };
        let e = Engine::assemble(
            HashAlgorithm::Sha256,
            Box::new(crate::backend::MemoryBackend::default()),
            meta,
            None,
            config,
        );
        let v = e.create_volume("v", 64 << 20).unwrap();
        let block = |k: u64| {
            let mut b = vec![0u8; BLOCK_SIZE];
            b[..8].copy_from_slice(&(k + 1).to_le_bytes());
            b
        };
        const N: u64 = 4096;
        for k in 0..N {
            e.write(v, k * 4096, &block(k), false).unwrap();
        }
        assert!(e.stats().index.entries_on_disk > 0);
        // the same contents again, one block and 8 blocks a request, while
        // the on-disk groups cannot be read: stored, as copies of their own
        failing.store(true, Ordering::Relaxed);
        for k in 0..64 {
            e.write(v, (N + k) * 4096, &block(k), false).unwrap();
        }
        let run: Vec<u8> = (64..72).flat_map(block).collect();
        e.write(v, (N + 64) * 4096, &run, false).unwrap();
        assert!(e.stats().index_errors > 0);
        failing.store(false, Ordering::Relaxed);
        let mut buf = vec![0u8; BLOCK_SIZE];
        for k in 0..72 {
            e.read(v, (N + k) * 4096, &mut buf).unwrap();
            assert_eq!(buf, block(k), "block {k}");
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn volumes_are_found_by_name_after_creates_and_deletes() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let a = e.create_volume("a", 1 << 20).unwrap();
        let b = e.create_volume("b", 2 << 20).unwrap();
        assert_eq!(e.volume("a"), Some((a, 1 << 20)));
        assert_eq!(e.volume("b"), Some((b, 2 << 20)));
        assert!(matches!(
            e.create_volume("a", 1 << 20),
            Err(EngineError::VolumeExists(_))
        ));
        e.delete_volume("a").unwrap();
        assert_eq!(e.volume("a"), None);
        assert!(matches!(
            e.delete_volume("a"),
            Err(EngineError::NoSuchVolume(_))
        ));
        let a2 = e.create_volume("a", 3 << 20).unwrap();
        assert_ne!(a2, a);
        assert_eq!(e.volume("a"), Some((a2, 3 << 20)));
        assert_eq!(e.volume("b"), Some((b, 2 << 20)));
    }

    #[test]
    fn a_failed_delete_keeps_the_mark_of_another_running_one() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], true).unwrap();
        {
            let mut m = lock(&e.meta);
            // a second delete of v counts itself in while this one runs
            // (it found the volume as this one leaves it marked, so it
            // would never undo the mark itself)
            m.volumes.get_mut(&v).unwrap().deletes_running = 1;
            // and this one's commit fails
            m.data_sync_failure = Some("injected".into());
        }
        assert!(e.delete_volume("v").is_err());
        assert!(
            e.volume_read_only(v),
            "the running delete's mark was undone"
        );
    }

    #[test]
    fn a_write_back_over_a_remapped_block_is_refused() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], false).unwrap();
        let mut block = vec![0u8; BLOCK_SIZE];
        let read = e.read_mapped(v, 0, &mut block).unwrap();
        // a whole-block write lands after the read
        e.write(v, 0, &[2u8; BLOCK_SIZE], false).unwrap();
        block[..512].fill(9);
        assert!(!e.write_full_blocks(v, 0, &block, Some(read)).unwrap());
        e.read(v, 0, &mut block).unwrap();
        assert!(block.iter().all(|&b| b == 2));
        // so does a commit that returns freed blocks for reuse: the bytes
        // of what was read might be another block's now
        let read = e.read_mapped(v, 0, &mut block).unwrap();
        e.write(v, 4096, &[3u8; BLOCK_SIZE], false).unwrap();
        e.write(v, 4096, &[4u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        assert!(!e.write_full_blocks(v, 0, &block, Some(read)).unwrap());
        // unchanged: written
        let read = e.read_mapped(v, 0, &mut block).unwrap();
        block[..512].fill(9);
        assert!(e.write_full_blocks(v, 0, &block, Some(read)).unwrap());
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_partial_write_racing_a_whole_block_write_never_brings_back_old_bytes() {
        let e = std::sync::Arc::new(Engine::in_memory(HashAlgorithm::Sha256));
        let v = e.create_volume("v", 1 << 20).unwrap();
        for round in 0..1500u32 {
            let old = [(round % 200) as u8 + 1; BLOCK_SIZE];
            e.write(v, 0, &old, false).unwrap();
            let full: Vec<u8> = (0..BLOCK_SIZE)
                .map(|i| (round as usize * 7 + i) as u8 | 1)
                .collect();
            let (a, b) = (e.clone(), e.clone());
            let partial = std::thread::spawn(move || a.write(v, 0, &[0xee; 512], false));
            let whole = {
                let full = full.clone();
                std::thread::spawn(move || b.write(v, 0, &full, false))
            };
            partial.join().unwrap().unwrap();
            whole.join().unwrap().unwrap();
            let mut got = vec![0u8; BLOCK_SIZE];
            e.read(v, 0, &mut got).unwrap();
            // either order leaves the whole write's bytes past the sector
            assert!(
                got[512..] == full[512..],
                "round {round}: bytes neither write left"
            );
            assert!(got[..512] == full[..512] || got[..512].iter().all(|&x| x == 0xee));
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_repeated_delete_that_cannot_commit_leaves_the_volume_marked() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], false).unwrap();
        // a delete cut short earlier: marked, some blocks released
        {
            let mut m = lock(&e.meta);
            let vol = m.volumes.get_mut(&v).unwrap();
            vol.deleting = true;
            vol.record.deleting = true;
        }
        // deleting again fails at its first commit
        e.reverse_cache
            .writes_dropped
            .fetch_add(1, Ordering::Relaxed);
        assert!(e.delete_volume("v").is_err());
        let m = lock(&e.meta);
        let vol = &m.volumes[&v];
        assert!(vol.deleting && vol.record.deleting && vol.read_only());
    }

    #[test]
    fn a_dropped_reverse_index_write_stops_writes_and_commits() {
        let d = tempfile::tempdir().unwrap();
        let e = Engine::create(
            &d.path().join("s"),
            HashAlgorithm::Sha256,
            EngineConfig::default(),
        )
        .unwrap();
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        e.write(v, 4096, &[2u8; BLOCK_SIZE], false).unwrap();
        // as a fingerprint dropped on a page the reverse index could not
        // read back (see pagecache's tests for the drop itself)
        e.reverse_cache
            .writes_dropped
            .fetch_add(1, Ordering::Relaxed);
        let err = e.write(v, 2 * 4096, &[3u8; BLOCK_SIZE], false).unwrap_err();
        assert!(matches!(err, EngineError::MetadataUnreadable(_)), "{err:?}");
        // a replayed write too
        let fp = e.hash.fingerprint(&[3u8; BLOCK_SIZE]);
        assert!(matches!(
            e.write_fingerprinted(v, Lba(2), &[Some(fp)]).unwrap_err(),
            EngineError::MetadataUnreadable(_)
        ));
        // the write before it is not committed
        assert!(matches!(
            e.flush().unwrap_err(),
            EngineError::MetadataUnreadable(_)
        ));
        let mut buf = vec![0u8; BLOCK_SIZE];
        e.read(v, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
    }

    /// A memory backend whose first write, once armed, waits for the test
    /// to let it go (a write caught between its lookup and its mapping).
    struct GatedBackend {
        inner: crate::backend::MemoryBackend,
        armed: std::sync::Arc<AtomicBool>,
        entered: Mutex<std::sync::mpsc::Sender<()>>,
        release: Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl BlockBackend for GatedBackend {
        fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> std::io::Result<()> {
            self.inner.read_blocks(pba, buf)
        }
        fn write_blocks(&self, pba: Pba, data: &[u8]) -> std::io::Result<()> {
            if self.armed.swap(false, Ordering::SeqCst) {
                lock(&self.entered).send(()).unwrap();
                lock(&self.release).recv().unwrap();
            }
            self.inner.write_blocks(pba, data)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.inner.sync()
        }
        fn len_bytes(&self) -> std::io::Result<u64> {
            self.inner.len_bytes()
        }
    }

    #[test]
    fn a_write_in_flight_while_t_is_lowered_to_1_is_left_for_the_background_pass() {
        let (e, armed, entered, release) = gated_engine(EngineConfig {
            sequence_threshold_blocks: 4,
            ..EngineConfig::default()
        });
        let v = e.create_volume("v", 1 << 20).unwrap();
        let content = [6u8; BLOCK_SIZE];
        e.write(v, 10 * 4096, &content, false).unwrap();
        // a copy, filtered by T = 4 (a run of one), caught before mapping
        armed.store(true, Ordering::SeqCst);
        let writer = {
            let e = e.clone();
            std::thread::spawn(move || e.write(v, 0, &content, false).unwrap())
        };
        entered.recv().unwrap();
        // T lowered to 1 meanwhile queues the volume whole, and its scan
        // ends before the write is mapped
        e.set_sequence_threshold("v", Some(1)).unwrap();
        while e.dedup_pass(1 << 20).unwrap().work_remaining {}
        release.send(()).unwrap();
        writer.join().unwrap();
        assert_eq!(e.stats().sequence_filtered_blocks, 1);
        assert_eq!(e.stats().physical_blocks_stored, 2);
        // the background pass still finds the copy
        for _ in 0..4 {
            if !e.dedup_pass(1 << 20).unwrap().work_remaining {
                break;
            }
        }
        assert_eq!(e.stats().physical_blocks_stored, 1);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_skipped_buffer_past_its_bounds_is_refused_before_anything_is_created() {
        for bytes in [
            0,
            crate::skipped::MIN_CAPACITY_BYTES - 1,
            crate::skipped::MAX_CAPACITY_BYTES + 1,
        ] {
            refused_before_anything_is_created(
                || EngineConfig {
                    skipped_buffer_bytes: bytes,
                    ..EngineConfig::default()
                },
                "skipped buffer",
            );
        }
    }

    #[test]
    fn a_prehash_table_out_of_bounds_is_refused() {
        for bytes in [1, 7, crate::caftl::MAX_PREHASH_BYTES + 1, 1 << 50] {
            refused_before_anything_is_created(
                || EngineConfig {
                    prehash_bytes: bytes,
                    ..EngineConfig::default()
                },
                "--prehash",
            );
        }
    }

    #[test]
    fn a_journal_reserve_a_forced_commit_would_not_fit_is_refused() {
        refused_before_anything_is_created(
            || EngineConfig {
                journal_reserve_bytes: 8 << 20,
                max_dirty_bytes: 5 << 20,
                ..EngineConfig::default()
            },
            "--journal-reserve",
        );
    }

    /// Checks that `config` is refused (an error naming `what`) by create,
    /// which then creates nothing, and by open.
    fn refused_before_anything_is_created(config: impl Fn() -> EngineConfig, what: &str) {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let Err(err) = Engine::create(&path, HashAlgorithm::Sha256, config()) else {
            panic!("created");
        };
        assert!(matches!(err, EngineError::InvalidArgument(_)), "{err:?}");
        assert!(err.to_string().contains(what), "{err}");
        assert!(!path.exists());
        drop(Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap());
        let Err(err) = Engine::open(&path, config()) else {
            panic!("opened");
        };
        assert!(matches!(err, EngineError::InvalidArgument(_)), "{err:?}");
    }

    /// An in-memory engine with `config` over a [`GatedBackend`]: (engine,
    /// the gate's arming flag, "a write entered the gate", "let it go").
    fn gated_engine(
        config: EngineConfig,
    ) -> (
        std::sync::Arc<Engine>,
        std::sync::Arc<AtomicBool>,
        std::sync::mpsc::Receiver<()>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        let armed = std::sync::Arc::new(AtomicBool::new(false));
        let backend = GatedBackend {
            inner: crate::backend::MemoryBackend::default(),
            armed: armed.clone(),
            entered: Mutex::new(entered_tx),
            release: Mutex::new(release_rx),
        };
        let e = std::sync::Arc::new(Engine::in_memory_over(
            HashAlgorithm::Sha256,
            config,
            Box::new(backend),
        ));
        (e, armed, entered, release)
    }

    /// A 1 MiB volume `v` holding one block (content 1s at LBA 0) and a
    /// write of `data` at LBA `lba` on another thread, held once its data
    /// write began: (engine, volume, the writer, "let it go").
    #[allow(clippy::type_complexity)]
    fn held_write(
        lba: u64,
        data: Vec<u8>,
    ) -> (
        std::sync::Arc<Engine>,
        VolumeId,
        std::thread::JoinHandle<Result<()>>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (e, armed, entered, release) = gated_engine(EngineConfig::default());
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], false).unwrap();
        armed.store(true, Ordering::SeqCst);
        let writer = {
            let e = e.clone();
            std::thread::spawn(move || e.write(v, lba * 4096, &data, false))
        };
        entered.recv().unwrap();
        (e, v, writer, release)
    }

    /// Writes new content at LBA `lba` of a 1 MiB volume holding one
    /// other block, holds the write between its lookup and its mapping,
    /// and lets it go from the progress of `op` (a delete or shrink, once
    /// its release of blocks has passed that LBA). Returns the engine and
    /// the write's outcome.
    fn write_caught_behind(
        lba: u64,
        op: impl FnOnce(&Engine, &mut dyn FnMut(u64, u64)) -> Result<()>,
    ) -> (std::sync::Arc<Engine>, Result<()>) {
        let (e, _, writer, release) = held_write(lba, vec![2u8; BLOCK_SIZE]);
        let mut writer = Some(writer);
        let mut outcome = None;
        op(&e, &mut |_, _| {
            if let Some(w) = writer.take() {
                release.send(()).unwrap();
                outcome = Some(w.join().unwrap());
            }
        })
        .unwrap();
        (e, outcome.expect("the operation reported progress"))
    }

    #[test]
    fn a_write_caught_behind_a_delete_s_release_maps_nothing() {
        let (e, outcome) = write_caught_behind(5, |e, progress| {
            e.delete_volume_with_progress("v", progress).map(|_| ())
        });
        let err = outcome.unwrap_err();
        assert!(matches!(err, EngineError::VolumeDeleting(_)), "{err:?}");
        assert!(e.check().is_empty(), "{:?}", e.check());
        assert_eq!(e.stats().physical_blocks_stored, 0);
    }

    #[test]
    fn a_write_caught_behind_a_shrink_s_release_maps_nothing() {
        let (e, outcome) = write_caught_behind(200, |e, progress| {
            e.resize_volume_with_progress("v", 64 * 4096, progress)
        });
        let err = outcome.unwrap_err();
        assert!(matches!(err, EngineError::OutOfRange { .. }), "{err:?}");
        let (v, _) = e.volume("v").unwrap();
        assert!(e.check().is_empty(), "{:?}", e.check());
        assert_eq!(e.stats().physical_blocks_stored, 1);
        let mut buf = vec![0u8; BLOCK_SIZE];
        e.read(v, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
    }

    #[test]
    fn a_write_caught_behind_a_shrink_and_a_grow_maps_nothing() {
        // block 200 shares stored content (mapped before the data write),
        // block 201 is new (mapped after it); the volume shrinks past both
        // and grows back meanwhile
        let mut data = vec![1u8; 2 * BLOCK_SIZE];
        data[BLOCK_SIZE..].fill(2);
        let (e, v, writer, release) = held_write(200, data);
        e.resize_volume("v", 64 * 4096).unwrap();
        e.resize_volume("v", 1 << 20).unwrap();
        release.send(()).unwrap();
        let err = writer.join().unwrap().unwrap_err();
        assert!(matches!(err, EngineError::OutOfRange { .. }), "{err:?}");
        assert!(e.check().is_empty(), "{:?}", e.check());
        let mut buf = vec![7u8; 2 * BLOCK_SIZE];
        e.read(v, 200 * 4096, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&b| b == 0),
            "a refused write left blocks mapped"
        );
        // a write that saw no shrink begin goes through
        e.write(v, 200 * 4096, &[3u8; 2 * BLOCK_SIZE], false)
            .unwrap();
    }

    #[test]
    fn a_resize_while_a_shrink_runs_is_refused() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 4 << 20).unwrap();
        e.write(v, 0, &vec![5u8; 4 << 20], false).unwrap();
        let mut tried = Vec::new();
        e.resize_volume_with_progress("v", 64 * 4096, &mut |_, _| {
            if tried.is_empty() {
                tried.push(e.resize_volume("v", 8 << 20));
                tried.push(e.resize_volume("v", 32 * 4096));
            }
        })
        .unwrap();
        assert_eq!(tried.len(), 2, "no progress reported");
        for r in tried {
            assert!(
                matches!(r, Err(EngineError::VolumeShrinking { to_bytes, .. }) if to_bytes == 64 * 4096),
                "{r:?}"
            );
        }
        assert_eq!(e.volume("v").unwrap().1, 64 * 4096);
        assert!(e.check().is_empty(), "{:?}", e.check());
        // once it finished, a resize goes through
        e.resize_volume("v", 8 << 20).unwrap();
    }

    #[test]
    fn writes_past_the_new_end_are_refused_while_a_shrink_runs() {
        let e = std::sync::Arc::new(Engine::in_memory(HashAlgorithm::Sha256));
        let v = e.create_volume("v", 1 << 20).unwrap();
        let mut seen = Vec::new();
        e.resize_volume_with_progress("v", 64 * 4096, &mut |_, _| {
            seen.push((
                e.write(v, 100 * 4096, &[3u8; BLOCK_SIZE], false).is_err(),
                e.write(v, 10 * 4096, &[3u8; BLOCK_SIZE], false).is_ok(),
            ));
        })
        .unwrap();
        assert!(!seen.is_empty() && seen.iter().all(|&(past, inside)| past && inside));
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}
