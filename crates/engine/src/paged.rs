//! Dense per-block metadata arrays kept in memory as pages, with the set of
//! pages changed since the last journal commit, and their checksummed
//! on-disk page format.
//!
//! Used for the LBA→PBA map of each volume, the reference counts and the
//! PBA→fingerprint reverse index. Pages that are all zero are not allocated,
//! so a sparsely written volume costs memory in proportion to what is mapped.
//!
//! On disk each 4 KiB page holds [`PAYLOAD_SIZE`] (4064) bytes of entries
//! (508 `u64`, 1016 `u32` or 127 fingerprints) and a 32-byte trailer:
//! CRC32C of the payload, page number and file tag; a magic; the file tag;
//! the page number. An all-zero page is a hole and reads as zeros. A page
//! whose trailer does not verify is *damaged*: it is reported, never
//! silently used.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Size in bytes of one on-disk metadata page (the unit of journaling).
pub const PAGE_SIZE: usize = 4096;
/// Bytes of entries per page.
pub const PAYLOAD_SIZE: usize = 4064;
/// `u64` entries (volume-map LBAs) in a page's payload: 508.
pub const U64_PER_PAGE: u64 = (PAYLOAD_SIZE / 8) as u64;
const PAGE_MAGIC: u32 = u32::from_le_bytes(*b"DDPG");

type Page = Box<[u8; PAYLOAD_SIZE]>;

/// Bytes on disk of an array whose logical content is `logical_bytes` long
/// (whole pages).
pub fn disk_len(logical_bytes: u64) -> u64 {
    logical_bytes.div_ceil(PAYLOAD_SIZE as u64) * PAGE_SIZE as u64
}

/// Encodes a page for disk: payload plus trailer.
pub(crate) fn encode_page(
    payload: &[u8; PAYLOAD_SIZE],
    tag: u32,
    page_no: u64,
) -> Box<[u8; PAGE_SIZE]> {
    let mut out = Box::new([0u8; PAGE_SIZE]);
    out[..PAYLOAD_SIZE].copy_from_slice(payload);
    let mut crc = crc32c::crc32c(payload);
    crc = crc32c::crc32c_append(crc, &tag.to_le_bytes());
    crc = crc32c::crc32c_append(crc, &page_no.to_le_bytes());
    let t = &mut out[PAYLOAD_SIZE..];
    t[0..4].copy_from_slice(&crc.to_le_bytes());
    t[4..8].copy_from_slice(&PAGE_MAGIC.to_le_bytes());
    t[8..12].copy_from_slice(&tag.to_le_bytes());
    t[16..24].copy_from_slice(&page_no.to_le_bytes());
    out
}

/// Decodes an on-disk page: `Ok(None)` for a hole, `Ok(Some(payload))`,
/// or `Err(())` if the trailer does not verify.
#[allow(clippy::result_unit_err)]
pub fn decode_page(bytes: &[u8], tag: u32, page_no: u64) -> Result<Option<Page>, ()> {
    if bytes.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    if bytes.len() != PAGE_SIZE {
        return Err(());
    }
    let mut payload: Page = Box::new([0u8; PAYLOAD_SIZE]);
    payload.copy_from_slice(&bytes[..PAYLOAD_SIZE]);
    let expect = encode_page(&payload, tag, page_no);
    if expect[PAYLOAD_SIZE..] == bytes[PAYLOAD_SIZE..] {
        Ok(Some(payload))
    } else {
        Err(())
    }
}

/// Applies a patch to an encoded page image: payload bytes `data` at
/// payload offset `in_page` of page `page_no` in a file tagged `tag`, the
/// trailer recomputed. A hole (all-zero image) is patched as a zero page.
///
/// Errors: the image fails its checksum, or the patch passes the payload's
/// end (nothing is changed).
pub(crate) fn patch_page(
    img: &mut [u8; PAGE_SIZE],
    tag: u32,
    page_no: u64,
    in_page: usize,
    data: &[u8],
) -> Result<(), ()> {
    if in_page + data.len() > PAYLOAD_SIZE {
        return Err(());
    }
    let mut payload =
        decode_page(&img[..], tag, page_no)?.unwrap_or_else(|| Box::new([0u8; PAYLOAD_SIZE]));
    payload[in_page..in_page + data.len()].copy_from_slice(data);
    *img = *encode_page(&payload, tag, page_no);
    Ok(())
}

/// Applies a journal patch ([`crate::journal::Op::Patch`]: payload bytes
/// `data` at logical byte `offset` of the array) to `img`, the image of
/// the page it falls in (see [`patch_page`]); that page is
/// `offset / PAYLOAD_SIZE`. A damaged image is left as it is (its check
/// reports it).
pub(crate) fn apply_patch(img: &mut [u8; PAGE_SIZE], tag: u32, offset: u64, data: &[u8]) {
    let payload = PAYLOAD_SIZE as u64;
    let _ = patch_page(
        img,
        tag,
        offset / payload,
        (offset % payload) as usize,
        data,
    );
}

/// Recomputes the trailer of a page image (`img`, [`PAGE_SIZE`] bytes)
/// after its payload was changed in place.
pub(crate) fn reencode_page(img: &mut [u8], tag: u32, page_no: u64) {
    let mut payload = [0u8; PAYLOAD_SIZE];
    payload.copy_from_slice(&img[..PAYLOAD_SIZE]);
    img.copy_from_slice(&encode_page(&payload, tag, page_no)[..]);
}

/// A page changed since the last [`PagedArray::take_dirty`].
#[derive(Debug)]
pub struct DirtyPage {
    /// Page number.
    pub page: u64,
    /// Its on-disk image (payload and trailer; all zeros for an emptied
    /// page, a hole on disk too).
    pub image: Box<[u8; PAGE_SIZE]>,
    /// The payload bytes changed (a superset: from the first to the last
    /// byte written).
    pub changed: std::ops::Range<usize>,
}

/// Pages per chunk of the page table.
pub(crate) const CHUNK_PAGES: usize = 256;

/// One chunk of the page table: up to [`CHUNK_PAGES`] pages and their
/// dirty bits. Allocated while any of its pages is in memory or dirty, so
/// an array mostly paged out costs 8 bytes per 256 pages.
#[derive(Debug)]
struct Chunk {
    pages: [Option<Page>; CHUNK_PAGES],
    dirty: [u64; CHUNK_PAGES / 64],
    /// Payload bytes changed in each dirty page: first and one past the
    /// last.
    changed: [(u16, u16); CHUNK_PAGES],
    /// Pages in memory in this chunk.
    allocated: u16,
}

impl Chunk {
    fn new() -> Box<Chunk> {
        Box::new(Chunk {
            pages: std::array::from_fn(|_| None),
            dirty: [0; CHUNK_PAGES / 64],
            changed: [(0, 0); CHUNK_PAGES],
            allocated: 0,
        })
    }
    fn is_dirty(&self, i: usize) -> bool {
        self.dirty[i / 64] & (1 << (i % 64)) != 0
    }
    fn unused(&self) -> bool {
        self.allocated == 0 && self.dirty.iter().all(|&w| w == 0)
    }
}

/// A growable array of bytes split into pages, tracking dirty pages.
///
/// The page table has two levels (chunks of 256 pages, allocated on
/// demand), so its memory follows the pages in memory, not the array's
/// length: 8 bytes per 256 pages spanned plus about 3 KiB per chunk in use.
#[derive(Debug, Default)]
pub struct PagedArray {
    tag: u32,
    chunks: Vec<Option<Box<Chunk>>>,
    len_pages: u64,
    allocated_pages: u64,
    /// Chunks allocated in `chunks`.
    chunks_in_use: u64,
    dirty: Vec<u64>,
    /// A count of dirty pages shared by several arrays (the volume maps),
    /// kept up to date here so that it is read without visiting them.
    dirty_total: Option<Arc<AtomicU64>>,
}

impl Drop for PagedArray {
    fn drop(&mut self) {
        self.count_cleaned(self.dirty.len());
    }
}

impl PagedArray {
    /// An empty array whose on-disk pages carry `tag` (identifies the file,
    /// so a page written to the wrong file or place is detected).
    pub fn new(tag: u32) -> Self {
        let mut a = PagedArray::default();
        a.tag = tag;
        a
    }

    /// Builds an array from its on-disk bytes (whole pages; a short tail is
    /// zero-padded). Nothing is dirty. Returns the array and the numbers of
    /// damaged pages, which read as zeros.
    pub fn from_disk(bytes: &[u8], tag: u32) -> (Self, Vec<u64>) {
        let mut a = PagedArray::new(tag);
        let mut damaged = Vec::new();
        for (i, chunk) in bytes.chunks(PAGE_SIZE).enumerate() {
            a.ensure_pages(i as u64 + 1);
            let mut full = [0u8; PAGE_SIZE];
            full[..chunk.len()].copy_from_slice(chunk);
            match decode_page(&full, tag, i as u64) {
                Ok(Some(p)) => a.put_page(i as u64, p),
                Ok(None) => {}
                Err(()) => damaged.push(i as u64),
            }
        }
        (a, damaged)
    }

    /// Number of pages (allocated or not) the array spans.
    pub fn page_count(&self) -> u64 {
        self.len_pages
    }

    /// Logical bytes the array spans (page count × payload).
    pub fn logical_len(&self) -> u64 {
        self.page_count() * PAYLOAD_SIZE as u64
    }

    /// Pages in memory.
    pub fn allocated_pages(&self) -> u64 {
        self.allocated_pages
    }

    /// Pages in memory plus page-table chunks in use, each chunk counted
    /// as one page (a chunk, about 3 KiB, costs less than a page's 4 KiB):
    /// what a cache budget in pages is charged, so that pages scattered
    /// one per chunk cannot take nearly twice their budget.
    pub fn resident_units(&self) -> u64 {
        self.allocated_pages + self.chunks_in_use
    }

    /// Bytes of the page table's first level and the dirty list (what
    /// [`PagedArray::resident_bytes`] counts beside pages and chunks).
    pub fn page_table_bytes(&self) -> u64 {
        self.chunks.capacity() as u64 * 8 + self.dirty.capacity() as u64 * 8
    }

    /// Bytes of memory held by allocated pages and the page table.
    pub fn resident_bytes(&self) -> u64 {
        self.allocated_pages * PAYLOAD_SIZE as u64
            + self.chunks_in_use * std::mem::size_of::<Chunk>() as u64
            + self.chunks.capacity() as u64 * 8
            + self.dirty.capacity() as u64 * 8
    }

    /// Makes the array span at least `n` pages (the new ones holes).
    pub(crate) fn set_len_pages(&mut self, n: u64) {
        self.ensure_pages(n);
    }

    fn ensure_pages(&mut self, n: u64) {
        if self.len_pages < n {
            self.len_pages = n;
            let chunks = (n as usize).div_ceil(CHUNK_PAGES);
            if self.chunks.len() < chunks {
                self.chunks.resize_with(chunks, || None);
            }
        }
    }

    #[inline]
    fn page(&self, page: u64) -> Option<&Page> {
        let page = page as usize;
        match self.chunks.get(page / CHUNK_PAGES) {
            Some(Some(c)) => c.pages[page % CHUNK_PAGES].as_ref(),
            _ => None,
        }
    }

    #[inline]
    fn page_mut(&mut self, page: u64) -> Option<&mut Page> {
        let page = page as usize;
        match self.chunks.get_mut(page / CHUNK_PAGES) {
            Some(Some(c)) => c.pages[page % CHUNK_PAGES].as_mut(),
            _ => None,
        }
    }

    /// The chunk holding `page` (within the array), allocated if absent.
    fn chunk_mut(&mut self, page: u64) -> &mut Chunk {
        let slot = &mut self.chunks[page as usize / CHUNK_PAGES];
        if slot.is_none() {
            self.chunks_in_use += 1;
        }
        slot.get_or_insert_with(Chunk::new)
    }

    /// Frees the chunk of `page` if it holds nothing.
    fn release_chunk(&mut self, page: u64) {
        let slot = &mut self.chunks[page as usize / CHUNK_PAGES];
        if slot.as_ref().is_some_and(|c| c.unused()) {
            *slot = None;
            self.chunks_in_use -= 1;
        }
    }

    /// Copies `out.len()` bytes at logical byte offset `off`; bytes past the
    /// end read as zero.
    pub fn read(&self, off: u64, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let pos = off + done as u64;
            let page = pos / PAYLOAD_SIZE as u64;
            let in_page = (pos % PAYLOAD_SIZE as u64) as usize;
            let n = (PAYLOAD_SIZE - in_page).min(out.len() - done);
            match self.page(page) {
                Some(p) => out[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    /// Writes `data` at logical byte offset `off`, growing the array as
    /// needed and marking the touched pages dirty.
    pub fn write(&mut self, off: u64, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let pos = off + done as u64;
            let page = pos / PAYLOAD_SIZE as u64;
            let in_page = (pos % PAYLOAD_SIZE as u64) as usize;
            let n = (PAYLOAD_SIZE - in_page).min(data.len() - done);
            self.ensure_pages(page + 1);
            if self.page(page).is_none() {
                if data[done..done + n].iter().all(|&b| b == 0) {
                    done += n;
                    continue;
                }
                self.put_page(page, Box::new([0u8; PAYLOAD_SIZE]));
            }
            if let Some(p) = self.page_mut(page) {
                p[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            }
            self.mark_dirty_range(page, in_page, in_page + n);
            done += n;
        }
    }

    fn mark_dirty(&mut self, page: u64) {
        self.mark_dirty_range(page, 0, PAYLOAD_SIZE);
    }

    /// Marks payload bytes `lo..hi` of `page` changed.
    fn mark_dirty_range(&mut self, page: u64, lo: usize, hi: usize) {
        let i = page as usize % CHUNK_PAGES;
        let c = self.chunk_mut(page);
        let (lo, hi) = (lo as u16, hi as u16);
        if !c.is_dirty(i) {
            c.dirty[i / 64] |= 1 << (i % 64);
            c.changed[i] = (lo, hi);
            self.dirty.push(page);
            if let Some(t) = &self.dirty_total {
                t.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            let (a, b) = c.changed[i];
            c.changed[i] = (a.min(lo), b.max(hi));
        }
    }

    /// Reads `N` bytes at logical byte offset `off` (zeros past the end or
    /// in holes). A fixed-size copy when they lie in one page, as every
    /// element of a size dividing [`PAYLOAD_SIZE`] does: no `memcpy` call.
    #[inline]
    pub fn get_array<const N: usize>(&self, off: u64) -> [u8; N] {
        let page = off / PAYLOAD_SIZE as u64;
        let in_page = (off % PAYLOAD_SIZE as u64) as usize;
        if in_page + N > PAYLOAD_SIZE {
            let mut b = [0u8; N];
            self.read(off, &mut b);
            return b;
        }
        match self.page(page) {
            Some(p) => p[in_page..in_page + N].try_into().expect("N bytes"),
            None => [0u8; N],
        }
    }

    /// Writes `N` bytes at logical byte offset `off`, as [`PagedArray::write`]
    /// does, with a fixed-size copy when they lie in one allocated page.
    #[inline]
    pub fn set_array<const N: usize>(&mut self, off: u64, data: [u8; N]) {
        let page = off / PAYLOAD_SIZE as u64;
        let in_page = (off % PAYLOAD_SIZE as u64) as usize;
        if in_page + N <= PAYLOAD_SIZE {
            if let Some(p) = self.page_mut(page) {
                p[in_page..in_page + N].copy_from_slice(&data);
                self.mark_dirty_range(page, in_page, in_page + N);
                return;
            }
        }
        self.write(off, &data);
    }

    /// Hints that the bytes at logical offset `off` will be read soon
    /// (nothing if their page is not in memory).
    #[inline]
    pub fn prefetch(&self, off: u64) {
        let page = off / PAYLOAD_SIZE as u64;
        let in_page = (off % PAYLOAD_SIZE as u64) as usize;
        if let Some(p) = self.page(page) {
            crate::prefetch::prefetch_read(&p[in_page]);
        }
    }

    /// Reads the little-endian `u64` at element index `i`.
    #[inline]
    pub fn get_u64(&self, i: u64) -> u64 {
        u64::from_le_bytes(self.get_array(i * 8))
    }

    /// Sets the little-endian `u64` at element index `i`.
    #[inline]
    pub fn set_u64(&mut self, i: u64, v: u64) {
        self.set_array(i * 8, v.to_le_bytes());
    }

    /// Reads the little-endian `u32` at element index `i`.
    #[inline]
    pub fn get_u32(&self, i: u64) -> u32 {
        u32::from_le_bytes(self.get_array(i * 4))
    }

    /// Sets the little-endian `u32` at element index `i`.
    #[inline]
    pub fn set_u32(&mut self, i: u64, v: u32) {
        self.set_array(i * 4, v.to_le_bytes());
    }

    /// The file tag the array's pages carry.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// Puts a page read back from disk at `page` (dirty state unchanged).
    pub fn put_page(&mut self, page: u64, payload: Box<[u8; PAYLOAD_SIZE]>) {
        self.ensure_pages(page + 1);
        let i = page as usize % CHUNK_PAGES;
        let c = self.chunk_mut(page);
        let was = c.pages[i].replace(payload);
        if was.is_none() {
            c.allocated += 1;
            self.allocated_pages += 1;
        }
    }

    /// Drops page `page` from memory (the caller keeps its image elsewhere).
    pub fn drop_page(&mut self, page: u64) {
        let i = page as usize % CHUNK_PAGES;
        let Some(Some(c)) = self.chunks.get_mut(page as usize / CHUNK_PAGES) else {
            return;
        };
        if c.pages[i].take().is_some() {
            c.allocated -= 1;
            self.allocated_pages -= 1;
            self.release_chunk(page);
        }
    }

    /// True if `page` changed since the last [`PagedArray::take_dirty`].
    pub fn is_dirty(&self, page: u64) -> bool {
        let i = page as usize % CHUNK_PAGES;
        match self.chunks.get(page as usize / CHUNK_PAGES) {
            Some(Some(c)) => c.is_dirty(i),
            _ => false,
        }
    }

    /// The non-zero `u64` entries with index in `range`, as (index, value),
    /// in order; pages not allocated are skipped whole, so a sparse array
    /// costs in proportion to what is set, not to its length.
    pub fn nonzero_u64(&self, range: std::ops::Range<u64>) -> Vec<(u64, u64)> {
        self.nonzero_le::<8>(range)
    }

    /// The non-zero little-endian entries `W` bytes wide with index in
    /// `range`, as (index, value), in order.
    pub(crate) fn nonzero_le<const W: usize>(
        &self,
        range: std::ops::Range<u64>,
    ) -> Vec<(u64, u64)> {
        let per_page = (PAYLOAD_SIZE / W) as u64;
        let mut out = Vec::new();
        if range.start >= range.end || self.page_count() == 0 {
            return out;
        }
        let first_page = range.start / per_page;
        let last_page = ((range.end - 1) / per_page).min(self.page_count() - 1);
        let mut page = first_page;
        while page <= last_page {
            if self
                .chunks
                .get(page as usize / CHUNK_PAGES)
                .is_none_or(|c| c.is_none())
            {
                // a whole chunk without pages
                page = (page / CHUNK_PAGES as u64 + 1) * CHUNK_PAGES as u64;
                continue;
            }
            if let Some(p) = self.page(page) {
                let lo = (page * per_page).max(range.start);
                let hi = ((page + 1) * per_page).min(range.end);
                for i in lo..hi {
                    let at = ((i - page * per_page) as usize) * W;
                    let mut le = [0u8; 8];
                    le[..W].copy_from_slice(&p[at..at + W]);
                    let v = u64::from_le_bytes(le);
                    if v != 0 {
                        out.push((i, v));
                    }
                }
            }
            page += 1;
        }
        out
    }

    /// The first page in memory in `from..end`, if any: whole chunks
    /// without pages are skipped at once, so a scan of a sparse array
    /// costs its allocated pages, not its length.
    pub fn next_allocated_page(&self, from: u64, end: u64) -> Option<u64> {
        let end = end.min(self.page_count());
        let mut page = from;
        while page < end {
            let c = page as usize / CHUNK_PAGES;
            match self.chunks.get(c) {
                Some(Some(chunk)) if chunk.allocated > 0 => {
                    let chunk_end = ((c + 1) * CHUNK_PAGES) as u64;
                    for p in page..chunk_end.min(end) {
                        if chunk.pages[p as usize % CHUNK_PAGES].is_some() {
                            return Some(p);
                        }
                    }
                    page = chunk_end;
                }
                _ => page = ((c + 1) * CHUNK_PAGES) as u64,
            }
        }
        None
    }

    /// True if page `page` is not in memory (holds no non-zero entry, unless
    /// a caller dropped it).
    pub fn page_is_hole(&self, page: u64) -> bool {
        self.page(page).is_none()
    }

    /// Takes every page dirtied since the last call (its on-disk image
    /// and the bytes changed) and clears the dirty set.
    pub fn take_dirty(&mut self) -> Vec<DirtyPage> {
        let mut out = Vec::with_capacity(self.dirty.len());
        let tag = self.tag;
        self.drain_dirty(|page, payload, changed| {
            let image = match payload {
                Some(p) => encode_page(p, tag, page),
                // an emptied page: a hole on disk too
                None => Box::new([0u8; PAGE_SIZE]),
            };
            out.push(DirtyPage {
                page,
                image,
                changed,
            });
        });
        out
    }

    /// Forgets every page dirtied since the last call without encoding
    /// them (for metadata that is never journaled: in-memory engines),
    /// calling `changed(page, bytes)` with the payload bytes each one
    /// changed (the whole payload for a page emptied since), as
    /// [`PagedArray::take_dirty`] would have reported them.
    pub fn clear_dirty(&mut self, mut changed: impl FnMut(u64, usize)) {
        self.drain_dirty(|page, _, range| changed(page, range.len()));
    }

    /// Clears the dirty mark of every page dirtied since the last call
    /// (pages truncated away since are skipped), calling `f(page, payload,
    /// changed)` for each: its payload (`None` for a page emptied since,
    /// whose changed range is then the whole payload) and the payload
    /// bytes changed.
    fn drain_dirty(&mut self, mut f: impl FnMut(u64, Option<&Page>, std::ops::Range<usize>)) {
        let pages = std::mem::take(&mut self.dirty);
        self.count_cleaned(pages.len());
        for page in pages {
            let i = page as usize % CHUNK_PAGES;
            let Some(Some(c)) = self.chunks.get_mut(page as usize / CHUNK_PAGES) else {
                continue; // truncated away
            };
            c.dirty[i / 64] &= !(1 << (i % 64));
            let (lo, hi) = c.changed[i];
            match &c.pages[i] {
                Some(p) => f(page, Some(p), lo as usize..hi as usize),
                None => f(page, None, 0..PAYLOAD_SIZE),
            }
            self.release_chunk(page);
        }
    }

    /// Marks `page` dirty again (after a failed commit, or to rewrite a
    /// damaged page).
    pub fn redirty(&mut self, page: u64) {
        if page < self.len_pages {
            self.mark_dirty(page);
        }
    }

    /// Number of dirty pages.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Counts this array's dirty pages, now and from now on, in `total`
    /// (shared with other arrays; the pages leave it as they are cleaned,
    /// truncated away or dropped with the array), instead of any count it
    /// was in before.
    pub fn count_dirty_in(&mut self, total: Arc<AtomicU64>) {
        self.count_cleaned(self.dirty.len());
        total.fetch_add(self.dirty.len() as u64, Ordering::Relaxed);
        self.dirty_total = Some(total);
    }

    fn count_cleaned(&self, pages: usize) {
        if let Some(t) = &self.dirty_total {
            t.fetch_sub(pages as u64, Ordering::Relaxed);
        }
    }

    /// Drops every page past logical length `len_bytes` and zeroes the tail
    /// of the last kept page.
    pub fn truncate(&mut self, len_bytes: u64) {
        let keep = len_bytes.div_ceil(PAYLOAD_SIZE as u64);
        if self.len_pages > keep {
            // only the chunks in memory hold pages to drop: a cut of a huge
            // thin array costs what it has in memory, not its length
            let first_chunk = keep as usize / CHUNK_PAGES;
            for c in first_chunk..self.chunks.len() {
                if self.chunks[c].is_some() {
                    let start = keep.max((c * CHUNK_PAGES) as u64);
                    let end = self.len_pages.min(((c + 1) * CHUNK_PAGES) as u64);
                    for page in start..end {
                        self.drop_page(page);
                    }
                }
            }
            self.len_pages = keep;
            let chunks = (keep as usize).div_ceil(CHUNK_PAGES);
            let cut = self.chunks[chunks.min(self.chunks.len())..]
                .iter()
                .filter(|c| c.is_some())
                .count();
            self.chunks_in_use -= cut as u64;
            self.chunks.truncate(chunks);
            // dirty bits of dropped pages in the last kept chunk
            let first = keep as usize % CHUNK_PAGES;
            if first != 0 {
                if let Some(Some(c)) = self.chunks.get_mut(keep as usize / CHUNK_PAGES) {
                    for i in first..CHUNK_PAGES {
                        c.dirty[i / 64] &= !(1 << (i % 64));
                    }
                }
            }
            let before = self.dirty.len();
            self.dirty.retain(|&p| p < keep);
            self.count_cleaned(before - self.dirty.len());
            if keep > 0 {
                self.release_chunk(keep - 1);
            }
        }
        let tail = (len_bytes % PAYLOAD_SIZE as u64) as usize;
        if tail != 0 && keep > 0 {
            let zeros = vec![0u8; PAYLOAD_SIZE - tail];
            self.write(len_bytes, &zeros);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_disk(a: &mut PagedArray) -> Vec<u8> {
        let mut bytes = vec![0u8; a.page_count() as usize * PAGE_SIZE];
        for d in a.take_dirty() {
            let p = d.page as usize;
            bytes[p * PAGE_SIZE..(p + 1) * PAGE_SIZE].copy_from_slice(&d.image[..]);
        }
        bytes
    }

    #[test]
    fn nonzero_u64_matches_a_full_scan() {
        let mut a = PagedArray::new(1);
        for i in [0u64, 1, 507, 508, 509, 5000, 5001, 100_000] {
            a.set_u64(i, i + 1);
        }
        a.set_u64(1, 0); // set then cleared: its page stays allocated
        for range in [0..10, 0..100_001, 500..5001, 508..509, 6000..7000, 9..9] {
            let full: Vec<(u64, u64)> = range
                .clone()
                .filter(|&i| a.get_u64(i) != 0)
                .map(|i| (i, a.get_u64(i)))
                .collect();
            assert_eq!(a.nonzero_u64(range.clone()), full, "{range:?}");
        }
        assert!(a.nonzero_u64(200_000..300_000).is_empty());
    }

    #[test]
    fn sparse_roundtrip_and_dirty() {
        let mut a = PagedArray::new(7);
        assert_eq!(a.get_u64(1_000_000), 0);
        a.set_u64(1_000_000, 42);
        assert_eq!(a.get_u64(1_000_000), 42);
        a.set_u64(5, 0); // writing zero into an absent page allocates nothing
        assert!(a.page_is_hole(0));
        a.set_u32(3, 7);
        assert_eq!(a.get_u32(3), 7);
        assert_eq!(a.dirty_count(), 2);
        let bytes = to_disk(&mut a);
        assert_eq!(a.dirty_count(), 0);
        let (b, damaged) = PagedArray::from_disk(&bytes, 7);
        assert!(damaged.is_empty());
        assert_eq!(b.get_u64(1_000_000), 42);
        assert_eq!(b.get_u32(3), 7);
        assert_eq!(disk_len(PAYLOAD_SIZE as u64 + 1), 2 * PAGE_SIZE as u64);
    }

    #[test]
    fn damage_is_detected_per_page() {
        let mut a = PagedArray::new(3);
        a.set_u64(0, 1);
        a.set_u64(600, 2); // second page
        let mut bytes = to_disk(&mut a);
        bytes[PAGE_SIZE + 17] ^= 0x04;
        let (b, damaged) = PagedArray::from_disk(&bytes, 3);
        assert_eq!(damaged, vec![1]);
        assert_eq!(b.get_u64(0), 1);
        assert_eq!(b.get_u64(600), 0);
        // the wrong file tag, or a page at the wrong place, is damage too
        let bytes = to_disk(&mut {
            let mut c = PagedArray::new(3);
            c.set_u64(0, 1);
            c
        });
        assert_eq!(PagedArray::from_disk(&bytes, 4).1, vec![0]);
        let mut moved = vec![0u8; 2 * PAGE_SIZE];
        moved[PAGE_SIZE..].copy_from_slice(&bytes[..PAGE_SIZE]);
        assert_eq!(PagedArray::from_disk(&moved, 3).1, vec![1]);
    }

    #[test]
    fn truncate_zeroes_tail() {
        let mut a = PagedArray::new(1);
        a.set_u64(10, 9);
        a.set_u64(2000, 9);
        a.truncate(10 * 8);
        assert_eq!(a.get_u64(10), 0);
        assert_eq!(a.get_u64(2000), 0);
        assert_eq!(a.page_count(), 1);
    }

    #[test]
    fn page_table_follows_pages_in_memory() {
        let mut a = PagedArray::new(1);
        let per = U64_PER_PAGE;
        // pages 0, 300 and 600: three chunks of the page table
        for p in [0u64, 300, 600] {
            a.set_u64(p * per, p + 1);
        }
        assert_eq!(a.allocated_pages(), 3);
        let imgs = a.take_dirty();
        assert_eq!(imgs.len(), 3);
        let full = a.resident_bytes();
        a.drop_page(300);
        a.drop_page(600);
        assert_eq!(a.allocated_pages(), 1);
        assert!(a.resident_bytes() + 2 * PAYLOAD_SIZE as u64 + 2000 < full);
        assert_eq!(a.get_u64(300 * per), 0);
        assert_eq!(a.nonzero_u64(0..700 * per), vec![(0, 1)]);
        // truncating across chunks keeps counts and dirty pages right
        a.set_u64(600 * per, 5);
        a.set_u64(257 * per, 6);
        a.truncate(258 * per * 8);
        assert_eq!(a.page_count(), 258);
        assert_eq!(a.allocated_pages(), 2);
        let dirty: Vec<u64> = a.take_dirty().into_iter().map(|d| d.page).collect();
        assert_eq!(dirty, vec![257]);
        assert_eq!(a.get_u64(257 * per), 6);
    }

    #[test]
    fn dirty_pages_carry_the_bytes_changed_and_patches_rebuild_them() {
        let mut a = PagedArray::new(7);
        a.set_u64(10, 1);
        a.set_u64(12, 2);
        a.set_u32(PAYLOAD_SIZE as u64 / 4 + 3, 9); // page 1
        let d = a.take_dirty();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].page, 0);
        assert_eq!(d[0].changed, 80..104);
        assert_eq!(d[1].changed, 12..16);
        // a patch of the changed bytes onto the old image gives the new one
        let mut old = Box::new([0u8; PAGE_SIZE]);
        patch_page(&mut old, 7, 0, 80, &d[0].image[80..104]).unwrap();
        assert_eq!(old[..], d[0].image[..]);
        // a damaged image or a patch past the payload is refused
        let mut bad = d[1].image.clone();
        bad[5] ^= 1;
        assert!(patch_page(&mut bad, 7, 1, 0, &[1]).is_err());
        let mut img = d[1].image.clone();
        assert!(patch_page(&mut img, 7, 1, PAYLOAD_SIZE - 1, &[1, 2]).is_err());
        assert_eq!(img, d[1].image);
        a.redirty(0);
        assert_eq!(a.take_dirty()[0].changed, 0..PAYLOAD_SIZE);
    }
}
