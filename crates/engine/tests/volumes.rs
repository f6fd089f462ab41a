//! Deleting and shrinking volumes release their blocks in pieces: commits
//! happen along the way (memory and lock hold times do not grow with the
//! volume), the metadata stays consistent, and writes racing the deletion
//! leak nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dedupd_engine::block::Lba;
use dedupd_engine::engine::{Engine, EngineConfig, RELEASE_PIECE_BLOCKS};
use dedupd_engine::error::EngineError;
use dedupd_engine::fingerprint::{Fingerprint, HashAlgorithm};
use dedupd_engine::observe::{IoEvent, IoObserver, Observer};

/// Counts journal syncs (one per commit).
#[derive(Default)]
struct Commits(AtomicU64);

impl IoObserver for Commits {
    fn event(&self, e: IoEvent<'_>) {
        if matches!(e, IoEvent::Sync { file: "journal" }) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn fingerprint(k: u64) -> Fingerprint {
    let mut b = [0u8; 32];
    let mut x = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for c in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    Fingerprint(b)
}

const BLOCKS: u64 = 4 * RELEASE_PIECE_BLOCKS;

fn store(dir: &std::path::Path, commits: &Arc<Commits>) -> Engine {
    store_with(dir, commits, EngineConfig::default().max_pending_free_bytes)
}

/// [`store`] committing once `max_pending_free_bytes` of blocks wait to
/// be freed.
fn store_with(
    dir: &std::path::Path,
    commits: &Arc<Commits>,
    max_pending_free_bytes: u64,
) -> Engine {
    let cfg = EngineConfig {
        max_dirty_bytes: 64 << 10,
        map_cache_bytes: 64 << 10,
        max_pending_free_bytes,
        observer: Observer(Some(commits.clone())),
        ..EngineConfig::default()
    };
    let e = Engine::create(&dir.join("store"), HashAlgorithm::Sha256, cfg).unwrap();
    let big = e.create_volume("big", BLOCKS * 4096).unwrap();
    let small = e.create_volume("small", 1 << 20).unwrap();
    for first in (0..BLOCKS).step_by(256) {
        let fps: Vec<Option<Fingerprint>> =
            (first..first + 256).map(|k| Some(fingerprint(k))).collect();
        e.write_fingerprinted(big, Lba(first), &fps).unwrap();
    }
    // the small volume shares its 256 blocks with the big one
    let shared: Vec<Option<Fingerprint>> = (0..256).map(|k| Some(fingerprint(k))).collect();
    e.write_fingerprinted(small, Lba(0), &shared).unwrap();
    e.flush().unwrap();
    e
}

#[test]
fn deleting_a_large_volume_commits_in_pieces_and_keeps_shared_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let commits = Arc::new(Commits::default());
    let e = store(dir.path(), &commits);
    assert_eq!(e.stats().physical_blocks_stored, BLOCKS);
    let before = commits.0.load(Ordering::Relaxed);
    e.delete_volume("big").unwrap();
    let during = commits.0.load(Ordering::Relaxed) - before;
    assert!(during > 2, "only {during} commits while deleting");
    assert!(e.check().is_empty(), "{:?}", e.check());
    let s = e.stats();
    assert_eq!(s.physical_blocks_stored, 256, "the shared blocks stay");
    assert_eq!(s.volumes, 1);
    drop(e);
    // (written as fingerprints only: the data file gets the length real
    // writes would have given it)
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("store/data"))
        .unwrap()
        .set_len(BLOCKS * 4096)
        .unwrap();
    let e = Engine::open(&dir.path().join("store"), EngineConfig::default()).unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, 256);
    assert!(e.volume("big").is_none());
}

#[test]
fn shrinking_releases_in_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let commits = Arc::new(Commits::default());
    let e = store(dir.path(), &commits);
    let before = commits.0.load(Ordering::Relaxed);
    e.resize_volume("big", RELEASE_PIECE_BLOCKS * 4096).unwrap();
    assert!(commits.0.load(Ordering::Relaxed) - before > 2);
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, RELEASE_PIECE_BLOCKS);
}

#[test]
fn writes_racing_a_deletion_leak_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let commits = Arc::new(Commits::default());
    let e = Arc::new(store(dir.path(), &commits));
    let (big, _) = e.volume("big").unwrap();
    let (started_tx, started) = std::sync::mpsc::channel();
    let writer = {
        let e = e.clone();
        std::thread::spawn(move || {
            // new content all over the volume, behind and ahead of the
            // deletion, until the volume is gone
            let mut k = 1 << 40;
            let mut written = 0u64;
            // until refused (30 s at most): the deletion may be slow to
            // take the metadata lock from this loop
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            for round in 0u64.. {
                if std::time::Instant::now() > deadline {
                    break;
                }
                let lba = (round * 7919) % (BLOCKS - 8);
                let fps: Vec<Option<Fingerprint>> = (0..8)
                    .map(|i| {
                        k += 1;
                        Some(fingerprint(k + i))
                    })
                    .collect();
                match e.write_fingerprinted(big, Lba(lba), &fps) {
                    Ok(()) => written += 1,
                    // refused once the deletion began or ended, nothing else
                    Err(EngineError::VolumeDeleting(_) | EngineError::NoSuchVolume(_)) => {
                        return (written, true)
                    }
                    Err(other) => panic!("write failed: {other}"),
                }
                if written == 1 {
                    let _ = started_tx.send(());
                }
            }
            (written, false)
        })
    };
    // the deletion starts while the writer writes
    started.recv().unwrap();
    e.delete_volume("big").unwrap();
    let (written, refused) = writer.join().unwrap();
    assert!(
        written > 0 && refused,
        "no race: {written} writes, refused {refused}"
    );
    e.flush().unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, 256);
}

#[test]
fn a_huge_sparse_volume_is_deleted_and_shrunk_past_its_holes_with_progress() {
    // 64 TiB thin volumes with a few blocks far apart, some of their map
    // pages evicted to the file (small map cache): only the stretches that
    // hold pages are visited, and every mapped block is released
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        map_cache_bytes: 16 << 10,
        ..EngineConfig::default()
    };
    let e = Engine::create(&dir.path().join("store"), HashAlgorithm::Sha256, cfg).unwrap();
    let size_bytes = 64u64 << 40;
    let blocks = size_bytes / 4096;
    let lbas = [0, 5_000, blocks / 3, blocks / 2 + 7, blocks - 1];
    for name in ["a", "b"] {
        let v = e.create_volume(name, size_bytes).unwrap();
        for (k, &lba) in lbas.iter().enumerate() {
            e.write_fingerprinted(v, Lba(lba), &[Some(fingerprint(k as u64))])
                .unwrap();
        }
    }
    e.flush().unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 5);

    let mut calls = Vec::new();
    e.resize_volume_with_progress("a", (blocks / 2) * 4096, &mut |done, all| {
        calls.push((done, all))
    })
    .unwrap();
    let half = blocks - blocks / 2;
    assert_eq!(calls.last(), Some(&(half, half)), "progress ends at all");
    assert!(
        calls.windows(2).all(|w| w[0].0 <= w[1].0),
        "never backwards"
    );
    assert!(
        calls.len() < 16,
        "{} pieces for 2 mapped blocks",
        calls.len()
    );
    assert!(e.check().is_empty(), "{:?}", e.check());

    let mut calls = 0;
    e.delete_volume_with_progress("b", &mut |_, _| calls += 1)
        .unwrap();
    assert!(calls < 24, "{calls} pieces for 5 mapped blocks");
    assert!(e.check().is_empty(), "{:?}", e.check());
    // volume a still maps its first three blocks
    let s = e.stats();
    assert_eq!((s.volumes, s.physical_blocks_stored), (1, 3));
    e.delete_volume("a").unwrap();
    assert_eq!(e.stats().physical_blocks_stored, 0);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn an_in_memory_engine_models_the_journal_a_store_writes() {
    // the same writes and flushes into a store and into a simulated engine:
    // the journal bytes the simulation counts are those the store wrote
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        // small enough for several checkpoints
        journal_size_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let store = Engine::create(
        &dir.path().join("store"),
        HashAlgorithm::Sha256,
        cfg.clone(),
    )
    .unwrap();
    let sim = Engine::simulated_with(HashAlgorithm::Sha256, cfg);
    for e in [&store, &sim] {
        let a = e.create_volume("a", 1 << 30).unwrap();
        let b = e.create_volume("b", 1 << 30).unwrap();
        let mut x = 7u64;
        for i in 0..40_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (v, lba) = if i % 3 == 0 {
                (b, x % 20_000)
            } else {
                (a, i % 50_000)
            };
            e.write_fingerprinted(v, Lba(lba), &[Some(fingerprint(x % 30_000))])
                .unwrap();
            if i % 1000 == 999 {
                e.flush().unwrap();
            }
        }
        e.flush().unwrap();
    }
    // more than 1 MiB each, and within 2 %
    let close = |what: &str, real: u64, modelled: u64| {
        eprintln!("{what}: store {real} bytes, modelled {modelled}");
        assert!(real > 1 << 20, "the store wrote {real} {what} bytes");
        let diff = real.abs_diff(modelled) as f64 / real as f64;
        assert!(
            diff < 0.02,
            "modelled {modelled} {what} bytes, the store wrote {real}"
        );
    };
    let j = |e: &Engine| e.stats().journal_bytes_written;
    close("journal", j(&store), j(&sim));
    // a store's shutdown checkpoints what is left
    store.close().unwrap();
    sim.close().unwrap();
    let c = |e: &Engine| e.stats().checkpoint_bytes_written;
    close("checkpoint", c(&store), c(&sim));
}

#[test]
fn writes_racing_a_shrink_leak_nothing() {
    // Data writes drop the metadata lock while their blocks are written;
    // a shrink that completes meanwhile must not let them map LBAs past
    // the new end (a reference no LBA inside the volume accounts for).
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        max_dirty_bytes: 64 << 10,
        ..EngineConfig::default()
    };
    let e =
        Arc::new(Engine::create(&dir.path().join("store"), HashAlgorithm::Sha256, cfg).unwrap());
    const FULL: u64 = 2048;
    let vol = e.create_volume("v", FULL * 4096).unwrap();
    let mut k = 0u64;
    let (mut accepted, mut refused) = (0u64, 0u64);
    for _trial in 0..30 {
        e.resize_volume("v", FULL * 4096).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (e, stop) = (e.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut data = vec![0u8; 8 * 4096];
                while !stop.load(Ordering::Relaxed) {
                    for lba in (FULL / 2..FULL).step_by(8) {
                        for block in data.chunks_mut(4096) {
                            k += 1;
                            block[..8].copy_from_slice(&k.to_le_bytes());
                        }
                        // refused past the end once shrunk, nothing else
                        match e.write(vol, lba * 4096, &data, false) {
                            Ok(()) => accepted += 1,
                            Err(EngineError::OutOfRange { .. }) => refused += 1,
                            Err(other) => panic!("write failed: {other}"),
                        }
                    }
                }
                (k, accepted, refused)
            })
        };
        std::thread::sleep(std::time::Duration::from_micros(500));
        e.resize_volume("v", FULL / 2 * 4096).unwrap();
        std::thread::sleep(std::time::Duration::from_micros(500));
        stop.store(true, Ordering::Relaxed);
        (k, accepted, refused) = writer.join().unwrap();
        // shrunk, writer gone: every reference comes from an LBA inside
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
    // writes landed inside before the shrinks and were refused after them
    assert!(
        accepted > 0 && refused > 0,
        "{accepted} accepted, {refused} refused"
    );
    e.flush().unwrap();
    drop(e);
    let e = Engine::open(&dir.path().join("store"), EngineConfig::default()).unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn one_huge_trim_commits_along_the_way() {
    // a TRIM of the whole volume in one call: changed metadata and blocks
    // waiting to be freed are committed as they pass their bounds, not
    // held until the TRIM ends
    let dir = tempfile::tempdir().unwrap();
    let commits = Arc::new(Commits::default());
    let e = store(dir.path(), &commits);
    let (big, _) = e.volume("big").unwrap();
    let before = commits.0.load(Ordering::Relaxed);
    e.trim(big, 0, BLOCKS * 4096, false).unwrap();
    let during = commits.0.load(Ordering::Relaxed) - before;
    assert!(during > 2, "only {during} commits during the TRIM");
    e.flush().unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(
        e.stats().physical_blocks_stored,
        256,
        "the shared blocks stay"
    );
}

#[test]
fn a_trim_of_densely_mapped_blocks_releases_them_in_bounded_pieces() {
    // 4096 mapped LBAs inside one 8192-block stretch: released at most
    // 1024 to a hold of the lock, and the blocks waiting to be freed
    // committed between pieces as they pass their (1 MiB) bound, so a
    // piece's transaction stays small
    let dir = tempfile::tempdir().unwrap();
    let commits = Arc::new(Commits::default());
    let e = store_with(dir.path(), &commits, 1 << 20);
    let (big, _) = e.volume("big").unwrap();
    let before = commits.0.load(Ordering::Relaxed);
    e.trim(big, 1 << 20, 4096 * 4096, false).unwrap();
    let during = commits.0.load(Ordering::Relaxed) - before;
    assert!(during >= 3, "only {during} commits during the TRIM");
    e.flush().unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn a_shrink_cut_short_keeps_the_tail_unwritten_until_resized_again() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("s");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let blocks = 2 * RELEASE_PIECE_BLOCKS + 100;
    let v = e.create_volume("v", blocks * 4096).unwrap();
    for k in 0..blocks {
        e.write(v, k * 4096, &[(k % 250) as u8 + 1; 4096], false)
            .unwrap();
    }
    e.flush().unwrap();
    // the process dies after the first piece of a shrink to 100 blocks
    let cut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        e.resize_volume_with_progress("v", 100 * 4096, &mut |_, _| panic!("killed"))
    }));
    assert!(cut.is_err());
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let info = e.volumes().into_iter().find(|i| i.name == "v").unwrap();
    assert_eq!(info.size_bytes, blocks * 4096);
    assert_eq!(info.shrinking_to_bytes, Some(100 * 4096), "{info:?}");
    assert!(!info.read_only);
    assert!(e.check().is_empty(), "{:?}", e.check());
    // the open says so, with the command that finishes it
    assert!(
        e.notes().iter().any(|n| n.contains(&format!(
            "`dedupd --store {} volume resize v 409600 --shrink`",
            path.display()
        ))),
        "{:?}",
        e.notes()
    );
    // below the new end the volume is served as before; past it, a part
    // of the tail is released already, and nothing is written
    let (v, _) = e.volume("v").unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(v, 99 * 4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 100));
    e.write(v, 99 * 4096, &[251u8; 4096], false).unwrap();
    let err = e
        .write(v, (blocks - 1) * 4096, &[9u8; 4096], false)
        .unwrap_err();
    assert!(
        matches!(err, dedupd_engine::EngineError::OutOfRange { .. }),
        "{err:?}"
    );
    // resizing to it again finishes the shrink
    e.resize_volume("v", 100 * 4096).unwrap();
    let info = e.volumes().into_iter().find(|i| i.name == "v").unwrap();
    assert_eq!(
        (info.size_bytes, info.shrinking_to_bytes),
        (100 * 4096, None)
    );
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, 100);
    drop(e);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let info = e.volumes().into_iter().find(|i| i.name == "v").unwrap();
    assert_eq!(info.shrinking_to_bytes, None);
    assert!(e.notes().is_empty(), "{:?}", e.notes());
}

#[test]
fn a_delete_cut_short_leaves_the_volume_read_only_until_deleted_again() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("s");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 64 << 20).unwrap();
    let keep = e.create_volume("keep", 1 << 20).unwrap();
    for k in 0..(RELEASE_PIECE_BLOCKS + 100) {
        e.write(v, k * 4096, &[(k % 250) as u8 + 1; 4096], false)
            .unwrap();
    }
    e.write(keep, 0, &[7u8; 4096], false).unwrap();
    e.flush().unwrap();
    // the process dies after the first piece (a crash: nothing more is
    // committed or written)
    let cut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        e.delete_volume_with_progress("v", &mut |_, _| panic!("killed"))
    }));
    assert!(cut.is_err());
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let vols = e.volumes();
    let info = vols.iter().find(|i| i.name == "v").expect("still listed");
    assert!(info.deleting && info.read_only, "{info:?}");
    assert!(
        e.notes().iter().any(|n| n.contains("volume delete v")),
        "{:?}",
        e.notes()
    );
    let (v, _) = e.volume("v").unwrap();
    assert!(e.write(v, 0, &[1u8; 4096], false).is_err());
    assert!(e.check().is_empty(), "{:?}", e.check());
    // it cannot be renamed or set meanwhile, and the error says why
    let err = e.rename_volume("v", "w").unwrap_err().to_string();
    assert!(
        err.contains("being deleted") && err.contains("volume delete v"),
        "{err}"
    );
    let err = e
        .set_sequence_threshold("v", Some(4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("being deleted"), "{err}");
    // deleting again finishes; the other volume is untouched
    e.delete_volume("v").unwrap();
    assert!(e.volume("v").is_none());
    let (keep, _) = e.volume("keep").unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(keep, 0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 7));
    assert!(e.check().is_empty(), "{:?}", e.check());
    assert_eq!(e.stats().physical_blocks_stored, 1);
}

#[test]
fn a_discard_of_a_whole_large_thin_volume_costs_what_it_has_mapped() {
    // 64 TiB (2^34 blocks): block by block, this discard would take many
    // minutes; the map's holes are passed over at once
    let e = Engine::in_memory_over(
        HashAlgorithm::Sha256,
        EngineConfig::default(),
        Box::new(dedupd_engine::backend::MemoryBackend::default()),
    );
    let size = 64u64 << 40;
    let v = e.create_volume("big", size).unwrap();
    let far = size - 16 * 4096;
    let block = |b: u8| vec![b; 4096];
    e.write(v, 0, &block(1), false).unwrap();
    e.write(v, 1 << 40, &block(2), false).unwrap();
    e.write(v, far, &block(3), false).unwrap();
    let started = std::time::Instant::now();
    e.trim(v, 0, size, false).unwrap();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "the discard took {:?}",
        started.elapsed()
    );
    let s = e.stats();
    assert_eq!(s.logical_bytes_mapped, 0);
    assert_eq!(s.blocks_trimmed, size / 4096);
    assert_eq!(s.pending_free_blocks + s.free_blocks, 3, "{s:?}");
    let mut buf = vec![1u8; 4096];
    e.read(v, far, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn a_commit_that_leaves_the_volume_table_alone_does_not_log_it() {
    // With many volumes (one per VM or container) the table is tens of
    // kilobytes; a FLUSH after a small write must not journal it again.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let first = e.create_volume("vm-0000", 1 << 30).unwrap();
    for i in 1..400 {
        e.create_volume(&format!("vm-{i:04}"), 1 << 30).unwrap();
    }
    e.flush().unwrap();
    e.checkpoint().unwrap();
    let table_bytes = std::fs::metadata(path.join("state.json")).unwrap().len();
    assert!(table_bytes > 20_000, "{table_bytes} bytes of volume table");
    let journal = |e: &Engine| e.stats().journal_bytes_written;
    // the first change to a page after a checkpoint logs its image; the
    // second one a patch
    e.write(first, 0, &[1; 4096], false).unwrap();
    e.flush().unwrap();
    let before = journal(&e);
    e.write(first, 4096, &[2; 4096], false).unwrap();
    e.flush().unwrap();
    let per_commit = journal(&e) - before;
    assert!(
        per_commit < 2048,
        "a one-block commit journaled {per_commit} bytes ({table_bytes} of volume table)"
    );
    // a change to the table is journaled, and all of it survives a crash
    // (no close: the journal is replayed)
    e.resize_volume("vm-0399", 2 << 30).unwrap();
    e.flush().unwrap();
    assert!(journal(&e) - before - per_commit > table_bytes / 2);
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let vols = e.volumes();
    assert_eq!(vols.len(), 400);
    assert_eq!(
        vols.iter()
            .find(|v| v.name == "vm-0399")
            .unwrap()
            .size_bytes,
        2 << 30
    );
    let s = e.stats();
    assert_eq!(s.blocks_written, 2);
    let mut back = vec![0u8; 4096];
    e.read(first, 4096, &mut back).unwrap();
    assert_eq!(back, [2; 4096]);
}

#[test]
fn a_format_1_store_opens_with_its_counters_and_is_marked_format_2_by_its_first_commit() {
    // Format 1 kept the counters and the last journal sequence in
    // state.json and had no counters.json.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let vol = {
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let vol = e.create_volume("v", 1 << 20).unwrap();
        e.write(vol, 0, &[7; 8192], false).unwrap();
        e.close().unwrap();
        vol
    };
    let checked = |value: &serde_json::Value| {
        let mut body = serde_json::to_vec(value).unwrap();
        body.push(b'\n');
        let crc = crc32c::crc32c(&body);
        body.extend_from_slice(format!("crc32c={crc:08x}\n").as_bytes());
        body
    };
    let unchecked = |file: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(path.join(file)).unwrap();
        serde_json::from_str(&text[..text.rfind("crc32c=").unwrap()]).unwrap()
    };
    let counters = unchecked("counters.json");
    let mut state = unchecked("state.json");
    state["counters"] = counters["counters"].clone();
    state["journal_seq"] = counters["journal_seq"].clone();
    let mut sb = unchecked("superblock");
    assert_eq!(sb["format_version"], 2);
    sb["format_version"] = 1.into();
    std::fs::write(path.join("state.json"), checked(&state)).unwrap();
    std::fs::write(path.join("superblock"), checked(&sb)).unwrap();
    std::fs::remove_file(path.join("counters.json")).unwrap();

    // a counters.json left by an upgrade that did not finish is ignored
    std::fs::write(path.join("counters.json"), b"torn").unwrap();
    // (and a lost superblock of this store is rebuilt as format 1)
    let lost = dir.path().join("lost");
    std::fs::create_dir_all(lost.join("maps")).unwrap();
    for sub in ["", "maps"] {
        for f in std::fs::read_dir(path.join(sub)).unwrap().flatten() {
            if f.file_type().unwrap().is_file() && f.file_name() != "superblock" {
                std::fs::copy(f.path(), lost.join(sub).join(f.file_name())).unwrap();
            }
        }
    }
    let check = dedupd_engine::fsck::fsck(&lost, Default::default()).unwrap();
    assert!(check.problems[0].contains("format 1"), "{check:?}");
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 2);
    assert_eq!(unchecked("superblock")["format_version"], 1);
    e.write(vol, 8192, &[8; 4096], false).unwrap();
    e.flush().unwrap();
    assert_eq!(unchecked("superblock")["format_version"], 2);
    // the upgrade wrote the counters as opened; the commit's are in the
    // journal only
    assert_eq!(unchecked("counters.json")["counters"]["blocks_written"], 2);
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 3);
    let mut back = vec![0u8; 4096];
    e.read(vol, 8192, &mut back).unwrap();
    assert_eq!(back, [8; 4096]);
    e.close().unwrap();
    drop(e);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 3);
    assert!(path.join("counters.json").exists());
    drop(e);
    // the state keeps its format-1 counters (written only when the volume
    // table changes), yet a lost superblock is rebuilt as format 2
    assert!(unchecked("state.json").get("counters").is_some());
    std::fs::remove_file(path.join("superblock")).unwrap();
    let fixed = dedupd_engine::fsck::fsck(
        &path,
        dedupd_engine::fsck::FsckOptions {
            repair: true,
            rehash: false,
        },
    )
    .unwrap();
    assert_eq!(fixed.exit_code(), 1, "{fixed:?}");
    assert_eq!(unchecked("superblock")["format_version"], 2);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    assert_eq!(e.stats().blocks_written, 3);
}

#[test]
fn growing_a_reopened_volume_keeps_the_mappings_paged_out() {
    // After a restart a volume's map pages are on file, not in memory;
    // a resize must keep them reachable (reads, TRIM, later writes).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    // map pages of 508 entries: entries on a dozen pages, more than the
    // small map cache below holds
    let lbas: Vec<u64> = [20u64, 30, 40, 50, 60, 100, 150, 200, 250, 300, 350, 393]
        .iter()
        .map(|page| page * 508 + 5)
        .collect();
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let v = e.create_volume("v", 1 << 30).unwrap();
        for (i, &lba) in lbas.iter().enumerate() {
            e.write(v, lba * 4096, &[i as u8 + 1; 4096], false).unwrap();
        }
        e.close().unwrap();
    }
    let read = |e: &Engine, v, lba: u64| {
        let mut b = vec![0u8; 4096];
        e.read(v, lba * 4096, &mut b).unwrap();
        b[0]
    };
    // a map cache of a few pages: the pages are evicted, not resident
    let small = || EngineConfig {
        map_cache_bytes: 4 * 4096,
        ..EngineConfig::default()
    };
    for size in [2u64 << 30, 2 << 30, 3 << 30] {
        let e = Engine::open(&path, small()).unwrap();
        let (v, _) = e.volume("v").unwrap();
        // the pages read last stay in memory, the others are evicted:
        // the highest ones among those
        for &lba in &lbas[..4] {
            read(&e, v, lba);
        }
        e.resize_volume("v", size).unwrap();
        for (i, &lba) in lbas.iter().enumerate() {
            assert_eq!(
                read(&e, v, lba),
                i as u8 + 1,
                "LBA {lba} after growing to {size}"
            );
        }
        // a write into the same map page keeps its neighbours
        e.write(v, (20 * 508 + 6) * 4096, &[99; 4096], false)
            .unwrap();
        assert!(e.check().is_empty());
        e.close().unwrap();
        drop(e);
        let e = Engine::open(&path, small()).unwrap();
        for (i, &lba) in lbas.iter().enumerate() {
            assert_eq!(read(&e, v, lba), i as u8 + 1, "LBA {lba} after a restart");
        }
        assert_eq!(read(&e, v, 20 * 508 + 6), 99);
        drop(e);
    }
}

#[test]
fn a_start_with_threshold_one_after_one_above_queues_the_volumes_that_took_it() {
    // Under T = 4, duplicate runs shorter than 4 blocks are stored as new
    // and not recorded for the out-of-line pass; a later start with T = 1
    // must not leave them out of it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let with_t = |t| EngineConfig {
        sequence_threshold_blocks: t,
        ..EngineConfig::default()
    };
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, with_t(4)).unwrap();
        let inherits = e.create_volume("inherits", 1 << 20).unwrap();
        let own = e.create_volume("own", 1 << 20).unwrap();
        e.set_sequence_threshold("own", Some(4)).unwrap();
        for v in [inherits, own] {
            e.write(v, 0, &[5; 4096], false).unwrap();
            e.write(v, 8 * 4096, &[5; 4096], false).unwrap();
        }
        assert!(e.stats().sequence_filtered_blocks >= 2);
        e.close().unwrap();
    }
    // a start with the same T queues nothing, nor does an open between
    // runs that takes T from the store
    {
        let e = Engine::open(&path, with_t(4)).unwrap();
        assert_eq!(e.stats().skipped.volumes, 0);
        e.close().unwrap();
    }
    {
        let config = EngineConfig {
            settings_from_store: true,
            ..EngineConfig::default()
        };
        let e = Engine::open(&path, config).unwrap();
        assert_eq!(e.stats().skipped.volumes, 0);
        e.create_volume("later", 1 << 20).unwrap();
        e.close().unwrap();
    }
    // the volume with its own T = 4 keeps it; the two that took the
    // store's (one created by the open between runs) are queued whole
    let e = Engine::open(&path, with_t(1)).unwrap();
    assert_eq!(e.stats().skipped.volumes, 2);
    // a crash before a checkpoint saved that queue: queued again
    let inherits = e.volume("inherits").unwrap().0;
    e.write(inherits, 16 * 4096, &[6; 4096], false).unwrap();
    e.flush().unwrap();
    e.drop_without_closing();
    let e = Engine::open(&path, with_t(1)).unwrap();
    assert_eq!(e.stats().skipped.volumes, 2);
    // saved at the close, and T = 1 recorded: a later start under T = 1
    // finds the queue saved, not made again
    e.close().unwrap();
    drop(e);
    let state = std::fs::read_to_string(path.join("state.json")).unwrap();
    assert!(
        !state.contains("default_sequence_threshold_blocks"),
        "{state}"
    );
    let e = Engine::open(&path, with_t(1)).unwrap();
    assert_eq!(e.stats().skipped.volumes, 2);
}

#[test]
fn a_renamed_volume_keeps_its_data_and_the_new_name_is_durable() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("s");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("old", 1 << 20).unwrap();
    e.create_volume("other", 1 << 20).unwrap();
    e.write(v, 0, &[9u8; 4096], false).unwrap();
    for (to, want) in [
        ("other", "exists already"),
        ("", "invalid volume name"),
        (".x", "invalid volume name"),
    ] {
        let err = e.rename_volume("old", to).unwrap_err().to_string();
        assert!(err.contains(want), "{to:?}: {err}");
    }
    assert!(matches!(
        e.rename_volume("nothing", "x"),
        Err(EngineError::NoSuchVolume(_))
    ));
    e.rename_volume("old", "new").unwrap();
    assert!(e.volume("old").is_none());
    assert_eq!(e.volume("new").unwrap().0, v);
    // the name is free again
    e.create_volume("old", 1 << 20).unwrap();
    // durable on return: a crash keeps it
    e.drop_without_closing();
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let (v, _) = e.volume("new").unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(v, 0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 9));
    assert_eq!(e.volumes().len(), 3);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn blocks_freed_at_the_top_of_the_data_file_stay_counted_free_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
    let v = e.create_volume("v", 1 << 20).unwrap();
    let data: Vec<u8> = (0..8u8).flat_map(|b| vec![b + 1; 4096]).collect();
    e.write(v, 0, &data, false).unwrap();
    e.trim(v, 4 * 4096, 4 * 4096, false).unwrap();
    e.flush().unwrap();
    // the freed blocks are the file's last four (held back until a
    // transaction after the one that released them is durable)
    let before = e.stats();
    assert_eq!(before.data_file_bytes, 8 * 4096);
    assert_eq!(before.free_blocks, 0, "{before:?}");
    assert_eq!(before.pending_free_blocks, 4, "{before:?}");
    // a flush with nothing changed leaves them held; a server's periodic
    // commit releases them, so an idle store does not keep them pending
    e.flush().unwrap();
    assert_eq!(e.stats().pending_free_blocks, 4);
    e.commit_periodic().unwrap();
    let idle = e.stats();
    assert_eq!(
        (idle.pending_free_blocks, idle.free_blocks),
        (0, 4),
        "{idle:?}"
    );
    e.close().unwrap();
    drop(e);
    let e = Engine::open(&path, EngineConfig::default()).unwrap();
    let after = e.stats();
    assert_eq!(after.data_file_bytes, 8 * 4096);
    assert_eq!(after.free_blocks, 4, "{after:?}");
    // and they are what new data takes: the file does not grow
    let (v, _) = e.volume("v").unwrap();
    let fresh: Vec<u8> = [9u8, 10].iter().flat_map(|&b| vec![b; 4096]).collect();
    e.write(v, 4 * 4096, &fresh, false).unwrap();
    let s = e.stats();
    assert_eq!(s.data_file_bytes, 8 * 4096);
    assert_eq!(s.free_blocks, 2, "{s:?}");
    assert!(e.check().is_empty(), "{:?}", e.check());
}
