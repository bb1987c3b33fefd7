//! OOM kills in a container's memory cgroup, reported as containerd's `/tasks/oom` event, as
//! runc's shim reports them: on cgroup v1, `memory.oom_control`'s notification through an
//! eventfd registered in `cgroup.event_control`; on cgroup2, a change of `memory.events` seen
//! through inotify. Either way kills are counted by `oom_kill`, so that each is reported once,
//! and before the container's exit.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::metrics::v1_directories;

/// Where a container's OOM kills are counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryCgroup {
    /// A v1 memory cgroup (`memory.oom_control`).
    V1(PathBuf),
    /// A cgroup2 cgroup with the memory controller (`memory.events`).
    V2(PathBuf),
}

impl MemoryCgroup {
    /// The file whose `oom_kill` line counts the kills.
    fn counter(&self) -> PathBuf {
        match self {
            MemoryCgroup::V1(dir) => dir.join("memory.oom_control"),
            MemoryCgroup::V2(dir) => dir.join("memory.events"),
        }
    }
}

/// The memory cgroup of `pid`: its v1 one, else its cgroup2 one when that has the memory
/// controller.
pub fn memory_cgroup(pid: u32) -> Option<MemoryCgroup> {
    let proc_cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let mounts = gpuplex_cgroup::CgroupMounts::of_this_process().ok()?;
    if let Some(dir) = v1_directories(&proc_cgroup, &mounts).remove("memory") {
        return Some(MemoryCgroup::V1(dir));
    }
    let path = gpuplex_cgroup::ProcCgroup::parse(&proc_cgroup).unified?;
    let dir = mounts.unified_dir(&path)?;
    dir.join("memory.events")
        .is_file()
        .then_some(MemoryCgroup::V2(dir))
}

/// The OOM kills of one v1 memory cgroup, reported once each: by the watcher thread when the
/// kernel signals one, or, when that thread comes too late (the cgroup is read after the
/// container's exit), by [`OomWatch::catch_up`] before the exit is reported.
#[derive(Clone)]
pub struct OomWatch {
    cgroup: MemoryCgroup,
    /// The kills reported so far.
    reported: Arc<Mutex<u64>>,
    on_oom: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for OomWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OomWatch")
            .field("cgroup", &self.cgroup)
            .finish()
    }
}

impl OomWatch {
    /// Reports the kills of its cgroup not reported yet; false when the cgroup cannot be read
    /// (it is gone).
    pub fn catch_up(&self) -> bool {
        let Ok(text) = std::fs::read_to_string(self.cgroup.counter()) else {
            return false;
        };
        // A file caught between two writes (the tests') has no count yet: nothing new.
        let Some(kills) = oom_kills(&text) else {
            return true;
        };
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        while *reported < kills {
            *reported += 1;
            (self.on_oom)();
        }
        true
    }
}

/// The `oom_kill` count in the text of `memory.oom_control` (v1) or `memory.events` (cgroup2).
fn oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// Calls `on_oom` at each OOM kill in `cgroup`, from a thread that ends when the cgroup is
/// removed or emptied.
pub fn watch(
    cgroup: &MemoryCgroup,
    on_oom: impl Fn() + Send + Sync + 'static,
) -> io::Result<OomWatch> {
    let watch = OomWatch {
        cgroup: cgroup.clone(),
        reported: Arc::new(Mutex::new(
            std::fs::read_to_string(cgroup.counter())
                .ok()
                .and_then(|t| oom_kills(&t))
                .unwrap_or(0),
        )),
        on_oom: Arc::new(on_oom),
    };
    match cgroup {
        MemoryCgroup::V1(dir) => watch_v1(dir, watch.clone())?,
        MemoryCgroup::V2(dir) => watch_v2(dir, watch.clone())?,
    };
    Ok(watch)
}

/// v1: the kernel signals an eventfd at each OOM (and when the cgroup is removed). The
/// watching thread is returned.
fn watch_v1(dir: &Path, watcher: OomWatch) -> io::Result<JoinHandle<()>> {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    let events = EventFd::from_flags(EfdFlags::EFD_CLOEXEC).map_err(io::Error::from)?;
    let control = File::open(dir.join("memory.oom_control"))?;
    std::fs::write(
        dir.join("cgroup.event_control"),
        format!("{} {}", events.as_fd().as_raw_fd(), control.as_raw_fd()),
    )?;
    Ok(std::thread::spawn(move || {
        let _control = control;
        while events.read().is_ok() {
            if !watcher.catch_up() {
                return;
            }
        }
    }))
}

/// cgroup2: `memory.events` changes at each OOM; `cgroup.events` says when the cgroup is empty.
/// The watching thread is returned.
fn watch_v2(dir: &Path, watcher: OomWatch) -> io::Result<JoinHandle<()>> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC).map_err(io::Error::from)?;
    for file in ["memory.events", "cgroup.events"] {
        inotify
            .add_watch(&dir.join(file), AddWatchFlags::IN_MODIFY)
            .map_err(io::Error::from)?;
    }
    let populated = dir.join("cgroup.events");
    Ok(std::thread::spawn(move || {
        while inotify.read_events().is_ok() {
            if !watcher.catch_up() {
                return;
            }
            let empty = std::fs::read_to_string(&populated)
                .map_or(true, |t| t.lines().any(|l| l == "populated 0"));
            if empty {
                return;
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn cgroup2_oom_kills_are_reported_once_each_until_the_cgroup_empties() {
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("memory.events");
        let cgroup_events = dir.path().join("cgroup.events");
        std::fs::write(&events, "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n").unwrap();
        std::fs::write(&cgroup_events, "populated 1\nfrozen 0\n").unwrap();
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let watch = OomWatch {
            cgroup: MemoryCgroup::V2(dir.path().to_path_buf()),
            reported: Arc::new(Mutex::new(0)),
            on_oom: Arc::new(move || {
                let _ = tx.lock().unwrap().send(());
            }),
        };
        let thread = watch_v2(dir.path(), watch.clone()).unwrap();
        let wait = Duration::from_secs(5);
        std::fs::write(&events, "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n").unwrap();
        rx.recv_timeout(wait).expect("the first kill");
        std::fs::write(&events, "low 0\nhigh 0\nmax 4\noom 3\noom_kill 3\n").unwrap();
        rx.recv_timeout(wait).expect("the second kill");
        rx.recv_timeout(wait).expect("the third kill");
        // A catch-up (at the exit) finds nothing new: each kill is reported once.
        assert!(watch.catch_up());
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        std::fs::write(&cgroup_events, "populated 0\nfrozen 0\n").unwrap();
        let (ended, thread_ended) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = thread.join();
            let _ = ended.send(());
        });
        thread_ended
            .recv_timeout(wait)
            .expect("the watch ended with the cgroup's last process");
    }
}
