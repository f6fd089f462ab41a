//! The persistent layout of a store directory.
//!
//! ```text
//! <store>/superblock     format version, block size, hash algorithm (checksummed)
//! <store>/data           block data, PBA × 4096 = byte offset (sparse, grows on demand)
//! <store>/journal        write-ahead journal of metadata changes (see `journal`)
//! <store>/refcounts      u32 reference count per PBA
//! <store>/fingerprints   32-byte fingerprint per PBA (reverse index)
//! <store>/state.json     volume table and counters (checksummed)
//! <store>/maps/<id>      u64 per LBA of volume <id>: 0 unmapped, else PBA + 1
//! <store>/lock           held (flock) by the process that has the store open
//! ```
//! Metadata files change only through the journal (see [`crate::journal`]).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::block::{VolumeId, BLOCK_SIZE};
use crate::error::{EngineError, Result};
use crate::fingerprint::HashAlgorithm;
use crate::journal::{MetaFile, Op};

/// Version of the on-disk format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
const SUPERBLOCK_MAGIC: &str = "dedupd-store";

/// The superblock: fixed properties of a store, written once at creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Superblock {
    /// Always `"dedupd-store"`.
    pub magic: String,
    /// On-disk format version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Block size in bytes (4096).
    pub block_size: u32,
    /// Fingerprint algorithm of every block in the store.
    pub hash: HashAlgorithm,
    /// Prefix bits P of the fingerprint index (SmartDedup §3.2): 2^P groups.
    #[serde(default = "default_prefix_bits")]
    pub index_prefix_bits: u32,
}

fn default_prefix_bits() -> u32 {
    14
}

/// One volume as recorded in `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Stable id (names the map file).
    pub id: VolumeId,
    /// Name, also the NBD export name.
    pub name: String,
    /// Size in bytes (a multiple of 4096).
    pub size_bytes: u64,
    /// This volume's sequence threshold T in blocks (iDedup; SmartDedup
    /// §4.5), overriding [`crate::engine::EngineConfig::sequence_threshold_blocks`];
    /// `None` uses the engine's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_threshold_blocks: Option<u32>,
}

/// Counters that persist across restarts (flows since the store was created).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistentCounters {
    /// 4 KiB blocks written by clients (including zero blocks).
    pub blocks_written: u64,
    /// Written blocks that were all zeros (unmapped, never stored).
    pub zero_blocks_written: u64,
    /// Written non-zero blocks whose content was already stored, so nothing
    /// was written to the data file.
    pub duplicate_blocks: u64,
    /// Blocks discarded by TRIM or WRITE_ZEROES.
    pub blocks_trimmed: u64,
    /// Fingerprints that could not be indexed because the on-disk
    /// fingerprint store failed (the blocks were stored all the same).
    #[serde(default)]
    pub index_errors: u64,
    /// Fingerprint hits whose bytes differed from the stored block (with
    /// verify on); those blocks were stored separately.
    #[serde(default)]
    pub verify_mismatches: u64,
    /// LBAs remapped onto an existing copy by out-of-line dedup.
    #[serde(default)]
    pub out_of_line_duplicates: u64,
    /// Duplicate blocks written as new because their run was shorter than
    /// the sequence threshold (iDedup; SmartDedup §4.5).
    #[serde(default)]
    pub sequence_filtered_blocks: u64,
    /// Times the skipped buffer could not be saved at a checkpoint.
    #[serde(default)]
    pub skipped_save_errors: u64,
}

/// The content of `state.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Id the next created volume gets.
    pub next_volume_id: u32,
    /// Every volume.
    pub volumes: Vec<VolumeRecord>,
    /// Persistent counters.
    pub counters: PersistentCounters,
    /// Sequence number of the journal transaction that wrote this state.
    pub journal_seq: u64,
}

/// Serializes `value` as JSON followed by a line `crc32c=<hex>` of the JSON.
pub fn encode_checked<T: Serialize>(value: &T) -> Vec<u8> {
    with_crc_line(serde_json::to_vec_pretty(value).expect("serializable"))
}

/// As [`encode_checked`], with the JSON on one line (for large values).
pub fn encode_checked_compact<T: Serialize>(value: &T) -> Vec<u8> {
    with_crc_line(serde_json::to_vec(value).expect("serializable"))
}

fn with_crc_line(mut body: Vec<u8>) -> Vec<u8> {
    body.push(b'\n');
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(format!("crc32c={crc:08x}\n").as_bytes());
    body
}

/// Parses what [`encode_checked`] wrote; `path` names the file in errors.
pub fn decode_checked<T: for<'de> Deserialize<'de>>(bytes: &[u8], path: &Path) -> Result<T> {
    let corrupt = |detail: String| EngineError::Corrupt {
        file: path.to_path_buf(),
        detail,
    };
    let text = std::str::from_utf8(bytes).map_err(|_| corrupt("not UTF-8".into()))?;
    let pos = text
        .rfind("crc32c=")
        .ok_or_else(|| corrupt("no checksum line".into()))?;
    let (body, crc_line) = text.split_at(pos);
    let want = u32::from_str_radix(crc_line.trim_start_matches("crc32c=").trim(), 16)
        .map_err(|_| corrupt("bad checksum line".into()))?;
    let got = crc32c::crc32c(body.as_bytes());
    if got != want {
        return Err(corrupt(format!(
            "checksum mismatch (stored {want:08x}, computed {got:08x})"
        )));
    }
    serde_json::from_str(body).map_err(|e| corrupt(format!("malformed: {e}")))
}

/// The store directory: paths, the lock, reading and applying metadata files.
#[derive(Debug)]
pub struct StoreDir {
    root: PathBuf,
    _lock: File,
    observer: crate::observe::Observer,
}

impl StoreDir {
    /// Creates a new store at `root` (the directory may exist but must be
    /// empty) and returns it opened and locked.
    pub fn create(root: &Path, hash: HashAlgorithm, index_prefix_bits: u32) -> Result<StoreDir> {
        if root.exists() {
            let mut entries = fs::read_dir(root)
                .map_err(|e| EngineError::io(format!("reading {}", root.display()), e))?;
            if entries.next().is_some() {
                return Err(EngineError::NotAStore {
                    path: root.to_path_buf(),
                    detail: "directory is not empty and has no superblock".into(),
                });
            }
        }
        fs::create_dir_all(root.join("maps"))
            .map_err(|e| EngineError::io(format!("creating {}", root.display()), e))?;
        let dir = StoreDir {
            root: root.to_path_buf(),
            _lock: lock(root)?,
            observer: crate::observe::Observer::default(),
        };
        let sb = Superblock {
            magic: SUPERBLOCK_MAGIC.into(),
            format_version: FORMAT_VERSION,
            block_size: BLOCK_SIZE as u32,
            hash,
            index_prefix_bits: index_prefix_bits.clamp(8, 24),
        };
        let state = State {
            next_volume_id: 1,
            ..State::default()
        };
        for (name, bytes) in [
            ("state.json", encode_checked(&state)),
            ("journal", Vec::new()),
            ("data", Vec::new()),
        ] {
            write_durable(&root.join(name), &bytes)?;
        }
        // the superblock last: a store without one is not a store
        write_durable(&root.join("superblock"), &encode_checked(&sb))?;
        sync_dir(root)?;
        Ok(dir)
    }

    /// Opens and locks the existing store at `root`, checking its superblock.
    pub fn open(root: &Path) -> Result<(StoreDir, Superblock)> {
        if !root.is_dir() {
            return Err(EngineError::NoStore(root.to_path_buf()));
        }
        let sb_path = root.join("superblock");
        let bytes = match fs::read(&sb_path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(EngineError::NotAStore {
                    path: root.to_path_buf(),
                    detail: "no superblock file".into(),
                })
            }
            Err(e) => return Err(EngineError::io(format!("reading {}", sb_path.display()), e)),
        };
        let sb: Superblock = decode_checked(&bytes, &sb_path).map_err(|e| match e {
            EngineError::Corrupt { detail, .. } => EngineError::NotAStore {
                path: root.to_path_buf(),
                detail: format!("superblock unreadable ({detail}); if this is a damaged store, run `dedupd fsck`"),
            },
            other => other,
        })?;
        if sb.magic != SUPERBLOCK_MAGIC {
            return Err(EngineError::NotAStore {
                path: root.to_path_buf(),
                detail: "wrong superblock magic".into(),
            });
        }
        if sb.format_version != FORMAT_VERSION {
            return Err(EngineError::NotAStore {
                path: root.to_path_buf(),
                detail: format!(
                    "format version {} (this build reads {FORMAT_VERSION})",
                    sb.format_version
                ),
            });
        }
        if sb.block_size as usize != BLOCK_SIZE {
            return Err(EngineError::NotAStore {
                path: root.to_path_buf(),
                detail: format!("block size {}", sb.block_size),
            });
        }
        let dir = StoreDir {
            root: root.to_path_buf(),
            _lock: lock(root)?,
            observer: crate::observe::Observer::default(),
        };
        Ok((dir, sb))
    }

    /// Reports every change [`StoreDir::apply`] makes to `observer`.
    pub fn set_observer(&mut self, observer: crate::observe::Observer) {
        self.observer = observer;
    }

    /// The store directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Absolute path of a metadata file.
    pub fn path(&self, file: MetaFile) -> PathBuf {
        self.root.join(file.relative_path())
    }

    /// An anonymous scratch file in the store's directory (created and
    /// unlinked at once: nothing is left behind after a crash); `None` if
    /// it cannot be created (read-only or full file system).
    pub fn scratch_file(&self) -> Option<File> {
        let p = self.root.join("scratch.tmp");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .ok()?;
        fs::remove_file(&p).ok()?;
        Some(f)
    }

    /// Opens a file of the store for reading and writing, creating it if asked.
    pub fn open_file(&self, name: &str, create: bool) -> Result<File> {
        let p = self.root.join(name);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(&p)
            .map_err(|e| EngineError::io(format!("opening {}", p.display()), e))
    }

    /// The whole content of a metadata file; empty if it does not exist.
    pub fn read_meta(&self, file: MetaFile) -> Result<SparseImage> {
        let p = self.path(file);
        match File::open(&p) {
            Ok(f) => SparseImage::read(&f)
                .map_err(|e| EngineError::io(format!("reading {}", p.display()), e)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(SparseImage::default()),
            Err(e) => Err(EngineError::io(format!("reading {}", p.display()), e)),
        }
    }

    /// Applies `ops` in order to the metadata files and makes them durable
    /// (every touched file synced, then the directories).
    pub fn apply(&self, ops: &[Op]) -> Result<()> {
        let mut open: HashMap<MetaFile, File> = HashMap::new();
        let mut dir_changed = false;
        let name = |file: MetaFile| file.relative_path();
        for op in ops {
            let file = op.file();
            let path = self.path(file);
            let ctx = |what: &str| format!("{what} {}", path.display());
            if let Op::Remove { .. } = op {
                open.remove(&file);
                match fs::remove_file(&path) {
                    Ok(()) => {
                        dir_changed = true;
                        self.observer
                            .emit(crate::observe::IoEvent::Remove { file: &name(file) });
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(EngineError::io(ctx("removing"), e)),
                }
                continue;
            }
            let f = match open.entry(file) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    dir_changed |= !path.exists();
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&path)
                        .map_err(|e| EngineError::io(ctx("opening"), e))?;
                    e.insert(f)
                }
            };
            let n = name(file);
            let obs = &self.observer;
            match op {
                Op::Write { offset, data, .. } => {
                    f.write_all_at(data, *offset)
                        .map_err(|e| EngineError::io(ctx("writing"), e))?;
                    obs.emit(crate::observe::IoEvent::Write {
                        file: &n,
                        offset: *offset,
                        data,
                    });
                }
                Op::Replace { data, .. } => {
                    f.set_len(0)
                        .map_err(|e| EngineError::io(ctx("truncating"), e))?;
                    obs.emit(crate::observe::IoEvent::SetLen {
                        file: &n,
                        len_bytes: 0,
                    });
                    f.write_all_at(data, 0)
                        .map_err(|e| EngineError::io(ctx("writing"), e))?;
                    obs.emit(crate::observe::IoEvent::Write {
                        file: &n,
                        offset: 0,
                        data,
                    });
                }
                Op::SetLen { len_bytes, .. } => {
                    f.set_len(*len_bytes)
                        .map_err(|e| EngineError::io(ctx("resizing"), e))?;
                    obs.emit(crate::observe::IoEvent::SetLen {
                        file: &n,
                        len_bytes: *len_bytes,
                    });
                }
                Op::Patch { offset, data, .. } => {
                    // a patch whose page image is not in this batch: read,
                    // patch and rewrite the page in place
                    let payload = crate::paged::PAYLOAD_SIZE as u64;
                    let page = offset / payload;
                    let at = page * crate::paged::PAGE_SIZE as u64;
                    let mut img = [0u8; crate::paged::PAGE_SIZE];
                    crate::fileio::read_padded(f, &mut img, at)
                        .map_err(|e| EngineError::io(ctx("reading"), e))?;
                    crate::paged::patch_page(
                        &mut img,
                        file.page_tag(),
                        page,
                        (offset % payload) as usize,
                        data,
                    )
                    .map_err(|()| EngineError::Corrupt {
                        file: path.clone(),
                        detail: format!(
                            "page {page} fails its checksum; cannot apply a journal patch"
                        ),
                    })?;
                    f.write_all_at(&img, at)
                        .map_err(|e| EngineError::io(ctx("writing"), e))?;
                    obs.emit(crate::observe::IoEvent::Write {
                        file: &n,
                        offset: at,
                        data: &img,
                    });
                }
                Op::Remove { .. } => unreachable!("handled above"),
            }
        }
        for (file, f) in &open {
            f.sync_all().map_err(|e| {
                EngineError::io(format!("syncing {}", self.path(*file).display()), e)
            })?;
            self.observer
                .emit(crate::observe::IoEvent::Sync { file: &name(*file) });
        }
        if dir_changed {
            sync_dir(&self.root.join("maps"))?;
            sync_dir(&self.root)?;
        }
        Ok(())
    }

    /// Bytes allocated on disk by metadata (every file but `data`).
    pub fn metadata_bytes_on_disk(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let mut total = 0;
        let mut visit = |p: &Path| {
            if let Ok(rd) = fs::read_dir(p) {
                for e in rd.flatten() {
                    if let Ok(m) = e.metadata() {
                        if m.is_file() && e.file_name() != "data" {
                            total += m.blocks() * 512;
                        }
                    }
                }
            }
        };
        visit(&self.root);
        visit(&self.root.join("maps"));
        total
    }
}

/// Metadata file contents in memory, read from the store on first use and
/// changed by journal operations (replay without writing the files).
#[derive(Debug)]
pub struct MetaImages<'a> {
    dir: &'a StoreDir,
    files: HashMap<MetaFile, SparseImage>,
}

/// The content of a file as its length and its 4 KiB pages that hold data;
/// the rest reads as zeros. A thin volume's map file is mostly holes, so
/// its image costs memory in proportion to what is mapped.
#[derive(Debug, Clone, Default)]
pub struct SparseImage {
    /// Length of the file in bytes.
    pub len_bytes: u64,
    /// Pages that may hold non-zero bytes, by page number.
    pub pages: std::collections::BTreeMap<u64, Box<[u8; crate::paged::PAGE_SIZE]>>,
}

const IMAGE_PAGE: u64 = crate::paged::PAGE_SIZE as u64;

impl SparseImage {
    /// Reads `f`, skipping the holes the file system reports
    /// (`SEEK_DATA`/`SEEK_HOLE`; without them the whole file is read).
    pub fn read(f: &File) -> io::Result<SparseImage> {
        let len_bytes = f.metadata()?.len();
        let mut img = SparseImage {
            len_bytes,
            ..SparseImage::default()
        };
        for (first, last) in crate::fileio::data_pages(f, len_bytes)? {
            for page in first..last {
                let off = page * IMAGE_PAGE;
                let want = (len_bytes - off).min(IMAGE_PAGE) as usize;
                let mut buf = Box::new([0u8; crate::paged::PAGE_SIZE]);
                crate::fileio::read_padded(f, &mut buf[..want], off)?;
                if buf.iter().any(|&b| b != 0) {
                    img.pages.insert(page, buf);
                }
            }
        }
        Ok(img)
    }

    /// An image holding `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> SparseImage {
        let mut img = SparseImage::default();
        img.write(0, bytes);
        img
    }

    /// The whole content (for small files).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len_bytes as usize];
        for (&p, page) in &self.pages {
            let off = (p * IMAGE_PAGE) as usize;
            let n = (out.len() - off).min(page.len());
            out[off..off + n].copy_from_slice(&page[..n]);
        }
        out
    }

    /// Writes `data` at byte `offset`, growing the file as needed.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        self.len_bytes = self.len_bytes.max(end);
        let mut pos = offset;
        while pos < end {
            let page = pos / IMAGE_PAGE;
            let in_page = (pos % IMAGE_PAGE) as usize;
            let n = ((IMAGE_PAGE - in_page as u64).min(end - pos)) as usize;
            let src = &data[(pos - offset) as usize..(pos - offset) as usize + n];
            let slot = self
                .pages
                .entry(page)
                .or_insert_with(|| Box::new([0u8; crate::paged::PAGE_SIZE]));
            slot[in_page..in_page + n].copy_from_slice(src);
            pos += n as u64;
        }
    }

    /// Sets the length to `len_bytes`, dropping what lies past it.
    pub fn set_len(&mut self, len_bytes: u64) {
        self.len_bytes = len_bytes;
        let keep = len_bytes.div_ceil(IMAGE_PAGE);
        self.pages.retain(|&p, _| p < keep);
        let tail = (len_bytes % IMAGE_PAGE) as usize;
        if tail != 0 {
            if let Some(last) = self.pages.get_mut(&(keep - 1)) {
                last[tail..].fill(0);
            }
        }
    }
}

impl<'a> MetaImages<'a> {
    /// No file read yet.
    pub fn new(dir: &'a StoreDir) -> Self {
        MetaImages {
            dir,
            files: HashMap::new(),
        }
    }

    /// The current content of `file` (empty if it does not exist).
    pub fn get(&mut self, file: MetaFile) -> Result<&SparseImage> {
        self.load(file)?;
        Ok(&self.files[&file])
    }

    fn load(&mut self, file: MetaFile) -> Result<&mut SparseImage> {
        if !self.files.contains_key(&file) {
            let bytes = self.dir.read_meta(file)?;
            self.files.insert(file, bytes);
        }
        Ok(self.files.get_mut(&file).expect("inserted above"))
    }

    /// Applies one journal operation to the in-memory content.
    pub fn apply(&mut self, op: &Op) -> Result<()> {
        match op {
            Op::Write { file, offset, data } => self.load(*file)?.write(*offset, data),
            Op::Replace { file, data } => {
                self.files.insert(*file, SparseImage::from_bytes(data));
            }
            Op::SetLen { file, len_bytes } => self.load(*file)?.set_len(*len_bytes),
            Op::Remove { file } => {
                self.files.insert(*file, SparseImage::default());
            }
            Op::Patch { file, offset, data } => {
                let payload = crate::paged::PAYLOAD_SIZE as u64;
                let page = offset / payload;
                let img = self.load(*file)?;
                img.len_bytes = img.len_bytes.max((page + 1) * IMAGE_PAGE);
                let slot = img
                    .pages
                    .entry(page)
                    .or_insert_with(|| Box::new([0u8; crate::paged::PAGE_SIZE]));
                crate::paged::apply_patch(slot, file.page_tag(), *offset, data);
            }
        }
        Ok(())
    }
}

fn lock(root: &Path) -> Result<File> {
    let p = root.join("lock");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .map_err(|e| EngineError::io(format!("opening {}", p.display()), e))?;
    // SAFETY: flock on a file descriptor we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(EngineError::Locked(root.to_path_buf()));
    }
    Ok(f)
}

/// Writes a whole file and syncs it.
fn write_durable(path: &Path, bytes: &[u8]) -> Result<()> {
    let f = File::create(path)
        .map_err(|e| EngineError::io(format!("creating {}", path.display()), e))?;
    f.write_all_at(bytes, 0)
        .map_err(|e| EngineError::io(format!("writing {}", path.display()), e))?;
    f.sync_all()
        .map_err(|e| EngineError::io(format!("syncing {}", path.display()), e))
}

/// Syncs a directory so created, renamed and removed entries are durable.
pub fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| EngineError::io(format!("syncing directory {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_json_detects_damage() {
        let s = State {
            next_volume_id: 3,
            ..State::default()
        };
        let mut b = encode_checked(&s);
        let back: State = decode_checked(&b, Path::new("x")).unwrap();
        assert_eq!(back, s);
        b[5] ^= 1;
        assert!(matches!(
            decode_checked::<State>(&b, Path::new("x")),
            Err(EngineError::Corrupt { .. })
        ));
    }

    #[test]
    fn open_rejects_missing_and_foreign() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(
            StoreDir::open(&d.path().join("nope")),
            Err(EngineError::NoStore(_))
        ));
        fs::write(d.path().join("something"), b"x").unwrap();
        assert!(matches!(
            StoreDir::open(d.path()),
            Err(EngineError::NotAStore { .. })
        ));
        assert!(matches!(
            StoreDir::create(d.path(), HashAlgorithm::Sha256, 16),
            Err(EngineError::NotAStore { .. })
        ));
        let s = d.path().join("s");
        let dir = StoreDir::create(&s, HashAlgorithm::Blake3, 16).unwrap();
        assert!(matches!(StoreDir::open(&s), Err(EngineError::Locked(_))));
        drop(dir);
        let (_d, sb) = StoreDir::open(&s).unwrap();
        assert_eq!(sb.hash, HashAlgorithm::Blake3);
    }

    #[test]
    fn sparse_image_reads_data_and_skips_holes() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let f = File::create(&p).unwrap();
        // 1 GiB long, data in three places, a short tail
        f.write_at(b"head", 0).unwrap();
        f.write_at(&[7u8; 5000], 512 << 20).unwrap();
        f.set_len((1 << 30) + 10).unwrap();
        f.write_at(b"tail", 1 << 30).unwrap();
        let img = SparseImage::read(&File::open(&p).unwrap()).unwrap();
        assert_eq!(img.len_bytes, (1 << 30) + 10);
        // only the pages with data were read
        let want: Vec<u64> = vec![
            0,
            (512 << 20) / 4096,
            (512 << 20) / 4096 + 1,
            (1 << 30) / 4096,
        ];
        assert_eq!(img.pages.keys().copied().collect::<Vec<_>>(), want);
        let mut expect = SparseImage::default();
        expect.write(0, b"head");
        expect.write(512 << 20, &[7u8; 5000]);
        expect.write(1 << 30, b"tail");
        expect.set_len((1 << 30) + 10);
        assert_eq!(img.pages.len(), expect.pages.len());
        for (k, v) in &img.pages {
            assert_eq!(&v[..], &expect.pages[k][..], "page {k}");
        }
        // writes grow, set_len cuts and zeroes the tail of the last page
        let mut small = SparseImage::from_bytes(b"abcdef");
        small.set_len(3);
        small.write(5, b"z");
        assert_eq!(small.to_bytes(), b"abc\0\0z");
    }
}
