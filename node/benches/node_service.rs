//! The node service's costs, measured with real cgroups and processes (root):
//!
//! 1. switch latency: revoke one busy container's window (freeze, confirmed) and grant the next
//!    (thaw), with each freezer version, through the same code the service runs;
//! 2. registration round trip over the node socket (register, then release), p50/p99;
//! 3. the service's CPU with 10 to 1,000 containers, idle ones on 8 GPUs and busy ones contending
//!    for one GPU at 200 ms windows.
//!
//! `cargo build --release --workspace` (it runs the service binary, `containerd-shim-gpuplex-v1`),
//! then `cargo bench -p gpuplex-node --bench node_service` (or `make bench`). Knobs:
//! GPUPLEX_BENCH_SWITCHES (default 1000), GPUPLEX_BENCH_RTTS (1000), GPUPLEX_BENCH_SECONDS (20, per CPU measurement),
//! GPUPLEX_BENCH_ONLY (`cost`: only the CPU measurements), GPUPLEX_BENCH_CASE (`8,100,idle`: only
//! that one).
//! Results go to docs/benchmarks.md by hand, with the machine they ran on.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use gpuplex_cgroup::{freeze_all, FreezerCgroup, FreezerVersion};
use serde_json::json;
use support::*;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quantiles(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    format!(
        "p50 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms  (n = {})",
        q(0.5).as_secs_f64() * 1e3,
        q(0.99).as_secs_f64() * 1e3,
        q(1.0).as_secs_f64() * 1e3,
        samples.len()
    )
}

fn switch_latency(version: FreezerVersion, switches: usize) {
    let h = hierarchies();
    if h.mount_of(version).is_none() {
        println!("switch latency, freezer {version}: SKIPPED (no such hierarchy here)");
        return;
    }
    let mut groups: Vec<TestCgroup> = (0..2)
        .map(|i| TestCgroup::new(version, &format!("bench-switch{i}")))
        .collect();
    for g in &mut groups {
        g.spawn_busy();
    }
    let cgroups: Vec<FreezerCgroup> = groups
        .iter()
        .map(|g| FreezerCgroup::at(&g.path, &h).unwrap())
        .collect();
    cgroups[1].freeze(Duration::from_secs(1)).unwrap();
    let (mut switch, mut freeze, mut thaw) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..switches {
        let (running, waiting) = (&cgroups[i % 2], &cgroups[(i + 1) % 2]);
        // Let the running one run a little, as within a window.
        std::thread::sleep(Duration::from_millis(2));
        let start = Instant::now();
        for r in freeze_all(&[running], Duration::from_secs(1)) {
            r.unwrap();
        }
        let frozen = start.elapsed();
        waiting.thaw().unwrap();
        let total = start.elapsed();
        switch.push(total);
        freeze.push(frozen);
        thaw.push(total - frozen);
    }
    println!("switch latency, freezer {version}: {}", quantiles(switch));
    println!("  of which freeze (confirmed):   {}", quantiles(freeze));
    println!("  of which thaw:                 {}", quantiles(thaw));
}

/// The baseline: the same switch done the way a runtime does it, `runc pause` then `runc resume`,
/// between two runc containers running busy loops. Skipped (saying so) without runc and busybox.
fn runc_switch_baseline(switches: usize) {
    let busybox = std::path::Path::new("/bin/busybox");
    let runc_found = std::process::Command::new("runc")
        .arg("--version")
        .output()
        .is_ok();
    if !busybox.exists() || !runc_found {
        println!("baseline, runc pause + resume: SKIPPED (needs runc and busybox-static: make bench installs them)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/sh")).unwrap();
    let state = dir.path().join("runc-state");
    // No pipes: a detached container keeps runc's stdio, and reading it would never end.
    let runc = |args: &[&str]| {
        let status = std::process::Command::new("runc")
            .arg("--root")
            .arg(&state)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "runc {args:?} failed: {status}");
    };
    let ids: Vec<String> = (0..2)
        .map(|i| format!("gpuplex-bench-{}-{i}", std::process::id()))
        .collect();
    for id in &ids {
        let bundle = dir.path().join(id);
        std::fs::create_dir_all(&bundle).unwrap();
        runc(&["spec", "--bundle", bundle.to_str().unwrap()]);
        let path = bundle.join("config.json");
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        spec["root"] = json!({"path": rootfs, "readonly": false});
        spec["process"]["terminal"] = json!(false);
        spec["process"]["args"] = json!(["sh", "-c", "while :; do :; done"]);
        std::fs::write(&path, spec.to_string()).unwrap();
        runc(&["run", "-d", "--bundle", bundle.to_str().unwrap(), id]);
    }
    runc(&["pause", &ids[1]]);
    let mut switch = Vec::new();
    for i in 0..switches {
        let (running, waiting) = (&ids[i % 2], &ids[(i + 1) % 2]);
        std::thread::sleep(Duration::from_millis(2));
        let start = Instant::now();
        runc(&["pause", running]);
        runc(&["resume", waiting]);
        switch.push(start.elapsed());
    }
    for id in &ids {
        let _ = std::process::Command::new("runc")
            .arg("--root")
            .arg(&state)
            .args(["delete", "-f", id])
            .output();
    }
    println!("baseline, runc pause + resume:  {}", quantiles(switch));
}

fn registration_round_trip(rounds: usize) {
    let service = NodeService::start(Setup::default());
    let mut g = TestCgroup::new(FreezerVersion::V1, "bench-rtt");
    g.spawn("exec sleep 1000");
    let path = g.path.to_str().unwrap().to_string();
    use std::io::{BufRead, BufReader, Write};
    let stream = std::os::unix::net::UnixStream::connect(&service.socket).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    let mut ask = |request: &serde_json::Value| {
        let start = Instant::now();
        writer.write_all(format!("{request}\n").as_bytes()).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let took = start.elapsed();
        let reply: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(reply["ok"], true, "{reply}");
        took
    };
    let (mut register, mut release) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let container = format!("rtt{i}");
        register.push(ask(&json!({
            "op": "register", "container": container, "cgroup": path,
            "annotations": {"gpuplex.io/gpu-memory": "1Gi"},
        })));
        release.push(ask(&json!({"op": "release", "container": container})));
    }
    println!(
        "registration round trip (register, saved to disk): {}",
        quantiles(register)
    );
    println!(
        "release round trip:                                {}",
        quantiles(release)
    );
}

/// The service's CPU, in % of one core, while `count` containers registered as plain cgroups
/// (cpu activity sampled every 50 ms, 200 ms slices) sit on `gpus` fake GPUs, each a busy loop
/// (`busy`) or a sleeping process; measured over `seconds` after 2 s of warm-up.
fn service_cost(gpus: usize, count: usize, busy: bool, seconds: usize) {
    let service = NodeService::start(Setup {
        gpus,
        slice: "200ms",
        sample_interval: "50ms",
        memory: "1000Gi",
        ..Setup::default()
    });
    let kind = if busy { "busy" } else { "idle" };
    let mut groups = Vec::new();
    for i in 0..count {
        let mut g = TestCgroup::new(FreezerVersion::V1, &format!("bench-cost-{kind}{i}"));
        if busy {
            g.spawn_busy();
        } else {
            g.spawn("exec sleep 100000");
        }
        service.register(
            &format!("{kind}{i}"),
            &g,
            json!({"gpuplex.io/gpu-memory": "512Mi"}),
        );
        groups.push(g);
    }
    std::thread::sleep(Duration::from_secs(2));
    let switches = |status: &serde_json::Value| -> u64 {
        status["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["switches"].as_u64().unwrap())
            .sum()
    };
    let before = process_cpu(service.pid());
    let switched_before = switches(&service.status());
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(seconds as u64));
    let used = process_cpu(service.pid()) - before;
    let wall = start.elapsed();
    let switched = switches(&service.status()) - switched_before;
    println!(
        "service CPU, {count:>4} {kind} containers on {gpus} GPU{}: {:>5.2}% of one core over {:.0} s ({switched} switches)",
        if gpus == 1 { " " } else { "s" },
        used.as_secs_f64() / wall.as_secs_f64() * 100.0,
        wall.as_secs_f64()
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too: only measure when asked.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if !can_run("node_service benchmarks") {
        return;
    }
    let _serial = serial();
    let seconds = knob("GPUPLEX_BENCH_SECONDS", 20);
    if std::env::var("GPUPLEX_BENCH_ONLY").as_deref() == Ok("cost") {
        return service_costs(seconds);
    }
    switch_latency(FreezerVersion::V1, knob("GPUPLEX_BENCH_SWITCHES", 1000));
    switch_latency(FreezerVersion::V2, knob("GPUPLEX_BENCH_SWITCHES", 1000));
    runc_switch_baseline(knob("GPUPLEX_BENCH_SWITCHES", 1000) / 5);
    registration_round_trip(knob("GPUPLEX_BENCH_RTTS", 1000));
    service_costs(seconds);
}

fn service_costs(seconds: usize) {
    // One case only: GPUPLEX_BENCH_CASE=GPUS,COUNT,busy|idle (for a profiler to attach to).
    if let Ok(case) = std::env::var("GPUPLEX_BENCH_CASE") {
        let parts: Vec<&str> = case.split(',').collect();
        let (Some(gpus), Some(count), Some(kind)) = (
            parts.first().and_then(|p| p.parse().ok()),
            parts.get(1).and_then(|p| p.parse().ok()),
            parts.get(2),
        ) else {
            panic!("GPUPLEX_BENCH_CASE={case}: expected GPUS,COUNT,busy|idle");
        };
        return service_cost(gpus, count, *kind == "busy", seconds);
    }
    // The targets: 100 idle on 8 GPUs, 50 busy on one; then the curve.
    service_cost(8, 100, false, seconds);
    service_cost(1, 50, true, seconds);
    service_cost(1, 8, true, seconds);
    for count in [10, 1000] {
        service_cost(8, count, false, seconds);
    }
    for count in [10, 100, 1000] {
        service_cost(1, count, true, seconds);
    }
}
