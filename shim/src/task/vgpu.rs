//! The shim's side of a container's vGPU: what it asks of the node service, behind one trait
//! ([`Node`]; [`NodeLink`](super::node_link::NodeLink) talks to the real one, a stub in the task
//! service's tests records the calls), and the vGPU a container holds from `Create` to
//! `Delete` ([`Vgpu`]).
//!
//! Which vGPU a container gets is decided from its spec alone ([`super::classify`]):
//!
//! - by `gpuplex.io/` annotations: the shim reserves one and edits the spec before `runc create`
//!   (the same function podman's precreate hook runs), attaches the container once it has a
//!   pid, and releases the vGPU at delete;
//! - a Kubernetes claim's container: its vGPU is pinned already, and the claim's CDI device,
//!   which the runtime applied, ends with the attach step ([`gpuplex_wire::attach_step`]). The shim
//!   takes that step out of the spec and attaches the container itself, with the claim's
//!   handle; its delete releases nothing (the claim's vGPU is the claim's);
//! - a container given `gpuplex.io/gpu-memory` units by the kubelet (the device plugin) carries
//!   its allocation's handle in the annotation `gpuplex.io/allocation`, written by the kubelet
//!   from the plugin's `Allocate` answer, and its devices, environment and identity mount from
//!   that answer too (or from its CDI device, with the same attach step as a claim's). The shim
//!   attaches it as it attaches a claim's container, passing the weight and priority the pod's
//!   annotations ask for; its delete releases nothing either (the allocation is the kubelet's
//!   units').

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use gpuplex_hook::stages::HookError;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;
use gpuplex_wire::ClientError;

use super::bundle::BundleError;
use gpuplex_hook::classify::SpecRefusal;

/// How long a node service started by the shim has to answer.
pub const SERVICE_START: Duration = Duration::from_secs(5);

/// What the shim asks of the node service, each call about one container.
pub trait Node: Send + Sync {
    /// Reserves a vGPU for a container that asks for one by its `gpuplex.io/` annotations
    /// (`spec`: its config.json as containerd wrote it) and edits the spec for it; starts the
    /// node service if it is absent. `None` when the spec asks for no vGPU after all. On
    /// failure nothing stays reserved.
    fn reserve(&self, spec: &[u8]) -> Result<Option<Reservation>, VgpuError>;
    /// Makes sure the node service answers, starting it if it is absent: before a container
    /// attaches to a vGPU pinned for it (a claim's, an allocation's).
    fn ensure_running(&self) -> Result<(), VgpuError>;
    /// Attaches container `id`, whose init is `pid` (created, not started), to `vgpu`.
    fn attach(&self, vgpu: &Vgpu, id: &str, pid: u32) -> Result<(), VgpuError>;
    /// Holds container `id` out of scheduling while its user has it paused (`held`), or lets
    /// it back in.
    fn hold(&self, id: &str, held: bool) -> Result<(), VgpuError>;
    /// Tells the node service that container `id` is being sent a stop signal; best effort:
    /// the service also sees a stop signal pending in a container it froze.
    fn stopping(&self, id: &str, signal: StopSignal);
    /// Releases the vGPU reserved with `handle`; best effort: the service also releases a
    /// container whose processes are gone.
    fn release(&self, handle: &Handle);
    /// Releases the vGPU of container `id` (the shim's `delete` after its daemon died, when
    /// the handle died with it); best effort.
    fn release_container(&self, id: &str);
}

/// A vGPU reserved for a container that does not exist yet, and its spec edited for it.
#[derive(Debug)]
pub struct Reservation {
    /// The reservation's handle.
    pub handle: Handle,
    /// The spec to run: config.json edited for the vGPU.
    pub spec: Vec<u8>,
}

/// A container's vGPU, as the shim holds it from `Create` to `Delete`.
#[derive(Clone, Debug, PartialEq)]
pub struct Vgpu {
    /// The handle it was reserved (or its claim or allocation pinned) with: what attaches the
    /// container, and releases a vGPU the shim reserved.
    pub handle: Handle,
    /// What a container of the device plugin's allocation asks for its vGPU (its weight,
    /// priority and pod); empty for any other.
    pub asked: BTreeMap<String, String>,
    /// Whether it was pinned for the container by a claim or an allocation, which keep it
    /// after the container: the shim then never releases it.
    pub pinned: bool,
}

/// The stop signal the node service is told of when `signal` is sent to a container's init:
/// SIGTERM, SIGINT and SIGQUIT ask it to stop, SIGKILL kills it; any other is no stop.
pub fn stop_signal(signal: u32) -> Option<StopSignal> {
    match i32::try_from(signal).ok()? {
        libc::SIGTERM | libc::SIGINT | libc::SIGQUIT => Some(StopSignal::Graceful),
        libc::SIGKILL => Some(StopSignal::Kill),
        _ => None,
    }
}

/// Why a container got no vGPU: one line, shown to the containerd user after `gpuplex: `.
#[derive(Debug, thiserror::Error)]
pub enum VgpuError {
    /// The bundle's config.json could not be read (or written back).
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The spec asks for what the shim refuses (two vGPUs, a forged handle).
    #[error(transparent)]
    Spec(#[from] SpecRefusal),
    /// gpuplex's configuration is unusable, or the request (its annotations, the node's
    /// answer) was refused: the hook library's line.
    #[error("{}", .0.message)]
    Refused(HookError),
    /// The shim's own file work (the service's log and socket directory).
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What the shim was doing.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The node service cannot be reached.
    #[error(transparent)]
    Unreachable(#[from] ClientError),
    /// The node service refused an attach or a hold.
    #[error("the gpuplex node service did not {action} {id}: {source}")]
    Node {
        /// `attach`, `hold` or `let go of`.
        action: &'static str,
        /// The container.
        id: String,
        /// Its answer.
        #[source]
        source: ClientError,
    },
    /// The node service could not be started.
    #[error("cannot start the gpuplex node service: {0}")]
    Start(#[source] std::io::Error),
    /// The node service was started but did not answer in time.
    #[error("the gpuplex node service did not come up on {} within {}s (its log, {}, ends: {last:?}); start it with `systemctl start gpuplex`", socket.display(), SERVICE_START.as_secs(), log.display())]
    NotUp {
        /// The node socket.
        socket: PathBuf,
        /// The service's log.
        log: PathBuf,
        /// Its last line.
        last: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stop_signals_are_told() {
        let cases = [
            (libc::SIGTERM, Some(StopSignal::Graceful)),
            (libc::SIGINT, Some(StopSignal::Graceful)),
            (libc::SIGQUIT, Some(StopSignal::Graceful)),
            (libc::SIGKILL, Some(StopSignal::Kill)),
            (libc::SIGUSR1, None),
            (libc::SIGHUP, None),
            (0, None),
        ];
        for (signal, told) in cases {
            assert_eq!(stop_signal(signal as u32), told, "{signal}");
        }
        assert_eq!(stop_signal(u32::MAX), None);
    }
}
