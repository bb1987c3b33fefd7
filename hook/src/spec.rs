//! The OCI spec edits that give a container its vGPU (DESIGN.md, data flow step 2).
//!
//! [`edit`] takes a container's proposed `config.json` and an [`Injection`] (what gpuplex
//! assigned it) and makes exactly these changes:
//!
//! | where | what |
//! |---|---|
//! | what the vGPU's CDI edits touch | the edits ([`gpuplex_wire::vgpu_edits`]: the host spec's for its GPUs, then its device nodes, `CUDA_VISIBLE_DEVICES`, the identity mount), applied as CDI applies them ([`crate::cdi::apply`]) |
//! | `annotations` | [`VGPU_ID`](gpuplex_wire::annotations::VGPU_ID) = the vGPU id; [`VGPU_HANDLE`](gpuplex_wire::annotations::VGPU_HANDLE) = the reservation's handle when the `createRuntime` hook attaches the container (podman), else none |
//! | `hooks.createRuntime`, `hooks.poststop` | the gpuplex hook with the stage name as its last argument, appended unless the stage already runs a program of the same file name with that last argument (podman puts `hooks.d`'s createRuntime entry there before precreate) |
//!
//! Objects and arrays that are absent (or `null`) are created. Everything else is left as it
//! was, including fields oci-spec does not model: the edits work on [`serde_json::Value`]. Two
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
mod edit;
pub(crate) mod json;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;

use gpuplex_scheduler::{Handle, VgpuId};
use gpuplex_wire::annotations::PREFIX;
use gpuplex_wire::protocol::cdi::CdiEdits;
use serde_json::Value;

use crate::cdi::ApplyError;
pub use json::FieldError;

/// The OCI hook stage at which the hook attaches the container to its assignment.
pub const CREATE_RUNTIME: &str = "createRuntime";
/// The OCI hook stage at which the hook releases the container's assignment.
pub const POSTSTOP: &str = "poststop";
/// The stages [`edit`] adds the hook at, in the order of the container's life.
pub const HOOK_STAGES: [&str; 2] = [CREATE_RUNTIME, POSTSTOP];

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
    /// The vGPU, written as [`VGPU_ID`](gpuplex_wire::annotations::VGPU_ID).
    pub vgpu: VgpuId,
    /// The reservation's handle, written as [`VGPU_HANDLE`](gpuplex_wire::annotations::VGPU_HANDLE) for the `createRuntime` hook to
    /// attach with; none when the caller attaches the container itself (the shim).
    pub handle: Option<Handle>,
    /// The vGPU's CDI edits ([`gpuplex_wire::vgpu_edits::vgpu_edits`]).
    pub edits: CdiEdits,
    /// The hook added at `createRuntime` and `poststop`; none for the containerd shim, which
    /// attaches and releases the container itself.
    pub hook: Option<HookCommand>,
}

/// Why a spec was not edited; `config.json` is then as it was. Every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The config is not JSON.
    #[error("config.json: not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    /// The vGPU's CDI edits could not be applied (the config's shape included).
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// A field the edit writes gpuplex's annotations or hooks into has the wrong type.
    #[error(transparent)]
    Field(#[from] FieldError),
    /// The hook's path is not absolute or not UTF-8.
    #[error("gpuplex injection: hook path {} must be an absolute UTF-8 path", path.display())]
    BadHookPath {
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
