//! Tenants attacking each other through podman (issue #12, items 1 to 3), with real podman,
//! runc and the node service on fake GPUs (root): a container owner's annotations never name,
//! attach to, release or read another container's vGPU, and are never used as a path. The runc
//! and containerd forms of the same attacks are in `runc.rs` and `containerd_vgpu.rs`.

use std::path::Path;
use std::time::Duration;

use gpuplex_integration::*;
use serde_json::{json, Value};

/// The node service's entry for container `id`.
fn entry(service: &NodeService, id: &str) -> Value {
    service.status()["containers"]
        .as_array()
        .and_then(|list| list.iter().find(|c| c["id"] == id).cloned())
        .unwrap_or(Value::Null)
}

/// A podman container that asks for a vGPU and sleeps: its id and its vGPU's id.
fn victim(podman: &Podman, service: &NodeService) -> (String, String) {
    let id = podman.run_detached(&["--annotation", "gpuplex.io/gpu-memory=4Gi"], "sleep 1000");
    let vgpu = entry(service, &id)["vgpu"]
        .as_str()
        .unwrap_or_else(|| panic!("the victim is not attached: {}", service.status()))
        .to_owned();
    (id, vgpu)
}

/// Runs a podman container with these annotations; asserts it was refused with a line that
/// says `because`.
fn refused(podman: &Podman, annotations: &[String], because: &str) {
    let mut args = Vec::new();
    for a in annotations {
        args.push("--annotation");
        args.push(a.as_str());
    }
    let out = podman.run(&args, "cat /run/gpuplex/vgpu.json");
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(because), "{stderr}");
}

#[test]
fn a_podman_container_naming_another_vgpu_gets_nothing_of_it() {
    if !can_run("a_podman_container_naming_another_vgpu_gets_nothing_of_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 100, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let (victim, vgpu) = victim(&podman, &service);
    let before = entry(&service, &victim);
    let identity = service.dir.join(format!("identity/{vgpu}.json"));
    assert!(identity.exists());
    // A reservation still waiting for its container (a precreate in flight).
    let mut client = std::os::unix::net::UnixStream::connect(&service.socket).unwrap();
    use std::io::{BufRead, Write};
    client
        .write_all(b"{\"op\":\"reserve\",\"annotations\":{\"gpuplex.io/gpu-memory\":\"1Gi\"}}\n")
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(&client)
        .read_line(&mut line)
        .unwrap();
    let pending: Value = serde_json::from_str(&line).unwrap();
    let pending = pending["vgpu"]["id"].as_str().unwrap().to_owned();
    let because = "is gpuplex's to write, not a container's";
    for target in [&vgpu, &pending] {
        refused(&podman, &[format!("gpuplex.io/vgpu-id={target}")], because);
        refused(
            &podman,
            &[
                "gpuplex.io/gpu-memory=1Gi".into(),
                format!("gpuplex.io/vgpu-id={target}"),
            ],
            because,
        );
    }
    // A guessed handle is refused the same way, before anything is reserved.
    refused(
        &podman,
        &[format!("gpuplex.io/vgpu-handle={}", "0".repeat(32))],
        because,
    );
    // The victim keeps its vGPU, its memory and its identity; the reservation still waits.
    let after = entry(&service, &victim);
    assert_eq!(after["vgpu"], before["vgpu"], "{after}");
    assert_eq!(after["memory"], before["memory"], "{after}");
    assert!(identity.exists(), "the victim's identity file was removed");
    let out = podman.exec(&victim, "cat /run/gpuplex/vgpu.json");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("\"vgpu\": \"{vgpu}\"")),
        "{}",
        text(&out)
    );
    let status = service.status();
    let waiting: Vec<&str> = status["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["vgpu"].as_str())
        .collect();
    assert_eq!(waiting, [pending.as_str()], "{status}");
    assert_eq!(
        status["containers"].as_array().unwrap().len(),
        1,
        "{status}"
    );
}

#[test]
fn an_annotation_is_never_a_path_the_hook_removes() {
    if !can_run("an_annotation_is_never_a_path_the_hook_removes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 102, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    // Two files the hook could reach by climbing out of its identity directory
    // (<node>/identity): one beside it, one anywhere on the host.
    let beside = service.dir.join("keep.json");
    let anywhere = std::env::temp_dir().join(format!("gpuplex-attack-{}.json", std::process::id()));
    for file in [&beside, &anywhere] {
        std::fs::write(file, "{}").unwrap();
    }
    let climb = |to: &Path| {
        let stem = to.with_extension("");
        format!("gpuplex.io/vgpu-id=../../../../../../..{}", stem.display())
    };
    for annotation in ["gpuplex.io/vgpu-id=../keep".to_string(), climb(&anywhere)] {
        refused(
            &podman,
            std::slice::from_ref(&annotation),
            "is gpuplex's to write",
        );
        refused(
            &podman,
            &["gpuplex.io/gpus=1".into(), annotation],
            "is gpuplex's to write",
        );
    }
    assert!(
        beside.exists() && anywhere.exists(),
        "a host file was removed"
    );
    std::fs::remove_file(&anywhere).unwrap();
    assert_eq!(service.held(), (0, 0));
}

#[test]
fn a_running_container_keeps_its_identity_when_the_state_is_lost() {
    if !can_run("a_running_container_keeps_its_identity_when_the_state_is_lost") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut service = NodeService::start(&dir.path().join("node"), 1, 104, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let (first, vgpu) = victim(&podman, &service);
    let read = |id: &str| {
        let out = podman.exec(id, "cat /run/gpuplex/vgpu.json");
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let identity = read(&first);
    assert_eq!(identity["vgpu"], vgpu.as_str());
    // The service starts again with its state gone: the first container is unknown to it now.
    service.stop();
    std::fs::remove_dir_all(service.dir.join("state")).unwrap();
    service.restart();
    let out = podman.run(
        &["--annotation", "gpuplex.io/gpu-memory=4Gi"],
        "cat /run/gpuplex/vgpu.json",
    );
    assert!(out.status.success(), "{}", text(&out));
    let second: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(second["vgpu"], json!(vgpu), "a vGPU id was given twice");
    assert_eq!(
        read(&first),
        identity,
        "the first container's identity changed"
    );
}

#[test]
fn kill_9_of_the_service_thaws_three_busy_podman_containers_within_a_second() {
    if !can_run("kill_9_of_the_service_thaws_three_busy_podman_containers_within_a_second") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut service = NodeService::start(&dir.path().join("node"), 1, 106, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let pids: Vec<u32> = ["1", "2", "3"]
        .iter()
        .map(|w| {
            let id = podman.run_detached(
                &[
                    "--annotation",
                    "gpuplex.io/gpu-memory=4Gi",
                    "--annotation",
                    &format!("gpuplex.io/weight={w}"),
                ],
                "while :; do :; done",
            );
            podman.init_pid(&id)
        })
        .collect();
    let frozen = |pid: &u32| freezer_state(*pid).as_deref() == Some("FROZEN");
    assert!(
        wait_until(Duration::from_secs(5), || pids
            .iter()
            .filter(|p| frozen(p))
            .count()
            == 2),
        "{}",
        service.status()
    );
    service.kill9();
    let started = std::time::Instant::now();
    let thawed = wait_until(Duration::from_secs(1), || {
        pids.iter()
            .all(|p| freezer_state(*p).as_deref() == Some("THAWED"))
    });
    eprintln!("THAWED after {:?}", started.elapsed());
    assert!(
        thawed,
        "{:?}",
        pids.iter().map(|p| freezer_state(*p)).collect::<Vec<_>>()
    );
    podman.remove_all();
    service.restart();
}

#[test]
fn what_a_podman_container_may_ask_for_is_the_operators_to_bound() {
    if !can_run("what_a_podman_container_may_ask_for_is_the_operators_to_bound") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The operator lets Kubernetes namespace `inference` ask for high priority: a podman
    // container is not in it, whatever its annotations say.
    let policy = "[policy]\nhigh_priority_namespaces = [\"inference\"]\n";
    let service = NodeService::start(&dir.path().join("node"), 1, 108, policy);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    refused(
        &podman,
        &["gpuplex.io/priority=high".into()],
        "annotation gpuplex.io/priority=`high` is not allowed outside Kubernetes on this node",
    );
    refused(
        &podman,
        &[
            "gpuplex.io/priority=high".into(),
            "io.kubernetes.pod.namespace=inference".into(),
            "io.kubernetes.cri.sandbox-namespace=inference".into(),
        ],
        "is not allowed outside Kubernetes",
    );
    refused(
        &podman,
        &["gpuplex.io/weight=11".into()],
        "annotation gpuplex.io/weight=`11` is over this node's limit of 10",
    );
    let out = podman.run(
        &[
            "--annotation",
            "gpuplex.io/weight=10",
            "--annotation",
            "gpuplex.io/priority=low",
        ],
        "true",
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(service.held(), (0, 0));
}
