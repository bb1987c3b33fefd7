//! The service's side of enforcement: the scheduler's orders handed to the [`Enforcer`]
//! (`enforcer.rs`, over a [`Freezer`](super::freezer::Freezer)); containers admitted (the one
//! [`Admission`] check at register, attach and recovery) and enforced from their attachment;
//! and let go of when their processes are gone or the node no longer has their vGPU.
//!
//! [`Enforcer`]: super::enforcer::Enforcer

use gpuplex_cgroup::{Admission, FreezerCgroup};
use gpuplex_scheduler::node::{Attachment, ReleaseKey, Target};
use gpuplex_scheduler::windows::Action;
use gpuplex_scheduler::VgpuId;

use super::enforced::Member;
use super::unstarted::Unstarted;
use super::Service;

impl Service {
    /// Carries out freeze and thaw orders ([`super::enforcer::Enforcer::apply`]), and lets go
    /// of the containers whose cgroups vanished meanwhile.
    pub(super) fn carry_out(&mut self, actions: &[Action]) {
        for vgpu in self.enforcer.apply(actions) {
            self.exit_seen(vgpu);
        }
    }

    /// Watches the exits of `vgpu`'s containers' processes as they are now.
    pub(super) fn watch_exits(&mut self, vgpu: VgpuId) {
        let (Some(watch), Some(e)) = (&self.exit_watch, self.enforcer.get_mut(vgpu)) else {
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
        let Some(gone) = self.enforcer.get_mut(vgpu).map(|e| e.gone(vgpu)) else {
            return;
        };
        for container in &gone {
            self.container_exited(vgpu, container);
        }
        if self.enforcer.contains(vgpu) {
            self.watch_exits(vgpu);
        }
    }

    /// Lets go of a container whose processes are all gone: its vGPU is released, unless it
    /// is a claim's, which stays reserved for the claim (the pod's other containers keep it,
    /// its next ones attach).
    pub(super) fn container_exited(&mut self, vgpu: VgpuId, container: &str) {
        let now = self.now();
        if let Some(detached) = self.registry.node_mut().detach(vgpu, container, now) {
            let claim = detached.record.claim.as_deref().unwrap_or_default();
            let left = detached.record.attachments.len() - 1;
            tracing::info!(
                "{vgpu} ({container}): its processes are gone; detached, still pinned for claim {claim} with {left} container(s)"
            );
            if self.enforcer.let_go(vgpu, container) {
                self.sampler.forget(vgpu);
            }
            if let Err(e) = self.save_enforced(vgpu) {
                tracing::error!("{vgpu}: {e}; a restart would find {container} gone and keep the claim's reservation");
            }
            return;
        }
        if let Some(released) = (self.registry.node_mut()).release(&ReleaseKey::Vgpu(vgpu), now) {
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
        self.enforcer.forget(vgpu);
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
        if let Err(e) = self.registry.remove(vgpu) {
            tracing::error!("{vgpu}: {e}; a restart would recover it, and then drop it if its container is gone");
        }
    }

    /// The freezer cgroup of a target, when the service may freeze it as a container's
    /// ([`gpuplex_cgroup::Admission`]: the same check at register, attach and recovery).
    pub(super) fn admitted_cgroup(&self, target: &Target) -> Result<FreezerCgroup, String> {
        let found = match target {
            Target::Pid(pid) => FreezerCgroup::of_pid(*pid, &self.hierarchies),
            Target::Cgroup(path) => FreezerCgroup::at(path.as_ref(), &self.hierarchies),
        };
        let cgroup = found.map_err(|e| e.to_string())?;
        self.admit(&cgroup)?;
        Ok(cgroup)
    }

    /// [`gpuplex_cgroup::Admission::check`] against every cgroup enforced now.
    pub(super) fn admit(&self, cgroup: &FreezerCgroup) -> Result<(), String> {
        let enforced = self.enforcer.iter().flat_map(|(v, e)| {
            (e.members.iter()).map(move |m| (format!("{v} (container {})", m.container), &m.cgroup))
        });
        let watchdog: Vec<u32> = self.watchdog.iter().map(|w| w.pid()).collect();
        let admission = Admission::of_processes(&self.hierarchies, &watchdog)
            .map_err(|e| format!("cannot tell the node service's own cgroups: {e}"))?;
        admission.check(cgroup, enforced).map_err(|e| e.to_string())
    }

    /// Enforces a container the node just attached to `vgpu` from now on (the first, or one
    /// more of a claim's pod) and saves it. On failure it is not enforced, and the node lets it
    /// go: a claim's vGPU is detached from it, any other vGPU released.
    pub(super) fn enforce(
        &mut self,
        vgpu: VgpuId,
        cgroup: FreezerCgroup,
        attachment: &Attachment,
        unstarted: bool,
    ) -> Result<(), String> {
        let mut member = Member::new(&attachment.container, cgroup.clone());
        // A container attached between its runtime's `create` and `start` (podman's and runc's
        // createRuntime hook, the shim) is not sampled before it starts; a running process
        // (`gpuplexctl register --pid`) is sampled at once.
        if let (true, Target::Pid(pid)) = (unstarted, &attachment.target) {
            member.unstarted = Unstarted::of(*pid);
        }
        self.enforcer.add(vgpu, member);
        let container = &attachment.container;
        let saved = (self.registry).save_attached(vgpu, container, self.enforcer.get(vgpu));
        if let Err(refused) = saved {
            self.enforcer.withdraw(vgpu, container);
            return Err(refused);
        }
        self.watch_exits(vgpu);
        tracing::info!(
            "{vgpu}: {} attached on GPU {}, freezer {} {}",
            attachment.container,
            self.gpus_of(vgpu),
            cgroup.version(),
            cgroup.path().display()
        );
        Ok(())
    }
}
