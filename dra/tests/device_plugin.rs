//! `gpuplex-dra` switched to the device plugin by gpuplex.toml (`[kubernetes] plugin =
//! "device-plugin"`), with the real node service (root) and the test in the kubelet's place,
//! over gRPC on unix sockets as the kubelet speaks it: registration, `ListAndWatch` (a GPU's
//! device node removed and made again), `GetPreferredAllocation`, `Allocate` (the units pinned on
//! their GPU; units on two GPUs refused in one line), a kubelet restart (sockets removed, a new
//! kubelet socket: the plugin registers again), and SIGTERM; the node's changes reaching
//! `ListAndWatch` and the CDI specs as they happen, with no poll (an ended allocation's spec
//! removed, a GPU gone and back, the node service stopped and started again).

#[path = "../../node/tests/support/mod.rs"]
mod support;
mod unix_grpc;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplex_dra::proto::deviceplugin as dp;
use gpuplex_wire::annotations::ALLOCATION;
use support::{can_run, NodeService, Setup};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;
use unix_grpc::channel;

const GIB: u64 = 1 << 30;

/// The kubelet's registration service, as the test plays it: what it was asked.
#[derive(Clone, Default)]
struct Kubelet(Arc<Mutex<Vec<dp::RegisterRequest>>>);

#[tonic::async_trait]
impl dp::registration_server::Registration for Kubelet {
    async fn register(
        &self,
        request: tonic::Request<dp::RegisterRequest>,
    ) -> Result<tonic::Response<dp::Empty>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(dp::Empty {}))
    }
}

impl Kubelet {
    /// Serves on `socket` until the returned sender is dropped or sent to.
    async fn serve(&self, socket: &Path) -> tokio::sync::oneshot::Sender<()> {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(dp::registration_server::RegistrationServer::new(
                self.clone(),
            ))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            });
        tokio::spawn(server);
        stop
    }

    fn registrations(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

fn ids(gpu: u32, ns: impl IntoIterator<Item = u32>) -> Vec<String> {
    ns.into_iter().map(|n| format!("gpu-{gpu}-{n}")).collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The plugin binary on `service`'s configuration, beside the kubelet socket in `dir`.
fn plugin(service: &NodeService, dir: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_gpuplex-dra"))
        .args([
            "--config",
            service.config.to_str().unwrap(),
            "--node",
            "testnode",
        ])
        .arg("--kubelet-socket")
        .arg(dir.join("kubelet.sock"))
        .arg("--cdi-dir")
        .arg(dir.join("cdi"))
        .args(["--poll", "100ms"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn the_device_plugin(gpus: usize) -> Setup {
    Setup {
        gpus,
        extra_service: "\n[kubernetes]\nplugin = \"device-plugin\"\n".into(),
        ..Setup::default()
    }
}

/// The next `ListAndWatch` update, within 20 s.
async fn next(
    updates: &mut (impl tokio_stream::Stream<Item = Result<dp::ListAndWatchResponse, tonic::Status>>
              + Unpin),
) -> dp::ListAndWatchResponse {
    let next = tokio::time::timeout(Duration::from_secs(20), updates.next());
    next.await.expect("an update within 20 s").unwrap().unwrap()
}

/// The health of each unit of `gpu` in `listed`.
fn health_of(listed: &dp::ListAndWatchResponse, gpu: u32) -> Vec<&str> {
    let prefix = format!("gpu-{gpu}-");
    (listed.devices.iter())
        .filter(|d| d.id.starts_with(&prefix))
        .map(|d| d.health.as_str())
        .collect()
}

#[test]
fn the_kubelet_registers_lists_prefers_and_allocates_units_and_the_plugin_survives_its_restart() {
    if !can_run("the_kubelet_registers_lists_prefers_and_allocates_units_and_the_plugin_survives_its_restart") {
        return;
    }
    let service = NodeService::start(the_device_plugin(2));
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let kubelet = Kubelet::default();
    let kubelet_socket = dir.path().join("kubelet.sock");
    let stop_kubelet = runtime.block_on(kubelet.serve(&kubelet_socket));
    let mut child = plugin(&service, dir.path());
    let socket: PathBuf = dir.path().join("gpuplex-gpu-memory.sock");

    // Registration: the resource, the API version, the endpoint beside the kubelet's socket.
    wait_for("registration", || kubelet.registrations() == 1);
    let asked = kubelet.0.lock().unwrap()[0].clone();
    assert_eq!(asked.version, "v1beta1");
    assert_eq!(asked.resource_name, "gpuplex.io/gpu-memory");
    assert_eq!(asked.endpoint, "gpuplex-gpu-memory.sock");
    assert!(asked.options.unwrap().get_preferred_allocation_available);
    assert!(socket.exists());

    runtime.block_on(async {
        let mut dp = dp::device_plugin_client::DevicePluginClient::new(channel(&socket).await);
        let options = dp.get_device_plugin_options(dp::Empty {}).await.unwrap();
        assert!(!options.into_inner().pre_start_required);

        // Two GPUs of 16 GiB: 16 units each, all healthy (once the node's GPUs are read).
        let mut updates = dp.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        let mut listed = next(&mut updates).await;
        while listed.devices.is_empty() {
            listed = next(&mut updates).await;
        }
        assert_eq!(listed.devices.len(), 32);
        assert_eq!(health_of(&listed, 0), ["Healthy"; 16]);
        assert_eq!(listed.devices[17].id, "gpu-1-1");

        // Preferred: a request of 8 stays on one GPU, the one with the most free units.
        let mut available = ids(0, 0..6);
        available.extend(ids(1, 2..16));
        let prefer = |available: Vec<String>, must: Vec<String>, size: i32| {
            let mut dp = dp.clone();
            async move {
                let request = dp::PreferredAllocationRequest {
                    container_requests: vec![dp::ContainerPreferredAllocationRequest {
                        available_device_i_ds: available,
                        must_include_device_i_ds: must,
                        allocation_size: size,
                    }],
                };
                let answer = dp.get_preferred_allocation(request).await.unwrap();
                answer.into_inner().container_responses[0]
                    .device_i_ds
                    .clone()
            }
        };
        assert_eq!(prefer(available.clone(), vec![], 8).await, ids(1, 2..10));
        // A unit the kubelet must include keeps the request on its GPU.
        assert_eq!(
            prefer(available.clone(), ids(0, [4]), 3).await,
            ["gpu-0-4", "gpu-0-0", "gpu-0-1"]
        );

        // Allocate: the units are pinned on GPU 1, 8 GiB, and the answer gives the container
        // GPU 1's node, its UUID, its identity and the allocation's handle.
        let allocate = |units: Vec<String>| {
            let mut dp = dp.clone();
            async move {
                let request = dp::AllocateRequest {
                    container_requests: vec![dp::ContainerAllocateRequest { devices_ids: units }],
                };
                dp.allocate(request)
                    .await
                    .map(|a| a.into_inner().container_responses[0].clone())
            }
        };
        let answer = allocate(ids(1, 2..10)).await.unwrap();
        assert_eq!(answer.envs["CUDA_VISIBLE_DEVICES"], "GPU-fake-1");
        assert_eq!(answer.annotations[ALLOCATION].len(), 32);
        let gpu_node = &answer.devices[0];
        assert_eq!(Path::new(&gpu_node.host_path), service.devices[1]);
        assert_eq!(gpu_node.permissions, "rwm");
        let identity = &answer.mounts[0];
        assert_eq!(identity.container_path, "/run/gpuplex/vgpu.json");
        assert!(identity.read_only);
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&identity.host_path).unwrap()).unwrap();
        assert_eq!(written["gpus"][0]["index"], 1, "{written}");
        assert_eq!(written["gpus"][0]["memory"], 8 * GIB, "{written}");
        let status = service.status();
        assert_eq!(status["gpus"][1]["unreserved"], 8 * GIB);
        assert_eq!(status["reservations"][0]["claim"], "units-gpu-1-2");
        // The kubelet asks again (a retry): the same answer, nothing more reserved.
        assert_eq!(allocate(ids(1, 2..10)).await.unwrap(), answer);
        assert_eq!(service.status()["gpus"][1]["unreserved"], 8 * GIB);

        // Units on two GPUs cannot be one vGPU's memory: refused in one line, nothing reserved.
        let mut spread = ids(0, [0]);
        spread.extend(ids(1, [12]));
        let refused = allocate(spread).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        let line = refused.message();
        assert!(
            line.contains("on GPUs 0, 1") && !line.contains('\n'),
            "{line}"
        );
        assert_eq!(service.status()["gpus"][0]["unreserved"], 16 * GIB);
        let forged = allocate(vec!["../gpu-1-0".into()]).await.unwrap_err();
        assert!(
            forged
                .message()
                .contains("is not a gpuplex.io/gpu-memory unit"),
            "{forged:?}"
        );

        // A unit no GPU lists (the kubelet was never shown gpu-0-99999) pins nothing.
        let beyond = allocate(ids(0, [99999])).await.unwrap_err();
        let line = beyond.message();
        assert!(
            line.contains("gpu-0-99999 is not one this node lists: GPU 0 offers 16 units")
                && !line.contains('\n'),
            "{beyond:?}"
        );
        assert_eq!(service.status()["gpus"][0]["unreserved"], 16 * GIB);
        // Two containers of one request given the same unit: refused whole, before either is
        // pinned (allocated in turn, the second would end the first's allocation).
        let request = dp::AllocateRequest {
            container_requests: vec![
                dp::ContainerAllocateRequest {
                    devices_ids: ids(0, 0..3),
                },
                dp::ContainerAllocateRequest {
                    devices_ids: ids(0, 2..4),
                },
            ],
        };
        let shared = dp.clone().allocate(request).await.unwrap_err();
        assert_eq!(shared.code(), tonic::Code::InvalidArgument);
        assert!(
            shared
                .message()
                .contains("gpu-0-2 was given to two containers"),
            "{shared:?}"
        );
        assert_eq!(service.status()["gpus"][0]["unreserved"], 16 * GIB);
        assert_eq!(
            service.status()["reservations"].as_array().unwrap().len(),
            1
        );

        // GPU 0's device node disappears: its units turn unhealthy, and healthy again when
        // it is back.
        let node = &service.devices[0];
        let rdev = std::fs::metadata(node).unwrap().rdev();
        std::fs::remove_file(node).unwrap();
        let mut listed = next(&mut updates).await;
        assert_eq!(health_of(&listed, 0), ["Unhealthy"; 16]);
        assert_eq!(health_of(&listed, 1), ["Healthy"; 16]);
        nix::sys::stat::mknod(
            node,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            rdev,
        )
        .unwrap();
        listed = next(&mut updates).await;
        assert_eq!(health_of(&listed, 0), ["Healthy"; 16]);
    });

    // The kubelet restarts: it removes every socket in its directory and serves a new one.
    drop(stop_kubelet);
    std::fs::remove_file(&kubelet_socket).unwrap();
    std::fs::remove_file(&socket).unwrap();
    let stop_kubelet = runtime.block_on(kubelet.serve(&kubelet_socket));
    wait_for("registration after the kubelet's restart", || {
        kubelet.registrations() == 2
    });
    wait_for("the plugin's socket", || socket.exists());
    runtime.block_on(async {
        let mut dp = dp::device_plugin_client::DevicePluginClient::new(channel(&socket).await);
        let mut updates = dp.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        let listed = next(&mut updates).await;
        assert_eq!(listed.devices.len(), 32);
    });
    // The kubelet's socket replaced while the plugin's stays (a kubelet that does not empty the
    // directory). A kubelet's restart takes seconds; 50 ms apart, the new socket's change time
    // differs even where it reuses the old one's inode number.
    drop(stop_kubelet);
    std::fs::remove_file(&kubelet_socket).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let _stop_kubelet = runtime.block_on(kubelet.serve(&kubelet_socket));
    wait_for("registration with the new kubelet socket", || {
        kubelet.registrations() == 3
    });

    // SIGTERM: it stops, and its socket goes.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(status.success(), "{status}: {log}");
    assert!(!socket.exists(), "{log}");
    assert!(log.contains("registering again"), "{log}");
}

/// With `device_plugin_devices = "cdi"` the answer names the allocation's CDI device, whose spec
/// (read by the CDI reference crate) carries the edits and the attach step with the handle; a
/// spec whose allocation the kubelet's units ended is removed at the next refresh.
#[test]
fn with_cdi_an_allocation_is_a_cdi_device_whose_spec_goes_with_it() {
    use gpuplex_dra::device_plugin::{DevicePlugin, PluginConfig};
    use gpuplex_dra::proto::deviceplugin::device_plugin_server::DevicePlugin as _;
    if !can_run("with_cdi_an_allocation_is_a_cdi_device_whose_spec_goes_with_it") {
        return;
    }
    let service = NodeService::start(the_device_plugin(1));
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let plugin = DevicePlugin::new(PluginConfig {
        node: "testnode".into(),
        socket: service.socket.clone(),
        unit: GIB,
        delivery: gpuplex_wire::config::DeviceDelivery::Cdi,
        policy: gpuplex_scheduler::inventory::AssignmentPolicy::Spread,
        cdi_dir: cdi_dir.clone(),
        hook: PathBuf::from("/usr/local/bin/gpuplex-hook"),
        control_nodes: Vec::new(),
        poll: Duration::from_secs(1),
    });
    plugin.refresh().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let allocate = |units: Vec<String>| {
        let request = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest { devices_ids: units }],
        };
        let answer = runtime.block_on(plugin.allocate(tonic::Request::new(request)));
        answer.unwrap().into_inner().container_responses.remove(0)
    };
    let answer = allocate(ids(0, 0..2));
    assert_eq!(answer.cdi_devices[0].name, "gpuplex.io/vgpu=units-gpu-0-0");
    assert!(answer.devices.is_empty() && answer.mounts.is_empty() && answer.envs.is_empty());
    let handle = answer.annotations[ALLOCATION].clone();
    let spec_path = cdi_dir.join("gpuplex.io-vgpu-units-gpu-0-0.json");
    let raw = container_device_interface::spec::parse_spec(&spec_path).expect("parses");
    let spec = container_device_interface::spec::new_spec(&raw, &spec_path, 0).expect("valid");
    assert!(spec.devices.contains_key("units-gpu-0-0"));
    let text = std::fs::read_to_string(&spec_path).unwrap();
    let written: serde_json::Value = serde_json::from_str(&text).unwrap();
    let edits = &written["devices"][0]["containerEdits"];
    assert_eq!(edits["env"][0], "CUDA_VISIBLE_DEVICES=GPU-fake-0");
    let attach = &edits["hooks"].as_array().unwrap().last().unwrap()["args"];
    assert_eq!(
        attach.as_array().unwrap().last().unwrap(),
        &serde_json::json!(handle)
    );
    assert_eq!(std::fs::metadata(&spec_path).unwrap().mode() & 0o777, 0o600);

    // The kubelet gives unit 1 to another container: the first allocation ends, and its spec
    // goes at the next refresh; the new one's stays.
    allocate(ids(0, 1..3));
    plugin.refresh().unwrap();
    assert!(!spec_path.exists());
    assert!(cdi_dir.join("gpuplex.io-vgpu-units-gpu-0-1.json").exists());
}

/// The plugin in this process, with CDI, over `service`'s socket, its specs in `cdi_dir`; it
/// tries a lost node service again after at most `longest`.
fn plugin_here(
    service: &NodeService,
    cdi_dir: &Path,
    longest: Duration,
) -> gpuplex_dra::device_plugin::DevicePlugin {
    use gpuplex_dra::device_plugin::{DevicePlugin, PluginConfig};
    DevicePlugin::new(PluginConfig {
        node: "testnode".into(),
        socket: service.socket.clone(),
        unit: GIB,
        delivery: gpuplex_wire::config::DeviceDelivery::Cdi,
        policy: gpuplex_scheduler::inventory::AssignmentPolicy::Spread,
        cdi_dir: cdi_dir.to_path_buf(),
        hook: PathBuf::from("/usr/local/bin/gpuplex-hook"),
        control_nodes: Vec::new(),
        poll: longest,
    })
}

/// The node service's changes reach the kubelet as they happen: the plugin follows the node's
/// `watch` (and would try a lost node again only after an hour at most, so nothing below is a
/// poll's): an allocation the kubelet's units ended loses its CDI spec, a GPU whose node goes
/// turns unhealthy and healthy again, and while the node service is stopped every unit is
/// unhealthy, until it is back.
#[test]
fn the_nodes_changes_reach_list_and_watch_and_the_specs_as_they_happen() {
    use gpuplex_dra::proto::deviceplugin::device_plugin_server::DevicePlugin as _;
    if !can_run("the_nodes_changes_reach_list_and_watch_and_the_specs_as_they_happen") {
        return;
    }
    let mut service = NodeService::start(the_device_plugin(1));
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let plugin = plugin_here(&service, &cdi_dir, Duration::from_secs(3600));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.spawn(plugin.clone().keep_fresh());
    let watched = runtime.block_on(plugin.list_and_watch(tonic::Request::new(dp::Empty {})));
    let mut updates = watched.unwrap().into_inner();
    let mut update = || runtime.block_on(next(&mut updates));
    let mut listed = update();
    while listed.devices.is_empty() {
        listed = update();
    }
    assert_eq!(health_of(&listed, 0), ["Healthy"; 16]);

    // The kubelet gives unit 1 to another container: the first allocation ends, and its spec
    // goes without waiting for anything.
    let allocate = |units: Vec<String>| {
        let request = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest { devices_ids: units }],
        };
        let answer = runtime.block_on(plugin.allocate(tonic::Request::new(request)));
        answer.unwrap().into_inner().container_responses.remove(0)
    };
    allocate(ids(0, 0..2));
    let first = cdi_dir.join("gpuplex.io-vgpu-units-gpu-0-0.json");
    let second = cdi_dir.join("gpuplex.io-vgpu-units-gpu-0-1.json");
    assert!(first.exists());
    allocate(ids(0, 1..3));
    wait_for("the ended allocation's spec removed", || !first.exists());
    assert!(second.exists(), "the live allocation's spec stays");

    // GPU 0's node goes (seen at the service's next sweep) and comes back.
    let node = &service.devices[0];
    let rdev = std::fs::metadata(node).unwrap().rdev();
    std::fs::remove_file(node).unwrap();
    let mut update = || runtime.block_on(next(&mut updates));
    assert_eq!(health_of(&update(), 0), ["Unhealthy"; 16]);
    nix::sys::stat::mknod(
        node,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        rdev,
    )
    .unwrap();
    assert_eq!(health_of(&update(), 0), ["Healthy"; 16]);

    // The node service stops: nothing is healthy that the plugin cannot see. It starts again:
    // the plugin finds it and lists what it sees.
    assert!(service.terminate().success(), "{}", service.log_text());
    assert_eq!(health_of(&update(), 0), ["Unhealthy"; 16]);
    service.spawn();
    assert_eq!(health_of(&update(), 0), ["Healthy"; 16]);
    assert!(
        second.exists(),
        "the allocation outlives the restart, and so does its spec"
    );
}
