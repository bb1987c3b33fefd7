//! The spec NRI's description stands for, and the precreate edit of it read back as NRI's
//! adjustment: the edit is the hook library's own, run here on the spec of `spec_of`.

use super::*;
use gpuplex_hook::spec::{edit, Injection};
use gpuplex_scheduler::VgpuId;
use gpuplex_wire::protocol::cdi::{CdiDeviceNode, CdiEdits, CdiHook, CdiMount};

fn pod() -> PodSandbox {
    PodSandbox {
        id: "pod-1".into(),
        name: "trainer".into(),
        namespace: "ml".into(),
        annotations: BTreeMap::from([
            ("gpuplex.io/gpu-memory".into(), "4Gi".into()),
            ("team".into(), "vision".into()),
        ]),
        ..Default::default()
    }
}

fn container() -> Container {
    Container {
        id: "c1".into(),
        annotations: BTreeMap::from([
            (
                "io.kubernetes.cri.container-type".into(),
                "container".into(),
            ),
            // A container's word for its namespace is never what the policy goes by.
            ("io.kubernetes.pod.namespace".into(), "kube-system".into()),
        ]),
        env: vec!["PATH=/bin".into(), "CUDA_VISIBLE_DEVICES=all".into()],
        hooks: Some(Hooks {
            create_runtime: vec![Hook {
                path: "/usr/bin/other".into(),
                args: vec!["other".into(), "x".into()],
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn the_spec_has_the_pods_requests_the_runtimes_namespace_and_the_containers_hooks() {
    let spec = spec_of(&pod(), &container());
    let a = &spec["annotations"];
    assert_eq!(a["gpuplex.io/gpu-memory"], "4Gi");
    assert!(a.get("team").is_none(), "only gpuplex.io/ keys of the pod");
    assert_eq!(a["io.kubernetes.cri.container-type"], "container");
    for key in POD_NAMESPACE_KEYS {
        assert_eq!(a[key], "ml", "{key}");
    }
    for key in POD_NAME_KEYS {
        assert_eq!(a[key], "trainer", "{key}");
    }
    assert_eq!(
        spec["process"]["env"],
        json!(["PATH=/bin", "CUDA_VISIBLE_DEVICES=all"])
    );
    assert_eq!(
        spec["hooks"]["createRuntime"],
        json!([{"path": "/usr/bin/other", "args": ["other", "x"]}])
    );
    // Without a pod name or namespace (not Kubernetes), none is claimed.
    let spec = spec_of(&PodSandbox::default(), &container());
    for key in POD_NAMESPACE_KEYS.iter().chain(POD_NAME_KEYS.iter()) {
        assert!(spec["annotations"].get(key).is_none(), "{key}");
    }
}

#[test]
fn a_container_annotation_wins_over_its_pods() {
    let mut c = container();
    c.annotations
        .insert("gpuplex.io/gpu-memory".into(), "2Gi".into());
    assert_eq!(
        spec_of(&pod(), &c)["annotations"]["gpuplex.io/gpu-memory"],
        "2Gi"
    );
}

fn injection() -> Injection {
    Injection {
        vgpu: VgpuId(42),
        handle: None,
        edits: CdiEdits {
            env: vec!["CUDA_VISIBLE_DEVICES=GPU-fake-0".into(), "PATH=/bin".into()],
            device_nodes: vec![
                CdiDeviceNode {
                    path: "/dev/nvidia0".into(),
                    host_path: Some("/dev/nvidia3".into()),
                    node_type: Some("c".into()),
                    major: Some(195),
                    minor: Some(3),
                    file_mode: Some(0o666),
                    uid: Some(0),
                    gid: Some(0),
                    ..Default::default()
                },
                CdiDeviceNode {
                    path: "/dev/nvidiactl".into(),
                    node_type: Some("c".into()),
                    major: Some(195),
                    minor: Some(255),
                    ..Default::default()
                },
            ],
            mounts: vec![CdiMount {
                host_path: "/run/gpuplex/identity/vgpu-42.json".into(),
                container_path: "/run/gpuplex/vgpu.json".into(),
                mount_type: None,
                options: vec!["ro".into(), "bind".into()],
            }],
            hooks: vec![CdiHook {
                hook_name: "createContainer".into(),
                path: "/usr/bin/nvidia-ctk".into(),
                args: vec!["nvidia-ctk".into(), "hook".into(), "update-ldcache".into()],
                timeout: Some(5),
                ..Default::default()
            }],
            additional_gids: vec![44],
            ..Default::default()
        },
        hook: None,
    }
}

#[test]
fn the_edit_comes_back_as_the_adjustment_that_makes_it() {
    let before = spec_of(&pod(), &container());
    let mut edited = before.clone();
    edit(&mut edited, &injection()).unwrap();
    let handle = Handle::from_bytes([7; 16]);
    let (adjust, gids) = adjustment(&before, &edited, &handle).unwrap();

    assert_eq!(adjust.annotations["gpuplex.io/vgpu-id"], "vgpu-42");
    assert_eq!(
        adjust.annotations["gpuplex.io/vgpu-handle"],
        handle.to_string()
    );
    assert_eq!(adjust.annotations.len(), 2);
    // The environment the edit set, and not what the container had already.
    assert_eq!(
        adjust.env,
        [KeyValue {
            key: "CUDA_VISIBLE_DEVICES".into(),
            value: "GPU-fake-0".into()
        }]
    );
    let devices = &adjust.linux.as_ref().unwrap().devices;
    let paths: Vec<_> = devices.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["/dev/nvidia0", "/dev/nvidiactl"]);
    let gpu = &devices[0];
    assert_eq!((gpu.r#type.as_str(), gpu.major, gpu.minor), ("c", 195, 3));
    assert_eq!(gpu.file_mode, Some(OptionalFileMode { value: 0o666 }));
    assert_eq!(adjust.mounts.len(), 1);
    let m = &adjust.mounts[0];
    assert_eq!(m.destination, "/run/gpuplex/vgpu.json");
    assert_eq!(m.source, "/run/gpuplex/identity/vgpu-42.json");
    assert!(m.options.contains(&"ro".to_string()));
    // The host spec's hook is added; the container's own createRuntime hook is not repeated.
    let hooks = adjust.hooks.unwrap();
    assert!(hooks.create_runtime.is_empty());
    assert_eq!(hooks.create_container.len(), 1);
    assert_eq!(hooks.create_container[0].path, "/usr/bin/nvidia-ctk");
    assert_eq!(
        hooks.create_container[0].timeout,
        Some(OptionalInt { value: 5 })
    );
    assert_eq!(gids, [44]);
}

#[test]
fn an_edit_without_its_vgpu_id_or_with_a_device_of_no_number_is_refused_in_one_line() {
    let before = spec_of(&pod(), &container());
    let handle = Handle::from_bytes([7; 16]);
    let err = adjustment(&before, &before, &handle).unwrap_err();
    assert!(
        err.contains("gpuplex.io/vgpu-id") && !err.contains('\n'),
        "{err}"
    );

    let mut edited = before.clone();
    edited["annotations"]["gpuplex.io/vgpu-id"] = json!("vgpu-1");
    edited["linux"]["devices"] = json!([{"path": "/dev/x", "type": "c"}]);
    let err = adjustment(&before, &edited, &handle).unwrap_err();
    assert!(err.contains("major") && !err.contains('\n'), "{err}");
}
