//! Parameter sweeps (`dedupd sweep`): every (trace, policy, index budget)
//! of a grid replayed on its own simulated engine, on all cores (std
//! threads), with results as CSV and JSON and one figure per trace
//! ([`crate::plot`]).
//!
//! Unbounded policies (`exact`, with or without filters) take no budget:
//! each runs once per trace. Plain `exact` is the figures' 100 % reference
//! line; `exact` with filters is drawn as a level line of its own.
//!
//! A trace may be named once only (the same file twice would mix its
//! rows); traces whose names make the same figure file name get figures
//! of their own (`-2`, `-3`, … after the name).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{io_err, Result, TraceError};
use crate::replay::{replay, PolicySpec, ReplayConfig, Report};

/// A sweep grid.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// Trace files (each replayed alone).
    pub traces: Vec<PathBuf>,
    /// Policy names as [`PolicySpec`] parses them (`exact`, `g-lru`,
    /// `lru+t4`, …).
    pub policies: Vec<String>,
    /// Index budgets in bytes for the bounded policies.
    pub budgets: Vec<u64>,
    /// Worker threads (at least 1).
    pub jobs: usize,
    /// Format, stream key, bad-line handling and prefix bits of every
    /// replay (its policy and budget are set per point).
    pub base: ReplayConfig,
}

/// One point of the grid. Percentages are of blocks written unless said.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SweepRow {
    /// The trace's name: its file name, or its path as given where
    /// another trace of the sweep has the same file name ([`trace_names`]).
    pub trace: String,
    /// Policy name as given.
    pub policy: String,
    /// Index budget in bytes (None: exact, unbounded).
    pub index_memory_bytes: Option<u64>,
    /// Requests replayed.
    pub requests: u64,
    /// Malformed lines and refused requests skipped (with `skip_bad`; 0
    /// without).
    #[serde(default)]
    pub bad_records_skipped: u64,
    /// 4 KiB blocks written.
    pub blocks_written: u64,
    /// Duplicates an exact dedup finds (blocks).
    pub exact_duplicate_blocks: u64,
    /// Duplicates found inline (blocks).
    pub duplicate_blocks_inline: u64,
    /// Inline duplicates in percent of blocks written.
    pub duplicate_percent: f64,
    /// Inline duplicates in percent of the exact duplicates.
    pub of_exact_percent: f64,
    /// On-disk fingerprint-group reads done by evictions.
    pub eviction_reads: u64,
    /// On-disk fingerprint-group writes done by evictions.
    pub eviction_writes: u64,
    /// Fingerprints evicted from memory.
    pub entries_evicted: u64,
    /// Groups evicted whole (G-LRU).
    pub groups_evicted: u64,
    /// Peak index memory in bytes.
    pub peak_index_bytes: u64,
    /// Extents in the volume maps at the end.
    pub extents: u64,
    /// Blocks cryptographically fingerprinted.
    pub blocks_fingerprinted: u64,
    /// Modelled hashing time in seconds.
    pub hashing_seconds_modelled: f64,
    /// Wall-clock seconds of the replay.
    pub elapsed_seconds: f64,
    /// Requests per second of the replay.
    pub requests_per_second: f64,
}

impl SweepRow {
    /// The row of a replay report.
    pub fn from_report(trace: &str, r: &Report) -> SweepRow {
        let ix = &r.engine.index;
        SweepRow {
            trace: trace.to_string(),
            policy: r.policy.clone(),
            index_memory_bytes: r.index_memory_bytes,
            requests: r.requests,
            bad_records_skipped: r.bad_records_skipped,
            blocks_written: r.blocks_written,
            exact_duplicate_blocks: r.exact_duplicate_blocks,
            duplicate_blocks_inline: r.duplicate_blocks_inline,
            duplicate_percent: r.duplicate_writes_eliminated_percent,
            of_exact_percent: r.inline_of_exact_percent,
            eviction_reads: ix.eviction_reads,
            eviction_writes: ix.eviction_writes,
            entries_evicted: ix.entries_evicted,
            groups_evicted: ix.groups_evicted,
            peak_index_bytes: r.peak_index_bytes_in_memory,
            extents: r.extents,
            blocks_fingerprinted: r.blocks_fingerprinted,
            hashing_seconds_modelled: r.hashing_seconds_modelled,
            elapsed_seconds: r.elapsed_seconds,
            requests_per_second: r.requests_per_second,
        }
    }

    /// Eviction I/Os: reads plus writes of on-disk groups.
    pub fn eviction_ios(&self) -> u64 {
        self.eviction_reads + self.eviction_writes
    }
}

/// The name a trace has in results: its file name.
pub fn trace_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// The names of `traces` in a sweep's rows and figures: each file's name
/// ([`trace_name`]), or its path as given where two traces share a file
/// name (rows and figures must tell them apart).
pub fn trace_names(traces: &[PathBuf]) -> Vec<String> {
    let short: Vec<String> = traces.iter().map(|t| trace_name(t)).collect();
    short
        .iter()
        .zip(traces)
        .map(|(n, t)| {
            if short.iter().filter(|m| *m == n).count() > 1 {
                t.display().to_string()
            } else {
                n.clone()
            }
        })
        .collect()
}

/// Checks that no file is among `traces` twice: the same file by device
/// and inode, so `t.fiu`, `./t.fiu` and a hard or symbolic link to it are
/// one ([`crate::input::same_file`]; a path that does not exist is
/// compared by its spelling).
///
/// Errors: [`TraceError::Config`] naming the first trace given twice.
pub fn check_distinct_traces(traces: &[PathBuf]) -> Result<()> {
    match first_repeat(traces, |a, b| crate::input::same_file(a, b)) {
        Some((first, again)) => Err(TraceError::Config(format!(
            "trace {} is given more than once{} (each trace is swept once)",
            traces[again].display(),
            spelled_as(&traces[first].display(), &traces[again].display()),
        ))),
        None => Ok(()),
    }
}

/// Checks that no policy is among `policies` twice, comparing them as
/// parsed ([`PolicySpec`]): `lru+sampling+prehash` and
/// `lru+prehash+sampling` are one policy.
///
/// Errors: [`TraceError::Config`] for a policy that does not parse, or
/// naming the first policy given twice.
pub fn check_distinct_policies(policies: &[String]) -> Result<()> {
    let specs = policies
        .iter()
        .map(|p| p.parse::<PolicySpec>())
        .collect::<Result<Vec<_>>>()?;
    match first_repeat(&specs, |a, b| a == b) {
        Some((first, again)) => Err(TraceError::Config(format!(
            "policy {:?} is given more than once{} (each policy is swept once)",
            policies[again],
            spelled_as(
                &format!("{:?}", policies[first]),
                &format!("{:?}", policies[again])
            ),
        ))),
        None => Ok(()),
    }
}

/// Checks that no index memory budget (in bytes) is among `budgets` twice;
/// `spellings`, if given, are the budgets as the user wrote them (one per
/// budget), for the message.
///
/// Errors: [`TraceError::Config`] naming the first budget given twice
/// (as spelt, with its bytes when the two spellings differ; else in
/// bytes).
pub fn check_distinct_budgets(budgets: &[u64], spellings: Option<&[String]>) -> Result<()> {
    let Some((first, again)) = first_repeat(budgets, |a, b| a == b) else {
        return Ok(());
    };
    Err(TraceError::Config(match spellings {
        Some(sp) if sp.len() == budgets.len() => format!(
            "budget {} is given more than once{} (each budget is swept once)",
            sp[again],
            if sp[first] == sp[again] {
                String::new()
            } else {
                format!(" (as {}; both are {} bytes)", sp[first], budgets[again])
            }
        ),
        _ => format!(
            "index memory budget of {} bytes is given more than once (each budget is swept once)",
            budgets[again]
        ),
    }))
}

/// The indices (earlier, later) of the first item of `items` equal to an
/// earlier one under `same`.
pub fn first_repeat<T>(items: &[T], same: impl Fn(&T, &T) -> bool) -> Option<(usize, usize)> {
    (1..items.len()).find_map(|j| (0..j).find(|&i| same(&items[i], &items[j])).map(|i| (i, j)))
}

/// ` (as FIRST)` when the repeat is spelled otherwise than the first.
pub(crate) fn spelled_as(first: &dyn std::fmt::Display, again: &dyn std::fmt::Display) -> String {
    let (first, again) = (first.to_string(), again.to_string());
    if first == again {
        String::new()
    } else {
        format!(" (as {first})")
    }
}

/// Runs the grid on `cfg.jobs` threads, calling `done(row, finished,
/// total)` as points finish. Points start round-robin over the traces
/// (every trace's first point, then every trace's second, …), so each
/// trace is read early; rows come back in grid order (trace, policy,
/// budget). After a failure no further point starts
/// ([`run_sweep_keeping_rows`] returns the rows that finished too).
///
/// Errors: a trace, policy or budget given twice
/// ([`check_distinct_traces`], [`check_distinct_policies`],
/// [`check_distinct_budgets`]) or a policy that does not parse (all
/// before anything runs), or the first replay that fails.
pub fn run_sweep(
    cfg: &SweepConfig,
    done: &(dyn Fn(&SweepRow, usize, usize) + Sync),
) -> Result<Vec<SweepRow>> {
    run_sweep_with_progress(cfg, done, &|_, _| {})
}

/// [`run_sweep`], also calling `progress(bytes_read, bytes_total)` as the
/// replays read their traces: bytes of trace files read since that
/// worker's last call, of the sum of each point's trace size on disk (a
/// trace swept at several points counts once per point); the calls add up
/// to that sum once every point ran. Called from the worker threads, at
/// most every 4096 requests of each.
///
/// Errors: as [`run_sweep`].
pub fn run_sweep_with_progress(
    cfg: &SweepConfig,
    done: &(dyn Fn(&SweepRow, usize, usize) + Sync),
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<SweepRow>> {
    match run_sweep_keeping_rows(cfg, done, progress) {
        (rows, None) => Ok(rows),
        (_, Some(e)) => Err(e),
    }
}

/// [`run_sweep_with_progress`], returning the rows of the points that
/// finished (in grid order) together with the error that stopped the
/// sweep, if one did (the first in grid order among the points that
/// failed; or a trace, policy or budget given twice or a policy that does not parse, found
/// before any point runs, with no rows). For writing what finished when a
/// point fails ([`write_partial`]).
pub fn run_sweep_keeping_rows(
    cfg: &SweepConfig,
    done: &(dyn Fn(&SweepRow, usize, usize) + Sync),
    progress: &(dyn Fn(u64, u64) + Sync),
) -> (Vec<SweepRow>, Option<TraceError>) {
    match plan_and_run(cfg, done, progress) {
        Ok(results) => collect_results(results, cfg.base.stopped()),
        Err(e) => (Vec::new(), Some(e)),
    }
}

/// Runs the grid: each point's result in grid order (`None`: a point left
/// out after a failure). Errors: those found before any point runs.
fn plan_and_run(
    cfg: &SweepConfig,
    done: &(dyn Fn(&SweepRow, usize, usize) + Sync),
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<Option<Result<SweepRow>>>> {
    check_distinct_traces(&cfg.traces)?;
    check_distinct_policies(&cfg.policies)?;
    check_distinct_budgets(&cfg.budgets, None)?;
    let names = trace_names(&cfg.traces);
    let mut points: Vec<(&PathBuf, &str, String, Option<u64>)> = Vec::new();
    for (t, name) in cfg.traces.iter().zip(&names) {
        for p in &cfg.policies {
            let spec: PolicySpec = p.parse()?;
            if spec.eviction.is_none() {
                points.push((t, name, p.clone(), None));
            } else {
                for &b in &cfg.budgets {
                    points.push((t, name, p.clone(), Some(b)));
                }
            }
        }
    }
    // after a failure no further point starts (the error is returned)
    let failed = std::sync::atomic::AtomicBool::new(false);
    let total = points.len();
    let bytes_total: u64 = points
        .iter()
        .map(|p| std::fs::metadata(p.0).map_or(0, |m| m.len()))
        .sum();
    // run order: the first point of every trace, then the second of
    // every trace, …, so each trace is read early and a malformed one
    // stops the sweep near its start, not after hours of other points
    let mut order: Vec<usize> = (0..total).collect();
    let mut nth_of_trace = vec![0usize; total];
    for i in 1..total {
        if points[i].0 == points[i - 1].0 {
            nth_of_trace[i] = nth_of_trace[i - 1] + 1;
        }
    }
    order.sort_by_key(|&i| nth_of_trace[i]);
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<SweepRow>>>> =
        Mutex::new((0..total).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..cfg.jobs.clamp(1, total.max(1)) {
            s.spawn(|| loop {
                // (checked before a point is taken: a point taken runs,
                // unless the sweep is stopped)
                if failed.load(Ordering::Relaxed) || cfg.base.stopped() {
                    break;
                }
                let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                let (trace, name, policy, budget) = &points[i];
                let rc = ReplayConfig {
                    policy: policy.clone(),
                    index_memory_bytes: *budget,
                    ..cfg.base.clone()
                };
                // (each replay reports its own bytes read so far: added
                // to the sweep's as they grow)
                let mut seen = 0u64;
                let out = replay(std::slice::from_ref(*trace), &rc, &mut |p| {
                    let delta = p.bytes_read.saturating_sub(seen);
                    seen = seen.max(p.bytes_read);
                    progress(delta, bytes_total);
                })
                .map(|r| SweepRow::from_report(name, &r));
                if out.is_ok() {
                    // (the rest of the file, read past the last report)
                    let size = std::fs::metadata(trace).map_or(0, |m| m.len());
                    progress(size.saturating_sub(seen), bytes_total);
                }
                match &out {
                    Ok(row) => {
                        let n = finished.fetch_add(1, Ordering::Relaxed) + 1;
                        done(row, n, total);
                    }
                    Err(_) => failed.store(true, Ordering::Relaxed),
                }
                results.lock().expect("results lock")[i] = Some(out);
            });
        }
    });
    Ok(results.into_inner().expect("results lock"))
}

/// The rows of a sweep's points that finished, in grid order (`None`: a
/// point that did not run, as none starts after a failure), and its first
/// error in grid order — an error of a point that ran, never that of a
/// point left out because of it.
fn collect_results(
    results: Vec<Option<Result<SweepRow>>>,
    stopped: bool,
) -> (Vec<SweepRow>, Option<TraceError>) {
    let mut rows = Vec::with_capacity(results.len());
    let mut first_error = None;
    let mut skipped = false;
    for r in results {
        match r {
            Some(Ok(row)) => rows.push(row),
            Some(Err(e)) => {
                first_error.get_or_insert(e);
            }
            None => skipped = true,
        }
    }
    if skipped && first_error.is_none() {
        // (only a failure or a stop keeps points from running)
        first_error = Some(if stopped {
            TraceError::Interrupted
        } else {
            TraceError::Config("a sweep point did not run".into())
        });
    }
    (rows, first_error)
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The rows as pretty JSON: an array of [`SweepRow`] objects, each with
/// `eviction_ios` added (as the CSV has it).
///
/// Errors: encoding (not expected).
pub fn to_json(rows: &[SweepRow]) -> Result<String> {
    #[derive(serde::Serialize)]
    struct Out<'a> {
        #[serde(flatten)]
        row: &'a SweepRow,
        eviction_ios: u64,
    }
    let out: Vec<Out<'_>> = rows
        .iter()
        .map(|row| Out {
            row,
            eviction_ios: row.eviction_ios(),
        })
        .collect();
    serde_json::to_string_pretty(&out)
        .map_err(|e| TraceError::Config(format!("encoding results: {e}")))
}

/// The rows as CSV (a header line, then one line per row).
pub fn to_csv(rows: &[SweepRow]) -> String {
    let mut out = String::from(
        "trace,policy,index_memory_bytes,requests,bad_records_skipped,blocks_written,exact_duplicate_blocks,duplicate_blocks_inline,duplicate_percent,of_exact_percent,eviction_reads,eviction_writes,eviction_ios,entries_evicted,groups_evicted,peak_index_bytes,extents,blocks_fingerprinted,hashing_seconds_modelled,elapsed_seconds,requests_per_second\n",
    );
    for r in rows {
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{:.4},{:.4},{},{},{},{},{},{},{},{},{:.6},{:.3},{:.0}\n",
            csv_field(&r.trace),
            csv_field(&r.policy),
            r.index_memory_bytes
                .map_or(String::new(), |b| b.to_string()),
            r.requests,
            r.bad_records_skipped,
            r.blocks_written,
            r.exact_duplicate_blocks,
            r.duplicate_blocks_inline,
            r.duplicate_percent,
            r.of_exact_percent,
            r.eviction_reads,
            r.eviction_writes,
            r.eviction_ios(),
            r.entries_evicted,
            r.groups_evicted,
            r.peak_index_bytes,
            r.extents,
            r.blocks_fingerprinted,
            r.hashing_seconds_modelled,
            r.elapsed_seconds,
            r.requests_per_second,
        ));
    }
    out
}

/// Writes `results.csv`, `results.json` and, per trace, the figures
/// `<stem>-duplicates.{png,svg}` and `<stem>-eviction-io.{png,svg}` into
/// `dir` (created if needed), the stem as [`figure_stems`] makes it from
/// the traces in order of their first row, and removes the partial results
/// of an earlier failed sweep ([`write_partial`]) from it, and the figures
/// of a trace swept with `exact` alone (none are drawn for it). Figures of
/// traces not in `rows` are left. Returns the files written.
///
/// Errors: I/O, or a drawing failure.
pub fn write_outputs(rows: &[SweepRow], dir: &Path) -> Result<Vec<PathBuf>> {
    let name = dir.display().to_string();
    std::fs::create_dir_all(dir).map_err(io_err(&name))?;
    let mut files = Vec::new();
    let csv = dir.join("results.csv");
    crate::output::write_whole(&csv, to_csv(rows).as_bytes())?;
    files.push(csv);
    let json = dir.join("results.json");
    let text = to_json(rows)?;
    crate::output::write_whole(&json, (text + "\n").as_bytes())?;
    files.push(json);
    // (partial results of an earlier sweep that failed are stale now)
    for stale in ["results.partial.csv", "results.partial.json"] {
        remove_if_present(&dir.join(stale)).map_err(io_err(&name))?;
    }
    let mut traces: Vec<&str> = Vec::new();
    for r in rows {
        if !traces.contains(&r.trace.as_str()) {
            traces.push(&r.trace);
        }
    }
    let stems = figure_stems(&traces);
    for (t, stem) in traces.into_iter().zip(&stems) {
        // (a figure plots the bounded policies against their budget; a
        // trace swept with `exact` alone has none to draw, and an earlier
        // sweep's figures of it would contradict these results)
        if !rows
            .iter()
            .any(|r| r.trace == t && r.index_memory_bytes.is_some())
        {
            for (path, _) in figure_paths(dir, stem) {
                remove_if_present(&path).map_err(io_err(&name))?;
            }
            continue;
        }
        for (path, what) in figure_paths(dir, stem) {
            crate::output::write_via_temporary(&path, |tmp| crate::plot::draw(rows, t, what, tmp))?;
            files.push(path);
        }
    }
    Ok(files)
}

/// Removes `path`; one already gone is no error.
fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Writes the rows of the points that finished before a sweep failed as
/// `results.partial.csv` and `results.partial.json` in `dir` (created if
/// needed), in the columns of [`write_outputs`]; no figures. Returns the
/// files written.
///
/// Errors: I/O.
pub fn write_partial(rows: &[SweepRow], dir: &Path) -> Result<Vec<PathBuf>> {
    let name = dir.display().to_string();
    std::fs::create_dir_all(dir).map_err(io_err(&name))?;
    let csv = dir.join("results.partial.csv");
    crate::output::write_whole(&csv, to_csv(rows).as_bytes())?;
    let json = dir.join("results.partial.json");
    let text = to_json(rows)?;
    crate::output::write_whole(&json, (text + "\n").as_bytes())?;
    Ok(vec![csv, json])
}

/// The file-name stems of the figures of traces `names` (distinct names,
/// in sweep order): each name with characters other than `[A-Za-z0-9._-]`
/// replaced by `_`, then, where that stem is taken already by an earlier
/// trace, `-2`, `-3`, … appended (the first free one), so no two traces
/// share a figure file.
pub fn figure_stems<S: AsRef<str>>(names: &[S]) -> Vec<String> {
    let mut taken = std::collections::HashSet::new();
    names
        .iter()
        .map(|name| {
            let base = name.as_ref().replace(
                |c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)),
                "_",
            );
            let mut stem = base.clone();
            let mut n = 1;
            while !taken.insert(stem.clone()) {
                n += 1;
                stem = format!("{base}-{n}");
            }
            stem
        })
        .collect()
}

/// The figures of stem `stem` ([`figure_stems`]) in `dir`: duplicates and
/// eviction I/O, each as PNG and SVG.
fn figure_paths(dir: &Path, stem: &str) -> Vec<(PathBuf, crate::plot::Figure)> {
    let mut out = Vec::new();
    for (kind, what) in [
        ("duplicates", crate::plot::Figure::Duplicates),
        ("eviction-io", crate::plot::Figure::EvictionIo),
    ] {
        for ext in ["png", "svg"] {
            out.push((dir.join(format!("{stem}-{kind}.{ext}")), what));
        }
    }
    out
}

/// Every file [`write_outputs`] or [`write_partial`] may write in `dir`
/// for a sweep of `traces` (results, and each trace's figures), to check before the sweep runs
/// that none of them is an input.
pub fn output_paths(dir: &Path, traces: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = vec![
        dir.join("results.csv"),
        dir.join("results.json"),
        dir.join("results.partial.csv"),
        dir.join("results.partial.json"),
    ];
    for stem in figure_stems(&trace_names(traces)) {
        out.extend(figure_paths(dir, &stem).into_iter().map(|(p, _)| p));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_sharing_a_file_name_keep_their_paths() {
        let t = |s: &str| PathBuf::from(s);
        let names = trace_names(&[t("a/t.fiu"), t("b/t.fiu"), t("c/u.fiu"), t("a_t.fiu")]);
        assert_eq!(names, ["a/t.fiu", "b/t.fiu", "u.fiu", "a_t.fiu"]);
        // figure stems: the names made file names, told apart if need be
        assert_eq!(
            figure_stems(&names),
            ["a_t.fiu", "b_t.fiu", "u.fiu", "a_t.fiu-2"]
        );
    }

    #[test]
    fn traces_policies_and_budgets_given_twice_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.fiu");
        std::fs::write(&t, "1 1 p 0 8 W 6 0 00000000000000000000000000000001\n").unwrap();
        std::fs::hard_link(&t, dir.path().join("u.fiu")).unwrap();
        let u = dir.path().join("u.fiu");
        let e = check_distinct_traces(&[t.clone(), u.clone()]).unwrap_err();
        assert!(
            e.to_string().contains("u.fiu is given more than once (as "),
            "{e}"
        );
        assert!(check_distinct_traces(&[t.clone(), dir.path().join("v.fiu")]).is_ok());
        let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(check_distinct_policies(&p(&["lru", "g-lru", "lru+t2", "exact"])).is_ok());
        let e = check_distinct_policies(&p(&["lru", "g-lru", "lru"])).unwrap_err();
        assert!(
            e.to_string().contains("\"lru\" is given more than once"),
            "{e}"
        );
        let e = check_distinct_policies(&p(&["arc+prehash+t2", "arc+t2+prehash"])).unwrap_err();
        assert!(e.to_string().contains("(as \"arc+prehash+t2\")"), "{e}");
        assert!(check_distinct_budgets(&[1 << 20, 2 << 20], None).is_ok());
        let e = check_distinct_budgets(&[1 << 20, 2 << 20, 1 << 20], None).unwrap_err();
        assert!(e.to_string().contains("1048576 bytes"), "{e}");
        // a sweep checks all three before it runs anything
        let cfg = SweepConfig {
            traces: vec![t],
            policies: p(&["lru", "lru"]),
            budgets: vec![1 << 20],
            jobs: 1,
            base: ReplayConfig::default(),
        };
        let (rows, e) = run_sweep_keeping_rows(&cfg, &|_, _, _| {}, &|_, _| {});
        assert!(rows.is_empty());
        assert!(e.unwrap().to_string().contains("more than once"));
    }

    #[test]
    fn progress_reaches_the_bytes_of_every_point() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.fiu");
        let text: String = (0..5000u64)
            .map(|i| format!("{i} 1 p {} 8 W 6 0 {:032x}\n", i * 8, i % 700 + 1))
            .collect();
        std::fs::write(&t, &text).unwrap();
        let cfg = SweepConfig {
            traces: vec![t],
            // exact once, lru at two budgets: three points
            policies: vec!["exact".into(), "lru".into()],
            budgets: vec![1 << 20, 2 << 20],
            jobs: 2,
            base: ReplayConfig::default(),
        };
        let last = Mutex::new((0u64, 0u64));
        let rows = run_sweep_with_progress(&cfg, &|_, _, _| {}, &|read, total| {
            let mut l = last.lock().unwrap();
            *l = (l.0 + read, total);
            assert!(l.0 <= total, "{} of {total}", l.0);
        })
        .unwrap();
        assert_eq!(rows.len(), 3);
        let size = text.len() as u64;
        assert_eq!(*last.lock().unwrap(), (3 * size, 3 * size));
    }

    #[test]
    fn a_malformed_trace_stops_the_sweep_before_the_other_traces_points() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.fiu");
        let text: String = (0..2000u64)
            .map(|i| format!("{i} 1 p {} 8 W 6 0 {:032x}\n", i * 8, i % 300 + 1))
            .collect();
        std::fs::write(&good, &text).unwrap();
        let bad = dir.path().join("bad.fiu");
        std::fs::write(&bad, format!("{}not a trace line\n", &text[..200])).unwrap();
        let cfg = SweepConfig {
            traces: vec![good, bad],
            // three points per trace
            policies: vec!["exact".into(), "lru".into()],
            budgets: vec![1 << 20, 2 << 20],
            jobs: 1,
            base: ReplayConfig::default(),
        };
        let (finished, e) = run_sweep_keeping_rows(&cfg, &|_, _, _| {}, &|_, _| {});
        let e = e.unwrap();
        assert!(e.to_string().contains("bad.fiu"), "{e}");
        // the bad trace's first point ran second, not fourth
        assert_eq!(finished.len(), 1, "{finished:?}");
        assert_eq!(finished[0].trace, "good.fiu");
        assert_eq!(finished[0].policy, "exact");
        // what finished is written as a partial result
        let out = dir.path().join("out");
        let files = write_partial(&finished, &out).unwrap();
        let csv = std::fs::read_to_string(&files[0]).unwrap();
        assert_eq!(csv.lines().count(), 2, "{csv}");
        assert!(csv.lines().nth(1).unwrap().starts_with("good.fiu,exact,"));
    }

    #[test]
    fn rows_count_the_bad_records_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.fiu");
        let good = |i: u64| format!("{i} 1 p {} 8 W 6 0 {:032x}\n", i * 8, i + 1);
        std::fs::write(
            &t,
            format!("{}nonsense\n{}x\n{}", good(1), good(2), good(3)),
        )
        .unwrap();
        let cfg = SweepConfig {
            traces: vec![t],
            policies: vec!["exact".into(), "lru".into()],
            budgets: vec![1 << 20],
            jobs: 1,
            base: ReplayConfig {
                skip_bad: true,
                ..ReplayConfig::default()
            },
        };
        let rows = run_sweep(&cfg, &|_, _, _| {}).unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!((r.requests, r.bad_records_skipped), (3, 2), "{r:?}");
        }
        let csv = to_csv(&rows);
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = header
            .iter()
            .position(|&c| c == "bad_records_skipped")
            .expect("a bad_records_skipped column");
        for line in lines {
            let fields: Vec<&str> = line.split(',').collect();
            assert_eq!(fields.len(), header.len(), "{line}");
            assert_eq!(fields[col], "2", "{line}");
        }
        let json: serde_json::Value = serde_json::from_str(&to_json(&rows).unwrap()).unwrap();
        assert_eq!(json[0]["bad_records_skipped"], 2);
        assert_eq!(
            json[0]["eviction_ios"],
            json[0]["eviction_reads"].as_u64().unwrap()
                + json[0]["eviction_writes"].as_u64().unwrap()
        );
    }

    #[test]
    fn the_error_returned_is_a_real_one_though_earlier_points_did_not_run() {
        // a worker took point 0 and, seeing point 1 fail, never ran it
        let ok = || Some(Ok(SweepRow::default()));
        let failed = || Some(Err(TraceError::Config("point 1 failed".into())));
        for results in [vec![None, failed(), None], vec![ok(), None, failed()]] {
            let e = collect_results(results, false).1.unwrap();
            assert_eq!(e.to_string(), "point 1 failed");
        }
        let (rows, e) = collect_results(vec![ok(), ok()], false);
        assert_eq!(rows.len(), 2);
        assert!(e.is_none());
        // a stopped sweep: what finished, and why the rest did not run
        let (rows, e) = collect_results(vec![ok(), None], true);
        assert_eq!(rows.len(), 1);
        assert!(matches!(e, Some(TraceError::Interrupted)), "{e:?}");
    }

    #[test]
    fn outputs_replace_files_whole_and_skip_figures_without_bounded_points() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("results.csv"), "old").unwrap();
        let exact = SweepRow {
            trace: "t".into(),
            policy: "exact".into(),
            index_memory_bytes: None,
            ..SweepRow::default()
        };
        // `exact` alone: the tables, no figure (and no error)
        let files = write_outputs(std::slice::from_ref(&exact), dir.path()).unwrap();
        assert_eq!(files.len(), 2, "{files:?}");
        let csv = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
        assert_eq!(csv, to_csv(std::slice::from_ref(&exact)));
        let bounded = SweepRow {
            policy: "g-lru".into(),
            index_memory_bytes: Some(1 << 20),
            ..exact.clone()
        };
        let files = write_outputs(&[exact.clone(), bounded], dir.path()).unwrap();
        assert_eq!(files.len(), 6, "{files:?}");
        // no temporary file left beside them
        let names = || -> Vec<String> {
            std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        };
        assert!(
            names().iter().all(|n| !n.starts_with(".dedupd-output-")),
            "{:?}",
            names()
        );
        assert_eq!(names().len(), 6, "{:?}", names());
        // the same trace swept again with `exact` alone: its old figures,
        // which these results no longer show, go; another trace's stay
        std::fs::write(dir.path().join("u-duplicates.png"), "other").unwrap();
        write_outputs(std::slice::from_ref(&exact), dir.path()).unwrap();
        let mut left = names();
        left.sort();
        assert_eq!(left, ["results.csv", "results.json", "u-duplicates.png"]);
    }
    #[test]
    fn a_trace_given_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.fiu");
        std::fs::write(&t, format!("1 1 p 0 8 W 6 0 {:032x}\n", 1)).unwrap();
        // the same file twice, once through another spelling of its path
        let again = dir.path().join(".").join("t.fiu");
        for traces in [vec![t.clone(), t.clone()], vec![t.clone(), again]] {
            let cfg = SweepConfig {
                traces,
                policies: vec!["exact".into()],
                budgets: vec![],
                jobs: 1,
                base: ReplayConfig::default(),
            };
            let e = run_sweep(&cfg, &|_, _, _| {}).unwrap_err();
            assert!(matches!(e, TraceError::Config(_)), "{e:?}");
            assert!(e.to_string().contains("more than once"), "{e}");
        }
    }

    #[test]
    fn traces_whose_sanitized_names_collide_get_figures_of_their_own() {
        let traces = [
            PathBuf::from("x/a b.fiu"),
            PathBuf::from("y/a_b.fiu"),
            PathBuf::from("z/a?b.fiu"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let paths = output_paths(dir.path(), &traces);
        let distinct: std::collections::HashSet<&PathBuf> = paths.iter().collect();
        assert_eq!(distinct.len(), paths.len(), "{paths:?}");
        let mut rows = Vec::new();
        for name in trace_names(&traces) {
            for (policy, budget, found) in [("exact", None, 100.0), ("g-lru", Some(1 << 20), 50.0)]
            {
                rows.push(SweepRow {
                    trace: name.clone(),
                    policy: policy.into(),
                    index_memory_bytes: budget,
                    of_exact_percent: found,
                    ..SweepRow::default()
                });
            }
        }
        let files = write_outputs(&rows, dir.path()).unwrap();
        // the tables, and four figures per trace, none over another
        assert_eq!(files.len(), 2 + 4 * traces.len(), "{files:?}");
        let on_disk = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(on_disk, files.len());
        // (all but the partial results, written only by a failed sweep)
        assert_eq!(
            paths
                .iter()
                .filter(|p| !p.to_string_lossy().contains(".partial."))
                .collect::<std::collections::HashSet<_>>(),
            files.iter().collect::<std::collections::HashSet<_>>()
        );
    }

    #[test]
    fn complete_results_replace_partial_ones() {
        let dir = tempfile::tempdir().unwrap();
        let row = SweepRow {
            trace: "t".into(),
            policy: "exact".into(),
            ..SweepRow::default()
        };
        let partial = write_partial(std::slice::from_ref(&row), dir.path()).unwrap();
        assert!(partial.iter().all(|p| p.exists()));
        write_outputs(&[row], dir.path()).unwrap();
        assert!(partial.iter().all(|p| !p.exists()), "{partial:?}");
    }
}
