//! The plugin binary against the runtime's side of NRI played by the test
//! (`stub_runtime`) and the real node service, with containers' inits in real cgroups (root):
//! the protocol-level tests of the plugin, which run without containerd. The VM's host suite
//! runs it under containerd 1.7 itself (`tests/hosts/checks/80-nri.sh`).

mod stub_runtime;
#[path = "../../node/tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuplex_cgroup::FreezerVersion;
use gpuplex_nri::proto::nri::{Container, ContainerState, Event};
use gpuplex_nri::ttrpc::{INVALID_ARGUMENT, UNIMPLEMENTED};
use stub_runtime::{container, pod, Connection, StubRuntime};
use support::*;

/// gpuplex-nri, running.
struct PluginProcess {
    child: Child,
    log: PathBuf,
}

impl PluginProcess {
    fn start(config: &Path, socket: &Path, log: PathBuf) -> PluginProcess {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(gpuplex_integration::bin("gpuplex-nri"))
            .arg("--config")
            .arg(config)
            .arg("--nri-socket")
            .arg(socket)
            .env("GPUPLEX_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start gpuplex-nri");
        PluginProcess { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A node service, a runtime's socket and the plugin connected to it, ready for events.
struct World {
    node: NodeService,
    runtime: StubRuntime,
    plugin: PluginProcess,
    conn: Connection,
}

impl World {
    fn start(setup: Setup) -> World {
        let node = NodeService::start(setup);
        let runtime = StubRuntime::listen(&node.dir.path().join("nri.sock"));
        let plugin =
            PluginProcess::start(&node.config, &runtime.path, node.dir.path().join("nri.log"));
        let mut conn = runtime
            .accept(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("the plugin did not connect: {}", plugin.log()));
        let registration = conn.ready();
        assert_eq!(
            (
                registration.plugin_name.as_str(),
                registration.plugin_idx.as_str()
            ),
            ("gpuplex", "10")
        );
        World {
            node,
            runtime,
            plugin,
            conn,
        }
    }

    fn reservations(&self) -> usize {
        self.node.status()["reservations"]
            .as_array()
            .map_or(0, Vec::len)
    }

    fn containers(&self) -> Vec<String> {
        (self.node.status()["containers"]
            .as_array()
            .into_iter()
            .flatten())
        .filter_map(|c| c["container"].as_str().or(c["id"].as_str()))
        .map(str::to_owned)
        .collect()
    }
}

/// A container's init in a cgroup of its own, waiting, as `runc init` waits, until it is
/// started; then it runs a busy program (another than the one it ran when attached).
struct Init {
    cgroup: TestCgroup,
    pid: u32,
    gate: PathBuf,
}

impl Init {
    fn new(name: &str, dir: &Path) -> Init {
        let mut cgroup = TestCgroup::new(FreezerVersion::V2, name);
        let gate = dir.join(format!("{name}.gate"));
        nix::unistd::mkfifo(&gate, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let pid = cgroup.spawn(&format!(
            "read x < {}; exec yes > /dev/null",
            gate.display()
        ));
        Init { cgroup, pid, gate }
    }

    /// Lets the container's program start.
    fn start(&self) {
        std::fs::write(&self.gate, "go\n").unwrap();
    }
}

/// The container as NRI describes it at start and after: its spec as the adjustment left it.
fn adjusted(
    mut c: Container,
    adjust_annotations: &BTreeMap<String, String>,
    pid: u32,
) -> Container {
    c.annotations.extend(adjust_annotations.clone());
    c.pid = pid;
    c
}

fn frozen_at_some_point(cgroups: &[&TestCgroup], within: Duration) -> Vec<bool> {
    let mut seen = vec![false; cgroups.len()];
    let deadline = Instant::now() + within;
    while Instant::now() < deadline && !seen.iter().all(|s| *s) {
        for (i, c) in cgroups.iter().enumerate() {
            seen[i] |= c.is_frozen();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    seen
}

#[test]
fn pods_asking_by_annotations_get_their_vgpus_and_take_turns() {
    if !can_run("pods_asking_by_annotations_get_their_vgpus_and_take_turns") {
        return;
    }
    let _serial = serial();
    let mut w = World::start(Setup::default());
    let pod = pod("trainer", &[("gpuplex.io/gpu-memory", "4Gi")]);
    let mut inits = Vec::new();
    let mut created = Vec::new();
    for name in ["nri-a", "nri-b"] {
        let c = container(name, &pod, ContainerState::ContainerCreated);
        let adjust = w.conn.create(&pod, &c).unwrap();
        let devices = &adjust.linux.as_ref().unwrap().devices;
        let gpu = devices
            .iter()
            .find(|d| d.major == 195)
            .unwrap_or_else(|| panic!("no GPU device in {devices:?}"));
        assert_eq!(gpu.r#type, "c");
        let env: BTreeMap<_, _> = adjust
            .env
            .iter()
            .map(|e| (&e.key[..], &e.value[..]))
            .collect();
        assert_eq!(env.get("CUDA_VISIBLE_DEVICES"), Some(&"GPU-fake-0"));
        let identity = adjust
            .mounts
            .iter()
            .find(|m| m.destination == "/run/gpuplex/vgpu.json")
            .expect("the identity mount");
        let file: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&identity.source).unwrap()).unwrap();
        assert_eq!(file["gpus"][0]["uuid"], "GPU-fake-0");
        assert!(adjust.annotations.contains_key("gpuplex.io/vgpu-handle"));
        created.push((c, adjust.annotations.clone()));
    }
    assert_eq!(w.reservations(), 2);
    for (c, annotations) in &created {
        let init = Init::new(&c.id, w.node.dir.path());
        let started = adjusted(c.clone(), annotations, init.pid);
        w.conn
            .state_change(Event::StartContainer, &pod, &started)
            .unwrap_or_else(|e| panic!("start {}: {e:?}\n{}", c.id, w.plugin.log()));
        init.start();
        inits.push(init);
    }
    assert_eq!(w.reservations(), 0);
    let mut attached = w.containers();
    attached.sort();
    assert_eq!(attached, ["nri-a", "nri-b"]);
    let frozen = frozen_at_some_point(
        &[&inits[0].cgroup, &inits[1].cgroup],
        Duration::from_secs(10),
    );
    assert_eq!(
        frozen,
        [true, true],
        "each waited its turn: {}",
        w.node.log_text()
    );

    for (c, annotations) in &created {
        let gone = adjusted(c.clone(), annotations, 0);
        w.conn
            .state_change(Event::StopContainer, &pod, &gone)
            .unwrap();
        w.conn
            .state_change(Event::RemoveContainer, &pod, &gone)
            .unwrap();
    }
    assert!(w.containers().is_empty(), "{}", w.plugin.log());
    for init in &mut inits {
        assert!(!init.cgroup.is_frozen(), "released, yet frozen");
        init.cgroup.kill_all();
    }
}

#[test]
fn refusals_are_one_line_and_leave_nothing_reserved() {
    if !can_run("refusals_are_one_line_and_leave_nothing_reserved") {
        return;
    }
    let mut w = World::start(Setup::default());
    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[("gpuplex.io/gpu-memory", "lots")], "lots"),
        (&[("gpuplex.io/gpu-memory", "64Gi")], "64 GiB needed"),
        // A tenant naming gpuplex's handle or vGPU id.
        (
            &[
                ("gpuplex.io/gpu-memory", "1Gi"),
                ("gpuplex.io/vgpu-handle", "00000000000000000000000000000001"),
            ],
            "gpuplex.io/vgpu-handle",
        ),
        (
            &[("gpuplex.io/allocation", "guess")],
            "gpuplex.io/allocation",
        ),
    ];
    for (annotations, named) in cases {
        let pod = pod("tenant", annotations);
        let c = container("c", &pod, ContainerState::ContainerCreated);
        let (_, message) = w.conn.create(&pod, &c).unwrap_err();
        assert!(message.starts_with("gpuplex: "), "{message}");
        assert!(message.contains(named), "{annotations:?}: {message}");
        assert!(!message.contains('\n'), "{message}");
    }
    assert_eq!(w.reservations(), 0);

    // The protocol's own refusals: an unknown method, a service that is not the plugin's, a
    // body that does not decode. The session goes on.
    let (code, _) = w
        .conn
        .call_raw("nri.pkg.api.v1alpha1.Plugin", "Frobnicate", vec![])
        .unwrap_err();
    assert_eq!(code, UNIMPLEMENTED);
    let (code, _) = w
        .conn
        .call_raw("other.Service", "CreateContainer", vec![])
        .unwrap_err();
    assert_eq!(code, UNIMPLEMENTED);
    let (code, message) = w
        .conn
        .call_raw(
            "nri.pkg.api.v1alpha1.Plugin",
            "CreateContainer",
            vec![0xff; 64],
        )
        .unwrap_err();
    assert_eq!(code, INVALID_ARGUMENT, "{message}");
    assert_eq!(w.conn.configure(), gpuplex_nri::plugin::event_mask());
}

#[test]
fn a_plugin_killed_and_started_again_catches_up_at_synchronisation() {
    if !can_run("a_plugin_killed_and_started_again_catches_up_at_synchronisation") {
        return;
    }
    let _serial = serial();
    let mut w = World::start(Setup::default());
    let pod = pod("serving", &[("gpuplex.io/gpu-memory", "2Gi")]);
    let mut specs = Vec::new();
    for name in ["nri-r1", "nri-r2", "nri-r3"] {
        let c = container(name, &pod, ContainerState::ContainerCreated);
        let adjust = w.conn.create(&pod, &c).unwrap();
        specs.push(adjusted(c, &adjust.annotations, 0));
    }
    // r1 starts while the plugin runs.
    let r1 = Init::new("nri-r1", w.node.dir.path());
    specs[0].pid = r1.pid;
    w.conn
        .state_change(Event::StartContainer, &pod, &specs[0])
        .unwrap();
    r1.start();
    w.plugin.kill9();
    assert!(w.conn.closed_within(Duration::from_secs(5)));

    // Meanwhile r2 starts, and r3 stops without ever starting.
    let r2 = Init::new("nri-r2", w.node.dir.path());
    r2.start();
    specs[0].set_state(ContainerState::ContainerRunning);
    specs[1].pid = r2.pid;
    specs[1].set_state(ContainerState::ContainerRunning);
    specs[2].set_state(ContainerState::ContainerStopped);
    assert_eq!(w.reservations(), 2, "r2's and r3's");

    let mut plugin = PluginProcess::start(
        &w.node.config,
        &w.runtime.path,
        w.node.dir.path().join("nri-2.log"),
    );
    let mut conn = w
        .runtime
        .accept(Duration::from_secs(10))
        .expect("reconnect");
    conn.accept_registration();
    conn.configure();
    conn.synchronize(vec![pod.clone()], specs.clone());
    let mut attached = w.containers();
    attached.sort();
    assert_eq!(attached, ["nri-r1", "nri-r2"], "{}", plugin.log());
    assert_eq!(w.reservations(), 0, "r3's released: {}", plugin.log());
    // Both busy on one GPU: they take turns, and nothing stays frozen once they go.
    let frozen = frozen_at_some_point(&[&r1.cgroup, &r2.cgroup], Duration::from_secs(10));
    assert_eq!(frozen, [true, true]);
    for spec in &specs[..2] {
        conn.state_change(Event::StopContainer, &pod, spec).unwrap();
    }
    assert!(w.containers().is_empty());
    assert!(!r1.cgroup.is_frozen() && !r2.cgroup.is_frozen());
    assert!(plugin.is_running());
    let (mut r1, mut r2) = (r1, r2);
    r1.cgroup.kill_all();
    r2.cgroup.kill_all();
}

#[test]
fn a_runtime_that_breaks_the_protocol_or_restarts_loses_its_session_not_the_plugin() {
    if !can_run("a_runtime_that_breaks_the_protocol_or_restarts_loses_its_session_not_the_plugin") {
        return;
    }
    let mut w = World::start(Setup::default());
    // A frame longer than NRI makes: the session ends, the plugin connects again.
    let mut huge = 1u32.to_be_bytes().to_vec();
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    w.conn.write_raw(&huge);
    assert!(w.conn.closed_within(Duration::from_secs(5)));
    let mut conn = w
        .runtime
        .accept(Duration::from_secs(10))
        .expect("reconnect");
    conn.ready();
    // A ttrpc message longer than ttrpc allows, in small frames.
    let mut message = ((4u32 << 20) + 1).to_be_bytes().to_vec();
    message.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
    conn.write_raw(&gpuplex_nri::mux::frames(1, &message));
    assert!(conn.closed_within(Duration::from_secs(5)));
    let mut conn = w
        .runtime
        .accept(Duration::from_secs(10))
        .expect("reconnect");
    // A refused registration: the plugin tries again.
    conn.refuse_registration("invalid plugin index");
    let mut conn = w
        .runtime
        .accept(Duration::from_secs(10))
        .expect("reconnect");
    conn.ready();

    // The runtime restarts: its socket goes, and comes back a while later.
    let path = w.runtime.path.clone();
    drop(conn);
    let old = std::mem::replace(
        &mut w.runtime,
        StubRuntime::listen(&path.with_extension("x")),
    );
    old.stop();
    std::thread::sleep(Duration::from_secs(1));
    w.runtime = StubRuntime::listen(&path);
    let mut conn = w
        .runtime
        .accept(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the plugin did not come back: {}", w.plugin.log()));
    conn.ready();
    assert!(w.plugin.is_running());
    let pod = pod("after", &[("gpuplex.io/gpu-memory", "1Gi")]);
    let c = container("c", &pod, ContainerState::ContainerCreated);
    conn.create(&pod, &c).unwrap();
    assert_eq!(w.reservations(), 1);
}

#[test]
fn the_plugin_refuses_a_bad_command_line_in_one_line() {
    for (args, says) in [
        (&["--index", "7"][..], "--index"),
        (&["--index", "1a"][..], "--index"),
        (&["--name", "a b"][..], "--name"),
        (&["--bogus"][..], "bogus"),
    ] {
        let out = Command::new(gpuplex_integration::bin("gpuplex-nri"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("gpuplex-nri: ") && first.contains(says),
            "{args:?}: {stderr}"
        );
    }
    let out = Command::new(gpuplex_integration::bin("gpuplex-nri"))
        .args(["--config", "/nonexistent/gpuplex.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("/nonexistent/gpuplex.toml"), "{stderr}");
}

#[test]
fn a_node_service_that_does_not_answer_is_a_refusal_within_the_runtimes_timeout() {
    if !can_run("a_node_service_that_does_not_answer_is_a_refusal_within_the_runtimes_timeout") {
        return;
    }
    let mut w = World::start(Setup::default());
    // The plugin gives the node three quarters of the timeout the runtime said.
    let pid = nix::unistd::Pid::from_raw(w.node.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let pod = pod("stalled", &[("gpuplex.io/gpu-memory", "1Gi")]);
    let c = container("c", &pod, ContainerState::ContainerCreated);
    let began = Instant::now();
    let answer = w.conn.create(&pod, &c);
    let took = began.elapsed();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let (_, message) = answer.unwrap_err();
    let timeout = Duration::from_millis(stub_runtime::REQUEST_TIMEOUT_MS as u64);
    assert!(
        took < timeout,
        "answered after {took:?}, past the runtime's {timeout:?}"
    );
    assert!(
        message.starts_with("gpuplex: ") && !message.contains('\n'),
        "{message}"
    );
    // The session goes on, and so does the node.
    let c = container("d", &pod, ContainerState::ContainerCreated);
    w.conn.create(&pod, &c).unwrap();
}
