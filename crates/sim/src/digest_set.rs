//! The set of distinct trace digests a replay has seen (the exact,
//! unbounded dedup computed alongside the engine's).
//!
//! An open-addressing table of 16-byte digests in buckets of four (one
//! 64-byte cache line each), probed linearly bucket by bucket, at most 7/8
//! full (as full as the standard library's hash set, without its control
//! bytes). The caller supplies each digest's 64-bit hash, which must be
//! the set's [`DigestSet::hash`] of it (the replay computes it once per
//! digest, when it reads the request ahead of its turn), so an insert is
//! one probe into one cache line in the common case, and the slot can be
//! prefetched before the insert ([`DigestSet::prefetch`]) while other work
//! runs. A general hash set costs two dependent cache misses per insert
//! (control bytes, then the bucket).
//!
//! The hash is keyed anew for every set (the standard library's
//! `RandomState`: SipHash-1-3 with random keys), as a trace is input from
//! anywhere: with a fixed hash, a crafted trace of digests that all land in
//! one bucket would make every insert probe all the earlier ones (time
//! quadratic in the trace). Which digests are in the set does not depend on
//! the keys, so neither does any figure of a replay.
//!
//! The all-zero digest marks an empty slot; when it occurs as a digest it
//! is remembered by a flag instead.
//!
//! The table is an anonymous memory mapping advised to use transparent
//! huge pages: probes are random over tens of MiB, and with 4 KiB pages
//! nearly every one also missed the TLB (a page walk, which a prefetch
//! waits for too).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::ptr::NonNull;

use crate::request::Digest;

/// Buckets of a new table (grows by doubling).
const INITIAL_BUCKETS: usize = 1 << 10;
/// Digests per bucket: 4 × 16 bytes, one cache line.
const BUCKET_SLOTS: usize = 4;
const EMPTY: Digest = [0; 16];

/// One cache line of slots; [`EMPTY`] slots are free and come last.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Bucket([Digest; BUCKET_SLOTS]);

/// Zero-filled buckets in an anonymous mapping of their own (see the
/// module docs).
struct Table {
    ptr: NonNull<Bucket>,
    len: usize,
}

impl Table {
    /// `len` empty buckets. Aborts like a failed allocation if the mapping
    /// fails.
    fn new(len: usize) -> Table {
        let bytes = len * std::mem::size_of::<Bucket>();
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched. The kernel zero-fills it, and all-zero bytes are valid
        // (empty) buckets.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::array::<Bucket>(len).expect("table size"),
            );
        }
        #[cfg(target_os = "linux")]
        // SAFETY: advice on the mapping just made; failure (no THP support)
        // leaves ordinary pages, which is fine.
        unsafe {
            libc::madvise(p, bytes, libc::MADV_HUGEPAGE);
        }
        Table {
            ptr: NonNull::new(p.cast()).expect("mmap returns a non-null address"),
            len,
        }
    }

    fn buckets(&self) -> &[Bucket] {
        // SAFETY: `len` initialized (zero-filled) buckets, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn buckets_mut(&mut self) -> &mut [Bucket] {
        // SAFETY: as in `buckets`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Table::new`, unmapped once.
        unsafe {
            libc::munmap(
                self.ptr.as_ptr().cast(),
                self.len * std::mem::size_of::<Bucket>(),
            );
        }
    }
}

/// A set of distinct digests, probed by their [`DigestSet::hash`] (see
/// the module docs).
pub struct DigestSet {
    /// Power-of-two table of buckets.
    table: Table,
    /// Occupied slots.
    len: usize,
    /// The all-zero digest is in the set.
    has_zero: bool,
    /// Random keys of the set's hash.
    keys: RandomState,
}

impl Default for DigestSet {
    fn default() -> Self {
        DigestSet {
            table: Table::new(INITIAL_BUCKETS),
            len: 0,
            has_zero: false,
            keys: RandomState::new(),
        }
    }
}

impl DigestSet {
    /// The hash by which this set places `d`: SipHash-1-3 under the set's
    /// random keys, over the digest's two 64-bit halves.
    #[inline]
    pub fn hash(&self, d: &Digest) -> u64 {
        let mut h = self.keys.build_hasher();
        h.write_u64(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")));
        h.write_u64(u64::from_le_bytes(d[8..].try_into().expect("8 bytes")));
        h.finish()
    }

    /// Number of distinct digests inserted.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.has_zero)
    }

    fn bucket_of(&self, hash: u64) -> usize {
        // the top bits (the low ones may be weaker in some mixes)
        let bits = self.table.len.trailing_zeros();
        (hash >> (64 - bits)) as usize
    }

    /// Hints that the bucket of the digest hashing to `hash` will be
    /// probed soon, and the one after it (where a probe overflows to).
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        let b = self.bucket_of(hash);
        let buckets = self.table.buckets();
        dedupd_engine::prefetch::prefetch_read(&buckets[b]);
        dedupd_engine::prefetch::prefetch_read(&buckets[(b + 1) & (buckets.len() - 1)]);
    }

    /// Inserts `d`, whose [`DigestSet::hash`] is `hash`; true if it was
    /// not in the set.
    #[inline]
    pub fn insert(&mut self, d: &Digest, hash: u64) -> bool {
        debug_assert_eq!(hash, self.hash(d));
        if *d == EMPTY {
            return !std::mem::replace(&mut self.has_zero, true);
        }
        let mask = self.table.len - 1;
        let mut b = self.bucket_of(hash);
        loop {
            for s in &mut self.table.buckets_mut()[b].0 {
                if *s == *d {
                    return false;
                }
                if *s == EMPTY {
                    *s = *d;
                    self.len += 1;
                    if self.len * 8 > self.table.len * BUCKET_SLOTS * 7 {
                        self.grow();
                    }
                    return true;
                }
            }
            b = (b + 1) & mask;
        }
    }

    /// Doubles the table (hashes are not stored: they are recomputed).
    /// Rare: kept out of the insert path's code.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let doubled = Table::new(self.table.len * 2);
        let old = std::mem::replace(&mut self.table, doubled);
        let mask = self.table.len - 1;
        for d in old.buckets().iter().flat_map(|b| b.0.iter()) {
            if *d == EMPTY {
                continue;
            }
            let mut b = self.bucket_of(self.hash(d));
            loop {
                if let Some(s) = self.table.buckets_mut()[b]
                    .0
                    .iter_mut()
                    .find(|s| **s == EMPTY)
                {
                    *s = *d;
                    break;
                }
                b = (b + 1) & mask;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// One step of splitmix64, to make test digests.
    fn splitmix64(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    impl DigestSet {
        /// Buckets probed to find `d`, which is in the set.
        fn probes(&self, d: &Digest) -> usize {
            let mask = self.table.len - 1;
            let mut b = self.bucket_of(self.hash(d));
            let mut n = 1;
            while !self.table.buckets()[b].0.contains(d) {
                b = (b + 1) & mask;
                n += 1;
            }
            n
        }
    }

    #[test]
    fn counts_distinct_digests_like_a_hash_set() {
        let mut set = DigestSet::default();
        let mut reference = HashSet::new();
        let mut state = 7u64;
        for i in 0..200_000u64 {
            state = splitmix64(state);
            // about a third repeat an earlier digest; some are all zero
            let v = if i % 3 == 0 { state % 1000 } else { state };
            let mut d = [0u8; 16];
            if i % 97 != 0 {
                d[..8].copy_from_slice(&v.to_le_bytes());
                d[8..].copy_from_slice(&(v >> 3).to_be_bytes());
            }
            set.prefetch(set.hash(&d));
            assert_eq!(set.insert(&d, set.hash(&d)), reference.insert(d));
        }
        assert_eq!(set.len(), reference.len());
    }

    /// Digests whose hashes all land in the last bucket still probe to
    /// each other: long runs across buckets, the wrap-around, and growth.
    #[test]
    fn a_crowded_bucket_spills_over_and_wraps() {
        let mut set = DigestSet::default();
        let bits = set.table.len.trailing_zeros();
        // hashes in the last bucket: probes wrap to bucket 0
        let last = u64::MAX >> (64 - bits) << (64 - bits);
        let mut found = Vec::new();
        let mut x = 1u64;
        while found.len() < 40 {
            x += 1;
            let mut d = [1u8; 16];
            d[..8].copy_from_slice(&x.to_le_bytes());
            if set.hash(&d) >= last {
                found.push(d);
            }
        }
        for d in &found {
            assert!(set.insert(d, set.hash(d)));
        }
        for d in &found {
            assert!(!set.insert(d, set.hash(d)));
        }
        assert_eq!(set.len(), found.len());
    }

    /// Digests made to share one value of a fixed 64-bit mix (here the
    /// replay's fingerprint mix, splitmix64 of each half: any `hi`, and
    /// `lo` solving for the value) spread over the table all the same:
    /// the set's hash is keyed, so a trace cannot choose its buckets.
    #[test]
    fn digests_crafted_to_collide_under_a_fixed_mix_spread_out() {
        let mix = |d: &Digest| {
            let lo = u64::from_le_bytes(d[..8].try_into().unwrap());
            let hi = u64::from_le_bytes(d[8..].try_into().unwrap());
            splitmix64(lo ^ splitmix64(hi))
        };
        let target = 0x0123_4567_89ab_cdefu64;
        let crafted: Vec<Digest> = (1..=8192u64)
            .map(|hi| {
                let mut d = [0u8; 16];
                d[..8].copy_from_slice(&(target ^ splitmix64(hi)).to_le_bytes());
                d[8..].copy_from_slice(&hi.to_le_bytes());
                d
            })
            .collect();
        assert!(crafted.iter().all(|d| mix(d) == splitmix64(target)));
        let mut set = DigestSet::default();
        for d in &crafted {
            assert!(set.insert(d, set.hash(d)));
        }
        assert_eq!(set.len(), crafted.len());
        // at most half full: a probe finds its digest within a few
        // buckets (all in one bucket's run, it would take up to 2048)
        let longest = crafted.iter().map(|d| set.probes(d)).max().unwrap();
        assert!(longest <= 32, "a probe visited {longest} buckets");
    }

    /// Two sets hash alike only by chance: each has keys of its own.
    #[test]
    fn each_set_has_keys_of_its_own() {
        let (a, b) = (DigestSet::default(), DigestSet::default());
        let d = [7u8; 16];
        assert_eq!(a.hash(&d), a.hash(&d));
        assert_ne!(a.hash(&d), b.hash(&d));
    }
}
