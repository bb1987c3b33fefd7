//! Starting again from `state_dir`: every saved vGPU whose container still runs is bound again
//! as it was; every saved container is thawed first (nothing holds a window at start), except a
//! held one (its user paused it: it stays paused, and rejoins held); what cannot be bound again
//! (its container is gone, its GPU changed, its memory no longer fits, its cgroup is not one the
//! service may freeze) is dropped with a log line saying why.
//!
//! Before any record is read, every cgroup of the frozen list is thawed: a record that cannot be
//! read (torn, garbage, not a regular file) never leaves its container frozen. A saved cgroup is
//! resolved again and passes the same admission check as at register and attach.

use std::time::{Duration, SystemTime};

use gpuplex_scheduler::accounting::{GpuStats, VgpuStats};
use gpuplex_scheduler::inventory::Assignment;
use gpuplex_scheduler::node::{Attachment, ReleaseKey, Target, VgpuRecord};
use gpuplex_scheduler::request::VgpuRequest;
use gpuplex_scheduler::{GpuIndex, Handle, VgpuId};

use super::enforced::{Enforced, Member};
use super::leftovers;
use super::unstarted::Unstarted;
use super::{Service, ServiceError};
use crate::state::{unix_ms, SavedAttachment, SavedVgpu};
use gpuplex_cgroup::FreezerCgroup;

impl Service {
    /// Recovers the saved registrations.
    pub(super) fn recover(&mut self) -> Result<(), ServiceError> {
        // Fail open first: whatever gpuplex may have frozen is thawed before anything else. A
        // held container is frozen by its user, not by gpuplex: it is left as it is (the list
        // never has it).
        let thawed = self.thaw_listed();
        let loaded = self.registry.state().load()?;
        for why in &loaded.unreadable {
            tracing::error!("state: {why}");
        }
        for why in &loaded.restored {
            tracing::warn!("state: {why}");
        }
        // Records written before the frozen list existed: their cgroups too.
        let records = leftovers::thaw(leftovers::saved_cgroups(&loaded.vgpus), &self.hierarchies);
        for why in &records.failed {
            tracing::warn!("{why}");
        }
        if thawed > 0 {
            tracing::info!("thawed {thawed} cgroup(s) the last run left on its frozen list");
        }
        let (mut kept, mut dropped) = (0, 0);
        for saved in loaded.vgpus {
            let name = saved.vgpu.clone();
            match self.rebind(saved) {
                Ok(()) => kept += 1,
                Err(why) => {
                    dropped += 1;
                    tracing::warn!("{name}: not recovered: {why}");
                    let removed = name
                        .parse::<VgpuId>()
                        .map(|id| self.registry.state().remove(id));
                    if let Ok(Err(e)) = removed {
                        tracing::error!("{name}: {e}");
                    }
                }
            }
        }
        self.carry_over_accounting();
        // Nothing is frozen now: the list says so before the first freeze adds to it.
        self.enforcer.record_frozen(&[]);
        if kept + dropped > 0 {
            tracing::info!(
                "recovered {kept} registration(s) from {}; dropped {dropped}",
                self.registry.state().path().display()
            );
        }
        Ok(())
    }

    /// Thaws every cgroup of the frozen list (each resolved again: a list names no other
    /// directory); how many. A list that cannot be read is logged: the records' cgroups are
    /// thawed next anyway.
    fn thaw_listed(&self) -> usize {
        let listed = match self.registry.state().load_frozen() {
            Ok(frozen) => frozen.frozen,
            Err(e) => {
                tracing::error!("state: the frozen list cannot be read ({e}); thawing the records' cgroups instead");
                return 0;
            }
        };
        let done = leftovers::thaw(&listed, &self.hierarchies);
        for why in &done.failed {
            tracing::warn!("{why}");
        }
        for why in &done.unresolved {
            tracing::debug!("frozen list: {why}");
        }
        done.thawed
    }

    /// Gives the recovered vGPUs and the GPUs the accounting they had at the last checkpoint.
    fn carry_over_accounting(&mut self) {
        let Some(saved) = self.registry.state().load_accounting() else {
            return;
        };
        let secs = |s: f64| Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO);
        for (id, a) in &saved.vgpus {
            let Ok(vgpu) = id.parse::<VgpuId>() else {
                continue;
            };
            let stats = VgpuStats {
                gpu_time: secs(a.gpu_seconds),
                windows: a.windows,
                wait_time: secs(a.wait_seconds),
                ..VgpuStats::default()
            };
            if self.registry.node_mut().carry_over_vgpu_stats(vgpu, stats) {
                if let Some(e) = self.enforcer.get_mut(vgpu) {
                    e.frozen_total = secs(a.frozen_seconds);
                }
            }
        }
        for (&index, g) in &saved.gpus {
            let same = (self.registry.node().inventory())
                .gpu(GpuIndex(index))
                .is_some_and(|now| now.uuid == g.uuid);
            if same {
                let stats = GpuStats {
                    busy_time: secs(g.busy_seconds),
                    switches: g.switches,
                };
                (self.registry.node_mut()).carry_over_gpu_stats(GpuIndex(index), stats);
            }
        }
    }

    /// A saved container's attachment and freezer cgroup, when it still runs there.
    fn reattach(&self, a: &SavedAttachment) -> Result<(Attachment, FreezerCgroup), String> {
        let cgroup = a
            .freezer
            .resolve(&self.hierarchies)
            .map_err(|e| e.to_string())?;
        self.admit(&cgroup)?;
        if !cgroup.is_populated().unwrap_or(false) {
            return Err(format!(
                "{}: its processes are gone ({} is empty or removed)",
                a.container,
                cgroup.path().display()
            ));
        }
        let target = match (a.pid, &a.cgroup) {
            (Some(pid), _) => Target::Pid(pid),
            (None, Some(path)) => Target::Cgroup(path.clone()),
            (None, None) => return Err("its attachment names no pid and no cgroup".into()),
        };
        Ok((
            Attachment {
                container: a.container.clone(),
                target,
            },
            cgroup,
        ))
    }

    fn rebind(&mut self, saved: SavedVgpu) -> Result<(), String> {
        let id: VgpuId = saved
            .vgpu
            .parse()
            .map_err(|_| format!("{:?} is not a vGPU id", saved.vgpu))?;
        let request = VgpuRequest::from_annotations(
            saved
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(|e| e.to_string())?
        .ok_or("its annotations ask for no vGPU")?;
        let mut gpus = Vec::new();
        for g in &saved.gpus {
            match self.registry.node().inventory().gpu(GpuIndex(g.index)) {
                Some(now) if now.uuid == g.uuid => gpus.push(GpuIndex(g.index)),
                Some(now) => {
                    return Err(format!(
                        "GPU {} is {} now, not {} as when it was assigned",
                        g.index, now.uuid, g.uuid
                    ))
                }
                None => {
                    return Err(format!(
                        "GPU {} ({}) is not on this node now",
                        g.index, g.uuid
                    ))
                }
            }
        }
        // Each container that still runs; a claim's reservation outlives its containers, so
        // it keeps those still running, and stays pinned with none.
        let mut members = Vec::new();
        for a in saved.attachment.iter().chain(&saved.shared) {
            match self.reattach(a) {
                Ok((attachment, cgroup)) => members.push((attachment, cgroup, a.pid, a.program)),
                Err(why) if saved.claim.is_some() => tracing::info!(
                    "{id}: {why}; still pinned for claim {}",
                    saved.claim.as_deref().unwrap_or_default()
                ),
                Err(why) => return Err(why),
            }
        }
        // A reservation keeps its age: the time it has left is what it had when the service
        // stopped, less the time the service was down.
        let age = Duration::from_millis(
            unix_ms(SystemTime::now()).saturating_sub(saved.reserved_at_unix_ms),
        );
        let now = self.now();
        // A record from before handles: a new one (its old reservation cannot be attached with
        // an annotation any more; it lapses, or its attached container goes on).
        let handle = match saved.handle.as_deref().map(str::parse::<Handle>) {
            Some(Ok(h)) => h,
            Some(Err(e)) => return Err(format!("its handle: {e}")),
            None => super::registry::fresh_handle()?,
        };
        let record = VgpuRecord {
            id,
            handle,
            annotations: saved.annotations.clone(),
            assignment: Assignment {
                vgpu: id,
                gpus,
                memory: request.memory,
            },
            request,
            reserved_at: now - age,
            attachments: members.iter().map(|m| m.0.clone()).collect(),
            claim: saved.claim.clone(),
            units: (saved.units.iter().map(|u| u.parse()))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("its units: {e}"))?,
        };
        (self.registry.node_mut())
            .restore(record, now)
            .map_err(|e| e.to_string())?;
        let members: Vec<Member> = members
            .into_iter()
            .map(|(attachment, cgroup, pid, program)| {
                let mut member = Member::new(&attachment.container, cgroup);
                // Attached before its start and not started then: not sampled before it is.
                if let (Some(pid), Some(program)) = (pid, program) {
                    member.unstarted = Some(Unstarted::saved(pid, program));
                }
                member
            })
            .collect();
        let dropped = members.len() < saved.attachment.iter().chain(&saved.shared).count();
        let mut members = members.into_iter();
        if let Some(first) = members.next() {
            let mut enforced = Enforced::new(first);
            enforced.members.extend(members);
            if saved.held {
                // Restored attached, so the node accepts the hold; were it refused, the
                // service would still leave the cgroup alone (`Enforced::held`).
                let node = self.registry.node_mut();
                if let Err(e) = node.hold(&ReleaseKey::Vgpu(id), true, now) {
                    tracing::error!("{id}: cannot hold it again: {e}");
                }
                enforced.set_held(true);
                tracing::info!(
                    "{id} ({}): held (paused by its user): left as it is until unhold",
                    saved
                        .attachment
                        .as_ref()
                        .map_or("", |a| a.container.as_str())
                );
            }
            self.enforcer.insert(id, enforced);
            self.watch_exits(id);
        }
        if dropped {
            if let Err(e) = self.save_enforced(id) {
                tracing::error!("{id}: {e}; the next start finds its gone containers gone again");
            }
        }
        Ok(())
    }
}
