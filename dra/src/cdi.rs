//! A prepared claim's CDI spec: one device, `gpuplex.io/vgpu=<claim uid>`, whose edits are what
//! podman's precreate gives a container with a vGPU ([`vgpu_edits`], defined once in the wire
//! crate: the host CDI spec's edits for its GPUs, which the node service chose, then its GPUs'
//! device nodes and the host's control nodes, `CUDA_VISIBLE_DEVICES`, the identity mounted
//! read-only), and last the attach step ([`gpuplex_wire::attach_step`]). The runtime
//! (containerd's or CRI-O's CDI support, podman's `--device`) applies it to each container of
//! the claim.
//!
//! The spec carries the claim's handle, so it is written for root alone (`0600`): runtimes read
//! it as root.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use gpuplex_wire::protocol::cdi::{CdiEdits, CdiHook};
use gpuplex_wire::protocol::{DeviceNode, VgpuReply};
use gpuplex_wire::vgpu_edits::{vgpu_edits, EditsError};
use serde_json::{json, Value};

/// The CDI kind of the claims' devices.
pub const KIND: &str = "gpuplex.io/vgpu";

/// The CDI version written: the oldest that has every field used (0.5.0: device nodes with a
/// host path, device names that start with a digit), so that older runtimes (podman 4.3,
/// containerd 1.7) read it; 0.7.0 when the host's edits add groups.
fn cdi_version(edits: &CdiEdits) -> &'static str {
    if edits.additional_gids.is_empty() {
        "0.5.0"
    } else {
        "0.7.0"
    }
}

/// Why a claim's spec was not written. One line.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// A claim uid that cannot name a CDI device or a file.
    #[error(
        "claim uid {0:?} cannot name a CDI device: expected 1 to 64 letters, digits and dashes"
    )]
    BadUid(String),
    /// The node service's reply lacks what the spec needs.
    #[error("the node service did not say {0}; is it older than this driver?")]
    Incomplete(&'static str),
    /// The vGPU's edits cannot be made from the node service's reply.
    #[error(transparent)]
    Edits(#[from] EditsError),
    /// The file could not be written or removed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
}

/// Checks that a claim uid can name a CDI device and a file (Kubernetes' uids are UUIDs).
pub fn check_uid(uid: &str) -> Result<(), CdiError> {
    let fine = !uid.is_empty()
        && uid.len() <= 64
        && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !uid.starts_with('-');
    if fine {
        Ok(())
    } else {
        Err(CdiError::BadUid(uid.to_owned()))
    }
}

/// The fully qualified CDI device of claim `uid`.
pub fn device_id(uid: &str) -> String {
    format!("{KIND}={uid}")
}

/// Where claim `uid`'s spec lives in `dir`.
pub fn spec_path(dir: &Path, uid: &str) -> PathBuf {
    dir.join(format!("gpuplex.io-vgpu-{uid}.json"))
}

/// The edits a container of the claim gets: the vGPU's, as podman's precreate applies them
/// ([`vgpu_edits`]: the host spec's for its GPUs, then gpuplex's own), then `attach`, the attach
/// step (none where the container attaches otherwise), last. `control` are the host's control
/// nodes (`/dev/nvidiactl`, ...).
pub fn claim_edits(
    vgpu: &VgpuReply,
    identity_file: &Path,
    control: &[DeviceNode],
    attach: Option<CdiHook>,
) -> Result<CdiEdits, CdiError> {
    let mut edits = vgpu_edits(vgpu, identity_file, control)?;
    edits.hooks.extend(attach);
    Ok(edits)
}

/// The CDI spec of claim `uid` with `edits`, as JSON.
pub fn spec_json(uid: &str, edits: &CdiEdits) -> Value {
    let mut container_edits = serde_json::to_value(edits).expect("CDI edits always serialize");
    if let Value::Object(fields) = &mut container_edits {
        // Provenance, not edits; and CDI leaves out what is empty.
        fields.remove("cdiDevices");
        fields.remove("specFiles");
        fields.retain(|_, v| !matches!(v, Value::Array(a) if a.is_empty()));
    }
    json!({
        "cdiVersion": cdi_version(edits),
        "kind": KIND,
        "devices": [{"name": uid, "containerEdits": container_edits}],
    })
}

/// Writes claim `uid`'s spec into `dir`: a temporary file renamed over it, so that a runtime
/// reads the old spec or the new one, never half of one.
pub fn write(dir: &Path, uid: &str, edits: &CdiEdits) -> Result<PathBuf, CdiError> {
    check_uid(uid)?;
    let path = spec_path(dir, uid);
    let io = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| CdiError::Io {
            action,
            path,
            source,
        }
    };
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let temp = dir.join(format!(".gpuplex.io-vgpu-{uid}.json.tmp"));
    let bytes = serde_json::to_vec_pretty(&spec_json(uid, edits)).expect("JSON");
    // Whatever is at the temporary name (a write cut short, or a file, hard link or symlink
    // planted there) is unlinked, never written through: the spec goes into a file made here,
    // so that it is root's alone (0600) and nowhere but in `dir`.
    match std::fs::remove_file(&temp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io("remove the leftover", &temp)(e))
        }
        _ => {}
    }
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)
        .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()));
    if let Err(source) = written.and_then(|()| std::fs::rename(&temp, &path)) {
        let _ = std::fs::remove_file(&temp);
        return Err(io("write", &path)(source));
    }
    Ok(path)
}

/// Removes claim `uid`'s spec; one that is not there is removed already.
pub fn remove(dir: &Path, uid: &str) -> Result<(), CdiError> {
    check_uid(uid)?;
    let path = spec_path(dir, uid);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(CdiError::Io {
            action: "remove",
            path,
            source: e,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod write_tests;
