//! The reverse index PBA → fingerprint (SmartDedup §3.4: an overwrite or
//! TRIM finds the fingerprint to remove from the index without knowing it;
//! a fingerprint hit is checked against it), kept in memory under a byte
//! budget and paged from its file on demand.
//!
//! The file `fingerprints` holds 32 bytes per PBA in checksummed 4 KiB pages
//! ([`crate::paged`]); the journal carries changed pages like every other
//! metadata page. In memory, at most `cache_bytes` of pages stay resident
//! (0: all of them). A page may leave memory only when its latest image is
//! in place in the file: it is clean, and no commit since the last
//! checkpoint carried it (such pages are *pinned* until the checkpoint that
//! writes them in place, which bounds them by the journal size). Eviction
//! is first-in first-out over resident pages; a read of an evicted page
//! loads it back (one `pread` and a CRC check).
//!
//! The reverse index can be rebuilt from the data (`dedupd fsck --repair
//! --rehash`), so a page that cannot be read back or fails its checksum
//! reads as zeros — "not fingerprinted yet" — and is counted: lookups then
//! miss (never share wrong data) and out-of-line dedup re-hashes those
//! blocks.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

use crate::fingerprint::{Fingerprint, FINGERPRINT_SIZE};
use crate::paged::{decode_page, PagedArray, PAGE_SIZE, PAYLOAD_SIZE};

/// Figures of the reverse index's page cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReverseIndexStats {
    /// Bytes of pages allowed in memory (0: unbounded).
    pub cache_bytes: u64,
    /// Bytes of pages in memory now.
    pub resident_bytes: u64,
    /// Pages that must stay in memory until the next checkpoint.
    pub pinned_pages: u64,
    /// Pages read back from the file since the engine started.
    pub pages_loaded: u64,
    /// Pages dropped from memory since the engine started.
    pub pages_evicted: u64,
    /// Pages that could not be read back or failed their checksum (read
    /// as "not fingerprinted"; `dedupd fsck --repair --rehash` rebuilds them).
    pub load_errors: u64,
}

#[derive(Debug, Default)]
struct Inner {
    array: PagedArray,
    /// Per page: not in memory, its image is in place in the file.
    evicted: Vec<bool>,
    /// Pages carried by a commit not yet checkpointed, with the commit's
    /// generation.
    pinned: HashMap<u64, u64>,
    /// Resident pages in load order (may hold pages evicted since).
    fifo: VecDeque<u64>,
    resident_pages: u64,
    source: Option<File>,
    budget_pages: u64,
    stats: ReverseIndexStats,
}

/// The reverse index; see the module docs. Interior mutability: reads may
/// load pages. Callers hold the engine's metadata lock.
#[derive(Debug, Default)]
pub struct ReverseIndex {
    inner: RefCell<Inner>,
}

impl ReverseIndex {
    /// A reverse index over `array` (all resident; no file to page from yet).
    pub fn new(array: PagedArray) -> Self {
        let resident_pages = (0..array.page_count())
            .filter(|&p| !array.page_is_hole(p))
            .count() as u64;
        let evicted = vec![false; array.page_count() as usize];
        ReverseIndex {
            inner: RefCell::new(Inner {
                array,
                evicted,
                resident_pages,
                ..Inner::default()
            }),
        }
    }

    /// Pages from `file` (the store's `fingerprints`) from now on, keeping
    /// at most `cache_bytes` of pages in memory (0: unbounded). `pinned`
    /// lists pages whose latest image is not in place yet (replayed from
    /// the journal); they stay until [`ReverseIndex::unpin_through`]`(0)`.
    pub fn page_from(&self, file: File, cache_bytes: u64, pinned: impl IntoIterator<Item = u64>) {
        let mut i = self.inner.borrow_mut();
        i.source = Some(file);
        i.budget_pages = cache_bytes / PAYLOAD_SIZE as u64;
        i.stats.cache_bytes = cache_bytes;
        for p in pinned {
            i.pinned.insert(p, 0);
        }
        let resident: Vec<u64> = (0..i.array.page_count())
            .filter(|&p| !i.array.page_is_hole(p))
            .collect();
        i.fifo.extend(resident);
        i.enforce_budget(None);
    }

    /// The fingerprint recorded for `pba` (zeros if none).
    pub fn get(&self, pba: u64) -> Fingerprint {
        let off = pba * FINGERPRINT_SIZE as u64;
        let mut i = self.inner.borrow_mut();
        i.load(off / PAYLOAD_SIZE as u64);
        Fingerprint(i.array.get_array(off))
    }

    /// The first 8 bytes of `pba`'s fingerprint, big-endian (its index key).
    pub fn key(&self, pba: u64) -> u64 {
        let off = pba * FINGERPRINT_SIZE as u64;
        let mut i = self.inner.borrow_mut();
        i.load(off / PAYLOAD_SIZE as u64);
        u64::from_be_bytes(i.array.get_array(off))
    }

    /// Records `fp` for `pba`.
    pub fn set(&mut self, pba: u64, fp: &Fingerprint) {
        self.write(pba * FINGERPRINT_SIZE as u64, &fp.0);
    }

    /// Writes `data` at logical byte offset `off` (whole fingerprints).
    pub fn write(&mut self, off: u64, data: &[u8]) {
        let i = self.inner.get_mut();
        let end = off + data.len() as u64;
        let mut pos = off;
        // page by page: a fingerprint never spans two pages, so this is
        // one step, with no allocation on the write path
        while pos < end {
            let p = pos / PAYLOAD_SIZE as u64;
            let upto = ((p + 1) * PAYLOAD_SIZE as u64).min(end);
            i.load(p);
            let was_hole = i.array.page_is_hole(p);
            i.array
                .write(pos, &data[(pos - off) as usize..(upto - off) as usize]);
            if was_hole && !i.array.page_is_hole(p) {
                i.resident_pages += 1;
                i.fifo.push_back(p);
            }
            pos = upto;
        }
        i.enforce_budget(None);
    }

    /// Takes the images of the pages changed since the last call (see
    /// [`PagedArray::take_dirty`]); they stay pinned in memory until the
    /// checkpoint that covers commit generation `generation`.
    pub fn take_dirty(&mut self, generation: u64) -> Vec<(u64, Box<[u8; PAGE_SIZE]>)> {
        let i = self.inner.get_mut();
        let out = i.array.take_dirty();
        for (p, _) in &out {
            i.pinned.insert(*p, generation);
        }
        out
    }

    /// Releases the pages pinned by commits up to `generation`, now in
    /// place in the file, and evicts down to the budget.
    pub fn unpin_through(&mut self, generation: u64) {
        let i = self.inner.get_mut();
        i.pinned.retain(|_, g| *g > generation);
        i.enforce_budget(None);
    }

    /// Marks `page` dirty again (after a failed commit, or to rewrite it).
    pub fn redirty(&mut self, page: u64) {
        let i = self.inner.get_mut();
        i.load(page);
        i.array.redirty(page);
    }

    /// Number of dirty pages.
    pub fn dirty_count(&self) -> usize {
        self.inner.borrow().array.dirty_count()
    }

    /// Logical bytes the array spans.
    pub fn logical_len(&self) -> u64 {
        self.inner.borrow().array.logical_len()
    }

    /// Bytes of memory held (resident pages and tables).
    pub fn resident_bytes(&self) -> u64 {
        let i = self.inner.borrow();
        i.array.resident_bytes()
            + i.evicted.capacity() as u64
            + i.fifo.capacity() as u64 * 8
            + i.pinned.capacity() as u64 * 24
    }

    /// Figures of the page cache.
    pub fn stats(&self) -> ReverseIndexStats {
        let i = self.inner.borrow();
        ReverseIndexStats {
            resident_bytes: i.resident_pages * PAYLOAD_SIZE as u64,
            pinned_pages: i.pinned.len() as u64,
            ..i.stats
        }
    }
}

impl Inner {
    /// Brings `page` back into memory if it was evicted.
    fn load(&mut self, page: u64) {
        if !self.evicted.get(page as usize).copied().unwrap_or(false) {
            return;
        }
        self.evicted[page as usize] = false;
        let mut buf = [0u8; PAGE_SIZE];
        let read = match &self.source {
            Some(f) => read_page(f, page, &mut buf),
            None => Ok(()),
        };
        self.stats.pages_loaded += 1;
        let payload = match read.map(|()| decode_page(&buf, self.array.tag(), page)) {
            Ok(Ok(p)) => p,
            _ => {
                self.stats.load_errors += 1;
                None
            }
        };
        if let Some(p) = payload {
            self.array.put_page(page, p);
            self.resident_pages += 1;
            self.fifo.push_back(page);
            // never the page being read
            self.enforce_budget(Some(page));
        }
    }

    /// Evicts clean, unpinned pages other than `keep`, oldest first, while
    /// over the budget.
    fn enforce_budget(&mut self, keep: Option<u64>) {
        if self.source.is_none() || self.budget_pages == 0 {
            return;
        }
        let mut tries = self.fifo.len();
        while self.resident_pages > self.budget_pages && tries > 0 {
            tries -= 1;
            let Some(p) = self.fifo.pop_front() else {
                break;
            };
            if self.array.page_is_hole(p) {
                continue; // evicted or emptied since it was queued
            }
            if self.array.is_dirty(p) || self.pinned.contains_key(&p) || keep == Some(p) {
                self.fifo.push_back(p);
                continue;
            }
            self.array.drop_page(p);
            if self.evicted.len() <= p as usize {
                self.evicted.resize(p as usize + 1, false);
            }
            self.evicted[p as usize] = true;
            self.resident_pages -= 1;
            self.stats.pages_evicted += 1;
        }
    }
}

/// Reads page `page` of `f` into `buf`; past the end of the file: zeros.
fn read_page(f: &File, page: u64, buf: &mut [u8; PAGE_SIZE]) -> std::io::Result<()> {
    let off = page * PAGE_SIZE as u64;
    let mut done = 0;
    while done < PAGE_SIZE {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
