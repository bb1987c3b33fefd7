//! What NRI's way in costs a container's creation (issue #32), measured as the kubelet sees it
//! (root; containerd 1.7 or later on PATH): `CreateContainer` and `StartContainer` through the
//! CRI, under runc's own shim, in three arms of one run, their containers made in turn:
//!
//! - `runc`: a containerd with NRI off, the baseline;
//! - `nri, no vGPU`: a containerd with NRI on and `gpuplex-nri` connected, a pod that asks for
//!   nothing (what the plugin costs every other pod);
//! - `nri, vGPU`: the same containerd, a pod asking `gpuplex.io/gpu-memory: 1Gi` (a vGPU
//!   reserved at create, the adjustment applied, attached at start).
//!
//! Each container is created in its arm's one pod, started, then stopped and removed before the
//! next; the arms take turns, container by container, so that the machine's drift touches each
//! alike. The node service has one fake GPU and the cpu activity source.
//!
//! `cargo build --release --workspace`, then `cargo bench -p gpuplex-nri --bench create`, with
//! containerd 1.7's binaries first on PATH. Knob: GPUPLEX_BENCH_CONTAINERS (per arm, default
//! 40). Results go to docs/benchmarks.md by hand, with the machine they ran on.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::cri::*;
use gpuplex_integration::*;

/// NRI's table in containerd 1.7's config (version 2).
const NRI_PLUGIN: &str = "io.containerd.nri.v1.nri";

/// One arm: its name, its pod's annotations, and what it measured.
struct Arm<'a> {
    name: &'static str,
    cri: &'a Cri,
    pod: Pod<'a>,
    create: Vec<Duration>,
    start: Vec<Duration>,
}

fn containerd(dir: &Path, config: &Path, nri_socket: Option<&Path>) -> Containerd {
    cri_containerd_configured(dir, config, |table| {
        let nri = table_at_mut(table, &["plugins", NRI_PLUGIN]);
        match nri_socket {
            Some(socket) => {
                nri.insert("disable".into(), false.into());
                nri.insert("socket_path".into(), socket.display().to_string().into());
                nri.insert(
                    "plugin_path".into(),
                    dir.join("nri-plugins").display().to_string().into(),
                );
            }
            None => {
                nri.insert("disable".into(), true.into());
            }
        }
    })
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: the create bench needs root (containerd, runc, cgroups)");
        return;
    }
    match containerd_version() {
        Some(v) if v >= (1, 7) => {}
        other => {
            eprintln!(
                "SKIPPED: the create bench needs containerd 1.7 or later (NRI) on PATH; found {other:?}"
            );
            return;
        }
    }
    let containers: usize = std::env::var("GPUPLEX_BENCH_CONTAINERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(40);
    let dir = tempfile::tempdir().unwrap();
    let service = NodeService::start(&dir.path().join("node"), 1, 160, "");
    let plain_dir = dir.path().join("runc");
    let nri_dir = dir.path().join("nri");
    std::fs::create_dir_all(&plain_dir).unwrap();
    std::fs::create_dir_all(&nri_dir).unwrap();
    let socket = nri_dir.join("nri.sock");
    let plain = containerd(&plain_dir, &service.config, None);
    let with_nri = containerd(&nri_dir, &service.config, Some(&socket));
    let log = std::fs::File::create(dir.path().join("nri.log")).unwrap();
    let mut plugin: Child = Command::new(bin("gpuplex-nri"))
        .arg("--config")
        .arg(&service.config)
        .arg("--nri-socket")
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("gpuplex-nri");
    let configured = wait_until(Duration::from_secs(20), || {
        std::fs::read_to_string(dir.path().join("nri.log"))
            .is_ok_and(|l| l.contains("configured by"))
    });
    assert!(configured, "the plugin did not register");

    let plain_cri = Cri::connect(&plain.socket);
    let nri_cri = Cri::connect(&with_nri.socket);
    let run = |cri: &'static Cri, name: &str, annotations: &[(&str, &str)]| {
        cri.run_pod_sandbox(&host_network_pod(name, "bench", annotations), "")
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}"))
    };
    // The clients live as long as the process; the pods borrow them.
    let plain_cri: &'static Cri = Box::leak(Box::new(plain_cri));
    let nri_cri: &'static Cri = Box::leak(Box::new(nri_cri));
    let mut arms = [
        Arm {
            name: "runc (NRI off)",
            cri: plain_cri,
            pod: run(plain_cri, "plain", &[]),
            create: Vec::new(),
            start: Vec::new(),
        },
        Arm {
            name: "runc + gpuplex-nri, no vGPU",
            cri: nri_cri,
            pod: run(nri_cri, "other", &[]),
            create: Vec::new(),
            start: Vec::new(),
        },
        Arm {
            name: "runc + gpuplex-nri, vGPU",
            cri: nri_cri,
            pod: run(nri_cri, "gpu", &[("gpuplex.io/gpu-memory", "1Gi")]),
            create: Vec::new(),
            start: Vec::new(),
        },
    ];
    for i in 0..containers + 2 {
        for arm in &mut arms {
            let mut config = host_network_container("app", BUSYBOX_IMAGE, &["sleep", "3600"], &[]);
            config.metadata.as_mut().unwrap().attempt = i as u32;
            let began = Instant::now();
            let id = (arm.pod.create_container(&config))
                .unwrap_or_else(|e| panic!("{}: CreateContainer: {e}", arm.name));
            let created = began.elapsed();
            let began = Instant::now();
            (arm.cri.start_container(&id))
                .unwrap_or_else(|e| panic!("{}: StartContainer: {e}", arm.name));
            let started = began.elapsed();
            // The first two of each arm warm caches up; they are not counted.
            if i >= 2 {
                arm.create.push(created);
                arm.start.push(started);
            }
            (arm.cri.remove_container(&id, Duration::from_secs(0)))
                .unwrap_or_else(|e| panic!("{}: removing: {e}", arm.name));
        }
    }
    let base_create = {
        let mut v = arms[0].create.clone();
        v.sort();
        quantile(&v, 0.5)
    };
    let base_start = {
        let mut v = arms[0].start.clone();
        v.sort();
        quantile(&v, 0.5)
    };
    println!(
        "{containers} containers per arm; CreateContainer and StartContainer through the CRI, in ms"
    );
    println!(
        "{:<30} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "arm", "create p50", "p90", "ratio", "start p50", "p90", "ratio"
    );
    for arm in &mut arms {
        arm.create.sort();
        arm.start.sort();
        let (c50, c90) = (quantile(&arm.create, 0.5), quantile(&arm.create, 0.9));
        let (s50, s90) = (quantile(&arm.start, 0.5), quantile(&arm.start, 0.9));
        println!(
            "{:<30} {:>10} {:>10} {:>8.2} {:>10} {:>10} {:>8.2}",
            arm.name,
            ms(c50),
            ms(c90),
            c50.as_secs_f64() / base_create.as_secs_f64(),
            ms(s50),
            ms(s90),
            s50.as_secs_f64() / base_start.as_secs_f64()
        );
    }
    for arm in arms {
        let mut pod = arm.pod;
        let _ = pod.remove();
    }
    let _ = plugin.kill();
    let _ = plugin.wait();
    println!(
        "node service afterwards: {:?} (containers, reservations)",
        service.held()
    );
}
