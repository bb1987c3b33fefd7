//! `gpuplex-dra` as the DaemonSet runs it, with the real node service (root), the test API
//! server of `kube_api/` (found through `$KUBECONFIG`, as kubectl finds it) and the test in
//! the kubelet's place: the slice appears with the node's GPUs, the kubelet registers the
//! plugin and a claim is prepared; SIGTERM stops it and removes its sockets.

mod kube_api;
#[path = "../../node/tests/support/mod.rs"]
mod support;
mod unix_grpc;

use unix_grpc::channel;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplex_dra::proto::dra_v1 as v1;
use gpuplex_dra::proto::registration::registration_client::RegistrationClient;
use gpuplex_dra::proto::registration::InfoRequest;
use kube_api::{kubeconfig, start, State};
use serde_json::json;
use support::{can_run, NodeService, Setup};

const GIB: u64 = 1 << 30;
const UID: &str = "4f1c9a2e-0000-4000-8000-000000000001";

#[test]
fn the_plugin_publishes_the_nodes_gpus_registers_and_prepares_a_claim() {
    if !can_run("the_plugin_publishes_the_nodes_gpus_registers_and_prepares_a_claim") {
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let state = Arc::new(Mutex::new(State::default()));
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "job", "namespace": "ml", "uid": UID},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": "gpuplex.io", "pool": "testnode", "device": "gpu-1",
            "consumedCapacity": {"memory": "2Gi"}}]}}},
    });
    state
        .lock()
        .unwrap()
        .claims
        .insert(("ml".into(), "job".into()), claim);
    let url = runtime.block_on(start(Arc::clone(&state)));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kubeconfig");
    std::fs::write(&config, kubeconfig(&url)).unwrap();
    let (registry, plugins, cdi) = (
        dir.path().join("registry"),
        dir.path().join("plugins"),
        dir.path().join("cdi"),
    );
    let mut plugin = Command::new(env!("CARGO_BIN_EXE_gpuplex-dra"))
        .args([
            "--config",
            service.config.to_str().unwrap(),
            "--node",
            "testnode",
        ])
        .arg("--registry-dir")
        .arg(&registry)
        .arg("--plugin-dir")
        .arg(&plugins)
        .arg("--cdi-dir")
        .arg(&cdi)
        .env("KUBECONFIG", &config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let registration = registry.join("gpuplex.io-reg.sock");
    // Up to 20 s: the binary's start, its first status read and publish on a loaded machine.
    let published = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        registration.exists()
            && state
                .lock()
                .unwrap()
                .slices
                .contains_key("testnode-gpuplex.io")
    });
    assert!(published, "no slice and registration socket after 20 s");
    let slice = state.lock().unwrap().slices["testnode-gpuplex.io"].clone();
    assert_eq!(slice["spec"]["nodeName"], "testnode");
    assert_eq!(slice["spec"]["devices"][1]["name"], "gpu-1");
    assert_eq!(
        slice["spec"]["devices"][1]["capacity"]["memory"]["value"],
        (16 * GIB).to_string()
    );
    assert_eq!(
        slice["spec"]["devices"][1]["attributes"]["uuid"]["string"],
        "GPU-fake-1"
    );
    runtime.block_on(async {
        let mut registration = RegistrationClient::new(channel(&registration).await);
        let info = registration
            .get_info(InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(Path::new(&info.endpoint), plugins.join("dra.sock"));
        let mut dra =
            v1::dra_plugin_client::DraPluginClient::new(channel(&plugins.join("dra.sock")).await);
        let claims = vec![v1::Claim {
            namespace: "ml".into(),
            name: "job".into(),
            uid: UID.into(),
        }];
        let prepared = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(prepared.claims[UID].error, "");
        assert_eq!(
            prepared.claims[UID].devices[0].cdi_device_ids,
            [format!("gpuplex.io/vgpu={UID}")]
        );
    });
    assert_eq!(service.status()["gpus"][1]["unreserved"], json!(14 * GIB));
    assert!(cdi.join(format!("gpuplex.io-vgpu-{UID}.json")).exists());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(plugin.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = plugin.wait().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(plugin.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(status.success(), "{status}: {log}");
    assert!(
        !registration.exists(),
        "the kubelet sees the plugin go: {log}"
    );
}
