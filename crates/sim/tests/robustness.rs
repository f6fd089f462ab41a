//! Inputs that are valid but odd, or broken: time stamps stepping back,
//! traces without requests, compressed files cut short.

use std::io::Write;
use std::path::{Path, PathBuf};

use dedupd_sim::replay::OutOfLine;
use dedupd_sim::{convert, replay, trace_stats, ReplayConfig, TraceError};

fn h(n: u32) -> String {
    format!("{n:032x}")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// One 4 KiB FIU write: time stamp in ms, LBA in blocks, digest number.
fn fiu_write(ms: u64, block: u64, digest: u32) -> String {
    format!(
        "{} 7 p {} 8 W 8 0 {}\n",
        ms * 1_000_000,
        block * 8,
        h(digest)
    )
}

#[test]
fn a_time_stamp_stepping_back_is_clamped_and_makes_no_idle_gap() {
    let dir = tempfile::tempdir().unwrap();
    // under +prehash the first copy of content is stored without a lookup
    // and queued for the out-of-line pass: the second write of digest 1
    // leaves a duplicate only a pass finds. Line 3 steps back to 20 ms:
    // the file's clock stays at 101 ms, so line 4 comes 49 ms later (no
    // idle gap of 60 ms), not 130 ms after line 3's stamp.
    let stepping_back = [
        fiu_write(100, 0, 1),
        fiu_write(101, 1, 1),
        fiu_write(20, 2, 2),
        fiu_write(150, 3, 3),
    ]
    .concat();
    let cfg = ReplayConfig {
        policy: "exact+prehash".into(),
        out_of_line: OutOfLine::IdleGapMs(60),
        ..ReplayConfig::default()
    };
    let p = write(dir.path(), "back.blkparse", stepping_back.as_bytes());
    let r = replay(std::slice::from_ref(&p), &cfg, &mut |_| {}).unwrap();
    assert_eq!(r.timestamps_clamped, 1);
    assert_eq!(r.requests, 4);
    assert_eq!(r.duplicate_blocks_out_of_line, 0, "a spurious idle gap");
    // a real gap of 60 ms from the clamped clock drains the pending work
    let gap = [
        fiu_write(100, 0, 1),
        fiu_write(101, 1, 1),
        fiu_write(20, 2, 2),
        fiu_write(161, 3, 3),
    ]
    .concat();
    let p = write(dir.path(), "gap.blkparse", gap.as_bytes());
    let r = replay(std::slice::from_ref(&p), &cfg, &mut |_| {}).unwrap();
    assert_eq!(r.timestamps_clamped, 1);
    assert_eq!(r.duplicate_blocks_out_of_line, 1);
    // in order, nothing is clamped
    let sorted = [fiu_write(1, 0, 1), fiu_write(1, 1, 2), fiu_write(2, 2, 3)].concat();
    let p = write(dir.path(), "sorted.blkparse", sorted.as_bytes());
    let r = replay(&[p], &cfg, &mut |_| {}).unwrap();
    assert_eq!(r.timestamps_clamped, 0);
}

#[test]
fn files_merge_by_their_clamped_clocks() {
    let dir = tempfile::tempdir().unwrap();
    // a steps back from 50 to 40 ms: its later requests count as at 50 ms
    // (clamped), so b's request at 45 ms still comes before them
    let a = [
        fiu_write(10, 0, 1),
        fiu_write(50, 1, 2),
        fiu_write(40, 2, 3),
        fiu_write(40, 3, 4),
    ]
    .concat();
    let b = fiu_write(60, 0, 9);
    let pa = write(dir.path(), "a.blkparse", a.as_bytes());
    let pb = write(dir.path(), "b.blkparse", b.as_bytes());
    let r = replay(&[pa, pb], &ReplayConfig::default(), &mut |_| {}).unwrap();
    assert_eq!(r.timestamps_clamped, 2);
    assert_eq!(r.requests, 5);
}

#[test]
fn stats_duration_runs_to_the_largest_time_stamp() {
    let dir = tempfile::tempdir().unwrap();
    let text = [
        fiu_write(1000, 0, 1),
        fiu_write(3000, 1, 2),
        fiu_write(2000, 2, 3),
    ]
    .concat();
    let p = write(dir.path(), "t.blkparse", text.as_bytes());
    let s = trace_stats(&p, None, false).unwrap();
    assert_eq!(s.first_ts_ns, Some(1_000_000_000));
    assert_eq!(s.last_ts_ns, Some(2_000_000_000));
    assert_eq!(s.max_ts_ns, Some(3_000_000_000));
    assert_eq!(s.timestamps_clamped, 1);
}

/// Files from which no request comes: empty, comments only, an empty
/// gzip stream, a native trace of sources only.
fn requestless(dir: &Path) -> Vec<PathBuf> {
    let native = dir.join("sources-only.ddt");
    let mut w =
        dedupd_sim::native::NativeWriter::new(std::fs::File::create(&native).unwrap()).unwrap();
    w.define_source(&dedupd_sim::Source {
        pid: 1,
        process: "p".into(),
        device: 0,
    })
    .unwrap();
    w.finish().unwrap();
    vec![
        write(dir, "empty.blkparse", b""),
        write(dir, "comments.blkparse", b"# a header\n\n# nothing else\n"),
        write(dir, "empty.gz", &gzip(b"")),
        native,
    ]
}

#[test]
fn a_trace_without_requests_is_refused_by_replay_and_convert() {
    let dir = tempfile::tempdir().unwrap();
    for p in requestless(dir.path()) {
        let name = p.display().to_string();
        let e = replay(
            std::slice::from_ref(&p),
            &ReplayConfig::default(),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(matches!(e, TraceError::NoRequests { .. }), "{name}: {e:?}");
        assert_eq!(e.to_string(), format!("{name}: no requests in this trace"));
        // even beside a trace that has some
        let good = write(dir.path(), "good.blkparse", fiu_write(1, 0, 1).as_bytes());
        let e = replay(&[good, p.clone()], &ReplayConfig::default(), &mut |_| {}).unwrap_err();
        assert!(matches!(e, TraceError::NoRequests { .. }), "{name}: {e:?}");

        let out = dir.path().join("out.ddt");
        let e = convert(&p, None, false, &out).unwrap_err();
        assert_eq!(e.to_string(), format!("{name}: no requests in this trace"));
        assert!(!out.exists(), "{name}: an output was left");

        // the figures of such a trace are zeros
        let s = trace_stats(&p, None, false).unwrap();
        assert_eq!((s.requests, s.first_ts_ns, s.max_ts_ns), (0, None, None));
    }
    // malformed lines only, skipped: no requests either, and said so
    let bad = write(dir.path(), "bad.blkparse", b"nonsense\nmore nonsense\n");
    let cfg = ReplayConfig {
        skip_bad: true,
        ..ReplayConfig::default()
    };
    let e = replay(std::slice::from_ref(&bad), &cfg, &mut |_| {}).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("bad.blkparse: no requests in this trace (2 malformed lines skipped)"),
        "{e}"
    );
    let s = trace_stats(&bad, None, true).unwrap();
    assert_eq!((s.requests, s.bad_records_skipped), (0, 2));
    // requests past the 1 PiB volume limit only, skipped: the same
    let far = write(
        dir.path(),
        "far.blkparse",
        format!(
            "1 1 p {} 8 W 0 0 0123456789abcdef0123456789abcdef\n",
            1u64 << 51
        )
        .as_bytes(),
    );
    let e = replay(std::slice::from_ref(&far), &cfg, &mut |_| {}).unwrap_err();
    assert!(matches!(e, TraceError::NoRequests { .. }), "{e:?}");
    assert!(e.to_string().contains("far.blkparse: no requests"), "{e}");
}

#[test]
fn a_truncated_gzip_names_the_line_being_read() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..2000u64)
        .map(|i| fiu_write(i, i, i as u32 + 1))
        .collect();
    let gz = gzip(text.as_bytes());
    let p = write(dir.path(), "cut.blkparse.gz", &gz[..gz.len() / 2]);
    let e = replay(
        std::slice::from_ref(&p),
        &ReplayConfig::default(),
        &mut |_| {},
    )
    .unwrap_err();
    let &TraceError::IoAtLine { line, .. } = &e else {
        panic!("{e:?}")
    };
    // well after the first line, well before the last
    assert!((100..2000).contains(&line), "{e}");
    let msg = e.to_string();
    let prefix = format!("{}:{line}: ", p.display());
    assert!(msg.starts_with(&prefix), "{msg}");
    // the same for the other readers of a trace
    assert!(trace_stats(&p, None, false)
        .unwrap_err()
        .to_string()
        .starts_with(&prefix));
    let e = convert(&p, None, false, &dir.path().join("o.ddt")).unwrap_err();
    assert!(e.to_string().starts_with(&prefix), "{e}");
}
