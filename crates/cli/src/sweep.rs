//! `dedupd sweep`: replays a grid of traces × policies × index budgets on
//! all cores and writes results.csv, results.json and one figure per trace
//! (docs/replay.md). The work is in `dedupd_sim::sweep`.

use std::path::PathBuf;
use std::time::Instant;

use dedupd_sim::{ReplayConfig, SweepConfig, SweepRow};

use crate::replay::TraceInputArgs;
use crate::size::{human, parse_index_memory};

/// Arguments of `dedupd sweep`.
#[derive(clap::Args, Debug)]
pub struct SweepArgs {
    /// Trace files, comma-separated (each replayed alone).
    #[arg(long, value_delimiter = ',', required = true)]
    traces: Vec<PathBuf>,
    /// Policies, comma-separated: exact, g-lru, lru, lfu, arc, refcount,
    /// each optionally with +sampling, +prehash, +tN.
    #[arg(long, value_delimiter = ',', default_value = "exact,g-lru,lru")]
    policies: Vec<String>,
    /// Index memory budgets, comma-separated (suffixes K, M, G).
    #[arg(long, value_delimiter = ',', default_value = "1M,2M,4M,8M")]
    index_memory: Vec<String>,
    /// Prefix bits of the index (8–24; default the engine's, 14).
    #[arg(long, value_name = "BITS", value_parser = clap::value_parser!(u32).range(8..=24))]
    index_prefix_bits: Option<u32>,
    /// Worker threads, at least 1 (default: the number of CPUs; never
    /// more than the grid's points).
    #[arg(long, value_parser = crate::parse_count)]
    jobs: Option<u64>,
    /// Output directory (created if missing; results.csv, results.json
    /// and the swept traces' figures in it are replaced; figures of other
    /// traces are left).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    input: TraceInputArgs,
    /// No per-point progress lines.
    #[arg(long, short)]
    quiet: bool,
}

/// Runs `dedupd sweep`.
pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let budgets = args
        .index_memory
        .iter()
        .map(|s| parse_index_memory(s).map_err(|e| anyhow::anyhow!("--index-memory {s:?}: {e}")))
        .collect::<anyhow::Result<Vec<u64>>>()?;
    // (checked before the grid runs, which may take hours)
    if args.out.exists() && !args.out.is_dir() {
        anyhow::bail!(
            "--out {}: exists and is not a directory",
            args.out.display()
        );
    }
    for t in &args.traces {
        if let Err(e) = std::fs::File::open(t) {
            anyhow::bail!("--traces {}: {e}", t.display());
        }
    }
    // (the same trace twice would mix its rows; the same policy or budget
    // twice would run duplicate rows)
    dedupd_sim::sweep::check_distinct_traces(&args.traces)
        .map_err(|e| anyhow::anyhow!("--traces: {e}"))?;
    dedupd_sim::sweep::check_distinct_policies(&args.policies)
        .map_err(|e| anyhow::anyhow!("--policies: {e}"))?;
    dedupd_sim::sweep::check_distinct_budgets(&budgets, Some(&args.index_memory))
        .map_err(|e| anyhow::anyhow!("--index-memory: {e}"))?;
    // no result or figure may land on a trace
    for out in dedupd_sim::sweep::output_paths(&args.out, &args.traces) {
        if args.out.is_dir() {
            dedupd_sim::output::check_destination(&out, &args.traces)
                .map_err(|e| anyhow::anyhow!("--out: {e}"))?;
        }
    }
    let points = args.traces.len() * args.policies.len() * budgets.len();
    let jobs = args
        .jobs
        .map_or_else(
            || {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            },
            |j| usize::try_from(j).unwrap_or(usize::MAX),
        )
        .min(points.max(1));
    // SIGINT or SIGTERM stops the sweep and keeps what finished
    let stop = crate::stopsignal::stop_flag_on_interrupt()?;
    let cfg = SweepConfig {
        traces: args.traces.clone(),
        policies: args.policies.clone(),
        budgets,
        jobs,
        base: args.input.apply(ReplayConfig {
            prefix_bits: args.index_prefix_bits,
            stop: Some(stop),
            ..ReplayConfig::default()
        })?,
    };
    let started = Instant::now();
    let quiet = args.quiet;
    // bytes of trace read over all points, on a terminal (the point lines
    // print above it)
    let bar =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    if quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(crate::replay::bytes_bar_style());
    // (the grid's points, for the message of a sweep that stops)
    let points_total = std::sync::atomic::AtomicUsize::new(0);
    let done = |r: &SweepRow, n: usize, total: usize| {
        points_total.store(total, std::sync::atomic::Ordering::Relaxed);
        if !quiet {
            let line = format!(
                "[{n}/{total}] {} {} {}: {:.2} % of exact, {} eviction I/Os ({:.1} s)",
                r.trace,
                r.policy,
                r.index_memory_bytes.map_or("unbounded".into(), human),
                r.of_exact_percent,
                r.eviction_ios(),
                r.elapsed_seconds
            );
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
    };
    let progress = |read: u64, total: u64| {
        bar.set_length(total);
        bar.inc(read);
    };
    let (rows, failed) = dedupd_sim::sweep::run_sweep_keeping_rows(&cfg, &done, &progress);
    bar.finish_and_clear();
    if let Some(e) = failed {
        // what finished is kept (in grid order, without figures); partial
        // results of an earlier sweep are not left to pass for this one's
        let kept = if rows.is_empty() {
            for stale in ["results.partial.csv", "results.partial.json"] {
                let _ = std::fs::remove_file(args.out.join(stale));
            }
            String::new()
        } else {
            match dedupd_sim::sweep::write_partial(&rows, &args.out) {
                Ok(files) => format!(
                    "\nthe sweep stopped; the {} of {} points that finished {} in {}",
                    rows.len(),
                    points_total.load(std::sync::atomic::Ordering::Relaxed),
                    if rows.len() == 1 { "is" } else { "are" },
                    files
                        .iter()
                        .map(|f| f.display().to_string())
                        .collect::<Vec<_>>()
                        .join(" and ")
                ),
                Err(w) => format!(
                    "\nthe sweep stopped, and the {} points that finished could not be written: {w}",
                    rows.len()
                ),
            }
        };
        anyhow::bail!("{e}{kept}");
    }
    let files = dedupd_sim::sweep::write_outputs(&rows, &args.out)?;
    println!(
        "{} points on {} threads in {:.1} s",
        rows.len(),
        jobs.min(rows.len().max(1)),
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<28} {:<16} {:>10} {:>12} {:>14}",
        "TRACE", "POLICY", "BUDGET", "% OF EXACT", "EVICTION I/Os"
    );
    for r in &rows {
        println!(
            "{:<28} {:<16} {:>10} {:>12.2} {:>14}",
            r.trace,
            r.policy,
            r.index_memory_bytes.map_or("-".into(), human),
            r.of_exact_percent,
            r.eviction_ios()
        );
    }
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(())
}
