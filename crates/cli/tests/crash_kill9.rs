//! Crash tests: `dedupd serve` is killed with SIGKILL at random moments
//! while real clients write, restarted on the same store, and the
//! durability contract of docs/durability.md is checked:
//!
//! - everything written before a completed FLUSH reads back intact;
//! - a write not yet flushed reads back, per 4 KiB block, as its old or its
//!   new content;
//! - an ext4 on the volume (nbdfuse + loop) is consistent after its journal
//!   is replayed, and every file synced before the kill is intact;
//! - `dedupd fsck` (when the binary has that subcommand) finds the crashed
//!   store clean (exit status 0) after every kill, and `fsck --rehash`
//!   after the final clean stop.
//!
//! The kill moments and the writes come from a seeded generator: the seed
//! is printed; `DEDUPD_CRASH_SEED=<n>` repeats a run, `DEDUPD_CRASH_KILLS=<n>`
//! changes the number of kills of the qemu-io test (default 40) and
//! `DEDUPD_CRASH_EXT4_KILLS=<n>` that of the ext4 test (default 6).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{dedupd_bin, files_under, require, require_ext4_tools, run, sha256_file};
use common::{source_tree, Fuse, Loop, Mount, Server};

const BLOCK: u64 = 4096;
const SECTOR: u64 = 512;
const SECTORS_PER_BLOCK: usize = (BLOCK / SECTOR) as usize;
/// Size of the volume of the qemu-io test.
const VOLUME_BYTES: u64 = 32 << 20;
const VOLUME_BLOCKS: usize = (VOLUME_BYTES / BLOCK) as usize;

/// splitmix64: small, seedable, good enough to pick offsets and delays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// True with probability `percent` / 100.
    fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        }
        Err(_) => default,
    }
}

/// `dedupd fsck` runs on the store after every kill; this checks the
/// subcommand is there (it is part of the durability contract).
fn fsck_available() -> bool {
    let out = Command::new(dedupd_bin())
        .args(["fsck", "--help"])
        .output()
        .expect("running dedupd fsck --help");
    assert!(
        out.status.success(),
        "`dedupd fsck --help` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

/// Runs `dedupd --store S fsck` on a store no server has open; requires
/// exit status 0 (clean).
fn fsck_clean(store: &Path, after: &str) {
    fsck_clean_with(store, after, &[]);
}

/// [`fsck_clean`] with extra options (`--rehash`, memory bounds).
fn fsck_clean_with(store: &Path, after: &str, opts: &[&str]) {
    let out = Command::new(dedupd_bin())
        .arg("--store")
        .arg(store)
        .arg("fsck")
        .args(opts)
        .output()
        .expect("running dedupd fsck");
    assert!(
        out.status.code() == Some(0),
        "dedupd fsck {opts:?} of the store after {after} exited with {} (0 = clean required):\n\
         stdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Server options varied from restart to restart, so kills land in
/// commits, checkpoints and background commits of every size, with the
/// metadata paged through tiny caches or held in memory.
fn random_server_args(rng: &mut Rng) -> Vec<String> {
    let interval = *rng.pick(&["0", "10", "100", "5000"]);
    let journal = *rng.pick(&["128K", "1M", "32M"]);
    let dirty = *rng.pick(&["64K", "1M", "16M"]);
    let workers = *rng.pick(&["1", "4"]);
    // tiny caches page the maps, reference counts and reverse index
    let cache = *rng.pick(&["8K", "16M"]);
    vec![
        "--map-cache".into(),
        cache.into(),
        "--reverse-index-cache".into(),
        cache.into(),
        "--commit-interval-ms".into(),
        interval.into(),
        "--journal-size".into(),
        journal.into(),
        "--max-dirty".into(),
        dirty.into(),
        "--workers".into(),
        workers.into(),
    ]
}

fn start_server(store: &Path, args: &[String], first: bool) -> Server {
    let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
    let size = VOLUME_BYTES.to_string();
    if first {
        a.extend(["--default-volume-size", &size]);
    }
    Server::start(store, &a)
}

/// Content of one 4 KiB block: the byte pattern of each of its 512-byte
/// sectors (every byte of a sector is the same in this test).
type Block = [u8; SECTORS_PER_BLOCK];

/// One client operation, in bytes.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// `write -P pattern` (pattern 0 included: zero blocks are unmapped).
    Write { off: u64, len: u64, pattern: u8 },
    /// `write -z`: NBD WRITE_ZEROES.
    Zero { off: u64, len: u64 },
    /// `discard`: NBD TRIM; dedupd unmaps, so the range reads back as zeros.
    Discard { off: u64, len: u64 },
}

impl Op {
    fn qemu_io(&self) -> String {
        match *self {
            Op::Write { off, len, pattern } => format!("write -P 0x{pattern:02x} {off} {len}"),
            Op::Zero { off, len } => format!("write -z {off} {len}"),
            Op::Discard { off, len } => format!("discard {off} {len}"),
        }
    }
    fn range(&self) -> (u64, u64) {
        match *self {
            Op::Write { off, len, .. } | Op::Zero { off, len } | Op::Discard { off, len } => {
                (off, len)
            }
        }
    }
    fn pattern(&self) -> u8 {
        match *self {
            Op::Write { pattern, .. } => pattern,
            _ => 0,
        }
    }
}

/// A random operation. Patterns come mostly from a small set so that
/// blocks of different regions and rounds deduplicate; `sector_aligned`
/// allows writes that cover 512-byte parts of a block (read-modify-write
/// in the server).
fn random_op(rng: &mut Rng, sector_aligned: bool) -> Op {
    let max_blocks = if rng.percent(80) { 64 } else { 512 };
    let blocks = rng.range(1, max_blocks);
    let start = rng.below(VOLUME_BLOCKS as u64 - blocks + 1);
    let (mut off, mut len) = (start * BLOCK, blocks * BLOCK);
    let kind = rng.below(100);
    if kind < 10 {
        return Op::Discard { off, len };
    }
    if kind < 18 {
        return Op::Zero { off, len };
    }
    if sector_aligned && rng.percent(30) {
        off += rng.below(SECTORS_PER_BLOCK as u64) * SECTOR;
        len = rng.range(1, (len - (off - start * BLOCK)) / SECTOR) * SECTOR;
    }
    let pattern = if rng.percent(85) {
        *rng.pick(&[0x11, 0x22, 0x33, 0x44, 0x55, 0xa5, 0xff, 0x00])
    } else {
        rng.range(1, 255) as u8
    };
    Op::Write { off, len, pattern }
}

/// What each block of the volume may read back as: usually one content,
/// several after writes that were not flushed before a kill.
struct Model {
    blocks: Vec<Vec<Block>>,
    /// Content before the racing writes, of blocks they touched.
    before: Vec<Option<Block>>,
}

impl Model {
    fn new() -> Model {
        Model {
            blocks: vec![vec![[0; SECTORS_PER_BLOCK]]; VOLUME_BLOCKS],
            before: vec![None; VOLUME_BLOCKS],
        }
    }

    /// Applies a write that is durable (its FLUSH completed). Requires one
    /// possible content per touched block.
    fn apply_durable(&mut self, op: &Op) {
        let (off, len) = op.range();
        let p = op.pattern();
        for s in off / SECTOR..(off + len) / SECTOR {
            let b = &mut self.blocks[(s / SECTORS_PER_BLOCK as u64) as usize];
            assert_eq!(b.len(), 1, "model: durable write over an undecided block");
            b[0][(s % SECTORS_PER_BLOCK as u64) as usize] = p;
        }
    }

    /// Applies the operations of concurrent clients that were racing the
    /// kill. `done[i]` says client `i` exited successfully (its final FLUSH
    /// completed) before the kill. Only 4 KiB-aligned operations.
    fn apply_racing(&mut self, clients: &[Vec<Op>], done: &[bool]) {
        // per block: (touched by a finished client, candidate contents)
        let mut touched: Vec<(bool, BTreeSet<Block>)> =
            vec![(false, BTreeSet::new()); VOLUME_BLOCKS];
        for (ops, &finished) in clients.iter().zip(done) {
            let mut last: Vec<Option<u8>> = vec![None; VOLUME_BLOCKS];
            for op in ops {
                let (off, len) = op.range();
                assert!(off % BLOCK == 0 && len % BLOCK == 0);
                for b in off / BLOCK..(off + len) / BLOCK {
                    let b = b as usize;
                    if finished {
                        last[b] = Some(op.pattern());
                    } else {
                        touched[b].1.insert([op.pattern(); SECTORS_PER_BLOCK]);
                    }
                }
            }
            for (b, p) in last.iter().enumerate() {
                if let Some(p) = p {
                    touched[b].0 = true;
                    touched[b].1.insert([*p; SECTORS_PER_BLOCK]);
                }
            }
        }
        for (b, (by_finished, cands)) in touched.into_iter().enumerate() {
            if cands.is_empty() {
                continue;
            }
            let mut all: BTreeSet<Block> = cands;
            self.before[b] = Some(self.blocks[b][0]);
            if !by_finished {
                all.extend(self.blocks[b].iter().copied());
            }
            self.blocks[b] = all.into_iter().collect();
        }
    }

    /// Checks an image read back after a restart, then makes what was read
    /// the only possible content (it is on disk now). Returns the number of
    /// blocks the racing writes touched and of those that read back changed.
    fn check_and_settle(&mut self, image: &[u8], seed: u64, kill: usize) -> (usize, usize) {
        assert_eq!(image.len() as u64, VOLUME_BYTES, "image size");
        let (mut touched, mut changed) = (0, 0);
        let mut bad = Vec::new();
        for (b, cands) in self.blocks.iter_mut().enumerate() {
            let data = &image[b * BLOCK as usize..(b + 1) * BLOCK as usize];
            let mut got: Option<Block> = Some([0; SECTORS_PER_BLOCK]);
            for (i, sector) in data.chunks(SECTOR as usize).enumerate() {
                if sector.iter().all(|&x| x == sector[0]) {
                    if let Some(g) = got.as_mut() {
                        g[i] = sector[0];
                    }
                } else {
                    got = None;
                }
            }
            if let Some(before) = self.before[b].take() {
                touched += 1;
                if got != Some(before) {
                    changed += 1;
                }
            }
            match got {
                Some(g) if cands.contains(&g) => *cands = vec![g],
                _ => bad.push((b, got, cands.clone())),
            }
        }
        assert!(
            bad.is_empty(),
            "seed {seed:#x}, kill {kill}: {} blocks read back with content neither flushed nor \
             written after the last flush; first ones (block, read, allowed): {:x?}",
            bad.len(),
            &bad[..bad.len().min(5)]
        );
        (touched, changed)
    }
}

fn qemu_io(uri: &str, cmds: &[String]) -> Command {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", "-d", "unmap"]);
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    c.arg(uri);
    c
}

/// Runs qemu-io and requires success with no failed command in its output.
fn qemu_io_ok(uri: &str, cmds: &[String]) {
    let out = run(&mut qemu_io(uri, cmds));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("failed") && !text.contains("error"),
        "qemu-io {cmds:?} reported a failure:\n{text}"
    );
}

/// Reads the whole volume through `qemu-img convert`.
fn read_image(uri: &str, dir: &Path) -> Vec<u8> {
    let out = dir.join("readback.raw");
    let _ = std::fs::remove_file(&out);
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", uri])
        .arg(&out));
    let mut v = std::fs::read(&out).unwrap();
    v.resize(VOLUME_BYTES as usize, 0);
    v
}

#[test]
fn kill9_during_qemu_io_writes_keeps_flushed_data() {
    require("qemu-io");
    require("qemu-img");
    let seed = env_u64("DEDUPD_CRASH_SEED", 0x00de_dd5e_ed01);
    let kills = env_u64("DEDUPD_CRASH_KILLS", 40) as usize;
    eprintln!(
        "crash: qemu-io test: seed {seed:#x} (set DEDUPD_CRASH_SEED to repeat), {kills} kills"
    );
    let mut rng = Rng(seed);
    let fsck = fsck_available();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let mut model = Model::new();
    let start = Instant::now();
    let mut args = random_server_args(&mut rng);
    let mut server = start_server(&store, &args, true);
    let (mut racing_at_kill, mut touched, mut changed, mut flushed_ops) = (0, 0, 0, 0);

    for kill in 0..kills {
        let uri = server.uri("default");
        // Rounds of writes, each ending with a FLUSH that completes.
        for _ in 0..rng.range(1, 3) {
            let ops: Vec<Op> = (0..rng.range(2, 10))
                .map(|_| random_op(&mut rng, true))
                .collect();
            let mut cmds: Vec<String> = ops.iter().map(Op::qemu_io).collect();
            cmds.push("flush".into());
            qemu_io_ok(&uri, &cmds);
            for op in &ops {
                model.apply_durable(op);
            }
            flushed_ops += ops.len();
        }
        // Clients racing the kill: more writes; a client whose process
        // exits before the kill has flushed them (qemu flushes on close).
        let clients: Vec<Vec<Op>> = (0..rng.range(1, 2))
            .map(|_| {
                (0..rng.range(100, 400))
                    .map(|_| random_op(&mut rng, false))
                    .collect()
            })
            .collect();
        let mut children: Vec<Child> = clients
            .iter()
            .map(|ops| {
                let mut cmds: Vec<String> = ops.iter().map(Op::qemu_io).collect();
                if rng.percent(50) {
                    cmds.push("flush".into());
                }
                qemu_io(&uri, &cmds)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("starting qemu-io")
            })
            .collect();
        std::thread::sleep(Duration::from_millis(rng.range(0, 300)));
        let done: Vec<bool> = children
            .iter_mut()
            .map(|c| matches!(c.try_wait(), Ok(Some(s)) if s.success()))
            .collect();
        server.kill();
        if done.iter().any(|d| !d) {
            racing_at_kill += 1;
        }
        for mut c in children {
            let _ = c.kill();
            let _ = c.wait();
        }
        model.apply_racing(&clients, &done);

        if fsck {
            // every other check under tiny bounds: its sorts spill to the
            // store's scratch file and its metadata pages through small caches
            let opts: &[&str] = if kill % 2 == 1 {
                &[
                    "--index-memory",
                    "64K",
                    "--map-cache",
                    "64K",
                    "--reverse-index-cache",
                    "64K",
                ]
            } else {
                &[]
            };
            fsck_clean_with(&store, &format!("kill {kill} (seed {seed:#x})"), opts);
        }
        args = random_server_args(&mut rng);
        server = start_server(&store, &args, false);
        let image = read_image(&server.uri("default"), tmp.path());
        let (t, c) = model.check_and_settle(&image, seed, kill);
        touched += t;
        changed += c;
    }
    server.stop();
    if fsck {
        fsck_clean_with(&store, "the final clean stop", &["--rehash"]);
    }
    eprintln!(
        "crash: qemu-io test: {kills} kills in {:.1} s ({racing_at_kill} with a client still \
         writing), {flushed_ops} flushed operations verified; of {touched} blocks written by the \
         racing clients, {changed} read back changed",
        start.elapsed().as_secs_f64()
    );
    assert!(
        racing_at_kill * 2 >= kills,
        "only {racing_at_kill} of {kills} kills hit a client that was still writing"
    );
}

/// The files of the ext4 test: a slice of the source tree of about
/// `total` bytes, in `n` batches of about equal size.
fn ext4_batches(total: u64, n: usize) -> (PathBuf, Vec<Vec<PathBuf>>) {
    let src = source_tree();
    let mut picked = Vec::new();
    let mut sum = 0;
    for f in files_under(&src) {
        let len = f.metadata().unwrap().len();
        if len > 8 << 20 {
            continue;
        }
        picked.push((f, len));
        sum += len;
        if sum >= total {
            break;
        }
    }
    assert!(
        sum >= total / 2,
        "source tree {} has only {sum} bytes in files under 8 MiB; set DEDUPD_E2E_TREE",
        src.display()
    );
    let mut batches = vec![Vec::new(); n];
    let mut acc = 0;
    for (f, len) in picked {
        let i = ((acc * n as u64) / sum).min(n as u64 - 1) as usize;
        batches[i].push(f);
        acc += len;
    }
    (src, batches)
}

/// Shell command copying `files` (relative to `src`) into `dst`, keeping
/// the relative paths.
fn copy_script(src: &Path, files: &[PathBuf], dst: &Path) -> String {
    let mut s = String::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let to = dst.join(rel);
        s.push_str(&format!(
            "mkdir -p '{}' && cp '{}' '{}' && ",
            to.parent().unwrap().display(),
            f.display(),
            to.display()
        ));
    }
    s.push_str("true");
    s
}

/// Attached volume: nbdfuse, loop device, mounted ext4.
struct Attached {
    fuse: Fuse,
    lo: Loop,
    mount: Option<Mount>,
}

fn attach(server: &Server, fuse_dir: &Path) -> (Fuse, Loop) {
    let fuse = Fuse::mount_quiet(fuse_dir, &server.uri("default"));
    let lo = Loop::attach(&fuse.file());
    (fuse, lo)
}

#[test]
fn kill9_during_ext4_copies_keeps_synced_files() {
    require_ext4_tools();
    require("sh");
    let seed = env_u64("DEDUPD_CRASH_SEED", 0x00de_dd5e_ed01);
    let kills = env_u64("DEDUPD_CRASH_EXT4_KILLS", 6) as usize;
    eprintln!("crash: ext4 test: seed {seed:#x} (set DEDUPD_CRASH_SEED to repeat), {kills} kills");
    let mut rng = Rng(seed ^ 0xe4e4);
    let fsck = fsck_available();
    let (src, batches) = ext4_batches(64 << 20, kills + 1);
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let fuse_dir = tmp.path().join("fuse");
    let mnt = tmp.path().join("mnt");
    let start = Instant::now();

    let mut server = Server::start(&store, &["--default-volume-size", "512M"]);
    let (fuse, lo) = attach(&server, &fuse_dir);
    run(Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096", &lo.0]));
    let mount = Mount::new(&lo.0, &mnt, "rw");
    run(&mut Command::new("sync"));
    let mut att = Attached {
        fuse,
        lo,
        mount: Some(mount),
    };
    // files copied and synced: (source, copy)
    let mut synced: Vec<(PathBuf, PathBuf)> = Vec::new();
    // kills that met the copy still running (the others test a restart)
    let mut while_writing = 0;

    for kill in 0..kills {
        // Copy one batch and sync it: these files must survive.
        let dst = mnt.join(format!("synced{kill}"));
        let t = Instant::now();
        run(Command::new("sh")
            .arg("-c")
            .arg(copy_script(&src, &batches[kill], &dst)));
        run(&mut Command::new("sync"));
        let phase = t.elapsed();
        for f in &batches[kill] {
            synced.push((f.clone(), dst.join(f.strip_prefix(&src).unwrap())));
        }
        // Copy the next batch, sync, delete the previous victim, sync, copy
        // again, sync, and kill the server somewhere in between.
        let victim = mnt.join(format!("victim{kill}"));
        let old = mnt.join(format!("victim{}", kill.wrapping_sub(1)));
        let script = format!(
            "{} && sync && rm -rf '{}' && sync && {} && sync",
            copy_script(&src, &batches[kill + 1], &victim.join("a")),
            old.display(),
            copy_script(&src, &batches[kill], &victim.join("b")),
        );
        let mut writer = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the copy");
        let delay = rng.range(10, (phase.as_millis() as u64 * 3 / 2).max(50));
        std::thread::sleep(Duration::from_millis(delay));
        let running = writer.try_wait().unwrap().is_none();
        server.kill();
        while_writing += usize::from(running);
        eprintln!(
            "crash: ext4 kill {kill}: after {delay} ms of a copy+sync phase (the synced phase \
             took {} ms); writer {}",
            phase.as_millis(),
            if running {
                "still running"
            } else {
                "already done"
            }
        );

        // Tear down the stale stack: mount, loop, FUSE.
        if let Some(m) = att.mount.take() {
            m.abandon();
        }
        let _ = writer.kill();
        let _ = writer.wait();
        drop(att.lo);
        att.fuse.abandon();

        if fsck {
            fsck_clean(&store, &format!("ext4 kill {kill} (seed {seed:#x})"));
        }
        server = Server::start(&store, &[]);
        let (fuse, lo) = attach(&server, &fuse_dir);
        // Mounting replays the ext4 journal; after unmounting, the file
        // system must be clean without any repair.
        Mount::new(&lo.0, &mnt, "rw").unmount();
        let out = Command::new("e2fsck")
            .args(["-fn", &lo.0])
            .output()
            .expect("running e2fsck");
        assert!(
            out.status.success(),
            "seed {seed:#x}, ext4 kill {kill}: e2fsck -fn after journal replay is not clean \
             ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mount = Mount::new(&lo.0, &mnt, "rw");
        for (from, to) in &synced {
            assert!(
                to.is_file(),
                "seed {seed:#x}, ext4 kill {kill}: synced file {} is missing",
                to.display()
            );
            assert_eq!(
                sha256_file(to),
                sha256_file(from),
                "seed {seed:#x}, ext4 kill {kill}: synced file {} differs from its source",
                to.display()
            );
        }
        eprintln!(
            "crash: ext4 kill {kill}: journal replayed, e2fsck -fn clean, {} synced files intact",
            synced.len()
        );
        att = Attached {
            fuse,
            lo,
            mount: Some(mount),
        };
    }
    if let Some(m) = att.mount.take() {
        m.unmount();
    }
    drop(att.lo);
    drop(att.fuse);
    server.stop();
    if fsck {
        fsck_clean_with(&store, "the final clean stop", &["--rehash"]);
    }
    eprintln!(
        "crash: ext4 test: {kills} kills ({while_writing} while the copy ran) in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    // (each kill comes within 1.5 times one copy-and-sync phase, into a
    // script of three of them: a run where none met it tested no crash)
    assert!(
        while_writing > 0,
        "no kill met the copy running (seed {seed:#x})"
    );
}
