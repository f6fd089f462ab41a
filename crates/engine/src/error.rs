//! Errors of the engine.

use std::path::PathBuf;

/// Everything an engine operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An I/O error of the backing files; `context` says what was being done.
    #[error("{context}: {cause}")]
    Io {
        /// What the engine was doing.
        context: String,
        /// The operating system's error (part of the message, so not also
        /// given as the error's source: a chain would print it twice).
        cause: std::io::Error,
    },
    /// The backing file system is full. Stored data and metadata are intact;
    /// reads keep working.
    #[error("no space left on the backing file system ({context})")]
    NoSpace {
        /// What the engine was doing.
        context: String,
    },
    /// The directory does not exist.
    #[error("store {0} does not exist (create it with `dedupd init` or `dedupd serve`)")]
    NoStore(PathBuf),
    /// A store already exists where a new one was to be created.
    #[error("a dedupd store already exists at {0}")]
    StoreExists(PathBuf),
    /// The path exists but is not a dedupd store (not a directory, or no or
    /// foreign superblock).
    #[error("{path} is not a dedupd store: {detail}")]
    NotAStore {
        /// The path given.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A metadata file fails its checksum or is malformed, or the data
    /// file is missing or cut short while blocks are referenced.
    #[error("store file {file} is damaged: {detail}")]
    Corrupt {
        /// The damaged file.
        file: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Another process holds the store open.
    #[error("store {0} is in use by another dedupd process")]
    Locked(PathBuf),
    /// dedupd runs as root on a store another user owns: the files it
    /// would create there (maps, journal, state) would belong to root,
    /// and the store's owner could no longer open them.
    #[error(
        "store {path} belongs to user {owner_uid}, and dedupd runs as root here: files it \
         creates in the store would belong to root, which that user could not open; run \
         dedupd as that user (e.g. `sudo -u '#{owner_uid}' dedupd ...`)"
    )]
    ForeignOwner {
        /// The store directory.
        path: PathBuf,
        /// Its owner's user id.
        owner_uid: u32,
    },
    /// No volume has this name.
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    /// A volume with this name exists already.
    #[error("a volume named {0:?} exists already")]
    VolumeExists(String),
    /// The volume's delete began and has not finished (a delete running,
    /// or one cut short by a crash or an error): it is read-only until it
    /// is finished.
    #[error(
        "volume {0:?} is being deleted (if no delete is running, one was cut short: finish it with `dedupd volume delete {0}`)"
    )]
    VolumeDeleting(String),
    /// A resize of a volume while a shrink of it runs (it would be undone
    /// or overtaken when the shrink ends).
    #[error(
        "volume {name:?} is being shrunk to {to_bytes} bytes: resize it again once that finishes"
    )]
    VolumeShrinking {
        /// The volume's name.
        name: String,
        /// The size the running shrink gives it, in bytes.
        to_bytes: u64,
    },
    /// A request reaches past the end of its volume.
    #[error("request at byte {offset} of length {len} is past the end of the volume ({size_bytes} bytes)")]
    OutOfRange {
        /// Byte offset of the request.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Volume size in bytes.
        size_bytes: u64,
    },
    /// The volume's metadata failed its checksums (or its map is missing
    /// or cut short); it is served read-only until `dedupd fsck --repair`.
    #[error("volume {volume:?} is read-only: its metadata is damaged (run `{fsck_command}`)")]
    ReadOnly {
        /// The volume's name.
        volume: String,
        /// The repair to run, naming the store (`dedupd --store PATH fsck
        /// --repair`).
        fsck_command: String,
    },
    /// A read of an LBA whose mapping was lost when the store opened (on a
    /// map page that failed its checksum, past the end of a truncated map,
    /// or in a missing map): its data cannot be told, so it is not read as
    /// zeros. `dedupd fsck --repair` lists such LBAs as lost and unmaps
    /// them.
    #[error(
        "volume {volume:?}: LBA {lba}'s mapping is on damaged metadata, so its data cannot be \
         read (run `dedupd fsck`, which lists the LBAs lost)"
    )]
    MappingLost {
        /// The volume's name.
        volume: String,
        /// The first LBA of the request whose mapping was lost.
        lba: u64,
    },
    /// A volume-map or reference-count page could not be read back from its
    /// file while serving (I/O error or checksum mismatch). The store stops
    /// writing and committing until restarted (reads of other pages keep
    /// working); what was committed before stays intact, and the next start
    /// checks every page and names the damaged file.
    #[error(
        "metadata unreadable: {0}; the store is read-only until restarted (then run `dedupd fsck`)"
    )]
    MetadataUnreadable(String),
    /// Syncing the data file failed once. Linux may drop the pages whose
    /// writeback failed and report success to the next sync, so a later
    /// commit could point maps at blocks never stored: the engine refuses
    /// writes, flushes and out-of-line dedup from then on (reads keep
    /// working) until restarted; the restart recovers the last committed
    /// state (writes not flushed before the failure may read back old).
    #[error(
        "the data file could not be synced ({0}); writes are refused until dedupd is restarted, which recovers the last committed state"
    )]
    DataSyncFailed(String),
    /// An argument is not acceptable (bad name, size not a multiple of 4 KiB, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// A partial-block write found its block rewritten by other writes
    /// during every one of its read-modify-write attempts; nothing was
    /// written (retrying is safe).
    #[error("busy: {0}")]
    Busy(String),
    /// A full offline dedup pass was asked for while another runs (one at
    /// a time: each takes about the index budget's memory again).
    #[error("an offline dedup pass is running already; run this one after it has finished")]
    OfflinePassRunning,
}

impl EngineError {
    /// Wraps an I/O error with what was being done; ENOSPC and EDQUOT become
    /// [`EngineError::NoSpace`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let context = context.into();
        match source.raw_os_error() {
            // (EFBIG: the data file reached the file system's largest
            // file; NBD asks for ENOSPC there too)
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => {
                EngineError::NoSpace { context }
            }
            _ if source.kind() == std::io::ErrorKind::StorageFull => {
                EngineError::NoSpace { context }
            }
            _ => EngineError::Io {
                context,
                cause: source,
            },
        }
    }
}

/// Result of engine operations.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// `s` as one word for a POSIX shell: as is if it holds only characters a
/// shell leaves alone (and does not start with `~` or `=`, which shells
/// expand there), else in single quotes. For the commands messages
/// suggest (`dedupd --store PATH fsck --repair`).
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && !s.starts_with(['~', '='])
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~/+,:=@%".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// A store path as a shell word ([`shell_quote`]).
pub(crate) fn store_word(path: &std::path::Path) -> String {
    shell_quote(&path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_words_are_quoted_where_a_shell_would_change_them() {
        assert_eq!(shell_quote("dedupd-store"), "dedupd-store");
        assert_eq!(shell_quote("/tmp/a_b/c.d"), "/tmp/a_b/c.d");
        assert_eq!(shell_quote("sp ace"), "'sp ace'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote("~/x"), "'~/x'");
        assert_eq!(shell_quote("=x"), "'=x'");
        assert_eq!(shell_quote("a?b*"), "'a?b*'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn a_full_file_system_or_file_is_no_space() {
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EFBIG] {
            let e = EngineError::io("writing", std::io::Error::from_raw_os_error(errno));
            assert!(matches!(e, EngineError::NoSpace { .. }), "{errno}: {e:?}");
        }
        let e = EngineError::io("writing", std::io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(e, EngineError::Io { .. }), "{e:?}");
    }
}
