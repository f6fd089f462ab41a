//! `dedupd`: serve deduplicated volumes over NBD, manage volumes, show stats.
//!
//! Thin: parses arguments, opens the store, prints. The work is in the
//! `dedupd-engine` and `dedupd-nbd` crates.

mod bounds;
mod control;
mod exports;
mod progress;
mod replay;
mod serve;
mod size;
mod sockpath;
mod stopsignal;
mod sweep;
mod trace;
mod volops;

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm};
use serde_json::Value;

use crate::control::Request;
use crate::size::{human, parse_volume_size};

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
    /// Serve every volume as an NBD export (`dedupd` alone runs it with
    /// its defaults; options go after `serve`). Creates the store and a
    /// 16 GiB volume `default` on first use.
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
        /// Index prefix bits for a superblock rebuilt by --repair (the
        /// store's were chosen at `init`; no other file records them).
        /// Default 14, as a new store's.
        #[arg(long, value_parser = clap::value_parser!(u32).range(8..=24))]
        index_prefix_bits: Option<u32>,
        #[command(flatten)]
        bounds: bounds::MemoryBounds,
    },
    /// Deduplicate stored data after the fact.
    Dedup {
        /// Full post-processing pass: compare the fingerprints of every
        /// stored block with every other's and merge copies (exact whatever
        /// the index budget); copies are byte-compared first if the server
        /// runs, or last ran, with --verify.
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
    /// Create a volume of SIZE bytes (binary suffixes: K = KiB, M = MiB,
    /// G = GiB, T = TiB, P = PiB; a multiple of 4 KiB).
    Create {
        /// Volume name, also its NBD export name (1–64 of A–Z a–z 0–9 `.`
        /// `_` `-`, not starting with `.`).
        name: String,
        /// Size in bytes, thin-provisioned: a whole number with an optional
        /// binary suffix (K = KiB = 1024 bytes, M = MiB, G = GiB, T = TiB,
        /// P = PiB); a multiple of 4 KiB, at most 1P.
        #[arg(value_parser = parse_volume_size)]
        size: u64,
    },
    /// List volumes.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Change a volume's size. Shrinking discards the data past the new end
    /// and needs --shrink; while served, it is refused if NBD clients are
    /// connected to the volume, unless --force.
    Resize {
        /// Volume name.
        name: String,
        /// New size in bytes: a whole number with an optional binary suffix
        /// (K = KiB = 1024 bytes, M = MiB, G = GiB, T = TiB, P = PiB); a
        /// multiple of 4 KiB, at most 1P.
        #[arg(value_parser = parse_volume_size)]
        size: u64,
        /// Allow a smaller size (the data past the new end is discarded).
        #[arg(long)]
        shrink: bool,
        /// Shrink even with NBD clients connected to the volume (their
        /// requests past the new end then fail); implies --shrink.
        #[arg(long)]
        force: bool,
    },
    /// Delete a volume and release its blocks. While served, refused if NBD
    /// clients are connected to the volume, unless --force.
    Delete {
        /// Volume name.
        name: String,
        /// Delete even with NBD clients connected to the volume (their
        /// requests then fail).
        #[arg(long)]
        force: bool,
    },
    /// Rename a volume (also its NBD export name; connected clients keep
    /// it open, new ones use the new name).
    Rename {
        /// Volume name.
        name: String,
        /// New name (1–64 of A–Z a–z 0–9 `.` `_` `-`, not starting with
        /// `.`).
        new_name: String,
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

/// The commands that use no store (traces only).
const STORELESS_COMMANDS: [&str; 3] = ["replay", "trace", "sweep"];

/// The command line parser: [`Cli`], with the global `--store` left out of
/// the commands that use no store (a hidden argument of theirs takes its
/// name, so it is neither shown in their help nor propagated to them, and
/// giving it there is an error).
fn cli_command() -> clap::Command {
    /// `c` (`dedupd <path>`) and its subcommands with the hidden argument.
    fn storeless(mut c: clap::Command, path: String) -> clap::Command {
        let subs: Vec<String> = c
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .collect();
        for sub in subs {
            let sub_path = format!("{path} {sub}");
            c = c.mut_subcommand(&sub, |s| storeless(s, sub_path));
        }
        c.arg(
            clap::Arg::new("store")
                .long("store")
                .hide(true)
                .value_parser(move |_: &str| -> Result<PathBuf, String> {
                    Err(format!("`dedupd {path}` uses no store"))
                }),
        )
    }
    let mut cmd = Cli::command();
    for name in STORELESS_COMMANDS {
        cmd = cmd.mut_subcommand(name, |c| storeless(c, name.to_string()));
    }
    cmd
}

fn main() {
    if let Some(msg) = empty_store_env() {
        eprintln!("error: {msg}");
        std::process::exit(if invoked_fsck() { 16 } else { 2 });
    }
    let parsed = cli_command().try_get_matches().and_then(|m| {
        Cli::from_arg_matches(&m)
            .map(|cli| (cli, m))
            .map_err(|e| e.format(&mut cli_command()))
    });
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            if let Some(hint) = serve_option_hint(&e) {
                eprintln!("{hint}");
            }
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
        Some(Command::Replay(_) | Command::Trace(_) | Command::Sweep(_) | Command::Stats { .. })
    ) {
        // a report piped into `head` ends quietly when the reader goes
        // (the server, and commands talking to it, keep ignoring SIGPIPE)
        // SAFETY: setting a signal's disposition to its default has no
        // preconditions; no handler is installed.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let given = matches
        .subcommand_matches("serve")
        .map(serve::CreationOptionsGiven::from_matches)
        .unwrap_or_default();
    if let Err(e) = run(cli, given) {
        eprintln!("dedupd: error: {e:#}");
        if let Some(hint) = e
            .chain()
            .find_map(|c| c.downcast_ref::<EngineError>())
            .and_then(no_superblock_hint)
        {
            eprintln!("dedupd: hint: {hint}");
        }
        std::process::exit(1);
    }
}

/// Files a store holds besides its superblock (which `dedupd init` writes
/// last).
const STORE_FILES: [&str; 9] = [
    "state.json",
    "counters.json",
    "journal",
    "data",
    "refcounts",
    "fingerprints",
    "fpgroups",
    "skipped.json",
    "maps",
];

/// For a directory refused as a store that has store files but no
/// superblock, what to do about it: `fsck --repair`, which rebuilds the
/// superblock when the store's `state.json` is there; removing the
/// directory only when it holds nothing but what an interrupted `dedupd
/// init` leaves (store files, all empty); for an empty directory, the
/// commands that make it a store. `None` for any other error, and for a
/// directory with other files but no store files (not a store at all).
fn no_superblock_hint(e: &EngineError) -> Option<String> {
    let EngineError::NotAStore { path, .. } = e else {
        return None;
    };
    if !path.is_dir() || path.join("superblock").exists() {
        return None;
    }
    let quoted = serve::shell_quote(&path.display().to_string());
    if !STORE_FILES.iter().any(|f| path.join(f).exists()) {
        // an empty directory is no store yet
        let empty = std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_none());
        return empty.then(|| {
            format!(
                "{quoted} is an empty directory: `dedupd --store {quoted} init` makes it a \
                 store (or `dedupd --store {quoted} serve` makes it one with a volume \
                 default)"
            )
        });
    }
    if path.join("state.json").is_file() {
        return Some(format!(
            "{quoted} holds a store's files but no superblock: \
             `dedupd --store {quoted} fsck --repair` rebuilds the superblock from the rest \
             of the store"
        ));
    }
    Some(if only_an_empty_start(path) {
        format!(
            "{quoted} holds only the empty files a `dedupd init` (or the first `dedupd \
             serve`) interrupted early leaves, without a superblock: remove the directory and \
             start again"
        )
    } else {
        format!(
            "{quoted} holds some of a store's files but neither its superblock nor its \
             state.json (which `fsck --repair` would need to rebuild it); check that --store \
             names the store you mean"
        )
    })
}

/// True if every entry of `dir` is a store file (or the lock) holding
/// nothing: empty files, an empty `maps` directory.
fn only_an_empty_start(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.into_iter().all(|entry| {
        let Ok(entry) = entry else { return false };
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        if name != "lock" && !STORE_FILES.contains(&name) {
            return false;
        }
        match entry.metadata() {
            Ok(m) if m.is_dir() => std::fs::read_dir(entry.path())
                .map(|mut d| d.next().is_none())
                .unwrap_or(false),
            Ok(m) => m.len() == 0,
            Err(_) => false,
        }
    })
}

/// The error for a `DEDUPD_STORE` that is set but empty while `--store`
/// is not given (clap would blame `--store`, which the user never typed);
/// with `--store` given, the empty variable is dropped. Runs before any
/// thread starts.
fn empty_store_env() -> Option<&'static str> {
    let empty = std::env::var_os("DEDUPD_STORE").is_some_and(|v| v.is_empty());
    if !empty {
        return None;
    }
    if invoked_command().is_some_and(|c| STORELESS_COMMANDS.iter().any(|s| c == *s)) {
        // (the variable means nothing to them; clap would still refuse
        // it empty)
        // SAFETY: called first thing in main, before any other thread exists.
        unsafe { std::env::remove_var("DEDUPD_STORE") };
        return None;
    }
    let given = std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--store" || a.to_string_lossy().starts_with("--store="));
    if !given {
        return Some(
            "DEDUPD_STORE is set but empty: unset it, or set it (or --store) to the store directory",
        );
    }
    // `--store` wins; clap would still refuse the empty variable
    // SAFETY: called first thing in main, before any other thread exists.
    unsafe { std::env::remove_var("DEDUPD_STORE") };
    None
}

/// For a command line that gives an option of `dedupd serve` without the
/// `serve` command (`dedupd --listen 0.0.0.0:10809`), a hint naming the
/// command line that works; `None` for any other error.
fn serve_option_hint(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let ContextValue::String(given) = e.get(ContextKind::InvalidArg)? else {
        return None;
    };
    let long = given.strip_prefix("--")?;
    let long = long.split_once('=').map_or(long, |(name, _)| name);
    let cmd = cli_command();
    let serve = cmd.find_subcommand("serve")?;
    serve.get_arguments().find(|a| a.get_long() == Some(long))?;
    // (OS strings, shown lossily: a non-UTF-8 argument must not panic here)
    let mut fixed = vec!["dedupd".to_string()];
    let mut args = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .peekable();
    while args
        .peek()
        .is_some_and(|a| a == "--store" || a.starts_with("--store="))
    {
        let a = args.next()?;
        let has_value = a == "--store";
        fixed.push(a);
        if has_value {
            fixed.push(args.next()?);
        }
    }
    // only an option before any command: `dedupd volume list --listen`
    // is another mistake
    let first = args.peek()?;
    if first != given && !first.starts_with(&format!("{given}=")) {
        return None;
    }
    fixed.push("serve".to_string());
    fixed.extend(args);
    Some(format!(
        "hint: `{given}` is an option of `dedupd serve`; options of the server go after `serve`: {}",
        fixed.join(" ")
    ))
}

/// True if the command line names the `fsck` subcommand.
fn invoked_fsck() -> bool {
    invoked_command().is_some_and(|c| c == "fsck")
}

/// The subcommand the command line names: its first argument that is not
/// an option or the value of `--store`.
fn invoked_command() -> Option<std::ffi::OsString> {
    // (OS strings: a non-UTF-8 argument must not panic here)
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        if a == "--store" {
            args.next();
        } else if !a.as_encoded_bytes().starts_with(b"-") {
            return Some(a);
        }
    }
    None
}

fn run(cli: Cli, given: serve::CreationOptionsGiven) -> anyhow::Result<()> {
    let store = cli.store.clone();
    match cli
        .command
        .unwrap_or(Command::Serve(serve::ServeArgs::default()))
    {
        Command::Serve(args) => serve::run(&store, args, given),
        Command::Init {
            hash,
            index_prefix_bits,
        } => {
            let mut config = offline_config(&store);
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
            index_prefix_bits,
            bounds,
        } => {
            let mut config = offline_config(&store);
            bounds.apply(&mut config);
            if let Some(bits) = index_prefix_bits {
                config.index.prefix_bits = bits;
            }
            fsck(
                &store,
                repair,
                rehash,
                json,
                config,
                index_prefix_bits.is_some(),
            )
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
        Request::VolumeDelete { name, .. } => format!("delete {name}"),
        Request::VolumeResize { name, .. } => format!("resize {name}"),
        // (the bar counts the data file's PBAs, free ones too; the report
        // then counts the stored blocks among them)
        Request::DedupOffline { .. } => "dedup --offline: scanning the data file".to_string(),
        _ => String::new(),
    };
    progress::with_bar(&label, |progress| {
        // (run as the server last ran: its sequence threshold and verify)
        let config = EngineConfig {
            settings_from_store: true,
            ..offline_config(store)
        };
        let opened = Engine::open(store, config);
        if let Ok(e) = &opened {
            // (as a server says them at start: a command may be the first
            // to open the store after a crash, and its commit settles what
            // they are about)
            for n in e.notes() {
                eprintln!("dedupd: warning: {n}");
            }
        }
        match opened {
            Ok(e) if matches!(req, Request::Stats | Request::VolumeList) => {
                // a listing changes nothing: nothing to commit, and no
                // checkpoint (which a full file system would refuse)
                let v = local(&e, progress);
                e.drop_without_closing();
                v
            }
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

fn volume(store: &Path, cmd: VolumeCommand) -> anyhow::Result<()> {
    match cmd {
        VolumeCommand::Create {
            name,
            size: size_bytes,
        } => {
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
            say(&format!("created volume {name} ({})", human(size_bytes)))?;
        }
        VolumeCommand::Resize {
            name,
            size: size_bytes,
            shrink,
            force,
        } => {
            with_store(
                store,
                Request::VolumeResize {
                    name: name.clone(),
                    size_bytes,
                    shrink,
                    force,
                },
                |e, progress| {
                    // (no server: no NBD connection can be open)
                    volops::resize(e, None, &name, size_bytes, shrink, force, progress)?;
                    Ok(Value::Null)
                },
            )?;
            say(&format!("resized volume {name} to {}", human(size_bytes)))?;
        }
        VolumeCommand::Rename { name, new_name } => {
            with_store(
                store,
                Request::VolumeRename {
                    name: name.clone(),
                    new_name: new_name.clone(),
                },
                |e, _| {
                    e.rename_volume(&name, &new_name)?;
                    Ok(Value::Null)
                },
            )?;
            say(&format!("renamed volume {name} to {new_name}"))?;
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
            say(&match t {
                Some(t) => format!("volume {name}: sequence threshold {t} blocks"),
                None => format!("volume {name}: sequence threshold from the server"),
            })?;
        }
        VolumeCommand::Delete { name, force } => {
            let done = with_store(
                store,
                Request::VolumeDelete {
                    name: name.clone(),
                    force,
                },
                |e, progress| volops::delete(e, None, &name, force, progress),
            )?;
            say(&format!("deleted volume {name}"))?;
            // (a server of an earlier version answers null)
            let done: dedupd_engine::VolumeDeleted =
                serde_json::from_value(done).unwrap_or_default();
            if done.map_damaged {
                eprintln!(
                    "dedupd: volume {name}'s map was damaged: the blocks its lost entries \
                     referenced stay allocated until `dedupd --store {} fsck --repair` (with \
                     the server stopped) reclaims them",
                    serve::shell_quote(&store.display().to_string())
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
                // (names up to 64 characters keep the columns aligned)
                let width = list
                    .iter()
                    .filter_map(|vol| vol["name"].as_str())
                    .map(str::len)
                    .max()
                    .unwrap_or(0)
                    .max(24);
                writeln!(
                    out,
                    "{:<width$} {:>12} {:>12} {:>10} STATE",
                    "NAME", "SIZE", "MAPPED", "SEQ-T"
                )?;
                for vol in list {
                    let state = if vol["deleting"].as_bool().unwrap_or(false) {
                        "being deleted (read-only; delete again to finish)".to_string()
                    } else if vol["read_only"].as_bool().unwrap_or(false) {
                        "read-only (damaged metadata: fsck --repair)".to_string()
                    } else if let Some(to) = vol["shrinking_to_bytes"].as_u64() {
                        format!(
                            "shrink to {} not finished (written only below it; resize to {} \
                             --shrink to finish)",
                            human(to),
                            crate::size::exact_size(to)
                        )
                    } else {
                        "ok".to_string()
                    };
                    writeln!(
                        out,
                        "{:<width$} {:>12} {:>12} {:>10} {}",
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

/// Writes `line` and a newline to stdout, as [`print_quietly_if_cut`]: a
/// command that did its work succeeds even if nobody reads what it says.
///
/// Errors: write errors other than a reader gone.
fn say(line: &str) -> std::io::Result<()> {
    print_quietly_if_cut(&format!("{line}\n"))
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
        |e, progress| {
            // SIGINT or SIGTERM stops the pass early, keeping what it
            // merged; a second one exits at once (the journal covers it),
            // also during the commit and checkpoint after the pass
            let stop = stopsignal::stop_flag_on_interrupt()?;
            let done = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    use std::sync::atomic::Ordering::Relaxed;
                    while !done.load(Relaxed) {
                        if stop.load(Relaxed) {
                            eprintln!(
                                "dedupd: stopping the pass with the merges it has planned (a second SIGINT or SIGTERM exits at once)"
                            );
                            e.stop_offline_passes();
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                });
                let v = offline_pass(e, volume.as_deref(), progress);
                done.store(true, std::sync::atomic::Ordering::Relaxed);
                v
            })
        },
    )?;
    println!(
        "examined {} stored blocks (the data file's PBAs in use), remapped {} LBAs; physical blocks {} -> {}",
        report["blocks_examined"],
        report["lbas_remapped"],
        report["physical_blocks_before"],
        report["physical_blocks_after"],
    );
    let unreadable = report["blocks_unreadable"].as_u64().unwrap_or(0);
    if unreadable > 0 {
        eprintln!(
            "dedupd: warning: {unreadable} stored blocks could not be read and were left unmerged; `dedupd fsck --rehash` (server stopped) names them"
        );
    }
    if report["interrupted"].as_bool() == Some(true) {
        bail!(
            "the pass was stopped before it finished (what it merged is kept); run it again to finish"
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
    prefix_bits_given: bool,
) -> anyhow::Result<()> {
    let opts = dedupd_engine::fsck::FsckOptions { repair, rehash };
    // an operational error (e2fsck's 8): on stderr, and with --json as a
    // JSON object on stdout too, for scripts that read only that
    let fail = |msg: String, hint: Option<String>| -> ! {
        eprintln!("dedupd: error: {msg}");
        if let Some(hint) = &hint {
            eprintln!("dedupd: hint: {hint}");
        }
        if json {
            let v = serde_json::json!({ "exit_code": 8, "error": msg, "hint": hint });
            let _ = say(&v.to_string());
        }
        std::process::exit(8);
    };
    let checked = progress::with_phase_bars(|progress| {
        dedupd_engine::fsck::fsck_with_progress(store, opts, config, progress)
    });
    let report = match checked {
        Ok(r) => r,
        Err(EngineError::Locked(p)) => fail(
            format!("{}; stop it before fsck", serve::in_use_message(&p)),
            None,
        ),
        Err(e) => {
            let hint = no_superblock_hint(&e);
            fail(e.to_string(), hint)
        }
    };
    // (a reader that goes early, `| grep -q`, does not take the exit code
    // e2fsck's conventions give: SIGPIPE stays ignored for fsck)
    let out = |line: &str| {
        if let Err(e) = say(line) {
            // (a report that cannot be written is an operational error)
            eprintln!("dedupd: error: writing the report: {e}");
            std::process::exit(8);
        }
    };
    if json {
        // (with the exit code, so a script reading stdout alone can tell
        // clean from corrected from uncorrected)
        let with_code = serde_json::to_value(&report).map(|mut v| {
            if let Value::Object(o) = &mut v {
                o.insert("exit_code".into(), report.exit_code().into());
            }
            v
        });
        match with_code.and_then(|v| serde_json::to_string_pretty(&v)) {
            Ok(text) => out(&text),
            Err(e) => {
                // an operational error, as e2fsck's 8 (the check itself ran)
                eprintln!("dedupd: error: writing the report as JSON: {e}");
                std::process::exit(8);
            }
        }
    } else {
        for n in &report.notes {
            out(&format!("note: {n}"));
        }
        for p in &report.problems {
            out(&format!("problem: {p}"));
        }
        for l in &report.data_lost {
            out(&format!("data lost: {l}"));
        }
        out(&format!(
            "{}: {} volume{}, {} mapped blocks, {} referenced blocks ({} duplicate copies), {} rehashed, {} leaked, {} corrupted, {} unreadable, {} LBAs past the data file; {}",
            store.display(),
            report.volumes,
            if report.volumes == 1 { "" } else { "s" },
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
                _ if report.corrupted_blocks > 0 || report.journal_lost_commits => format!(
                    "{} problem(s) left uncorrected (run with --repair --rehash)",
                    report.problem_count()
                ),
                _ => format!(
                    "{} problem(s) left uncorrected (run with --repair)",
                    report.problem_count()
                ),
            }
        ));
    }
    if prefix_bits_given && !report.problems.iter().any(|p| p.starts_with("superblock:")) {
        eprintln!(
            "dedupd: warning: --index-prefix-bits ignored: the superblock is intact (a store's \
             prefix bits are fixed when it is created)"
        );
    }
    if let Some(e) = &report.close_error {
        eprintln!(
            "dedupd: warning: the repair is committed (the next start replays it from the journal), but writing it in place failed: {e}"
        );
    }
    std::process::exit(report.exit_code());
}

/// The engine configuration of a command other than `serve` on the store
/// at `store`: its journal keeps the reserve the server left (the space
/// allocated past the journal's end, which the server's
/// `--journal-reserve` chose; a short command takes none of its own):
/// changed metadata is committed whenever it reaches half of that (1 MiB
/// to the default 16 MiB), and the reserve is twice that.
fn offline_config(store: &Path) -> EngineConfig {
    use std::os::unix::fs::MetadataExt;
    let default = EngineConfig::default();
    let reserved = std::fs::metadata(store.join("journal"))
        .map_or(0, |m| (m.blocks() * 512).saturating_sub(m.len()));
    let max_dirty_bytes = (reserved / 2).clamp(1 << 20, default.max_dirty_bytes);
    EngineConfig {
        max_dirty_bytes,
        journal_reserve_bytes: 2 * max_dirty_bytes,
        ..default
    }
}

/// A count that must be at least 1 (`--jobs`, `--max-connections`).
fn parse_count(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

/// The figures of `dedupd stats` (its JSON), read by dotted path
/// (`index.memory_bytes`). A figure that is missing (a server of another
/// version) prints as `?` and is remembered, so a test can tell that the
/// text reads only figures the stats have.
struct Figures<'a> {
    v: &'a Value,
    missing: std::cell::RefCell<Vec<String>>,
}

impl<'a> Figures<'a> {
    fn new(v: &'a Value) -> Self {
        Figures {
            v,
            missing: Default::default(),
        }
    }

    /// The value at `path`, remembered as missing if absent or not a number.
    fn get(&self, path: &str) -> Option<&'a Value> {
        let found = path
            .split('.')
            .try_fold(self.v, |v, k| v.get(k))
            .filter(|v| v.is_number());
        if found.is_none() {
            self.missing.borrow_mut().push(path.to_string());
        }
        found
    }

    /// A count, or `?`.
    fn n(&self, path: &str) -> String {
        self.get(path)
            .and_then(Value::as_u64)
            .map_or("?".into(), |n| n.to_string())
    }

    /// Bytes with a binary unit, or `?`.
    fn bytes(&self, path: &str) -> String {
        self.get(path)
            .and_then(Value::as_u64)
            .map_or("?".into(), human)
    }

    /// A percentage with one decimal, or `?`; one that is not exactly 0
    /// or 100 never reads as either (`<0.1`, `>99.9`).
    fn pct(&self, path: &str) -> String {
        self.pct_of(path, 1.0)
    }

    /// [`Figures::pct`] of a fraction times `scale` (100 for a fraction
    /// of 1).
    fn pct_of(&self, path: &str, scale: f64) -> String {
        self.get(path)
            .and_then(Value::as_f64)
            .map_or("?".into(), |x| percent_text(x * scale))
    }

    /// A fraction or ratio times `scale`, with `decimals` decimals, or `?`.
    fn f(&self, path: &str, scale: f64, decimals: usize) -> String {
        self.get(path)
            .and_then(Value::as_f64)
            .map_or("?".into(), |x| format!("{:.*}", decimals, x * scale))
    }
}

/// `x` % with one decimal, except that a value strictly between 0 and
/// 0.05 reads `<0.1` and one strictly between 99.95 and 100 reads `>99.9`
/// (rounding would show them as 0.0 and 100.0).
fn percent_text(x: f64) -> String {
    if x > 0.0 && x < 0.05 {
        "<0.1".into()
    } else if (99.95..100.0).contains(&x) {
        ">99.9".into()
    } else {
        format!("{x:.1}")
    }
}

fn print_stats(v: &Value) {
    print!("{}", format_stats(v).0);
}

/// The text of `dedupd stats` for its JSON `v`, and the figures it wanted
/// that `v` lacks (printed as `?`).
fn format_stats(v: &Value) -> (String, Vec<String>) {
    use std::fmt::Write as _;
    let s = Figures::new(v);
    let mut out = String::new();
    // (writing to a String cannot fail)
    macro_rules! line {
        ($($arg:tt)*) => {
            let _ = writeln!(out, $($arg)*);
        };
    }
    line!(
        "volumes                      {} ({} provisioned)",
        s.n("volumes"),
        s.bytes("provisioned_bytes")
    );
    let damaged = s.n("volumes_damaged");
    if damaged != "0" {
        line!(
            "volumes damaged              {damaged} (served read-only: `dedupd volume list` names them, `dedupd fsck --repair` rebuilds them)"
        );
    }
    line!(
        "logical bytes mapped         {}",
        s.bytes("logical_bytes_mapped")
    );
    line!(
        "physical blocks stored       {} ({})",
        s.n("physical_blocks_stored"),
        s.bytes("physical_bytes_stored")
    );
    line!(
        "dedup ratio                  {}",
        s.f("dedup_ratio", 1.0, 3)
    );
    line!(
        "space savings                {} %",
        s.pct("space_savings_percent")
    );
    line!("blocks written               {}", s.n("blocks_written"));
    line!(
        "zero blocks written          {}",
        s.n("zero_blocks_written")
    );
    line!(
        "duplicate writes eliminated  {} ({} % of blocks written)",
        s.n("duplicate_writes_eliminated"),
        s.pct("duplicate_writes_eliminated_percent")
    );
    line!("blocks trimmed               {}", s.n("blocks_trimmed"));
    line!(
        "inline selectivity           {} % (duplication {}, load {}, power {}; {} selected, {} left to out-of-line)",
        s.pct_of("selectivity.selectivity", 100.0),
        s.f("selectivity.duplication_factor", 1.0, 2),
        s.f("selectivity.load_factor", 1.0, 2),
        s.f("selectivity.power_factor", 1.0, 2),
        s.n("selectivity.blocks_selected"),
        s.n("selectivity.blocks_unselected")
    );
    line!(
        "sequence-filtered blocks     {} (duplicates in runs shorter than the sequence threshold, stored anew)",
        s.n("sequence_filtered_blocks")
    );
    line!(
        "verify mismatches            {} (comparisons that found different bytes, --verify: kept apart)",
        s.n("verify_mismatches")
    );
    line!(
        "fingerprint store errors     {} (lookups or inserts that failed: the blocks stored as copies of their own)",
        s.n("index_errors")
    );
    for (label, cache) in [
        ("reverse index in memory     ", "reverse_index"),
        ("maps + refcounts in memory  ", "map_cache"),
    ] {
        let k = |field: &str| format!("{cache}.{field}");
        let budget = match s.get(&k("cache_bytes")).and_then(Value::as_u64) {
            Some(0) => "unbounded".to_string(),
            Some(b) => human(b),
            None => "?".to_string(),
        };
        line!(
            "{label} {} of {budget} ({} pinned pages; {} pages loaded, {} evicted, {} load errors, {} writes dropped)",
            s.bytes(&k("resident_bytes")),
            s.n(&k("pinned_pages")),
            s.n(&k("pages_loaded")),
            s.n(&k("pages_evicted")),
            s.n(&k("load_errors")),
            s.n(&k("writes_dropped"))
        );
    }
    line!(
        "out-of-line passes           {} ({} blocks examined, {} hashed, {} LBAs remapped, {} merges; {} µs CPU per block)",
        s.n("out_of_line.passes"),
        s.n("out_of_line.blocks_examined"),
        s.n("out_of_line.blocks_hashed"),
        s.n("out_of_line.lbas_remapped"),
        s.n("out_of_line.merges_applied"),
        s.f("out_of_line.cpu_us_per_block", 1.0, 2)
    );
    line!(
        "fingerprinted inline         {} blocks (CAFTL: {} pre-hashed, {} unseen CRCs, {} sampled requests, {} blocks behind a missed sample; table {})",
        s.n("blocks_fingerprinted_inline"),
        s.n("caftl.blocks_prehashed"),
        s.n("caftl.prehash_misses"),
        s.n("caftl.requests_sampled"),
        s.n("caftl.sample_misses"),
        s.bytes("caftl.prehash_table_bytes")
    );
    line!(
        "read cache                   {} hits, {} misses ({} used of {})",
        s.n("read_cache.hits"),
        s.n("read_cache.misses"),
        s.bytes("read_cache.used_bytes"),
        s.bytes("read_cache.capacity_bytes")
    );
    line!(
        "out-of-line duplicates       {} (skipped buffer: {} records, {} regions, {} volumes, {} used of {}; {} merges pending)",
        s.n("out_of_line_duplicates"),
        s.n("skipped.records"),
        s.n("skipped.regions"),
        s.n("skipped.volumes"),
        s.bytes("skipped.used_bytes"),
        s.bytes("skipped.capacity_bytes"),
        s.n("pending_merges")
    );
    line!(
        "skipped buffer faults        {} times degraded (records folded into coarser ones: buffer full, or dropped copies not remembered), {} saves failed (records lost on a crash; a full pass finds those duplicates)",
        s.n("skipped.degradations"),
        s.n("skipped_save_errors")
    );
    line!(
        "data file                    {} ({} free blocks; {} released, reusable after the next commit; {} commits forced by a full file system)",
        s.bytes("data_file_bytes"),
        s.n("free_blocks"),
        s.n("pending_free_blocks"),
        s.n("no_space_commits")
    );
    line!(
        "metadata on disk             {}",
        s.bytes("metadata_bytes_on_disk")
    );
    line!(
        "journal in use               {} ({} written since start; checkpoints {})",
        s.bytes("journal_bytes"),
        s.bytes("journal_bytes_written"),
        s.bytes("checkpoint_bytes_written")
    );
    line!(
        "index entries                {} ({} in memory)",
        s.n("index_entries"),
        s.bytes("index_bytes_in_memory")
    );
    line!(
        "  in memory / on disk        {} / {} (budget {} used of {}; prefix tree {})",
        s.n("index.entries_in_memory"),
        s.n("index.entries_on_disk"),
        s.bytes("index.memory_bytes"),
        s.bytes("index.memory_budget_bytes"),
        s.bytes("index.tree_bytes")
    );
    line!(
        "  evictions                  {} groups, {} entries ({} reads, {} writes, {} failed writes)",
        s.n("index.groups_evicted"),
        s.n("index.entries_evicted"),
        s.n("index.eviction_reads"),
        s.n("index.eviction_writes"),
        s.n("index.eviction_errors")
    );
    line!(
        "  disk lookups / promotions  {} / {}",
        s.n("index.lookup_reads"),
        s.n("index.promotions")
    );
    line!(
        "metadata arrays in memory    {}",
        s.bytes("metadata_bytes_in_memory")
    );
    line!(
        "peak RSS                     {} (now {})",
        s.bytes("peak_rss_bytes"),
        s.bytes("rss_bytes")
    );
    // (present only while a server answers)
    if v.get("connections_open").is_some() {
        line!(
            "NBD connections open         {} ({} negotiating, {} total, {} refused at the limit; read buffers {}; negotiation buffers {}; kept request buffers {}; payload in flight {}, peak {} of a {} budget)",
            s.n("connections_open"),
            s.n("connections_negotiating"),
            s.n("connections_total"),
            s.n("connections_refused"),
            s.bytes("connection_read_buffer_bytes"),
            s.bytes("negotiation_buffer_bytes"),
            s.bytes("connection_kept_buffer_bytes"),
            s.bytes("inflight_bytes"),
            s.bytes("inflight_bytes_peak"),
            s.bytes("inflight_budget_bytes")
        );
    }
    (out, s.missing.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_parser_is_well_formed() {
        cli_command().debug_assert();
    }

    #[test]
    fn every_figure_the_stats_text_reads_is_in_the_stats() {
        let v = serve::stats_with_server(
            &dedupd_engine::Stats::default(),
            &dedupd_nbd::ServerStats::default(),
        )
        .unwrap();
        let (text, missing) = format_stats(&v);
        assert!(missing.is_empty(), "figures the stats lack: {missing:?}");
        assert!(!text.contains('?'), "{text}");
        assert!(text.contains("NBD connections open"), "{text}");
        // without the server's figures: the same but that line
        let v = serde_json::to_value(dedupd_engine::Stats::default()).unwrap();
        let (text, missing) = format_stats(&v);
        assert!(missing.is_empty(), "figures the stats lack: {missing:?}");
        assert!(!text.contains("NBD connections"), "{text}");
    }

    #[test]
    fn percentages_near_0_and_100_do_not_round_to_them() {
        assert_eq!(super::percent_text(0.0), "0.0");
        assert_eq!(super::percent_text(0.02), "<0.1");
        assert_eq!(super::percent_text(0.05), "0.1");
        assert_eq!(super::percent_text(50.04), "50.0");
        // 4095 of 4096 blocks
        assert_eq!(super::percent_text(100.0 * 4095.0 / 4096.0), ">99.9");
        assert_eq!(super::percent_text(99.94), "99.9");
        assert_eq!(super::percent_text(100.0), "100.0");
    }

    #[test]
    fn a_missing_figure_prints_as_unknown_not_zero() {
        let mut v = serde_json::to_value(dedupd_engine::Stats::default()).unwrap();
        v.as_object_mut().unwrap().remove("skipped_save_errors");
        v["skipped"].as_object_mut().unwrap().remove("degradations");
        let (text, missing) = format_stats(&v);
        assert_eq!(missing, ["skipped.degradations", "skipped_save_errors"]);
        assert!(text.contains("? times degraded"), "{text}");
        assert!(text.contains("? saves failed"), "{text}");
    }

    #[test]
    fn a_directory_with_store_files_but_no_superblock_gets_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        let err = |p: &Path| EngineError::NotAStore {
            path: p.to_path_buf(),
            detail: "no superblock file".into(),
        };
        // not a store at all: nothing suggests removing it
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        assert_eq!(no_superblock_hint(&err(dir.path())), None);
        // store files beside others, or holding data: not to be removed
        std::fs::write(dir.path().join("journal"), "").unwrap();
        let hint = no_superblock_hint(&err(dir.path())).unwrap();
        assert!(!hint.contains("remove"), "{hint}");
        std::fs::remove_file(dir.path().join("notes.txt")).unwrap();
        std::fs::write(dir.path().join("data"), "blocks").unwrap();
        let hint = no_superblock_hint(&err(dir.path())).unwrap();
        assert!(!hint.contains("remove"), "{hint}");
        // an init cut short before its state was written: empty files
        std::fs::write(dir.path().join("data"), "").unwrap();
        std::fs::create_dir(dir.path().join("maps")).unwrap();
        let hint = no_superblock_hint(&err(dir.path())).unwrap();
        assert!(hint.contains("remove the directory"), "{hint}");
        assert!(!hint.contains("rebuilds the superblock"), "{hint}");
        // with its state: fsck --repair rebuilds the superblock
        std::fs::write(dir.path().join("state.json"), "").unwrap();
        let hint = no_superblock_hint(&err(dir.path())).unwrap();
        assert!(
            hint.contains("fsck --repair` rebuilds the superblock"),
            "{hint}"
        );
        // a superblock there: some other trouble
        std::fs::write(dir.path().join("superblock"), "").unwrap();
        assert_eq!(no_superblock_hint(&err(dir.path())), None);
    }
}
