//! Every origin and every refusal of [`classify`], as one table, and input that is malformed
//! or huge.

use std::path::Path;

use super::*;
use serde_json::json;

fn handle(n: u8) -> Handle {
    Handle::from_bytes([n; 16])
}

/// A claim's attach step for `handle`, as the DRA driver writes it into the claim's CDI spec.
fn step(n: u8) -> Value {
    let hook = gpuplex_wire::attach_step::attach_hook(
        Path::new("/usr/bin/gpuplex-hook"),
        Path::new("/run/gpuplex/gpuplex.sock"),
        &handle(n),
    );
    serde_json::to_value(hook).unwrap()
}

/// Another runtime's `createRuntime` hook, which stays.
fn other_hook() -> Value {
    json!({"path": "/usr/bin/nvidia-ctk", "args": ["nvidia-ctk", "hook", "update-ldcache"]})
}

/// A spec with these annotations and `createRuntime` hooks.
fn spec(annotations: Value, hooks: Vec<Value>) -> Value {
    json!({"ociVersion": "1.0.2", "annotations": annotations, "hooks": {"createRuntime": hooks}})
}

/// What a case classifies as, in few words.
#[derive(Debug, PartialEq)]
enum Expect {
    NoVgpu,
    /// The `gpuplex.io/` keys asked.
    Annotations(Vec<String>),
    /// The claim's handle; the hooks left in the spec.
    Claim(Handle, Vec<Value>),
    /// The allocation's handle; the keys asked; the hooks left in the spec.
    Allocation(Handle, Vec<String>, Vec<Value>),
    Refused(SpecRefusal),
}

fn seen(origin: Result<VgpuOrigin, SpecRefusal>) -> Expect {
    let hooks = |spec: &Value| {
        spec["hooks"]["createRuntime"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let keys = |map: &BTreeMap<String, String>| map.keys().cloned().collect();
    match origin {
        Ok(VgpuOrigin::NoVgpu) => Expect::NoVgpu,
        Ok(VgpuOrigin::Annotations(asked)) => Expect::Annotations(keys(&asked)),
        Ok(VgpuOrigin::Claim { handle, spec }) => Expect::Claim(handle, hooks(&spec)),
        Ok(VgpuOrigin::Allocation {
            handle,
            asked,
            spec,
        }) => Expect::Allocation(handle, keys(&asked), hooks(&spec)),
        Err(refusal) => Expect::Refused(refusal),
    }
}

const FORGED: &str = "a gpuplex-hook attach hook in the spec names no handle gpuplex wrote; it is the DRA driver's, written into the claim's CDI spec";
const TWO_STEPS: &str = "the container has two gpuplex claim devices (gpuplex.io/vgpu=...); a container uses one claim's vGPU";

#[test]
fn every_origin_and_every_refusal() {
    use Expect::*;
    let keys = |k: &[&str]| k.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    let memory = json!({"gpuplex.io/gpu-memory": "2Gi"});
    let h = |n: u8| handle(n).to_string();
    let forged = json!({"path": "/h", "args": ["gpuplex-hook", "attach", "../../etc/passwd"]});
    let cases: Vec<(&str, Value, Expect)> = vec![
        // No vGPU.
        ("an empty spec", json!({}), NoVgpu),
        ("no annotations", spec(Value::Null, vec![]), NoVgpu),
        (
            "other annotations",
            spec(json!({"other.io/x": "y"}), vec![]),
            NoVgpu,
        ),
        ("a spec that is an array", json!([memory]), NoVgpu),
        ("a spec that is a string", json!("gpuplex.io/gpus"), NoVgpu),
        ("a spec that is null", Value::Null, NoVgpu),
        (
            "annotations that are an array",
            spec(json!([memory]), vec![]),
            NoVgpu,
        ),
        (
            "annotations that are a string",
            spec(json!("gpuplex.io/gpus=1"), vec![]),
            NoVgpu,
        ),
        (
            "a gpuplex.io value that is a number",
            spec(json!({"gpuplex.io/gpus": 1}), vec![]),
            NoVgpu,
        ),
        (
            "a gpuplex.io value that is null",
            spec(json!({"gpuplex.io/gpus": null}), vec![]),
            NoVgpu,
        ),
        (
            "a pod's sandbox",
            spec(
                json!({"io.kubernetes.cri.container-type": "sandbox", "gpuplex.io/gpu-memory": "2Gi"}),
                vec![],
            ),
            NoVgpu,
        ),
        (
            "hooks that are not an object",
            json!({"hooks": [step(1)]}),
            NoVgpu,
        ),
        (
            "createRuntime that is not an array",
            json!({"hooks": {"createRuntime": step(1)}}),
            NoVgpu,
        ),
        (
            "another runtime's hook",
            spec(json!({}), vec![other_hook()]),
            NoVgpu,
        ),
        // Annotations.
        (
            "gpuplex.io annotations",
            spec(memory.clone(), vec![]),
            Annotations(keys(&["gpuplex.io/gpu-memory"])),
        ),
        (
            "a pod's workload container",
            spec(
                json!({"io.kubernetes.cri.container-type": "container", "gpuplex.io/gpu-memory": "2Gi", "gpuplex.io/weight": "3", "gpuplex.io/odd": 7}),
                vec![],
            ),
            Annotations(keys(&["gpuplex.io/gpu-memory", "gpuplex.io/weight"])),
        ),
        (
            "a container type that is not a string",
            spec(
                json!({"io.kubernetes.cri.container-type": ["sandbox"], "gpuplex.io/gpus": "1"}),
                vec![],
            ),
            Annotations(keys(&["gpuplex.io/gpus"])),
        ),
        // A claim's container.
        (
            "a claim's step",
            spec(json!({}), vec![other_hook(), step(1)]),
            Claim(handle(1), vec![other_hook()]),
        ),
        (
            "a claim's step without annotations",
            json!({"hooks": {"createRuntime": [step(1)]}}),
            Claim(handle(1), vec![]),
        ),
        (
            "a claim's step and a gpuplex.io value that is no string",
            spec(json!({"gpuplex.io/weight": 3}), vec![step(1)]),
            Claim(handle(1), vec![]),
        ),
        (
            "a claim's step in a sandbox (as today: steps come before the sandbox rule)",
            spec(
                json!({"io.kubernetes.cri.container-type": "sandbox"}),
                vec![step(1)],
            ),
            Claim(handle(1), vec![]),
        ),
        (
            "a claim's step and annotations",
            spec(memory.clone(), vec![step(1)]),
            Refused(SpecRefusal::ClaimAndAnnotations),
        ),
        (
            "a forged step",
            spec(json!({}), vec![forged.clone()]),
            Refused(SpecRefusal::AttachStep(FORGED.into())),
        ),
        (
            "two steps",
            spec(json!({}), vec![step(1), step(2)]),
            Refused(SpecRefusal::AttachStep(TWO_STEPS.into())),
        ),
        (
            "the same step twice",
            spec(json!({}), vec![step(1), step(1)]),
            Refused(SpecRefusal::AttachStep(TWO_STEPS.into())),
        ),
        // An allocation's container.
        (
            "an allocation",
            spec(
                json!({
                    "gpuplex.io/allocation": h(1),
                    "gpuplex.io/weight": "3",
                    "gpuplex.io/odd": 7,
                    "io.kubernetes.cri.sandbox-name": "p",
                    "io.kubernetes.pod.namespace": "ml",
                    "io.kubernetes.cri.container-type": "container",
                    "other.io/x": "y",
                }),
                vec![other_hook()],
            ),
            Allocation(
                handle(1),
                keys(&[
                    "gpuplex.io/weight",
                    "io.kubernetes.cri.sandbox-name",
                    "io.kubernetes.pod.namespace",
                ]),
                vec![other_hook()],
            ),
        ),
        (
            "an allocation and its own step",
            spec(json!({"gpuplex.io/allocation": h(1)}), vec![step(1)]),
            Allocation(handle(1), keys(&[]), vec![]),
        ),
        (
            "an allocation and a step of another",
            spec(json!({"gpuplex.io/allocation": h(1)}), vec![step(2)]),
            Refused(SpecRefusal::TwoAllocations),
        ),
        (
            "an allocation and a forged step",
            spec(json!({"gpuplex.io/allocation": "../x"}), vec![forged]),
            Refused(SpecRefusal::AttachStep(FORGED.into())),
        ),
        (
            "an allocation that is a path",
            spec(json!({"gpuplex.io/allocation": "../../x"}), vec![]),
            Refused(SpecRefusal::AllocationNotAHandle),
        ),
        (
            "an allocation that is a number",
            spec(json!({"gpuplex.io/allocation": 7}), vec![]),
            Refused(SpecRefusal::AllocationNotAHandle),
        ),
        (
            "an allocation that is empty",
            spec(json!({"gpuplex.io/allocation": ""}), vec![]),
            Refused(SpecRefusal::AllocationNotAHandle),
        ),
        (
            "an allocation in upper case",
            spec(
                json!({"gpuplex.io/allocation": h(0xab).to_uppercase()}),
                vec![],
            ),
            Refused(SpecRefusal::AllocationNotAHandle),
        ),
        (
            "an allocation in a sandbox (as today)",
            spec(
                json!({"gpuplex.io/allocation": h(1), "io.kubernetes.cri.container-type": "sandbox"}),
                vec![],
            ),
            Allocation(handle(1), keys(&[]), vec![]),
        ),
    ];
    let mut failed = Vec::new();
    for (name, spec, expected) in cases {
        let got = seen(classify(&spec));
        if got != expected {
            failed.push(format!("{name}: expected {expected:?}, got {got:?}"));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn the_spec_kept_is_the_input_without_the_step_alone() {
    let input = spec(
        json!({"gpuplex.io/allocation": handle(4).to_string()}),
        vec![other_hook(), step(4)],
    );
    let Ok(VgpuOrigin::Allocation { spec: kept, .. }) = classify(&input) else {
        panic!("an allocation");
    };
    let mut expected = input.clone();
    expected["hooks"]["createRuntime"] = json!([other_hook()]);
    assert_eq!(kept, expected);
}

#[test]
fn every_refusal_is_one_line_naming_what_is_wrong() {
    let refusals = [
        SpecRefusal::AttachStep(FORGED.into()),
        SpecRefusal::AllocationNotAHandle,
        SpecRefusal::TwoAllocations,
        SpecRefusal::ClaimAndAnnotations,
    ];
    let words = [
        "attach hook",
        "gpuplex.io/allocation",
        "two gpuplex allocations",
        "two vGPUs",
    ];
    for (refusal, words) in refusals.iter().zip(words) {
        let line = refusal.to_string();
        assert!(line.contains(words) && !line.contains('\n'), "{line}");
    }
}

#[test]
fn huge_specs_are_classified_like_small_ones() {
    let many: serde_json::Map<String, Value> = (0..100_000)
        .map(|i| (format!("other.io/k{i}"), json!("v".repeat(16))))
        .collect();
    assert_eq!(
        classify(&spec(Value::Object(many.clone()), vec![])),
        Ok(VgpuOrigin::NoVgpu)
    );

    let mut asked = many;
    asked.insert("gpuplex.io/weight".into(), json!("9".repeat(1 << 20)));
    let Ok(VgpuOrigin::Annotations(found)) = classify(&spec(Value::Object(asked), vec![])) else {
        panic!("annotations");
    };
    assert_eq!(found.keys().collect::<Vec<_>>(), ["gpuplex.io/weight"]);

    let hooks: Vec<Value> = (0..10_000).map(|_| other_hook()).chain([step(3)]).collect();
    let Ok(VgpuOrigin::Claim {
        handle: found,
        spec,
    }) = classify(&spec(json!({}), hooks))
    else {
        panic!("a claim");
    };
    assert_eq!(found, handle(3));
    assert_eq!(
        spec["hooks"]["createRuntime"].as_array().unwrap().len(),
        10_000
    );
}

#[test]
fn a_pods_sandbox_gets_no_vgpu() {
    let sandbox = json!({"annotations":{"io.kubernetes.cri.container-type":"sandbox","gpuplex.io/gpu-memory":"2Gi"}});
    let workload = json!({"annotations":{"io.kubernetes.cri.container-type":"container","gpuplex.io/gpu-memory":"2Gi"}});
    assert!(is_sandbox(&sandbox));
    assert!(!is_sandbox(&workload));
    assert!(!is_sandbox(&json!({})));
    assert!(!is_sandbox(&json!("not an object")));
    assert_eq!(classify(&sandbox), Ok(VgpuOrigin::NoVgpu));
    assert!(matches!(
        classify(&workload),
        Ok(VgpuOrigin::Annotations(_))
    ));
}

#[test]
fn an_allocations_container_brings_its_handle_weight_and_pod() {
    let handle = "5a".repeat(16);
    let config = json!({"annotations": {
        "gpuplex.io/allocation": handle,
        "gpuplex.io/weight": "3",
        "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.container-type": "container",
        "other.io/x": "y",
    }});
    let found = allocation_of(&config).unwrap().unwrap();
    assert_eq!(found.handle.to_string(), handle);
    let asked: Vec<&str> = found.asked.keys().map(String::as_str).collect();
    assert_eq!(
        asked,
        ["gpuplex.io/weight", "io.kubernetes.cri.sandbox-namespace"]
    );
    assert!(
        allocation_of(&json!({"annotations": {"gpuplex.io/weight": "3"}}))
            .unwrap()
            .is_none()
    );
    for forged in [json!("../../x"), json!(7)] {
        let config = json!({"annotations": {"gpuplex.io/allocation": forged}});
        let line = allocation_of(&config).unwrap_err().to_string();
        assert!(
            line.contains("not a handle") && !line.contains('\n'),
            "{line}"
        );
    }
}
