//! Sorting (key, PBA) pairs in bounded memory, for rebuilding the
//! fingerprint index when a store opens.
//!
//! Fingerprint keys are uniform, so pairs are spread over `2^bits` buckets
//! by their top bits; a bucket's pairs wait in a 4 KiB buffer and are
//! spilled in 4 KiB chunks to a scratch file. Reading back one bucket at a
//! time and sorting it gives every pair in key order with at most one
//! bucket (twice, while it is sorted) and the buffers in memory. The
//! buckets are at most `memory_bytes / 4 KiB` (one buffer each), so a
//! bucket and its sorted copy stay within `memory_bytes` up to about
//! `memory_bytes² / 8 KiB` bytes of pairs (8 MiB: 8 GiB, 512 M pairs);
//! past that a bucket grows with the number of pairs. With one bucket
//! (few pairs) nothing is spilled. The spilled chunks' places are kept in
//! memory, 16 bytes per 4 KiB chunk: 0.4 % of the pairs' bytes (for the
//! index of a store, one 16-byte pair per stored block: 16 MiB per TiB
//! of stored data).
//!
//! A counting sorter ([`KeySorter::counting`]) treats the second value as a
//! count and merges pairs with equal keys (adding their counts) whenever a
//! buffer fills and while a bucket is read back, so one key pushed
//! millions of times (a block shared by millions of LBAs, to fsck) costs a
//! pair per spilled chunk, not a pair per push.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Pairs per spilled chunk (16 bytes each: 4 KiB).
const CHUNK_PAIRS: usize = 256;
const PAIR_BYTES: usize = 16;
/// Most buckets: 2^16.
const MAX_BITS: u32 = 16;

/// A bucketed external sort of `(key, pba)` pairs by key.
#[derive(Debug)]
pub struct KeySorter {
    bits: u32,
    buffers: Vec<Vec<(u64, u64)>>,
    /// Offset in `scratch` and number of pairs of each bucket's spilled
    /// chunks.
    chunks: Vec<Vec<(u64, u32)>>,
    /// Where chunks go; `None`: kept in `buffers` (no scratch file).
    scratch: Option<File>,
    scratch_len: u64,
    /// Full buffers are spilled; false once a spill failed (the chunks
    /// spilled before it are still read back from `scratch`).
    spilling: bool,
    /// Values are counts; equal keys are merged (see the module docs).
    counting: bool,
    /// Merges of a full in-memory buffer (tests check they stay rare).
    #[cfg(test)]
    memory_merges: u64,
}

impl KeySorter {
    /// A sorter for up to about `expected_pairs` pairs that keeps about
    /// `memory_bytes` in memory at once (one bucket, plus a 4 KiB buffer
    /// per bucket), spilling to `scratch` (an empty file; `None`: sort in
    /// memory). `max_bits` bounds the bucket bits (the index's prefix bits,
    /// so that a bucket holds whole groups).
    pub fn new(
        expected_pairs: u64,
        memory_bytes: u64,
        max_bits: u32,
        scratch: Option<File>,
    ) -> Self {
        let memory_bytes = memory_bytes.max(64 << 10);
        let want = expected_pairs
            .saturating_mul(PAIR_BYTES as u64)
            .div_ceil(memory_bytes);
        let by_buffers = memory_bytes / (CHUNK_PAIRS * PAIR_BYTES) as u64;
        let cap = by_buffers.max(1).ilog2().min(max_bits).min(MAX_BITS);
        let bits = if scratch.is_none() || want <= 1 {
            0
        } else {
            want.next_power_of_two().ilog2().min(cap)
        };
        let n = 1usize << bits;
        KeySorter {
            bits,
            buffers: (0..n).map(|_| Vec::new()).collect(),
            chunks: (0..n).map(|_| Vec::new()).collect(),
            spilling: bits > 0 && scratch.is_some(),
            scratch: if bits == 0 { None } else { scratch },
            scratch_len: 0,
            counting: false,
            #[cfg(test)]
            memory_merges: 0,
        }
    }

    /// [`KeySorter::new`] for (key, count) pairs: pairs with equal keys are
    /// merged into one whose count is their sum, and
    /// [`KeySorter::for_each_sorted`] gives each key once.
    pub fn counting(
        expected_pairs: u64,
        memory_bytes: u64,
        max_bits: u32,
        scratch: Option<File>,
    ) -> Self {
        KeySorter {
            counting: true,
            ..KeySorter::new(expected_pairs, memory_bytes, max_bits, scratch)
        }
    }

    /// Number of buckets (a power of two).
    pub fn buckets(&self) -> usize {
        self.buffers.len()
    }

    fn bucket(&self, key: u64) -> usize {
        if self.bits == 0 {
            0
        } else {
            (key >> (64 - self.bits)) as usize
        }
    }

    /// Adds a pair. After a failed spill (no room for the scratch file)
    /// the pairs stay in memory: the sort still completes, with every pair,
    /// over its memory bound.
    pub fn push(&mut self, key: u64, value: u64) {
        let b = self.bucket(key);
        let buf = &mut self.buffers[b];
        buf.push((key, value));
        let len = buf.len();
        if self.spilling && len == CHUNK_PAIRS {
            if self.counting {
                combine(buf);
                // merging made room: no chunk yet
                if buf.len() <= CHUNK_PAIRS / 2 {
                    return;
                }
            }
            self.spill(b);
        } else if self.counting && len >= CHUNK_PAIRS && len == buf.capacity() {
            // in memory and full: merge before the buffer grows, and grow
            // it only if merging freed less than half (so merges stay
            // apart by at least half a buffer of pushes)
            combine(buf);
            if buf.len() > buf.capacity() / 2 {
                buf.reserve(buf.capacity());
            }
            #[cfg(test)]
            {
                self.memory_merges += 1;
            }
        }
    }

    fn spill(&mut self, b: usize) {
        let Some(f) = &self.scratch else {
            return;
        };
        let mut bytes = [0u8; CHUNK_PAIRS * PAIR_BYTES];
        let n = self.buffers[b].len();
        let bytes = &mut bytes[..n * PAIR_BYTES];
        for (i, (k, p)) in self.buffers[b].iter().enumerate() {
            bytes[i * PAIR_BYTES..i * PAIR_BYTES + 8].copy_from_slice(&k.to_le_bytes());
            bytes[i * PAIR_BYTES + 8..(i + 1) * PAIR_BYTES].copy_from_slice(&p.to_le_bytes());
        }
        if f.write_all_at(bytes, self.scratch_len).is_err() {
            // no room for the scratch file: keep the rest in memory (what
            // was spilled is read back as usual)
            self.spilling = false;
            return;
        }
        self.chunks[b].push((self.scratch_len, n as u32));
        self.scratch_len += bytes.len() as u64;
        self.buffers[b].clear();
    }

    /// Calls `f` with the pairs of each bucket in turn, sorted by key:
    /// together, every pair in key order.
    ///
    /// Errors: reading the scratch file back, or `f`'s error.
    pub fn for_each_sorted<E: From<io::Error>>(
        mut self,
        mut f: impl FnMut(&[(u64, u64)]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut bytes = vec![0u8; CHUNK_PAIRS * PAIR_BYTES];
        for b in 0..self.buffers.len() {
            let mut pairs = std::mem::take(&mut self.buffers[b]);
            let chunks = std::mem::take(&mut self.chunks[b]);
            if let Some(scratch) = self.scratch.as_ref().filter(|_| !chunks.is_empty()) {
                if !self.counting {
                    pairs.reserve(chunks.len() * CHUNK_PAIRS);
                }
                let mut merge_at = pairs.len().max(16 * CHUNK_PAIRS);
                for (off, n) in chunks {
                    let bytes = &mut bytes[..n as usize * PAIR_BYTES];
                    scratch.read_exact_at(bytes, off)?;
                    pairs.extend(bytes.chunks_exact(PAIR_BYTES).map(|c| {
                        (
                            u64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
                            u64::from_le_bytes(c[8..].try_into().expect("8 bytes")),
                        )
                    }));
                    if self.counting && pairs.len() >= merge_at {
                        combine(&mut pairs);
                        merge_at = (2 * pairs.len()).max(16 * CHUNK_PAIRS);
                    }
                }
            }
            if self.counting {
                combine(&mut pairs);
            } else {
                pairs.sort_unstable_by_key(|&(k, _)| k);
            }
            f(&pairs)?;
        }
        Ok(())
    }
}

/// Sorts (key, count) pairs by key and merges equal keys, adding counts
/// (saturating).
fn combine(pairs: &mut Vec<(u64, u64)>) {
    pairs.sort_unstable_by_key(|&(k, _)| k);
    pairs.dedup_by(|next, kept| {
        if next.0 == kept.0 {
            kept.1 = kept.1.saturating_add(next.1);
            true
        } else {
            false
        }
    });
}

/// Calls `f` with each run of two or more pairs with the same key in
/// `pairs` (sorted by key): the candidates for equal fingerprints, which
/// the caller compares in full.
pub fn for_each_equal_key_run(pairs: &[(u64, u64)], mut f: impl FnMut(&[(u64, u64)])) {
    let mut i = 0;
    while i < pairs.len() {
        let mut j = i + 1;
        while j < pairs.len() && pairs[j].0 == pairs[i].0 {
            j += 1;
        }
        if j - i > 1 {
            f(&pairs[i..j]);
        }
        i = j;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(n: u64, memory_bytes: u64, scratch: bool) -> (Vec<(u64, u64)>, usize) {
        let file = scratch.then(|| tempfile::tempfile().unwrap());
        let mut s = KeySorter::new(n, memory_bytes, 20, file);
        let buckets = s.buckets();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push(x, i);
        }
        let mut out = Vec::new();
        s.for_each_sorted::<io::Error>(|pairs| {
            out.extend_from_slice(pairs);
            Ok(())
        })
        .unwrap();
        (out, buckets)
    }

    #[test]
    fn a_damaged_expected_count_does_not_overflow() {
        // (derived from a file's length, which damage may make huge)
        let s = KeySorter::new(u64::MAX, 1 << 20, 14, Some(tempfile::tempfile().unwrap()));
        assert!(s.buckets() <= 1 << 14);
    }

    #[test]
    fn spilled_buckets_come_back_in_key_order() {
        let (a, buckets) = sorted(100_000, 64 << 10, true);
        assert!(buckets > 1, "{buckets}");
        let (b, one) = sorted(100_000, 64 << 20, true);
        assert_eq!(one, 1);
        assert_eq!(a.len(), 100_000);
        assert!(a.windows(2).all(|w| w[0].0 <= w[1].0));
        assert_eq!(a, b);
        let mut pbas: Vec<u64> = a.iter().map(|p| p.1).collect();
        pbas.sort_unstable();
        assert!(pbas.iter().copied().eq(0..100_000));
    }

    #[test]
    fn a_spill_that_fails_midway_loses_no_pair() {
        use std::os::fd::FromRawFd;
        // a memfd that refuses to grow once sealed: the spills after the
        // seal fail (as on a full file system), those before it stand
        // SAFETY: a fresh memfd, owned by the File made from it.
        let fd = unsafe { libc::memfd_create(c"keysort".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: `fd` is open and owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        let seal = file.try_clone().unwrap();
        let n = 20_000u64;
        let mut s = KeySorter::new(n, 64 << 10, 20, Some(file));
        assert!(s.buckets() > 1);
        let key = |i: u64| (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for i in 0..n / 2 {
            s.push(key(i), i);
        }
        assert!(s.scratch_len > 0, "nothing was spilled before the seal");
        let spilled = s.scratch_len;
        // SAFETY: fcntl on an open descriptor.
        let r = unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&seal),
                libc::F_ADD_SEALS,
                libc::F_SEAL_GROW,
            )
        };
        assert_eq!(r, 0);
        for i in n / 2..n {
            s.push(key(i), i);
        }
        assert_eq!(s.scratch_len, spilled, "a spill grew the sealed file");
        assert!(!s.spilling);
        let mut out = Vec::new();
        s.for_each_sorted::<io::Error>(|pairs| {
            out.extend_from_slice(pairs);
            Ok(())
        })
        .unwrap();
        assert!(out.windows(2).all(|w| w[0].0 <= w[1].0));
        let mut want: Vec<(u64, u64)> = (0..n).map(|i| (key(i), i)).collect();
        want.sort_unstable();
        out.sort_unstable();
        assert_eq!(out, want);
    }

    #[test]
    fn a_counting_sorter_merges_a_hot_key_instead_of_holding_each_push() {
        let unique = 20_000u64;
        let hot_pushes = 500_000u64;
        let hot = 0x8000_0000_0000_0000u64;
        let mut s =
            KeySorter::counting(unique + hot_pushes, 64 << 10, 20, tempfile::tempfile().ok());
        assert!(s.buckets() > 1);
        let key = |i: u64| (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for i in 0..unique {
            s.push(key(i), 1);
            for _ in 0..hot_pushes / unique {
                s.push(hot, 1);
            }
        }
        // the hot key's pushes fold into a pair per chunk at most
        assert!(
            s.scratch_len < (unique + hot_pushes / 128) * PAIR_BYTES as u64,
            "{} bytes spilled",
            s.scratch_len
        );
        let mut seen = std::collections::HashMap::new();
        let mut largest = 0;
        s.for_each_sorted::<io::Error>(|pairs| {
            largest = largest.max(pairs.len());
            assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0), "a key twice");
            for &(k, n) in pairs {
                seen.insert(k, n);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(seen.len() as u64, unique + 1);
        assert_eq!(seen[&hot], hot_pushes);
        assert!((0..unique).all(|i| seen[&key(i)] == 1));
        // a bucket comes back with each key once: no bucket holds the
        // half million pushes
        assert!(largest < 20_000, "{largest} pairs in one bucket");
    }

    #[test]
    fn a_counting_sorter_in_memory_merges_rarely() {
        // one bucket (no scratch file); just under a power of two distinct
        // keys, then pushed again and again: a merge per push would sort
        // the whole buffer each time
        let distinct = (1u64 << 14) - 1;
        let mut s = KeySorter::counting(distinct, 64 << 10, 20, None);
        assert_eq!(s.buckets(), 1);
        let rounds = 20;
        for _ in 0..rounds {
            for k in 0..distinct {
                s.push(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1);
            }
        }
        let pushes = rounds * distinct;
        assert!(
            s.memory_merges <= 2 * pushes / distinct + 16,
            "{} merges for {pushes} pushes",
            s.memory_merges
        );
        let mut seen = 0;
        s.for_each_sorted::<io::Error>(|pairs| {
            assert!(pairs.iter().all(|&(_, n)| n == rounds));
            seen += pairs.len() as u64;
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, distinct);
    }

    #[test]
    fn equal_key_runs_are_found() {
        let pairs = [
            (1, 10),
            (2, 20),
            (2, 21),
            (3, 30),
            (4, 40),
            (4, 41),
            (4, 42),
        ];
        let mut runs = Vec::new();
        for_each_equal_key_run(&pairs, |r| runs.push(r.to_vec()));
        assert_eq!(
            runs,
            vec![vec![(2, 20), (2, 21)], vec![(4, 40), (4, 41), (4, 42)]]
        );
    }

    #[test]
    fn without_a_scratch_file_everything_stays_in_memory() {
        let (a, buckets) = sorted(10_000, 64 << 10, false);
        assert_eq!(buckets, 1);
        assert!(a.windows(2).all(|w| w[0].0 <= w[1].0));
        assert_eq!(a.len(), 10_000);
    }
}
