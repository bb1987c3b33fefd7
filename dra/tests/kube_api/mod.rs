//! A test server speaking Kubernetes' REST JSON for ResourceClaims and ResourceSlices
//! (resource.k8s.io/v1, the shapes of k8s-openapi): reads, creates, replaces with resource
//! versions and 409 conflicts, and watches that replay the events after the version asked. No
//! kube-apiserver can run on these machines; this is the boundary as the driver's client sees it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// What the server holds, and who watches.
#[derive(Default)]
pub struct State {
    pub version: u64,
    pub slices: HashMap<String, Value>,
    pub claims: HashMap<(String, String), Value>,
    pub watchers: Vec<(String, mpsc::UnboundedSender<Value>)>,
    /// Every event, with the resource version it happened at: a watch from version v is sent
    /// the events after v first, as the API server does.
    pub log: Vec<(u64, String, Value)>,
    /// Replaces by the driver that were answered 409.
    pub conflicts: usize,
    /// The next replace is answered 409 after another writer's change (a race).
    pub race_next_replace: bool,
    /// How long a claim's read waits before it is answered (a slow API server: the soak's
    /// kubelet stand-in restarts the plugin while a prepare waits for its claim).
    pub claim_delay: std::time::Duration,
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
    pub fn edit_slice(&mut self, name: &str, edit: impl FnOnce(&mut Value)) {
        let mut object = self.slices.remove(name).expect("a slice");
        edit(&mut object);
        self.stamp(&mut object);
        self.slices.insert(name.to_owned(), object.clone());
        self.tell("MODIFIED", &object);
    }

    pub fn delete_slice(&mut self, name: &str) {
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
    if method == Method::GET && path.contains("/resourceclaims/") {
        let delay = state.lock().unwrap().claim_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
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

/// Starts the server; its URL.
pub async fn start(state: Arc<Mutex<State>>) -> String {
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

/// A kubeconfig naming the server at `url`, without credentials.
pub fn kubeconfig(url: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\nusers:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\ncurrent-context: test\n"
    )
}
