//! Timeline rendering of a tiny hand-made run.

use super::*;
use crate::config::SchedulerConfig;
use crate::request::VgpuRequest;
use crate::sim::demand::Demand;
use crate::sim::report::GpuReport;
use crate::sim::scenario::{ContainerSpec, GpuSpec};

fn at(ms: u64) -> Instant {
    Instant::from_nanos(ms * 1_000_000)
}

fn container(name: &str, gpus: Vec<u32>, weight: u32, priority: &'static str) -> ContainerReport {
    ContainerReport {
        name: name.into(),
        gpus,
        weight,
        priority,
        gpu_seconds: Some(0.5),
        demand_seconds: Some(1.0),
        share: Some(0.5),
        wait_seconds: Some(0.5),
        wait_p50: Some(0.25),
        wait_p95: Some(0.25),
        wait_p99: Some(0.25),
        max_wait: Some(0.25),
        windows: Some(2),
        bursts: Some(1),
        burst_wait_p50: Some(0.25),
        burst_wait_p99: Some(0.25),
        bursts_unwindowed: Some(0),
        bursts_begun_frozen: Some(0),
        running_burst_wait_p99: Some(0.0),
        rejected: None,
        fair_share: Some(0.5),
    }
}

/// One GPU, 1 s in 100 ms columns: `a` runs the first half while `b` waits, then they swap; `b`
/// stops using it at 900 ms. `c` (low) is rejected.
fn tiny() -> (Scenario, Report, Timeline) {
    let spec = |name: &str| ContainerSpec {
        name: name.into(),
        annotations: Default::default(),
        request: VgpuRequest::default(),
        start: Instant::ZERO,
        stop: at(1000),
        demand: Demand::Busy,
    };
    let scenario = Scenario {
        origin: "tiny.toml".into(),
        duration: Duration::from_secs(1),
        seed: 0,
        sample_interval: Duration::from_millis(50),
        scheduler: SchedulerConfig::default(),
        gpus: vec![GpuSpec {
            model: "Fake GPU".into(),
            memory: 1 << 30,
        }],
        containers: vec![spec("a"), spec("bee"), spec("c")],
    };
    let mut b = container("bee", vec![0], 2, "high");
    b.share = Some(0.4);
    b.fair_share = None;
    b.windows = Some(1);
    b.wait_p95 = Some(1.2345);
    let mut c = container("c", vec![], 1, "low");
    c.rejected = Some("no GPU has 2 GiB free".into());
    c.share = None;
    let report = Report {
        duration: 1.0,
        seed: 0,
        containers: vec![container("a", vec![0], 1, "normal"), b, c],
        gpus: vec![GpuReport {
            index: 0,
            model: "Fake GPU".into(),
            busy_fraction: 0.9,
            busy_while_wanted: 0.9,
            switches: 1,
        }],
    };
    let mut timeline = Timeline::new(3, scenario.duration, Duration::from_millis(100)).unwrap();
    timeline.record(0, at(0), at(500), true, false);
    timeline.record(0, at(500), at(1000), false, true);
    timeline.record(1, at(0), at(500), false, true);
    // 30 ms of use in column 5 (under a third: blank), all of 6..8, and 40 ms of column 9 (a
    // third or more: ▒).
    timeline.record(1, at(570), at(940), true, false);
    (scenario, report, timeline)
}

#[test]
fn renders_rows_axis_and_table() {
    let (scenario, report, timeline) = tiny();
    let expected = "\
tiny.toml: 1s on 1 GPU, 3 containers; slice 200ms; one column = 100ms

GPU 0  Fake GPU  busy 90.0%  switches 1
  a    w1      │█████·····│
  bee  w2 high │····· ███▒│
               └┬─────────┘
                0s        1s

  █ used the GPU   ▒ used it part of the time   · frozen, waiting for a window   blank: no work

container  GPUs  weight  priority  share   fair  windows  p95 wait
a          0          1  normal    50.0%  50.0%        2     250ms
bee        0          2  high      40.0%      -        1    1.235s
c          -          1  low       rejected: no GPU has 2 GiB free
";
    assert_eq!(timeline.render(&scenario, &report), expected);
}

#[test]
fn cells_follow_the_thresholds() {
    let mut t = Timeline::new(1, Duration::from_millis(600), Duration::from_millis(100)).unwrap();
    t.record(0, at(0), at(51), true, false); // > half: █
    t.record(0, at(100), at(150), true, false); // exactly half, rest idle: ▒
    t.record(0, at(200), at(233), true, false); // just under a third: idle wins
    t.record(0, at(300), at(330), true, false); // a little use, more frozen than idle: ·
    t.record(0, at(330), at(400), false, true);
    t.record(0, at(400), at(440), false, true); // frozen less than idle: blank
    let cells: String = (0..t.columns()).map(|col| t.cell(0, col)).collect();
    assert_eq!(cells, "█▒ ·  ");
}

#[test]
fn intervals_spread_over_columns() {
    let mut t = Timeline::new(1, Duration::from_millis(350), Duration::from_millis(100)).unwrap();
    assert_eq!(t.columns(), 4);
    t.record(0, at(50), at(320), true, false);
    assert_eq!(t.used[..4], [50e6, 100e6, 100e6, 20e6]);
    // The last column is 50 ms wide: 20 ms of it is not more than half.
    let cells: String = (0..t.columns()).map(|col| t.cell(0, col)).collect();
    assert_eq!(cells, "▒██▒");
}

#[test]
fn resolution_limits() {
    assert_eq!(
        default_resolution(Duration::from_secs(20)),
        Duration::from_millis(200)
    );
    assert_eq!(
        default_resolution(Duration::from_millis(50)),
        Duration::from_millis(1)
    );
    assert_eq!(
        default_resolution(Duration::from_millis(65_432)),
        Duration::from_millis(654)
    );
    let e = Timeline::new(1, Duration::from_secs(3600), Duration::from_millis(1)).unwrap_err();
    assert_eq!(e.columns, 3_600_000);
    assert!(
        e.to_string()
            .starts_with("--resolution 1ms: gives 3600000 columns over 1h"),
        "{e}"
    );
    assert!(Timeline::new(1, Duration::from_secs(1), Duration::ZERO).is_err());
}
