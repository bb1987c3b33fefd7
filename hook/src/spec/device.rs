//! Host character device nodes and where they appear in a container.

use std::path::{Component, Path, PathBuf};

use gpuplex_cgroup::DeviceNumbers;

use super::SpecError;

/// The NVIDIA control nodes a container with a GPU also needs, where the host has them.
pub const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// A character device node to give a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    /// The node on the host.
    pub host_path: PathBuf,
    /// Where it appears in the container.
    pub container_path: PathBuf,
    /// Its major number.
    pub major: u32,
    /// Its minor number.
    pub minor: u32,
    /// Its permission bits, such as `0o666`.
    pub file_mode: u32,
}

impl DeviceNode {
    /// Reads the major/minor numbers and permission bits of a host node, which must be a
    /// character device (a symlink to one is followed; `host_path` stays the link). The
    /// container path is [`container_path_of`]`(host_path)`.
    pub fn from_host(host_path: &Path) -> Result<DeviceNode, SpecError> {
        let found = DeviceNumbers::char_device(host_path).map_err(|source| SpecError::Stat {
            path: host_path.to_path_buf(),
            source,
        })?;
        let numbers = found.ok_or_else(|| SpecError::NotCharDevice {
            path: host_path.to_path_buf(),
        })?;
        Ok(DeviceNode {
            host_path: host_path.to_path_buf(),
            container_path: container_path_of(host_path),
            major: numbers.major,
            minor: numbers.minor,
            file_mode: numbers.permissions,
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
/// order. Each one's container path is `/dev/<name>`.
pub fn control_nodes_in(dev: &Path) -> Vec<DeviceNode> {
    CONTROL_NODES
        .iter()
        .filter_map(|name| DeviceNode::from_host(&dev.join(name)).ok())
        .collect()
}

/// [`control_nodes_in`] `/dev`.
pub fn control_nodes() -> Vec<DeviceNode> {
    control_nodes_in(Path::new("/dev"))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;

    use nix::sys::stat::{makedev, mknod, Mode, SFlag};

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
    fn from_host_reads_a_character_device() {
        let null = DeviceNode::from_host(Path::new("/dev/null")).unwrap();
        let expected = DeviceNode {
            host_path: "/dev/null".into(),
            container_path: "/dev/null".into(),
            major: 1,
            minor: 3,
            file_mode: 0o666,
        };
        assert_eq!(null, expected);
    }

    #[test]
    fn from_host_reads_a_node_made_anywhere() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("fakegpu7");
        let mode = Mode::from_bits_truncate(0o640);
        if let Err(err) = mknod(&node, SFlag::S_IFCHR, mode, makedev(195, 7)) {
            eprintln!("skipped: mknod needs CAP_MKNOD ({err})");
            return;
        }
        let got = DeviceNode::from_host(&node).unwrap();
        let expected = DeviceNode {
            host_path: node.clone(),
            container_path: "/dev/fakegpu7".into(),
            major: 195,
            minor: 7,
            file_mode: 0o640,
        };
        assert_eq!(got, expected);
    }

    #[test]
    fn from_host_refuses_what_is_not_a_character_device() {
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
            let message = DeviceNode::from_host(&path).unwrap_err().to_string();
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
            host_path: dir.path().join(name),
            container_path: Path::new("/dev").join(name),
            major: 1,
            minor,
            file_mode: 0o666,
        };
        assert_eq!(got, vec![node("nvidiactl", 3), node("nvidia-uvm-tools", 5)]);
        assert_eq!(control_nodes_in(&dir.path().join("absent")), vec![]);
    }
}
