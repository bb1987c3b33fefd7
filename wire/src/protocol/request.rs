//! The requests of the node protocol, and how a client writes them.

use std::collections::BTreeMap;

use gpuplex_scheduler::node::{Attachment, Placement, ReleaseKey, Target};
use gpuplex_scheduler::quantity::shown;
use gpuplex_scheduler::units::UnitId;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;
use serde::Serialize;

/// The longest request line accepted, in bytes (without its newline).
pub const MAX_LINE: usize = 64 * 1024;

/// The operations, as written in `op`.
pub const OPERATIONS: [&str; 12] = [
    "reserve", "attach", "register", "release", "hold", "unhold", "stopping", "pin", "allocate",
    "status", "events", "watch",
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
    /// The node's capacity now, and on the socket again each time it changes (see the module
    /// doc): the connection carries nothing else from then on.
    Watch,
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
            Request::Watch => WireRequest::op("watch"),
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
    #[error("unknown operation {}: expected \"op\" to be one of reserve, attach, register, release, hold, unhold, stopping, pin, allocate, status, events, watch", shown(.0))]
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
