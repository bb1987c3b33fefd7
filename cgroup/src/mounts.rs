//! Where the cgroup hierarchies are mounted, from `/proc/self/mountinfo`: the one mountinfo
//! parser of gpuplex (the lines are read by `procfs-core`; the kernel's octal escapes undone here).
//!
//! One rule for every use: a mount of a hierarchy's subtree (mountinfo's root field `/pod`, a
//! bind mount of a cgroup directory) is a mount of that subtree. Cgroup `/pod/c1` is at
//! `POINT/c1` through it ([`CgroupMount::dir_of`]), and a cgroup outside `/pod` is not reachable
//! through it at all. The hook finds a devices cgroup through any mount that reaches it
//! ([`CgroupMounts::v1_dir`]); the node service, which must know each hierarchy's root to refuse
//! it and to keep saved cgroups below it, takes only mounts of a whole hierarchy
//! ([`Hierarchies`]).

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use procfs_core::process::MountInfo;

use super::{CgroupError, FreezerVersion};

/// One mount of a cgroup hierarchy, or of a subtree of one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    /// cgroup2 (`true`) or a cgroup v1 hierarchy.
    pub v2: bool,
    /// The cgroup mounted, as `/proc/PID/cgroup` names it: `/` for the whole hierarchy.
    pub root: PathBuf,
    /// Where it is mounted.
    pub point: PathBuf,
    /// The superblock options: a v1 hierarchy's controllers (`freezer`, `cpu`, ...) and its
    /// name (`name=systemd`), each with its value if it has one.
    options: HashMap<String, Option<String>>,
}

impl CgroupMount {
    /// The mount of one mountinfo line, if it is of a cgroup filesystem and parses.
    fn parse(line: &str) -> Option<CgroupMount> {
        let info = MountInfo::from_line(line).ok()?;
        let v2 = match info.fs_type.as_str() {
            "cgroup" => false,
            "cgroup2" => true,
            _ => return None,
        };
        Some(CgroupMount {
            v2,
            root: PathBuf::from(unescape(&info.root)),
            point: PathBuf::from(unescape(&info.mount_point.to_string_lossy())),
            options: info.super_options,
        })
    }

    /// Whether this is a v1 hierarchy with `controller` (`freezer`, or a name such as
    /// `name=systemd`, as `/proc/PID/cgroup` lists it).
    pub fn has_controller(&self, controller: &str) -> bool {
        if self.v2 {
            return false;
        }
        match controller.split_once('=') {
            Some((key, value)) => self.options.get(key) == Some(&Some(value.to_string())),
            None => self.options.get(controller) == Some(&None),
        }
    }

    /// Whether this mounts the whole hierarchy, not a subtree of it.
    pub fn is_whole(&self) -> bool {
        self.root == Path::new("/")
    }

    /// The directory of `cgroup` (a path of `/proc/PID/cgroup`) through this mount; `None` when
    /// the cgroup is not in the subtree mounted, or climbs out of it (`/../x`).
    pub fn dir_of(&self, cgroup: &str) -> Option<PathBuf> {
        let below = Path::new(cgroup).strip_prefix(&self.root).ok()?;
        join_cgroup_path(&self.point, below.to_str()?)
    }
}

/// The cgroup mounts of a mount namespace, in mountinfo's order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupMounts(pub Vec<CgroupMount>);

impl CgroupMounts {
    /// The cgroup mounts in the text of a `mountinfo` file (see proc(5)). Lines that do not
    /// parse are skipped.
    pub fn from_mountinfo(text: &str) -> CgroupMounts {
        CgroupMounts(text.lines().filter_map(CgroupMount::parse).collect())
    }

    /// Reads `/proc/self/mountinfo`.
    pub fn of_this_process() -> Result<CgroupMounts, CgroupError> {
        let path = Path::new("/proc/self/mountinfo");
        let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(CgroupMounts::from_mountinfo(&text))
    }

    /// The directory of `cgroup` of the v1 hierarchy with `controller`, through the first
    /// mount listed that reaches it (a subtree mount included).
    pub fn v1_dir(&self, controller: &str, cgroup: &str) -> Option<PathBuf> {
        self.0
            .iter()
            .filter(|m| m.has_controller(controller))
            .find_map(|m| m.dir_of(cgroup))
    }

    /// The directory of cgroup2 cgroup `cgroup`, through the first cgroup2 mount listed that
    /// reaches it.
    pub fn unified_dir(&self, cgroup: &str) -> Option<PathBuf> {
        self.0
            .iter()
            .filter(|m| m.v2)
            .find_map(|m| m.dir_of(cgroup))
    }

    /// The first mount of a whole hierarchy that `wanted` accepts.
    fn whole(&self, wanted: impl Fn(&CgroupMount) -> bool) -> Option<PathBuf> {
        let mount = self.0.iter().find(|m| m.is_whole() && wanted(m))?;
        Some(mount.point.clone())
    }
}

/// Where the cgroup hierarchies this crate freezes and reads are mounted.
///
/// Only mounts of a whole hierarchy count: through a mount of a subtree some cgroups of
/// `/proc/PID/cgroup` are not reachable, and its mount point is not the hierarchy's root. When
/// a hierarchy is mounted twice, the first mount listed wins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hierarchies {
    /// The cgroup v1 hierarchy that has the `freezer` controller (`/sys/fs/cgroup/freezer`).
    pub freezer: Option<PathBuf>,
    /// The cgroup v1 hierarchy that has the `cpuacct` controller (`/sys/fs/cgroup/cpuacct` or
    /// `/sys/fs/cgroup/cpu,cpuacct`).
    pub cpuacct: Option<PathBuf>,
    /// The cgroup2 mount (`/sys/fs/cgroup` on a pure v2 machine, `/sys/fs/cgroup/unified` on a
    /// hybrid one).
    pub unified: Option<PathBuf>,
}

impl Hierarchies {
    /// Finds the hierarchies in the text of a `mountinfo` file (see proc(5)). Lines that do not
    /// parse are skipped.
    pub fn from_mountinfo(text: &str) -> Hierarchies {
        Hierarchies::from_mounts(&CgroupMounts::from_mountinfo(text))
    }

    /// The hierarchies among `mounts`.
    pub fn from_mounts(mounts: &CgroupMounts) -> Hierarchies {
        Hierarchies {
            freezer: mounts.whole(|m| m.has_controller("freezer")),
            cpuacct: mounts.whole(|m| m.has_controller("cpuacct")),
            unified: mounts.whole(|m| m.v2),
        }
    }

    /// Reads `/proc/self/mountinfo`.
    pub fn of_this_machine() -> Result<Hierarchies, CgroupError> {
        CgroupMounts::of_this_process().map(|mounts| Hierarchies::from_mounts(&mounts))
    }

    /// The mount that freezes with `version`: the v1 freezer hierarchy or the cgroup2 mount.
    pub fn mount_of(&self, version: FreezerVersion) -> Option<&Path> {
        match version {
            FreezerVersion::V1 => self.freezer.as_deref(),
            FreezerVersion::V2 => self.unified.as_deref(),
        }
    }

    /// Whether any freezer is available (a v1 freezer hierarchy or cgroup2).
    pub fn has_freezer(&self) -> bool {
        self.freezer.is_some() || self.unified.is_some()
    }
}

/// `mount` joined with a cgroup path of `/proc/PID/cgroup` (`/a/b`); `None` for a path that
/// climbs out of the hierarchy (`/../x`, seen from another cgroup namespace).
pub(super) fn join_cgroup_path(mount: &Path, path: &str) -> Option<PathBuf> {
    let relative = Path::new(path.trim_start_matches('/'));
    if relative
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return None;
    }
    Some(mount.join(relative))
}

/// Undoes the kernel's octal escapes in mountinfo paths (`\040` for a space, `\011` for a tab,
/// `\012` for a newline, `\134` for a backslash).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| {
            bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)) && d[0] <= b'3'
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian 12 as set up on the development machines: v1 hierarchies, cgroup2 at `unified`.
    const HYBRID: &str = "\
23 1 0:22 / /sys rw,nosuid,nodev,noexec,relatime - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    /// Ubuntu 20.04 under systemd: cpu and cpuacct share a hierarchy, optional fields present.
    const HYBRID_SYSTEMD: &str = "\
25 24 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
33 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu,cpuacct
38 25 0:35 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec,relatime shared:20 - cgroup cgroup rw,freezer
";

    /// Debian 12 / Fedora under systemd: cgroup2 only.
    const PURE_V2: &str = "\
22 29 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
26 22 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    fn hierarchies(
        freezer: Option<&str>,
        cpuacct: Option<&str>,
        unified: Option<&str>,
    ) -> Hierarchies {
        Hierarchies {
            freezer: freezer.map(PathBuf::from),
            cpuacct: cpuacct.map(PathBuf::from),
            unified: unified.map(PathBuf::from),
        }
    }

    #[test]
    fn finds_the_hierarchies() {
        let table = [
            (
                "hybrid",
                HYBRID.to_string(),
                hierarchies(
                    Some("/sys/fs/cgroup/freezer"),
                    Some("/sys/fs/cgroup/cpuacct"),
                    Some("/sys/fs/cgroup/unified"),
                ),
            ),
            (
                "hybrid under systemd",
                HYBRID_SYSTEMD.to_string(),
                hierarchies(
                    Some("/sys/fs/cgroup/freezer"),
                    Some("/sys/fs/cgroup/cpu,cpuacct"),
                    Some("/sys/fs/cgroup/unified"),
                ),
            ),
            (
                "pure v2",
                PURE_V2.to_string(),
                hierarchies(None, None, Some("/sys/fs/cgroup")),
            ),
            ("nothing", String::new(), hierarchies(None, None, None)),
            (
                "a subtree bind mount is skipped, the real mount after it is taken",
                format!(
                    "90 80 0:34 /docker/abc /mnt/freezer rw - cgroup cgroup rw,freezer\n{HYBRID}"
                ),
                hierarchies(
                    Some("/sys/fs/cgroup/freezer"),
                    Some("/sys/fs/cgroup/cpuacct"),
                    Some("/sys/fs/cgroup/unified"),
                ),
            ),
            (
                "the first of two mounts wins",
                format!("{PURE_V2}99 26 0:23 / /run/cg rw - cgroup2 cgroup2 rw\n"),
                hierarchies(None, None, Some("/sys/fs/cgroup")),
            ),
            (
                "name=freezer is not the freezer controller; garbage lines are skipped",
                "40 31 0:37 / /x rw - cgroup cgroup rw,name=freezer\nnot a mountinfo line\n1 2 3\n"
                    .to_string(),
                hierarchies(None, None, None),
            ),
            (
                "escaped mount point",
                "41 31 0:38 / /mnt/my\\040cgroups rw,relatime - cgroup2 cgroup2 rw\n".to_string(),
                hierarchies(None, None, Some("/mnt/my cgroups")),
            ),
        ];
        for (name, text, expected) in table {
            assert_eq!(Hierarchies::from_mountinfo(&text), expected, "{name}");
        }
    }

    #[test]
    fn a_subtree_mount_reaches_only_its_subtree() {
        // The hook's case: the devices hierarchy, whole or a bind-mounted subtree of it.
        let devices = "\
30 24 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
33 24 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
37 24 0:33 / /sys/fs/cgroup/devices rw,nosuid - cgroup cgroup rw,devices
";
        let mounts = CgroupMounts::from_mountinfo(devices);
        assert_eq!(
            mounts.v1_dir("devices", "/c1"),
            Some(PathBuf::from("/sys/fs/cgroup/devices/c1"))
        );
        let nested = CgroupMounts::from_mountinfo(
            "37 24 0:33 /pod /mnt/my\\040cg rw - cgroup cgroup rw,devices,cpu\n",
        );
        assert_eq!(
            nested.v1_dir("devices", "/pod/c1"),
            Some(PathBuf::from("/mnt/my cg/c1"))
        );
        assert_eq!(
            nested.v1_dir("devices", "/pod"),
            Some(PathBuf::from("/mnt/my cg"))
        );
        assert_eq!(nested.v1_dir("devices", "/other/c1"), None);
        assert_eq!(nested.v1_dir("devices", "/podcast/c1"), None);
        assert_eq!(nested.v1_dir("devices", "/pod/../x"), None);
        let cpu_only =
            CgroupMounts::from_mountinfo("33 24 0:29 / /cpu rw - cgroup cgroup rw,cpu\n");
        assert_eq!(cpu_only.v1_dir("devices", "/c1"), None);
        assert_eq!(
            mounts.unified_dir("/a/b"),
            Some(PathBuf::from("/sys/fs/cgroup/unified/a/b"))
        );
        assert_eq!(cpu_only.unified_dir("/a/b"), None);
        // The node service's case: the same subtree mount is no hierarchy root.
        assert_eq!(Hierarchies::from_mounts(&nested), Hierarchies::default());
        assert!(!nested.0[0].is_whole() && mounts.0[2].is_whole());
    }

    #[test]
    fn controllers_and_names_are_told_apart() {
        let mounts = CgroupMounts::from_mountinfo(&format!(
            "{HYBRID_SYSTEMD}40 31 0:37 / /x rw - cgroup cgroup rw,name=freezer\n"
        ));
        let with = |c: &str| -> Vec<&Path> {
            let found = mounts.0.iter().filter(|m| m.has_controller(c));
            found.map(|m| m.point.as_path()).collect()
        };
        assert_eq!(with("cpuacct"), [Path::new("/sys/fs/cgroup/cpu,cpuacct")]);
        assert_eq!(with("cpu"), [Path::new("/sys/fs/cgroup/cpu,cpuacct")]);
        assert_eq!(with("name=systemd"), [Path::new("/sys/fs/cgroup/systemd")]);
        assert_eq!(with("freezer"), [Path::new("/sys/fs/cgroup/freezer")]);
        assert_eq!(with("name=freezer"), [Path::new("/x")]);
        assert!(
            with("nsdelegate").is_empty(),
            "cgroup2 has no controllers here"
        );
    }

    #[test]
    fn unescapes_octal_sequences_only() {
        let table = [
            ("/plain", "/plain"),
            ("/a\\040b", "/a b"),
            ("/tab\\011x", "/tab\tx"),
            ("/back\\134slash", "/back\\slash"),
            ("/not\\999octal", "/not\\999octal"),
            ("/short\\04", "/short\\04"),
        ];
        for (field, expected) in table {
            assert_eq!(unescape(field), expected, "{field}");
        }
    }

    #[test]
    fn mount_of_picks_the_hierarchy_for_the_version() {
        let h = Hierarchies::from_mountinfo(HYBRID);
        assert_eq!(
            h.mount_of(FreezerVersion::V1),
            Some(Path::new("/sys/fs/cgroup/freezer"))
        );
        assert_eq!(
            h.mount_of(FreezerVersion::V2),
            Some(Path::new("/sys/fs/cgroup/unified"))
        );
        assert!(h.has_freezer());
        assert!(!Hierarchies::default().has_freezer());
    }

    #[test]
    fn this_machine_parses() {
        // Whatever this machine has, reading it must work.
        Hierarchies::of_this_machine().unwrap();
    }
}
