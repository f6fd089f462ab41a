//! The store's files: whole reads that treat the end of a file as zeros,
//! the page ranges of a sparse file that may hold data, and allocation
//! ahead of a file's end.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

use crate::paged::PAGE_SIZE;

/// Allocates bytes `[start, end)` of `f` without changing its length
/// (`fallocate` with `FALLOC_FL_KEEP_SIZE`); nothing for an empty range.
///
/// Errors: the call's (no space, unsupported by the file system).
pub fn allocate_keeping_size(f: &File, start: u64, end: u64) -> io::Result<()> {
    if end <= start {
        return Ok(());
    }
    // SAFETY: fallocate on a file descriptor `f` owns.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            start as libc::off_t,
            (end - start) as libc::off_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads `buf.len()` bytes at byte `off` of `f`; what lies past the end of
/// the file reads as zeros. Retries interrupted reads.
///
/// Errors: the read's.
pub fn read_padded(f: &File, buf: &mut [u8], off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The ranges of 4 KiB pages (first, one past the last) of `f` below byte
/// `end` that may hold data, skipping the holes the file system reports
/// (`SEEK_DATA` / `SEEK_HOLE`; without them, one range for everything).
///
/// Errors: `lseek`'s, other than "no data past here" and "unsupported".
pub fn data_pages(f: &File, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let page = PAGE_SIZE as u64;
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < end {
        // SAFETY: lseek on a descriptor we own; it changes only the file
        // offset, which the reads here do not use (read_at).
        let data = unsafe { libc::lseek(f.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // only a hole is left
                Some(libc::EINVAL) => {
                    out.push((pos / page, end.div_ceil(page)));
                    break;
                }
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
        let stop = if hole < 0 {
            end
        } else {
            (hole as u64).min(end)
        };
        let (first, last) = (data as u64 / page, stop.div_ceil(page));
        if first < last {
            out.push((first, last));
        }
        pos = stop.max(data as u64 + 1);
    }
    Ok(out)
}

/// Bytes of the file system holding `file` available to this process
/// (`fstatvfs`: `f_bavail` × `f_frsize`), or `None` if the call fails.
pub(crate) fn available_bytes(file: &File) -> Option<u64> {
    use std::os::unix::io::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: fstatvfs fills the struct for a file descriptor we own; it
    // is read only when the call succeeded.
    let rc = unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_files_show_their_data_pages_and_read_zeros_past_the_end() {
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(&[1u8; 10], 0).unwrap();
        f.write_all_at(&[2u8; 10], 10 * 1024 * 1024).unwrap();
        let ranges = data_pages(&f, f.metadata().unwrap().len()).unwrap();
        let pages: u64 = ranges.iter().map(|(a, b)| b - a).sum();
        // the file system may report coarser extents, never fewer pages
        assert!(ranges.first().unwrap().0 == 0 && pages >= 2, "{ranges:?}");
        assert!(pages < 2560, "holes were not skipped: {ranges:?}");
        let mut buf = [9u8; 8];
        read_padded(&f, &mut buf, 10 * 1024 * 1024 + 6).unwrap();
        assert_eq!(buf, [2, 2, 2, 2, 0, 0, 0, 0]);
    }
}
