//! The CDI edits a reservation's reply carries (`cdi` in [`super::VgpuReply`]): what the node
//! service chose from the GPUs' CDI spec for the assigned GPUs, in the form the hook and the
//! containerd shim apply to a container's `config.json`. The field names and their JSON are
//! CDI's own (`containerEdits`: `env`, `deviceNodes`, `mounts`, `hooks`, `additionalGids`), plus
//! where the edits come from, for messages.
//!
//! Only the types: reading a spec is the node service's, applying the edits the hook's.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A device node to give the container, as the CDI spec has it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDeviceNode {
    /// Where it appears in the container.
    pub path: String,
    /// The node on the host, when not `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c`, `b`, `u` or `p`; read from the host node when absent.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    /// The major number; read from the host node when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// The minor number; read with the major number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// The node's permission bits in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    /// The device cgroup access (`rwm` when absent, none at all for `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    /// The node's owner (the process's uid when absent and not root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The node's group (the process's gid when absent and not root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// A mount to add to the container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiMount {
    /// The mount's source on the host.
    pub host_path: String,
    /// Its destination in the container.
    pub container_path: String,
    /// The file system type (NVIDIA's bind mounts have none, only the `bind` option).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub mount_type: Option<String>,
    /// The mount options.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// An OCI hook to add to the container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiHook {
    /// The OCI hook stage it runs at (`createRuntime`, `createContainer`, ...).
    pub hook_name: String,
    /// The program, an absolute path on the host.
    pub path: String,
    /// `argv`, `argv[0]` included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// The hook's environment (`KEY=value`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Seconds before the runtime gives up on the hook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

/// The edits for one assignment, merged: the spec-wide edits first, then each GPU's. The node
/// service sends them with a reservation (`cdi` in its reply), in this form.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CdiEdits {
    /// `KEY=value` entries; a later one replaces an earlier one of the same name.
    pub env: Vec<String>,
    /// Device nodes; a later one replaces an earlier one of the same `path`.
    pub device_nodes: Vec<CdiDeviceNode>,
    /// Mounts; a later one replaces an earlier one of the same `container_path`.
    pub mounts: Vec<CdiMount>,
    /// Hooks, in the order they run within their stage.
    pub hooks: Vec<CdiHook>,
    /// Supplementary groups for the container's process.
    pub additional_gids: Vec<u32>,
    /// The devices the edits come from, fully qualified (`nvidia.com/gpu=GPU-…`), for logs.
    pub cdi_devices: Vec<String>,
    /// The spec files the edits come from, for logs.
    pub spec_files: Vec<PathBuf>,
}

impl CdiEdits {
    /// Appends `other`'s edits (not its provenance) after this one's.
    pub fn append(&mut self, other: &CdiEdits) {
        self.env.extend_from_slice(&other.env);
        self.device_nodes.extend_from_slice(&other.device_nodes);
        self.mounts.extend_from_slice(&other.mounts);
        self.hooks.extend_from_slice(&other.hooks);
        self.additional_gids
            .extend_from_slice(&other.additional_gids);
    }

    /// Whether there is nothing to apply.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
            && self.additional_gids.is_empty()
    }
}
