//! Property tests: random write/overwrite/trim/read/flush/reopen sequences
//! over several volumes, compared with a plain in-memory model of the
//! volumes' bytes; after each sequence the metadata invariants hold
//! (reference count = mapping LBAs, no referenced block free, every stored
//! block indexed) and freed blocks are reused.

use dedupd_engine::index::{EvictionPolicy, IndexConfig, LookupMode};
use dedupd_engine::{Engine, EngineConfig, HashAlgorithm, VolumeId, BLOCK_SIZE};

/// Index configurations the model runs under: the default (everything fits
/// in memory), a 4 KiB budget with 256 groups in each lookup mode and
/// eviction policy, the default with a sequence threshold of 3, and the
/// default with CAFTL's pre-hashing and sampling.
fn config(which: u8) -> EngineConfig {
    let tiny = |policy, lookup| IndexConfig {
        memory_budget_bytes: 4096,
        policy,
        lookup,
        prefix_bits: 8,
    };
    let index = match which {
        0 => IndexConfig::default(),
        1 => tiny(EvictionPolicy::GroupLru, LookupMode::Disk),
        2 => tiny(EvictionPolicy::Lru, LookupMode::Disk),
        4 => tiny(EvictionPolicy::Lfu, LookupMode::Disk),
        5 => tiny(EvictionPolicy::Arc, LookupMode::Disk),
        6 => tiny(EvictionPolicy::RefCount, LookupMode::Disk),
        7 | 8 => IndexConfig::default(),
        _ => tiny(EvictionPolicy::GroupLru, LookupMode::Memory),
    };
    EngineConfig {
        index,
        // the sequence threshold changes which duplicates are shared, never
        // what reads return
        sequence_threshold_blocks: if which == 7 { 3 } else { 1 },
        // CAFTL's filters leave blocks unhashed for the out-of-line pass
        prehash_bytes: if which == 8 { 4096 } else { 0 },
        // the tiny-budget configurations also page the reverse index
        // through a one-page cache
        reverse_index_cache_bytes: if (1..=6).contains(&which) {
            4064
        } else {
            16 << 20
        },
        // and the volume maps and reference counts through a one-page cache
        map_cache_bytes: if (1..=6).contains(&which) {
            4064
        } else {
            16 << 20
        },
        sampling: which == 8,
        ..EngineConfig::default()
    }
}
use proptest::prelude::*;

const VOLUMES: usize = 3;
const VOLUME_BLOCKS: u64 = 48;

#[derive(Debug, Clone)]
enum Action {
    /// Whole blocks: volume, first LBA, contents (pattern ids; 0 = zeros).
    Write(usize, u64, Vec<u8>),
    /// Unaligned bytes: volume, byte offset, length, fill byte.
    WriteBytes(usize, u64, usize, u8),
    Trim(usize, u64, u64),
    Read(usize, u64, usize),
    Flush,
    Reopen,
}

fn action() -> impl Strategy<Value = Action> {
    let vol = 0..VOLUMES;
    prop_oneof![
        6 => (vol.clone(), 0..VOLUME_BLOCKS, proptest::collection::vec(0u8..6, 1..8)).prop_map(|(v, l, p)| Action::Write(v, l, p)),
        2 => (vol.clone(), 0..VOLUME_BLOCKS * 4096, 1usize..9000, any::<u8>()).prop_map(|(v, o, n, b)| Action::WriteBytes(v, o, n, b)),
        2 => (vol.clone(), 0..VOLUME_BLOCKS * 4096, 1u64..20000).prop_map(|(v, o, n)| Action::Trim(v, o, n)),
        2 => (vol.clone(), 0..VOLUME_BLOCKS * 4096, 1usize..20000).prop_map(|(v, o, n)| Action::Read(v, o, n)),
        1 => Just(Action::Flush),
        1 => Just(Action::Reopen),
    ]
}

fn pattern(id: u8) -> Vec<u8> {
    if id == 0 {
        return vec![0; BLOCK_SIZE];
    }
    (0..BLOCK_SIZE)
        .map(|i| (i as u8).wrapping_mul(id).wrapping_add(id))
        .collect()
}

fn clamp(off: u64, len: u64) -> u64 {
    len.min(VOLUME_BLOCKS * 4096 - off)
}

proptest! {
    // (about 32 cases for each of the 9 configurations)
    #![proptest_config(ProptestConfig { cases: 288, ..ProptestConfig::default() })]
    #[test]
    fn engine_matches_model(actions in proptest::collection::vec(action(), 1..60), which in 0u8..9) {
        let cfg = config(which);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let mut engine = Engine::create(&path, HashAlgorithm::Sha256, cfg.clone()).unwrap();
        let mut ids: Vec<VolumeId> = Vec::new();
        for v in 0..VOLUMES {
            ids.push(engine.create_volume(&format!("v{v}"), VOLUME_BLOCKS * 4096).unwrap());
        }
        let mut model = vec![vec![0u8; (VOLUME_BLOCKS * 4096) as usize]; VOLUMES];
        for a in actions {
            match a {
                Action::Write(v, lba, pats) => {
                    let n = (pats.len() as u64).min(VOLUME_BLOCKS - lba) as usize;
                    let data: Vec<u8> = pats[..n].iter().flat_map(|&p| pattern(p)).collect();
                    engine.write(ids[v], lba * 4096, &data, false).unwrap();
                    model[v][(lba * 4096) as usize..(lba * 4096) as usize + data.len()].copy_from_slice(&data);
                }
                Action::WriteBytes(v, off, n, b) => {
                    let n = clamp(off, n as u64) as usize;
                    let data = vec![b; n];
                    engine.write(ids[v], off, &data, false).unwrap();
                    model[v][off as usize..off as usize + n].copy_from_slice(&data);
                }
                Action::Trim(v, off, n) => {
                    let n = clamp(off, n);
                    engine.trim(ids[v], off, n, false).unwrap();
                    model[v][off as usize..(off + n) as usize].fill(0);
                }
                Action::Read(v, off, n) => {
                    let n = clamp(off, n as u64) as usize;
                    let mut buf = vec![0xEEu8; n];
                    engine.read(ids[v], off, &mut buf).unwrap();
                    prop_assert!(buf == model[v][off as usize..off as usize + n], "read mismatch");
                }
                Action::Flush => engine.flush().unwrap(),
                Action::Reopen => {
                    engine.close().unwrap();
                    drop(engine);
                    engine = Engine::open(&path, cfg.clone()).unwrap();
                }
            }
            let errs = engine.check();
            prop_assert!(errs.is_empty(), "invariants violated: {:?}", errs);
        }
        for (v, id) in ids.iter().enumerate() {
            let mut buf = vec![0u8; model[v].len()];
            engine.read(*id, 0, &mut buf).unwrap();
            prop_assert!(buf == model[v], "volume {} differs from the model", v);
        }
        // each volume's mapped bytes: its non-zero blocks (zero blocks are
        // never stored, trimmed ones unmapped)
        let listed = engine.volumes();
        for (v, id) in ids.iter().enumerate() {
            let nonzero = model[v].chunks(BLOCK_SIZE).filter(|b| b.iter().any(|&x| x != 0)).count() as u64;
            let info = listed.iter().find(|i| i.id == *id).unwrap();
            prop_assert_eq!(info.mapped_bytes, nonzero * 4096, "volume {} mapped bytes", v);
        }
        // physical blocks = distinct non-zero 4 KiB contents over all volumes
        let mut distinct = std::collections::HashSet::new();
        for m in &model {
            for b in m.chunks(BLOCK_SIZE) {
                if b.iter().any(|&x| x != 0) {
                    distinct.insert(b.to_vec());
                }
            }
        }
        let s = engine.stats();
        if which == 7 || which == 8 {
            // the sequence threshold keeps short runs of duplicates apart;
            // CAFTL's filters skip some duplicates inline
            prop_assert!(s.physical_blocks_stored >= distinct.len() as u64);
        } else if which != 3 {
            // the unbounded index, or disk lookups: every duplicate is found
            prop_assert_eq!(s.physical_blocks_stored, distinct.len() as u64);
        } else {
            // memory-only lookups under a tiny budget may miss some
            prop_assert!(s.physical_blocks_stored >= distinct.len() as u64);
        }
        // out-of-line dedup makes it exact, whatever the budget; duplicates
        // the sequence threshold kept apart take a full pass
        if which == 7 {
            engine.dedup_offline(None, &mut |_, _| {}).unwrap();
        }
        for _ in 0..1000 {
            if !engine.dedup_pass(256).unwrap().work_remaining {
                break;
            }
        }
        let s = engine.stats();
        prop_assert_eq!(s.physical_blocks_stored, distinct.len() as u64, "not exact after out-of-line dedup");
        prop_assert!(engine.check().is_empty(), "{:?}", engine.check());
        for (v, id) in ids.iter().enumerate() {
            let mut buf = vec![0u8; model[v].len()];
            engine.read(*id, 0, &mut buf).unwrap();
            prop_assert!(buf == model[v], "volume {} differs after out-of-line dedup", v);
        }
        // freed blocks are reused: after a flush, new unique data fits in the free blocks
        engine.flush().unwrap();
        let s = engine.stats();
        let high_water = s.data_file_bytes;
        let k = s.free_blocks.min(VOLUME_BLOCKS);
        for lba in 0..k {
            let mut blk = vec![0u8; BLOCK_SIZE];
            blk[..8].copy_from_slice(&(0xABCD_0000u64 + lba).to_le_bytes());
            blk[100] = 1;
            engine.write(ids[0], lba * 4096, &blk, false).unwrap();
        }
        prop_assert_eq!(engine.stats().data_file_bytes, high_water, "free blocks were not reused");
        prop_assert!(engine.check().is_empty());
    }
}

#[test]
fn dedup_across_volumes_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    {
        let e = Engine::create(&path, HashAlgorithm::Blake3, EngineConfig::default()).unwrap();
        let a = e.create_volume("a", 1 << 20).unwrap();
        let b = e.create_volume("b", 1 << 20).unwrap();
        let data: Vec<u8> = (0..64 * 1024).map(|i| (i / 4096) as u8 + 1).collect();
        e.write(a, 0, &data, false).unwrap();
        e.write(b, 64 * 1024, &data, true).unwrap();
        let s = e.stats();
        assert_eq!(s.physical_blocks_stored, 16);
        assert_eq!(s.logical_bytes_mapped, 2 * 64 * 1024);
        assert_eq!(s.duplicate_writes_eliminated, 16);
        assert!((s.dedup_ratio - 2.0).abs() < 1e-9);
        // no close: the FUA write made everything durable through the journal
        std::mem::forget(e);
    }
    // the forgotten engine still holds the lock file descriptor in this process;
    // flock locks belong to the open file description, so a new open conflicts.
    // Re-open through a child-free path: drop happens at process exit, so test
    // the journal replay on a copy of the directory instead.
    let copy = dir.path().join("copy");
    std::fs::create_dir_all(copy.join("maps")).unwrap();
    for entry in walk(&path) {
        let rel = entry.strip_prefix(&path).unwrap();
        if rel.to_str() != Some("lock") {
            std::fs::copy(&entry, copy.join(rel)).unwrap();
        }
    }
    let e = Engine::open(&copy, EngineConfig::default()).unwrap();
    let (b, _) = e.volume("b").unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    e.read(b, 64 * 1024, &mut buf).unwrap();
    assert!(buf
        .iter()
        .enumerate()
        .all(|(i, &x)| x == (i / 4096) as u8 + 1));
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, 16);
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap().flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn volume_lifecycle_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::create(
        &dir.path().join("s"),
        HashAlgorithm::Sha256,
        EngineConfig::default(),
    )
    .unwrap();
    assert!(e.create_volume("bad name", 4096).is_err());
    assert!(e.create_volume("x", 4095).is_err());
    let x = e.create_volume("x", 8192).unwrap();
    assert!(e.create_volume("x", 8192).is_err());
    assert!(e.write(x, 8190, &[1, 2, 3], false).is_err());
    assert!(e.read(x, u64::MAX - 1, &mut [0u8; 4]).is_err());
    e.write(x, 4096, &[7u8; 4096], false).unwrap();
    e.resize_volume("x", 4096).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 0);
    e.resize_volume("x", 1 << 30).unwrap();
    let mut b = [1u8; 4096];
    e.read(x, 4096, &mut b).unwrap();
    assert!(b.iter().all(|&v| v == 0));
    e.delete_volume("x").unwrap();
    assert!(e.delete_volume("x").is_err());
    assert!(e.volumes().is_empty());
    assert!(e.check().is_empty());
}

#[test]
fn simulated_engine_dedups_by_fingerprint() {
    use dedupd_engine::{Fingerprint, Lba};
    let e = Engine::simulated(HashAlgorithm::Sha256);
    let v = e.create_volume("trace", 1 << 30).unwrap();
    let a = Some(Fingerprint::from_digest(&[1u8; 16]));
    let b = Some(Fingerprint::from_digest(&[2u8; 16]));
    e.write_fingerprinted(v, Lba(0), &[a, b, a, None]).unwrap();
    e.write_fingerprinted(v, Lba(10), &[b]).unwrap();
    let s = e.stats();
    assert_eq!(s.blocks_written, 5);
    assert_eq!(s.zero_blocks_written, 1);
    assert_eq!(s.duplicate_writes_eliminated, 2);
    assert_eq!(s.physical_blocks_stored, 2);
    assert_eq!(s.logical_bytes_mapped, 4 * 4096);
    assert!(e
        .write_fingerprinted(v, Lba((1 << 30) / 4096), &[a])
        .is_err());
    assert!(e.check().is_empty());
}

#[test]
fn out_of_line_dedup_finds_what_a_tiny_memory_budget_missed() {
    let cfg = config(3); // 4 KiB budget, memory-only lookups
    let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
    let a = e.create_volume("a", 64 << 20).unwrap();
    let b = e.create_volume("b", 64 << 20).unwrap();
    let n = 3000u64;
    let blk = |i: u64| {
        let mut x = vec![7u8; BLOCK_SIZE];
        x[..8].copy_from_slice(&i.to_le_bytes());
        x
    };
    for i in 0..n {
        e.write(a, i * 4096, &blk(i), false).unwrap();
    }
    for i in 0..n {
        e.write(b, i * 4096, &blk(i), false).unwrap();
    }
    // a third volume deduplicating onto copies inline dedup made in b
    let c = e.create_volume("c", 64 << 20).unwrap();
    for i in 0..n {
        e.write(c, i * 4096, &blk(i), false).unwrap();
    }
    let before = e.stats();
    assert!(
        before.physical_blocks_stored > n + n / 2,
        "the tiny budget should miss most duplicates: {}",
        before.physical_blocks_stored
    );
    let mut passes = 0;
    while e.dedup_pass(500).unwrap().work_remaining {
        passes += 1;
        assert!(passes < 10_000);
    }
    e.flush().unwrap();
    let after = e.stats();
    // the passes' totals, and their CPU cost
    let ol = after.out_of_line;
    assert!(ol.passes > passes as u64);
    assert!(ol.blocks_examined >= 2 * n);
    assert!(ol.lbas_remapped > 0);
    assert!(ol.cpu_seconds > 0.0 && ol.cpu_us_per_block > 0.0, "{ol:?}");
    assert_eq!(
        after.physical_blocks_stored, n,
        "out-of-line dedup is not exact"
    );
    // each copy freed counted once, however many LBAs shared it
    assert_eq!(
        after.out_of_line_duplicates - before.out_of_line_duplicates,
        before.physical_blocks_stored - n
    );
    assert!(e.check().is_empty(), "{:?}", e.check());
    for (v, name) in [(a, "a"), (b, "b"), (c, "c")] {
        for i in (0..n).step_by(97) {
            let mut buf = vec![0u8; BLOCK_SIZE];
            e.read(v, i * 4096, &mut buf).unwrap();
            assert!(buf == blk(i), "{name} block {i}");
        }
    }
    // the offline pass agrees there is nothing left
    let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert_eq!(r.lbas_remapped, 0);
}

#[test]
fn a_long_read_counts_a_miss_per_block_read_and_uses_cached_blocks() {
    let e = Engine::in_memory(HashAlgorithm::Sha256);
    let v = e.create_volume("v", 1 << 20).unwrap();
    let data: Vec<u8> = (0..16 * BLOCK_SIZE)
        .map(|i| (i / BLOCK_SIZE * 7 + i % 251) as u8)
        .collect();
    e.write(v, 0, &data, false).unwrap();
    // block 8 cached first; then all 16 in one read
    let mut one = vec![0u8; BLOCK_SIZE];
    e.read(v, 8 * 4096, &mut one).unwrap();
    let mut all = vec![0u8; 16 * BLOCK_SIZE];
    e.read(v, 0, &mut all).unwrap();
    assert!(all == data);
    let s = e.stats().read_cache;
    assert_eq!((s.misses, s.hits), (16, 1), "{s:?}");
    // all cached now
    e.read(v, 0, &mut all).unwrap();
    assert!(all == data);
    assert_eq!(e.stats().read_cache.hits, 17);
}

#[test]
fn read_cache_serves_shared_content_once() {
    let e = Engine::in_memory(HashAlgorithm::Sha256);
    let v = e.create_volume("v", 1 << 20).unwrap();
    let mut blk = vec![3u8; BLOCK_SIZE];
    blk[0] = 9;
    for lba in 0..16u64 {
        e.write(v, lba * 4096, &blk, false).unwrap();
    }
    let mut buf = vec![0u8; BLOCK_SIZE];
    for lba in 0..16u64 {
        e.read(v, lba * 4096, &mut buf).unwrap();
        assert!(buf == blk);
    }
    let s = e.stats().read_cache;
    assert_eq!(s.misses, 1, "{s:?}");
    assert_eq!(s.hits, 15, "{s:?}");
    // a freed and reused block is not served stale
    e.write(v, 0, &vec![0u8; 16 * BLOCK_SIZE], false).unwrap();
    e.flush().unwrap();
    let mut other = vec![5u8; BLOCK_SIZE];
    other[1] = 1;
    e.write(v, 0, &other, false).unwrap();
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf == other);
}

#[test]
fn unselected_blocks_are_hashed_and_deduplicated_out_of_line() {
    use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
    let cfg = EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Battery(40.0),
        },
        ..EngineConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let e = Engine::create(&path, HashAlgorithm::Sha256, cfg.clone()).unwrap();
    let a = e.create_volume("a", 16 << 20).unwrap();
    let blk = |i: u64| {
        let mut x = vec![1u8; BLOCK_SIZE];
        x[..8].copy_from_slice(&(i % 100).to_le_bytes());
        x
    };
    for i in 0..1000u64 {
        e.write(a, i * 4096, &blk(i), false).unwrap();
    }
    let s = e.stats();
    assert!(s.selectivity.blocks_unselected > 500, "{:?}", s.selectivity);
    assert!(s.physical_blocks_stored > 100);
    e.close().unwrap();
    // fsck accepts blocks not fingerprinted yet
    drop(e);
    let r = dedupd_engine::fsck::fsck(
        &path,
        dedupd_engine::fsck::FsckOptions {
            repair: false,
            rehash: true,
        },
    )
    .unwrap();
    assert_eq!(r.exit_code(), 0, "{:?}", r.problems);
    let e = Engine::open(&path, cfg).unwrap();
    let a = e.volume("a").unwrap().0;
    e.dedup_offline(None, &mut |_, _| {}).unwrap();
    e.flush().unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 100);
    for i in (0..1000u64).step_by(37) {
        let mut buf = vec![0u8; BLOCK_SIZE];
        e.read(a, i * 4096, &mut buf).unwrap();
        assert!(buf == blk(i));
    }
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// iDedup's sequence threshold (SmartDedup §4.5) in the write path: only
/// runs of at least T duplicates with contiguous stored copies are shared,
/// also when a run spans requests; a volume's own T overrides the engine's.
#[test]
fn sequence_threshold_shares_only_long_contiguous_runs() {
    let cfg = EngineConfig {
        sequence_threshold_blocks: 3,
        ..EngineConfig::default()
    };
    let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
    let src = e.create_volume("src", 64 * 4096).unwrap();
    let dst = e.create_volume("dst", 64 * 4096).unwrap();
    let blk = |k: u64| {
        let mut b = vec![0u8; BLOCK_SIZE];
        b[..8].copy_from_slice(&(k + 1).to_le_bytes());
        b[4000] = 7;
        b
    };
    let run = |from: u64, n: u64| (from..from + n).flat_map(blk).collect::<Vec<u8>>();
    // 16 distinct blocks, stored at contiguous PBAs
    e.write(src, 0, &run(0, 16), false).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 16);
    // a run of 4: shared
    e.write(dst, 0, &run(0, 4), false).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 16);
    // a run of 2 and a single duplicate: stored anew
    e.write(dst, 10 * 4096, &run(8, 2), false).unwrap();
    e.write(dst, 20 * 4096, &blk(12), false).unwrap();
    let s = e.stats();
    assert_eq!(s.physical_blocks_stored, 19);
    assert_eq!(s.sequence_filtered_blocks, 3);
    // four duplicates whose copies are not contiguous (0, 2, 4, 6): stored anew
    let scattered: Vec<u8> = [0, 2, 4, 6].into_iter().flat_map(blk).collect();
    e.write(dst, 30 * 4096, &scattered, false).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 23);
    // one run over three sequential requests: the third block reaches T
    for k in 0..3u64 {
        e.write(dst, (40 + k) * 4096, &blk(13 + k), false).unwrap();
    }
    let s = e.stats();
    assert_eq!(s.physical_blocks_stored, 25);
    assert_eq!(s.sequence_filtered_blocks, 9);
    // a volume's own threshold of 1 turns the filter off for it
    e.set_sequence_threshold("dst", Some(1)).unwrap();
    e.write(dst, 50 * 4096, &blk(5), false).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 25);
    assert!(e.set_sequence_threshold("dst", Some(0)).is_err());
    assert!(e.set_sequence_threshold("nope", None).is_err());
    // reads return what was written, whatever was shared
    let mut got = vec![0u8; 4 * 4096];
    e.read(dst, 30 * 4096, &mut got).unwrap();
    assert_eq!(got, scattered);
    assert!(e.check().is_empty(), "{:?}", e.check());
    // the filtered duplicates are not queued for the background pass; a
    // full pass merges them
    e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 16);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// Copies a live store directory (all but its lock file): the state a
/// crash at this instant would leave.
fn crash_copy(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to.join("maps")).unwrap();
    for entry in walk(from) {
        let rel = entry.strip_prefix(from).unwrap();
        if rel.to_str() != Some("lock") {
            std::fs::copy(&entry, to.join(rel)).unwrap();
        }
    }
}

/// The skipped buffer is checkpointed with the metadata and the journal's
/// map pages are queued again at start, so a crash loses no pending
/// out-of-line work of committed writes (SmartDedup §3.3); a damaged saved
/// buffer queues every volume whole. The copies are written in low-power
/// mode (inline dedup off): stored unhashed, only the skipped buffer knows
/// them (a restart re-finds hashed duplicates from the reverse index).
#[test]
fn pending_out_of_line_work_survives_a_crash() {
    use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let mains = EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Ac,
        },
        ..EngineConfig::default()
    };
    let low_power = EngineConfig {
        selectivity: SelectivityConfig {
            power: PowerSource::Battery(10.0),
            ..mains.selectivity
        },
        ..mains.clone()
    };
    let n = 2000u64;
    let blk = |i: u64| {
        let mut x = vec![9u8; BLOCK_SIZE];
        x[..8].copy_from_slice(&i.to_le_bytes());
        x
    };
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, mains.clone()).unwrap();
        let a = e.create_volume("a", 64 << 20).unwrap();
        for i in 0..n {
            e.write(a, i * 4096, &blk(i), false).unwrap();
        }
        while e.dedup_pass(1000).unwrap().work_remaining {}
        e.close().unwrap();
    }
    let e = Engine::open(&path, low_power).unwrap();
    // b copies the first half: pending work saved by a checkpoint
    let b = e.create_volume("b", 64 << 20).unwrap();
    for i in 0..n / 2 {
        e.write(b, i * 4096, &blk(i), false).unwrap();
    }
    e.flush().unwrap();
    e.checkpoint().unwrap();
    assert!(
        path.join("skipped.json").exists(),
        "the checkpoint did not save it"
    );
    // c copies the second half after the checkpoint: committed to the
    // journal only, no record of it saved anywhere
    let c = e.create_volume("c", 64 << 20).unwrap();
    let journal_before = e.stats().journal_bytes;
    for i in n / 2..n {
        e.write(c, i * 4096, &blk(i), false).unwrap();
    }
    e.flush().unwrap();
    assert!(
        e.stats().journal_bytes > journal_before,
        "no checkpoint expected"
    );
    assert_eq!(
        e.stats().physical_blocks_stored,
        2 * n,
        "copies were deduplicated inline"
    );
    for damaged in [false, true] {
        let copy = dir.path().join(format!("crash-{damaged}"));
        crash_copy(&path, &copy);
        if damaged {
            let f = copy.join("skipped.json");
            let mut bytes = std::fs::read(&f).unwrap();
            bytes[10] ^= 0x20;
            std::fs::write(&f, bytes).unwrap();
        }
        // fsck tells of it too (not a problem of consistency)
        let check = dedupd_engine::fsck::fsck(&copy, Default::default()).unwrap();
        assert_eq!(
            check.notes.iter().any(|n| n.contains("skipped.json")),
            damaged,
            "{check:?}"
        );
        if damaged {
            // a repair saves it again, the work it held queued whole
            let before = dir.path().join("crash-repaired");
            crash_copy(&copy, &before);
            let fixed = dedupd_engine::fsck::fsck(
                &before,
                dedupd_engine::fsck::FsckOptions {
                    repair: true,
                    rehash: false,
                },
            )
            .unwrap();
            assert_eq!(fixed.exit_code(), 0, "{fixed:?}");
            let again = dedupd_engine::fsck::fsck(&before, Default::default()).unwrap();
            assert!(again.notes.is_empty(), "{again:?}");
            let r = Engine::open(&before, mains.clone()).unwrap();
            while r.dedup_pass(1000).unwrap().work_remaining {}
            assert_eq!(
                r.stats().physical_blocks_stored,
                n,
                "work lost by the repair"
            );
            r.close().unwrap();
        }
        let r = Engine::open(&copy, mains.clone()).unwrap();
        assert_eq!(
            r.notes().iter().any(|n| n.contains("skipped.json")),
            damaged,
            "{:?}",
            r.notes()
        );
        let mut passes = 0;
        while r.dedup_pass(1000).unwrap().work_remaining {
            passes += 1;
            assert!(passes < 10_000);
        }
        assert_eq!(
            r.stats().physical_blocks_stored,
            n,
            "pending work lost in the crash (damaged file: {damaged})"
        );
        assert!(r.check().is_empty(), "{:?}", r.check());
    }
    std::mem::forget(e);
}

/// CAFTL's pre-hashing and sampling (SmartDedup §4.1) in the write path:
/// blocks they turn away are stored unhashed, the first repeat of content
/// is missed inline, and the out-of-line pass makes dedup exact again.
#[test]
fn caftl_prehash_and_sampling_hash_less_and_stay_exact() {
    let blk = |k: u64| {
        let mut b = vec![3u8; BLOCK_SIZE];
        b[..8].copy_from_slice(&(k + 1).to_le_bytes());
        b
    };
    let request: Vec<u8> = (0..8).flat_map(blk).collect();
    for (prehash_bytes, sampling) in [(64 << 10, false), (0, true)] {
        let cfg = EngineConfig {
            prehash_bytes,
            sampling,
            ..EngineConfig::default()
        };
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &request, false).unwrap();
        let s = e.stats();
        assert_eq!(s.physical_blocks_stored, 8);
        if sampling {
            // the sample alone was hashed; it missed, so 7 were turned away
            assert_eq!(s.blocks_fingerprinted_inline, 1);
            assert_eq!((s.caftl.requests_sampled, s.caftl.sample_misses), (1, 7));
        } else {
            // no CRC was seen before: nothing hashed
            assert_eq!(s.blocks_fingerprinted_inline, 0);
            assert_eq!(s.caftl.prehash_misses, 8);
            assert_eq!(s.caftl.blocks_prehashed, 8);
        }
        // the first repeat: hashed now, but the first copies were not
        // indexed (sampling: the sample was, so it alone is shared)
        e.write(v, 8 * 4096, &request, false).unwrap();
        let s = e.stats();
        assert_eq!(s.physical_blocks_stored, if sampling { 15 } else { 16 });
        // the second repeat is found inline
        e.write(v, 16 * 4096, &request, false).unwrap();
        let s = e.stats();
        assert_eq!(s.physical_blocks_stored, if sampling { 15 } else { 16 });
        assert!(s.skipped.records > 0);
        while e.dedup_pass(1000).unwrap().work_remaining {}
        assert_eq!(
            e.stats().physical_blocks_stored,
            8,
            "not exact after the pass"
        );
        let mut got = vec![0u8; 24 * 4096];
        e.read(v, 0, &mut got).unwrap();
        assert!(got.chunks(request.len()).all(|c| c == request));
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}

/// Under sustained foreground load the background worker still drains a
/// filling skipped buffer (its minimum share), instead of pausing forever.
#[test]
fn out_of_line_worker_keeps_a_minimum_share_under_load() {
    let cfg = EngineConfig {
        skipped_buffer_bytes: 16 << 10,
        ..config(3) // 4 KiB index budget, memory-only lookups
    };
    let e = std::sync::Arc::new(Engine::in_memory_with(HashAlgorithm::Sha256, cfg));
    let a = e.create_volume("a", 64 << 20).unwrap();
    let b = e.create_volume("b", 64 << 20).unwrap();
    let blk = |i: u64| {
        let mut x = vec![5u8; BLOCK_SIZE];
        x[..8].copy_from_slice(&i.to_le_bytes());
        x
    };
    for i in 0..2000u64 {
        e.write(a, i * 4096, &blk(i), false).unwrap();
        e.write(b, i * 4096, &blk(i), false).unwrap();
    }
    assert!(e.dedup_pressure());
    let pending = |e: &Engine| {
        let s = e.stats().skipped;
        s.records + s.regions * 256 + s.volumes * 16384
    };
    // foreground reads without a pause, from before the worker starts
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (e, stop) = (e.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; BLOCK_SIZE];
            let mut lba = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                e.read(a, (lba % 2000) * 4096, &mut buf).unwrap();
                lba += 1;
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(100));
    let worker = e.start_out_of_line(20_000);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = pending(&e);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    worker.stop();
    let after = pending(&e);
    assert!(
        after < before,
        "the worker made no progress under load: {before} -> {after} blocks pending"
    );
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// The reverse index, volume maps and reference counts under two-page
/// caches: pages leave memory once a checkpoint put them in place and come
/// back on demand; dedup, overwrites, out-of-line passes, restarts and
/// crash recovery see the same content.
#[test]
fn metadata_pages_from_disk_under_tiny_caches() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let cfg = EngineConfig {
        reverse_index_cache_bytes: 2 * 4064,
        map_cache_bytes: 2 * 4064,
        journal_size_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let blk = |k: u64| {
        let mut b = vec![6u8; BLOCK_SIZE];
        b[..8].copy_from_slice(&(k + 1).to_le_bytes());
        b
    };
    let n = 3000u64;
    let e = Engine::create(&path, HashAlgorithm::Sha256, cfg.clone()).unwrap();
    let a = e.create_volume("a", 64 << 20).unwrap();
    let b = e.create_volume("b", 64 << 20).unwrap();
    for k in 0..n {
        e.write(a, k * 4096, &blk(k), false).unwrap();
    }
    e.flush().unwrap();
    e.checkpoint().unwrap();
    let s = e.stats().reverse_index;
    assert!(s.pages_evicted > 0, "{s:?}");
    assert!(s.resident_bytes <= s.cache_bytes, "{s:?}");
    let s = e.stats().map_cache;
    assert!(s.pages_evicted > 0, "{s:?}");
    assert!(s.resident_bytes <= s.cache_bytes, "{s:?}");
    // duplicates of every block: each hit is checked against an evicted page
    for k in 0..n {
        e.write(b, k * 4096, &blk(k), false).unwrap();
    }
    assert_eq!(e.stats().physical_blocks_stored, n);
    // overwrites release blocks: their fingerprints come back to be removed
    for k in 0..n / 2 {
        e.write(a, k * 4096, &blk(n + k), false).unwrap();
    }
    e.flush().unwrap();
    assert!(e.stats().reverse_index.pages_loaded > 0);
    assert_eq!(e.stats().reverse_index.load_errors, 0);
    assert!(e.stats().map_cache.pages_loaded > 0);
    assert_eq!(e.stats().map_cache.load_errors, 0);
    assert!(e.check().is_empty(), "{:?}", e.check());
    // a crash now: recovery replays what the journal holds
    let copy = dir.path().join("crash");
    crash_copy(&path, &copy);
    let mut live = Some(e);
    for store in [&copy, &path] {
        if store == &path {
            let e = live.take().expect("open");
            e.close().unwrap();
            drop(e);
        }
        let r = Engine::open(store, cfg.clone()).unwrap();
        let (ra, _) = r.volume("a").unwrap();
        let (rb, _) = r.volume("b").unwrap();
        let mut got = vec![0u8; BLOCK_SIZE];
        for k in (0..n).step_by(97) {
            r.read(rb, k * 4096, &mut got).unwrap();
            assert_eq!(got, blk(k));
            r.read(ra, k * 4096, &mut got).unwrap();
            assert_eq!(got, if k < n / 2 { blk(n + k) } else { blk(k) });
        }
        // a third copy still dedups against the paged reverse index
        let c = r.create_volume("c", 64 << 20).unwrap();
        for k in 0..n {
            r.write(c, k * 4096, &blk(k), false).unwrap();
        }
        assert_eq!(r.stats().physical_blocks_stored, n + n / 2);
        assert!(r.check().is_empty(), "{:?}", r.check());
        drop(r);
    }
}

/// An overwrite that releases the only copy of content the same request
/// writes twice more: both copies must end up sharing one new block (the
/// request's own index insert is seen by its later blocks).
#[test]
fn request_rewriting_released_content_twice_stores_it_once() {
    let cfg = config(4); // 4 KiB budget, LFU, disk lookups: every duplicate found
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::create(&dir.path().join("s"), HashAlgorithm::Sha256, cfg).unwrap();
    let v = e.create_volume("v", VOLUME_BLOCKS * 4096).unwrap();
    let data = |pats: &[u8]| pats.iter().flat_map(|&p| pattern(p)).collect::<Vec<u8>>();
    e.write(v, 19 * 4096, &data(&[5, 2]), false).unwrap();
    // LBA 20 held the only copy of pattern 2; LBAs 21 and 22 write it again
    e.write(v, 20 * 4096, &data(&[5, 2, 2]), false).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 2);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// Copies the sequence threshold stored apart stay apart after a restart,
/// clean or not (the index rebuilt at open finds them; a replayed journal
/// queues their regions for the background pass, which leaves such a
/// volume alone); the explicit full pass merges them.
#[test]
fn a_restart_keeps_what_the_sequence_threshold_stored_apart() {
    for clean in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let cfg = EngineConfig {
            sequence_threshold_blocks: 3,
            ..EngineConfig::default()
        };
        let blk = |k: u64| {
            let mut b = vec![0u8; BLOCK_SIZE];
            b[..8].copy_from_slice(&(k + 1).to_le_bytes());
            b[4000] = 9;
            b
        };
        let e = Engine::create(&path, HashAlgorithm::Sha256, cfg.clone()).unwrap();
        let src = e.create_volume("src", 64 * 4096).unwrap();
        let dst = e.create_volume("dst", 64 * 4096).unwrap();
        let run: Vec<u8> = (0..16).flat_map(blk).collect();
        e.write(src, 0, &run, false).unwrap();
        // a single duplicate: stored anew
        e.write(dst, 20 * 4096, &blk(12), false).unwrap();
        assert_eq!(e.stats().physical_blocks_stored, 17);
        let path = if clean {
            e.close().unwrap();
            path
        } else {
            // committed to the journal only: the state a crash leaves
            e.flush().unwrap();
            let crashed = dir.path().join("crashed");
            crash_copy(&path, &crashed);
            crashed
        };
        drop(e);
        let e = Engine::open(&path, cfg).unwrap();
        while e.dedup_pass(1 << 16).unwrap().work_remaining {}
        assert_eq!(
            e.stats().physical_blocks_stored,
            17,
            "clean restart: {clean}"
        );
        e.dedup_offline(None, &mut |_, _| {}).unwrap();
        assert_eq!(e.stats().physical_blocks_stored, 16);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}

#[test]
fn zero_blocks_do_not_take_selection_from_the_data_blocks_beside_them() {
    use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
    // half the blocks selected (a battery at 50 %), requests of one data
    // block and one zero block: half the data blocks are fingerprinted
    // inline, not all or none of them
    let cfg = EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Battery(50.0),
        },
        ..EngineConfig::default()
    };
    let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
    let v = e.create_volume("v", 16 << 20).unwrap();
    for i in 0..200u64 {
        let mut req = vec![0u8; 2 * BLOCK_SIZE];
        req[..8].copy_from_slice(&(i + 1).to_le_bytes());
        e.write(v, i * 2 * 4096, &req, false).unwrap();
    }
    let s = e.stats().selectivity;
    assert_eq!(s.blocks_selected + s.blocks_unselected, 200, "{s:?}");
    assert!((90..=110).contains(&s.blocks_selected), "{s:?}");
}

/// SmartDedup §3.4: in low-power mode dedup is off — inline selects no
/// block, and the background worker leaves the skipped blocks waiting
/// instead of hashing them; with charge it drains them.
#[test]
fn out_of_line_worker_waits_in_low_power_mode() {
    use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};
    let on_battery = |pct: f64| EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: true,
            load_aware: false,
            power: PowerSource::Battery(pct),
        },
        ..EngineConfig::default()
    };
    let blk = |i: u64| {
        let mut x = vec![3u8; BLOCK_SIZE];
        x[..8].copy_from_slice(&(i % 100).to_le_bytes());
        x
    };
    let e = std::sync::Arc::new(Engine::in_memory_with(
        HashAlgorithm::Sha256,
        on_battery(10.0),
    ));
    let a = e.create_volume("a", 64 << 20).unwrap();
    for i in 0..1000u64 {
        e.write(a, i * 4096, &blk(i), false).unwrap();
    }
    let s = e.stats();
    assert_eq!(s.selectivity.blocks_selected, 0);
    assert_eq!(s.physical_blocks_stored, 1000, "inline dedup ran");
    let worker = e.start_out_of_line(100_000);
    std::thread::sleep(std::time::Duration::from_millis(800));
    worker.stop();
    let s = e.stats();
    assert_eq!(s.out_of_line.passes, 0, "a pass ran in low-power mode");
    assert_eq!(s.skipped.records, 1000);
    assert_eq!(s.physical_blocks_stored, 1000);

    // the same at half charge: the worker drains them to the 100 distinct
    let e = std::sync::Arc::new(Engine::in_memory_with(
        HashAlgorithm::Sha256,
        on_battery(50.0),
    ));
    let a = e.create_volume("a", 64 << 20).unwrap();
    for i in 0..1000u64 {
        e.write(a, i * 4096, &blk(i), false).unwrap();
    }
    let worker = e.start_out_of_line(100_000);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while e.stats().physical_blocks_stored > 100 {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker did not drain"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    worker.stop();
    assert!(e.check().is_empty(), "{:?}", e.check());
}
