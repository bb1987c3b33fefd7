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

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::windows::Action;
use gpuplex_scheduler::VgpuId;

use super::unstarted::Unstarted;
use super::Service;
use gpuplex_cgroup::{freeze_all, CgroupError, CgroupReader, FreezerCgroup};

/// An attached vGPU as the service enforces it: its containers (one, or the containers of a
/// pod sharing a claim's vGPU), frozen and thawed together.
#[derive(Debug)]
pub(super) struct Enforced {
    /// Its containers, in the order they attached; never empty.
    pub members: Vec<Member>,
    /// Since when it is frozen (confirmed), if it is.
    pub frozen_since: Option<Instant>,
    /// Time frozen before that.
    pub frozen_total: Duration,
    /// When it was last thawed (or resumed by its user).
    pub thawed_at: Option<Instant>,
    /// Held: its user paused it; the service neither freezes nor thaws it.
    pub held: bool,
}

/// One container of an enforced vGPU.
#[derive(Debug)]
pub(super) struct Member {
    /// The container's id.
    pub container: String,
    /// Its freezer cgroup.
    pub cgroup: FreezerCgroup,
    /// Its files read at every sample, kept open.
    pub reader: CgroupReader,
    /// Pidfds of some of its processes, watched for their exits.
    pub exits: Vec<std::os::fd::OwnedFd>,
    /// Attached before it started, and not started yet: neither sampled nor frozen (see
    /// [`Unstarted`]).
    pub unstarted: Option<Unstarted>,
}

impl Member {
    pub fn new(container: &str, cgroup: FreezerCgroup) -> Member {
        Member {
            container: container.to_owned(),
            reader: CgroupReader::new(cgroup.clone()),
            exits: Vec::new(),
            cgroup,
            unstarted: None,
        }
    }

    /// Whether any process is left in its cgroup; `None` (said in the log) when that cannot be
    /// told.
    pub fn still_runs(&mut self, vgpu: VgpuId) -> Option<bool> {
        match self.reader.is_populated() {
            Ok(populated) => Some(populated),
            Err(CgroupError::Gone(_)) => Some(false),
            Err(err) => {
                tracing::warn!(
                    "{vgpu} ({}): cannot tell whether it still runs: {err}",
                    self.container
                );
                None
            }
        }
    }
}

impl Enforced {
    pub fn new(first: Member) -> Enforced {
        Enforced {
            members: vec![first],
            frozen_since: None,
            frozen_total: Duration::ZERO,
            thawed_at: None,
            held: false,
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

    /// The containers whose processes are all gone.
    pub fn gone(&mut self, vgpu: VgpuId) -> Vec<String> {
        (self.members.iter_mut())
            .filter_map(|m| (m.still_runs(vgpu) == Some(false)).then(|| m.container.clone()))
            .collect()
    }

    /// The member that is container `id`.
    pub fn member(&self, id: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.container == id)
    }

    /// The cgroups a freeze of it freezes: its started containers' (an unstarted one is left
    /// to start: runc refuses to start a container it finds frozen).
    pub fn freezable(&self) -> impl Iterator<Item = &FreezerCgroup> {
        (self.members.iter())
            .filter(|m| m.unstarted.is_none())
            .map(|m| &m.cgroup)
    }

    /// Seconds frozen so far, the current freeze included.
    pub fn frozen_seconds(&self) -> Duration {
        self.frozen_total + self.frozen_since.map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// Thaws every container of it if the service froze it (never when held); true when it
    /// did. A container gone meanwhile is thawed already; `Gone` comes back only when all are.
    pub fn thaw(&mut self, vgpu: VgpuId) -> Result<bool, CgroupError> {
        let Some(since) = self.frozen_since.filter(|_| !self.held) else {
            return Ok(false);
        };
        let mut failed = None;
        let mut gone = None;
        for m in &self.members {
            match m.cgroup.thaw() {
                Ok(()) => {}
                Err(e @ CgroupError::Gone(_)) => gone = Some(e),
                Err(e) => {
                    tracing::error!("{vgpu} ({}): thaw failed: {e}", m.container);
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.frozen_since = None;
        self.frozen_total += since.elapsed();
        self.thawed_at = Some(Instant::now());
        match gone {
            Some(e) if self.members.len() == 1 => Err(e),
            _ => Ok(true),
        }
    }
}

/// What the freeze of one vGPU's containers came to.
#[derive(Default)]
struct Frozen {
    /// A container is frozen (or could not be thawed again).
    frozen: bool,
    /// A container's freeze failed and was undone.
    failed: bool,
    /// A container's cgroup is gone.
    gone: bool,
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
            // Every container of every vGPU to freeze, requested together.
            let (owners, cgroups): (Vec<VgpuId>, Vec<&FreezerCgroup>) = freezes
                .iter()
                .flat_map(|v| self.enforced[v].freezable().map(move |c| (*v, c)))
                .unzip();
            let results = freeze_all(&cgroups, self.config.service.freeze_timeout);
            let at = Instant::now();
            let mut outcome: BTreeMap<VgpuId, Frozen> = BTreeMap::new();
            for (vgpu, result) in owners.into_iter().zip(results) {
                let seen = outcome.entry(vgpu).or_default();
                match result {
                    Ok(()) => seen.frozen = true,
                    Err(CgroupError::Gone(_)) => seen.gone = true,
                    Err(e @ CgroupError::StillFrozen { .. }) => {
                        // Counted as frozen, so that every later thaw order, release and
                        // shutdown tries again.
                        seen.frozen = true;
                        tracing::error!("{vgpu}: freeze failed and so did undoing it: {e}");
                    }
                    Err(e) => {
                        seen.failed = true;
                        tracing::error!(
                            "{vgpu}: freeze failed and was undone, it runs on outside its window: {e}"
                        );
                    }
                }
            }
            for (vgpu, seen) in outcome {
                let e = self.enforced.get_mut(&vgpu).expect("collected above");
                if seen.frozen {
                    e.frozen_since.get_or_insert(at);
                }
                if seen.failed && seen.frozen {
                    // Its other containers run on too: a vGPU's containers take windows
                    // together, and nothing stays frozen that the scheduler thinks runs.
                    let _ = e.thaw(vgpu);
                }
                if seen.gone {
                    exited.push(vgpu);
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
            self.exit_seen(vgpu);
        }
    }

    /// Freezes containers that started while the rest of their vGPU was frozen (they were
    /// left to start: see [`Enforced::freezable`]), so that a vGPU's containers take its
    /// windows together. A freeze that fails leaves that container running, and says so.
    pub(super) fn freeze_joining(&mut self, joining: Vec<(VgpuId, FreezerCgroup)>) {
        if joining.is_empty() {
            return;
        }
        // The list has every container of a frozen vGPU, these too.
        if self.watchdog.is_none() || !self.record_frozen(&[]) {
            tracing::error!(
                "{} container(s) that started in a frozen vGPU run on: no watchdog, or the frozen list cannot be written",
                joining.len()
            );
            return;
        }
        let cgroups: Vec<&FreezerCgroup> = joining.iter().map(|(_, c)| c).collect();
        let results = freeze_all(&cgroups, self.config.service.freeze_timeout);
        for ((vgpu, cgroup), result) in joining.iter().zip(results) {
            if let Err(e) = result {
                tracing::warn!(
                    "{vgpu}: {} started while its vGPU is frozen and could not be frozen with it; it runs on until the next window: {e}",
                    cgroup.path().display()
                );
            }
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

    /// Watches the exits of `vgpu`'s containers' processes as they are now.
    pub(super) fn watch_exits(&mut self, vgpu: VgpuId) {
        let (Some(watch), Some(e)) = (&self.exit_watch, self.enforced.get_mut(&vgpu)) else {
            return;
        };
        for m in &mut e.members {
            m.exits.clear();
            if let Ok(pids) = m.reader.pids() {
                m.exits = watch.watch(vgpu, &pids);
            }
        }
    }

    /// A process of one of `vgpu`'s containers exited: lets go of each container with none
    /// left, and watches the processes the others have now.
    pub(super) fn exit_seen(&mut self, vgpu: VgpuId) {
        let Some(gone) = self.enforced.get_mut(&vgpu).map(|e| e.gone(vgpu)) else {
            return;
        };
        for container in &gone {
            self.container_exited(vgpu, container);
        }
        if self.enforced.contains_key(&vgpu) {
            self.watch_exits(vgpu);
        }
    }

    /// Lets go of a container whose processes are all gone: its vGPU is released, unless it
    /// is a claim's, which stays reserved for the claim (the pod's other containers keep it,
    /// its next ones attach).
    pub(super) fn container_exited(&mut self, vgpu: VgpuId, container: &str) {
        let now = self.now();
        if let Some(detached) = self.node.detach(vgpu, container, now) {
            let claim = detached.record.claim.as_deref().unwrap_or_default();
            let left = detached.record.attachments.len() - 1;
            tracing::info!(
                "{vgpu} ({container}): its processes are gone; detached, still pinned for claim {claim} with {left} container(s)"
            );
            if let Some(e) = self.enforced.get_mut(&vgpu) {
                if let Some(at) = e.members.iter().position(|m| m.container == container) {
                    let member = e.members.remove(at);
                    if e.frozen_since.is_some() && !e.held {
                        let _ = member.cgroup.thaw();
                    }
                }
                if e.members.is_empty() {
                    self.enforced.remove(&vgpu);
                    self.sampler.forget(vgpu);
                }
            }
            self.record_frozen(&[]);
            if let Err(e) = self.save_enforced(vgpu) {
                tracing::error!("{vgpu}: {e}; a restart would find {container} gone and keep the claim's reservation");
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
        let identities = gpuplex_wire::identity::identity_dir(&self.config.service.socket);
        if let Err(e) = gpuplex_wire::identity::remove(&identities, vgpu) {
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
