//! The one error type of the cgroup module.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Why a cgroup operation failed. Every message is one line and names the path or pid involved.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Reading or writing a file failed for a reason other than the cgroup being gone.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// The cgroup's directory no longer exists: its processes exited and it was removed.
    #[error("cgroup {} is gone: its directory was removed (its container exited)", .0.display())]
    Gone(PathBuf),
    /// No process has this pid.
    #[error(
        "no process {pid}: /proc/{pid} does not exist (the process exited, or the pid is wrong)"
    )]
    NoProcess {
        /// The pid asked about.
        pid: u32,
    },
    /// The process is in the root cgroup of every freezer hierarchy mounted here.
    #[error(
        "process {pid} is in the root freezer cgroup: gpuplex freezes whole cgroups, so run it in a cgroup of its own"
    )]
    RootCgroup {
        /// The pid asked about.
        pid: u32,
    },
    /// Neither a cgroup v1 freezer hierarchy nor cgroup2 is mounted.
    #[error(
        "no freezer hierarchy is mounted: /proc/self/mountinfo shows neither a cgroup v1 freezer nor cgroup2; mount one (e.g. `mount -t cgroup2 none /sys/fs/cgroup`)"
    )]
    NoFreezer,
    /// A path that is not a freezer cgroup directory: outside both hierarchies, a hierarchy's
    /// root, or a directory without the freezer's control file.
    #[error(
        "{} is not a freezer cgroup: give a directory below the v1 freezer mount (with freezer.state) or below the cgroup2 mount (with cgroup.freeze), not the mount itself",
        .0.display()
    )]
    NotACgroup(PathBuf),
    /// A freeze did not complete in time. The cgroup was thawed again.
    #[error("cgroup {} did not freeze within {waited:?}; it was thawed again", path.display())]
    Timeout {
        /// The cgroup's directory.
        path: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
    /// A thaw was written but the cgroup still reads frozen (a frozen parent cgroup does this).
    #[error(
        "{} still reads {found:?} after the thaw was written: is a parent cgroup frozen?",
        path.display()
    )]
    NotThawed {
        /// The file read back (`freezer.state` or `cgroup.events`).
        path: PathBuf,
        /// What it reads (trimmed).
        found: String,
    },
    /// A file whose contents do not follow the kernel's format.
    #[error("unexpected contents in {}: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What was wrong, quoting the offending text.
        what: String,
    },
    /// Freezing failed, and thawing the cgroup again failed too: it may be left frozen.
    #[error(
        "cgroup {} may be left frozen: freezing failed ({cause}) and thawing it again failed too ({thaw})",
        path.display()
    )]
    StillFrozen {
        /// The cgroup's directory.
        path: PathBuf,
        /// Why freezing failed.
        cause: Box<CgroupError>,
        /// Why the thaw that followed failed.
        thaw: Box<CgroupError>,
    },
}

impl CgroupError {
    /// Whether this error says the cgroup (or process) no longer exists, which the node service
    /// treats as "the container exited" rather than as a failure.
    pub fn is_gone(&self) -> bool {
        matches!(self, CgroupError::Gone(_) | CgroupError::NoProcess { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_is_one_line_and_names_its_subject() {
        let path = PathBuf::from("/sys/fs/cgroup/freezer/web");
        let errors = [
            CgroupError::Io {
                path: path.join("freezer.state"),
                source: io::Error::from_raw_os_error(libc::EBUSY),
            },
            CgroupError::Gone(path.clone()),
            CgroupError::NoProcess { pid: 42 },
            CgroupError::RootCgroup { pid: 42 },
            CgroupError::NoFreezer,
            CgroupError::NotACgroup(path.clone()),
            CgroupError::Timeout {
                path: path.clone(),
                waited: Duration::from_millis(100),
            },
            CgroupError::NotThawed {
                path: path.join("freezer.state"),
                found: "FROZEN".into(),
            },
            CgroupError::Malformed {
                path: path.join("cgroup.procs"),
                what: "line \"x\" is not a pid".into(),
            },
            CgroupError::StillFrozen {
                path: path.clone(),
                cause: Box::new(CgroupError::Timeout {
                    path: path.clone(),
                    waited: Duration::from_millis(100),
                }),
                thaw: Box::new(CgroupError::Io {
                    path: path.join("freezer.state"),
                    source: io::Error::from_raw_os_error(libc::EIO),
                }),
            },
        ];
        for error in errors {
            let message = error.to_string();
            assert!(!message.contains('\n'), "{message}");
            assert!(
                message.contains("/sys/fs/cgroup/freezer/web")
                    || message.contains("42")
                    || matches!(error, CgroupError::NoFreezer),
                "{message}"
            );
        }
    }

    #[test]
    fn root_cgroup_message_says_what_to_do() {
        assert_eq!(
            CgroupError::RootCgroup { pid: 7 }.to_string(),
            "process 7 is in the root freezer cgroup: gpuplex freezes whole cgroups, so run it in a cgroup of its own"
        );
    }

    #[test]
    fn gone_and_no_process_are_gone() {
        assert!(CgroupError::Gone(PathBuf::from("/x")).is_gone());
        assert!(CgroupError::NoProcess { pid: 1 }.is_gone());
        assert!(!CgroupError::NoFreezer.is_gone());
    }
}
