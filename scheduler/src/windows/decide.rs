//! The steps of [`WindowScheduler::decide`] and of the calls that feed it: the accounting clock,
//! work starting and ending, windows ending, granted and lent, and the orders that follow. The
//! rules they carry out are the module doc's ([`super`]).

use super::state::{end_wait, VgpuState, VirtualTime};
use super::{Action, WindowScheduler};
use crate::request::Priority;
use crate::{Instant, VgpuId};
use std::time::Duration;

impl WindowScheduler {
    /// Moves the accounting clock to `now` (never backwards) and returns it: GPU time goes to
    /// the running vGPUs with work, split evenly among those sharing a GPU.
    pub(super) fn advance(&mut self, now: Instant) -> Instant {
        if now <= self.clock {
            return self.clock;
        }
        let start = self.clock;
        let grace = self.idle_grace;
        for (p, gpu) in self.gpus.iter_mut().enumerate() {
            let running = gpu
                .with_work
                .iter()
                .filter(|v| !self.vgpus[v].frozen)
                .count() as u32;
            if running == 0 {
                continue;
            }
            let mut busy_until = start;
            for v in &gpu.with_work {
                let state = self.vgpus.get_mut(v).expect("with_work holds bound vGPUs");
                if state.frozen {
                    continue;
                }
                // Work lapses `idle_grace` after the last sample that showed it.
                let end = now.min(state.last_work + grace);
                let span = end.saturating_since(start) / running;
                busy_until = busy_until.max(end);
                state.stats.gpu_time += span;
                if let Some(i) = state.positions.iter().position(|&q| q == p) {
                    state.virtual_times[i].accrue(span, state.binding.weight);
                }
            }
            gpu.stats.busy_time += busy_until.saturating_since(start);
        }
        self.clock = now;
        now
    }

    /// Σ weight and Σ weight × virtual time of the vGPUs with work of `class` (not `high`) on
    /// the GPU at position `p`, but `except`: the weighted mean is the GPU's *average virtual
    /// time*, against which lags are measured.
    pub(super) fn class_sums(&self, p: usize, class: usize, except: VgpuId) -> (u128, u128) {
        let mut sums = (0, 0);
        for v in &self.gpus[p].with_work {
            let s = &self.vgpus[v];
            if *v == except || s.binding.priority == Priority::High || s.class() != class {
                continue;
            }
            let weight = u128::from(s.binding.weight);
            sums.0 += weight;
            sums.1 += weight * s.virtual_time(p);
        }
        sums
    }

    /// `vgpu`'s lag on the GPU at position `p` (one of its own), in virtual time: the GPU's
    /// average virtual time, with it counted, minus its own. Positive: it is owed GPU time;
    /// negative: it is ahead. Zero when no other vGPU of its class has work there.
    pub(super) fn lag(&self, vgpu: VgpuId, p: usize) -> i128 {
        let state = &self.vgpus[&vgpu];
        let (others, weighted) = self.class_sums(p, state.class(), vgpu);
        if others == 0 {
            return 0;
        }
        let own = state.virtual_time(p);
        let weight = u128::from(state.binding.weight);
        let mean = (weighted + weight * own) / (others + weight);
        mean as i128 - own as i128
    }

    /// A vGPU starts having work: it gets back the lag it kept when its work last ended
    /// (placed so that, counted in the GPU's average, its lag is that again), is queued, and
    /// arrives *fresh*: it goes first among those waiting, and a window in progress on its GPUs
    /// ends one slice from now at the latest, so that a burst waits about one slice at most.
    pub(super) fn start_work(&mut self, vgpu: VgpuId, now: Instant) {
        let queued = self.next_queue_position();
        let state = &self.vgpus[&vgpu];
        let (class, weight) = (state.class(), u128::from(state.binding.weight));
        let high = state.binding.priority == Priority::High;
        let places: Vec<Option<u128>> = state
            .positions
            .iter()
            .zip(&state.kept_lags)
            .map(|(&p, &lag)| {
                let (others, weighted) = self.class_sums(p, class, vgpu);
                if high || others == 0 {
                    return None;
                }
                let mean = (weighted / others) as i128;
                let place = lag * (others + weight) as i128 / others as i128;
                Some(mean.saturating_sub(place).max(0) as u128)
            })
            .collect();
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.has_work = true;
        state.queued = queued;
        for (virtual_time, place) in state.virtual_times.iter_mut().zip(places) {
            if let Some(place) = place {
                virtual_time.set(place);
            }
        }
        let positions = state.positions.clone();
        for &p in &positions {
            self.gpus[p].with_work.push(vgpu);
        }
        if high {
            return;
        }
        let by = now + self.slice;
        self.vgpus.get_mut(&vgpu).expect("caller checked").fresh = Some(by);
        for p in positions {
            let Some(holder) = self.gpus[p].holder else {
                continue;
            };
            let holding = self.vgpus.get_mut(&holder).expect("holder is bound");
            if holding.class() == class {
                holding.window_end = holding.window_end.map(|end| end.min(by));
            }
        }
    }

    /// Running vGPUs whose last work is `idle_grace` old have none any more.
    pub(super) fn expire_work(&mut self, now: Instant) {
        for p in 0..self.gpus.len() {
            let mut i = 0;
            while i < self.gpus[p].with_work.len() {
                let v = self.gpus[p].with_work[i];
                let state = &self.vgpus[&v];
                if !state.frozen && now >= state.last_work + self.idle_grace {
                    self.stop_work(v);
                } else {
                    i += 1;
                }
            }
        }
    }

    /// A vGPU stops having work: it keeps its lag on each of its GPUs, bounded to one slice
    /// of virtual time either way, for its next work (time without work neither earns nor
    /// costs), and leaves the GPUs' averages.
    pub(super) fn stop_work(&mut self, vgpu: VgpuId) {
        let bound = VirtualTime::of(self.slice) as i128;
        let positions = self.vgpus[&vgpu].positions.clone();
        let lags: Vec<i128> = (positions.iter())
            .map(|&p| self.lag(vgpu, p).clamp(-bound, bound))
            .collect();
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.has_work = false;
        state.fresh = None;
        state.kept_lags = lags;
        for p in positions {
            self.gpus[p].with_work.retain(|&v| v != vgpu);
        }
    }

    /// Ends the windows whose time is up, whose holder has no work, or that are preempted.
    pub(super) fn end_windows(&mut self, now: Instant) {
        for p in 0..self.gpus.len() {
            let Some(holder) = self.gpus[p].holder else {
                continue;
            };
            let state = &self.vgpus[&holder];
            let preempted = state.positions.iter().any(|&q| {
                let gpu = &self.gpus[q];
                gpu.high_busy || state.binding.priority == Priority::Low && gpu.normal_busy
            });
            let over = state.window_end.is_none_or(|end| now >= end);
            if state.has_work && !over && !preempted {
                continue;
            }
            self.end_window(holder, now);
        }
    }

    /// Ends `holder`'s window. Its lag on each of its GPUs is bounded below by one slice of
    /// virtual time: time it ran beyond that was time nobody else could use (the others were
    /// waiting for their other GPUs, or for a `high` vGPU), and is not paid back by waiting.
    pub(super) fn end_window(&mut self, holder: VgpuId, now: Instant) {
        let queued = self.next_queue_position();
        let lead = VirtualTime::of(self.slice);
        let state = &self.vgpus[&holder];
        let weight = u128::from(state.binding.weight);
        let caps: Vec<Option<u128>> = (state.positions.iter())
            .map(|&p| {
                let (others, weighted) = self.class_sums(p, state.class(), holder);
                // Its lag, counted in the average, is -lead at virtual time
                // mean of the others + lead × (others + weight) / others.
                (state.has_work && others > 0)
                    .then(|| weighted / others + lead * (others + weight) / others)
            })
            .collect();
        let state = self.vgpus.get_mut(&holder).expect("holder is bound");
        state.window_end = None;
        state.window_ended_at = Some(now);
        state.queued = queued;
        for ((&q, virtual_time), cap) in state
            .positions
            .iter()
            .zip(&mut state.virtual_times)
            .zip(caps)
        {
            let gpu = &mut self.gpus[q];
            gpu.holder = None;
            gpu.lent = false;
            if let Some(cap) = cap {
                virtual_time.cap_at(cap);
            }
        }
    }

    /// A multi-GPU vGPU that could start but for lent windows on its reserved GPUs takes them
    /// back now.
    pub(super) fn reclaim_lent_windows(&mut self, now: Instant) {
        for p in 0..self.gpus.len() {
            let gpu = &self.gpus[p];
            let (Some(m), Some(borrower)) = (gpu.reserved_for, gpu.holder) else {
                continue;
            };
            if !gpu.lent {
                continue;
            }
            let startable = self.vgpus[&m].positions.iter().all(|&q| {
                let gpu = &self.gpus[q];
                !gpu.high_busy
                    && gpu.reserved_for.is_none_or(|r| r == m)
                    && (gpu.holder.is_none() || gpu.lent)
            });
            if startable {
                self.end_window(borrower, now);
            }
        }
    }

    /// A reservation lapses when its vGPU has no work or cannot run (a `high` vGPU has work on one
    /// of its GPUs, or it is `low` and a `normal` one has work there).
    pub(super) fn drop_stale_reservations(&mut self) {
        for p in 0..self.gpus.len() {
            let Some(m) = self.gpus[p].reserved_for else {
                continue;
            };
            let state = &self.vgpus[&m];
            if !state.has_work || !self.eligible(state) {
                for &q in &state.positions {
                    if self.gpus[q].reserved_for == Some(m) {
                        self.gpus[q].reserved_for = None;
                    }
                }
            }
        }
    }

    /// Whether a `normal` or `low` vGPU may run now as far as priorities go.
    pub(super) fn eligible(&self, state: &VgpuState) -> bool {
        state.positions.iter().all(|&p| {
            let gpu = &self.gpus[p];
            !gpu.high_busy && (state.binding.priority != Priority::Low || !gpu.normal_busy)
        })
    }

    pub(super) fn free(&self, p: usize, for_vgpu: VgpuId) -> bool {
        let gpu = &self.gpus[p];
        gpu.holder.is_none() && !gpu.high_busy && gpu.reserved_for.is_none_or(|r| r == for_vgpu)
    }

    /// Starts windows on the GPUs that have none.
    pub(super) fn grant_windows(&mut self, now: Instant) {
        for p in 0..self.gpus.len() {
            let gpu = &self.gpus[p];
            if gpu.holder.is_some() || gpu.high_busy {
                continue;
            }
            let mut reserved_for = gpu.reserved_for;
            if let Some(m) = reserved_for {
                if self.vgpus[&m].positions.iter().all(|&q| self.free(q, m)) {
                    self.grant(m, now, false);
                    continue;
                }
            }
            let class = if gpu.normal_busy { 0 } else { 1 };
            let mut candidates = std::mem::take(&mut self.candidates);
            candidates.clear();
            candidates.extend(
                gpu.with_work
                    .iter()
                    .map(|v| (v, &self.vgpus[v]))
                    .filter(|(_, s)| {
                        s.binding.priority != Priority::High
                            && s.class() == class
                            && s.window_end.is_none()
                            && self.eligible(s)
                    })
                    .map(|(&v, s)| {
                        let (later, rank, queued) = rank(s, p);
                        (later, rank, queued, v)
                    }),
            );
            candidates.sort_unstable();
            for &(_, _, _, v) in &candidates {
                let positions = &self.vgpus[&v].positions;
                if positions.len() == 1 {
                    // On a GPU kept for a multi-GPU vGPU that still waits for its other GPUs,
                    // the window is lent until that one can start: no GPU idles meanwhile.
                    self.grant(v, now, reserved_for.is_some());
                    break;
                }
                if reserved_for.is_some() {
                    continue;
                }
                // A multi-GPU vGPU reserves all its GPUs when it is next in line on every one of
                // them and no other reservation is in the way; otherwise the next candidate is
                // considered.
                if positions.iter().any(|&q| {
                    self.gpus[q].reserved_for.is_some_and(|r| r != v) || !self.next_in_line(v, q)
                }) {
                    continue;
                }
                let positions = positions.clone();
                for &q in &positions {
                    self.gpus[q].reserved_for = Some(v);
                }
                if positions.iter().all(|&q| self.free(q, v)) {
                    self.grant(v, now, false);
                    break;
                }
                // It waits for its other GPUs: this one is lent meanwhile, to the next
                // single-GPU vGPU in line.
                reserved_for = Some(v);
            }
            self.candidates = candidates;
        }
    }

    /// Whether `vgpu` ranks first among the vGPUs waiting for a window on GPU `p`.
    pub(super) fn next_in_line(&self, vgpu: VgpuId, p: usize) -> bool {
        let own = &self.vgpus[&vgpu];
        let key = rank(own, p);
        self.gpus[p].with_work.iter().all(|v| {
            let s = &self.vgpus[v];
            *v == vgpu
                || s.binding.priority == Priority::High
                || s.class() != own.class()
                || s.window_end.is_some()
                || !self.eligible(s)
                || rank(s, p) > key
        })
    }

    /// Grants `vgpu` the window on its GPUs. A window lasts `slice × weight`; while fresh vGPUs
    /// wait on its GPUs, one slice at most, and it ends by the first one's deadline (lasting
    /// `max(slice / 4, idle_grace)` at least). A fresh vGPU's first one is shorter by what it is
    /// ahead (its lag below zero), down to that same shortest length.
    pub(super) fn grant(&mut self, vgpu: VgpuId, now: Instant, lent: bool) {
        let shortest = (self.slice / 4).max(self.idle_grace);
        let state = &self.vgpus[&vgpu];
        let full = self.slice.saturating_mul(state.binding.weight);
        let mut length = full;
        if state.fresh.is_some() {
            let ahead = (state.positions.iter())
                .map(|&p| self.lag(vgpu, p))
                .min()
                .unwrap_or(0)
                .min(0);
            let ahead = VirtualTime::gpu_nanos(-ahead, state.binding.weight);
            let ahead = Duration::from_nanos(u64::try_from(ahead).unwrap_or(u64::MAX));
            length = full.saturating_sub(ahead).max(shortest.min(full));
        }
        // While fresh vGPUs wait on its GPUs, the window ends by the first one's deadline
        // (but lasts `shortest` at least, so that a window is never too short to be worth the
        // switch), and one slice at most.
        let class = state.class();
        let first_deadline = (state.positions.iter())
            .flat_map(|&p| self.gpus[p].with_work.iter())
            .filter(|&&v| v != vgpu && self.vgpus[&v].class() == class)
            .filter_map(|v| self.vgpus[v].fresh)
            .min();
        if let Some(by) = first_deadline {
            let until = by.saturating_since(now).max(shortest);
            length = length.min(self.slice).min(until);
        }
        let end = now + length;
        let state = self.vgpus.get_mut(&vgpu).expect("granted vGPU is bound");
        state.fresh = None;
        state.window_end = Some(end);
        if state.window_ended_at != Some(now) {
            state.stats.windows += 1;
        }
        for &p in &state.positions {
            let gpu = &mut self.gpus[p];
            gpu.holder = Some(vgpu);
            gpu.lent = lent;
            if gpu.reserved_for == Some(vgpu) {
                gpu.reserved_for = None;
            }
            if gpu.last_holder.is_some_and(|h| h != vgpu) {
                gpu.stats.switches += 1;
            }
            gpu.last_holder = Some(vgpu);
        }
    }

    /// Freezes the vGPUs with work that may not run and thaws those that may.
    pub(super) fn enforce(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        for gpu in &self.gpus {
            for &v in &gpu.with_work {
                let state = self.vgpus.get_mut(&v).expect("with_work holds bound vGPUs");
                let may_run =
                    state.binding.priority == Priority::High || state.window_end.is_some();
                if may_run && state.frozen {
                    state.frozen = false;
                    end_wait(state, now);
                    // It could not show work while frozen: its grace starts now.
                    state.last_work = now;
                    state.thawed_at = Some(now);
                    actions.push(Action::Thaw(v));
                } else if !may_run && !state.frozen {
                    state.frozen = true;
                    state.waiting_since = Some(now);
                    actions.push(Action::Freeze(v));
                }
            }
        }
        actions
    }

    /// The earliest instant at which a decision could change for someone who waits: the end of
    /// a window, or the lapse of the work of a window holder or of a `high` vGPU, on a GPU where
    /// a vGPU is frozen.
    pub(super) fn next_due(&self) -> Option<Instant> {
        let mut due: Option<Instant> = None;
        let mut consider = |t: Instant| due = Some(due.map_or(t, |d: Instant| d.min(t)));
        for gpu in &self.gpus {
            if !gpu.with_work.iter().any(|v| self.vgpus[v].frozen) {
                continue;
            }
            for v in &gpu.with_work {
                let state = &self.vgpus[v];
                if state.frozen {
                    continue;
                }
                consider(state.last_work + self.idle_grace);
                if let Some(end) = state.window_end {
                    consider(end);
                }
            }
        }
        due
    }
}

/// Where a waiting vGPU stands in line on the GPU at position `p` (smaller first): the fresh
/// ones first, by the instant they must hold the window; then the others by virtual time; ties
/// to the one queued first.
fn rank(state: &VgpuState, p: usize) -> (bool, u128, u64) {
    match state.fresh {
        Some(by) => (
            false,
            by.saturating_since(Instant::ZERO).as_nanos(),
            state.queued,
        ),
        None => (true, state.virtual_time(p), state.queued),
    }
}
