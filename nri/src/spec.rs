//! A container as NRI describes it, turned into the OCI spec gpuplex's decisions read, and
//! their spec edit turned back into NRI's adjustment. Pure.
//!
//! [`spec_of`] makes the spec `gpuplex_hook::classify` and `gpuplex_hook::stages::prepare`
//! read: the container's annotations (with its pod's `gpuplex.io/` annotations under them: a
//! Kubernetes user writes them on the pod, and NRI hands the plugin the pod's annotations,
//! where a runtime hands a shim only those its `pod_annotations` pass), the pod's name and
//! namespace as the runtime knows them (what the `[policy]` goes by; never the container's
//! word), its environment (which may ask NVIDIA's runtime for GPUs too) and its `createRuntime`
//! hooks (where a claim's attach step is). Its mounts, devices and other hooks start empty, so
//! that what the edit adds there is the adjustment.
//!
//! [`adjustment`] is the edit as NRI's `ContainerAdjustment`: the device nodes (which NRI also
//! allows in the device cgroup), the environment the edit set, the mounts and hooks it added,
//! and the annotations `gpuplex.io/vgpu-id` and `gpuplex.io/vgpu-handle`: the handle goes into
//! the container's spec, root's alone, as podman's precreate puts it there, so that a plugin
//! started again finds what to attach and release.

use std::collections::{BTreeMap, BTreeSet};

use gpuplex_scheduler::Handle;
use gpuplex_wire::annotations::{POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX, VGPU_HANDLE, VGPU_ID};
use serde_json::{json, Map, Value};

use crate::proto::nri::{
    Container, ContainerAdjustment, Hook, Hooks, KeyValue, LinuxContainerAdjustment, LinuxDevice,
    Mount, OptionalFileMode, OptionalInt, OptionalUInt32, PodSandbox,
};

/// The OCI spec NRI's `pod` and `container` stand for (see the module doc).
pub fn spec_of(pod: &PodSandbox, container: &Container) -> Value {
    let mut annotations: Map<String, Value> = Map::new();
    for (key, value) in &pod.annotations {
        if key.starts_with(PREFIX) {
            annotations.insert(key.clone(), value.clone().into());
        }
    }
    for (key, value) in &container.annotations {
        annotations.insert(key.clone(), value.clone().into());
    }
    for (keys, value) in [
        (POD_NAME_KEYS, &pod.name),
        (POD_NAMESPACE_KEYS, &pod.namespace),
    ] {
        for key in keys {
            annotations.remove(key);
            if !value.is_empty() {
                annotations.insert(key.to_owned(), value.clone().into());
            }
        }
    }
    let create_runtime: Vec<Value> = (container.hooks.iter())
        .flat_map(|h| h.create_runtime.iter())
        .map(oci_hook)
        .collect();
    json!({
        "ociVersion": "1.0.2",
        "process": {"env": container.env},
        "annotations": annotations,
        "hooks": {"createRuntime": create_runtime},
        "mounts": [],
        "linux": {"devices": [], "resources": {"devices": []}},
    })
}

/// An NRI hook as OCI writes it.
fn oci_hook(hook: &Hook) -> Value {
    let mut value = json!({"path": hook.path});
    if !hook.args.is_empty() {
        value["args"] = json!(hook.args);
    }
    if !hook.env.is_empty() {
        value["env"] = json!(hook.env);
    }
    if let Some(timeout) = &hook.timeout {
        value["timeout"] = json!(timeout.value);
    }
    value
}

/// An OCI hook as NRI writes it.
fn nri_hook(hook: &Value) -> Result<Hook, String> {
    Ok(Hook {
        path: str_field(hook, "path")?,
        args: strings(&hook["args"]),
        env: strings(&hook["env"]),
        timeout: hook["timeout"].as_i64().map(|value| OptionalInt { value }),
    })
}

/// What NRI's adjustment must do to the container so that its spec is `edited`, the edit of
/// `before` (a spec of [`spec_of`]) for the vGPU reserved with `handle`. Supplementary groups
/// the host's CDI spec adds cannot be said in NRI's adjustment: they are returned apart, for
/// the caller to say so.
pub fn adjustment(
    before: &Value,
    edited: &Value,
    handle: &Handle,
) -> Result<(ContainerAdjustment, Vec<u64>), String> {
    let mut annotations = BTreeMap::new();
    let vgpu = edited["annotations"][VGPU_ID]
        .as_str()
        .ok_or_else(|| format!("the edited spec has no {VGPU_ID}"))?;
    annotations.insert(VGPU_ID.to_owned(), vgpu.to_owned());
    annotations.insert(VGPU_HANDLE.to_owned(), handle.to_string());

    let had: BTreeSet<&str> = before["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let env = (edited["process"]["env"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .filter(|e| !had.contains(e))
        .filter_map(|e| e.split_once('='))
        .map(|(key, value)| KeyValue {
            key: key.to_owned(),
            value: value.to_owned(),
        })
        .collect();

    let mounts = (edited["mounts"].as_array().into_iter().flatten())
        .map(|m| {
            Ok(Mount {
                destination: str_field(m, "destination")?,
                r#type: m["type"].as_str().unwrap_or_default().to_owned(),
                source: m["source"].as_str().unwrap_or_default().to_owned(),
                options: strings(&m["options"]),
            })
        })
        .collect::<Result<_, String>>()?;

    let devices = (edited["linux"]["devices"].as_array().into_iter().flatten())
        .map(nri_device)
        .collect::<Result<_, String>>()?;

    let hooks = added_hooks(before, edited)?;
    let gids = (edited["process"]["user"]["additionalGids"].as_array())
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect();
    Ok((
        ContainerAdjustment {
            annotations,
            mounts,
            env,
            hooks,
            linux: Some(LinuxContainerAdjustment { devices }),
        },
        gids,
    ))
}

/// The hooks the edit added, stage by stage (after those `before` had at `createRuntime`).
fn added_hooks(before: &Value, edited: &Value) -> Result<Option<Hooks>, String> {
    let stage = |name: &str| -> Result<Vec<Hook>, String> {
        let kept = before["hooks"][name].as_array().map_or(0, Vec::len);
        (edited["hooks"][name].as_array().into_iter().flatten())
            .skip(kept)
            .map(nri_hook)
            .collect()
    };
    let hooks = Hooks {
        prestart: stage("prestart")?,
        create_runtime: stage("createRuntime")?,
        create_container: stage("createContainer")?,
        start_container: stage("startContainer")?,
        poststart: stage("poststart")?,
        poststop: stage("poststop")?,
    };
    Ok((hooks != Hooks::default()).then_some(hooks))
}

/// An OCI device node as NRI writes it.
fn nri_device(device: &Value) -> Result<LinuxDevice, String> {
    let number = |key: &str| {
        device[key]
            .as_i64()
            .ok_or_else(|| format!("device {} has no {key} number", device["path"]))
    };
    Ok(LinuxDevice {
        path: str_field(device, "path")?,
        r#type: str_field(device, "type")?,
        major: number("major")?,
        minor: number("minor")?,
        file_mode: (device["fileMode"].as_u64())
            .and_then(|m| u32::try_from(m).ok())
            .map(|value| OptionalFileMode { value }),
        uid: (device["uid"].as_u64())
            .and_then(|u| u32::try_from(u).ok())
            .map(|value| OptionalUInt32 { value }),
        gid: (device["gid"].as_u64())
            .and_then(|g| u32::try_from(g).ok())
            .map(|value| OptionalUInt32 { value }),
    })
}

fn str_field(value: &Value, key: &str) -> Result<String, String> {
    (value[key].as_str())
        .map(str::to_owned)
        .ok_or_else(|| format!("{value} has no {key}"))
}

fn strings(value: &Value) -> Vec<String> {
    (value.as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests;
