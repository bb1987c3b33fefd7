//! A prepared claim's CDI device used by real runtimes (root): podman applies the claim's spec
//! (`--device gpuplex.io/vgpu=<uid>`) and runs its attach step; containerd runs a container
//! whose spec has the claim's device applied, under the gpuplex shim, which attaches it
//! instead of reserving. The driver runs in the test with the real node service; the claims
//! come from a store in the test (no kube-apiserver can run here).
//!
//! podman 4.3 reads CDI specs only from `/etc/cdi` and `/var/run/cdi`, so the podman test
//! writes its claims' specs into `/var/run/cdi`, under uids of its own, and removes them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuplex_dra::claim::ClaimRef;
use gpuplex_dra::driver::{Claims, Driver, DriverConfig};
use gpuplex_integration::containerd::{can_run_containerd, containerd_has_cdi, Containerd, Setup};
use gpuplex_integration::cri::k8s_cri::v1::CdiDevice;
use gpuplex_integration::cri::{
    cri_containerd_with, host_network_container, host_network_pod, Cri, BUSYBOX_IMAGE,
};
use gpuplex_integration::{bin, can_run, text, wait_until, FreezerProbe, NodeService, Podman};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

/// The API server's claims, as the test serves them.
#[derive(Default)]
struct Store(Mutex<HashMap<String, ResourceClaim>>);

impl Claims for &'static Store {
    async fn get(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        let claims = self.0.lock().unwrap();
        claims
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| format!("resourceclaims \"{}\" not found", claim.name))
    }
}

/// The driver of a node, with its claims.
struct Node {
    service: NodeService,
    driver: Driver<&'static Store>,
    store: &'static Store,
    runtime: tokio::runtime::Runtime,
    prepared: Vec<ClaimRef>,
}

impl Node {
    /// The node service on two fake GPUs, and a driver writing specs into `cdi_dir`.
    fn start(dir: &Path, minor: u32, cdi_dir: &Path) -> Node {
        let service = NodeService::start(&dir.join("node"), 2, minor, "");
        let store: &'static Store = Box::leak(Box::default());
        let driver = Driver::new(
            store,
            DriverConfig {
                node: "testnode".into(),
                socket: service.socket.clone(),
                cdi_dir: cdi_dir.to_path_buf(),
                control_nodes: Vec::new(),
                hook: bin("gpuplex-hook"),
            },
        );
        Node {
            service,
            driver,
            store,
            runtime: tokio::runtime::Runtime::new().unwrap(),
            prepared: Vec::new(),
        }
    }

    /// A claim of `gib` on GPU `gpu`, allocated by the scheduler and prepared by the driver,
    /// as the kubelet asks: its CDI device id.
    fn prepare(&mut self, name: &str, gpu: u32, gib: u32) -> String {
        // Distinct per run: the specs of the podman test share /var/run/cdi.
        let uid = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            std::process::id(),
            self.prepared.len() + 1000 * usize::try_from(gpu).unwrap()
        );
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ml", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpuplex.io"}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": "gpuplex.io", "pool": "testnode",
                "device": format!("gpu-{gpu}"), "shareID": format!("share-{uid}"),
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
        let devices = self
            .runtime
            .block_on(self.driver.prepare(&claim))
            .unwrap_or_else(|e| panic!("{claim}: {e}"));
        self.prepared.push(claim);
        devices[0].cdi_device_ids[0].clone()
    }

    /// Unprepares every claim, as the kubelet does when its pods are gone.
    fn unprepare_all(&mut self) {
        for claim in std::mem::take(&mut self.prepared) {
            self.runtime
                .block_on(self.driver.unprepare(&claim))
                .unwrap_or_else(|e| panic!("{claim}: {e}"));
        }
    }

    /// What the node service says of a container, if it has it.
    fn container(&self, id: &str) -> Option<Value> {
        let status = self.service.status();
        (status["containers"].as_array()?.iter())
            .find(|c| c["id"] == id)
            .cloned()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Never leave a spec in /var/run/cdi.
        for claim in std::mem::take(&mut self.prepared) {
            let _ = self.runtime.block_on(self.driver.unprepare(&claim));
        }
    }
}

/// What a container prints of its GPUs: its device nodes, `CUDA_VISIBLE_DEVICES` and identity.
const SHOW: &str = "ls /dev; echo CUDA=$CUDA_VISIBLE_DEVICES; cat /run/gpuplex/vgpu.json";

/// A busy loop, so that the cpu activity source sees work.
const BUSY: &str = "while :; do :; done";

fn name_of(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// The largest share of samples in which two containers of one vGPU may differ: they do only
/// while a switch freezes or thaws one after the other (tens of milliseconds in an emulated VM),
/// where two vGPUs taking turns against a third differ about two thirds of the time.
const APART_AT_MOST: f64 = 0.2;

/// Samples the freezers of the containers whose init pids are `pids` together for `span`:
/// how many samples, and in how many each was frozen, and in how many the first two differed.
fn freezes(pids: &[u32], span: Duration) -> (u32, Vec<u32>, u32) {
    let (mut samples, mut frozen, mut apart) = (0, vec![0; pids.len()], 0);
    // Found once: a sample then reads only the cgroups' files, so that what it compares is the
    // service's freezes, not the time the sampler took between them. A cgroup asked to freeze
    // counts as frozen (`FREEZING` too): the service's order, not how long the kernel takes to
    // stop each cgroup's tasks (longer on a slow or emulated machine).
    let probes: Vec<FreezerProbe> = pids
        .iter()
        .map(|&p| FreezerProbe::of_pid(p).expect("a container's freezer"))
        .collect();
    let end = Instant::now() + span;
    while Instant::now() < end {
        let states: Vec<bool> = probes
            .iter()
            .map(|p| p.state().is_some_and(|s| s != "THAWED"))
            .collect();
        samples += 1;
        for (count, &s) in frozen.iter_mut().zip(&states) {
            *count += u32::from(s);
        }
        apart += u32::from(states[0] != states[1]);
        std::thread::sleep(Duration::from_millis(2));
    }
    (samples, frozen, apart)
}

#[test]
fn podman_runs_a_pods_containers_with_the_claims_cdi_device_sharing_its_vgpu_beside_a_neighbour() {
    let test = "podman_runs_a_pods_containers_with_the_claims_cdi_device_sharing_its_vgpu_beside_a_neighbour";
    if !can_run(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = PathBuf::from("/var/run/cdi");
    let mut node = Node::start(dir.path(), 122, &cdi_dir);
    let pod = node.prepare("pod-a", 1, 4);
    let neighbour = node.prepare("pod-b", 1, 2);
    let uid = pod.rsplit('=').next().unwrap().to_owned();
    let spec = cdi_dir.join(format!("gpuplex.io-vgpu-{uid}.json"));
    assert!(spec.exists(), "{}", spec.display());
    // No gpuplex hooks: the claim's CDI spec is all podman needs.
    let podman = Podman::new(&dir.path().join("podman"), None);

    // The container sees its GPU, and only it.
    let out = podman.run(&["--device", &pod], SHOW);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    let gpus = &node.service.devices;
    assert!(shown.contains(&name_of(&gpus[1])), "{shown}");
    assert!(!shown.contains(&name_of(&gpus[0])), "{shown}");
    assert!(shown.contains("CUDA=GPU-fake-1"), "{shown}");
    assert!(shown.contains("\"vgpu\""), "the identity: {shown}");

    // Two containers of the pod and one of another pod on the same GPU.
    let app = podman.run_detached(&["--device", &pod], BUSY);
    let sidecar = podman.run_detached(&["--device", &pod], BUSY);
    let other = podman.run_detached(&["--device", &neighbour], BUSY);
    let ours = node
        .container(&app)
        .unwrap_or_else(|| panic!("app is not attached: {}", node.service.status()));
    assert_eq!(node.container(&sidecar).unwrap()["vgpu"], ours["vgpu"]);
    assert_ne!(node.container(&other).unwrap()["vgpu"], ours["vgpu"]);
    let pids: Vec<u32> = [&app, &sidecar, &other]
        .iter()
        .map(|id| podman.init_pid(id))
        .collect();
    let (samples, frozen, apart) = freezes(&pids, Duration::from_secs(3));
    eprintln!("{samples} samples: frozen {frozen:?}, the pod's two apart in {apart}");
    assert!(
        frozen[0] * 5 > samples && frozen[2] * 5 > samples,
        "no windows taken: {frozen:?} of {samples}"
    );
    assert!(
        f64::from(apart) < APART_AT_MOST * f64::from(samples),
        "the pod's containers froze apart in {apart} of {samples}"
    );

    // The pod's containers go: the claim keeps its vGPU until it is unprepared.
    let removed = podman
        .command()
        .args(["rm", "-f", "-t", "0", &app, &sidecar])
        .output()
        .unwrap();
    assert!(removed.status.success(), "{}", text(&removed));
    assert!(wait_until(Duration::from_secs(5), || node
        .container(&sidecar)
        .is_none()
        && node.container(&app).is_none()));
    let status = node.service.status();
    assert!(
        status["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["claim"] == uid.as_str()),
        "{status}"
    );
    let _ = podman
        .command()
        .args(["rm", "-f", "-t", "0", &other])
        .output();
    node.unprepare_all();
    assert!(!spec.exists());
    assert!(
        wait_until(Duration::from_secs(5), || node.service.held() == (0, 0)),
        "{}",
        node.service.status()
    );
}

/// `ctr oci spec` for container `id` of the busybox `rootfs` running `script`, with the claim's
/// CDI `device` applied from `cdi_dir` by the CDI reference crate, as containerd's CRI applies
/// a pod's CDI devices (containerd 1.7 and later; 1.6, installed here, has no CDI).
fn spec_with_device(
    containerd: &Containerd,
    cdi_dir: &Path,
    device: &str,
    id: &str,
    script: &str,
) -> PathBuf {
    let out = containerd.ctr(&["oci", "spec"]);
    assert!(out.status.success(), "{}", text(&out));
    let mut spec: Value = serde_json::from_slice(&out.stdout).unwrap();
    spec["process"]["args"] = json!(["sh", "-c", script]);
    spec["process"]["env"] = json!(["PATH=/bin"]);
    spec["root"] = json!({"path": containerd.rootfs, "readonly": false});
    // Where `ctr run` puts a container of its own spec: a cgroup of its namespace's.
    spec["linux"]["cgroupsPath"] = json!(format!("/{}/{id}", containerd.namespace));
    let mut oci: oci_spec::runtime::Spec = serde_json::from_value(spec).unwrap();
    let cache = container_device_interface::cache::new_cache(vec![
        container_device_interface::spec_dirs::with_spec_dirs(&[cdi_dir.to_str().unwrap()]),
        container_device_interface::cache::with_auto_refresh(false),
    ]);
    let unresolved = cache
        .lock()
        .unwrap()
        .inject_devices(Some(&mut oci), vec![device.to_owned()])
        .unwrap_or_else(|e| panic!("{device}: {e}"));
    assert!(unresolved.is_empty(), "{unresolved:?}");
    let path = containerd.dir.join(format!("spec-{id}.json"));
    std::fs::write(&path, serde_json::to_vec(&oci).unwrap()).unwrap();
    path
}

fn ctr_run(containerd: &Containerd, flags: &[&str], spec: &Path, id: &str) -> Output {
    containerd
        .ctr_command()
        .arg("run")
        .args(flags)
        .args(["--runtime", "io.containerd.gpuplex.v1", "--config"])
        .arg(spec)
        .arg(id)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn the_gpuplex_shim_attaches_a_claims_containers_instead_of_reserving() {
    let test = "the_gpuplex_shim_attaches_a_claims_containers_instead_of_reserving";
    if !can_run_containerd(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let mut node = Node::start(dir.path(), 126, &cdi_dir);
    let pod = node.prepare("pod-c", 1, 4);
    let containerd = Containerd::start(Setup {
        gpuplex_config: Some(node.service.config.clone()),
        cri: false,
    });
    let shown = spec_with_device(&containerd, &cdi_dir, &pod, "claim-show", SHOW);
    let out = ctr_run(&containerd, &["--rm"], &shown, "claim-show");
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out),
        containerd.log_tail()
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains(&name_of(&node.service.devices[1])),
        "{printed}"
    );
    assert!(
        !printed.contains(&name_of(&node.service.devices[0])),
        "{printed}"
    );
    assert!(printed.contains("CUDA=GPU-fake-1"), "{printed}");

    // A container that asks for a vGPU by annotation too is refused in one line.
    let twice = spec_with_device(&containerd, &cdi_dir, &pod, "claim-twice", SHOW);
    let mut edited: Value = serde_json::from_slice(&std::fs::read(&twice).unwrap()).unwrap();
    edited["annotations"] = json!({"gpuplex.io/gpu-memory": "1Gi"});
    std::fs::write(&twice, edited.to_string()).unwrap();
    let out = ctr_run(&containerd, &["--rm"], &twice, "claim-twice");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("asks for two vGPUs"),
        "{}",
        text(&out)
    );

    // Two containers of the pod under the shim share the claim's vGPU; nothing is reserved.
    for id in ["claim-app", "claim-sidecar"] {
        let busy = spec_with_device(&containerd, &cdi_dir, &pod, id, BUSY);
        let out = ctr_run(&containerd, &["-d"], &busy, id);
        assert!(
            out.status.success(),
            "{id}: {}\n{}",
            text(&out),
            containerd.log_tail()
        );
    }
    let app = node
        .container("claim-app")
        .unwrap_or_else(|| panic!("not attached: {}", node.service.status()));
    assert_eq!(
        node.container("claim-sidecar").unwrap()["vgpu"],
        app["vgpu"]
    );
    let status = node.service.status();
    assert_eq!(
        status["reservations"],
        json!([]),
        "the shim reserved: {status}"
    );
    assert_eq!(
        status["gpus"][1]["unreserved"],
        json!(12u64 << 30),
        "{status}"
    );
    // The shim took the attach step out of the spec runc got.
    let bundle = containerd
        .dir
        .join("state/io.containerd.runtime.v2.task")
        .join(&containerd.namespace)
        .join("claim-app/config.json");
    let given: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    let hooks = given["hooks"]["createRuntime"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        hooks.iter().all(|h| !h.to_string().contains("attach")),
        "{given}"
    );
    // Their deletes release nothing: the claim keeps its vGPU until it is unprepared.
    for id in ["claim-app", "claim-sidecar"] {
        let _ = containerd.kill(id, "SIGKILL");
        assert!(containerd.wait_for_status(id, "STOPPED", Duration::from_secs(10)));
        let out = containerd.remove(id);
        assert!(out.status.success(), "{}", text(&out));
    }
    assert!(wait_until(Duration::from_secs(5), || node
        .container("claim-app")
        .is_none()));
    let status = node.service.status();
    assert_eq!(status["reservations"][0]["vgpu"], app["vgpu"], "{status}");
    node.unprepare_all();
    assert!(wait_until(Duration::from_secs(5), || node.service.held() == (0, 0)));
}

/// containerd 1.7 and later apply a pod's CDI devices themselves (`enable_cdi`): the claim's
/// device named in the container's CRI config (`CDI_devices`, as the kubelet names a prepared
/// claim's devices) gives the container its vGPU through containerd's own injection, with no
/// spec edit of the test's; the shim attaches it to the claim's vGPU instead of reserving.
#[test]
fn containerd_applies_a_claims_cdi_device_named_through_the_cri_and_the_shim_attaches_it() {
    let test =
        "containerd_applies_a_claims_cdi_device_named_through_the_cri_and_the_shim_attaches_it";
    if !can_run_containerd(test) || !containerd_has_cdi(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi_dir = dir.path().join("cdi");
    let mut node = Node::start(dir.path(), 127, &cdi_dir);
    let device = node.prepare("pod-cri", 1, 4);
    let containerd = cri_containerd_with(dir.path(), &node.service.config, |cri| {
        cri.insert("enable_cdi".into(), true.into());
        cri.insert(
            "cdi_spec_dirs".into(),
            vec![cdi_dir.display().to_string()].into(),
        );
    });
    let cri = Cri::connect(&containerd.socket);
    let mut pod = cri
        .run_pod_sandbox(&host_network_pod("pod-cri", "ml", &[]), "gpuplex")
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", containerd.log_tail()));
    let mut config = host_network_container("app", BUSYBOX_IMAGE, &["sh", "-c", BUSY], &[]);
    config.cdi_devices = vec![CdiDevice {
        name: device.clone(),
    }];
    let id = pod
        .create_container(&config)
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", containerd.log_tail()));
    cri.start_container(&id)
        .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", containerd.log_tail()));

    // Attached to the claim's vGPU, on the claim's GPU; nothing reserved besides the claim.
    let attached = wait_until(Duration::from_secs(5), || node.container(&id).is_some());
    assert!(attached, "not attached: {}", node.service.status());
    assert_eq!(node.container(&id).unwrap()["gpus"], json!([1]));
    let status = node.service.status();
    assert_eq!(status["reservations"], json!([]), "{status}");
    assert_eq!(
        status["gpus"][1]["unreserved"],
        json!(12u64 << 30),
        "{status}"
    );
    let seen = cri
        .exec_sync(&id, &["sh", "-c", SHOW], Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("ExecSync: {e}"));
    let printed = String::from_utf8_lossy(&seen.stdout);
    assert!(
        printed.contains(&name_of(&node.service.devices[1])),
        "{printed}"
    );
    assert!(
        !printed.contains(&name_of(&node.service.devices[0])),
        "{printed}"
    );
    assert!(printed.contains("CUDA=GPU-fake-1"), "{printed}");
    // containerd applied the device (its node is in runc's spec), and the shim took the
    // attach step out.
    let info = cri.container_info(&id).expect("ContainerStatus");
    let spec = &info["runtimeSpec"];
    let devices = spec["linux"]["devices"].to_string();
    assert!(
        devices.contains(&name_of(&node.service.devices[1])),
        "{spec}"
    );
    assert!(
        !spec["hooks"].to_string().contains(" attach "),
        "{}",
        spec["hooks"]
    );
    pod.remove().expect("the pod removed");
    node.unprepare_all();
    assert!(wait_until(Duration::from_secs(5), || node.service.held() == (0, 0)));
}
