//! `dedupd serve`: open (or create) the store, export every volume over
//! NBD on TCP and/or a Unix socket, answer the control socket, and on
//! SIGINT, SIGTERM or SIGHUP stop accepting, finish in-flight requests,
//! make everything durable and exit 0.

/// A line to stderr, as `eprintln!` but dropped if it cannot be written
/// (to a terminal that hung up, say) instead of panicking: the server must
/// go on to stop cleanly.
macro_rules! err_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// A line to stdout, dropped if it cannot be written (see `err_line!`).
macro_rules! out_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

use crate::sockpath::SocketPath;
use crate::stopsignal::StopSignal;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm};
use dedupd_nbd::{Server, ServerConfig};
use serde_json::Value;

use crate::control::{self, Request};
use crate::exports::VolumeExports;
use crate::size::{human, parse_size};

/// Options of `dedupd serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// TCP address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:10809")]
    pub listen: String,
    /// Do not listen on TCP (use with --socket; refused with --listen).
    #[arg(long, conflicts_with = "listen")]
    pub no_tcp: bool,
    /// Also listen on this Unix socket.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Fingerprint algorithm when the store is created: sha256 or blake3
    /// (ignored, with a warning, for an existing store).
    #[arg(long, default_value = "sha256")]
    pub hash: HashAlgorithm,
    /// Size of the volume `default` created with a new store (binary
    /// suffixes: K = KiB, M = MiB, G = GiB, T = TiB, P = PiB; ignored, with a
    /// warning, for an existing store).
    #[arg(long, default_value = "16G", value_parser = crate::size::parse_volume_size)]
    pub default_volume_size: u64,
    /// Byte-compare each block with the stored copy on a fingerprint hit
    /// before sharing it (like ZFS dedup=verify; off by default). The
    /// store records it: `dedupd dedup --offline` with the server stopped
    /// verifies as the server last did.
    #[arg(long)]
    pub verify: bool,
    #[command(flatten)]
    pub bounds: crate::bounds::MemoryBounds,
    /// Eviction policy of the in-memory fingerprint store: glru (whole
    /// prefix groups; SmartDedup) or, for comparison, lru, lfu, arc or
    /// refcount (CAFTL) over single fingerprints.
    #[arg(long, default_value = "glru")]
    pub index_policy: dedupd_engine::index::EvictionPolicy,
    /// Inline lookup: memory (never waits on disk; SmartDedup) or disk (also
    /// searches the on-disk fingerprint store; dmdedup-style).
    #[arg(long, default_value = "memory")]
    pub inline_lookup: dedupd_engine::index::LookupMode,
    /// Prefix bits P of the fingerprint index when a store is created
    /// (8-24): 2^P groups of 254 entries per 4 KiB page; 14 keeps groups
    /// within 2 pages up to ~32 GiB of unique data (add 1 per doubling).
    /// Ignored, with a warning, for an existing store.
    #[arg(long, default_value_t = 14, value_parser = clap::value_parser!(u32).range(8..=24))]
    pub index_prefix_bits: u32,
    /// Out-of-line dedup rate in blocks per second (0: off). The worker
    /// drains the skipped buffer in the background and backs off while
    /// clients are sending requests.
    #[arg(long, default_value_t = 20000)]
    pub out_of_line_rate: u64,
    /// Inline selectivity: full (every block inline; the default) or
    /// adaptive (fingerprint fewer blocks inline when the duplication level
    /// falls, 30 % at least, and by battery charge; the rest is left to
    /// out-of-line dedup — for phones and battery-powered devices).
    #[arg(long, default_value = "full", value_parser = ["adaptive", "full"])]
    pub selectivity: String,
    /// With --selectivity adaptive, also lower selectivity under CPU or I/O pressure (/proc/pressure; without it, CPU or disk utilisation over 90 % from /proc/stat and /proc/diskstats).
    #[arg(long)]
    pub selectivity_load: bool,
    /// Power source for adaptive selectivity (--selectivity adaptive): auto
    /// (/sys/class/power_supply), ac, or battery:PERCENT (simulated; below
    /// 15 % inline dedup is off).
    #[arg(long, default_value = "auto")]
    pub power_source: dedupd_engine::selectivity::PowerSource,
    /// Bytes of the read cache keyed by PBA (reads of different LBAs with
    /// the same content share one cached copy); 0 disables it.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub read_cache: u64,
    /// Bytes of the skipped buffer (blocks awaiting out-of-line dedup), 16
    /// per record; at most 256M.
    #[arg(long, default_value = "512K", value_parser = parse_size)]
    pub skipped_buffer: u64,
    /// Sequence threshold T (iDedup, SmartDedup §4.5): dedup inline only
    /// runs of at least T duplicate blocks whose stored copies are
    /// contiguous, to limit fragmentation; 1 turns it off. Volumes may
    /// override it (`dedupd volume set`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub sequence_threshold: u32,
    /// Bytes of CAFTL's pre-hash CRC table: only blocks whose CRC-32C was
    /// seen before are fingerprinted inline (0: off).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    pub prehash: u64,
    /// CAFTL's sampling: fingerprint a request's other blocks only if its
    /// sample (largest CRC-32C) is a duplicate.
    #[arg(long)]
    pub sampling: bool,
    /// Worker threads per NBD connection (1 to 64; requests of a
    /// connection run concurrently up to this many).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub workers: u16,
    /// Bytes of request payload in flight at once, over all connections;
    /// at least 2M. The largest request accepted is half of it (at most
    /// 32 MiB), and one connection holds at most half.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub inflight_budget: u64,
    /// NBD connections open at once, over all listeners (each holds a
    /// 128 KiB read buffer and 4 open files); more are closed at once,
    /// and said on stderr (one line every 5 s at most). Refused if the connections could exhaust the open-file limit with
    /// the store's files (one per volume and 256); the default is lowered
    /// to what fits instead.
    #[arg(long, default_value_t = 128, value_parser = crate::parse_count)]
    pub max_connections: u64,
    /// Journal length that triggers a checkpoint of metadata in place (as
    /// do as many bytes of metadata pages changed since the last one); at
    /// least 64K.
    #[arg(long, default_value = "32M", value_parser = parse_size)]
    pub journal_size: u64,
    /// Disk space kept allocated ahead of the journal, so TRIMs can be
    /// committed on a full file system; at least twice --max-dirty.
    #[arg(long, default_value = "40M", value_parser = parse_size)]
    pub journal_reserve: u64,
    /// Changed metadata that triggers a journal commit from the write path;
    /// at least 4K.
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub max_dirty: u64,
    /// Blocks released (overwrites, TRIM) but not yet reusable that trigger
    /// a commit from the write path: the data file may grow by this much
    /// beyond what is stored. Fewer commits (each syncs the data file)
    /// under overwrite-heavy load with a larger value.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub max_pending_free: u64,
    /// Commit metadata at least this often (milliseconds; 0 = only on FLUSH/FUA and size bounds).
    #[arg(long, default_value_t = 5000)]
    pub commit_interval_ms: u64,
}

impl Default for ServeArgs {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: ServeArgs,
        }
        Wrapper::parse_from(["serve"]).args
    }
}

/// The options of `dedupd serve` that apply only when it creates the store,
/// each true if the user gave it (on the command line or in the
/// environment) rather than leaving its default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CreationOptionsGiven {
    /// `--hash`.
    pub hash: bool,
    /// `--index-prefix-bits`.
    pub index_prefix_bits: bool,
    /// `--default-volume-size`.
    pub default_volume_size: bool,
    /// `--max-connections` (not a creation option: when not given, the
    /// server lowers its default to what the open-file limit allows).
    pub max_connections: bool,
}

impl CreationOptionsGiven {
    /// Which creation options `matches` (those of `serve`) holds from the
    /// command line or the environment.
    pub fn from_matches(matches: &clap::ArgMatches) -> Self {
        use clap::parser::ValueSource;
        let given = |id: &str| {
            matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        CreationOptionsGiven {
            hash: given("hash"),
            index_prefix_bits: given("index_prefix_bits"),
            default_volume_size: given("default_volume_size"),
            max_connections: given("max_connections"),
        }
    }
}

/// The warnings for creation options given for a store that exists (whose
/// fingerprints are `store_hash`), which therefore do not apply.
fn ignored_creation_options(
    given: CreationOptionsGiven,
    args: &ServeArgs,
    store_hash: HashAlgorithm,
    has_default: bool,
) -> Vec<String> {
    let mut out = Vec::new();
    // (the store's own algorithm given again changes nothing)
    if given.hash && args.hash != store_hash {
        out.push(format!(
            "--hash {} ignored: the store exists and its fingerprints are {} (chosen when it \
             was created)",
            args.hash.name(),
            store_hash.name()
        ));
    }
    if given.index_prefix_bits {
        out.push(format!(
            "--index-prefix-bits {} ignored: the store exists and its index prefix bits were \
             fixed when it was created",
            args.index_prefix_bits
        ));
    }
    if given.default_volume_size {
        out.push(format!(
            "--default-volume-size {} ignored: it sizes the volume `default` of a new store \
             only; {}",
            human(args.default_volume_size),
            if has_default {
                "use `dedupd volume resize default SIZE` to change it"
            } else {
                "this store has no volume `default`: `dedupd volume create default SIZE` makes one"
            }
        ));
    }
    out
}

/// "store S is in use by another dedupd process (pid N: its command line)",
/// the holder as [`dedupd_engine::store::lock_holder`] finds it; without
/// it, the kinds of process that hold a store.
pub fn in_use_message(store: &Path) -> String {
    let holder = match dedupd_engine::store::lock_holder(store) {
        Some((pid, cmdline)) if !cmdline.is_empty() => format!("pid {pid}: {cmdline}"),
        Some((pid, _)) => format!("pid {pid}"),
        None => "a server, fsck, or a volume or dedup command".into(),
    };
    format!(
        "store {} is in use by another dedupd process ({holder})",
        store.display()
    )
}

/// Opens the store, creating it (with a volume `default`) if it does not
/// exist. For an existing store, warns of each creation option in `given`
/// (which does not apply).
fn open_or_create(
    store: &Path,
    args: &ServeArgs,
    given: CreationOptionsGiven,
    config: EngineConfig,
) -> anyhow::Result<Engine> {
    let empty_dir = store.is_dir()
        && std::fs::read_dir(store)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
    if store.exists() && !empty_dir {
        // opening reads every metadata page once (checksums) and rebuilds
        // the fingerprint index: seconds to minutes on a large store (said
        // only of a directory not locked by another process: those are
        // refused at once)
        let started = std::time::Instant::now();
        if store.is_dir() && dedupd_engine::store::lock_holder(store).is_none() {
            err_line!(
                "dedupd: opening store {}: checking metadata, rebuilding the fingerprint index",
                store.display()
            );
        }
        let opened = match Engine::open(store, config) {
            Err(EngineError::Locked(p)) => Err(anyhow::anyhow!(in_use_message(&p))),
            other => Ok(other?),
        };
        if let Ok(e) = &opened {
            err_line!(
                "dedupd: store opened in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            if let Err(err) = e.make_replayed_chain_durable() {
                err_line!(
                    "dedupd: warning: could not write the replayed journal again: {err} \
                     (tried again at the first write or FLUSH)"
                );
            }
            let has_default = e.volume("default").is_some();
            for w in ignored_creation_options(given, args, e.hash_algorithm(), has_default) {
                err_line!("dedupd: warning: {w}");
            }
        }
        return opened;
    }
    let size_bytes = args.default_volume_size;
    let existed = store.exists();
    let engine = Engine::create(store, args.hash, config)
        .with_context(|| format!("creating store {}", store.display()))?;
    if let Err(e) = engine.create_volume("default", size_bytes) {
        // a store without its first volume would be served empty at every
        // later start: take back what this call made. The superblock goes
        // first, while this process holds the store's lock: from then on
        // no other dedupd takes the directory for a store
        let _ = std::fs::remove_file(store.join("superblock"));
        drop(engine);
        let undone = if existed {
            std::fs::read_dir(store).and_then(|entries| {
                entries.into_iter().try_for_each(|entry| {
                    let path = entry?.path();
                    if path.is_dir() {
                        std::fs::remove_dir_all(path)
                    } else {
                        std::fs::remove_file(path)
                    }
                })
            })
        } else {
            std::fs::remove_dir_all(store)
        };
        if let Err(u) = undone {
            err_line!(
                "dedupd: warning: could not remove the store just created at {}: {u}",
                store.display()
            );
        }
        return Err(e).with_context(|| format!("creating volume default in {}", store.display()));
    }
    out_line!(
        "created store {} with volume default ({})",
        store.display(),
        human(size_bytes)
    );
    Ok(engine)
}

/// Smallest `--inflight-budget`: the largest request a client may send is
/// half of it, and the NBD protocol expects servers to take 1 MiB ones.
const INFLIGHT_BUDGET_MIN_BYTES: u64 = 2 << 20;

/// Smallest `--journal-size`.
const JOURNAL_SIZE_MIN_BYTES: u64 = 64 << 10;

/// Refuses options that would be ignored or cannot work together.
fn check_option_combinations(args: &ServeArgs) -> anyhow::Result<()> {
    if args.selectivity != "adaptive" {
        if args.selectivity_load {
            anyhow::bail!(
                "--selectivity-load applies to adaptive selectivity only: add --selectivity adaptive"
            );
        }
        if args.power_source != dedupd_engine::selectivity::PowerSource::Auto {
            anyhow::bail!(
                "--power-source applies to adaptive selectivity only: add --selectivity adaptive"
            );
        }
    }
    if args.journal_size < JOURNAL_SIZE_MIN_BYTES {
        anyhow::bail!(
            "--journal-size {} is too small: at least 64K (below it every commit would \
             checkpoint the metadata in place)",
            crate::size::exact_size(args.journal_size)
        );
    }
    if args.max_dirty < 4096 {
        anyhow::bail!(
            "--max-dirty {} is too small: at least 4K, one metadata page (a client that needs \
             each write durable at once sends it with FUA, or a FLUSH)",
            crate::size::exact_size(args.max_dirty)
        );
    }
    if args.inflight_budget < INFLIGHT_BUDGET_MIN_BYTES {
        anyhow::bail!(
            "--inflight-budget {} is too small: at least 2M (the largest request a client \
             may send is half of it, and NBD clients expect to send 1 MiB ones)",
            crate::size::exact_size(args.inflight_budget)
        );
    }
    Ok(())
}

/// File descriptors an NBD connection holds (its socket, and the clones
/// its reading, replying and shutdown halves use).
const DESCRIPTORS_PER_CONNECTION: u64 = 4;

/// File descriptors kept for everything but the store's volume maps (one
/// open file each, counted apart): the store's other files, listeners, the
/// control socket and its clients, scratch files, volumes created while
/// serving.
const DESCRIPTORS_RESERVED: u64 = 256;

/// Volume-map files of the store at `store` (one descriptor each while
/// serving); 0 for a store not made yet.
fn map_files_of(store: &Path) -> u64 {
    std::fs::read_dir(store.join("maps")).map_or(0, |d| d.count() as u64)
}

/// Raises the soft limit on open files to the hard one, and refuses a
/// `--max-connections` whose connections could use up the descriptors the
/// store needs (a full table would fail commits for every client).
///
/// How often connections refused at `--max-connections` are said on
/// stderr (at most one line per interval).
const REFUSAL_NOTE_INTERVAL: Duration = Duration::from_secs(5);

/// The stderr line for `n` connections refused at the limit of `max` open
/// connections.
fn refusal_note(n: u64, max: u64) -> String {
    let conns = if n == 1 { "connection" } else { "connections" };
    format!(
        "dedupd: warning: refused {n} NBD {conns}: {max} open already \
         (--max-connections; `dedupd stats` counts them)"
    )
}

/// Returns the connections to allow: `max_connections`, or, when it was
/// not given (`given` false: the default) and does not fit, as many as
/// fit, with a warning.
fn ensure_descriptors_for(max_connections: u64, given: bool, store: &Path) -> anyhow::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Ok(max_connections); // (nothing known: nothing to check)
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    let limit: u64 = lim.rlim_cur;
    // (a store made now gets its volume `default`)
    let maps = map_files_of(store).max(1);
    let reserved = DESCRIPTORS_RESERVED + maps;
    let needed = max_connections
        .saturating_mul(DESCRIPTORS_PER_CONNECTION)
        .saturating_add(reserved);
    if lim.rlim_cur != libc::RLIM_INFINITY && needed > limit {
        let fits = limit.saturating_sub(reserved) / DESCRIPTORS_PER_CONNECTION;
        if !given && fits > 0 {
            err_line!(
                "dedupd: warning: at most {fits} NBD connections at once (not {max_connections}): \
                 this process may open {limit} files (`ulimit -n`), and the store's {maps} \
                 volumes and the rest of the store take {reserved}"
            );
            return Ok(fits);
        }
        let advice = if fits == 0 {
            "raise the limit".to_string()
        } else {
            format!("give --max-connections {fits} or less, or raise the limit")
        };
        anyhow::bail!(
            "--max-connections {max_connections} needs up to {needed} open files \
             ({DESCRIPTORS_PER_CONNECTION} per connection, one per volume ({maps}) and \
             {DESCRIPTORS_RESERVED} for the rest of the store), but this process may open \
             {limit} (`ulimit -n`): {advice}"
        );
    }
    Ok(max_connections)
}

/// Volumes named in the line `serve` prints at start (the rest are
/// counted).
const VOLUMES_NAMED: usize = 8;

/// Runs the server until SIGINT, SIGTERM or SIGHUP. `given` tells which
/// creation options the user gave (warned of if the store exists).
pub fn run(store: &Path, args: ServeArgs, given: CreationOptionsGiven) -> anyhow::Result<()> {
    check_option_combinations(&args)?;
    let max_connections =
        ensure_descriptors_for(args.max_connections, given.max_connections, store)?;
    let mut config = EngineConfig {
        journal_size_bytes: args.journal_size,
        max_dirty_bytes: args.max_dirty,
        max_pending_free_bytes: args.max_pending_free,
        journal_reserve_bytes: args.journal_reserve,
        verify: args.verify,
        selectivity: dedupd_engine::selectivity::SelectivityConfig {
            adaptive: args.selectivity == "adaptive",
            load_aware: args.selectivity_load && args.selectivity == "adaptive",
            power: if args.selectivity == "adaptive" {
                args.power_source
            } else {
                dedupd_engine::selectivity::PowerSource::Ac
            },
        },
        read_cache_bytes: args.read_cache,
        sequence_threshold_blocks: args.sequence_threshold,
        prehash_bytes: args.prehash,
        sampling: args.sampling,
        skipped_buffer_bytes: args.skipped_buffer as usize,
        index: dedupd_engine::index::IndexConfig {
            policy: args.index_policy,
            lookup: args.inline_lookup,
            prefix_bits: args.index_prefix_bits,
            // (set from the memory bounds below)
            ..dedupd_engine::index::IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    args.bounds.apply(&mut config);
    let server_config = ServerConfig {
        workers_per_connection: usize::from(args.workers),
        inflight_budget_bytes: args.inflight_budget as usize,
        max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
        ..ServerConfig::default()
    };
    // the listeners are tried first: a bad --listen or --socket, or one in
    // use, changes nothing (no store is created). They are let go again
    // while the store opens (minutes, for a large one): clients meanwhile
    // are refused and retry, instead of waiting for a greeting.
    if args.no_tcp && args.socket.is_none() {
        anyhow::bail!("nothing to listen on: give --socket when using --no-tcp");
    }
    let bind_tcp = |listen: &str| -> anyhow::Result<TcpListener> {
        if !listen.contains(':') {
            anyhow::bail!(
                "--listen {listen}: give HOST:PORT, such as 127.0.0.1:10809, \
                 localhost:10809 or [::1]:10809"
            );
        }
        TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))
    };
    let bind_unix = |p: &Path| -> anyhow::Result<UnixListener> {
        SocketPath::new(p)
            .and_then(|at| UnixListener::bind(at.addr()))
            .with_context(|| format!("listening on {}", p.display()))
    };
    if let Some(p) = &args.socket {
        remove_stale_socket(p)?;
        drop(bind_unix(p)?);
        let _ = std::fs::remove_file(p);
    }
    // (a port of 0, tried here and bound again below, gets another free
    // port; the one printed is the one bound)
    if !args.no_tcp {
        drop(bind_tcp(&args.listen)?);
    }
    let engine = Arc::new(open_or_create(store, &args, given, config)?);
    let tcp = if args.no_tcp {
        None
    } else {
        Some(bind_tcp(&args.listen)?)
    };
    let unix = match &args.socket {
        Some(p) => Some((bind_unix(p)?, p.clone())),
        None => None,
    };
    let exports = Arc::new(VolumeExports::new(engine.clone()));
    let server = Arc::new(Server::new(exports.clone(), server_config));

    // control socket (we hold the store lock, so an existing one is stale)
    let ctl_path = control::socket_path(store);
    let _ = std::fs::remove_file(&ctl_path);
    let ctl = SocketPath::new(&ctl_path)
        .and_then(|at| UnixListener::bind(at.addr()))
        .with_context(|| format!("binding {}", ctl_path.display()))?;
    // it manages the store: the server's user only (root passes anyway;
    // connections of other users are refused by credentials too)
    std::fs::set_permissions(
        &ctl_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .with_context(|| format!("restricting {}", ctl_path.display()))?;
    let stop = Arc::new(StopSignal::new());

    // the stop signals are caught from here on, before the server says it
    // is ready (one sent as soon as it has would otherwise kill it); they
    // are acted on once it serves. SIGHUP too: the terminal or session
    // going away stops the server cleanly instead of killing it, unless
    // the caller set it to be ignored (`nohup`). (SIGINT is caught even
    // then: a script's background job has it ignored, and the script's
    // `kill -INT` must still stop the server.)
    let mut signals = signal_hook::iterator::Signals::new(
        [
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
            signal_hook::consts::SIGHUP,
        ]
        .into_iter()
        .filter(|&sig| sig != signal_hook::consts::SIGHUP || !signal_ignored(sig)),
    )?;
    let names: Vec<String> = engine.volume_names().into_iter().map(|(n, _)| n).collect();
    let first = names
        .iter()
        .find(|n| *n == "default")
        .or(names.first())
        .cloned()
        .unwrap_or_default();
    match names.len() {
        0 => out_line!("dedupd: store {} (no volumes)", store.display()),
        1 => out_line!("dedupd: store {} (1 volume: {})", store.display(), names[0]),
        n if n <= VOLUMES_NAMED => out_line!(
            "dedupd: store {} ({n} volumes: {})",
            store.display(),
            names.join(", ")
        ),
        n => out_line!(
            "dedupd: store {} ({n} volumes: {}, … and {} more: `dedupd --store {} volume list`)",
            store.display(),
            names[..VOLUMES_NAMED].join(", "),
            n - VOLUMES_NAMED,
            shell_quote(&store.display().to_string())
        ),
    }
    for n in engine.notes() {
        err_line!("dedupd: warning: {n}");
    }
    // (the open kept a larger reserve an earlier start made; the server's
    // is the one asked for. A failure is said, unless the open said it)
    if let Err(note) = engine.fit_journal_reserve() {
        if !engine.notes().contains(&note) {
            err_line!("dedupd: warning: {note}");
        }
    }
    for d in engine.damage() {
        err_line!(
            "dedupd: warning: {}; its volume is served read-only, and reads of the \
             LBAs whose mapping was lost fail (EIO), until `dedupd --store {} fsck --repair` \
             (which lists them as lost)",
            d.describe(),
            shell_quote(&store.display().to_string())
        );
    }
    if names.is_empty() {
        out_line!(
            "dedupd: no volumes: create one with `dedupd --store {} volume create NAME SIZE`",
            shell_quote(&store.display().to_string())
        );
    }
    if let Some(l) = &tcp {
        let addr = l.local_addr()?;
        out_line!("dedupd: listening on nbd://{addr}");
        if !names.is_empty() {
            // (listening on every address: a client on this machine
            // connects to the loopback one)
            let mut reach = addr;
            if reach.ip().is_unspecified() {
                reach.set_ip(match reach.ip() {
                    std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            out_line!(
                "dedupd: try: nbdinfo nbd://{reach}/{}",
                uri_encode(first.as_ref())
            );
        }
    }
    if let Some((_, p)) = &unix {
        // (absolute, so that the command works from any directory, unless
        // that is too long for a socket address and the path given is not)
        let p = match std::path::absolute(p) {
            Ok(a) if a.as_os_str().len() <= 107 || p.as_os_str().len() > 107 => a,
            _ => p.clone(),
        };
        let p = &p;
        let socket = uri_encode(p.as_os_str());
        out_line!("dedupd: listening on nbd+unix:///?socket={socket}");
        if p.as_os_str().len() > 107 {
            err_line!(
                "dedupd: warning: --socket {} is longer than a Unix socket address \
                 (107 bytes): clients connecting by this path will fail; give them \
                 a shorter path (a symbolic link to its directory)",
                p.display()
            );
        }
        if !names.is_empty() {
            let uri = format!("nbd+unix:///{}?socket={socket}", uri_encode(first.as_ref()));
            out_line!("dedupd: try: nbdinfo {}", shell_quote(&uri));
        }
    }
    out_line!(
        "dedupd: stats: dedupd --store {} stats",
        shell_quote(
            &std::path::absolute(store)
                .unwrap_or_else(|_| store.to_path_buf())
                .display()
                .to_string()
        )
    );
    use std::io::Write;
    std::io::stdout().flush().ok();

    let worker =
        (args.out_of_line_rate > 0).then(|| engine.start_out_of_line(args.out_of_line_rate));
    let handle = server.shutdown_handle();
    let signal_handle = signals.handle();
    {
        let handle = handle.clone();
        let stop = stop.clone();
        let engine = engine.clone();
        std::thread::spawn(move || {
            // (messages that cannot be written, to a terminal that hung
            // up, say, are dropped: this thread must go on to stop the
            // server)
            let say = |line: String| {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "{line}");
            };
            let mut received = signals.forever();
            if let Some(sig) = received.next() {
                // (a SIGHUP after the first signal is ignored: a closing
                // terminal sends it twice)
                say(format!(
                    "dedupd: signal {sig}: finishing in-flight requests (a SIGINT or SIGTERM \
                     now exits at once)"
                ));
                // the control socket stops accepting too; its requests
                // already taken finish before the store is closed (an
                // offline pass early, with the merges it has planned)
                stop.stop();
                engine.stop_offline_passes();
                handle.shutdown();
            }
            // a second SIGINT or SIGTERM (the operator will not wait, say
            // for a long volume delete): exit now, as a crash would, which
            // the journal covers. Not a SIGHUP: a closing terminal sends
            // it twice (the shell passes its own on, then the kernel hangs
            // the session's foreground group up)
            for sig in received {
                if sig == signal_hook::consts::SIGHUP {
                    continue;
                }
                say(format!(
                    "dedupd: signal {sig} again: exiting now; the next start recovers from the journal (writes not flushed may read back old)"
                ));
                std::process::exit(128 + sig);
            }
        });
    }

    let served = std::thread::scope(|s| -> anyhow::Result<()> {
        {
            let engine = engine.clone();
            let server = server.clone();
            let exports = exports.clone();
            let stop = stop.clone();
            s.spawn(move || {
                control::serve(ctl, stop, move |req, progress| {
                    answer(&engine, &server, &exports, req, progress)
                });
            });
        }
        if args.commit_interval_ms > 0 {
            let engine = engine.clone();
            let stop = stop.clone();
            let interval = Duration::from_millis(args.commit_interval_ms);
            s.spawn(move || {
                // (asleep between commits; the stop wakes it)
                while !stop.wait_timeout(interval) {
                    if let Err(e) = engine.commit_periodic() {
                        err_line!("dedupd: periodic commit failed: {e}");
                    }
                }
            });
        }
        {
            // connections refused at the limit are said on stderr (at most
            // one line every REFUSAL_NOTE_INTERVAL), so that an operator
            // sees why a client failed without asking for the stats
            let server = server.clone();
            let stop = stop.clone();
            s.spawn(move || {
                let mut said = 0;
                while !stop.wait_timeout(REFUSAL_NOTE_INTERVAL) {
                    let refused = server.stats().connections_refused;
                    if refused > said {
                        err_line!("{}", refusal_note(refused - said, max_connections));
                        said = refused;
                    }
                }
            });
        }
        let tcp_thread = tcp.map(|l| {
            let server = server.clone();
            let handle = handle.clone();
            s.spawn(move || {
                // a listener that fails stops the server (the other
                // listener and the clients too), which then closes the
                // store as on a signal
                let r = server.serve_tcp(l);
                if r.is_err() {
                    handle.shutdown();
                }
                r
            })
        });
        let unix_thread = unix.map(|(l, _)| {
            let server = server.clone();
            let handle = handle.clone();
            s.spawn(move || {
                let r = server.serve_unix(l);
                if r.is_err() {
                    handle.shutdown();
                }
                r
            })
        });
        let mut result = Ok(());
        for t in [tcp_thread, unix_thread].into_iter().flatten() {
            if let Err(e) = t.join().expect("listener thread panicked") {
                result = Err(anyhow::Error::from(e).context("serving NBD"));
            }
        }
        stop.stop();
        // the clients' writes committed now, not only once a control
        // command still running (a long delete or offline pass) ends: the
        // periodic commit has stopped, and the operator may not wait
        if let Err(e) = engine.flush() {
            err_line!("dedupd: commit at shutdown failed: {e}");
        }
        result
    });
    // (on a listener's error too: the store is closed cleanly first)
    if let Some(p) = &args.socket {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(&ctl_path);
    if let Some(w) = worker {
        w.stop();
    }
    engine
        .flush()
        .context("making the store durable at shutdown")?;
    if let Err(e) = engine.checkpoint() {
        err_line!(
            "dedupd: warning: checkpoint at shutdown failed ({e}); \
             the journal keeps every change and the next start replays it"
        );
    }
    // (only now: until the store is closed a second signal still exits
    // at once; a closed handle leaves the signals ignored)
    signal_handle.close();
    served?;
    let st = engine.stats();
    // (not printable once the terminal hung up or the reader left: the
    // store is closed, the stop clean all the same)
    let _ = writeln!(
        std::io::stdout(),
        "dedupd: stopped; {} stored for {} mapped (dedup ratio {:.2})",
        human(st.physical_bytes_stored),
        human(st.logical_bytes_mapped),
        st.dedup_ratio
    );
    Ok(())
}

/// The figures of `dedupd stats` while serving: the engine's `stats`
/// with the NBD server's `server` added.
///
/// Errors: serialising them.
pub(crate) fn stats_with_server(
    stats: &dedupd_engine::Stats,
    server: &dedupd_nbd::ServerStats,
) -> anyhow::Result<Value> {
    let mut v = serde_json::to_value(stats)?;
    let s = server;
    v["connections_open"] = s.connections_open.into();
    v["connections_total"] = s.connections_total.into();
    v["requests_total"] = s.requests_total.into();
    v["inflight_bytes"] = s.inflight_bytes.into();
    v["inflight_bytes_peak"] = s.inflight_bytes_peak.into();
    v["inflight_budget_bytes"] = s.inflight_budget_bytes.into();
    v["connections_refused"] = s.connections_refused.into();
    v["connection_read_buffer_bytes"] = s.read_buffer_bytes.into();
    v["connection_kept_buffer_bytes"] = s.kept_buffer_bytes.into();
    v["connections_negotiating"] = s.connections_negotiating.into();
    v["negotiation_buffer_bytes"] = s.negotiation_buffer_bytes.into();
    Ok(v)
}

fn answer(
    engine: &Engine,
    server: &Server,
    exports: &VolumeExports,
    req: Request,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Value> {
    Ok(match req {
        Request::Stats => stats_with_server(&engine.stats(), &server.stats())?,
        Request::VolumeList => serde_json::to_value(engine.volumes())?,
        Request::VolumeCreate { name, size_bytes } => {
            engine.create_volume(&name, size_bytes)?;
            Value::Null
        }
        Request::VolumeResize {
            name,
            size_bytes,
            shrink,
            force,
        } => {
            crate::volops::resize(
                engine,
                Some(exports),
                &name,
                size_bytes,
                shrink,
                force,
                progress,
            )?;
            Value::Null
        }
        Request::VolumeDelete { name, force } => {
            crate::volops::delete(engine, Some(exports), &name, force, progress)?
        }
        Request::VolumeRename { name, new_name } => {
            engine.rename_volume(&name, &new_name)?;
            Value::Null
        }
        Request::VolumeSet {
            name,
            sequence_threshold_blocks,
        } => {
            engine.set_sequence_threshold(&name, sequence_threshold_blocks)?;
            Value::Null
        }
        Request::DedupOffline { volume } => {
            crate::offline_pass(engine, volume.as_deref(), progress)?
        }
    })
}

/// `s` percent-encoded for a URI's path or query (RFC 3986: unreserved
/// characters and `/` kept, every other byte as `%XX`; bytes that are not
/// UTF-8 too).
fn uri_encode(s: &std::ffi::OsStr) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(crate) use dedupd_engine::error::shell_quote;

/// Removes a socket left at `path` by a server that is gone, so the Unix
/// listener can bind there. Anything else at `path` is left alone.
///
/// Errors: `path` is not a socket (a file, a directory...), or a server
/// still answers on it.
fn remove_stale_socket(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("--socket {}", path.display())),
    };
    if !md.file_type().is_socket() {
        anyhow::bail!(
            "--socket {}: exists and is not a socket (not removing it)",
            path.display()
        );
    }
    // stale only if nobody accepts there: any other answer (a server
    // listening, or one we may not reach) leaves the socket alone
    match SocketPath::new(path).and_then(|at| std::os::unix::net::UnixStream::connect(at.addr())) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        Ok(_) => anyhow::bail!(
            "--socket {}: another server is listening there",
            path.display()
        ),
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "--socket {}: a socket is there and may be in use (not removing it)",
                    path.display()
                )
            })
        }
    }
    std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))
}

/// True if signal `sig` is set to be ignored (as `nohup` leaves SIGHUP).
fn signal_ignored(sig: libc::c_int) -> bool {
    // SAFETY: sigaction with a null new action only reads the current
    // disposition into `old`, a zeroed sigaction we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn uri_parts_are_percent_encoded_byte_by_byte() {
        assert_eq!(uri_encode(OsStr::new("/tmp/n.sock")), "/tmp/n.sock");
        assert_eq!(
            uri_encode(OsStr::new("/tmp/sp ace%/n?.sock")),
            "/tmp/sp%20ace%25/n%3F.sock"
        );
        assert_eq!(uri_encode(OsStr::from_bytes(b"/a\xffb")), "/a%FFb");
    }
}
