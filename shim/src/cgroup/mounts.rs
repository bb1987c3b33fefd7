//! Where the cgroup hierarchies are mounted, from `/proc/self/mountinfo`.

use std::path::{Path, PathBuf};

use super::{CgroupError, FreezerVersion};

/// Where the cgroup hierarchies this module needs are mounted.
///
/// Only mounts of a hierarchy's root (mountinfo's root field `/`) count: a bind mount of a
/// subtree cannot turn the paths of `/proc/PID/cgroup` into directories. When a hierarchy is
/// mounted twice, the first mount listed wins.
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
        let mut found = Hierarchies::default();
        for mount in text.lines().filter_map(Mount::parse) {
            if mount.root != "/" {
                continue;
            }
            let point = || Some(PathBuf::from(&mount.point));
            match mount.fstype {
                "cgroup" => {
                    if found.freezer.is_none() && has_option(mount.super_options, "freezer") {
                        found.freezer = point();
                    }
                    if found.cpuacct.is_none() && has_option(mount.super_options, "cpuacct") {
                        found.cpuacct = point();
                    }
                }
                "cgroup2" if found.unified.is_none() => found.unified = point(),
                _ => {}
            }
        }
        found
    }

    /// Reads `/proc/self/mountinfo`.
    pub fn of_this_machine() -> Result<Hierarchies, CgroupError> {
        let path = Path::new("/proc/self/mountinfo");
        let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Hierarchies::from_mountinfo(&text))
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

/// The fields of one mountinfo line that matter here.
#[derive(Debug, PartialEq, Eq)]
struct Mount<'a> {
    /// The directory of the filesystem mounted (field 4), unescaped.
    root: String,
    /// The mount point (field 5), unescaped.
    point: String,
    /// The filesystem type (after the ` - ` separator).
    fstype: &'a str,
    /// The superblock options, comma-separated (the last field).
    super_options: &'a str,
}

impl<'a> Mount<'a> {
    /// Parses `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`.
    fn parse(line: &'a str) -> Option<Mount<'a>> {
        let fields: Vec<&str> = line.split(' ').collect();
        let separator = fields.iter().position(|f| *f == "-")?;
        if separator < 6 || fields.len() < separator + 4 {
            return None;
        }
        Some(Mount {
            root: unescape(fields[3]),
            point: unescape(fields[4]),
            fstype: fields[separator + 1],
            super_options: fields[separator + 3],
        })
    }
}

/// Whether a comma-separated option list has `option` as one of its entries.
fn has_option(options: &str, option: &str) -> bool {
    options.split(',').any(|o| o == option)
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
