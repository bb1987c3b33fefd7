//! Host character device nodes ([`DeviceNode`]) and where they appear in a container.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use crate::protocol::DeviceNode;

/// The NVIDIA control nodes a container with a GPU also needs, where the host has them.
pub const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// Why a host path is no device node to give a container. One line.
#[derive(Debug, thiserror::Error)]
pub enum HostNodeError {
    /// The path could not be read.
    #[error("cannot read device node {}: {source}", path.display())]
    Stat {
        /// The node.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The path is not a character device.
    #[error("{} is not a character device; a GPU node (real or fake) is made with `mknod PATH c MAJOR MINOR`", path.display())]
    NotCharDevice {
        /// The path.
        path: PathBuf,
    },
}

impl DeviceNode {
    /// The host character device at `path` with its major and minor numbers; a symlink to one
    /// is followed, and `path` stays the link.
    pub fn of_char_device(path: &Path) -> Result<DeviceNode, HostNodeError> {
        let metadata = std::fs::metadata(path).map_err(|source| HostNodeError::Stat {
            path: path.to_path_buf(),
            source,
        })?;
        if !metadata.file_type().is_char_device() {
            return Err(HostNodeError::NotCharDevice {
                path: path.to_path_buf(),
            });
        }
        let rdev = metadata.rdev();
        Ok(DeviceNode {
            path: path.to_path_buf(),
            major: libc::major(rdev),
            minor: libc::minor(rdev),
        })
    }
}

/// Where a host device node appears in the container: its own path when it is under `/dev`,
/// else `/dev/<file name>` (fake GPUs' nodes may live anywhere on the host).
pub fn container_path_of(host: &Path) -> PathBuf {
    let dev = Path::new("/dev");
    let plain = host
        .components()
        .all(|part| !matches!(part, Component::ParentDir | Component::CurDir));
    if plain && host.starts_with(dev) && host != dev {
        return host.to_path_buf();
    }
    match host.file_name() {
        Some(name) => dev.join(name),
        None => host.to_path_buf(),
    }
}

/// The [`CONTROL_NODES`] in the directory `dev` that exist and are character devices, in that
/// order. Each one appears in the container at `/dev/<name>`.
pub fn control_nodes_in(dev: &Path) -> Vec<DeviceNode> {
    CONTROL_NODES
        .iter()
        .filter_map(|name| DeviceNode::of_char_device(&dev.join(name)).ok())
        .collect()
}

/// [`control_nodes_in`] `/dev`.
pub fn control_nodes() -> Vec<DeviceNode> {
    control_nodes_in(Path::new("/dev"))
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn container_path_of_keeps_dev_paths_and_moves_others_to_dev() {
        let table = [
            ("/dev/nvidia0", "/dev/nvidia0"),
            ("/dev/dri/renderD128", "/dev/dri/renderD128"),
            ("/var/lib/gpuplex/fake/nvidia3", "/dev/nvidia3"),
            ("/tmp/x/fakegpu0", "/dev/fakegpu0"),
            ("/dev/../tmp/fakegpu1", "/dev/fakegpu1"),
            ("/devices/nvidia0", "/dev/nvidia0"),
            ("fakegpu2", "/dev/fakegpu2"),
        ];
        for (host, expected) in table {
            assert_eq!(
                container_path_of(Path::new(host)),
                Path::new(expected),
                "{host}"
            );
        }
    }

    #[test]
    fn of_char_device_reads_a_character_device() {
        let null = DeviceNode::of_char_device(Path::new("/dev/null")).unwrap();
        let expected = DeviceNode {
            path: "/dev/null".into(),
            major: 1,
            minor: 3,
        };
        assert_eq!(null, expected);
    }

    #[test]
    fn of_char_device_reads_a_node_made_anywhere() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("fakegpu7");
        let name = CString::new(node.as_os_str().as_bytes()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
        let made =
            unsafe { libc::mknod(name.as_ptr(), libc::S_IFCHR | 0o640, libc::makedev(195, 7)) };
        if made != 0 {
            let err = std::io::Error::last_os_error();
            eprintln!("skipped: mknod needs CAP_MKNOD ({err})");
            return;
        }
        let got = DeviceNode::of_char_device(&node).unwrap();
        let expected = DeviceNode {
            path: node.clone(),
            major: 195,
            minor: 7,
        };
        assert_eq!(got, expected);
    }

    #[test]
    fn of_char_device_refuses_what_is_not_a_character_device() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nvidia0");
        fs::write(&file, "").unwrap();
        let missing = dir.path().join("nvidia1");
        let table = [
            (
                file.clone(),
                format!("{} is not a character device;", file.display()),
            ),
            (
                dir.path().to_path_buf(),
                format!("{} is not a character device;", dir.path().display()),
            ),
            (
                missing.clone(),
                format!(
                    "cannot read device node {}: No such file",
                    missing.display()
                ),
            ),
        ];
        for (path, start) in table {
            let message = DeviceNode::of_char_device(&path).unwrap_err().to_string();
            assert!(message.starts_with(&start), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
    }

    #[test]
    fn control_nodes_in_lists_the_character_devices_present() {
        let dir = tempfile::tempdir().unwrap();
        // Symlinks to /dev/null and /dev/zero stand in for the NVIDIA nodes without root.
        symlink("/dev/zero", dir.path().join("nvidia-uvm-tools")).unwrap();
        symlink("/dev/null", dir.path().join("nvidiactl")).unwrap();
        fs::write(dir.path().join("nvidia-uvm"), "not a device").unwrap();
        let got = control_nodes_in(dir.path());
        let node = |name: &str, minor| DeviceNode {
            path: dir.path().join(name),
            major: 1,
            minor,
        };
        assert_eq!(got, vec![node("nvidiactl", 3), node("nvidia-uvm-tools", 5)]);
        assert_eq!(control_nodes_in(&dir.path().join("absent")), vec![]);
    }
}
