//! What happened on the node's GPUs, kept for tools that draw it (`gpuplexctl timeline`): each
//! change of a GPU's window holder, numbered, in a bounded buffer. A client asks for the events
//! after the last number it saw; when it asks for ones that were dropped, it learns the first
//! number still kept.

use std::collections::{BTreeMap, VecDeque};

use crate::{GpuIndex, Instant, VgpuId};

/// How many events are kept (about an hour of switches every second on one GPU; 4096 × ~100
/// bytes).
pub const EVENTS_KEPT: usize = 4096;

/// A GPU's window passed to `holder` (none: nobody holds it).
#[derive(Clone, Debug, PartialEq)]
pub struct WindowEvent {
    /// Its number: one more than the previous event's.
    pub seq: u64,
    /// When, on the node's clock.
    pub at: Instant,
    /// The GPU.
    pub gpu: u32,
    /// The vGPU that holds the window now.
    pub vgpu: Option<VgpuId>,
    /// Its first container then.
    pub container: Option<String>,
}

/// The events kept, and each GPU's last holder.
#[derive(Clone, Debug, Default)]
pub struct EventLog {
    events: VecDeque<WindowEvent>,
    next: u64,
    holders: BTreeMap<GpuIndex, Option<VgpuId>>,
}

impl EventLog {
    /// Notes `gpu`'s holder at `at`: an event when it changed.
    pub fn holder(
        &mut self,
        gpu: GpuIndex,
        vgpu: Option<VgpuId>,
        container: impl FnOnce() -> Option<String>,
        at: Instant,
    ) {
        let last = self.holders.insert(gpu, vgpu);
        if last.flatten() == vgpu && last.is_some() {
            return;
        }
        if last.is_none() && vgpu.is_none() {
            return;
        }
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.next += 1;
        self.events.push_back(WindowEvent {
            seq: self.next,
            at,
            gpu: gpu.0,
            vgpu,
            container: container(),
        });
    }

    /// The events numbered above `since`, oldest first, and the number of the oldest kept (the
    /// ones between `since` and it were dropped).
    pub fn since(&self, since: u64) -> (Vec<WindowEvent>, u64) {
        let first = self.events.front().map_or(self.next + 1, |e| e.seq);
        let after: Vec<WindowEvent> = (self.events.iter())
            .filter(|e| e.seq > since)
            .cloned()
            .collect();
        (after, first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn only_changes_are_events_numbered_in_order() {
        let mut log = EventLog::default();
        let g = GpuIndex(0);
        log.holder(g, None, || None, at(0));
        log.holder(g, Some(VgpuId(1)), || Some("a".into()), at(1));
        log.holder(g, Some(VgpuId(1)), || Some("a".into()), at(2));
        log.holder(GpuIndex(1), Some(VgpuId(2)), || Some("b".into()), at(2));
        log.holder(g, None, || None, at(3));
        let (events, first) = log.since(0);
        assert_eq!(first, 1);
        let seen: Vec<(u64, u32, Option<VgpuId>)> =
            events.iter().map(|e| (e.seq, e.gpu, e.vgpu)).collect();
        assert_eq!(
            seen,
            [
                (1, 0, Some(VgpuId(1))),
                (2, 1, Some(VgpuId(2))),
                (3, 0, None)
            ]
        );
        assert_eq!(events[0].container.as_deref(), Some("a"));
        assert_eq!(log.since(2).0.len(), 1);
        assert!(log.since(3).0.is_empty());
    }

    #[test]
    fn the_buffer_is_bounded_and_says_what_was_dropped() {
        let mut log = EventLog::default();
        for i in 0..(EVENTS_KEPT as u64 + 10) {
            let holder = Some(VgpuId(i % 2 + 1));
            log.holder(GpuIndex(0), holder, || None, at(i));
        }
        let (events, first) = log.since(0);
        assert_eq!(events.len(), EVENTS_KEPT);
        assert_eq!(first, 11);
        assert_eq!(events.last().unwrap().seq, EVENTS_KEPT as u64 + 10);
    }
}
