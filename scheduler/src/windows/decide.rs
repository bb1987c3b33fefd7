//! The steps of [`WindowScheduler::decide`] and of the calls that feed it: the accounting clock,
//! work starting and ending, windows ending, granted and lent, and the orders that follow. The
//! rules they carry out are the module doc's ([`super`]).

use super::state::{end_wait, VgpuState, VirtualTime};
use super::{Action, WindowScheduler};
use crate::request::Priority;
use crate::{Instant, VgpuId};

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
            // The GPU's virtual clock for the class it serves moves at 1 / (sum of the weights
            // with work): the virtual time a vGPU with work would reach if the GPU were shared
            // continuously by weight.
            let mut weights = [0u32; 2];
            for v in &gpu.with_work {
                let state = &self.vgpus[v];
                if state.binding.priority != Priority::High {
                    weights[state.class()] += state.binding.weight;
                }
            }
            if !gpu.high_busy {
                if let Some(class) = weights.iter().position(|&w| w > 0) {
                    gpu.clock[class].accrue(now.saturating_since(start), weights[class]);
                }
            }
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

    /// A vGPU starts having work: lift it to its GPUs' virtual clocks and queue it.
    pub(super) fn start_work(&mut self, vgpu: VgpuId) {
        let queued = self.next_queue_position();
        let state = &self.vgpus[&vgpu];
        let class = state.class();
        let clocks: Vec<u128> = if state.binding.priority == Priority::High {
            Vec::new()
        } else {
            state
                .positions
                .iter()
                .map(|&p| self.gpus[p].clock[class].time)
                .collect()
        };
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.has_work = true;
        for (virtual_time, clock) in state.virtual_times.iter_mut().zip(clocks) {
            virtual_time.lift_to(clock);
        }
        state.queued = queued;
        for &p in &state.positions {
            self.gpus[p].with_work.push(vgpu);
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

    /// A vGPU stops having work. When it was the last of its class with work on a GPU and got
    /// ahead of the GPU's clock, the clock moves up to it: whoever gets work next starts there.
    pub(super) fn stop_work(&mut self, vgpu: VgpuId) {
        let state = self.vgpus.get_mut(&vgpu).expect("caller checked");
        state.has_work = false;
        let class = state.class();
        let high = state.binding.priority == Priority::High;
        let left: Vec<(usize, u128)> = state
            .positions
            .iter()
            .zip(&state.virtual_times)
            .map(|(&p, t)| (p, t.time))
            .collect();
        for (p, own) in left {
            self.gpus[p].with_work.retain(|&v| v != vgpu);
            let alone = self.gpus[p].with_work.iter().all(|v| {
                let s = &self.vgpus[v];
                s.class() != class || s.binding.priority == Priority::High
            });
            if !high && alone {
                self.gpus[p].clock[class].lift_to(own);
            }
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

    /// Ends `holder`'s window. Its virtual time on each of its GPUs is capped at one slice past
    /// the GPU's clock: time it ran beyond that was time nobody else could use (the others were
    /// waiting for their other GPUs, or for a `high` vGPU), and is not paid back by waiting.
    pub(super) fn end_window(&mut self, holder: VgpuId, now: Instant) {
        let queued = self.next_queue_position();
        let lead = VirtualTime::of(self.slice);
        let state = self.vgpus.get_mut(&holder).expect("holder is bound");
        state.window_end = None;
        state.window_ended_at = Some(now);
        state.queued = queued;
        let class = state.class();
        for (&q, virtual_time) in state.positions.iter().zip(&mut state.virtual_times) {
            let gpu = &mut self.gpus[q];
            gpu.holder = None;
            gpu.lent = false;
            virtual_time.cap_at(gpu.clock[class].time + lead);
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
            let reserved_for = gpu.reserved_for;
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
                    .map(|(&v, s)| (s.virtual_time(p), s.queued, v)),
            );
            candidates.sort_unstable();
            for &(_, _, v) in &candidates {
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
                }
                break;
            }
            self.candidates = candidates;
        }
    }

    /// Whether `vgpu` ranks first among the vGPUs waiting for a window on GPU `p`.
    pub(super) fn next_in_line(&self, vgpu: VgpuId, p: usize) -> bool {
        let own = &self.vgpus[&vgpu];
        let key = (own.virtual_time(p), own.queued);
        self.gpus[p].with_work.iter().all(|v| {
            let s = &self.vgpus[v];
            *v == vgpu
                || s.binding.priority == Priority::High
                || s.class() != own.class()
                || s.window_end.is_some()
                || !self.eligible(s)
                || (s.virtual_time(p), s.queued) > key
        })
    }

    pub(super) fn grant(&mut self, vgpu: VgpuId, now: Instant, lent: bool) {
        let state = self.vgpus.get_mut(&vgpu).expect("granted vGPU is bound");
        let length = self.slice.saturating_mul(state.binding.weight);
        state.window_end = Some(now + length);
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
