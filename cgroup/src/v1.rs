//! The cgroup v1 freezer's file protocol (`freezer.state`), and CPU time through `cpuacct`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use super::procfs::ProcCgroup;
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

/// The control file of a cpuacct cgroup with its CPU time in nanoseconds.
pub(super) const CPUACCT_USAGE: &str = "cpuacct.usage";

/// The cpuacct cgroup all of `pids` are in, when they share one that is not the root (a process
/// that exited meanwhile is not counted); `None` otherwise, and then their CPU time is the sum of
/// theirs. `proc` stands for `/proc`.
pub(super) fn cpuacct_dir(
    pids: &[u32],
    h: &Hierarchies,
    proc: &Path,
) -> Result<Option<std::path::PathBuf>, CgroupError> {
    let Some(mount) = &h.cpuacct else {
        return Ok(None);
    };
    let mut groups = BTreeSet::new();
    for &pid in pids {
        match ProcCgroup::of_pid_in(proc, pid) {
            Ok(cgroup) => {
                groups.insert(cgroup.cpuacct().map(str::to_string));
            }
            Err(CgroupError::NoProcess { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(single_cpuacct_cgroup(&groups, mount))
}

/// The nanoseconds of a `cpuacct.usage` read from `path`.
pub(super) fn parse_cpuacct_usage(path: &Path, text: &str) -> Result<Duration, CgroupError> {
    let nanos = text.trim().parse().map_err(|_| CgroupError::Malformed {
        path: path.to_path_buf(),
        what: format!("{:?} is not a number of nanoseconds", text.trim()),
    })?;
    Ok(Duration::from_nanos(nanos))
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
    super::mounts::join_cgroup_path(mount, path)
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

    /// A fixture `/proc` holding the `cgroup` file of processes given as (pid, cpuacct path).
    fn fixture_proc(processes: &[(u32, &str)]) -> tempfile::TempDir {
        let proc = tempfile::tempdir().unwrap();
        for &(pid, cpuacct) in processes {
            let dir = proc.path().join(pid.to_string());
            fs::create_dir(&dir).unwrap();
            fs::write(
                dir.join("cgroup"),
                format!("6:freezer:/web\n2:cpuacct:{cpuacct}\n0::/\n"),
            )
            .unwrap();
        }
        proc
    }

    /// Two sleeping processes, killed when dropped.
    struct Sleepers(Vec<std::process::Child>);

    impl Sleepers {
        fn start() -> Sleepers {
            let start = || {
                std::process::Command::new("sleep")
                    .arg("100")
                    .spawn()
                    .unwrap()
            };
            Sleepers(vec![start(), start()])
        }

        fn pids(&self) -> [u32; 2] {
            [self.0[0].id(), self.0[1].id()]
        }

        /// Their CPU time together, from their CPU clocks.
        fn cpu(&self) -> Duration {
            use nix::time::{clock_gettime, ClockId};
            self.pids()
                .iter()
                .map(|&pid| {
                    let clock =
                        ClockId::pid_cpu_clock_id(nix::unistd::Pid::from_raw(pid as i32)).unwrap();
                    Duration::from(clock_gettime(clock).unwrap())
                })
                .sum()
        }
    }

    impl Drop for Sleepers {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// A pid no process can have (above the kernel's largest).
    const NO_PID: u32 = 4_000_000_000;

    /// CPU time of a v1 cgroup whose `cgroup.procs` lists `pids`, read as the service does.
    fn cpu_time(pids: &[u32], h: &Hierarchies, proc: &Path) -> Result<Duration, CgroupError> {
        let cgroup = tempfile::tempdir().unwrap();
        let list: String = pids.iter().map(|p| format!("{p}\n")).collect();
        fs::write(cgroup.path().join("cgroup.procs"), list).unwrap();
        let freezer =
            crate::FreezerCgroup::new(crate::FreezerVersion::V1, cgroup.path().to_path_buf());
        crate::CgroupReader::with_proc(freezer, proc).cpu_time(h)
    }

    #[test]
    fn cpu_time_reads_the_shared_cpuacct_cgroup() {
        let proc = fixture_proc(&[(10, "/web"), (11, "/web")]);
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
        let sleepers = Sleepers::start();
        let [a, b] = sleepers.pids();
        let cpuacct = tempfile::tempdir().unwrap();
        let mounted = Hierarchies {
            cpuacct: Some(cpuacct.path().to_path_buf()),
            ..Hierarchies::default()
        };
        let unmounted = Hierarchies::default();
        let table = [
            ("cpuacct root", &mounted, [(a, "/"), (b, "/")]),
            ("different cgroups", &mounted, [(a, "/a"), (b, "/b")]),
            ("no cpuacct mount", &unmounted, [(a, "/a"), (b, "/a")]),
        ];
        for (name, h, processes) in table {
            let proc = fixture_proc(&processes);
            // Their clocks, read around the reader's (they may still be starting).
            let before = sleepers.cpu();
            let time = cpu_time(&[a, b, NO_PID], h, proc.path()).unwrap();
            let after = sleepers.cpu();
            assert!(
                before <= time && time <= after && !time.is_zero(),
                "{name}: {before:?} <= {time:?} <= {after:?}"
            );
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
