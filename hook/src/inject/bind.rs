//! The vGPU identity, bind-mounted read-only into the container's mount namespace.
//!
//! Two ways to get the host's file there, tried in this order:
//! 1. Before the pivot the namespace still has (a copy of) the host's mounts, so the host path
//!    usually names the same file inside it: checked by device and inode, then bound with a
//!    plain `mount(MS_BIND)`.
//! 2. Otherwise (the file is on a mount the namespace does not have, e.g. one made after the
//!    container was created with private propagation, or the container has pivoted already):
//!    a detached copy of the file's mount is taken in the host namespace with
//!    `open_tree(OPEN_TREE_CLONE)` before entering, and attached with `move_mount`. Binding
//!    from `/proc/self/fd/N` instead does not work: the kernel refuses (EINVAL) to bind a
//!    mount of another namespace.
//!
//! Either way the mount is then remounted read-only (and nosuid, nodev, noexec).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use gpuplex_wire::vgpu_edits::IDENTITY_PATH;
use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{Mode, SFlag};
use rustix::mount::{MoveMountFlags, OpenTreeFlags};

use super::ns::{describe, in_mount_namespace, kind, lstat_at, HostRootfs, Rootfs};
use super::InjectError;

/// What [`bind_identity`] added, for [`unbind_identity`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityMount {
    /// The mount point, as the host names it: `<rootfs>/run/gpuplex/vgpu.json`.
    pub target: PathBuf,
    /// What was created for the mount point (directories, then the empty file), as host
    /// paths, in creation order.
    pub created: Vec<PathBuf>,
}

/// Makes `identity_file` (a host path) visible read-only at [`IDENTITY_PATH`] inside the mount
/// namespace of the container process `pid`: creates the mount point under `rootfs` (missing
/// directories, mode 0755, and an empty file, mode 0644; no symlink followed), bind-mounts the
/// file there and remounts it read-only. The host's own namespace gains no mount.
///
/// A read-only rootfs (`root.readonly`) is no obstacle at `createRuntime` with runc, which makes
/// it read-only only after the pivot; where the mount point cannot be made, the error is
/// [`InjectError::Fs`] with the path and a hint. On an error, what this call created is removed.
pub fn bind_identity(
    pid: u32,
    rootfs: &Path,
    identity_file: &Path,
) -> Result<IdentityMount, InjectError> {
    let host = HostRootfs::of(rootfs)?;
    let identity_error = |source| InjectError::Identity {
        path: identity_file.to_path_buf(),
        source,
    };
    let file = File::open(identity_file).map_err(identity_error)?;
    let meta = file.metadata().map_err(identity_error)?;
    if !meta.is_file() {
        return Err(InjectError::InvalidPath {
            path: identity_file.to_path_buf(),
            reason: "the vGPU identity must be a regular file",
        });
    }
    let source = Source {
        path: identity_file,
        dev: meta.dev(),
        ino: meta.ino(),
        tree: clone_mount(&file),
    };
    in_mount_namespace(pid, move || {
        let root = host.open_inside(pid)?;
        let names = identity_names();
        let mut created = Vec::new();
        match attach(pid, &root, &names, &source, &mut created) {
            Ok(()) => Ok(IdentityMount {
                target: root.host_path(&names),
                created,
            }),
            Err(error) => {
                for path in created.iter().rev() {
                    let _ = root.remove(path);
                }
                Err(error)
            }
        }
    })
}

/// Undoes [`bind_identity`]: unmounts the identity inside the mount namespace of process `pid`
/// and removes the mount point and directories it created (a directory only when empty).
/// What is gone already is not an error.
pub fn unbind_identity(pid: u32, rootfs: &Path, mount: &IdentityMount) -> Result<(), InjectError> {
    let host = HostRootfs::of(rootfs)?;
    in_mount_namespace(pid, || {
        let root = host.open_inside(pid)?;
        let names = root.names_of(&mount.target)?;
        let inside = root.inside_path(&names);
        match umount2(&inside, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) | Err(Errno::EINVAL | Errno::ENOENT) => {}
            Err(source) => {
                return Err(InjectError::Mount {
                    pid,
                    step: "unmount the vGPU identity at",
                    path: mount.target.clone(),
                    source,
                })
            }
        }
        let mut first_error = None;
        for path in mount.created.iter().rev() {
            if let Err(error) = root.remove(path) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

/// The identity file as the host has it.
struct Source<'a> {
    path: &'a Path,
    dev: u64,
    ino: u64,
    /// A detached copy of its mount, or why there is none.
    tree: Result<OwnedFd, Errno>,
}

fn identity_names() -> Vec<&'static OsStr> {
    Path::new(IDENTITY_PATH)
        .iter()
        .skip(1)
        .map(OsStr::new)
        .collect()
}

fn attach(
    pid: u32,
    root: &Rootfs,
    names: &[&OsStr],
    source: &Source,
    created: &mut Vec<PathBuf>,
) -> Result<(), InjectError> {
    let (leaf, parents) = names.split_last().expect("IDENTITY_PATH has names");
    let host_path = root.host_path(names);
    let dir = root.open_dir(parents, Some(created))?;
    let fs_error = |step, source| InjectError::Fs {
        step,
        path: host_path.clone(),
        source,
    };
    match lstat_at(&dir, leaf).map_err(|e| fs_error("look at", e))? {
        None => {
            let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW;
            openat(
                &dir,
                *leaf,
                flags | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o644),
            )
            .map_err(|e| fs_error("create the mount point", e))?;
            created.push(host_path.clone());
        }
        Some(st) if kind(&st) == SFlag::S_IFREG => {}
        Some(st) => {
            return Err(InjectError::Occupied {
                path: host_path,
                found: describe(&st),
                wanted: "a regular file (the vGPU identity's mount point)".into(),
            })
        }
    }
    let target = openat(
        &dir,
        *leaf,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| fs_error("open the mount point", e))?;
    let inside = root.inside_path(names);
    let mount_error = |step, source| InjectError::Mount {
        pid,
        step,
        path: host_path.clone(),
        source,
    };
    let visible = nix::sys::stat::stat(source.path)
        .is_ok_and(|st| st.st_dev == source.dev && st.st_ino == source.ino);
    if visible {
        mount(
            Some(source.path),
            &inside,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| mount_error("bind-mount the vGPU identity onto", e))?;
    } else {
        match &source.tree {
            Ok(tree) => move_mount(tree, &target)
                .map_err(|e| mount_error("move the vGPU identity's mount onto", e))?,
            Err(errno) => {
                return Err(InjectError::IdentityNotVisible {
                    pid,
                    path: source.path.to_path_buf(),
                    source: *errno,
                })
            }
        }
    }
    let read_only = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | MsFlags::MS_NOEXEC;
    if let Err(e) = mount(None::<&str>, &inside, None::<&str>, read_only, None::<&str>) {
        let _ = umount2(&inside, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW);
        return Err(mount_error("remount read-only the vGPU identity at", e));
    }
    Ok(())
}

/// A detached copy of the mount of `file` (`open_tree(OPEN_TREE_CLONE)`), taken in the
/// caller's namespace, that `move_mount` can attach in another one.
fn clone_mount(file: &File) -> Result<OwnedFd, Errno> {
    let flags = OpenTreeFlags::OPEN_TREE_CLONE
        | OpenTreeFlags::OPEN_TREE_CLOEXEC
        | OpenTreeFlags::AT_EMPTY_PATH;
    rustix::mount::open_tree(file, "", flags).map_err(|e| Errno::from_raw(e.raw_os_error()))
}

/// Attaches the detached mount `tree` onto the file `target` (both fds).
fn move_mount(tree: &OwnedFd, target: &OwnedFd) -> Result<(), Errno> {
    let flags = MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH;
    rustix::mount::move_mount(tree, "", target, "", flags)
        .map_err(|e| Errno::from_raw(e.raw_os_error()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_path_names() {
        assert_eq!(identity_names(), ["run", "gpuplex", "vgpu.json"]);
    }
}
