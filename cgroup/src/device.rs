//! What a device node is, by its numbers: the type and the major and minor numbers a devices
//! cgroup rule (`c 195:0 rwm`) and an OCI `linux.devices` entry name it by.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// The kind of a node a device rule can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// A character device (`c`).
    Char,
    /// A block device (`b`).
    Block,
    /// A FIFO (`p`), which has no numbers.
    Fifo,
}

/// A host node's kind, numbers and permission bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceNumbers {
    /// Its kind.
    pub kind: DeviceKind,
    /// Its major number (0 for a FIFO).
    pub major: u32,
    /// Its minor number (0 for a FIFO).
    pub minor: u32,
    /// Its permission bits, such as `0o666`.
    pub permissions: u32,
}

impl DeviceNumbers {
    /// Stats `path`, following a symlink: `None` when it is neither a device node nor a FIFO.
    pub fn of(path: &Path) -> io::Result<Option<DeviceNumbers>> {
        let meta = std::fs::metadata(path)?;
        let kind = meta.file_type();
        let kind = if kind.is_char_device() {
            DeviceKind::Char
        } else if kind.is_block_device() {
            DeviceKind::Block
        } else if kind.is_fifo() {
            DeviceKind::Fifo
        } else {
            return Ok(None);
        };
        let rdev = meta.rdev();
        let (major, minor) = match kind {
            DeviceKind::Fifo => (0, 0),
            _ => (libc::major(rdev), libc::minor(rdev)),
        };
        Ok(Some(DeviceNumbers {
            kind,
            major,
            minor,
            permissions: meta.mode() & 0o777,
        }))
    }

    /// The node's numbers if it is a character device.
    pub fn char_device(path: &Path) -> io::Result<Option<DeviceNumbers>> {
        let found = DeviceNumbers::of(path)?;
        Ok(found.filter(|d| d.kind == DeviceKind::Char))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_dev_null_and_refuses_files() {
        let null = DeviceNumbers::of(Path::new("/dev/null")).unwrap().unwrap();
        assert_eq!(
            (null.kind, null.major, null.minor),
            (DeviceKind::Char, 1, 3)
        );
        assert_eq!(null.permissions, 0o666);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert_eq!(DeviceNumbers::of(&file).unwrap(), None);
        assert_eq!(DeviceNumbers::char_device(&file).unwrap(), None);
        let fifo = dir.path().join("p");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let found = DeviceNumbers::of(&fifo).unwrap().unwrap();
        assert_eq!(
            (found.kind, found.major, found.minor),
            (DeviceKind::Fifo, 0, 0)
        );
        assert_eq!(DeviceNumbers::char_device(&fifo).unwrap(), None);
        let missing = DeviceNumbers::of(&dir.path().join("none")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }
}
