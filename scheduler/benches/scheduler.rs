//! The scheduler core's performance targets (issue #2):
//! - one scheduling decision, 1,000 vGPUs bound to 8 GPUs, 1 to 10 with work per GPU: < 20 µs;
//! - one assignment among 8 GPUs: < 2 µs;
//! - the simulator replays 1 hour of 100 containers on 8 GPUs: < 1 s.
//!
//! Run: `cargo bench -p gpuplex-scheduler --bench scheduler`.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use gpuplex_scheduler::config::SchedulerConfig;
use gpuplex_scheduler::inventory::{AssignmentPolicy, Gpu, Inventory};
use gpuplex_scheduler::request::{GpuMemory, Priority, VgpuRequest};
use gpuplex_scheduler::windows::{Binding, WindowScheduler};
use gpuplex_scheduler::{sim, GpuIndex, Instant, VgpuId};

const GPUS: u32 = 8;
const VGPUS: u64 = 1_000;

/// 1,000 vGPUs round-robin over 8 GPUs; on GPU g, the first `working(g)` of them have work.
fn busy_node(working: impl Fn(u32) -> u64) -> (WindowScheduler, Vec<VgpuId>, Instant) {
    let config = SchedulerConfig::default();
    let mut s = WindowScheduler::new((0..GPUS).map(GpuIndex), &config);
    let mut now = Instant::ZERO;
    let mut with_work = Vec::new();
    for n in 0..VGPUS {
        let gpu = (n % u64::from(GPUS)) as u32;
        let binding = Binding {
            gpus: vec![GpuIndex(gpu)],
            weight: (n % 7 + 1) as u32,
            priority: Priority::Normal,
        };
        s.bind(VgpuId(n), binding, now).unwrap();
        if n / u64::from(GPUS) < working(gpu) {
            with_work.push(VgpuId(n));
        }
    }
    // Warm up: a few seconds of samples so windows, waits and floors are in steady state.
    for _ in 0..100 {
        now = now + Duration::from_millis(50);
        for &v in &with_work {
            s.observe(v, true, now);
        }
        s.decide(now);
    }
    (s, with_work, now)
}

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide");
    for (name, working) in [
        (
            "1000 vGPUs, 8 GPUs, 10 with work each",
            Box::new(|_| 10u64) as Box<dyn Fn(u32) -> u64>,
        ),
        (
            "1000 vGPUs, 8 GPUs, 1 to 10 with work",
            Box::new(|g| [1, 2, 3, 5, 6, 8, 9, 10][g as usize]),
        ),
    ] {
        let (mut s, with_work, mut now) = busy_node(working);
        // The service samples every 50 ms; between samples it decides at window ends. One
        // iteration: time moves 10 ms, the running vGPUs show work, one decision.
        group.bench_function(name, |b| {
            b.iter(|| {
                now = now + Duration::from_millis(10);
                for &v in &with_work {
                    s.observe(v, true, now);
                }
                black_box(s.decide(now));
            })
        });
    }
    let (mut s, with_work, mut now) = busy_node(|_| 10u64);
    let mut all: Vec<(VgpuId, bool)> = s.vgpus().map(|v| (v, with_work.contains(&v))).collect();
    all.sort();
    group.bench_function("sample round: 1000 observations + decide", |b| {
        b.iter(|| {
            now = now + Duration::from_millis(50);
            for &(v, works) in &all {
                s.observe(v, works, now);
            }
            black_box(s.decide(now));
        })
    });
    group.finish();
}

fn assignment(c: &mut Criterion) {
    let gpus = (0..GPUS)
        .map(|i| Gpu {
            index: GpuIndex(i),
            uuid: format!("GPU-bench-{i}"),
            model: if i < 4 {
                "NVIDIA A100-SXM4-80GB"
            } else {
                "NVIDIA H100 80GB HBM3"
            }
            .into(),
            memory: 80 << 30,
        })
        .collect();
    let mut inventory = Inventory::new(gpus, 1.0).unwrap();
    // A loaded node: 100 vGPUs of 4 GiB already bound.
    let small = VgpuRequest {
        memory: GpuMemory::Bytes(4 << 30),
        ..VgpuRequest::default()
    };
    for n in 0..100 {
        inventory
            .assign(VgpuId(n), &small, AssignmentPolicy::Spread, |g| {
                g.0 % 2 == 0
            })
            .unwrap();
    }
    let request = VgpuRequest {
        memory: GpuMemory::Bytes(8 << 30),
        models: vec!["H100".into(), "A100".into()],
        ..VgpuRequest::default()
    };
    c.bench_function("assign among 8 GPUs (and release)", |b| {
        b.iter(|| {
            let a = inventory
                .assign(VgpuId(1_000_000), &request, AssignmentPolicy::Spread, |g| {
                    g.0 % 2 == 0
                })
                .unwrap();
            black_box(&a);
            inventory.release(VgpuId(1_000_000));
        })
    });
}

fn simulator(c: &mut Criterion) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/fleet.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let scenario = sim::Scenario::parse(&text, "fleet.toml").unwrap();
    let mut group = c.benchmark_group("simulator");
    group.sample_size(10);
    group.bench_function("fleet.toml: 1 h, 100 containers, 8 GPUs", |b| {
        b.iter_batched(
            || scenario.clone(),
            |s| black_box(sim::run(&s)),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, decision, assignment, simulator);
criterion_main!(benches);
