//! Opening a paged metadata file (reference counts, reverse index, a
//! volume map) without reading it into memory.
//!
//! Each page of the file is read once and checked (its checksum, as in
//! [`crate::paged::decode_page`]) and then dropped: afterwards the array
//! reads it again on first use, through its page cache. The journal's
//! newer page images, not in place until the next checkpoint, are applied
//! over the file and stay in memory, pinned. Memory at open is thus the
//! journal being replayed plus a bit per page, whatever the store's size.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::sync::Arc;

use crate::fileio::{data_pages, read_padded};
use crate::journal::{MetaFile, Op};
use crate::pagecache::{CacheGroup, CachedArray};
use crate::paged::{decode_page, PagedArray, PAGE_SIZE};

const PS: u64 = PAGE_SIZE as u64;
/// Pages read per system call while checking.
const SCAN_PAGES: u64 = 64;

/// A metadata file opened for paging.
#[derive(Debug)]
pub struct OpenedArray {
    /// The array: journal pages in memory (pinned), the file's pages read
    /// on demand.
    pub array: CachedArray,
    /// Pages that fail their checksum; they read as zeros.
    pub damaged: Vec<u64>,
}

/// The file's content as the journal leaves it: the file's bytes below
/// `base_len`, overlaid by whole pages the journal changed.
#[derive(Debug, Default)]
struct Overlay {
    len_bytes: u64,
    base_len: u64,
    pages: BTreeMap<u64, Box<[u8; PAGE_SIZE]>>,
}

impl Overlay {
    /// Puts page `page` in the overlay if it is not there, as the file
    /// holds it (zeros past `base_len`).
    fn seed(&mut self, file: Option<&File>, page: u64) -> io::Result<&mut [u8; PAGE_SIZE]> {
        if !self.pages.contains_key(&page) {
            let mut buf = Box::new([0u8; PAGE_SIZE]);
            let start = page * PS;
            if let Some(f) = file.filter(|_| start < self.base_len) {
                let want = (self.base_len - start).min(PS) as usize;
                read_padded(f, &mut buf[..want], start)?;
            }
            self.pages.insert(page, buf);
        }
        Ok(self.pages.get_mut(&page).expect("inserted above"))
    }

    fn write(&mut self, file: Option<&File>, offset: u64, data: &[u8]) -> io::Result<()> {
        let end = offset + data.len() as u64;
        let mut pos = offset;
        while pos < end {
            let in_page = (pos % PS) as usize;
            let n = (PS - in_page as u64).min(end - pos) as usize;
            let src = &data[(pos - offset) as usize..(pos - offset) as usize + n];
            if n == PS as usize {
                // a whole page: nothing of the file's copy is kept (nor
                // read: an unreadable copy must not stop the replay)
                self.pages
                    .insert(pos / PS, Box::new(src.try_into().expect("a whole page")));
            } else {
                self.seed(file, pos / PS)?[in_page..in_page + n].copy_from_slice(src);
            }
            pos += n as u64;
        }
        self.len_bytes = self.len_bytes.max(end);
        Ok(())
    }

    fn set_len(&mut self, file: Option<&File>, len: u64) -> io::Result<()> {
        let tail = (len % PS) as usize;
        if tail != 0 && len < self.len_bytes {
            self.seed(file, len / PS)?[tail..].fill(0);
        }
        self.pages.retain(|&p, _| p < len.div_ceil(PS));
        self.base_len = self.base_len.min(len);
        self.len_bytes = len;
        Ok(())
    }

    /// Applies the journal's operations on `which`, in order.
    fn build(file: Option<&File>, which: MetaFile, ops: &[&Op]) -> io::Result<Overlay> {
        let file_len = match file {
            Some(f) => f.metadata()?.len(),
            None => 0,
        };
        let mut o = Overlay {
            len_bytes: file_len,
            base_len: file_len,
            pages: BTreeMap::new(),
        };
        for op in ops.iter().filter(|op| op.file() == which) {
            match op {
                Op::Write { offset, data, .. } => o.write(file, *offset, data)?,
                Op::SetLen { len_bytes, .. } => o.set_len(file, *len_bytes)?,
                Op::Replace { data, .. } => {
                    o = Overlay::default();
                    o.write(None, 0, data)?;
                }
                Op::Remove { .. } => o = Overlay::default(),
                Op::Patch { offset, data, .. } => {
                    let page = offset / crate::paged::PAYLOAD_SIZE as u64;
                    crate::paged::apply_patch(o.seed(file, page)?, which.page_tag(), *offset, data);
                    o.len_bytes = o.len_bytes.max((page + 1) * PS);
                }
            }
        }
        Ok(o)
    }
}

/// Opens metadata file `which` (`file`; `None` if it could not be created)
/// with the journal operations `ops` (those on other files are skipped)
/// replayed over it, paging under
/// `group`; `name` names it in messages. Pages the journal changed are
/// pinned until the first checkpoint (`unpin_through(0)`), as they are not
/// in place. `visit(page, payload)` sees every page that holds data and
/// passes its check, once, in no particular order (so a caller can derive
/// state from the file without reading it again).
///
/// A file (with the journal's changes) longer than `max_len` bytes, where
/// given (a volume map: what its volume's size needs), is read as cut
/// there: what lies past it cannot be in use.
///
/// Errors: reading the file; `InvalidData` if it is longer than
/// 2^50 bytes (1 PiB, the bound on every metadata file).
pub fn open_paged(
    file: Option<File>,
    which: MetaFile,
    ops: &[&Op],
    name: &str,
    group: &Arc<CacheGroup>,
    max_len: Option<u64>,
    visit: &mut dyn FnMut(u64, &[u8]),
) -> io::Result<OpenedArray> {
    let tag = which.page_tag();
    let mut overlay = Overlay::build(file.as_ref(), which, ops)?;
    if let Some(max) = max_len.filter(|&m| overlay.len_bytes > m) {
        overlay.pages.retain(|&p, _| p < max.div_ceil(PS));
        overlay.base_len = overlay.base_len.min(max);
        overlay.len_bytes = max;
    }
    // (the page table follows the length: a damaged length far past what
    // any store can write would take that much memory, or abort the open)
    const MAX_META_FILE_BYTES: u64 = crate::journal::MAX_FILE_BYTES;
    if overlay.len_bytes > MAX_META_FILE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{name} is {} bytes long, more than any dedupd metadata file can be \
                 ({MAX_META_FILE_BYTES}): its length is damaged, and the store is not \
                 opened (cut the file to the end of its data, then run \
                 `dedupd fsck --repair`)",
                overlay.len_bytes
            ),
        ));
    }
    let mut damaged = Vec::new();
    let mut on_file = Vec::new();
    if let Some(f) = &file {
        let end = overlay.base_len.min(overlay.len_bytes);
        let mut buf = vec![0u8; (SCAN_PAGES * PS) as usize];
        for (first, last) in data_pages(f, end)? {
            let mut page = first;
            while page < last {
                let n = (last - page).min(SCAN_PAGES);
                let bytes = &mut buf[..(n * PS) as usize];
                // pages that cannot be read (EIO) are damage, as pages that
                // fail their checksum are: handled by what the file is
                // (a volume read-only, the store stopped naming fsck)
                let mut unreadable = Vec::new();
                if read_padded(f, bytes, page * PS).is_err() {
                    // page by page, leaving out those the journal replaces
                    // whole (their copies here are never needed)
                    for (k, img) in bytes.chunks_exact_mut(PAGE_SIZE).enumerate() {
                        let p = page + k as u64;
                        if !overlay.pages.contains_key(&p) && read_padded(f, img, p * PS).is_err() {
                            unreadable.push(p);
                        }
                    }
                }
                for (k, img) in bytes.chunks_exact(PAGE_SIZE).enumerate() {
                    let p = page + k as u64;
                    if overlay.pages.contains_key(&p) {
                        continue;
                    }
                    if unreadable.contains(&p) {
                        damaged.push(p);
                        continue;
                    }
                    match decode_page(img, tag, p) {
                        Ok(Some(payload)) => {
                            visit(p, &payload[..]);
                            on_file.push(p);
                        }
                        Ok(None) => {}
                        Err(()) => damaged.push(p),
                    }
                }
                page += n;
            }
        }
    }
    let mut array = PagedArray::new(tag);
    array.set_len_pages(overlay.len_bytes.div_ceil(PS));
    let mut pinned = Vec::new();
    for (&p, img) in &overlay.pages {
        match decode_page(&img[..], tag, p) {
            Ok(Some(payload)) => {
                visit(p, &payload[..]);
                array.put_page(p, payload);
                pinned.push(p);
            }
            Ok(None) => {}
            Err(()) => damaged.push(p),
        }
    }
    damaged.sort_unstable();
    let array = CachedArray::new(array);
    if let Some(f) = file {
        array.page_from(f, name, group, pinned);
        array.mark_on_file(on_file);
    }
    Ok(OpenedArray { array, damaged })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pagecache::OnLoadError;
    use crate::paged::{encode_page, PAYLOAD_SIZE};
    use std::os::unix::fs::FileExt;

    fn page_with(tag: u32, page: u64, byte: u8) -> Vec<u8> {
        let payload = Box::new([byte; PAYLOAD_SIZE]);
        encode_page(&payload, tag, page).to_vec()
    }

    #[test]
    fn file_pages_come_on_demand_and_journal_pages_win() {
        let which = MetaFile::Refcounts;
        let tag = which.page_tag();
        let f = tempfile::tempfile().unwrap();
        // pages 0 and 5 on file, page 3 damaged, the rest holes
        f.write_all_at(&page_with(tag, 0, 1), 0).unwrap();
        f.write_all_at(&page_with(tag, 5, 5), 5 * PS).unwrap();
        let mut bad = page_with(tag, 3, 3);
        bad[100] ^= 1;
        f.write_all_at(&bad, 3 * PS).unwrap();
        // the journal rewrites page 0 and adds page 7
        let ops = [
            Op::Write {
                file: which,
                offset: 0,
                data: page_with(tag, 0, 9),
            },
            Op::Write {
                file: which,
                offset: 7 * PS,
                data: page_with(tag, 7, 7),
            },
            Op::Write {
                file: MetaFile::Fingerprints,
                offset: 0,
                data: page_with(MetaFile::Fingerprints.page_tag(), 0, 4),
            },
        ];
        let group = CacheGroup::new(4 * PS, OnLoadError::Fault);
        let mut visited = Vec::new();
        let opened = open_paged(
            Some(f),
            which,
            &ops.iter().collect::<Vec<_>>(),
            "rc",
            &group,
            None,
            &mut |p, payload| visited.push((p, payload[0])),
        )
        .unwrap();
        assert_eq!(opened.damaged, vec![3]);
        // every good page once, with its final content
        visited.sort_unstable();
        assert_eq!(visited, vec![(0, 9), (5, 5), (7, 7)]);
        let a = &opened.array;
        assert_eq!(a.page_count(), 8);
        // only the journal's pages are in memory (and their chunk of the
        // page table, charged as one page)
        assert_eq!(group.stats().resident_bytes, 3 * PAYLOAD_SIZE as u64);
        assert_eq!(a.get_u32(0), u32::from_le_bytes([9; 4]));
        let per_page = (PAYLOAD_SIZE / 4) as u64;
        assert_eq!(a.get_u32(5 * per_page), u32::from_le_bytes([5; 4]));
        assert_eq!(a.get_u32(7 * per_page + 3), u32::from_le_bytes([7; 4]));
        assert_eq!(a.get_u32(3 * per_page), 0);
        assert!(a.page_is_hole(3) && a.page_is_hole(1) && !a.page_is_hole(5));
    }

    #[test]
    fn a_whole_page_in_the_journal_needs_nothing_of_the_file_s_copy() {
        // the file's copy cannot be read at all (opened write-only, as a
        // bad sector would fail): the journal's image replaces it, and
        // another page that cannot be read is damaged
        let which = MetaFile::Refcounts;
        let tag = which.page_tag();
        let named = tempfile::NamedTempFile::new().unwrap();
        for p in 0..2 {
            named
                .as_file()
                .write_all_at(&page_with(tag, p, 1), p * PS)
                .unwrap();
        }
        let unreadable = std::fs::OpenOptions::new()
            .write(true)
            .open(named.path())
            .unwrap();
        let ops = [Op::Write {
            file: which,
            offset: 0,
            data: page_with(tag, 0, 9),
        }];
        let group = CacheGroup::new(4 * PS, OnLoadError::Fault);
        let opened = open_paged(
            Some(unreadable),
            which,
            &ops.iter().collect::<Vec<_>>(),
            "rc",
            &group,
            None,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(opened.array.get_u32(0), u32::from_le_bytes([9; 4]));
        // page 1, which the journal does not replace, cannot be read: it is
        // damage of that page, not an error of the open
        assert_eq!(opened.damaged, [1]);
    }

    #[test]
    fn truncation_and_removal_in_the_journal_hide_the_file() {
        let which = MetaFile::Map(crate::block::VolumeId(1));
        let tag = which.page_tag();
        let f = tempfile::tempfile().unwrap();
        for p in 0..4 {
            f.write_all_at(&page_with(tag, p, p as u8 + 1), p * PS)
                .unwrap();
        }
        let group = CacheGroup::new(1 << 20, OnLoadError::Fault);
        let shrink = [
            Op::SetLen {
                file: which,
                len_bytes: 2 * PS,
            },
            Op::SetLen {
                file: which,
                len_bytes: 4 * PS,
            },
        ];
        let f2 = f.try_clone().unwrap();
        let opened = open_paged(
            Some(f2),
            which,
            &shrink.iter().collect::<Vec<_>>(),
            "map",
            &group,
            None,
            &mut |_, _| {},
        )
        .unwrap();
        assert!(opened.damaged.is_empty());
        assert_eq!(opened.array.page_count(), 4);
        assert_eq!(opened.array.get_u64(0), u64::from_le_bytes([1; 8]));
        let per_page = crate::paged::U64_PER_PAGE;
        assert_eq!(opened.array.get_u64(per_page), u64::from_le_bytes([2; 8]));
        assert_eq!(opened.array.get_u64(2 * per_page), 0);
        assert_eq!(opened.array.get_u64(3 * per_page), 0);
        let removed = open_paged(
            Some(f),
            which,
            &[&Op::Remove { file: which }],
            "map",
            &group,
            None,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(removed.array.page_count(), 0);
    }
}
