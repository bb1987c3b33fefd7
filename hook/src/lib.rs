//! gpuplex's injection library and its OCI hook.
//!
//! - [`spec`]: the OCI spec edits that give a container its vGPU: its CDI edits
//!   ([`gpuplex_wire::vgpu_edits`]: device nodes, `CUDA_VISIBLE_DEVICES`, the identity mount,
//!   after the host spec's for its GPUs) applied, then the vGPU id annotation and the hooks: one
//!   function for podman's `precreate` stage and the containerd shim's `Create`;
//! - [`cdi`]: CDI edits applied to a `config.json` the way CDI does (the vGPU's, which include
//!   those the node service chose from the GPUs' CDI spec), and the check that a container does
//!   not ask NVIDIA's runtime for GPUs too;
//! - [`inject`]: what a hook does inside a container that exists already (plain runc and crun
//!   users): device nodes made in its mount namespace, its device cgroup, the identity;
//! - [`classify`]: where a container's vGPU comes from (annotations, a claim, the device
//!   plugin's allocation), decided from its spec alone: for the containerd shim and the NRI
//!   plugin;
//! - [`oci_state`]: the OCI state a runtime hands its hooks;
//! - [`stages`]: what `gpuplex-hook precreate|createRuntime|prestart|poststop|attach` does
//!   (`attach` is a Kubernetes claim's attach step, [`gpuplex_wire::attach_step`]).
//!
//! It finds and talks to the node service with `gpuplex-wire` (the configuration, the
//! socket's client, the identity files and what a vGPU's container gets), as `gpuplexctl`, the
//! containerd shim, the NRI plugin and the DRA driver do.
#![deny(missing_docs)]

pub mod cdi;
pub mod classify;
pub mod inject;
pub mod oci_state;
pub mod spec;
pub mod stages;
