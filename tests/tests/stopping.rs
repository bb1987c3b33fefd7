//! Stopping wins over windows (issue #12, item 12), with real podman, containerd, runc and the
//! node service on a fake GPU (root): a container frozen behind a busy `high` neighbour, which
//! would never get a window while the neighbour works, runs its SIGTERM handler when it is
//! stopped, and dies of a SIGKILL sent to its process directly (on cgroup v1 a frozen process
//! does not die of SIGKILL until it is thawed).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::*;

/// The operator's policy: containers outside Kubernetes may ask for high priority.
const HIGH_ALLOWED: &str = "[policy]\nhigh_priority_outside_kubernetes = true\n";

/// A busy loop that, on SIGTERM, writes `TERM` to `file` (a path in the container) and exits 0.
fn trapping_loop(file: &str) -> String {
    format!("trap 'echo TERM > {file}; exit 0' TERM; while :; do :; done")
}

/// Waits until `pid`'s freezer cgroup reads FROZEN.
fn frozen(pid: u32) -> bool {
    wait_until(Duration::from_secs(5), || {
        freezer_state(pid).as_deref() == Some("FROZEN")
    })
}

/// A busy `high` podman container, then one running `script` that is frozen behind it: the
/// latter's id and init pid.
fn frozen_behind_high(podman: &Podman, service: &NodeService, script: &str) -> (String, u32) {
    let memory = ["--annotation", "gpuplex.io/gpu-memory=4Gi"];
    let mut high = memory.to_vec();
    high.extend(["--annotation", "gpuplex.io/priority=high"]);
    podman.run_detached(&high, "while :; do :; done");
    let id = podman.run_detached(&memory, script);
    let pid = podman.init_pid(&id);
    assert!(
        frozen(pid),
        "not frozen behind the high neighbour: {}",
        service.status()
    );
    (id, pid)
}

fn gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
        || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

#[test]
fn a_podman_container_frozen_behind_a_high_neighbour_runs_its_sigterm_handler_on_stop() {
    if !can_run(
        "a_podman_container_frozen_behind_a_high_neighbour_runs_its_sigterm_handler_on_stop",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 110, HIGH_ALLOWED);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let file = format!("/tmp/term-{}", std::process::id());
    let (stopped, _) = frozen_behind_high(&podman, &service, &trapping_loop(&file));
    let started = Instant::now();
    let out = podman
        .command()
        .args(["stop", "-t", "10", &stopped])
        .output()
        .unwrap();
    eprintln!("podman stop took {:?}", started.elapsed());
    assert!(out.status.success(), "{}", text(&out));
    let got = std::fs::read_to_string(podman.rootfs.join(file.trim_start_matches('/')))
        .unwrap_or_default();
    assert_eq!(
        got.trim(),
        "TERM",
        "its SIGTERM handler did not run (it was killed at the timeout)"
    );
    let inspect = podman
        .command()
        .args(["inspect", "--format", "{{.State.ExitCode}}", &stopped])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&inspect.stdout).trim(), "0");
}

#[test]
fn a_podman_container_frozen_behind_a_high_neighbour_dies_of_a_sigkill_to_its_process() {
    if !can_run(
        "a_podman_container_frozen_behind_a_high_neighbour_dies_of_a_sigkill_to_its_process",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 112, HIGH_ALLOWED);
    let podman = Podman::new(&dir.path().join("podman"), Some(&service.config));
    let (_, pid) = frozen_behind_high(&podman, &service, "while :; do :; done");
    let started = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let died = wait_until(Duration::from_secs(5), || gone(pid));
    eprintln!("gone {:?} after the SIGKILL", started.elapsed());
    assert!(died, "a frozen process did not die of SIGKILL");
}

#[test]
fn a_containerd_container_frozen_behind_a_high_neighbour_runs_its_sigterm_handler_on_kill() {
    if !can_run_containerd(
        "a_containerd_container_frozen_behind_a_high_neighbour_runs_its_sigterm_handler_on_kill",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 114, HIGH_ALLOWED);
    let c = Containerd::start(Setup {
        gpuplex_config: Some(service.config.clone()),
        cri: false,
    });
    c.run_detached(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=4Gi", "gpuplex.io/priority=high"],
        "high",
        &["sh", "-c", "while :; do :; done"],
    );
    let file = format!("/tmp/term-{}", std::process::id());
    c.run_detached(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=4Gi"],
        "stopped",
        &["sh", "-c", &trapping_loop(&file)],
    );
    let pid = c
        .tasks()
        .into_iter()
        .find(|t| t.id == "stopped")
        .map(|t| t.pid)
        .unwrap();
    assert!(frozen(pid), "{}", service.status());
    let started = Instant::now();
    let out = c.kill("stopped", "SIGTERM");
    assert!(out.status.success(), "{}", text(&out));
    let ran = wait_until(Duration::from_secs(5), || {
        c.rootfs.join(file.trim_start_matches('/')).exists()
    });
    eprintln!(
        "the handler ran {:?} after ctr task kill",
        started.elapsed()
    );
    assert!(ran, "its SIGTERM handler did not run: {}", service.status());
    assert!(c.wait_for_status("stopped", "STOPPED", Duration::from_secs(5)));
    let _ = c
        .ctr_command()
        .args(["task", "kill", "-s", "SIGKILL", "high"])
        .stdin(Stdio::null())
        .output();
}
