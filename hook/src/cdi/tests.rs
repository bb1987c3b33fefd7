//! Tables for [`apply`] and [`nvidia_runtime_conflict`], on the edits the node service sends
//! for GPU 0 of a spec in the style of `nvidia-ctk cdi generate`
//! (`fixtures/nvidia-gpu0-edits.json`: what the registry, `shim/src/cdi/`, chooses from its
//! `fixtures/nvidia.yaml`, as its tests check).

use gpuplex_wire::protocol::cdi::{CdiDeviceNode, CdiEdits, CdiHook};
use serde_json::{json, Value};

use super::*;

const KIND: &str = "nvidia.com/gpu";

/// The edits for GPU 0 (by its UUID) of the registry's fixture, as the node service sends them.
fn gpu0() -> CdiEdits {
    serde_json::from_str(include_str!("fixtures/nvidia-gpu0-edits.json")).unwrap()
}

/// A config as podman would hand it over, with fields oci-spec does not model.
fn config() -> Value {
    json!({
        "ociVersion": "1.2.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["nvidia-smi"],
            "env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all", "HOME=/root"],
            "cwd": "/",
        },
        "root": {"path": "/rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "type": "bind",
             "source": "/old/libcuda.so.1", "options": ["bind"]},
            {"destination": "/run/gpuplex/vgpu.json", "type": "bind", "source": "/x",
             "options": ["bind", "ro"]},
        ],
        "hooks": {"createRuntime": [{"path": "/usr/bin/gpuplex-hook", "args": ["gpuplex-hook", "createRuntime"]}]},
        "annotations": {"gpuplex.io/gpu-memory": "4Gi"},
        "linux": {
            "devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
            "resources": {"devices": [
                {"allow": false, "access": "rwm"},
                {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
            ]},
            "namespaces": [{"type": "mount"}],
        },
        "x-unknown-to-oci-spec": {"kept": true},
    })
}

#[test]
fn apply_writes_devices_rules_env_mounts_and_hooks_and_nothing_else() {
    let edits = gpu0();
    let before = config();
    let mut edited = before.clone();
    apply(&mut edited, &edits).unwrap();

    assert_eq!(
        edited["linux"]["devices"],
        json!([
            {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229},
            {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
            {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
        ])
    );
    // the rule for /dev/nvidia0 is there already, in the shape gpuplex's spec edit writes
    assert_eq!(
        edited["linux"]["resources"]["devices"],
        json!([
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
            {"allow": true, "type": "c", "major": 195, "minor": 255, "access": "rwm"},
        ])
    );
    assert_eq!(
        edited["process"]["env"],
        json!([
            "PATH=/usr/bin:/bin",
            "NVIDIA_VISIBLE_DEVICES=void",
            "HOME=/root",
            "GPUPLEX_TEST_ENTRY=uuid-0",
        ])
    );
    let libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.1";
    assert_eq!(
        edited["mounts"],
        json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/run/gpuplex/vgpu.json", "type": "bind", "source": "/x",
             "options": ["bind", "ro"]},
            {"destination": libcuda, "source": libcuda,
             "options": ["ro", "nosuid", "nodev", "bind"]},
        ])
    );
    let hook = |step: &str, rest: &[&str]| {
        let mut args = vec!["nvidia-cdi-hook", step];
        args.extend_from_slice(rest);
        json!({"path": "/usr/bin/nvidia-cdi-hook", "args": args, "env": ["NVIDIA_CTK_DEBUG=false"]})
    };
    assert_eq!(
        edited["hooks"],
        json!({
            "createRuntime": before["hooks"]["createRuntime"],
            "createContainer": [
                hook("create-symlinks", &["--link", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"]),
                hook("update-ldcache", &["--folder", "/usr/lib/x86_64-linux-gnu"]),
            ],
        })
    );
    // everything else as it was
    for key in ["ociVersion", "root", "annotations", "x-unknown-to-oci-spec"] {
        assert_eq!(edited[key], before[key], "{key}");
    }
    assert_eq!(edited["linux"]["namespaces"], before["linux"]["namespaces"]);
    for key in ["user", "args", "cwd"] {
        assert_eq!(edited["process"][key], before["process"][key], "{key}");
    }
    let keys = |value: &Value| {
        value
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&edited), keys(&before));

    // applying twice is applying once
    let mut again = edited.clone();
    apply(&mut again, &edits).unwrap();
    assert_eq!(again, edited);
}

#[test]
fn apply_reads_missing_numbers_from_the_host_node_and_follows_cdi_defaults() {
    let edits = CdiEdits {
        device_nodes: vec![
            // no type, no numbers: all from the host
            CdiDeviceNode {
                path: "/dev/null".to_owned(),
                ..CdiDeviceNode::default()
            },
            // a container path of its own, numbers from hostPath; read, write only
            CdiDeviceNode {
                path: "/dev/gpuplex-zero".to_owned(),
                host_path: Some("/dev/zero".to_owned()),
                node_type: Some("c".to_owned()),
                permissions: Some("rw".to_owned()),
                file_mode: Some(0o666),
                ..CdiDeviceNode::default()
            },
            // type given but no major: read from the host too; `none` gives no access
            CdiDeviceNode {
                path: "/dev/full".to_owned(),
                node_type: Some("c".to_owned()),
                permissions: Some("none".to_owned()),
                uid: Some(7),
                ..CdiDeviceNode::default()
            },
            // a fifo is taken as written, with no rule
            CdiDeviceNode {
                path: "/dev/gpuplex-fifo".to_owned(),
                node_type: Some("p".to_owned()),
                ..CdiDeviceNode::default()
            },
        ],
        additional_gids: vec![0, 44, 44],
        ..CdiEdits::default()
    };
    let mut config =
        json!({"process": {"user": {"uid": 1000, "gid": 1001, "additionalGids": [5]}}});
    apply(&mut config, &edits).unwrap();
    assert_eq!(
        config["linux"]["devices"],
        json!([
            {"path": "/dev/null", "type": "c", "major": 1, "minor": 3, "uid": 1000, "gid": 1001},
            {"path": "/dev/gpuplex-zero", "type": "c", "major": 1, "minor": 5, "fileMode": 0o666,
             "uid": 1000, "gid": 1001},
            {"path": "/dev/full", "type": "c", "major": 1, "minor": 7, "uid": 7, "gid": 1001},
            {"path": "/dev/gpuplex-fifo", "type": "p", "uid": 1000, "gid": 1001},
        ])
    );
    assert_eq!(
        config["linux"]["resources"]["devices"],
        json!([
            {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 5, "access": "rw"},
            {"allow": true, "type": "c", "major": 1, "minor": 7, "access": ""},
        ])
    );
    assert_eq!(config["process"]["user"]["additionalGids"], json!([5, 44]));
    // nothing else was created
    assert_eq!(config.as_object().unwrap().len(), 2);
}

#[test]
fn apply_is_all_or_nothing() {
    let edits = gpu0();
    let broken = |pointer: &str, value: Value| {
        let mut config = config();
        *config.pointer_mut(pointer).unwrap() = value;
        config
    };
    let missing_host = CdiEdits {
        env: vec!["A=1".to_owned()],
        device_nodes: vec![CdiDeviceNode {
            path: "/dev/gpuplex-test-absent".to_owned(),
            ..CdiDeviceNode::default()
        }],
        ..CdiEdits::default()
    };
    let wrong_type = CdiEdits {
        device_nodes: vec![CdiDeviceNode {
            path: "/dev/null".to_owned(),
            node_type: Some("b".to_owned()),
            ..CdiDeviceNode::default()
        }],
        ..CdiEdits::default()
    };
    let mut bad_hook = edits.clone();
    bad_hook.hooks.push(CdiHook {
        hook_name: "afterLunch".to_owned(),
        path: "/bin/true".to_owned(),
        ..CdiHook::default()
    });
    let mut bad_env = edits.clone();
    bad_env.env.push("=value".to_owned());
    let mut bad_perms = edits.clone();
    bad_perms.device_nodes[0].permissions = Some("rwx".to_owned());
    // (config, edits, the error)
    let cases: Vec<(Value, &CdiEdits, &str)> = vec![
        (json!([]), &edits, "config.json: not a JSON object (it is an array)"),
        (
            broken("/linux/devices", json!("x")),
            &edits,
            "config.json: linux.devices is not an array (it is a string)",
        ),
        (
            broken("/linux/devices/0", json!(1)),
            &edits,
            "config.json: linux.devices[0] is not an object (it is a number)",
        ),
        // the last edits written: devices, rules, env and mounts were done on the copy
        (
            broken("/hooks", json!({"createContainer": {}})),
            &edits,
            "config.json: hooks.createContainer is not an array (it is an object)",
        ),
        (
            broken("/process/env/1", json!(null)),
            &edits,
            "config.json: process.env[1] is not a string (it is null)",
        ),
        (
            broken("/mounts", json!({})),
            &edits,
            "config.json: mounts is not an array (it is an object)",
        ),
        (
            config(),
            &missing_host,
            "CDI device node /dev/gpuplex-test-absent: cannot read host node /dev/gpuplex-test-absent: ",
        ),
        (
            config(),
            &wrong_type,
            "CDI device node /dev/null: the spec says type b but host node /dev/null is of type c",
        ),
        (config(), &bad_hook, "CDI hook /bin/true: hookName \"afterLunch\" is not one of"),
        (config(), &bad_env, "CDI env entry \"=value\" is not NAME=value"),
        (config(), &bad_perms, "CDI device node /dev/nvidiactl: permissions \"rwx\""),
    ];
    for (before, edits, message) in cases {
        let mut config = before.clone();
        let err = apply(&mut config, edits).unwrap_err().to_string();
        assert!(err.starts_with(message), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert_eq!(config, before, "{message}");
    }
}

#[test]
fn apply_of_nothing_changes_nothing() {
    let mut config = json!({"process": {"args": ["sh"]}});
    apply(&mut config, &CdiEdits::default()).unwrap();
    assert_eq!(config, json!({"process": {"args": ["sh"]}}));
}

#[test]
fn nvidia_runtime_conflict_finds_nvidias_hooks_env_and_cdi_annotations() {
    let with = |pointer: &str, value: Value| {
        let mut config = json!({"process": {"env": ["PATH=/bin"]}, "hooks": {}, "annotations": {}});
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        config.pointer_mut(parent).unwrap()[key.replace("~1", "/")] = value;
        config
    };
    let hook = |path: &str, args: &[&str]| json!([{"path": path, "args": args}]);
    let legacy = "/usr/bin/nvidia-container-runtime-hook";
    // (config, what the line says was found, or None)
    let cases: Vec<(Value, Option<&str>)> = vec![
        (json!({}), None),
        (json!([]), None),
        (with("/hooks/prestart", hook("/usr/bin/gpuplex-hook", &["gpuplex-hook", "prestart"])), None),
        // NVIDIA's legacy hook acts only on NVIDIA_VISIBLE_DEVICES: alone it asks for nothing.
        (with("/hooks/prestart", hook(legacy, &["nvidia-container-runtime-hook", "prestart"])), None),
        (
            {
                let mut c = with("/hooks/prestart", hook(legacy, &["nvidia-container-runtime-hook", "prestart"]));
                c["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=all"]);
                c
            },
            Some("hooks.prestart[0] runs /usr/bin/nvidia-container-runtime-hook (NVIDIA's legacy hook) and process.env has NVIDIA_VISIBLE_DEVICES=all"),
        ),
        (
            {
                let mut c = with("/hooks/prestart", hook("/usr/bin/nvidia-container-toolkit", &["nvidia-container-toolkit", "prestart"]));
                c["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=GPU-1"]);
                c
            },
            Some("hooks.prestart[0] runs /usr/bin/nvidia-container-toolkit (NVIDIA's legacy hook) and process.env has NVIDIA_VISIBLE_DEVICES=GPU-1"),
        ),
        (
            {
                let mut c = with("/hooks/prestart", hook(legacy, &["nvidia-container-runtime-hook", "prestart"]));
                c["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=void"]);
                c
            },
            None,
        ),
        (
            with("/hooks/createContainer", hook("/usr/bin/nvidia-cdi-hook", &["nvidia-cdi-hook", "update-ldcache"])),
            Some("hooks.createContainer[0] runs /usr/bin/nvidia-cdi-hook (a hook of NVIDIA's CDI spec, already applied)"),
        ),
        (
            with("/hooks/createContainer", hook("/usr/bin/nvidia-ctk", &["nvidia-ctk", "hook", "update-ldcache"])),
            Some("hooks.createContainer[0] runs /usr/bin/nvidia-ctk (a hook of NVIDIA's CDI spec, already applied)"),
        ),
        (with("/hooks/createContainer", hook("/usr/bin/nvidia-ctk", &["nvidia-ctk", "cdi", "list"])), None),
        // A CUDA image's own ENV NVIDIA_VISIBLE_DEVICES, with no NVIDIA hook: no conflict.
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES=all"])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES=GPU-1,GPU-2"])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES=void"])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES=none"])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES="])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES"])), None),
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICESX=all"])), None),
        // the last entry is the one that counts
        (with("/process/env", json!(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"])), None),
        (
            {
                let mut c = with("/hooks/prestart", hook(legacy, &["nvidia-container-runtime-hook", "prestart"]));
                c["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=0"]);
                c
            },
            Some("hooks.prestart[0] runs /usr/bin/nvidia-container-runtime-hook (NVIDIA's legacy hook) and process.env has NVIDIA_VISIBLE_DEVICES=0"),
        ),
        (
            with("/annotations/cdi.k8s.io~1nvidia-device-plugin_uuid", json!("nvidia.com/gpu=0")),
            Some("annotation cdi.k8s.io/nvidia-device-plugin_uuid asks for CDI device nvidia.com/gpu=0"),
        ),
        (
            with("/annotations/cdi.k8s.io~1x", json!("vendor.com/nic=eth0,nvidia.com/gpu=all")),
            Some("annotation cdi.k8s.io/x asks for CDI device nvidia.com/gpu=all"),
        ),
        (with("/annotations/cdi.k8s.io~1x", json!("vendor.com/nic=eth0")), None),
        (with("/annotations/cdi.k8s.io~1x", json!("nvidia.com/gpus=0")), None),
        (with("/annotations/example.com~1x", json!("nvidia.com/gpu=0")), None),
        (with("/annotations/gpuplex.io~1gpu-memory", json!("4Gi")), None),
    ];
    for (config, found) in cases {
        let line = nvidia_runtime_conflict(&config, KIND);
        let expected = found.map(|found| {
            format!(
                "the container asks NVIDIA's runtime for GPUs as well as gpuplex: {found}; \
                 choose one: gpuplex (gpuplex.io/ annotations) or NVIDIA's runtime"
            )
        });
        assert_eq!(line, expected, "{config}");
    }
}

#[test]
fn nvidia_runtime_conflict_is_for_the_config_before_apply() {
    // the spec's own edits set NVIDIA_VISIBLE_DEVICES=void and add nvidia-cdi-hook hooks
    let mut config = json!({"process": {"env": ["PATH=/bin"]}});
    assert_eq!(nvidia_runtime_conflict(&config, KIND), None);
    apply(&mut config, &gpu0()).unwrap();
    assert!(nvidia_runtime_conflict(&config, KIND)
        .unwrap()
        .contains("nvidia-cdi-hook"));
}
