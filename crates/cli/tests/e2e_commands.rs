//! End to end: the volume commands' guards (open NBD connections, shrinks
//! not asked for, sizes refused before the store is opened), what `serve`
//! says about options that do not apply, its stop on SIGHUP, and exit
//! codes (stdout a closed pipe, a directory that is not quite a store).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{dedupd, dedupd_bin, run, stats, Server};

/// A client that negotiated `name` (fixed newstyle, `NBD_OPT_EXPORT_NAME`)
/// and holds the connection in transmission.
fn connect(port: u16, name: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
    s.write_all(&0x49484156454F5054u64.to_be_bytes()).unwrap(); // IHAVEOPT
    s.write_all(&1u32.to_be_bytes()).unwrap(); // NBD_OPT_EXPORT_NAME
    s.write_all(&(name.len() as u32).to_be_bytes()).unwrap();
    s.write_all(name.as_bytes()).unwrap();
    // size and flags: the export is open
    let mut reply = [0u8; 10];
    s.read_exact(&mut reply).unwrap();
    s
}

/// Ends a client's connection (NBD_CMD_DISC) and waits until the server
/// has `left` connections open.
fn disconnect(mut s: TcpStream, store: &Path, left: u64) {
    let mut disc = Vec::new();
    disc.extend_from_slice(&0x25609513u32.to_be_bytes());
    disc.extend_from_slice(&0u16.to_be_bytes());
    disc.extend_from_slice(&2u16.to_be_bytes()); // NBD_CMD_DISC
    disc.extend_from_slice(&[0u8; 16]);
    s.write_all(&disc).unwrap();
    drop(s);
    let start = Instant::now();
    while stats(store)["connections_open"] != left {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the server still counts the connection"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `dedupd --store STORE ARGS…` and asserts it succeeds.
fn succeeds(store: &Path, args: &[&str]) -> Output {
    run(Command::new(dedupd_bin())
        .arg("--store")
        .arg(store)
        .args(args))
}

/// Asserts `out` failed with a message containing `want`.
fn fails_with(out: &Output, want: &str) {
    assert!(!out.status.success(), "succeeded: {}", stderr(out));
    assert!(stderr(out).contains(want), "{}", stderr(out));
}

fn volume_size(store: &Path, name: &str) -> u64 {
    let out = succeeds(store, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .and_then(|v| v["size_bytes"].as_u64())
        .unwrap_or_else(|| panic!("no volume {name}: {list}"))
}

#[test]
fn delete_and_shrink_wait_for_the_volumes_clients_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    succeeds(&store, &["volume", "create", "vm1", "8M"]);
    let a = connect(server.port, "vm1");
    let b = connect(server.port, "vm1");
    // a client of another volume does not count
    let other = connect(server.port, "default");

    let out = dedupd(&store, &["volume", "delete", "vm1"]);
    fails_with(
        &out,
        "volume vm1 has 2 NBD connections open; disconnect them or pass --force",
    );
    let out = dedupd(&store, &["volume", "resize", "vm1", "4M", "--shrink"]);
    fails_with(&out, "volume vm1 has 2 NBD connections open");
    // a shrink not asked for is refused first, naming what it would discard
    let out = dedupd(&store, &["volume", "resize", "vm1", "4M"]);
    fails_with(&out, "would discard its last 4194304 bytes");
    fails_with(&out, "pass --shrink");
    assert_eq!(volume_size(&store, "vm1"), 8 << 20);
    // growing takes nothing away from the clients
    succeeds(&store, &["volume", "resize", "vm1", "16M"]);
    assert_eq!(volume_size(&store, "vm1"), 16 << 20);

    disconnect(a, &store, 2);
    let out = dedupd(&store, &["volume", "resize", "vm1", "4M", "--shrink"]);
    fails_with(
        &out,
        "volume vm1 has 1 NBD connection open; disconnect it or pass --force",
    );
    disconnect(b, &store, 1);
    succeeds(&store, &["volume", "resize", "vm1", "4M", "--shrink"]);
    assert_eq!(volume_size(&store, "vm1"), 4 << 20);

    // --force goes ahead with a client connected
    let c = connect(server.port, "vm1");
    succeeds(&store, &["volume", "delete", "vm1", "--force"]);
    let out = succeeds(&store, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        list.as_array().unwrap().iter().all(|v| v["name"] != "vm1"),
        "vm1 still listed: {list}"
    );
    drop(c);
    drop(other);
    server.stop();
}

#[test]
fn a_volume_is_renamed_while_served_and_while_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    succeeds(&store, &["volume", "create", "vm1", "8M"]);
    // a client connected by the old name keeps its volume
    let held = connect(server.port, "vm1");
    let out = succeeds(&store, &["volume", "rename", "vm1", "vm2"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("renamed volume vm1 to vm2"),
        "{out:?}"
    );
    fails_with(
        &dedupd(&store, &["volume", "rename", "vm1", "x"]),
        "no volume named \"vm1\"",
    );
    fails_with(
        &dedupd(&store, &["volume", "rename", "vm2", "default"]),
        "a volume named \"default\" exists already",
    );
    // new clients find it by the new name only
    let info = |port: u16, name: &str| {
        Command::new("nbdinfo")
            .arg("--size")
            .arg(format!("nbd://127.0.0.1:{port}/{name}"))
            .output()
            .unwrap()
    };
    let out = info(server.port, "vm2");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "8388608");
    assert!(!info(server.port, "vm1").status.success());
    disconnect(held, &store, 0);
    server.stop();
    // without a server, and the name stays after a restart
    succeeds(&store, &["volume", "rename", "vm2", "vm3"]);
    assert_eq!(volume_size(&store, "vm3"), 8 << 20);
    let server = Server::start(&store, &[]);
    let out = info(server.port, "vm3");
    assert!(out.status.success(), "{}", stderr(&out));
    server.stop();
}

#[test]
fn listings_of_a_stopped_store_write_nothing_to_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    // a server killed after a flushed write: its commits wait in the
    // journal, which a checkpoint would fold into the files
    let server = Server::start(&store, &["--default-volume-size", "8M"]);
    common::require("qemu-io");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 0 64k", "-c", "flush"])
        .arg(server.uri("default")));
    server.kill();
    // every file's bytes but the fingerprint store's groups, which each
    // open rebuilds (derived data), and the lock
    let files = || -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
        walk(&store)
            .into_iter()
            .filter(|p| !p.ends_with("fpgroups") && !p.ends_with("lock"))
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect()
    };
    let before = files();
    assert!(
        before
            .iter()
            .any(|(p, b)| p.ends_with("journal") && b.iter().any(|&x| x != 0)),
        "nothing left in the journal"
    );
    succeeds(&store, &["volume", "list"]);
    let out = succeeds(&store, &["stats", "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["physical_blocks_stored"], 1, "{s}");
    // (opening creates the empty map file of a volume created since the
    // last checkpoint, which the journal fills)
    let after = files();
    for (p, b) in &after {
        assert!(
            before.get(p).map_or(b.is_empty(), |was| was == b),
            "a listing changed {}",
            p.display()
        );
    }
    assert!(before.keys().all(|p| after.contains_key(p)));
}

/// Every regular file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if p.is_file() {
            // (not the control socket a killed server leaves)
            out.push(p);
        }
    }
    out
}

#[test]
fn worker_counts_out_of_range_are_refused_and_long_names_keep_the_list_aligned() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    for bad in ["0", "65"] {
        let out = dedupd(&store, &["serve", "--workers", bad]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        fails_with(&out, "--workers");
        assert!(!store.exists(), "a refused serve created the store");
    }
    succeeds(&store, &["init"]);
    let long = "a-volume-name-much-longer-than-twenty-four-characters";
    succeeds(&store, &["volume", "create", long, "8M"]);
    succeeds(&store, &["volume", "create", "short", "16M"]);
    let out = succeeds(&store, &["volume", "list"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // the size column ends at the same place on every line
    let ends: Vec<usize> = text
        .lines()
        .map(|l| {
            l.find(" SIZE")
                .map(|at| at + " SIZE".len())
                .or_else(|| l.find(" MiB").map(|at| at + " MiB".len()))
                .unwrap()
        })
        .collect();
    assert_eq!(ends.len(), 3, "{text}");
    assert!(ends.iter().all(|&e| e == ends[0]), "{text}");
}

#[test]
fn serve_options_that_would_be_ignored_or_cannot_work_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    for (args, says) in [
        (
            &["serve", "--power-source", "battery:5"][..],
            "--power-source applies to adaptive selectivity only",
        ),
        (
            &["serve", "--selectivity", "full", "--selectivity-load"][..],
            "--selectivity-load applies to adaptive selectivity only",
        ),
        (
            &["serve", "--inflight-budget", "1M"][..],
            "--inflight-budget 1M is too small: at least 2M",
        ),
        (
            &["serve", "--journal-size", "0"][..],
            "--journal-size 0 is too small: at least 64K",
        ),
        (
            &["serve", "--max-dirty", "0"][..],
            "--max-dirty 0 is too small: at least 4K",
        ),
        (
            &["serve", "--listen", "localhost"][..],
            "--listen localhost: give HOST:PORT",
        ),
        (
            // (more connections than any open-file limit allows)
            &["serve", "--max-connections", "1000000000000"][..],
            "--max-connections 1000000000000 needs up to",
        ),
    ] {
        let out = dedupd(&store, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        fails_with(&out, says);
        assert!(!store.exists(), "a refused serve created the store");
    }
    let out = dedupd(&store, &["serve", "--max-connections", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    fails_with(
        &out,
        "--max-connections <MAX_CONNECTIONS>': must be at least 1",
    );
}

#[test]
fn a_shrink_without_a_server_needs_shrink_too() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    succeeds(&store, &["init"]);
    succeeds(&store, &["volume", "create", "vm1", "80G"]);
    // the typo of `80G`
    let out = dedupd(&store, &["volume", "resize", "vm1", "80M"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    fails_with(&out, "from 80.00 GiB to 80.00 MiB would discard");
    assert_eq!(volume_size(&store, "vm1"), 80 << 30);
    succeeds(&store, &["volume", "resize", "vm1", "80M", "--shrink"]);
    assert_eq!(volume_size(&store, "vm1"), 80 << 20);
    // --force allows a shrink as well (no client can be connected)
    succeeds(&store, &["volume", "resize", "vm1", "40M", "--force"]);
    assert_eq!(volume_size(&store, "vm1"), 40 << 20);
}

#[test]
fn volume_sizes_are_checked_before_the_store_is_opened() {
    let tmp = tempfile::tempdir().unwrap();
    // (no store there: a size refused first never gets to say so)
    let store = tmp.path().join("none");
    for (cmd, size, want) in [
        ("create", "0", "not a positive multiple of 4K"),
        ("create", "1000", "not a positive multiple of 4K"),
        ("create", "2P", "over the 1 PiB limit"),
        ("resize", "1000", "not a positive multiple of 4K"),
        (
            "create",
            "1.5G",
            "fractional sizes are not accepted; use 1536M",
        ),
        (
            "resize",
            "1.5G",
            "fractional sizes are not accepted; use 1536M",
        ),
    ] {
        let out = dedupd(&store, &["volume", cmd, "v", size]);
        assert_eq!(out.status.code(), Some(2), "{cmd} {size}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(want),
            "{cmd} {size}: {}",
            stderr(&out)
        );
        assert!(!stderr(&out).contains("does not exist"), "{}", stderr(&out));
    }
    assert!(!store.exists());
}

#[test]
fn sighup_stops_the_server_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "16M"]);
    let mut c = connect(server.port, "default");
    // a write the stop must make durable
    let mut write = Vec::new();
    write.extend_from_slice(&0x25609513u32.to_be_bytes());
    write.extend_from_slice(&0u16.to_be_bytes());
    write.extend_from_slice(&1u16.to_be_bytes()); // NBD_CMD_WRITE
    write.extend_from_slice(&1u64.to_be_bytes());
    write.extend_from_slice(&0u64.to_be_bytes());
    write.extend_from_slice(&4096u32.to_be_bytes());
    write.extend_from_slice(&[0x5a; 4096]);
    c.write_all(&write).unwrap();
    let mut reply = [0u8; 16];
    c.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[4..8], &[0; 4], "the write failed");
    drop(c);
    // a closing terminal hangs up twice (its shell, then the kernel): a
    // second SIGHUP does not turn the clean stop into an exit at once
    server.signal(libc::SIGHUP);
    std::thread::sleep(std::time::Duration::from_millis(20));
    server.stop_with(libc::SIGHUP);
    // closed cleanly: opened again without a journal to replay, the
    // block is there
    assert_eq!(stats(&store)["logical_bytes_mapped"], 4096);
}

#[test]
fn serve_started_with_sigint_ignored_still_stops_on_it() {
    // (as a script's background job: `dedupd serve & ... kill -INT $!`)
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start_via(
        &["sh", "-c", "trap '' INT; exec \"$0\" \"$@\""],
        &tmp.path().join("store"),
        &["--default-volume-size", "16M"],
    );
    server.stop_with(libc::SIGINT);
}

#[test]
fn serve_under_nohup_ignores_sighup() {
    common::require("nohup");
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start_via(
        &["nohup"],
        &tmp.path().join("store"),
        &["--default-volume-size", "16M"],
    );
    server.signal(libc::SIGHUP);
    std::thread::sleep(std::time::Duration::from_millis(300));
    // still serving: a client negotiates, and the stop is the clean one
    drop(connect(server.port, "default"));
    server.stop();
}

/// Runs `dedupd serve` on `store` with `args` until it is ready, stops it,
/// and returns what it wrote to stderr.
fn serve_stderr(store: &Path, args: &[&str]) -> String {
    let mut cmd = Command::new(dedupd_bin());
    cmd.arg("--store")
        .arg(store)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args);
    serve_until_ready(cmd).1
}

/// Runs `cmd` (a `dedupd serve`) until it is ready (it printed its stats
/// command), stops it with SIGTERM, asserts it exited 0, and returns what
/// it wrote to stdout until then (lines) and to stderr.
fn serve_until_ready(mut cmd: Command) -> (String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut said = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        let ready = line.starts_with("dedupd: stats:");
        said.push(line);
        if ready {
            break;
        }
    }
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let errors = errors.join().unwrap();
    assert!(status.success(), "dedupd serve: {status}\n{errors}");
    (said.join("\n"), errors)
}

#[test]
fn creation_options_given_for_an_existing_store_are_warned_of() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    // the store is created with them: no warning
    let err = serve_stderr(&store, &["--hash", "blake3", "--default-volume-size", "8M"]);
    assert!(!err.contains("ignored"), "{err}");
    let err = serve_stderr(
        &store,
        &[
            "--hash",
            "sha256",
            "--index-prefix-bits",
            "16",
            "--default-volume-size",
            "64G",
        ],
    );
    assert!(
        err.contains("--hash sha256 ignored: the store exists and its fingerprints are blake3"),
        "{err}"
    );
    assert!(err.contains("--index-prefix-bits 16 ignored"), "{err}");
    assert!(
        err.contains("--default-volume-size 64.00 GiB ignored")
            && err.contains("volume resize default"),
        "{err}"
    );
    // options left at their defaults, or the store's own algorithm, say
    // nothing
    let err = serve_stderr(&store, &[]);
    assert!(!err.contains("ignored"), "{err}");
    let err = serve_stderr(&store, &["--hash", "blake3"]);
    assert!(!err.contains("ignored"), "{err}");
    assert_eq!(volume_size(&store, "default"), 8 << 20);
}

#[test]
fn a_volume_command_whose_output_nobody_reads_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    succeeds(&store, &["init"]);
    for args in [
        &["volume", "create", "v", "4M"][..],
        &["volume", "resize", "v", "8M"],
        &["volume", "delete", "v"],
    ] {
        // stdout: a pipe whose reading end is closed
        let mut fds = [0i32; 2];
        // SAFETY: pipe writes two new descriptors into the array given.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just made and are owned here only.
        let (read, write) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        drop(read);
        let out = Command::new(dedupd_bin())
            .arg("--store")
            .arg(&store)
            .args(args)
            .stdout(Stdio::from(write))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    let out = succeeds(&store, &["volume", "list", "--json"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
}

#[test]
fn a_store_without_its_superblock_gets_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    succeeds(&store, &["init"]);
    std::fs::remove_file(store.join("superblock")).unwrap();
    let out = dedupd(&store, &["volume", "list"]);
    fails_with(&out, "no superblock");
    fails_with(&out, "fsck --repair` rebuilds the superblock");
    // as fsck --repair does; its JSON report carries the exit code
    let out = dedupd(&store, &["fsck", "--repair", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["exit_code"].as_i64(), v["repaired"].as_bool()),
        (Some(1), Some(true)),
        "{v}"
    );
    succeeds(&store, &["volume", "list"]);
    let out = dedupd(&store, &["fsck", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["exit_code"].as_i64(), Some(0), "{v}");
    // given to fsck of an intact superblock, prefix bits change nothing
    let out = dedupd(&store, &["fsck", "--index-prefix-bits", "12"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--index-prefix-bits ignored: the superblock is intact"),
        "{}",
        stderr(&out)
    );
    // prefix bits other than the default: the report says which it would
    // write, and the repair takes them from fsck's option
    let bits12 = tmp.path().join("bits12");
    succeeds(&bits12, &["init", "--index-prefix-bits", "12"]);
    std::fs::remove_file(bits12.join("superblock")).unwrap();
    let out = dedupd(&bits12, &["fsck"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("index prefix bits 14"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = dedupd(&bits12, &["fsck", "--repair", "--index-prefix-bits", "12"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let sb = std::fs::read_to_string(bits12.join("superblock")).unwrap();
    assert!(sb.contains("\"index_prefix_bits\": 12"), "{sb}");
    // an init cut short before its state was written: only removing helps
    let early = tmp.path().join("early");
    std::fs::create_dir(&early).unwrap();
    std::fs::write(early.join("journal"), "").unwrap();
    let out = dedupd(&early, &["fsck"]);
    assert_eq!(out.status.code(), Some(8), "{}", stderr(&out));
    fails_with(&out, "remove the directory and start again");
    // a directory that is not a store is not to be removed
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let out = dedupd(&other, &["volume", "list"]);
    fails_with(&out, "not a dedupd store");
    assert!(!stderr(&out).contains("remove"), "{}", stderr(&out));
    // an empty directory: the commands that make it a store
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = dedupd(&empty, &["stats"]);
    fails_with(&out, "is an empty directory: `dedupd --store");
    fails_with(&out, "init` makes it a store");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    // a file is not made a store, and stays as it was
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "mine").unwrap();
    for cmd in [&["init"][..], &["serve", "--listen", "127.0.0.1:0"]] {
        let out = dedupd(&file, cmd);
        fails_with(&out, "is not a dedupd store: not a directory");
        assert!(!stderr(&out).contains("opening store"), "{}", stderr(&out));
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
}

#[test]
fn fsck_keeps_its_exit_code_when_the_reader_goes_early() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    Server::start(&store, &["--default-volume-size", "16M"]).stop();
    // (`dedupd fsck | grep -q …`: the reader closes its end first)
    let mut child = Command::new(dedupd_bin())
        .arg("--store")
        .arg(&store)
        .arg("fsck")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
    // a report that cannot be written (a full disk) is an operational error
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let status = Command::new(dedupd_bin())
        .arg("--store")
        .arg(&store)
        .arg("fsck")
        .stdout(full)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(8), "{status:?}");
    // with --json, an operational error is a JSON object on stdout too
    let out = dedupd(&tmp.path().join("missing"), &["fsck", "--json"]);
    assert_eq!(out.status.code(), Some(8), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["exit_code"], 8, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("does not exist"),
        "{v}"
    );
}

#[test]
fn an_empty_dedupd_store_variable_is_named_in_the_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(dedupd_bin())
        .current_dir(tmp.path())
        .env("DEDUPD_STORE", "")
        .args(["volume", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    fails_with(&out, "DEDUPD_STORE is set but empty");
    let out = Command::new(dedupd_bin())
        .current_dir(tmp.path())
        .env("DEDUPD_STORE", "")
        .arg("fsck")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(16), "{}", stderr(&out));
    // --store on the command line wins over the empty variable
    let store = tmp.path().join("s");
    let out = Command::new(dedupd_bin())
        .env("DEDUPD_STORE", "")
        .args(["--store", store.to_str().unwrap(), "init"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(store.join("superblock").exists());
    // nothing was created in the working directory
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
}

#[test]
fn a_server_option_before_serve_gets_the_command_line_that_works() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let store = store.to_str().unwrap();
    let out = Command::new(dedupd_bin())
        .current_dir(tmp.path())
        .args([
            "--store",
            store,
            "--listen",
            "127.0.0.1:1",
            "--read-cache=1M",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    fails_with(
        &out,
        &format!("dedupd --store {store} serve --listen 127.0.0.1:1 --read-cache=1M"),
    );
    // nothing was created: the command line was refused before any store
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    // an option that belongs to no command, and a server option given to
    // another command, get no such hint
    for args in [&["--bogus"][..], &["volume", "list", "--listen", "x"]] {
        let out = Command::new(dedupd_bin())
            .current_dir(tmp.path())
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("hint:"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

/// Voluntary context switches of all of process `pid`'s threads: each is
/// a thread going to sleep, so one that wakes to look at something counts.
fn sleeps_of(pid: u32) -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

#[test]
fn an_idle_server_sleeps_and_stops_at_once() {
    // a phone or an edge box: a server with nothing to do must not wake
    // its threads to poll (it woke about 360 times a second when its
    // loops polled every 3 to 50 ms)
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let server = Server::start(&store, &["--default-volume-size", "64M"]);
    // (past the start, whose first out-of-line looks come quickly)
    std::thread::sleep(std::time::Duration::from_secs(3));
    let before = sleeps_of(server.pid());
    std::thread::sleep(std::time::Duration::from_secs(4));
    let woke = sleeps_of(server.pid()) - before;
    assert!(woke <= 40, "{woke} wake-ups in 4 s of idling");
    let started = std::time::Instant::now();
    server.stop();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "an idle server took {:?} to stop",
        started.elapsed()
    );
}

#[test]
fn commands_other_than_serve_take_no_journal_reserve_of_their_own() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let allocated = || {
        std::fs::metadata(store.join("journal"))
            .map(|m| m.blocks() * 512)
            .unwrap()
    };
    succeeds(&store, &["init"]);
    let after_init = allocated();
    // (the server's default reserve is 40 MiB; a small device's server
    // may keep less, and commands run between must not take it back)
    assert!(after_init <= 4 << 20, "init allocated {after_init} bytes");
    succeeds(&store, &["volume", "create", "v", "64M"]);
    succeeds(&store, &["stats"]);
    succeeds(&store, &["dedup", "--offline"]);
    succeeds(&store, &["fsck"]);
    assert!(
        allocated() <= after_init.max(4 << 20),
        "{} bytes after the commands",
        allocated()
    );
}

#[test]
fn a_low_open_file_limit_lowers_the_default_connection_cap_and_many_volumes_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    succeeds(&store, &["init"]);
    for i in 0..10 {
        succeeds(&store, &["volume", "create", &format!("v{i}"), "1M"]);
    }
    // 300 files: 256 for the store, one per volume's map (10), 4 per
    // connection: 8 connections fit
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "ulimit -n 300 && exec \"$0\" \"$@\""])
        .arg(dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["serve", "--listen", "127.0.0.1:0"]);
    let (said, errors) = serve_until_ready(cmd);
    assert!(
        errors.contains("at most 8 NBD connections at once (not 128)"),
        "{errors}"
    );
    assert!(
        said.contains("(10 volumes: v0, v1, v2, v3, v4, v5, v6, v7, … and 2 more: `dedupd --store"),
        "{said}"
    );
    // given explicitly, a cap that does not fit is refused
    let out = Command::new("sh")
        .args(["-c", "ulimit -n 300 && exec \"$0\" \"$@\""])
        .arg(dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["serve", "--listen", "127.0.0.1:0", "--max-connections", "9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    fails_with(&out, "give --max-connections 8 or less");
}

#[test]
fn connections_refused_at_the_limit_are_said_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let mut child = Command::new(dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["serve", "--listen", "127.0.0.1:0", "--max-connections", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut port = None;
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in out.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("dedupd: listening on nbd://127.0.0.1:") {
            port = rest.trim().parse::<u16>().ok();
        }
        if line.starts_with("dedupd: stats:") {
            break;
        }
    }
    std::thread::spawn(move || for _ in out {});
    let (tx, rx) = std::sync::mpsc::channel();
    let err = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let port = port.expect("a TCP port");
    // the one connection allowed, then one the server closes at once
    let held = connect(port, "default");
    let mut refused = TcpStream::connect(("127.0.0.1", port)).unwrap();
    refused
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 18];
    assert_eq!(refused.read(&mut buf).unwrap(), 0, "not closed at once");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut said = Vec::new();
    while Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            said.push(line);
            if said.last().unwrap().contains("refused 1 NBD connection:") {
                break;
            }
        }
    }
    drop(held);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let last = said.last().cloned().unwrap_or_default();
    assert!(
        last.contains(
            "dedupd: warning: refused 1 NBD connection: 1 open already (--max-connections"
        ),
        "{said:?}"
    );
}
