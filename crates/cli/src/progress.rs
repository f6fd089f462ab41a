//! Progress of long store operations (volume delete and resize, offline
//! dedup, fsck) on stderr: a bar per phase on a terminal; elsewhere (a log
//! file, a pipe, a service manager's journal) a plain line every
//! [`LINE_INTERVAL`], so a long run is seen to move.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Time between progress lines when stderr is not a terminal.
pub(crate) const LINE_INTERVAL: Duration = Duration::from_secs(10);

/// Runs `f` with a progress callback (blocks done, of all) shown under
/// `label` (see [`with_phase_bars`]).
pub(crate) fn with_bar<T>(label: &str, f: impl FnOnce(&mut dyn FnMut(u64, u64)) -> T) -> T {
    with_phase_bars(|progress| f(&mut |done, all| progress(label, done, all)))
}

/// Runs `f` with a progress callback (phase, blocks done, of all). On a
/// terminal each phase gets a bar labelled with it, which appears at the
/// phase's first report and is cleared when the next phase begins or `f`
/// ends; otherwise a [`LineProgress`] line goes to stderr every
/// [`LINE_INTERVAL`].
pub(crate) fn with_phase_bars<T>(f: impl FnOnce(&mut dyn FnMut(&str, u64, u64)) -> T) -> T {
    if !std::io::stderr().is_terminal() {
        let mut lines = LineProgress::new(LINE_INTERVAL, Instant::now());
        return f(&mut |phase, done, all| {
            if let Some(line) = lines.report(phase, done, all, Instant::now()) {
                eprintln!("{line}");
            }
        });
    }
    let mut bar: Option<(String, indicatif::ProgressBar)> = None;
    let result = f(&mut |phase, done, all| {
        if bar.as_ref().is_none_or(|(p, _)| p != phase) {
            if let Some((_, old)) = bar.take() {
                old.finish_and_clear();
            }
        }
        let (_, b) = bar.get_or_insert_with(|| (phase.to_string(), progress_bar(phase)));
        b.set_length(all);
        b.set_position(done);
    });
    if let Some((_, b)) = bar {
        b.finish_and_clear();
    }
    result
}

/// A progress bar on stderr counting blocks, with an ETA; the caller sets
/// its length and position.
fn progress_bar(msg: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {human_pos}/{human_len} blocks, {per_sec:0} (eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(msg.to_string());
    bar
}

/// Progress as text lines: one per `interval` at most, none for a phase
/// that ends within its first interval.
pub(crate) struct LineProgress {
    interval: Duration,
    phase: Option<String>,
    /// When the current phase began (its first report).
    phase_start: Instant,
    /// When the last line was printed, or the phase began.
    last_line: Instant,
}

impl LineProgress {
    /// A reporter whose first line is due `interval` after `now`.
    pub(crate) fn new(interval: Duration, now: Instant) -> Self {
        LineProgress {
            interval,
            phase: None,
            phase_start: now,
            last_line: now,
        }
    }

    /// Takes one report (`done` of `all` blocks in `phase`, at `now`) and
    /// returns the line to print, if one is due: `dedupd: PHASE: DONE/ALL
    /// blocks (P %), R blocks/s, about S s left`. A new phase restarts the
    /// interval.
    pub(crate) fn report(
        &mut self,
        phase: &str,
        done: u64,
        all: u64,
        now: Instant,
    ) -> Option<String> {
        if self.phase.as_deref() != Some(phase) {
            self.phase = Some(phase.to_string());
            self.phase_start = now;
            self.last_line = now;
            return None;
        }
        if now.saturating_duration_since(self.last_line) < self.interval {
            return None;
        }
        self.last_line = now;
        let elapsed_s = now
            .saturating_duration_since(self.phase_start)
            .as_secs_f64();
        let rate_blocks_per_s = if elapsed_s > 0.0 {
            done as f64 / elapsed_s
        } else {
            0.0
        };
        let percent = if all > 0 {
            done as f64 * 100.0 / all as f64
        } else {
            100.0
        };
        let left = if rate_blocks_per_s > 0.0 && all >= done {
            format!(
                ", about {:.0} s left",
                (all - done) as f64 / rate_blocks_per_s
            )
        } else {
            String::new()
        };
        Some(format!(
            "dedupd: {phase}: {done}/{all} blocks ({percent:.0} %), {rate_blocks_per_s:.0} blocks/s{left}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_once_per_interval_and_restart_with_each_phase() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut p = LineProgress::new(Duration::from_secs(10), t0);
        assert_eq!(p.report("scan", 0, 1000, s(0)), None);
        assert_eq!(p.report("scan", 100, 1000, s(9)), None);
        assert_eq!(
            p.report("scan", 200, 1000, s(10)).as_deref(),
            Some("dedupd: scan: 200/1000 blocks (20 %), 20 blocks/s, about 40 s left")
        );
        // not again until another interval has passed
        assert_eq!(p.report("scan", 250, 1000, s(15)), None);
        assert!(p.report("scan", 400, 1000, s(20)).is_some());
        // a new phase is quiet for its first interval
        assert_eq!(p.report("merge", 1, 10, s(25)), None);
        assert_eq!(p.report("merge", 5, 10, s(34)), None);
        assert_eq!(
            p.report("merge", 5, 10, s(35)).as_deref(),
            Some("dedupd: merge: 5/10 blocks (50 %), 0 blocks/s, about 10 s left")
        );
    }
}
