//! `dedupd-bench`: measures dedupd against a plain nbdkit file export.
//!
//! For each workload (4 KiB random write, 4 KiB random read after a
//! sequential prefill, 1 MiB sequential write) and each fio
//! `dedupe_percentage` (0, 25, 50, 75 by default), the benchmark runs fio
//! with its `nbd` ioengine against
//!
//! * the baseline: `nbdkit file` serving a fresh sparse file, and
//! * `dedupd serve` on a fresh store,
//!
//! alternating between the two `--repeats` times (one pair per repeat, the
//! order swapped every repeat) so that both see the same machine state,
//! after one discarded warm-up pair. Every run gets a fresh server and a
//! fresh file or store in a temporary directory. It reports the median of
//! each side, the ratio dedupd / baseline as the median of the pairs'
//! ratios (each pair ran back to back) with their range, whether that ratio
//! meets the target, and dedupd's peak RSS and share of duplicate writes
//! eliminated (from `dedupd stats --json`).
//!
//! It builds nothing: run `cargo build --release` first. `nbdkit` and `fio`
//! (with the `nbd` ioengine) must be on `PATH`.
//!
//! Servers are stopped with SIGTERM when the run ends, also on errors and
//! panics ([`ServerGuard`]). On Ctrl-C at a terminal the servers get SIGINT
//! too, as they share the benchmark's process group; nbdkit is additionally
//! started with `--exit-with-parent`.

#![warn(missing_docs)]

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::Read as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use serde::Deserialize;
use serde_json::Value;

/// Seconds of each timed fio run before its measurement starts (fio
/// `ramp_time`).
const RAMP_S: u64 = 1;

/// SIGTERM's signal number (Linux).
const SIGTERM: i32 = 15;

/// Command line of `dedupd-bench`.
#[derive(Parser, Debug)]
#[command(
    name = "dedupd-bench",
    about = "Benchmark dedupd against an nbdkit file export with fio over NBD",
    after_help = "Build dedupd first: cargo build --release -p dedupd. Needs nbdkit and fio (with the nbd ioengine) on PATH."
)]
pub struct Cli {
    /// Short run: 3 s per measurement, 2 repeats, 256 MiB region (each can still be overridden).
    #[arg(long)]
    pub quick: bool,
    /// Seconds each fio measurement runs (default 10, or 3 with --quick).
    #[arg(long)]
    pub runtime_s: Option<u64>,
    /// Runs of each server per (workload, dup %) row (default 4, or 2 with
    /// --quick; with an even count each server runs first equally often).
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Size of the region fio works on (default 1G, or 256M with --quick).
    #[arg(long)]
    pub region: Option<String>,
    /// Size of the dedupd volume and of the baseline's sparse file.
    #[arg(long, default_value = "2G")]
    pub volume_size: String,
    /// Workloads to run.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Workload::ALL.to_vec())]
    pub workloads: Vec<Workload>,
    /// fio dedupe_percentage values to run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0u32, 25, 50, 75])]
    pub dup: Vec<u32>,
    /// Directory for temporary stores and files (a fresh subdirectory is made and removed).
    #[arg(long, default_value = "/tmp")]
    pub dir: PathBuf,
    /// The dedupd binary (default: target/release/dedupd of this workspace).
    #[arg(long)]
    pub dedupd: Option<PathBuf>,
    /// Also write the report (Markdown) to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A fio workload measured by the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// 4 KiB random write, iodepth 16; measured in IOPS.
    Randwrite,
    /// 4 KiB random read, iodepth 16, after a sequential prefill of the region; IOPS.
    Randread,
    /// 1 MiB sequential write, iodepth 4; measured in MiB/s.
    Seqwrite,
}

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 3] = [Workload::Randwrite, Workload::Randread, Workload::Seqwrite];

    /// Human-readable name for the report.
    pub fn label(self) -> &'static str {
        match self {
            Workload::Randwrite => "4K rand write QD16",
            Workload::Randread => "4K rand read QD16",
            Workload::Seqwrite => "1M seq write QD4",
        }
    }

    /// Whether the measured phase writes.
    pub fn is_write(self) -> bool {
        !matches!(self, Workload::Randread)
    }

    /// Unit of the reported figure.
    pub fn unit(self) -> &'static str {
        match self {
            Workload::Seqwrite => "MiB/s",
            _ => "IOPS",
        }
    }

    /// fio arguments (`rw`, `bs`, `iodepth`) of the measured phase.
    fn fio_args(self) -> [&'static str; 3] {
        match self {
            Workload::Randwrite => ["--rw=randwrite", "--bs=4k", "--iodepth=16"],
            Workload::Randread => ["--rw=randread", "--bs=4k", "--iodepth=16"],
            Workload::Seqwrite => ["--rw=write", "--bs=1m", "--iodepth=4"],
        }
    }

    /// Minimum dedupd / baseline ratio this workload should reach at `dup` %.
    pub fn target(self, dup: u32) -> f64 {
        match (self.is_write(), dup) {
            (true, 0) => 0.9,
            (true, _) => 1.0,
            (false, _) => 0.9,
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.to_possible_value().expect("no skipped variants");
        f.write_str(v.get_name())
    }
}

/// Which server a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `nbdkit file` on a sparse file.
    Baseline,
    /// `dedupd serve` on a fresh store.
    Dedupd,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Baseline => "nbdkit-file",
            Target::Dedupd => "dedupd",
        }
    }
}

/// Resolved settings of one benchmark invocation.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Seconds per measured fio run.
    pub runtime_s: u64,
    /// Runs per server per (workload, dup %) pair.
    pub repeats: usize,
    /// Bytes of the region fio works on.
    pub region_bytes: u64,
    /// Bytes of the volume / sparse file.
    pub volume_bytes: u64,
    /// The dedupd binary.
    pub dedupd: PathBuf,
    /// Directory of the temporary stores and files.
    pub dir: PathBuf,
}

/// Stops a server process when dropped: SIGTERM, then waits (SIGKILL after a grace period).
pub struct ServerGuard {
    child: Option<Child>,
    name: String,
}

impl ServerGuard {
    /// Wraps a spawned server.
    pub fn new(child: Child, name: impl Into<String>) -> Self {
        ServerGuard {
            child: Some(child),
            name: name.into(),
        }
    }

    /// Returns the exit status if the server has already exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends SIGTERM and waits for the process to exit; SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(status) = child.try_wait()? {
            // it was to be running: any exit before SIGTERM is a failure
            bail!("{} had exited before SIGTERM ({status})", self.name);
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait()? {
                // a clean exit, or death by the SIGTERM itself (a server
                // without a handler); any other signal (SIGSEGV, an OOM
                // kill) or exit code is a failure
                let by_term =
                    std::os::unix::process::ExitStatusExt::signal(&status) == Some(SIGTERM);
                if !(status.success() || by_term) {
                    bail!("{} exited with {status} after SIGTERM", self.name);
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        bail!(
            "{} did not exit within {:?} of SIGTERM; killed",
            self.name,
            grace
        )
    }
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Err(e) = self.stop(Duration::from_secs(120)) {
            eprintln!("dedupd-bench: warning: {e:#}");
        }
    }
}

/// A directory removed (recursively) when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates the directory `parent/name`, which must not exist yet.
    pub fn new(parent: &Path, name: &str) -> anyhow::Result<Self> {
        let p = parent.join(name);
        fs::create_dir(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(TempDir(p))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A running server under test and the NBD URI to reach it.
struct Running {
    guard: ServerGuard,
    uri: String,
    store: Option<PathBuf>,
}

/// One measured run.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// IOPS or MiB/s, per [`Workload::unit`].
    pub value: f64,
    /// dedupd's peak RSS (dedupd runs only).
    pub peak_rss_bytes: Option<u64>,
    /// dedupd's duplicate_writes_eliminated_percent (dedupd runs only).
    pub dup_eliminated_percent: Option<f64>,
}

/// All runs of one (workload, dup %) pair.
#[derive(Debug, Clone)]
pub struct Row {
    /// The workload.
    pub workload: Workload,
    /// fio dedupe_percentage.
    pub dup: u32,
    /// Baseline runs.
    pub baseline: Vec<Sample>,
    /// dedupd runs.
    pub dedupd: Vec<Sample>,
}

/// Parses `123`, `4K`, `256M`, `2G`, `1T` (binary multiples; an optional `iB`/`B` is accepted).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => bail!("bad size suffix in {s:?}"),
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .with_context(|| format!("bad size {s:?}"))?;
    n.checked_mul(mult)
        .with_context(|| format!("size {s:?} overflows"))
}

/// Median of `v` (mean of the middle two for an even count); NaN if empty.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn find_in_path(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

fn command_output(prog: &str, args: &[&str]) -> String {
    Command::new(prog)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Checks that dedupd, nbdkit (with its file plugin) and fio (with the nbd ioengine) are usable.
fn check_prerequisites(settings: &Settings) -> anyhow::Result<()> {
    if !settings.dedupd.is_file() {
        bail!(
            "dedupd binary not found at {}: build it first with `cargo build --release` \
             (or `cargo build --release -p dedupd`), or pass --dedupd PATH",
            settings.dedupd.display()
        );
    }
    if find_in_path("nbdkit").is_none() {
        bail!("`nbdkit` not found on PATH: install nbdkit (e.g. `apt-get install nbdkit`)");
    }
    if find_in_path("fio").is_none() {
        bail!("`fio` not found on PATH: install fio built with the nbd ioengine (e.g. `apt-get install fio`)");
    }
    let eng = Command::new("fio")
        .arg("--enghelp=nbd")
        .output()
        .context("running fio --enghelp=nbd")?;
    if !eng.status.success() || !String::from_utf8_lossy(&eng.stdout).contains("uri") {
        bail!("this fio has no `nbd` ioengine (fio --enghelp=nbd failed); install a fio built with libnbd");
    }
    let plug = Command::new("nbdkit")
        .args(["file", "--dump-plugin"])
        .output()
        .context("running nbdkit")?;
    if !plug.status.success() {
        bail!(
            "nbdkit has no `file` plugin: {}",
            String::from_utf8_lossy(&plug.stderr).trim()
        );
    }
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free TCP port")?;
    Ok(l.local_addr()?.port())
}

fn tail_of(path: &Path) -> String {
    let s = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts `nbdkit file` on a fresh sparse file in `dir`.
fn start_nbdkit(dir: &Path, volume_bytes: u64) -> anyhow::Result<Running> {
    let file = dir.join("baseline.img");
    File::create(&file)
        .and_then(|f| f.set_len(volume_bytes))
        .with_context(|| format!("creating sparse file {}", file.display()))?;
    // nbdkit cannot pick a port itself: take a free one, retry if another process grabs it first.
    for attempt in 0..5 {
        let port = free_port()?;
        let pidfile = dir.join(format!("nbdkit-{attempt}.pid"));
        let log = dir.join(format!("nbdkit-{attempt}.log"));
        let log_file = File::create(&log)?;
        let child = Command::new("nbdkit")
            .arg("--exit-with-parent")
            .arg("-f")
            .arg("-P")
            .arg(&pidfile)
            .arg("-p")
            .arg(port.to_string())
            .arg("-i")
            .arg("127.0.0.1")
            .arg("file")
            .arg(format!("file={}", file.display()))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("starting nbdkit")?;
        let mut guard = ServerGuard::new(child, "nbdkit");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // nbdkit writes the pidfile once it accepts connections.
            if fs::metadata(&pidfile).map(|m| m.len() > 0).unwrap_or(false) {
                return Ok(Running {
                    guard,
                    uri: format!("nbd://127.0.0.1:{port}/"),
                    store: None,
                });
            }
            if guard.exited().is_some() {
                eprintln!(
                    "dedupd-bench: nbdkit on port {port} exited early, retrying: {}",
                    tail_of(&log)
                );
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "nbdkit did not become ready within 20 s:\n{}",
                    tail_of(&log)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    bail!("could not start nbdkit (port collisions?)")
}

/// Starts `dedupd serve` on a fresh store in `dir`; reads the port from its stdout.
fn start_dedupd(dedupd: &Path, dir: &Path, volume_bytes: u64) -> anyhow::Result<Running> {
    let store = dir.join("store");
    let out = dir.join("dedupd.out");
    let err = dir.join("dedupd.err");
    let child = Command::new(dedupd)
        .arg("--store")
        .arg(&store)
        .args(["serve", "--listen", "127.0.0.1:0", "--default-volume-size"])
        .arg(volume_bytes.to_string())
        .stdin(Stdio::null())
        .stdout(File::create(&out)?)
        .stderr(File::create(&err)?)
        .spawn()
        .with_context(|| format!("starting {}", dedupd.display()))?;
    let mut guard = ServerGuard::new(child, "dedupd");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = fs::read_to_string(&out).unwrap_or_default();
        if let Some(addr) = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("dedupd: listening on nbd://"))
        {
            let addr = addr.trim().trim_end_matches('/');
            return Ok(Running {
                guard,
                uri: format!("nbd://{addr}/default"),
                store: Some(store),
            });
        }
        if let Some(status) = guard.exited() {
            bail!(
                "dedupd exited ({status}) before listening:\n{}\n{}",
                tail_of(&out),
                tail_of(&err)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "dedupd did not print its listening address within 60 s:\n{}",
                tail_of(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Longest a region prefill may take before fio is killed.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(900);

/// The part of fio's JSON output the benchmark reads.
#[derive(Deserialize)]
struct FioOutput {
    jobs: Vec<FioJob>,
}

#[derive(Deserialize)]
struct FioJob {
    error: i64,
    read: FioDir,
    write: FioDir,
}

#[derive(Deserialize)]
struct FioDir {
    iops: f64,
    bw_bytes: u64,
    total_ios: u64,
}

/// Runs fio with `args` against `uri`; returns the parsed read or write figures.
fn run_fio(
    dir: &Path,
    uri: &str,
    tag: &str,
    args: &[String],
    timeout: Duration,
) -> anyhow::Result<(FioDir, FioDir)> {
    let json_path = dir.join(format!("fio-{tag}.json"));
    let log_path = dir.join(format!("fio-{tag}.log"));
    let log = File::create(&log_path)?;
    let mut child = Command::new("fio")
        .arg(format!("--name={tag}"))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .args(args)
        .arg("--output-format=json")
        .arg(format!("--output={}", json_path.display()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("running fio")?;
    // A stalled server must not hang the benchmark: kill fio after `timeout`.
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "fio {tag} against {uri} did not finish within {timeout:?}; killed:\n{}",
                tail_of(&log_path)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        bail!(
            "fio {tag} against {uri} failed ({status}):\n{}",
            tail_of(&log_path)
        );
    }
    let mut text = String::new();
    File::open(&json_path)?.read_to_string(&mut text)?;
    // fio may put notes before the JSON document.
    let start = text
        .find('{')
        .with_context(|| format!("no JSON in fio output {}", json_path.display()))?;
    let parsed: FioOutput =
        serde_json::from_str(&text[start..]).context("parsing fio JSON output")?;
    let job = parsed
        .jobs
        .into_iter()
        .next()
        .context("fio JSON has no jobs")?;
    if job.error != 0 {
        bail!("fio {tag} job reported error {}", job.error);
    }
    Ok((job.read, job.write))
}

/// Runs `dedupd stats --json` against the serving store.
fn dedupd_stats(dedupd: &Path, store: &Path) -> anyhow::Result<Value> {
    let out = Command::new(dedupd)
        .arg("--store")
        .arg(store)
        .args(["stats", "--json"])
        .output()
        .context("running dedupd stats")?;
    if !out.status.success() {
        bail!(
            "dedupd stats failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout).context("parsing dedupd stats --json")
}

/// One measurement: fresh server, optional prefill, fio run, stats, stop.
fn measure(
    settings: &Settings,
    base: &Path,
    target: Target,
    workload: Workload,
    dup: u32,
    run_tag: &str,
) -> anyhow::Result<Sample> {
    // Short names: dedupd's control socket lives in the store and Unix socket paths are short.
    let short = match target {
        Target::Baseline => 'b',
        Target::Dedupd => 'd',
    };
    let dir = TempDir::new(base, &format!("{short}-{workload}-{dup}-{run_tag}"))?;
    let mut running = match target {
        Target::Baseline => start_nbdkit(dir.path(), settings.volume_bytes)?,
        Target::Dedupd => start_dedupd(&settings.dedupd, dir.path(), settings.volume_bytes)?,
    };
    let size = format!("--size={}", settings.region_bytes);
    let dedupe = [
        format!("--dedupe_percentage={dup}"),
        "--refill_buffers".to_string(),
    ];
    if workload == Workload::Randread {
        let mut args: Vec<String> = ["--rw=write", "--bs=1m", "--iodepth=4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push(size.clone());
        args.extend(dedupe.iter().cloned());
        let (_, w) = run_fio(dir.path(), &running.uri, "prefill", &args, PREFILL_TIMEOUT)?;
        if w.total_ios * (1 << 20) < settings.region_bytes {
            bail!(
                "prefill wrote only {} MiB of {} bytes",
                w.total_ios,
                settings.region_bytes
            );
        }
    }
    let mut args: Vec<String> = workload.fio_args().iter().map(|s| s.to_string()).collect();
    args.push(size);
    args.push("--time_based".into());
    // (the first second, connection and first touches, is not counted)
    args.push(format!("--ramp_time={RAMP_S}"));
    args.push(format!("--runtime={}", settings.runtime_s));
    if workload.is_write() {
        args.extend(dedupe.iter().cloned());
    }
    let (r, w) = run_fio(
        dir.path(),
        &running.uri,
        &workload.to_string(),
        &args,
        Duration::from_secs(settings.runtime_s + RAMP_S + 120),
    )?;
    let d = if workload.is_write() { w } else { r };
    let value = match workload.unit() {
        "IOPS" => d.iops,
        _ => d.bw_bytes as f64 / (1u64 << 20) as f64,
    };
    let mut sample = Sample {
        value,
        peak_rss_bytes: None,
        dup_eliminated_percent: None,
    };
    if let Some(store) = &running.store {
        // (a server gone by now would leave the store to the stats command
        // itself, whose figures are not the server's)
        if let Some(status) = running.guard.exited() {
            bail!("dedupd exited during the run ({status})");
        }
        let stats = dedupd_stats(&settings.dedupd, store)?;
        // (a figure missing, or a peak RSS of 0 (unread), is an error, not
        // a blank in the table)
        sample.peak_rss_bytes = Some(
            stats["peak_rss_bytes"]
                .as_u64()
                .filter(|&b| b > 0)
                .context("dedupd stats --json has no peak_rss_bytes (or 0)")?,
        );
        sample.dup_eliminated_percent = Some(
            stats["duplicate_writes_eliminated_percent"]
                .as_f64()
                .context("dedupd stats --json has no duplicate_writes_eliminated_percent")?,
        );
    }
    running.guard.stop(Duration::from_secs(120))?;
    Ok(sample)
}

fn fmt_value(v: f64, unit: &str) -> String {
    if v.is_nan() {
        "-".into()
    } else if unit == "IOPS" {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// dedupd ÷ baseline of each repeat's pair of runs (which ran back to
/// back), in repeat order.
pub fn pair_ratios(row: &Row) -> Vec<f64> {
    row.baseline
        .iter()
        .zip(&row.dedupd)
        .map(|(b, d)| d.value / b.value)
        .filter(|r| r.is_finite())
        .collect()
}

/// Renders the Markdown report.
pub fn report(header: &str, rows: &[Row]) -> String {
    let mut s = String::new();
    s.push_str(header);
    s.push_str(
        "\n| Workload | Dup % | Unit | Baseline (nbdkit file) median | dedupd median | Ratio (median of pairs) | Pair ratios | Target | Met | dedupd dup writes eliminated | dedupd peak RSS |\n",
    );
    s.push_str("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|\n");
    for row in rows {
        let unit = row.workload.unit();
        let b = median(&row.baseline.iter().map(|x| x.value).collect::<Vec<_>>());
        let d = median(&row.dedupd.iter().map(|x| x.value).collect::<Vec<_>>());
        let pairs = pair_ratios(row);
        let ratio = median(&pairs);
        let range = if pairs.is_empty() {
            "-".to_string()
        } else {
            let lo = pairs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = pairs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo:.2}–{hi:.2}x")
        };
        let target = row.workload.target(row.dup);
        let met = if ratio.is_finite() && ratio >= target {
            "yes"
        } else {
            "no"
        };
        let elim: Vec<f64> = row
            .dedupd
            .iter()
            .filter_map(|x| x.dup_eliminated_percent)
            .collect();
        let elim = if row.workload.is_write() && !elim.is_empty() {
            format!("{:.1}%", median(&elim))
        } else {
            "-".into()
        };
        let rss = row
            .dedupd
            .iter()
            .filter_map(|x| x.peak_rss_bytes)
            .max()
            .map(mib)
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.2}x | {} | ≥ {:.1}x | {} | {} | {} |",
            row.workload.label(),
            row.dup,
            unit,
            fmt_value(b, unit),
            fmt_value(d, unit),
            ratio,
            range,
            target,
            met,
            elim,
            rss
        );
    }
    s.push_str("\nRaw runs (baseline / dedupd, in repeat order; pair i is the i-th of each):\n\n");
    for row in rows {
        let list = |v: &[Sample]| {
            v.iter()
                .map(|x| fmt_value(x.value, row.workload.unit()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            s,
            "- {} dup {}%: baseline [{}] / dedupd [{}] {}",
            row.workload.label(),
            row.dup,
            list(&row.baseline),
            list(&row.dedupd),
            row.workload.unit()
        );
    }
    s
}

fn header(settings: &Settings) -> String {
    let date = command_output("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]);
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "?".into());
    let fio = command_output("fio", &["--version"]);
    let dir_fs = command_output("stat", &["-f", "-c", "%T", &settings.dir.to_string_lossy()]);
    let nbdkit = command_output("nbdkit", &["--version"]);
    let repo = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let rev = command_output("git", &["-C", repo, "rev-parse", "--short", "HEAD"]);
    let dirty = !command_output(
        "git",
        &["-C", repo, "status", "--porcelain", "--untracked-files=no"],
    )
    .is_empty();
    let mut s = String::new();
    s.push_str("# dedupd benchmark\n\n");
    let _ = writeln!(s, "- date: {date}");
    let _ = writeln!(s, "- nproc: {nproc} ({cpu})");
    let _ = writeln!(s, "- kernel: {kernel}");
    let _ = writeln!(s, "- fio: {fio}; nbdkit: {nbdkit}");
    let _ = writeln!(
        s,
        "- files under {} ({})",
        settings.dir.display(),
        if dir_fs.is_empty() { "?" } else { &dir_fs }
    );
    let _ = writeln!(
        s,
        "- dedupd: {} (git {}{})",
        settings.dedupd.display(),
        if rev.is_empty() { "?" } else { &rev },
        if dirty { ", uncommitted changes" } else { "" }
    );
    let _ = writeln!(
        s,
        "- fio ioengine=nbd over TCP 127.0.0.1, 1 job; region {}; volume/file {}; runtime {} s per run after {RAMP_S} s of ramp; {} repeat(s) per server, each a pair of runs back to back (baseline first in even repeats, dedupd first in odd ones) after one discarded warm-up pair; fresh server and store/file per run",
        mib(settings.region_bytes),
        mib(settings.volume_bytes),
        settings.runtime_s,
        settings.repeats
    );
    s.push_str(
        "- duplicates: fio dedupe_percentage with its default dedupe_mode=repeat (a duplicate buffer repeats an earlier one: for 1 MiB writes, 256 blocks in a row) and refill_buffers (0% means no duplicate blocks)\n",
    );
    s.push_str(
        "- ratio: the median over repeats of dedupd ÷ baseline of each pair, with the range of those pair ratios; peak RSS of the read rows includes their prefill\n",
    );
    s.push_str(
        "- random read runs follow a sequential 1 MiB write prefill of the region with the same dedupe_percentage\n",
    );
    s.push_str(
        "- targets: writes ≥ 0.9x baseline at 0% duplicates and ≥ 1.0x at ≥ 25%; reads ≥ 0.9x\n",
    );
    s
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let dedupd = cli.dedupd.clone().unwrap_or_else(|| {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/release/dedupd"
        ))
    });
    let settings = Settings {
        runtime_s: cli
            .runtime_s
            .unwrap_or(if cli.quick { 3 } else { 10 })
            .max(1),
        repeats: cli.repeats.unwrap_or(if cli.quick { 2 } else { 4 }).max(1),
        region_bytes: parse_size(cli.region.as_deref().unwrap_or(if cli.quick {
            "256M"
        } else {
            "1G"
        }))?,
        volume_bytes: parse_size(&cli.volume_size)?,
        dedupd: fs::canonicalize(&dedupd).unwrap_or(dedupd),
        dir: cli.dir.clone(),
    };
    if settings.region_bytes == 0
        || settings.region_bytes > settings.volume_bytes
        || !settings.region_bytes.is_multiple_of(1 << 20)
    {
        bail!("--region must be a non-zero multiple of 1 MiB no larger than --volume-size");
    }
    if let Some(bad) = cli.dup.iter().find(|d| **d > 100) {
        bail!("--dup {bad}: a percentage must be 0..=100");
    }
    check_prerequisites(&settings)?;
    let header = header(&settings);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.subsec_nanos();
    let base = TempDir::new(
        &cli.dir,
        &format!("dbench-{}-{nanos:x}", std::process::id()),
    )?;
    // one pair first, not counted: whichever server runs first meets the
    // machine's first touches of memory and files
    if let (Some(&workload), Some(&dup)) = (cli.workloads.first(), cli.dup.first()) {
        for target in [Target::Baseline, Target::Dedupd] {
            let sample = measure(&settings, base.path(), target, workload, dup, "warm-up")
                .with_context(|| format!("warm-up run of {}", target.name()))?;
            eprintln!(
                "[warm-up] {:<20} dup {dup:>3}% {:<12} {:>10} {} (not counted)",
                workload.label(),
                target.name(),
                fmt_value(sample.value, workload.unit()),
                workload.unit()
            );
        }
    }
    let total = cli.workloads.len() * cli.dup.len() * settings.repeats * 2;
    let mut done = 0;
    let mut rows = Vec::new();
    for &workload in &cli.workloads {
        for &dup in &cli.dup {
            let mut row = Row {
                workload,
                dup,
                baseline: Vec::new(),
                dedupd: Vec::new(),
            };
            for rep in 0..settings.repeats {
                // counterbalanced: baseline first in even repeats, dedupd
                // first in odd ones
                let order = if rep % 2 == 0 {
                    [Target::Baseline, Target::Dedupd]
                } else {
                    [Target::Dedupd, Target::Baseline]
                };
                for target in order {
                    done += 1;
                    let sample = measure(
                        &settings,
                        base.path(),
                        target,
                        workload,
                        dup,
                        &rep.to_string(),
                    )
                    .with_context(|| {
                        format!("{} {workload} dup {dup}% run {}", target.name(), rep + 1)
                    })?;
                    eprintln!(
                        "[{done}/{total}] {:<20} dup {dup:>3}% {:<12} {:>10} {}{}",
                        workload.label(),
                        target.name(),
                        fmt_value(sample.value, workload.unit()),
                        workload.unit(),
                        match (sample.dup_eliminated_percent, sample.peak_rss_bytes) {
                            (Some(e), Some(r)) =>
                                format!("  (dup eliminated {e:.1}%, peak RSS {})", mib(r)),
                            _ => String::new(),
                        }
                    );
                    match target {
                        Target::Baseline => row.baseline.push(sample),
                        Target::Dedupd => row.dedupd.push(sample),
                    }
                }
            }
            rows.push(row);
        }
    }
    let text = report(&header, &rows);
    println!("{text}");
    if let Some(out) = &cli.out {
        fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("dedupd-bench: wrote {}", out.display());
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("dedupd-bench: error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert!(parse_size("2X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn ratios_pair_the_runs_of_each_repeat() {
        let s = |value| Sample {
            value,
            peak_rss_bytes: None,
            dup_eliminated_percent: None,
        };
        let row = Row {
            workload: Workload::Randwrite,
            dup: 0,
            baseline: vec![s(100.0), s(50.0), s(80.0)],
            dedupd: vec![s(90.0), s(60.0), s(40.0)],
        };
        assert_eq!(pair_ratios(&row), [0.9, 1.2, 0.5]);
        // the median of the pairs' ratios, not the ratio of the medians
        assert_eq!(median(&pair_ratios(&row)), 0.9);
        assert_eq!(row.dedupd[1].value / row.baseline[2].value, 0.75);
    }

    #[test]
    fn targets() {
        assert_eq!(Workload::Randwrite.target(0), 0.9);
        assert_eq!(Workload::Seqwrite.target(25), 1.0);
        assert_eq!(Workload::Randread.target(75), 0.9);
    }
}
