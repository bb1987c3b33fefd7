//! Carrying out the scheduler's orders on freezer cgroups, and letting containers go.
//!
//! Freezes are carried out before thaws, so that a switch never lets two containers of one GPU
//! run at once; all the freezes of one decision are requested together and confirmed together
//! ([`gpuplex_cgroup::freeze_all`]). A freeze that cannot be confirmed is undone by the cgroup
//! layer and logged: the container runs on rather than stay frozen outside a window.
//!
//! A held container (its user paused it) is its user's: no order, release, exit or shutdown
//! freezes or thaws it until it is unheld.
//!
//! Every freeze is preceded by the frozen list written with its cgroup, and no freeze is made
//! while no watchdog runs or the list cannot be written (see the service's module doc).

use std::time::{Duration, Instant};

use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::windows::Action;
use gpuplex_scheduler::VgpuId;

use super::unstarted::Unstarted;
use super::Service;
use gpuplex_cgroup::{freeze_all, CgroupError, CgroupReader, FreezerCgroup};

/// An attached container as the service enforces it.
#[derive(Debug)]
pub(super) struct Enforced {
    /// Its freezer cgroup.
    pub cgroup: FreezerCgroup,
    /// Its files read at every sample, kept open.
    pub reader: CgroupReader,
    /// Pidfds of some of its processes, watched for their exits.
    pub exits: Vec<std::os::fd::OwnedFd>,
    /// Since when it is frozen (confirmed), if it is.
    pub frozen_since: Option<Instant>,
    /// Time frozen before that.
    pub frozen_total: Duration,
    /// When it was last thawed (or resumed by its user).
    pub thawed_at: Option<Instant>,
    /// Held: its user paused it; the service neither freezes nor thaws it.
    pub held: bool,
    /// Attached before it started, and not started yet: not sampled (see [`Unstarted`]).
    pub unstarted: Option<Unstarted>,
}

impl Enforced {
    pub fn new(cgroup: FreezerCgroup) -> Enforced {
        Enforced {
            reader: CgroupReader::new(cgroup.clone()),
            exits: Vec::new(),
            cgroup,
            frozen_since: None,
            frozen_total: Duration::ZERO,
            thawed_at: None,
            held: false,
            unstarted: None,
        }
    }

    /// Its user paused it (`held`) or resumed it. A freeze of the service's in force becomes
    /// its user's pause: it is no longer counted, and never undone by the service.
    pub fn set_held(&mut self, held: bool) {
        self.held = held;
        if let Some(since) = self.frozen_since.take() {
            self.frozen_total += since.elapsed();
        }
        if !held {
            self.thawed_at = Some(Instant::now());
        }
    }

    /// Whether any process is left in its cgroup; `None` (said in the log) when that cannot be
    /// told.
    pub fn still_runs(&mut self, vgpu: VgpuId) -> Option<bool> {
        match self.reader.is_populated() {
            Ok(populated) => Some(populated),
            Err(CgroupError::Gone(_)) => Some(false),
            Err(err) => {
                tracing::warn!("{vgpu}: cannot tell whether it still runs: {err}");
                None
            }
        }
    }

    /// Seconds frozen so far, the current freeze included.
    pub fn frozen_seconds(&self) -> Duration {
        self.frozen_total + self.frozen_since.map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// Thaws it if the service froze it (never when held); true when it did.
    pub fn thaw(&mut self, vgpu: VgpuId) -> Result<bool, CgroupError> {
        let Some(since) = self.frozen_since.filter(|_| !self.held) else {
            return Ok(false);
        };
        let result = self.cgroup.thaw();
        if result.is_ok() || matches!(result, Err(CgroupError::Gone(_))) {
            self.frozen_since = None;
            self.frozen_total += since.elapsed();
            self.thawed_at = Some(Instant::now());
        }
        if let Err(e) = &result {
            if !matches!(e, CgroupError::Gone(_)) {
                tracing::error!("{vgpu}: thaw failed: {e}");
            }
        }
        result.map(|()| true)
    }
}

impl Service {
    /// Carries out freeze and thaw orders: freezes first, confirmed together, then thaws.
    /// Orders naming a held container are not carried out (the scheduler gives none).
    pub(super) fn carry_out(&mut self, actions: &[Action]) {
        if actions.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut freezes: Vec<VgpuId> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Freeze(v) if self.enforced.get(v).is_some_and(|e| !e.held) => Some(*v),
                Action::Freeze(v) if self.enforced.contains_key(v) => {
                    tracing::error!("{v}: an order to freeze it while held was not carried out");
                    None
                }
                _ => None,
            })
            .collect();
        let mut exited = Vec::new();
        if !freezes.is_empty() && (self.watchdog.is_none() || !self.record_frozen(&freezes)) {
            tracing::error!(
                "{} freeze(s) not carried out: no watchdog, or the frozen list cannot be written; they run on outside their windows",
                freezes.len()
            );
            freezes.clear();
        }
        if !freezes.is_empty() {
            let cgroups: Vec<&FreezerCgroup> =
                freezes.iter().map(|v| &self.enforced[v].cgroup).collect();
            let results = freeze_all(&cgroups, self.config.service.freeze_timeout);
            let at = Instant::now();
            for (vgpu, result) in freezes.iter().zip(results) {
                match result {
                    Ok(()) => {
                        let e = self.enforced.get_mut(vgpu).expect("collected above");
                        e.frozen_since.get_or_insert(at);
                    }
                    Err(CgroupError::Gone(_)) => exited.push(*vgpu),
                    Err(e @ CgroupError::StillFrozen { .. }) => {
                        // Counted as frozen, so that every later thaw order, release and
                        // shutdown tries again.
                        let entry = self.enforced.get_mut(vgpu).expect("collected above");
                        entry.frozen_since.get_or_insert(at);
                        tracing::error!("{vgpu}: freeze failed and so did undoing it: {e}");
                    }
                    Err(e) => tracing::error!(
                        "{vgpu}: freeze failed and was undone, it runs on outside its window: {e}"
                    ),
                }
            }
        }
        let frozen_at = started.elapsed();
        let mut thawed = 0;
        for action in actions {
            if let Action::Thaw(vgpu) = action {
                if let Some(e) = self.enforced.get_mut(vgpu).filter(|e| !e.held) {
                    match e.thaw(*vgpu) {
                        Ok(_) => thawed += 1,
                        Err(CgroupError::Gone(_)) => exited.push(*vgpu),
                        Err(_) => {}
                    }
                }
            }
        }
        self.record_frozen(&[]);
        tracing::debug!(
            "carried out {} freeze(s) in {:?} and {thawed} thaw(s), {:?} in all",
            freezes.len(),
            frozen_at,
            started.elapsed()
        );
        for vgpu in exited {
            self.release_exited(vgpu);
        }
    }

    /// Thaws every container the service froze; returns how many.
    pub(super) fn thaw_all(&mut self) -> usize {
        let mut thawed = 0;
        for (vgpu, e) in self.enforced.iter_mut() {
            if let Ok(true) = e.thaw(*vgpu) {
                thawed += 1;
            }
        }
        self.record_frozen(&[]);
        thawed
    }

    /// Watches the exits of `vgpu`'s container's processes as they are now.
    pub(super) fn watch_exits(&mut self, vgpu: VgpuId) {
        let (Some(watch), Some(e)) = (&self.exit_watch, self.enforced.get_mut(&vgpu)) else {
            return;
        };
        e.exits.clear();
        if let Ok(pids) = e.reader.pids() {
            e.exits = watch.watch(vgpu, &pids);
        }
    }

    /// A process of `vgpu`'s container exited: releases it when none is left, else watches
    /// the ones it has now.
    pub(super) fn exit_seen(&mut self, vgpu: VgpuId) {
        match self.enforced.get_mut(&vgpu).map(|e| e.still_runs(vgpu)) {
            Some(Some(true)) => self.watch_exits(vgpu),
            Some(Some(false)) => self.release_exited(vgpu),
            _ => {}
        }
    }

    /// Releases a container whose processes are all gone.
    pub(super) fn release_exited(&mut self, vgpu: VgpuId) {
        let container = self
            .node
            .record(vgpu)
            .and_then(|r| r.attachment.as_ref())
            .map(|a| a.container.clone())
            .unwrap_or_default();
        // A claim's vGPU stays reserved for the claim (the pod's next container attaches);
        // only its container goes.
        let now = self.now();
        if let Some(detached) = self.node.detach(vgpu, now) {
            tracing::info!(
                "{vgpu} ({container}): its processes are gone; detached, still pinned for claim {}",
                detached.record.claim.as_deref().unwrap_or_default()
            );
            if let Some(mut e) = self.enforced.remove(&vgpu) {
                let _ = e.thaw(vgpu);
                self.record_frozen(&[]);
            }
            self.sampler.forget(vgpu);
            if let Err(e) = self.save_detached(vgpu) {
                tracing::error!("{vgpu}: {e}; a restart would find its container gone and keep the claim's reservation");
            }
            return;
        }
        if let Some(released) = self.node.release(&ReleaseKey::Vgpu(vgpu), now) {
            tracing::info!(
                "{vgpu} ({container}): its processes are gone; released ({:.3} GPU seconds, {} windows)",
                released.stats.as_ref().map_or(0.0, |s| s.gpu_time.as_secs_f64()),
                released.stats.as_ref().map_or(0, |s| s.windows)
            );
        }
        self.forget(vgpu);
    }

    /// Drops everything the service keeps of a vGPU the node no longer has: thaws its cgroup if
    /// frozen, forgets its samples, removes its state file.
    pub(super) fn forget(&mut self, vgpu: VgpuId) {
        if let Some(mut e) = self.enforced.remove(&vgpu) {
            let _ = e.thaw(vgpu);
            self.record_frozen(&[]);
        }
        self.sampler.forget(vgpu);
        // The hook's identity file for it, if any: whoever released it (poststop, an exit seen
        // here, a lapse), the file goes with the vGPU.
        let identities = gpuplex_client::identity::identity_dir(&self.config.service.socket);
        if let Err(e) = gpuplex_client::identity::remove(&identities, vgpu) {
            tracing::warn!(
                "{vgpu}: cannot remove its identity file in {}: {e}",
                identities.display()
            );
        }
        if let Err(e) = self.state.remove(vgpu) {
            tracing::error!("{vgpu}: {e}; a restart would recover it, and then drop it if its container is gone");
        }
    }
}
