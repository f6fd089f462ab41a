//! Fault injection: EIO and ENOSPC from the block backend at random points.
//! The caller gets an error, the engine stays consistent (invariants hold,
//! every block reads back as its last successfully written content or, for
//! a write that failed, old or new content per block) and keeps serving.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use dedupd_engine::backend::{BlockBackend, MemoryBackend};
use dedupd_engine::{Engine, EngineConfig, EngineError, HashAlgorithm, Pba, BLOCK_SIZE};

/// Fails every `every`-th data write (EIO or ENOSPC by turns) and every
/// `every`-th sync with EIO.
struct Faulty {
    inner: MemoryBackend,
    every: u64,
    ops: AtomicU64,
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
        match self.fail() {
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
