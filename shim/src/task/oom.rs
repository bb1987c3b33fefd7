//! OOM kills in a container's memory cgroup, reported as containerd's `/tasks/oom` event, as
//! runc's shim reports them: cgroup v1's `memory.oom_control` notification through an eventfd
//! registered in `cgroup.event_control`, counted by `oom_kill` so that each kill is reported
//! once, and before the container's exit.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::metrics::v1_directories;

/// The v1 memory cgroup of `pid`, if it has one.
pub fn memory_cgroup(pid: u32) -> Option<PathBuf> {
    let proc_cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    v1_directories(&proc_cgroup).remove("memory")
}

/// The OOM kills of one v1 memory cgroup, reported once each: by the watcher thread when the
/// kernel signals one, or, when that thread comes too late (the cgroup is read after the
/// container's exit), by [`OomWatch::catch_up`] before the exit is reported.
#[derive(Clone)]
pub struct OomWatch {
    dir: PathBuf,
    /// The kills reported so far.
    reported: Arc<Mutex<u64>>,
    on_oom: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for OomWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OomWatch").field("dir", &self.dir).finish()
    }
}

impl OomWatch {
    /// Reports the kills of its cgroup not reported yet; false when the cgroup cannot be read
    /// (it is gone).
    pub fn catch_up(&self) -> bool {
        let Some(kills) = oom_kills(&self.dir) else {
            return false;
        };
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        while *reported < kills {
            *reported += 1;
            (self.on_oom)();
        }
        true
    }
}

/// The `oom_kill` count of a v1 memory cgroup's `memory.oom_control`.
fn oom_kills(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("memory.oom_control")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// Calls `on_oom` at each OOM kill in the v1 memory cgroup `dir`, from a thread that ends when
/// the cgroup is removed (the kernel signals the eventfd then too).
pub fn watch(dir: &Path, on_oom: impl Fn() + Send + Sync + 'static) -> io::Result<OomWatch> {
    // SAFETY: eventfd takes integers and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let mut events = unsafe { File::from_raw_fd(fd) };
    let control = File::open(dir.join("memory.oom_control"))?;
    std::fs::write(
        dir.join("cgroup.event_control"),
        format!("{} {}", events.as_raw_fd(), control.as_raw_fd()),
    )?;
    let watch = OomWatch {
        dir: dir.to_path_buf(),
        reported: Arc::new(Mutex::new(oom_kills(dir).unwrap_or(0))),
        on_oom: Arc::new(on_oom),
    };
    let watcher = watch.clone();
    std::thread::spawn(move || {
        let _control = control;
        let mut count = [0u8; 8];
        while events.read_exact(&mut count).is_ok() {
            if !watcher.catch_up() {
                return;
            }
        }
    });
    Ok(watch)
}
