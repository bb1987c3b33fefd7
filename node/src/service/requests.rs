//! The node socket's requests, carried out: the node decides, the service finds cgroups, and
//! the [`Registry`](super::registry::Registry) saves the result before it is answered. A
//! request that fails leaves nothing behind: a reservation or registration whose record cannot
//! be saved is released again; a hold or unhold that cannot be saved is refused, and changes
//! nothing.
//!
//! A reservation's handle is drawn here, from the kernel's random source, and shown only in the
//! reply to the request that made it. Every cgroup a request names passes the one
//! [`gpuplex_cgroup::Admission`] check before anything is bound to it.

use std::collections::BTreeMap;
use std::time::SystemTime;

use gpuplex_scheduler::node::{Attachment, Placement, ReleaseKey, VgpuRecord};
use gpuplex_scheduler::units::UnitId;
use gpuplex_scheduler::{Handle, VgpuId};
use gpuplex_wire::protocol::cdi::CdiEdits;
use gpuplex_wire::protocol::{EventsReply, Reply, Request, VgpuReply};

use super::Service;
use crate::gpus::GpuSource;

impl Service {
    /// Carries out one request and says how it went.
    pub fn handle(&mut self, request: Request) -> Reply {
        let gives_ids = matches!(
            request,
            Request::Reserve { .. }
                | Request::Register { .. }
                | Request::Pin { .. }
                | Request::Allocate { .. }
        );
        if gives_ids {
            if let Err(e) = self.registry.ids_saved() {
                return Reply::refused(e);
            }
        }
        match request {
            Request::Status => {
                self.cdi.refresh();
                Reply::Status(Box::new(self.status()))
            }
            Request::Events { since } => {
                // The node's clock is the service's origin, offset by reservation_ttl.
                let now = self.now();
                let wall = crate::state::unix_ms(SystemTime::now());
                let at_ms = |at: gpuplex_scheduler::Instant| {
                    let ago = now.saturating_since(at).as_millis() as u64;
                    wall.saturating_sub(ago)
                };
                Reply::Events(EventsReply::of(self.registry.node(), since, at_ms))
            }
            Request::Release(key) => self.release(&key),
            Request::Hold { key, held } => self.hold(&key, held),
            Request::Stopping { key, signal } => self.stopping(&key, signal),
            Request::Reserve { annotations } => self.reserve(&annotations),
            Request::Attach {
                handle,
                attachment,
                unstarted,
                asked,
            } => self.attach(&handle, attachment, unstarted, &asked),
            Request::Register {
                annotations,
                attachment,
                unstarted,
            } => self.register(&annotations, attachment, unstarted),
            Request::Pin {
                claim,
                placement,
                annotations,
            } => self.pin(&claim, &placement, &annotations),
            Request::Allocate { units, unit } => self.allocate(&units, unit),
            // The node's capacity now; the socket makes a connection that asks a watcher
            // (`Service::watch`), which is sent this view first.
            Request::Watch => Reply::Capacity(Box::new(self.fresh_view())),
        }
    }

    fn no_gpu(&self) -> Option<Reply> {
        if !self.gpus.is_empty() {
            return None;
        }
        let why = match &self.source {
            GpuSource::None(why) => why.as_str(),
            _ => "no GPU was found",
        };
        Some(Reply::refused(format!(
            "this node has no GPU to assign: {why}"
        )))
    }

    fn reserve(&mut self, annotations: &BTreeMap<String, String>) -> Reply {
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let handle = match self.registry.draw_handle() {
            Ok(h) => h,
            Err(e) => return Reply::refused(e),
        };
        let now = self.now();
        let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let vgpu = match self.registry.node_mut().reserve(pairs, handle, now) {
            Ok(record) => record.id,
            Err(e) => return Reply::refused(e),
        };
        let cdi = match self.cdi_edits(vgpu) {
            Ok(cdi) => cdi,
            Err(refused) => return Reply::refused(refused),
        };
        if let Err(e) = self.registry.save_new(vgpu) {
            return Reply::refused(e);
        }
        tracing::info!("{vgpu}: reserved on GPU {}", self.gpus_of(vgpu));
        new_vgpu(self.reply(vgpu), handle, cdi)
    }

    /// Pins a vGPU for a ResourceClaim where kube-scheduler placed it, saved before the reply;
    /// the same claim placed the same way again gets the same vGPU, handle and edits.
    fn pin(
        &mut self,
        claim: &str,
        placement: &Placement,
        annotations: &BTreeMap<String, String>,
    ) -> Reply {
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let fresh = match self.registry.draw_handle() {
            Ok(h) => h,
            Err(e) => return Reply::refused(e),
        };
        let now = self.now();
        let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let vgpu = match (self.registry.node_mut()).pin(claim, pairs, placement, fresh, now) {
            Ok(record) => record.id,
            Err(e) => return Reply::refused(e),
        };
        self.pinned(vgpu, fresh, &format!("claim {claim}"))
    }

    /// The reply to a pin or an allocation of `vgpu` (`fresh`: the handle drawn for it, which
    /// it has when it is new): a new one gets its CDI edits and is saved before the reply; one
    /// pinned before changes nothing, whatever the CDI spec says now.
    fn pinned(&mut self, vgpu: VgpuId, fresh: Handle, what: &str) -> Reply {
        let handle = self
            .registry
            .node()
            .record(vgpu)
            .map_or(fresh, |r| r.handle);
        if handle != fresh {
            let gpus = self.gpu_uuids_of(vgpu);
            let gpus: Vec<(u32, &str)> = gpus.iter().map(|(i, u)| (*i, u.as_str())).collect();
            let cdi = self.cdi.edits_for(&gpus).ok().flatten();
            return new_vgpu(self.reply(vgpu), handle, cdi);
        }
        let cdi = match self.cdi_edits(vgpu) {
            Ok(cdi) => cdi,
            Err(refused) => return Reply::refused(refused),
        };
        if let Err(e) = self.registry.save_new(vgpu) {
            return Reply::refused(e);
        }
        tracing::info!("{vgpu}: pinned for {what} on GPU {}", self.gpus_of(vgpu));
        new_vgpu(self.reply(vgpu), handle, cdi)
    }

    /// Pins the vGPU of the device plugin's units, saved before the reply, after releasing the
    /// allocations that held any of them (their containers thawed, their files removed); the
    /// same units again get the same vGPU, handle and edits.
    fn allocate(&mut self, units: &[UnitId], unit: u64) -> Reply {
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let fresh = match self.registry.draw_handle() {
            Ok(h) => h,
            Err(e) => return Reply::refused(e),
        };
        let now = self.now();
        let allocated = (self.registry.node_mut()).allocate(units, unit, fresh, now);
        let allocated = match allocated {
            Ok(a) => a,
            Err(e) => return Reply::refused(e),
        };
        for released in &allocated.released {
            let vgpu = released.record.id;
            let key = released.record.claim.as_deref().unwrap_or_default();
            tracing::info!("{vgpu}: released, the kubelet gave its units ({key}...) again");
            self.forget(vgpu);
        }
        let what = format!("{} unit(s) of the device plugin", units.len());
        self.pinned(allocated.vgpu, fresh, &what)
    }

    /// A vGPU's GPUs with their UUIDs, as the CDI registry chooses edits for them.
    fn gpu_uuids_of(&self, vgpu: VgpuId) -> Vec<(u32, String)> {
        let assigned = self
            .registry
            .node()
            .record(vgpu)
            .map(|r| &r.assignment.gpus);
        assigned
            .into_iter()
            .flatten()
            .filter_map(|&g| Some((g.0, self.registry.node().inventory().gpu(g)?.uuid.clone())))
            .collect()
    }

    /// The CDI edits for a new vGPU's GPUs; when there are none to be had (a broken spec, one
    /// that disagrees with the GPUs), the vGPU is released and the refusal says why.
    fn cdi_edits(&mut self, vgpu: VgpuId) -> Result<Option<CdiEdits>, String> {
        let gpus = self.gpu_uuids_of(vgpu);
        let gpus: Vec<(u32, &str)> = gpus.iter().map(|(i, u)| (*i, u.as_str())).collect();
        let edits = self.cdi.edits_for(&gpus);
        if edits.is_err() {
            self.registry.undo_new(vgpu);
        }
        edits
    }

    fn attach(
        &mut self,
        handle: &Handle,
        attachment: Attachment,
        unstarted: bool,
        asked: &BTreeMap<String, String>,
    ) -> Reply {
        if let Some(vgpu) = self.registry.node().vgpu_with(handle) {
            let record = self.registry.node().record(vgpu);
            if record.is_some_and(|r| r.containers().any(|c| c == attachment.container)) {
                return self.reply(vgpu);
            }
        }
        let cgroup = match self.admitted_cgroup(&attachment.target) {
            Ok(c) => c,
            Err(e) => return Reply::refused(e),
        };
        let now = self.now();
        let attached =
            (self.registry.node_mut()).attach_asking(handle, attachment.clone(), asked, now);
        let vgpu = match attached {
            Ok(record) => record.id,
            Err(e) => return Reply::refused(e),
        };
        if let Err(e) = self.enforce(vgpu, cgroup, &attachment, unstarted) {
            return Reply::refused(e);
        }
        self.reply(vgpu)
    }

    fn register(
        &mut self,
        annotations: &BTreeMap<String, String>,
        attachment: Attachment,
        unstarted: bool,
    ) -> Reply {
        if let Some(vgpu) = self.registry.node().vgpu_of(&attachment.container) {
            // The same container again (a hook that runs at two stages) gets its vGPU, without
            // the handle; the same id from another process gets nothing of it.
            let same = (self.registry.node())
                .record(vgpu)
                .is_some_and(|r| r.attachments.contains(&attachment));
            return if same {
                self.reply(vgpu)
            } else {
                Reply::refused(format!(
                    "container {} is already attached to {vgpu}, from another process or cgroup",
                    attachment.container
                ))
            };
        }
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let cgroup = match self.admitted_cgroup(&attachment.target) {
            Ok(c) => c,
            Err(e) => return Reply::refused(e),
        };
        let handle = match self.registry.draw_handle() {
            Ok(h) => h,
            Err(e) => return Reply::refused(e),
        };
        let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let now = self.now();
        let registered =
            (self.registry.node_mut()).register(pairs, handle, attachment.clone(), now);
        let vgpu = match registered {
            Ok(record) => record.id,
            Err(e) => return Reply::refused(e),
        };
        let cdi = match self.cdi_edits(vgpu) {
            Ok(cdi) => cdi,
            Err(refused) => return Reply::refused(refused),
        };
        if let Err(e) = self.enforce(vgpu, cgroup, &attachment, unstarted) {
            return Reply::refused(e);
        }
        new_vgpu(self.reply(vgpu), handle, cdi)
    }

    fn release(&mut self, key: &ReleaseKey) -> Reply {
        let now = self.now();
        let Some(released) = self.registry.node_mut().release(key, now) else {
            return Reply::Done;
        };
        let vgpu = released.record.id;
        tracing::info!(
            "{vgpu} ({}): released",
            match released.record.attachments.len() {
                0 => "no container".to_owned(),
                _ => released.record.containers().collect::<Vec<_>>().join(", "),
            }
        );
        let reply = Reply::vgpu(self.vgpu_reply(&released.record));
        self.forget(vgpu);
        reply
    }

    /// Holds a container its user paused (`held`), or lets it go again once its user resumed
    /// it. From the hold until the unhold the service never freezes or thaws its cgroup (a
    /// freeze of its own becomes its user's pause); the hold is saved before it takes effect,
    /// so that a restart does not thaw it either.
    fn hold(&mut self, key: &ReleaseKey, held: bool) -> Reply {
        let vgpu = match self.registry.node().holdable(key, held) {
            Ok(v) => v,
            Err(e) => return Reply::refused(e),
        };
        if self.registry.node().is_held(vgpu) == held {
            return self.reply(vgpu);
        }
        if !self.enforcer.contains(vgpu) {
            return Reply::refused(format!("{vgpu} has no cgroup the node service enforces"));
        }
        if let Err(e) = self.registry.hold(vgpu, held, self.enforcer.get(vgpu)) {
            return Reply::refused(e);
        }
        let container = self.container_of(vgpu);
        // A freeze of the service's became its user's pause: the watchdog must not undo it.
        self.enforcer.set_held(vgpu, held);
        if self.enforcer.contains(vgpu) {
            let frozen = self.enforcer.reads_frozen(vgpu);
            if held {
                tracing::info!(
                    "{vgpu} ({container}): held (paused by its user): no window, never frozen or thawed by gpuplex until unhold"
                );
            } else if frozen {
                tracing::warn!(
                    "{vgpu} ({container}): unheld while its cgroup is still frozen: it is left for its user to resume, and scheduled from its next sample"
                );
            } else {
                tracing::info!(
                    "{vgpu} ({container}): unheld (resumed by its user): scheduled again"
                );
            }
        }
        self.reply(vgpu)
    }

    /// Saves an enforced vGPU as it is now (a container of a claim's vGPU came or went).
    pub(super) fn save_enforced(&mut self, vgpu: VgpuId) -> Result<(), crate::state::StateError> {
        self.registry.save(vgpu, self.enforcer.get(vgpu))
    }

    pub(super) fn reply(&self, vgpu: VgpuId) -> Reply {
        match self.registry.node().record(vgpu) {
            Some(r) => Reply::vgpu(self.vgpu_reply(r)),
            None => Reply::Done,
        }
    }

    /// The node's reply for a vGPU, with each GPU's device node and whether it is fake: what
    /// the hook needs to inject it.
    fn vgpu_reply(&self, record: &VgpuRecord) -> VgpuReply {
        let mut reply = VgpuReply::of(self.registry.node(), record);
        for assigned in &mut reply.gpus {
            if let Some(g) = self.gpus.iter().find(|g| g.gpu.index.0 == assigned.index) {
                assigned.device = Some(g.device.clone());
                assigned.fake = g.fake;
            }
        }
        reply
    }

    pub(super) fn gpus_of(&self, vgpu: VgpuId) -> String {
        self.registry
            .node()
            .record(vgpu)
            .map_or(String::new(), |r| {
                let gpus: Vec<String> = r.assignment.gpus.iter().map(|g| g.0.to_string()).collect();
                gpus.join(",")
            })
    }

    pub(super) fn container_of(&self, vgpu: VgpuId) -> String {
        match self.registry.node().record(vgpu) {
            Some(r) if !r.attachments.is_empty() => r.containers().collect::<Vec<_>>().join(", "),
            _ => vgpu.to_string(),
        }
    }
}

/// The reply to the request that made a vGPU: with its handle and its CDI edits.
fn new_vgpu(mut reply: Reply, handle: Handle, cdi: Option<CdiEdits>) -> Reply {
    if let Reply::Vgpu(vgpu) = &mut reply {
        vgpu.handle = Some(handle);
        vgpu.cdi = cdi;
    }
    reply
}
