//! Metadata arrays paged from their files on demand, under a memory budget
//! shared by a group of arrays.
//!
//! A [`CachedArray`] is a [`PagedArray`] whose pages may leave memory and
//! come back from the array's file. The rule that keeps this correct: a
//! page may leave memory only when its latest image is in place in the
//! file, that is, it is clean (no change since the last journal commit) and
//! no commit since the last checkpoint carried it. Pages carried by such a
//! commit are *pinned* with the commit's generation until the checkpoint
//! that writes them in place ([`CachedArray::unpin_through`]), which bounds
//! them by the journal size. Eviction is first-in first-out over the
//! array's resident pages; a read of an evicted page loads it back (one
//! `pread` of 4 KiB and its CRC32C check).
//!
//! The arrays of one [`CacheGroup`] share its budget: an array that loads
//! or creates a page while the group is over budget evicts its own oldest
//! clean, unpinned pages, and so does every array at each checkpoint
//! ([`CachedArray::unpin_through`]), so an array no longer accessed sheds
//! its pages too. The budget can be exceeded by pinned and dirty pages
//! (bounded by `--journal-size` and `--max-dirty`) and by one page per
//! array being read.
//!
//! What a page that cannot be read back (I/O error, checksum mismatch)
//! reads as is the group's [`OnLoadError`]: zeros, for data that can be
//! rebuilt (the reverse index), or a *fault* for data that cannot (volume
//! maps, reference counts): the access reads zeros, a write to that page is
//! dropped, the page stays out of memory, and the fault is counted in the
//! group, so the engine fails the operation and stops committing (read-only
//! until restart) instead of committing anything derived from it.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::paged::{decode_page, DirtyPage, PagedArray, PAGE_SIZE, PAYLOAD_SIZE};

/// What a page that cannot be read back from its file reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnLoadError {
    /// Zeros (derived data that a rebuild restores).
    #[default]
    ReadAsZeros,
    /// A fault: see the module docs.
    Fault,
}

/// Figures of a group's page cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageCacheStats {
    /// Bytes of pages allowed in memory (0: unbounded).
    pub cache_bytes: u64,
    /// Bytes of pages in memory now, charged against `cache_bytes`: 4064
    /// bytes of entries per page, and as much for each 256-page chunk of
    /// the page table in use (about 3 KiB), so scattered pages cannot take
    /// far more memory than the budget.
    pub resident_bytes: u64,
    /// Pages that must stay in memory until the next checkpoint.
    pub pinned_pages: u64,
    /// Pages read back from their files since the engine started.
    pub pages_loaded: u64,
    /// Pages dropped from memory since the engine started.
    pub pages_evicted: u64,
    /// Pages that could not be read back or failed their checksum.
    pub load_errors: u64,
    /// Writes dropped because their page could not be read back (an I/O
    /// error: the page's entries could not be kept): in the reverse
    /// index these stop commits as a map fault does, since a dropped
    /// fingerprint would leave a reused block's old one in place.
    pub writes_dropped: u64,
}

/// The budget and counters a group of [`CachedArray`]s share.
#[derive(Debug, Default)]
pub struct CacheGroup {
    cache_bytes: u64,
    budget_pages: u64,
    on_error: OnLoadError,
    resident_pages: AtomicU64,
    pinned_pages: AtomicU64,
    pages_loaded: AtomicU64,
    pages_evicted: AtomicU64,
    load_errors: AtomicU64,
    pub(crate) writes_dropped: AtomicU64,
    first_error: std::sync::Mutex<Option<String>>,
}

impl CacheGroup {
    /// A group keeping at most `cache_bytes` of pages in memory (0:
    /// unbounded); `on_error` says what unreadable pages read as.
    pub fn new(cache_bytes: u64, on_error: OnLoadError) -> Arc<CacheGroup> {
        Arc::new(CacheGroup {
            cache_bytes,
            // (a budget below one page still bounds: one page; 0 alone
            // means unbounded)
            budget_pages: (cache_bytes / PAYLOAD_SIZE as u64).max(u64::from(cache_bytes > 0)),
            on_error,
            ..CacheGroup::default()
        })
    }

    /// Current figures.
    pub fn stats(&self) -> PageCacheStats {
        PageCacheStats {
            cache_bytes: self.cache_bytes,
            resident_bytes: self.resident_pages.load(Relaxed) * PAYLOAD_SIZE as u64,
            pinned_pages: self.pinned_pages.load(Relaxed),
            pages_loaded: self.pages_loaded.load(Relaxed),
            pages_evicted: self.pages_evicted.load(Relaxed),
            load_errors: self.load_errors.load(Relaxed),
            writes_dropped: self.writes_dropped.load(Relaxed),
        }
    }

    /// Writes dropped so far because their page could not be read back.
    pub fn writes_dropped(&self) -> u64 {
        self.writes_dropped.load(Relaxed)
    }

    /// Pages that could not be read back so far.
    pub fn load_errors(&self) -> u64 {
        self.load_errors.load(Relaxed)
    }

    /// What went wrong with the first page that could not be read back
    /// (file, page and cause), if any.
    pub fn first_error(&self) -> Option<String> {
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn note_error(&self, what: String) {
        self.load_errors.fetch_add(1, Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(what);
        }
    }

    /// Over the budget, with more than a quarter of it in pages that may
    /// leave: pages pinned until a checkpoint cannot, and when they alone
    /// fill the budget the clean ones still keep that quarter (else every
    /// access to a clean page would read it from its file again, until the
    /// checkpoint).
    fn over_budget(&self) -> bool {
        let resident = self.resident_pages.load(Relaxed);
        self.budget_pages > 0
            && resident > self.budget_pages
            && resident.saturating_sub(self.pinned_pages.load(Relaxed)) > self.budget_pages / 4
    }
}

/// Bits per leaf of [`Bits`] (64 words: 512 bytes).
const BITS_PER_LEAF: u64 = 4096;
const WORDS_PER_LEAF: usize = (BITS_PER_LEAF / 64) as usize;

/// A bit per page (evicted, queued, logged), sparse: leaves of 4096 bits
/// exist only where a bit is set, under a table of 8 bytes per 4096 pages,
/// so a page set near the end of a 1 PiB volume costs one leaf, not a bit
/// for every page before it.
#[derive(Debug, Default)]
struct Bits(Vec<Option<Box<[u64; WORDS_PER_LEAF]>>>);

impl Bits {
    #[inline]
    fn get(&self, i: u64) -> bool {
        match self.0.get((i / BITS_PER_LEAF) as usize) {
            Some(Some(leaf)) => {
                let bit = i % BITS_PER_LEAF;
                leaf[(bit / 64) as usize] & (1 << (bit % 64)) != 0
            }
            _ => false,
        }
    }
    fn set(&mut self, i: u64, v: bool) {
        let l = (i / BITS_PER_LEAF) as usize;
        let bit = i % BITS_PER_LEAF;
        let (w, mask) = ((bit / 64) as usize, 1u64 << (bit % 64));
        if v {
            if self.0.len() <= l {
                self.0.resize_with(l + 1, || None);
            }
            self.0[l].get_or_insert_with(|| Box::new([0; WORDS_PER_LEAF]))[w] |= mask;
        } else if let Some(Some(leaf)) = self.0.get_mut(l) {
            leaf[w] &= !mask;
            if leaf[w] == 0 && leaf.iter().all(|&x| x == 0) {
                self.0[l] = None;
                if l + 1 == self.0.len() {
                    self.trim_table();
                }
            }
        }
    }
    /// Drops the table's trailing empty slots.
    fn trim_table(&mut self) {
        while self.0.last().is_some_and(|l| l.is_none()) {
            self.0.pop();
        }
    }
    /// The first set bit in `from..end`, a word at a time (a leaf at a
    /// time where none is).
    fn next_set(&self, from: u64, end: u64) -> Option<u64> {
        let mut i = from;
        while i < end {
            let leaf = self.0.get((i / BITS_PER_LEAF) as usize)?;
            let Some(leaf) = leaf else {
                i = (i / BITS_PER_LEAF + 1) * BITS_PER_LEAF;
                continue;
            };
            let bit = i % BITS_PER_LEAF;
            let rest = leaf[(bit / 64) as usize] >> (bit % 64);
            if rest != 0 {
                let found = i + u64::from(rest.trailing_zeros());
                return (found < end).then_some(found);
            }
            i = (i / 64 + 1) * 64;
        }
        None
    }
    /// Clears every bit from `n` on.
    fn truncate(&mut self, n: u64) {
        let leaves = n.div_ceil(BITS_PER_LEAF) as usize;
        self.0.truncate(leaves);
        // the leaf holding bit n, if there is one (a shorter table has no
        // bit at or past n)
        if !n.is_multiple_of(BITS_PER_LEAF) && self.0.len() == leaves {
            if let Some(Some(leaf)) = self.0.last_mut() {
                let bit = n % BITS_PER_LEAF;
                let w = (bit / 64) as usize;
                leaf[w] &= (1 << (bit % 64)) - 1;
                leaf[w + 1..].fill(0);
                if leaf.iter().all(|&x| x == 0) {
                    *self.0.last_mut().expect("a last leaf") = None;
                }
            }
        }
        self.trim_table();
    }
    /// Bytes of memory held.
    fn memory_bytes(&self) -> u64 {
        self.0.capacity() as u64 * 8
            + self.0.iter().flatten().count() as u64 * (WORDS_PER_LEAF as u64 * 8)
    }
}

#[derive(Debug)]
struct Inner {
    array: PagedArray,
    evicted: Bits,
    /// Pages carried by a commit not yet checkpointed, with the commit's
    /// generation.
    pinned: HashMap<u64, u64>,
    /// Eviction candidates in the order they became clean and unpinned
    /// (loaded, or released by a checkpoint); each page at most once
    /// ([`Inner::queued`]). A candidate found dirty or pinned when its turn
    /// comes leaves the queue: the checkpoint that releases it queues it
    /// again. So eviction never rescans pages it cannot evict.
    fifo: VecDeque<u64>,
    queued: Bits,
    /// Pages whose whole image a commit carried since the last checkpoint:
    /// later commits may log only the bytes that changed.
    logged: Bits,
    source: Option<File>,
    /// The file's name in messages.
    name: String,
    group: Arc<CacheGroup>,
}

/// A metadata array paged from its file; see the module docs. Interior
/// mutability: reads may load pages. Callers hold the engine's metadata lock.
#[derive(Debug)]
pub struct CachedArray {
    inner: RefCell<Inner>,
}

impl Default for CachedArray {
    fn default() -> Self {
        CachedArray::new(PagedArray::default())
    }
}

impl CachedArray {
    /// An array over `array`, all resident, in a group of its own without
    /// a budget (no file to page from yet).
    pub fn new(array: PagedArray) -> Self {
        let group = CacheGroup::new(0, OnLoadError::ReadAsZeros);
        group.resident_pages.store(array.resident_units(), Relaxed);
        CachedArray {
            inner: RefCell::new(Inner {
                array,
                evicted: Bits::default(),
                queued: Bits::default(),
                logged: Bits::default(),
                pinned: HashMap::new(),
                fifo: VecDeque::new(),
                source: None,
                name: String::new(),
                group,
            }),
        }
    }

    /// Pages from `file` (the array's metadata file, called `name` in
    /// messages) from now on, under `group`'s budget. `pinned` lists pages
    /// whose latest image is not in place yet (replayed from the journal);
    /// they stay until [`CachedArray::unpin_through`]`(0)`.
    pub fn page_from(
        &self,
        file: File,
        name: &str,
        group: &Arc<CacheGroup>,
        pinned: impl IntoIterator<Item = u64>,
    ) {
        let mut i = self.inner.borrow_mut();
        i.name = name.to_string();
        let resident = i.array.resident_units();
        i.group.resident_pages.fetch_sub(resident, Relaxed);
        i.group
            .pinned_pages
            .fetch_sub(i.pinned.len() as u64, Relaxed);
        i.group = group.clone();
        group.resident_pages.fetch_add(resident, Relaxed);
        group.pinned_pages.fetch_add(i.pinned.len() as u64, Relaxed);
        i.source = Some(file);
        for p in pinned {
            if i.pinned.insert(p, 0).is_none() {
                i.group.pinned_pages.fetch_add(1, Relaxed);
            }
        }
        let pages: Vec<u64> = (0..i.array.page_count())
            .filter(|&p| !i.array.page_is_hole(p))
            .collect();
        for p in pages {
            i.enqueue(p);
        }
        i.enforce_budget(None);
    }

    /// Marks `pages`, holes in memory, as held by the file (valid images
    /// there): they are read on first use. For an array opened without
    /// reading its file ([`crate::metaopen`]).
    pub fn mark_on_file(&self, pages: impl IntoIterator<Item = u64>) {
        let mut i = self.inner.borrow_mut();
        if i.source.is_none() {
            return;
        }
        for p in pages {
            if p < i.array.page_count() && i.array.page_is_hole(p) {
                i.evicted.set(p, true);
            }
        }
    }

    /// Evicts this array's clean, unpinned pages while its group is over
    /// budget. (Each array evicts its own pages as it loads others, so an
    /// array not used for a while keeps what it last loaded until then.)
    pub fn trim(&self) {
        self.inner.borrow_mut().enforce_budget(None);
    }

    /// True once the array pages from a file.
    pub fn has_source(&self) -> bool {
        self.inner.borrow().source.is_some()
    }

    /// Reads `N` bytes at logical byte offset `off` (one element; it never
    /// spans two pages). Zeros for holes, and for an unreadable page.
    #[inline]
    pub fn get_array<const N: usize>(&self, off: u64) -> [u8; N] {
        let mut i = self.inner.borrow_mut();
        i.load(off / PAYLOAD_SIZE as u64);
        i.array.get_array(off)
    }

    /// The `N` bytes at logical byte offset `off` (one element, as
    /// [`CachedArray::get_array`] reads it) if their page is in memory or a
    /// hole; `None` if reading them would load the page. Never loads, so
    /// nothing resident or counted changes: for hints.
    #[inline]
    pub fn peek_array<const N: usize>(&self, off: u64) -> Option<[u8; N]> {
        let i = self.inner.borrow();
        (!i.evicted.get(off / PAYLOAD_SIZE as u64)).then(|| i.array.get_array(off))
    }

    /// Hints that the bytes at logical offset `off` will be read soon
    /// (nothing if their page is not in memory: it is not loaded).
    #[inline]
    pub fn prefetch(&self, off: u64) {
        let i = self.inner.borrow();
        if !i.evicted.get(off / PAYLOAD_SIZE as u64) {
            i.array.prefetch(off);
        }
    }

    /// Reads the little-endian `u64` at element index `idx`.
    #[inline]
    pub fn get_u64(&self, idx: u64) -> u64 {
        u64::from_le_bytes(self.get_array(idx * 8))
    }

    /// Reads the little-endian `u32` at element index `idx`.
    #[inline]
    pub fn get_u32(&self, idx: u64) -> u32 {
        u32::from_le_bytes(self.get_array(idx * 4))
    }

    /// Sets the little-endian `u64` at element index `idx`.
    #[inline]
    pub fn set_u64(&mut self, idx: u64, v: u64) {
        self.set_array(idx * 8, v.to_le_bytes());
    }

    /// Sets the little-endian `u32` at element index `idx`.
    #[inline]
    pub fn set_u32(&mut self, idx: u64, v: u32) {
        self.set_array(idx * 4, v.to_le_bytes());
    }

    /// Writes the `N` bytes of one element at logical byte offset `off`, as
    /// [`CachedArray::write`] does, with a fixed-size copy when the element
    /// lies in one page (every element whose size divides
    /// [`PAYLOAD_SIZE`] does).
    #[inline]
    pub fn set_array<const N: usize>(&mut self, off: u64, data: [u8; N]) {
        let page = off / PAYLOAD_SIZE as u64;
        if (off % PAYLOAD_SIZE as u64) as usize + N > PAYLOAD_SIZE {
            return self.write(off, &data);
        }
        let i = self.inner.get_mut();
        i.change_page(page, |a| a.set_array(off, data));
        i.enforce_budget(None);
    }

    /// Writes `data` at logical byte offset `off` (whole elements), page by
    /// page, with no allocation on the write path. A page that cannot be
    /// loaded in a group that faults is left untouched.
    pub fn write(&mut self, off: u64, data: &[u8]) {
        let i = self.inner.get_mut();
        let end = off + data.len() as u64;
        let mut pos = off;
        while pos < end {
            let p = pos / PAYLOAD_SIZE as u64;
            let upto = ((p + 1) * PAYLOAD_SIZE as u64).min(end);
            i.change_page(p, |a| {
                a.write(pos, &data[(pos - off) as usize..(upto - off) as usize])
            });
            pos = upto;
        }
        i.enforce_budget(None);
    }

    /// Number of pages (in memory or not) the array spans.
    pub fn page_count(&self) -> u64 {
        self.inner.borrow().array.page_count()
    }

    /// Logical bytes the array spans.
    pub fn logical_len(&self) -> u64 {
        self.inner.borrow().array.logical_len()
    }

    /// True if page `page` holds no entry (never written; not merely out
    /// of memory).
    pub fn page_is_hole(&self, page: u64) -> bool {
        let i = self.inner.borrow();
        !i.evicted.get(page) && i.array.page_is_hole(page)
    }

    /// The non-zero `u64` entries with index in `range`, as (index, value),
    /// in order; loads the pages it visits, one at a time, and skips holes.
    pub fn nonzero_u64(&self, range: std::ops::Range<u64>) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        self.for_each_nonzero_u64(range, |idx, v| out.push((idx, v)));
        out
    }

    /// The index of the first page in `from..end` (page indexes) that may
    /// hold a non-zero entry: in memory, or evicted to the file; `None` if
    /// every page there is a hole (never written: all zeros). Holes are
    /// skipped without a look, a chunk of pages or a word of eviction bits
    /// at a time.
    pub fn next_present_page(&self, from: u64, end: u64) -> Option<u64> {
        let i = self.inner.borrow();
        let in_memory = i.array.next_allocated_page(from, end);
        // an evicted page before that one?
        let evicted = i.evicted.next_set(from, in_memory.unwrap_or(end));
        evicted.or(in_memory)
    }

    /// Number of non-zero little-endian `u64` entries in index range
    /// `range`, read a page at a time (evicted pages are loaded in turn).
    pub fn count_nonzero_u64(&self, range: std::ops::Range<u64>) -> u64 {
        let mut n = 0;
        self.for_each_nonzero_u64(range, |_, _| n += 1);
        n
    }

    /// Calls `f(index, value)` for each non-zero `u64` entry in `range`,
    /// a page at a time (the array is borrowed meanwhile: `f` must not
    /// touch it).
    pub fn for_each_nonzero_u64(&self, range: std::ops::Range<u64>, f: impl FnMut(u64, u64)) {
        self.for_each_nonzero::<8>(range, f)
    }

    /// Calls `f(index, value)` for each non-zero `u32` entry (1016 per
    /// page) in `range`, in order, a page at a time; holes are skipped
    /// without a look, so the cost follows the pages present, not the
    /// array's length.
    pub fn for_each_nonzero_u32(&self, range: std::ops::Range<u64>, f: impl FnMut(u64, u64)) {
        self.for_each_nonzero::<4>(range, f)
    }

    fn for_each_nonzero<const W: usize>(
        &self,
        range: std::ops::Range<u64>,
        mut f: impl FnMut(u64, u64),
    ) {
        let per_page = (crate::paged::PAYLOAD_SIZE / W) as u64;
        let end = range.end.min(self.page_count() * per_page);
        let mut start = range.start;
        while start < end {
            let Some(page) = self.next_present_page(start / per_page, end.div_ceil(per_page))
            else {
                return;
            };
            start = start.max(page * per_page);
            let upto = ((page + 1) * per_page).min(end);
            let found = {
                let mut i = self.inner.borrow_mut();
                i.load(page);
                i.array.nonzero_le::<W>(start..upto)
            };
            for (idx, v) in found {
                f(idx, v);
            }
            start = upto;
        }
    }

    /// Takes the pages changed since the last call (see
    /// [`PagedArray::take_dirty`]); they stay pinned in memory until the
    /// checkpoint that covers commit generation `generation`.
    pub fn take_dirty(&mut self, generation: u64) -> Vec<DirtyPage> {
        let i = self.inner.get_mut();
        // (a chunk that held only dirty marks is freed)
        let out = i.counted(|a| a.take_dirty());
        for d in &out {
            if i.pinned.insert(d.page, generation).is_none() {
                i.group.pinned_pages.fetch_add(1, Relaxed);
            }
        }
        out
    }

    /// Forgets the pages changed since the last commit, encoding and
    /// pinning nothing; `changed(page, bytes)` as in
    /// [`PagedArray::clear_dirty`].
    pub fn clear_dirty(&mut self, changed: impl FnMut(u64, usize)) {
        self.inner.get_mut().counted(|a| a.clear_dirty(changed));
    }

    /// True if a commit since the last checkpoint carried page `page`'s
    /// whole image (see [`CachedArray::set_logged`]).
    pub fn is_logged(&self, page: u64) -> bool {
        self.inner.borrow().logged.get(page)
    }

    /// Records whether the journal holds page `page`'s whole image since
    /// the last checkpoint: set when a commit carries it, cleared when that
    /// commit fails.
    pub fn set_logged(&mut self, page: u64, logged: bool) {
        self.inner.get_mut().logged.set(page, logged);
    }

    /// Forgets every logged image: the journal restarts empty after a
    /// checkpoint.
    pub fn clear_logged(&mut self) {
        self.inner.get_mut().logged = Bits::default();
    }

    /// Releases the pages pinned by commits up to `generation`, now in
    /// place in the file, and evicts down to the budget.
    pub fn unpin_through(&mut self, generation: u64) {
        let i = self.inner.get_mut();
        let mut released = Vec::new();
        i.pinned.retain(|&p, g| {
            let keep = *g > generation;
            if !keep {
                released.push(p);
            }
            keep
        });
        i.group
            .pinned_pages
            .fetch_sub(released.len() as u64, Relaxed);
        for p in released {
            i.enqueue(p);
        }
        i.enforce_budget(None);
    }

    /// Marks `page` dirty again (after a failed commit, or to rewrite it).
    pub fn redirty(&mut self, page: u64) {
        let i = self.inner.get_mut();
        if i.load(page) {
            // (a hole's chunk may be allocated for the mark)
            i.counted(|a| a.redirty(page));
        }
    }

    /// Number of dirty pages.
    pub fn dirty_count(&self) -> usize {
        self.inner.borrow().array.dirty_count()
    }

    /// See [`PagedArray::count_dirty_in`].
    pub fn count_dirty_in(&self, total: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        self.inner.borrow_mut().array.count_dirty_in(total);
    }

    /// Drops every entry past logical length `len_bytes`.
    pub fn truncate(&mut self, len_bytes: u64) {
        let i = self.inner.get_mut();
        let keep = len_bytes.div_ceil(PAYLOAD_SIZE as u64);
        if !len_bytes.is_multiple_of(PAYLOAD_SIZE as u64) {
            // its tail is zeroed in memory: bring it back first
            i.load(keep - 1);
        }
        i.counted(|a| a.truncate(len_bytes));
        i.evicted.truncate(keep);
        i.queued.truncate(keep);
        // a page cut and grown again is logged whole again
        i.logged.truncate(keep.saturating_sub(1));
        i.fifo.retain(|&p| p < keep);
        let dropped = i.pinned.len();
        i.pinned.retain(|&p, _| p < keep);
        i.group
            .pinned_pages
            .fetch_sub((dropped - i.pinned.len()) as u64, Relaxed);
    }

    /// Bytes of memory held (resident pages and tables).
    pub fn resident_bytes(&self) -> u64 {
        let i = self.inner.borrow();
        i.array.resident_bytes()
            + i.evicted.memory_bytes()
            + i.queued.memory_bytes()
            + i.logged.memory_bytes()
            + i.fifo.capacity() as u64 * 8
            + i.pinned.capacity() as u64 * 24
    }

    /// Figures of the array's group.
    pub fn group_stats(&self) -> PageCacheStats {
        self.inner.borrow().group.stats()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.group
            .resident_pages
            .fetch_sub(self.array.resident_units(), Relaxed);
        self.group
            .pinned_pages
            .fetch_sub(self.pinned.len() as u64, Relaxed);
    }
}

impl Inner {
    /// Runs `f` on the array, charging the group for the pages and chunks
    /// it allocated or freed.
    fn counted<R>(&mut self, f: impl FnOnce(&mut PagedArray) -> R) -> R {
        let before = self.array.resident_units();
        let r = f(&mut self.array);
        let after = self.array.resident_units();
        if after > before {
            self.group.resident_pages.fetch_add(after - before, Relaxed);
        } else {
            self.group.resident_pages.fetch_sub(before - after, Relaxed);
        }
        r
    }

    /// Loads `page` and applies `change` (which writes within it) to the
    /// array, counting the page as resident if the change allocated it.
    /// A page that cannot be loaded in a group that faults, or after an
    /// I/O error, is left untouched, and the dropped write counted.
    #[inline]
    fn change_page(&mut self, page: u64, change: impl FnOnce(&mut PagedArray)) {
        if !self.load(page) {
            self.group.writes_dropped.fetch_add(1, Relaxed);
        } else {
            // (a new page is dirty, queued once a checkpoint releases it,
            // or by `page_from` before paging starts)
            self.counted(change);
        }
    }

    /// Brings `page` back into memory if it was evicted. False if it could
    /// not be and the group faults on that (the caller must not use it).
    #[inline]
    fn load(&mut self, page: u64) -> bool {
        !self.evicted.get(page) || self.load_evicted(page)
    }

    /// [`Inner::load`] of a page that is evicted.
    #[cold]
    #[inline(never)]
    fn load_evicted(&mut self, page: u64) -> bool {
        let mut buf = [0u8; PAGE_SIZE];
        let read = match &self.source {
            Some(f) => read_page(f, page, &mut buf),
            None => Ok(()),
        };
        self.group.pages_loaded.fetch_add(1, Relaxed);
        let payload = match read.map(|()| decode_page(&buf, self.array.tag(), page)) {
            Ok(Ok(Some(p))) => Some(p),
            failed => {
                let io_error = failed.is_err();
                // (only a page holding entries leaves memory, and only once
                // its image is on file: all zeros there, or a file cut
                // short before it, is damage, not an empty page)
                let why = match failed {
                    Err(e) => e.to_string(),
                    Ok(Ok(None)) => "all zeros on file (zeroed or cut short)".to_string(),
                    _ => "checksum mismatch".to_string(),
                };
                self.group
                    .note_error(format!("page {page} of {}: {why}", self.name));
                if self.group.on_error == OnLoadError::Fault || io_error {
                    // stays out of memory: a later access tries again. (An
                    // I/O error may pass: under ReadAsZeros the page reads
                    // as zeros meanwhile, but a write to it is dropped
                    // rather than committing zeros over the entries that
                    // could not be read. A page that fails its checksum
                    // holds nothing to keep: it reads as zeros and takes
                    // writes.)
                    return false;
                }
                None
            }
        };
        self.evicted.set(page, false);
        if let Some(p) = payload {
            self.counted(|a| a.put_page(page, p));
            self.enqueue(page);
            // never the page being read
            self.enforce_budget(Some(page));
        }
        true
    }

    /// Queues `page` as an eviction candidate unless it is queued already.
    fn enqueue(&mut self, page: u64) {
        if !self.queued.get(page) {
            self.queued.set(page, true);
            self.fifo.push_back(page);
        }
    }

    /// Evicts clean, unpinned pages other than `keep`, oldest first, while
    /// the group is over its budget.
    #[inline]
    fn enforce_budget(&mut self, keep: Option<u64>) {
        if self.source.is_some() && self.group.over_budget() {
            self.evict_over_budget(keep);
        }
    }

    /// [`Inner::enforce_budget`] once the group is over its budget.
    #[inline(never)]
    fn evict_over_budget(&mut self, keep: Option<u64>) {
        while self.group.over_budget() {
            let Some(p) = self.fifo.pop_front() else {
                break;
            };
            if keep == Some(p) {
                // only the page being read is left
                self.fifo.push_front(p);
                break;
            }
            self.queued.set(p, false);
            if self.array.page_is_hole(p) {
                continue; // emptied or truncated since it was queued
            }
            if self.array.is_dirty(p) || self.pinned.contains_key(&p) {
                continue; // queued again when a checkpoint releases it
            }
            self.counted(|a| a.drop_page(p));
            self.evicted.set(p, true);
            self.group.pages_evicted.fetch_add(1, Relaxed);
        }
    }
}

/// Reads page `page` of `f` into `buf`; past the end of the file: zeros.
fn read_page(f: &File, page: u64, buf: &mut [u8; PAGE_SIZE]) -> std::io::Result<()> {
    crate::fileio::read_padded(f, buf, page * PAGE_SIZE as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    const PER_PAGE: u64 = crate::paged::U64_PER_PAGE;

    #[test]
    fn truncating_bits_past_their_end_keeps_them() {
        let mut b = Bits::default();
        b.set(20, true);
        b.set(63, true);
        // one word; a cut at 1033 is in word 16, which it does not have
        b.truncate(1033);
        assert!(b.get(20) && b.get(63));
        b.set(100, true);
        b.truncate(70);
        assert!(b.get(20) && b.get(63) && !b.get(100));
        b.truncate(21);
        assert!(b.get(20) && !b.get(63));
        b.truncate(0);
        assert!(!b.get(20));
        assert!(b.0.is_empty());
    }

    #[test]
    fn bits_cost_what_is_set_not_how_far() {
        let mut b = Bits::default();
        // the last page of a 1 PiB volume's map
        let far = (1u64 << 38) / PER_PAGE;
        b.set(far, true);
        assert!(b.memory_bytes() < 2 << 20, "{} bytes", b.memory_bytes());
        assert!(b.get(far) && !b.get(far - 1) && !b.get(far + 1));
        assert_eq!(b.next_set(0, far + 1), Some(far));
        assert_eq!(b.next_set(0, far), None);
        b.set(5, true);
        assert_eq!(b.next_set(0, far + 1), Some(5));
        assert_eq!(b.next_set(6, far + 1), Some(far));
        // cleared, its leaf and the table's tail go
        b.set(far, false);
        assert!(!b.get(far));
        assert_eq!(b.0.len(), 1);
        b.set(5, false);
        assert_eq!(b.0.len(), 0);
        // a cut inside a leaf keeps the bits before it only
        b.set(4095, true);
        b.set(4100, true);
        b.set(4200, true);
        b.truncate(4101);
        assert!(b.get(4095) && b.get(4100) && !b.get(4200));
        b.truncate(4100);
        assert!(b.get(4095) && !b.get(4100));
        assert_eq!(b.0.len(), 1);
    }

    /// An array of `pages` pages (entry `i` = `i + 1`), committed and
    /// checkpointed to a temporary file, paging under `group`.
    fn paged(pages: u64, group: &Arc<CacheGroup>) -> (CachedArray, tempfile::NamedTempFile) {
        paged_at(0..pages * PER_PAGE, group)
    }

    /// [`paged`] with only the entries at `indexes` set (entry `i` = `i + 1`).
    fn paged_at(
        indexes: impl IntoIterator<Item = u64>,
        group: &Arc<CacheGroup>,
    ) -> (CachedArray, tempfile::NamedTempFile) {
        paged_through(indexes, group, |f| f.reopen().unwrap())
    }

    /// [`paged_at`], paging from the descriptor `open` gives for the file.
    fn paged_through(
        indexes: impl IntoIterator<Item = u64>,
        group: &Arc<CacheGroup>,
        open: impl FnOnce(&tempfile::NamedTempFile) -> std::fs::File,
    ) -> (CachedArray, tempfile::NamedTempFile) {
        let mut a = CachedArray::new(PagedArray::new(9));
        for i in indexes {
            a.set_u64(i, i + 1);
        }
        let f = tempfile::NamedTempFile::new().unwrap();
        for d in a.take_dirty(1) {
            f.as_file()
                .write_all_at(&d.image[..], d.page * PAGE_SIZE as u64)
                .unwrap();
        }
        a.page_from(open(&f), "test", group, []);
        (a, f)
    }

    #[test]
    fn pages_leave_after_checkpoint_and_come_back_intact() {
        let group = CacheGroup::new(2 * PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let (mut a, _f) = paged(8, &group);
        // pinned by the commit until the checkpoint
        assert_eq!(group.stats().pinned_pages, 8);
        assert_eq!(group.stats().pages_evicted, 0);
        a.unpin_through(1);
        let s = group.stats();
        // one page and the page table's chunk, charged as one
        assert_eq!(
            (s.pinned_pages, s.resident_bytes),
            (0, 2 * PAYLOAD_SIZE as u64)
        );
        assert_eq!(s.pages_evicted, 7);
        for i in (0..8 * PER_PAGE).step_by(37) {
            assert_eq!(a.get_u64(i), i + 1);
        }
        assert!(group.stats().pages_loaded >= 6);
        assert!(group.stats().resident_bytes <= 2 * PAYLOAD_SIZE as u64);
        assert!(!a.page_is_hole(0), "an evicted page is not a hole");
        let all = a.nonzero_u64(0..8 * PER_PAGE);
        assert_eq!(all.len() as u64, 8 * PER_PAGE);
        assert!(all.iter().all(|&(i, v)| v == i + 1));
        // a dirty page stays until its commit is checkpointed
        a.set_u64(5, 99);
        for i in (0..8 * PER_PAGE).step_by(PER_PAGE as usize) {
            a.get_u64(i);
        }
        assert_eq!(a.get_u64(5), 99);
        assert_eq!(group.load_errors(), 0);
    }

    #[test]
    fn scans_of_a_sparse_array_find_resident_and_evicted_entries_only() {
        // entries far apart: some pages stay in memory, others are evicted
        let group = CacheGroup::new(2 * PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let far = 1u64 << 34; // 2^34 entries span 34 M pages
        let at = [3, PER_PAGE * 300 + 7, far / 2, far / 2 + 1, far - 1];
        let (mut a, _f) = paged_at(at, &group);
        a.unpin_through(1);
        assert!(
            group.stats().pages_evicted >= 2,
            "some pages are on file only"
        );
        let want: Vec<(u64, u64)> = at.iter().map(|&i| (i, i + 1)).collect();
        assert_eq!(a.nonzero_u64(0..far), want);
        assert_eq!(a.nonzero_u64(4..far - 1), want[1..4].to_vec());
        assert_eq!(a.count_nonzero_u64(far / 2 + 1..far), 2);
        let first_page = a.next_present_page(1, far / PER_PAGE);
        assert_eq!(first_page, Some(300));
        assert_eq!(a.next_present_page(301, far / 2 / PER_PAGE), None);
        assert_eq!(group.load_errors(), 0);
    }

    #[test]
    fn an_unreadable_page_faults_and_is_never_written() {
        // page 1 goes bad on disk while out of memory
        page_damaged_while_out(
            |f| f.write_all_at(&[0xff; 8], PAGE_SIZE as u64 + 40).unwrap(),
            1,
        );
    }

    #[test]
    fn a_page_zeroed_or_cut_on_disk_while_out_of_memory_faults() {
        // an evicted page held entries: all zeros on disk (zeroed in
        // place, or past a file cut short) is damage, not an empty page
        page_damaged_while_out(
            |f| {
                f.write_all_at(&[0u8; PAGE_SIZE], PAGE_SIZE as u64).unwrap();
                f.set_len(2 * PAGE_SIZE as u64).unwrap();
            },
            2,
        );
    }

    /// Pages 1 and 2 of a 3-page array leave memory, `damage` changes
    /// the file (page 1, and page 2 too if `bad_pages` is 2), and they are
    /// read back: under `Fault` a bad page reads as zeros, is counted and
    /// drops writes; under `ReadAsZeros` it reads as zeros and takes them.
    fn page_damaged_while_out(damage: impl Fn(&std::fs::File), bad_pages: u64) {
        let group = CacheGroup::new(PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let (mut a, f) = paged(3, &group);
        a.unpin_through(1);
        damage(f.as_file());
        a.get_u64(0);
        assert_eq!(a.get_u64(PER_PAGE + 1), 0);
        let page2 = if bad_pages == 2 { 0 } else { 2 * PER_PAGE + 1 };
        assert_eq!(a.get_u64(2 * PER_PAGE), page2);
        assert_eq!(group.load_errors(), bad_pages);
        assert!(group.first_error().unwrap().contains("page 1 of test"));
        a.set_u64(PER_PAGE + 2, 7);
        assert_eq!(a.dirty_count(), 0, "a write to a faulted page is dropped");
        assert!(!a.page_is_hole(1));
        // with zeros as the policy the page reads as zeros and is writable
        let zeros = CacheGroup::new(PAYLOAD_SIZE as u64, OnLoadError::ReadAsZeros);
        let (mut z, f) = paged(3, &zeros);
        z.unpin_through(1);
        damage(f.as_file());
        z.get_u64(0);
        assert_eq!(z.get_u64(PER_PAGE + 1), 0);
        z.set_u64(PER_PAGE + 2, 7);
        assert_eq!(z.get_u64(PER_PAGE + 2), 7);
        assert_eq!(zeros.load_errors(), 1);
    }

    #[test]
    fn a_page_that_cannot_be_read_is_not_overwritten_with_zeros() {
        // the file is opened write-only: every read of it fails (EBADF),
        // as a transient EIO would
        let zeros = CacheGroup::new(PAYLOAD_SIZE as u64, OnLoadError::ReadAsZeros);
        let (mut a, _f) = paged_through(0..3 * PER_PAGE, &zeros, |f| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(f.path())
                .unwrap()
        });
        a.unpin_through(1); // all but one page leave memory
        let mut unreadable = 0;
        for page in 0..3 {
            let i = page * PER_PAGE + 1;
            if a.get_u64(i) == 0 {
                unreadable += 1;
                a.set_u64(i + 1, 7);
                assert_eq!(a.get_u64(i + 1), 0, "a write to page {page} was kept");
            }
        }
        assert!(unreadable >= 2, "{unreadable}");
        assert_eq!(a.dirty_count(), 0, "zeros would be committed");
        assert!(zeros.load_errors() >= 2);
        assert_eq!(zeros.writes_dropped(), unreadable);
    }

    #[test]
    fn pages_scattered_one_per_chunk_stay_within_the_budget_in_bytes() {
        // 64 pages, each alone in its chunk of the page table, under a
        // budget of 16 pages' bytes
        let budget = 16 * PAYLOAD_SIZE as u64;
        let group = CacheGroup::new(budget, OnLoadError::Fault);
        let chunk = crate::paged::CHUNK_PAGES as u64;
        let (mut a, _f) = paged_at((0..64).map(|k| k * chunk * PER_PAGE), &group);
        a.unpin_through(1);
        for round in 0..2 {
            for k in 0..64 {
                let i = k * chunk * PER_PAGE;
                assert_eq!(a.get_u64(i), i + 1, "round {round}");
                // the pages' and chunks' memory, whatever the table's
                // length (one page may be over while it is read)
                let held = a.inner.borrow().array.resident_bytes()
                    - a.inner.borrow().array.page_table_bytes();
                assert!(held <= budget + 2 * 4096, "{held} bytes held");
            }
        }
    }

    #[test]
    fn marking_a_hole_dirty_and_taking_it_keeps_the_group_count_exact() {
        let group = CacheGroup::new(PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let chunk = crate::paged::CHUNK_PAGES as u64;
        let (mut a, _f) = paged_at([0, (chunk + 10) * PER_PAGE], &group);
        a.unpin_through(1);
        let units = |a: &CachedArray| a.inner.borrow().array.resident_units();
        let charged = |g: &Arc<CacheGroup>| g.stats().resident_bytes / PAYLOAD_SIZE as u64;
        assert_eq!(charged(&group), units(&a));
        // a hole in a chunk not in memory, marked dirty (as a repair
        // rewrites a damaged page), then committed
        a.redirty(chunk + 3);
        assert_eq!(charged(&group), units(&a));
        a.take_dirty(2);
        assert_eq!(charged(&group), units(&a));
        a.redirty(chunk + 4);
        a.clear_dirty(|_, _| {});
        assert_eq!(charged(&group), units(&a));
        // loads and evictions after it stay exact
        assert_eq!(
            a.get_u64((chunk + 10) * PER_PAGE),
            (chunk + 10) * PER_PAGE + 1
        );
        assert_eq!(a.get_u64(0), 1);
        assert_eq!(charged(&group), units(&a));
    }

    #[test]
    fn pinned_pages_over_the_budget_leave_room_for_clean_ones() {
        // a budget of 16 pages; 64 pages on file
        let group = CacheGroup::new(16 * PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let (mut a, _f) = paged(64, &group);
        a.unpin_through(1);
        // 24 pages changed and committed: pinned until the checkpoint,
        // more than the budget
        for p in 0..24 {
            a.set_u64(p * PER_PAGE, 7);
        }
        a.take_dirty(2);
        assert!(group.stats().pinned_pages >= 24);
        // a clean page read again and again comes from memory after the
        // first read
        let loaded = group.stats().pages_loaded;
        for _ in 0..10 {
            assert_eq!(a.get_u64(40 * PER_PAGE + 1), 40 * PER_PAGE + 2);
            assert_eq!(a.get_u64(41 * PER_PAGE + 1), 41 * PER_PAGE + 2);
        }
        assert!(
            group.stats().pages_loaded <= loaded + 2,
            "{} loads",
            group.stats().pages_loaded - loaded
        );
        // and the clean pages held stay within a quarter of the budget
        let clean = group.stats().resident_bytes / PAYLOAD_SIZE as u64 - group.stats().pinned_pages;
        assert!(clean <= 16 / 4 + 1, "{clean} clean pages");
    }

    #[test]
    fn a_group_shares_one_budget_and_forgets_dropped_arrays() {
        let group = CacheGroup::new(3 * PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let (mut a, _fa) = paged(6, &group);
        let (mut b, _fb) = paged(6, &group);
        a.unpin_through(1);
        b.unpin_through(1);
        for round in 0..3 {
            for i in (0..6 * PER_PAGE).step_by(PER_PAGE as usize) {
                assert_eq!(a.get_u64(i + round), i + round + 1);
                assert_eq!(b.get_u64(i + round), i + round + 1);
                // one page per array may be over while it is read
                assert!(group.stats().resident_bytes <= 5 * PAYLOAD_SIZE as u64);
            }
        }
        drop(a);
        drop(b);
        assert_eq!(group.stats().resident_bytes, 0);
        assert_eq!(group.stats().pinned_pages, 0);
    }

    #[test]
    fn truncating_an_evicted_tail_page_zeroes_it() {
        let group = CacheGroup::new(PAYLOAD_SIZE as u64, OnLoadError::Fault);
        let (mut a, _f) = paged(4, &group);
        a.unpin_through(1);
        a.get_u64(0); // pages 1..4 out of memory
        a.truncate((2 * PER_PAGE + 10) * 8);
        assert_eq!(a.page_count(), 3);
        assert_eq!(a.get_u64(2 * PER_PAGE + 9), 2 * PER_PAGE + 10);
        assert_eq!(a.get_u64(2 * PER_PAGE + 10), 0);
        assert_eq!(a.get_u64(3 * PER_PAGE + 1), 0);
        assert_eq!(a.get_u64(PER_PAGE), PER_PAGE + 1);
        assert_eq!(group.load_errors(), 0);
    }
}
