//! What preparing and unpreparing a claim costs (issue #15), measured as the kubelet sees it
//! (root): the `gpuplex-dra` binary with the real node service (8 fake GPUs of 80 GiB) and the
//! test API server of `tests/kube_api/` (through `$KUBECONFIG`); the bench plays the kubelet over
//! the plugin's unix socket (DRA v1), one claim per `NodePrepareResources` call as for a pod with
//! one claim. Each round prepares 100 distinct allocated claims (1 GiB each, spread over the 8
//! GPUs, all held at once), then unprepares them; every call is timed.
//!
//! Baselines from the same run, so that the figures read as ratios: a bare node-service `status`
//! round trip (a new connection each time, as the driver opens one per claim), a gRPC
//! `GetInfo` round trip to the same plugin process; and the parts of a prepare on their own: the
//! claim's read from the test API server through the driver's own client (`ApiClaims`), and the
//! node service's `pin` and `release` of a claim's placement sent directly on its socket.
//!
//! `cargo build --release --workspace` (it runs the service binary, `containerd-shim-gpuplex-v1`),
//! then `cargo bench -p gpuplex-dra --bench prepare`. Knobs: GPUPLEX_BENCH_CLAIMS (default 100),
//! GPUPLEX_BENCH_ROUNDS (5). Results go to docs/benchmarks.md by hand, with the machine they ran
//! on.

#[path = "../tests/kube_api/mod.rs"]
mod kube_api;
#[path = "../../node/tests/support/mod.rs"]
mod support;
#[path = "../tests/unix_grpc/mod.rs"]
mod unix_grpc;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplex_dra::apiserver::{self, ApiClaims};
use gpuplex_dra::claim::{self, ClaimRef};
use gpuplex_dra::driver::Claims;
use gpuplex_dra::proto::dra_v1 as v1;
use gpuplex_dra::proto::registration::registration_client::RegistrationClient;
use gpuplex_dra::proto::registration::InfoRequest;
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_wire::NodeClient;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube_api::{kubeconfig, start, State};
use serde_json::json;
use support::{can_run, NodeService, Setup};
use unix_grpc::channel;

const GPUS: usize = 8;

/// Where the uids of the claims pinned directly (a baseline) start: apart from the prepared ones.
const DIRECT: usize = 1 << 20;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// p50, p99 and max of `samples`, in ms; and the p50 itself.
fn quantiles(samples: &mut [Duration]) -> (String, f64) {
    samples.sort();
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (
        format!(
            "p50 {:>7.3} ms  p99 {:>7.3} ms  max {:>7.3} ms  (n = {})",
            ms(q(0.5)),
            ms(q(0.99)),
            ms(q(1.0)),
            samples.len()
        ),
        ms(q(0.5)),
    )
}

fn uid(i: usize) -> String {
    format!("7c3e5a10-0000-4000-8000-{i:012x}")
}

fn claim_ref(i: usize) -> v1::Claim {
    v1::Claim {
        namespace: "bench".into(),
        name: format!("claim-{i}"),
        uid: uid(i),
    }
}

/// Claim `i` as kube-scheduler allocated it: 1 GiB on `gpu-<i mod 8>` of node `testnode`.
fn allocated(i: usize) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{i}"), "namespace": "bench", "uid": uid(i),
                     "resourceVersion": "1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": "gpuplex.io", "pool": "testnode",
            "device": format!("gpu-{}", i % GPUS), "shareID": format!("share-{i}"),
            "consumedCapacity": {"memory": "1Gi"}}]}}},
    })
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too: only measure when asked.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if !can_run("the DRA prepare benchmark") {
        return;
    }
    let claims = knob("GPUPLEX_BENCH_CLAIMS", 100);
    let rounds = knob("GPUPLEX_BENCH_ROUNDS", 5);
    let service = NodeService::start(Setup {
        gpus: GPUS,
        memory: "80Gi",
        ..Setup::default()
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let state = Arc::new(Mutex::new(State::default()));
    for i in 0..claims {
        state
            .lock()
            .unwrap()
            .claims
            .insert(("bench".into(), format!("claim-{i}")), allocated(i));
    }
    let url = runtime.block_on(start(Arc::clone(&state)));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kubeconfig");
    std::fs::write(&config, kubeconfig(&url)).unwrap();
    let (registry, plugins, cdi) = (
        dir.path().join("registry"),
        dir.path().join("plugins"),
        dir.path().join("cdi"),
    );
    let log = dir.path().join("plugin.log");
    let mut plugin = Command::new(env!("CARGO_BIN_EXE_gpuplex-dra"))
        .arg("--config")
        .arg(&service.config)
        .args(["--node", "testnode"])
        .arg("--registry-dir")
        .arg(&registry)
        .arg("--plugin-dir")
        .arg(&plugins)
        .arg("--cdi-dir")
        .arg(&cdi)
        .env("KUBECONFIG", &config)
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let (registration, dra) = (
        registry.join("gpuplex.io-reg.sock"),
        plugins.join("dra.sock"),
    );
    let listening = (0..1000).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        registration.exists() && dra.exists()
    });
    assert!(
        listening,
        "the plugin did not listen within 20 s: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    let mut status = Vec::new();
    let mut get_info = Vec::new();
    let mut api_read = Vec::new();
    let (mut pin, mut release) = (Vec::new(), Vec::new());
    let (mut prepare, mut unprepare) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        let mut registration = RegistrationClient::new(channel(&registration).await);
        let mut plugin_client = v1::dra_plugin_client::DraPluginClient::new(channel(&dra).await);
        let kube_config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&config).unwrap(),
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        let api = ApiClaims::new(apiserver::client(kube_config).unwrap());
        let socket = service.socket.clone();
        for round in 0..rounds {
            // The baselines, between the rounds so that both see the same machine. (Blocking
            // calls on this thread are fine: the API server's tasks run on the runtime's workers.)
            for i in 0..claims {
                let start = Instant::now();
                let gpus = NodeClient::connect(&socket)
                    .and_then(|mut c| c.status())
                    .unwrap()
                    .gpus;
                status.push(start.elapsed());
                assert_eq!(gpus.len(), GPUS);

                let start = Instant::now();
                registration.get_info(InfoRequest {}).await.unwrap();
                get_info.push(start.elapsed());

                let asked = ClaimRef {
                    namespace: "bench".into(),
                    name: format!("claim-{i}"),
                    uid: uid(i),
                };
                let start = Instant::now();
                let found: ResourceClaim = api.get(&asked).await.unwrap();
                api_read.push(start.elapsed());

                // The node service's part: the claim's placement pinned, then released.
                let plan = claim::plan(&found, &asked, "testnode").unwrap();
                let key = uid(DIRECT + i);
                let start = Instant::now();
                NodeClient::connect(&socket)
                    .and_then(|mut c| c.pin(&key, &plan.placement, &plan.annotations))
                    .unwrap();
                pin.push(start.elapsed());
                let start = Instant::now();
                let released = NodeClient::connect(&socket)
                    .and_then(|mut c| c.release(&ReleaseKey::Claim(key)))
                    .unwrap();
                release.push(start.elapsed());
                assert!(released.is_some());
            }

            for i in 0..claims {
                let request = v1::NodePrepareResourcesRequest {
                    claims: vec![claim_ref(i)],
                };
                let start = Instant::now();
                let answer = plugin_client
                    .node_prepare_resources(request)
                    .await
                    .unwrap()
                    .into_inner();
                prepare.push(start.elapsed());
                let prepared = &answer.claims[&uid(i)];
                assert_eq!(prepared.error, "", "round {round}, claim {i}");
                assert_eq!(prepared.devices[0].device_name, format!("gpu-{}", i % GPUS));
            }
            let held = service.status();
            assert_eq!(held["reservations"].as_array().unwrap().len(), claims);
            assert_eq!(std::fs::read_dir(&cdi).unwrap().count(), claims);

            for i in 0..claims {
                let request = v1::NodeUnprepareResourcesRequest {
                    claims: vec![claim_ref(i)],
                };
                let start = Instant::now();
                let answer = plugin_client
                    .node_unprepare_resources(request)
                    .await
                    .unwrap()
                    .into_inner();
                unprepare.push(start.elapsed());
                assert_eq!(answer.claims[&uid(i)].error, "", "round {round}, claim {i}");
            }
            let held = service.status();
            assert!(held["reservations"].as_array().unwrap().is_empty());
            assert_eq!(std::fs::read_dir(&cdi).unwrap().count(), 0);
        }
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(plugin.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = plugin.wait();

    println!(
        "DRA prepare/unprepare, {claims} claims of 1 GiB on {GPUS} fake GPUs of 80 GiB, held at once, {rounds} rounds; one claim per call, DRA v1 over the plugin's unix socket"
    );
    let (prepared, prepare_p50) = quantiles(&mut prepare);
    let (unprepared, unprepare_p50) = quantiles(&mut unprepare);
    let (status_line, status_p50) = quantiles(&mut status);
    let (info_line, info_p50) = quantiles(&mut get_info);
    let (read_line, read_p50) = quantiles(&mut api_read);
    let (pin_line, pin_p50) = quantiles(&mut pin);
    let (release_line, release_p50) = quantiles(&mut release);
    for (what, line) in [
        ("NodePrepareResources", &prepared),
        ("NodeUnprepareResources", &unprepared),
        ("baseline, node service status round trip", &status_line),
        ("baseline, gRPC GetInfo round trip", &info_line),
        ("part, the claim read from the API server", &read_line),
        ("part, the node service's pin, directly", &pin_line),
        ("part, the node service's release, directly", &release_line),
    ] {
        println!("{:<44}{line}", format!("{what}:"));
    }
    println!(
        "p50 ratios: prepare = {:.1}x status, {:.1}x GetInfo, {:.1}x (API read + pin); unprepare = {:.1}x status, {:.1}x GetInfo, {:.1}x release",
        prepare_p50 / status_p50,
        prepare_p50 / info_p50,
        prepare_p50 / (read_p50 + pin_p50),
        unprepare_p50 / status_p50,
        unprepare_p50 / info_p50,
        unprepare_p50 / release_p50,
    );
}
