//! The event loop: replays a scenario against the real node (inventory and window scheduler),
//! through the same calls the node service makes: register, observe, decide, release.
//!
//! Virtual time jumps from event to event: the next activity sample, the scheduler's
//! `next_due`, a container's start or stop, a change of some running container's demand, or the
//! end. At each event the interval since the previous one is accounted first, then demand
//! changes, stops, starts (one assignment batch per instant), the activity sample at sample
//! ticks, and a decision whose freeze and thaw orders are applied to the simulated containers.
//!
//! Ground truth: the containers that run unfrozen with demand on a GPU share it evenly. It is
//! accounted with per-GPU integrals over time (GPU time per user, busy time, fair share per unit
//! of weight), advanced at every event in O(GPUs); a container reads the integrals of its GPUs
//! when its own state changes. So an event costs O(GPUs + containers whose state changes), plus
//! one `observe` per running container at sample ticks. Everything per container lives in plain
//! vectors indexed by the container's position in the scenario. Nothing is allocated per event.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use super::demand::{Demand, DemandCursor, SplitMix64};
use super::report::{micros, ContainerReport, GpuReport, Report};
use super::scenario::Scenario;
use super::timeline::Timeline;
use crate::accounting::{VgpuStats, WaitHistogram};
use crate::inventory::{Gpu, InventoryError};
use crate::node::{Attachment, Node, ReleaseKey, Target};
use crate::request::Priority;
use crate::windows::Action;
use crate::{GpuIndex, Handle, Instant, VgpuId};

/// Replays `scenario` and reports what happened.
pub fn run(scenario: &Scenario) -> Result<Report, InventoryError> {
    Ok(Engine::new(scenario, None)?.run().0)
}

/// Replays `scenario`, recording `timeline` as well.
pub fn run_with_timeline(
    scenario: &Scenario,
    timeline: Timeline,
) -> Result<(Report, Timeline), InventoryError> {
    let (report, timeline) = Engine::new(scenario, Some(timeline))?.run();
    Ok((report, timeline.expect("a timeline was given")))
}

/// Where a container is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Pending,
    Running,
    Done,
    Rejected,
}

/// One simulated container's state and ground-truth tallies (nanoseconds).
#[derive(Clone, Debug)]
struct Container {
    phase: Phase,
    /// Its GPUs' positions.
    gpus: Vec<usize>,
    weight: u64,
    class: usize,
    /// Frozen by the scheduler's order (only while running).
    frozen: bool,
    /// Running with demand.
    wants: bool,
    /// Running, unfrozen, with demand: using its GPUs.
    uses: bool,
    /// It used its GPUs for some time since the previous sample.
    worked: bool,
    using_since: Instant,
    wanting_since: Instant,
    frozen_since: Instant,
    /// Σ over its GPUs of the GPU-time integral when it started using them.
    share_mark: f64,
    /// Σ over its GPUs of the busy and fair integrals when it started wanting them.
    busy_mark: f64,
    fair_mark: f64,
    /// GPU time received, summed over its GPUs.
    gpu_time: f64,
    /// Time with demand.
    demand: f64,
    /// Busy time of its GPUs, summed over them, while it had demand.
    busy_while_demand: f64,
    /// The fraction of its GPUs the scheduling rules promise it (see [`GpuLive::fair`]),
    /// integrated over the time it had demand, summed over its GPUs.
    fair: f64,
    stats: Option<VgpuStats>,
    rejected: Option<String>,
    /// When its current burst of demand began, until it holds its GPUs' windows, and whether
    /// it began while the container was frozen (the scheduler cannot see it begin).
    burst_since: Option<(Instant, bool)>,
    /// Each burst's wait from its start to its first window.
    burst_waits: WaitHistogram,
    /// The same, for the bursts that began while the container was running.
    running_burst_waits: WaitHistogram,
    /// Bursts that ended before a window (served, if at all, while not frozen between windows).
    bursts_unwindowed: u64,
}

/// One GPU's state and integrals (nanoseconds).
#[derive(Clone, Debug, Default)]
struct GpuLive {
    /// Containers using it.
    running: u32,
    /// Σ weights of the containers that want it, per class (high, normal, low).
    wanting: [u64; 3],
    /// `high` containers that want it.
    wanting_high: u32,
    /// ∫ 1/running dt while running > 0: the GPU time of each user.
    share: f64,
    /// ∫ dt while running > 0.
    busy: f64,
    /// ∫ dt while some container wants it.
    wanted: f64,
    /// ∫ of the fraction of the GPU the scheduling rules promise a container that wants it:
    /// `high` containers are never frozen and split the GPU evenly among themselves; otherwise
    /// the highest class that wants the GPU shares it by weight, and lower classes get nothing.
    /// Per container for class 0 (high), per unit of weight for classes 1 and 2.
    fair: [f64; 3],
}

impl GpuLive {
    fn advance(&mut self, dt: f64) {
        if self.running > 0 {
            self.share += dt / f64::from(self.running);
            self.busy += dt;
        }
        if self.wanting.iter().any(|&w| w > 0) {
            self.wanted += dt;
        }
        match self.wanting.iter().position(|&w| w > 0) {
            Some(0) => self.fair[0] += dt / f64::from(self.wanting_high.max(1)),
            Some(top) => self.fair[top] += dt / self.wanting[top] as f64,
            None => {}
        }
    }
}

/// Priority class: 0 high, 1 normal, 2 low.
fn class_of(priority: Priority) -> usize {
    match priority {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

struct Engine<'a> {
    scenario: &'a Scenario,
    node: Node,
    /// Each container's vGPU, once registered.
    vgpus: Vec<Option<VgpuId>>,
    /// The container of each vGPU.
    containers_of: HashMap<VgpuId, usize>,
    containers: Vec<Container>,
    demand: Vec<DemandCursor>,
    gpus: Vec<GpuLive>,
    /// Next demand change of each running container whose demand changes (stale entries, of
    /// stopped containers, are skipped when they come up).
    changes: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Container positions by start time, and the next one to start.
    starts: Vec<usize>,
    next_start: usize,
    /// Container positions by stop time, and the next one to stop.
    stops: Vec<usize>,
    next_stop: usize,
    last_sample: Instant,
    /// The containers whose demand is bursts of work ([`super::demand::Demand::Work`]): their
    /// bursts end when their work is done, so their progress is counted at every event.
    working: Vec<usize>,
    /// Containers whose burst of work was done at the end of the last interval.
    done: Vec<usize>,
    timeline: Option<Timeline>,
}

impl<'a> Engine<'a> {
    fn new(scenario: &'a Scenario, timeline: Option<Timeline>) -> Result<Self, InventoryError> {
        let gpus: Vec<Gpu> = scenario
            .gpus
            .iter()
            .enumerate()
            .map(|(i, spec)| Gpu {
                index: GpuIndex(i as u32),
                uuid: format!("GPU-sim-{i}"),
                model: spec.model.clone(),
                memory: spec.memory,
            })
            .collect();
        let node = Node::new(gpus, scenario.scheduler.clone())?;
        let n = scenario.containers.len();
        let containers = scenario
            .containers
            .iter()
            .map(|spec| Container {
                phase: Phase::Pending,
                gpus: Vec::new(),
                weight: u64::from(spec.request.weight),
                class: class_of(spec.request.priority),
                frozen: false,
                wants: false,
                uses: false,
                worked: false,
                using_since: Instant::ZERO,
                wanting_since: Instant::ZERO,
                frozen_since: Instant::ZERO,
                share_mark: 0.0,
                busy_mark: 0.0,
                fair_mark: 0.0,
                gpu_time: 0.0,
                demand: 0.0,
                busy_while_demand: 0.0,
                fair: 0.0,
                stats: None,
                rejected: None,
                burst_since: None,
                burst_waits: WaitHistogram::default(),
                running_burst_waits: WaitHistogram::default(),
                bursts_unwindowed: 0,
            })
            .collect();
        let demand = scenario
            .containers
            .iter()
            .enumerate()
            .map(|(c, spec)| {
                let rng = SplitMix64::for_container(scenario.seed, c);
                DemandCursor::new(spec.demand, spec.start, rng)
            })
            .collect();
        let mut starts: Vec<usize> = (0..n).collect();
        starts.sort_by_key(|&c| (scenario.containers[c].start, c));
        let mut stops: Vec<usize> = (0..n).collect();
        stops.sort_by_key(|&c| (scenario.containers[c].stop, c));
        Ok(Engine {
            scenario,
            node,
            vgpus: vec![None; n],
            containers_of: HashMap::with_capacity(n),
            containers,
            demand,
            gpus: vec![GpuLive::default(); scenario.gpus.len()],
            changes: BinaryHeap::with_capacity(n),
            starts,
            next_start: 0,
            stops,
            next_stop: 0,
            last_sample: Instant::ZERO,
            working: (0..n)
                .filter(|&c| matches!(scenario.containers[c].demand, Demand::Work { .. }))
                .collect(),
            done: Vec::new(),
            timeline,
        })
    }

    fn run(mut self) -> (Report, Option<Timeline>) {
        let end = Instant::from_duration(self.scenario.duration);
        let interval = self.scenario.sample_interval;
        let mut now = Instant::ZERO;
        let mut next_sample = Instant::ZERO + interval;
        let mut due: Option<Instant> = None;
        loop {
            for c in std::mem::take(&mut self.done) {
                self.refresh(c, now);
            }
            self.demand_changes(now);
            if now == end {
                break;
            }
            let mut changed = self.stop_due(now);
            changed |= self.start_due(now);
            let sample = now == next_sample;
            if sample {
                self.sample(now);
                next_sample = now + interval;
            }
            if sample || changed || due.is_some_and(|d| d <= now) {
                due = self.decide(now);
            }
            let next = self.next_event(now, end, next_sample, due);
            self.work_progress(now, next);
            let dt = (next - now).as_nanos() as f64;
            for gpu in &mut self.gpus {
                gpu.advance(dt);
            }
            now = next;
        }
        for c in 0..self.containers.len() {
            if self.containers[c].phase == Phase::Running {
                self.stop(c, end);
            }
        }
        (self.report(), self.timeline)
    }

    /// The earliest event after `now`.
    fn next_event(
        &self,
        now: Instant,
        end: Instant,
        next_sample: Instant,
        due: Option<Instant>,
    ) -> Instant {
        let mut next = end.min(next_sample);
        // A decision due at or before now was just taken: only a later one counts.
        if let Some(due) = due.filter(|&d| d > now) {
            next = next.min(due);
        }
        if let Some(&c) = self.starts.get(self.next_start) {
            next = next.min(self.scenario.containers[c].start);
        }
        if let Some(&c) = self.stops.get(self.next_stop) {
            next = next.min(self.scenario.containers[c].stop);
        }
        if let Some(Reverse((at, _))) = self.changes.peek() {
            next = next.min(*at);
        }
        for &c in &self.working {
            if let Some(pace) = self.pace(c) {
                let left = self.demand[c].work_left().unwrap_or_default();
                let nanos = u64::try_from(left.as_nanos() * u128::from(pace)).unwrap_or(u64::MAX);
                next = next.min(now + Duration::from_nanos(nanos.max(1)));
            }
        }
        next
    }

    /// How many containers share the busiest of `c`'s GPUs while `c` works through a burst and
    /// runs: its work is done at 1 / that rate (a multi-GPU step goes at the pace of its
    /// slowest GPU). `None` while it does not run or has no burst.
    fn pace(&self, c: usize) -> Option<u64> {
        let container = &self.containers[c];
        if !container.uses || self.demand[c].work_left().is_none() {
            return None;
        }
        let most = container.gpus.iter().map(|&g| self.gpus[g].running).max();
        Some(u64::from(most.unwrap_or(1).max(1)))
    }

    /// Counts the work done by the containers in bursts from `now` to `next`; those whose work
    /// is done stop wanting the GPU at `next`.
    fn work_progress(&mut self, now: Instant, next: Instant) {
        let span = next - now;
        for i in 0..self.working.len() {
            let c = self.working[i];
            let Some(pace) = self.pace(c) else {
                continue;
            };
            let pace = u32::try_from(pace).unwrap_or(u32::MAX);
            self.demand[c].work_done(span / pace, next);
            if !self.demand[c].is_on() {
                if let Some(at) = self.demand[c].next_change() {
                    self.changes.push(Reverse((at, c)));
                }
                self.done.push(c);
            }
        }
    }

    /// Applies the demand changes due at `now`.
    fn demand_changes(&mut self, now: Instant) {
        while let Some(&Reverse((at, c))) = self.changes.peek() {
            if at > now {
                break;
            }
            self.changes.pop();
            if self.containers[c].phase != Phase::Running {
                continue;
            }
            self.demand[c].advance(now);
            if let Some(next) = self.demand[c].next_change() {
                self.changes.push(Reverse((next, c)));
            }
            self.refresh(c, now);
        }
    }

    /// Brings container `c`'s wanting, using and frozen periods, and its GPUs' counts, in line
    /// with its phase, demand and freezer state at `now`.
    fn refresh(&mut self, c: usize, now: Instant) {
        let running = self.containers[c].phase == Phase::Running;
        let wants = running && self.demand[c].is_on();
        let frozen = running && self.containers[c].frozen;
        let uses = wants && !frozen;
        let container = &mut self.containers[c];
        let gpus = &mut self.gpus;
        let share_sum = |gpus: &[GpuLive], own: &[usize]| own.iter().map(|&g| gpus[g].share).sum();
        let busy_sum = |gpus: &[GpuLive], own: &[usize]| own.iter().map(|&g| gpus[g].busy).sum();
        let fair_sum = |gpus: &[GpuLive], own: &[usize], class: usize, weight: u64| -> f64 {
            let per = if class == 0 { 1.0 } else { weight as f64 };
            own.iter().map(|&g| gpus[g].fair[class] * per).sum()
        };

        if uses != container.uses {
            if uses {
                container.using_since = now;
                container.share_mark = share_sum(gpus, &container.gpus);
            } else {
                container.gpu_time += share_sum(gpus, &container.gpus) - container.share_mark;
                if now > container.using_since.max(self.last_sample) {
                    container.worked = true;
                }
                if let Some(timeline) = &mut self.timeline {
                    timeline.record(c, container.using_since, now, true, false);
                }
            }
            for &g in &container.gpus {
                if uses {
                    gpus[g].running += 1;
                } else {
                    gpus[g].running -= 1;
                }
            }
            container.uses = uses;
        }
        if wants != container.wants {
            if wants {
                container.burst_since = Some((now, frozen));
            } else if container.burst_since.take().is_some() {
                container.bursts_unwindowed += 1;
            }
            if wants {
                container.wanting_since = now;
                container.busy_mark = busy_sum(gpus, &container.gpus);
                container.fair_mark =
                    fair_sum(gpus, &container.gpus, container.class, container.weight);
            } else {
                container.demand += (now - container.wanting_since).as_nanos() as f64;
                container.busy_while_demand +=
                    busy_sum(gpus, &container.gpus) - container.busy_mark;
                container.fair +=
                    fair_sum(gpus, &container.gpus, container.class, container.weight)
                        - container.fair_mark;
            }
            for &g in &container.gpus {
                let gpu = &mut gpus[g];
                if wants {
                    gpu.wanting[container.class] += container.weight;
                    gpu.wanting_high += u32::from(container.class == 0);
                } else {
                    gpu.wanting[container.class] -= container.weight;
                    gpu.wanting_high -= u32::from(container.class == 0);
                }
            }
            container.wants = wants;
        }
        let was_frozen = container.frozen_since != Instant::from_nanos(u64::MAX);
        if frozen != was_frozen {
            if frozen {
                container.frozen_since = now;
            } else {
                if let Some(timeline) = &mut self.timeline {
                    timeline.record(c, container.frozen_since, now, false, true);
                }
                container.frozen_since = Instant::from_nanos(u64::MAX);
            }
        }
    }

    /// Stops the containers whose stop time is `now`; whether any stopped.
    fn stop_due(&mut self, now: Instant) -> bool {
        let mut any = false;
        while let Some(&c) = self.stops.get(self.next_stop) {
            if self.scenario.containers[c].stop > now {
                break;
            }
            self.next_stop += 1;
            if self.containers[c].phase == Phase::Running {
                self.stop(c, now);
                any = true;
            }
        }
        any
    }

    /// Releases a running container, keeping its statistics (an open wait closed at `now`).
    fn stop(&mut self, c: usize, now: Instant) {
        let Some(id) = self.vgpus[c] else {
            return;
        };
        let released = self.node.release(&ReleaseKey::Vgpu(id), now);
        self.containers[c].stats = released.and_then(|r| r.stats);
        self.containers[c].phase = Phase::Done;
        self.containers[c].frozen = false;
        self.refresh(c, now);
    }

    /// Starts the containers whose start time is `now`, as one assignment batch; whether any
    /// started or was rejected.
    fn start_due(&mut self, now: Instant) -> bool {
        let first = self.next_start;
        while let Some(&c) = self.starts.get(self.next_start) {
            if self.scenario.containers[c].start > now {
                break;
            }
            self.next_start += 1;
        }
        if first == self.next_start {
            return false;
        }
        for i in first..self.next_start {
            let c = self.starts[i];
            let spec = &self.scenario.containers[c];
            let annotations = spec
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()));
            let attachment = Attachment {
                container: format!("sim-{c}"),
                target: Target::Cgroup(format!("/gpuplex-sim/{c}")),
            };
            // The simulator's handles need not be secret, only distinct: the container's index.
            let handle = Handle::from_bytes((c as u128).to_be_bytes());
            let assignment = match self.node.register(annotations, handle, attachment, now) {
                Ok(record) => record.assignment.clone(),
                Err(e) => {
                    self.reject(c, e.to_string());
                    continue;
                }
            };
            self.vgpus[c] = Some(assignment.vgpu);
            self.containers_of.insert(assignment.vgpu, c);
            let container = &mut self.containers[c];
            container.gpus = assignment.gpus.iter().map(|g| g.0 as usize).collect();
            container.phase = Phase::Running;
            container.frozen_since = Instant::from_nanos(u64::MAX);
            if let Some(next) = self.demand[c].next_change() {
                self.changes.push(Reverse((next, c)));
            }
            self.refresh(c, now);
        }
        true
    }

    fn reject(&mut self, c: usize, why: String) {
        self.containers[c].phase = Phase::Rejected;
        self.containers[c].rejected = Some(why);
    }

    /// The activity sample: every running container says whether it worked since the previous
    /// sample.
    fn sample(&mut self, now: Instant) {
        for (c, container) in self.containers.iter_mut().enumerate() {
            if container.phase != Phase::Running {
                continue;
            }
            let worked = container.worked
                || (container.uses && now > container.using_since.max(self.last_sample));
            if let Some(id) = self.vgpus[c] {
                self.node.observe(id, worked, now);
            }
            container.worked = false;
        }
        self.last_sample = now;
    }

    /// Asks the scheduler who runs now and applies its orders; returns its `next_due`.
    fn decide(&mut self, now: Instant) -> Option<Instant> {
        let decision = self.node.decide(now);
        for &action in &decision.actions {
            let (id, frozen) = match action {
                Action::Freeze(id) => (id, true),
                Action::Thaw(id) => (id, false),
            };
            let Some(&c) = self.containers_of.get(&id) else {
                continue;
            };
            if let Some(container) = self.containers.get_mut(c) {
                container.frozen = frozen;
                self.refresh(c, now);
            }
        }
        self.windows_taken(now);
        decision.next_due
    }

    /// Ends the burst waits of the containers that hold the windows of all their GPUs now.
    fn windows_taken(&mut self, now: Instant) {
        let windows = self.node.windows();
        for (_, holder) in windows.holders() {
            let Some(&c) = holder.and_then(|id| self.containers_of.get(&id)) else {
                continue;
            };
            let container = &mut self.containers[c];
            let Some((since, begun_frozen)) = container.burst_since else {
                continue;
            };
            let holds_all = container
                .gpus
                .iter()
                .all(|&g| windows.gpu(GpuIndex(g as u32)).and_then(|v| v.holder) == holder);
            if holds_all {
                container.burst_waits.record(now - since);
                if !begun_frozen {
                    container.running_burst_waits.record(now - since);
                }
                container.burst_since = None;
            }
        }
    }

    fn report(&self) -> Report {
        let secs = |nanos: f64| micros(nanos / 1e9);
        let dur = |d: Duration| micros(d.as_secs_f64());
        let containers = self
            .scenario
            .containers
            .iter()
            .zip(&self.containers)
            .map(|(spec, c)| {
                let stats = c.stats.as_ref();
                let had_demand = c.demand > 0.0;
                let ran = |value: f64| stats.map(|_| value);
                let span = c.demand * c.gpus.len() as f64;
                ContainerReport {
                    name: spec.name.clone(),
                    gpus: c.gpus.iter().map(|&g| g as u32).collect(),
                    weight: spec.request.weight,
                    priority: spec.request.priority.name(),
                    gpu_seconds: ran(secs(c.gpu_time)),
                    demand_seconds: ran(secs(c.demand)),
                    share: stats.and(had_demand.then(|| {
                        if c.busy_while_demand > 0.0 {
                            micros(c.gpu_time / c.busy_while_demand)
                        } else {
                            0.0
                        }
                    })),
                    wait_seconds: stats.map(|s| dur(s.wait_time)),
                    wait_p50: stats.map(|s| dur(s.waits.quantile(0.50))),
                    wait_p95: stats.map(|s| dur(s.waits.quantile(0.95))),
                    wait_p99: stats.map(|s| dur(s.waits.quantile(0.99))),
                    max_wait: stats.map(|s| dur(s.waits.max())),
                    windows: stats.map(|s| s.windows),
                    bursts: stats.map(|_| c.burst_waits.count()),
                    burst_wait_p50: stats.map(|_| dur(c.burst_waits.quantile(0.50))),
                    burst_wait_p99: stats.map(|_| dur(c.burst_waits.quantile(0.99))),
                    bursts_begun_frozen: stats
                        .map(|_| c.burst_waits.count() - c.running_burst_waits.count()),
                    running_burst_wait_p99: stats
                        .map(|_| dur(c.running_burst_waits.quantile(0.99))),
                    bursts_unwindowed: stats.map(|_| c.bursts_unwindowed),
                    rejected: c.rejected.clone(),
                    fair_share: stats.and(had_demand.then(|| micros(c.fair / span))),
                }
            })
            .collect();
        let duration = self.scenario.duration.as_nanos() as f64;
        let gpus = self
            .scenario
            .gpus
            .iter()
            .zip(&self.gpus)
            .enumerate()
            .map(|(g, (spec, live))| GpuReport {
                index: g as u32,
                model: spec.model.clone(),
                busy_fraction: micros(live.busy / duration),
                busy_while_wanted: if live.wanted > 0.0 {
                    micros(live.busy / live.wanted)
                } else {
                    1.0
                },
                switches: self
                    .node
                    .windows()
                    .gpu(GpuIndex(g as u32))
                    .map_or(0, |view| view.stats.switches),
            })
            .collect();
        Report {
            duration: dur(self.scenario.duration),
            seed: self.scenario.seed,
            containers,
            gpus,
        }
    }
}

#[cfg(test)]
#[path = "run_tests.rs"]
mod tests;
