//! A ResourceClaim that kube-scheduler allocated to this node, read: where its vGPU goes (the
//! GPUs and the memory it consumes on each) and the weight and priority its `VgpuConfig` asks
//! for. Pure: the claim comes in as the API server's object, the plan goes out.

use std::collections::BTreeMap;

use gpuplex_scheduler::node::Placement;
use gpuplex_scheduler::quantity::{parse_quantity, shown};
use gpuplex_scheduler::request::VgpuRequest;
use gpuplex_scheduler::GpuIndex;
use gpuplex_wire::annotations::{GPUS, GPU_MEMORY, PRIORITY, WEIGHT};
use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};
use serde::Deserialize;

/// The driver's name: the DeviceClass, the ResourceSlices' driver, the opaque config's.
pub const DRIVER: &str = "gpuplex.io";

/// The capacity a claim consumes on a GPU.
pub const MEMORY: &str = "memory";

/// The opaque configuration's `apiVersion` and `kind`.
pub const CONFIG_API_VERSION: &str = "gpuplex.io/v1";
/// See [`CONFIG_API_VERSION`].
pub const CONFIG_KIND: &str = "VgpuConfig";

/// The annotation the node's policy reads a Kubernetes namespace from.
const NAMESPACE_KEY: &str = "io.kubernetes.pod.namespace";

/// A claim as the kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "claim {}/{}", self.namespace, self.name)
    }
}

/// One device of the allocation, as the kubelet is told of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatedDevice {
    /// The claim's request it serves.
    pub request: String,
    /// Its pool (this node's name).
    pub pool: String,
    /// The device (`gpu-0`).
    pub device: String,
}

/// What preparing a claim asks of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimPlan {
    /// Its GPUs and the memory on each.
    pub placement: Placement,
    /// Its weight and priority, and its namespace, as the node's requests carry them.
    pub annotations: BTreeMap<String, String>,
    /// The devices allocated, in the allocation's order.
    pub devices: Vec<AllocatedDevice>,
}

/// Why a claim cannot be prepared here. One line, naming the claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The API server's claim is another object than the kubelet's.
    #[error("{claim}: its uid is {found} now, not {asked} (deleted and created again)")]
    Replaced {
        /// The claim asked for (`claim NAMESPACE/NAME`).
        claim: String,
        /// The uid the kubelet asked for.
        asked: String,
        /// The uid found.
        found: String,
    },
    /// The claim is not allocated.
    #[error("{0}: it is not allocated")]
    NotAllocated(String),
    /// No device of the allocation is gpuplex's.
    #[error("{0}: no device of its allocation is {DRIVER}'s")]
    NoDevices(String),
    /// A device of another node's pool.
    #[error("{claim}: device {device} is in pool {pool}, not this node's ({node})")]
    OtherNode {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// The device.
        device: String,
        /// Its pool.
        pool: String,
        /// This node's name.
        node: String,
    },
    /// A device name that is not one of gpuplex's.
    #[error("{claim}: device {} is not a gpuplex GPU (gpu-<index>)", shown(device))]
    UnknownDevice {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// The device.
        device: String,
    },
    /// The allocation consumes no memory, or memory that cannot be read.
    #[error("{claim}: device {device}: {problem}")]
    Memory {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// The device.
        device: String,
        /// What is wrong.
        problem: String,
    },
    /// Different memory on the GPUs of one claim.
    #[error(
        "{0}: its GPUs consume different memory; a vGPU has the same memory on each of its GPUs"
    )]
    UnevenMemory(String),
    /// The opaque configuration is not a valid `VgpuConfig`.
    #[error("{claim}: {CONFIG_KIND}: {problem}")]
    Config {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// What is wrong.
        problem: String,
    },
}

/// The device name of GPU `index` in this driver's ResourceSlice.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU a device name of this driver's names.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    digits.parse().ok()
}

/// The opaque configuration a claim (or its DeviceClass) gives gpuplex's devices.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct VgpuConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    weight: Option<serde_json::Value>,
    #[serde(default)]
    priority: Option<serde_json::Value>,
}

/// Reads the claim `found` that the kubelet asked to prepare as `asked`, on node `node`.
pub fn plan(found: &ResourceClaim, asked: &ClaimRef, node: &str) -> Result<ClaimPlan, ClaimError> {
    let uid = found.metadata.uid.clone().unwrap_or_default();
    if uid != asked.uid {
        return Err(ClaimError::Replaced {
            claim: asked.to_string(),
            asked: asked.uid.clone(),
            found: uid,
        });
    }
    let allocation = found
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated(asked.to_string()))?;
    let devices = allocation.devices.as_ref();
    let results: Vec<_> = devices
        .map(|d| {
            d.results
                .iter()
                .flatten()
                .filter(|r| r.driver == DRIVER)
                .collect()
        })
        .unwrap_or_default();
    if results.is_empty() {
        return Err(ClaimError::NoDevices(asked.to_string()));
    }
    let mut gpus = Vec::new();
    let mut memory = None;
    let mut allocated = Vec::new();
    for result in &results {
        if result.pool != node {
            return Err(ClaimError::OtherNode {
                claim: asked.to_string(),
                device: result.device.clone(),
                pool: result.pool.clone(),
                node: node.to_owned(),
            });
        }
        let index = device_index(&result.device).ok_or_else(|| ClaimError::UnknownDevice {
            claim: asked.to_string(),
            device: result.device.clone(),
        })?;
        let consumed = result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(MEMORY));
        let memory_error = |problem: String| ClaimError::Memory {
            claim: asked.to_string(),
            device: result.device.clone(),
            problem,
        };
        let Some(quantity) = consumed else {
            return Err(memory_error(
                "the allocation consumes no memory: kube-scheduler needs consumable capacity (the DRAConsumableCapacity feature, on by default since Kubernetes 1.36)".into(),
            ));
        };
        let bytes = parse_quantity(&quantity.0).map_err(|e| memory_error(e.to_string()))?;
        if bytes == 0 {
            return Err(memory_error("the allocation consumes 0 bytes".into()));
        }
        if memory.is_some_and(|m| m != bytes) {
            return Err(ClaimError::UnevenMemory(asked.to_string()));
        }
        memory = Some(bytes);
        gpus.push(GpuIndex(index));
        allocated.push(AllocatedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
        });
    }
    let requests: Vec<&str> = results.iter().map(|r| r.request.as_str()).collect();
    let configs = devices
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();
    let mut annotations =
        config_annotations(configs, &requests).map_err(|problem| ClaimError::Config {
            claim: asked.to_string(),
            problem,
        })?;
    annotations.insert(NAMESPACE_KEY.to_owned(), asked.namespace.clone());
    Ok(ClaimPlan {
        placement: Placement {
            gpus,
            memory: memory.expect("at least one result"),
        },
        annotations,
        devices: allocated,
    })
}

/// The weight and priority the configurations of gpuplex's requests give, as annotations:
/// the DeviceClass's first, then the claim's, each later one overriding what it sets. Each
/// value is checked as the node checks a request, so a bad one is refused here in the node's
/// words.
fn config_annotations(
    configs: &[DeviceAllocationConfiguration],
    requests: &[&str],
) -> Result<BTreeMap<String, String>, String> {
    let ours = |c: &&DeviceAllocationConfiguration| {
        c.opaque.as_ref().is_some_and(|o| o.driver == DRIVER)
            && (c.requests.as_ref().is_none_or(|r| r.is_empty())
                || c.requests
                    .iter()
                    .flatten()
                    .any(|r| requests.contains(&r.as_str())))
    };
    let mut ordered: Vec<&DeviceAllocationConfiguration> = configs.iter().filter(ours).collect();
    // FromClass before FromClaim; the sort is stable, so each keeps its own order.
    ordered.sort_by_key(|c| c.source != "FromClass");
    let mut annotations = BTreeMap::new();
    for config in ordered {
        let parameters = &config.opaque.as_ref().expect("filtered").parameters.0;
        let parsed: VgpuConfig = serde_json::from_value(parameters.clone())
            .map_err(|e| shown(&e.to_string()).into_owned())?;
        if parsed.api_version != CONFIG_API_VERSION || parsed.kind != CONFIG_KIND {
            return Err(format!(
                "apiVersion {} and kind {} are not {CONFIG_API_VERSION} and {CONFIG_KIND}",
                shown(&parsed.api_version),
                shown(&parsed.kind)
            ));
        }
        for (key, value) in [(WEIGHT, parsed.weight), (PRIORITY, parsed.priority)] {
            match value {
                None => {}
                Some(serde_json::Value::String(s)) => {
                    annotations.insert(key.to_owned(), s);
                }
                Some(serde_json::Value::Number(n)) => {
                    annotations.insert(key.to_owned(), n.to_string());
                }
                Some(other) => {
                    return Err(format!(
                        "{}: {other} is neither a number nor a string",
                        key.trim_start_matches("gpuplex.io/")
                    ))
                }
            }
        }
    }
    // Checked as the node will check it (with a stand-in placement, which the node sets).
    let mut check = annotations.clone();
    check.insert(GPUS.to_owned(), "1".to_owned());
    check.insert(GPU_MEMORY.to_owned(), "1".to_owned());
    VgpuRequest::from_annotations(check.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(
        |e| {
            let field = e
                .annotation
                .trim_start_matches(gpuplex_wire::annotations::PREFIX);
            format!("{field}: `{}` {}", shown(&e.value), e.reason)
        },
    )?;
    Ok(annotations)
}

#[cfg(test)]
mod tests;
