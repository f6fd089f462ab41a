//! Speed of the replay path: a native trace replayed through the engine
//! with G-LRU and an 8 MiB index budget (throughput in requests), twice:
//! 200 000 requests, whose 100 000 distinct fingerprints fit in the budget,
//! and 2 000 000 requests, whose million do not (groups are evicted to the
//! on-disk store and read back: the steady state of a long trace); FIU
//! text parsing (throughput in lines) and native parsing (requests). Run: `cargo bench -p dedupd-sim`.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dedupd_sim::gen::{GenSpec, Locality, StreamSpec};
use dedupd_sim::{replay, Format, ReplayConfig, Request, TraceReader};

const REQUESTS: u64 = 200_000;
const REQUESTS_EVICTING: u64 = 2_000_000;
const FIU_LINES: u64 = 200_000;

fn native_trace(dir: &Path, requests: u64) -> std::path::PathBuf {
    let path = dir.join(format!("bench-{requests}.ddt"));
    let spec = GenSpec {
        streams: vec![StreamSpec {
            locality: Locality::Good {
                mean_reuse_blocks: 20_000.0,
            },
            share: 1,
            name: "good".into(),
        }],
        size_bytes: requests * 4096,
        block_bytes: 4096,
        volume_bytes: 64 << 30,
        sequential: true,
        dup_percent: 50.0,
        copy_runs: false,
        seed: 1,
    };
    dedupd_sim::generate(&spec, &path).expect("generate");
    path
}

/// FIU IODedup lines: one 4 KiB write each, pids and digests varied.
fn fiu_trace(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("bench.blkparse");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    for i in 0..FIU_LINES {
        let d = (i % 50_000).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        writeln!(
            f,
            "{} {} proc{} {} 8 W 6 0 {:016x}{:016x}",
            1_000_000 + i * 1000,
            1000 + i % 7,
            i % 7,
            (i * 8) % (1 << 30),
            d,
            !d
        )
        .expect("write");
    }
    f.flush().expect("flush");
    path
}

/// Parses the whole trace at `path`, returning its number of requests.
fn parse_all(path: &Path, format: Format) -> u64 {
    let mut r =
        TraceReader::open(path, Some(format), false, Arc::new(AtomicU64::new(0))).expect("open");
    let mut req = Request::default();
    let mut n = 0u64;
    while r.next_into(&mut req).expect("parse") {
        n += 1;
    }
    n
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let native = native_trace(dir.path(), REQUESTS);
    let evicting = native_trace(dir.path(), REQUESTS_EVICTING);
    let fiu = fiu_trace(dir.path());

    let mut g = c.benchmark_group("replay");
    g.sample_size(10);
    g.throughput(Throughput::Elements(REQUESTS));
    let cfg = ReplayConfig {
        policy: "g-lru".into(),
        index_memory_bytes: Some(8 << 20),
        ..ReplayConfig::default()
    };
    g.bench_function("native g-lru 8MiB (requests)", |b| {
        b.iter(|| {
            let r = replay(std::slice::from_ref(&native), &cfg, &mut |_| {}).expect("replay");
            assert_eq!(r.requests, REQUESTS);
        })
    });
    g.throughput(Throughput::Elements(REQUESTS_EVICTING));
    g.bench_function("native g-lru 8MiB evicting (requests)", |b| {
        b.iter(|| {
            let r = replay(std::slice::from_ref(&evicting), &cfg, &mut |_| {}).expect("replay");
            assert_eq!(r.requests, REQUESTS_EVICTING);
            assert!(
                r.engine.index.groups_evicted > 0,
                "the budget was not exceeded"
            );
        })
    });
    g.finish();

    let mut g = c.benchmark_group("parse");
    g.sample_size(10);
    g.throughput(Throughput::Elements(FIU_LINES));
    g.bench_function("fiu text (lines)", |b| {
        b.iter(|| assert_eq!(parse_all(&fiu, Format::Fiu), FIU_LINES))
    });
    g.throughput(Throughput::Elements(REQUESTS_EVICTING));
    g.bench_function("native (requests)", |b| {
        b.iter(|| assert_eq!(parse_all(&evicting, Format::Native), REQUESTS_EVICTING))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
