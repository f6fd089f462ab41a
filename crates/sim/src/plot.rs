//! Figures of a sweep, drawn in Rust with plotters (PNG and SVG, no
//! system font libraries: DejaVu Sans is embedded, see
//! `assets/DejaVuSans-LICENSE.txt`).
//!
//! - [`Figure::Duplicates`]: duplicates found (percent of the exact
//!   dedup's) against index memory, one line per policy; plain `exact` (no
//!   filters) as the 100 % reference, and each other unbounded policy
//!   (`exact+prehash`, `exact+t4`, …) as a level line at its own percent;
//! - [`Figure::EvictionIo`]: on-disk fingerprint-group reads + writes done
//!   by evictions against index memory (log scale), one line per policy.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::error::{Result, TraceError};
use crate::replay::{Filters, PolicySpec};
use crate::sweep::SweepRow;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static REGISTER: Once = Once::new();

/// Which figure to draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// Duplicates found (% of exact) vs index memory.
    Duplicates,
    /// Eviction I/Os vs index memory.
    EvictionIo,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn draw_err<E: std::fmt::Display>(path: &Path) -> impl Fn(E) -> TraceError + '_ {
    move |e| TraceError::Config(format!("drawing {}: {e}", path.display()))
}

/// Draws `what` for `trace` from `rows` into `path` (`.png` or `.svg`,
/// 1000 × 640 pixels).
///
/// Errors: no bounded point for the trace, or a drawing/I/O failure.
pub fn draw(rows: &[SweepRow], trace: &str, what: Figure, path: &Path) -> Result<()> {
    REGISTER.call_once(|| {
        let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let size = (1000, 640);
    if path.extension().is_some_and(|e| e == "svg") {
        let root = SVGBackend::new(path, size).into_drawing_area();
        chart(root, rows, trace, what, path)
    } else {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        chart(root, rows, trace, what, path)
    }
}

/// True for the plain `exact` policy: unbounded, without filters (the
/// reference every other policy is measured against).
fn is_plain_exact(policy: &str) -> bool {
    policy
        .parse::<PolicySpec>()
        .is_ok_and(|s| s.eviction.is_none() && s.filters == Filters::default())
}

fn chart<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    rows: &[SweepRow],
    trace: &str,
    what: Figure,
    path: &Path,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = draw_err(path);
    let mine: Vec<&SweepRow> = rows.iter().filter(|r| r.trace == trace).collect();
    let bounded: Vec<&&SweepRow> = mine
        .iter()
        .filter(|r| r.index_memory_bytes.is_some())
        .collect();
    if bounded.is_empty() {
        return Err(TraceError::Config(format!(
            "no bounded policy point for trace {trace} to draw"
        )));
    }
    let (xmin, xmax) = bounded
        .iter()
        .map(|r| mib(r.index_memory_bytes.unwrap_or(0)).log2())
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let pad = ((xmax - xmin) * 0.05).max(0.25);
    let xr = (xmin - pad)..(xmax + pad);
    let mut policies: Vec<&str> = Vec::new();
    for r in &mine {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    root.fill(&WHITE).map_err(&err)?;
    let value = |r: &SweepRow| match what {
        Figure::Duplicates => r.of_exact_percent,
        // log10, drawn on a linear axis labelled in powers of ten (0 is
        // drawn at 1, as the axis label says when a point has none)
        Figure::EvictionIo => (r.eviction_ios() as f64).max(1.0).log10(),
    };
    let exact_pct = mine
        .iter()
        .find(|r| r.index_memory_bytes.is_none() && is_plain_exact(&r.policy))
        .map(|r| r.exact_duplicate_blocks as f64 * 100.0 / r.blocks_written.max(1) as f64);
    let caption = match what {
        Figure::Duplicates => format!("{trace}: duplicates found vs index memory"),
        Figure::EvictionIo => format!("{trace}: eviction I/Os vs index memory"),
    };
    // labels at the budgets swept, on the tick nearest each (ticks are a
    // tenth of a doubling apart, so a label sits within 3.5 % of its
    // budget; budgets closer than that share a tick, labelled with the
    // nearest), in KiB or MiB
    let mut budgets: Vec<f64> = bounded
        .iter()
        .map(|r| mib(r.index_memory_bytes.unwrap_or(0)).log2())
        .collect();
    budgets.sort_by(f64::total_cmp);
    budgets.dedup();
    let label_x = |x: &f64| {
        let Some(&b) = budgets
            .iter()
            .filter(|&&b| (x - b).abs() <= 0.05)
            .min_by(|a, b| (x - *a).abs().total_cmp(&(x - *b).abs()))
        else {
            return String::new();
        };
        let bytes = (b.exp2() * 1048576.0).round() as u64;
        // whole KiB or MiB where the budget is one, else two decimals
        if bytes >= 1 << 20 {
            if bytes.is_multiple_of(1 << 20) {
                format!("{} MiB", bytes >> 20)
            } else {
                format!("{:.2} MiB", bytes as f64 / 1048576.0)
            }
        } else if bytes.is_multiple_of(1024) {
            format!("{} KiB", bytes >> 10)
        } else {
            format!("{:.2} KiB", bytes as f64 / 1024.0)
        }
    };
    let mut b = ChartBuilder::on(&root);
    b.caption(caption, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80);
    // the level of each unbounded policy: what it found, in % of the
    // duplicates an exact dedup of the trace's digests finds (plain `exact`
    // finds less when content was overwritten and freed before it recurred)
    let level = |p: &str| -> Option<f64> {
        mine.iter()
            .find(|r| r.policy == p && r.index_memory_bytes.is_none())
            .map(|r| r.of_exact_percent)
    };
    let series: Vec<(&str, Vec<(f64, f64)>)> = policies
        .iter()
        .map(|p| {
            let mut pts: Vec<(f64, f64)> = bounded
                .iter()
                .filter(|r| r.policy == *p)
                .map(|r| (mib(r.index_memory_bytes.unwrap_or(0)).log2(), value(r)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (*p, pts)
        })
        .collect();
    let x_labels = ((xr.end - xr.start) * 10.0).ceil() as usize + 2;
    let n = series.len();
    let draw_lines = |chart: &mut ChartContext<'_, DB, _>| -> Result<()> {
        for (i, (p, pts)) in series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let w = (2 + 2 * (n - 1 - i) as u32).min(9);
            if pts.is_empty() {
                if let (Figure::Duplicates, Some(y)) = (what, level(p)) {
                    // an unbounded policy: a level line
                    chart
                        .draw_series(LineSeries::new(
                            [(xr.start, y), (xr.end, y)],
                            c.stroke_width(2),
                        ))
                        .map_err(&err)?
                        .label(match exact_pct {
                            Some(e) if is_plain_exact(p) => format!(
                                "{p} ({:.1} % of writes; all digests {e:.1} %)",
                                mine.iter()
                                    .find(|r| r.policy == *p && r.index_memory_bytes.is_none())
                                    .map_or(0.0, |r| r.duplicate_percent)
                            ),
                            _ => p.to_string(),
                        })
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                        });
                }
                continue;
            }
            chart
                // earlier lines are wider, so lines that coincide stay visible
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(w)))
                .map_err(&err)?
                .label(*p)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(w))
                });
            chart
                .draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 5, c.filled())))
                .map_err(&err)?;
        }
        Ok(())
    };
    match what {
        Figure::Duplicates => {
            let ymax = series
                .iter()
                .flat_map(|(_, p)| p.iter().map(|q| q.1))
                .chain(policies.iter().filter_map(|p| level(p)))
                .fold(100.0f64, f64::max);
            let mut chart = b
                .build_cartesian_2d(xr.clone(), 0.0..ymax * 1.05)
                .map_err(&err)?;
            chart
                .configure_mesh()
                .x_desc("index memory budget (log scale)")
                .y_desc("duplicates found, % of exact dedup")
                .x_label_formatter(&label_x)
                .x_labels(x_labels)
                .disable_x_mesh()
                .label_style(("sans-serif", 18))
                .axis_desc_style(("sans-serif", 20))
                .draw()
                .map_err(&err)?;
            draw_lines(&mut chart)?;
            chart
                .configure_series_labels()
                // lower right: curves rise with memory, so it stays clear
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .label_font(("sans-serif", 18))
                .draw()
                .map_err(&err)?;
        }
        Figure::EvictionIo => {
            // (a log scale has no 0: a point of no eviction I/O is drawn at
            // 1, and the axis says so)
            let y_desc = if bounded.iter().any(|r| r.eviction_ios() == 0) {
                "eviction I/Os (group reads + writes, log scale; 0 drawn at 1)"
            } else {
                "eviction I/Os (group reads + writes, log scale)"
            };
            let ymax = series
                .iter()
                .flat_map(|(_, p)| p.iter().map(|q| q.1))
                .fold(1.0f64, f64::max);
            let mut chart = b
                .build_cartesian_2d(xr.clone(), 0.0..ymax.ceil() + 0.3)
                .map_err(&err)?;
            chart
                .configure_mesh()
                .x_desc("index memory budget (log scale)")
                .y_desc(y_desc)
                .x_label_formatter(&label_x)
                .x_labels(x_labels)
                .disable_x_mesh()
                .y_labels(((ymax.ceil() + 1.0) * 2.0) as usize)
                .y_label_formatter(&|y| {
                    if (y - y.round()).abs() < 1e-6 {
                        format!("{:.0}", 10f64.powf(*y))
                    } else {
                        String::new()
                    }
                })
                .label_style(("sans-serif", 18))
                .axis_desc_style(("sans-serif", 20))
                .draw()
                .map_err(&err)?;
            draw_lines(&mut chart)?;
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerLeft)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .label_font(("sans-serif", 18))
                .draw()
                .map_err(&err)?;
        }
    }
    root.present().map_err(&err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `(colour, points)` of every `tag` element (`polyline`: its
    /// stroke and points; `circle`: its fill and centre) of an SVG, in order.
    fn shapes(svg: &str, tag: &str) -> Vec<(String, Vec<(f64, f64)>)> {
        let attr = |el: &str, name: &str| -> Option<String> {
            let at = el.find(&format!(" {name}=\""))? + name.len() + 3;
            Some(el[at..at + el[at..].find('"')?].to_string())
        };
        svg.split(&format!("<{tag} "))
            .skip(1)
            .map(|el| {
                let el = format!(" {}", &el[..el.find('>').unwrap_or(el.len())]);
                let el = el.as_str();
                let points = match tag {
                    "circle" => vec![(
                        attr(el, "cx").unwrap().parse().unwrap(),
                        attr(el, "cy").unwrap().parse().unwrap(),
                    )],
                    _ => attr(el, "points")
                        .unwrap()
                        .split_whitespace()
                        .map(|p| {
                            let (x, y) = p.split_once(',').unwrap();
                            (x.parse().unwrap(), y.parse().unwrap())
                        })
                        .collect(),
                };
                let colour = match tag {
                    "circle" => attr(el, "fill").unwrap(),
                    _ => attr(el, "stroke").unwrap(),
                };
                (colour, points)
            })
            .collect()
    }

    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// The height of the longest polyline in colour `c` (a horizontal
    /// line: all its points at one height).
    fn level(lines: &[(String, Vec<(f64, f64)>)], c: RGBColor) -> f64 {
        let (_, pts) = lines
            .iter()
            .filter(|(colour, _)| *colour == hex(c))
            .max_by(|a, b| {
                let w = |p: &[(f64, f64)]| p.last().unwrap().0 - p[0].0;
                w(&a.1).total_cmp(&w(&b.1))
            })
            .unwrap();
        assert!(pts.iter().all(|p| p.1 == pts[0].1), "{pts:?}");
        pts[0].1
    }

    #[test]
    fn eviction_io_axis_says_when_zero_is_drawn_at_one() {
        let row = |budget: u64, reads: u64| SweepRow {
            trace: "t".into(),
            policy: "lru".into(),
            index_memory_bytes: Some(budget),
            eviction_reads: reads,
            eviction_writes: reads,
            ..SweepRow::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.svg");
        let note = "0 drawn at 1";
        draw(
            &[row(1 << 20, 50), row(2 << 20, 0)],
            "t",
            Figure::EvictionIo,
            &path,
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains(note), "{svg}");
        draw(
            &[row(1 << 20, 50), row(2 << 20, 5)],
            "t",
            Figure::EvictionIo,
            &path,
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(!svg.contains(note) && svg.contains("log scale"), "{svg}");
    }

    #[test]
    fn only_plain_exact_is_the_reference_line() {
        let row = |policy: &str, budget: Option<u64>, found: f64| SweepRow {
            trace: "t".into(),
            policy: policy.into(),
            index_memory_bytes: budget,
            of_exact_percent: found,
            blocks_written: 100,
            exact_duplicate_blocks: 40,
            ..SweepRow::default()
        };
        // series colours follow the policies' order of appearance
        let rows = [
            row("exact+prehash", None, 50.0),
            row("exact", None, 100.0),
            row("g-lru", Some(1 << 20), 50.0),
            row("g-lru", Some(2 << 20), 100.0),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.svg");
        draw(&rows, "t", Figure::Duplicates, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let lines = shapes(&svg, "polyline");
        let dots: Vec<f64> = shapes(&svg, "circle")
            .into_iter()
            .filter(|(c, _)| *c == hex(COLORS[2]))
            .map(|(_, p)| p[0].1)
            .collect();
        assert_eq!(dots.len(), 2, "{svg}");
        // g-lru's points at 50 % and 100 % (the lower one further down)
        let (at_50, at_100) = (dots[0].max(dots[1]), dots[0].min(dots[1]));
        assert!(at_50 > at_100);
        assert!((level(&lines, COLORS[1]) - at_100).abs() <= 1.0, "exact");
        assert!(
            (level(&lines, COLORS[0]) - at_50).abs() <= 1.0,
            "exact+prehash"
        );
    }
}
