//! The kubelet's side of `gpuplex-dra` for `make soak` (tests/soak/kubelet.py): the real plugin
//! binary driven over its real sockets, as the kubelet drives it, with the claims served by the
//! API server stand-in of `tests/kube_api/`. No kubelet or kube-apiserver runs on these machines.
//!
//! `kubelet-standin --dir DIR [--node NAME]` makes, under DIR, the kubelet's plugin registry
//! (`registry/`), the DRA driver's socket directory (`plugins/`), the device plugins' directory
//! with the kubelet's registration socket served in it (`device-plugins/kubelet.sock`), and a
//! kubeconfig naming the API server stand-in (`kubeconfig`); its first line on stdout says
//! where each is, for the plugins' command lines:
//!
//! ```text
//! {"ok":true,"ready":{"kubeconfig":..,"registry_dir":..,"plugin_dir":..,"kubelet_socket":..,"api":..,"node":..}}
//! ```
//!
//! Then it reads one JSON command per line on stdin and answers each with one JSON line on
//! stdout, `{"ok":true,...}` or `{"ok":false,"error":"<one line>"}` (with `"code"`, the gRPC
//! status code, when the plugin answered with one or could not be reached: `"Unavailable"`).
//! Commands run concurrently; an `"id"` in a command is echoed in its answer. Commands:
//!
//! ```text
//! {"op":"claim","namespace":"ml","name":"job","uid":"..","gpu":"gpu-1","memory":"2Gi"}
//!     (optional: "gpu" a list for a claim on several GPUs, "weight", "priority", "pool";
//!      or "object": a whole ResourceClaim) the allocated claim served by the API stand-in
//! {"op":"delete_claim","namespace":"ml","name":"job"}   (or "uid")
//! {"op":"api","claim_delay_ms":1500}      a slow API server: claims' reads wait this long
//! {"op":"slices"}                         the ResourceSlices the driver published
//! {"op":"register","timeout_ms":20000}    the DRA driver's registration (GetInfo, then
//!                                         NotifyRegistrationStatus), as the kubelet's plugin
//!                                         watcher does when the socket appears
//! {"op":"prepare","uids":[..]}            NodePrepareResources (v1) of claims the stand-in
//!                                         serves (or "claims":[{"namespace","name","uid"}]);
//!                                         answers "claims": {uid: {"devices":[..],"error":".."}}
//! {"op":"unprepare","uids":[..]}          NodeUnprepareResources: {uid: {"error":".."}}
//! {"op":"dp_registrations","at_least":1,"timeout_ms":20000}
//!                                         the device plugins that registered (waiting for at
//!                                         least that many registrations)
//! {"op":"list","timeout_ms":20000}        ListAndWatch's first non-empty list: "units"
//! {"op":"preferred","available":[..],"must_include":[..],"size":4}
//!                                         GetPreferredAllocation: "units"
//! {"op":"allocate","units":[..]}          Allocate for one container (or "containers": [[..],..]):
//!                                         "containers": [{envs, mounts, devices, annotations,
//!                                         cdi_devices}]
//! {"op":"quit"}                           (or end of input) the stand-in stops
//! ```
//!
//! Every gRPC call has `timeout_ms` (default 30 s). Built with `cargo build --release -p
//! gpuplex-dra --example kubelet-standin` (an example, so that it shares the tests' API server
//! and gRPC helpers, which are dev-dependencies, and ships in no package).

#[path = "../tests/kube_api/mod.rs"]
mod kube_api;
#[path = "../tests/unix_grpc/mod.rs"]
mod unix_grpc;

use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplex_dra::proto::deviceplugin as dp;
use gpuplex_dra::proto::dra_v1 as v1;
use gpuplex_dra::proto::registration::registration_client::RegistrationClient;
use gpuplex_dra::proto::registration::{InfoRequest, RegistrationStatus};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;

/// The longest command line read (a longer one is answered with an error, unread).
const MAX_LINE: usize = 1 << 20;
/// How long a gRPC call may take by default.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The DRA driver whose registration is accepted.
const DRIVER: &str = "gpuplex.io";
/// The DRA service version the kubelet speaks to it (the highest both know).
const DRA_VERSION: &str = "v1.DRAPlugin";

/// A command's failure: one line, and the gRPC code when there is one.
struct Failure {
    error: String,
    code: Option<&'static str>,
}

impl Failure {
    fn new(error: impl Into<String>) -> Failure {
        Failure {
            error: one_line(&error.into()),
            code: None,
        }
    }

    fn unavailable(error: impl Into<String>) -> Failure {
        Failure {
            error: one_line(&error.into()),
            code: Some("Unavailable"),
        }
    }

    fn status(call: &str, status: &tonic::Status) -> Failure {
        Failure {
            error: one_line(&format!("{call}: {}", status.message())),
            code: Some(code_name(status.code())),
        }
    }
}

type Answer = Result<Value, Failure>;

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "Ok",
        Cancelled => "Cancelled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// The kubelet's registration service for device plugins: who registered, in order.
#[derive(Clone, Default)]
struct DevicePluginRegistry(Arc<Mutex<Vec<dp::RegisterRequest>>>);

#[tonic::async_trait]
impl dp::registration_server::Registration for DevicePluginRegistry {
    async fn register(
        &self,
        request: tonic::Request<dp::RegisterRequest>,
    ) -> Result<tonic::Response<dp::Empty>, tonic::Status> {
        let asked = request.into_inner();
        // What the kubelet's device manager refuses.
        if asked.version != "v1beta1" {
            return Err(tonic::Status::invalid_argument(format!(
                "version {:?} is not v1beta1",
                asked.version
            )));
        }
        if asked.endpoint.is_empty() || asked.endpoint.contains('/') {
            return Err(tonic::Status::invalid_argument(format!(
                "endpoint {:?} is not a socket name in the device plugins' directory",
                asked.endpoint
            )));
        }
        lock(&self.0).push(asked);
        Ok(tonic::Response::new(dp::Empty {}))
    }
}

/// A mutex's contents, also after a panic elsewhere (nothing here is left half-changed).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The kubelet as the stand-in plays it.
struct Kubelet {
    node: String,
    api: Arc<Mutex<kube_api::State>>,
    registry_dir: PathBuf,
    device_plugins_dir: PathBuf,
    /// The DRA driver's service socket, once registered.
    dra_endpoint: Mutex<Option<PathBuf>>,
    device_plugins: DevicePluginRegistry,
}

fn ms(value: Option<u64>) -> Duration {
    value.map_or(CALL_TIMEOUT, Duration::from_millis)
}

/// A command's fields, read strictly: an unknown field is an error.
fn fields<T: DeserializeOwned>(op: &str, command: Value) -> Result<T, Failure> {
    serde_json::from_value(command).map_err(|e| Failure::new(format!("{op}: {e}")))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrText {
    Number(u64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimFields {
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
    gpu: Option<OneOrMany>,
    memory: Option<String>,
    weight: Option<NumberOrText>,
    priority: Option<String>,
    pool: Option<String>,
    object: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimName {
    namespace: Option<String>,
    name: Option<String>,
    uid: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiFields {
    claim_delay_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Timeout {
    timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimsFields {
    uids: Option<Vec<String>>,
    claims: Option<Vec<ClaimName>>,
    timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistrationsFields {
    at_least: Option<usize>,
    timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PreferredFields {
    available: Vec<String>,
    #[serde(default)]
    must_include: Vec<String>,
    size: i32,
    timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllocateFields {
    units: Option<Vec<String>>,
    containers: Option<Vec<Vec<String>>>,
    timeout_ms: Option<u64>,
}

/// `call` within `timeout`, its error one line.
async fn within<T>(
    name: &str,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(Failure {
            error: format!("{name}: no answer within {} ms", timeout.as_millis()),
            code: Some("DeadlineExceeded"),
        }),
        Ok(Err(status)) => Err(Failure::status(name, &status)),
        Ok(Ok(response)) => Ok(response.into_inner()),
    }
}

async fn connect(what: &str, socket: &Path) -> Result<tonic::transport::Channel, Failure> {
    unix_grpc::try_channel(socket).await.map_err(|e| {
        let mut why = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(inner) = source {
            why = format!("{why}: {inner}");
            source = inner.source();
        }
        Failure::unavailable(format!(
            "{what}: {} does not answer: {why}",
            socket.display()
        ))
    })
}

impl Kubelet {
    async fn handle(&self, op: &str, command: Value) -> Answer {
        match op {
            "claim" => self.claim(fields(op, command)?),
            "delete_claim" => self.delete_claim(fields(op, command)?),
            "api" => {
                let f: ApiFields = fields(op, command)?;
                let delay = Duration::from_millis(f.claim_delay_ms.unwrap_or(0));
                lock(&self.api).claim_delay = delay;
                Ok(json!({}))
            }
            "slices" => {
                let _: Timeout = fields(op, command)?;
                let slices = lock(&self.api).slices.clone();
                Ok(json!({ "slices": slices }))
            }
            "register" => self.register(fields(op, command)?).await,
            "prepare" => self.prepare(fields(op, command)?).await,
            "unprepare" => self.unprepare(fields(op, command)?).await,
            "dp_registrations" => self.dp_registrations(fields(op, command)?).await,
            "list" => self.list(fields(op, command)?).await,
            "preferred" => self.preferred(fields(op, command)?).await,
            "allocate" => self.allocate(fields(op, command)?).await,
            other => Err(Failure::new(format!(
                "unknown op {other:?}: expected claim, delete_claim, api, slices, register, prepare, unprepare, dp_registrations, list, preferred, allocate or quit"
            ))),
        }
    }

    /// The claim kube-scheduler allocated, as the API server serves it.
    fn claim(&self, f: ClaimFields) -> Answer {
        let object = match f.object {
            Some(object) => {
                if f.gpu.is_some() || f.memory.is_some() || f.weight.is_some() {
                    return Err(Failure::new(
                        "claim: give either \"object\" or the claim's fields, not both",
                    ));
                }
                object
            }
            None => {
                let need = |v: Option<String>, what: &str| {
                    v.filter(|s| !s.is_empty())
                        .ok_or_else(|| Failure::new(format!("claim: \"{what}\" is missing")))
                };
                let (namespace, name, uid) = (
                    need(f.namespace, "namespace")?,
                    need(f.name, "name")?,
                    need(f.uid, "uid")?,
                );
                let memory = need(f.memory, "memory")?;
                let gpus = match f.gpu {
                    None => return Err(Failure::new("claim: \"gpu\" is missing")),
                    Some(OneOrMany::One(g)) => vec![g],
                    Some(OneOrMany::Many(g)) if g.is_empty() => {
                        return Err(Failure::new("claim: \"gpu\" lists no device"))
                    }
                    Some(OneOrMany::Many(g)) => g,
                };
                let pool = f.pool.unwrap_or_else(|| self.node.clone());
                let results: Vec<Value> = gpus
                    .iter()
                    .map(|device| {
                        json!({
                            "request": "gpu", "driver": DRIVER, "pool": pool, "device": device,
                            "shareID": format!("share-{uid}-{device}"),
                            "consumedCapacity": {"memory": memory},
                        })
                    })
                    .collect();
                let mut parameters = json!({"apiVersion": "gpuplex.io/v1", "kind": "VgpuConfig"});
                match f.weight {
                    Some(NumberOrText::Number(n)) => parameters["weight"] = json!(n),
                    Some(NumberOrText::Text(t)) => parameters["weight"] = json!(t),
                    None => {}
                }
                if let Some(priority) = f.priority {
                    parameters["priority"] = json!(priority);
                }
                let mut devices = json!({ "results": results });
                if parameters.as_object().is_some_and(|o| o.len() > 2) {
                    devices["config"] = json!([{
                        "source": "FromClaim", "requests": ["gpu"],
                        "opaque": {"driver": DRIVER, "parameters": parameters},
                    }]);
                }
                json!({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name, "namespace": namespace, "uid": uid},
                    "spec": {"devices": {"requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": DRIVER}},
                    ]}},
                    "status": {"allocation": {"devices": devices}},
                })
            }
        };
        // What the API server would refuse to store.
        serde_json::from_value::<ResourceClaim>(object.clone())
            .map_err(|e| Failure::new(format!("claim: not a ResourceClaim: {e}")))?;
        let key = |field: &str| object["metadata"][field].as_str().unwrap_or_default();
        let (namespace, name) = (key("namespace").to_owned(), key("name").to_owned());
        if namespace.is_empty() || name.is_empty() {
            return Err(Failure::new("claim: its metadata has no namespace or name"));
        }
        let mut api = lock(&self.api);
        api.version += 1;
        let mut object = object;
        object["metadata"]["resourceVersion"] = json!(api.version.to_string());
        api.claims.insert((namespace, name), object);
        Ok(json!({}))
    }

    /// The (namespace, name) of a claim the API stand-in serves with `uid`.
    fn by_uid(&self, uid: &str) -> Option<(String, String)> {
        lock(&self.api)
            .claims
            .iter()
            .find(|(_, c)| c["metadata"]["uid"] == uid)
            .map(|(k, _)| k.clone())
    }

    fn delete_claim(&self, f: ClaimName) -> Answer {
        let key = match (f.namespace, f.name, f.uid) {
            (Some(namespace), Some(name), None) => (namespace, name),
            (None, None, Some(uid)) => self
                .by_uid(&uid)
                .ok_or_else(|| Failure::new(format!("delete_claim: no claim has uid {uid:?}")))?,
            _ => {
                return Err(Failure::new(
                    "delete_claim: give \"namespace\" and \"name\", or \"uid\"",
                ))
            }
        };
        let deleted = lock(&self.api).claims.remove(&key).is_some();
        Ok(json!({ "deleted": deleted }))
    }

    /// Registration as the kubelet's plugin watcher does it: `GetInfo` on the registration
    /// socket, the answer checked, then `NotifyRegistrationStatus`. Tried again until the
    /// socket answers (a plugin starting) or the time is up.
    async fn register(&self, f: Timeout) -> Answer {
        let socket = self.registry_dir.join(format!("{DRIVER}-reg.sock"));
        let deadline = tokio::time::Instant::now() + ms(f.timeout_ms);
        let mut last;
        loop {
            match self.register_once(&socket, deadline).await {
                Ok(answer) => return Ok(answer),
                Err(failure) if failure.code.is_none() => return Err(failure),
                Err(failure) => last = failure,
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Failure {
                    error: format!("register: {}", last.error),
                    code: last.code,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn register_once(
        &self,
        socket: &Path,
        deadline: tokio::time::Instant,
    ) -> Result<Value, Failure> {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let channel = connect("registration", socket).await?;
        let mut client = RegistrationClient::new(channel);
        let info = within("GetInfo", left, client.get_info(InfoRequest {})).await?;
        // What the kubelet checks before it registers a DRA driver.
        let refused = if info.r#type != "DRAPlugin" {
            Some(format!("type {:?} is not DRAPlugin", info.r#type))
        } else if info.name != DRIVER {
            Some(format!("name {:?} is not {DRIVER}", info.name))
        } else if !info.supported_versions.iter().any(|v| v == DRA_VERSION) {
            Some(format!(
                "versions {:?} do not include {DRA_VERSION}",
                info.supported_versions
            ))
        } else if !Path::new(&info.endpoint).is_absolute() {
            Some(format!(
                "endpoint {:?} is not an absolute path",
                info.endpoint
            ))
        } else {
            None
        };
        let status = RegistrationStatus {
            plugin_registered: refused.is_none(),
            error: refused.clone().unwrap_or_default(),
        };
        within(
            "NotifyRegistrationStatus",
            left,
            client.notify_registration_status(status),
        )
        .await?;
        if let Some(why) = refused {
            return Err(Failure::new(format!("register: refused: {why}")));
        }
        *lock(&self.dra_endpoint) = Some(PathBuf::from(&info.endpoint));
        Ok(json!({
            "name": info.name, "endpoint": info.endpoint,
            "versions": info.supported_versions,
        }))
    }

    /// The claims a prepare or unprepare names: by uid, among those the stand-in serves.
    fn claims_of(&self, op: &str, f: ClaimsFields) -> Result<Vec<v1::Claim>, Failure> {
        let mut claims = Vec::new();
        for uid in f.uids.unwrap_or_default() {
            let (namespace, name) = self.by_uid(&uid).ok_or_else(|| {
                Failure::new(format!(
                    "{op}: no claim has uid {uid:?}; add it with op claim, or name it in \"claims\""
                ))
            })?;
            claims.push(v1::Claim {
                namespace,
                name,
                uid,
            });
        }
        for c in f.claims.unwrap_or_default() {
            match (c.namespace, c.name, c.uid) {
                (Some(namespace), Some(name), Some(uid)) => claims.push(v1::Claim {
                    namespace,
                    name,
                    uid,
                }),
                _ => {
                    return Err(Failure::new(format!(
                        "{op}: each of \"claims\" has \"namespace\", \"name\" and \"uid\""
                    )))
                }
            }
        }
        if claims.is_empty() {
            return Err(Failure::new(format!(
                "{op}: no claim named: give \"uids\" or \"claims\""
            )));
        }
        Ok(claims)
    }

    async fn dra_client(
        &self,
        call: &str,
    ) -> Result<v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>, Failure> {
        let endpoint = lock(&self.dra_endpoint).clone().ok_or_else(|| {
            Failure::unavailable(format!(
                "{call}: the driver {DRIVER} is not registered (op register)"
            ))
        })?;
        Ok(v1::dra_plugin_client::DraPluginClient::new(
            connect(call, &endpoint).await?,
        ))
    }

    async fn prepare(&self, f: ClaimsFields) -> Answer {
        let timeout = ms(f.timeout_ms);
        let claims = self.claims_of("prepare", f)?;
        let mut client = self.dra_client("NodePrepareResources").await?;
        let request = v1::NodePrepareResourcesRequest { claims };
        let answer = within(
            "NodePrepareResources",
            timeout,
            client.node_prepare_resources(request),
        )
        .await?;
        let claims: BTreeMap<String, Value> = answer
            .claims
            .into_iter()
            .map(|(uid, c)| {
                let devices: Vec<Value> = c
                    .devices
                    .into_iter()
                    .map(|d| {
                        json!({
                            "request_names": d.request_names, "pool": d.pool_name,
                            "device": d.device_name, "cdi_device_ids": d.cdi_device_ids,
                        })
                    })
                    .collect();
                (uid, json!({"devices": devices, "error": c.error}))
            })
            .collect();
        Ok(json!({ "claims": claims }))
    }

    async fn unprepare(&self, f: ClaimsFields) -> Answer {
        let timeout = ms(f.timeout_ms);
        let claims = self.claims_of("unprepare", f)?;
        let mut client = self.dra_client("NodeUnprepareResources").await?;
        let request = v1::NodeUnprepareResourcesRequest { claims };
        let answer = within(
            "NodeUnprepareResources",
            timeout,
            client.node_unprepare_resources(request),
        )
        .await?;
        let claims: BTreeMap<String, Value> = answer
            .claims
            .into_iter()
            .map(|(uid, c)| (uid, json!({"error": c.error})))
            .collect();
        Ok(json!({ "claims": claims }))
    }

    async fn dp_registrations(&self, f: RegistrationsFields) -> Answer {
        let at_least = f.at_least.unwrap_or(0);
        let deadline = tokio::time::Instant::now() + ms(f.timeout_ms);
        loop {
            let registered: Vec<Value> = lock(&self.device_plugins.0)
                .iter()
                .map(|r| {
                    let options = r.options.unwrap_or_default();
                    json!({
                        "version": r.version, "endpoint": r.endpoint,
                        "resource_name": r.resource_name,
                        "pre_start_required": options.pre_start_required,
                        "get_preferred_allocation_available": options.get_preferred_allocation_available,
                    })
                })
                .collect();
            if registered.len() >= at_least {
                return Ok(json!({ "registrations": registered }));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Failure::unavailable(format!(
                    "dp_registrations: {} registration(s), not {at_least}, within the time",
                    registered.len()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn dp_client(
        &self,
        call: &str,
    ) -> Result<dp::device_plugin_client::DevicePluginClient<tonic::transport::Channel>, Failure>
    {
        let endpoint = lock(&self.device_plugins.0)
            .last()
            .map(|r| r.endpoint.clone())
            .ok_or_else(|| {
                Failure::unavailable(format!("{call}: no device plugin has registered"))
            })?;
        let socket = self.device_plugins_dir.join(endpoint);
        Ok(dp::device_plugin_client::DevicePluginClient::new(
            connect(call, &socket).await?,
        ))
    }

    /// `ListAndWatch`'s first list that names units (the plugin lists none until it has read
    /// the node's GPUs).
    async fn list(&self, f: Timeout) -> Answer {
        let timeout = ms(f.timeout_ms);
        let mut client = self.dp_client("ListAndWatch").await?;
        let mut updates =
            within("ListAndWatch", timeout, client.list_and_watch(dp::Empty {})).await?;
        let first = async {
            loop {
                match updates.next().await {
                    None => return Err(Failure::unavailable("ListAndWatch: the stream ended")),
                    Some(Err(status)) => return Err(Failure::status("ListAndWatch", &status)),
                    Some(Ok(listed)) if !listed.devices.is_empty() => return Ok(listed),
                    Some(Ok(_)) => {}
                }
            }
        };
        let listed = tokio::time::timeout(timeout, first)
            .await
            .map_err(|_| Failure {
                error: "ListAndWatch: no units listed within the time".into(),
                code: Some("DeadlineExceeded"),
            })??;
        let units: Vec<Value> = listed
            .devices
            .iter()
            .map(|d| json!({"id": d.id, "health": d.health}))
            .collect();
        Ok(json!({ "units": units }))
    }

    async fn preferred(&self, f: PreferredFields) -> Answer {
        let mut client = self.dp_client("GetPreferredAllocation").await?;
        let request = dp::PreferredAllocationRequest {
            container_requests: vec![dp::ContainerPreferredAllocationRequest {
                available_device_i_ds: f.available,
                must_include_device_i_ds: f.must_include,
                allocation_size: f.size,
            }],
        };
        let answer = within(
            "GetPreferredAllocation",
            ms(f.timeout_ms),
            client.get_preferred_allocation(request),
        )
        .await?;
        let units: Vec<String> = answer
            .container_responses
            .into_iter()
            .flat_map(|c| c.device_i_ds)
            .collect();
        Ok(json!({ "units": units }))
    }

    async fn allocate(&self, f: AllocateFields) -> Answer {
        let containers = match (f.units, f.containers) {
            (Some(units), None) => vec![units],
            (None, Some(containers)) if !containers.is_empty() => containers,
            _ => {
                return Err(Failure::new(
                    "allocate: give \"units\" (one container's) or \"containers\" (a list of units lists)",
                ))
            }
        };
        let mut client = self.dp_client("Allocate").await?;
        let request = dp::AllocateRequest {
            container_requests: containers
                .into_iter()
                .map(|devices_ids| dp::ContainerAllocateRequest { devices_ids })
                .collect(),
        };
        let answer = within("Allocate", ms(f.timeout_ms), client.allocate(request)).await?;
        let containers: Vec<Value> = answer
            .container_responses
            .into_iter()
            .map(|c| {
                let envs: BTreeMap<String, String> = c.envs.into_iter().collect();
                let annotations: BTreeMap<String, String> = c.annotations.into_iter().collect();
                let mounts: Vec<Value> = (c.mounts.iter())
                    .map(|m| json!({"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}))
                    .collect();
                let devices: Vec<Value> = (c.devices.iter())
                    .map(|d| json!({"container_path": d.container_path, "host_path": d.host_path, "permissions": d.permissions}))
                    .collect();
                let cdi: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
                json!({
                    "envs": envs, "mounts": mounts, "devices": devices,
                    "annotations": annotations, "cdi_devices": cdi,
                })
            })
            .collect();
        Ok(json!({ "containers": containers }))
    }
}

/// One command line: its answer line, and whether it asked to quit.
async fn answer(kubelet: &Kubelet, line: &[u8]) -> (String, bool) {
    let mut command: Value = match serde_json::from_slice(line) {
        Ok(command @ Value::Object(_)) => command,
        Ok(other) => {
            let kind = match other {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            };
            let error = format!("a command is a JSON object, not {kind}");
            return (json!({"ok": false, "error": error}).to_string(), false);
        }
        Err(e) => {
            let error = one_line(&format!("not JSON: {e}"));
            return (json!({"ok": false, "error": error}).to_string(), false);
        }
    };
    let object = command.as_object_mut().expect("matched an object above");
    let id = object.remove("id");
    let op = object.remove("op");
    let (result, quit) = match op {
        Some(Value::String(op)) if op == "quit" => (Ok(json!({})), true),
        Some(Value::String(op)) => (kubelet.handle(&op, command).await, false),
        _ => (Err(Failure::new("a command needs \"op\", a string")), false),
    };
    let mut reply = match result {
        Ok(mut value) => {
            value["ok"] = json!(true);
            value
        }
        Err(failure) => {
            let mut value = json!({"ok": false, "error": failure.error});
            if let Some(code) = failure.code {
                value["code"] = json!(code);
            }
            value
        }
    };
    if let Some(id) = id {
        reply["id"] = id;
    }
    (reply.to_string(), quit)
}

/// A line of stdin, as the reading thread hands it over.
enum Input {
    Line(Vec<u8>),
    TooLong,
    End,
    Failed(String),
}

/// Reads stdin on a thread of its own (tokio's stdin is not among this crate's features): its
/// lines, at most MAX_LINE bytes each (the rest of a longer one skipped).
fn read_stdin() -> mpsc::UnboundedReceiver<Input> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut stdin = stdin.lock();
        loop {
            let mut line = Vec::new();
            let read = stdin
                .by_ref()
                .take(MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut line);
            let input = match read {
                Ok(0) => Input::End,
                Err(e) => Input::Failed(one_line(&format!("cannot read stdin: {e}"))),
                Ok(_) if line.len() > MAX_LINE && !line.ends_with(b"\n") => {
                    match skip_line(&mut stdin) {
                        Ok(()) => Input::TooLong,
                        Err(e) => Input::Failed(one_line(&format!("cannot read stdin: {e}"))),
                    }
                }
                Ok(_) => Input::Line(line),
            };
            let last = matches!(input, Input::End | Input::Failed(_));
            if tx.send(input).is_err() || last {
                return;
            }
        }
    });
    rx
}

/// Reads past the next newline (or to the end).
fn skip_line(reader: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let buffer = reader.fill_buf()?;
        if buffer.is_empty() {
            return Ok(());
        }
        match buffer.iter().position(|&b| b == b'\n') {
            Some(at) => {
                reader.consume(at + 1);
                return Ok(());
            }
            None => {
                let n = buffer.len();
                reader.consume(n);
            }
        }
    }
}

struct Args {
    dir: PathBuf,
    node: String,
}

fn parse() -> Result<Args, String> {
    use lexopt::prelude::*;
    let (mut dir, mut node) = (None, "soaknode".to_owned());
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Long("dir") => dir = Some(PathBuf::from(parser.value().map_err(|e| e.to_string())?)),
            Long("node") => {
                let value = parser.value().map_err(|e| e.to_string())?;
                node = value.into_string().map_err(|_| "--node: not UTF-8")?;
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    let dir = dir.ok_or("--dir DIR is required")?;
    Ok(Args { dir, node })
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(why) => {
            eprintln!("kubelet-standin: {why}; usage: kubelet-standin --dir DIR [--node NAME]");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kubelet-standin: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("kubelet-standin: {why}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let dir = &args.dir;
    let (registry_dir, plugin_dir, device_plugins_dir) = (
        dir.join("registry"),
        dir.join("plugins"),
        dir.join("device-plugins"),
    );
    for d in [&registry_dir, &plugin_dir, &device_plugins_dir] {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot make {}: {e}", d.display()))?;
    }
    let api = Arc::new(Mutex::new(kube_api::State::default()));
    let url = kube_api::start(Arc::clone(&api)).await;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kube_api::kubeconfig(&url))
        .map_err(|e| format!("cannot write {}: {e}", kubeconfig.display()))?;
    // The kubelet's registration socket for device plugins.
    let kubelet_socket = device_plugins_dir.join("kubelet.sock");
    let _ = std::fs::remove_file(&kubelet_socket);
    let listener = tokio::net::UnixListener::bind(&kubelet_socket)
        .map_err(|e| format!("cannot serve {}: {e}", kubelet_socket.display()))?;
    let device_plugins = DevicePluginRegistry::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(dp::registration_server::RegistrationServer::new(
            device_plugins.clone(),
        ))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
            let _ = stopped.await;
        });
    let server = tokio::spawn(server);
    let kubelet = Arc::new(Kubelet {
        node: args.node.clone(),
        api,
        registry_dir: registry_dir.clone(),
        device_plugins_dir,
        dra_endpoint: Mutex::new(None),
        device_plugins,
    });

    // Answers go out one line at a time, in the order they are ready.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let writer = std::thread::spawn(move || {
        let stdout = std::io::stdout();
        let mut stdout = stdout.lock();
        for line in rx {
            if writeln!(stdout, "{line}")
                .and_then(|()| stdout.flush())
                .is_err()
            {
                break;
            }
        }
    });
    let ready = json!({"ok": true, "ready": {
        "kubeconfig": kubeconfig, "registry_dir": registry_dir, "plugin_dir": plugin_dir,
        "kubelet_socket": kubelet_socket, "api": url, "node": args.node,
    }});
    let _ = tx.send(ready.to_string());

    let mut input = read_stdin();
    let (quit_tx, mut quit_rx) = mpsc::unbounded_channel::<()>();
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let line = tokio::select! {
            line = input.recv() => line,
            _ = quit_rx.recv() => break,
        };
        let line = match line {
            None | Some(Input::End) => break,
            Some(Input::Failed(why)) => {
                let _ = tx.send(json!({"ok": false, "error": why}).to_string());
                break;
            }
            Some(Input::TooLong) => {
                let error = format!("a command line is at most {MAX_LINE} bytes");
                let _ = tx.send(json!({"ok": false, "error": error}).to_string());
                continue;
            }
            Some(Input::Line(line)) => line,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let (kubelet, tx, quit_tx) = (Arc::clone(&kubelet), tx.clone(), quit_tx.clone());
        tasks.spawn(async move {
            let (reply, quit) = answer(&kubelet, &line).await;
            let _ = tx.send(reply);
            if quit {
                let _ = quit_tx.send(());
            }
        });
        // Finished commands' tasks are let go as they end.
        while tasks.try_join_next().is_some() {}
    }
    tasks.shutdown().await;
    drop(tx);
    let _ = writer.join();
    let _ = stop.send(());
    let _ = server.await;
    let _ = std::fs::remove_file(&kubelet_socket);
    Ok(())
}
