//! Where a container's vGPU comes from, decided from its spec alone: one pure function,
//! [`classify`], over the container's OCI spec (the containerd shim's one parse of the bundle's
//! config.json; for the NRI plugin, the spec as NRI describes the container: its annotations and
//! `createRuntime` hooks).
//!
//! The rules, in the order they apply:
//!
//! 1. A claim's attach step in the spec's `createRuntime` hooks (the format is the wire
//!    crate's, [`gpuplex_wire::attach_step::take_attach_hook`], which also refuses a forged
//!    or second step) and the device plugin's allocation annotation ([`ALLOCATION`]; refused when it is
//!    not a handle) come first:
//!    - an allocation, with or without a step of the same handle: [`VgpuOrigin::Allocation`];
//!      with a step of another handle: refused;
//!    - a step alone: [`VgpuOrigin::Claim`], refused when `gpuplex.io/` annotations ask for a
//!      vGPU too.
//! 2. Else `gpuplex.io/` annotations ([`crate::spec::gpuplex_annotations`]: string values
//!    only) ask for a vGPU that the shim or the NRI plugin reserves, [`VgpuOrigin::Annotations`],
//!    except in a pod's sandbox (CRI's `io.kubernetes.cri.container-type` = `sandbox`), which
//!    carries its pod's annotations but runs no GPU work.
//! 3. Else no vGPU.

use std::collections::BTreeMap;

use crate::spec::gpuplex_annotations;
use gpuplex_scheduler::Handle;
use gpuplex_wire::annotations::{ALLOCATION, POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX};
use gpuplex_wire::attach_step::take_attach_hook;
use serde_json::Value;

/// How CRI marks a pod's sandbox (pause) container.
const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// Where a container's vGPU comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum VgpuOrigin {
    /// It has none: no `gpuplex.io/` annotation, or a pod's sandbox. runc runs it untouched.
    NoVgpu,
    /// It asks by these `gpuplex.io/` annotations: a vGPU is reserved and the spec edited
    /// before `runc create` (by the shim, or by the NRI plugin's adjustment), and released when
    /// the container goes.
    Annotations(BTreeMap<String, String>),
    /// A Kubernetes claim's container: the claim's vGPU, pinned already, is attached with the
    /// claim's `handle`; the container runs `spec`, the spec without the attach step. The claim
    /// keeps the vGPU after the container.
    Claim {
        /// The claim's handle, from its attach step.
        handle: Handle,
        /// The spec without the step.
        spec: Value,
    },
    /// A container of the device plugin's allocation: its vGPU, pinned already, is attached with
    /// the allocation's `handle`, bringing what the pod `asked`; the container runs `spec`
    /// (without an attach step the runtime applied from the allocation's CDI device). The
    /// allocation keeps the vGPU after the container.
    Allocation {
        /// The allocation's handle, from its annotation.
        handle: Handle,
        /// Every other `gpuplex.io/` annotation (the node service takes the weight and priority
        /// and refuses the rest in one line) and the pod's name and namespace.
        asked: BTreeMap<String, String>,
        /// The spec without the attach step.
        spec: Value,
    },
}

/// A spec gpuplex refuses to run: one line, shown to the containerd user (after `gpuplex: `).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecRefusal {
    /// A claim's attach step that is forged, or two of them: the hook library's line.
    #[error("{0}")]
    AttachStep(String),
    /// An allocation annotation that is not a handle.
    #[error("{ALLOCATION} is not a handle gpuplex's device plugin wrote; it is the kubelet's to write, from the plugin's answer")]
    AllocationNotAHandle,
    /// An allocation annotation and a claim's attach step of another handle.
    #[error("the container has two gpuplex allocations: a gpuplex.io/vgpu CDI device and a different {ALLOCATION}")]
    TwoAllocations,
    /// A claim's attach step and `gpuplex.io/` annotations asking for a vGPU of their own.
    #[error("the container asks for two vGPUs: its claim's (a gpuplex.io/vgpu CDI device) and one by gpuplex.io/ annotations; a claim's container takes its weight and priority from the claim's VgpuConfig")]
    ClaimAndAnnotations,
}

/// Where the vGPU of the container whose spec is `spec` comes from (see the module's doc).
pub fn classify(spec: &Value) -> Result<VgpuOrigin, SpecRefusal> {
    let mut without_step = spec.clone();
    let step = take_attach_hook(&mut without_step).map_err(SpecRefusal::AttachStep)?;
    let allocation = allocation_of(spec)?;
    let asked_by_annotations = gpuplex_annotations(spec);
    match (step, allocation) {
        (Some(step), Some(allocation)) if step != allocation.handle => {
            Err(SpecRefusal::TwoAllocations)
        }
        (_, Some(AllocationAnnotation { handle, asked })) => Ok(VgpuOrigin::Allocation {
            handle,
            asked,
            spec: without_step,
        }),
        (Some(_), None) if !asked_by_annotations.is_empty() => {
            Err(SpecRefusal::ClaimAndAnnotations)
        }
        (Some(handle), None) => Ok(VgpuOrigin::Claim {
            handle,
            spec: without_step,
        }),
        (None, None) if asked_by_annotations.is_empty() || is_sandbox(spec) => {
            Ok(VgpuOrigin::NoVgpu)
        }
        (None, None) => Ok(VgpuOrigin::Annotations(asked_by_annotations)),
    }
}

/// Whether `spec` is a pod's sandbox container.
fn is_sandbox(spec: &Value) -> bool {
    spec["annotations"][CONTAINER_TYPE] == "sandbox"
}

/// The device plugin's allocation, as a spec names it.
#[derive(Debug)]
struct AllocationAnnotation {
    /// The handle of [`ALLOCATION`].
    handle: Handle,
    /// What the container asks for it ([`VgpuOrigin::Allocation`]'s `asked`).
    asked: BTreeMap<String, String>,
}

/// The device plugin's allocation a spec names ([`ALLOCATION`]). `None` without the
/// annotation (or without annotations that are an object); refused when it is not a handle.
fn allocation_of(spec: &Value) -> Result<Option<AllocationAnnotation>, SpecRefusal> {
    let Some(annotations) = spec.get("annotations").and_then(Value::as_object) else {
        return Ok(None);
    };
    let Some(value) = annotations.get(ALLOCATION) else {
        return Ok(None);
    };
    let handle = (value.as_str())
        .and_then(|h| h.parse::<Handle>().ok())
        .ok_or(SpecRefusal::AllocationNotAHandle)?;
    let asked = annotations
        .iter()
        .filter(|(k, _)| *k != ALLOCATION)
        .filter(|(k, _)| {
            k.starts_with(PREFIX)
                || POD_NAME_KEYS.contains(&k.as_str())
                || POD_NAMESPACE_KEYS.contains(&k.as_str())
        })
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    Ok(Some(AllocationAnnotation { handle, asked }))
}

#[cfg(test)]
mod tests;
