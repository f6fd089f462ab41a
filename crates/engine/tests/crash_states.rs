//! Crash-state enumeration in the spirit of CrashMonkey and ALICE.
//!
//! A recorder sees every write, length change, creation, removal, file sync
//! and directory sync the engine makes to its files (a file created or
//! removed since its directory's last sync may or may not be there after a
//! power loss). For random seeded workloads (writes with duplicate
//! content, overwrites, TRIMs, FLUSHes and FUA writes, a third volume
//! created, written, resized and deleted over and over, with small journal
//! and dirty bounds so commits and checkpoints happen often; commits log
//! pages whole and then as patches, which checkpoints fold in), the test
//! builds post-crash states — at each sync boundary and at random points,
//! with everything synced before the point plus a random subset of the
//! writes not yet synced, some metadata pages torn (only their first 512-byte
//! sectors written), some journal writes torn (only some of their sectors
//! written, in any order: after a checkpoint the journal restarts over its
//! old chain) — then opens each state and checks (the index has
//! a tiny budget, so out-of-line dedup passes remap blocks in between):
//! - the metadata invariants hold (reference counts, free space, index);
//! - every write acknowledged by a FLUSH (or FUA) reads back intact;
//! - every other block reads back as its content at the last FLUSH or as
//!   one of the contents written since (never a mix, never another block's);
//! - `fsck --rehash` finds nothing wrong;
//! - after recovery, new writes, TRIMs and a FLUSH, then a clean close,
//!   every block reads what it read after recovery or was written since,
//!   and reopened, exactly its last content;
//! - a second crash (power loss), while recovering or in that later work
//!   (its writes recorded too), recovers as the first: consistent, every
//!   block one of its allowed contents. Every other first crash is a
//!   process kill instead of a power loss: the recovery reads every write
//!   made (the page cache keeps them) though the unsynced ones are not
//!   durable, and the second crash may lose them.
//!
//! Data-file writes not yet synced may be torn too (any subset of their
//! sectors): no block a map points at may show it.
//!
//! The normal run builds several hundred states; set `DEDUPD_CRASH_STATES`
//! (e.g. 5000) for a long run.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use dedupd_engine::fsck::{fsck, FsckOptions};
use dedupd_engine::journal::{decode_txn, Op};
use dedupd_engine::observe::{IoEvent, IoObserver, Observer};
use dedupd_engine::{Engine, EngineConfig, HashAlgorithm, VolumeId};

const BLOCKS: u64 = 40;
const VOLUMES: usize = 2;

#[derive(Debug, Clone)]
enum Ev {
    Write(String, u64, Vec<u8>),
    SetLen(String, u64),
    Remove(String),
    Sync(String),
    Create(String),
    SyncDir(String),
    SyncStart(String),
}

/// The directory of store file `name` (`""` for the store's own).
fn dir_of(name: &str) -> &str {
    name.rsplit_once('/').map_or("", |(d, _)| d)
}

#[derive(Default)]
struct Recorder(Mutex<Vec<Ev>>);

impl IoObserver for Recorder {
    fn event(&self, e: IoEvent<'_>) {
        let ev = match e {
            IoEvent::Write { file, offset, data } => Ev::Write(file.into(), offset, data.to_vec()),
            IoEvent::SetLen { file, len_bytes } => Ev::SetLen(file.into(), len_bytes),
            IoEvent::Remove { file } => Ev::Remove(file.into()),
            IoEvent::Sync { file } => Ev::Sync(file.into()),
            IoEvent::Create { file } => Ev::Create(file.into()),
            IoEvent::SyncDir { dir } => Ev::SyncDir(dir.into()),
            IoEvent::SyncStart { file } => Ev::SyncStart(file.into()),
        };
        self.0.lock().unwrap().push(ev);
    }
}

impl Recorder {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Small xorshift generator: the test needs reproducible randomness only.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Content of pattern `p` (0 = zeros) for block `lba`-independent dedup.
fn block(p: u8) -> Vec<u8> {
    if p == 0 {
        return vec![0; 4096];
    }
    let mut b: Vec<u8> = (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(p) ^ p)
        .collect();
    b[0] = p;
    b
}

fn read_tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for sub in ["", "maps"] {
        let dir = root.join(sub);
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !e.file_type().unwrap().is_file() || ["lock", "fpgroups"].contains(&name.as_str()) {
                continue;
            }
            let rel = if sub.is_empty() {
                name
            } else {
                format!("{sub}/{name}")
            };
            out.insert(rel, std::fs::read(e.path()).unwrap());
        }
    }
    out
}

fn apply(content: &mut Vec<u8>, ev: &Ev) {
    match ev {
        Ev::Write(_, off, data) => {
            let end = *off as usize + data.len();
            if content.len() < end {
                content.resize(end, 0);
            }
            content[*off as usize..end].copy_from_slice(data);
        }
        Ev::SetLen(_, len) => content.resize(*len as usize, 0),
        _ => {}
    }
}

/// What ends the process at event `k`.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Crash {
    /// Power loss: synced changes, plus each unsynced change kept with
    /// probability 1/2 (in order), some torn.
    PowerLoss,
    /// The process killed: every change is in the page cache, so the next
    /// process reads them all (though the unsynced ones are not durable).
    Kill,
}

/// The files a crash after event `k` leaves.
fn crash_state(
    base: &BTreeMap<String, Vec<u8>>,
    events: &[Ev],
    k: usize,
    rng: &mut Rng,
    crash: Crash,
) -> BTreeMap<String, Vec<u8>> {
    // each file's content as far as it is durable (in its inode), and its
    // directory entry: there now, and there durably (since the last sync
    // of its directory)
    let mut durable: BTreeMap<String, Vec<u8>> = base.clone();
    let mut entry_now: BTreeMap<String, bool> = base.keys().map(|n| (n.clone(), true)).collect();
    let mut entry_durable = entry_now.clone();
    let mut pending: HashMap<String, Vec<Ev>> = HashMap::new();
    // files removed since their directory's last sync: their writes not
    // yet synced when removed
    let mut removed: HashMap<String, Vec<Ev>> = HashMap::new();
    // files created again since: the old one's durable content and writes
    // not yet synced
    let mut replaced: HashMap<String, (Vec<u8>, Vec<Ev>)> = HashMap::new();
    // files whose sync has begun: how many of their pending writes it covers
    let mut sync_started: HashMap<String, usize> = HashMap::new();
    for ev in &events[..k] {
        match ev {
            Ev::Write(f, ..) | Ev::SetLen(f, _) => {
                // (a file written that no event created was there before)
                if !entry_now.contains_key(f) {
                    entry_now.insert(f.clone(), true);
                    entry_durable.insert(f.clone(), true);
                }
                pending.entry(f.clone()).or_default().push(ev.clone())
            }
            Ev::SyncStart(f) => {
                sync_started.insert(f.clone(), pending.get(f).map_or(0, Vec::len));
            }
            Ev::Sync(f) => {
                let c = durable.entry(f.clone()).or_default();
                let mut writes = pending.remove(f).unwrap_or_default();
                // (a sync whose start was reported makes durable what was
                // written before it began: writes made meanwhile by other
                // threads stay pending)
                let later = match sync_started.remove(f) {
                    Some(n) if n <= writes.len() => writes.split_off(n),
                    _ => Vec::new(),
                };
                for p in writes {
                    apply(c, &p);
                }
                if !later.is_empty() {
                    pending.insert(f.clone(), later);
                }
            }
            Ev::Create(f) => {
                // created again under a name removed since its directory's
                // last sync (a recovery replaying a volume's creation and
                // deletion): the old file may come back instead
                if let Some(old_unsynced) = removed.remove(f) {
                    let old = durable.get(f).cloned().unwrap_or_default();
                    replaced.insert(f.clone(), (old, old_unsynced));
                }
                entry_now.insert(f.clone(), true);
                entry_durable.entry(f.clone()).or_insert(false);
                durable.insert(f.clone(), Vec::new());
                pending.remove(f);
            }
            Ev::Remove(f) => {
                // the entry may come back: with its durable content and
                // any of the writes not yet synced
                entry_now.insert(f.clone(), false);
                removed.insert(f.clone(), pending.remove(f).unwrap_or_default());
            }
            Ev::SyncDir(d) => {
                for (n, now) in &entry_now {
                    if dir_of(n) == d {
                        entry_durable.insert(n.clone(), *now);
                        removed.remove(n);
                        replaced.remove(n);
                    }
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for (n, &now) in &entry_now {
        let was = entry_durable.get(n).copied().unwrap_or(false);
        // an entry created or removed since its directory's last sync may
        // or may not be there after a power loss
        let mut exists = match crash {
            Crash::Kill => now,
            Crash::PowerLoss if now == was => now,
            Crash::PowerLoss => rng.below(2) == 0,
        };
        // a file created again: its old self, none, or the new one
        let old = match (crash, replaced.get(n)) {
            (Crash::PowerLoss, Some(old)) => match rng.below(3) {
                0 => Some(old),
                1 => {
                    exists = false;
                    None
                }
                _ => {
                    exists = true;
                    None
                }
            },
            _ => None,
        };
        if !exists && old.is_none() {
            continue;
        }
        let n = n.clone();
        // (a removal lost: the file as it was durably, and any of the
        // writes it had not synced)
        let (mut c, unsynced) = match old {
            Some((content, unsynced)) => (content.clone(), Some(unsynced)),
            None if now => (
                durable.get(&n).cloned().unwrap_or_default(),
                pending.get(&n),
            ),
            None => (
                durable.get(&n).cloned().unwrap_or_default(),
                removed.get(&n),
            ),
        };
        let paged = n == "refcounts" || n == "fingerprints" || n.starts_with("maps/");
        for p in unsynced.map(|v| v.as_slice()).unwrap_or(&[]) {
            let dice = match crash {
                Crash::PowerLoss => rng.below(4),
                Crash::Kill => 3,
            };
            match (dice, p) {
                (0 | 1, _) => {}
                // a page of metadata torn in place: only its first sectors
                (2, Ev::Write(f, off, data)) if paged && data.len() >= 1024 => {
                    let sectors = 1 + rng.below(data.len() as u64 / 512 - 1) as usize;
                    apply(
                        &mut c,
                        &Ev::Write(f.clone(), *off, data[..sectors * 512].to_vec()),
                    );
                }
                // a data write of several sectors of which only some reached
                // the disk, in any order (blocks are never rewritten in
                // place, so no block a map points at may show it)
                (2, Ev::Write(f, off, data)) if n == "data" && data.len() >= 1024 => {
                    for (i, sector) in data.chunks(512).enumerate() {
                        if rng.below(2) == 0 {
                            apply(
                                &mut c,
                                &Ev::Write(f.clone(), *off + i as u64 * 512, sector.to_vec()),
                            );
                        }
                    }
                }
                // a journal write of which only some sectors reached the
                // disk, in any order (power loss): its end without its
                // start, or any subset
                (2, Ev::Write(f, off, data)) if n == "journal" && data.len() > 512 => {
                    let suffix_from = (rng.below(2) == 0).then(|| rng.below(data.len() as u64));
                    let mut at = 0usize;
                    while at < data.len() {
                        // sectors are aligned on the file's 512-byte boundaries
                        let end = (((*off as usize + at) / 512 + 1) * 512 - *off as usize)
                            .min(data.len());
                        let keep = match suffix_from {
                            Some(cut) => at as u64 >= cut,
                            None => rng.below(2) == 0,
                        };
                        if keep {
                            apply(
                                &mut c,
                                &Ev::Write(f.clone(), *off + at as u64, data[at..end].to_vec()),
                            );
                        }
                        at = end;
                    }
                }
                _ => apply(&mut c, p),
            }
        }
        out.insert(n, c);
    }
    out
}

fn write_tree(root: &Path, files: &BTreeMap<String, Vec<u8>>) {
    std::fs::create_dir_all(root.join("maps")).unwrap();
    for (n, c) in files {
        std::fs::write(root.join(n), c).unwrap();
    }
}

/// The engine's configuration for a recorded workload: small journal and
/// dirty bounds, so commits and checkpoints happen often, one-page caches
/// and a tiny memory-only index, reporting to `recorder`.
fn recorded_config(recorder: &Arc<Recorder>) -> EngineConfig {
    EngineConfig {
        journal_size_bytes: 16 << 10,
        // a one-page reverse-index cache: pages leave and come back
        reverse_index_cache_bytes: 4064,
        // and one page for the volume maps and reference counts together
        map_cache_bytes: 4064,
        max_dirty_bytes: 8 << 10,
        max_pending_free_bytes: 16 << 10,
        // a tiny memory-only index: inline dedup misses, out-of-line passes run
        index: dedupd_engine::index::IndexConfig {
            memory_budget_bytes: 4096,
            prefix_bits: 8,
            ..Default::default()
        },
        observer: Observer(Some(recorder.clone())),
        ..EngineConfig::default()
    }
}

/// Crash points of `events`, in order: right before each sync and after it
/// (before: its file's writes all pending, what a kill leaves a recovery
/// to read without their being durable), and `random` points anywhere.
fn crash_points(events: &[Ev], random: usize, rng: &mut Rng) -> Vec<usize> {
    let mut points: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Ev::Sync(_)))
        .flat_map(|(i, _)| [i, i + 1])
        .collect();
    for _ in 0..random {
        points.push(rng.below(events.len() as u64 + 1) as usize);
    }
    points.sort_unstable();
    points.dedup();
    points
}

/// Allowed contents (pattern ids) per (volume, block) after each operation.
type Allowed = Vec<Vec<BTreeSet<u8>>>;

/// The contents allowed after a crash at event `k` of a workload whose
/// `history` holds (event count after each operation, allowed contents
/// after it): those after the last operation complete by then, united with
/// those after the operation in progress (if any); before the first
/// entry's end, that entry's alone. Returns the index of that last
/// operation too.
fn allowed_at(history: &[(usize, Allowed)], k: usize) -> (usize, Allowed) {
    let Some(j) = history.iter().rposition(|(end, _)| *end <= k) else {
        return (0, history[0].1.clone());
    };
    let mut allowed = history[j].1.clone();
    if let Some((_, next)) = history.get(j + 1) {
        for (a, n) in allowed.iter_mut().zip(next) {
            for (set, more) in a.iter_mut().zip(n) {
                set.extend(more.iter().copied());
            }
        }
    }
    (j, allowed)
}

/// Asserts that a store recovered from a crash is consistent and not
/// damaged: a crash is not damage (no file missing, short or failing its
/// checksums where the journal does not cover it).
fn assert_recovered(e: &Engine, what: &str) {
    let errs = e.check();
    assert!(errs.is_empty(), "{what}: invariants violated: {errs:?}");
    assert!(
        e.damage().is_empty(),
        "{what}: damage after a crash: {:?}",
        e.damage().iter().map(|d| d.describe()).collect::<Vec<_>>()
    );
}

/// Asserts that every block of every volume reads one of its allowed
/// contents.
fn assert_reads(e: &Engine, allowed: &Allowed, what: &str) {
    for (v, vol) in allowed.iter().enumerate() {
        let (id, _) = e.volume(&format!("v{v}")).unwrap();
        for (b, set) in vol.iter().enumerate() {
            let mut buf = vec![0u8; 4096];
            e.read(id, b as u64 * 4096, &mut buf).unwrap();
            assert!(
                set.iter().any(|&p| block(p) == buf),
                "{what}: volume v{v} block {b} reads content not in {set:?} (first byte {})",
                buf[0]
            );
        }
    }
}

/// Runs one seeded workload and checks its crash states; returns the
/// states checked, the journal patches and in-place page writes made, and
/// the files created or removed.
fn run_seed(seed: u64, states_wanted: usize, dir: &Path) -> (usize, usize, usize, usize) {
    let store = dir.join("store");
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    {
        let e = Engine::create(&store, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        for v in 0..VOLUMES {
            e.create_volume(&format!("v{v}"), BLOCKS * 4096).unwrap();
        }
        e.close().unwrap();
    }
    let base = read_tree(&store);
    let recorder = Arc::new(Recorder::default());
    let engine = Engine::open(&store, recorded_config(&recorder)).unwrap();
    let ids: Vec<VolumeId> = (0..VOLUMES)
        .map(|v| engine.volume(&format!("v{v}")).unwrap().0)
        .collect();
    let mut current = vec![vec![0u8; BLOCKS as usize]; VOLUMES];
    let mut allowed: Allowed = vec![vec![BTreeSet::from([0u8]); BLOCKS as usize]; VOLUMES];
    // (event count after the op, allowed sets after the op)
    let mut history: Vec<(usize, Allowed)> = vec![(0, allowed.clone())];
    let mut log: Vec<String> = Vec::new();
    // a third volume, `v2`, created, written, resized and deleted over and
    // over (map files created and removed, blocks it shared with v0 and v1
    // released): patterns 4–9, so it shares some contents with them and
    // has some of its own; every pattern each of its blocks ever held
    let mut v2: Option<(VolumeId, u64)> = None;
    let mut v2_ever: Vec<BTreeSet<u8>> = vec![BTreeSet::from([0u8]); BLOCKS as usize];
    let mut v2_ops = 0;
    for _ in 0..120 {
        let v = rng.below(VOLUMES as u64) as usize;
        let lba = rng.below(BLOCKS);
        let n = (1 + rng.below(4)).min(BLOCKS - lba) as usize;
        match rng.below(13) {
            11 => match v2 {
                None => {
                    let id = engine.create_volume("v2", BLOCKS * 4096).unwrap();
                    v2 = Some((id, BLOCKS));
                    v2_ops += 1;
                    log.push("create v2".into());
                }
                Some((id, _)) if rng.below(2) == 0 => {
                    engine.delete_volume("v2").unwrap();
                    v2 = None;
                    log.push(format!("delete v2 ({id:?})"));
                }
                Some((id, _)) => {
                    let blocks = 1 + rng.below(BLOCKS);
                    engine.resize_volume("v2", blocks * 4096).unwrap();
                    v2 = Some((id, blocks));
                    log.push(format!("resize v2 to {blocks} blocks"));
                }
            },
            12 => {
                if let Some((id, blocks)) = v2 {
                    let lba = rng.below(blocks);
                    let n = (1 + rng.below(3)).min(blocks - lba) as usize;
                    let pats: Vec<u8> = (0..n).map(|_| 4 + rng.below(6) as u8).collect();
                    let data: Vec<u8> = pats.iter().flat_map(|&p| block(p)).collect();
                    engine.write(id, lba * 4096, &data, false).unwrap();
                    log.push(format!("write v2 lba {lba} {pats:?}"));
                    for (i, &p) in pats.iter().enumerate() {
                        v2_ever[lba as usize + i].insert(p);
                    }
                }
            }
            10 => {
                engine.dedup_pass(1 + rng.below(16) as usize).unwrap();
                log.push("dedup pass".into());
            }
            0..=5 => {
                let pats: Vec<u8> = (0..n).map(|_| rng.below(7) as u8).collect();
                let data: Vec<u8> = pats.iter().flat_map(|&p| block(p)).collect();
                let fua = rng.below(8) == 0;
                engine.write(ids[v], lba * 4096, &data, fua).unwrap();
                log.push(format!("write v{v} lba {lba} {pats:?} fua {fua}"));
                for (i, &p) in pats.iter().enumerate() {
                    current[v][lba as usize + i] = p;
                    allowed[v][lba as usize + i].insert(p);
                }
                if fua {
                    // FUA makes the whole store durable up to this point
                    for (a, c) in allowed.iter_mut().zip(&current) {
                        for (set, &p) in a.iter_mut().zip(c) {
                            *set = BTreeSet::from([p]);
                        }
                    }
                }
            }
            6 | 7 => {
                engine
                    .trim(ids[v], lba * 4096, n as u64 * 4096, false)
                    .unwrap();
                log.push(format!("trim v{v} lba {lba} n {n}"));
                for i in 0..n {
                    current[v][lba as usize + i] = 0;
                    allowed[v][lba as usize + i].insert(0);
                }
            }
            _ => {
                engine.flush().unwrap();
                log.push("flush".into());
                for (a, c) in allowed.iter_mut().zip(&current) {
                    for (set, &p) in a.iter_mut().zip(c) {
                        *set = BTreeSet::from([p]);
                    }
                }
            }
        }
        history.push((recorder.len(), allowed.clone()));
    }
    engine.flush().unwrap();
    let events = recorder.0.lock().unwrap().clone();
    drop(engine);
    // what the journal carried as patches, and pages checkpointed in place
    let patches: usize = events
        .iter()
        .filter_map(|e| match e {
            Ev::Write(f, _, data) if f == "journal" => decode_txn(data).ok(),
            _ => None,
        })
        .flat_map(|t| t.ops)
        .filter(|op| matches!(op, Op::Patch { .. }))
        .count();
    let in_place = events
        .iter()
        .filter(|e| matches!(e, Ev::Write(f, _, _) if f == "refcounts" || f.starts_with("maps")))
        .count();

    let syncs = events.iter().filter(|e| matches!(e, Ev::Sync(_))).count();
    let points = crash_points(&events, syncs + 4, &mut rng);
    let stride = (points.len() / states_wanted.max(1)).max(1);
    let mut checked = 0;
    let mut kills = 0;
    for (n, &k) in points.iter().enumerate().filter(|(n, _)| n % stride == 0) {
        let (j, allowed_k) = allowed_at(&history, k);
        let allowed = &allowed_k;
        // every other state a kill (the page cache keeps every write: the
        // recovery reads changes that are not durable), else a power loss
        let first = if checked % 2 == 1 {
            Crash::Kill
        } else {
            Crash::PowerLoss
        };
        kills += usize::from(first == Crash::Kill);
        let files = crash_state(&base, &events, k, &mut rng, first);
        let crash = dir.join(format!("crash-{n}"));
        write_tree(&crash, &files);
        // (what recovery itself writes is recorded: crashes during it are
        // built below)
        let base2 = read_tree(&crash);
        let recorder2 = Arc::new(Recorder::default());
        let config2 = EngineConfig {
            observer: Observer(Some(recorder2.clone())),
            ..EngineConfig::default()
        };
        let e = Engine::open(&crash, config2).unwrap_or_else(|err| {
            panic!("seed {seed} point {k}: crash state does not open: {err}")
        });
        assert_recovered(&e, &format!("seed {seed} point {k}"));
        // the pattern each block reads after recovery
        let mut seen = vec![vec![0u8; BLOCKS as usize]; VOLUMES];
        for (v, name) in (0..VOLUMES).map(|v| (v, format!("v{v}"))) {
            let (id, _) = e.volume(&name).unwrap();
            #[allow(clippy::needless_range_loop)] // b is also the block number
            for b in 0..BLOCKS as usize {
                let mut buf = vec![0u8; 4096];
                e.read(id, b as u64 * 4096, &mut buf).unwrap();
                let found = allowed[v][b].iter().copied().find(|&p| block(p) == buf);
                let ok = found.is_some();
                seen[v][b] = found.unwrap_or(0);
                if !ok && std::env::var_os("DEDUPD_CRASH_DEBUG").is_some() {
                    for (i, ev) in events.iter().enumerate().take(k + 3) {
                        let d = match ev {
                            Ev::Write(f, o, data) => format!("W {f} @{o} len {}", data.len()),
                            Ev::SetLen(f, l) => format!("L {f} {l}"),
                            Ev::Remove(f) => format!("R {f}"),
                            Ev::Sync(f) => format!("S {f}"),
                            Ev::Create(f) => format!("C {f}"),
                            Ev::SyncDir(d) => format!("D {d}"),
                            Ev::SyncStart(f) => format!("s {f}"),
                        };
                        eprintln!("{i:4} {d}");
                    }
                    let hi = j;
                    eprintln!(
                        "history index {hi:?}; ends {:?}",
                        history.iter().map(|h| h.0).collect::<Vec<_>>()
                    );
                    for (i, l) in log.iter().enumerate().take(hi + 2) {
                        eprintln!("op {i} (ends at event {}): {l}", history[i + 1].0);
                    }
                }
                assert!(
                    ok,
                    "seed {seed} point {k}/{}: volume {name} block {b} reads content not in {:?} (first byte {})",
                    events.len(),
                    allowed[v][b],
                    buf[0]
                );
            }
        }
        // after recovery: new writes (reusing the blocks recovery freed),
        // TRIMs and a FLUSH, then a clean close; each block reads what it
        // read after recovery or what was written since
        // v2, if there (it may be as created, resized, being deleted or
        // gone): each block one of the contents it ever held, or zeros
        if let Some((id, size_bytes)) = e.volume("v2") {
            for b in 0..(size_bytes / 4096).min(BLOCKS) {
                let mut buf = vec![0u8; 4096];
                e.read(id, b * 4096, &mut buf).unwrap();
                let set = &v2_ever[b as usize];
                assert!(
                    set.iter().any(|&p| block(p) == buf),
                    "seed {seed} point {k}: volume v2 block {b} reads content not in {set:?} (first byte {})",
                    buf[0]
                );
            }
        }
        let mut current2 = seen.clone();
        // (after a kill what recovery read is not all durable until its
        // first write or FLUSH makes the replayed journal so: a power loss
        // before then may give any content the first crash allowed)
        let mut allowed2: Allowed = match first {
            Crash::PowerLoss => seen
                .iter()
                .map(|vol| vol.iter().map(|&p| BTreeSet::from([p])).collect())
                .collect(),
            Crash::Kill => allowed.clone(),
        };
        let mut history2: Vec<(usize, Allowed)> = vec![(recorder2.len(), allowed2.clone())];
        // (half the time a FLUSH first, with nothing written since the
        // recovery: it still makes what the recovery read durable)
        let flush_first = rng.below(2) == 0;
        for step in 0..12 {
            let v = rng.below(VOLUMES as u64) as usize;
            let (id, _) = e.volume(&format!("v{v}")).unwrap();
            let lba = rng.below(BLOCKS);
            if step == 8 || (step == 0 && flush_first) {
                e.flush().unwrap();
                for (a, c) in allowed2.iter_mut().zip(&current2) {
                    for (set, &p) in a.iter_mut().zip(c) {
                        *set = BTreeSet::from([p]);
                    }
                }
            } else if rng.below(4) == 0 {
                e.trim(id, lba * 4096, 4096, false).unwrap();
                current2[v][lba as usize] = 0;
                allowed2[v][lba as usize].insert(0);
            } else {
                let p = rng.below(7) as u8;
                e.write(id, lba * 4096, &block(p), false).unwrap();
                current2[v][lba as usize] = p;
                allowed2[v][lba as usize].insert(p);
            }
            history2.push((recorder2.len(), allowed2.clone()));
        }
        e.close()
            .unwrap_or_else(|err| panic!("seed {seed} point {k}: close after recovery: {err}"));
        let closed_at = recorder2.len();
        drop(e);
        let events2 = recorder2.0.lock().unwrap().clone();
        // a crash while recovering or right after: a second recovery
        for c in 0..2 {
            let k2 = if c == 0 {
                // (within the open itself, where recovery writes)
                rng.below(history2[0].0 as u64 + 1) as usize
            } else {
                // (right after a sync: where one file is durable and the
                // next not yet)
                let syncs: Vec<usize> = events2
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| matches!(e, Ev::Sync(_)))
                    .map(|(i, _)| i + 1)
                    .collect();
                match syncs.len() {
                    0 => rng.below(events2.len() as u64 + 1) as usize,
                    n => syncs[rng.below(n as u64) as usize],
                }
            };
            let (_, allowed_k2) = allowed_at(&history2, k2);
            let again = dir.join(format!("crash-{n}-again-{c}"));
            // a power loss now: after a power loss, over the state that
            // recovery found; after a kill, over what was durable then, the
            // killed process's unsynced writes still pending (a sync of a
            // file by the recovery makes them durable too)
            let state = match first {
                Crash::PowerLoss => crash_state(&base2, &events2, k2, &mut rng, Crash::PowerLoss),
                Crash::Kill => {
                    let both: Vec<Ev> = events[..k].iter().chain(&events2).cloned().collect();
                    crash_state(&base, &both, k + k2, &mut rng, Crash::PowerLoss)
                }
            };
            write_tree(&again, &state);
            let e2 = Engine::open(&again, EngineConfig::default()).unwrap_or_else(|err| {
                panic!("seed {seed} point {k}, crash {k2} in recovery: does not open: {err}")
            });
            assert_recovered(
                &e2,
                &format!("seed {seed} point {k}, crash {k2} in recovery"),
            );
            assert_reads(
                &e2,
                &allowed_k2,
                &format!(
                    "seed {seed} point {k}, crash {k2}/{} in recovery",
                    events2.len()
                ),
            );
            drop(e2);
            std::fs::remove_dir_all(&again).unwrap();
        }
        // the clean close made everything durable
        let e = Engine::open(&crash, EngineConfig::default()).unwrap();
        assert!(
            e.check().is_empty(),
            "seed {seed} point {k}: {:?}",
            e.check()
        );
        let exact: Allowed = current2
            .iter()
            .map(|vol| vol.iter().map(|&p| BTreeSet::from([p])).collect())
            .collect();
        assert_reads(
            &e,
            &exact,
            &format!("seed {seed} point {k}, reopened after recovery ({closed_at} events)"),
        );
        drop(e);
        let r = fsck(
            &crash,
            FsckOptions {
                repair: false,
                rehash: true,
            },
        )
        .unwrap();
        assert_eq!(
            r.exit_code(),
            0,
            "seed {seed} point {k}: fsck: {:?}",
            r.problems
        );
        std::fs::remove_dir_all(&crash).unwrap();
        checked += 1;
    }
    let entries = events
        .iter()
        .filter(|e| matches!(e, Ev::Create(_) | Ev::Remove(_)))
        .count();
    assert!(v2_ops > 0 || entries == 0);
    assert!(
        kills > 0 || checked < 2,
        "seed {seed}: no first crash was a kill"
    );
    (checked, patches, in_place, entries)
}

#[test]
fn every_crash_state_recovers_consistent_with_flushed_writes_intact() {
    let total: usize = std::env::var("DEDUPD_CRASH_STATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    // more states means more workloads too: about 50 states per seed
    let seeds = (total as u64 / 50).max(8);
    let (mut checked, mut patches, mut in_place, mut entries) = (0, 0, 0, 0);
    for seed in 1..=seeds {
        let dir = tempfile::tempdir().unwrap();
        let (c, p, w, e) = run_seed(seed, (total as u64 / seeds) as usize, dir.path());
        checked += c;
        patches += p;
        in_place += w;
        entries += e;
    }
    eprintln!(
        "crash states checked: {checked} (journal patches {patches}, pages checkpointed in place {in_place}, files created or removed {entries})"
    );
    // and map files created and removed, as volumes come and go
    assert!(entries > 0, "no file was created or removed");
    // the states cover commits that log patches and checkpoints that fold
    // them into pages written in place
    assert!(
        patches > 0 && in_place > 0,
        "{patches} patches, {in_place} in-place writes"
    );
    assert!(
        checked as u64 >= (total as u64) / 2,
        "only {checked} crash states were built"
    );
}

/// One write of the concurrent workload: block, pattern, FUA, the
/// recorder's event count before the call and after it returned, and the
/// workload's clock after it returned.
#[derive(Clone, Copy, Debug)]
struct TimedWrite {
    block: usize,
    pattern: u8,
    fua: bool,
    start: usize,
    end: usize,
    returned_at: u64,
}

/// Writers on two threads (each its own blocks of v0, with contents that
/// also occur on the other's, so blocks are shared across threads) while a
/// third thread FLUSHes and runs out-of-line passes: after a crash at any
/// point, every block reads what the last write acknowledged before the
/// last completed FLUSH began (or a later FUA write) left, or what a later
/// write wrote, and the store is consistent. The recorder reports when
/// the data file's syncs begin, so a write made while a commit syncs is
/// not taken as synced by it.
#[test]
fn concurrent_writes_and_flushes_recover_with_flushed_writes_intact() {
    let rounds: u64 = std::env::var("DEDUPD_CRASH_STATES")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map_or(6, |n| (n / 100).max(6));
    let mut checked = 0;
    for seed in 1..=rounds {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        {
            let e = Engine::create(&store, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
            e.create_volume("v0", BLOCKS * 4096).unwrap();
            e.create_volume("v1", BLOCKS * 4096).unwrap();
            e.close().unwrap();
        }
        let base = read_tree(&store);
        let recorder = Arc::new(Recorder::default());
        let engine = Arc::new(Engine::open(&store, recorded_config(&recorder)).unwrap());
        let (v0, _) = engine.volume("v0").unwrap();
        // (what returned before a FLUSH began is told by this clock, not
        // by the recorder's count, which two threads may read alike)
        let clock = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tick =
            |c: &std::sync::atomic::AtomicU64| c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (engine, recorder, clock) = (engine.clone(), recorder.clone(), clock.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng((seed * 7919 + t * 104_729) | 1);
                    let half = BLOCKS as usize / 2;
                    let mut done = Vec::new();
                    for _ in 0..60 {
                        let b = t as usize * half + rng.below(half as u64) as usize;
                        let pattern = 1 + rng.below(6) as u8;
                        let fua = rng.below(10) == 0;
                        let start = recorder.len();
                        engine
                            .write(v0, b as u64 * 4096, &block(pattern), fua)
                            .unwrap();
                        let returned_at = tick(&clock);
                        let end = recorder.len();
                        done.push(TimedWrite {
                            block: b,
                            pattern,
                            fua,
                            start,
                            end,
                            returned_at,
                        });
                    }
                    done
                })
            })
            .collect();
        // (clock when each FLUSH began, recorder's count when it returned)
        let mut flushes: Vec<(u64, usize)> = Vec::new();
        for i in 0.. {
            if writers.iter().all(|w| w.is_finished()) {
                break;
            }
            if i % 3 == 2 {
                engine.dedup_pass(8).unwrap();
            } else {
                let began_at = tick(&clock);
                engine.flush().unwrap();
                flushes.push((began_at, recorder.len()));
            }
            std::thread::sleep(std::time::Duration::from_micros(300));
        }
        let writes: Vec<TimedWrite> = writers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        let events = recorder.0.lock().unwrap().clone();
        drop(engine);
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let points = crash_points(&events, 20, &mut rng);
        let stride = (points.len() / 40).max(1);
        for (n, &k) in points.iter().enumerate().filter(|(n, _)| n % stride == 0) {
            // each block: its content as of the last completed FLUSH's
            // start (or a later FUA write), or any write begun since
            let flushed_from = flushes.iter().filter(|f| f.1 <= k).map(|f| f.0).max();
            let mut allowed: Vec<BTreeSet<u8>> = Vec::new();
            for b in 0..BLOCKS as usize {
                let mine: Vec<&TimedWrite> = writes.iter().filter(|w| w.block == b).collect();
                // (a thread's writes to its block are in program order)
                let durable = mine.iter().rposition(|w| {
                    flushed_from.is_some_and(|f| w.returned_at < f) || (w.fua && w.end <= k)
                });
                let mut set = BTreeSet::new();
                set.insert(durable.map_or(0, |i| mine[i].pattern));
                for w in &mine[durable.map_or(0, |i| i + 1)..] {
                    if w.start <= k {
                        set.insert(w.pattern);
                    }
                }
                allowed.push(set);
            }
            let files = crash_state(&base, &events, k, &mut rng, Crash::PowerLoss);
            let crash = dir.path().join(format!("crash-{n}"));
            write_tree(&crash, &files);
            let e = Engine::open(&crash, EngineConfig::default()).unwrap_or_else(|err| {
                panic!("concurrent seed {seed} point {k}: crash state does not open: {err}")
            });
            assert_recovered(&e, &format!("concurrent seed {seed} point {k}"));
            // (v0's blocks)
            assert_reads(
                &e,
                &vec![allowed],
                &format!("concurrent seed {seed} point {k}/{}", events.len()),
            );
            drop(e);
            std::fs::remove_dir_all(&crash).unwrap();
            checked += 1;
        }
    }
    eprintln!("concurrent crash states checked: {checked}");
    assert!(checked >= 6 * 20, "only {checked} concurrent crash states");
}
