//! `dedupd trace convert|stats|gen`: trace conversion to the native format,
//! trace figures, and seeded synthetic traces (docs/replay.md).

use std::path::PathBuf;

use anyhow::bail;
use clap::Subcommand;
use dedupd_sim::gen::{parse_streams, workload, Locality, StreamSpec};
use dedupd_sim::GenSpec;

use crate::replay::parse_format;
use crate::size::parse_size;

/// Subcommands of `dedupd trace`.
#[derive(Subcommand, Debug)]
pub enum TraceCommand {
    /// Convert a trace (fiu, mobile, native; plain, .gz or .zst) to the
    /// native binary format.
    Convert {
        /// Input trace.
        input: PathBuf,
        /// Output file (native format).
        output: PathBuf,
        /// Input format: fiu, mobile, native or auto.
        #[arg(long, default_value = "auto", value_parser = ["fiu", "mobile", "native", "auto"])]
        format: String,
        /// Count and skip malformed lines.
        #[arg(long)]
        skip_bad: bool,
    },
    /// Show a trace's figures: requests, blocks, distinct fingerprints,
    /// exact duplicate %, reuse distance, streams, LBA range.
    Stats {
        /// Trace file.
        trace: PathBuf,
        /// Format: fiu, mobile, native or auto.
        #[arg(long, default_value = "auto", value_parser = ["fiu", "mobile", "native", "auto"])]
        format: String,
        /// Count and skip malformed lines.
        #[arg(long)]
        skip_bad: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate a seeded synthetic trace in the native format.
    Gen(GenArgs),
}

/// Arguments of `dedupd trace gen`.
#[derive(clap::Args, Debug)]
pub struct GenArgs {
    /// fio (uniform duplicates), locality (one good- or weak-locality
    /// stream) or mix (several streams interleaved by time stamp).
    #[arg(long, default_value = "fio", value_parser = ["fio", "locality", "mix"])]
    kind: String,
    /// Bytes written in total (suffixes K, M, G), rounded up to whole
    /// requests of --bs: 10K of 4K requests is 3 requests, 4K of 8K
    /// requests is 1.
    #[arg(long, default_value = "64M")]
    size: String,
    /// Bytes per request (a multiple of 4K, at most 32M).
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Address space of each stream.
    #[arg(long, default_value = "1G")]
    volume_size: String,
    /// Address pattern: random or seq.
    #[arg(long, default_value = "random", value_parser = ["random", "rand", "seq", "sequential"])]
    rw: String,
    /// Percentage of blocks that repeat earlier content.
    #[arg(long, default_value_t = 50.0)]
    dup_percent: f64,
    /// Consecutive duplicates of a request repeat consecutive earlier
    /// writes (copies of earlier runs), for good and weak locality (not
    /// for fio or uniform streams).
    #[arg(long)]
    copy_runs: bool,
    /// For --kind locality: good or weak [default: good].
    #[arg(long, value_parser = ["good", "weak"])]
    locality: Option<String>,
    /// Mean reuse distance of good-locality streams, in written blocks
    /// [default: 64].
    #[arg(long)]
    mean_reuse: Option<f64>,
    /// For --kind mix: streams as KIND:SHARE,… with KIND good, weak or
    /// uniform (e.g. good:3,weak:1).
    #[arg(long, conflicts_with = "workload")]
    streams: Option<String>,
    /// For --kind mix: HPDedup workload A (good:weak 3:1), B (1:1) or C (1:3).
    #[arg(long)]
    workload: Option<String>,
    /// Seed of the random generator (same seed, same bytes).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
}

/// Runs `dedupd trace …`.
pub fn run(cmd: TraceCommand) -> anyhow::Result<()> {
    match cmd {
        TraceCommand::Convert {
            input,
            output,
            format,
            skip_bad,
        } => {
            let format = parse_format(&format)?;
            let s = with_file_bar(&input, "converting", |consumed| {
                dedupd_sim::convert_counting(&input, format, skip_bad, &output, consumed)
            })?;
            println!(
                "wrote {} from {} to {}{}",
                counted(s.requests, "request"),
                counted(s.sources, "source"),
                output.display(),
                if s.bad_records_skipped > 0 {
                    format!(" ({} bad lines skipped)", s.bad_records_skipped)
                } else {
                    String::new()
                }
            );
            Ok(())
        }
        TraceCommand::Stats {
            trace,
            format,
            skip_bad,
            json,
        } => {
            let format = parse_format(&format)?;
            let s = with_file_bar(&trace, "reading", |consumed| {
                dedupd_sim::trace_stats_counting(&trace, format, skip_bad, consumed)
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(());
            }
            let fmt = serde_json::to_value(s.format)?;
            println!("format                  {}", fmt.as_str().unwrap_or("?"));
            println!(
                "requests                {} ({} reads, {} writes, {} trims)",
                s.requests, s.reads, s.writes, s.trims
            );
            if s.bad_records_skipped > 0 {
                println!("bad records skipped     {}", s.bad_records_skipped);
            }
            println!(
                "blocks                  {} written ({} zero), {} read",
                s.blocks_written, s.zero_blocks_written, s.blocks_read
            );
            println!("distinct fingerprints   {}", s.distinct_fingerprints);
            println!(
                "exact duplicates        {} ({:.2} % of blocks written)",
                s.exact_duplicate_blocks, s.exact_duplicate_percent
            );
            println!(
                "mean reuse distance     {:.1} blocks",
                s.mean_reuse_distance_blocks
            );
            println!(
                "streams                 {} ({}, {}, {})",
                counted(s.sources, "source"),
                counted(s.pids, "pid"),
                counted(s.processes, "process"),
                counted(s.devices, "device")
            );
            match (s.lba_min_sectors, s.lba_end_sectors) {
                (Some(a), Some(b)) => println!("LBA range (sectors)     {a}..{b}"),
                _ => println!("LBA range (sectors)     empty"),
            }
            // (from the first time stamp to the largest: a trace's clock
            // may step back, and replay takes such a step as no time)
            if let (Some(a), Some(b)) = (s.first_ts_ns, s.max_ts_ns) {
                println!(
                    "duration                {:.3} s",
                    b.saturating_sub(a) as f64 / 1e9
                );
            }
            if s.timestamps_clamped > 0 {
                println!(
                    "time stamps clamped     {} (before an earlier one: replay takes each as the largest before it)",
                    s.timestamps_clamped
                );
            }
            Ok(())
        }
        TraceCommand::Gen(g) => gen(g),
    }
}

/// Mean reuse distance of good-locality streams when `--mean-reuse` is not
/// given, in written blocks.
const DEFAULT_MEAN_REUSE_BLOCKS: f64 = 64.0;

fn gen(g: GenArgs) -> anyhow::Result<()> {
    let size =
        |flag: &str, s: &str| parse_size(s).map_err(|e| anyhow::anyhow!("--{flag} {s:?}: {e}"));
    // (clap admits only fio, locality and mix)
    let kind = g.kind.as_str();
    // an option the kind does not use is refused, not ignored
    let only_for = |flag: &str, given: bool, for_kind: &str| {
        if given && kind != for_kind {
            bail!("{flag} does not apply to --kind {kind} (only to --kind {for_kind})");
        }
        Ok(())
    };
    only_for("--locality", g.locality.is_some(), "locality")?;
    only_for("--workload", g.workload.is_some(), "mix")?;
    only_for("--streams", g.streams.is_some(), "mix")?;
    let mean_reuse = g.mean_reuse.unwrap_or(DEFAULT_MEAN_REUSE_BLOCKS);
    let streams: Vec<StreamSpec> = match kind {
        "fio" => vec![StreamSpec {
            locality: Locality::Uniform,
            share: 1,
            name: "fio".into(),
        }],
        "locality" => {
            let name = g.locality.as_deref().unwrap_or("good");
            let locality = match name {
                "good" => Locality::Good {
                    mean_reuse_blocks: mean_reuse,
                },
                "weak" => Locality::Weak,
                l => bail!("unknown locality {l:?} (good, weak)"),
            };
            vec![StreamSpec {
                locality,
                share: 1,
                name: name.into(),
            }]
        }
        _ => match (&g.workload, &g.streams) {
            (Some(w), _) => workload(w, mean_reuse)?,
            (None, Some(s)) => parse_streams(s, mean_reuse)?,
            (None, None) => workload("B", mean_reuse)?,
        },
    };
    // the kind as given, to name it in the errors below
    let what = match (kind, &g.locality, &g.streams) {
        ("locality", Some(l), _) => format!("--kind locality --locality {l}"),
        ("mix", _, Some(s)) if g.workload.is_none() => format!("--kind mix --streams {s}"),
        _ => format!("--kind {kind}"),
    };
    let any = |f: fn(&Locality) -> bool| streams.iter().any(|s| f(&s.locality));
    if g.mean_reuse.is_some() && !any(|l| matches!(l, Locality::Good { .. })) {
        bail!("--mean-reuse does not apply to {what} (only to good-locality streams)");
    }
    if g.copy_runs && !any(|l| *l != Locality::Uniform) {
        bail!("--copy-runs does not apply to {what} (only to good- and weak-locality streams)");
    }
    let sequential = match g.rw.as_str() {
        "random" | "rand" => false,
        "seq" | "sequential" => true,
        r => bail!("unknown address pattern {r:?} (random, seq)"),
    };
    let spec = GenSpec {
        streams,
        size_bytes: size("size", &g.size)?,
        block_bytes: size("bs", &g.bs)?,
        volume_bytes: size("volume-size", &g.volume_size)?,
        sequential,
        dup_percent: g.dup_percent,
        copy_runs: g.copy_runs,
        seed: g.seed,
    };
    let n = with_bytes_bar(spec.size_bytes, "generating", |generated| {
        dedupd_sim::generate_with_progress(&spec, &g.output, &generated)
    })?;
    println!("wrote {} to {}", counted(n, "request"), g.output.display());
    Ok(())
}

/// Runs `f` with a counter of the bytes it reads from `path`, drawn on
/// stderr (when it is a terminal) as a bar against the file's size with
/// rate and ETA, refreshed every 200 ms and cleared at the end.
fn with_file_bar<T>(
    path: &std::path::Path,
    label: &str,
    f: impl FnOnce(std::sync::Arc<std::sync::atomic::AtomicU64>) -> T,
) -> T {
    let total = std::fs::metadata(path).map_or(0, |m| m.len());
    with_bytes_bar(total, label, f)
}

/// Runs `f` with a counter of bytes done, drawn on stderr (when it is a
/// terminal) as a bar against `total` bytes with rate and ETA, refreshed
/// every 200 ms and cleared at the end.
fn with_bytes_bar<T>(
    total: u64,
    label: &str,
    f: impl FnOnce(std::sync::Arc<std::sync::atomic::AtomicU64>) -> T,
) -> T {
    use std::io::IsTerminal;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let consumed = Arc::new(AtomicU64::new(0));
    if !std::io::stderr().is_terminal() {
        return f(consumed);
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(crate::replay::bytes_bar_style());
    bar.set_message(label.to_string());
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                bar.set_position(consumed.load(Ordering::Relaxed).min(total));
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        let out = f(consumed.clone());
        done.store(true, Ordering::Relaxed);
        bar.finish_and_clear();
        out
    })
}

/// "1 source", "2 sources", "3 processes".
fn counted(n: u64, noun: &str) -> String {
    match (n, noun.ends_with('s')) {
        (1, _) => format!("1 {noun}"),
        (_, true) => format!("{n} {noun}es"),
        _ => format!("{n} {noun}s"),
    }
}
