//! Trace formats, replay figures, generators: fixtures of our own, and the
//! real FIU samples in ../shared/traces/fiu when that folder exists.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use dedupd_sim::gen::{Locality, StreamSpec};
use dedupd_sim::{
    convert, generate_to, replay, trace_stats, Format, GenSpec, Op, ReplayConfig, Request,
    StreamBy, TraceError, TraceReader,
};

const ZERO_4K: &str = "620f0b67a91f7f74151bc5be745b7110";
const ZERO_512: &str = "bf619eac0cdf3f68d496ea9344137e8b";

/// The real FIU samples: `$DEDUPD_FIU_SAMPLES`, else ../shared/traces/fiu
/// beside the repository; `None` (said on stderr) where neither exists,
/// and the tests that need them check the fixtures of their own only.
fn samples_dir() -> Option<PathBuf> {
    let d = std::env::var_os("DEDUPD_FIU_SAMPLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces/fiu")
        });
    let found = d.join("mail-01-sample.blkparse").exists();
    if !found {
        eprintln!(
            "real FIU samples not found in {} (set DEDUPD_FIU_SAMPLES): this test checks only its own fixtures",
            d.display()
        );
    }
    found.then_some(d)
}

fn h(n: u32) -> String {
    format!("{n:032x}")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn run(paths: &[PathBuf], cfg: &ReplayConfig) -> dedupd_sim::Report {
    replay(paths, cfg, &mut |_| {}).unwrap()
}

fn read_all(path: &Path, format: Option<Format>) -> Vec<Request> {
    let mut r = TraceReader::open(path, format, false, Arc::new(AtomicU64::new(0))).unwrap();
    let mut out = Vec::new();
    let mut q = Request::default();
    while r.next_into(&mut q).unwrap() {
        out.push(q.clone());
    }
    out
}

/// Independent count over FIU text: (requests, reads, writes, blocks
/// written, zero blocks, exact duplicate blocks). Aligned 8-sector requests
/// only (as in the samples): one block per line, keyed by its digest field.
fn independent_fiu(text: &str) -> (u64, u64, u64, u64, u64, u64) {
    let zero_sector_block = ZERO_512.repeat(8);
    let (mut req, mut reads, mut writes, mut blocks, mut zeros, mut dups) = (0, 0, 0, 0, 0, 0);
    let mut seen = HashSet::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        req += 1;
        assert_eq!(f[4], "8", "the samples hold 8-sector requests only");
        if f[5] == "R" {
            reads += 1;
            continue;
        }
        writes += 1;
        blocks += 1;
        let d = f[8];
        if d == ZERO_4K || d == zero_sector_block {
            zeros += 1;
        } else if !seen.insert(d.to_string()) {
            dups += 1;
        }
    }
    (req, reads, writes, blocks, zeros, dups)
}

/// Fixtures in the two layouts of the FIU samples, for where the samples
/// are absent: `homes` (all writes, eight 512-byte sector digests per 4 KiB
/// page, zero pages and repeated content among them, two devices) and
/// `mail` (mostly reads, one digest per page). Aligned 8-sector requests,
/// as [`independent_fiu`] expects.
fn fiu_fixtures(dir: &Path) -> PathBuf {
    let mut homes = String::new();
    for i in 0..400u32 {
        let digests: String = if i % 13 == 0 {
            ZERO_512.repeat(8)
        } else {
            (0..8).map(|k| h((i % 151) * 8 + k)).collect()
        };
        let minor = i % 2;
        homes += &format!(
            "{} 5 nfsd {} 8 W 8 {minor} {digests}\n",
            1000 + i,
            (i % 90) * 8
        );
    }
    write(dir, "homes-sample.1.blkparse", &homes);
    let mut mail = String::new();
    for i in 0..300u32 {
        let op = if i % 9 == 0 { "W" } else { "R" };
        let d = if i % 27 == 0 {
            ZERO_4K.to_string()
        } else {
            h(i % 40)
        };
        mail += &format!("{} 9 dovecot {} 8 {op} 6 0 {d}\n", 2000 + i, (i % 70) * 8);
    }
    write(dir, "mail-01-sample.blkparse", &mail);
    dir.to_path_buf()
}

#[test]
fn real_fiu_samples_replay_with_independently_computed_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = samples_dir().unwrap_or_else(|| fiu_fixtures(tmp.path()));
    let (mut requests, mut counted_writes, mut counted_zeros, mut counted_dups) = (0, 0, 0, 0);
    for name in ["homes-sample.1.blkparse", "mail-01-sample.blkparse"] {
        let p = dir.join(name);
        let text = std::fs::read_to_string(&p).unwrap();
        let (req, reads, writes, blocks, zeros, dups) = independent_fiu(&text);
        requests += req;
        counted_writes += writes;
        counted_zeros += zeros;
        counted_dups += dups;
        let r = run(std::slice::from_ref(&p), &ReplayConfig::default());
        assert_eq!(r.requests, req, "{name}");
        assert_eq!(r.reads, reads, "{name}");
        assert_eq!(r.writes, writes, "{name}");
        assert_eq!(r.blocks_written, blocks, "{name}");
        assert_eq!(r.zero_blocks_written, zeros, "{name}");
        assert_eq!(r.exact_duplicate_blocks, dups, "{name}");
        assert_eq!(r.distinct_fingerprints, blocks - zeros - dups, "{name}");
        // the engine's exact index finds every duplicate unless content was
        // overwritten and freed before it recurred
        assert!(r.duplicate_blocks_inline <= dups, "{name}");
        assert!(r.extents > 0 && r.extents <= r.mapped_blocks, "{name}");
        let s = trace_stats(&p, None, false).unwrap();
        assert_eq!(s.format, Some(Format::Fiu));
        assert_eq!(
            (s.requests, s.blocks_written, s.exact_duplicate_blocks),
            (req, blocks, dups)
        );
    }
    // the inputs hold what the checks are about
    assert!(counted_writes > 0 && counted_zeros > 0 && counted_dups > 0);
    // both at once: a stream per (file, device), interleaved; totals add up
    let a = dir.join("homes-sample.1.blkparse");
    let b = dir.join("mail-01-sample.blkparse");
    let devices = |p: &Path| {
        let text = std::fs::read_to_string(p).unwrap();
        let set: HashSet<(String, String)> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[6].to_string(), f[7].to_string())
            })
            .collect();
        set.len()
    };
    let streams = devices(&a) + devices(&b);
    let r = run(&[a, b], &ReplayConfig::default());
    assert_eq!(r.streams.len(), streams);
    assert_eq!(r.requests, requests);
}

#[test]
fn fiu_per_page_layout_multi_page_unaligned_and_zero() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "# comment\n\
         100 7 proc 0 16 W 8 0 {a}{b}\n\
         200 7 proc 16 8 W 8 0 {a}\n\
         300 7 proc 3 8 W 8 0 {z}{c}\n\
         400 9 other 64 8 R 8 0 {b}\n\
         \n\
         500 9 other 72 4 W 8 0 {b}\n",
        a = h(1),
        b = h(2),
        c = h(3),
        z = ZERO_4K
    );
    let p = write(dir.path(), "t.blkparse", &text);
    let reqs = read_all(&p, None);
    assert_eq!(reqs.len(), 5);
    assert_eq!(reqs[0].blocks.len(), 2);
    // unaligned: sectors 3..11 touch blocks 0 and 1, one digest each
    assert_eq!(reqs[2].first_block(), 0);
    assert_eq!(reqs[2].blocks_touched(), 2);
    assert_eq!(reqs[2].blocks[0], None);
    assert_eq!(reqs[3].op, Some(Op::Read));
    // half a page with one digest
    assert_eq!(reqs[4].blocks.len(), 1);
    let r = run(&[p], &ReplayConfig::default());
    assert_eq!((r.writes, r.reads, r.blocks_written), (4, 1, 6));
    assert_eq!(r.zero_blocks_written, 1);
    // a, b, a, [zero], c, b: exact duplicates a and b
    assert_eq!(r.exact_duplicate_blocks, 2);
    assert_eq!(r.distinct_fingerprints, 3);
}

#[test]
fn fiu_two_sectors_across_a_page_boundary_follow_the_files_layout() {
    // per page: a 2-sector write at sector 7 touches two pages and carries
    // two digests, as many as its sectors; it is read per page, and the
    // file stays per page for the one-sector line after it
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "1 7 proc 0 8 W 8 0 {a}\n\
         2 7 proc 8 8 W 8 0 {b}\n\
         3 7 proc 7 2 W 8 0 {c}{c}\n\
         4 7 proc 16 1 W 8 0 {a}\n",
        a = h(1),
        b = h(2),
        c = h(3),
    );
    let p = write(dir.path(), "t.blkparse", &text);
    let r = run(&[p], &ReplayConfig::default());
    assert_eq!(r.blocks_written, 5);
    // a, b, c, c, a: c and a repeat
    assert_eq!(r.exact_duplicate_blocks, 2);
}

#[test]
fn a_malformed_line_registers_no_source() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "1 7 good 0 8 W 8 0 {a}\n\
         2 77 bad 0 8 W 8 0 {g}\n",
        a = h(1),
        g = "g".repeat(32),
    );
    let p = write(dir.path(), "t.blkparse", &text);
    let mut r = TraceReader::open(&p, None, true, Arc::new(AtomicU64::new(0))).unwrap();
    let mut q = Request::default();
    while r.next_into(&mut q).unwrap() {}
    assert_eq!(r.bad_records(), 1);
    assert_eq!(r.sources().len(), 1, "{:?}", r.sources());
}

#[test]
fn fiu_per_sector_layout_combines_eight_digests_per_block() {
    let dir = tempfile::tempdir().unwrap();
    let blk = |base: u32| (0..8).map(|i| h(base + i)).collect::<String>();
    let zero = ZERO_512.repeat(8);
    let text = format!(
        "1 5 nfsd 0 8 W 6 0 {x}\n\
         2 5 nfsd 8 16 W 6 0 {x}{y}\n\
         3 5 nfsd 24 8 W 6 0 {zero}\n\
         4 5 nfsd 40 8 W 6 0 {y}\n",
        x = blk(100),
        y = blk(200)
    );
    let p = write(dir.path(), "homes.blkparse", &text);
    let reqs = read_all(&p, Some(Format::Fiu));
    assert_eq!(reqs[1].blocks.len(), 2);
    assert_eq!(reqs[0].blocks[0], reqs[1].blocks[0]);
    assert_ne!(reqs[1].blocks[0], reqs[1].blocks[1]);
    assert_eq!(reqs[2].blocks, vec![None]);
    let r = run(&[p], &ReplayConfig::default());
    assert_eq!(r.blocks_written, 5);
    assert_eq!(r.zero_blocks_written, 1);
    assert_eq!(r.exact_duplicate_blocks, 2);
    assert_eq!(r.duplicate_blocks_inline, 2);
    assert!((r.dedup_ratio - 2.0).abs() < 1e-9);
    // LBA 0→P0, 1→P0, 2→P1, 5→P1: runs {0}, {1, 2}, {5}
    assert_eq!((r.mapped_blocks, r.extents), (4, 3));
}

#[test]
fn mobile_format_is_detected_and_read() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "0.5\tW\t0\t16\t1200\tcom.whatsapp\t{a}-{b}\n\
         1.25\tR\t0\t8\t1200\tcom.whatsapp\t{a}\n\
         2\tW\t64\t8\t1300\tcom.tencent.mm\t{a}\n\
         3.000000001\tW\t72\t8\t1300\tcom.tencent.mm\t{z}\n",
        a = h(7),
        b = h(8),
        z = ZERO_4K
    );
    let p = write(dir.path(), "mobile.txt", &text);
    let reqs = read_all(&p, None);
    assert_eq!(reqs.len(), 4);
    assert_eq!(reqs[0].ts_ns, 500_000_000);
    assert_eq!(reqs[1].ts_ns, 1_250_000_000);
    assert_eq!(reqs[3].ts_ns, 3_000_000_001);
    let s = trace_stats(&p, None, false).unwrap();
    assert_eq!(s.format, Some(Format::Mobile));
    assert_eq!((s.writes, s.reads, s.blocks_written), (3, 1, 4));
    assert_eq!((s.exact_duplicate_blocks, s.zero_blocks_written), (1, 1));
    assert_eq!((s.sources, s.processes), (2, 2));
    let cfg = ReplayConfig {
        stream_by: StreamBy::Process,
        ..ReplayConfig::default()
    };
    let r = run(&[p], &cfg);
    assert_eq!(r.streams.len(), 2);
    // the duplicate is across volumes: the engine shares it too
    assert_eq!(r.duplicate_blocks_inline, 1);
}

#[test]
fn an_fiu_trace_separated_by_tabs_is_read_as_fiu() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("1\t1\tp\t0\t8\tW\t8\t0\t{}\n", h(3));
    let p = write(dir.path(), "tab.fiu", &text);
    assert_eq!(
        dedupd_sim::detect_format(text.as_bytes()),
        dedupd_sim::Format::Fiu
    );
    let s = trace_stats(&p, None, false).unwrap();
    assert_eq!((s.format, s.writes), (Some(Format::Fiu), 1));
}

#[test]
fn volumes_are_named_by_stream_index_and_labels_keep_the_file_and_process() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "0.5\tW\t0\t8\t1200\tkworker/0:1\t{a}\n\
         1\tW\t8\t8\t1300\tcom.example\t{a}\n",
        a = h(7),
    );
    let p = write(dir.path(), "phone.txt", &text);
    let cfg = ReplayConfig {
        stream_by: StreamBy::Process,
        ..ReplayConfig::default()
    };
    let r = run(&[p], &cfg);
    let volumes: Vec<&str> = r.streams.iter().map(|s| s.volume.as_str()).collect();
    assert_eq!(volumes, ["s0", "s1"]);
    let labels: Vec<&str> = r.streams.iter().map(|s| s.name.as_str()).collect();
    let file = dir.path().join("phone.txt").display().to_string();
    assert_eq!(
        labels,
        [format!("{file}:kworker/0:1"), format!("{file}:com.example")]
    );
}

/// A report as JSON without what names the trace's file (its path and
/// the stream labels) or depends on the clock or the process (its
/// resident memory).
fn report_without_names(r: &dedupd_sim::Report) -> serde_json::Value {
    let mut v = serde_json::to_value(r).unwrap();
    let o = v.as_object_mut().unwrap();
    for k in ["traces", "elapsed_seconds", "requests_per_second"] {
        assert!(o.remove(k).is_some(), "{k}");
    }
    let engine = o["engine"].as_object_mut().unwrap();
    for k in ["rss_bytes", "peak_rss_bytes"] {
        assert!(engine.remove(k).is_some(), "{k}");
    }
    for s in o["streams"].as_array_mut().unwrap() {
        s.as_object_mut().unwrap().remove("name").unwrap();
    }
    v
}

#[test]
fn every_form_of_a_trace_gives_the_same_report() {
    // the real FIU sample if it is there, else lines in its format
    let real = samples_dir().map(|d| d.join("mail-01-sample.blkparse"));
    let text = real
        .and_then(|r| std::fs::read_to_string(r).ok())
        .unwrap_or_else(|| {
            (0..3000u32)
                .map(|i| {
                    format!(
                        "{} 4253 nfsd {} 8 W 6 0 {}\n",
                        1000 + i,
                        (i % 500) * 8,
                        h(i % 700)
                    )
                })
                .collect()
        });
    let dir = tempfile::tempdir().unwrap();
    let plain = write(dir.path(), "mail.blkparse", &text);
    let gz = dir.path().join("another-name-entirely.blkparse.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    enc.write_all(text.as_bytes()).unwrap();
    enc.finish().unwrap();
    let native = dir.path().join("m.ddt");
    convert(&plain, None, false, &native).unwrap();
    for policy in ["exact", "lru"] {
        let cfg = ReplayConfig {
            policy: policy.into(),
            index_memory_bytes: (policy != "exact").then_some(8192),
            ..ReplayConfig::default()
        };
        let want = run(std::slice::from_ref(&plain), &cfg);
        assert!(want.journal_bytes > 0 && want.checkpoint_bytes > 0);
        let want = report_without_names(&want);
        for other in [&gz, &native] {
            let got = report_without_names(&run(std::slice::from_ref(other), &cfg));
            assert_eq!(got, want, "{policy}: {other:?}");
        }
    }
}

#[test]
fn a_mobile_trace_with_a_comment_first_and_a_bad_line_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "# a MobileAppTraces sample\n\
         0.5\tW\t0\t8\t1200\tcom.whatsapp\t{a}\n\
         1\tW\t8\t8\t777\tevil\tzz\n\
         2\tW\t64\t8\t1300\tcom.tencent.mm\t{a}\n",
        a = h(7),
    );
    let p = write(dir.path(), "mobile.txt", &text);
    let s = trace_stats(&p, None, true).unwrap();
    assert_eq!(s.format, Some(Format::Mobile));
    assert_eq!((s.writes, s.bad_records_skipped), (2, 1));
    // the skipped line's process is not a source
    assert_eq!((s.sources, s.processes), (2, 2), "{s:?}");
}

#[test]
fn the_format_of_a_gzip_file_of_several_members_is_detected_past_the_first() {
    // the first member holds only a comment: the decoder's first read
    // stops at its end, before any record line
    let dir = tempfile::tempdir().unwrap();
    let gz = dir.path().join("m.gz");
    let mut bytes = Vec::new();
    for part in [
        "# a MobileAppTraces sample\n".to_string(),
        format!("0.5\tW\t0\t8\t1200\tcom.whatsapp\t{}\n", h(7)),
    ] {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(part.as_bytes()).unwrap();
        bytes.extend(e.finish().unwrap());
    }
    std::fs::write(&gz, &bytes).unwrap();
    let s = trace_stats(&gz, None, false).unwrap();
    assert_eq!(s.format, Some(Format::Mobile));
    assert_eq!(s.writes, 1);
}

#[test]
fn gzip_and_zstd_input_are_read_directly() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "1 7 p 0 8 W 8 0 {a}\n2 7 p 8 8 W 8 0 {a}\n3 7 p 16 8 W 8 0 {b}\n",
        a = h(1),
        b = h(2)
    );
    let gz = dir.path().join("t.blkparse.gz");
    let mut e = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    e.write_all(text.as_bytes()).unwrap();
    e.finish().unwrap();
    // the name says nothing: detection is by magic bytes
    let zst = dir.path().join("t.data");
    std::fs::write(&zst, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
    for p in [gz, zst] {
        let r = run(std::slice::from_ref(&p), &ReplayConfig::default());
        assert_eq!(
            (r.blocks_written, r.exact_duplicate_blocks),
            (3, 1),
            "{p:?}"
        );
    }
}

#[test]
fn bad_lines_name_file_and_line_or_are_counted_with_skip_bad() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "1 7 p 0 8 W 8 0 {a}\n\
         2 7 p 8 8 X 8 0 {a}\n\
         3 7 p 16 8 W 8 0 {a}zz\n\
         4 7 p 16 8 W 8 0 {a}\n",
        a = h(1)
    );
    let p = write(dir.path(), "bad.blkparse", &text);
    let err = replay(
        std::slice::from_ref(&p),
        &ReplayConfig::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(err, TraceError::BadLine { line: 2, .. }), "{err}");
    assert!(
        err.to_string().contains("bad.blkparse:2:"),
        "message names file:line: {err}"
    );
    let cfg = ReplayConfig {
        skip_bad: true,
        ..ReplayConfig::default()
    };
    let r = run(&[p], &cfg);
    assert_eq!(r.bad_records_skipped, 2);
    assert_eq!(r.writes, 2);
}

#[test]
fn a_refused_request_is_named_by_its_own_line_though_later_lines_were_read() {
    // requests are read ahead of their turn (for prefetching): the error
    // must still name the refused request's line, not the reader's
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for i in 0..100u64 {
        text += &format!(
            "{} 7 p {} 8 W 8 0 {}\n",
            i + 1,
            i * 8,
            h((i % 7) as u32 + 1)
        );
    }
    // line 101: past the 1 PiB volume (2^41 sectors)
    text += &format!("101 7 p {} 8 W 8 0 {}\n", 1u64 << 41, h(1));
    for i in 0..50u64 {
        text += &format!("{} 7 p {} 8 W 8 0 {}\n", 102 + i, i * 8, h(i as u32 + 100));
    }
    let p = write(dir.path(), "far.blkparse", &text);
    let err = replay(
        std::slice::from_ref(&p),
        &ReplayConfig::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("far.blkparse:101:"),
        "message names the refused line: {err}"
    );
    let cfg = ReplayConfig {
        skip_bad: true,
        ..ReplayConfig::default()
    };
    let r = run(&[p], &cfg);
    assert_eq!((r.bad_records_skipped, r.writes), (1, 150));
}

#[test]
fn unknown_policy_or_filter_is_a_clear_error() {
    for (policy, msg) in [
        ("mru", "unknown policy \"mru\""),
        ("lru+dedup", "unknown filter \"dedup\""),
        ("lru+t0", "bad threshold"),
        (
            "lru+t99999999999",
            "bad threshold \"t99999999999\" (tN with N from 1 to 4294967295 blocks)",
        ),
        ("lru+t4+t8", "gives a threshold (tN) twice"),
        ("lru+prehash+prehash", "gives prehash twice"),
    ] {
        let cfg = ReplayConfig {
            policy: policy.into(),
            ..ReplayConfig::default()
        };
        let err = replay(&[], &cfg, &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains(msg), "{err}");
    }
    let cfg = ReplayConfig {
        index_memory_bytes: Some(1 << 20),
        ..ReplayConfig::default()
    };
    assert!(replay(&[], &cfg, &mut |_| {}).is_err());
}

#[test]
fn multiple_files_interleave_by_time_stamp() {
    let dir = tempfile::tempdir().unwrap();
    // the same block is written in both files; overwritten in a at t=30
    let a = write(
        dir.path(),
        "a.blkparse",
        &format!(
            "10 1 p 0 8 W 8 0 {x}\n30 1 p 0 8 W 8 0 {y}\n",
            x = h(1),
            y = h(2)
        ),
    );
    let b = write(
        dir.path(),
        "b.blkparse",
        &format!("20 2 q 0 8 W 8 0 {x}\n", x = h(1)),
    );
    let r = run(&[a, b], &ReplayConfig::default());
    assert_eq!(r.streams.len(), 2);
    // t=20 comes before the overwrite: still a duplicate inline
    assert_eq!(r.duplicate_blocks_inline, 1);
}

fn gen_bytes(spec: &GenSpec) -> Vec<u8> {
    let mut out = Vec::new();
    generate_to(spec, &mut out, "mem").unwrap();
    out
}

fn spec(locality: Locality, seed: u64) -> GenSpec {
    GenSpec {
        streams: vec![StreamSpec {
            locality,
            share: 1,
            name: "s".into(),
        }],
        size_bytes: 16 << 20,
        block_bytes: 4096,
        volume_bytes: 64 << 20,
        sequential: false,
        dup_percent: 50.0,
        copy_runs: false,
        seed,
    }
}

#[test]
fn generators_are_deterministic() {
    let s = spec(Locality::Uniform, 7);
    assert_eq!(gen_bytes(&s), gen_bytes(&s));
    assert_ne!(gen_bytes(&s), gen_bytes(&spec(Locality::Uniform, 8)));
    let mix = GenSpec {
        streams: dedupd_sim::gen::workload("A", 32.0).unwrap(),
        ..spec(Locality::Weak, 3)
    };
    assert_eq!(gen_bytes(&mix), gen_bytes(&mix));
}

#[test]
fn good_locality_has_much_shorter_reuse_distances_than_weak() {
    let dir = tempfile::tempdir().unwrap();
    let mut means = Vec::new();
    for (name, loc) in [
        (
            "good",
            Locality::Good {
                mean_reuse_blocks: 32.0,
            },
        ),
        ("weak", Locality::Weak),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, gen_bytes(&spec(loc, 1))).unwrap();
        let s = trace_stats(&p, None, false).unwrap();
        assert_eq!(s.format, Some(Format::Native));
        assert_eq!(s.blocks_written, 4096);
        let pct = s.exact_duplicate_percent;
        assert!((40.0..60.0).contains(&pct), "{name}: {pct} % duplicates");
        means.push(s.mean_reuse_distance_blocks);
    }
    assert!(
        means[0] * 10.0 < means[1],
        "good {} vs weak {}",
        means[0],
        means[1]
    );
}

#[test]
fn fio_generator_dup_percent_and_mix_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fio");
    std::fs::write(&p, gen_bytes(&spec(Locality::Uniform, 2))).unwrap();
    let s = trace_stats(&p, None, false).unwrap();
    assert!((45.0..55.0).contains(&s.exact_duplicate_percent));
    let mix = GenSpec {
        streams: dedupd_sim::gen::workload("C", 32.0).unwrap(),
        ..spec(Locality::Weak, 3)
    };
    let p = dir.path().join("mix");
    std::fs::write(&p, gen_bytes(&mix)).unwrap();
    let cfg = ReplayConfig {
        stream_by: StreamBy::Process,
        ..ReplayConfig::default()
    };
    let r = run(&[p], &cfg);
    assert_eq!(r.streams.len(), 2);
    let blocks = |suffix: &str| {
        r.streams
            .iter()
            .find(|s| s.name.ends_with(suffix))
            .unwrap()
            .blocks_written
    };
    let (good, weak) = (blocks(":good"), blocks(":weak"));
    let ratio = weak as f64 / good as f64;
    assert!((2.5..3.5).contains(&ratio), "weak:good = {ratio}");
}

#[test]
fn convert_then_replay_gives_the_same_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, lines) = match samples_dir() {
        Some(dir) => (dir.join("homes-sample.1.blkparse"), 1000),
        None => {
            // a fixture in the homes layout: eight sector digests per page
            let mut t = String::new();
            for i in 0..300u32 {
                let digests: String = (0..8).map(|k| h((i % 97) * 8 + k)).collect();
                t += &format!("{} 7 p {} 8 W 8 0 {digests}\n", 1000 + i, (i % 50) * 8);
            }
            (write(tmp.path(), "homes.blkparse", &t), 300)
        }
    };
    let out = tmp.path().join("homes.ddt");
    let c = convert(&src, None, false, &out).unwrap();
    assert_eq!(c.requests, lines);
    assert_eq!(read_all(&src, None), read_all(&out, None));
    let a = run(&[src], &ReplayConfig::default());
    let b = run(&[out], &ReplayConfig::default());
    assert_eq!(
        (
            a.blocks_written,
            a.exact_duplicate_blocks,
            a.duplicate_blocks_inline,
            a.extents
        ),
        (
            b.blocks_written,
            b.exact_duplicate_blocks,
            b.duplicate_blocks_inline,
            b.extents
        )
    );
}

#[test]
fn a_small_bounded_index_finds_fewer_duplicates_than_exact() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("weak");
    let s = GenSpec {
        size_bytes: 64 << 20,
        ..spec(Locality::Weak, 5)
    };
    std::fs::write(&p, gen_bytes(&s)).unwrap();
    let exact = run(std::slice::from_ref(&p), &ReplayConfig::default());
    // random addresses overwrite and free content that recurs later: the
    // engine forgets it, the exact count does not
    assert!(exact.duplicate_blocks_inline <= exact.exact_duplicate_blocks);
    for policy in ["g-lru", "lru"] {
        let cfg = ReplayConfig {
            policy: policy.into(),
            index_memory_bytes: Some(64 << 10),
            ..ReplayConfig::default()
        };
        let r = run(std::slice::from_ref(&p), &cfg);
        assert_eq!(r.exact_duplicate_blocks, exact.exact_duplicate_blocks);
        assert!(
            r.duplicate_blocks_inline < exact.duplicate_blocks_inline,
            "{policy}: {} vs exact {}",
            r.duplicate_blocks_inline,
            exact.duplicate_blocks_inline
        );
    }
}

#[test]
fn hostile_lines_are_refused_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = format!("1 7 p 0 8 W 8 0 {}\n", h(1));
    let mobile = format!("1.5\tW\t0\t8\t1\tp\t{}\n", h(5));
    let cases = [
        (
            &good,
            format!(
                "1 10 proc 18446744073709551612 8 W 8 0 {}\n",
                h(2).repeat(8)
            ),
            "address space",
        ),
        (
            &good,
            format!("0 10 proc 18446744073709551615 1 R 8 0 {}\n", h(3)),
            "address space",
        ),
        (
            &mobile,
            format!(".\tW\t0\t8\t1\tp\t{}\n", h(4)),
            "bad time \".\" (field 1 of 7)",
        ),
        // a field too many at the end: the value and the count are named
        (
            &good,
            format!("2 7 p 8 8 W 8 0 {} extra\n", h(2)),
            "bad size \"W\" (field 6 of 10); the line has 10 fields where 9 are expected",
        ),
        (
            &good,
            format!("2 7 p 8 8 Q 8 0 {}\n", h(2)),
            "bad operation (not R or W) \"Q\" (field 6 of 9)",
        ),
        (
            &mobile,
            format!("1.6\tR\t0\t8\t1\tp\t{0}-{0}-{0}\n", h(4)),
            "do not fit",
        ),
        (&good, format!("{}\n", "9".repeat(2 << 20)), "longer than"),
    ];
    for (i, (good, bad, why)) in cases.iter().enumerate() {
        let p = write(
            dir.path(),
            &format!("t{i}.trace"),
            &format!("{good}{bad}{good}"),
        );
        let err = replay(
            std::slice::from_ref(&p),
            &ReplayConfig::default(),
            &mut |_| {},
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TraceError::BadLine { line: 2, .. }), "{msg}");
        assert!(msg.contains(why), "{msg}");
        // skipped and counted with skip_bad; the line after it is read
        let cfg = ReplayConfig {
            skip_bad: true,
            ..ReplayConfig::default()
        };
        let r = run(&[p], &cfg);
        assert_eq!((r.bad_records_skipped, r.writes), (1, 2), "case {i}");
    }
    // a last line of 3 MiB without a newline
    let p = write(
        dir.path(),
        "long.blkparse",
        &format!("{good}{}", "7".repeat(3 << 20)),
    );
    let err = replay(&[p], &ReplayConfig::default(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains(":2: line longer than"), "{err}");
}

#[test]
fn convert_and_gen_replace_their_output_only_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..40u32)
        .map(|i| format!("{} 7 p {} 8 W 8 0 {}\n", 100 + i, i * 8, h(i % 9)))
        .collect();
    let p = write(dir.path(), "t.blkparse", &text);
    let before = std::fs::read(&p).unwrap();
    // onto itself (or a link to it) it is refused, the input left as it was
    let hard = dir.path().join("hard.blkparse");
    std::fs::hard_link(&p, &hard).unwrap();
    for onto in [p.clone(), dir.path().join("./t.blkparse"), hard] {
        let e = convert(&p, None, false, &onto).unwrap_err().to_string();
        assert!(e.contains("is an input"), "{onto:?}: {e}");
        assert_eq!(std::fs::read(&p).unwrap(), before);
    }
    // a conversion that fails leaves an existing output as it was
    let bad = write(dir.path(), "bad.blkparse", &format!("{text}garbage\n"));
    let out = write(dir.path(), "out.ddt", "precious");
    assert!(convert(&bad, None, false, &out).is_err());
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    // so does a generator refusing its parameters
    let mut s = spec(Locality::Uniform, 1);
    s.block_bytes = 1000;
    assert!(dedupd_sim::generate(&s, &out).is_err());
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    // and no temporary file is left behind
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with(".dedupd-output")),
        "{names:?}"
    );
}

#[test]
fn fiu_devices_of_one_file_are_separate_volumes() {
    // device 6,16 writes the LBA 6,0 wrote; then 6,0 writes its first
    // block's content again elsewhere: a duplicate of a block still mapped
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "1 10 p 0 8 W 6 0 {a}\n\
         2 10 p 0 8 W 6 16 {b}\n\
         3 10 p 8 8 W 6 0 {a}\n",
        a = h(1),
        b = h(2),
    );
    let p = write(dir.path(), "two-disks.blkparse", &text);
    let name = p.display().to_string();
    for (by, labels) in [
        (StreamBy::File, [name.clone(), format!("{name}@6,16")]),
        (
            StreamBy::Pid,
            [format!("{name}:10"), format!("{name}:10@6,16")],
        ),
        (
            StreamBy::Process,
            [format!("{name}:p"), format!("{name}:p@6,16")],
        ),
    ] {
        let cfg = ReplayConfig {
            stream_by: by,
            ..ReplayConfig::default()
        };
        let r = run(std::slice::from_ref(&p), &cfg);
        assert_eq!(r.exact_duplicate_blocks, 1, "{by:?}");
        assert_eq!(r.duplicate_blocks_inline, 1, "{by:?}");
        assert_eq!(r.mapped_blocks, 3, "{by:?}");
        let names: Vec<&str> = r.streams.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, labels, "{by:?}");
    }
    // the device survives a conversion to the native format
    let native = dir.path().join("two-disks.ddt");
    convert(&p, None, false, &native).unwrap();
    let r = run(&[native], &ReplayConfig::default());
    assert_eq!((r.duplicate_blocks_inline, r.mapped_blocks), (1, 3));
    assert_eq!(r.streams.len(), 2);
    let s = trace_stats(&p, None, false).unwrap();
    assert_eq!((s.sources, s.devices), (2, 2));
}

#[test]
fn a_process_name_cut_inside_a_character_is_read_lossily() {
    // comm is cut at 15 bytes, which can split a multi-byte character:
    // "k€" with the euro sign's last byte missing
    let dir = tempfile::tempdir().unwrap();
    let name = b"k\xe2\x82";
    let want = String::from_utf8_lossy(name).into_owned();
    let mut fiu = b"1 7 ".to_vec();
    fiu.extend(name);
    fiu.extend(format!(" 0 8 W 8 0 {}\n", h(1)).as_bytes());
    let mut mobile = b"0.5\tW\t0\t8\t7\t".to_vec();
    mobile.extend(name);
    mobile.extend(format!("\t{}\n", h(1)).as_bytes());
    for (file, bytes) in [("t.blkparse", fiu), ("t.mobile", mobile)] {
        let p = dir.path().join(file);
        std::fs::write(&p, bytes).unwrap();
        let mut r = TraceReader::open(&p, None, false, Arc::new(AtomicU64::new(0))).unwrap();
        let mut q = Request::default();
        assert!(r.next_into(&mut q).unwrap(), "{file}");
        assert_eq!(r.sources().len(), 1, "{file}");
        assert_eq!(r.sources()[0].process, want, "{file}");
        assert_eq!(r.sources()[0].pid, 7, "{file}");
    }
}

#[test]
fn binary_data_and_a_cut_native_header_are_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    // bytes that are no trace: refused as such, not as a bad FIU line
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let p = dir.path().join("garbage.bin");
    std::fs::write(&p, &garbage).unwrap();
    let err = trace_stats(&p, None, false).unwrap_err();
    assert!(matches!(err, TraceError::Unrecognized { .. }), "{err}");
    assert!(
        err.to_string().contains("not a trace dedupd reads"),
        "{err}"
    );
    // a native trace cut inside its magic: read as native, and its header
    // named as cut
    let p = dir.path().join("cut.ddt");
    std::fs::write(&p, &dedupd_sim::native::MAGIC[..3]).unwrap();
    let err = trace_stats(&p, None, false).unwrap_err();
    assert!(matches!(err, TraceError::BadNative { .. }), "{err}");
    // a mobile line's bad digest is named by its place, with what it holds
    let text = format!("1\tW\t0\t16\t7\tapp\t{}-xyz\n", h(1));
    let p = write(dir.path(), "bad.txt", &text);
    let err = trace_stats(&p, None, false).unwrap_err();
    assert!(
        err.to_string()
            .contains("MD5 digest #2 of the request (\"xyz\") is not 32 hex digits"),
        "{err}"
    );
}

#[test]
fn a_native_trace_read_as_text_is_named_as_native() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("1 7 p 0 8 W 8 0 {}\n", h(1));
    let src = write(dir.path(), "t.blkparse", &text);
    let native = dir.path().join("t.ddt");
    convert(&src, None, false, &native).unwrap();
    for format in [Format::Fiu, Format::Mobile] {
        let cfg = ReplayConfig {
            format: Some(format),
            ..ReplayConfig::default()
        };
        let err = replay(std::slice::from_ref(&native), &cfg, &mut |_| {}).unwrap_err();
        assert!(matches!(err, TraceError::NativeAsText { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("a native trace") && msg.contains("--format native"),
            "{msg}"
        );
        assert!(trace_stats(&native, Some(format), true).is_err());
    }
    // named as native, or detected, it reads
    for format in [Some(Format::Native), None] {
        let s = trace_stats(&native, format, false).unwrap();
        assert_eq!(s.writes, 1);
    }
    // a text trace named as such still reads
    assert_eq!(
        trace_stats(&src, Some(Format::Fiu), false).unwrap().writes,
        1
    );
}
