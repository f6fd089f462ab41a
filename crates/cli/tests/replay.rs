//! `dedupd replay` and `dedupd trace` end to end through the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

fn dedupd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dedupd"))
}

/// The real mail sample if ../shared is there, else a fixture in its format.
fn trace(dir: &Path) -> (PathBuf, u64, u64) {
    let real = std::env::var_os("DEDUPD_FIU_SAMPLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces/fiu"))
        .join("mail-01-sample.blkparse");
    let p = if real.exists() {
        real
    } else {
        eprintln!(
            "real FIU sample {} not found (set DEDUPD_FIU_SAMPLES): using a fixture in its format",
            real.display()
        );
        let p = dir.join("fixture.blkparse");
        let mut t = String::new();
        for i in 0..50u64 {
            let op = if i % 5 == 0 { "W" } else { "R" };
            t += &format!(
                "{} 4253 nfsd {} 8 {op} 6 0 {:032x}\n",
                1000 + i,
                i * 8,
                i % 7
            );
        }
        std::fs::write(&p, t).unwrap();
        p
    };
    // independent count: writes and exact duplicates (one digest per line)
    let text = std::fs::read_to_string(&p).unwrap();
    let mut seen = std::collections::HashSet::new();
    let (mut writes, mut dups) = (0, 0);
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.get(5) == Some(&"W") {
            writes += 1;
            if !seen.insert(f[8].to_string()) {
                dups += 1;
            }
        }
    }
    (p, writes, dups)
}

#[test]
fn replay_prints_text_and_json_reports() {
    let dir = tempfile::tempdir().unwrap();
    let (p, writes, dups) = trace(dir.path());
    let report = dir.path().join("report.json");
    let out = dedupd()
        .arg("replay")
        .arg(&p)
        .arg("--json")
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["writes"], writes);
    assert_eq!(v["blocks_written"], writes);
    assert_eq!(v["exact_duplicate_blocks"], dups);
    assert_eq!(v["duplicate_blocks_inline"], dups);
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(saved["exact_duplicate_blocks"], dups);

    let out = dedupd().arg("replay").arg(&p).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("duplicates (exact dedup)"), "{text}");
    assert!(text.contains("fragmentation"), "{text}");
    // not a TTY: no progress bar on stderr
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn replay_rejects_unknown_policy_and_names_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _, _) = trace(dir.path());
    let out = dedupd()
        .args(["replay", "--policy", "mru"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown policy \"mru\""), "{err}");
    for policy in ["lfu", "arc", "refcount", "g-lru+prehash+sampling+t2"] {
        let out = dedupd()
            .args(["replay", "-q", "--policy", policy, "--index-memory", "64K"])
            .arg(&p)
            .output()
            .unwrap();
        assert!(out.status.success(), "{policy}: {out:?}");
    }

    let bad = dir.path().join("bad.blkparse");
    std::fs::write(&bad, format!("1 2 p 0 8 W 6 0 {:032x}\nnonsense\n", 1)).unwrap();
    let out = dedupd().arg("replay").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.blkparse:2:"));
    let out = dedupd()
        .args(["replay", "--skip-bad", "--json"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bad_records_skipped"], 1);
}

#[test]
fn trace_gen_convert_stats() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.ddt");
    let b = dir.path().join("b.ddt");
    for out in [&a, &b] {
        let s = dedupd()
            .args(["trace", "gen", "--kind", "mix", "--workload", "A"])
            .args(["--size", "4M", "--seed", "9", "-o"])
            .arg(out)
            .status()
            .unwrap();
        assert!(s.success());
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let (p, writes, _) = trace(dir.path());
    let native = dir.path().join("conv.ddt");
    assert!(dedupd()
        .args(["trace", "convert"])
        .arg(&p)
        .arg(&native)
        .status()
        .unwrap()
        .success());
    let out = dedupd()
        .args(["trace", "stats", "--json"])
        .arg(&native)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["format"], "native");
    assert_eq!(v["blocks_written"], writes);
    // a native trace read as text is named as native, not as bad lines
    let out = dedupd()
        .args(["replay", "-q", "--format", "fiu"])
        .arg(&native)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a native trace") && err.contains("--format native"),
        "{err}"
    );
    let out = dedupd()
        .args(["replay", "--stream-by", "process", "--json"])
        .arg(&a)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["streams"].as_array().unwrap().len(), 2);
    assert_eq!(v["blocks_written"], 1024);
}

#[test]
fn trace_convert_refuses_to_write_over_its_input() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let (p, _, _) = trace(tmp.path());
    let input = tmp.path().join("in.txt");
    std::fs::copy(&p, &input).unwrap();
    std::fs::set_permissions(&input, std::fs::Permissions::from_mode(0o444)).unwrap();
    std::fs::hard_link(&input, tmp.path().join("hard.txt")).unwrap();
    std::os::unix::fs::symlink("in.txt", tmp.path().join("soft.txt")).unwrap();
    let before = std::fs::read(&input).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = ["in.txt", "./in.txt", "hard.txt", "soft.txt"]
        .into_iter()
        .map(|out| {
            (
                vec!["trace", "convert", "in.txt", out],
                "is an input (in.txt)",
            )
        })
        .collect();
    assert_refused(tmp.path(), &cases);
    assert_eq!(std::fs::read(&input).unwrap(), before, "the input changed");
    assert_eq!(
        std::fs::metadata(&input).unwrap().permissions().mode() & 0o777,
        0o444
    );
    assert!(std::fs::symlink_metadata(tmp.path().join("soft.txt"))
        .unwrap()
        .file_type()
        .is_symlink());
    // another name is converted as before
    let out = dedupd()
        .current_dir(tmp.path())
        .args(["trace", "convert", "in.txt", "out.ddt"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read(tmp.path().join("out.ddt"))
        .unwrap()
        .starts_with(b"DDTRACE"));
}

#[test]
fn the_text_report_splits_index_entries_between_memory_and_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("g.ddt");
    let out = dedupd()
        .args(["trace", "gen", "--size", "4M", "--seed", "3", "-o"])
        .arg(&t)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let run = |json: bool| {
        let mut c = dedupd();
        c.args(["replay", "-q", "--policy", "lru", "--index-memory", "4K"])
            .arg(&t);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let v: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    let (all, mem, disk) = (
        v["index_entries"].as_u64().unwrap(),
        v["engine"]["index"]["entries_in_memory"].as_u64().unwrap(),
        v["engine"]["index"]["entries_on_disk"].as_u64().unwrap(),
    );
    assert_eq!(all, mem + disk);
    // a 4 KiB budget holds few of them: most are on disk
    assert!(disk > mem, "{mem} in memory, {disk} on disk");
    let text = run(false);
    let want = format!("({all} entries at end: {mem} in memory, {disk} on disk)");
    assert!(text.contains(&want), "{want} not in\n{text}");
}

#[test]
fn sweep_writes_results_and_figures() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("loc.ddt");
    let s = dedupd()
        .args(["trace", "gen", "--kind", "locality", "--size", "8M"])
        .args(["--mean-reuse", "500", "--seed", "2", "-o"])
        .arg(&t)
        .status()
        .unwrap();
    assert!(s.success());
    let out = dir.path().join("out");
    let o = dedupd()
        .args(["sweep", "-q", "--policies", "exact,g-lru,lru,arc"])
        .args([
            "--index-memory",
            "16K,64K",
            "--index-prefix-bits",
            "8",
            "--jobs",
            "2",
        ])
        .arg("--traces")
        .arg(&t)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    // header + exact + 3 bounded policies × 2 budgets
    assert_eq!(csv.lines().count(), 1 + 1 + 3 * 2, "{csv}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 7);
    for f in ["loc.ddt-duplicates", "loc.ddt-eviction-io"] {
        let png = std::fs::read(out.join(format!("{f}.png"))).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let svg = std::fs::read_to_string(out.join(format!("{f}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("g-lru"));
    }
}

#[test]
fn a_sweep_stopped_by_a_bad_trace_keeps_what_finished() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.fiu");
    let text: String = (0..3000u64)
        .map(|i| format!("{i} 1 p {} 8 W 6 0 {:032x}\n", i * 8, i % 400 + 1))
        .collect();
    std::fs::write(&good, &text).unwrap();
    let bad = dir.path().join("bad.fiu");
    std::fs::write(&bad, format!("{}garbage\n", &text[..500])).unwrap();
    let out = dir.path().join("out");
    // `dedupd sweep` of policies exact and lru at `budgets` over `traces`
    let sweep = |budgets: &str, traces: String| {
        dedupd()
            .args(["sweep", "-q", "--policies", "exact,lru", "--jobs", "1"])
            .args(["--index-memory", budgets, "--traces", &traces])
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap()
    };
    let o = sweep("1M,2M", format!("{},{}", good.display(), bad.display()));
    assert!(!o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    // the bad line named, and where the finished points went
    assert!(err.contains("bad.fiu:11: expected 9 fields"), "{err}");
    assert!(err.contains("the 1 of 6 points that finished"), "{err}");
    assert!(err.contains("results.partial.csv"), "{err}");
    let csv = std::fs::read_to_string(out.join("results.partial.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    assert!(
        csv.lines().nth(1).unwrap().starts_with("good.fiu,exact,"),
        "{csv}"
    );
    assert!(!out.join("results.csv").exists());
    // a sweep that completes replaces them with whole results
    let o = sweep("1M", good.display().to_string());
    assert!(o.status.success(), "{o:?}");
    assert!(out.join("results.csv").exists());
    assert!(!out.join("results.partial.csv").exists());
}

/// SIGINT to a running sweep: the running point stops, none starts after
/// it, and the points that finished are kept as partial results.
#[test]
fn an_interrupted_sweep_keeps_what_finished() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.ddt");
    // 2 Mi requests: seconds per point, so the signal lands in the second
    let o = dedupd()
        .args(["trace", "gen", "--size", "8G", "-o"])
        .arg(&t)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let out = dir.path().join("out");
    let mut child = dedupd()
        .args([
            "sweep",
            "--policies",
            "exact,lru",
            "--index-memory",
            "1M,2M,4M",
        ])
        .args(["--jobs", "1", "--traces"])
        .arg(&t)
        .arg("--out")
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.starts_with("[1/4] t.ddt exact"), "{first}");
    let started = std::time::Instant::now();
    // SAFETY: kill(2) on the child's pid, which has not been reaped
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "{rest}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "stopping took {:?}",
        started.elapsed()
    );
    assert!(rest.contains("interrupted"), "{rest}");
    assert!(rest.contains("the 1 of 4 points that finished"), "{rest}");
    let csv = std::fs::read_to_string(out.join("results.partial.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    assert!(
        csv.lines().nth(1).unwrap().starts_with("t.ddt,exact,"),
        "{csv}"
    );
    assert!(!out.join("results.csv").exists());
}

/// Runs each command line in `dir`: it must fail, its error naming the
/// given text.
fn assert_refused(dir: &Path, cases: &[(Vec<&str>, &str)]) {
    for (args, why) in cases {
        let out = dedupd().current_dir(dir).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        // (a value outside a flag's list is a usage error, as clap's own)
        if why.starts_with("invalid value") {
            assert_eq!(out.status.code(), Some(2), "{args:?}");
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }
}

#[test]
fn bad_flags_are_named_and_outputs_survive_failures() {
    let tmp = tempfile::tempdir().unwrap();
    let (trace, _, _) = trace(tmp.path());
    let t = trace.to_str().unwrap();
    assert_refused(
        tmp.path(),
        &[
            (
                vec!["replay", "--policy", "lru", "--index-memory", "8X", t],
                "--index-memory",
            ),
            (
                vec!["replay", "--policy", "lru", "--index-memory", "0", t],
                "--index-memory",
            ),
            (
                vec!["replay", "--index-prefix-bits", "40", t],
                "--index-prefix-bits",
            ),
            (vec!["replay", "--format", "bogus", t], "--format"),
            (
                vec!["trace", "gen", "--kind", "bogus", "-o", "x.ddt"],
                "invalid value 'bogus' for '--kind <KIND>'",
            ),
            (
                vec!["trace", "stats", "--format", "bogus", t],
                "invalid value 'bogus' for '--format <FORMAT>'",
            ),
            (
                vec!["trace", "gen", "--size", "4iB", "-o", "x.ddt"],
                "--size",
            ),
            (
                vec![
                    "trace",
                    "gen",
                    "--bs",
                    "1T",
                    "--size",
                    "1T",
                    "--volume-size",
                    "1T",
                    "-o",
                    "x.ddt",
                ],
                "at most 32M",
            ),
            (vec!["serve", "--read-cache", "8X"], "--read-cache"),
        ],
    );
    // a generator refusing its parameters leaves an existing file alone
    let keep = tmp.path().join("keep.ddt");
    std::fs::write(&keep, b"precious").unwrap();
    let out = dedupd()
        .args(["trace", "gen", "--bs", "1000", "-o"])
        .arg(&keep)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&keep).unwrap(), b"precious");
    // outputs are checked before any work, and never go over an input
    let copy = tmp.path().join("copy.blkparse");
    std::fs::copy(&trace, &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    std::fs::copy(&trace, tmp.path().join("results.csv")).unwrap();
    let c = copy.to_str().unwrap();
    let twice = format!("{c},{c}");
    let dot_c = format!("./{}", copy.file_name().unwrap().to_str().unwrap());
    std::fs::hard_link(&copy, tmp.path().join("link.blkparse")).unwrap();
    let not_a_dir = keep.to_str().unwrap();
    assert_refused(
        tmp.path(),
        &[
            (vec!["replay", "-q", c, "--report", c], "is an input"),
            (
                vec!["replay", "-q", c, "--report", "nodir/r.json"],
                "does not exist",
            ),
            (
                vec!["sweep", "--traces", c, "--out", not_a_dir],
                "not a directory",
            ),
            (
                vec!["sweep", "--traces", "nosuch.ddt", "--out", "o"],
                "nosuch.ddt",
            ),
            (
                vec!["sweep", "--traces", c, "--jobs", "0", "--out", "o"],
                "--jobs",
            ),
            // the same trace twice would mix its rows
            (
                vec!["sweep", "--traces", &twice, "--out", "o"],
                "given more than once",
            ),
            // so would the same policy or budget twice (equal in bytes)
            (
                vec![
                    "sweep",
                    "--traces",
                    c,
                    "--policies",
                    "lru,lru,g-lru",
                    "--out",
                    "o",
                ],
                "--policies: policy \"lru\" is given more than once",
            ),
            (
                vec![
                    "sweep",
                    "--traces",
                    c,
                    "--policies",
                    "lru+sampling+prehash,lru+prehash+sampling",
                    "--out",
                    "o",
                ],
                "(as \"lru+sampling+prehash\")",
            ),
            (
                vec![
                    "sweep",
                    "--traces",
                    c,
                    "--index-memory",
                    "1M,1M",
                    "--out",
                    "o",
                ],
                "--index-memory: budget 1M is given more than once",
            ),
            (
                vec![
                    "sweep",
                    "--traces",
                    c,
                    "--index-memory",
                    "2M,1M,1024K",
                    "--out",
                    "o",
                ],
                "budget 1024K is given more than once (as 1M; both are 1048576 bytes)",
            ),
            // a replay of the same file twice, however it is named
            (vec!["replay", "-q", c, c], "is given more than once"),
            (vec!["replay", "-q", c, &dot_c], "is given more than once"),
            (
                vec!["replay", "-q", c, "link.blkparse"],
                "trace link.blkparse is given more than once",
            ),
            // a trace where the sweep would write its results
            (
                vec!["sweep", "--traces", "results.csv", "--out", "."],
                "is an input",
            ),
        ],
    );
    assert_eq!(
        std::fs::read(tmp.path().join("results.csv")).unwrap(),
        before,
        "the trace named results.csv was overwritten"
    );
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        before,
        "the trace was overwritten"
    );
    assert!(
        !tmp.path().join("o").exists(),
        "a refused sweep created its output"
    );
    // a second init names the existing store
    let store = tmp.path().join("store");
    for expect_ok in [true, false] {
        let out = dedupd()
            .arg("--store")
            .arg(&store)
            .arg("init")
            .output()
            .unwrap();
        assert_eq!(out.status.success(), expect_ok, "{out:?}");
        if !expect_ok {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("already exists"), "{err}");
        }
    }
    // a report cut short by its reader ends quietly, without a panic
    let mut child = dedupd()
        .args(["trace", "stats", t])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn trace_gen_refuses_options_its_kind_does_not_use() {
    let tmp = tempfile::tempdir().unwrap();
    let gen = |extra: &[&'static str]| {
        let mut v = vec!["trace", "gen", "--size", "64K", "-o", "g.ddt"];
        v.extend_from_slice(extra);
        v
    };
    assert_refused(
        tmp.path(),
        &[
            (
                gen(&["--kind", "fio", "--workload", "C"]),
                "--workload does not apply to --kind fio",
            ),
            (
                gen(&["--kind", "fio", "--locality", "weak"]),
                "--locality does not apply to --kind fio",
            ),
            (
                gen(&["--kind", "mix", "--locality", "weak"]),
                "--locality does not apply to --kind mix",
            ),
            (
                gen(&["--kind", "locality", "--streams", "good:1"]),
                "--streams does not apply to --kind locality",
            ),
            (
                gen(&["--kind", "fio", "--mean-reuse", "10"]),
                "--mean-reuse does not apply to --kind fio",
            ),
            (
                gen(&[
                    "--kind",
                    "locality",
                    "--locality",
                    "weak",
                    "--mean-reuse",
                    "10",
                ]),
                "--mean-reuse does not apply to --kind locality --locality weak",
            ),
            (
                gen(&[
                    "--kind",
                    "mix",
                    "--streams",
                    "uniform:1,weak:1",
                    "--mean-reuse",
                    "10",
                ]),
                "--mean-reuse does not apply to --kind mix",
            ),
            (
                gen(&["--kind", "fio", "--copy-runs"]),
                "--copy-runs does not apply to --kind fio",
            ),
            (
                gen(&["--kind", "mix", "--streams", "uniform:2", "--copy-runs"]),
                "--copy-runs does not apply to --kind mix",
            ),
        ],
    );
    assert!(!tmp.path().join("g.ddt").exists());
    // the same options where they apply
    for extra in [
        &["--kind", "locality", "--locality", "weak", "--copy-runs"][..],
        &["--kind", "locality", "--mean-reuse", "10"],
        &[
            "--kind",
            "mix",
            "--workload",
            "C",
            "--mean-reuse",
            "10",
            "--copy-runs",
        ],
        &[
            "--kind",
            "mix",
            "--streams",
            "good:1,uniform:1",
            "--mean-reuse",
            "10",
        ],
    ] {
        let out = dedupd()
            .current_dir(tmp.path())
            .args(gen(extra))
            .output()
            .unwrap();
        assert!(out.status.success(), "{extra:?}: {out:?}");
    }
}

#[test]
fn a_trace_without_requests_is_refused_but_has_stats() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, bytes) in [
        ("empty.blkparse", Vec::new()),
        ("comments.blkparse", b"# nothing\n\n".to_vec()),
        // gzip of nothing: header, an empty final deflate block, CRC and
        // length 0
        (
            "empty.gz",
            vec![
                0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            ],
        ),
    ] {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let why = format!("{}: no requests in this trace", p.display());
        let out = dedupd().args(["replay", "-q"]).arg(&p).output().unwrap();
        assert!(!out.status.success(), "{name}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&why), "{name}: {err}");
        let conv = tmp.path().join("out.ddt");
        let out = dedupd()
            .args(["trace", "convert"])
            .arg(&p)
            .arg(&conv)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&why));
        assert!(!conv.exists());
        let out = dedupd()
            .args(["trace", "stats", "--json"])
            .arg(&p)
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["requests"], 0, "{name}");
    }
}

#[test]
fn time_stamps_stepping_back_are_reported_and_do_not_shorten_the_duration() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("back.blkparse");
    let line = |s: u64, i: u64| {
        format!(
            "{} 7 p {} 8 W 6 0 {:032x}\n",
            s * 1_000_000_000,
            i * 8,
            i + 1
        )
    };
    std::fs::write(&p, [line(1, 0), line(3, 1), line(2, 2)].concat()).unwrap();
    let out = dedupd().args(["trace", "stats"]).arg(&p).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("duration                2.000 s"), "{text}");
    assert!(text.contains("time stamps clamped     1"), "{text}");
    let out = dedupd().args(["replay", "-q"]).arg(&p).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("time stamps clamped           1"), "{text}");
    let out = dedupd()
        .args(["replay", "--json"])
        .arg(&p)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["timestamps_clamped"], 1);
}

#[test]
fn an_interrupted_trace_gen_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big.ddt");
    std::fs::write(&out, b"precious").unwrap();
    // a trace far too long to finish, interrupted while it is written
    let mut child = dedupd()
        .args(["trace", "gen", "--size", "1T", "-o"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert!(!status.success());
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["big.ddt"], "left behind");
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
}

#[test]
fn trace_commands_take_no_store() {
    let tmp = tempfile::tempdir().unwrap();
    for cmd in [
        vec!["replay"],
        vec!["sweep"],
        vec!["trace", "gen"],
        vec!["trace", "stats"],
        vec!["trace", "convert"],
    ] {
        let o = dedupd().args(&cmd).arg("--help").output().unwrap();
        assert!(o.status.success(), "{cmd:?}");
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(!help.contains("--store"), "{cmd:?}: {help}");
    }
    let (trace, _, _) = trace(tmp.path());
    for cmd in [&["replay", "-q"][..], &["trace", "stats"]] {
        let o = dedupd()
            .args(cmd)
            .args(["--store", "s"])
            .arg(&trace)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        let name = cmd.iter().filter(|a| !a.starts_with('-')).copied();
        let want = format!(
            "`dedupd {}` uses no store",
            name.collect::<Vec<_>>().join(" ")
        );
        assert!(String::from_utf8_lossy(&o.stderr).contains(&want), "{o:?}");
    }
    // an empty DEDUPD_STORE is no error where no store is used
    let o = dedupd()
        .env("DEDUPD_STORE", "")
        .args(["trace", "stats"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    // and commands of a store still take the option after their name
    let o = dedupd()
        .args(["volume", "list", "--store"])
        .arg(tmp.path().join("missing"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("does not exist"),
        "{o:?}"
    );
}
