//! Parsers of the two text trace formats, one line at a time, without
//! allocating per line (fields are byte slices; hex is decoded in place).
//!
//! **FIU IODedup** (SNIA IOTTA; whitespace-separated):
//! `ts_ns pid process lba_sectors size_sectors R|W major minor digests`.
//! The major and minor device numbers name the disk: each (pid, process,
//! device) is a source of its own, its device `major << 32 | minor`.
//! `digests` concatenates 32-hex MD5 digests with no separator: one per
//! 4 KiB page (most traces) or one per 512-byte sector (the *homes*
//! traces). The layout is detected per line from the digest count `n` and
//! the size `s`: `n = s ≥ 2` is per sector; `n = ceil(s/8)` or `n` = pages
//! touched is per page; the ambiguous `n = s = 1` follows the last
//! unambiguous line of the file (per page at first). Per-page digests equal
//! to the MD5 of 4096 zero bytes are zero blocks. Per-sector digests are
//! combined per 4 KiB block: a block whose 8 sector digests are all the MD5
//! of 512 zero bytes is a zero block; otherwise its digest is the first 16
//! bytes of SHA-256 over the 8 digests in sector order (a sector the
//! request does not cover contributes 16 zero bytes). A process name with
//! spaces is accepted: the fields are taken from both ends; such a name
//! longer than a Linux process name (15 bytes) is an error, as what a line
//! cut short and run into the next looks like. A process name
//! that is not valid UTF-8 (Linux cuts names at 15 bytes, which may split
//! a multi-byte character) is read with U+FFFD in place of the bad bytes,
//! in both formats.
//!
//! **MobileAppTraces** (XMU smartphone traces; tab-separated):
//! `time_s R|W lba_sectors size_sectors pid process md5-md5-…`, one MD5 per
//! 4 KiB page joined by `-`; time in (fractional) seconds. No device
//! numbers: every source has device 0.

use std::collections::HashMap;

use sha2::{Digest as _, Sha256};

use crate::request::{
    device_number, Digest, Op, Request, Source, MD5_ZERO_4K, MD5_ZERO_512, SECTORS_PER_BLOCK,
};

/// Which text format a line is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextFormat {
    /// FIU IODedup blkparse lines.
    Fiu,
    /// MobileAppTraces lines.
    Mobile,
}

/// Digest layout of FIU lines (per 4 KiB page or per 512-byte sector).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One digest per 4 KiB page.
    PerPage,
    /// One digest per 512-byte sector (FIU homes).
    PerSector,
}

/// The (pid, process, device) → id table of a text trace, looked up
/// without allocating when the source was seen before. One hash-map entry
/// per distinct source (its name stored twice: in the map's key and in
/// [`SourceTable::sources`]), so a lookup costs the same however many
/// sources there are.
#[derive(Debug, Default)]
pub struct SourceTable {
    /// Sources in order of first appearance; a request's `source` indexes it.
    pub sources: Vec<Source>,
    ids: HashMap<SourceKey, u32>,
    last: Option<u32>,
}

/// A source's key in [`SourceTable`]: (pid, device, process name), owned.
/// It hashes and compares through [`SourceParts`], so the table can be
/// looked up with borrowed parts (a `&str` name, no allocation).
#[derive(Debug)]
struct SourceKey(u32, u64, String);

/// (pid, device, process name) of a source, owned ([`SourceKey`]) or
/// borrowed.
trait SourceParts {
    fn parts(&self) -> (u32, u64, &str);
}

impl SourceParts for SourceKey {
    fn parts(&self) -> (u32, u64, &str) {
        (self.0, self.1, &self.2)
    }
}

impl SourceParts for (u32, u64, &str) {
    fn parts(&self) -> (u32, u64, &str) {
        *self
    }
}

impl<'a> std::borrow::Borrow<dyn SourceParts + 'a> for SourceKey {
    fn borrow(&self) -> &(dyn SourceParts + 'a) {
        self
    }
}

impl std::hash::Hash for dyn SourceParts + '_ {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.parts().hash(h)
    }
}

impl PartialEq for dyn SourceParts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn SourceParts + '_ {}

// (the owned key hashes and compares as its borrowed form, as `Borrow`
// requires)
impl std::hash::Hash for SourceKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self as &dyn SourceParts).hash(h)
    }
}

impl PartialEq for SourceKey {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for SourceKey {}

impl SourceTable {
    /// The id of (pid, process, device), adding it if new. `device` as
    /// [`Source::device`] (0: none).
    pub fn id(&mut self, pid: u32, process: &str, device: u64) -> u32 {
        if let Some(l) = self.last {
            let s = &self.sources[l as usize];
            if s.pid == pid && s.device == device && s.process == process {
                return l;
            }
        }
        let key = (pid, device, process);
        let id = match self.ids.get(&key as &dyn SourceParts) {
            Some(&i) => i,
            None => {
                let i = u32::try_from(self.sources.len()).expect("fewer than 2^32 sources");
                self.sources.push(Source {
                    pid,
                    process: process.to_string(),
                    device,
                });
                self.ids
                    .insert(SourceKey(pid, device, process.to_string()), i);
                i
            }
        };
        self.last = Some(id);
        id
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Decodes exactly 32 hex digits into a 16-byte digest.
pub fn parse_hex16(s: &[u8]) -> Option<Digest> {
    if s.len() != 32 {
        return None;
    }
    let mut d = [0u8; 16];
    for (i, out) in d.iter_mut().enumerate() {
        *out = (hex_val(s[2 * i])? << 4) | hex_val(s[2 * i + 1])?;
    }
    Some(d)
}

fn parse_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut v: u64 = 0;
    for &c in s {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
    }
    Some(v)
}

/// Seconds with an optional fraction (`12.345678`) to nanoseconds.
fn parse_seconds_ns(s: &[u8]) -> Option<u64> {
    let (int, frac) = match s.iter().position(|&c| c == b'.') {
        Some(p) => (&s[..p], &s[p + 1..]),
        None => (s, &[][..]),
    };
    if int.is_empty() && frac.is_empty() {
        return None; // "." alone is no time
    }
    let secs = if int.is_empty() { 0 } else { parse_u64(int)? };
    let mut ns: u64 = 0;
    let mut scale = 100_000_000;
    for &c in frac {
        if !c.is_ascii_digit() {
            return None;
        }
        ns += (c - b'0') as u64 * scale;
        scale /= 10;
    }
    secs.checked_mul(1_000_000_000)?.checked_add(ns)
}

fn parse_op(s: &[u8]) -> Option<Op> {
    match s {
        b"R" | b"r" | b"Read" => Some(Op::Read),
        b"W" | b"w" | b"Write" => Some(Op::Write),
        _ => None,
    }
}

fn page_digest(d: Digest) -> Option<Digest> {
    if d == MD5_ZERO_4K {
        None
    } else {
        Some(d)
    }
}

/// Fills `req.blocks` from concatenated per-sector digests (FIU homes).
fn blocks_from_sectors(req: &mut Request, hex: &[u8]) -> Result<(), String> {
    let first = req.first_block();
    let n_blocks = req.blocks_touched();
    for b in 0..n_blocks {
        let block = first + b;
        let mut slots = [[0u8; 16]; SECTORS_PER_BLOCK as usize];
        let mut all_zero = true;
        for (k, slot) in slots.iter_mut().enumerate() {
            let sector = block * SECTORS_PER_BLOCK + k as u64;
            if sector < req.lba_sectors || sector >= req.lba_sectors + req.sectors {
                all_zero = false;
                continue;
            }
            let j = (sector - req.lba_sectors) as usize;
            let d = parse_hex16(&hex[32 * j..32 * j + 32])
                .ok_or_else(|| format!("bad hex in digest #{} of the request", j + 1))?;
            all_zero &= d == MD5_ZERO_512;
            *slot = d;
        }
        if all_zero {
            req.blocks.push(None);
        } else {
            let mut h = Sha256::new();
            for s in &slots {
                h.update(s);
            }
            let full = h.finalize();
            let mut d = [0u8; 16];
            d.copy_from_slice(&full[..16]);
            req.blocks.push(Some(d));
        }
    }
    Ok(())
}

/// Longest FIU process name of several fields, in bytes: Linux keeps a
/// process name (comm) in 16 bytes with its NUL.
const MAX_SPACED_PROCESS_NAME_BYTES: usize = 15;

/// Parses one FIU line into `req` (its block list is cleared first).
/// `sticky` is the file's last unambiguous digest layout, updated here.
///
/// Errors: a message saying what is malformed (the caller adds file:line).
pub fn parse_fiu(
    line: &[u8],
    req: &mut Request,
    sources: &mut SourceTable,
    sticky: &mut Layout,
) -> Result<(), String> {
    let mut f: [&[u8]; 16] = [&[]; 16];
    let mut n = 0;
    for field in line
        .split(|c| c.is_ascii_whitespace())
        .filter(|s| !s.is_empty())
    {
        if n == f.len() {
            return Err("too many fields".into());
        }
        f[n] = field;
        n += 1;
    }
    if n < 9 {
        return Err(format!("expected 9 fields, found {n}"));
    }
    // the value of field `i` (0-based) quoted; past the process name, the
    // fields are counted from the end (a process name may hold spaces),
    // so a line with a field too many names the wrong one: say so
    let bad = |what: &str, i: usize| {
        let mut m = format!(
            "bad {what} {:?} (field {} of {n})",
            String::from_utf8_lossy(f[i]),
            i + 1
        );
        if n > 9 && i >= n - 6 {
            m.push_str(&format!(
                "; the line has {n} fields where 9 are expected (the fields after \
                 the process name are taken from the end, so one too many shifts them)"
            ));
        }
        m
    };
    let ts = parse_u64(f[0]).ok_or_else(|| bad("time stamp", 0))?;
    let pid = parse_u64(f[1])
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| bad("pid", 1))?;
    // process may hold spaces: it is everything between pid and lba
    let lba = parse_u64(f[n - 6]).ok_or_else(|| bad("lba", n - 6))?;
    let size = parse_u64(f[n - 5]).ok_or_else(|| bad("size", n - 5))?;
    let op = parse_op(f[n - 4]).ok_or_else(|| bad("operation (not R or W)", n - 4))?;
    let major = parse_u64(f[n - 3])
        .and_then(|d| u32::try_from(d).ok())
        .ok_or_else(|| bad("major device number", n - 3))?;
    let minor = parse_u64(f[n - 2])
        .and_then(|d| u32::try_from(d).ok())
        .ok_or_else(|| bad("minor device number", n - 2))?;
    let hex = f[n - 1];
    // (comm is cut at 15 bytes, which can split a multi-byte character)
    let process = if n == 9 {
        String::from_utf8_lossy(f[2])
    } else {
        // re-slice the original line from the first to the last name field
        let start = f[2].as_ptr() as usize - line.as_ptr() as usize;
        let end = f[n - 7].as_ptr() as usize - line.as_ptr() as usize + f[n - 7].len();
        // a name of several fields is a Linux comm with spaces, at most 15
        // bytes: longer, it is a line cut short and the next run into it
        if end - start > MAX_SPACED_PROCESS_NAME_BYTES {
            return Err(format!(
                "process name of {} bytes in {} fields (a process name with spaces \
                 has at most {MAX_SPACED_PROCESS_NAME_BYTES}): two lines run together?",
                end - start,
                n - 8
            ));
        }
        String::from_utf8_lossy(&line[start..end])
    };
    Request::check_sectors(lba, size)?;
    if !hex.len().is_multiple_of(32) {
        return Err(format!(
            "digest field is {} hex digits, not a multiple of 32",
            hex.len()
        ));
    }
    req.ts_ns = ts;
    req.op = Some(op);
    req.lba_sectors = lba;
    req.sectors = size;
    req.blocks.clear();
    let digests = (hex.len() / 32) as u64;
    let pages = size.div_ceil(SECTORS_PER_BLOCK);
    let per_page = digests == pages || digests == req.blocks_touched();
    // one digest per sector and per page touched at once (one sector, or
    // two across a page boundary): the file's layout so far decides
    let ambiguous = digests == size && per_page;
    let layout = if ambiguous {
        *sticky
    } else if digests == size {
        Layout::PerSector
    } else if per_page {
        Layout::PerPage
    } else {
        return Err(format!(
            "{digests} digests do not fit {size} sectors (one per 4 KiB page or per 512-byte sector)"
        ));
    };
    match layout {
        Layout::PerPage => {
            for (j, h) in hex.chunks_exact(32).enumerate() {
                let d = parse_hex16(h)
                    .ok_or_else(|| format!("bad hex in digest #{} of the request", j + 1))?;
                req.blocks.push(page_digest(d));
            }
        }
        Layout::PerSector => blocks_from_sectors(req, hex)?,
    }
    // (only a line found good counts: its source, and the layout it shows)
    if !ambiguous {
        *sticky = layout;
    }
    req.source = sources.id(pid, &process, device_number(major, minor));
    Ok(())
}

/// Parses one MobileAppTraces line into `req` (its block list is cleared
/// first).
///
/// Errors: a message saying what is malformed (the caller adds file:line).
pub fn parse_mobile(
    line: &[u8],
    req: &mut Request,
    sources: &mut SourceTable,
) -> Result<(), String> {
    let mut f: [&[u8]; 7] = [&[]; 7];
    let mut n = 0;
    for field in line.split(|&c| c == b'\t') {
        if n == f.len() {
            return Err("more than 7 tab-separated fields".into());
        }
        f[n] = field.trim_ascii();
        n += 1;
    }
    if n < 6 {
        return Err(format!("expected 7 tab-separated fields, found {n}"));
    }
    // the value of field `i` (0-based) quoted
    let bad = |what: &str, i: usize| {
        format!(
            "bad {what} {:?} (field {} of {n})",
            String::from_utf8_lossy(f[i]),
            i + 1
        )
    };
    let ts = parse_seconds_ns(f[0]).ok_or_else(|| bad("time", 0))?;
    let op = parse_op(f[1]).ok_or_else(|| bad("operation (not R or W)", 1))?;
    let lba = parse_u64(f[2]).ok_or_else(|| bad("lba", 2))?;
    let size = parse_u64(f[3]).ok_or_else(|| bad("size", 3))?;
    let pid = parse_u64(f[4])
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| bad("pid", 4))?;
    // (comm is cut at 15 bytes, which can split a multi-byte character)
    let process = String::from_utf8_lossy(f[5]);
    Request::check_sectors(lba, size)?;
    req.ts_ns = ts;
    req.op = Some(op);
    req.lba_sectors = lba;
    req.sectors = size;
    req.blocks.clear();
    let hex = if n == 7 { f[6] } else { &[][..] };
    if !hex.is_empty() {
        for (j, h) in hex.split(|&c| c == b'-').enumerate() {
            let d = parse_hex16(h).ok_or_else(|| {
                format!(
                    "MD5 digest #{} of the request ({:?}) is not 32 hex digits",
                    j + 1,
                    String::from_utf8_lossy(&h[..h.len().min(40)])
                )
            })?;
            req.blocks.push(page_digest(d));
        }
    }
    let pages = size.div_ceil(SECTORS_PER_BLOCK);
    let n_digests = req.blocks.len() as u64;
    // (a read may carry no digests; any it carries must fit as a write's)
    let checked = op == Op::Write || n_digests > 0;
    if checked && n_digests != pages && n_digests != req.blocks_touched() {
        return Err(format!(
            "{n_digests} digests do not fit {size} sectors (one per 4 KiB page)"
        ));
    }
    // (only a line found good adds its source)
    req.source = sources.id(pid, &process, 0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_cut_short_and_run_into_the_next_is_malformed() {
        let parse = |line: &str| {
            let mut req = Request::default();
            let mut sources = SourceTable::default();
            let mut sticky = Layout::PerPage;
            parse_fiu(line.as_bytes(), &mut req, &mut sources, &mut sticky)
                .map(|()| sources.sources[0].process.clone())
        };
        let digest = "57db00a2a67ca70d33789a784d37729d";
        // (a name with spaces of 15 bytes parses; of 16 it does not)
        assert_eq!(
            parse(&format!("1 7 Web Content ab 8 8 W 6 0 {digest}")).unwrap(),
            "Web Content ab"
        );
        assert_eq!(
            parse(&format!("1 7 Web Content abc 8 8 W 6 0 {digest}")).unwrap(),
            "Web Content abc"
        );
        assert!(parse(&format!("1 7 Web Content abcd 8 8 W 6 0 {digest}")).is_err());
        // (one field of any length is one name)
        assert_eq!(
            parse(&format!("1 7 a-very-long-process-name 8 8 W 6 0 {digest}")).unwrap(),
            "a-very-long-process-name"
        );
        // the first line of mail-01 cut after its LBA, then its second
        let e = parse(&format!(
            "89966527996712 4253 nfsd 50851668089966528039628 4253 nfsd 508516688 8 W 6 0 {digest}"
        ))
        .unwrap_err();
        assert!(e.contains("two lines run together"), "{e}");
    }

    #[test]
    fn sources_differ_by_pid_device_and_name() {
        let mut t = SourceTable::default();
        let a = t.id(1, "p", 0);
        let ids = [t.id(2, "p", 0), t.id(1, "q", 0), t.id(1, "p", 5)];
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(a, 0);
        // seen before: the same ids, whatever came last
        assert_eq!(t.id(1, "q", 0), 2);
        assert_eq!(t.id(1, "p", 0), 0);
        assert_eq!(t.id(1, "p", 5), 3);
        assert_eq!(t.sources.len(), 4);
        assert_eq!(
            (
                t.sources[3].pid,
                t.sources[3].process.as_str(),
                t.sources[3].device
            ),
            (1, "p", 5)
        );
    }

    /// Many sources sharing a pid (a pid reused by process after process
    /// over weeks of trace, or a trace without real pids): each lookup
    /// takes the same time however many there are. Scanning them instead
    /// takes minutes here.
    #[test]
    fn many_sources_of_one_pid_keep_their_ids() {
        // (looked up by hash: a table of one pid's many process names is
        // not searched entry by entry)
        const N: u32 = 20_000;
        let names: Vec<String> = (0..N).map(|i| format!("kworker/{i}")).collect();
        let mut t = SourceTable::default();
        for (i, name) in names.iter().enumerate() {
            assert_eq!(t.id(7, name, 0), i as u32);
        }
        // again, in another order (the last-source shortcut never hits)
        for (i, name) in names.iter().enumerate().rev() {
            assert_eq!(t.id(7, name, 0), i as u32);
        }
    }
}
