//! The plugin's answers over a node that records what it is asked: every origin of a vGPU,
//! refusals, a restart's catching up, and NRI's calls decoded and answered.

use std::cell::RefCell;
use std::path::Path;

use super::*;
use gpuplex_hook::stages::Prepared;
use gpuplex_scheduler::VgpuId;
use gpuplex_wire::annotations::ALLOCATION;
use serde_json::{json, Value};

use crate::proto::nri::{Hook, Hooks};

/// What the stub node was asked, in order.
#[derive(Debug, PartialEq)]
enum Asked {
    Prepare,
    Undo(Handle),
    Attach {
        handle: Handle,
        id: String,
        pid: u32,
        unstarted: bool,
        asked: BTreeMap<String, String>,
    },
    Release(Handle),
}

#[derive(Default)]
struct StubNode {
    asked: RefCell<Vec<Asked>>,
    /// The edit prepare makes: none (it reserves nothing) or this config.
    edit: Option<Value>,
    /// Prepare's refusal.
    refuse: Option<String>,
    /// Attach's refusal.
    refuse_attach: Option<String>,
}

/// The handle the stub reserves with.
fn reserved() -> Handle {
    Handle::from_bytes([1; 16])
}

impl Node for StubNode {
    fn prepare(&self, spec: &Value) -> Result<Option<Prepared>, String> {
        self.asked.borrow_mut().push(Asked::Prepare);
        if let Some(why) = &self.refuse {
            return Err(why.clone());
        }
        let Some(edit) = &self.edit else {
            return Ok(None);
        };
        let mut config = spec.clone();
        for (key, value) in edit.as_object().unwrap() {
            config[key] = value.clone();
        }
        Ok(Some(Prepared {
            config: serde_json::to_vec(&config).unwrap(),
            vgpu: VgpuId(9),
            handle: reserved(),
        }))
    }

    fn undo(&self, prepared: &Prepared) {
        self.asked.borrow_mut().push(Asked::Undo(prepared.handle));
    }

    fn attach(
        &self,
        handle: &Handle,
        id: &str,
        pid: u32,
        unstarted: bool,
        asked: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        self.asked.borrow_mut().push(Asked::Attach {
            handle: *handle,
            id: id.into(),
            pid,
            unstarted,
            asked: asked.clone(),
        });
        match &self.refuse_attach {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    fn release(&self, handle: &Handle) {
        self.asked.borrow_mut().push(Asked::Release(*handle));
    }
}

/// The edit of a reservation: its id annotation and one device.
fn an_edit() -> Value {
    json!({
        "annotations": {"gpuplex.io/gpu-memory": "4Gi", "gpuplex.io/vgpu-id": "vgpu-9"},
        "linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
                  "resources": {"devices": []}},
    })
}

fn plugin(node: StubNode) -> Plugin<StubNode> {
    Plugin::new(node)
}

fn asked(p: &Plugin<StubNode>) -> Vec<Asked> {
    p.node().asked.borrow_mut().drain(..).collect()
}

fn pod(annotations: &[(&str, &str)]) -> PodSandbox {
    PodSandbox {
        id: "pod".into(),
        name: "p".into(),
        namespace: "ml".into(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn container(id: &str, pid: u32) -> Container {
    Container {
        id: id.into(),
        pod_sandbox_id: "pod".into(),
        pid,
        ..Default::default()
    }
}

/// A claim's attach step, as the DRA driver writes it into a claim's CDI spec, in NRI's form.
fn step(handle: &Handle) -> Hook {
    let hook = gpuplex_wire::attach_step::attach_hook(
        Path::new("/usr/bin/gpuplex-hook"),
        Path::new("/run/gpuplex/gpuplex.sock"),
        handle,
    );
    let hook = serde_json::to_value(hook).unwrap();
    Hook {
        path: hook["path"].as_str().unwrap().into(),
        args: serde_json::from_value(hook["args"].clone()).unwrap(),
        ..Default::default()
    }
}

#[test]
fn a_container_that_asks_for_nothing_is_left_alone() {
    let mut p = plugin(StubNode::default());
    let answer = p.create(&pod(&[]), &container("c", 0)).unwrap();
    assert_eq!(answer, CreateContainerResponse::default());
    p.start(&pod(&[]), &container("c", 10), true).unwrap();
    p.gone(&container("c", 10));
    assert_eq!(asked(&p), []);
}

#[test]
fn annotations_reserve_at_create_attach_at_start_and_release_when_gone() {
    let mut p = plugin(StubNode {
        edit: Some(an_edit()),
        ..Default::default()
    });
    let pod = pod(&[("gpuplex.io/gpu-memory", "4Gi")]);
    let answer = p.create(&pod, &container("c", 0)).unwrap();
    let adjust = answer.adjust.unwrap();
    assert_eq!(
        adjust.annotations["gpuplex.io/vgpu-handle"],
        reserved().to_string()
    );
    assert_eq!(adjust.linux.unwrap().devices[0].path, "/dev/nvidia0");
    assert_eq!(asked(&p), [Asked::Prepare]);

    p.start(&pod, &container("c", 77), true).unwrap();
    p.gone(&container("c", 77));
    assert_eq!(
        asked(&p),
        [
            Asked::Attach {
                handle: reserved(),
                id: "c".into(),
                pid: 77,
                unstarted: true,
                asked: BTreeMap::new()
            },
            Asked::Release(reserved())
        ]
    );
    // Removal after stop finds nothing more to release.
    p.gone(&container("c", 77));
    assert_eq!(asked(&p), []);
}

#[test]
fn a_pod_of_gpuplexs_shim_is_left_to_the_shim() {
    let mut p = plugin(StubNode {
        edit: Some(an_edit()),
        ..Default::default()
    });
    let mut shims = pod(&[("gpuplex.io/gpu-memory", "4Gi")]);
    shims.runtime_handler = SHIM_HANDLER.into();
    let answer = p.create(&shims, &container("c", 0)).unwrap();
    assert_eq!(answer, CreateContainerResponse::default());
    let mut c = container("c", 5);
    c.annotations
        .insert(ALLOCATION.into(), Handle::from_bytes([3; 16]).to_string());
    p.start(&shims, &c, true).unwrap();
    assert_eq!(asked(&p), []);
    // Another handler's pod (runc's, named "runc" or the default "") is the plugin's.
    let mut p = p.with_shim_handler("gpuplex-b");
    p.create(&shims, &container("d", 0)).unwrap();
    assert_eq!(asked(&p), [Asked::Prepare]);
}

#[test]
fn a_refusal_is_one_line_and_an_edit_that_cannot_be_adjusted_is_undone() {
    let mut p = plugin(StubNode {
        refuse: Some("gpuplex.io/gpu-memory \"lots\": not a quantity".into()),
        ..Default::default()
    });
    let err = p
        .create(
            &pod(&[("gpuplex.io/gpu-memory", "lots")]),
            &container("c", 0),
        )
        .unwrap_err();
    assert!(err.contains("lots") && !err.contains('\n'), "{err}");

    // An edit without its vGPU id cannot be said as an adjustment: the reservation goes.
    let mut p = plugin(StubNode {
        edit: Some(json!({"annotations": {"gpuplex.io/gpu-memory": "4Gi"}})),
        ..Default::default()
    });
    let err = p
        .create(
            &pod(&[("gpuplex.io/gpu-memory", "4Gi")]),
            &container("c", 0),
        )
        .unwrap_err();
    assert!(!err.contains('\n'), "{err}");
    assert_eq!(asked(&p), [Asked::Prepare, Asked::Undo(reserved())]);
    p.start(&pod(&[]), &container("c", 5), true).unwrap();
    assert_eq!(asked(&p), [], "nothing to attach");
}

#[test]
fn an_attach_that_fails_releases_the_containers_reservation() {
    let mut p = plugin(StubNode {
        edit: Some(an_edit()),
        refuse_attach: Some("the cgroup is the hierarchy's root".into()),
        ..Default::default()
    });
    let pod = pod(&[("gpuplex.io/gpu-memory", "4Gi")]);
    p.create(&pod, &container("c", 0)).unwrap();
    asked(&p);
    let err = p.start(&pod, &container("c", 3), true).unwrap_err();
    assert!(
        err.contains("hierarchy's root") && !err.contains('\n'),
        "{err}"
    );
    let calls = asked(&p);
    assert_eq!(calls.last(), Some(&Asked::Release(reserved())));
    // A container without a pid is not attached to anything.
    let mut p = plugin(StubNode {
        edit: Some(an_edit()),
        ..Default::default()
    });
    p.create(&pod, &container("c", 0)).unwrap();
    assert!(p.start(&pod, &container("c", 0), true).is_err());
}

#[test]
fn a_claims_container_is_attached_by_its_own_step_not_by_the_plugin() {
    let mut p = plugin(StubNode::default());
    let handle = Handle::from_bytes([4; 16]);
    let mut c = container("c", 0);
    c.hooks = Some(Hooks {
        create_runtime: vec![step(&handle)],
        ..Default::default()
    });
    let answer = p.create(&pod(&[]), &c).unwrap();
    assert_eq!(answer, CreateContainerResponse::default());
    c.pid = 8;
    p.start(&pod(&[]), &c, true).unwrap();
    p.gone(&c);
    assert_eq!(asked(&p), []);

    // A claim and annotations asking for another vGPU: refused, as the shim refuses it.
    let err = p
        .create(&pod(&[("gpuplex.io/gpu-memory", "1Gi")]), &c)
        .unwrap_err();
    assert!(err.contains("two vGPUs"), "{err}");
    // A forged step.
    let mut forged = step(&handle);
    forged.args.pop();
    forged.args.push("not-a-handle".into());
    c.hooks = Some(Hooks {
        create_runtime: vec![forged],
        ..Default::default()
    });
    assert!(p.create(&pod(&[]), &c).is_err());
    assert_eq!(asked(&p), []);
}

#[test]
fn an_allocations_container_attaches_with_its_pods_weight_and_the_runtimes_namespace() {
    let mut p = plugin(StubNode::default());
    let handle = Handle::from_bytes([5; 16]);
    let mut c = container("c", 0);
    c.annotations = BTreeMap::from([
        (ALLOCATION.to_string(), handle.to_string()),
        (
            "io.kubernetes.cri.sandbox-namespace".into(),
            "kube-system".into(),
        ),
    ]);
    let pod = pod(&[("gpuplex.io/weight", "3")]);
    assert_eq!(
        p.create(&pod, &c).unwrap(),
        CreateContainerResponse::default()
    );
    c.pid = 12;
    p.start(&pod, &c, true).unwrap();
    p.gone(&c);
    let calls = asked(&p);
    assert_eq!(calls.len(), 1, "attached, never released: {calls:?}");
    let Asked::Attach {
        handle: h, asked, ..
    } = &calls[0]
    else {
        panic!("{calls:?}")
    };
    assert_eq!(h, &handle);
    assert_eq!(asked["gpuplex.io/weight"], "3");
    assert_eq!(asked["io.kubernetes.cri.sandbox-namespace"], "ml");

    // Not a handle: refused at create.
    c.annotations.insert(ALLOCATION.into(), "guess".into());
    assert!(p.create(&pod, &c).is_err());
}

#[test]
fn a_plugin_started_again_finds_its_reservations_in_the_specs() {
    let mut p = plugin(StubNode::default());
    let mut c = container("c", 40);
    c.annotations
        .insert(VGPU_HANDLE.into(), reserved().to_string());
    c.set_state(ContainerState::ContainerRunning);
    let mut stopped = container("s", 0);
    stopped
        .annotations
        .insert(VGPU_HANDLE.into(), Handle::from_bytes([2; 16]).to_string());
    stopped.set_state(ContainerState::ContainerStopped);
    // Created while the plugin was away: it asks, and cannot be given a vGPU now.
    let mut missed = container("m", 41);
    missed
        .annotations
        .insert("gpuplex.io/gpu-memory".into(), "1Gi".into());
    missed.set_state(ContainerState::ContainerRunning);
    p.synchronize(&SynchronizeRequest {
        pods: vec![pod(&[])],
        containers: vec![c, stopped, missed],
        more: false,
    });
    assert_eq!(
        asked(&p),
        [
            Asked::Attach {
                handle: reserved(),
                id: "c".into(),
                pid: 40,
                unstarted: false,
                asked: BTreeMap::new()
            },
            Asked::Release(Handle::from_bytes([2; 16]))
        ]
    );
}

#[test]
fn the_node_is_given_three_quarters_of_the_runtimes_timeout() {
    assert_eq!(answer_within(2000), Some(Duration::from_millis(1500)));
    assert_eq!(answer_within(40), Some(Duration::from_millis(50)));
    assert_eq!(answer_within(0), None);
    assert_eq!(answer_within(-5), None);
}

#[test]
fn nris_calls_are_decoded_and_answered() {
    let mut p = plugin(StubNode {
        edit: Some(an_edit()),
        ..Default::default()
    });
    let answer = p
        .call("Configure", &ConfigureRequest::default().encode_to_vec())
        .unwrap();
    let mask = ConfigureResponse::decode(&answer[..]).unwrap().events;
    // CreateContainer (4), StartContainer (6), StopContainer (10), RemoveContainer (11).
    assert_eq!(mask, 1 << 3 | 1 << 5 | 1 << 9 | 1 << 10);

    let sync = SynchronizeRequest {
        more: true,
        ..Default::default()
    };
    let answer = p.call("Synchronize", &sync.encode_to_vec()).unwrap();
    assert!(SynchronizeResponse::decode(&answer[..]).unwrap().more);

    let create = CreateContainerRequest {
        pod: Some(pod(&[("gpuplex.io/gpu-memory", "4Gi")])),
        container: Some(container("c", 0)),
    };
    let answer = p.call("CreateContainer", &create.encode_to_vec()).unwrap();
    let answer = CreateContainerResponse::decode(&answer[..]).unwrap();
    assert!(answer.adjust.unwrap().annotations.contains_key(VGPU_HANDLE));

    // NRI 0.8's StateChange and the later StartContainer reach the same start.
    let start = StateChangeEvent {
        event: Event::StartContainer as i32,
        pod: create.pod.clone(),
        container: Some(container("c", 9)),
    };
    p.call("StateChange", &start.encode_to_vec()).unwrap();
    let start = ContainerEvent {
        pod: create.pod.clone(),
        container: Some(container("c", 9)),
    };
    p.call("StartContainer", &start.encode_to_vec()).unwrap();
    let attaches = asked(&p)
        .iter()
        .filter(|a| matches!(a, Asked::Attach { pid: 9, .. }))
        .count();
    assert_eq!(attaches, 2);
    let remove = StateChangeEvent {
        event: Event::RemoveContainer as i32,
        container: Some(container("c", 9)),
        ..Default::default()
    };
    p.call("StateChange", &remove.encode_to_vec()).unwrap();
    assert_eq!(asked(&p), [Asked::Release(reserved())]);

    let (code, message) = p.call("UpdatePodSandbox", &[]).unwrap_err();
    assert_eq!(code, UNIMPLEMENTED);
    assert!(message.contains("UpdatePodSandbox"));
    let (code, message) = p.call("CreateContainer", &[0xff, 0xff]).unwrap_err();
    assert_eq!(code, INVALID_ARGUMENT);
    assert!(message.starts_with("gpuplex: ") && !message.contains('\n'));

    // A refusal reaches the runtime as the one line the pod's events show.
    let mut p = plugin(StubNode {
        refuse: Some("no GPU has 99Gi free".into()),
        ..Default::default()
    });
    let (code, message) = p
        .call("CreateContainer", &create.encode_to_vec())
        .unwrap_err();
    assert_eq!(
        (code, message.as_str()),
        (UNKNOWN, "gpuplex: no GPU has 99Gi free")
    );
}
