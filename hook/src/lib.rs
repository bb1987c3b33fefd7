//! gpuplex's injection library and its OCI hook.
//!
//! - [`spec`]: the OCI spec edits that give a container its vGPU (device nodes and allow rules,
//!   `CUDA_VISIBLE_DEVICES`, the identity mount, the vGPU id annotation, the hooks): one function
//!   for podman's `precreate` stage and the containerd shim's `Create`;
//! - [`cdi`]: the CDI edits the node service chose from the GPUs' CDI spec, applied (by the hook
//!   and the shim) for the assigned GPUs only;
//! - [`inject`]: what a hook does inside a container that exists already (plain runc and crun
//!   users): device nodes made in its mount namespace, its device cgroup, the identity;
//! - [`oci_state`]: the OCI state a runtime hands its hooks;
//! - [`stages`]: what `gpuplex-hook precreate|createRuntime|prestart|poststop|attach` does;
//! - [`claim`]: a Kubernetes claim's attach step, the hook its CDI spec carries.
//!
//! It finds and talks to the node service with `gpuplex-wire` (the configuration, the
//! socket's client and the identity files), as `gpuplexctl` and the containerd shim do.
#![deny(missing_docs)]

pub mod cdi;
pub mod claim;
pub mod inject;
pub mod oci_state;
pub mod spec;
pub mod stages;
