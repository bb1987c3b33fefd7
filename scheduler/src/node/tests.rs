//! The life of a vGPU on a node: reserve, attach, register, hold, release, lapse, restore,
//! status.

use super::*;
use crate::inventory::AssignmentPolicy;
use crate::request::Priority;
use std::time::Duration;

const GIB: u64 = 1 << 30;

fn at(ms: u64) -> Instant {
    Instant::from_nanos(ms * 1_000_000)
}

pub(super) fn node(gpus: u32, policy: AssignmentPolicy) -> Node {
    let gpus = (0..gpus)
        .map(|i| Gpu {
            index: GpuIndex(i),
            uuid: format!("GPU-test-{i}"),
            model: "NVIDIA A100-SXM4-40GB".into(),
            memory: 40 * GIB,
        })
        .collect();
    let config = SchedulerConfig {
        policy,
        reservation_ttl: Duration::from_secs(60),
        ..SchedulerConfig::default()
    };
    Node::new(gpus, config).unwrap()
}

fn mem(gib: &str) -> Vec<(&'static str, String)> {
    vec![("gpuplex.io/gpu-memory", gib.to_string())]
}

fn reserve(n: &mut Node, annotations: &[(&str, &str)], ms: u64) -> Result<VgpuId, NodeError> {
    n.reserve(annotations.iter().copied(), fresh(), at(ms))
        .map(|r| r.id)
}

/// A handle no other call of this test process gets.
fn fresh() -> Handle {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    Handle::from_bytes(u128::from(NEXT.fetch_add(1, Ordering::Relaxed)).to_be_bytes())
}

/// The handle `v` was reserved with (a handle nothing was reserved with for an unknown `v`).
fn handle_of(n: &Node, v: VgpuId) -> Handle {
    n.record(v)
        .map_or(Handle::from_bytes([0xee; 16]), |r| r.handle)
}

fn container(id: &str, pid: u32) -> Attachment {
    Attachment {
        container: id.into(),
        target: Target::Pid(pid),
    }
}

const EIGHT: &[(&str, &str)] = &[("gpuplex.io/gpu-memory", "8Gi")];

#[test]
fn a_reservation_holds_memory_until_released() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let v = reserve(&mut n, EIGHT, 0).unwrap();
    assert_eq!(v, VgpuId(1));
    let record = n.record(v).unwrap();
    assert_eq!(record.assignment.gpus, vec![GpuIndex(0)]);
    assert_eq!(record.annotations["gpuplex.io/gpu-memory"], "8Gi");
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 32 * GIB);
    let status = n.status(at(1000));
    assert_eq!(status.containers.len(), 0);
    assert_eq!(status.reservations[0].vgpu, "vgpu-1");
    assert!((status.reservations[0].expires_in_seconds - 59.0).abs() < 1e-9);
    assert_eq!(status.gpus[0].reservations, vec!["vgpu-1".to_string()]);
    let released = n.release(&ReleaseKey::Vgpu(v), at(10)).unwrap();
    assert_eq!((released.record.id, released.thaw), (v, None));
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 40 * GIB);
    assert!(
        n.release(&ReleaseKey::Vgpu(v), at(10)).is_none(),
        "released once"
    );
}

#[test]
fn reserve_refuses_what_asks_for_nothing_is_invalid_or_fits_nowhere() {
    let mut n = node(2, AssignmentPolicy::Spread);
    assert_eq!(
        reserve(&mut n, &[("io.kubernetes.pod.name", "web")], 0),
        Err(NodeError::NoRequest)
    );
    let e = reserve(&mut n, &[("gpuplex.io/weight", "0")], 0).unwrap_err();
    assert!(e.to_string().contains("gpuplex.io/weight=`0`"), "{e}");
    let e = reserve(&mut n, &[("gpuplex.io/gpu-memory", "41Gi")], 0).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("GPU 0") && text.contains("GPU 1") && text.contains("40 GiB"),
        "{text}"
    );
    assert!(!text.contains('\n'));
    let mut empty = node(0, AssignmentPolicy::Spread);
    let e = reserve(&mut empty, EIGHT, 0).unwrap_err();
    assert!(e.to_string().contains("no GPU"), "{e}");
    assert_eq!(n.records().count(), 0, "nothing reserved by a refusal");
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 40 * GIB);
}

#[test]
fn an_id_a_refusal_names_is_never_another_vgpus() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let e = reserve(&mut n, &[("gpuplex.io/gpu-memory", "41Gi")], 0).unwrap_err();
    let named = n.next_id() - 1;
    assert!(e.to_string().contains(&format!("vgpu-{named}")), "{e}");
    let next = reserve(&mut n, EIGHT, 0).unwrap();
    assert!(
        next.0 > named,
        "{next} after a refusal that named vgpu-{named}"
    );
}

#[test]
fn arrivals_close_together_get_different_idle_gpus_under_either_policy() {
    for policy in [AssignmentPolicy::Spread, AssignmentPolicy::Pack] {
        let mut n = node(2, policy);
        let a = reserve(&mut n, EIGHT, 0).unwrap();
        let b = reserve(&mut n, EIGHT, 1).unwrap();
        let gpus = |v| n.record(v).unwrap().assignment.gpus.clone();
        assert_ne!(gpus(a), gpus(b), "{policy:?}");
    }
}

#[test]
fn registrations_close_together_get_different_idle_gpus_and_share_once_none_is_idle() {
    for policy in [AssignmentPolicy::Spread, AssignmentPolicy::Pack] {
        let mut n = node(2, policy);
        let ids: Vec<VgpuId> = (0..3)
            .map(|i| {
                n.register(
                    EIGHT.iter().copied(),
                    fresh(),
                    container(&format!("c{i}"), i + 1),
                    at(0),
                )
                .unwrap()
                .id
            })
            .collect();
        let gpu = |n: &Node, v: VgpuId| n.record(v).unwrap().assignment.gpus[0];
        assert_ne!(gpu(&n, ids[0]), gpu(&n, ids[1]), "{policy:?}");
        // Once sampled without work, they are no arrivals any more: pack fills one GPU again.
        for &v in &ids {
            n.observe(v, false, at(50));
        }
        let d = n
            .register(EIGHT.iter().copied(), fresh(), container("d", 9), at(60))
            .unwrap()
            .id;
        let busiest = if n.inventory().bound(GpuIndex(0)) > 2 {
            GpuIndex(0)
        } else {
            GpuIndex(1)
        };
        match policy {
            AssignmentPolicy::Pack => assert_eq!(gpu(&n, d), busiest),
            AssignmentPolicy::Spread => assert_ne!(gpu(&n, d), gpu(&n, ids[2])),
        }
    }
}

#[test]
fn attach_binds_the_container_and_is_idempotent() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let v = reserve(&mut n, EIGHT, 0).unwrap();
    let first = n
        .attach(&handle_of(&n, v), container("c1", 100), at(5))
        .unwrap()
        .clone();
    assert_eq!(first.attachment(), Some(&container("c1", 100)));
    assert_eq!(
        n.attach(&handle_of(&n, v), container("c1", 100), at(6))
            .unwrap(),
        &first
    );
    assert_eq!(n.vgpu_of("c1"), Some(v));
    let status = n.status(at(6));
    assert_eq!(status.containers[0].state, ContainerState::Idle);
    assert_eq!(status.gpus[0].containers, vec!["c1".to_string()]);
    assert!(status.reservations.is_empty());
    assert_eq!(
        n.attach(&handle_of(&n, v), container("c2", 200), at(7)),
        Err(NodeError::AttachedElsewhere {
            vgpu: v,
            attached: "c1".into(),
            container: "c2".into()
        })
    );
    let w = reserve(&mut n, EIGHT, 8).unwrap();
    assert_eq!(
        n.attach(&handle_of(&n, w), container("c1", 100), at(9)),
        Err(NodeError::ContainerAttached {
            container: "c1".into(),
            attached: v
        })
    );
    assert_eq!(
        n.attach(&handle_of(&n, VgpuId(99)), container("c3", 1), at(9)),
        Err(NodeError::UnknownHandle)
    );
    for bad in ["", "a b", "x\ny"] {
        assert_eq!(
            n.attach(&handle_of(&n, w), container(bad, 1), at(9)),
            Err(NodeError::BadContainerId(bad.into()))
        );
    }
    assert!(n.record(w).unwrap().attachments.is_empty());
}

#[test]
fn register_is_reserve_and_attach_and_leaves_nothing_when_it_fails() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let annotations = [
        ("gpuplex.io/gpu-memory", "30Gi"),
        ("gpuplex.io/weight", "3"),
    ];
    let v = n
        .register(annotations, fresh(), container("job", 7), at(0))
        .unwrap()
        .id;
    assert_eq!(n.record(v).unwrap().request.weight, 3);
    // Registering the same container again returns the same vGPU, whatever it asks now.
    let again = n.register(
        mem("1Gi").iter().map(|(k, v)| (*k, v.as_str())),
        fresh(),
        container("job", 7),
        at(1),
    );
    assert_eq!(again.unwrap().id, v);
    // One that does not fit leaves no reservation behind.
    let e = n.register(
        [("gpuplex.io/gpu-memory", "20Gi")],
        fresh(),
        container("other", 8),
        at(2),
    );
    assert!(matches!(e, Err(NodeError::Assign(_))), "{e:?}");
    assert_eq!(n.records().count(), 1);
    assert_eq!(n.vgpu_of("other"), None);
    assert_eq!(
        n.register(EIGHT.iter().copied(), fresh(), container(" ", 9), at(3)),
        Err(NodeError::BadContainerId(" ".into()))
    );
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 10 * GIB);
}

#[test]
fn only_a_handle_attaches_or_releases_on_a_containers_behalf() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let victim = reserve(&mut n, EIGHT, 0).unwrap();
    let victim_handle = handle_of(&n, victim);
    let mine = reserve(&mut n, EIGHT, 1).unwrap();
    // Another reservation's handle is no use to a guess: an unknown handle attaches nothing and
    // releases nothing.
    let guess = Handle::from_bytes([0x42; 16]);
    assert_eq!(
        n.attach(&guess, container("thief", 5), at(2)),
        Err(NodeError::UnknownHandle)
    );
    assert_eq!(n.release(&ReleaseKey::Handle(guess), at(2)), None);
    n.attach(&victim_handle, container("victim", 6), at(3))
        .unwrap();
    // A register under the victim's container id, from another process, gets nothing of it.
    assert_eq!(
        n.register(
            EIGHT.iter().copied(),
            fresh(),
            container("victim", 7),
            at(4)
        ),
        Err(NodeError::ContainerAttached {
            container: "victim".into(),
            attached: victim
        })
    );
    // The same container registering again (a hook run twice) gets its own vGPU back.
    assert_eq!(
        n.register(
            EIGHT.iter().copied(),
            fresh(),
            container("victim", 6),
            at(5)
        )
        .map(|r| r.id),
        Ok(victim)
    );
    let released = n.release(&ReleaseKey::Handle(handle_of(&n, mine)), at(6));
    assert_eq!(released.map(|r| r.record.id), Some(mine));
    assert_eq!(n.vgpu_of("victim"), Some(victim), "untouched");
    // A handle is one reservation's, and is not given to a second one.
    assert_eq!(
        reserve_with(&mut n, victim_handle, 7),
        Err(NodeError::HandleInUse)
    );
}

fn reserve_with(n: &mut Node, handle: Handle, ms: u64) -> Result<VgpuId, NodeError> {
    n.reserve(EIGHT.iter().copied(), handle, at(ms))
        .map(|r| r.id)
}

#[test]
fn ids_start_where_the_service_says_and_never_repeat() {
    let mut n = node(1, AssignmentPolicy::Spread);
    n.start_ids_at(1_764_600_000_000);
    let a = reserve(&mut n, EIGHT, 0).unwrap();
    assert_eq!(a, VgpuId(1_764_600_000_000));
    n.release(&ReleaseKey::Vgpu(a), at(1));
    // A lower start never takes the numbering back.
    n.start_ids_at(5);
    let b = reserve(&mut n, EIGHT, 2).unwrap();
    assert_eq!(b, VgpuId(1_764_600_000_001));
    assert_eq!(n.next_id(), 1_764_600_000_002);
    // Past the last number there are none left: refused, not wrapped around.
    n.start_ids_at(u64::MAX);
    assert_eq!(reserve(&mut n, EIGHT, 3), Err(NodeError::IdsExhausted));
}

/// Containers `a` and `b`, registered on one GPU and both with work at 50 ms: the decision
/// then freezes one of them. The node, `a`, `b` and the frozen one.
fn contending() -> (Node, VgpuId, VgpuId, VgpuId) {
    let mut n = node(1, AssignmentPolicy::Spread);
    let a = n
        .register(EIGHT.iter().copied(), fresh(), container("a", 1), at(0))
        .unwrap()
        .id;
    let b = n
        .register(EIGHT.iter().copied(), fresh(), container("b", 2), at(0))
        .unwrap()
        .id;
    n.observe(a, true, at(50));
    n.observe(b, true, at(50));
    let frozen = match n.decide(at(50)).actions[..] {
        [Action::Freeze(w)] => w,
        ref other => panic!("one freeze, not {other:?}"),
    };
    (n, a, b, frozen)
}

#[test]
fn release_by_container_thaws_a_frozen_one_and_frees_its_memory() {
    let (mut n, a, _, frozen) = contending();
    let name = if frozen == a { "a" } else { "b" };
    let status = n.status(at(80));
    let waiting = status
        .containers
        .iter()
        .find(|s| s.state == ContainerState::Frozen)
        .unwrap();
    assert!((waiting.waiting_seconds - 0.03).abs() < 1e-9);
    assert_eq!(
        status.gpus[0].holder.as_deref(),
        Some(if name == "a" { "b" } else { "a" })
    );
    let released = n
        .release(&ReleaseKey::Container(name.into()), at(100))
        .unwrap();
    assert_eq!(released.thaw, Some(Action::Thaw(frozen)));
    assert_eq!(n.vgpu_of(name), None);
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 32 * GIB);
    assert!(n
        .release(&ReleaseKey::Container(name.into()), at(100))
        .is_none());
}

#[test]
fn a_held_container_is_paused_gets_no_order_and_rejoins_thawed() {
    let (mut n, a, b, waiter) = contending();
    let holder = if waiter == a { b } else { a };
    // The window holder's user pauses it, by container; then again, by vGPU.
    let name = |v: VgpuId| if v == a { "a" } else { "b" };
    let key = ReleaseKey::Container(name(holder).into());
    assert_eq!(n.hold(&key, true, at(60)), Ok(holder));
    assert_eq!(n.hold(&ReleaseKey::Vgpu(holder), true, at(61)), Ok(holder));
    assert!(n.is_held(holder) && !n.is_held(waiter));
    let d = n.decide(at(61));
    assert_eq!(
        d.actions,
        vec![Action::Thaw(waiter)],
        "the window passes on at once"
    );
    for t in (100..2_000).step_by(50) {
        n.observe(a, true, at(t));
        n.observe(b, true, at(t));
        let d = n.decide(at(t));
        assert!(d.actions.is_empty(), "at {t}: {:?}", d.actions);
    }
    let status = n.status(at(2_000));
    let state = |id: &str| status.containers.iter().find(|c| c.id == id).unwrap().state;
    assert_eq!(state(name(holder)), ContainerState::Paused);
    assert_eq!(state(name(waiter)), ContainerState::Running);
    assert_eq!(ContainerState::Paused.name(), "paused");
    assert_eq!(
        serde_json::to_value(ContainerState::Paused).unwrap(),
        "paused"
    );
    // Resumed: it runs, and is frozen by the next decision that sees its work.
    assert_eq!(n.hold(&key, false, at(2_000)), Ok(holder));
    assert_eq!(n.hold(&key, false, at(2_000)), Ok(holder), "idempotent");
    assert!(n.decide(at(2_000)).actions.is_empty());
    n.observe(holder, true, at(2_010));
    assert_eq!(n.decide(at(2_010)).actions, vec![Action::Freeze(holder)]);
}

#[test]
fn a_hold_needs_an_attached_container() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let r = reserve(&mut n, EIGHT, 0).unwrap();
    let e = n.hold(&ReleaseKey::Container("nobody".into()), true, at(1));
    assert_eq!(e, Err(NodeError::UnknownContainer("nobody".into())));
    assert_eq!(
        e.unwrap_err().to_string(),
        "container nobody is not attached to a vGPU on this node (it was never attached, or it was released)"
    );
    assert_eq!(
        n.hold(&ReleaseKey::Vgpu(VgpuId(9)), true, at(1)),
        Err(NodeError::UnknownVgpu(VgpuId(9)))
    );
    assert_eq!(
        n.hold(&ReleaseKey::Vgpu(r), false, at(1)),
        Err(NodeError::NotAttached(r))
    );
    assert!(!n.is_held(r));
}

#[test]
fn a_held_container_released_is_left_to_its_user() {
    let (mut n, _, _, frozen) = contending();
    n.hold(&ReleaseKey::Vgpu(frozen), true, at(60)).unwrap();
    let released = n.release(&ReleaseKey::Vgpu(frozen), at(70)).unwrap();
    assert_eq!(
        released.thaw, None,
        "gpuplex did not freeze it last: its user did"
    );
}

#[test]
fn a_reservation_nobody_attaches_lapses_after_its_ttl() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let lapsing = reserve(&mut n, EIGHT, 1_000).unwrap();
    let lapsing_handle = handle_of(&n, lapsing);
    let kept = reserve(&mut n, EIGHT, 2_000).unwrap();
    n.attach(&handle_of(&n, kept), container("c", 1), at(3_000))
        .unwrap();
    let d = n.decide(at(3_000));
    assert_eq!(d.next_due, Some(at(61_000)), "the next lapse is due");
    assert!(n.decide(at(60_999)).lapsed.is_empty());
    let d = n.decide(at(61_000));
    assert_eq!(
        d.lapsed.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![lapsing]
    );
    assert_eq!(d.next_due, None);
    assert!(n.record(lapsing).is_none());
    assert!(n.record(kept).is_some(), "attached: never lapses");
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 32 * GIB);
    assert_eq!(
        n.attach(&lapsing_handle, container("late", 2), at(61_001)),
        Err(NodeError::UnknownHandle)
    );
}

#[test]
fn records_restore_after_a_restart_never_beyond_a_gpus_memory() {
    let mut before = node(2, AssignmentPolicy::Spread);
    let a = before
        .register(
            [
                ("gpuplex.io/gpu-memory", "30Gi"),
                ("gpuplex.io/priority", "high"),
            ],
            fresh(),
            container("a", 1),
            at(0),
        )
        .unwrap()
        .id;
    let b = reserve(&mut before, &[("gpuplex.io/gpu-memory", "30Gi")], 0).unwrap();
    let saved: Vec<VgpuRecord> = before.records().cloned().collect();

    let mut after = node(2, AssignmentPolicy::Spread);
    for record in saved.clone() {
        after.restore(record, at(10)).unwrap();
    }
    assert_eq!(after.records().cloned().collect::<Vec<_>>(), saved);
    assert_eq!(after.vgpu_of("a"), Some(a));
    assert_eq!(after.status(at(10)).containers[0].priority, Priority::High);
    assert!(
        after.windows().vgpu(a).is_some(),
        "attached: scheduled again"
    );
    assert!(after.windows().vgpu(b).is_none(), "reserved: not scheduled");
    // New ids continue above the restored ones.
    assert_eq!(reserve(&mut after, EIGHT, 20).unwrap(), VgpuId(3));
    // A record that would overfill a GPU is refused, and changes nothing.
    let mut over = saved[0].clone();
    over.id = VgpuId(50);
    over.handle = fresh();
    over.attachments = vec![container("z", 9)];
    let unreserved = after.inventory().unreserved(over.assignment.gpus[0]);
    assert!(matches!(
        after.restore(over, at(30)),
        Err(NodeError::Assign(_))
    ));
    assert_eq!(
        after.inventory().unreserved(saved[0].assignment.gpus[0]),
        unreserved
    );
    assert_eq!(after.vgpu_of("z"), None);
    // The same record twice, or a container twice, or a handle twice, is refused too.
    assert!(after.restore(saved[0].clone(), at(30)).is_err());
    let mut same_handle = saved[1].clone();
    same_handle.id = VgpuId(60);
    assert_eq!(
        after.restore(same_handle, at(30)),
        Err(NodeError::HandleInUse)
    );
}

#[test]
fn status_serializes_for_tools() {
    let mut n = node(1, AssignmentPolicy::Spread);
    n.register(
        [
            ("gpuplex.io/gpu-memory", "8Gi"),
            ("gpuplex.io/priority", "low"),
            ("io.kubernetes.cri.sandbox-name", "trainer-0"),
            ("io.kubernetes.cri.sandbox-namespace", "ml"),
            ("io.other/ignored", "x"),
        ],
        fresh(),
        container("c", 1),
        at(0),
    )
    .unwrap();
    let json = serde_json::to_value(n.status(at(0))).unwrap();
    let c = &json["containers"][0];
    assert_eq!(c["id"], "c");
    assert_eq!(c["vgpu"], "vgpu-1");
    assert_eq!(c["priority"], "low");
    assert_eq!(c["state"], "idle");
    assert_eq!(c["memory"][0], 8 * GIB);
    assert_eq!(
        (&c["pod"], &c["namespace"]),
        (&"trainer-0".into(), &"ml".into())
    );
    assert_eq!(json["gpus"][0]["uuid"], "GPU-test-0");
    assert_eq!(json["gpus"][0]["fake"], false);
    assert!(!n
        .record(VgpuId(1))
        .unwrap()
        .annotations
        .contains_key("io.other/ignored"));
    let back: NodeStatus = serde_json::from_value(json).unwrap();
    assert_eq!(back, n.status(at(0)));
}

#[derive(Clone, Debug)]
enum Op {
    Reserve(u8, u8),
    Attach(u64, u8),
    Register(u8, u8, u8),
    ReleaseVgpu(u64),
    ReleaseContainer(u8),
    Hold(u8, bool),
    Observe(u64, bool),
    Pin(u8, u8, u8),
    ReleaseClaim(u8),
    Detach(u64, u8),
    Decide,
    Wait(u64),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (1u8..=45, 1u8..=3).prop_map(|(g, n)| Op::Reserve(g, n)),
        (1u64..12, 0u8..6).prop_map(|(v, c)| Op::Attach(v, c)),
        (1u8..=45, 1u8..=2, 0u8..6).prop_map(|(g, n, c)| Op::Register(g, n, c)),
        (1u64..12).prop_map(Op::ReleaseVgpu),
        (0u8..6).prop_map(Op::ReleaseContainer),
        (0u8..6, any::<bool>()).prop_map(|(c, h)| Op::Hold(c, h)),
        (1u64..12, any::<bool>()).prop_map(|(v, w)| Op::Observe(v, w)),
        (0u8..4, 1u8..8, 1u8..=45).prop_map(|(c, gpus, g)| Op::Pin(c, gpus, g)),
        (0u8..4).prop_map(Op::ReleaseClaim),
        (1u64..12, 0u8..6).prop_map(|(v, c)| Op::Detach(v, c)),
        Just(Op::Decide),
        (1u64..40_000).prop_map(Op::Wait),
    ]
}

proptest::proptest! {
    /// Whatever the sequence of requests, the bookkeeping stays consistent: memory within
    /// capacity, each container on at most one vGPU and each attached vGPU scheduled, nothing
    /// reserved for longer than its TTL once a decision has run.
    #[test]
    fn bookkeeping_stays_consistent(ops in proptest::collection::vec(op(), 1..80)) {
        let mut n = node(3, AssignmentPolicy::Spread);
        let mut now = 0u64;
        for op in ops {
            let t = at(now);
            match op {
                Op::Reserve(gib, gpus) => {
                    let a = [("gpuplex.io/gpu-memory", format!("{gib}Gi")), ("gpuplex.io/gpus", gpus.to_string())];
                    let _ = n.reserve(a.iter().map(|(k, v)| (*k, v.as_str())), fresh(), t);
                }
                Op::Attach(v, c) => {
                    let _ = n.attach(&handle_of(&n, VgpuId(v)), container(&format!("c{c}"), 1), t);
                }
                Op::Register(gib, gpus, c) => {
                    let a = [("gpuplex.io/gpu-memory", format!("{gib}Gi")), ("gpuplex.io/gpus", gpus.to_string())];
                    let _ = n.register(a.iter().map(|(k, v)| (*k, v.as_str())), fresh(), container(&format!("c{c}"), 1), t);
                }
                Op::ReleaseVgpu(v) => {
                    let _ = n.release(&ReleaseKey::Vgpu(VgpuId(v)), t);
                }
                Op::ReleaseContainer(c) => {
                    let claim = n.vgpu_of(&format!("c{c}")).and_then(|v| n.record(v)?.claim.clone());
                    let released = n.release(&ReleaseKey::Container(format!("c{c}")), t);
                    if claim.is_some() {
                        proptest::prop_assert!(released.is_none(), "a container released its claim's vGPU");
                    }
                }
                Op::Hold(c, held) => {
                    let key = ReleaseKey::Container(format!("c{c}"));
                    match n.hold(&key, held, t) {
                        Ok(v) => proptest::prop_assert_eq!(n.is_held(v), held),
                        Err(NodeError::HoldShared { vgpu, count, .. }) => {
                            proptest::prop_assert!(held && count > 1 && !n.is_held(vgpu));
                            proptest::prop_assert_eq!(n.record(vgpu).unwrap().attachments.len(), count);
                        }
                        Err(e) => proptest::prop_assert_eq!(e, NodeError::UnknownContainer(format!("c{c}"))),
                    }
                }
                Op::Observe(v, w) => {
                    n.observe(VgpuId(v), w, t);
                }
                Op::Pin(c, mask, gib) => {
                    // GPUs 0..3 as a bit mask, one GPU more than the node has now and then.
                    let gpus = (0..4).filter(|i| mask & (1 << i) != 0).map(GpuIndex).collect();
                    let placement = Placement { gpus, memory: u64::from(gib) * GIB };
                    let claim = format!("claim-{c}");
                    let before = n.records().count();
                    match n.pin(&claim, [], &placement, fresh(), t) {
                        Ok(r) => {
                            proptest::prop_assert_eq!(r.claim.as_deref(), Some(claim.as_str()));
                            let mut gpus = placement.gpus.clone();
                            gpus.sort_unstable();
                            proptest::prop_assert_eq!(&r.assignment.gpus, &gpus);
                        }
                        Err(_) => proptest::prop_assert_eq!(n.records().count(), before),
                    }
                }
                Op::ReleaseClaim(c) => {
                    let claim = format!("claim-{c}");
                    let _ = n.release(&ReleaseKey::Claim(claim.clone()), t);
                    proptest::prop_assert!(n.records().all(|r| r.claim.as_ref() != Some(&claim)));
                }
                Op::Detach(v, c) => {
                    let pinned = n.record(VgpuId(v)).is_some_and(|r| r.claim.is_some());
                    let container = format!("c{c}");
                    let detached = n.detach(VgpuId(v), &container, t);
                    proptest::prop_assert!(detached.is_none() || pinned);
                    if pinned {
                        let r = n.record(VgpuId(v));
                        proptest::prop_assert!(r.is_some_and(|r| !r.containers().any(|x| x == container)), "a claim's vGPU went with its container");
                    }
                    if detached.is_some() {
                        proptest::prop_assert_eq!(n.vgpu_of(&container), None);
                    }
                }
                Op::Decide => {
                    let d = n.decide(t);
                    for a in &d.actions {
                        let (Action::Freeze(v) | Action::Thaw(v)) = *a;
                        proptest::prop_assert!(!n.is_held(v), "{:?} names a held vGPU", a);
                    }
                    for r in &d.lapsed {
                        proptest::prop_assert!(r.attachments.is_empty());
                        proptest::prop_assert!(r.claim.is_none(), "a claim's reservation lapsed");
                        proptest::prop_assert!(t >= r.reserved_at + n.config().reservation_ttl);
                    }
                    for r in n.records() {
                        proptest::prop_assert!(!r.attachments.is_empty() || r.claim.is_some() || t < r.reserved_at + n.config().reservation_ttl);
                    }
                }
                Op::Wait(ms) => now += ms,
            }
            for gpu in n.inventory().gpus() {
                let bound: u64 = n
                    .records()
                    .filter(|r| r.assignment.gpus.contains(&gpu.index))
                    .map(|r| n.inventory().entitlement(r.id, gpu.index).unwrap())
                    .sum();
                proptest::prop_assert!(bound <= gpu.memory);
                proptest::prop_assert_eq!(bound + n.inventory().unreserved(gpu.index), gpu.memory);
            }
            let mut containers = std::collections::HashSet::new();
            let mut attached = 0;
            for r in n.records() {
                proptest::prop_assert_eq!(n.windows().vgpu(r.id).is_some(), !r.attachments.is_empty());
                attached += usize::from(!r.attachments.is_empty());
                let most = if r.claim.is_some() { super::MAX_SHARING } else { 1 };
                proptest::prop_assert!(r.attachments.len() <= most, "{} has {} containers", r.id, r.attachments.len());
                for a in &r.attachments {
                    proptest::prop_assert!(containers.insert(a.container.clone()));
                    proptest::prop_assert_eq!(n.vgpu_of(&a.container), Some(r.id));
                }
            }
            proptest::prop_assert_eq!(n.windows().vgpus().count(), attached);
            let mut claims = std::collections::HashSet::new();
            for r in n.records() {
                if let Some(claim) = &r.claim {
                    proptest::prop_assert!(claims.insert(claim.clone()), "{} pinned twice", claim);
                }
            }
        }
    }
}

#[test]
fn accounting_carries_over_a_restart() {
    let mut n = node(1, AssignmentPolicy::Spread);
    let v = n
        .register(
            [("gpuplex.io/gpu-memory", "8Gi")],
            fresh(),
            container("c", 1),
            at(0),
        )
        .unwrap()
        .id;
    let stats = VgpuStats {
        gpu_time: Duration::from_secs(7),
        windows: 3,
        wait_time: Duration::from_secs(2),
        ..VgpuStats::default()
    };
    assert!(n.carry_over_vgpu_stats(v, stats));
    assert!(!n.carry_over_vgpu_stats(VgpuId(99), VgpuStats::default()));
    let gpu = GpuStats {
        busy_time: Duration::from_secs(9),
        switches: 4,
    };
    assert!(n.carry_over_gpu_stats(GpuIndex(0), gpu));
    assert!(!n.carry_over_gpu_stats(GpuIndex(5), GpuStats::default()));
    let status = n.status(at(1));
    assert_eq!(status.containers[0].gpu_seconds, 7.0);
    assert_eq!(status.containers[0].windows, 3);
    assert_eq!(status.containers[0].wait_seconds, 2.0);
    assert_eq!(
        (status.gpus[0].busy_seconds, status.gpus[0].switches),
        (9.0, 4)
    );
}
