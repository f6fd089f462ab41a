//! Seeded synthetic trace generators (`dedupd trace gen`), writing the
//! native format. The same [`GenSpec`] (seed included) always produces the
//! same bytes: randomness comes only from a ChaCha8 generator seeded with
//! [`GenSpec::seed`].
//!
//! Content model: every written block either repeats an earlier block's
//! digest (with probability `dup_percent`) or gets a fresh random digest.
//! Which earlier block is repeated depends on the stream's [`Locality`]:
//! - [`Locality::Uniform`] (kind `fio`): any earlier distinct content,
//!   uniformly, like fio's `dedupe_percentage`;
//! - [`Locality::Good`]: the block written `d` writes ago, `d` geometric
//!   with the given mean — short, skewed reuse distances (FIU mail/web in
//!   HPDedup §II-B, Fig. 1);
//! - [`Locality::Weak`]: the block written `d` writes ago, `d` uniform over
//!   the whole history (up to [`HISTORY_BLOCKS`]) — long reuse distances
//!   (Cloud-FTP in Fig. 1).
//!
//! Mixes interleave several streams, each with its own pid, process name
//! and content: each request goes to a stream drawn with probability
//! proportional to its share, and time advances by an exponential
//! inter-arrival (mean 100 µs), so the output is ordered by time stamp.
//! HPDedup §V's workloads A, B and C mix good- and weak-locality streams at
//! data-size ratios 3:1, 1:1 and 1:3 ([`workload`]).

use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{io_err, Result, TraceError};
use crate::native::NativeWriter;
use crate::request::{Digest, Op, Request, Source, SECTORS_PER_BLOCK};

/// Blocks of history a stream keeps for choosing what to repeat (16 bytes
/// each: 16 MiB per stream at most).
pub const HISTORY_BLOCKS: usize = 1 << 20;
/// Mean time between requests in nanoseconds.
const MEAN_INTERARRIVAL_NS: f64 = 100_000.0;

/// How a stream picks the earlier content it repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Locality {
    /// Any earlier distinct content, uniformly (fio-like).
    Uniform,
    /// Reuse distance geometric with this mean, in written blocks.
    Good {
        /// Mean reuse distance in written blocks (≥ 1).
        mean_reuse_blocks: f64,
    },
    /// Reuse distance uniform over the whole history.
    Weak,
}

/// One stream of a generated trace.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    /// How it repeats content.
    pub locality: Locality,
    /// Relative share of the requests (and so of the data written).
    pub share: u32,
    /// Process name recorded for it.
    pub name: String,
}

/// Parameters of a generated trace. Sizes in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct GenSpec {
    /// Streams (at least one).
    pub streams: Vec<StreamSpec>,
    /// Bytes written in total, positive: rounded up to whole requests
    /// (`size_bytes.div_ceil(block_bytes)` requests, so at least one: 10 KiB
    /// of 4 KiB requests is 3, 4 KiB of 8 KiB requests is 1).
    pub size_bytes: u64,
    /// Bytes per request: a positive multiple of 4096.
    pub block_bytes: u64,
    /// Address space of each stream in bytes (a multiple of `block_bytes`).
    pub volume_bytes: u64,
    /// Sequential (wrapping) addresses instead of uniformly random ones.
    pub sequential: bool,
    /// Percentage (0–100) of blocks that repeat earlier content.
    pub dup_percent: f64,
    /// Consecutive duplicate blocks of a request repeat consecutive earlier
    /// writes (a copy of an earlier run, as copying a file makes) instead of
    /// each drawing its own reuse distance. Applies to good- and
    /// weak-locality streams; what the sequence threshold acts on.
    pub copy_runs: bool,
    /// Seed of the random generator.
    pub seed: u64,
}

/// The streams of HPDedup §V workload `A`, `B` or `C`: a good- and a
/// weak-locality stream at shares 3:1, 1:1 or 1:3. `mean_reuse_blocks` is
/// the good stream's mean reuse distance.
///
/// Errors: [`TraceError::Config`] for another letter.
pub fn workload(letter: &str, mean_reuse_blocks: f64) -> Result<Vec<StreamSpec>> {
    let (good, weak) = match letter {
        "A" | "a" => (3, 1),
        "B" | "b" => (1, 1),
        "C" | "c" => (1, 3),
        _ => {
            return Err(TraceError::Config(format!(
                "unknown workload {letter:?} (A, B or C)"
            )))
        }
    };
    Ok(vec![
        StreamSpec {
            locality: Locality::Good { mean_reuse_blocks },
            share: good,
            name: "good".into(),
        },
        StreamSpec {
            locality: Locality::Weak,
            share: weak,
            name: "weak".into(),
        },
    ])
}

/// Parses a stream list like `good:3,weak:1` (or `uniform:1`); `good` uses
/// `mean_reuse_blocks`. Names get the stream's index appended.
///
/// Errors: [`TraceError::Config`] for a malformed list.
pub fn parse_streams(list: &str, mean_reuse_blocks: f64) -> Result<Vec<StreamSpec>> {
    let mut out = Vec::new();
    for (i, item) in list.split(',').enumerate() {
        let (kind, share) = item.split_once(':').unwrap_or((item, "1"));
        let share: u32 = share
            .trim()
            .parse()
            .map_err(|_| TraceError::Config(format!("bad share in stream {item:?}")))?;
        let locality = match kind.trim() {
            "good" => Locality::Good { mean_reuse_blocks },
            "weak" => Locality::Weak,
            "uniform" | "fio" => Locality::Uniform,
            k => {
                return Err(TraceError::Config(format!(
                    "unknown stream kind {k:?} (good, weak, uniform)"
                )))
            }
        };
        out.push(StreamSpec {
            locality,
            share,
            name: format!("{}{i}", kind.trim()),
        });
    }
    Ok(out)
}

struct StreamState {
    history: Vec<Digest>,
    next: usize,
    full: bool,
    seq_block: u64,
}

impl StreamState {
    fn len(&self) -> usize {
        if self.full {
            HISTORY_BLOCKS
        } else {
            self.next
        }
    }
    /// The digest written `d` blocks ago (1 = the last one).
    fn ago(&self, d: usize) -> Digest {
        let i = (self.next + HISTORY_BLOCKS - d) % HISTORY_BLOCKS;
        self.history[i]
    }
    fn push(&mut self, x: Digest) {
        if self.history.len() < HISTORY_BLOCKS {
            self.history.push(x);
        } else {
            self.history[self.next] = x;
        }
        self.next = (self.next + 1) % HISTORY_BLOCKS;
        if self.next == 0 {
            self.full = true;
        }
    }
}

/// Largest request a generator makes: 32 MiB, the largest NBD request
/// dedupd serves (8192 pages, 139 KiB of digests in one record).
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;

fn check(spec: &GenSpec) -> Result<()> {
    let bad = |m: &str| Err(TraceError::Config(m.to_string()));
    if spec.streams.is_empty() || spec.streams.iter().all(|s| s.share == 0) {
        return bad("a generated trace needs at least one stream with a positive share");
    }
    if spec.block_bytes == 0 || !spec.block_bytes.is_multiple_of(4096) {
        return bad("request size must be a positive multiple of 4096 bytes");
    }
    // (a request's digests are held at once and written as one record of
    // a native chunk: 17 bytes per 4 KiB page)
    if spec.block_bytes > MAX_REQUEST_BYTES {
        return bad("request size must be at most 32M (--bs)");
    }
    if spec.volume_bytes < spec.block_bytes || !spec.volume_bytes.is_multiple_of(spec.block_bytes) {
        return bad("volume size must be a positive multiple of the request size");
    }
    // (the replay's volume limit: a larger one makes a trace no replay takes)
    if spec.volume_bytes > 1 << 50 {
        return bad("volume size must be at most 1P (a replayed volume's limit)");
    }
    // (any other size is rounded up to whole requests)
    if spec.size_bytes == 0 {
        return bad("size must be positive");
    }
    if !(0.0..=100.0).contains(&spec.dup_percent) {
        return bad("duplicate percentage must be within 0–100");
    }
    for s in &spec.streams {
        if let Locality::Good { mean_reuse_blocks } = s.locality {
            if !mean_reuse_blocks.is_finite() || mean_reuse_blocks < 1.0 {
                return bad("mean reuse distance must be a finite number of blocks, at least 1");
            }
        }
    }
    Ok(())
}

/// Writes the trace described by `spec` to `out` in the native format.
/// Returns the number of requests.
///
/// Errors: [`TraceError::Config`] for inconsistent parameters; I/O errors
/// of `out` (reported against `name`).
pub fn generate_to<W: Write>(spec: &GenSpec, out: W, name: &str) -> Result<u64> {
    generate_counting(spec, out, name, &AtomicU64::new(0))
}

/// [`generate_to`] adding the bytes of the requests it has generated to
/// `generated_bytes` as it goes (every 4096 requests, and at the end).
fn generate_counting<W: Write>(
    spec: &GenSpec,
    out: W,
    name: &str,
    generated_bytes: &AtomicU64,
) -> Result<u64> {
    check(spec)?;
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut w = NativeWriter::new(out).map_err(io_err(name))?;
    for (i, s) in spec.streams.iter().enumerate() {
        w.define_source(&Source {
            pid: 1000 + i as u32,
            process: s.name.clone(),
            device: 0,
        })
        .map_err(io_err(name))?;
    }
    let total_share: u64 = spec.streams.iter().map(|s| s.share as u64).sum();
    let blocks_per_req = spec.block_bytes / 4096;
    let slots = spec.volume_bytes / spec.block_bytes;
    let requests = spec.size_bytes.div_ceil(spec.block_bytes);
    let mut states: Vec<StreamState> = spec
        .streams
        .iter()
        .map(|_| StreamState {
            history: Vec::new(),
            next: 0,
            full: false,
            seq_block: 0,
        })
        .collect();
    let mut req = Request {
        op: Some(Op::Write),
        sectors: blocks_per_req * SECTORS_PER_BLOCK,
        ..Request::default()
    };
    let mut ts: u64 = 0;
    let dup_p = spec.dup_percent / 100.0;
    for i in 0..requests {
        if i % 4096 == 0 && i > 0 {
            generated_bytes.fetch_add(4096 * spec.block_bytes, Ordering::Relaxed);
        }
        // which stream
        let mut x = rng.random_range(0..total_share);
        let mut si = 0;
        while x >= spec.streams[si].share as u64 {
            x -= spec.streams[si].share as u64;
            si += 1;
        }
        let u: f64 = rng.random();
        ts += (-(1.0 - u).ln() * MEAN_INTERARRIVAL_NS) as u64 + 1;
        let st = &mut states[si];
        let slot = if spec.sequential {
            let s = st.seq_block;
            st.seq_block = (st.seq_block + 1) % slots;
            s
        } else {
            rng.random_range(0..slots)
        };
        req.ts_ns = ts;
        req.source = si as u32;
        req.lba_sectors = slot * blocks_per_req * SECTORS_PER_BLOCK;
        req.blocks.clear();
        let bpr = blocks_per_req as usize;
        if spec.streams[si].locality == Locality::Uniform && bpr > 1 {
            // fio-like: the request's whole buffer repeats an earlier
            // distinct one, chosen uniformly, or is new (fio's
            // dedupe_percentage repeats whole buffers of --bs too, in its
            // default mode the latest new one); the history holds distinct requests
            // back to back, so request r from the newest starts (r + 1) ×
            // bpr blocks back
            let whole = st.len() / bpr;
            if whole > 0 && rng.random_bool(dup_p) {
                let start = (rng.random_range(0..whole) + 1) * bpr;
                for j in 0..bpr {
                    req.blocks.push(Some(st.ago(start - j)));
                }
            } else {
                for _ in 0..bpr {
                    let mut d = [0u8; 16];
                    rng.fill_bytes(&mut d);
                    st.push(d);
                    req.blocks.push(Some(d));
                }
            }
            w.write(&req).map_err(io_err(name))?;
            continue;
        }
        let mut run_dist: Option<usize> = None;
        for _ in 0..blocks_per_req {
            let n = st.len();
            let repeat = n > 0 && rng.random_bool(dup_p);
            let d = if repeat {
                let copying = spec.copy_runs && spec.streams[si].locality != Locality::Uniform;
                let dist = match (run_dist.filter(|_| copying), spec.streams[si].locality) {
                    // the same distance again: the write after the one
                    // the previous block repeated
                    (Some(d), _) => d.min(n),
                    (None, Locality::Uniform | Locality::Weak) => rng.random_range(1..=n),
                    (None, Locality::Good { mean_reuse_blocks }) => {
                        // geometric on {1, 2, …} with p = 1/m (mean m),
                        // truncated to the n writes of the history: drawn
                        // by inverting the truncated distribution, so a
                        // distance past the history is never clamped onto
                        // its first write (which would pile the copies of
                        // a young trace onto one block)
                        let p = 1.0 / mean_reuse_blocks;
                        let u: f64 = rng.random();
                        let k = if p >= 1.0 {
                            1.0
                        } else {
                            // q = ln(1 − p); within = 1 − (1 − p)^n, the
                            // chance of a distance within the history;
                            // k = ⌊ln(1 − u·within) / q⌋ + 1. With
                            // ln_1p/exp_m1 a huge mean (p near 0) keeps
                            // its precision: the distances tend to uniform
                            // over the history instead of collapsing to 1
                            let q = (-p).ln_1p();
                            let within = -(n as f64 * q).exp_m1();
                            ((-u * within).ln_1p() / q).floor() + 1.0
                        };
                        (k as usize).clamp(1, n)
                    }
                };
                run_dist = Some(dist);
                st.ago(dist)
            } else {
                run_dist = None;
                let mut d = [0u8; 16];
                rng.fill_bytes(&mut d);
                d
            };
            // fio-like streams remember only distinct content, so every
            // earlier distinct block is equally likely to repeat; the others
            // remember every write, so distances count writes
            if !repeat || spec.streams[si].locality != Locality::Uniform {
                st.push(d);
            }
            req.blocks.push(Some(d));
        }
        w.write(&req).map_err(io_err(name))?;
    }
    let mut out = w.finish().map_err(io_err(name))?;
    out.flush().map_err(io_err(name))?;
    // (the requests since the last 4096 counted)
    let counted = requests.saturating_sub(1) / 4096 * 4096;
    generated_bytes.fetch_add((requests - counted) * spec.block_bytes, Ordering::Relaxed);
    Ok(requests)
}

/// Writes the trace described by `spec` to the file `path` (see
/// [`generate_to`]).
///
/// Errors: as [`generate_to`], or the file cannot be created.
pub fn generate(spec: &GenSpec, path: &Path) -> Result<u64> {
    generate_with_progress(spec, path, &AtomicU64::new(0))
}

/// [`generate`] adding the bytes of the requests generated so far to
/// `generated_bytes` (of `spec.size_bytes` in all), for a progress bar.
///
/// Errors: as [`generate`].
pub fn generate_with_progress(
    spec: &GenSpec,
    path: &Path,
    generated_bytes: &AtomicU64,
) -> Result<u64> {
    // (an existing file is replaced only by a complete trace)
    let dest = crate::output::OutputFile::create(path)?;
    let name = dest.name().to_string();
    let n = generate_counting(
        spec,
        BufWriter::with_capacity(256 * 1024, dest.file()?),
        &name,
        generated_bytes,
    )?;
    dest.commit()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mean_reuse_blocks: f64) -> GenSpec {
        GenSpec {
            streams: vec![StreamSpec {
                locality: Locality::Good { mean_reuse_blocks },
                share: 1,
                name: "good".into(),
            }],
            size_bytes: 2000 * 4096,
            block_bytes: 4096,
            volume_bytes: 1 << 30,
            sequential: false,
            dup_percent: 50.0,
            copy_runs: false,
            seed: 3,
        }
    }

    #[test]
    fn size_is_rounded_up_to_whole_requests() {
        for (size, bs, requests) in [
            (10 << 10, 4 << 10, 3),
            (100 << 10, 64 << 10, 2),
            (4 << 10, 8 << 10, 1),
            (1, 32 << 20, 1),
            (8 << 10, 8 << 10, 1),
        ] {
            let s = GenSpec {
                size_bytes: size,
                block_bytes: bs,
                ..spec(64.0)
            };
            let n = generate_to(&s, Vec::new(), "t").unwrap();
            assert_eq!(n, requests, "{size} bytes of {bs}-byte requests");
        }
        let s = GenSpec {
            size_bytes: 0,
            ..spec(64.0)
        };
        let e = generate_to(&s, Vec::new(), "t").unwrap_err();
        assert!(e.to_string().contains("size must be positive"), "{e}");
    }

    #[test]
    fn progress_counts_every_generated_request_once() {
        for requests in [0u64, 1, 4095, 4096, 4097, 10_000] {
            let s = GenSpec {
                size_bytes: requests * 4096,
                ..spec(64.0)
            };
            let done = AtomicU64::new(0);
            if requests == 0 {
                assert!(generate_counting(&s, Vec::new(), "t", &done).is_err());
                continue;
            }
            let n = generate_counting(&s, Vec::new(), "t", &done).unwrap();
            assert_eq!(n, requests);
            assert_eq!(done.load(Ordering::Relaxed), requests * 4096);
        }
    }

    /// The blocks of each request of the trace `spec` generates.
    fn requests_of(spec: &GenSpec) -> Vec<Vec<Digest>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.ddt");
        generate(spec, &path).unwrap();
        let mut r = crate::reader::TraceReader::open(
            &path,
            None,
            false,
            std::sync::Arc::new(AtomicU64::new(0)),
        )
        .unwrap();
        let mut out = Vec::new();
        let mut req = crate::Request::default();
        while r.next_into(&mut req).unwrap() {
            out.push(req.blocks.iter().map(|b| b.unwrap()).collect());
        }
        out
    }

    /// Copies per content of the trace `spec` generates, most first, and
    /// the share of duplicates whose content was the write just before.
    fn copies_per_content(spec: &GenSpec) -> (Vec<u64>, f64) {
        let mut counts = std::collections::HashMap::new();
        let mut last = std::collections::HashMap::new();
        let (mut at, mut dups, mut adjacent) = (0u64, 0u64, 0u64);
        for req in requests_of(spec) {
            for d in &req {
                *counts.entry(*d).or_insert(0u64) += 1;
                if let Some(prev) = last.insert(*d, at) {
                    dups += 1;
                    adjacent += u64::from(at - prev == 1);
                }
                at += 1;
            }
        }
        let mut v: Vec<u64> = counts.into_values().collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        (v, adjacent as f64 / dups.max(1) as f64)
    }

    #[test]
    fn long_reuse_distances_do_not_pile_copies_on_the_first_block() {
        // a mean far past the trace's length: every distance is truncated
        // to the history, spread over it, not set to its first write
        for mean in [10_000.0, 1e9, 1e17, 1e300] {
            let s = GenSpec {
                size_bytes: 20_000 * 4096,
                ..spec(mean)
            };
            let (copies, adjacent) = copies_per_content(&s);
            // nor collapse onto the write just before (a huge mean lost
            // its precision that way)
            assert!(
                adjacent < 0.05,
                "mean {mean}: {adjacent} of duplicates at distance 1"
            );
            let duplicates: u64 = copies.iter().map(|c| c - 1).sum();
            assert!(duplicates > 9_000, "{duplicates}");
            // (copies are copied too, so early content gathers copies as in
            // a Yule–Simon process: about √(20 000) ≈ 150 for the most
            // copied, as with uniform distances; clamped onto the first
            // write it took 30 % of the duplicates at a mean of 10 000,
            // all of them at 10^9)
            assert!(
                copies[0] < 500,
                "mean {mean}: one content has {} copies of {duplicates} duplicates",
                copies[0]
            );
        }
    }

    #[test]
    fn fio_like_requests_repeat_whole_earlier_buffers() {
        let s = GenSpec {
            streams: vec![StreamSpec {
                locality: Locality::Uniform,
                share: 1,
                name: "fio".into(),
            }],
            size_bytes: 2000 * 65536,
            block_bytes: 65536,
            dup_percent: 40.0,
            ..spec(64.0)
        };
        let mut seen_buffers = std::collections::HashSet::new();
        let mut seen_blocks = std::collections::HashSet::new();
        let (mut requests, mut repeats) = (0u32, 0u32);
        for blocks in requests_of(&s) {
            assert_eq!(blocks.len(), 16);
            requests += 1;
            if seen_buffers.contains(&blocks) {
                repeats += 1;
            } else {
                // a buffer not seen whole is new block by block
                assert!(blocks.iter().all(|b| seen_blocks.insert(*b)));
                seen_buffers.insert(blocks);
            }
        }
        assert_eq!(requests, 2000);
        let pct = f64::from(repeats) * 100.0 / f64::from(requests);
        assert!((35.0..45.0).contains(&pct), "{pct} % of buffers repeated");
    }

    #[test]
    fn a_huge_mean_reuse_distance_generates_and_an_infinite_one_is_refused() {
        // 1 − 1/m rounds to 1: distances are uniform over the history (it
        // panicked reading past the history before)
        for m in [1e17, 1e300] {
            let mut out = Vec::new();
            assert_eq!(generate_to(&spec(m), &mut out, "t").unwrap(), 2000);
        }
        for m in [f64::INFINITY, f64::NAN, 0.5] {
            let err = generate_to(&spec(m), Vec::new(), "t").unwrap_err();
            assert!(err.to_string().contains("mean reuse distance"), "{err}");
        }
    }
}
