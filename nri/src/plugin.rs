//! gpuplex's answers to the runtime's NRI calls: a [`Handler`] over a [`Node`].
//!
//! - `CreateContainer`: which vGPU the container gets is `gpuplex_hook::classify`'s decision
//!   over the spec NRI's description stands for ([`spec_of`]). A container asking by
//!   `gpuplex.io/` annotations gets a vGPU reserved and the precreate edit, answered as the
//!   adjustment (device nodes, environment, the identity mount, gpuplex's annotations); a
//!   refusal is one line, which fails the container's creation and is what the pod's events
//!   show. A claim's container (and an allocation's with the same attach step) is left as it
//!   is: the runtime runs the claim's attach step, a `createRuntime` hook, itself.
//! - `StartContainer` (NRI calls it before the container's program starts, with its init's
//!   pid): the container attaches to its vGPU, as not yet started; a device plugin
//!   allocation's container brings its pod's weight and priority. An attach that fails releases
//!   the reservation, which was the container's alone.
//! - `StopContainer`, `RemoveContainer`: a vGPU reserved for the container is released (the
//!   node service also releases it when the container's processes are gone).
//! - `Synchronize`, at each connection: the runtime's containers are reconciled with the node:
//!   a created or running container whose spec carries gpuplex's handle, or an allocation, is
//!   attached (an attach is idempotent), a stopped one's reservation released. So a plugin that
//!   was away when a container started, or stopped, catches up.
//!
//! Runtimes of NRI 0.8 and older (containerd 1.7) send start, stop and removal as
//! `StateChange`; later ones call each event's method, and only fall back to `StateChange`.
//! Both reach the same code.
//!
//! The plugin keeps no state a restart would lose: what it reserved is in the containers'
//! specs (`gpuplex.io/vgpu-handle`), which the runtime hands it with every event.
//!
//! A pod run by gpuplex's own shim (its runtime handler is the shim's, `gpuplex` unless the
//! operator named it otherwise) is the shim's: the plugin leaves its containers alone, so that a
//! node may offer both ways in.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use gpuplex_hook::classify::{classify, VgpuOrigin};
use gpuplex_scheduler::Handle;
use gpuplex_wire::annotations::VGPU_HANDLE;
use prost::Message;

use crate::node::Node;
use crate::proto::nri::{
    ConfigureRequest, ConfigureResponse, Container, ContainerEvent, ContainerState,
    CreateContainerRequest, CreateContainerResponse, Empty, Event, PodSandbox, StateChangeEvent,
    SynchronizeRequest, SynchronizeResponse,
};
use crate::session::Handler;
use crate::spec::{adjustment, spec_of};
use crate::ttrpc::{INVALID_ARGUMENT, UNIMPLEMENTED, UNKNOWN};

/// The events the plugin subscribes to.
pub const EVENTS: [Event; 4] = [
    Event::CreateContainer,
    Event::StartContainer,
    Event::StopContainer,
    Event::RemoveContainer,
];

/// [`EVENTS`] as NRI's mask: bit (event - 1) for each.
pub fn event_mask() -> i32 {
    EVENTS.iter().fold(0, |mask, e| mask | 1 << (*e as i32 - 1))
}

/// How long each request to the node service may take when the runtime gives the plugin
/// `request_timeout` milliseconds to answer it: three quarters of that, so that a node service
/// that is slow to answer (restarting, say) makes a refusal the runtime shows, not a plugin
/// the runtime drops. `None` when the runtime says no timeout.
pub fn answer_within(request_timeout: i64) -> Option<Duration> {
    let ms = u64::try_from(request_timeout).ok().filter(|ms| *ms > 0)?;
    Some(Duration::from_millis(ms * 3 / 4).max(Duration::from_millis(50)))
}

/// What the plugin has to do for a container once it has a pid.
#[derive(Debug, PartialEq)]
enum Duty {
    /// Nothing: no vGPU, or one its runtime attaches (a claim's attach step).
    Nothing,
    /// Attach it to the vGPU the plugin reserved for it with this handle; release that vGPU
    /// when the container goes.
    Reserved(Handle),
    /// Attach it to its device plugin allocation's vGPU, bringing what its pod asks.
    Allocation {
        /// The allocation's handle.
        handle: Handle,
        /// Its pod's weight, priority, name and namespace.
        asked: BTreeMap<String, String>,
    },
}

/// The runtime handler of gpuplex's shim, as `config/kubernetes/runtimeclass.yaml` names it.
pub const SHIM_HANDLER: &str = "gpuplex";

/// gpuplex's NRI plugin over the node service `node`.
pub struct Plugin<N> {
    node: N,
    /// The runtime handler whose pods gpuplex's shim serves.
    shim_handler: String,
    /// The handles of the vGPUs reserved in this process's life, by container: what the
    /// container's spec also carries, kept in case a runtime hands back an older spec.
    reserved: HashMap<String, Handle>,
}

impl<N: Node> Plugin<N> {
    /// A plugin asking `node`.
    pub fn new(node: N) -> Plugin<N> {
        Plugin {
            node,
            shim_handler: SHIM_HANDLER.to_owned(),
            reserved: HashMap::new(),
        }
    }

    /// The same, leaving the pods of runtime handler `handler` to gpuplex's shim.
    pub fn with_shim_handler(mut self, handler: &str) -> Plugin<N> {
        self.shim_handler = handler.to_owned();
        self
    }

    /// Whether `pod` runs under gpuplex's shim, which gives its containers their vGPUs itself.
    fn shims(&self, pod: &PodSandbox) -> bool {
        pod.runtime_handler == self.shim_handler
    }

    /// The node it asks.
    pub fn node(&self) -> &N {
        &self.node
    }

    /// `CreateContainer`: the adjustment, or the one line that refuses the container.
    pub fn create(
        &mut self,
        pod: &PodSandbox,
        container: &Container,
    ) -> Result<CreateContainerResponse, String> {
        if self.shims(pod) {
            return Ok(CreateContainerResponse::default());
        }
        let spec = spec_of(pod, container);
        let origin = classify(&spec).map_err(|e| e.to_string())?;
        if !matches!(origin, VgpuOrigin::Annotations(_)) {
            return Ok(CreateContainerResponse::default());
        }
        let Some(prepared) = self.node.prepare(&spec)? else {
            return Ok(CreateContainerResponse::default());
        };
        let edited = serde_json::from_slice(&prepared.config).map_err(|e| e.to_string());
        let adjusted = edited.and_then(|edited| adjustment(&spec, &edited, &prepared.handle));
        let (adjust, gids) = match adjusted {
            Ok(adjusted) => adjusted,
            Err(why) => {
                self.node.undo(&prepared);
                return Err(format!(
                    "the vGPU's edits cannot be made an NRI adjustment: {why}"
                ));
            }
        };
        if !gids.is_empty() {
            tracing::warn!(
                "{}: the GPUs' CDI spec adds the supplementary groups {gids:?}, which NRI cannot give a container; it runs without them",
                container.id
            );
        }
        tracing::info!(
            "{} ({}/{}): vGPU {} reserved",
            container.id,
            pod.namespace,
            pod.name,
            prepared.vgpu
        );
        self.reserved.insert(container.id.clone(), prepared.handle);
        Ok(CreateContainerResponse {
            adjust: Some(adjust),
        })
    }

    /// `StartContainer`: attaches the container if it has a vGPU to attach to. `unstarted`:
    /// its program has not started yet.
    pub fn start(
        &mut self,
        pod: &PodSandbox,
        container: &Container,
        unstarted: bool,
    ) -> Result<(), String> {
        let (handle, asked, ours) = match self.duty(pod, container) {
            Duty::Nothing => return Ok(()),
            Duty::Reserved(handle) => (handle, BTreeMap::new(), true),
            Duty::Allocation { handle, asked } => (handle, asked, false),
        };
        if container.pid == 0 {
            return Err(format!(
                "the runtime did not say the pid of container {}, which gpuplex attaches to its vGPU by its init",
                container.id
            ));
        }
        let attached = self
            .node
            .attach(&handle, &container.id, container.pid, unstarted, &asked);
        if let Err(why) = attached {
            if ours {
                self.node.release(&handle);
                self.reserved.remove(&container.id);
            }
            return Err(format!(
                "container {} was not attached to its vGPU: {why}",
                container.id
            ));
        }
        tracing::info!("{}: attached (pid {})", container.id, container.pid);
        Ok(())
    }

    /// `StopContainer`, `RemoveContainer`: releases the vGPU reserved for the container.
    pub fn gone(&mut self, container: &Container) {
        let handle = self
            .reserved
            .remove(&container.id)
            .or_else(|| handle_in_spec(container));
        if let Some(handle) = handle {
            self.node.release(&handle);
            tracing::info!("{}: its vGPU released", container.id);
        }
    }

    /// `Synchronize`: the runtime's containers reconciled with the node (see the module doc).
    pub fn synchronize(&mut self, request: &SynchronizeRequest) {
        let pods: HashMap<&str, &PodSandbox> =
            request.pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let no_pod = PodSandbox::default();
        for container in &request.containers {
            let pod = pods
                .get(container.pod_sandbox_id.as_str())
                .copied()
                .unwrap_or(&no_pod);
            let result = match container.state() {
                ContainerState::ContainerCreated => self.start(pod, container, true),
                ContainerState::ContainerRunning | ContainerState::ContainerPaused => {
                    self.start(pod, container, false)
                }
                ContainerState::ContainerStopped => {
                    self.gone(container);
                    Ok(())
                }
                ContainerState::ContainerUnknown => Ok(()),
            };
            if let Err(why) = result {
                tracing::warn!("synchronising: {why}");
            }
        }
    }

    /// What the plugin has to do for `container` once it has a pid.
    fn duty(&self, pod: &PodSandbox, container: &Container) -> Duty {
        if self.shims(pod) {
            return Duty::Nothing;
        }
        if let Some(handle) = self.reserved.get(&container.id) {
            return Duty::Reserved(*handle);
        }
        if let Some(handle) = handle_in_spec(container) {
            return Duty::Reserved(handle);
        }
        let spec = spec_of(pod, container);
        match classify(&spec) {
            Ok(VgpuOrigin::Allocation {
                handle,
                asked,
                spec: without_step,
            }) if without_step == spec => Duty::Allocation { handle, asked },
            Ok(VgpuOrigin::Annotations(_)) => {
                tracing::warn!(
                    "{}: asks for a vGPU, but was created while the plugin was away: it runs without one",
                    container.id
                );
                Duty::Nothing
            }
            _ => Duty::Nothing,
        }
    }
}

/// The handle gpuplex's adjustment wrote into the container's spec.
fn handle_in_spec(container: &Container) -> Option<Handle> {
    container.annotations.get(VGPU_HANDLE)?.parse().ok()
}

impl<N: Node> Handler for Plugin<N> {
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, (i32, String)> {
        fn decode<M: Message + Default>(payload: &[u8]) -> Result<M, (i32, String)> {
            M::decode(payload).map_err(|e| (INVALID_ARGUMENT, format!("gpuplex: {e}")))
        }
        let refused = |why: String| (UNKNOWN, format!("gpuplex: {why}"));
        let empty = || Empty {}.encode_to_vec();
        match method {
            "Configure" => {
                let request: ConfigureRequest = decode(payload)?;
                tracing::info!(
                    "configured by {} {}",
                    request.runtime_name,
                    request.runtime_version
                );
                if let Some(limit) = answer_within(request.request_timeout) {
                    self.node.answer_within(limit);
                }
                Ok(ConfigureResponse {
                    events: event_mask(),
                }
                .encode_to_vec())
            }
            "Synchronize" => {
                let request: SynchronizeRequest = decode(payload)?;
                self.synchronize(&request);
                Ok(SynchronizeResponse { more: request.more }.encode_to_vec())
            }
            "Shutdown" => Ok(empty()),
            "CreateContainer" => {
                let request: CreateContainerRequest = decode(payload)?;
                let pod = request.pod.unwrap_or_default();
                let container = request.container.unwrap_or_default();
                let answer = self.create(&pod, &container).map_err(refused)?;
                Ok(answer.encode_to_vec())
            }
            "StartContainer" => {
                let request: ContainerEvent = decode(payload)?;
                let pod = request.pod.unwrap_or_default();
                let container = request.container.unwrap_or_default();
                self.start(&pod, &container, true).map_err(refused)?;
                Ok(empty())
            }
            "StopContainer" | "RemoveContainer" => {
                let request: ContainerEvent = decode(payload)?;
                self.gone(&request.container.unwrap_or_default());
                Ok(empty())
            }
            "StateChange" => {
                let request: StateChangeEvent = decode(payload)?;
                let pod = request.pod.unwrap_or_default();
                let container = request.container.unwrap_or_default();
                match Event::try_from(request.event) {
                    Ok(Event::StartContainer) => {
                        self.start(&pod, &container, true).map_err(refused)?
                    }
                    Ok(Event::StopContainer | Event::RemoveContainer) => self.gone(&container),
                    _ => {}
                }
                Ok(empty())
            }
            other => Err((
                UNIMPLEMENTED,
                format!("gpuplex: {other} is not implemented"),
            )),
        }
    }
}

#[cfg(test)]
mod tests;
