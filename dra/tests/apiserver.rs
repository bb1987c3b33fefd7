//! The driver against a test server that speaks Kubernetes' REST JSON for ResourceClaims and
//! ResourceSlices (resource.k8s.io/v1, the shapes of k8s-openapi): reads, creates, replaces
//! with resource versions and 409 conflicts, and watches. No kube-apiserver can run on these
//! machines; this is the boundary as the driver's client sees it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use gpuplex_dra::apiserver::{keep_published, ApiClaims, Published, SlicePublisher};
use gpuplex_dra::claim::ClaimRef;
use gpuplex_dra::driver::Claims;
use gpuplex_dra::slice::devices;
use gpuplex_scheduler::node::GpuStatus;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// What the server holds, and who watches.
#[derive(Default)]
struct State {
    version: u64,
    slices: HashMap<String, Value>,
    claims: HashMap<(String, String), Value>,
    watchers: Vec<(String, mpsc::UnboundedSender<Value>)>,
    /// Every event, with the resource version it happened at: a watch from version v is sent
    /// the events after v first, as the API server does.
    log: Vec<(u64, String, Value)>,
    /// Replaces by the driver that were answered 409.
    conflicts: usize,
    /// The next replace is answered 409 after another writer's change (a race).
    race_next_replace: bool,
}

impl State {
    fn stamp(&mut self, object: &mut Value) {
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
    }

    fn tell(&mut self, kind: &str, object: &Value) {
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let event = json!({"type": kind, "object": object});
        self.log.push((self.version, name.clone(), event.clone()));
        self.watchers
            .retain(|(watched, tx)| *watched != name || tx.send(event.clone()).is_ok());
    }

    /// Another writer changes the slice (an operator's `kubectl edit`).
    fn edit_slice(&mut self, name: &str, edit: impl FnOnce(&mut Value)) {
        let mut object = self.slices.remove(name).expect("a slice");
        edit(&mut object);
        self.stamp(&mut object);
        self.slices.insert(name.to_owned(), object.clone());
        self.tell("MODIFIED", &object);
    }

    fn delete_slice(&mut self, name: &str) {
        let mut object = self.slices.remove(name).expect("a slice");
        self.stamp(&mut object);
        self.tell("DELETED", &object);
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn status(code: StatusCode, reason: &str, message: String) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    reply(code, &body)
}

fn reply(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

/// A body the driver sent must be the object's type, field for field.
fn typed<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<Value, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    serde_json::from_value::<T>(value.clone()).map_err(|e| e.to_string())?;
    Ok(value)
}

async fn serve(
    state: Arc<Mutex<State>>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or_default().to_owned();
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let mut s = state.lock().unwrap();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let response = match (&method, parts.as_slice()) {
        (
            &Method::GET,
            ["apis", "resource.k8s.io", "v1", "namespaces", ns, "resourceclaims", name],
        ) => match s.claims.get(&(ns.to_string(), name.to_string())) {
            Some(claim) => reply(StatusCode::OK, claim),
            None => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
            ),
        },
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices"])
            if query.contains("watch=true") =>
        {
            let field = query
                .split('&')
                .find_map(|p| p.strip_prefix("fieldSelector="))
                .map(|f| f.replace("%3D", "=").replace("%3d", "="))
                .unwrap_or_default();
            let name = field
                .strip_prefix("metadata.name=")
                .unwrap_or_default()
                .to_owned();
            let since: u64 = query
                .split('&')
                .find_map(|p| p.strip_prefix("resourceVersion="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let (tx, rx) = mpsc::unbounded_channel::<Value>();
            for (version, about, event) in &s.log {
                if *version > since && *about == name {
                    let _ = tx.send(event.clone());
                }
            }
            s.watchers.push((name, tx));
            let lines = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
                .map(|event| Ok::<_, Infallible>(Frame::data(Bytes::from(format!("{event}\n")))));
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(BodyExt::boxed(StreamBody::new(lines)))
                .unwrap()
        }
        (&Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            match s.slices.get(*name) {
                Some(slice) => reply(StatusCode::OK, slice),
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("resourceslices.resource.k8s.io \"{name}\" not found"),
                ),
            }
        }
        (&Method::POST, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
            match typed::<ResourceSlice>(&body) {
                Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", e),
                Ok(mut slice) => {
                    let name = slice["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    if s.slices.contains_key(&name) {
                        status(
                            StatusCode::CONFLICT,
                            "AlreadyExists",
                            format!("resourceslices.resource.k8s.io \"{name}\" already exists"),
                        )
                    } else {
                        s.stamp(&mut slice);
                        slice["metadata"]["uid"] = json!(format!("uid-{}", s.version));
                        s.slices.insert(name, slice.clone());
                        s.tell("ADDED", &slice);
                        reply(StatusCode::CREATED, &slice)
                    }
                }
            }
        }
        (&Method::PUT, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
            match typed::<ResourceSlice>(&body) {
                Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", e),
                Ok(mut slice) => {
                    let name = name.to_string();
                    if s.race_next_replace {
                        s.race_next_replace = false;
                        s.edit_slice(&name, |o| {
                            o["metadata"]["labels"] = json!({"edited": "by-someone-else"})
                        });
                    }
                    let current = s
                        .slices
                        .get(&name)
                        .map(|o| o["metadata"]["resourceVersion"].clone());
                    match current {
                        None => status(
                            StatusCode::NOT_FOUND,
                            "NotFound",
                            format!("resourceslices.resource.k8s.io \"{name}\" not found"),
                        ),
                        Some(v) if v != slice["metadata"]["resourceVersion"] => {
                            s.conflicts += 1;
                            status(StatusCode::CONFLICT, "Conflict", format!("Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"))
                        }
                        Some(_) => {
                            s.stamp(&mut slice);
                            s.slices.insert(name, slice.clone());
                            s.tell("MODIFIED", &slice);
                            reply(StatusCode::OK, &slice)
                        }
                    }
                }
            }
        }
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{method} {path}: not served by this test"),
        ),
    };
    Ok(response)
}

use futures_util::StreamExt;

/// Starts the server; its URL.
async fn start(state: Arc<Mutex<State>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |r| serve(Arc::clone(&state), r));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

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
