//! The reverse index PBA → fingerprint (SmartDedup §3.4: an overwrite or
//! TRIM finds the fingerprint to remove from the index without knowing it;
//! a fingerprint hit is checked against it), kept in memory under a byte
//! budget and paged from its file on demand.
//!
//! The file `fingerprints` holds 32 bytes per PBA in checksummed 4 KiB pages
//! ([`crate::paged`]); the journal carries changed pages like every other
//! metadata page. In memory, at most `cache_bytes` of pages stay resident
//! (0: all of them), paged as [`crate::pagecache`] describes.
//!
//! The reverse index can be rebuilt from the data (`dedupd fsck --repair
//! --rehash`), so a page that cannot be read back or fails its checksum
//! reads as zeros — "not fingerprinted yet" — and is counted (`load
//! errors` in `dedupd stats`): lookups then miss (never share wrong data),
//! the next commit of the page keeps it so, and a full out-of-line pass
//! (`dedupd dedup --offline`) or `fsck --repair` re-hashes those blocks
//! (the background worker only those its skipped buffer holds).

use crate::fingerprint::{Fingerprint, FINGERPRINT_SIZE};
use crate::pagecache::{CachedArray, PageCacheStats};
use crate::paged::PagedArray;

/// Figures of the reverse index's page cache.
pub type ReverseIndexStats = PageCacheStats;

/// The reverse index; see the module docs. Reads may load pages (interior
/// mutability). Callers hold the engine's metadata lock.
#[derive(Debug, Default)]
pub struct ReverseIndex {
    array: CachedArray,
}

impl ReverseIndex {
    /// A reverse index over `array` (all resident; no file to page from yet).
    pub fn new(array: PagedArray) -> Self {
        ReverseIndex {
            array: CachedArray::new(array),
        }
    }

    /// Wraps an array already paging from its file (see
    /// [`crate::metaopen::open_paged`]).
    pub fn from_cached(array: CachedArray) -> Self {
        ReverseIndex { array }
    }

    /// Evicts pages while over budget (see [`CachedArray::trim`]).
    pub fn trim(&self) {
        self.array.trim();
    }

    /// The fingerprint recorded for `pba` (zeros if none).
    #[inline]
    pub fn get(&self, pba: u64) -> Fingerprint {
        Fingerprint(self.array.get_array(pba * FINGERPRINT_SIZE as u64))
    }

    /// The first 8 bytes of `pba`'s fingerprint, big-endian (its index key).
    #[inline]
    pub fn key(&self, pba: u64) -> u64 {
        u64::from_be_bytes(self.array.get_array(pba * FINGERPRINT_SIZE as u64))
    }

    /// [`ReverseIndex::get`] if `pba`'s page is in memory; `None` if
    /// reading it would load the page (see [`CachedArray::peek_array`]).
    #[inline]
    pub fn peek(&self, pba: u64) -> Option<Fingerprint> {
        self.array
            .peek_array(pba * FINGERPRINT_SIZE as u64)
            .map(Fingerprint)
    }

    /// Hints that `pba`'s fingerprint will be read soon.
    #[inline]
    pub fn prefetch(&self, pba: u64) {
        self.array.prefetch(pba * FINGERPRINT_SIZE as u64);
    }

    /// Records `fp` for `pba`.
    #[inline]
    pub fn set(&mut self, pba: u64, fp: &Fingerprint) {
        self.array.set_array(pba * FINGERPRINT_SIZE as u64, fp.0);
    }

    /// Writes `data` at logical byte offset `off` (whole fingerprints).
    pub fn write(&mut self, off: u64, data: &[u8]) {
        self.array.write(off, data);
    }

    /// The paged array itself (for commits: logging pages whole or as
    /// patches).
    pub fn cached_mut(&mut self) -> &mut CachedArray {
        &mut self.array
    }

    /// Releases the pages pinned by commits up to `generation`, now in
    /// place in the file, and evicts down to the budget.
    pub fn unpin_through(&mut self, generation: u64) {
        self.array.unpin_through(generation);
    }

    /// Marks `page` dirty again (after a failed commit, or to rewrite it).
    pub fn redirty(&mut self, page: u64) {
        self.array.redirty(page);
    }

    /// Number of dirty pages.
    pub fn dirty_count(&self) -> usize {
        self.array.dirty_count()
    }

    /// Logical bytes the array spans.
    pub fn logical_len(&self) -> u64 {
        self.array.logical_len()
    }

    /// Bytes of memory held (resident pages and tables).
    pub fn resident_bytes(&self) -> u64 {
        self.array.resident_bytes()
    }

    /// Figures of the page cache.
    pub fn stats(&self) -> ReverseIndexStats {
        self.array.group_stats()
    }
}
