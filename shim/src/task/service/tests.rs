//! The task service as containerd sees it, without root and without containerd: the service is
//! served over ttrpc on a socket of its own and called through containerd's generated client;
//! behind it, a stub runtime whose processes are numbers and an event publisher that records.
//! Each test states what containerd's runc shim answers (its task service, containerd 1.6).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use containerd_shim::api::{
    CloseIORequest, ConnectRequest, CreateTaskRequest, DeleteRequest, ExecProcessRequest,
    KillRequest, PidsRequest, ResizePtyRequest, ShutdownRequest, StartRequest, StateRequest,
    WaitRequest, WaitResponse,
};
use containerd_shim::protos::events::task::{TaskExit, TaskOOM};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::{Message, MessageDyn, MessageField};
use containerd_shim::protos::shim::oci::ProcessDetails;
use containerd_shim::protos::shim_sync::{create_task, TaskClient};
use containerd_shim::protos::ttrpc::context::Context;
use containerd_shim::protos::ttrpc::{self, Code, Server};
use containerd_shim::protos::types::task::Status;
use containerd_shim::ExitSignal;
use oci_spec::runtime::{LinuxResources, Process};
use runc::options::{CreateOpts, ExecOpts};

use super::TaskService;
use crate::task::events::{EventSink, Publish, PublishError};
use crate::task::runtime::{OciRuntime, RuntimeError, RuntimeFor};
use vgpu::StubNode;

/// What happened, in order: the runtime's calls and the events published.
#[derive(Debug, Default)]
struct Journal {
    lines: Mutex<Vec<String>>,
    grew: Condvar,
}

impl Journal {
    fn write(&self, line: String) {
        self.lines.lock().unwrap().push(line);
        self.grew.notify_all();
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The lines so far, once one of them starts with `prefix` (at most 5 s).
    fn after(&self, prefix: &str) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        let (lines, _) = self
            .grew
            .wait_timeout_while(lines, Duration::from_secs(5), |l| {
                !l.iter().any(|line| line.starts_with(prefix))
            })
            .unwrap();
        assert!(
            lines.iter().any(|line| line.starts_with(prefix)),
            "no {prefix:?} in {lines:#?}"
        );
        lines.clone()
    }

    fn events(&self) -> Vec<String> {
        let lines = self.lines();
        lines.into_iter().filter(|l| l.starts_with('/')).collect()
    }
}

/// The event publisher: each event as one journal line (`/tasks/exit c1 e1 137`).
struct Recorder(Arc<Journal>);

impl Publish for Recorder {
    fn publish(
        &mut self,
        topic: &str,
        _: &str,
        event: &dyn MessageDyn,
    ) -> Result<(), PublishError> {
        let what = if let Some(exit) = event.downcast_ref::<TaskExit>() {
            format!(" {} {} {}", exit.container_id, exit.id, exit.exit_status)
        } else if let Some(oom) = event.downcast_ref::<TaskOOM>() {
            format!(" {}", oom.container_id)
        } else {
            String::new()
        };
        self.0.write(format!("{topic}{what}"));
        Ok(())
    }
}

/// A runtime whose processes are numbers above any real pid: what it is asked is journalled;
/// a verb set in `failing` fails with that message, as runc's log would say it.
struct Stub {
    journal: Arc<Journal>,
    next_pid: AtomicU32,
    failing: Mutex<HashMap<&'static str, String>>,
    /// Exits reaped as soon as an exec starts, as a `true` exec's would be.
    quick_execs: Mutex<Option<i32>>,
    /// The environment of the last exec started.
    exec_env: Mutex<Vec<String>>,
    reaper: OnceLock<TaskService>,
}

impl std::fmt::Debug for Stub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stub")
            .field("journal", &self.journal)
            .finish()
    }
}

/// Above `pid_max` (at most 2^22): no signal of the tests can reach a real process.
const FIRST_PID: u32 = 1 << 30;

impl Stub {
    fn new(journal: Arc<Journal>) -> Arc<Stub> {
        Arc::new(Stub {
            journal,
            next_pid: AtomicU32::new(FIRST_PID),
            failing: Mutex::new(HashMap::new()),
            quick_execs: Mutex::new(None),
            exec_env: Mutex::new(Vec::new()),
            reaper: OnceLock::new(),
        })
    }

    fn fail(&self, verb: &'static str, why: &str) {
        self.failing.lock().unwrap().insert(verb, why.to_owned());
    }

    fn heal(&self, verb: &'static str) {
        self.failing.lock().unwrap().remove(verb);
    }

    fn call(&self, verb: &'static str, line: String) -> Result<(), RuntimeError> {
        self.journal.write(line);
        match self.failing.lock().unwrap().get(verb) {
            Some(why) => Err(RuntimeError(why.clone())),
            None => Ok(()),
        }
    }

    fn new_pid(&self, pid_file: &Option<PathBuf>) -> u32 {
        let pid = self.next_pid.fetch_add(1, Ordering::SeqCst);
        std::fs::write(pid_file.as_ref().expect("a pid file"), pid.to_string()).unwrap();
        pid
    }
}

impl OciRuntime for Stub {
    fn create(&self, id: &str, _: &Path, opts: &CreateOpts) -> Result<(), RuntimeError> {
        self.call("create", format!("create {id}"))?;
        self.new_pid(&opts.pid_file);
        Ok(())
    }

    fn start(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("start", format!("start {id}"))
    }

    fn exec(&self, id: &str, process: &Process, opts: &ExecOpts) -> Result<(), RuntimeError> {
        let args = process.args().clone().unwrap_or_default().join(" ");
        self.call("exec", format!("exec {id} {args}"))?;
        *self.exec_env.lock().unwrap() = process.env().clone().unwrap_or_default();
        let pid = self.new_pid(&opts.pid_file);
        if let Some(code) = *self.quick_execs.lock().unwrap() {
            let service = self.reaper.get().expect("the service").clone();
            std::thread::spawn(move || service.exited(pid as i32, code));
        }
        Ok(())
    }

    fn kill(&self, id: &str, signal: u32, all: bool) -> Result<(), RuntimeError> {
        let all = if all { " all" } else { "" };
        self.call("kill", format!("kill {id} {signal}{all}"))
    }

    fn signal(&self, pid: u32, signal: u32) -> Result<(), RuntimeError> {
        self.call("signal", format!("signal {pid} {signal}"))
    }

    fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("pause", format!("pause {id}"))
    }

    fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("resume", format!("resume {id}"))
    }

    fn ps(&self, id: &str) -> Result<Vec<u32>, RuntimeError> {
        self.call("ps", format!("ps {id}"))?;
        let issued = self.next_pid.load(Ordering::SeqCst);
        Ok((FIRST_PID..issued).collect())
    }

    fn update(&self, id: &str, _: &LinuxResources) -> Result<(), RuntimeError> {
        self.call("update", format!("update {id}"))
    }

    fn delete(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("delete", format!("delete {id}"))
    }
}

/// A shim: the service on its socket, a client of it, and what is behind it.
struct Shim {
    client: TaskClient,
    service: TaskService,
    stub: Arc<Stub>,
    node: Arc<StubNode>,
    journal: Arc<Journal>,
    exit: Arc<ExitSignal>,
    dir: tempfile::TempDir,
    _server: Server,
}

/// A config.json whose init has a PID namespace of its own, or shares the host's.
fn config(own_pid_namespace: bool) -> String {
    let namespaces = if own_pid_namespace {
        r#"[{"type": "pid"}, {"type": "mount"}]"#
    } else {
        r#"[{"type": "mount"}]"#
    };
    format!(
        r#"{{"ociVersion": "1.0.2", "process": {{"args": ["sh"], "cwd": "/", "user": {{"uid": 0, "gid": 0}}}},
            "root": {{"path": "rootfs"}}, "linux": {{"namespaces": {namespaces}}}}}"#
    )
}

fn ctx() -> Context {
    Context::default()
}

/// A failed call's code and message, as containerd's client gets them.
fn status<T: std::fmt::Debug>(result: ttrpc::Result<T>) -> (Code, String) {
    match result {
        Err(ttrpc::Error::RpcStatus(s)) => (s.code(), s.message().to_owned()),
        other => panic!("not a refusal: {other:?}"),
    }
}

impl Shim {
    fn new() -> Shim {
        let journal = Arc::new(Journal::default());
        let stub = Stub::new(Arc::clone(&journal));
        let runtime = Arc::clone(&stub);
        let runtime_for: RuntimeFor = Arc::new(move |_, _, _| Ok(runtime.clone() as _));
        const NOW: [Duration; 0] = [];
        let events = EventSink::new(Recorder(Arc::clone(&journal)), "default".into(), &NOW);
        let exit = Arc::new(ExitSignal::default());
        let node = StubNode::new(Arc::clone(&journal));
        let service = TaskService::with_parts(
            events,
            runtime_for,
            Arc::clone(&node) as _,
            "default",
            Arc::clone(&exit),
        );
        assert!(stub.reaper.set(service.clone()).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let socket = format!("unix://{}", dir.path().join("shim.sock").display());
        let mut server = Server::new()
            .bind(&socket)
            .unwrap()
            .register_service(create_task(Arc::new(service.clone())));
        server.start().unwrap();
        let client = TaskClient::new(ttrpc::Client::connect(&socket).unwrap());
        Shim {
            client,
            service,
            stub,
            node,
            journal,
            exit,
            dir,
            _server: server,
        }
    }

    fn bundle(&self, id: &str, own_pid_namespace: bool) -> String {
        self.bundle_with(id, config(own_pid_namespace).as_bytes())
    }

    /// A bundle for `id` whose config.json is `config`.
    fn bundle_with(&self, id: &str, config: &[u8]) -> String {
        let bundle = self.dir.path().join(id);
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(bundle.join("config.json"), config).unwrap();
        bundle.display().to_string()
    }

    /// `Create` of `id` in `bundle`.
    fn create_bundle(&self, id: &str, bundle: String) -> ttrpc::Result<u32> {
        let req = CreateTaskRequest {
            id: id.into(),
            bundle,
            ..Default::default()
        };
        Ok(self.client.create(ctx(), &req)?.pid)
    }

    fn create(&self, id: &str) -> u32 {
        self.create_in(id, true).unwrap()
    }

    fn create_in(&self, id: &str, own_pid_namespace: bool) -> ttrpc::Result<u32> {
        self.create_bundle(id, self.bundle(id, own_pid_namespace))
    }

    fn start(&self, id: &str, exec_id: &str) -> ttrpc::Result<u32> {
        let req = StartRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        Ok(self.client.start(ctx(), &req)?.pid)
    }

    /// A running container: created and started.
    fn running(&self, id: &str) -> u32 {
        let pid = self.create(id);
        self.start(id, "").unwrap();
        pid
    }

    fn exec(&self, id: &str, exec_id: &str) -> ttrpc::Result<()> {
        let spec = r#"{"args": ["true"], "cwd": "/", "user": {"uid": 0, "gid": 0}}"#;
        let req = ExecProcessRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            spec: MessageField::some(Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
                value: spec.as_bytes().to_vec(),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.client.exec(ctx(), &req).map(drop)
    }

    fn state(&self, id: &str, exec_id: &str) -> ttrpc::Result<(String, Status, u32, u32)> {
        let req = StateRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        let s = self.client.state(ctx(), &req)?;
        Ok((
            s.id.clone(),
            s.status.enum_value_or_default(),
            s.pid,
            s.exit_status,
        ))
    }

    fn kill(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> ttrpc::Result<()> {
        let req = KillRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            signal,
            all,
            ..Default::default()
        };
        self.client.kill(ctx(), &req).map(drop)
    }

    fn delete(&self, id: &str, exec_id: &str) -> ttrpc::Result<(u32, u32)> {
        let req = DeleteRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        let d = self.client.delete(ctx(), &req)?;
        Ok((d.pid, d.exit_status))
    }

    /// A `Wait` sent now, answered on the returned channel.
    fn wait(&self, id: &str, exec_id: &str) -> Receiver<ttrpc::Result<WaitResponse>> {
        let req = WaitRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        let client = self.client.clone();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let _ = tx.send(client.wait(ctx(), &req));
        });
        rx
    }

    fn shutdown(&self) {
        self.client
            .shutdown(ctx(), &ShutdownRequest::default())
            .unwrap();
    }

    /// Whether the shim has been told to exit, within `within`.
    fn exits(&self, within: Duration) -> bool {
        let exit = Arc::clone(&self.exit);
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            exit.wait();
            let _ = tx.send(());
        });
        rx.recv_timeout(within).is_ok()
    }
}

const ANSWER: Duration = Duration::from_secs(5);
const GO_ZERO_TIME: i64 = -62_135_596_800;

#[test]
fn a_shim_containerd_never_asks_for_a_container_ends_by_itself() {
    let shim = Shim::new();
    shim.service.exit_if_never_asked(Duration::from_millis(50));
    assert!(shim.exits(ANSWER));
}

#[test]
fn a_shim_once_asked_for_a_container_waits_for_containerd_to_end_it() {
    let shim = Shim::new();
    let pid = shim.create("c1");
    shim.service.exit_if_never_asked(Duration::from_millis(50));
    assert!(!shim.exits(Duration::from_millis(300)));
    // Even with the container gone: containerd still holds the shim and will shut it down.
    shim.service.exited(pid as i32, 0);
    shim.delete("c1", "").unwrap();
    assert!(!shim.exits(Duration::from_millis(300)));
}

#[test]
fn a_task_goes_through_create_start_exit_delete_and_the_shim_then_exits() {
    let shim = Shim::new();
    let pid = shim.create("c1");
    assert_eq!(
        shim.state("c1", "").unwrap(),
        ("c1".into(), Status::CREATED, pid, 0)
    );
    let waited = shim.wait("c1", "");
    assert_eq!(shim.start("c1", "").unwrap(), pid);
    assert_eq!(shim.state("c1", "").unwrap().1, Status::RUNNING);
    assert!(waited.recv_timeout(Duration::from_millis(200)).is_err());

    shim.service.exited(pid as i32, 7);
    let waited = waited.recv_timeout(ANSWER).unwrap().unwrap();
    assert_eq!(waited.exit_status, 7);
    assert!(waited.exited_at.seconds > 0);
    assert_eq!(
        shim.state("c1", "").unwrap(),
        ("c1".into(), Status::STOPPED, pid, 7)
    );
    assert_eq!(shim.delete("c1", "").unwrap(), (pid, 7));

    let events = shim.journal.after("/tasks/delete");
    let events: Vec<_> = events.iter().filter(|l| l.starts_with('/')).collect();
    assert_eq!(
        events,
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exit c1 c1 7",
            "/tasks/delete"
        ]
    );
    shim.shutdown();
    assert!(
        shim.exits(ANSWER),
        "the last container is gone, the shim stays"
    );
}

#[test]
fn shutdown_while_a_task_remains_does_nothing() {
    let shim = Shim::new();
    let pid = shim.running("c1");
    shim.shutdown();
    assert!(!shim.exits(Duration::from_millis(300)));
    shim.service.exited(pid as i32, 0);
    shim.delete("c1", "").unwrap();
    shim.shutdown();
    assert!(shim.exits(ANSWER));
}

#[test]
fn an_exec_that_fails_to_start_releases_its_wait_at_once_and_leaves_no_exit_event() {
    let shim = Shim::new();
    let pid = shim.running("c1");
    shim.exec("c1", "probe").unwrap();
    // containerd waits for an exec before it starts it.
    let waited = shim.wait("c1", "probe");
    let missing = r#"exec failed: unable to start container process: exec: "nope": executable file not found in $PATH"#;
    shim.stub.fail("exec", missing);
    assert_eq!(
        status(shim.start("c1", "probe")),
        (Code::UNKNOWN, format!("OCI runtime exec failed: {missing}"))
    );
    let waited = waited
        .recv_timeout(ANSWER)
        .expect("the wait returns")
        .unwrap();
    assert_eq!(
        (waited.exit_status, waited.exited_at.seconds),
        (0, GO_ZERO_TIME)
    );
    assert_eq!(
        shim.state("c1", "probe").unwrap(),
        ("probe".into(), Status::CREATED, 0, 0)
    );
    assert_eq!(
        status(shim.kill("c1", "probe", 9, false)),
        (
            Code::FAILED_PRECONDITION,
            "process not created: failed precondition".into()
        )
    );
    assert_eq!(shim.delete("c1", "probe").unwrap(), (0, 0));

    // The pod goes: nothing of the failed exec holds the shim.
    shim.kill("c1", "", 9, false).unwrap();
    shim.service.exited(pid as i32, 137);
    shim.delete("c1", "").unwrap();
    shim.shutdown();
    assert!(shim.exits(ANSWER));
    let events = shim.journal.after("/tasks/delete");
    assert!(
        !events
            .iter()
            .any(|e| e.starts_with("/tasks/exec-started") || e.starts_with("/tasks/exit c1 probe")),
        "{events:#?}"
    );
}

#[test]
fn an_exec_is_added_started_and_exits_under_its_own_id_with_no_delete_event() {
    let shim = Shim::new();
    shim.running("c1");
    *shim.stub.quick_execs.lock().unwrap() = Some(137);
    shim.exec("c1", "e1").unwrap();
    let pid = shim.start("c1", "e1").unwrap();
    let waited = shim.wait("c1", "e1").recv_timeout(ANSWER).unwrap().unwrap();
    assert_eq!(waited.exit_status, 137);
    assert_eq!(
        shim.state("c1", "e1").unwrap(),
        ("e1".into(), Status::STOPPED, pid, 137)
    );
    assert_eq!(shim.delete("c1", "e1").unwrap(), (pid, 137));
    // The exit, reaped while the start was under way, is published after the start.
    let events = shim.journal.after("/tasks/exit");
    let events: Vec<_> = events.iter().filter(|l| l.starts_with('/')).collect();
    assert_eq!(
        events,
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit c1 e1 137"
        ]
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        shim.journal.events().len(),
        5,
        "an exec's delete has no event"
    );
}

#[test]
fn processes_are_refused_in_the_runc_shims_words_and_codes() {
    let shim = Shim::new();
    let pid = shim.running("c1");
    shim.exec("c1", "e1").unwrap();
    shim.start("c1", "e1").unwrap();
    let cases = [
        (
            status(shim.wait("c1", "nope").recv_timeout(ANSWER).unwrap()),
            (Code::NOT_FOUND, "process does not exist nope: not found"),
        ),
        (
            status(shim.delete("c1", "e1")),
            (Code::UNKNOWN, "cannot delete a running process"),
        ),
        (
            status(shim.delete("c1", "")),
            (Code::UNKNOWN, "cannot delete a running process"),
        ),
        (
            status(shim.exec("c1", "e1")),
            (Code::ALREADY_EXISTS, "id e1: already exists"),
        ),
        (
            status(shim.state("c2", "")),
            (Code::NOT_FOUND, "container not created: not found"),
        ),
        (
            status(shim.start("c1", "")),
            (Code::UNKNOWN, "cannot start a running process"),
        ),
    ];
    for (got, (code, message)) in cases {
        assert_eq!(got, (code, message.to_owned()));
    }
    let close = CloseIORequest {
        id: "c1".into(),
        exec_id: "nope".into(),
        stdin: true,
        ..Default::default()
    };
    assert_eq!(
        status(shim.client.close_io(ctx(), &close)),
        (
            Code::UNKNOWN,
            "process does not exist nope: not found".into()
        )
    );

    shim.service.exited(pid as i32, 0);
    shim.journal.after("/tasks/exit c1 c1");
    assert_eq!(
        status(shim.kill("c1", "", 15, false)),
        (
            Code::NOT_FOUND,
            "process already finished: not found".into()
        )
    );
    assert_eq!(
        status(shim.exec("c1", "e2")),
        (Code::UNKNOWN, "cannot exec in a stopped state".into())
    );
}

#[test]
fn kill_all_reaches_the_containers_processes_through_runc_and_an_exec_by_its_pid_alone() {
    let shim = Shim::new();
    shim.running("c1");
    shim.exec("c1", "e1").unwrap();
    let exec = shim.start("c1", "e1").unwrap();
    shim.kill("c1", "", 15, true).unwrap();
    shim.kill("c1", "", 2, false).unwrap();
    shim.kill("c1", "e1", 9, true).unwrap();
    let calls: Vec<_> = shim
        .journal
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("kill") || l.starts_with("signal"))
        .collect();
    assert_eq!(
        calls,
        ["kill c1 15 all", "kill c1 2", &format!("signal {exec} 9")]
    );
    // runc's answer for a container that is gone, as the runc shim reads it.
    shim.stub.fail("kill", "container not running");
    assert_eq!(
        status(shim.kill("c1", "", 15, false)),
        (
            Code::NOT_FOUND,
            "process already finished: not found".into()
        )
    );
}

#[test]
fn an_init_exiting_in_a_shared_pid_namespace_takes_the_rest_with_it_before_its_exit_is_told() {
    let shim = Shim::new();
    let shared = shim.create_in("shared", false).unwrap();
    shim.start("shared", "").unwrap();
    let own = shim.running("own");
    shim.service.exited(own as i32, 0);
    shim.service.exited(shared as i32, 0);
    let lines = shim.journal.after("/tasks/exit shared");
    let position = |line: &str| lines.iter().position(|l| l == line);
    let killed = position("kill shared 9 all").expect("runc kill --all of the shared one");
    assert!(killed < position("/tasks/exit shared shared 0").unwrap());
    assert_eq!(position("kill own 9 all"), None, "{lines:#?}");
}

#[test]
fn connect_state_stats_pids_and_resize_answer_as_the_runc_shim_does() {
    let shim = Shim::new();
    let init = shim.running("c1");
    shim.exec("c1", "e1").unwrap();
    let exec = shim.start("c1", "e1").unwrap();

    let connect = |id: &str| {
        let req = ConnectRequest {
            id: id.into(),
            ..Default::default()
        };
        shim.client.connect(ctx(), &req).unwrap()
    };
    let c = connect("c1");
    assert_eq!(
        (c.shim_pid, c.task_pid, c.version.as_str()),
        (std::process::id(), init, "")
    );
    assert_eq!(connect("unknown").task_pid, 0);

    // The stub's pids have no cgroup.
    let stats = containerd_shim::api::StatsRequest {
        id: "c1".into(),
        ..Default::default()
    };
    assert_eq!(
        status(shim.client.stats(ctx(), &stats)),
        (Code::NOT_FOUND, "cgroup does not exist: not found".into())
    );

    assert_eq!(
        shim.state("c1", "e1").unwrap(),
        ("e1".into(), Status::RUNNING, exec, 0)
    );

    let req = PidsRequest {
        id: "c1".into(),
        ..Default::default()
    };
    let pids = shim.client.pids(ctx(), &req).unwrap();
    let listed: Vec<_> = pids.processes.iter().map(|p| p.pid).collect();
    assert_eq!(listed, [init, exec]);
    assert!(pids.processes[0].info.is_none());
    let info = pids.processes[1].info.as_ref().expect("an exec's details");
    assert_eq!(info.type_url, "containerd.runc.v1.ProcessDetails");
    let details = ProcessDetails::parse_from_bytes(&info.value).unwrap();
    assert_eq!(details.exec_id, "e1");

    let resize = |exec_id: &str| {
        let req = ResizePtyRequest {
            id: "c1".into(),
            exec_id: exec_id.into(),
            width: 80,
            height: 24,
            ..Default::default()
        };
        shim.client.resize_pty(ctx(), &req)
    };
    // Neither has a terminal: nothing to resize, and no error.
    resize("").unwrap();
    resize("e1").unwrap();
    shim.service.exited(exec as i32, 0);
    shim.journal.after("/tasks/exit c1 e1");
    assert_eq!(
        status(resize("e1")),
        (Code::UNKNOWN, "cannot resize a stopped container".into())
    );
}

#[test]
fn a_failed_create_or_start_says_what_runc_said_and_leaves_nothing_behind() {
    let shim = Shim::new();
    let said =
        "runc create failed: unable to start container process: exec: \"nope\": no such file";
    shim.stub.fail("create", said);
    assert_eq!(
        status(shim.create_in("c1", true)),
        (Code::UNKNOWN, format!("OCI runtime create failed: {said}"))
    );
    shim.stub.heal("create");
    let pid = shim.create("c1");

    shim.stub
        .fail("start", "cannot start a container that has stopped");
    assert_eq!(
        status(shim.start("c1", "")),
        (
            Code::UNKNOWN,
            "OCI runtime start failed: cannot start a container that has stopped".into()
        )
    );
    assert_eq!(shim.state("c1", "").unwrap().1, Status::CREATED);
    shim.stub.heal("start");
    shim.start("c1", "").unwrap();
    shim.service.exited(pid as i32, 0);
    shim.delete("c1", "").unwrap();
    let events = shim.journal.after("/tasks/delete");
    let creates = events.iter().filter(|e| *e == "/tasks/create").count();
    assert_eq!(creates, 1, "the failed create is not told: {events:#?}");
}

#[test]
fn an_exit_that_is_not_one_of_the_shims_processes_is_ignored() {
    let shim = Shim::new();
    let pid = shim.running("c1");
    // A runc invocation's own exit, reaped by the same reaper.
    shim.service.exited(FIRST_PID as i32 + 100, 1);
    shim.service.exited(0, 0);
    assert_eq!(
        shim.state("c1", "").unwrap(),
        ("c1".into(), Status::RUNNING, pid, 0)
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(shim.journal.events(), ["/tasks/create", "/tasks/start"]);
}

mod vgpu;
