//! [`edit`]: the vGPU's CDI edits applied, then what is not a CDI edit (gpuplex's annotations
//! and its own hooks) written into the config.

use std::path::Path;

use gpuplex_wire::annotations::{VGPU_HANDLE, VGPU_ID};
use serde_json::{json, Map, Value};

use super::json::{array, object, FieldError};
use super::{HookCommand, Injection, SpecError, HOOK_STAGES};
use crate::cdi;

/// The hook's entry at each of [`HOOK_STAGES`]; its path must be absolute and UTF-8.
fn hook_entries(hook: &HookCommand) -> Result<Vec<(&'static str, Value)>, SpecError> {
    let hook_path = match hook.path.to_str() {
        Some(text) if hook.path.is_absolute() => text,
        _ => {
            return Err(SpecError::BadHookPath {
                path: hook.path.clone(),
            })
        }
    };
    let hooks = HOOK_STAGES
        .iter()
        .map(|&stage| {
            let mut args = hook.args.clone();
            if args.is_empty() {
                args.push(hook_path.to_owned());
            }
            args.push(stage.to_owned());
            let mut entry = json!({ "path": hook_path, "args": args });
            if !hook.env.is_empty() {
                entry["env"] = json!(hook.env);
            }
            (stage, entry)
        })
        .collect();
    Ok(hooks)
}

/// Writes gpuplex's annotations and hook entries into `root`, the config's top-level object.
fn write_own(
    root: &mut Map<String, Value>,
    injection: &Injection,
    hooks: Vec<(&'static str, Value)>,
) -> Result<(), FieldError> {
    let annotations = object(root, "annotations", "annotations")?;
    annotations.insert(VGPU_ID.to_owned(), injection.vgpu.to_string().into());
    match injection.handle {
        Some(handle) => annotations.insert(VGPU_HANDLE.to_owned(), handle.to_string().into()),
        None => annotations.remove(VGPU_HANDLE),
    };
    let entries_at = object(root, "hooks", "hooks")?;
    for (stage, entry) in hooks {
        let entries = array(entries_at, stage, &format!("hooks.{stage}"))?;
        if !entries
            .iter()
            .any(|item| same_program_and_stage(item, &entry, stage))
        {
            entries.push(entry);
        }
    }
    Ok(())
}

/// Whether the hook `item`, already in the config, runs the program of `entry` (the same file
/// name) with `stage` as its last argument. podman puts hooks.d's createRuntime entries into the
/// config before it runs precreate, so a second entry would only run gpuplex-hook twice.
fn same_program_and_stage(item: &Value, entry: &Value, stage: &str) -> bool {
    fn name(hook: &Value) -> Option<&std::ffi::OsStr> {
        hook["path"]
            .as_str()
            .and_then(|path| Path::new(path).file_name())
    }
    let last_arg = item["args"].as_array().and_then(|args| args.last());
    name(item).is_some()
        && name(item) == name(entry)
        && last_arg.and_then(Value::as_str) == Some(stage)
}

/// See [`super::edit`]: the edits are made on a copy, which replaces `config` when all of them
/// succeeded.
pub(super) fn edit(config: &mut Value, injection: &Injection) -> Result<(), SpecError> {
    let hooks = match &injection.hook {
        Some(hook) => hook_entries(hook)?,
        None => Vec::new(),
    };
    let mut edited = config.clone();
    cdi::apply(&mut edited, &injection.edits)?;
    // `apply` refuses a config that is no object.
    if let Some(root) = edited.as_object_mut() {
        write_own(root, injection, hooks)?;
    }
    *config = edited;
    Ok(())
}
