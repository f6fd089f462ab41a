//! Figures of a trace by itself, without the engine (`dedupd trace stats`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::Result;
use crate::reader::{Format, TraceReader};
use crate::request::{Digest, Op, Request};

/// Figures of one trace. Blocks are 4 KiB; sectors 512 bytes.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TraceStats {
    /// Format read.
    pub format: Option<Format>,
    /// Requests.
    pub requests: u64,
    /// Read requests.
    pub reads: u64,
    /// Write requests.
    pub writes: u64,
    /// Trim requests.
    pub trims: u64,
    /// Malformed lines skipped (with `skip_bad`).
    pub bad_records_skipped: u64,
    /// Blocks read (blocks touched by reads).
    pub blocks_read: u64,
    /// Blocks written (one per digest of a write).
    pub blocks_written: u64,
    /// Written blocks that are all zeros.
    pub zero_blocks_written: u64,
    /// Distinct non-zero digests written.
    pub distinct_fingerprints: u64,
    /// Written non-zero blocks whose digest was written before.
    pub exact_duplicate_blocks: u64,
    /// `exact_duplicate_blocks` in percent of `blocks_written`.
    pub exact_duplicate_percent: f64,
    /// Mean reuse distance of duplicates, in written blocks (HPDedup
    /// §II-B, Fig. 1): with the written blocks numbered 0, 1, 2, … in
    /// trace order (zero blocks included), a duplicate's distance is its
    /// number minus that of the latest earlier write of the same digest (1
    /// for a repeat of the block just before it). 0 without duplicates.
    pub mean_reuse_distance_blocks: f64,
    /// Distinct (pid, process, device) sources.
    pub sources: u64,
    /// Distinct process ids.
    pub pids: u64,
    /// Distinct process names.
    pub processes: u64,
    /// Distinct devices (disks; a trace without device numbers has one,
    /// device 0; 0 for a trace without sources).
    pub devices: u64,
    /// Lowest sector addressed (None for an empty trace).
    pub lba_min_sectors: Option<u64>,
    /// One past the highest sector addressed.
    pub lba_end_sectors: Option<u64>,
    /// First time stamp in nanoseconds.
    pub first_ts_ns: Option<u64>,
    /// Last request's time stamp in nanoseconds.
    pub last_ts_ns: Option<u64>,
    /// Largest time stamp in nanoseconds (the trace's duration is
    /// `max_ts_ns − first_ts_ns`: replay raises a time stamp that steps
    /// back to the largest before it).
    pub max_ts_ns: Option<u64>,
    /// Requests whose time stamp is below an earlier one's (replay
    /// counts them as `timestamps_clamped` too).
    pub timestamps_clamped: u64,
}

/// Reads the whole trace at `path` and computes its figures. Memory grows
/// with the distinct digests (a map digest → last position). A trace
/// without requests (an empty file, say) is not an error here: its
/// figures are zeros, without time stamps or LBA range.
///
/// Errors: as [`TraceReader::open`] and [`TraceReader::next_into`].
pub fn trace_stats(path: &Path, format: Option<Format>, skip_bad: bool) -> Result<TraceStats> {
    trace_stats_counting(path, format, skip_bad, Arc::new(AtomicU64::new(0)))
}

/// [`trace_stats`], adding the bytes read from the file (compressed, if it
/// is) to `consumed` as it goes, for a progress display.
///
/// Errors: as [`trace_stats`].
pub fn trace_stats_counting(
    path: &Path,
    format: Option<Format>,
    skip_bad: bool,
    consumed: Arc<AtomicU64>,
) -> Result<TraceStats> {
    let mut reader = TraceReader::open(path, format, skip_bad, consumed)?;
    let mut s = TraceStats {
        format: Some(reader.format()),
        ..TraceStats::default()
    };
    let mut last_pos: HashMap<Digest, u64> = HashMap::new();
    let mut distance_sum: u128 = 0;
    let mut req = Request::default();
    while reader.next_into(&mut req)? {
        s.requests += 1;
        s.lba_min_sectors = Some(
            s.lba_min_sectors
                .map_or(req.lba_sectors, |m| m.min(req.lba_sectors)),
        );
        let end = req.lba_sectors.saturating_add(req.sectors);
        s.lba_end_sectors = Some(s.lba_end_sectors.map_or(end, |m| m.max(end)));
        s.first_ts_ns.get_or_insert(req.ts_ns);
        s.last_ts_ns = Some(req.ts_ns);
        match s.max_ts_ns {
            Some(m) if req.ts_ns < m => s.timestamps_clamped += 1,
            _ => s.max_ts_ns = Some(req.ts_ns),
        }
        match req.op {
            Some(Op::Read) => {
                s.reads += 1;
                s.blocks_read += req.blocks_touched();
            }
            Some(Op::Write) => {
                s.writes += 1;
                for b in &req.blocks {
                    let pos = s.blocks_written;
                    s.blocks_written += 1;
                    match b {
                        None => s.zero_blocks_written += 1,
                        Some(d) => {
                            if let Some(prev) = last_pos.insert(*d, pos) {
                                s.exact_duplicate_blocks += 1;
                                distance_sum += (pos - prev) as u128;
                            }
                        }
                    }
                }
            }
            Some(Op::Trim) => s.trims += 1,
            None => {}
        }
    }
    s.bad_records_skipped = reader.bad_records();
    s.distinct_fingerprints = last_pos.len() as u64;
    s.exact_duplicate_percent = if s.blocks_written == 0 {
        0.0
    } else {
        100.0 * s.exact_duplicate_blocks as f64 / s.blocks_written as f64
    };
    s.mean_reuse_distance_blocks = if s.exact_duplicate_blocks == 0 {
        0.0
    } else {
        distance_sum as f64 / s.exact_duplicate_blocks as f64
    };
    let src = reader.sources();
    s.sources = src.len() as u64;
    s.pids = src
        .iter()
        .map(|x| x.pid)
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    s.processes = src
        .iter()
        .map(|x| x.process.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    s.devices = src
        .iter()
        .map(|x| x.device)
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    Ok(s)
}
