//! gpuplex for a plain runc user who lists `gpuplex-hook` in config.json (config/runc-hooks.json):
//! the hook registers the container at createRuntime and injects the vGPU from outside (device
//! nodes in its mount namespace, its device cgroup, the identity), and poststop releases it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gpuplex_integration::*;
use serde_json::{json, Value};

/// The operator's policy for a test whose container asks for weight 100.
const HEAVY: &str = "[policy]\nmax_weight = 100\n";

struct Runc {
    dir: PathBuf,
    rootfs: PathBuf,
}

impl Runc {
    fn new(dir: &Path) -> Runc {
        std::fs::create_dir_all(dir).unwrap();
        Runc {
            dir: dir.to_path_buf(),
            rootfs: busybox_rootfs(dir),
        }
    }

    /// `runc run` of a bundle whose config has `annotations`, the gpuplex hooks from
    /// config/runc-hooks.json (pointed at the built hook and `config`), and `sh -c script`.
    fn run(&self, id: &str, config: &Path, annotations: Value, script: &str) -> Output {
        self.run_at("createRuntime", id, config, annotations, script)
    }

    /// The same with the registering hook at `stage` (`createRuntime` or `prestart`).
    fn run_at(
        &self,
        stage: &str,
        id: &str,
        config: &Path,
        annotations: Value,
        script: &str,
    ) -> Output {
        let bundle = self.bundle(stage, id, config, annotations, script);
        self.command()
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(id)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// runc with this test's state directory.
    fn command(&self) -> Command {
        let mut runc = Command::new("runc");
        runc.arg("--root").arg(self.dir.join("state"));
        runc
    }

    /// The bundle `run_at` runs.
    fn bundle(
        &self,
        stage: &str,
        id: &str,
        config: &Path,
        annotations: Value,
        script: &str,
    ) -> PathBuf {
        let bundle = self.dir.join(id);
        std::fs::create_dir_all(&bundle).unwrap();
        let status = Command::new("runc")
            .args(["spec", "--bundle"])
            .arg(&bundle)
            .status()
            .unwrap();
        assert!(status.success());
        let path = bundle.join("config.json");
        let mut spec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let snippet: Value = serde_json::from_slice(
            &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/runc-hooks.json"))
                .unwrap(),
        )
        .unwrap();
        // The snippet's own entries (prestart takes createRuntime's), pointed at the built hook
        // and this test's config.
        let hook = |stage: &str| {
            let documented = if stage == "poststop" {
                "poststop"
            } else {
                "createRuntime"
            };
            let mut h = snippet["hooks"][documented][0].clone();
            assert_eq!(
                h["args"],
                json!(["gpuplex-hook", documented]),
                "config/runc-hooks.json"
            );
            h["path"] = json!(bin("gpuplex-hook"));
            h["args"] = json!(["gpuplex-hook", "--config", config, stage]);
            json!([h])
        };
        spec["root"] = json!({"path": self.rootfs, "readonly": false});
        spec["process"]["terminal"] = json!(false);
        spec["process"]["args"] = json!(["sh", "-c", script]);
        spec["annotations"] = annotations;
        let mut hooks = json!({"poststop": hook("poststop")});
        hooks[stage] = hook(stage);
        spec["hooks"] = hooks;
        std::fs::write(&path, spec.to_string()).unwrap();
        bundle
    }
}

#[test]
fn a_runc_container_with_the_hook_in_its_config_gets_its_vgpu() {
    if !can_run("a_runc_container_with_the_hook_in_its_config_gets_its_vgpu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 2, 233, "");
    let runc = Runc::new(&dir.path().join("runc"));
    let node = |i: usize| {
        format!(
            "/dev/{}",
            service.devices[i].file_name().unwrap().to_str().unwrap()
        )
    };
    let out = runc.run(
        "gpuplex-runc-1",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "4Gi", "gpuplex.io/weight": "2"}),
        &format!(
            "ls -l {a} {b} 2>&1; cat {a} 2>&1; cat /run/gpuplex/vgpu.json; echo x > /run/gpuplex/vgpu.json 2>&1 || echo identity-read-only",
            a = node(0),
            b = node(1)
        ),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", text(&out));
    assert!(stdout.contains("195,"), "{stdout}");
    assert!(stdout.contains("No such device or address"), "{stdout}");
    assert!(
        stdout.contains(&format!("{}: No such file or directory", node(1))),
        "{stdout}"
    );
    assert!(
        stdout.contains("\"container\": \"gpuplex-runc-1\""),
        "{stdout}"
    );
    assert!(stdout.contains("\"uuid\": \"GPU-fake-0\""), "{stdout}");
    assert!(stdout.contains("\"weight\": 2"), "{stdout}");
    assert!(stdout.contains("identity-read-only"), "{stdout}");
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
    let identities = service.dir.join("identity");
    assert!(wait_until(Duration::from_secs(1), || {
        !identities.exists() || std::fs::read_dir(&identities).unwrap().count() == 0
    }));
}

#[test]
fn a_runc_container_without_annotations_is_left_alone() {
    if !can_run("a_runc_container_without_annotations_is_left_alone") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 236, "");
    let runc = Runc::new(&dir.path().join("runc"));
    let out = runc.run(
        "gpuplex-runc-2",
        &service.config,
        json!({}),
        "ls /dev; ls /run/gpuplex 2>&1; true",
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("gpuplexfake"), "{stdout}");
    assert!(
        stdout.contains("/run/gpuplex: No such file or directory"),
        "{stdout}"
    );
    assert_eq!(service.held(), (0, 0));
}

#[test]
fn a_runc_container_that_cannot_get_a_vgpu_fails_in_one_line_leaving_nothing() {
    if !can_run("a_runc_container_that_cannot_get_a_vgpu_fails_in_one_line_leaving_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut service = NodeService::start(&dir.path().join("node"), 1, 238, "");
    let runc = Runc::new(&dir.path().join("runc"));
    // No GPU fits.
    let out = runc.run(
        "gpuplex-runc-3",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "64Gi"}),
        "true",
    );
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "gpuplex-hook createRuntime: the gpuplex node service refused: no GPU can hold"
        ),
        "{stderr}"
    );
    assert_eq!(service.held(), (0, 0));
    // An invalid annotation.
    let out = runc.run(
        "gpuplex-runc-4",
        &service.config,
        json!({"gpuplex.io/priority": "urgent"}),
        "true",
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("gpuplex.io/priority"),
        "{}",
        text(&out)
    );
    // No node service.
    service.stop();
    let out = runc.run(
        "gpuplex-runc-5",
        &service.config,
        json!({"gpuplex.io/gpus": "1"}),
        "true",
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach the gpuplex node service"),
        "{}",
        text(&out)
    );
    let identities = service.dir.join("identity");
    assert!(!identities.exists() || std::fs::read_dir(&identities).unwrap().count() == 0);
    // Nothing was left in the rootfs on the host either (the nodes would have been on the
    // container's own /dev).
    assert!(!runc.rootfs.join("run/gpuplex/vgpu.json").exists());
}

#[test]
fn a_runc_container_with_the_hook_at_prestart_gets_its_vgpu_too() {
    if !can_run("a_runc_container_with_the_hook_at_prestart_gets_its_vgpu_too") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 239, "");
    let runc = Runc::new(&dir.path().join("runc"));
    let node = format!(
        "/dev/{}",
        service.devices[0].file_name().unwrap().to_str().unwrap()
    );
    let out = runc.run_at(
        "prestart",
        "gpuplex-runc-6",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "2Gi"}),
        &format!("cat {node} 2>&1; cat /run/gpuplex/vgpu.json"),
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("No such device or address"), "{stdout}");
    assert!(
        stdout.contains("\"container\": \"gpuplex-runc-6\""),
        "{stdout}"
    );
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );
}

#[test]
fn a_runc_container_on_a_host_with_a_cdi_spec_is_sent_to_podman_or_containerd() {
    if !can_run("a_runc_container_on_a_host_with_a_cdi_spec_is_sent_to_podman_or_containerd") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    std::fs::write(
        cdi.join("nvidia.yaml"),
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/gpuplex-cdi-0\n      type: c\n      major: 195\n      minor: 218\n",
    )
    .unwrap();
    let extra = format!("cdi_spec_dirs = [\"{}\"]", cdi.display());
    let service = NodeService::start(&dir.path().join("node"), 1, 218, &extra);
    let runc = Runc::new(&dir.path().join("runc"));
    let out = runc.run(
        "gpuplex-runc-cdi",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "1Gi"}),
        "true",
    );
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("have a CDI spec"), "{stderr}");
    assert!(stderr.contains("io.containerd.gpuplex.v1"), "{stderr}");
    assert_eq!(service.held(), (0, 0), "{}", service.status());
}

/// runc reads a created container whose cgroup is frozen as paused, and refuses to start it: the
/// service must not freeze a container it attached before its start, however busy its GPU.
#[test]
fn a_container_is_not_frozen_between_its_attach_and_its_start() {
    if !can_run("a_container_is_not_frozen_between_its_attach_and_its_start") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Every sample shows work: whatever the service may freeze, it freezes.
    let mut service =
        NodeService::start_sampling("always", &dir.path().join("node"), 1, 216, HEAVY);
    let runc = Runc::new(&dir.path().join("runc"));
    let _gone = Deleted(&runc, &["gpuplex-runc-holder", "gpuplex-runc-late"]);
    let status = |id: &str| {
        let out = runc.command().args(["state", id]).output().unwrap();
        let state: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        state["status"].as_str().unwrap_or_default().to_string()
    };
    // The first container takes the window, 100 slices long.
    let holder = runc.bundle(
        "createRuntime",
        "gpuplex-runc-holder",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "1Gi", "gpuplex.io/weight": "100"}),
        "sleep 60",
    );
    // A detached container keeps runc's stdio: a pipe would never close.
    let errors = dir.path().join("runc.err");
    let quiet = |runc: &mut Command| {
        let err = std::fs::File::create(&errors).unwrap();
        let status = runc
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .status()
            .unwrap();
        (status, std::fs::read_to_string(&errors).unwrap())
    };
    let out = quiet(
        runc.command()
            .args(["run", "-d", "--bundle"])
            .arg(&holder)
            .arg("gpuplex-runc-holder"),
    );
    assert!(out.0.success(), "{}", out.1);
    let late = runc.bundle(
        "createRuntime",
        "gpuplex-runc-late",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "1Gi"}),
        "sleep 60",
    );
    let out = quiet(
        runc.command()
            .args(["create", "--bundle"])
            .arg(&late)
            .arg("gpuplex-runc-late"),
    );
    assert!(out.0.success(), "{}", out.1);
    assert_eq!(service.held(), (2, 0), "{}", service.status());
    // Twenty samples, each showing work, while it waits for its start.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status("gpuplex-runc-late"), "created", "{}", service.log());
    // A restarted service, which recovers both, leaves it alone as well.
    service.stop();
    service = NodeService::start_sampling("always", &dir.path().join("node"), 1, 216, HEAVY);
    assert_eq!(service.held(), (2, 0), "{}", service.log());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status("gpuplex-runc-late"), "created", "{}", service.log());
    let out = quiet(runc.command().args(["start", "gpuplex-runc-late"]));
    assert!(out.0.success(), "{}", out.1);
    // Started, it is scheduled: it waits for the holder's window, frozen.
    assert!(
        wait_until(Duration::from_secs(4), || status("gpuplex-runc-late")
            == "paused"),
        "{}",
        service.log()
    );
    // Stopping the service thaws it (fail open); then the containers go.
    service.stop();
}

/// Deletes these runc containers when dropped, the test passed or not.
struct Deleted<'a>(&'a Runc, &'a [&'a str]);

impl Drop for Deleted<'_> {
    fn drop(&mut self) {
        for id in self.1 {
            // A paused container is thawed first: runc cannot kill a frozen one.
            let _ = self.0.command().args(["resume", id]).output();
            let _ = self.0.command().args(["delete", "--force", id]).output();
        }
    }
}

#[test]
fn a_runc_container_naming_another_vgpu_or_a_path_gets_nothing() {
    if !can_run("a_runc_container_naming_another_vgpu_or_a_path_gets_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 240, "");
    let runc = Runc::new(&dir.path().join("runc"));
    // The victim: a runc container that registered itself and sleeps.
    let bundle = runc.bundle(
        "createRuntime",
        "gpuplex-victim",
        &service.config,
        json!({"gpuplex.io/gpu-memory": "2Gi"}),
        "sleep 1000",
    );
    let mut victim = runc
        .command()
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg("gpuplex-victim")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let listed = || {
        service.status()["containers"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["id"] == "gpuplex-victim").cloned())
    };
    assert!(wait_until(Duration::from_secs(10), || listed().is_some()));
    let before = listed().unwrap();
    let vgpu = before["vgpu"].as_str().unwrap().to_owned();
    let identity = service.dir.join(format!("identity/{vgpu}.json"));
    let elsewhere = dir.path().join("elsewhere.json");
    std::fs::write(&elsewhere, "{}").unwrap();
    let climb = format!(
        "../../../../../../..{}",
        dir.path().join("elsewhere").display()
    );
    let attacks = [
        (
            json!({"gpuplex.io/vgpu-id": vgpu}),
            "gpuplex.io/vgpu-id is gpuplex's annotation",
        ),
        (
            json!({"gpuplex.io/vgpu-id": climb}),
            "gpuplex.io/vgpu-id is gpuplex's annotation",
        ),
        (
            json!({"gpuplex.io/vgpu-handle": "../../x", "gpuplex.io/vgpu-id": vgpu}),
            "gpuplex.io/vgpu-handle is not one gpuplex wrote",
        ),
        (
            json!({"gpuplex.io/vgpu-handle": "0".repeat(32), "gpuplex.io/vgpu-id": vgpu}),
            "no reservation on this node has this handle",
        ),
    ];
    for (i, (annotations, because)) in attacks.into_iter().enumerate() {
        let out = runc.run(
            &format!("gpuplex-thief-{i}"),
            &service.config,
            annotations,
            "true",
        );
        assert!(!out.status.success(), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(because), "{stderr}");
    }
    // The victim keeps its vGPU and its identity; no file was removed. (Its accounting moves
    // with its own start-up: the service may sample its first CPU time only now.)
    assert_eq!(listed().as_ref().map(holdings), Some(holdings(&before)));
    assert!(identity.exists() && elsewhere.exists());
    let _ = runc
        .command()
        .args(["kill", "gpuplex-victim", "KILL"])
        .status();
    let _ = victim.wait();
}
