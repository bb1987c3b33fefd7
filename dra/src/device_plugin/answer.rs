//! What the device plugin tells the kubelet, decided from what the node service said: the units
//! each GPU offers with their health (`ListAndWatch`), the preferred units (pure, in
//! [`gpuplex_scheduler::units`]), and a container's `Allocate` answer.
//!
//! The answer carries the allocation's handle in [`ALLOCATION`], which the kubelet writes on the
//! container and the shim attaches it with, and gives the container its GPU in one of two ways
//! ([`DeviceDelivery`]): as device nodes, mounts and environment that any runtime applies, or as
//! the allocation's CDI device (with the same attach step as a claim's).

use std::collections::HashMap;

use gpuplex_scheduler::units::units_of;
use gpuplex_scheduler::{GpuIndex, Handle};
use gpuplex_wire::annotations::ALLOCATION;
use gpuplex_wire::config::DeviceDelivery;
use gpuplex_wire::protocol::cdi::CdiEdits;
use gpuplex_wire::protocol::GpuCapacity;

use crate::cdi;
use crate::proto::deviceplugin as dp;

/// A unit's health as the kubelet reads it.
pub const HEALTHY: &str = "Healthy";
/// A unit of a GPU that is gone, or of any GPU while the node service cannot be reached.
pub const UNHEALTHY: &str = "Unhealthy";

/// The units the GPUs offer (each GPU's capacity, its memory × `memory_overcommit`, in units of
/// `unit` bytes), unhealthy on a GPU that is gone; in the order of the GPUs and units.
pub fn devices(gpus: &[GpuCapacity], unit: u64) -> Vec<dp::Device> {
    let mut devices = Vec::new();
    for gpu in gpus {
        let health = if gpu.healthy { HEALTHY } else { UNHEALTHY };
        for u in units_of(&[(GpuIndex(gpu.index), gpu.capacity)], unit) {
            devices.push(dp::Device {
                id: u.to_string(),
                health: health.to_owned(),
                topology: None,
            });
        }
    }
    devices
}

/// The units listed, each unhealthy: what the plugin lists while it cannot see the GPUs (the
/// node service cannot be reached), so that the kubelet admits nothing to them.
pub fn unseen(devices: &[dp::Device]) -> Vec<dp::Device> {
    (devices.iter())
        .map(|d| dp::Device {
            health: UNHEALTHY.to_owned(),
            ..d.clone()
        })
        .collect()
}

/// The most units one GPU offers: what a container may ask for at most.
pub fn most_on_one_gpu(gpus: &[GpuCapacity], unit: u64) -> u64 {
    gpus.iter()
        .map(|g| g.capacity / unit.max(1))
        .max()
        .unwrap_or(0)
}

/// The CDI device name of allocation `key` (`gpuplex.io/vgpu=units-gpu-1-0`).
pub fn cdi_device(key: &str) -> String {
    cdi::device_id(key)
}

/// A container's `Allocate` answer for its allocation `key` with `handle`: `edits` are the
/// allocation's (`cdi::claim_edits` without the attach step) for [`DeviceDelivery::Kubelet`];
/// with [`DeviceDelivery::Cdi`] its CDI device, written beforehand, stands for them. The host
/// spec's hooks cannot be given as the kubelet's fields: they are left out, and the caller says
/// so in its log.
pub fn answer(
    delivery: DeviceDelivery,
    key: &str,
    handle: &Handle,
    edits: &CdiEdits,
) -> dp::ContainerAllocateResponse {
    let mut annotations = HashMap::from([(ALLOCATION.to_owned(), handle.to_string())]);
    match delivery {
        DeviceDelivery::Cdi => {
            let name = cdi_device(key);
            // containerd 1.7 reads the CDI annotation; kubelets of 1.28 and later pass the field.
            annotations.insert(format!("cdi.k8s.io/gpuplex.io_{key}"), name.clone());
            dp::ContainerAllocateResponse {
                annotations,
                cdi_devices: vec![dp::CdiDevice { name }],
                ..Default::default()
            }
        }
        DeviceDelivery::Kubelet => dp::ContainerAllocateResponse {
            envs: edits
                .env
                .iter()
                .filter_map(|e| e.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            mounts: edits
                .mounts
                .iter()
                .map(|m| dp::Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    read_only: m.options.iter().any(|o| o == "ro"),
                })
                .collect(),
            devices: edits
                .device_nodes
                .iter()
                .map(|d| dp::DeviceSpec {
                    container_path: d.path.clone(),
                    host_path: d.host_path.clone().unwrap_or_else(|| d.path.clone()),
                    permissions: d.permissions.clone().unwrap_or_else(|| "rw".into()),
                })
                .collect(),
            annotations,
            cdi_devices: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests;
