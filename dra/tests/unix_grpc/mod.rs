//! What the tests that play the kubelet share: a gRPC channel over a unix socket, as the
//! kubelet dials a plugin.

use std::path::Path;

use tonic::transport::{Channel, Endpoint, Uri};

/// A channel to the gRPC server on `socket`.
#[allow(dead_code)] // the soak's kubelet stand-in (examples/kubelet-standin.rs) uses try_channel
pub async fn channel(socket: &Path) -> Channel {
    try_channel(socket)
        .await
        .expect("the plugin's socket answers")
}

/// A channel to the gRPC server on `socket`, or why it does not answer (a plugin that is
/// restarting, or gone).
pub async fn try_channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    // The URI is a placeholder: the connector dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}
