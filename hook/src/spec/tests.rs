//! The spec editor against real configs (`fixtures/`: `runc spec`, `crun spec`, and what podman
//! 4.3.1 handed a `precreate` hook, plain and with `--read-only --device --env`) and small
//! hand-made ones. Its input is made as the hook makes it: the vGPU's edits
//! ([`vgpu_edits`]) from the node service's reply.

use std::path::Path;

use gpuplex_scheduler::request::Priority;
use gpuplex_wire::annotations::{VGPU_HANDLE, VGPU_ID};
use gpuplex_wire::protocol::cdi::{CdiDeviceNode, CdiEdits, CdiHook, CdiMount};
use gpuplex_wire::protocol::{AssignedGpu, DeviceNode, VgpuReply};
use gpuplex_wire::vgpu_edits::{vgpu_edits, IDENTITY_PATH};
use serde_json::{json, Value};

use super::*;

const FIXTURES: [(&str, &str); 4] = [
    ("runc spec", include_str!("fixtures/runc-spec.json")),
    ("crun spec", include_str!("fixtures/crun-spec.json")),
    ("podman", include_str!("fixtures/podman-precreate.json")),
    (
        "podman --read-only",
        include_str!("fixtures/podman-precreate-readonly.json"),
    ),
];

pub(super) fn fixtures() -> impl Iterator<Item = (&'static str, Value)> {
    FIXTURES
        .iter()
        .map(|(name, text)| (*name, serde_json::from_str(text).unwrap()))
}

fn gpu(index: u32, uuid: &str, path: &str, minor: u32) -> AssignedGpu {
    AssignedGpu {
        index,
        uuid: uuid.into(),
        model: "Fake A100".into(),
        memory: 8 << 30,
        device: Some(DeviceNode {
            path: path.into(),
            major: 195,
            minor,
        }),
        fake: true,
    }
}

/// The node service's reply for vGPU `id` on `gpus`, with the host spec's edits `cdi`.
pub(super) fn reply(id: u64, gpus: Vec<AssignedGpu>, cdi: Option<CdiEdits>) -> VgpuReply {
    VgpuReply {
        id: VgpuId(id),
        handle: None,
        container: None,
        gpus,
        weight: 1,
        priority: Priority::Normal,
        cdi,
    }
}

/// vGPU 3's reply: two GPUs, one fake outside /dev; `cdi`, its host spec's edits.
pub(super) fn two_gpus(cdi: Option<CdiEdits>) -> VgpuReply {
    let gpus = vec![
        gpu(
            0,
            "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
            "/dev/nvidia0",
            0,
        ),
        gpu(1, "GPU-fake-1", "/var/lib/gpuplex/fake/nvidia1", 1),
    ];
    reply(3, gpus, cdi)
}

/// The injection of `vgpu` with two control nodes and a hook that has options.
pub(super) fn injection_of(vgpu: &VgpuReply) -> Injection {
    let node = |path: &str, major, minor| DeviceNode {
        path: path.into(),
        major,
        minor,
    };
    let control = [
        node("/dev/nvidiactl", 195, 255),
        node("/dev/nvidia-uvm", 508, 0),
    ];
    let identity = format!("/run/gpuplex/vgpus/{}.json", vgpu.id);
    Injection {
        vgpu: vgpu.id,
        handle: Some(gpuplex_scheduler::Handle::from_bytes([0x3c; 16])),
        edits: vgpu_edits(vgpu, Path::new(&identity), &control).unwrap(),
        hook: Some(HookCommand {
            path: "/usr/local/bin/gpuplex-hook".into(),
            args: ["gpuplex-hook", "--config", "/etc/gpuplex/gpuplex.toml"]
                .map(String::from)
                .into(),
            env: vec!["GPUPLEX_LOG=info".into()],
        }),
    }
}

/// Two GPUs (one fake, outside /dev) and two control nodes, with a hook that has options.
pub(super) fn injection() -> Injection {
    injection_of(&two_gpus(None))
}

/// One GPU, no control node, a hook with no args and no env, no handle.
pub(super) fn one() -> Injection {
    let vgpu = reply(1, vec![gpu(0, "GPU-a", "/dev/nvidia0", 0)], None);
    let identity = Path::new("/run/gpuplex/vgpus/vgpu-1.json");
    Injection {
        vgpu: vgpu.id,
        handle: None,
        edits: vgpu_edits(&vgpu, identity, &[]).unwrap(),
        hook: Some(HookCommand {
            path: "/usr/bin/gpuplex-hook".into(),
            args: vec![],
            env: vec![],
        }),
    }
}

pub(super) fn edited(config: &Value, injection: &Injection) -> Value {
    let mut config = config.clone();
    edit(&mut config, injection).unwrap();
    config
}

fn items<'a>(config: &'a Value, pointer: &str) -> &'a [Value] {
    config
        .pointer(pointer)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

#[test]
fn edits_each_fixture() {
    let inj = injection();
    for (name, input) in fixtures() {
        let out = edited(&input, &inj);
        for device in &inj.edits.device_nodes {
            let path = device.path.as_str();
            let (major, minor) = (device.major.unwrap(), device.minor.unwrap());
            let entry = json!({"path": path, "type": "c", "major": major, "minor": minor,
                "fileMode": 0o666, "uid": 0, "gid": 0});
            let at_path: Vec<_> = items(&out, "/linux/devices")
                .iter()
                .filter(|d| d["path"] == path)
                .collect();
            assert_eq!(at_path, [&entry], "{name}: {path}");
            let rule = json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"});
            let count = items(&out, "/linux/resources/devices")
                .iter()
                .filter(|r| **r == rule)
                .count();
            assert_eq!(count, 1, "{name}: {rule}");
        }
        let visible: Vec<_> = items(&out, "/process/env")
            .iter()
            .filter(|e| e.as_str().unwrap().starts_with("CUDA_VISIBLE_DEVICES="))
            .collect();
        let expected = "CUDA_VISIBLE_DEVICES=GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0,GPU-fake-1";
        assert_eq!(visible, [expected], "{name}");
        let mount = json!({"destination": "/run/gpuplex/vgpu.json", "type": "bind",
            "source": "/run/gpuplex/vgpus/vgpu-3.json", "options": ["bind", "ro", "nosuid", "nodev", "noexec"]});
        assert_eq!(items(&out, "/mounts").last(), Some(&mount), "{name}");
        assert_eq!(out["annotations"]["gpuplex.io/vgpu-id"], "vgpu-3", "{name}");
        for stage in ["createRuntime", "poststop"] {
            let hook = json!({"path": "/usr/local/bin/gpuplex-hook",
                "args": ["gpuplex-hook", "--config", "/etc/gpuplex/gpuplex.toml", stage],
                "env": ["GPUPLEX_LOG=info"]});
            assert_eq!(
                items(&out, &format!("/hooks/{stage}")).last(),
                Some(&hook),
                "{name}"
            );
        }
    }
}

/// The fields the edit may touch, as JSON pointers.
const EDITED: [&str; 7] = [
    "/linux/devices",
    "/linux/resources/devices",
    "/process/env",
    "/mounts",
    "/annotations",
    "/hooks/createRuntime",
    "/hooks/poststop",
];

fn remove(config: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    if let Some(Value::Object(map)) = config.pointer_mut(parent) {
        map.remove(key);
    }
}

/// `config` without the edited fields, and without the objects that holds them when they are
/// left empty (the edit creates them when absent).
fn without_edited(config: &Value) -> Value {
    let mut config = config.clone();
    EDITED
        .iter()
        .for_each(|pointer| remove(&mut config, pointer));
    for parent in ["/linux/resources", "/linux", "/process", "/hooks"] {
        if config.pointer(parent) == Some(&json!({})) {
            remove(&mut config, parent);
        }
    }
    config
}

/// The items of the array at `pointer` that `ours` does not pick.
fn others(config: &Value, pointer: &str, ours: impl Fn(&Value) -> bool) -> Vec<Value> {
    items(config, pointer)
        .iter()
        .filter(|item| !ours(item))
        .cloned()
        .collect()
}

#[test]
fn leaves_everything_else_as_it_was() {
    let inj = injection();
    let paths: Vec<_> = inj.edits.device_nodes.iter().map(|d| &d.path).collect();
    for (name, input) in fixtures() {
        let out = edited(&input, &inj);
        assert_eq!(without_edited(&out), without_edited(&input), "{name}");
        let ours = |d: &Value| paths.iter().any(|p| d["path"] == **p);
        assert_eq!(
            others(&out, "/linux/devices", ours),
            others(&input, "/linux/devices", ours),
            "{name}"
        );
        let visible = |e: &Value| e.as_str().unwrap().starts_with("CUDA_VISIBLE_DEVICES=");
        assert_eq!(
            others(&out, "/process/env", visible),
            others(&input, "/process/env", visible),
            "{name}"
        );
        let identity = |m: &Value| m["destination"] == IDENTITY_PATH;
        assert_eq!(
            others(&out, "/mounts", identity),
            others(&input, "/mounts", identity),
            "{name}"
        );
        for pointer in [
            "/linux/resources/devices",
            "/hooks/createRuntime",
            "/hooks/poststop",
        ] {
            assert!(
                items(&out, pointer).starts_with(items(&input, pointer)),
                "{name}: {pointer}"
            );
        }
        let mut annotations = out["annotations"].as_object().unwrap().clone();
        annotations.remove(VGPU_ID);
        annotations.remove(VGPU_HANDLE);
        assert_eq!(
            Some(&annotations),
            input["annotations"]
                .as_object()
                .or(Some(&Default::default())),
            "{name}"
        );
    }
}

#[test]
fn edit_is_idempotent() {
    let small = [
        json!({}),
        json!({"process": {"env": ["CUDA_VISIBLE_DEVICES=all"]}}),
    ];
    let configs = fixtures().map(|(_, config)| config).chain(small);
    for config in configs {
        for inj in [injection(), one()] {
            let once = edited(&config, &inj);
            assert_eq!(edited(&once, &inj), once, "{config}");
        }
    }
}

/// serde_json sorts keys unless its `preserve_order` feature is on (some crate of the build
/// may turn it on); when it is, untouched objects must keep their order.
#[test]
fn keeps_key_order_when_serde_json_preserves_it() {
    let probe: Value = serde_json::from_str(r#"{"b":0,"a":0}"#).unwrap();
    if probe.as_object().unwrap().keys().next().unwrap() != "b" {
        eprintln!("skipped: serde_json is built without preserve_order; runtimes ignore key order");
        return;
    }
    for (name, input) in fixtures() {
        let out = edited(&input, &injection());
        for pointer in ["", "/process", "/linux", "/root"] {
            let keys = |v: &Value| {
                v.pointer(pointer)
                    .and_then(Value::as_object)
                    .map(|o| o.keys().cloned().collect::<Vec<_>>())
            };
            let kept: Option<Vec<_>> = keys(&out).map(|k| {
                k.into_iter()
                    .filter(|k| input.pointer(pointer).unwrap().get(k).is_some())
                    .collect()
            });
            assert_eq!(kept, keys(&input), "{name}: {pointer}");
        }
        for pointer in [
            "/process/capabilities",
            "/linux/seccomp",
            "/linux/namespaces",
            "/root",
        ] {
            let text = |v: &Value| v.pointer(pointer).map(Value::to_string);
            assert_eq!(text(&out), text(&input), "{name}: {pointer}");
        }
    }
}

#[test]
fn without_a_hook_command_no_hook_is_added() {
    let mut injection = one();
    injection.hook = None;
    let config = serde_json::json!({"hooks": {"poststop": [{"path": "/bin/true"}]}});
    let out = edited(&config, &injection);
    assert_eq!(out["hooks"], config["hooks"]);
    assert_eq!(out["annotations"][VGPU_ID], "vgpu-1");
}

#[test]
fn the_handle_is_in_the_spec_only_for_a_hook_that_attaches_with_it() {
    let config = json!({"annotations": {"gpuplex.io/gpu-memory": "1Gi"}});
    let with = edited(&config, &injection());
    assert_eq!(with["annotations"][VGPU_HANDLE], "3c".repeat(16));
    let without = edited(&with, &one());
    assert!(
        without["annotations"].get(VGPU_HANDLE).is_none(),
        "{without}"
    );
}

/// A host CDI spec's edits for the GPUs: a node at a GPU's path (as NVIDIA's specs have it),
/// NVIDIA's variable, a library and a mount at `/run`, and NVIDIA's hook.
fn host_edits() -> CdiEdits {
    CdiEdits {
        env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
        device_nodes: vec![CdiDeviceNode {
            path: "/dev/nvidia0".into(),
            node_type: Some("c".into()),
            major: Some(195),
            minor: Some(0),
            ..CdiDeviceNode::default()
        }],
        mounts: vec![
            CdiMount {
                host_path: "/usr/lib/libcuda.so.1".into(),
                container_path: "/usr/lib/libcuda.so.1".into(),
                mount_type: None,
                options: vec!["ro".into(), "bind".into()],
            },
            CdiMount {
                host_path: "tmpfs".into(),
                container_path: "/run".into(),
                mount_type: Some("tmpfs".into()),
                options: vec![],
            },
        ],
        hooks: vec![CdiHook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/nvidia-cdi-hook".into(),
            args: vec!["nvidia-cdi-hook".into(), "update-ldcache".into()],
            ..CdiHook::default()
        }],
        ..CdiEdits::default()
    }
}

#[test]
fn the_host_specs_edits_go_in_first_and_gpuplexs_win() {
    let inj = injection_of(&two_gpus(Some(host_edits())));
    for (name, input) in fixtures() {
        let out = edited(&input, &inj);
        let at_path: Vec<_> = items(&out, "/linux/devices")
            .iter()
            .filter(|d| d["path"] == "/dev/nvidia0")
            .collect();
        let ours = json!({"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
            "fileMode": 0o666, "uid": 0, "gid": 0});
        assert_eq!(at_path, [&ours], "{name}");
        let mounts = items(&out, "/mounts");
        let destinations: Vec<_> = mounts
            .iter()
            .rev()
            .take(3)
            .map(|m| &m["destination"])
            .collect();
        assert_eq!(
            destinations,
            [IDENTITY_PATH, "/run", "/usr/lib/libcuda.so.1"],
            "{name}: the identity mount is last, on top of the spec's /run"
        );
        let env = items(&out, "/process/env");
        assert!(
            env.contains(&json!("NVIDIA_VISIBLE_DEVICES=void")),
            "{name}"
        );
        let hook = &items(&out, "/hooks/createContainer")[0];
        assert_eq!(hook["path"], "/usr/bin/nvidia-cdi-hook", "{name}");
        assert_eq!(edited(&out, &inj), out, "{name}: idempotent");
    }
}
