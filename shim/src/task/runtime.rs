//! What the task service has the OCI runtime do, behind one small trait: runc in the shim
//! ([`Runc`]), a stub in the task service's unit tests.
//!
//! Each call names a container by containerd's id; an error is what the runtime said (runc's
//! last error in its log), which the service prefixes as containerd's runc shim does.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oci_spec::runtime::{LinuxResources, Process};
use runc::options::{CreateOpts, DeleteOpts, ExecOpts, GlobalOpts, KillOpts};

use super::error::TaskError;
use super::options::RuntimeOptions;
use super::spawner::ReapedSpawner;

/// What the runtime said when a call failed (one line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);

/// The OCI runtime's verbs, as the shim uses them for one container's bundle.
pub trait OciRuntime: Send + Sync + fmt::Debug {
    /// `create`: the container's init, created and stopped before its program; its pid is
    /// written to `opts.pid_file`, its stdio is `opts.io` or the console socket's terminal.
    fn create(&self, id: &str, bundle: &Path, opts: &CreateOpts) -> Result<(), RuntimeError>;
    /// `start`: init runs its program.
    fn start(&self, id: &str) -> Result<(), RuntimeError>;
    /// `exec --detach`: another process in the container; its pid goes to `opts.pid_file`.
    fn exec(&self, id: &str, process: &Process, opts: &ExecOpts) -> Result<(), RuntimeError>;
    /// `kill [--all]`: a signal to init (to every process of the container with `all`).
    fn kill(&self, id: &str, signal: u32, all: bool) -> Result<(), RuntimeError>;
    /// A signal to one of the container's processes by pid (an exec: containerd's runc shim
    /// signals those directly, not through runc).
    fn signal(&self, pid: u32, signal: u32) -> Result<(), RuntimeError>;
    /// `pause`.
    fn pause(&self, id: &str) -> Result<(), RuntimeError>;
    /// `resume`.
    fn resume(&self, id: &str) -> Result<(), RuntimeError>;
    /// `ps`: the pids of the container's processes.
    fn ps(&self, id: &str) -> Result<Vec<u32>, RuntimeError>;
    /// `update`: new resources.
    fn update(&self, id: &str, resources: &LinuxResources) -> Result<(), RuntimeError>;
    /// `delete --force`: the container gone, its processes killed.
    fn delete(&self, id: &str) -> Result<(), RuntimeError>;
}

/// Makes the runtime for a bundle: runc as the runtime options say, in the shim.
pub type RuntimeFor = Arc<
    dyn Fn(&RuntimeOptions, &str, &Path) -> Result<Arc<dyn OciRuntime>, TaskError> + Send + Sync,
>;

/// runc, run as the runtime options say, its log in the bundle (`log.json`), every invocation
/// waited for through the shim's reaper.
#[derive(Debug, Clone)]
pub struct Runc {
    runc: runc::Runc,
    bundle: PathBuf,
}

impl Runc {
    /// runc for `bundle`, as `options` say, under `namespace`'s root.
    pub fn new(
        options: &RuntimeOptions,
        namespace: &str,
        bundle: &Path,
    ) -> Result<Runc, TaskError> {
        let mut global = GlobalOpts::new()
            .command(options.runc_binary())
            .root(options.runc_root(namespace))
            .log(bundle.join("log.json"))
            .log_json()
            .systemd_cgroup(options.systemd_cgroup);
        global.custom_spawner(Arc::new(ReapedSpawner));
        let runc = global.build().map_err(|e| TaskError::Runc {
            what: "find runc",
            why: e.to_string(),
        })?;
        Ok(Runc {
            runc,
            bundle: bundle.to_owned(),
        })
    }

    /// The runtime the shim's task service uses.
    pub fn runtime_for() -> RuntimeFor {
        Arc::new(|options, namespace, bundle| {
            Ok(Arc::new(Runc::new(options, namespace, bundle)?) as Arc<dyn OciRuntime>)
        })
    }

    /// What runc said last in its log (`log.json`), else `fallback`.
    fn said(&self, fallback: runc::error::Error) -> RuntimeError {
        let log = std::fs::read_to_string(self.bundle.join("log.json")).unwrap_or_default();
        let last = log
            .lines()
            .rev()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|entry| entry["level"] == "error")
            .and_then(|entry| entry["msg"].as_str().map(str::to_owned));
        RuntimeError(last.unwrap_or_else(|| fallback.to_string()))
    }
}

impl OciRuntime for Runc {
    fn create(&self, id: &str, bundle: &Path, opts: &CreateOpts) -> Result<(), RuntimeError> {
        self.runc
            .create(id, bundle, Some(opts))
            .map(drop)
            .map_err(|e| self.said(e))
    }

    fn start(&self, id: &str) -> Result<(), RuntimeError> {
        self.runc.start(id).map(drop).map_err(|e| self.said(e))
    }

    fn exec(&self, id: &str, process: &Process, opts: &ExecOpts) -> Result<(), RuntimeError> {
        self.runc
            .exec(id, process, Some(opts))
            .map_err(|e| self.said(e))
    }

    fn kill(&self, id: &str, signal: u32, all: bool) -> Result<(), RuntimeError> {
        self.runc
            .kill(id, signal, Some(&KillOpts::new().all(all)))
            .map_err(|e| self.said(e))
    }

    fn signal(&self, pid: u32, signal: u32) -> Result<(), RuntimeError> {
        let signal = nix::sys::signal::Signal::try_from(signal as i32)
            .map_err(|_| RuntimeError(format!("{signal} is not a signal")))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal)
            .map_err(|e| RuntimeError(e.desc().to_lowercase()))
    }

    fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.runc.pause(id).map_err(|e| self.said(e))
    }

    fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.runc.resume(id).map_err(|e| self.said(e))
    }

    fn ps(&self, id: &str) -> Result<Vec<u32>, RuntimeError> {
        let pids = self.runc.ps(id).map_err(|e| self.said(e))?;
        Ok(pids.into_iter().map(|p| p as u32).collect())
    }

    fn update(&self, id: &str, resources: &LinuxResources) -> Result<(), RuntimeError> {
        self.runc.update(id, resources).map_err(|e| self.said(e))
    }

    fn delete(&self, id: &str) -> Result<(), RuntimeError> {
        self.runc
            .delete(id, Some(&DeleteOpts::new().force(true)))
            .map_err(|e| self.said(e))
    }
}
