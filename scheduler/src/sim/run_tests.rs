//! The event loop against the real scheduler: small scenarios with known outcomes, and the
//! ground-truth invariants on the showcase scenarios.

use super::*;
use crate::sim::report::ContainerReport;

/// A scenario of `duration` on one 40 GiB GPU (or `gpus` of them) with these containers, each
/// `(name, annotations, extra keys)`.
fn scenario(duration: &str, gpus: usize, containers: &[(&str, &str, &str)]) -> Scenario {
    let mut text = format!("duration = \"{duration}\"\n");
    for _ in 0..gpus {
        text.push_str("[[gpu]]\nmodel = \"NVIDIA A100-SXM4-40GB\"\nmemory = \"40Gi\"\n");
    }
    for (name, annotations, extra) in containers {
        text.push_str(&format!(
            "[[container]]\nname = \"{name}\"\nannotations = {{ {annotations} }}\n{extra}\n"
        ));
    }
    Scenario::parse(&text, "test.toml").unwrap()
}

fn by_name<'r>(report: &'r Report, name: &str) -> &'r ContainerReport {
    report.containers.iter().find(|c| c.name == name).unwrap()
}

const SMALL: &str = "\"gpuplex.io/gpu-memory\" = \"1Gi\"";

#[test]
fn a_container_alone_is_never_frozen() {
    let s = scenario("10s", 1, &[("solo", SMALL, "demand = \"busy\"")]);
    let r = run(&s).unwrap();
    let solo = by_name(&r, "solo");
    assert_eq!(solo.gpus, [0]);
    assert_eq!(solo.gpu_seconds, Some(10.0));
    assert_eq!(solo.demand_seconds, Some(10.0));
    assert_eq!(solo.share, Some(1.0));
    assert_eq!(solo.wait_seconds, Some(0.0));
    assert_eq!(solo.max_wait, Some(0.0));
    assert_eq!(r.gpus[0].busy_fraction, 1.0);
    assert_eq!(r.duration, 10.0);
}

#[test]
fn an_idle_container_costs_nothing_and_waits_never() {
    let s = scenario(
        "10s",
        1,
        &[
            ("busy", SMALL, "demand = \"busy\""),
            ("idle", SMALL, "demand = \"idle\""),
        ],
    );
    let r = run(&s).unwrap();
    let idle = by_name(&r, "idle");
    assert_eq!(idle.gpu_seconds, Some(0.0));
    assert_eq!(idle.demand_seconds, Some(0.0));
    assert_eq!(idle.share, None, "no demand: no share");
    assert_eq!(idle.wait_seconds, Some(0.0));
    assert_eq!(idle.windows, Some(0));
    assert_eq!(by_name(&r, "busy").share, Some(1.0));
    assert_eq!(by_name(&r, "busy").wait_seconds, Some(0.0));
}

#[test]
fn equal_weights_share_equally_and_waits_are_counted() {
    let s = scenario(
        "20s",
        1,
        &[
            ("a", SMALL, "demand = \"busy\""),
            ("b", SMALL, "demand = \"busy\""),
        ],
    );
    let r = run(&s).unwrap();
    let (a, b) = (by_name(&r, "a"), by_name(&r, "b"));
    for c in [a, b] {
        let share = c.share.unwrap();
        assert!((share - 0.5).abs() < 0.02, "{}: {share}", c.name);
        // Frozen about half the time, in waits of about one 200 ms window.
        let wait = c.wait_seconds.unwrap();
        assert!((wait - 10.0).abs() < 0.5, "{}: waited {wait}", c.name);
        assert!(c.max_wait.unwrap() <= 0.3, "{}: {:?}", c.name, c.max_wait);
        assert!(c.windows.unwrap() >= 40, "{}: {:?}", c.name, c.windows);
    }
    let total = a.gpu_seconds.unwrap() + b.gpu_seconds.unwrap();
    assert!((total - 20.0).abs() < 1e-5, "{total}");
    assert!(r.gpus[0].switches >= 80, "{}", r.gpus[0].switches);
}

#[test]
fn a_high_container_freezes_the_others_while_it_has_work() {
    let s = scenario(
        "10s",
        1,
        &[
            ("normal", SMALL, "demand = \"busy\""),
            (
                "high",
                "\"gpuplex.io/priority\" = \"high\", \"gpuplex.io/gpu-memory\" = \"1Gi\"",
                "demand = \"busy\"",
            ),
        ],
    );
    let r = run(&s).unwrap();
    let (normal, high) = (by_name(&r, "normal"), by_name(&r, "high"));
    assert_eq!(high.wait_seconds, Some(0.0));
    // Both run until the first sample shows the high one's work, then the normal one waits.
    assert!(normal.gpu_seconds.unwrap() < 0.1, "{normal:?}");
    assert!(normal.wait_seconds.unwrap() > 9.8, "{normal:?}");
    assert!(high.share.unwrap() > 0.99, "{high:?}");
}

#[test]
fn starts_stops_and_periodic_demand_are_exact() {
    let s = scenario(
        "10s",
        1,
        &[
            (
                "late",
                SMALL,
                "start = \"2s\"\nstop = \"7s\"\ndemand = \"busy\"",
            ),
            (
                "blink",
                SMALL,
                "stop = \"9s\"\ndemand = { on = \"1s\", off = \"2s\" }",
            ),
        ],
    );
    let r = run(&s).unwrap();
    assert_eq!(by_name(&r, "late").demand_seconds, Some(5.0));
    // On [0,1), [3,4), [6,7): 3 s by 9 s.
    assert_eq!(by_name(&r, "blink").demand_seconds, Some(3.0));
}

#[test]
fn a_container_that_fits_nowhere_is_rejected_and_the_run_goes_on() {
    let s = scenario(
        "5s",
        1,
        &[
            (
                "big",
                "\"gpuplex.io/gpu-memory\" = \"30Gi\"",
                "demand = \"busy\"",
            ),
            (
                "too-big",
                "\"gpuplex.io/gpu-memory\" = \"20Gi\"",
                "demand = \"busy\"",
            ),
            (
                "two",
                "\"gpuplex.io/gpus\" = \"2\"",
                "start = \"1s\"\ndemand = \"busy\"",
            ),
        ],
    );
    let r = run(&s).unwrap();
    assert_eq!(by_name(&r, "big").gpu_seconds, Some(5.0));
    for name in ["too-big", "two"] {
        let c = by_name(&r, name);
        let why = c
            .rejected
            .as_deref()
            .unwrap_or_else(|| panic!("{name} not rejected"));
        assert!(!why.is_empty() && !why.contains('\n'), "{why}");
        assert!(c.gpus.is_empty());
        assert_eq!((c.gpu_seconds, c.share, c.windows), (None, None, None));
    }
    assert!(r.to_json().contains("\"rejected\": "));
}

#[test]
fn arrivals_together_get_different_idle_gpus() {
    let s = scenario(
        "2s",
        2,
        &[
            ("a", SMALL, "demand = \"busy\""),
            ("b", SMALL, "demand = \"busy\""),
        ],
    );
    let r = run(&s).unwrap();
    assert_eq!(by_name(&r, "a").gpus, [0]);
    assert_eq!(by_name(&r, "b").gpus, [1]);
}

#[test]
fn the_seed_decides_exponential_demand() {
    let containers = [(
        "burst",
        SMALL,
        "demand = { on_mean = \"300ms\", off_mean = \"700ms\" }",
    )];
    let mut s = scenario("30s", 1, &containers);
    let first = run(&s).unwrap();
    assert_eq!(run(&s).unwrap().to_json(), first.to_json());
    s.seed = 1;
    let other = run(&s).unwrap();
    assert_ne!(
        other.containers[0].demand_seconds,
        first.containers[0].demand_seconds
    );
    let demand = first.containers[0].demand_seconds.unwrap();
    assert!((demand - 9.0).abs() < 3.0, "about 30% of 30 s: {demand}");
}

/// Ground truth adds up on every showcase scenario: the GPU time of the containers of a GPU is
/// its busy time, nobody gets more than it asked for, and the timeline shows the same run.
#[test]
fn showcase_scenarios_add_up() {
    let scenarios = [
        ("weights.toml", include_str!("../../scenarios/weights.toml")),
        ("bursty.toml", include_str!("../../scenarios/bursty.toml")),
        (
            "priorities.toml",
            include_str!("../../scenarios/priorities.toml"),
        ),
        (
            "multi-gpu.toml",
            include_str!("../../scenarios/multi-gpu.toml"),
        ),
    ];
    for (name, text) in scenarios {
        let s = Scenario::parse(text, name).unwrap();
        let r = run(&s).unwrap();
        // Every GPU-second of busy time went to someone, and nobody got one that was not busy.
        let used: f64 = r.containers.iter().filter_map(|c| c.gpu_seconds).sum();
        let busy: f64 = r.gpus.iter().map(|g| g.busy_fraction * r.duration).sum();
        assert!((used - busy).abs() < 1e-4, "{name}: {used} vs {busy}");
        for c in &r.containers {
            let most = c.demand_seconds.unwrap() * c.gpus.len() as f64;
            assert!(c.gpu_seconds.unwrap() <= most + 1e-6, "{name}: {c:?}");
            assert!(
                c.share.is_none_or(|share| (0.0..=1.0).contains(&share)),
                "{c:?}"
            );
            assert!(
                c.wait_p50 <= c.wait_p95 && c.wait_p95 <= c.wait_p99,
                "{c:?}"
            );
            assert!(c.wait_p99 <= c.max_wait, "{c:?}");
        }
        let timeline = Timeline::new(s.containers.len(), s.duration, s.duration / 50).unwrap();
        let (with_timeline, _) = run_with_timeline(&s, timeline).unwrap();
        assert_eq!(
            with_timeline, r,
            "{name}: recording a timeline changed the run"
        );
    }
}

/// The promised fraction of a GPU, computed directly: what [`GpuLive`] integrates.
fn fair_fraction(class: usize, weight: u64, wanting: &[u64; 3], high: u32) -> f64 {
    let top = wanting.iter().position(|&w| w > 0).unwrap_or(class);
    match (class == top, class) {
        (false, _) => 0.0,
        (true, 0) => 1.0 / f64::from(high.max(1)),
        (true, _) => weight as f64 / wanting[class] as f64,
    }
}

#[test]
fn gpus_integrate_the_promised_fractions() {
    // (class, weight, wanting per class, high count) -> fraction
    let cases: &[(usize, u64, [u64; 3], u32, f64)] = &[
        (1, 1, [0, 4, 0], 0, 0.25),
        (1, 3, [0, 4, 5], 0, 0.75),
        (2, 5, [0, 4, 5], 0, 0.0),
        (2, 5, [0, 0, 10], 0, 0.5),
        (1, 3, [2, 4, 0], 1, 0.0),
        (0, 7, [9, 4, 0], 2, 0.5),
    ];
    for &(class, weight, wanting, high, expected) in cases {
        assert_eq!(fair_fraction(class, weight, &wanting, high), expected);
        let mut gpu = GpuLive {
            running: 1,
            wanting,
            wanting_high: high,
            ..GpuLive::default()
        };
        gpu.advance(1000.0);
        let per = if class == 0 { 1.0 } else { weight as f64 };
        let got = gpu.fair[class] * per / 1000.0;
        assert!(
            (got - expected).abs() < 1e-12,
            "{class} {weight} {wanting:?} {high}: {got}"
        );
        assert_eq!((gpu.busy, gpu.share), (1000.0, 1000.0));
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Random scenarios replay without panicking, and every report adds up: no GPU is busy more
    /// than all the time, its users' GPU time fits in its busy time, shares are fractions, wait
    /// quantiles are ordered, and demand fits between start and stop.
    #[test]
    fn any_scenario_adds_up(
        gpus in 1usize..=3,
        containers in proptest::collection::vec(
            (
                1u32..=3,
                1u32..=10,
                proptest::sample::select(vec!["high", "normal", "normal", "normal", "low"]),
                1u32..=2,
                0u64..20,
                proptest::sample::select(vec![
                    "\"busy\"".to_string(),
                    "\"idle\"".to_string(),
                    "{ on = \"700ms\", off = \"1.3s\" }".to_string(),
                    "{ on_mean = \"300ms\", off_mean = \"900ms\" }".to_string(),
                ]),
            ),
            1..8,
        ),
        seed in 0u64..1_000,
    ) {
        let mut text = format!("duration = \"30s\"\nseed = {seed}\n");
        for _ in 0..gpus {
            text.push_str("[[gpu]]\nmodel = \"NVIDIA A100-SXM4-40GB\"\nmemory = \"40Gi\"\n");
        }
        for (i, (gib, weight, priority, count, start, demand)) in containers.iter().enumerate() {
            text.push_str(&format!(
                "[[container]]\nname = \"c{i}\"\nstart = \"{start}s\"\ndemand = {demand}\n\
                 annotations = {{ \"gpuplex.io/gpu-memory\" = \"{}Gi\", \"gpuplex.io/weight\" = \"{weight}\", \
                 \"gpuplex.io/priority\" = \"{priority}\", \"gpuplex.io/gpus\" = \"{count}\" }}\n",
                gib * 8
            ));
        }
        let scenario = Scenario::parse(&text, "random.toml").unwrap();
        let report = run(&scenario).unwrap();
        let duration = 30.0;
        for gpu in &report.gpus {
            proptest::prop_assert!((0.0..=1.0).contains(&gpu.busy_fraction), "{gpu:?}");
            let used: f64 = report
                .containers
                .iter()
                // A multi-GPU container's time may differ between its GPUs (two `high` ones
                // share one GPU and not the other): count the single-GPU users only.
                .filter(|c| c.gpus == [gpu.index])
                .map(|c| c.gpu_seconds.unwrap_or(0.0))
                .sum();
            proptest::prop_assert!(used <= gpu.busy_fraction * duration + 1e-3, "GPU {}: {used} s used, busy {}", gpu.index, gpu.busy_fraction);
        }
        for (c, spec) in report.containers.iter().zip(&scenario.containers) {
            if c.rejected.is_some() {
                proptest::prop_assert!(c.gpus.is_empty() && c.gpu_seconds.is_none());
                continue;
            }
            let life = (spec.stop - spec.start).as_secs_f64();
            proptest::prop_assert!(c.demand_seconds.unwrap() <= life + 1e-6);
            proptest::prop_assert!(c.gpu_seconds.unwrap() <= c.demand_seconds.unwrap() * c.gpus.len() as f64 + 1e-5);
            if let Some(share) = c.share {
                proptest::prop_assert!((0.0..=1.0 + 1e-9).contains(&share), "{c:?}");
            }
            let (p50, p95, p99, max) = (c.wait_p50.unwrap(), c.wait_p95.unwrap(), c.wait_p99.unwrap(), c.max_wait.unwrap());
            proptest::prop_assert!(p50 <= p95 && p95 <= p99 && p99 <= max && max <= c.wait_seconds.unwrap() + 1e-6, "{c:?}");
            if spec.request.priority == crate::request::Priority::High {
                proptest::prop_assert_eq!(c.wait_seconds.unwrap(), 0.0, "high never waits");
            }
        }
    }
}

#[test]
fn a_burst_of_work_alone_takes_its_work_and_beside_a_busy_one_waits_for_windows() {
    let work = "demand = { work_mean = \"200ms\", gap_mean = \"1s\" }";
    let s = scenario("60s", 1, &[("bursty", SMALL, work)]);
    let alone = run(&s).unwrap();
    let a = by_name(&alone, "bursty");
    let (gpu, demand) = (a.gpu_seconds.unwrap(), a.demand_seconds.unwrap());
    assert!(gpu > 5.0, "{a:?}");
    assert!(
        (gpu - demand).abs() < 1e-3,
        "alone, a burst takes its work: {a:?}"
    );
    assert!(
        a.bursts_unwindowed.unwrap() + a.bursts.unwrap() > 30,
        "{a:?}"
    );

    let s = scenario(
        "60s",
        1,
        &[
            ("bursty", SMALL, work),
            ("trainer", SMALL, "demand = \"busy\""),
        ],
    );
    let shared = run(&s).unwrap();
    let b = by_name(&shared, "bursty");
    // The same bursts (same seed and position), each done more slowly: it wants the GPU for
    // longer than the work it gets done, and fewer bursts fit in the run.
    assert!(
        b.demand_seconds.unwrap() > 1.5 * b.gpu_seconds.unwrap(),
        "{b:?}"
    );
    assert!(b.gpu_seconds.unwrap() < gpu, "{b:?} against {a:?}");
    assert!(
        b.bursts.unwrap() > 0 && b.burst_wait_p99.unwrap() > 0.0,
        "{b:?}"
    );
}
