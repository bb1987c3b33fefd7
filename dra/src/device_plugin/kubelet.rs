//! The device plugin's place on the node: its socket in the kubelet's device plugin directory
//! (`/var/lib/kubelet/device-plugins/`), and its registration on the kubelet's socket there.
//!
//! A kubelet that starts empties that directory and makes its own socket anew: the plugin
//! notices its socket gone or the kubelet's replaced (looked at every `watch_every`), serves on
//! a new socket and registers again.

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::DevicePlugin;
use crate::proto::deviceplugin as dp;
use gpuplex_scheduler::units::RESOURCE;

/// The kubelet's registration socket on a node.
pub const KUBELET_SOCKET: &str = "/var/lib/kubelet/device-plugins/kubelet.sock";

/// The plugin's socket, by its name in the same directory.
pub const PLUGIN_SOCKET: &str = "gpuplex-gpu-memory.sock";

/// The device plugin API version registered.
const VERSION: &str = "v1beta1";

/// Where the kubelet's socket is, and so where the plugin's goes.
#[derive(Clone, Debug)]
pub struct DevicePluginPaths {
    /// The kubelet's registration socket ([`KUBELET_SOCKET`] on a node).
    pub kubelet: PathBuf,
}

impl DevicePluginPaths {
    /// The plugin's socket: [`PLUGIN_SOCKET`] beside the kubelet's.
    pub fn plugin(&self) -> PathBuf {
        self.kubelet.with_file_name(PLUGIN_SOCKET)
    }
}

/// Which file a socket is (device, inode, and its change time: a socket made again at once
/// may get the inode number of the one it replaces); `None` when it is not there.
fn identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// A gRPC channel to the unix socket at `path`.
async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is a placeholder: the connector dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

/// Registers the plugin with the kubelet at `kubelet`; the error is one line.
async fn register(kubelet: &Path) -> Result<(), String> {
    let channel = dial(kubelet)
        .await
        .map_err(|e| format!("cannot reach the kubelet at {}: {e}", kubelet.display()))?;
    let mut client = dp::registration_client::RegistrationClient::new(channel);
    client
        .register(dp::RegisterRequest {
            version: VERSION.to_owned(),
            endpoint: PLUGIN_SOCKET.to_owned(),
            resource_name: RESOURCE.to_owned(),
            options: Some(super::options()),
        })
        .await
        .map_err(|e| format!("the kubelet refused the registration: {}", e.message()))?;
    Ok(())
}

/// Serves `plugin` beside the kubelet's socket and registers it, again after each kubelet
/// restart, until `shutdown` completes; its socket is removed then.
pub async fn serve(
    plugin: DevicePlugin,
    paths: &DevicePluginPaths,
    watch_every: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let socket = paths.plugin();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopping = || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    loop {
        let listener = crate::kubelet::bind(&socket)?;
        let ours = identity(&socket);
        let (end_tx, end_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(dp::device_plugin_server::DevicePluginServer::new(
                plugin.clone(),
            ))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = end_rx.await;
            });
        let server = tokio::spawn(server);
        // Registered once the kubelet answers; until then, and after, both sockets are watched.
        let mut registered_with = None;
        let restart = loop {
            let kubelet = identity(&paths.kubelet);
            if registered_with.is_none() && kubelet.is_some() {
                match register(&paths.kubelet).await {
                    Ok(()) => {
                        tracing::info!(
                            "{RESOURCE}: registered with the kubelet ({}), serving {}",
                            paths.kubelet.display(),
                            socket.display()
                        );
                        registered_with = kubelet;
                    }
                    Err(e) => tracing::warn!("{RESOURCE}: {e}; trying again"),
                }
            }
            tokio::select! {
                () = stopping() => break false,
                () = tokio::time::sleep(watch_every) => {}
            }
            if identity(&socket) != ours {
                tracing::info!(
                    "{RESOURCE}: {} was removed (the kubelet restarted?): serving again",
                    socket.display()
                );
                break true;
            }
            if registered_with.is_some() && identity(&paths.kubelet) != registered_with {
                tracing::info!("{RESOURCE}: the kubelet's socket is new (the kubelet restarted): registering again");
                break true;
            }
        };
        let _ = end_tx.send(());
        let served = server.await.map_err(std::io::Error::other)?;
        if identity(&socket) == ours {
            let _ = std::fs::remove_file(&socket);
        }
        served.map_err(std::io::Error::other)?;
        if !restart {
            return Ok(());
        }
    }
}
