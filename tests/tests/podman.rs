//! gpuplex through podman's hooks.d (precreate spec edits, createRuntime attach, poststop
//! release), with real podman, runc and the node service on fake GPUs (root).

use std::time::Duration;

use gpuplex_integration::*;

#[test]
fn a_podman_container_gets_its_vgpu_and_nothing_else() {
    if !can_run("a_podman_container_gets_its_vgpu_and_nothing_else") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 2, 210, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let node = |i: usize| {
        format!(
            "/dev/{}",
            service.devices[i].file_name().unwrap().to_str().unwrap()
        )
    };
    let script = format!(
        "ls -l {a} {b} 2>&1; cat {a} 2>&1; cat /run/gpuplex/vgpu.json; echo CUDA=$CUDA_VISIBLE_DEVICES; echo x > /run/gpuplex/vgpu.json 2>&1 || echo identity-read-only",
        a = node(0),
        b = node(1)
    );
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=4Gi"], &script);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", text(&out));
    // Spread puts the first vGPU on GPU 0: its node is there, allowed (ENXIO: no driver behind
    // it), and GPU 1's node is not.
    assert!(stdout.contains("195,"), "{stdout}");
    assert!(stdout.contains("No such device or address"), "{stdout}");
    assert!(
        stdout.contains(&format!("{}: No such file or directory", node(1))),
        "{stdout}"
    );
    assert!(stdout.contains("CUDA=GPU-fake-0"), "{stdout}");
    assert!(stdout.contains("\"uuid\": \"GPU-fake-0\""), "{stdout}");
    assert!(stdout.contains("\"memory\": 4294967296"), "{stdout}");
    assert!(stdout.contains("identity-read-only"), "{stdout}");
    // poststop released it.
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}

#[test]
fn a_podman_container_without_annotations_is_untouched() {
    if !can_run("a_podman_container_without_annotations_is_untouched") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 215, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(
        &[],
        "echo CUDA=$CUDA_VISIBLE_DEVICES; ls /run/gpuplex 2>&1; ls /dev",
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("CUDA=\n"), "{stdout}");
    assert!(
        stdout.contains("/run/gpuplex: No such file or directory"),
        "{stdout}"
    );
    assert!(!stdout.contains("gpuplexfake"), "{stdout}");
    assert_eq!(service.held(), (0, 0));
}

#[test]
fn a_podman_container_with_a_bad_annotation_is_refused_in_one_line() {
    if !can_run("a_podman_container_with_a_bad_annotation_is_refused_in_one_line") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 217, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(&["--annotation", "gpuplex.io/weight=0"], "true");
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    // podman drops a precreate hook's stderr; the line reaches the user through runc, from the
    // createRuntime hook the failed precreate put in the spec.
    assert!(
        stderr.contains("stderr: gpuplex-hook precreate: "),
        "{stderr}"
    );
    assert!(stderr.contains("gpuplex.io/weight"), "{stderr}");
    assert_eq!(service.held(), (0, 0));
    // A request that fits nowhere names every GPU's free memory.
    let out = podman.run(&["--annotation", "gpuplex.io/gpu-memory=32Gi"], "true");
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GPU 0 (Fake A100, 16 GiB): 16 GiB free, 32 GiB needed"),
        "{stderr}"
    );
    assert_eq!(service.held(), (0, 0));
}

#[test]
fn without_the_node_service_a_podman_container_fails_saying_so() {
    if !can_run("without_the_node_service_a_podman_container_fails_saying_so") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut service = NodeService::start(&dir.path().join("node"), 1, 219, "");
    service.stop();
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(&["--annotation", "gpuplex.io/gpus=1"], "true");
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot reach the gpuplex node service"),
        "{stderr}"
    );
    assert!(
        !service.dir.join("identity").exists()
            || std::fs::read_dir(service.dir.join("identity"))
                .unwrap()
                .count()
                == 0
    );
}

#[test]
fn two_podman_containers_on_one_gpu_take_turns_by_weight() {
    if !can_run("two_podman_containers_on_one_gpu_take_turns_by_weight") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 223, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let counters = dir.path().join("counters");
    let mut ids = Vec::new();
    for (name, weight) in [("light", 1), ("heavy", 3)] {
        let data = counters.join(name);
        std::fs::create_dir_all(&data).unwrap();
        let volume = format!("{}:/data", data.display());
        ids.push(podman.run_detached(
            &[
                "-v",
                &volume,
                "--annotation",
                &format!("gpuplex.io/weight={weight}"),
                "--annotation",
                "gpuplex.io/gpu-memory=4Gi",
            ],
            &counting_loop("/data/n"),
        ));
    }
    let read = |name: &str| -> f64 {
        std::fs::read_to_string(counters.join(name).join("n"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let share = heavy_share(read).expect("both loops count within 5 s");
    assert!(
        (share - 0.75).abs() <= 0.075,
        "heavy's share {share:.3}, want 0.75 ± 10%"
    );
    let status = service.status();
    assert_eq!(
        status["containers"].as_array().unwrap().len(),
        2,
        "{status}"
    );
    assert!(
        status["gpus"][0]["switches"].as_u64().unwrap() > 10,
        "{status}"
    );
    podman.remove_all();
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}

#[test]
fn an_exited_podman_container_is_released_within_a_second() {
    if !can_run("an_exited_podman_container_is_released_within_a_second") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 225, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let id = podman.run_detached(&["--annotation", "gpuplex.io/gpu-memory=4Gi"], "sleep 1");
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (1, 0)),
        "{}",
        service.status()
    );
    let out = podman.command().args(["wait", &id]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let exited = std::time::Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
    eprintln!("released {:?} after podman wait returned", exited.elapsed());
}

#[test]
fn a_read_only_podman_container_still_gets_its_identity() {
    if !can_run("a_read_only_podman_container_still_gets_its_identity") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 227, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let out = podman.run(
        &["--read-only", "--annotation", "gpuplex.io/gpu-memory=1Gi"],
        "cat /run/gpuplex/vgpu.json; touch /x 2>&1 || echo rootfs-read-only",
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"uuid\": \"GPU-fake-0\""), "{stdout}");
    assert!(stdout.contains("rootfs-read-only"), "{stdout}");
}

#[test]
fn a_podman_container_that_fails_to_start_does_not_keep_its_reservation() {
    if !can_run("a_podman_container_that_fails_to_start_does_not_keep_its_reservation") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 229, "");
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    // precreate reserves; the command does not exist, so the container never runs.
    let out = podman
        .command()
        .args(["run", "--rm", "--runtime", "runc", "--network", "none"])
        .args(["--annotation", "gpuplex.io/gpu-memory=4Gi", "--rootfs"])
        .arg(&podman.rootfs)
        .arg("/bin/does-not-exist")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    // Released at once by poststop, or at the latest when the reservation lapses (3 s here).
    assert!(
        wait_until(Duration::from_secs(5), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}
