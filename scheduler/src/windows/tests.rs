//! Rule-by-rule tests of the window scheduler, on a small node driven sample by sample.

use super::*;
use std::collections::BTreeSet;

const SAMPLE_MS: u64 = 50;

fn at(ms: u64) -> Instant {
    Instant::from_nanos(ms * 1_000_000)
}

fn v(n: u64) -> VgpuId {
    VgpuId(n)
}

/// A node with `gpus` GPUs, slice 200 ms, idle_grace 100 ms, that applies the scheduler's
/// orders and checks them against its own record of who is frozen.
struct Node {
    s: WindowScheduler,
    frozen: BTreeSet<u64>,
    now: u64,
}

impl Node {
    fn new(gpus: u32) -> Node {
        let config = SchedulerConfig {
            slice: Duration::from_millis(200),
            idle_grace: Duration::from_millis(100),
            ..SchedulerConfig::default()
        };
        Node {
            s: WindowScheduler::new((0..gpus).map(GpuIndex), &config),
            frozen: BTreeSet::new(),
            now: 0,
        }
    }

    fn bind(&mut self, id: u64, gpus: &[u32], weight: u32, priority: Priority) {
        let binding = Binding {
            gpus: gpus.iter().map(|&g| GpuIndex(g)).collect(),
            weight,
            priority,
        };
        self.s.bind(v(id), binding, at(self.now)).unwrap();
    }

    fn apply(&mut self, actions: &[Action]) {
        for a in actions {
            match *a {
                Action::Freeze(id) => assert!(self.frozen.insert(id.0), "froze {id} twice"),
                Action::Thaw(id) => assert!(self.frozen.remove(&id.0), "thawed running {id}"),
            }
        }
    }

    /// Samples at `ms`: `working` showed work, every other vGPU showed none; then decides.
    fn sample(&mut self, ms: u64, working: &[u64]) -> Decision {
        self.now = ms;
        let ids: Vec<VgpuId> = self.s.vgpus().collect();
        for id in ids {
            self.s.observe(id, working.contains(&id.0), at(ms));
        }
        self.decide(ms)
    }

    fn decide(&mut self, ms: u64) -> Decision {
        self.now = ms;
        let d = self.s.decide(at(ms));
        self.apply(&d.actions);
        d
    }

    /// Samples every 50 ms from `from` (inclusive) to `to` (exclusive), waking at `next_due`
    /// between samples. `working(id, ms)` says whether a running vGPU works at that time.
    fn run(&mut self, from: u64, to: u64, working: impl Fn(u64, u64) -> bool) {
        let mut t = from;
        while t < to {
            let ids: Vec<u64> = self.s.vgpus().map(|id| id.0).collect();
            let busy: Vec<u64> = ids
                .into_iter()
                .filter(|&id| !self.frozen.contains(&id) && working(id, t))
                .collect();
            let mut due = self.sample(t, &busy).next_due;
            let next_sample = t + SAMPLE_MS;
            while let Some(d) = due.map(|d| d.as_nanos().div_ceil(1_000_000)) {
                if d >= next_sample || d >= to {
                    break;
                }
                due = self.decide(d).next_due;
            }
            t = next_sample;
        }
    }

    fn frozen(&self) -> Vec<u64> {
        self.frozen.iter().copied().collect()
    }

    fn stats(&self, id: u64) -> VgpuStats {
        self.s.vgpu(v(id)).unwrap().stats
    }

    fn gpu_secs(&self, id: u64) -> f64 {
        self.stats(id).gpu_time.as_secs_f64()
    }
}

#[test]
fn a_vgpu_without_work_is_never_frozen() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.bind(3, &[0], 1, Priority::Low);
    n.run(0, 5_000, |_, _| false);
    assert!(n.frozen().is_empty());
    // One works: the idle ones stay untouched.
    n.run(5_000, 10_000, |id, _| id == 1);
    assert!(n.frozen().is_empty());
}

#[test]
fn a_vgpu_alone_with_work_runs_unrestricted_in_one_window() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.run(0, 10_000, |id, _| id == 1);
    assert!(n.frozen().is_empty());
    assert_eq!(n.stats(1).windows, 1, "an extended window is not a new one");
    assert!((n.gpu_secs(1) - 10.0).abs() < 0.2, "{}", n.gpu_secs(1));
    assert_eq!(n.s.gpu(GpuIndex(0)).unwrap().holder, Some(v(1)));
}

#[test]
fn a_second_vgpu_with_work_waits_for_the_window_to_end() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    let d = n.sample(0, &[1]);
    assert_eq!((d.actions, d.next_due), (vec![], None));
    let d = n.sample(50, &[1, 2]);
    assert_eq!(d.actions, vec![Action::Freeze(v(2))]);
    assert_eq!(
        d.next_due,
        Some(at(150)),
        "the holder's work may lapse first"
    );
    n.sample(100, &[1]);
    let d = n.sample(150, &[1]);
    assert_eq!(d.next_due, Some(at(200)), "window of 1 ends at slice");
    let d = n.decide(200);
    assert_eq!(d.actions, vec![Action::Freeze(v(1)), Action::Thaw(v(2))]);
    assert_eq!(n.s.vgpu(v(2)).unwrap().window_end, Some(at(400)));
    assert_eq!(n.stats(2).waits.count(), 1);
    assert_eq!(n.stats(2).wait_time, Duration::from_millis(150));
}

#[test]
fn a_window_lasts_slice_times_weight_and_one_slice_once_a_vgpu_arrives() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 3, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    let end = |n: &Node, id| n.s.vgpu(v(id)).unwrap().window_end;
    n.sample(0, &[1]);
    assert_eq!(end(&n, 1), Some(at(600)), "alone: slice × weight");
    // 2 gets work: 1's window ends one slice from then.
    n.sample(50, &[1, 2]);
    assert_eq!(n.frozen(), vec![2]);
    assert_eq!(end(&n, 1), Some(at(250)));
    n.run(100, 300, |_, _| true);
    assert_eq!(n.frozen(), vec![1]);
    assert_eq!(end(&n, 2), Some(at(450)), "2 is owed: a whole window");
    n.run(300, 500, |_, _| true);
    assert_eq!(n.frozen(), vec![2]);
    assert_eq!(
        end(&n, 1),
        Some(at(1_050)),
        "nobody arrived: slice × weight"
    );
}

#[test]
fn shares_follow_weights() {
    let mut n = Node::new(1);
    for (id, w) in [(1, 1), (2, 2), (3, 5)] {
        n.bind(id, &[0], w, Priority::Normal);
    }
    n.run(0, 120_000, |_, _| true);
    let total: f64 = (1..=3).map(|id| n.gpu_secs(id)).sum();
    assert!(total > 119.0, "the GPU stays busy: {total}");
    for (id, w) in [(1, 1.0), (2, 2.0), (3, 5.0)] {
        let share = n.gpu_secs(id) / total;
        let fair = w / 8.0;
        assert!(
            (share - fair).abs() / fair < 0.02,
            "vgpu {id}: {share} vs {fair}"
        );
    }
    let gpu = n.s.gpu(GpuIndex(0)).unwrap().stats;
    assert!(gpu.switches > 100, "{gpu:?}");
}

#[test]
fn a_holder_whose_sample_shows_no_work_passes_the_window_at_once_while_another_waits() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 10, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    assert_eq!(n.frozen(), vec![2]);
    // 1's window would last 2 s, but its sample at 100 ms shows no work, and 2 waits.
    let d = n.sample(100, &[]);
    assert_eq!(d.actions, vec![Action::Thaw(v(2))]);
    assert!(n.s.vgpu(v(1)).unwrap().window_end.is_none());
    assert!(!n.s.vgpu(v(1)).unwrap().has_work);
}

#[test]
fn a_holder_alone_keeps_its_work_for_idle_grace() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1]);
    // Nobody waits: a sample without work ends nothing before the grace.
    let d = n.sample(100, &[]);
    assert!(d.actions.is_empty());
    assert!(n.s.vgpu(v(1)).unwrap().has_work);
    n.decide(150);
    assert!(!n.s.vgpu(v(1)).unwrap().has_work);
}

#[test]
fn samples_of_a_frozen_vgpu_are_ignored_and_a_thawed_one_gets_its_grace() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 4, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    assert_eq!(n.frozen(), vec![2]);
    for t in (100..250).step_by(50) {
        n.sample(t, &[1]); // 2 shows nothing: it is frozen
    }
    assert_eq!(n.frozen(), vec![2], "still waiting");
    // 1's window ends one slice after 2 got work.
    n.decide(250);
    assert_eq!(n.frozen(), vec![1]);
    // No sample yet after the thaw: 2 keeps its window for idle_grace.
    n.decide(300);
    assert_eq!(n.frozen(), vec![1]);
    assert!(n.s.vgpu(v(2)).unwrap().has_work);
}

#[test]
fn high_freezes_the_others_with_work_and_is_never_frozen() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::High);
    n.bind(2, &[0], 1, Priority::Normal);
    n.bind(3, &[0], 1, Priority::Low);
    n.bind(4, &[0], 1, Priority::Normal);
    n.sample(0, &[2]);
    assert!(n.frozen().is_empty());
    n.sample(50, &[1, 2, 3]);
    assert_eq!(n.frozen(), vec![2, 3], "4 has no work and is left alone");
    n.run(100, 3_000, |id, _| id != 4);
    assert_eq!(n.frozen(), vec![2, 3]);
    assert!(n.s.gpu(GpuIndex(0)).unwrap().holder.is_none());
    // The high one's work ends: the normal one runs, the low one still waits.
    n.run(3_000, 3_300, |id, _| id == 2 || id == 3);
    assert_eq!(n.frozen(), vec![3]);
}

#[test]
fn two_high_vgpus_run_together() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::High);
    n.bind(2, &[0], 1, Priority::High);
    n.run(0, 2_000, |_, _| true);
    assert!(n.frozen().is_empty());
    assert!((n.gpu_secs(1) - 1.0).abs() < 0.1 && (n.gpu_secs(2) - 1.0).abs() < 0.1);
}

#[test]
fn low_runs_only_while_no_normal_has_work() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Low);
    n.bind(2, &[0], 1, Priority::Low);
    n.bind(3, &[0], 1, Priority::Normal);
    n.run(0, 2_000, |id, _| id != 3);
    assert_eq!(n.frozen().len(), 1, "two lows take turns");
    assert!(n.gpu_secs(1) > 0.8 && n.gpu_secs(2) > 0.8);
    // A normal gets work: the low holder is preempted at once.
    n.sample(2_000, &[1, 2, 3]);
    assert_eq!(n.frozen(), vec![1, 2]);
    n.run(2_050, 4_000, |_, _| true);
    assert_eq!(n.frozen(), vec![1, 2]);
    n.run(4_000, 4_500, |id, _| id != 3);
    assert_eq!(n.frozen().len(), 1);
}

#[test]
fn a_multi_gpu_vgpu_runs_only_holding_all_its_gpus_and_is_not_starved() {
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[1], 3, Priority::Normal);
    n.bind(9, &[0, 1], 1, Priority::Normal);
    n.run(0, 60_000, |_, _| true);
    // Alone, 9 would get half of each GPU it shares; it gets a fair part of its GPUs.
    let m = n.gpu_secs(9) / 2.0;
    assert!(m > 10.0, "multi-GPU vGPU got {m} s per GPU of 60");
    let stats = n.stats(9);
    assert!(stats.windows > 20);
    assert!(
        stats.waits.max() < Duration::from_millis(2_000),
        "{:?}",
        stats.waits.max()
    );
}

#[test]
fn a_multi_gpu_vgpu_never_runs_beside_a_single_gpu_one() {
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[1], 2, Priority::Normal);
    n.bind(9, &[0, 1], 2, Priority::Normal);
    for t in (0..20_000).step_by(50) {
        let running: Vec<u64> = [1, 2, 9]
            .into_iter()
            .filter(|id| !n.frozen.contains(id))
            .collect();
        n.sample(t, &running);
        if !n.frozen.contains(&9) {
            assert_eq!(n.frozen(), vec![1, 2], "at {t} ms");
        }
    }
}

#[test]
fn a_burst_that_ran_ahead_keeps_its_lag_and_gets_a_shorter_first_window_next_time() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    let lag = |n: &Node, id| n.s.vgpu(v(id)).unwrap().lag_seconds;
    // The first window that holds 2 after its work begins at `from`, and when it was granted.
    let first_window = |n: &mut Node, from: u64| {
        for t in (from..from + 400).step_by(50) {
            n.run(t, t + 50, |id, t| id == 1 || t < from + 150);
            if let Some(end) = n.s.vgpu(v(2)).unwrap().window_end {
                return (t, end.as_nanos() / 1_000_000 - t);
            }
        }
        panic!("no window for 2 within 400 ms of {from}");
    };
    n.run(0, 2_000, |id, _| id == 1);
    // 2 works 150 ms from 2 s: it holds a window at once (1's ends then), a whole one: it is
    // owed nothing and ahead by nothing.
    assert_eq!(first_window(&mut n, 2_000), (2_000, 200));
    n.run(2_400, 2_600, |id, _| id == 1);
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
    // It ran ahead of its half, and keeps that; ten idle seconds change nothing.
    let kept = lag(&n, 2);
    assert!((-0.2..-0.02).contains(&kept), "kept lag {kept}");
    n.run(2_600, 12_600, |id, _| id == 1);
    assert_eq!(lag(&n, 2), kept);
    // Its next work: it still holds a window within one slice, a shorter one.
    let (granted, length) = first_window(&mut n, 12_600);
    assert!(granted <= 12_800, "granted at {granted}");
    assert!((100..200).contains(&length), "first window {length} ms");
}

#[test]
fn a_latecomer_queues_at_the_average_and_banks_no_idle_time() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.run(0, 30_000, |id, _| id == 1);
    let before = (n.gpu_secs(1), n.gpu_secs(2));
    n.run(30_000, 40_000, |_, _| true);
    let (a, b) = (n.gpu_secs(1) - before.0, n.gpu_secs(2) - before.1);
    assert!(
        (a - b).abs() < 0.5,
        "after the latecomer arrives they share: {a} vs {b}"
    );
    // And one that worked alone, went idle and came back is not punished for its solo run.
    n.run(40_000, 50_000, |id, _| id == 2);
    let before = (n.gpu_secs(1), n.gpu_secs(2));
    n.run(50_000, 60_000, |_, _| true);
    let (a, b) = (n.gpu_secs(1) - before.0, n.gpu_secs(2) - before.1);
    assert!((a - b).abs() < 0.5, "{a} vs {b}");
}

#[test]
fn unbinding_the_holder_passes_the_window_and_a_frozen_one_is_thawed() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.bind(3, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2, 3]);
    assert_eq!(n.frozen(), vec![2, 3]);
    assert_eq!(n.s.unbind(v(1), at(60)).unwrap().thaw, None);
    let d = n.decide(60);
    assert_eq!(d.actions.len(), 1);
    let next = match d.actions[0] {
        Action::Thaw(id) => id.0,
        other => panic!("{other:?}"),
    };
    let still_frozen = 5 - next;
    assert_eq!(n.frozen(), vec![still_frozen]);
    let unbound = n.s.unbind(v(still_frozen), at(70)).unwrap();
    assert_eq!(unbound.thaw, Some(Action::Thaw(v(still_frozen))));
    // Its last wait, 50 ms to 70 ms, is counted.
    assert_eq!(unbound.stats.waits.count(), 1);
    assert_eq!(unbound.stats.wait_time, Duration::from_millis(20));
    assert_eq!(n.s.unbind(v(still_frozen), at(70)), None, "already gone");
    assert!(!n.s.observe(v(still_frozen), true, at(80)));
}

#[test]
fn next_due_is_none_while_nobody_waits() {
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[1], 1, Priority::Normal);
    for t in (0..2_000).step_by(50) {
        assert_eq!(n.sample(t, &[1, 2]).next_due, None);
    }
}

#[test]
fn bind_rejects_bad_bindings() {
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    let b = |gpus: &[u32], weight| Binding {
        gpus: gpus.iter().map(|&g| GpuIndex(g)).collect(),
        weight,
        priority: Priority::Normal,
    };
    let now = at(0);
    assert_eq!(
        n.s.bind(v(1), b(&[0], 1), now),
        Err(BindError::AlreadyBound(v(1)))
    );
    assert_eq!(
        n.s.bind(v(2), b(&[7], 1), now),
        Err(BindError::UnknownGpu(GpuIndex(7)))
    );
    assert!(matches!(
        n.s.bind(v(2), b(&[], 1), now),
        Err(BindError::BadGpuList(_))
    ));
    assert!(matches!(
        n.s.bind(v(2), b(&[1, 1], 1), now),
        Err(BindError::BadGpuList(_))
    ));
    assert_eq!(
        n.s.bind(v(2), b(&[0], 0), now),
        Err(BindError::BadWeight(0))
    );
    assert_eq!(
        n.s.bind(v(2), b(&[0], 101), now),
        Err(BindError::BadWeight(101))
    );
    assert!(n.s.vgpu(v(2)).is_none(), "nothing half-bound");
    assert_eq!(n.s.gpu(GpuIndex(0)).unwrap().bound, vec![v(1)]);
}

#[test]
fn a_clock_that_goes_back_is_read_as_the_latest() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(1_000, &[1, 2]);
    let frozen = n.frozen();
    let d = n.sample(10, &[1]);
    assert!(d.actions.is_empty());
    assert_eq!(n.frozen(), frozen);
}

#[test]
fn accounting_counts_windows_switches_and_waits() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.run(0, 4_000, |_, _| true);
    let (a, b) = (n.stats(1), n.stats(2));
    // 4 s of 200 ms windows: 20 windows in all, one switch between each.
    assert!(
        (19..=21).contains(&(a.windows + b.windows)),
        "{} {}",
        a.windows,
        b.windows
    );
    let switches = n.s.gpu(GpuIndex(0)).unwrap().stats.switches;
    assert_eq!(switches, a.windows + b.windows - 1);
    assert!(a.waits.count() + b.waits.count() >= 18);
    assert!(b.waits.quantile(0.5) >= Duration::from_millis(150));
    assert!(b.waits.max() <= Duration::from_millis(250));
    let busy = n.s.gpu(GpuIndex(0)).unwrap().stats.busy_time;
    assert!(busy >= Duration::from_millis(3_900), "{busy:?}");
}

#[test]
fn windows_rotate_in_queue_order_when_virtual_times_tie() {
    // Weights 1, 2, 3, all arriving at 50 ms, so all due to hold a window by 250 ms: 1's
    // window lasts one slice, to 250 ms; 2's the shortest window (100 ms: 3's deadline has
    // come), 3's its full 600 ms. Then 2 (50 ms of virtual time) goes, and 1 and 3 tie
    // at 200 ms, which must add up exactly (600 ms accrued in 50 ms steps at weight 3 equals
    // 200 ms at weight 1): 1, queued first, goes before 3; and so on, each in turn.
    let mut n = Node::new(1);
    for (id, w) in [(1, 1), (2, 2), (3, 3)] {
        n.bind(id, &[0], w, Priority::Normal);
    }
    let mut holders = Vec::new();
    n.sample(0, &[]);
    for t in (50..4_000).step_by(50) {
        let running: Vec<u64> = [1, 2, 3]
            .into_iter()
            .filter(|id| !n.frozen.contains(id))
            .collect();
        n.sample(t, &running);
        let holder = n.s.gpu(GpuIndex(0)).unwrap().holder.unwrap().0;
        if holders.last() != Some(&(holder, t)) && holders.last().map(|h| h.0) != Some(holder) {
            holders.push((holder, t));
        }
    }
    let expected = [
        (1, 50),
        (2, 250),
        (3, 350),
        (2, 950),
        (1, 1_350),
        (3, 1_550),
        (2, 2_150),
        (1, 2_550),
        (3, 2_750),
    ];
    assert_eq!(&holders[..expected.len()], &expected, "{holders:?}");
}

#[test]
fn a_multi_gpu_vgpu_is_compared_on_each_gpu_by_that_gpu_average() {
    // GPU 0 has had one busy vGPU for 30 s, GPU 1 two: their average virtual times stand at
    // 30 s and 15 s. A 2-GPU vGPU arriving then must rank by each GPU's own average; placed at
    // the higher one everywhere, it would wait ~30 s on GPU 1 for the others to catch up.
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[1], 1, Priority::Normal);
    n.bind(3, &[1], 1, Priority::Normal);
    n.run(0, 30_000, |id, _| id != 9);
    n.bind(9, &[0, 1], 1, Priority::Normal);
    n.run(30_000, 60_000, |_, _| true);
    let m = n.stats(9);
    assert!(m.windows >= 20, "{} windows", m.windows);
    assert!(
        m.waits.max() < Duration::from_secs(2),
        "waited {:?}",
        m.waits.max()
    );
}

#[test]
fn a_thawed_vgpu_whose_first_sample_shows_no_work_passes_its_window_at_once() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    n.sample(100, &[1]);
    n.sample(150, &[1]);
    n.sample(200, &[1]);
    // 1's window ends at 200 ms: 2 is thawed; what it waited for ended while it was frozen.
    assert_eq!(n.frozen(), vec![1]);
    // A sample 10 ms after the thaw is too soon to tell: ignored.
    let d = n.sample(210, &[]);
    assert!(d.actions.is_empty());
    assert!(n.s.vgpu(v(2)).unwrap().has_work);
    // The next one, 50 ms after: 2 has no work, and 1 runs again now, not a grace later.
    let d = n.sample(250, &[]);
    assert_eq!(d.actions, vec![Action::Thaw(v(1))]);
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
}

/// An activity source that sees a thawed vGPU only some time after the thaw (NVML: up to two
/// driver samples, 400 ms on an H200) says "not yet" meanwhile: the work the vGPU was thawed
/// for is kept past `idle_grace`, so its window does not lapse into a thawed "idle" vGPU that
/// runs on beside the next holder.
#[test]
fn a_thawed_vgpu_not_seen_yet_keeps_its_work_and_its_window() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    for t in (100..250).step_by(50) {
        n.sample(t, &[1]);
    }
    assert_eq!(n.frozen(), vec![1], "2 was thawed at 200 ms");
    // Not seen yet, for longer than idle_grace: 2 keeps its work and its window (one slice,
    // to 400 ms).
    for t in (250..400).step_by(50) {
        n.s.observe_unseen(v(2), at(t));
        n.s.observe(v(1), false, at(t)); // frozen: ignored
        n.decide(t);
        assert_eq!(n.frozen(), vec![1], "at {t} ms");
        assert!(n.s.vgpu(v(2)).unwrap().has_work, "at {t} ms");
    }
    // Its first real sample decides: no work passes the window on at once.
    let d = n.sample(375, &[]);
    assert_eq!(d.actions, vec![Action::Thaw(v(1))]);
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
    // Without the "not yet", the window lapses idle_grace after the thaw, and 2 is left
    // running as an idle vGPU, which it may not be.
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    for t in (100..250).step_by(50) {
        n.sample(t, &[1]);
    }
    n.decide(250);
    let d = n.decide(300);
    assert_eq!(d.actions, vec![Action::Thaw(v(1))]);
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
}

/// "Not yet" keeps only work the scheduler thawed a vGPU for: not for one running without work,
/// one its user resumed, a frozen one, or one whose first sample since its thaw came.
#[test]
fn not_yet_gives_no_work_to_a_vgpu_that_had_none() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    // 2 runs without work: "not yet" is nothing.
    assert!(n.s.observe_unseen(v(2), at(10)));
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
    // Resumed by its user: nothing either.
    n.hold(2, true, 20);
    n.hold(2, false, 30);
    n.s.observe_unseen(v(2), at(40));
    assert!(!n.s.vgpu(v(2)).unwrap().has_work);
    // 1 has had its first sample since it began: its work lapses idle_grace after it.
    for t in (50..200).step_by(50) {
        n.s.observe_unseen(v(1), at(t));
        n.decide(t);
    }
    assert!(!n.s.vgpu(v(1)).unwrap().has_work);
    assert!(!n.s.observe_unseen(v(9), at(200)), "unknown vGPU");
}

#[test]
fn time_nobody_else_could_use_is_not_paid_back_by_waiting() {
    // GPU 2 is shared by a weight-1 vGPU and two multi-GPU ones that often wait for GPU 0. While
    // they wait, the small one keeps GPU 2 busy; charged in full, that lead cost it a 17 s wait
    // later (found by the wait-bound property). Capped at one slice past the GPU's clock, its
    // wait stays within the bound: 2 × slice × the other weights + one sample.
    let mut n = Node::new(3);
    n.bind(10, &[1, 2], 10, Priority::Normal);
    n.bind(11, &[0], 5, Priority::Normal);
    n.bind(12, &[2], 1, Priority::Normal);
    n.bind(13, &[0, 1, 2], 7, Priority::Normal);
    n.run(0, 30_000, |_, _| true);
    let worst = n.stats(12).waits.max();
    assert!(
        worst <= Duration::from_millis(2 * 200 * 22 + 50),
        "waited {worst:?}"
    );
}

// Holds: a vGPU whose user paused its container.

impl Node {
    /// Holds or lets go of `id` at `ms`, as the node service does: from a hold on, the
    /// container's freezer is its user's, so this node's record of it is dropped; an unhold
    /// finds it running (its user resumed it).
    fn hold(&mut self, id: u64, held: bool, ms: u64) {
        self.now = ms;
        assert!(self.s.hold(v(id), held, at(ms)));
        self.frozen.remove(&id);
    }

    /// Checks what a hold promises after a decision: no order for a held vGPU, which has no
    /// work, holds no window, waits for none and is kept for none.
    fn check_held(&self, held: &BTreeSet<u64>, d: &Decision) {
        for a in &d.actions {
            let (Action::Freeze(id) | Action::Thaw(id)) = *a;
            assert!(!held.contains(&id.0), "{a:?} names a held vGPU");
        }
        for &id in held {
            let view = self.s.vgpu(v(id)).unwrap();
            assert_eq!(view.state, RunState::Held);
            assert!(!view.has_work && view.window_end.is_none() && view.waiting_since.is_none());
            assert!(self.s.is_held(v(id)));
            assert!(!self.s.frozen().any(|f| f == v(id)));
        }
        for g in 0..self.s.gpus.len() as u32 {
            let gpu = self.s.gpu(GpuIndex(g)).unwrap();
            for who in [gpu.holder, gpu.reserved_for].into_iter().flatten() {
                assert!(!held.contains(&who.0), "GPU {g} is kept for held {who}");
            }
        }
    }
}

#[test]
fn a_held_window_holder_passes_the_window_on_at_once() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    let d = n.sample(50, &[1, 2]);
    assert_eq!(d.actions, vec![Action::Freeze(v(2))]);
    // 1 holds the window until 200 ms; its user pauses it at 60.
    n.hold(1, true, 60);
    let d = n.decide(60);
    assert_eq!(d.actions, vec![Action::Thaw(v(2))], "no order for 1");
    assert_eq!(n.s.gpu(GpuIndex(0)).unwrap().holder, Some(v(2)));
    assert_eq!(n.stats(2).wait_time, Duration::from_millis(10));
    assert_eq!(d.next_due, None, "nobody waits: 1 is not waiting");
    // While held, its samples are ignored, and 2 runs alone for as long as it works.
    n.run(60, 3_000, |_, _| true);
    assert!(n.frozen().is_empty());
    assert_eq!(n.s.vgpu(v(1)).unwrap().state, RunState::Held);
    assert_eq!(
        n.stats(2).windows,
        1,
        "an extended window, never interrupted"
    );
    n.check_held(&BTreeSet::from([1]), &Decision::default());
}

#[test]
fn a_held_vgpu_that_was_frozen_is_left_frozen_by_its_user_and_stops_waiting() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    assert_eq!(n.frozen(), vec![2]);
    n.hold(2, true, 100);
    assert_eq!(
        n.stats(2).wait_time,
        Duration::from_millis(50),
        "its wait ends"
    );
    assert_eq!(n.s.vgpu(v(2)).unwrap().waiting_since, None);
    // 1's window would have ended at 200 for 2: it now extends, and 2 is never thawed.
    for t in (100..2_000).step_by(50) {
        let d = n.sample(t, &[1, 2]);
        assert!(d.actions.is_empty(), "at {t}: {:?}", d.actions);
        n.check_held(&BTreeSet::from([2]), &d);
    }
    assert_eq!(
        n.s.unbind(v(2), at(2_000)).unwrap().thaw,
        None,
        "its user's"
    );
}

#[test]
fn an_unheld_vgpu_rejoins_thawed_and_is_frozen_when_it_works_without_the_window() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    n.sample(50, &[1, 2]);
    assert_eq!(n.frozen(), vec![2]);
    n.hold(2, true, 60);
    n.run(60, 1_000, |_, _| true);
    // Resumed: it runs, without work, and is given no order until it shows work.
    n.hold(2, false, 1_000);
    let view = n.s.vgpu(v(2)).unwrap();
    assert_eq!((view.state, view.has_work), (RunState::Running, false));
    assert!(n.decide(1_000).actions.is_empty(), "no thaw: it runs");
    assert_eq!(n.s.vgpu(v(1)).unwrap().window_end, Some(at(1_010)));
    let d = n.sample(1_000, &[1, 2]);
    assert_eq!(d.actions, vec![Action::Freeze(v(2))], "1 holds the window");
    // And they take turns again.
    n.run(1_100, 5_000, |_, _| true);
    assert!(n.stats(2).windows >= 5, "{:?}", n.stats(2));
    let (a, b) = (n.gpu_secs(1), n.gpu_secs(2));
    assert!(b > 1.5, "2 got {b} s of the last 4, 1 got {a} s in all");
}

#[test]
fn an_unheld_vgpu_alone_with_work_is_never_frozen() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.hold(2, true, 0);
    n.run(0, 1_000, |id, _| id == 1);
    n.hold(2, false, 1_000);
    n.run(1_000, 3_000, |id, _| id == 2);
    assert!(n.frozen().is_empty());
    assert_eq!(n.s.gpu(GpuIndex(0)).unwrap().holder, Some(v(2)));
}

#[test]
fn the_pause_banks_no_virtual_time() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.run(0, 2_000, |_, _| true);
    n.hold(2, true, 2_000);
    n.run(2_000, 20_000, |_, _| true);
    n.hold(2, false, 20_000);
    let before = (n.gpu_secs(1), n.gpu_secs(2));
    n.run(20_000, 30_000, |_, _| true);
    let (a, b) = (n.gpu_secs(1) - before.0, n.gpu_secs(2) - before.1);
    assert!(
        (a - b).abs() < 0.5,
        "after the resume they share, 2 does not catch up: {a} vs {b}"
    );
}

#[test]
fn holding_a_busy_high_vgpu_lets_the_others_run() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(5, &[0], 1, Priority::High);
    n.sample(0, &[1, 5]);
    assert_eq!(n.frozen(), vec![1]);
    n.hold(5, true, 20);
    let d = n.decide(20);
    assert_eq!(d.actions, vec![Action::Thaw(v(1))]);
    n.run(50, 1_000, |_, _| true);
    assert!(n.frozen().is_empty());
}

#[test]
fn holding_a_multi_gpu_vgpu_drops_its_reservations() {
    let mut n = Node::new(2);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[1], 4, Priority::Normal);
    n.bind(9, &[0, 1], 1, Priority::Normal);
    // Find a moment at which 9 keeps a GPU while it waits for the other.
    let mut t = 0;
    let kept = loop {
        let running: Vec<u64> = [1, 2, 9]
            .into_iter()
            .filter(|id| !n.frozen.contains(id))
            .collect();
        n.sample(t, &running);
        let kept = (0..2).any(|g| n.s.gpu(GpuIndex(g)).unwrap().reserved_for == Some(v(9)));
        if kept && n.frozen.contains(&9) {
            break t;
        }
        t += 50;
        assert!(t < 20_000, "9 never waited holding a reservation");
    };
    n.hold(9, true, kept + 10);
    let d = n.decide(kept + 10);
    n.check_held(&BTreeSet::from([9]), &d);
    // With 9 held, 1 and 2 are each alone on their GPU: both run.
    n.run(kept + 50, kept + 2_000, |_, _| true);
    assert!(n.frozen().is_empty(), "{:?}", n.frozen());
}

#[test]
fn holds_are_idempotent_and_unknown_vgpus_are_refused() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    assert!(
        n.s.hold(v(1), false, at(0)),
        "unholding one not held changes nothing"
    );
    assert_eq!(n.s.vgpu(v(1)).unwrap().state, RunState::Running);
    assert!(n.s.hold(v(1), true, at(10)));
    assert!(n.s.hold(v(1), true, at(20)));
    assert!(n.s.is_held(v(1)));
    assert!(!n.s.hold(v(7), true, at(30)));
    assert!(!n.s.is_held(v(7)));
}

/// A vGPU held from the start is a vGPU that never has work: every order for the others, and
/// every `next_due`, is the same, whatever its samples say.
#[derive(Clone, Debug)]
struct HeldCase {
    bindings: Vec<(Vec<u32>, u32, Priority)>,
    /// Per sample, each vGPU's demand as a bit.
    samples: Vec<u8>,
}

fn held_case() -> impl proptest::strategy::Strategy<Value = HeldCase> {
    use proptest::prelude::*;
    let binding = (
        proptest::sample::subsequence(vec![0u32, 1, 2], 1..=2),
        1u32..=4,
        prop_oneof![
            6 => Just(Priority::Normal),
            1 => Just(Priority::Low),
            1 => Just(Priority::High),
        ],
    );
    (
        proptest::collection::vec(binding, 2..=5),
        proptest::collection::vec(any::<u8>(), 1..120),
    )
        .prop_map(|(bindings, samples)| HeldCase { bindings, samples })
}

/// One step of a random run with holds.
#[derive(Clone, Debug)]
enum HoldOp {
    Sample(u8),
    Hold(u64),
    Unhold(u64),
    Wait(u64),
}

fn hold_ops() -> impl proptest::strategy::Strategy<Value = Vec<HoldOp>> {
    use proptest::prelude::*;
    proptest::collection::vec(
        prop_oneof![
            6 => any::<u8>().prop_map(HoldOp::Sample),
            1 => (1u64..=5).prop_map(HoldOp::Hold),
            1 => (1u64..=5).prop_map(HoldOp::Unhold),
            2 => (1u64..400).prop_map(HoldOp::Wait),
        ],
        1..200,
    )
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    #[test]
    fn a_vgpu_held_from_the_start_is_one_that_never_works(case in held_case(), which in 0usize..5) {
        let held = (which % case.bindings.len()) as u64 + 1;
        let mut a = Node::new(3);
        let mut b = Node::new(3);
        for (i, (gpus, weight, priority)) in case.bindings.iter().enumerate() {
            a.bind(i as u64 + 1, gpus, *weight, *priority);
            b.bind(i as u64 + 1, gpus, *weight, *priority);
        }
        a.hold(held, true, 0);
        let mut t = 0;
        for bits in &case.samples {
            let working = |n: &Node, with_held: bool| -> Vec<u64> {
                (1..=case.bindings.len() as u64)
                    .filter(|&id| bits >> (id - 1) & 1 == 1 && !n.frozen.contains(&id))
                    .filter(|&id| with_held || id != held)
                    .collect()
            };
            let wa = working(&a, true);
            let wb = working(&b, false);
            let da = a.sample(t, &wa);
            let db = b.sample(t, &wb);
            proptest::prop_assert_eq!(&da, &db);
            a.check_held(&BTreeSet::from([held]), &da);
            t += SAMPLE_MS;
        }
    }

    #[test]
    fn a_held_vgpu_never_gets_an_order_and_the_others_keep_the_rules(
        case in held_case(),
        ops in hold_ops(),
    ) {
        let mut n = Node::new(3);
        let count = case.bindings.len() as u64;
        for (i, (gpus, weight, priority)) in case.bindings.iter().enumerate() {
            n.bind(i as u64 + 1, gpus, *weight, *priority);
        }
        let mut held = BTreeSet::new();
        let mut t = 0;
        for op in ops {
            let d = match op {
                HoldOp::Sample(bits) => {
                    let working: Vec<u64> = (1..=count)
                        .filter(|&id| bits >> (id - 1) & 1 == 1 && !n.frozen.contains(&id))
                        .collect();
                    n.sample(t, &working)
                }
                HoldOp::Hold(id) | HoldOp::Unhold(id) if id > count => continue,
                HoldOp::Hold(id) => {
                    n.hold(id, true, t);
                    held.insert(id);
                    n.decide(t)
                }
                HoldOp::Unhold(id) => {
                    // Released only when held: the node service's rule (its user resumed it).
                    if !held.remove(&id) {
                        continue;
                    }
                    n.hold(id, false, t);
                    n.decide(t)
                }
                HoldOp::Wait(ms) => {
                    t += ms;
                    n.decide(t)
                }
            };
            n.check_held(&held, &d);
            // The others keep the window rules: on each GPU, at most one non-high vGPU runs
            // with work, and a vGPU is frozen only while it has work.
            for g in 0..3u32 {
                let gpu = n.s.gpu(GpuIndex(g)).unwrap();
                let running_with_work = gpu
                    .bound
                    .iter()
                    .filter(|id| {
                        let view = n.s.vgpu(**id).unwrap();
                        view.binding.priority != Priority::High
                            && view.state == RunState::Running
                            && view.has_work
                    })
                    .count();
                proptest::prop_assert!(running_with_work <= 1, "GPU {}: {:?}", g, gpu);
            }
            for &id in &n.frozen {
                proptest::prop_assert!(n.s.vgpu(v(id)).unwrap().has_work);
            }
            t += 1;
        }
    }
}

impl Node {
    /// Says at `ms` that `id`'s container has `signal` pending, and carries out the thaw.
    fn stop(&mut self, id: u64, signal: StopSignal, ms: u64) -> Option<Action> {
        self.now = ms;
        let thaw = self.s.stop(v(id), signal, at(ms));
        self.apply(thaw.as_slice());
        thaw
    }
}

#[test]
fn a_frozen_vgpu_with_a_graceful_stop_pending_runs_its_grace_out_of_windows_once() {
    let mut n = Node::new(1);
    // 1 is high priority: 2 is frozen for as long as 1 works.
    n.bind(1, &[0], 1, Priority::High);
    n.bind(2, &[0], 1, Priority::Normal);
    n.run(0, 500, |_, _| true);
    assert_eq!(n.frozen(), vec![2]);
    // SIGTERM to 2 (podman stop): thawed at once, out of windows, for stop_grace (30 s).
    assert_eq!(
        n.stop(2, StopSignal::Graceful, 500),
        Some(Action::Thaw(v(2)))
    );
    assert_eq!(n.s.vgpu(v(2)).unwrap().state, RunState::Stopping);
    n.run(500, 30_000, |_, _| true);
    assert!(
        n.frozen().is_empty(),
        "stopping: never frozen again within its grace"
    );
    // A second graceful stop is no new grace; its grace ends, and it is windowed again.
    assert_eq!(n.stop(2, StopSignal::Graceful, 30_000), None);
    n.run(30_000, 30_600, |_, _| true);
    assert_eq!(n.frozen(), vec![2], "its grace over, it waits for 1 again");
    assert_eq!(n.stop(2, StopSignal::Graceful, 30_600), None, "once only");
    assert_eq!(n.frozen(), vec![2]);
    // SIGKILL: out of windows until it is unbound.
    assert_eq!(
        n.stop(2, StopSignal::Kill, 30_650),
        Some(Action::Thaw(v(2)))
    );
    n.run(30_650, 120_000, |_, _| true);
    assert!(n.frozen().is_empty());
    assert_eq!(n.s.vgpu(v(2)).unwrap().state, RunState::Stopping);
    assert_eq!(n.stop(2, StopSignal::Kill, 120_000), None);
    assert!(n.s.unbind(v(2), at(120_000)).unwrap().thaw.is_none());
}

#[test]
fn a_stopping_window_holder_passes_the_window_and_a_held_one_stays_its_users() {
    let mut n = Node::new(1);
    n.bind(1, &[0], 1, Priority::Normal);
    n.bind(2, &[0], 1, Priority::Normal);
    n.sample(0, &[1]);
    let d = n.sample(50, &[1, 2]);
    assert_eq!(d.actions, vec![Action::Freeze(v(2))]);
    // 1 holds the window and is told to stop: nothing to thaw; 2 gets the window at once.
    assert_eq!(n.stop(1, StopSignal::Graceful, 60), None);
    let d = n.decide(60);
    assert_eq!(d.actions, vec![Action::Thaw(v(2))]);
    // A user's pause while stopping changes nothing; neither does its resume.
    n.hold(1, true, 70);
    n.hold(1, false, 80);
    n.run(80, 3_000, |_, _| true);
    assert!(n.frozen().is_empty());
    assert_eq!(n.s.vgpu(v(1)).unwrap().state, RunState::Stopping);
    // A held vGPU that gets a stop signal keeps its user's pause: no order names it.
    n.bind(3, &[0], 1, Priority::Normal);
    n.hold(3, true, 3_000);
    assert_eq!(n.stop(3, StopSignal::Kill, 3_050), None);
    assert_eq!(n.s.vgpu(v(3)).unwrap().state, RunState::Held);
}
