//! Listeners, connections, shutdown and counters.
//!
//! A [`Server`] accepts connections on TCP and/or Unix listeners (one
//! thread per connection), runs the handshake, then the transmission phase
//! with a few worker threads per connection, each reading, executing and
//! answering whole requests.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::budget::Budget;
use crate::export::ExportProvider;
use crate::handshake::{self, Outcome};
use crate::transmission::{self, ReplySink, ReplyWriter, RequestSource, Resources};

/// After shutdown began, connections still open this long have their
/// reading side shut down (a client stalled in the middle of a request
/// header would otherwise hold the shutdown up).
const SHUTDOWN_STOP_READING_AFTER: Duration = Duration::from_secs(5);
/// After shutdown began, connections still negotiating this long are shut
/// down both ways (a reply blocked on a client that does not read fails at
/// once); until then the options they send are answered
/// `NBD_REP_ERR_SHUTDOWN` (proto.md: a server being shut down SHOULD error
/// further options so).
const SHUTDOWN_NEGOTIATION_GRACE: Duration = Duration::from_secs(1);
/// After shutdown began, connections still open this long are shut down
/// both ways: a client that reads its replies, but slower than a send
/// timeout notices, would otherwise hold the exit up for minutes. Their
/// requests have been carried out by then; only replies not yet read are
/// lost, as in a network failure.
const SHUTDOWN_CLOSE_AFTER: Duration = Duration::from_secs(60);
/// How often an idle accept loop checks for shutdown when it has no wake
/// pair ([`Shared::wake`]).
const ACCEPT_POLL_MS: libc::c_int = 50;
/// Longest wait of an accept loop for a client when the shutdown wakes it
/// (only a safeguard: the wake comes at once).
const IDLE_ACCEPT_POLL_MS: libc::c_int = 5000;
/// A reply write that makes no progress for this long (the client does not
/// read) fails, and the connection is dropped.
const STALLED_CLIENT_SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// After shutdown, a reply that cannot be sent within this time (the client
/// does not read) fails, and the connection is dropped.
const SHUTDOWN_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Read buffer of a connection, in bytes.
pub const READ_BUFFER_BYTES: usize = 128 * 1024;

/// Bytes a connection holds while it negotiates, besides its read buffer:
/// one option's data (at most [`crate::proto::MAX_OPTION_DATA_LEN`], 8 KiB) and
/// the buffer of the replies being sent (8 KiB).
pub const NEGOTIATION_BUFFER_BYTES: usize =
    crate::proto::MAX_OPTION_DATA_LEN as usize + NEGOTIATION_SEND_BUFFER_BYTES;

/// Capacity of a negotiating connection's buffer of replies being sent.
const NEGOTIATION_SEND_BUFFER_BYTES: usize = 8 * 1024;
/// At the end of a connection, bytes the client still sends are read and
/// dropped for up to this long, so that closing the socket does not reset
/// it and destroy replies not yet delivered...
const CLOSE_DRAIN_TIME: Duration = Duration::from_secs(2);
/// ... until the client closes its side or sends nothing for this long.
const CLOSE_DRAIN_IDLE: Duration = Duration::from_millis(200);

/// Tunables of a [`Server`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Worker threads per connection (0 is treated as 1). Each reads one
    /// whole request, executes it and sends its reply, so this many
    /// requests of a connection run concurrently. Default 4.
    pub workers_per_connection: usize,
    /// Bytes of request payload (WRITE data, READ reply buffers) that may be
    /// in flight at once, summed over all connections of the server. A
    /// request waits for room before its buffer is allocated. It also sets
    /// the largest request of every client
    /// ([`ServerConfig::max_payload_bytes`]: half of it, at most 32 MiB),
    /// whether or not it asked for the server's size constraints. One
    /// connection may
    /// hold at most half of it, so a client that
    /// stops reading its replies leaves room for the others' requests of
    /// up to half the budget; requests wait in arrival order, so one
    /// larger than that room waits (until the stalled replies' send times
    /// out) and holds up those behind it. Default 64 MiB.
    pub inflight_budget_bytes: usize,
    /// Connections open at once (handshake or transmission), over all
    /// listeners; one more is accepted and closed at once, and counted in
    /// [`ServerStats::connections_refused`]. Each open connection holds a
    /// read buffer of [`READ_BUFFER_BYTES`]. Default 128.
    pub max_connections: usize,
    /// A WRITE's payload must arrive within this time of its header, plus
    /// 1 s per MiB of payload (a 32 MiB one over a slow link), or the
    /// connection is dropped (it holds its share of the in-flight budget
    /// meanwhile). Default 60 s.
    pub payload_timeout: Duration,
    /// Negotiation must end (in transmission, or the client's abort)
    /// within this time of the connection's accept, or the connection is
    /// closed: a client that stalls, or keeps asking options, cannot hold
    /// a connection slot. An idle connection in transmission is kept (TCP
    /// keepalive probes find a vanished peer: [`TCP_KEEPALIVE_IDLE`]).
    /// Default 30 s.
    pub handshake_timeout: Duration,
}

impl ServerConfig {
    /// Maximum payload size advertised in `NBD_INFO_BLOCK_SIZE`, in bytes
    /// (proto.md "Block size constraints"): half of
    /// [`ServerConfig::inflight_budget_bytes`] rounded down to 4 KiB, at
    /// most 2^25 (32 MiB, the protocol's default and the default here) and
    /// at least 4 KiB (the preferred block size). Every client is held to
    /// it, whether or not it asked for `NBD_INFO_BLOCK_SIZE` (so the
    /// budget bounds memory; proto.md lets a server stricter than the
    /// 32 MiB default error such commands cleanly): a longer READ gets
    /// `NBD_EINVAL`; a longer WRITE of up to 32 MiB has its payload read
    /// and dropped and gets `NBD_EINVAL`. Any client's WRITE over 32 MiB
    /// gets `NBD_EINVAL` and the connection is closed.
    pub fn max_payload_bytes(&self) -> u32 {
        let half = (self.inflight_budget_bytes / 2) as u64 / 4096 * 4096;
        half.clamp(
            u64::from(crate::proto::BLOCK_SIZE_PREFERRED),
            u64::from(crate::proto::BLOCK_SIZE_MAX),
        ) as u32
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers_per_connection: 4,
            inflight_budget_bytes: 64 * 1024 * 1024,
            max_connections: 128,
            payload_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

/// Idle time of a TCP connection before keepalive probes start; with
/// [`TCP_KEEPALIVE_INTERVAL`] and [`TCP_KEEPALIVE_PROBES`], a peer that
/// vanished without closing (power loss, a network partition) is found
/// and its connection closed within about two minutes.
pub const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// Time between keepalive probes.
pub const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered keepalive probes after which the connection is closed.
pub const TCP_KEEPALIVE_PROBES: u32 = 6;

/// Longest a TCP connection's sent data may stay unacknowledged before it
/// is closed (`TCP_USER_TIMEOUT`): keepalive alone never probes while
/// replies wait for an acknowledgement, so a peer that vanished with
/// replies in flight would hold its connection (and its volume open)
/// until the kernel's retransmissions give up, about 15 minutes. The same
/// two minutes as the keepalive timings above.
pub const TCP_UNACKED_TIMEOUT: Duration = Duration::from_secs(120);

/// Turns on TCP keepalive for `stream` with the timings above, and bounds
/// unacknowledged data by [`TCP_UNACKED_TIMEOUT`].
fn set_keepalive(stream: &TcpStream) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| -> io::Result<()> {
        // SAFETY: setsockopt on a socket we own, with a pointer to a live
        // c_int and its size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        TCP_KEEPALIVE_IDLE.as_secs() as libc::c_int,
    )?;
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        TCP_KEEPALIVE_INTERVAL.as_secs() as libc::c_int,
    )?;
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        TCP_KEEPALIVE_PROBES as libc::c_int,
    )?;
    set(
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        TCP_UNACKED_TIMEOUT.as_millis() as libc::c_int,
    )
}

/// A snapshot of a server's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections currently open (handshake or transmission phase).
    pub connections_open: u64,
    /// Connections accepted since the server was created.
    pub connections_total: u64,
    /// Transmission requests decoded since the server was created
    /// (including refused ones and `NBD_CMD_DISC`).
    pub requests_total: u64,
    /// Bytes of payload buffers currently taken from the in-flight budget.
    pub inflight_bytes: u64,
    /// Most bytes [`ServerStats::inflight_bytes`] reached since the
    /// server was created: at most [`ServerConfig::inflight_budget_bytes`],
    /// or one request larger than the budget served alone.
    pub inflight_bytes_peak: u64,
    /// The in-flight budget in bytes ([`ServerConfig::inflight_budget_bytes`]).
    pub inflight_budget_bytes: u64,
    /// Connections closed at once because [`ServerConfig::max_connections`]
    /// were open.
    pub connections_refused: u64,
    /// Bytes of the open connections' read buffers
    /// (`connections_open` × [`READ_BUFFER_BYTES`]).
    pub read_buffer_bytes: u64,
    /// Bytes of request buffers the open connections keep for reuse
    /// between requests: at most one of up to 1 MiB + 4 KiB per worker
    /// of a busy connection, and at most the in-flight budget's bytes in
    /// all; none once a client has sent nothing for a second.
    pub kept_buffer_bytes: u64,
    /// Connections still negotiating (handshake phase).
    pub connections_negotiating: u64,
    /// Bytes the negotiating connections may hold besides their read
    /// buffers (`connections_negotiating` × [`NEGOTIATION_BUFFER_BYTES`]).
    pub negotiation_buffer_bytes: u64,
}

/// A connected socket of either kind, as the connection code needs it.
trait Socket: Read + Write + Send + Sync + 'static {
    fn raw_fd(&self) -> RawFd;
    fn clone_socket(&self) -> io::Result<Box<dyn Socket>>;
    fn shutdown_socket(&self, how: Shutdown) -> io::Result<()>;
    fn set_send_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// `SO_RCVTIMEO`: a read that gets nothing for `t` fails.
    fn set_recv_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Socket for TcpStream {
    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
    fn clone_socket(&self) -> io::Result<Box<dyn Socket>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown_socket(&self, how: Shutdown) -> io::Result<()> {
        self.shutdown(how)
    }
    fn set_send_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(t)
    }
    fn set_recv_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)
    }
}

impl Socket for UnixStream {
    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
    fn clone_socket(&self) -> io::Result<Box<dyn Socket>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown_socket(&self, how: Shutdown) -> io::Result<()> {
        self.shutdown(how)
    }
    fn set_send_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(t)
    }
    fn set_recv_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)
    }
}

impl ReplySink for Box<dyn Socket> {
    fn socket_fd(&self) -> Option<RawFd> {
        Some(self.raw_fd())
    }
}

/// The reading half of a connection: the socket behind a
/// [`READ_BUFFER_BYTES`] buffer, and the time a WRITE payload may take.
struct SocketReader {
    buffered: BufReader<Box<dyn Socket>>,
    payload_timeout: Duration,
    /// While negotiating: when reading must have ended.
    deadline: Option<Instant>,
    /// Readable once the server shuts down ([`Shared::wake`]): a wait for
    /// the client ends then too.
    wake: Option<RawFd>,
}

impl SocketReader {
    fn socket(&self) -> &dyn Socket {
        self.buffered.get_ref().as_ref()
    }

    /// When a payload of `len` bytes starting now must have arrived: the
    /// payload timeout plus 1 s per MiB (a client sending at 1 MiB/s or
    /// more is never cut off).
    fn payload_deadline(&self, len: u64) -> Instant {
        Instant::now() + self.payload_timeout + Duration::from_secs(len >> 20)
    }
}

impl Read for SocketReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(deadline) = self.deadline {
            // (checked on buffered input too: options sent at once and
            // answered slowly must not outlast the deadline)
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "negotiation not finished in time",
                ));
            }
            if self.buffered.buffer().is_empty() {
                self.socket().set_recv_timeout(Some(left))?;
            }
        }
        self.buffered.read(buf)
    }
}

/// One connection counted in [`ServerStats::connections_negotiating`]
/// while it lives.
struct Negotiating<'a>(&'a AtomicU64);

impl<'a> Negotiating<'a> {
    fn count(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Negotiating(counter)
    }
}

impl Drop for Negotiating<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The sending side while negotiating: every send must end by the
/// negotiation's deadline too (a client that reads an option's replies
/// slowly cannot hold its connection past it).
struct NegotiationWriter<'a> {
    socket: &'a mut Box<dyn Socket>,
    deadline: Instant,
    /// The server's shutdown flag (a shutdown's shorter send timeout is
    /// kept).
    stopping: &'a AtomicBool,
}

impl Write for NegotiationWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "negotiation not finished in time",
            ));
        }
        let bound = if self.stopping.load(Ordering::SeqCst) {
            SHUTDOWN_SEND_TIMEOUT
        } else {
            STALLED_CLIENT_SEND_TIMEOUT
        };
        self.socket.set_send_timeout(Some(left.min(bound)))?;
        self.socket.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.socket.flush()
    }
}

impl RequestSource for SocketReader {
    fn input_pending(&mut self) -> bool {
        !self.buffered.buffer().is_empty()
            || wait_readable(self.socket().raw_fd(), None, 0).unwrap_or(false)
    }

    fn wakes_on_stop(&self) -> bool {
        self.wake.is_some()
    }

    fn wait_input(&mut self, timeout: Duration) -> bool {
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        if !self.buffered.buffer().is_empty() {
            return true;
        }
        match wait_readable(self.socket().raw_fd(), self.wake, ms) {
            Ok(readable) => readable,
            // a signal: not input (the caller waits again)
            Err(e) if e.kind() == io::ErrorKind::Interrupted => false,
            // let the read find the error
            Err(_) => true,
        }
    }

    /// Reads the payload within the payload timeout of the call: each read
    /// that has to wait for the socket may wait only for what is left of
    /// that time. A payload already buffered costs no system call.
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if self.buffered.buffer().len() >= buf.len() {
            return self.buffered.read_exact(buf);
        }
        self.read_by(buf, self.payload_deadline(buf.len() as u64))
    }

    /// Reads and drops a refused WRITE's payload within the same payload
    /// timeout, counted for the whole payload.
    fn skip_payload(&mut self, mut len: u64) -> io::Result<()> {
        let deadline = self.payload_deadline(len);
        let mut scratch = vec![0u8; SKIP_CHUNK_BYTES.min(len as usize)];
        while len > 0 {
            let n = scratch
                .len()
                .min(usize::try_from(len).unwrap_or(usize::MAX));
            self.read_by(&mut scratch[..n], deadline)?;
            len -= n as u64;
        }
        Ok(())
    }
}

/// Bytes a refused WRITE's payload is read in (a buffer of the call; the
/// connection's read buffer is in front of it).
const SKIP_CHUNK_BYTES: usize = 16 << 10;

impl SocketReader {
    /// Fills `buf`, failing with `TimedOut` once `deadline` passes while
    /// waiting for the socket.
    fn read_by(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut done = 0;
        let result = loop {
            if done == buf.len() {
                break Ok(());
            }
            if self.buffered.buffer().is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "WRITE payload not received in time",
                    ));
                }
                if let Err(e) = self.socket().set_recv_timeout(Some(left)) {
                    break Err(e);
                }
            }
            match self.buffered.read(&mut buf[done..]) {
                Ok(0) => break Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        let cleared = self.socket().set_recv_timeout(None);
        result.and(cleared)
    }
}

/// State shared by the server, its connections and its shutdown handles.
struct Shared {
    provider: Arc<dyn ExportProvider>,
    config: ServerConfig,
    stopping: AtomicBool,
    budget: Arc<Budget>,
    /// Every open connection's socket (a clone) and phase, for the
    /// shutdown.
    connections: Mutex<HashMap<u64, Registered>>,
    next_id: AtomicU64,
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    requests_total: AtomicU64,
    kept_buffer_bytes: AtomicU64,
    connections_negotiating: AtomicU64,
    /// A connected pair: the accept loops poll the first, the shutdown
    /// writes a byte to the second, so an idle server sleeps in `poll`
    /// instead of waking to look at `stopping` (None if the pair could not
    /// be made: the loops then look every [`ACCEPT_POLL_MS`]).
    wake: Option<(UnixStream, UnixStream)>,
}

impl Shared {
    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Registered>> {
        self.connections.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An NBD server (fixed newstyle handshake, simple replies) serving the
/// exports of one [`ExportProvider`].
///
/// `serve_tcp` and `serve_unix` may run at the same time from different
/// threads; one [`ShutdownHandle`] stops them all.
pub struct Server {
    shared: Arc<Shared>,
}

/// Stops a [`Server`]: see [`ShutdownHandle::shutdown`].
#[derive(Clone)]
pub struct ShutdownHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ShutdownHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownHandle")
            .field("stopping", &self.is_shutdown())
            .finish()
    }
}

impl ShutdownHandle {
    /// Starts the shutdown of the server and returns at once: every
    /// `serve_*` call stops accepting within about 50 ms, every open
    /// connection in transmission answers what its client has already sent
    /// with `NBD_ESHUTDOWN` and stops reading within about 100 ms, in-flight
    /// requests finish and are replied to, connections end with FIN (what
    /// a client sends after it is read and dropped), then the `serve_*`
    /// calls return. Connections still negotiating get
    /// `NBD_REP_ERR_SHUTDOWN` for the options they send in the next second,
    /// then are shut down both ways. A connection still open 5 s later has
    /// its reading side shut down too. A client that does not read its
    /// replies is given 10 s per reply that makes no progress before its
    /// connection is dropped, and any connection still open 60 s after the
    /// shutdown began is shut down both ways (its requests are carried out;
    /// replies not yet sent are lost). Idempotent and permanent.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        if let Some((_, waker)) = &self.shared.wake {
            // (non-blocking: a full pipe already wakes the loops)
            let _ = (&*waker).write(&[1]);
        }
        for r in self.shared.registry().values() {
            stop_socket(r.socket.as_ref());
        }
    }

    /// True once [`ShutdownHandle::shutdown`] has been called.
    pub fn is_shutdown(&self) -> bool {
        self.shared.stopping.load(Ordering::SeqCst)
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.shared.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Server {
    /// A server for the exports of `provider`, tuned by `config`.
    pub fn new(provider: Arc<dyn ExportProvider>, config: ServerConfig) -> Server {
        let budget = Budget::new(config.inflight_budget_bytes);
        Server {
            shared: Arc::new(Shared {
                provider,
                config,
                stopping: AtomicBool::new(false),
                budget,
                connections: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(0),
                connections_open: AtomicU64::new(0),
                connections_total: AtomicU64::new(0),
                connections_refused: AtomicU64::new(0),
                requests_total: AtomicU64::new(0),
                kept_buffer_bytes: AtomicU64::new(0),
                connections_negotiating: AtomicU64::new(0),
                wake: UnixStream::pair()
                    .and_then(|(r, w)| {
                        w.set_nonblocking(true)?;
                        Ok((r, w))
                    })
                    .ok(),
            }),
        }
    }

    /// A handle that shuts this server down from any thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Current counters.
    pub fn stats(&self) -> ServerStats {
        let s = &self.shared;
        let negotiating = s.connections_negotiating.load(Ordering::Relaxed);
        ServerStats {
            connections_open: s.connections_open.load(Ordering::Relaxed),
            connections_total: s.connections_total.load(Ordering::Relaxed),
            requests_total: s.requests_total.load(Ordering::Relaxed),
            inflight_bytes: s.budget.in_use() as u64,
            inflight_bytes_peak: s.budget.peak() as u64,
            inflight_budget_bytes: s.budget.capacity() as u64,
            connections_refused: s.connections_refused.load(Ordering::Relaxed),
            read_buffer_bytes: s.connections_open.load(Ordering::Relaxed)
                * READ_BUFFER_BYTES as u64,
            kept_buffer_bytes: s.kept_buffer_bytes.load(Ordering::Relaxed),
            connections_negotiating: negotiating,
            negotiation_buffer_bytes: negotiating * NEGOTIATION_BUFFER_BYTES as u64,
        }
    }

    /// Accepts NBD clients on `listener` (TCP_NODELAY and keepalive,
    /// [`TCP_KEEPALIVE_IDLE`], are set on each accepted socket) until
    /// shutdown, then waits for this listener's
    /// connections to finish and returns `Ok(())`.
    ///
    /// Errors: a failure to configure or poll the listener. Failed
    /// `accept`s (e.g. too many open files) are retried after a pause.
    /// Returns at once if the server is already shut down.
    pub fn serve_tcp(&self, listener: TcpListener) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let fd = listener.as_raw_fd();
        self.accept_loop(
            || self.wait_for_client(fd),
            || {
                let (stream, _) = listener.accept()?;
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                set_keepalive(&stream)?;
                Ok(Box::new(stream))
            },
        )
    }

    /// Accepts NBD clients on the Unix socket `listener` until shutdown,
    /// then waits for this listener's connections to finish and returns
    /// `Ok(())`. Does not remove the socket file.
    ///
    /// Errors: as [`Server::serve_tcp`].
    pub fn serve_unix(&self, listener: UnixListener) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let fd = listener.as_raw_fd();
        self.accept_loop(
            || self.wait_for_client(fd),
            || {
                let (stream, _) = listener.accept()?;
                stream.set_nonblocking(false)?;
                Ok(Box::new(stream))
            },
        )
    }

    /// Waits until listener `fd` has a client to accept (true), or the
    /// shutdown began or a while passed (false).
    fn wait_for_client(&self, fd: RawFd) -> io::Result<bool> {
        match &self.shared.wake {
            Some((wake, _)) => wait_readable(fd, Some(wake.as_raw_fd()), IDLE_ACCEPT_POLL_MS),
            None => wait_readable(fd, None, ACCEPT_POLL_MS),
        }
    }

    /// Accepts connections until shutdown or a failure of `wait` (true
    /// once a connection waits to be taken; false after a timeout) and
    /// serves each on its own thread; returns once they have all ended.
    fn accept_loop(
        &self,
        mut wait: impl FnMut() -> io::Result<bool>,
        mut accept: impl FnMut() -> io::Result<Box<dyn Socket>>,
    ) -> io::Result<()> {
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let result = loop {
            if self.shared.stopping.load(Ordering::SeqCst) {
                break Ok(());
            }
            threads.retain(|t| !t.is_finished());
            match wait() {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // a listener that fails stops the server: its
                    // connections, which would otherwise wait for their
                    // clients to leave before this returns, and the others
                    self.shutdown_handle().shutdown();
                    break Err(e);
                }
            }
            match accept() {
                Ok(socket) if !self.admit() => drop(socket),
                Ok(socket) => match self.spawn_connection(socket) {
                    Ok(t) => threads.push(t),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                },
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted => {}
                // ECONNABORTED, EMFILE, ENOBUFS...: pause and go on.
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        // In-flight requests finish and connections stop reading by
        // themselves; one whose client stalls in the middle of a request
        // header has its reading side shut down after a while.
        let stopped_at = Instant::now();
        let mut forced = false;
        let mut closed = false;
        while self.shared.stopping.load(Ordering::SeqCst)
            && threads.iter().any(|t| !t.is_finished())
        {
            let since = stopped_at.elapsed();
            if !closed && since >= SHUTDOWN_NEGOTIATION_GRACE {
                for r in self.shared.registry().values() {
                    if !r.transmitting.load(Ordering::SeqCst) {
                        let _ = r.socket.shutdown_socket(Shutdown::Both);
                    }
                }
            }
            if !forced && since >= SHUTDOWN_STOP_READING_AFTER {
                for r in self.shared.registry().values() {
                    let _ = r.socket.shutdown_socket(Shutdown::Read);
                }
                forced = true;
            }
            if !closed && since >= SHUTDOWN_CLOSE_AFTER {
                for r in self.shared.registry().values() {
                    let _ = r.socket.shutdown_socket(Shutdown::Both);
                }
                closed = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for t in threads {
            let _ = t.join();
        }
        result
    }

    /// Counts a just accepted connection as open, unless
    /// [`ServerConfig::max_connections`] are open already (then it is
    /// counted as refused).
    fn admit(&self) -> bool {
        let s = &self.shared;
        let max = s.config.max_connections.max(1) as u64;
        let admitted = s
            .connections_open
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if admitted {
            s.connections_total.fetch_add(1, Ordering::Relaxed);
        } else {
            s.connections_refused.fetch_add(1, Ordering::Relaxed);
        }
        admitted
    }

    /// Runs an admitted connection on its own thread (uncounting it if the
    /// thread cannot be started).
    fn spawn_connection(&self, socket: Box<dyn Socket>) -> io::Result<JoinHandle<()>> {
        let shared = Arc::clone(&self.shared);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || handle_connection(&shared, id, socket));
        if spawned.is_err() {
            self.shared.connections_open.fetch_sub(1, Ordering::SeqCst);
        }
        spawned
    }
}

/// A connection as the shutdown sees it: a handle on its socket, and
/// whether it has reached transmission.
struct Registered {
    socket: Box<dyn Socket>,
    transmitting: Arc<AtomicBool>,
}

/// At shutdown, bounds how long a connection's remaining replies may
/// block on a client that does not read them. A connection in
/// transmission stops reading by itself once nothing more has arrived
/// (its reading side stays open: data a client sends after the server's
/// FIN is then read and dropped, where a shut reading side would answer
/// it with a reset that destroys replies not yet delivered); one still
/// negotiating answers options `NBD_REP_ERR_SHUTDOWN` until
/// [`SHUTDOWN_NEGOTIATION_GRACE`] has passed, when the accept loop shuts
/// it down both ways.
fn stop_socket(socket: &dyn Socket) {
    let _ = socket.set_send_timeout(Some(SHUTDOWN_SEND_TIMEOUT));
}

/// Waits up to `timeout_ms` for `fd` to become readable (true), or for
/// `wake` to (false).
fn wait_readable(fd: RawFd, wake: Option<RawFd>, timeout_ms: libc::c_int) -> io::Result<bool> {
    let pfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let mut fds = [pfd(fd), pfd(wake.unwrap_or(-1))];
    let n = if wake.is_some() { 2 } else { 1 };
    // SAFETY: `fds` holds `n` valid pollfds for the duration of the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n, timeout_ms) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fds[0].revents != 0)
}

/// Unregisters a connection and fixes the counters when it ends.
struct ConnectionGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for ConnectionGuard<'_> {
    fn drop(&mut self) {
        self.shared.registry().remove(&self.id);
        self.shared.connections_open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one admitted connection (already counted open) to its end.
fn handle_connection(shared: &Shared, id: u64, socket: Box<dyn Socket>) {
    let _guard = ConnectionGuard { shared, id };

    let (Ok(control), Ok(read_half), Ok(hangup_half)) = (
        socket.clone_socket(),
        socket.clone_socket(),
        socket.clone_socket(),
    ) else {
        let _ = socket.shutdown_socket(Shutdown::Both);
        return;
    };
    // A client that stops reading its replies cannot block a worker (and
    // the budget its reply holds) for ever.
    let _ = socket.set_send_timeout(Some(STALLED_CLIENT_SEND_TIMEOUT));
    let transmitting = Arc::new(AtomicBool::new(false));
    shared.registry().insert(
        id,
        Registered {
            socket: control,
            transmitting: Arc::clone(&transmitting),
        },
    );
    // A shutdown that ran before the registration did not see this socket.
    if shared.stopping.load(Ordering::SeqCst) {
        stop_socket(socket.as_ref());
    }

    let deadline = Instant::now() + shared.config.handshake_timeout;
    let mut reader = SocketReader {
        buffered: BufReader::with_capacity(READ_BUFFER_BYTES, read_half),
        payload_timeout: shared.config.payload_timeout,
        deadline: Some(deadline),
        wake: shared.wake.as_ref().map(|(r, _)| r.as_raw_fd()),
    };
    let mut writer: Box<dyn Socket> = socket;
    // Replies of one option leave together (negotiate flushes per option).
    let mut buffered = BufWriter::with_capacity(
        NEGOTIATION_SEND_BUFFER_BYTES,
        NegotiationWriter {
            socket: &mut writer,
            deadline,
            stopping: &shared.stopping,
        },
    );
    // A client that does not finish negotiating in time is dropped; an
    // idle client in transmission is not (it may send its next request in
    // hours).
    let max_payload = shared.config.max_payload_bytes();
    let negotiating = Negotiating::count(&shared.connections_negotiating);
    let outcome = handshake::negotiate(
        &mut reader,
        &mut buffered,
        max_payload,
        shared.provider.as_ref(),
        &shared.stopping,
        &transmitting,
    )
    .and_then(|o| {
        reader.deadline = None;
        reader.socket().set_recv_timeout(None)?;
        Ok(o)
    });
    // (a shutdown from now on leaves reading to the transmission phase;
    // one just before made negotiate refuse the options that followed.
    // negotiate marks the connection before its final reply goes out.)
    transmitting.store(true, Ordering::SeqCst);
    drop(buffered);
    drop(negotiating);
    // transmission's bound on a stalled send; a shutdown's shorter one if
    // it began (set after ours, or seen here: the flag is set before the
    // shutdown sets its timeout)
    let _ = writer.set_send_timeout(Some(STALLED_CLIENT_SEND_TIMEOUT));
    if shared.stopping.load(Ordering::SeqCst) {
        let _ = writer.set_send_timeout(Some(SHUTDOWN_SEND_TIMEOUT));
    }
    let hangup_half = Arc::new(hangup_half);
    if let Ok(Outcome::Transmission { export }) = outcome {
        let hangup_socket = Arc::clone(&hangup_half);
        let replies = Arc::new(ReplyWriter::new(
            Box::new(writer),
            Box::new(move || {
                let _ = hangup_socket.shutdown_socket(Shutdown::Both);
            }),
        ));
        let res = Resources {
            workers: shared.config.workers_per_connection,
            max_payload,
            budget: &shared.budget,
            requests_total: &shared.requests_total,
            stopping: &shared.stopping,
            kept_buffer_bytes: &shared.kept_buffer_bytes,
        };
        transmission::run(&mut reader, replies, export, &res);
    }
    close_gracefully(reader.buffered.get_mut().as_mut());
    let _ = hangup_half.shutdown_socket(Shutdown::Both);
}

/// Ends a connection without resetting it: sends FIN after the replies
/// already queued, then reads and drops what the client still sends until
/// it closes its side, pauses for [`CLOSE_DRAIN_IDLE`], or
/// [`CLOSE_DRAIN_TIME`] passes. (Closing a socket with unread input makes
/// the kernel send a reset, which can destroy replies the client has not
/// read yet.)
fn close_gracefully(s: &mut dyn Socket) {
    let _ = s.shutdown_socket(Shutdown::Write);
    let deadline = std::time::Instant::now() + CLOSE_DRAIN_TIME;
    let mut scratch = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero()
            || s.set_recv_timeout(Some(left.min(CLOSE_DRAIN_IDLE)))
                .is_err()
        {
            return;
        }
        match s.read(&mut scratch) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{Export, ExportInfo};

    struct NoExports;

    impl ExportProvider for NoExports {
        fn list(&self) -> Vec<ExportInfo> {
            Vec::new()
        }
        fn open(&self, _: &str) -> Option<Arc<dyn Export>> {
            None
        }
        fn flush_covers_all_connections(&self) -> bool {
            true
        }
    }

    #[test]
    fn accepted_tcp_sockets_bound_unacknowledged_data() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_end, _) = listener.accept().unwrap();
        set_keepalive(&server_end).unwrap();
        let mut ms: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt on a live socket into a c_int of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                server_end.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                (&mut ms as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(ms as u128, TCP_UNACKED_TIMEOUT.as_millis());
    }

    #[test]
    fn a_failing_listener_stops_its_connections_and_returns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listener = UnixListener::bind(&path).unwrap();
        // a client that connects and then says nothing (its connection
        // waits in the handshake, for up to its 30 s deadline)
        let _client = UnixStream::connect(&path).unwrap();
        let server = Server::new(Arc::new(NoExports), ServerConfig::default());
        let mut waits = 0;
        let started = Instant::now();
        let r = server.accept_loop(
            || {
                waits += 1;
                match waits {
                    1 => Ok(true),
                    _ => Err(io::Error::from_raw_os_error(libc::ENOMEM)),
                }
            },
            || {
                let (s, _) = listener.accept()?;
                Ok(Box::new(s) as Box<dyn Socket>)
            },
        );
        assert!(r.is_err());
        assert!(server.shutdown_handle().is_shutdown());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "returned after {:?}",
            started.elapsed()
        );
    }
}
