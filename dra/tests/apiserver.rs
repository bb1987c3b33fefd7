//! The driver's API server side against the test server of `kube_api/`: the slice created,
//! replaced on change, read again after a conflict, put back after another writer's change or
//! delete (watches); claims read.

mod kube_api;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplex_dra::apiserver::{keep_published, ApiClaims, Published, SlicePublisher};
use gpuplex_dra::claim::ClaimRef;
use gpuplex_dra::driver::Claims;
use gpuplex_dra::slice::devices;
use gpuplex_scheduler::node::GpuStatus;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube_api::{start, State};
use serde_json::json;

fn client(url: &str) -> kube::Client {
    gpuplex_dra::apiserver::client(kube::Config::new(url.parse().unwrap())).unwrap()
}

fn gpu(index: u32, capacity: u64) -> GpuStatus {
    GpuStatus {
        index,
        uuid: format!("GPU-fake-{index}"),
        model: "Fake A100".into(),
        memory: capacity,
        fake: true,
        capacity,
        healthy: true,
        unreserved: capacity,
        holder: None,
        busy_seconds: 0.0,
        switches: 0,
        containers: Vec::new(),
        reservations: Vec::new(),
    }
}

fn generation(state: &Mutex<State>) -> i64 {
    state.lock().unwrap().slices["node-a-gpuplex.io"]["spec"]["pool"]["generation"]
        .as_i64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_is_created_replaced_on_change_and_conflicts_are_read_again() {
    let state = Arc::new(Mutex::new(State::default()));
    let url = start(Arc::clone(&state)).await;
    let publisher = SlicePublisher::new(client(&url), "node-a");
    let two = devices(&[gpu(0, 40 << 30), gpu(1, 40 << 30)]);
    assert_eq!(publisher.publish(&two).await.unwrap(), Published::Created);
    assert_eq!(publisher.publish(&two).await.unwrap(), Published::Unchanged);
    assert_eq!(generation(&state), 1);
    let stored: ResourceSlice =
        serde_json::from_value(state.lock().unwrap().slices["node-a-gpuplex.io"].clone()).unwrap();
    assert_eq!(stored.spec.devices.as_ref().unwrap().len(), 2);
    // The node's capacity changed (memory_overcommit raised): the spec is replaced, the pool's
    // generation goes up.
    let more = devices(&[gpu(0, 60 << 30), gpu(1, 60 << 30)]);
    assert_eq!(publisher.publish(&more).await.unwrap(), Published::Updated);
    assert_eq!(generation(&state), 2);
    // Someone else writes in between the driver's read and its replace: 409, read again, done.
    state.lock().unwrap().race_next_replace = true;
    let one = devices(&[gpu(0, 60 << 30)]);
    assert_eq!(publisher.publish(&one).await.unwrap(), Published::Updated);
    assert_eq!(state.lock().unwrap().conflicts, 1);
    let stored: ResourceSlice =
        serde_json::from_value(state.lock().unwrap().slices["node-a-gpuplex.io"].clone()).unwrap();
    assert_eq!(stored.spec.devices.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_another_writer_changes_or_deletes_is_put_back_at_once() {
    let state = Arc::new(Mutex::new(State::default()));
    let url = start(Arc::clone(&state)).await;
    let publisher = SlicePublisher::new(client(&url), "node-a");
    let wanted = devices(&[gpu(0, 40 << 30)]);
    let kept = wanted.clone();
    // An hour between periodic publishes: only the watch can bring it back in time.
    let task = tokio::spawn(keep_published(
        publisher,
        Duration::from_secs(3600),
        move || Some(kept.clone()),
    ));
    let has = |state: &Mutex<State>, devices: usize| {
        state
            .lock()
            .unwrap()
            .slices
            .get("node-a-gpuplex.io")
            .is_some_and(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len) == devices)
    };
    // Well within the hour between periodic publishes, even on a loaded machine.
    let within = |state: Arc<Mutex<State>>, devices: usize| async move {
        for _ in 0..500 {
            if has(&state, devices) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(within(Arc::clone(&state), 1).await, "published");
    // Wait for the watch to be set up.
    for _ in 0..100 {
        if !state.lock().unwrap().watchers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state
        .lock()
        .unwrap()
        .edit_slice("node-a-gpuplex.io", |o| o["spec"]["devices"] = json!([]));
    assert!(
        within(Arc::clone(&state), 1).await,
        "put back after an edit"
    );
    state.lock().unwrap().delete_slice("node-a-gpuplex.io");
    assert!(
        within(Arc::clone(&state), 1).await,
        "put back after a delete"
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_read_as_the_api_server_has_them() {
    let state = Arc::new(Mutex::new(State::default()));
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ml", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
    });
    state
        .lock()
        .unwrap()
        .claims
        .insert(("ml".into(), "c".into()), claim);
    let url = start(Arc::clone(&state)).await;
    let claims = ApiClaims::new(client(&url));
    let asked = ClaimRef {
        namespace: "ml".into(),
        name: "c".into(),
        uid: "u-1".into(),
    };
    let found: ResourceClaim = claims.get(&asked).await.unwrap();
    assert_eq!(found.metadata.uid.as_deref(), Some("u-1"));
    let missing = ClaimRef {
        name: "gone".into(),
        ..asked
    };
    let line = claims.get(&missing).await.unwrap_err();
    assert!(
        line.contains("\"gone\" not found") && line.contains("404"),
        "{line}"
    );
}
