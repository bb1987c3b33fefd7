//! What `gpuplex-hook` does at each stage.
//!
//! - `precreate` (podman): the proposed `config.json` on stdin, the config to use on stdout. A
//!   config without a `gpuplex.io/` annotation comes back byte for byte; otherwise a vGPU is
//!   reserved and the spec edited ([`crate::spec`]), and the edit adds this hook at
//!   `createRuntime` and `poststop`.
//! - `createRuntime` / `prestart` (OCI hooks; the OCI state on stdin): a container whose spec
//!   carries `gpuplex.io/vgpu-id` attaches its init process to that reservation; one with
//!   `gpuplex.io/` annotations but no vGPU id (a runc/crun user who listed the hook by hand) is
//!   registered and injected here ([`crate::inject`]); any other container is left alone.
//! - `poststop`: the vGPU is released.
//!
//! Every failure is one [`HookError`] line, and undoes what the stage did: no reservation, no
//! device node, no device rule, no identity file is left behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpuplex_scheduler::protocol::VgpuReply;
use gpuplex_scheduler::request::{POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX, VGPU_ID};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::cdi::{self, CdiEdits, CdiSettings};
use crate::client::{hook_config, ClientError, NodeClient, DEFAULT_CONFIG, DEFAULT_SOCKET};
use crate::identity::{self, Identity};
use crate::inject;
use crate::oci_state::{BundleConfig, OciState};
use crate::spec::{self, DeviceNode, HookCommand, Injection};

/// Why a stage failed: one line a podman user can act on.
#[derive(Debug, thiserror::Error)]
#[error("gpuplex-hook {stage}: {message}")]
pub struct HookError {
    /// The stage.
    pub stage: &'static str,
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
    /// This hook, as later stages are to run it; none when the caller attaches and releases the
    /// container itself (the containerd shim).
    pub hook: Option<HookCommand>,
    /// The node's name, for identities.
    pub node: String,
    /// Where the GPUs' CDI spec is, and its kind.
    pub cdi: CdiSettings,
}

impl HookContext {
    /// The context from the configuration (`--config`, else `$GPUPLEX_CONFIG`, else the
    /// default file, which may be absent).
    pub fn from_config(
        stage: &'static str,
        named: Option<&Path>,
    ) -> Result<HookContext, HookError> {
        let (path, was_named) = match named {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        let (socket, cdi) =
            hook_config(&path, was_named).map_err(|message| HookError { stage, message })?;
        let socket = socket.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
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
            hook: Some(HookCommand {
                path: exe,
                args,
                env: Vec::new(),
            }),
            node,
            cdi,
        })
    }

    fn client(&self, stage: &'static str) -> Result<NodeClient, HookError> {
        NodeClient::connect(&self.socket).map_err(|e| service_error(stage, e))
    }
}

fn service_error(stage: &'static str, e: ClientError) -> HookError {
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
pub fn concerns_gpuplex(stage: &str, input: &[u8]) -> bool {
    match stage {
        "precreate" => match serde_json::from_slice::<Value>(input) {
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
    let hook_path = ctx.hook.as_ref().map(|hook| hook.path.clone());
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
    const STAGE: &str = "precreate";
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
    if annotations.is_empty() || annotations.contains_key(VGPU_ID) {
        // Not ours, or edited already: pass it through untouched.
        return Ok(input.to_vec());
    }
    // Before anything is reserved: a container that NVIDIA's runtime would give GPUs too.
    if let Some(line) = cdi::nvidia_runtime_conflict(&config, &ctx.cdi.kind) {
        return Err(fail(line));
    }
    let mut client = ctx.client(STAGE)?;
    let mut annotations = annotations;
    annotations.extend(pod_annotations(
        config.get("annotations").and_then(Value::as_object),
    ));
    let reply = client
        .request(&json!({"op": "reserve", "annotations": annotations}))
        .map_err(|e| service_error(STAGE, e))?;
    let vgpu = reply
        .vgpu
        .ok_or_else(|| fail("the node service replied without a vGPU".into()))?;
    let undo = |client: &mut NodeClient| {
        let _ = client.release(&vgpu.id);
        let _ = identity::remove(&ctx.identity_dir, &vgpu.id);
    };
    let edited = identity::write(&ctx.identity_dir, &Identity::of(&vgpu, &ctx.node))
        .map_err(|e| {
            fail(format!(
                "cannot write the vGPU identity in {}: {e}",
                ctx.identity_dir.display()
            ))
        })
        .and_then(|file| injection(ctx, &vgpu, file).map_err(fail))
        .and_then(|inj| edit_with_cdi(&config, &inj, &vgpu).map_err(fail));
    if edited.is_err() {
        undo(&mut client);
    }
    edited
}

/// The config to run: the CDI spec's edits for the vGPU's GPUs (the node service sends them
/// when the node has a spec), then gpuplex's own ([`spec::edit`]: the identity mount stays
/// last).
fn edit_with_cdi(
    config: &Value,
    injection: &Injection,
    vgpu: &VgpuReply,
) -> Result<Vec<u8>, String> {
    let mut edited = config.clone();
    if let Some(edits) = cdi_edits(vgpu)? {
        cdi::apply(&mut edited, &edits).map_err(|e| format!("CDI spec: {e}"))?;
    }
    spec::edit(&mut edited, injection).map_err(|e| e.to_string())?;
    serde_json::to_vec(&edited).map_err(|e| e.to_string())
}

/// The CDI edits the node service sent with a vGPU, if any.
fn cdi_edits(vgpu: &VgpuReply) -> Result<Option<CdiEdits>, String> {
    let Some(edits) = &vgpu.cdi else {
        return Ok(None);
    };
    let edits = CdiEdits::deserialize(edits).map_err(|e| {
        format!("the node service sent CDI edits this hook cannot read ({e}); is it of another gpuplex version?")
    })?;
    Ok(Some(edits))
}

/// The edit of a vGPU: its GPUs' device nodes (as the node service names them) and the
/// control nodes the host has.
fn injection(
    ctx: &HookContext,
    vgpu: &VgpuReply,
    identity_file: PathBuf,
) -> Result<Injection, String> {
    let mut devices = Vec::new();
    for gpu in &vgpu.gpus {
        let device = gpu.device.as_ref().ok_or_else(|| {
            format!("the node service did not say which device node is GPU {}; is it older than this hook?", gpu.index)
        })?;
        let host = Path::new(&device.path);
        let node = DeviceNode::from_host(host).unwrap_or(DeviceNode {
            host_path: host.to_path_buf(),
            container_path: spec::container_path_of(host),
            major: device.major,
            minor: device.minor,
            file_mode: 0o666,
        });
        devices.push(node);
    }
    devices.extend(spec::control_nodes());
    Ok(Injection {
        vgpu: vgpu.id.clone(),
        uuids: vgpu.gpus.iter().map(|g| g.uuid.clone()).collect(),
        devices,
        identity_file,
        hook: ctx.hook.clone(),
    })
}

/// `createRuntime` (or `prestart`): attach, or register and inject.
pub fn create_runtime(
    ctx: &HookContext,
    stage: &'static str,
    input: &[u8],
) -> Result<(), HookError> {
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
    let mut client = ctx.client(stage)?;
    if let Some(vgpu) = annotations.remove(VGPU_ID) {
        let reply = client
            .request(&json!({"op": "attach", "vgpu": vgpu, "container": state.id, "pid": pid}));
        return match reply {
            Ok(reply) => {
                if let Some(v) = reply.vgpu {
                    let _ = identity::write(&ctx.identity_dir, &Identity::of(&v, &ctx.node));
                }
                Ok(())
            }
            Err(e) => {
                let _ = client.release(&vgpu);
                let _ = identity::remove(&ctx.identity_dir, &vgpu);
                Err(service_error(stage, e))
            }
        };
    }
    let pod_keys = POD_NAME_KEYS.iter().chain(POD_NAMESPACE_KEYS.iter());
    let all = bundle.annotations();
    for key in pod_keys {
        if let Some(value) = state.annotations.get(*key).or_else(|| all.get(*key)) {
            annotations.insert(key.to_string(), value.clone());
        }
    }
    let reply = client
        .request(&json!({"op": "register", "annotations": annotations, "container": state.id, "pid": pid}))
        .map_err(|e| service_error(stage, e))?;
    let vgpu = reply
        .vgpu
        .ok_or_else(|| fail("the node service replied without a vGPU".into()))?;
    // The runc/crun path makes device nodes inside a container that exists already; a CDI
    // spec's driver libraries, mounts and createContainer hooks cannot be added then.
    let injected = match cdi_edits(&vgpu) {
        Ok(None) => inject_registered(ctx, &vgpu, pid, &bundle),
        Ok(Some(edits)) => Err(format!(
            "this host's GPUs have a CDI spec ({}) whose driver libraries and hooks cannot be added to a container runc has already made; run it with podman (config/hooks.d) or containerd (runtime io.containerd.gpuplex.v1), which apply it",
            edits.spec_files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        )),
        Err(e) => Err(e),
    };
    if let Err(message) = injected {
        let _ = client.release(&state.id);
        let _ = identity::remove(&ctx.identity_dir, &vgpu.id);
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
    let injection = injection(ctx, vgpu, file.clone())?;
    let rootfs = &bundle.rootfs;
    let created =
        inject::create_device_nodes(pid, rootfs, &injection.devices).map_err(|e| e.to_string())?;
    let rules = match inject::allow_devices(pid, &injection.devices) {
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

/// `poststop`: release the container's vGPU.
pub fn poststop(ctx: &HookContext, input: &[u8]) -> Result<(), HookError> {
    const STAGE: &str = "poststop";
    let state = OciState::parse(input).map_err(|e| HookError {
        stage: STAGE,
        message: e.to_string(),
    })?;
    let mut client = ctx.client(STAGE)?;
    let released = client
        .release(&state.id)
        .map_err(|e| service_error(STAGE, e))?;
    if let Some(v) = released {
        let _ = identity::remove(&ctx.identity_dir, &v.id);
    }
    Ok(())
}
