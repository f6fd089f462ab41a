//! Transmission phase ("Transmission" section of the spec), simple replies
//! only.
//!
//! One reader (the connection's thread) decodes requests, checks them,
//! reads WRITE payloads and queues the work; a small pool of worker threads
//! calls the [`Export`] and writes each reply whole under a mutex, so
//! replies may leave in any order.

use std::io::{Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};

use crate::budget::{Budget, BudgetGuard};
use crate::export::{Export, ExportError};
use crate::handshake::discard;
use crate::proto::{self, Command, Request};

/// What to do with a decoded request, decided before any payload is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Valid: (read the WRITE payload and) hand it to a worker.
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
/// server's limits; pure.
pub(crate) fn plan(req: &Request, size: u64, read_only: bool) -> Plan {
    let flags_ok = req.flags & !req.command.allowed_flags() == 0;
    let in_range = req
        .offset
        .checked_add(u64::from(req.length))
        .is_some_and(|end| end <= size);
    let too_long = req.length > proto::BLOCK_SIZE_MAX;
    match req.command {
        Command::Disc => Plan::Disconnect,
        Command::Unknown(_) => Plan::Reply(proto::NBD_EINVAL),
        Command::Write => {
            if too_long {
                Plan::ReplyThenClose(proto::NBD_EINVAL)
            } else if !flags_ok {
                Plan::SkipPayloadThenReply(proto::NBD_EINVAL)
            } else if read_only {
                Plan::SkipPayloadThenReply(proto::NBD_EPERM)
            } else if !in_range {
                Plan::SkipPayloadThenReply(proto::NBD_EINVAL)
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
            } else if !in_range {
                Plan::Reply(proto::NBD_EINVAL)
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

/// The sending half of a connection, shared by the reader and workers.
pub(crate) struct ReplyWriter {
    out: Mutex<Box<dyn Write + Send>>,
    hangup: Box<dyn Fn() + Send + Sync>,
    dead: AtomicBool,
}

impl ReplyWriter {
    /// Wraps `out`; `hangup` is called once a write fails (it should shut
    /// the socket down so the reader stops too).
    pub(crate) fn new(out: Box<dyn Write + Send>, hangup: Box<dyn Fn() + Send + Sync>) -> Self {
        ReplyWriter {
            out: Mutex::new(out),
            hangup,
            dead: AtomicBool::new(false),
        }
    }

    /// Writes one whole reply. Returns false if the connection is dead.
    pub(crate) fn send(&self, bytes: &[u8]) -> bool {
        if self.dead.load(Ordering::SeqCst) {
            return false;
        }
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let ok = out.write_all(bytes).and_then(|()| out.flush()).is_ok();
        drop(out);
        if !ok && !self.dead.swap(true, Ordering::SeqCst) {
            (self.hangup)();
        }
        ok
    }
}

/// Server-wide resources a connection uses.
pub(crate) struct Resources<'a> {
    /// Worker threads for this connection (at least one is used).
    pub workers: usize,
    /// Shared in-flight payload budget.
    pub budget: &'a Arc<Budget>,
    /// Counter of decoded requests.
    pub requests_total: &'a AtomicU64,
    /// Server shutdown flag: stop reading new requests once set.
    pub stopping: &'a AtomicBool,
}

struct Job {
    req: Request,
    payload: Vec<u8>,
    _budget: BudgetGuard,
}

/// Runs the transmission phase until the client disconnects, breaks the
/// protocol, the socket fails, or the server shuts down. Returns after
/// every accepted request has been executed and (if possible) replied to.
pub(crate) fn run<R: Read + ?Sized>(
    reader: &mut R,
    writer: Arc<ReplyWriter>,
    export: Arc<dyn Export>,
    res: &Resources<'_>,
) {
    let size = export.size_bytes();
    let read_only = export.read_only();
    let workers = res.workers.max(1);
    let (tx, rx) = sync_channel::<Job>(workers * 2);
    let rx = Arc::new(Mutex::new(rx));

    std::thread::scope(|scope| {
        for _ in 0..workers {
            let rx = Arc::clone(&rx);
            let export = Arc::clone(&export);
            let writer = Arc::clone(&writer);
            scope.spawn(move || worker(&rx, &*export, &writer));
        }

        let mut hdr = [0u8; proto::REQUEST_HEADER_LEN];
        loop {
            if res.stopping.load(Ordering::SeqCst) {
                break;
            }
            if reader.read_exact(&mut hdr).is_err() {
                break;
            }
            let Ok(req) = proto::decode_request(&hdr) else {
                break; // bad magic: cannot resynchronise
            };
            res.requests_total.fetch_add(1, Ordering::Relaxed);
            let len = req.length as usize;
            match plan(&req, size, read_only) {
                Plan::Disconnect => break,
                Plan::Reply(e) => {
                    if !writer.send(&proto::encode_simple_reply(e, req.handle)) {
                        break;
                    }
                }
                Plan::SkipPayloadThenReply(e) => {
                    if discard(reader, u64::from(req.length)).is_err()
                        || !writer.send(&proto::encode_simple_reply(e, req.handle))
                    {
                        break;
                    }
                }
                Plan::ReplyThenClose(e) => {
                    writer.send(&proto::encode_simple_reply(e, req.handle));
                    break;
                }
                Plan::Dispatch => {
                    let bytes = match req.command {
                        Command::Read => len + proto::SIMPLE_REPLY_HEADER_LEN,
                        Command::Write => len,
                        _ => 0,
                    };
                    let guard = res.budget.acquire(bytes);
                    let mut payload = Vec::new();
                    if req.command == Command::Write {
                        payload = vec![0u8; len];
                        if reader.read_exact(&mut payload).is_err() {
                            break;
                        }
                    }
                    let job = Job {
                        req,
                        payload,
                        _budget: guard,
                    };
                    if tx.send(job).is_err() {
                        break;
                    }
                }
            }
        }
        // Closing the queue lets the workers drain it and exit; the scope
        // then waits for them.
        drop(tx);
    });
}

fn worker(rx: &Mutex<Receiver<Job>>, export: &dyn Export, writer: &ReplyWriter) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv()
        };
        match job {
            Ok(job) => execute(job, export, writer),
            Err(_) => return,
        }
    }
}

/// Calls the export, turning a panic into `NBD_EIO`.
fn guarded<T>(f: impl FnOnce() -> Result<T, ExportError>) -> Result<T, ExportError> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(ExportError::Io("export implementation panicked".into())))
}

fn execute(job: Job, export: &dyn Export, writer: &ReplyWriter) {
    let req = job.req;
    let fua = req.flags & proto::CMD_FLAG_FUA != 0;
    let len = u64::from(req.length);
    let result = match req.command {
        Command::Read => {
            let mut buf = vec![0u8; proto::SIMPLE_REPLY_HEADER_LEN + req.length as usize];
            let r = if len == 0 {
                Ok(())
            } else {
                guarded(|| export.read(req.offset, &mut buf[proto::SIMPLE_REPLY_HEADER_LEN..]))
            };
            if r.is_ok() {
                proto::write_simple_reply_header(&mut buf, 0, req.handle);
                writer.send(&buf);
                return;
            }
            r
        }
        Command::Write if len == 0 => Ok(()),
        Command::Write => guarded(|| export.write(req.offset, &job.payload, fua)),
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
    writer.send(&proto::encode_simple_reply(code, req.handle));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, NBD_EINVAL, NBD_EPERM};

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

    #[test]
    fn plans() {
        let size = 1 << 30;
        let p = |r: Request| plan(&r, size, false);
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
        assert_eq!(
            p(req(Command::Write, 0, size, 1)),
            Plan::SkipPayloadThenReply(NBD_EINVAL)
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
    fn read_only_plans() {
        let p = |r: Request| plan(&r, 4096, true);
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
