//! Reservations the cluster's scheduler placed: a Kubernetes ResourceClaim allocated by
//! kube-scheduler (DRA, consumable capacity) names the GPUs and the memory on each. The node
//! does not choose again; it checks that the placement still fits (memory taken meanwhile by a
//! container outside Kubernetes, a GPU gone) and pins it: the reservation never lapses, and only
//! its claim releases it.

use std::collections::BTreeMap;

use super::{check_claim_uid, is_pod_key, Node, NodeError, VgpuRecord};
use crate::inventory::Assignment;
use crate::request::{GpuMemory, GPUS, GPU_MEMORY, GPU_MODEL};
use crate::{GpuIndex, Handle, Instant, VgpuId};

/// Where a claim's vGPU goes: the GPUs and the bytes on each that kube-scheduler allocated.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    /// The GPUs (a gang when more than one), distinct.
    pub gpus: Vec<GpuIndex>,
    /// The memory on each, in bytes.
    pub memory: u64,
}

impl Placement {
    /// The GPUs ascending, or why the placement names none or one twice.
    fn sorted_gpus(&self) -> Result<Vec<GpuIndex>, NodeError> {
        let mut gpus = self.gpus.clone();
        gpus.sort_unstable();
        if gpus.is_empty() {
            return Err(NodeError::BadPlacement("names no GPU".into()));
        }
        if let Some(pair) = gpus.windows(2).find(|p| p[0] == p[1]) {
            return Err(NodeError::BadPlacement(format!(
                "names GPU {} twice",
                pair[0]
            )));
        }
        if self.memory == 0 {
            return Err(NodeError::BadPlacement("gives no memory".into()));
        }
        Ok(gpus)
    }
}

impl Node {
    /// Pins a vGPU for `claim` (a ResourceClaim's uid) on exactly `placement`, with the weight
    /// and priority its `annotations` ask for (`gpuplex.io/weight`, `gpuplex.io/priority`, and
    /// the pod's namespace for the operator's policy). Its container attaches with `handle`, as
    /// after [`Node::reserve`]; it never lapses ([`Node::decide`] lets it be) and is released by
    /// [`super::ReleaseKey::Claim`].
    ///
    /// Idempotent: the same claim placed the same way gets its record back; placed otherwise,
    /// it is refused. Refused too when the placement does not fit (a GPU the node lacks, memory
    /// beyond what is unreserved there); then nothing changes.
    pub fn pin<'a>(
        &mut self,
        claim: &str,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
        placement: &Placement,
        handle: Handle,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        if claim.starts_with(super::allocated::ALLOCATION_PREFIX) {
            return Err(NodeError::BadClaimUid(claim.to_owned()));
        }
        self.pin_unchecked(claim, annotations, placement, handle, now)
    }

    /// [`Node::pin`] under any claim key, an allocation's too ([`Node::allocate`]).
    pub(super) fn pin_unchecked<'a>(
        &mut self,
        claim: &str,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
        placement: &Placement,
        handle: Handle,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        check_claim_uid(claim)?;
        let gpus = placement.sorted_gpus()?;
        let memory = GpuMemory::Bytes(placement.memory);
        if let Some(&vgpu) = self.by_claim.get(claim) {
            let record = &self.records[&vgpu];
            if record.assignment.gpus == gpus && record.assignment.memory == memory {
                return Ok(record);
            }
            return Err(NodeError::ClaimPinned {
                claim: claim.to_owned(),
                vgpu,
            });
        }
        if self.by_handle.contains_key(&handle) {
            return Err(NodeError::HandleInUse);
        }
        let mut kept = BTreeMap::new();
        for (key, value) in annotations {
            if let Some(placed) = [GPUS, GPU_MEMORY, GPU_MODEL]
                .into_iter()
                .find(|k| *k == key)
            {
                return Err(NodeError::PlacedByScheduler(placed));
            }
            if key.starts_with(crate::request::PREFIX) || is_pod_key(key) {
                kept.insert(key.to_owned(), value.to_owned());
            }
        }
        // What the placement decided, written as a request would ask for it: a restarted node
        // service reads the request back from the record's annotations.
        kept.insert(GPUS.to_owned(), gpus.len().to_string());
        kept.insert(GPU_MEMORY.to_owned(), placement.memory.to_string());
        let request = self.admitted(&kept)?;
        let id = VgpuId(self.next_id);
        // Spent even when the pin is refused (see `Node::reserve`).
        self.next_id = self.next_id.checked_add(1).ok_or(NodeError::IdsExhausted)?;
        let assignment = Assignment {
            vgpu: id,
            gpus,
            memory,
        };
        self.inventory.restore(assignment.clone())?;
        self.by_handle.insert(handle, id);
        self.by_claim.insert(claim.to_owned(), id);
        let record = VgpuRecord {
            id,
            handle,
            annotations: kept,
            request,
            assignment,
            reserved_at: now,
            attachments: Vec::new(),
            claim: Some(claim.to_owned()),
            units: Vec::new(),
        };
        Ok(self.records.entry(id).or_insert(record))
    }
}

impl Node {
    /// Lets one container of a pinned vGPU go (its processes are gone, or its runtime let it
    /// go) and keeps the reservation for its claim: the pod's other containers keep it, and its
    /// next ones attach with the same handle. Returns the record as it was; when the last
    /// container went, with the thaw order and the stats, as [`Node::release`] does (the vGPU
    /// left the windows). `None` when the vGPU is not pinned or `container` is not attached
    /// to it.
    pub fn detach(
        &mut self,
        vgpu: VgpuId,
        container: &str,
        now: Instant,
    ) -> Option<super::Released> {
        let record = self.records.get_mut(&vgpu)?;
        let at = record.containers().position(|c| c == container)?;
        record.claim.as_ref()?;
        let before = record.clone();
        record.attachments.remove(at);
        let last = record.attachments.is_empty();
        self.by_container.remove(container);
        if !last {
            return Some(super::Released {
                record: before,
                thaw: None,
                stats: None,
            });
        }
        self.unsampled.remove(&vgpu);
        let unbound = self.windows.unbind(vgpu, now);
        Some(super::Released {
            record: before,
            thaw: unbound.as_ref().and_then(|u| u.thaw),
            stats: unbound.map(|u| u.stats),
        })
    }
}

#[cfg(test)]
mod tests;
