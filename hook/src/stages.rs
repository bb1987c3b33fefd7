//! What `gpuplex-hook` does at each stage.
//!
//! - `precreate` (podman): the proposed `config.json` on stdin, the config to use on stdout. A
//!   config without a `gpuplex.io/` annotation comes back byte for byte; otherwise a vGPU is
//!   reserved and the spec edited ([`crate::spec`]), and the edit adds this hook at
//!   `createRuntime` and `poststop`.
//! - `createRuntime` / `prestart` (OCI hooks; the OCI state on stdin): a container whose spec
//!   carries `gpuplex.io/vgpu-handle` (written by precreate) attaches its init process to that
//!   reservation; one with `gpuplex.io/` annotations but neither (a runc/crun user who listed
//!   the hook by hand) is registered and injected here ([`crate::inject`]); any other container
//!   is left alone.
//! - `poststop`: the vGPU is released (by its handle when the spec has one, else by container).
//! - `attach HANDLE` (createRuntime, from a Kubernetes claim's CDI spec:
//!   [`gpuplex_wire::attach_step`]): the container attaches to the claim's vGPU, which its pod's
//!   containers share.
//!
//! Every failure is one [`HookError`] line, and undoes what the stage did, and only that: a
//! reservation is released by the handle the stage's own request returned, and an identity
//! file removed only for a vGPU the service says it released. A container's annotations never
//! name a vGPU or a file: `gpuplex.io/vgpu-id` and `gpuplex.io/vgpu-handle` are gpuplex's, and a
//! container that brings its own is refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_scheduler::node::{ReleaseKey, Target};
use gpuplex_scheduler::{Handle, VgpuId};
use gpuplex_wire::annotations::{POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX, VGPU_HANDLE, VGPU_ID};
use gpuplex_wire::config::{CdiSettings, NodeConfig, DEFAULT_CONFIG};
use gpuplex_wire::identity::{self, Identity};
use gpuplex_wire::protocol::VgpuReply;
use gpuplex_wire::stage::Stage;
use gpuplex_wire::vgpu_edits::{control_nodes, vgpu_edits};
use gpuplex_wire::{ClientError, NodeClient};
use serde_json::{json, Value};

use crate::cdi;
use crate::inject;
use crate::oci_state::{BundleConfig, OciState};
use crate::spec::{self, HookCommand, Injection};

/// Why a stage failed: one line a podman user can act on.
#[derive(Debug, thiserror::Error)]
#[error("gpuplex-hook {stage}: {message}")]
pub struct HookError {
    /// The stage.
    pub stage: Stage,
    /// What failed, why, and what to do.
    pub message: String,
}

/// Where the hook finds the node service, and how it calls itself back.
#[derive(Clone, Debug)]
pub struct HookContext {
    /// The node socket.
    pub socket: PathBuf,
    /// Where identity files live.
    pub identity_dir: PathBuf,
    /// Who runs these steps: the hook, or the containerd shim.
    pub caller: Caller,
    /// The node's name, for identities.
    pub node: String,
    /// Where the GPUs' CDI spec is, and its kind.
    pub cdi: CdiSettings,
    /// The longest one request to the node service may take (each read and write of it).
    pub timeout: Duration,
}

/// Who runs the hook library's steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// `gpuplex-hook`, run again at the later stages as this command (the spec gets it at
    /// `createRuntime` and `poststop`, with the handle to attach with).
    Hook(HookCommand),
    /// The containerd shim, which attaches and releases the container itself (the spec gets
    /// no hook and no handle), and under CRI, where the annotations naming a Kubernetes pod
    /// and namespace come from the runtime: they are passed on to the node service, where the
    /// namespace decides what the pod may ask for (`[policy]`). A podman or runc user writes
    /// them as freely as any annotation, so the hook never passes them on.
    Shim,
}

impl HookContext {
    /// The context from the configuration `named` (`--config`, else `$GPUPLEX_CONFIG`), else
    /// the default file, which may be absent; read and checked as the node service reads it.
    pub fn from_config(stage: Stage, named: Option<&Path>) -> Result<HookContext, HookError> {
        let (path, was_named) = match named {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        let config = NodeConfig::load(&path, was_named).map_err(|e| HookError {
            stage,
            message: e.to_string(),
        })?;
        let cdi = config.service.cdi();
        let socket = config.service.socket;
        let exe = std::env::current_exe()
            .unwrap_or_else(|_| PathBuf::from("/usr/local/bin/gpuplex-hook"));
        let mut args = vec!["gpuplex-hook".to_string()];
        if was_named {
            args.push("--config".into());
            args.push(path.display().to_string());
        }
        let node = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".into());
        Ok(HookContext {
            identity_dir: identity::identity_dir(&socket),
            socket,
            caller: Caller::Hook(HookCommand {
                path: exe,
                args,
                env: Vec::new(),
            }),
            node,
            cdi,
            timeout: gpuplex_wire::socket::TIMEOUT,
        })
    }

    /// The same context, whose requests to the node service each take at most `timeout` (the
    /// NRI plugin's, which must answer its runtime within the runtime's own timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> HookContext {
        self.timeout = timeout;
        self
    }

    /// The same context, for the containerd shim ([`Caller::Shim`]).
    pub fn for_shim(mut self) -> HookContext {
        self.caller = Caller::Shim;
        self
    }

    /// The command later stages run, when the hook is the caller.
    fn hook_command(&self) -> Option<&HookCommand> {
        match &self.caller {
            Caller::Hook(command) => Some(command),
            Caller::Shim => None,
        }
    }

    /// The same context, talking to the node service at `socket` (`--socket`: the socket a
    /// claim's attach step names).
    pub fn with_socket(mut self, socket: PathBuf) -> HookContext {
        self.identity_dir = identity::identity_dir(&socket);
        self.socket = socket;
        self
    }

    fn client(&self, stage: Stage) -> Result<NodeClient, HookError> {
        NodeClient::connect_with_timeout(&self.socket, self.timeout)
            .map_err(|e| service_error(stage, e))
    }
}

fn service_error(stage: Stage, e: ClientError) -> HookError {
    let message = match e {
        ClientError::Refused(why) => format!("the gpuplex node service refused: {why}"),
        other => other.to_string(),
    };
    HookError { stage, message }
}

fn gpuplex_only(annotations: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    annotations
        .iter()
        .filter(|(k, _)| k.starts_with(PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The annotations that name a container's Kubernetes pod and namespace (the CRI plugin's and
/// the kubelet's), which the node service keeps with a vGPU for status and metrics.
fn pod_annotations(
    annotations: Option<&serde_json::Map<String, Value>>,
) -> BTreeMap<String, String> {
    let keys = POD_NAME_KEYS.iter().chain(POD_NAMESPACE_KEYS.iter());
    keys.filter_map(|key| {
        let value = annotations?.get(*key)?.as_str()?;
        Some((key.to_string(), value.to_owned()))
    })
    .collect()
}

/// Whether a stage has anything to do with this input: false only when the input parses and
/// asks for no vGPU (no `gpuplex.io/` annotation), so that an unrelated container is never
/// touched, even when gpuplex's own configuration is broken. Unreadable input is "ours": the
/// stage then reports what is wrong with it.
pub fn concerns_gpuplex(stage: Stage, input: &[u8]) -> bool {
    match stage {
        Stage::Precreate | Stage::ShimCreate => match serde_json::from_slice::<Value>(input) {
            Ok(config) => !spec::gpuplex_annotations(&config).is_empty(),
            Err(_) => true,
        },
        _ => match OciState::parse(input) {
            Ok(state) => {
                !gpuplex_only(&state.annotations).is_empty()
                    || state
                        .config()
                        .map_or(true, |b| !gpuplex_only(&b.annotations()).is_empty())
            }
            Err(_) => true,
        },
    }
}

/// podman's `precreate`, as podman needs it: podman drops a precreate hook's stderr and says
/// only "exit status 1", so a failure would reach the user without its reason. On failure this
/// prints the line on stderr and returns the proposed config with one `createRuntime` hook in
/// front, `gpuplex-hook fail <line>`, so that the runtime fails the container with the line
/// (runc and crun show a hook's stderr). Nothing is reserved then.
pub fn precreate_for_podman(ctx: &HookContext, input: &[u8]) -> Result<Vec<u8>, HookError> {
    let error = match precreate(ctx, input) {
        Ok(out) => return Ok(out),
        Err(e) => e,
    };
    let Ok(mut config) = serde_json::from_slice::<Value>(input) else {
        return Err(error);
    };
    let Some(object) = config.as_object_mut() else {
        return Err(error);
    };
    let hook_path = ctx.hook_command().map(|hook| hook.path.clone());
    let fail = json!({
        "path": hook_path.unwrap_or_else(|| PathBuf::from("/usr/local/bin/gpuplex-hook")),
        "args": ["gpuplex-hook", "fail", error.to_string()],
    });
    let hooks = object.entry("hooks").or_insert_with(|| json!({}));
    let Some(hooks) = hooks.as_object_mut() else {
        return Err(error);
    };
    match hooks.entry("createRuntime").or_insert_with(|| json!([])) {
        Value::Array(list) => list.insert(0, fail),
        _ => return Err(error),
    }
    eprintln!("{error}");
    serde_json::to_vec(&config).map_err(|_| error)
}

/// podman's `precreate`: the config to run, from the proposed one.
pub fn precreate(ctx: &HookContext, input: &[u8]) -> Result<Vec<u8>, HookError> {
    Ok(prepare(ctx, input)?.map_or_else(|| input.to_vec(), |p| p.config))
}

/// A vGPU reserved for a container that does not exist yet, and its config edited for it.
#[derive(Debug)]
pub struct Prepared {
    /// The config to run.
    pub config: Vec<u8>,
    /// The vGPU.
    pub vgpu: VgpuId,
    /// The reservation's handle: what attaches the container, and what releases the vGPU on its
    /// behalf.
    pub handle: Handle,
}

/// precreate's work (podman's hook and the containerd shim's `Create`): for a config with a
/// `gpuplex.io/` annotation, reserves a vGPU, writes its identity and edits the config; `None`
/// for any other config. On failure nothing stays reserved or written.
pub fn prepare(ctx: &HookContext, input: &[u8]) -> Result<Option<Prepared>, HookError> {
    const STAGE: Stage = Stage::Precreate;
    let fail = |message: String| HookError {
        stage: STAGE,
        message,
    };
    let config: Value = serde_json::from_slice(input).map_err(|e| {
        fail(format!(
            "the config on stdin is not JSON ({e}); gpuplex-hook precreate reads the config podman proposes"
        ))
    })?;
    let annotations = spec::gpuplex_annotations(&config);
    if annotations.is_empty() {
        return Ok(None);
    }
    // Before anything is reserved: a container that NVIDIA's runtime would give GPUs too.
    if let Some(line) = cdi::nvidia_runtime_conflict(&config, &ctx.cdi.kind) {
        return Err(fail(line));
    }
    let mut client = ctx.client(STAGE)?;
    let mut annotations = annotations;
    if ctx.caller == Caller::Shim {
        annotations.extend(pod_annotations(
            config.get("annotations").and_then(Value::as_object),
        ));
    }
    // The service refuses `gpuplex.io/vgpu-id` and `gpuplex.io/vgpu-handle` among them: a
    // container cannot bring another's.
    let vgpu = client
        .reserve(&annotations)
        .map_err(|e| service_error(STAGE, e))?;
    let (id, handle) = match reserved(&vgpu) {
        Ok(reserved) => reserved,
        Err(message) => {
            let _ = client.release(&ReleaseKey::Vgpu(vgpu.id));
            return Err(fail(message));
        }
    };
    let undo = |client: &mut NodeClient, identity_written: bool| {
        let _ = client.release(&ReleaseKey::Handle(handle));
        if identity_written {
            let _ = identity::remove(&ctx.identity_dir, id);
        }
    };
    let file = match identity::create(&ctx.identity_dir, &Identity::of(&vgpu, &ctx.node)) {
        Ok(file) => file,
        Err(e) => {
            undo(&mut client, false);
            return Err(fail(format!(
                "cannot write the vGPU identity in {}: {e}",
                ctx.identity_dir.display()
            )));
        }
    };
    // The handle goes into the spec only for a hook that attaches with it; the shim keeps it.
    let handle_in_spec = ctx.hook_command().map(|_| handle);
    let edited = injection(ctx, &vgpu, &file, handle_in_spec)
        .and_then(|injection| edited_config(&config, &injection))
        .map_err(fail);
    match edited {
        Ok(config) => Ok(Some(Prepared {
            config,
            vgpu: id,
            handle,
        })),
        Err(e) => {
            undo(&mut client, true);
            Err(e)
        }
    }
}

/// The id and handle of a vGPU the service just reserved.
fn reserved(vgpu: &VgpuReply) -> Result<(VgpuId, Handle), String> {
    let id = vgpu.id;
    let handle = vgpu.handle.ok_or_else(|| {
            "the node service replied without a handle for the reservation; is it older than this hook?".to_string()
        })?;
    Ok((id, handle))
}

/// The config to run: `config` edited for the vGPU ([`spec::edit`]).
fn edited_config(config: &Value, injection: &Injection) -> Result<Vec<u8>, String> {
    let mut edited = config.clone();
    spec::edit(&mut edited, injection).map_err(|e| e.to_string())?;
    serde_json::to_vec(&edited).map_err(|e| e.to_string())
}

/// The edit of a vGPU: its CDI edits ([`vgpu_edits`]: the host spec's for its GPUs, its GPUs'
/// device nodes as the node service names them, the control nodes the host has, ...), its id,
/// the handle the spec carries and this hook when the hook is the caller.
fn injection(
    ctx: &HookContext,
    vgpu: &VgpuReply,
    identity_file: &Path,
    handle: Option<Handle>,
) -> Result<Injection, String> {
    let edits = vgpu_edits(vgpu, identity_file, &control_nodes()).map_err(|e| e.to_string())?;
    Ok(Injection {
        vgpu: vgpu.id,
        handle,
        edits,
        hook: ctx.hook_command().cloned(),
    })
}

/// `createRuntime` (or `prestart`): attach, or register and inject.
pub fn create_runtime(ctx: &HookContext, stage: Stage, input: &[u8]) -> Result<(), HookError> {
    let fail = |message: String| HookError { stage, message };
    let state = OciState::parse(input).map_err(|e| fail(e.to_string()))?;
    let bundle = state.config().map_err(|e| fail(e.to_string()))?;
    let mut annotations = gpuplex_only(&state.annotations);
    annotations.extend(gpuplex_only(&bundle.annotations()));
    if annotations.is_empty() {
        return Ok(());
    }
    let pid = state.pid.ok_or_else(|| {
        fail(format!(
            "the OCI state of {} has no pid; run gpuplex-hook at createRuntime or prestart",
            state.id
        ))
    })?;
    let handle = annotations.remove(VGPU_HANDLE);
    let vgpu_id = annotations.remove(VGPU_ID);
    match (handle, vgpu_id) {
        (Some(handle), _) => {
            let handle = handle.parse::<Handle>().map_err(|_| {
                fail(format!(
                    "{VGPU_HANDLE} is not one gpuplex wrote: it is gpuplex's annotation (podman's precreate hook writes it); remove it from config.json"
                ))
            })?;
            attach(ctx, stage, &handle, &state.id, pid)
        }
        (None, Some(_)) => Err(fail(format!(
            "{VGPU_ID} is gpuplex's annotation, and gpuplex writes it only with {VGPU_HANDLE}; remove it from config.json and ask for a vGPU with gpuplex.io/gpu-memory and the like"
        ))),
        (None, None) => register(ctx, stage, &state, &bundle, annotations, pid),
    }
}

/// `attach HANDLE` at createRuntime: a container of a Kubernetes claim's pod attaches to the
/// claim's vGPU (see [`crate::claim`]). On failure nothing changes: the claim keeps its vGPU.
pub fn attach_claim(ctx: &HookContext, handle: &str, input: &[u8]) -> Result<(), HookError> {
    const STAGE: Stage = Stage::Attach;
    let fail = |message: String| HookError {
        stage: STAGE,
        message,
    };
    let handle = handle.parse::<Handle>().map_err(|_| {
        fail(format!(
            "{handle:?} is not a handle gpuplex wrote: the attach step is the DRA driver's, written into a claim's CDI spec"
        ))
    })?;
    let state = OciState::parse(input).map_err(|e| fail(e.to_string()))?;
    let pid = state.pid.ok_or_else(|| {
        fail(format!(
            "the OCI state of {} has no pid; the attach step runs at createRuntime",
            state.id
        ))
    })?;
    attach(ctx, STAGE, &handle, &state.id, pid)
}

/// Attaches the container to the reservation precreate made; on failure releases that
/// reservation (its handle is the container's) and nothing else. A claim's vGPU is never
/// released this way: it is its claim's.
fn attach(
    ctx: &HookContext,
    stage: Stage,
    handle: &Handle,
    container: &str,
    pid: u32,
) -> Result<(), HookError> {
    let mut client = ctx.client(stage)?;
    match client.attach(handle, container, pid, true) {
        Ok(vgpu) => {
            // The identity now names its container.
            let _ = identity::write(&ctx.identity_dir, &Identity::of(&vgpu, &ctx.node));
            Ok(())
        }
        Err(e) => {
            if let Ok(Some(released)) = client.release(&ReleaseKey::Handle(*handle)) {
                let _ = identity::remove(&ctx.identity_dir, released.id);
            }
            Err(service_error(stage, e))
        }
    }
}

/// A runc/crun container that listed the hook itself: registered and injected from outside.
fn register(
    ctx: &HookContext,
    stage: Stage,
    state: &OciState,
    bundle: &BundleConfig,
    annotations: BTreeMap<String, String>,
    pid: u32,
) -> Result<(), HookError> {
    let fail = |message: String| HookError { stage, message };
    // No pod or namespace: a runc user's config says what it likes (see `Caller::Shim`).
    let mut client = ctx.client(stage)?;
    let vgpu = client
        .register(&state.id, &Target::Pid(pid), &annotations, true)
        .map_err(|e| service_error(stage, e))?;
    // A handle comes back only when this call reserved the vGPU (a hook that runs at prestart
    // and createRuntime registers twice): only then is it this call's to undo.
    let ours = vgpu.handle;
    // The runc/crun path makes device nodes inside a container that exists already; a CDI
    // spec's driver libraries, mounts and createContainer hooks cannot be added then.
    let injected = match &vgpu.cdi {
        None => inject_registered(ctx, &vgpu, pid, bundle),
        Some(edits) => Err(format!(
            "this host's GPUs have a CDI spec ({}) whose driver libraries and hooks cannot be added to a container runc has already made; run it with podman (config/hooks.d) or containerd (runtime io.containerd.gpuplex.v1), which apply it",
            edits.spec_files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        )),
    };
    if let Err(message) = injected {
        if let Some(handle) = ours {
            let _ = client.release(&ReleaseKey::Handle(handle));
            let _ = identity::remove(&ctx.identity_dir, vgpu.id);
        }
        return Err(fail(message));
    }
    Ok(())
}

/// Gives a running container its vGPU from the outside; undoes every step on failure.
fn inject_registered(
    ctx: &HookContext,
    vgpu: &VgpuReply,
    pid: u32,
    bundle: &BundleConfig,
) -> Result<(), String> {
    let file = identity::write(&ctx.identity_dir, &Identity::of(vgpu, &ctx.node)).map_err(|e| {
        format!(
            "cannot write the vGPU identity in {}: {e}",
            ctx.identity_dir.display()
        )
    })?;
    // The edits' device nodes: no host spec's among them, the caller refused a vGPU with one.
    let edits = vgpu_edits(vgpu, &file, &control_nodes()).map_err(|e| e.to_string())?;
    let nodes = &edits.device_nodes;
    let rootfs = &bundle.rootfs;
    let created = inject::create_device_nodes(pid, rootfs, nodes).map_err(|e| e.to_string())?;
    let rules = match inject::allow_devices(pid, nodes) {
        Ok(rules) => rules,
        Err(e) => {
            let _ = inject::remove_device_nodes(pid, rootfs, &created);
            return Err(e.to_string());
        }
    };
    if let Err(e) = inject::bind_identity(pid, rootfs, &file) {
        let _ = inject::deny_devices(pid, &rules);
        let _ = inject::remove_device_nodes(pid, rootfs, &created);
        return Err(e.to_string());
    }
    Ok(())
}

/// `poststop`: release the container's vGPU: by the handle its spec carries (podman), else by
/// its container id (a runc/crun container that registered itself).
pub fn poststop(ctx: &HookContext, input: &[u8]) -> Result<(), HookError> {
    const STAGE: Stage = Stage::Poststop;
    let state = OciState::parse(input).map_err(|e| HookError {
        stage: STAGE,
        message: e.to_string(),
    })?;
    let in_bundle = state.config().map(|b| b.annotations()).unwrap_or_default();
    let handle = state
        .annotations
        .get(VGPU_HANDLE)
        .or_else(|| in_bundle.get(VGPU_HANDLE))
        .and_then(|h| h.parse::<Handle>().ok());
    let key = match handle {
        Some(handle) => ReleaseKey::Handle(handle),
        None => ReleaseKey::Container(state.id.clone()),
    };
    let mut client = ctx.client(STAGE)?;
    let released = client.release(&key).map_err(|e| service_error(STAGE, e))?;
    if let Some(id) = released.map(|v| v.id) {
        let _ = identity::remove(&ctx.identity_dir, id);
    }
    Ok(())
}
