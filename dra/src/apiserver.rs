//! The API server's side of the driver: the claims the kubelet asks to prepare, read as the API
//! server has them now, and this node's ResourceSlice, kept equal to the node's GPUs.
//!
//! The slice is reconciled, not just written: [`SlicePublisher::publish`] reads the slice,
//! creates it when it is missing and replaces its spec when it differs (the pool's generation
//! one higher), and reads again when the API server answers that someone else changed it
//! meanwhile (409). [`keep_published`] publishes when the node's GPUs or capacity change, and
//! when a watch of the slice says another writer changed or deleted it.

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use kube::Client;

use crate::claim::ClaimRef;
use crate::driver::Claims;
use crate::slice::{slice, slice_name};

/// A client of the API server `config` names (in a pod: its service account's, from
/// `kube::Config::incluster`).
pub fn client(config: kube::Config) -> Result<Client, String> {
    // Ring, as kube's features ask; whichever call comes first installs it.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::try_from(config).map_err(|e| one_line(&e))
}

/// Claims read from the API server.
#[derive(Clone)]
pub struct ApiClaims {
    client: Client,
}

impl ApiClaims {
    /// Through `client`.
    pub fn new(client: Client) -> ApiClaims {
        ApiClaims { client }
    }
}

impl Claims for ApiClaims {
    async fn get(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        api.get(&claim.name).await.map_err(|e| one_line(&e))
    }
}

/// What a publish did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// There was no slice: it was created.
    Created,
    /// The slice said something else: its spec was replaced.
    Updated,
    /// The slice said this already.
    Unchanged,
}

/// Why the slice could not be published. One line.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The API server refused or could not be reached.
    #[error("ResourceSlice {slice}: {message}")]
    Api {
        /// The slice.
        slice: String,
        /// The API server's answer.
        message: String,
    },
    /// Other writers kept changing the slice.
    #[error("ResourceSlice {0}: changed by another writer at each of {ATTEMPTS} attempts")]
    Contended(String),
}

/// How soon a slice that is missing is published again.
const RETRY: Duration = Duration::from_secs(1);

/// How often a publish reads again after a conflict.
const ATTEMPTS: usize = 5;

/// Keeps this node's slice.
pub struct SlicePublisher {
    api: Api<ResourceSlice>,
    node: String,
}

fn one_line(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        other => other.to_string().replace('\n', " "),
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == code)
}

impl SlicePublisher {
    /// The slice of node `node`, through `client`.
    pub fn new(client: Client, node: &str) -> SlicePublisher {
        SlicePublisher {
            api: Api::all(client),
            node: node.to_owned(),
        }
    }

    /// Makes the API server's slice of this node list `devices`.
    pub async fn publish(&self, devices: &[Device]) -> Result<Published, PublishError> {
        let name = slice_name(&self.node);
        let failed = |e: &kube::Error| PublishError::Api {
            slice: name.clone(),
            message: one_line(e),
        };
        for _ in 0..ATTEMPTS {
            let found = self.api.get_opt(&name).await.map_err(|e| failed(&e))?;
            let Some(found) = found else {
                let new = slice(&self.node, devices.to_vec(), 1);
                match self.api.create(&PostParams::default(), &new).await {
                    Ok(_) => return Ok(Published::Created),
                    Err(e) if is_status(&e, 409) => continue,
                    Err(e) => return Err(failed(&e)),
                }
            };
            let wanted = slice(&self.node, devices.to_vec(), found.spec.pool.generation);
            if found.spec == wanted.spec {
                return Ok(Published::Unchanged);
            }
            let mut new = slice(&self.node, devices.to_vec(), found.spec.pool.generation + 1);
            new.metadata.resource_version = found.metadata.resource_version.clone();
            match self.api.replace(&name, &PostParams::default(), &new).await {
                Ok(_) => return Ok(Published::Updated),
                Err(e) if is_status(&e, 409) || is_status(&e, 404) => continue,
                Err(e) => return Err(failed(&e)),
            }
        }
        Err(PublishError::Contended(name))
    }

    /// Waits until the slice is changed or deleted by another writer (or the watch ends), from
    /// `resource_version`.
    pub async fn changed(&self, resource_version: &str) -> Result<(), PublishError> {
        let name = slice_name(&self.node);
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(290);
        let events = self
            .api
            .watch(&params, resource_version)
            .await
            .map_err(|e| PublishError::Api {
                slice: name.clone(),
                message: one_line(&e),
            })?;
        let mut events = events.boxed();
        while let Ok(Some(event)) = events.try_next().await {
            match event {
                WatchEvent::Modified(_) | WatchEvent::Deleted(_) => return Ok(()),
                WatchEvent::Error(_) => return Ok(()),
                WatchEvent::Added(_) | WatchEvent::Bookmark(_) => {}
            }
        }
        Ok(())
    }

    /// The slice's resource version now, if there is a slice.
    pub async fn resource_version(&self) -> Option<String> {
        let found = self.api.get_opt(&slice_name(&self.node)).await.ok()??;
        found.metadata.resource_version
    }
}

/// Publishes `devices()` now, again every `interval` when it changes, and at once when another
/// writer changes or deletes the slice. Runs until the task is dropped.
pub async fn keep_published<F>(publisher: SlicePublisher, interval: Duration, mut devices: F)
where
    F: FnMut() -> Option<Vec<Device>> + Send,
{
    loop {
        if let Some(now) = devices() {
            match publisher.publish(&now).await {
                Ok(Published::Unchanged) => {}
                Ok(done) => {
                    tracing::info!("ResourceSlice {}: {done:?}", slice_name(&publisher.node))
                }
                Err(e) => tracing::warn!("{e}"),
            }
        }
        // Watched from the version read now: a change after the read is among the events.
        let Some(version) = publisher.resource_version().await else {
            // Deleted since it was published, or not published: again, soon.
            tokio::time::sleep(interval.min(RETRY)).await;
            continue;
        };
        tokio::select! {
            _ = publisher.changed(&version) => {}
            () = tokio::time::sleep(interval) => {}
        }
    }
}
