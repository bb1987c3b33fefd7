//! [`NodeStatus`]: what `gpuplexctl status`, `top` and the metrics endpoint show.
//!
//! The node fills what it knows; the node service adds what only it can see (the node's name,
//! the activity source, which GPUs are fake, how long each container was actually frozen).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Node, VgpuRecord};
use crate::request::{Priority, POD_NAMESPACE_KEYS, POD_NAME_KEYS};
use crate::windows::RunState;
use crate::Instant;

/// A snapshot of the node for people and tools.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The node's name (filled by the node service).
    #[serde(default)]
    pub node: String,
    /// The activity source in use: `nvml`, `cpu` or `always` (filled by the node service).
    #[serde(default)]
    pub activity: String,
    /// What containers get of the GPUs' CDI spec, in words (filled by the node service).
    #[serde(default)]
    pub cdi: String,
    /// Every GPU, by index.
    pub gpus: Vec<GpuStatus>,
    /// Every container attached to a vGPU, by vGPU id.
    pub containers: Vec<ContainerStatus>,
    /// Every reservation no container is attached to yet, by vGPU id.
    pub reservations: Vec<ReservationStatus>,
}

/// One GPU in a [`NodeStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    /// Host index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// Memory in bytes.
    pub memory: u64,
    /// Declared in `[[fake_gpu]]` rather than found by NVML (filled by the node service).
    #[serde(default)]
    pub fake: bool,
    /// What entitlements may hold on it in all, in bytes: its memory × `memory_overcommit`
    /// (what a cluster scheduler counts). Absent from older services' status: 0.
    #[serde(default)]
    pub capacity: u64,
    /// Still usable: its device node is there and NVML (when it found it) still reports it
    /// (filled by the node service). Absent from older services' status: true.
    #[serde(default = "healthy_by_default")]
    pub healthy: bool,
    /// Memory no entitlement holds, in bytes.
    pub unreserved: u64,
    /// The container holding its window.
    pub holder: Option<String>,
    /// Seconds some container ran on it with work.
    pub busy_seconds: f64,
    /// Windows passed from one container to another.
    pub switches: u64,
    /// The containers bound to it.
    pub containers: Vec<String>,
    /// The vGPU ids of the reservations on it that no container has attached to yet.
    pub reservations: Vec<String>,
}

/// What an attached container is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerState {
    /// Running, with work.
    Running,
    /// Frozen, waiting for a window.
    Frozen,
    /// Running, without work.
    Idle,
    /// Paused by its user (held): the scheduler leaves it alone until it is resumed.
    Paused,
    /// A stop signal is pending: thawed and out of windows until it exits (or its graceful
    /// stop's grace ends).
    Stopping,
}

impl ContainerState {
    /// The state as written in JSON.
    pub fn name(self) -> &'static str {
        match self {
            ContainerState::Running => "running",
            ContainerState::Frozen => "frozen",
            ContainerState::Idle => "idle",
            ContainerState::Paused => "paused",
            ContainerState::Stopping => "stopping",
        }
    }
}

/// One container in a [`NodeStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContainerStatus {
    /// The container's id.
    pub id: String,
    /// Its vGPU's id (`vgpu-7`).
    pub vgpu: String,
    /// Its GPUs' indexes.
    pub gpus: Vec<u32>,
    /// Its memory entitlement on each of its GPUs, in bytes.
    pub memory: Vec<u64>,
    /// Share weight.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
    /// What it is doing.
    pub state: ContainerState,
    /// GPU seconds received, summed over its GPUs.
    pub gpu_seconds: f64,
    /// Seconds spent waiting for a window, the current wait included.
    pub wait_seconds: f64,
    /// How long its current wait has lasted (0 when not waiting).
    pub waiting_seconds: f64,
    /// Seconds its cgroup was actually frozen (filled by the node service).
    #[serde(default)]
    pub frozen_seconds: f64,
    /// Windows received.
    pub windows: u64,
    /// Its lag in seconds of GPU time, summed over its GPUs: what it is owed (positive) or has
    /// had ahead of its weighted share (negative) against the others with work there; while
    /// idle, what it keeps for its next work. Absent from older services' status: 0.
    #[serde(default)]
    pub lag_seconds: f64,
    /// The median of its completed waits for a window, in seconds (within about 3%; 0 before
    /// one has ended). Kept since the node service started. Absent from older services'
    /// status: 0.
    #[serde(default)]
    pub wait_p50_seconds: f64,
    /// The 99th percentile of its completed waits, in seconds, likewise.
    #[serde(default)]
    pub wait_p99_seconds: f64,
    /// Its Kubernetes pod, when its annotations name one.
    pub pod: Option<String>,
    /// Its Kubernetes namespace, when its annotations name one.
    pub namespace: Option<String>,
    /// The ResourceClaim (uid) or device plugin allocation (`units-...`) its vGPU is pinned
    /// for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// One reservation in a [`NodeStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReservationStatus {
    /// Its vGPU's id.
    pub vgpu: String,
    /// Its GPUs' indexes.
    pub gpus: Vec<u32>,
    /// Its memory entitlement on each of its GPUs, in bytes.
    pub memory: Vec<u64>,
    /// Share weight.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
    /// Seconds until it lapses unless a container attaches (0 for a claim's, which never
    /// lapses).
    pub expires_in_seconds: f64,
    /// The Kubernetes ResourceClaim (uid) it is pinned for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

impl Node {
    /// What `gpuplexctl status` shows, as of the last decision.
    pub fn status(&self, now: Instant) -> NodeStatus {
        let gpus = self
            .inventory
            .gpus()
            .iter()
            .map(|gpu| {
                let view = self.windows.gpu(gpu.index);
                let on_gpu = || {
                    self.records
                        .values()
                        .filter(move |r| r.assignment.gpus.contains(&gpu.index))
                };
                GpuStatus {
                    index: gpu.index.0,
                    uuid: gpu.uuid.clone(),
                    model: gpu.model.clone(),
                    memory: gpu.memory,
                    fake: false,
                    capacity: self.inventory.limit(gpu.index),
                    healthy: true,
                    unreserved: self.inventory.unreserved(gpu.index),
                    holder: view
                        .as_ref()
                        .and_then(|v| v.holder)
                        .and_then(|h| self.records.get(&h))
                        .and_then(|r| r.attachment())
                        .map(|a| a.container.clone()),
                    busy_seconds: view
                        .as_ref()
                        .map_or(0.0, |v| v.stats.busy_time.as_secs_f64()),
                    switches: view.as_ref().map_or(0, |v| v.stats.switches),
                    containers: on_gpu()
                        .flat_map(|r| r.containers().map(str::to_owned))
                        .collect(),
                    reservations: on_gpu()
                        .filter(|r| r.attachments.is_empty())
                        .map(|r| r.id.to_string())
                        .collect(),
                }
            })
            .collect();
        let mut containers = Vec::new();
        let mut reservations = Vec::new();
        for r in self.records.values() {
            let memory = self.memory_of(r);
            if r.attachments.is_empty() {
                let lapses_at = r.reserved_at + self.config.reservation_ttl;
                reservations.push(ReservationStatus {
                    vgpu: r.id.to_string(),
                    gpus: r.assignment.gpus.iter().map(|g| g.0).collect(),
                    memory,
                    weight: r.request.weight,
                    priority: r.request.priority,
                    expires_in_seconds: match r.claim {
                        Some(_) => 0.0,
                        None => lapses_at.saturating_since(now).as_secs_f64(),
                    },
                    claim: r.claim.clone(),
                });
                continue;
            }
            let view = self.windows.vgpu(r.id);
            let state = match &view {
                Some(v) if v.state == RunState::Held => ContainerState::Paused,
                Some(v) if v.state == RunState::Stopping => ContainerState::Stopping,
                Some(v) if v.state == RunState::Frozen => ContainerState::Frozen,
                Some(v) if v.has_work => ContainerState::Running,
                _ => ContainerState::Idle,
            };
            let stats = view.as_ref().map(|v| v.stats.clone()).unwrap_or_default();
            let lag_seconds = view.as_ref().map_or(0.0, |v| v.lag_seconds);
            let waiting = view
                .as_ref()
                .and_then(|v| v.waiting_since)
                .map_or(Duration::ZERO, |since| now.saturating_since(since));
            let (p50, p99) = (stats.waits.quantile(0.5), stats.waits.quantile(0.99));
            let (p50, p99) = (p50.as_secs_f64(), p99.as_secs_f64());
            // The containers sharing a claim's vGPU each show the vGPU's windows and time.
            containers.extend(r.containers().map(|container| ContainerStatus {
                id: container.to_owned(),
                vgpu: r.id.to_string(),
                gpus: r.assignment.gpus.iter().map(|g| g.0).collect(),
                memory: memory.clone(),
                weight: r.request.weight,
                priority: r.request.priority,
                state,
                gpu_seconds: stats.gpu_time.as_secs_f64(),
                wait_seconds: (stats.wait_time + waiting).as_secs_f64(),
                waiting_seconds: waiting.as_secs_f64(),
                frozen_seconds: 0.0,
                windows: stats.windows,
                lag_seconds,
                wait_p50_seconds: p50,
                wait_p99_seconds: p99,
                pod: first_annotation(r, &POD_NAME_KEYS),
                namespace: first_annotation(r, &POD_NAMESPACE_KEYS),
                claim: r.claim.clone(),
            }));
        }
        NodeStatus {
            node: String::new(),
            activity: String::new(),
            cdi: String::new(),
            gpus,
            containers,
            reservations,
        }
    }

    fn memory_of(&self, r: &VgpuRecord) -> Vec<u64> {
        r.assignment
            .gpus
            .iter()
            .map(|&g| self.inventory.entitlement(r.id, g).unwrap_or(0))
            .collect()
    }
}

fn first_annotation(r: &VgpuRecord, keys: &[&str]) -> Option<String> {
    keys.iter()
        .find_map(|k| r.annotations.get(*k))
        .filter(|v| !v.is_empty())
        .cloned()
}

fn healthy_by_default() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::accounting::VgpuStats;
    use crate::config::SchedulerConfig;
    use crate::inventory::Gpu;
    use crate::node::{Attachment, Target};
    use crate::{GpuIndex, Handle};

    #[test]
    fn wait_quantiles_come_from_the_vgpu_histogram_and_default_to_zero() {
        let gpu = Gpu {
            index: GpuIndex(0),
            uuid: "GPU-0".into(),
            model: "NVIDIA A100-SXM4-40GB".into(),
            memory: 40 << 30,
        };
        let mut n = Node::new(vec![gpu], SchedulerConfig::default()).unwrap();
        let attachment = Attachment {
            container: "c".into(),
            target: Target::Pid(1),
        };
        let annotations = [("gpuplex.io/gpu-memory", "8Gi")];
        let handle = Handle::from_bytes([7; 16]);
        let v = n
            .register(annotations, handle, attachment, Instant::from_nanos(0))
            .unwrap()
            .id;
        let now = Instant::from_nanos(1);
        let c = &n.status(now).containers[0];
        assert_eq!((c.wait_p50_seconds, c.wait_p99_seconds), (0.0, 0.0));

        let mut stats = VgpuStats::default();
        for ms in 1..=100 {
            stats.waits.record(Duration::from_millis(ms));
        }
        assert!(n.carry_over_vgpu_stats(v, stats.clone()));
        let status = n.status(now);
        let c = &status.containers[0];
        assert_eq!(c.wait_p50_seconds, stats.waits.quantile(0.5).as_secs_f64());
        assert_eq!(c.wait_p99_seconds, stats.waits.quantile(0.99).as_secs_f64());
        assert!((c.wait_p50_seconds - 0.050).abs() < 0.050 * 0.03);
        assert!((c.wait_p99_seconds - 0.099).abs() < 0.099 * 0.03);

        // An older service's status, without them, reads as zero.
        let mut json = serde_json::to_value(&status).unwrap();
        let object = json["containers"][0].as_object_mut().unwrap();
        object.remove("wait_p50_seconds");
        object.remove("wait_p99_seconds");
        let back: NodeStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back.containers[0].wait_p50_seconds, 0.0);
        assert_eq!(back.containers[0].wait_p99_seconds, 0.0);
    }
}
