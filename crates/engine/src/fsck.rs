//! `fsck`: checks a closed store's metadata against itself and its data,
//! and optionally repairs it (SmartDedup §3.4 "File System Consistency";
//! the invariants are listed in [`crate::meta`]).
//!
//! Checks: every volume map entry points inside the data file; each PBA's
//! reference count equals the LBAs mapped to it (a count too high is a
//! leaked block, too low a block that would be freed while in use); every
//! referenced PBA has a fingerprint and no two referenced PBAs share one
//! (the fingerprint index is rebuilt from these at start); metadata pages
//! pass their checksums. With `rehash` every referenced block is read and
//! re-fingerprinted. `repair` rebuilds reference counts, the reverse index
//! and free space from the volume maps and the data, and writes everything
//! back through the journal. Duplicate copies (blocks inline dedup missed)
//! are counted, not treated as errors.
//!
//! Exit codes follow e2fsck: 0 clean, 1 errors corrected, 4 errors left
//! uncorrected, 8 operational error.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::block::{Pba, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::engine::{lock, Engine, EngineConfig};
use crate::error::Result;
use crate::fingerprint::{Fingerprint, FINGERPRINT_SIZE};
use crate::paged::PAYLOAD_SIZE;

/// What fsck does.
#[derive(Debug, Clone, Copy, Default)]
pub struct FsckOptions {
    /// Fix what is wrong (rebuild reference counts, reverse index, free
    /// space; unmap entries that point outside the data file; make damaged
    /// volumes writable again).
    pub repair: bool,
    /// Re-fingerprint every referenced block (reads all stored data).
    pub rehash: bool,
}

/// The outcome of a check.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FsckReport {
    /// Volumes checked.
    pub volumes: u64,
    /// LBAs mapped, over all volumes.
    pub mapped_blocks: u64,
    /// PBAs referenced by at least one LBA.
    pub referenced_blocks: u64,
    /// Blocks re-fingerprinted (with `rehash`, or where the reverse index was damaged).
    pub blocks_rehashed: u64,
    /// PBAs with a reference count but no mapping LBA (leaked space).
    pub leaked_blocks: u64,
    /// Referenced PBAs whose fingerprint another referenced PBA also has: a
    /// copy inline dedup missed (not an error; out-of-line dedup merges
    /// them; with verify, possibly a true collision).
    pub duplicate_copies: u64,
    /// One line per problem found.
    pub problems: Vec<String>,
    /// True if the problems were repaired and the store written back.
    pub repaired: bool,
    /// Problems that a repair could fix only by discarding data (listed
    /// also in `problems`).
    pub data_lost: Vec<String>,
}

impl FsckReport {
    /// e2fsck-style exit code: 0 clean, 1 corrected, 4 uncorrected.
    pub fn exit_code(&self) -> i32 {
        if self.problems.is_empty() {
            0
        } else if self.repaired {
            1
        } else {
            4
        }
    }
}

/// Checks (and with `opts.repair`, repairs) the store at `path`, which must
/// not be open in another process.
///
/// Errors: those of [`Engine::open`] other than damaged metadata pages
/// (which are reported as problems), and I/O errors reading data or
/// writing the repair.
pub fn fsck(path: &Path, opts: FsckOptions) -> Result<FsckReport> {
    let config = EngineConfig {
        allow_damaged_metadata: true,
        ..EngineConfig::default()
    };
    let engine = Engine::open(path, config)?;
    let report = engine.check_and_repair(opts)?;
    if report.repaired {
        engine.close()?;
    }
    Ok(report)
}

impl Engine {
    fn check_and_repair(&self, opts: FsckOptions) -> Result<FsckReport> {
        let mut r = FsckReport::default();
        let data_blocks = self
            .backend
            .len_bytes()
            .map_err(|e| crate::error::EngineError::io("reading the data file size", e))?
            .div_ceil(BLOCK_SIZE_U64);
        let mut m = lock(&self.meta);
        let fp_damaged_pages: Vec<u64> = self
            .damage
            .iter()
            .filter(|d| d.file.ends_with("fingerprints"))
            .flat_map(|d| d.pages.iter().copied())
            .collect();
        for d in &self.damage {
            r.problems.push(format!(
                "{}: {} page(s) fail their checksum: {:?}",
                d.file.display(),
                d.pages.len(),
                &d.pages[..d.pages.len().min(16)]
            ));
        }

        // maps: entries inside the data file; count references
        let mut counts: Vec<u32> = vec![0; data_blocks as usize];
        let ids: Vec<_> = m.volumes.keys().copied().collect();
        r.volumes = ids.len() as u64;
        let mut outside: Vec<(crate::VolumeId, u64)> = Vec::new();
        for id in &ids {
            let v = &m.volumes[id];
            if v.read_only() {
                let lost = format!(
                    "volume {}: map pages {:?} damaged; the LBAs they hold (508 per page) read as unmapped",
                    v.record.name,
                    &v.damaged_pages[..v.damaged_pages.len().min(16)]
                );
                r.data_lost.push(lost);
            }
            for (lba, raw) in v.map.nonzero_u64(0..v.size_blocks()) {
                let p = Pba(raw - 1);
                r.mapped_blocks += 1;
                match counts.get_mut(p.0 as usize) {
                    Some(c) => *c += 1,
                    None => outside.push((*id, lba)),
                }
            }
        }
        for (id, lba) in &outside {
            let name = m.volumes[id].record.name.clone();
            r.problems.push(format!(
                "volume {name}: LBA {lba} maps past the end of the data file"
            ));
            r.data_lost.push(format!(
                "volume {name}: LBA {lba} unmapped (its block is missing)"
            ));
        }

        // reference counts
        let rc_len = (m.refcounts.logical_len() / 4).max(data_blocks);
        for p in 0..rc_len {
            let rc = m.refcounts.get_u32(p);
            let want = counts.get(p as usize).copied().unwrap_or(0);
            if rc != want {
                if rc > want && want == 0 {
                    r.leaked_blocks += 1;
                }
                if r.problems.len() < 10_000 {
                    r.problems.push(format!(
                        "PBA {p}: reference count {rc}, mapped by {want} LBA(s){}",
                        if rc < want {
                            " (would be freed while in use)"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }
        r.referenced_blocks = counts.iter().filter(|&&c| c > 0).count() as u64;

        // fingerprints of referenced blocks
        let per_page = (PAYLOAD_SIZE / FINGERPRINT_SIZE) as u64;
        let mut new_fp: HashMap<u64, Fingerprint> = HashMap::new();
        let mut block = vec![0u8; BLOCK_SIZE];
        for p in 0..data_blocks {
            if counts[p as usize] == 0 {
                continue;
            }
            let stored = m.fingerprint_of(Pba(p));
            let damaged = fp_damaged_pages.contains(&(p / per_page));
            if opts.rehash || damaged || stored.0 == [0u8; FINGERPRINT_SIZE] {
                self.backend
                    .read_blocks(Pba(p), &mut block)
                    .map_err(|e| crate::error::EngineError::io(format!("reading PBA {p}"), e))?;
                r.blocks_rehashed += 1;
                let actual = self.hash.fingerprint(&block);
                if actual != stored {
                    // an all-zero entry is a block not fingerprinted yet
                    // (stored without inline dedup): filled in by a repair,
                    // not an error
                    if !damaged && stored != crate::engine::UNHASHED {
                        r.problems.push(format!(
                            "PBA {p}: stored fingerprint does not match its data"
                        ));
                    }
                    new_fp.insert(p, actual);
                }
            }
        }
        // equal fingerprints on two referenced PBAs: a duplicate copy that
        // inline dedup missed (memory-only lookups under a small budget) —
        // not an inconsistency; out-of-line dedup merges them
        // (keys sorted through a scratch file: memory stays about the
        // index budget whatever the store's size)
        let fp_of = |m: &crate::meta::Meta, p: u64| {
            new_fp
                .get(&p)
                .copied()
                .unwrap_or_else(|| m.fingerprint_of(Pba(p)))
        };
        let mut sorter = crate::keysort::KeySorter::new(
            r.referenced_blocks,
            m.index.config().memory_budget_bytes,
            16,
            self.dir.as_ref().and_then(|d| d.scratch_file()),
        );
        for p in 0..data_blocks {
            if counts[p as usize] > 0 {
                sorter.push(crate::index::key_of(&fp_of(&m, p)), p);
            }
        }
        sorter
            .for_each_sorted::<std::io::Error>(|pairs| {
                crate::keysort::for_each_equal_key_run(pairs, |run| {
                    let mut fps: Vec<Fingerprint> =
                        run.iter().map(|&(_, p)| fp_of(&m, p)).collect();
                    fps.sort_unstable();
                    r.duplicate_copies += fps.windows(2).filter(|w| w[0] == w[1]).count() as u64;
                });
                Ok(())
            })
            .map_err(|e| crate::error::EngineError::io("reading the scratch file back", e))?;

        if !opts.repair || r.problems.is_empty() {
            return Ok(r);
        }

        // repair: unmap entries outside the data file, rebuild counts and
        // fingerprints, make damaged volumes writable
        for (id, lba) in &outside {
            let v = m.volumes.get_mut(id).expect("listed above");
            v.map.set_u64(*lba, 0);
        }
        for (p, fp) in &new_fp {
            m.fingerprints.write(p * FINGERPRINT_SIZE as u64, &fp.0);
        }
        for p in 0..rc_len {
            let want = counts.get(p as usize).copied().unwrap_or(0);
            if m.refcounts.get_u32(p) != want {
                m.refcounts.set_u32(p, want);
            }
        }
        for page in &fp_damaged_pages {
            m.fingerprints.redirty(*page);
        }
        for d in self.damage.iter().filter(|d| d.file.ends_with("refcounts")) {
            for page in &d.pages {
                m.refcounts.redirty(*page);
            }
        }
        for id in &ids {
            let v = m.volumes.get_mut(id).expect("listed above");
            for page in std::mem::take(&mut v.damaged_pages) {
                v.map.redirty(page);
            }
        }
        let scratch = self.dir.as_ref().and_then(|d| d.scratch_file());
        m.rebuild_derived(data_blocks, crate::meta::IndexPairs::Scan(scratch))
            .map_err(|e| crate::error::EngineError::io("rebuilding the fingerprint store", e))?;
        m.change_count += 1;
        m.state_dirty = true;
        drop(m);
        self.flush()?;
        r.repaired = true;
        Ok(r)
    }
}
