//! Fingerprinting cost per 4 KiB block: SHA-256 against BLAKE3, the two
//! algorithms a store can be created with (`dedupd init --hash`).
//!
//! Inline dedup hashes every block a client writes before it is placed
//! (SmartDedup §3.1), so on a CPU-bound machine the algorithm bounds the
//! write throughput of non-duplicate data: the figure to compare is
//! bytes per second per core, reported by criterion as throughput.
//!
//! ```sh
//! cargo bench -p dedupd-engine --bench fingerprint
//! ```

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dedupd_engine::fingerprint::HashAlgorithm;

/// Bytes hashed per iteration: one 4 KiB block, or a 1 MiB request of 256
/// blocks hashed one by one as the write path does.
const SIZES: [usize; 2] = [4096, 1 << 20];

fn fingerprint(c: &mut Criterion) {
    // fixed pseudo-random content: neither algorithm's speed depends on it
    let data: Vec<u8> = (0..1u64 << 20)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect();
    let mut g = c.benchmark_group("fingerprint");
    for size in SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        for alg in [HashAlgorithm::Sha256, HashAlgorithm::Blake3] {
            g.bench_with_input(BenchmarkId::new(alg.name(), size), &size, |b, &size| {
                b.iter(|| {
                    let mut acc = 0u8;
                    for block in data[..size].chunks_exact(4096) {
                        acc ^= alg.fingerprint(std::hint::black_box(block)).0[0];
                    }
                    acc
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
