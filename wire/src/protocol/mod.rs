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
//! {"op":"watch"}
//! ```
//!
//! `events` answers the changes of each GPU's window holder numbered above `since` (0: all
//! kept), oldest first, with `first`, the number of the oldest the node still keeps (a bounded
//! buffer, [`gpuplex_scheduler::node::events::EVENTS_KEPT`]): a client that polls with the last number it
//! saw misses nothing unless `first` is above it plus one.
//!
//! `watch` subscribes: the service answers at once with the node's capacity
//! ([`CapacityView`]: each GPU's index, UUID, model, memory, capacity, unreserved memory and
//! health, and the keys of the claims and allocations pinned now), then sends another such line
//! on the same connection each time that view changes (a request carried out, a reservation
//! lapsed, a container gone, a GPU's health seen to change at the service's one-second sweep),
//! until the client closes the connection. The connection carries nothing else: a `watch` with
//! more requests already sent behind it is refused (they are carried out as usual), and
//! anything a watcher sends later closes its connection. Each line is the whole view: when a
//! watcher reads more slowly than the node changes, the views not yet written to it are
//! replaced by the latest, and one that takes no line for 10 s is closed. Only a few
//! connections may watch (16 on the node, 4 of one process, whose oldest gives way to its
//! next); a `watch` over that is refused and the connection takes requests as before.
//!
//! ```text
//! {"ok":true,"capacity":{"gpus":[{"index":0,"uuid":"GPU-...","model":"...","memory":17179869184,"capacity":17179869184,"unreserved":8589934592,"healthy":true}],"claims":["units-gpu-0-0"]}}
//! ```
//!
//! `allocate` is the device plugin's (clusters without DRA): the kubelet gave a container these
//! units of `gpuplex.io/gpu-memory`, each `unit` bytes; the node pins their vGPU on their GPU as
//! `pin` does, under the claim key `units-<lowest unit>`, first releasing allocations that held any
//! of them (see [`gpuplex_scheduler::node::Node::allocate`]). The same units again answer with the same vGPU
//! and its handle. An `attach` with `annotations` (the weight, priority and pod of the container)
//! is an allocation's container's: its first container sets them (see
//! [`gpuplex_scheduler::node::Node::attach_asking`]); any other vGPU refuses them.
//!
//! `pin` is the DRA driver's: kube-scheduler allocated a ResourceClaim (its `uid`) on these
//! GPUs with this much memory on each, and the node reserves exactly that, never lapsing, until
//! the claim is released (see [`gpuplex_scheduler::node::Node::pin`]). Pinning the same claim again, placed
//! the same way, answers with the same vGPU and its handle: the handle is the claim's, and only
//! the driver, as root on the node socket, sends `pin` (no hook or shim request makes one).
//!
//! `stopping` says a container is being sent a stop signal (the containerd shim's `Kill`): it
//! is thawed and kept out of windows so that the signal is taken (see
//! [`gpuplex_scheduler::windows::WindowScheduler::stop`]).
//!
//! `reserve` (and a `register` that reserves) answers with the new vGPU's `handle`: the only
//! thing `attach` accepts, and what a hook or the shim releases with when it undoes its own
//! reservation. A vGPU id names a vGPU and grants nothing; a container never chooses either
//! (its annotations may not carry them: [`gpuplex_scheduler::request::SET_BY_GPUPLEX`]). A reply never
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
//! node (see [`gpuplex_scheduler::windows::WindowScheduler::hold`]). Both are idempotent; the container must
//! be attached.
//!
//! Clients write their requests with [`Request::to_line`], the same type this module reads, so
//! the two ends cannot disagree on a field; [`parse_request`] reads back every line it writes.
//!
//! A reply ([`Reply`]) is `{"ok":true,...}` with `vgpu` (reserve, attach, register, pin,
//! allocate, hold, unhold, stopping; release: the released one, absent when there was none),
//! `status`, `events` or `capacity` (watch), or `{"ok":false,"error":"<one line>"}`. A line longer than
//! [`MAX_LINE`] bytes, malformed JSON, an unknown operation or an unknown field gets an error
//! reply; none of them changes anything. Ids and handles in a reply are typed ([`VgpuReply`]):
//! a reply naming a malformed one does not read.

mod parse;
mod reply;
mod request;

pub mod cdi;

pub use parse::{json_kind, parse_request, MAX_UNITS};
pub use reply::{
    AssignedGpu, CapacityView, DeviceNode, EventLine, EventsReply, GpuCapacity, Reply, VgpuReply,
};
pub use request::{ProtocolError, Request, MAX_LINE, OPERATIONS, STOP_SIGNALS};

#[cfg(test)]
mod tests;
