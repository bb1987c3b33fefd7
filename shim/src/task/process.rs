//! One process of a container (its init, or an exec): its lifecycle as containerd sees it, and
//! the wait for its exit.

use std::sync::{Arc, Condvar, Mutex};
use std::time::SystemTime;

use containerd_shim::api::Status;

use super::stdio::{ProcessIo, StdioPaths};

/// Where a process is in its life. The transitions: Created → Running (start) → Stopped (its
/// exit); Running ⇄ Paused (the user's pause and resume, init only); Created → StartFailed (an
/// exec that runc could not start: as containerd's runc shim, it reads as created, a wait for it
/// returns at once with status 0 at Go's zero time, and it gives no exit event).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// Created by runc, not started.
    Created,
    /// Started.
    Running,
    /// Frozen by the user.
    Paused,
    /// An exec that runc could not start.
    StartFailed,
    /// Exited, with its status and when.
    Stopped {
        /// The exit status (128 + the signal for a killed process).
        status: u32,
        /// When it exited.
        at: SystemTime,
    },
}

impl Lifecycle {
    /// containerd's name for it.
    pub fn status(self) -> Status {
        match self {
            Lifecycle::Created | Lifecycle::StartFailed => Status::CREATED,
            Lifecycle::Running => Status::RUNNING,
            Lifecycle::Paused => Status::PAUSED,
            Lifecycle::Stopped { .. } => Status::STOPPED,
        }
    }
}

/// Go's zero time (0001-01-01T00:00:00Z), which containerd's runc shim reports as the exit time
/// of a process that has none.
pub fn go_zero_time() -> SystemTime {
    SystemTime::UNIX_EPOCH - std::time::Duration::from_secs(62_135_596_800)
}

/// A process's lifecycle, shared with the threads that wait for its exit.
#[derive(Debug)]
pub struct LifecycleCell {
    now: Mutex<Lifecycle>,
    changed: Condvar,
}

impl LifecycleCell {
    /// A cell in `state`.
    pub fn new(state: Lifecycle) -> Arc<LifecycleCell> {
        Arc::new(LifecycleCell {
            now: Mutex::new(state),
            changed: Condvar::new(),
        })
    }

    /// The state now.
    pub fn get(&self) -> Lifecycle {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves to `state`; an exit, or a failed start, is final.
    pub fn set(&self, state: Lifecycle) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*now, Lifecycle::Stopped { .. } | Lifecycle::StartFailed) {
            *now = state;
        }
        self.changed.notify_all();
    }

    /// Blocks until the process has exited (or failed to start: status 0 at
    /// [`go_zero_time`]); its status and when.
    pub fn wait_exit(&self) -> (u32, SystemTime) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match *now {
                Lifecycle::Stopped { status, at } => return (status, at),
                Lifecycle::StartFailed => return (0, go_zero_time()),
                _ => {}
            }
            now = self.changed.wait(now).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A process: the container's init (exec id empty) or one started by `Exec`.
#[derive(Debug)]
pub struct Process {
    /// The exec id; empty for init.
    pub exec_id: String,
    /// Its pid on the host, once runc has made it (0 before).
    pub pid: u32,
    /// Its fifos.
    pub stdio: StdioPaths,
    /// Its lifecycle.
    pub lifecycle: Arc<LifecycleCell>,
    /// The copying of its stdio, once it has a pid.
    pub io: Option<ProcessIo>,
    /// For an exec: the OCI process (JSON) containerd sent, to give runc at start.
    pub spec: Option<oci_spec::runtime::Process>,
}

impl Process {
    /// A process that runc has not made yet.
    pub fn new(exec_id: &str, stdio: StdioPaths) -> Process {
        Process {
            exec_id: exec_id.to_owned(),
            pid: 0,
            stdio,
            lifecycle: LifecycleCell::new(Lifecycle::Created),
            io: None,
            spec: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_exit_is_final_and_wakes_every_waiter() {
        let cell = LifecycleCell::new(Lifecycle::Created);
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let cell = Arc::clone(&cell);
                std::thread::spawn(move || cell.wait_exit().0)
            })
            .collect();
        cell.set(Lifecycle::Running);
        cell.set(Lifecycle::Paused);
        std::thread::sleep(Duration::from_millis(20));
        let at = SystemTime::now();
        cell.set(Lifecycle::Stopped { status: 137, at });
        cell.set(Lifecycle::Running);
        for w in waiters {
            assert_eq!(w.join().unwrap(), 137);
        }
        assert_eq!(cell.get(), Lifecycle::Stopped { status: 137, at });
        assert_eq!(cell.get().status(), Status::STOPPED);
    }

    #[test]
    fn a_failed_start_is_final_reads_as_created_and_releases_its_waiters_at_once() {
        let cell = LifecycleCell::new(Lifecycle::Created);
        let waiter = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || cell.wait_exit())
        };
        cell.set(Lifecycle::StartFailed);
        assert_eq!(waiter.join().unwrap(), (0, go_zero_time()));
        cell.set(Lifecycle::Running);
        assert_eq!(cell.get(), Lifecycle::StartFailed);
        assert_eq!(cell.get().status(), Status::CREATED);
    }
}
