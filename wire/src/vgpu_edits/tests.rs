//! The edits of a vGPU, whole, and every reply they cannot be made from, in one line.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use gpuplex_scheduler::request::Priority;

use super::*;
use crate::protocol::cdi::CdiHook;
use crate::protocol::AssignedGpu;

fn gpu(index: u32, uuid: &str, path: &str) -> AssignedGpu {
    AssignedGpu {
        index,
        uuid: uuid.into(),
        model: "Fake A100".into(),
        memory: 8 << 30,
        device: Some(DeviceNode {
            path: path.into(),
            major: 195,
            minor: index,
        }),
        fake: true,
    }
}

/// Two GPUs, the second a fake one outside `/dev`.
fn reply(cdi: Option<CdiEdits>) -> VgpuReply {
    VgpuReply {
        id: VgpuId(3),
        handle: None,
        container: None,
        gpus: vec![
            gpu(0, "GPU-0f1e", "/dev/nvidia0"),
            gpu(1, "GPU-fake-1", "/var/lib/gpuplex/fake/nvidia1"),
        ],
        weight: 1,
        priority: Priority::Normal,
        cdi,
    }
}

fn control() -> Vec<DeviceNode> {
    vec![DeviceNode {
        path: "/dev/nvidiactl".into(),
        major: 195,
        minor: 255,
    }]
}

const IDENTITY: &str = "/run/gpuplex/identity/vgpu-3.json";

fn node(path: &str, host: &str, minor: i64) -> CdiDeviceNode {
    CdiDeviceNode {
        path: path.into(),
        host_path: Some(host.into()),
        node_type: Some("c".into()),
        major: Some(195),
        minor: Some(minor),
        file_mode: Some(0o666),
        permissions: Some("rwm".into()),
        uid: Some(0),
        gid: Some(0),
    }
}

/// gpuplex's own edits of [`reply`], in their order.
fn ours() -> CdiEdits {
    CdiEdits {
        device_nodes: vec![
            node("/dev/nvidia0", "/dev/nvidia0", 0),
            node("/dev/nvidia1", "/var/lib/gpuplex/fake/nvidia1", 1),
            node("/dev/nvidiactl", "/dev/nvidiactl", 255),
        ],
        env: vec!["CUDA_VISIBLE_DEVICES=GPU-0f1e,GPU-fake-1".into()],
        mounts: vec![CdiMount {
            host_path: IDENTITY.into(),
            container_path: "/run/gpuplex/vgpu.json".into(),
            mount_type: Some("bind".into()),
            options: ["bind", "ro", "nosuid", "nodev", "noexec"]
                .map(String::from)
                .into(),
        }],
        ..CdiEdits::default()
    }
}

/// A host spec's edits: a device node at a path gpuplex gives too, a variable, a mount, a
/// hook, a group, and where they come from.
fn host() -> CdiEdits {
    CdiEdits {
        env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
        device_nodes: vec![CdiDeviceNode {
            path: "/dev/nvidia0".into(),
            ..CdiDeviceNode::default()
        }],
        mounts: vec![CdiMount {
            host_path: "/usr/lib/libcuda.so.1".into(),
            container_path: "/usr/lib/libcuda.so.1".into(),
            mount_type: None,
            options: vec!["ro".into(), "bind".into()],
        }],
        hooks: vec![CdiHook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/nvidia-cdi-hook".into(),
            args: vec!["nvidia-cdi-hook".into(), "update-ldcache".into()],
            ..CdiHook::default()
        }],
        additional_gids: vec![44],
        cdi_devices: vec!["nvidia.com/gpu=0".into()],
        spec_files: vec!["/etc/cdi/nvidia.yaml".into()],
    }
}

#[test]
fn the_host_specs_edits_come_first_then_gpuplexs() {
    // (case, host edits, expected)
    let with_host = {
        let mut expected = host();
        expected.append(&ours());
        expected
    };
    let table = [
        ("no host spec", None, ours()),
        ("host spec", Some(host()), with_host),
    ];
    for (case, cdi, expected) in table {
        let edits = vgpu_edits(&reply(cdi), Path::new(IDENTITY), &control()).unwrap();
        assert_eq!(edits, expected, "{case}");
    }
}

#[test]
fn gpuplexs_edits_are_last_of_their_kind() {
    let edits = vgpu_edits(&reply(Some(host())), Path::new(IDENTITY), &control()).unwrap();
    // CDI: a later device node of a path, or variable of a name, replaces an earlier one.
    let last_at = |path: &str| edits.device_nodes.iter().rfind(|d| d.path == path).cloned();
    assert_eq!(
        last_at("/dev/nvidia0"),
        Some(node("/dev/nvidia0", "/dev/nvidia0", 0))
    );
    assert_eq!(edits.mounts.last().unwrap().container_path, IDENTITY_PATH);
    assert_eq!(
        edits.env.last().unwrap(),
        "CUDA_VISIBLE_DEVICES=GPU-0f1e,GPU-fake-1"
    );
}

#[test]
fn without_control_nodes_only_the_gpus_are_given() {
    let edits = vgpu_edits(&reply(None), Path::new(IDENTITY), &[]).unwrap();
    let paths: Vec<&str> = edits.device_nodes.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["/dev/nvidia0", "/dev/nvidia1"]);
}

#[test]
fn a_reply_the_edits_cannot_be_made_from_is_refused_in_one_line() {
    type Change = fn(&mut VgpuReply, &mut PathBuf);
    let table: [(Change, &str); 8] = [
        (|r, _| r.gpus.clear(),
            "gpuplex edits for vgpu-3: the node service's reply names no GPU (an assignment has at least one)"),
        (|r, _| r.gpus[1].device = None,
            "gpuplex edits for vgpu-3: the node service did not say which device node is GPU 1; is the node service older than this program?"),
        (|r, _| r.gpus[0].uuid = "GPU-a,GPU-b".into(),
            "gpuplex edits for vgpu-3: GPU UUID \"GPU-a,GPU-b\" cannot go in CUDA_VISIBLE_DEVICES: it is empty or has a comma or whitespace"),
        (|r, _| r.gpus[1].uuid = String::new(),
            "gpuplex edits for vgpu-3: GPU UUID \"\" cannot go in CUDA_VISIBLE_DEVICES: it is empty or has a comma or whitespace"),
        (|r, _| r.gpus[1].uuid = "GPU 1".into(),
            "gpuplex edits for vgpu-3: GPU UUID \"GPU 1\" cannot go in CUDA_VISIBLE_DEVICES: it is empty or has a comma or whitespace"),
        (|_, file| *file = "vgpu.json".into(),
            "gpuplex edits for vgpu-3: identity file vgpu.json must be an absolute UTF-8 path"),
        (|_, file| *file = PathBuf::from(OsStr::from_bytes(b"/run/\xff.json")),
            "gpuplex edits for vgpu-3: identity file /run/\u{fffd}.json must be an absolute UTF-8 path"),
        (|r, _| r.gpus[0].device.as_mut().unwrap().path = PathBuf::from(OsStr::from_bytes(b"/dev/\xff")),
            "gpuplex edits for vgpu-3: device node /dev/\u{fffd} must be an absolute UTF-8 path"),
    ];
    for (change, message) in table {
        let (mut vgpu, mut file) = (reply(Some(host())), PathBuf::from(IDENTITY));
        change(&mut vgpu, &mut file);
        let error = vgpu_edits(&vgpu, &file, &control()).unwrap_err();
        assert_eq!(error.to_string(), message);
    }
}
