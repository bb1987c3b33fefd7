//! What a container with a vGPU gets, defined once: [`vgpu_edits`] turns the node service's
//! reply for a vGPU into CDI edits ([`CdiEdits`]). podman's `precreate` and the containerd
//! shim apply them to the container's `config.json` (the hook's `cdi::apply`), the plain runc
//! hook makes their device nodes in a running container, and the DRA driver writes them into a
//! claim's (or an allocation's) CDI spec, which the runtime applies.
//!
//! The edits, in this order:
//!
//! | edits | what |
//! |---|---|
//! | the host's | the edits the node service chose from the GPUs' CDI spec (`cdi` in the reply), when the node has one |
//! | `deviceNodes` | each GPU's node, as the reply names it: `path` [`container_path_of`] the host node, `hostPath`, type `c`, the reply's major and minor, `fileMode` `0o666`, `uid` and `gid` 0, `permissions` `rwm`; then the control nodes given (`/dev/nvidiactl`, ...: [`control_nodes`]), alike |
//! | `env` | `CUDA_VISIBLE_DEVICES=<the GPUs' UUIDs, joined by ,>` ([`VISIBLE_DEVICES`]) |
//! | `mounts` | the identity file, bound read-only at [`IDENTITY_PATH`] with [`IDENTITY_MOUNT_OPTIONS`] |
//!
//! A later CDI edit of the same device path, variable or mount destination replaces an earlier
//! one, so gpuplex's own edits win over the host spec's, and the identity mount is the last
//! mount: it lands on top of a tmpfs an earlier mount puts on `/run` (podman's `--read-only`).

mod device_nodes;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use gpuplex_scheduler::VgpuId;

use crate::protocol::cdi::{CdiDeviceNode, CdiEdits, CdiMount};
use crate::protocol::{DeviceNode, VgpuReply};

pub use device_nodes::{
    container_path_of, control_nodes, control_nodes_in, HostNodeError, CONTROL_NODES,
};

/// Where the container sees its vGPU identity.
pub const IDENTITY_PATH: &str = "/run/gpuplex/vgpu.json";
/// The variable that names the container's GPUs (their UUIDs) to CUDA.
pub const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// The mount options of the identity bind mount.
pub const IDENTITY_MOUNT_OPTIONS: [&str; 5] = ["bind", "ro", "nosuid", "nodev", "noexec"];
/// The permission bits of every device node gpuplex gives a container.
pub const NODE_FILE_MODE: u32 = 0o666;
/// The device cgroup access of every device node gpuplex gives a container.
pub const NODE_ACCESS: &str = "rwm";

/// Why a vGPU's edits cannot be made from the node service's reply. One line.
#[derive(Debug, thiserror::Error)]
pub enum EditsError {
    /// The reply names no GPU.
    #[error("gpuplex edits for {vgpu}: the node service's reply names no GPU (an assignment has at least one)")]
    NoGpu {
        /// The vGPU.
        vgpu: VgpuId,
    },
    /// A GPU of the reply has no device node.
    #[error("gpuplex edits for {vgpu}: the node service did not say which device node is GPU {gpu}; is the node service older than this program?")]
    NoDeviceNode {
        /// The vGPU.
        vgpu: VgpuId,
        /// The GPU's index on the host.
        gpu: u32,
    },
    /// A GPU UUID that cannot be listed in `CUDA_VISIBLE_DEVICES`.
    #[error("gpuplex edits for {vgpu}: GPU UUID {uuid:?} cannot go in {VISIBLE_DEVICES}: it is empty or has a comma or whitespace")]
    BadUuid {
        /// The vGPU.
        vgpu: VgpuId,
        /// The UUID.
        uuid: String,
    },
    /// A path that is not absolute or not UTF-8.
    #[error("gpuplex edits for {vgpu}: {what} {} must be an absolute UTF-8 path", path.display())]
    BadPath {
        /// The vGPU.
        vgpu: VgpuId,
        /// Which path: `identity file`, `device node`.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
}

/// The CDI edits that give a container the vGPU of `vgpu` (see the module docs): the host
/// spec's, then its GPUs' device nodes, the `control` nodes, `CUDA_VISIBLE_DEVICES` and the
/// identity file `identity_file` (an absolute host path) mounted read-only. The provenance of
/// the host's edits (`cdi_devices`, `spec_files`) is kept.
pub fn vgpu_edits(
    vgpu: &VgpuReply,
    identity_file: &Path,
    control: &[DeviceNode],
) -> Result<CdiEdits, EditsError> {
    let id = vgpu.id;
    if vgpu.gpus.is_empty() {
        return Err(EditsError::NoGpu { vgpu: id });
    }
    let unfit =
        |uuid: &str| uuid.is_empty() || uuid.contains(',') || uuid.contains(char::is_whitespace);
    if let Some(gpu) = vgpu.gpus.iter().find(|gpu| unfit(&gpu.uuid)) {
        let uuid = gpu.uuid.clone();
        return Err(EditsError::BadUuid { vgpu: id, uuid });
    }
    let source = absolute(identity_file).ok_or_else(|| EditsError::BadPath {
        vgpu: id,
        what: "identity file",
        path: identity_file.to_path_buf(),
    })?;
    let mut edits = vgpu.cdi.clone().unwrap_or_default();
    for gpu in &vgpu.gpus {
        let device = gpu.device.as_ref().ok_or(EditsError::NoDeviceNode {
            vgpu: id,
            gpu: gpu.index,
        })?;
        edits.device_nodes.push(node_edit(id, device)?);
    }
    for node in control {
        edits.device_nodes.push(node_edit(id, node)?);
    }
    let uuids: Vec<&str> = vgpu.gpus.iter().map(|gpu| gpu.uuid.as_str()).collect();
    edits
        .env
        .push(format!("{VISIBLE_DEVICES}={}", uuids.join(",")));
    edits.mounts.push(CdiMount {
        host_path: source.to_owned(),
        container_path: IDENTITY_PATH.to_owned(),
        mount_type: Some("bind".to_owned()),
        options: IDENTITY_MOUNT_OPTIONS.map(str::to_owned).to_vec(),
    });
    Ok(edits)
}

/// `path` as text when it is absolute and UTF-8.
fn absolute(path: &Path) -> Option<&str> {
    path.to_str().filter(|_| path.is_absolute())
}

/// The CDI device node of a host character device `node`.
fn node_edit(vgpu: VgpuId, node: &DeviceNode) -> Result<CdiDeviceNode, EditsError> {
    let bad = |path: &Path| EditsError::BadPath {
        vgpu,
        what: "device node",
        path: path.to_path_buf(),
    };
    let host = node.path.to_str().ok_or_else(|| bad(&node.path))?;
    let inside = container_path_of(&node.path);
    let inside = absolute(&inside).ok_or_else(|| bad(&node.path))?;
    Ok(CdiDeviceNode {
        path: inside.to_owned(),
        host_path: Some(host.to_owned()),
        node_type: Some("c".to_owned()),
        major: Some(node.major.into()),
        minor: Some(node.minor.into()),
        file_mode: Some(NODE_FILE_MODE),
        permissions: Some(NODE_ACCESS.to_owned()),
        uid: Some(0),
        gid: Some(0),
    })
}
