//! Device nodes made inside the container's mount namespace.

use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{makedev, mknodat, Mode, SFlag};
use nix::unistd::{fchownat, Gid, Uid};

use super::ns::{
    container_names, describe, in_mount_namespace, kind, lstat_at, HostRootfs, Rootfs,
};
use super::InjectError;
use crate::spec::DeviceNode;

/// Creates each device node inside the mount namespace of the container process `pid`, at
/// `<rootfs><container_path>`: a character device with the node's major, minor and mode
/// (`file_mode & 0o7777`, exactly: no umask), owned by root. Missing parent directories are
/// made (mode 0755). No symlink inside the rootfs is followed.
///
/// Returns the host paths of what it created, directories included, in creation order, for
/// [`remove_device_nodes`]. A character device with the same major and minor already at a path
/// is kept and not reported; anything else there is [`InjectError::Occupied`]. On an error,
/// what this call created is removed before it returns.
///
/// Works before the container's pivot (its rootfs is then at its host path inside the
/// namespace, the normal case at `createRuntime` and `prestart`) and after it.
pub fn create_device_nodes(
    pid: u32,
    rootfs: &Path,
    devices: &[DeviceNode],
) -> Result<Vec<PathBuf>, InjectError> {
    let host = HostRootfs::of(rootfs)?;
    for device in devices {
        container_names(&device.container_path)?;
    }
    in_mount_namespace(pid, || {
        let root = host.open_inside(pid)?;
        let mut created = Vec::new();
        for device in devices {
            if let Err(error) = create_node(&root, device, &mut created) {
                for path in created.iter().rev() {
                    let _ = root.remove(path);
                }
                return Err(error);
            }
        }
        Ok(created)
    })
}

/// Removes what [`create_device_nodes`] created (`created`, host paths under `rootfs`), in
/// reverse order: nodes, then the directories made for them if they are empty. What is gone
/// already is not an error; on errors the rest is still removed and the first error returned.
pub fn remove_device_nodes(
    pid: u32,
    rootfs: &Path,
    created: &[PathBuf],
) -> Result<(), InjectError> {
    if created.is_empty() {
        return Ok(());
    }
    let host = HostRootfs::of(rootfs)?;
    in_mount_namespace(pid, || {
        let root = host.open_inside(pid)?;
        let mut first_error = None;
        for path in created.iter().rev() {
            if let Err(error) = root.remove(path) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

fn create_node(
    root: &Rootfs,
    device: &DeviceNode,
    created: &mut Vec<PathBuf>,
) -> Result<(), InjectError> {
    let names = container_names(&device.container_path)?;
    let (leaf, parents) = names
        .split_last()
        .expect("container_names gives one name or more");
    let path = root.host_path(&names);
    let rdev = makedev(device.major.into(), device.minor.into());
    let dir = root.open_dir(parents, Some(created))?;
    match lstat_at(&dir, leaf) {
        Ok(None) => {}
        Ok(Some(st)) if kind(&st) == SFlag::S_IFCHR && st.st_rdev == rdev => return Ok(()),
        Ok(Some(st)) => {
            return Err(InjectError::Occupied {
                path,
                found: describe(&st),
                wanted: format!("the character device {}:{}", device.major, device.minor),
            })
        }
        Err(source) => {
            return Err(InjectError::Fs {
                step: "look at",
                path,
                source,
            })
        }
    }
    let mode = Mode::from_bits_truncate(device.file_mode & 0o7777);
    match mknodat(&dir, *leaf, SFlag::S_IFCHR, mode, rdev) {
        Ok(()) => created.push(path.clone()),
        // Made by someone else meanwhile: kept if it is the same node.
        Err(Errno::EEXIST) => return create_node(root, device, created),
        Err(source) => {
            return Err(InjectError::Fs {
                step: "create the device node",
                path,
                source,
            })
        }
    }
    let root_uid = Some(Uid::from_raw(0));
    let root_gid = Some(Gid::from_raw(0));
    fchownat(
        &dir,
        *leaf,
        root_uid,
        root_gid,
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|source| InjectError::Fs {
        step: "give root the device node",
        path,
        source,
    })
}
