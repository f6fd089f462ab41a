//! Out-of-line dedup (SmartDedup §3.3, HPDedup §III-C): find later the
//! duplicates inline dedup missed because their fingerprints were not in
//! memory, so dedup becomes exact while memory stays small.
//!
//! A pass drains the skipped buffer: for each (volume, LBA) it looks the
//! block's fingerprint up in memory *and* in the on-disk store; if another
//! live copy exists, the LBA is remapped to the lowest such PBA (the
//! canonical copy, so every path converges on the same one) and the copy's
//! reference is released. Copies that still have other references — and the
//! live duplicates the index itself drops when it merges groups — become
//! pending merges, applied by a scan of the volume maps once the buffer is
//! empty. Every change goes through the metadata lock and the journal, like
//! a write: the durability contract is unchanged, and a crash in the middle
//! of a pass leaves a consistent store (the remaining work is found again by
//! `dedupd dedup --offline`).
//!
//! The background worker runs passes at a bounded rate (blocks per second)
//! and backs off while foreground requests are arriving. So that sustained
//! load cannot starve it while the skipped buffer fills (and degrades to
//! coarser records), it keeps a minimum share under load once the buffer
//! is half full: one batch per ten periods, a tenth of its rate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::block::{Lba, Pba, VolumeId, BLOCK_SIZE};
use crate::engine::{lock, Engine};
use crate::error::{EngineError, Result};
use crate::fingerprint::Fingerprint;

/// Totals of the incremental out-of-line passes since the engine started
/// (the background worker's and a replay's; for `dedupd stats`), with
/// their CPU cost. [`Engine::dedup_offline`] reports its own figures and
/// is not counted here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct OutOfLineStats {
    /// Passes run.
    pub passes: u64,
    /// Block addresses examined.
    pub blocks_examined: u64,
    /// Blocks fingerprinted by the passes.
    pub blocks_hashed: u64,
    /// LBAs remapped onto another copy of their content.
    pub lbas_remapped: u64,
    /// Pending merges applied by map scans.
    pub merges_applied: u64,
    /// CPU time of the passes' threads, in seconds (user + system).
    pub cpu_seconds: f64,
    /// `cpu_seconds` per block examined, in microseconds (0 before any).
    pub cpu_us_per_block: f64,
}

impl OutOfLineStats {
    fn add(&mut self, r: &PassReport, cpu_seconds: f64) {
        self.passes += 1;
        self.blocks_examined += r.blocks_examined;
        self.blocks_hashed += r.blocks_hashed;
        self.lbas_remapped += r.lbas_remapped;
        self.merges_applied += r.merges_applied;
        self.cpu_seconds += cpu_seconds;
        self.cpu_us_per_block = if self.blocks_examined == 0 {
            0.0
        } else {
            self.cpu_seconds * 1e6 / self.blocks_examined as f64
        };
    }
}

/// CPU time of the calling thread in seconds (0 if unavailable).
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// What a pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PassReport {
    /// Block addresses examined.
    pub blocks_examined: u64,
    /// Blocks fingerprinted by the pass (stored without inline dedup).
    pub blocks_hashed: u64,
    /// LBAs remapped onto another copy of their content.
    pub lbas_remapped: u64,
    /// Pending merges applied by a map scan.
    pub merges_applied: u64,
    /// True if work remains (skipped records or pending merges).
    pub work_remaining: bool,
}

/// LBAs scanned under one hold of the metadata lock.
const SCAN_CHUNK: u64 = 1024;

impl Engine {
    /// True if out-of-line work is pending.
    pub fn dedup_pending(&self) -> bool {
        let mut m = lock(&self.meta);
        m.collect_displaced();
        !m.skipped.is_empty() || !m.pending_merges.is_empty()
    }

    /// True if the skipped buffer is at least half full or has degraded to
    /// regions or volumes: the worker then keeps a minimum share under load.
    pub fn dedup_pressure(&self) -> bool {
        let s = lock(&self.meta).skipped.stats();
        s.used_bytes * 2 >= s.capacity_bytes || s.regions > 0 || s.volumes > 0
    }

    /// One out-of-line pass over at most `max_blocks` skipped records; when
    /// the buffer is empty, applies the pending merges with a map scan.
    ///
    /// Errors: I/O errors reading the on-disk fingerprint store.
    pub fn dedup_pass(&self, max_blocks: usize) -> Result<PassReport> {
        self.dedup_pass_yielding(max_blocks, &|| false)
    }

    /// [`Engine::dedup_pass`] that stops a merge scan early (leaving the
    /// merges pending) as soon as `should_yield` returns true.
    pub fn dedup_pass_yielding(
        &self,
        max_blocks: usize,
        should_yield: &dyn Fn() -> bool,
    ) -> Result<PassReport> {
        // nothing to do on a store that stopped committing
        crate::engine::fault_check(&lock(&self.meta))?;
        let cpu_before = thread_cpu_seconds();
        let r = self.pass(max_blocks, should_yield)?;
        let cpu = (thread_cpu_seconds() - cpu_before).max(0.0);
        lock(&self.out_of_line).add(&r, cpu);
        Ok(r)
    }

    /// The totals of the passes run so far.
    pub fn out_of_line_stats(&self) -> OutOfLineStats {
        *lock(&self.out_of_line)
    }

    fn pass(&self, max_blocks: usize, should_yield: &dyn Fn() -> bool) -> Result<PassReport> {
        let mut r = PassReport::default();
        // volumes with a sequence threshold T > 1 are left to the explicit
        // full pass: their records cannot tell the copies the threshold
        // stored apart on purpose from other blocks (journal replay and a
        // degraded buffer queue whole regions), so they are taken and
        // dropped
        let (items, sizes) = {
            let mut m = lock(&self.meta);
            let default_t = self.config.sequence_threshold_blocks;
            let sizes: HashMap<VolumeId, u64> = m
                .volumes
                .iter()
                .filter(|(_, v)| v.record.sequence_threshold_blocks.unwrap_or(default_t) <= 1)
                .map(|(id, v)| (*id, v.size_blocks()))
                .collect();
            (
                m.skipped.take(max_blocks, |v| sizes.get(&v).copied()),
                sizes,
            )
        };
        for chunk in items.chunks(64) {
            let mut m = lock(&self.meta);
            m.collect_displaced();
            for &(vol, lba) in chunk {
                if !sizes.contains_key(&vol) {
                    continue;
                }
                r.blocks_examined += 1;
                let Some(p) = m.volumes.get(&vol).and_then(|v| v.get(Lba(lba))) else {
                    continue;
                };
                let mut fp = m.fingerprint_of(p);
                if fp == crate::engine::UNHASHED {
                    // stored without inline dedup (selectivity): hash it now
                    let mut block = vec![0u8; BLOCK_SIZE];
                    self.backend
                        .read_blocks(p, &mut block)
                        .map_err(|e| EngineError::io(format!("reading PBA {}", p.0), e))?;
                    fp = self.hash.fingerprint(&block);
                    m.record_unindexed(p, fp);
                    r.blocks_hashed += 1;
                }
                let mut candidates = m
                    .lookup_all(&fp)
                    .map_err(|e| EngineError::io("reading the fingerprint store", e))?;
                // (a copy with the most references a count holds takes no more)
                candidates.retain(|c| m.shareable(c.0));
                if self.config.verify {
                    // only copies with the same bytes are merged
                    candidates = self.same_bytes(&mut m, p, candidates)?;
                }
                let canonical = candidates.iter().copied().chain([p]).min().unwrap_or(p);
                if canonical != p {
                    m.remap(vol, Lba(lba), Some(canonical));
                    m.counters.out_of_line_duplicates += 1;
                    r.lbas_remapped += 1;
                }
                for c in candidates.iter().copied().chain([p]) {
                    if c != canonical
                        && m.refcounts.get_u32(c.0) > 0
                        && m.pending_merges.len() < crate::meta::MAX_PENDING_MERGES
                    {
                        m.pending_merges.insert(c.0, canonical.0);
                    }
                }
                if candidates.len() != 1 || candidates[0] != canonical {
                    m.index_insert(fp, canonical)
                        .map_err(|e| EngineError::io("writing the fingerprint store", e))?;
                }
            }
            m.collect_displaced();
            self.note_change(&m);
        }
        let buffer_empty = lock(&self.meta).skipped.is_empty();
        if buffer_empty {
            r.merges_applied = self.apply_merges(None, true, should_yield)?;
        }
        let mut m = lock(&self.meta);
        m.collect_displaced();
        r.work_remaining = !m.skipped.is_empty() || !m.pending_merges.is_empty();
        Ok(r)
    }

    /// The `candidates` (other than `p` itself) whose bytes equal `p`'s
    /// (`verify`); each that differs is counted as a verify mismatch.
    /// Called under the metadata lock, so no block is released meanwhile.
    ///
    /// Errors: reading `p`. (A candidate that cannot be read is left out.)
    fn same_bytes(
        &self,
        m: &mut crate::meta::Meta,
        p: Pba,
        candidates: Vec<Pba>,
    ) -> Result<Vec<Pba>> {
        let (mut mine, mut other) = (vec![0u8; BLOCK_SIZE], vec![0u8; BLOCK_SIZE]);
        self.backend
            .read_blocks(p, &mut mine)
            .map_err(|e| EngineError::io(format!("reading PBA {}", p.0), e))?;
        Ok(candidates
            .into_iter()
            .filter(|&c| {
                let same =
                    c == p || (self.backend.read_blocks(c, &mut other).is_ok() && other == mine);
                if !same {
                    m.counters.verify_mismatches += 1;
                }
                same
            })
            .collect())
    }

    /// Remaps every LBA (of `only`, or of all volumes) mapped to a pending
    /// merge's copy onto the kept PBA, scanning the maps in chunks. With
    /// `keep_sequences` (the background pass), volumes with a sequence
    /// threshold T > 1 are left as they are: their copies were stored
    /// apart on purpose (iDedup; SmartDedup §4.5), and only the explicit
    /// full pass merges them.
    fn apply_merges(
        &self,
        only: Option<VolumeId>,
        keep_sequences: bool,
        should_yield: &dyn Fn() -> bool,
    ) -> Result<u64> {
        let merges: HashMap<u64, u64> = {
            let m = lock(&self.meta);
            if m.pending_merges.is_empty() {
                return Ok(0);
            }
            m.pending_merges.iter().map(|(a, b)| (*a, *b)).collect()
        };
        let resolve = |mut p: u64| {
            let mut hops = 0;
            while let Some(&q) = merges.get(&p) {
                p = q;
                hops += 1;
                if hops > 64 {
                    break;
                }
            }
            p
        };
        // `verify`: a copy is merged only onto a block with the same bytes
        // (a fingerprint collision, or a copy stored apart because its
        // bytes differed, stays apart); read under the metadata lock, so
        // neither block is released meanwhile
        let mut differ = std::collections::HashSet::new();
        if self.config.verify {
            for &p in merges.keys() {
                let target = Pba(resolve(p));
                let mut m = lock(&self.meta);
                // (an unreadable copy is not merged either)
                let same = self
                    .same_bytes(&mut m, Pba(p), vec![target])
                    .is_ok_and(|kept| !kept.is_empty());
                if !same {
                    differ.insert(p);
                }
            }
        }
        let volumes: Vec<VolumeId> = {
            let m = lock(&self.meta);
            let default_t = self.config.sequence_threshold_blocks;
            m.volumes
                .iter()
                .filter(|(id, v)| {
                    only.is_none_or(|o| o == **id)
                        && !(keep_sequences
                            && v.record.sequence_threshold_blocks.unwrap_or(default_t) > 1)
                })
                .map(|(id, _)| *id)
                .collect()
        };
        // scan only allocated map pages (a 1 PiB replay volume is sparse)
        let per_page = crate::paged::U64_PER_PAGE;
        let pages_per_hold = SCAN_CHUNK.div_ceil(per_page);
        let mut applied = 0;
        for vol in volumes {
            let mut page = 0;
            loop {
                if should_yield() {
                    return Ok(applied); // the merges stay pending
                }
                let mut m = lock(&self.meta);
                let Some(pages) = m.volumes.get(&vol).map(|v| v.map.page_count()) else {
                    break;
                };
                if page >= pages {
                    break;
                }
                let end_page = (page + pages_per_hold).min(pages);
                for pg in page..end_page {
                    if m.volumes[&vol].map.page_is_hole(pg) {
                        continue;
                    }
                    for l in pg * per_page..(pg + 1) * per_page {
                        let Some(p) = m.volumes.get(&vol).and_then(|v| v.get(Lba(l))) else {
                            continue;
                        };
                        if !merges.contains_key(&p.0) || differ.contains(&p.0) {
                            continue;
                        }
                        let target = Pba(resolve(p.0));
                        // merge only onto a live copy of the same content
                        // (a block stored unhashed since the merge was
                        // planned has no fingerprint to compare)
                        let fp = m.fingerprint_of(p);
                        if target != p
                            && fp != crate::engine::UNHASHED
                            && m.shareable(target.0)
                            && m.fingerprint_of(target) == fp
                        {
                            m.remap(vol, Lba(l), Some(target));
                            m.counters.out_of_line_duplicates += 1;
                            applied += 1;
                        }
                    }
                }
                self.note_change(&m);
                drop(m);
                page = end_page;
            }
        }
        let mut m = lock(&self.meta);
        for p in merges.keys() {
            m.pending_merges.remove(p);
        }
        Ok(applied)
    }

    /// The full post-processing pass (the baseline HPDedup compares
    /// against): every referenced block's fingerprint is compared with
    /// every other's, and every LBA (of `volume`, or of all volumes) is
    /// remapped onto the lowest PBA holding its content. Exact whatever the
    /// index budget. The (fingerprint key, PBA) pairs are sorted through a
    /// scratch file in the store ([`crate::keysort`]), so memory stays
    /// about the index budget plus one pending merge per duplicate copy
    /// found. `progress` receives (PBAs examined, PBAs in all) during the
    /// scan.
    ///
    /// Errors: [`EngineError::NoSuchVolume`]; reading blocks or the scratch
    /// file; the commits of the remapping.
    pub fn dedup_offline(
        &self,
        volume: Option<&str>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<PassReport> {
        let only = match volume {
            Some(name) => Some(
                self.volume(name)
                    .ok_or_else(|| EngineError::NoSuchVolume(name.into()))?
                    .0,
            ),
            None => None,
        };
        let mut r = PassReport::default();
        let (high, budget_bytes) = {
            let m = lock(&self.meta);
            (m.high_water_blocks, m.index.config().memory_budget_bytes)
        };
        let mut sorter = crate::keysort::KeySorter::new(
            high,
            budget_bytes,
            16,
            self.dir.as_ref().and_then(|d| d.scratch_file()),
        );
        let mut p = 0;
        while p < high {
            let end = (p + SCAN_CHUNK).min(high);
            let mut m = lock(&self.meta);
            for q in p..end {
                if m.refcounts.get_u32(q) == 0 {
                    continue;
                }
                r.blocks_examined += 1;
                let mut fp = m.fingerprint_of(Pba(q));
                if fp == crate::engine::UNHASHED {
                    let mut block = vec![0u8; crate::block::BLOCK_SIZE];
                    self.backend
                        .read_blocks(Pba(q), &mut block)
                        .map_err(|e| EngineError::io(format!("reading PBA {q}"), e))?;
                    fp = self.hash.fingerprint(&block);
                    m.record_unindexed(Pba(q), fp);
                    r.blocks_hashed += 1;
                }
                sorter.push(crate::index::key_of(&fp), q);
            }
            drop(m);
            progress(end, high);
            p = end;
        }
        // equal keys are candidates: their full fingerprints, read again
        // now (blocks may have been released since the scan), decide; each
        // copy merges onto the lowest PBA with the same content
        let merged = sorter.for_each_sorted::<std::io::Error>(|pairs| {
            crate::keysort::for_each_equal_key_run(pairs, |run| {
                let mut m = lock(&self.meta);
                // (a PBA freed and reused since the scan may hold a block
                // stored unhashed: no fingerprint, never merged)
                let mut run: Vec<(Fingerprint, u64)> = run
                    .iter()
                    .filter(|&&(_, q)| m.refcounts.get_u32(q) > 0)
                    .map(|&(_, q)| (m.fingerprint_of(Pba(q)), q))
                    .filter(|(fp, _)| *fp != crate::engine::UNHASHED)
                    .collect();
                run.sort_unstable();
                // the first (lowest PBA) of each run of equal fingerprints
                // is kept
                let mut kept: Option<(Fingerprint, u64)> = None;
                for (fp, q) in run {
                    match kept {
                        Some((f, k)) if f == fp => {
                            m.pending_merges.insert(q, k);
                        }
                        _ => kept = Some((fp, q)),
                    }
                }
            });
            Ok(())
        });
        merged.map_err(|e| EngineError::io("reading the scratch file back", e))?;
        r.lbas_remapped = self.apply_merges(only, false, &|| false)?;
        r.merges_applied = r.lbas_remapped;
        let m = lock(&self.meta);
        r.work_remaining = !m.skipped.is_empty();
        Ok(r)
    }

    /// Starts the background out-of-line worker: passes of up to 64 blocks
    /// at most `rate_blocks_per_s` blocks per second, pausing while
    /// foreground requests arrive — except for one batch per ten periods
    /// while [`Engine::dedup_pressure`] holds. Stops when the handle is
    /// dropped.
    pub fn start_out_of_line(self: &Arc<Self>, rate_blocks_per_s: u64) -> WorkerHandle {
        let stop = Arc::new(AtomicBool::new(false));
        let engine = self.clone();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("dedupd-out-of-line".into())
            .spawn(move || {
                let batch = 64u64;
                let period =
                    Duration::from_secs_f64(batch as f64 / rate_blocks_per_s.max(1) as f64);
                let mut last_foreground = engine.foreground_ops();
                let mut last_pass = Instant::now();
                // a lasting error (full disk, a metadata fault) is reported
                // once, not at every period
                let mut last_error = String::new();
                let mut report = |r: Result<PassReport>| match r {
                    Ok(_) => last_error.clear(),
                    Err(e) => {
                        let msg = e.to_string();
                        if msg != last_error {
                            eprintln!("dedupd: out-of-line dedup: {msg}");
                            last_error = msg;
                        }
                    }
                };
                while !flag.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let now_foreground = engine.foreground_ops();
                    let busy = now_foreground != last_foreground;
                    last_foreground = now_foreground;
                    if busy && last_pass.elapsed() >= period * 10 && engine.dedup_pressure() {
                        // the minimum share: one batch, not yielding
                        last_pass = Instant::now();
                        report(engine.dedup_pass(batch as usize));
                    } else if !busy && engine.dedup_pending() {
                        last_pass = Instant::now();
                        let seen = engine.foreground_ops();
                        let yield_now = || engine.foreground_ops() != seen;
                        report(engine.dedup_pass_yielding(batch as usize, &yield_now));
                    }
                    let wait = if busy {
                        period.max(Duration::from_millis(20))
                    } else {
                        period
                    };
                    let elapsed = started.elapsed();
                    let mut left = wait.saturating_sub(elapsed).max(Duration::from_millis(1));
                    while left > Duration::ZERO && !flag.load(Ordering::Relaxed) {
                        let step = left.min(Duration::from_millis(50));
                        std::thread::sleep(step);
                        left = left.saturating_sub(step);
                    }
                }
            })
            .expect("spawning the out-of-line worker");
        WorkerHandle {
            stop,
            thread: Some(thread),
        }
    }
}

/// The running background worker; dropping it stops the worker and waits.
pub struct WorkerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Stops the worker and waits for its current pass to finish.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use crate::block::{Lba, BLOCK_SIZE};
    use crate::engine::{lock, UNHASHED};
    use crate::{Engine, EngineConfig, HashAlgorithm};

    #[test]
    fn a_planned_merge_never_joins_blocks_stored_unhashed() {
        // CAFTL pre-hashing stores content seen for the first time unhashed
        let cfg = EngineConfig {
            prehash_bytes: 4096,
            ..EngineConfig::default()
        };
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[1u8; BLOCK_SIZE], false).unwrap();
        e.write(v, 4096, &[2u8; BLOCK_SIZE], false).unwrap();
        let (a, b) = {
            let m = lock(&e.meta);
            let map = &m.volumes[&v];
            let (a, b) = (map.get(Lba(0)).unwrap(), map.get(Lba(1)).unwrap());
            assert_eq!(m.fingerprint_of(a), UNHASHED);
            assert_eq!(m.fingerprint_of(b), UNHASHED);
            (a, b)
        };
        // a merge planned while these PBAs held one content, both since
        // freed and reused for these blocks
        lock(&e.meta).pending_merges.insert(b.0, a.0);
        assert_eq!(e.apply_merges(None, false, &|| false).unwrap(), 0);
        let mut got = vec![0u8; BLOCK_SIZE];
        e.read(v, 4096, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 2), "LBA 1 reads another block");
        assert!(e.check().is_empty());
    }

    #[test]
    fn a_block_with_the_most_references_a_count_holds_is_not_shared_further() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        let block = [7u8; BLOCK_SIZE];
        e.write(v, 0, &block, false).unwrap();
        let pba = |e: &Engine, lba: u64| lock(&e.meta).volumes[&v].get(Lba(lba)).unwrap();
        let a = pba(&e, 0);
        // as if u32::MAX − 2 other LBAs mapped it: one more may share it
        lock(&e.meta).refcounts.set_u32(a.0, u32::MAX - 1);
        e.write(v, 4096, &block, false).unwrap();
        assert_eq!(pba(&e, 1), a);
        assert_eq!(lock(&e.meta).refcounts.get_u32(a.0), u32::MAX);
        // the next copy is stored apart, inline and after out-of-line
        // passes, instead of wrapping the count to 0
        e.write(v, 2 * 4096, &block, false).unwrap();
        let b = pba(&e, 2);
        assert_ne!(b, a);
        e.dedup_pass(1 << 20).unwrap();
        e.dedup_offline(None, &mut |_, _| {}).unwrap();
        assert_eq!(pba(&e, 2), b);
        assert_eq!(lock(&e.meta).refcounts.get_u32(a.0), u32::MAX);
        let mut got = vec![0u8; BLOCK_SIZE];
        e.read(v, 2 * 4096, &mut got).unwrap();
        assert!(got == block);
        // (back to its true count for the invariant check)
        lock(&e.meta).refcounts.set_u32(a.0, 2);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}
