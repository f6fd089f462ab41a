//! Errors of trace reading, conversion, generation and replay.

/// Everything that can go wrong in this crate. Messages name the file and,
/// for text traces, the 1-based line number (`file:line: …`).
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// An I/O error on a named file.
    #[error("{file}: {cause}")]
    Io {
        /// The file's path as given.
        file: String,
        /// The underlying error (part of the message, so not also given
        /// as the error's source: a chain would print it twice).
        cause: std::io::Error,
    },
    /// An I/O error on a text trace while reading one of its lines (a
    /// truncated or corrupt compressed file, typically): `file:line: …`,
    /// the line being read when it happened.
    #[error("{file}:{line}: {cause}")]
    IoAtLine {
        /// The file's path as given.
        file: String,
        /// 1-based number of the line being read.
        line: u64,
        /// The underlying error (part of the message, as for `Io`).
        cause: std::io::Error,
    },
    /// A trace from which no request was read (an empty file, comments
    /// only, or only malformed lines skipped with `skip_bad`): replaying
    /// or converting it is refused, as it is most likely not the file
    /// meant.
    #[error("{file}: no requests in this trace{}", skipped_note(*.bad_records_skipped))]
    NoRequests {
        /// The file's path as given.
        file: String,
        /// Malformed lines skipped (with `skip_bad`).
        bad_records_skipped: u64,
    },
    /// A malformed text line (skipped and counted instead with `skip_bad`).
    #[error("{file}:{line}: {msg}")]
    BadLine {
        /// The file's path as given.
        file: String,
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        msg: String,
    },
    /// A file whose format was to be detected but that is neither a native
    /// trace nor text (binary data in its first record line).
    #[error(
        "{file}: not a trace dedupd reads: no native header (DDTRACE) and not text \
         (FIU and mobile traces are text lines; --format names the format if it is one)"
    )]
    Unrecognized {
        /// The file's path as given.
        file: String,
    },
    /// A native trace (it starts with the native header) opened with a
    /// text format named (`--format fiu` or `--format mobile`).
    #[error(
        "{file}: a native trace (it starts with the DDTRACE header), not {format} text: \
         read it with --format native, or without --format to detect it"
    )]
    NativeAsText {
        /// The file's path as given.
        file: String,
        /// The text format named: `fiu` or `mobile`.
        format: &'static str,
    },
    /// A malformed or truncated native trace.
    #[error("{file}: native trace at byte {offset}: {msg}")]
    BadNative {
        /// The file's path as given.
        file: String,
        /// Byte offset (in the decompressed stream) of the failing chunk.
        offset: u64,
        /// What is wrong with it.
        msg: String,
    },
    /// A request the engine refused (e.g. beyond the 1 PiB volume limit).
    #[error("{location}: {msg}")]
    Request {
        /// `file:line` or `file:record N`.
        location: String,
        /// What is wrong with it.
        msg: String,
    },
    /// Bad configuration (unknown policy, bad generator parameters, …).
    #[error("{0}")]
    Config(String),
    /// The replay was asked to stop ([`crate::replay::ReplayConfig::stop`]
    /// raised, e.g. by SIGINT) before it finished.
    #[error("interrupted")]
    Interrupted,
    /// An engine error outside any single request (part of the message,
    /// so not also given as the error's source).
    #[error("engine: {0}")]
    Engine(dedupd_engine::EngineError),
}

impl From<dedupd_engine::EngineError> for TraceError {
    fn from(e: dedupd_engine::EngineError) -> Self {
        TraceError::Engine(e)
    }
}

/// ` (N malformed lines skipped)`, or nothing for none.
fn skipped_note(n: u64) -> String {
    match n {
        0 => String::new(),
        1 => " (1 malformed line skipped)".into(),
        n => format!(" ({n} malformed lines skipped)"),
    }
}

/// Result with [`TraceError`].
pub type Result<T> = std::result::Result<T, TraceError>;

/// Wraps an I/O error with the file and the line being read when it
/// happened (nothing is allocated unless it is called).
pub(crate) fn io_err_at_line(
    file: &str,
    line: u64,
) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |cause| TraceError::IoAtLine {
        file: file.to_string(),
        line,
        cause,
    }
}

/// Wraps an I/O error with the file it happened on.
pub(crate) fn io_err(file: &str) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |cause| TraceError::Io {
        file: file.to_string(),
        cause,
    }
}
