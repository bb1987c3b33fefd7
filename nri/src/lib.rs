//! gpuplex's NRI plugin: a vGPU and execution windows for the containers of a runtime that
//! implements NRI, the Node Resource Interface (containerd 1.7 and 2.x, CRI-O), with the
//! runtime's own shim left in place.
//!
//! - [`mux`] and [`ttrpc`]: NRI's wire: two ttrpc connections over one unix socket, framed;
//! - [`session`]: one connection to the runtime, from registration to its end, serving the
//!   runtime's calls through a [`session::Handler`];
//! - [`plugin`]: the handler, gpuplex's answers to NRI's events (create: reserve and adjust;
//!   start: attach; stop and removal: release; synchronisation: attach what was missed);
//! - [`spec`]: a container as NRI describes it turned into the OCI spec gpuplex's classify
//!   and precreate edit read, and their edit turned back into NRI's adjustment;
//! - [`node`]: the node service, from the plugin's side, behind one trait.
//!
//! The decisions are the containerd shim's and podman's precreate's, reused: which vGPU a
//! container gets is `gpuplex_hook::classify`, the reservation and its edits are
//! `gpuplex_hook::stages::prepare`, the trust rules are theirs.
#![deny(missing_docs)]

pub mod mux;
pub mod node;
pub mod plugin;
pub mod session;
pub mod spec;
pub mod ttrpc;

/// The protobuf messages, generated from `proto/`.
#[allow(missing_docs)]
pub mod proto {
    /// NRI's plugin API (`nri.pkg.api.v1alpha1`), the part gpuplex uses.
    pub mod nri {
        include!(concat!(env!("OUT_DIR"), "/nri.pkg.api.v1alpha1.rs"));
    }
    /// ttrpc's request and response bodies.
    pub mod ttrpc {
        include!(concat!(env!("OUT_DIR"), "/ttrpc.rs"));
    }
}
