//! The shim's side of a container's vGPU: reserve and edit the spec before `runc create` (the
//! same function podman's precreate hook runs), attach the container once it has a pid,
//! release it at delete. The node service is started, as a daemon of this binary, the first
//! time a container needs it and it is not running.
//!
//! A container of a Kubernetes claim comes with its vGPU pinned already: the claim's CDI
//! device, which the runtime applied, ends with the attach step ([`gpuplex_hook::claim`]). The
//! shim takes that hook out of the spec and attaches the container itself, with the claim's
//! handle, instead of reserving; its delete releases nothing (the claim's vGPU is the claim's).
//!
//! A container given `gpuplex.io/gpu-memory` units by the kubelet (the device plugin) carries
//! its allocation's handle in the annotation [`ALLOCATION`], written by the kubelet from the
//! plugin's `Allocate` answer, and its devices, environment and identity mount from that answer
//! too (or from its CDI device, with the same attach step as a claim's). The shim attaches it
//! as it attaches a claim's container, passing the weight and priority the pod's annotations ask
//! for; its delete releases nothing either (the allocation is the kubelet's units').

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpuplex_hook::stages::{self, HookContext, HookError, Prepared};
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::request::{ALLOCATION, POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX};
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;
use gpuplex_wire::config::{config_path, CONFIG_ENV};
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::{ClientError, NodeClient};
use serde_json::Value;

/// How CRI marks a pod's sandbox (pause) container, which carries the pod's annotations too
/// but runs no GPU work: it gets no vGPU.
const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// Whether `config` is a pod's sandbox container.
pub fn is_sandbox(config: &[u8]) -> bool {
    serde_json::from_slice::<Value>(config)
        .map(|c| c["annotations"][CONTAINER_TYPE] == "sandbox")
        .unwrap_or(false)
}

/// Why a container got no vGPU: one line, shown to the containerd user after `gpuplex: `.
#[derive(Debug, thiserror::Error)]
pub enum VgpuError {
    /// gpuplex's configuration is unusable, or the request (its annotations, the node's
    /// answer) was refused: the hook library's line.
    #[error("{}", .0.message)]
    Refused(HookError),
    /// The shim's own file work (the bundle's config.json, the service's log).
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What the shim was doing.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The node service cannot be reached.
    #[error(transparent)]
    Unreachable(#[from] ClientError),
    /// The node service refused an attach or a hold.
    #[error("the gpuplex node service did not {action} {id}: {source}")]
    Node {
        /// `attach`, `hold` or `let go of`.
        action: &'static str,
        /// The container.
        id: String,
        /// Its answer.
        #[source]
        source: ClientError,
    },
    /// The node service could not be started.
    #[error("cannot start the gpuplex node service: {0}")]
    Start(#[source] std::io::Error),
    /// The node service was started but did not answer in time.
    #[error("the gpuplex node service did not come up on {} within {}s (its log, {}, ends: {last:?}); start it with `systemctl start gpuplex`", socket.display(), SERVICE_START.as_secs(), log.display())]
    NotUp {
        /// The node socket.
        socket: PathBuf,
        /// The service's log.
        log: PathBuf,
        /// Its last line.
        last: String,
    },
}

/// A container's vGPU, as the shim holds it from `Create` to `Delete`.
#[derive(Clone, Debug)]
pub struct Reserved {
    /// The handle it was reserved (or its claim pinned) with: what attaches the container, and
    /// releases a vGPU that is not a claim's.
    pub handle: Handle,
    /// What a container of the device plugin's allocation asks for its vGPU (its weight,
    /// priority and pod); empty for any other.
    pub asked: BTreeMap<String, String>,
}

impl Reserved {
    fn with(handle: Handle) -> Reserved {
        Reserved {
            handle,
            asked: BTreeMap::new(),
        }
    }
}

/// How long a node service started by the shim has to answer.
const SERVICE_START: Duration = Duration::from_secs(5);

/// Where the node service is, and what this shim tells it.
#[derive(Debug)]
pub struct NodeLink {
    /// The hook library's context, or why gpuplex's configuration is unusable (which matters
    /// only to containers that ask for a vGPU).
    ctx: Result<HookContext, HookError>,
    config: PathBuf,
    named: bool,
}

impl NodeLink {
    /// From gpuplex's configuration: `$GPUPLEX_CONFIG`, else `/etc/gpuplex/gpuplex.toml`
    /// (which may be absent).
    pub fn from_env() -> NodeLink {
        let env = std::env::var_os(CONFIG_ENV);
        let (config, named) = config_path(None, env.as_deref());
        let ctx =
            HookContext::from_config("create", named.then_some(config.as_path())).map(|mut ctx| {
                // The shim attaches and releases the container itself: no hook in the spec.
                ctx.hook = None;
                // Under CRI the pod's name and namespace are CRI's, not the pod's owner's.
                ctx.pod_from_runtime = true;
                ctx
            });
        NodeLink { ctx, config, named }
    }

    fn ctx(&self) -> Result<&HookContext, VgpuError> {
        self.ctx.as_ref().map_err(|e| {
            VgpuError::Refused(HookError {
                stage: e.stage,
                message: e.message.clone(),
            })
        })
    }

    /// If `bundle`'s config.json asks for a vGPU: reserves one, edits config.json in place and
    /// returns the reservation. A config without a `gpuplex.io/` annotation is not touched.
    pub fn prepare(&self, bundle: &Path) -> Result<Option<Reserved>, VgpuError> {
        let path = bundle.join("config.json");
        let proposed = std::fs::read(&path).map_err(|source| VgpuError::Io {
            action: "read",
            path: path.clone(),
            source,
        })?;
        if let Some(claimed) = self.claimed(bundle, &proposed)? {
            return Ok(Some(claimed));
        }
        if !stages::concerns_gpuplex("precreate", &proposed) || is_sandbox(&proposed) {
            return Ok(None);
        }
        let ctx = self.ctx()?;
        self.ensure_service(ctx)?;
        let Some(Prepared { config, handle, .. }) =
            stages::prepare(ctx, &proposed).map_err(VgpuError::Refused)?
        else {
            return Ok(None);
        };
        let reserved = Reserved::with(handle);
        if let Err(e) = write_config(bundle, &config) {
            self.release(&reserved);
            return Err(e);
        }
        Ok(Some(reserved))
    }

    /// A container of a Kubernetes claim (its spec has the claim's attach step) or of the device
    /// plugin's allocation (its spec has [`ALLOCATION`], and the attach step too when the runtime
    /// applied the allocation's CDI device): the spec without the step, and the handle to attach
    /// with.
    fn claimed(&self, bundle: &Path, proposed: &[u8]) -> Result<Option<Reserved>, VgpuError> {
        let refused = |message: String| {
            VgpuError::Refused(HookError {
                stage: "create",
                message,
            })
        };
        let Ok(mut config) = serde_json::from_slice::<Value>(proposed) else {
            return Ok(None);
        };
        let hook = gpuplex_hook::claim::take_attach_hook(&mut config).map_err(refused)?;
        let allocation = allocation_of(&config).map_err(refused)?;
        let reserved = match (hook, allocation) {
            (None, None) => return Ok(None),
            (Some(step), Some(allocation)) if step != allocation.handle => {
                return Err(refused(format!("the container has two gpuplex allocations: a gpuplex.io/vgpu CDI device and a different {ALLOCATION}")));
            }
            (_, Some(allocation)) => allocation,
            (Some(handle), None) => {
                if stages::concerns_gpuplex("precreate", proposed) {
                    return Err(refused("the container asks for two vGPUs: its claim's (a gpuplex.io/vgpu CDI device) and one by gpuplex.io/ annotations; a claim's container takes its weight and priority from the claim's VgpuConfig".into()));
                }
                Reserved::with(handle)
            }
        };
        self.ensure_service(self.ctx()?)?;
        let config = serde_json::to_vec(&config).map_err(|e| refused(e.to_string()))?;
        write_config(bundle, &config)?;
        Ok(Some(reserved))
    }

    /// Attaches container `id`, whose init is `pid` (created, not started), to its reservation.
    pub fn attach(&self, reserved: &Reserved, id: &str, pid: u32) -> Result<(), VgpuError> {
        let ctx = self.ctx()?;
        let mut client = NodeClient::connect(&ctx.socket)?;
        let vgpu = client
            .attach_asking(&reserved.handle, id, pid, true, &reserved.asked)
            .map_err(|source| VgpuError::Node {
                action: "attach",
                id: id.to_owned(),
                source,
            })?;
        // The identity now names its container, as under podman.
        let _ = identity::write(&ctx.identity_dir, &Identity::of(&vgpu, &ctx.node));
        Ok(())
    }

    /// Holds container `id` out of scheduling while its user has it paused (`held`), or
    /// lets it back in.
    pub fn hold(&self, id: &str, held: bool) -> Result<(), VgpuError> {
        let mut client = NodeClient::connect(&self.ctx()?.socket)?;
        let key = ReleaseKey::Container(id.to_owned());
        client
            .hold(&key, held)
            .map(drop)
            .map_err(|source| VgpuError::Node {
                action: if held { "hold" } else { "let go of" },
                id: id.to_owned(),
                source,
            })
    }

    /// Tells the node service that container `id` is being sent `signal`, when that is a stop
    /// signal (SIGTERM, SIGINT, SIGQUIT, SIGKILL); best effort: the service also sees a stop
    /// signal pending in a container it froze.
    pub fn stopping(&self, id: &str, signal: u32) {
        let signal = match signal as i32 {
            libc::SIGTERM | libc::SIGINT | libc::SIGQUIT => StopSignal::Graceful,
            libc::SIGKILL => StopSignal::Kill,
            _ => return,
        };
        let Ok(ctx) = self.ctx() else { return };
        let Ok(mut client) = NodeClient::connect(&ctx.socket) else {
            return;
        };
        let key = ReleaseKey::Container(id.to_owned());
        if let Err(e) = client.stopping(&key, signal) {
            tracing::warn!("the gpuplex node service did not hear that {id} is stopping: {e}");
        }
    }

    /// Releases a container's reservation, by its handle; best effort: the service also
    /// releases a container whose processes are gone. A claim's vGPU is not released (the
    /// service refuses it a handle's release): the service lets the container go at its exit.
    pub fn release(&self, reserved: &Reserved) {
        let Ok(ctx) = self.ctx() else { return };
        let Ok(mut client) = NodeClient::connect(&ctx.socket) else {
            return;
        };
        let released = client.release(&ReleaseKey::Handle(reserved.handle));
        if let Some(vgpu) = released.ok().flatten().map(|v| v.id) {
            let _ = identity::remove(&ctx.identity_dir, vgpu);
        }
    }

    /// Releases the vGPU of container `id` (the shim's `delete` after its daemon died, when
    /// the handle died with it); best effort.
    pub fn release_container(&self, id: &str) {
        let Ok(ctx) = self.ctx() else { return };
        let Ok(mut client) = NodeClient::connect(&ctx.socket) else {
            return;
        };
        let released = client.release(&ReleaseKey::Container(id.to_owned()));
        if let Some(vgpu) = released.ok().flatten().map(|v| v.id) {
            let _ = identity::remove(&ctx.identity_dir, vgpu);
        }
    }

    /// Connects, or starts `containerd-shim-gpuplex-v1 serve` and waits for it to answer.
    fn ensure_service(&self, ctx: &HookContext) -> Result<(), VgpuError> {
        if NodeClient::connect(&ctx.socket).is_ok() {
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

/// The device plugin's allocation a spec names ([`ALLOCATION`]): its handle, and what the
/// container asks for it: every other `gpuplex.io/` annotation (the node service takes the
/// weight and priority and refuses the rest in one line) and the pod's name and namespace.
/// `Ok(None)` without the annotation; refused when it is not a handle.
fn allocation_of(config: &Value) -> Result<Option<Reserved>, String> {
    let Some(annotations) = config["annotations"].as_object() else {
        return Ok(None);
    };
    let Some(value) = annotations.get(ALLOCATION) else {
        return Ok(None);
    };
    let handle = (value.as_str())
        .and_then(|h| h.parse::<Handle>().ok())
        .ok_or_else(|| format!("{ALLOCATION} is not a handle gpuplex's device plugin wrote; it is the kubelet's to write, from the plugin's answer"))?;
    let asked = annotations
        .iter()
        .filter(|(k, _)| *k != ALLOCATION)
        .filter(|(k, _)| {
            k.starts_with(PREFIX)
                || POD_NAME_KEYS.contains(&k.as_str())
                || POD_NAMESPACE_KEYS.contains(&k.as_str())
        })
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    Ok(Some(Reserved { handle, asked }))
}

/// Writes a bundle's config.json in place, by rename.
fn write_config(bundle: &Path, config: &[u8]) -> Result<(), VgpuError> {
    let path = bundle.join("config.json");
    let temp = bundle.join(".config.json.gpuplex");
    let written = std::fs::write(&temp, config).and_then(|()| std::fs::rename(&temp, &path));
    written.map_err(|source| {
        let _ = std::fs::remove_file(&temp);
        VgpuError::Io {
            action: "write",
            path,
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_sandbox_gets_no_vgpu() {
        let sandbox = br#"{"annotations":{"io.kubernetes.cri.container-type":"sandbox","gpuplex.io/gpu-memory":"2Gi"}}"#;
        let workload = br#"{"annotations":{"io.kubernetes.cri.container-type":"container","gpuplex.io/gpu-memory":"2Gi"}}"#;
        assert!(is_sandbox(sandbox));
        assert!(!is_sandbox(workload));
        assert!(!is_sandbox(b"{}"));
        assert!(!is_sandbox(b"not json"));
    }

    #[test]
    fn an_allocations_container_brings_its_handle_weight_and_pod() {
        let handle = "5a".repeat(16);
        let config = serde_json::json!({"annotations": {
            "gpuplex.io/allocation": handle,
            "gpuplex.io/weight": "3",
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.container-type": "container",
            "other.io/x": "y",
        }});
        let found = allocation_of(&config).unwrap().unwrap();
        assert_eq!(found.handle.to_string(), handle);
        let asked: Vec<&str> = found.asked.keys().map(String::as_str).collect();
        assert_eq!(
            asked,
            ["gpuplex.io/weight", "io.kubernetes.cri.sandbox-namespace"]
        );
        assert!(
            allocation_of(&serde_json::json!({"annotations": {"gpuplex.io/weight": "3"}}))
                .unwrap()
                .is_none()
        );
        for forged in [serde_json::json!("../../x"), serde_json::json!(7)] {
            let config = serde_json::json!({"annotations": {"gpuplex.io/allocation": forged}});
            let line = allocation_of(&config).unwrap_err();
            assert!(
                line.contains("not a handle") && !line.contains('\n'),
                "{line}"
            );
        }
    }
}
