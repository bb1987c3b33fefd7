//! Making a [`Service`]: of this machine's GPUs, cgroups and state directory
//! ([`Service::start`]), or of given parts ([`Service::assemble`]: what tests and the fuzz
//! target make of fixtures); and keeping its watchdog.

use gpuplex_cgroup::Hierarchies;
use gpuplex_scheduler::node::Node;
use gpuplex_wire::config::NodeConfig;

use super::cdi::CdiSpecs;
use super::enforcer::Enforcer;
use super::registry::Registry;
use super::watchdog::Watchdog;
use super::{daemon, exits, freezer, watch, HandleSource, Service, ServiceError};
use super::{EXIT_SWEEP, LOCK_WAIT};
use crate::activity::{ActivitySampler, ActivitySource};
use crate::gpus::{self, GpuSource};
use crate::state::{unix_ms, NodeLock, StateDir};

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
        daemon::keep_descriptors();
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
        let watchdog = Watchdog::spawn(service.registry.state().path(), &service.lock)
            .map_err(ServiceError::Watchdog)?;
        tracing::info!(
            "watchdog: pid {}; it thaws what the service froze if the service dies",
            watchdog.pid()
        );
        service.set_watchdog(Some(watchdog));
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
        // vGPU ids never repeat on a node: at or above the id ceiling (written before the ids
        // below it were given), the next id the accounting saved, and the clock in milliseconds
        // (which covers a lost state directory).
        let saved_next = state.load_accounting().and_then(|a| a.next_vgpu);
        let ceiling = state.load_id_ceiling();
        node.start_ids_at(
            unix_ms(std::time::SystemTime::now())
                .max(saved_next.unwrap_or(0))
                .max(ceiling.unwrap_or(0)),
        );
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
        let enforcer = Enforcer::new(
            Box::new(freezer::Kernel),
            state.clone(),
            service.freeze_timeout,
        );
        let registry = Registry::new(node, state, config.scheduler.reservation_ttl);
        Ok(Service {
            registry,
            gpus: found.gpus,
            source: found.source,
            hierarchies,
            sampler: ActivitySampler::new(source),
            enforcer,
            node_name,
            cdi,
            last_checkpoint: std::time::Instant::now(),
            checkpoint_failures: Default::default(),
            last_exit_sweep: std::time::Instant::now(),
            last_stop_check: std::time::Instant::now(),
            config,
            lock,
            watchdog: None,
            exit_watch: exits::ExitWatch::new()
                .inspect_err(|e| {
                    tracing::warn!("cannot watch exits ({e}): they are seen every {EXIT_SWEEP:?}")
                })
                .ok(),
            watchers: watch::Watchers::default(),
        })
    }

    /// Draws new reservations' handles from `handles` instead of the kernel's random source:
    /// for tests and the fuzz target, whose requests attach what they reserved.
    pub fn draw_handles_from(&mut self, handles: HandleSource) {
        self.registry.draw_handles_from(handles);
    }

    /// Restarts the watchdog if it exited; without one, nothing is frozen.
    pub(super) fn keep_watchdog(&mut self) {
        if !self.watchdog.as_mut().is_none_or(Watchdog::has_exited) {
            return;
        }
        self.set_watchdog(None);
        match Watchdog::spawn(self.registry.state().path(), &self.lock) {
            Ok(w) => {
                tracing::warn!("watchdog: it was gone; started again as pid {}", w.pid());
                self.set_watchdog(Some(w));
            }
            Err(e) => {
                tracing::error!("watchdog: cannot start it ({e}); nothing is frozen until it runs");
                self.enforcer.thaw_all();
            }
        }
    }

    /// The watchdog now; the enforcer freezes only while there is one.
    fn set_watchdog(&mut self, watchdog: Option<Watchdog>) {
        self.enforcer.set_watched(watchdog.is_some());
        self.watchdog = watchdog;
    }
}
