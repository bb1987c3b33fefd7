//! Fail-open, with real cgroups (root): whatever kills the node service or damages its state, no
//! container stays frozen (issue #12, items 8 to 11), and a running process registered by pid is
//! windowed (item 13).

mod support;

use std::process::Command;
use std::time::Duration;

use gpuplex_cgroup::FreezerVersion::{V1, V2};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::json;
use support::*;

fn signal(pid: u32, signal: Signal) {
    kill(Pid::from_raw(pid as i32), signal).unwrap();
}

/// Three busy cgroups taking turns on one GPU (v1, v2, v1).
fn three_busy(service: &NodeService, name: &str) -> Vec<TestCgroup> {
    let mut cgroups = Vec::new();
    for (i, version) in [V1, V2, V1].into_iter().enumerate() {
        let mut cgroup = TestCgroup::new(version, &format!("{name}-{i}"));
        cgroup.spawn_busy();
        service.register(&format!("{name}-{i}"), &cgroup, json!({}));
        cgroups.push(cgroup);
    }
    let two_frozen = wait_until(Duration::from_secs(3), || {
        cgroups.iter().filter(|c| c.is_frozen()).count() == 2
    });
    assert!(two_frozen.is_some(), "{}", service.status());
    cgroups
}

#[test]
fn kill_9_of_the_service_thaws_everything_it_froze_within_a_second() {
    if !can_run("kill_9_of_the_service_thaws_everything_it_froze_within_a_second") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let cgroups = three_busy(&service, "kill9");
    let watchdog = service.watchdog_pid();
    service.kill9();
    let thawed = wait_until(Duration::from_secs(1), || {
        cgroups.iter().all(|c| !c.is_frozen())
    });
    eprintln!("all thawed {thawed:?} after the kill");
    assert!(thawed.is_some(), "still frozen 1 s after kill -9");
    // Its job done, the watchdog is gone, and a new service starts at once.
    assert!(wait_until(Duration::from_secs(2), || !alive(watchdog)).is_some());
    service.spawn();
    assert_eq!(service.status()["containers"].as_array().unwrap().len(), 3);
}

#[test]
fn a_killed_watchdog_is_started_again() {
    if !can_run("a_killed_watchdog_is_started_again") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let cgroups = three_busy(&service, "rewatch");
    let first = service.watchdog_pid();
    signal(first, Signal::SIGKILL);
    let again = wait_until(Duration::from_secs(2), || service.watchdog_pid() != first);
    assert!(again.is_some(), "{}", service.log_text());
    service.kill9();
    let thawed = wait_until(Duration::from_secs(1), || {
        cgroups.iter().all(|c| !c.is_frozen())
    });
    assert!(thawed.is_some(), "the second watchdog did not thaw them");
}

#[test]
fn an_unreadable_record_of_a_frozen_container_never_leaves_it_frozen() {
    if !can_run("an_unreadable_record_of_a_frozen_container_never_leaves_it_frozen") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup {
        slice: "10s",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "torn");
    // Service and watchdog gone at once (the watchdog stopped first, so that it cannot act).
    let watchdog = service.watchdog_pid();
    signal(watchdog, Signal::SIGSTOP);
    service.kill9();
    signal(watchdog, Signal::SIGKILL);
    let frozen: Vec<&TestCgroup> = cgroups.iter().filter(|c| c.is_frozen()).collect();
    assert_eq!(frozen.len(), 2, "nobody thawed them");
    // Every record torn or turned to garbage, and every copy of one.
    tear_records(&under(&service, "state"));
    tear_records(&under(&service, "state").join("copies"));
    service.spawn();
    assert!(
        cgroups.iter().all(|c| !c.is_frozen()),
        "{}",
        service.log_text()
    );
    let log = service.log_text();
    assert!(log.contains("set aside as"), "{log}");
    assert!(
        log.contains("thawed 2 cgroup(s) the last run left on its frozen list"),
        "{log}"
    );
}

/// Cuts every vGPU record in `dir` short.
fn tear_records(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if name.starts_with("vgpu-") {
            std::fs::write(&path, "{\"format\":1,\"vgpu\":").unwrap();
        }
    }
}

#[test]
fn records_torn_while_the_service_was_down_come_back_from_their_copies() {
    if !can_run("records_torn_while_the_service_was_down_come_back_from_their_copies") {
        return;
    }
    let _serial = serial();
    // Every container counts as working: on a loaded machine the cpu source may see a thawed
    // busy loop idle, and the two-frozen check below is about windows, not activity.
    let mut service = NodeService::start(Setup {
        slice: "10s",
        activity: "always",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "copies");
    let before = service.status();
    service.kill9();
    tear_records(&under(&service, "state"));
    service.spawn();
    let log = service.log_text();
    assert_eq!(log.matches("restored it from its copy").count(), 3, "{log}");
    let after = service.status();
    let vgpus = |s: &serde_json::Value| {
        let mut v: Vec<String> = (s["containers"].as_array().unwrap().iter())
            .map(|c| format!("{} {}", c["vgpu"], c["id"]))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        vgpus(&after),
        vgpus(&before),
        "every container keeps its vGPU"
    );
    assert_eq!(
        after["gpus"][0]["unreserved"],
        before["gpus"][0]["unreserved"]
    );
    // And it is windowed again: two of the three busy ones frozen.
    let two_frozen = wait_until(Duration::from_secs(3), || {
        cgroups.iter().filter(|c| c.is_frozen()).count() == 2
    });
    assert!(two_frozen.is_some(), "{}", service.status());
}

#[test]
fn start_up_never_blocks_on_a_fifo_a_link_or_a_huge_file_in_state_dir() {
    if !can_run("start_up_never_blocks_on_a_fifo_a_link_or_a_huge_file_in_state_dir") {
        return;
    }
    let mut service = NodeService::start(Setup::default());
    assert!(service.terminate().success());
    let state = under(&service, "state");
    nix::unistd::mkfifo(
        &state.join("vgpu-3.json"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    std::os::unix::fs::symlink("/dev/zero", state.join("vgpu-4.json")).unwrap();
    std::fs::remove_file(state.join("frozen.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", state.join("frozen.json")).unwrap();
    let huge = std::fs::File::create(state.join("vgpu-5.json")).unwrap();
    huge.set_len(1 << 30).unwrap();
    // NodeService::spawn waits 10 s for the socket: a start that blocked would fail here.
    let started = std::time::Instant::now();
    service.spawn();
    eprintln!("started in {:?}", started.elapsed());
    let log = service.log_text();
    for name in ["vgpu-3.json", "vgpu-4.json", "vgpu-5.json"] {
        assert!(
            log.contains(&format!("{name}: ")) && log.contains("set aside as"),
            "{name}: {log}"
        );
    }
    assert!(log.contains("the frozen list cannot be read"), "{log}");
    assert_eq!(service.status()["containers"], json!([]));
}

#[test]
fn a_second_service_on_the_same_node_touches_no_cgroup() {
    if !can_run("a_second_service_on_the_same_node_touches_no_cgroup") {
        return;
    }
    let _serial = serial();
    // No window ends while the second instance waits for the lock (5 s): windows of a quarter
    // slice at least, and every container counts as working (on a loaded machine a thawed busy
    // loop may get no CPU time before its first sample, which would end its window early).
    let service = NodeService::start(Setup {
        slice: "100s",
        activity: "always",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "second");
    let frozen: Vec<bool> = cgroups.iter().map(TestCgroup::is_frozen).collect();
    let out = Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
        .args(["serve", "--config"])
        .arg(&service.config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("another gpuplex node service") && stderr.contains("owns this node"),
        "{stderr}"
    );
    assert_eq!(
        cgroups
            .iter()
            .map(TestCgroup::is_frozen)
            .collect::<Vec<_>>(),
        frozen,
        "the second instance thawed or froze something"
    );
    assert_eq!(service.status()["containers"].as_array().unwrap().len(), 3);
}

/// A SIGTERM while a service starts (here: while it waits for a node another service owns; on
/// a slow host, systemd's stop right after its start) is handled, never the default action
/// that kills the process half-started.
#[test]
fn a_sigterm_while_the_service_starts_ends_it_in_order() {
    if !can_run("a_sigterm_while_the_service_starts_ends_it_in_order") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let log = service.dir.path().join("second.log");
    let mut second = Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
        .args(["serve", "--config"])
        .arg(&service.config)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // It is starting, and waits up to 5 s for the node lock the first service holds.
    let starting = wait_until(Duration::from_secs(5), || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("held by another process"))
    });
    assert!(starting.is_some(), "{:?}", std::fs::read_to_string(&log));
    signal(second.id(), Signal::SIGTERM);
    let status = second.wait().unwrap();
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        None,
        "killed by the signal: {said}"
    );
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains("owns this node"), "{said}");
}

#[test]
fn a_running_process_registered_by_pid_is_windowed_from_its_first_sample() {
    if !can_run("a_running_process_registered_by_pid_is_windowed_from_its_first_sample") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let mut cgroups = Vec::new();
    for weight in [1, 2, 3] {
        let mut cgroup = TestCgroup::new(V1, &format!("bypid-{weight}"));
        let pid = cgroup.spawn_busy();
        // gpuplexctl register --pid: the process has been running for a while.
        let out = Command::new(gpuplex_integration::bin("gpuplexctl"))
            .args(["--socket"])
            .arg(&service.socket)
            .args(["register", "--id", &format!("bypid-{weight}"), "--pid"])
            .arg(pid.to_string())
            .args(["--annotation", &format!("gpuplex.io/weight={weight}")])
            .args(["--annotation", "gpuplex.io/gpu-memory=4Gi"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        cgroups.push(cgroup);
    }
    let frozen = wait_until(Duration::from_secs(2), || {
        cgroups.iter().any(|c| c.is_frozen())
    });
    assert!(frozen.is_some(), "never windowed: {}", service.status());
    std::thread::sleep(Duration::from_secs(1));
    let before: Vec<Duration> = cgroups.iter().map(TestCgroup::cpu).collect();
    std::thread::sleep(Duration::from_secs(4));
    let used: Vec<f64> = cgroups
        .iter()
        .zip(&before)
        .map(|(c, b)| (c.cpu() - *b).as_secs_f64())
        .collect();
    let total: f64 = used.iter().sum();
    let shares: Vec<f64> = used.iter().map(|u| u / total).collect();
    eprintln!("shares by CPU time: {shares:.3?} (weights 1:2:3)");
    for (share, fair) in shares.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
        assert!((share - fair).abs() < 0.08, "{shares:?}");
    }
}

/// `containerd-shim-gpuplex-v1 stop --config <the service's> [args]`: its exit status and its
/// one line (stdout, else stderr).
fn stop(service: &NodeService, args: &[&str]) -> (bool, String) {
    let out = Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
        .arg("stop")
        .arg("--config")
        .arg(&service.config)
        .args(args)
        .output()
        .unwrap();
    let text = if out.stdout.is_empty() {
        String::from_utf8_lossy(&out.stderr).into_owned()
    } else {
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    (out.status.success(), text.trim_end().to_string())
}

#[test]
fn stop_ends_the_service_from_outside_and_leaves_nothing_frozen() {
    if !can_run("stop_ends_the_service_from_outside_and_leaves_nothing_frozen") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup {
        slice: "10s",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "stopped");
    let (pid, watchdog) = (service.pid(), service.watchdog_pid());
    let (ok, line) = stop(&service, &[]);
    assert!(ok, "{line}");
    assert!(
        line.starts_with(&format!("stopped the gpuplex node service (pid {pid});")),
        "{line}"
    );
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(cgroups.iter().all(|c| !c.is_frozen()), "{line}");
    // It stopped as on SIGTERM: exit 0; its watchdog is gone too.
    let status = service.child.take().unwrap().wait().unwrap();
    assert!(status.success(), "{status}: {}", service.log_text());
    assert!(!alive(watchdog));
    // Nothing runs now: a second stop says so, and a new service starts at once.
    let (ok, again) = stop(&service, &[]);
    assert!(
        ok && again.starts_with("no gpuplex node service was running on "),
        "{again}"
    );
    service.spawn();
}

#[test]
fn stop_kills_a_service_that_does_not_stop_and_its_watchdog_thaws() {
    if !can_run("stop_kills_a_service_that_does_not_stop_and_its_watchdog_thaws") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup {
        slice: "10s",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "stuck");
    // A stopped process handles no SIGTERM: only SIGKILL ends it.
    let pid = service.pid();
    signal(pid, Signal::SIGSTOP);
    let (ok, line) = stop(&service, &["--timeout", "500ms"]);
    assert!(ok, "{line}");
    assert!(
        line.starts_with(&format!("killed the gpuplex node service (pid {pid})")),
        "{line}"
    );
    assert!(cgroups.iter().all(|c| !c.is_frozen()), "{line}");
    let status = service.child.take().unwrap().wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
}

/// The service and its watchdog killed together, two of three busy cgroups left frozen: `stop
/// ARGS` thaws them, and says no service was running.
fn stop_thaws_after_both_were_killed(name: &str, args: &[&str]) {
    let _serial = serial();
    let mut service = NodeService::start(Setup {
        slice: "10s",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, name);
    let watchdog = service.watchdog_pid();
    signal(watchdog, Signal::SIGSTOP);
    service.kill9();
    signal(watchdog, Signal::SIGKILL);
    assert!(wait_until(Duration::from_secs(2), || !alive(watchdog)).is_some());
    assert_eq!(cgroups.iter().filter(|c| c.is_frozen()).count(), 2);
    let (ok, line) = stop(&service, args);
    assert!(ok, "{line}");
    assert!(
        line.starts_with("no gpuplex node service was running on "),
        "{line}"
    );
    assert!(cgroups.iter().all(|c| !c.is_frozen()), "{line}");
}

#[test]
fn stop_thaws_what_a_service_and_watchdog_killed_together_left_frozen() {
    if !can_run("stop_thaws_what_a_service_and_watchdog_killed_together_left_frozen") {
        return;
    }
    stop_thaws_after_both_were_killed("orphaned", &[]);
}

/// The unit's `ExecStopPost` (`stop --after-exit`) after `systemctl kill --signal=SIGKILL`:
/// the service and its watchdog killed together, nobody signalled, everything thawed.
#[test]
fn stop_after_exit_thaws_what_a_kill_of_the_whole_unit_left_frozen() {
    if !can_run("stop_after_exit_thaws_what_a_kill_of_the_whole_unit_left_frozen") {
        return;
    }
    stop_thaws_after_both_were_killed("unitkill", &["--after-exit", "--timeout", "2s"]);
}

/// `stop --after-exit` signals nobody: a service that still runs (one started by hand while
/// systemd's could not take the lock) keeps running and keeps its windows.
#[test]
fn stop_after_exit_leaves_a_running_service_alone() {
    if !can_run("stop_after_exit_leaves_a_running_service_alone") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup {
        slice: "10s",
        ..Setup::default()
    });
    let cgroups = three_busy(&service, "running");
    let (pid, watchdog) = (service.pid(), service.watchdog_pid());
    let (ok, line) = stop(&service, &["--after-exit", "--timeout", "300ms"]);
    assert!(!ok, "{line}");
    assert!(line.contains("a node service that still runs"), "{line}");
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(alive(pid) && alive(watchdog), "{line}");
    assert_eq!(
        cgroups.iter().filter(|c| c.is_frozen()).count(),
        2,
        "{line}"
    );
}

fn alive(pid: u32) -> bool {
    kill(Pid::from_raw(pid as i32), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}
