//! The replies of the node protocol.

use std::path::PathBuf;

use gpuplex_scheduler::node::{Node, NodeStatus, VgpuRecord};
use gpuplex_scheduler::request::Priority;
use gpuplex_scheduler::{Handle, Instant, VgpuId};
use serde::{Deserialize, Serialize};

use super::cdi::CdiEdits;

/// The reply to one request: what the request got, or why it got nothing.
///
/// On the wire it is one JSON object: `{"ok":true}` with `vgpu`, `status`, `events` or
/// `capacity` (or none of them: a release that found nothing), or
/// `{"ok":false,"error":"<one line>"}`. A client
/// reads the form its request is answered with ([`Reply::into_vgpu`], ...); any other form is
/// an answer it cannot read.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// The vGPU reserved, attached, registered, pinned, allocated, held, stopping or released.
    Vgpu(Box<VgpuReply>),
    /// Done, with nothing to tell (a release that found no vGPU).
    Done,
    /// The node's status.
    Status(Box<NodeStatus>),
    /// The window events asked for.
    Events(EventsReply),
    /// The node's capacity: the answer to `watch`, and each line a watcher is sent after it.
    Capacity(Box<CapacityView>),
    /// Not carried out; why, in one line.
    Refused(String),
}

/// A reply's line as written and read.
#[derive(Default, Serialize, Deserialize)]
struct WireReply {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vgpu: Option<Box<VgpuReply>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<Box<NodeStatus>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    events: Option<EventsReply>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    capacity: Option<Box<CapacityView>>,
}

impl Serialize for Reply {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let ok = WireReply {
            ok: true,
            ..WireReply::default()
        };
        let wire = match self.clone() {
            Reply::Vgpu(vgpu) => WireReply {
                vgpu: Some(vgpu),
                ..ok
            },
            Reply::Done => ok,
            Reply::Status(status) => WireReply {
                status: Some(status),
                ..ok
            },
            Reply::Events(events) => WireReply {
                events: Some(events),
                ..ok
            },
            Reply::Capacity(capacity) => WireReply {
                capacity: Some(capacity),
                ..ok
            },
            Reply::Refused(why) => WireReply {
                error: Some(why),
                ..WireReply::default()
            },
        };
        wire.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Reply {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Reply, D::Error> {
        let wire = WireReply::deserialize(deserializer)?;
        if !wire.ok {
            return Ok(Reply::refused(wire.error.unwrap_or_default()));
        }
        match (wire.vgpu, wire.status, wire.events, wire.capacity) {
            (None, None, None, None) => Ok(Reply::Done),
            (Some(vgpu), None, None, None) => Ok(Reply::Vgpu(vgpu)),
            (None, Some(status), None, None) => Ok(Reply::Status(status)),
            (None, None, Some(events), None) => Ok(Reply::Events(events)),
            (None, None, None, Some(capacity)) => Ok(Reply::Capacity(capacity)),
            _ => Err(serde::de::Error::custom(
                "a reply has at most one of `vgpu`, `status`, `events` and `capacity`",
            )),
        }
    }
}

/// What a kubelet plugin needs of the node, and all a watcher is sent (`watch`): each GPU's
/// size, room and health, and the claims and allocations pinned now. Each line is the whole
/// view, so a watcher that missed one (or a hundred) misses nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityView {
    /// Every GPU, by index.
    pub gpus: Vec<GpuCapacity>,
    /// The keys of the vGPUs pinned now, sorted: the ResourceClaims' uids (`pin`) and the device
    /// plugin's allocations (`units-...`, `allocate`), attached or not.
    pub claims: Vec<String>,
}

impl CapacityView {
    /// The view a node's status shows: what `watch` answers at the same instant. A GPU whose
    /// capacity a service older than `capacity` did not say (0) counts its memory.
    pub fn of_status(status: &NodeStatus) -> CapacityView {
        let gpus = (status.gpus.iter())
            .map(|g| GpuCapacity {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory: g.memory,
                capacity: if g.capacity > 0 { g.capacity } else { g.memory },
                unreserved: g.unreserved,
                healthy: g.healthy,
                fake: g.fake,
            })
            .collect();
        let reserved = status.reservations.iter().filter_map(|r| r.claim.clone());
        let attached = status.containers.iter().filter_map(|c| c.claim.clone());
        let mut claims: Vec<String> = reserved.chain(attached).collect();
        claims.sort();
        claims.dedup();
        CapacityView { gpus, claims }
    }
}

/// One GPU in a [`CapacityView`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuCapacity {
    /// Host index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// Memory in bytes.
    pub memory: u64,
    /// What entitlements may hold on it in all, in bytes: its memory × `memory_overcommit`.
    pub capacity: u64,
    /// What no entitlement holds of that, in bytes.
    pub unreserved: u64,
    /// Still usable: its device node is there and NVML (when it found it) still reports it.
    pub healthy: bool,
    /// Declared in `[[fake_gpu]]` rather than found by NVML.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fake: bool,
}

/// The answer to `events`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EventsReply {
    /// The number of the oldest event the node keeps.
    pub first: u64,
    /// The events asked for, oldest first.
    pub events: Vec<EventLine>,
}

/// One change of a GPU's window holder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventLine {
    /// Its number.
    pub seq: u64,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The GPU.
    pub gpu: u32,
    /// The vGPU that holds its window now (none: nobody).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuId>,
    /// Its container then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl EventsReply {
    /// The `events` answer of `node`, with each instant written by `at_ms`.
    pub fn of(node: &Node, since: u64, at_ms: impl Fn(Instant) -> u64) -> EventsReply {
        let (events, first) = node.events(since);
        EventsReply {
            first,
            events: events
                .into_iter()
                .map(|e| EventLine {
                    seq: e.seq,
                    at_ms: at_ms(e.at),
                    gpu: e.gpu,
                    vgpu: e.vgpu,
                    container: e.container,
                })
                .collect(),
        }
    }
}

impl Reply {
    /// A refusal, on one line (and never a silent one).
    pub fn refused(why: impl ToString) -> Reply {
        let why = why.to_string().replace(['\n', '\r'], " ");
        let why = why.trim();
        Reply::Refused(if why.is_empty() {
            "the gpuplex node service refused the request without saying why".into()
        } else {
            why.to_owned()
        })
    }

    /// A vGPU's reply.
    pub fn vgpu(vgpu: VgpuReply) -> Reply {
        Reply::Vgpu(Box::new(vgpu))
    }

    /// The reply as one line of JSON, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_else(|e| {
            serde_json::to_string(&Reply::refused(format!("the reply cannot be written: {e}")))
                .unwrap_or_default()
        });
        line.push('\n');
        line
    }

    /// Whether the request was carried out.
    pub fn is_ok(&self) -> bool {
        !matches!(self, Reply::Refused(_))
    }

    /// Why the request was refused, if it was.
    pub fn refusal(&self) -> Option<&str> {
        match self {
            Reply::Refused(why) => Some(why),
            _ => None,
        }
    }

    /// The vGPU of the reply, if it has one.
    pub fn into_vgpu(self) -> Option<VgpuReply> {
        match self {
            Reply::Vgpu(vgpu) => Some(*vgpu),
            _ => None,
        }
    }

    /// The status of the reply, if it is one.
    pub fn into_status(self) -> Option<NodeStatus> {
        match self {
            Reply::Status(status) => Some(*status),
            _ => None,
        }
    }

    /// The events of the reply, if it has them.
    pub fn into_events(self) -> Option<EventsReply> {
        match self {
            Reply::Events(events) => Some(events),
            _ => None,
        }
    }

    /// The capacity view of the reply, if it is one.
    pub fn into_capacity(self) -> Option<CapacityView> {
        match self {
            Reply::Capacity(capacity) => Some(*capacity),
            _ => None,
        }
    }
}

/// What a client learns of a vGPU: enough for the hook to edit a spec and write the identity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VgpuReply {
    /// Its id (`vgpu-7`).
    pub id: VgpuId,
    /// Its handle, only in the reply to the request that reserved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<Handle>,
    /// Its container, once attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// Its GPUs.
    pub gpus: Vec<AssignedGpu>,
    /// Share weight.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
    /// The edits of the GPUs' CDI spec for its GPUs, in the replies to `reserve` and
    /// `register` on a node that has a spec of its CDI kind; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi: Option<CdiEdits>,
}

/// One GPU of a vGPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AssignedGpu {
    /// Host index.
    pub index: u32,
    /// UUID (what `CUDA_VISIBLE_DEVICES` takes).
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// The vGPU's memory entitlement on it, in bytes.
    pub memory: u64,
    /// Its device node on the host (filled by the node service, which knows the devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceNode>,
    /// Whether it is a `[[fake_gpu]]` (filled by the node service).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fake: bool,
}

/// A character device node on the host: a GPU's, as the node service names it, or a control
/// node ([`crate::vgpu_edits::control_nodes`]); [`crate::vgpu_edits`] gives it to a container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Its path on the host (`/dev/nvidia0`).
    pub path: PathBuf,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

impl VgpuReply {
    /// What the node tells of the vGPU of `record`: no handle, CDI edits or device nodes (the
    /// node service adds those it may show).
    pub fn of(node: &Node, record: &VgpuRecord) -> VgpuReply {
        let gpus = record
            .assignment
            .gpus
            .iter()
            .filter_map(|&index| {
                let gpu = node.inventory().gpu(index)?;
                Some(AssignedGpu {
                    index: index.0,
                    uuid: gpu.uuid.clone(),
                    model: gpu.model.clone(),
                    memory: record.assignment.memory.bytes_on(gpu.memory),
                    device: None,
                    fake: false,
                })
            })
            .collect();
        VgpuReply {
            id: record.id,
            handle: None,
            container: record.attachment().map(|a| a.container.clone()),
            gpus,
            weight: record.request.weight,
            priority: record.request.priority,
            cdi: None,
        }
    }
}
