//! The watchdog: what thaws the containers the node service froze when the service dies by a
//! signal it cannot handle (SIGKILL, an OOM kill, a panic), without systemd.
//!
//! The service spawns it as `containerd-shim-gpuplex-v1 watchdog --state-dir DIR`, a process of
//! its own session (a signal to the service's process group does not reach it), named
//! `gpuplex-watchdog`, holding:
//!
//! - on its stdin, the read end of a pipe whose only write end the service holds (close-on-exec,
//!   so no other process inherits it): the read returns end-of-file the moment the service is
//!   gone, however it went;
//! - a copy of the service's node lock ([`crate::state::NodeLock`]), so that a service started
//!   after the crash waits until the watchdog is done before it touches a cgroup.
//!
//! At end-of-file (or on SIGTERM, SIGINT or SIGHUP) it thaws every cgroup of `frozen.json`, the
//! list the service rewrites before each freeze and after thaws, and exits. A clean stop leaves
//! the list empty, so the watchdog then thaws nothing. It reads no record and decides nothing:
//! it only undoes freezes. The service respawns it when it exits early.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};

use crate::state::{NodeLock, StateDir};
use gpuplex_cgroup::Hierarchies;

/// The watchdog as the service holds it.
#[derive(Debug)]
pub(super) struct Watchdog {
    child: Child,
    /// The pipe's write end: closed when the service dies, which wakes the watchdog.
    _alive: OwnedFd,
}

impl Watchdog {
    /// Spawns the watchdog of the service whose state is in `state_dir`.
    pub fn spawn(state_dir: &Path, lock: &NodeLock) -> std::io::Result<Watchdog> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        // The child inherits this copy of the lock (no close-on-exec); ours is closed after.
        let lock_copy = lock.inheritable()?;
        let child = Command::new("/proc/self/exe")
            .arg("watchdog")
            .arg("--state-dir")
            .arg(state_dir)
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn();
        drop(lock_copy);
        Ok(Watchdog {
            child: child?,
            _alive: write,
        })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (and then reaps it).
    pub fn has_exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }
}

/// The watchdog's own `main`: waits for the service to go, then thaws what it left frozen.
pub fn run(state_dir: PathBuf) -> ExitCode {
    let _ = nix::sys::prctl::set_name(c"gpuplex-watchdog");
    let _ = nix::unistd::setsid();
    let service = nix::unistd::getppid();
    {
        let state_dir = state_dir.clone();
        let signals = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGTERM,
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGHUP,
        ]);
        if let Ok(mut signals) = signals {
            std::thread::spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    let thawed = thaw_left_frozen(&state_dir);
                    eprintln!(
                        "gpuplex watchdog: stopped by signal {signal}; thawed {thawed} cgroup(s) the node service may have frozen"
                    );
                    std::process::exit(0);
                }
            });
        }
    }
    // End of file (or an error) on stdin: the service's end of the pipe is closed.
    let mut buf = [0u8; 64];
    while matches!(nix::unistd::read(std::io::stdin(), &mut buf), Ok(n) if n > 0) {}
    let thawed = thaw_left_frozen(&state_dir);
    if thawed > 0 {
        eprintln!(
            "gpuplex watchdog: the node service (pid {service}) is gone; thawed {thawed} cgroup(s) it had frozen"
        );
    }
    ExitCode::SUCCESS
}

/// Thaws every cgroup of the frozen list that is still a freezer cgroup of its version; how many.
fn thaw_left_frozen(state_dir: &Path) -> usize {
    let state = match StateDir::open(state_dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpuplex watchdog: {e}");
            return 0;
        }
    };
    let frozen = match state.load_frozen() {
        Ok(f) => f.frozen,
        Err(e) => {
            eprintln!("gpuplex watchdog: cannot read the frozen list: {e}");
            return 0;
        }
    };
    let hierarchies = Hierarchies::of_this_machine().unwrap_or_default();
    let done = super::leftovers::thaw(&frozen, &hierarchies);
    for why in &done.failed {
        eprintln!("gpuplex watchdog: {why}");
    }
    done.thawed
}
