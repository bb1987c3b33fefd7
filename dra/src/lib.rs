//! gpuplex's Kubernetes DRA driver, `gpuplex.io`: the kubelet plugin that prepares a
//! ResourceClaim kube-scheduler allocated on this node as a vGPU pinned where it was placed, and
//! gives the kubelet a CDI device for it.
//!
//! - [`apiserver`]: claims read from the API server, the slice published, watched and kept;
//! - [`claim`]: a ResourceClaim read into a placement and a configuration (pure);
//! - [`cdi`]: the claim's CDI spec, written where the runtime reads specs;
//! - [`driver`]: `NodePrepareResources` and `NodeUnprepareResources`, carried out against the
//!   node service;
//! - [`slice`]: the ResourceSlice this node publishes: a device per GPU, its memory consumable;
//! - [`device_plugin`]: for clusters without DRA, the device plugin of the extended resource
//!   `gpuplex.io/gpu-memory` (units per GPU), served on the kubelet's device plugin socket;
//! - [`kubelet`]: the kubelet's gRPC APIs (plugin registration, DRA `v1` and `v1beta1`), served
//!   on unix sockets;
//! - [`proto`]: the generated protobuf types and services.
#![deny(missing_docs)]

pub mod apiserver;
pub mod cdi;
pub mod claim;
pub mod device_plugin;
pub mod driver;
pub mod kubelet;
pub mod slice;

/// The kubelet's gRPC APIs, generated from `proto/` (written for gpuplex from the published
/// API definitions).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    /// Plugin registration (`pluginregistration`).
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
    /// DRA, version v1 (`k8s.io.kubelet.pkg.apis.dra.v1`).
    pub mod dra_v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// DRA, version v1beta1 (`k8s.io.kubelet.pkg.apis.dra.v1beta1`).
    pub mod dra_v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
    /// Device plugins, version v1beta1 (`v1beta1`).
    pub mod deviceplugin {
        tonic::include_proto!("v1beta1");
    }
}
