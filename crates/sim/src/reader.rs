//! One reader for every trace format: detection, decompression, line
//! numbers in errors, and skipping of malformed lines.

use std::io::{BufRead, Read};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::{io_err, io_err_at_line, Result, TraceError};
use crate::input;
use crate::native::{NativeReader, MAGIC};
use crate::request::{Request, Source};
use crate::text::{parse_fiu, parse_mobile, Layout, SourceTable, TextFormat};

/// Longest text line accepted, in bytes (without its newline): a longer
/// one is a bad line (so a file without newlines cannot exhaust memory).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Reads and drops the rest of a line (through its newline, or to the end
/// of the input), a buffer at a time.
fn skip_rest_of_line(input: &mut dyn BufRead) -> std::io::Result<()> {
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&c| c == b'\n') {
            Some(i) => {
                input.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                input.consume(n);
            }
        }
    }
}

/// A trace format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// FIU IODedup text (see [`crate::text`]).
    Fiu,
    /// MobileAppTraces text (see [`crate::text`]).
    Mobile,
    /// The native binary format (see [`crate::native`]).
    Native,
}

impl Format {
    /// The name [`Format`]'s `FromStr` parses (`fiu`, `mobile`, `native`).
    pub fn name(self) -> &'static str {
        match self {
            Format::Fiu => "fiu",
            Format::Mobile => "mobile",
            Format::Native => "native",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    /// Parses `fiu`, `mobile` or `native`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fiu" => Ok(Format::Fiu),
            "mobile" => Ok(Format::Mobile),
            "native" => Ok(Format::Native),
            _ => Err(format!(
                "unknown trace format {s:?} (fiu, mobile, native, auto)"
            )),
        }
    }
}

/// Detects the format from the first (decompressed) bytes: the native
/// magic (or, for a file shorter than it, the start of the magic: a cut
/// native trace), else a tab in the first record line (empty lines and `#`
/// comments, which the readers skip, skipped here too) means
/// MobileAppTraces, else FIU.
pub fn detect_format(head: &[u8]) -> Format {
    if head.starts_with(&MAGIC) || (!head.is_empty() && MAGIC.starts_with(head)) {
        return Format::Native;
    }
    let first = head
        .split(|&c| c == b'\n')
        .map(|l| l.trim_ascii())
        .find(|l| !l.is_empty() && l[0] != b'#')
        .unwrap_or(&[]);
    // MobileAppTraces: 6 or 7 tab-separated fields (an FIU line has 9 or
    // more, whatever separates them)
    let tab_fields = first.split(|&c| c == b'\t').count();
    if (6..=7).contains(&tab_fields) {
        Format::Mobile
    } else {
        Format::Fiu
    }
}

/// True if the first record line of `head` (its first 4 KiB) holds no
/// control characters other than tab and carriage return. (Not a UTF-8
/// check: process names cut at 15 bytes may split a character.)
fn looks_like_text(head: &[u8]) -> bool {
    let first = head
        .split(|&c| c == b'\n')
        .find(|l| !l.trim_ascii().is_empty() && l.trim_ascii()[0] != b'#')
        .unwrap_or(&[]);
    first[..first.len().min(4096)]
        .iter()
        .all(|&c| c >= 0x20 || c == b'\t' || c == b'\r')
}

/// Most bytes read to find the first record line for [`detect_format`].
const DETECT_CAP_BYTES: usize = 2 * MAX_LINE_BYTES;

/// True once `head` decides [`detect_format`]: it starts with the native
/// magic, or holds a whole first record line.
fn format_decidable(head: &[u8]) -> bool {
    if head.len() >= MAGIC.len() && head.starts_with(&MAGIC) {
        return true;
    }
    if head.len() < MAGIC.len() && MAGIC.starts_with(head) {
        return false;
    }
    head.split_inclusive(|&c| c == b'\n')
        .take_while(|l| l.ends_with(b"\n"))
        .map(|l| l.trim_ascii())
        .any(|l| !l.is_empty() && l[0] != b'#')
}

enum Inner {
    Text {
        input: Box<dyn BufRead>,
        format: TextFormat,
        line: Vec<u8>,
        line_no: u64,
        sources: SourceTable,
        layout: Layout,
    },
    Native(NativeReader),
}

/// A trace being read request by request (streaming: memory does not grow
/// with the trace, apart from its table of sources).
pub struct TraceReader {
    name: String,
    format: Format,
    skip_bad: bool,
    bad: u64,
    inner: Inner,
}

impl TraceReader {
    /// Opens `path` in `format` (`None`: detect), decompressing gzip/zstd.
    /// Bytes read from the file are added to `consumed` (for progress).
    /// With `skip_bad`, malformed text lines are counted
    /// ([`TraceReader::bad_records`]) instead of failing.
    ///
    /// Errors: the file cannot be opened, a native header is bad, or a
    /// text format is named for a native trace
    /// ([`TraceError::NativeAsText`]).
    pub fn open(
        path: &Path,
        format: Option<Format>,
        skip_bad: bool,
        consumed: Arc<AtomicU64>,
    ) -> Result<Self> {
        let name = path.display().to_string();
        let (input, _) = input::open(path, consumed).map_err(io_err(&name))?;
        let (input, format) = match format {
            Some(Format::Native) => (input, Format::Native),
            // (a native trace read as text would fail on its first line
            // with a message about fields, saying nothing of the cause)
            Some(f) => {
                let (input, head) = input::peek(input, |h| h.len() >= MAGIC.len(), MAGIC.len())
                    .map_err(io_err(&name))?;
                if head.starts_with(&MAGIC) {
                    return Err(TraceError::NativeAsText {
                        file: name,
                        format: f.name(),
                    });
                }
                (input, f)
            }
            None => {
                let (input, head) = input::peek(input, format_decidable, DETECT_CAP_BYTES)
                    .map_err(io_err(&name))?;
                let format = detect_format(&head);
                if format != Format::Native && !looks_like_text(&head) {
                    return Err(TraceError::Unrecognized { file: name });
                }
                (input, format)
            }
        };
        let inner = match format {
            Format::Native => {
                Inner::Native(NativeReader::new(input).map_err(|(offset, msg)| {
                    TraceError::BadNative {
                        file: name.clone(),
                        offset,
                        msg,
                    }
                })?)
            }
            Format::Fiu | Format::Mobile => Inner::Text {
                input,
                format: if format == Format::Fiu {
                    TextFormat::Fiu
                } else {
                    TextFormat::Mobile
                },
                line: Vec::with_capacity(1024),
                line_no: 0,
                sources: SourceTable::default(),
                layout: Layout::PerPage,
            },
        };
        Ok(TraceReader {
            name,
            format,
            skip_bad,
            bad: 0,
            inner,
        })
    }

    /// The file name as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The format being read.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Malformed lines skipped so far (with `skip_bad`).
    pub fn bad_records(&self) -> u64 {
        self.bad
    }

    /// Sources seen so far; a request's `source` indexes this slice, which
    /// only grows.
    pub fn sources(&self) -> &[Source] {
        match &self.inner {
            Inner::Text { sources, .. } => &sources.sources,
            Inner::Native(n) => &n.sources,
        }
    }

    /// Where the last request came from: `file:line` or `file:record N`.
    pub fn location(&self) -> String {
        self.location_at(self.position())
    }

    /// The line (text formats) or record number (native) of the last
    /// request read; [`TraceReader::location_at`] names it.
    pub fn position(&self) -> u64 {
        match &self.inner {
            Inner::Text { line_no, .. } => *line_no,
            Inner::Native(n) => n.records(),
        }
    }

    /// `file:line` or `file:record N` for a [`TraceReader::position`] (of a
    /// request read earlier, when requests are read ahead of their use).
    pub fn location_at(&self, position: u64) -> String {
        match &self.inner {
            Inner::Text { .. } => format!("{}:{}", self.name, position),
            Inner::Native(_) => format!("{}:record {}", self.name, position),
        }
    }

    /// Counts one bad request found by the caller (e.g. out of range) when
    /// skipping is on; returns whether it may be skipped.
    pub fn skip_bad_request(&mut self) -> bool {
        if self.skip_bad {
            self.bad += 1;
        }
        self.skip_bad
    }

    /// Reads the next request into `req` (reusing its buffers); false at
    /// the end. Empty lines and lines starting with `#` are ignored.
    ///
    /// Errors: I/O, a malformed line (unless skipping), a bad native chunk.
    pub fn next_into(&mut self, req: &mut Request) -> Result<bool> {
        match &mut self.inner {
            Inner::Native(n) => n
                .next_into(req)
                .map_err(|(offset, msg)| TraceError::BadNative {
                    file: self.name.clone(),
                    offset,
                    msg,
                }),
            Inner::Text {
                input,
                format,
                line,
                line_no,
                sources,
                layout,
            } => loop {
                line.clear();
                // (an error names the line being read, as a parse error
                // does: a truncated .gz fails part way through the file)
                let n = (&mut **input)
                    .take(MAX_LINE_BYTES as u64 + 1)
                    .read_until(b'\n', line)
                    .map_err(io_err_at_line(&self.name, *line_no + 1))?;
                if n == 0 {
                    return Ok(false);
                }
                *line_no += 1;
                if line.len() > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
                    skip_rest_of_line(&mut **input)
                        .map_err(io_err_at_line(&self.name, *line_no))?;
                    if self.skip_bad {
                        self.bad += 1;
                        continue;
                    }
                    return Err(TraceError::BadLine {
                        file: self.name.clone(),
                        line: *line_no,
                        msg: format!("line longer than {MAX_LINE_BYTES} bytes"),
                    });
                }
                let l = line.trim_ascii();
                if l.is_empty() || l[0] == b'#' {
                    continue;
                }
                let r = match format {
                    TextFormat::Fiu => parse_fiu(l, req, sources, layout),
                    TextFormat::Mobile => parse_mobile(l, req, sources),
                };
                match r {
                    Ok(()) => return Ok(true),
                    Err(_) if self.skip_bad => self.bad += 1,
                    Err(msg) => {
                        return Err(TraceError::BadLine {
                            file: self.name.clone(),
                            line: *line_no,
                            msg,
                        })
                    }
                }
            },
        }
    }
}
