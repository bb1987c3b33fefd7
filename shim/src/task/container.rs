//! One container of this shim and what runc does to it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use containerd_shim::api::CreateTaskRequest;
use containerd_shim::protos::shim::oci::Options as RuncV1Options;
use runc::options::{CreateOpts, ExecOpts};

use super::bundle::{self, BundleSpec};
use super::error::TaskError;
use super::options::RuntimeOptions;
use super::process::{Lifecycle, Process};
use super::runtime::{OciRuntime, RuntimeError, RuntimeFor};
use super::stdio::{PendingStdio, StdioPaths};
use super::vgpu::{Node, Vgpu, VgpuError};
use gpuplex_cgroup::{FreezerCgroup, Hierarchies};
use gpuplex_hook::classify::{classify, VgpuOrigin};

/// A container: its bundle, its runc, its init and its execs, and its vGPU if it has one.
#[derive(Debug)]
pub struct Container {
    /// containerd's id for it.
    pub id: String,
    /// Its bundle directory.
    pub bundle: PathBuf,
    /// runc, as the runtime options say to run it.
    runc: Arc<dyn OciRuntime>,
    options: RuntimeOptions,
    /// Its init process.
    pub init: Process,
    /// Its exec processes, by exec id.
    pub execs: HashMap<String, Process>,
    /// Its vGPU, if it has one.
    pub vgpu: Option<Vgpu>,
    /// Whether the shim mounted its rootfs (and so unmounts it).
    mounted_rootfs: bool,
    /// The `CUDA_VISIBLE_DEVICES=...` entry its vGPU gave its init, which its execs get too
    /// (containerd builds an exec's process from the spec it stored, before the edit).
    visible_devices: Option<String>,
    /// Whether its init shares a PID namespace (the host's, its pod's): its other processes
    /// then outlive it, and are killed when it exits, as containerd's runc shim does.
    pub shares_pid_namespace: bool,
    /// Its OOM kills, reported as `/tasks/oom`.
    pub oom: Option<super::oom::OomWatch>,
    /// Its init's `/proc/PID/cgroup` once created (`None`: unreadable), for `Stats`.
    pub proc_cgroup: Option<String>,
}

/// A failed `runc kill` of init, as containerd's runc shim reads it: a process that is gone is
/// not found (`process already finished`), so is a container runc no longer knows.
fn kill_error(RuntimeError(why): RuntimeError) -> TaskError {
    let gone = [
        "process already finished",
        "container not running",
        "no such process",
    ];
    if gone.iter().any(|g| why.contains(g)) {
        TaskError::NotFound("process already finished".into())
    } else if why.contains("does not exist") {
        TaskError::NotFound("no such container".into())
    } else {
        TaskError::State(format!("unknown error after kill: {why}"))
    }
}

fn pid_file(path: &Path) -> Result<u32, TaskError> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| TaskError::Runc {
            what: "failed to retrieve OCI runtime container pid",
            why: format!("{} is missing or not a pid", path.display()),
        })
}

impl Container {
    /// `Create`: reads the bundle's spec and decides where the container's vGPU comes from
    /// (refused before anything is done), mounts the rootfs, gives the container its vGPU, runs
    /// `runc create` and attaches the container. Undone entirely on failure.
    pub fn create(
        req: &CreateTaskRequest,
        options: RuntimeOptions,
        namespace: &str,
        runtime_for: &RuntimeFor,
        node: &dyn Node,
    ) -> Result<Container, TaskError> {
        let bundle = PathBuf::from(&req.bundle);
        let rootfs = bundle.join("rootfs");
        let spec = BundleSpec::read(&bundle).map_err(|e| TaskError::Vgpu(e.into()))?;
        let origin = classify(&spec.value).map_err(|e| TaskError::Vgpu(e.into()))?;
        let options = options.for_cgroups_path(bundle::cgroups_path(&spec.value));
        let mut container = Container {
            id: req.id.clone(),
            runc: runtime_for(&options, namespace, &bundle)?,
            bundle: bundle.clone(),
            options,
            init: Process::new(
                "",
                StdioPaths {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                },
            ),
            execs: HashMap::new(),
            vgpu: None,
            mounted_rootfs: false,
            visible_devices: None,
            shares_pid_namespace: bundle::shares_pid_namespace(&spec.value),
            oom: None,
            proc_cgroup: None,
        };
        write_runc_options(&bundle, &container.options);
        for m in &req.rootfs {
            std::fs::create_dir_all(&rootfs)
                .map_err(|e| TaskError::io("create the rootfs directory", e))?;
            containerd_shim::mount::mount_rootfs(
                Some(&m.type_),
                Some(&m.source),
                &m.options,
                &rootfs,
            )
            .map_err(|e| {
                container.undo(node);
                TaskError::Runc {
                    what: "mount the rootfs",
                    why: e.to_string(),
                }
            })?;
            container.mounted_rootfs = true;
        }
        if let Err(why) = container.take_vgpu(origin, &spec, node) {
            container.undo(node);
            return Err(TaskError::Vgpu(why));
        }
        if let Err(e) = container.runc_create() {
            container.undo(node);
            return Err(e);
        }
        if let Some(vgpu) = &container.vgpu {
            if let Err(why) = node.attach(vgpu, &container.id, container.init.pid) {
                let _ = container.runc.delete(&container.id);
                container.undo(node);
                return Err(TaskError::Vgpu(why));
            }
        }
        Ok(container)
    }

    /// Gives the container the vGPU `origin` says, and writes the spec it runs with to the
    /// bundle: reserved by annotations (`spec` edited for it), or pinned for it already (`spec`
    /// without the attach step). A failure leaves [`Container::vgpu`] set to what is to be
    /// undone.
    fn take_vgpu(
        &mut self,
        origin: VgpuOrigin,
        spec: &BundleSpec,
        node: &dyn Node,
    ) -> Result<(), VgpuError> {
        let (vgpu, bytes, to_run) = match origin {
            VgpuOrigin::NoVgpu => return Ok(()),
            VgpuOrigin::Annotations(asked) => {
                tracing::debug!("{} asks for a vGPU: {asked:?}", self.id);
                let Some(reservation) = node.reserve(&spec.bytes)? else {
                    return Ok(());
                };
                let vgpu = Vgpu {
                    handle: reservation.handle,
                    asked: BTreeMap::new(),
                    pinned: false,
                };
                // The hook library's edit, parsed for the environment the execs get too.
                let edited = serde_json::from_slice(&reservation.spec).unwrap_or_default();
                (vgpu, reservation.spec, edited)
            }
            VgpuOrigin::Claim { handle, spec } => {
                node.ensure_running()?;
                let vgpu = Vgpu {
                    handle,
                    asked: BTreeMap::new(),
                    pinned: true,
                };
                (vgpu, serialized(&self.bundle, &spec)?, spec)
            }
            VgpuOrigin::Allocation {
                handle,
                asked,
                spec,
            } => {
                node.ensure_running()?;
                let vgpu = Vgpu {
                    handle,
                    asked,
                    pinned: true,
                };
                (vgpu, serialized(&self.bundle, &spec)?, spec)
            }
        };
        self.vgpu = Some(vgpu);
        bundle::write_spec(&self.bundle, &bytes)?;
        self.visible_devices = bundle::visible_devices(&to_run);
        Ok(())
    }

    fn runc_create(&mut self) -> Result<(), TaskError> {
        let pid_path = self.bundle.join("init.pid");
        let paths = self.init.stdio.clone();
        let mut opts = CreateOpts::new()
            .pid_file(&pid_path)
            .no_pivot(self.options.no_pivot_root)
            .no_new_keyring(self.options.no_new_keyring);
        let (pending, ends) = PendingStdio::new(&paths, self.options.io_uid, self.options.io_gid)
            .map_err(|e| TaskError::io("set up the process's stdio", e))?;
        if let Some(socket) = pending.console_socket() {
            opts = opts.console_socket(socket);
        }
        opts = opts.io(ends);
        self.runc
            .create(&self.id, &self.bundle, &opts)
            .map_err(|e| TaskError::Runc {
                what: "OCI runtime create failed",
                why: e.0,
            })?;
        self.init.pid = pid_file(&pid_path)?;
        self.proc_cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", self.init.pid)).ok();
        self.init.io = Some(
            pending
                .start(&paths)
                .map_err(|e| TaskError::io("copy the process's stdio", e))?,
        );
        Ok(())
    }

    /// Undoes a failed create: the vGPU, the rootfs mount.
    fn undo(&mut self, node: &dyn Node) {
        self.release_vgpu(node);
        self.unmount();
    }

    /// Lets go of the container's vGPU: releases it if the shim reserved it (a claim's or an
    /// allocation's is theirs to release).
    fn release_vgpu(&mut self, node: &dyn Node) {
        if let Some(vgpu) = self.vgpu.take().filter(|v| !v.pinned) {
            node.release(&vgpu.handle);
        }
    }

    fn unmount(&mut self) {
        if std::mem::take(&mut self.mounted_rootfs) {
            let rootfs = self.bundle.join("rootfs");
            let _ = containerd_shim::mount::umount_recursive(rootfs.to_str(), 0);
        }
    }

    /// A process by exec id (empty: init).
    pub fn process(&self, exec_id: &str) -> Result<&Process, TaskError> {
        if exec_id.is_empty() {
            return Ok(&self.init);
        }
        self.execs
            .get(exec_id)
            .ok_or_else(|| TaskError::NotFound(format!("process does not exist {exec_id}")))
    }

    fn process_mut(&mut self, exec_id: &str) -> Result<&mut Process, TaskError> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.execs
            .get_mut(exec_id)
            .ok_or_else(|| TaskError::NotFound(format!("process does not exist {exec_id}")))
    }

    /// Refuses what a process's state does not allow, in containerd's runc shim's words:
    /// `cannot <verb> a running process`.
    fn refuse(verb: &str, state: Lifecycle) -> TaskError {
        let state = match state {
            Lifecycle::Running => "running",
            Lifecycle::Paused => "paused",
            Lifecycle::Created | Lifecycle::StartFailed => "created",
            Lifecycle::Stopped { .. } => "stopped",
        };
        TaskError::State(format!("cannot {verb} a {state} process"))
    }

    /// Refuses an exec the init's state does not allow (`cannot exec in a stopped state`).
    pub fn check_exec(&self) -> Result<(), TaskError> {
        let state = match self.init.lifecycle.get() {
            Lifecycle::Running => return Ok(()),
            Lifecycle::Paused => "paused",
            Lifecycle::Created | Lifecycle::StartFailed => "created",
            Lifecycle::Stopped { .. } => "stopped",
        };
        Err(TaskError::State(format!("cannot exec in a {state} state")))
    }

    /// `Start`: init (`runc start`) or an exec (`runc exec --detach`); its pid.
    pub fn start(&mut self, exec_id: &str) -> Result<u32, TaskError> {
        if exec_id.is_empty() {
            let state = self.init.lifecycle.get();
            if state != Lifecycle::Created {
                return Err(Container::refuse("start", state));
            }
            self.runc.start(&self.id).map_err(|e| TaskError::Runc {
                what: "OCI runtime start failed",
                why: e.0,
            })?;
            self.init.lifecycle.set(Lifecycle::Running);
            return Ok(self.init.pid);
        }
        self.check_exec()?;
        let (id, bundle) = (self.id.clone(), self.bundle.clone());
        let (uid, gid) = (self.options.io_uid, self.options.io_gid);
        let runc = Arc::clone(&self.runc);
        let freezer = self.scheduler_freezer();
        let exec = self.process_mut(exec_id)?;
        let state = exec.lifecycle.get();
        let spec = match (state, exec.spec.clone()) {
            (Lifecycle::Created, Some(spec)) => spec,
            _ => return Err(Container::refuse("start", state)),
        };
        let pid_path = bundle.join(format!("exec-{exec_id}.pid"));
        let paths = exec.stdio.clone();
        let mut opts = ExecOpts::new().pid_file(&pid_path).detach(true);
        let (pending, ends) = PendingStdio::new(&paths, uid, gid)
            .map_err(|e| TaskError::io("set up the process's stdio", e))?;
        if let Some(socket) = pending.console_socket() {
            opts = opts.console_socket(socket);
        }
        opts = opts.io(ends);
        // runc refuses to exec in a frozen container. The caller waits for the container's
        // window first (`scheduler_freezer`, `wait_thawed`), and again if a freeze came between.
        if let Err(RuntimeError(why)) = runc.exec(&id, &spec, &opts) {
            if freezer.is_some() && why.contains("paused container") {
                return Err(TaskError::FrozenMeanwhile(id));
            }
            // As containerd's runc shim: the exec stays created, a wait for it returns.
            exec.spec = None;
            exec.lifecycle.set(Lifecycle::StartFailed);
            return Err(TaskError::Runc {
                what: "OCI runtime exec failed",
                why,
            });
        }
        exec.spec = None;
        exec.pid = pid_file(&pid_path)?;
        let _ = std::fs::remove_file(&pid_path);
        exec.io = Some(
            pending
                .start(&paths)
                .map_err(|e| TaskError::io("copy the process's stdio", e))?,
        );
        exec.lifecycle.set(Lifecycle::Running);
        Ok(exec.pid)
    }

    /// An exec's process as it is to run: with its container's `CUDA_VISIBLE_DEVICES`.
    pub fn exec_process(
        &self,
        mut process: oci_spec::runtime::Process,
    ) -> oci_spec::runtime::Process {
        if let Some(entry) = &self.visible_devices {
            let name = entry.split('=').next().unwrap_or_default();
            let mut env = process.env().clone().unwrap_or_default();
            env.retain(|e| e.split('=').next() != Some(name));
            env.push(entry.clone());
            process.set_env(Some(env));
        }
        process
    }

    /// The freezer the node service freezes this container with between its windows: for a
    /// container with a vGPU that the user has not paused.
    pub fn scheduler_freezer(&self) -> Option<FreezerCgroup> {
        self.vgpu.as_ref()?;
        if self.init.lifecycle.get() == Lifecycle::Paused {
            return None;
        }
        let hierarchies = Hierarchies::of_this_machine().ok()?;
        FreezerCgroup::of_pid(self.init.pid, &hierarchies).ok()
    }

    /// What kills every process of the container when its init has exited in a shared PID
    /// namespace (`runc kill --all <id> SIGKILL`); `None` when it has a PID namespace of its own.
    pub fn kill_all_on_exit(&self) -> Option<impl FnOnce() + Send + 'static> {
        if !self.shares_pid_namespace {
            return None;
        }
        let (runc, id) = (Arc::clone(&self.runc), self.id.clone());
        Some(move || {
            if let Err(e) = runc.kill(&id, libc::SIGKILL as u32, true) {
                tracing::warn!(
                    "{id}: its init exited; killing the rest of its processes failed: {e}"
                );
            }
        })
    }

    /// `Kill`: init through `runc kill` (`--all` when asked), an exec by its pid (`all` means
    /// nothing there, as in containerd's runc shim).
    pub fn kill(&self, exec_id: &str, signal: u32, all: bool) -> Result<(), TaskError> {
        let process = self.process(exec_id)?;
        if let Lifecycle::Stopped { .. } = process.lifecycle.get() {
            return Err(TaskError::NotFound("process already finished".into()));
        }
        if exec_id.is_empty() {
            return self.runc.kill(&self.id, signal, all).map_err(kill_error);
        }
        if process.pid == 0 {
            return Err(TaskError::Precondition("process not created".into()));
        }
        self.runc
            .signal(process.pid, signal)
            .map_err(|e| match kill_error(e) {
                TaskError::NotFound(why) => TaskError::NotFound(format!("exec kill error: {why}")),
                other => TaskError::State(format!("exec kill error: {other}")),
            })
    }

    /// `Pause` and `Resume`. A container with a vGPU is held by the node service first (it
    /// then never thaws it) and let go only after runc has resumed it, so that the scheduler
    /// cannot undo the user's pause in between.
    pub fn set_paused(&self, paused: bool, node: &dyn Node) -> Result<(), TaskError> {
        let held = self.vgpu.is_some();
        if paused && held {
            node.hold(&self.id, true).map_err(TaskError::Vgpu)?;
        }
        // Frozen by the scheduler when the hold came: runc sees it paused already (and would
        // refuse, "container not running"), and the hold keeps it so.
        let frozen_already = paused
            && held
            && self
                .scheduler_freezer()
                .is_some_and(|f| f.is_frozen().unwrap_or(false));
        let (result, state, what) = if frozen_already {
            (Ok(()), Lifecycle::Paused, "OCI runtime pause failed")
        } else if paused {
            (
                self.runc.pause(&self.id),
                Lifecycle::Paused,
                "OCI runtime pause failed",
            )
        } else {
            (
                self.runc.resume(&self.id),
                Lifecycle::Running,
                "OCI runtime resume failed",
            )
        };
        if let Err(e) = result {
            if paused && held {
                let _ = node.hold(&self.id, false);
            }
            return Err(TaskError::Runc { what, why: e.0 });
        }
        self.init.lifecycle.set(state);
        if !paused && held {
            node.hold(&self.id, false).map_err(TaskError::Vgpu)?;
        }
        Ok(())
    }

    /// The pids of the container's processes (`runc ps`).
    pub fn pids(&self) -> Result<Vec<u32>, TaskError> {
        self.runc
            .ps(&self.id)
            .map_err(|RuntimeError(why)| TaskError::RuncSaid(why))
    }

    /// `Update`: new resources through `runc update`.
    pub fn update(&self, resources: &oci_spec::runtime::LinuxResources) -> Result<(), TaskError> {
        self.runc
            .update(&self.id, resources)
            .map_err(|RuntimeError(why)| TaskError::RuncSaid(why))
    }

    /// `Delete` of init: `runc delete`, the rootfs unmounted, the vGPU released. Its exit.
    pub fn delete(&mut self, node: &dyn Node) -> (u32, SystemTime) {
        let _ = self.runc.delete(&self.id);
        if let Some(io) = &self.init.io {
            io.close_stdin();
        }
        self.unmount();
        self.release_vgpu(node);
        match self.init.lifecycle.get() {
            Lifecycle::Stopped { status, at } => (status, at),
            _ => (137, SystemTime::now()),
        }
    }
}

/// `spec` as the bytes the config.json of bundle `dir` is written with.
fn serialized(dir: &Path, spec: &serde_json::Value) -> Result<Vec<u8>, VgpuError> {
    serde_json::to_vec(spec).map_err(|e| {
        VgpuError::Bundle(bundle::BundleError::Write {
            path: dir.join("config.json"),
            source: e.into(),
        })
    })
}

/// How long an exec waits for its container's window; a window comes round within one round of
/// its GPU's windows, far less than this.
pub const EXEC_WINDOW_WAIT: Duration = Duration::from_secs(60);

/// Waits until `freezer` is thawed, or fails at `deadline`.
pub fn wait_thawed(freezer: &FreezerCgroup, deadline: Instant, id: &str) -> Result<(), TaskError> {
    while freezer.is_frozen().unwrap_or(false) {
        if Instant::now() > deadline {
            return Err(TaskError::Precondition(format!(
                "{id} waited {}s for a window of its GPU in vain; see `gpuplexctl status`",
                EXEC_WINDOW_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The runtime options, in the bundle as containerd's runc shim keeps them (`options.json`),
/// for the `delete` action after a crash.
fn write_runc_options(bundle: &Path, options: &RuntimeOptions) {
    let proto = RuncV1Options {
        binary_name: options.binary_name.clone(),
        root: options.root.clone(),
        systemd_cgroup: options.systemd_cgroup,
        ..Default::default()
    };
    if let Some(bundle) = bundle.to_str() {
        let _ = containerd_shim::util::write_options(bundle, &proto);
    }
}
