use super::*;
use gpuplex_wire::protocol::cdi::{CdiDeviceNode, CdiMount};

const GIB: u64 = 1 << 30;

fn gpu(index: u32, capacity: u64, healthy: bool) -> GpuCapacity {
    GpuCapacity {
        index,
        uuid: format!("GPU-fake-{index}"),
        model: "Fake".into(),
        memory: capacity,
        capacity,
        unreserved: capacity,
        healthy,
        fake: true,
    }
}

#[test]
fn each_gpu_offers_its_capacity_in_whole_units_with_its_health() {
    let gpus = [gpu(0, 2 * GIB + GIB / 2, true), gpu(1, 3 * GIB, false)];
    let listed: Vec<(String, String)> = devices(&gpus, GIB)
        .into_iter()
        .map(|d| (d.id, d.health))
        .collect();
    let expected: Vec<(String, String)> = [
        ("gpu-0-0", HEALTHY),
        ("gpu-0-1", HEALTHY),
        ("gpu-1-0", UNHEALTHY),
        ("gpu-1-1", UNHEALTHY),
        ("gpu-1-2", UNHEALTHY),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(listed, expected);
    assert_eq!(most_on_one_gpu(&gpus, GIB), 3);
    assert_eq!(devices(&gpus, 512 << 20).len(), 5 + 6);
}

#[test]
fn units_not_seen_are_listed_unhealthy_with_their_ids() {
    let gpus = [gpu(0, 2 * GIB, true), gpu(1, GIB, false)];
    let listed = devices(&gpus, GIB);
    let unseen = unseen(&listed);
    let ids = |d: &[dp::Device]| d.iter().map(|d| d.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&unseen), ids(&listed));
    assert!(unseen.iter().all(|d| d.health == UNHEALTHY));
    assert!(super::unseen(&[]).is_empty());
}

fn edits() -> CdiEdits {
    CdiEdits {
        env: vec!["CUDA_VISIBLE_DEVICES=GPU-fake-1".into()],
        device_nodes: vec![
            CdiDeviceNode {
                path: "/dev/nvidia1".into(),
                host_path: Some("/dev/gpuplex-fake1".into()),
                permissions: Some("rw".into()),
                ..CdiDeviceNode::default()
            },
            CdiDeviceNode {
                path: "/dev/nvidiactl".into(),
                ..CdiDeviceNode::default()
            },
        ],
        mounts: vec![CdiMount {
            host_path: "/run/gpuplex/identity/vgpu-3.json".into(),
            container_path: "/run/gpuplex/vgpu.json".into(),
            mount_type: Some("bind".into()),
            options: vec!["bind".into(), "ro".into()],
        }],
        ..CdiEdits::default()
    }
}

#[test]
fn the_kubelets_fields_carry_the_devices_environment_identity_and_handle() {
    let handle = Handle::from_bytes([7; 16]);
    let a = answer(DeviceDelivery::Kubelet, "units-gpu-1-0", &handle, &edits());
    assert_eq!(a.annotations[ALLOCATION], handle.to_string());
    assert_eq!(a.annotations.len(), 1);
    assert_eq!(a.envs["CUDA_VISIBLE_DEVICES"], "GPU-fake-1");
    assert_eq!(
        a.devices,
        [
            dp::DeviceSpec {
                container_path: "/dev/nvidia1".into(),
                host_path: "/dev/gpuplex-fake1".into(),
                permissions: "rw".into(),
            },
            dp::DeviceSpec {
                container_path: "/dev/nvidiactl".into(),
                host_path: "/dev/nvidiactl".into(),
                permissions: "rw".into(),
            }
        ]
    );
    assert_eq!(
        a.mounts,
        [dp::Mount {
            container_path: "/run/gpuplex/vgpu.json".into(),
            host_path: "/run/gpuplex/identity/vgpu-3.json".into(),
            read_only: true,
        }]
    );
    assert!(a.cdi_devices.is_empty());
}

#[test]
fn with_cdi_the_device_stands_for_the_edits() {
    let handle = Handle::from_bytes([7; 16]);
    let a = answer(DeviceDelivery::Cdi, "units-gpu-1-0", &handle, &edits());
    assert_eq!(a.cdi_devices[0].name, "gpuplex.io/vgpu=units-gpu-1-0");
    assert_eq!(
        a.annotations["cdi.k8s.io/gpuplex.io_units-gpu-1-0"],
        "gpuplex.io/vgpu=units-gpu-1-0"
    );
    assert_eq!(a.annotations[ALLOCATION], handle.to_string());
    assert!(a.devices.is_empty() && a.mounts.is_empty() && a.envs.is_empty());
}
