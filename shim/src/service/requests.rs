//! The node socket's requests, carried out: the node decides, the service finds cgroups and
//! saves the result before it answers. A request that fails leaves nothing behind: a
//! reservation or registration whose record cannot be saved is released again; a hold or unhold
//! that cannot be saved is refused, and changes nothing.

use std::collections::BTreeMap;
use std::time::SystemTime;

use gpuplex_scheduler::node::{Attachment, ReleaseKey, Target, VgpuRecord};
use gpuplex_scheduler::protocol::{DeviceNode, Reply, Request, VgpuReply};
use gpuplex_scheduler::VgpuId;

use super::enforce::Enforced;
use super::unstarted::Unstarted;
use super::Service;
use crate::cgroup::FreezerCgroup;
use crate::gpus::GpuSource;
use crate::state::{unix_ms, SavedAttachment, SavedFreezer, SavedGpu, SavedVgpu, FORMAT};

impl Service {
    /// Carries out one request and says how it went.
    pub fn handle(&mut self, request: Request) -> Reply {
        match request {
            Request::Status => {
                self.cdi.refresh();
                Reply {
                    ok: true,
                    status: Some(self.status()),
                    ..Reply::default()
                }
            }
            Request::Release(key) => self.release(&key),
            Request::Hold { key, held } => self.hold(&key, held),
            Request::Reserve { annotations } => self.reserve(&annotations),
            Request::Attach { vgpu, attachment } => self.attach(vgpu, attachment),
            Request::Register {
                annotations,
                attachment,
            } => self.register(&annotations, attachment),
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
        Some(Reply::error(format!(
            "this node has no GPU to assign: {why}"
        )))
    }

    fn reserve(&mut self, annotations: &BTreeMap<String, String>) -> Reply {
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let now = self.now();
        let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let vgpu = match self.node.reserve(pairs, now) {
            Ok(record) => record.id,
            Err(e) => return Reply::error(e),
        };
        let cdi = match self.cdi_edits(vgpu) {
            Ok(cdi) => cdi,
            Err(refused) => return Reply::error(refused),
        };
        if let Err(e) = self.save(vgpu, None) {
            return Reply::error(e);
        }
        tracing::info!("{vgpu}: reserved on GPU {}", self.gpus_of(vgpu));
        with_cdi(self.reply(vgpu), cdi)
    }

    /// The CDI edits for a new vGPU's GPUs; when there are none to be had (a broken spec, one
    /// that disagrees with the GPUs), the vGPU is released and the refusal says why.
    fn cdi_edits(&mut self, vgpu: VgpuId) -> Result<Option<serde_json::Value>, String> {
        let assigned = self.node.record(vgpu).map(|r| &r.assignment.gpus);
        let gpus: Vec<(u32, &str)> = assigned
            .into_iter()
            .flatten()
            .filter_map(|&g| Some((g.0, self.node.inventory().gpu(g)?.uuid.as_str())))
            .collect();
        let edits = self.cdi.edits_for(&gpus);
        if edits.is_err() {
            self.node.release(&ReleaseKey::Vgpu(vgpu), self.now());
        }
        edits
    }

    fn attach(&mut self, vgpu: VgpuId, attachment: Attachment) -> Reply {
        let attached = self.node.record(vgpu).and_then(|r| r.attachment.as_ref());
        if attached.is_some_and(|a| a.container == attachment.container) {
            return self.reply(vgpu);
        }
        let cgroup = match self.freezer_of(&attachment.target) {
            Ok(c) => c,
            Err(e) => return Reply::error(e),
        };
        if let Err(e) = self.node.attach(vgpu, attachment.clone(), self.now()) {
            return Reply::error(e);
        }
        if let Err(e) = self.enforce(vgpu, cgroup, &attachment) {
            return Reply::error(e);
        }
        self.reply(vgpu)
    }

    fn register(
        &mut self,
        annotations: &BTreeMap<String, String>,
        attachment: Attachment,
    ) -> Reply {
        if let Some(vgpu) = self.node.vgpu_of(&attachment.container) {
            return self.reply(vgpu);
        }
        if let Some(refused) = self.no_gpu() {
            return refused;
        }
        let cgroup = match self.freezer_of(&attachment.target) {
            Ok(c) => c,
            Err(e) => return Reply::error(e),
        };
        if let Some(other) = self
            .enforced
            .iter()
            .find(|(_, e)| e.cgroup.path() == cgroup.path())
        {
            return Reply::error(format!(
                "{} is already the cgroup of {} ({}): one cgroup is frozen as one container",
                cgroup.path().display(),
                self.container_of(*other.0),
                other.0
            ));
        }
        let pairs = annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let vgpu = match self.node.register(pairs, attachment.clone(), self.now()) {
            Ok(record) => record.id,
            Err(e) => return Reply::error(e),
        };
        let cdi = match self.cdi_edits(vgpu) {
            Ok(cdi) => cdi,
            Err(refused) => return Reply::error(refused),
        };
        if let Err(e) = self.enforce(vgpu, cgroup, &attachment) {
            return Reply::error(e);
        }
        with_cdi(self.reply(vgpu), cdi)
    }

    fn release(&mut self, key: &ReleaseKey) -> Reply {
        let Some(released) = self.node.release(key, self.now()) else {
            return Reply {
                ok: true,
                ..Reply::default()
            };
        };
        let vgpu = released.record.id;
        tracing::info!(
            "{vgpu} ({}): released",
            released
                .record
                .attachment
                .as_ref()
                .map_or("no container", |a| a.container.as_str())
        );
        let reply = Reply {
            ok: true,
            vgpu: Some(self.vgpu_reply(&released.record)),
            ..Reply::default()
        };
        self.forget(vgpu);
        reply
    }

    /// Holds a container its user paused (`held`), or lets it go again once its user resumed
    /// it. From the hold until the unhold the service never freezes or thaws its cgroup (a
    /// freeze of its own becomes its user's pause); the hold is saved before it takes effect,
    /// so that a restart does not thaw it either.
    fn hold(&mut self, key: &ReleaseKey, held: bool) -> Reply {
        let vgpu = match self.node.attached(key) {
            Ok(v) => v,
            Err(e) => return Reply::error(e),
        };
        if self.node.is_held(vgpu) == held {
            return self.reply(vgpu);
        }
        let Some(enforced) = self.enforced.get(&vgpu) else {
            return Reply::error(format!("{vgpu} has no cgroup the node service enforces"));
        };
        let saved = self.saved(vgpu, Some(&enforced.cgroup), held);
        if let Err(e) = self.state.save(&saved) {
            tracing::error!("{vgpu}: {e}");
            return Reply::error(if held {
                format!("{e}; {vgpu} is not held, since a restart would have thawed it")
            } else {
                format!("{e}; {vgpu} stays held, since a restart would have held it again")
            });
        }
        if let Err(e) = self.node.hold(&ReleaseKey::Vgpu(vgpu), held, self.now()) {
            return Reply::error(e);
        }
        let container = self.container_of(vgpu);
        if let Some(e) = self.enforced.get_mut(&vgpu) {
            e.set_held(held);
            let frozen = e.cgroup.is_frozen().unwrap_or(false);
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

    fn freezer_of(&self, target: &Target) -> Result<FreezerCgroup, String> {
        let found = match target {
            Target::Pid(pid) => FreezerCgroup::of_pid(*pid, &self.hierarchies),
            Target::Cgroup(path) => FreezerCgroup::at(path.as_ref(), &self.hierarchies),
        };
        found.map_err(|e| e.to_string())
    }

    /// Enforces an attached vGPU from now on and saves it; on failure it is released (see
    /// [`Service::save`]) and not enforced.
    fn enforce(
        &mut self,
        vgpu: VgpuId,
        cgroup: FreezerCgroup,
        attachment: &Attachment,
    ) -> Result<(), String> {
        let mut enforced = Enforced::new(cgroup.clone());
        // Every attach (podman's createRuntime, runc's createRuntime or prestart, the shim
        // after `runc create`) comes before the container starts.
        if let Target::Pid(pid) = attachment.target {
            enforced.unstarted = Unstarted::of(pid);
        }
        self.enforced.insert(vgpu, enforced);
        if let Err(e) = self.save(vgpu, Some(&cgroup)) {
            self.enforced.remove(&vgpu);
            return Err(e);
        }
        tracing::info!(
            "{vgpu}: {} attached on GPU {}, freezer {} {}",
            attachment.container,
            self.gpus_of(vgpu),
            cgroup.version(),
            cgroup.path().display()
        );
        Ok(())
    }

    /// What is saved of a vGPU (known to the node), `held` or not.
    fn saved(&self, vgpu: VgpuId, cgroup: Option<&FreezerCgroup>, held: bool) -> SavedVgpu {
        let record = self.node.record(vgpu).expect("a vGPU the node knows");
        let age = self.now().saturating_since(record.reserved_at);
        let reserved_at = SystemTime::now()
            .checked_sub(age)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let unstarted = self.enforced.get(&vgpu).and_then(|e| e.unstarted);
        let mut saved = saved_vgpu(record, cgroup, &self.node_gpu_uuids(), reserved_at, held);
        if let Some(a) = &mut saved.attachment {
            a.program = unstarted.map(|u| u.program());
        }
        saved
    }

    /// Saves a vGPU's record; on failure releases it and returns the error reply.
    fn save(&mut self, vgpu: VgpuId, cgroup: Option<&FreezerCgroup>) -> Result<(), String> {
        let saved = self.saved(vgpu, cgroup, self.node.is_held(vgpu));
        match self.state.save(&saved) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.node.release(&ReleaseKey::Vgpu(vgpu), self.now());
                let _ = self.state.remove(&vgpu.to_string());
                tracing::error!("{vgpu}: {e}");
                Err(format!(
                    "{e}; nothing was reserved, since a restart would have lost it"
                ))
            }
        }
    }

    fn node_gpu_uuids(&self) -> BTreeMap<u32, String> {
        self.gpus
            .iter()
            .map(|g| (g.gpu.index.0, g.gpu.uuid.clone()))
            .collect()
    }

    fn reply(&self, vgpu: VgpuId) -> Reply {
        Reply {
            ok: true,
            vgpu: self.node.record(vgpu).map(|r| self.vgpu_reply(r)),
            ..Reply::default()
        }
    }

    /// The node's reply for a vGPU, with each GPU's device node and whether it is fake: what
    /// the hook needs to inject it.
    fn vgpu_reply(&self, record: &VgpuRecord) -> VgpuReply {
        let mut reply = self.node.vgpu_reply(record);
        for assigned in &mut reply.gpus {
            if let Some(g) = self.gpus.iter().find(|g| g.gpu.index.0 == assigned.index) {
                assigned.device = Some(DeviceNode {
                    path: g.device.path.display().to_string(),
                    major: g.device.major,
                    minor: g.device.minor,
                });
                assigned.fake = g.fake;
            }
        }
        reply
    }

    fn gpus_of(&self, vgpu: VgpuId) -> String {
        self.node.record(vgpu).map_or(String::new(), |r| {
            let gpus: Vec<String> = r.assignment.gpus.iter().map(|g| g.0.to_string()).collect();
            gpus.join(",")
        })
    }

    fn container_of(&self, vgpu: VgpuId) -> String {
        self.node
            .record(vgpu)
            .and_then(|r| r.attachment.as_ref())
            .map_or_else(|| vgpu.to_string(), |a| a.container.clone())
    }
}

/// What is saved of a vGPU.
fn saved_vgpu(
    record: &VgpuRecord,
    cgroup: Option<&FreezerCgroup>,
    uuids: &BTreeMap<u32, String>,
    reserved_at: SystemTime,
    held: bool,
) -> SavedVgpu {
    SavedVgpu {
        format: FORMAT,
        vgpu: record.id.to_string(),
        annotations: record.annotations.clone(),
        gpus: record
            .assignment
            .gpus
            .iter()
            .map(|g| SavedGpu {
                index: g.0,
                uuid: uuids.get(&g.0).cloned().unwrap_or_default(),
            })
            .collect(),
        reserved_at_unix_ms: unix_ms(reserved_at),
        attachment: record.attachment.as_ref().and_then(|a| {
            let cgroup = cgroup?;
            Some(SavedAttachment {
                container: a.container.clone(),
                pid: match a.target {
                    Target::Pid(p) => Some(p),
                    Target::Cgroup(_) => None,
                },
                cgroup: match &a.target {
                    Target::Cgroup(c) => Some(c.clone()),
                    Target::Pid(_) => None,
                },
                freezer: SavedFreezer::of(cgroup),
                program: None,
            })
        }),
        held,
    }
}

/// A reply for a new vGPU, with its CDI edits.
fn with_cdi(mut reply: Reply, cdi: Option<serde_json::Value>) -> Reply {
    if let Some(vgpu) = &mut reply.vgpu {
        vgpu.cdi = cdi;
    }
    reply
}
