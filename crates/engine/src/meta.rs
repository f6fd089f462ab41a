//! In-memory metadata of an open store: volume maps, reference counts,
//! reverse index, fingerprint index and free space, with the rules that
//! keep them consistent. Callers hold the engine's metadata lock.
//!
//! Invariants (checked by [`Meta::check`]):
//! - the reference count of a PBA equals the number of (volume, LBA) mapped to it;
//! - a PBA with reference count 0 is free (or pending free) and not indexed;
//! - an indexed fingerprint's PBA holds the data with that fingerprint.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::block::{Lba, Pba, VolumeId, BLOCK_SIZE_U64};
use crate::fingerprint::{Fingerprint, FINGERPRINT_SIZE};
use crate::index::FingerprintIndex;
use crate::journal::{MetaFile, Op};
use crate::pagecache::{CacheGroup, CachedArray};
use crate::paged::PagedArray;
use crate::store::{PersistentCounters, VolumeRecord};

/// Pending merges kept at most (duplicate copies awaiting a map scan).
pub const MAX_PENDING_MERGES: usize = 65536;

/// One volume: its record and LBA→PBA map.
#[derive(Debug)]
pub struct Volume {
    /// Name, size and id.
    pub record: VolumeRecord,
    /// u64 per LBA: 0 unmapped, else PBA + 1; paged from the volume's map
    /// file under [`Meta::map_cache`].
    pub map: CachedArray,
    /// Map pages that failed their checksum at open, in ascending order
    /// (their LBAs fail to read, [`Volume::lost_mapping_in`]); a volume
    /// with any is served read-only until repaired.
    pub damaged_pages: Vec<u64>,
    /// The map file was missing at open (every LBA reads as unmapped); the
    /// volume is served read-only until repaired.
    pub map_missing: bool,
    /// The map file ended at this page at open, short of the volume (the
    /// LBAs past it read as unmapped); served read-only until repaired.
    pub map_truncated_at: Option<u64>,
    /// LBAs mapped (the nonzero entries of `map` below the size): counted
    /// at open ([`Meta::rebuild_derived`]), kept by [`Meta::remap`].
    pub mapped_blocks: u64,
    /// Being deleted: its blocks are released piece by piece, and writes
    /// are refused meanwhile.
    pub deleting: bool,
    /// Deletes of this volume under way (more than one if requested
    /// twice at once): a delete that fails gives the volume back only if
    /// it was the last.
    pub deletes_running: u32,
    /// (`deleting`, `record.deleting`) before the first of the deletes
    /// under way: what a failing last one gives back.
    pub before_deletes: (bool, bool),
    /// New sizes, in blocks, of the shrinks under way: no LBA at or past
    /// the smallest is written or mapped meanwhile, so none appears behind
    /// a shrink's release of the blocks there.
    pub shrinking_to: Vec<u64>,
    /// Shrinks of this volume begun since the store opened, and the new
    /// sizes (blocks) of the last [`RECENT_SHRINKS`] of them, oldest
    /// first: a write mapped in two steps checks, before its second, that
    /// no shrink begun since its first passed its blocks (a shrink and a
    /// grow back would leave no other trace; see
    /// [`Volume::lowest_shrink_since`]).
    pub shrinks_begun: u64,
    /// New sizes in blocks of the last [`RECENT_SHRINKS`] shrinks counted
    /// by `shrinks_begun`, oldest first.
    pub recent_shrinks: std::collections::VecDeque<u64>,
}

/// Shrink targets a [`Volume`] remembers (older ones count as shrinks to
/// nothing, see [`Volume::lowest_shrink_since`]).
pub const RECENT_SHRINKS: usize = 16;

impl Volume {
    /// Size in 4 KiB blocks.
    pub fn size_blocks(&self) -> u64 {
        self.record.size_bytes / BLOCK_SIZE_U64
    }
    /// Records a shrink to `new_blocks` beginning (see
    /// [`Volume::shrinks_begun`]).
    pub fn begin_shrink(&mut self, new_blocks: u64) {
        self.shrinking_to.push(new_blocks);
        self.shrinks_begun += 1;
        if self.recent_shrinks.len() == RECENT_SHRINKS {
            self.recent_shrinks.pop_front();
        }
        self.recent_shrinks.push_back(new_blocks);
    }
    /// The smallest new size (blocks) of the shrinks begun since
    /// [`Volume::shrinks_begun`] was `seen`; `None` if none began, 0 if
    /// more began than are remembered.
    pub fn lowest_shrink_since(&self, seen: u64) -> Option<u64> {
        let k = usize::try_from(self.shrinks_begun.checked_sub(seen)?).unwrap_or(usize::MAX);
        if k == 0 {
            return None;
        }
        if k > self.recent_shrinks.len() {
            return Some(0);
        }
        self.recent_shrinks.iter().rev().take(k).copied().min()
    }
    /// Forgets one running shrink to `new_blocks` (done or failed).
    pub fn end_shrink(&mut self, new_blocks: u64) {
        if let Some(k) = self.shrinking_to.iter().position(|&b| b == new_blocks) {
            self.shrinking_to.swap_remove(k);
        }
    }
    /// Blocks that may be written: the size, or less while a shrink runs
    /// or after one was cut short.
    pub fn writable_blocks(&self) -> u64 {
        self.shrinking_to
            .iter()
            .copied()
            .chain(self.record.shrinking_to_bytes.map(|b| b / BLOCK_SIZE_U64))
            .fold(self.size_blocks(), u64::min)
    }
    /// True if the volume's metadata cannot be trusted (served read-only).
    pub fn read_only(&self) -> bool {
        !self.damaged_pages.is_empty()
            || self.map_missing
            || self.map_truncated_at.is_some()
            || self.deleting
    }
    /// The first LBA of `first..first + count` whose mapping was lost at
    /// open (on a damaged map page, past a truncated map's end, anywhere
    /// in a missing map), if any: such LBAs read as unmapped in `map`.
    pub fn lost_mapping_in(&self, first: u64, count: u64) -> Option<u64> {
        let end = first.saturating_add(count);
        if count == 0 {
            return None;
        }
        if self.map_missing {
            return Some(first);
        }
        let per = crate::paged::U64_PER_PAGE;
        let truncated = self
            .map_truncated_at
            .map(|page| page * per)
            .filter(|&from| end > from)
            .map(|from| first.max(from));
        // (sorted: the first damaged page at or after the request's first)
        let at = self.damaged_pages.partition_point(|&p| p < first / per);
        let damaged = self
            .damaged_pages
            .get(at)
            .map(|&p| p * per)
            .filter(|&from| from < end)
            .map(|from| first.max(from));
        truncated.into_iter().chain(damaged).min()
    }
    /// The PBA an LBA maps to, if any.
    pub fn get(&self, lba: Lba) -> Option<Pba> {
        match self.map.get_u64(lba.0) {
            0 => None,
            v => Some(Pba(v - 1)),
        }
    }
}

/// The metadata of an open store.
#[derive(Debug, Default)]
pub struct Meta {
    /// Volumes by id (added and removed through [`Meta::insert_volume`]
    /// and [`Meta::remove_volume`], which keep the two counts below).
    pub volumes: BTreeMap<VolumeId, Volume>,
    /// Volume ids by name.
    pub(crate) volume_names: HashMap<String, VolumeId>,
    /// Dirty pages of all volume maps (each map counts its own in it).
    pub(crate) map_dirty_pages_total: Arc<AtomicU64>,
    /// Set once syncing the data file failed: blocks written since the
    /// last commit may never reach the disk (the kernel may drop them and
    /// report success to a later sync), so nothing more is written or
    /// committed until a restart recovers the last committed state.
    pub data_sync_failure: Option<String>,
    /// Id the next created volume gets.
    pub next_volume_id: u32,
    /// The engine's sequence threshold T in effect for volumes without
    /// their own ([`crate::store::State::default_sequence_threshold_blocks`]).
    pub default_sequence_threshold_blocks: u32,
    /// The engine's `verify` setting, recorded in the state
    /// ([`crate::store::State::verify`]).
    pub verify: bool,
    /// u32 reference count per PBA; paged from `refcounts` under
    /// [`Meta::map_cache`].
    pub refcounts: CachedArray,
    /// The page cache budget the volume maps and reference counts share
    /// (`--map-cache`); a page of theirs that cannot be read back is a
    /// fault ([`Meta::paging_faults`]).
    pub map_cache: std::sync::Arc<CacheGroup>,
    /// The page cache of the reverse index (`--reverse-index-cache`): its
    /// unreadable pages read as zeros (rebuildable), but a write dropped
    /// for one is a fault ([`Meta::paging_faults`]).
    pub reverse_cache: std::sync::Arc<CacheGroup>,
    /// Fingerprint per PBA (reverse index); stale (meaningless) for free PBAs.
    pub fingerprints: crate::reverse::ReverseIndex,
    /// The two-level fingerprint store (fingerprint → PBA).
    pub index: FingerprintIndex,
    /// Blocks written without an inline match, for out-of-line dedup.
    pub skipped: crate::skipped::SkippedBuffer,
    /// Commit batches taken so far ([`Meta::take_commit`]); the reverse
    /// index pins the pages of a batch until a checkpoint covers it.
    pub commit_generation: u64,
    /// Fingerprints indexed by [`Meta::index_new`] so far: a writer that
    /// saw none added since its lookup knows its miss still holds.
    pub index_inserts: u64,
    /// Blocks fingerprinted and looked up inline since the engine started.
    pub fingerprinted_inline: u64,
    /// Journal traffic modelled by an engine without a journal.
    pub journal_model: JournalModel,
    /// Runs of duplicates in progress per volume (sequence threshold).
    pub sequences: crate::sequence::SequenceRuns,
    /// Duplicate copies to merge: every LBA mapped to the first PBA is to
    /// be remapped to the second (found by out-of-line dedup or dropped by
    /// the index).
    pub pending_merges: std::collections::BTreeMap<u64, u64>,
    /// Free PBAs below the high-water mark, reusable now; allocation hands
    /// out the lowest first, so consecutive allocations get ascending PBAs
    /// that coalesce into one data write.
    pub free: crate::freespace::FreeSpace,
    /// Times a commit returned freed blocks to `free` (so they may hold
    /// other data from then on); a read-modify-write checks it did not
    /// change under it.
    pub reuse_epoch: u64,
    /// PBAs whose reference count reached 0 since the last journal commit;
    /// reusable only after the commit that records it (deferred free).
    pub pending_free: Vec<u64>,
    /// Released blocks taken by the commit under way (0 when none is):
    /// held once it succeeds, pending again if it fails.
    pub frees_in_flight: usize,
    /// PBAs released by the journal's last transaction: reusable only once
    /// a later transaction (or a checkpoint) is durable too. Were that
    /// transaction damaged after its commit (bit rot), recovery would stop
    /// before it, at maps that still point at these blocks: held back, they
    /// still hold what those maps read. (Damage to a transaction with an
    /// intact one behind it is refused at open.) Empty without a journal.
    pub held_free: Vec<u64>,
    /// Skipped-buffer records (volume, LBA) the running out-of-line pass
    /// took and has not examined yet (at most one pass's worth): saved with
    /// the buffer, so a checkpoint during the pass keeps them.
    pub skipped_in_flight: Vec<(VolumeId, u64)>,
    /// First PBA never allocated.
    pub high_water_blocks: u64,
    /// LBAs mapped, over all volumes.
    pub mapped_blocks: u64,
    /// PBAs with reference count > 0.
    pub stored_blocks: u64,
    /// Persistent counters.
    pub counters: PersistentCounters,
    /// The counters as the last durable commit carried them (or as the
    /// store held them at open): a close commits counters that moved
    /// without any other change (a verify mismatch that kept two copies
    /// apart).
    pub counters_committed: PersistentCounters,
    /// Structural changes (file lengths, removals) since the last commit.
    pub structural_ops: Vec<Op>,
    /// True if the volume table or counters changed since the last commit.
    pub state_dirty: bool,
    /// Number of metadata changes made (monotonic); a commit makes every
    /// change up to its snapshot durable.
    pub change_count: u64,
}

/// What a journal commit takes from [`Meta`].
#[derive(Debug, Default)]
pub struct CommitBatch {
    /// Operations, in the order they must be applied.
    pub ops: Vec<Op>,
    /// PBAs that become reusable once the commit is durable.
    pub frees: Vec<u64>,
    /// [`Meta::change_count`] at the snapshot.
    pub change_count: u64,
    /// [`Meta::commit_generation`] of this batch.
    pub generation: u64,
    /// The counters the batch carries: [`Meta::counters_committed`] once
    /// it is durable.
    pub counters: PersistentCounters,
}

impl Meta {
    /// Empty metadata with each array tagged for its file.
    pub fn empty(index: FingerprintIndex) -> Meta {
        Meta {
            index,
            refcounts: CachedArray::new(PagedArray::new(MetaFile::Refcounts.page_tag())),
            fingerprints: crate::reverse::ReverseIndex::new(PagedArray::new(
                MetaFile::Fingerprints.page_tag(),
            )),
            ..Meta::default()
        }
    }

    /// Builds the free list and derived counts after loading the arrays,
    /// and rebuilds the fingerprint index from `pairs` (see
    /// [`IndexPairs`]). `data_blocks` is the data file's length in blocks.
    /// The pairs are sorted through a scratch file so that memory stays
    /// about the index budget (plus 0.4 % of the pairs' bytes for where
    /// the spilled chunks are, see [`crate::keysort`]). Returns the sum
    /// of every PBA's reference count, which equals `mapped_blocks` in a
    /// consistent store.
    ///
    /// The high-water mark becomes one past the highest referenced PBA:
    /// the data file's blocks above it hold nothing referenced and are
    /// written again as the store grows, so a data file longer than its
    /// content (a crash after writes not yet committed, or a damaged
    /// length) costs no memory. The free set holds the unreferenced PBAs
    /// below the high-water mark that lie inside the data file; a
    /// referenced PBA past the data file's end (damage: the high-water mark
    /// then exceeds `data_blocks`) leaves the PBAs between them out of it.
    /// Reference-count pages that are holes are skipped without a look.
    ///
    /// Errors: writing the on-disk fingerprint store, reading the scratch
    /// file.
    pub fn rebuild_derived(&mut self, data_blocks: u64, pairs: IndexPairs) -> std::io::Result<u64> {
        let rc_blocks = self.refcounts.logical_len() / 4;
        let (mut sorter, scan) = match pairs {
            IndexPairs::Collected(sorter) => (sorter, false),
            IndexPairs::Scan(scratch) => (self.index_sorter(rc_blocks, scratch), true),
        };
        let mut top = 0;
        let mut references = 0u64;
        let mut stored_blocks = 0;
        let mut free = crate::freespace::FreeSpace::default();
        self.refcounts.for_each_nonzero_u32(0..rc_blocks, |p, rc| {
            references += rc;
            stored_blocks += 1;
            free.extend(top..p.min(data_blocks).max(top));
            top = p + 1;
            if scan {
                let fp = self.fingerprints.get(p);
                // blocks not fingerprinted yet are not indexed
                // (out-of-line dedup hashes them)
                if fp != crate::engine::UNHASHED {
                    sorter.push(crate::index::key_of(&fp), p);
                }
            }
        });
        let mut state = self.index.begin_rebuild();
        sorter.for_each_sorted(|pairs| self.index.rebuild_sorted(pairs, &mut state))?;
        self.index.finish_rebuild()?;
        self.stored_blocks = stored_blocks;
        self.high_water_blocks = top;
        self.free = free;
        self.mapped_blocks = 0;
        for v in self.volumes.values_mut() {
            v.mapped_blocks = v.map.count_nonzero_u64(0..v.size_blocks());
            self.mapped_blocks += v.mapped_blocks;
        }
        Ok(references)
    }

    /// A sorter for the index's (key, PBA) pairs of up to `pbas` PBAs, in
    /// buckets of about the index budget, spilling to `scratch`.
    pub fn index_sorter(
        &self,
        pbas: u64,
        scratch: Option<std::fs::File>,
    ) -> crate::keysort::KeySorter {
        crate::keysort::KeySorter::new(
            pbas,
            self.index.config().memory_budget_bytes,
            self.index.prefix_bits(),
            scratch,
        )
    }

    /// Adds to `sorter` the index pairs of reverse-index page `page`
    /// (`payload`: its 4064 bytes): each referenced PBA with a fingerprint.
    pub fn collect_index_pairs(
        &self,
        sorter: &mut crate::keysort::KeySorter,
        page: u64,
        payload: &[u8],
    ) {
        let per_page = (crate::paged::PAYLOAD_SIZE / FINGERPRINT_SIZE) as u64;
        let rc_blocks = self.refcounts.logical_len() / 4;
        for (k, fp) in payload.chunks_exact(FINGERPRINT_SIZE).enumerate() {
            let p = page * per_page + k as u64;
            if p >= rc_blocks {
                break;
            }
            let fp = Fingerprint(fp.try_into().expect("a fingerprint's bytes"));
            if self.refcounts.get_u32(p) > 0 && fp != crate::engine::UNHASHED {
                sorter.push(crate::index::key_of(&fp), p);
            }
        }
    }

    /// Looks a fingerprint up in the index; a candidate counts only if its
    /// PBA is referenced and stores exactly this fingerprint (reverse index).
    pub fn lookup(&mut self, fp: &Fingerprint) -> std::io::Result<Option<Pba>> {
        // after a paging fault a dropped reverse-index write can leave a
        // reused PBA's old fingerprint in place: no hit is trusted (a miss
        // stores the block as a copy of its own)
        if self.paging_faults() > 0 {
            return Ok(None);
        }
        let found = self.with_index(|index, live, rc| index.lookup_with_refcount(fp, live, rc))?;
        Ok(found.filter(|&p| self.fingerprint_of(p) == *fp))
    }

    /// Brings into the CPU cache what lookups of `fps` will read: the
    /// index levels, over the whole batch at once (see
    /// [`FingerprintIndex::prefetch`]), then the reference count and
    /// reverse-index record of each in-memory hit. Only a hint.
    pub fn prefetch_lookups(&self, fps: &[Fingerprint]) {
        let mut hits = Vec::with_capacity(fps.len());
        self.index.prefetch(fps, &mut hits);
        for p in hits {
            self.refcounts.prefetch(p.0 * 4);
            self.fingerprints.prefetch(p.0);
        }
    }

    /// [`Meta::prefetch_lookups`] for a write of `n` blocks at LBA `first`
    /// of `vol` that will look up or insert `fps`, adding the fingerprints
    /// its remaps will take out of the index: those of blocks the LBAs map
    /// to now whose only reference they hold. Reads only metadata pages
    /// already in memory (it never loads one). Only a hint.
    pub fn prefetch_write(&self, vol: VolumeId, first: u64, n: u64, fps: &[Fingerprint]) {
        let mut all = Vec::with_capacity(fps.len() + n as usize);
        all.extend_from_slice(fps);
        if let Some(v) = self.volumes.get(&vol) {
            for lba in first..first.saturating_add(n).min(v.size_blocks()) {
                let Some(p) = v.map.peek_array::<8>(lba * 8).map(u64::from_le_bytes) else {
                    continue;
                };
                let Some(p) = p.checked_sub(1) else { continue };
                if self.refcounts.peek_array::<4>(p * 4) == Some(1u32.to_le_bytes()) {
                    if let Some(fp) = self.fingerprints.peek(p) {
                        all.push(fp);
                    }
                }
            }
        }
        self.prefetch_lookups(&all);
    }

    /// The fingerprint recorded for a PBA.
    pub fn fingerprint_of(&self, pba: Pba) -> Fingerprint {
        self.fingerprints.get(pba.0)
    }

    /// Takes a free PBA for new data (lowest free, else the high-water mark).
    /// The PBA is reserved: not free, not referenced, not indexed.
    pub fn allocate(&mut self) -> Pba {
        match self.free.pop_lowest() {
            Some(p) => Pba(p),
            None => {
                self.high_water_blocks += 1;
                Pba(self.high_water_blocks - 1)
            }
        }
    }

    /// Returns a reserved PBA that was never referenced; reusable at once.
    pub fn unreserve(&mut self, pba: Pba) {
        self.free.insert(pba.0);
    }

    /// Records that `pba` now stores the block with fingerprint `fp`
    /// (reference count still 0; the caller maps it next).
    pub fn index_new(&mut self, pba: Pba, fp: Fingerprint) -> std::io::Result<()> {
        self.index_inserts += 1;
        self.fingerprints.set(pba.0, &fp);
        // the entry is live once the caller maps it; count it live now so an
        // eviction triggered by this insert keeps it
        let Meta {
            index,
            refcounts,
            fingerprints,
            ..
        } = self;
        // (only this fingerprint's entry at `pba`: a stale entry of the
        // PBA's earlier content stays stale)
        let new_key = crate::index::key_of(&fp);
        let live = |key: u64, p: Pba| {
            (p == pba && key == new_key) || live(refcounts, fingerprints, key, p)
        };
        let rc = |p: Pba| refcounts.get_u32(p.0);
        index.insert_with_refcount(&fp, pba, &live, &rc)
    }

    /// Every live PBA holding exactly `fp` that the index knows, in
    /// memory and on disk (out-of-line dedup).
    pub fn lookup_all(&mut self, fp: &Fingerprint) -> std::io::Result<Vec<Pba>> {
        // (no hit trusted after a paging fault: see `lookup`)
        if self.paging_faults() > 0 {
            return Ok(Vec::new());
        }
        let mut found = self.with_index(|index, live, _| index.lookup_all(fp, live))?;
        found.retain(|&p| self.fingerprint_of(p) == *fp);
        Ok(found)
    }

    /// Puts `fp` → `pba` in the in-memory index (the PBA already stores it).
    pub fn index_insert(&mut self, fp: Fingerprint, pba: Pba) -> std::io::Result<()> {
        // (a write between its lookups and its placement looks again)
        self.index_inserts += 1;
        self.with_index(|index, live, rc| index.insert_with_refcount(&fp, pba, live, rc))
    }

    /// Indexes `fp` → `pba` (a live block holding it, fingerprint
    /// recorded or not yet) unless the index already finds a live copy
    /// of `fp`; otherwise only records the fingerprint. An index that
    /// cannot be read or written is counted (`index_errors`), not an
    /// error: the block stays a copy of its own, which a later pass finds.
    pub fn index_if_absent(&mut self, pba: Pba, fp: Fingerprint) {
        if self.fingerprint_of(pba) != fp {
            self.record_unindexed(pba, fp);
        }
        let indexed = match self.lookup(&fp) {
            Ok(None) => self.index_insert(fp, pba),
            Ok(Some(_)) => Ok(()),
            Err(e) => Err(e),
        };
        if indexed.is_err() {
            self.counters.index_errors += 1;
        }
    }

    /// Runs `f` on the index with the reverse-index liveness check.
    /// Also passes reference counts, which the reference-count eviction
    /// policy (CAFTL) evicts by.
    fn with_index<T>(
        &mut self,
        f: impl FnOnce(&mut FingerprintIndex, crate::index::Live<'_>, crate::index::RefCount<'_>) -> T,
    ) -> T {
        let Meta {
            index,
            refcounts,
            fingerprints,
            ..
        } = self;
        let live = |key: u64, p: Pba| live(refcounts, fingerprints, key, p);
        let rc = |p: Pba| refcounts.get_u32(p.0);
        f(index, &live, &rc)
    }

    /// True if released blocks wait for a commit to become reusable:
    /// pending, or taken by a commit under way.
    pub fn frees_waiting(&self) -> bool {
        !self.pending_free.is_empty() || self.frees_in_flight > 0 || !self.held_free.is_empty()
    }

    /// Moves the duplicate copies the index dropped into `pending_merges`.
    /// At most [`MAX_PENDING_MERGES`] are kept (about 48 bytes each); past
    /// that, `dedupd dedup --offline` finds the rest.
    pub fn collect_displaced(&mut self) {
        let (displaced, mut dropped) = self.index.take_displaced();
        for (copy, kept) in displaced {
            if self.pending_merges.len() < MAX_PENDING_MERGES {
                self.pending_merges.insert(copy.0, kept.0);
            } else {
                dropped = true;
            }
        }
        if dropped {
            self.merges_dropped();
        }
    }

    /// A live duplicate copy out-of-line dedup should merge could not be
    /// remembered (the index's or the pending merges' bound was full):
    /// every volume is queued whole in the skipped buffer, a degradation
    /// as its own are, so the background pass finds the copy again (it
    /// examines each mapped LBA against every copy of its content) and
    /// dedup stays exact whatever the bounds.
    pub fn merges_dropped(&mut self) {
        let ids: Vec<VolumeId> = self
            .volumes
            .iter()
            // (a volume with a sequence threshold T > 1, its own or the
            // engine's, is left to the full pass, as the background pass
            // leaves it)
            .filter(|(_, v)| {
                !v.deleting
                    && v.record
                        .sequence_threshold_blocks
                        .unwrap_or(self.default_sequence_threshold_blocks)
                        <= 1
            })
            .map(|(id, _)| *id)
            .collect();
        self.skipped.record_volumes_whole(&ids);
    }

    /// True if another LBA may be mapped to PBA `p`: it is referenced, and
    /// by fewer than `u32::MAX` LBAs (a reference count is 32 bits; a block
    /// with that many references is not shared further, and a new write of
    /// its content is stored as a new copy, so the count never wraps to 0
    /// and frees a block in use).
    pub fn shareable(&self, p: u64) -> bool {
        self.shareable_by(p, 1)
    }

    /// True if `lbas` more LBAs may be mapped to PBA `p` ([`Meta::shareable`]
    /// for several at once: a block and its copies in one request).
    pub fn shareable_by(&self, p: u64, lbas: u64) -> bool {
        let rc = u64::from(self.refcounts.get_u32(p));
        rc > 0 && rc + lbas <= u64::from(u32::MAX)
    }

    /// Records the fingerprint of a block stored without being indexed (its
    /// fingerprint is indexed for other bytes: a verify mismatch).
    pub fn record_unindexed(&mut self, pba: Pba, fp: Fingerprint) {
        self.fingerprints.set(pba.0, &fp);
        // (a change to commit: a FLUSH after the offline pass fingerprinted
        // blocks commits their reverse-index pages)
        self.change_count += 1;
    }

    /// Maps `lba` of `vol` to `new` (None: unmapped), adjusting reference
    /// counts; a PBA whose count reaches 0 is unindexed and pending free.
    pub fn remap(&mut self, vol: VolumeId, lba: Lba, new: Option<Pba>) {
        let Some(v) = self.volumes.get_mut(&vol) else {
            return;
        };
        let old = v.get(lba);
        if old == new {
            return;
        }
        v.map.set_u64(lba.0, new.map_or(0, |p| p.0 + 1));
        self.change_count += 1;
        match (old.is_some(), new.is_some()) {
            (false, true) => {
                self.mapped_blocks += 1;
                v.mapped_blocks += 1;
            }
            (true, false) => {
                self.mapped_blocks -= 1;
                v.mapped_blocks -= 1;
            }
            _ => {}
        }
        if let Some(p) = new {
            let rc = self.refcounts.get_u32(p.0);
            if rc == 0 {
                self.stored_blocks += 1;
            }
            self.refcounts.set_u32(p.0, rc + 1);
        }
        if let Some(p) = old {
            self.release(p);
        }
    }

    fn release(&mut self, p: Pba) {
        let rc = self.refcounts.get_u32(p.0);
        debug_assert!(
            rc > 0 || self.paging_faults() > 0,
            "releasing PBA {} with reference count 0",
            p.0
        );
        if rc == 0 {
            // an unreadable count (a metadata fault, which stops every
            // commit): nothing is freed, counted or taken out of the index
            return;
        }
        let rc = rc - 1;
        self.refcounts.set_u32(p.0, rc);
        if rc == 0 {
            self.stored_blocks -= 1;
            let fp = self.fingerprint_of(p);
            self.index.remove(&fp, p);
            // the reverse-index entry is left stale: reference count 0
            // marks it meaningless, and a TRIM dirties fewer pages
            self.pending_free.push(p.0);
        }
    }

    /// The `state.json` content ([`crate::store::State`]: the volume
    /// table), encoded as the file holds it
    /// ([`crate::store::encode_checked_compact`]).
    pub(crate) fn encoded_state(&self) -> Vec<u8> {
        crate::store::encode_checked_compact(&self.state_view())
    }

    fn state_view(&self) -> StateView<'_> {
        StateView {
            next_volume_id: self.next_volume_id,
            volumes: self.volumes.values().map(|v| &v.record).collect(),
            default_sequence_threshold_blocks: self.default_sequence_threshold_blocks,
            verify: self.verify,
        }
    }

    /// The `counters.json` content ([`crate::store::CounterState`]: the
    /// counters and `journal_seq`), encoded as the file holds it.
    pub(crate) fn encoded_counters(&self, journal_seq: u64) -> Vec<u8> {
        crate::store::encode_checked_compact(&CounterStateView {
            counters: &self.counters,
            journal_seq,
        })
    }

    /// Length of [`Meta::encoded_state`], for the journal model, without
    /// building it.
    fn encoded_state_len(&self) -> usize {
        let mut count = ByteCount(0);
        serde_json::to_writer(&mut count, &self.state_view()).expect("serializable");
        // a newline, then the checksum line: "crc32c=" and 8 hex digits
        count.0 + 1 + "crc32c=00000000\n".len()
    }

    /// Takes every change since the last commit as journal operations:
    /// the pages changed, the structural changes, `state.json` if the
    /// volume table changed (`state_dirty`), and always `counters.json`
    /// (it carries the sequence number).
    pub fn take_commit(&mut self, journal_seq: u64) -> CommitBatch {
        // (the index's dropped copies leave its budget at every commit,
        // whether or not the out-of-line worker runs)
        self.collect_displaced();
        let mut ops = std::mem::take(&mut self.structural_ops);
        self.commit_generation += 1;
        let generation = self.commit_generation;
        log_pages(
            &mut self.refcounts,
            MetaFile::Refcounts,
            generation,
            &mut ops,
        );
        log_pages(
            self.fingerprints.cached_mut(),
            MetaFile::Fingerprints,
            generation,
            &mut ops,
        );
        for (id, v) in self.volumes.iter_mut() {
            log_pages(&mut v.map, MetaFile::Map(*id), generation, &mut ops);
        }
        if self.state_dirty {
            ops.push(Op::Replace {
                file: MetaFile::State,
                data: self.encoded_state(),
            });
        }
        ops.push(Op::Replace {
            file: MetaFile::Counters,
            data: self.encoded_counters(journal_seq),
        });
        self.state_dirty = false;
        CommitBatch {
            counters: self.counters.clone(),
            ops,
            frees: {
                self.frees_in_flight = self.pending_free.len();
                std::mem::take(&mut self.pending_free)
            },
            change_count: self.change_count,
            generation,
        }
    }

    /// [`Meta::take_commit`] for an engine without a journal (in memory, as
    /// in a replay): the changes are forgotten instead of encoded, since
    /// nothing would write them, and only the bytes a store's journal
    /// would have received are counted ([`JournalModel`]; a checkpoint is
    /// modelled once those bytes, or the pages logged whole since the last
    /// one, reach `journal_size_bytes`). The batch has no operations; its
    /// frees and change count are as `take_commit` gives them.
    pub fn take_commit_unlogged(&mut self, journal_size_bytes: u64) -> CommitBatch {
        self.collect_displaced();
        let mut lens: Vec<usize> = self
            .structural_ops
            .drain(..)
            .map(|op| op.data_len())
            .collect();
        self.commit_generation += 1;
        let mut images = 0u64;
        model_log_pages(&mut self.refcounts, &mut lens, &mut images);
        model_log_pages(self.fingerprints.cached_mut(), &mut lens, &mut images);
        for v in self.volumes.values_mut() {
            model_log_pages(&mut v.map, &mut lens, &mut images);
        }
        // every commit replaces the counters, and the state if the volume
        // table changed
        if self.state_dirty {
            let state_len = self.encoded_state_len();
            lens.push(state_len);
            self.journal_model.state_bytes = Some(state_len as u64);
        }
        let counters_len = self.encoded_counters(self.commit_generation).len();
        lens.push(counters_len);
        let bytes = crate::journal::txn_len(lens);
        let model = &mut self.journal_model;
        model.written_bytes += bytes;
        model.used_bytes += bytes;
        model.pages_logged_whole += images;
        model.counters_bytes = counters_len as u64;
        if model.used_bytes >= journal_size_bytes
            || model.pages_logged_whole * crate::paged::PAGE_SIZE as u64 >= journal_size_bytes
        {
            self.model_checkpoint();
        }
        self.state_dirty = false;
        CommitBatch {
            counters: self.counters.clone(),
            ops: Vec::new(),
            frees: {
                self.frees_in_flight = self.pending_free.len();
                std::mem::take(&mut self.pending_free)
            },
            change_count: self.change_count,
            generation: self.commit_generation,
        }
    }

    /// Counts a checkpoint in the [`JournalModel`] (an engine without a
    /// journal, at the point a store would checkpoint): it writes each page
    /// logged since the previous one, the counters, and the state if it
    /// was logged since, after which pages are logged whole again. Nothing
    /// if nothing was committed since.
    pub fn model_checkpoint(&mut self) {
        let model = &mut self.journal_model;
        if model.used_bytes == 0 {
            return;
        }
        model.checkpoint_bytes += model.pages_logged_whole * crate::paged::PAGE_SIZE as u64
            + model.counters_bytes
            + model.state_bytes.take().unwrap_or(0);
        model.used_bytes = 0;
        model.pages_logged_whole = 0;
        model.checkpoints += 1;
        self.refcounts.clear_logged();
        self.fingerprints.cached_mut().clear_logged();
        for v in self.volumes.values_mut() {
            v.map.clear_logged();
        }
    }

    /// Releases the pages of every paged array pinned by commits up to
    /// `generation` (now written in place by a checkpoint), so they may
    /// leave memory.
    /// The journal restarts empty after that checkpoint: every page is
    /// logged whole again before it is patched.
    pub fn unpin_through(&mut self, generation: u64) {
        self.refcounts.unpin_through(generation);
        self.refcounts.clear_logged();
        self.fingerprints.unpin_through(generation);
        self.fingerprints.cached_mut().clear_logged();
        for v in self.volumes.values_mut() {
            v.map.unpin_through(generation);
            v.map.clear_logged();
        }
    }

    /// Pages of the volume maps or reference counts that could not be read
    /// back from their files while running. Any makes the in-memory
    /// metadata untrustworthy: the engine then refuses writes and commits
    /// (read-only until restart; the journal holds the last consistent
    /// state).
    pub fn paging_faults(&self) -> u64 {
        self.map_cache.load_errors() + self.reverse_cache.writes_dropped()
    }

    /// Puts a batch back after its commit failed, so the next commit carries it.
    pub fn restore_commit(&mut self, batch: CommitBatch) {
        let mut structural = Vec::new();
        for op in batch.ops {
            // the page's image (or patch) is not in the journal: mark it
            // dirty again, to be logged whole
            let (file, page) = match &op {
                Op::Write { file, offset, .. } => (*file, offset / crate::paged::PAGE_SIZE as u64),
                Op::Patch { file, offset, .. } => {
                    (*file, offset / crate::paged::PAYLOAD_SIZE as u64)
                }
                // (the counters go into every commit)
                Op::Replace { file, .. } => {
                    self.state_dirty |= *file == MetaFile::State;
                    continue;
                }
                _ => {
                    structural.push(op);
                    continue;
                }
            };
            let array = match file {
                MetaFile::Refcounts => Some(&mut self.refcounts),
                MetaFile::Fingerprints => Some(self.fingerprints.cached_mut()),
                MetaFile::Map(id) => self.volumes.get_mut(&id).map(|v| &mut v.map),
                MetaFile::State | MetaFile::Counters => None,
            };
            if let Some(a) = array {
                a.redirty(page);
                a.set_logged(page, false);
            }
        }
        structural.append(&mut self.structural_ops);
        self.structural_ops = structural;
        self.frees_in_flight = 0;
        self.pending_free.extend(batch.frees);
    }

    /// Pages changed since the last commit, over every array.
    pub fn dirty_pages(&self) -> usize {
        self.refcounts.dirty_count() + self.fingerprints.dirty_count() + self.map_dirty_pages()
    }

    /// Dirty pages of the volume maps.
    pub fn map_dirty_pages(&self) -> usize {
        let total = self.map_dirty_pages_total.load(Ordering::Relaxed) as usize;
        debug_assert_eq!(
            total,
            self.volumes
                .values()
                .map(|v| v.map.dirty_count())
                .sum::<usize>()
        );
        total
    }

    /// Adds volume `v` (its id and name not in use), its map's dirty pages
    /// counted in [`Meta::map_dirty_pages`].
    pub fn insert_volume(&mut self, v: Volume) {
        v.map.count_dirty_in(self.map_dirty_pages_total.clone());
        self.volume_names.insert(v.record.name.clone(), v.record.id);
        let replaced = self.volumes.insert(v.record.id, v);
        debug_assert!(replaced.is_none(), "volume id in use");
    }

    /// Removes volume `id`, if present, and returns it.
    pub fn remove_volume(&mut self, id: VolumeId) -> Option<Volume> {
        let v = self.volumes.remove(&id)?;
        self.volume_names.remove(&v.record.name);
        Some(v)
    }

    /// The id of the volume named `name`, if any.
    pub fn volume_named(&self, name: &str) -> Option<VolumeId> {
        self.volume_names.get(name).copied()
    }

    /// Bytes of memory held by the metadata arrays (maps, reference counts,
    /// reverse index) and the free lists.
    pub fn array_bytes(&self) -> u64 {
        self.refcounts.resident_bytes()
            + self.fingerprints.resident_bytes()
            + self
                .volumes
                .values()
                .map(|v| v.map.resident_bytes())
                .sum::<u64>()
            + self.free.memory_bytes()
            + self.pending_free.capacity() as u64 * 8
            + self.held_free.capacity() as u64 * 8
            + self.skipped.memory_bytes()
            + self.skipped_in_flight.capacity() as u64 * 16
            + self.pending_merges.len() as u64 * 48
    }

    /// Bytes of memory held by the fingerprint index (entries plus the hash
    /// table's control bytes and spare capacity).
    pub fn index_bytes(&self) -> u64 {
        self.index.memory_bytes() + self.index.stats().tree_bytes
    }

    /// Checks every invariant; returns a description of each violation.
    /// Call it between requests: a block a write has reserved and not yet
    /// mapped counts as leaked.
    pub fn check(&self) -> Vec<String> {
        let mut errs = Vec::new();
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for v in self.volumes.values() {
            let mapped = v.map.count_nonzero_u64(0..v.size_blocks());
            if mapped != v.mapped_blocks {
                errs.push(format!(
                    "volume {}: {mapped} LBAs mapped, counted {}",
                    v.record.name, v.mapped_blocks
                ));
            }
            for (lba, raw) in v.map.nonzero_u64(0..v.size_blocks()) {
                let p = Pba(raw - 1);
                *counts.entry(p.0).or_default() += 1;
                if p.0 >= self.high_water_blocks {
                    errs.push(format!(
                        "volume {} LBA {lba} maps to PBA {} past the high-water mark",
                        v.record.name, p.0
                    ));
                }
            }
        }
        let mut free_or_pending = vec![false; self.high_water_blocks as usize];
        if self.free.doubled() > 0 {
            errs.push(format!(
                "{} PBA(s) were freed while already free",
                self.free.doubled()
            ));
        }
        for p in self
            .free
            .iter()
            .chain(self.pending_free.iter().copied())
            .chain(self.held_free.iter().copied())
        {
            if let Some(f) = free_or_pending.get_mut(p as usize) {
                if *f {
                    errs.push(format!("PBA {p} is on the free lists twice"));
                }
                *f = true;
            }
        }
        for p in 0..self.high_water_blocks {
            let rc = self.refcounts.get_u32(p);
            let want = counts.get(&p).copied().unwrap_or(0);
            if rc != want {
                errs.push(format!(
                    "PBA {p}: reference count {rc}, mapped by {want} LBAs"
                ));
            }
            if rc > 0 && free_or_pending[p as usize] {
                errs.push(format!("PBA {p} is referenced and free"));
            }
            // (between requests: a write holds the blocks it reserved only
            // while it runs, and a commit the frees it carries)
            if rc == 0 && !free_or_pending[p as usize] && self.frees_in_flight == 0 {
                errs.push(format!(
                    "PBA {p} is unreferenced but neither free nor pending"
                ));
            }
        }
        for (key, p) in self.index.memory_entries() {
            if !live(&self.refcounts, &self.fingerprints, key, p) {
                errs.push(format!("index entry {key:016x} → PBA {} is stale", p.0));
            }
        }
        errs
    }
}

/// True if PBA `p` is referenced and its recorded fingerprint starts with `key`.
fn live(
    refcounts: &CachedArray,
    fingerprints: &crate::reverse::ReverseIndex,
    key: u64,
    p: Pba,
) -> bool {
    if refcounts.get_u32(p.0) == 0 {
        return false;
    }
    // the index key is the fingerprint's first 8 bytes (big-endian)
    fingerprints.key(p.0) == key
}

/// The journal traffic an engine without a journal models (see
/// [`Meta::take_commit_unlogged`]): what a store would have written for
/// the same commits.
#[derive(Debug, Default, Clone, Copy)]
pub struct JournalModel {
    /// Bytes of transactions, in total.
    pub written_bytes: u64,
    /// Bytes since the last modelled checkpoint.
    pub used_bytes: u64,
    /// Pages logged whole since the last modelled checkpoint (pinned in
    /// memory until it, in a store).
    pub pages_logged_whole: u64,
    /// Modelled checkpoints.
    pub checkpoints: u64,
    /// Bytes those checkpoints wrote in place: each page logged since the
    /// one before, once, and the state.
    pub checkpoint_bytes: u64,
    /// Length of the counters the last commit carried.
    pub counters_bytes: u64,
    /// Length of the state last committed, if a commit carried it since
    /// the last checkpoint.
    pub state_bytes: Option<u64>,
}

/// [`crate::store::State`] borrowed from [`Meta`]: the same fields in the
/// same order, so the same JSON (the format-1 fields left out).
#[derive(serde::Serialize)]
struct StateView<'a> {
    next_volume_id: u32,
    volumes: Vec<&'a VolumeRecord>,
    #[serde(skip_serializing_if = "crate::store::is_one")]
    default_sequence_threshold_blocks: u32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    verify: bool,
}

/// [`crate::store::CounterState`] borrowed from [`Meta`].
#[derive(serde::Serialize)]
struct CounterStateView<'a> {
    counters: &'a PersistentCounters,
    journal_seq: u64,
}

/// An [`std::io::Write`] that only counts the bytes written to it.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Counts what [`log_pages`] would log for `array`'s dirty pages (one
/// record data length per page into `lens`; pages logged whole for the
/// first time since the checkpoint into `images`), forgetting them.
fn model_log_pages(array: &mut CachedArray, lens: &mut Vec<usize>, images: &mut u64) {
    let mut changed = Vec::new();
    array.clear_dirty(|page, n| changed.push((page, n)));
    for (page, n) in changed {
        if logs_as_patch(array, page, n) {
            lens.push(n);
        } else {
            // a page's first image since the checkpoint pins it; a later
            // one replaces it
            if !array.is_logged(page) {
                array.set_logged(page, true);
                *images += 1;
            }
            lens.push(crate::paged::PAGE_SIZE);
        }
    }
}

/// Largest change logged as a patch; a page with more changed bytes is
/// logged whole (its image is 4 KiB).
const PATCH_MAX_BYTES: usize = 1024;

/// True if a change of `n` payload bytes to `page` is logged as a patch:
/// small, and the page's whole image is in the journal since the last
/// checkpoint.
fn logs_as_patch(array: &CachedArray, page: u64, n: usize) -> bool {
    n > 0 && n <= PATCH_MAX_BYTES && array.is_logged(page)
}

/// Takes `array`'s dirty pages (pinned until the checkpoint of commit
/// `generation`) into `ops`: a page's first change since the last
/// checkpoint as its whole image, later ones as patches of the bytes that
/// changed, so small random updates log tens of bytes instead of 4 KiB.
fn log_pages(array: &mut CachedArray, file: MetaFile, generation: u64, ops: &mut Vec<Op>) {
    let page_bytes = crate::paged::PAGE_SIZE as u64;
    let payload = crate::paged::PAYLOAD_SIZE as u64;
    for d in array.take_dirty(generation) {
        if logs_as_patch(array, d.page, d.changed.len()) {
            ops.push(Op::Patch {
                file,
                offset: d.page * payload + d.changed.start as u64,
                data: d.image[d.changed].to_vec(),
            });
        } else {
            array.set_logged(d.page, true);
            ops.push(Op::Write {
                file,
                offset: d.page * page_bytes,
                data: d.image.to_vec(),
            });
        }
    }
}

/// Where [`Meta::rebuild_derived`] gets the fingerprint index's pairs.
#[derive(Debug)]
pub enum IndexPairs {
    /// Collected while the reverse index was checked at open
    /// ([`Meta::collect_index_pairs`]), so it is not read again.
    Collected(crate::keysort::KeySorter),
    /// Read from the reverse index, sorted through this scratch file
    /// (`None`: in memory).
    Scan(Option<std::fs::File>),
}
