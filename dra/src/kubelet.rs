//! The kubelet's gRPC APIs, served on unix sockets: plugin registration (the kubelet finds
//! the socket in `/var/lib/kubelet/plugins_registry/`, asks `GetInfo` and is told where the DRA
//! service is) and the DRA service in versions `v1` and `v1beta1`, both carried out by one
//! [`Driver`]. Each claim of a request gets its own answer; one that fails says why in one line.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::claim::{ClaimRef, DRIVER};
use crate::driver::{Claims, Driver, PreparedDevice};
use crate::proto::registration::registration_server::{Registration, RegistrationServer};
use crate::proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use crate::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};

/// The plugin type a DRA driver registers as.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The DRA services this driver offers, as registration names them.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// Where the kubelet looks for plugins to register.
pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// Where the driver's own socket goes.
pub const PLUGIN_DIR: &str = "/var/lib/kubelet/plugins/gpuplex.io";

/// The two sockets.
#[derive(Clone, Debug)]
pub struct Sockets {
    /// The registration socket (`<registry>/gpuplex.io-reg.sock`).
    pub registration: PathBuf,
    /// The DRA service's socket (`<plugins>/gpuplex.io/dra.sock`).
    pub dra: PathBuf,
}

impl Sockets {
    /// The sockets in the registry directory ([`REGISTRY_DIR`] on a node) and the driver's own
    /// ([`PLUGIN_DIR`]).
    pub fn under(registry: &Path, plugin: &Path) -> Sockets {
        Sockets {
            registration: registry.join(format!("{DRIVER}-reg.sock")),
            dra: plugin.join("dra.sock"),
        }
    }
}

/// Registration: who the driver is and where its service is.
pub struct RegistrationService {
    endpoint: PathBuf,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("the kubelet registered {DRIVER}");
        } else {
            tracing::error!("the kubelet did not register {DRIVER}: {}", status.error);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// The DRA service, both versions over one driver.
pub struct DraService<C> {
    driver: Arc<Driver<C>>,
}

impl<C> Clone for DraService<C> {
    fn clone(&self) -> Self {
        DraService {
            driver: Arc::clone(&self.driver),
        }
    }
}

fn claim_ref(namespace: String, name: String, uid: String) -> ClaimRef {
    ClaimRef {
        namespace,
        name,
        uid,
    }
}

impl<C: Claims> DraService<C> {
    /// Prepares each claim; by uid, its devices or why not.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(String, Result<Vec<PreparedDevice>, String>)> {
        let mut answers = Vec::with_capacity(claims.len());
        for claim in claims {
            let result = self.driver.prepare(&claim).await;
            match &result {
                Ok(_) => tracing::info!("{claim} ({}): prepared", claim.uid),
                Err(e) => tracing::warn!("{claim} ({}): not prepared: {e}", claim.uid),
            }
            answers.push((claim.uid.clone(), result.map_err(|e| e.to_string())));
        }
        answers
    }

    /// Unprepares each claim; by uid, `None` or why not.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, Option<String>)> {
        let mut answers = Vec::with_capacity(claims.len());
        for claim in claims {
            let result = self.driver.unprepare(&claim).await;
            match &result {
                Ok(()) => tracing::info!("{claim} ({}): unprepared", claim.uid),
                Err(e) => tracing::warn!("{claim} ({}): not unprepared: {e}", claim.uid),
            }
            answers.push((claim.uid.clone(), result.err().map(|e| e.to_string())));
        }
        answers
    }
}

/// The DRA service of one API version: the versions' messages are the same, field for field.
macro_rules! dra_version {
    ($v:ident) => {
        #[tonic::async_trait]
        impl<C: Claims> $v::dra_plugin_server::DraPlugin for DraService<C> {
            async fn node_prepare_resources(
                &self,
                request: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims;
                let claims = claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let mut response = $v::NodePrepareResourcesResponse::default();
                for (uid, result) in self.prepare(claims).await {
                    let answer = match result {
                        Ok(devices) => $v::NodePrepareResourceResponse {
                            devices: devices
                                .into_iter()
                                .map(|d| $v::Device {
                                    request_names: vec![d.device.request],
                                    pool_name: d.device.pool,
                                    device_name: d.device.device,
                                    cdi_device_ids: d.cdi_device_ids,
                                })
                                .collect(),
                            error: String::new(),
                        },
                        Err(error) => $v::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        },
                    };
                    response.claims.insert(uid, answer);
                }
                Ok(Response::new(response))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims;
                let claims = claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.name, c.uid))
                    .collect();
                let mut response = $v::NodeUnprepareResourcesResponse::default();
                for (uid, error) in self.unprepare(claims).await {
                    let error = error.unwrap_or_default();
                    response
                        .claims
                        .insert(uid, $v::NodeUnprepareResourceResponse { error });
                }
                Ok(Response::new(response))
            }
        }
    };
}

dra_version!(v1);
dra_version!(v1beta1);

/// Binds a unix socket, replacing a stale file (a socket a previous run left).
pub(crate) fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) => {
            std::fs::remove_file(path)?
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(_) => {}
    }
    UnixListener::bind(path)
}

/// Serves registration and the DRA service until `shutdown` completes; the sockets are
/// removed then, so that the kubelet deregisters the driver.
pub async fn serve<C: Claims>(
    driver: Driver<C>,
    sockets: &Sockets,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let service = DraService {
        driver: Arc::new(driver),
    };
    let dra = bind(&sockets.dra)?;
    let registration = bind(&sockets.registration)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let dra_server = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service))
        .serve_with_incoming_shutdown(UnixListenerStream::new(dra), stopped(stop_rx.clone()));
    let registration_server = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(RegistrationService {
            endpoint: sockets.dra.clone(),
        }))
        .serve_with_incoming_shutdown(UnixListenerStream::new(registration), stopped(stop_rx));
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let (a, b) = tokio::join!(dra_server, registration_server);
    let _ = std::fs::remove_file(&sockets.registration);
    let _ = std::fs::remove_file(&sockets.dra);
    a.and(b).map_err(std::io::Error::other)
}
