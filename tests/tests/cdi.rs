//! The GPUs' CDI spec applied to containers with a vGPU, for their assigned GPUs only (root,
//! real podman and the node service on two fake GPUs). The spec is written here in the style
//! of `nvidia-ctk cdi generate`: spec-wide edits (a control node, a bind-mounted `libcuda.so.1`,
//! an environment variable) and one entry per GPU by UUID (its node, a variable of its own).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_integration::*;

/// A node service whose configuration points at a CDI spec directory `cdi` (written by
/// `write_spec`, or left empty), with two fake GPUs.
fn service_with_cdi(dir: &Path, cdi: &Path, minor: u32) -> NodeService {
    std::fs::create_dir_all(cdi).expect("the CDI directory");
    let extra = format!("cdi_spec_dirs = [\"{}\"]", cdi.display());
    NodeService::start(&dir.join("node"), 2, minor, &extra)
}

/// A spec of kind nvidia.com/gpu for the service's fake GPUs (their nodes and UUIDs), with a
/// control node (`ctl`, a fake node of its own) and a fake `libcuda.so.1` from `dir`.
fn write_spec(cdi: &Path, dir: &Path, service: &NodeService, ctl_minor: u32) -> PathBuf {
    let lib = dir.join("libcuda.so.1");
    std::fs::write(&lib, "fake libcuda\n").expect("the fake library");
    let ctl = dir.join("ctl");
    let _ = std::fs::remove_file(&ctl);
    nix::sys::stat::mknod(
        &ctl,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(195, ctl_minor as u64),
    )
    .expect("mknod");
    let mut devices = String::new();
    for (i, node) in service.devices.iter().enumerate() {
        let name = node.file_name().expect("a name").to_string_lossy();
        let minor = std::fs::metadata(node).map(|m| {
            use std::os::unix::fs::MetadataExt;
            nix::sys::stat::minor(m.rdev())
        });
        devices.push_str(&format!(
            "- name: GPU-fake-{i}\n  containerEdits:\n    deviceNodes:\n    - path: /dev/{name}\n      hostPath: {host}\n      type: c\n      major: 195\n      minor: {minor}\n    env:\n    - GPUPLEX_CDI_GPU=gpu{i}\n",
            host = node.display(),
            minor = minor.expect("the node's minor"),
        ));
    }
    let spec = format!(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/gpuplex-ctl\n    hostPath: {ctl}\n    type: c\n    major: 195\n    minor: {ctl_minor}\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\n  - GPUPLEX_CDI_SPEC=applied\n  mounts:\n  - containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.1\n    hostPath: {lib}\n    options: [ro, nosuid, nodev, bind]\ndevices:\n{devices}",
        ctl = ctl.display(),
        lib = lib.display(),
    );
    let path = cdi.join("nvidia.yaml");
    std::fs::write(&path, spec).expect("the spec");
    path
}

/// What `SCRIPT` printed in a container assigned GPU 1: the spec-wide edits (the library, the
/// control node, the variables) and GPU 1's entry, nothing of GPU 0's.
fn assert_sees_gpu1_only(shown: &str, service: &NodeService) {
    let node = |i: usize| {
        service.devices[i]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string()
    };
    assert!(shown.contains("fake libcuda"), "{shown}");
    assert!(shown.contains("gpuplex-ctl"), "{shown}");
    assert!(shown.contains(&node(1)), "{shown}");
    assert!(!shown.contains(&node(0)), "{shown}");
    assert!(
        shown.contains("SPEC=applied GPU=gpu1 NVIDIA=void CUDA=GPU-fake-1"),
        "{shown}"
    );
}

/// What a container prints of its GPUs, driver library and environment.
const SCRIPT: &str = "cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>&1; ls /dev; \
    echo SPEC=$GPUPLEX_CDI_SPEC GPU=$GPUPLEX_CDI_GPU NVIDIA=$NVIDIA_VISIBLE_DEVICES CUDA=$CUDA_VISIBLE_DEVICES";

#[test]
fn a_podman_container_gets_the_cdi_edits_of_its_gpu_only() {
    if !can_run("a_podman_container_gets_the_cdi_edits_of_its_gpu_only") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cdi = dir.path().join("cdi");
    let service = service_with_cdi(dir.path(), &cdi, 200);
    write_spec(&cdi, dir.path(), &service, 202);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    // GPU 0 taken whole, so that the container under test gets GPU 1.
    podman.run_detached(
        &["--annotation", "gpuplex.io/gpu-memory=16Gi"],
        "sleep 1000",
    );
    assert!(
        wait_until(Duration::from_secs(5), || service.held().0 == 1),
        "{}",
        service.status()
    );
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=1Gi"], SCRIPT);
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    podman.remove_all();
    assert!(out.status.success(), "{}", text(&out));
    assert_sees_gpu1_only(&shown, &service);
}

#[test]
fn without_a_cdi_spec_a_podman_container_gets_device_nodes_only() {
    if !can_run("without_a_cdi_spec_a_podman_container_gets_device_nodes_only") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cdi = dir.path().join("cdi");
    let service = service_with_cdi(dir.path(), &cdi, 203);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=1Gi"], SCRIPT);
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", text(&out));
    let gpu0 = service.devices[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(shown.contains(&gpu0), "{shown}");
    assert!(shown.contains("No such file or directory"), "{shown}");
    assert!(
        shown.contains("SPEC= GPU= NVIDIA= CUDA=GPU-fake-0"),
        "{shown}"
    );
    // The service says so, with the command that writes a spec.
    let cdi_state = service.status()["cdi"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(cdi_state.starts_with("none: "), "{cdi_state}");
    assert!(cdi_state.contains("nvidia-ctk cdi generate"), "{cdi_state}");
}

#[test]
fn a_cdi_spec_whose_gpus_disagree_with_the_nodes_is_named_at_start_and_at_creation() {
    if !can_run("a_cdi_spec_whose_gpus_disagree_with_the_nodes_is_named_at_start_and_at_creation") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    // As after a driver upgrade without regenerating the spec: other UUIDs.
    std::fs::write(
        cdi.join("nvidia.yaml"),
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-0bad0000-0000\n  containerEdits:\n    deviceNodes:\n    - path: /dev/gpuplex-other\n      type: c\n      major: 195\n      minor: 214\n",
    )
    .unwrap();
    let service = service_with_cdi(dir.path(), &cdi, 234);
    let cdi_state = service.status()["cdi"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(cdi_state.starts_with("error: "), "{cdi_state}");
    assert!(cdi_state.contains("GPU-0bad0000-0000"), "{cdi_state}");
    assert!(cdi_state.contains("GPU-fake-0"), "{cdi_state}");
    assert!(service.log().contains("CDI: "), "{}", service.log());

    // A container asking for a vGPU meanwhile is refused, naming both sides, holding nothing.
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=1Gi"], "true");
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("GPU-0bad0000-0000"), "{err}");
    assert!(
        err.contains("GPU-fake-0") && err.contains("regenerate"),
        "{err}"
    );
    assert_eq!(service.held(), (0, 0), "{}", service.status());
}

#[test]
fn a_malformed_cdi_spec_or_a_second_gpu_runtime_is_refused_leaving_nothing() {
    if !can_run("a_malformed_cdi_spec_or_a_second_gpu_runtime_is_refused_leaving_nothing") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cdi = dir.path().join("cdi");
    let service = service_with_cdi(dir.path(), &cdi, 205);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));

    // A container that asks NVIDIA's CDI injection for a GPU as well.
    write_spec(&cdi, dir.path(), &service, 207);
    let out = podman.run(
        &[
            "--annotation",
            "gpuplex.io/gpu-memory=1Gi",
            "--annotation",
            "cdi.k8s.io/other=nvidia.com/gpu=0",
        ],
        "true",
    );
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("choose one"), "{err}");
    assert_eq!(service.held(), (0, 0), "{}", service.status());

    // A spec that does not parse: its file is named.
    let spec = cdi.join("nvidia.yaml");
    std::fs::write(
        &spec,
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: [\n",
    )
    .unwrap();
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=1Gi"], "true");
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&spec.display().to_string()), "{err}");
    assert_eq!(service.held(), (0, 0), "{}", service.status());
}

#[test]
fn a_containerd_container_gets_the_cdi_edits_of_its_gpu_only() {
    use gpuplex_integration::containerd::*;
    if !can_run_containerd("a_containerd_container_gets_the_cdi_edits_of_its_gpu_only") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cdi = dir.path().join("cdi");
    let service = service_with_cdi(dir.path(), &cdi, 208);
    write_spec(&cdi, dir.path(), &service, 213);
    let c = Containerd::start(Setup {
        gpuplex_config: Some(service.config.clone()),
        cri: false,
    });
    // GPU 0 taken whole, so that the container under test gets GPU 1.
    c.run_detached(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=16Gi"],
        "cdi-whole",
        &["sleep", "1000"],
    );
    let out = c.run(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=1Gi"],
        "cdi-one",
        &["sh", "-c", SCRIPT],
    );
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    c.remove_all();
    assert!(out.status.success(), "{}", text(&out));
    assert_sees_gpu1_only(&shown, &service);
}
