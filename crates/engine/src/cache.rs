//! The read cache keyed by PBA (SmartDedup §3.4's page cache index): reads
//! of different LBAs that share content are served from one cached copy.
//!
//! Bounded in bytes (`--read-cache`), least recently used blocks evicted
//! first. A stored block never changes while referenced (redirect-on-write),
//! so entries stay valid until their PBA is freed and recycled; the engine
//! drops them at that moment.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::block::{Pba, BLOCK_SIZE};

/// Bytes of bookkeeping counted per cached block besides its 4 KiB.
const ENTRY_OVERHEAD: u64 = 64;

/// Figures of the read cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadCacheStats {
    /// Bytes the cache may use.
    pub capacity_bytes: u64,
    /// Bytes in use (blocks plus bookkeeping).
    pub used_bytes: u64,
    /// Block reads served from the cache.
    pub hits: u64,
    /// Block reads that went to the data file.
    pub misses: u64,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<u64, (Box<[u8; BLOCK_SIZE]>, u64)>,
    lru: BTreeMap<u64, u64>,
    tick: u64,
    hits: u64,
    misses: u64,
}

/// A PBA-keyed LRU cache of block contents.
pub struct ReadCache {
    capacity_bytes: u64,
    inner: Mutex<Inner>,
}

impl ReadCache {
    /// A cache of at most `capacity_bytes` (0 disables it).
    pub fn new(capacity_bytes: u64) -> Self {
        ReadCache {
            capacity_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copies the cached content of `pba` into `out` (4 KiB); false on a miss.
    pub fn get(&self, pba: Pba, out: &mut [u8]) -> bool {
        if self.capacity_bytes == 0 {
            return false;
        }
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        let Inner { blocks, lru, .. } = &mut *g;
        match blocks.get_mut(&pba.0) {
            Some((data, t)) => {
                out.copy_from_slice(&data[..]);
                lru.remove(t);
                *t = tick;
                lru.insert(tick, pba.0);
                g.hits += 1;
                true
            }
            None => {
                g.misses += 1;
                false
            }
        }
    }

    /// Caches `data` (4 KiB) as the content of `pba`.
    pub fn insert(&self, pba: Pba, data: &[u8]) {
        if self.capacity_bytes < BLOCK_SIZE as u64 + ENTRY_OVERHEAD {
            return;
        }
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        let mut block = Box::new([0u8; BLOCK_SIZE]);
        block.copy_from_slice(data);
        if let Some((_, old)) = g.blocks.insert(pba.0, (block, tick)) {
            g.lru.remove(&old);
        }
        g.lru.insert(tick, pba.0);
        let per = BLOCK_SIZE as u64 + ENTRY_OVERHEAD;
        while g.blocks.len() as u64 * per > self.capacity_bytes {
            let Some((_, victim)) = g.lru.pop_first() else {
                break;
            };
            g.blocks.remove(&victim);
        }
    }

    /// Drops `pba` (its block was freed and may be reused).
    pub fn invalidate(&self, pba: u64) {
        if self.capacity_bytes == 0 {
            return;
        }
        let mut g = self.lock();
        if let Some((_, t)) = g.blocks.remove(&pba) {
            g.lru.remove(&t);
        }
    }

    /// Figures for `dedupd stats`.
    pub fn stats(&self) -> ReadCacheStats {
        let g = self.lock();
        ReadCacheStats {
            capacity_bytes: self.capacity_bytes,
            used_bytes: g.blocks.len() as u64 * (BLOCK_SIZE as u64 + ENTRY_OVERHEAD),
            hits: g.hits,
            misses: g.misses,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lru_and_invalidation() {
        let per = BLOCK_SIZE as u64 + ENTRY_OVERHEAD;
        let c = ReadCache::new(3 * per);
        let mut out = vec![0u8; BLOCK_SIZE];
        for p in 0..3u64 {
            c.insert(Pba(p), &vec![p as u8; BLOCK_SIZE]);
        }
        assert!(c.get(Pba(0), &mut out) && out[0] == 0);
        c.insert(Pba(3), &vec![3u8; BLOCK_SIZE]); // evicts 1, the least recent
        assert!(!c.get(Pba(1), &mut out));
        assert!(c.get(Pba(0), &mut out));
        c.invalidate(0);
        assert!(!c.get(Pba(0), &mut out));
        assert!(c.stats().used_bytes <= 3 * per);
        let off = ReadCache::new(0);
        off.insert(Pba(1), &out);
        assert!(!off.get(Pba(1), &mut out));
    }
}
