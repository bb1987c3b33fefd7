//! Properties of the window scheduler over random nodes, demand patterns and event orders.
//!
//! A `Node` plays the node service: it samples activity every 50 ms (a vGPU shows work when it
//! ran with demand), also decides at the scheduler's `next_due`, applies the freeze and thaw
//! orders, and checks the invariants after every decision.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpuplex_scheduler::config::SchedulerConfig;
use gpuplex_scheduler::request::Priority;
use gpuplex_scheduler::windows::{Action, Binding, RunState, WindowScheduler};
use gpuplex_scheduler::{GpuIndex, Instant, VgpuId};
use proptest::prelude::*;

const SAMPLE_MS: u64 = 50;
const SLICE_MS: u64 = 200;
const GRACE_MS: u64 = 100;

fn at(ms: u64) -> Instant {
    Instant::from_nanos(ms * 1_000_000)
}

#[derive(Clone, Debug)]
struct Spec {
    gpus: Vec<u32>,
    weight: u32,
    priority: Priority,
    /// Bound during [start, stop) ms.
    start: u64,
    stop: u64,
    /// Demand: alternating on/off periods in ms, starting on; empty: always on.
    pattern: Vec<u64>,
}

impl Spec {
    fn demand(&self, t: u64) -> bool {
        if self.pattern.is_empty() {
            return true;
        }
        let period: u64 = self.pattern.iter().sum();
        let mut x = (t - self.start) % period.max(1);
        for (i, &len) in self.pattern.iter().enumerate() {
            if x < len {
                return i % 2 == 0;
            }
            x -= len;
        }
        false
    }
}

struct Node {
    s: WindowScheduler,
    specs: Vec<Spec>,
    frozen: BTreeSet<u64>,
    bound: BTreeSet<u64>,
    /// The last instant (ms) at which each vGPU's sample showed work.
    last_work: BTreeMap<u64, u64>,
    /// Ground truth: GPU ms used per vGPU (split evenly among those running with demand).
    used: Vec<f64>,
    waits: Vec<Vec<u64>>,
    frozen_at: BTreeMap<u64, u64>,
    /// The vGPUs the scheduler counted with work at the previous decision.
    had_work: BTreeSet<u64>,
    /// When the scheduler first counted each vGPU with work, until it holds a window.
    arrived: BTreeMap<u64, u64>,
    /// Each arrival's instant and wait for its window (ms), per vGPU.
    first_waits: Vec<Vec<(u64, u64)>>,
    /// The largest |lag| seen per vGPU, as a fraction of its bound (see `check`).
    lag_use: Vec<f64>,
    now: u64,
}

impl Node {
    fn new(gpus: u32, specs: Vec<Spec>) -> Node {
        let config = SchedulerConfig {
            slice: Duration::from_millis(SLICE_MS),
            idle_grace: Duration::from_millis(GRACE_MS),
            ..SchedulerConfig::default()
        };
        let n = specs.len();
        Node {
            s: WindowScheduler::new((0..gpus).map(GpuIndex), &config),
            specs,
            frozen: BTreeSet::new(),
            bound: BTreeSet::new(),
            last_work: BTreeMap::new(),
            used: vec![0.0; n],
            waits: vec![Vec::new(); n],
            frozen_at: BTreeMap::new(),
            had_work: BTreeSet::new(),
            arrived: BTreeMap::new(),
            first_waits: vec![Vec::new(); n],
            lag_use: vec![0.0; n],
            now: 0,
        }
    }

    fn running_with_demand(&self, i: usize, t: u64) -> bool {
        self.bound.contains(&(i as u64))
            && !self.frozen.contains(&(i as u64))
            && self.specs[i].demand(t)
    }

    /// Ground truth over [self.now, t): who used which GPU.
    fn account(&mut self, t: u64) {
        let gpus: BTreeSet<u32> = self.specs.iter().flat_map(|s| s.gpus.clone()).collect();
        for g in gpus {
            let users: Vec<usize> = (0..self.specs.len())
                .filter(|&i| {
                    self.specs[i].gpus.contains(&g) && self.running_with_demand(i, self.now)
                })
                .collect();
            for &i in &users {
                self.used[i] += (t - self.now) as f64 / users.len() as f64;
            }
        }
        self.now = t;
    }

    fn apply(&mut self, actions: &[Action], t: u64) {
        for a in actions {
            match *a {
                Action::Freeze(VgpuId(id)) => {
                    let last = self.last_work.get(&id).copied();
                    assert!(
                        last.is_some_and(|w| t < w + GRACE_MS),
                        "vgpu {id} frozen at {t} ms without work (last work {last:?})"
                    );
                    assert!(self.frozen.insert(id), "vgpu {id} frozen twice");
                    self.frozen_at.insert(id, t);
                }
                Action::Thaw(VgpuId(id)) => {
                    assert!(self.frozen.remove(&id), "vgpu {id} thawed while running");
                    let since = self.frozen_at.remove(&id).unwrap();
                    // Thawed into a window, it counts as working until it shows otherwise.
                    self.last_work.insert(id, t);
                    self.waits[id as usize].push(t - since);
                }
            }
        }
    }

    fn decide(&mut self, t: u64) -> Option<u64> {
        self.account(t);
        let d = self.s.decide(at(t));
        self.apply(&d.actions, t);
        self.check(t);
        d.next_due.map(|d| {
            let due = d.as_nanos().div_ceil(1_000_000);
            assert!(due > t, "next_due {due} is not after {t}");
            due
        })
    }

    /// Binds and unbinds by the specs, samples everyone (in `order`), decides.
    fn sample(&mut self, t: u64, order: &[usize]) -> Option<u64> {
        self.account(t);
        for &i in order {
            let id = i as u64;
            let spec = &self.specs[i];
            let live = spec.start <= t && t < spec.stop;
            if live && !self.bound.contains(&id) {
                let binding = Binding {
                    gpus: spec.gpus.iter().map(|&g| GpuIndex(g)).collect(),
                    weight: spec.weight,
                    priority: spec.priority,
                };
                self.s.bind(VgpuId(id), binding, at(t)).unwrap();
                self.bound.insert(id);
            } else if !live && self.bound.remove(&id) {
                let thaw = self.s.unbind(VgpuId(id), at(t)).unwrap().thaw;
                assert_eq!(thaw.is_some(), self.frozen.remove(&id), "unbind of {id}");
                self.frozen_at.remove(&id);
            }
        }
        for &i in order {
            let id = i as u64;
            if !self.bound.contains(&id) {
                continue;
            }
            // A sample shows work when the vGPU ran with demand since the previous sample.
            let worked = !self.frozen.contains(&id)
                && (t.saturating_sub(SAMPLE_MS)..t)
                    .step_by(10)
                    .any(|x| self.specs[i].demand(x.max(self.specs[i].start)));
            if worked {
                self.last_work.insert(id, t);
            }
            assert!(self.s.observe(VgpuId(id), worked, at(t)));
        }
        self.decide(t)
    }

    fn run(&mut self, until: u64, order: &[usize]) {
        let mut t = 0;
        while t < until {
            let mut due = self.sample(t, order);
            while let Some(d) = due.filter(|&d| d < t + SAMPLE_MS) {
                due = self.decide(d);
            }
            t += SAMPLE_MS;
        }
        self.account(until);
    }

    /// The invariants that hold after every decision.
    fn check(&mut self, t: u64) {
        let views: BTreeMap<u64, _> = self
            .bound
            .iter()
            .map(|&id| (id, self.s.vgpu(VgpuId(id)).unwrap()))
            .collect();
        for (&id, view) in &views {
            let frozen = view.state == RunState::Frozen;
            assert_eq!(frozen, self.frozen.contains(&id), "vgpu {id} state at {t}");
            if frozen {
                assert!(view.has_work, "vgpu {id} frozen without work at {t}");
                assert_ne!(
                    view.binding.priority,
                    Priority::High,
                    "high vgpu {id} frozen at {t}"
                );
            }
            let others_with_work = views.iter().any(|(&o, ov)| {
                o != id
                    && ov.has_work
                    && ov
                        .binding
                        .gpus
                        .iter()
                        .any(|g| view.binding.gpus.contains(g))
            });
            if view.has_work && !others_with_work {
                assert!(!frozen, "vgpu {id} alone with work but frozen at {t}");
            }
            if view.has_work && !frozen && view.binding.priority != Priority::High {
                for g in &view.binding.gpus {
                    let holder = self.s.gpu(*g).unwrap().holder;
                    assert_eq!(
                        holder,
                        Some(VgpuId(id)),
                        "vgpu {id} runs on GPU {g} without holding it at {t}"
                    );
                }
            }
        }
        for (&id, view) in &views {
            // Lag stays within two windows' worth of every weight sharing its GPUs, per GPU.
            let bound: f64 = (view.binding.gpus.iter())
                .map(|g| {
                    let weights: u32 = (views.values())
                        .filter(|o| o.binding.gpus.contains(g))
                        .map(|o| o.binding.weight)
                        .sum();
                    2.0 * SLICE_MS as f64 / 1000.0 * f64::from(weights)
                })
                .sum();
            let used = view.lag_seconds.abs() / bound;
            assert!(
                used <= 1.0,
                "vgpu {id} lag {} s beyond ±{bound} s at {t}",
                view.lag_seconds
            );
            let i = id as usize;
            self.lag_use[i] = self.lag_use[i].max(used);
            // Arrivals: from the decision that first counts it with work to its window.
            let arrives = view.has_work && self.had_work.insert(id);
            if !view.has_work {
                self.had_work.remove(&id);
                self.arrived.remove(&id);
            } else if arrives {
                self.arrived.insert(id, t);
            }
            if view.window_end.is_some() {
                if let Some(since) = self.arrived.remove(&id) {
                    self.first_waits[i].push((since, t - since));
                }
            }
        }
        let gpus: BTreeSet<GpuIndex> = views
            .values()
            .flat_map(|v| v.binding.gpus.clone())
            .collect();
        for g in gpus {
            // Work conservation: a GPU where a single-GPU vGPU of the class it serves waits has a
            // window holder, unless a `high` vGPU has work there.
            let on_g = |v: &&gpuplex_scheduler::windows::VgpuView| {
                v.binding.gpus.contains(&g) && v.has_work
            };
            let high = views
                .values()
                .filter(on_g)
                .any(|v| v.binding.priority == Priority::High);
            let normal = views
                .values()
                .filter(on_g)
                .any(|v| v.binding.priority == Priority::Normal);
            let serves = if normal {
                Priority::Normal
            } else {
                Priority::Low
            };
            let single_waits = (views.values().filter(on_g))
                .any(|v| v.binding.priority == serves && v.binding.gpus.len() == 1);
            if single_waits && !high {
                assert!(
                    self.s.gpu(g).unwrap().holder.is_some(),
                    "GPU {g} idles while a vGPU waits at {t}: {:?} {views:#?}",
                    self.s.gpu(g)
                );
            }
            let running: Vec<u64> = views
                .iter()
                .filter(|(_, v)| {
                    v.binding.gpus.contains(&g)
                        && v.has_work
                        && v.state == RunState::Running
                        && v.binding.priority != Priority::High
                })
                .map(|(&id, _)| id)
                .collect();
            assert!(
                running.len() <= 1,
                "GPU {g} runs {running:?} at once at {t}"
            );
        }
    }
}

fn priority() -> impl Strategy<Value = Priority> {
    prop_oneof![8 => Just(Priority::Normal), 1 => Just(Priority::High), 2 => Just(Priority::Low)]
}

fn gpu_set(gpus: u32) -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        4 => (0..gpus).prop_map(|g| vec![g]),
        1 => proptest::sample::subsequence((0..gpus).collect::<Vec<_>>(), 1..=gpus as usize),
    ]
}

fn spec(gpus: u32, horizon: u64) -> impl Strategy<Value = Spec> {
    (
        gpu_set(gpus),
        1u32..=10,
        priority(),
        0..horizon / 2,
        horizon / 2..=horizon + 1,
        prop_oneof![
            1 => Just(vec![]),
            3 => proptest::collection::vec(10u64..1_500, 2..6),
        ],
    )
        .prop_map(|(gpus, weight, priority, start, stop, pattern)| Spec {
            gpus,
            weight,
            priority,
            start: start / SAMPLE_MS * SAMPLE_MS,
            stop,
            pattern,
        })
}

fn node(horizon: u64) -> impl Strategy<Value = (u32, Vec<Spec>, Vec<usize>)> {
    (1u32..=3).prop_flat_map(move |gpus| {
        proptest::collection::vec(spec(gpus, horizon), 1..=7).prop_flat_map(move |specs| {
            let order = Just((0..specs.len()).collect::<Vec<_>>()).prop_shuffle();
            (Just(gpus), Just(specs), order)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// No two non-high vGPUs run with work on one GPU; no vGPU is frozen without work, nor when
    /// alone with work on its GPUs; a multi-GPU vGPU runs only holding all its GPUs; high is
    /// never frozen — whatever the demand, priorities, arrivals, departures and sample order.
    #[test]
    fn invariants_hold_after_every_decision((gpus, specs, order) in node(20_000)) {
        let mut n = Node::new(gpus, specs);
        n.run(20_000, &order);
    }

    /// A continuously busy `normal` vGPU gets a window within
    /// 2 × slice × (sum of the weights of the other vGPUs on the node) + one sampling interval.
    #[test]
    fn every_busy_vgpu_gets_a_window_within_the_bound(
        (gpus, mut specs, order) in node(30_000),
    ) {
        for s in &mut specs {
            s.priority = Priority::Normal;
            s.pattern.clear();
            s.start = 0;
            s.stop = u64::MAX;
        }
        let mut n = Node::new(gpus, specs.clone());
        n.run(30_000, &order);
        let total: u64 = specs.iter().map(|s| u64::from(s.weight)).sum();
        for (i, s) in specs.iter().enumerate() {
            let bound = 2 * SLICE_MS * (total - u64::from(s.weight)) + SAMPLE_MS;
            let worst = n.waits[i].iter().copied().max().unwrap_or(0);
            prop_assert!(worst <= bound, "vgpu {} waited {} ms > {} ms", i, worst, bound);
            prop_assert!(n.used[i] > 0.0, "vgpu {} never ran", i);
        }
    }

    /// With N continuously busy `normal` vGPUs on one GPU, each one's share of the GPU time
    /// converges to weight / Σ weights within ±2% (relative) over 20 minutes.
    #[test]
    fn shares_converge_to_the_weights(weights in proptest::collection::vec(1u32..=10, 2..=6)) {
        let specs: Vec<Spec> = weights
            .iter()
            .map(|&weight| Spec {
                gpus: vec![0],
                weight,
                priority: Priority::Normal,
                start: 0,
                stop: u64::MAX,
                pattern: vec![],
            })
            .collect();
        let order: Vec<usize> = (0..specs.len()).collect();
        let mut n = Node::new(1, specs);
        n.run(20 * 60 * 1000, &order);
        let total: f64 = n.used.iter().sum();
        let sum_w: u32 = weights.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let fair = f64::from(w) / f64::from(sum_w);
            let share = n.used[i] / total;
            prop_assert!((share - fair).abs() <= 0.02 * fair, "weights {:?}: vgpu {} got {} for {}", weights, i, share, fair);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Beside always-busy `normal` vGPUs of any weights, a vGPU whose work begins (as the
    /// scheduler sees it: a sample shows work after none) holds a window within one slice,
    /// whatever its weight and lag; with `k` such vGPUs, within one slice and `k - 1` shortest
    /// windows (`max(slice / 4, idle_grace)`): a window granted while fresh vGPUs wait ends by
    /// the first one's deadline, or after the shortest window when that deadline is nearer.
    /// Lags stay within their bound throughout (`check`), and the busy ones keep getting
    /// windows.
    #[test]
    fn work_that_begins_gets_a_window_within_a_slice_per_arrival_ahead(
        steady in proptest::collection::vec(1u32..=10, 1..=4),
        bursty in proptest::collection::vec(
            (1u32..=10, proptest::collection::vec(60u64..1_500, 2..6)),
            1..=3,
        ),
    ) {
        let specs: Vec<Spec> = (steady.iter().map(|&weight| (weight, vec![])))
            .chain(bursty.iter().cloned())
            .map(|(weight, pattern)| Spec {
                gpus: vec![0],
                weight,
                priority: Priority::Normal,
                start: 0,
                stop: u64::MAX,
                pattern,
            })
            .collect();
        let order: Vec<usize> = (0..specs.len()).collect();
        let mut n = Node::new(1, specs);
        n.run(60_000, &order);
        let shortest = (SLICE_MS / 4).max(GRACE_MS);
        let bound = SLICE_MS + shortest * (bursty.len() as u64 - 1);
        for i in steady.len()..n.specs.len() {
            // The start, when every vGPU arrives at once, is left out.
            for &(since, wait) in n.first_waits[i].iter().filter(|(since, _)| *since >= 5_000) {
                prop_assert!(wait <= bound, "vgpu {} got work at {} ms, waited {} ms > {} ms", i, since, wait, bound);
            }
        }
        for i in 0..steady.len() {
            prop_assert!(n.waits[i].iter().any(|&w| w > 0) || n.used[i] > 0.0, "vgpu {} never ran", i);
        }
    }
}
