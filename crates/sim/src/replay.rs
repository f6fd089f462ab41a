//! Replay of traces through the real engine (SmartDedup §4.2 replays
//! smartphone traces the same way; HPDedup §V mixes FIU streams into
//! multi-tenant workloads).
//!
//! Each stream — a trace file, or with [`StreamBy::Process`] /
//! [`StreamBy::Pid`] one process of one file — writes to its own volume of
//! a simulated engine ([`Engine::simulated`]: metadata in memory, no data).
//! Several files are interleaved by time stamp (a k-way merge; ties go to
//! the file named first). Writes go through
//! [`Engine::write_fingerprinted`], so the inline dedup measured is the
//! engine's own. Alongside, the set of distinct non-zero digests written
//! gives the duplicates an exact, unbounded dedup would find. Memory is
//! independent of the trace length apart from that set, the engine's
//! metadata and the stream table.
//!
//! Trace digests become engine fingerprints through [`fingerprint_of`]
//! (a 64-bit mix in front, so the index's prefixes and keys are uniform).
//!
//! Volumes are 1 PiB (the engine's limit; thin, so memory follows the LBAs
//! touched). Reads are counted, not replayed (the null backend has no data).
//! The engine is flushed every [`FLUSH_EVERY_REQUESTS`] requests so freed
//! blocks are recycled, and the index memory is sampled then for its peak.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dedupd_engine::index::EvictionPolicy;
use dedupd_engine::{
    Engine, EngineConfig, Fingerprint, HashAlgorithm, Lba, Stats, VolumeId, BLOCK_SIZE,
};

use crate::error::{Result, TraceError};
use crate::reader::{Format, TraceReader};
use crate::request::{Digest, Op, Request, SECTOR_SIZE};

/// Size of each stream's volume: 1 PiB, the engine's maximum.
pub const VOLUME_BYTES: u64 = 1 << 50;
/// Requests between engine flushes (and index-memory samples).
pub const FLUSH_EVERY_REQUESTS: u64 = 4096;
/// Requests between progress callbacks.
const PROGRESS_EVERY_REQUESTS: u64 = 8192;

/// Fingerprint-index policies this build can replay with: `exact` (every
/// stored block's fingerprint stays in memory) and the engine's bounded
/// policies `g-lru` (SmartDedup §3.2 group LRU) and `lru`.
pub const AVAILABLE_POLICIES: &[&str] = &["exact", "g-lru", "lru"];
/// Policies named by the design (ARCHITECTURE.md, index) but not built yet.
pub const PLANNED_POLICIES: &[&str] = &["lfu", "arc", "refcount"];
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
    /// One stream per trace file.
    #[default]
    File,
    /// One stream per process name within a file.
    Process,
    /// One stream per process id within a file.
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
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            format: None,
            stream_by: StreamBy::File,
            skip_bad: false,
            policy: "exact".into(),
            index_memory_bytes: None,
        }
    }
}

/// Builds the engine a replay runs on: the one place where a policy and an
/// index budget turn into an engine configuration. `exact` takes no budget;
/// `g-lru` and `lru` use `index_memory_bytes` (default
/// [`default_index_memory_bytes`]) with the engine's default lookup mode.
///
/// Errors: [`TraceError::Config`] for a policy not built yet, an unknown
/// policy, or a budget given to the unbounded `exact` policy.
pub fn build_engine(cfg: &ReplayConfig) -> Result<Engine> {
    let mut ec = EngineConfig::default();
    match cfg.policy.as_str() {
        "exact" => {
            if let Some(b) = cfg.index_memory_bytes {
                return Err(TraceError::Config(format!(
                    "policy exact keeps every fingerprint; an index memory budget ({b} bytes) needs a bounded policy ({})",
                    AVAILABLE_POLICIES[1..].join(", ")
                )));
            }
            ec.index.memory_budget_bytes = UNBOUNDED_INDEX_BYTES;
        }
        p @ ("g-lru" | "glru" | "lru") => {
            ec.index.policy = p.parse::<EvictionPolicy>().map_err(TraceError::Config)?;
            ec.index.memory_budget_bytes = cfg
                .index_memory_bytes
                .unwrap_or_else(default_index_memory_bytes);
        }
        p if PLANNED_POLICIES.contains(&p) => {
            return Err(TraceError::Config(format!(
                "policy {p} is not available yet (available: {})",
                AVAILABLE_POLICIES.join(", ")
            )))
        }
        p => {
            return Err(TraceError::Config(format!(
                "unknown policy {p:?} (available: {}; planned: {})",
                AVAILABLE_POLICIES.join(", "),
                PLANNED_POLICIES.join(", ")
            )))
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
    /// `file`, `file:process` or `file:pid`.
    pub name: String,
    /// Name of its volume in the engine.
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
    /// 4 KiB blocks read.
    pub blocks_read: u64,
    /// 4 KiB blocks written (zero blocks included), as the engine counts.
    pub blocks_written: u64,
    /// Written blocks that were all zeros.
    pub zero_blocks_written: u64,
    /// Duplicates the engine found inline (its `duplicate_writes_eliminated`).
    pub duplicate_blocks_inline: u64,
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
    /// Metadata I/O: journal bytes in use at the end (0 for the simulated
    /// engine, which has no journal).
    pub journal_bytes: u64,
    /// Peak bytes of the fingerprint index in memory (sampled at each flush
    /// and at the end).
    pub peak_index_bytes_in_memory: u64,
    /// Fingerprints in the index at the end.
    pub index_entries: u64,
    /// Blocks mapped in all volumes at the end.
    pub mapped_blocks: u64,
    /// Extents in all volume maps at the end (fragmentation: fewer is better).
    pub extents: u64,
    /// `mapped_blocks ÷ extents` (0 when nothing is mapped).
    pub mean_extent_blocks: f64,
    /// Wall-clock time of the replay in seconds.
    pub elapsed_seconds: f64,
    /// Requests per second of wall-clock time.
    pub requests_per_second: f64,
    /// Per-stream figures, by order of first request.
    pub streams: Vec<StreamReport>,
    /// The engine's own figures at the end.
    pub engine: Stats,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The engine fingerprint of a 16-byte trace digest: a 64-bit mix of the
/// whole digest, then the digest itself (then zeros). The engine's index
/// keys on the first 64 bits and its prefix tree on the first P bits, which
/// assume uniformly random fingerprints; MD5 digests are, but synthetic or
/// structured digests (fixtures, counters) need not be. The digest is kept
/// whole, so distinct digests stay distinct fingerprints.
pub fn fingerprint_of(d: &Digest) -> Fingerprint {
    let lo = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(d[8..].try_into().expect("8 bytes"));
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(&splitmix64(lo ^ splitmix64(hi)).to_le_bytes());
    b[8..].copy_from_slice(d);
    Fingerprint::from_digest(&b)
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A volume name from a label: `[A-Za-z0-9._-]`, others become `_`, at most
/// 64 characters, prefixed with the stream index for uniqueness.
fn volume_name(index: usize, label: &str) -> String {
    let mut s = format!("s{index}-");
    for c in label.chars() {
        if s.len() >= 64 {
            break;
        }
        s.push(
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            },
        );
    }
    s
}

#[derive(PartialEq, Eq, Hash)]
enum StreamKey {
    File(usize),
    Pid(usize, u32),
    Process(usize, String),
}

struct Input {
    reader: TraceReader,
    head: Request,
    live: bool,
    /// Stream index per source id of this reader.
    stream_of: Vec<Option<usize>>,
}

struct Stream {
    report: StreamReport,
    volume: VolumeId,
}

/// Replays `paths` (interleaved by time stamp) under `cfg`, calling
/// `progress` now and then (and once at the end).
///
/// Errors: a policy that is not available ([`build_engine`]), I/O, a
/// malformed line (unless `skip_bad`), or a request the engine refuses
/// (beyond 1 PiB; skipped and counted with `skip_bad`).
pub fn replay(
    paths: &[PathBuf],
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Report> {
    let engine = build_engine(cfg)?;
    let started = Instant::now();
    let consumed = Arc::new(AtomicU64::new(0));
    let mut bytes_total = 0;
    let mut inputs = Vec::with_capacity(paths.len());
    for p in paths {
        bytes_total += std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let mut reader = TraceReader::open(p, cfg.format, cfg.skip_bad, consumed.clone())?;
        let mut head = Request::default();
        let live = reader.next_into(&mut head)?;
        inputs.push(Input {
            reader,
            head,
            live,
            stream_of: Vec::new(),
        });
    }
    let mut streams: Vec<Stream> = Vec::new();
    let mut keys: HashMap<StreamKey, usize> = HashMap::new();
    let mut exact: HashSet<Digest> = HashSet::new();
    let mut r = Report {
        traces: paths.iter().map(|p| p.display().to_string()).collect(),
        policy: cfg.policy.clone(),
        index_memory_bytes: cfg.index_memory_bytes,
        stream_by: cfg.stream_by,
        ..Report::default()
    };
    let mut fps: Vec<Option<Fingerprint>> = Vec::new();
    let max_blocks = VOLUME_BYTES / BLOCK_SIZE as u64;
    loop {
        // the input whose head is earliest (ties: the first file)
        let mut pick: Option<usize> = None;
        for (i, inp) in inputs.iter().enumerate() {
            if inp.live && pick.is_none_or(|p| inp.head.ts_ns < inputs[p].head.ts_ns) {
                pick = Some(i);
            }
        }
        let Some(i) = pick else { break };
        let inp = &mut inputs[i];
        let req = &inp.head;

        // the request's stream and volume
        let src = req.source as usize;
        if inp.stream_of.len() <= src {
            inp.stream_of.resize(src + 1, None);
        }
        let s = match inp.stream_of[src] {
            Some(s) => s,
            None => {
                let source = &inp.reader.sources()[src];
                let (key, label) = match cfg.stream_by {
                    StreamBy::File => (StreamKey::File(i), inp.reader.name().to_string()),
                    StreamBy::Pid => (
                        StreamKey::Pid(i, source.pid),
                        format!("{}:{}", inp.reader.name(), source.pid),
                    ),
                    StreamBy::Process => (
                        StreamKey::Process(i, source.process.clone()),
                        format!("{}:{}", inp.reader.name(), source.process),
                    ),
                };
                let s = match keys.get(&key) {
                    Some(&s) => s,
                    None => {
                        let s = streams.len();
                        let base = label.rsplit('/').next().unwrap_or(&label).to_string();
                        let volume = volume_name(s, &base);
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

        let first = req.first_block();
        let n = match req.op {
            Some(Op::Write) => req.blocks.len() as u64,
            _ => req.blocks_touched(),
        };
        let in_range = first.checked_add(n).is_some_and(|end| end <= max_blocks);
        if !in_range {
            if !inp.reader.skip_bad_request() {
                return Err(TraceError::Request {
                    location: inp.reader.location(),
                    msg: format!("blocks {first}..+{n} pass the 1 PiB volume limit"),
                });
            }
        } else {
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
                    fps.clear();
                    for b in &req.blocks {
                        match b {
                            Some(d) => {
                                if !exact.insert(*d) {
                                    r.exact_duplicate_blocks += 1;
                                }
                                fps.push(Some(fingerprint_of(d)));
                            }
                            None => fps.push(None),
                        }
                    }
                    engine
                        .write_fingerprinted(stream.volume, Lba(first), &fps)
                        .map_err(|e| TraceError::Request {
                            location: inp.reader.location(),
                            msg: e.to_string(),
                        })?;
                }
                Some(Op::Trim) => {
                    r.trims += 1;
                    engine
                        .trim(
                            stream.volume,
                            req.lba_sectors * SECTOR_SIZE,
                            req.sectors * SECTOR_SIZE,
                            false,
                        )
                        .map_err(|e| TraceError::Request {
                            location: inp.reader.location(),
                            msg: e.to_string(),
                        })?;
                }
                None => {}
            }
            if r.requests.is_multiple_of(FLUSH_EVERY_REQUESTS) {
                engine.flush()?;
                r.peak_index_bytes_in_memory = r
                    .peak_index_bytes_in_memory
                    .max(engine.stats().index_bytes_in_memory);
            }
            if r.requests.is_multiple_of(PROGRESS_EVERY_REQUESTS) {
                progress(&Progress {
                    bytes_read: consumed.load(Ordering::Relaxed),
                    bytes_total,
                    requests: r.requests,
                    blocks_written: r.blocks_written,
                });
            }
        }
        let inp = &mut inputs[i];
        inp.live = inp.reader.next_into(&mut inp.head)?;
    }
    engine.flush()?;
    let st = engine.stats();
    progress(&Progress {
        bytes_read: consumed.load(Ordering::Relaxed),
        bytes_total,
        requests: r.requests,
        blocks_written: st.blocks_written,
    });
    r.bad_records_skipped = inputs.iter().map(|i| i.reader.bad_records()).sum();
    r.blocks_written = st.blocks_written;
    r.zero_blocks_written = st.zero_blocks_written;
    r.duplicate_blocks_inline = st.duplicate_writes_eliminated;
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
    r.journal_bytes = st.journal_bytes;
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
