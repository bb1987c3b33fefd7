//! The execution-window scheduler (API skeleton; bodies being written).

use std::time::Duration;

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

/// Whether a vGPU's container is running or frozen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    /// Not frozen.
    Running,
    /// Frozen, waiting for a window.
    Frozen,
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
}

impl WindowScheduler {
    /// A scheduler for these GPUs with `config`'s `slice` and `idle_grace`.
    pub fn new(gpus: impl IntoIterator<Item = GpuIndex>, config: &SchedulerConfig) -> Self {
        let _ = gpus;
        WindowScheduler {
            slice: config.slice,
            idle_grace: config.idle_grace,
        }
    }

    /// Binds a vGPU. It starts running, with no work.
    pub fn bind(&mut self, vgpu: VgpuId, binding: Binding, now: Instant) -> Result<(), BindError> {
        let _ = (vgpu, binding, now, self.slice, self.idle_grace);
        todo!()
    }

    /// Unbinds a vGPU; returns `Some(Action::Thaw)` when it was frozen and still needs thawing.
    pub fn unbind(&mut self, vgpu: VgpuId, now: Instant) -> Option<Action> {
        let _ = (vgpu, now);
        todo!()
    }

    /// Records an activity sample: whether `vgpu` showed GPU work since its previous sample.
    /// Samples of a frozen vGPU are ignored (it cannot work while frozen; it still waits).
    /// Returns false for an unknown vGPU.
    pub fn observe(&mut self, vgpu: VgpuId, has_work: bool, now: Instant) -> bool {
        let _ = (vgpu, has_work, now);
        todo!()
    }

    /// Decides who runs now.
    pub fn decide(&mut self, now: Instant) -> Decision {
        let _ = now;
        todo!()
    }

    /// Whether any vGPU bound to `gpu` has work now (assignment prefers GPUs where none has).
    pub fn gpu_has_work(&self, gpu: GpuIndex) -> bool {
        let _ = gpu;
        todo!()
    }

    /// A view of one vGPU.
    pub fn vgpu(&self, vgpu: VgpuId) -> Option<VgpuView> {
        let _ = vgpu;
        todo!()
    }

    /// A view of one GPU.
    pub fn gpu(&self, gpu: GpuIndex) -> Option<GpuView> {
        let _ = gpu;
        todo!()
    }
}
