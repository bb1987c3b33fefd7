//! [`nvidia_runtime_conflict`]: a container that asks NVIDIA's own runtime for GPUs as well as
//! gpuplex.

use std::path::Path;

use serde_json::Value;

/// The file names of NVIDIA's legacy OCI hook (`nvidia-container-runtime-hook prestart`, added
/// by `nvidia-container-runtime` in legacy mode, Docker's `--gpus` and the toolkit's podman
/// `hooks.d` file); `nvidia-container-toolkit` is its older name.
const LEGACY_HOOKS: [&str; 2] = ["nvidia-container-runtime-hook", "nvidia-container-toolkit"];
/// The file name of the hook NVIDIA's CDI specs run (`nvidia-cdi-hook update-ldcache`, ...).
const CDI_HOOK: &str = "nvidia-cdi-hook";
/// The CLI that older CDI specs run as `nvidia-ctk hook update-ldcache ...`.
const CTK: &str = "nvidia-ctk";
/// The variable NVIDIA's runtime and hook read to pick GPUs.
const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// The values of [`NVIDIA_VISIBLE_DEVICES`] that ask for no GPU (the CDI spec sets `void`).
const NO_GPU: [&str; 2] = ["void", "none"];
/// The prefix of the annotations that ask a CDI-aware runtime for devices.
const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

fn file_name(path: &str) -> Option<&str> {
    Path::new(path).file_name().and_then(|name| name.to_str())
}

/// What an NVIDIA hook in `hook` is, if it is one.
fn nvidia_hook(hook: &Value) -> Option<&'static str> {
    let path = hook["path"].as_str().unwrap_or_default();
    let args: Vec<&str> = hook["args"]
        .as_array()
        .map(|args| args.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let program = file_name(path);
    let argv0 = args.first().and_then(|arg| file_name(arg));
    let is = |name: &str| program == Some(name) || argv0 == Some(name);
    if LEGACY_HOOKS.iter().any(|name| is(name)) {
        return Some("NVIDIA's legacy hook");
    }
    if is(CDI_HOOK) || args.contains(&CDI_HOOK) || (is(CTK) && args.contains(&"hook")) {
        return Some("a hook of NVIDIA's CDI spec, already applied");
    }
    None
}

/// The first NVIDIA hook in the config's `hooks`, in words.
fn find_hook(config: &Value) -> Option<String> {
    let hooks = config["hooks"].as_object()?;
    hooks.iter().find_map(|(stage, entries)| {
        let entries = entries.as_array()?;
        entries.iter().enumerate().find_map(|(i, hook)| {
            let what = nvidia_hook(hook)?;
            let path = hook["path"].as_str().unwrap_or_default();
            Some(format!("hooks.{stage}[{i}] runs {path} ({what})"))
        })
    })
}

/// `NVIDIA_VISIBLE_DEVICES` in `process.env` (its last entry) when it asks for GPUs.
fn find_env(config: &Value) -> Option<String> {
    let env = config["process"]["env"].as_array()?;
    let value = env
        .iter()
        .filter_map(Value::as_str)
        .filter_map(|entry| entry.split_once('='))
        .filter(|(name, _)| *name == NVIDIA_VISIBLE_DEVICES)
        .map(|(_, value)| value.trim())
        .next_back()?;
    if value.is_empty() || NO_GPU.contains(&value) {
        return None;
    }
    Some(format!("process.env has {NVIDIA_VISIBLE_DEVICES}={value}"))
}

/// An annotation `cdi.k8s.io/*` whose value (comma-separated qualified device names) names a
/// device of `kind`.
fn find_annotation(config: &Value, kind: &str) -> Option<String> {
    let annotations = config["annotations"].as_object()?;
    annotations.iter().find_map(|(key, value)| {
        if !key.starts_with(CDI_ANNOTATION_PREFIX) {
            return None;
        }
        let value = value.as_str()?;
        let device = value.split(',').map(str::trim).find(|device| {
            device
                .split_once('=')
                .is_some_and(|(device_kind, _)| device_kind == kind)
        })?;
        Some(format!("annotation {key} asks for CDI device {device}"))
    })
}

/// Whether a container's config also asks NVIDIA's runtime for GPUs: a hook of an NVIDIA CDI
/// spec already applied (`nvidia-cdi-hook`, `nvidia-ctk hook`), NVIDIA's legacy hook
/// (`nvidia-container-runtime-hook`, `nvidia-container-toolkit`) with `NVIDIA_VISIBLE_DEVICES`
/// in `process.env` asking for GPUs (not empty, `void` or `none`), or a `cdi.k8s.io/*`
/// annotation naming a device of `kind`. The answer is one line saying what was found. Look
/// before [`super::apply`]: the edits it writes include NVIDIA's hooks.
///
/// `NVIDIA_VISIBLE_DEVICES` alone is no conflict: CUDA images set it (`ENV
/// NVIDIA_VISIBLE_DEVICES all`) whoever runs them, it means something only to NVIDIA's hook,
/// and the CDI spec gpuplex applies sets it to `void`.
pub fn nvidia_runtime_conflict(config: &Value, kind: &str) -> Option<String> {
    let hook = find_hook(config);
    let found = match hook {
        Some(hook) if hook.contains("legacy") => {
            find_env(config).map(|env| format!("{hook} and {env}"))
        }
        other => other,
    }
    .or_else(|| find_annotation(config, kind))?;
    Some(format!(
        "the container asks NVIDIA's runtime for GPUs as well as gpuplex: {found}; choose one: \
         gpuplex (gpuplex.io/ annotations) or NVIDIA's runtime"
    ))
}
