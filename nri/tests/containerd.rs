//! gpuplex through NRI on a real containerd (root; containerd 1.7 or later, whose NRI is
//! enabled in the test's config; `make test-hosts` runs it on Debian 13's containerd 1.7, and
//! on a machine with an older one it says `SKIPPED`). Every pod runs under runc's own shim
//! (`io.containerd.runc.v2`, the default handler); the plugin `gpuplex-nri` gives the
//! containers that ask their vGPU, the test plays the kubelet over the CRI, the DRA driver
//! prepares a claim whose CDI device containerd applies itself, and the device plugin answers
//! `Allocate` as the kubelet asks it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuplex_dra::claim::ClaimRef;
use gpuplex_dra::device_plugin::{DevicePlugin, PluginConfig};
use gpuplex_dra::driver::{Claims, Driver, DriverConfig};
use gpuplex_dra::proto::deviceplugin as dp;
use gpuplex_dra::proto::deviceplugin::device_plugin_server::DevicePlugin as _;
use gpuplex_integration::containerd::*;
use gpuplex_integration::cri::k8s_cri::v1 as cri_api;
use gpuplex_integration::cri::k8s_cri::v1::CdiDevice;
use gpuplex_integration::cri::*;
use gpuplex_integration::*;
use gpuplex_wire::config::{DeviceDelivery, NodeConfig};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

/// NRI's table in containerd 1.7's config (version 2).
const NRI_PLUGIN: &str = "io.containerd.nri.v1.nri";

/// What a container prints of its GPUs: its device nodes, `CUDA_VISIBLE_DEVICES` and identity.
const SHOW: &str = "ls /dev; echo CUDA=$CUDA_VISIBLE_DEVICES; cat /run/gpuplex/vgpu.json";

/// A busy loop, so that the cpu activity source sees work.
const BUSY: &str = "while :; do :; done";

/// Idle until `/tmp/go` exists, then busy: a container is never frozen while it has no work,
/// and under runc's own shim an exec into a frozen container fails ("cannot exec in a paused
/// container"; gpuplex's shim makes it wait for the container's window instead).
const IDLE_THEN_BUSY: &str = "until [ -e /tmp/go ]; do sleep 0.2; done; while :; do :; done";

/// Whether this machine's containerd has NRI (1.7 and later); if not, says so loudly.
fn containerd_has_nri(test: &str) -> bool {
    match containerd_version() {
        Some(version) if version >= (1, 7) => true,
        other => {
            eprintln!(
                "SKIPPED: {test} needs containerd 1.7 or later (NRI); this machine has {other:?}; make test-hosts runs it on Debian 13's containerd"
            );
            false
        }
    }
}

/// The claims the API server would hold, by uid.
#[derive(Default)]
struct Store(Mutex<HashMap<String, ResourceClaim>>);

impl Claims for &'static Store {
    async fn get(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        let claims = self.0.lock().unwrap();
        (claims.get(&claim.uid).cloned())
            .ok_or_else(|| format!("resourceclaims \"{}\" not found", claim.name))
    }
}

/// gpuplex-nri on a containerd's NRI socket, its log in a file.
struct NriPlugin {
    child: Option<Child>,
    log: PathBuf,
    config: PathBuf,
    socket: PathBuf,
}

impl NriPlugin {
    fn start(config: &Path, socket: &Path, log: &Path) -> NriPlugin {
        let mut plugin = NriPlugin {
            child: None,
            log: log.to_path_buf(),
            config: config.to_path_buf(),
            socket: socket.to_path_buf(),
        };
        plugin.spawn();
        plugin
    }

    fn spawn(&mut self) {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(bin("gpuplex-nri"))
            .arg("--config")
            .arg(&self.config)
            .arg("--nri-socket")
            .arg(&self.socket)
            .env("GPUPLEX_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start gpuplex-nri");
        self.child = Some(child);
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until containerd has configured the plugin `times` times in all (once per
    /// connection).
    fn wait_configured(&self, times: usize, containerd: &Containerd) {
        let configured = wait_until(Duration::from_secs(20), || {
            self.log().matches("configured by").count() >= times
        });
        assert!(
            configured,
            "the plugin was not configured {times} time(s):\n{}\n--- containerd:\n{}",
            self.log(),
            containerd.log_tail()
        );
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NriPlugin {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A node service with one fake GPU, a DRA driver writing specs into `dir/cdi`, containerd with
/// its CRI plugin (CDI applied by containerd, from `dir/cdi`) and NRI, and the plugin on it.
struct World {
    service: NodeService,
    driver: Driver<&'static Store>,
    store: &'static Store,
    tokio: tokio::runtime::Runtime,
    containerd: Containerd,
    plugin: NriPlugin,
    claims: Vec<ClaimRef>,
}

impl World {
    fn start(dir: &Path, minor: u32) -> World {
        let service = NodeService::start(&dir.join("node"), 1, minor, "");
        let cdi_dir = dir.join("cdi");
        let nri_socket = dir.join("nri.sock");
        let store: &'static Store = Box::leak(Box::default());
        let driver = Driver::new(
            store,
            DriverConfig {
                node: "testnode".into(),
                socket: service.socket.clone(),
                cdi_dir: cdi_dir.clone(),
                control_nodes: Vec::new(),
                hook: bin("gpuplex-hook"),
            },
        );
        let containerd = cri_containerd_configured(dir, &service.config, |config| {
            let cri = table_at_mut(config, &["plugins", CRI_PLUGIN_V2]);
            cri.insert("enable_cdi".into(), true.into());
            cri.insert(
                "cdi_spec_dirs".into(),
                vec![cdi_dir.display().to_string()].into(),
            );
            let nri = table_at_mut(config, &["plugins", NRI_PLUGIN]);
            nri.insert("disable".into(), false.into());
            nri.insert("disable_connections".into(), false.into());
            nri.insert(
                "socket_path".into(),
                nri_socket.display().to_string().into(),
            );
            let plugins = dir.join("nri-plugins");
            nri.insert("plugin_path".into(), plugins.display().to_string().into());
            nri.insert(
                "plugin_config_path".into(),
                dir.join("nri-conf").display().to_string().into(),
            );
        });
        let plugin = NriPlugin::start(&service.config, &nri_socket, &dir.join("nri.log"));
        plugin.wait_configured(1, &containerd);
        World {
            service,
            driver,
            store,
            tokio: tokio::runtime::Runtime::new().unwrap(),
            containerd,
            plugin,
            claims: Vec::new(),
        }
    }

    /// A claim of `gib` on GPU 0, allocated and prepared as the kubelet asks: its CDI device.
    fn prepare(&mut self, name: &str, gib: u32) -> String {
        let uid = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            std::process::id(),
            self.claims.len()
        );
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ml", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": "gpuplex.io", "pool": "testnode",
                "device": "gpu-0", "shareID": format!("share-{uid}"),
                "consumedCapacity": {"memory": format!("{gib}Gi")},
            }]}}},
        }))
        .unwrap();
        self.store.0.lock().unwrap().insert(uid.clone(), claim);
        let claim = ClaimRef {
            namespace: "ml".into(),
            name: name.into(),
            uid,
        };
        let devices = (self.tokio.block_on(self.driver.prepare(&claim)))
            .unwrap_or_else(|e| panic!("{claim}: {e}"));
        self.claims.push(claim);
        devices[0].cdi_device_ids[0].clone()
    }

    fn unprepare_all(&mut self) {
        for claim in std::mem::take(&mut self.claims) {
            (self.tokio.block_on(self.driver.unprepare(&claim)))
                .unwrap_or_else(|e| panic!("{claim}: {e}"));
        }
    }

    /// What the node service says of container `id`, if it has it.
    fn listed(&self, id: &str) -> Option<Value> {
        let status = self.service.status();
        (status["containers"].as_array()?.iter())
            .find(|c| c["id"] == id)
            .cloned()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for claim in std::mem::take(&mut self.claims) {
            let _ = self.tokio.block_on(self.driver.unprepare(&claim));
        }
    }
}

/// Runs a container ([`IDLE_THEN_BUSY`]) in a new host-network pod of namespace `ml` (runc's handler), with
/// the pod's `annotations` and, if given, a claim's CDI `device`: the pod and the container.
fn busy_pod<'a>(
    w: &World,
    cri: &'a Cri,
    name: &str,
    annotations: &[(&str, &str)],
    device: Option<&str>,
) -> (Pod<'a>, String) {
    let pod = cri
        .run_pod_sandbox(&host_network_pod(name, "ml", annotations), "")
        .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", w.containerd.log_tail()));
    let mut config =
        host_network_container("app", BUSYBOX_IMAGE, &["sh", "-c", IDLE_THEN_BUSY], &[]);
    if let Some(device) = device {
        config.cdi_devices = vec![CdiDevice {
            name: device.to_owned(),
        }];
    }
    let id = pod.create_container(&config).unwrap_or_else(|e| {
        panic!(
            "CreateContainer {name}: {e}\n{}\n--- plugin:\n{}",
            w.containerd.log_tail(),
            w.plugin.log()
        )
    });
    cri.start_container(&id)
        .unwrap_or_else(|e| panic!("StartContainer {name}: {e}\n{}", w.containerd.log_tail()));
    (pod, id)
}

/// The init pid of container `id`.
fn pid_of(cri: &Cri, id: &str) -> u32 {
    let info = cri.container_info(id).expect("ContainerStatus");
    info["pid"].as_u64().expect("a pid") as u32
}

/// Over `span`, in how many freezer samples each container was frozen, of how many.
fn frozen_samples(pids: &[u32], span: Duration) -> (u32, Vec<u32>) {
    let probes: Vec<FreezerProbe> = (pids.iter())
        .map(|&p| FreezerProbe::of_pid(p).expect("a container's freezer"))
        .collect();
    let (mut samples, mut frozen) = (0, vec![0; pids.len()]);
    let end = Instant::now() + span;
    while Instant::now() < end {
        samples += 1;
        for (count, probe) in frozen.iter_mut().zip(&probes) {
            *count += u32::from(probe.state().is_some_and(|s| s != "THAWED"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    (samples, frozen)
}

#[test]
fn pods_of_runcs_handler_get_their_vgpus_through_nri_and_take_turns() {
    let test = "pods_of_runcs_handler_get_their_vgpus_through_nri_and_take_turns";
    if !can_run_containerd(test) || !containerd_has_nri(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = World::start(dir.path(), 150);
    let cri = Cri::connect(&w.containerd.socket);
    let device = w.prepare("claimed", 4);
    let asks = [("gpuplex.io/gpu-memory", "2Gi"), ("gpuplex.io/weight", "2")];
    let (pod_a, a) = busy_pod(&w, &cri, "annotated", &asks, None);
    let (pod_c, c) = busy_pod(&w, &cri, "claimed", &[], Some(&device));

    // Both attached, under runc's shim: no gpuplex shim runs.
    for id in [&a, &c] {
        let attached = wait_until(Duration::from_secs(10), || w.listed(id).is_some());
        assert!(
            attached,
            "{id} not attached: {}\n--- plugin:\n{}",
            w.service.status(),
            w.plugin.log()
        );
    }
    for pod in [&pod_a, &pod_c] {
        let info = cri.sandbox_info(&pod.id).expect("PodSandboxStatus");
        assert_eq!(info["runtimeType"], RUNC, "{info:#}");
    }
    assert!(shim_daemons(GPUPLEX_SHIM).is_empty(), "a gpuplex shim runs");
    let listed = w.listed(&a).unwrap();
    assert_eq!(listed["weight"], 2, "{listed}");
    assert_eq!(listed["namespace"], "ml", "{listed}");
    assert_eq!(listed["pod"], "annotated", "{listed}");
    let status = w.service.status();
    assert_eq!(status["reservations"], json!([]), "{status}");

    // Each sees its GPU, its identity and CUDA_VISIBLE_DEVICES.
    let device_name = w.service.devices[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    for id in [&a, &c] {
        let seen = cri
            .exec_sync(
                id,
                &["sh", "-c", &format!("{SHOW}; touch /tmp/go")],
                Duration::from_secs(30),
            )
            .unwrap_or_else(|e| panic!("ExecSync {id}: {e}"));
        let printed = String::from_utf8_lossy(&seen.stdout);
        assert!(printed.contains("CUDA=GPU-fake-0"), "{id}: {printed}");
        assert!(printed.contains("\"vgpu\""), "{id}: {printed}");
        let spec = cri.container_info(id).unwrap()["runtimeSpec"].clone();
        let devices = spec["linux"]["devices"].to_string();
        assert!(
            devices.contains(&device_name) || devices.contains("195"),
            "{id}: {devices}"
        );
    }
    let spec = cri.container_info(&a).unwrap()["runtimeSpec"].clone();
    assert!(
        spec["annotations"]["gpuplex.io/vgpu-handle"].is_string(),
        "{}",
        spec["annotations"]
    );

    // They take turns on the one GPU.
    let pids = [pid_of(&cri, &a), pid_of(&cri, &c)];
    let (samples, frozen) = frozen_samples(&pids, Duration::from_secs(3));
    eprintln!("of {samples} samples, frozen: {frozen:?}");
    assert!(
        frozen.iter().all(|&f| f > 0 && f < samples),
        "no turns: {frozen:?} of {samples}\n{}",
        w.service.status()
    );

    // The plugin killed mid-run and started again: a pod created meanwhile runs without a vGPU
    // (NRI creates it as if the plugin were not there); the others keep theirs and their turns.
    w.plugin.kill9();
    let (pod_m, m) = busy_pod(&w, &cri, "missed", &asks, None);
    cri.exec_sync(&m, &["touch", "/tmp/go"], Duration::from_secs(30))
        .expect("ExecSync");
    w.plugin.spawn();
    w.plugin.wait_configured(2, &w.containerd);
    // The synchronisation follows the configuration: the plugin names the missed container.
    let named = wait_until(Duration::from_secs(20), || {
        w.plugin.log().contains("created while the plugin was away")
    });
    assert!(named, "{}", w.plugin.log());
    assert!(w.listed(&m).is_none(), "{}", w.service.status());
    assert!(w.listed(&a).is_some() && w.listed(&c).is_some());
    let (_, frozen) = frozen_samples(&pids, Duration::from_secs(2));
    assert!(
        frozen.iter().all(|&f| f > 0),
        "no turns after the restart: {frozen:?}"
    );

    // The pods go: nothing stays attached, reserved or frozen.
    for mut pod in [pod_a, pod_c, pod_m] {
        pod.remove().expect("the pod removed");
    }
    w.unprepare_all();
    assert!(
        wait_until(Duration::from_secs(10), || w.service.held() == (0, 0)),
        "{}",
        w.service.status()
    );
    for pid in pids {
        assert!(
            freezer_state(pid).is_none_or(|s| s == "THAWED"),
            "{pid} left frozen"
        );
    }
}

#[test]
fn the_plugin_comes_back_when_containerd_restarts_and_refusals_reach_the_kubelet() {
    let test = "the_plugin_comes_back_when_containerd_restarts_and_refusals_reach_the_kubelet";
    if !can_run_containerd(test) || !containerd_has_nri(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = World::start(dir.path(), 152);
    w.containerd.restart();
    w.plugin.wait_configured(2, &w.containerd);

    let cri = Cri::connect(&w.containerd.socket);
    let (mut pod, id) = busy_pod(&w, &cri, "after", &[("gpuplex.io/gpu-memory", "1Gi")], None);
    assert!(wait_until(Duration::from_secs(10), || w
        .listed(&id)
        .is_some()));

    // What gpuplex refuses fails the container's creation with its one line.
    let refused = cri
        .run_pod_sandbox(
            &host_network_pod("greedy", "ml", &[("gpuplex.io/gpu-memory", "64Gi")]),
            "",
        )
        .expect("the sandbox itself asks for nothing");
    let config = host_network_container("app", BUSYBOX_IMAGE, &["sh", "-c", BUSY], &[]);
    let err = refused.create_container(&config).unwrap_err();
    let message = err.message();
    assert!(message.contains("gpuplex: "), "{message}");
    assert!(message.contains("64 GiB needed"), "{message}");
    drop(refused);
    pod.remove().unwrap();
    assert!(wait_until(Duration::from_secs(10), || w.service.held() == (0, 0)));
}

/// The kubelet's `Allocate` for one container's units, as the device plugin answers it.
fn allocate(
    tokio: &tokio::runtime::Runtime,
    plugin: &DevicePlugin,
    ids: Vec<String>,
) -> dp::ContainerAllocateResponse {
    let request = dp::AllocateRequest {
        container_requests: vec![dp::ContainerAllocateRequest { devices_ids: ids }],
    };
    tokio
        .block_on(plugin.allocate(tonic::Request::new(request)))
        .map(|a| a.into_inner().container_responses.remove(0))
        .expect("Allocate")
}

#[test]
fn a_device_plugin_allocations_container_is_attached_by_the_plugin_with_its_pods_weight() {
    let test =
        "a_device_plugin_allocations_container_is_attached_by_the_plugin_with_its_pods_weight";
    if !can_run_containerd(test) || !containerd_has_nri(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let w = World::start(dir.path(), 154);
    let config = NodeConfig::load(&w.service.config, true).unwrap();
    let plugin = DevicePlugin::new(PluginConfig {
        node: "testnode".into(),
        socket: w.service.socket.clone(),
        unit: config.kubernetes.gpu_memory_unit,
        delivery: DeviceDelivery::Kubelet,
        policy: config.scheduler.policy,
        cdi_dir: dir.path().join("cdi"),
        hook: bin("gpuplex-hook"),
        control_nodes: Vec::new(),
        poll: Duration::from_secs(1),
    });
    plugin.refresh().expect("the node's GPUs");
    let answer = allocate(&w.tokio, &plugin, vec!["gpu-0-0".into(), "gpu-0-1".into()]);

    // The container's config as the kubelet makes it from the answer (kuberuntime's
    // generateContainerConfig: envs, mounts, devices, annotations), in a pod asking weight 3.
    let cri = Cri::connect(&w.containerd.socket);
    let mut pod = cri
        .run_pod_sandbox(
            &host_network_pod("served", "ml", &[("gpuplex.io/weight", "3")]),
            "",
        )
        .unwrap();
    let mut config =
        host_network_container("app", BUSYBOX_IMAGE, &["sh", "-c", IDLE_THEN_BUSY], &[]);
    config
        .envs
        .extend(answer.envs.iter().map(|(key, value)| cri_api::KeyValue {
            key: key.clone(),
            value: value.clone(),
        }));
    config
        .mounts
        .extend(answer.mounts.iter().map(|m| cri_api::Mount {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            readonly: m.read_only,
            ..Default::default()
        }));
    config
        .devices
        .extend(answer.devices.iter().map(|d| cri_api::Device {
            container_path: d.container_path.clone(),
            host_path: d.host_path.clone(),
            permissions: d.permissions.clone(),
        }));
    config.annotations.extend(answer.annotations.clone());
    let id = pod
        .create_container(&config)
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n--- plugin:\n{}", w.plugin.log()));
    cri.start_container(&id).unwrap();
    let attached = wait_until(Duration::from_secs(10), || w.listed(&id).is_some());
    assert!(
        attached,
        "not attached: {}\n--- plugin:\n{}",
        w.service.status(),
        w.plugin.log()
    );
    let entry = w.listed(&id).unwrap();
    assert_eq!(entry["weight"], 3, "{entry}");
    assert_eq!(entry["namespace"], "ml", "{entry}");
    assert_eq!(entry["memory"], json!([2u64 << 30]), "{entry}");
    assert_eq!(w.service.status()["reservations"], json!([]));
    let seen = cri
        .exec_sync(&id, &["sh", "-c", SHOW], Duration::from_secs(30))
        .unwrap();
    let printed = String::from_utf8_lossy(&seen.stdout);
    assert!(printed.contains("CUDA=GPU-fake-0"), "{printed}");
    pod.remove().unwrap();
    assert!(wait_until(Duration::from_secs(10), || w
        .listed(&id)
        .is_none()));
}

#[test]
fn a_pod_of_gpuplexs_own_shim_is_the_shims_with_the_plugin_beside_it() {
    let test = "a_pod_of_gpuplexs_own_shim_is_the_shims_with_the_plugin_beside_it";
    if !can_run_containerd(test) || !containerd_has_nri(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let w = World::start(dir.path(), 156);
    let cri = Cri::connect(&w.containerd.socket);
    // Both ways in on one node: a pod of RuntimeClass gpuplex (the shim), and one of runc's.
    let asks = [("gpuplex.io/gpu-memory", "2Gi")];
    let mut shims = cri
        .run_pod_sandbox(&host_network_pod("shims", "ml", &asks), "gpuplex")
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", w.containerd.log_tail()));
    let config = host_network_container("app", BUSYBOX_IMAGE, &["sh", "-c", IDLE_THEN_BUSY], &[]);
    let by_shim = shims.create_container(&config).unwrap_or_else(|e| {
        panic!(
            "CreateContainer under the shim: {e}\n--- plugin:\n{}",
            w.plugin.log()
        )
    });
    cri.start_container(&by_shim).unwrap();
    let (mut runcs, by_plugin) = busy_pod(&w, &cri, "runcs", &asks, None);
    for id in [&by_shim, &by_plugin] {
        assert!(
            wait_until(Duration::from_secs(10), || w.listed(id).is_some()),
            "{id} not attached: {}\n--- plugin:\n{}",
            w.service.status(),
            w.plugin.log()
        );
    }
    // One vGPU each, none left reserved: the plugin left the shim's pod to the shim.
    let status = w.service.status();
    assert_eq!(
        status["containers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    assert_eq!(status["reservations"], json!([]), "{status}");
    let spec = cri.container_info(&by_shim).unwrap()["runtimeSpec"].clone();
    assert!(
        spec["annotations"]["gpuplex.io/vgpu-handle"].is_null(),
        "{spec}"
    );
    assert!(
        !w.plugin.log().contains(&by_shim[..12]),
        "{}",
        w.plugin.log()
    );
    shims.remove().unwrap();
    runcs.remove().unwrap();
    assert!(wait_until(Duration::from_secs(10), || w.service.held() == (0, 0)));
}
