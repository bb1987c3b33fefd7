//! The device plugin's allocations (`allocate`), against the real service with real cgroups
//! (root): units pinned on their GPU, the first container's weight, units given again ending the
//! allocation that held them (its container thawed and let go), and kill -9 keeping the units.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::*;

use gpuplex_cgroup::FreezerVersion::V1;

const GIB: u64 = 1 << 30;

fn allocate(service: &NodeService, units: &[&str]) -> Value {
    service.ask(&json!({"op": "allocate", "units": units, "unit": GIB}))
}

#[test]
fn units_are_pinned_weighted_by_their_container_and_end_when_given_again() {
    if !can_run("units_are_pinned_weighted_by_their_container_and_end_when_given_again") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup {
        gpus: 2,
        reservation_ttl: "1s",
        ..Setup::default()
    });
    let first = allocate(&service, &["gpu-1-0", "gpu-1-1", "gpu-1-2", "gpu-1-3"]);
    assert_eq!(first["ok"], true, "{first}");
    let vgpu = first["vgpu"]["id"].clone();
    let handle = first["vgpu"]["handle"].as_str().unwrap().to_owned();
    assert_eq!(first["vgpu"]["gpus"][0]["index"], 1);
    assert_eq!(first["vgpu"]["gpus"][0]["memory"], 4 * GIB);
    let status = service.status();
    assert_eq!(status["gpus"][1]["unreserved"], json!(12 * GIB));
    assert_eq!(status["reservations"][0]["claim"], "units-gpu-1-0");
    // A retry: the same vGPU and handle.
    let again = allocate(&service, &["gpu-1-3", "gpu-1-2", "gpu-1-1", "gpu-1-0"]);
    assert_eq!(
        (&again["vgpu"]["id"], &again["vgpu"]["handle"]),
        (&vgpu, &json!(handle))
    );
    let spread = allocate(&service, &["gpu-0-0", "gpu-1-9"]);
    assert!(
        spread["error"].as_str().unwrap().contains("on GPUs 0, 1"),
        "{spread}"
    );

    // Its container brings the pod's weight; well past reservation_ttl, nothing lapses.
    let mut c = TestCgroup::new(V1, "units-a");
    c.spawn_busy();
    let attached = service.ask(&json!({
        "op": "attach", "handle": handle, "container": "ctr-a",
        "cgroup": c.path.to_str().unwrap(),
        "annotations": {"gpuplex.io/weight": "3", "io.kubernetes.cri.sandbox-namespace": "ml"},
    }));
    assert_eq!(attached["vgpu"]["weight"], 3, "{attached}");
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(service.container("ctr-a").unwrap()["vgpu"], vgpu);

    // kill -9 and a restart keep the allocation, its units and its weight.
    service.kill9();
    service.spawn();
    assert_eq!(service.container("ctr-a").unwrap()["vgpu"], vgpu);
    let again = allocate(&service, &["gpu-1-0", "gpu-1-1", "gpu-1-2", "gpu-1-3"]);
    assert_eq!(again["vgpu"]["id"], vgpu, "{again}");
    assert_eq!(again["vgpu"]["weight"], 3);

    // A busy neighbour freezes it now and then; then the kubelet gives unit 3 to another
    // container: the pod is gone, and its vGPU with it, its cgroup left thawed.
    let mut n = TestCgroup::new(V1, "units-neighbour");
    n.spawn_busy();
    let neighbour = allocate(&service, &["gpu-1-4", "gpu-1-5"]);
    let attached = service.ask(&json!({
        "op": "attach", "handle": neighbour["vgpu"]["handle"], "container": "ctr-n",
        "cgroup": n.path.to_str().unwrap(),
    }));
    assert_eq!(attached["ok"], true, "{attached}");
    wait_until(Duration::from_secs(5), || c.is_frozen()).expect("windows are taken in turn");
    let next = allocate(&service, &["gpu-1-3", "gpu-1-6"]);
    assert_eq!(next["ok"], true, "{next}");
    assert_ne!(next["vgpu"]["id"], vgpu);
    assert!(service.container("ctr-a").is_none());
    assert!(!c.is_frozen(), "a released container is left thawed");
    let status = service.status();
    assert_eq!(status["gpus"][1]["unreserved"], json!(12 * GIB), "{status}");
    assert!(service.log_text().contains("the kubelet gave its units"));
    c.kill_all();
    n.kill_all();
}
