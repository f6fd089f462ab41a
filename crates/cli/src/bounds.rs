//! The memory bounds a store is opened with, shared by `dedupd serve` and
//! `dedupd fsck`: the fingerprint index budget and the page caches of the
//! reverse index, volume maps and reference counts.

use clap::Args;
use dedupd_engine::EngineConfig;

use crate::size::{parse_index_memory, parse_size};

/// Memory bounds (sizes with K/M/G suffixes).
#[derive(Args, Debug, Clone)]
pub struct MemoryBounds {
    /// Memory budget of the in-memory fingerprint store (SmartDedup §3.2),
    /// at least 4K; the server's is changeable at every start. fsck sorts
    /// within it (references by PBA, fingerprints), spilling to a scratch
    /// file in the store beyond it.
    #[arg(long, default_value = "8M", value_parser = parse_index_memory)]
    pub index_memory: u64,
    /// Bytes of the reverse index (PBA → fingerprint, 32 bytes per stored
    /// block) kept in memory; the rest is read from disk on demand (0: keep
    /// all of it).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub reverse_index_cache: u64,
    /// Bytes of volume-map and reference-count pages (8 bytes per LBA, 4
    /// per stored block) kept in memory, for all volumes together; the rest
    /// is read from disk on demand (0: keep all of them).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub map_cache: u64,
}

impl MemoryBounds {
    /// Puts the bounds into `config`.
    pub fn apply(&self, config: &mut EngineConfig) {
        config.index.memory_budget_bytes = self.index_memory;
        config.reverse_index_cache_bytes = self.reverse_index_cache;
        config.map_cache_bytes = self.map_cache;
    }
}
