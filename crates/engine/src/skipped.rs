//! The skipped buffer (SmartDedup §3.3): blocks written without an inline
//! match, waiting for out-of-line dedup.
//!
//! A fixed-size table of (volume, LBA) records — the fingerprint is found
//! through the map and the reverse index when the record is processed.
//! When the table is full it degrades to coarser records so nothing is
//! forgotten: dirty regions of 256 blocks (1 MiB) per volume, and when those
//! fill their share too, whole volumes (SmartDedup falls back to inode
//! numbers the same way). A write to a volume pending whole, behind its
//! scan's cursor, is recorded as any other while there is room; in a full
//! buffer the scan comes back to it at the end. Memory: 16 bytes per
//! record; regions and volumes are counted in the same budget.
//!
//! The buffer lives in memory and is checkpointed with the metadata: every
//! metadata checkpoint (and clean shutdown) first saves it to
//! `<store>/skipped.json`, so the saved copy holds a record of every block
//! whose write the checkpoint puts in place. Writes after the checkpoint
//! are in the journal; at the next start each volume-map page the journal
//! replays adds its LBAs as dirty regions. A crash therefore loses no
//! pending work of committed writes; what it can lose is the records the
//! out-of-line worker took (and merges a finished scan dropped) after the
//! last commit a checkpoint put in place and before the checkpoint saved
//! its copy (or before the copy saved when a volume's sequence threshold
//! is lowered to 1), if their remaps were not committed before the crash,
//! and, if
//! `skipped.json` cannot be written (a full file system), the records
//! since its last save. Only space is lost, never data. A damaged `skipped.json`
//! queues every volume whole. `dedupd dedup --offline` (a full pass) finds
//! any duplicate all the same.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::block::VolumeId;

/// Largest capacity a skipped buffer may be given, bytes (256 MiB: 16 Mi
/// records, whose saved copy, at up to 26 bytes of JSON each, stays well
/// within what a start reads of it).
pub const MAX_CAPACITY_BYTES: usize = 256 << 20;

/// Smallest capacity a skipped buffer may be given, bytes (16 records).
pub const MIN_CAPACITY_BYTES: usize = RECORD_BYTES * 16;
/// Blocks per dirty region, the first coarser record.
pub const REGION_BLOCKS: u64 = 256;
const RECORD_BYTES: usize = 16;
/// Regions without a mapped LBA that one [`SkippedBuffer::take`] passes
/// over at most (16 Mi LBAs: a few milliseconds of map lookups).
pub const EMPTY_REGIONS_PER_TAKE: u64 = 1 << 16;
const REGION_BYTES: usize = 48;

/// Figures of the skipped buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedStats {
    /// Block records pending.
    pub records: u64,
    /// Dirty regions (256 blocks each) pending.
    pub regions: u64,
    /// Whole volumes pending.
    pub volumes: u64,
    /// Bytes the buffer may use.
    pub capacity_bytes: u64,
    /// Bytes in use.
    pub used_bytes: u64,
    /// Times the buffer degraded to coarser records: folded when full, or
    /// every volume queued whole because duplicate copies the index
    /// dropped could not be remembered ([`crate::meta::Meta::merges_dropped`]).
    pub degradations: u64,
}

/// The skipped buffer; see the module docs.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct SkippedBuffer {
    capacity_bytes: usize,
    records: VecDeque<(VolumeId, u64)>,
    regions: BTreeSet<(VolumeId, u64)>,
    /// Whole volumes, with the next region to expand.
    volumes: BTreeMap<VolumeId, u64>,
    /// Per whole volume, the lowest region written behind its scan's
    /// cursor: scanned again once the scan reaches the end (moving the
    /// cursor back at each such write would let a block rewritten without
    /// pause, say a file system's journal, hold the scan there for ever).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    rescan_from: BTreeMap<VolumeId, u64>,
    /// The whole volume a region was last taken from: the next is taken
    /// from the volume after it, so every volume's scan goes on.
    #[serde(skip)]
    last_volume: Option<VolumeId>,
    degradations: u64,
    /// The pending merges of out-of-line dedup (copy PBA → kept PBA), in a
    /// saved buffer only: [`Engine`](crate::Engine) keeps them apart while
    /// running, and puts them here when it saves the buffer at a
    /// checkpoint, so a restart keeps them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    saved_merges: Vec<(u64, u64)>,
    /// The last region a record fell in and whether `regions` holds it, so
    /// runs of writes to one region (sequential writes) search the set
    /// once. Cleared whenever `regions` changes.
    #[serde(skip)]
    last_region: Option<((VolumeId, u64), bool)>,
    /// Calls that recorded work (blocks, ranges, volumes) since the
    /// buffer was made or loaded: unchanged over a span of time, nothing
    /// was written that could need out-of-line dedup.
    #[serde(skip)]
    additions: u64,
}

impl SkippedBuffer {
    /// Puts the pending merges (copy PBA → kept PBA) into a copy of the
    /// buffer about to be saved.
    pub fn set_saved_merges(&mut self, merges: Vec<(u64, u64)>) {
        self.saved_merges = merges;
    }

    /// Takes the pending merges out of a buffer just loaded.
    pub fn take_saved_merges(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.saved_merges)
    }

    /// An empty buffer of `capacity_bytes`.
    pub fn new(capacity_bytes: usize) -> Self {
        SkippedBuffer {
            capacity_bytes: capacity_bytes.max(MIN_CAPACITY_BYTES),
            ..SkippedBuffer::default()
        }
    }

    fn used_bytes(&self) -> usize {
        self.records.len() * RECORD_BYTES
            + self.regions.len() * REGION_BYTES
            + (self.volumes.len() + self.rescan_from.len()) * REGION_BYTES
    }

    /// Records that block `lba` of `vol` was written without an inline match.
    pub fn record(&mut self, vol: VolumeId, lba: u64) {
        self.additions += 1;
        let region = (vol, lba / REGION_BLOCKS);
        // a volume pending whole: its scan covers what is ahead of its
        // cursor; a write behind it is recorded as any other while the
        // buffer has room (a rescan of the volume from there to its end
        // is the last resort, when the buffer is full)
        if self.volumes.get(&vol).is_some_and(|&next| region.1 >= next) {
            return;
        }
        let held = match self.last_region {
            Some((r, held)) if r == region => held,
            _ => {
                let held = self.regions.contains(&region);
                self.last_region = Some((region, held));
                held
            }
        };
        if held {
            return;
        }
        if self.used_bytes() + RECORD_BYTES <= self.capacity_bytes {
            if self.records.len() == self.records.capacity() {
                // grown by hand, never past what the capacity leaves the
                // records beside the coarser ones (doubling would take up
                // to twice the configured bytes)
                let len = self.records.len();
                let others = self.used_bytes() - len * RECORD_BYTES;
                let max = (self.capacity_bytes - others) / RECORD_BYTES;
                self.records.reserve_exact(len.max(16).min(max - len));
            }
            self.records.push_back((vol, lba));
            return;
        }
        if !self.records.is_empty() {
            self.degradations += 1;
            self.fold();
        }
        self.regions.insert(region);
        self.last_region = None;
        self.fold_regions_if_over_half();
    }

    /// Folds the block records into regions (a full buffer degrades).
    fn fold(&mut self) {
        self.last_region = None;
        let mut last = None;
        for (v, l) in std::mem::take(&mut self.records) {
            // consecutive records mostly share a region: one insert each
            let r = (v, l / REGION_BLOCKS);
            if last != Some(r) {
                self.regions.insert(r);
                last = Some(r);
            }
        }
    }

    /// Past half the capacity, folds the regions into whole volumes.
    fn fold_regions_if_over_half(&mut self) {
        if self.regions.len() * REGION_BYTES > self.capacity_bytes / 2 {
            self.degradations += 1;
            self.fold_regions();
        }
    }

    /// Folds the regions into whole volumes: a region of a volume already
    /// pending whole, behind its scan's cursor, is scanned again once the
    /// scan reaches the end (none forgotten).
    fn fold_regions(&mut self) {
        self.last_region = None;
        for (v, region) in std::mem::take(&mut self.regions) {
            match self.volumes.get(&v) {
                Some(_) => self.behind_scan(v, region),
                None => {
                    self.volumes.insert(v, 0);
                }
            }
        }
    }

    /// Records that blocks `start..end` of `vol` may hold duplicates, as
    /// dirty regions (used for writes replayed from the journal).
    pub fn record_range(&mut self, vol: VolumeId, start: u64, end: u64) {
        self.additions += 1;
        if start >= end {
            return;
        }
        let (first, last) = (start / REGION_BLOCKS, (end - 1) / REGION_BLOCKS);
        // (a volume pending whole: only what lies behind its scan's cursor)
        let last = match self.volumes.get(&vol) {
            Some(&next) if first >= next => return,
            Some(&next) => last.min(next - 1),
            None => last,
        };
        self.last_region = None;
        for region in first..=last {
            self.regions.insert((vol, region));
        }
        if self.used_bytes() > self.capacity_bytes {
            self.degradations += 1;
            self.fold();
            self.fold_regions();
        }
    }

    /// Notes that region `region` of `vol`, a volume pending whole, was
    /// written: if its scan is past it, the scan comes back to it once at
    /// the end (none missed).
    fn behind_scan(&mut self, vol: VolumeId, region: u64) {
        if self.volumes.get(&vol).is_some_and(|&next| region < next) {
            let r = self.rescan_from.entry(vol).or_insert(region);
            *r = (*r).min(region);
        }
    }

    /// Records that every block of `vol` may hold duplicates.
    pub fn record_volume(&mut self, vol: VolumeId) {
        self.additions += 1;
        self.last_region = None;
        self.records.retain(|r| r.0 != vol);
        self.regions.retain(|r| r.0 != vol);
        self.volumes.insert(vol, 0);
        self.rescan_from.remove(&vol);
    }

    /// Records that every block of each of `vols` may hold duplicates, as
    /// a degradation (out-of-line dedup lost track of a copy): a volume
    /// already pending whole is scanned again from its start once its scan
    /// reaches the end (its scan is not restarted, so repeated calls
    /// cannot hold it back for ever).
    pub fn record_volumes_whole(&mut self, vols: &[VolumeId]) {
        self.additions += 1;
        self.degradations += 1;
        for &vol in vols {
            if self.volumes.contains_key(&vol) {
                self.behind_scan(vol, 0);
            } else {
                self.record_volume(vol);
            }
        }
    }

    /// Forgets everything about `vol` (deleted).
    pub fn forget(&mut self, vol: VolumeId) {
        self.last_region = None;
        self.records.retain(|r| r.0 != vol);
        self.regions.retain(|r| r.0 != vol);
        self.volumes.remove(&vol);
        self.rescan_from.remove(&vol);
    }

    /// Calls that recorded work since the buffer was made or loaded (see
    /// [`SkippedBuffer::clear`]).
    pub fn additions(&self) -> u64 {
        self.additions
    }

    /// Forgets everything pending (the capacity and the count of
    /// degradations stay): for an exact pass over every stored block
    /// during which [`SkippedBuffer::additions`] did not move, which left
    /// nothing for the records to find.
    pub fn clear(&mut self) {
        self.records = VecDeque::new();
        self.regions.clear();
        self.volumes.clear();
        self.rescan_from.clear();
        self.last_region = None;
        self.last_volume = None;
    }

    /// True if nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty() && self.regions.is_empty() && self.volumes.is_empty()
    }

    /// Takes up to about `max` block addresses to process, oldest first;
    /// regions and volumes are expanded into their LBAs (`size_blocks`
    /// gives a volume's size; unknown volumes are dropped), except ranges
    /// of LBAs with none mapped: `first_mapped(volume, start, end)` gives
    /// the first LBA in `start..end` that may be mapped, `None` if none is
    /// (a whole thin volume is mostly unmapped: its scan jumps to the next
    /// region that may hold a mapped LBA). Passes over at most
    /// [`EMPTY_REGIONS_PER_TAKE`] empty regions or volume ends per call, so
    /// a call costs little whatever the volume's size (it may then return
    /// nothing while work remains).
    pub fn take(
        &mut self,
        max: usize,
        size_blocks: impl Fn(VolumeId) -> Option<u64>,
        first_mapped: impl Fn(VolumeId, u64, u64) -> Option<u64>,
    ) -> Vec<(VolumeId, u64)> {
        self.last_region = None;
        let mut out = Vec::with_capacity(max.min(4096));
        let mut empty_regions = 0;
        while out.len() < max && empty_regions < EMPTY_REGIONS_PER_TAKE {
            if let Some(r) = self.records.pop_front() {
                out.push(r);
                continue;
            }
            if let Some((v, region)) = self.regions.pop_first() {
                let Some(size) = size_blocks(v) else { continue };
                let start = region * REGION_BLOCKS;
                let end = (start + REGION_BLOCKS).min(size);
                if start < end && first_mapped(v, start, end).is_some() {
                    out.extend((start..end).map(|l| (v, l)));
                } else {
                    empty_regions += 1;
                }
                continue;
            }
            // the volume after the one served last, in turn
            let after = self.last_volume.and_then(|l| {
                self.volumes
                    .range((std::ops::Bound::Excluded(l), std::ops::Bound::Unbounded))
                    .next()
            });
            let Some((&v, &next)) = after.or_else(|| self.volumes.iter().next()) else {
                break;
            };
            self.last_volume = Some(v);
            let Some(size) = size_blocks(v) else {
                self.volumes.remove(&v);
                self.rescan_from.remove(&v);
                continue;
            };
            let start = next * REGION_BLOCKS;
            if start >= size {
                // at the end: once more from what was written behind it
                match self.rescan_from.remove(&v) {
                    Some(r) => {
                        self.volumes.insert(v, r);
                    }
                    None => {
                        self.volumes.remove(&v);
                    }
                }
                continue;
            }
            match first_mapped(v, start, size) {
                Some(lba) => {
                    let region = lba.max(start) / REGION_BLOCKS;
                    let start = region * REGION_BLOCKS;
                    let end = (start + REGION_BLOCKS).min(size);
                    out.extend((start..end).map(|l| (v, l)));
                    self.volumes.insert(v, region + 1);
                }
                None => {
                    // nothing mapped to the end: there next time
                    empty_regions += 1;
                    self.volumes.insert(v, size.div_ceil(REGION_BLOCKS));
                }
            }
        }
        out
    }

    /// Figures for `dedupd stats`.
    pub fn stats(&self) -> SkippedStats {
        SkippedStats {
            records: self.records.len() as u64,
            regions: self.regions.len() as u64,
            volumes: self.volumes.len() as u64,
            capacity_bytes: self.capacity_bytes as u64,
            used_bytes: self.used_bytes() as u64,
            degradations: self.degradations,
        }
    }

    /// Bytes of memory held (the records' capacity included).
    pub fn memory_bytes(&self) -> u64 {
        (self.records.capacity() * RECORD_BYTES
            + self.regions.len() * REGION_BYTES
            + (self.volumes.len() + self.rescan_from.len()) * REGION_BYTES) as u64
    }

    /// Sets the capacity (at open, from configuration, over a buffer
    /// loaded from the store): the records' memory is cut to what they
    /// hold, and a buffer over the new capacity degrades as a full one
    /// does, so nothing is forgotten.
    pub fn set_capacity(&mut self, capacity_bytes: usize) {
        self.capacity_bytes = capacity_bytes.max(MIN_CAPACITY_BYTES);
        self.records.shrink_to_fit();
        if self.used_bytes() > self.capacity_bytes {
            self.degradations += 1;
            self.fold();
            self.fold_regions_if_over_half();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_beside_regions_stay_within_the_capacity() {
        let cap = 600 << 10;
        let mut b = SkippedBuffer::new(cap);
        // fills with records of volume 1, folds them into 150 regions, then
        // takes records of volume 2 beside those
        for lba in 0..2 * (cap / RECORD_BYTES) as u64 {
            b.record(
                VolumeId(1 + (lba >= (cap / RECORD_BYTES) as u64) as u32),
                lba,
            );
            assert!(b.memory_bytes() <= cap as u64, "{} bytes", b.memory_bytes());
        }
        assert!(b.stats().degradations >= 1);
    }

    #[test]
    fn a_loaded_buffer_over_a_smaller_capacity_degrades_and_keeps_its_blocks() {
        let mut b = SkippedBuffer::new(600 << 10);
        for lba in 0..20_000u64 {
            b.record(VolumeId(1), lba * 3);
        }
        b.set_capacity(64 << 10);
        assert!(b.memory_bytes() <= 64 << 10, "{} bytes", b.memory_bytes());
        // every recorded block is still covered
        let regions: std::collections::HashSet<u64> = b.regions.iter().map(|r| r.1).collect();
        for lba in (0..20_000u64).map(|l| l * 3) {
            assert!(
                b.volumes.contains_key(&VolumeId(1)) || regions.contains(&(lba / REGION_BLOCKS)),
                "LBA {lba} forgotten"
            );
        }
    }

    #[test]
    fn block_records_never_take_more_than_the_capacity() {
        // 600 KiB: 38 400 records, which doubling would hold in 65 536
        let cap = 600 << 10;
        let mut b = SkippedBuffer::new(cap);
        for lba in 0..(cap / RECORD_BYTES) as u64 {
            // one record per region: none folds into another
            b.record(VolumeId(1), lba * REGION_BLOCKS);
            assert!(b.memory_bytes() <= cap as u64, "{} bytes", b.memory_bytes());
        }
        assert_eq!(b.stats().records, (cap / RECORD_BYTES) as u64);
    }

    #[test]
    fn a_block_rewritten_without_pause_does_not_hold_whole_volume_scans() {
        let mut b = SkippedBuffer::new(RECORD_BYTES * 16);
        let (v, w) = (VolumeId(1), VolumeId(2));
        b.record_volume(v);
        b.record_volume(w);
        let size = |_| Some(100 * REGION_BLOCKS);
        let mut seen: BTreeSet<(VolumeId, u64)> = BTreeSet::new();
        // a region at a time, and after each a write to block 5 of v (a
        // file system's journal, say)
        for _ in 0..250 {
            let got = b.take(REGION_BLOCKS as usize, size, |_, s, _| Some(s));
            seen.extend(got.into_iter().map(|(vol, l)| (vol, l / REGION_BLOCKS)));
            b.record(v, 5);
        }
        // both scans ended while the writes went on: the rewritten block
        // waits as a record, not as a rescan of its volume
        assert_eq!(b.stats().volumes, 0, "{:?}", b.stats());
        assert_eq!(b.stats().records, 1);
        for vol in [v, w] {
            let regions = seen.iter().filter(|(x, _)| *x == vol).count();
            assert_eq!(
                regions, 100,
                "volume {vol:?}: {regions} of 100 regions scanned"
            );
        }
        // once the writes stop, the buffer empties
        for _ in 0..10 {
            b.take(1 << 20, size, |_, s, _| Some(s));
        }
        assert!(b.is_empty(), "{:?}", b.stats());
    }

    #[test]
    fn a_whole_thin_volume_is_scanned_by_what_it_maps() {
        // 2^36 LBAs (256 TiB), two mapped far apart: found in one take
        let mut b = SkippedBuffer::new(RECORD_BYTES * 16);
        let v = VolumeId(1);
        b.record_volume(v);
        let mapped = [1u64 << 34, (1 << 35) + 7];
        let first_mapped =
            |_, start: u64, end: u64| mapped.iter().copied().find(|l| (start..end).contains(l));
        let got = b.take(4 * REGION_BLOCKS as usize, |_| Some(1 << 36), first_mapped);
        for lba in mapped {
            assert!(got.contains(&(v, lba)), "LBA {lba} not taken");
        }
        assert_eq!(got.len(), 2 * REGION_BLOCKS as usize);
        let rest = b.take(4 * REGION_BLOCKS as usize, |_| Some(1 << 36), first_mapped);
        assert!(rest.is_empty());
        assert!(b.is_empty());
    }

    #[test]
    fn a_write_behind_a_whole_volume_scan_is_not_lost() {
        let mut b = SkippedBuffer::new(RECORD_BYTES * 16);
        let v = VolumeId(1);
        b.record_volume(v);
        // the scan is past the first regions...
        let first = b.take(
            3 * REGION_BLOCKS as usize,
            |_| Some(100 * REGION_BLOCKS),
            |_, s, _| Some(s),
        );
        assert_eq!(first.len(), 3 * REGION_BLOCKS as usize);
        // ...when blocks in them are written again
        b.record(v, 5);
        b.record_range(v, REGION_BLOCKS + 1, REGION_BLOCKS + 2);
        let mut seen = BTreeSet::new();
        loop {
            let got = b.take(1000, |_| Some(100 * REGION_BLOCKS), |_, s, _| Some(s));
            if got.is_empty() {
                break;
            }
            seen.extend(got.into_iter().map(|(_, l)| l));
        }
        assert!(seen.contains(&5) && seen.contains(&(REGION_BLOCKS + 1)));
        assert!(seen.contains(&(100 * REGION_BLOCKS - 1)));
    }

    #[test]
    fn a_write_behind_a_whole_volume_scan_in_a_full_buffer_is_rescanned() {
        let mut b = SkippedBuffer::new(RECORD_BYTES * 16);
        let (v, w) = (VolumeId(1), VolumeId(2));
        b.record_volume(v);
        let size = |_| Some(100 * REGION_BLOCKS);
        let first = b.take(3 * REGION_BLOCKS as usize, size, |_, s, _| Some(s));
        assert_eq!(first.len(), 3 * REGION_BLOCKS as usize);
        // records of another volume fill the buffer (each in its own
        // region, so none folds into another)
        while b.used_bytes() + RECORD_BYTES <= b.capacity_bytes {
            let n = b.stats().records;
            b.record(w, n * REGION_BLOCKS);
        }
        // a write behind v's scan degrades the buffer, and is not lost
        b.record(v, REGION_BLOCKS + 9);
        assert!(b.stats().degradations > 0);
        assert!(b.memory_bytes() <= b.stats().capacity_bytes + 2 * REGION_BYTES as u64);
        let mut seen = BTreeSet::new();
        for _ in 0..1000 {
            let got = b.take(1000, size, |_, s, _| Some(s));
            seen.extend(got);
            if b.is_empty() {
                break;
            }
        }
        assert!(b.is_empty(), "{:?}", b.stats());
        assert!(seen.contains(&(v, REGION_BLOCKS + 9)));
        assert!(seen.contains(&(v, 100 * REGION_BLOCKS - 1)));
        assert!(seen.contains(&(w, 0)));
    }

    #[test]
    fn degrades_without_forgetting() {
        let mut b = SkippedBuffer::new(RECORD_BYTES * 16);
        let v = VolumeId(1);
        for l in 0..2000u64 {
            b.record(v, l * 3);
        }
        assert!(b.stats().degradations > 0);
        assert!(b.stats().used_bytes <= b.stats().capacity_bytes + REGION_BYTES as u64);
        let mut seen = BTreeSet::new();
        loop {
            let got = b.take(1000, |_| Some(10_000), |_, s, _| Some(s));
            if got.is_empty() {
                break;
            }
            seen.extend(got.into_iter().map(|(_, l)| l));
        }
        for l in 0..2000u64 {
            assert!(seen.contains(&(l * 3)), "block {} forgotten", l * 3);
        }
        assert!(b.is_empty());
    }

    /// The remembered region answer follows every change of the regions:
    /// the same records as a buffer that searches the set every time.
    #[test]
    fn sequential_runs_fold_and_take_like_the_plain_set() {
        let mut b = SkippedBuffer::new(RECORD_BYTES * 64);
        let v = VolumeId(1);
        let mut want = BTreeSet::new();
        for round in 0..3u64 {
            for l in 0..2000u64 {
                let lba = round * 7 + l;
                b.record(v, lba);
                want.insert(lba);
            }
            // a region is taken (and forgotten), then written again
            let got = b.take(300, |_| Some(100_000), |_, s, _| Some(s));
            for (_, l) in &got {
                want.remove(l);
            }
            b.record(v, 5);
            want.insert(5);
        }
        let mut seen = BTreeSet::new();
        loop {
            let got = b.take(1000, |_| Some(100_000), |_, s, _| Some(s));
            if got.is_empty() {
                break;
            }
            seen.extend(got.into_iter().map(|(_, l)| l));
        }
        for l in want {
            assert!(seen.contains(&l), "block {l} forgotten");
        }
    }
}
