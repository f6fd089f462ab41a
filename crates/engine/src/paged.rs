//! Dense per-block metadata arrays kept in memory as 4 KiB pages, with the
//! set of pages changed since the last journal commit.
//!
//! Used for the LBA→PBA map of each volume, the reference counts and the
//! PBA→fingerprint reverse index. Pages that are all zero are not allocated,
//! so a sparsely written volume costs memory in proportion to what is mapped
//! (one 4 KiB page per 512 mapped LBAs at most).

/// Size in bytes of one metadata page (the unit of journaling).
pub const PAGE_SIZE: usize = 4096;

/// A growable byte array split into 4 KiB pages, tracking dirty pages.
#[derive(Debug, Default)]
pub struct PagedArray {
    pages: Vec<Option<Box<[u8; PAGE_SIZE]>>>,
    dirty: Vec<u64>,
    dirty_flag: Vec<bool>,
}

impl PagedArray {
    /// Builds an array from its persisted bytes (any length; the tail page
    /// is zero-padded). Nothing is dirty.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut a = PagedArray::default();
        for (i, chunk) in bytes.chunks(PAGE_SIZE).enumerate() {
            a.ensure_pages(i as u64 + 1);
            if chunk.iter().any(|&b| b != 0) {
                let mut p = Box::new([0u8; PAGE_SIZE]);
                p[..chunk.len()].copy_from_slice(chunk);
                a.pages[i] = Some(p);
            }
        }
        a
    }

    /// Number of pages (allocated or not) the array spans.
    pub fn page_count(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Bytes of memory held by allocated pages.
    pub fn resident_bytes(&self) -> u64 {
        self.pages.iter().filter(|p| p.is_some()).count() as u64 * PAGE_SIZE as u64
            + self.pages.capacity() as u64
                * std::mem::size_of::<Option<Box<[u8; PAGE_SIZE]>>>() as u64
    }

    fn ensure_pages(&mut self, n: u64) {
        let n = n as usize;
        if self.pages.len() < n {
            self.pages.resize_with(n, || None);
            self.dirty_flag.resize(n, false);
        }
    }

    /// Copies `out.len()` bytes at byte offset `off`; bytes past the end
    /// read as zero.
    pub fn read(&self, off: u64, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let pos = off + done as u64;
            let page = (pos / PAGE_SIZE as u64) as usize;
            let in_page = (pos % PAGE_SIZE as u64) as usize;
            let n = (PAGE_SIZE - in_page).min(out.len() - done);
            match self.pages.get(page).and_then(|p| p.as_ref()) {
                Some(p) => out[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    /// Writes `data` at byte offset `off`, growing the array as needed and
    /// marking the touched pages dirty.
    pub fn write(&mut self, off: u64, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let pos = off + done as u64;
            let page = pos / PAGE_SIZE as u64;
            let in_page = (pos % PAGE_SIZE as u64) as usize;
            let n = (PAGE_SIZE - in_page).min(data.len() - done);
            self.ensure_pages(page + 1);
            let slot = &mut self.pages[page as usize];
            if slot.is_none() {
                if data[done..done + n].iter().all(|&b| b == 0) {
                    done += n;
                    continue;
                }
                *slot = Some(Box::new([0u8; PAGE_SIZE]));
            }
            if let Some(p) = slot.as_mut() {
                p[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            }
            self.mark_dirty(page);
            done += n;
        }
    }

    fn mark_dirty(&mut self, page: u64) {
        if !self.dirty_flag[page as usize] {
            self.dirty_flag[page as usize] = true;
            self.dirty.push(page);
        }
    }

    /// Reads the little-endian `u64` at element index `i`.
    pub fn get_u64(&self, i: u64) -> u64 {
        let mut b = [0u8; 8];
        self.read(i * 8, &mut b);
        u64::from_le_bytes(b)
    }

    /// Sets the little-endian `u64` at element index `i`.
    pub fn set_u64(&mut self, i: u64, v: u64) {
        self.write(i * 8, &v.to_le_bytes());
    }

    /// Reads the little-endian `u32` at element index `i`.
    pub fn get_u32(&self, i: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(i * 4, &mut b);
        u32::from_le_bytes(b)
    }

    /// Sets the little-endian `u32` at element index `i`.
    pub fn set_u32(&mut self, i: u64, v: u32) {
        self.write(i * 4, &v.to_le_bytes());
    }

    /// Takes the images of every page dirtied since the last call, as
    /// (page number, copy of the page), and clears the dirty set.
    pub fn take_dirty(&mut self) -> Vec<(u64, Box<[u8; PAGE_SIZE]>)> {
        let mut out = Vec::with_capacity(self.dirty.len());
        for page in std::mem::take(&mut self.dirty) {
            self.dirty_flag[page as usize] = false;
            let img = match &self.pages[page as usize] {
                Some(p) => p.clone(),
                None => Box::new([0u8; PAGE_SIZE]),
            };
            out.push((page, img));
        }
        out
    }

    /// Marks `page` dirty again (after a failed commit).
    pub fn redirty(&mut self, page: u64) {
        if (page as usize) < self.pages.len() {
            self.mark_dirty(page);
        }
    }

    /// Number of dirty pages.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    /// Drops every page at or past byte length `len_bytes` (rounded up to a
    /// page) and zeroes the tail of the last kept page.
    pub fn truncate(&mut self, len_bytes: u64) {
        let keep = len_bytes.div_ceil(PAGE_SIZE as u64) as usize;
        if self.pages.len() > keep {
            self.pages.truncate(keep);
            self.dirty_flag.truncate(keep);
            self.dirty.retain(|&p| (p as usize) < keep);
        }
        let tail = (len_bytes % PAGE_SIZE as u64) as usize;
        if tail != 0 && keep > 0 {
            let zeros = vec![0u8; PAGE_SIZE - tail];
            self.write(len_bytes, &zeros);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_roundtrip_and_dirty() {
        let mut a = PagedArray::default();
        assert_eq!(a.get_u64(1_000_000), 0);
        a.set_u64(1_000_000, 42);
        assert_eq!(a.get_u64(1_000_000), 42);
        a.set_u64(5, 0); // writing zero into an absent page allocates nothing
        assert!(a.resident_bytes() < 2 * PAGE_SIZE as u64 + a.page_count() * 8);
        let d = a.take_dirty();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].0, 8_000_000 / PAGE_SIZE as u64);
        assert_eq!(a.dirty_count(), 0);
        a.set_u32(3, 7);
        assert_eq!(a.get_u32(3), 7);
        let mut bytes = vec![0u8; (a.page_count() as usize) * PAGE_SIZE];
        a.read(0, &mut bytes);
        let b = PagedArray::from_bytes(&bytes);
        assert_eq!(b.get_u64(1_000_000), 42);
        assert_eq!(b.get_u32(3), 7);
    }

    #[test]
    fn truncate_zeroes_tail() {
        let mut a = PagedArray::default();
        a.set_u64(10, 9);
        a.set_u64(2000, 9);
        a.truncate(10 * 8);
        assert_eq!(a.get_u64(10), 0);
        assert_eq!(a.get_u64(2000), 0);
        assert_eq!(a.page_count(), 1);
    }
}
