//! End to end with qemu-img, qemu-io, nbdinfo and nbdcopy, and the bad-input
//! cases of the block-device issue that need a running dedupd: a store path
//! that is missing or not a store, a client vanishing mid-request, garbage
//! on the wire, a full backing file system.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{dedupd, require, run, stats, Server};

/// Copies a real file of this machine into `dst`, padded with zeros to a
/// multiple of 4 KiB; returns the padded size.
fn real_image(dst: &Path) -> u64 {
    let out = run(Command::new("rustc").args(["--print", "sysroot"]));
    let sysroot = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let src = std::fs::read_dir(sysroot.join("lib"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "so"))
        .max_by_key(|p| p.metadata().map(|m| m.len()).unwrap_or(0))
        .expect("the Rust toolchain has shared libraries");
    std::fs::copy(&src, dst).unwrap();
    let len = std::fs::metadata(dst).unwrap().len().div_ceil(4096) * 4096;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dst)
        .unwrap()
        .set_len(len)
        .unwrap();
    len
}

#[test]
fn qemu_img_convert_in_and_out_is_byte_identical() {
    require("qemu-img");
    require("nbdcopy");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let img = tmp.path().join("image.raw");
    let size = real_image(&img);
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "img", &size.to_string()]));
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "img2", &size.to_string()]));

    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&img)
        .arg(server.uri("img")));
    let back = tmp.path().join("back.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(server.uri("img"))
        .arg(&back));
    assert!(
        std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap(),
        "image differs after a round trip through dedupd"
    );

    // a second copy with nbdcopy shares every block with the first
    let before = stats(&store)["physical_blocks_stored"].as_u64().unwrap();
    run(Command::new("nbdcopy")
        .arg(server.uri("img"))
        .arg(server.uri("img2")));
    let s = stats(&store);
    assert_eq!(
        s["physical_blocks_stored"].as_u64().unwrap(),
        before,
        "a copy of a volume stored new blocks"
    );
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(server.uri("img"))
        .arg(server.uri("img2")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("identical"));

    // through the running server (progress lines before each reply): an
    // offline pass, then deleting the copy frees nothing the first uses
    let out = dedupd(&store, &["dedup", "--offline"]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("examined"));
    let out = dedupd(&store, &["volume", "delete", "img2"]);
    assert!(out.status.success(), "{out:?}");
    let s = stats(&store);
    assert_eq!(s["physical_blocks_stored"].as_u64().unwrap(), before);
    assert_eq!(s["volumes"].as_u64().unwrap(), 2, "{s}"); // default, img
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(server.uri("img")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("identical"));
    server.stop();
}

/// The hashing filters (CAFTL pre-hashing and sampling, the sequence
/// threshold), and the reverse index, volume maps and reference counts
/// paged through 8 KiB caches, end to end:
/// real clients read back what they wrote across a restart, the filters and
/// the page cache did their work, an offline pass and fsck find the store
/// consistent.
#[test]
fn hashing_filters_and_a_paged_reverse_index_lose_nothing() {
    require("qemu-img");
    require("nbdcopy");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let img = tmp.path().join("image.raw");
    let size = real_image(&img).to_string();
    let opts = [
        "--default-volume-size",
        "64M",
        "--reverse-index-cache",
        "8K",
        "--map-cache",
        "8K",
        "--journal-size",
        "256K",
        "--prehash",
        "64K",
        "--sampling",
        "--sequence-threshold",
        "2",
    ];
    let server = Server::start(&store, &opts);
    for name in ["img", "img2"] {
        run(Command::new(common::dedupd_bin())
            .arg("--store")
            .arg(&store)
            .args(["volume", "create", name, &size]));
    }
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&img)
        .arg(server.uri("img")));
    run(Command::new("nbdcopy")
        .arg(server.uri("img"))
        .arg(server.uri("img2")));
    let s = stats(&store);
    assert!(s["caftl"]["blocks_prehashed"].as_u64().unwrap() > 0, "{s}");
    assert!(s["caftl"]["requests_sampled"].as_u64().unwrap() > 0, "{s}");
    assert!(
        s["reverse_index"]["pages_evicted"].as_u64().unwrap() > 0,
        "{s}"
    );
    assert!(s["map_cache"]["pages_evicted"].as_u64().unwrap() > 0, "{s}");
    server.stop();
    let server = Server::start(&store, &opts);
    for name in ["img", "img2"] {
        let out = run(Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&img)
            .arg(server.uri(name)));
        assert!(String::from_utf8_lossy(&out.stdout).contains("identical"));
    }
    // the maps were read back page by page through the 8 KiB cache
    let s = stats(&store);
    assert!(s["map_cache"]["pages_loaded"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["map_cache"]["load_errors"].as_u64().unwrap(), 0, "{s}");
    server.stop();
    // a full pass merges what the filters left apart; fsck is clean
    let before = stats(&store)["physical_blocks_stored"].as_u64().unwrap();
    let out = dedupd(&store, &["dedup", "--offline"]);
    assert!(out.status.success(), "{out:?}");
    assert!(stats(&store)["physical_blocks_stored"].as_u64().unwrap() <= before);
    let out = dedupd(&store, &["fsck"]);
    assert!(out.status.success(), "fsck: {out:?}");
    // under tiny memory bounds too; a bad bound is a usage error (16)
    let tiny = ["--index-memory", "64K", "--map-cache", "16K"];
    let out = dedupd(&store, &[&["fsck", "--rehash"][..], &tiny].concat());
    assert!(out.status.success(), "fsck with tiny bounds: {out:?}");
    let out = dedupd(&store, &["fsck", "--map-cache", "lots"]);
    assert_eq!(out.status.code(), Some(16), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--map-cache") && err.contains("lots"),
        "stderr: {err}"
    );
    let out = dedupd(&store, &["fsck", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(16), "{out:?}");
    let out = dedupd(&store, &["fsck", "--index-memory", "1K"]);
    assert_eq!(out.status.code(), Some(16), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("4K minimum"));
}

#[test]
fn bad_store_paths_get_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let out = dedupd(&missing, &["stats"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not exist"), "stderr: {err}");

    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("precious.txt"), b"user data").unwrap();
    for args in [
        &["serve", "--listen", "127.0.0.1:0"][..],
        &["stats"],
        &["volume", "list"],
    ] {
        let out = dedupd(&foreign, args);
        assert!(
            !out.status.success(),
            "{args:?} succeeded on a foreign directory"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not a dedupd store"), "{args:?} stderr: {err}");
    }
    assert_eq!(
        std::fs::read(foreign.join("precious.txt")).unwrap(),
        b"user data"
    );
    assert_eq!(
        std::fs::read_dir(&foreign).unwrap().count(),
        1,
        "dedupd wrote into a foreign directory"
    );

    // init sets the index's prefix bits of the store it creates
    let p18 = tmp.path().join("p18-store");
    assert!(dedupd(&p18, &["init", "--index-prefix-bits", "18"])
        .status
        .success());
    let sb = std::fs::read_to_string(p18.join("superblock")).unwrap();
    assert!(sb.contains("\"index_prefix_bits\": 18"), "{sb}");
    assert!(!dedupd(
        &tmp.path().join("p30"),
        &["init", "--index-prefix-bits", "30"]
    )
    .status
    .success());

    // an I/O error names the file and the system's reason, once
    let odd = tmp.path().join("odd-store");
    assert!(dedupd(&odd, &["init"]).status.success());
    let _ = std::fs::remove_file(odd.join("lock"));
    std::fs::create_dir(odd.join("lock")).unwrap();
    let out = dedupd(&odd, &["volume", "list"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lock"), "stderr: {err}");
    assert_eq!(err.matches("Is a directory").count(), 1, "stderr: {err}");

    // a store on a read-only file system (a read-only bind mount): the
    // error says so, and the store is untouched
    let ro = tmp.path().join("ro-view");
    std::fs::create_dir(&ro).unwrap();
    let mount = |args: &[&str]| {
        let st = std::process::Command::new("mount")
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "mount {args:?}");
    };
    mount(&["--bind", odd.to_str().unwrap(), ro.to_str().unwrap()]);
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(ro.clone());
    mount(&["-o", "remount,bind,ro", ro.to_str().unwrap()]);
    std::fs::remove_dir(odd.join("lock")).unwrap();
    let before: Vec<_> = std::fs::read_dir(&odd)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    for args in [&["fsck"][..], &["volume", "list"]] {
        let out = dedupd(&ro, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("read-only file system"),
            "{args:?} stderr: {err}"
        );
    }
    let after: Vec<_> = std::fs::read_dir(&odd)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after);

    // a second server on the same store is refused
    let store = tmp.path().join("store");
    let server = Server::start(&store, &[]);
    // its control socket manages the store: the server's user only
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(store.join("control.sock"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let out = dedupd(&store, &["serve", "--listen", "127.0.0.1:0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // named by its holder, and not announced as being opened first
    assert!(
        err.contains(&format!(
            "in use by another dedupd process (pid {}: ",
            server.pid()
        )),
        "{err}"
    );
    assert!(!err.contains("opening store"), "{err}");
    // --socket never removes what is not a stale socket
    let other = tmp.path().join("other-store");
    let precious = tmp.path().join("precious.txt");
    std::fs::write(&precious, b"user data").unwrap();
    let live_socket = tmp.path().join("live.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&live_socket).unwrap();
    for (path, why) in [
        (&precious, "not a socket"),
        (&live_socket, "another server is listening"),
    ] {
        let p = path.to_str().unwrap();
        let out = dedupd(&other, &["serve", "--no-tcp", "--socket", p]);
        assert!(!out.status.success(), "serve --socket {p} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "stderr: {err}");
    }
    assert_eq!(std::fs::read(&precious).unwrap(), b"user data");
    assert!(live_socket.exists());
    // bad volume arguments
    for args in [
        &["volume", "create", "bad name", "1G"][..],
        &["volume", "create", "x", "1000"],
        &["volume", "create", "x", "12Q"],
        &["volume", "delete", "nope"],
        &["volume", "set", "default", "--sequence-threshold", "0"],
        &["volume", "set", "default", "--sequence-threshold", "x"],
        &["volume", "set", "nope", "--sequence-threshold", "4"],
    ] {
        let out = dedupd(&store, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("error"),
            "{args:?}"
        );
    }
    // a volume's sequence threshold, set through the running server, is
    // listed and survives a restart
    let out = dedupd(
        &store,
        &["volume", "set", "default", "--sequence-threshold", "4"],
    );
    assert!(out.status.success(), "{out:?}");
    server.stop();
    let out = dedupd(&store, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["sequence_threshold_blocks"], 4, "{list}");
    // deleting a volume whose map is lost works, and says that its blocks
    // wait for a repair; a sound volume's delete says nothing of the kind
    let out = dedupd(&store, &["volume", "create", "lost", "8M"]);
    assert!(out.status.success(), "{out:?}");
    let out = dedupd(&store, &["volume", "create", "sound", "8M"]);
    assert!(out.status.success(), "{out:?}");
    let list: serde_json::Value =
        serde_json::from_slice(&dedupd(&store, &["volume", "list", "--json"]).stdout).unwrap();
    let id = list
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "lost")
        .map(|v| v["id"].as_u64().unwrap())
        .unwrap();
    std::fs::remove_file(store.join("maps").join(id.to_string())).unwrap();
    let out = dedupd(&store, &["volume", "delete", "lost"]);
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fsck --repair"), "stderr: {err}");
    let out = dedupd(&store, &["volume", "delete", "sound"]);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
}

#[test]
fn a_store_in_a_deep_directory_serves_and_answers_commands() {
    // `<store>/control.sock` longer than a Unix socket address holds
    let tmp = tempfile::tempdir().unwrap();
    let deep = tmp.path().join("d".repeat(60)).join("e".repeat(60));
    let store = deep.join("store");
    assert!(store.join("control.sock").as_os_str().len() > 107);
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    // commands reach the running server through its control socket
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "second", "8M"]));
    let s = stats(&store);
    assert_eq!(s["volumes"].as_u64(), Some(2), "{s}");
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x33 0 1M",
        &server.uri("second"),
    ]));
    assert!(stats(&store)["blocks_written"].as_u64().unwrap() >= 256);
    server.stop();
}

#[test]
fn the_empty_export_name_is_default_only() {
    require("nbdinfo");
    let tmp = tempfile::tempdir().unwrap();
    // a bad size for the first volume is refused before anything is
    // created (no store left without its volume `default`)
    let store = tmp.path().join("store");
    let out = dedupd(
        &store,
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--default-volume-size",
            "1000",
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("multiple of 4K"), "stderr: {err}");
    assert!(!store.exists(), "a store was created");
    let server = Server::start(&store, &["--default-volume-size", "8M"]);
    let empty = format!("nbd://127.0.0.1:{}/", server.port);
    let size = |uri: &str| {
        Command::new("nbdinfo")
            .args(["--size", uri])
            .output()
            .unwrap()
    };
    let out = size(&empty);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "8388608");
    // with `default` gone, the empty name reaches no other volume, even
    // the only one left
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "vm2", "4M"]));
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "delete", "default"]));
    assert!(!size(&empty).status.success(), "the empty name opened vm2");
    assert!(size(&server.uri("vm2")).status.success());
    server.stop();
}

fn handshake(port: u16, name: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
                                               // NBD_OPT_EXPORT_NAME
    s.write_all(&0x49484156454F5054u64.to_be_bytes()).unwrap();
    s.write_all(&1u32.to_be_bytes()).unwrap();
    s.write_all(&(name.len() as u32).to_be_bytes()).unwrap();
    s.write_all(name.as_bytes()).unwrap();
    let mut reply = [0u8; 10];
    s.read_exact(&mut reply).unwrap();
    s
}

#[test]
fn vanishing_clients_and_garbage_lose_nothing() {
    require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    let uri = server.uri("default");
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 0 1M", &uri]));

    // a WRITE header announcing 1 MiB, then half the payload, then gone
    let mut s = handshake(server.port, "default");
    let mut hdr = Vec::new();
    hdr.extend_from_slice(&0x25609513u32.to_be_bytes());
    hdr.extend_from_slice(&0u16.to_be_bytes());
    hdr.extend_from_slice(&1u16.to_be_bytes()); // WRITE
    hdr.extend_from_slice(&7u64.to_be_bytes());
    hdr.extend_from_slice(&0u64.to_be_bytes());
    hdr.extend_from_slice(&(1u32 << 20).to_be_bytes());
    s.write_all(&hdr).unwrap();
    s.write_all(&vec![0xEE; 512 * 1024]).unwrap();
    drop(s);
    // a truncated header
    let mut s = handshake(server.port, "default");
    s.write_all(&hdr[..11]).unwrap();
    drop(s);
    // garbage instead of a request
    let mut s = handshake(server.port, "default");
    s.write_all(&[0xFFu8; 64]).unwrap();
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
    // garbage instead of a handshake
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n");
    let _ = s.read_to_end(&mut sink);

    run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x5a 0 1M", &uri]));
    // past the end, over 32 MiB: refused with EINVAL (qemu-io would not
    // send these: it checks them against the export itself), the
    // connection and the data stay
    let mut s = handshake(server.port, "default");
    let request = |s: &mut TcpStream, handle: u64, offset: u64, len: u32| {
        let mut r = Vec::new();
        r.extend_from_slice(&0x25609513u32.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes()); // READ
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        s.write_all(&r).unwrap();
        let mut reply = [0u8; 16];
        s.read_exact(&mut reply).unwrap();
        assert_eq!(
            &reply[..4],
            &0x67446698u32.to_be_bytes(),
            "not a simple reply"
        );
        assert_eq!(&reply[8..], &handle.to_be_bytes());
        u32::from_be_bytes(reply[4..8].try_into().unwrap())
    };
    assert_eq!(request(&mut s, 1, 64 << 20, 4096), 22, "read past the end");
    assert_eq!(
        request(&mut s, 2, (64 << 20) - 4096, 8192),
        22,
        "read across the end"
    );
    assert_eq!(
        request(&mut s, 3, 0, (32 << 20) + 4096),
        22,
        "read over 32 MiB"
    );
    // the connection still serves: the last block, in full
    assert_eq!(request(&mut s, 4, (64 << 20) - 4096, 4096), 0);
    let mut block = vec![0u8; 4096];
    s.read_exact(&mut block).unwrap();
    drop(s);
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x5a 0 1M", &uri]));
    server.stop();
    let server = Server::start(&store, &[]);
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x5a 0 1M",
        "-c",
        "read -P 0 1M 1M",
        &server.uri("default"),
    ]));
    server.stop();
}

/// `len` bytes (a multiple of 8) of xorshift noise from `seed`: unique
/// 4 KiB blocks, as a real file's rarely repeat.
fn noise_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut buf = vec![0u8; len];
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    buf
}

/// A tmpfs of `size` mounted at `at`, unmounted on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at));
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn full_backing_file_system_gives_enospc_and_keeps_data() {
    require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&tmp.path().join("small"), "48M");
    let store = fs.0.join("store");
    // (no periodic commit: released blocks wait for one until a write
    // finds the file system full; a journal reserve for a small device)
    let server = Server::start(
        &store,
        &[
            "--default-volume-size",
            "1G",
            "--commit-interval-ms",
            "0",
            "--journal-reserve",
            "8M",
            "--max-dirty",
            "4M",
        ],
    );
    let uri = server.uri("default");
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x11 0 8M",
        "-c",
        "flush",
        &uri,
    ]));
    // unique data (a real file's bytes repeat rarely) until the file system is full
    let noise = tmp.path().join("noise.raw");
    let buf = noise_bytes(96 << 20, 0x9E3779B97F4A7C15);
    std::fs::write(&noise, &buf).unwrap();
    run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "fill", "96M"]));
    let out = Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&noise)
        .arg(server.uri("fill"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "writing 96 MiB of unique data into a 48 MiB file system succeeded"
    );
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        err.contains("no space") || err.contains("enospc"),
        "client did not see ENOSPC: {err}"
    );
    // earlier data still reads back; the server keeps serving
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x11 0 8M", &uri]));
    let s = stats(&store);
    assert!(s["physical_blocks_stored"].as_u64().unwrap() >= 2048);
    // freeing space makes writes work again, before any commit (one
    // client session, no FLUSH between): a write of 4 MiB of new unique
    // data (more than the blocks left free by the failed writes) finds the
    // file system full, commits and reuses the blocks the discard released
    let fresh = tmp.path().join("fresh.raw");
    let fresh_data: Vec<u8> = buf[..4 << 20].iter().map(|b| b ^ 0x5a).collect();
    std::fs::write(&fresh, &fresh_data).unwrap();
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "discard 0 96M",
        "-c",
        &format!("write -s {} 0 4M", fresh.display()),
        "-c",
        "flush",
        &server.uri("fill"),
    ]));
    assert!(stats(&store)["no_space_commits"].as_u64().unwrap() >= 1);
    server.stop();
    let server = Server::start(&store, &[]);
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x11 0 8M",
        &server.uri("default"),
    ]));
    // (the rest of the volume, discarded, must read as zeros)
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&fresh)
        .arg(server.uri("fill")));
    server.stop();
}

/// Bytes available on the file system holding `path` (`df -B1`).
fn available_bytes(path: &Path) -> u64 {
    let out = run(Command::new("df").args(["-B1", "--output=avail"]).arg(path));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df output")
}

/// A 64 MiB ext4 (4 KiB blocks) made in `dir`, attached to a loop device
/// and mounted at `dir/mnt`; unmounted, then detached, when dropped.
struct SmallExt4 {
    /// Where a store on it goes (`dir/mnt/store`, not created).
    store: PathBuf,
    // (dropped in this order: unmounted before the loop device goes)
    _mount: common::Mount,
    _lo: common::Loop,
}

impl SmallExt4 {
    fn mount(dir: &Path) -> SmallExt4 {
        let image = dir.join("small.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096"])
            .arg(&image));
        let lo = common::Loop::attach(&image);
        let mount = common::Mount::new(&lo.0, &dir.join("mnt"), "rw");
        SmallExt4 {
            store: dir.join("mnt").join("store"),
            _mount: mount,
            _lo: lo,
        }
    }
}

/// On ext4, a preallocation the file system cannot satisfy in full keeps
/// what it allocated past the data file's end: the store must not take
/// space that way and then find the file system full with most of it
/// unused.
#[test]
fn a_small_ext4_fills_with_data_before_enospc() {
    require("qemu-img");
    require("mkfs.ext4");
    require("losetup");
    let tmp = tempfile::tempdir().unwrap();
    let small = SmallExt4::mount(tmp.path());
    let store = small.store.clone();
    let server = Server::start(
        &store,
        &[
            "--default-volume-size",
            "128M",
            "--journal-reserve",
            "8M",
            "--max-dirty",
            "4M",
        ],
    );
    // what is left for data once the store's metadata files exist
    let free_at_start = available_bytes(&store);
    let noise = tmp.path().join("noise.raw");
    std::fs::write(&noise, noise_bytes(96 << 20, 0x2545F4914F6CDD1D)).unwrap();
    let out = Command::new("qemu-img")
        .args(["convert", "-n", "-W", "-m", "8", "-f", "raw", "-O", "raw"])
        .arg(&noise)
        .arg(server.uri("default"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "96 MiB fitted in a 64 MiB file system"
    );
    let stored = stats(&store)["physical_blocks_stored"].as_u64().unwrap() * 4096;
    assert!(
        stored * 10 >= free_at_start * 7,
        "ENOSPC with {stored} bytes of data stored; {free_at_start} were free at the start"
    );
    server.stop();
}

/// A journal reserve larger than the file system's free space takes none
/// of it (ext4 keeps what a failed preallocation got: the reserve used to
/// fill the file system and leave no room for data), and a start with a
/// smaller reserve gives back what an earlier one took.
#[test]
fn a_journal_reserve_takes_no_more_than_fits_and_shrinks() {
    require("qemu-io");
    require("mkfs.ext4");
    require("losetup");
    let tmp = tempfile::tempdir().unwrap();
    let small = SmallExt4::mount(tmp.path());
    let store = small.store.clone();
    let serve = |reserve: &str| {
        Server::start(
            &store,
            &[
                "--default-volume-size",
                "64M",
                "--journal-reserve",
                reserve,
                "--max-dirty",
                "4M",
            ],
        )
    };
    // a reserve that fits takes its space, and a short command (which
    // opens the store with at most 32 MiB of its own) keeps it
    let server = serve("40M");
    let free_40m = available_bytes(&store);
    server.stop();
    let stopped = available_bytes(&store);
    assert!(dedupd(&store, &["volume", "list"]).status.success());
    let after_list = available_bytes(&store);
    assert!(
        after_list <= stopped + (1 << 20),
        "a short command gave back the server's reserve: {stopped} bytes free before, {after_list} after"
    );
    // a server with a smaller reserve gives the rest back
    let server = serve("8M");
    let free_8m = available_bytes(&store);
    assert!(
        free_8m >= free_40m + (24 << 20),
        "{free_40m} bytes free with a 40 MiB reserve, {free_8m} with 8 MiB"
    );
    server.stop();
    // 200 MiB on a 64 MiB file system: no reserve, the space stays free
    let server = serve("200M");
    let free = available_bytes(&store);
    assert!(
        free > 40 << 20,
        "{free} bytes free with a reserve that does not fit"
    );
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x3c 0 16M",
        "-c",
        "flush",
        &server.uri("default"),
    ]));
    server.stop();
    let server = serve("8M");
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x3c 0 16M",
        &server.uri("default"),
    ]));
    server.stop();
}

/// `chattr +i` on a file while alive (even root cannot write it then),
/// `chattr -i` when dropped so the directory can be removed.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn set(path: &Path) -> Immutable {
        require("chattr");
        run(Command::new("chattr").arg("+i").arg(path));
        Immutable(path.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

#[test]
fn a_command_whose_checkpoint_fails_succeeds_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    assert!(dedupd(&store, &["init"]).status.success());
    // the state cannot be written in place: the command's change is
    // committed to the journal, its checkpoint fails
    let _frozen = Immutable::set(&store.join("state.json"));
    let out = dedupd(&store, &["volume", "create", "v", "8M"]);
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning: checkpoint failed"), "stderr: {err}");
    // the volume is there (replayed from the journal), and a second
    // create of it says so
    let out = dedupd(&store, &["volume", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["name"], "v", "{list}");
    let out = dedupd(&store, &["volume", "create", "v", "8M"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists"));
}

/// Runs the client and stats commands `server` printed at start (three),
/// with `path` as PATH, from directory `cwd`; each must succeed.
fn run_printed_commands(server: &Server, path: &str, cwd: &Path) {
    let commands: Vec<&str> = server
        .banner
        .lines()
        .filter_map(|l| {
            l.strip_prefix("dedupd: try: ")
                .or_else(|| l.strip_prefix("dedupd: stats: "))
        })
        .collect();
    assert_eq!(commands.len(), 3, "{}", server.banner);
    for c in commands {
        run(Command::new("bash")
            .args(["-c", c])
            .env("PATH", path)
            .current_dir(cwd));
    }
}

#[test]
fn serve_refuses_bad_options_before_making_a_store_and_prints_commands_that_work() {
    require("nbdinfo");
    let tmp = tempfile::tempdir().unwrap();
    // refused before anything is written: no store appears
    for (i, args) in [
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--default-volume-size",
            "2P",
        ][..],
        &["serve", "--no-tcp"],
        &["serve", "--listen", "127.0.0.1"],
        &[
            "serve",
            "--no-tcp",
            "--listen",
            "127.0.0.1:0",
            "--socket",
            "x.sock",
        ],
    ]
    .iter()
    .enumerate()
    {
        let store = tmp.path().join(format!("s{i}"));
        let out = dedupd(&store, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!store.exists(), "{args:?} made a store");
    }
    // a file given as the store is named as such, and left alone
    let file = tmp.path().join("afile");
    std::fs::write(&file, b"hi\n").unwrap();
    for args in [
        &["serve", "--listen", "127.0.0.1:0"][..],
        &["stats"],
        &["fsck"],
    ] {
        let out = dedupd(&file, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not a dedupd store"), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"hi\n");

    // paths a shell or a URI must quote: the commands printed at start
    // work as printed (dedupd on PATH)
    let odd = tmp.path().join("sp ace%");
    std::fs::create_dir(&odd).unwrap();
    let store = odd.join("st 'q'");
    let socket = odd.join("n.sock");
    let server = Server::start(&store, &["--socket", socket.to_str().unwrap()]);
    let bin_dir = common::dedupd_bin().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run_printed_commands(&server, &path, &std::env::current_dir().unwrap());
    server.stop();
    // given relative to the server's directory, they work from any other
    let dir = format!("--chdir={}", odd.display());
    let server = Server::start_via(&["env", &dir], Path::new("st 'q'"), &["--socket", "n.sock"]);
    run_printed_commands(&server, &path, Path::new("/"));
    server.stop();

    // a listing whose reader went away ends quietly
    run(Command::new("bash")
        .args([
            "-c",
            "set -o pipefail; \"$0\" --store \"$1\" volume list | true",
        ])
        .arg(common::dedupd_bin())
        .arg(&store));
}

#[test]
fn lbas_whose_mapping_was_lost_fail_to_read_over_nbd() {
    require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    let uri = server.uri("default");
    // 4 MiB: LBAs 0..1024, over map pages 0, 1 (LBAs 508..1016) and 2
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x3c 0 4M", &uri]));
    server.stop();
    // one flipped bit in map page 1
    let map = std::fs::read_dir(store.join("maps"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&map).unwrap();
    bytes[4096 + 100] ^= 0x10;
    std::fs::write(&map, &bytes).unwrap();
    let server = Server::start(&store, &[]);
    let uri = server.uri("default");
    // served read-only: the LBAs of other pages read back, those of the
    // damaged page fail instead of reading as zeros
    run(Command::new("qemu-io").args(["-r", "-f", "raw", "-c", "read -P 0x3c 0 1M", &uri]));
    // (LBAs 1016..1024 on page 2)
    run(Command::new("qemu-io").args(["-r", "-f", "raw", "-c", "read -P 0x3c 4064k 32k", &uri]));
    let out = Command::new("qemu-io")
        .args(["-r", "-f", "raw", "-c", "read 2M 4k", &uri])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("Input/output error"), "{said}");
    // and the stats say so
    assert_eq!(stats(&store)["volumes_damaged"].as_u64(), Some(1));
    let text = dedupd(&store, &["stats"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("volumes damaged              1 (served read-only"),
        "{text}"
    );
    server.stop();
}

#[test]
fn fast_zeroes_of_whole_blocks_unmap_and_partial_ones_fail_at_once() {
    require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &[]);
    let uri = server.uri("default");
    // `write -z -n`: zeroes with NBD_CMD_FLAG_FAST_ZERO (no slow fallback)
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x33 0 64k",
        "-c",
        "write -z -n 0 16k",
        "-c",
        "read -P 0 0 16k",
        "-c",
        "read -P 0x33 16k 48k",
        &uri,
    ]));
    assert_eq!(
        stats(&store)["logical_bytes_mapped"].as_u64(),
        Some(48 << 10)
    );
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -z -n 16k 1000", &uri])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("Operation not supported"), "{said}");
    // nothing changed
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x33 16k 48k", &uri]));
    server.stop();
}

/// One NBD request with a simple reply (no structured replies were
/// negotiated): returns the reply's error (0 for success).
fn nbd_request(s: &mut TcpStream, command: u16, offset: u64, len: u32, payload: &[u8]) -> u32 {
    let mut req = Vec::with_capacity(28 + payload.len());
    req.extend_from_slice(&0x25609513u32.to_be_bytes());
    req.extend_from_slice(&0u16.to_be_bytes());
    req.extend_from_slice(&command.to_be_bytes());
    req.extend_from_slice(&7u64.to_be_bytes());
    req.extend_from_slice(&offset.to_be_bytes());
    req.extend_from_slice(&len.to_be_bytes());
    req.extend_from_slice(payload);
    s.write_all(&req).unwrap();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..4], &0x67446698u32.to_be_bytes());
    u32::from_be_bytes(reply[4..8].try_into().unwrap())
}

/// A store on a 64 MiB ext4 whose journal has not been checkpointed when
/// the file system fills: unique 4 KiB writes with a FLUSH every 8 go on
/// well past ENOSPC, then TRIM of the whole volume, three times. A
/// checkpoint that waited for the journal's size bound found no room for
/// the pages it puts in place once the disk was full: every FLUSH failed
/// from then on, even after the TRIM. It runs while there is room now.
#[test]
fn a_full_file_system_emptied_by_trim_takes_flushes_and_writes_again() {
    require("mkfs.ext4");
    require("losetup");
    const NBD_CMD_WRITE: u16 = 1;
    const NBD_CMD_FLUSH: u16 = 3;
    const NBD_CMD_TRIM: u16 = 4;
    const NBD_ENOSPC: u32 = 28;
    let tmp = tempfile::tempdir().unwrap();
    let small = SmallExt4::mount(tmp.path());
    let store = small.store.clone();
    let ok = |args: &[&str]| assert!(dedupd(&store, args).status.success(), "{args:?}");
    ok(&["init", "--index-prefix-bits", "8"]);
    ok(&["volume", "create", "a", "48M"]);
    let server = Server::start(&store, &["--journal-reserve", "8M", "--max-dirty", "4M"]);
    let mut s = handshake(server.port, "a");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        // (splitmix64)
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut block = vec![0u8; 4096];
    for round in 0..3 {
        let (mut writes, mut errors, mut flush_errors) = (0u64, 0u64, 0u64);
        while errors < 200 && writes < 40_000 {
            for w in block.chunks_mut(8) {
                w.copy_from_slice(&next().to_le_bytes());
            }
            let offset = (next() % 12_288) * 4096;
            match nbd_request(&mut s, NBD_CMD_WRITE, offset, 4096, &block) {
                0 => writes += 1,
                NBD_ENOSPC => errors += 1,
                e => panic!("round {round}: write error {e}"),
            }
            if (writes + errors).is_multiple_of(8) {
                let e = nbd_request(&mut s, NBD_CMD_FLUSH, 0, 0, &[]);
                if e != 0 {
                    flush_errors += 1;
                }
            }
        }
        assert!(errors > 0, "round {round}: the file system never filled");
        assert_eq!(flush_errors, 0, "round {round}: FLUSHes failed");
        assert_eq!(nbd_request(&mut s, NBD_CMD_TRIM, 0, 48 << 20, &[]), 0);
        assert_eq!(
            nbd_request(&mut s, NBD_CMD_FLUSH, 0, 0, &[]),
            0,
            "round {round}"
        );
        assert_eq!(nbd_request(&mut s, NBD_CMD_WRITE, 0, 4096, &block), 0);
        assert_eq!(
            nbd_request(&mut s, NBD_CMD_FLUSH, 0, 0, &[]),
            0,
            "round {round}"
        );
    }
    drop(s);
    server.stop();
    assert!(dedupd(&store, &["fsck"]).status.success());
}
