//! Transmission phase ("Transmission" section of the spec), simple replies
//! only.
//!
//! Each connection runs a few worker threads, all alike (nbdkit's
//! "parallel" thread model). A worker takes the reading half, decodes one
//! request, checks it, takes its share of the in-flight budget and reads its
//! WRITE payload, gives the reading half back, calls the [`Export`], and
//! writes the reply whole under the sending half's mutex. No request is
//! handed from one thread to another, and replies may leave in any order.
//!
//! Replies are coalesced: while another request of the connection is in
//! flight (its reply will follow soon; a FLUSH or FUA write, which waits
//! for the disk, does not count, nor a write while the export says writes
//! may wait for it: [`Export::writes_may_wait_for_disk`]), a reply is sent with `MSG_MORE`, so
//! the kernel may put several replies in one TCP segment. The reply that
//! leaves the connection with nothing in flight is sent without it, which
//! pushes everything queued; and while a worker waits for the client's
//! next request (nothing is buffered), queued replies are pushed and no
//! reply is held.

use std::io::{self, Read, Write};
use std::os::fd::RawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::budget::{Budget, BudgetGuard};
use crate::export::{Export, ExportError};
use crate::handshake::discard;
use crate::proto::{self, Command, Request};

/// What to do with a decoded request, decided before any payload is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Valid: (read the WRITE payload and) execute it.
    Dispatch,
    /// Reply with this error; the request carries no payload.
    Reply(u32),
    /// WRITE refused: read and drop the payload, then reply with this error.
    SkipPayloadThenReply(u32),
    /// WRITE too long to skip safely: reply with this error, stop reading.
    ReplyThenClose(u32),
    /// `NBD_CMD_DISC`: stop reading, finish in-flight requests, close.
    Disconnect,
}

/// Checks a request against the export (`size` bytes, `read_only`) and the
/// server's limits (READ and WRITE payloads up to `max_payload` bytes);
/// pure.
pub(crate) fn plan(
    req: &Request,
    size: u64,
    read_only: bool,
    max_payload: u32,
    fast_zero_granule: Option<u32>,
) -> Plan {
    let flags_ok = req.flags & !req.command.allowed_flags() == 0;
    let in_range = req
        .offset
        .checked_add(u64::from(req.length))
        .is_some_and(|end| end <= size);
    let too_long = req.length > max_payload;
    match req.command {
        Command::Disc => Plan::Disconnect,
        Command::Unknown(_) => Plan::Reply(proto::NBD_EINVAL),
        Command::Write => {
            if req.length > proto::BLOCK_SIZE_MAX {
                Plan::ReplyThenClose(proto::NBD_EINVAL)
            } else if too_long || !flags_ok {
                Plan::SkipPayloadThenReply(proto::NBD_EINVAL)
            } else if read_only {
                Plan::SkipPayloadThenReply(proto::NBD_EPERM)
            } else if !in_range {
                // proto.md "Error values": a write past the end SHOULD get
                // NBD_ENOSPC (reads and trims get NBD_EINVAL).
                Plan::SkipPayloadThenReply(proto::NBD_ENOSPC)
            } else {
                Plan::Dispatch
            }
        }
        Command::Read | Command::Trim | Command::WriteZeroes => {
            // TRIM and WRITE_ZEROES carry no payload, so any length inside
            // the export is accepted (proto.md "Size constraints": the
            // server SHOULD accept them); QEMU does not split discards.
            let too_long = too_long && req.command == Command::Read;
            if too_long || !flags_ok {
                Plan::Reply(proto::NBD_EINVAL)
            } else if read_only && req.command != Command::Read {
                Plan::Reply(proto::NBD_EPERM)
            } else if !in_range && req.command == Command::WriteZeroes {
                Plan::Reply(proto::NBD_ENOSPC)
            } else if !in_range {
                Plan::Reply(proto::NBD_EINVAL)
            } else if req.flags & proto::CMD_FLAG_FAST_ZERO != 0 {
                match fast_zero_granule {
                    // (not advertised)
                    None => Plan::Reply(proto::NBD_EINVAL),
                    Some(g)
                        if !(req.offset | u64::from(req.length)).is_multiple_of(u64::from(g)) =>
                    {
                        Plan::Reply(proto::NBD_ENOTSUP)
                    }
                    Some(_) => Plan::Dispatch,
                }
            } else {
                Plan::Dispatch
            }
        }
        Command::Flush => {
            if flags_ok {
                Plan::Dispatch
            } else {
                Plan::Reply(proto::NBD_EINVAL)
            }
        }
    }
}

/// What to do with a request received during shutdown: a valid FLUSH is
/// executed (the writes it covers were acknowledged, and a failed flush
/// makes file systems such as ext4 abort their journal, though the
/// shutdown makes the writes durable anyway); anything else is answered
/// `NBD_ESHUTDOWN` (a WRITE's payload read and dropped); pure.
pub(crate) fn shutdown_plan(req: &Request) -> Plan {
    match req.command {
        Command::Disc => Plan::Disconnect,
        Command::Flush if req.flags & !req.command.allowed_flags() == 0 => Plan::Dispatch,
        Command::Write if req.length > proto::BLOCK_SIZE_MAX => Plan::Disconnect,
        Command::Write => Plan::SkipPayloadThenReply(proto::NBD_ESHUTDOWN),
        _ => Plan::Reply(proto::NBD_ESHUTDOWN),
    }
}

/// Where replies go: a byte sink, optionally backed by a socket whose raw
/// descriptor lets replies be sent with `MSG_MORE`.
pub(crate) trait ReplySink: Write + Send {
    /// The socket descriptor behind this sink, if any. It must stay open for
    /// as long as the sink lives (the sink owns it).
    fn socket_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Where requests come from.
pub(crate) trait RequestSource: Read + Send {
    /// True if the next read will find data without waiting for the client
    /// (bytes already buffered, or readable on the socket). Used only to
    /// decide whether queued replies must be pushed out first; `false` when
    /// unsure.
    fn input_pending(&mut self) -> bool;

    /// True if [`RequestSource::wait_input`] also ends when the server
    /// shuts down, so a connection waiting for its client need not wake up
    /// to look. Default: false.
    fn wakes_on_stop(&self) -> bool {
        false
    }

    /// Waits up to `timeout` for input; false if none arrived (end of
    /// stream counts as input: the next read finds it). A source that
    /// cannot wait answers true at once.
    fn wait_input(&mut self, timeout: std::time::Duration) -> bool {
        let _ = timeout;
        true
    }

    /// Reads a WRITE payload whole. A source over a socket bounds the time
    /// this may take (the payload holds its share of the server's
    /// in-flight budget meanwhile) and fails once it is exceeded.
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.read_exact(buf)
    }

    /// Reads and drops the `len`-byte payload of a refused WRITE, with
    /// the time bound of [`RequestSource::read_payload`].
    fn skip_payload(&mut self, len: u64) -> io::Result<()> {
        discard(self, len)
    }
}

/// The sending half of a connection, shared by its workers, and the count
/// of the connection's requests in flight (read but not yet replied to).
pub(crate) struct ReplyWriter {
    out: Mutex<Box<dyn ReplySink>>,
    /// Socket of `out` while `send` with flags works on it.
    fd: Option<RawFd>,
    /// Cleared once the socket refused `send` (e.g. `EOPNOTSUPP`): plain
    /// writes from then on.
    use_send: AtomicBool,
    hangup: Box<dyn Fn() + Send + Sync>,
    dead: AtomicBool,
    /// Requests counted by [`ReplyWriter::begin`] whose reply is not sent.
    in_flight: AtomicUsize,
    /// Those of them that may take long (FLUSH, FUA, writes while the
    /// export says they may wait for the disk): a reply waits with
    /// `MSG_MORE` only for company that will follow it soon.
    slow_in_flight: AtomicUsize,
    /// A reply went out with `MSG_MORE` and nothing has pushed it since.
    /// Only changed under the `out` lock.
    corked: AtomicBool,
    /// A worker is waiting for the client's next request (nothing was
    /// buffered): replies must not wait for company.
    awaiting_client: AtomicBool,
}

impl ReplyWriter {
    /// Wraps `out`; `hangup` is called once a write fails (it should shut
    /// the socket down so the workers stop reading too).
    pub(crate) fn new(out: Box<dyn ReplySink>, hangup: Box<dyn Fn() + Send + Sync>) -> Self {
        let fd = out.socket_fd();
        ReplyWriter {
            out: Mutex::new(out),
            fd,
            use_send: AtomicBool::new(fd.is_some()),
            hangup,
            dead: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            slow_in_flight: AtomicUsize::new(0),
            corked: AtomicBool::new(false),
            awaiting_client: AtomicBool::new(false),
        }
    }

    /// Counts one more request in flight, `slow` if it may take long (a
    /// FLUSH or a FUA write, which wait for the disk); it must be answered
    /// with [`ReplyWriter::reply`] exactly once, with the same `slow`.
    fn begin(&self, slow: bool) {
        if slow {
            self.slow_in_flight.fetch_add(1, Ordering::SeqCst);
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// True once a write has failed.
    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Sends the whole reply of a request counted by
    /// [`ReplyWriter::begin`] and uncounts it. Returns false if the
    /// connection is dead.
    ///
    /// The count is taken and decremented under the send lock, so the reply
    /// that brings it to zero is also the last one sent among those
    /// counted: it goes out without `MSG_MORE` and pushes every reply
    /// queued before it. A reply sent while a worker waits for the client
    /// is not held either (the client may be waiting for it), nor one whose
    /// only company is slow (a FLUSH or FUA write in flight may take the
    /// disk's time, and the kernel would hold the reply up to 200 ms).
    fn reply(&self, bytes: &[u8], slow: bool) -> bool {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if slow {
            self.slow_in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        let others = self.in_flight.fetch_sub(1, Ordering::SeqCst) - 1;
        if self.is_dead() {
            return false;
        }
        let fast_others = others.saturating_sub(self.slow_in_flight.load(Ordering::SeqCst));
        let more = fast_others > 0 && !self.awaiting_client.load(Ordering::SeqCst);
        let ok = self.write_locked(&mut out, bytes, more).is_ok();
        // dead before the lock is given up: a reply that failed part way
        // must not be followed by another reply's bytes, which the client
        // would read as the rest of this one
        let first_failure = !ok && !self.dead.swap(true, Ordering::SeqCst);
        drop(out);
        if first_failure {
            (self.hangup)();
        }
        ok
    }

    /// Marks whether a worker is about to wait for the client; on `true`,
    /// pushes replies queued with `MSG_MORE` onto the wire. Under the send
    /// lock, so a reply either is pushed here or sees the mark and is not
    /// queued.
    fn set_awaiting_client(&self, waiting: bool) {
        if !waiting {
            self.awaiting_client.store(false, Ordering::SeqCst);
            return;
        }
        self.awaiting_client.store(true, Ordering::SeqCst);
        let _out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if !self.corked.swap(false, Ordering::SeqCst) {
            return;
        }
        if let Some(fd) = self.fd {
            // Setting TCP_NODELAY (already set) makes Linux send pending
            // segments at once. Not a TCP socket (Unix sockets ignore
            // MSG_MORE): nothing to push, the error is irrelevant.
            let one: libc::c_int = 1;
            // SAFETY: `fd` is owned by `out`, which is alive (and locked);
            // the option value points to a c_int of the size passed.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::IPPROTO_TCP,
                    libc::TCP_NODELAY,
                    std::ptr::addr_of!(one).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }

    /// Writes all of `bytes`; the caller holds the `out` lock.
    fn write_locked(
        &self,
        out: &mut Box<dyn ReplySink>,
        bytes: &[u8],
        more: bool,
    ) -> io::Result<()> {
        if let (Some(fd), true) = (self.fd, self.use_send.load(Ordering::Relaxed)) {
            match send_all(fd, bytes, more) {
                Ok(()) => {
                    self.corked.store(more, Ordering::SeqCst);
                    return Ok(());
                }
                Err(SendError::Unsupported(sent)) => {
                    self.use_send.store(false, Ordering::Relaxed);
                    self.corked.store(false, Ordering::SeqCst);
                    return out.write_all(&bytes[sent..]).and_then(|()| out.flush());
                }
                Err(SendError::Io(e)) => return Err(e),
            }
        }
        out.write_all(bytes).and_then(|()| out.flush())
    }
}

enum SendError {
    /// The descriptor does not support `send` with these flags; this many
    /// bytes were sent before.
    Unsupported(usize),
    Io(io::Error),
}

/// Time a reply may take to leave once the client stops taking it whole
/// at once: 60 s plus 1 s per 64 KiB of reply (about 9 minutes for
/// 32 MiB). A client that reads a byte now and then, so that no single
/// send times out, cannot hold the reply's share of the in-flight budget
/// for ever.
fn reply_deadline(len: usize) -> std::time::Duration {
    std::time::Duration::from_secs(60 + (len as u64 >> 16))
}

/// Sends all of `bytes` on socket `fd`, with `MSG_MORE` if `more`.
/// Errors: the socket's, or `TimedOut` past [`reply_deadline`].
fn send_all(fd: RawFd, bytes: &[u8], more: bool) -> Result<(), SendError> {
    let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
    let mut sent = 0;
    // (the clock is read only once a send was partial)
    let mut deadline: Option<std::time::Instant> = None;
    while sent < bytes.len() {
        if sent > 0 {
            let d = *deadline
                .get_or_insert_with(|| std::time::Instant::now() + reply_deadline(bytes.len()));
            if std::time::Instant::now() > d {
                return Err(SendError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not take its reply in time",
                )));
            }
        }
        let rest = &bytes[sent..];
        // SAFETY: `rest` is a valid readable buffer of `rest.len()` bytes;
        // `fd` is a descriptor owned by the caller's locked sink.
        let n = unsafe { libc::send(fd, rest.as_ptr().cast(), rest.len(), flags) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP | libc::ENOTSOCK) => {
                    return Err(SendError::Unsupported(sent))
                }
                _ => return Err(SendError::Io(e)),
            }
        }
        if n == 0 {
            return Err(SendError::Io(io::ErrorKind::WriteZero.into()));
        }
        sent += n as usize;
    }
    Ok(())
}

/// Server-wide resources a connection uses.
pub(crate) struct Resources<'a> {
    /// Worker threads for this connection (at least one is used).
    pub workers: usize,
    /// Largest READ or WRITE payload accepted (bytes; at most
    /// [`proto::BLOCK_SIZE_MAX`]).
    pub max_payload: u32,
    /// Shared in-flight payload budget.
    pub budget: &'a Arc<Budget>,
    /// Counter of decoded requests.
    pub requests_total: &'a AtomicU64,
    /// Server shutdown flag: once set, requests already received are
    /// answered `NBD_ESHUTDOWN` (at most [`SHUTDOWN_REPLIES`] of them) and
    /// reading stops at the end of what the client has sent.
    pub stopping: &'a AtomicBool,
    /// Bytes of request buffers kept for reuse by all connections (see
    /// [`KEPT_BUFFER_BYTES`]).
    pub kept_buffer_bytes: &'a AtomicU64,
}

/// Requests a connection answers with `NBD_ESHUTDOWN` after the server
/// began to shut down, before it stops reading (a client that keeps
/// sending cannot hold the shutdown up).
pub(crate) const SHUTDOWN_REPLIES: usize = 1024;

/// Largest request buffer a connection keeps for reuse after its request
/// (so the next request's buffer is neither allocated nor zeroed again); a
/// larger one is freed at once. A connection keeps at most one per worker,
/// and frees them all once its client has sent nothing for
/// [`IDLE_BUFFER_FREE_AFTER`], so idle connections hold none; all
/// connections together keep at most the in-flight budget's bytes.
const KEPT_BUFFER_BYTES: usize = buffer_bytes((1 << 20) + proto::SIMPLE_REPLY_HEADER_LEN);

/// Granule of request buffers: a request of `n` bytes (payload, or a READ's
/// reply with its header) gets a buffer of `n` rounded up to it, and is
/// charged that to the in-flight budget; a kept buffer serves a request
/// whose own size is at most one granule smaller, so memory in flight
/// passes what is charged by less than 4 KiB per request.
const BUFFER_GRANULE_BYTES: usize = 4096;

/// The buffer (and budget charge) of a request of `bytes` bytes.
const fn buffer_bytes(bytes: usize) -> usize {
    bytes.next_multiple_of(BUFFER_GRANULE_BYTES)
}

/// How long a connection waits for its client with nothing to read before
/// it frees its kept request buffers.
pub(crate) const IDLE_BUFFER_FREE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a connection waiting for its client checks for shutdown
/// when its source does not wake it ([`RequestSource::wakes_on_stop`]).
pub(crate) const STOP_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Longest single wait of an idle connection whose source wakes it at a
/// shutdown (only a safeguard).
const IDLE_WAIT_STEP: std::time::Duration = std::time::Duration::from_secs(5);

/// A request read whole, ready to execute.
struct Job {
    req: Request,
    /// Counted as slow ([`ReplyWriter::begin`]).
    slow: bool,
    /// The worker's buffer: a WRITE's payload in its first `req.length`
    /// bytes; space for a READ's reply.
    buf: Vec<u8>,
    _budget: BudgetGuard,
    /// Its share of the connection's own part of the budget (taken first).
    _share: BudgetGuard,
}

/// Makes `buf` at least `len` bytes long, zeroing only what it grows by.
fn ensure_len(buf: &mut Vec<u8>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0);
    }
}

/// What one turn at the reading half produced.
enum Next {
    /// A request to execute (already counted in flight).
    Job(Job),
    /// The request was answered or dropped while reading; read again.
    Handled,
    /// Stop reading: end of stream, broken protocol, DISC, shutdown, or a
    /// dead connection.
    Stop,
}

/// One connection's state shared by its workers.
struct Connection<'a, R: ?Sized> {
    reader: Mutex<&'a mut R>,
    /// Set by the first worker that stops reading; the others then stop
    /// too (after finishing the request they hold).
    done: AtomicBool,
    writer: &'a ReplyWriter,
    export: &'a dyn Export,
    size: u64,
    read_only: bool,
    /// [`Export::fast_zero_granule`], read once.
    fast_zero_granule: Option<u32>,
    res: &'a Resources<'a>,
    /// Requests answered `NBD_ESHUTDOWN` so far.
    shutdown_replies: AtomicUsize,
    /// Buffers of finished requests, for the next ones.
    spare: Mutex<Vec<Vec<u8>>>,
    /// This connection's part of the in-flight budget: half the server's
    /// (a larger request still runs alone in it).
    share: Arc<Budget>,
    /// Set while the reading worker waits for a client that has sent
    /// nothing for [`IDLE_BUFFER_FREE_AFTER`]: buffers are then freed, not
    /// kept.
    idle: AtomicBool,
}

/// Runs the transmission phase until the client disconnects, breaks the
/// protocol, the socket fails, or the server shuts down. Returns after
/// every accepted request has been executed and (if possible) replied to.
pub(crate) fn run<R: RequestSource + ?Sized>(
    reader: &mut R,
    writer: Arc<ReplyWriter>,
    export: Arc<dyn Export>,
    res: &Resources<'_>,
) {
    let conn = Connection::new(reader, &writer, &*export, res);
    let workers = res.workers.max(1);
    std::thread::scope(|scope| {
        // This thread is one of the workers.
        for i in 1..workers {
            let conn = &conn;
            let spawned = std::thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .spawn_scoped(scope, move || conn.work());
            if spawned.is_err() {
                break; // run with the workers there are
            }
        }
        conn.work();
    });
    conn.free_spare_buffers();
}

impl<'a, R: RequestSource + ?Sized> Connection<'a, R> {
    fn new(
        reader: &'a mut R,
        writer: &'a ReplyWriter,
        export: &'a dyn Export,
        res: &'a Resources<'a>,
    ) -> Self {
        Connection {
            reader: Mutex::new(reader),
            done: AtomicBool::new(false),
            writer,
            export,
            size: export.size_bytes(),
            read_only: export.read_only(),
            fast_zero_granule: export.fast_zero_granule(),
            res,
            shutdown_replies: AtomicUsize::new(0),
            spare: Mutex::new(Vec::new()),
            idle: AtomicBool::new(false),
            // (plus a granule per worker: requests are charged in whole
            // granules, READs with their reply header, so as many as fit
            // in half the budget by length still run together)
            share: Budget::new(
                res.budget.capacity() / 2 + res.workers.max(1) * BUFFER_GRANULE_BYTES,
            ),
        }
    }

    /// One worker: read a request, execute it, reply; until reading stops.
    fn work(&self) {
        loop {
            let next = {
                let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
                let next = self.next(&mut **reader);
                if matches!(next, Next::Stop) {
                    // before the reader is released: the next worker to
                    // take it must see the stop, not block reading a
                    // socket the client keeps open after DISC
                    self.done.store(true, Ordering::SeqCst);
                }
                next
            };
            match next {
                Next::Job(job) => {
                    let buf = execute(job, self.export, self.writer);
                    if buf.capacity() <= KEPT_BUFFER_BYTES {
                        self.keep_buffer(buf);
                    }
                }
                Next::Handled => {}
                Next::Stop => {
                    self.done.store(true, Ordering::SeqCst);
                    return;
                }
            }
        }
    }

    /// Keeps a finished request's buffer for a later request: at most one
    /// per worker, and all connections' kept buffers within the in-flight
    /// budget's bytes (else it is freed).
    fn keep_buffer(&self, buf: Vec<u8>) {
        let bytes = buf.capacity() as u64;
        if bytes == 0 {
            return;
        }
        {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.len() >= self.res.workers.max(1) {
                return;
            }
            let limit = self.res.budget.capacity() as u64;
            let counted = self.res.kept_buffer_bytes.fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |kept| (kept + bytes <= limit).then_some(kept + bytes),
            );
            if counted.is_err() {
                return;
            }
            spare.push(buf);
        }
        // (after the push: a reader that went idle before it has freed it,
        // or is seen idle here)
        if self.idle.load(Ordering::SeqCst) {
            self.free_spare_buffers();
        }
    }

    /// A buffer with room for `need` bytes (0: none needed, an empty one):
    /// a kept one of at most one [`BUFFER_GRANULE_BYTES`] more, else a new
    /// one of `need` (empty, allocated as it is filled). Larger kept
    /// buffers are left for larger requests, so a request holds about what
    /// it was charged.
    fn take_buffer(&self, need: usize) -> Vec<u8> {
        if need == 0 {
            return Vec::new();
        }
        let fits = need.saturating_add(BUFFER_GRANULE_BYTES);
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = spare
            .iter()
            .position(|b| (need..=fits).contains(&b.capacity()))
        else {
            drop(spare);
            return Vec::with_capacity(need);
        };
        let buf = spare.swap_remove(i);
        drop(spare);
        self.res
            .kept_buffer_bytes
            .fetch_sub(buf.capacity() as u64, Ordering::Relaxed);
        buf
    }

    /// Frees every kept buffer.
    fn free_spare_buffers(&self) {
        let freed = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|e| e.into_inner()));
        let bytes: usize = freed.iter().map(Vec::capacity).sum();
        self.res
            .kept_buffer_bytes
            .fetch_sub(bytes as u64, Ordering::Relaxed);
    }

    /// Reads the next request whole; the caller holds the reading half.
    fn next(&self, reader: &mut R) -> Next {
        let writer = self.writer;
        if self.done.load(Ordering::SeqCst) || writer.is_dead() {
            return Next::Stop;
        }
        // during shutdown, requests the client has already sent are
        // answered NBD_ESHUTDOWN (proto.md "Terminating the transmission
        // phase"); reading stops when nothing more has arrived or after
        // SHUTDOWN_REPLIES
        let stopping = self.res.stopping.load(Ordering::SeqCst);
        if stopping
            && (self.shutdown_replies.fetch_add(1, Ordering::SeqCst) >= SHUTDOWN_REPLIES
                || !reader.input_pending())
        {
            return Next::Stop;
        }
        // About to wait for the client, which may be waiting for a reply
        // queued behind MSG_MORE: send it now, and queue none meanwhile.
        let waiting = !reader.input_pending();
        if waiting {
            writer.set_awaiting_client(true);
            // wait for the client: a shutdown stops the wait (waking it,
            // or seen at the next of short steps), and a client idle for
            // long (maybe hours) lets the connection free its kept buffers
            let started = std::time::Instant::now();
            loop {
                let step = if !reader.wakes_on_stop() {
                    STOP_POLL_INTERVAL
                } else if self.idle.load(Ordering::SeqCst) {
                    IDLE_WAIT_STEP
                } else {
                    IDLE_BUFFER_FREE_AFTER
                        .saturating_sub(started.elapsed())
                        .max(std::time::Duration::from_millis(1))
                };
                if reader.wait_input(step) {
                    break;
                }
                if self.res.stopping.load(Ordering::SeqCst) {
                    writer.set_awaiting_client(false);
                    // from the top, where a request that arrived since the
                    // last poll is answered NBD_ESHUTDOWN, not dropped
                    return self.next(reader);
                }
                if started.elapsed() >= IDLE_BUFFER_FREE_AFTER && !self.idle.load(Ordering::SeqCst)
                {
                    self.idle.store(true, Ordering::SeqCst);
                    self.free_spare_buffers();
                }
            }
        }
        let mut hdr = [0u8; proto::REQUEST_HEADER_LEN];
        let got = reader.read_exact(&mut hdr);
        if waiting {
            writer.set_awaiting_client(false);
            self.idle.store(false, Ordering::SeqCst);
        }
        if got.is_err() {
            return Next::Stop;
        }
        let Ok(req) = proto::decode_request(&hdr) else {
            return Next::Stop; // bad magic: cannot resynchronise
        };
        self.res.requests_total.fetch_add(1, Ordering::Relaxed);
        let len = req.length as usize;
        let refuse = |e: u32| {
            writer.begin(false);
            writer.reply(&proto::encode_simple_reply(e, req.handle), false)
        };
        let plan = if stopping {
            shutdown_plan(&req)
        } else {
            plan(
                &req,
                self.size,
                self.read_only,
                self.res.max_payload,
                self.fast_zero_granule,
            )
        };
        match plan {
            Plan::Disconnect => Next::Stop,
            Plan::Reply(e) => {
                if refuse(e) {
                    Next::Handled
                } else {
                    Next::Stop
                }
            }
            Plan::SkipPayloadThenReply(e) => {
                if reader.skip_payload(u64::from(req.length)).is_ok() && refuse(e) {
                    Next::Handled
                } else {
                    Next::Stop
                }
            }
            Plan::ReplyThenClose(e) => {
                refuse(e);
                Next::Stop
            }
            Plan::Dispatch => {
                let bytes = match req.command {
                    Command::Read => buffer_bytes(len + proto::SIMPLE_REPLY_HEADER_LEN),
                    Command::Write => buffer_bytes(len),
                    _ => 0,
                };
                // the connection's own part first: one connection (say a
                // client sending its payloads slowly) can hold at most half
                // the server's budget, so others always find room
                let share = self.share.acquire(bytes);
                let guard = self.res.budget.acquire(bytes);
                let mut buf = self.take_buffer(bytes);
                if req.command == Command::Write {
                    ensure_len(&mut buf, len);
                    if reader.read_payload(&mut buf[..len]).is_err() {
                        return Next::Stop;
                    }
                }
                let slow = is_slow(&req)
                    || (matches!(
                        req.command,
                        Command::Write | Command::Trim | Command::WriteZeroes
                    ) && self.export.writes_may_wait_for_disk());
                writer.begin(slow);
                Next::Job(Job {
                    req,
                    slow,
                    buf,
                    _budget: guard,
                    _share: share,
                })
            }
        }
    }
}

/// Calls the export, turning a panic into `NBD_EIO`.
fn guarded<T>(f: impl FnOnce() -> Result<T, ExportError>) -> Result<T, ExportError> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(ExportError::Io("export implementation panicked".into())))
}

/// Executes a counted request and sends its reply; its budget is given back
/// once the reply is sent. Returns the worker's buffer for the next request.
fn execute(job: Job, export: &dyn Export, writer: &ReplyWriter) -> Vec<u8> {
    let Job {
        req,
        slow,
        mut buf,
        _budget,
        _share,
    } = job;
    let fua = req.flags & proto::CMD_FLAG_FUA != 0;
    let len = u64::from(req.length);
    let result = match req.command {
        Command::Read => {
            // Header and data in one buffer: the reply leaves in one send.
            let total = proto::SIMPLE_REPLY_HEADER_LEN + req.length as usize;
            ensure_len(&mut buf, total);
            let r = if len == 0 {
                Ok(())
            } else {
                guarded(|| export.read(req.offset, &mut buf[proto::SIMPLE_REPLY_HEADER_LEN..total]))
            };
            if r.is_ok() {
                proto::write_simple_reply_header(&mut buf[..total], 0, req.handle);
                writer.reply(&buf[..total], slow);
                return buf;
            }
            r
        }
        Command::Write if len == 0 => Ok(()),
        Command::Write => guarded(|| export.write(req.offset, &buf[..len as usize], fua)),
        Command::Flush => guarded(|| export.flush()),
        Command::Trim if len == 0 => Ok(()),
        Command::Trim => guarded(|| export.trim(req.offset, len, fua)),
        Command::WriteZeroes if len == 0 => Ok(()),
        Command::WriteZeroes => guarded(|| export.write_zeroes(req.offset, len, fua)),
        Command::Disc | Command::Unknown(_) => Err(ExportError::Invalid("not dispatchable".into())),
    };
    let code = match &result {
        Ok(()) => 0,
        Err(e) => proto::error_code(e),
    };
    writer.reply(&proto::encode_simple_reply(code, req.handle), slow);
    buf
}

/// True for a request that waits for the disk (FLUSH, or FUA).
fn is_slow(req: &Request) -> bool {
    req.command == Command::Flush || req.flags & proto::CMD_FLAG_FUA != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, NBD_EINVAL, NBD_ENOSPC, NBD_EPERM};

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            command,
            handle: 1,
            offset,
            length,
        }
    }

    const MAX: u32 = proto::BLOCK_SIZE_MAX;

    struct Nothing;

    impl Export for Nothing {
        fn size_bytes(&self) -> u64 {
            1 << 30
        }
        fn read(&self, _: u64, _: &mut [u8]) -> Result<(), ExportError> {
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
            Ok(())
        }
        fn flush(&self) -> Result<(), ExportError> {
            Ok(())
        }
        fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
            Ok(())
        }
        fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), ExportError> {
            Ok(())
        }
    }

    impl ReplySink for Vec<u8> {}

    impl RequestSource for std::io::Empty {
        fn input_pending(&mut self) -> bool {
            false
        }
    }

    #[test]
    fn kept_buffers_stay_within_the_budget_and_requests_take_their_own_size() {
        let budget = Budget::new((3 << 20) + 8192);
        let (requests, stopping, kept) =
            (AtomicU64::new(0), AtomicBool::new(false), AtomicU64::new(0));
        let res = Resources {
            workers: 4,
            max_payload: proto::BLOCK_SIZE_MAX,
            budget: &budget,
            requests_total: &requests,
            stopping: &stopping,
            kept_buffer_bytes: &kept,
        };
        let writer = ReplyWriter::new(Box::new(Vec::new()), Box::new(|| {}));
        let mut input = std::io::empty();
        let conn = Connection::new(&mut input, &writer, &Nothing, &res);
        // four finished 1 MiB requests: the budget keeps three of them
        for _ in 0..4 {
            conn.keep_buffer(Vec::with_capacity(1 << 20));
        }
        assert_eq!(kept.load(Ordering::Relaxed), 3 << 20);
        assert_eq!(conn.spare.lock().unwrap().len(), 3);
        // a 4 KiB request (or a FLUSH) takes none of them along
        assert_eq!(conn.take_buffer(4096).capacity(), 4096);
        assert_eq!(conn.take_buffer(0).capacity(), 0);
        assert_eq!(kept.load(Ordering::Relaxed), 3 << 20);
        // its own small buffer is kept, one per worker at most
        conn.keep_buffer(Vec::with_capacity(4096));
        conn.keep_buffer(Vec::with_capacity(4096));
        assert_eq!(conn.spare.lock().unwrap().len(), 4);
        assert_eq!(kept.load(Ordering::Relaxed), (3 << 20) + 4096);
        assert_eq!(conn.take_buffer(4096).capacity(), 4096);
        // a 512 KiB request does not hold a 1 MiB one: a new buffer of its
        // size; a request up to one granule smaller takes one
        assert_eq!(conn.take_buffer(512 << 10).capacity(), 512 << 10);
        assert_eq!(kept.load(Ordering::Relaxed), 3 << 20);
        assert_eq!(conn.take_buffer((1 << 20) - 4096).capacity(), 1 << 20);
        assert_eq!(kept.load(Ordering::Relaxed), 2 << 20);
        // requests are charged whole granules, a 1 MiB READ's reply too
        assert_eq!(buffer_bytes(1), 4096);
        assert_eq!(buffer_bytes(4096), 4096);
        assert_eq!(buffer_bytes(4096 + proto::SIMPLE_REPLY_HEADER_LEN), 8192);
        // a finished 1 MiB READ's buffer is kept for the next one
        conn.free_spare_buffers();
        let read_1m = buffer_bytes((1 << 20) + proto::SIMPLE_REPLY_HEADER_LEN);
        conn.keep_buffer(Vec::with_capacity(read_1m));
        assert_eq!(conn.take_buffer(read_1m).capacity(), read_1m);
        conn.free_spare_buffers();
        assert_eq!(kept.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn plans() {
        let size = 1 << 30;
        let p = |r: Request| plan(&r, size, false, MAX, Some(4096));
        assert_eq!(p(req(Command::Read, 0, 0, 4096)), Plan::Dispatch);
        assert_eq!(p(req(Command::Read, CMD_FLAG_FUA, 0, 4096)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Read, 0, size - 1, 2)),
            Plan::Reply(NBD_EINVAL)
        );
        assert_eq!(
            p(req(Command::Read, 0, u64::MAX, 2)),
            Plan::Reply(NBD_EINVAL)
        );
        assert_eq!(p(req(Command::Read, 0, 0, MAX)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Read, 0, 0, MAX + 1)),
            Plan::Reply(NBD_EINVAL)
        );
        assert_eq!(
            p(req(Command::Read, CMD_FLAG_NO_HOLE, 0, 1)),
            Plan::Reply(NBD_EINVAL)
        );
        assert_eq!(p(req(Command::Trim, 0, 0, MAX + 1)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Trim, 0, size - 4096, 8192)),
            Plan::Reply(NBD_EINVAL)
        );
        assert_eq!(
            p(req(
                Command::WriteZeroes,
                CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
                0,
                10
            )),
            Plan::Dispatch
        );
        assert_eq!(
            p(req(Command::WriteZeroes, 1 << 9, 0, 10)),
            Plan::Reply(NBD_EINVAL)
        );
        // FAST_ZERO: whole blocks are only unmapped; a partial block would
        // be read and written back, so it fails at once
        let fast = proto::CMD_FLAG_FAST_ZERO;
        assert_eq!(
            p(req(
                Command::WriteZeroes,
                fast | CMD_FLAG_NO_HOLE,
                8192,
                1 << 20
            )),
            Plan::Dispatch
        );
        assert_eq!(
            p(req(Command::WriteZeroes, fast, 8192, 4095)),
            Plan::Reply(proto::NBD_ENOTSUP)
        );
        assert_eq!(
            p(req(Command::WriteZeroes, fast, 512, 4096)),
            Plan::Reply(proto::NBD_ENOTSUP)
        );
        assert_eq!(
            p(req(Command::Trim, fast, 0, 4096)),
            Plan::Reply(NBD_EINVAL)
        );
        // an export without a granule does not advertise the flag
        assert_eq!(
            plan(
                &req(Command::WriteZeroes, fast, 0, 4096),
                size,
                false,
                MAX,
                None
            ),
            Plan::Reply(NBD_EINVAL)
        );
        // (past the end: the range error comes first)
        assert_eq!(
            p(req(Command::WriteZeroes, fast, size, 4096)),
            Plan::Reply(NBD_ENOSPC)
        );
        assert_eq!(
            p(req(Command::Write, 0, size, 1)),
            Plan::SkipPayloadThenReply(NBD_ENOSPC)
        );
        assert_eq!(
            p(req(Command::WriteZeroes, 0, size - 1, 2)),
            Plan::Reply(NBD_ENOSPC)
        );
        assert_eq!(p(req(Command::Write, 0, size - 1, 1)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Write, 4, 0, 1)),
            Plan::SkipPayloadThenReply(NBD_EINVAL)
        );
        assert_eq!(
            p(req(Command::Write, 0, 0, MAX + 1)),
            Plan::ReplyThenClose(NBD_EINVAL)
        );
        assert_eq!(p(req(Command::Flush, 0, 0, 0)), Plan::Dispatch);
        assert_eq!(p(req(Command::Flush, 2, 0, 0)), Plan::Reply(NBD_EINVAL));
        assert_eq!(p(req(Command::Disc, 0, 0, 0)), Plan::Disconnect);
        assert_eq!(
            p(req(Command::Unknown(42), 0, 0, 100)),
            Plan::Reply(NBD_EINVAL)
        );
    }

    #[test]
    fn a_smaller_maximum_payload_refuses_longer_reads_and_writes_cleanly() {
        const SMALL: u32 = 1 << 20;
        let p = |r: Request| plan(&r, 1 << 30, false, SMALL, None);
        assert_eq!(p(req(Command::Read, 0, 0, SMALL)), Plan::Dispatch);
        assert_eq!(p(req(Command::Write, 0, 0, SMALL)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Read, 0, 0, SMALL + 1)),
            Plan::Reply(NBD_EINVAL)
        );
        // (the payload is read and dropped: the connection stays usable)
        assert_eq!(
            p(req(Command::Write, 0, 0, SMALL + 1)),
            Plan::SkipPayloadThenReply(NBD_EINVAL)
        );
        assert_eq!(
            p(req(Command::Write, 0, 0, MAX + 1)),
            Plan::ReplyThenClose(NBD_EINVAL)
        );
        // (no payload: any length)
        assert_eq!(p(req(Command::Trim, 0, 0, SMALL + 1)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::WriteZeroes, 0, 0, SMALL + 1)),
            Plan::Dispatch
        );
    }

    #[test]
    fn read_only_plans() {
        let p = |r: Request| plan(&r, 4096, true, proto::BLOCK_SIZE_MAX, None);
        assert_eq!(p(req(Command::Read, 0, 0, 10)), Plan::Dispatch);
        assert_eq!(
            p(req(Command::Write, 0, 0, 10)),
            Plan::SkipPayloadThenReply(NBD_EPERM)
        );
        assert_eq!(p(req(Command::Trim, 0, 0, 10)), Plan::Reply(NBD_EPERM));
        assert_eq!(
            p(req(Command::WriteZeroes, 0, 0, 10)),
            Plan::Reply(NBD_EPERM)
        );
        assert_eq!(p(req(Command::Flush, 0, 0, 0)), Plan::Dispatch);
    }
}
