//! The container's cgroup v1 devices controller: `devices.allow`, `devices.deny`, read back
//! through `devices.list`.
//!
//! The hook runs in the host's mount namespace, so the cgroup is found from
//! `/proc/PID/cgroup` (the process's devices cgroup) and `/proc/self/mountinfo` (where this
//! namespace mounts the devices hierarchy).

use std::fmt;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use gpuplex_cgroup::{CgroupMounts, ProcCgroup};
use gpuplex_wire::protocol::cdi::CdiDeviceNode;

use super::nodes::char_numbers;
use super::InjectError;

/// One rule of the devices controller, for a character device: `c MAJOR:MINOR ACCESS`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceRule {
    /// The device's major number.
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
    /// The access allowed: letters of `rwm` (read, write, mknod).
    pub access: String,
}

impl fmt::Display for DeviceRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c {}:{} {}", self.major, self.minor, self.access)
    }
}

/// Allows each device node of the edits (`c MAJOR:MINOR rwm`) in the cgroup v1 devices cgroup
/// of process `pid`, and reads `devices.list` back to confirm. A node that is no character
/// device with both numbers is [`InjectError::NotACharNode`], before anything is written.
///
/// Returns the rules it added, for [`deny_devices`]: a device the cgroup allows already (an
/// exact or wildcard rule, or an unrestricted cgroup) is not added and not returned, so undoing
/// never takes away access the container had before. On an error, the rules this call added
/// are denied again before it returns.
///
/// Without a v1 devices controller (a cgroup v2 host, where device access is an eBPF program)
/// this is [`InjectError::CgroupV2Devices`].
pub fn allow_devices(pid: u32, devices: &[CdiDeviceNode]) -> Result<Vec<DeviceRule>, InjectError> {
    let numbers = devices
        .iter()
        .map(char_numbers)
        .collect::<Result<Vec<_>, _>>()?;
    let dir = devices_dir(pid)?;
    let list = read(&dir.join("devices.list"))?;
    let mut added: Vec<DeviceRule> = Vec::new();
    let mut result = Ok(());
    for (major, minor) in numbers {
        let rule = DeviceRule {
            major,
            minor,
            access: "rwm".into(),
        };
        if added.contains(&rule) || allows(&list, &rule) {
            continue;
        }
        result = write(&dir.join("devices.allow"), &rule);
        if result.is_err() {
            break;
        }
        added.push(rule);
    }
    if result.is_ok() {
        result = check(&dir, &added, "devices.allow", true);
    }
    match result {
        Ok(()) => Ok(added),
        Err(error) => {
            for rule in &added {
                let _ = write(&dir.join("devices.deny"), rule);
            }
            Err(error)
        }
    }
}

/// Undoes [`allow_devices`]: writes each rule to `devices.deny` of the devices cgroup of
/// process `pid` and reads `devices.list` back to confirm.
pub fn deny_devices(pid: u32, rules: &[DeviceRule]) -> Result<(), InjectError> {
    if rules.is_empty() {
        return Ok(());
    }
    let dir = devices_dir(pid)?;
    for rule in rules {
        write(&dir.join("devices.deny"), rule)?;
    }
    check(&dir, rules, "devices.deny", false)
}

/// The directory of the devices cgroup of process `pid`, through whichever mount of this
/// namespace reaches it (a bind-mounted subtree of the hierarchy included).
fn devices_dir(pid: u32) -> Result<PathBuf, InjectError> {
    let read = |source| InjectError::CgroupRead { pid, source };
    let cgroups = ProcCgroup::of_pid(pid).map_err(read)?;
    let cgroup = cgroups
        .v1_path("devices")
        .ok_or(InjectError::CgroupV2Devices { pid })?;
    let mounts = CgroupMounts::of_this_process().map_err(read)?;
    mounts
        .v1_dir("devices", cgroup)
        .ok_or_else(|| InjectError::CgroupNotMounted {
            pid,
            cgroup: cgroup.to_string(),
        })
}

/// Whether the text of `devices.list` allows all of `rule`'s access.
fn allows(list: &str, rule: &DeviceRule) -> bool {
    let number = |field: &str, want: u32| field == "*" || field.parse() == Ok(want);
    list.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (Some(kind), Some(numbers), Some(access)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return false;
        };
        let Some((major, minor)) = numbers.split_once(':') else {
            return false;
        };
        (kind == "a" || kind == "c")
            && number(major, rule.major)
            && number(minor, rule.minor)
            && rule.access.chars().all(|c| access.contains(c))
    })
}

fn read(path: &Path) -> Result<String, InjectError> {
    fs::read_to_string(path).map_err(|source| InjectError::Cgroup {
        step: "read".into(),
        path: path.to_path_buf(),
        source,
    })
}

fn write(path: &Path, rule: &DeviceRule) -> Result<(), InjectError> {
    let line = rule.to_string();
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut file| file.write_all(line.as_bytes()))
        .map_err(|source| InjectError::Cgroup {
            step: format!("write `{line}` to"),
            path: path.to_path_buf(),
            source,
        })
}

/// Reads `devices.list` back: each rule must now be allowed (`allowed`) or not (`!allowed`).
fn check(dir: &Path, rules: &[DeviceRule], file: &str, allowed: bool) -> Result<(), InjectError> {
    if rules.is_empty() {
        return Ok(());
    }
    let list = read(&dir.join("devices.list"))?;
    match rules.iter().find(|rule| allows(&list, rule) != allowed) {
        None => Ok(()),
        Some(rule) => Err(InjectError::CgroupNotApplied {
            path: dir.join(file),
            rule: rule.to_string(),
            expected: if allowed { "allowed" } else { "denied" },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(major: u32, minor: u32) -> DeviceRule {
        DeviceRule {
            major,
            minor,
            access: "rwm".into(),
        }
    }

    #[test]
    fn finds_the_v1_devices_cgroup() {
        let devices = |text| ProcCgroup::parse(text).v1_path("devices").map(String::from);
        let text = "9:name=systemd:/c1\n5:devices:/c1\n4:memory:/a/b/c1\n0::/\n";
        assert_eq!(devices(text).as_deref(), Some("/c1"));
        let joined = "3:cpu,devices:/x:y\n";
        assert_eq!(devices(joined).as_deref(), Some("/x:y"));
        assert_eq!(devices("0::/user.slice/c1\n"), None);
    }

    #[test]
    fn cgroup_v2_only_has_no_devices_cgroup_and_says_what_to_do() {
        let message = InjectError::CgroupV2Devices { pid: 7 }.to_string();
        assert!(message.contains("v2"), "{message}");
        assert!(message.contains("not support"), "{message}");
        assert!(message.contains("precreate"), "{message}");
        assert!(message.contains("linux.resources.devices"), "{message}");
        assert!(!message.contains('\n'));
    }

    // Where the devices hierarchy is mounted, whole or a subtree: gpuplex-cgroup's
    // `a_subtree_mount_reaches_only_its_subtree`.

    #[test]
    fn reads_what_devices_list_allows() {
        let list = "c 1:3 rwm\nc 136:* rwm\nc 195:0 rw\nb *:* m\n";
        assert!(!allows(list, &rule(195, 240)));
        assert!(!allows(list, &rule(195, 0)), "rw is not rwm");
        assert!(allows(list, &rule(136, 4)));
        assert!(allows(list, &rule(1, 3)));
        assert!(allows("a *:* rwm\n", &rule(195, 240)));
        assert!(!allows("", &rule(195, 240)));
        assert_eq!(rule(195, 240).to_string(), "c 195:240 rwm");
    }
}
