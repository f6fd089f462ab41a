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

use std::process::Command;

use common::{files_under, require_ext4_tools, run, sha256_file, source_tree, stats};
use common::{Fuse, Loop, Mount, Server};

#[test]
fn ext4_on_nbdfuse_loop_survives_restart_and_dedups_copies() {
    require_ext4_tools();
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
