//! Costs of the hybrid (inline + out-of-line) design, through the public
//! engine API on file-backed stores (`Engine::create` in a temporary
//! directory, so block data lives in a real file and a read-cache miss is a
//! real `pread`). Method and measured figures: `docs/bench-engine.md`.
//!
//! - `read_cache`: 4 KiB random reads of a 64 MiB volume whose 16384 LBAs
//!   share 256 distinct blocks, with the read cache on (4 MiB) and off (0).
//!   One store, filled once, reopened with each configuration.
//! - `out_of_line_pass`: one `dedup_pass` draining the skipped buffer after
//!   65536 block writes (50 % duplicates of random earlier blocks) under a
//!   64 KiB index budget, so inline dedup misses most duplicates. Throughput
//!   in blocks examined; user + system CPU time of the pass (getrusage,
//!   RUSAGE_THREAD) is printed to stderr.
//! - `foreground_write`: 4 KiB writes at random LBAs (50 % duplicates) while
//!   a large skipped backlog exists, with no out-of-line worker ("idle"),
//!   with `start_out_of_line` at the `serve` default rate ("busy"), and with
//!   a thread calling `dedup_pass(64)` at the same rate without the worker's
//!   back-off ("forced", what the worker would cost if it never paused),
//!   then "idle" once more, to show how much the machine drifted.
//!
//! Adaptive selectivity is off in every store (every block is fingerprinted
//! inline), so runs are deterministic whatever the power source and load.
//!
//! Run: `cargo bench -p dedupd-engine --bench hybrid` (about 1.5 minutes on 2 cores,
//! plus the build).

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use dedupd_engine::index::IndexConfig;
use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
use dedupd_engine::{Engine, EngineConfig, HashAlgorithm, VolumeId, BLOCK_SIZE};

const BLOCK: u64 = BLOCK_SIZE as u64;

/// Rate of the background worker in blocks/s: `dedupd serve`'s default
/// `--out-of-line-rate` (the default lives in the CLI, not in the engine).
const SERVE_DEFAULT_RATE: u64 = 20_000;
/// Name of the engine's background worker thread (`start_out_of_line`).
const WORKER_THREAD: &str = "dedupd-out-of-line";
/// Name of the bench's own pass thread in the "forced" variant.
const FORCED_THREAD: &str = "bench-forced-pass";

/// splitmix64: a small deterministic generator (no rand dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Fills `buf` (4 KiB) with the content numbered `id`: pseudo-random,
/// never all zeros, equal ids give equal blocks.
fn content(id: u64, buf: &mut [u8]) {
    let mut r = Rng(id.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5555);
    for w in buf.chunks_exact_mut(8) {
        w.copy_from_slice(&r.next().to_le_bytes());
    }
}

/// The base configuration: defaults, with selectivity fixed at 100 %.
fn config() -> EngineConfig {
    EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Ac,
        },
        ..EngineConfig::default()
    }
}

fn create(dir: &Path, cfg: EngineConfig, volume_bytes: u64) -> (Engine, VolumeId) {
    let e = Engine::create(&dir.join("store"), HashAlgorithm::Sha256, cfg).expect("create");
    let vol = e.create_volume("bench", volume_bytes).expect("volume");
    (e, vol)
}

/// Resource use of the calling thread so far.
#[derive(Clone, Copy)]
struct Usage {
    /// User + system CPU time.
    cpu: Duration,
    /// Blocks read from storage (512-byte units; page-cache hits excluded).
    inblock: i64,
    /// Voluntary context switches (waits: I/O, locks).
    voluntary: i64,
    /// Involuntary context switches (preempted: a busy shared machine).
    involuntary: i64,
}

fn thread_usage() -> Usage {
    // SAFETY: getrusage only writes the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Usage {
        cpu: tv(u.ru_utime) + tv(u.ru_stime),
        inblock: u.ru_inblock,
        voluntary: u.ru_nvcsw,
        involuntary: u.ru_nivcsw,
    }
}

/// User + system CPU time so far of this process's thread named `name`
/// (`/proc/self/task/*/comm`, which keeps the first 15 bytes of a name).
fn named_thread_cpu(name: &str) -> Option<Duration> {
    let short = &name[..name.len().min(15)];
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    for t in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != short {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
        // fields after "(comm)": state is field 3, utime 14, stime 15
        let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        return Some(Duration::from_nanos(ticks * 1_000_000_000 / tick));
    }
    None
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

// ---- 1. read cache -------------------------------------------------------

const RC_VOLUME: u64 = 64 << 20;
const RC_DISTINCT: u64 = 256;

fn read_cache(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let lbas = RC_VOLUME / BLOCK;
    {
        let (e, vol) = create(dir.path(), config(), RC_VOLUME);
        let mut rng = Rng(1);
        let chunk = 256u64; // 1 MiB writes
        let mut buf = vec![0u8; (chunk * BLOCK) as usize];
        for first in (0..lbas).step_by(chunk as usize) {
            for b in buf.chunks_exact_mut(BLOCK_SIZE) {
                content(rng.below(RC_DISTINCT), b);
            }
            e.write(vol, first * BLOCK, &buf, false).expect("write");
        }
        e.close().expect("close");
        let s = e.stats();
        eprintln!(
            "read_cache: {} LBAs over {} distinct blocks (dedup ratio {:.1})",
            lbas, s.physical_blocks_stored, s.dedup_ratio
        );
    }
    let mut rng = Rng(2);
    let order: Vec<u64> = (0..1 << 16).map(|_| rng.below(lbas)).collect();

    let mut g = c.benchmark_group("read_cache");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(BLOCK));
    for (name, bytes) in [("on 4MiB", 4u64 << 20), ("off", 0)] {
        let e = Engine::open(
            &dir.path().join("store"),
            EngineConfig {
                read_cache_bytes: bytes,
                ..config()
            },
        )
        .expect("open");
        let (vol, _) = e.volume("bench").expect("volume");
        let mut buf = vec![0u8; BLOCK_SIZE];
        let mut i = 0usize;
        g.bench_function(format!("4KiB random read, cache {name}"), |b| {
            b.iter(|| {
                let lba = order[i % order.len()];
                i += 1;
                e.read(vol, lba * BLOCK, &mut buf).expect("read");
            })
        });
        let s = e.stats().read_cache;
        eprintln!(
            "read_cache {name}: {} hits, {} misses ({:.1} % hits), {} B of {} B used",
            s.hits,
            s.misses,
            100.0 * s.hits as f64 / (s.hits + s.misses).max(1) as f64,
            s.used_bytes,
            s.capacity_bytes
        );
        drop(e);
    }
    g.finish();
}

// ---- 2. out-of-line pass -------------------------------------------------

const OOL_BLOCKS: u64 = 65536;
const OOL_REQUEST: u64 = 64; // blocks per write (256 KiB)
const OOL_INDEX_BUDGET: u64 = 64 << 10;

/// Writes `OOL_BLOCKS` blocks sequentially; after the first request each
/// block is, with probability 1/2, a copy of a random block of an earlier
/// request (never of its own request, where inline dedup always finds it).
fn ool_store(dir: &Path) -> Engine {
    let cfg = EngineConfig {
        index: IndexConfig {
            memory_budget_bytes: OOL_INDEX_BUDGET,
            ..IndexConfig::default()
        },
        // 16 B a record: room for every block, so nothing degrades to regions
        skipped_buffer_bytes: (OOL_BLOCKS * 32) as usize,
        ..config()
    };
    let (e, vol) = create(dir, cfg, OOL_BLOCKS * BLOCK);
    fill_half_duplicates(&e, vol, OOL_BLOCKS, OOL_REQUEST, 3);
    e
}

/// Writes LBAs `0..blocks` of `vol` in requests of `request_blocks`, each
/// block with a 1 in 2 chance of copying a random block of an earlier
/// request (new content otherwise), then flushes. Returns the number of
/// distinct contents written.
fn fill_half_duplicates(
    e: &Engine,
    vol: VolumeId,
    blocks: u64,
    request_blocks: u64,
    seed: u64,
) -> u64 {
    let mut rng = Rng(seed);
    let mut unique = 0u64;
    let mut buf = vec![0u8; (request_blocks * BLOCK) as usize];
    for first in (0..blocks).step_by(request_blocks as usize) {
        let before = unique;
        for b in buf.chunks_exact_mut(BLOCK_SIZE) {
            let id = if before > 0 && rng.below(2) == 0 {
                rng.below(before)
            } else {
                unique += 1;
                unique - 1
            };
            content(id, b);
        }
        e.write(vol, first * BLOCK, &buf, false).expect("write");
    }
    e.flush().expect("flush");
    unique
}

fn out_of_line_pass(c: &mut Criterion) {
    // a first run: how many blocks one pass examines (the same every run)
    let examined = {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = ool_store(dir.path());
        let s = e.stats();
        let t = Instant::now();
        let r = e.dedup_pass(usize::MAX).expect("pass");
        eprintln!(
            "out_of_line_pass: {} blocks written, {} duplicates found inline, {} skipped records, \
             {} degradations; pass: {:?} examined {}, hashed {}, remapped {}, merges {}, work left {}",
            s.blocks_written,
            s.duplicate_writes_eliminated,
            s.skipped.records,
            s.skipped.degradations,
            t.elapsed(),
            r.blocks_examined,
            r.blocks_hashed,
            r.lbas_remapped,
            r.merges_applied,
            r.work_remaining
        );
        r.blocks_examined
    };
    // per timed pass: (wall ns, CPU ns, inblock, voluntary, involuntary)
    let passes: RefCell<Vec<[f64; 5]>> = RefCell::new(Vec::new());

    let mut g = c.benchmark_group("out_of_line_pass");
    // each iteration needs a fresh store (seconds to build, untimed): one
    // iteration per sample, one for warm-up (criterion warns that 10 samples
    // do not fit in the tiny target time; that is intended)
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_millis(1))
        .throughput(Throughput::Elements(examined));
    g.bench_function("dedup_pass (blocks examined)", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let dir = tempfile::tempdir().expect("tempdir");
                let e = ool_store(dir.path());
                let u0 = thread_usage();
                let t = Instant::now();
                let r = e.dedup_pass(usize::MAX).expect("pass");
                let wall = t.elapsed();
                let u1 = thread_usage();
                total += wall;
                assert_eq!(
                    r.blocks_examined, examined,
                    "a pass examines the same blocks"
                );
                passes.borrow_mut().push([
                    wall.as_nanos() as f64,
                    (u1.cpu - u0.cpu).as_nanos() as f64,
                    (u1.inblock - u0.inblock) as f64,
                    (u1.voluntary - u0.voluntary) as f64,
                    (u1.involuntary - u0.involuntary) as f64,
                ]);
            }
            total
        })
    });
    g.finish();
    let passes = passes.into_inner();
    if passes.is_empty() {
        return; // filtered out on the command line
    }
    let col = |k: usize| {
        let mut v: Vec<f64> = passes.iter().map(|p| p[k]).collect();
        let m = median(&mut v);
        (m, v[0], v[v.len() - 1])
    };
    let per_block = |(m, lo, hi): (f64, f64, f64)| {
        let x = examined as f64 * 1000.0;
        (m / x, lo / x, hi / x)
    };
    let (wall, cpu) = (per_block(col(0)), per_block(col(1)));
    eprintln!(
        "out_of_line_pass: {} timed passes of {examined} blocks; per block examined: \
         wall median {:.2} µs (min {:.2}, max {:.2}); user+system CPU (RUSAGE_THREAD) \
         median {:.2} µs (min {:.2}, max {:.2}); per pass, medians: {} blocks read from storage, \
         {} voluntary and {} involuntary context switches",
        passes.len(),
        wall.0,
        wall.1,
        wall.2,
        cpu.0,
        cpu.1,
        cpu.2,
        col(2).0,
        col(3).0,
        col(4).0
    );
}

// ---- 3. foreground writes with the worker busy or idle -----------------------

const FG_VOLUME: u64 = 512 << 20;

/// A store whose volume is fully written (1 MiB writes, 50 % duplicates),
/// leaving one skipped record per stored block: the backlog.
fn fg_store(dir: &Path) -> (Arc<Engine>, VolumeId, u64) {
    let cfg = EngineConfig {
        skipped_buffer_bytes: 4 << 20, // 262144 records
        ..config()
    };
    let (e, vol) = create(dir, cfg, FG_VOLUME);
    let unique = fill_half_duplicates(&e, vol, FG_VOLUME / BLOCK, 256, 4);
    (Arc::new(e), vol, unique)
}

fn foreground_write(c: &mut Criterion) {
    let mut g = c.benchmark_group("foreground_write");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(6))
        .throughput(Throughput::Bytes(BLOCK));
    // "idle again" repeats the first variant last: its distance from "idle"
    // shows how much the machine drifted during the group
    for variant in ["idle", "busy", "forced", "idle again"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (e, vol, mut unique) = fg_store(dir.path());
        let before = e.stats().skipped;
        let stop = Arc::new(AtomicBool::new(false));
        let forced_examined = Arc::new(AtomicU64::new(0));
        let worker = (variant == "busy").then(|| e.start_out_of_line(SERVE_DEFAULT_RATE));
        let forced = (variant == "forced").then(|| {
            let (e, stop, n) = (e.clone(), stop.clone(), forced_examined.clone());
            std::thread::Builder::new()
                .name(FORCED_THREAD.into())
                .spawn(move || {
                    // the worker's loop without its back-off: 64 blocks per period
                    let period = Duration::from_secs_f64(64.0 / SERVE_DEFAULT_RATE as f64);
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        let r = e.dedup_pass(64).expect("pass");
                        n.fetch_add(r.blocks_examined, Ordering::Relaxed);
                        if let Some(left) = period.checked_sub(t.elapsed()) {
                            std::thread::sleep(left);
                        }
                    }
                })
                .expect("spawn")
        });
        // let the background thread get going on the backlog first
        if !variant.starts_with("idle") {
            std::thread::sleep(Duration::from_millis(500));
        }
        let thread_name = if variant == "busy" {
            WORKER_THREAD
        } else {
            FORCED_THREAD
        };
        let cpu0 = named_thread_cpu(thread_name);
        let mut rng = Rng(5);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let lbas = FG_VOLUME / BLOCK;
        let started = Instant::now();
        g.bench_function(format!("4KiB random write, worker {variant}"), |b| {
            b.iter(|| {
                let id = if rng.below(2) == 0 {
                    rng.below(unique)
                } else {
                    unique += 1;
                    unique - 1
                };
                content(id, &mut buf);
                e.write(vol, rng.below(lbas) * BLOCK, &buf, false)
                    .expect("write");
            })
        });
        let elapsed = started.elapsed();
        let cpu = named_thread_cpu(thread_name)
            .zip(cpu0)
            .map_or(0.0, |(a, b)| (a - b).as_secs_f64());
        stop.store(true, Ordering::Relaxed);
        drop(worker);
        if let Some(t) = forced {
            t.join().expect("forced pass thread");
        }
        let after = e.stats().skipped;
        eprintln!(
            "foreground_write {variant}: skipped buffer records/regions/volumes {}/{}/{} -> \
             {}/{}/{} ({} degradations); in {:.1} s of warm-up + measurement the background \
             thread used {:.2} s CPU (forced passes examined {} blocks)",
            before.records,
            before.regions,
            before.volumes,
            after.records,
            after.regions,
            after.volumes,
            after.degradations,
            elapsed.as_secs_f64(),
            cpu,
            forced_examined.load(Ordering::Relaxed),
        );
    }
    g.finish();
}

criterion_group!(benches, read_cache, out_of_line_pass, foreground_write);
criterion_main!(benches);
