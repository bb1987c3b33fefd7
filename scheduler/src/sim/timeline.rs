//! The text timeline: who used each GPU when, who waited, and the shares that came of it.
//!
//! Per GPU, one row per container bound to it and one column per `resolution` of virtual time.
//! A cell says what the container did in its column: `█` used the GPU more than half of it, `▒`
//! used it a third to a half (it took turns within the column), `·` otherwise frozen, waiting
//! for a window, more than it was idle; blank otherwise (no work, or not running). A time axis runs under each GPU, and a
//! table per container follows: share received against the weighted fair share.

use std::fmt::Write as _;
use std::time::Duration;

use super::report::{ContainerReport, Report};
use super::scenario::Scenario;
use crate::time::format_duration;
use crate::Instant;

/// The most columns a timeline may have.
pub const MAX_COLUMNS: u64 = 10_000;

/// Columns between two labelled ticks of the time axis.
const TICK_EVERY: usize = 10;

/// A resolution that gives no columns or too many.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--resolution {resolution}: gives {columns} columns over {duration}; choose a resolution that gives at most {MAX_COLUMNS}")]
pub struct ResolutionError {
    /// The resolution asked for.
    pub resolution: String,
    /// The scenario's duration.
    pub duration: String,
    /// The columns it would take.
    pub columns: u64,
}

/// What each container did in each column of time, recorded during a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    resolution: Duration,
    duration: Duration,
    columns: usize,
    /// Nanoseconds spent using the GPU, `[container * columns + column]`.
    used: Vec<f64>,
    /// Nanoseconds spent frozen, same layout.
    frozen: Vec<f64>,
}

/// The default resolution: a hundredth of the duration, rounded to a whole millisecond, at
/// least one millisecond.
pub fn default_resolution(duration: Duration) -> Duration {
    let ms = (duration.as_secs_f64() * 1000.0 / 100.0).round() as u64;
    Duration::from_millis(ms.max(1))
}

impl Timeline {
    /// An empty timeline for `containers` containers over `duration`.
    pub fn new(
        containers: usize,
        duration: Duration,
        resolution: Duration,
    ) -> Result<Timeline, ResolutionError> {
        let res = resolution.as_nanos().max(1);
        let columns = duration.as_nanos().div_ceil(res).max(1);
        if resolution.is_zero() || columns > u128::from(MAX_COLUMNS) {
            return Err(ResolutionError {
                resolution: format_duration(resolution),
                duration: format_duration(duration),
                columns: u64::try_from(columns).unwrap_or(u64::MAX),
            });
        }
        let columns = columns as usize;
        Ok(Timeline {
            resolution,
            duration,
            columns,
            used: vec![0.0; containers * columns],
            frozen: vec![0.0; containers * columns],
        })
    }

    /// Number of columns.
    pub fn columns(&self) -> usize {
        self.columns
    }

    /// Records that container `c` used the GPU (`used`) or was frozen (`frozen`) over
    /// `[from, to)`.
    pub fn record(&mut self, c: usize, from: Instant, to: Instant, used: bool, frozen: bool) {
        if !(used || frozen) || to <= from {
            return;
        }
        let res = self.resolution.as_nanos() as u64;
        let cells = if used {
            &mut self.used
        } else {
            &mut self.frozen
        };
        let row = &mut cells[c * self.columns..(c + 1) * self.columns];
        let (from, to) = (from.as_nanos(), to.as_nanos());
        let mut col = (from / res) as usize;
        let mut at = from;
        while at < to && col < self.columns {
            let col_end = (col as u64 + 1) * res;
            let until = to.min(col_end);
            row[col] += (until - at) as f64;
            at = until;
            col += 1;
        }
    }

    /// Container `c`'s row of cells, one per column.
    pub fn row(&self, c: usize) -> String {
        (0..self.columns).map(|col| self.cell(c, col)).collect()
    }

    /// The cell of container `c` in column `col`.
    fn cell(&self, c: usize, col: usize) -> char {
        let res = self.resolution.as_nanos() as f64;
        let start = col as f64 * res;
        let width = (self.duration.as_nanos() as f64 - start).min(res);
        let used = self.used[c * self.columns + col];
        let frozen = self.frozen[c * self.columns + col];
        if used * 2.0 > width {
            '█'
        } else if used * 3.0 >= width {
            '▒'
        } else if frozen > 0.0 && frozen >= width - used - frozen {
            '·'
        } else {
            ' '
        }
    }

    /// The timeline and the table, ready to print.
    pub fn render(&self, scenario: &Scenario, report: &Report) -> String {
        let mut out = String::new();
        let containers = &report.containers;
        let _ = writeln!(
            out,
            "{}: {} on {} GPU{}, {} container{}; slice {}; one column = {}",
            scenario.origin,
            format_duration(scenario.duration),
            report.gpus.len(),
            plural(report.gpus.len()),
            containers.len(),
            plural(containers.len()),
            format_duration(scenario.scheduler.slice),
            format_duration(self.resolution),
        );
        let name_width = containers
            .iter()
            .map(|c| c.name.chars().count())
            .max()
            .unwrap_or(0);
        let labels: Vec<String> = containers
            .iter()
            .map(|c| row_label(c, name_width))
            .collect();
        let label_width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
        // Rows are indented two spaces, then the label, a space and the left border.
        let margin = 2 + label_width + 1;
        for gpu in &report.gpus {
            let _ = writeln!(
                out,
                "\nGPU {}  {}  busy {:.1}%  switches {}",
                gpu.index,
                gpu.model,
                gpu.busy_fraction * 100.0,
                gpu.switches
            );
            let mut any = false;
            for (c, container) in containers.iter().enumerate() {
                if !container.gpus.contains(&gpu.index) {
                    continue;
                }
                any = true;
                let _ = writeln!(out, "  {:<label_width$} │{}│", labels[c], self.row(c));
            }
            if !any {
                let _ = writeln!(out, "  (no container)");
                continue;
            }
            self.axis(&mut out, margin);
        }
        let _ = writeln!(
            out,
            "\n  █ used the GPU   ▒ used it part of the time   · frozen, waiting for a window   blank: no work\n"
        );
        table(&mut out, containers);
        out
    }

    /// The axis line and its labels, under rows whose first column is at `margin + 1`.
    pub fn axis(&self, out: &mut String, margin: usize) {
        let mut line = " ".repeat(margin);
        line.push('└');
        for col in 0..self.columns {
            line.push(if col % TICK_EVERY == 0 { '┬' } else { '─' });
        }
        line.push('┘');
        let _ = writeln!(out, "{line}");

        let mut labels = " ".repeat(margin + 1);
        let mut width = 0; // characters written after the margin
        let mut place = |text: String, at: usize, labels: &mut String| {
            if at >= width + usize::from(width > 0) {
                labels.push_str(&" ".repeat(at - width));
                labels.push_str(&text);
                width = at + text.chars().count();
            }
        };
        for col in (0..self.columns).step_by(TICK_EVERY) {
            let at = self.resolution * col as u32;
            place(format_duration(at), col, &mut labels);
        }
        place(format_duration(self.duration), self.columns, &mut labels);
        let _ = writeln!(out, "{labels}");
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `name  w2`, plus the priority when it is not `normal`; names padded to `name_width`.
fn row_label(container: &ContainerReport, name_width: usize) -> String {
    let label = format!("{:<name_width$}  w{}", container.name, container.weight);
    match container.priority {
        "normal" => label,
        priority => format!("{label} {priority}"),
    }
}

fn percent(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn seconds(value: Option<f64>) -> String {
    value.map_or_else(
        || "-".into(),
        |s| format_duration(Duration::from_millis((s * 1000.0).round() as u64)),
    )
}

/// The per-container table: columns sized to their contents, numbers right-aligned; a rejected
/// container's reason takes the place of its statistics.
fn table(out: &mut String, containers: &[ContainerReport]) {
    const HEADER: [&str; 8] = [
        "container",
        "GPUs",
        "weight",
        "priority",
        "share",
        "fair",
        "windows",
        "p95 wait",
    ];
    const RIGHT: [bool; 8] = [false, false, true, false, true, true, true, true];
    let rows: Vec<Vec<String>> = containers
        .iter()
        .map(|c| {
            let gpus = c
                .gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let mut row = vec![
                c.name.clone(),
                if gpus.is_empty() { "-".into() } else { gpus },
                c.weight.to_string(),
                c.priority.to_string(),
            ];
            match &c.rejected {
                Some(why) => row.push(format!("rejected: {why}")),
                None => row.extend([
                    percent(c.share),
                    percent(c.fair_share),
                    c.windows.map_or_else(|| "-".into(), |w| w.to_string()),
                    seconds(c.wait_p95),
                ]),
            }
            row
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        // A rejection's text spans the statistics' columns without widening them.
        let sized = if row.len() == HEADER.len() {
            row.len()
        } else {
            4
        };
        for (width, cell) in widths.iter_mut().zip(&row[..sized]) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let width = if cells.len() < HEADER.len() && i == cells.len() - 1 {
                0
            } else {
                widths[i]
            };
            let sep = if i == 0 { "" } else { "  " };
            if RIGHT[i] && width > 0 {
                let _ = write!(text, "{sep}{cell:>width$}");
            } else {
                let _ = write!(text, "{sep}{cell:<width$}");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    };
    line(&HEADER.map(String::from));
    for row in &rows {
        line(row);
    }
}

#[cfg(test)]
#[path = "timeline_tests.rs"]
mod tests;
