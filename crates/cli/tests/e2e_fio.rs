//! End to end with fio's `nbd` engine and qemu-img (issue: block device, test a).
//!
//! 1. 4 KiB random writes with `dedupe_percentage=50` through NBD; the same
//!    job against a local file is the reference (fio's buffers are
//!    deterministic for a given seed and queue depth). `qemu-img compare` says identical,
//!    and stats show 50 % ± 5 points of written blocks eliminated: exactly
//!    the duplicates and distinct blocks the reference image holds.
//! 2. A second job with `verify=crc32c` (every block unique) checks reads
//!    under concurrency (two jobs, queue depth 16 each).

mod common;

use std::process::Command;

use common::{require, run, stats, Server};

const REGION: &str = "128M";

fn fio_write_job(target: &[&str]) -> Command {
    let mut c = Command::new("fio");
    c.args([
        "--name=dedup50",
        "--rw=randwrite",
        "--bs=4k",
        &format!("--size={REGION}"),
        "--dedupe_percentage=50",
        "--randseed=1234",
        // fio's buffer contents depend on the queue depth, not on the engine
        "--iodepth=16",
        "--output-format=terse",
    ]);
    c.args(target);
    c
}

#[test]
fn fio_dedupe_50_percent_matches_reference_and_verifies() {
    require("fio");
    require("qemu-img");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let reference = tmp.path().join("reference.img");

    // reference: the same job against a plain file
    std::fs::File::create(&reference)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    run(&mut fio_write_job(&[
        "--ioengine=psync",
        &format!("--filename={}", reference.display()),
    ]));

    // every block through inline dedup: this test measures inline dedup
    let server = Server::start(
        &store,
        &["--default-volume-size", REGION, "--selectivity", "full"],
    );
    let uri = server.uri("default");
    run(&mut fio_write_job(&[
        "--ioengine=nbd",
        &format!("--uri={uri}"),
    ]));

    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&reference)
        .arg(&uri));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("identical"),
        "qemu-img compare: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    let s = stats(&store);
    let pct = s["duplicate_writes_eliminated_percent"].as_f64().unwrap();
    let written = s["blocks_written"].as_u64().unwrap();
    assert_eq!(
        written,
        (128 << 20) / 4096,
        "every 4 KiB block of the region is written once"
    );
    assert!(
        (45.0..=55.0).contains(&pct),
        "duplicate writes eliminated {pct:.1} % (expected 50 ± 5)"
    );
    // exactly: fio wrote each block once (the count above), so the blocks
    // of the reference image are what was written; the in-memory index
    // holds every fingerprint of this region, so inline dedup is exact
    let image = std::fs::read(&reference).unwrap();
    let mut distinct = std::collections::HashSet::new();
    let mut nonzero = 0u64;
    for block in image.chunks_exact(4096) {
        if block.iter().any(|&b| b != 0) {
            nonzero += 1;
            distinct.insert(block);
        }
    }
    let distinct = distinct.len() as u64;
    assert!(distinct < nonzero, "the job wrote no duplicates");
    assert_eq!(s["physical_blocks_stored"].as_u64().unwrap(), distinct);
    assert_eq!(
        s["duplicate_writes_eliminated"].as_u64().unwrap(),
        nonzero - distinct
    );
    assert_eq!(
        s["zero_blocks_written"].as_u64().unwrap(),
        written - nonzero
    );
    let ratio = s["dedup_ratio"].as_f64().unwrap();
    assert!(
        ratio > 1.6,
        "dedup ratio {ratio} too low for 50 % duplicates"
    );

    // concurrent verified writes and reads on a second volume
    let out = run(Command::new(common::dedupd_bin())
        .arg("--store")
        .arg(&store)
        .args(["volume", "create", "verify", "256M"]));
    assert!(out.status.success());
    run(Command::new("fio").args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri("verify")),
        "--rw=randwrite",
        "--bs=4k",
        "--size=64M",
        "--numjobs=2",
        "--offset_increment=64M",
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--do_verify=1",
        "--group_reporting",
        "--output-format=terse",
    ]));
    server.stop();
}
