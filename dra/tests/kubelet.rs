//! The test plays the kubelet: it registers the driver through the plugin registration API and
//! prepares and unprepares claims through DRA v1 and v1beta1 over unix sockets, against the real
//! node service (root). The claims come from a store of API objects in the test: no
//! kube-apiserver can run on these machines.

#[path = "../../node/tests/support/mod.rs"]
mod support;
mod unix_grpc;

use unix_grpc::channel;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpuplex_dra::claim::ClaimRef;
use gpuplex_dra::driver::{Claims, Driver, DriverConfig};
use gpuplex_dra::kubelet::{self, Sockets};
use gpuplex_dra::proto::registration::registration_client::RegistrationClient;
use gpuplex_dra::proto::registration::{InfoRequest, RegistrationStatus};
use gpuplex_dra::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use support::*;

const GIB: u64 = 1 << 30;

/// The API server's claims, as a test serves them.
#[derive(Default)]
struct Store(Mutex<HashMap<(String, String), ResourceClaim>>);

impl Claims for &'static Store {
    async fn get(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        let claims = self.0.lock().unwrap();
        claims
            .get(&(claim.namespace.clone(), claim.name.clone()))
            .cloned()
            .ok_or_else(|| {
                format!(
                    "resourceclaims.resource.k8s.io \"{}\" not found",
                    claim.name
                )
            })
    }
}

fn allocated(name: &str, uid: &str, device: &str, memory: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": "gpuplex.io", "pool": "testnode", "device": device,
                         "shareID": format!("share-{uid}"), "consumedCapacity": {"memory": memory}}],
            "config": [{"source": "FromClaim", "opaque": {"driver": "gpuplex.io",
                        "parameters": {"apiVersion": "gpuplex.io/v1", "kind": "VgpuConfig", "weight": 3}}}],
        }}},
    }))
    .unwrap()
}

fn claim(name: &str, uid: &str) -> (String, String, String) {
    ("ml".into(), name.into(), uid.into())
}

fn v1_claims(claims: &[(String, String, String)]) -> Vec<v1::Claim> {
    claims
        .iter()
        .map(|(namespace, name, uid)| v1::Claim {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
        })
        .collect()
}

fn specs(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    found.sort();
    found
}

/// The driver served on sockets under `dir` as the kubelet finds it, reading claims from
/// `store` and writing CDI specs to `dir/cdi`.
struct Served {
    runtime: tokio::runtime::Runtime,
    sockets: Sockets,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn serve_driver(service: &NodeService, store: &'static Store, dir: &Path) -> Served {
    let sockets = Sockets::under(
        &dir.join("plugins_registry"),
        &dir.join("plugins/gpuplex.io"),
    );
    let driver = Driver::new(
        store,
        DriverConfig {
            node: "testnode".into(),
            socket: service.socket.clone(),
            cdi_dir: dir.join("cdi"),
            control_nodes: Vec::new(),
            hook: gpuplex_integration::bin("gpuplex-hook"),
        },
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = {
        let sockets = sockets.clone();
        runtime.spawn(async move {
            kubelet::serve(driver, &sockets, async {
                let _ = stopped.await;
            })
            .await
        })
    };
    // Up to 10 s: the plugin's start on a loaded machine.
    for _ in 0..500 {
        if sockets.registration.exists() && sockets.dra.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Served {
        runtime,
        sockets,
        stop,
        served,
    }
}

#[test]
fn the_kubelet_registers_the_driver_and_prepares_and_unprepares_claims() {
    if !can_run("the_kubelet_registers_the_driver_and_prepares_and_unprepares_claims") {
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let store: &'static Store = Box::leak(Box::default());
    let a = "0b7d2a9e-0000-4000-8000-00000000000a";
    let b = "0b7d2a9e-0000-4000-8000-00000000000b";
    let c = "0b7d2a9e-0000-4000-8000-00000000000c";
    for (name, uid, device, memory) in [
        ("a", a, "gpu-1", "4Gi"),
        ("b", b, "gpu-0", "8Gi"),
        ("c", c, "gpu-0", "10Gi"),
    ] {
        store.0.lock().unwrap().insert(
            ("ml".into(), name.into()),
            allocated(name, uid, device, memory),
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let Served {
        runtime,
        sockets,
        stop,
        served,
    } = serve_driver(&service, store, dir.path());
    runtime.block_on(async {
        // Registration, as the kubelet's plugin watcher does it.
        let mut registration = RegistrationClient::new(channel(&sockets.registration).await);
        let info = registration
            .get_info(InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpuplex.io");
        assert_eq!(Path::new(&info.endpoint), sockets.dra);
        assert_eq!(
            info.supported_versions,
            ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        );
        registration
            .notify_registration_status(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .unwrap();

        // Prepare (v1): the claim's vGPU, pinned on the GPU kube-scheduler chose.
        let mut dra = v1::dra_plugin_client::DraPluginClient::new(channel(&sockets.dra).await);
        let request = v1::NodePrepareResourcesRequest {
            claims: v1_claims(&[claim("a", a)]),
        };
        let prepared = dra
            .node_prepare_resources(request.clone())
            .await
            .unwrap()
            .into_inner();
        let answer = &prepared.claims[a];
        assert_eq!(answer.error, "");
        assert_eq!(answer.devices.len(), 1);
        let device = &answer.devices[0];
        assert_eq!(
            (device.pool_name.as_str(), device.device_name.as_str()),
            ("testnode", "gpu-1")
        );
        assert_eq!(device.request_names, ["gpu"]);
        assert_eq!(device.cdi_device_ids, [format!("gpuplex.io/vgpu={a}")]);
        let status = service.status();
        assert_eq!(status["gpus"][1]["unreserved"], json!(12 * GIB), "{status}");
        assert_eq!(status["reservations"][0]["claim"], a);
        assert_eq!(status["reservations"][0]["weight"], 3);
        assert_eq!(
            specs(&cdi_dir),
            [cdi_dir.join(format!("gpuplex.io-vgpu-{a}.json"))]
        );
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&specs(&cdi_dir)[0]).unwrap()).unwrap();
        assert_eq!(
            spec["devices"][0]["containerEdits"]["env"][0],
            "CUDA_VISIBLE_DEVICES=GPU-fake-1"
        );

        // Prepare again: the same answer, nothing more reserved, and the same spec (its attach
        // step keeps the claim's handle, not the retry's).
        let written = std::fs::read(&specs(&cdi_dir)[0]).unwrap();
        let again = dra
            .node_prepare_resources(request)
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again, prepared);
        assert_eq!(std::fs::read(&specs(&cdi_dir)[0]).unwrap(), written);
        assert_eq!(
            service.status()["reservations"].as_array().unwrap().len(),
            1
        );

        // v1beta1 serves the same driver.
        let mut beta =
            v1beta1::dra_plugin_client::DraPluginClient::new(channel(&sockets.dra).await);
        let request = v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "ml".into(),
                name: "b".into(),
                uid: b.into(),
            }],
        };
        let prepared_b = beta
            .node_prepare_resources(request.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(prepared_b.claims[b].error, "");
        assert_eq!(prepared_b.claims[b].devices[0].device_name, "gpu-0");

        // A claim that no longer fits (GPU 0 has 8 GiB left): one line, nothing left behind.
        let refused = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: v1_claims(&[claim("c", c)]),
            })
            .await
            .unwrap()
            .into_inner();
        let line = &refused.claims[c].error;
        assert!(
            line.contains("claim ml/c")
                && line.contains("8 GiB unreserved")
                && !line.contains('\n'),
            "{line}"
        );
        assert!(refused.claims[c].devices.is_empty());
        assert_eq!(specs(&cdi_dir).len(), 2, "{:?}", specs(&cdi_dir));
        // A claim the API server does not have.
        let missing = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: v1_claims(&[claim("gone", "0b7d2a9e-0000-4000-8000-0000000000ff")]),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(missing.claims["0b7d2a9e-0000-4000-8000-0000000000ff"]
            .error
            .contains("not found"));

        // The kubelet restarts: it finds the sockets again and prepares what it had again.
        drop((registration, dra, beta));
        let mut registration = RegistrationClient::new(channel(&sockets.registration).await);
        assert_eq!(
            registration
                .get_info(InfoRequest {})
                .await
                .unwrap()
                .into_inner()
                .name,
            "gpuplex.io"
        );
        let mut beta =
            v1beta1::dra_plugin_client::DraPluginClient::new(channel(&sockets.dra).await);
        assert_eq!(
            beta.node_prepare_resources(request)
                .await
                .unwrap()
                .into_inner(),
            prepared_b
        );

        // Unprepare, twice: released, spec gone; the second finds nothing to do.
        let mut dra = v1::dra_plugin_client::DraPluginClient::new(channel(&sockets.dra).await);
        for _ in 0..2 {
            let request = v1::NodeUnprepareResourcesRequest {
                claims: v1_claims(&[claim("a", a), claim("b", b)]),
            };
            let answer = dra
                .node_unprepare_resources(request)
                .await
                .unwrap()
                .into_inner();
            assert_eq!(answer.claims[a].error, "");
            assert_eq!(answer.claims[b].error, "");
            assert!(specs(&cdi_dir).is_empty(), "{:?}", specs(&cdi_dir));
            let status = service.status();
            assert!(
                status["reservations"].as_array().unwrap().is_empty(),
                "{status}"
            );
            assert_eq!(status["gpus"][0]["unreserved"], json!(16 * GIB));
        }
    });
    let _ = stop.send(());
    runtime.block_on(served).unwrap().unwrap();
    assert!(
        !sockets.registration.exists() && !sockets.dra.exists(),
        "the sockets go with the driver"
    );
}

/// Issue #33: a burst of prepares and unprepares at once, each a call of its own as the kubelet
/// makes them for many pods, is answered in full: the driver shares a few connections to the
/// node service instead of opening one per claim past what the node socket serves one process.
#[test]
fn a_burst_of_500_prepares_and_then_500_unprepares_is_answered_in_full() {
    if !can_run("a_burst_of_500_prepares_and_then_500_unprepares_is_answered_in_full") {
        return;
    }
    const CLAIMS: usize = 500;
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let store: &'static Store = Box::leak(Box::default());
    let claims: Vec<(String, String, String)> = (0..CLAIMS)
        .map(|i| {
            claim(
                &format!("burst-{i}"),
                &format!("0b7d2a9e-0000-4000-8000-{i:012}"),
            )
        })
        .collect();
    for (i, (_, name, uid)) in claims.iter().enumerate() {
        let device = format!("gpu-{}", i % 2);
        store.0.lock().unwrap().insert(
            ("ml".into(), name.clone()),
            allocated(name, uid, &device, "16Mi"),
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let Served {
        runtime,
        sockets,
        stop,
        served,
    } = serve_driver(&service, store, dir.path());
    runtime.block_on(async {
        let dra = v1::dra_plugin_client::DraPluginClient::new(channel(&sockets.dra).await);
        let failed = each_at_once(&dra, &claims, Call::Prepare).await;
        assert!(
            failed.is_empty(),
            "{} of {CLAIMS}: {failed:#?}",
            failed.len()
        );
        assert_eq!(specs(&cdi_dir).len(), CLAIMS);
        let status = service.status();
        assert_eq!(
            status["reservations"].as_array().unwrap().len(),
            CLAIMS,
            "{status}"
        );

        let failed = each_at_once(&dra, &claims, Call::Unprepare).await;
        assert!(
            failed.is_empty(),
            "{} of {CLAIMS}: {failed:#?}",
            failed.len()
        );
        assert!(specs(&cdi_dir).is_empty(), "{:?}", specs(&cdi_dir));
        let status = service.status();
        assert!(
            status["reservations"].as_array().unwrap().is_empty(),
            "{status}"
        );
    });
    let _ = stop.send(());
    runtime.block_on(served).unwrap().unwrap();
}

/// A kubelet call on one claim.
#[derive(Clone, Copy)]
enum Call {
    Prepare,
    Unprepare,
}

/// Makes `call` on each of `claims` at once, a call each, as the kubelet does for many pods;
/// the claims whose call failed, each with its error.
async fn each_at_once(
    dra: &v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    claims: &[(String, String, String)],
    call: Call,
) -> Vec<String> {
    let calls = claims.iter().map(|c| {
        let mut dra = dra.clone();
        let one = v1_claims(std::slice::from_ref(c));
        async move {
            let answer = match call {
                Call::Prepare => dra
                    .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: one })
                    .await
                    .map(|a| a.into_inner().claims[&c.2].error.clone()),
                Call::Unprepare => dra
                    .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: one })
                    .await
                    .map(|a| a.into_inner().claims[&c.2].error.clone()),
            };
            match answer {
                Ok(error) if error.is_empty() => None,
                Ok(error) => Some(format!("{}: {error}", c.2)),
                Err(status) => Some(format!("{}: {status}", c.2)),
            }
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    answers.into_iter().flatten().collect()
}
