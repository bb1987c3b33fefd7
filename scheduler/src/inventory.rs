//! The GPUs of a node, the memory bound on each, and GPU assignment (DESIGN.md, "Scheduling
//! rules" → Assignment).
//!
//! The invariant this module keeps, whatever the sequence of [`Inventory::assign`],
//! [`Inventory::release`] and [`Inventory::restore`]: the memory entitlements bound on a GPU never
//! exceed floor(capacity × `memory_overcommit`). Every operation either succeeds whole or leaves
//! the inventory unchanged.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

use crate::quantity::format_bytes;
use crate::request::{GpuMemory, VgpuRequest};
use crate::{GpuIndex, VgpuId};

/// One physical GPU of the node (found by NVML or declared as a `[[fake_gpu]]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gpu {
    /// Host index.
    pub index: GpuIndex,
    /// UUID, as `CUDA_VISIBLE_DEVICES` takes it (`GPU-…`).
    pub uuid: String,
    /// Model name, as NVML reports it (`NVIDIA A100-SXM4-80GB`).
    pub model: String,
    /// Memory capacity in bytes.
    pub memory: u64,
}

/// Which of the GPUs that can hold a request gets it, once idle GPUs are preferred (the
/// `policy` key of `[scheduler]`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AssignmentPolicy {
    /// The GPU with the fewest bound vGPUs: containers take turns with as few others as possible.
    #[default]
    Spread,
    /// The GPU with the most bound vGPUs: keeps whole GPUs free for large requests.
    Pack,
}

/// The GPUs given to one vGPU and the memory it is entitled to on each.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Assignment {
    /// The vGPU.
    pub vgpu: VgpuId,
    /// Its GPUs, ascending, distinct, at least one.
    pub gpus: Vec<GpuIndex>,
    /// The memory it is entitled to on each GPU: a number of bytes, or each GPU's whole
    /// capacity (see [`Inventory::entitlement`]). Kept as asked, so that restoring an assignment
    /// after a restart reserves exactly what assigning it did.
    pub memory: GpuMemory,
}

/// A list of GPUs that cannot make an inventory.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InventoryError {
    /// Two GPUs share an index.
    #[error("two GPUs have index {0}: every GPU needs its own index")]
    DuplicateIndex(GpuIndex),
    /// Two GPUs share a UUID.
    #[error("GPUs {first} and {second} have the same UUID `{uuid}`: every GPU needs its own UUID")]
    DuplicateUuid {
        /// The shared UUID.
        uuid: String,
        /// The lower index.
        first: GpuIndex,
        /// The higher index.
        second: GpuIndex,
    },
    /// A GPU with no memory.
    #[error("GPU {0} has 0 bytes of memory: a GPU's memory must be more than 0")]
    ZeroMemory(GpuIndex),
    /// An overcommit factor that is not a finite number above 0.
    #[error(
        "memory_overcommit = {0} is not accepted: a finite number above 0 (1.0 = no overcommit)"
    )]
    BadOvercommit(f64),
}

/// Why an assignment or a restore was refused. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    /// The vGPU already has GPUs (assigning it again is the caller's business).
    #[error("{vgpu} already holds GPU {}: release it before assigning it again", list(.gpus))]
    AlreadyAssigned {
        /// The vGPU.
        vgpu: VgpuId,
        /// The GPUs it holds.
        gpus: Vec<GpuIndex>,
    },
    /// A request for no GPU at all.
    #[error("{vgpu} asks for 0 GPUs: gpuplex.io/gpus must be 1 or more")]
    NoGpusRequested {
        /// The vGPU.
        vgpu: VgpuId,
    },
    /// Not enough GPUs can hold the request.
    #[error("{0}")]
    NoFit(NoFit),
    /// A restored assignment that lists no GPU.
    #[error("cannot restore {vgpu}: its assignment lists no GPU")]
    RestoreWithoutGpu {
        /// The vGPU.
        vgpu: VgpuId,
    },
    /// A restored assignment that lists a GPU twice.
    #[error("cannot restore {vgpu}: its assignment lists GPU {gpu} twice")]
    RestoreDuplicateGpu {
        /// The vGPU.
        vgpu: VgpuId,
        /// The GPU listed twice.
        gpu: GpuIndex,
    },
    /// A restored (or pinned) assignment on a GPU this node does not have.
    #[error("cannot place {vgpu} on GPU {gpu}: this node has no GPU {gpu} (its GPUs: {})", list(.node_gpus))]
    UnknownGpu {
        /// The vGPU.
        vgpu: VgpuId,
        /// The missing GPU.
        gpu: GpuIndex,
        /// The GPUs the node has.
        node_gpus: Vec<GpuIndex>,
    },
    /// A restored (or pinned) assignment that would bind more memory than a GPU has unreserved.
    #[error(
        "cannot place {vgpu}: GPU {gpu} ({model}, {}) has {} unreserved and {} is needed there",
        format_bytes(*.capacity), format_bytes(*.unreserved), format_bytes(*.needed)
    )]
    OverCapacity {
        /// The vGPU.
        vgpu: VgpuId,
        /// The GPU.
        gpu: GpuIndex,
        /// Its model.
        model: String,
        /// Its capacity in bytes.
        capacity: u64,
        /// Its unreserved memory in bytes.
        unreserved: u64,
        /// The memory the assignment holds on it.
        needed: u64,
    },
}

/// A request that not enough GPUs can hold, with the verdict on every GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoFit {
    /// The vGPU.
    pub vgpu: VgpuId,
    /// The request, as `gpus=2 gpu-memory=8 GiB model=H100|A100`.
    pub request: String,
    /// GPUs the request needs.
    pub needed: u32,
    /// Every GPU of the node, ascending (empty: the node has no GPU).
    pub gpus: Vec<GpuVerdict>,
}

/// What one GPU could offer a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuVerdict {
    /// The GPU.
    pub index: GpuIndex,
    /// Its model.
    pub model: String,
    /// Its capacity in bytes.
    pub memory: u64,
    /// Its unreserved memory in bytes.
    pub unreserved: u64,
    /// Whether it could hold the request.
    pub verdict: Verdict,
}

/// Whether one GPU could hold a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Its model is none of the request's alternatives.
    ModelMismatch,
    /// It has less unreserved memory than the request needs on it (`needed` bytes).
    NotEnoughMemory {
        /// Bytes needed on this GPU.
        needed: u64,
    },
    /// It could hold the request (but too few others could).
    Fits,
}

impl fmt::Display for NoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fit = self
            .gpus
            .iter()
            .filter(|g| g.verdict == Verdict::Fits)
            .count();
        let head = if fit == 0 {
            "no GPU"
        } else {
            "not enough GPUs"
        };
        write!(f, "{head} can hold {} ({}): ", self.vgpu, self.request)?;
        if self.gpus.is_empty() {
            return write!(f, "this node has no GPU");
        }
        for (i, g) in self.gpus.iter().enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            let (capacity, free) = (format_bytes(g.memory), format_bytes(g.unreserved));
            write!(f, "{sep}GPU {} ({}, {capacity}): ", g.index, g.model)?;
            match g.verdict {
                Verdict::ModelMismatch => write!(f, "model does not match")?,
                Verdict::NotEnoughMemory { needed } => {
                    write!(f, "{free} free, {} needed", format_bytes(needed))?
                }
                Verdict::Fits => write!(f, "{free} free, fits")?,
            }
        }
        if fit > 0 {
            let verb = if fit == 1 { "fits" } else { "fit" };
            let total = self.gpus.len();
            write!(
                f,
                "; {fit} of {total} GPUs {verb} and {} are needed",
                self.needed
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for NoFit {}

fn list(gpus: &[GpuIndex]) -> String {
    if gpus.is_empty() {
        return "none".to_string();
    }
    let names: Vec<String> = gpus.iter().map(GpuIndex::to_string).collect();
    names.join(", ")
}

/// The GPUs of a node and the vGPUs bound to them.
#[derive(Clone, Debug, PartialEq)]
pub struct Inventory {
    /// Ascending by index.
    gpus: Vec<Gpu>,
    /// Parallel to `gpus`.
    slots: Vec<Slot>,
    memory_overcommit: f64,
    bindings: BTreeMap<VgpuId, Assignment>,
}

/// What is bound on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    /// floor(capacity × memory_overcommit).
    limit: u64,
    /// Sum of the entitlements bound.
    reserved: u64,
    /// vGPUs bound.
    bound: usize,
}

impl Slot {
    fn unreserved(&self) -> u64 {
        self.limit.saturating_sub(self.reserved)
    }
}

/// floor(capacity × factor), computed in `f64`; a factor of 1 gives exactly the capacity and a
/// smaller one never more, so no rounding can bind beyond a GPU's memory without overcommit.
fn scaled_capacity(capacity: u64, factor: f64) -> u64 {
    if factor == 1.0 {
        return capacity;
    }
    let scaled = (capacity as f64 * factor).floor() as u64; // `as` saturates
    if factor < 1.0 {
        scaled.min(capacity)
    } else {
        scaled
    }
}

/// What the ranking sees of one candidate GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Load {
    index: GpuIndex,
    /// A bound vGPU has work now (or an earlier arrival of the batch was given it).
    busy: bool,
    /// vGPUs bound.
    bound: usize,
    /// Unreserved memory left after the request is bound.
    left: u64,
}

/// Orders two candidates, better first: idle before busy, then fewest (spread) or most (pack)
/// bound vGPUs, then least memory left (tightest fit), then lowest index. A total order, since
/// indices differ.
fn rank(policy: AssignmentPolicy, a: &Load, b: &Load) -> Ordering {
    a.busy
        .cmp(&b.busy)
        .then_with(|| match policy {
            AssignmentPolicy::Spread => a.bound.cmp(&b.bound),
            AssignmentPolicy::Pack => b.bound.cmp(&a.bound),
        })
        .then(a.left.cmp(&b.left))
        .then(a.index.cmp(&b.index))
}

impl Inventory {
    /// An inventory of these GPUs (in any order), nothing bound. `memory_overcommit` scales each
    /// GPU's capacity for admission (1.0: entitlements never exceed the memory).
    pub fn new(mut gpus: Vec<Gpu>, memory_overcommit: f64) -> Result<Inventory, InventoryError> {
        if !(memory_overcommit.is_finite() && memory_overcommit > 0.0) {
            return Err(InventoryError::BadOvercommit(memory_overcommit));
        }
        gpus.sort_by_key(|g| g.index);
        if let Some(pair) = gpus.windows(2).find(|p| p[0].index == p[1].index) {
            return Err(InventoryError::DuplicateIndex(pair[0].index));
        }
        for (i, gpu) in gpus.iter().enumerate() {
            if gpu.memory == 0 {
                return Err(InventoryError::ZeroMemory(gpu.index));
            }
            if let Some(first) = gpus[..i].iter().find(|g| g.uuid == gpu.uuid) {
                return Err(InventoryError::DuplicateUuid {
                    uuid: gpu.uuid.clone(),
                    first: first.index,
                    second: gpu.index,
                });
            }
        }
        let slots = gpus
            .iter()
            .map(|g| Slot {
                limit: scaled_capacity(g.memory, memory_overcommit),
                reserved: 0,
                bound: 0,
            })
            .collect();
        Ok(Inventory {
            gpus,
            slots,
            memory_overcommit,
            bindings: BTreeMap::new(),
        })
    }

    /// The GPUs, ascending by index.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The GPU with this index.
    pub fn gpu(&self, index: GpuIndex) -> Option<&Gpu> {
        self.position(index).map(|p| &self.gpus[p])
    }

    /// The overcommit factor the inventory was made with.
    pub fn memory_overcommit(&self) -> f64 {
        self.memory_overcommit
    }

    /// Memory of this GPU that no entitlement holds: floor(capacity × `memory_overcommit`) minus
    /// the entitlements bound. 0 for a GPU the node does not have.
    pub fn unreserved(&self, gpu: GpuIndex) -> u64 {
        self.position(gpu).map_or(0, |p| self.slots[p].unreserved())
    }

    /// What entitlements may bind on this GPU in all: floor(capacity × `memory_overcommit`); 0
    /// for a GPU the node does not have.
    pub fn limit(&self, gpu: GpuIndex) -> u64 {
        self.position(gpu).map_or(0, |p| self.slots[p].limit)
    }

    /// vGPUs bound to this GPU (0 for a GPU the node does not have).
    pub fn bound(&self, gpu: GpuIndex) -> usize {
        self.position(gpu).map_or(0, |p| self.slots[p].bound)
    }

    /// The memory this vGPU is entitled to on this GPU, if it is bound to it.
    pub fn entitlement(&self, vgpu: VgpuId, gpu: GpuIndex) -> Option<u64> {
        let assignment = self.bindings.get(&vgpu)?;
        assignment.gpus.binary_search(&gpu).ok()?;
        Some(assignment.memory.bytes_on(self.gpu(gpu)?.memory))
    }

    /// The assignment of this vGPU.
    pub fn assignment(&self, vgpu: VgpuId) -> Option<&Assignment> {
        self.bindings.get(&vgpu)
    }

    /// Every assignment, ascending by vGPU id.
    pub fn assignments(&self) -> impl Iterator<Item = &Assignment> {
        self.bindings.values()
    }

    fn position(&self, index: GpuIndex) -> Option<usize> {
        self.gpus.binary_search_by_key(&index, |g| g.index).ok()
    }

    /// Gives `vgpu` the `request.gpus` best GPUs that match the request's model and have room for
    /// its memory (whole GPU: the GPU's full capacity), or nothing. Best: one where `has_work` is
    /// false, then per `policy` the fewest (spread) or most (pack) bound vGPUs, then the tightest
    /// memory fit, then the lowest index. On error the inventory is unchanged.
    pub fn assign(
        &mut self,
        vgpu: VgpuId,
        request: &VgpuRequest,
        policy: AssignmentPolicy,
        has_work: impl Fn(GpuIndex) -> bool,
    ) -> Result<Assignment, AssignError> {
        if let Some(taken) = self.bindings.get(&vgpu) {
            let gpus = taken.gpus.clone();
            return Err(AssignError::AlreadyAssigned { vgpu, gpus });
        }
        let needed = request.gpus as usize;
        if needed == 0 {
            return Err(AssignError::NoGpusRequested { vgpu });
        }
        // (load, position); GPUs of one model usually come together, so match each model once.
        let mut candidates: Vec<(Load, usize)> = Vec::with_capacity(self.gpus.len());
        let mut last_model: Option<(&str, bool)> = None;
        for (pos, (gpu, slot)) in self.gpus.iter().zip(&self.slots).enumerate() {
            let accepted = match last_model {
                Some((model, accepted)) if model == gpu.model => accepted,
                _ => request.accepts_model(&gpu.model),
            };
            last_model = Some((&gpu.model, accepted));
            let want = request.memory.bytes_on(gpu.memory);
            let free = slot.unreserved();
            if !accepted || want > free {
                continue;
            }
            let load = Load {
                index: gpu.index,
                busy: has_work(gpu.index),
                bound: slot.bound,
                left: free - want,
            };
            candidates.push((load, pos));
        }
        if candidates.len() < needed {
            return Err(AssignError::NoFit(self.no_fit(vgpu, request)));
        }
        candidates.sort_unstable_by(|a, b| rank(policy, &a.0, &b.0));
        candidates.truncate(needed);
        candidates.sort_unstable_by_key(|&(_, pos)| pos);

        let mut gpus = Vec::with_capacity(needed);
        for &(_, pos) in &candidates {
            let slot = &mut self.slots[pos];
            slot.reserved += request.memory.bytes_on(self.gpus[pos].memory);
            slot.bound += 1;
            gpus.push(self.gpus[pos].index);
        }
        let assignment = Assignment {
            vgpu,
            gpus,
            memory: request.memory,
        };
        self.bindings.insert(vgpu, assignment.clone());
        Ok(assignment)
    }

    /// Assigns arrivals that came together, one after the other, in order. A GPU given to an
    /// earlier arrival counts as having work for the later ones, so that arrivals get different
    /// idle GPUs when there are enough (under either policy).
    pub fn assign_batch(
        &mut self,
        requests: &[(VgpuId, VgpuRequest)],
        policy: AssignmentPolicy,
        has_work: impl Fn(GpuIndex) -> bool,
    ) -> Vec<Result<Assignment, AssignError>> {
        let mut given: Vec<GpuIndex> = Vec::new();
        let mut results = Vec::with_capacity(requests.len());
        for (vgpu, request) in requests {
            let result = self.assign(*vgpu, request, policy, |g| {
                has_work(g) || given.contains(&g)
            });
            if let Ok(assignment) = &result {
                given.extend_from_slice(&assignment.gpus);
            }
            results.push(result);
        }
        results
    }

    /// The verdict on every GPU, for the error of a request that does not fit.
    fn no_fit(&self, vgpu: VgpuId, request: &VgpuRequest) -> NoFit {
        let memory = match request.memory {
            GpuMemory::WholeGpu => "whole GPU".to_string(),
            GpuMemory::Bytes(bytes) => format_bytes(bytes),
        };
        let model = if request.models.is_empty() {
            "any".to_string()
        } else {
            request.models.join("|")
        };
        let gpus = self
            .gpus
            .iter()
            .zip(&self.slots)
            .map(|(gpu, slot)| {
                let needed = request.memory.bytes_on(gpu.memory);
                let verdict = if !request.accepts_model(&gpu.model) {
                    Verdict::ModelMismatch
                } else if needed > slot.unreserved() {
                    Verdict::NotEnoughMemory { needed }
                } else {
                    Verdict::Fits
                };
                GpuVerdict {
                    index: gpu.index,
                    model: gpu.model.clone(),
                    memory: gpu.memory,
                    unreserved: slot.unreserved(),
                    verdict,
                }
            })
            .collect();
        NoFit {
            vgpu,
            request: format!("gpus={} gpu-memory={memory} model={model}", request.gpus),
            needed: request.gpus,
            gpus,
        }
    }

    /// Unbinds this vGPU from its GPUs and returns its assignment (`None`: it had none).
    pub fn release(&mut self, vgpu: VgpuId) -> Option<Assignment> {
        let assignment = self.bindings.remove(&vgpu)?;
        for &index in &assignment.gpus {
            if let Some(pos) = self.position(index) {
                let entitlement = assignment.memory.bytes_on(self.gpus[pos].memory);
                let slot = &mut self.slots[pos];
                slot.reserved = slot.reserved.saturating_sub(entitlement);
                slot.bound = slot.bound.saturating_sub(1);
            }
        }
        Some(assignment)
    }

    /// Binds a known assignment again (the node service recovering its state after a restart),
    /// with the same entitlement on each of its GPUs as assigning it gave. Refuses a taken vGPU id, an
    /// assignment without GPUs or with one twice, a GPU the node does not have, and memory beyond
    /// any GPU's unreserved memory, so that no GPU is assigned beyond its memory across a restart.
    /// The model and `has_work` are not checked. On error the inventory is unchanged.
    pub fn restore(&mut self, assignment: Assignment) -> Result<(), AssignError> {
        let Assignment {
            vgpu,
            mut gpus,
            memory,
        } = assignment;
        if let Some(taken) = self.bindings.get(&vgpu) {
            let gpus = taken.gpus.clone();
            return Err(AssignError::AlreadyAssigned { vgpu, gpus });
        }
        if gpus.is_empty() {
            return Err(AssignError::RestoreWithoutGpu { vgpu });
        }
        gpus.sort_unstable();
        if let Some(pair) = gpus.windows(2).find(|p| p[0] == p[1]) {
            let gpu = pair[0];
            return Err(AssignError::RestoreDuplicateGpu { vgpu, gpu });
        }
        let mut positions = Vec::with_capacity(gpus.len());
        for &gpu in &gpus {
            let Some(pos) = self.position(gpu) else {
                let node_gpus = self.gpus.iter().map(|g| g.index).collect();
                return Err(AssignError::UnknownGpu {
                    vgpu,
                    gpu,
                    node_gpus,
                });
            };
            let unreserved = self.slots[pos].unreserved();
            let needed = memory.bytes_on(self.gpus[pos].memory);
            if needed > unreserved {
                return Err(AssignError::OverCapacity {
                    vgpu,
                    gpu,
                    model: self.gpus[pos].model.clone(),
                    capacity: self.gpus[pos].memory,
                    unreserved,
                    needed,
                });
            }
            positions.push(pos);
        }
        for pos in positions {
            self.slots[pos].reserved += memory.bytes_on(self.gpus[pos].memory);
            self.slots[pos].bound += 1;
        }
        let assignment = Assignment { vgpu, gpus, memory };
        self.bindings.insert(vgpu, assignment);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
