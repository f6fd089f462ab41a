//! Memory of an open store as it grows: what stays resident per stored
//! block once the metadata caches are bounded (SmartDedup §3.2 keeps a
//! fixed in-memory budget; the target is ≤ 0.1 byte per stored block
//! outside the configured budgets).
//!
//! For each size, a fresh file-backed store (`Engine::create` in a
//! temporary directory) with 1 MiB reverse-index and map caches and the
//! default 8 MiB index budget receives `2 × N` block writes through
//! `write_fingerprinted` (the dedup path without hashing; half the blocks
//! repeat an earlier one; with inline misses under the index budget, more
//! than `N` are stored), in requests of 256 blocks with a FLUSH after every
//! 64 requests, then a flush and a checkpoint (no dirty or pinned pages
//! left).
//! It prints the engine's own accounting (`dedupd stats`:
//! `metadata_bytes_in_memory`, `index_bytes_in_memory`, the caches'
//! resident bytes) and the slope between consecutive sizes: the bytes that
//! grow with the store, which no budget bounds.
//!
//! Run: `cargo bench -p dedupd-engine --bench memory` (about a minute).
//! Method and figures: `docs/bench-engine.md`.

use dedupd_engine::fingerprint::Fingerprint;
use dedupd_engine::{Engine, EngineConfig, HashAlgorithm, Lba};

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fingerprint(k: u64) -> Fingerprint {
    let mut b = [0u8; 32];
    for (i, c) in b.chunks_mut(8).enumerate() {
        c.copy_from_slice(&mix(k * 4 + i as u64).to_le_bytes());
    }
    Fingerprint(b)
}

struct Row {
    stored: u64,
    total: u64,
}

fn measure(n: u64) -> Row {
    let dir = tempfile::tempdir().expect("temporary directory");
    let cfg = EngineConfig {
        reverse_index_cache_bytes: 1 << 20,
        map_cache_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let e = Engine::create(&dir.path().join("s"), HashAlgorithm::Sha256, cfg).expect("store");
    let v = e.create_volume("v", 2 * n * 4096).expect("volume");
    let mut next_new = 0u64;
    let mut lba = 0u64;
    while lba < 2 * n {
        let fps: Vec<Option<Fingerprint>> = (0..256)
            .map(|i| {
                let r = mix(lba + i + (1 << 40));
                if r.is_multiple_of(2) && next_new > 0 {
                    Some(fingerprint(r % next_new))
                } else {
                    next_new += 1;
                    Some(fingerprint(next_new - 1))
                }
            })
            .collect();
        e.write_fingerprinted(v, Lba(lba), &fps).expect("write");
        lba += 256;
        if lba.is_multiple_of(64 * 256) {
            // a client's periodic FLUSH (this path does not commit by itself)
            e.flush().expect("flush");
        }
    }
    e.flush().expect("flush");
    e.checkpoint().expect("checkpoint");
    let s = e.stats();
    let total = s.metadata_bytes_in_memory + s.index_bytes_in_memory;
    println!(
        "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        n * 2,
        s.physical_blocks_stored,
        s.map_cache.resident_bytes as f64 / 1e6,
        s.reverse_index.resident_bytes as f64 / 1e6,
        s.index_bytes_in_memory as f64 / 1e6,
        s.skipped.used_bytes as f64 / 1e6,
        s.metadata_bytes_in_memory.saturating_sub(
            s.map_cache.resident_bytes + s.reverse_index.resident_bytes + s.skipped.used_bytes
        ) as f64
            / 1e6,
        total as f64 / 1e6,
        total as f64 / s.physical_blocks_stored as f64,
    );
    Row {
        stored: s.physical_blocks_stored,
        total,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once small
    let quick = !std::env::args().any(|a| a == "--bench");
    let sizes: &[u64] = if quick {
        &[1 << 12, 1 << 13]
    } else {
        &[1 << 18, 1 << 21, 1 << 23]
    };
    println!("| LBAs written | blocks stored | maps + refcounts cache MB | reverse-index cache MB | index MB | skipped buffer MB | page tables, free lists, other MB | total MB | total bytes per stored block |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let rows: Vec<Row> = sizes.iter().map(|&n| measure(n)).collect();
    for w in rows.windows(2) {
        let slope = (w[1].total as f64 - w[0].total as f64) / (w[1].stored - w[0].stored) as f64;
        println!(
            "growth from {} to {} stored blocks: {slope:.3} bytes per added stored block",
            w[0].stored, w[1].stored
        );
    }
}
