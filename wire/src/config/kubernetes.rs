//! `[kubernetes]`: which kubelet plugin `gpuplex-dra` serves, and how the device plugin counts
//! and hands out GPU memory.

use serde::Deserialize;

use super::{refused, InvalidConfig};
use gpuplex_scheduler::quantity::parse_quantity;

/// Which kubelet plugin `gpuplex-dra` serves. A node's GPU memory is counted by one cluster
/// mechanism, never both: either would hand out memory the other counts as free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KubeletPlugin {
    /// The DRA driver `gpuplex.io` (Kubernetes 1.34 and later: ResourceClaims, consumable
    /// capacity).
    #[default]
    Dra,
    /// The device plugin of the extended resource `gpuplex.io/gpu-memory` (any Kubernetes with
    /// device plugins v1beta1).
    DevicePlugin,
}

/// How the device plugin's `Allocate` answer gives a container its GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceDelivery {
    /// Device nodes, mounts and environment in the answer: any runtime applies them.
    #[default]
    Kubelet,
    /// A CDI device (`gpuplex.io/vgpu=units-...`): runtimes that read CDI (containerd 1.7 with
    /// `enable_cdi`, CRI-O); the host spec's hooks apply too.
    Cdi,
}

/// `[kubernetes]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// The plugin served.
    pub plugin: KubeletPlugin,
    /// One unit of `gpuplex.io/gpu-memory`, in bytes.
    pub gpu_memory_unit: u64,
    /// How `Allocate` gives a container its GPU.
    pub device_plugin_devices: DeviceDelivery,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            plugin: KubeletPlugin::Dra,
            gpu_memory_unit: gpuplex_scheduler::units::DEFAULT_UNIT,
            device_plugin_devices: DeviceDelivery::Kubelet,
        }
    }
}

/// The smallest unit accepted (a GPU of 80 GiB is then 1,280 units).
const MIN_UNIT: u64 = 64 << 20;
/// The largest unit accepted.
const MAX_UNIT: u64 = 1 << 40;

/// `[kubernetes]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct KubernetesEntry {
    plugin: KubeletPlugin,
    gpu_memory_unit: String,
    device_plugin_devices: DeviceDelivery,
}

impl Default for KubernetesEntry {
    fn default() -> Self {
        let d = KubernetesConfig::default();
        KubernetesEntry {
            plugin: d.plugin,
            // DEFAULT_UNIT as written.
            gpu_memory_unit: "1Gi".to_owned(),
            device_plugin_devices: d.device_plugin_devices,
        }
    }
}

impl KubernetesEntry {
    /// Checked.
    pub(super) fn check(self) -> Result<KubernetesConfig, InvalidConfig> {
        let shown = format!("{:?}", self.gpu_memory_unit);
        let accepted = "a Kubernetes quantity from 64Mi to 1Ti, like \"1Gi\"";
        let unit = parse_quantity(&self.gpu_memory_unit)
            .map_err(|_| refused("kubernetes.gpu_memory_unit", shown.clone(), accepted))?;
        if !(MIN_UNIT..=MAX_UNIT).contains(&unit) {
            return Err(refused("kubernetes.gpu_memory_unit", shown, accepted));
        }
        Ok(KubernetesConfig {
            plugin: self.plugin,
            gpu_memory_unit: unit,
            device_plugin_devices: self.device_plugin_devices,
        })
    }
}
