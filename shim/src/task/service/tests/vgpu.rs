//! The vGPU paths of the task service: a stub node service that journals what the shim asks of
//! it, beside the stub runtime's calls, so that each test reads the order of the two.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::Status;
use gpuplex_hook::stages::HookError;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;
use serde_json::{json, Value};

use super::{config, ctx, status, Journal, Shim};
use crate::task::vgpu::{Node, Reservation, Vgpu, VgpuError};

/// The handle the stub reserves with.
fn reserved() -> Handle {
    handle(0x11)
}

/// What the stub's reservation puts in the container's environment.
const VISIBLE: &str = "CUDA_VISIBLE_DEVICES=GPU-stub-0";

/// A node service whose calls are journal lines (`node attach c1 HANDLE PID k=v,...`); a call
/// named in `failing` fails with that line.
pub struct StubNode {
    journal: Arc<Journal>,
    failing: Mutex<HashMap<&'static str, String>>,
}

impl StubNode {
    /// A node service journalling to `journal`.
    pub fn new(journal: Arc<Journal>) -> Arc<StubNode> {
        Arc::new(StubNode {
            journal,
            failing: Mutex::new(HashMap::new()),
        })
    }

    fn fail(&self, call: &'static str, why: &str) {
        self.failing.lock().unwrap().insert(call, why.to_owned());
    }

    fn call(&self, call: &'static str, line: String) -> Result<(), VgpuError> {
        self.journal.write(format!("node {line}"));
        match self.failing.lock().unwrap().get(call) {
            Some(why) => Err(VgpuError::Refused(HookError {
                stage: gpuplex_wire::stage::Stage::ShimCreate,
                message: why.clone(),
            })),
            None => Ok(()),
        }
    }
}

impl Node for StubNode {
    fn reserve(&self, spec: &[u8]) -> Result<Option<Reservation>, VgpuError> {
        let mut spec: Value = serde_json::from_slice(spec).expect("the shim's spec is JSON");
        let asked = gpuplex_hook::spec::gpuplex_annotations(&spec);
        let asked: Vec<String> = asked.iter().map(|(k, v)| format!("{k}={v}")).collect();
        self.call("reserve", format!("reserve {}", asked.join(",")))?;
        spec["process"]["env"] = json!([VISIBLE]);
        Ok(Some(Reservation {
            handle: reserved(),
            spec: serde_json::to_vec(&spec).unwrap(),
        }))
    }

    fn ensure_running(&self) -> Result<(), VgpuError> {
        self.call("ensure_running", "ensure-running".into())
    }

    fn attach(&self, vgpu: &Vgpu, id: &str, pid: u32) -> Result<(), VgpuError> {
        let asked: Vec<String> = vgpu.asked.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let line = format!("attach {id} {} {pid} {}", vgpu.handle, asked.join(","));
        self.call("attach", line.trim_end().to_owned())
    }

    fn hold(&self, id: &str, held: bool) -> Result<(), VgpuError> {
        self.call("hold", format!("hold {id} {held}"))
    }

    fn stopping(&self, id: &str, signal: StopSignal) {
        let _ = self.call("stopping", format!("stopping {id} {signal:?}"));
    }

    fn release(&self, handle: &Handle) {
        let _ = self.call("release", format!("release {handle}"));
    }

    fn release_container(&self, id: &str) {
        let _ = self.call("release_container", format!("release-container {id}"));
    }
}

fn handle(n: u8) -> Handle {
    Handle::from_bytes([n; 16])
}

/// The tests' config.json with `annotations` and these `createRuntime` hooks.
fn spec(annotations: Value, hooks: Vec<Value>) -> Vec<u8> {
    let mut spec: Value = serde_json::from_str(&config(true)).unwrap();
    spec["annotations"] = annotations;
    if !hooks.is_empty() {
        spec["hooks"] = json!({"createRuntime": hooks});
    }
    serde_json::to_vec(&spec).unwrap()
}

/// A claim's attach step for handle `n`, as the DRA driver writes it.
fn step(n: u8) -> Value {
    let hook = gpuplex_wire::attach_step::attach_hook(
        Path::new("/usr/bin/gpuplex-hook"),
        Path::new("/run/gpuplex/gpuplex.sock"),
        &handle(n),
    );
    serde_json::to_value(hook).unwrap()
}

fn other_hook() -> Value {
    json!({"path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook", "update-ldcache"]})
}

impl Shim {
    /// `Create` of `id` with `config` as its config.json.
    fn create_with(&self, id: &str, config: &[u8]) -> ttrpc::Result<u32> {
        self.create_bundle(id, self.bundle_with(id, config))
    }

    /// The journal's lines that are not events.
    fn calls(&self) -> Vec<String> {
        let lines = self.journal.lines();
        lines.into_iter().filter(|l| !l.starts_with('/')).collect()
    }

    /// `id`'s config.json as runc is to read it.
    fn config_of(&self, id: &str) -> Value {
        let config = std::fs::read(self.dir.path().join(id).join("config.json")).unwrap();
        serde_json::from_slice(&config).unwrap()
    }

    /// The container exits, and is deleted.
    fn exit_and_delete(&self, id: &str, pid: u32) {
        self.service.exited(pid as i32, 0);
        self.journal.after(&format!("/tasks/exit {id}"));
        self.delete(id, "").unwrap();
    }
}

#[test]
fn an_annotated_container_is_reserved_before_runc_create_attached_after_and_released_at_delete() {
    let shim = Shim::new();
    let asked = spec(
        json!({"gpuplex.io/gpu-memory": "2Gi", "other.io/x": "y"}),
        vec![],
    );
    let pid = shim.create_with("c1", &asked).unwrap();
    assert_eq!(
        shim.calls(),
        [
            "node reserve gpuplex.io/gpu-memory=2Gi".to_string(),
            "create c1".into(),
            format!("node attach c1 {} {pid}", reserved()),
        ]
    );
    // runc runs the reservation's edit, and an exec gets its container's devices.
    assert_eq!(shim.config_of("c1")["process"]["env"], json!([VISIBLE]));
    shim.start("c1", "").unwrap();
    shim.exec("c1", "e1").unwrap();
    shim.start("c1", "e1").unwrap();
    assert!(shim
        .stub
        .exec_env
        .lock()
        .unwrap()
        .contains(&VISIBLE.to_owned()));

    shim.exit_and_delete("c1", pid);
    let calls = shim.calls();
    assert_eq!(
        calls[calls.len() - 2..],
        [
            "delete c1".to_string(),
            format!("node release {}", reserved())
        ]
    );
}

#[test]
fn a_claims_container_attaches_with_the_claims_handle_runs_without_the_step_and_keeps_the_vgpu() {
    let shim = Shim::new();
    let claimed = spec(json!({"gpuplex.io/weight": 3}), vec![other_hook(), step(7)]);
    let pid = shim.create_with("c1", &claimed).unwrap();
    assert_eq!(
        shim.calls(),
        [
            "node ensure-running".to_string(),
            "create c1".into(),
            format!("node attach c1 {} {pid}", handle(7)),
        ]
    );
    assert_eq!(
        shim.config_of("c1")["hooks"]["createRuntime"],
        json!([other_hook()])
    );
    shim.exit_and_delete("c1", pid);
    let calls = shim.calls();
    assert_eq!(calls.last().unwrap(), "delete c1", "{calls:#?}");
    assert!(!calls.iter().any(|c| c.starts_with("node release")));
}

#[test]
fn an_allocations_container_attaches_with_what_its_pod_asks_and_keeps_the_vgpu() {
    let shim = Shim::new();
    let allocated = spec(
        json!({
            "gpuplex.io/allocation": handle(9).to_string(),
            "gpuplex.io/weight": "3",
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.container-type": "container",
        }),
        vec![step(9)],
    );
    let pid = shim.create_with("c1", &allocated).unwrap();
    assert_eq!(
        shim.calls(),
        [
            "node ensure-running".to_string(),
            "create c1".into(),
            format!(
                "node attach c1 {} {pid} gpuplex.io/weight=3,io.kubernetes.cri.sandbox-namespace=ml",
                handle(9)
            ),
        ]
    );
    assert_eq!(shim.config_of("c1")["hooks"]["createRuntime"], json!([]));
    shim.exit_and_delete("c1", pid);
    assert!(!shim.calls().iter().any(|c| c.starts_with("node release")));
}

#[test]
fn a_refused_spec_fails_create_in_one_line_before_anything_is_done() {
    let shim = Shim::new();
    let claim_and_annotations = spec(json!({"gpuplex.io/gpus": "1"}), vec![step(1)]);
    let not_a_handle = spec(json!({"gpuplex.io/allocation": "../../x"}), vec![]);
    let two = spec(
        json!({"gpuplex.io/allocation": handle(1).to_string()}),
        vec![step(2)],
    );
    let forged = json!({"path": "/h", "args": ["gpuplex-hook", "attach", "nope"]});
    let forged = spec(json!({}), vec![forged]);
    let cases: [(&[u8], &str); 5] = [
        (
            &claim_and_annotations,
            "gpuplex: the container asks for two vGPUs",
        ),
        (
            &not_a_handle,
            "gpuplex: gpuplex.io/allocation is not a handle",
        ),
        (&two, "gpuplex: the container has two gpuplex allocations"),
        (
            &forged,
            "gpuplex: a gpuplex-hook attach hook in the spec names no handle",
        ),
        (b"not json", "config.json is not JSON"),
    ];
    for (config, said) in cases {
        let (code, message) = status(shim.create_with("c1", config));
        assert_eq!(code, Code::INVALID_ARGUMENT, "{message}");
        assert!(
            message.contains(said) && !message.contains('\n'),
            "{said}: {message}"
        );
        // Untouched: the spec, runc, the node service; and the id is free.
        let bundle = shim.dir.path().join("c1");
        assert_eq!(std::fs::read(bundle.join("config.json")).unwrap(), config);
        assert_eq!(shim.calls(), Vec::<String>::new());
        assert_eq!(status(shim.state("c1", "")).0, Code::NOT_FOUND);
    }
}

#[test]
fn a_config_json_that_is_a_link_or_a_fifo_is_refused_without_blocking() {
    let shim = Shim::new();
    let outside = shim.dir.path().join("outside.json");
    std::fs::write(&outside, config(true)).unwrap();
    let bundle = shim.dir.path().join("c1");
    std::fs::create_dir_all(&bundle).unwrap();
    let config_json = bundle.join("config.json");
    std::os::unix::fs::symlink(&outside, &config_json).unwrap();
    let bundle = bundle.display().to_string();
    let (code, message) = status(shim.create_bundle("c1", bundle.clone()));
    assert_eq!(code, Code::INVALID_ARGUMENT);
    assert!(message.starts_with("gpuplex: cannot read "), "{message}");

    std::fs::remove_file(&config_json).unwrap();
    nix::unistd::mkfifo(
        &config_json,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let (code, message) = status(shim.create_bundle("c1", bundle));
    assert_eq!(code, Code::INVALID_ARGUMENT);
    assert!(message.ends_with("not a regular file"), "{message}");
    assert_eq!(shim.calls(), Vec::<String>::new());
}

#[test]
fn pause_and_resume_hold_the_container_around_runc() {
    let shim = Shim::new();
    shim.create_with("c1", &spec(json!({"gpuplex.io/gpus": "1"}), vec![]))
        .unwrap();
    shim.start("c1", "").unwrap();
    shim.running("plain");
    let pause = |id: &str| {
        let req = containerd_shim::api::PauseRequest {
            id: id.into(),
            ..Default::default()
        };
        shim.client.pause(ctx(), &req).map(drop)
    };
    let resume = |id: &str| {
        let req = containerd_shim::api::ResumeRequest {
            id: id.into(),
            ..Default::default()
        };
        shim.client.resume(ctx(), &req).map(drop)
    };
    let before = shim.calls().len();
    pause("c1").unwrap();
    assert_eq!(shim.state("c1", "").unwrap().1, Status::PAUSED);
    resume("c1").unwrap();
    pause("plain").unwrap();
    resume("plain").unwrap();
    assert_eq!(
        shim.calls()[before..],
        [
            "node hold c1 true",
            "pause c1",
            "resume c1",
            "node hold c1 false",
            "pause plain",
            "resume plain"
        ]
    );

    // A hold refused: runc is not asked to pause.
    shim.node
        .fail("hold", "the gpuplex node service did not hold c1: no");
    let before = shim.calls().len();
    let (code, message) = status(pause("c1"));
    assert_eq!(
        (code, message.as_str()),
        (
            Code::INVALID_ARGUMENT,
            "gpuplex: the gpuplex node service did not hold c1: no"
        )
    );
    assert_eq!(shim.calls()[before..], ["node hold c1 true"]);
    assert_eq!(shim.state("c1", "").unwrap().1, Status::RUNNING);
}

#[test]
fn a_stop_signal_to_init_is_told_to_the_node_service_before_runc_sends_it() {
    let shim = Shim::new();
    shim.create_with("c1", &spec(json!({"gpuplex.io/gpus": "1"}), vec![]))
        .unwrap();
    shim.start("c1", "").unwrap();
    shim.exec("c1", "e1").unwrap();
    let exec = shim.start("c1", "e1").unwrap();
    shim.running("plain");
    let before = shim.calls().len();
    shim.kill("c1", "", 15, false).unwrap();
    shim.kill("c1", "", 9, true).unwrap();
    shim.kill("c1", "", 10, false).unwrap();
    shim.kill("c1", "e1", 15, false).unwrap();
    shim.kill("plain", "", 15, false).unwrap();
    assert_eq!(
        shim.calls()[before..],
        [
            "node stopping c1 Graceful".to_string(),
            "kill c1 15".into(),
            "node stopping c1 Kill".into(),
            "kill c1 9 all".into(),
            "kill c1 10".into(),
            format!("signal {exec} 15"),
            "kill plain 15".into(),
        ]
    );
}

#[test]
fn a_failure_after_the_reservation_releases_it_and_leaves_the_id_free() {
    let shim = Shim::new();
    let asked = spec(json!({"gpuplex.io/gpus": "1"}), vec![]);
    let released = format!("node release {}", reserved());

    shim.stub.fail("create", "runc create failed: no");
    let (_, message) = status(shim.create_with("c1", &asked));
    assert_eq!(message, "OCI runtime create failed: runc create failed: no");
    assert_eq!(
        shim.calls(),
        ["node reserve gpuplex.io/gpus=1", "create c1", &released]
    );
    shim.stub.heal("create");

    shim.node
        .fail("attach", "the gpuplex node service did not attach c1: no");
    let before = shim.calls().len();
    let (code, message) = status(shim.create_with("c1", &asked));
    assert_eq!(
        (code, message.as_str()),
        (
            Code::INVALID_ARGUMENT,
            "gpuplex: the gpuplex node service did not attach c1: no"
        )
    );
    let calls = shim.calls();
    let attach = calls[before + 2].clone();
    assert!(attach.starts_with("node attach c1 "), "{calls:#?}");
    assert_eq!(
        calls[before..],
        [
            "node reserve gpuplex.io/gpus=1",
            "create c1",
            &attach,
            "delete c1",
            &released
        ]
    );

    // A claim's vGPU is the claim's, whatever failed.
    let before = shim.calls().len();
    let (_, message) = status(shim.create_with("c1", &spec(json!({}), vec![step(7)])));
    assert!(message.ends_with("did not attach c1: no"), "{message}");
    assert!(!shim.calls()[before..]
        .iter()
        .any(|c| c.starts_with("node release")));

    // Nothing reserved, nothing run.
    shim.node
        .fail("reserve", "gpuplex.io/gpus: 9 is more than the node has");
    let before = shim.calls().len();
    let (_, message) = status(shim.create_with("c1", &asked));
    assert_eq!(
        message,
        "gpuplex: gpuplex.io/gpus: 9 is more than the node has"
    );
    assert_eq!(shim.calls()[before..], ["node reserve gpuplex.io/gpus=1"]);
    shim.node
        .fail("ensure_running", "the gpuplex node service did not come up");
    let before = shim.calls().len();
    status(shim.create_with("c1", &spec(json!({}), vec![step(7)])));
    assert_eq!(shim.calls()[before..], ["node ensure-running"]);

    shim.node.failing.lock().unwrap().clear();
    let pid = shim.create_with("c1", &asked).unwrap();
    assert_eq!(
        shim.state("c1", "").unwrap(),
        ("c1".into(), Status::CREATED, pid, 0)
    );
}
