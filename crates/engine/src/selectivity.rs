//! Adaptive selectivity (SmartDedup §3.4, §4.4): inline dedup fingerprints
//! only a fraction of the blocks written; the rest are stored at once and
//! recorded in the skipped buffer for out-of-line dedup, which fingerprints
//! them later.
//!
//! The fraction is the product of three factors:
//! - **duplication level**: per window of at least 150 selected blocks
//!   (counted in blocks, not requests: a large request can fill a window
//!   alone), the share of duplicates found, divided by the fraction then
//!   selected (only that share of earlier copies was indexed: undivided,
//!   each step down would read as a further fall), is compared with the
//!   mean of the last 30 windows' figures; when it falls the factor is multiplied
//!   by 0.9 (floor 30 %), when it rises by 1.3 (cap 100 %) — the paper's
//!   "10 %" and "30 %" read as relative steps; the first three windows
//!   only fill the history (a mean of fewer says little);
//! - **load** (with `load_aware`): when CPU or I/O pressure
//!   (`/proc/pressure/{cpu,io}`, "some" avg10) passes 50 %, the factor
//!   halves; under 20 % it is 1. Without pressure stall information (a
//!   kernel built without PSI, or a container hiding it), CPU utilisation
//!   (`/proc/stat`) or the busiest disk's (`/proc/diskstats`) over 90 %
//!   halves it and under 70 % gives 1 (see [`crate::load`]);
//! - **power**: on mains 1; on battery the charge fraction
//!   (`/sys/class/power_supply`: system batteries, not those of devices
//!   such as a wireless mouse; an online mains or USB supply means mains);
//!   0 (inline dedup off) in low-power mode, below 15 % charge.
//!   `--power-source` overrides the reading for tests.
//!
//! Zero blocks are never stored and take no part in the selection (nor in
//! `blocks_selected`): requests alternating zero and data blocks would
//! otherwise leave the data blocks all selected or all not.
//!
//! Blocks are selected in bursts, not at random, so replays are
//! deterministic: of every [`PERIOD_BLOCKS`] blocks (counted across
//! requests) the first `round(fraction × 64)` are selected, the fraction
//! read at the period's start. Consecutive blocks stay together — a large
//! request, or a sequential stream of small ones, keeps runs of selected
//! blocks (32 at a fraction of 0.5, 19 at the 30 % floor) that the
//! sequence threshold of a volume with T > 1 can share, where picking
//! every other block would leave no run longer than one.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Blocks per selection period: the selected ones of a period are its
/// first, consecutive (see the module docs).
pub const PERIOD_BLOCKS: u32 = 64;

/// Writes per duplication-level window.
pub const WINDOW_WRITES: u64 = 150;
/// Windows averaged for the comparison.
pub const HISTORY_WINDOWS: usize = 30;
/// Floor of the duplication-level factor.
pub const FLOOR: f64 = 0.3;
/// Difference between a window's duplication level and the mean of the
/// last windows' below which the level counts as unchanged (rounding).
const LEVEL_TOLERANCE: f64 = 1e-9;
const LOW_POWER_PERCENT: f64 = 15.0;

/// Where power comes from, as configured (`--power-source`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub enum PowerSource {
    /// Read `/sys/class/power_supply` (mains if nothing is found).
    #[default]
    Auto,
    /// Mains power.
    Ac,
    /// Battery at this charge, in percent (0–100).
    Battery(f64),
}

impl std::str::FromStr for PowerSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(PowerSource::Auto),
            "ac" => Ok(PowerSource::Ac),
            _ => s
                .strip_prefix("battery:")
                .and_then(|p| p.trim_end_matches('%').parse::<f64>().ok())
                .filter(|p| (0.0..=100.0).contains(p))
                .map(PowerSource::Battery)
                .ok_or_else(|| {
                    format!("invalid power source {s:?}: use auto, ac or battery:PERCENT")
                }),
        }
    }
}

/// Configuration of the controller.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SelectivityConfig {
    /// Adapt to the duplication level (otherwise that factor stays 1).
    pub adaptive: bool,
    /// Back off under CPU or I/O pressure (default off: on a shared server
    /// a busy neighbour would turn inline dedup down).
    pub load_aware: bool,
    /// Power source.
    pub power: PowerSource,
}

/// The server's default (`--selectivity full`): every block fingerprinted
/// inline, whatever the duplication level, load or battery of the host
/// (so a store's behaviour, and its tests', do not depend on the machine).
impl Default for SelectivityConfig {
    fn default() -> Self {
        SelectivityConfig {
            adaptive: false,
            load_aware: false,
            power: PowerSource::Ac,
        }
    }
}

/// Current selectivity and its factors, for `dedupd stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SelectivityStats {
    /// Fraction of blocks fingerprinted inline now (0–1).
    pub selectivity: f64,
    /// Duplication-level factor.
    pub duplication_factor: f64,
    /// Load factor.
    pub load_factor: f64,
    /// Power factor.
    pub power_factor: f64,
    /// Non-zero blocks chosen for inline fingerprinting, counted when
    /// chosen (CAFTL's filters may still skip some; a partial-block write
    /// retried after a race counts again).
    pub blocks_selected: u64,
    /// Non-zero blocks held back for out-of-line dedup, counted likewise.
    pub blocks_unselected: u64,
}

struct State {
    dup_factor: f64,
    window_writes: u64,
    window_dups: u64,
    history: VecDeque<f64>,
    /// Position in the selection period, 0 to [`PERIOD_BLOCKS`] − 1.
    period_pos: u32,
    /// Blocks selected at the start of the current period.
    period_selected: u32,
    load_factor: f64,
    power_factor: f64,
    load: crate::load::LoadMonitor,
    sampled: Option<Instant>,
    selected: u64,
    unselected: u64,
}

/// The selectivity controller; cheap to call per block.
pub struct Selectivity {
    cfg: SelectivityConfig,
    state: Mutex<State>,
}

impl Selectivity {
    /// A controller starting at full selectivity.
    pub fn new(cfg: SelectivityConfig) -> Self {
        Selectivity {
            cfg,
            state: Mutex::new(State {
                dup_factor: 1.0,
                window_writes: 0,
                window_dups: 0,
                history: VecDeque::new(),
                period_pos: 0,
                period_selected: 0,
                load_factor: 1.0,
                power_factor: 1.0,
                load: crate::load::LoadMonitor::default(),
                sampled: None,
                selected: 0,
                unselected: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides for `n` blocks which are fingerprinted inline.
    pub fn select(&self, n: usize) -> Vec<bool> {
        self.refresh();
        let mut s = self.lock();
        let product = s.dup_factor * s.load_factor * s.power_factor;
        // (a reading gone wrong must not stop selection for good)
        let fraction = if product.is_finite() {
            product.clamp(0.0, 1.0)
        } else {
            1.0
        };
        (0..n)
            .map(|_| {
                // (fixed at the period's start; a lower fraction, as on
                // entering low-power mode, applies at once)
                let now = (fraction * f64::from(PERIOD_BLOCKS)).round() as u32;
                if s.period_pos == 0 || now < s.period_selected {
                    s.period_selected = now;
                }
                let selected = s.period_pos < s.period_selected;
                s.period_pos = (s.period_pos + 1) % PERIOD_BLOCKS;
                if selected {
                    s.selected += 1;
                } else {
                    s.unselected += 1;
                }
                selected
            })
            .collect()
    }

    /// Feeds the outcome of selected blocks: `writes` fingerprinted, of
    /// which `duplicates` were found inline.
    pub fn observe(&self, writes: u64, duplicates: u64) {
        if !self.cfg.adaptive || writes == 0 {
            return;
        }
        let mut s = self.lock();
        s.window_writes += writes;
        s.window_dups += duplicates;
        if s.window_writes < WINDOW_WRITES {
            return;
        }
        // (per block fingerprinted, found among the blocks indexed: with a
        // fraction f selected, a duplicate's earlier copy was indexed
        // about f of the time, so the share found is about f × the level.
        // Divided by f, a window after a step down is compared with those
        // before it at the level itself — not as a further fall, which
        // would step down again and again to the floor)
        let fraction = (s.dup_factor * s.load_factor * s.power_factor).clamp(0.01, 1.0);
        let level = s.window_dups as f64 / s.window_writes as f64 / fraction;
        if s.history.len() >= 3 {
            let mean = s.history.iter().sum::<f64>() / s.history.len() as f64;
            // (a mean of equal levels is not always bit-equal to them: a
            // steady level must not read as falling; real changes are at
            // least 1/150 of one window's share)
            if level < mean - LEVEL_TOLERANCE {
                s.dup_factor = (s.dup_factor * 0.9).max(FLOOR);
            } else if level > mean + LEVEL_TOLERANCE {
                s.dup_factor = (s.dup_factor * 1.3).min(1.0);
            }
        }
        s.history.push_back(level);
        if s.history.len() > HISTORY_WINDOWS {
            s.history.pop_front();
        }
        s.window_writes = 0;
        s.window_dups = 0;
    }

    /// Re-reads load and power at most once a second. The files are read
    /// without the lock every write's [`Selectivity::select`] takes (a
    /// battery read through ACPI can take tens of milliseconds); the
    /// thread that finds the reading stale claims it, the others go on
    /// with the factors they have.
    fn refresh(&self) {
        {
            let mut s = self.lock();
            if s.sampled
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
            {
                return;
            }
            s.sampled = Some(Instant::now());
        }
        let load = self.cfg.load_aware.then(crate::load::LoadMonitor::sample);
        let power = power_factor(self.cfg.power);
        let mut s = self.lock();
        s.load_factor = match load {
            None => 1.0,
            Some(sample) => {
                let reading = s.load.reading(sample);
                crate::load::load_factor(s.load_factor, reading)
            }
        };
        s.power_factor = power;
    }

    /// Share of its rate the out-of-line worker may run at: the power
    /// factor with adaptive selectivity (0 in low-power mode: SmartDedup
    /// §3.4 turns dedup off there, so the blocks inline dedup skipped wait
    /// in the skipped buffer instead of being hashed in the background),
    /// 1 otherwise. Re-reads power at most once a second.
    pub fn out_of_line_share(&self) -> f64 {
        if !self.cfg.adaptive {
            return 1.0;
        }
        self.refresh();
        self.lock().power_factor.clamp(0.0, 1.0)
    }

    /// Figures for `dedupd stats`.
    pub fn stats(&self) -> SelectivityStats {
        self.refresh();
        let s = self.lock();
        SelectivityStats {
            selectivity: (s.dup_factor * s.load_factor * s.power_factor).clamp(0.0, 1.0),
            duplication_factor: s.dup_factor,
            load_factor: s.load_factor,
            power_factor: s.power_factor,
            blocks_selected: s.selected,
            blocks_unselected: s.unselected,
        }
    }
}

/// 1 on mains, the charge fraction on battery, 0 in low-power mode.
fn power_factor(src: PowerSource) -> f64 {
    let on_battery = |pct: f64| {
        if pct < LOW_POWER_PERCENT {
            0.0
        } else {
            pct / 100.0
        }
    };
    match src {
        PowerSource::Ac => 1.0,
        PowerSource::Battery(p) => on_battery(p),
        PowerSource::Auto => power_factor_from(Path::new("/sys/class/power_supply")),
    }
}

/// [`power_factor`] from the supplies under `root` (`/sys/class/power_supply`):
/// 1 if any supply other than a battery (mains, USB, USB-C/PD, a UPS, a
/// wireless charger) is online or no system battery is discharging; else
/// the charge left in all system batteries together (an idle second pack
/// counts: the machine draws on it once the first runs down) — Σ
/// `energy_now` ÷ Σ `energy_full` when every battery reports them, else the
/// same by `charge_*`, else the mean `capacity` — and 0 below 15 %.
/// Batteries of devices (`scope` `Device`: a wireless mouse or headset) do
/// not count, nor readings that are not a number; none at all reads as
/// full.
fn power_factor_from(root: &Path) -> f64 {
    let Ok(dir) = std::fs::read_dir(root) else {
        return 1.0;
    };
    let read = |p: &Path, f: &str| {
        std::fs::read_to_string(p.join(f))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let number = |p: &Path, f: &str| read(p, f).parse::<f64>().ok().filter(|v| v.is_finite());
    let mut discharging = false;
    // each system battery's (now, full) in µWh, in µAh, and its capacity %
    let (mut energy, mut charge, mut percent) = (Vec::new(), Vec::new(), Vec::new());
    let mut batteries = 0;
    for e in dir.flatten() {
        let p = e.path();
        if read(&p, "scope") == "Device" {
            continue;
        }
        match read(&p, "type").as_str() {
            "Battery" => {
                batteries += 1;
                discharging |= read(&p, "status") == "Discharging";
                if let (Some(now), Some(full)) =
                    (number(&p, "energy_now"), number(&p, "energy_full"))
                {
                    energy.push((now, full));
                }
                if let (Some(now), Some(full)) =
                    (number(&p, "charge_now"), number(&p, "charge_full"))
                {
                    charge.push((now, full));
                }
                if let Some(c) = number(&p, "capacity") {
                    percent.push(c.clamp(0.0, 100.0));
                }
            }
            // any other supply online (mains, USB, USB-C/PD, a UPS, a
            // wireless charger) powers the machine
            "" => {}
            _ if read(&p, "online") == "1" => return 1.0,
            _ => {}
        }
    }
    if !discharging {
        return 1.0;
    }
    // the charge left in all of them together: by energy if every battery
    // reports it, else by charge, else the mean of their percentages
    let total = |pairs: &[(f64, f64)]| {
        let (now, full) = pairs
            .iter()
            .fold((0.0, 0.0), |(n, f), &(a, b)| (n + a, f + b));
        (full > 0.0).then(|| (100.0 * now / full).clamp(0.0, 100.0))
    };
    let pct = (energy.len() == batteries)
        .then(|| total(&energy))
        .flatten()
        .or_else(|| {
            (charge.len() == batteries)
                .then(|| total(&charge))
                .flatten()
        })
        .or_else(|| {
            (!percent.is_empty()).then(|| percent.iter().sum::<f64>() / percent.len() as f64)
        });
    match pct {
        // (no reading: taken as full)
        None => 1.0,
        Some(pct) if pct < LOW_POWER_PERCENT => 0.0,
        Some(pct) => pct / 100.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(power: PowerSource) -> Selectivity {
        Selectivity::new(SelectivityConfig {
            adaptive: true,
            load_aware: false,
            power,
        })
    }

    #[test]
    fn a_steady_duplication_level_keeps_the_selectivity() {
        let s = fixed(PowerSource::Ac);
        // 10 % duplicates in every window (0.1 has no exact f64)
        for _ in 0..40 {
            s.observe(150, 15);
        }
        assert_eq!(s.stats().duplication_factor, 1.0);
    }

    #[test]
    fn power_comes_from_system_batteries_and_mains_only() {
        let supply = |root: &Path, name: &str, files: &[(&str, &str)]| {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            for (f, v) in files {
                std::fs::write(d.join(f), format!("{v}\n")).unwrap();
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // a wireless mouse at 10 %, discharging: not the machine's power
        supply(
            root,
            "hidpp_battery_0",
            &[
                ("type", "Battery"),
                ("scope", "Device"),
                ("status", "Discharging"),
                ("capacity", "10"),
            ],
        );
        assert_eq!(power_factor_from(root), 1.0);
        // the system battery, discharging at 60 %
        supply(
            root,
            "BAT0",
            &[
                ("type", "Battery"),
                ("status", "Discharging"),
                ("capacity", "60"),
            ],
        );
        assert!((power_factor_from(root) - 0.6).abs() < 1e-9);
        // an idle second pack does not mean mains, but its charge counts:
        // (60 + 100) / 2
        supply(
            root,
            "BAT2",
            &[
                ("type", "Battery"),
                ("status", "Not charging"),
                ("capacity", "100"),
            ],
        );
        assert!((power_factor_from(root) - 0.8).abs() < 1e-9);
        // a reading that is not a number is not taken at its word
        supply(root, "BAT2", &[("capacity", "nan")]);
        assert!((power_factor_from(root) - 0.6).abs() < 1e-9);
        // by energy when every battery reports it: a small external pack
        // at 12 % and a large internal one at 95 % hold 81 % together,
        // not low power
        supply(
            root,
            "BAT0",
            &[("energy_now", "2400000"), ("energy_full", "20000000")],
        );
        supply(
            root,
            "BAT2",
            &[("energy_now", "76000000"), ("energy_full", "80000000")],
        );
        assert!((power_factor_from(root) - 0.784).abs() < 1e-9);
        // both nearly empty: low-power mode, inline dedup off
        supply(root, "BAT2", &[("energy_now", "4000000")]);
        assert_eq!(power_factor_from(root), 0.0);
        // a USB-C supply online is external power too
        supply(
            root,
            "ucsi-source-psy-1",
            &[("type", "USB_PD"), ("online", "1")],
        );
        assert_eq!(power_factor_from(root), 1.0);
        supply(root, "ucsi-source-psy-1", &[("online", "0")]);
        assert_eq!(power_factor_from(root), 0.0);
        // plugged in: mains power
        supply(root, "AC", &[("type", "Mains"), ("online", "1")]);
        assert_eq!(power_factor_from(root), 1.0);
    }

    #[test]
    fn a_step_down_is_not_read_as_a_further_fall() {
        let s = fixed(PowerSource::Ac);
        // a steady 50 % of duplicates, of which inline finds the share
        // whose earlier copy was selected (about the fraction selected)
        let window = |s: &Selectivity, level: f64| {
            let f = s.stats().duplication_factor;
            s.observe(150, (150.0 * level * f).round() as u64);
        };
        for _ in 0..5 {
            window(&s, 0.5);
        }
        // one window of fewer duplicates steps the fraction down once
        window(&s, 0.3);
        assert!(s.stats().duplication_factor < 1.0);
        for _ in 0..60 {
            window(&s, 0.5);
        }
        let f = s.stats().duplication_factor;
        assert!(f > 0.85, "the level held, yet selectivity fell to {f}");
    }

    #[test]
    fn falls_to_the_floor_when_duplicates_dry_up_and_recovers() {
        let s = fixed(PowerSource::Ac);
        for _ in 0..10 {
            s.observe(150, 75);
        }
        for _ in 0..40 {
            s.observe(150, 0);
        }
        let low = s.stats().duplication_factor;
        assert!((FLOOR..0.5).contains(&low), "{low}");
        for _ in 0..20 {
            s.observe(150, 140);
        }
        assert!(s.stats().duplication_factor > 0.99);
    }

    #[test]
    fn battery_scales_and_low_power_turns_inline_off() {
        let half = fixed(PowerSource::Battery(50.0));
        let chosen = half.select(1024);
        let picked = chosen.iter().filter(|&&b| b).count();
        assert_eq!(picked, 512);
        // in runs of 32 consecutive blocks, across requests too
        let runs: Vec<usize> = chosen
            .split(|&b| !b)
            .map(|r| r.len())
            .filter(|&l| l > 0)
            .collect();
        assert!(runs.iter().all(|&l| l == 32), "{runs:?}");
        let mut stream = Vec::new();
        for _ in 0..128 {
            stream.extend(half.select(1));
        }
        assert!(stream[..32].iter().all(|&b| b) && stream[32..64].iter().all(|&b| !b));
        let low = fixed(PowerSource::Battery(10.0));
        assert!(low.select(100).iter().all(|&b| !b));
        assert!("battery:40".parse::<PowerSource>().is_ok());
        assert!("battery:140".parse::<PowerSource>().is_err());
    }
}
