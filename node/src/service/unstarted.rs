//! Containers attached before they start.
//!
//! podman's `createRuntime` hook and the containerd shim attach a container while its init is
//! still the runtime's (`runc init`, crun's child) and waits for `start`. A freeze then would
//! make runc read the container as paused and refuse `runc start` ("cannot start a container in
//! the paused state"). So until its init runs another program than it ran when attached, a
//! container is not sampled: it has no work, and the scheduler never freezes a vGPU without work.
//! The program is told by `/proc/PID/exe`'s device and inode: an `execve` changes them, nothing
//! else does.

use std::os::unix::fs::MetadataExt;

/// A container's init as it was when attached, before it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Unstarted {
    pid: u32,
    /// The device and inode of its program.
    program: [u64; 2],
}

impl Unstarted {
    /// The init `pid` as it is now; `None` when its program cannot be read (it is gone).
    pub fn of(pid: u32) -> Option<Unstarted> {
        Some(Unstarted {
            pid,
            program: program_of(pid)?,
        })
    }

    /// The init `pid` as saved before a restart: running `program` (device, inode).
    pub fn saved(pid: u32, program: [u64; 2]) -> Unstarted {
        Unstarted { pid, program }
    }

    /// The program it ran when attached, to save.
    pub fn program(&self) -> [u64; 2] {
        self.program
    }

    /// Whether the init has started its container's program since (or is gone).
    pub fn has_started(&self) -> bool {
        program_of(self.pid) != Some(self.program)
    }
}

/// The device and inode of the program `pid` runs.
fn program_of(pid: u32) -> Option<[u64; 2]> {
    let meta = std::fs::metadata(format!("/proc/{pid}/exe")).ok()?;
    Some([meta.dev(), meta.ino()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    #[test]
    fn a_process_has_started_once_it_runs_another_program() {
        // `sh` waits for a line, as runc init waits for `start`, then runs `sleep`.
        let mut child = Command::new("sh")
            .args(["-c", "read line; exec sleep 5"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let unstarted = Unstarted::of(child.id()).expect("a live process");
        std::thread::sleep(Duration::from_millis(50));
        assert!(!unstarted.has_started(), "still the shell");
        child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !unstarted.has_started() {
            assert!(Instant::now() < deadline, "the exec of sleep was not seen");
            std::thread::sleep(Duration::from_millis(5));
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_process_that_is_gone_counts_as_started() {
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let unstarted = Unstarted::of(child.id()).expect("a live process");
        assert!(!unstarted.has_started());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(unstarted.has_started());
        assert_eq!(Unstarted::of(child.id()), None);
    }
}
