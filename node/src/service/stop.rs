//! `containerd-shim-gpuplex-v1 stop`: the node service stopped however it was started, and
//! nothing it may have frozen left frozen. The Debian package's `prerm` runs it after systemd's
//! own stop, so that removing the package thaws every container even where no systemd runs the
//! service (a container's init, a service started by hand) or where it would not stop.
//!
//! The service is found by what it holds, not by a pid file: the processes that have the node
//! lock (`state_dir/lock`) open are the service and its watchdog (`gpuplex-watchdog`), the only
//! ones (root's directory, mode 0700; the lock is opened close-on-exec everywhere else). The
//! service is sent SIGTERM, which thaws everything it froze; once the lock is free they are all
//! gone. One still holding it after the timeout is killed (SIGKILL), and its watchdog thaws. Then,
//! with the lock held, so that no service starts meanwhile, every cgroup of the frozen list and
//! every saved container not held by its user is thawed once more: what a service that died
//! with no watchdog (a kill -9 of both) left frozen is thawed too.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_cgroup::Hierarchies;
use nix::sys::signal::Signal;

use super::leftovers;
use crate::state::{NodeLock, StateDir};

/// The watchdog's process name ([`super::watchdog`]) as `/proc/PID/comm` shows it: the kernel
/// keeps 15 bytes of `gpuplex-watchdog`.
const WATCHDOG_COMM: &str = "gpuplex-watchdo";

/// How long a process killed with SIGKILL is given to let the lock go (a watchdog, to thaw).
const AFTER_KILL: Duration = Duration::from_secs(5);

/// What a stop did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stopped {
    /// The pids sent SIGTERM (the services; the watchdogs when no service was left).
    pub terminated: Vec<u32>,
    /// The pids that had to be killed.
    pub killed: Vec<u32>,
    /// How many cgroups the stop itself left thawed, whether or not they still were frozen (the
    /// service thaws its own first).
    pub checked: usize,
    /// State files that could not be read (set aside as `.bad`), one line each.
    pub unread: Vec<String>,
}

impl Stopped {
    /// One line saying what was done.
    pub fn summary(&self, state_dir: &Path) -> String {
        let who = match (self.terminated.as_slice(), self.killed.as_slice()) {
            ([], []) => format!(
                "no gpuplex node service was running on {}",
                state_dir.display()
            ),
            (stopped, []) => format!("stopped the gpuplex node service (pid {})", pids(stopped)),
            (_, killed) => format!(
                "killed the gpuplex node service (pid {}), which did not stop on SIGTERM",
                pids(killed)
            ),
        };
        format!(
            "{who}; every container it may have frozen is thawed ({} cgroup(s) checked)",
            self.checked
        )
    }
}

fn pids(pids: &[u32]) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a stop could not finish. One line each.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// The state directory could not be opened or read.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The lock is still held after SIGKILL.
    #[error("{path}: still held by pid {pids} after SIGKILL; nothing more was thawed")]
    StillHeld {
        /// The lock.
        path: PathBuf,
        /// Who holds it.
        pids: String,
    },
    /// After an exit, the lock is held by a service that still runs (`after_exit`).
    #[error("{path}: held by pid {pids}, a node service that still runs; it thaws what it froze, nothing was done")]
    Running {
        /// The lock.
        path: PathBuf,
        /// Who holds it.
        pids: String,
    },
    /// Some cgroups could not be thawed.
    #[error("{} cgroup(s) may stay frozen: {}", .failed.len(), .failed.join("; "))]
    Thaw {
        /// One line per cgroup.
        failed: Vec<String>,
    },
}

/// Stops the node service whose state is in `state_dir`, giving it `timeout` to stop on
/// SIGTERM, and thaws whatever is left. A state directory that does not exist means nothing ever
/// ran: nothing to do.
pub fn stop(state_dir: &Path, timeout: Duration) -> Result<Stopped, StopError> {
    let mut stopped = Stopped::default();
    if !state_dir.is_dir() {
        return Ok(stopped);
    }
    let state = StateDir::open(state_dir)?;
    let lock_path = state.lock_path();
    stopped.terminated = services_first(&lock_holders(&lock_path));
    for pid in &stopped.terminated {
        signal(*pid, Signal::SIGTERM);
    }
    // Not stopped in time: the service is killed, and its watchdog thaws and lets go; then
    // whatever still holds the lock.
    let mut lock = state.lock(timeout);
    for last_resort in [false, true] {
        if lock.is_ok() {
            break;
        }
        let holders = lock_holders(&lock_path);
        let killed = if last_resort {
            holders.into_iter().map(|(pid, _)| pid).collect()
        } else {
            services_first(&holders)
        };
        for pid in &killed {
            signal(*pid, Signal::SIGKILL);
        }
        stopped.killed.extend(killed);
        lock = state.lock(AFTER_KILL);
    }
    let lock: NodeLock = lock.map_err(|_| StopError::StillHeld {
        pids: pids(&services_first(&lock_holders(&lock_path))),
        path: lock_path.clone(),
    })?;
    thaw_under(&state, lock, stopped)
}

/// After the node service has exited, however it went (systemd's `ExecStopPost`, which also
/// runs when `systemctl kill` killed the service and its watchdog together): signals nobody,
/// waits up to `timeout` for whoever still holds the node lock (a watchdog thawing) to let it
/// go, then thaws whatever is left, as [`stop`] does. A service that still holds the lock after
/// `timeout` (one started by hand while systemd's failed to) is left alone: `Running`.
pub fn after_exit(state_dir: &Path, timeout: Duration) -> Result<Stopped, StopError> {
    if !state_dir.is_dir() {
        return Ok(Stopped::default());
    }
    let state = StateDir::open(state_dir)?;
    let lock_path = state.lock_path();
    let lock = state.lock(timeout).map_err(|_| StopError::Running {
        pids: pids(&services_first(&lock_holders(&lock_path))),
        path: lock_path.clone(),
    })?;
    thaw_under(&state, lock, Stopped::default())
}

/// With the node lock held, so that no service starts meanwhile: every cgroup of the frozen
/// list and every saved container not held by its user thawed.
fn thaw_under(
    state: &StateDir,
    _lock: NodeLock,
    mut stopped: Stopped,
) -> Result<Stopped, StopError> {
    let hierarchies = Hierarchies::of_this_machine().unwrap_or_default();
    // What cannot be read is reported, not fatal: the records' cgroups are thawed anyway.
    let listed = match state.load_frozen() {
        Ok(list) => list.frozen,
        Err(e) => {
            stopped.unread.push(format!("the frozen list: {e}"));
            Vec::new()
        }
    };
    let loaded = state.load()?;
    stopped.unread.extend(loaded.unreadable);
    let done = leftovers::thaw(
        listed.iter().chain(leftovers::saved_cgroups(&loaded.vgpus)),
        &hierarchies,
    );
    stopped.checked = done.thawed;
    if done.failed.is_empty() {
        Ok(stopped)
    } else {
        Err(StopError::Thaw {
            failed: done.failed,
        })
    }
}

/// The services among `holders`; the watchdogs when there is none (a watchdog alone, its
/// service just gone, thaws and exits on SIGTERM).
fn services_first(holders: &[(u32, String)]) -> Vec<u32> {
    let services: Vec<u32> = holders
        .iter()
        .filter(|(_, name)| name != WATCHDOG_COMM)
        .map(|(pid, _)| *pid)
        .collect();
    if services.is_empty() {
        holders.iter().map(|(pid, _)| *pid).collect()
    } else {
        services
    }
}

/// The processes other than this one that have `lock` open, with their names
/// (`/proc/PID/comm`), by pid.
fn lock_holders(lock: &Path) -> Vec<(u32, String)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(lock) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut holders = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return holders;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::metadata(fd.path())
                .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
        });
        if holds {
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            holders.push((pid, name.trim_end().to_string()));
        }
    }
    holders.sort();
    holders
}

fn signal(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
    }
}
