//! [`edit`]: the checked injection turned into JSON, then written into the config.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::json::{all_objects, all_strings, array, kind, object, replace_or_push, write_devices};
use super::{
    HookCommand, Injection, SpecError, HOOK_STAGES, IDENTITY_MOUNT_OPTIONS, IDENTITY_PATH,
    VGPU_HANDLE_ANNOTATION, VGPU_ID_ANNOTATION, VISIBLE_DEVICES,
};

/// What goes into the config, built and checked before anything is changed.
struct Plan {
    /// `linux.devices` entries, each with its container path.
    devices: Vec<(String, Value)>,
    /// `linux.resources.devices` allow rules.
    rules: Vec<Value>,
    /// The `CUDA_VISIBLE_DEVICES=...` entry of `process.env`.
    env: String,
    /// The identity mount.
    mount: Value,
    /// The vGPU id.
    vgpu: String,
    /// The handle, if the config carries it.
    handle: Option<String>,
    /// The hook entry per stage.
    hooks: Vec<(&'static str, Value)>,
}

/// `path` as a string when it is absolute and UTF-8.
fn absolute<'a>(path: &'a Path, what: &'static str) -> Result<&'a str, SpecError> {
    match path.to_str() {
        Some(text) if path.is_absolute() => Ok(text),
        _ => Err(SpecError::BadPath {
            what,
            path: path.to_path_buf(),
        }),
    }
}

impl Plan {
    fn new(injection: &Injection) -> Result<Plan, SpecError> {
        let vgpu = injection.vgpu.trim();
        if vgpu.is_empty() {
            return Err(SpecError::NoVgpuId);
        }
        let vgpu = vgpu.to_owned();
        if injection.devices.is_empty() {
            return Err(SpecError::NoDevice { vgpu });
        }
        if injection.uuids.is_empty() {
            return Err(SpecError::NoUuid { vgpu });
        }
        let unfit = |uuid: &String| {
            uuid.is_empty() || uuid.contains(',') || uuid.contains(char::is_whitespace)
        };
        if let Some(uuid) = injection.uuids.iter().find(|uuid| unfit(uuid)) {
            let uuid = uuid.clone();
            return Err(SpecError::BadUuid { vgpu, uuid });
        }
        let mut devices = Vec::with_capacity(injection.devices.len());
        let mut rules = Vec::with_capacity(injection.devices.len());
        for device in &injection.devices {
            let path = absolute(&device.container_path, "device container path")?;
            let (major, minor) = (device.major, device.minor);
            let entry = json!({
                "path": path, "type": "c", "major": major, "minor": minor,
                "fileMode": device.file_mode, "uid": 0, "gid": 0,
            });
            devices.push((path.to_owned(), entry));
            rules.push(json!({
                "allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm",
            }));
        }
        let source = absolute(&injection.identity_file, "identity file")?;
        let mount = json!({
            "destination": IDENTITY_PATH, "type": "bind", "source": source,
            "options": IDENTITY_MOUNT_OPTIONS,
        });
        let mut hooks = Vec::new();
        if let Some(hook) = &injection.hook {
            hooks = Plan::hooks(hook)?;
        }
        Ok(Plan {
            devices,
            rules,
            env: format!("{VISIBLE_DEVICES}={}", injection.uuids.join(",")),
            mount,
            vgpu,
            handle: injection.handle.map(|h| h.to_string()),
            hooks,
        })
    }

    /// The hook's entry at each of [`HOOK_STAGES`].
    fn hooks(hook: &HookCommand) -> Result<Vec<(&'static str, Value)>, SpecError> {
        let hook_path = absolute(&hook.path, "hook path")?;
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

    /// Writes the plan into `root`, the config's top-level object.
    fn apply(self, root: &mut Map<String, Value>) -> Result<(), SpecError> {
        write_devices(root, self.devices, self.rules)?;

        let process = object(root, "process", "process")?;
        let env = array(process, "env", "process.env")?;
        all_strings(env, "process.env")?;
        let is_visible = |item: &Value| {
            let text = item.as_str().unwrap_or_default();
            text.split_once('=').map(|(name, _)| name) == Some(VISIBLE_DEVICES)
        };
        replace_or_push(env, Value::String(self.env), is_visible);

        let mounts = array(root, "mounts", "mounts")?;
        all_objects(mounts, "mounts")?;
        mounts.retain(|mount| mount["destination"] != IDENTITY_PATH);
        mounts.push(self.mount);

        let annotations = object(root, "annotations", "annotations")?;
        annotations.insert(VGPU_ID_ANNOTATION.to_owned(), Value::String(self.vgpu));
        match self.handle {
            Some(handle) => annotations.insert(VGPU_HANDLE_ANNOTATION.to_owned(), handle.into()),
            None => annotations.remove(VGPU_HANDLE_ANNOTATION),
        };

        let hooks = object(root, "hooks", "hooks")?;
        for (stage, entry) in self.hooks {
            let entries = array(hooks, stage, &format!("hooks.{stage}"))?;
            if !entries
                .iter()
                .any(|item| same_program_and_stage(item, &entry, stage))
            {
                entries.push(entry);
            }
        }
        Ok(())
    }
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
    let plan = Plan::new(injection)?;
    let mut edited = config.clone();
    let root = edited.as_object_mut().ok_or(SpecError::NotAnObject {
        found: kind(config),
    })?;
    plan.apply(root)?;
    *config = edited;
    Ok(())
}
