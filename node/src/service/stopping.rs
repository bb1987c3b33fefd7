//! Stopping wins over windows (DESIGN.md): a container with a stop signal pending is thawed and
//! kept out of windows, so that its SIGTERM handler runs now rather than at its next window (which
//! a busy `high` neighbour may never leave it), and so that a SIGKILL kills it (on cgroup v1 a
//! frozen process does not even die of SIGKILL).
//!
//! Two ways a stop reaches the service:
//!
//! - the containerd shim says so (`stopping` on the socket) before it signals the container;
//! - at each sample, the service reads the pending signals (`/proc/PID/status`) of the
//!   processes of every container it froze: a frozen process cannot take a signal, so one sent
//!   to it (`podman stop`, `runc kill`, `kill` from the host) is still pending there.
//!
//! The scheduler decides how long it stays out ([`gpuplex_scheduler::windows::WindowScheduler::stop`]:
//! `stop_grace` once for a graceful stop, until it exits for SIGKILL).

use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::windows::{Action, StopSignal};
use gpuplex_scheduler::VgpuId;
use gpuplex_wire::protocol::Reply;

use super::Service;
use gpuplex_cgroup::PendingSignals;

/// The stop a set of pending signals asks for: SIGKILL before SIGTERM, SIGINT and SIGQUIT.
pub(super) fn stop_signal(pending: PendingSignals) -> Option<StopSignal> {
    if pending.has(libc::SIGKILL) {
        Some(StopSignal::Kill)
    } else if [libc::SIGTERM, libc::SIGINT, libc::SIGQUIT]
        .into_iter()
        .any(|s| pending.has(s))
    {
        Some(StopSignal::Graceful)
    } else {
        None
    }
}

impl Service {
    /// `stopping` on the socket: the container of `key` is being sent `signal`.
    pub(super) fn stopping(&mut self, key: &ReleaseKey, signal: StopSignal) -> Reply {
        let vgpu = match self.registry.node().attached(key) {
            Ok(v) => v,
            Err(e) => return Reply::refused(e),
        };
        self.stop(vgpu, signal, "its runtime is sending it");
        self.reply(vgpu)
    }

    /// Looks for stop signals pending in the containers the service froze.
    pub(super) fn notice_stops(&mut self) {
        let mut stops = Vec::new();
        for (vgpu, e) in self.enforcer.iter_mut() {
            if e.held || e.frozen_since.is_none() {
                continue;
            }
            // Any of its containers being stopped thaws them all: they share its windows.
            let signals: Vec<StopSignal> = (e.members.iter_mut())
                .filter_map(|m| stop_signal(m.reader.pending_signals().ok()?))
                .collect();
            let kill = signals.contains(&StopSignal::Kill);
            let signal = signals
                .first()
                .map(|&s| if kill { StopSignal::Kill } else { s });
            if let Some(signal) = signal {
                stops.push((vgpu, signal));
            }
        }
        for (vgpu, signal) in stops {
            self.stop(vgpu, signal, "it has it pending");
        }
    }

    /// Carries out the scheduler's answer to a stop: the thaw, if it was frozen.
    fn stop(&mut self, vgpu: VgpuId, signal: StopSignal, why: &str) {
        let now = self.now();
        let thaw = self.registry.node_mut().stopping(vgpu, signal, now);
        let container = self.container_of(vgpu);
        let name = match signal {
            StopSignal::Kill => "SIGKILL",
            StopSignal::Graceful => "a stop signal",
        };
        if thaw == Some(Action::Thaw(vgpu)) {
            self.enforcer.thaw(vgpu);
            tracing::info!(
                "{vgpu} ({container}): {name}, which {why}: thawed, and out of windows while it stops"
            );
        } else {
            tracing::debug!("{vgpu} ({container}): {name}, which {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigkill_wins_and_only_stop_signals_count() {
        let set = |signals: &[i32]| PendingSignals(signals.iter().fold(0, |m, s| m | 1 << (s - 1)));
        assert_eq!(stop_signal(set(&[])), None);
        assert_eq!(stop_signal(set(&[libc::SIGHUP, libc::SIGUSR1])), None);
        for graceful in [libc::SIGTERM, libc::SIGINT, libc::SIGQUIT] {
            assert_eq!(stop_signal(set(&[graceful])), Some(StopSignal::Graceful));
        }
        assert_eq!(
            stop_signal(set(&[libc::SIGTERM, libc::SIGKILL])),
            Some(StopSignal::Kill)
        );
    }
}
