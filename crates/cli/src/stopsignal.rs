//! Stopping on signals: a stop flag the server's threads sleep on (a
//! timed wait ends at once when it is raised, and a descriptor becomes
//! readable for `poll`, so an idle server does not wake up to look at it),
//! and the flag of commands that stop early on SIGINT or SIGTERM.

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Raised once, by [`StopSignal::stop`]; never lowered.
pub struct StopSignal {
    stopped: Mutex<bool>,
    raised: Condvar,
    /// A connected pair: readable at the first once stopped (None if it
    /// could not be made: pollers then look every [`POLL_FALLBACK`]).
    wake: Option<(UnixStream, UnixStream)>,
}

/// How often a poller without a wake descriptor looks at the flag.
pub const POLL_FALLBACK: Duration = Duration::from_millis(50);

impl StopSignal {
    /// A signal not raised.
    pub fn new() -> StopSignal {
        StopSignal {
            stopped: Mutex::new(false),
            raised: Condvar::new(),
            wake: UnixStream::pair()
                .and_then(|(r, w)| {
                    w.set_nonblocking(true)?;
                    Ok((r, w))
                })
                .ok(),
        }
    }

    /// Raises the signal: every waiter returns. Idempotent.
    pub fn stop(&self) {
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.raised.notify_all();
        if let Some((_, w)) = &self.wake {
            // (non-blocking: a full buffer already wakes the pollers)
            let _ = (&*w).write(&[1]);
        }
    }

    /// True once raised.
    pub fn is_stopped(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sleeps up to `timeout`, or until raised; true if raised.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let guard = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .raised
            .wait_timeout_while(guard, timeout, |stopped| !*stopped)
            .unwrap_or_else(|e| e.into_inner());
        *guard
    }

    /// A descriptor readable once raised, to `poll` with others.
    pub fn wake_fd(&self) -> Option<RawFd> {
        self.wake.as_ref().map(|(r, _)| r.as_raw_fd())
    }
}

impl Default for StopSignal {
    fn default() -> Self {
        StopSignal::new()
    }
}

/// A flag raised by the first SIGINT or SIGTERM, for a command that stops
/// early on it and keeps what it did (a sweep, an offline pass); a second
/// one ends the process at once, with status 128 + the signal's number
/// (130, 143). The handlers stay registered until the process ends, so a
/// signal is never ignored once this was called (SIGINT included, even if
/// the caller had it ignored, as a script's background job has).
///
/// Errors: registering a handler.
pub fn stop_flag_on_interrupt() -> std::io::Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for (sig, status) in [
        (signal_hook::consts::SIGINT, 130),
        (signal_hook::consts::SIGTERM, 143),
    ] {
        signal_hook::flag::register_conditional_shutdown(sig, status, stop.clone())?;
        signal_hook::flag::register(sig, stop.clone())?;
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn waiters_and_pollers_return_when_raised() {
        let s = Arc::new(StopSignal::new());
        assert!(!s.wait_timeout(Duration::from_millis(10)));
        let fd = s.wake_fd().unwrap();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0);
        let raiser = {
            let s = s.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                s.stop();
            })
        };
        let started = Instant::now();
        assert!(s.wait_timeout(Duration::from_secs(30)));
        assert!(started.elapsed() < Duration::from_secs(10));
        raiser.join().unwrap();
        assert!(s.is_stopped());
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 1);
        s.stop();
        assert!(s.wait_timeout(Duration::ZERO));
    }
}
