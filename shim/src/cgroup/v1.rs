//! The cgroup v1 freezer's file protocol (`freezer.state`), and CPU time through `cpuacct`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use super::procfs::{ProcCgroup, ProcStat};
use super::{fsio, CgroupError, Hierarchies};

/// The control file of a v1 freezer cgroup.
pub(super) const STATE_FILE: &str = "freezer.state";

/// What `freezer.state` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Running.
    Thawed,
    /// A freeze was asked for and some task has not stopped yet.
    Freezing,
    /// Every task has stopped.
    Frozen,
}

/// Parses the contents of `freezer.state`.
pub(super) fn parse_state(text: &str) -> Option<State> {
    match text.trim() {
        "THAWED" => Some(State::Thawed),
        "FREEZING" => Some(State::Freezing),
        "FROZEN" => Some(State::Frozen),
        _ => None,
    }
}

/// Reads `freezer.state`. Reading is also what lets the kernel move `FREEZING` on to `FROZEN`.
pub(super) fn state(dir: &Path) -> Result<State, CgroupError> {
    let text = fsio::read(dir, STATE_FILE)?;
    parse_state(&text).ok_or_else(|| CgroupError::Malformed {
        path: dir.join(STATE_FILE),
        what: format!("{:?} is none of THAWED, FREEZING, FROZEN", text.trim()),
    })
}

/// Asks the kernel to freeze the cgroup (only the write).
pub(super) fn request_freeze(dir: &Path) -> Result<(), CgroupError> {
    fsio::write(dir, STATE_FILE, "FROZEN")
}

/// Whether every task has stopped (`FREEZING` is not frozen).
pub(super) fn is_frozen(dir: &Path) -> Result<bool, CgroupError> {
    Ok(state(dir)? == State::Frozen)
}

/// Thaws the cgroup and reads the state back: the kernel thaws at once, so anything but `THAWED`
/// (a frozen parent, say) is an error.
pub(super) fn thaw(dir: &Path) -> Result<(), CgroupError> {
    fsio::write(dir, STATE_FILE, "THAWED")?;
    match state(dir)? {
        State::Thawed => Ok(()),
        other => Err(CgroupError::NotThawed {
            path: dir.join(STATE_FILE),
            found: format!("{other:?}").to_uppercase(),
        }),
    }
}

/// CPU time of the processes `pids` (the members of a v1 freezer cgroup): `cpuacct.usage` of the
/// cpuacct cgroup they are all in, when there is one and it is not the hierarchy's root; else the
/// sum of their `utime + stime`. Processes that exit meanwhile are skipped. `proc` stands for
/// `/proc`.
pub(super) fn cpu_time(
    pids: &[u32],
    h: &Hierarchies,
    proc: &Path,
) -> Result<Duration, CgroupError> {
    if let Some(mount) = &h.cpuacct {
        let mut groups = BTreeSet::new();
        for &pid in pids {
            match ProcCgroup::of_pid_in(proc, pid) {
                Ok(cgroup) => {
                    groups.insert(cgroup.cpuacct);
                }
                Err(CgroupError::NoProcess { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(dir) = single_cpuacct_cgroup(&groups, mount) {
            match fsio::read(&dir, "cpuacct.usage") {
                Ok(text) => {
                    let nanos = text.trim().parse().map_err(|_| CgroupError::Malformed {
                        path: dir.join("cpuacct.usage"),
                        what: format!("{:?} is not a number of nanoseconds", text.trim()),
                    })?;
                    return Ok(Duration::from_nanos(nanos));
                }
                // Its cpuacct cgroup went away (processes moved out): count per process.
                Err(CgroupError::Gone(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let mut total = Duration::ZERO;
    for &pid in pids {
        match ProcStat::of_pid_in(proc, pid) {
            Ok(stat) => total += stat.cpu_time(),
            Err(CgroupError::NoProcess { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// The directory of the one cpuacct cgroup every member is in, when that is not the root.
fn single_cpuacct_cgroup(
    groups: &BTreeSet<Option<String>>,
    mount: &Path,
) -> Option<std::path::PathBuf> {
    let mut only = groups.iter();
    let path = only.next()?.as_deref()?;
    if path == "/" || only.next().is_some() {
        return None;
    }
    super::freezer::join_cgroup_path(mount, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::PathBuf;

    #[test]
    fn parses_the_three_states() {
        let table = [
            ("THAWED\n", Some(State::Thawed)),
            ("FREEZING\n", Some(State::Freezing)),
            ("FROZEN\n", Some(State::Frozen)),
            ("FROZEN", Some(State::Frozen)),
            ("frozen\n", None),
            ("", None),
        ];
        for (text, expected) in table {
            assert_eq!(parse_state(text), expected, "{text:?}");
        }
    }

    #[test]
    fn freezing_is_not_frozen_and_garbage_is_malformed() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), "FREEZING\n").unwrap();
        assert!(!is_frozen(dir.path()).unwrap());
        fs::write(dir.path().join(STATE_FILE), "SOMETHING\n").unwrap();
        assert!(matches!(
            is_frozen(dir.path()),
            Err(CgroupError::Malformed { .. })
        ));
    }

    #[test]
    fn request_and_thaw_write_the_state() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), "THAWED\n").unwrap();
        request_freeze(dir.path()).unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join(STATE_FILE)).unwrap(),
            "FROZEN"
        );
        assert!(is_frozen(dir.path()).unwrap());
        thaw(dir.path()).unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join(STATE_FILE)).unwrap(),
            "THAWED"
        );
    }

    /// A fixture `/proc` with processes given as (pid, cpuacct path, utime, stime).
    fn fixture_proc(processes: &[(u32, &str, u64, u64)]) -> tempfile::TempDir {
        let proc = tempfile::tempdir().unwrap();
        for &(pid, cpuacct, utime, stime) in processes {
            let dir = proc.path().join(pid.to_string());
            fs::create_dir(&dir).unwrap();
            fs::write(
                dir.join("cgroup"),
                format!("6:freezer:/web\n2:cpuacct:{cpuacct}\n0::/\n"),
            )
            .unwrap();
            fs::write(
                dir.join("stat"),
                format!("{pid} (sh) R 1 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 5 0 0"),
            )
            .unwrap();
        }
        proc
    }

    #[test]
    fn cpu_time_reads_the_shared_cpuacct_cgroup() {
        let proc = fixture_proc(&[(10, "/web", 1, 1), (11, "/web", 1, 1)]);
        let cpuacct = tempfile::tempdir().unwrap();
        fs::create_dir(cpuacct.path().join("web")).unwrap();
        fs::write(cpuacct.path().join("web/cpuacct.usage"), "1500000000\n").unwrap();
        let h = Hierarchies {
            cpuacct: Some(cpuacct.path().to_path_buf()),
            ..Hierarchies::default()
        };
        let time = cpu_time(&[10, 11, 12], &h, proc.path()).unwrap();
        assert_eq!(time, Duration::from_millis(1500));
    }

    #[test]
    fn cpu_time_sums_processes_in_the_cpuacct_root_or_in_different_cgroups() {
        let ticks = super::super::clock_ticks_per_second();
        let each =
            |utime: u64, stime: u64| super::super::procfs::ticks_to_duration(utime + stime, ticks);
        let cpuacct = tempfile::tempdir().unwrap();
        let mounted = Hierarchies {
            cpuacct: Some(cpuacct.path().to_path_buf()),
            ..Hierarchies::default()
        };
        let unmounted = Hierarchies::default();
        let table = [
            (
                "cpuacct root",
                &mounted,
                [(10, "/", 30, 10), (11, "/", 5, 5)],
            ),
            (
                "different cgroups",
                &mounted,
                [(10, "/a", 30, 10), (11, "/b", 5, 5)],
            ),
            (
                "no cpuacct mount",
                &unmounted,
                [(10, "/a", 30, 10), (11, "/a", 5, 5)],
            ),
        ];
        for (name, h, processes) in table {
            let proc = fixture_proc(&processes);
            let time = cpu_time(&[10, 11, 99], h, proc.path()).unwrap();
            assert_eq!(time, each(30, 10) + each(5, 5), "{name}");
        }
    }

    #[test]
    fn cpu_time_of_no_process_is_zero() {
        let proc = tempfile::tempdir().unwrap();
        let h = Hierarchies {
            cpuacct: Some(PathBuf::from("/nonexistent")),
            ..Hierarchies::default()
        };
        assert_eq!(cpu_time(&[], &h, proc.path()).unwrap(), Duration::ZERO);
    }
}
