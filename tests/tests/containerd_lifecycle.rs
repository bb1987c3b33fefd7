//! gpuplex's containerd shim when the user or a crash intervenes (root, a private containerd,
//! the node service on one fake GPU): a user's pause outlasts the scheduler's windows, a
//! shim killed with SIGKILL leaves nothing reserved and nothing frozen, and a shim containerd
//! forgot (it died between `start` and `Create`) ends by itself.

use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::*;
use serde_json::Value;

/// The node service, a containerd that reaches it, and two busy containers with vGPUs on its
/// one GPU (so that one of them is frozen at any time).
struct Rig {
    containerd: Containerd,
    service: NodeService,
    _dir: tempfile::TempDir,
}

/// The node service on one fake GPU of `minor` and a containerd whose shims reach it.
fn service_and_containerd(minor: u32) -> (tempfile::TempDir, NodeService, Containerd) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let service = NodeService::start(&dir.path().join("node"), 1, minor, "");
    let containerd = Containerd::start(Setup {
        gpuplex_config: Some(service.config.clone()),
        cri: false,
    });
    (dir, service, containerd)
}

/// Containers `<prefix>-one` and `<prefix>-two` (ids distinct across tests: the shims of every
/// containerd on the host are told apart by container id alone).
fn busy_pair(test: &str, prefix: &str, minor: u32) -> Option<Rig> {
    if !can_run_containerd(test) {
        return None;
    }
    let (dir, service, containerd) = service_and_containerd(minor);
    for name in [format!("{prefix}-one"), format!("{prefix}-two")] {
        containerd.run_detached(
            GPUPLEX,
            &["gpuplex.io/gpu-memory=1Gi"],
            &name,
            &["sh", "-c", "while :; do :; done"],
        );
    }
    let rig = Rig {
        containerd,
        service,
        _dir: dir,
    };
    let both_listed = wait_until(Duration::from_secs(5), || {
        rig.service.status()["containers"].as_array().map(Vec::len) == Some(2)
    });
    assert!(both_listed, "{}", rig.service.status());
    Some(rig)
}

fn entry(status: &Value, id: &str) -> Value {
    status["containers"]
        .as_array()
        .and_then(|list| list.iter().find(|c| c["id"] == id).cloned())
        .unwrap_or(Value::Null)
}

#[test]
fn a_paused_container_stays_paused_through_the_windows_until_resumed() {
    let Some(rig) = busy_pair(
        "a_paused_container_stays_paused_through_the_windows_until_resumed",
        "paused",
        236,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let pid_of = |id: &str| {
        c.tasks()
            .into_iter()
            .find(|t| t.id == id)
            .map(|t| t.pid)
            .expect("the task")
    };
    let (one, two) = (pid_of("paused-one"), pid_of("paused-two"));
    let out = c.pause("paused-one");
    assert!(out.status.success(), "{}", text(&out));
    // Two seconds are ten windows of 200 ms: the scheduler would have thawed it several times.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut other_frozen = 0;
    while Instant::now() < deadline {
        assert_eq!(
            freezer_state(one).as_deref(),
            Some("FROZEN"),
            "{}",
            service.status()
        );
        if freezer_state(two).as_deref() != Some("THAWED") {
            other_frozen += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        other_frozen <= 2,
        "the other was frozen {other_frozen} times out of 100"
    );
    assert_eq!(c.task_status("paused-one").as_deref(), Some("PAUSED"));
    assert_eq!(entry(&service.status(), "paused-one")["state"], "paused");

    let out = c.resume("paused-one");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(c.task_status("paused-one").as_deref(), Some("RUNNING"));
    // Both busy again: they take turns, each frozen some of the time.
    let mut frozen = [0, 0];
    for _ in 0..100 {
        for (i, pid) in [one, two].into_iter().enumerate() {
            if freezer_state(pid).as_deref() == Some("FROZEN") {
                frozen[i] += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        frozen[0] > 10 && frozen[1] > 10,
        "frozen samples {frozen:?}"
    );
}

#[test]
fn a_shim_killed_with_sigkill_leaves_nothing_reserved_or_frozen() {
    let Some(rig) = busy_pair(
        "a_shim_killed_with_sigkill_leaves_nothing_reserved_or_frozen",
        "killed",
        237,
    ) else {
        return;
    };
    let (c, service) = (&rig.containerd, &rig.service);
    let two = c
        .tasks()
        .into_iter()
        .find(|t| t.id == "killed-two")
        .map(|t| t.pid)
        .expect("the task");
    let shim = shim_daemon(GPUPLEX, "killed-one").expect("the shim daemon of container killed-one");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9 the shim");
    let killed = Instant::now();
    // containerd notices, runs the shim's `delete` (runc delete --force): the task is gone.
    assert!(
        wait_until(Duration::from_secs(10), || c
            .tasks()
            .iter()
            .all(|t| t.id != "killed-one" || t.status == "STOPPED")),
        "{:?}\n{}",
        c.tasks(),
        c.log_tail()
    );
    // The node service lets it go, and the other container runs alone, never frozen.
    assert!(
        wait_until(Duration::from_secs(3), || entry(
            &service.status(),
            "killed-one"
        )
        .is_null()),
        "{}",
        service.status()
    );
    eprintln!("released {:?} after the shim's SIGKILL", killed.elapsed());
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..50 {
        assert_eq!(
            freezer_state(two).as_deref(),
            Some("THAWED"),
            "{}",
            service.status()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        service.status()["containers"].as_array().map(Vec::len),
        Some(1)
    );
}

#[test]
fn runtime_options_from_a_config_file_choose_runcs_root_and_the_shim_sits_above_containerd() {
    if !can_run_containerd(
        "runtime_options_from_a_config_file_choose_runcs_root_and_the_shim_sits_above_containerd",
    ) {
        return;
    }
    let (dir, service, c) = service_and_containerd(238);
    // CRI's runtimeoptions.v1.Options: a TOML file of runc's options by their Go names.
    let root = dir.path().join("runc-root");
    let options = dir.path().join("runc-options.toml");
    std::fs::write(
        &options,
        format!(
            "BinaryName = \"/usr/bin/runc\"\nRoot = \"{}\"\n",
            root.display()
        ),
    )
    .expect("the options file");
    let options = options.to_str().expect("a UTF-8 path").to_owned();
    let id = "options-root";
    let out = c
        .run_command(
            &["-d", "--runtime-config-path", &options],
            GPUPLEX,
            &[],
            id,
            &["sleep", "1000"],
        )
        .stdin(std::process::Stdio::null())
        .output()
        .expect("ctr runs");
    assert!(out.status.success(), "{}", text(&out));
    // runc keeps its state under the chosen root, per namespace.
    let states: Vec<_> = std::fs::read_dir(&root)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert_eq!(states.len(), 1, "{} holds {states:?}", root.display());
    let ours = std::fs::read_to_string("/proc/self/oom_score_adj").expect("our OOM score");
    let shim = shim_daemon(GPUPLEX, id).expect("the shim daemon");
    let score = std::fs::read_to_string(format!("/proc/{shim}/oom_score_adj")).expect("its score");
    let ours: i64 = ours.trim().parse().expect("a score");
    assert_eq!(score.trim().parse::<i64>().ok(), Some((ours + 1).min(1000)));
    c.remove_all();
    drop(c);
    drop(service);
}

/// The pids of processes whose command line holds every one of `words`.
fn processes_with(words: &[&str]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            words.iter().all(|w| cmdline.contains(w)).then_some(pid)
        })
        .collect()
}

#[test]
fn the_shim_starts_the_node_service_when_it_is_not_running() {
    if !can_run_containerd("the_shim_starts_the_node_service_when_it_is_not_running") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    // A configured node whose service is not running.
    let mut service = NodeService::start(&dir.path().join("node"), 1, 239, "");
    service.stop();
    let config = service.config.to_str().expect("a UTF-8 path").to_owned();
    assert!(processes_with(&["serve", &config]).is_empty());
    let c = Containerd::start(Setup {
        gpuplex_config: Some(service.config.clone()),
        cri: false,
    });
    let out = c.run(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=1Gi"],
        "autostart",
        &["sh", "-c", "echo CUDA=$CUDA_VISIBLE_DEVICES"],
    );
    let started = processes_with(&["containerd-shim-gpuplex-v1", "serve", &config]);
    // Stopped again whatever the checks below say: SIGTERM thaws everything and exits.
    for pid in &started {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "CUDA=GPU-fake-0\n");
    assert_eq!(started.len(), 1, "node services started: {started:?}");
    drop(c);
}

/// containerd dies between starting a shim (`start`) and asking it for the container
/// (`Create`), as a kill -9 of containerd during `ctr run` makes it: nothing will ever talk to
/// that shim again. runc's shim then runs until the machine stops; gpuplex's ends by itself
/// within a minute, its socket removed. The test runs `start` in the bundle as containerd does,
/// against a live containerd's addresses, and never sends `Create`.
#[test]
fn a_shim_containerd_never_asks_for_a_container_ends_by_itself() {
    if !can_run_containerd("a_shim_containerd_never_asks_for_a_container_ends_by_itself") {
        return;
    }
    let (_dir, service, c) = service_and_containerd(250);
    let id = "never-asked";
    let bundle = c
        .dir
        .join("state/io.containerd.runtime.v2.task")
        .join(&c.namespace)
        .join(id);
    std::fs::create_dir_all(&bundle).expect("the bundle");
    std::fs::write(bundle.join("config.json"), "{}").expect("its config.json");
    let ttrpc = format!("{}.ttrpc", c.socket.display());
    let started = Instant::now();
    let out = std::process::Command::new(bin(GPUPLEX_SHIM))
        .args(["-namespace", &c.namespace, "-address"])
        .arg(&c.socket)
        .args(["-publish-binary", "containerd", "-id", id, "start"])
        .current_dir(&bundle)
        .env("TTRPC_ADDRESS", &ttrpc)
        .env("GRPC_ADDRESS", &c.socket)
        .env("NAMESPACE", &c.namespace)
        .env("GPUPLEX_CONFIG", &service.config)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("the shim's start runs");
    assert!(out.status.success(), "start: {}", text(&out));
    let address = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let socket = std::path::PathBuf::from(address.strip_prefix("unix://").unwrap_or(&address));
    let daemon = shim_daemon(GPUPLEX, id).expect("the shim daemon runs after start");
    assert!(socket.exists(), "{} is not there", socket.display());
    // A zombie has no command line: gone from the list once it has exited.
    let ended = wait_until(Duration::from_secs(90), || {
        shim_daemon(GPUPLEX, id).is_none()
    });
    assert!(
        ended,
        "the shim (pid {daemon}) still runs {:?} after start",
        started.elapsed()
    );
    eprintln!("the unasked shim ended {:?} after start", started.elapsed());
    assert!(
        started.elapsed() >= Duration::from_secs(55),
        "it ended before containerd had its minute"
    );
    assert!(!socket.exists(), "{} was left behind", socket.display());
    drop(c);
    drop(service);
}
