//! The spec editor against real configs (`fixtures/`: `runc spec`, `crun spec`, and what podman
//! 4.3.1 handed a `precreate` hook, plain and with `--read-only --device --env`) and small
//! hand-made ones.

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

pub(super) fn node(host: &str, major: u32, minor: u32) -> DeviceNode {
    DeviceNode {
        host_path: host.into(),
        container_path: container_path_of(host.as_ref()),
        major,
        minor,
        file_mode: 0o666,
    }
}

/// Two GPUs (one fake, outside /dev) and two control nodes, with a hook that has options.
pub(super) fn injection() -> Injection {
    Injection {
        vgpu: "vgpu-3".into(),
        handle: Some(gpuplex_scheduler::Handle::from_bytes([0x3c; 16])),
        uuids: vec![
            "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".into(),
            "GPU-fake-1".into(),
        ],
        devices: vec![
            node("/dev/nvidia0", 195, 0),
            node("/var/lib/gpuplex/fake/nvidia1", 195, 1),
            node("/dev/nvidiactl", 195, 255),
            node("/dev/nvidia-uvm", 508, 0),
        ],
        identity_file: "/run/gpuplex/vgpus/vgpu-3.json".into(),
        hook: Some(HookCommand {
            path: "/usr/local/bin/gpuplex-hook".into(),
            args: ["gpuplex-hook", "--config", "/etc/gpuplex/gpuplex.toml"]
                .map(String::from)
                .into(),
            env: vec!["GPUPLEX_LOG=info".into()],
        }),
    }
}

/// One GPU, a hook with no args and no env.
pub(super) fn one() -> Injection {
    Injection {
        vgpu: "vgpu-1".into(),
        handle: None,
        uuids: vec!["GPU-a".into()],
        devices: vec![node("/dev/nvidia0", 195, 0)],
        identity_file: "/run/gpuplex/vgpus/vgpu-1.json".into(),
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
        for device in &inj.devices {
            let path = device.container_path.to_str().unwrap();
            let (major, minor) = (device.major, device.minor);
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
    let paths: Vec<_> = inj
        .devices
        .iter()
        .map(|d| d.container_path.to_str().unwrap())
        .collect();
    for (name, input) in fixtures() {
        let out = edited(&input, &inj);
        assert_eq!(without_edited(&out), without_edited(&input), "{name}");
        let ours = |d: &Value| paths.iter().any(|p| d["path"] == *p);
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
        annotations.remove(VGPU_ID_ANNOTATION);
        annotations.remove(VGPU_HANDLE_ANNOTATION);
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
    assert_eq!(out["annotations"][VGPU_ID_ANNOTATION], "vgpu-1");
}

#[test]
fn the_handle_is_in_the_spec_only_for_a_hook_that_attaches_with_it() {
    let config = json!({"annotations": {"gpuplex.io/gpu-memory": "1Gi"}});
    let with = edited(&config, &injection());
    assert_eq!(with["annotations"][VGPU_HANDLE_ANNOTATION], "3c".repeat(16));
    let without = edited(&with, &one());
    assert!(
        without["annotations"].get(VGPU_HANDLE_ANNOTATION).is_none(),
        "{without}"
    );
}
