//! The execution-window scheduler: on each GPU, who runs and who waits.
//!
//! The rules are DESIGN.md's; how they are met:
//!
//! - **Work.** A vGPU has work from a sample that showed work until `idle_grace` passes without
//!   one. A frozen vGPU cannot show work, so its samples are ignored: it keeps its work (it is
//!   waiting) until it runs again. When it is thawed, its grace starts over, except that a first
//!   sample after the thaw showing no work (taken at least `idle_grace / 4` after it) ends its
//!   work at once: whatever it waited for is gone, and the window should not idle for a grace.
//!   So does a window holder's sample showing no work while another vGPU with work is bound
//!   to one of its GPUs: the window passes on at once instead of idling for a grace.
//! - **Windows.** On each GPU, among the `normal` vGPUs with work (or the `low` ones when no
//!   `normal` one has work) at most one holds the window and runs; the others are frozen. A window
//!   lasts `slice × weight`, and ends early when its holder has no work, is unbound, or is
//!   preempted (a `high` vGPU gets work on one of its GPUs; for a `low` holder, a `normal` vGPU
//!   gets work). A vGPU with work alone on all of its GPUs is always granted at once.
//! - **Who is next.** Lag decides, in the spirit of EEVDF. A vGPU's *virtual time* on a GPU is
//!   the GPU time it received there divided by its weight; the GPU's *average virtual time* is
//!   the weighted mean of those of the vGPUs with work in its class there; a vGPU's *lag* is the
//!   average minus its own: positive, it is owed GPU time; negative, it is ahead of its weighted
//!   share. Waiting with work earns lag, holding a window spends it, and time without work
//!   does neither: when its work ends, a vGPU keeps its lag, bounded to one slice of virtual
//!   time either way (`slice × weight` of GPU time), and gets it back with its next work. So a
//!   burst that ran ahead is charged at the next one, and a long idle spell earns nothing.
//!   Each GPU is ranked on its own, so a multi-GPU vGPU is compared on each GPU with the vGPUs
//!   there. Among those waiting, the least virtual time goes next, ties to the one queued
//!   first. When a window ends, its holder's lag is bounded below by one slice of virtual time:
//!   a vGPU that kept a GPU busy while the others could not run (waiting for their other GPUs)
//!   does not pay that back later.
//! - **Work that begins.** A vGPU whose work begins (a sample shows work after none) arrives
//!   *fresh*: it goes first among those waiting, in order of arrival, and must hold a window
//!   one slice after it was seen (its *deadline*). A window in progress on its GPUs ends by
//!   then; a window granted while fresh vGPUs wait ends by the first one's deadline, and lasts
//!   one slice at most and the *shortest window*, `max(slice / 4, idle_grace)`, at least. So it
//!   holds a window within one slice of being seen, plus a shortest window per fresh vGPU
//!   ahead of it whose deadline had come. Its first window is shorter by what it is ahead (its
//!   lag below zero), down to the shortest window, so that going first costs the others no
//!   more than its weighted share; the rest of its work queues by lag.
//! - **Several GPUs.** A multi-GPU vGPU runs only holding all its GPUs. When it is next in line on
//!   every one of them, it reserves them, so it waits at most for the longest window in progress
//!   on its GPUs. Meanwhile a reserved GPU whose window ends is *lent* to the next single-GPU
//!   vGPU in line there, and taken back the moment the multi-GPU vGPU can start: no GPU idles
//!   while someone with work waits for it. (Next in line
//!   on just one of them would not do: alone on one GPU it would always be next there and jump
//!   the queue on the others.)
//! - **Priorities.** `high` vGPUs are never frozen and hold no window; while one has work, every
//!   other vGPU with work on its GPUs is frozen.
//! - **Held.** A vGPU whose user paused its container (`hold`) takes no part: it counts as having
//!   no work (its samples are ignored), holds no window and delays nobody (a window it held ends
//!   at once, as when work ends; a reservation for it is dropped), and no order names it until it
//!   is released (`unhold`). Its container is then running (its user resumed it): it rejoins
//!   thawed and without work, and its next sample showing work queues it like any arrival.
//! - **Stopping.** A vGPU whose container has a stop signal pending ([`WindowScheduler::stop`])
//!   is thawed (the one order that names it) and takes no part, as a held one: for
//!   `stop_grace` after a SIGTERM, SIGINT or SIGQUIT, once in its life, so that its graceful
//!   shutdown runs; until it is unbound after a SIGKILL. Once only: signals that a container
//!   has sent to itself (from a sibling container, say) cannot keep it out of windows.
//!
//! Every public method takes `now`; the caller passes a non-decreasing clock (an earlier `now`
//! is read as the latest one seen). Nothing here panics on any sequence of calls.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use state::{end_wait, BuildVgpuHasher, GpuState, Stopping, VgpuState, VirtualTime};

use crate::accounting::{GpuStats, VgpuStats};
use crate::config::SchedulerConfig;
use crate::request::Priority;
use crate::{GpuIndex, Instant, VgpuId};

/// What the scheduler needs to know of a vGPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// Its assigned GPUs (at least one, no duplicates).
    pub gpus: Vec<GpuIndex>,
    /// Share weight, 1..=100.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
}

/// An order to the enforcer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Freeze this vGPU's container.
    Freeze(VgpuId),
    /// Thaw it.
    Thaw(VgpuId),
}

/// The result of [`WindowScheduler::decide`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Freeze and thaw orders, to carry out now.
    pub actions: Vec<Action>,
    /// When to call `decide` again at the latest, even with no new observation; `None`: only when
    /// something changes (an observation, a bind or an unbind).
    pub next_due: Option<Instant>,
}

/// What [`WindowScheduler::unbind`] leaves.
#[derive(Clone, Debug, PartialEq)]
pub struct Unbound {
    /// `Some(Action::Thaw)` when it was frozen and still needs thawing.
    pub thaw: Option<Action>,
    /// What it received and waited, its last wait (if it was waiting) included.
    pub stats: VgpuStats,
}

/// Why a vGPU could not be bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// The id is bound already.
    #[error("{0} is already bound")]
    AlreadyBound(VgpuId),
    /// A GPU the scheduler does not know.
    #[error("GPU {0} is not one of this node's GPUs")]
    UnknownGpu(GpuIndex),
    /// No GPU, or one listed twice.
    #[error("a vGPU needs one or more distinct GPUs, got {0:?}")]
    BadGpuList(Vec<GpuIndex>),
    /// Weight out of range.
    #[error("weight {0} is outside 1..=100")]
    BadWeight(u32),
}

/// A stop signal pending in a vGPU's container ([`WindowScheduler::stop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGTERM, SIGINT or SIGQUIT: a graceful shutdown, which may take `stop_grace`.
    Graceful,
    /// SIGKILL: the container dies as soon as it runs.
    Kill,
}

/// Whether a vGPU's container is running or frozen, as far as the scheduler is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    /// Not frozen.
    Running,
    /// Frozen, waiting for a window.
    Frozen,
    /// Held: its user paused it. The scheduler neither freezes nor thaws it, and counts it as
    /// having no work, until it is released ([`WindowScheduler::hold`]).
    Held,
    /// Stopping: a stop signal is pending; running, out of windows ([`WindowScheduler::stop`]).
    Stopping,
}

/// A read-only view of one vGPU.
#[derive(Clone, Debug, PartialEq)]
pub struct VgpuView {
    /// Its binding.
    pub binding: Binding,
    /// Running or frozen.
    pub state: RunState,
    /// Whether the scheduler counts it as having GPU work now.
    pub has_work: bool,
    /// The end of the window it holds, if it holds one.
    pub window_end: Option<Instant>,
    /// Since when it has been waiting, if it is frozen.
    pub waiting_since: Option<Instant>,
    /// Its lag, in seconds of GPU time summed over its GPUs: what it is owed (positive) or has
    /// had ahead of its weighted share (negative) against the others with work there; while
    /// it has no work, the lag it kept for its next work.
    pub lag_seconds: f64,
    /// What it received and waited so far.
    pub stats: VgpuStats,
}

/// A read-only view of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuView {
    /// The vGPU holding its window (`normal` or `low`), if any.
    pub holder: Option<VgpuId>,
    /// The multi-GPU vGPU it is kept for, if any.
    pub reserved_for: Option<VgpuId>,
    /// Bound vGPUs.
    pub bound: Vec<VgpuId>,
    /// What it did so far.
    pub stats: GpuStats,
}

/// The per-node execution-window scheduler.
#[derive(Clone, Debug)]
pub struct WindowScheduler {
    slice: Duration,
    idle_grace: Duration,
    stop_grace: Duration,
    /// When the graceful stops in force end, earliest first.
    stops_ending: BTreeSet<(Instant, VgpuId)>,
    /// Sorted by index.
    gpus: Vec<GpuState>,
    vgpus: HashMap<VgpuId, VgpuState, BuildVgpuHasher>,
    /// The instant accounting has reached.
    clock: Instant,
    /// Source of queue positions (ties in virtual time go to the smaller).
    queue_seq: u64,
    /// Scratch space for candidate ranking, kept to avoid allocating per decision.
    candidates: Vec<(bool, u128, u64, VgpuId)>,
}

impl WindowScheduler {
    /// A scheduler for these GPUs with `config`'s `slice` and `idle_grace`.
    pub fn new(gpus: impl IntoIterator<Item = GpuIndex>, config: &SchedulerConfig) -> Self {
        let mut indexes: Vec<GpuIndex> = gpus.into_iter().collect();
        indexes.sort();
        indexes.dedup();
        WindowScheduler {
            slice: config.slice,
            idle_grace: config.idle_grace,
            stop_grace: config.stop_grace,
            stops_ending: BTreeSet::new(),
            gpus: indexes
                .into_iter()
                .map(|index| GpuState {
                    index,
                    bound: Vec::new(),
                    with_work: Vec::new(),
                    holder: None,
                    last_holder: None,
                    reserved_for: None,
                    lent: false,
                    high_busy: false,
                    normal_busy: false,
                    stats: GpuStats::default(),
                })
                .collect(),
            vgpus: HashMap::default(),
            clock: Instant::ZERO,
            queue_seq: 0,
            candidates: Vec::new(),
        }
    }

    /// Binds a vGPU. It starts running, with no work.
    pub fn bind(&mut self, vgpu: VgpuId, binding: Binding, now: Instant) -> Result<(), BindError> {
        let now = self.advance(now);
        if self.vgpus.contains_key(&vgpu) {
            return Err(BindError::AlreadyBound(vgpu));
        }
        if !(1..=100).contains(&binding.weight) {
            return Err(BindError::BadWeight(binding.weight));
        }
        let mut sorted = binding.gpus.clone();
        sorted.sort();
        sorted.dedup();
        if sorted.is_empty() || sorted.len() != binding.gpus.len() {
            return Err(BindError::BadGpuList(binding.gpus));
        }
        let positions = sorted
            .iter()
            .map(|&g| self.position(g).ok_or(BindError::UnknownGpu(g)))
            .collect::<Result<Vec<_>, _>>()?;
        for &p in &positions {
            self.gpus[p].bound.push(vgpu);
        }
        self.vgpus.insert(
            vgpu,
            VgpuState {
                binding,
                positions,
                frozen: false,
                held: false,
                stopping: None,
                stopped_once: false,
                has_work: false,
                fresh: None,
                last_work: now,
                window_end: None,
                window_ended_at: None,
                queued: 0,
                thawed_at: None,
                waiting_since: None,
                virtual_times: vec![VirtualTime::default(); sorted.len()],
                kept_lags: vec![0; sorted.len()],
                stats: VgpuStats::default(),
            },
        );
        Ok(())
    }

    /// Unbinds a vGPU (`None`: it was not bound). Its window, if it held one, ends; the next
    /// `decide` passes it on.
    pub fn unbind(&mut self, vgpu: VgpuId, now: Instant) -> Option<Unbound> {
        let now = self.advance(now);
        let mut state = self.vgpus.remove(&vgpu)?;
        if let Some(Stopping::Until(at)) = state.stopping {
            self.stops_ending.remove(&(at, vgpu));
        }
        for &p in &state.positions {
            let gpu = &mut self.gpus[p];
            gpu.bound.retain(|&v| v != vgpu);
            gpu.with_work.retain(|&v| v != vgpu);
            if gpu.holder == Some(vgpu) {
                gpu.holder = None;
                gpu.lent = false;
            }
            if gpu.reserved_for == Some(vgpu) {
                gpu.reserved_for = None;
            }
        }
        let thaw = state.frozen.then_some(Action::Thaw(vgpu));
        end_wait(&mut state, now);
        Some(Unbound {
            thaw,
            stats: state.stats,
        })
    }

    /// Records an activity sample: whether `vgpu` showed GPU work since its previous sample.
    /// Samples of a frozen vGPU are ignored (it cannot work while frozen; it still waits).
    /// Returns false for an unknown vGPU.
    pub fn observe(&mut self, vgpu: VgpuId, has_work: bool, now: Instant) -> bool {
        let now = self.advance(now);
        let Some(state) = self.vgpus.get_mut(&vgpu) else {
            return false;
        };
        if state.frozen || state.held || state.stopping.is_some() {
            return true;
        }
        let thawed_at = state.thawed_at.take();
        if !has_work {
            // The first sample after a thaw that shows no work (taken long enough after it to
            // tell) says the vGPU stopped waiting while frozen: its work ends now, not a whole
            // grace later, and its window passes on. So does a window holder's while another
            // vGPU with work waits on one of its GPUs: a window left idle for a grace is GPU
            // time nobody gets.
            let grace = self.idle_grace;
            let holds = state.window_end.is_some() && thawed_at.is_none();
            match thawed_at {
                Some(at) if now.saturating_since(at) >= grace / 4 => state.last_work = now - grace,
                Some(at) => state.thawed_at = Some(at),
                None => {}
            }
            if holds && self.others_wait(vgpu) {
                let state = self.vgpus.get_mut(&vgpu).expect("checked above");
                state.last_work = state.last_work.min(now - grace);
            }
            return true;
        }
        state.last_work = now;
        if !state.has_work {
            self.start_work(vgpu, now);
        }
        true
    }

    /// Records a sample that cannot tell yet: the activity source has not had time to see
    /// `vgpu` since the scheduler thawed it (NVML names a process only in its next driver
    /// sample, up to two sampling periods later). The work it had when thawed, which is why it
    /// was thawed, is kept as if the sample had shown it, so that its window does not lapse
    /// `idle_grace` into it for want of a sample that could not come yet. Nothing changes for a
    /// vGPU the scheduler did not thaw, one with no work or one whose first sample since has
    /// come. The caller bounds how long it says so (NVML: the source's lag). Returns false for
    /// an unknown vGPU.
    pub fn observe_unseen(&mut self, vgpu: VgpuId, now: Instant) -> bool {
        let now = self.advance(now);
        let Some(state) = self.vgpus.get_mut(&vgpu) else {
            return false;
        };
        let keeps = !state.frozen && !state.held && state.stopping.is_none();
        if keeps && state.has_work && state.thawed_at.is_some() {
            state.last_work = now;
        }
        true
    }

    /// Holds a vGPU (`held`: its user paused its container) or releases its hold (its user
    /// resumed it). Returns false for an unknown vGPU; holding a held one, or releasing one that
    /// is not held, changes nothing.
    ///
    /// Held, it takes no part in scheduling: its work ends (its samples are ignored), a window
    /// it holds ends and a reservation for it is dropped, so the next `decide` passes them on;
    /// it stops waiting if it was; no order names it, and [`WindowScheduler::frozen`] and
    /// `unbind` leave it to its user. Released, it rejoins as a running vGPU without work, as
    /// its user's resume left it: its next sample showing work queues it (with the lag it kept,
    /// so the pause banks nothing), and the next decision freezes it unless it
    /// gets the window.
    pub fn hold(&mut self, vgpu: VgpuId, held: bool, now: Instant) -> bool {
        let now = self.advance(now);
        let Some(state) = self.vgpus.get_mut(&vgpu) else {
            return false;
        };
        if state.held == held {
            return true;
        }
        state.held = held;
        if state.stopping.is_some() {
            // Out of windows already, and until its stop ends: only the flag changes.
            state.frozen = false;
            return true;
        }
        if held {
            self.leave(vgpu, now);
        } else {
            self.rejoin(vgpu, now);
        }
        true
    }

    /// Says that `vgpu`'s container has a stop signal pending: it is thawed (the order returned,
    /// when it was frozen) and takes no part in scheduling, as a held vGPU: after a
    /// [`StopSignal::Graceful`] for `stop_grace`, once in its life (a later one changes
    /// nothing), after a [`StopSignal::Kill`] until it is unbound. A held vGPU is marked only:
    /// its user's pause stays. `None` for an unknown vGPU, or when nothing is to be thawed.
    pub fn stop(&mut self, vgpu: VgpuId, signal: StopSignal, now: Instant) -> Option<Action> {
        let now = self.advance(now);
        let grace = self.stop_grace;
        let state = self.vgpus.get_mut(&vgpu)?;
        let stopping = match (signal, state.stopping, state.stopped_once) {
            (_, Some(Stopping::UntilUnbound), _) => return None,
            (StopSignal::Kill, _, _) => Stopping::UntilUnbound,
            (StopSignal::Graceful, None, false) => Stopping::Until(now + grace),
            (StopSignal::Graceful, _, _) => return None,
        };
        let out_already = state.held || state.stopping.is_some();
        if let Some(Stopping::Until(at)) = state.stopping {
            self.stops_ending.remove(&(at, vgpu));
        }
        if let Stopping::Until(at) = stopping {
            self.stops_ending.insert((at, vgpu));
        }
        state.stopping = Some(stopping);
        state.stopped_once = true;
        if out_already {
            return None;
        }
        let thaw = state.frozen.then_some(Action::Thaw(vgpu));
        self.leave(vgpu, now);
        thaw
    }

    /// Takes a vGPU out of scheduling (held, stopping): unfrozen as far as the scheduler knows,
    /// without work, holding no window and no reservation, and no longer waiting.
    fn leave(&mut self, vgpu: VgpuId, now: Instant) {
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.frozen = false;
        state.thawed_at = None;
        end_wait(state, now);
        let holds_window = state.window_end.is_some();
        if state.has_work {
            self.stop_work(vgpu);
        }
        if holds_window {
            self.end_window(vgpu, now);
        }
        let positions = self.vgpus[&vgpu].positions.clone();
        for p in positions {
            if self.gpus[p].reserved_for == Some(vgpu) {
                self.gpus[p].reserved_for = None;
            }
        }
    }

    /// Brings a vGPU back into scheduling, running and without work (its user resumed it, its
    /// graceful stop ended): its next sample showing work queues it like any arrival.
    fn rejoin(&mut self, vgpu: VgpuId, now: Instant) {
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.frozen = false;
        state.thawed_at = None;
        state.has_work = false;
        state.last_work = now;
    }

    /// Ends the graceful stops whose `stop_grace` has passed.
    fn end_stops(&mut self, now: Instant) {
        while let Some(&(at, vgpu)) = self.stops_ending.first() {
            if now < at {
                break;
            }
            self.stops_ending.pop_first();
            let Some(state) = self.vgpus.get_mut(&vgpu) else {
                continue;
            };
            state.stopping = None;
            if !state.held {
                self.rejoin(vgpu, now);
            }
        }
    }

    /// Whether a vGPU is held ([`WindowScheduler::hold`]); false for an unknown one.
    pub fn is_held(&self, vgpu: VgpuId) -> bool {
        self.vgpus.get(&vgpu).is_some_and(|s| s.held)
    }

    /// Decides who runs now: the freeze and thaw orders to carry out, and when to decide again.
    pub fn decide(&mut self, now: Instant) -> Decision {
        let now = self.advance(now);
        self.end_stops(now);
        self.expire_work(now);
        for gpu in &mut self.gpus {
            let has = |p| {
                gpu.with_work
                    .iter()
                    .any(|v| self.vgpus[v].binding.priority == p)
            };
            gpu.high_busy = has(Priority::High);
            gpu.normal_busy = has(Priority::Normal);
        }
        self.end_windows(now);
        self.drop_stale_reservations();
        self.reclaim_lent_windows(now);
        self.grant_windows(now);
        let actions = self.enforce(now);
        Decision {
            actions,
            next_due: self.next_due(),
        }
    }

    /// Whether any vGPU bound to `gpu` has work now (assignment prefers GPUs where none has).
    pub fn gpu_has_work(&self, gpu: GpuIndex) -> bool {
        self.position(gpu)
            .is_some_and(|p| !self.gpus[p].with_work.is_empty())
    }

    /// A view of one vGPU.
    pub fn vgpu(&self, vgpu: VgpuId) -> Option<VgpuView> {
        let state = self.vgpus.get(&vgpu)?;
        Some(VgpuView {
            binding: state.binding.clone(),
            state: if state.held {
                RunState::Held
            } else if state.stopping.is_some() {
                RunState::Stopping
            } else if state.frozen {
                RunState::Frozen
            } else {
                RunState::Running
            },
            has_work: state.has_work,
            window_end: state.window_end,
            waiting_since: state.waiting_since,
            lag_seconds: self.lag_seconds(vgpu),
            stats: state.stats.clone(),
        })
    }

    /// A view of one GPU.
    pub fn gpu(&self, gpu: GpuIndex) -> Option<GpuView> {
        let state = &self.gpus[self.position(gpu)?];
        Some(GpuView {
            holder: state.holder,
            reserved_for: state.reserved_for,
            bound: state.bound.clone(),
            stats: state.stats.clone(),
        })
    }

    /// Carries accounting over a restart: a bound vGPU's stats become `stats` (what it had
    /// received before). False when it is not bound.
    pub fn carry_over_vgpu_stats(&mut self, vgpu: VgpuId, stats: VgpuStats) -> bool {
        match self.vgpus.get_mut(&vgpu) {
            Some(state) => {
                state.stats = stats;
                true
            }
            None => false,
        }
    }

    /// Carries accounting over a restart: a GPU's stats become `stats`. False for an unknown GPU.
    pub fn carry_over_gpu_stats(&mut self, gpu: GpuIndex, stats: GpuStats) -> bool {
        match self.position(gpu) {
            Some(p) => {
                self.gpus[p].stats = stats;
                true
            }
            None => false,
        }
    }

    /// The bound vGPUs, in no particular order.
    pub fn vgpus(&self) -> impl Iterator<Item = VgpuId> + '_ {
        self.vgpus.keys().copied()
    }

    /// The vGPUs frozen now (what a shutdown must thaw).
    pub fn frozen(&self) -> impl Iterator<Item = VgpuId> + '_ {
        self.vgpus
            .iter()
            .filter(|(_, s)| s.frozen)
            .map(|(&id, _)| id)
    }

    /// Each GPU's window holder, by index: what [`WindowScheduler::gpu`] tells, without the rest.
    pub fn holders(&self) -> impl Iterator<Item = (GpuIndex, Option<VgpuId>)> + '_ {
        self.gpus.iter().map(|g| (g.index, g.holder))
    }

    /// [`VgpuView::lag_seconds`].
    fn lag_seconds(&self, vgpu: VgpuId) -> f64 {
        let state = &self.vgpus[&vgpu];
        if state.binding.priority == Priority::High {
            return 0.0;
        }
        let lags: Vec<i128> = if state.has_work {
            state.positions.iter().map(|&p| self.lag(vgpu, p)).collect()
        } else {
            state.kept_lags.clone()
        };
        let nanos: i128 = (lags.into_iter())
            .map(|lag| VirtualTime::gpu_nanos(lag, state.binding.weight))
            .sum();
        nanos as f64 / 1e9
    }

    /// Whether another vGPU with work is bound to one of `vgpu`'s GPUs.
    fn others_wait(&self, vgpu: VgpuId) -> bool {
        let Some(state) = self.vgpus.get(&vgpu) else {
            return false;
        };
        (state.positions.iter()).any(|&p| self.gpus[p].with_work.iter().any(|&v| v != vgpu))
    }

    fn position(&self, gpu: GpuIndex) -> Option<usize> {
        self.gpus.binary_search_by_key(&gpu, |g| g.index).ok()
    }

    fn next_queue_position(&mut self) -> u64 {
        self.queue_seq += 1;
        self.queue_seq
    }
}

mod decide;
mod state;
#[cfg(test)]
mod tests;
