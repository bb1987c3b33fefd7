//! [`ExitWatch`]: the exits of containers' processes, told by the kernel.
//!
//! Each enforced container has a pidfd of a few of its processes (at most [`WATCHED`]), in one
//! epoll set. A pidfd becomes readable when its process exits; the watch's thread then tells the
//! loop ([`Event::Exited`]), which looks at whether the container has any process left: it
//! releases the container when none is, or watches the processes it has now. A container's last
//! process is one the watch holds, or one that appeared after the watch last looked; the
//! service's sweep of every container (`EXIT_SWEEP`) covers that case, and any pidfd that could
//! not be opened.
//!
//! Each pidfd is registered one-shot: it reports once, and the loop's next look replaces it.
//! Closing a pidfd (the container forgotten, or watched again) takes it out of the set.

use std::os::fd::OwnedFd;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use gpuplex_scheduler::VgpuId;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use super::Event;

/// The most processes of one container watched at once (the first ones it lists).
pub const WATCHED: usize = 8;

/// The epoll set of the containers' pidfds.
pub(super) struct ExitWatch {
    epoll: Arc<Epoll>,
}

impl ExitWatch {
    /// An empty set; nothing is reported until [`ExitWatch::spawn`].
    pub fn new() -> std::io::Result<ExitWatch> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        Ok(ExitWatch {
            epoll: Arc::new(epoll),
        })
    }

    /// Watches up to [`WATCHED`] of `pids`, processes of `vgpu`'s container; returns their
    /// pidfds, which the caller keeps as long as it wants them watched. A process that is gone
    /// already is left out (the caller's next look at the container sees it).
    pub fn watch(&self, vgpu: VgpuId, pids: &[u32]) -> Vec<OwnedFd> {
        let mut fds = Vec::new();
        for &pid in pids {
            if fds.len() == WATCHED {
                break;
            }
            let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
                continue;
            };
            let Ok(fd) = pidfd_open(pid, PidfdFlags::empty()) else {
                continue;
            };
            let event = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLONESHOT, vgpu.0);
            if self.epoll.add(&fd, event).is_ok() {
                fds.push(fd);
            }
        }
        fds
    }

    /// Starts the thread that tells the loop of each exit, until the loop is gone.
    pub fn spawn(&self, events: Sender<Event>) -> std::io::Result<()> {
        let epoll = Arc::clone(&self.epoll);
        std::thread::Builder::new()
            .name("exit-watch".into())
            .spawn(move || {
                let mut ready = [EpollEvent::empty(); 64];
                loop {
                    let n = match epoll.wait(&mut ready, EpollTimeout::NONE) {
                        Ok(n) => n,
                        Err(nix::errno::Errno::EINTR) => continue,
                        Err(e) => {
                            tracing::error!("exit watch: {e}; exits are seen by the sweep only");
                            return;
                        }
                    };
                    for event in &ready[..n] {
                        if events.send(Event::Exited(VgpuId(event.data()))).is_err() {
                            return;
                        }
                    }
                }
            })
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_exit_is_told_once_with_its_vgpu_and_a_gone_pid_is_skipped() {
        let watch = ExitWatch::new().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let fds = watch.watch(VgpuId(7), &[child.id(), 4_000_000_000]);
        assert_eq!(fds.len(), 1);
        let (tx, rx) = std::sync::mpsc::channel();
        watch.spawn(tx).unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Event::Exited(vgpu)) => assert_eq!(vgpu, VgpuId(7)),
            _ => panic!("no exit reported"),
        }
        // One-shot: reported once, however long the pidfd stays readable.
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    }
}
