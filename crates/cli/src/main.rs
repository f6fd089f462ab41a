//! `dedupd`: serve deduplicated volumes over NBD, manage volumes, show stats.
//!
//! Thin: parses arguments, opens the store, prints. The work is in the
//! `dedupd-engine` and `dedupd-nbd` crates.

mod bounds;
mod control;
mod exports;
mod replay;
mod serve;
mod size;
mod sockpath;
mod sweep;
mod trace;

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::{Parser, Subcommand};
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm};
use serde_json::Value;

use crate::control::Request;
use crate::size::{human, parse_size};

#[derive(Parser, Debug)]
#[command(
    name = "dedupd",
    version,
    about = "Deduplicating block storage served over NBD"
)]
struct Cli {
    /// Store directory.
    #[arg(
        long,
        global = true,
        env = "DEDUPD_STORE",
        default_value = "./dedupd-store"
    )]
    store: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve every volume as an NBD export (the default command). Creates
    /// the store and a 16 GiB volume `default` on first use.
    Serve(serve::ServeArgs),
    /// Create an empty store.
    Init {
        /// Fingerprint algorithm: sha256 or blake3 (fixed for the store's life).
        #[arg(long, default_value = "sha256")]
        hash: HashAlgorithm,
        /// Prefix bits P of the fingerprint index (8-24): 2^P groups; 14
        /// keeps groups within 2 pages up to ~32 GiB of unique data (add 1
        /// per doubling). Fixed for the store's life.
        #[arg(long, default_value_t = 14, value_parser = clap::value_parser!(u32).range(8..=24))]
        index_prefix_bits: u32,
    },
    /// Manage volumes (each volume is one NBD export).
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Replay block traces (FIU, smartphone, native; .gz/.zst) through a
    /// simulated engine and report dedup figures (no store is used).
    Replay(replay::ReplayArgs),
    /// Convert, inspect and generate block traces.
    #[command(subcommand)]
    Trace(trace::TraceCommand),
    /// Replay a grid of traces × index policies × index budgets on all
    /// cores; write results.csv, results.json and figures.
    Sweep(sweep::SweepArgs),
    /// Check the store's metadata (the server must be stopped). Exit codes as
    /// e2fsck: 0 clean, 1 errors corrected, 4 errors left uncorrected, 8
    /// operational error, 16 usage error. Memory: the caches and index
    /// budget below, up to about 512 M referenced blocks (2 TiB stored) at
    /// the default 8 MiB index budget (the bound grows with the square of
    /// the budget; past it, sorting fingerprints needs more); a repair
    /// also holds the metadata pages it changes until its commit.
    Fsck {
        /// Repair: rebuild reference counts, reverse index and free space
        /// from the volume maps and data.
        #[arg(long)]
        repair: bool,
        /// Re-fingerprint every stored block (reads all data).
        #[arg(long)]
        rehash: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        bounds: bounds::MemoryBounds,
    },
    /// Deduplicate stored data after the fact.
    Dedup {
        /// Full post-processing pass: compare every stored block with every
        /// other and merge copies (exact whatever the index budget).
        #[arg(long)]
        offline: bool,
        /// Only this volume (default: all volumes).
        volume: Option<String>,
        /// All volumes (the default).
        #[arg(long, conflicts_with = "volume")]
        all: bool,
    },
    /// Show dedup and resource figures (also while `dedupd serve` runs).
    Stats {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum VolumeCommand {
    /// Create a volume of SIZE bytes (suffixes K, M, G, T; a multiple of 4 KiB).
    Create {
        /// Volume name, also its NBD export name (1–64 of A–Z a–z 0–9 `.`
        /// `_` `-`, not starting with `.`).
        name: String,
        /// Size in bytes, thin-provisioned (suffixes K, M, G, T; a
        /// multiple of 4 KiB, at most 1P).
        size: String,
    },
    /// List volumes.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Change a volume's size; shrinking discards the data past the new end.
    Resize {
        /// Volume name.
        name: String,
        /// New size in bytes (suffixes K, M, G, T; a multiple of 4 KiB).
        size: String,
    },
    /// Delete a volume and release its blocks.
    Delete {
        /// Volume name.
        name: String,
    },
    /// Change a volume's settings.
    Set {
        /// Volume name.
        name: String,
        /// Sequence threshold T in blocks for this volume (iDedup,
        /// SmartDedup §4.5: dedup inline only runs of at least T duplicates
        /// with contiguous stored copies), or `default` for the server's
        /// `--sequence-threshold`.
        #[arg(long)]
        sequence_threshold: String,
    },
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            // help and version go to stdout and succeed; a usage error
            // exits 2, or 16 (e2fsck's usage error) for `dedupd fsck`
            std::process::exit(match (usage, invoked_fsck()) {
                (false, _) => 0,
                (true, true) => 16,
                (true, false) => 2,
            });
        }
    };
    if matches!(
        cli.command,
        Some(
            Command::Replay(_)
                | Command::Trace(_)
                | Command::Sweep(_)
                | Command::Stats { .. }
                | Command::Fsck { .. }
        )
    ) {
        // a report piped into `head` ends quietly when the reader goes
        // (the server, and commands talking to it, keep ignoring SIGPIPE)
        // SAFETY: setting a signal's disposition to its default has no
        // preconditions; no handler is installed.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if let Err(e) = run(cli) {
        eprintln!("dedupd: error: {e:#}");
        std::process::exit(1);
    }
}

/// True if the command line names the `fsck` subcommand (its first
/// argument that is not an option or the value of `--store`).
fn invoked_fsck() -> bool {
    // (OS strings: a non-UTF-8 argument must not panic here)
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        if a == "--store" {
            args.next();
        } else if !a.as_encoded_bytes().starts_with(b"-") {
            return a == "fsck";
        }
    }
    false
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let store = cli.store.clone();
    match cli
        .command
        .unwrap_or(Command::Serve(serve::ServeArgs::default()))
    {
        Command::Serve(args) => serve::run(&store, args),
        Command::Init {
            hash,
            index_prefix_bits,
        } => {
            let mut config = EngineConfig::default();
            config.index.prefix_bits = index_prefix_bits;
            let e = Engine::create(&store, hash, config)?;
            e.close()?;
            println!(
                "created store {} (fingerprints: {})",
                store.display(),
                hash.name()
            );
            Ok(())
        }
        Command::Volume(cmd) => volume(&store, cmd),
        Command::Replay(args) => replay::run(args),
        Command::Trace(cmd) => trace::run(cmd),
        Command::Sweep(args) => sweep::run(args),
        Command::Fsck {
            repair,
            rehash,
            json,
            bounds,
        } => {
            let mut config = EngineConfig::default();
            bounds.apply(&mut config);
            fsck(&store, repair, rehash, json, config)
        }
        Command::Dedup {
            offline,
            volume,
            all: _,
        } => dedup(&store, offline, volume),
        Command::Stats { json } => {
            let v = with_store(&store, Request::Stats, |e, _| {
                Ok(serde_json::to_value(e.stats())?)
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print_stats(&v);
            }
            Ok(())
        }
    }
}

/// Runs `req` on the running server if the store is in use, else opens the
/// store and runs `local` on it. Either way, the progress the operation
/// reports (volume delete and resize, offline dedup) is shown as a bar.
fn with_store(
    store: &Path,
    req: Request,
    local: impl FnOnce(&Engine, &mut dyn FnMut(u64, u64)) -> anyhow::Result<Value>,
) -> anyhow::Result<Value> {
    let label = match &req {
        Request::VolumeDelete { name } => format!("delete {name}"),
        Request::VolumeResize { name, .. } => format!("resize {name}"),
        Request::DedupOffline { .. } => "dedup --offline".to_string(),
        _ => String::new(),
    };
    with_bar(&label, |progress| {
        // (run as the server last ran: its sequence threshold)
        let config = EngineConfig {
            sequence_threshold_from_store: true,
            ..EngineConfig::default()
        };
        match Engine::open(store, config) {
            Ok(e) => {
                let v = local(&e, progress)?;
                // what the command changed is durable once committed; a
                // checkpoint that fails (a full file system, say) loses
                // nothing: the journal keeps it for the next start
                e.flush()?;
                if let Err(err) = e.checkpoint() {
                    eprintln!(
                        "dedupd: warning: checkpoint failed ({err}); \
                         the journal keeps every change and the next start replays it"
                    );
                }
                Ok(v)
            }
            Err(EngineError::Locked(_)) => control::call(store, &req, progress),
            Err(e) => Err(e.into()),
        }
    })
}

/// Runs `f` with a progress callback (blocks done, of all) drawn as a bar
/// labelled `label`, which appears at the first report and is cleared at
/// the end.
fn with_bar<T>(label: &str, f: impl FnOnce(&mut dyn FnMut(u64, u64)) -> T) -> T {
    let mut bar: Option<indicatif::ProgressBar> = None;
    let result = f(&mut |done, all| {
        let bar = bar.get_or_insert_with(|| progress_bar(label));
        bar.set_length(all);
        bar.set_position(done);
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    result
}

fn volume(store: &Path, cmd: VolumeCommand) -> anyhow::Result<()> {
    match cmd {
        VolumeCommand::Create { name, size } => {
            let size_bytes =
                parse_size(&size).map_err(|e| anyhow::anyhow!("SIZE {size:?}: {e}"))?;
            with_store(
                store,
                Request::VolumeCreate {
                    name: name.clone(),
                    size_bytes,
                },
                |e, _| {
                    e.create_volume(&name, size_bytes)?;
                    Ok(Value::Null)
                },
            )?;
            println!("created volume {name} ({})", human(size_bytes));
        }
        VolumeCommand::Resize { name, size } => {
            let size_bytes =
                parse_size(&size).map_err(|e| anyhow::anyhow!("SIZE {size:?}: {e}"))?;
            with_store(
                store,
                Request::VolumeResize {
                    name: name.clone(),
                    size_bytes,
                },
                |e, progress| {
                    e.resize_volume_with_progress(&name, size_bytes, progress)?;
                    Ok(Value::Null)
                },
            )?;
            println!("resized volume {name} to {}", human(size_bytes));
        }
        VolumeCommand::Set {
            name,
            sequence_threshold,
        } => {
            let t = match sequence_threshold.as_str() {
                "default" => None,
                s => Some(s.parse::<u32>().map_err(|_| {
                    anyhow::anyhow!("bad sequence threshold {s:?}: a number of blocks or `default`")
                })?),
            };
            with_store(
                store,
                Request::VolumeSet {
                    name: name.clone(),
                    sequence_threshold_blocks: t,
                },
                |e, _| {
                    e.set_sequence_threshold(&name, t)?;
                    Ok(Value::Null)
                },
            )?;
            match t {
                Some(t) => println!("volume {name}: sequence threshold {t} blocks"),
                None => println!("volume {name}: sequence threshold from the server"),
            }
        }
        VolumeCommand::Delete { name } => {
            let done = with_store(
                store,
                Request::VolumeDelete { name: name.clone() },
                |e, progress| {
                    Ok(serde_json::to_value(
                        e.delete_volume_with_progress(&name, progress)?,
                    )?)
                },
            )?;
            println!("deleted volume {name}");
            // (a server of an earlier version answers null)
            let done: dedupd_engine::VolumeDeleted =
                serde_json::from_value(done).unwrap_or_default();
            if done.map_damaged {
                eprintln!(
                    "dedupd: volume {name}'s map was damaged: the blocks its lost entries \
                     referenced stay allocated until `dedupd fsck --repair` (with the server \
                     stopped) reclaims them"
                );
            }
        }
        VolumeCommand::List { json } => {
            let v = with_store(store, Request::VolumeList, |e, _| {
                Ok(serde_json::to_value(e.volumes())?)
            })?;
            use std::fmt::Write as _;
            let mut out = String::new();
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                let Some(list) = v.as_array() else {
                    bail!("malformed volume list")
                };
                writeln!(
                    out,
                    "{:<24} {:>12} {:>12} {:>10} STATE",
                    "NAME", "SIZE", "MAPPED", "SEQ-T"
                )?;
                for vol in list {
                    let state = if vol["deleting"].as_bool().unwrap_or(false) {
                        "being deleted (read-only; delete again to finish)"
                    } else if vol["read_only"].as_bool().unwrap_or(false) {
                        "read-only (damaged metadata: fsck --repair)"
                    } else {
                        "ok"
                    };
                    writeln!(
                        out,
                        "{:<24} {:>12} {:>12} {:>10} {}",
                        vol["name"].as_str().unwrap_or("?"),
                        human(vol["size_bytes"].as_u64().unwrap_or(0)),
                        human(vol["mapped_bytes"].as_u64().unwrap_or(0)),
                        vol["sequence_threshold_blocks"]
                            .as_u64()
                            .map_or("default".to_string(), |t| t.to_string()),
                        state
                    )?;
                }
            }
            print_quietly_if_cut(&out)?;
        }
    }
    Ok(())
}

/// Writes `text` to stdout; a reader that went away (`| head`) ends the
/// output quietly instead of failing.
///
/// Errors: other write errors.
fn print_quietly_if_cut(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// A progress bar on stderr (drawn only on a terminal) counting blocks,
/// with an ETA; the caller sets its length and position.
fn progress_bar(msg: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {human_pos}/{human_len} blocks, {per_sec} (eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(msg.to_string());
    bar
}

fn dedup(store: &Path, offline: bool, volume: Option<String>) -> anyhow::Result<()> {
    if !offline {
        bail!("give --offline (the background pass runs inside `dedupd serve`, see --out-of-line-rate)");
    }
    // one open of the store (or one request to its server) for the whole
    // pass and its figures
    let report = with_store(
        store,
        Request::DedupOffline {
            volume: volume.clone(),
        },
        |e, progress| offline_pass(e, volume.as_deref(), progress),
    )?;
    println!(
        "examined {} stored blocks, remapped {} LBAs; physical blocks {} -> {}",
        report["blocks_examined"],
        report["lbas_remapped"],
        report["physical_blocks_before"],
        report["physical_blocks_after"]
    );
    let unreadable = report["blocks_unreadable"].as_u64().unwrap_or(0);
    if unreadable > 0 {
        eprintln!(
            "dedupd: warning: {unreadable} stored blocks could not be read and were left unmerged; `dedupd fsck --rehash` (server stopped) names them"
        );
    }
    Ok(())
}

/// `dedupd dedup --offline` on an open engine, made durable: the pass's
/// report plus the physical blocks stored before and after it.
pub(crate) fn offline_pass(
    e: &Engine,
    volume: Option<&str>,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Value> {
    let before = e.stats().physical_blocks_stored;
    let report = e.dedup_offline(volume, progress)?;
    e.flush()?;
    let mut v = serde_json::to_value(report)?;
    v["physical_blocks_before"] = before.into();
    v["physical_blocks_after"] = e.stats().physical_blocks_stored.into();
    Ok(v)
}

fn fsck(
    store: &Path,
    repair: bool,
    rehash: bool,
    json: bool,
    config: EngineConfig,
) -> anyhow::Result<()> {
    let opts = dedupd_engine::fsck::FsckOptions { repair, rehash };
    let report = match dedupd_engine::fsck::fsck_with(store, opts, config) {
        Ok(r) => r,
        Err(EngineError::Locked(p)) => {
            eprintln!(
                "dedupd: error: store {} is in use by another dedupd process (a server, or a \
                 volume or dedup command); stop it before fsck",
                p.display()
            );
            std::process::exit(8);
        }
        Err(e) => {
            eprintln!("dedupd: error: {e}");
            std::process::exit(8);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for p in &report.problems {
            println!("problem: {p}");
        }
        for l in &report.data_lost {
            println!("data lost: {l}");
        }
        println!(
            "{}: {} volumes, {} mapped blocks, {} referenced blocks ({} duplicate copies), {} rehashed, {} leaked, {} corrupted, {} unreadable, {} LBAs past the data file; {}",
            store.display(),
            report.volumes,
            report.mapped_blocks,
            report.referenced_blocks,
            report.duplicate_copies,
            report.blocks_rehashed,
            report.leaked_blocks,
            report.corrupted_blocks,
            report.unreadable_blocks,
            report.lbas_outside_data_file,
            match report.exit_code() {
                0 => "clean".to_string(),
                1 => format!("{} problem(s) corrected", report.problem_count()),
                _ if report.repaired => format!(
                    "{} problem(s) found, repaired but for {} unreadable block(s) left as they are",
                    report.problem_count(),
                    report.unreadable_blocks
                ),
                // a repair without --rehash would not see (nor fix) the
                // blocks whose bytes no longer match their fingerprints
                _ if report.corrupted_blocks > 0 => format!(
                    "{} problem(s) left uncorrected (run with --repair --rehash)",
                    report.problem_count()
                ),
                _ => format!(
                    "{} problem(s) left uncorrected (run with --repair)",
                    report.problem_count()
                ),
            }
        );
    }
    if let Some(e) = &report.close_error {
        eprintln!(
            "dedupd: warning: the repair is committed (the next start replays it from the journal), but writing it in place failed: {e}"
        );
    }
    std::process::exit(report.exit_code());
}

fn print_stats(v: &Value) {
    let u = |k: &str| v[k].as_u64().unwrap_or(0);
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    println!(
        "volumes                      {} ({} provisioned)",
        u("volumes"),
        human(u("provisioned_bytes"))
    );
    println!(
        "logical bytes mapped         {}",
        human(u("logical_bytes_mapped"))
    );
    println!(
        "physical blocks stored       {} ({})",
        u("physical_blocks_stored"),
        human(u("physical_bytes_stored"))
    );
    println!("dedup ratio                  {:.3}", f("dedup_ratio"));
    println!(
        "space savings                {:.1} %",
        f("space_savings_percent")
    );
    println!("blocks written               {}", u("blocks_written"));
    println!("zero blocks written          {}", u("zero_blocks_written"));
    println!(
        "duplicate writes eliminated  {} ({:.1} % of blocks written)",
        u("duplicate_writes_eliminated"),
        f("duplicate_writes_eliminated_percent")
    );
    println!("blocks trimmed               {}", u("blocks_trimmed"));
    let se = &v["selectivity"];
    println!(
        "inline selectivity           {:.0} % (duplication {:.2}, load {:.2}, power {:.2}; {} selected, {} left to out-of-line)",
        se["selectivity"].as_f64().unwrap_or(1.0) * 100.0,
        se["duplication_factor"].as_f64().unwrap_or(1.0),
        se["load_factor"].as_f64().unwrap_or(1.0),
        se["power_factor"].as_f64().unwrap_or(1.0),
        se["blocks_selected"].as_u64().unwrap_or(0),
        se["blocks_unselected"].as_u64().unwrap_or(0)
    );
    println!(
        "sequence-filtered blocks     {} (duplicates in runs shorter than the sequence threshold, stored anew)",
        u("sequence_filtered_blocks")
    );
    println!(
        "verify mismatches            {} (comparisons that found different bytes, --verify: kept apart)",
        u("verify_mismatches")
    );
    println!(
        "fingerprint store errors     {} (lookups or inserts that failed: the blocks stored as copies of their own)",
        u("index_errors")
    );
    print_page_cache("reverse index in memory     ", &v["reverse_index"]);
    print_page_cache("maps + refcounts in memory  ", &v["map_cache"]);
    let ol = &v["out_of_line"];
    println!(
        "out-of-line passes           {} ({} blocks examined, {} hashed, {} LBAs remapped, {} merges; {:.2} µs CPU per block)",
        ol["passes"].as_u64().unwrap_or(0),
        ol["blocks_examined"].as_u64().unwrap_or(0),
        ol["blocks_hashed"].as_u64().unwrap_or(0),
        ol["lbas_remapped"].as_u64().unwrap_or(0),
        ol["merges_applied"].as_u64().unwrap_or(0),
        ol["cpu_us_per_block"].as_f64().unwrap_or(0.0)
    );
    let ca = &v["caftl"];
    println!(
        "fingerprinted inline         {} blocks (CAFTL: {} pre-hashed, {} unseen CRCs, {} sampled requests, {} blocks behind a missed sample; table {})",
        u("blocks_fingerprinted_inline"),
        ca["blocks_prehashed"].as_u64().unwrap_or(0),
        ca["prehash_misses"].as_u64().unwrap_or(0),
        ca["requests_sampled"].as_u64().unwrap_or(0),
        ca["sample_misses"].as_u64().unwrap_or(0),
        human(ca["prehash_table_bytes"].as_u64().unwrap_or(0))
    );
    let rc = &v["read_cache"];
    println!(
        "read cache                   {} hits, {} misses ({} used of {})",
        rc["hits"].as_u64().unwrap_or(0),
        rc["misses"].as_u64().unwrap_or(0),
        human(rc["used_bytes"].as_u64().unwrap_or(0)),
        human(rc["capacity_bytes"].as_u64().unwrap_or(0))
    );
    let sk = &v["skipped"];
    println!(
        "out-of-line duplicates       {} (skipped buffer: {} records, {} regions, {} volumes; {} merges pending)",
        u("out_of_line_duplicates"),
        sk["records"].as_u64().unwrap_or(0),
        sk["regions"].as_u64().unwrap_or(0),
        sk["volumes"].as_u64().unwrap_or(0),
        u("pending_merges")
    );
    println!(
        "data file                    {} ({} free blocks; {} released, reusable after the next commit; {} commits forced by a full file system)",
        human(u("data_file_bytes")),
        u("free_blocks"),
        u("pending_free_blocks"),
        u("no_space_commits")
    );
    println!(
        "metadata on disk             {}",
        human(u("metadata_bytes_on_disk"))
    );
    println!(
        "journal in use               {} ({} written since start; checkpoints {})",
        human(u("journal_bytes")),
        human(u("journal_bytes_written")),
        human(u("checkpoint_bytes_written"))
    );
    println!(
        "index entries                {} ({} in memory)",
        u("index_entries"),
        human(u("index_bytes_in_memory"))
    );
    let ix = &v["index"];
    let x = |k: &str| ix[k].as_u64().unwrap_or(0);
    println!(
        "  in memory / on disk        {} / {} (budget {} used of {}; prefix tree {})",
        x("entries_in_memory"),
        x("entries_on_disk"),
        human(x("memory_bytes")),
        human(x("memory_budget_bytes")),
        human(x("tree_bytes"))
    );
    println!(
        "  evictions                  {} groups, {} entries ({} reads, {} writes, {} failed writes)",
        x("groups_evicted"),
        x("entries_evicted"),
        x("eviction_reads"),
        x("eviction_writes"),
        x("eviction_errors")
    );
    println!(
        "  disk lookups / promotions  {} / {}",
        x("lookup_reads"),
        x("promotions")
    );
    println!(
        "metadata arrays in memory    {}",
        human(u("metadata_bytes_in_memory"))
    );
    println!(
        "peak RSS                     {}",
        human(u("peak_rss_bytes"))
    );
    if let Some(c) = v.get("connections_open").and_then(Value::as_u64) {
        println!(
            "NBD connections open         {c} ({} total, {} refused at the limit; read buffers {}; kept request buffers {}; payload in flight {})",
            u("connections_total"),
            u("connections_refused"),
            human(u("connection_read_buffer_bytes")),
            human(u("connection_kept_buffer_bytes")),
            human(u("inflight_bytes"))
        );
    }
}

/// One line of `dedupd stats` for a metadata page cache (`label` padded to
/// the column).
fn print_page_cache(label: &str, c: &serde_json::Value) {
    let n = |k: &str| c[k].as_u64().unwrap_or(0);
    println!(
        "{label} {} of {} ({} pinned pages; {} pages loaded, {} evicted, {} load errors, {} writes dropped)",
        human(n("resident_bytes")),
        match n("cache_bytes") {
            0 => "unbounded".to_string(),
            b => human(b),
        },
        n("pinned_pages"),
        n("pages_loaded"),
        n("pages_evicted"),
        n("load_errors"),
        n("writes_dropped")
    );
}
