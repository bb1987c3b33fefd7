//! The task API containerd calls (`containerd.task.v2.Task`), over the shim's containers.
//!
//! One lock holds the containers; a request holds it for its whole runc call, so that an exit
//! reaped meanwhile is matched to its process only after that process is on record (the exit
//! thread waits for the lock). Events leave in the order they happen ([`EventSink`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use containerd_shim::api::{
    CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
    DeleteRequest, DeleteResponse, ExecProcessRequest, KillRequest, PauseRequest, PidsRequest,
    PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest, StartRequest, StartResponse,
    StateRequest, StateResponse, StatsRequest, StatsResponse, UpdateTaskRequest, WaitRequest,
    WaitResponse,
};
use containerd_shim::monitor::{monitor_subscribe, Subject, Topic};
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::empty::Empty;
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::shim::oci::ProcessDetails;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc;
use containerd_shim::protos::types::task::ProcessInfo;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{ExitSignal, Task, TtrpcContext};

use super::container::{wait_thawed, Container, EXEC_WINDOW_WAIT};
use super::error::TaskError;
use super::events::{timestamp, EventSink, Remote, RETRY_AFTER};
use super::node_link::NodeLink;
use super::options::RuntimeOptions;
use super::process::{go_zero_time, Lifecycle, Process};
use super::runtime::{Runc, RuntimeFor};
use super::stdio::StdioPaths;
use super::vgpu::{stop_signal, Node};

type TtrpcResult<T> = ttrpc::Result<T>;

/// How long an exit waits for the process's last output to reach containerd's fifos; a child
/// that keeps the process's stdout open must not hold the exit back longer.
const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(1);

/// The shim's containers and what the requests share.
struct Shared {
    containers: Mutex<HashMap<String, Container>>,
    events: Arc<EventSink>,
    namespace: String,
    runtime_for: RuntimeFor,
    node: Arc<dyn Node>,
    exit: Arc<ExitSignal>,
    /// Whether containerd has asked for a container (`Create`) since the shim started.
    asked: AtomicBool,
}

/// containerd's task service, for this shim's containers.
#[derive(Clone)]
pub struct TaskService {
    shared: Arc<Shared>,
}

impl TaskService {
    /// The service, publishing to `publisher` under `namespace`; `exit` is signalled when the
    /// last container is gone and containerd asks the shim to shut down.
    pub fn new(publisher: RemotePublisher, namespace: &str, exit: Arc<ExitSignal>) -> TaskService {
        let remote = Remote::new(
            std::env::var("TTRPC_ADDRESS").unwrap_or_default(),
            publisher,
        );
        let events = EventSink::new(remote, namespace.to_owned(), &RETRY_AFTER);
        let service = TaskService::with_parts(
            events,
            Runc::runtime_for(),
            Arc::new(NodeLink::from_env()),
            namespace,
            exit,
        );
        service.watch_exits();
        service
    }

    /// The service over its parts: where its events go, its OCI runtime, its node service.
    /// Exits reach it through [`TaskService::exited`].
    pub fn with_parts(
        events: EventSink,
        runtime_for: RuntimeFor,
        node: Arc<dyn Node>,
        namespace: &str,
        exit: Arc<ExitSignal>,
    ) -> TaskService {
        let shared = Arc::new(Shared {
            containers: Mutex::new(HashMap::new()),
            events: Arc::new(events),
            namespace: namespace.to_owned(),
            runtime_for,
            node,
            exit,
            asked: AtomicBool::new(false),
        });
        TaskService { shared }
    }

    /// Ends the shim if containerd has not asked it for a container within `within` of now.
    /// containerd starts a shim and asks at once; when it dies in between (or restarts and
    /// drops the half-made task, as containerd 1.6 does), nothing would ever talk to the shim
    /// again, and runc's shim then runs until the machine stops. Once asked, only Shutdown or a
    /// signal ends it.
    pub fn exit_if_never_asked(&self, within: Duration) {
        let service = self.clone();
        std::thread::spawn(move || {
            std::thread::sleep(within);
            // Containers come only from Create: never asked, none.
            if !service.shared.asked.load(Ordering::SeqCst) {
                tracing::warn!(
                    "containerd asked for no container within {} s of this shim's start \
                     (it died or restarted meanwhile); exiting",
                    within.as_secs()
                );
                service.shared.exit.signal();
            }
        });
    }

    fn containers(&self) -> MutexGuard<'_, HashMap<String, Container>> {
        self.shared
            .containers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Matches every reaped child to its process and publishes its exit.
    fn watch_exits(&self) {
        let Ok(subscription) = monitor_subscribe(Topic::Pid) else {
            tracing::error!("cannot watch for exits");
            return;
        };
        let service = self.clone();
        std::thread::spawn(move || {
            for event in subscription.rx.iter() {
                if let Subject::Pid(pid) = event.subject {
                    service.exited(pid, event.exit_code);
                }
            }
        });
    }

    /// The reaper's report: `pid` exited with `code` (128 + the signal that killed it).
    pub fn exited(&self, pid: i32, code: i32) {
        if pid <= 0 {
            return;
        }
        let found = {
            let containers = self.containers();
            containers.values().find_map(|c| {
                let mut processes = std::iter::once(&c.init).chain(c.execs.values());
                let p = processes.find(|p| p.pid == pid as u32)?;
                let (id, kill_all, oom) = if p.exec_id.is_empty() {
                    (c.id.clone(), c.kill_all_on_exit(), c.oom.clone())
                } else {
                    (p.exec_id.clone(), None, None)
                };
                let output = p.io.as_ref().map(|io| io.output_waiter());
                Some((
                    c.id.clone(),
                    id,
                    Arc::clone(&p.lifecycle),
                    output,
                    kill_all,
                    oom,
                ))
            })
        };
        // Not ours: one of runc's own runs.
        let Some((container_id, id, lifecycle, output, kill_all, oom)) = found else {
            return;
        };
        // An OOM kill whose notification the watcher has not taken yet goes out before the exit
        // (the cgroup is still there: it goes at Delete).
        if let Some(oom) = oom {
            oom.catch_up();
        }
        // An init that exits in a shared PID namespace leaves its other processes behind,
        // holding its output open: they go first, as under containerd's runc shim.
        if let Some(kill_all) = kill_all {
            kill_all();
        }
        // containerd stops reading a process's output once it learns of the exit; what the
        // process wrote last is in its pipe or terminal, and reaches the fifo first.
        if let Some(output) = output {
            output.wait(OUTPUT_AFTER_EXIT);
        }
        let at = SystemTime::now();
        let status = code as u32;
        lifecycle.set(Lifecycle::Stopped { status, at });
        let event = TaskExit {
            container_id,
            id,
            pid: pid as u32,
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_EXIT_EVENT_TOPIC, Box::new(event));
    }

    fn node(&self) -> &dyn Node {
        &*self.shared.node
    }

    fn with<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Container) -> Result<T, TaskError>,
    ) -> Result<T, TaskError> {
        let mut containers = self.containers();
        let c = containers
            .get_mut(id)
            .ok_or_else(|| TaskError::NotFound("container not created".into()))?;
        f(c)
    }

    fn do_create(&self, req: CreateTaskRequest) -> Result<CreateTaskResponse, TaskError> {
        let options = match req.options.as_ref() {
            Some(any) => RuntimeOptions::decode(any)?,
            None => RuntimeOptions::default(),
        };
        if !req.checkpoint.is_empty() {
            return Err(TaskError::Invalid(
                "gpuplex's shim does not restore checkpoints".into(),
            ));
        }
        // Options sent with the task rather than at `start` (the legacy CreateOptions of
        // containerd 1.6 clients): the shim cgroup applies now.
        if !options.shim_cgroup.is_empty() {
            containerd_shim::cgroup::add_task_to_cgroup(&options.shim_cgroup, std::process::id())
                .map_err(|e| {
                    TaskError::Invalid(format!("shim cgroup {}: {e}", options.shim_cgroup))
                })?;
        }
        let mut containers = self.containers();
        if containers.contains_key(&req.id) {
            return Err(TaskError::AlreadyExists(format!("container {}", req.id)));
        }
        let namespace = &self.shared.namespace;
        let runtime_for = &self.shared.runtime_for;
        let mut container = Container::create(&req, options, namespace, runtime_for, self.node())?;
        let pid = container.init.pid;
        if let Some(cgroup) = super::oom::memory_cgroup(pid) {
            let (events, id) = (Arc::clone(&self.shared.events), req.id.clone());
            let watched = super::oom::watch(&cgroup, move || {
                let event = TaskOOM {
                    container_id: id.clone(),
                    ..Default::default()
                };
                events.send(topics::TASK_OOM_EVENT_TOPIC, Box::new(event));
            });
            match watched {
                Ok(watch) => container.oom = Some(watch),
                Err(e) => tracing::warn!("cannot watch {cgroup:?} for OOM kills: {e}"),
            }
        }
        containers.insert(req.id.clone(), container);
        let event = TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: MessageField::some(TaskIO {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
                ..Default::default()
            }),
            checkpoint: req.checkpoint.clone(),
            pid,
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_CREATE_EVENT_TOPIC, Box::new(event));
        Ok(CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn do_start(&self, req: &StartRequest) -> Result<StartResponse, TaskError> {
        let pid = self.with(&req.id, |c| {
            let pid = c.start(&req.exec_id)?;
            if req.exec_id.is_empty() {
                let event = TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                };
                self.shared
                    .events
                    .send(topics::TASK_START_EVENT_TOPIC, Box::new(event));
            } else {
                let event = TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                };
                self.shared
                    .events
                    .send(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(event));
            }
            Ok(pid)
        })?;
        Ok(StartResponse {
            pid,
            ..Default::default()
        })
    }

    fn do_delete(&self, req: DeleteRequest) -> Result<DeleteResponse, TaskError> {
        let mut containers = self.containers();
        let c = containers
            .get_mut(&req.id)
            .ok_or_else(|| TaskError::NotFound("container not created".into()))?;
        // As containerd's runc shim: a running (or paused) process is not deleted.
        let state = c.process(&req.exec_id)?.lifecycle.get();
        match state {
            Lifecycle::Running => {
                return Err(TaskError::State("cannot delete a running process".into()))
            }
            Lifecycle::Paused => {
                return Err(TaskError::State("cannot delete a paused process".into()))
            }
            _ => {}
        }
        if !req.exec_id.is_empty() {
            let exec = c.execs.remove(&req.exec_id).expect("checked above");
            let (status, at) = match exec.lifecycle.get() {
                Lifecycle::Stopped { status, at } => (status, at),
                _ => (0, go_zero_time()),
            };
            return Ok(DeleteResponse {
                pid: exec.pid,
                exit_status: status,
                exited_at: MessageField::some(timestamp(at)),
                ..Default::default()
            });
        }
        let (status, at) = c.delete(self.node());
        let pid = c.init.pid;
        containers.remove(&req.id);
        let event = TaskDelete {
            container_id: req.id.clone(),
            pid,
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            id: req.id.clone(),
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_DELETE_EVENT_TOPIC, Box::new(event));
        Ok(DeleteResponse {
            pid,
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        })
    }

    fn do_state(&self, req: StateRequest) -> Result<StateResponse, TaskError> {
        self.with(&req.id, |c| {
            let p: &Process = c.process(&req.exec_id)?;
            let state = p.lifecycle.get();
            let (exit_status, at) = match state {
                Lifecycle::Stopped { status, at } => (status, at),
                _ => (0, go_zero_time()),
            };
            // As containerd's runc shim: an exec's state names the exec in `id`.
            let id = if req.exec_id.is_empty() {
                &req.id
            } else {
                &req.exec_id
            };
            Ok(StateResponse {
                id: id.clone(),
                bundle: c.bundle.display().to_string(),
                pid: p.pid,
                status: state.status().into(),
                stdin: p.stdio.stdin.clone(),
                stdout: p.stdio.stdout.clone(),
                stderr: p.stdio.stderr.clone(),
                terminal: p.stdio.terminal,
                exit_status,
                exited_at: MessageField::some(timestamp(at)),
                ..Default::default()
            })
        })
    }

    fn do_exec(&self, req: ExecProcessRequest) -> Result<(), TaskError> {
        let spec = req.spec.as_ref().ok_or_else(|| {
            TaskError::Invalid(format!("exec {} has no process spec", req.exec_id))
        })?;
        let mut spec: oci_spec::runtime::Process =
            serde_json::from_slice(&spec.value).map_err(|e| {
                TaskError::Invalid(format!(
                    "exec {}: the process spec is not valid: {e}",
                    req.exec_id
                ))
            })?;
        // The request's terminal wins over the spec's, as in containerd's runc shim (a client
        // may ask for one without saying so in the spec).
        spec.set_terminal(Some(req.terminal));
        self.with(&req.id, |c| {
            if c.execs.contains_key(&req.exec_id) {
                return Err(TaskError::AlreadyExists(format!("id {}", req.exec_id)));
            }
            c.check_exec()?;
            let stdio = StdioPaths {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
            };
            let mut process = Process::new(&req.exec_id, stdio);
            process.spec = Some(c.exec_process(spec));
            c.execs.insert(req.exec_id.clone(), process);
            Ok(())
        })?;
        let event = TaskExecAdded {
            container_id: req.id.clone(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(event));
        Ok(())
    }

    fn do_pids(&self, req: PidsRequest) -> Result<PidsResponse, TaskError> {
        self.with(&req.id, |c| {
            let execs: HashMap<u32, String> = c
                .execs
                .values()
                .map(|p| (p.pid, p.exec_id.clone()))
                .collect();
            let mut processes = Vec::new();
            for pid in c.pids()? {
                let mut info = ProcessInfo {
                    pid,
                    ..Default::default()
                };
                if let Some(exec_id) = execs.get(&pid) {
                    let details = ProcessDetails {
                        exec_id: exec_id.clone(),
                        ..Default::default()
                    };
                    if let Ok(any) = containerd_shim::util::convert_to_any(Box::new(details)) {
                        info.info = MessageField::some(any);
                    }
                }
                processes.push(info);
            }
            Ok(PidsResponse {
                processes,
                ..Default::default()
            })
        })
    }

    fn do_wait(&self, req: WaitRequest) -> Result<WaitResponse, TaskError> {
        let lifecycle = self.with(&req.id, |c| {
            Ok(Arc::clone(&c.process(&req.exec_id)?.lifecycle))
        })?;
        let (status, at) = lifecycle.wait_exit();
        Ok(WaitResponse {
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        })
    }

    fn do_update(&self, req: UpdateTaskRequest) -> Result<(), TaskError> {
        let resources = req
            .resources
            .as_ref()
            .ok_or_else(|| TaskError::Invalid("update without resources".into()))?;
        let resources: oci_spec::runtime::LinuxResources = serde_json::from_slice(&resources.value)
            .map_err(|e| TaskError::Invalid(format!("the resources are not valid: {e}")))?;
        self.with(&req.id, |c| c.update(&resources))
    }

    fn do_stats(&self, req: StatsRequest) -> Result<StatsResponse, TaskError> {
        let (cgroup, pid) = self.with(&req.id, |c| Ok((c.proc_cgroup.clone(), c.init.pid)))?;
        // As containerd's runc shim: a container whose cgroup it could not load has none.
        let cgroup = cgroup.ok_or_else(|| TaskError::NotFound("cgroup does not exist".into()))?;
        let any = super::metrics::of_container(&cgroup, pid)
            .map_err(|e| TaskError::RuncSaid(format!("the metrics of {}: {e}", req.id)))?;
        Ok(StatsResponse {
            stats: MessageField::some(any),
            ..Default::default()
        })
    }
}

impl Task for TaskService {
    fn state(&self, _: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        Ok(self.do_state(req)?)
    }

    fn create(&self, _: &TtrpcContext, req: CreateTaskRequest) -> TtrpcResult<CreateTaskResponse> {
        self.shared.asked.store(true, Ordering::SeqCst);
        Ok(self.do_create(req)?)
    }

    fn start(&self, _: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        if req.exec_id.is_empty() {
            return Ok(self.do_start(&req)?);
        }
        // An exec into a container with a vGPU waits for its window without holding the
        // containers' lock, so that the shim's other requests go on meanwhile.
        let deadline = Instant::now() + EXEC_WINDOW_WAIT;
        loop {
            if let Some(freezer) = self.with(&req.id, |c| Ok(c.scheduler_freezer()))? {
                wait_thawed(&freezer, deadline, &req.id)?;
            }
            match self.do_start(&req) {
                Err(TaskError::FrozenMeanwhile(_)) if Instant::now() < deadline => continue,
                result => return Ok(result?),
            }
        }
    }

    fn delete(&self, _: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        Ok(self.do_delete(req)?)
    }

    fn pids(&self, _: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        Ok(self.do_pids(req)?)
    }

    fn pause(&self, _: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        let node = self.node();
        self.with(&req.id, |c| c.set_paused(true, node))?;
        let event = TaskPaused {
            container_id: req.id.clone(),
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_PAUSED_EVENT_TOPIC, Box::new(event));
        Ok(Empty::new())
    }

    fn resume(&self, _: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        let node = self.node();
        self.with(&req.id, |c| c.set_paused(false, node))?;
        let event = TaskResumed {
            container_id: req.id.clone(),
            ..Default::default()
        };
        self.shared
            .events
            .send(topics::TASK_RESUMED_EVENT_TOPIC, Box::new(event));
        Ok(Empty::new())
    }

    fn kill(&self, _: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        let node = self.node();
        self.with(&req.id, |c| {
            // A container frozen between its windows takes no signal until it is thawed: the
            // node service thaws it and keeps it out of windows while it stops.
            let told = stop_signal(req.signal).filter(|_| req.exec_id.is_empty());
            if let (Some(signal), Some(_)) = (told, &c.vgpu) {
                node.stopping(&c.id, signal);
            }
            c.kill(&req.exec_id, req.signal, req.all)
        })?;
        Ok(Empty::new())
    }

    fn exec(&self, _: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        self.do_exec(req)?;
        Ok(Empty::new())
    }

    fn resize_pty(&self, _: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        self.with(&req.id, |c| {
            let p = c.process(&req.exec_id)?;
            let stopped = matches!(p.lifecycle.get(), Lifecycle::Stopped { .. });
            if stopped && !req.exec_id.is_empty() {
                return Err(TaskError::State("cannot resize a stopped container".into()));
            }
            // As containerd's runc shim: a process without a terminal has nothing to resize,
            // and that is no error.
            match p.io.as_ref().filter(|_| p.stdio.terminal) {
                Some(io) => io
                    .resize(req.width, req.height)
                    .map_err(|e| TaskError::io("resize the terminal", e)),
                None => Ok(()),
            }
        })?;
        Ok(Empty::new())
    }

    fn close_io(&self, _: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        self.with(&req.id, |c| {
            // As containerd's runc shim: an unknown exec is not found in words, not in code.
            let process = c.process(&req.exec_id).map_err(|e| match e {
                TaskError::NotFound(_) => TaskError::State(e.to_string()),
                other => other,
            })?;
            if let (true, Some(io)) = (req.stdin, process.io.as_ref()) {
                io.close_stdin();
            }
            Ok(())
        })?;
        Ok(Empty::new())
    }

    fn update(&self, _: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        self.do_update(req)?;
        Ok(Empty::new())
    }

    fn wait(&self, _: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        Ok(self.do_wait(req)?)
    }

    fn stats(&self, _: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        Ok(self.do_stats(req)?)
    }

    fn connect(&self, _: &TtrpcContext, req: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        let task_pid = self.with(&req.id, |c| Ok(c.init.pid)).unwrap_or(0);
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            ..Default::default()
        })
    }

    fn shutdown(&self, _: &TtrpcContext, _: ShutdownRequest) -> TtrpcResult<Empty> {
        if self.containers().is_empty() {
            self.shared.exit.signal();
        }
        Ok(Empty::new())
    }
}

#[cfg(test)]
mod tests;
