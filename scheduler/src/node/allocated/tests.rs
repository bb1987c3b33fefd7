//! The device plugin's allocations: pinned where the kubelet's units are, released when the
//! kubelet gives their units again.

use super::*;
use crate::node::Target;
use crate::policy::PolicyConfig;
use crate::request::GpuMemory;
use crate::GpuIndex;
use proptest::prelude::*;

const GIB: u64 = 1 << 30;

fn at(secs: u64) -> Instant {
    Instant::from_nanos(secs * 1_000_000_000)
}

/// Two 40 GiB GPUs.
fn node() -> Node {
    crate::node::tests::node(2, crate::inventory::AssignmentPolicy::Spread)
}

fn handle(n: u8) -> Handle {
    Handle::from_bytes([n; 16])
}

fn units(gpu: u32, ns: impl IntoIterator<Item = u32>) -> Vec<UnitId> {
    ns.into_iter()
        .map(|n| UnitId {
            gpu: GpuIndex(gpu),
            n,
        })
        .collect()
}

fn ctr(id: &str, pid: u32) -> Attachment {
    Attachment {
        container: id.into(),
        target: Target::Pid(pid),
    }
}

fn asking(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn units_are_pinned_on_their_gpu_with_their_memory_and_never_lapse() {
    let mut n = node();
    let done = n
        .allocate(&units(1, [3, 0, 1, 2]), GIB, handle(1), at(0))
        .unwrap();
    assert!(done.released.is_empty());
    let r = n.record(done.vgpu).unwrap();
    assert_eq!(r.assignment.gpus, vec![GpuIndex(1)]);
    assert_eq!(r.assignment.memory, GpuMemory::Bytes(4 * GIB));
    assert_eq!(r.units, units(1, 0..4), "kept ascending");
    assert_eq!(r.claim.as_deref(), Some("units-gpu-1-0"));
    assert_eq!(r.handle, handle(1));
    assert_eq!(r.request.weight, 1);
    assert_eq!(n.inventory().unreserved(GpuIndex(1)), 36 * GIB);
    assert!(n.decide(at(24 * 3600)).lapsed.is_empty());
    // A container's runtime cannot release it; the operator can, by its key.
    assert!(n.release(&ReleaseKey::Handle(handle(1)), at(1)).is_none());
    assert!(n
        .release(&ReleaseKey::Claim("units-gpu-1-0".into()), at(1))
        .is_some());
}

#[test]
fn the_same_units_again_are_the_same_vgpu_and_release_nothing() {
    let mut n = node();
    let first = n.allocate(&units(0, 4..8), GIB, handle(1), at(0)).unwrap();
    let again = n
        .allocate(&units(0, [7, 6, 5, 4]), GIB, handle(2), at(1))
        .unwrap();
    assert_eq!(again.vgpu, first.vgpu);
    assert!(again.released.is_empty());
    assert_eq!(n.record(again.vgpu).unwrap().handle, handle(1));
    assert_eq!(n.records().count(), 1);
}

#[test]
fn units_given_again_end_the_allocations_that_held_them() {
    let mut n = node();
    let a = n.allocate(&units(0, 0..4), GIB, handle(1), at(0)).unwrap();
    let b = n.allocate(&units(0, 4..6), GIB, handle(2), at(0)).unwrap();
    let c = n.allocate(&units(1, 0..4), GIB, handle(3), at(0)).unwrap();
    n.attach(&handle(1), ctr("gone", 10), at(1)).unwrap();
    // The kubelet gives units 3 and 4 to a new container: a's and b's pods are gone.
    let d = n.allocate(&units(0, 3..5), GIB, handle(4), at(2)).unwrap();
    let mut released: Vec<VgpuId> = d.released.iter().map(|r| r.record.id).collect();
    released.sort();
    assert_eq!(released, vec![a.vgpu, b.vgpu]);
    assert!(n.vgpu_of("gone").is_none(), "its container let go with it");
    assert!(
        n.record(c.vgpu).is_some(),
        "another GPU's units are not touched"
    );
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 38 * GIB);
    assert_eq!(
        n.record(d.vgpu).unwrap().claim.as_deref(),
        Some("units-gpu-0-3")
    );
}

#[test]
fn units_that_cannot_make_one_vgpu_are_refused_and_change_nothing() {
    let mut n = node();
    let kept = n.allocate(&units(0, 0..2), GIB, handle(1), at(0)).unwrap();
    let mut spread = units(0, [1]);
    spread.extend(units(1, [0]));
    let err = n.allocate(&spread, GIB, handle(2), at(1)).unwrap_err();
    assert!(err.to_string().contains("on GPUs 0, 1"), "{err}");
    assert_eq!(
        n.allocate(&[], GIB, handle(2), at(1)).unwrap_err(),
        NodeError::Units(units::UnitsError::None)
    );
    let twice = units(0, [5, 5]);
    assert!(matches!(
        n.allocate(&twice, GIB, handle(2), at(1)),
        Err(NodeError::Units(units::UnitsError::Twice(_)))
    ));
    assert!(n.record(kept.vgpu).is_some());
    assert_eq!(n.records().count(), 1);
}

#[test]
fn units_the_gpu_does_not_offer_are_refused_and_change_nothing() {
    let mut n = node();
    let kept = n.allocate(&units(0, 0..2), GIB, handle(1), at(0)).unwrap();
    // Two 40 GiB GPUs in units of 1 GiB: gpu-<0|1>-0 to -39.
    for beyond in [units(0, [99999]), units(0, [38, 40]), units(2, [0])] {
        let err = n.allocate(&beyond, GIB, handle(2), at(1)).unwrap_err();
        assert!(
            matches!(err, NodeError::Units(units::UnitsError::Unlisted { .. })),
            "{err}"
        );
    }
    assert!(n.allocate(&units(1, [39]), GIB, handle(3), at(2)).is_ok());
    // Units of 4 GiB: ten per GPU.
    let err = n
        .allocate(&units(1, [10]), 4 * GIB, handle(4), at(3))
        .unwrap_err();
    assert!(err.to_string().contains("GPU 1 offers 10 units"), "{err}");
    assert!(n.record(kept.vgpu).is_some());
    assert_eq!(n.records().count(), 2);
}

#[test]
fn units_beyond_what_is_free_outside_the_kubelets_count_are_refused() {
    let mut n = node();
    // 36 GiB of GPU 1 reserved by a container outside Kubernetes.
    let outside = [("gpuplex.io/gpu-memory", "36Gi")];
    let v = n.reserve(outside, handle(9), at(0)).unwrap().id;
    assert_eq!(n.record(v).unwrap().assignment.gpus, vec![GpuIndex(0)]);
    let err = n
        .allocate(&units(0, 0..8), GIB, handle(1), at(1))
        .unwrap_err();
    assert!(matches!(err, NodeError::Assign(_)), "{err}");
    assert_eq!(n.records().count(), 1);
}

#[test]
fn an_allocation_that_would_not_fit_releases_nothing_and_one_that_fits_once_freed_does() {
    let mut n = node();
    // GPU 0 (40 GiB): an allocation of 2 GiB, 36 GiB outside the kubelet's count, 2 GiB free.
    let old = n
        .allocate(&units(0, 0..2), GIB, handle(1), at(0))
        .unwrap()
        .vgpu;
    let outside = [("gpuplex.io/gpu-memory", "36Gi")];
    let v = n.reserve(outside, handle(8), at(0)).unwrap().id;
    assert_eq!(n.record(v).unwrap().assignment.gpus, vec![GpuIndex(1)]);
    let v = n.reserve(outside, handle(9), at(0)).unwrap().id;
    assert_eq!(n.record(v).unwrap().assignment.gpus, vec![GpuIndex(0)]);
    // The kubelet gives unit gpu-0-0 again with five more: 6 GiB, 4 GiB once the old one goes.
    let err = n
        .allocate(&units(0, 0..6), GIB, handle(2), at(1))
        .unwrap_err();
    assert!(matches!(err, NodeError::Assign(_)), "{err}");
    assert!(err.to_string().contains("4 GiB unreserved"), "{err}");
    assert!(n.record(old).is_some(), "nothing released by a refusal");
    assert_eq!(n.records().count(), 3);
    // Four units, the old one's two among them: 4 GiB, which fits once it is released.
    let done = n.allocate(&units(0, 0..4), GIB, handle(3), at(2)).unwrap();
    assert_eq!(done.released.len(), 1);
    assert_eq!(done.released[0].record.id, old);
    assert!(n.record(old).is_none());
}

#[test]
fn a_claim_cannot_take_an_allocations_key() {
    let mut n = node();
    let placement = crate::node::Placement {
        gpus: vec![GpuIndex(0)],
        memory: GIB,
    };
    let err = n
        .pin("units-gpu-0-0", [], &placement, handle(1), at(0))
        .unwrap_err();
    assert!(matches!(err, NodeError::BadClaimUid(_)), "{err}");
}

#[test]
fn the_first_container_brings_the_pods_weight_and_priority() {
    let mut n = node();
    n.set_policy(PolicyConfig {
        high_priority_namespaces: vec!["serving".into()],
        ..PolicyConfig::default()
    });
    let v = n
        .allocate(&units(0, 0..4), GIB, handle(1), at(0))
        .unwrap()
        .vgpu;
    // high is the operator's to allow: not in namespace ml; nothing changes.
    let high = asking(&[
        ("gpuplex.io/priority", "high"),
        ("io.kubernetes.cri.sandbox-namespace", "ml"),
    ]);
    let err = n
        .attach_asking(&handle(1), ctr("app", 1), &high, at(1))
        .unwrap_err();
    assert!(matches!(err, NodeError::Policy(_)), "{err}");
    assert!(n.vgpu_of("app").is_none());
    // What the units decide is not the container's to ask.
    let memory = asking(&[("gpuplex.io/gpu-memory", "30Gi")]);
    assert_eq!(
        n.attach_asking(&handle(1), ctr("app", 1), &memory, at(1))
            .unwrap_err(),
        NodeError::AskedOfAllocation("gpuplex.io/gpu-memory".into())
    );
    let weight = asking(&[
        ("gpuplex.io/weight", "4"),
        ("io.kubernetes.cri.sandbox-namespace", "ml"),
        ("io.kubernetes.cri.sandbox-name", "trainer"),
    ]);
    let r = n
        .attach_asking(&handle(1), ctr("app", 1), &weight, at(1))
        .unwrap();
    assert_eq!((r.id, r.request.weight), (v, 4));
    assert_eq!(r.annotations["io.kubernetes.cri.sandbox-name"], "trainer");
    assert_eq!(r.assignment.memory, GpuMemory::Bytes(4 * GIB), "unchanged");
    // The pod's next container (after the first's exit) asks again, and is heard.
    n.detach(v, "app", at(2)).unwrap();
    let r = n
        .attach_asking(&handle(1), ctr("app-2", 2), &asking(&[]), at(3))
        .unwrap();
    assert_eq!(r.request.weight, 1, "asking nothing is the default");
}

#[test]
fn only_an_allocations_container_may_ask() {
    let mut n = node();
    let v = n
        .reserve([("gpuplex.io/gpu-memory", "4Gi")], handle(1), at(0))
        .unwrap()
        .id;
    let weight = asking(&[("gpuplex.io/weight", "9")]);
    assert_eq!(
        n.attach_asking(&handle(1), ctr("c", 1), &weight, at(1))
            .unwrap_err(),
        NodeError::NotAnAllocation(v)
    );
    // Pod keys alone ask nothing.
    let pod = asking(&[("io.kubernetes.cri.sandbox-namespace", "ml")]);
    assert!(n
        .attach_asking(&handle(1), ctr("c", 1), &pod, at(1))
        .is_ok());
}

proptest! {
    /// Whatever units the kubelet hands out, one allocation at a time: the allocations pinned
    /// never share a unit, each holds its units' memory on its units' GPU, and a GPU's pinned
    /// memory never exceeds the units it offers.
    #[test]
    fn allocations_never_share_a_unit(
        asks in proptest::collection::vec(
            (0u32..2, proptest::collection::btree_set(0u32..40, 1..12)),
            1..40,
        )
    ) {
        let mut n = node();
        for (i, (gpu, ns)) in asks.into_iter().enumerate() {
            let asked = units(gpu, ns);
            let fresh = Handle::from_bytes([(i as u8).wrapping_add(1); 16]);
            let done = n.allocate(&asked, GIB, fresh, at(i as u64)).unwrap();
            let mut sorted = asked.clone();
            sorted.sort();
            prop_assert_eq!(&n.record(done.vgpu).unwrap().units, &sorted);
            let mut seen = std::collections::BTreeSet::new();
            for r in n.records() {
                prop_assert_eq!(r.assignment.memory, GpuMemory::Bytes(r.units.len() as u64 * GIB));
                prop_assert!(r.units.iter().all(|u| r.assignment.gpus == vec![u.gpu]));
                for u in &r.units {
                    prop_assert!(seen.insert(*u), "unit {} held twice", u);
                }
            }
        }
    }
}
