//! The body of each fuzz target, one `pub fn(&[u8])` per target, named as the target.
//!
//! One definition, two users: the cargo-fuzz targets (`fuzz/fuzz_targets/`, nightly) and the
//! main workspace's `tests/tests/fuzz_regressions.rs` (stable), which includes this file with
//! `#[path]` and replays every file of `fuzz/regressions/<target>/` through the same function.
//! So this file uses only what both crates depend on: the gpuplex crates (scheduler, client,
//! hook, shim), `serde_json`, `toml` and `tempfile`.
//!
//! Every body holds, for any input: nothing panics, and every error's `Display` is one line
//! (ARCHITECTURE.md, "nothing panics on input"). A panic here, an assertion's included, is a
//! finding. Beyond that, each checks what the code's documentation promises of the value it
//! returns (noted at each function).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_hook::spec::{self, HookCommand, Injection};
use gpuplex_node::service::fixture;
use gpuplex_scheduler::config::SchedulerConfig;
use gpuplex_scheduler::policy::PolicyConfig;
use gpuplex_scheduler::quantity::{format_bytes, parse_quantity};
use gpuplex_scheduler::request::{
    GpuMemory, Priority, VgpuRequest, GPU_MEMORY, MAX_GPUS, MAX_WEIGHT, POD_NAMESPACE_KEYS, PREFIX,
};
use gpuplex_scheduler::time::{format_duration, parse_duration};
use gpuplex_scheduler::{Handle, VgpuId};
use gpuplex_wire::protocol::{parse_request, AssignedGpu, DeviceNode, Reply, VgpuReply};
use gpuplex_wire::vgpu_edits::vgpu_edits;
use serde_json::Value;

/// A target's body.
pub type Body = fn(&[u8]);

/// The targets, as named in `fuzz/Cargo.toml`, each with its body.
pub const TARGETS: [(&str, Body); 5] = [
    ("annotations", annotations),
    ("request_line", request_line),
    ("state_file", state_file),
    ("gpuplex_toml", gpuplex_toml),
    ("oci_state", oci_state),
];

/// Panics unless `message` is one line: no `\n`, no `\r`.
fn one_line(what: &str, message: impl std::fmt::Display) {
    let message = message.to_string();
    assert!(
        !message.contains(['\n', '\r']),
        "{what}: the error is not one line: {message:?}"
    );
}

/// The input as text: invalid UTF-8 replaced.
fn text_of(data: &[u8]) -> String {
    String::from_utf8_lossy(data).into_owned()
}

/// The annotations the `annotations` target reads from its bytes: records separated by `0xFF`,
/// each a key and a value separated by its first `0xFE` (a record without one is a key with an
/// empty value), each read as UTF-8 with invalid sequences replaced; at most 32 records. Neither
/// byte occurs in UTF-8, so every pair of strings can be written, `\n` and all.
pub fn decode_annotations(data: &[u8]) -> Vec<(String, String)> {
    data.split(|&b| b == 0xFF)
        .take(32)
        .map(|record| match record.iter().position(|&b| b == 0xFE) {
            Some(at) => (text_of(&record[..at]), text_of(&record[at + 1..])),
            None => (text_of(record), String::new()),
        })
        .collect()
}

/// `annotations`: a container's annotations to `VgpuRequest::from_annotations` (and a request
/// read to the default `[policy]`'s `admit`, from the pod namespace among them, if any), and
/// each value (and the whole input) to `parse_quantity`.
///
/// Also held: no `gpuplex.io/` key means no request (`Ok(None)`), and a request only when
/// there is one; an error names one of the `gpuplex.io/` keys given; a request's numbers are in
/// their documented ranges and its memory is what `parse_quantity` reads of the (trimmed) value;
/// a quantity read is at least 1 byte.
pub fn annotations(data: &[u8]) {
    let pairs = decode_annotations(data);
    // A key given twice counts with its last value.
    let ours: BTreeMap<&str, &str> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .filter(|(k, _)| k.starts_with(PREFIX))
        .collect();
    let result = VgpuRequest::from_annotations(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    match result {
        Ok(None) => assert!(ours.is_empty(), "gpuplex.io/ annotations, yet no request"),
        Ok(Some(request)) => {
            assert!(
                !ours.is_empty(),
                "a request without a gpuplex.io/ annotation"
            );
            assert!((1..=MAX_GPUS).contains(&request.gpus), "{request:?}");
            assert!((1..=MAX_WEIGHT).contains(&request.weight), "{request:?}");
            match ours.get(GPU_MEMORY) {
                Some(value) => {
                    let bytes = parse_quantity(value.trim()).expect("the request read it");
                    assert_eq!(request.memory, GpuMemory::Bytes(bytes));
                }
                None => assert_eq!(request.memory, GpuMemory::WholeGpu),
            }
            for (_, value) in &pairs {
                request.accepts_model(value);
            }
            let namespace = pairs
                .iter()
                .rev()
                .find(|(k, _)| POD_NAMESPACE_KEYS.contains(&k.as_str()))
                .map(|(_, v)| v.as_str());
            if let Err(e) = PolicyConfig::default().admit(&request, namespace) {
                one_line("PolicyConfig::admit", e);
            }
        }
        Err(e) => {
            one_line("from_annotations", &e);
            assert!(
                ours.contains_key(e.annotation.as_str()),
                "the error names {:?}, not one of the annotations given",
                e.annotation
            );
        }
    }
    let whole = text_of(data);
    for text in pairs
        .iter()
        .map(|(_, v)| v.as_str())
        .chain([whole.as_str()])
    {
        match parse_quantity(text) {
            Ok(bytes) => {
                assert!(bytes >= 1, "{text:?} read as 0 bytes");
                format_bytes(bytes);
            }
            Err(e) => one_line("parse_quantity", e),
        }
    }
}

/// `request_line`: the input to `protocol::parse_request` as one line; then split into lines
/// (at most 64), as the node socket reads them, each parsed and carried out by the node
/// service's own dispatcher (`Service::handle`) on a service of fixtures
/// (`gpuplex_node::service::fixture`: one fake GPU, a temporary state directory, fixture
/// cgroups). The n-th reservation's handle is `n` in each of its 16 bytes: `0101…01` for the
/// first, so an input can attach what it reserved.
///
/// Also held: a reply is one line of JSON that reads back as itself, and an error reply says why
/// in one line.
pub fn request_line(data: &[u8]) {
    if let Err(e) = parse_request(data) {
        one_line("parse_request", e);
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut service = fixture::service(dir.path()).expect("the fixture service");
    for line in data.split(|&b| b == b'\n').take(64) {
        let request = match parse_request(line) {
            Ok(request) => request,
            Err(e) => {
                one_line("parse_request", e);
                continue;
            }
        };
        let reply = service.handle(request);
        if let Some(why) = reply.refusal() {
            one_line("Service::handle", why);
        }
        let text = reply.to_line();
        assert!(
            text.ends_with('\n') && text.matches('\n').count() == 1,
            "a reply of more than one line: {text:?}"
        );
        let back: Reply = serde_json::from_str(&text).expect("a reply reads back");
        assert_eq!(back, reply, "a reply reads back as itself");
    }
}

/// `state_file`: the input as the file of a vGPU in a fresh state directory (`vgpu-1.json`),
/// then `StateDir::load` and `load_accounting`; then as `accounting.json` in another; then as
/// the list of frozen cgroups (`frozen.json`, `load_frozen`) in a third.
///
/// Also held: the record is either loaded (and saving it again and loading gives the same
/// record) or reported in one line in `unreadable` and set aside with its bytes, never dropped
/// silently; `accounting.json` and `frozen.json` are never read as records; read accounting
/// saves and reads back the same (floats to within rounding), with the file left as it was; a
/// frozen list is read, and saves and reads back the same, or is an error in one line.
pub fn state_file(data: &[u8]) {
    use gpuplex_node::state::StateDir;

    // Round 1: a vGPU's record.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let state = StateDir::open(&dir.path().join("state")).expect("a fresh state directory");
    let file = state.path().join("vgpu-1.json");
    std::fs::write(&file, data).expect("write the record");
    let loaded = state.load().expect("the directory is readable");
    match (loaded.vgpus.as_slice(), loaded.unreadable.as_slice()) {
        ([saved], []) => {
            assert_eq!(saved.vgpu, "vgpu-1", "a record loaded under another's name");
            state.save(saved).expect("save the record again");
            let again = state.load().expect("the directory is readable");
            assert!(again.unreadable.is_empty(), "{:?}", again.unreadable);
            assert_eq!(
                again.vgpus,
                std::slice::from_ref(saved),
                "saved and read back"
            );
        }
        ([], [why]) => {
            one_line("StateDir::load", why);
            let kept = set_aside(state.path(), "vgpu-1.json");
            assert_eq!(
                kept.as_deref(),
                Some(data),
                "the unreadable file's bytes are lost"
            );
        }
        (vgpus, unreadable) => panic!(
            "one file gave {} records and {} unreadable: {unreadable:?}",
            vgpus.len(),
            unreadable.len()
        ),
    }
    state.load_accounting();

    // Round 2: the accounting.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let state = StateDir::open(&dir.path().join("state")).expect("a fresh state directory");
    let file = state.path().join("accounting.json");
    std::fs::write(&file, data).expect("write the accounting");
    let loaded = state.load().expect("the directory is readable");
    assert!(loaded.vgpus.is_empty(), "accounting.json read as a record");
    assert!(loaded.unreadable.is_empty(), "{:?}", loaded.unreadable);
    let accounting = state.load_accounting();
    assert_eq!(
        std::fs::read(&file).ok().as_deref(),
        Some(data),
        "reading the accounting changed its file"
    );
    if let Some(accounting) = accounting {
        state
            .save_accounting(&accounting)
            .expect("save the accounting again");
        let again = state
            .load_accounting()
            .expect("saved accounting reads back");
        let close = |a: f64, b: f64| a == b || (a - b).abs() <= a.abs().max(b.abs()) * 1e-14;
        assert_eq!(again.format, accounting.format);
        assert_eq!(
            again.vgpus.keys().collect::<Vec<_>>(),
            accounting.vgpus.keys().collect::<Vec<_>>()
        );
        for (a, b) in again.vgpus.values().zip(accounting.vgpus.values()) {
            assert_eq!(a.windows, b.windows);
            assert!(close(a.gpu_seconds, b.gpu_seconds), "{a:?} {b:?}");
            assert!(close(a.wait_seconds, b.wait_seconds), "{a:?} {b:?}");
            assert!(close(a.frozen_seconds, b.frozen_seconds), "{a:?} {b:?}");
        }
        assert_eq!(
            again.gpus.keys().collect::<Vec<_>>(),
            accounting.gpus.keys().collect::<Vec<_>>()
        );
        for (a, b) in again.gpus.values().zip(accounting.gpus.values()) {
            assert_eq!((&a.uuid, a.switches), (&b.uuid, b.switches));
            assert!(close(a.busy_seconds, b.busy_seconds), "{a:?} {b:?}");
        }
    }

    // Round 3: the cgroups the service may have frozen.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let state = StateDir::open(&dir.path().join("state")).expect("a fresh state directory");
    std::fs::write(state.path().join("frozen.json"), data).expect("write the frozen list");
    let loaded = state.load().expect("the directory is readable");
    assert!(loaded.vgpus.is_empty(), "frozen.json read as a record");
    assert!(loaded.unreadable.is_empty(), "{:?}", loaded.unreadable);
    match state.load_frozen() {
        Ok(frozen) => {
            state
                .save_frozen(&frozen)
                .expect("save the frozen list again");
            let again = state.load_frozen().expect("read back what was saved");
            assert_eq!(again, frozen, "saved and read back");
        }
        Err(e) => one_line("StateDir::load_frozen", e),
    }
}

/// The bytes of the file `name` was set aside as: the only file in `dir` other than `name`
/// whose name starts with `name`'s stem (`vgpu-1.json.bad`), if `name` itself is gone.
fn set_aside(dir: &Path, name: &str) -> Option<Vec<u8>> {
    if dir.join(name).exists() {
        return None;
    }
    let stem = name.trim_end_matches(".json");
    let mut others: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(stem))
        })
        .collect();
    match others.as_mut_slice() {
        [only] => std::fs::read(only).ok(),
        _ => None,
    }
}

/// `gpuplex_toml`: the input as `gpuplex.toml` (invalid UTF-8 replaced) to the one reader,
/// `NodeConfig::parse`, to the hook's `HookContext::from_config` (from a file) and to the
/// core's `SchedulerConfig::from_toml` and `PolicyConfig::from_toml`; as it is to
/// `NodeConfig::load` (from a file); and each of its strings (keys and values) to
/// `time::parse_duration`.
///
/// Also held: what the node service accepts, the hook accepts, and what it refuses, the hook
/// refuses; the core accepts it too; all read it the same (`[scheduler]`, `[policy]`; the
/// socket and CDI settings); a duration read formats to text that reads back to it, to within
/// the 3 decimals the format keeps.
pub fn gpuplex_toml(data: &[u8]) {
    let text = text_of(data);
    let node = gpuplex_wire::config::NodeConfig::parse(&text);
    if let Err(e) = &node {
        one_line("NodeConfig::parse", e);
    }
    let scheduler = SchedulerConfig::from_toml(&text);
    if let Err(e) = &scheduler {
        one_line("SchedulerConfig::from_toml", e);
    }
    let policy = PolicyConfig::from_toml(&text);
    if let Err(e) = &policy {
        one_line("PolicyConfig::from_toml", e);
    }
    // The hook reads the same text from a file; the service's own reading of the file (as
    // bytes, which may not be UTF-8) is checked beside it.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("gpuplex.toml");
    std::fs::write(&path, &text).expect("write the file");
    let hook = gpuplex_hook::stages::HookContext::from_config(
        gpuplex_wire::stage::Stage::Precreate,
        Some(&path),
    );
    let raw = dir.path().join("raw.toml");
    std::fs::write(&raw, data).expect("write the file");
    if let Err(e) = gpuplex_wire::config::NodeConfig::load(&raw, true) {
        one_line("NodeConfig::load", e);
    }
    if let Err(e) = &hook {
        one_line("HookContext::from_config", e);
    }
    assert_eq!(
        hook.is_ok(),
        node.is_ok(),
        "the node service and the hook disagree on whether the file is good"
    );
    if let (Ok(node), Ok(hook)) = (&node, &hook) {
        assert_eq!(
            scheduler.as_ref(),
            Ok(&node.scheduler),
            "the core reads [scheduler] otherwise"
        );
        assert_eq!(
            policy.as_ref(),
            Ok(&node.policy),
            "the core reads [policy] otherwise"
        );
        assert_eq!(hook.socket, node.service.socket);
        assert_eq!(hook.cdi, node.service.cdi());
    }
    // Every string of the document as a duration, the way `slice = "200ms"` is read.
    let mut strings = Vec::new();
    if let Ok(table) = text.parse::<toml::Table>() {
        strings_in(&toml::Value::Table(table), &mut strings);
    }
    for text in strings.iter().take(64) {
        match parse_duration(text) {
            Ok(d) => {
                let shown = format_duration(d);
                let back = parse_duration(&shown).expect("a formatted duration reads back");
                let error = back.abs_diff(d);
                assert!(
                    error <= d / 1000 + Duration::from_nanos(1),
                    "{text:?} read as {d:?}, shown as {shown:?}, read back as {back:?}"
                );
            }
            Err(e) => one_line("parse_duration", e),
        }
    }
}

/// The strings in a TOML value, keys and values, depth first.
fn strings_in(value: &toml::Value, out: &mut Vec<String>) {
    match value {
        toml::Value::String(s) => out.push(s.clone()),
        toml::Value::Array(items) => items.iter().for_each(|v| strings_in(v, out)),
        toml::Value::Table(table) => {
            for (key, v) in table {
                out.push(key.clone());
                strings_in(v, out);
            }
        }
        _ => {}
    }
}

/// The injection `oci_state` edits configs with: two GPUs, two control nodes and a hook, like
/// the spec editor's tests, made as the hook makes it (the vGPU's edits from a reply).
fn injection() -> Injection {
    let node = |path: &str, major: u32, minor: u32| DeviceNode {
        path: path.into(),
        major,
        minor,
    };
    let gpu = |index: u32, uuid: &str, path: &str| AssignedGpu {
        index,
        uuid: uuid.into(),
        model: "Fake".into(),
        memory: 1 << 30,
        device: Some(node(path, 195, index)),
        fake: true,
    };
    let vgpu = VgpuReply {
        id: VgpuId(3),
        handle: None,
        container: None,
        gpus: vec![
            gpu(
                0,
                "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
                "/dev/nvidia0",
            ),
            gpu(1, "GPU-fake-1", "/var/lib/gpuplex/fake/nvidia1"),
        ],
        weight: 1,
        priority: Priority::Normal,
        cdi: None,
    };
    let control = [
        node("/dev/nvidiactl", 195, 255),
        node("/dev/nvidia-uvm", 508, 0),
    ];
    let identity = Path::new("/run/gpuplex/vgpus/vgpu-3.json");
    Injection {
        vgpu: vgpu.id,
        handle: Some(Handle::from_bytes([0x3c; 16])),
        edits: vgpu_edits(&vgpu, identity, &control).expect("the edits of a whole reply"),
        hook: Some(HookCommand {
            path: "/usr/local/bin/gpuplex-hook".into(),
            args: ["gpuplex-hook", "--config", "/etc/gpuplex/gpuplex.toml"]
                .map(String::from)
                .into(),
            env: vec!["GPUPLEX_LOG=info".into()],
        }),
    }
}

/// `oci_state`: the input as the OCI state on a hook's stdin (`OciState::parse`), as a bundle's
/// `config.json` (`BundleConfig::read`), as the config `spec::edit_bytes` edits, and as the
/// config podman hands `precreate` (with no node service listening).
///
/// Also held: a state read has an id and no pid 0; an edit gives JSON, and editing it again
/// changes nothing (idempotent); a failed edit leaves the config as it was (all or nothing);
/// `precreate` passes a config without a `gpuplex.io/` annotation through byte for byte.
pub fn oci_state(data: &[u8]) {
    use gpuplex_hook::oci_state::{BundleConfig, OciState};

    match OciState::parse(data) {
        Ok(state) => {
            assert!(!state.id.is_empty(), "a state without an id");
            assert_ne!(state.pid, Some(0), "pid 0 is no process");
        }
        Err(e) => one_line("OciState::parse", e),
    }

    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("config.json"), data).expect("write config.json");
    match BundleConfig::read(dir.path()) {
        Ok(bundle) => {
            bundle.annotations();
        }
        Err(e) => one_line("BundleConfig::read", e),
    }

    let injection = injection();
    match spec::edit_bytes(data, &injection) {
        Ok(edited) => {
            serde_json::from_slice::<Value>(&edited).expect("an edited config is JSON");
            let again = spec::edit_bytes(&edited, &injection).expect("an edited config edits");
            assert!(again == edited, "editing twice is not editing once");
        }
        Err(e) => {
            one_line("spec::edit_bytes", &e);
            if let Ok(config) = serde_json::from_slice::<Value>(data) {
                let mut tried = config.clone();
                assert!(
                    spec::edit(&mut tried, &injection).is_err(),
                    "edit and edit_bytes disagree"
                );
                assert!(tried == config, "a failed edit changed the config");
            }
        }
    }

    // The hook's context as `gpuplex-hook --config FILE` makes it, for a node service that is
    // not there.
    let config = dir.path().join("gpuplex.toml");
    let socket = dir.path().join("no-service.sock");
    let toml = format!("[service]\nsocket = {:?}\n", socket.display().to_string());
    std::fs::write(&config, toml).expect("write gpuplex.toml");
    let ctx = gpuplex_hook::stages::HookContext::from_config(
        gpuplex_wire::stage::Stage::Precreate,
        Some(&config),
    )
    .expect("a context from a good gpuplex.toml");
    // Whether the stages read the config as gpuplex's (unreadable counts).
    let ours = match serde_json::from_slice::<Value>(data) {
        Ok(config) => !spec::gpuplex_annotations(&config).is_empty(),
        Err(_) => true,
    };
    assert_eq!(
        gpuplex_hook::stages::concerns_gpuplex(gpuplex_wire::stage::Stage::Precreate, data),
        ours
    );
    match gpuplex_hook::stages::precreate(&ctx, data) {
        Ok(out) => {
            assert!(
                !ours,
                "precreate edited a config without a node service to reserve from"
            );
            assert!(out == data, "precreate changed a config it passes through");
        }
        Err(e) => {
            assert!(ours, "precreate refused a config it passes through: {e}");
            one_line("precreate", e);
        }
    }
}
