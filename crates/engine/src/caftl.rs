//! CAFTL's two ways to hash less in the write path (Chen et al., FAST '11,
//! as SmartDedup §4.1 describes and compares them), as engine options:
//!
//! - **Pre-hashing**: every non-zero block gets a CRC-32C first (cheap:
//!   hardware-assisted); only a block whose CRC was seen before is
//!   fingerprinted inline. A CRC never seen means the content is new, so
//!   the block is stored without a fingerprint and its CRC remembered. The
//!   first repeat of any content is therefore missed inline (SmartDedup
//!   §4.1's observation); the out-of-line pass finds it later. The CRCs
//!   live in a direct-mapped table of `prehash_bytes` (8 bytes per slot):
//!   a CRC that lands on an occupied slot replaces it, so the table forgets
//!   old content instead of growing.
//! - **Sampling**: of a write request with several non-zero blocks only
//!   one, the sample, is fingerprinted and looked up first — the block
//!   with the largest CRC-32C, a content-defined choice so equal requests
//!   pick equal samples. The other blocks are fingerprinted only if the
//!   sample is a duplicate; otherwise the request is stored without
//!   fingerprints.
//!
//! Blocks these filters turn away are stored "unhashed" and recorded in
//! the skipped buffer, exactly like blocks adaptive selectivity leaves out,
//! so hybrid dedup stays exact.

use serde::{Deserialize, Serialize};

/// Figures of the CAFTL filters, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaftlStats {
    /// Bytes of the pre-hash CRC table (0: pre-hashing off).
    pub prehash_table_bytes: u64,
    /// Blocks whose CRC-32C was computed by pre-hashing.
    pub blocks_prehashed: u64,
    /// Blocks stored unfingerprinted because their CRC was not seen before.
    pub prehash_misses: u64,
    /// Write requests whose sample was fingerprinted first (sampling on).
    pub requests_sampled: u64,
    /// Blocks stored unfingerprinted because their request's sample was
    /// not a duplicate.
    pub sample_misses: u64,
}

/// Largest pre-hash table, bytes (1 GiB: 128 Mi CRC slots); smallest
/// non-zero one is one slot (8 bytes).
pub const MAX_PREHASH_BYTES: u64 = 1 << 30;

/// The pre-hash CRC set: a direct-mapped table of CRC-32C values.
#[derive(Debug, Default)]
pub struct PrehashTable {
    /// Slot value: CRC | 1 << 32 when occupied (0: empty); u64 so that any
    /// CRC, 0 included, can be stored.
    slots: Vec<u64>,
    stats: CaftlStats,
}

impl PrehashTable {
    /// A table of about `bytes` (8 bytes per slot; 0 disables pre-hashing).
    pub fn new(bytes: u64) -> Self {
        let n = (bytes / 8) as usize;
        PrehashTable {
            slots: vec![0; n],
            stats: CaftlStats {
                prehash_table_bytes: (n * 8) as u64,
                ..CaftlStats::default()
            },
        }
    }

    /// True if pre-hashing is on.
    pub fn enabled(&self) -> bool {
        !self.slots.is_empty()
    }

    /// Records `crc` and tells whether it was in the table before (the
    /// content may be a duplicate). Always true when pre-hashing is off.
    pub fn seen_before(&mut self, crc: u32) -> bool {
        if self.slots.is_empty() {
            return true;
        }
        self.stats.blocks_prehashed += 1;
        // spread CRCs over the slots (Fibonacci hashing)
        let h = u64::from(crc).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let slot = ((u128::from(h) * self.slots.len() as u128) >> 64) as usize;
        let tagged = u64::from(crc) | 1 << 32;
        let seen = self.slots[slot] == tagged;
        if !seen {
            self.slots[slot] = tagged;
            self.stats.prehash_misses += 1;
        }
        seen
    }

    /// Counts a sampled request and the blocks its missed sample turned away.
    pub fn note_sample(&mut self, turned_away_blocks: u64) {
        self.stats.requests_sampled += 1;
        self.stats.sample_misses += turned_away_blocks;
    }

    /// The figures so far.
    pub fn stats(&self) -> CaftlStats {
        self.stats
    }
}

/// The sample of a request: the index of the candidate with the largest
/// CRC (first on ties); `None` if fewer than two candidates.
pub fn sample(crcs: &[Option<u32>]) -> Option<usize> {
    let mut candidates = crcs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.map(|c| (i, c)));
    let first = candidates.next()?;
    let mut best = first;
    let mut count = 1;
    for (i, c) in candidates {
        count += 1;
        if c > best.1 {
            best = (i, c);
        }
    }
    (count >= 2).then_some(best.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prehash_remembers_and_forgets_by_slot() {
        let mut t = PrehashTable::new(8 * 1024);
        assert!(t.enabled());
        assert!(!t.seen_before(42));
        assert!(t.seen_before(42));
        assert!(!t.seen_before(0));
        assert!(t.seen_before(0));
        let s = t.stats();
        assert_eq!((s.blocks_prehashed, s.prehash_misses), (4, 2));
        // a tiny table forgets: of many CRCs, early ones are overwritten
        let mut small = PrehashTable::new(64);
        for c in 0..1000 {
            small.seen_before(c);
        }
        assert!((0..1000).filter(|&c| small.seen_before(c)).count() <= 8);
        let mut off = PrehashTable::new(0);
        assert!(!off.enabled());
        assert!(off.seen_before(7));
        assert_eq!(off.stats().blocks_prehashed, 0);
    }

    #[test]
    fn sample_is_the_largest_crc_of_two_or_more() {
        assert_eq!(sample(&[Some(3), None, Some(9), Some(1)]), Some(2));
        assert_eq!(sample(&[None, Some(9)]), None);
        assert_eq!(sample(&[]), None);
        assert_eq!(sample(&[Some(5), Some(5)]), Some(0));
    }
}
