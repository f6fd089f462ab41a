//! Output files written whole or not at all: data goes to a temporary
//! file beside the destination, which replaces the destination only once
//! complete and synced. A failed or interrupted conversion or generation
//! leaves an existing file as it was. An output that is one of the
//! inputs is refused before any work ([`check_destination`]).
//!
//! The temporary file is anonymous (`O_TMPFILE`) until it is complete, so
//! a process killed or interrupted by a signal meanwhile leaves nothing
//! behind; it is then linked under a unique hidden name and renamed over
//! the destination. Where the file system lacks `O_TMPFILE`, it is a named
//! hidden file (`.dedupd-output-*`) from the start (also where `/proc` is
//! missing), removed on error but
//! not after a signal.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{io_err, Result};

/// A file being written for `path`.
#[derive(Debug)]
pub(crate) struct OutputFile {
    tmp: Temporary,
    path: PathBuf,
    name: String,
}

/// Where the data goes until it is complete.
#[derive(Debug)]
enum Temporary {
    /// Anonymous (`O_TMPFILE`) in this directory.
    Anonymous { file: File, dir: PathBuf },
    /// Named, beside the destination.
    Named(tempfile::NamedTempFile),
}

/// Prefix of the hidden names temporary files take in the destination's
/// directory.
const TEMPORARY_PREFIX: &str = ".dedupd-output-";

/// An anonymous file in `dir` (mode 0666 less the umask, as an ordinary
/// new file), or `None` where the file system cannot make one, or where
/// it could not be linked when complete (no `/proc`: a chroot or a bare
/// container).
fn anonymous_in(dir: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    if !Path::new("/proc/self/fd").is_dir() {
        return None;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o666)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)
        .ok()
}

/// Links the anonymous `file` into `dir` under a new unique hidden name,
/// which it returns.
fn link_anonymous(file: &File, dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::AsRawFd;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .expect("no NUL in a number");
    loop {
        let to = dir.join(format!("{TEMPORARY_PREFIX}{:016x}", rand::random::<u64>()));
        let to_c = std::ffi::CString::new(to.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: two NUL-terminated paths that outlive the call.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to_c.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc == 0 {
            return Ok(to);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(e);
        }
    }
}

impl OutputFile {
    /// Starts writing `path` (a temporary file in its directory).
    ///
    /// Errors: the directory is missing or not writable.
    pub(crate) fn create(path: &Path) -> Result<OutputFile> {
        // (a missing directory named as such, not by a temporary name)
        check_destination(path, &[])?;
        let name = path.display().to_string();
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = match anonymous_in(dir) {
            Some(file) => Temporary::Anonymous {
                file,
                dir: dir.to_path_buf(),
            },
            None => {
                let mut builder = tempfile::Builder::new();
                builder.prefix(TEMPORARY_PREFIX);
                // as an ordinary new file: 0666 less the umask (a temporary
                // file's default, 0600, would hide results from other users)
                builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
                Temporary::Named(builder.tempfile_in(dir).map_err(io_err(&name))?)
            }
        };
        Ok(OutputFile {
            tmp,
            path: path.to_path_buf(),
            name,
        })
    }

    /// The destination's path as given (for messages).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A handle to write the temporary file through.
    ///
    /// Errors: the descriptor cannot be duplicated.
    pub(crate) fn file(&self) -> Result<File> {
        self.handle().try_clone().map_err(io_err(&self.name))
    }

    fn handle(&self) -> &File {
        match &self.tmp {
            Temporary::Anonymous { file, .. } => file,
            Temporary::Named(t) => t.as_file(),
        }
    }

    /// Syncs the temporary file and renames it over the destination.
    ///
    /// Errors: syncing or renaming fails (the destination is unchanged).
    pub(crate) fn commit(self) -> Result<()> {
        self.handle().sync_all().map_err(io_err(&self.name))?;
        match self.tmp {
            Temporary::Anonymous { file, dir } => {
                let linked = link_anonymous(&file, &dir).map_err(io_err(&self.name))?;
                if let Err(e) = std::fs::rename(&linked, &self.path) {
                    let _ = std::fs::remove_file(&linked);
                    return Err(io_err(&self.name)(e));
                }
            }
            Temporary::Named(t) => {
                t.persist(&self.path)
                    .map_err(|e| e.error)
                    .map_err(io_err(&self.name))?;
            }
        }
        sync_parent(&self.path).map_err(io_err(&self.name))
    }
}

/// Syncs the directory holding `path`, so a rename into it is durable.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Writes `bytes` to `path` whole or not at all (a temporary file renamed
/// over it): an interrupted write leaves an existing file as it was.
///
/// Errors: I/O, naming `path`.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    let out = OutputFile::create(path)?;
    std::io::Write::write_all(&mut out.file()?, bytes).map_err(io_err(out.name()))?;
    out.commit()
}

/// Checks before any work that `path` can take an output file: its
/// directory exists, it is not a directory itself, and it is none of
/// `inputs` (an output written over the trace it was made from would
/// destroy it): not the same file by device and inode (a hard or symbolic
/// link to an input is the input), nor, where either does not exist, the
/// same path ([`crate::input::same_file`]).
///
/// Errors: [`crate::error::TraceError::Config`] naming `path` and the reason.
pub fn check_destination(path: &Path, inputs: &[PathBuf]) -> Result<()> {
    let name = path.display();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(crate::error::TraceError::Config(format!(
            "{name}: directory {} does not exist",
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(crate::error::TraceError::Config(format!(
            "{name}: is a directory"
        )));
    }
    for input in inputs {
        if crate::input::same_file(path, input) {
            return Err(crate::error::TraceError::Config(format!(
                "{name}: is an input ({}); not writing over it",
                input.display()
            )));
        }
    }
    Ok(())
}

/// Runs `write` on a temporary path beside `path` (with its extension),
/// then renames the result over `path`: for writers that take a path
/// (the plotting backends). A failure leaves `path` as it was.
///
/// Errors: those of `write`; renaming.
pub fn write_via_temporary(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.display().to_string();
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".dedupd-output-{}-{file_name}", std::process::id()));
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path)
            .and_then(|()| sync_parent(path))
            .map_err(io_err(&name))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's umask, from `/proc/self/status` (Linux).
    fn umask() -> Option<u32> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("Umask:"))?;
        u32::from_str_radix(line.split_whitespace().nth(1)?, 8).ok()
    }

    #[test]
    fn destinations_are_checked_before_any_work() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.ddt");
        std::fs::write(&input, b"x").unwrap();
        std::fs::hard_link(&input, dir.path().join("hard.ddt")).unwrap();
        std::os::unix::fs::symlink(&input, dir.path().join("soft.ddt")).unwrap();
        let inputs = [input.clone()];
        assert!(check_destination(&dir.path().join("r.json"), &inputs).is_ok());
        for (bad, why) in [
            (input.clone(), "is an input"),
            (dir.path().join("./in.ddt"), "is an input"),
            (dir.path().join("hard.ddt"), "is an input"),
            (dir.path().join("soft.ddt"), "is an input"),
            (dir.path().join("nodir/r.json"), "does not exist"),
            (dir.path().to_path_buf(), "is a directory"),
        ] {
            let e = check_destination(&bad, &inputs).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert_eq!(std::fs::read(&input).unwrap(), b"x");
        // an output file started in a missing directory says so
        let e = match OutputFile::create(&dir.path().join("nodir/out.ddt")) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("an output file in a missing directory"),
        };
        assert!(
            e.contains("directory") && e.contains("does not exist"),
            "{e}"
        );
        assert!(!e.contains(TEMPORARY_PREFIX), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn output_files_get_an_ordinary_files_mode() {
        use std::os::unix::fs::PermissionsExt;
        let Some(mask) = umask() else {
            panic!("no Umask line in /proc/self/status");
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.csv");
        write_whole(&path, b"a,b\n").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !mask);
        assert_eq!(std::fs::read(&path).unwrap(), b"a,b\n");
    }

    #[test]
    fn an_unfinished_output_has_no_name_and_a_finished_one_replaces_the_destination() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.ddt");
        std::fs::write(&path, b"old").unwrap();
        let names = || -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        // a process killed while it writes runs no destructor: nothing of
        // the unfinished file may be left under a name
        let out = OutputFile::create(&path).unwrap();
        std::io::Write::write_all(&mut out.file().unwrap(), b"partial").unwrap();
        assert!(matches!(out.tmp, Temporary::Anonymous { .. }), "{out:?}");
        std::mem::forget(out);
        assert_eq!(names(), ["out.ddt"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let out = OutputFile::create(&path).unwrap();
        std::io::Write::write_all(&mut out.file().unwrap(), b"new").unwrap();
        out.commit().unwrap();
        assert_eq!(names(), ["out.ddt"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
    }
}
