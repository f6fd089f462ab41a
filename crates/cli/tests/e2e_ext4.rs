//! End to end with a real ext4 (issue: block device, test b): `nbdfuse`
//! exposes the export as a file, `losetup` makes it a block device,
//! `mkfs.ext4` and `mount` put a file system on it; a real directory tree
//! of this machine (≥ 200 MiB) is copied twice; after unmount and a
//! restart of dedupd every file's SHA-256 matches its source, `e2fsck -fn`
//! is clean, and the physical bytes stored are < 60 % of the bytes copied.
//!
//! The tree is `$DEDUPD_E2E_TREE` if set, else the Rust toolchain's `lib`
//! directory (`rustc --print sysroot`), which every machine that builds
//! dedupd has. Needs root (loop devices, mount) and /dev/fuse.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{require, run, sha256_file, stats, Server};

/// nbdfuse exposing one export as `<dir>/nbd`, unmounted on drop.
struct Fuse {
    child: Child,
    dir: PathBuf,
}

impl Fuse {
    fn mount(dir: &Path, uri: &str) -> Fuse {
        std::fs::create_dir_all(dir).unwrap();
        let pidfile = dir.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new("nbdfuse")
            .arg("-P")
            .arg(&pidfile)
            .arg(dir)
            .arg(uri)
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
            child,
            dir: dir.to_path_buf(),
        }
    }
    fn file(&self) -> PathBuf {
        self.dir.join("nbd")
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .status();
        let _ = self.child.wait();
    }
}

/// A loop device over a file, detached on drop.
struct Loop(String);

impl Loop {
    fn attach(file: &Path) -> Loop {
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
struct Mount(PathBuf);

impl Mount {
    fn new(dev: &str, at: &Path, opts: &str) -> Mount {
        std::fs::create_dir_all(at).unwrap();
        run(Command::new("mount").args(["-o", opts, dev]).arg(at));
        Mount(at.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn source_tree() -> PathBuf {
    if let Some(p) = std::env::var_os("DEDUPD_E2E_TREE") {
        return PathBuf::from(p);
    }
    let out = run(Command::new("rustc").args(["--print", "sysroot"]));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("lib")
}

fn files_under(root: &Path) -> Vec<PathBuf> {
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

#[test]
fn ext4_on_nbdfuse_loop_survives_restart_and_dedups_copies() {
    for t in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "sha256sum",
    ] {
        require(t);
    }
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: this test needs FUSE"
    );
    let src = source_tree();
    let files = files_under(&src);
    let src_bytes: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();
    assert!(
        src_bytes >= 200 << 20,
        "source tree {} has only {src_bytes} bytes; set DEDUPD_E2E_TREE to a tree of ≥ 200 MiB",
        src.display()
    );

    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let fuse_dir = tmp.path().join("fuse");
    let mnt = tmp.path().join("mnt");
    let size = format!("{}M", (src_bytes * 3 / (1 << 20)).max(1024));

    let server = Server::start(&store, &["--default-volume-size", &size]);
    {
        let fuse = Fuse::mount(&fuse_dir, &server.uri("default"));
        let lo = Loop::attach(&fuse.file());
        run(Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096", &lo.0]));
        let m = Mount::new(&lo.0, &mnt, "rw");
        for copy in ["copy1", "copy2"] {
            run(Command::new("cp").arg("-a").arg(&src).arg(mnt.join(copy)));
        }
        run(&mut Command::new("sync"));
        drop(m);
        drop(lo);
        drop(fuse);
    }
    let copied = 2 * src_bytes;
    let s = stats(&store);
    let physical = s["physical_bytes_stored"].as_u64().unwrap();
    server.stop();

    // restart and verify
    let server = Server::start(&store, &[]);
    let fuse = Fuse::mount(&fuse_dir, &server.uri("default"));
    let lo = Loop::attach(&fuse.file());
    run(Command::new("e2fsck").args(["-fn", &lo.0]));
    let m = Mount::new(&lo.0, &mnt, "ro");
    let mut checked = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let want = sha256_file(f);
        for copy in ["copy1", "copy2"] {
            let got = sha256_file(&mnt.join(copy).join(rel));
            assert_eq!(got, want, "{} differs in {copy}", rel.display());
            checked += 1;
        }
    }
    drop(m);
    drop(lo);
    drop(fuse);
    server.stop();
    eprintln!(
        "ext4: {checked} files verified; {} MiB copied, {} MiB stored ({:.1} %)",
        copied >> 20,
        physical >> 20,
        100.0 * physical as f64 / copied as f64
    );
    assert!(
        physical * 100 < copied * 60,
        "stored {physical} bytes for {copied} copied: not < 60 %"
    );
}
