//! The node protocol: one JSON object per line on the node socket, each request answered by one
//! reply line.
//!
//! ```text
//! {"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"8Gi"}}
//! {"op":"attach","handle":"<32 hex digits>","container":"c0ffee","pid":4242,"unstarted":true}
//! {"op":"attach","handle":"<32 hex digits>","container":"c0ffee","pid":4242,"unstarted":true,"annotations":{"gpuplex.io/weight":"2"}}
//! {"op":"register","annotations":{"gpuplex.io/weight":"2"},"container":"job-7","cgroup":"/sys/fs/cgroup/freezer/jobs/7"}
//! {"op":"release","handle":"<32 hex digits>"}     (or "container":"c0ffee", or "vgpu":"vgpu-1")
//! {"op":"hold","container":"c0ffee"}               (or "vgpu":"vgpu-1")
//! {"op":"unhold","container":"c0ffee"}             (or "vgpu":"vgpu-1")
//! {"op":"stopping","container":"c0ffee","signal":"SIGTERM"}   (SIGTERM, SIGINT, SIGQUIT or SIGKILL)
//! {"op":"pin","claim":"<uid>","gpus":[0],"memory":8589934592,"annotations":{"gpuplex.io/weight":"2"}}
//! {"op":"release","claim":"<uid>"}
//! {"op":"allocate","units":["gpu-1-0","gpu-1-1"],"unit":1073741824}
//! {"op":"status"}
//! {"op":"events","since":41}
//! ```
//!
//! `events` answers the changes of each GPU's window holder numbered above `since` (0: all
//! kept), oldest first, with `first`, the number of the oldest the node still keeps (a bounded
//! buffer, [`crate::node::events::EVENTS_KEPT`]): a client that polls with the last number it
//! saw misses nothing unless `first` is above it plus one.
//!
//! `allocate` is the device plugin's (clusters without DRA): the kubelet gave a container these
//! units of `gpuplex.io/gpu-memory`, each `unit` bytes; the node pins their vGPU on their GPU as
//! `pin` does, under the claim key `units-<lowest unit>`, first releasing allocations that held any
//! of them (see [`crate::node::Node::allocate`]). The same units again answer with the same vGPU
//! and its handle. An `attach` with `annotations` (the weight, priority and pod of the container)
//! is an allocation's container's: its first container sets them (see
//! [`crate::node::Node::attach_asking`]); any other vGPU refuses them.
//!
//! `pin` is the DRA driver's: kube-scheduler allocated a ResourceClaim (its `uid`) on these
//! GPUs with this much memory on each, and the node reserves exactly that, never lapsing, until
//! the claim is released (see [`crate::node::Node::pin`]). Pinning the same claim again, placed
//! the same way, answers with the same vGPU and its handle: the handle is the claim's, and only
//! the driver, as root on the node socket, sends `pin` (no hook or shim request makes one).
//!
//! `stopping` says a container is being sent a stop signal (the containerd shim's `Kill`): it
//! is thawed and kept out of windows so that the signal is taken (see
//! [`crate::windows::WindowScheduler::stop`]).
//!
//! `reserve` (and a `register` that reserves) answers with the new vGPU's `handle`: the only
//! thing `attach` accepts, and what a hook or the shim releases with when it undoes its own
//! reservation. A vGPU id names a vGPU and grants nothing; a container never chooses either
//! (its annotations may not carry them: [`crate::request::SET_BY_GPUPLEX`]). A reply never
//! carries the handle of a vGPU the request did not reserve.
//!
//! A `pid` names a container's init; with `"unstarted":true` (podman's and runc's
//! `createRuntime` hook, the containerd shim: between the runtime's `create` and `start`) the
//! node service schedules it from the moment that process runs another program (the
//! container's), and never freezes it before. Without it (`gpuplexctl register --pid` of a
//! running process), and for a `cgroup`, it is scheduled from its first sample.
//!
//! `hold` says the container's user paused it (`ctr task pause`, `runc pause`): until `unhold`
//! (its user resumed it) it takes no part in scheduling and is never frozen or thawed by the
//! node (see [`crate::windows::WindowScheduler::hold`]). Both are idempotent; the container must
//! be attached.
//!
//! Clients write their requests with [`Request::to_line`], the same type this module reads, so
//! the two ends cannot disagree on a field; [`parse_request`] reads back every line it writes.
//!
//! A reply is `{"ok":true,...}` with `vgpu` (reserve, attach, register, hold, unhold; release:
//! the released one, absent when there was none) or `status`, or
//! `{"ok":false,"error":"<one line>"}`. A line
//! longer than [`MAX_LINE`] bytes, malformed JSON, an unknown operation or an unknown field gets
//! an error reply; none of them changes anything.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::node::{
    Attachment, Node, NodeError, NodeStatus, Placement, ReleaseKey, Target, VgpuRecord,
};
use crate::quantity::shown;
use crate::request::Priority;
use crate::units::UnitId;
use crate::windows::StopSignal;
use crate::{GpuIndex, Handle, Instant, VgpuId};

pub mod cdi;

use cdi::CdiEdits;

/// The longest request line accepted, in bytes (without its newline).
pub const MAX_LINE: usize = 64 * 1024;

/// The operations, as written in `op`.
pub const OPERATIONS: [&str; 11] = [
    "reserve", "attach", "register", "release", "hold", "unhold", "stopping", "pin", "allocate",
    "status", "events",
];

/// The signals a `stopping` request names, and what each is to the scheduler; a request is
/// written with the first name of its kind.
pub const STOP_SIGNALS: [(&str, StopSignal); 4] = [
    ("SIGTERM", StopSignal::Graceful),
    ("SIGINT", StopSignal::Graceful),
    ("SIGQUIT", StopSignal::Graceful),
    ("SIGKILL", StopSignal::Kill),
];

/// A request on the node socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Reserve a vGPU for a container that does not exist yet.
    Reserve {
        /// The container's annotations (only `gpuplex.io/` ones matter).
        annotations: BTreeMap<String, String>,
    },
    /// Attach a container to its reservation.
    Attach {
        /// The reservation's handle.
        handle: Handle,
        /// The container.
        attachment: Attachment,
        /// Its init has not started the container's program yet (see the module doc).
        unstarted: bool,
        /// What an allocation's container asks for its vGPU: `gpuplex.io/weight`,
        /// `gpuplex.io/priority` and its pod's name and namespace; empty for any other.
        asked: BTreeMap<String, String>,
    },
    /// Reserve and attach at once.
    Register {
        /// The container's annotations.
        annotations: BTreeMap<String, String>,
        /// The container.
        attachment: Attachment,
        /// Its init has not started the container's program yet.
        unstarted: bool,
    },
    /// Release a vGPU.
    Release(ReleaseKey),
    /// Hold a container its user paused (`held`), or release the hold (it was resumed).
    Hold {
        /// The container, or its vGPU.
        key: ReleaseKey,
        /// `hold` (true) or `unhold` (false).
        held: bool,
    },
    /// The container is being sent a stop signal.
    Stopping {
        /// The container, or its vGPU.
        key: ReleaseKey,
        /// Which.
        signal: StopSignal,
    },
    /// Pin a vGPU for a ResourceClaim where the cluster's scheduler placed it.
    Pin {
        /// The claim's uid.
        claim: String,
        /// Its GPUs and the memory on each.
        placement: Placement,
        /// Its weight and priority as annotations (`gpuplex.io/weight`, `gpuplex.io/priority`),
        /// and its pod's namespace.
        annotations: BTreeMap<String, String>,
    },
    /// Pin the vGPU of the device plugin's units that the kubelet gave one container.
    Allocate {
        /// The units, all on one GPU.
        units: Vec<UnitId>,
        /// One unit's size in bytes.
        unit: u64,
    },
    /// The node's status.
    Status,
    /// The window events numbered above `since`.
    Events {
        /// The last number the client saw (0: none).
        since: u64,
    },
}

impl Request {
    /// The request as one line of JSON, newline included: what a client sends, and what
    /// [`parse_request`] reads back (without the newline) as this same request.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("a request always serializes");
        line.push('\n');
        line
    }

    /// The request as its line's fields.
    fn wire(&self) -> WireRequest<'_> {
        match self {
            Request::Reserve { annotations } => WireRequest {
                annotations: Some(annotations),
                ..WireRequest::op("reserve")
            },
            Request::Attach {
                handle,
                attachment,
                unstarted,
                asked,
            } => WireRequest {
                handle: Some(handle.to_string()),
                unstarted: *unstarted,
                annotations: (!asked.is_empty()).then_some(asked),
                ..WireRequest::op("attach").attached(attachment)
            },
            Request::Register {
                annotations,
                attachment,
                unstarted,
            } => WireRequest {
                annotations: Some(annotations),
                unstarted: *unstarted,
                ..WireRequest::op("register").attached(attachment)
            },
            Request::Release(key) => WireRequest::op("release").keyed(key),
            Request::Hold { key, held } => {
                WireRequest::op(if *held { "hold" } else { "unhold" }).keyed(key)
            }
            Request::Stopping { key, signal } => WireRequest {
                signal: STOP_SIGNALS
                    .iter()
                    .find(|(_, s)| s == signal)
                    .map(|(name, _)| *name),
                ..WireRequest::op("stopping").keyed(key)
            },
            Request::Pin {
                claim,
                placement,
                annotations,
            } => WireRequest {
                claim: Some(claim),
                gpus: Some(placement.gpus.iter().map(|g| g.0).collect()),
                memory: Some(placement.memory),
                annotations: Some(annotations),
                ..WireRequest::op("pin")
            },
            Request::Allocate { units, unit } => WireRequest {
                units: Some(units.iter().map(UnitId::to_string).collect()),
                unit: Some(*unit),
                ..WireRequest::op("allocate")
            },
            Request::Status => WireRequest::op("status"),
            Request::Events { since } => WireRequest {
                since: Some(*since),
                ..WireRequest::op("events")
            },
        }
    }
}

impl Serialize for Request {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.wire().serialize(serializer)
    }
}

/// A request's line as written: `op` first, then the fields its operation takes.
#[derive(Default, Serialize)]
struct WireRequest<'a> {
    op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<&'a BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    handle: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vgpu: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    container: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cgroup: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unstarted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    signal: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claim: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpus: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    units: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    since: Option<u64>,
}

impl<'a> WireRequest<'a> {
    fn op(op: &'static str) -> WireRequest<'a> {
        WireRequest {
            op,
            ..WireRequest::default()
        }
    }

    /// With the container and its pid or cgroup.
    fn attached(mut self, attachment: &'a Attachment) -> WireRequest<'a> {
        self.container = Some(&attachment.container);
        match &attachment.target {
            Target::Pid(pid) => self.pid = Some(*pid),
            Target::Cgroup(path) => self.cgroup = Some(path),
        }
        self
    }

    /// With the vGPU, container or handle `key` names.
    fn keyed(mut self, key: &'a ReleaseKey) -> WireRequest<'a> {
        match key {
            ReleaseKey::Vgpu(vgpu) => self.vgpu = Some(vgpu.to_string()),
            ReleaseKey::Container(container) => self.container = Some(container),
            ReleaseKey::Handle(handle) => self.handle = Some(handle.to_string()),
            ReleaseKey::Claim(claim) => self.claim = Some(claim),
        }
        self
    }
}

/// A request line that cannot be read. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Over [`MAX_LINE`].
    #[error("request of {len} bytes is over the limit of {max} bytes")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not JSON, or not an object.
    #[error("request is not a JSON object: {}", shown(.0))]
    Json(String),
    /// No `op`, or one that is not known.
    #[error("unknown operation {}: expected \"op\" to be one of reserve, attach, register, release, hold, unhold, stopping, pin, allocate, status, events", shown(.0))]
    UnknownOp(String),
    /// A field that is missing, unknown, or of the wrong type.
    #[error("{op}: {}", shown(.message))]
    Field {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// The reply to one request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request was carried out.
    pub ok: bool,
    /// Why not, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The vGPU reserved, attached, registered or released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<VgpuReply>,
    /// The node's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<NodeStatus>,
    /// The window events asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<EventsReply>,
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
    /// When, in milliseconds since the Unix epoch (the node service's answer; [`Node::handle`]
    /// gives the node's own clock).
    pub at_ms: u64,
    /// The GPU.
    pub gpu: u32,
    /// The vGPU that holds its window now (none: nobody).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<String>,
    /// Its container then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl Node {
    /// The `events` answer, with each instant written by `at_ms`.
    pub fn events_reply(&self, since: u64, at_ms: impl Fn(Instant) -> u64) -> EventsReply {
        let (events, first) = self.events(since);
        EventsReply {
            first,
            events: events
                .into_iter()
                .map(|e| EventLine {
                    seq: e.seq,
                    at_ms: at_ms(e.at),
                    gpu: e.gpu,
                    vgpu: e.vgpu.map(|v| v.to_string()),
                    container: e.container,
                })
                .collect(),
        }
    }
}

impl Reply {
    /// An error reply.
    pub fn error(message: impl ToString) -> Reply {
        Reply {
            ok: false,
            error: Some(message.to_string().replace('\n', " ")),
            ..Reply::default()
        }
    }

    /// The reply as one line of JSON, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).expect("a reply always serializes");
        line.push('\n');
        line
    }
}

/// What a client learns of a vGPU: enough for the hook to edit a spec and write the identity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VgpuReply {
    /// Its id (`vgpu-7`).
    pub id: String,
    /// Its handle ([`Handle`]), only in the reply to the request that reserved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
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

/// A character device node on the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Its path on the host (`/dev/nvidia0`).
    pub path: String,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

/// Reads one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, ProtocolError> {
    if line.len() > MAX_LINE {
        return Err(ProtocolError::TooLong {
            len: line.len(),
            max: MAX_LINE,
        });
    }
    let value: Value =
        serde_json::from_slice(line).map_err(|e| ProtocolError::Json(e.to_string()))?;
    let Value::Object(mut fields) = value else {
        return Err(ProtocolError::Json(format!("got {}", json_kind(&value))));
    };
    let op = match fields.remove("op") {
        Some(Value::String(op)) => OPERATIONS
            .into_iter()
            .find(|o| *o == op)
            .ok_or_else(|| ProtocolError::UnknownOp(format!("`{op}`")))?,
        Some(other) => return Err(ProtocolError::UnknownOp(other.to_string())),
        None => return Err(ProtocolError::UnknownOp("(no \"op\")".into())),
    };
    let field = |message: String| ProtocolError::Field { op, message };
    let rest = Value::Object(fields);
    let read = |value: Value| -> Result<Fields, ProtocolError> {
        serde_json::from_value(value).map_err(|e| field(e.to_string()))
    };
    match op {
        "reserve" => {
            let f: ReserveFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Reserve {
                annotations: f.annotations,
            })
        }
        "attach" => {
            let f = read(rest)?;
            let handle = f
                .handle
                .as_deref()
                .ok_or_else(|| field("missing field `handle`".into()))?;
            let handle = handle.parse().map_err(|e| field(format!("handle: {e}")))?;
            let attachment = f.attachment().map_err(field)?;
            Ok(Request::Attach {
                handle,
                attachment,
                unstarted: f.unstarted,
                asked: f.annotations.unwrap_or_default(),
            })
        }
        "register" => {
            let f = read(rest)?;
            if f.handle.is_some() {
                return Err(field(
                    "unknown field `handle`: register reserves one".into(),
                ));
            }
            let attachment = f.attachment().map_err(field)?;
            Ok(Request::Register {
                annotations: f.annotations.unwrap_or_default(),
                attachment,
                unstarted: f.unstarted,
            })
        }
        "release" | "hold" | "unhold" | "stopping" => {
            let mut rest = rest;
            let signal = match op {
                "stopping" => {
                    let signal = rest.as_object_mut().and_then(|o| o.remove("signal"));
                    Some(stop_signal(signal).map_err(field)?)
                }
                _ => None,
            };
            let f: ReleaseFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            let key = match (f.vgpu, f.container, f.handle, f.claim) {
                (Some(v), None, None, None) => {
                    ReleaseKey::Vgpu(v.parse().map_err(|e| field(format!("vgpu: {e}")))?)
                }
                (None, Some(c), None, None) => ReleaseKey::Container(c),
                (None, None, Some(h), None) => {
                    ReleaseKey::Handle(h.parse().map_err(|e| field(format!("handle: {e}")))?)
                }
                (None, None, None, Some(c)) => ReleaseKey::Claim(c),
                _ => {
                    return Err(field(
                        "give exactly one of `vgpu`, `container`, `handle` and `claim`".into(),
                    ))
                }
            };
            Ok(match (op, signal) {
                ("release", _) => Request::Release(key),
                (_, Some(signal)) => Request::Stopping { key, signal },
                _ => Request::Hold {
                    key,
                    held: op == "hold",
                },
            })
        }
        "pin" => {
            let f: PinFields = serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Pin {
                claim: f.claim,
                placement: Placement {
                    gpus: f.gpus.into_iter().map(GpuIndex).collect(),
                    memory: f.memory,
                },
                annotations: f.annotations,
            })
        }
        "allocate" => {
            let f: AllocateFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            if f.units.len() > MAX_UNITS {
                return Err(field(format!(
                    "{} units; at most {MAX_UNITS} make one allocation",
                    f.units.len()
                )));
            }
            let units = (f.units.iter().map(|u| u.parse()))
                .collect::<Result<Vec<UnitId>, _>>()
                .map_err(|e: crate::units::UnitsError| field(e.to_string()))?;
            if f.unit == 0 {
                return Err(field("unit must be above 0 bytes".into()));
            }
            Ok(Request::Allocate {
                units,
                unit: f.unit,
            })
        }
        "events" => {
            let f: EventsFields = serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Events { since: f.since })
        }
        _ => {
            serde_json::from_value::<StatusFields>(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Status)
        }
    }
}

/// The `signal` of a `stopping` request.
fn stop_signal(value: Option<Value>) -> Result<StopSignal, String> {
    let name = value.as_ref().and_then(Value::as_str);
    let known = STOP_SIGNALS.iter().find(|(n, _)| Some(*n) == name);
    match (known, name) {
        (Some((_, signal)), _) => Ok(*signal),
        (None, Some(other)) => Err(format!(
            "signal `{other}` is not a stop signal: expected SIGTERM, SIGINT, SIGQUIT or SIGKILL"
        )),
        (None, None) => Err("missing field `signal` (SIGTERM, SIGINT, SIGQUIT or SIGKILL)".into()),
    }
}

/// How a JSON value reads in a one-line message: `a string`, `an array`, ... (also the hook's
/// spec editor's wording).
pub fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveFields {
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    #[serde(default)]
    handle: Option<String>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    container: String,
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    cgroup: Option<String>,
    #[serde(default)]
    unstarted: bool,
}

impl Fields {
    fn attachment(&self) -> Result<Attachment, String> {
        let target = match (self.pid, &self.cgroup) {
            (Some(pid), None) if pid > 0 => Target::Pid(pid),
            (None, Some(path)) if path.starts_with('/') => Target::Cgroup(path.clone()),
            (Some(_), None) => return Err("pid must be above 0".into()),
            (None, Some(path)) => return Err(format!("cgroup `{path}` is not an absolute path")),
            _ => return Err("give exactly one of `pid` and `cgroup`".into()),
        };
        Ok(Attachment {
            container: self.container.clone(),
            target,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseFields {
    #[serde(default)]
    vgpu: Option<String>,
    #[serde(default)]
    container: Option<String>,
    #[serde(default)]
    handle: Option<String>,
    #[serde(default)]
    claim: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PinFields {
    claim: String,
    gpus: Vec<u32>,
    memory: u64,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllocateFields {
    units: Vec<String>,
    unit: u64,
}

/// The most units one `allocate` names (a line holds about 6,000 at most anyway).
pub const MAX_UNITS: usize = 4096;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusFields {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsFields {
    #[serde(default)]
    since: u64,
}

impl Node {
    /// Carries out one request and says how it went; a reservation it makes gets `fresh` as
    /// its handle (the caller's random draw), and only then does the reply carry one.
    pub fn handle(&mut self, request: Request, fresh: Handle, now: Instant) -> Reply {
        // Only a request that reserves shows a handle, and only the one it reserved with; a pin
        // shows its claim's (see the module doc).
        let pinning = matches!(request, Request::Pin { .. } | Request::Allocate { .. });
        let reserving =
            pinning || matches!(request, Request::Reserve { .. } | Request::Register { .. });
        let done = |node: &Node, result: Result<VgpuId, NodeError>| match result {
            Ok(vgpu) => Reply {
                ok: true,
                vgpu: node.record(vgpu).map(|r| {
                    let mut reply = node.vgpu_reply(r);
                    if pinning || (reserving && r.handle == fresh) {
                        reply.handle = Some(r.handle.to_string());
                    }
                    reply
                }),
                ..Reply::default()
            },
            Err(e) => Reply::error(e),
        };
        match request {
            Request::Reserve { annotations } => {
                let result = self
                    .reserve(
                        annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                        fresh,
                        now,
                    )
                    .map(|r| r.id);
                done(self, result)
            }
            Request::Attach {
                handle,
                attachment,
                asked,
                ..
            } => {
                let result = self
                    .attach_asking(&handle, attachment, &asked, now)
                    .map(|r| r.id);
                done(self, result)
            }
            Request::Register {
                annotations,
                attachment,
                ..
            } => {
                let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
                let result = self.register(pairs, fresh, attachment, now).map(|r| r.id);
                done(self, result)
            }
            Request::Release(key) => {
                let released = self.release(&key, now);
                Reply {
                    ok: true,
                    vgpu: released.map(|r| self.vgpu_reply(&r.record)),
                    ..Reply::default()
                }
            }
            Request::Hold { key, held } => {
                let result = self.hold(&key, held, now);
                done(self, result)
            }
            Request::Stopping { key, signal } => {
                let result = self.attached(&key).inspect(|&v| {
                    self.stopping(v, signal, now);
                });
                done(self, result)
            }
            Request::Pin {
                claim,
                placement,
                annotations,
            } => {
                let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
                let result = self
                    .pin(&claim, pairs, &placement, fresh, now)
                    .map(|r| r.id);
                done(self, result)
            }
            Request::Allocate { units, unit } => {
                let result = self.allocate(&units, unit, fresh, now).map(|a| a.vgpu);
                done(self, result)
            }
            Request::Status => Reply {
                ok: true,
                status: Some(self.status(now)),
                ..Reply::default()
            },
            Request::Events { since } => Reply {
                ok: true,
                events: Some(self.events_reply(since, |at| at.as_nanos() / 1_000_000)),
                ..Reply::default()
            },
        }
    }

    /// What a client learns of a vGPU.
    pub fn vgpu_reply(&self, record: &VgpuRecord) -> VgpuReply {
        let gpus = record
            .assignment
            .gpus
            .iter()
            .filter_map(|&index| {
                let gpu = self.inventory().gpu(index)?;
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
            id: record.id.to_string(),
            handle: None,
            container: record.attachment().map(|a| a.container.clone()),
            gpus,
            weight: record.request.weight,
            priority: record.request.priority,
            cdi: None,
        }
    }
}

#[cfg(test)]
mod tests;
