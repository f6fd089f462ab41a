//! `dedupd replay`: replays block traces through a simulated engine and
//! prints a report (docs/replay.md). The work is in `dedupd_sim::replay`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use dedupd_sim::{Format, Progress, ReplayConfig, Report, StreamBy};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::size::human;

/// Arguments of `dedupd replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Trace files (plain, .gz or .zst, detected from their bytes); several
    /// are interleaved by time stamp.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    #[command(flatten)]
    input: TraceInputArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to FILE.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Fingerprint-index policy: exact (unbounded), g-lru, lru, lfu, arc or
    /// refcount, optionally with write-path filters: +sampling, +prehash
    /// (CAFTL), +tN (iDedup sequence threshold), e.g. lru+t4.
    #[arg(long, default_value = "exact")]
    policy: String,
    /// Memory budget of the fingerprint index (suffixes K, M, G) for the
    /// bounded policies (default: the engine's, 8 MiB).
    #[arg(long, value_name = "SIZE", value_parser = crate::size::parse_index_memory)]
    index_memory: Option<u64>,
    /// Prefix bits of the index (8–24; default the engine's, 14).
    #[arg(long, value_name = "BITS", value_parser = clap::value_parser!(u32).range(8..=24))]
    index_prefix_bits: Option<u32>,
    /// Model the background out-of-line pass: off, every:N (a pass of up to
    /// 4096 blocks after every N requests) or idle:MS (drain whenever the
    /// trace's time stamps show an idle gap of MS milliseconds).
    #[arg(long, default_value = "off", value_name = "MODE")]
    out_of_line: dedupd_sim::replay::OutOfLine,
}

/// How traces are read, shared by `dedupd replay` and `dedupd sweep`.
#[derive(clap::Args, Debug)]
pub struct TraceInputArgs {
    /// Trace format: fiu, mobile, native or auto (detect per file).
    #[arg(long, default_value = "auto", value_parser = ["fiu", "mobile", "native", "auto"])]
    format: String,
    /// What makes a stream (one volume each): file, process or pid.
    #[arg(long, default_value = "file")]
    stream_by: StreamBy,
    /// Count and skip malformed lines instead of stopping at the first.
    #[arg(long)]
    skip_bad: bool,
}

impl TraceInputArgs {
    /// `base` with these input settings.
    ///
    /// Errors: an unknown format name.
    pub fn apply(&self, base: ReplayConfig) -> anyhow::Result<ReplayConfig> {
        Ok(ReplayConfig {
            format: parse_format(&self.format)?,
            stream_by: self.stream_by,
            skip_bad: self.skip_bad,
            ..base
        })
    }
}

/// Parses `auto` (None) or a format name.
pub fn parse_format(s: &str) -> anyhow::Result<Option<Format>> {
    if s == "auto" {
        Ok(None)
    } else {
        s.parse()
            .map(Some)
            .map_err(|e| anyhow::anyhow!("--format {s:?}: {e}"))
    }
}

/// The style of a bar of bytes read from trace files (with rate and ETA;
/// the message after them).
pub fn bytes_bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
    )
    .expect("static template")
    .progress_chars("=> ")
}

/// The style of a count of bytes read from inputs whose size is not known
/// (a pipe): bytes and rate, no bar and no ETA.
pub fn bytes_count_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bytes} {bytes_per_sec} {msg}")
        .expect("static template")
}

/// Runs `dedupd replay`.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    // (before the replay, which may take long: its report must have
    // somewhere to go, and never over a trace)
    if let Some(path) = &args.report {
        dedupd_sim::output::check_destination(path, &args.traces)
            .map_err(|e| anyhow::anyhow!("--report {e}"))?;
    }
    let index_memory_bytes = args.index_memory;
    let cfg = args.input.apply(ReplayConfig {
        policy: args.policy.clone(),
        index_memory_bytes,
        prefix_bits: args.index_prefix_bits,
        out_of_line: args.out_of_line,
        ..ReplayConfig::default()
    })?;
    // a bar against the inputs' size when they are all regular files (a
    // pipe's size says nothing: then a count of bytes read and the rate)
    let sizes: Option<u64> = args
        .traces
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len())
        })
        .sum();
    let bar = ProgressBar::with_draw_target(sizes, ProgressDrawTarget::stderr());
    if args.quiet || !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(if sizes.is_some() {
        bytes_bar_style()
    } else {
        bytes_count_style()
    });
    bar.enable_steady_tick(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let mut on_progress = |p: &Progress| {
        match sizes {
            Some(total) => bar.set_position(p.bytes_read.min(total)),
            None => bar.set_position(p.bytes_read),
        }
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{} req ({:.0} req/s)",
            p.requests,
            p.requests as f64 / secs
        ));
    };
    let result = dedupd_sim::replay(&args.traces, &cfg, &mut on_progress);
    bar.finish_and_clear();
    let report = result?;
    let json = serde_json::to_string_pretty(&report)?;
    // (printed first: a report file that cannot be written still leaves
    // the figures on the screen)
    if args.json {
        println!("{json}");
    } else {
        print_report(&report);
    }
    if let Some(path) = &args.report {
        dedupd_sim::output::write_whole(path, format!("{json}\n").as_bytes())?;
    }
    Ok(())
}

fn print_report(r: &Report) {
    println!("traces                        {}", r.traces.join(", "));
    println!(
        "policy                        {}{}",
        r.policy,
        r.index_memory_bytes
            .map(|b| format!(" (index budget {})", human(b)))
            .unwrap_or_default()
    );
    println!(
        "requests                      {} ({} reads, {} writes, {} trims)",
        r.requests, r.reads, r.writes, r.trims
    );
    if r.bad_records_skipped > 0 {
        println!("bad records skipped           {}", r.bad_records_skipped);
    }
    if r.timestamps_clamped > 0 {
        println!(
            "time stamps clamped           {} (before an earlier one of their file: replayed as at the largest before them)",
            r.timestamps_clamped
        );
    }
    println!(
        "blocks written                {} ({} zero), {} read",
        r.blocks_written, r.zero_blocks_written, r.blocks_read
    );
    println!(
        "duplicates found inline       {} ({:.2} % of blocks written: duplicate writes eliminated)",
        r.duplicate_blocks_inline, r.duplicate_writes_eliminated_percent
    );
    println!(
        "duplicates found out-of-line  {} (copies the modelled background pass freed; {} physical blocks at the end)",
        r.duplicate_blocks_out_of_line, r.physical_blocks_stored
    );
    println!(
        "duplicates (exact dedup)      {} ({:.2} %; {} distinct fingerprints; inline found {:.1} % of them)",
        r.exact_duplicate_blocks,
        r.exact_duplicate_percent,
        r.distinct_fingerprints,
        r.inline_of_exact_percent
    );
    println!(
        "hashing                       {} blocks fingerprinted, {} pre-hashed, {} written as new by filters ({:.3} s modelled)",
        r.blocks_fingerprinted, r.blocks_prehashed, r.blocks_filtered_as_new, r.hashing_seconds_modelled
    );
    println!("dedup ratio                   {:.3}", r.dedup_ratio);
    println!(
        "data writes avoided           {} blocks, {} ({:.2} %)",
        r.data_writes_avoided_blocks,
        human(r.data_writes_avoided_bytes),
        r.data_writes_avoided_percent
    );
    println!("journal bytes (metadata I/O)  {}", human(r.journal_bytes));
    println!(
        "checkpoint bytes (in place)   {}",
        human(r.checkpoint_bytes)
    );
    let ix = &r.engine.index;
    println!(
        "fingerprint store I/O         {} eviction reads, {} eviction writes, {} lookup reads ({} groups evicted)",
        ix.eviction_reads, ix.eviction_writes, ix.lookup_reads, ix.groups_evicted
    );
    // (entries on disk are outside the budget: only those in memory are in
    // the peak)
    println!(
        "index memory                  peak {} with the prefix tree ({} entries at end: {} in memory, {} on disk)",
        human(r.peak_index_bytes_in_memory),
        r.index_entries,
        ix.entries_in_memory,
        ix.entries_on_disk
    );
    println!(
        "fragmentation                 {} extents over {} mapped blocks ({:.2} blocks/extent)",
        r.extents, r.mapped_blocks, r.mean_extent_blocks
    );
    println!(
        "streams                       {} (by {})",
        r.streams.len(),
        match r.stream_by {
            StreamBy::File => "file",
            StreamBy::Process => "process",
            StreamBy::Pid => "pid",
        }
    );
    // (names padded to the longest shown, so the columns line up)
    let width = r
        .streams
        .iter()
        .take(20)
        .map(|s| s.name.chars().count())
        .max()
        .unwrap_or(0);
    for s in r.streams.iter().take(20) {
        println!(
            "  {:<width$} {:>9} req {:>10} blocks written {:>8} extents",
            s.name, s.requests, s.blocks_written, s.extents
        );
    }
    if r.streams.len() > 20 {
        println!("  … {} more (see --json)", r.streams.len() - 20);
    }
    println!(
        "time                          {:.2} s ({:.0} requests/s)",
        r.elapsed_seconds, r.requests_per_second
    );
}
