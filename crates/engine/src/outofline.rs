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
//! empty. A copy that cannot be remembered, the pending merges (or the
//! index's list of dropped copies) being at their bound, queues every
//! volume whole in the skipped buffer (a degradation, counted as the
//! buffer's own): the pass then examines each mapped LBA against every
//! copy of its content, so nothing is forgotten. Every change goes through the metadata lock and the journal, like
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
    /// Stored blocks without a fingerprint that could not be read (an I/O
    /// error of the data file): left as they are, unmerged (`dedupd fsck
    /// --rehash` names them). Only the offline pass counts them; it goes
    /// on past them.
    pub blocks_unreadable: u64,
    /// True if work remains (skipped records or pending merges).
    pub work_remaining: bool,
    /// A full offline pass stopped early by [`Engine::stop_offline_passes`]
    /// (the merges it had planned are applied; the copies it had not
    /// reached stay until the next pass).
    pub interrupted: bool,
}

/// [`crate::meta::Meta::index_if_absent`] for a pass, with the copies the
/// insert displaced from the index collected at once
/// ([`crate::meta::Meta::collect_displaced`], otherwise done by the next
/// commit): returns the work that added to the skipped buffer (copies
/// that could not all be remembered), which the pass itself examines.
fn index_if_absent_counted(m: &mut crate::meta::Meta, p: Pba, fp: Fingerprint) -> u64 {
    let before = m.skipped.additions();
    m.index_if_absent(p, fp);
    m.collect_displaced();
    m.skipped.additions() - before
}

/// LBAs scanned under one hold of the metadata lock.
const SCAN_CHUNK: u64 = 1024;

/// Skipped records examined under one hold of the metadata lock.
const PASS_CHUNK: usize = 64;

/// Room left in the pending merges before a record is examined (the
/// merges one record plans: its copies); with less, the pass stops and
/// applies them first, the records left going back to the buffer.
const MERGE_HEADROOM: usize = 64;

/// A scan of the volume maps applying merges (copy PBA → kept PBA), which
/// can stop and resume ([`Engine::apply_pending_merges`]).
#[derive(Debug, Default)]
pub(crate) struct MergeScan {
    merges: HashMap<u64, u64>,
    /// Work the scan itself added to the skipped buffer (its index
    /// inserts may displace copies that cannot all be remembered: see
    /// [`crate::meta::Meta::merges_dropped`]), in
    /// [`crate::skipped::SkippedBuffer::additions`].
    own_additions: u64,
    /// Copies whose bytes are still to be compared with their kept PBA's
    /// (`verify`), those found to differ (never merged), and the
    /// [`crate::meta::Meta::reuse_epoch`] at which each of the others was
    /// found the same: a comparison holds only while no freed block was
    /// reused (the copy could since hold new content with the same
    /// fingerprint), so a later epoch compares again before remapping.
    to_verify: Vec<u64>,
    differ: std::collections::HashSet<u64>,
    same_at: HashMap<u64, u64>,
    /// Volumes to scan, and where the scan is: `volumes[volume]`, map page
    /// `page`.
    volumes: Vec<VolumeId>,
    volume: usize,
    page: u64,
    /// What the scan covers (see [`Engine::volumes_to_merge`]).
    only: Option<VolumeId>,
    keep_sequences: bool,
}

/// Bytes a planned merge costs in memory (an entry of a hash map of two
/// u64s, and the resolve and verify sets and map), for the offline pass's
/// batches.
const MERGE_BYTES: u64 = 64;

/// Why examining a skipped record failed, which decides whether the
/// record is kept for a later pass.
#[derive(Debug)]
enum ExamineError {
    /// Reading the block itself: the record is dropped (left to `dedupd
    /// dedup --offline`).
    Block(EngineError),
    /// Reading or writing the fingerprint store: the record is kept
    /// (unless it was the first of its pass).
    Index(EngineError),
    /// The in-memory metadata cannot be trusted any more (a page could
    /// not be read back or written: [`crate::engine::fault_check`]): the
    /// record and those after it are kept, nothing more is examined.
    Fault(EngineError),
}

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
            // (unmapped ranges of a whole volume are passed over: only
            // allocated map pages can hold mapped LBAs)
            let crate::meta::Meta {
                skipped, volumes, ..
            } = &mut *m;
            let per_page = crate::paged::U64_PER_PAGE;
            let first_mapped = |v: VolumeId, start: u64, end: u64| {
                volumes.get(&v).and_then(|vol| {
                    vol.map
                        .next_present_page(start / per_page, (end - 1) / per_page + 1)
                        .map(|page| (page * per_page).max(start))
                })
            };
            let items = skipped.take(max_blocks, |v| sizes.get(&v).copied(), first_mapped);
            // (until examined, they are saved with the buffer by any
            // checkpoint that runs meanwhile)
            m.skipped_in_flight.clone_from(&items);
            (items, sizes)
        };
        // records not examined go back to the buffer (those of volumes
        // the pass leaves alone are dropped, as taking them did)
        let give_back = |from: usize| {
            let mut m = lock(&self.meta);
            m.skipped_in_flight.clear();
            for &(vol, lba) in &items[from..] {
                if sizes.contains_key(&vol) {
                    m.skipped.record(vol, lba);
                }
            }
        };
        for (k, chunk) in items.chunks(PASS_CHUNK).enumerate() {
            let stopped = match self.pass_chunk(chunk, &sizes, &mut r) {
                Ok(stopped) => stopped,
                Err((i, e)) => {
                    // a record whose own block could not be read is
                    // dropped (left to `dedupd dedup --offline`: retrying
                    // it at every pass would stall the buffer behind it);
                    // one that met the fingerprint store is kept, unless
                    // it was the pass's first: every pass then does or
                    // drops at least one record, so records that keep
                    // failing cannot hold the buffer, and the merges
                    // waiting for it to empty, for ever
                    let failed = k * PASS_CHUNK + i;
                    let (rest, e) = match e {
                        ExamineError::Fault(e) => (failed, e),
                        ExamineError::Index(e) if failed > 0 => (failed, e),
                        ExamineError::Block(e) | ExamineError::Index(e) => (failed + 1, e),
                    };
                    give_back(rest);
                    return Err(e);
                }
            };
            // the pending merges near their bound: the records left wait
            // for them to be applied below
            if let Some(i) = stopped {
                give_back(k * PASS_CHUNK + i);
            }
            // (a commit between chunks when the pass's changes pass the
            // bounds on uncommitted metadata and pending frees)
            if let Err(e) = self.after_write(false) {
                if stopped.is_none() {
                    give_back(((k + 1) * PASS_CHUNK).min(items.len()));
                }
                return Err(e);
            }
            if stopped.is_some() {
                break;
            }
        }
        // the merges wait for the buffer to empty (one scan of the maps
        // applies many), unless they pass half their bound or a scan has
        // begun: steady writes that keep the buffer from emptying must not
        // hold them (and, at the bound, the copies planned after them) off
        let merges_due = {
            let m = lock(&self.meta);
            m.skipped.is_empty() || m.pending_merges.len() >= crate::meta::MAX_PENDING_MERGES / 2
        } || lock(&self.merge_scan).is_some();
        if merges_due {
            r.merges_applied = self.apply_pending_merges(should_yield)?;
        }
        let mut m = lock(&self.meta);
        m.skipped_in_flight.clear();
        m.collect_displaced();
        r.work_remaining = !m.skipped.is_empty() || !m.pending_merges.is_empty();
        Ok(r)
    }

    /// Examines one chunk of skipped records under one hold of the
    /// metadata lock. Returns `Some(i)` if it stopped before record `i`
    /// because the pending merges are near their bound (the rest wait for
    /// them to be applied). On an error, returns it with the position in
    /// `chunk` of the record that met it (those before it are done).
    fn pass_chunk(
        &self,
        chunk: &[(VolumeId, u64)],
        sizes: &HashMap<VolumeId, u64>,
        r: &mut PassReport,
    ) -> std::result::Result<Option<usize>, (usize, ExamineError)> {
        let hashed = self.hash_unhashed(chunk, sizes);
        let mut m = lock(&self.meta);
        m.collect_displaced();
        let mut result = Ok(None);
        let mut examined = chunk.len();
        for (i, &(vol, lba)) in chunk.iter().enumerate() {
            // (a fault met by an earlier record, or by a request, leaves
            // stale fingerprints a lookup could trust)
            if let Err(e) = crate::engine::fault_check(&m) {
                result = Err((i, ExamineError::Fault(e)));
                examined = i;
                break;
            }
            if m.pending_merges.len() + MERGE_HEADROOM > crate::meta::MAX_PENDING_MERGES {
                result = Ok(Some(i));
                examined = i;
                break;
            }
            if let Err(e) = self.examine(&mut m, vol, lba, sizes, r, hashed[i]) {
                result = Err((i, e));
                examined = i;
                break;
            }
        }
        let examined = examined.min(m.skipped_in_flight.len());
        m.skipped_in_flight.drain(..examined);
        m.collect_displaced();
        self.note_change(&m);
        result
    }

    /// The blocks of `chunk`'s records stored unhashed, read and hashed
    /// without the metadata lock (foreground requests do not wait on these
    /// reads): per record, (its PBA, the reuse epoch when it was looked
    /// up, its fingerprint), or `None` (hashed, unmapped, unreadable: left
    /// to [`Engine::examine`]). Mapped blocks are never written in place,
    /// and a freed one becomes reusable only with the epoch's increment,
    /// so a fingerprint is used only while the epoch is unchanged (no
    /// guard is held: a commit making frees reusable meanwhile does not
    /// wait on these reads, and the block is read again under the lock).
    fn hash_unhashed(
        &self,
        chunk: &[(VolumeId, u64)],
        sizes: &HashMap<VolumeId, u64>,
    ) -> Vec<Option<(Pba, u64, crate::fingerprint::Fingerprint)>> {
        let (wanted, epoch): (Vec<Option<Pba>>, u64) = {
            let m = lock(&self.meta);
            let wanted = chunk
                .iter()
                .map(|&(vol, lba)| {
                    sizes.contains_key(&vol).then_some(())?;
                    let p = m.volumes.get(&vol)?.get(Lba(lba))?;
                    (m.fingerprint_of(p) == crate::engine::UNHASHED).then_some(p)
                })
                .collect();
            (wanted, m.reuse_epoch)
        };
        if wanted.iter().all(Option::is_none) {
            return vec![None; chunk.len()];
        }
        let mut block = vec![0u8; BLOCK_SIZE];
        wanted
            .into_iter()
            .map(|p| {
                let p = p?;
                self.backend.read_blocks(p, &mut block).ok()?;
                Some((p, epoch, self.hash.fingerprint(&block)))
            })
            .collect()
    }

    /// Examines the skipped record (`vol`, `lba`): the LBA is remapped onto
    /// the lowest live copy of its content, and the other copies become
    /// pending merges. A volume not in `sizes` (deleted, or with a sequence
    /// threshold T > 1) is passed over.
    ///
    /// Errors: reading the block ([`ExamineError::Block`]) or the on-disk
    /// fingerprint store ([`ExamineError::Index`]).
    fn examine(
        &self,
        m: &mut crate::meta::Meta,
        vol: VolumeId,
        lba: u64,
        sizes: &HashMap<VolumeId, u64>,
        r: &mut PassReport,
        hashed: Option<(Pba, u64, crate::fingerprint::Fingerprint)>,
    ) -> std::result::Result<(), ExamineError> {
        let default_t = self.config.sequence_threshold_blocks;
        // (a volume whose threshold was raised since the records were
        // taken is left as it is now, as the merge scan leaves it)
        let threshold_one = m
            .volumes
            .get(&vol)
            .is_some_and(|v| v.record.sequence_threshold_blocks.unwrap_or(default_t) <= 1);
        if !sizes.contains_key(&vol) || !threshold_one {
            return Ok(());
        }
        r.blocks_examined += 1;
        let Some(p) = m.volumes.get(&vol).and_then(|v| v.get(Lba(lba))) else {
            return Ok(());
        };
        let mut fp = m.fingerprint_of(p);
        if fp == crate::engine::UNHASHED {
            if let Some((_, _, f)) =
                hashed.filter(|&(hp, epoch, _)| hp == p && epoch == m.reuse_epoch)
            {
                // hashed just before, outside the lock
                fp = f;
                m.record_unindexed(p, fp);
                r.blocks_hashed += 1;
            }
        }
        if fp == crate::engine::UNHASHED {
            // stored without inline dedup (selectivity): hash it now
            let mut block = vec![0u8; BLOCK_SIZE];
            self.backend.read_blocks(p, &mut block).map_err(|e| {
                ExamineError::Block(EngineError::io(format!("reading PBA {}", p.0), e))
            })?;
            fp = self.hash.fingerprint(&block);
            m.record_unindexed(p, fp);
            r.blocks_hashed += 1;
        }
        let mut candidates = m.lookup_all(&fp).map_err(|e| {
            ExamineError::Index(EngineError::io("reading the fingerprint store", e))
        })?;
        // (a copy with the most references a count holds takes no more)
        candidates.retain(|c| m.shareable(c.0));
        if self.config.verify {
            // only copies with the same bytes are merged
            candidates = self
                .same_bytes(m, p, candidates)
                .map_err(ExamineError::Block)?;
        }
        let canonical = candidates.iter().copied().chain([p]).min().unwrap_or(p);
        if canonical != p {
            m.remap(vol, Lba(lba), Some(canonical));
            if m.refcounts.get_u32(p.0) == 0 {
                // the copy is gone: one write inline dedup missed (LBAs
                // sharing it were inline hits, counted as such)
                m.counters.out_of_line_duplicates += 1;
            }
            r.lbas_remapped += 1;
        }
        let mut dropped = false;
        for c in candidates.iter().copied().chain([p]) {
            if c != canonical && m.refcounts.get_u32(c.0) > 0 {
                if m.pending_merges.len() < crate::meta::MAX_PENDING_MERGES {
                    m.pending_merges.insert(c.0, canonical.0);
                } else {
                    dropped = true;
                }
            }
        }
        if dropped {
            m.merges_dropped();
        }
        if candidates.len() != 1 || candidates[0] != canonical {
            m.index_insert(fp, canonical).map_err(|e| {
                ExamineError::Index(EngineError::io("writing the fingerprint store", e))
            })?;
        }
        Ok(())
    }

    /// The `candidates` (other than `p` itself) whose bytes equal `p`'s
    /// (`verify`); each that differs is counted as a verify mismatch (a
    /// comparison: a pair compared again, by a later pass or by the write
    /// that stored it apart, counts again). Called under the metadata
    /// lock, so no block is released meanwhile.
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
                if c == p {
                    return true;
                }
                // (a block that cannot be read is not shared either, but
                // is no mismatch: its bytes are not known to differ)
                let readable = self.backend.read_blocks(c, &mut other).is_ok();
                if readable && other != mine {
                    m.counters.verify_mismatches += 1;
                }
                readable && other == mine
            })
            .collect())
    }

    /// Applies the pending merges (the background pass's), leaving volumes
    /// with a sequence threshold T > 1 as they are. A scan that yields to
    /// foreground traffic resumes where it stopped at the next call, over
    /// the merges it started with (merges planned meanwhile wait for the
    /// next scan), so steady light traffic cannot keep restarting it; the
    /// merges of a finished scan leave `pending_merges`. Returns the LBAs
    /// remapped.
    fn apply_pending_merges(&self, should_yield: &dyn Fn() -> bool) -> Result<u64> {
        let mut slot = lock(&self.merge_scan);
        let mut scan = match slot.take() {
            Some(scan) => scan,
            None => {
                let m = lock(&self.meta);
                if m.pending_merges.is_empty() {
                    return Ok(0);
                }
                let merges = m.pending_merges.iter().map(|(a, b)| (*a, *b)).collect();
                drop(m);
                self.merge_scan_of(merges, None, true)
            }
        };
        self.merge_scan_bytes
            .store(scan.merges.len() as u64 * MERGE_BYTES, Ordering::Relaxed);
        let (applied, finished) = match self.run_merge_scan(&mut scan, should_yield) {
            Ok(r) => r,
            Err(e) => {
                // (the merges stay pending; the next pass scans anew)
                self.merge_scan_bytes.store(0, Ordering::Relaxed);
                return Err(e);
            }
        };
        if finished {
            self.merge_scan_bytes.store(0, Ordering::Relaxed);
            let mut m = lock(&self.meta);
            for (p, kept) in &scan.merges {
                // (one planned again meanwhile, onto another copy, stays)
                if m.pending_merges.get(p) == Some(kept) {
                    m.pending_merges.remove(p);
                }
            }
        } else {
            *slot = Some(scan);
        }
        Ok(applied)
    }

    /// Applies `merges` (copy PBA → kept PBA) to every LBA of `only`, or of
    /// all volumes, at once (the offline pass). Returns the LBAs remapped,
    /// and the work the scan itself added to the skipped buffer
    /// ([`MergeScan::own_additions`]).
    fn apply_merges(
        &self,
        merges: HashMap<u64, u64>,
        only: Option<VolumeId>,
    ) -> Result<(u64, u64)> {
        let mut scan = self.merge_scan_of(merges, only, false);
        let applied = self.run_merge_scan(&mut scan, &|| false)?.0;
        Ok((applied, scan.own_additions))
    }

    /// A scan applying `merges` to the volumes of `only` (or all); with
    /// `keep_sequences` (the background pass), volumes with a sequence
    /// threshold T > 1 are left as they are: their copies were stored apart
    /// on purpose (iDedup; SmartDedup §4.5), and only the explicit full
    /// pass merges them.
    fn merge_scan_of(
        &self,
        merges: HashMap<u64, u64>,
        only: Option<VolumeId>,
        keep_sequences: bool,
    ) -> MergeScan {
        let volumes = self.volumes_to_merge(only, keep_sequences);
        let to_verify = if self.config.verify {
            merges.keys().copied().collect()
        } else {
            Vec::new()
        };
        MergeScan {
            merges,
            own_additions: 0,
            to_verify,
            differ: Default::default(),
            same_at: HashMap::new(),
            volumes,
            volume: 0,
            page: 0,
            only,
            keep_sequences,
        }
    }

    /// The volumes a merge scan covers: `only` (or all), without those
    /// with a sequence threshold T > 1 if `keep_sequences`.
    fn volumes_to_merge(&self, only: Option<VolumeId>, keep_sequences: bool) -> Vec<VolumeId> {
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
    }

    /// Runs `scan` on from where it stopped, remapping every LBA mapped to
    /// one of its copies onto the kept PBA, in chunks of map pages under
    /// the metadata lock (only allocated pages: a 1 PiB replay volume is
    /// sparse). Returns the LBAs remapped and whether it finished (false:
    /// `should_yield` stopped it; calling again resumes).
    fn run_merge_scan(
        &self,
        scan: &mut MergeScan,
        should_yield: &dyn Fn() -> bool,
    ) -> Result<(u64, bool)> {
        if scan.merges.is_empty() {
            return Ok((0, true));
        }
        let merges = &scan.merges;
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
        while let Some(&p) = scan.to_verify.last() {
            if should_yield() {
                return Ok((0, false)); // (two block reads per merge)
            }
            let target = Pba(resolve(p));
            let mut m = lock(&self.meta);
            let fp = m.fingerprint_of(Pba(p));
            if m.refcounts.get_u32(p) == 0
                || !m.shareable(target.0)
                || fp == crate::engine::UNHASHED
                || m.fingerprint_of(target) != fp
            {
                // a copy (or target) freed since the merge was planned, or
                // reused for other content (a block stored unhashed has no
                // fingerprint to compare): its bytes now say nothing, and
                // blocks of different content are no mismatch (taking a
                // free block for new data changes no epoch); should it
                // hold a copy again when the scan reaches it, it is
                // compared there
                scan.to_verify.pop();
                continue;
            }
            // (an unreadable copy is not merged either)
            let same = self
                .same_bytes(&mut m, Pba(p), vec![target])
                .is_ok_and(|kept| !kept.is_empty());
            if same {
                scan.same_at.insert(p, m.reuse_epoch);
            } else {
                scan.differ.insert(p);
            }
            scan.to_verify.pop();
        }
        let per_page = crate::paged::U64_PER_PAGE;
        let pages_per_hold = SCAN_CHUNK.div_ceil(per_page);
        let mut applied = 0;
        loop {
            let Some(&vol) = scan.volumes.get(scan.volume) else {
                // volumes created while a paused scan waited (their LBAs
                // may have been mapped to its copies since) are scanned
                // too before it ends
                let scanned: std::collections::HashSet<VolumeId> =
                    scan.volumes.iter().copied().collect();
                let later: Vec<VolumeId> = self
                    .volumes_to_merge(scan.only, scan.keep_sequences)
                    .into_iter()
                    .filter(|v| !scanned.contains(v))
                    .collect();
                if later.is_empty() {
                    break;
                }
                scan.volumes.extend(later);
                continue;
            };
            loop {
                if should_yield() {
                    return Ok((applied, false)); // the merges stay pending
                }
                let mut m = lock(&self.meta);
                // (merges are planned and checked by fingerprints, which a
                // fault can leave stale)
                crate::engine::fault_check(&m)?;
                let default_t = self.config.sequence_threshold_blocks;
                let Some(pages) = m
                    .volumes
                    .get(&vol)
                    // (a threshold raised meanwhile: left as it is now)
                    .filter(|v| {
                        !(scan.keep_sequences
                            && v.record.sequence_threshold_blocks.unwrap_or(default_t) > 1)
                    })
                    .map(|v| v.map.page_count())
                else {
                    break;
                };
                if scan.page >= pages {
                    break;
                }
                // the pages in use only (a thin volume's map spans its
                // whole size: a 1 PiB volume has 5.4e8 page numbers)
                let mut next_page = scan.page;
                for _ in 0..pages_per_hold {
                    let Some(pg) = m.volumes[&vol].map.next_present_page(next_page, pages) else {
                        next_page = pages;
                        break;
                    };
                    next_page = pg + 1;
                    for l in pg * per_page..(pg + 1) * per_page {
                        let Some(p) = m.volumes.get(&vol).and_then(|v| v.get(Lba(l))) else {
                            continue;
                        };
                        if !merges.contains_key(&p.0) || scan.differ.contains(&p.0) {
                            continue;
                        }
                        // merge only onto a live copy of the same content
                        // (a block stored unhashed since the merge was
                        // planned has no fingerprint to compare): the
                        // chain's last such copy
                        let fp = m.fingerprint_of(p);
                        if fp == crate::engine::UNHASHED {
                            continue;
                        }
                        let deepest = Pba(resolve(p.0));
                        let holds = |m: &crate::meta::Meta, t: Pba| {
                            t != p && m.shareable(t.0) && m.fingerprint_of(t) == fp
                        };
                        let target = if holds(&m, deepest) {
                            deepest
                        } else {
                            let mut found = None;
                            let mut q = p.0;
                            for _ in 0..64 {
                                let Some(&next) = merges.get(&q) else { break };
                                q = next;
                                if holds(&m, Pba(q)) {
                                    found = Some(Pba(q));
                                }
                            }
                            // every copy it was to join is gone: it joins
                            // the live copy the index holds (another copy
                            // whose target went, met earlier in the scan),
                            // or stays and is indexed (the one indexed may
                            // have been one of those gone)
                            let indexed = || match m.lookup(&fp) {
                                Ok(Some(c)) if holds(&m, c) => Some(c),
                                _ => None,
                            };
                            match found.or_else(indexed) {
                                Some(t) => t,
                                None => {
                                    scan.own_additions += index_if_absent_counted(&mut m, p, fp);
                                    continue;
                                }
                            }
                        };
                        // `verify`: compared again (under this hold of the
                        // lock) if a freed block was reused since, or if
                        // the copy compared with is gone
                        if self.config.verify
                            && (target != deepest || scan.same_at.get(&p.0) != Some(&m.reuse_epoch))
                        {
                            let same = self
                                .same_bytes(&mut m, p, vec![target])
                                .is_ok_and(|kept| !kept.is_empty());
                            if !same {
                                scan.differ.insert(p.0);
                                continue;
                            }
                            scan.same_at.insert(p.0, m.reuse_epoch);
                        }
                        m.remap(vol, Lba(l), Some(target));
                        applied += 1;
                        if m.refcounts.get_u32(p.0) == 0 {
                            m.counters.out_of_line_duplicates += 1;
                            // the copy's last reference: had the index held
                            // it, the content is now unindexed
                            scan.own_additions += index_if_absent_counted(&mut m, target, fp);
                        }
                    }
                }
                self.note_change(&m);
                drop(m);
                scan.page = next_page;
                self.after_write(false)?;
            }
            scan.volume += 1;
            scan.page = 0;
        }
        Ok((applied, true))
    }

    /// Makes every full offline pass ([`Engine::dedup_offline`]), the one
    /// running and any started later on this engine, stop early: within
    /// 1024 blocks (`SCAN_CHUNK`) while it scans, or after the run of equal
    /// fingerprints it is at while it plans merges; the merges planned by
    /// then are applied, and its report says `interrupted`. For a shutdown
    /// (a signal) that should not wait for a pass over the whole store.
    pub fn stop_offline_passes(&self) {
        self.offline_pass_stop.store(true, Ordering::SeqCst);
    }

    /// True once [`Engine::stop_offline_passes`] was called.
    fn offline_pass_stopped(&self) -> bool {
        self.offline_pass_stop.load(Ordering::SeqCst)
    }

    /// The full post-processing pass (the baseline HPDedup compares
    /// against): every referenced block's fingerprint is compared with
    /// every other's, and every LBA (of `volume`, or of all volumes) is
    /// remapped onto the lowest PBA holding its content. Exact whatever the
    /// index budget. The (fingerprint key, PBA) pairs are sorted through a
    /// scratch file in the store ([`crate::keysort`]), and the merges it
    /// plans are applied whenever a batch of them fills (the index
    /// budget's worth at 48 bytes each, at least 65 536; checked between
    /// runs of equal fingerprints), so memory does not grow with the
    /// store. `progress` receives (PBAs examined, PBAs in all) during the
    /// scan.
    ///
    /// Errors: [`EngineError::NoSuchVolume`];
    /// [`EngineError::OfflinePassRunning`] while another pass runs; reading
    /// blocks or the scratch file; the commits of the remapping.
    pub fn dedup_offline(
        &self,
        volume: Option<&str>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<PassReport> {
        if self
            .offline_pass_running
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(EngineError::OfflinePassRunning);
        }
        /// Clears the flag however the pass ends (an error, a panic).
        struct Running<'a>(&'a AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _running = Running(&self.offline_pass_running);
        let budget_bytes = lock(&self.meta).index.config().memory_budget_bytes;
        let batch = usize::try_from(budget_bytes / MERGE_BYTES)
            .unwrap_or(usize::MAX)
            .max(crate::meta::MAX_PENDING_MERGES);
        self.dedup_offline_in_batches(volume, progress, batch)
    }

    /// [`Engine::dedup_offline`] applying its merges whenever `batch` of
    /// them are planned.
    fn dedup_offline_in_batches(
        &self,
        volume: Option<&str>,
        progress: &mut dyn FnMut(u64, u64),
        batch: usize,
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
        let (high, budget_bytes, quiet_before) = {
            let m = lock(&self.meta);
            (
                m.high_water_blocks,
                m.index.config().memory_budget_bytes,
                (m.skipped.additions(), m.counters.blocks_written),
            )
        };
        let mut sorter = crate::keysort::KeySorter::new(
            high,
            budget_bytes,
            16,
            self.dir.as_ref().and_then(|d| d.scratch_file()),
        );
        let mut p = 0;
        let mut own_additions = 0u64;
        let mut block = vec![0u8; crate::block::BLOCK_SIZE];
        while p < high {
            if self.offline_pass_stopped() {
                // (nothing planned yet: the merges need the whole scan)
                r.interrupted = true;
                r.work_remaining = !lock(&self.meta).skipped.is_empty();
                return Ok(r);
            }
            let limit = (p + SCAN_CHUNK).min(high);
            let mut end = p;
            // (blocks stored unhashed are read and hashed here: at most
            // PASS_CHUNK of them per hold of the lock, as a background pass)
            let mut reads = 0;
            let mut m = lock(&self.meta);
            while end < limit && reads < PASS_CHUNK {
                let q = end;
                end += 1;
                if m.refcounts.get_u32(q) == 0 {
                    continue;
                }
                r.blocks_examined += 1;
                let mut fp = m.fingerprint_of(Pba(q));
                if fp == crate::engine::UNHASHED {
                    reads += 1;
                    if self.backend.read_blocks(Pba(q), &mut block).is_err() {
                        // (one bad block does not stop the pass)
                        r.blocks_unreadable += 1;
                        continue;
                    }
                    fp = self.hash.fingerprint(&block);
                    // indexed unless a live copy is (the merges below
                    // fold them), so inline dedup finds it from now on
                    own_additions += index_if_absent_counted(&mut m, Pba(q), fp);
                    r.blocks_hashed += 1;
                }
                sorter.push(crate::index::key_of(&fp), q);
            }
            self.note_change(&m);
            drop(m);
            self.after_write(false)?;
            progress(end, high);
            p = end;
        }
        // equal keys are candidates: their full fingerprints, read again
        // now (blocks may have been released since the scan), decide; each
        // copy merges onto the lowest PBA with the same content. The
        // merges are the pass's own (the background worker's stay apart),
        // applied by a map scan whenever a batch fills, so memory stays
        // bounded however many copies there are
        let mut merges: HashMap<u64, u64> = HashMap::new();
        let mut failure: Option<EngineError> = None;
        let merged = sorter.for_each_sorted::<std::io::Error>(|pairs| {
            crate::keysort::for_each_equal_key_run(pairs, |run| {
                if failure.is_some() || r.interrupted {
                    return;
                }
                if self.offline_pass_stopped() {
                    r.interrupted = true;
                    return;
                }
                if merges.len() >= batch {
                    match self.apply_merges(std::mem::take(&mut merges), only) {
                        Ok((applied, own)) => {
                            r.lbas_remapped += applied;
                            own_additions += own;
                        }
                        Err(e) => failure = Some(e),
                    }
                }
                let m = lock(&self.meta);
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
                            merges.insert(q, k);
                        }
                        _ => kept = Some((fp, q)),
                    }
                }
            });
            if failure.is_some() || r.interrupted {
                Err(std::io::Error::other("offline pass stopped"))
            } else {
                Ok(())
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        if !r.interrupted {
            merged.map_err(|e| EngineError::io("reading the scratch file back", e))?;
        }
        let (applied, own) = self.apply_merges(merges, only)?;
        r.lbas_remapped += applied;
        own_additions += own;
        r.merges_applied = r.lbas_remapped;
        let mut m = lock(&self.meta);
        // (what the pass itself queued, copies its own index inserts
        // displaced, it has examined: every stored block was)
        if only.is_none()
            && !r.interrupted
            && (
                m.skipped.additions() - own_additions,
                m.counters.blocks_written,
            ) == quiet_before
        {
            // every stored block was examined and nothing was written
            // since the scan began (not even an inline hit, which may
            // share a copy the pass merged away from, and records
            // nothing): the queued work (blocks written before, copies
            // planned to merge) is done
            m.skipped.clear();
            m.pending_merges.clear();
        }
        r.work_remaining = !m.skipped.is_empty();
        Ok(r)
    }

    /// Starts the background out-of-line worker: passes of up to 64 blocks
    /// at most `rate_blocks_per_s` blocks per second, pausing while
    /// foreground requests arrive — except for one batch per ten periods
    /// while [`Engine::dedup_pressure`] holds. With nothing to do and no
    /// requests arriving it waits longer and longer, up to
    /// [`IDLE_WAIT_MAX`], between looks. With adaptive selectivity
    /// the rate is scaled by the power factor, and no pass runs in
    /// low-power mode (SmartDedup §3.4). Stops when the handle is dropped.
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
                // (the last pass failed: its records wait, and the worker
                // backs off as if idle instead of trying at every period)
                let failing = std::cell::Cell::new(false);
                // (the blocks a pass examined and merged: what its rate
                // counts)
                let mut report = |r: Result<PassReport>| match r {
                    Ok(r) => {
                        last_error.clear();
                        failing.set(false);
                        r.blocks_examined + r.merges_applied
                    }
                    Err(e) => {
                        failing.set(true);
                        let msg = e.to_string();
                        if msg != last_error {
                            // (a closed stderr must not stop the worker)
                            use std::io::Write as _;
                            let _ = writeln!(std::io::stderr(), "dedupd: out-of-line dedup: {msg}");
                            last_error = msg;
                        }
                        0
                    }
                };
                // waits while there is nothing to do grow from a period
                // to IDLE_WAIT_MAX, so an idle server wakes seldom (a phone
                // on battery); any work or client request resets them
                let mut idle_wait = period.max(Duration::from_millis(1));
                while !flag.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let mut done = 0;
                    // (on battery the rate follows the charge; in
                    // low-power mode no pass runs)
                    let share = engine.selectivity.out_of_line_share();
                    let rate = if share > 0.0 {
                        ((rate_blocks_per_s as f64 * share).ceil() as u64).max(1)
                    } else {
                        0
                    };
                    let now_foreground = engine.foreground_ops();
                    let busy = now_foreground != last_foreground;
                    last_foreground = now_foreground;
                    if rate == 0 {
                        // low-power mode: the records wait
                    } else if busy && last_pass.elapsed() >= period * 10 && engine.dedup_pressure()
                    {
                        // the minimum share: one batch of records, and of a
                        // merge scan one step (one chunk of map pages or
                        // one verify) before it yields
                        last_pass = Instant::now();
                        let steps = std::cell::Cell::new(0u32);
                        // (a stop ends a pass at its next step too)
                        let after_one_step = || {
                            steps.set(steps.get() + 1);
                            steps.get() > 1 || flag.load(Ordering::Relaxed)
                        };
                        done = report(engine.dedup_pass_yielding(batch as usize, &after_one_step));
                    } else if !busy && engine.dedup_pending() {
                        last_pass = Instant::now();
                        let seen = engine.foreground_ops();
                        let yield_now =
                            || engine.foreground_ops() != seen || flag.load(Ordering::Relaxed);
                        done = report(engine.dedup_pass_yielding(batch as usize, &yield_now));
                    }
                    let mut wait = pass_wait(done, rate.max(1), period, busy);
                    if busy || done > 0 || (rate > 0 && !failing.get() && engine.dedup_pending()) {
                        idle_wait = period.max(Duration::from_millis(1));
                    } else {
                        wait = wait.max(idle_wait);
                        idle_wait = (idle_wait * 2).min(IDLE_WAIT_MAX);
                    }
                    // (parked: a stop unparks the thread at once)
                    let until = started + wait.max(Duration::from_millis(1));
                    while !flag.load(Ordering::Relaxed) {
                        let now = Instant::now();
                        if now >= until {
                            break;
                        }
                        std::thread::park_timeout(until - now);
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

/// How long the background worker waits after a pass that examined and
/// merged `done` blocks: a period of its batch (at least 20 ms while
/// clients are busy), or longer when the pass did more than a batch (a
/// dirty region or a whole volume's slice is taken whole, a merge scan
/// applies many merges), so `rate_blocks_per_s` holds on average, up to
/// [`MAX_PASS_WAIT`].
fn pass_wait(done: u64, rate_blocks_per_s: u64, period: Duration, busy: bool) -> Duration {
    let floor = if busy {
        period.max(Duration::from_millis(20))
    } else {
        period
    };
    // (at most 10 s: the worker keeps its share under pressure)
    floor.max(
        Duration::from_secs_f64(done as f64 / rate_blocks_per_s.max(1) as f64).min(MAX_PASS_WAIT),
    )
}

/// Longest wait after one pass (a merge scan that applied many merges).
const MAX_PASS_WAIT: Duration = Duration::from_secs(10);

/// Longest wait of the background worker while it has nothing to do (or
/// its passes fail) and no client sends requests: records written
/// meanwhile wait at most this long before the worker looks at them.
pub const IDLE_WAIT_MAX: Duration = Duration::from_secs(1);

/// The running background worker; dropping it stops the worker and waits.
pub struct WorkerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Stops the worker and waits for its current pass to reach its next
    /// yield point (a batch of records, or a step of a merge scan).
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
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
    use crate::block::{Lba, Pba, VolumeId, BLOCK_SIZE};
    use crate::engine::{lock, UNHASHED};
    use crate::{Engine, EngineConfig, HashAlgorithm};

    /// Content X written at LBAs 0 and 1 of a new 1 MiB volume of `e`,
    /// stored apart (the index forgets the first copy before the second
    /// write): (volume, X's fingerprint, first copy, second copy).
    fn two_copies_apart(e: &Engine) -> (VolumeId, crate::Fingerprint, Pba, Pba) {
        let v = e.create_volume("v", 1 << 20).unwrap();
        let x = [5u8; BLOCK_SIZE];
        let fp = HashAlgorithm::Sha256.fingerprint(&x);
        e.write(v, 0, &x, false).unwrap();
        let a = lock(&e.meta).volumes[&v].get(Lba(0)).unwrap();
        lock(&e.meta).index.remove(&fp, a);
        e.write(v, 4096, &x, false).unwrap();
        let b = lock(&e.meta).volumes[&v].get(Lba(1)).unwrap();
        assert_ne!(a, b);
        (v, fp, a, b)
    }

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
        assert_eq!(e.apply_pending_merges(&|| false).unwrap(), 0);
        let mut got = vec![0u8; BLOCK_SIZE];
        e.read(v, 4096, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 2), "LBA 1 reads another block");
        assert!(e.check().is_empty());
    }

    #[test]
    fn after_a_dropped_reverse_index_write_no_fingerprint_is_trusted() {
        // two copies of X stored apart, a merge of the second onto the
        // first planned; then a reverse-index write is dropped (its page
        // could not be read back): the fingerprints may be stale, so no
        // lookup hits, no merge is applied and the pass stops
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let (v, fp, a, b) = two_copies_apart(&e);
        let pba = |e: &Engine, lba: u64| lock(&e.meta).volumes[&v].get(Lba(lba)).unwrap();
        {
            let mut m = lock(&e.meta);
            assert_eq!(m.lookup(&fp).unwrap(), Some(b));
            m.pending_merges.insert(b.0, a.0);
            m.reverse_cache
                .writes_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(m.lookup(&fp).unwrap(), None);
            assert!(m.lookup_all(&fp).unwrap().is_empty());
        }
        assert!(matches!(
            e.apply_pending_merges(&|| false),
            Err(crate::EngineError::MetadataUnreadable(_))
        ));
        assert_eq!(pba(&e, 1), b, "a merge was applied after the fault");
        // a pass over skipped records stops at once, keeping them
        let before = lock(&e.meta).skipped.stats().records;
        assert!(before > 0);
        assert!(e.dedup_pass(64).is_err());
        assert_eq!(lock(&e.meta).skipped.stats().records, before);
        // and a chunk whose pass began before the fault stops at its next
        // record, examining nothing
        let sizes: std::collections::HashMap<_, _> = [(v, 1 << 20)].into_iter().collect();
        let mut r = super::PassReport::default();
        let stopped = e.pass_chunk(&[(v, 0), (v, 1)], &sizes, &mut r);
        assert!(
            matches!(stopped, Err((0, super::ExamineError::Fault(_)))),
            "{stopped:?}"
        );
        assert_eq!(r.blocks_examined, 0);
        assert_eq!(pba(&e, 1), b);
    }

    #[test]
    fn copies_not_remembered_queue_only_the_volumes_the_background_pass_takes() {
        // the engine's sequence threshold T > 1: volumes without their own
        // are left to the full pass, so they are not queued whole
        let cfg = EngineConfig {
            sequence_threshold_blocks: 4,
            ..EngineConfig::default()
        };
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
        let a = e.create_volume("a", 1 << 20).unwrap();
        let b = e.create_volume("b", 1 << 20).unwrap();
        e.set_sequence_threshold("b", Some(1)).unwrap();
        let mut m = lock(&e.meta);
        // (b, lowered to T = 1, is queued whole already)
        assert_eq!(m.skipped.stats().volumes, 1);
        m.merges_dropped();
        // a (T = 4 from the engine) is not queued
        assert_eq!(m.skipped.stats().volumes, 1, "{:?}", m.skipped.stats());
        let _ = (a, b);
    }

    #[test]
    fn copies_whose_merge_target_died_are_merged_with_each_other() {
        // copies b and c of content X were to merge onto a; a lost its
        // last reference before the merge scan: b and c end as one copy
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        let x = [5u8; BLOCK_SIZE];
        let fp = HashAlgorithm::Sha256.fingerprint(&x);
        let pba = |e: &Engine, lba: u64| lock(&e.meta).volumes[&v].get(Lba(lba)).unwrap();
        let mut copies = Vec::new();
        for lba in 0..3u64 {
            e.write(v, lba * 4096, &x, false).unwrap();
            let p = pba(&e, lba);
            // (stored apart: the index forgets each copy)
            lock(&e.meta).index.remove(&fp, p);
            copies.push(p);
        }
        let (a, b, c) = (copies[0], copies[1], copies[2]);
        assert!(a != b && b != c && a != c);
        {
            let mut m = lock(&e.meta);
            m.pending_merges.insert(b.0, a.0);
            m.pending_merges.insert(c.0, a.0);
        }
        e.write(v, 0, &[6u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        let stored = e.stats().physical_blocks_stored;
        e.apply_pending_merges(&|| false).unwrap();
        assert_eq!(pba(&e, 1), pba(&e, 2), "two copies of X left");
        assert_eq!(e.stats().physical_blocks_stored, stored - 1);
        let mut got = vec![0u8; BLOCK_SIZE];
        for lba in 1..3u64 {
            e.read(v, lba * 4096, &mut got).unwrap();
            assert_eq!(got, x);
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_copy_whose_merge_target_died_is_indexed_again() {
        // copy b of content X was to merge onto a, which the index then
        // held instead of b; a lost its last reference before the merge
        // scan: b stays, and is indexed, so X is found inline again
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let (v, fp, a, b) = two_copies_apart(&e);
        let x = [5u8; BLOCK_SIZE];
        let pba = |e: &Engine, lba: u64| lock(&e.meta).volumes[&v].get(Lba(lba)).unwrap();
        {
            let mut m = lock(&e.meta);
            m.index_insert(fp, a).unwrap();
            m.pending_merges.insert(b.0, a.0);
        }
        e.write(v, 0, &[6u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        assert_eq!(lock(&e.meta).lookup(&fp).unwrap(), None);
        assert_eq!(e.apply_pending_merges(&|| false).unwrap(), 0);
        assert_eq!(lock(&e.meta).lookup(&fp).unwrap(), Some(b));
        let stored = e.stats().physical_blocks_stored;
        e.write(v, 5 * 4096, &x, false).unwrap();
        assert_eq!(pba(&e, 5), b);
        assert_eq!(e.stats().physical_blocks_stored, stored);
        assert!(e.check().is_empty(), "{:?}", e.check());
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

    /// Inline dedup off (low-power mode): every block is stored as written.
    fn inline_off() -> EngineConfig {
        EngineConfig {
            selectivity: crate::selectivity::SelectivityConfig {
                adaptive: true,
                load_aware: false,
                power: crate::selectivity::PowerSource::Battery(5.0),
            },
            ..EngineConfig::default()
        }
    }

    /// Writes `content` at LBAs `la` and `lb` of `v` (two copies: inline
    /// dedup is off), records their fingerprint as a pass would, plans the
    /// merge of the higher PBA onto the lower and empties the skipped
    /// buffer. Returns (kept PBA, copy PBA).
    fn planned_merge(e: &Engine, v: VolumeId, la: u64, lb: u64, content: &[u8]) -> (u64, u64) {
        e.write(v, la * 4096, content, false).unwrap();
        e.write(v, lb * 4096, content, false).unwrap();
        let fp = e.hash.fingerprint(content);
        let mut m = lock(&e.meta);
        let (a, b) = {
            let map = &m.volumes[&v];
            (map.get(Lba(la)).unwrap(), map.get(Lba(lb)).unwrap())
        };
        assert_ne!(a, b);
        m.record_unindexed(a, fp);
        m.record_unindexed(b, fp);
        m.skipped = crate::skipped::SkippedBuffer::new(64 << 10);
        let (kept, copy) = (a.0.min(b.0), a.0.max(b.0));
        m.pending_merges.insert(copy, kept);
        (kept, copy)
    }

    #[test]
    fn a_merge_scan_of_a_1_pib_volume_visits_only_its_pages_in_use() {
        // 5.4e8 page numbers, two in use: a scan stepping through every
        // page number would take minutes here
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 50).unwrap();
        let far = (1u64 << 38) - 1;
        let content = [9u8; BLOCK_SIZE];
        let (kept, _copy) = planned_merge(&e, v, 0, far, &content);
        // and a whole-volume record, taken by the next pass
        lock(&e.meta).skipped.record_volume(v);
        e.dedup_pass(1 << 20).unwrap();
        assert!(e.apply_pending_merges(&|| false).unwrap() <= 1);
        let m = lock(&e.meta);
        assert_eq!(m.volumes[&v].get(Lba(far)), Some(Pba(kept)));
        assert_eq!(m.volumes[&v].get(Lba(0)), Some(Pba(kept)));
        drop(m);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    /// An engine with `verify` on and inline dedup off, and a merge planned
    /// of two copies of one content at LBAs 0 and 1 of its volume:
    /// (engine, volume, content, kept PBA, copy PBA).
    fn verified_planned_merge() -> (Engine, VolumeId, [u8; BLOCK_SIZE], u64, u64) {
        let cfg = EngineConfig {
            verify: true,
            ..inline_off()
        };
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
        let v = e.create_volume("v", 1 << 20).unwrap();
        let content = [3u8; BLOCK_SIZE];
        let (kept, copy) = planned_merge(&e, v, 0, 1, &content);
        (e, v, content, kept, copy)
    }

    #[test]
    fn a_paused_verified_merge_compares_again_once_blocks_were_reused() {
        let (e, v, content, kept, copy) = verified_planned_merge();
        // the scan finds the copy the same as the kept block, then yields
        let calls = std::cell::Cell::new(0);
        let yield_after_verifying = || {
            calls.set(calls.get() + 1);
            calls.get() > 1
        };
        assert_eq!(e.apply_pending_merges(&yield_after_verifying).unwrap(), 0);
        // meanwhile: the copy's LBA is overwritten and the copy freed and
        // reused for a write of the same content, which a verified write
        // stores apart because the kept block rotted on disk
        e.write(v, 4096, &[4u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        // the resumed scan compares again and leaves LBA 3 alone
        rot_store_apart_and_resume(&e, v, kept, copy, &content);
        assert!(e.stats().verify_mismatches >= 1);
    }

    /// The kept block of a planned merge rots on disk; a verified write of
    /// `content` at LBA 3 is stored apart, in the block of the freed
    /// `copy` (with no commit between); the merge scan resumes, and LBA 3
    /// must still read `content`.
    fn rot_store_apart_and_resume(e: &Engine, v: VolumeId, kept: u64, copy: u64, content: &[u8]) {
        e.backend
            .write_blocks(Pba(kept), &[0xee; BLOCK_SIZE])
            .unwrap();
        e.write(v, 3 * 4096, content, false).unwrap();
        {
            let mut m = lock(&e.meta);
            let p = m.volumes[&v].get(Lba(3)).unwrap();
            assert_eq!(p.0, copy, "the freed copy was not reused");
            let fp = e.hash.fingerprint(content);
            m.record_unindexed(p, fp);
        }
        e.apply_pending_merges(&|| false).unwrap();
        let mut got = vec![0u8; BLOCK_SIZE];
        e.read(v, 3 * 4096, &mut got).unwrap();
        assert!(
            got == content,
            "LBA 3 was merged onto a block with other bytes"
        );
    }

    #[test]
    fn a_verified_merge_does_not_trust_a_compare_of_a_freed_copy() {
        let (e, v, content, kept, copy) = verified_planned_merge();
        // the copy's LBA is overwritten and the copy freed before the scan
        e.write(v, 4096, &[4u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        // the scan's verify step meets the freed copy (its old bytes still
        // equal the kept block's), then yields
        let calls = std::cell::Cell::new(0);
        let yield_after_verifying = || {
            calls.set(calls.get() + 1);
            calls.get() > 1
        };
        assert_eq!(e.apply_pending_merges(&yield_after_verifying).unwrap(), 0);
        rot_store_apart_and_resume(&e, v, kept, copy, &content);
    }

    #[test]
    fn a_planned_merge_whose_copy_now_holds_other_content_is_no_verify_mismatch() {
        let (e, v, content, _kept, copy) = verified_planned_merge();
        // the copy's LBA is overwritten, the copy freed and reused for
        // other content before the scan verifies the merge
        e.write(v, 4096, &[4u8; BLOCK_SIZE], false).unwrap();
        e.flush().unwrap();
        e.write(v, 2 * 4096, &[5u8; BLOCK_SIZE], false).unwrap();
        assert_eq!(
            lock(&e.meta).volumes[&v].get(Lba(2)).map(|p| p.0),
            Some(copy),
            "the freed copy was not reused"
        );
        e.apply_pending_merges(&|| false).unwrap();
        // blocks of different content are no mismatch: only blocks with
        // one fingerprint and different bytes are
        assert_eq!(e.stats().verify_mismatches, 0);
        let mut got = vec![0u8; BLOCK_SIZE];
        e.read(v, 2 * 4096, &mut got).unwrap();
        assert_eq!(got, [5u8; BLOCK_SIZE]);
        e.read(v, 0, &mut got).unwrap();
        assert_eq!(got, content);
    }

    #[test]
    fn the_offline_pass_goes_on_past_an_unreadable_block() {
        let bad = crate::backend::OneBadBlock::new();
        let e = Engine::in_memory_over(HashAlgorithm::Sha256, inline_off(), Box::new(bad.clone()));
        let v = e.create_volume("v", 1 << 20).unwrap();
        for k in 0..6u64 {
            // contents 1, 2, 3, each twice, stored unhashed
            e.write(v, k * 4096, &[(k % 3) as u8 + 1; BLOCK_SIZE], false)
                .unwrap();
        }
        bad.fail(lock(&e.meta).volumes[&v].get(Lba(0)).unwrap());
        let r = e.dedup_offline(None, &mut |_, _| {}).unwrap();
        assert_eq!(r.blocks_unreadable, 1);
        // the other two contents merged; the unreadable block's LBA and
        // its twin stay as they were
        assert_eq!(r.lbas_remapped, 2);
        assert_eq!(e.stats().physical_blocks_stored, 4);
        let mut got = vec![0u8; BLOCK_SIZE];
        for k in 1..6u64 {
            e.read(v, k * 4096, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == (k % 3) as u8 + 1), "LBA {k}");
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn the_offline_pass_applies_its_merges_in_bounded_batches() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        for k in 0..20u64 {
            // contents 0..10, each twice
            e.write(v, k * 4096, &[(k % 10) as u8 + 1; BLOCK_SIZE], false)
                .unwrap();
        }
        assert_eq!(e.stats().physical_blocks_stored, 20);
        let r = e.dedup_offline_in_batches(None, &mut |_, _| {}, 3).unwrap();
        assert_eq!(r.lbas_remapped, 10);
        assert_eq!(e.stats().physical_blocks_stored, 10);
        // its merges never went through the background worker's list
        assert!(lock(&e.meta).pending_merges.is_empty());
        let mut got = vec![0u8; BLOCK_SIZE];
        for k in 0..20u64 {
            e.read(v, k * 4096, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == (k % 10) as u8 + 1), "LBA {k}");
        }
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn out_of_line_passes_commit_within_the_bounds() {
        // 16 dirty pages, 256 blocks waiting to be freed
        let cfg = EngineConfig {
            max_dirty_bytes: 64 << 10,
            max_pending_free_bytes: 1 << 20,
            ..inline_off()
        };
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, cfg);
        let v = e.create_volume("v", 64 << 20).unwrap();
        let n = 8192u64;
        for k in 0..n {
            // contents 0..n/2, each twice, stored apart (inline dedup off)
            let mut b = vec![1u8; BLOCK_SIZE];
            b[..8].copy_from_slice(&(k % (n / 2)).to_le_bytes());
            e.write(v, k * 4096, &b, false).unwrap();
        }
        e.flush().unwrap();
        // the offline pass fingerprints every block (8192 reverse-index
        // entries, 64 pages), then frees half of them
        let mut peak_dirty = 0;
        let r = e
            .dedup_offline(None, &mut |_, _| {
                peak_dirty = peak_dirty.max(lock(&e.meta).dirty_pages());
            })
            .unwrap();
        assert_eq!(r.lbas_remapped, n / 2);
        assert!(peak_dirty <= 16 + 16, "{peak_dirty} dirty pages");
        // (one hold of the scan frees up to SCAN_CHUNK blocks)
        let pending = lock(&e.meta).pending_free.len() as u64;
        assert!(
            pending <= 256 + super::SCAN_CHUNK as usize as u64,
            "{pending} blocks waiting"
        );
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_whole_thin_volume_queued_is_scanned_only_where_mapped() {
        // 1 TiB, two blocks mapped (one content, stored twice)
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 40).unwrap();
        e.write(v, 4096, &[5u8; BLOCK_SIZE], false).unwrap();
        e.write(v, (1 << 39) + 4096, &[5u8; BLOCK_SIZE], false)
            .unwrap();
        {
            let mut m = lock(&e.meta);
            m.skipped = crate::skipped::SkippedBuffer::new(64 << 10);
            m.skipped.record_volume(v);
        }
        let mut examined = 0;
        for _ in 0..100 {
            let r = e.dedup_pass(4096).unwrap();
            examined += r.blocks_examined;
            if !r.work_remaining {
                break;
            }
        }
        assert!(!e.dedup_pending());
        // the 256-LBA regions that share an allocated map page (508 LBAs)
        // with the two blocks, not 2^28 LBAs
        assert!(
            examined <= 6 * crate::skipped::REGION_BLOCKS,
            "{examined} LBAs examined"
        );
        assert_eq!(e.stats().physical_blocks_stored, 1);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_merge_scan_that_keeps_yielding_resumes_and_finishes() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 30).unwrap();
        let per_page = crate::paged::U64_PER_PAGE;
        // ten contents, each stored twice, spread over ~300 map pages
        for k in 0..10u64 {
            let la = k * 30 * per_page;
            planned_merge(&e, v, la, la + 15 * per_page, &[k as u8 + 1; BLOCK_SIZE]);
        }
        // traffic arrives at every fourth check: a scan that started over
        // each time would never get past the first few chunks
        let checks = std::cell::Cell::new(0u32);
        let traffic = || {
            checks.set(checks.get() + 1);
            checks.get().is_multiple_of(4)
        };
        let mut calls = 0;
        while !lock(&e.meta).pending_merges.is_empty() {
            e.apply_pending_merges(&traffic).unwrap();
            calls += 1;
            assert!(calls < 1000, "the scan never finishes");
        }
        assert_eq!(e.stats().physical_blocks_stored, 10);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_paused_merge_scan_also_covers_volumes_created_meanwhile() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 32).unwrap();
        let far = 1000 * crate::paged::U64_PER_PAGE;
        // pages in use between the copies, so that the first chunk of the
        // scan (3 pages in use) ends before the far one
        for pg in 1..=4u64 {
            let lba = pg * crate::paged::U64_PER_PAGE;
            e.write(v, lba * 4096, &[20 + pg as u8; BLOCK_SIZE], false)
                .unwrap();
        }
        let (a, b) = planned_merge(&e, v, 0, far, &[6u8; BLOCK_SIZE]);
        // the scan pauses after its first chunk...
        let first = std::cell::Cell::new(true);
        let pause = || !first.replace(false);
        e.apply_pending_merges(&pause).unwrap();
        assert!(lock(&e.merge_scan).is_some(), "the scan did not pause");
        // ...and a volume created meanwhile maps the copy
        let w = e.create_volume("w", 1 << 20).unwrap();
        lock(&e.meta).remap(w, Lba(0), Some(Pba(b)));
        while !lock(&e.meta).pending_merges.is_empty() {
            e.apply_pending_merges(&|| false).unwrap();
        }
        assert_eq!(lock(&e.meta).volumes[&w].get(Lba(0)), Some(Pba(a)));
        // (the kept copy and the 4 blocks between)
        assert_eq!(e.stats().physical_blocks_stored, 5);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn lowering_a_sequence_threshold_queues_the_volume() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.set_sequence_threshold("v", Some(4)).unwrap();
        e.write(v, 0, &[8u8; BLOCK_SIZE], false).unwrap();
        let s = e.stats().skipped;
        assert_eq!((s.records, s.volumes), (0, 0), "a T > 1 write was recorded");
        e.set_sequence_threshold("v", None).unwrap();
        assert_eq!(e.stats().skipped.volumes, 1);
    }

    #[test]
    fn sharing_leaves_room_for_a_request_s_own_copies() {
        let e = Engine::in_memory(HashAlgorithm::Sha256);
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.write(v, 0, &[9u8; BLOCK_SIZE], false).unwrap();
        let mut m = lock(&e.meta);
        let p = m.volumes[&v].get(Lba(0)).unwrap().0;
        m.refcounts.set_u32(p, u32::MAX - 3);
        assert!(m.shareable(p) && m.shareable_by(p, 3));
        assert!(!m.shareable_by(p, 4));
        m.refcounts.set_u32(p, 1);
    }

    #[test]
    fn records_a_pass_took_are_saved_by_a_checkpoint_before_it_examines_them() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let e = Engine::create(&path, HashAlgorithm::Sha256, inline_off()).unwrap();
        let v = e.create_volume("v", 1 << 20).unwrap();
        for i in 0..8u8 {
            e.write(v, u64::from(i) * 4096, &[i + 1; BLOCK_SIZE], false)
                .unwrap();
        }
        assert_eq!(e.stats().skipped.records, 8);
        // a pass takes the records; another thread's checkpoint runs
        // before it examines them; then the process dies
        {
            let mut m = lock(&e.meta);
            let items = m.skipped.take(64, |_| Some(256), |_, s, _| Some(s));
            assert_eq!(items.len(), 8);
            m.skipped_in_flight = items;
        }
        e.checkpoint().unwrap();
        e.drop_without_closing();
        let e = Engine::open(&path, inline_off()).unwrap();
        assert_eq!(e.stats().skipped.records, 8, "the records taken were lost");
    }

    #[test]
    fn a_lowered_threshold_is_queued_durably_before_it_is_committed() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let v = e.create_volume("v", 1 << 20).unwrap();
        e.set_sequence_threshold("v", Some(4)).unwrap();
        e.write(v, 0, &[8u8; BLOCK_SIZE], true).unwrap();
        e.set_sequence_threshold("v", Some(1)).unwrap();
        // a crash right after the commit of the new threshold
        e.drop_without_closing();
        let e = Engine::open(&path, EngineConfig::default()).unwrap();
        let t = e
            .volumes()
            .iter()
            .find(|i| i.name == "v")
            .map(|i| i.sequence_threshold_blocks);
        assert_eq!(t, Some(Some(1)));
        assert_eq!(e.stats().skipped.volumes, 1, "the volume was not queued");
    }

    /// Applies one pass over a skipped buffer that keeps one record after
    /// it (steady writes): true if `copy` of `v`'s LBA 1 was merged.
    fn merged_by_a_pass_that_leaves_records(e: &Engine, v: VolumeId, kept: u64) -> bool {
        {
            let mut m = lock(&e.meta);
            m.skipped.record(v, 200);
            m.skipped.record(v, 201);
        }
        let r = e.dedup_pass(1).unwrap();
        assert!(!lock(&e.meta).skipped.is_empty());
        assert!(r.work_remaining);
        lock(&e.meta).volumes[&v].get(Lba(1)) == Some(Pba(kept))
    }

    #[test]
    fn merges_past_half_their_bound_apply_though_the_buffer_never_empties() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        let (kept, _copy) = planned_merge(&e, v, 0, 1, &[5u8; BLOCK_SIZE]);
        // few merges wait for the buffer to empty
        assert!(!merged_by_a_pass_that_leaves_records(&e, v, kept));
        // merges planned of copies no LBA maps any more, up to half the
        // bound: the next pass applies them all
        {
            let mut m = lock(&e.meta);
            let mut copy = 1 << 30;
            while m.pending_merges.len() < crate::meta::MAX_PENDING_MERGES / 2 {
                m.pending_merges.insert(copy, kept);
                copy += 1;
            }
        }
        assert!(merged_by_a_pass_that_leaves_records(&e, v, kept));
        assert_eq!(e.stats().pending_merges, 0);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn blocks_hashed_outside_the_lock_are_used_only_while_not_reused() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        let content = [3u8; BLOCK_SIZE];
        e.write(v, 0, &content, false).unwrap();
        e.write(v, 4096, &content, false).unwrap();
        let fp = e.hash.fingerprint(&content);
        let sizes: std::collections::HashMap<VolumeId, u64> = [(v, 256)].into();
        let hashed = e.hash_unhashed(&[(v, 0), (v, 1), (v, 9)], &sizes);
        let p0 = lock(&e.meta).volumes[&v].get(Lba(0)).unwrap();
        assert_eq!(hashed[0].map(|h| (h.0, h.2)), Some((p0, fp)));
        assert_eq!(hashed[1].map(|h| h.2), Some(fp));
        assert!(hashed[2].is_none(), "an unmapped LBA");
        // a fingerprint from before a block's reuse is not used: the block
        // is read again under the lock
        let mut m = lock(&e.meta);
        let stale_epoch = m.reuse_epoch;
        m.reuse_epoch += 1;
        let wrong = e.hash.fingerprint(&[4u8; BLOCK_SIZE]);
        let mut r = super::PassReport::default();
        assert!(e
            .examine(&mut m, v, 0, &sizes, &mut r, Some((p0, stale_epoch, wrong)))
            .is_ok());
        assert_eq!(m.fingerprint_of(p0), fp);
        // a current one is
        let epoch = m.reuse_epoch;
        let p1 = m.volumes[&v].get(Lba(1)).unwrap();
        assert!(e
            .examine(&mut m, v, 1, &sizes, &mut r, Some((p1, epoch, fp)))
            .is_ok());
        assert_eq!(r.blocks_hashed, 2);
        assert_eq!(m.volumes[&v].get(Lba(1)), Some(p0.min(p1)));
        drop(m);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn a_pass_that_did_more_than_a_batch_waits_for_what_it_did() {
        use super::pass_wait;
        use std::time::Duration;
        let period = Duration::from_millis(64); // a batch of 64 at 1000/s
        assert_eq!(pass_wait(0, 1000, period, false), period);
        assert_eq!(pass_wait(64, 1000, period, false), period);
        // a region of 256 blocks taken whole with 63 records
        assert_eq!(
            pass_wait(319, 1000, period, false),
            Duration::from_millis(319)
        );
        assert_eq!(
            pass_wait(1, 100_000, Duration::from_micros(640), true),
            Duration::from_millis(20)
        );
        assert_eq!(pass_wait(65_536, 1000, period, false), super::MAX_PASS_WAIT);
    }

    /// Runs passes until no work remains: one stored copy is left, and
    /// the metadata is consistent.
    fn drained_to_one_copy(e: &Engine) {
        for _ in 0..1000 {
            if !e.dedup_pass(256).unwrap().work_remaining {
                break;
            }
        }
        assert_eq!(e.stats().physical_blocks_stored, 1, "a copy was forgotten");
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn pending_merges_at_their_bound_are_applied_before_more_records_are_examined() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        let content = [7u8; BLOCK_SIZE];
        e.write(v, 0, &content, false).unwrap();
        e.write(v, 4096, &content, false).unwrap();
        let fp = e.hash.fingerprint(&content);
        {
            let mut m = lock(&e.meta);
            let map = &m.volumes[&v];
            let (p0, p1) = (map.get(Lba(0)).unwrap(), map.get(Lba(1)).unwrap());
            // LBA 2 shares LBA 1's copy (an inline hit on it); only LBA 1
            // is recorded, and LBA 0's copy is the one indexed
            m.remap(v, Lba(2), Some(p1));
            m.record_unindexed(p0, fp);
            m.index_insert(fp, p0).unwrap();
            m.skipped = crate::skipped::SkippedBuffer::new(64 << 10);
            m.skipped.record(v, 1);
            // the pending merges at their bound (copies no LBA maps)
            let mut copy = 1 << 30;
            while m.pending_merges.len() < crate::meta::MAX_PENDING_MERGES {
                m.pending_merges.insert(copy, p0.0);
                copy += 1;
            }
        }
        // the pass examines nothing: it applies the merges, and the record
        // waits in the buffer (no merge is dropped, nothing degrades)
        let r = e.dedup_pass(1).unwrap();
        assert_eq!(r.blocks_examined, 0);
        assert_eq!(e.stats().pending_merges, 0);
        assert_eq!(e.stats().skipped.records, 1);
        assert_eq!(e.stats().skipped.degradations, 0);
        drained_to_one_copy(&e);
    }

    #[test]
    fn a_merge_that_cannot_be_kept_queues_the_volumes_whole_and_dedup_stays_exact() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        let content = [7u8; BLOCK_SIZE];
        e.write(v, 0, &content, false).unwrap();
        e.write(v, 4096, &content, false).unwrap();
        {
            let mut m = lock(&e.meta);
            let p1 = m.volumes[&v].get(Lba(1)).unwrap();
            m.remap(v, Lba(2), Some(p1));
            m.skipped = crate::skipped::SkippedBuffer::new(64 << 10);
            // (as when the index's list of dropped copies overflows)
            m.merges_dropped();
        }
        assert_eq!(e.stats().skipped.volumes, 1);
        assert_eq!(e.stats().skipped.degradations, 1);
        drained_to_one_copy(&e);
    }

    #[test]
    fn a_merge_scan_begun_goes_on_though_the_buffer_never_empties() {
        let e = Engine::in_memory_with(HashAlgorithm::Sha256, inline_off());
        let v = e.create_volume("v", 1 << 20).unwrap();
        let (kept, _copy) = planned_merge(&e, v, 0, 1, &[5u8; BLOCK_SIZE]);
        // the scan begins, and yields at once to foreground traffic
        assert_eq!(e.apply_pending_merges(&|| true).unwrap(), 0);
        assert!(lock(&e.merge_scan).is_some());
        assert!(merged_by_a_pass_that_leaves_records(&e, v, kept));
        assert!(e.check().is_empty(), "{:?}", e.check());
    }

    #[test]
    fn pending_merges_are_saved_with_the_skipped_buffer() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let e = Engine::create(&path, HashAlgorithm::Sha256, inline_off()).unwrap();
        let v = e.create_volume("v", 1 << 20).unwrap();
        // both hashed by a pass, a merge planned, their LBAs no longer in
        // the skipped buffer
        planned_merge(&e, v, 0, 1, &[1u8; BLOCK_SIZE]);
        e.close().unwrap();
        drop(e);
        let e = Engine::open(&path, inline_off()).unwrap();
        assert_eq!(e.stats().pending_merges, 1);
        e.dedup_pass(64).unwrap();
        assert_eq!(e.stats().physical_blocks_stored, 1);
        // (the index, rebuilt with both copies, may have planned the same
        // merge again: the next pass finds it done)
        for _ in 0..2 {
            if !e.dedup_pass(64).unwrap().work_remaining {
                break;
            }
        }
        assert_eq!(e.stats().pending_merges, 0);
        assert!(e.check().is_empty(), "{:?}", e.check());
    }
}
