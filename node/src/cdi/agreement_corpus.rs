//! The specs `agreement_tests.rs` gives gpuplex's reader and the reference crate's: valid ones
//! (an nvidia-ctk-like spec, minimal ones of each version, each field at the version that
//! brought it) and invalid ones (one fault each: syntax, unknown and missing fields, types,
//! names, versions, edits, annotations).

use serde_json::{json, Value};

/// One spec of the corpus.
pub struct Case {
    /// What it is, for failures.
    pub name: String,
    /// Its text.
    pub text: Text,
    /// Whether it is a valid spec.
    pub valid: bool,
}

/// A spec's text.
pub enum Text {
    /// As written (YAML, JSON, or neither).
    Raw(String),
    /// Built as JSON, given both as JSON and as YAML.
    Built(Value),
}

const KIND: &str = "vendor.com/device";

/// A spec of `version` and `kind` with these devices.
fn spec(version: &str, kind: &str, devices: Value) -> Value {
    json!({"cdiVersion": version, "kind": kind, "devices": devices})
}

/// A spec of `version` with one device `gpu0` whose edits are `edits`, and `spec_wide` edits
/// when given.
fn one_device(version: &str, edits: Value, spec_wide: Option<Value>) -> Value {
    let mut spec = spec(
        version,
        KIND,
        json!([{"name": "gpu0", "containerEdits": edits}]),
    );
    if let Some(spec_wide) = spec_wide {
        spec["containerEdits"] = spec_wide;
    }
    spec
}

/// A spec of `version` with the device `name` (edits: one env entry).
fn named(version: &str, name: &str) -> Value {
    spec(
        version,
        KIND,
        json!([{"name": name, "containerEdits": {"env": ["A=1"]}}]),
    )
}

/// A spec of `version` and `kind` with one device `x` (edits: one env entry).
fn of_kind(version: &str, kind: &str) -> Value {
    let mut spec = named(version, "x");
    spec["kind"] = json!(kind);
    spec
}

/// A spec of `version` with annotations on the spec, or on its device `x`.
fn annotated(version: &str, annotations: Value, on_device: bool) -> Value {
    let mut spec = named(version, "x");
    match on_device {
        true => spec["devices"][0]["annotations"] = annotations,
        false => spec["annotations"] = annotations,
    }
    spec
}

/// An nvidia-ctk-like spec: spec-wide edits (control nodes, libraries, hooks), then devices by
/// index, by UUID, a MIG device and `all`.
fn nvidia_ctk_like() -> Value {
    let hook = |args: &[&str]| {
        let mut argv = vec!["nvidia-cdi-hook"];
        argv.extend_from_slice(args);
        json!({"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
               "args": argv, "env": ["NVIDIA_CTK_DEBUG=false"]})
    };
    let bind = |path: &str| {
        json!({"hostPath": path, "containerPath": path,
               "options": ["ro", "nosuid", "nodev", "bind"]})
    };
    let gpu = |index: u32| {
        json!({"deviceNodes": [
            {"path": format!("/dev/nvidia{index}")},
            {"path": format!("/dev/dri/card{}", index + 1)},
            {"path": format!("/dev/dri/renderD{}", 128 + index)},
        ], "hooks": [hook(&["create-symlinks", "--link",
                            &format!("../card{}::/dev/dri/by-path/pci-0000:0{index}:00.0-card", index + 1)]),
                     hook(&["chmod", "--mode", "755", "--path", "/dev/dri"])]})
    };
    let uuid0 = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c";
    let uuid1 = "GPU-b0a2c1e4-9f3d-11ee-8c90-0242ac120002";
    json!({
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidia-modeset"}, {"path": "/dev/nvidia-uvm"},
                            {"path": "/dev/nvidia-uvm-tools"}, {"path": "/dev/nvidiactl"}],
            "hooks": [hook(&["create-symlinks", "--link",
                             "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"]),
                      hook(&["update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"])],
            "mounts": [bind("/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15"),
                       bind("/usr/bin/nvidia-smi"),
                       {"hostPath": "/run/nvidia-persistenced/socket",
                        "containerPath": "/run/nvidia-persistenced/socket",
                        "options": ["ro", "nosuid", "nodev", "bind", "noexec"]}],
        },
        "devices": [
            {"name": "0", "containerEdits": gpu(0)},
            {"name": uuid0, "containerEdits": gpu(0)},
            {"name": "1", "containerEdits": gpu(1)},
            {"name": uuid1, "containerEdits": gpu(1)},
            {"name": "1:0", "containerEdits": {"deviceNodes": [
                {"path": "/dev/nvidia1"}, {"path": "/dev/nvidia-caps/nvidia-cap21"}]}},
            {"name": "all", "containerEdits": {"deviceNodes": [
                {"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]}},
        ],
    })
}

/// Texts as written: YAML's own forms, and texts that are no spec. `{S}` stands for the lines
/// `cdiVersion: 0.3.0` and `kind: vendor.com/device`, `{D}` for a device `gpu0` with one env
/// entry.
#[rustfmt::skip]
const RAW: &[(&str, &str, bool)] = &[
    ("comments and markers", "# a spec\n---\n{S}{D}...\n", true),
    ("quoted scalars", "cdiVersion: \"0.3.0\"\nkind: 'vendor.com/device'\n{D}", true),
    ("flow style", "{cdiVersion: 0.3.0, kind: vendor.com/device, devices: [{name: gpu0, containerEdits: {env: [A=1]}}]}", true),
    ("a plain number as device name", "cdiVersion: 0.5.0\nkind: vendor.com/device\ndevices:\n- name: 0\n  containerEdits: {env: [A=1]}\n", true),
    ("null spec-wide edits", "{S}containerEdits: null\n{D}", true),
    ("null and ~ edits fields", "{S}containerEdits:\n  env: ~\n  mounts: null\n{D}", true),
    ("anchors and aliases", "{S}containerEdits: &edits\n  env: [A=1]\ndevices:\n- name: gpu0\n  containerEdits: *edits\n", true),
    ("empty annotations", "{S}annotations: {}\n{D}", true),
    ("a JSON escape", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=\u00e9"]}}]}"#, true),
    ("not YAML", "cdiVersion: [not a spec\n", false),
    ("truncated JSON", "{\"cdiVersion\": \"0.5.0\",", false),
    ("empty file", "", false),
    ("a list", "- a\n- list\n", false),
    ("a scalar", "just words\n", false),
    ("two documents", "{S}{D}---\n{S}{D}", false),
    ("a key twice", "{S}kind: other.com/device\n{D}", false),
    ("tab indentation", "{S}devices:\n-\tname: gpu0\n", false),
    ("null devices", "{S}devices: null\n", false),
    ("null device edits", "{S}devices:\n- name: gpu0\n  containerEdits: null\n", false),
    ("null annotations", "{S}annotations: null\n{D}", false),
    ("a device without its edits", "{S}devices:\n- name: gpu0\n", false),
];

/// Specs of one device `gpu0`: what, cdiVersion, the device's `containerEdits` as JSON, valid.
#[rustfmt::skip]
const ONE_DEVICE: &[(&str, &str, &str, bool)] = &[
    // fields at the version that brought them, and each value a field may have
    ("env forms", "0.3.0", r#"{"env": ["A=", "A==b", "PATH=/a:/b", "a b=c"]}"#, true),
    ("a mount type at 0.4.0", "0.4.0", r#"{"mounts": [{"hostPath": "tmpfs", "containerPath": "/tmp", "type": "tmpfs", "options": ["nosuid"]}]}"#, true),
    ("an empty mount type at 0.3.0", "0.3.0", r#"{"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": ""}]}"#, true),
    ("relative mount paths", "0.3.0", r#"{"mounts": [{"hostPath": "source", "containerPath": "destination"}]}"#, true),
    ("a hostPath at 0.5.0", "0.5.0", r#"{"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}"#, true),
    ("an empty hostPath at 0.3.0", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "hostPath": ""}]}"#, true),
    ("a device node's every field", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": "c", "major": 195, "minor": -1, "fileMode": 438, "permissions": "rw", "uid": 0, "gid": 4294967295}]}"#, true),
    ("node type u", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": "u"}]}"#, true),
    ("node type p", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": "p"}]}"#, true),
    ("empty node type", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": ""}]}"#, true),
    ("permissions none", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "permissions": "none"}]}"#, true),
    ("empty permissions", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "permissions": ""}]}"#, true),
    ("repeated permissions", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "permissions": "mmrw"}]}"#, true),
    ("hooks of each stage", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "timeout": 0}, {"hookName": "createRuntime", "path": "/bin/true", "timeout": 4294967295}, {"hookName": "createContainer", "path": "/bin/true", "args": ["true", ""], "env": ["A=1", "B="]}, {"hookName": "startContainer", "path": "/bin/true", "timeout": null}, {"hookName": "poststart", "path": "/bin/true"}, {"hookName": "poststop", "path": "/bin/true"}]}"#, true),
    ("additionalGids at 0.7.0", "0.7.0", r#"{"additionalGids": [0, 44, 4294967295]}"#, true),
    ("intelRdt at 0.7.0", "0.7.0", r#"{"intelRdt": {"closID": "gpuplex", "l3CacheSchema": "L3:0=ff", "memBwSchema": "MB:0=50"}}"#, true),
    ("an empty intelRdt alone at 0.7.0", "0.7.0", r#"{"intelRdt": {}}"#, true),
    ("enableCMT and enableMBM at 1.0.0", "1.0.0", r#"{"intelRdt": {"enableCMT": true, "enableMBM": false}}"#, true),
    ("netDevices at 1.1.0", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "eth0", "name": "eth1"}, {"hostInterfaceName": "eth1", "name": "eth0"}]}"#, true),
    ("schemata and enableMonitoring at 1.1.0", "1.1.0", r#"{"intelRdt": {"schemata": ["L3:0=ffff"], "enableMonitoring": true}}"#, true),
    // device edits must not be empty
    ("empty device edits", "0.3.0", r#"{}"#, false),
    ("device edits of empty lists", "0.3.0", r#"{"env": [], "deviceNodes": [], "mounts": [], "hooks": []}"#, false),
    ("device edits of empty additionalGids", "0.7.0", r#"{"additionalGids": []}"#, false),
    ("device edits of empty netDevices", "1.1.0", r#"{"netDevices": []}"#, false),
    // unknown fields
    ("unknown edits field", "0.3.0", r#"{"env": ["A=1"], "foo": []}"#, false),
    ("additionalGIDs spelt as in SPEC.md's prose", "0.7.0", r#"{"additionalGIDs": [1]}"#, false),
    ("unknown device node field", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "foo": 1}]}"#, false),
    ("unknown mount field", "0.3.0", r#"{"mounts": [{"hostPath": "/a", "containerPath": "/b", "foo": 1}]}"#, false),
    ("unknown hook field", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "foo": 1}]}"#, false),
    ("unknown intelRdt field", "0.7.0", r#"{"intelRdt": {"closID": "x", "foo": 1}}"#, false),
    ("closId spelt camelCase", "0.7.0", r#"{"intelRdt": {"closId": "x"}}"#, false),
    ("unknown netDevice field", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "a", "name": "b", "foo": 1}]}"#, false),
    // missing fields, wrong types
    ("a device node without a path", "0.3.0", r#"{"deviceNodes": [{"type": "c"}]}"#, false),
    ("a mount without containerPath", "0.3.0", r#"{"mounts": [{"hostPath": "/a"}]}"#, false),
    ("a mount without hostPath", "0.3.0", r#"{"mounts": [{"containerPath": "/a"}]}"#, false),
    ("a hook without hookName", "0.3.0", r#"{"hooks": [{"path": "/bin/true"}]}"#, false),
    ("a hook without path", "0.3.0", r#"{"hooks": [{"hookName": "prestart"}]}"#, false),
    ("a netDevice without name", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "a"}]}"#, false),
    ("env a string", "0.3.0", r#"{"env": "A=1"}"#, false),
    ("an env entry a list", "0.3.0", r#"{"env": [["A=1"]]}"#, false),
    ("major a string", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "major": "x"}]}"#, false),
    ("a negative uid", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "uid": -1}]}"#, false),
    ("a gid past u32", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "gid": 4294967296}]}"#, false),
    ("a negative fileMode", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "fileMode": -1}]}"#, false),
    ("a negative additional gid", "0.7.0", r#"{"additionalGids": [-1]}"#, false),
    ("a timeout string", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "timeout": "5s"}]}"#, false),
    ("enableMonitoring a string", "1.1.0", r#"{"intelRdt": {"enableMonitoring": "yes"}}"#, false),
    // fields before the version that brought them, or after the one that dropped them
    ("a mount type at 0.3.0", "0.3.0", r#"{"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]}"#, false),
    ("a hostPath at 0.4.0", "0.4.0", r#"{"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}"#, false),
    ("additionalGids at 0.6.0", "0.6.0", r#"{"additionalGids": [1]}"#, false),
    ("intelRdt at 0.6.0", "0.6.0", r#"{"intelRdt": {"closID": "x"}}"#, false),
    ("netDevices at 1.0.0", "1.0.0", r#"{"netDevices": [{"hostInterfaceName": "a", "name": "b"}]}"#, false),
    ("schemata at 1.0.0", "1.0.0", r#"{"intelRdt": {"schemata": []}}"#, false),
    ("enableMonitoring at 1.0.0", "1.0.0", r#"{"intelRdt": {"enableMonitoring": false}}"#, false),
    ("enableCMT at 1.1.0", "1.1.0", r#"{"intelRdt": {"enableCMT": true}}"#, false),
    // values no field may have
    ("env without =", "0.3.0", r#"{"env": ["NOEQUALS"]}"#, false),
    ("env without a name", "0.3.0", r#"{"env": ["=x"]}"#, false),
    ("an empty env entry", "0.3.0", r#"{"env": ["A=1", ""]}"#, false),
    ("a device node with an empty path", "0.3.0", r#"{"deviceNodes": [{"path": ""}]}"#, false),
    ("a device node type x", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": "x"}]}"#, false),
    ("a device node type C", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "type": "C"}]}"#, false),
    ("permissions rwx", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "permissions": "rwx"}]}"#, false),
    ("permissions R", "0.3.0", r#"{"deviceNodes": [{"path": "/dev/x", "permissions": "R"}]}"#, false),
    ("a mount with an empty hostPath", "0.3.0", r#"{"mounts": [{"hostPath": "", "containerPath": "/b"}]}"#, false),
    ("a mount with an empty containerPath", "0.3.0", r#"{"mounts": [{"hostPath": "/a", "containerPath": ""}]}"#, false),
    ("a hook name nope", "0.3.0", r#"{"hooks": [{"hookName": "nope", "path": "/bin/true"}]}"#, false),
    ("a hook name Prestart", "0.3.0", r#"{"hooks": [{"hookName": "Prestart", "path": "/bin/true"}]}"#, false),
    ("a hook with an empty path", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": ""}]}"#, false),
    ("a hook env without =", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "env": ["X"]}]}"#, false),
    ("a negative hook timeout", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "timeout": -1}]}"#, false),
    ("a hook timeout past u32", "0.3.0", r#"{"hooks": [{"hookName": "prestart", "path": "/bin/true", "timeout": 4294967296}]}"#, false),
    ("netDevices without hostInterfaceName", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "", "name": "b"}]}"#, false),
    ("netDevices without name", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "a", "name": ""}]}"#, false),
    ("netDevices with a host interface twice", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "a", "name": "b"}, {"hostInterfaceName": "a", "name": "c"}]}"#, false),
    ("netDevices with a name twice", "1.1.0", r#"{"netDevices": [{"hostInterfaceName": "a", "name": "b"}, {"hostInterfaceName": "c", "name": "b"}]}"#, false),
];

/// Specs of one device `gpu0` (one env entry) with spec-wide edits: what, cdiVersion, the
/// spec-wide `containerEdits` as JSON, valid.
#[rustfmt::skip]
const SPEC_WIDE: &[(&str, &str, &str, bool)] = &[
    ("empty spec-wide edits", "0.3.0", r#"{}"#, true),
    ("empty spec-wide additionalGids at 0.3.0", "0.3.0", r#"{"additionalGids": []}"#, true),
    ("empty spec-wide netDevices at 1.0.0", "1.0.0", r#"{"netDevices": []}"#, true),
    ("spec-wide additionalGids at 0.6.0", "0.6.0", r#"{"additionalGids": [1]}"#, false),
    ("spec-wide enableMBM at 1.1.0", "1.1.0", r#"{"intelRdt": {"enableMBM": false}}"#, false),
    ("spec-wide env without =", "0.3.0", r#"{"env": ["X"]}"#, false),
    ("a spec-wide hook name nope", "0.3.0", r#"{"hooks": [{"hookName": "nope", "path": "/bin/true"}]}"#, false),
];

/// Whole specs: what, the spec as JSON, valid.
#[rustfmt::skip]
const WHOLE: &[(&str, &str, bool)] = &[
    ("device names", r#"{"cdiVersion": "0.5.0", "kind": "vendor.com/device", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}, {"name": "0", "containerEdits": {"env": ["A=1"]}}, {"name": "mig-1:0", "containerEdits": {"env": ["A=1"]}}, {"name": "a.b_c-d", "containerEdits": {"env": ["A=1"]}}, {"name": "GPU-ABC", "containerEdits": {"env": ["A=1"]}}]}"#, true),
    ("no devices", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": []}"#, false),
    ("a device named twice", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=1"]}}, {"name": "gpu0", "containerEdits": {"env": ["B=1"]}}]}"#, false),
    ("unknown top-level field", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "foo": 1, "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("unknown device field", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [{"name": "x", "foo": 1, "containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("no cdiVersion", r#"{"kind": "vendor.com/device", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("no kind", r#"{"cdiVersion": "0.3.0", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("no devices field", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device"}"#, false),
    ("a device without a name", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [{"containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("a device without edits", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": [{"name": "x"}]}"#, false),
    ("devices a string", r#"{"cdiVersion": "0.3.0", "kind": "vendor.com/device", "devices": "gpu0"}"#, false),
    ("cdiVersion a list", r#"{"cdiVersion": ["0.3.0"], "kind": "vendor.com/device", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}"#, false),
    ("an annotation value a list", r#"{"cdiVersion": "0.6.0", "kind": "vendor.com/device", "annotations": {"a": ["b"]}, "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}"#, false),
];

/// Kinds: valid (at 0.6.0, for the dotted class), invalid.
#[rustfmt::skip]
const KINDS: [(&[&str], bool); 2] = [
    (&["a/b", "ven-dor_1.com/cl_a-ss1", "vendor.com/gpu.v2", "Vendor/GPU"], true),
    (&["nvidia.com", "nvidia.com/", "/gpu", "a/b/c", "0vendor/gpu", "vendor./gpu", "vendor/gpu-",
       "vendor/g pu", "vendor/1gpu", "ven/dor=x", "véndor/gpu", ""], false),
];

/// Device names: valid (at 0.5.0), invalid.
#[rustfmt::skip]
const DEVICE_NAMES: [(&[&str], bool); 2] = [
    (&["x", "0", "all", "1:0", "a.b_c-d", "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c", "Z9"], true),
    (&["bad name!", "_x", "x_", "", "gpu/0", "é", "a=b", "x y", "-"], false),
];

/// `cdiVersion` values: valid, invalid (unknown, or no longer read).
#[rustfmt::skip]
const VERSIONS: [(&[&str], bool); 2] = [
    (&["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0", "v0.3.0", "v1.1.0"], true),
    (&["9.9.9", "1.2.0", "0.1.0", "0.2.0", "", "1.0", "1.0.0-rc1", "v", "V1.0.0", " 1.0.0"], false),
];

/// Specs whose version is too low for a name or annotations: what, the spec.
fn too_low() -> Vec<(&'static str, Value)> {
    vec![
        ("a digit name at 0.4.0", named("0.4.0", "0")),
        (
            "a dotted class at 0.5.0",
            of_kind("0.5.0", "vendor.com/gpu.v2"),
        ),
        (
            "spec annotations at 0.5.0",
            annotated("0.5.0", json!({"a": "b"}), false),
        ),
        (
            "device annotations at 0.5.0",
            annotated("0.5.0", json!({"a": "b"}), true),
        ),
    ]
}

/// Annotation keys: valid (at 0.6.0), invalid; and the longest allowed and one longer, of
/// the name and of the prefix.
#[rustfmt::skip]
const ANNOTATION_KEYS: [(&[&str], bool); 2] = [
    (&["cdi.k8s.io/vfio17", "Example.COM/Some_Key.1", "a", "1-2.3/4", "\u{212A}ey"], true),
    (&["inva$$lid", "a/b/c", "/name", "Bad_Prefix/name", "prefix./x", "", "-x", "x-", "a/",
       "pre..fix/x", "é"], false),
];

/// Intel RDT classes of service (at 0.7.0): valid, invalid; and the longest allowed and one
/// longer.
#[rustfmt::skip]
const CLOS_IDS: [(&[&str], bool); 2] = [
    (&["gpuplex", "a.b", "..."], true),
    (&[".", "..", "a/b", "a\nb"], false),
];

/// JSON text of the tables as a value.
fn parsed(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|err| panic!("corpus JSON {text}: {err}"))
}

/// The texts of [`RAW`] and the fixture.
fn raw_cases() -> Vec<Case> {
    let spec_lines = format!("cdiVersion: 0.3.0\nkind: {KIND}\n");
    let device_lines = "devices:\n- name: gpu0\n  containerEdits:\n    env: [A=1]\n";
    let fixture = ("the fixture", include_str!("fixtures/nvidia.yaml"), true);
    let all = std::iter::once(&fixture).chain(RAW);
    all.map(|&(name, text, valid)| Case {
        name: name.to_owned(),
        text: Text::Raw(
            text.replace("{S}", &spec_lines)
                .replace("{D}", device_lines),
        ),
        valid,
    })
    .collect()
}

/// The whole corpus.
pub fn corpus() -> Vec<Case> {
    let mut cases = raw_cases();
    let mut add = |name: String, spec: Value, valid: bool| {
        let text = Text::Built(spec);
        cases.push(Case { name, text, valid });
    };
    add("nvidia-ctk-like".to_owned(), nvidia_ctk_like(), true);
    let env = || json!({"env": ["A=1"]});
    for &(name, version, edits, valid) in ONE_DEVICE {
        add(
            name.to_owned(),
            one_device(version, parsed(edits), None),
            valid,
        );
    }
    for &(name, version, edits, valid) in SPEC_WIDE {
        let spec = one_device(version, env(), Some(parsed(edits)));
        add(name.to_owned(), spec, valid);
    }
    for &(name, text, valid) in WHOLE {
        add(name.to_owned(), parsed(text), valid);
    }
    for (name, spec) in too_low() {
        add(name.to_owned(), spec, false);
    }
    for (kinds, valid) in KINDS {
        for kind in kinds {
            add(format!("kind {kind:?}"), of_kind("0.6.0", kind), valid);
        }
    }
    for (names, valid) in DEVICE_NAMES {
        for name in names {
            add(format!("device {name:?}"), named("0.5.0", name), valid);
        }
    }
    for (versions, valid) in VERSIONS {
        for version in versions {
            let spec = one_device(version, env(), None);
            add(format!("cdiVersion {version:?}"), spec, valid);
        }
    }
    let long_keys = [
        ("x".repeat(63), true),
        ("x".repeat(64), false),
        (format!("{}/k", "a".repeat(253)), true),
        (format!("{}/k", "a".repeat(254)), false),
    ];
    let keys = ANNOTATION_KEYS
        .iter()
        .flat_map(|&(keys, valid)| keys.iter().map(move |key| ((*key).to_owned(), valid)));
    for (key, valid) in keys.chain(long_keys) {
        for on_device in [false, true] {
            let spec = annotated("0.6.0", json!({key.clone(): "v"}), on_device);
            add(format!("annotation key {key:?}"), spec, valid);
        }
    }
    let limit = 256 * 1024;
    for (size, valid) in [(limit, true), (limit + 1, false)] {
        let spec = annotated("0.6.0", json!({"k": "v".repeat(size - 1)}), false);
        add(format!("annotations of {size} bytes"), spec, valid);
    }
    let ids = CLOS_IDS
        .iter()
        .flat_map(|&(ids, valid)| ids.iter().map(move |id| ((*id).to_owned(), valid)));
    let long_ids = [("c".repeat(4095), true), ("c".repeat(4096), false)];
    for (id, valid) in ids.chain(long_ids) {
        let spec = one_device("0.7.0", json!({"intelRdt": {"closID": id}}), None);
        add(format!("closID {id:.20?}"), spec, valid);
    }
    cases
}
