//! Conversion of any readable trace to the native format.

use std::io::BufWriter;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::{io_err, Result, TraceError};
use crate::native::NativeWriter;
use crate::output::OutputFile;
use crate::reader::{Format, TraceReader};
use crate::request::Request;

/// What a conversion did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConvertSummary {
    /// Requests written.
    pub requests: u64,
    /// Sources (pid, process, device) written.
    pub sources: u64,
    /// Malformed lines skipped (with `skip_bad`).
    pub bad_records_skipped: u64,
}

/// Reads `input` (format `format`, or detected) and writes it to `output`
/// in the native format, streaming. Per-sector FIU digests become per-block
/// digests as the reader derives them (see [`crate::text`]).
///
/// The output replaces `output` only once complete (a temporary file
/// beside it is renamed over it), so a failed conversion leaves an
/// existing file as it was.
///
/// Errors: `output` is the input (the same file, by device and inode, or
/// the same path: [`crate::output::check_destination`];
/// [`TraceError::Config`], before anything is read or written); reading
/// the input (as [`TraceReader::next_into`]) or writing the output fails,
/// or the input holds no request ([`TraceError::NoRequests`]; `output` is
/// then left as it was).
pub fn convert(
    input: &Path,
    format: Option<Format>,
    skip_bad: bool,
    output: &Path,
) -> Result<ConvertSummary> {
    convert_counting(input, format, skip_bad, output, Arc::new(AtomicU64::new(0)))
}

/// [`convert`], adding the bytes read from `input`'s file (compressed, if
/// it is) to `consumed` as it goes, for a progress display.
///
/// Errors: as [`convert`].
pub fn convert_counting(
    input: &Path,
    format: Option<Format>,
    skip_bad: bool,
    output: &Path,
    consumed: Arc<AtomicU64>,
) -> Result<ConvertSummary> {
    // (a trace converted onto itself would be lost if the conversion
    // were wrong; and a read-only input must stay as it is)
    crate::output::check_destination(output, &[input.to_path_buf()])?;
    let mut reader = TraceReader::open(input, format, skip_bad, consumed)?;
    let dest = OutputFile::create(output)?;
    let out_name = dest.name().to_string();
    let mut w = NativeWriter::new(BufWriter::with_capacity(256 * 1024, dest.file()?))
        .map_err(io_err(&out_name))?;
    let mut req = Request::default();
    let mut summary = ConvertSummary::default();
    // each source is defined before the first request that names it;
    // sources after the last request (a native input may hold some) too
    let mut live = true;
    while live {
        live = reader.next_into(&mut req)?;
        while summary.sources < reader.sources().len() as u64 {
            w.define_source(&reader.sources()[summary.sources as usize])
                .map_err(io_err(&out_name))?;
            summary.sources += 1;
        }
        if live {
            w.write(&req).map_err(io_err(&out_name))?;
            summary.requests += 1;
        }
    }
    if summary.requests == 0 {
        // (the temporary file goes with `dest`)
        return Err(TraceError::NoRequests {
            file: reader.name().to_string(),
            bad_records_skipped: reader.bad_records(),
        });
    }
    let out = w.finish().map_err(io_err(&out_name))?;
    out.into_inner()
        .map_err(|e| e.into_error())
        .map_err(io_err(&out_name))?;
    dest.commit()?;
    summary.bad_records_skipped = reader.bad_records();
    Ok(summary)
}
