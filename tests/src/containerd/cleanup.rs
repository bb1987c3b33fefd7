//! What a private containerd leaves behind once its tasks are gone and it is stopped: mounts
//! under its directory, and runc's traces of its namespace outside it.

use std::path::{Path, PathBuf};

/// Removes what runc leaves of a containerd namespace: its state directory and the cgroups'
/// parents (`/<namespace>` in each hierarchy). Only empty ones go.
pub(super) fn remove_namespace_leftovers(namespace: &str) {
    let _ = std::fs::remove_dir(Path::new("/run/containerd/runc").join(namespace));
    let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(namespace));
    if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
        for hierarchy in hierarchies.flatten() {
            let _ = std::fs::remove_dir(hierarchy.path().join(namespace));
        }
    }
}

/// Unmounts everything under `dir`, then removes it; a tree something is still mounted in is
/// kept (removing it would reach into the mount), saying so.
pub(super) fn unmount_and_remove(dir: &Path) {
    for point in mounts_under(dir) {
        let _ = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH);
    }
    let left = mounts_under(dir);
    if left.is_empty() {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        eprintln!("keeping {}: still mounted there: {left:?}", dir.display());
    }
}

/// The mount points under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|escaped| PathBuf::from(unescape_mount_point(escaped)))
        .filter(|point| point.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// A mountinfo path with its octal escapes (`\040` for a space) decoded.
fn unescape_mount_point(escaped: &str) -> String {
    let mut out = String::new();
    let mut rest = escaped;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(byte as char);
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_unescaped() {
        assert_eq!(unescape_mount_point(r"/a\040b/c"), "/a b/c");
        assert_eq!(unescape_mount_point(r"/tab\011x"), "/tab\tx");
        assert_eq!(unescape_mount_point(r"/odd\x"), r"/odd\x");
        assert_eq!(unescape_mount_point("/plain"), "/plain");
    }
}
