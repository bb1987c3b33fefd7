//! gpuplex on the Kubernetes path (root): containerd 1.6's CRI plugin with gpuplex's shipped
//! runtime handler, and the test acting as the kubelet through the CRI's gRPC API
//! (../shared/notes/container-stack.md §9). A pod with gpuplex annotations runs under the
//! `gpuplex` handler; its workload container gets the vGPU the annotations ask for, its sandbox
//! (pause) container gets none, both are served by one shim, and removing the pod releases
//! the vGPU.

use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::cri::*;
use gpuplex_integration::*;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

/// The binary containerd runs for the gpuplex runtime: the shims and the node service.
const SHIM: &str = "containerd-shim-gpuplex-v1";

/// The node service's entry for container `id`, if it lists it.
fn listed(status: &Value, id: &str) -> Option<Value> {
    status["containers"]
        .as_array()?
        .iter()
        .find(|c| c["id"] == id)
        .cloned()
}

/// The parent of process `pid`.
fn parent(pid: u64) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|p| p.trim().parse().ok())
}

#[test]
fn a_pod_run_through_the_cri_gets_its_vgpu_and_removing_the_pod_releases_it() {
    let test = "a_pod_run_through_the_cri_gets_its_vgpu_and_removing_the_pod_releases_it";
    if !can_run_containerd(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");

    // Dropped in reverse order: the pod (removed through the CRI), the client, containerd, the
    // node service (after the containers released their vGPUs), the directory.
    // The operator lets the pods of namespace `inference` ask for high priority, no other.
    let policy = "[policy]\nhigh_priority_namespaces = [\"inference\"]\n";
    let service = NodeService::start(&dir.path().join("node"), 2, 230, policy);
    let containerd = cri_containerd(dir.path(), &service.config);

    let cri = Cri::connect(&containerd.socket);
    let version = cri.version().expect("Version");
    eprintln!(
        "CRI: {} {} (API {})",
        version.runtime_name, version.runtime_version, version.runtime_api_version
    );
    let pod_config = host_network_pod(
        "trainer",
        "ml",
        &[("gpuplex.io/gpu-memory", "2Gi"), ("gpuplex.io/weight", "2")],
    );
    let mut pod = cri
        .run_pod_sandbox(&pod_config, "gpuplex")
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", service.log()));
    let container = pod
        .create_container(&host_network_container(
            "worker",
            BUSYBOX_IMAGE,
            &["sh", "-c", "sleep 1000"],
            &[],
        ))
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    cri.start_container(&container)
        .unwrap_or_else(|e| panic!("StartContainer: {e}"));

    // The sandbox ran under gpuplex's handler, and the container runs.
    let sandbox_info = cri.sandbox_info(&pod.id).expect("PodSandboxStatus");
    assert_eq!(
        sandbox_info["runtimeHandler"], "gpuplex",
        "{sandbox_info:#}"
    );
    assert_eq!(sandbox_info["runtimeType"], GPUPLEX, "{sandbox_info:#}");
    let container_info = cri.container_info(&container).expect("ContainerStatus");
    assert_eq!(
        container_info["state"], "CONTAINER_RUNNING",
        "{container_info:#}"
    );
    let spec = &container_info["runtimeSpec"];
    assert_eq!(
        spec["annotations"]["io.kubernetes.cri.sandbox-id"],
        json!(pod.id)
    );
    assert_eq!(
        spec["annotations"]["gpuplex.io/gpu-memory"], "2Gi",
        "{spec}"
    );
    let sandbox_spec = &sandbox_info["runtimeSpec"];
    assert_eq!(
        sandbox_spec["annotations"]["io.kubernetes.cri.container-type"], "sandbox",
        "{sandbox_spec}"
    );
    // What is wrong beyond the vGPU itself is gathered, so that one run shows all of it.
    let mut problems = Vec::new();

    // The workload container holds one vGPU: one GPU, 2 GiB on it, weight 2, in its pod.
    assert!(
        wait_until(Duration::from_secs(5), || listed(
            &service.status(),
            &container
        )
        .is_some()),
        "the workload container is not listed: {:#}",
        service.status()
    );
    let status = service.status();
    eprintln!("node status with the pod running: {status}");
    let entry = listed(&status, &container).expect("listed");
    assert_eq!(entry["memory"], json!([2 * GIB]), "{entry}");
    assert_eq!(entry["weight"], 2, "{entry}");
    // The node service names the pod from the annotations CRI adds to the spec.
    if entry["pod"] != "trainer" || entry["namespace"] != "ml" {
        problems.push(format!(
            "the workload container's entry names pod {} in namespace {}, but its spec says \
             io.kubernetes.cri.sandbox-name {} and io.kubernetes.cri.sandbox-namespace {}: {entry}",
            entry["pod"],
            entry["namespace"],
            spec["annotations"]["io.kubernetes.cri.sandbox-name"],
            spec["annotations"]["io.kubernetes.cri.sandbox-namespace"],
        ));
    }
    let gpus = entry["gpus"].as_array().expect("its GPUs");
    assert_eq!(gpus.len(), 1, "{entry}");
    let index = gpus[0].as_u64().expect("a GPU index") as usize;
    let uuid = status["gpus"][index]["uuid"]
        .as_str()
        .expect("a UUID")
        .to_owned();
    // The sandbox (pause) container carries the pod's annotations too, but only the workload
    // container asks for a vGPU: CRI marks the sandbox `io.kubernetes.cri.container-type:
    // sandbox`.
    let workload_only = status["containers"].as_array().map(Vec::len) == Some(1)
        && status["reservations"].as_array().is_some_and(Vec::is_empty);
    if !workload_only {
        problems.push(format!(
            "the node service must hold only the workload container {container}'s vGPU, not \
             the sandbox {}'s (listed: {}): {status:#}",
            pod.id,
            listed(&status, &pod.id).is_some()
        ));
    }

    // What the container sees agrees with the node service.
    let exec = |command: &[&str]| -> String {
        let out = cri
            .exec_sync(&container, command, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("ExecSync {command:?}: {e}"));
        assert_eq!(
            out.exit_code,
            0,
            "ExecSync {command:?}: stdout {:?}, stderr {:?}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let shown = exec(&["cat", "/run/gpuplex/vgpu.json"]);
    let identity: Value = serde_json::from_str(&shown)
        .unwrap_or_else(|e| panic!("/run/gpuplex/vgpu.json: {e}: {shown:?}"));
    eprintln!("/run/gpuplex/vgpu.json in the container: {identity}");
    assert_eq!(identity["vgpu"], entry["vgpu"], "{identity}");
    assert_eq!(identity["weight"], 2, "{identity}");
    assert_eq!(identity["priority"], entry["priority"], "{identity}");
    assert_eq!(identity["container"], json!(container), "{identity}");
    let gpu = &status["gpus"][index];
    assert_eq!(
        identity["gpus"],
        json!([{"uuid": uuid, "index": index, "model": gpu["model"], "memory": 2 * GIB}]),
        "{identity}"
    );
    let cuda = exec(&["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]);
    assert_eq!(cuda, format!("{uuid}\n"));

    // The kubelet's resize reaches runc through the shim's Update.
    cri.update_container_resources(
        &container,
        LinuxContainerResources {
            memory_limit_in_bytes: 96 << 20,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("UpdateContainerResources: {e}"));
    // cgroup v1's file, or on a pure cgroup v2 host (make test-hosts) v2's.
    let limit = exec(&[
        "sh",
        "-c",
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
    ]);
    assert_eq!(limit.trim(), (96u64 << 20).to_string());

    // One shim serves the pod: the daemon started for the sandbox, the parent of the sandbox's
    // process and of the container's.
    let daemons = shim_daemons(SHIM);
    eprintln!("gpuplex shim daemons: {daemons:?}");
    let for_pod: Vec<u32> = daemons
        .iter()
        .filter(|(_, id)| *id == pod.id)
        .map(|(pid, _)| *pid)
        .collect();
    assert_eq!(for_pod.len(), 1, "sandbox {}: {daemons:?}", pod.id);
    assert!(
        daemons.iter().all(|(_, id)| *id != container),
        "a shim of the container's own: {daemons:?}"
    );
    let sandbox_pid = sandbox_info["pid"].as_u64().expect("the sandbox's pid");
    let container_pid = container_info["pid"].as_u64().expect("the container's pid");
    assert_eq!(
        parent(sandbox_pid),
        Some(for_pod[0]),
        "the sandbox's parent"
    );
    assert_eq!(
        parent(container_pid),
        Some(for_pod[0]),
        "the container's parent"
    );

    // Removing the pod releases the vGPU, and the pod's shim goes.
    pod.remove()
        .unwrap_or_else(|e| panic!("StopPodSandbox, RemovePodSandbox: {e}"));
    let removed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "2 s after RemovePodSandbox: {:#}",
        service.status()
    );
    eprintln!(
        "released {:.0} ms after RemovePodSandbox returned",
        removed.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        wait_until(Duration::from_secs(5), || shim_daemons(SHIM)
            .iter()
            .all(|(_, id)| *id != pod.id)),
        "the pod's shim still runs 5 s after RemovePodSandbox: {:?}",
        shim_daemons(SHIM)
    );

    // The policy goes by the namespace CRI gives the shim: `inference` may ask for high
    // priority, `ml` may not, and a pod cannot claim another namespace by annotation (only
    // `gpuplex.io/` pod annotations reach the container).
    let claims = [
        ("io.kubernetes.cri.sandbox-namespace", "inference"),
        ("io.kubernetes.pod.namespace", "inference"),
    ];
    for (name, namespace, claim, allowed) in [
        ("server", "inference", &[][..], true),
        ("squatter", "ml", &[][..], false),
        ("spoofer", "ml", &claims[..], false),
    ] {
        let mut annotations = vec![
            ("gpuplex.io/priority", "high"),
            ("gpuplex.io/gpu-memory", "1Gi"),
        ];
        annotations.extend_from_slice(claim);
        let mut pod = cri
            .run_pod_sandbox(&host_network_pod(name, namespace, &annotations), "gpuplex")
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}"));
        let id = pod
            .create_container(&host_network_container(
                "worker",
                BUSYBOX_IMAGE,
                &["sleep", "1000"],
                &[],
            ))
            .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}"));
        // The task, and with it the vGPU, is made at StartContainer.
        match (allowed, cri.start_container(&id)) {
            (true, Ok(())) => {
                let status = service.status();
                let entry = listed(&status, &id)
                    .unwrap_or_else(|| panic!("{id} is not listed: {status:#}"));
                assert_eq!(entry["priority"], "high", "{entry}");
                assert_eq!(entry["namespace"], namespace, "{entry}");
            }
            (false, Err(e)) => assert!(
                e.message().contains(
                    "annotation gpuplex.io/priority=`high` is not allowed for namespace `ml`"
                ),
                "{name}: {e}"
            ),
            (allowed, started) => panic!("{name}: allowed {allowed}, but {started:?}"),
        }
        pod.remove()
            .unwrap_or_else(|e| panic!("RemovePodSandbox {name}: {e}"));
    }
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{:#}",
        service.status()
    );

    eprintln!("CRI calls:");
    for (call, took) in cri.timings() {
        eprintln!("  {call:<18} {:>8.1} ms", took.as_secs_f64() * 1e3);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The kubelet's systemd cgroup driver (kubeadm's default): the pod's cgroup parent is a slice,
/// containerd's CRI writes the containers' cgroups paths in runc's systemd form
/// (`kubepods-besteffort-pod<uid>.slice:cri-containerd:<id>`) and, for a runtime that is not
/// runc's, passes no `SystemdCgroup`. The shim runs runc with its systemd driver then: each
/// container is a scope in the pod's slice under `kubepods.slice`, and two of them on one GPU
/// take turns there. Needs systemd as PID 1 on pure cgroup v2 (make test-hosts).
#[test]
fn a_pod_in_a_kubepods_slice_runs_in_systemd_scopes_there_and_takes_windows() {
    let test = "a_pod_in_a_kubepods_slice_runs_in_systemd_scopes_there_and_takes_windows";
    if !can_run_containerd(test) {
        return;
    }
    let systemd_v2 = std::path::Path::new("/run/systemd/system").is_dir()
        && std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    if !systemd_v2 {
        eprintln!("SKIPPED: {test} needs systemd as PID 1 on pure cgroup v2; make test-hosts runs it on Debian 13");
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let service = NodeService::start(&dir.path().join("node"), 1, 232, "");
    let containerd = cri_containerd(dir.path(), &service.config);
    let cri = Cri::connect(&containerd.socket);
    let mut pod_config = host_network_pod("slice", "ml", &[]);
    let slice = format!("kubepods-besteffort-pod{}.slice", std::process::id());
    pod_config.linux.as_mut().expect("linux").cgroup_parent = slice.clone();
    let mut pod = cri
        .run_pod_sandbox(&pod_config, "gpuplex")
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", containerd.log_tail()));
    let mut pids = Vec::new();
    for name in ["one", "two"] {
        let id = pod
            .create_container(&host_network_container(
                name,
                BUSYBOX_IMAGE,
                &["sh", "-c", "while :; do :; done"],
                &[("gpuplex.io/gpu-memory", "1Gi")],
            ))
            .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", containerd.log_tail()));
        cri.start_container(&id)
            .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", containerd.log_tail()));
        let info = cri.container_info(&id).expect("ContainerStatus");
        let spec_path = info["runtimeSpec"]["linux"]["cgroupsPath"].clone();
        assert_eq!(
            spec_path,
            json!(format!("{slice}:cri-containerd:{id}")),
            "containerd's CRI did not write the systemd form"
        );
        let pid = info["pid"].as_u64().expect("its pid") as u32;
        let cgroup = gpuplex_cgroup::ProcCgroup::of_pid(pid).expect("its cgroups");
        let want =
            format!("/kubepods.slice/kubepods-besteffort.slice/{slice}/cri-containerd-{id}.scope");
        assert_eq!(
            cgroup.unified.as_deref(),
            Some(want.as_str()),
            "{name} is not in its systemd scope"
        );
        pids.push(pid);
    }
    // Both are windowed: each is seen frozen while the other runs.
    let mut seen_frozen = [false, false];
    let took_turns = wait_until(Duration::from_secs(20), || {
        for (seen, pid) in seen_frozen.iter_mut().zip(&pids) {
            *seen |= freezer_state(*pid).as_deref() == Some("FROZEN");
        }
        seen_frozen == [true, true]
    });
    assert!(
        took_turns,
        "frozen seen {seen_frozen:?}: {}",
        service.status()
    );
    pod.remove().expect("the pod removed");
    assert!(
        wait_until(Duration::from_secs(10), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}
