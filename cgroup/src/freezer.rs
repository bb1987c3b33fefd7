//! [`FreezerCgroup`]: one cgroup that gpuplex freezes and thaws, whichever the interface.

use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::mounts::join_cgroup_path;
use super::procfs::ProcCgroup;
use super::{fsio, v1, v2, CgroupError, CgroupReader, FreezerVersion, Hierarchies};

/// The first pause between two looks at a cgroup that is still freezing.
const FIRST_POLL: Duration = Duration::from_micros(50);
/// The longest pause between two looks (the pause doubles up to this).
const MAX_POLL: Duration = Duration::from_millis(1);

/// A cgroup gpuplex can freeze: its interface and its directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FreezerCgroup {
    version: FreezerVersion,
    path: PathBuf,
}

impl FreezerCgroup {
    /// The freezer cgroup of a process, from `/proc/PID/cgroup`: its v1 freezer cgroup when that
    /// hierarchy is mounted and the process is not in its root; else its cgroup2 cgroup when that
    /// is mounted and not the root.
    ///
    /// Errors: [`CgroupError::NoFreezer`] when neither hierarchy is mounted,
    /// [`CgroupError::NoProcess`] when there is no such process, [`CgroupError::RootCgroup`] when
    /// the process is in the root cgroup of every freezer hierarchy mounted.
    pub fn of_pid(pid: u32, h: &Hierarchies) -> Result<FreezerCgroup, CgroupError> {
        FreezerCgroup::of_pid_in(Path::new("/proc"), pid, h)
    }

    /// [`FreezerCgroup::of_pid`], with `proc` standing for `/proc` (tests give a fixture).
    pub fn of_pid_in(proc: &Path, pid: u32, h: &Hierarchies) -> Result<FreezerCgroup, CgroupError> {
        if !h.has_freezer() {
            return Err(CgroupError::NoFreezer);
        }
        let cgroups = ProcCgroup::of_pid_in(proc, pid)?;
        FreezerCgroup::of_proc_cgroup(pid, &cgroups, h)
    }

    /// The choice [`FreezerCgroup::of_pid`] makes, from an already parsed `/proc/PID/cgroup`.
    pub fn of_proc_cgroup(
        pid: u32,
        cgroups: &ProcCgroup,
        h: &Hierarchies,
    ) -> Result<FreezerCgroup, CgroupError> {
        let candidates = [
            (FreezerVersion::V1, &h.freezer, cgroups.freezer()),
            (FreezerVersion::V2, &h.unified, cgroups.unified.as_deref()),
        ];
        for (version, mount, path) in candidates {
            if let (Some(mount), Some(path)) = (mount, path) {
                if path != "/" {
                    if let Some(dir) = join_cgroup_path(mount, path) {
                        return Ok(FreezerCgroup::new(version, dir));
                    }
                }
            }
        }
        if h.has_freezer() {
            Err(CgroupError::RootCgroup { pid })
        } else {
            Err(CgroupError::NoFreezer)
        }
    }

    /// A cgroup directory given by path: v1 when below the freezer mount (and it has
    /// `freezer.state`), v2 when below the cgroup2 mount (and it has `cgroup.freeze`). The path is
    /// resolved (symlinks, `..`) first. Refuses a missing directory ([`CgroupError::Io`] naming
    /// it), a hierarchy's root, a path outside both and one without the control file
    /// ([`CgroupError::NotACgroup`]).
    pub fn at(path: &Path, h: &Hierarchies) -> Result<FreezerCgroup, CgroupError> {
        let refuse = || CgroupError::NotACgroup(path.to_path_buf());
        let dir = path.canonicalize().map_err(|source| CgroupError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if !dir.is_dir() {
            return Err(refuse());
        }
        let mut best: Option<(FreezerVersion, PathBuf)> = None;
        for version in [FreezerVersion::V1, FreezerVersion::V2] {
            let Some(mount) = h.mount_of(version) else {
                continue;
            };
            let mount = mount.canonicalize().unwrap_or_else(|_| mount.to_path_buf());
            let deeper = best.as_ref().is_none_or(|(_, b)| mount.starts_with(b));
            if dir.starts_with(&mount) && deeper {
                best = Some((version, mount));
            }
        }
        let (version, mount) = best.ok_or_else(refuse)?;
        let control = match version {
            FreezerVersion::V1 => v1::STATE_FILE,
            FreezerVersion::V2 => v2::FREEZE_FILE,
        };
        if dir == mount || !dir.join(control).is_file() {
            return Err(refuse());
        }
        Ok(FreezerCgroup::new(version, dir))
    }

    /// A cgroup of a known version at a known directory, unchecked (for tests with fixture
    /// directories, and for recovering saved state).
    pub fn new(version: FreezerVersion, path: PathBuf) -> FreezerCgroup {
        FreezerCgroup { version, path }
    }

    /// Its interface.
    pub fn version(&self) -> FreezerVersion {
        self.version
    }

    /// Its directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Asks the kernel to freeze it, and returns without waiting: v1 writes `FROZEN` to
    /// `freezer.state`, v2 writes `1` to `cgroup.freeze`.
    pub fn request_freeze(&self) -> Result<(), CgroupError> {
        match self.version {
            FreezerVersion::V1 => v1::request_freeze(&self.path),
            FreezerVersion::V2 => v2::request_freeze(&self.path),
        }
    }

    /// Whether every task has stopped: v1 `freezer.state` reads `FROZEN` (`FREEZING` is not
    /// frozen), v2 `cgroup.events` says `frozen 1`.
    pub fn is_frozen(&self) -> Result<bool, CgroupError> {
        match self.version {
            FreezerVersion::V1 => v1::is_frozen(&self.path),
            FreezerVersion::V2 => v2::is_frozen(&self.path),
        }
    }

    /// Freezes it and waits until every task has stopped, polling every 50 µs to 1 ms. On a
    /// timeout or an error it thaws the cgroup again before returning the error, so it is never
    /// left frozen by a failed freeze (if even the thaw fails: [`CgroupError::StillFrozen`]).
    pub fn freeze(&self, timeout: Duration) -> Result<(), CgroupError> {
        let mut results = freeze_all(&[self], timeout);
        results.pop().unwrap_or(Ok(()))
    }

    /// Thaws it and reads the state back: v1 writes `THAWED` and expects to read `THAWED`; v2
    /// writes `0` and expects `cgroup.events` to say `frozen 0`.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        match self.version {
            FreezerVersion::V1 => v1::thaw(&self.path),
            FreezerVersion::V2 => v2::thaw(&self.path),
        }
    }

    /// The processes directly in it (`cgroup.procs`; not those of child cgroups).
    /// A removed directory is [`CgroupError::Gone`].
    pub fn pids(&self) -> Result<Vec<u32>, CgroupError> {
        CgroupReader::new(self.clone()).pids()
    }

    /// Whether any process is left in it or its child cgroups; `false` once its directory is
    /// gone.
    pub fn is_populated(&self) -> Result<bool, CgroupError> {
        CgroupReader::new(self.clone()).is_populated()
    }

    /// CPU time used so far by its processes; it only grows while the same processes live.
    /// v2: `usage_usec` of its `cpu.stat` (child cgroups included). v1: `cpuacct.usage` of the
    /// cpuacct cgroup all its member processes are in, when that is not the cpuacct root; else
    /// the sum of their `utime + stime` from `/proc/PID/stat`.
    pub fn cpu_time(&self, h: &Hierarchies) -> Result<Duration, CgroupError> {
        self.cpu_time_in(Path::new("/proc"), h)
    }

    /// [`FreezerCgroup::cpu_time`], with `proc` standing for `/proc` (tests give a fixture).
    pub fn cpu_time_in(&self, proc: &Path, h: &Hierarchies) -> Result<Duration, CgroupError> {
        CgroupReader::with_proc(self.clone(), proc).cpu_time(h)
    }

    /// Thaws it after a failed freeze, and says what the caller must hear: the original error,
    /// or [`CgroupError::StillFrozen`] when the thaw failed too.
    fn undo_failed_freeze(&self, cause: CgroupError) -> CgroupError {
        if cause.is_gone() {
            return cause;
        }
        match self.thaw() {
            // The caller logs what it is told: the library itself logs nothing (the hook links
            // it and has no logger).
            Ok(()) => cause,
            Err(thaw) if thaw.is_gone() => thaw,
            Err(thaw) => CgroupError::StillFrozen {
                path: self.path.clone(),
                cause: Box::new(cause),
                thaw: Box::new(thaw),
            },
        }
    }
}

/// Freezes several cgroups at once: writes every request first, then waits for all of them,
/// polling every 50 µs at first and at most every 1 ms, until `timeout`. Returns one result per
/// cgroup, in order; a cgroup whose freeze failed or timed out is thawed again (see
/// [`FreezerCgroup::freeze`]).
pub fn freeze_all(cgroups: &[&FreezerCgroup], timeout: Duration) -> Vec<Result<(), CgroupError>> {
    let start = Instant::now();
    // None: still freezing.
    let mut outcomes: Vec<Option<Result<(), CgroupError>>> = cgroups
        .iter()
        .map(|c| c.request_freeze().err().map(Err))
        .collect();
    let mut pause = FIRST_POLL;
    loop {
        for (outcome, cgroup) in outcomes.iter_mut().zip(cgroups) {
            if outcome.is_none() {
                match cgroup.is_frozen() {
                    Ok(true) => *outcome = Some(Ok(())),
                    Ok(false) => {}
                    Err(e) => *outcome = Some(Err(e)),
                }
            }
        }
        let elapsed = start.elapsed();
        if outcomes.iter().all(Option::is_some) || elapsed >= timeout {
            break;
        }
        thread::sleep(pause.min(timeout - elapsed));
        pause = (pause * 2).min(MAX_POLL);
    }
    let waited = start.elapsed();
    outcomes
        .into_iter()
        .zip(cgroups)
        .map(|(outcome, cgroup)| {
            let error = match outcome {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => e,
                None => CgroupError::Timeout {
                    path: cgroup.path.clone(),
                    waited,
                },
            };
            Err(cgroup.undo_failed_freeze(error))
        })
        .collect()
}

/// Parses `cgroup.procs`: one pid a line. On failure, returns the offending line.
pub(super) fn parse_pids(text: &str) -> Result<Vec<u32>, String> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.trim().parse().map_err(|_| line.to_string()))
        .collect()
}

/// v1 has no `populated` flag: a process in the directory or in any directory below it.
pub(super) fn v1_is_populated(dir: &Path) -> Result<bool, CgroupError> {
    match fsio::read(dir, "cgroup.procs") {
        Ok(text) if text.trim().is_empty() => {}
        Ok(_) => return Ok(true),
        Err(CgroupError::Gone(_)) => return Ok(false),
        Err(e) => return Err(e),
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            return match fsio::classify(dir, dir, e) {
                CgroupError::Gone(_) => Ok(false),
                other => Err(other),
            }
        }
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) && v1_is_populated(&entry.path())? {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
#[path = "freezer_tests.rs"]
mod tests;
