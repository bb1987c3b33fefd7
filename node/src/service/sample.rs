//! The loop's sampling: activity read from the containers the scheduler uses samples of, exits
//! no pidfd saw, stop signals pending in frozen containers, containers that started, and the
//! accounting saved.

use super::repeated::Say;
use gpuplex_scheduler::VgpuId;

use super::{Service, ACCOUNTING_CHECKPOINT, EXIT_SWEEP, STOP_CHECK};
use crate::activity::{Observation, Watched};
use crate::gpus::GpuSource;
use crate::state::{SavedAccounting, SavedGpuAccounting, SavedVgpuAccounting};

impl Service {
    /// Samples activity, and releases containers whose processes are all gone.
    ///
    /// What it costs follows what can change: a frozen container cannot show work (the
    /// scheduler ignores its samples) nor exit on v1, a held or unstarted one is not scheduled;
    /// none of them is sampled. An exit is told by the kernel (a pidfd of the
    /// container's processes becomes readable: `exits.rs`); every [`EXIT_SWEEP`], not every
    /// sample, each container is also asked whether it still has processes, for the exits no
    /// pidfd saw. A frozen one is looked at for stop signals every [`STOP_CHECK`]. Every read is one
    /// `pread` of a file kept open ([`gpuplex_cgroup::CgroupReader`]).
    pub(super) fn sample(&mut self) {
        self.keep_watchdog();
        if self.last_exit_sweep.elapsed() >= EXIT_SWEEP {
            self.last_exit_sweep = std::time::Instant::now();
            let exited: Vec<(VgpuId, Vec<String>)> = (self.enforcer.iter_mut())
                .map(|(vgpu, e)| (vgpu, e.gone(vgpu)))
                .filter(|(_, gone)| !gone.is_empty())
                .collect();
            for (vgpu, gone) in exited {
                self.watchers.stale = true;
                for container in gone {
                    self.container_exited(vgpu, &container);
                }
            }
            self.watch_health();
        }
        if self.last_stop_check.elapsed() >= STOP_CHECK {
            self.last_stop_check = std::time::Instant::now();
            self.notice_stops();
        }
        let mut joining = Vec::new();
        for (vgpu, e) in self.enforcer.iter_mut() {
            let frozen = e.frozen_since.is_some() && !e.held;
            for m in &mut e.members {
                if m.unstarted.is_some_and(|u| u.has_started()) {
                    m.unstarted = None;
                    tracing::debug!("{vgpu} ({}): started; sampled from now on", m.container);
                    if frozen {
                        joining.push((vgpu, m.cgroup.clone()));
                    }
                }
            }
        }
        self.enforcer.freeze_joining(joining);
        let node = self.registry.node();
        let mut watched: Vec<Watched<'_>> = self
            .enforcer
            .iter_mut()
            .filter(|(_, e)| !e.held && e.frozen_since.is_none())
            .filter_map(|(vgpu, e)| {
                let readers: Vec<_> = (e.members.iter_mut())
                    .filter(|m| m.unstarted.is_none())
                    .map(|m| &mut m.reader)
                    .collect();
                if readers.is_empty() {
                    return None;
                }
                Some(Watched {
                    vgpu,
                    gpus: &node.record(vgpu)?.assignment.gpus,
                    thawed_at: e.thawed_at,
                    readers,
                })
            })
            .collect();
        let nvml = match &mut self.source {
            GpuSource::Nvml(n) => Some(n.as_mut()),
            _ => None,
        };
        let samples = self.sampler.sample(
            &mut watched,
            &self.hierarchies,
            nvml,
            std::time::Instant::now(),
        );
        drop(watched);
        let now = self.now();
        let node = self.registry.node_mut();
        for (vgpu, observed) in samples {
            match observed {
                Observation::Work => node.observe(vgpu, true, now),
                Observation::NoWork => node.observe(vgpu, false, now),
                Observation::NotYet => node.observe_unseen(vgpu, now),
            };
        }
        if self.last_checkpoint.elapsed() >= ACCOUNTING_CHECKPOINT {
            self.checkpoint();
        }
    }

    /// Saves the accounting, so that a restart carries it over.
    pub(super) fn checkpoint(&mut self) {
        self.last_checkpoint = std::time::Instant::now();
        let status = self.status();
        let accounting = SavedAccounting {
            format: crate::state::FORMAT,
            next_vgpu: Some(self.registry.node().next_id()),
            vgpus: status
                .containers
                .iter()
                .map(|c| {
                    let saved = SavedVgpuAccounting {
                        gpu_seconds: c.gpu_seconds,
                        wait_seconds: c.wait_seconds,
                        windows: c.windows,
                        frozen_seconds: c.frozen_seconds,
                    };
                    (c.vgpu.clone(), saved)
                })
                .collect(),
            gpus: status
                .gpus
                .iter()
                .map(|g| {
                    let saved = SavedGpuAccounting {
                        uuid: g.uuid.clone(),
                        busy_seconds: g.busy_seconds,
                        switches: g.switches,
                    };
                    (g.index, saved)
                })
                .collect(),
        };
        match self.registry.state().save_accounting(&accounting) {
            Ok(()) if self.checkpoint_failures.succeeded() => {
                tracing::info!("the accounting is saved again")
            }
            Ok(()) => {}
            Err(e) => match self.checkpoint_failures.failed(std::time::Instant::now()) {
                Say::Nothing => {}
                Say::First => {
                    tracing::warn!("{e}; a restart would lose the accounting since the last save")
                }
                Say::Again(n) => tracing::warn!(
                    "{e} (and {n} more times since the last line); the accounting is not saved"
                ),
            },
        }
    }
}
