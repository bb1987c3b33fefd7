//! The node service: this machine's scheduler, enforced.
//!
//! One thread owns everything that changes ([`Service`]): the scheduler's [`Node`], the freezer
//! cgroups, the activity sampler and the state directory. Everything else talks to it through
//! one channel of [`Event`]s: the socket's connection threads (requests, watches), the metrics
//! endpoint (status), the signal thread (shutdown). The loop sleeps in `recv_timeout` until the
//! next activity sample or the scheduler's next decision instant, whichever is first: no
//! polling. Watchers of the node's capacity ([`watch`]) are told of a change by the loop after the event
//! that made it, without the loop ever waiting for them.
//!
//! Fail open (DESIGN.md): every freeze that cannot be confirmed is undone; a released or exited
//! container is thawed; SIGTERM thaws every frozen container and exits 0; at start every
//! recovered container is thawed, since nothing holds a window yet. A held container (its user
//! paused it: `hold` on the socket, saved with its record) is its user's: no order, release,
//! exit, shutdown or start freezes or thaws it until `unhold`.
//!
//! What survives what: before any freeze the cgroups about to be frozen are written to the
//! frozen list (`state_dir/frozen.json`); a [`watchdog`] process thaws that list when the service
//! dies of anything (SIGKILL, an OOM kill, a panic), and a start thaws it before it reads a
//! record. Nothing is frozen while the list cannot be written or no watchdog watches. The node
//! lock (`state_dir/lock`) is taken before any cgroup is touched, and the watchdog keeps it until
//! it has thawed: a second instance, or a restart racing the watchdog, waits or refuses.

mod cdi;
mod enforce;
mod exits;
pub mod fixture;
mod leftovers;
mod recover;
mod requests;
mod socket;
pub mod stop;
mod stopping;
#[cfg(test)]
mod tests;
mod unstarted;
pub mod watch;
pub mod watchdog;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use gpuplex_scheduler::node::{Node, NodeStatus};
use gpuplex_scheduler::{Handle, Instant, VgpuId};
use gpuplex_wire::protocol::{Reply, Request};

use crate::activity::{ActivitySampler, ActivitySource, Watched};
use crate::gpus::{self, GpuSource, NodeGpu};
use crate::state::{
    unix_ms, NodeLock, SavedAccounting, SavedFreezer, SavedFrozen, SavedGpuAccounting,
    SavedVgpuAccounting, StateDir, StateError,
};
use gpuplex_cgroup::{CgroupError, Hierarchies};
use gpuplex_wire::config::NodeConfig;

use cdi::CdiSpecs;
use enforce::Enforced;
use watchdog::Watchdog;

/// What the service's loop is told.
pub enum Event {
    /// A request from the socket, and where its reply goes.
    Request(Request, Sender<Reply>),
    /// The status, for the metrics endpoint.
    Status(Sender<NodeStatus>),
    /// A connection subscribed to the node's capacity (`watch`): its first view and each
    /// change go to this mailbox.
    Watch(std::sync::Arc<watch::Mailbox>),
    /// Stop: thaw everything and return.
    Shutdown(&'static str),
    /// A process of this vGPU's container exited: see whether any is left.
    Exited(VgpuId),
}

/// Why the service cannot start. One line.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The GPUs cannot be used.
    #[error(transparent)]
    Gpus(#[from] gpus::GpuError),
    /// No freezer.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The state directory cannot be used.
    #[error(transparent)]
    State(#[from] StateError),
    /// The GPUs do not make an inventory (two with one index).
    #[error("the GPUs found do not make an inventory: {0}")]
    Inventory(String),
    /// The socket cannot be served.
    #[error("node socket {path}: {message}")]
    Socket {
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The metrics endpoint cannot listen.
    #[error("metrics_listen = {address:?}: cannot listen: {source}")]
    Metrics {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
    /// Signals cannot be handled.
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
    /// The watchdog cannot be started.
    #[error("cannot start the watchdog that thaws containers if the service dies: {0}")]
    Watchdog(std::io::Error),
}

/// The node service's state, owned by its loop.
pub struct Service {
    config: NodeConfig,
    node: Node,
    gpus: Vec<NodeGpu>,
    source: GpuSource,
    hierarchies: Hierarchies,
    state: StateDir,
    sampler: ActivitySampler,
    enforced: BTreeMap<VgpuId, Enforced>,
    origin: std::time::Instant,
    node_name: String,
    /// The GPUs' CDI spec, as containers get it.
    cdi: CdiSpecs,
    last_checkpoint: std::time::Instant,
    /// When every container was last asked whether it still has processes.
    last_exit_sweep: std::time::Instant,
    /// When the frozen containers were last looked at for stop signals.
    last_stop_check: std::time::Instant,
    /// The node, owned (kept for the process's life).
    lock: NodeLock,
    /// The frozen list as last written (`None`: not written yet).
    frozen_saved: Option<Vec<SavedFreezer>>,
    /// What thaws the frozen list if the service dies; `None` when it could not be (re)started,
    /// and then nothing is frozen.
    watchdog: Option<Watchdog>,
    /// The exits of containers' processes (`None`: no epoll; the sweep sees them).
    exit_watch: Option<exits::ExitWatch>,
    /// Where new reservations' handles come from: the kernel's random source
    /// ([`requests::fresh_handle`]), or a sequence a test predicts.
    handles: HandleSource,
    /// The connections watching the node's capacity.
    watchers: watch::Watchers,
}

/// Where a service draws the handles of new reservations.
pub type HandleSource = Box<dyn FnMut() -> Result<Handle, String> + Send>;

/// How long a start waits for the node lock (the watchdog of a service that just died holds it
/// while it thaws).
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// How often the accounting is saved.
pub const ACCOUNTING_CHECKPOINT: Duration = Duration::from_secs(1);

/// How often every container is asked whether it still has processes, for the exits its pidfds
/// did not see (see `Service::sample`).
pub const EXIT_SWEEP: Duration = Duration::from_secs(1);

/// How often the frozen containers are looked at for a pending stop signal: reading a process's
/// `/proc/PID/status` is the dearest read of a sample (about 15 µs).
pub const STOP_CHECK: Duration = Duration::from_millis(100);

/// What a [`Service`] is made of (see [`Service::assemble`]).
pub struct Parts {
    /// The configuration.
    pub config: NodeConfig,
    /// The GPUs, and where they came from.
    pub found: gpus::Discovery,
    /// Where the freezer hierarchies are mounted.
    pub hierarchies: Hierarchies,
    /// The state directory.
    pub state: StateDir,
    /// The node, owned.
    pub lock: NodeLock,
}

impl Service {
    /// Finds the GPUs and the cgroup hierarchies, opens the state directory and recovers what
    /// it holds. Logs what it found.
    pub fn start(config: NodeConfig) -> Result<Service, ServiceError> {
        keep_descriptors();
        let found = gpus::discover(&config)?;
        let hierarchies = Hierarchies::of_this_machine()?;
        let state = StateDir::open(&config.service.state_dir)?;
        // Before any cgroup is touched: a second instance stops here.
        let lock = state.lock(LOCK_WAIT)?;
        let mut service = Service::assemble(Parts {
            config,
            found,
            hierarchies,
            state,
            lock,
        })?;
        service.recover()?;
        let watchdog =
            Watchdog::spawn(service.state.path(), &service.lock).map_err(ServiceError::Watchdog)?;
        tracing::info!(
            "watchdog: pid {}; it thaws what the service froze if the service dies",
            watchdog.pid()
        );
        service.watchdog = Some(watchdog);
        Ok(service)
    }

    /// The service over `parts`, with nothing recovered and no watchdog: what
    /// [`Service::start`] makes of this machine's, and what tests and the `request_line` fuzz
    /// target make of fixtures (fake GPUs, a temporary state directory, fixture cgroups). Without
    /// a watchdog it freezes nothing; every request is carried out as in production.
    pub fn assemble(parts: Parts) -> Result<Service, ServiceError> {
        let Parts {
            config,
            found,
            hierarchies,
            state,
            lock,
        } = parts;
        let nvml_loaded = matches!(found.source, GpuSource::Nvml(_));
        let source = ActivitySource::resolve(config.service.activity, nvml_loaded);
        let mut node = Node::new(
            found.gpus.iter().map(|g| g.gpu.clone()).collect(),
            config.scheduler.clone(),
        )
        .map_err(|e| ServiceError::Inventory(e.to_string()))?;
        node.set_policy(config.policy.clone());
        // vGPU ids never repeat on a node: above every id given before (saved), and above the
        // clock in milliseconds (which covers a lost state directory).
        let saved_next = state.load_accounting().and_then(|a| a.next_vgpu);
        node.start_ids_at(unix_ms(std::time::SystemTime::now()).max(saved_next.unwrap_or(0)));
        let node_name = if config.service.node_name.is_empty() {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "localhost".into())
        } else {
            config.service.node_name.clone()
        };
        match &found.source {
            GpuSource::Fake => tracing::warn!(
                "GPUs: {} FAKE GPU(s) from [[fake_gpu]] in the configuration; NVML is not used",
                found.gpus.len()
            ),
            GpuSource::Nvml(nvml) => tracing::info!(
                "GPUs: {} found by NVML (driver {})",
                found.gpus.len(),
                nvml.driver_version().unwrap_or_else(|| "unknown".into())
            ),
            GpuSource::None(why) => tracing::warn!(
                "GPUs: none. {why}. Registrations will be refused until the service restarts with GPUs"
            ),
        }
        for g in &found.gpus {
            tracing::info!(
                "GPU {}: {} {} {} bytes, device {} ({}:{}){}",
                g.gpu.index.0,
                g.gpu.model,
                g.gpu.uuid,
                g.gpu.memory,
                g.device.path.display(),
                g.device.major,
                g.device.minor,
                if g.fake { " FAKE" } else { "" }
            );
        }
        tracing::info!(
            "activity source: {} (configured {:?}), sampled every {:?}; freezer: v1 at {:?}, v2 at {:?}",
            source.name(),
            config.service.activity,
            config.service.sample_interval,
            hierarchies.freezer,
            hierarchies.unified
        );
        let uuids = found.gpus.iter().map(|g| g.gpu.uuid.clone()).collect();
        let service = &config.service;
        let cdi = CdiSpecs::load(&service.cdi_spec_dirs, &service.cdi_kind, uuids);
        Ok(Service {
            node,
            gpus: found.gpus,
            source: found.source,
            hierarchies,
            state,
            sampler: ActivitySampler::new(source),
            enforced: BTreeMap::new(),
            origin: std::time::Instant::now(),
            node_name,
            cdi,
            last_checkpoint: std::time::Instant::now(),
            last_exit_sweep: std::time::Instant::now(),
            last_stop_check: std::time::Instant::now(),
            config,
            lock,
            frozen_saved: None,
            watchdog: None,
            exit_watch: exits::ExitWatch::new()
                .inspect_err(|e| {
                    tracing::warn!("cannot watch exits ({e}): they are seen every {EXIT_SWEEP:?}")
                })
                .ok(),
            handles: Box::new(requests::fresh_handle),
            watchers: watch::Watchers::default(),
        })
    }

    /// Draws new reservations' handles from `handles` instead of the kernel's random source:
    /// for tests and the fuzz target, whose requests attach what they reserved.
    pub fn draw_handles_from(&mut self, handles: HandleSource) {
        self.handles = handles;
    }

    /// Restarts the watchdog if it exited; without one, nothing is frozen.
    fn keep_watchdog(&mut self) {
        if !self.watchdog.as_mut().is_none_or(Watchdog::has_exited) {
            return;
        }
        self.watchdog = None;
        match Watchdog::spawn(self.state.path(), &self.lock) {
            Ok(w) => {
                tracing::warn!("watchdog: it was gone; started again as pid {}", w.pid());
                self.watchdog = Some(w);
            }
            Err(e) => {
                tracing::error!("watchdog: cannot start it ({e}); nothing is frozen until it runs");
                self.thaw_all();
            }
        }
    }

    /// Writes the frozen list: every cgroup the service froze, and those of `about` (about to be
    /// frozen), when it changed. False when it could not be written: then nothing more may be
    /// frozen, since neither the watchdog nor a restart would know to thaw it.
    fn record_frozen(&mut self, about: &[VgpuId]) -> bool {
        let mut list: Vec<SavedFreezer> = self
            .enforced
            .iter()
            .filter(|(v, e)| !e.held && (e.frozen_since.is_some() || about.contains(v)))
            .flat_map(|(_, e)| e.members.iter().map(|m| SavedFreezer::of(&m.cgroup)))
            .collect();
        list.sort();
        list.dedup();
        if self.frozen_saved.as_ref() == Some(&list) {
            return true;
        }
        let saved = SavedFrozen {
            format: crate::state::FORMAT,
            frozen: list.clone(),
        };
        match self.state.save_frozen(&saved) {
            Ok(()) => {
                self.frozen_saved = Some(list);
                true
            }
            Err(e) => {
                tracing::error!("{e}; nothing is frozen until the frozen list can be written");
                false
            }
        }
    }

    /// The scheduler's clock. It starts at `reservation_ttl`, not 0, so that a recovered
    /// reservation can be dated before the service started.
    fn now(&self) -> Instant {
        Instant::from_duration(self.origin.elapsed() + self.config.scheduler.reservation_ttl)
    }

    /// Runs the loop until a [`Event::Shutdown`] arrives or every sender is gone, then thaws
    /// every container it froze.
    pub fn run(&mut self, events: Receiver<Event>) {
        let interval = self.config.service.sample_interval;
        let mut next_sample = self.now();
        let mut next_due: Option<Instant> = None;
        loop {
            let now = self.now();
            let wake = next_due.map_or(next_sample, |d| d.min(next_sample));
            let timeout = wake.saturating_since(now);
            let first = match events.recv_timeout(timeout) {
                Ok(event) => Some(event),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.shutdown("every event source is gone");
                    return;
                }
            };
            for event in first
                .into_iter()
                .chain(std::iter::from_fn(|| events.try_recv().ok()))
            {
                if let Some(why) = self.serve_event(event) {
                    self.shutdown(why);
                    return;
                }
            }
            let now = self.now();
            if now >= next_sample {
                self.sample();
                next_sample = next_sample + interval;
                if next_sample <= now {
                    next_sample = now + interval;
                }
            }
            next_due = self.decide();
            self.publish();
        }
    }

    /// Carries out one event as the loop does, the watchers told of what it changed (after
    /// the reply, so that a requester hears of its own request first); a shutdown is returned,
    /// not carried out.
    pub fn serve_event(&mut self, event: Event) -> Option<&'static str> {
        match event {
            Event::Request(request, reply) => {
                let answer = self.handle(request);
                let _ = reply.send(answer);
                self.watchers.stale = true;
            }
            Event::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Event::Watch(mailbox) => self.watch(mailbox),
            Event::Shutdown(why) => return Some(why),
            Event::Exited(vgpu) => {
                self.exit_seen(vgpu);
                self.watchers.stale = true;
            }
        }
        self.publish();
        None
    }

    /// Samples activity, and releases containers whose processes are all gone.
    ///
    /// What it costs follows what can change: a frozen container cannot show work (the
    /// scheduler ignores its samples) nor exit on v1, a held or unstarted one is not scheduled;
    /// none of them is sampled. An exit is told by the kernel (a pidfd of the
    /// container's processes becomes readable: `exits.rs`); every [`EXIT_SWEEP`], not every
    /// sample, each container is also asked whether it still has processes, for the exits no
    /// pidfd saw. A frozen one is looked at for stop signals every [`STOP_CHECK`]. Every read is one
    /// `pread` of a file kept open ([`gpuplex_cgroup::CgroupReader`]).
    fn sample(&mut self) {
        self.keep_watchdog();
        if self.last_exit_sweep.elapsed() >= EXIT_SWEEP {
            self.last_exit_sweep = std::time::Instant::now();
            let exited: Vec<(VgpuId, Vec<String>)> = (self.enforced.iter_mut())
                .map(|(&vgpu, e)| (vgpu, e.gone(vgpu)))
                .filter(|(_, gone)| !gone.is_empty())
                .collect();
            for (vgpu, gone) in exited {
                self.watchers.stale = true;
                for container in gone {
                    self.container_exited(vgpu, &container);
                }
            }
            self.watch_health();
        }
        if self.last_stop_check.elapsed() >= STOP_CHECK {
            self.last_stop_check = std::time::Instant::now();
            self.notice_stops();
        }
        let mut joining = Vec::new();
        for (vgpu, e) in self.enforced.iter_mut() {
            let frozen = e.frozen_since.is_some() && !e.held;
            for m in &mut e.members {
                if m.unstarted.is_some_and(|u| u.has_started()) {
                    m.unstarted = None;
                    tracing::debug!("{vgpu} ({}): started; sampled from now on", m.container);
                    if frozen {
                        joining.push((*vgpu, m.cgroup.clone()));
                    }
                }
            }
        }
        self.freeze_joining(joining);
        let node = &self.node;
        let mut watched: Vec<Watched<'_>> = self
            .enforced
            .iter_mut()
            .filter(|(_, e)| !e.held && e.frozen_since.is_none())
            .filter_map(|(&vgpu, e)| {
                let readers: Vec<_> = (e.members.iter_mut())
                    .filter(|m| m.unstarted.is_none())
                    .map(|m| &mut m.reader)
                    .collect();
                if readers.is_empty() {
                    return None;
                }
                Some(Watched {
                    vgpu,
                    gpus: &node.record(vgpu)?.assignment.gpus,
                    thawed_at: e.thawed_at,
                    readers,
                })
            })
            .collect();
        let nvml = match &mut self.source {
            GpuSource::Nvml(n) => Some(n.as_mut()),
            _ => None,
        };
        let samples = self.sampler.sample(
            &mut watched,
            &self.hierarchies,
            nvml,
            std::time::Instant::now(),
        );
        drop(watched);
        let now = self.now();
        for (vgpu, has_work) in samples {
            self.node.observe(vgpu, has_work, now);
        }
        if self.last_checkpoint.elapsed() >= ACCOUNTING_CHECKPOINT {
            self.checkpoint();
        }
    }

    /// Saves the accounting, so that a restart carries it over.
    fn checkpoint(&mut self) {
        self.last_checkpoint = std::time::Instant::now();
        let status = self.status();
        let accounting = SavedAccounting {
            format: crate::state::FORMAT,
            next_vgpu: Some(self.node.next_id()),
            vgpus: status
                .containers
                .iter()
                .map(|c| {
                    let saved = SavedVgpuAccounting {
                        gpu_seconds: c.gpu_seconds,
                        wait_seconds: c.wait_seconds,
                        windows: c.windows,
                        frozen_seconds: c.frozen_seconds,
                    };
                    (c.vgpu.clone(), saved)
                })
                .collect(),
            gpus: status
                .gpus
                .iter()
                .map(|g| {
                    let saved = SavedGpuAccounting {
                        uuid: g.uuid.clone(),
                        busy_seconds: g.busy_seconds,
                        switches: g.switches,
                    };
                    (g.index, saved)
                })
                .collect(),
        };
        if let Err(e) = self.state.save_accounting(&accounting) {
            tracing::warn!("{e}; a restart would lose the accounting since the last save");
        }
    }

    /// Decides and carries the decision out; returns when to decide again at the latest.
    fn decide(&mut self) -> Option<Instant> {
        let decision = self.node.decide(self.now());
        for lapsed in &decision.lapsed {
            tracing::info!(
                "{}: reservation lapsed: no container attached within {:?}",
                lapsed.id,
                self.config.scheduler.reservation_ttl
            );
            self.forget(lapsed.id);
            self.watchers.stale = true;
        }
        self.carry_out(&decision.actions);
        decision.next_due
    }

    /// The status, with what only the service knows.
    pub fn status(&self) -> NodeStatus {
        let mut status = self.node.status(self.now());
        status.node = self.node_name.clone();
        status.activity = self.sampler.source().name().to_string();
        status.cdi = self.cdi.state().to_owned();
        for g in &mut status.gpus {
            let gpu = self.gpus.iter().find(|n| n.gpu.index.0 == g.index);
            g.fake = gpu.is_some_and(|n| n.fake);
            g.healthy = gpu.is_some_and(|n| gpus::healthy(n, &self.source));
        }
        for c in &mut status.containers {
            if let Some(e) = c.vgpu.parse().ok().and_then(|v| self.enforced.get(&v)) {
                c.frozen_seconds = e.frozen_seconds().as_secs_f64();
            }
        }
        status
    }

    fn shutdown(&mut self, why: &str) {
        self.watchers.close_all();
        let frozen = self.thaw_all();
        self.checkpoint();
        tracing::info!(
            "stopping ({why}): thawed {frozen} frozen container(s); {} registration(s) stay in {} for the next start",
            self.node.records().count(),
            self.state.path().display()
        );
    }
}

/// Raises the soft limit on open files to the hard one (the soft default, 1024, dates from
/// `select(2)`, which the service does not use), and lets the cgroup readers keep half of it.
fn keep_descriptors() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    };
    gpuplex_cgroup::set_kept_budget(usize::try_from(soft / 2).unwrap_or(usize::MAX));
}

/// Runs the node service in the foreground until SIGTERM or SIGINT: the whole of
/// `containerd-shim-gpuplex-v1 serve`.
pub fn serve(config: NodeConfig) -> Result<(), ServiceError> {
    // SIGTERM and SIGINT are caught before anything else: one that comes while the service
    // starts (systemd's stop right after its start) waits in the channel and ends the service
    // as any other does, once it can thaw, instead of killing it half-started.
    let (events, inbox) = mpsc::channel();
    spawn_signal_thread(events.clone())?;
    let mut service = Service::start(config)?;
    if let Some(watch) = &service.exit_watch {
        if let Err(e) = watch.spawn(events.clone()) {
            tracing::warn!("cannot watch exits ({e}): they are seen every {EXIT_SWEEP:?}");
        }
    }
    let socket = socket::bind(&service.config.service.socket)?;
    tracing::info!(
        "listening on {} (mode 0600)",
        service.config.service.socket.display()
    );
    if !service.config.service.metrics_listen.is_empty() {
        let address = service.config.service.metrics_listen.clone();
        let listener =
            std::net::TcpListener::bind(&address).map_err(|source| ServiceError::Metrics {
                address: address.clone(),
                source,
            })?;
        if let Ok(local) = listener.local_addr() {
            tracing::info!("metrics: http://{local}/metrics");
        }
        let asker: Sender<Event> = events.clone();
        crate::metrics::serve(listener, crate::metrics::Limits::default(), move || {
            let (tx, rx) = mpsc::channel();
            asker.send(Event::Status(tx)).ok()?;
            rx.recv_timeout(Duration::from_secs(5)).ok()
        })
        .map_err(|source| ServiceError::Metrics { address, source })?;
    }
    socket::spawn_accept_loop(socket, events);
    service.run(inbox);
    Ok(())
}

fn spawn_signal_thread(events: Sender<Event>) -> Result<(), ServiceError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).map_err(ServiceError::Signals)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let name = if signal == SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGINT"
                };
                let _ = events.send(Event::Shutdown(name));
            }
        })
        .map_err(ServiceError::Signals)?;
    Ok(())
}
