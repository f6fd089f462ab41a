//! System load for adaptive selectivity (SmartDedup §3.4, §4.4: inline
//! dedup backs off when the CPU or the disk is saturated).
//!
//! The reading is CPU and I/O pressure stall information
//! (`/proc/pressure/{cpu,io}`, "some" avg10, percent of time some task
//! waited) where the kernel has it. Without it (a kernel built without
//! PSI, or a container hiding it) the reading is utilisation between two
//! samples: busy CPU time from the `cpu` line of `/proc/stat` (all time but
//! idle and iowait), and for each whole disk the time spent doing I/O from
//! `/proc/diskstats` (`io_ticks`), the busiest disk counting.
//!
//! [`LoadMonitor`] reads the files ([`LoadMonitor::sample`], no lock held)
//! and turns samples into readings ([`LoadMonitor::reading`], pure);
//! [`load_factor`] turns readings into the factor applied to selectivity.

use std::path::Path;
use std::time::{Duration, Instant};

/// Pressure (percent of time stalled) above which the load factor halves.
pub const PRESSURE_HIGH_PERCENT: f64 = 50.0;
/// Pressure below which the load factor goes back to 1.
pub const PRESSURE_LOW_PERCENT: f64 = 20.0;
/// Utilisation (percent busy) above which the load factor halves.
pub const UTILIZATION_HIGH_PERCENT: f64 = 90.0;
/// Utilisation below which the load factor goes back to 1.
pub const UTILIZATION_LOW_PERCENT: f64 = 70.0;
/// Samples further apart than this give no utilisation (an average over
/// an idle spell says nothing of now); the next pair does.
pub const MAX_SAMPLE_GAP: Duration = Duration::from_secs(10);

/// One reading of the system's load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadReading {
    /// The larger of CPU and I/O pressure ("some" avg10), percent.
    Pressure(f64),
    /// The larger of CPU and busiest-disk utilisation since the previous
    /// sample, percent.
    Utilization(f64),
    /// Nothing to go by (no pressure information and no earlier sample,
    /// or the files cannot be read).
    Unknown,
    /// The previous utilisation sample is older than [`MAX_SAMPLE_GAP`]:
    /// the factor it gave is as old, and goes back to 1 (as at start);
    /// the next sample, taken against this one, gives a reading.
    Stale,
}

/// Cumulative counters of one utilisation sample.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageSample {
    /// When the counters were read.
    pub at: Instant,
    /// (busy, total) time of all CPUs, in clock ticks (`/proc/stat`).
    pub cpu: Option<(u64, u64)>,
    /// Milliseconds spent doing I/O, per whole disk (name, `io_ticks`).
    pub disks: Vec<(String, u64)>,
}

/// What [`LoadMonitor::sample`] read.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadSample {
    /// Pressure stall information, percent (the larger of CPU and I/O).
    Pressure(f64),
    /// Utilisation counters (no pressure information).
    Usage(UsageSample),
}

/// Reads the load, keeping the previous utilisation sample.
#[derive(Debug, Default)]
pub struct LoadMonitor {
    previous: Option<UsageSample>,
}

impl LoadMonitor {
    /// Reads the system's files (a few small reads under `/proc` and
    /// `/sys/block`; call without locks others wait on).
    pub fn sample() -> LoadSample {
        match (
            pressure(Path::new("/proc/pressure/cpu")),
            pressure(Path::new("/proc/pressure/io")),
        ) {
            (Some(cpu), Some(io)) => LoadSample::Pressure(cpu.max(io)),
            (Some(p), None) | (None, Some(p)) => LoadSample::Pressure(p),
            (None, None) => LoadSample::Usage(UsageSample {
                at: Instant::now(),
                cpu: std::fs::read_to_string("/proc/stat")
                    .ok()
                    .and_then(|t| cpu_times(&t)),
                disks: std::fs::read_to_string("/proc/diskstats")
                    .map(|t| {
                        disk_io_ticks(&t, |name| {
                            // (nor an NBD client's device: dedupd's own
                            // clients may be behind it)
                            !name.starts_with("loop")
                                && !name.starts_with("ram")
                                && !name.starts_with("nbd")
                                && Path::new("/sys/block").join(name).exists()
                        })
                    })
                    .unwrap_or_default(),
            }),
        }
    }

    /// The reading `sample` gives after the samples before it: pressure
    /// as it is; utilisation against the previous sample (unknown for the
    /// first, stale after [`MAX_SAMPLE_GAP`]).
    pub fn reading(&mut self, sample: LoadSample) -> LoadReading {
        match sample {
            LoadSample::Pressure(p) => {
                self.previous = None;
                LoadReading::Pressure(p)
            }
            LoadSample::Usage(now) => {
                let reading = match &self.previous {
                    Some(prev)
                        if now
                            .at
                            .checked_duration_since(prev.at)
                            .is_some_and(|gap| gap > MAX_SAMPLE_GAP) =>
                    {
                        LoadReading::Stale
                    }
                    Some(prev) => utilization(prev, &now)
                        .map_or(LoadReading::Unknown, LoadReading::Utilization),
                    None => LoadReading::Unknown,
                };
                self.previous = Some(now);
                reading
            }
        }
    }
}

/// The load factor after `reading`, from the `current` one: 0.5 above the
/// high threshold, 1 below the low one, unchanged between them (and when
/// the reading is unknown); 1 after a stale sample.
pub fn load_factor(current: f64, reading: LoadReading) -> f64 {
    let (value, high, low) = match reading {
        LoadReading::Pressure(p) => (p, PRESSURE_HIGH_PERCENT, PRESSURE_LOW_PERCENT),
        LoadReading::Utilization(u) => (u, UTILIZATION_HIGH_PERCENT, UTILIZATION_LOW_PERCENT),
        LoadReading::Unknown => return current,
        LoadReading::Stale => return 1.0,
    };
    if value > high {
        0.5
    } else if value < low {
        1.0
    } else {
        current
    }
}

/// Utilisation between two samples in percent: the larger of CPU busy
/// time and the busiest disk's I/O time (disks present in both). `None`
/// when the samples are out of order, too far apart, or hold nothing to
/// compare.
pub fn utilization(prev: &UsageSample, now: &UsageSample) -> Option<f64> {
    let elapsed = now.at.checked_duration_since(prev.at)?;
    if elapsed.is_zero() || elapsed > MAX_SAMPLE_GAP {
        return None;
    }
    let cpu = match (prev.cpu, now.cpu) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 && b1 >= b0 => {
            Some((b1 - b0) as f64 / (t1 - t0) as f64 * 100.0)
        }
        _ => None,
    };
    let elapsed_ms = elapsed.as_secs_f64() * 1000.0;
    let disk = now
        .disks
        .iter()
        .filter_map(|(name, ticks)| {
            let (_, before) = prev.disks.iter().find(|(n, _)| n == name)?;
            let busy_ms = ticks.checked_sub(*before)?;
            Some(busy_ms as f64 / elapsed_ms * 100.0)
        })
        .reduce(f64::max);
    match (cpu, disk) {
        (None, None) => None,
        (c, d) => Some(c.unwrap_or(0.0).max(d.unwrap_or(0.0)).clamp(0.0, 100.0)),
    }
}

/// "some avg10" of a pressure file, percent; `None` if unreadable.
pub fn pressure(path: &Path) -> Option<f64> {
    pressure_from(&std::fs::read_to_string(path).ok()?)
}

/// "some avg10" of a pressure file's text (`some avg10=1.00 avg60=…`).
pub fn pressure_from(text: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with("some"))
        .and_then(|l| l.split_whitespace().find_map(|f| f.strip_prefix("avg10=")))
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite())
        .map(|v| v.clamp(0.0, 100.0))
}

/// (busy, total) clock ticks from the `cpu` line of `/proc/stat`'s text:
/// total is user + nice + system + idle + iowait + irq + softirq + steal
/// (guest time is inside user), busy is total less idle and iowait.
pub fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let total = v.iter().try_fold(0u64, |a, &x| a.checked_add(x))?;
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total.checked_sub(idle)?, total))
}

/// (name, `io_ticks` in ms) of each device in `/proc/diskstats`'s text for
/// which `whole_disk` holds (partitions and pseudo devices left out).
pub fn disk_io_ticks(diskstats: &str, whole_disk: impl Fn(&str) -> bool) -> Vec<(String, u64)> {
    diskstats
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = *f.get(2)?;
            let ticks = f.get(12)?.parse::<u64>().ok()?;
            whole_disk(name).then(|| (name.to_string(), ticks))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_is_some_avg10() {
        let t = "some avg10=61.50 avg60=10.00 avg300=2.00 total=1\n\
                 full avg10=99.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(pressure_from(t), Some(61.5));
        assert_eq!(pressure_from("full avg10=3.00\n"), None);
        assert_eq!(pressure_from("some avg10=nan\n"), None);
        assert_eq!(pressure_from("some avg10=250\n"), Some(100.0));
    }

    #[test]
    fn cpu_times_leave_out_idle_and_iowait() {
        let stat = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1\n";
        // total 100+5+50+800+40+3+2+0 = 1000; idle + iowait 840
        assert_eq!(cpu_times(stat), Some((160, 1000)));
        assert_eq!(cpu_times("cpu  1 2\n"), None);
        assert_eq!(cpu_times("cpu  a b c d\n"), None);
        assert_eq!(cpu_times("intr 5\n"), None);
    }

    #[test]
    fn disk_ticks_come_from_whole_disks_only() {
        let t = "   8       0 sda 10 0 80 5 20 0 160 9 0 1234 14 0 0 0 0\n\
                 \x20  8       1 sda1 10 0 80 5 20 0 160 9 0 999 14 0 0 0 0\n\
                 \x20  7       0 loop0 1 0 8 1 0 0 0 0 0 50 1 0 0 0 0\n\
                 bad line\n";
        let whole = |n: &str| n == "sda" || n == "loop0";
        assert_eq!(
            disk_io_ticks(t, whole),
            vec![("sda".to_string(), 1234), ("loop0".to_string(), 50)]
        );
    }

    fn usage(at: Instant, cpu: Option<(u64, u64)>, disks: &[(&str, u64)]) -> LoadSample {
        LoadSample::Usage(UsageSample {
            at,
            cpu,
            disks: disks.iter().map(|(n, t)| (n.to_string(), *t)).collect(),
        })
    }

    #[test]
    fn utilization_is_the_busier_of_cpu_and_disks_between_samples() {
        let t0 = Instant::now();
        let mut m = LoadMonitor::default();
        // the first sample has nothing to compare with
        let r = m.reading(usage(t0, Some((0, 0)), &[("sda", 0), ("sdb", 0)]));
        assert_eq!(r, LoadReading::Unknown);
        // 1 s later: CPU 30 % busy, sdb busy 950 ms of 1000
        let r = m.reading(usage(
            t0 + Duration::from_secs(1),
            Some((30, 100)),
            &[("sda", 100), ("sdb", 950)],
        ));
        let LoadReading::Utilization(u) = r else {
            panic!("{r:?}")
        };
        assert!((u - 95.0).abs() < 1e-9, "{u}");
        assert_eq!(load_factor(1.0, r), 0.5);
        // then, with the disks idle: CPU 80 % busy (between thresholds:
        // the factor stays), 10 % (back to 1), and a pair a minute apart
        // (stale: the factor goes back to 1, even from 0.5)
        let idle = [("sda", 100), ("sdb", 950)];
        for (secs, cpu, want, factor) in [
            (2, (110, 200), LoadReading::Utilization(80.0), 0.5),
            (3, (120, 300), LoadReading::Utilization(10.0), 1.0),
            (60, (9000, 9100), LoadReading::Stale, 1.0),
        ] {
            let r = m.reading(usage(t0 + Duration::from_secs(secs), Some(cpu), &idle));
            assert_eq!(r, want, "at {secs} s");
            assert_eq!(load_factor(0.5, r), factor, "at {secs} s");
        }
        // counters that went backwards (a disk replaced) are not a reading
        let r = m.reading(usage(
            t0 + Duration::from_secs(61),
            Some((9000, 9100)),
            &[("sda", 0)],
        ));
        assert_eq!(r, LoadReading::Unknown);
    }

    #[test]
    fn pressure_thresholds_differ_from_utilization_thresholds() {
        assert_eq!(load_factor(1.0, LoadReading::Pressure(60.0)), 0.5);
        assert_eq!(load_factor(0.5, LoadReading::Pressure(30.0)), 0.5);
        assert_eq!(load_factor(0.5, LoadReading::Pressure(10.0)), 1.0);
        assert_eq!(load_factor(1.0, LoadReading::Utilization(60.0)), 1.0);
        assert_eq!(load_factor(0.5, LoadReading::Utilization(80.0)), 0.5);
        assert_eq!(load_factor(0.5, LoadReading::Unknown), 0.5);
        // a pressure reading drops any utilisation sample
        let mut m = LoadMonitor::default();
        let t0 = Instant::now();
        m.reading(usage(t0, Some((0, 0)), &[]));
        assert_eq!(
            m.reading(LoadSample::Pressure(5.0)),
            LoadReading::Pressure(5.0)
        );
        let r = m.reading(usage(t0 + Duration::from_secs(1), Some((50, 100)), &[]));
        assert_eq!(r, LoadReading::Unknown);
    }

    #[test]
    fn this_machine_gives_a_reading_within_bounds() {
        let mut m = LoadMonitor::default();
        m.reading(LoadMonitor::sample());
        std::thread::sleep(Duration::from_millis(50));
        match m.reading(LoadMonitor::sample()) {
            LoadReading::Pressure(p) | LoadReading::Utilization(p) => {
                assert!((0.0..=100.0).contains(&p), "{p}")
            }
            LoadReading::Unknown | LoadReading::Stale => {
                // only without pressure files and without /proc/stat
                assert!(!Path::new("/proc/pressure/cpu").exists());
                assert!(std::fs::read_to_string("/proc/stat").is_err());
            }
        }
    }
}
