//! The control socket `<store>/control.sock`: lets `dedupd stats` and
//! `dedupd volume …` reach a running `dedupd serve`, which holds the store.
//!
//! Protocol: one JSON request line; then, for long operations (volume
//! delete and resize, offline dedup), progress lines
//! `{"progress":{"done":D,"total":T}}` at most every 250 ms (blocks done
//! of all), and `{"working":true}` after 30 s without a line, so a client
//! can tell a busy server from a hung one; then one JSON reply line, the
//! only one with an `"ok"` member. Clients skip the other lines.
//! Requests: `{"cmd":"stats"}`, `{"cmd":"volume_list"}`,
//! `{"cmd":"volume_create","name":N,"size_bytes":S}`,
//! `{"cmd":"volume_resize","name":N,"size_bytes":S,"shrink":B,"force":B}`,
//! `{"cmd":"volume_delete","name":N,"force":B}` (`shrink` and `force`
//! false when absent),
//! `{"cmd":"volume_set","name":N,"sequence_threshold_blocks":T|null}`,
//! `{"cmd":"dedup_offline","volume":N|null}`.
//! Replies: `{"ok":true,"result":…}` or `{"ok":false,"error":"…"}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::stopsignal::StopSignal;

/// A control request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// Engine and server figures.
    Stats,
    /// Every volume.
    VolumeList,
    /// Create a volume.
    VolumeCreate { name: String, size_bytes: u64 },
    /// Resize a volume.
    VolumeResize {
        name: String,
        size_bytes: u64,
        /// A smaller size is allowed (it discards the data past it).
        #[serde(default)]
        shrink: bool,
        /// Go ahead even with NBD connections open to the volume (and
        /// allow a smaller size).
        #[serde(default)]
        force: bool,
    },
    /// Delete a volume.
    VolumeDelete {
        name: String,
        /// Go ahead even with NBD connections open to the volume.
        #[serde(default)]
        force: bool,
    },
    /// Rename a volume.
    VolumeRename { name: String, new_name: String },
    /// Set a volume's sequence threshold (None: the server's default).
    VolumeSet {
        name: String,
        sequence_threshold_blocks: Option<u32>,
    },
    /// Full out-of-line dedup pass over one volume or all.
    DedupOffline { volume: Option<String> },
}

/// Path of the control socket of the store at `store`.
pub fn socket_path(store: &Path) -> PathBuf {
    store.join("control.sock")
}

/// Longest wait for the next line from the server: a long operation
/// sends a line (progress, or that it is working) at least every
/// [`KEEPALIVE_EVERY`].
const REPLY_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest wait for the reply to a request that only reads (`Stats`,
/// `VolumeList`): the server answers those at once unless the engine is
/// stuck (a commit waiting on a disk that does not answer), which its
/// "working" lines would otherwise hide for ever.
#[cfg(not(test))]
const READ_REPLY_DEADLINE: Duration = Duration::from_secs(120);
#[cfg(test)]
const READ_REPLY_DEADLINE: Duration = Duration::from_millis(700);
/// Least time between two progress lines.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Writes all of `buf` to `s` without raising SIGPIPE (`stats` restores
/// its default action, so a plain write to a closed socket would kill the
/// process): a closed peer is an error `BrokenPipe`.
fn send_all(s: &UnixStream, mut buf: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    while !buf.is_empty() {
        // SAFETY: send on a socket descriptor `s` owns, reading from a
        // live buffer of `buf.len()` bytes.
        let n = unsafe {
            libc::send(
                s.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Sends `req` to the server of `store`, passing each progress line
/// (blocks done, of all) to `progress` while the server works; the
/// reply's result or its error.
///
/// Errors: no server listening, no line for [`REPLY_TIMEOUT`], no reply
/// to a request that only reads within [`READ_REPLY_DEADLINE`], a
/// malformed line, or the server's error.
pub fn call(
    store: &Path,
    req: &Request,
    progress: &mut dyn FnMut(u64, u64),
) -> anyhow::Result<Value> {
    let path = socket_path(store);
    let s = match crate::sockpath::SocketPath::new(&path)
        .and_then(|at| UnixStream::connect(at.addr()))
    {
        Ok(s) => s,
        // the store's lock is held, but no server answers on its socket
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            bail!(
                "the store is in use by another dedupd process that does not take requests \
                 (a server starting up or stopping, fsck, or another command); try again when \
                 it is done (a server whose control socket {} was removed takes none until \
                 it is restarted)",
                path.display()
            )
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("connecting to the running server at {}", path.display()))
        }
    };
    s.set_read_timeout(Some(REPLY_TIMEOUT))?;
    let deadline = matches!(req, Request::Stats | Request::VolumeList)
        .then(|| std::time::Instant::now() + READ_REPLY_DEADLINE);
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    // a server at its limit answers busy and closes at once, maybe before
    // the request went out: its reply is still there to read, and the
    // send's error is told only if none is
    let unsent = match send_all(&s, line.as_bytes()) {
        Ok(()) => None,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            Some(e)
        }
        Err(e) => {
            return Err(e).with_context(|| format!("sending to the server at {}", path.display()))
        }
    };
    let unsent_context = |e: anyhow::Error| match &unsent {
        Some(u) => e.context(format!("the request was not sent: {u}")),
        None => e,
    };
    let mut lines = BufReader::new(s);
    loop {
        let mut reply = String::new();
        let read = lines
            .read_line(&mut reply)
            .map_err(|e| unsent_context(e.into()))?;
        if read == 0 {
            return Err(unsent_context(anyhow::anyhow!(
                "the server closed the control connection without a reply (it stopped or \
                 crashed): the operation may be done, cut short or not begun; running the \
                 same command again finishes it, or says why not"
            )));
        }
        let v: Value = serde_json::from_str(&reply).context("malformed reply from the server")?;
        if let Some(p) = v.get("progress") {
            let n = |k: &str| p[k].as_u64().unwrap_or(0);
            progress(n("done"), n("total"));
            continue;
        }
        if v.get("ok").is_none() {
            // {"working":true}: the server is still at it
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                bail!(
                    "the server has not answered in {} s though it says it is working: its \
                     engine may be stuck (a commit waiting on a disk that does not answer)",
                    READ_REPLY_DEADLINE.as_secs()
                );
            }
            continue;
        }
        return if v["ok"].as_bool() == Some(true) {
            Ok(v["result"].clone())
        } else {
            Err(anyhow!("{}", v["error"].as_str().unwrap_or("server error")))
        };
    }
}

/// Control requests answered at once (a thread each); a connection past
/// them is answered busy and closed.
pub const MAX_CONTROL_CONNECTIONS: usize = 16;

/// What answers a request: given it and a progress callback (blocks done,
/// of all), the reply's result.
pub type Handler = dyn Fn(Request, &mut dyn FnMut(u64, u64)) -> anyhow::Result<Value> + Send + Sync;

/// Serves control requests on `listener` until `stop` is raised, answering
/// each with `handle` (one thread per connection, at most
/// [`MAX_CONTROL_CONNECTIONS`] at once); then stops accepting
/// and returns once every request already taken is answered (a volume
/// delete running at shutdown finishes before the store is closed; an
/// offline pass stops early once the engine is told to stop passes).
pub fn serve(
    listener: UnixListener,
    stop: Arc<StopSignal>,
    handle: impl Fn(Request, &mut dyn FnMut(u64, u64)) -> anyhow::Result<Value> + Send + Sync + 'static,
) {
    let handle = Arc::new(handle);
    listener.set_nonblocking(true).ok();
    let mut running: Vec<std::thread::JoinHandle<()>> = Vec::new();
    while !stop.is_stopped() {
        // (asleep until a client connects or the stop is raised)
        if !wait_for_client(&listener, &stop) {
            continue;
        }
        // (the requests that ended while it slept no longer count)
        running.retain(|t| !t.is_finished());
        match listener.accept() {
            // only the server's user (and root) may manage its store
            Ok((stream, _)) if !peer_may_control(&stream) => {
                let mut s = &stream;
                let _ = s.write_all(
                    b"{\"ok\":false,\"error\":\"permission denied: the control socket serves the server's user and root only\"}\n",
                );
            }
            Ok((stream, _)) if running.len() >= MAX_CONTROL_CONNECTIONS => {
                let mut s = &stream;
                let _ = s.write_all(
                    format!(
                        "{{\"ok\":false,\"error\":\"busy: {MAX_CONTROL_CONNECTIONS} control requests are running; try again when one is done\"}}\n"
                    )
                    .as_bytes(),
                );
            }
            Ok((stream, _)) => {
                let handle = handle.clone();
                running.push(std::thread::spawn(move || {
                    let _ = answer(stream, &*handle);
                }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    drop(listener);
    for t in running {
        let _ = t.join();
    }
}

/// Waits until `listener` has a client to accept (true), or `stop` is
/// raised or a while passed (false).
fn wait_for_client(listener: &UnixListener, stop: &StopSignal) -> bool {
    use std::os::fd::AsRawFd;
    let pfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let (wake, timeout) = match stop.wake_fd() {
        // (a safeguard: the wake comes at once)
        Some(fd) => (fd, 5000),
        None => (
            -1,
            crate::stopsignal::POLL_FALLBACK.as_millis() as libc::c_int,
        ),
    };
    let mut fds = [pfd(listener.as_raw_fd()), pfd(wake)];
    // SAFETY: two valid pollfds (a negative fd is ignored by poll).
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
    r > 0 && fds[0].revents != 0
}

/// True if the process at the other end of `stream` runs as the server's
/// user or as root (`SO_PEERCRED`); false if that cannot be told.
fn peer_may_control(stream: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt on a socket we own, into a ucred of the size given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    rc == 0 && (cred.uid == me || cred.uid == 0)
}

/// Longest time a long operation goes without sending a line.
#[cfg(not(test))]
const KEEPALIVE_EVERY: Duration = Duration::from_secs(30);
#[cfg(test)]
const KEEPALIVE_EVERY: Duration = Duration::from_millis(300);

/// The lines a long operation sends before its reply. Each is written
/// whole, with a write timeout; after a failed write (the client left, or
/// stopped reading) nothing more is sent, and the operation goes on.
struct InfoLines<'a> {
    stream: &'a UnixStream,
    last: Instant,
    last_progress: Option<Instant>,
    failed: bool,
}

impl InfoLines<'_> {
    fn send(&mut self, line: &Value) {
        if self.failed {
            return;
        }
        let mut bytes = serde_json::to_vec(line).unwrap_or_default();
        bytes.push(b'\n');
        let mut out = self.stream;
        self.failed = out.write_all(&bytes).is_err();
        self.last = Instant::now();
    }
}

fn answer(stream: UnixStream, handle: &Handler) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    let mut line = String::new();
    // the whole request within REQUEST_TIME (a client trickling bytes
    // cannot hold a thread, nor the shutdown that joins it)
    BufReader::new(Deadline {
        stream: stream.try_clone()?,
        until: Instant::now() + REQUEST_TIME,
    })
    .take_line(&mut line)?;
    let lines = std::sync::Mutex::new(InfoLines {
        stream: &stream,
        last: Instant::now(),
        last_progress: None,
        failed: false,
    });
    let lock = || lines.lock().unwrap_or_else(|e| e.into_inner());
    let mut progress = |done: u64, total: u64| {
        let mut l = lock();
        if l.last_progress
            .is_none_or(|t| t.elapsed() >= PROGRESS_EVERY)
        {
            l.last_progress = Some(Instant::now());
            l.send(&serde_json::json!({"progress": {"done": done, "total": total}}));
        }
    };
    let working = AtomicBool::new(true);
    let reply = std::thread::scope(|s| {
        let keepalive = s.spawn(|| {
            while working.load(Ordering::Relaxed) {
                std::thread::park_timeout(Duration::from_millis(100));
                let mut l = lock();
                if l.last.elapsed() >= KEEPALIVE_EVERY {
                    l.send(&serde_json::json!({"working": true}));
                }
            }
        });
        // a panic in the handler is answered as an error (the keepalive
        // thread must stop either way, or the client would wait for ever
        // and the server's shutdown with it)
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                handle(req, &mut progress)
            })) {
                Ok(Ok(result)) => serde_json::json!({"ok": true, "result": result}),
                Ok(Err(e)) => serde_json::json!({"ok": false, "error": format!("{e:#}")}),
                Err(_) => {
                    serde_json::json!({"ok": false, "error": "internal error (the operation panicked; see the server's output)"})
                }
            },
            Err(e) => serde_json::json!({"ok": false, "error": format!("bad request: {e}")}),
        };
        // (woken, so a quick request is not held up by its sleep)
        working.store(false, Ordering::Relaxed);
        keepalive.thread().unpark();
        reply
    });
    let mut bytes = serde_json::to_vec(&reply).unwrap_or_default();
    bytes.push(b'\n');
    (&stream).write_all(&bytes)
}

/// Time a client has to send its whole request line.
#[cfg(not(test))]
const REQUEST_TIME: Duration = Duration::from_secs(10);
#[cfg(test)]
const REQUEST_TIME: Duration = Duration::from_secs(1);

/// A socket read until a deadline: each read waits only for what is left
/// of it, and fails with `TimedOut` once it has passed.
struct Deadline {
    stream: UnixStream,
    until: Instant,
}

impl std::io::Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "request not received in time",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

trait TakeLine {
    fn take_line(self, out: &mut String) -> std::io::Result<usize>;
}

impl<R: std::io::Read> TakeLine for BufReader<R> {
    /// Reads one line of at most 64 KiB.
    fn take_line(self, out: &mut String) -> std::io::Result<usize> {
        use std::io::Read;
        BufReader::new(self.take(64 * 1024)).read_line(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A server whose handler reports `steps` progress steps 100 ms apart
    /// for `volume_delete`, then answers; `stats` fails.
    fn start(dir: &Path, finished: Arc<AtomicU64>) -> Arc<StopSignal> {
        let listener = UnixListener::bind(socket_path(dir)).unwrap();
        let stop = Arc::new(StopSignal::new());
        let s = stop.clone();
        std::thread::spawn(move || {
            serve(listener, s, move |req, progress| match req {
                Request::VolumeDelete { name, .. } => {
                    for done in 0..=8u64 {
                        progress(done, 8);
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok(Value::String(name))
                }
                Request::VolumeCreate { .. } => {
                    // long, without progress
                    std::thread::sleep(Duration::from_millis(1000));
                    Ok(Value::Null)
                }
                Request::VolumeList => {
                    // stuck (only reads: the client gives up)
                    std::thread::sleep(Duration::from_millis(3000));
                    Ok(Value::Null)
                }
                _ => bail!("no such thing"),
            })
        });
        stop
    }

    #[test]
    fn progress_lines_come_before_the_reply_and_errors_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let finished = Arc::new(AtomicU64::new(0));
        let stop = start(dir.path(), finished.clone());
        let mut seen = Vec::new();
        let req = Request::VolumeDelete {
            name: "v".into(),
            force: false,
        };
        let r = call(dir.path(), &req, &mut |d, t| seen.push((d, t))).unwrap();
        assert_eq!(r, Value::String("v".into()));
        assert_eq!(finished.load(Ordering::SeqCst), 1);
        // about 900 ms of work (longer on a loaded machine), a line at
        // most every 250 ms, one per step at most
        assert!((2..=9).contains(&seen.len()), "{seen:?}");
        assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");
        assert!(seen.iter().all(|&(d, t)| t == 8 && d <= 8), "{seen:?}");
        let e = call(dir.path(), &Request::Stats, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("no such thing"), "{e}");
        stop.stop();
    }

    #[test]
    fn a_long_operation_without_progress_says_it_is_working() {
        let dir = tempfile::tempdir().unwrap();
        let stop = start(dir.path(), Arc::new(AtomicU64::new(0)));
        let mut s = UnixStream::connect(socket_path(dir.path())).unwrap();
        let req = Request::VolumeCreate {
            name: "v".into(),
            size_bytes: 4096,
        };
        writeln!(s, "{}", serde_json::to_string(&req).unwrap()).unwrap();
        let lines: Vec<Value> = BufReader::new(&s)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect();
        let (reply, before) = lines.split_last().unwrap();
        assert_eq!(reply["ok"], true, "{lines:?}");
        assert!(!before.is_empty(), "{lines:?}");
        assert!(before.iter().all(|l| l["working"] == true), "{lines:?}");
        // and the client takes the reply after them
        let r = call(dir.path(), &req, &mut |_, _| {}).unwrap();
        assert_eq!(r, Value::Null);
        stop.stop();
    }

    #[test]
    fn a_request_that_only_reads_gives_up_on_a_stuck_server() {
        let dir = tempfile::tempdir().unwrap();
        let stop = start(dir.path(), Arc::new(AtomicU64::new(0)));
        let started = std::time::Instant::now();
        let e = call(dir.path(), &Request::VolumeList, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("stuck"), "{e}");
        assert!(started.elapsed() < Duration::from_millis(2500));
        stop.stop();
    }

    #[test]
    fn a_panicking_operation_is_answered_and_does_not_hold_the_stop() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(socket_path(dir.path())).unwrap();
        let stop = Arc::new(StopSignal::new());
        let s = stop.clone();
        let server = std::thread::spawn(move || {
            serve(listener, s, move |_, _| -> anyhow::Result<Value> {
                panic!("a bug in an operation")
            })
        });
        let e = call(dir.path(), &Request::VolumeList, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("internal error"), "{e}");
        stop.stop();
        server.join().unwrap();
    }

    #[test]
    fn connections_past_the_limit_are_answered_busy() {
        let dir = tempfile::tempdir().unwrap();
        let stop = start(dir.path(), Arc::new(AtomicU64::new(0)));
        let req = Request::VolumeCreate {
            name: "v".into(),
            size_bytes: 4096,
        };
        // the limit of long requests (each runs 1 s)
        let held: Vec<UnixStream> = (0..MAX_CONTROL_CONNECTIONS)
            .map(|_| {
                let mut s = UnixStream::connect(socket_path(dir.path())).unwrap();
                writeln!(s, "{}", serde_json::to_string(&req).unwrap()).unwrap();
                s
            })
            .collect();
        // (the server takes them in 50 ms steps at worst)
        std::thread::sleep(Duration::from_millis(300));
        let e = call(dir.path(), &Request::VolumeList, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("busy"), "{e}");
        for s in held {
            let last = BufReader::new(&s).lines().last().unwrap().unwrap();
            assert!(last.contains("\"ok\":true"), "{last}");
        }
        // room again
        let r = call(dir.path(), &req, &mut |_, _| {}).unwrap();
        assert_eq!(r, Value::Null);
        stop.stop();
    }

    #[test]
    fn the_servers_own_user_may_control_it() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(peer_may_control(&a));
    }

    #[test]
    fn a_client_trickling_its_request_is_cut_off_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let stop = start(dir.path(), Arc::new(AtomicU64::new(0)));
        let mut s = UnixStream::connect(socket_path(dir.path())).unwrap();
        // a byte every 200 ms, each well within a per-read timeout; the
        // server closes the connection once the request's time is up
        let mut closed = false;
        for _ in 0..25 {
            if s.write_all(b" ").is_err() {
                closed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(closed, "still reading a request after 5 s");
        stop.stop();
    }

    #[test]
    fn stopping_waits_for_the_operations_already_taken() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(socket_path(dir.path())).unwrap();
        let stop = Arc::new(StopSignal::new());
        let done = Arc::new(AtomicBool::new(false));
        let (s, d) = (stop.clone(), done.clone());
        let (taken_tx, taken) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            serve(listener, s, move |_, _| {
                let _ = taken_tx.send(());
                std::thread::sleep(Duration::from_millis(500));
                d.store(true, Ordering::SeqCst);
                Ok(Value::Null)
            })
        });
        let client = {
            let dir = dir.path().to_path_buf();
            std::thread::spawn(move || call(&dir, &Request::VolumeList, &mut |_, _| {}))
        };
        // the request is taken, then the server is told to stop
        taken.recv().unwrap();
        stop.stop();
        server.join().unwrap();
        assert!(done.load(Ordering::SeqCst), "serve returned mid-operation");
        assert_eq!(client.join().unwrap().unwrap(), Value::Null);
    }

    #[test]
    fn a_client_that_leaves_does_not_stop_the_operation() {
        let dir = tempfile::tempdir().unwrap();
        let finished = Arc::new(AtomicU64::new(0));
        let stop = start(dir.path(), finished.clone());
        {
            let mut s = UnixStream::connect(socket_path(dir.path())).unwrap();
            let req = serde_json::to_string(&Request::VolumeDelete {
                name: "v".into(),
                force: false,
            });
            writeln!(s, "{}", req.unwrap()).unwrap();
            // read the first progress line, then go away
            let mut first = String::new();
            BufReader::new(&s).read_line(&mut first).unwrap();
            assert!(first.contains("progress"), "{first}");
        }
        let t = Instant::now();
        while finished.load(Ordering::SeqCst) == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the operation stopped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.stop();
    }
}
