//! How the shim runs runc: the shim reaps every child itself (it is a subreaper, and the daemon's
//! SIGCHLD thread, `daemon.rs`, calls `waitpid(-1)` and tells `containerd-shim`'s exit monitor),
//! so a runc invocation cannot be waited for with `Child::wait`; its exit comes from the monitor
//! instead.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};

use containerd_shim::monitor::{monitor_subscribe, wait_pid, Topic};
use runc::Spawner;

/// Runs a command and learns its exit from the shim's reaper.
#[derive(Debug, Default)]
pub struct ReapedSpawner;

impl Spawner for ReapedSpawner {
    fn execute(&self, mut cmd: Command) -> runc::Result<(ExitStatus, u32, String, String)> {
        // Subscribed before the spawn, so that an exit reaped at once is not missed.
        let subscription = monitor_subscribe(Topic::Pid).map_err(|e| {
            runc::error::Error::Other(Box::new(std::io::Error::other(e.to_string())))
        })?;
        let mut child = cmd
            .spawn()
            .map_err(runc::error::Error::ProcessSpawnFailed)?;
        let pid = child.id();
        let drain = |stream: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut stream) = stream {
                    let mut bytes = Vec::new();
                    let _ = stream.read_to_end(&mut bytes);
                    text = String::from_utf8_lossy(&bytes).into_owned();
                }
                text
            })
        };
        let stdout = drain(
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        let stderr = drain(
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        let code = wait_pid(pid as i32, subscription);
        let stdout = stdout.join().unwrap_or_default();
        let stderr = stderr.join().unwrap_or_default();
        Ok((ExitStatus::from_raw(code << 8), pid, stdout, stderr))
    }
}
