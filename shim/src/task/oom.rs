//! OOM kills in a container's memory cgroup, reported as containerd's `/tasks/oom` event, as
//! runc's shim reports them: cgroup v1's `memory.oom_control` notification through an eventfd
//! registered in `cgroup.event_control`.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};

use super::metrics::v1_directories;

/// The v1 memory cgroup of `pid`, if it has one.
pub fn memory_cgroup(pid: u32) -> Option<PathBuf> {
    let proc_cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    v1_directories(&proc_cgroup).remove("memory")
}

/// Calls `on_oom` at each OOM kill in the v1 memory cgroup `dir`, from a thread that ends when
/// the cgroup is removed (the kernel signals the eventfd then too).
pub fn watch(dir: &Path, on_oom: impl Fn() + Send + 'static) -> io::Result<()> {
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
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _control = control;
        let mut count = [0u8; 8];
        while events.read_exact(&mut count).is_ok() {
            if !dir.join("memory.oom_control").exists() {
                return;
            }
            on_oom();
        }
    });
    Ok(())
}
