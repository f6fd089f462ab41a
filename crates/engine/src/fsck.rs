//! `fsck`: checks a closed store's metadata against itself and its data,
//! and optionally repairs it (SmartDedup §3.4 "File System Consistency";
//! the invariants are listed in [`crate::meta`]).
//!
//! Checks: every volume map entry points inside the data file and no entry
//! lies past its volume's end; each PBA's reference count equals the LBAs
//! mapped to it (a count too high is a leaked block, too low a block that
//! would be freed while in use); metadata pages pass their checksums and
//! the files the store needs exist. A referenced block without a stored
//! fingerprint (stored unhashed) is hashed from its data, not reported;
//! with `rehash` every referenced block is read and re-fingerprinted, and
//! a stored fingerprint that contradicts its data is a problem. `repair`
//! rebuilds reference counts, the reverse index and free space from the
//! volume maps and the data, and writes everything back through the
//! journal. Duplicate copies (several referenced blocks with one
//! fingerprint: blocks inline dedup missed) are counted, not treated as
//! errors.
//!
//! Exit codes follow e2fsck: 0 clean, 1 errors corrected, 4 errors left
//! uncorrected, 8 operational error (16, a usage error, is the CLI's).

use std::path::Path;

use serde::Serialize;

use crate::block::{Pba, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::engine::{lock, Engine, EngineConfig};
use crate::error::Result;
use crate::fingerprint::{Fingerprint, FINGERPRINT_SIZE};
use crate::keysort::KeySorter;
use crate::paged::PAYLOAD_SIZE;

/// What fsck does.
#[derive(Debug, Clone, Copy, Default)]
pub struct FsckOptions {
    /// Fix what is wrong (rebuild reference counts, reverse index, free
    /// space; unmap entries that point outside the data file or lie past
    /// their volume's end; make damaged
    /// volumes writable again).
    pub repair: bool,
    /// Re-fingerprint every referenced block (reads all stored data).
    pub rehash: bool,
}

/// Lines of `problems` (and of `data_lost`) listed one by one; past it,
/// further ones are only counted (`problems_not_listed`,
/// `data_lost_not_listed`, and one closing line each saying how many), so a
/// store damaged throughout (a truncated or replaced data file) does not
/// fill memory with messages.
pub const NAMED_PROBLEMS_MAX: usize = 10_000;

/// A run of consecutive LBAs of one volume, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LbaRun {
    first: u64,
    last: u64,
}

impl LbaRun {
    /// "LBA 7", or "LBAs 7-9 (3)".
    fn describe(self) -> String {
        if self.first == self.last {
            format!("LBA {}", self.first)
        } else {
            format!(
                "LBAs {}-{} ({})",
                self.first,
                self.last,
                self.last - self.first + 1
            )
        }
    }
}

/// Runs of consecutive LBAs of each volume, built as LBAs arrive in order
/// (volume by volume, LBAs ascending): at most [`NAMED_PROBLEMS_MAX`] runs
/// are kept; an LBA that would start a run past that is only counted.
#[derive(Debug, Default)]
struct LbaRuns {
    runs: Vec<(crate::VolumeId, LbaRun)>,
    /// LBAs per volume, listed in `runs` or not.
    total: std::collections::BTreeMap<crate::VolumeId, u64>,
}

impl LbaRuns {
    fn push(&mut self, id: crate::VolumeId, lba: u64) {
        *self.total.entry(id).or_default() += 1;
        if let Some((v, run)) = self.runs.last_mut() {
            if *v == id && run.last.checked_add(1) == Some(lba) {
                run.last = lba;
                return;
            }
        }
        if self.runs.len() < NAMED_PROBLEMS_MAX {
            self.runs.push((
                id,
                LbaRun {
                    first: lba,
                    last: lba,
                },
            ));
        }
    }

    /// LBAs of volume `id` found but in no run.
    fn not_listed(&self, id: crate::VolumeId) -> u64 {
        let listed: u64 = self
            .runs
            .iter()
            .filter(|(v, _)| *v == id)
            .map(|(_, r)| r.last - r.first + 1)
            .sum();
        self.total.get(&id).copied().unwrap_or(0) - listed
    }
}

/// A run of consecutive PBAs with the same reference-count problem, for
/// messages: "PBA 7: ..." or "PBAs 7-9 (3): ...".
#[derive(Debug, Clone, PartialEq, Eq)]
struct PbaProblemRun {
    first: u64,
    last: u64,
    /// What the problem says of each PBA of the run.
    what: String,
}

impl PbaProblemRun {
    fn describe(&self) -> String {
        if self.first == self.last {
            format!("PBA {}: {}", self.first, self.what)
        } else {
            format!(
                "PBAs {}-{} ({}): {}",
                self.first,
                self.last,
                self.last - self.first + 1,
                self.what
            )
        }
    }
}

impl FsckReport {
    /// Lists a problem, or counts it past [`NAMED_PROBLEMS_MAX`].
    fn note_problem(&mut self, line: String) {
        if self.problems.len() < NAMED_PROBLEMS_MAX {
            self.problems.push(line);
        } else {
            self.problems_not_listed += 1;
        }
    }

    /// Lists lost data, or counts it past [`NAMED_PROBLEMS_MAX`].
    fn note_lost(&mut self, line: String) {
        if self.data_lost.len() < NAMED_PROBLEMS_MAX {
            self.data_lost.push(line);
        } else {
            self.data_lost_not_listed += 1;
        }
    }

    /// Lists a line that sums up `count` LBAs no listed run names (as a
    /// problem, and as lost data if `lost` is given).
    fn note_summary(&mut self, problem: String, lost: Option<String>, count: u64) {
        self.problems.push(problem);
        self.lbas_not_listed += count;
        if let Some(lost) = lost {
            self.data_lost.push(lost);
        }
    }

    /// Closes the lists with how many lines were only counted.
    fn close_lists(&mut self) {
        if self.problems_not_listed > 0 {
            self.problems.push(format!(
                "... and {} more problems not listed",
                self.problems_not_listed
            ));
        }
        if self.data_lost_not_listed > 0 {
            self.data_lost.push(format!(
                "... and {} more not listed",
                self.data_lost_not_listed
            ));
        }
    }
}

/// The file in the store where `fsck --repair` appends the data it
/// discards, before it commits (a line with the time, then its "data
/// lost" lines); the store's open
/// notes it while it exists.
pub const DATA_LOST_FILE: &str = "fsck-data-lost.txt";

/// Appends `r`'s lost-data lines to `path` under a line naming the repair
/// (seconds since the Unix epoch), durably (the file synced, and its
/// directory when the file is new).
///
/// Errors: writing or syncing.
fn save_data_lost(path: &Path, r: &FsckReport) -> std::io::Result<()> {
    use std::io::Write as _;
    let existed = path.exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut text = format!(
        "fsck --repair at {secs} s since the Unix epoch (unless its report says it failed, it discarded these):\n"
    );
    for line in &r.data_lost {
        text.push_str(line);
        text.push('\n');
    }
    if r.data_lost_not_listed > 0 {
        text.push_str(&format!(
            "... and {} more not listed\n",
            r.data_lost_not_listed
        ));
    }
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    if !existed {
        if let Some(parent) = path.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
    }
    Ok(())
}

/// The outcome of a check.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FsckReport {
    /// Volumes checked.
    pub volumes: u64,
    /// LBAs mapped, over all volumes.
    pub mapped_blocks: u64,
    /// PBAs referenced by at least one LBA.
    pub referenced_blocks: u64,
    /// Blocks re-fingerprinted (with `rehash`, or where the reverse index was damaged).
    pub blocks_rehashed: u64,
    /// PBAs with a reference count but no mapping LBA (leaked space).
    pub leaked_blocks: u64,
    /// Referenced PBAs whose data no longer matches the fingerprint they
    /// were stored with (found by `rehash`): changed on disk, so every LBA
    /// mapping them reads the changed bytes. A repair re-fingerprints them
    /// (new writes of the old content then no longer share them) and lists
    /// them in `data_lost`; it cannot bring the old bytes back.
    pub corrupted_blocks: u64,
    /// The journal is missing or lost commits (a transaction damaged with
    /// intact ones after it): a repair needs `rehash` (blocks those commits
    /// freed may hold other data now).
    pub journal_lost_commits: bool,
    /// `repair` was asked for without `rehash` on a store whose journal
    /// lost commits: it ran as a check, changing nothing.
    pub repair_refused: bool,
    /// LBAs whose mapping points past the end of the data file (their
    /// block is missing; a repair unmaps them).
    pub lbas_outside_data_file: u64,
    /// Referenced PBAs whose data could not be read where the check needed
    /// it (an I/O error of the data file): listed in `problems` and
    /// `data_lost`, left as they are by a repair (which then exits 4), and
    /// not compared with other blocks.
    pub unreadable_blocks: u64,
    /// Referenced PBAs whose fingerprint another referenced PBA also has: a
    /// copy inline dedup missed (not an error; out-of-line dedup merges
    /// them; with verify, possibly a true collision). Fingerprints are
    /// compared by their first 64 bits (two different ones agree there
    /// with odds of 2^-64 per pair), so the count's memory stays within
    /// the index budget however many copies a block has.
    pub duplicate_copies: u64,
    /// What opening the store found that is not a problem of its
    /// consistency (a damaged `skipped.json`, whose pending work is queued
    /// again whole; no space for the on-disk fingerprint store), as the
    /// server warns of it at start.
    pub notes: Vec<String>,
    /// One line per problem found.
    pub problems: Vec<String>,
    /// True if the problems were repaired and the store written back.
    pub repaired: bool,
    /// Problems that a repair could fix only by discarding data (listed
    /// also in `problems`).
    pub data_lost: Vec<String>,
    /// Problem lines past the first [`NAMED_PROBLEMS_MAX`], only counted.
    pub problems_not_listed: u64,
    /// Lost-data lines past the first [`NAMED_PROBLEMS_MAX`], only counted.
    pub data_lost_not_listed: u64,
    /// LBAs mapped past the data file's end or past their volume's end
    /// that no listed run names (more runs than [`NAMED_PROBLEMS_MAX`]):
    /// summed up in one line per volume ("N more LBAs ...").
    pub lbas_not_listed: u64,
    /// Set when a repair was committed (its journal transaction is
    /// durable, and replays at the next start) but closing the store, which
    /// puts it in place, failed: why. The report stands.
    pub close_error: Option<String>,
}

impl FsckReport {
    /// Problem lines, listed or not (the closing "more not listed" line
    /// not counted; a line that sums up LBAs of a volume counts once).
    pub fn problem_count(&self) -> u64 {
        self.problems.len() as u64 - u64::from(self.problems_not_listed > 0)
            + self.problems_not_listed
    }

    /// e2fsck-style exit code: 0 clean, 1 corrected, 4 uncorrected (also
    /// after a repair that left unreadable blocks).
    pub fn exit_code(&self) -> i32 {
        if self.problems.is_empty() {
            0
        } else if self.repaired && self.unreadable_blocks == 0 {
            1
        } else {
            4
        }
    }
}

/// Lists the pending run of PBAs with one count problem, if any.
fn flush_pba_run(r: &mut FsckReport, run: &mut Option<PbaProblemRun>) {
    if let Some(done) = run.take() {
        r.note_problem(done.describe());
    }
}

/// Blocks (LBAs or PBAs) between two progress calls of
/// [`fsck_with_progress`] (256 MiB of volume or data).
pub const FSCK_PROGRESS_STEP_BLOCKS: u64 = 1 << 16;

/// Calls `f` with each PBA in `range` whose reference count is not zero,
/// in order, a reference-count page at a time: pages that are holes are
/// skipped without a look, so a long, sparse file costs what it holds.
fn for_each_referenced<E>(
    m: &mut crate::meta::Meta,
    range: std::ops::Range<u64>,
    mut f: impl FnMut(&mut crate::meta::Meta, u64) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    const PER_PAGE: u64 = (PAYLOAD_SIZE / 4) as u64;
    let mut start = range.start;
    let mut found = Vec::with_capacity(PER_PAGE as usize);
    while start < range.end {
        let Some(page) = m
            .refcounts
            .next_present_page(start / PER_PAGE, range.end.div_ceil(PER_PAGE))
        else {
            break;
        };
        start = start.max(page * PER_PAGE);
        let upto = ((page + 1) * PER_PAGE).min(range.end);
        found.clear();
        m.refcounts
            .for_each_nonzero_u32(start..upto, |p, _| found.push(p));
        for &p in &found {
            f(m, p)?;
        }
        start = upto;
    }
    Ok(())
}

/// Checks (and with `opts.repair`, repairs) the store at `path`, which must
/// not be open in another process.
///
/// Errors: those of [`Engine::open`] other than damaged metadata pages
/// (which are reported as problems), and I/O errors reading data or
/// writing the repair.
pub fn fsck(path: &Path, opts: FsckOptions) -> Result<FsckReport> {
    fsck_with(path, opts, EngineConfig::default())
}

/// [`fsck`] with the memory bounds of `config` (index budget, metadata
/// caches), which also bound the check's own sorts: fsck's memory does not
/// grow with the store. `allow_damaged_metadata` and
/// `settings_from_store` are set whatever `config` says.
///
/// Errors: as [`fsck`].
pub fn fsck_with(path: &Path, opts: FsckOptions, config: EngineConfig) -> Result<FsckReport> {
    fsck_with_progress(path, opts, config, &mut |_, _, _| {})
}

/// [`fsck_with`], calling `progress(phase, done, total)` as the check goes
/// (once the store is open): `"checking volume maps"` with LBAs of the
/// volumes looked at, of all volumes' LBAs; `"checking blocks"` (or
/// `"re-fingerprinting blocks"` with `rehash`) with PBAs passed, of the
/// reference-count array's PBAs; with `repair`, `"repairing"` with PBAs
/// passed again. Each phase ends with a call where `done` equals `total`;
/// calls come at most every [`FSCK_PROGRESS_STEP_BLOCKS`] blocks.
///
/// Errors: as [`fsck`].
pub fn fsck_with_progress(
    path: &Path,
    opts: FsckOptions,
    config: EngineConfig,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<FsckReport> {
    let config = EngineConfig {
        allow_damaged_metadata: true,
        settings_from_store: true,
        ..config
    };
    let (dir, sb) = crate::store::StoreDir::open_for_repair(path)?;
    let (engine, rebuilt) = match sb {
        Ok(sb) => (Engine::open_dir(path, dir, sb, config)?, None),
        Err(why) => {
            // a superblock rebuilt from the rest of the store: the format
            // from the state's shape, the fingerprint algorithm from stored
            // blocks and their fingerprints, the index's prefix bits from
            // the configuration (they leave no trace: the on-disk groups
            // are rebuilt at every open)
            let sb = provisional_superblock(&dir, config.index.prefix_bits)?;
            let mut engine = Engine::open_dir(path, dir, sb.clone(), config)?;
            let found = match engine.infer_hash() {
                Ok(found) => found,
                Err(e) => {
                    engine.drop_without_closing();
                    return Err(e);
                }
            };
            engine.hash = found.unwrap_or_default();
            let sb = crate::store::Superblock {
                hash: engine.hash,
                ..sb
            };
            (engine, Some((sb, why, found.is_some())))
        }
    };
    let mut report = match engine.check_and_repair(opts, progress) {
        Ok(r) => r,
        Err(e) => {
            // (a repair that failed committed nothing; a check writes nothing)
            let journal_made = opts.repair
                && engine
                    .damage
                    .iter()
                    .any(|d| d.missing && d.file.ends_with("journal"));
            let root = engine.dir.as_ref().map(|d| d.root().to_path_buf());
            engine.drop_without_closing();
            // a journal this repair made anew goes again (it is not in
            // place yet: the store stays refused until a repair finishes)
            if let Some(root) = root.filter(|_| journal_made) {
                let _ = std::fs::remove_file(root.join(crate::engine::REPAIR_JOURNAL_FILE));
                let _ = crate::store::sync_dir(&root);
            }
            return Err(e);
        }
    };
    if let Some((sb, why, found)) = rebuilt {
        report.problems.insert(
            0,
            format!(
                "superblock: {why}; {} from the store: format {}, fingerprints {}{}, \
                 index prefix bits {} (not recorded elsewhere: a store created with others \
                 gets them back with --index-prefix-bits)",
                if opts.repair {
                    "rebuilt"
                } else {
                    "can be rebuilt (--repair)"
                },
                sb.format_version,
                sb.hash.name(),
                if found {
                    ""
                } else {
                    " (no fingerprinted block to tell the algorithm by: the default assumed)"
                },
                sb.index_prefix_bits
            ),
        );
        if opts.repair && !report.repair_refused {
            let written = engine
                .dir
                .as_ref()
                .map_or(Ok(()), |d| d.replace_superblock(&sb));
            if let Err(e) = written {
                engine.drop_without_closing();
                return Err(e);
            }
            report.repaired = true;
        }
    }
    // (the open's notes first, then the check's own)
    let mut notes = engine.notes().to_vec();
    notes.append(&mut report.notes);
    report.notes = notes;
    report.close_lists();
    // a repair also puts right what opening the store noted (a damaged
    // `skipped.json` is saved again, every volume queued whole), which a
    // close does even where the metadata needed nothing
    let rewrite_notes = opts.repair
        && !report.repair_refused
        && !report.notes.is_empty()
        && report.problems.is_empty();
    if report.repaired || rewrite_notes {
        // (the repair is committed: its report, with the data it lost, is
        // not thrown away because putting it in place failed)
        match engine.close() {
            Err(e) => report.close_error = Some(e.to_string()),
            Ok(()) if rewrite_notes => {
                for n in report
                    .notes
                    .iter_mut()
                    .filter(|n| n.contains("skipped.json"))
                {
                    n.push_str(" (saved again by this repair)");
                }
            }
            Ok(()) => {}
        }
    } else {
        // a check writes nothing to the store, as e2fsck -n
        engine.drop_without_closing();
    }
    Ok(report)
}

/// A superblock for a store whose own is lost: the format version from
/// `state.json` and `counters.json` (format 1 keeps the counters in the
/// state; format 2 in `counters.json`), SHA-256
/// until [`Engine::infer_hash`] says otherwise, and `index_prefix_bits`.
///
/// Errors: `state.json` cannot be read or fails its checksum.
fn provisional_superblock(
    dir: &crate::store::StoreDir,
    index_prefix_bits: u32,
) -> Result<crate::store::Superblock> {
    let path = dir.path(crate::journal::MetaFile::State);
    let bytes = dir.blob_bytes(crate::journal::MetaFile::State, &[])?;
    let state: crate::store::State = crate::store::decode_checked(&bytes, &path)?;
    // a format-2 store may keep the state of its format-1 days (the state
    // is written only when the volume table changes), counters included:
    // a counters.json at least as recent as those counters says format 2
    // (a format-1 store's counters.json, left by an upgrade that did not
    // finish, is older than the state's counters once a commit followed)
    let format_version = match &state.counters {
        None => 2,
        Some(_) => {
            let cpath = dir.path(crate::journal::MetaFile::Counters);
            let newer = dir
                .blob_bytes(crate::journal::MetaFile::Counters, &[])
                .ok()
                .filter(|b| !b.is_empty())
                .and_then(|b| {
                    crate::store::decode_checked::<crate::store::CounterState>(&b, &cpath).ok()
                })
                .is_some_and(|c| c.journal_seq >= state.journal_seq);
            if newer {
                2
            } else {
                1
            }
        }
    };
    Ok(crate::store::Superblock {
        magic: crate::store::SUPERBLOCK_MAGIC.into(),
        format_version,
        block_size: BLOCK_SIZE as u32,
        hash: crate::fingerprint::HashAlgorithm::default(),
        index_prefix_bits,
    })
}

/// Fingerprinted blocks [`Engine::infer_hash`] reads at most.
const HASH_SAMPLE_BLOCKS: u32 = 64;

impl Engine {
    /// The fingerprint algorithm the store's blocks were fingerprinted
    /// with, told by hashing up to 64 referenced blocks both ways and
    /// comparing with their stored fingerprints; `None` if no referenced
    /// block has a fingerprint.
    ///
    /// Errors: [`crate::error::EngineError::Corrupt`] naming the superblock
    /// if fingerprinted blocks exist but none matches either way.
    fn infer_hash(&self) -> Result<Option<crate::fingerprint::HashAlgorithm>> {
        use crate::fingerprint::HashAlgorithm;
        let mut m = lock(&self.meta);
        let rc_len = m.refcounts.logical_len() / 4;
        let (mut tried, mut sha256, mut blake3) = (0u32, 0u32, 0u32);
        let mut block = vec![0u8; BLOCK_SIZE];
        let _ = for_each_referenced(&mut m, 0..rc_len, |m, p| {
            let stored = m.fingerprint_of(Pba(p));
            if stored == crate::engine::UNHASHED {
                return Ok(());
            }
            tried += 1;
            if self.backend.read_blocks(Pba(p), &mut block).is_ok() {
                if HashAlgorithm::Sha256.fingerprint(&block) == stored {
                    sha256 += 1;
                } else if HashAlgorithm::Blake3.fingerprint(&block) == stored {
                    blake3 += 1;
                }
            }
            if tried >= HASH_SAMPLE_BLOCKS {
                return Err(());
            }
            Ok(())
        });
        match (sha256, blake3) {
            (0, 0) if tried == 0 => Ok(None),
            (0, 0) => Err(crate::error::EngineError::Corrupt {
                file: self
                    .dir
                    .as_ref()
                    .map(|d| d.root().join("superblock"))
                    .unwrap_or_default(),
                detail: format!(
                    "lost, and none of {tried} stored blocks matches its fingerprint under \
                     SHA-256 or BLAKE3: the fingerprint algorithm cannot be told; restore the \
                     superblock from a copy"
                ),
            }),
            (s, b) if s >= b => Ok(Some(HashAlgorithm::Sha256)),
            _ => Ok(Some(HashAlgorithm::Blake3)),
        }
    }

    fn check_and_repair(
        &self,
        opts: FsckOptions,
        progress: &mut dyn FnMut(&str, u64, u64),
    ) -> Result<FsckReport> {
        // commits lost with the journal may have freed blocks that were
        // then reused for other data: their stored fingerprints, and so
        // the index a repair rebuilds from them, can be wrong (new writes
        // would share blocks by a fingerprint their bytes no longer have).
        // Such a repair without rehash runs as a check: nothing is changed,
        // in memory or on file
        let mut r = FsckReport {
            journal_lost_commits: self.damage.iter().any(|d| d.file.ends_with("journal")),
            ..FsckReport::default()
        };
        if r.journal_lost_commits {
            // (the damaged transactions cannot be decoded: which LBAs they
            // changed is not known)
            r.note_lost(
                "journal: the commits from its damaged transaction on (all it held, if \
                 it is missing) are lost, though acknowledged: the writes, TRIMs and \
                 volume changes they held read as before them (which LBAs cannot be \
                 told from the damaged journal)"
                    .to_string(),
            );
        }
        r.repair_refused = opts.repair && r.journal_lost_commits && !opts.rehash;
        let opts = FsckOptions {
            repair: opts.repair && !r.repair_refused,
            ..opts
        };
        let data_blocks = self
            .backend
            .len_bytes()
            .map_err(|e| crate::error::EngineError::io("reading the data file size", e))?
            // (whole blocks: a partial last one is damage, see Engine::open)
            / BLOCK_SIZE_U64;
        let mut m = lock(&self.meta);
        let faults_before = m.paging_faults();
        // (sorted: looked up for every referenced block)
        let mut fp_damaged_pages: Vec<u64> = self
            .damage
            .iter()
            .filter(|d| d.file.ends_with("fingerprints"))
            .flat_map(|d| d.pages.iter().copied())
            .collect();
        fp_damaged_pages.sort_unstable();
        fp_damaged_pages.dedup();
        for d in &self.damage {
            r.problems.push(d.describe());
        }

        // maps: entries inside the data file; every reference as a pair
        // (key, 1) whose key orders by PBA, counted through a scratch file,
        // so memory stays about the index budget whatever the store's size
        // (not 4 bytes per PBA), even with a block shared by millions of LBAs
        let pba_bits = (64 - data_blocks.leading_zeros()).max(1);
        let pba_of_key = |key: u64| key >> (64 - pba_bits);
        let budget = m.index.config().memory_budget_bytes;
        let scratch = || self.dir.as_ref().and_then(|d| d.scratch_file());
        let mut refs = KeySorter::counting(m.mapped_blocks, budget, 16, scratch());
        let ids: Vec<_> = m.volumes.keys().copied().collect();
        r.volumes = ids.len() as u64;
        // mappings past the data file's end: the first ones by LBA, and the
        // number per volume (all unmapped by a repair)
        let mut outside = LbaRuns::default();
        let mut beyond = LbaRuns::default();
        let maps_phase = "checking volume maps";
        let all_lbas: u64 = m.volumes.values().map(|v| v.size_blocks()).sum();
        let mut lbas_done = 0;
        progress(maps_phase, 0, all_lbas);
        for id in &ids {
            let v = &m.volumes[id];
            if v.map_missing {
                r.data_lost.push(format!(
                    "volume {}: its map file is missing; every LBA fails to read until a repair unmaps them all",
                    v.record.name
                ));
            } else if let Some(page) = v.map_truncated_at {
                r.data_lost.push(format!(
                    "volume {}: its map file ends at page {page} (truncated); the LBAs from {} on fail to read until a repair unmaps them",
                    v.record.name,
                    page * crate::paged::U64_PER_PAGE
                ));
            }
            if !v.map_missing && !v.damaged_pages.is_empty() {
                // (the LBAs each page holds, within the volume)
                const PER_PAGE: u64 = crate::paged::U64_PER_PAGE;
                let shown = &v.damaged_pages[..v.damaged_pages.len().min(16)];
                let lbas: Vec<String> = shown
                    .iter()
                    .map(|&page| {
                        let first = page * PER_PAGE;
                        let last = ((page + 1) * PER_PAGE).min(v.size_blocks().max(first + 1)) - 1;
                        format!("{first}-{last}")
                    })
                    .collect();
                let more = v.damaged_pages.len() - shown.len();
                let lost = format!(
                    "volume {}: map page{} {:?} damaged: LBAs {}{} lost (they fail to read until a repair unmaps them, then read as zeros)",
                    v.record.name,
                    if v.damaged_pages.len() == 1 { "" } else { "s" },
                    shown,
                    lbas.join(", "),
                    if more > 0 {
                        format!(" and those of {more} more pages")
                    } else {
                        String::new()
                    }
                );
                r.data_lost.push(lost);
            }
            // entries past the volume's end (in its map's last page, or a
            // map longer than the volume) are not references: they are
            // problems, unmapped by a repair (a later grow would otherwise
            // expose them)
            let map_end = v.map.logical_len() / 8;
            if map_end > v.size_blocks() {
                v.map
                    .for_each_nonzero_u64(v.size_blocks()..map_end, |lba, _| {
                        // (all unmapped by a repair)
                        beyond.push(*id, lba);
                    });
            }
            // (in steps, each with its progress; holes of a thin volume's
            // map passed over at once)
            let blocks = v.size_blocks();
            let mut from = 0;
            while from < blocks {
                const PER_PAGE: u64 = crate::paged::U64_PER_PAGE;
                let Some(page) = v
                    .map
                    .next_present_page(from / PER_PAGE, blocks.div_ceil(PER_PAGE))
                else {
                    break;
                };
                from = from.max(page * PER_PAGE);
                let to = (from + FSCK_PROGRESS_STEP_BLOCKS).min(blocks);
                v.map.for_each_nonzero_u64(from..to, |lba, raw| {
                    let p = raw - 1;
                    r.mapped_blocks += 1;
                    if p < data_blocks {
                        refs.push(p << (64 - pba_bits), 1);
                    } else {
                        outside.push(*id, lba);
                    }
                });
                progress(maps_phase, lbas_done + to, all_lbas);
                from = to;
            }
            lbas_done += blocks;
            progress(maps_phase, lbas_done, all_lbas);
        }
        for &(id, lbas) in &beyond.runs {
            let v = &m.volumes[&id];
            r.note_problem(format!(
                "volume {}: {} past the volume's end ({} blocks) but mapped",
                v.record.name,
                lbas.describe(),
                v.size_blocks()
            ));
        }
        for &(id, lbas) in &outside.runs {
            let name = &m.volumes[&id].record.name;
            r.note_problem(format!(
                "volume {name}: {} mapped past the end of the data file",
                lbas.describe()
            ));
            r.note_lost(format!(
                "volume {name}: {} unmapped (data missing)",
                lbas.describe()
            ));
        }
        for &id in beyond.total.keys() {
            let more = beyond.not_listed(id);
            if more > 0 {
                let v = &m.volumes[&id];
                r.note_summary(
                    format!(
                        "volume {}: {more} more LBAs past the volume's end ({} blocks) but mapped",
                        v.record.name,
                        v.size_blocks()
                    ),
                    None,
                    more,
                );
            }
        }
        for (&id, &count) in &outside.total {
            r.lbas_outside_data_file += count;
            let more = outside.not_listed(id);
            if more > 0 {
                let name = &m.volumes[&id].record.name;
                r.note_summary(
                    format!("volume {name}: {more} more LBAs map past the end of the data file"),
                    Some(format!(
                        "volume {name}: {more} more LBAs unmapped (their blocks are missing)"
                    )),
                    more,
                );
            }
        }

        // one pass over the PBAs in order, each with the number of LBAs
        // mapping it: reference counts (set right at once when repairing:
        // a difference is always a problem, so the repair below happens),
        // then the fingerprints of referenced blocks, collected for the
        // duplicate count
        let rc_len = m.refcounts.logical_len() / 4;
        let per_page = (PAYLOAD_SIZE / FINGERPRINT_SIZE) as u64;
        // a referenced block whose stored fingerprint cannot be used as it
        // is (none yet, or on a damaged page) is hashed from its data
        // wherever its fingerprint is needed, instead of being remembered
        // (a store of unhashed blocks would need an entry per block)
        let needs_hash = |p: u64, stored: &Fingerprint| {
            *stored == crate::engine::UNHASHED
                || fp_damaged_pages.binary_search(&(p / per_page)).is_ok()
        };
        // (None: the block cannot be read; the check goes on without it)
        let mut block = vec![0u8; BLOCK_SIZE];
        let mut hash_of = |p: u64| -> Option<Fingerprint> {
            self.backend.read_blocks(Pba(p), &mut block).ok()?;
            Some(self.hash.fingerprint(&block))
        };
        // (fingerprint key, 1) per referenced block, counted: equal keys
        // merge as they are sorted, so one block stored a million times
        // costs a pair, not a million
        let mut dups = KeySorter::counting(m.stored_blocks, budget, 16, scratch());
        let blocks_phase = if opts.rehash {
            "re-fingerprinting blocks"
        } else {
            "checking blocks"
        };
        progress(blocks_phase, 0, rc_len);
        let mut reported_step = 0;
        // (consecutive PBAs with the same count problem are named as a run)
        let mut pba_run: Option<PbaProblemRun> = None;
        // referenced blocks found unreadable or changed (the first
        // NAMED_PROBLEMS_MAX): the LBAs mapping them are named after the pass
        let mut damaged_pbas = std::collections::BTreeSet::new();
        let mut check = |m: &mut crate::meta::Meta, p: u64, want: u32| -> Result<()> {
            if p / FSCK_PROGRESS_STEP_BLOCKS > reported_step {
                reported_step = p / FSCK_PROGRESS_STEP_BLOCKS;
                progress(blocks_phase, p.min(rc_len), rc_len);
            }
            let rc = m.refcounts.get_u32(p);
            if rc != want {
                // (a block past the data file's end: its LBAs are named
                // above, mapped past the end; not leaked space)
                let past_end = p >= data_blocks;
                if rc > want && want == 0 && !past_end {
                    r.leaked_blocks += 1;
                }
                let what = format!(
                    "reference count {rc}, mapped by {want} LBA(s){}",
                    if past_end {
                        " (past the end of the data file)"
                    } else if rc < want {
                        " (would be freed while in use)"
                    } else if want == 0 {
                        " (leaked by a crash, or its LBAs' map entries were lost)"
                    } else {
                        ""
                    }
                );
                match &mut pba_run {
                    Some(run) if run.last + 1 == p && run.what == what => run.last = p,
                    _ => {
                        let new = PbaProblemRun {
                            first: p,
                            last: p,
                            what,
                        };
                        if let Some(done) = pba_run.replace(new) {
                            r.note_problem(done.describe());
                        }
                    }
                }
                if opts.repair {
                    m.refcounts.set_u32(p, want);
                }
            }
            if want == 0 {
                return Ok(());
            }
            r.referenced_blocks += 1;
            let stored = m.fingerprint_of(Pba(p));
            let fp = if opts.rehash || needs_hash(p, &stored) {
                r.blocks_rehashed += 1;
                let Some(actual) = hash_of(p) else {
                    flush_pba_run(&mut r, &mut pba_run);
                    if damaged_pbas.len() < NAMED_PROBLEMS_MAX {
                        damaged_pbas.insert(p);
                    }
                    r.unreadable_blocks += 1;
                    r.note_problem(format!("PBA {p}: cannot be read (I/O error)"));
                    r.note_lost(format!(
                        "PBA {p}: cannot be read; the {want} LBA(s) mapping it fail to read (left as they are)"
                    ));
                    return Ok(());
                };
                // an all-zero entry is a block not fingerprinted yet
                // (stored without inline dedup): filled in by a repair,
                // not an error
                if actual != stored && !needs_hash(p, &stored) {
                    // the fingerprint page passed its checksum: the data
                    // changed on disk, and no repair can undo that
                    flush_pba_run(&mut r, &mut pba_run);
                    if damaged_pbas.len() < NAMED_PROBLEMS_MAX {
                        damaged_pbas.insert(p);
                    }
                    r.corrupted_blocks += 1;
                    r.note_problem(format!(
                        "PBA {p}: stored fingerprint does not match its data"
                    ));
                    r.note_lost(format!(
                            "PBA {p}: its data changed on disk; the {want} LBA(s) mapping it read the changed bytes{}",
                            if opts.repair {
                                " (re-fingerprinted, so new writes no longer share it)"
                            } else {
                                ""
                            }
                        ),
                    );
                    if opts.repair {
                        m.fingerprints.set(p, &actual);
                    }
                }
                actual
            } else {
                stored
            };
            dups.push(crate::index::key_of(&fp), 1);
            Ok(())
        };
        let mut next = 0u64;
        let mut failure = None;
        refs.for_each_sorted::<std::io::Error>(|pairs| {
            for &(key, lbas) in pairs {
                let p = pba_of_key(key);
                let lbas = u32::try_from(lbas).unwrap_or(u32::MAX);
                // (PBAs no LBA maps matter only if counted)
                let checked = for_each_referenced(&mut m, next..p, |m, q| check(m, q, 0))
                    .and_then(|()| check(&mut m, p, lbas));
                if let Err(e) = checked {
                    failure = Some(e);
                    return Err(std::io::Error::other("fsck stopped"));
                }
                next = p + 1;
            }
            Ok(())
        })
        .map_err(|e| {
            failure.take().unwrap_or_else(|| {
                crate::error::EngineError::io("reading the scratch file back", e)
            })
        })?;
        for_each_referenced(&mut m, next..rc_len, |m, q| check(m, q, 0))?;
        flush_pba_run(&mut r, &mut pba_run);
        progress(blocks_phase, rc_len, rc_len);
        // the LBAs that read those blocks, volume by volume (one more pass
        // over the maps, only when a block was found damaged)
        if !damaged_pbas.is_empty() {
            let mut reading = LbaRuns::default();
            for id in &ids {
                let v = &m.volumes[id];
                v.map.for_each_nonzero_u64(0..v.size_blocks(), |lba, raw| {
                    if damaged_pbas.contains(&(raw - 1)) {
                        reading.push(*id, lba);
                    }
                });
            }
            for &(id, lbas) in &reading.runs {
                r.note_lost(format!(
                    "volume {}: {} read a damaged block (named above by PBA)",
                    m.volumes[&id].record.name,
                    lbas.describe()
                ));
            }
            for &id in reading.total.keys() {
                let more = reading.not_listed(id);
                if more > 0 {
                    r.note_lost(format!(
                        "volume {}: {more} more LBAs read a damaged block",
                        m.volumes[&id].record.name
                    ));
                }
            }
        }

        // a referenced block's fingerprint, from its data where the stored
        // one cannot be used (None: unreadable now), for the repair
        let mut fp_of = |m: &crate::meta::Meta, p: u64| -> Option<Fingerprint> {
            let stored = m.fingerprint_of(Pba(p));
            if needs_hash(p, &stored) {
                hash_of(p)
            } else {
                Some(stored)
            }
        };
        // equal fingerprints on two referenced PBAs: a duplicate copy that
        // inline dedup missed (memory-only lookups under a small budget) —
        // not an inconsistency; out-of-line dedup merges them
        // (the blocks' fingerprints as the check found them, their data's
        // where it was hashed; equal by their first 64 bits, where two
        // different fingerprints meet with odds of 2^-64 per pair)
        dups.for_each_sorted::<std::io::Error>(|pairs| {
            for &(_, copies) in pairs {
                r.duplicate_copies += copies.saturating_sub(1);
            }
            Ok(())
        })
        .map_err(|e| crate::error::EngineError::io("reading the scratch file back", e))?;

        // a map or count page that could not be read back during the check
        // read as zeros: its figures are wrong, so no report is given
        if m.paging_faults() > faults_before {
            crate::engine::fault_check(&m)?;
        }
        if r.repair_refused {
            r.problems.push(
                "the journal lost commits: blocks they freed may hold other data now, so \
                 a repair must fingerprint every stored block again: not repaired; run \
                 `fsck --repair --rehash`"
                    .into(),
            );
            return Ok(r);
        }
        if !opts.repair || r.problems.is_empty() {
            return Ok(r);
        }
        // what the repair discards is kept in the store before the repair
        // commits anything: a repair cut short after its commit (a crash,
        // a kill) leaves a store every later check finds clean, and this
        // list the only record of the data it lost
        if !r.data_lost.is_empty() || r.data_lost_not_listed > 0 {
            if let Some(dir) = &self.dir {
                let path = dir.root().join(DATA_LOST_FILE);
                save_data_lost(&path, &r).map_err(|e| {
                    crate::error::EngineError::io(
                        format!(
                            "saving the list of data the repair discards to {} (nothing repaired)",
                            path.display()
                        ),
                        e,
                    )
                })?;
                r.notes.push(format!(
                    "the data lost is also listed in {} (kept until deleted)",
                    path.display()
                ));
            }
        }
        // (the repair commits through it)
        let journal_missing = self
            .damage
            .iter()
            .any(|d| d.missing && d.file.ends_with("journal"));
        if journal_missing {
            drop(m);
            self.create_missing_journal()?;
            m = lock(&self.meta);
        }

        // repair: unmap entries outside the data file or past the volume's
        // end, rebuild counts and fingerprints, make damaged volumes
        // writable
        for id in outside.total.keys() {
            let v = m.volumes.get_mut(id).expect("listed above");
            // a map page's worth of LBAs at a time (bounded memory)
            for from in (0..v.size_blocks()).step_by(4096) {
                let to = (from + 4096).min(v.size_blocks());
                for (lba, raw) in v.map.nonzero_u64(from..to) {
                    if raw > data_blocks {
                        // (an entry is PBA + 1: this PBA is past the end)
                        v.map.set_u64(lba, 0);
                    }
                }
            }
        }
        for id in beyond.total.keys() {
            let v = m.volumes.get_mut(id).expect("listed above");
            let (start, end) = (v.size_blocks(), v.map.logical_len() / 8);
            // a map page's worth of LBAs at a time (bounded memory)
            for from in (start..end).step_by(4096) {
                for (lba, _) in v.map.nonzero_u64(from..(from + 4096).min(end)) {
                    v.map.set_u64(lba, 0);
                }
            }
        }
        // the fingerprints of referenced blocks: wrong ones, missing ones
        // (blocks stored unhashed) and those on damaged pages, from the data
        // (an unreadable block keeps what it has)
        progress("repairing", 0, rc_len);
        let mut reported_step = 0;
        for_each_referenced(&mut m, 0..rc_len, |m, p| {
            if p / FSCK_PROGRESS_STEP_BLOCKS > reported_step {
                reported_step = p / FSCK_PROGRESS_STEP_BLOCKS;
                progress("repairing", p, rc_len);
            }
            if let Some(fp) = fp_of(m, p) {
                if fp != m.fingerprint_of(Pba(p)) {
                    m.fingerprints.set(p, &fp);
                }
            }
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {});
        progress("repairing", rc_len, rc_len);
        for page in &fp_damaged_pages {
            m.fingerprints.redirty(*page);
        }
        for d in self.damage.iter().filter(|d| d.file.ends_with("refcounts")) {
            for page in &d.pages {
                m.refcounts.redirty(*page);
            }
        }
        // a missing reference-count or reverse-index file is created again
        // at its full length by the checkpoint, even if no entry changed
        // (all counts zero, say): the next open finds it
        for d in self.damage.iter().filter(|d| d.missing) {
            let (file, logical) = if d.file.ends_with("refcounts") {
                (
                    crate::journal::MetaFile::Refcounts,
                    m.refcounts.logical_len(),
                )
            } else if d.file.ends_with("fingerprints") {
                (
                    crate::journal::MetaFile::Fingerprints,
                    m.fingerprints.logical_len(),
                )
            } else {
                continue;
            };
            // (the cut to nothing tells the next open that the journal
            // holds the whole file: a crash before the checkpoint writes
            // it keeps the repair)
            m.structural_ops
                .push(crate::journal::Op::SetLen { file, len_bytes: 0 });
            m.structural_ops.push(crate::journal::Op::SetLen {
                file,
                len_bytes: crate::paged::disk_len(logical),
            });
        }
        for id in &ids {
            let v = m.volumes.get_mut(id).expect("listed above");
            for page in std::mem::take(&mut v.damaged_pages) {
                v.map.redirty(page);
            }
            let missing = std::mem::take(&mut v.map_missing);
            if missing || v.map_truncated_at.take().is_some() {
                // the checkpoint creates the file again (empty) or gives
                // it back its full length; a missing one is cut to nothing
                // first, as a new volume's is, so that until the checkpoint
                // writes it the next open knows it is made anew (the
                // state, saved with the repair, says the volume's creation
                // is so marked)
                if missing {
                    v.record.creation_marked = true;
                }
                let len_bytes = crate::paged::disk_len(v.size_blocks() * 8);
                let file = crate::journal::MetaFile::Map(*id);
                if missing {
                    m.structural_ops
                        .push(crate::journal::Op::SetLen { file, len_bytes: 0 });
                }
                m.structural_ops
                    .push(crate::journal::Op::SetLen { file, len_bytes });
            }
        }
        let scratch = self.dir.as_ref().and_then(|d| d.scratch_file());
        m.rebuild_derived(data_blocks, crate::meta::IndexPairs::Scan(scratch))
            .map_err(|e| crate::error::EngineError::io("rebuilding the fingerprint store", e))?;
        m.change_count += 1;
        m.state_dirty = true;
        drop(m);
        self.flush()?;
        if journal_missing {
            // (the repair is in it: the store opens with it from now on)
            self.journal_repaired_in_place()?;
        }
        r.repaired = true;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_lbas_are_named_as_runs() {
        let (a, b) = (crate::VolumeId(1), crate::VolumeId(2));
        let mut runs = LbaRuns::default();
        for (v, lba) in [(a, 3), (a, 4), (a, 5), (a, 9), (b, 10), (b, 11)] {
            runs.push(v, lba);
        }
        let named: Vec<(crate::VolumeId, String)> =
            runs.runs.iter().map(|&(v, r)| (v, r.describe())).collect();
        assert_eq!(
            named,
            [
                (a, "LBAs 3-5 (3)".to_string()),
                (a, "LBA 9".to_string()),
                (b, "LBAs 10-11 (2)".to_string()),
            ]
        );
        assert_eq!((runs.not_listed(a), runs.not_listed(b)), (0, 0));
    }

    #[test]
    fn lbas_past_the_listed_runs_are_counted_per_volume() {
        let (a, b) = (crate::VolumeId(1), crate::VolumeId(2));
        let mut runs = LbaRuns::default();
        // every other LBA: a run each
        for i in 0..NAMED_PROBLEMS_MAX as u64 + 5 {
            runs.push(a, 2 * i);
        }
        // the last run still grows; new ones are only counted
        runs.push(a, 2 * (NAMED_PROBLEMS_MAX as u64 + 4) + 1);
        runs.push(b, 0);
        assert_eq!(runs.runs.len(), NAMED_PROBLEMS_MAX);
        assert_eq!(runs.not_listed(a), 5 + 1);
        assert_eq!(runs.not_listed(b), 1);
    }
    use crate::fingerprint::HashAlgorithm;

    #[test]
    fn progress_goes_through_each_phase_to_its_end() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let v = e.create_volume("v", 1 << 30).unwrap();
        // (two map steps apart, and a hole the check passes over)
        for lba in [0u64, 1, 3 * FSCK_PROGRESS_STEP_BLOCKS / 2] {
            e.write(v, lba * 4096, &[(lba % 251) as u8 + 1; 4096], false)
                .unwrap();
        }
        e.close().unwrap();
        drop(e);
        let mut calls: Vec<(String, u64, u64)> = Vec::new();
        let opts = FsckOptions {
            repair: true,
            rehash: true,
        };
        let r = fsck_with_progress(&path, opts, EngineConfig::default(), &mut |p, d, t| {
            calls.push((p.to_string(), d, t))
        })
        .unwrap();
        assert_eq!(r.referenced_blocks, 3);
        let mut phases: Vec<&str> = calls.iter().map(|c| c.0.as_str()).collect();
        phases.dedup();
        // (a clean store needs no repair pass)
        assert_eq!(phases, ["checking volume maps", "re-fingerprinting blocks"]);
        let maps: Vec<_> = calls.iter().filter(|c| c.0 == phases[0]).collect();
        assert_eq!(maps.first().map(|c| c.1), Some(0));
        assert!(maps.windows(2).all(|w| w[0].1 <= w[1].1), "{maps:?}");
        assert!(maps.len() >= 4, "{maps:?}");
        let last = maps.last().unwrap();
        assert_eq!((last.1, last.2), (1 << 18, 1 << 18));
        let blocks = calls.iter().rfind(|c| c.0 == phases[1]).unwrap();
        assert!(blocks.2 >= 3 && blocks.1 == blocks.2, "{blocks:?}");
    }

    #[test]
    fn an_unreadable_block_is_reported_and_the_check_goes_on() {
        let bad = crate::backend::OneBadBlock::new();
        let e = Engine::in_memory_over(
            HashAlgorithm::Sha256,
            EngineConfig::default(),
            Box::new(bad.clone()),
        );
        let v = e.create_volume("v", 1 << 20).unwrap();
        for k in 0..4u64 {
            e.write(v, k * 4096, &[k as u8 + 1; 4096], false).unwrap();
        }
        e.flush().unwrap();
        let p = lock(&e.meta).volumes[&v].get(crate::block::Lba(1)).unwrap();
        bad.fail(p);
        let rehash = FsckOptions {
            rehash: true,
            ..FsckOptions::default()
        };
        let r = e.check_and_repair(rehash, &mut |_, _, _| {}).unwrap();
        assert_eq!(r.unreadable_blocks, 1);
        assert_eq!(r.referenced_blocks, 4);
        assert_eq!(r.blocks_rehashed, 4);
        assert!(r.data_lost.iter().any(|l| l.contains("cannot be read")));
        assert_eq!(r.exit_code(), 4);
        // a repair leaves it as it is, and still says so
        let r = e
            .check_and_repair(
                FsckOptions {
                    repair: true,
                    rehash: true,
                },
                &mut |_, _, _| {},
            )
            .unwrap();
        assert!(r.repaired);
        assert_eq!(r.unreadable_blocks, 1);
        assert_eq!(r.exit_code(), 4);
        assert_eq!(lock(&e.meta).volumes[&v].get(crate::block::Lba(1)), Some(p));
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_map_page_unreadable_during_the_check_stops_it_without_a_report() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let a = e.create_volume("a", 8 << 20).unwrap();
        let b = e.create_volume("b", 8 << 20).unwrap();
        for k in 0..600u64 {
            e.write(a, k * 4096, &[(k % 200) as u8 + 1; 4096], false)
                .unwrap();
        }
        e.write(b, 0, &[9u8; 4096], false).unwrap();
        e.close().unwrap();
        drop(e);
        // one page of cache for every map and the counts: the check pages
        // each map in turn, and a's second page goes bad after the open
        let config = EngineConfig {
            map_cache_bytes: 4064,
            ..EngineConfig::default()
        };
        let e = Engine::open(&path, config).unwrap();
        let mut buf = vec![0u8; 4096];
        e.read(b, 0, &mut buf).unwrap();
        let map = std::fs::read_dir(path.join("maps"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .min()
            .unwrap();
        let mut bytes = std::fs::read(&map).unwrap();
        bytes[4096 + 100] ^= 0x20;
        std::fs::write(&map, bytes).unwrap();
        let err = e
            .check_and_repair(FsckOptions::default(), &mut |_, _, _| {})
            .unwrap_err();
        assert!(
            matches!(err, crate::error::EngineError::MetadataUnreadable(_)),
            "{err}"
        );
        e.drop_without_closing();
    }

    #[test]
    fn a_mapping_past_the_volume_end_is_reported_and_unmapped() {
        let dir = tempfile::tempdir().unwrap();
        let e = Engine::create(
            &dir.path().join("store"),
            HashAlgorithm::Sha256,
            EngineConfig::default(),
        )
        .unwrap();
        let vol = e.create_volume("v", 10 * 4096).unwrap();
        e.write(vol, 0, &[7u8; 4096], false).unwrap();
        e.flush().unwrap();
        // LBA 20 lies in the map's one page but past the 10-block volume
        {
            let mut m = lock(&e.meta);
            let raw = m.volumes[&vol].map.get_u64(0);
            assert_ne!(raw, 0);
            m.volumes.get_mut(&vol).unwrap().map.set_u64(20, raw);
        }
        let r = e
            .check_and_repair(FsckOptions::default(), &mut |_, _, _| {})
            .unwrap();
        assert!(
            r.problems.iter().any(|p| p.contains("LBA 20 past")),
            "{:?}",
            r.problems
        );
        let r = e
            .check_and_repair(
                FsckOptions {
                    repair: true,
                    ..FsckOptions::default()
                },
                &mut |_, _, _| {},
            )
            .unwrap();
        assert!(r.repaired);
        assert_eq!(lock(&e.meta).volumes[&vol].map.get_u64(20), 0);
        // the block LBA 0 maps is kept, and a grow exposes nothing
        e.resize_volume("v", 64 * 4096).unwrap();
        let r = e
            .check_and_repair(FsckOptions::default(), &mut |_, _, _| {})
            .unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        let mut b = vec![0u8; 4096];
        e.read(vol, 20 * 4096, &mut b).unwrap();
        assert_eq!(b, vec![0u8; 4096]);
        e.read(vol, 0, &mut b).unwrap();
        assert_eq!(b, vec![7u8; 4096]);
    }
}
