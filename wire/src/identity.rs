//! The vGPU identity: what a container learns of its vGPU, at `/run/gpuplex/vgpu.json`.
//!
//! The hook writes one file per vGPU on the host, in `<socket dir>/identity/`, and the spec (or,
//! for plain runc/crun, the hook inside the container's mount namespace) binds it read-only into
//! the container. A bind mount holds the file's inode, so the file is rewritten in place (when
//! the container id becomes known at `createRuntime`), never replaced by a rename.
//!
//! The directory is mode 0711 and each file 0644: no other user of the host can list which
//! vGPUs and containers there are, while the file stays readable where it is bind-mounted into
//! a container, whatever user the container runs as. Not 0700: a user-namespaced runtime may
//! open the bind mount's source as the container's root, an unprivileged user of the host,
//! which must be able to pass through the directory (ARCHITECTURE.md, trust boundary).
//!
//! A file is named only by a [`VgpuId`] the node service gave (`vgpu-<n>.json`), never by a
//! string a container brought, and no symlink is followed: nothing here can write or remove a
//! file outside the directory. The file of a new vGPU is created, never found: since ids never
//! repeat, a file already there is not this vGPU's, and is not overwritten.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::protocol::VgpuReply;
use gpuplex_scheduler::request::Priority;
use gpuplex_scheduler::VgpuId;
use serde::{Deserialize, Serialize};

/// A container's vGPU, as the container sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    /// The vGPU's id (`vgpu-3`).
    pub vgpu: VgpuId,
    /// The container's id, once known.
    pub container: Option<String>,
    /// The node's name.
    pub node: String,
    /// Its GPUs.
    pub gpus: Vec<IdentityGpu>,
    /// Share weight.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
}

/// One GPU of an [`Identity`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdentityGpu {
    /// UUID (the container's `CUDA_VISIBLE_DEVICES` lists these).
    pub uuid: String,
    /// The GPU's index on the host.
    pub index: u32,
    /// Model name.
    pub model: String,
    /// The vGPU's memory entitlement on it, in bytes.
    pub memory: u64,
}

impl Identity {
    /// The identity of a vGPU the node service assigned.
    pub fn of(reply: &VgpuReply, node: &str) -> Identity {
        Identity {
            vgpu: reply.id,
            container: reply.container.clone(),
            node: node.to_string(),
            gpus: reply
                .gpus
                .iter()
                .map(|g| IdentityGpu {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory: g.memory,
                })
                .collect(),
            weight: reply.weight,
            priority: reply.priority,
        }
    }
}

/// The directory of the identity files: `identity/` beside the node socket.
pub fn identity_dir(socket: &Path) -> PathBuf {
    socket
        .parent()
        .unwrap_or_else(|| Path::new("/run/gpuplex"))
        .join("identity")
}

/// The identity directory's mode: passed through by anyone, listed by root alone.
const DIR_MODE: u32 = 0o711;

/// The identity file of a vGPU.
pub fn identity_file(dir: &Path, vgpu: VgpuId) -> PathBuf {
    dir.join(format!("{vgpu}.json"))
}

/// Creates the identity file of a vGPU just reserved, mode 0644 in a directory of mode 0711;
/// returns its path. Refused
/// when a file of that name exists.
pub fn create(dir: &Path, identity: &Identity) -> std::io::Result<PathBuf> {
    put(dir, identity, true)
}

/// Rewrites a vGPU's identity file in place (creating it if it is gone); returns its path.
pub fn write(dir: &Path, identity: &Identity) -> std::io::Result<PathBuf> {
    put(dir, identity, false)
}

fn put(dir: &Path, identity: &Identity, new: bool) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::fs::PermissionsExt;
    let vgpu = identity.vgpu;
    std::fs::create_dir_all(dir)?;
    if std::fs::metadata(dir)?.permissions().mode() & 0o7777 != DIR_MODE {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE))?;
    }
    let path = identity_file(dir, vgpu);
    let mut bytes = serde_json::to_vec_pretty(identity).expect("an identity always serializes");
    bytes.push(b'\n');
    let mut options = std::fs::OpenOptions::new();
    options
        .write(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    if new {
        options.create_new(true);
    } else {
        options.create(true);
    }
    let mut file = options.open(&path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    file.set_len(0)?;
    // Not flushed to disk: it lives under /run (memory), and a crash before the container
    // starts leaves a container that never ran.
    file.write_all(&bytes)?;
    Ok(path)
}

/// Reads an identity file.
pub fn read(path: &Path) -> std::io::Result<Identity> {
    let bytes = std::fs::read(path)?;
    serde_json::from_slice(&bytes).map_err(std::io::Error::other)
}

/// Removes a vGPU's identity file; an absent one is not an error.
pub fn remove(dir: &Path, vgpu: VgpuId) -> std::io::Result<()> {
    match std::fs::remove_file(identity_file(dir, vgpu)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::AssignedGpu;

    fn reply() -> VgpuReply {
        VgpuReply {
            id: VgpuId(3),
            handle: None,
            container: None,
            gpus: vec![AssignedGpu {
                index: 1,
                uuid: "GPU-fake-1".into(),
                model: "Fake A100".into(),
                memory: 8 << 30,
                device: None,
                fake: true,
            }],
            weight: 2,
            priority: Priority::High,
            cdi: None,
        }
    }

    #[test]
    fn an_identity_is_rewritten_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let identity_dir = identity_dir(&dir.path().join("gpuplex.sock"));
        let mut identity = Identity::of(&reply(), "node-a");
        let path = write(&identity_dir, &identity).unwrap();
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(&path).unwrap().ino();
        identity.container = Some("c0ffee".into());
        assert_eq!(write(&identity_dir, &identity).unwrap(), path);
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode, "same inode");
        assert_eq!(read(&path).unwrap(), identity);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(json["gpus"][0]["uuid"], "GPU-fake-1");
        assert_eq!(json["priority"], "high");
        remove(&identity_dir, VgpuId(3)).unwrap();
        remove(&identity_dir, VgpuId(3)).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_new_identity_never_overwrites_a_file_and_no_link_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity::of(&reply(), "node-a");
        let path = create(dir.path(), &identity).unwrap();
        let err = create(dir.path(), &identity).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        std::fs::remove_file(&path).unwrap();
        let target = dir.path().join("elsewhere.json");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(create(dir.path(), &identity).is_err());
        assert!(write(dir.path(), &identity).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        // Only a vGPU id names a file: an identity naming anything else does not even read.
        let mut bad = serde_json::to_value(&identity).unwrap();
        bad["vgpu"] = "../../../../tmp/x".into();
        let err = serde_json::from_value::<Identity>(bad).unwrap_err();
        assert!(
            err.to_string().contains("a vGPU id such as `vgpu-7`"),
            "{err}"
        );
    }

    /// Issue #33: no other user of the host lists the vGPUs and containers; a container's
    /// user, whoever it is, still reads its own file through the bind mount (here: by name).
    #[test]
    fn another_user_of_the_host_cannot_list_the_identities() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let identity_dir = identity_dir(&dir.path().join("gpuplex.sock"));
        std::fs::create_dir_all(&identity_dir).unwrap();
        std::fs::set_permissions(&identity_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = write(&identity_dir, &Identity::of(&reply(), "node-a")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            mode(&identity_dir),
            0o711,
            "a directory left 0755 is made 0711"
        );
        assert_eq!(mode(&path), 0o644);
        if !is_root() {
            eprintln!(
                "SKIPPED: listing the identities as another user needs root; CI runs it as root"
            );
            return;
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let as_nobody = |program: &str, arg: &Path| {
            std::process::Command::new(program)
                .arg(arg)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        };
        let listed = as_nobody("ls", &identity_dir);
        assert!(
            !listed.status.success(),
            "nobody listed {}",
            identity_dir.display()
        );
        let read = as_nobody("cat", &path);
        assert!(
            read.status.success(),
            "{}",
            String::from_utf8_lossy(&read.stderr)
        );
        assert!(String::from_utf8_lossy(&read.stdout).contains("\"vgpu\": \"vgpu-3\""));
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }
}
