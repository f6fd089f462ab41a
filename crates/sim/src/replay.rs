//! Replay of traces through the real engine (SmartDedup §4.2 replays
//! smartphone traces the same way; HPDedup §V mixes FIU streams into
//! multi-tenant workloads).
//!
//! Each stream — a trace file, or with [`StreamBy::Process`] /
//! [`StreamBy::Pid`] one process of one file — writes to its own volume of
//! a simulated engine ([`Engine::simulated`]: metadata in memory, no data).
//! A file whose requests name several devices (FIU traces record the
//! major and minor numbers) has separate streams per device: the same LBA
//! on two devices is two blocks. Stream labels name the device
//! (`name@major,minor`) for every device but the first of a file.
//! Several files are interleaved by time stamp (a k-way merge; ties go to
//! the file named first). A time stamp before an earlier one of its file
//! is taken as that file's largest so far (counted as
//! [`Report::timestamps_clamped`]), so each file's clock, which the merge
//! and the idle gaps of [`OutOfLine::IdleGapMs`] follow, never runs back.
//! Writes go through [`Engine::write_fingerprinted`], so the inline dedup
//! measured is the engine's own. Alongside, the set of distinct non-zero
//! digests written gives the duplicates an exact, unbounded dedup would
//! find. Memory is independent of the trace length apart from that set,
//! the engine's metadata, the stream table and each file's table of
//! sources.
//!
//! Trace digests become engine fingerprints through [`fingerprint_of`]
//! (a 64-bit mix in front, so the index's prefixes and keys are uniform).
//!
//! Volumes are 1 PiB (the engine's limit; thin, so memory follows the LBAs
//! touched). Reads are counted, not replayed (the null backend has no data).
//! The engine is flushed every [`FLUSH_EVERY_REQUESTS`] requests so freed
//! blocks are recycled, and the index memory is sampled then for its peak.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dedupd_engine::fingerprint::FINGERPRINT_SIZE;
use dedupd_engine::index::EvictionPolicy;
use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
use dedupd_engine::{
    Engine, EngineConfig, Fingerprint, HashAlgorithm, Lba, Stats, VolumeId, BLOCK_SIZE,
};

use crate::digest_set::DigestSet;
use crate::error::{Result, TraceError};
use crate::reader::{Format, TraceReader};
use crate::request::{device_label, Digest, Op, Request, SECTOR_SIZE};

/// Size of each stream's volume: 1 PiB, the engine's maximum.
pub const VOLUME_BYTES: u64 = 1 << 50;
/// Requests between engine flushes (and index-memory samples).
pub const FLUSH_EVERY_REQUESTS: u64 = 4096;
/// Requests between progress callbacks.
const PROGRESS_EVERY_REQUESTS: u64 = 8192;
/// Requests read ahead of the one being replayed.
const LOOKAHEAD_REQUESTS: usize = 32;
/// Most fingerprints prefetched in one batch.
const PREFETCH_BATCH_BLOCKS: usize = 32;

/// Fingerprint-index policies this build can replay with: `exact` (every
/// stored block's fingerprint stays in memory) and the engine's bounded
/// policies `g-lru` (SmartDedup §3.2 group LRU), `lru`, `lfu`, `arc` and
/// `refcount` (CAFTL). Each may be followed by filters of the write path
/// ([`Filters`]): `+sampling`, `+prehash`, `+tN`.
pub const AVAILABLE_POLICIES: &[&str] = &["exact", "g-lru", "lru", "lfu", "arc", "refcount"];
/// Policies the replay names as planned but this build cannot run (none
/// now: every policy docs/replay.md names is in [`AVAILABLE_POLICIES`]).
pub const PLANNED_POLICIES: &[&str] = &[];
/// Modelled SHA-256 rate over 4 KiB blocks, in bytes per second, for the
/// hashing-cost figures of the report: `sha2` with SHA extensions, as
/// measured by the engine's `fingerprint` benchmark (1.61 GiB/s,
/// docs/bench-engine.md).
pub const SHA256_BYTES_PER_SECOND: f64 = 1.75e9;
/// Modelled CRC32 (CRC-32C, hardware) rate over 4 KiB blocks.
pub const CRC32_BYTES_PER_SECOND: f64 = 20e9;
/// Write-path filters of a policy (`+sampling`, `+prehash`, `+tN`), each
/// an engine option ([`build_engine`] sets them): CAFTL's sampling and
/// pre-hashing ([`dedupd_engine::caftl`]) and iDedup's sequence threshold
/// ([`dedupd_engine::sequence`]). Blocks the CAFTL filters turn away are
/// stored without an inline lookup (their fingerprint kept for the
/// out-of-line pass), as the server does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Filters {
    /// CAFTL sampling hashing (FAST '11, as SmartDedup §4.1 describes it):
    /// of a write request with several non-zero blocks only the sample —
    /// the block with the largest CRC-32C of its engine fingerprint
    /// ([`fingerprint_of`] its trace digest, 32 bytes; not of the digest)
    /// — is
    /// fingerprinted and looked up first; the others only if it is a
    /// duplicate ([`dedupd_engine::EngineConfig::sampling`]).
    pub sampling: bool,
    /// CAFTL pre-hashing: a CRC-32C of every block (of its engine
    /// fingerprint here, as for `sampling`: 32 bits, so collisions pass as
    /// with real CRCs); only a block
    /// whose CRC was seen before is fingerprinted inline. The engine's CRC
    /// table has [`PREHASH_TABLE_BYTES`]
    /// ([`dedupd_engine::EngineConfig::prehash_bytes`]).
    pub prehash: bool,
    /// iDedup's sequence threshold T (FAST '12; SmartDedup §4.5, HPDedup
    /// §III-C): only runs of at least T consecutive duplicate blocks whose
    /// stored copies are contiguous are deduplicated; shorter runs are
    /// written as new. 1 turns it off. Not a replay filter: it is the
    /// engine's own write path
    /// ([`dedupd_engine::EngineConfig::sequence_threshold_blocks`]), asking
    /// the engine's fingerprint store, with runs followed across requests.
    pub threshold: u32,
}

impl Default for Filters {
    fn default() -> Self {
        Filters {
            sampling: false,
            prehash: false,
            threshold: 1,
        }
    }
}

/// A parsed policy name: `exact` or an engine eviction policy, plus
/// filters: `POLICY[+sampling][+prehash][+tN]`, e.g. `refcount+prehash`,
/// `g-lru+t4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySpec {
    /// The engine's eviction policy; `None` for `exact` (unbounded).
    pub eviction: Option<EvictionPolicy>,
    /// Write-path filters.
    pub filters: Filters,
}

impl std::str::FromStr for PolicySpec {
    type Err = TraceError;
    fn from_str(s: &str) -> Result<Self> {
        let mut parts = s.split('+');
        let base = parts.next().unwrap_or_default();
        let eviction = match base {
            "exact" => None,
            p => Some(p.parse::<EvictionPolicy>().map_err(|_| {
                TraceError::Config(format!(
                    "unknown policy {p:?} (available: {})",
                    AVAILABLE_POLICIES.join(", ")
                ))
            })?),
        };
        let mut filters = Filters::default();
        let mut seen: Vec<&str> = Vec::new();
        for f in parts {
            // (each filter once: `+t4+t8` would leave which applies unclear)
            let kind = if f.starts_with(['t', 'T']) { "t" } else { f };
            if seen.contains(&kind) {
                return Err(TraceError::Config(format!(
                    "policy {s:?} gives {} twice",
                    if kind == "t" {
                        "a threshold (tN)"
                    } else {
                        kind
                    }
                )));
            }
            seen.push(kind);
            match f {
                "sampling" => filters.sampling = true,
                "prehash" => filters.prehash = true,
                t if t.starts_with('t') || t.starts_with('T') => {
                    filters.threshold =
                        t[1..]
                            .parse()
                            .ok()
                            .filter(|&n: &u32| n >= 1)
                            .ok_or_else(|| {
                                TraceError::Config(format!(
                                    "bad threshold {t:?} (tN with N from 1 to {} blocks)",
                                    u32::MAX
                                ))
                            })?;
                }
                f => {
                    return Err(TraceError::Config(format!(
                        "unknown filter {f:?} in policy {s:?} (sampling, prehash, tN)"
                    )))
                }
            }
        }
        Ok(PolicySpec { eviction, filters })
    }
}
/// Bytes of the engine's pre-hash CRC table under `+prehash`: 16 MiB, two
/// million CRC slots, so a replay's table forgets little.
pub const PREHASH_TABLE_BYTES: u64 = 16 << 20;

/// Index budget standing for "unbounded" (`exact`): far above any memory,
/// yet small enough that the engine's budget arithmetic cannot overflow.
const UNBOUNDED_INDEX_BYTES: u64 = u64::MAX / 1024;

/// Index budget of a bounded policy when none is given: the engine's default.
pub fn default_index_memory_bytes() -> u64 {
    EngineConfig::default().index.memory_budget_bytes
}

/// What makes a stream (one volume each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamBy {
    /// One stream per trace file (and device).
    #[default]
    File,
    /// One stream per process name within a file (and device).
    Process,
    /// One stream per process id within a file (and device).
    Pid,
}

impl std::str::FromStr for StreamBy {
    type Err = String;
    /// Parses `file`, `process` or `pid`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "file" => Ok(StreamBy::File),
            "process" => Ok(StreamBy::Process),
            "pid" => Ok(StreamBy::Pid),
            _ => Err(format!("unknown stream key {s:?} (file, process, pid)")),
        }
    }
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Trace format of every input (`None`: detect per file).
    pub format: Option<Format>,
    /// What makes a stream.
    pub stream_by: StreamBy,
    /// Count and skip malformed lines instead of failing.
    pub skip_bad: bool,
    /// Fingerprint-index replacement policy: `exact`, `g-lru` or `lru`
    /// ([`AVAILABLE_POLICIES`]).
    pub policy: String,
    /// Memory budget of the fingerprint index in bytes, for bounded
    /// policies (`None`: the engine's default); refused with `exact`.
    pub index_memory_bytes: Option<u64>,
    /// Prefix bits of the index (`None`: the engine's default, 14). Fewer
    /// bits mean fewer, larger groups, so small budgets hold more entries.
    pub prefix_bits: Option<u32>,
    /// How the background out-of-line pass is modelled (SmartDedup §3.3).
    pub out_of_line: OutOfLine,
    /// Once raised (a signal handler, another thread), the replay stops at
    /// its next progress report (every few thousand requests) with
    /// [`TraceError::Interrupted`], and a sweep starts no further point.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl ReplayConfig {
    /// True once [`ReplayConfig::stop`] is raised.
    pub fn stopped(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// When the replay runs the engine's out-of-line dedup pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OutOfLine {
    /// Never: inline dedup only.
    #[default]
    Off,
    /// A pass of up to 4096 blocks after every N requests.
    EveryRequests(u64),
    /// Drain all pending work whenever the trace's time stamps show an idle
    /// gap of at least this many milliseconds (the device is idle then).
    IdleGapMs(u64),
}

impl std::str::FromStr for OutOfLine {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad =
            || format!("invalid out-of-line mode {s:?}: use off, every:N (requests) or idle:MS");
        match s.split_once(':') {
            None if s == "off" => Ok(OutOfLine::Off),
            Some(("every", n)) => n
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .map(OutOfLine::EveryRequests)
                .ok_or_else(bad),
            // (at most about 584 years, so the gap in ns fits in 64 bits)
            Some(("idle", ms)) => ms
                .parse::<u64>()
                .ok()
                .filter(|&ms| ms.checked_mul(1_000_000).is_some())
                .map(OutOfLine::IdleGapMs)
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

/// Runs out-of-line passes until no work is left (bounded).
fn drain_out_of_line(engine: &Engine) -> std::result::Result<(), TraceError> {
    for _ in 0..100_000 {
        if !engine.dedup_pass(4096)?.work_remaining {
            break;
        }
    }
    Ok(())
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            format: None,
            stream_by: StreamBy::File,
            skip_bad: false,
            policy: "exact".into(),
            index_memory_bytes: None,
            prefix_bits: None,
            out_of_line: OutOfLine::Off,
            stop: None,
        }
    }
}

/// Builds the engine a replay runs on: the one place where a policy and an
/// index budget turn into an engine configuration. `exact` takes no budget
/// (the index is unbounded); the others use `index_memory_bytes` (default
/// [`default_index_memory_bytes`]) with the engine's default lookup mode
/// (memory). Adaptive selectivity is off and so is the read cache: every
/// block passed on is fingerprinted inline, so policies are compared alone.
/// The filters (`+sampling`, `+prehash`, `+tN`) are engine options too.
///
/// Errors: [`TraceError::Config`] for an unknown policy or filter, or a
/// budget given to the unbounded `exact` policy.
pub fn build_engine(cfg: &ReplayConfig) -> Result<Engine> {
    let spec: PolicySpec = cfg.policy.parse()?;
    let mut ec = EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Ac,
        },
        read_cache_bytes: 0,
        sequence_threshold_blocks: spec.filters.threshold,
        prehash_bytes: if spec.filters.prehash {
            PREHASH_TABLE_BYTES
        } else {
            0
        },
        sampling: spec.filters.sampling,
        ..EngineConfig::default()
    };
    if let Some(bits) = cfg.prefix_bits {
        ec.index.prefix_bits = bits;
    }
    match spec.eviction {
        None => {
            if let Some(b) = cfg.index_memory_bytes {
                return Err(TraceError::Config(format!(
                    "policy exact keeps every fingerprint; an index memory budget ({b} bytes) needs a bounded policy ({})",
                    AVAILABLE_POLICIES[1..].join(", ")
                )));
            }
            ec.index.memory_budget_bytes = UNBOUNDED_INDEX_BYTES;
        }
        Some(p) => {
            ec.index.policy = p;
            ec.index.memory_budget_bytes = cfg
                .index_memory_bytes
                .unwrap_or_else(default_index_memory_bytes);
        }
    }
    Ok(Engine::simulated_with(HashAlgorithm::Sha256, ec))
}

/// Progress of a replay, passed to the caller's callback.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Bytes read from the trace files so far (compressed size on disk).
    pub bytes_read: u64,
    /// Total size of the trace files on disk in bytes.
    pub bytes_total: u64,
    /// Requests replayed so far.
    pub requests: u64,
    /// Blocks written so far.
    pub blocks_written: u64,
}

/// Figures of one stream.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StreamReport {
    /// `file`, `file:process` or `file:pid`, followed by
    /// `@major,minor` for a device other than the first of its file.
    pub name: String,
    /// Name of its volume in the engine: `s` and the stream's index
    /// (`s0`, `s1`, … by order of first request), whatever the file is
    /// called.
    pub volume: String,
    /// Requests of the stream.
    pub requests: u64,
    /// Write requests.
    pub writes: u64,
    /// 4 KiB blocks written.
    pub blocks_written: u64,
    /// Extents in its volume map at the end (runs of consecutive LBAs on
    /// consecutive PBAs).
    pub extents: u64,
}

/// The result of a replay. Block counts are 4 KiB blocks; percentages are
/// of `blocks_written` unless said otherwise.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// Trace files, in the order given.
    pub traces: Vec<String>,
    /// Index policy replayed with.
    pub policy: String,
    /// Index memory budget in bytes (None: unbounded).
    pub index_memory_bytes: Option<u64>,
    /// What made a stream.
    pub stream_by: StreamBy,
    /// Requests replayed (reads + writes + trims).
    pub requests: u64,
    /// Read requests (counted, not replayed).
    pub reads: u64,
    /// Write requests.
    pub writes: u64,
    /// Trim requests.
    pub trims: u64,
    /// Malformed lines or refused requests skipped (with `skip_bad`).
    pub bad_records_skipped: u64,
    /// Requests whose time stamp was before an earlier request's of the
    /// same file, replayed as at the largest earlier one (for the
    /// interleaving of files and the idle gaps of [`OutOfLine::IdleGapMs`]).
    pub timestamps_clamped: u64,
    /// 4 KiB blocks read.
    pub blocks_read: u64,
    /// 4 KiB blocks written (zero blocks included), as the engine counts.
    pub blocks_written: u64,
    /// Written blocks that were all zeros.
    pub zero_blocks_written: u64,
    /// Duplicates the engine found inline (its `duplicate_writes_eliminated`).
    pub duplicate_blocks_inline: u64,
    /// Stored copies the modelled background pass freed by remapping their
    /// LBAs onto another copy (writes inline dedup missed; 0 with
    /// out-of-line off): with the inline figure, at most the exact count.
    pub duplicate_blocks_out_of_line: u64,
    /// Physical blocks stored at the end.
    pub physical_blocks_stored: u64,
    /// `duplicate_blocks_inline` in percent of `blocks_written` (the
    /// papers' "duplicate writes eliminated").
    pub duplicate_writes_eliminated_percent: f64,
    /// Distinct non-zero digests written.
    pub distinct_fingerprints: u64,
    /// Non-zero blocks whose digest had been written before, anywhere: the
    /// duplicates an exact, never-forgetting dedup would find.
    pub exact_duplicate_blocks: u64,
    /// `exact_duplicate_blocks` in percent of `blocks_written`.
    pub exact_duplicate_percent: f64,
    /// `duplicate_blocks_inline` ÷ `exact_duplicate_blocks` in percent (100
    /// when there are none): how much of the exact dedup inline achieves.
    /// Below 100 with the exact policy only when content was overwritten
    /// and freed before it recurred.
    pub inline_of_exact_percent: f64,
    /// Dedup ratio at the end: logical mapped ÷ physical stored.
    pub dedup_ratio: f64,
    /// Blocks not written to the data file: zero blocks + inline duplicates.
    pub data_writes_avoided_blocks: u64,
    /// `data_writes_avoided_blocks` × 4096.
    pub data_writes_avoided_bytes: u64,
    /// `data_writes_avoided_blocks` in percent of `blocks_written`.
    pub data_writes_avoided_percent: f64,
    /// Metadata I/O: bytes a store's journal would have received for the
    /// replay's commits (one every [`FLUSH_EVERY_REQUESTS`] requests; page
    /// images and patches, the state, checkpoints as a store makes them),
    /// modelled by the simulated engine, which has no journal.
    pub journal_bytes: u64,
    /// Metadata I/O: bytes a store's checkpoints would have written in
    /// place for the same commits (modelled likewise).
    pub checkpoint_bytes: u64,
    /// Peak bytes of the fingerprint index in memory (sampled at each flush
    /// and at the end): the in-memory groups, within the budget, plus the
    /// prefix tree, outside it.
    pub peak_index_bytes_in_memory: u64,
    /// Fingerprints in the index at the end.
    pub index_entries: u64,
    /// Blocks mapped in all volumes at the end.
    pub mapped_blocks: u64,
    /// Extents in all volume maps at the end (fragmentation: fewer is better).
    pub extents: u64,
    /// `mapped_blocks ÷ extents` (0 when nothing is mapped).
    pub mean_extent_blocks: f64,
    /// Write-path filters applied ([`Filters`]).
    pub filters: Filters,
    /// Non-zero blocks fingerprinted and looked up inline (SHA-256 of
    /// 4 KiB in a real system): all of them without filters; fewer with
    /// sampling or pre-hashing.
    pub blocks_fingerprinted: u64,
    /// Non-zero blocks given a CRC-32C pre-hash (pre-hashing only).
    pub blocks_prehashed: u64,
    /// Non-zero blocks the CAFTL filters stored without an inline lookup.
    pub blocks_filtered_as_new: u64,
    /// Modelled hashing time in seconds: fingerprinted blocks × 4 KiB at
    /// [`SHA256_BYTES_PER_SECOND`] plus pre-hashed blocks × 4 KiB at
    /// [`CRC32_BYTES_PER_SECOND`].
    pub hashing_seconds_modelled: f64,
    /// Wall-clock time of the replay in seconds.
    pub elapsed_seconds: f64,
    /// Requests per second of wall-clock time.
    pub requests_per_second: f64,
    /// Per-stream figures, by order of first request.
    pub streams: Vec<StreamReport>,
    /// The engine's own figures at the end.
    pub engine: Stats,
}

/// The engine fingerprint of a 16-byte trace digest: a 64-bit mix of the
/// whole digest, then the digest itself (then zeros). The engine's index
/// keys on the first 64 bits and its prefix tree on the first P bits, which
/// assume uniformly random fingerprints; MD5 digests are, but synthetic or
/// structured digests (fixtures, counters) need not be. The digest is kept
/// whole, so distinct digests stay distinct fingerprints.
#[inline]
pub fn fingerprint_of(d: &Digest) -> Fingerprint {
    let mut b = [0u8; FINGERPRINT_SIZE];
    b[..8].copy_from_slice(&digest_hash(d).to_le_bytes());
    b[8..24].copy_from_slice(d);
    Fingerprint(b)
}

/// The 64-bit mix in front of a digest's engine fingerprint: one
/// splitmix64 step over each half. Fixed (not keyed per run), so that the
/// index's groups, and with them every figure of a bounded policy, are the
/// same from run to run.
fn digest_hash(d: &Digest) -> u64 {
    let lo = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(d[8..].try_into().expect("8 bytes"));
    splitmix64(lo ^ splitmix64(hi))
}

/// One step of splitmix64 (Steele, Lea & Flood), a 64-bit bijective mix.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// The engine volume name of stream `index` (0-based, by order of first
/// request): `s0`, `s1`, …. Independent of the trace's file name, so that
/// the figures that depend on the volume table (journal and checkpoint
/// bytes) are the same for every copy and form of one trace; the stream's
/// label ([`StreamReport::name`]) names the file.
fn volume_name(index: usize) -> String {
    format!("s{index}")
}

/// What identifies a stream: the input file's index, the device (each
/// device of a file is a disk of its own), and the pid or process name.
#[derive(PartialEq, Eq, Hash)]
enum StreamKey {
    File(usize, u64),
    Pid(usize, u64, u32),
    Process(usize, u64, String),
}

struct Input {
    reader: TraceReader,
    head: Request,
    /// [`TraceReader::position`] of `head`.
    head_position: u64,
    live: bool,
    /// Largest time stamp read from the file so far (the file's clock).
    clock_ns: u64,
    /// Requests whose time stamp was below `clock_ns`, raised to it.
    timestamps_clamped: u64,
    /// Stream index per source id of this reader.
    stream_of: Vec<Option<usize>>,
    /// Device of the file's first stream: its streams are labelled without
    /// a device, those of other devices with `@major,minor`.
    first_device: Option<u64>,
    /// Requests of the file replayed (not skipped as past the volume
    /// limit).
    replayed: u64,
}

impl Input {
    /// Opens `path` and reads its first request.
    ///
    /// Errors: as [`TraceReader::open`] and [`TraceReader::next_into`], and
    /// [`TraceError::NoRequests`] when the file holds no request.
    fn open(path: &std::path::Path, cfg: &ReplayConfig, consumed: Arc<AtomicU64>) -> Result<Self> {
        let reader = TraceReader::open(path, cfg.format, cfg.skip_bad, consumed)?;
        let mut inp = Input {
            head_position: 0,
            reader,
            head: Request::default(),
            live: false,
            clock_ns: 0,
            timestamps_clamped: 0,
            stream_of: Vec::new(),
            first_device: None,
            replayed: 0,
        };
        if !inp.advance()? {
            return Err(TraceError::NoRequests {
                file: inp.reader.name().to_string(),
                bad_records_skipped: inp.reader.bad_records(),
            });
        }
        Ok(inp)
    }

    /// Reads the file's next request into `head`; false at its end. A time
    /// stamp before an earlier one of the same file is raised to the
    /// largest so far, and counted: the merge of several files and the
    /// idle gaps of `--out-of-line idle:MS` follow each file's clock, which
    /// never runs backwards.
    ///
    /// Errors: as [`TraceReader::next_into`] (the input is then done).
    fn advance(&mut self) -> Result<bool> {
        self.live = false;
        self.live = self.reader.next_into(&mut self.head)?;
        self.head_position = self.reader.position();
        if self.live {
            if self.head.ts_ns < self.clock_ns {
                self.head.ts_ns = self.clock_ns;
                self.timestamps_clamped += 1;
            }
            self.clock_ns = self.head.ts_ns;
        }
        Ok(self.live)
    }
}

/// A request read ahead of its turn, with its blocks' fingerprints and
/// their hashes in the exact set (computed once, for the prefetch and for
/// the write).
#[derive(Default)]
struct Pending {
    input: usize,
    /// [`TraceReader::position`] of the request, for error messages.
    position: u64,
    req: Request,
    fps: Vec<Option<Fingerprint>>,
    hashes: Vec<u64>,
}

/// Requests read ahead of their turn, merged from the inputs in time-stamp
/// order (ties: the first file), so that the index lookups of the next
/// ones can be prefetched in batches while the ones before them run. A
/// ring of [`LOOKAHEAD_REQUESTS`] slots whose buffers are reused.
struct Lookahead {
    window: Vec<Pending>,
    /// The next request's slot, and how many are waiting from it.
    head: usize,
    len: usize,
    /// Waiting requests, from `head`, whose lookups were prefetched.
    prefetched: usize,
    batch: Vec<Fingerprint>,
    /// A read error: it ends the replay once the requests before it are done.
    read_error: Option<TraceError>,
}

impl Lookahead {
    fn new() -> Self {
        Lookahead {
            window: (0..LOOKAHEAD_REQUESTS)
                .map(|_| Pending::default())
                .collect(),
            head: 0,
            len: 0,
            prefetched: 0,
            batch: Vec::with_capacity(PREFETCH_BATCH_BLOCKS),
            read_error: None,
        }
    }

    /// Reads requests until the window is full, the inputs end, or one
    /// fails to read.
    fn fill(&mut self, inputs: &mut [Input], exact: &DigestSet) {
        while self.len < LOOKAHEAD_REQUESTS && self.read_error.is_none() {
            let mut pick: Option<usize> = None;
            for (i, inp) in inputs.iter().enumerate() {
                if inp.live && pick.is_none_or(|p| inp.head.ts_ns < inputs[p].head.ts_ns) {
                    pick = Some(i);
                }
            }
            let Some(i) = pick else { break };
            let inp = &mut inputs[i];
            let p = &mut self.window[(self.head + self.len) % LOOKAHEAD_REQUESTS];
            std::mem::swap(&mut p.req, &mut inp.head);
            p.input = i;
            p.position = inp.head_position;
            p.fps.clear();
            p.hashes.clear();
            if p.req.op == Some(Op::Write) {
                for b in &p.req.blocks {
                    match b {
                        Some(d) => {
                            p.hashes.push(exact.hash(d));
                            p.fps.push(Some(fingerprint_of(d)));
                        }
                        None => p.fps.push(None),
                    }
                }
            }
            if let Err(e) = inp.advance() {
                self.read_error = Some(e);
            }
            self.len += 1;
        }
    }

    /// Once fewer than half the waiting requests are prefetched, hands the
    /// next batch's fingerprints to the engine and fetches their
    /// exact-set slots.
    fn prefetch(&mut self, engine: &Engine, exact: &DigestSet) {
        if self.prefetched >= LOOKAHEAD_REQUESTS / 2 {
            return;
        }
        self.batch.clear();
        while self.prefetched < self.len && self.batch.len() < PREFETCH_BATCH_BLOCKS {
            let p = &self.window[(self.head + self.prefetched) % LOOKAHEAD_REQUESTS];
            let room = PREFETCH_BATCH_BLOCKS - self.batch.len();
            self.batch.extend(p.fps.iter().flatten().take(room));
            for &h in &p.hashes {
                exact.prefetch(h);
            }
            self.prefetched += 1;
        }
        if !self.batch.is_empty() {
            engine.prefetch_fingerprints(&self.batch);
        }
    }

    /// The next request in order, if any (its slot is reused by a later
    /// [`Lookahead::fill`]).
    fn pop(&mut self) -> Option<&Pending> {
        if self.len == 0 {
            return None;
        }
        let at = self.head;
        self.head = (self.head + 1) % LOOKAHEAD_REQUESTS;
        self.len -= 1;
        self.prefetched = self.prefetched.saturating_sub(1);
        Some(&self.window[at])
    }
}

struct Stream {
    report: StreamReport,
    volume: VolumeId,
}

/// Replays `paths` (interleaved by time stamp) under `cfg`, calling
/// `progress` now and then (and once at the end).
///
/// Errors: a file given twice (the same device and inode, or the same
/// path: [`TraceError::Config`]), a policy that is not available
/// ([`build_engine`]), I/O, a
/// malformed line (unless `skip_bad`), a file without any request
/// ([`TraceError::NoRequests`]), or a request the engine refuses (beyond
/// 1 PiB; skipped and counted with `skip_bad`).
pub fn replay(
    paths: &[PathBuf],
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Report> {
    // (the same file twice would replay its requests as two streams with
    // one label)
    if let Some((first, again)) =
        crate::sweep::first_repeat(paths, |a, b| crate::input::same_file(a, b))
    {
        return Err(TraceError::Config(format!(
            "trace {} is given more than once{} (each trace is replayed once)",
            paths[again].display(),
            crate::sweep::spelled_as(&paths[first].display(), &paths[again].display()),
        )));
    }
    let engine = build_engine(cfg)?;
    let spec = cfg.policy.parse::<PolicySpec>()?;
    let bounded = spec.eviction.is_some();
    let filters = spec.filters;
    let started = Instant::now();
    let consumed = Arc::new(AtomicU64::new(0));
    let mut bytes_total = 0;
    let mut inputs = Vec::with_capacity(paths.len());
    for p in paths {
        bytes_total += std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        inputs.push(Input::open(p, cfg, consumed.clone())?);
    }
    let mut streams: Vec<Stream> = Vec::new();
    let mut keys: HashMap<StreamKey, usize> = HashMap::new();
    let mut exact: DigestSet = DigestSet::default();
    let mut r = Report {
        traces: paths.iter().map(|p| p.display().to_string()).collect(),
        policy: cfg.policy.clone(),
        // (a bounded policy's default budget is a budget too)
        index_memory_bytes: cfg
            .index_memory_bytes
            .or_else(|| bounded.then(default_index_memory_bytes)),
        stream_by: cfg.stream_by,
        ..Report::default()
    };
    let max_blocks = VOLUME_BYTES / BLOCK_SIZE as u64;
    let mut last_ts_ns: Option<u64> = None;
    let mut ahead = Lookahead::new();
    loop {
        ahead.fill(&mut inputs, &exact);
        ahead.prefetch(&engine, &exact);
        let Some(pending) = ahead.pop() else {
            break;
        };
        let i = pending.input;
        let inp = &mut inputs[i];
        let req = &pending.req;
        let location = |inp: &Input| inp.reader.location_at(pending.position);

        // (a request past the volume limit makes no stream)
        let first = req.first_block();
        let n = match req.op {
            Some(Op::Write) => req.blocks.len() as u64,
            _ => req.blocks_touched(),
        };
        if first.checked_add(n).is_none_or(|end| end > max_blocks) {
            if !inp.reader.skip_bad_request() {
                return Err(TraceError::Request {
                    location: location(inp),
                    msg: format!("blocks {first}..+{n} pass the 1 PiB volume limit"),
                });
            }
            continue;
        }
        inp.replayed += 1;

        // the request's stream and volume
        let src = req.source as usize;
        if inp.stream_of.len() <= src {
            inp.stream_of.resize(src + 1, None);
        }
        let s = match inp.stream_of[src] {
            Some(s) => s,
            None => {
                let source = &inp.reader.sources()[src];
                let device = source.device;
                let (key, mut label) = match cfg.stream_by {
                    StreamBy::File => (StreamKey::File(i, device), inp.reader.name().to_string()),
                    StreamBy::Pid => (
                        StreamKey::Pid(i, device, source.pid),
                        format!("{}:{}", inp.reader.name(), source.pid),
                    ),
                    StreamBy::Process => (
                        StreamKey::Process(i, device, source.process.clone()),
                        format!("{}:{}", inp.reader.name(), source.process),
                    ),
                };
                if *inp.first_device.get_or_insert(device) != device {
                    label.push('@');
                    label.push_str(&device_label(device));
                }
                let s = match keys.get(&key) {
                    Some(&s) => s,
                    None => {
                        let s = streams.len();
                        let volume = volume_name(s);
                        let id = engine.create_volume(&volume, VOLUME_BYTES)?;
                        streams.push(Stream {
                            report: StreamReport {
                                name: label,
                                volume,
                                ..StreamReport::default()
                            },
                            volume: id,
                        });
                        keys.insert(key, s);
                        s
                    }
                };
                inp.stream_of[src] = Some(s);
                s
            }
        };
        let stream = &mut streams[s];

        {
            r.requests += 1;
            stream.report.requests += 1;
            match req.op {
                Some(Op::Read) => {
                    r.reads += 1;
                    r.blocks_read += n;
                }
                Some(Op::Write) => {
                    r.writes += 1;
                    stream.report.writes += 1;
                    stream.report.blocks_written += n;
                    r.blocks_written += n;
                    engine
                        .write_fingerprinted(stream.volume, Lba(first), &pending.fps)
                        .map_err(|e| TraceError::Request {
                            location: location(inp),
                            msg: e.to_string(),
                        })?;
                    for (d, &h) in req.blocks.iter().flatten().zip(&pending.hashes) {
                        if !exact.insert(d, h) {
                            r.exact_duplicate_blocks += 1;
                        }
                    }
                }
                Some(Op::Trim) => {
                    r.trims += 1;
                    // whole blocks only: the simulated engine keeps no
                    // data, so a partial block's read-modify-write would
                    // turn the whole block into zeros (and count a write)
                    let sectors_per_block = BLOCK_SIZE as u64 / SECTOR_SIZE;
                    let first = req.lba_sectors.div_ceil(sectors_per_block);
                    let end = (req.lba_sectors + req.sectors) / sectors_per_block;
                    if first < end {
                        engine
                            .trim(
                                stream.volume,
                                first * BLOCK_SIZE as u64,
                                (end - first) * BLOCK_SIZE as u64,
                                false,
                            )
                            .map_err(|e| TraceError::Request {
                                location: location(inp),
                                msg: e.to_string(),
                            })?;
                    }
                }
                None => {}
            }
            match cfg.out_of_line {
                OutOfLine::EveryRequests(n) if r.requests.is_multiple_of(n) => {
                    engine.dedup_pass(4096)?;
                }
                OutOfLine::IdleGapMs(gap_ms)
                    if last_ts_ns
                        .is_some_and(|t| req.ts_ns.saturating_sub(t) >= gap_ms * 1_000_000) =>
                {
                    drain_out_of_line(&engine)?;
                }
                _ => {}
            }
            last_ts_ns = Some(req.ts_ns);
            if r.requests.is_multiple_of(FLUSH_EVERY_REQUESTS) {
                engine.flush()?;
                r.peak_index_bytes_in_memory = r
                    .peak_index_bytes_in_memory
                    .max(engine.index_bytes_in_memory());
            }
            if r.requests.is_multiple_of(PROGRESS_EVERY_REQUESTS) {
                if cfg.stopped() {
                    return Err(TraceError::Interrupted);
                }
                progress(&Progress {
                    bytes_read: consumed.load(Ordering::Relaxed),
                    bytes_total,
                    requests: r.requests,
                    blocks_written: r.blocks_written,
                });
            }
        }
    }
    if let Some(e) = ahead.read_error {
        return Err(e);
    }
    // (a file whose every request was skipped, past 1 PiB, says nothing)
    if let Some(inp) = inputs.iter().find(|inp| inp.replayed == 0) {
        return Err(TraceError::NoRequests {
            file: inp.reader.name().to_string(),
            bad_records_skipped: inp.reader.bad_records(),
        });
    }
    // as a store's shutdown: flush, then a (modelled) checkpoint
    engine.close()?;
    let st = engine.stats();
    progress(&Progress {
        bytes_read: consumed.load(Ordering::Relaxed),
        bytes_total,
        requests: r.requests,
        blocks_written: st.blocks_written,
    });
    r.bad_records_skipped = inputs.iter().map(|i| i.reader.bad_records()).sum();
    r.timestamps_clamped = inputs.iter().map(|i| i.timestamps_clamped).sum();
    r.blocks_written = st.blocks_written;
    r.zero_blocks_written = st.zero_blocks_written;
    r.duplicate_blocks_inline = st.duplicate_writes_eliminated;
    r.duplicate_blocks_out_of_line = st.out_of_line_duplicates;
    r.physical_blocks_stored = st.physical_blocks_stored;
    r.duplicate_writes_eliminated_percent = pct(st.duplicate_writes_eliminated, st.blocks_written);
    r.distinct_fingerprints = exact.len() as u64;
    r.exact_duplicate_percent = pct(r.exact_duplicate_blocks, st.blocks_written);
    r.inline_of_exact_percent = if r.exact_duplicate_blocks == 0 {
        100.0
    } else {
        pct(r.duplicate_blocks_inline, r.exact_duplicate_blocks)
    };
    r.dedup_ratio = st.dedup_ratio;
    r.data_writes_avoided_blocks = st.zero_blocks_written + st.duplicate_writes_eliminated;
    r.data_writes_avoided_bytes = r.data_writes_avoided_blocks * BLOCK_SIZE as u64;
    r.data_writes_avoided_percent = pct(r.data_writes_avoided_blocks, st.blocks_written);
    r.journal_bytes = st.journal_bytes_written;
    r.checkpoint_bytes = st.checkpoint_bytes_written;
    r.peak_index_bytes_in_memory = r.peak_index_bytes_in_memory.max(st.index_bytes_in_memory);
    r.index_entries = st.index_entries;
    r.mapped_blocks = st.logical_bytes_mapped / BLOCK_SIZE as u64;
    for s in &mut streams {
        s.report.extents = engine.extents(s.volume);
        r.extents += s.report.extents;
    }
    r.mean_extent_blocks = if r.extents == 0 {
        0.0
    } else {
        r.mapped_blocks as f64 / r.extents as f64
    };
    r.filters = filters;
    r.blocks_fingerprinted = st.blocks_fingerprinted_inline;
    r.blocks_prehashed = st.caftl.blocks_prehashed;
    r.blocks_filtered_as_new = st.caftl.prehash_misses + st.caftl.sample_misses;
    r.hashing_seconds_modelled = (r.blocks_fingerprinted as f64 / SHA256_BYTES_PER_SECOND
        + r.blocks_prehashed as f64 / CRC32_BYTES_PER_SECOND)
        * BLOCK_SIZE as f64;
    r.elapsed_seconds = started.elapsed().as_secs_f64();
    r.requests_per_second = if r.elapsed_seconds > 0.0 {
        r.requests as f64 / r.elapsed_seconds
    } else {
        0.0
    };
    r.streams = streams.into_iter().map(|s| s.report).collect();
    r.engine = st;
    Ok(r)
}
