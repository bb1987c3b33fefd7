//! `gpuplexctl timeline`: who held each GPU's window when, over the last `--since`, drawn from the
//! node service's window events as the simulator draws its timeline (one row per container
//! that held the GPU, `█` where it held the window most of a column).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use gpuplex_scheduler::sim::timeline::Timeline;
use gpuplex_scheduler::time::format_duration;
use gpuplex_scheduler::Instant;
use gpuplex_wire::protocol::EventsReply;

/// How many columns the drawing has.
pub const COLUMNS: u64 = 100;

/// Who held which GPU from when to when, in milliseconds since the Unix epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The GPU.
    pub gpu: u32,
    /// The container (its vGPU when it had none).
    pub holder: String,
    /// From.
    pub from_ms: u64,
    /// To.
    pub to_ms: u64,
}

/// The events of `reply` from `from_ms` on, and before them each GPU's last one: who held it at
/// `from_ms`. Oldest first; `first` as the node service sent it.
pub fn since(reply: EventsReply, from_ms: u64) -> EventsReply {
    let mut events = reply.events;
    events.sort_by_key(|e| e.seq);
    let mut last_before: BTreeMap<u32, u64> = BTreeMap::new();
    for e in events.iter().filter(|e| e.at_ms < from_ms) {
        last_before.insert(e.gpu, e.seq);
    }
    events.retain(|e| e.at_ms >= from_ms || last_before.get(&e.gpu) == Some(&e.seq));
    EventsReply {
        first: reply.first,
        events,
    }
}

/// The spans the events make over `[from_ms, to_ms]`: each event's holder holds its GPU until
/// the next event of that GPU, or `to_ms`. A holder before `from_ms` is cut at `from_ms`.
pub fn spans(reply: &EventsReply, from_ms: u64, to_ms: u64) -> Vec<Held> {
    let mut events: Vec<_> = reply.events.iter().collect();
    events.sort_by_key(|e| e.seq);
    let mut open: BTreeMap<u32, (Option<String>, u64)> = BTreeMap::new();
    let mut held = Vec::new();
    let close = |gpu: u32, holder: Option<String>, since: u64, until: u64, held: &mut Vec<Held>| {
        let (start, end) = (since.max(from_ms), until.min(to_ms));
        if let (Some(holder), true) = (holder, start < end) {
            held.push(Held {
                gpu,
                holder,
                from_ms: start,
                to_ms: end,
            });
        }
    };
    for e in events {
        let holder = (e.container.clone()).or_else(|| e.vgpu.map(|v| v.to_string()));
        if let Some((before, since)) = open.insert(e.gpu, (holder, e.at_ms)) {
            close(e.gpu, before, since, e.at_ms, &mut held);
        }
    }
    for (gpu, (holder, since)) in open {
        close(gpu, holder, since, to_ms, &mut held);
    }
    held
}

/// The drawing of the spans over the `span` up to `to_ms`; `dropped`: whether events older than
/// those kept were dropped (the start may be missing).
pub fn render(held: &[Held], to_ms: u64, span: Duration, dropped: bool) -> String {
    let mut out = String::new();
    let resolution = (span / COLUMNS as u32).max(Duration::from_millis(1));
    let from_ms = to_ms.saturating_sub(span.as_millis() as u64);
    let mut rows: Vec<(u32, &str)> = held.iter().map(|h| (h.gpu, h.holder.as_str())).collect();
    rows.sort();
    rows.dedup();
    let _ = writeln!(
        out,
        "window holders over the last {}; one column = {}{}",
        format_duration(span),
        format_duration(resolution),
        if dropped {
            " (older events were dropped: the start may be missing)"
        } else {
            ""
        }
    );
    let Ok(mut timeline) = Timeline::new(rows.len(), span, resolution) else {
        return out;
    };
    let at = |ms: u64| Instant::from_nanos(ms.saturating_sub(from_ms) * 1_000_000);
    for h in held {
        if let Some(c) = rows.iter().position(|r| *r == (h.gpu, h.holder.as_str())) {
            timeline.record(c, at(h.from_ms), at(h.to_ms), true, false);
        }
    }
    let width = rows
        .iter()
        .map(|(_, n)| n.chars().count())
        .max()
        .unwrap_or(0);
    let mut gpus: Vec<u32> = rows.iter().map(|(g, _)| *g).collect();
    gpus.dedup();
    if gpus.is_empty() {
        let _ = writeln!(out, "\n  (no window was held)");
    }
    for gpu in gpus {
        let _ = writeln!(out, "\nGPU {gpu}");
        for (c, (_, name)) in rows.iter().enumerate().filter(|(_, r)| r.0 == gpu) {
            let _ = writeln!(out, "  {name:<width$} │{}│", timeline.row(c));
        }
        timeline.axis(&mut out, 2 + width + 1);
    }
    out
}

/// The spans as an SVG image over the `span` up to `to_ms`: a band per GPU, a row per holder, a
/// bar where it held the window, and a time axis in seconds before `to_ms`. Names are escaped
/// (a container's id is its owner's to choose).
pub fn svg(held: &[Held], to_ms: u64, span: Duration) -> String {
    const WIDTH: f64 = 900.0;
    const LABEL: f64 = 180.0;
    const ROW: f64 = 18.0;
    let from_ms = to_ms.saturating_sub(span.as_millis() as u64);
    let scale = WIDTH / (span.as_millis().max(1) as f64);
    let x = |ms: u64| LABEL + (ms.saturating_sub(from_ms)) as f64 * scale;
    let mut rows: Vec<(u32, &str)> = held.iter().map(|h| (h.gpu, h.holder.as_str())).collect();
    rows.sort();
    rows.dedup();
    let mut gpus: Vec<u32> = rows.iter().map(|(g, _)| *g).collect();
    gpus.dedup();
    let mut body = String::new();
    let mut y = 10.0;
    for gpu in &gpus {
        let _ = writeln!(
            body,
            r#"<text x="4" y="{:.0}" font-weight="bold">GPU {gpu}</text>"#,
            y + 12.0
        );
        y += ROW;
        for (_, name) in rows.iter().filter(|r| r.0 == *gpu) {
            let _ = writeln!(
                body,
                r#"<text x="12" y="{:.0}">{}</text>"#,
                y + 12.0,
                escape(name)
            );
            for h in held.iter().filter(|h| h.gpu == *gpu && h.holder == *name) {
                let (a, b) = (x(h.from_ms), x(h.to_ms));
                let _ = writeln!(
                    body,
                    r#"<rect x="{a:.1}" y="{:.0}" width="{:.1}" height="{:.0}" fill="steelblue"/>"#,
                    y + 2.0,
                    (b - a).max(0.5),
                    ROW - 4.0
                );
            }
            y += ROW;
        }
    }
    // The axis: ten ticks, labelled in seconds before now.
    let _ = writeln!(
        body,
        r#"<line x1="{LABEL}" y1="{y:.0}" x2="{:.0}" y2="{y:.0}" stroke="black"/>"#,
        LABEL + WIDTH
    );
    for tick in 0..=10u32 {
        let at = LABEL + WIDTH * f64::from(tick) / 10.0;
        let before = span.mul_f64(f64::from(10 - tick) / 10.0);
        let _ = writeln!(
            body,
            r#"<text x="{at:.0}" y="{:.0}" text-anchor="middle">-{}</text>"#,
            y + 14.0,
            format_duration(before)
        );
    }
    format!(
        concat!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{:.0}" height="{:.0}" font-family="monospace" font-size="12">"#,
            "\n<title>gpuplex window holders over the last {}</title>\n{}</svg>\n"
        ),
        LABEL + WIDTH + 20.0,
        y + 24.0,
        format_duration(span),
        body
    )
}

/// Text made safe inside an SVG element.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplex_wire::protocol::EventLine;

    fn event(seq: u64, at_ms: u64, gpu: u32, container: Option<&str>) -> EventLine {
        EventLine {
            seq,
            at_ms,
            gpu,
            vgpu: container.map(|_| gpuplex_scheduler::VgpuId(seq)),
            container: container.map(str::to_owned),
        }
    }

    #[test]
    fn since_keeps_the_interval_and_each_gpus_holder_at_its_start() {
        let reply = EventsReply {
            first: 3,
            events: vec![
                event(4, 900, 0, Some("b")),
                event(3, 500, 0, Some("a")),
                event(5, 950, 1, Some("c")),
                event(6, 1_000, 0, None),
                event(7, 1_500, 0, Some("a")),
            ],
        };
        let kept = since(reply, 1_000);
        let seqs: Vec<u64> = kept.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [4, 5, 6, 7]);
        assert_eq!(kept.first, 3);
        assert!(since(
            EventsReply {
                first: 1,
                events: vec![]
            },
            0
        )
        .events
        .is_empty());
    }

    #[test]
    fn each_holder_holds_until_the_next_event_of_its_gpu() {
        let reply = EventsReply {
            first: 1,
            events: vec![
                event(1, 500, 0, Some("a")),
                event(2, 1_200, 0, Some("b")),
                event(3, 1_300, 1, Some("c")),
                event(4, 1_600, 0, None),
                event(5, 1_700, 0, Some("a")),
            ],
        };
        let held = spans(&reply, 1_000, 2_000);
        let seen: Vec<(u32, &str, u64, u64)> = held
            .iter()
            .map(|h| (h.gpu, h.holder.as_str(), h.from_ms, h.to_ms))
            .collect();
        assert_eq!(
            seen,
            [
                (0, "a", 1_000, 1_200),
                (0, "b", 1_200, 1_600),
                (0, "a", 1_700, 2_000),
                (1, "c", 1_300, 2_000)
            ]
        );
        let text = render(&held, 2_000, Duration::from_secs(1), false);
        assert!(
            text.starts_with("window holders over the last 1s; one column = 10ms"),
            "{text}"
        );
        let row = |name: &str| {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap();
            line.split('│').nth(1).unwrap().to_owned()
        };
        // a: columns 0-19 and 70-99; b: 20-59; c on GPU 1 from column 30.
        let a = row("a");
        assert_eq!(a.chars().filter(|&c| c == '█').count(), 50, "{text}");
        assert!(a.starts_with(&"█".repeat(20)));
        assert_eq!(row("b").chars().filter(|&c| c == '█').count(), 40);
        assert!(row("c").ends_with(&"█".repeat(70)));
        assert!(text.contains("GPU 1"));
    }

    #[test]
    fn the_svg_has_a_bar_per_span_and_escapes_names() {
        let held = [
            Held {
                gpu: 0,
                holder: "<a&b>".into(),
                from_ms: 1_000,
                to_ms: 1_500,
            },
            Held {
                gpu: 0,
                holder: "<a&b>".into(),
                from_ms: 1_600,
                to_ms: 2_000,
            },
            Held {
                gpu: 1,
                holder: "c".into(),
                from_ms: 1_000,
                to_ms: 2_000,
            },
        ];
        let image = svg(&held, 2_000, Duration::from_secs(1));
        assert!(
            image.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
            "{image}"
        );
        assert!(image.trim_end().ends_with("</svg>"));
        assert_eq!(image.matches("<rect ").count(), 3);
        assert!(
            image.contains("&lt;a&amp;b&gt;") && !image.contains("<a&b>"),
            "{image}"
        );
        // The first bar: half of the 900 px from the label column.
        assert!(
            image.contains(r#"<rect x="180.0" y="30" width="450.0""#),
            "{image}"
        );
        assert!(image.contains(">GPU 1</text>"));
    }

    #[test]
    fn nothing_held_says_so() {
        let text = render(&[], 10_000, Duration::from_secs(30), true);
        assert!(text.contains("no window was held"), "{text}");
        assert!(text.contains("dropped"), "{text}");
    }
}
