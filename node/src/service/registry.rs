//! [`Registry`]: the node's registrations (the scheduler's [`Node`]) and their records in the
//! state directory, kept in step by one rule: a request that changes a registration is saved
//! before it is answered, and one whose record cannot be saved is undone and refused, so that a
//! reply never claims what a restart would not find.
//!
//! - A new vGPU (reserved, registered, pinned, allocated) is saved before its reply
//!   ([`Registry::save_new`]); when it cannot be, it is released again.
//! - A container attached to a vGPU (attach, register) is saved with its cgroup before the reply
//!   ([`Registry::save_attached`]); when it cannot be, a claim's vGPU is detached from it, any
//!   other vGPU released.
//! - A hold or unhold is saved before the node takes it ([`Registry::hold`]); when it cannot be,
//!   nothing changes.
//! - A release is the node's at once; the record goes with the vGPU (the service's `forget`).
//!
//! It also keeps the scheduler's clock ([`Registry::now`]) and draws reservations' handles.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use gpuplex_cgroup::FreezerCgroup;
use gpuplex_scheduler::node::{Attachment, Node, ReleaseKey, Target, VgpuRecord};
use gpuplex_scheduler::{Handle, Instant, VgpuId};

use super::enforced::Enforced;
use super::HandleSource;
use crate::state::{
    unix_ms, SavedAttachment, SavedFreezer, SavedGpu, SavedVgpu, StateDir, StateError, FORMAT,
};

/// The node's registrations and their saved records.
pub(super) struct Registry {
    node: Node,
    state: StateDir,
    /// Where new reservations' handles come from: the kernel's random source
    /// ([`fresh_handle`]), or a sequence a test predicts.
    handles: HandleSource,
    /// The scheduler's clock starts here, at `reservation_ttl`.
    origin: std::time::Instant,
    ttl: Duration,
    /// The id ceiling saved last ([`Registry::ids_saved`]); 0 before the first.
    id_ceiling: u64,
}

/// How many ids a saved ceiling is ahead of the next one: one write per this many vGPUs.
const ID_BLOCK: u64 = 1024;
/// How many ids one request may spend at most (a reservation's, or a refusal's).
const IDS_PER_REQUEST: u64 = 16;

impl Registry {
    /// The registrations of `node`, saved in `state`; the clock starts now, at `ttl` (the
    /// scheduler's `reservation_ttl`).
    pub fn new(node: Node, state: StateDir, ttl: Duration) -> Registry {
        Registry {
            node,
            state,
            handles: Box::new(fresh_handle),
            origin: std::time::Instant::now(),
            ttl,
            id_ceiling: 0,
        }
    }

    /// Before a request that may give vGPU ids (a reservation, a registration, a pin, an
    /// allocation: the id a refusal names is spent too): makes sure the saved id ceiling is
    /// above the ids it may give, saving the next block's when it is not. A death after that
    /// never lets the next service give them again, though a refusal's id and a released
    /// vGPU's leave no record. When the ceiling cannot be saved the request is refused, and
    /// nothing is given.
    pub fn ids_saved(&mut self) -> Result<(), String> {
        let next = self.node.next_id();
        if next.saturating_add(IDS_PER_REQUEST) <= self.id_ceiling {
            return Ok(());
        }
        let ceiling = next.saturating_add(ID_BLOCK);
        match self.state.save_id_ceiling(ceiling) {
            Ok(()) => {
                self.id_ceiling = ceiling;
                Ok(())
            }
            Err(e) => {
                tracing::error!("vGPU ids: {e}");
                Err(format!(
                    "{e}; nothing was reserved, since a restart could give its id again"
                ))
            }
        }
    }

    /// Draws new reservations' handles from `handles`.
    pub fn draw_handles_from(&mut self, handles: HandleSource) {
        self.handles = handles;
    }

    /// A new reservation's handle.
    pub fn draw_handle(&mut self) -> Result<Handle, String> {
        (self.handles)()
    }

    /// The scheduler's clock. It starts at `reservation_ttl`, not 0, so that a recovered
    /// reservation can be dated before the service started.
    pub fn now(&self) -> Instant {
        Instant::from_duration(self.origin.elapsed() + self.ttl)
    }

    /// The node, to read.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The node, to change: a registration's change is saved by one of the `save_*` methods
    /// before it is answered; samples, decisions and stops change no record.
    pub fn node_mut(&mut self) -> &mut Node {
        &mut self.node
    }

    /// The state directory.
    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// What is saved of a vGPU (known to the node), `held` or not: its record, with the cgroup
    /// of each container `enforced` has.
    pub fn record(&self, vgpu: VgpuId, held: bool, enforced: Option<&Enforced>) -> SavedVgpu {
        let record = self.node.record(vgpu).expect("a vGPU the node knows");
        let age = self.now().saturating_since(record.reserved_at);
        let reserved_at = SystemTime::now()
            .checked_sub(age)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut attachments = record.attachments.iter().filter_map(|a| {
            let member = enforced?.member(&a.container)?;
            let mut saved = saved_attachment(a, &member.cgroup);
            saved.program = member.unstarted.map(|u| u.program());
            Some(saved)
        });
        SavedVgpu {
            attachment: attachments.next(),
            shared: attachments.collect(),
            ..saved_vgpu(record, &self.node, reserved_at, held)
        }
    }

    /// Saves a vGPU as it is now (a container of a claim's vGPU came or went).
    pub fn save(&self, vgpu: VgpuId, enforced: Option<&Enforced>) -> Result<(), StateError> {
        let saved = self.record(vgpu, self.node.is_held(vgpu), enforced);
        self.state.save(&saved)
    }

    /// Removes a vGPU's record (the node no longer has it).
    pub fn remove(&self, vgpu: VgpuId) -> Result<(), StateError> {
        self.state.remove(vgpu)
    }

    /// Takes back a new vGPU that cannot be given (its CDI edits cannot be had).
    pub fn undo_new(&mut self, vgpu: VgpuId) {
        let now = self.now();
        self.node.release(&ReleaseKey::Vgpu(vgpu), now);
    }

    /// Saves a new vGPU's record before its reply; on failure releases it and refuses.
    pub fn save_new(&mut self, vgpu: VgpuId) -> Result<(), String> {
        let saved = self.record(vgpu, false, None);
        match self.state.save(&saved) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.undo_new(vgpu);
                let _ = self.state.remove(vgpu);
                tracing::error!("{vgpu}: {e}");
                Err(format!(
                    "{e}; nothing was reserved, since a restart would have lost it"
                ))
            }
        }
    }

    /// Saves `vgpu` with `container` just attached (its cgroup in `enforced`) before the
    /// reply; on failure the node lets it go (a claim's vGPU is detached from it, any other
    /// vGPU released) and it is refused. The caller stops enforcing it.
    pub fn save_attached(
        &mut self,
        vgpu: VgpuId,
        container: &str,
        enforced: Option<&Enforced>,
    ) -> Result<(), String> {
        let Err(e) = self.save(vgpu, enforced) else {
            return Ok(());
        };
        tracing::error!("{vgpu}: {e}");
        let now = self.now();
        if self.node.detach(vgpu, container, now).is_none() {
            self.node.release(&ReleaseKey::Vgpu(vgpu), now);
            let _ = self.state.remove(vgpu);
        }
        Err(format!(
            "{e}; {container} was not attached, since a restart would have lost it"
        ))
    }

    /// Holds `vgpu` (its user paused it) or lets it go again: saved first, then the node's;
    /// when it cannot be saved, nothing changes and it is refused.
    pub fn hold(
        &mut self,
        vgpu: VgpuId,
        held: bool,
        enforced: Option<&Enforced>,
    ) -> Result<(), String> {
        let saved = self.record(vgpu, held, enforced);
        if let Err(e) = self.state.save(&saved) {
            tracing::error!("{vgpu}: {e}");
            return Err(if held {
                format!("{e}; {vgpu} is not held, since a restart would have thawed it")
            } else {
                format!("{e}; {vgpu} stays held, since a restart would have held it again")
            });
        }
        let now = self.now();
        self.node
            .hold(&ReleaseKey::Vgpu(vgpu), held, now)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// What is saved of a vGPU.
fn saved_vgpu(record: &VgpuRecord, node: &Node, reserved_at: SystemTime, held: bool) -> SavedVgpu {
    let uuids: BTreeMap<u32, String> = (record.assignment.gpus.iter())
        .filter_map(|&g| Some((g.0, node.inventory().gpu(g)?.uuid.clone())))
        .collect();
    SavedVgpu {
        format: FORMAT,
        vgpu: record.id.to_string(),
        handle: Some(record.handle.to_string()),
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
        attachment: None,
        shared: Vec::new(),
        held,
        claim: record.claim.clone(),
        units: record.units.iter().map(|u| u.to_string()).collect(),
    }
}

/// What is saved of a container attached to a vGPU, in `cgroup`.
fn saved_attachment(a: &Attachment, cgroup: &FreezerCgroup) -> SavedAttachment {
    SavedAttachment {
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
    }
}

/// A new reservation's handle: 128 bits from the kernel's random source.
pub(super) fn fresh_handle() -> Result<Handle, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| {
        format!("cannot draw a reservation handle from the kernel's random source: {e}")
    })?;
    Ok(Handle::from_bytes(bytes))
}
