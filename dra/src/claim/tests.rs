//! Claims as the API server serves them, read into what the node is asked for.

use super::*;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

fn asked() -> ClaimRef {
    ClaimRef {
        namespace: "ml".into(),
        name: "trainer-gpu".into(),
        uid: "8d5c6f1e-0000-4000-8000-000000000001".into(),
    }
}

fn result(device: &str, memory: &str) -> Value {
    json!({
        "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device,
        "shareID": "0f6e2c1a-0000-4000-8000-00000000000a",
        "consumedCapacity": {"memory": memory},
    })
}

fn claim(results: Value, config: Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "trainer-gpu", "namespace": "ml", "uid": asked().uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpuplex.io",
            "capacity": {"requests": {"memory": "8Gi"}},
        }}]}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }))
    .expect("a ResourceClaim")
}

fn opaque(source: &str, parameters: Value) -> Value {
    json!({"source": source, "opaque": {"driver": DRIVER, "parameters": parameters}})
}

#[test]
fn an_allocated_claim_becomes_a_placement_with_its_config() {
    let c = claim(
        json!([result("gpu-1", "8Gi")]),
        json!([
            opaque("FromClass", json!({"apiVersion": "gpuplex.io/v1", "kind": "VgpuConfig", "weight": 2, "priority": "low"})),
            opaque("FromClaim", json!({"apiVersion": "gpuplex.io/v1", "kind": "VgpuConfig", "priority": "high"})),
            {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"x": 1}}},
        ]),
    );
    let plan = plan(&c, &asked(), "node-a").unwrap();
    assert_eq!(
        plan.placement,
        Placement {
            gpus: vec![GpuIndex(1)],
            memory: 8 * GIB
        }
    );
    assert_eq!(plan.annotations["gpuplex.io/weight"], "2");
    assert_eq!(
        plan.annotations["gpuplex.io/priority"], "high",
        "the claim's wins"
    );
    assert_eq!(plan.annotations["io.kubernetes.pod.namespace"], "ml");
    assert_eq!(
        plan.devices,
        vec![AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: "gpu-1".into()
        }]
    );
}

#[test]
fn two_devices_are_a_gang_with_the_same_memory_on_each() {
    let c = claim(
        json!([result("gpu-0", "4Gi"), result("gpu-3", "4Gi")]),
        json!([]),
    );
    let plan = plan(&c, &asked(), "node-a").unwrap();
    assert_eq!(plan.placement.gpus, vec![GpuIndex(0), GpuIndex(3)]);
    assert_eq!(plan.placement.memory, 4 * GIB);
    assert_eq!(plan.devices.len(), 2);
    let uneven = claim(
        json!([result("gpu-0", "4Gi"), result("gpu-1", "8Gi")]),
        json!([]),
    );
    let e = super::plan(&uneven, &asked(), "node-a").unwrap_err();
    assert_eq!(e, ClaimError::UnevenMemory(asked().to_string()));
}

#[test]
fn every_bad_claim_is_refused_in_one_line_naming_it() {
    let config = |parameters: Value| json!([opaque("FromClaim", parameters)]);
    let vgpu = |extra: Value| {
        let mut p = json!({"apiVersion": "gpuplex.io/v1", "kind": "VgpuConfig"});
        p.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        p
    };
    let cases: Vec<(ResourceClaim, &str, &str)> = vec![
        (
            claim(
                json!([result("gpu-0", "8Gi")]),
                config(vgpu(json!({"weight": 0}))),
            ),
            "node-a",
            "claim ml/trainer-gpu: VgpuConfig: weight: `0` is invalid: expected a whole number from 1 to 100",
        ),
        (
            claim(
                json!([result("gpu-0", "8Gi")]),
                config(vgpu(json!({"priority": "urgent"}))),
            ),
            "node-a",
            "claim ml/trainer-gpu: VgpuConfig: priority: `urgent` is invalid",
        ),
        (
            claim(
                json!([result("gpu-0", "8Gi")]),
                config(vgpu(json!({"wieght": 2}))),
            ),
            "node-a",
            "claim ml/trainer-gpu: VgpuConfig: unknown field `wieght`",
        ),
        (
            claim(
                json!([result("gpu-0", "8Gi")]),
                config(json!({"apiVersion": "gpuplex.io/v2", "kind": "VgpuConfig"})),
            ),
            "node-a",
            "apiVersion gpuplex.io/v2 and kind VgpuConfig are not gpuplex.io/v1 and VgpuConfig",
        ),
        (
            claim(
                json!([result("gpu-0", "8Gi")]),
                config(vgpu(json!({"weight": [2]}))),
            ),
            "node-a",
            "weight: [2] is neither a number nor a string",
        ),
        (
            claim(json!([result("gpu-0", "8Gi")]), json!([])),
            "node-b",
            "claim ml/trainer-gpu: device gpu-0 is in pool node-a, not this node's (node-b)",
        ),
        (
            claim(json!([result("gpu-01", "8Gi")]), json!([])),
            "node-a",
            "device gpu-01 is not a gpuplex GPU",
        ),
        (
            claim(json!([result("gpu-0", "eight")]), json!([])),
            "node-a",
            "claim ml/trainer-gpu: device gpu-0: ",
        ),
        (
            claim(
                json!([{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]),
                json!([]),
            ),
            "node-a",
            "the allocation consumes no memory",
        ),
        (
            claim(
                json!([{"request": "nic", "driver": "nic.example.com", "pool": "node-a", "device": "eth1"}]),
                json!([]),
            ),
            "node-a",
            "claim ml/trainer-gpu: no device of its allocation is gpuplex.io's",
        ),
    ];
    for (c, node, message) in cases {
        let line = plan(&c, &asked(), node).unwrap_err().to_string();
        assert!(line.contains(message), "{line}\n  expected: {message}");
        assert!(!line.contains('\n'), "{line}");
    }
    let mut replaced = claim(json!([result("gpu-0", "8Gi")]), json!([]));
    replaced.metadata.uid = Some("another".into());
    let line = plan(&replaced, &asked(), "node-a").unwrap_err().to_string();
    assert!(line.contains("its uid is another now"), "{line}");
    let mut pending = claim(json!([]), json!([]));
    pending.status = None;
    assert_eq!(
        plan(&pending, &asked(), "node-a").unwrap_err(),
        ClaimError::NotAllocated(asked().to_string())
    );
}

#[test]
fn device_names_are_the_gpus_indexes() {
    assert_eq!(device_name(3), "gpu-3");
    for i in [0, 7, 1023, u32::MAX] {
        assert_eq!(device_index(&device_name(i)), Some(i));
    }
    for bad in [
        "gpu-",
        "gpu-01",
        "gpu--1",
        "gpu-1a",
        "GPU-1",
        "gpu-4294967296",
        "../gpu-1",
    ] {
        assert_eq!(device_index(bad), None, "{bad}");
    }
}
