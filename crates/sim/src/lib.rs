//! Block-trace tools for dedupd: trace formats, generators and replay
//! through the real engine.
//!
//! - [`request`]: the common request shape (sectors, 4 KiB blocks, digests);
//! - [`text`]: FIU IODedup and MobileAppTraces parsers;
//! - [`native`]: the native binary format (docs/trace-format.md);
//! - [`input`]: gzip/zstd detection; [`reader`]: one reader for all formats;
//! - [`replay`](mod@replay): multi-stream replay into a simulated engine, the report,
//!   index policies and write-path filters;
//! - [`sweep`]: grids of (trace, policy, budget) on all cores; [`plot`]:
//!   their figures;
//! - [`stats`]: figures of a trace alone; [`convert`](mod@convert): to the native format;
//! - [`gen`]: seeded fio-like, locality and mixed-stream generators.
//!
//! User documentation: docs/replay.md.

#![deny(missing_docs)]

pub mod convert;
mod digest_set;
pub mod error;
pub mod gen;
pub mod input;
pub mod native;
pub mod output;
pub mod plot;
pub mod reader;
pub mod replay;
pub mod request;
pub mod stats;
pub mod sweep;
pub mod text;

pub use convert::{convert, convert_counting, ConvertSummary};
pub use error::{Result, TraceError};
pub use gen::{generate, generate_to, generate_with_progress, GenSpec, Locality, StreamSpec};
pub use reader::{detect_format, Format, TraceReader};
pub use replay::{
    build_engine, replay, Filters, PolicySpec, Progress, ReplayConfig, Report, StreamBy,
};
pub use request::{Digest, Op, Request, Source};
pub use stats::{trace_stats, trace_stats_counting, TraceStats};
pub use sweep::{run_sweep, run_sweep_with_progress, SweepConfig, SweepRow};
