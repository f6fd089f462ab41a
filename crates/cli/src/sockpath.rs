//! Unix socket paths of any length.
//!
//! A Unix socket address holds at most 107 bytes of path (`sun_path`, 108
//! bytes with its NUL), so a store in a deep directory could not bind or
//! reach `<store>/control.sock` by name. A longer path is used through an
//! open descriptor of its directory instead: `/proc/self/fd/N/NAME` names
//! the same file, and the kernel follows the descriptor's link when it
//! binds or connects.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Longest path that fits a Unix socket address, in bytes.
const SUN_PATH_MAX_BYTES: usize = 107;

/// An address for the Unix socket at a path, short enough to bind or
/// connect to. Holds the directory descriptor its address goes through,
/// if any: keep it alive while binding or connecting.
#[derive(Debug)]
pub struct SocketPath {
    addr: PathBuf,
    _dir: Option<File>,
}

impl SocketPath {
    /// The address of the socket at `path`: `path` itself if it fits,
    /// else `/proc/self/fd/N/NAME` through a descriptor of its directory.
    ///
    /// Errors: a long path whose directory cannot be opened (missing, no
    /// permission), or whose file name alone does not fit.
    pub fn new(path: &Path) -> io::Result<Self> {
        if path.as_os_str().len() <= SUN_PATH_MAX_BYTES {
            return Ok(SocketPath {
                addr: path.to_path_buf(),
                _dir: None,
            });
        }
        let name = path.file_name().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: not a file path", path.display()),
            )
        })?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = File::open(parent)?;
        let addr = Path::new("/proc/self/fd")
            .join(std::os::fd::AsRawFd::as_raw_fd(&dir).to_string())
            .join(name);
        if addr.as_os_str().len() > SUN_PATH_MAX_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: the socket's file name is longer than a Unix socket address holds",
                    path.display()
                ),
            ));
        }
        Ok(SocketPath {
            addr,
            _dir: Some(dir),
        })
    }

    /// The path to bind or connect to.
    pub fn addr(&self) -> &Path {
        &self.addr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_socket_deeper_than_an_address_holds_binds_and_connects() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let path = deep.join("control.sock");
        assert!(path.as_os_str().len() > SUN_PATH_MAX_BYTES);
        // by name it cannot be bound
        assert!(UnixListener::bind(&path).is_err());
        let at = SocketPath::new(&path).unwrap();
        let listener = UnixListener::bind(at.addr()).unwrap();
        // the socket file is where it was asked for
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket());
        let mut c = UnixStream::connect(SocketPath::new(&path).unwrap().addr()).unwrap();
        c.write_all(b"x").unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }

    #[test]
    fn a_short_path_is_used_as_it_is() {
        let p = Path::new("/tmp/x/control.sock");
        assert_eq!(SocketPath::new(p).unwrap().addr(), p);
    }
}
