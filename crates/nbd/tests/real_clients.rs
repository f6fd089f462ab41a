//! Interoperability: real NBD clients (libnbd's `nbdinfo`, QEMU's
//! `qemu-io`) against the in-process server, over TCP and a Unix socket.
//!
//! These clients must be installed; a missing binary fails the test.

mod common;

use std::process::{Command, Output};

use common::{Harness, DISK_SIZE};
use dedupd_nbd::ServerConfig;

fn run(program: &str, args: &[&str]) -> Output {
    match Command::new(program).args(args).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "`{program}` is not installed or not on PATH; it is required by this test \
             (nbdinfo comes with libnbd, e.g. Debian package libnbd-bin; qemu-io with \
             qemu-utils)"
        ),
        Err(e) => panic!("could not run `{program}`: {e}"),
    }
}

fn text(out: &Output) -> String {
    format!(
        "status: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn check_nbdinfo(uri: &str, expected_size: u64, read_only: bool) {
    let out = run("nbdinfo", &["--json", uri]);
    let all = text(&out);
    assert!(out.status.success(), "nbdinfo failed for {uri}:\n{all}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let compact: String = stdout.split_whitespace().collect();
    assert!(
        compact.contains(&format!("\"export-size\":{expected_size}")),
        "unexpected nbdinfo output for {uri}:\n{all}"
    );
    assert!(
        compact.contains(&format!("\"is_read_only\":{read_only}")),
        "unexpected read-only state for {uri}:\n{all}"
    );
    assert!(compact.contains("\"can_flush\":true"), "{all}");
    // a read-only export offers none of the write features
    let writable = !read_only;
    for feature in ["can_fua", "can_trim", "can_zero"] {
        assert!(
            compact.contains(&format!("\"{feature}\":{writable}")),
            "{feature} should be {writable} for {uri}:\n{all}"
        );
    }
    assert!(compact.contains("\"can_multi_conn\":true"), "{all}");
}

fn check_qemu_io(uri: &str, pattern: u8, offset: u64) {
    let write = format!("write -P {pattern:#x} {offset} 64k");
    let read = format!("read -P {pattern:#x} {offset} 64k");
    let out = run(
        "qemu-io",
        &["-f", "raw", "-c", &write, "-c", &read, "-c", "flush", uri],
    );
    let all = text(&out);
    assert!(out.status.success(), "qemu-io failed for {uri}:\n{all}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("wrote 65536/65536 bytes"), "{all}");
    assert!(stdout.contains("read 65536/65536 bytes"), "{all}");
    assert!(!all.contains("Pattern verification failed"), "{all}");
}

#[test]
fn nbdinfo_over_tcp_and_unix() {
    let h = Harness::start(ServerConfig::default());
    let port = h.addr.port();
    check_nbdinfo(
        &format!("nbd://127.0.0.1:{port}/disk"),
        DISK_SIZE as u64,
        false,
    );
    check_nbdinfo(&format!("nbd://127.0.0.1:{port}/ro"), 1 << 20, true);
    // The default export (empty name).
    check_nbdinfo(&format!("nbd://127.0.0.1:{port}"), DISK_SIZE as u64, false);
    let sock = h.socket_path.display().to_string();
    check_nbdinfo(
        &format!("nbd+unix:///disk?socket={sock}"),
        DISK_SIZE as u64,
        false,
    );

    // Listing exports.
    let out = run(
        "nbdinfo",
        &["--list", "--json", &format!("nbd://127.0.0.1:{port}")],
    );
    let all = text(&out);
    assert!(out.status.success(), "nbdinfo --list failed:\n{all}");
    assert!(all.contains("\"disk\"") && all.contains("\"ro\""), "{all}");

    // Unknown export: a clean failure.
    let out = run("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/nope")]);
    assert!(!out.status.success(), "{}", text(&out));
    h.stop();
}

#[test]
fn qemu_io_over_tcp_and_unix() {
    let h = Harness::start(ServerConfig::default());
    let port = h.addr.port();
    check_qemu_io(&format!("nbd://127.0.0.1:{port}/disk"), 0xab, 0);
    assert!(h.provider.disk.data.lock().unwrap()[..65536]
        .iter()
        .all(|&b| b == 0xab));
    let sock = h.socket_path.display().to_string();
    check_qemu_io(&format!("nbd+unix:///disk?socket={sock}"), 0xcd, 1 << 20);
    assert!(
        h.provider.disk.data.lock().unwrap()[1 << 20..(1 << 20) + 65536]
            .iter()
            .all(|&b| b == 0xcd)
    );

    // Zeroing and discarding through QEMU.
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -z 0 4k",
            "-c",
            "read -P 0 0 4k",
            "-c",
            "discard 4k 4k",
            "-c",
            "read -P 0xab 8k 4k",
            &uri,
        ],
    );
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(!all.contains("Pattern verification failed"), "{all}");

    // Writing to the read-only export fails cleanly.
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 1 0 4k",
            &format!("nbd://127.0.0.1:{port}/ro"),
        ],
    );
    assert!(
        !out.status.success(),
        "write to read-only export did not fail:\n{}",
        text(&out)
    );
    assert!(h.provider.ro.data.lock().unwrap().iter().all(|&b| b == 0));
    h.stop();
}

/// QEMU splits WRITE_ZEROES at the advertised 32 MiB maximum; a discard of
/// exactly 32 MiB is accepted. (QEMU does not split discards at the
/// advertised maximum; the server accepts TRIMs of any length inside the
/// export.)
#[test]
fn qemu_io_large_zero_is_split_and_32m_discard_works() {
    let h = Harness::start(ServerConfig::default());
    let uri = format!("nbd://127.0.0.1:{}/null", h.addr.port());
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -z 0 100M",
            "-c",
            "discard 0 32M",
            &uri,
        ],
    );
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(!all.contains("failed"), "{all}");
    assert_eq!(
        *h.provider.null.longest_zero.lock().unwrap(),
        32 << 20,
        "{all}"
    );
    assert_eq!(
        *h.provider.null.longest_trim.lock().unwrap(),
        32 << 20,
        "{all}"
    );
    h.stop();
}
