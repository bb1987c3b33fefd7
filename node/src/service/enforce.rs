//! The service's side of enforcement: the scheduler's orders handed to the [`Enforcer`]
//! (`enforcer.rs`, over a [`Freezer`](super::freezer::Freezer)), and containers let go of when
//! their processes are gone or the node no longer has their vGPU.
//!
//! [`Enforcer`]: super::enforcer::Enforcer

use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::windows::Action;
use gpuplex_scheduler::VgpuId;

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
}
