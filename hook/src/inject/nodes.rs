//! Device nodes made inside the container's mount namespace.

use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{makedev, mknodat, Mode, SFlag};
use nix::unistd::{fchownat, Gid, Uid};

use super::ns::{
    container_names, describe, in_mount_namespace, kind, lstat_at, HostRootfs, Rootfs,
};
use gpuplex_wire::protocol::cdi::CdiDeviceNode;
use gpuplex_wire::vgpu_edits::NODE_FILE_MODE;

use super::InjectError;

/// The major and minor numbers of a device node of the edits, which must be a character device
/// (type `c`, or none) with both numbers given.
pub(super) fn char_numbers(device: &CdiDeviceNode) -> Result<(u32, u32), InjectError> {
    let char_type = matches!(device.node_type.as_deref(), None | Some("c"));
    let number = |n: Option<i64>| n.and_then(|n| u32::try_from(n).ok());
    match (number(device.major), number(device.minor)) {
        (Some(major), Some(minor)) if char_type => Ok((major, minor)),
        _ => Err(InjectError::NotACharNode {
            path: device.path.clone(),
        }),
    }
}

/// Creates each device node of the edits inside the mount namespace of the container process
/// `pid`, at `<rootfs><path>`: a character device with the node's major, minor and mode
/// (`fileMode & 0o7777`, exactly: no umask; 0o666 when the edits give none), owned by root.
/// Missing parent directories are made (mode 0755). No symlink inside the rootfs is followed.
/// A node that is no character device with both numbers is [`InjectError::NotACharNode`].
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
    devices: &[CdiDeviceNode],
) -> Result<Vec<PathBuf>, InjectError> {
    let host = HostRootfs::of(rootfs)?;
    for device in devices {
        container_names(Path::new(&device.path))?;
        char_numbers(device)?;
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
    device: &CdiDeviceNode,
    created: &mut Vec<PathBuf>,
) -> Result<(), InjectError> {
    let names = container_names(Path::new(&device.path))?;
    let (major, minor) = char_numbers(device)?;
    let (leaf, parents) = names
        .split_last()
        .expect("container_names gives one name or more");
    let path = root.host_path(&names);
    let rdev = makedev(major.into(), minor.into());
    let dir = root.open_dir(parents, Some(created))?;
    match lstat_at(&dir, leaf) {
        Ok(None) => {}
        Ok(Some(st)) if kind(&st) == SFlag::S_IFCHR && st.st_rdev == rdev => return Ok(()),
        Ok(Some(st)) => {
            return Err(InjectError::Occupied {
                path,
                found: describe(&st),
                wanted: format!("the character device {major}:{minor}"),
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
    let mode = Mode::from_bits_truncate(device.file_mode.unwrap_or(NODE_FILE_MODE) & 0o7777);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(node_type: Option<&str>, major: Option<i64>, minor: Option<i64>) -> CdiDeviceNode {
        CdiDeviceNode {
            path: "/dev/nvidia0".into(),
            node_type: node_type.map(String::from),
            major,
            minor,
            ..CdiDeviceNode::default()
        }
    }

    #[test]
    fn only_character_devices_with_both_numbers_are_made() {
        let table = [
            (node(Some("c"), Some(195), Some(0)), Some((195, 0))),
            (node(None, Some(195), Some(255)), Some((195, 255))),
            (node(Some("b"), Some(8), Some(0)), None),
            (node(Some("p"), None, None), None),
            (node(Some("c"), None, Some(0)), None),
            (node(Some("c"), Some(195), None), None),
            (node(Some("c"), Some(-1), Some(0)), None),
            (node(Some("c"), Some(195), Some(1 << 32)), None),
        ];
        for (device, expected) in table {
            match (char_numbers(&device), expected) {
                (Ok(numbers), Some(expected)) => assert_eq!(numbers, expected, "{device:?}"),
                (Err(error), None) => assert_eq!(
                    error.to_string(),
                    "cannot inject device node /dev/nvidia0: a running container is given character devices with their major and minor numbers only"
                ),
                (got, _) => panic!("{device:?}: {got:?}"),
            }
        }
    }
}
