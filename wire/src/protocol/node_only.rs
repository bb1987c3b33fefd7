//! The node's side of each request alone, without the node service around it: no cgroup, no
//! state file, no CDI spec. What the protocol's tests and the `request_line` fuzz target drive
//! until the service's own dispatcher runs without root (issue #28); nothing in production
//! calls it.

use gpuplex_scheduler::node::{Node, NodeError};
use gpuplex_scheduler::{Handle, Instant, VgpuId};

use super::{EventsReply, Reply, Request, VgpuReply};

/// Carries out one request on `node` alone and says how it went; a reservation it makes gets
/// `fresh` as its handle (the caller's random draw), and only then does the reply carry one.
pub fn handle(node: &mut Node, request: Request, fresh: Handle, now: Instant) -> Reply {
    // Only a request that reserves shows a handle, and only the one it reserved with; a pin
    // shows its claim's (see the module doc).
    let pinning = matches!(request, Request::Pin { .. } | Request::Allocate { .. });
    let reserving =
        pinning || matches!(request, Request::Reserve { .. } | Request::Register { .. });
    let done = |node: &Node, result: Result<VgpuId, NodeError>| match result {
        Ok(vgpu) => match node.record(vgpu) {
            Some(r) => {
                let mut reply = VgpuReply::of(node, r);
                if pinning || (reserving && r.handle == fresh) {
                    reply.handle = Some(r.handle);
                }
                Reply::vgpu(reply)
            }
            None => Reply::Done,
        },
        Err(e) => Reply::refused(e),
    };
    match request {
        Request::Reserve { annotations } => {
            let result = node
                .reserve(
                    annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    fresh,
                    now,
                )
                .map(|r| r.id);
            done(node, result)
        }
        Request::Attach {
            handle,
            attachment,
            asked,
            ..
        } => {
            let result = node
                .attach_asking(&handle, attachment, &asked, now)
                .map(|r| r.id);
            done(node, result)
        }
        Request::Register {
            annotations,
            attachment,
            ..
        } => {
            let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let result = node.register(pairs, fresh, attachment, now).map(|r| r.id);
            done(node, result)
        }
        Request::Release(key) => {
            let released = node.release(&key, now);
            match released {
                Some(r) => Reply::vgpu(VgpuReply::of(node, &r.record)),
                None => Reply::Done,
            }
        }
        Request::Hold { key, held } => {
            let result = node.hold(&key, held, now);
            done(node, result)
        }
        Request::Stopping { key, signal } => {
            let result = node.attached(&key).inspect(|&v| {
                node.stopping(v, signal, now);
            });
            done(node, result)
        }
        Request::Pin {
            claim,
            placement,
            annotations,
        } => {
            let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let result = node
                .pin(&claim, pairs, &placement, fresh, now)
                .map(|r| r.id);
            done(node, result)
        }
        Request::Allocate { units, unit } => {
            let result = node.allocate(&units, unit, fresh, now).map(|a| a.vgpu);
            done(node, result)
        }
        Request::Status => Reply::Status(Box::new(node.status(now))),
        Request::Events { since } => {
            Reply::Events(EventsReply::of(node, since, |at| at.as_nanos() / 1_000_000))
        }
    }
}
