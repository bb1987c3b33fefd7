//! Units of GPU memory: ids, the preferred allocation and the placement, by table and property.

use super::*;
use proptest::prelude::*;

const GIB: u64 = 1 << 30;

fn u(gpu: u32, n: u32) -> UnitId {
    UnitId {
        gpu: GpuIndex(gpu),
        n,
    }
}

fn ids(units: &[UnitId]) -> Vec<String> {
    units.iter().map(UnitId::to_string).collect()
}

#[test]
fn each_gpu_offers_its_capacity_in_whole_units_named_by_gpu() {
    let units = units_of(&[(GpuIndex(0), 2 * GIB + 5), (GpuIndex(3), GIB)], GIB);
    assert_eq!(ids(&units), ["gpu-0-0", "gpu-0-1", "gpu-3-0"]);
    assert!(units_of(&[(GpuIndex(0), GIB - 1)], GIB).is_empty());
    for unit in &units {
        assert_eq!(unit.to_string().parse::<UnitId>(), Ok(*unit));
    }
}

#[test]
fn an_id_that_is_not_a_unit_is_refused_in_one_line() {
    for bad in [
        "",
        "gpu-",
        "gpu-1",
        "gpu-1-",
        "gpu--1",
        "gpu-01-2",
        "gpu-1-02",
        "gpu-+1-2",
        "gpu-1-2-3",
        "GPU-1-2",
        "gpu-4294967296-0",
        "nvidia0",
        "gpu-1-2\n",
    ] {
        let e = bad.parse::<UnitId>().unwrap_err();
        assert_eq!(e, UnitsError::BadId(bad.into()), "{bad:?}");
        assert!(!e.to_string().contains('\n') || bad.contains('\n'), "{e}");
    }
    let long = "x".repeat(10_000);
    let UnitsError::BadId(shown) = long.parse::<UnitId>().unwrap_err() else {
        panic!()
    };
    assert_eq!(shown.len(), 64, "a huge id is cut short in the line");
}

#[test]
fn a_request_is_kept_on_one_gpu_with_room_chosen_by_the_policy() {
    // GPU 0 has 3 free units, GPU 1 has 6, GPU 2 has 4.
    let mut available = Vec::new();
    for (gpu, free) in [(0, 3), (1, 6), (2, 4)] {
        available.extend((0..free).map(|n| u(gpu, n)));
    }
    let spread = preferred(&available, &[], 4, AssignmentPolicy::Spread);
    assert_eq!(spread, [u(1, 0), u(1, 1), u(1, 2), u(1, 3)]);
    let pack = preferred(&available, &[], 4, AssignmentPolicy::Pack);
    assert_eq!(pack, [u(2, 0), u(2, 1), u(2, 2), u(2, 3)]);
    // What the kubelet must include decides the GPU.
    let must = preferred(&available, &[u(0, 2)], 3, AssignmentPolicy::Spread);
    assert_eq!(must, [u(0, 2), u(0, 0), u(0, 1)]);
    // No GPU has 7: the largest free GPUs first, and Allocate will refuse the spread.
    let none = preferred(&available, &[], 7, AssignmentPolicy::Pack);
    assert_eq!(none.len(), 7);
    assert_eq!(&none[..6], &(0..6).map(|n| u(1, n)).collect::<Vec<_>>()[..]);
    assert_eq!(none[6], u(2, 0));
}

#[test]
fn allocate_reads_one_gpus_units_as_its_memory_and_refuses_a_spread() {
    let one = placement(&ids(&[u(1, 4), u(1, 0), u(1, 7)]), GIB, 16).unwrap();
    assert_eq!(one.gpus, [GpuIndex(1)]);
    assert_eq!(one.memory, 3 * GIB);
    let e = placement(&ids(&[u(0, 0), u(1, 0), u(1, 1)]), GIB, 16).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the kubelet gave this container gpuplex.io/gpu-memory on GPUs 0, 1 (3 units of 1 GiB); a vGPU's memory is on one GPU: ask for at most 16 (the most one GPU of this node offers), on a node with a GPU that has them free, or use DRA"
    );
    assert_eq!(
        placement(&ids(&[u(0, 1), u(0, 1)]), GIB, 16),
        Err(UnitsError::Twice(u(0, 1)))
    );
    assert_eq!(placement(&[], GIB, 16), Err(UnitsError::None));
    assert_eq!(
        placement(&["../../etc".into()], GIB, 16),
        Err(UnitsError::BadId("../../etc".into()))
    );
}

#[test]
fn a_unit_its_gpu_does_not_offer_is_refused_in_one_line() {
    let offered = |gpu: GpuIndex| if gpu.0 == 0 { 40 } else { 1 };
    assert_eq!(
        check_offered(&[u(0, 0), u(0, 39), u(1, 0)], offered),
        Ok(())
    );
    let e = check_offered(&[u(0, 3), u(0, 99999)], offered).unwrap_err();
    assert_eq!(
        e.to_string(),
        "gpuplex.io/gpu-memory unit gpu-0-99999 is not one this node lists: GPU 0 offers 40 units (gpu-0-0 to gpu-0-39)"
    );
    let e = check_offered(&[u(1, 1)], offered).unwrap_err();
    assert!(
        e.to_string().ends_with("GPU 1 offers 1 unit (gpu-1-0)"),
        "{e}"
    );
    let e = check_offered(&[u(7, 0)], |_| 0).unwrap_err();
    assert!(e.to_string().ends_with("GPU 7 offers no units"), "{e}");
}

#[test]
fn one_unit_given_to_two_containers_of_a_request_is_refused() {
    let fine = [vec![u(0, 0), u(0, 1)], vec![u(0, 2)], vec![u(1, 0)]];
    assert_eq!(check_disjoint(&fine), Ok(()));
    let shared = [vec![u(0, 0), u(0, 1)], vec![u(0, 2), u(0, 1)]];
    let e = check_disjoint(&shared).unwrap_err();
    assert_eq!(e, UnitsError::Shared(u(0, 1)));
    assert!(!e.to_string().contains('\n'));
    assert!(
        e.to_string()
            .contains("gpu-0-1 was given to two containers"),
        "{e}"
    );
}

fn free_units() -> impl Strategy<Value = Vec<UnitId>> {
    proptest::collection::vec(0u32..8, 0..4).prop_map(|free| {
        free.iter()
            .enumerate()
            .flat_map(|(gpu, &count)| (0..count).map(move |n| u(gpu as u32, n)))
            .collect()
    })
}

proptest! {
    /// Whatever the kubelet offers: the preference includes what it must, never a unit it was
    /// not offered, and is all on one GPU whenever a GPU can take the request with what it must
    /// include; then Allocate reads it as that GPU and the request's memory.
    #[test]
    fn the_preference_is_one_gpu_whenever_one_has_room(
        available in free_units(),
        must_pick in proptest::collection::vec(any::<prop::sample::Index>(), 0..3),
        size in 1usize..10,
        pack in any::<bool>(),
    ) {
        let policy = if pack { AssignmentPolicy::Pack } else { AssignmentPolicy::Spread };
        let mut must: Vec<UnitId> = if available.is_empty() {
            Vec::new()
        } else {
            must_pick.iter().map(|i| *i.get(&available)).collect()
        };
        must.sort();
        must.dedup();
        let got = preferred(&available, &must, size, policy);
        for m in &must {
            prop_assert!(got.contains(m));
        }
        for g in &got {
            prop_assert!(available.contains(g) || must.contains(g));
        }
        let mut distinct = got.clone();
        distinct.sort();
        distinct.dedup();
        prop_assert_eq!(distinct.len(), got.len());
        prop_assert!(got.len() <= size.max(must.len()));
        let room = (0..8).any(|gpu| {
            let on = available.iter().filter(|x| x.gpu.0 == gpu).count();
            on >= size && must.iter().all(|m| m.gpu.0 == gpu)
        });
        if room {
            prop_assert_eq!(got.len(), size.max(must.len()));
            let placed = placement(&ids(&got), GIB, 8).unwrap();
            prop_assert_eq!(placed.gpus.len(), 1);
            prop_assert_eq!(placed.memory, GIB * got.len() as u64);
        }
    }
}
