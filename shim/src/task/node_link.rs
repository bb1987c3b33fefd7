//! [`NodeLink`]: the shim's [`Node`] in production, the node service on its socket. The node
//! service is started, as a daemon of this binary, the first time a container needs it and
//! nothing listens on its socket. Under systemd, `gpuplex.socket` keeps the socket listening
//! while the service restarts, so the shim never starts one there: its requests wait for the
//! unit's next service. Without that unit, a service that died leaves its socket behind, and
//! whoever ran it (`Restart=`, one second later) starts it again: for [`RESTART_GRACE`] that one
//! is waited for, not raced by a service of the shim's own, which would hold the node outside
//! its supervisor.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpuplex_hook::stages::{self, HookContext, HookError, Prepared};
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;
use gpuplex_wire::config::{config_path, CONFIG_ENV};
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::socket::pool::POOL_SIZE;
use gpuplex_wire::stage::Stage;
use gpuplex_wire::{NodeClient, NodePool};

use super::vgpu::{Node, Reservation, Vgpu, VgpuError, SERVICE_START};

/// How long a dead service's socket is given to answer again before the shim starts one.
pub const RESTART_GRACE: Duration = Duration::from_secs(3);

/// Where the node service is, and what this shim tells it.
#[derive(Debug)]
pub struct NodeLink {
    /// The hook library's context, or why gpuplex's configuration is unusable (which matters
    /// only to containers that ask for a vGPU).
    ctx: Result<HookContext, HookError>,
    /// Connections to the node service, shared by the task service's threads: a pod's
    /// containers may start and stop at once.
    node: Option<NodePool>,
    config: PathBuf,
    named: bool,
}

impl NodeLink {
    /// From gpuplex's configuration: `$GPUPLEX_CONFIG`, else `/etc/gpuplex/gpuplex.toml`
    /// (which may be absent).
    pub fn from_env() -> NodeLink {
        let env = std::env::var_os(CONFIG_ENV);
        let (config, named) = config_path(None, env.as_deref());
        // The shim attaches and releases the container itself (no hook in the spec), and under
        // CRI the pod's name and namespace are CRI's, not the pod's owner's.
        let ctx = HookContext::from_config(Stage::ShimCreate, named.then_some(config.as_path()))
            .map(HookContext::for_shim);
        let node = (ctx.as_ref().ok()).map(|ctx| NodePool::new(&ctx.socket, POOL_SIZE));
        NodeLink {
            ctx,
            node,
            config,
            named,
        }
    }

    fn ctx(&self) -> Result<&HookContext, VgpuError> {
        self.ctx.as_ref().map_err(|e| {
            VgpuError::Refused(HookError {
                stage: e.stage,
                message: e.message.clone(),
            })
        })
    }

    /// The node service's connections, when gpuplex's configuration is usable.
    fn node(&self) -> Result<(&HookContext, &NodePool), VgpuError> {
        let ctx = self.ctx()?;
        let node = (self.node.as_ref()).expect("a usable configuration has its pool");
        Ok((ctx, node))
    }

    /// Releases the vGPU `key` names, and removes its identity file; best effort.
    fn release_by(&self, key: &ReleaseKey) {
        let Ok((ctx, node)) = self.node() else {
            return;
        };
        if let Some(vgpu) = node.ask(|c| c.release(key)).ok().flatten().map(|v| v.id) {
            let _ = identity::remove(&ctx.identity_dir, vgpu);
        }
    }

    /// Connects, or starts `containerd-shim-gpuplex-v1 serve` and waits for it to answer.
    fn ensure_service(&self, ctx: &HookContext) -> Result<(), VgpuError> {
        if NodeClient::connect(&ctx.socket).is_ok() || answers_again(&ctx.socket, RESTART_GRACE) {
            return Ok(());
        }
        let dir = ctx.socket.parent().unwrap_or(Path::new("/run/gpuplex"));
        std::fs::create_dir_all(dir).map_err(|source| VgpuError::Io {
            action: "create",
            path: dir.to_owned(),
            source,
        })?;
        let log_path = dir.join("service.log");
        let io = |action| {
            let path = log_path.clone();
            move |source| VgpuError::Io {
                action,
                path,
                source,
            }
        };
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io("open"))?;
        let exe = std::env::current_exe().map_err(VgpuError::Start)?;
        let mut command = Command::new(exe);
        command.arg("serve");
        if self.named {
            command.arg("--config").arg(&self.config);
        }
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io("open"))?)
            .stderr(log)
            .process_group(0);
        command.spawn().map_err(VgpuError::Start)?;
        let deadline = Instant::now() + SERVICE_START;
        while Instant::now() < deadline {
            if NodeClient::connect(&ctx.socket).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let last = std::fs::read_to_string(&log_path)
            .ok()
            .and_then(|t| t.lines().last().map(str::to_owned))
            .unwrap_or_default();
        Err(VgpuError::NotUp {
            socket: ctx.socket.clone(),
            log: log_path,
            last,
        })
    }
}

/// Whether a socket left by a service that died (a socket file nobody answers on) answers
/// again within `grace`: its supervisor restarts it. False at once where there is no socket
/// file (no service ran, or it stopped and removed it).
fn answers_again(socket: &Path, grace: Duration) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let left = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket());
    let deadline = Instant::now() + grace;
    while left(socket) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        if NodeClient::connect(socket).is_ok() {
            return true;
        }
    }
    false
}

impl Node for NodeLink {
    fn reserve(&self, spec: &[u8]) -> Result<Option<Reservation>, VgpuError> {
        let ctx = self.ctx()?;
        self.ensure_service(ctx)?;
        let prepared = stages::prepare(ctx, spec).map_err(VgpuError::Refused)?;
        Ok(prepared.map(|Prepared { config, handle, .. }| Reservation {
            handle,
            spec: config,
        }))
    }

    fn ensure_running(&self) -> Result<(), VgpuError> {
        self.ensure_service(self.ctx()?)
    }

    fn attach(&self, vgpu: &Vgpu, id: &str, pid: u32) -> Result<(), VgpuError> {
        let (ctx, node) = self.node()?;
        let attached = node
            .ask(|c| c.attach_asking(&vgpu.handle, id, pid, true, &vgpu.asked))
            .map_err(|source| VgpuError::Node {
                action: "attach",
                id: id.to_owned(),
                source,
            })?;
        // The identity now names its container, as under podman.
        let _ = identity::write(&ctx.identity_dir, &Identity::of(&attached, &ctx.node));
        Ok(())
    }

    fn hold(&self, id: &str, held: bool) -> Result<(), VgpuError> {
        let (_, node) = self.node()?;
        let key = ReleaseKey::Container(id.to_owned());
        node.ask(|c| c.hold(&key, held))
            .map(drop)
            .map_err(|source| VgpuError::Node {
                action: if held { "hold" } else { "let go of" },
                id: id.to_owned(),
                source,
            })
    }

    fn stopping(&self, id: &str, signal: StopSignal) {
        let Ok((_, node)) = self.node() else {
            return;
        };
        let key = ReleaseKey::Container(id.to_owned());
        if let Err(e) = node.ask(|c| c.stopping(&key, signal)) {
            tracing::warn!("the gpuplex node service did not hear that {id} is stopping: {e}");
        }
    }

    fn release(&self, handle: &Handle) {
        self.release_by(&ReleaseKey::Handle(*handle));
    }

    fn release_container(&self, id: &str) {
        self.release_by(&ReleaseKey::Container(id.to_owned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn a_dead_services_socket_is_given_time_to_answer_again_and_no_socket_none() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("gpuplex.sock");
        // No socket file: no wait (a wait would be the whole minute).
        let t0 = Instant::now();
        assert!(!answers_again(&socket, Duration::from_secs(60)));
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no socket file: no wait"
        );

        // A service killed with SIGKILL: its socket file stays, nobody answers.
        drop(UnixListener::bind(&socket).unwrap());
        let t0 = Instant::now();
        assert!(!answers_again(&socket, Duration::from_millis(300)));
        assert!(t0.elapsed() >= Duration::from_millis(300));

        // Its supervisor starts it again within the grace. The new socket is put in place in
        // one step (bound beside it, renamed over it), so that the poll never finds the path
        // empty, which would read as a service that stopped.
        let (again, beside) = (socket.clone(), dir.path().join("new.sock"));
        let restart = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            let listener = UnixListener::bind(&beside).unwrap();
            std::fs::rename(&beside, &again).unwrap();
            let _ = listener.accept();
        });
        assert!(answers_again(&socket, Duration::from_secs(3)));
        restart.join().unwrap();
    }
}
