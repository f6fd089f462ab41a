//! Figures reported by `dedupd stats`, each with its unit and definition.

use serde::{Deserialize, Serialize};

/// A snapshot of the engine's figures. Definitions (also in docs/stats.md):
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Number of volumes.
    pub volumes: u64,
    /// Volumes whose map could not be trusted when the store was opened (a
    /// page failing its checksum, a map missing or cut short): served
    /// read-only until `dedupd fsck --repair` rebuilds them. Volumes being
    /// deleted are not counted.
    #[serde(default)]
    pub volumes_damaged: u64,
    /// Sum of volume sizes in bytes (what clients see; may exceed physical space).
    pub provisioned_bytes: u64,
    /// Bytes of all volumes that map to stored data: mapped LBAs × 4096.
    /// Unmapped and zero blocks are not counted.
    pub logical_bytes_mapped: u64,
    /// Distinct blocks stored (PBAs with reference count > 0).
    pub physical_blocks_stored: u64,
    /// `physical_blocks_stored` × 4096.
    pub physical_bytes_stored: u64,
    /// Length of the data file in bytes (stored blocks plus free holes).
    pub data_file_bytes: u64,
    /// Free PBAs below the data file's end, reusable for new data.
    pub free_blocks: u64,
    /// Blocks released (by overwrites, TRIM, deletes, out-of-line dedup)
    /// and not reusable yet: those released since the last commit, and,
    /// in a store, those the last commit released, which wait for one more
    /// commit or a checkpoint (so that damage to the journal's last
    /// transaction cannot leave maps pointing at reused blocks). Once
    /// they pass `--max-pending-free` bytes, the next write commits.
    #[serde(default)]
    pub pending_free_blocks: u64,
    /// Commits a write forced because the file system was full while
    /// released blocks waited for a commit; the write then reused them
    /// (since the engine started).
    #[serde(default)]
    pub no_space_commits: u64,
    /// 4 KiB blocks written by clients since the store was created (zero blocks included).
    pub blocks_written: u64,
    /// Written blocks that were all zeros: unmapped, never stored, read back as zeros.
    pub zero_blocks_written: u64,
    /// Duplicate writes eliminated: written non-zero blocks whose content was
    /// already stored, so nothing was written to the data file.
    pub duplicate_writes_eliminated: u64,
    /// `duplicate_writes_eliminated` as a percentage of `blocks_written`
    /// (the figure the dedup papers report).
    pub duplicate_writes_eliminated_percent: f64,
    /// Blocks discarded by TRIM or WRITE_ZEROES since creation.
    pub blocks_trimmed: u64,
    /// Comparisons (verify on) that found a block's bytes differing from
    /// a stored block with its fingerprint, on the write path (the block
    /// was stored separately) and in the out-of-line passes (the copies
    /// stay apart); a pair compared again counts again.
    pub verify_mismatches: u64,
    /// Fingerprint lookups and inserts the on-disk fingerprint store failed
    /// (read or write errors), since the store was created: each block
    /// concerned was stored as a copy of its own (out-of-line dedup or
    /// fsck finds its duplicates).
    pub index_errors: u64,
    /// Stored copies out-of-line dedup freed by remapping their LBAs onto
    /// another copy of the same content (writes inline dedup missed; LBAs
    /// that shared a copy count as inline duplicates), in blocks, since the
    /// store was created (SmartDedup §3.3).
    pub out_of_line_duplicates: u64,
    /// Duplicate blocks written as new because their run of duplicates was
    /// shorter than the sequence threshold T (iDedup; SmartDedup §4.5).
    pub sequence_filtered_blocks: u64,
    /// Blocks fingerprinted and looked up in the write path since the
    /// engine started (the hashing inline dedup paid for).
    pub blocks_fingerprinted_inline: u64,
    /// CAFTL's pre-hashing and sampling: table size, CRCs computed, blocks
    /// turned away (since the engine started).
    pub caftl: crate::caftl::CaftlStats,
    /// Out-of-line passes since the engine started: blocks examined,
    /// remapped, merges, and their CPU cost per block.
    pub out_of_line: crate::outofline::OutOfLineStats,
    /// The reverse index's page cache: budget, resident bytes, pages loaded
    /// back and evicted.
    pub reverse_index: crate::reverse::ReverseIndexStats,
    /// The page cache of the volume maps and reference counts (one budget,
    /// `--map-cache`): budget, resident bytes, pinned pages, pages loaded
    /// back and evicted, and pages that could not be read back (any makes
    /// the store read-only until restarted).
    #[serde(default)]
    pub map_cache: crate::pagecache::PageCacheStats,
    /// Checkpoints at which the skipped buffer could not be saved (its
    /// records since the previous save are lost on a crash; a full pass
    /// finds those duplicates).
    pub skipped_save_errors: u64,
    /// The skipped buffer: records, regions and volumes pending out-of-line dedup.
    pub skipped: crate::skipped::SkippedStats,
    /// Duplicate copies waiting for a map scan to merge them.
    pub pending_merges: u64,
    /// The read cache keyed by PBA: capacity, use, hits and misses.
    pub read_cache: crate::cache::ReadCacheStats,
    /// Inline selectivity now and its factors (duplication level, load, power).
    pub selectivity: crate::selectivity::SelectivityStats,
    /// Dedup ratio: `logical_bytes_mapped` ÷ `physical_bytes_stored`, as VDO
    /// and ZFS report it (1.0 when nothing is stored).
    pub dedup_ratio: f64,
    /// Space savings: 100 × (1 − physical ÷ logical), in percent (0 when nothing is mapped).
    pub space_savings_percent: f64,
    /// Bytes allocated on disk by metadata files (journal, maps, reference
    /// counts, fingerprints, state).
    pub metadata_bytes_on_disk: u64,
    /// Bytes of the journal in use since the last checkpoint.
    pub journal_bytes: u64,
    /// Bytes of journal transactions written since the engine started. An
    /// engine without a journal (in memory, as in a replay) counts what a
    /// store's journal would have received for the same commits: page
    /// images and patches as a store logs them, the state, a checkpoint
    /// modelled whenever a store's would happen.
    #[serde(default)]
    pub journal_bytes_written: u64,
    /// Bytes the checkpoints since the engine started wrote in place
    /// (metadata pages and state); modelled likewise without a journal.
    #[serde(default)]
    pub checkpoint_bytes_written: u64,
    /// Fingerprints in the index, in memory and on disk (the on-disk count
    /// may include stale entries awaiting a rewrite).
    pub index_entries: u64,
    /// Bytes of memory held by the fingerprint index: in-memory groups
    /// (bounded by the budget) plus the prefix tree.
    pub index_bytes_in_memory: u64,
    /// The two-level fingerprint store in detail (SmartDedup §3.2).
    pub index: crate::index::IndexStats,
    /// Bytes of memory held by the metadata arrays (maps, reference counts,
    /// reverse index) and free lists.
    pub metadata_bytes_in_memory: u64,
    /// Bytes held for the checkpoint (committed page images not yet written in place).
    pub checkpoint_buffer_bytes: u64,
    /// Peak resident set size of the process in bytes (VmHWM).
    pub peak_rss_bytes: u64,
    /// Current resident set size of the process in bytes (VmRSS).
    pub rss_bytes: u64,
}

/// Reads a `kB` field of `/proc/self/status`, in bytes; 0 if unavailable.
pub fn proc_status_bytes(field: &str) -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
