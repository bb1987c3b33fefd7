//! gpuplex's device plugin (clusters without DRA): GPU memory as the extended resource
//! `gpuplex.io/gpu-memory`, counted in units (1 GiB by default) with ids per GPU
//! (`gpu-<index>-<n>`), so that the kubelet's accounting is per GPU.
//!
//! - `ListAndWatch`: each GPU's units, from the node service's capacity as it changes (its
//!   `watch`: [`DevicePlugin::keep_fresh`]), unhealthy on a GPU that is gone, and on every GPU
//!   while the node service cannot be reached (nothing is healthy that the plugin cannot see);
//! - `GetPreferredAllocation`: a container's units on one GPU that has room for all of them
//!   ([`gpuplex_scheduler::units::preferred`], by the node's assignment policy);
//! - `Allocate`: the units the kubelet chose are pinned as one vGPU on their GPU with their
//!   memory (the node service's `allocate`); the answer ([`answer`]) carries its handle and
//!   gives the container its GPU. Units on two GPUs are refused in one line, which the pod's
//!   events show. Nothing depends on which pod the kubelet is allocating for: the units say
//!   which GPU and how much.
//!
//! With CDI, the spec of an allocation the node no longer has (the kubelet gave its units again)
//! is removed as soon as a view without it comes, once the node confirms it gone (a spec written
//! after the view was made is not stale).
//!
//! [`serve`] runs it on the kubelet's device plugin socket directory and registers it, again
//! whenever the kubelet restarts.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use gpuplex_scheduler::inventory::AssignmentPolicy;
use gpuplex_scheduler::node::{allocation_key, ReleaseKey, ALLOCATION_PREFIX};
use gpuplex_scheduler::units::{self, UnitId, RESOURCE};
use gpuplex_scheduler::Handle;
use gpuplex_wire::attach_step::attach_hook;
use gpuplex_wire::config::DeviceDelivery;
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::protocol::{CapacityView, DeviceNode};
use gpuplex_wire::socket::pool::POOL_SIZE;
use gpuplex_wire::{ClientError, NodeClient, NodePool};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::cdi;
use crate::proto::deviceplugin as dp;

pub mod answer;
mod kubelet;
pub use kubelet::{serve, DevicePluginPaths, KUBELET_SOCKET, PLUGIN_SOCKET};

/// What the plugin needs to know of this node.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// This node's name (the identity file's `node`).
    pub node: String,
    /// The node service's socket.
    pub socket: PathBuf,
    /// One unit, in bytes (`[kubernetes] gpu_memory_unit`).
    pub unit: u64,
    /// How `Allocate` gives a container its GPU (`[kubernetes] device_plugin_devices`).
    pub delivery: DeviceDelivery,
    /// Which GPU is preferred among those with room (`[scheduler] policy`).
    pub policy: AssignmentPolicy,
    /// Where the runtime reads CDI specs (`/var/run/cdi`), for [`DeviceDelivery::Cdi`].
    pub cdi_dir: PathBuf,
    /// `gpuplex-hook` on the host: the CDI device's attach step.
    pub hook: PathBuf,
    /// The host's control nodes each container gets.
    pub control_nodes: Vec<DeviceNode>,
    /// The longest wait between tries to reach the node service again once its watch is lost
    /// (the waits start at [`FIRST_RETRY`] and double up to this). Nothing is polled: the node
    /// service sends each change.
    pub poll: Duration,
}

/// The first wait before the node service is tried again after its watch was lost (a restart
/// takes about that long).
pub const FIRST_RETRY: Duration = Duration::from_millis(50);

/// The wait before the next try to reach the node service, after `previous` (`None`: the first
/// try since the watch was lost): [`FIRST_RETRY`], then twice the last, at most `longest`.
pub fn next_retry(previous: Option<Duration>, longest: Duration) -> Duration {
    previous
        .map_or(FIRST_RETRY, |wait| wait.saturating_mul(2))
        .min(longest.max(FIRST_RETRY))
}

/// The `DevicePlugin` service.
#[derive(Clone)]
pub struct DevicePlugin {
    config: Arc<PluginConfig>,
    devices: watch::Sender<Listed>,
    /// Its connections to the node service for allocations: the kubelet may allocate for
    /// many pods at once.
    node: Arc<NodePool>,
}

/// The units listed, and the most units one GPU offers.
#[derive(Clone, Debug, Default, PartialEq)]
struct Listed {
    devices: Vec<dp::Device>,
    most: u64,
}

impl DevicePlugin {
    /// A plugin with nothing listed yet: [`DevicePlugin::refresh`] (or
    /// [`DevicePlugin::keep_fresh`]) reads the node's GPUs.
    pub fn new(config: PluginConfig) -> DevicePlugin {
        DevicePlugin {
            node: Arc::new(NodePool::new(&config.socket, POOL_SIZE)),
            config: Arc::new(config),
            devices: watch::channel(Listed::default()).0,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// Reads the node's status once and lists its GPUs' units as a watched view would be
    /// (the watchers hear of a change); with CDI, removes the specs of allocations the node no
    /// longer has. Blocking.
    pub fn refresh(&self) -> Result<(), ClientError> {
        let status = NodeClient::connect(&self.config.socket)?.status()?;
        self.apply(&CapacityView::of_status(&status));
        Ok(())
    }

    /// Lists the units of `view` (the watchers hear of a change); with CDI, removes the specs
    /// of allocations it does not have. Blocking.
    fn apply(&self, view: &CapacityView) {
        let unit = self.config.unit;
        self.list(Listed {
            devices: answer::devices(&view.gpus, unit),
            most: answer::most_on_one_gpu(&view.gpus, unit),
        });
        if self.config.delivery == DeviceDelivery::Cdi {
            self.remove_stale_specs(&view.claims);
        }
    }

    /// Lists every unit as unhealthy: the node service cannot be reached.
    fn unseen(&self) {
        let listed = self.devices.borrow().clone();
        self.list(Listed {
            devices: answer::unseen(&listed.devices),
            ..listed
        });
    }

    /// Lists `listed`, telling the watchers when it changed.
    fn list(&self, listed: Listed) {
        self.devices.send_if_modified(|now| {
            let changed = *now != listed;
            if changed {
                let unhealthy = (listed.devices.iter())
                    .filter(|d| d.health != answer::HEALTHY)
                    .count();
                tracing::info!(
                    "{RESOURCE}: {} units listed, {unhealthy} unhealthy",
                    listed.devices.len()
                );
                *now = listed;
            }
            changed
        });
    }

    /// Follows the node service's capacity for as long as the plugin runs: each view it sends
    /// is listed as it comes; when the watch is lost (the service stopped or restarts) every
    /// unit is unhealthy until a view comes again, tried after [`next_retry`]'s waits. On a
    /// thread of its own, since the watch blocks (and a blocking task would hold the runtime's
    /// shutdown).
    pub async fn keep_fresh(self) {
        let (ended, end) = tokio::sync::oneshot::channel::<()>();
        let follower = std::thread::Builder::new()
            .name("node-watch".into())
            .spawn(move || {
                let _ended = ended;
                self.follow()
            });
        if let Err(e) = follower {
            tracing::error!("{RESOURCE}: cannot follow the node service's GPUs: {e}");
            return;
        }
        let _ = end.await;
        tracing::error!("{RESOURCE}: stopped following the node service's GPUs");
    }

    /// [`DevicePlugin::keep_fresh`]'s thread: watches, and watches again, for ever.
    fn follow(&self) {
        let mut wait = None;
        let mut told = String::new();
        loop {
            let lost = self.watch(&mut wait);
            self.unseen();
            let why = lost.to_string();
            // Once per loss, and again only when the reason changes.
            if wait.is_none() || why != told {
                tracing::warn!(
                    "{RESOURCE}: the node's GPUs are not known, so every unit is unhealthy until they are: {why}"
                );
                told = why;
            }
            let next = next_retry(wait, self.config.poll);
            wait = Some(next);
            std::thread::sleep(next);
        }
    }

    /// Watches the node service's capacity and lists each view, until the watch is lost; a
    /// view resets `wait` (the next loss is retried after [`FIRST_RETRY`]).
    fn watch(&self, wait: &mut Option<Duration>) -> ClientError {
        let watched = (|| -> Result<Infallible, ClientError> {
            let mut watch = NodeClient::connect(&self.config.socket)?.watch()?;
            loop {
                let view = watch.next_view()?;
                if wait.take().is_some() {
                    tracing::info!("{RESOURCE}: following the node's GPUs again");
                }
                self.apply(&view);
            }
        })();
        match watched {
            Err(lost) => lost,
            Ok(never) => match never {},
        }
    }

    /// Removes the CDI specs of allocations (`gpuplex.io-vgpu-units-*.json`) that are not
    /// among `claims` (released when the kubelet gave their units again), once the node
    /// confirms they are gone: a view may be older than a spec an `Allocate` just wrote.
    fn remove_stale_specs(&self, claims: &[String]) {
        let dir = &self.config.cdi_dir;
        let stale = stale_specs(&allocation_specs(dir), claims);
        if stale.is_empty() {
            return;
        }
        let now = NodeClient::connect(&self.config.socket).and_then(|mut c| c.status());
        let claims = match now {
            Ok(status) => CapacityView::of_status(&status).claims,
            Err(e) => {
                tracing::warn!("{RESOURCE}: the CDI specs of ended allocations stay for now: {e}");
                return;
            }
        };
        for key in stale_specs(&stale, &claims) {
            match cdi::remove(dir, &key) {
                Ok(()) => tracing::info!("{key}: released; its CDI spec removed"),
                Err(e) => tracing::warn!("{key}: {e}"),
            }
        }
    }

    fn preferred(
        &self,
        request: dp::ContainerPreferredAllocationRequest,
    ) -> Result<Vec<String>, Status> {
        let read = |ids: &[String]| -> Result<Vec<UnitId>, Status> {
            ids.iter()
                .map(|id| {
                    id.parse()
                        .map_err(|e: units::UnitsError| Status::invalid_argument(e.to_string()))
                })
                .collect()
        };
        let available = read(&request.available_device_i_ds)?;
        let must = read(&request.must_include_device_i_ds)?;
        let size = usize::try_from(request.allocation_size).unwrap_or(0);
        let picked = units::preferred(&available, &must, size, self.config.policy);
        Ok(picked.iter().map(UnitId::to_string).collect())
    }
}

/// Allocates one container's units: pinned by the node service, the identity written (and the
/// CDI spec with CDI), the answer made. When anything after the pin fails, the allocation is
/// released again. Blocking.
fn allocate_one(
    config: &PluginConfig,
    node: &NodePool,
    units: &[UnitId],
) -> Result<dp::ContainerAllocateResponse, String> {
    let key = allocation_key(units).ok_or("no unit was given")?;
    let vgpu = node
        .ask(|c| c.allocate(units, config.unit))
        .map_err(|e| e.to_string())?;
    let made = (|| -> Result<dp::ContainerAllocateResponse, String> {
        let handle: Handle =
            (vgpu.handle).ok_or("the node service did not give the allocation's handle")?;
        let id = vgpu.id;
        let dir = identity::identity_dir(&config.socket);
        identity::write(&dir, &Identity::of(&vgpu, &config.node))
            .map_err(|e| format!("cannot write the identity file in {}: {e}", dir.display()))?;
        let file = identity::identity_file(&dir, id);
        let attach = (config.delivery == DeviceDelivery::Cdi)
            .then(|| attach_hook(&config.hook, &config.socket, &handle));
        let edits = cdi::claim_edits(&vgpu, &file, &config.control_nodes, attach)
            .map_err(|e| e.to_string())?;
        match config.delivery {
            DeviceDelivery::Cdi => {
                cdi::write(&config.cdi_dir, &key, &edits).map_err(|e| e.to_string())?;
            }
            DeviceDelivery::Kubelet if !edits.hooks.is_empty() => tracing::warn!(
                "{key}: the host's CDI spec has hooks for GPU {}, which the kubelet's fields cannot carry; set device_plugin_devices = \"cdi\" where the runtime reads CDI",
                units[0].gpu
            ),
            DeviceDelivery::Kubelet => {}
        }
        Ok(answer::answer(config.delivery, &key, &handle, &edits))
    })();
    if made.is_err() {
        let _ = node.ask(|c| c.release(&ReleaseKey::Claim(key.clone())));
        let _ = cdi::remove(&config.cdi_dir, &key);
    }
    made.map_err(|e| format!("{RESOURCE} {key}: {e}"))
}

/// The allocation keys of the CDI specs in `dir` (`gpuplex.io-vgpu-units-*.json`).
fn allocation_specs(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let keys = entries.flatten().filter_map(|entry| {
        let name = entry.file_name();
        let key = (name.to_str())
            .and_then(|n| n.strip_prefix("gpuplex.io-vgpu-"))
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|k| k.starts_with(ALLOCATION_PREFIX))?;
        Some(key.to_owned())
    });
    keys.collect()
}

/// The allocation keys of `specs` that are not among the live `claims`.
fn stale_specs(specs: &[String], claims: &[String]) -> Vec<String> {
    (specs.iter())
        .filter(|key| !claims.contains(key))
        .cloned()
        .collect()
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for DevicePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        let updates = tokio_stream::wrappers::WatchStream::new(self.devices.subscribe());
        let stream = updates.map(|listed| {
            Ok(dp::ListAndWatchResponse {
                devices: listed.devices,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let mut response = dp::PreferredAllocationResponse::default();
        for asked in request.into_inner().container_requests {
            let device_i_ds = self.preferred(asked)?;
            response
                .container_responses
                .push(dp::ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(Response::new(response))
    }

    async fn allocate(
        &self,
        request: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let mut response = dp::AllocateResponse::default();
        let most = self.devices.borrow().most;
        let asked = request.into_inner().container_requests;
        // Every container's units are checked before any is pinned: a request refused here
        // pins nothing.
        let mut containers = Vec::with_capacity(asked.len());
        for ids in asked.into_iter().map(|c| c.devices_ids) {
            if let Err(e) = units::placement(&ids, self.config.unit, most) {
                tracing::warn!("{RESOURCE}: Allocate of {} refused: {e}", ids.join(","));
                return Err(Status::invalid_argument(e.to_string()));
            }
            let units: Vec<UnitId> = ids.iter().filter_map(|id| id.parse().ok()).collect();
            containers.push((ids, units));
        }
        let all: Vec<Vec<UnitId>> = containers.iter().map(|(_, u)| u.clone()).collect();
        if let Err(e) = units::check_disjoint(&all) {
            tracing::warn!("{RESOURCE}: Allocate refused: {e}");
            return Err(Status::invalid_argument(e.to_string()));
        }
        for (ids, units) in containers {
            let (config, node) = (Arc::clone(&self.config), Arc::clone(&self.node));
            let made = tokio::task::spawn_blocking(move || allocate_one(&config, &node, &units))
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
            match made {
                Ok(answer) => {
                    tracing::info!("{RESOURCE}: allocated {}", ids.join(","));
                    response.container_responses.push(answer);
                }
                Err(e) => {
                    tracing::warn!("Allocate refused: {e}");
                    return Err(Status::failed_precondition(e));
                }
            }
        }
        Ok(Response::new(response))
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// The plugin's options: preferred allocations, no pre-start call.
pub fn options() -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_is_tried_again_after_doubling_waits_up_to_the_longest() {
        let longest = Duration::from_secs(2);
        let mut wait = None;
        let waits: Vec<u128> = (0..9)
            .map(|_| {
                let next = next_retry(wait, longest);
                wait = Some(next);
                next.as_millis()
            })
            .collect();
        assert_eq!(waits, [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        // A longest wait below the first is the first.
        assert_eq!(next_retry(None, Duration::from_millis(1)), FIRST_RETRY);
        assert_eq!(next_retry(Some(FIRST_RETRY), Duration::ZERO), FIRST_RETRY);
    }

    #[test]
    fn a_spec_is_stale_when_its_allocation_is_not_live() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "gpuplex.io-vgpu-units-gpu-0-0.json",
            "gpuplex.io-vgpu-units-gpu-1-4.json",
            "gpuplex.io-vgpu-7f3c.json",
            "other.json",
        ] {
            std::fs::write(dir.path().join(name), "{}").unwrap();
        }
        let mut specs = allocation_specs(dir.path());
        specs.sort();
        assert_eq!(specs, ["units-gpu-0-0", "units-gpu-1-4"]);
        let live = ["7f3c".to_string(), "units-gpu-1-4".to_string()];
        assert_eq!(stale_specs(&specs, &live), ["units-gpu-0-0"]);
        assert!(allocation_specs(&dir.path().join("absent")).is_empty());
    }
}
