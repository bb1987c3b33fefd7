//! Tests of GPU assignment: every ranking rule by a table, the error messages, and properties
//! over random sequences of assign, release and restore.

use super::*;
use proptest::prelude::*;

const GIB: u64 = 1 << 30;
const A100: &str = "NVIDIA A100-PCIE-40GB";
const H100: &str = "NVIDIA H100 80GB HBM3";
const L4: &str = "NVIDIA L4";
use AssignmentPolicy::{Pack, Spread};

fn gpu(index: u32, model: &str, memory: u64) -> Gpu {
    Gpu {
        index: GpuIndex(index),
        uuid: format!("GPU-{index:08}"),
        model: model.to_string(),
        memory,
    }
}

/// A node whose GPU i has index i; memory in GiB.
fn node(gpus: &[(&str, u64)], overcommit: f64) -> Inventory {
    let gpus = gpus.iter().enumerate();
    let gpus = gpus
        .map(|(i, (m, gib))| gpu(i as u32, m, gib * GIB))
        .collect();
    Inventory::new(gpus, overcommit).unwrap()
}

fn request(gpus: u32, gib: Option<u64>, models: &[&str]) -> VgpuRequest {
    VgpuRequest {
        gpus,
        memory: gib.map_or(GpuMemory::WholeGpu, |g| GpuMemory::Bytes(g * GIB)),
        models: models.iter().map(|m| m.to_string()).collect(),
        ..VgpuRequest::default()
    }
}

fn indices(gpus: &[u32]) -> Vec<GpuIndex> {
    gpus.iter().copied().map(GpuIndex).collect()
}

fn restore(inv: &mut Inventory, id: u64, gpus: &[u32], gib: u64) {
    let assignment = Assignment {
        vgpu: VgpuId(id),
        gpus: indices(gpus),
        memory: GpuMemory::Bytes(gib * GIB),
    };
    inv.restore(assignment).unwrap();
}

/// One assignment: the node, what is bound already (GPUs, GiB each), which GPUs have work, the
/// policy, the request (gpus, GiB or whole GPU, models) and the GPUs expected (`None`: no fit).
struct Case {
    name: &'static str,
    gpus: &'static [(&'static str, u64)],
    overcommit: f64,
    bound: &'static [(&'static [u32], u64)],
    busy: &'static [u32],
    policy: AssignmentPolicy,
    request: (u32, Option<u64>, &'static [&'static str]),
    expect: Option<&'static [u32]>,
}

const TWO_A100: &[(&str, u64)] = &[(A100, 40), (A100, 40)];
const FOUR_A100: &[(&str, u64)] = &[(A100, 40), (A100, 40), (A100, 40), (A100, 40)];
const MIXED: &[(&str, u64)] = &[(A100, 40), (H100, 80), (L4, 24)];

#[rustfmt::skip]
const CASES: &[Case] = &[
    Case { name: "idle before busy", gpus: TWO_A100, overcommit: 1.0, bound: &[], busy: &[0], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "idle before fewest bound", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[1], 1), (&[1], 1)], busy: &[0], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "idle before most bound (pack)", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[0], 1)], busy: &[0], policy: Pack, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "busy GPU when no idle one fits", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[1], 39)], busy: &[0], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[0]) },
    Case { name: "spread: fewest bound", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[0], 1)], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "pack: most bound", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[1], 1)], busy: &[], policy: Pack, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "bound count before tightest fit (spread)", gpus: &[(A100, 40), (L4, 24)], overcommit: 1.0, bound: &[(&[1], 1)], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[0]) },
    Case { name: "bound count before tightest fit (pack)", gpus: &[(L4, 24), (A100, 40)], overcommit: 1.0, bound: &[(&[1], 1)], busy: &[], policy: Pack, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "tightest fit: smaller GPU", gpus: &[(A100, 40), (L4, 24)], overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "tightest fit: fuller GPU", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[0], 4), (&[1], 30), (&[2], 20), (&[3], 31)], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[3]) },
    Case { name: "tightest fit under pack", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[0], 4), (&[1], 30), (&[2], 20), (&[3], 33)], busy: &[], policy: Pack, request: (1, Some(8), &[]), expect: Some(&[1]) },
    Case { name: "lowest index breaks ties", gpus: FOUR_A100, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[0]) },
    Case { name: "lowest idle index", gpus: FOUR_A100, overcommit: 1.0, bound: &[], busy: &[0, 1], policy: Pack, request: (1, Some(8), &[]), expect: Some(&[2]) },
    Case { name: "model: one name", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &["H100"]), expect: Some(&[1]) },
    Case { name: "model: alternatives", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &["H100", "A100"]), expect: Some(&[0]) },
    Case { name: "model: alternatives, busy first choice", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[0], policy: Spread, request: (1, Some(8), &["H100", "A100"]), expect: Some(&[1]) },
    Case { name: "model: none matches", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &["H200"]), expect: None },
    Case { name: "model: any, tightest", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[2]) },
    Case { name: "whole GPU: only an empty one (1.0)", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[0], 1)], busy: &[], policy: Pack, request: (1, None, &[]), expect: Some(&[1]) },
    Case { name: "whole GPU: none empty (1.0)", gpus: TWO_A100, overcommit: 1.0, bound: &[(&[0], 1), (&[1], 1)], busy: &[], policy: Spread, request: (1, None, &[]), expect: None },
    Case { name: "whole GPU: every empty GPU fits exactly", gpus: MIXED, overcommit: 1.0, bound: &[], busy: &[0], policy: Spread, request: (1, None, &[]), expect: Some(&[1]) },
    Case { name: "whole GPU beside 10 GiB (1.5)", gpus: TWO_A100, overcommit: 1.5, bound: &[(&[0], 10), (&[1], 21)], busy: &[], policy: Spread, request: (1, None, &[]), expect: Some(&[0]) },
    Case { name: "whole GPU beside 21 GiB (1.5)", gpus: &[(A100, 40)], overcommit: 1.5, bound: &[(&[0], 21)], busy: &[], policy: Spread, request: (1, None, &[]), expect: None },
    Case { name: "exactly the rest (1.0)", gpus: &[(A100, 40)], overcommit: 1.0, bound: &[(&[0], 32)], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: Some(&[0]) },
    Case { name: "a byte over (1.0)", gpus: &[(A100, 40)], overcommit: 1.0, bound: &[(&[0], 33)], busy: &[], policy: Spread, request: (1, Some(8), &[]), expect: None },
    Case { name: "beyond capacity (1.5)", gpus: &[(A100, 40)], overcommit: 1.5, bound: &[(&[0], 40)], busy: &[], policy: Spread, request: (1, Some(20), &[]), expect: Some(&[0]) },
    Case { name: "beyond capacity × 1.5", gpus: &[(A100, 40)], overcommit: 1.5, bound: &[(&[0], 40)], busy: &[], policy: Spread, request: (1, Some(21), &[]), expect: None },
    Case { name: "multi: best two, ascending", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[0], 1)], busy: &[2], policy: Spread, request: (2, Some(8), &[]), expect: Some(&[1, 3]) },
    Case { name: "multi: pack", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[0], 1), (&[3], 1), (&[3], 1)], busy: &[], policy: Pack, request: (2, Some(8), &[]), expect: Some(&[0, 3]) },
    Case { name: "multi: takes busy when needed", gpus: TWO_A100, overcommit: 1.0, bound: &[], busy: &[1], policy: Spread, request: (2, Some(8), &[]), expect: Some(&[0, 1]) },
    Case { name: "multi: all or nothing", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[0], 36), (&[1], 36), (&[2], 36)], busy: &[], policy: Spread, request: (2, Some(8), &[]), expect: None },
    Case { name: "multi: more than the node has", gpus: TWO_A100, overcommit: 1.0, bound: &[], busy: &[], policy: Spread, request: (3, Some(1), &[]), expect: None },
    Case { name: "multi: whole GPUs", gpus: FOUR_A100, overcommit: 1.0, bound: &[(&[1], 1)], busy: &[], policy: Spread, request: (3, None, &[]), expect: Some(&[0, 2, 3]) },
];

fn check(case: &Case) {
    let mut inv = node(case.gpus, case.overcommit);
    for (i, (gpus, gib)) in case.bound.iter().enumerate() {
        restore(&mut inv, 100 + i as u64, gpus, *gib);
    }
    let before = inv.clone();
    let (count, gib, models) = case.request;
    let req = request(count, gib, models);
    let busy = |g: GpuIndex| case.busy.contains(&g.0);
    let result = inv.assign(VgpuId(1), &req, case.policy, busy);
    match (case.expect, result) {
        (Some(want), Ok(got)) => {
            assert_eq!(got.gpus, indices(want), "{}", case.name);
            assert_eq!(inv.assignment(VgpuId(1)), Some(&got), "{}", case.name);
            for g in &got.gpus {
                assert_eq!(inv.bound(*g), before.bound(*g) + 1, "{}", case.name);
                let took = before.unreserved(*g) - inv.unreserved(*g);
                assert_eq!(Some(took), inv.entitlement(VgpuId(1), *g), "{}", case.name);
            }
        }
        (None, Err(AssignError::NoFit(e))) => {
            assert_eq!(
                inv, before,
                "{}: a failed assign changes nothing",
                case.name
            );
            assert_eq!(e.gpus.len(), case.gpus.len(), "{}", case.name);
        }
        (want, got) => panic!("{}: expected {want:?}, got {got:?}", case.name),
    }
}

#[test]
fn assignment_follows_every_ranking_rule() {
    for case in CASES {
        check(case);
    }
}

#[test]
fn ranking_is_exhaustively_the_documented_order() {
    let mut loads = Vec::new();
    for index in 0..2 {
        for busy in [false, true] {
            for bound in 0..3 {
                for left in 0..3 {
                    let index = GpuIndex(index);
                    loads.push(Load {
                        index,
                        busy,
                        bound,
                        left,
                    });
                }
            }
        }
    }
    for policy in [Spread, Pack] {
        for a in &loads {
            for b in &loads {
                let expected = if a.busy != b.busy {
                    // idle first
                    if a.busy {
                        Ordering::Greater
                    } else {
                        Ordering::Less
                    }
                } else if a.bound != b.bound {
                    let fewer_first = (a.bound < b.bound) == (policy == Spread);
                    if fewer_first {
                        Ordering::Less
                    } else {
                        Ordering::Greater
                    }
                } else if a.left != b.left {
                    if a.left < b.left {
                        Ordering::Less
                    } else {
                        Ordering::Greater
                    }
                } else {
                    a.index.cmp(&b.index)
                };
                assert_eq!(rank(policy, a, b), expected, "{policy:?} {a:?} {b:?}");
                assert_eq!(
                    rank(policy, b, a),
                    expected.reverse(),
                    "{policy:?} {a:?} {b:?}"
                );
            }
        }
    }
}

#[test]
fn whole_gpu_on_gpus_of_different_memory() {
    let mut inv = node(&[(A100, 40), (H100, 80)], 1.0);
    let got = inv
        .assign(VgpuId(1), &request(2, None, &[]), Spread, |_| false)
        .unwrap();
    assert_eq!(got.gpus, indices(&[0, 1]));
    assert_eq!(got.memory, GpuMemory::WholeGpu);
    assert_eq!(inv.entitlement(VgpuId(1), GpuIndex(0)), Some(40 * GIB));
    assert_eq!(inv.entitlement(VgpuId(1), GpuIndex(1)), Some(80 * GIB));
    assert_eq!(
        (inv.unreserved(GpuIndex(0)), inv.unreserved(GpuIndex(1))),
        (0, 0)
    );
    assert_eq!(inv.release(VgpuId(1)), Some(got.clone()));
    assert_eq!(inv, node(&[(A100, 40), (H100, 80)], 1.0));
    // Restored after a restart, it takes both whole GPUs again, not the smaller one's size.
    inv.restore(got).unwrap();
    assert_eq!(
        (inv.unreserved(GpuIndex(0)), inv.unreserved(GpuIndex(1))),
        (0, 0)
    );
}

#[test]
fn release_frees_the_memory_and_forgets_the_vgpu() {
    let mut inv = node(TWO_A100, 1.0);
    let empty = inv.clone();
    let a = inv
        .assign(VgpuId(1), &request(2, Some(8), &[]), Spread, |_| false)
        .unwrap();
    assert_eq!(inv.unreserved(GpuIndex(1)), 32 * GIB);
    assert_eq!(inv.assignments().collect::<Vec<_>>(), vec![&a]);
    assert_eq!(inv.release(VgpuId(1)), Some(a));
    assert_eq!(inv.release(VgpuId(1)), None);
    assert_eq!(inv, empty);
    assert_eq!(inv.assignment(VgpuId(1)), None);
}

#[test]
fn restore_binds_known_assignments_and_refuses_the_rest() {
    let mut inv = node(TWO_A100, 1.0);
    restore(&mut inv, 1, &[1, 0], 30);
    assert_eq!(inv.assignment(VgpuId(1)).unwrap().gpus, indices(&[0, 1]));
    assert_eq!(inv.unreserved(GpuIndex(0)), 10 * GIB);
    let before = inv.clone();
    let attempts: &[(u64, &[u32], u64, &str)] = &[
        (1, &[0], 1, "vgpu-1 already holds GPU 0, 1"),
        (2, &[], 1, "lists no GPU"),
        (2, &[1, 1], 1, "lists GPU 1 twice"),
        (2, &[0, 7], 1, "this node has no GPU 7 (its GPUs: 0, 1)"),
        (2, &[0, 1], 11, "GPU 0 (NVIDIA A100-PCIE-40GB, 40 GiB) has 10 GiB unreserved and 11 GiB is needed there"),
    ];
    for (id, gpus, gib, message) in attempts {
        let assignment = Assignment {
            vgpu: VgpuId(*id),
            gpus: indices(gpus),
            memory: GpuMemory::Bytes(gib * GIB),
        };
        let e = inv.restore(assignment).unwrap_err().to_string();
        assert!(e.contains(message), "{e}");
        assert!(!e.contains('\n'), "{e}");
        assert_eq!(inv, before, "a refused restore changes nothing");
    }
    restore(&mut inv, 2, &[0, 1], 10);
    assert_eq!(inv.unreserved(GpuIndex(0)), 0);
    let mut over = node(&[(A100, 40)], 1.5);
    restore(&mut over, 1, &[0], 60);
    let one_more = Assignment {
        vgpu: VgpuId(2),
        gpus: indices(&[0]),
        memory: GpuMemory::Bytes(1),
    };
    assert!(matches!(
        over.restore(one_more),
        Err(AssignError::OverCapacity { .. })
    ));
}

#[test]
fn a_batch_gets_distinct_idle_gpus_under_both_policies() {
    for policy in [Spread, Pack] {
        let mut inv = node(FOUR_A100, 1.0);
        // One idle vGPU already on GPU 2: pack alone would pile everyone onto it.
        restore(&mut inv, 100, &[2], 1);
        let batch: Vec<_> = (1..=3)
            .map(|i| (VgpuId(i), request(1, Some(8), &[])))
            .collect();
        let results = inv.assign_batch(&batch, policy, |g| g == GpuIndex(3));
        let got: Vec<u32> = results
            .iter()
            .map(|r| r.as_ref().unwrap().gpus[0].0)
            .collect();
        let expected = match policy {
            Spread => [0, 1, 2],
            Pack => [2, 0, 1],
        };
        assert_eq!(got, expected, "{policy:?}");

        // Sequentially, without the batch, pack puts both on one GPU.
        let mut inv = node(FOUR_A100, 1.0);
        let one = inv.assign(VgpuId(1), &request(1, Some(8), &[]), policy, |_| false);
        let two = inv.assign(VgpuId(2), &request(1, Some(8), &[]), policy, |_| false);
        let same = one.unwrap().gpus == two.unwrap().gpus;
        assert_eq!(same, policy == Pack, "{policy:?}");
    }
}

#[test]
fn a_batch_shares_gpus_when_idle_ones_run_out() {
    let mut inv = node(TWO_A100, 1.0);
    let batch: Vec<_> = (1..=3)
        .map(|i| (VgpuId(i), request(1, Some(8), &[])))
        .collect();
    let results = inv.assign_batch(&batch, Spread, |_| false);
    let got: Vec<u32> = results
        .iter()
        .map(|r| r.as_ref().unwrap().gpus[0].0)
        .collect();
    assert_eq!(got, [0, 1, 0]);
    let again = inv.assign_batch(&batch[..1], Spread, |_| false);
    assert!(matches!(again[0], Err(AssignError::AlreadyAssigned { .. })));
}

#[test]
fn the_no_fit_message_lists_every_gpu_on_one_line() {
    let mut inv = node(&[(A100, 40), (L4, 24), (A100, 40)], 1.0);
    restore(&mut inv, 100, &[0], 36);
    restore(&mut inv, 101, &[2], 2);
    let e = inv.assign(VgpuId(1), &request(2, Some(8), &["A100"]), Spread, |_| {
        false
    });
    assert_eq!(
        e.unwrap_err().to_string(),
        "not enough GPUs can hold vgpu-1 (gpus=2 gpu-memory=8 GiB model=A100): \
         GPU 0 (NVIDIA A100-PCIE-40GB, 40 GiB): 4 GiB free, 8 GiB needed; \
         GPU 1 (NVIDIA L4, 24 GiB): model does not match; \
         GPU 2 (NVIDIA A100-PCIE-40GB, 40 GiB): 38 GiB free, fits; \
         1 of 3 GPUs fits and 2 are needed"
    );
    restore(&mut inv, 102, &[1], 1);
    let e = inv.assign(VgpuId(1), &request(1, None, &["H100", "L4"]), Pack, |_| {
        false
    });
    assert_eq!(
        e.unwrap_err().to_string(),
        "no GPU can hold vgpu-1 (gpus=1 gpu-memory=whole GPU model=H100|L4): \
         GPU 0 (NVIDIA A100-PCIE-40GB, 40 GiB): model does not match; \
         GPU 1 (NVIDIA L4, 24 GiB): 23 GiB free, 24 GiB needed; \
         GPU 2 (NVIDIA A100-PCIE-40GB, 40 GiB): model does not match"
    );
}

#[test]
fn the_other_messages_are_one_line_and_say_what_to_do() {
    let mut empty = Inventory::new(Vec::new(), 1.0).unwrap();
    let mut inv = node(TWO_A100, 1.0);
    inv.assign(VgpuId(1), &request(1, Some(1), &[]), Spread, |_| false)
        .unwrap();
    let cases: Vec<(Result<Assignment, AssignError>, &str)> = vec![
        (
            empty.assign(VgpuId(1), &request(1, None, &[]), Spread, |_| false),
            "no GPU can hold vgpu-1 (gpus=1 gpu-memory=whole GPU model=any): this node has no GPU",
        ),
        (
            inv.assign(VgpuId(1), &request(1, None, &[]), Spread, |_| false),
            "vgpu-1 already holds GPU 0: release it before assigning it again",
        ),
        (
            inv.assign(VgpuId(2), &request(0, None, &[]), Spread, |_| false),
            "vgpu-2 asks for 0 GPUs: gpuplex.io/gpus must be 1 or more",
        ),
    ];
    for (result, message) in cases {
        assert_eq!(result.unwrap_err().to_string(), message);
    }
    let gpus = |specs: &[(u32, &str, u64)]| {
        specs
            .iter()
            .map(|(i, u, m)| Gpu {
                uuid: u.to_string(),
                ..gpu(*i, A100, *m)
            })
            .collect::<Vec<_>>()
    };
    let bad: &[(Vec<Gpu>, f64, &str)] = &[
        (
            gpus(&[(0, "a", 1), (0, "b", 1)]),
            1.0,
            "two GPUs have index 0: every GPU needs its own index",
        ),
        (
            gpus(&[(3, "a", 1), (1, "a", 1)]),
            1.0,
            "GPUs 1 and 3 have the same UUID `a`: every GPU needs its own UUID",
        ),
        (
            gpus(&[(0, "a", 0)]),
            1.0,
            "GPU 0 has 0 bytes of memory: a GPU's memory must be more than 0",
        ),
        (
            gpus(&[]),
            0.0,
            "memory_overcommit = 0 is not accepted: a finite number above 0 (1.0 = no overcommit)",
        ),
        (gpus(&[]), -1.0, "memory_overcommit = -1 is not accepted"),
        (
            gpus(&[]),
            f64::NAN,
            "memory_overcommit = NaN is not accepted",
        ),
        (
            gpus(&[]),
            f64::INFINITY,
            "memory_overcommit = inf is not accepted",
        ),
    ];
    for (gpus, overcommit, message) in bad {
        let e = Inventory::new(gpus.clone(), *overcommit)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(message), "{e}");
    }
}

#[test]
fn gpus_are_kept_in_index_order_and_found_by_index() {
    let inv = Inventory::new(vec![gpu(5, L4, GIB), gpu(2, A100, GIB)], 1.0).unwrap();
    let order: Vec<u32> = inv.gpus().iter().map(|g| g.index.0).collect();
    assert_eq!(order, [2, 5]);
    assert_eq!(inv.gpu(GpuIndex(5)).unwrap().model, L4);
    assert_eq!(inv.gpu(GpuIndex(3)), None);
    assert_eq!(
        (inv.unreserved(GpuIndex(3)), inv.bound(GpuIndex(3))),
        (0, 0)
    );
    assert_eq!(inv.memory_overcommit(), 1.0);
}

#[test]
fn overcommit_scales_capacity_down_and_up() {
    let cases = [
        (40, 1.0, 40),
        (40, 1.5, 60),
        (10, 0.3, 3),
        (3, 0.5, 1),
        (1, 0.1, 0),
        (u64::MAX, 1.0, u64::MAX),
        (u64::MAX, 2.0, u64::MAX),
        ((1 << 53) + 1, 1.0, (1 << 53) + 1),
    ];
    for (capacity, factor, limit) in cases {
        assert_eq!(
            scaled_capacity(capacity, factor),
            limit,
            "{capacity} × {factor}"
        );
    }
}

// Properties over random sequences of operations.

const MODELS: [&str; 3] = ["NVIDIA A100", "NVIDIA H100", "Fake GPU"];
const WANTED: [&str; 4] = ["A100", "H100", "fake", "L4"];
const INDICES: [u32; 5] = [0, 1, 3, 4, 7];

#[derive(Debug, Clone)]
enum Op {
    Assign(u64, VgpuRequest, bool, u8),
    Batch(Vec<(u64, VgpuRequest)>, bool, u8),
    Release(u64),
    Restore(u64, Vec<u32>, u64),
}

fn any_request() -> impl Strategy<Value = VgpuRequest> {
    let memory = prop_oneof![
        Just(GpuMemory::WholeGpu),
        (0u64..=120).prop_map(GpuMemory::Bytes)
    ];
    let models = proptest::sample::subsequence(WANTED.to_vec(), 0..=2);
    (1u32..=3, memory, models).prop_map(|(gpus, memory, models)| VgpuRequest {
        gpus,
        memory,
        models: models.into_iter().map(String::from).collect(),
        ..VgpuRequest::default()
    })
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..6, any_request(), any::<bool>(), any::<u8>()).prop_map(|(i, r, p, b)| Op::Assign(i, r, p, b)),
        1 => (proptest::collection::vec((0u64..6, any_request()), 0..4), any::<bool>(), any::<u8>()).prop_map(|(v, p, b)| Op::Batch(v, p, b)),
        2 => (0u64..6).prop_map(Op::Release),
        2 => (0u64..6, proptest::collection::vec(0u32..9, 0..4), 0u64..=120).prop_map(|(i, g, m)| Op::Restore(i, g, m)),
    ]
}

fn any_inventory() -> impl Strategy<Value = Inventory> {
    let gpus = proptest::collection::vec((0..MODELS.len(), 1u64..=100), 0..=INDICES.len());
    let overcommit = prop_oneof![Just(1.0), Just(1.5), Just(0.5), 0.05f64..4.0];
    (gpus, overcommit).prop_map(|(gpus, overcommit)| {
        let gpus = gpus.iter().enumerate();
        let gpus = gpus
            .map(|(i, &(m, mem))| gpu(INDICES[i], MODELS[m], mem))
            .collect();
        Inventory::new(gpus, overcommit).unwrap()
    })
}

fn busy(mask: u8) -> impl Fn(GpuIndex) -> bool {
    move |g| mask & (1 << g.0) != 0
}

fn policy(pack: bool) -> AssignmentPolicy {
    if pack {
        Pack
    } else {
        Spread
    }
}

/// The entitlements on every GPU add up to what it has reserved, never beyond
/// floor(capacity × overcommit), and every assignment lists distinct known GPUs, ascending.
fn check_invariants(inv: &Inventory) {
    for (gpu, slot) in inv.gpus.iter().zip(&inv.slots) {
        let holders = inv
            .bindings
            .values()
            .filter(|a| a.gpus.contains(&gpu.index));
        let (count, sum) = holders.fold((0, 0), |(n, s), a| {
            (n + 1, s + a.memory.bytes_on(gpu.memory))
        });
        assert_eq!((slot.bound, slot.reserved), (count, sum));
        let limit = (gpu.memory as f64 * inv.memory_overcommit).floor();
        assert!(sum as f64 <= limit, "{sum} bound on {gpu:?} beyond {limit}");
        assert!(inv.memory_overcommit > 1.0 || sum <= gpu.memory);
    }
    for (id, a) in &inv.bindings {
        assert_eq!(a.vgpu, *id);
        assert!(
            !a.gpus.is_empty() && a.gpus.windows(2).all(|p| p[0] < p[1]),
            "{a:?}"
        );
        assert!(a.gpus.iter().all(|g| inv.gpu(*g).is_some()), "{a:?}");
    }
}

/// The GPUs `assign` should choose, worked out from the public view alone.
fn oracle(
    inv: &Inventory,
    r: &VgpuRequest,
    policy: AssignmentPolicy,
    busy: &dyn Fn(GpuIndex) -> bool,
) -> Option<Vec<GpuIndex>> {
    let mut loads: Vec<Load> = inv
        .gpus()
        .iter()
        .filter(|g| r.accepts_model(&g.model))
        .filter_map(|g| {
            let left = inv
                .unreserved(g.index)
                .checked_sub(r.memory.bytes_on(g.memory))?;
            Some(Load {
                index: g.index,
                busy: busy(g.index),
                bound: inv.bound(g.index),
                left,
            })
        })
        .collect();
    if r.gpus == 0 || loads.len() < r.gpus as usize {
        return None;
    }
    loads.sort_by(|a, b| rank(policy, a, b));
    let mut chosen: Vec<GpuIndex> = loads[..r.gpus as usize].iter().map(|l| l.index).collect();
    chosen.sort();
    Some(chosen)
}

fn check_assign(
    inv: &mut Inventory,
    id: u64,
    r: &VgpuRequest,
    policy: AssignmentPolicy,
    busy: &dyn Fn(GpuIndex) -> bool,
) {
    let before = inv.clone();
    let taken = before.assignment(VgpuId(id)).is_some();
    let expected = if taken {
        None
    } else {
        oracle(&before, r, policy, busy)
    };
    match inv.assign(VgpuId(id), r, policy, busy) {
        Ok(a) => {
            assert_eq!(Some(&a.gpus), expected.as_ref());
            assert_eq!(a.gpus.len(), r.gpus as usize);
            assert!(
                a.gpus.windows(2).all(|p| p[0] < p[1]),
                "distinct GPUs: {a:?}"
            );
            assert!(a
                .gpus
                .iter()
                .all(|g| r.accepts_model(&inv.gpu(*g).unwrap().model)));
        }
        Err(e) => {
            assert_eq!(expected, None, "{e}");
            assert_eq!(*inv, before, "a failed assign changes nothing");
            assert!(!e.to_string().contains('\n'));
            if let AssignError::NoFit(no_fit) = e {
                assert_eq!(no_fit.gpus.len(), inv.gpus().len());
            }
        }
    }
}

proptest! {
    #[test]
    fn memory_is_never_bound_beyond_capacity_times_overcommit(
        mut inv in any_inventory(),
        ops in proptest::collection::vec(any_op(), 0..40),
    ) {
        for op in ops {
            match op {
                Op::Assign(id, r, pack, mask) => check_assign(&mut inv, id, &r, policy(pack), &busy(mask)),
                Op::Batch(batch, pack, mask) => {
                    let busy = busy(mask);
                    let mut given: Vec<GpuIndex> = Vec::new();
                    let mut replay = inv.clone();
                    let requests: Vec<_> = batch.into_iter().map(|(i, r)| (VgpuId(i), r)).collect();
                    let results = inv.assign_batch(&requests, policy(pack), &busy);
                    for ((id, r), result) in requests.iter().zip(results) {
                        let with_given = |g| busy(g) || given.contains(&g);
                        check_assign(&mut replay, id.0, r, policy(pack), &with_given);
                        prop_assert_eq!(replay.assignment(*id).filter(|_| result.is_ok()), result.as_ref().ok());
                        if let Ok(a) = result {
                            given.extend(a.gpus);
                        }
                    }
                    prop_assert_eq!(&replay, &inv);
                }
                Op::Release(id) => {
                    let before = inv.clone();
                    let released = inv.release(VgpuId(id));
                    prop_assert_eq!(released.as_ref(), before.assignment(VgpuId(id)));
                    for g in released.iter().flat_map(|a| &a.gpus) {
                        let freed = inv.unreserved(*g) - before.unreserved(*g);
                        prop_assert_eq!(Some(freed), before.entitlement(VgpuId(id), *g));
                    }
                }
                Op::Restore(id, gpus, memory) => {
                    let before = inv.clone();
                    let mut sorted = indices(&gpus);
                    sorted.sort();
                    let fits = before.assignment(VgpuId(id)).is_none()
                        && !sorted.is_empty()
                        && sorted.windows(2).all(|p| p[0] < p[1])
                        && sorted.iter().all(|g| before.gpu(*g).is_some() && before.unreserved(*g) >= memory);
                    let assignment = Assignment { vgpu: VgpuId(id), gpus: indices(&gpus), memory: GpuMemory::Bytes(memory) };
                    let result = inv.restore(assignment);
                    prop_assert_eq!(result.is_ok(), fits, "{:?}", result);
                    if result.is_err() {
                        prop_assert_eq!(&inv, &before);
                    }
                }
            }
            check_invariants(&inv);
        }
    }
}
