//! Fault injection: EIO and ENOSPC from the block backend at random points.
//! A failed data write: the caller gets an error, the engine stays
//! consistent (invariants hold, every block reads back as its last
//! successfully written content or, for a write that failed, old or new
//! content per block) and keeps serving. A failed sync of the data file:
//! reads keep working, writes and flushes are refused until restart.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use dedupd_engine::backend::{BlockBackend, MemoryBackend};
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm, Pba, BLOCK_SIZE};

/// Fails every `every`-th data write (EIO or ENOSPC by turns), and with
/// `fail_syncs` every `every`-th sync too.
struct Faulty {
    inner: MemoryBackend,
    every: u64,
    ops: AtomicU64,
    fail_syncs: bool,
}

impl Faulty {
    fn fail(&self) -> Option<io::Error> {
        let n = self.ops.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(self.every) {
            return None;
        }
        Some(if (n / self.every).is_multiple_of(2) {
            io::Error::from_raw_os_error(5) // EIO
        } else {
            io::Error::from_raw_os_error(28) // ENOSPC
        })
    }
}

impl BlockBackend for Faulty {
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_blocks(pba, buf)
    }
    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()> {
        match self.fail() {
            Some(e) => Err(e),
            None => self.inner.write_blocks(pba, data),
        }
    }
    fn sync(&self) -> io::Result<()> {
        match self.fail_syncs.then(|| self.fail()).flatten() {
            Some(e) => Err(e),
            None => self.inner.sync(),
        }
    }
    fn len_bytes(&self) -> io::Result<u64> {
        self.inner.len_bytes()
    }
}

fn block(p: u64) -> Vec<u8> {
    let mut b = vec![(p % 251) as u8 + 1; BLOCK_SIZE];
    b[..8].copy_from_slice(&p.to_le_bytes());
    b
}

#[test]
fn eio_and_enospc_at_random_points_leave_the_engine_consistent_and_serving() {
    for every in [3u64, 7, 13] {
        let backend = Faulty {
            inner: MemoryBackend::default(),
            every,
            ops: AtomicU64::new(0),
            fail_syncs: false,
        };
        let e = Engine::in_memory_over(
            HashAlgorithm::Sha256,
            EngineConfig::default(),
            Box::new(backend),
        );
        let v = e.create_volume("v", 64 * 4096).unwrap();
        // per block: Some(content id) once a write succeeded, plus ids of failed writes since
        let mut last_ok: Vec<Option<u64>> = vec![None; 64];
        let mut maybe: Vec<Vec<u64>> = vec![Vec::new(); 64];
        let (mut errors, mut seed) = (0, every);
        for round in 0..400u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let lba = (seed >> 33) % 60;
            let n = 1 + (seed >> 20) % 4;
            let ids: Vec<u64> = (0..n).map(|i| (round * 7 + i * 3) % 40).collect();
            let data: Vec<u8> = ids.iter().flat_map(|&p| block(p)).collect();
            match e.write(v, lba * 4096, &data, round % 5 == 0) {
                Ok(()) => {
                    for (i, &p) in ids.iter().enumerate() {
                        last_ok[(lba as usize) + i] = Some(p);
                        maybe[(lba as usize) + i].clear();
                    }
                }
                Err(EngineError::Io { .. }) | Err(EngineError::NoSpace { .. }) => {
                    errors += 1;
                    for (i, &p) in ids.iter().enumerate() {
                        maybe[(lba as usize) + i].push(p);
                    }
                }
                Err(other) => panic!("unexpected error {other}"),
            }
            assert!(
                e.check().is_empty(),
                "every {every} round {round}: {:?}",
                e.check()
            );
        }
        assert!(errors > 0, "no faults were injected");
        // every block reads back as its last good content or a failed write's
        for b in 0..64usize {
            let mut buf = vec![0u8; BLOCK_SIZE];
            e.read(v, b as u64 * 4096, &mut buf).unwrap();
            let ok = last_ok[b].is_some_and(|p| block(p) == buf)
                || maybe[b].iter().any(|&p| block(p) == buf)
                || (last_ok[b].is_none() && buf.iter().all(|&x| x == 0));
            assert!(ok, "every {every}: block {b} holds unexpected data");
        }
        // and it keeps serving: a flush eventually succeeds and commits
        let mut flushed = false;
        for _ in 0..10 {
            if e.flush().is_ok() {
                flushed = true;
                break;
            }
        }
        assert!(flushed, "flush never succeeded after faults");
        assert!(e.check().is_empty());
    }
}

#[test]
fn a_failed_data_sync_stops_writes_and_flushes_but_not_reads() {
    let backend = Faulty {
        inner: MemoryBackend::default(),
        every: 50,
        ops: AtomicU64::new(0),
        fail_syncs: true,
    };
    let e = Engine::in_memory_over(
        HashAlgorithm::Sha256,
        EngineConfig::default(),
        Box::new(backend),
    );
    let v = e.create_volume("v", 64 * 4096).unwrap();
    e.write(v, 0, &block(1), false).unwrap();
    e.flush().unwrap();
    // the 50th backend operation (a sync of one of these flushes) fails
    let mut failed_at = None;
    for round in 0..100u64 {
        if e.flush().is_err() {
            failed_at = Some(round);
            break;
        }
    }
    assert!(failed_at.is_some(), "no sync failure was injected");
    // the failure sticks: later syncs would succeed, yet nothing is
    // written or committed
    for _ in 0..3 {
        assert!(matches!(e.flush(), Err(EngineError::DataSyncFailed(_))));
        assert!(matches!(
            e.write(v, 4096, &block(2), false),
            Err(EngineError::DataSyncFailed(_))
        ));
        assert!(matches!(
            e.trim(v, 0, 4096, false),
            Err(EngineError::DataSyncFailed(_))
        ));
    }
    // nor are volumes created, grown, renamed or set: no commit could
    // record it, and it would be shown until a restart lost it
    assert!(matches!(
        e.create_volume("w", 4096),
        Err(EngineError::DataSyncFailed(_))
    ));
    assert!(matches!(
        e.resize_volume("v", 128 * 4096),
        Err(EngineError::DataSyncFailed(_))
    ));
    assert!(matches!(
        e.rename_volume("v", "w"),
        Err(EngineError::DataSyncFailed(_))
    ));
    assert!(matches!(
        e.set_sequence_threshold("v", Some(4)),
        Err(EngineError::DataSyncFailed(_))
    ));
    assert!(e.volume("w").is_none());
    assert_eq!(e.volume("v").unwrap().1, 64 * 4096);
    let info = e.volumes().into_iter().find(|i| i.name == "v").unwrap();
    assert_eq!(
        info.sequence_threshold_blocks, None,
        "the threshold changed"
    );
    let mut buf = vec![0u8; BLOCK_SIZE];
    e.read(v, 0, &mut buf).unwrap();
    assert_eq!(buf, block(1));
    e.read(v, 4096, &mut buf).unwrap();
    assert_eq!(buf, vec![0u8; BLOCK_SIZE]);
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// A file system with room for `limit_blocks` blocks of data: writes past
/// it fail with ENOSPC.
struct Full {
    inner: MemoryBackend,
    limit_blocks: u64,
}

impl BlockBackend for Full {
    fn read_blocks(&self, pba: Pba, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_blocks(pba, buf)
    }
    fn write_blocks(&self, pba: Pba, data: &[u8]) -> io::Result<()> {
        if pba.0 + (data.len() / BLOCK_SIZE) as u64 > self.limit_blocks {
            return Err(io::Error::from_raw_os_error(28)); // ENOSPC
        }
        self.inner.write_blocks(pba, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn len_bytes(&self) -> io::Result<u64> {
        self.inner.len_bytes()
    }
}

#[test]
fn a_full_file_system_commits_and_reuses_released_blocks_instead_of_failing() {
    let e = Engine::in_memory_over(
        HashAlgorithm::Sha256,
        EngineConfig::default(),
        Box::new(Full {
            inner: MemoryBackend::default(),
            limit_blocks: 8,
        }),
    );
    let v = e.create_volume("v", 16 * 4096).unwrap();
    let data: Vec<u8> = (0..8).flat_map(block).collect();
    e.write(v, 0, &data, false).unwrap();
    // full, and nothing released: ENOSPC, nothing changes
    match e.write(v, 0, &block(100), false) {
        Err(EngineError::NoSpace { .. }) => {}
        other => panic!("expected ENOSPC, got {other:?}"),
    }
    // nor a block and its copy in one request: neither is counted written
    let twice: Vec<u8> = [200, 200].into_iter().flat_map(block).collect();
    assert!(matches!(
        e.write(v, 0, &twice, false),
        Err(EngineError::NoSpace { .. })
    ));
    assert_eq!(e.stats().blocks_written, 8);
    assert_eq!(e.stats().no_space_commits, 0);
    // two blocks released, not yet committed
    e.trim(v, 4096, 2 * 4096, false).unwrap();
    assert_eq!(e.stats().pending_free_blocks, 2);
    // a two-block write: it commits and goes into the released blocks
    let new: Vec<u8> = [100, 101].into_iter().flat_map(block).collect();
    e.write(v, 0, &new, false).unwrap();
    let s = e.stats();
    assert_eq!(s.no_space_commits, 1);
    // 8 stored, 2 trimmed, LBA 0's old copy released, 2 new
    assert_eq!(s.physical_blocks_stored, 8 - 2 - 1 + 2, "{s:?}");
    assert_eq!(s.pending_free_blocks, 1, "{s:?}");
    let mut buf = vec![0u8; 4 * 4096];
    e.read(v, 0, &mut buf).unwrap();
    assert_eq!(&buf[..2 * 4096], &new[..]);
    assert!(buf[2 * 4096..3 * 4096].iter().all(|&x| x == 0));
    assert_eq!(&buf[3 * 4096..], &block(3)[..]);
    assert!(e.check().is_empty(), "{:?}", e.check());
    // a partial-block write (read-modify-write) into an unmapped LBA, full
    // again with LBA 0's old copy waiting: it commits and reuses it too
    e.write(v, 2 * 4096 + 512, &[0x77; 512], false).unwrap();
    let s = e.stats();
    assert_eq!(s.no_space_commits, 2, "{s:?}");
    // blocks written: 8, then the 2-block write, then the partial one; the
    // writes that failed or were retried count once or not at all
    assert_eq!(s.blocks_written, 8 + 2 + 1, "{s:?}");
    let mut b = vec![0u8; 4096];
    e.read(v, 2 * 4096, &mut b).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0));
    assert!(b[512..1024].iter().all(|&x| x == 0x77));
    assert!(b[1024..].iter().all(|&x| x == 0));
    assert!(e.check().is_empty(), "{:?}", e.check());
    e.flush().unwrap();
    assert!(e.check().is_empty(), "{:?}", e.check());
}

/// Fails the writes of metadata files whose name starts with `prefix`
/// (`journal`, or the files a checkpoint writes) with EIO while armed.
struct FailingMetadata {
    prefix: &'static [&'static str],
    armed: std::sync::atomic::AtomicBool,
}

impl dedupd_engine::observe::IoObserver for FailingMetadata {
    fn event(&self, _: dedupd_engine::observe::IoEvent<'_>) {}
    fn inject(&self, e: dedupd_engine::observe::IoEvent<'_>) -> Option<io::Error> {
        use dedupd_engine::observe::IoEvent;
        let file = match e {
            IoEvent::Write { file, .. }
            | IoEvent::SetLen { file, .. }
            | IoEvent::Remove { file }
            | IoEvent::Create { file }
            | IoEvent::SyncStart { file }
            | IoEvent::Sync { file } => file,
            IoEvent::SyncDir { dir } => dir,
        };
        (self.armed.load(Ordering::SeqCst) && self.prefix.iter().any(|p| file.starts_with(p)))
            .then(|| io::Error::from_raw_os_error(5))
    }
}

fn store_failing(
    dir: &std::path::Path,
    prefix: &'static [&'static str],
    config: EngineConfig,
) -> (Engine, std::sync::Arc<FailingMetadata>) {
    let faults = std::sync::Arc::new(FailingMetadata {
        prefix,
        armed: Default::default(),
    });
    let config = EngineConfig {
        observer: dedupd_engine::observe::Observer(Some(faults.clone())),
        ..config
    };
    let e = Engine::create(&dir.join("store"), HashAlgorithm::Sha256, config).unwrap();
    (e, faults)
}

/// One block per map page (508 LBAs each): every write dirties a page.
const LBA_STRIDE: u64 = 508;

#[test]
fn failing_commits_refuse_writes_past_twice_the_dirty_bound() {
    let d = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        max_dirty_bytes: 64 << 10,
        map_cache_bytes: 64 << 10,
        ..EngineConfig::default()
    };
    let (e, faults) = store_failing(d.path(), &["journal"], config);
    let v = e.create_volume("v", 4096 * LBA_STRIDE * 4096).unwrap();
    e.write(v, 0, &block(0), true).unwrap();
    let before = e.stats().metadata_bytes_in_memory;
    faults.armed.store(true, Ordering::SeqCst);
    let (mut ok, mut refused) = (0u64, 0u64);
    for i in 1..2000u64 {
        match e.write(v, i * LBA_STRIDE * 4096, &block(i), false) {
            Ok(()) => ok += 1,
            Err(_) => refused += 1,
        }
    }
    let grown = e.stats().metadata_bytes_in_memory.saturating_sub(before);
    // uncommitted map pages cannot leave memory: past twice the bound
    // (128 KiB, 32 pages) writes are refused before they change anything
    // (every write past the bound fails, but without the hard bound the
    // ones past twice it change the metadata first: 8 MB grew)
    assert!(refused > 1900, "{ok} accepted, {refused} refused");
    // writes up to twice the bound are taken (a commit each starts fails,
    // which is the next FLUSH's error, not theirs)
    assert!(ok > 20, "{ok} accepted, {refused} refused");
    assert!(e.flush().is_err());
    for i in 1..=ok {
        let mut buf = vec![0u8; 4096];
        e.read(v, i * LBA_STRIDE * 4096, &mut buf).unwrap();
        assert_eq!(buf, block(i), "accepted write {i}");
    }
    assert!(
        grown < 192 << 10,
        "metadata in memory grew by {grown} bytes"
    );
    // the journal back: writes and flushes work again, nothing accepted lost
    faults.armed.store(false, Ordering::SeqCst);
    e.write(v, 0, &block(7), true).unwrap();
    e.flush().unwrap();
    let mut buf = vec![0u8; 4096];
    e.read(v, 0, &mut buf).unwrap();
    assert_eq!(buf, block(7));
    assert!(e.check().is_empty(), "{:?}", e.check());
}

#[test]
fn failing_checkpoints_refuse_writes_past_twice_the_journal_size() {
    let d = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        journal_size_bytes: 256 << 10,
        ..EngineConfig::default()
    };
    let (e, faults) = store_failing(d.path(), &["maps/", "refcounts", "fingerprints"], config);
    let v = e.create_volume("v", 4096 * LBA_STRIDE * 4096).unwrap();
    e.flush().unwrap();
    faults.armed.store(true, Ordering::SeqCst);
    let mut refused = 0u64;
    let mut buffer_max = 0u64;
    for i in 0..1000u64 {
        if e.write(v, i * LBA_STRIDE * 4096, &block(i), true).is_err() {
            refused += 1;
        }
        buffer_max = buffer_max.max(e.stats().checkpoint_buffer_bytes);
    }
    // from about a fifth of the way on, once past twice the journal size
    assert!(refused > 700, "{refused} writes refused");
    // twice the journal size, plus the commit that passed it
    assert!(
        buffer_max < 540 << 10,
        "checkpoint buffer reached {buffer_max} bytes"
    );
    faults.armed.store(false, Ordering::SeqCst);
    e.write(v, 0, &block(5000), true).unwrap();
    assert!(e.stats().checkpoint_buffer_bytes < 256 << 10);
    let mut buf = vec![0u8; 4096];
    e.read(v, 0, &mut buf).unwrap();
    assert_eq!(buf, block(5000));
    assert!(e.check().is_empty(), "{:?}", e.check());
}
