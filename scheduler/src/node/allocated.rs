//! The device plugin's allocations (clusters without DRA, `gpuplex.io/gpu-memory` units): the
//! kubelet gave a container units of one GPU's memory ([`crate::units`]), and the plugin pins
//! their vGPU as a claim is pinned ([`Node::pin`]): on exactly that GPU and memory, never
//! lapsing, attached with one handle.
//!
//! The kubelet's `Allocate` does not say which pod it serves, and never says when a pod has gone.
//! The units say both: the kubelet gives a unit to one container at a time, so a new allocation
//! holding any unit of an earlier one means the earlier one's pod is gone. [`Node::allocate`]
//! releases such allocations first: pinned allocations never share a unit, and the memory they
//! hold is never more than the units the kubelet counts. An allocation that would not fit even
//! then is refused before anything is released: a refusal changes nothing (released in memory
//! but not told to the service, an earlier allocation's record would outlive it on disk and
//! come back at a restart in the new one's place). The same units allocated again (a
//! retry, an init container's units reused by the pod's next container) are the same vGPU.
//!
//! The pod's weight and priority are unknown at `Allocate`: its first container brings them
//! when it attaches ([`Node::attach_asking`]).

use std::collections::BTreeMap;

use super::{is_pod_key, Attachment, Node, NodeError, ReleaseKey, Released};
use crate::inventory::AssignError;
use crate::request::{VgpuRequest, PREFIX, PRIORITY, WEIGHT};
use crate::units::{self, UnitId};
use crate::{Handle, Instant, VgpuId};

/// The claim key an allocation is pinned under: `units-` and its lowest unit (`units-gpu-1-0`).
/// Unique among pinned allocations, since they never share a unit.
pub fn allocation_key(units: &[UnitId]) -> Option<String> {
    units
        .iter()
        .min()
        .map(|u| format!("{ALLOCATION_PREFIX}{u}"))
}

/// How an allocation's claim key starts; no ResourceClaim uid does.
pub const ALLOCATION_PREFIX: &str = "units-";

/// What [`Node::allocate`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocated {
    /// The allocation's vGPU.
    pub vgpu: VgpuId,
    /// Earlier allocations released because the kubelet gave their units again.
    pub released: Vec<Released>,
}

impl Node {
    /// Pins the vGPU of the units the kubelet gave one container (`units`, each `unit` bytes,
    /// all on one GPU), first releasing every allocation that holds any of them; the same units
    /// again get the same vGPU, releasing nothing. Its container attaches with `handle` (the
    /// existing one's for the same units). Refused when the units are none, repeat, span GPUs or are not
    /// among those their GPU offers ([`units::check_offered`]: its limit in units of `unit`),
    /// or when their memory does not fit the GPU even with the allocations that hold them
    /// released (memory reserved outside the kubelet's count); a refusal changes nothing.
    pub fn allocate(
        &mut self,
        units: &[UnitId],
        unit: u64,
        handle: Handle,
        now: Instant,
    ) -> Result<Allocated, NodeError> {
        let placement = units::placement_of(units, unit, 0)?;
        units::check_offered(units, |gpu| self.inventory.limit(gpu) / unit.max(1))?;
        let mut asked = units.to_vec();
        asked.sort_unstable();
        let key = allocation_key(&asked).ok_or(NodeError::Units(units::UnitsError::None))?;
        let same = self
            .records
            .values()
            .find(|r| r.units == asked)
            .map(|r| r.id);
        if let Some(vgpu) = same {
            return Ok(Allocated {
                vgpu,
                released: Vec::new(),
            });
        }
        let over: Vec<VgpuId> = self
            .records
            .values()
            .filter(|r| r.units.iter().any(|u| asked.binary_search(u).is_ok()))
            .map(|r| r.id)
            .collect();
        let gpu = placement.gpus.first().copied();
        if let Some(g) = gpu.and_then(|g| self.inventory.gpu(g)).cloned() {
            let freed: u64 = (over.iter().map(|v| &self.records[v].assignment))
                .filter(|a| a.gpus.contains(&g.index))
                .map(|a| a.memory.bytes_on(g.memory))
                .sum();
            let unreserved = self.inventory.unreserved(g.index).saturating_add(freed);
            if placement.memory > unreserved {
                // The id the refusal names is spent, as a reservation's is.
                let vgpu = VgpuId(self.next_id);
                self.next_id = self.next_id.checked_add(1).ok_or(NodeError::IdsExhausted)?;
                return Err(NodeError::Assign(AssignError::OverCapacity {
                    vgpu,
                    gpu: g.index,
                    model: g.model,
                    capacity: g.memory,
                    unreserved,
                    needed: placement.memory,
                }));
            }
        }
        let released = over
            .into_iter()
            .filter_map(|vgpu| self.release(&ReleaseKey::Vgpu(vgpu), now))
            .collect();
        let vgpu = self.pin_unchecked(&key, [], &placement, handle, now)?.id;
        self.records.get_mut(&vgpu).expect("pinned just now").units = asked;
        Ok(Allocated { vgpu, released })
    }

    /// [`Node::attach`], with what the container asks for its vGPU: an allocation's weight and
    /// priority (`gpuplex.io/weight`, `gpuplex.io/priority`, checked by the operator's policy
    /// with the pod's namespace among `asked`), taken when the allocation has no container yet
    /// (asking nothing then is asking the defaults). Any other vGPU's weight and priority were
    /// set when it was reserved: asking is refused, and asking nothing is [`Node::attach`].
    pub fn attach_asking(
        &mut self,
        handle: &Handle,
        attachment: Attachment,
        asked: &BTreeMap<String, String>,
        now: Instant,
    ) -> Result<&super::VgpuRecord, NodeError> {
        let vgpu = self.vgpu_with(handle).ok_or(NodeError::UnknownHandle)?;
        let record = &self.records[&vgpu];
        if record.units.is_empty() {
            if asked.keys().any(|k| k.starts_with(PREFIX)) {
                return Err(NodeError::NotAnAllocation(vgpu));
            }
        } else if record.attachments.is_empty() {
            // The first container of a pod (the units may have served another pod before).
            let (annotations, request) = self.asked_of(record.annotations.clone(), asked)?;
            let record = self.records.get_mut(&vgpu).expect("found above");
            record.annotations = annotations;
            record.request = request;
        }
        self.attach(handle, attachment, now)
    }

    /// An allocation's annotations with what its container asks, and the request they make,
    /// admitted by the policy.
    fn asked_of(
        &self,
        mut annotations: BTreeMap<String, String>,
        asked: &BTreeMap<String, String>,
    ) -> Result<(BTreeMap<String, String>, VgpuRequest), NodeError> {
        annotations.retain(|k, _| k != WEIGHT && k != PRIORITY && !is_pod_key(k));
        for (key, value) in asked {
            if key.starts_with(PREFIX) && key != WEIGHT && key != PRIORITY {
                return Err(NodeError::AskedOfAllocation(key.clone()));
            }
            if key.starts_with(PREFIX) || is_pod_key(key) {
                annotations.insert(key.clone(), value.clone());
            }
        }
        let request = self.admitted(&annotations)?;
        Ok((annotations, request))
    }
}

#[cfg(test)]
mod tests;
