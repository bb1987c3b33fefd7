//! `gpuplexctl` as a user runs it: its exit status, its stdout and stderr, and the request lines
//! it sends, against a fake node service (a unix socket answering canned reply lines). The real
//! service is tested with the service.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::thread;

use gpuplex_ctl::render_status;
use gpuplex_scheduler::node::{
    ContainerState, ContainerStatus, GpuStatus, NodeStatus, ReservationStatus,
};
use gpuplex_scheduler::request::Priority;
use gpuplex_wire::protocol::{parse_request, AssignedGpu, Reply, VgpuReply};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

/// A node service that answers the requests it gets, on any connection, with `replies` in
/// order, and stops listening once they are spent.
struct Fake {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    requests: Arc<Mutex<Vec<String>>>,
}

impl Fake {
    fn start(replies: Vec<String>) -> Fake {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("gpuplex.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        thread::spawn(move || {
            let mut replies = replies.into_iter();
            let mut next = replies.next();
            while next.is_some() {
                let Ok((stream, _)) = listener.accept() else {
                    return;
                };
                let mut writer = stream.try_clone().unwrap();
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    seen.lock().unwrap().push(line);
                    let Some(reply) = next.take() else { break };
                    let _ = writer.write_all(reply.as_bytes());
                    next = replies.next();
                    if next.is_none() {
                        return; // drops the connection and the listener
                    }
                }
            }
        });
        Fake {
            _dir: dir,
            socket,
            requests,
        }
    }

    /// The request lines received so far, parsed.
    fn requests(&self) -> Vec<Value> {
        let lines = self.requests.lock().unwrap().clone();
        lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut all = vec!["--socket", self.socket.to_str().unwrap()];
        all.extend_from_slice(args);
        gpuplexctl(&all, &[])
    }
}

fn gpuplexctl(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuplexctl"));
    command
        .args(args)
        .env_remove("GPUPLEX_SOCKET")
        .env_remove("GPUPLEX_CONFIG");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// Stderr, checked to be exactly one line.
fn one_line_stderr(output: &Output) -> String {
    let stderr = String::from_utf8(output.stderr.clone()).unwrap();
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr:?}");
    assert!(stderr.starts_with("gpuplexctl: "), "{stderr:?}");
    stderr.trim_end().to_string()
}

fn node_status() -> NodeStatus {
    NodeStatus {
        node: "gpu-node-1".into(),
        activity: "cpu".into(),
        cdi: "none: no CDI spec of kind nvidia.com/gpu".into(),
        gpus: vec![GpuStatus {
            index: 0,
            uuid: "GPU-fake-0".into(),
            model: "Fake A100".into(),
            memory: 40 * GIB,
            fake: true,
            capacity: 0,
            healthy: true,
            unreserved: 20 * GIB,
            holder: Some("job-a".into()),
            busy_seconds: 12.5,
            switches: 4,
            containers: vec!["job-a".into(), "job-b".into()],
            reservations: vec!["vgpu-3".into()],
        }],
        containers: vec![
            container("job-a", "vgpu-1", ContainerState::Running),
            container("job-b", "vgpu-2", ContainerState::Frozen),
        ],
        reservations: vec![ReservationStatus {
            vgpu: "vgpu-3".into(),
            gpus: vec![0],
            memory: vec![4 * GIB],
            weight: 1,
            priority: Priority::Normal,
            expires_in_seconds: 25.0,
            claim: None,
        }],
    }
}

fn container(id: &str, vgpu: &str, state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        id: id.into(),
        vgpu: vgpu.into(),
        gpus: vec![0],
        memory: vec![8 * GIB],
        weight: 1,
        priority: Priority::Normal,
        state,
        gpu_seconds: 6.0,
        wait_seconds: 2.0,
        waiting_seconds: if state == ContainerState::Frozen {
            0.5
        } else {
            0.0
        },
        frozen_seconds: 1.5,
        windows: 3,
        lag_seconds: 0.125,
        wait_p50_seconds: 0.25,
        wait_p99_seconds: 0.75,
        pod: Some("trainer".into()),
        namespace: None,
        claim: None,
    }
}

fn status_reply() -> String {
    Reply::Status(Box::new(node_status())).to_line()
}

fn vgpu_reply(id: &str, container: Option<&str>) -> VgpuReply {
    VgpuReply {
        id: id.parse().unwrap(),
        handle: None,
        container: container.map(String::from),
        gpus: vec![AssignedGpu {
            index: 0,
            uuid: "GPU-fake-0".into(),
            model: "Fake A100".into(),
            memory: 8 * GIB,
            device: None,
            fake: false,
        }],
        weight: 2,
        priority: Priority::Normal,
        cdi: None,
    }
}

#[test]
fn usage_errors_exit_2_with_one_line() {
    for (args, names) in [
        (&[][..], "missing a command"),
        (&["frobnicate"], "unknown command `frobnicate`"),
        (&["status", "-o", "yaml"], "-o `yaml`"),
        (
            &["top", "--interval", "5"],
            "--interval: `5` is not a duration",
        ),
        (&["register", "--pid", "3"], "missing --id"),
        (&["register", "--id", "c", "--pid", "abc"], "--pid `abc`"),
        (
            &["register", "--id", "c", "--pid", "3", "--cgroup", "/x"],
            "give one of --pid and --cgroup, not both",
        ),
        (
            &[
                "register",
                "--id",
                "c",
                "--pid",
                "3",
                "--annotation",
                "novalue",
            ],
            "--annotation `novalue`: expected KEY=VALUE",
        ),
        (&["release"], "release: missing the id"),
    ] {
        let output = gpuplexctl(args, &[]);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let line = one_line_stderr(&output);
        assert!(line.contains(names), "{args:?}: {line}");
        assert!(line.ends_with("try `gpuplexctl --help`"), "{line}");
        assert!(output.stdout.is_empty());
    }
}

#[test]
fn help_documents_the_exit_status_and_version_prints() {
    let output = gpuplexctl(&["--help"], &[]);
    assert_eq!(output.status.code(), Some(0));
    let help = stdout(&output);
    for line in [
        "Exit status:",
        "  0  done",
        "  1  the service refused",
        "  2  usage error",
    ] {
        assert!(help.contains(line), "{line}");
    }
    let output = gpuplexctl(&["--version"], &[]);
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        stdout(&output),
        format!("gpuplexctl {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn an_unreachable_socket_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("absent.sock");
    let output = gpuplexctl(&["--socket", socket.to_str().unwrap(), "status"], &[]);
    assert_eq!(output.status.code(), Some(1));
    let line = one_line_stderr(&output);
    let expected = format!(
        "gpuplexctl: cannot reach the gpuplex node service at {}: ",
        socket.display()
    );
    assert!(line.starts_with(&expected), "{line}");
    assert!(line.ends_with("(systemctl status gpuplex)?"), "{line}");
}

#[test]
fn status_prints_the_table() {
    let fake = Fake::start(vec![status_reply()]);
    let output = fake.run(&["status"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let text = stdout(&output);
    assert_eq!(text, render_status(&node_status()));
    assert!(text.starts_with("node gpu-node-1  activity cpu  (fake GPUs)\n"));
    assert!(text.contains("  * job-a  vgpu-1"), "{text}");
    assert!(text.contains("frozen (waiting 0.5s)"), "{text}");
    assert!(text.contains("reserved  vgpu-3"), "{text}");
    assert_eq!(fake.requests(), [json!({"op": "status"})]);
}

#[test]
fn status_json_is_the_status_object() {
    let fake = Fake::start(vec![status_reply()]);
    let output = fake.run(&["status", "-o", "json"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let printed: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(printed, serde_json::to_value(node_status()).unwrap());
}

#[test]
fn the_socket_comes_from_the_environment_or_the_config_file() {
    let fake = Fake::start(vec![status_reply(), status_reply()]);
    let output = gpuplexctl(&["status"], &[("GPUPLEX_SOCKET", &fake.socket)]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpuplex.toml");
    let toml = format!("[service]\nsocket = {:?}\n", fake.socket.to_str().unwrap());
    std::fs::write(&config, toml).unwrap();
    let output = gpuplexctl(&["--config", config.to_str().unwrap(), "status"], &[]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert_eq!(fake.requests().len(), 2);
}

#[test]
fn register_sends_one_request_line_and_prints_the_vgpu() {
    let vgpu = vgpu_reply("vgpu-7", Some("job-1"));
    let reply = Reply::vgpu(vgpu.clone());
    let fake = Fake::start(vec![reply.to_line(), reply.to_line()]);
    let output = fake.run(&[
        "register",
        "--id",
        "job-1",
        "--pid",
        "4242",
        "--annotation",
        "gpuplex.io/gpu-memory=8Gi",
        "--annotation",
        "gpuplex.io/weight=2",
    ]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert_eq!(
        stdout(&output),
        serde_json::to_string_pretty(&vgpu).unwrap() + "\n"
    );
    let output = fake.run(&["register", "--id", "job-2", "--cgroup", "/sys/fs/cgroup/x"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let annotations = json!({"gpuplex.io/gpu-memory": "8Gi", "gpuplex.io/weight": "2"});
    assert_eq!(
        fake.requests(),
        [
            json!({"op": "register", "annotations": annotations, "container": "job-1", "pid": 4242}),
            json!({"op": "register", "annotations": {"gpuplex.io/gpus": "1"},
                   "container": "job-2", "cgroup": "/sys/fs/cgroup/x"}),
        ]
    );
    // The service would read them.
    for line in fake.requests.lock().unwrap().iter() {
        parse_request(line.as_bytes()).unwrap();
    }
}

#[test]
fn a_refusal_exits_1_with_the_service_line() {
    let fake = Fake::start(vec![Reply::refused("no GPU has 80Gi free").to_line()]);
    let output = fake.run(&["register", "--id", "job-1", "--pid", "7"]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(one_line_stderr(&output), "gpuplexctl: no GPU has 80Gi free");
    assert!(output.stdout.is_empty());
}

#[test]
fn release_by_vgpu_or_container() {
    let released = Reply::vgpu(vgpu_reply("vgpu-3", None));
    let nothing = Reply::Done;
    let fake = Fake::start(vec![released.to_line(), nothing.to_line()]);
    let output = fake.run(&["release", "vgpu-3"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert_eq!(stdout(&output), "vgpu-3\n");
    let output = fake.run(&["release", "job-9"]);
    assert_eq!(output.status.code(), Some(1));
    let line = one_line_stderr(&output);
    assert!(
        line.starts_with("gpuplexctl: nothing is registered under `job-9`"),
        "{line}"
    );
    assert_eq!(
        fake.requests(),
        [
            json!({"op": "release", "vgpu": "vgpu-3"}),
            json!({"op": "release", "container": "job-9"}),
        ]
    );
}

#[test]
fn top_refreshes_count_times() {
    let fake = Fake::start(vec![status_reply(), status_reply(), status_reply()]);
    let output = fake.run(&["top", "--count", "2", "--interval", "10ms"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let text = stdout(&output);
    let frames: Vec<&str> = text.split("\x1b[H\x1b[2J").skip(1).collect();
    assert_eq!(frames.len(), 2, "{text:?}");
    for frame in frames {
        let (header, table) = frame.split_once('\n').unwrap();
        assert!(
            header.starts_with("gpuplexctl top  every 10ms  "),
            "{header}"
        );
        assert!(header.ends_with(" UTC"), "{header}");
        assert_eq!(table, render_status(&node_status()));
    }
    assert_eq!(fake.requests().len(), 2);
}

#[test]
fn top_exits_1_when_the_service_goes_away() {
    let fake = Fake::start(vec![status_reply()]);
    let output = fake.run(&["top", "--count", "5", "--interval", "10ms"]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    one_line_stderr(&output);
    assert_eq!(stdout(&output).matches("\x1b[H\x1b[2J").count(), 1);
}

#[test]
fn timeline_draws_the_services_window_events() {
    use gpuplex_wire::protocol::{EventLine, EventsReply};
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let event = |seq: u64, ago_ms: u64, container: &str| EventLine {
        seq,
        at_ms: now_ms - ago_ms,
        gpu: 0,
        vgpu: Some(gpuplex_scheduler::VgpuId(seq)),
        container: Some(container.into()),
    };
    let reply = Reply::Events(EventsReply {
        first: 1,
        events: vec![event(1, 20_000, "job-a"), event(2, 10_000, "job-b")],
    });
    let fake = Fake::start(vec![reply.to_line()]);
    let output = fake.run(&["timeline", "--since", "30s"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let text = stdout(&output);
    assert!(
        text.starts_with("window holders over the last 30s"),
        "{text}"
    );
    let row = |name: &str| {
        let line = text.lines().find(|l| l.trim_start().starts_with(name));
        line.unwrap_or_else(|| panic!("{name}: {text}")).to_owned()
    };
    // job-a from 10 s into the drawing to 20 s; job-b from 20 s on (100 columns of 300 ms).
    let a = row("job-a");
    let b = row("job-b");
    assert!(
        a.matches('█').count() >= 32 && a.matches('█').count() <= 35,
        "{text}"
    );
    assert!(
        b.matches('█').count() >= 32 && b.matches('█').count() <= 35,
        "{text}"
    );
    assert_eq!(fake.requests(), [json!({"op": "events", "since": 0})]);
    let fake = Fake::start(vec![reply.to_line()]);
    let output = fake.run(&["timeline", "-o", "svg"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let image = stdout(&output);
    assert!(
        image.starts_with("<svg ") && image.trim_end().ends_with("</svg>"),
        "{image}"
    );
    assert_eq!(image.matches("<rect ").count(), 2, "{image}");
    let fake = Fake::start(vec![reply.to_line()]);
    let output = fake.run(&["timeline", "--since", "15s", "-o", "json"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let events: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    // job-a held GPU 0 when the 15 s began; job-b took it within them.
    let holders: Vec<&str> = (events["events"].as_array().unwrap().iter())
        .map(|e| e["container"].as_str().unwrap())
        .collect();
    assert_eq!(holders, ["job-a", "job-b"], "{events}");
    assert_eq!(events["events"][1]["at_ms"], json!(now_ms - 10_000));
    let bad = gpuplexctl(&["timeline", "-o", "png"], &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(one_line_stderr(&bad).contains("expected text, svg or json"));
    let bad = gpuplexctl(&["timeline", "--since", "2h"], &[]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(one_line_stderr(&bad).contains("--since `2h`"));
}
