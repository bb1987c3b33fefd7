//! gpuplex's injection library and its OCI hook.
//!
//! - [`spec`]: the OCI spec edits that give a container its vGPU (device nodes and allow rules,
//!   `CUDA_VISIBLE_DEVICES`, the identity mount, the vGPU id annotation, the hooks): one function
//!   for podman's `precreate` stage here and the containerd shim later;
//! - [`cdi`]: the NVIDIA Container Toolkit's CDI spec (`nvidia-ctk cdi generate`), read (by the
//!   node service) and applied (by the hook and the shim) for the assigned GPUs only;
//! - [`identity`]: the vGPU identity a container sees at `/run/gpuplex/vgpu.json`;
//! - [`inject`]: what a hook does inside a container that exists already (plain runc and crun
//!   users): device nodes made in its mount namespace, its device cgroup, the identity;
//! - [`oci_state`]: the OCI state a runtime hands its hooks;
//! - [`client`]: the node socket's client (also `gpuplexctl`'s);
//! - [`stages`]: what `gpuplex-hook precreate|createRuntime|prestart|poststop` does.
#![deny(missing_docs)]

pub mod cdi;
pub mod client;
pub mod identity;
pub mod inject;
pub mod oci_state;
pub mod spec;
pub mod stages;
