//! The sequence threshold T of iDedup (Srinivasan et al., FAST '12), as
//! SmartDedup §4.5 "Fragmentation Resistance" applies it: inline dedup
//! shares a stored block only when the write belongs to a run of at least
//! T consecutive duplicate blocks whose stored copies are physically
//! contiguous too (PBA p, p + 1, …). Shorter runs are written as new
//! blocks, so a file is not scattered over many one-block extents; T = 1
//! turns the filter off.
//!
//! Runs are tracked per volume across requests: a sequential stream of
//! small writes forms one run, also while other streams write elsewhere in
//! the volume (up to [`RUNS_PER_VOLUME`] runs in progress per volume, the
//! least recently continued dropped first; iDedup keeps such state per
//! stream). A run that has not reached T when its request ends is written
//! as new (the decision cannot wait); when the next request continues it
//! and the run reaches T, the continuation is shared.
//!
//! Memory: a 24-byte entry per run in progress, at most
//! [`RUNS_PER_VOLUME`] per volume.

use std::collections::HashMap;

use crate::block::VolumeId;

/// What inline dedup found for one block of a write request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// Not a duplicate (new content, zero block, or not fingerprinted).
    Other,
    /// Duplicate of the block stored at this PBA.
    Stored(u64),
    /// Duplicate of block `j` of the same request (stored by it).
    InRequest(usize),
}

impl Candidate {
    /// True if `next` continues a run ending with `self`: the next PBA, or
    /// the next block of the request.
    fn continued_by(self, next: Candidate) -> bool {
        match (self, next) {
            (Candidate::Stored(p), Candidate::Stored(q)) => q == p.wrapping_add(1),
            (Candidate::InRequest(i), Candidate::InRequest(j)) => j == i + 1,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Run {
    /// LBA the run would continue at.
    next_lba: u64,
    /// PBA the run's next block would have to duplicate.
    next_pba: u64,
    /// Blocks in the run so far.
    len_blocks: u64,
}

/// Runs in progress a volume keeps at most (separate sequential streams
/// writing one volume at once).
pub const RUNS_PER_VOLUME: usize = 8;

/// Runs in progress, per volume, least recently continued first; see the
/// module docs.
#[derive(Debug, Default)]
pub struct SequenceRuns {
    runs: HashMap<VolumeId, Vec<Run>>,
}

impl SequenceRuns {
    /// Decides which duplicates of a write request of `cands.len()` blocks
    /// at LBA `first` of `vol` inline dedup may share under threshold
    /// `threshold_blocks` (≥ 1): `keep[i]` is true for a duplicate in a run
    /// of at least that many blocks (counting the blocks of earlier
    /// requests that the run continues), false for a short run's blocks
    /// and for [`Candidate::Other`].
    pub fn filter(
        &mut self,
        vol: VolumeId,
        first: u64,
        threshold_blocks: u32,
        cands: &[Candidate],
    ) -> Vec<bool> {
        let n = cands.len();
        let mut keep = vec![false; n];
        let runs = self.runs.entry(vol).or_default();
        // runs that would continue at this request's LBA end here: the one
        // whose next PBA it duplicates carries on, the others are gone
        let continued = match cands.first() {
            Some(&Candidate::Stored(p)) => runs
                .iter()
                .rposition(|r| r.next_lba == first && r.next_pba == p),
            _ => None,
        };
        let carried = continued.map(|at| runs.remove(at));
        runs.retain(|r| r.next_lba != first);
        let t = u64::from(threshold_blocks.max(1));
        let mut i = 0;
        while i < n {
            if cands[i] == Candidate::Other {
                i += 1;
                continue;
            }
            let start = i;
            i += 1;
            while i < n && cands[i - 1].continued_by(cands[i]) {
                i += 1;
            }
            let before = match (start, carried, cands[start]) {
                (0, Some(r), Candidate::Stored(p)) if r.next_lba == first && r.next_pba == p => {
                    r.len_blocks
                }
                _ => 0,
            };
            let len = before + (i - start) as u64;
            if len >= t {
                keep[start..i].fill(true);
            }
            if i == n {
                if let Candidate::Stored(p) = cands[n - 1] {
                    if runs.len() == RUNS_PER_VOLUME {
                        runs.remove(0);
                    }
                    runs.push(Run {
                        next_lba: first + n as u64,
                        next_pba: p + 1,
                        len_blocks: len,
                    });
                }
            }
        }
        if runs.is_empty() {
            self.runs.remove(&vol);
        }
        keep
    }

    /// Forgets the runs of `vol` (deleted or resized).
    pub fn forget(&mut self, vol: VolumeId) {
        self.runs.remove(&vol);
    }

    /// Bytes of memory held.
    pub fn memory_bytes(&self) -> u64 {
        let lists: usize = self
            .runs
            .values()
            .map(|l| l.capacity() * std::mem::size_of::<Run>())
            .sum();
        (self.runs.capacity() * (std::mem::size_of::<(VolumeId, Vec<Run>)>() + 8) + lists) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::Candidate::{InRequest, Other, Stored};
    use super::*;

    const V: VolumeId = VolumeId(1);

    #[test]
    fn threshold_one_keeps_every_duplicate() {
        let mut s = SequenceRuns::default();
        let c = [Stored(5), Other, Stored(9), InRequest(1)];
        assert_eq!(s.filter(V, 0, 1, &c), vec![true, false, true, true]);
    }

    #[test]
    fn short_and_scattered_runs_are_dropped() {
        let mut s = SequenceRuns::default();
        // 3 contiguous, then 2 non-contiguous, then 2 contiguous
        let c = [
            Stored(10),
            Stored(11),
            Stored(12),
            Other,
            Stored(40),
            Stored(7),
            Other,
            Stored(3),
            Stored(4),
        ];
        let keep = s.filter(V, 100, 3, &c);
        assert_eq!(
            keep,
            vec![true, true, true, false, false, false, false, false, false]
        );
    }

    #[test]
    fn runs_continue_across_requests_of_a_volume() {
        let mut s = SequenceRuns::default();
        assert_eq!(s.filter(V, 0, 4, &[Stored(20), Stored(21)]), [false, false]);
        // continues at LBA 2 with PBA 22: the run reaches 4
        assert_eq!(s.filter(V, 2, 4, &[Stored(22), Stored(23)]), [true, true]);
        // another volume's write does not break it
        assert_eq!(s.filter(VolumeId(2), 0, 4, &[Stored(24)]), [false]);
        assert_eq!(s.filter(V, 4, 4, &[Stored(24)]), [true]);
        // a gap in LBAs starts over
        assert_eq!(s.filter(V, 9, 4, &[Stored(25)]), [false]);
    }

    #[test]
    fn interleaved_streams_of_one_volume_keep_their_runs() {
        let mut s = SequenceRuns::default();
        // two sequential streams, one block a request, alternating: LBAs
        // 0.. onto PBAs 100.., LBAs 50.. onto PBAs 300..
        let mut kept = Vec::new();
        for k in 0..4u64 {
            kept.extend(s.filter(V, k, 3, &[Stored(100 + k)]));
            kept.extend(s.filter(V, 50 + k, 3, &[Stored(300 + k)]));
        }
        // each reaches 3 at its third block
        assert_eq!(kept, [false, false, false, false, true, true, true, true]);
        // past RUNS_PER_VOLUME streams, the least recently continued goes
        for k in 0..RUNS_PER_VOLUME as u64 {
            s.filter(V, 1000 + 10 * k, 3, &[Stored(5000 + 10 * k)]);
        }
        assert_eq!(s.filter(V, 4, 3, &[Stored(104)]), [false]);
        assert!(s.memory_bytes() > 0);
        // (the last stream would continue: LBA 1071 onto PBA 5071, a run
        // of 2) — forgotten with its volume
        s.forget(V);
        assert_eq!(s.filter(V, 1071, 2, &[Stored(5071)]), [false]);
        assert_eq!(s.filter(V, 1072, 2, &[Stored(5072)]), [true]);
    }

    #[test]
    fn a_rewritten_run_continues_from_its_new_copies() {
        let mut s = SequenceRuns::default();
        // LBAs 0–1 duplicate PBAs 100–101, then are rewritten as
        // duplicates of PBAs 500–501: both runs would go on at LBA 2
        s.filter(V, 0, 3, &[Stored(100), Stored(101)]);
        s.filter(V, 0, 3, &[Stored(500), Stored(501)]);
        // LBA 2 duplicating PBA 502 continues the newer run to 3
        assert_eq!(s.filter(V, 2, 3, &[Stored(502)]), [true]);
        // and the older one ended there: PBA 102 next is no continuation
        assert_eq!(s.filter(V, 2, 3, &[Stored(102)]), [false]);
    }

    #[test]
    fn in_request_duplicates_form_runs_by_position() {
        let mut s = SequenceRuns::default();
        let c = [Other, Other, InRequest(0), InRequest(1), InRequest(0)];
        assert_eq!(s.filter(V, 0, 2, &c), [false, false, true, true, false]);
    }
}
