//! The dedupd engine: a deduplicating block store with many volumes.
//!
//! Stores each distinct 4 KiB block once; volumes map LBAs to shared PBAs
//! with reference counts. No network code: front ends (the NBD server, the
//! trace replayer) call [`Engine`].
//!
//! Modules: [`block`] (addresses), [`fingerprint`] (hashes), [`paged`]
//! (dense metadata arrays), [`journal`] (write-ahead log), [`store`] (on-disk
//! layout), [`meta`] (in-memory metadata and invariants), [`backend`] (block
//! data), [`engine`] (the write and read paths), [`stats`] (figures).

#![deny(missing_docs)]

pub mod backend;
pub mod block;
pub mod cache;
pub mod caftl;
pub mod engine;
pub mod error;
pub mod fileio;
pub mod fingerprint;
pub mod freespace;
pub mod fsck;
pub mod index;
pub mod journal;
pub mod keysort;
pub mod load;
pub mod meta;
pub mod metaopen;
pub mod observe;
pub mod outofline;
pub mod pagecache;
pub mod paged;
pub mod prefetch;
pub mod reverse;
pub mod selectivity;
pub mod sequence;
pub mod skipped;
pub mod staterebuild;
pub mod stats;
pub mod store;

pub use block::{Lba, Pba, VolumeId, BLOCK_SIZE};
pub use engine::{Engine, EngineConfig, VolumeDeleted, VolumeInfo};
pub use error::{EngineError, Result};
pub use fingerprint::{Fingerprint, HashAlgorithm};
pub use stats::Stats;
