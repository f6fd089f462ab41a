//! The two-level fingerprint store (SmartDedup §3.2): a small in-memory
//! store of hot fingerprints and a complete on-disk store, both reached
//! through one prefix tree, so memory is a fixed budget and nothing is
//! forgotten.
//!
//! - **Prefix tree**: the first P bits of a fingerprint select a leaf
//!   (P is chosen when the store is created; default 14: 16384 groups,
//!   at most 2 pages each up to ~32 GiB of unique data). Leaves live in
//!   chunks of 256 allocated on demand (a two-level radix tree). A leaf holds
//!   the slot of its in-memory group and the location of its on-disk group;
//!   a missing leaf proves the fingerprint absent, so no Bloom filter is
//!   needed.
//! - **In-memory groups**: sorted arrays of (key, PBA), 16 bytes an entry,
//!   under a budget in bytes (`--index-memory`).
//! - **On-disk groups**: a file of groups, each a sorted array in whole 4 KiB
//!   pages (32-byte header with a CRC32C); a lookup reads one group and
//!   binary-searches it.
//! - **Eviction**: G-LRU (default) evicts the least recently used group
//!   whole, with one read-merge-write of its on-disk group (none if the
//!   group gained nothing since it was loaded); per-fingerprint LRU is
//!   available for comparison (one read-merge-write per evicted entry). An
//!   on-disk hit promotes only that fingerprint.
//!
//! Keys are the first 64 bits of the fingerprint (the prefix included).
//! Every hit is validated by the caller against the reverse index
//! (reference count > 0 and the full 256-bit fingerprint stored for that
//! PBA), so a key collision or a stale entry is a miss, never wrong data:
//! dedup correctness does not depend on the key length. What a collision
//! can cost is a missed duplicate: two different blocks of one group with
//! equal 64-bit keys keep one entry. With g entries in a group the chance
//! is about g² / 2^65 per group (g = 256: ≈ 2^-49). `--verify` still
//! byte-compares every hit.
//!
//! Deletions remove the entry from memory; an on-disk entry is left stale and
//! dropped the next time its group is rewritten (stale entries fail
//! validation). The on-disk store is derived data: it is rebuilt from the
//! journaled reverse index each time the store opens, so it needs no journal.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

use crate::block::Pba;
use crate::fingerprint::Fingerprint;

/// Bytes of one index entry (64-bit key, 64-bit PBA), in memory and on disk.
pub const ENTRY_BYTES: usize = 16;
const GROUP_PAGE: usize = 4096;
const GROUP_HEADER: usize = 32;
const GROUP_MAGIC: u32 = u32::from_le_bytes(*b"DDFG");
const NONE: u32 = u32::MAX;

/// How the in-memory store chooses what to evict when its budget is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvictionPolicy {
    /// Group LRU (SmartDedup §3.2): evict the least recently used prefix
    /// group whole, with one read-merge-write of its on-disk group.
    #[default]
    GroupLru,
    /// Per-fingerprint LRU: evict single entries (one read-merge-write
    /// each); for comparison.
    Lru,
}

impl std::str::FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "glru" | "g-lru" | "group-lru" => Ok(EvictionPolicy::GroupLru),
            "lru" => Ok(EvictionPolicy::Lru),
            _ => Err(format!(
                "unknown eviction policy {s:?} (expected glru or lru)"
            )),
        }
    }
}

/// Whether an inline lookup may read the on-disk store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LookupMode {
    /// SmartDedup: a miss in memory never waits on disk (out-of-line dedup
    /// finds the rest).
    #[default]
    Memory,
    /// dmdedup-style: a miss in memory searches the on-disk group too.
    Disk,
}

impl std::str::FromStr for LookupMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "memory" => Ok(LookupMode::Memory),
            "disk" => Ok(LookupMode::Disk),
            _ => Err(format!(
                "unknown lookup mode {s:?} (expected memory or disk)"
            )),
        }
    }
}

/// Configuration of the fingerprint index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Bytes of memory for in-memory groups (entries, group headers, LRU
    /// bookkeeping); the prefix tree is counted separately. Default 8 MiB.
    pub memory_budget_bytes: u64,
    /// Eviction policy.
    pub policy: EvictionPolicy,
    /// Inline lookup mode.
    pub lookup: LookupMode,
    /// Prefix bits P (8–24). Default 14.
    pub prefix_bits: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            memory_budget_bytes: 8 << 20,
            policy: EvictionPolicy::GroupLru,
            lookup: LookupMode::Memory,
            prefix_bits: 14,
        }
    }
}

/// Counters and gauges of the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexStats {
    /// Fingerprints in the in-memory store.
    pub entries_in_memory: u64,
    /// Entries in the on-disk store (may include stale ones awaiting a rewrite).
    pub entries_on_disk: u64,
    /// Bytes used by the in-memory store (counted against the budget).
    pub memory_bytes: u64,
    /// The in-memory budget in bytes.
    pub memory_budget_bytes: u64,
    /// Bytes of the prefix tree (always resident, outside the budget).
    pub tree_bytes: u64,
    /// Groups evicted from memory.
    pub groups_evicted: u64,
    /// Entries evicted from memory.
    pub entries_evicted: u64,
    /// On-disk group reads done by evictions (read-merge-write).
    pub eviction_reads: u64,
    /// On-disk group writes done by evictions.
    pub eviction_writes: u64,
    /// On-disk group reads done by lookups (`disk` mode).
    pub lookup_reads: u64,
    /// Fingerprints promoted from disk to memory after an on-disk hit.
    pub promotions: u64,
    /// Pages of the on-disk store file.
    pub disk_pages: u64,
}

/// Where on-disk groups live: a file (production) or memory (simulation).
pub trait GroupStore: Send {
    /// Reads `buf.len()` bytes at byte `offset` (zeros past the end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `data` at byte `offset`.
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()>;
}

/// On-disk groups in a file (`<store>/fpgroups`), rebuilt at every open.
pub struct FileGroupStore(pub File);

impl GroupStore for FileGroupStore {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.0.read_at(&mut buf[done..], offset + done as u64)? {
                0 => {
                    buf[done..].fill(0);
                    break;
                }
                n => done += n,
            }
        }
        Ok(())
    }
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_all_at(data, offset)
    }
}

/// On-disk groups kept in memory (simulation: I/O is counted, not done).
#[derive(Default)]
pub struct MemoryGroupStore(pub Vec<u8>);

impl GroupStore for MemoryGroupStore {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.0.get(offset as usize + i).copied().unwrap_or(0);
        }
        Ok(())
    }
    fn write_at(&mut self, data: &[u8], offset: u64) -> io::Result<()> {
        let end = offset as usize + data.len();
        if self.0.len() < end {
            self.0.resize(end, 0);
        }
        self.0[offset as usize..end].copy_from_slice(data);
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Leaf {
    mem: u32,
    disk_page: u32,
    disk_pages: u32,
    disk_count: u32,
}

impl Default for Leaf {
    fn default() -> Self {
        Leaf {
            mem: NONE,
            disk_page: 0,
            disk_pages: 0,
            disk_count: 0,
        }
    }
}

impl Leaf {
    fn is_empty(&self) -> bool {
        self.mem == NONE && self.disk_pages == 0
    }
}

type Entry = (u64, u64);

/// Per-entry access ticks, allocated only in per-fingerprint LRU mode (8
/// bytes in a group otherwise).
#[derive(Debug, Default)]
// boxed on purpose: 8 bytes per group instead of a 24-byte empty Vec
#[allow(clippy::box_collection)]
struct Ticks(Option<Box<Vec<u64>>>);

impl Ticks {
    fn v(&mut self) -> &mut Vec<u64> {
        self.0.get_or_insert_with(Default::default)
    }
    fn capacity(&self) -> usize {
        self.0.as_ref().map_or(0, |v| v.capacity())
    }
    fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|v| v.is_empty())
    }
    fn reserve_exact(&mut self, n: usize) {
        self.v().reserve_exact(n)
    }
    fn insert(&mut self, i: usize, t: u64) {
        self.v().insert(i, t)
    }
    fn remove(&mut self, i: usize) {
        self.v().remove(i);
    }
    fn shrink_to(&mut self, n: usize) {
        self.v().shrink_to(n)
    }
    fn get(&self, i: usize) -> u64 {
        self.0.as_ref().and_then(|v| v.get(i).copied()).unwrap_or(0)
    }
    fn set(&mut self, i: usize, t: u64) {
        self.v()[i] = t;
    }
}

#[derive(Debug, Default)]
struct Group {
    prefix: u32,
    entries: Vec<Entry>,
    /// Last access tick per entry (per-fingerprint LRU only).
    ticks: Ticks,
    prev: u32,
    next: u32,
    /// Entries added since the group was last written to disk.
    dirty: bool,
}

/// The 64-bit key of a fingerprint (its first 8 bytes, big-endian, so
/// the prefix is the key's top bits).
pub fn key_of(fp: &Fingerprint) -> u64 {
    u64::from_be_bytes(fp.0[..8].try_into().expect("8 bytes"))
}

/// The two-level fingerprint store. Not thread-safe by itself: the engine
/// holds it under its metadata lock.
pub struct FingerprintIndex {
    cfg: IndexConfig,
    tree: Vec<Option<Box<[Leaf; 256]>>>,
    groups: Vec<Group>,
    free_slots: Vec<u32>,
    head: u32,
    tail: u32,
    mem_entries: u64,
    mem_bytes: u64,
    store: Box<dyn GroupStore>,
    free_runs: BTreeMap<u32, u32>,
    end_page: u32,
    tick: u64,
    access: VecDeque<(u64, u32, u64)>,
    stats: IndexStats,
    /// Live duplicate copies the index dropped (copy, kept PBA), for
    /// out-of-line dedup to merge.
    displaced: Vec<(Pba, Pba)>,
}

impl std::fmt::Debug for FingerprintIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FingerprintIndex")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for FingerprintIndex {
    fn default() -> Self {
        FingerprintIndex::new(
            IndexConfig::default(),
            Box::new(MemoryGroupStore::default()),
        )
    }
}

/// Validates a candidate (key, PBA): true if the PBA is referenced and
/// its stored fingerprint starts with the key.
pub type Live<'a> = &'a dyn Fn(u64, Pba) -> bool;

impl FingerprintIndex {
    /// An empty index over `store`.
    pub fn new(cfg: IndexConfig, store: Box<dyn GroupStore>) -> Self {
        let p = cfg.prefix_bits.clamp(8, 24);
        FingerprintIndex {
            cfg: IndexConfig {
                prefix_bits: p,
                ..cfg
            },
            tree: (0..1usize << (p - 8)).map(|_| None).collect(),
            groups: Vec::new(),
            free_slots: Vec::new(),
            head: NONE,
            tail: NONE,
            mem_entries: 0,
            mem_bytes: 0,
            store,
            free_runs: BTreeMap::new(),
            end_page: 0,
            tick: 0,
            access: VecDeque::new(),
            stats: IndexStats::default(),
            displaced: Vec::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> IndexConfig {
        self.cfg
    }

    fn prefix_of(&self, key: u64) -> u32 {
        (key >> (64 - self.cfg.prefix_bits)) as u32
    }

    fn leaf(&self, prefix: u32) -> Option<&Leaf> {
        self.tree[(prefix >> 8) as usize]
            .as_ref()
            .map(|c| &c[(prefix & 255) as usize])
            .filter(|l| !l.is_empty())
    }

    fn leaf_mut(&mut self, prefix: u32) -> &mut Leaf {
        let chunk = self.tree[(prefix >> 8) as usize]
            .get_or_insert_with(|| Box::new([Leaf::default(); 256]));
        &mut chunk[(prefix & 255) as usize]
    }

    fn group_bytes(&self, g: &Group) -> u64 {
        (std::mem::size_of::<Group>() + g.entries.capacity() * ENTRY_BYTES + g.ticks.capacity() * 8)
            as u64
    }

    /// Figures of the index.
    pub fn stats(&self) -> IndexStats {
        let chunks = self.tree.iter().filter(|c| c.is_some()).count() as u64;
        IndexStats {
            entries_in_memory: self.mem_entries,
            memory_bytes: self.memory_bytes(),
            memory_budget_bytes: self.cfg.memory_budget_bytes,
            tree_bytes: chunks * std::mem::size_of::<[Leaf; 256]>() as u64
                + self.tree.capacity() as u64 * 8,
            disk_pages: self.end_page as u64,
            ..self.stats
        }
    }

    /// Bytes counted against the budget.
    pub fn memory_bytes(&self) -> u64 {
        self.mem_bytes
            + (self.groups.capacity() * std::mem::size_of::<Group>()) as u64
            + self.free_slots.capacity() as u64 * 4
            + self.access.capacity() as u64 * 32
    }

    /// Fingerprints held in memory and on disk (on-disk count may include
    /// stale entries).
    pub fn len(&self) -> u64 {
        self.mem_entries + self.stats.entries_on_disk
    }

    /// True if nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every in-memory entry as (key, PBA), for checks.
    pub fn memory_entries(&self) -> Vec<(u64, Pba)> {
        let mut out = Vec::new();
        let mut g = self.head;
        while g != NONE {
            let grp = &self.groups[g as usize];
            out.extend(grp.entries.iter().map(|&(k, p)| (k, Pba(p))));
            g = grp.next;
        }
        out
    }

    // ---- LRU list of groups ----------------------------------------------

    fn unlink(&mut self, g: u32) {
        let (prev, next) = {
            let grp = &self.groups[g as usize];
            (grp.prev, grp.next)
        };
        if prev != NONE {
            self.groups[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NONE {
            self.groups[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }

    fn push_front(&mut self, g: u32) {
        self.groups[g as usize].prev = NONE;
        self.groups[g as usize].next = self.head;
        if self.head != NONE {
            self.groups[self.head as usize].prev = g;
        }
        self.head = g;
        if self.tail == NONE {
            self.tail = g;
        }
    }

    fn touch(&mut self, g: u32, pos: usize) {
        if self.head != g {
            self.unlink(g);
            self.push_front(g);
        }
        if self.cfg.policy == EvictionPolicy::Lru {
            self.tick += 1;
            let key = self.groups[g as usize].entries[pos].0;
            self.groups[g as usize].ticks.set(pos, self.tick);
            let prefix = self.groups[g as usize].prefix;
            self.access.push_back((self.tick, prefix, key));
        }
    }

    fn new_group(&mut self, prefix: u32) -> u32 {
        let g = Group {
            prefix,
            prev: NONE,
            next: NONE,
            ..Group::default()
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.groups[s as usize] = g;
                s
            }
            None => {
                if self.groups.len() == self.groups.capacity() {
                    self.groups.reserve_exact(1 + self.groups.len() / 8);
                }
                self.groups.push(g);
                (self.groups.len() - 1) as u32
            }
        };
        self.mem_bytes += self.group_bytes(&self.groups[slot as usize]);
        self.push_front(slot);
        self.leaf_mut(prefix).mem = slot;
        slot
    }

    fn drop_group(&mut self, g: u32) {
        self.unlink(g);
        let grp = std::mem::take(&mut self.groups[g as usize]);
        self.mem_bytes -= self.group_bytes(&grp);
        self.mem_entries -= grp.entries.len() as u64;
        self.leaf_mut(grp.prefix).mem = NONE;
        self.free_slots.push(g);
    }

    /// Adds an entry to group `g` (sorted; replaces an equal key) and
    /// returns its position.
    fn add_entry(&mut self, g: u32, key: u64, pba: u64, dirty: bool) -> usize {
        let before = self.group_bytes(&self.groups[g as usize]);
        let lru = self.cfg.policy == EvictionPolicy::Lru;
        let grp = &mut self.groups[g as usize];
        let pos = match grp.entries.binary_search_by_key(&key, |e| e.0) {
            Ok(i) => {
                grp.entries[i].1 = pba;
                i
            }
            Err(i) => {
                if grp.entries.len() == grp.entries.capacity() {
                    let extra = 1 + grp.entries.len() / 8;
                    grp.entries.reserve_exact(extra);
                    if lru {
                        grp.ticks.reserve_exact(extra);
                    }
                }
                grp.entries.insert(i, (key, pba));
                if lru {
                    grp.ticks.insert(i, 0);
                }
                self.mem_entries += 1;
                i
            }
        };
        grp.dirty |= dirty;
        let after = self.group_bytes(&self.groups[g as usize]);
        self.mem_bytes = self.mem_bytes + after - before;
        pos
    }

    // ---- operations ------------------------------------------------------

    /// Looks `fp` up: first in memory, then (in `disk` mode) in its on-disk
    /// group, promoting an on-disk hit. Candidates failing `live` are
    /// treated as absent. Returns the PBA of a live entry.
    pub fn lookup(&mut self, fp: &Fingerprint, live: Live<'_>) -> io::Result<Option<Pba>> {
        let key = key_of(fp);
        let prefix = self.prefix_of(key);
        let Some(leaf) = self.leaf(prefix).copied() else {
            return Ok(None);
        };
        if leaf.mem != NONE {
            let g = leaf.mem;
            if let Ok(i) = self.groups[g as usize]
                .entries
                .binary_search_by_key(&key, |e| e.0)
            {
                let pba = Pba(self.groups[g as usize].entries[i].1);
                if live(key, pba) {
                    self.touch(g, i);
                    return Ok(Some(pba));
                }
            }
        }
        if self.cfg.lookup == LookupMode::Disk && leaf.disk_pages > 0 {
            self.stats.lookup_reads += 1;
            let entries = self.read_group(&leaf, prefix)?;
            if let Ok(i) = entries.binary_search_by_key(&key, |e| e.0) {
                let pba = Pba(entries[i].1);
                if live(key, pba) {
                    self.stats.promotions += 1;
                    let g = match self.leaf(prefix).map(|l| l.mem) {
                        Some(g) if g != NONE => g,
                        _ => self.new_group(prefix),
                    };
                    let pos = self.add_entry(g, key, pba.0, false);
                    self.touch(g, pos);
                    self.enforce_budget(live)?;
                    return Ok(Some(pba));
                }
            }
        }
        Ok(None)
    }

    /// Takes the live duplicate copies the index dropped since the last
    /// call, as (copy, PBA kept in the index).
    pub fn take_displaced(&mut self) -> Vec<(Pba, Pba)> {
        std::mem::take(&mut self.displaced)
    }

    /// Every live PBA the index holds for `fp`, in memory and on disk (an
    /// on-disk read whatever the lookup mode; nothing is promoted). Used by
    /// out-of-line dedup, which must see copies inline dedup missed.
    pub fn lookup_all(&mut self, fp: &Fingerprint, live: Live<'_>) -> io::Result<Vec<Pba>> {
        let key = key_of(fp);
        let prefix = self.prefix_of(key);
        let Some(leaf) = self.leaf(prefix).copied() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        if leaf.mem != NONE {
            let g = &self.groups[leaf.mem as usize];
            if let Ok(i) = g.entries.binary_search_by_key(&key, |e| e.0) {
                out.push(Pba(g.entries[i].1));
            }
        }
        if leaf.disk_pages > 0 {
            self.stats.lookup_reads += 1;
            let entries = self.read_group(&leaf, prefix)?;
            if let Ok(i) = entries.binary_search_by_key(&key, |e| e.0) {
                out.push(Pba(entries[i].1));
            }
        }
        out.retain(|&p| live(key, p));
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// Inserts `fp` → `pba` into the in-memory store, evicting to disk when
    /// the budget is full.
    pub fn insert(&mut self, fp: &Fingerprint, pba: Pba, live: Live<'_>) -> io::Result<()> {
        let key = key_of(fp);
        let prefix = self.prefix_of(key);
        let g = match self.leaf(prefix).map(|l| l.mem) {
            Some(g) if g != NONE => g,
            _ => self.new_group(prefix),
        };
        let pos = self.add_entry(g, key, pba.0, true);
        self.touch(g, pos);
        self.enforce_budget(live)
    }

    /// Removes `fp` → `pba` from memory if it is there. An on-disk copy is
    /// left stale (it fails validation) until its group is rewritten.
    pub fn remove(&mut self, fp: &Fingerprint, pba: Pba) {
        let key = key_of(fp);
        let prefix = self.prefix_of(key);
        let Some(leaf) = self.leaf(prefix).copied() else {
            return;
        };
        if leaf.mem == NONE {
            return;
        }
        let g = leaf.mem;
        let grp = &mut self.groups[g as usize];
        if let Ok(i) = grp.entries.binary_search_by_key(&key, |e| e.0) {
            if grp.entries[i].1 == pba.0 {
                grp.entries.remove(i);
                if !grp.ticks.is_empty() {
                    grp.ticks.remove(i);
                }
                self.mem_entries -= 1;
                if self.groups[g as usize].entries.is_empty() && leaf.disk_pages == 0 {
                    self.drop_group(g);
                }
            }
        }
    }

    fn enforce_budget(&mut self, live: Live<'_>) -> io::Result<()> {
        while self.memory_bytes() > self.cfg.memory_budget_bytes && self.tail != NONE {
            match self.cfg.policy {
                EvictionPolicy::GroupLru => self.evict_group(self.tail, live)?,
                EvictionPolicy::Lru => self.evict_lru_entry(live)?,
            }
        }
        Ok(())
    }

    /// G-LRU: writes the group's new entries to its on-disk group (one read,
    /// one write) and drops it from memory.
    fn evict_group(&mut self, g: u32, live: Live<'_>) -> io::Result<()> {
        self.stats.groups_evicted += 1;
        self.stats.entries_evicted += self.groups[g as usize].entries.len() as u64;
        if self.groups[g as usize].dirty {
            let prefix = self.groups[g as usize].prefix;
            let entries = self.groups[g as usize].entries.clone();
            self.merge_to_disk(prefix, &entries, live)?;
        }
        self.drop_group(g);
        Ok(())
    }

    /// Per-fingerprint LRU: evicts the least recently used entry alone.
    fn evict_lru_entry(&mut self, live: Live<'_>) -> io::Result<()> {
        while let Some((tick, prefix, key)) = self.access.pop_front() {
            let Some(leaf) = self.leaf(prefix).copied() else {
                continue;
            };
            if leaf.mem == NONE {
                continue;
            }
            let g = leaf.mem;
            let Ok(i) = self.groups[g as usize]
                .entries
                .binary_search_by_key(&key, |e| e.0)
            else {
                continue;
            };
            if self.groups[g as usize].ticks.get(i) != tick {
                continue; // accessed again later: a newer record exists
            }
            let entry = self.groups[g as usize].entries[i];
            self.stats.entries_evicted += 1;
            self.merge_to_disk(prefix, &[entry], live)?;
            let before = self.group_bytes(&self.groups[g as usize]);
            let grp = &mut self.groups[g as usize];
            grp.entries.remove(i);
            grp.ticks.remove(i);
            grp.entries
                .shrink_to(grp.entries.len() + grp.entries.len() / 8);
            grp.ticks.shrink_to(grp.entries.capacity());
            self.mem_entries -= 1;
            let after = self.group_bytes(&self.groups[g as usize]);
            self.mem_bytes = self.mem_bytes + after - before;
            if self.groups[g as usize].entries.is_empty() {
                self.drop_group(g);
            }
            if self.access.len() > 4 * self.mem_entries as usize + 64 {
                self.compact_access();
            }
            return Ok(());
        }
        // no records left: fall back to evicting a whole group
        self.evict_group(self.tail, live)
    }

    fn compact_access(&mut self) {
        let groups = &self.groups;
        let tree = &self.tree;
        self.access.retain(|&(tick, prefix, key)| {
            let Some(leaf) = tree[(prefix >> 8) as usize]
                .as_ref()
                .map(|c| c[(prefix & 255) as usize])
            else {
                return false;
            };
            if leaf.mem == NONE {
                return false;
            }
            let grp = &groups[leaf.mem as usize];
            grp.entries
                .binary_search_by_key(&key, |e| e.0)
                .is_ok_and(|i| grp.ticks.get(i) == tick)
        });
        self.access.shrink_to_fit();
    }

    /// Read-merge-write of the on-disk group of `prefix` with `add`
    /// (sorted); entries failing `live` are dropped.
    fn merge_to_disk(&mut self, prefix: u32, add: &[Entry], live: Live<'_>) -> io::Result<()> {
        let leaf = *self.leaf_mut(prefix);
        let mut merged: Vec<Entry> = Vec::new();
        if leaf.disk_pages > 0 {
            self.stats.eviction_reads += 1;
            let old = self.read_group(&leaf, prefix)?;
            merged.reserve(old.len() + add.len());
            let (mut i, mut j) = (0, 0);
            while i < old.len() || j < add.len() {
                let take_add = j < add.len() && (i >= old.len() || add[j].0 <= old[i].0);
                if take_add {
                    let mut keep = add[j];
                    if i < old.len() && old[i].0 == add[j].0 {
                        // two live copies of one fingerprint: keep the lower
                        // PBA, report the other for out-of-line merging
                        let other = old[i];
                        if other.1 != keep.1
                            && live(other.0, Pba(other.1))
                            && live(keep.0, Pba(keep.1))
                        {
                            let (lo, hi) = if other.1 < keep.1 {
                                (other, keep)
                            } else {
                                (keep, other)
                            };
                            self.displaced.push((Pba(hi.1), Pba(lo.1)));
                            keep = lo;
                        }
                        i += 1;
                    }
                    merged.push(keep);
                    j += 1;
                } else {
                    merged.push(old[i]);
                    i += 1;
                }
            }
        } else {
            merged.extend_from_slice(add);
        }
        merged.retain(|&(k, p)| live(k, Pba(p)));
        self.stats.entries_on_disk =
            self.stats.entries_on_disk + merged.len() as u64 - leaf.disk_count as u64;
        self.write_group(prefix, leaf, &merged)
    }

    fn read_group(&self, leaf: &Leaf, prefix: u32) -> io::Result<Vec<Entry>> {
        let mut buf = vec![0u8; leaf.disk_pages as usize * GROUP_PAGE];
        self.store
            .read_at(&mut buf, leaf.disk_page as u64 * GROUP_PAGE as u64)?;
        Ok(decode_group(&buf, prefix).unwrap_or_default())
    }

    fn write_group(&mut self, prefix: u32, leaf: Leaf, entries: &[Entry]) -> io::Result<()> {
        let pages = pages_for(entries.len());
        let mut new_leaf = leaf;
        if entries.is_empty() {
            self.free_run(leaf.disk_page, leaf.disk_pages);
            new_leaf.disk_page = 0;
            new_leaf.disk_pages = 0;
            new_leaf.disk_count = 0;
        } else {
            let page = if pages <= leaf.disk_pages && leaf.disk_pages > 0 {
                self.free_run(leaf.disk_page + pages, leaf.disk_pages - pages);
                leaf.disk_page
            } else {
                self.free_run(leaf.disk_page, leaf.disk_pages);
                self.alloc_run(pages)
            };
            self.stats.eviction_writes += 1;
            self.store.write_at(
                &encode_group(prefix, entries, pages),
                page as u64 * GROUP_PAGE as u64,
            )?;
            new_leaf.disk_page = page;
            new_leaf.disk_pages = pages;
            new_leaf.disk_count = entries.len() as u32;
        }
        let mem = self.leaf_mut(prefix).mem;
        *self.leaf_mut(prefix) = Leaf { mem, ..new_leaf };
        Ok(())
    }

    fn free_run(&mut self, start: u32, len: u32) {
        if len > 0 {
            self.free_runs.insert(start, len);
        }
    }

    fn alloc_run(&mut self, pages: u32) -> u32 {
        let found = self
            .free_runs
            .iter()
            .find(|(_, &len)| len >= pages)
            .map(|(&s, &l)| (s, l));
        match found {
            Some((start, len)) => {
                self.free_runs.remove(&start);
                if len > pages {
                    self.free_runs.insert(start + pages, len - pages);
                }
                start
            }
            None => {
                self.end_page += pages;
                self.end_page - pages
            }
        }
    }

    /// Rebuilds the whole index from every stored (fingerprint, PBA): writes
    /// the complete on-disk store, then loads groups into memory (clean, in
    /// prefix order) up to 90 % of the budget. Called when a store opens.
    pub fn rebuild(&mut self, mut all: Vec<(Fingerprint, Pba)>) -> io::Result<()> {
        let cfg = self.cfg;
        let store = std::mem::replace(&mut self.store, Box::new(MemoryGroupStore::default()));
        *self = FingerprintIndex::new(cfg, store);
        all.sort_unstable_by_key(|(fp, _)| key_of(fp));
        let mut i = 0;
        let mut loading = true;
        while i < all.len() {
            let prefix = self.prefix_of(key_of(&all[i].0));
            let mut j = i;
            let mut entries: Vec<Entry> = Vec::new();
            while j < all.len() && self.prefix_of(key_of(&all[j].0)) == prefix {
                let e = (key_of(&all[j].0), all[j].1 .0);
                match entries.last() {
                    // the same fingerprint stored twice: keep the lower PBA
                    // (sorted by key only, so compare), report the other
                    Some(l) if l.0 == e.0 => {
                        let (lo, hi) = (l.1.min(e.1), l.1.max(e.1));
                        if lo != hi {
                            self.displaced.push((Pba(hi), Pba(lo)));
                        }
                        if let Some(last) = entries.last_mut() {
                            last.1 = lo;
                        }
                    }
                    _ => entries.push(e),
                }
                j += 1;
            }
            let pages = pages_for(entries.len());
            let page = self.alloc_run(pages);
            self.store.write_at(
                &encode_group(prefix, &entries, pages),
                page as u64 * GROUP_PAGE as u64,
            )?;
            self.stats.entries_on_disk += entries.len() as u64;
            *self.leaf_mut(prefix) = Leaf {
                mem: NONE,
                disk_page: page,
                disk_pages: pages,
                disk_count: entries.len() as u32,
            };
            if loading {
                let g = self.new_group(prefix);
                for e in &entries {
                    let pos = self.add_entry(g, e.0, e.1, false);
                    if self.cfg.policy == EvictionPolicy::Lru {
                        self.touch(g, pos);
                    }
                }
                if self.memory_bytes() * 10 > self.cfg.memory_budget_bytes * 9 {
                    self.drop_group(g);
                    loading = false;
                }
            }
            i = j;
        }
        // loaded groups are clean: trimming to the budget costs no I/O
        self.enforce_budget(&|_, _| true)
    }
}

fn pages_for(entries: usize) -> u32 {
    (GROUP_HEADER + entries * ENTRY_BYTES)
        .div_ceil(GROUP_PAGE)
        .max(1) as u32
}

fn encode_group(prefix: u32, entries: &[Entry], pages: u32) -> Vec<u8> {
    let mut out = vec![0u8; pages as usize * GROUP_PAGE];
    for (i, (k, p)) in entries.iter().enumerate() {
        let o = GROUP_HEADER + i * ENTRY_BYTES;
        out[o..o + 8].copy_from_slice(&k.to_le_bytes());
        out[o + 8..o + 16].copy_from_slice(&p.to_le_bytes());
    }
    let body_end = GROUP_HEADER + entries.len() * ENTRY_BYTES;
    let mut crc = crc32c::crc32c(&out[GROUP_HEADER..body_end]);
    crc = crc32c::crc32c_append(crc, &prefix.to_le_bytes());
    crc = crc32c::crc32c_append(crc, &(entries.len() as u32).to_le_bytes());
    out[0..4].copy_from_slice(&GROUP_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&prefix.to_le_bytes());
    out[8..12].copy_from_slice(&(entries.len() as u32).to_le_bytes());
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes an on-disk group; `None` if its header or checksum is wrong.
fn decode_group(buf: &[u8], prefix: u32) -> Option<Vec<Entry>> {
    if buf.len() < GROUP_HEADER {
        return None;
    }
    let word = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().expect("4 bytes"));
    if word(0) != GROUP_MAGIC || word(4) != prefix {
        return None;
    }
    let n = word(8) as usize;
    let body_end = GROUP_HEADER + n * ENTRY_BYTES;
    if body_end > buf.len() {
        return None;
    }
    let mut crc = crc32c::crc32c(&buf[GROUP_HEADER..body_end]);
    crc = crc32c::crc32c_append(crc, &prefix.to_le_bytes());
    crc = crc32c::crc32c_append(crc, &(n as u32).to_le_bytes());
    if crc != word(12) {
        return None;
    }
    Some(
        (0..n)
            .map(|i| {
                let o = GROUP_HEADER + i * ENTRY_BYTES;
                (
                    u64::from_le_bytes(buf[o..o + 8].try_into().expect("8 bytes")),
                    u64::from_le_bytes(buf[o + 8..o + 16].try_into().expect("8 bytes")),
                )
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn fp(i: u64) -> Fingerprint {
        crate::fingerprint::HashAlgorithm::Sha256.fingerprint(&i.to_le_bytes())
    }

    fn index(budget: u64, policy: EvictionPolicy, lookup: LookupMode) -> FingerprintIndex {
        FingerprintIndex::new(
            IndexConfig {
                memory_budget_bytes: budget,
                policy,
                lookup,
                prefix_bits: 10,
            },
            Box::new(MemoryGroupStore::default()),
        )
    }

    #[test]
    fn bounded_memory_and_disk_mode_finds_everything() {
        for policy in [EvictionPolicy::GroupLru, EvictionPolicy::Lru] {
            let mut live_set: HashMap<u64, u64> = HashMap::new();
            let mut idx = index(64 << 10, policy, LookupMode::Disk);
            for i in 0..20_000u64 {
                let f = fp(i);
                live_set.insert(key_of(&f), i);
                let live = |k: u64, p: Pba| live_set.get(&k) == Some(&p.0);
                idx.insert(&f, Pba(i), &live).unwrap();
                assert!(idx.memory_bytes() <= 64 << 10, "{policy:?} over budget");
            }
            let live = |k: u64, p: Pba| live_set.get(&k) == Some(&p.0);
            for i in (0..20_000u64).step_by(7) {
                assert_eq!(
                    idx.lookup(&fp(i), &live).unwrap(),
                    Some(Pba(i)),
                    "{policy:?} lost {i}"
                );
            }
            assert!(idx.lookup(&fp(99_999), &live).unwrap().is_none());
            let s = idx.stats();
            assert!(s.eviction_writes > 0 && s.promotions > 0);
            assert!(s.entries_in_memory < 20_000);
        }
    }

    #[test]
    fn memory_mode_never_reads_disk_and_removed_entries_stay_gone() {
        let mut live_set: HashMap<u64, u64> = HashMap::new();
        let mut idx = index(16 << 10, EvictionPolicy::GroupLru, LookupMode::Memory);
        for i in 0..5_000u64 {
            live_set.insert(key_of(&fp(i)), i);
            let live = |k: u64, p: Pba| live_set.get(&k) == Some(&p.0);
            idx.insert(&fp(i), Pba(i), &live).unwrap();
        }
        let live = |k: u64, p: Pba| live_set.get(&k) == Some(&p.0);
        let found = (0..5_000u64)
            .filter(|&i| idx.lookup(&fp(i), &live).unwrap().is_some())
            .count();
        assert!(found < 5_000 && found > 0);
        assert_eq!(idx.stats().lookup_reads, 0);
        // a removed (dead) entry is not returned, from memory or from disk
        live_set.remove(&key_of(&fp(4_999)));
        idx.remove(&fp(4_999), Pba(4_999));
        let live = |k: u64, p: Pba| live_set.get(&k) == Some(&p.0);
        assert!(idx.lookup(&fp(4_999), &live).unwrap().is_none());
    }

    #[test]
    fn group_eviction_costs_at_most_one_read_and_one_write() {
        let live = |_: u64, _: Pba| true;
        // about 8 entries per in-memory group (P = 10, 128 KiB budget)
        let mut idx = index(128 << 10, EvictionPolicy::GroupLru, LookupMode::Memory);
        for i in 0..40_000u64 {
            idx.insert(&fp(i), Pba(i), &live).unwrap();
        }
        let s = idx.stats();
        assert!(s.groups_evicted > 0);
        assert!(s.eviction_reads <= s.groups_evicted && s.eviction_writes <= s.groups_evicted);
        let mut lru = index(128 << 10, EvictionPolicy::Lru, LookupMode::Memory);
        for i in 0..40_000u64 {
            lru.insert(&fp(i), Pba(i), &live).unwrap();
        }
        let l = lru.stats();
        assert!(
            l.eviction_writes > s.eviction_writes * 3,
            "per-entry eviction should cost more I/O: {l:?} vs {s:?}"
        );
    }

    #[test]
    fn rebuild_writes_a_complete_disk_store() {
        let live = |_: u64, _: Pba| true;
        let mut idx = index(8 << 10, EvictionPolicy::GroupLru, LookupMode::Disk);
        let all: Vec<_> = (0..3_000u64).map(|i| (fp(i), Pba(i))).collect();
        idx.rebuild(all).unwrap();
        assert!(idx.memory_bytes() <= 8 << 10);
        assert_eq!(idx.stats().entries_on_disk, 3_000);
        for i in 0..3_000u64 {
            assert_eq!(idx.lookup(&fp(i), &live).unwrap(), Some(Pba(i)));
        }
    }

    #[test]
    fn group_codec_detects_damage() {
        let e = vec![(5u64, 9u64), (7, 11)];
        let mut b = encode_group(3, &e, 1);
        assert_eq!(decode_group(&b, 3), Some(e));
        assert_eq!(decode_group(&b, 4), None);
        b[40] ^= 1;
        assert_eq!(decode_group(&b, 3), None);
    }
}
