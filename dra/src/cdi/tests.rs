//! The claim's spec is a CDI spec the reference parser accepts, with precreate's edits (the
//! host's, then gpuplex's) and the attach step last.

use super::*;
use gpuplex_scheduler::request::Priority;
use gpuplex_wire::protocol::cdi::CdiHook;
use gpuplex_wire::protocol::AssignedGpu;
use gpuplex_wire::vgpu_edits::EditsError;

const UID: &str = "8d5c6f1e-0000-4000-8000-000000000001";

fn vgpu(cdi: Option<CdiEdits>) -> VgpuReply {
    let gpu = |index: u32| AssignedGpu {
        index,
        uuid: format!("GPU-fake-{index}"),
        model: "Fake A100".into(),
        memory: 8 << 30,
        device: Some(DeviceNode {
            path: format!("/dev/nvidia{index}").into(),
            major: 195,
            minor: index,
        }),
        fake: true,
    };
    VgpuReply {
        id: gpuplex_scheduler::VgpuId(4),
        handle: None,
        container: None,
        gpus: vec![gpu(0), gpu(2)],
        weight: 2,
        priority: Priority::Normal,
        cdi,
    }
}

fn attach() -> CdiHook {
    gpuplex_wire::attach_step::attach_hook(
        Path::new("/usr/local/bin/gpuplex-hook"),
        Path::new("/run/gpuplex/gpuplex.sock"),
        &gpuplex_scheduler::Handle::from_bytes([9; 16]),
    )
}

fn control() -> Vec<DeviceNode> {
    vec![DeviceNode {
        path: "/dev/nvidiactl".into(),
        major: 195,
        minor: 255,
    }]
}

#[test]
fn a_claims_spec_carries_the_hosts_edits_then_gpuplexs_then_the_attach_step() {
    let host = CdiEdits {
        env: vec!["NVIDIA_DRIVER=1".into()],
        hooks: vec![CdiHook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/nvidia-cdi-hook".into(),
            args: vec!["nvidia-cdi-hook".into(), "update-ldcache".into()],
            ..CdiHook::default()
        }],
        cdi_devices: vec!["nvidia.com/gpu=0".into()],
        ..CdiEdits::default()
    };
    let edits = claim_edits(
        &vgpu(Some(host)),
        Path::new("/run/gpuplex/identity/vgpu-4.json"),
        &control(),
        Some(attach()),
    )
    .unwrap();
    let paths: Vec<&str> = edits.device_nodes.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["/dev/nvidia0", "/dev/nvidia2", "/dev/nvidiactl"]);
    assert_eq!(
        edits.env,
        [
            "NVIDIA_DRIVER=1",
            "CUDA_VISIBLE_DEVICES=GPU-fake-0,GPU-fake-2"
        ]
    );
    // As precreate writes them: rw and mknod, mode 0666, root's.
    for node in &edits.device_nodes {
        assert_eq!(node.permissions.as_deref(), Some("rwm"), "{}", node.path);
        assert_eq!(node.file_mode, Some(0o666), "{}", node.path);
        assert_eq!((node.uid, node.gid), (Some(0), Some(0)), "{}", node.path);
    }
    assert_eq!(edits.mounts[0].container_path, "/run/gpuplex/vgpu.json");
    assert!(edits.mounts[0].options.contains(&"ro".to_string()));
    let spec = spec_json(UID, &edits);
    assert_eq!(spec["kind"], "gpuplex.io/vgpu");
    assert_eq!(spec["devices"][0]["name"], UID);
    let container = &spec["devices"][0]["containerEdits"];
    assert!(container.get("cdiDevices").is_none() && container.get("specFiles").is_none());
    assert!(
        container.get("additionalGids").is_none(),
        "empty lists are left out"
    );
    assert_eq!(container["hooks"][0]["hookName"], "createContainer");
    // The attach step comes last, after the host's hooks.
    assert_eq!(container["hooks"][1]["hookName"], "createRuntime");
    assert_eq!(container["hooks"][1]["args"][3], "attach");
}

#[test]
fn the_reference_parser_accepts_the_written_spec() {
    let dir = tempfile::tempdir().unwrap();
    let edits = claim_edits(
        &vgpu(None),
        Path::new("/run/gpuplex/identity/vgpu-4.json"),
        &control(),
        Some(attach()),
    )
    .unwrap();
    let path = write(dir.path(), UID, &edits).unwrap();
    assert_eq!(path, dir.path().join(format!("gpuplex.io-vgpu-{UID}.json")));
    let raw = container_device_interface::spec::parse_spec(&path).expect("parses");
    let spec = container_device_interface::spec::new_spec(&raw, &path, 0).expect("valid");
    assert!(spec.devices.contains_key(UID), "{:?}", spec.devices.keys());
    // The version written is the oldest the reference crate finds it needs (podman 4.3 and
    // containerd 1.7 read up to 0.5.0), and the file, which carries the handle, is root's.
    let needed = container_device_interface::version::minimum_required_version(&raw).unwrap();
    let written: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(written["cdiVersion"], "0.5.0");
    assert_eq!(needed.to_string().trim_start_matches('v'), "0.5.0");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temporary file is left");
    remove(dir.path(), UID).unwrap();
    assert!(!path.exists());
    remove(dir.path(), UID).unwrap();
}

#[test]
fn a_uid_that_could_escape_the_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for uid in ["", "../x", "a/b", "-rf", "x y", &"a".repeat(65), "ä"] {
        assert!(matches!(check_uid(uid), Err(CdiError::BadUid(_))), "{uid}");
        assert!(
            write(dir.path(), uid, &CdiEdits::default()).is_err(),
            "{uid}"
        );
        assert!(remove(dir.path(), uid).is_err(), "{uid}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    let gone = vgpu(None);
    let mut bare = gone.clone();
    bare.gpus[0].device = None;
    assert!(matches!(
        claim_edits(&bare, Path::new("/x"), &[], Some(attach())),
        Err(CdiError::Edits(EditsError::NoDeviceNode { gpu: 0, .. }))
    ));
}
