//! The device plugin's `Allocate` answers passed to real containerd 1.6 through CRI
//! `CreateContainer`, as the kubelet passes them (root): the answer's devices, mounts and
//! environment become the container's, its annotations the container's (which containerd
//! passes on to the runtime through `container_annotations`), and the gpuplex shim attaches the
//! container to the units' vGPU. Two pods allocated at once run on the GPUs the kubelet gave
//! each, with the memory of their units and their pods' weights; once they are gone, their units
//! given again end their allocations.

use std::time::Duration;

use gpuplex_dra::device_plugin::{DevicePlugin, PluginConfig};
use gpuplex_dra::proto::deviceplugin as dp;
use gpuplex_dra::proto::deviceplugin::device_plugin_server::DevicePlugin as _;
use gpuplex_integration::containerd::*;
use gpuplex_integration::cri::k8s_cri::v1 as cri_api;
use gpuplex_integration::cri::*;
use gpuplex_integration::*;
use gpuplex_wire::annotations::ALLOCATION;
use gpuplex_wire::config::{DeviceDelivery, NodeConfig};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

fn units(gpu: u32, ns: std::ops::Range<u32>) -> Vec<String> {
    ns.map(|n| format!("gpu-{gpu}-{n}")).collect()
}

/// The kubelet's `Allocate` for one container's units, as the plugin answers it.
fn allocate(
    runtime: &tokio::runtime::Runtime,
    plugin: &DevicePlugin,
    ids: Vec<String>,
) -> Result<dp::ContainerAllocateResponse, tonic::Status> {
    let request = dp::AllocateRequest {
        container_requests: vec![dp::ContainerAllocateRequest { devices_ids: ids }],
    };
    runtime
        .block_on(plugin.allocate(tonic::Request::new(request)))
        .map(|a| a.into_inner().container_responses.remove(0))
}

/// A container's config with what `Allocate` answered, as the kubelet makes it
/// (kuberuntime's generateContainerConfig: envs, mounts, devices, annotations).
fn with_allocation(
    mut config: cri_api::ContainerConfig,
    answer: &dp::ContainerAllocateResponse,
) -> cri_api::ContainerConfig {
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
    config
}

fn listed(status: &Value, id: &str) -> Option<Value> {
    status["containers"]
        .as_array()?
        .iter()
        .find(|c| c["id"] == id)
        .cloned()
}

#[test]
fn two_pods_allocated_at_once_run_on_the_gpus_the_kubelet_gave_each() {
    let test = "two_pods_allocated_at_once_run_on_the_gpus_the_kubelet_gave_each";
    if !can_run_containerd(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let service = NodeService::start(
        &dir.path().join("node"),
        2,
        242,
        "[kubernetes]\nplugin = \"device-plugin\"\n",
    );
    let containerd = cri_containerd(dir.path(), &service.config);

    // The plugin as gpuplex-dra runs it from the same gpuplex.toml.
    let config = NodeConfig::load(&service.config, true).unwrap();
    let plugin = DevicePlugin::new(PluginConfig {
        node: "testnode".into(),
        socket: service.socket.clone(),
        unit: config.kubernetes.gpu_memory_unit,
        delivery: DeviceDelivery::Kubelet,
        policy: config.scheduler.policy,
        cdi_dir: dir.path().join("cdi"),
        hook: bin("gpuplex-hook"),
        control_nodes: Vec::new(),
        poll: Duration::from_secs(1),
    });
    plugin.refresh().expect("the node's GPUs");
    let runtime = tokio::runtime::Runtime::new().unwrap();

    // The kubelet admits two pods, one after the other, before either starts: 8 units of
    // GPU 1 for the trainer, 4 of GPU 0 for the server.
    let trainer_units = allocate(&runtime, &plugin, units(1, 0..8)).expect("Allocate");
    let server_units = allocate(&runtime, &plugin, units(0, 0..4)).expect("Allocate");
    assert_ne!(
        trainer_units.annotations[ALLOCATION],
        server_units.annotations[ALLOCATION]
    );

    let cri = Cri::connect(&containerd.socket);
    let run = |name: &str, weight: &str, answer: &dp::ContainerAllocateResponse| {
        let pod_config = host_network_pod(name, "ml", &[("gpuplex.io/weight", weight)]);
        let pod = cri
            .run_pod_sandbox(&pod_config, "gpuplex")
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", service.log()));
        let config =
            host_network_container("main", BUSYBOX_IMAGE, &["sh", "-c", "sleep 1000"], &[]);
        let container = pod
            .create_container(&with_allocation(config, answer))
            .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", service.log()));
        cri.start_container(&container)
            .unwrap_or_else(|e| panic!("StartContainer: {e}"));
        (pod, container)
    };
    let (mut trainer_pod, trainer) = run("trainer", "3", &trainer_units);
    let (mut server_pod, server) = run("server", "1", &server_units);

    let exec = |container: &str, command: &[&str]| -> String {
        let out = cri
            .exec_sync(container, command, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("ExecSync {command:?}: {e}"));
        assert_eq!(
            out.exit_code,
            0,
            "{command:?}: {:?}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        wait_until(Duration::from_secs(5), || service.held().0 == 2),
        "{:#}",
        service.status()
    );
    let status = service.status();
    eprintln!("node status with both pods running: {status}");
    for (container, gpu, memory, weight) in [(&trainer, 1, 8 * GIB, 3), (&server, 0, 4 * GIB, 1)] {
        let entry = listed(&status, container).expect("listed");
        assert_eq!(entry["gpus"], json!([gpu]), "{entry}");
        assert_eq!(entry["memory"], json!([memory]), "{entry}");
        assert_eq!(entry["weight"], weight, "{entry}");
        assert_eq!(entry["namespace"], "ml", "{entry}");
        let identity: Value =
            serde_json::from_str(&exec(container, &["cat", "/run/gpuplex/vgpu.json"])).unwrap();
        assert_eq!(identity["vgpu"], entry["vgpu"], "{identity}");
        assert_eq!(identity["container"], json!(container), "{identity}");
        assert_eq!(identity["gpus"][0]["index"], gpu, "{identity}");
        assert_eq!(identity["gpus"][0]["memory"], memory, "{identity}");
        let cuda = exec(container, &["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]);
        assert_eq!(cuda, format!("GPU-fake-{gpu}\n"));
        // Its GPU's node is there, the other GPU's is not.
        let nodes = exec(
            container,
            &["sh", "-c", "ls /dev | grep gpuplexfake || true"],
        );
        let node = service.devices[gpu as usize].file_name().unwrap();
        assert_eq!(
            nodes,
            format!("{}\n", node.to_string_lossy()),
            "{container}"
        );
    }
    let unreserved = |gpu: usize| status["gpus"][gpu]["unreserved"].as_u64().unwrap();
    assert_eq!((unreserved(0), unreserved(1)), (12 * GIB, 8 * GIB));
    // runc's spec carries the allocation's handle as the kubelet gave it, and no hook of gpuplex.
    let info = cri.container_info(&trainer).expect("ContainerStatus");
    let spec = &info["runtimeSpec"];
    assert_eq!(
        spec["annotations"][ALLOCATION],
        json!(trainer_units.annotations[ALLOCATION])
    );

    // The pods go; their allocations stay with their units until the kubelet gives them again.
    trainer_pod.remove().expect("RemovePodSandbox");
    server_pod.remove().expect("RemovePodSandbox");
    assert!(wait_until(Duration::from_secs(5), || service.held().0 == 0));
    assert_eq!(service.status()["gpus"][1]["unreserved"], 8 * GIB);
    let next = allocate(&runtime, &plugin, units(1, 4..6)).expect("Allocate");
    assert_ne!(
        next.annotations[ALLOCATION],
        trainer_units.annotations[ALLOCATION]
    );
    let status = service.status();
    assert_eq!(status["gpus"][1]["unreserved"], 14 * GIB, "{status}");
    assert_eq!(status["gpus"][0]["unreserved"], 12 * GIB, "{status}");
}
