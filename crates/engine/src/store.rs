//! The persistent layout of a store directory.
//!
//! ```text
//! <store>/superblock     format version, block size, hash algorithm (checksummed)
//! <store>/data           block data, PBA × 4096 = byte offset (sparse, grows on demand)
//! <store>/journal        write-ahead journal of metadata changes (see `journal`)
//! <store>/refcounts      u32 reference count per PBA
//! <store>/fingerprints   32-byte fingerprint per PBA (reverse index)
//! <store>/state.json     volume table (checksummed)
//! <store>/counters.json  persistent counters, last journal sequence (checksummed)
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

/// Version of the on-disk format this build writes: 2 keeps the counters
/// in `counters.json`, apart from the volume table in `state.json`, so a
/// journal transaction carries the table only when it changed.
pub const FORMAT_VERSION: u32 = 2;
/// Oldest on-disk format this build reads. A store of format 1 (counters
/// inside `state.json`) is read as it is and marked format 2 by its first
/// commit ([`StoreDir::upgrade_format`]), before that commit journals a
/// `counters.json` a format-1 reader would not know.
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// The superblock's `magic`.
pub const SUPERBLOCK_MAGIC: &str = "dedupd-store";

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
    /// A delete of this volume began (committed before its first block was
    /// released): the volume stays read-only, some of its blocks possibly
    /// released, until `volume delete` runs again and finishes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
    /// A shrink of this volume to this many bytes began (committed before
    /// its first block was released) and has not finished: LBAs past it
    /// are not written, some of their blocks possibly released, until a
    /// `volume resize` finishes (or undoes) it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrinking_to_bytes: Option<u64>,
    /// The volume's creation journaled its map cut to nothing before its
    /// length: a map no checkpoint has written yet is then told from a
    /// lost one (missing without that cut in the journal: damage).
    /// False for volumes created by earlier versions, whose creation
    /// journaled the length alone: their map may be missing whenever the
    /// journal changes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub creation_marked: bool,
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
    /// Fingerprint lookups and inserts the on-disk fingerprint store
    /// failed (the blocks were stored all the same, as copies of their own).
    #[serde(default)]
    pub index_errors: u64,
    /// Comparisons (verify on) that found a block's bytes differing from
    /// a stored block with its fingerprint: on the write path (the block
    /// was stored separately) and in the out-of-line passes (the copies
    /// stay apart); a pair compared again counts again.
    #[serde(default)]
    pub verify_mismatches: u64,
    /// Stored copies out-of-line dedup freed (see
    /// [`crate::stats::Stats::out_of_line_duplicates`]).
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Id the next created volume gets.
    pub next_volume_id: u32,
    /// Every volume.
    pub volumes: Vec<VolumeRecord>,
    /// The engine's sequence threshold T (blocks) in effect for volumes
    /// without their own, as of the last open that wrote the state (absent:
    /// 1). A start with T = 1 after one with T > 1 queues those volumes for
    /// a whole out-of-line pass, since their writes under T > 1 were not
    /// recorded for it.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub default_sequence_threshold_blocks: u32,
    /// The engine's `verify` setting (byte-compare before sharing) as of
    /// the last open that wrote the state (absent: off). Commands opening
    /// the store between runs of the server take it from here, so an
    /// offline dedup pass verifies as the server did.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify: bool,
    /// Persistent counters of a format-1 store (format 2 keeps them in
    /// `counters.json`, [`CounterState`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<PersistentCounters>,
    /// Sequence number of the journal transaction that wrote a format-1
    /// state (0 in format 2).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub journal_seq: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            next_volume_id: 0,
            volumes: Vec::new(),
            default_sequence_threshold_blocks: 1,
            verify: false,
            counters: None,
            journal_seq: 0,
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn one() -> u32 {
    1
}

/// True for a sequence threshold of 1 (or 0): off, left out of the state.
pub(crate) fn is_one(n: &u32) -> bool {
    *n <= 1
}

/// The content of `counters.json`, replaced by every journal transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterState {
    /// Persistent counters.
    pub counters: PersistentCounters,
    /// Sequence number of the journal transaction that wrote them.
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

/// Writes [`encode_checked_compact`]'s bytes to `out` as they are made
/// (for large values: no copy of the JSON in memory).
///
/// Errors: writing `out`.
pub fn write_checked_compact<T: Serialize, W: std::io::Write>(
    value: &T,
    out: W,
) -> std::io::Result<()> {
    /// Passes bytes on, adding them to a running CRC32C.
    struct Crc<W> {
        out: W,
        crc: u32,
    }
    impl<W: std::io::Write> std::io::Write for Crc<W> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = self.out.write(buf)?;
            self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.out.flush()
        }
    }
    let mut w = Crc { out, crc: 0 };
    serde_json::to_writer(&mut w, value)?;
    std::io::Write::write_all(&mut w, b"\n")?;
    let line = format!("crc32c={:08x}\n", w.crc);
    std::io::Write::write_all(&mut w.out, line.as_bytes())?;
    std::io::Write::flush(&mut w.out)
}

fn with_crc_line(mut body: Vec<u8>) -> Vec<u8> {
    body.push(b'\n');
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(format!("crc32c={crc:08x}\n").as_bytes());
    body
}

/// The JSON body and the checksum line of what [`encode_checked`] wrote.
pub(crate) fn split_checked(text: &str) -> Option<(&str, &str)> {
    text.rfind("crc32c=").map(|pos| text.split_at(pos))
}

/// Parses what [`encode_checked`] wrote; `path` names the file in errors.
pub fn decode_checked<T: for<'de> Deserialize<'de>>(bytes: &[u8], path: &Path) -> Result<T> {
    let corrupt = |detail: String| EngineError::Corrupt {
        file: path.to_path_buf(),
        detail,
    };
    let text = std::str::from_utf8(bytes).map_err(|_| corrupt("not UTF-8".into()))?;
    let (body, crc_line) = split_checked(text).ok_or_else(|| corrupt("no checksum line".into()))?;
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
        // the directory must be empty but for a lock file: checked before
        // the lock is taken (no lock file is left in a directory that is
        // not to be a store), and again under it (another dedupd creating
        // the store at the same moment is "in use", not a half-made store)
        let check_empty = || -> Result<()> {
            if !root.exists() {
                return Ok(());
            }
            if !root.is_dir() {
                return Err(EngineError::NotAStore {
                    path: root.to_path_buf(),
                    detail: "not a directory".into(),
                });
            }
            check_owner(root)?;
            let entries = fs::read_dir(root)
                .map_err(|e| EngineError::io(format!("reading {}", root.display()), e))?;
            if root.join("superblock").exists() {
                return Err(EngineError::StoreExists(root.to_path_buf()));
            }
            for entry in entries {
                let entry =
                    entry.map_err(|e| EngineError::io(format!("reading {}", root.display()), e))?;
                if entry.file_name() != "lock" {
                    return Err(EngineError::NotAStore {
                        path: root.to_path_buf(),
                        detail: "directory is not empty and has no superblock".into(),
                    });
                }
            }
            Ok(())
        };
        // (a lock file there already: taken first, so a store another
        // dedupd is making right now is "in use", whatever it holds yet)
        let held = if root.is_dir() && root.join("lock").is_file() {
            Some(lock(root)?)
        } else {
            None
        };
        check_empty()?;
        fs::create_dir_all(root)
            .map_err(|e| EngineError::io(format!("creating {}", root.display()), e))?;
        let dir = StoreDir {
            root: root.to_path_buf(),
            _lock: match held {
                Some(l) => l,
                None => lock(root)?,
            },
            observer: crate::observe::Observer::default(),
        };
        check_empty()?;
        fs::create_dir_all(root.join("maps"))
            .map_err(|e| EngineError::io(format!("creating {}", root.display()), e))?;
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
        // (every file the first open needs exists: it creates none, whose
        // directory entries a power loss could take away)
        for (name, bytes) in [
            ("state.json", encode_checked(&state)),
            ("counters.json", encode_checked(&CounterState::default())),
            ("journal", Vec::new()),
            ("data", Vec::new()),
            ("refcounts", Vec::new()),
            ("fingerprints", Vec::new()),
        ] {
            write_durable(&root.join(name), &bytes)?;
        }
        // the superblock last, once the other files' entries are durable: a
        // store without one is not a store, and one with it has them all
        sync_dir(&root.join("maps"))?;
        sync_dir(root)?;
        write_durable(&root.join("superblock"), &encode_checked(&sb))?;
        sync_dir(root)?;
        // and the store's own entry in its parent directory
        let parent = root
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        sync_dir(parent)?;
        Ok(dir)
    }

    /// Opens and locks the existing store at `root`, checking its superblock.
    pub fn open(root: &Path) -> Result<(StoreDir, Superblock)> {
        Self::check_dir(root)?;
        let early = Self::lock_if_any(root)?;
        let sb = match read_superblock(root) {
            Ok(sb) => sb,
            // (a store's superblock, damaged: not "not a store")
            Err(SuperblockError::Unreadable(detail))
                if detail != NO_SUPERBLOCK
                    && root.join(MetaFile::State.relative_path()).is_file() =>
            {
                return Err(EngineError::Corrupt {
                    file: root.join("superblock"),
                    detail: format!(
                        "{detail}; `dedupd --store {} fsck --repair` rebuilds it from the rest \
                         of the store",
                        crate::error::store_word(root)
                    ),
                })
            }
            Err(SuperblockError::Unreadable(detail)) => {
                return Err(EngineError::NotAStore {
                    path: root.to_path_buf(),
                    detail: if detail == NO_SUPERBLOCK {
                        detail
                    } else {
                        format!("superblock unreadable ({detail})")
                    },
                })
            }
            Err(SuperblockError::Other(e)) => return Err(e),
        };
        Ok((early.map_or_else(|| Self::lock_dir(root), Ok)?, sb))
    }

    /// The store's lock, taken before anything of the store is read, if
    /// its lock file exists: a store another process is creating (or
    /// repairing) is then reported as in use ([`EngineError::Locked`]),
    /// not as missing its superblock. (A directory without one gets no
    /// lock file from a look at it.)
    fn lock_if_any(root: &Path) -> Result<Option<StoreDir>> {
        if root.join("lock").is_file() {
            Self::lock_dir(root).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Reads the superblock of the store this holds locked (as
    /// [`StoreDir::open`] checks it).
    ///
    /// Errors: as [`StoreDir::open`].
    pub fn superblock(&self) -> Result<Superblock> {
        read_superblock(&self.root).map_err(|e| match e {
            SuperblockError::Unreadable(detail) => EngineError::NotAStore {
                path: self.root.clone(),
                detail,
            },
            SuperblockError::Other(e) => e,
        })
    }

    /// Opens and locks the store at `root` for fsck: as [`StoreDir::open`],
    /// but a superblock that is missing or fails its checksum is returned
    /// as `Err(what is wrong)` instead of refusing the store, if the
    /// directory holds a store's `state.json` (a superblock of another
    /// format version or block size is refused as by `open`).
    ///
    /// Errors: as [`StoreDir::open`].
    pub fn open_for_repair(
        root: &Path,
    ) -> Result<(StoreDir, std::result::Result<Superblock, String>)> {
        Self::check_dir(root)?;
        let early = Self::lock_if_any(root)?;
        let sb = match read_superblock(root) {
            Ok(sb) => Ok(sb),
            Err(SuperblockError::Unreadable(detail))
                if root.join(MetaFile::State.relative_path()).is_file() =>
            {
                Err(detail)
            }
            Err(_) => {
                drop(early);
                return Self::open(root).map(|(dir, sb)| (dir, Ok(sb)));
            }
        };
        Ok((early.map_or_else(|| Self::lock_dir(root), Ok)?, sb))
    }

    fn check_dir(root: &Path) -> Result<()> {
        if !root.is_dir() {
            if root.exists() {
                return Err(EngineError::NotAStore {
                    path: root.to_path_buf(),
                    detail: "not a directory".into(),
                });
            }
            return Err(EngineError::NoStore(root.to_path_buf()));
        }
        Ok(())
    }

    fn lock_dir(root: &Path) -> Result<StoreDir> {
        // the owner checked after the lock when there is a lock file (a
        // store its owner's server holds is reached through that server's
        // control socket instead), before it when the lock would create one
        let had_lock_file = root.join("lock").is_file();
        if !had_lock_file {
            check_owner(root)?;
        }
        let dir = StoreDir {
            root: root.to_path_buf(),
            _lock: lock(root)?,
            observer: crate::observe::Observer::default(),
        };
        if had_lock_file {
            check_owner(root)?;
        }
        Ok(dir)
    }

    /// Writes `sb` as the store's superblock (through a new file renamed
    /// over the old one, each step synced): a repair's rebuilt superblock.
    ///
    /// Errors: [`EngineError::Io`] naming the file.
    pub fn replace_superblock(&self, sb: &Superblock) -> Result<()> {
        let new = self.root.join("superblock.new");
        write_durable(&new, &encode_checked(sb))?;
        fs::rename(&new, self.root.join("superblock"))
            .map_err(|e| EngineError::io(format!("renaming {}", new.display()), e))?;
        sync_dir(&self.root)
    }

    /// Marks a format-1 store as of [`FORMAT_VERSION`]: writes `counters`
    /// (as the format-1 state held them) to `counters.json`, then `sb` with
    /// the new version to `superblock.new`, each synced, and renames the
    /// latter over `superblock` (a crash leaves the old superblock or the
    /// new one, both valid for this build; a format-1 store's
    /// `counters.json` is ignored), syncing the directory after each step.
    ///
    /// Errors: [`EngineError::Io`] naming the file (e.g. ENOSPC); the old
    /// superblock is then still in place.
    pub fn upgrade_format(&self, sb: &Superblock, counters: &CounterState) -> Result<()> {
        write_durable(
            &self.path(MetaFile::Counters),
            &encode_checked_compact(counters),
        )?;
        sync_dir(&self.root)?;
        let new = Superblock {
            format_version: FORMAT_VERSION,
            ..sb.clone()
        };
        let tmp = self.root.join("superblock.new");
        write_durable(&tmp, &encode_checked(&new))?;
        let path = self.root.join("superblock");
        fs::rename(&tmp, &path)
            .map_err(|e| EngineError::io(format!("renaming {} into place", tmp.display()), e))?;
        sync_dir(&self.root)
    }

    /// The observer set by [`StoreDir::set_observer`].
    pub fn observer(&self) -> crate::observe::Observer {
        self.observer.clone()
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

    /// An anonymous scratch file in the store's directory, its own for
    /// each call (passes running at once never share one), with no name
    /// (`O_TMPFILE`; where the file system lacks it, a unique name
    /// unlinked at once), so nothing is left behind after a crash; `None`
    /// if it cannot be created (read-only or full file system).
    pub fn scratch_file(&self) -> Option<File> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Ok(f) = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(0o600)
            .open(&self.root)
        {
            return Some(f);
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        for _ in 0..16 {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = self
                .root
                .join(format!("scratch.{}.{n}.tmp", std::process::id()));
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&p)
            {
                Ok(f) => return fs::remove_file(&p).ok().map(|()| f),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(_) => return None,
            }
        }
        None
    }

    /// An unlinked file standing in for the store's missing `what` (a
    /// check creates nothing in the store; see [`StoreDir::scratch_file`]).
    ///
    /// Errors: [`EngineError::Io`] if no file can be created there.
    pub fn stand_in(&self, what: &str) -> Result<File> {
        self.scratch_file().ok_or_else(|| {
            EngineError::io(
                format!("creating a stand-in for the missing {what}"),
                io::Error::other("cannot create a file in the store"),
            )
        })
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

    /// The bytes of the small file `file` (`state.json` or
    /// `counters.json`, [`MetaFile::is_blob`]) as the journal operations
    /// `ops` (in order; those on other files are skipped) leave it: the
    /// file's content (empty if missing) with every write, length change,
    /// replacement and removal applied.
    ///
    /// Errors: reading the file; [`EngineError::Corrupt`] for a page patch
    /// of it (never written: these files are replaced whole).
    pub fn blob_bytes<'o>(
        &self,
        file: MetaFile,
        ops: impl IntoIterator<Item = &'o Op>,
    ) -> Result<Vec<u8>> {
        let p = self.path(file);
        let mut bytes = read_small(&p, STATE_MAX_BYTES)?.unwrap_or_default();
        for op in ops.into_iter().filter(|op| op.file() == file) {
            match op {
                // replaced whole, never patched: a patch's offset counts
                // page payload bytes, meaningless here
                Op::Patch { .. } => {
                    return Err(EngineError::Corrupt {
                        file: self.root.join("journal"),
                        detail: format!("a page patch of {}", file.relative_path()),
                    })
                }
                Op::Write { offset, data, .. } => {
                    let (at, end) = (*offset as usize, *offset as usize + data.len());
                    if bytes.len() < end {
                        bytes.resize(end, 0);
                    }
                    bytes[at..end].copy_from_slice(data);
                }
                Op::Replace { data, .. } => bytes = data.clone(),
                Op::SetLen { len_bytes, .. } => bytes.resize(*len_bytes as usize, 0),
                Op::Remove { .. } => bytes.clear(),
            }
        }
        Ok(bytes)
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
                    let created = !path.exists();
                    dir_changed |= created;
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&path)
                        .map_err(|e| EngineError::io(ctx("opening"), e))?;
                    if created {
                        self.observer
                            .emit(crate::observe::IoEvent::Create { file: &name(file) });
                    }
                    e.insert(f)
                }
            };
            let n = name(file);
            let obs = &self.observer;
            let planned = match op {
                Op::Write { offset, data, .. } => crate::observe::IoEvent::Write {
                    file: &n,
                    offset: *offset,
                    data,
                },
                Op::Replace { data, .. } => crate::observe::IoEvent::Write {
                    file: &n,
                    offset: 0,
                    data,
                },
                Op::SetLen { len_bytes, .. } => crate::observe::IoEvent::SetLen {
                    file: &n,
                    len_bytes: *len_bytes,
                },
                Op::Patch { .. } | Op::Remove { .. } => crate::observe::IoEvent::Write {
                    file: &n,
                    offset: 0,
                    data: &[],
                },
            };
            obs.check(planned)
                .map_err(|e| EngineError::io(ctx("writing"), e))?;
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
            let n = name(*file);
            self.observer
                .check(crate::observe::IoEvent::Sync { file: &n })
                .and_then(|()| f.sync_all())
                .map_err(|e| {
                    EngineError::io(format!("syncing {}", self.path(*file).display()), e)
                })?;
            self.observer
                .emit(crate::observe::IoEvent::Sync { file: &name(*file) });
        }
        // also when only existing files were written: a file this batch
        // found in place may have been created by an open since the last
        // sync of its directory (its entry not yet durable), and the
        // journal is restarted after this
        if dir_changed || !open.is_empty() {
            self.sync_dir_observed("maps")?;
            self.sync_dir_observed("")?;
        }
        Ok(())
    }

    /// Syncs the store's directory `rel` (`""` for the store itself,
    /// `maps`), reporting it to the observer.
    ///
    /// Errors: I/O.
    pub fn sync_dir_observed(&self, rel: &str) -> Result<()> {
        sync_dir(&self.root.join(rel))?;
        self.observer
            .emit(crate::observe::IoEvent::SyncDir { dir: rel });
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

/// Refuses a store directory another user owns when running as root
/// ([`EngineError::ForeignOwner`]).
fn check_owner(root: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let owner_uid = fs::metadata(root)
        .map_err(|e| EngineError::io(format!("reading {}", root.display()), e))?
        .uid();
    if owner_uid == 0 {
        Ok(())
    } else {
        Err(EngineError::ForeignOwner {
            path: root.to_path_buf(),
            owner_uid,
        })
    }
}

/// The process holding the lock of the store at `root`: its PID (which
/// the holder writes into the lock file) and command line (arguments
/// joined by spaces; empty if unreadable). The PID counts only if the
/// kernel's table of locks (`/proc/locks`) shows that process holding a
/// `flock` on the lock file's inode (by inode number alone: on btrfs the
/// table's device is not the one `stat` gives). `None` if the store is not
/// locked, or where either cannot be read.
pub fn lock_holder(root: &Path) -> Option<(u32, String)> {
    use std::os::unix::fs::MetadataExt;
    let path = root.join("lock");
    let ino = std::fs::metadata(&path).ok()?.ino();
    let pid: u32 = std::fs::read_to_string(&path)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&p| p > 0)?;
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
    let (pid_text, ino_suffix) = (pid.to_string(), format!(":{ino}"));
    let held = table.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 6 && f[1] == "FLOCK" && f[4] == pid_text && f[5].ends_with(&ino_suffix)
    });
    if !held {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Some((pid, cmdline))
}

fn lock(root: &Path) -> Result<File> {
    let p = root.join("lock");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .map_err(|e| {
            let why = match e.raw_os_error() {
                Some(libc::EROFS) => {
                    " (the store is on a read-only file system; every command that \
                     opens a store, fsck included, needs it writable: opening takes \
                     a lock file and rebuilds the on-disk fingerprint store)"
                }
                Some(libc::EACCES) | Some(libc::EPERM) => {
                    " (every command that opens a store, fsck included, needs to \
                     write in its directory: run it as the store's owner, or give \
                     this user write access to the store)"
                }
                _ => "",
            };
            EngineError::io(format!("opening {}{why}", p.display()), e)
        })?;
    // SAFETY: flock on a file descriptor we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // only another holder is "in use"; any other failure (a file
        // system without flock: ENOSYS, ENOLCK) is named as it is
        if e.kind() == std::io::ErrorKind::WouldBlock {
            return Err(EngineError::Locked(root.to_path_buf()));
        }
        return Err(EngineError::io(
            format!(
                "locking {} (the store's file system must support flock)",
                p.display()
            ),
            e,
        ));
    }
    // the holder's PID, for the message of a process refused the store
    // ([`lock_holder`]); best effort
    let _ = f
        .set_len(0)
        .and_then(|()| f.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0));
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
const NO_SUPERBLOCK: &str = "no superblock file";

/// Why a superblock could not be used.
enum SuperblockError {
    /// Missing, too long, or failing its checksum or decoding: damage a
    /// repair may undo.
    Unreadable(String),
    /// Readable but not of a store this build serves (magic, version,
    /// block size), or an I/O error.
    Other(EngineError),
}

/// Reads and checks `<root>/superblock`.
fn read_superblock(root: &Path) -> std::result::Result<Superblock, SuperblockError> {
    let sb_path = root.join("superblock");
    let bytes = match read_small(&sb_path, SUPERBLOCK_MAX_BYTES) {
        Ok(Some(b)) => b,
        Ok(None) => return Err(SuperblockError::Unreadable(NO_SUPERBLOCK.into())),
        Err(EngineError::Corrupt { detail, .. }) => {
            return Err(SuperblockError::Unreadable(detail))
        }
        Err(e) => return Err(SuperblockError::Other(e)),
    };
    let sb: Superblock = decode_checked(&bytes, &sb_path).map_err(|e| match e {
        EngineError::Corrupt { detail, .. } => SuperblockError::Unreadable(detail),
        other => SuperblockError::Other(other),
    })?;
    let not_a_store = |detail: String| {
        SuperblockError::Other(EngineError::NotAStore {
            path: root.to_path_buf(),
            detail,
        })
    };
    if sb.magic != SUPERBLOCK_MAGIC {
        return Err(not_a_store("wrong superblock magic".into()));
    }
    if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&sb.format_version) {
        return Err(not_a_store(format!(
            "format version {} (this build reads {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})",
            sb.format_version
        )));
    }
    if sb.block_size as usize != BLOCK_SIZE {
        return Err(not_a_store(format!("block size {}", sb.block_size)));
    }
    Ok(sb)
}

/// Largest `superblock` read (it holds a few dozen bytes of JSON).
pub const SUPERBLOCK_MAX_BYTES: u64 = 1 << 20;
/// Largest `state.json` or `counters.json` read (the volume table: about
/// 200 bytes per volume).
pub const STATE_MAX_BYTES: u64 = 256 << 20;

/// The bytes of the small metadata file at `path`, `None` if it does not
/// exist. A file longer than `max_bytes` (a damaged length: a long hole,
/// say) is refused instead of read into memory.
///
/// Errors: [`EngineError::Io`] reading it; [`EngineError::Corrupt`] naming
/// it if it is longer than `max_bytes`.
pub fn read_small(path: &Path, max_bytes: u64) -> Result<Option<Vec<u8>>> {
    let io_err = |e| EngineError::io(format!("reading {}", path.display()), e);
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    let len = f.metadata().map_err(io_err)?.len();
    if len > max_bytes {
        return Err(EngineError::Corrupt {
            file: path.to_path_buf(),
            detail: format!("{len} bytes long, more than the {max_bytes} it can hold"),
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    io::Read::read_to_end(&mut io::Read::take(f, max_bytes + 1), &mut bytes).map_err(io_err)?;
    if bytes.len() as u64 > max_bytes {
        return Err(EngineError::Corrupt {
            file: path.to_path_buf(),
            detail: format!("more than the {max_bytes} bytes it can hold"),
        });
    }
    Ok(Some(bytes))
}

/// fsync the directory `path`, so that files created, renamed or removed
/// in it stay so after a crash.
///
/// # Errors
/// [`EngineError::Io`] naming `path` if it cannot be opened or synced.
pub fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| EngineError::io(format!("syncing directory {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_being_created_by_another_process_is_in_use_not_half_made() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("s");
        // another dedupd's create: lock held, its first files made
        fs::create_dir_all(root.join("maps")).unwrap();
        let other = lock(&root).unwrap();
        fs::write(root.join("journal"), b"").unwrap();
        let r = StoreDir::create(&root, HashAlgorithm::Sha256, 16).map(|_| ());
        assert!(matches!(r, Err(EngineError::Locked(_))), "{r:?}");
        drop(other);
        // once it is gone, what it left is not taken for an empty directory
        let r = StoreDir::create(&root, HashAlgorithm::Sha256, 16).map(|_| ());
        assert!(matches!(r, Err(EngineError::NotAStore { .. })), "{r:?}");
        // a lone lock file (a create stopped right after locking) is no
        // obstacle, and a directory that is not empty gets no lock file
        let lone = d.path().join("lone");
        fs::create_dir(&lone).unwrap();
        drop(lock(&lone).unwrap());
        drop(StoreDir::create(&lone, HashAlgorithm::Sha256, 16).unwrap());
        StoreDir::open(&lone).unwrap();
        let mine = d.path().join("mine");
        fs::create_dir(&mine).unwrap();
        fs::write(mine.join("notes"), b"x").unwrap();
        assert!(StoreDir::create(&mine, HashAlgorithm::Sha256, 16).is_err());
        assert!(!mine.join("lock").exists());
    }

    #[test]
    fn a_held_lock_is_in_use_and_free_again_once_released() {
        // (flock through a second descriptor of the same process fails
        // with EWOULDBLOCK, as against another process)
        let d = tempfile::tempdir().unwrap();
        let held = lock(d.path()).unwrap();
        assert!(matches!(lock(d.path()), Err(EngineError::Locked(_))));
        // the holder is found in the kernel's table of locks
        let (pid, cmdline) = lock_holder(d.path()).expect("a holder");
        assert_eq!(pid, std::process::id());
        assert!(!cmdline.is_empty());
        drop(held);
        assert_eq!(lock_holder(d.path()), None);
        lock(d.path()).unwrap();
    }

    #[test]
    fn a_store_of_another_user_is_refused_to_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("s");
        drop(StoreDir::create(&root, HashAlgorithm::Sha256, 16).unwrap());
        // one's own store opens
        StoreDir::open(&root).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // as root, another user's store is refused, files unchanged
            std::os::unix::fs::chown(&root, Some(65534), None).unwrap();
            let before: Vec<_> = fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            let r = StoreDir::open(&root).map(|_| ());
            assert!(
                matches!(
                    r,
                    Err(EngineError::ForeignOwner {
                        owner_uid: 65534,
                        ..
                    })
                ),
                "{r:?}"
            );
            assert!(r
                .unwrap_err()
                .to_string()
                .contains("run dedupd as that user"));
            let after: Vec<_> = fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            assert_eq!(before, after);
            // nor is a lock file made where there was none
            fs::remove_file(root.join("lock")).unwrap();
            assert!(StoreDir::open(&root).is_err());
            assert!(!root.join("lock").exists(), "root made the lock file");
            let empty = d.path().join("empty");
            fs::create_dir(&empty).unwrap();
            std::os::unix::fs::chown(&empty, Some(65534), None).unwrap();
            assert!(matches!(
                StoreDir::create(&empty, HashAlgorithm::Sha256, 16),
                Err(EngineError::ForeignOwner { .. })
            ));
            assert_eq!(fs::read_dir(&empty).unwrap().count(), 0);
        }
    }

    #[test]
    fn a_store_another_process_is_creating_is_in_use_not_broken() {
        // its lock taken, its superblock not written yet
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("s");
        fs::create_dir_all(root.join("maps")).unwrap();
        let held = lock(&root).unwrap();
        for r in [
            StoreDir::open(&root).map(|_| ()),
            StoreDir::open_for_repair(&root).map(|_| ()),
        ] {
            assert!(matches!(r, Err(EngineError::Locked(_))), "{r:?}");
        }
        drop(held);
        assert!(matches!(
            StoreDir::open(&root),
            Err(EngineError::NotAStore { .. })
        ));
    }

    #[test]
    fn a_value_written_as_it_is_made_reads_back_as_an_encoded_one() {
        let value: Vec<(u32, u64)> = (0..10_000).map(|i| (i, u64::from(i) * 7)).collect();
        let mut streamed = Vec::new();
        write_checked_compact(&value, &mut streamed).unwrap();
        assert_eq!(streamed, encode_checked_compact(&value));
        let back: Vec<(u32, u64)> = decode_checked(&streamed, Path::new("t")).unwrap();
        assert_eq!(back, value);
    }

    #[test]
    fn scratch_files_are_each_their_own_and_leave_nothing_behind() {
        let d = tempfile::tempdir().unwrap();
        let dir = StoreDir::create(&d.path().join("s"), HashAlgorithm::Sha256, 16).unwrap();
        let before: Vec<_> = fs::read_dir(dir.root()).unwrap().collect();
        let (a, b) = (dir.scratch_file().unwrap(), dir.scratch_file().unwrap());
        a.write_all_at(&[1u8; 4096], 0).unwrap();
        b.write_all_at(&[2u8; 100], 0).unwrap();
        let mut back = [0u8; 4096];
        a.read_exact_at(&mut back, 0).unwrap();
        assert!(
            back.iter().all(|&x| x == 1),
            "two scratch files share one inode"
        );
        assert_eq!(b.metadata().unwrap().len(), 100);
        assert_eq!(fs::read_dir(dir.root()).unwrap().count(), before.len());
    }

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
    fn state_bytes_follow_the_journal() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path().join("s");
        let dir = StoreDir::create(&s, HashAlgorithm::Sha256, 16).unwrap();
        let before = dir.blob_bytes(MetaFile::State, &[]).unwrap();
        let ops = [
            Op::Replace {
                file: MetaFile::State,
                data: b"{\"a\":1}".to_vec(),
            },
            Op::Replace {
                file: MetaFile::Refcounts,
                data: b"other file".to_vec(),
            },
            Op::Write {
                file: MetaFile::State,
                offset: 5,
                data: b"2}".to_vec(),
            },
        ];
        assert_eq!(
            dir.blob_bytes(MetaFile::State, &ops).unwrap(),
            b"{\"a\":2}".to_vec()
        );
        assert_eq!(dir.blob_bytes(MetaFile::State, &ops[1..2]).unwrap(), before);
        let removed = [Op::Remove {
            file: MetaFile::State,
        }];
        assert!(dir
            .blob_bytes(MetaFile::State, &removed)
            .unwrap()
            .is_empty());
        // a page patch of the state is refused, not applied as a write
        let patch = [Op::Patch {
            file: MetaFile::State,
            offset: 0,
            data: b"x".to_vec(),
        }];
        assert!(matches!(
            dir.blob_bytes(MetaFile::State, &patch),
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
}
