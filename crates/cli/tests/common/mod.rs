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
        let mut child = Command::new(dedupd_bin())
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

    /// NBD URI of volume `name`.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, name)
    }

    /// Sends SIGTERM and waits; asserts a clean exit (status 0) within 60 s.
    pub fn stop(mut self) {
        self.stop_inner(true);
    }

    /// Kills the server with SIGKILL (no clean shutdown).
    pub fn kill(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn stop_inner(&mut self, check: bool) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            match c.try_wait().expect("waiting for dedupd") {
                Some(status) => {
                    if check {
                        assert!(
                            status.success(),
                            "dedupd exited with {status} after SIGTERM"
                        );
                    }
                    return;
                }
                None if start.elapsed() > Duration::from_secs(60) => {
                    let _ = c.kill();
                    panic!("dedupd did not exit within 60 s of SIGTERM");
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_inner(false);
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
