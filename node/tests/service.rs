//! The node service with real processes and cgroups (root; no container runtime): busy loops in
//! cgroups the tests make, registered on fake GPUs with the `cpu` activity source.

mod support;

use std::time::{Duration, Instant};

use gpuplex_cgroup::FreezerVersion::{V1, V2};
use serde_json::json;
use support::*;

/// Each process's share of the CPU time all of them got over `over`.
fn shares(groups: &[&TestCgroup], over: Duration) -> Vec<f64> {
    let before: Vec<Duration> = groups.iter().map(|g| g.cpu()).collect();
    std::thread::sleep(over);
    let used: Vec<f64> = groups
        .iter()
        .zip(before)
        .map(|(g, b)| (g.cpu() - b).as_secs_f64())
        .collect();
    let total: f64 = used.iter().sum();
    used.iter().map(|u| u / total).collect()
}

fn check_shares(version: gpuplex_cgroup::FreezerVersion, weights: &[u32]) {
    let service = NodeService::start(Setup::default());
    let mut groups = Vec::new();
    for (i, w) in weights.iter().enumerate() {
        let mut g = TestCgroup::new(version, &format!("share{i}"));
        g.spawn_busy();
        service.register(
            &format!("busy{i}"),
            &g,
            json!({"gpuplex.io/weight": w.to_string()}),
        );
        groups.push(g);
    }
    std::thread::sleep(Duration::from_secs(1));
    let got = shares(&groups.iter().collect::<Vec<_>>(), Duration::from_secs(10));
    let total: u32 = weights.iter().sum();
    for (i, (share, w)) in got.iter().zip(weights).enumerate() {
        let want = *w as f64 / total as f64;
        eprintln!("{version} busy{i}: weight {w}, share {share:.3} (want {want:.3})");
        assert!(
            (share - want).abs() <= 0.10 * want,
            "busy{i} (weight {w}) got {share:.3} of the CPU, want {want:.3} ± 10%: {got:?}"
        );
    }
    let status = service.status();
    assert!(
        status["gpus"][0]["switches"].as_u64().unwrap() > 10,
        "{status}"
    );
}

#[test]
fn shares_follow_the_weights_with_the_v1_freezer() {
    if !can_run("shares_follow_the_weights_with_the_v1_freezer") {
        return;
    }
    let _serial = serial();
    check_shares(V1, &[1, 3]);
}

#[test]
fn shares_follow_the_weights_with_the_v2_freezer() {
    if !can_run("shares_follow_the_weights_with_the_v2_freezer") {
        return;
    }
    if hierarchies().unified.is_none() {
        eprintln!("SKIPPED: shares_follow_the_weights_with_the_v2_freezer: no cgroup2 mount here");
        return;
    }
    let _serial = serial();
    check_shares(V2, &[1, 2]);
}

#[test]
fn a_lone_busy_process_is_never_frozen() {
    if !can_run("a_lone_busy_process_is_never_frozen") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let mut g = TestCgroup::new(V1, "lone");
    g.spawn_busy();
    service.register("lone", &g, json!({"gpuplex.io/gpus": "1"}));
    let start = Instant::now();
    let cpu = g.cpu();
    while start.elapsed() < Duration::from_secs(2) {
        assert!(!g.is_frozen(), "a lone busy process was frozen");
        std::thread::sleep(Duration::from_millis(3));
    }
    let used = (g.cpu() - cpu).as_secs_f64() / start.elapsed().as_secs_f64();
    // Not 1.0: the machine has other work (this test polls every 3 ms, cargo may be building).
    assert!(used > 0.3, "the lone process got {used:.2} of a CPU");
    let c = service.container("lone").unwrap();
    assert_eq!(c["state"], "running", "{c}");
    assert_eq!(c["frozen_seconds"], 0.0, "{c}");
}

#[test]
fn a_process_that_goes_idle_stops_getting_windows() {
    if !can_run("a_process_that_goes_idle_stops_getting_windows") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let mut busy = TestCgroup::new(V1, "stays-busy");
    busy.spawn_busy();
    let mut idle = TestCgroup::new(V1, "goes-idle");
    // Busy for 2 s of wall time, then asleep.
    idle.spawn(
        "end=$(($(date +%s) + 2)); while [ $(date +%s) -lt $end ]; do :; done; exec sleep 1000",
    );
    service.register("stays-busy", &busy, json!({"gpuplex.io/weight": "1"}));
    service.register("goes-idle", &idle, json!({"gpuplex.io/weight": "1"}));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        service.status()["gpus"][0]["switches"].as_u64().unwrap() > 0,
        "both had work: they took turns"
    );
    // Its busy phase ends 2 s of wall time after it started, frozen or not; from then on the
    // first runs alone. (Waiting for "idle" any earlier could catch a sample in which the
    // busy phase was starved of CPU by other tests.)
    std::thread::sleep(Duration::from_millis(1000));
    let alone = wait_until(Duration::from_secs(6), || {
        service.container("goes-idle").unwrap()["state"] == "idle"
    });
    assert!(alone.is_some(), "{}", service.status());
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let cpu = busy.cpu();
    while start.elapsed() < Duration::from_secs(2) {
        assert!(
            !busy.is_frozen(),
            "the busy process was frozen while the other slept"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    let used = (busy.cpu() - cpu).as_secs_f64() / start.elapsed().as_secs_f64();
    assert!(
        used > 0.3,
        "the remaining busy process got {used:.2} of a CPU"
    );
    assert_eq!(service.container("stays-busy").unwrap()["state"], "running");
}

#[test]
fn a_busy_high_priority_process_freezes_normal_ones() {
    if !can_run("a_busy_high_priority_process_freezes_normal_ones") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup {
        policy: "high_priority_outside_kubernetes = true",
        ..Setup::default()
    });
    let mut normal = TestCgroup::new(V1, "normal");
    normal.spawn_busy();
    service.register("normal", &normal, json!({"gpuplex.io/priority": "normal"}));
    std::thread::sleep(Duration::from_millis(300));
    let mut high = TestCgroup::new(V2, "high");
    high.spawn_busy();
    service.register("high", &high, json!({"gpuplex.io/priority": "high"}));
    assert!(
        wait_until(Duration::from_secs(2), || normal.is_frozen()).is_some(),
        "{}",
        service.status()
    );
    let start = Instant::now();
    let cpu = normal.cpu();
    while start.elapsed() < Duration::from_secs(1) {
        assert!(!high.is_frozen(), "a high priority process was frozen");
        assert!(
            normal.is_frozen(),
            "the normal one ran while the high one was busy"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    assert!(normal.cpu() - cpu < Duration::from_millis(30));
    // The high one leaves: the normal one runs again.
    high.kill_all();
    assert!(wait_until(Duration::from_secs(2), || !normal.is_frozen()).is_some());
}

#[test]
fn kill_9_and_restart_recovers_registrations_and_thaws() {
    if !can_run("kill_9_and_restart_recovers_registrations_and_thaws") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V1, "recover-a");
    a.spawn_busy();
    let mut b = TestCgroup::new(V2, "recover-b");
    b.spawn_busy();
    service.register(
        "a",
        &a,
        json!({"gpuplex.io/weight": "1", "gpuplex.io/gpu-memory": "4Gi"}),
    );
    service.register(
        "b",
        &b,
        json!({"gpuplex.io/weight": "2", "gpuplex.io/gpu-memory": "8Gi"}),
    );
    let reserved =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "2Gi"}}));
    assert_eq!(reserved["ok"], true, "{reserved}");
    assert!(wait_until(Duration::from_secs(2), || a.is_frozen() || b.is_frozen()).is_some());
    // Run long enough for a few accounting checkpoints.
    std::thread::sleep(Duration::from_millis(2500));
    let before = service.status();
    let frozen = if a.is_frozen() { &a } else { &b };
    let cpu = frozen.cpu();
    service.kill9();
    // The service is gone: its watchdog thaws what it froze, within a second.
    let thawed = wait_until(Duration::from_secs(1), || !a.is_frozen() && !b.is_frozen());
    assert!(thawed.is_some(), "still frozen 1 s after the service died");
    assert!(
        wait_until(Duration::from_millis(500), || frozen.cpu() > cpu).is_some(),
        "the process frozen before the kill did not run again"
    );
    service.spawn();
    let after = service.status();
    // Accounting carries over from the last checkpoint (once a second): at most about a second
    // of GPU time is lost, none is invented.
    let gpu_seconds = |s: &serde_json::Value| -> f64 {
        s["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["gpu_seconds"].as_f64().unwrap())
            .sum()
    };
    let (was, is) = (gpu_seconds(&before), gpu_seconds(&after));
    assert!(
        is > was - 1.2 && is <= was + 0.6,
        "GPU seconds {was} before, {is} after"
    );
    for key in ["id", "vgpu", "gpus", "memory", "weight", "priority"] {
        let pick = |s: &serde_json::Value| -> Vec<serde_json::Value> {
            s["containers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c[key].clone())
                .collect()
        };
        assert_eq!(pick(&before), pick(&after), "{key}");
    }
    assert_eq!(
        after["reservations"][0]["vgpu"],
        before["reservations"][0]["vgpu"]
    );
    assert_eq!(
        after["gpus"][0]["unreserved"],
        before["gpus"][0]["unreserved"]
    );
    assert_eq!(after["gpus"][0]["unreserved"], json!(2u64 << 30));
    // They take turns again.
    let switches = after["gpus"][0]["switches"].as_u64().unwrap();
    assert!(wait_until(Duration::from_secs(3), || {
        service.status()["gpus"][0]["switches"].as_u64().unwrap() > switches + 2
    })
    .is_some());
}

#[test]
fn sigterm_thaws_everything_and_exits_0() {
    if !can_run("sigterm_thaws_everything_and_exits_0") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V1, "term-a");
    a.spawn_busy();
    let mut b = TestCgroup::new(V2, "term-b");
    b.spawn_busy();
    service.register("a", &a, json!({"gpuplex.io/gpus": "1"}));
    service.register("b", &b, json!({"gpuplex.io/gpus": "1"}));
    assert!(wait_until(Duration::from_secs(2), || a.is_frozen() || b.is_frozen()).is_some());
    let status = service.terminate();
    assert!(status.success(), "{status}");
    assert!(!a.is_frozen() && !b.is_frozen());
    assert!(
        service.log_text().contains("thawed 1 frozen container"),
        "{}",
        service.log_text()
    );
}

#[test]
fn a_reservation_never_attached_lapses_and_frees_its_memory() {
    if !can_run("a_reservation_never_attached_lapses_and_frees_its_memory") {
        return;
    }
    let service = NodeService::start(Setup {
        reservation_ttl: "1s",
        ..Setup::default()
    });
    let reply =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "10Gi"}}));
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(service.status()["gpus"][0]["unreserved"], json!(6u64 << 30));
    let lapsed = wait_until(Duration::from_secs(3), || {
        service.status()["reservations"]
            .as_array()
            .unwrap()
            .is_empty()
    })
    .expect("the reservation lapsed");
    assert!(
        lapsed >= Duration::from_millis(700),
        "lapsed after {lapsed:?}"
    );
    assert_eq!(
        service.status()["gpus"][0]["unreserved"],
        json!(16u64 << 30)
    );
    let saved: Vec<String> = std::fs::read_dir(under(&service, "state"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vgpu-"))
        .collect();
    assert!(saved.is_empty(), "{saved:?}");
}

#[test]
fn racing_registrations_get_different_idle_gpus() {
    if !can_run("racing_registrations_get_different_idle_gpus") {
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let mut groups: Vec<TestCgroup> = (0..2)
        .map(|i| TestCgroup::new(V1, &format!("race{i}")))
        .collect();
    for g in &mut groups {
        g.spawn("exec sleep 1000");
    }
    let gpus: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let service = &service;
                s.spawn(move || {
                    let reply = service.register(
                        &format!("race{i}"),
                        g,
                        json!({"gpuplex.io/gpu-memory": "8Gi"}),
                    );
                    reply["vgpu"]["gpus"][0]["index"].as_u64().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_ne!(gpus[0], gpus[1], "{gpus:?}");
}

#[test]
fn a_registration_that_fits_nowhere_lists_free_memory() {
    if !can_run("a_registration_that_fits_nowhere_lists_free_memory") {
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let mut groups = Vec::new();
    for i in 0..2 {
        let mut g = TestCgroup::new(V1, &format!("nofit-first{i}"));
        g.spawn("exec sleep 1000");
        service.register(
            &format!("first{i}"),
            &g,
            json!({"gpuplex.io/gpu-memory": "10Gi"}),
        );
        groups.push(g);
    }
    let mut h = TestCgroup::new(V1, "nofit2");
    h.spawn("exec sleep 1000");
    let reply = service.ask(&json!({
        "op": "register", "container": "second", "cgroup": h.path.to_str().unwrap(),
        "annotations": {"gpuplex.io/gpu-memory": "12Gi"},
    }));
    assert_eq!(reply["ok"], false);
    let error = reply["error"].as_str().unwrap();
    assert!(error.contains("no GPU can hold"), "{error}");
    assert!(
        error.contains("GPU 0 (Fake A100, 16 GiB): 6 GiB free, 12 GiB needed"),
        "{error}"
    );
    assert!(
        error.contains("GPU 1 (Fake A100, 16 GiB): 6 GiB free, 12 GiB needed"),
        "{error}"
    );
    // Nothing was left behind.
    assert_eq!(service.status()["containers"].as_array().unwrap().len(), 2);
}

#[test]
fn an_exited_container_is_released_within_a_sampling_interval() {
    if !can_run("an_exited_container_is_released_within_a_sampling_interval") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup {
        sample_interval: "50ms",
        ..Setup::default()
    });
    let mut g = TestCgroup::new(V1, "exits");
    g.spawn_busy();
    service.register("exits", &g, json!({"gpuplex.io/gpu-memory": "4Gi"}));
    assert_eq!(
        service.status()["gpus"][0]["unreserved"],
        json!(12u64 << 30)
    );
    g.kill_all();
    let gone = wait_until(Duration::from_secs(2), || {
        service.container("exits").is_none()
    })
    .expect("released");
    eprintln!("released {gone:?} after its processes were killed");
    // One interval (50 ms), plus the time the kernel takes to empty the cgroup and the polling here.
    assert!(
        gone < Duration::from_millis(50 + 100),
        "released after {gone:?}"
    );
    assert_eq!(
        service.status()["gpus"][0]["unreserved"],
        json!(16u64 << 30)
    );
}

#[test]
fn registering_twice_returns_the_same_assignment_and_a_pid_finds_its_cgroup() {
    if !can_run("registering_twice_returns_the_same_assignment_and_a_pid_finds_its_cgroup") {
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 2,
        ..Setup::default()
    });
    let mut g = TestCgroup::new(V1, "bypid");
    let pid = g.spawn("exec sleep 1000");
    let ask = || {
        service.ask(&json!({"op": "register", "container": "c1", "pid": pid, "annotations": {"gpuplex.io/weight": "3"}}))
    };
    let first = ask();
    assert_eq!(first["ok"], true, "{first}");
    // The reply carries what the hook needs to inject the GPU: its device node on the host.
    let gpu = &first["vgpu"]["gpus"][0];
    let device = service.devices[gpu["index"].as_u64().unwrap() as usize]
        .to_str()
        .unwrap();
    assert_eq!(gpu["device"]["path"], device, "{first}");
    assert_eq!(gpu["device"]["major"], 195, "{first}");
    assert_eq!(gpu["fake"], true, "{first}");
    // The same container again gets the same vGPU, without its handle: only the request that
    // reserved a vGPU learns it.
    let handle = first["vgpu"]["handle"]
        .as_str()
        .expect("a handle")
        .to_owned();
    assert_eq!(handle.len(), 32, "{first}");
    let mut without_handle = first.clone();
    without_handle["vgpu"]
        .as_object_mut()
        .unwrap()
        .remove("handle");
    assert_eq!(ask(), without_handle);
    assert_eq!(service.status()["containers"].as_array().unwrap().len(), 1);
    let vgpu = first["vgpu"]["id"].as_str().unwrap().to_owned();
    let file = format!("state/{vgpu}.json");
    let saved = std::fs::read_to_string(under(&service, &file)).unwrap();
    assert!(saved.contains(g.path.to_str().unwrap()), "{saved}");
    // A pid in no cgroup of its own is refused, saying why.
    let reply = service.ask(&json!({"op": "register", "container": "c2", "pid": std::process::id(), "annotations": {"gpuplex.io/gpus": "1"}}));
    assert_eq!(reply["ok"], false, "{reply}");
    // Release by container id, then by vGPU id: the second finds nothing.
    let released = service.ask(&json!({"op": "release", "container": "c1"}));
    assert_eq!(released["vgpu"]["id"], vgpu, "{released}");
    let again = service.ask(&json!({"op": "release", "vgpu": vgpu}));
    assert_eq!(again, json!({"ok": true}));
    let by_handle = service.ask(&json!({"op": "release", "handle": handle}));
    assert_eq!(by_handle, json!({"ok": true}));
    assert!(!under(&service, &file).exists());
}

#[test]
fn every_malformed_request_gets_an_error_reply_and_the_service_carries_on() {
    if !can_run("every_malformed_request_gets_an_error_reply_and_the_service_carries_on") {
        return;
    }
    let service = NodeService::start(Setup::default());
    assert_eq!(mode_of(&service.socket), 0o600);
    for line in [
        "not json",
        "{",
        "[1,2]",
        "{}",
        r#"{"op":"dance"}"#,
        r#"{"op":"register"}"#,
        r#"{"op":"register","container":"x","pid":"12","annotations":{}}"#,
        r#"{"op":"attach","vgpu":"vgpu-99","container":"x","pid":1}"#,
        r#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"x","pid":1}"#,
        r#"{"op":"reserve","annotations":{"gpuplex.io/weight":"0"}}"#,
        r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"lots"}}"#,
        r#"{"op":"register","container":"x","cgroup":"/nonexistent/cgroup","annotations":{"gpuplex.io/gpus":"1"}}"#,
        r#"{"op":"status","extra":true}"#,
        "\u{1}\u{2}\u{3}",
    ] {
        let reply = service.ask_line(line);
        assert_eq!(reply["ok"], false, "{line}: {reply}");
        let error = reply["error"].as_str().unwrap();
        assert!(
            !error.is_empty() && !error.contains('\n'),
            "{line}: {error}"
        );
    }
    // Over the size bound: an error reply, then the connection is closed.
    let long = format!(r#"{{"op":"status","pad":"{}"}}"#, "x".repeat(70 * 1024));
    let reply = service.ask_line(&long);
    assert!(
        reply["error"].as_str().unwrap().contains("over the limit"),
        "{reply}"
    );
    // Several requests on one connection, one of them bad.
    use std::io::{BufRead, BufReader, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(&service.socket).unwrap();
    stream
        .write_all(b"{\"op\":\"status\"}\nnope\n{\"op\":\"status\"}\n")
        .unwrap();
    let replies: Vec<serde_json::Value> = BufReader::new(stream)
        .lines()
        .take(3)
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    assert_eq!(
        replies.iter().map(|r| r["ok"].clone()).collect::<Vec<_>>(),
        vec![json!(true), json!(false), json!(true)]
    );
    assert_eq!(service.status()["node"], "testnode");
}

#[test]
fn without_gpus_the_service_starts_and_refuses_registrations() {
    if !can_run("without_gpus_the_service_starts_and_refuses_registrations") {
        return;
    }
    if gpuplex_node::nvml::NvmlGpus::load().is_ok() {
        eprintln!("SKIPPED: without_gpus_...: NVML loads on this machine");
        return;
    }
    let service = NodeService::start(Setup {
        gpus: 0,
        activity: "auto",
        ..Setup::default()
    });
    let reply = service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpus": "1"}}));
    assert_eq!(reply["ok"], false);
    let error = reply["error"].as_str().unwrap();
    assert!(
        error.starts_with("this node has no GPU to assign: NVML"),
        "{error}"
    );
    let status = service.status();
    assert_eq!(status["activity"], "cpu");
    assert!(status["gpus"].as_array().unwrap().is_empty());
    assert!(
        service.log_text().contains("GPUs: none"),
        "{}",
        service.log_text()
    );
}

#[test]
fn a_bad_configuration_stops_the_service_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpuplex.toml");
    std::fs::write(&config, "[service]\nsample_interval = \"often\"\n").unwrap();
    let out = std::process::Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("line 2 (service.sample_interval)"),
        "{stderr}"
    );
    let out = std::process::Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
        .arg("bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn gpuplexctl_and_the_metrics_endpoint_show_the_real_service() {
    if !can_run("gpuplexctl_and_the_metrics_endpoint_show_the_real_service") {
        return;
    }
    let _serial = serial();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let service = NodeService::start(Setup {
        extra_service: format!("metrics_listen = \"127.0.0.1:{port}\""),
        ..Setup::default()
    });
    let mut a = TestCgroup::new(V1, "ctl-a");
    a.spawn_busy();
    let ctl = |args: &[&str]| {
        std::process::Command::new(gpuplex_integration::bin("gpuplexctl"))
            .arg("--socket")
            .arg(&service.socket)
            .args(args)
            .output()
            .unwrap()
    };
    let out = ctl(&[
        "register",
        "--id",
        "ctl-a",
        "--cgroup",
        a.path.to_str().unwrap(),
        "--annotation",
        "gpuplex.io/gpu-memory=4Gi",
        "--annotation",
        "gpuplex.io/weight=2",
    ]);
    assert!(out.status.success(), "{out:?}");
    let vgpu: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(vgpu["weight"], 2);
    let mut b = TestCgroup::new(V2, "ctl-b");
    b.spawn_busy();
    service.register("ctl-b", &b, json!({}));
    std::thread::sleep(Duration::from_millis(500));

    let out = ctl(&["status"]);
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("fake"), "{table}");
    assert!(
        table.contains("ctl-a") && table.contains("ctl-b"),
        "{table}"
    );

    let out = ctl(&["status", "-o", "json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = &status["gpus"][0];
    for key in [
        "index",
        "uuid",
        "model",
        "memory",
        "fake",
        "holder",
        "containers",
    ] {
        assert!(gpu.get(key).is_some(), "GPU has no {key}: {gpu}");
    }
    assert_eq!(gpu["fake"], true);
    for c in status["containers"].as_array().unwrap() {
        for key in [
            "id",
            "gpus",
            "weight",
            "priority",
            "state",
            "gpu_seconds",
            "wait_seconds",
            "windows",
        ] {
            assert!(c.get(key).is_some(), "container has no {key}: {c}");
        }
        assert!(
            ["running", "frozen", "idle"].contains(&c["state"].as_str().unwrap()),
            "{c}"
        );
    }

    let out = ctl(&["release", "ctl-a"]);
    assert!(out.status.success(), "{out:?}");
    assert!(service.container("ctl-a").is_none());

    use std::io::{Read, Write};
    let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    http.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    // OpenMetrics: a counter family is named without `_total`, its samples with it.
    for metric in [
        "gpuplex_gpu_busy_seconds",
        "gpuplex_gpu_window_switches",
        "gpuplex_container_gpu_seconds",
        "gpuplex_container_wait_seconds",
        "gpuplex_container_frozen_seconds",
    ] {
        assert!(
            body.contains(&format!("# HELP {metric} ")),
            "{metric}: {body}"
        );
        assert!(
            body.contains(&format!("# TYPE {metric} counter")),
            "{metric}: {body}"
        );
        assert!(
            body.contains(&format!("\n{metric}_total{{")),
            "{metric}: {body}"
        );
    }
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(
        body.contains(r#"container="ctl-b""#) && body.contains(r#"Hostname="testnode""#),
        "{body}"
    );
    assert!(body.contains(r#"UUID="GPU-fake-0""#), "{body}");
}

/// Two busy processes on one fake GPU; `a` is made to hold the window, so that the service
/// has no thaw of it pending when the test pauses it. Returns when both have had windows.
fn two_taking_turns(service: &NodeService, a: &TestCgroup, b: &TestCgroup) {
    service.register("held-a", a, json!({"gpuplex.io/weight": "1"}));
    service.register("held-b", b, json!({"gpuplex.io/weight": "1"}));
    let windows = |id: &str| service.container(id).unwrap()["windows"].as_u64().unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || windows("held-a") > 1
            && windows("held-b") > 1)
        .is_some(),
        "they do not take turns: {}",
        service.status()
    );
}

/// Pauses `a` as `runc pause` would (its freezer, by hand) at a moment it holds the window and
/// runs, then holds it on the node socket.
fn pause_and_hold(service: &NodeService, a: &TestCgroup) {
    assert!(
        wait_until(Duration::from_secs(3), || {
            service.status()["gpus"][0]["holder"] == "held-a" && !a.is_frozen()
        })
        .is_some(),
        "{}",
        service.status()
    );
    a.freeze();
    let reply = service.ask(&json!({"op": "hold", "container": "held-a"}));
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["vgpu"]["container"], "held-a", "{reply}");
    assert!(a.is_frozen(), "the hold thawed it");
}

/// For `over`: `a` stays frozen (nobody thaws it) and `b`, once the service has given it the
/// window (the hold may have come while `b` waited, frozen, for its turn), is never frozen again,
/// and runs.
fn check_paused_alone(a: &TestCgroup, b: &TestCgroup, over: Duration) {
    assert!(
        wait_until(Duration::from_secs(1), || !b.is_frozen()).is_some(),
        "the other one was not given the window after the hold"
    );
    let start = Instant::now();
    let cpu = b.cpu();
    while start.elapsed() < over {
        assert!(a.is_frozen(), "the service thawed a held container");
        assert!(
            !b.is_frozen(),
            "the other one was frozen beside a paused one"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    let used = (b.cpu() - cpu).as_secs_f64() / start.elapsed().as_secs_f64();
    assert!(used > 0.3, "the running one got {used:.2} of a CPU");
}

#[test]
fn a_held_container_is_never_thawed_and_rejoins_when_unheld() {
    if !can_run("a_held_container_is_never_thawed_and_rejoins_when_unheld") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V1, "held-a");
    a.spawn_busy();
    let mut b = TestCgroup::new(V1, "held-b");
    b.spawn_busy();
    two_taking_turns(&service, &a, &b);
    pause_and_hold(&service, &a);
    // Holding again, by vGPU id, is the same.
    let vgpu = service.container("held-a").unwrap()["vgpu"].clone();
    let again = service.ask(&json!({"op": "hold", "vgpu": vgpu}));
    assert_eq!(again["ok"], true, "{again}");
    check_paused_alone(&a, &b, Duration::from_secs(2));
    let status = service.status();
    let c = service.container("held-a").unwrap();
    assert_eq!(c["state"], "paused", "{status}");
    assert_eq!(service.container("held-b").unwrap()["state"], "running");
    assert_eq!(status["gpus"][0]["holder"], "held-b", "{status}");
    let saved = std::fs::read_to_string(under(
        &service,
        &format!("state/{}.json", vgpu.as_str().unwrap()),
    ))
    .unwrap();
    let saved: serde_json::Value = serde_json::from_str(&saved).unwrap();
    assert_eq!(saved["held"], true, "{saved}");
    // gpuplexctl shows it.
    let out = std::process::Command::new(gpuplex_integration::bin("gpuplexctl"))
        .arg("--socket")
        .arg(&service.socket)
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("paused"), "{text}");
    // An unknown container gets the usual one-line error, and changes nothing.
    let unknown = service.ask(&json!({"op": "unhold", "container": "nobody"}));
    assert_eq!(unknown["ok"], false, "{unknown}");
    assert!(
        unknown["error"]
            .as_str()
            .unwrap()
            .contains("container nobody is not attached"),
        "{unknown}"
    );
    // Resumed as `runc resume` does, then unheld: both take turns again.
    a.thaw();
    let reply = service.ask(&json!({"op": "unhold", "container": "held-a"}));
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["vgpu"]["container"], "held-a", "{reply}");
    let windows = |id: &str| service.container(id).unwrap()["windows"].as_u64().unwrap();
    let before = (windows("held-a"), windows("held-b"));
    let (mut a_frozen, mut b_frozen) = (false, false);
    let turns = wait_until(Duration::from_secs(3), || {
        a_frozen |= a.is_frozen();
        b_frozen |= b.is_frozen();
        a_frozen && b_frozen && windows("held-a") > before.0 + 2 && windows("held-b") > before.1 + 2
    });
    assert!(turns.is_some(), "{}", service.status());
    assert_ne!(service.container("held-a").unwrap()["state"], "paused");
    let saved = std::fs::read_to_string(under(
        &service,
        &format!("state/{}.json", vgpu.as_str().unwrap()),
    ))
    .unwrap();
    let saved: serde_json::Value = serde_json::from_str(&saved).unwrap();
    assert!(saved.get("held").is_none(), "{saved}");
}

#[test]
fn a_held_container_stays_paused_across_a_restart_and_a_shutdown() {
    if !can_run("a_held_container_stays_paused_across_a_restart_and_a_shutdown") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V1, "held-a");
    a.spawn_busy();
    let mut b = TestCgroup::new(V2, "held-b");
    b.spawn_busy();
    two_taking_turns(&service, &a, &b);
    pause_and_hold(&service, &a);
    // Killed and started again: recovery thaws what gpuplex froze, not what its user paused.
    service.kill9();
    service.spawn();
    assert!(a.is_frozen(), "recovery thawed a held container");
    assert_eq!(service.container("held-a").unwrap()["state"], "paused");
    check_paused_alone(&a, &b, Duration::from_millis(1000));
    // Stopped: the shutdown thaws what gpuplex froze, not what its user paused.
    let status = service.terminate();
    assert!(status.success(), "{status}");
    assert!(a.is_frozen(), "the shutdown thawed a held container");
    assert!(!b.is_frozen());
}

#[test]
fn a_container_held_while_gpuplex_froze_it_is_left_frozen_until_its_user_resumes_it() {
    if !can_run("a_container_held_while_gpuplex_froze_it_is_left_frozen_until_its_user_resumes_it")
    {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V2, "held-a");
    a.spawn_busy();
    let mut b = TestCgroup::new(V1, "held-b");
    b.spawn_busy();
    two_taking_turns(&service, &a, &b);
    // The order a shim keeps: hold first, then `runc pause`; here while `a` waits, frozen by
    // gpuplex. The freeze becomes its user's: no window is ever given back to it.
    assert!(wait_until(Duration::from_secs(3), || a.is_frozen()).is_some());
    let reply = service.ask(&json!({"op": "hold", "container": "held-a"}));
    assert_eq!(reply["ok"], true, "{reply}");
    a.freeze();
    check_paused_alone(&a, &b, Duration::from_secs(2));
    let frozen = service.container("held-a").unwrap()["frozen_seconds"]
        .as_f64()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let later = service.container("held-a").unwrap()["frozen_seconds"]
        .as_f64()
        .unwrap();
    assert_eq!(frozen, later, "a pause is not counted as gpuplex's freeze");
    // Stopped while held: the shutdown leaves it to its user.
    let status = service.terminate();
    assert!(status.success(), "{status}");
    assert!(a.is_frozen(), "the shutdown thawed a held container");
    assert!(
        service.log_text().contains("thawed 0 frozen container"),
        "{}",
        service.log_text()
    );
}
