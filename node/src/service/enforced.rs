//! [`Enforced`]: an attached vGPU as the service enforces it, its containers ([`Member`]) frozen
//! and thawed together, and the time it spent frozen.
//!
//! A held container (its user paused it) is its user's: its vGPU is neither frozen nor thawed
//! by the service until it is unheld.

use std::time::{Duration, Instant};

use gpuplex_cgroup::{CgroupError, CgroupReader, FreezerCgroup};
use gpuplex_scheduler::VgpuId;

use super::freezer::Freezer;
use super::unstarted::Unstarted;

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
    pub fn thaw(&mut self, vgpu: VgpuId, freezer: &dyn Freezer) -> Result<bool, CgroupError> {
        let Some(since) = self.frozen_since.filter(|_| !self.held) else {
            return Ok(false);
        };
        let mut failed = None;
        let mut gone = None;
        for m in &self.members {
            match freezer.thaw(&m.cgroup) {
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
