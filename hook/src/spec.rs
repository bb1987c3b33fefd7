//! The OCI spec edits that give a container its vGPU (DESIGN.md, data flow step 2).
//!
//! [`edit`] takes a container's proposed `config.json` and an [`Injection`] (what gpuplex
//! assigned it) and makes exactly these changes:
//!
//! | where | what |
//! |---|---|
//! | `linux.devices` | one `{"path","type":"c","major","minor","fileMode","uid":0,"gid":0}` per injected device; an entry with the same path is replaced in place |
//! | `linux.resources.devices` | one `{"allow":true,"type":"c","major","minor","access":"rwm"}` per device, appended unless an identical rule is there |
//! | `process.env` | `CUDA_VISIBLE_DEVICES=<uuids joined by ,>`, replacing an existing one in place |
//! | `mounts` | a read-only bind of the identity file at [`IDENTITY_PATH`], last (an older mount there is removed) |
//! | `annotations` | [`VGPU_ID_ANNOTATION`] = the vGPU id; [`VGPU_HANDLE_ANNOTATION`] = the reservation's handle when the `createRuntime` hook attaches the container (podman), else none |
//! | `hooks.createRuntime`, `hooks.poststop` | the gpuplex hook with the stage name as its last argument, appended unless the stage already runs a program of the same file name with that last argument (podman puts `hooks.d`'s createRuntime entry there before precreate) |
//!
//! Objects and arrays that are absent (or `null`) are created. Everything else is left as it
//! was, including fields oci-spec does not model: the edits work on [`serde_json::Value`], and
//! [`edit_spec`] (the containerd shim's entry point) goes through the same function. Two
//! properties the tests hold:
//!
//! - **idempotent**: editing an edited config with the same injection changes nothing;
//! - **all or nothing**: on error the config is left untouched.
//!
//! Key order: `serde_json` is built without `preserve_order` here, so the edited config comes out
//! with every object's keys sorted. Runtimes do not care (podman, runc and crun decode into
//! structs); the tests compare values, and check key order only when the feature is on.
//!
//! The identity mount is the last mount so that it lands on top of a tmpfs that an earlier
//! mount puts on `/run` (podman does so with `--read-only`). It works with `root.readonly`:
//! runc and crun create the mount point before they remount the root read-only.

#[cfg(test)]
mod cases;
mod device;
mod edit;
pub(crate) mod json;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;

use gpuplex_scheduler::request::PREFIX;
use serde_json::Value;

pub use device::{container_path_of, control_nodes, control_nodes_in, DeviceNode, CONTROL_NODES};

/// Where the container sees its vGPU identity.
pub const IDENTITY_PATH: &str = "/run/gpuplex/vgpu.json";
/// The variable that names the container's GPUs (their UUIDs) to CUDA.
pub const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// The annotation that carries the container's vGPU id.
pub const VGPU_ID_ANNOTATION: &str = gpuplex_scheduler::request::VGPU_ID;
/// The annotation that carries the reservation's handle to the `createRuntime` hook.
pub const VGPU_HANDLE_ANNOTATION: &str = gpuplex_scheduler::request::VGPU_HANDLE;
/// The OCI hook stage at which the hook attaches the container to its assignment.
pub const CREATE_RUNTIME: &str = "createRuntime";
/// The OCI hook stage at which the hook releases the container's assignment.
pub const POSTSTOP: &str = "poststop";
/// The stages [`edit`] adds the hook at, in the order of the container's life.
pub const HOOK_STAGES: [&str; 2] = [CREATE_RUNTIME, POSTSTOP];
/// The mount options of the identity bind mount.
pub const IDENTITY_MOUNT_OPTIONS: [&str; 5] = ["bind", "ro", "nosuid", "nodev", "noexec"];

/// How the hook is called back at the later stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookCommand {
    /// The hook binary, an absolute path on the host.
    pub path: PathBuf,
    /// `argv[0]` and any options (such as `--config X`); the stage name is appended. When
    /// empty, `argv[0]` is `path`.
    pub args: Vec<String>,
    /// The hook's whole environment (`KEY=value`); none is written when empty, so that the hook
    /// inherits the runtime's. A hook given `env` gets no `PATH` unless it is listed.
    pub env: Vec<String>,
}

/// Everything the edit needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injection {
    /// The vGPU id, such as `vgpu-3`.
    pub vgpu: String,
    /// The reservation's handle, written as [`VGPU_HANDLE_ANNOTATION`] for the `createRuntime`
    /// hook to attach with; none when the caller attaches the container itself (the shim).
    pub handle: Option<gpuplex_scheduler::Handle>,
    /// The assigned GPUs' UUIDs, in order: `CUDA_VISIBLE_DEVICES=uuid1,uuid2`.
    pub uuids: Vec<String>,
    /// The assigned GPUs' nodes, then the control nodes ([`control_nodes`]).
    pub devices: Vec<DeviceNode>,
    /// The host file bind-mounted read-only at [`IDENTITY_PATH`]; an absolute path.
    pub identity_file: PathBuf,
    /// The hook added at `createRuntime` and `poststop`; none for the containerd shim, which
    /// attaches and releases the container itself.
    pub hook: Option<HookCommand>,
}

/// What can go wrong reading a device node or editing a spec. Every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The config is not JSON.
    #[error("config.json: not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// The config is JSON but not an object.
    #[error("config.json: not a JSON object (it is {found})")]
    NotAnObject {
        /// What it is instead, such as `an array`.
        found: &'static str,
    },
    /// A field the edit reads or writes has the wrong type.
    #[error("config.json: {field} is not {expected} (it is {found})")]
    WrongType {
        /// The field, such as `linux.devices` or `process.env[2]`.
        field: String,
        /// What it must be, such as `an array`.
        expected: &'static str,
        /// What it is, such as `a string`.
        found: &'static str,
    },
    /// oci-spec's type could not be turned into JSON or back.
    #[error("config.json: oci-spec could not {step} the spec: {source}")]
    Typed {
        /// `serialize` or `read back`.
        step: &'static str,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The injection has no device node.
    #[error("gpuplex injection for {vgpu}: no device node to give the container (an assignment has at least one GPU)")]
    NoDevice {
        /// The vGPU id.
        vgpu: String,
    },
    /// The injection has no GPU UUID.
    #[error("gpuplex injection for {vgpu}: no GPU UUID for {VISIBLE_DEVICES} (an assignment has at least one GPU)")]
    NoUuid {
        /// The vGPU id.
        vgpu: String,
    },
    /// A GPU UUID that cannot be listed in `CUDA_VISIBLE_DEVICES`.
    #[error("gpuplex injection for {vgpu}: GPU UUID {uuid:?} cannot go in {VISIBLE_DEVICES}: it is empty or has a comma or whitespace")]
    BadUuid {
        /// The vGPU id.
        vgpu: String,
        /// The UUID.
        uuid: String,
    },
    /// The injection has an empty vGPU id.
    #[error("gpuplex injection: the vGPU id is empty")]
    NoVgpuId,
    /// A path of the injection that is not absolute or not UTF-8.
    #[error("gpuplex injection: {what} {} must be an absolute UTF-8 path", path.display())]
    BadPath {
        /// Which path: `hook path`, `identity file`, `device container path`.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// A host device node could not be read.
    #[error("cannot read device node {}: {source}", path.display())]
    Stat {
        /// The node.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A host path that is not a character device.
    #[error("{} is not a character device; a GPU node (real or fake) is made with `mknod PATH c MAJOR MINOR`", path.display())]
    NotCharDevice {
        /// The path.
        path: PathBuf,
    },
}

/// Edits a `config.json` value in place (see the module docs for what changes). On error the
/// value is left as it was.
pub fn edit(config: &mut Value, injection: &Injection) -> Result<(), SpecError> {
    edit::edit(config, injection)
}

/// The same on bytes: parse, edit, serialize compactly (what `precreate` prints).
pub fn edit_bytes(config: &[u8], injection: &Injection) -> Result<Vec<u8>, SpecError> {
    let mut value: Value = serde_json::from_slice(config).map_err(SpecError::Json)?;
    edit(&mut value, injection)?;
    serde_json::to_vec(&value).map_err(SpecError::Json)
}

/// The same on oci-spec's type: to JSON, [`edit`], back.
pub fn edit_spec(
    spec: &oci_spec::runtime::Spec,
    injection: &Injection,
) -> Result<oci_spec::runtime::Spec, SpecError> {
    let mut value = serde_json::to_value(spec).map_err(|source| SpecError::Typed {
        step: "serialize",
        source,
    })?;
    edit(&mut value, injection)?;
    serde_json::from_value(value).map_err(|source| SpecError::Typed {
        step: "read back",
        source,
    })
}

/// The `gpuplex.io/` annotations of a config with string values (an empty map when there are
/// none, or when the config or its `annotations` is not an object): the `precreate` stage
/// passes a config without any through byte-for-byte.
pub fn gpuplex_annotations(config: &Value) -> BTreeMap<String, String> {
    let Some(annotations) = config.get("annotations").and_then(Value::as_object) else {
        return BTreeMap::new();
    };
    annotations
        .iter()
        .filter(|(key, _)| key.starts_with(PREFIX))
        .filter_map(|(key, value)| Some((key.clone(), value.as_str()?.to_owned())))
        .collect()
}
