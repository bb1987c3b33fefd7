//! The node service's trust boundary, attacked through its socket with real cgroups (root):
//! cgroups it must never freeze as a container's (issue #12, items 4 and 5), state files that
//! name them, handles and ids.

mod support;

use gpuplex_cgroup::FreezerVersion::{self, V1};
use serde_json::{json, Value};
use support::*;

/// A reservation of 4 GiB; its handle.
fn reserve(service: &NodeService) -> String {
    let reply =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "4Gi"}}));
    assert_eq!(reply["ok"], true, "{reply}");
    reply["vgpu"]["handle"]
        .as_str()
        .expect("a handle")
        .to_owned()
}

/// The ids of the containers a status lists.
fn attached(status: &Value) -> Vec<&str> {
    status["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect()
}

fn refused(reply: &Value, because: &str) {
    assert_eq!(reply["ok"], false, "{reply}");
    let error = reply["error"].as_str().unwrap();
    assert!(error.contains(because), "{error}");
    assert!(!error.contains('\n'), "{error}");
}

#[test]
fn attach_refuses_a_cgroup_enforced_already_or_nested_with_one() {
    if !can_run("attach_refuses_a_cgroup_enforced_already_or_nested_with_one") {
        return;
    }
    let service = NodeService::start(Setup::default());
    let mut victim = TestCgroup::new(V1, "enforced");
    let victim_pid = victim.spawn("exec sleep 1000");
    service.register("victim", &victim, json!({}));
    let mut inner = TestCgroup::nested(&victim, "inner");
    let inner_pid = inner.spawn("exec sleep 1000");
    let mut outer = TestCgroup::new(V1, "outer");
    let mut below = TestCgroup::nested(&outer, "below");
    below.spawn("exec sleep 1000");
    let outer_pid = outer.spawn("exec sleep 1000");
    service.register("below", &below, json!({}));
    let handle = reserve(&service);
    // The victim's own cgroup, by its init's pid: two vGPUs would freeze one cgroup.
    let reply = service.ask(&json!({"op": "attach", "handle": handle, "container": "thief", "pid": victim_pid, "unstarted": true}));
    refused(&reply, "is already the cgroup of");
    // A cgroup inside it, or one above another's.
    let reply = service
        .ask(&json!({"op": "attach", "handle": handle, "container": "thief", "pid": inner_pid}));
    refused(&reply, "is inside");
    let reply = service
        .ask(&json!({"op": "attach", "handle": handle, "container": "thief", "pid": outer_pid}));
    refused(&reply, "is above");
    // register makes the same check.
    let reply = service.ask(&json!({"op": "register", "container": "thief", "pid": victim_pid, "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
    refused(&reply, "is already the cgroup of");
    // Nothing was taken: the reservation still waits, the victim is attached once.
    let status = service.status();
    assert_eq!(
        status["reservations"].as_array().unwrap().len(),
        1,
        "{status}"
    );
    let containers = attached(&status);
    assert_eq!(containers, ["victim", "below"], "{status}");
}

#[test]
fn a_cgroup_that_holds_the_service_or_its_watchdog_is_never_a_containers() {
    if !can_run("a_cgroup_that_holds_the_service_or_its_watchdog_is_never_a_containers") {
        return;
    }
    let service = NodeService::start(Setup::default());
    let (pid, watchdog) = (service.pid(), service.watchdog_pid());
    let slice = TestCgroup::new(V1, "slice");
    let unit = TestCgroup::nested(&slice, "gpuplex.service");
    unit.adopt(pid);
    let watchdogs = TestCgroup::new(V1, "watchdogs");
    watchdogs.adopt(watchdog);
    for (cgroup, because) in [
        (&slice, "holds the gpuplex node service or its watchdog"),
        (&unit, "holds the gpuplex node service or its watchdog"),
        (&watchdogs, "holds the gpuplex node service or its watchdog"),
    ] {
        let reply = service.ask(&json!({"op": "register", "container": "x", "cgroup": cgroup.path, "annotations": {"gpuplex.io/gpus": "1"}}));
        refused(&reply, because);
    }
    // By pid too: the service's, the watchdog's.
    for target in [pid, watchdog] {
        let reply = service.ask(&json!({"op": "register", "container": "x", "pid": target, "annotations": {"gpuplex.io/gpus": "1"}}));
        refused(&reply, "holds the gpuplex node service or its watchdog");
    }
    // A hierarchy's root is no container's either.
    let root = freezer_root(slice.version);
    let reply = service.ask(&json!({"op": "register", "container": "x", "cgroup": root, "annotations": {"gpuplex.io/gpus": "1"}}));
    refused(&reply, "not the mount itself");
    // The service still answers, holds nothing, and nothing of it was frozen.
    assert_eq!(service.status()["containers"], json!([]));
    assert!(!slice.is_frozen() && !unit.is_frozen() && !watchdogs.is_frozen());
    unit.release(pid);
    watchdogs.release(watchdog);
}

/// A record as the service saves it, attached to `freezer` (a path of `version`) by cgroup.
fn record(vgpu: &str, freezer: &str, version: FreezerVersion) -> Value {
    let version = match version {
        FreezerVersion::V1 => "v1",
        FreezerVersion::V2 => "v2",
    };
    json!({
        "format": 1,
        "vgpu": vgpu,
        "handle": "00112233445566778899aabbccddeeff",
        "annotations": {"gpuplex.io/gpus": "1", "gpuplex.io/gpu-memory": "1Gi"},
        "gpus": [{"index": 0, "uuid": "GPU-fake-0"}],
        "reserved_at_unix_ms": 0,
        "attachment": {
            "container": format!("planted-{vgpu}"),
            "pid": null,
            "cgroup": freezer,
            "freezer": {"version": version, "path": freezer}
        }
    })
}

#[test]
fn a_state_file_naming_a_cgroup_the_service_may_not_freeze_is_dropped_at_recovery() {
    if !can_run("a_state_file_naming_a_cgroup_the_service_may_not_freeze_is_dropped_at_recovery") {
        return;
    }
    let mut service = NodeService::start(Setup::default());
    assert!(service.terminate().success());
    let mut busy = TestCgroup::new(V1, "planted");
    busy.spawn_busy();
    let root = freezer_root(busy.version);
    let climbing = format!("{}/../../../../etc", busy.path.display());
    let planted = [
        ("vgpu-5", root.display().to_string()),
        ("vgpu-6", climbing),
        ("vgpu-7", busy.path.display().to_string()),
    ];
    let mut files = Vec::new();
    for (vgpu, freezer) in &planted {
        let file = under(&service, &format!("state/{vgpu}.json"));
        std::fs::write(&file, record(vgpu, freezer, busy.version).to_string()).unwrap();
        files.push(file);
    }
    // The same cgroup a second time, under another vGPU: only one of them is recovered.
    let mut twice = record("vgpu-8", &busy.path.display().to_string(), busy.version);
    twice["handle"] = json!("ffeeddccbbaa99887766554433221100");
    twice["attachment"]["container"] = json!("planted-again");
    std::fs::write(under(&service, "state/vgpu-8.json"), twice.to_string()).unwrap();
    service.spawn();
    let status = service.status();
    let containers = attached(&status);
    assert_eq!(containers, ["planted-vgpu-7"], "{status}");
    let log = service.log_text();
    assert!(log.contains("vgpu-5: not recovered"), "{log}");
    assert!(log.contains("vgpu-6: not recovered"), "{log}");
    assert!(log.contains("vgpu-8: not recovered"), "{log}");
    assert!(!files[0].exists() && !files[1].exists());
}

#[test]
fn vgpu_ids_never_repeat_even_when_the_state_is_lost() {
    if !can_run("vgpu_ids_never_repeat_even_when_the_state_is_lost") {
        return;
    }
    let mut service = NodeService::start(Setup::default());
    let first =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
    let first_id = first["vgpu"]["id"].as_str().unwrap().to_owned();
    let released = service.ask(&json!({"op": "release", "handle": first["vgpu"]["handle"]}));
    assert_eq!(released["vgpu"]["id"], first_id.as_str(), "{released}");
    let second =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
    let second_id = second["vgpu"]["id"].as_str().unwrap().to_owned();
    assert!(service.terminate().success());
    // Started again with its state directory gone (wiped by hand, or a new tmpfs).
    std::fs::remove_dir_all(under(&service, "state")).unwrap();
    service.spawn();
    let third =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
    let third_id = third["vgpu"]["id"].as_str().unwrap().to_owned();
    let number = |id: &str| id.trim_start_matches("vgpu-").parse::<u64>().unwrap();
    assert!(
        number(&first_id) < number(&second_id) && number(&second_id) < number(&third_id),
        "{first_id} {second_id} {third_id}"
    );
    // Handles are 128 random bits, never the id.
    let handles: Vec<&str> = [&first, &second, &third]
        .iter()
        .map(|r| r["vgpu"]["handle"].as_str().unwrap())
        .collect();
    assert!(handles.iter().all(|h| h.len() == 32 && !h.contains("vgpu")));
    assert!(handles[0] != handles[1] && handles[1] != handles[2]);
}

/// How a flooding connection behaves.
#[derive(Clone, Copy)]
enum Flood {
    /// Connects and sends nothing.
    Idle,
    /// Sends a space every half second: a request that never ends.
    Trickle,
    /// Sends 300 requests and never reads a reply: the service's writes block.
    Deaf,
}

/// Processes that each open `per_process` connections to the socket and hold them, behaving
/// as `how`.
fn flood(
    socket: &std::path::Path,
    processes: usize,
    per_process: usize,
    how: Flood,
) -> Vec<std::process::Child> {
    const SCRIPT: &str = r#"
import socket, sys, time
conns = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    conns.append(s)
    if sys.argv[3] == 'deaf':
        s.setblocking(False)
        try:
            s.send(b'{"op":"status"}\n' * 300)
        except OSError:
            pass
print('ready', flush=True)
while True:
    time.sleep(0.5)
    if sys.argv[3] == 'trickle':
        for s in conns:
            try:
                s.send(b' ')
            except OSError:
                pass
"#;
    let how = match how {
        Flood::Idle => "idle",
        Flood::Trickle => "trickle",
        Flood::Deaf => "deaf",
    };
    (0..processes)
        .map(|_| {
            let mut child = std::process::Command::new("python3")
                .args(["-c", SCRIPT])
                .arg(socket)
                .arg(per_process.to_string())
                .arg(how)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("python3 runs");
            let mut ready = String::new();
            use std::io::BufRead;
            std::io::BufReader::new(child.stdout.as_mut().unwrap())
                .read_line(&mut ready)
                .unwrap();
            assert_eq!(ready.trim(), "ready");
            child
        })
        .collect()
}

#[test]
fn a_flood_of_idle_trickling_and_deaf_connections_locks_no_client_out() {
    if !can_run("a_flood_of_idle_trickling_and_deaf_connections_locks_no_client_out") {
        return;
    }
    let service = NodeService::start(Setup::default());
    // 8 processes × 16 connections that ask and never read the replies (alone enough to fill
    // the 128 slots), 4 × 16 idle ones, 2 × 16 trickling ones.
    let mut flooders = flood(&service.socket, 8, 16, Flood::Deaf);
    flooders.extend(flood(&service.socket, 4, 16, Flood::Idle));
    flooders.extend(flood(&service.socket, 2, 16, Flood::Trickle));
    let mut slowest = std::time::Duration::ZERO;
    let mut cgroup = TestCgroup::new(V1, "flooded");
    cgroup.spawn("exec sleep 1000");
    for round in 0..5 {
        let asked = std::time::Instant::now();
        let reply = service.ask(&json!({"op": "status"}));
        slowest = slowest.max(asked.elapsed());
        assert_eq!(reply["ok"], true, "round {round}: {reply}");
        // And what the hooks and the shim do.
        let registered = service.ask(&json!({"op": "register", "container": format!("c{round}"), "cgroup": cgroup.path, "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
        assert!(
            registered["ok"] == true
                || registered["error"]
                    .as_str()
                    .unwrap_or("")
                    .contains("already the cgroup"),
            "round {round}: {registered}"
        );
        let released = service.ask(&json!({"op": "release", "container": format!("c{round}")}));
        assert_eq!(released["ok"], true, "{released}");
    }
    eprintln!("status answered within {slowest:?} under the flood");
    for mut f in flooders {
        let _ = f.kill();
        let _ = f.wait();
    }
}
