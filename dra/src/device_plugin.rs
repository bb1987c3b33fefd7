//! gpuplex's device plugin (clusters without DRA): GPU memory as the extended resource
//! `gpuplex.io/gpu-memory`, counted in units (1 GiB by default) with ids per GPU
//! (`gpu-<index>-<n>`), so that the kubelet's accounting is per GPU.
//!
//! - `ListAndWatch`: each GPU's units, from the node service's status (polled), unhealthy on
//!   a GPU that is gone;
//! - `GetPreferredAllocation`: a container's units on one GPU that has room for all of them
//!   ([`gpuplex_scheduler::units::preferred`], by the node's assignment policy);
//! - `Allocate`: the units the kubelet chose are pinned as one vGPU on their GPU with their
//!   memory (the node service's `allocate`); the answer ([`answer`]) carries its handle and
//!   gives the container its GPU. Units on two GPUs are refused in one line, which the pod's
//!   events show. Nothing depends on which pod the kubelet is allocating for: the units say
//!   which GPU and how much.
//!
//! [`serve`] runs it on the kubelet's device plugin socket directory and registers it, again
//! whenever the kubelet restarts.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use gpuplex_hook::spec::DeviceNode;
use gpuplex_scheduler::inventory::AssignmentPolicy;
use gpuplex_scheduler::node::{allocation_key, NodeStatus, ReleaseKey, ALLOCATION_PREFIX};
use gpuplex_scheduler::units::{self, UnitId, RESOURCE};
use gpuplex_scheduler::Handle;
use gpuplex_wire::config::DeviceDelivery;
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::{ClientError, NodeClient};
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
    /// How often the node service's GPUs are read for `ListAndWatch`.
    pub poll: Duration,
}

/// The `DevicePlugin` service.
#[derive(Clone)]
pub struct DevicePlugin {
    config: Arc<PluginConfig>,
    devices: watch::Sender<Listed>,
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
            config: Arc::new(config),
            devices: watch::channel(Listed::default()).0,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// Reads the node's GPUs and lists their units again (the watchers hear of a change); with
    /// CDI, removes the specs of allocations the node no longer has. Blocking.
    pub fn refresh(&self) -> Result<(), ClientError> {
        let status = NodeClient::connect(&self.config.socket)?.status()?;
        let unit = self.config.unit;
        let listed = Listed {
            devices: answer::devices(&status.gpus, unit),
            most: answer::most_on_one_gpu(&status.gpus, unit),
        };
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
        if self.config.delivery == DeviceDelivery::Cdi {
            remove_stale_specs(&self.config.cdi_dir, &status);
        }
        Ok(())
    }

    /// Refreshes every `poll`, until dropped.
    pub async fn keep_fresh(self) {
        loop {
            let plugin = self.clone();
            let read = tokio::task::spawn_blocking(move || plugin.refresh()).await;
            if let Ok(Err(e)) = read {
                tracing::warn!("{RESOURCE}: the node's GPUs are not known: {e}");
            }
            tokio::time::sleep(self.config.poll).await;
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
    units: &[UnitId],
) -> Result<dp::ContainerAllocateResponse, String> {
    let key = allocation_key(units).ok_or("no unit was given")?;
    let mut client = NodeClient::connect(&config.socket).map_err(|e| e.to_string())?;
    let vgpu = client
        .allocate(units, config.unit)
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
            .then(|| gpuplex_hook::claim::attach_hook(&config.hook, &config.socket, &handle));
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
        let _ = client.release(&ReleaseKey::Claim(key.clone()));
        let _ = cdi::remove(&config.cdi_dir, &key);
    }
    made.map_err(|e| format!("{RESOURCE} {key}: {e}"))
}

/// Removes the CDI specs of allocations (`gpuplex.io-vgpu-units-*.json`) that the node no
/// longer has (released when the kubelet gave their units again).
fn remove_stale_specs(dir: &Path, status: &NodeStatus) {
    let live: Vec<&str> = (status
        .reservations
        .iter()
        .filter_map(|r| r.claim.as_deref()))
    .chain(status.containers.iter().filter_map(|c| c.claim.as_deref()))
    .collect();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(key) = (name.to_str())
            .and_then(|n| n.strip_prefix("gpuplex.io-vgpu-"))
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|k| k.starts_with(ALLOCATION_PREFIX))
        else {
            continue;
        };
        if !live.contains(&key) {
            match cdi::remove(dir, key) {
                Ok(()) => tracing::info!("{key}: released; its CDI spec removed"),
                Err(e) => tracing::warn!("{key}: {e}"),
            }
        }
    }
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
        for asked in request.into_inner().container_requests {
            let ids = asked.devices_ids;
            let placed = units::placement(&ids, self.config.unit, most);
            if let Err(e) = placed {
                tracing::warn!("{RESOURCE}: Allocate of {} refused: {e}", ids.join(","));
                return Err(Status::invalid_argument(e.to_string()));
            }
            let units: Vec<UnitId> = ids.iter().filter_map(|id| id.parse().ok()).collect();
            let config = Arc::clone(&self.config);
            let made = tokio::task::spawn_blocking(move || allocate_one(&config, &units))
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
