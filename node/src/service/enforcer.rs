//! [`Enforcer`]: the scheduler's freeze and thaw orders carried out on the attached vGPUs'
//! cgroups, through a [`Freezer`], with the frozen list that makes every freeze undoable.
//!
//! Its rules:
//!
//! - Freezes are carried out before thaws, so that a switch never lets two containers of one
//!   GPU run at once; all the freezes of one decision are requested together and confirmed
//!   together ([`Freezer::freeze_all`]). A freeze that cannot be confirmed is undone by the
//!   freezer and logged: the container runs on rather than stay frozen outside a window.
//! - Every freeze has a way back: its cgroup is on the frozen list (`state_dir/frozen.json`,
//!   which the watchdog and a restart thaw) before it is frozen, and nothing is frozen while no
//!   watchdog watches ([`Enforcer::set_watched`]) or the list cannot be written. After each
//!   change the list is written again, so that it holds exactly the cgroups the service froze.
//! - A thaw that fails leaves its vGPU counted as frozen, and on the list: the next thaw order,
//!   release, exit or shutdown tries again.
//! - A held container (its user paused it) is its user's: no order freezes or thaws it.
//! - A cgroup that vanished is its container gone: the vGPU is reported back
//!   ([`Enforcer::apply`]) for the service to let go of.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuplex_cgroup::{CgroupError, FreezerCgroup};
use gpuplex_scheduler::windows::Action;
use gpuplex_scheduler::VgpuId;

use super::enforced::{Enforced, Member};
use super::freezer::Freezer;
use super::repeated::{Repeated, Say};
use crate::state::{SavedFreezer, SavedFrozen, StateDir};

/// The attached vGPUs as enforced, and how.
pub(super) struct Enforcer {
    enforced: BTreeMap<VgpuId, Enforced>,
    freezer: Box<dyn Freezer>,
    /// Where the frozen list is written.
    list: StateDir,
    /// The frozen list as last written (`None`: not written yet).
    saved: Option<Vec<SavedFreezer>>,
    /// A watchdog thaws the frozen list if the service dies: without one nothing is frozen.
    watched: bool,
    /// How long a freeze may take to be confirmed.
    freeze_timeout: Duration,
    /// Failures to write the frozen list, logged as they begin, recur and end.
    list_failures: Repeated,
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

impl Enforcer {
    /// Nothing enforced; the frozen list goes to `list`; nothing is frozen until
    /// [`Enforcer::set_watched`].
    pub fn new(freezer: Box<dyn Freezer>, list: StateDir, freeze_timeout: Duration) -> Enforcer {
        Enforcer {
            enforced: BTreeMap::new(),
            freezer,
            list,
            saved: None,
            watched: false,
            freeze_timeout,
            list_failures: Repeated::default(),
        }
    }

    /// Whether a watchdog now watches (it thaws the frozen list if the service dies).
    pub fn set_watched(&mut self, watched: bool) {
        self.watched = watched;
    }

    /// The vGPU, if enforced.
    pub fn get(&self, vgpu: VgpuId) -> Option<&Enforced> {
        self.enforced.get(&vgpu)
    }

    /// The vGPU, if enforced, to read its containers' files (its freezes and thaws are the
    /// enforcer's).
    pub fn get_mut(&mut self, vgpu: VgpuId) -> Option<&mut Enforced> {
        self.enforced.get_mut(&vgpu)
    }

    /// Whether the vGPU is enforced.
    pub fn contains(&self, vgpu: VgpuId) -> bool {
        self.enforced.contains_key(&vgpu)
    }

    /// Every enforced vGPU.
    pub fn iter(&self) -> impl Iterator<Item = (VgpuId, &Enforced)> {
        self.enforced.iter().map(|(v, e)| (*v, e))
    }

    /// Every enforced vGPU, to read its containers' files.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (VgpuId, &mut Enforced)> {
        self.enforced.iter_mut().map(|(v, e)| (*v, e))
    }

    /// Enforces `member` as a container of `vgpu` (its first, or one more of a claim's pod).
    pub fn add(&mut self, vgpu: VgpuId, member: Member) {
        match self.enforced.get_mut(&vgpu) {
            Some(e) => e.members.push(member),
            None => {
                self.enforced.insert(vgpu, Enforced::new(member));
            }
        }
    }

    /// Enforces a recovered vGPU as it was.
    pub fn insert(&mut self, vgpu: VgpuId, enforced: Enforced) {
        self.enforced.insert(vgpu, enforced);
    }

    /// Takes back a container just added whose attachment could not be saved: it was never
    /// enforced (neither frozen nor thawed here).
    pub fn withdraw(&mut self, vgpu: VgpuId, container: &str) {
        if let Some(e) = self.enforced.get_mut(&vgpu) {
            e.members.retain(|m| m.container != container);
            if e.members.is_empty() {
                self.enforced.remove(&vgpu);
            }
        }
    }

    /// The time `vgpu` has spent frozen, if enforced.
    pub fn frozen_time(&self, vgpu: VgpuId) -> Option<Duration> {
        self.enforced.get(&vgpu).map(Enforced::frozen_seconds)
    }

    /// Writes the frozen list: every cgroup the service froze, and those of `about` (about to be
    /// frozen), when it changed. False when it could not be written: then nothing more may be
    /// frozen, since neither the watchdog nor a restart would know to thaw it.
    pub fn record_frozen(&mut self, about: &[VgpuId]) -> bool {
        let mut list: Vec<SavedFreezer> = self
            .enforced
            .iter()
            .filter(|(v, e)| !e.held && (e.frozen_since.is_some() || about.contains(v)))
            .flat_map(|(_, e)| e.members.iter().map(|m| SavedFreezer::of(&m.cgroup)))
            .collect();
        list.sort();
        list.dedup();
        if self.saved.as_ref() == Some(&list) {
            return true;
        }
        let saved = SavedFrozen {
            format: crate::state::FORMAT,
            frozen: list.clone(),
        };
        match self.list.save_frozen(&saved) {
            Ok(()) => {
                self.saved = Some(list);
                if self.list_failures.succeeded() {
                    tracing::info!(
                        "the frozen list can be written again: windows are enforced again"
                    );
                }
                true
            }
            Err(e) => {
                match self.list_failures.failed(Instant::now()) {
                    Say::Nothing => {}
                    Say::First => tracing::error!(
                        "{e}; nothing is frozen until the frozen list can be written"
                    ),
                    Say::Again(n) => tracing::error!(
                        "{e} (and {n} more times since the last line); still nothing is frozen"
                    ),
                }
                false
            }
        }
    }

    /// Carries out freeze and thaw orders: freezes first, confirmed together, then thaws.
    /// Orders naming a held container are not carried out (the scheduler gives none). Returns
    /// the vGPUs whose cgroups vanished (their containers exited), for the caller to let go.
    pub fn apply(&mut self, actions: &[Action]) -> Vec<VgpuId> {
        let mut exited = Vec::new();
        if actions.is_empty() {
            return exited;
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
        if !freezes.is_empty() && (!self.watched || !self.record_frozen(&freezes)) {
            tracing::error!(
                "{} freeze(s) not carried out: no watchdog, or the frozen list cannot be written; they run on outside their windows",
                freezes.len()
            );
            freezes.clear();
        }
        if !freezes.is_empty() {
            exited = self.freeze(&freezes);
        }
        let frozen_at = started.elapsed();
        let mut thawed = 0;
        for action in actions {
            if let Action::Thaw(vgpu) = action {
                if let Some(e) = self.enforced.get_mut(vgpu).filter(|e| !e.held) {
                    match e.thaw(*vgpu, self.freezer.as_ref()) {
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
        exited
    }

    /// Freezes every container of `freezes` (on the frozen list already), requested together;
    /// the vGPUs whose cgroups vanished.
    fn freeze(&mut self, freezes: &[VgpuId]) -> Vec<VgpuId> {
        let (owners, cgroups): (Vec<VgpuId>, Vec<&FreezerCgroup>) = freezes
            .iter()
            .flat_map(|v| self.enforced[v].freezable().map(move |c| (*v, c)))
            .unzip();
        let results = self.freezer.freeze_all(&cgroups, self.freeze_timeout);
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
        let mut exited = Vec::new();
        for (vgpu, seen) in outcome {
            let e = self.enforced.get_mut(&vgpu).expect("collected above");
            if seen.frozen {
                e.frozen_since.get_or_insert(at);
            }
            if seen.failed && seen.frozen {
                // Its other containers run on too: a vGPU's containers take windows
                // together, and nothing stays frozen that the scheduler thinks runs.
                let _ = e.thaw(vgpu, self.freezer.as_ref());
            }
            if seen.gone {
                exited.push(vgpu);
            }
        }
        exited
    }

    /// Freezes containers that started while the rest of their vGPU was frozen (they were
    /// left to start: see [`Enforced::freezable`]), so that a vGPU's containers take its
    /// windows together. A freeze that fails leaves that container running, and says so.
    pub fn freeze_joining(&mut self, joining: Vec<(VgpuId, FreezerCgroup)>) {
        if joining.is_empty() {
            return;
        }
        // The list has every container of a frozen vGPU, these too.
        if !self.watched || !self.record_frozen(&[]) {
            tracing::error!(
                "{} container(s) that started in a frozen vGPU run on: no watchdog, or the frozen list cannot be written",
                joining.len()
            );
            return;
        }
        let cgroups: Vec<&FreezerCgroup> = joining.iter().map(|(_, c)| c).collect();
        let results = self.freezer.freeze_all(&cgroups, self.freeze_timeout);
        for ((vgpu, cgroup), result) in joining.iter().zip(results) {
            if let Err(e) = result {
                tracing::warn!(
                    "{vgpu}: {} started while its vGPU is frozen and could not be frozen with it; it runs on until the next window: {e}",
                    cgroup.path().display()
                );
            }
        }
    }

    /// Thaws `vgpu` if the service froze it (a stop wins over windows), and writes the list.
    pub fn thaw(&mut self, vgpu: VgpuId) {
        if let Some(e) = self.enforced.get_mut(&vgpu) {
            let _ = e.thaw(vgpu, self.freezer.as_ref());
        }
        self.record_frozen(&[]);
    }

    /// Thaws every container the service froze; returns how many vGPUs.
    pub fn thaw_all(&mut self) -> usize {
        let mut thawed = 0;
        for (vgpu, e) in self.enforced.iter_mut() {
            if let Ok(true) = e.thaw(*vgpu, self.freezer.as_ref()) {
                thawed += 1;
            }
        }
        self.record_frozen(&[]);
        thawed
    }

    /// Stops enforcing `vgpu` (the node no longer has it): thaws it if the service froze it.
    /// True when it was enforced.
    pub fn forget(&mut self, vgpu: VgpuId) -> bool {
        let Some(mut e) = self.enforced.remove(&vgpu) else {
            return false;
        };
        let _ = e.thaw(vgpu, self.freezer.as_ref());
        self.record_frozen(&[]);
        true
    }

    /// Stops enforcing one container of `vgpu` (its processes are gone; the vGPU stays, a
    /// claim's): thawed if the service froze it. True when `vgpu` has no container left and so
    /// is no longer enforced.
    pub fn let_go(&mut self, vgpu: VgpuId, container: &str) -> bool {
        let mut emptied = false;
        if let Some(e) = self.enforced.get_mut(&vgpu) {
            if let Some(at) = e.members.iter().position(|m| m.container == container) {
                let member = e.members.remove(at);
                if e.frozen_since.is_some() && !e.held {
                    let _ = self.freezer.thaw(&member.cgroup);
                }
            }
            if e.members.is_empty() {
                self.enforced.remove(&vgpu);
                emptied = true;
            }
        }
        self.record_frozen(&[]);
        emptied
    }

    /// Its user paused `vgpu` (`held`) or resumed it: a freeze of the service's in force
    /// becomes its user's pause, off the frozen list (the watchdog must not undo it). Holding
    /// what is held, or unholding what is not, changes nothing.
    pub fn set_held(&mut self, vgpu: VgpuId, held: bool) {
        if let Some(e) = self.enforced.get_mut(&vgpu).filter(|e| e.held != held) {
            e.set_held(held);
        }
        self.record_frozen(&[]);
    }

    /// Whether any container of `vgpu` reads frozen now.
    pub fn reads_frozen(&self, vgpu: VgpuId) -> bool {
        let mut members = self
            .enforced
            .get(&vgpu)
            .into_iter()
            .flat_map(|e| &e.members);
        members.any(|m| self.freezer.is_frozen(&m.cgroup).unwrap_or(false))
    }
}

#[cfg(test)]
#[path = "enforcer_tests.rs"]
mod tests;
