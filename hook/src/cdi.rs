//! The CDI edits the node service chose for a vGPU's GPUs (issue #6), applied to a container's
//! `config.json`, and the check that a container does not ask NVIDIA's own runtime for GPUs too.
//!
//! The node service reads the GPUs' CDI spec (`nvidia-ctk cdi generate`) and sends each
//! reservation's edits in its reply, as the protocol's
//! [`CdiEdits`](gpuplex_wire::protocol::cdi::CdiEdits); the hook never reads a spec, so
//! `gpuplex-hook` does not link the CDI crate and its YAML, JSON schema and HTTP dependencies.
//!
//! - [`apply`] writes the edits into a `config.json` value the way CDI does; all or nothing.
//!   What it applies for a vGPU is [`gpuplex_wire::vgpu_edits`]: those edits, then gpuplex's own
//!   (device nodes, `CUDA_VISIBLE_DEVICES`, the identity mount), as [`crate::spec::edit`] does.
//! - [`nvidia_runtime_conflict`] tells when a container asks NVIDIA's own runtime for GPUs too.
//!   It must look at the config *before* [`apply`]: the spec's own hooks are NVIDIA's.
//!
//! Every error is one line naming the device node, hook, entry or field at fault.

mod apply;
mod conflict;
#[cfg(test)]
mod tests;

pub use apply::{apply, ApplyError};
pub use conflict::nvidia_runtime_conflict;

/// The OCI hook stages a CDI hook may name.
pub const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];
