//! Preparing and unpreparing claims: the claim is read from the API server, pinned in the node
//! service exactly where kube-scheduler placed it, and given a CDI spec; unpreparing releases it
//! and removes the spec. Both are idempotent, as the kubelet retries them. A claim that cannot
//! be prepared leaves nothing behind: no reservation, no spec, no identity file.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_wire::attach_step::attach_hook;
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::protocol::DeviceNode;
use gpuplex_wire::socket::pool::POOL_SIZE;
use gpuplex_wire::{ClientError, NodePool};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::cdi::{self, CdiError};
use crate::claim::{self, AllocatedDevice, ClaimError, ClaimRef};

/// Where claims come from: the API server, or what a test serves in its place.
pub trait Claims: Send + Sync + 'static {
    /// The claim as the API server has it now; the error is one line.
    fn get(&self, claim: &ClaimRef) -> impl Future<Output = Result<ResourceClaim, String>> + Send;
}

/// Why a claim was not prepared or unprepared. One line, for the kubelet's event on the pod.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The claim could not be read.
    #[error("{claim}: cannot read it from the API server: {why}")]
    Fetch {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// Why not.
        why: String,
    },
    /// The claim cannot be prepared as allocated.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The node service refused or could not be reached.
    #[error("{claim}: {source}")]
    Node {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// Its answer.
        #[source]
        source: ClientError,
    },
    /// The claim's CDI spec.
    #[error("{claim}: {source}")]
    Cdi {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// What failed.
        #[source]
        source: CdiError,
    },
    /// The identity file.
    #[error("{claim}: cannot write its identity file: {source}")]
    Identity {
        /// The claim (`claim NAMESPACE/NAME`).
        claim: String,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
}

/// A prepared claim's device, as the kubelet is told of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The allocation's device.
    pub device: AllocatedDevice,
    /// Its CDI device ids.
    pub cdi_device_ids: Vec<String>,
}

/// Where the driver finds things on this node.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// This node's name: the pool of its ResourceSlice.
    pub node: String,
    /// The node service's socket.
    pub socket: PathBuf,
    /// Where the runtime reads CDI specs (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// The host's control nodes each container gets (`/dev/nvidiactl`, ...).
    pub control_nodes: Vec<DeviceNode>,
    /// `gpuplex-hook` as the host's runtimes run it: the claims' attach step.
    pub hook: PathBuf,
}

/// The driver: prepares and unprepares claims.
pub struct Driver<C> {
    claims: C,
    config: DriverConfig,
    /// Its connections to the node service: the kubelet may prepare and unprepare many claims
    /// at once.
    node: Arc<NodePool>,
}

impl<C: Claims> Driver<C> {
    /// A driver reading claims from `claims`.
    pub fn new(claims: C, config: DriverConfig) -> Driver<C> {
        let node = Arc::new(NodePool::new(&config.socket, POOL_SIZE));
        Driver {
            claims,
            config,
            node,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &DriverConfig {
        &self.config
    }

    /// Prepares `claim`: the devices the kubelet passes to the runtime.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, DriverError> {
        cdi::check_uid(&claim.uid).map_err(|source| DriverError::Cdi {
            claim: claim.to_string(),
            source,
        })?;
        let found = self
            .claims
            .get(claim)
            .await
            .map_err(|why| DriverError::Fetch {
                claim: claim.to_string(),
                why,
            })?;
        let plan = claim::plan(&found, claim, &self.config.node)?;
        let (config, node) = (self.config.clone(), Arc::clone(&self.node));
        let asked = claim.clone();
        let devices = plan.devices.clone();
        tokio::task::spawn_blocking(move || pin_and_write(&config, &node, &asked, &plan))
            .await
            .expect("the preparing thread does not panic")?;
        let ids = vec![cdi::device_id(&claim.uid)];
        Ok(devices
            .into_iter()
            .map(|device| PreparedDevice {
                device,
                cdi_device_ids: ids.clone(),
            })
            .collect())
    }

    /// Unprepares `claim`: releases its vGPU and removes its spec; a claim this node does not
    /// have is unprepared already.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), DriverError> {
        cdi::check_uid(&claim.uid).map_err(|source| DriverError::Cdi {
            claim: claim.to_string(),
            source,
        })?;
        let (config, node) = (self.config.clone(), Arc::clone(&self.node));
        let asked = claim.clone();
        tokio::task::spawn_blocking(move || release_and_remove(&config, &node, &asked))
            .await
            .expect("the unpreparing thread does not panic")
    }
}

fn node_error(claim: &ClaimRef) -> impl FnOnce(ClientError) -> DriverError + '_ {
    move |source| DriverError::Node {
        claim: claim.to_string(),
        source,
    }
}

/// Pins the claim's vGPU and writes its identity and spec; undoes the pin when either fails.
fn pin_and_write(
    config: &DriverConfig,
    node: &NodePool,
    claim: &ClaimRef,
    plan: &claim::ClaimPlan,
) -> Result<(), DriverError> {
    let vgpu = node
        .ask(|c| c.pin(&claim.uid, &plan.placement, &plan.annotations))
        .map_err(node_error(claim))?;
    let written = (|| {
        let dir = identity::identity_dir(&config.socket);
        let file = identity::identity_file(&dir, vgpu.id);
        identity::write(&dir, &Identity::of(&vgpu, &config.node)).map_err(|source| {
            DriverError::Identity {
                claim: claim.to_string(),
                source,
            }
        })?;
        let handle = vgpu.handle.ok_or(DriverError::Cdi {
            claim: claim.to_string(),
            source: CdiError::Incomplete("the claim's handle"),
        })?;
        let attach = attach_hook(&config.hook, &config.socket, &handle);
        let edits = cdi::claim_edits(&vgpu, &file, &config.control_nodes, Some(attach));
        edits
            .and_then(|edits| cdi::write(&config.cdi_dir, &claim.uid, &edits))
            .map_err(|source| DriverError::Cdi {
                claim: claim.to_string(),
                source,
            })?;
        Ok(())
    })();
    if written.is_err() {
        let _ = release_and_remove(config, node, claim);
    }
    written
}

fn release_and_remove(
    config: &DriverConfig,
    node: &NodePool,
    claim: &ClaimRef,
) -> Result<(), DriverError> {
    let released = node
        .ask(|c| c.release(&ReleaseKey::Claim(claim.uid.clone())))
        .map_err(node_error(claim))?;
    if let Some(released) = released {
        let _ = identity::remove(&identity::identity_dir(&config.socket), released.id);
    }
    cdi::remove(&config.cdi_dir, &claim.uid).map_err(|source| DriverError::Cdi {
        claim: claim.to_string(),
        source,
    })
}
