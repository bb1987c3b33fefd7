//! The spec editor on small hand-made configs: what it replaces, what it refuses, and its
//! byte entry point.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use serde_json::{json, Value};

use super::tests::{edited, fixtures, injection, one};
use super::*;

const DEVICE: &str =
    r#"{"path":"/dev/nvidia0","type":"c","major":195,"minor":0,"fileMode":438,"uid":0,"gid":0}"#;
const RULE: &str = r#"{"allow":true,"type":"c","major":195,"minor":0,"access":"rwm"}"#;
const MOUNT: &str = r#"{"destination":"/run/gpuplex/vgpu.json","type":"bind","source":"/run/gpuplex/vgpus/vgpu-1.json","options":["bind","ro","nosuid","nodev","noexec"]}"#;
const RUN_TMPFS: &str =
    r#"{"destination":"/run","type":"tmpfs","source":"tmpfs","options":["nosuid"]}"#;

fn hook(stage: &str) -> String {
    format!(r#"{{"path":"/usr/bin/gpuplex-hook","args":["/usr/bin/gpuplex-hook","{stage}"]}}"#)
}

/// What [`one`] makes of `{}`.
fn whole() -> String {
    format!(
        r#"{{"linux":{{"devices":[{DEVICE}],"resources":{{"devices":[{RULE}]}}}},
        "process":{{"env":["CUDA_VISIBLE_DEVICES=GPU-a"]}},"mounts":[{MOUNT}],
        "annotations":{{"gpuplex.io/vgpu-id":"vgpu-1"}},
        "hooks":{{"createRuntime":[{}],"poststop":[{}]}}}}"#,
        hook("createRuntime"),
        hook("poststop")
    )
}

#[test]
fn replaces_what_was_there_and_keeps_the_rest() {
    let kvm = r#"{"path":"/dev/kvm","type":"c","major":10,"minor":232}"#;
    let old = r#"{"path":"/dev/nvidia0","type":"c","major":195,"minor":9,"fileMode":8630}"#;
    let deny = r#"{"allow":false,"access":"rwm"}"#;
    let rw = r#"{"allow":true,"type":"c","major":195,"minor":0,"access":"rw"}"#;
    let timed = r#"{"path":"/usr/bin/gpuplex-hook","args":["/usr/bin/gpuplex-hook","poststop"],"timeout":5}"#;
    let old_mount = MOUNT.replace("vgpu-1.json", "vgpu-0.json");
    let whole = whole();
    // (case, config, JSON pointer, its value after the edit)
    let table: Vec<(&str, String, &str, String)> = vec![
        ("empty config", "{}".into(), "", whole.clone()),
        ("null fields", r#"{"linux":null,"process":null,"mounts":null,"annotations":null,"hooks":null}"#.into(), "", whole),
        ("device at the same path replaced in place",
            format!(r#"{{"linux":{{"devices":[{kvm},{old},{kvm}]}}}}"#), "/linux/devices", format!("[{kvm},{DEVICE},{kvm}]")),
        ("device duplicates at that path dropped",
            format!(r#"{{"linux":{{"devices":[{old},{kvm},{old}]}}}}"#), "/linux/devices", format!("[{DEVICE},{kvm}]")),
        ("allow rule appended after the others",
            format!(r#"{{"linux":{{"resources":{{"devices":[{deny},{rw}]}}}}}}"#), "/linux/resources/devices", format!("[{deny},{rw},{RULE}]")),
        ("identical allow rule not repeated",
            format!(r#"{{"linux":{{"resources":{{"devices":[{RULE},{deny}]}}}}}}"#), "/linux/resources/devices", format!("[{RULE},{deny}]")),
        ("resources without devices",
            r#"{"linux":{"resources":{"pids":{"limit":9}}}}"#.into(), "/linux/resources", format!(r#"{{"pids":{{"limit":9}},"devices":[{RULE}]}}"#)),
        ("CUDA_VISIBLE_DEVICES replaced in place, repeats dropped",
            r#"{"process":{"env":["A=1","CUDA_VISIBLE_DEVICES=all","CUDA_VISIBLE_DEVICES_X=1","CUDA_VISIBLE_DEVICES=0"]}}"#.into(),
            "/process/env", r#"["A=1","CUDA_VISIBLE_DEVICES=GPU-a","CUDA_VISIBLE_DEVICES_X=1"]"#.into()),
        ("CUDA_VISIBLE_DEVICES appended",
            r#"{"process":{"args":["sh"],"env":["PATH=/bin","TERM=xterm"]}}"#.into(),
            "/process", r#"{"args":["sh"],"env":["PATH=/bin","TERM=xterm","CUDA_VISIBLE_DEVICES=GPU-a"]}"#.into()),
        ("identity mount moved last, after a /run tmpfs",
            format!(r#"{{"mounts":[{old_mount},{RUN_TMPFS}]}}"#), "/mounts", format!("[{RUN_TMPFS},{MOUNT}]")),
        ("vgpu id overwritten, other annotations kept",
            r#"{"annotations":{"gpuplex.io/vgpu-id":"vgpu-0","gpuplex.io/gpus":"1","x":"y"}}"#.into(),
            "/annotations", r#"{"gpuplex.io/vgpu-id":"vgpu-1","gpuplex.io/gpus":"1","x":"y"}"#.into()),
        ("identical hook not repeated, a different one kept",
            format!(r#"{{"hooks":{{"poststop":[{},{timed}],"prestart":[{timed}]}}}}"#, hook("poststop")),
            "/hooks", format!(r#"{{"poststop":[{},{timed}],"prestart":[{timed}],"createRuntime":[{}]}}"#, hook("poststop"), hook("createRuntime"))),
        ("gpuplex-hook already at a stage (podman's hooks.d createRuntime) not doubled",
            r#"{"hooks":{"createRuntime":[{"path":"/usr/local/bin/gpuplex-hook","args":["gpuplex-hook","createRuntime"]}]}}"#.into(),
            "/hooks/createRuntime", r#"[{"path":"/usr/local/bin/gpuplex-hook","args":["gpuplex-hook","createRuntime"]}]"#.into()),
        ("another program at the stage, or gpuplex-hook at another stage: the hook still added",
            r#"{"hooks":{"createRuntime":[{"path":"/bin/true","args":["true","createRuntime"]},{"path":"/usr/bin/gpuplex-hook","args":["gpuplex-hook","poststop"]}]}}"#.into(),
            "/hooks/createRuntime", format!(r#"[{{"path":"/bin/true","args":["true","createRuntime"]}},{{"path":"/usr/bin/gpuplex-hook","args":["gpuplex-hook","poststop"]}},{}]"#, hook("createRuntime"))),
        ("read-only root untouched",
            r#"{"root":{"path":"rootfs","readonly":true}}"#.into(), "/root", r#"{"path":"rootfs","readonly":true}"#.into()),
    ];
    for (case, config, pointer, expected) in table {
        let config: Value = serde_json::from_str(&config).unwrap();
        let expected: Value = serde_json::from_str(&expected).unwrap();
        let out = edited(&config, &one());
        assert_eq!(out.pointer(pointer), Some(&expected), "{case}");
    }
}

#[test]
fn refuses_a_config_it_cannot_edit_and_leaves_it_unchanged() {
    let table = [
        ("[]", "config.json: not a JSON object (it is an array)"),
        (r#""x""#, "config.json: not a JSON object (it is a string)"),
        (
            r#"{"linux":[]}"#,
            "config.json: linux is not an object (it is an array)",
        ),
        (
            r#"{"linux":{"devices":{}}}"#,
            "config.json: linux.devices is not an array (it is an object)",
        ),
        (
            r#"{"linux":{"devices":["/dev/nvidia0"]}}"#,
            "config.json: linux.devices[0] is not an object (it is a string)",
        ),
        (
            r#"{"linux":{"resources":5}}"#,
            "config.json: linux.resources is not an object (it is a number)",
        ),
        (
            r#"{"linux":{"resources":{"devices":"c 195:0 rwm"}}}"#,
            "config.json: linux.resources.devices is not an array (it is a string)",
        ),
        (
            r#"{"process":true}"#,
            "config.json: process is not an object (it is a boolean)",
        ),
        (
            r#"{"process":{"env":"A=1"}}"#,
            "config.json: process.env is not an array (it is a string)",
        ),
        (
            r#"{"process":{"env":["A=1",3]}}"#,
            "config.json: process.env[1] is not a string (it is a number)",
        ),
        (
            r#"{"mounts":{}}"#,
            "config.json: mounts is not an array (it is an object)",
        ),
        (
            r#"{"mounts":[{"destination":"/proc"},null]}"#,
            "config.json: mounts[1] is not an object (it is null)",
        ),
        (
            r#"{"annotations":[]}"#,
            "config.json: annotations is not an object (it is an array)",
        ),
        (
            r#"{"hooks":[]}"#,
            "config.json: hooks is not an object (it is an array)",
        ),
        (
            r#"{"process":{"env":["A=1"]},"hooks":{"poststop":{}}}"#,
            "config.json: hooks.poststop is not an array (it is an object)",
        ),
    ];
    for (config, message) in table {
        let mut value: Value = serde_json::from_str(config).unwrap();
        assert_eq!(
            edit(&mut value, &one()).unwrap_err().to_string(),
            message,
            "{config}"
        );
        assert_eq!(
            value,
            serde_json::from_str::<Value>(config).unwrap(),
            "changed: {config}"
        );
        let bytes = edit_bytes(config.as_bytes(), &one())
            .unwrap_err()
            .to_string();
        assert_eq!(bytes, message, "{config}");
    }
    for text in ["", "{", "not json", r#"{"a":1}x"#] {
        let message = edit_bytes(text.as_bytes(), &one()).unwrap_err().to_string();
        assert!(
            message.starts_with("config.json: not valid JSON: "),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message}");
    }
}

#[test]
fn refuses_an_injection_it_cannot_write() {
    // What the node service's reply cannot give is refused by `vgpu_edits` (the wire crate's
    // tests); what is left is the hook's path and edits CDI does not allow.
    type Change = fn(&mut Injection);
    let table: [(Change, &str); 4] = [
        (|i| i.hook.as_mut().unwrap().path = "gpuplex-hook".into(), "gpuplex injection: hook path gpuplex-hook must be an absolute UTF-8 path"),
        (|i| i.hook.as_mut().unwrap().path = PathBuf::from(OsStr::from_bytes(b"/usr/bin/\xff")), "gpuplex injection: hook path /usr/bin/\u{fffd} must be an absolute UTF-8 path"),
        (|i| i.edits.device_nodes[0].permissions = Some("rwx".into()), "CDI device node /dev/nvidia0: permissions \"rwx\" are not made of r, w and m (or none)"),
        (|i| i.edits.env.insert(0, "=x".into()), "CDI env entry \"=x\" is not NAME=value with a non-empty name"),
    ];
    for (change, message) in table {
        let mut inj = one();
        change(&mut inj);
        let mut config = json!({"process": {"env": ["A=1"]}});
        assert_eq!(edit(&mut config, &inj).unwrap_err().to_string(), message);
        assert_eq!(config, json!({"process": {"env": ["A=1"]}}), "{message}");
    }
}

#[test]
fn edit_bytes_prints_the_edited_config_on_one_line() {
    for (name, input) in fixtures() {
        let bytes = edit_bytes(input.to_string().as_bytes(), &injection()).unwrap();
        assert!(!bytes.contains(&b'\n'), "{name}");
        let printed: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(printed, edited(&input, &injection()), "{name}");
    }
}

#[test]
fn gpuplex_annotations_picks_the_gpuplex_keys() {
    let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let table = [
        (json!({}), map(&[])),
        (json!([]), map(&[])),
        (json!({"annotations": null}), map(&[])),
        (json!({"annotations": ["gpuplex.io/gpus"]}), map(&[])),
        (
            json!({"annotations": {"io.container.manager": "libpod", "gpuplex.io": "1"}}),
            map(&[]),
        ),
        (
            json!({"annotations": {"gpuplex.io/gpus": "2", "x": "y", "gpuplex.io/weight": 3, "gpuplex.io/vgpu-id": "vgpu-1"}}),
            map(&[("gpuplex.io/gpus", "2"), ("gpuplex.io/vgpu-id", "vgpu-1")]),
        ),
    ];
    for (config, expected) in table {
        assert_eq!(gpuplex_annotations(&config), expected, "{config}");
    }
    let expected = [
        map(&[]),
        map(&[]),
        map(&[("gpuplex.io/gpu-memory", "8Gi"), ("gpuplex.io/gpus", "1")]),
        map(&[("gpuplex.io/gpus", "1")]),
    ];
    for ((name, config), expected) in fixtures().zip(expected) {
        assert_eq!(gpuplex_annotations(&config), expected, "{name}");
    }
}
