//! Claims pinned where the cluster's scheduler placed them.

use super::*;
use crate::node::{Attachment, ReleaseKey, Target, MAX_SHARING};

const GIB: u64 = 1 << 30;

fn at(secs: u64) -> Instant {
    Instant::from_nanos(secs * 1_000_000_000)
}

/// Two 40 GiB GPUs, reservations lapsing after 60 s.
fn node() -> Node {
    crate::node::tests::node(2, crate::inventory::AssignmentPolicy::Spread)
}

fn handle(n: u8) -> Handle {
    Handle::from_bytes([n; 16])
}

fn on(gpus: &[u32], gib: u64) -> Placement {
    Placement {
        gpus: gpus.iter().copied().map(GpuIndex).collect(),
        memory: gib * GIB,
    }
}

const WEIGHT: [(&str, &str); 1] = [("gpuplex.io/weight", "3")];

#[test]
fn a_claim_gets_exactly_its_placement_and_never_lapses() {
    let mut n = node();
    // The node would have spread it to GPU 0; the cluster's scheduler chose GPU 1.
    let r = n
        .pin("uid-1", WEIGHT, &on(&[1], 8), handle(1), at(0))
        .unwrap();
    assert_eq!(r.assignment.gpus, vec![GpuIndex(1)]);
    assert_eq!(r.assignment.memory, GpuMemory::Bytes(8 * GIB));
    assert_eq!(r.request.weight, 3);
    assert_eq!(r.claim.as_deref(), Some("uid-1"));
    assert_eq!(
        r.annotations["gpuplex.io/gpu-memory"],
        (8 * GIB).to_string()
    );
    let v = r.id;
    assert_eq!(n.inventory().unreserved(GpuIndex(1)), 32 * GIB);
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 40 * GIB);
    let d = n.decide(at(24 * 3600));
    assert!(d.lapsed.is_empty(), "{:?}", d.lapsed);
    assert_eq!(d.next_due, None, "no lapse to wake up for");
    let status = n.status(at(24 * 3600));
    assert_eq!(status.reservations[0].claim.as_deref(), Some("uid-1"));
    assert_eq!(status.reservations[0].expires_in_seconds, 0.0);
    let released = n
        .release(&ReleaseKey::Claim("uid-1".into()), at(1))
        .unwrap();
    assert_eq!(released.record.id, v);
    assert_eq!(n.inventory().unreserved(GpuIndex(1)), 40 * GIB);
    assert!(n
        .release(&ReleaseKey::Claim("uid-1".into()), at(2))
        .is_none());
}

#[test]
fn pinning_again_is_idempotent_and_another_placement_is_refused() {
    let mut n = node();
    let first = n
        .pin("uid-1", [], &on(&[0, 1], 4), handle(1), at(0))
        .unwrap()
        .clone();
    // The kubelet prepares again (after its restart): the same vGPU and handle, nothing more.
    let again = n
        .pin("uid-1", [], &on(&[1, 0], 4), handle(2), at(5))
        .unwrap();
    assert_eq!((again.id, again.handle), (first.id, handle(1)));
    assert_eq!(n.records().count(), 1);
    assert!(
        n.vgpu_with(&handle(2)).is_none(),
        "the unused handle is not kept"
    );
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 36 * GIB);
    let moved = n
        .pin("uid-1", [], &on(&[0], 4), handle(3), at(6))
        .unwrap_err();
    assert_eq!(
        moved,
        NodeError::ClaimPinned {
            claim: "uid-1".into(),
            vgpu: first.id
        }
    );
    let more = n.pin("uid-1", [], &on(&[0, 1], 5), handle(3), at(6));
    assert!(matches!(more, Err(NodeError::ClaimPinned { .. })));
}

#[test]
fn a_placement_that_no_longer_fits_is_refused_in_one_line_and_changes_nothing() {
    let mut n = node();
    // Memory taken meanwhile by a container outside Kubernetes.
    n.reserve([("gpuplex.io/gpu-memory", "36Gi")], handle(9), at(0))
        .unwrap();
    let reserved: Vec<u64> = (0..2)
        .map(|g| n.inventory().unreserved(GpuIndex(g)))
        .collect();
    let e = n
        .pin("uid-1", [], &on(&[0], 8), handle(1), at(1))
        .unwrap_err();
    let line = e.to_string();
    assert!(
        line.contains("GPU 0")
            && line.contains("4 GiB unreserved")
            && line.contains("8 GiB is needed"),
        "{line}"
    );
    assert!(!line.contains('\n'));
    let gone = n
        .pin("uid-2", [], &on(&[7], 8), handle(2), at(1))
        .unwrap_err();
    assert!(
        gone.to_string().contains("this node has no GPU 7"),
        "{gone}"
    );
    let after: Vec<u64> = (0..2)
        .map(|g| n.inventory().unreserved(GpuIndex(g)))
        .collect();
    assert_eq!(after, reserved);
    assert_eq!(n.records().count(), 1);
    assert!(n.vgpu_with(&handle(1)).is_none() && n.vgpu_with(&handle(2)).is_none());
    // The ids the refusals named (2 and 3) are spent: no other vGPU gets them.
    assert!(gone.to_string().contains("vgpu-3"), "{gone}");
    let v = n
        .pin("uid-1", [], &on(&[1], 8), handle(1), at(2))
        .unwrap()
        .id;
    assert_eq!(v, VgpuId(4));
}

#[test]
fn what_the_placement_decides_cannot_come_from_the_claims_config() {
    let mut n = node();
    for key in [
        "gpuplex.io/gpu-memory",
        "gpuplex.io/gpus",
        "gpuplex.io/gpu-model",
    ] {
        let e = n
            .pin("uid-1", [(key, "1")], &on(&[0], 8), handle(1), at(0))
            .unwrap_err();
        assert_eq!(e, NodeError::PlacedByScheduler(key), "{key}");
    }
    let cases = [
        (on(&[], 8), "the placement names no GPU"),
        (on(&[1, 1], 8), "the placement names GPU 1 twice"),
        (on(&[0], 0), "the placement gives no memory"),
    ];
    for (placement, line) in cases {
        let e = n
            .pin("uid-1", [], &placement, handle(1), at(0))
            .unwrap_err();
        assert_eq!(e.to_string(), line);
    }
    for uid in ["", "a b", "x\n", &"u".repeat(129)] {
        let e = n.pin(uid, [], &on(&[0], 8), handle(1), at(0)).unwrap_err();
        assert_eq!(e, NodeError::BadClaimUid(uid.to_string()));
    }
    let bad_weight = n.pin(
        "uid-1",
        [("gpuplex.io/weight", "0")],
        &on(&[0], 8),
        handle(1),
        at(0),
    );
    assert!(
        matches!(bad_weight, Err(NodeError::Request(_))),
        "{bad_weight:?}"
    );
    assert_eq!(n.records().count(), 0);
    assert_eq!(n.inventory().unreserved(GpuIndex(0)), 40 * GIB);
}

#[test]
fn its_containers_come_and_go_and_the_claim_stays() {
    let mut n = node();
    let v = n
        .pin("uid-1", [], &on(&[0], 8), handle(1), at(0))
        .unwrap()
        .id;
    let first = Attachment {
        container: "ctr-a".into(),
        target: Target::Pid(10),
    };
    n.attach(&handle(1), first.clone(), at(1)).unwrap();
    assert!(n.windows().vgpu(v).is_some());
    let detached = n.detach(v, "ctr-a", at(2)).unwrap();
    assert_eq!(detached.record.attachment(), Some(&first));
    assert!(n.windows().vgpu(v).is_none());
    assert_eq!(n.vgpu_of("ctr-a"), None);
    assert!(
        n.detach(v, "ctr-a", at(2)).is_none(),
        "nothing attached any more"
    );
    assert!(n.decide(at(3600)).lapsed.is_empty());
    // The pod's container restarts: it attaches with the same handle.
    let second = Attachment {
        container: "ctr-b".into(),
        target: Target::Pid(11),
    };
    assert_eq!(n.attach(&handle(1), second, at(3601)).unwrap().id, v);
    assert_eq!(n.vgpu_of("ctr-b"), Some(v));
    // An unpinned vGPU is not detached: its container's exit releases it.
    let other = n
        .register(
            [("gpuplex.io/gpu-memory", "1Gi")],
            handle(5),
            Attachment {
                container: "plain".into(),
                target: Target::Pid(12),
            },
            at(3602),
        )
        .unwrap()
        .id;
    assert!(n.detach(other, "plain", at(3603)).is_none());
    assert!(n.record(other).unwrap().attachment().is_some());
}

#[test]
fn a_claim_is_restored_pinned_after_a_restart() {
    let mut n = node();
    let record = n
        .pin("uid-1", WEIGHT, &on(&[1], 8), handle(1), at(0))
        .unwrap()
        .clone();
    let mut restarted = node();
    restarted.restore(record.clone(), at(0)).unwrap();
    assert!(restarted.decide(at(3600)).lapsed.is_empty());
    assert_eq!(restarted.vgpu_with(&handle(1)), Some(record.id));
    let again = restarted
        .pin("uid-1", [], &on(&[1], 8), handle(2), at(3601))
        .unwrap();
    assert_eq!(again.id, record.id);
    // The same claim cannot be restored twice, even under another id.
    let mut twin = record.clone();
    twin.id = VgpuId(9);
    twin.assignment.vgpu = VgpuId(9);
    twin.handle = handle(7);
    assert!(matches!(
        restarted.restore(twin, at(3602)),
        Err(NodeError::ClaimPinned { .. })
    ));
    assert!(restarted
        .release(&ReleaseKey::Claim("uid-1".into()), at(3603))
        .is_some());
}

fn ctr(name: &str, pid: u32) -> Attachment {
    Attachment {
        container: name.into(),
        target: Target::Pid(pid),
    }
}

#[test]
fn the_containers_of_a_pod_share_its_claims_vgpu_and_its_windows() {
    let mut n = node();
    let v = n
        .pin("uid-1", [], &on(&[0], 8), handle(1), at(0))
        .unwrap()
        .id;
    n.attach(&handle(1), ctr("app", 10), at(1)).unwrap();
    let shared = n.attach(&handle(1), ctr("sidecar", 11), at(1)).unwrap();
    assert_eq!(shared.containers().collect::<Vec<_>>(), ["app", "sidecar"]);
    assert_eq!(n.vgpu_of("sidecar"), Some(v));
    assert_eq!(n.windows().vgpus().count(), 1, "one vGPU in the windows");
    // Attaching again is idempotent; a container of another vGPU cannot join.
    n.attach(&handle(1), ctr("sidecar", 11), at(1)).unwrap();
    let plain = [("gpuplex.io/gpu-memory", "1Gi")];
    n.register(plain, handle(5), ctr("other", 12), at(1))
        .unwrap();
    assert!(matches!(
        n.attach(&handle(1), ctr("other", 12), at(1)),
        Err(NodeError::ContainerAttached { .. })
    ));
    // Only the claim (or the operator, by id) releases it: not a container, not the handle.
    assert!(n
        .release(&ReleaseKey::Container("app".into()), at(2))
        .is_none());
    assert!(n.release(&ReleaseKey::Handle(handle(1)), at(2)).is_none());
    assert_eq!(n.record(v).unwrap().attachments.len(), 2);
    // Pausing one of them cannot take the vGPU out of the windows the other takes.
    let e = n
        .hold(&ReleaseKey::Container("app".into()), true, at(2))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{v} is shared by 2 containers of claim uid-1: gpuplex holds a vGPU out of its windows only when one container has it")
    );
    // One goes: the other keeps the vGPU in its windows; the last one going takes it out.
    let first = n.detach(v, "app", at(3)).unwrap();
    assert_eq!((first.thaw, first.stats), (None, None));
    assert!(n.windows().vgpu(v).is_some());
    assert_eq!(n.vgpu_of("app"), None);
    n.hold(&ReleaseKey::Container("sidecar".into()), true, at(3))
        .unwrap();
    let last = n.detach(v, "sidecar", at(4)).unwrap();
    assert!(last.stats.is_some());
    assert!(n.windows().vgpu(v).is_none());
    assert!(n.record(v).is_some(), "the claim keeps its reservation");
}

#[test]
fn a_plain_vgpu_has_one_container_and_a_claims_at_most_max_sharing() {
    let mut n = node();
    let plain = [("gpuplex.io/gpu-memory", "1Gi")];
    let v = n.reserve(plain, handle(2), at(0)).unwrap().id;
    n.attach(&handle(2), ctr("one", 1), at(0)).unwrap();
    assert_eq!(
        n.attach(&handle(2), ctr("two", 2), at(0)).unwrap_err(),
        NodeError::AttachedElsewhere {
            vgpu: v,
            attached: "one".into(),
            container: "two".into()
        }
    );
    let c = n
        .pin("uid-1", [], &on(&[1], 8), handle(1), at(0))
        .unwrap()
        .id;
    for i in 0..MAX_SHARING {
        n.attach(&handle(1), ctr(&format!("c{i}"), 100), at(0))
            .unwrap();
    }
    let e = n
        .attach(&handle(1), ctr("one-too-many", 100), at(0))
        .unwrap_err();
    assert_eq!(
        e,
        NodeError::SharedTooWidely {
            vgpu: c,
            claim: "uid-1".into()
        }
    );
    assert_eq!(n.vgpu_of("one-too-many"), None);
}

#[test]
fn a_shared_vgpu_is_restored_with_all_its_containers() {
    let mut n = node();
    n.pin("uid-1", [], &on(&[0], 8), handle(1), at(0)).unwrap();
    n.attach(&handle(1), ctr("app", 10), at(0)).unwrap();
    let v = n.attach(&handle(1), ctr("sidecar", 11), at(0)).unwrap();
    let record = v.clone();
    let mut restarted = node();
    restarted.restore(record.clone(), at(0)).unwrap();
    assert_eq!(restarted.vgpu_of("app"), Some(record.id));
    assert_eq!(restarted.vgpu_of("sidecar"), Some(record.id));
    assert_eq!(restarted.status(at(1)).containers.len(), 2);
    // A record naming one container twice, or a plain vGPU with two, is refused whole.
    for bad in [
        vec![ctr("app", 10), ctr("app", 11)],
        vec![ctr("a", 10), ctr("b", 11)],
    ] {
        let mut odd = record.clone();
        odd.attachments = bad.clone();
        if bad[0].container == "a" {
            odd.claim = None;
        }
        let mut fresh = node();
        assert!(fresh.restore(odd, at(0)).is_err());
        assert_eq!(fresh.records().count(), 0);
        assert_eq!(fresh.inventory().unreserved(GpuIndex(0)), 40 * GIB);
    }
}
