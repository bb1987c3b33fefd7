//! The node service: this machine's scheduler, enforced.
//!
//! One thread owns everything that changes ([`Service`]): the scheduler's [`Node`](gpuplex_scheduler::node::Node) and the
//! state directory (`registry.rs`: a registration's change saved before it is answered), the
//! freezer cgroups and the frozen list (`enforcer.rs`, over a freezer trait: `freezer.rs`), the
//! activity sampler. Everything else talks to it through
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

mod assemble;
mod cdi;
mod daemon;
mod enforce;
mod enforced;
mod enforcer;
mod exits;
pub mod fixture;
mod freezer;
mod leftovers;
mod recover;
mod registry;
#[cfg(test)]
mod registry_tests;
mod repeated;
mod requests;
mod sample;
mod socket;
pub mod stop;
mod stopping;
#[cfg(test)]
mod tests;
mod unstarted;
pub mod watch;
pub mod watchdog;

pub use assemble::Parts;
pub use daemon::serve;

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use gpuplex_scheduler::node::NodeStatus;
use gpuplex_scheduler::{Handle, Instant, VgpuId};
use gpuplex_wire::protocol::{Reply, Request};

use crate::activity::ActivitySampler;
use crate::gpus::{self, GpuSource, NodeGpu};
use crate::state::{NodeLock, StateError};
use gpuplex_cgroup::{CgroupError, Hierarchies};
use gpuplex_wire::config::NodeConfig;

use cdi::CdiSpecs;
use enforcer::Enforcer;
use registry::Registry;
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
    /// The node's registrations, saved before they are answered.
    registry: Registry,
    gpus: Vec<NodeGpu>,
    source: GpuSource,
    hierarchies: Hierarchies,
    sampler: ActivitySampler,
    /// The attached vGPUs' cgroups, frozen and thawed as decided, and the frozen list.
    enforcer: Enforcer,
    node_name: String,
    /// The GPUs' CDI spec, as containers get it.
    cdi: CdiSpecs,
    last_checkpoint: std::time::Instant,
    /// Failures to save the accounting, logged as they begin, recur and end.
    checkpoint_failures: repeated::Repeated,
    /// When every container was last asked whether it still has processes.
    last_exit_sweep: std::time::Instant,
    /// When the frozen containers were last looked at for stop signals.
    last_stop_check: std::time::Instant,
    /// The node, owned (kept for the process's life).
    lock: NodeLock,
    /// What thaws the frozen list if the service dies; `None` when it could not be (re)started,
    /// and then nothing is frozen (the enforcer is told: [`Service::set_watchdog`]).
    watchdog: Option<Watchdog>,
    /// The exits of containers' processes (`None`: no epoll; the sweep sees them).
    exit_watch: Option<exits::ExitWatch>,
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

impl Service {
    /// The scheduler's clock ([`Registry::now`]).
    fn now(&self) -> Instant {
        self.registry.now()
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

    /// Decides and carries the decision out; returns when to decide again at the latest.
    fn decide(&mut self) -> Option<Instant> {
        let now = self.now();
        let decision = self.registry.node_mut().decide(now);
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
        let mut status = self.registry.node().status(self.now());
        status.node = self.node_name.clone();
        status.activity = self.sampler.source().name().to_string();
        status.cdi = self.cdi.state().to_owned();
        for g in &mut status.gpus {
            let gpu = self.gpus.iter().find(|n| n.gpu.index.0 == g.index);
            g.fake = gpu.is_some_and(|n| n.fake);
            g.healthy = gpu.is_some_and(|n| gpus::healthy(n, &self.source));
        }
        for c in &mut status.containers {
            if let Some(t) = c
                .vgpu
                .parse()
                .ok()
                .and_then(|v| self.enforcer.frozen_time(v))
            {
                c.frozen_seconds = t.as_secs_f64();
            }
        }
        status
    }

    fn shutdown(&mut self, why: &str) {
        self.watchers.close_all();
        let frozen = self.enforcer.thaw_all();
        self.checkpoint();
        tracing::info!(
            "stopping ({why}): thawed {frozen} frozen container(s); {} registration(s) stay in {} for the next start",
            self.registry.node().records().count(),
            self.registry.state().path().display()
        );
    }
}
