//! The full offline pass finds every duplicate through a sort spilled to
//! disk when the stored blocks' pairs exceed the memory it may use.

use dedupd_engine::engine::{Engine, EngineConfig};
use dedupd_engine::fingerprint::HashAlgorithm;
use dedupd_engine::fsck::{fsck, FsckOptions};
use dedupd_engine::index::IndexConfig;
use dedupd_engine::selectivity::{PowerSource, SelectivityConfig};

const DISTINCT: u64 = 6000;

fn block(k: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    for (i, c) in b.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(k * 1_000_003 + i as u64).to_le_bytes());
    }
    b
}

/// Inline dedup off (low-power mode): every block is stored as written.
fn inline_off() -> EngineConfig {
    EngineConfig {
        selectivity: SelectivityConfig {
            adaptive: true,
            load_aware: false,
            power: PowerSource::Battery(5.0),
        },
        ..EngineConfig::default()
    }
}

#[test]
fn offline_pass_with_a_spilled_sort_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        selectivity: inline_off().selectivity,
        // 64 KiB for the index, and so for the sort's buckets: the
        // 12 000 stored blocks' pairs (192 KB) spill
        index: IndexConfig {
            memory_budget_bytes: 64 << 10,
            ..IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    let e = Engine::create(
        &dir.path().join("store"),
        HashAlgorithm::Sha256,
        cfg.clone(),
    )
    .unwrap();
    let a = e.create_volume("a", DISTINCT * 4096).unwrap();
    let b = e.create_volume("b", DISTINCT * 4096).unwrap();
    for k in 0..DISTINCT {
        e.write(a, k * 4096, &block(k), false).unwrap();
        // b holds the same blocks in another order
        e.write(b, ((k * 7) % DISTINCT) * 4096, &block(k), false)
            .unwrap();
    }
    e.close().unwrap();
    drop(e);
    // fsck counts the copies inline dedup did not merge (not an error)
    let path = dir.path().join("store");
    let report = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(report.duplicate_copies, DISTINCT);
    assert_eq!(report.exit_code(), 0, "{:?}", report.problems);
    let e = Engine::open(&path, cfg).unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 2 * DISTINCT);
    let mut last = (0, 0);
    let r = e
        .dedup_offline(None, &mut |done, all| last = (done, all))
        .unwrap();
    e.flush().unwrap();
    assert_eq!(last.0, last.1);
    assert_eq!(r.blocks_examined, 2 * DISTINCT);
    assert_eq!(r.lbas_remapped, DISTINCT);
    assert_eq!(e.stats().physical_blocks_stored, DISTINCT);
    assert!(e.check().is_empty(), "{:?}", e.check());
    for k in (0..DISTINCT).step_by(113) {
        let mut buf = vec![0u8; 4096];
        e.read(b, ((k * 7) % DISTINCT) * 4096, &mut buf).unwrap();
        assert!(buf == block(k), "block {k}");
    }
    e.close().unwrap();
    drop(e);
    assert_eq!(
        fsck(&path, FsckOptions::default())
            .unwrap()
            .duplicate_copies,
        0
    );
}

#[test]
fn blocks_the_offline_pass_fingerprints_are_indexed_for_inline_dedup() {
    // stored unhashed (inline dedup off), then fingerprinted by the full
    // pass: a later write of one of their contents finds it inline
    // instead of storing another copy
    let cfg = inline_off();
    let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
    let v = e.create_volume("v", 64 * 4096).unwrap();
    for k in 0..8 {
        e.write(v, k * 4096, &block(k), false).unwrap();
    }
    // and one copy, which the pass merges onto the lower PBA
    e.write(v, 8 * 4096, &block(3), false).unwrap();
    assert_eq!(e.stats().index_entries, 0);
    let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert_eq!((r.blocks_hashed, r.lbas_remapped), (9, 1));
    assert_eq!(e.stats().physical_blocks_stored, 8);
    assert_eq!(e.stats().index_entries, 8);
    for k in [0, 3, 7] {
        let fp = HashAlgorithm::Sha256.fingerprint(&block(k));
        e.write_fingerprinted(v, dedupd_engine::block::Lba(20 + k), &[Some(fp)])
            .unwrap();
    }
    assert_eq!(
        e.stats().physical_blocks_stored,
        8,
        "a pass-hashed block was stored again"
    );
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn one_offline_pass_runs_at_a_time() {
    let cfg = inline_off();
    let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
    let v = e.create_volume("v", 64 * 4096).unwrap();
    for k in 0..16 {
        e.write(v, k * 4096, &block(k % 8), false).unwrap();
    }
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let e = &e;
        let first = s.spawn(move || {
            let mut waited = false;
            e.dedup_offline(None, &mut |_, _| {
                if !waited {
                    waited = true;
                    started_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                }
            })
        });
        started_rx.recv().unwrap();
        // a second pass while the first runs is refused, and says why
        let err = e.dedup_offline(None, &mut |_, _| {}).unwrap_err();
        assert!(
            matches!(err, dedupd_engine::error::EngineError::OfflinePassRunning),
            "{err}"
        );
        assert!(err.to_string().contains("running already"), "{err}");
        go_tx.send(()).unwrap();
        assert_eq!(first.join().unwrap().unwrap().lbas_remapped, 8);
    });
    // once it has finished, the next runs
    let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert_eq!(r.lbas_remapped, 0);
    assert_eq!(e.stats().physical_blocks_stored, 8);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// An exact pass over every stored block during which nothing was written
/// leaves no queued out-of-line work behind (the skipped buffer's records
/// and the planned merges were all about copies it merged); a write while
/// it runs keeps the queue, whether it stores a new block or shares one
/// inline (which records nothing, but may share a copy the pass merged
/// away from).
#[test]
fn an_exact_pass_with_no_write_meanwhile_empties_the_queued_work() {
    const N: u64 = 2000;
    let cfg = EngineConfig {
        // a 4 KiB index: inline dedup misses most copies, which are queued
        index: IndexConfig {
            memory_budget_bytes: 4096,
            ..IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    for write_meanwhile in [None, Some(N), Some(N - 1)] {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg.clone());
        let a = e.create_volume("a", 2 * N * 4096).unwrap();
        let b = e.create_volume("b", N * 4096).unwrap();
        for k in 0..N {
            e.write(a, k * 4096, &block(k), false).unwrap();
        }
        for k in 0..N {
            e.write(b, k * 4096, &block(k), false).unwrap();
        }
        let s = e.stats();
        assert!(
            s.skipped.records + s.skipped.regions + s.skipped.volumes > 0,
            "{:?}",
            s.skipped
        );
        let mut wrote = false;
        e.dedup_offline(None, &mut |_, _| {
            if let (Some(k), false) = (write_meanwhile, wrote) {
                wrote = true;
                e.write(a, N * 4096, &block(k), false).unwrap();
            }
        })
        .unwrap();
        let s = e.stats();
        let queued = s.skipped.records + s.skipped.regions + s.skipped.volumes;
        if write_meanwhile.is_some() {
            assert!(
                queued + s.pending_merges > 0,
                "the queue was emptied though {write_meanwhile:?} was written during the pass"
            );
        } else {
            assert_eq!(queued, 0, "{:?}", s.skipped);
            assert_eq!(s.pending_merges, 0);
            assert_eq!(s.physical_blocks_stored, N);
        }
        let mut buf = vec![0u8; 4096];
        for k in (0..N).step_by(97) {
            e.read(b, k * 4096, &mut buf).unwrap();
            assert!(buf == block(k), "block {k}");
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}

/// A pass asked to stop (a signal) ends early, says so, and leaves the
/// store consistent, its work to the next pass; the request holds for
/// passes started later on the same engine.
#[test]
fn a_stopped_offline_pass_ends_early_and_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let n = 3000;
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, inline_off()).unwrap();
        let a = e.create_volume("a", n * 4096).unwrap();
        let b = e.create_volume("b", n * 4096).unwrap();
        for k in 0..n {
            e.write(a, k * 4096, &block(k), false).unwrap();
            e.write(b, k * 4096, &block(k), false).unwrap();
        }
        assert_eq!(e.stats().physical_blocks_stored, 2 * n);
        // stopped while it scans: at its second progress report
        let mut reports = 0;
        let r = e
            .dedup_offline(None, &mut |_, _| {
                reports += 1;
                if reports == 2 {
                    e.stop_offline_passes();
                }
            })
            .unwrap();
        assert!(r.interrupted, "{r:?}");
        assert!(r.blocks_examined < 2 * n, "{r:?}");
        assert_eq!(r.lbas_remapped, 0, "{r:?}");
        assert!(r.work_remaining, "the queued work was dropped: {r:?}");
        // and any pass started later on this engine
        let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
        assert!(r.interrupted && r.lbas_remapped == 0, "{r:?}");
        assert!(e.check().is_empty(), "{:?}", e.check());
        e.close().unwrap();
    }
    let check = fsck(&path, FsckOptions::default()).unwrap();
    assert_eq!(check.exit_code(), 0, "{check:?}");
    // a new engine runs the pass whole
    let e = Engine::open(&path, inline_off()).unwrap();
    let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert!(!r.interrupted, "{r:?}");
    assert_eq!(e.stats().physical_blocks_stored, n);
    e.close().unwrap();
}

/// The pass's own index inserts may displace copies from a small index,
/// and displaced copies that cannot all be remembered queue every volume
/// whole: work the pass itself examines, so it still empties the queue
/// (it used to leave the volume queued and merges pending).
#[test]
fn the_work_an_exact_pass_queues_itself_does_not_outlive_it() {
    const N: u64 = 2000;
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        index: IndexConfig {
            memory_budget_bytes: 4096,
            ..IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    let e = Engine::create(&dir.path().join("store"), HashAlgorithm::Sha256, cfg).unwrap();
    let v = e.create_volume("v", 64 << 20).unwrap();
    // the same N blocks twice, 32 to a request
    for base in [0, 2 * N] {
        for first in (0..N).step_by(32) {
            let data: Vec<u8> = (first..(first + 32).min(N)).flat_map(block).collect();
            e.write(v, (base + first) * 4096, &data, false).unwrap();
        }
    }
    e.flush().unwrap();
    let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
    assert!(!r.interrupted && !r.work_remaining, "{r:?}");
    e.flush().unwrap();
    let s = e.stats();
    assert_eq!(s.physical_blocks_stored, N);
    assert_eq!(
        s.skipped.records + s.skipped.regions + s.skipped.volumes,
        0,
        "{:?}",
        s.skipped
    );
    assert_eq!(s.pending_merges, 0);
    e.close().unwrap();
}
