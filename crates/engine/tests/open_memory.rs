//! Opening a store, and checking it with fsck, need memory for the
//! configured budgets, not for the store: the heap's peak while
//! `Engine::open` or `fsck` runs, measured by a counting allocator, stays
//! far below the size of the store's metadata.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dedupd_engine::block::Lba;
use dedupd_engine::engine::{Engine, EngineConfig};
use dedupd_engine::fingerprint::{Fingerprint, HashAlgorithm};
use dedupd_engine::index::{IndexConfig, LookupMode};

/// The system allocator, counting bytes in use and their peak.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only
// counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = IN_USE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The tests measure the one process-wide heap: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Blocks written as fingerprints only: the store's data file gets the
/// length (sparse) their data would have given it.
fn give_data_file_its_length(store: &std::path::Path, blocks: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(store.join("data"))
        .unwrap()
        .set_len(blocks * 4096)
        .unwrap();
}

fn fingerprint(k: u64) -> Fingerprint {
    let mut b = [0u8; 32];
    let mut x = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555;
    for c in b.chunks_mut(8) {
        x ^= x >> 29;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        c.copy_from_slice(&x.to_le_bytes());
    }
    Fingerprint(b)
}

#[test]
fn opening_a_store_needs_its_budgets_not_its_size() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const BLOCKS: u64 = 1172 * 256;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let cfg = EngineConfig {
        map_cache_bytes: 256 << 10,
        reverse_index_cache_bytes: 256 << 10,
        index: IndexConfig {
            memory_budget_bytes: 1 << 20,
            // inline lookups search the on-disk store too: every duplicate
            // is found, through the groups the open rebuilt
            lookup: LookupMode::Disk,
            ..IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, cfg.clone()).unwrap();
        let v = e.create_volume("v", BLOCKS * 4096).unwrap();
        // every block distinct; the data file stays sparse (fingerprints only)
        for first in (0..BLOCKS).step_by(256) {
            let fps: Vec<Option<Fingerprint>> =
                (first..first + 256).map(|k| Some(fingerprint(k))).collect();
            e.write_fingerprinted(v, Lba(first), &fps).unwrap();
            if first % (64 * 256) == 0 {
                e.flush().unwrap();
            }
        }
        e.close().unwrap();
    }
    give_data_file_its_length(&path, BLOCKS);
    // reverse index 32 B, map 8 B and reference count 4 B per block:
    // reading it whole would hold all of it at least once
    let metadata_bytes = BLOCKS as usize * (32 + 8 + 4);
    let before = IN_USE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let e = Engine::open(&path, cfg).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let s = e.stats();
    assert_eq!(s.physical_blocks_stored, BLOCKS);
    assert_eq!(s.index.entries_on_disk, BLOCKS);
    eprintln!(
        "open: heap peak {peak} bytes for {metadata_bytes} bytes of metadata ({:.2} B per stored block)",
        peak as f64 / BLOCKS as f64
    );
    assert!(
        peak < metadata_bytes / 3,
        "opening held {peak} bytes at its peak for {metadata_bytes} bytes of metadata"
    );
    // the rebuilt index finds old blocks: rewrite 64 of them elsewhere
    let (v, _) = e.volume("v").unwrap();
    let before = e.stats().duplicate_writes_eliminated;
    let fps: Vec<Option<Fingerprint>> = (0..64)
        .map(|i| Some(fingerprint(i * (BLOCKS / 64) + 7)))
        .collect();
    e.write_fingerprinted(v, Lba(BLOCKS - 64), &fps).unwrap();
    assert_eq!(e.stats().duplicate_writes_eliminated - before, 64);
}

/// Builds a store of `blocks` LBAs, block `k` with content `content(k)`
/// (fingerprints only; the data file made sparse at its length), then runs
/// fsck under 256 KiB caches and a 1 MiB index budget: its report and the
/// heap's peak during it, in bytes.
fn fsck_peak(
    blocks: u64,
    content: impl Fn(u64) -> u64,
) -> (dedupd_engine::fsck::FsckReport, usize) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    {
        let e = Engine::create(&path, HashAlgorithm::Sha256, EngineConfig::default()).unwrap();
        let v = e.create_volume("v", blocks * 4096).unwrap();
        for first in (0..blocks).step_by(256) {
            let fps: Vec<Option<Fingerprint>> = (first..first + 256)
                .map(|k| Some(fingerprint(content(k))))
                .collect();
            e.write_fingerprinted(v, Lba(first), &fps).unwrap();
        }
        e.close().unwrap();
    }
    give_data_file_its_length(&path, blocks);
    let before = IN_USE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let small = EngineConfig {
        map_cache_bytes: 256 << 10,
        reverse_index_cache_bytes: 256 << 10,
        index: IndexConfig {
            memory_budget_bytes: 1 << 20,
            ..IndexConfig::default()
        },
        ..EngineConfig::default()
    };
    let opts = dedupd_engine::fsck::FsckOptions::default();
    let r = dedupd_engine::fsck::fsck_with(&path, opts, small).unwrap();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    assert!(
        r.problems.is_empty(),
        "{:?}",
        &r.problems[..r.problems.len().min(5)]
    );
    (r, peak)
}

#[test]
fn fsck_needs_its_budgets_not_the_store_size() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // fsck counts references by sorting them through a scratch file, not
    // in a table of 4 bytes per PBA, and walks the maps without listing
    // them (16 bytes per mapped block)
    const BLOCKS: u64 = 4 * 1172 * 256;
    let (r, peak) = fsck_peak(BLOCKS, |k| k);
    assert_eq!((r.mapped_blocks, r.referenced_blocks), (BLOCKS, BLOCKS));
    // the map (8 B per block), reference counts (4 B), reverse index (32 B)
    let metadata_bytes = BLOCKS as usize * (8 + 4 + 32);
    eprintln!(
        "fsck: heap peak {peak} bytes for {metadata_bytes} bytes of metadata ({:.2} B per stored block)",
        peak as f64 / BLOCKS as f64
    );
    // the caches and the index budget bound it (the budget also bounds
    // the sorts)
    assert!(
        peak < metadata_bytes / 4,
        "fsck held {peak} bytes at its peak for {metadata_bytes} bytes of metadata"
    );
}

#[test]
fn fsck_memory_stays_bounded_when_one_block_is_shared_by_a_million_lbas() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // nine LBAs in ten map one block: fsck's reference count of that PBA
    // must not cost a sorted pair per LBA
    const BLOCKS: u64 = 4 * 1172 * 256;
    let (r, peak) = fsck_peak(BLOCKS, |k| if k % 10 == 0 { k } else { u64::MAX });
    assert_eq!(r.mapped_blocks, BLOCKS);
    assert_eq!(r.referenced_blocks, BLOCKS.div_ceil(10) + 1);
    eprintln!("fsck with a hot block: heap peak {peak} bytes for {BLOCKS} mapped blocks");
    // 16 bytes per reference to the hot block would be 17 MB
    assert!(
        peak < 8 << 20,
        "fsck held {peak} bytes at its peak for {BLOCKS} mapped blocks"
    );
}
