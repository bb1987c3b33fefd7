//! The scheduler's inner state: per GPU, per vGPU, and the integer virtual time.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use super::Binding;
use crate::accounting::{GpuStats, VgpuStats};
use crate::request::Priority;
use crate::{GpuIndex, Instant, VgpuId};

/// Virtual time is GPU nanoseconds × `VIRTUAL_SCALE` / weight, in integers, so that ordering is
/// exact and reproducible.
const VIRTUAL_SCALE: u128 = 1 << 20;

#[derive(Clone, Debug)]
pub(super) struct GpuState {
    pub(super) index: GpuIndex,
    pub(super) bound: Vec<VgpuId>,
    /// The bound vGPUs that have work (any priority), frozen ones included.
    pub(super) with_work: Vec<VgpuId>,
    pub(super) holder: Option<VgpuId>,
    pub(super) last_holder: Option<VgpuId>,
    pub(super) reserved_for: Option<VgpuId>,
    /// The holder's window is lent: the GPU is reserved for a multi-GPU vGPU that is still
    /// waiting for its other GPUs, and the window ends as soon as that one can start.
    pub(super) lent: bool,
    /// Set during `decide`: a `high` vGPU here has work.
    pub(super) high_busy: bool,
    /// Set during `decide`: a `normal` vGPU here has work (`low` ones may not run).
    pub(super) normal_busy: bool,
    pub(super) stats: GpuStats,
}

#[derive(Clone, Debug)]
pub(super) struct VgpuState {
    pub(super) binding: Binding,
    /// Positions of its GPUs in `WindowScheduler::gpus`.
    pub(super) positions: Vec<usize>,
    pub(super) frozen: bool,
    /// Its user paused it: it has no work, holds no window and gets no order.
    pub(super) held: bool,
    /// A stop signal is pending in its container: out of windows, as a held one.
    pub(super) stopping: Option<Stopping>,
    /// It has had a graceful stop already (it gets one).
    pub(super) stopped_once: bool,
    pub(super) has_work: bool,
    /// It got work and has had no window since: it goes first among those waiting, and holds the
    /// window by this instant (one slice after its work was seen).
    pub(super) fresh: Option<Instant>,
    pub(super) last_work: Instant,
    pub(super) window_end: Option<Instant>,
    /// When its last window ended (a window granted again at that instant is an extension).
    pub(super) window_ended_at: Option<Instant>,
    pub(super) queued: u64,
    /// When it was last thawed, until its first sample after that.
    pub(super) thawed_at: Option<Instant>,
    pub(super) waiting_since: Option<Instant>,
    /// Its virtual time on each of its GPUs, parallel to `positions`. Each GPU keeps its own
    /// clock: a multi-GPU vGPU is compared on each GPU with the vGPUs there, by the time it
    /// received there.
    pub(super) virtual_times: Vec<VirtualTime>,
    /// While it has no work: its lag on each of its GPUs when its work ended (bounded), which
    /// it gets back with its next work. Parallel to `positions`.
    pub(super) kept_lags: Vec<i128>,
    pub(super) stats: VgpuStats,
}

/// How long a stopping vGPU stays out of windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stopping {
    /// Until this instant (a graceful stop's `stop_grace`).
    Until(Instant),
    /// Until it is unbound (its container was sent SIGKILL).
    UntilUnbound,
}

/// GPU time received on one GPU divided by weight (scaled by `VIRTUAL_SCALE`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct VirtualTime {
    pub(super) time: u128,
    /// What the integer division left over, carried so that time accrued in many small steps
    /// adds up exactly (three 200 ms steps at weight 3 equal one 600 ms).
    pub(super) remainder: u128,
}

impl VirtualTime {
    pub(super) fn accrue(&mut self, span: Duration, weight: u32) {
        let weight = u128::from(weight);
        let scaled = span.as_nanos() * VIRTUAL_SCALE + self.remainder;
        self.time += scaled / weight;
        self.remainder = scaled % weight;
    }

    /// The GPU nanoseconds a difference in virtual time stands for at `weight`.
    pub(super) fn gpu_nanos(span: i128, weight: u32) -> i128 {
        span * i128::from(weight) / VIRTUAL_SCALE as i128
    }

    /// The virtual time a vGPU of weight 1 gains in `span`.
    pub(super) fn of(span: Duration) -> u128 {
        span.as_nanos() * VIRTUAL_SCALE
    }

    pub(super) fn cap_at(&mut self, cap: u128) {
        if self.time > cap {
            self.time = cap;
            self.remainder = 0;
        }
    }

    pub(super) fn set(&mut self, time: u128) {
        self.time = time;
        self.remainder = 0;
    }
}

impl VgpuState {
    /// Its virtual time on the GPU at position `p` (one of its own).
    pub(super) fn virtual_time(&self, p: usize) -> u128 {
        self.positions
            .iter()
            .position(|&q| q == p)
            .map_or(0, |i| self.virtual_times[i].time)
    }

    pub(super) fn class(&self) -> usize {
        match self.binding.priority {
            Priority::Low => 1,
            _ => 0,
        }
    }
}

pub(super) fn end_wait(state: &mut VgpuState, now: Instant) {
    if let Some(since) = state.waiting_since.take() {
        let wait = now.saturating_since(since);
        state.stats.wait_time += wait;
        state.stats.waits.record(wait);
    }
}

/// vGPU ids are small unique integers: a multiplicative hash is enough and keeps lookups cheap on
/// the decision path.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BuildVgpuHasher;

impl BuildHasher for BuildVgpuHasher {
    type Hasher = VgpuHasher;
    fn build_hasher(&self) -> VgpuHasher {
        VgpuHasher(0)
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct VgpuHasher(u64);

impl Hasher for VgpuHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
