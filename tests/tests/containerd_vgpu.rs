//! gpuplex as a containerd runtime (`io.containerd.gpuplex.v1`), driven with `ctr` against a
//! private containerd with real runc and the node service on fake GPUs (root): what the shim
//! adds to a container that asks for a vGPU, and leaves alone in one that does not. Its parity
//! with runc's shim for everything else is held in `containerd.rs`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::*;
use serde_json::{json, Value};

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A node service with fake GPUs and a containerd whose gpuplex shim reaches it. Dropped in
/// order: the containers (their vGPUs released while the service still runs), the service, the
/// directory.
struct Rig {
    containerd: Containerd,
    service: NodeService,
    _dir: tempfile::TempDir,
}

/// A [`Rig`] with `gpus` fake GPUs from device minor `minor` (distinct per test), or `None` when
/// `test` cannot run here.
fn rig(test: &str, gpus: usize, minor: u32) -> Option<Rig> {
    if !can_run_containerd(test) {
        return None;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let service = NodeService::start(&dir.path().join("node"), gpus, minor, "");
    let containerd = Containerd::start(Setup {
        gpuplex_config: Some(service.config.clone()),
        cri: false,
    });
    Some(Rig {
        containerd,
        service,
        _dir: dir,
    })
}

/// The node service's entry for container `id`, if it lists it.
fn listed(status: &Value, id: &str) -> Option<Value> {
    status["containers"]
        .as_array()?
        .iter()
        .find(|c| c["id"] == id)
        .cloned()
}

/// The lines of `text` between a line `--- start` and a line `--- end`.
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text
        .find(&format!("--- {start}\n"))
        .map(|i| i + start.len() + 5)
        .unwrap_or_else(|| panic!("no `--- {start}` in {text:?}"));
    let to = text[from..]
        .find(&format!("--- {end}\n"))
        .map(|i| from + i)
        .unwrap_or_else(|| panic!("no `--- {end}` in {text:?}"));
    &text[from..to]
}

const GIB: u64 = 1 << 30;

#[test]
fn a_containerd_container_gets_its_vgpu_and_nothing_else() {
    let Some(rig) = rig(
        "a_containerd_container_gets_its_vgpu_and_nothing_else",
        2,
        250,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let node = |i: usize| {
        let name = service.devices[i].file_name().expect("a device name");
        format!("/dev/{}", name.to_string_lossy())
    };
    let id = "vgpu";
    // It shows what it sees, then waits (while the node service is asked) until told to exit.
    let script = format!(
        "echo CUDA=$CUDA_VISIBLE_DEVICES; cat {a} 2>&1; cat {b} 2>&1; echo '--- identity'; cat /run/gpuplex/vgpu.json; echo; echo '--- end'; while [ ! -e /tmp/{id}.exit ]; do sleep 0.05; done",
        a = node(0),
        b = node(1)
    );
    let mut child = c
        .run_command(
            &["--rm"],
            GPUPLEX,
            &["gpuplex.io/gpu-memory=1Gi"],
            id,
            &["sh", "-c", &script],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr runs");
    let attached = wait_until(Duration::from_secs(10), || {
        listed(&service.status(), id).is_some() || matches!(child.try_wait(), Ok(Some(_)))
    });
    let status = service.status();
    std::fs::write(c.rootfs.join("tmp").join(format!("{id}.exit")), "")
        .expect("telling it to exit");
    if !attached {
        // Neither listed nor exited: do not wait for a ctr that may never return.
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("ctr exits");
    assert!(out.status.success(), "{}", text(&out));
    let entry = listed(&status, id)
        .unwrap_or_else(|| panic!("attached: {attached}; not listed: {status}\n{}", text(&out)));
    let shown = stdout(&out);

    // The assignment: one GPU, 1 GiB on it; everything the container sees agrees with it.
    assert_eq!(entry["memory"], json!([GIB]), "{entry}");
    let gpus = entry["gpus"].as_array().expect("its GPUs");
    assert_eq!(gpus.len(), 1, "{entry}");
    let index = gpus[0].as_u64().expect("a GPU index") as usize;
    let gpu = &status["gpus"][index];
    let other = 1 - index;
    assert!(
        shown.contains(&format!("CUDA={}\n", gpu["uuid"].as_str().expect("a UUID"))),
        "{shown}"
    );
    // Its GPU's node is there and allowed (ENXIO: no driver behind it); the other's is not there.
    let line_of = |path: &str| {
        shown
            .lines()
            .find(|l| l.contains(path))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        line_of(&node(index)).contains("No such device or address"),
        "{shown}"
    );
    assert!(
        line_of(&node(other)).contains("No such file or directory"),
        "{shown}"
    );
    let identity: Value = serde_json::from_str(between(&shown, "identity", "end"))
        .unwrap_or_else(|e| panic!("/run/gpuplex/vgpu.json: {e}\n{shown}"));
    assert_eq!(identity["vgpu"], entry["vgpu"], "{identity}");
    assert_eq!(identity["weight"], entry["weight"], "{identity}");
    assert_eq!(identity["priority"], entry["priority"], "{identity}");
    assert_eq!(
        identity["gpus"],
        json!([{"uuid": gpu["uuid"], "index": index, "model": gpu["model"], "memory": GIB}]),
        "{identity}"
    );

    // `--rm` deleted it: released within a second of ctr returning.
    assert!(
        wait_until(Duration::from_secs(1), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
    // The shim knows the container's id when it asks for the vGPU (the task's id): the identity
    // names it, as it does for a container registered by the runc hook.
    assert_eq!(identity["container"], json!(id), "{identity}");
}

#[test]
fn two_containerd_containers_on_one_gpu_take_turns_by_weight() {
    let Some(rig) = rig(
        "two_containerd_containers_on_one_gpu_take_turns_by_weight",
        1,
        252,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    for (name, weight) in [("light", 1), ("heavy", 3)] {
        let weight = format!("gpuplex.io/weight={weight}");
        let script = counting_loop(&format!("/data/{name}"));
        c.run_detached(
            GPUPLEX,
            &[&weight, "gpuplex.io/gpu-memory=4Gi"],
            name,
            &["sh", "-c", &script],
        );
    }
    let read = |name: &str| -> f64 {
        std::fs::read_to_string(c.rootfs.join("data").join(name))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let Some(share) = heavy_share(read) else {
        panic!(
            "the loops did not both count within 5 s: {}",
            service.status()
        );
    };
    assert!(
        (share - 0.75).abs() <= 0.075,
        "heavy's share {share:.3}, want 0.75 ± 10%"
    );
    let status = service.status();
    assert_eq!(
        status["containers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    assert!(
        status["gpus"][0]["switches"].as_u64() > Some(10),
        "{status}"
    );
    // Each is frozen between its windows; an exec waits for the next one instead of failing as
    // runc would ("cannot exec in a paused container"), and sees the container's GPU.
    let uuid = status["gpus"][0]["uuid"]
        .as_str()
        .expect("a UUID")
        .to_owned();
    for round in 0..3 {
        for name in ["light", "heavy"] {
            let exec_id = format!("e{round}{name}");
            let out = c.exec(
                name,
                &exec_id,
                &["sh", "-c", "echo CUDA=$CUDA_VISIBLE_DEVICES"],
            );
            assert!(out.status.success(), "exec {exec_id}: {}", text(&out));
            assert_eq!(stdout(&out), format!("CUDA={uuid}\n"), "exec {exec_id}");
        }
    }
    c.remove_all();
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}

#[test]
fn a_killed_and_removed_containerd_container_is_released_within_a_second() {
    let Some(rig) = rig(
        "a_killed_and_removed_containerd_container_is_released_within_a_second",
        1,
        253,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let id = "released";
    c.run_detached(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=1Gi"],
        id,
        &["sleep", "1000"],
    );
    assert!(
        wait_until(Duration::from_secs(2), || listed(&service.status(), id)
            .is_some()),
        "{}",
        service.status()
    );
    let out = c.kill(id, "SIGKILL");
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        c.wait_for_status(id, "STOPPED", Duration::from_secs(5)),
        "{:?}",
        c.tasks()
    );
    let out = c.remove(id);
    assert!(out.status.success(), "{}", text(&out));
    let removed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
    eprintln!(
        "released {:?} after ctr container rm returned",
        removed.elapsed()
    );
}

#[test]
fn a_containerd_container_without_annotations_is_untouched() {
    let Some(rig) = rig(
        "a_containerd_container_without_annotations_is_untouched",
        1,
        254,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let out = c.run(
        GPUPLEX,
        &[],
        "plain",
        &[
            "sh",
            "-c",
            "echo CUDA=$CUDA_VISIBLE_DEVICES; ls /run/gpuplex 2>&1; ls /dev",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let shown = stdout(&out);
    assert!(shown.contains("CUDA=\n"), "{shown}");
    assert!(
        shown.contains("/run/gpuplex: No such file or directory"),
        "{shown}"
    );
    assert!(!shown.contains("gpuplexfake"), "{shown}");
    assert_eq!(service.held(), (0, 0));
}

#[test]
fn a_containerd_container_with_a_bad_annotation_is_refused_leaving_nothing() {
    let Some(rig) = rig(
        "a_containerd_container_with_a_bad_annotation_is_refused_leaving_nothing",
        1,
        255,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let out = c.run(GPUPLEX, &["gpuplex.io/weight=0"], "refused", &["true"]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("gpuplex.io/weight"), "{stderr}");
    assert_eq!(service.held(), (0, 0), "{}", service.status());
    assert_eq!(c.tasks(), []);
    // `ctr run --rm` deletes the container it made when its task cannot be created.
    assert_eq!(c.containers(), Vec::<String>::new());
    let identities = service.dir.join("identity");
    assert!(!identities.exists() || std::fs::read_dir(&identities).map_or(0, |d| d.count()) == 0);
}

#[test]
fn a_containerd_container_naming_another_vgpu_gets_nothing_of_it() {
    let Some(rig) = rig(
        "a_containerd_container_naming_another_vgpu_gets_nothing_of_it",
        1,
        251,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    c.run_detached(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=4Gi"],
        "victim",
        &["sleep", "1000"],
    );
    let before = listed(&service.status(), "victim").expect("the victim is attached");
    let vgpu = before["vgpu"].as_str().unwrap().to_owned();
    let identity = service.dir.join(format!("identity/{vgpu}.json"));
    assert!(identity.exists());
    let attacks = [
        format!("gpuplex.io/vgpu-id={vgpu}"),
        "gpuplex.io/vgpu-id=../../../../tmp/x".to_string(),
        format!("gpuplex.io/vgpu-handle={}", "0".repeat(32)),
    ];
    for (i, annotation) in attacks.iter().enumerate() {
        let out = c.run(
            GPUPLEX,
            &[annotation.as_str()],
            &format!("thief-{i}"),
            &["true"],
        );
        assert!(!out.status.success(), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("is gpuplex's to write"), "{stderr}");
    }
    // What it holds is unchanged (its accounting moves with its own start-up).
    let after = listed(&service.status(), "victim");
    assert_eq!(after.as_ref().map(holdings), Some(holdings(&before)));
    assert!(identity.exists(), "the victim's identity file was removed");
    assert_eq!(service.held(), (1, 0), "{}", service.status());
}

#[test]
fn a_containerd_container_asks_for_high_priority_only_where_the_operator_allows() {
    let Some(rig) = rig(
        "a_containerd_container_asks_for_high_priority_only_where_the_operator_allows",
        1,
        249,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    // The default policy: nobody gets high priority, nobody a weight over 10.
    for (annotation, because) in [
        (
            "gpuplex.io/priority=high",
            "is not allowed outside Kubernetes",
        ),
        ("gpuplex.io/weight=50", "is over this node's limit of 10"),
    ] {
        let out = c.run(GPUPLEX, &[annotation], "greedy", &["true"]);
        assert!(!out.status.success(), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(because), "{stderr}");
    }
    assert_eq!(service.held(), (0, 0), "{}", service.status());
}
