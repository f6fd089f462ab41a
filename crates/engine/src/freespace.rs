//! Free PBAs below the high-water mark, as a sparse bitmap.
//!
//! A chunk of 512 bytes holds one bit for each of 4096 consecutive PBAs and
//! exists only while one of them is free, so the structure costs nothing
//! when no block is free and at most about 0.13 bytes per PBA of the store
//! when free blocks are scattered everywhere (a heap of free PBAs cost 8
//! bytes per free block). Allocation takes the lowest free PBA, so
//! consecutive allocations get ascending PBAs that coalesce into one data
//! write.

use std::collections::BTreeMap;

const WORDS: usize = 64;
const CHUNK_PBAS: u64 = (WORDS * 64) as u64;
/// Bytes of one chunk in memory: the bits, the box and the tree's share.
const CHUNK_BYTES: u64 = (WORDS * 8) as u64 + 32;

/// A set of free PBAs with lowest-first allocation.
#[derive(Debug, Default, Clone)]
pub struct FreeSpace {
    chunks: BTreeMap<u64, Box<[u64; WORDS]>>,
    len: u64,
    /// Inserts of a PBA that was free already (a double free: a bug).
    doubled: u64,
}

impl FreeSpace {
    /// Adds `pba`; false (and counted, see [`FreeSpace::doubled`]) if it
    /// was free already.
    pub fn insert(&mut self, pba: u64) -> bool {
        let chunk = self
            .chunks
            .entry(pba / CHUNK_PBAS)
            .or_insert_with(|| Box::new([0; WORDS]));
        let (w, bit) = (((pba % CHUNK_PBAS) / 64) as usize, pba % 64);
        if chunk[w] & (1 << bit) != 0 {
            self.doubled += 1;
            return false;
        }
        chunk[w] |= 1 << bit;
        self.len += 1;
        true
    }

    /// Takes the lowest free PBA.
    pub fn pop_lowest(&mut self) -> Option<u64> {
        let mut entry = self.chunks.first_entry()?;
        let base = *entry.key() * CHUNK_PBAS;
        let chunk = entry.get_mut();
        let w = chunk.iter().position(|&x| x != 0)?;
        let bit = chunk[w].trailing_zeros() as u64;
        chunk[w] &= !(1 << bit);
        if chunk[w..].iter().all(|&x| x == 0) {
            entry.remove();
        }
        self.len -= 1;
        Some(base + w as u64 * 64 + bit)
    }

    /// True if `pba` is free.
    pub fn contains(&self, pba: u64) -> bool {
        self.chunks
            .get(&(pba / CHUNK_PBAS))
            .is_some_and(|c| c[((pba % CHUNK_PBAS) / 64) as usize] & (1 << (pba % 64)) != 0)
    }

    /// Number of free PBAs.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True if no PBA is free.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Double frees seen (a PBA inserted while free).
    pub fn doubled(&self) -> u64 {
        self.doubled
    }

    /// Every free PBA, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.chunks.iter().flat_map(|(&k, c)| {
            c.iter().enumerate().flat_map(move |(w, &word)| {
                let base = k * CHUNK_PBAS + w as u64 * 64;
                (0..64u64)
                    .filter(move |b| word & (1 << b) != 0)
                    .map(move |b| base + b)
            })
        })
    }

    /// Bytes of memory held.
    pub fn memory_bytes(&self) -> u64 {
        self.chunks.len() as u64 * CHUNK_BYTES
    }
}

impl Extend<u64> for FreeSpace {
    fn extend<I: IntoIterator<Item = u64>>(&mut self, iter: I) {
        for p in iter {
            self.insert(p);
        }
    }
}

impl FromIterator<u64> for FreeSpace {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut f = FreeSpace::default();
        f.extend(iter);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Behaves as a min-heap of distinct PBAs.
        #[test]
        fn matches_a_sorted_set(ops in proptest::collection::vec((any::<bool>(), 0u64..20_000), 0..400)) {
            let mut f = FreeSpace::default();
            let mut model = std::collections::BTreeSet::new();
            for (pop, pba) in ops {
                if pop {
                    prop_assert_eq!(f.pop_lowest(), model.pop_first());
                } else {
                    prop_assert_eq!(f.insert(pba), model.insert(pba));
                }
                prop_assert_eq!(f.len(), model.len() as u64);
            }
            prop_assert!(f.iter().eq(model.iter().copied()));
            for p in [0, 63, 64, 4095, 4096, 19_999] {
                prop_assert_eq!(f.contains(p), model.contains(&p));
            }
        }
    }

    #[test]
    fn memory_follows_the_chunks_in_use() {
        let mut f = FreeSpace::default();
        assert_eq!(f.memory_bytes(), 0);
        f.extend(0..4096);
        assert_eq!(f.memory_bytes(), CHUNK_BYTES);
        f.insert(1 << 30);
        assert_eq!(f.memory_bytes(), 2 * CHUNK_BYTES);
        while f.pop_lowest().is_some() {}
        assert_eq!(f.memory_bytes(), 0);
        assert!(f.insert(5));
        assert!(!f.insert(5));
        assert_eq!(f.doubled(), 1);
    }
}
