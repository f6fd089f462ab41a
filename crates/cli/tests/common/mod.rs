//! Shared harness of the end-to-end tests: start and stop `dedupd serve`,
//! run real client programs, fail clearly when one is missing.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Path of the `dedupd` binary under test.
pub fn dedupd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dedupd"))
}

/// Fails the test with a clear message if `tool` is not on PATH (the
/// project's test command installs every client the tests use).
pub fn require(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(found, "{tool} is not installed: run the README's test command (scripts/test.sh), which installs the real NBD clients");
}

/// Runs a command, returning its output; panics with stderr if it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `dedupd` with `args` against `store`.
pub fn dedupd(store: &Path, args: &[&str]) -> Output {
    Command::new(dedupd_bin())
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("running dedupd")
}

/// `dedupd stats --json` of `store` as JSON (works while serving).
pub fn stats(store: &Path) -> serde_json::Value {
    let out = run(Command::new(dedupd_bin())
        .arg("--store")
        .arg(store)
        .args(["stats", "--json"]));
    serde_json::from_slice(&out.stdout).expect("stats --json prints JSON")
}

/// A running `dedupd serve`, stopped with SIGTERM when dropped.
pub struct Server {
    child: Option<Child>,
    /// The store directory.
    pub store: PathBuf,
    /// TCP port it listens on.
    pub port: u16,
    /// Everything it printed before it was ready.
    pub banner: String,
}

impl Server {
    /// Starts `dedupd serve` on 127.0.0.1 (a free port) with extra `args`,
    /// and waits until it listens.
    pub fn start(store: &Path, args: &[&str]) -> Server {
        Server::start_via(&[], store, args)
    }

    /// [`Server::start`] run by the command `launcher` (e.g. `nohup`)
    /// given dedupd's command line, if not empty.
    pub fn start_via(launcher: &[&str], store: &Path, args: &[&str]) -> Server {
        let mut command = match launcher.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(dedupd_bin());
                c
            }
            None => Command::new(dedupd_bin()),
        };
        // (the test's own dispositions are not the server's: started under
        // nohup, the tests would hand it an ignored SIGHUP)
        // SAFETY: signal() is async-signal-safe, as pre_exec requires.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                libc::signal(libc::SIGHUP, libc::SIG_DFL);
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = command
            .arg("--store")
            .arg(store)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting dedupd serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut banner = String::new();
        let mut port = None;
        for line in lines.by_ref() {
            let line = line.expect("reading dedupd output");
            banner.push_str(&line);
            banner.push('\n');
            if let Some(rest) = line.strip_prefix("dedupd: listening on nbd://127.0.0.1:") {
                port = rest.trim().parse().ok();
            }
            if line.starts_with("dedupd: stats:") {
                break;
            }
        }
        // keep draining stdout so the server never blocks on a full pipe
        std::thread::spawn(move || for _ in lines {});
        let port = port
            .unwrap_or_else(|| panic!("dedupd did not report a TCP port; it printed:\n{banner}"));
        Server {
            child: Some(child),
            store: store.to_path_buf(),
            port,
            banner,
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// NBD URI of volume `name`.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, name)
    }

    /// Sends SIGTERM and waits; asserts a clean exit (status 0) within 60 s.
    pub fn stop(mut self) {
        self.stop_inner(libc::SIGTERM, true);
    }

    /// Sends `signal` to the server (it keeps running, or stops).
    pub fn signal(&self, signal: i32) {
        if let Some(c) = &self.child {
            // SAFETY: sending a signal to our own child process.
            unsafe { libc::kill(c.id() as i32, signal) };
        }
    }

    /// Sends `signal` and waits; asserts a clean exit (status 0) within 60 s.
    pub fn stop_with(mut self, signal: i32) {
        self.stop_inner(signal, true);
    }

    /// Kills the server with SIGKILL (no clean shutdown).
    pub fn kill(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn stop_inner(&mut self, signal: i32, check: bool) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(c.id() as i32, signal) };
        let start = Instant::now();
        loop {
            match c.try_wait().expect("waiting for dedupd") {
                Some(status) => {
                    if check {
                        assert!(
                            status.success(),
                            "dedupd exited with {status} after signal {signal}"
                        );
                    }
                    return;
                }
                None if start.elapsed() > Duration::from_secs(60) => {
                    let _ = c.kill();
                    panic!("dedupd did not exit within 60 s of signal {signal}");
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_inner(libc::SIGTERM, false);
    }
}

/// SHA-256 of a file, via `sha256sum`.
pub fn sha256_file(path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// nbdfuse exposing one export as `<dir>/nbd`, unmounted on drop.
pub struct Fuse {
    child: Option<Child>,
    dir: PathBuf,
}

impl Fuse {
    /// Starts nbdfuse on `dir` for `uri` and waits until it serves.
    pub fn mount(dir: &Path, uri: &str) -> Fuse {
        Fuse::start(dir, uri, Stdio::inherit())
    }

    /// As [`Fuse::mount`], with nbdfuse's messages discarded (for tests
    /// that kill the server under it, where every failed request is logged).
    pub fn mount_quiet(dir: &Path, uri: &str) -> Fuse {
        Fuse::start(dir, uri, Stdio::null())
    }

    fn start(dir: &Path, uri: &str, stderr: Stdio) -> Fuse {
        std::fs::create_dir_all(dir).unwrap();
        let pidfile = dir.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new("nbdfuse")
            .arg("-P")
            .arg(&pidfile)
            .arg(dir)
            .arg(uri)
            .stderr(stderr)
            .spawn()
            .expect("starting nbdfuse");
        let start = Instant::now();
        while !pidfile.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "nbdfuse did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Fuse {
            child: Some(child),
            dir: dir.to_path_buf(),
        }
    }

    /// The file that is the export.
    pub fn file(&self) -> PathBuf {
        self.dir.join("nbd")
    }

    /// Tears down a FUSE mount whose server is gone: lazy unmount
    /// (`fusermount3 -u -z`), then SIGTERM to nbdfuse and wait.
    pub fn abandon(mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg("-z")
            .arg(&self.dir)
            .status();
        if let Some(mut c) = self.child.take() {
            // SAFETY: sending a signal to our own child process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.dir)
                .status();
            let _ = c.wait();
        }
    }
}

/// A loop device over a file, detached on drop.
pub struct Loop(pub String);

impl Loop {
    /// `losetup -f --show --direct-io=off file`.
    pub fn attach(file: &Path) -> Loop {
        let out = run(Command::new("losetup")
            .args(["-f", "--show", "--direct-io=off"])
            .arg(file));
        Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// A mounted file system, unmounted on drop.
pub struct Mount(PathBuf);

impl Mount {
    /// `mount -o opts dev at`.
    pub fn new(dev: &str, at: &Path, opts: &str) -> Mount {
        std::fs::create_dir_all(at).unwrap();
        run(Command::new("mount").args(["-o", opts, dev]).arg(at));
        Mount(at.to_path_buf())
    }

    /// Unmounts, asserting that `umount` succeeds.
    pub fn unmount(self) {
        run(Command::new("umount").arg(&self.0));
        std::mem::forget(self);
    }

    /// Detaches a mount whose device is gone (`umount -l`), without waiting
    /// for its users.
    pub fn abandon(self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        std::mem::forget(self);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A real directory tree of this machine: `$DEDUPD_E2E_TREE` if set, else
/// the Rust toolchain's `lib` directory (`rustc --print sysroot`).
pub fn source_tree() -> PathBuf {
    if let Some(p) = std::env::var_os("DEDUPD_E2E_TREE") {
        return PathBuf::from(p);
    }
    let out = run(Command::new("rustc").args(["--print", "sysroot"]));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("lib")
}

/// Regular files under `root`, sorted.
pub fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// Fails the test with a clear message unless the tools of the ext4 tests
/// (nbdfuse, loop devices, mkfs.ext4, e2fsck, mount) and /dev/fuse exist.
pub fn require_ext4_tools() {
    for t in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
        "sha256sum",
    ] {
        require(t);
    }
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: this test needs FUSE"
    );
}
