//! Observation of the changes the engine makes to its metadata, journal
//! and data files, for crash testing: a recorder sees each write, length
//! change, creation, removal, file sync and directory sync in the order
//! they happen, and a test builds the states a crash could leave
//! (everything synced, plus any subset of what was not). Not reported:
//! the superblock and the skipped-buffer file (each written whole to a
//! new file, synced and renamed into place, then the store's directory
//! synced), the journal a repair makes anew (renamed over `journal`, then
//! the directory synced) and its removal by a repair that failed, the lock
//! and scratch files. A directory sync among those is not reported either:
//! a model built from these events may take an entry to be less durable
//! than it is, never more.
//!
//! File names are relative to the store directory (`data`, `journal`,
//! `maps/3`, …). The on-disk fingerprint store (`fpgroups`) is rebuilt at
//! every open and is not reported.

use std::path::Path;
use std::sync::Arc;

/// One change to a file of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEvent<'a> {
    /// `data` written at byte `offset` (not yet durable).
    Write {
        /// File, relative to the store.
        file: &'a str,
        /// Byte offset.
        offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// Length set to `len_bytes` (not yet durable).
    SetLen {
        /// File, relative to the store.
        file: &'a str,
        /// New length in bytes.
        len_bytes: u64,
    },
    /// The file was removed (its directory entry gone for good once the
    /// directory is synced: [`IoEvent::SyncDir`]).
    Remove {
        /// File, relative to the store.
        file: &'a str,
    },
    /// The file was created, empty (its directory entry durable once the
    /// directory is synced: [`IoEvent::SyncDir`]).
    Create {
        /// File, relative to the store.
        file: &'a str,
    },
    /// Every earlier creation and removal of a file in the directory is
    /// durable.
    SyncDir {
        /// Directory, relative to the store (`""` for the store itself,
        /// `maps`).
        dir: &'a str,
    },
    /// A sync of the file begins (reported for the data file, which
    /// request threads write while a commit syncs it): the changes
    /// reported before this are those the [`IoEvent::Sync`] that ends it
    /// makes durable.
    SyncStart {
        /// File, relative to the store.
        file: &'a str,
    },
    /// Every earlier change to the file is durable (for the data file:
    /// every change reported before its [`IoEvent::SyncStart`]).
    Sync {
        /// File, relative to the store.
        file: &'a str,
    },
}

/// Receives [`IoEvent`]s; called right after each operation succeeds.
pub trait IoObserver: Send + Sync {
    /// One event.
    fn event(&self, e: IoEvent<'_>);

    /// Asked before each write and sync of the journal and each write,
    /// length change and sync a checkpoint makes to the metadata files:
    /// an error returned here fails that operation as the file system's
    /// own would (fault injection in tests). Default: none.
    fn inject(&self, e: IoEvent<'_>) -> Option<std::io::Error> {
        let _ = e;
        None
    }
}

/// An optional observer, cheap to clone; the default observes nothing.
#[derive(Clone, Default)]
pub struct Observer(pub Option<Arc<dyn IoObserver>>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Observer(on)"
        } else {
            "Observer(off)"
        })
    }
}

impl Observer {
    /// Reports `e` if an observer is attached.
    pub fn emit(&self, e: IoEvent<'_>) {
        if let Some(o) = &self.0 {
            o.event(e);
        }
    }

    /// Fails with the observer's injected error for `e`, if any, before
    /// the operation `e` describes is made.
    pub fn check(&self, e: IoEvent<'_>) -> std::io::Result<()> {
        match self.0.as_ref().and_then(|o| o.inject(e)) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Reports a write to `file` (a path under the store root `root`).
    pub fn write(&self, root: &Path, file: &Path, offset: u64, data: &[u8]) {
        if self.0.is_some() {
            let name = relative(root, file);
            self.emit(IoEvent::Write {
                file: &name,
                offset,
                data,
            });
        }
    }

    /// Reports a length change.
    pub fn set_len(&self, root: &Path, file: &Path, len_bytes: u64) {
        if self.0.is_some() {
            let name = relative(root, file);
            self.emit(IoEvent::SetLen {
                file: &name,
                len_bytes,
            });
        }
    }

    /// Reports a removal.
    pub fn remove(&self, root: &Path, file: &Path) {
        if self.0.is_some() {
            let name = relative(root, file);
            self.emit(IoEvent::Remove { file: &name });
        }
    }

    /// Reports a sync.
    pub fn sync(&self, root: &Path, file: &Path) {
        if self.0.is_some() {
            let name = relative(root, file);
            self.emit(IoEvent::Sync { file: &name });
        }
    }
}

fn relative(root: &Path, file: &Path) -> String {
    file.strip_prefix(root)
        .unwrap_or(file)
        .to_string_lossy()
        .into_owned()
}
