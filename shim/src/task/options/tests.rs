use std::io::Write;

use containerd_shim::protos::protobuf::CodedOutputStream;

use super::*;

fn any(type_url: &str, value: Vec<u8>) -> Any {
    Any {
        type_url: type_url.into(),
        value,
        ..Default::default()
    }
}

/// Encodes fields the way protoc does: varints and strings by number.
fn encode(fields: &[(u32, Field)]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut stream = CodedOutputStream::vec(&mut out);
        for (number, field) in fields {
            match field {
                Field::Varint(v) => stream.write_uint64(*number, *v).unwrap(),
                Field::Bytes(b) => stream.write_bytes(*number, b).unwrap(),
            }
        }
        stream.flush().unwrap();
    }
    out
}

#[test]
fn runc_v1_options_with_either_type_url_form() {
    let o = RuncV1Options {
        binary_name: "/usr/bin/crun".into(),
        root: "/run/gpuplex-runc".into(),
        shim_cgroup: "/gpuplex/shims".into(),
        systemd_cgroup: true,
        io_uid: 1000,
        io_gid: 100,
        ..Default::default()
    };
    let bytes = o.write_to_bytes().unwrap();
    for url in [
        "containerd.runc.v1.Options",
        "type.googleapis.com/containerd.runc.v1.Options",
    ] {
        let got = RuntimeOptions::decode(&any(url, bytes.clone())).unwrap();
        assert_eq!(got.binary_name, "/usr/bin/crun");
        assert_eq!(got.root, "/run/gpuplex-runc");
        assert_eq!(got.shim_cgroup, "/gpuplex/shims");
        assert!(got.systemd_cgroup);
        assert_eq!((got.io_uid, got.io_gid), (1000, 100));
    }
}

#[test]
fn legacy_create_options_carry_the_shim_cgroup_and_io_owner() {
    let bytes = encode(&[
        (1, Field::Varint(1)),
        (2, Field::Varint(1)),
        (6, Field::Bytes(b"network".to_vec())),
        (7, Field::Bytes(b"soft".to_vec())),
        (8, Field::Varint(1)),
        (9, Field::Bytes(b"/shims".to_vec())),
        (10, Field::Varint(7)),
        (11, Field::Varint(8)),
    ]);
    let got = RuntimeOptions::decode(&any("containerd.linux.runc.CreateOptions", bytes)).unwrap();
    assert_eq!(
        got,
        RuntimeOptions {
            no_pivot_root: true,
            no_new_keyring: true,
            shim_cgroup: "/shims".into(),
            io_uid: 7,
            io_gid: 8,
            ..Default::default()
        }
    );
}

#[test]
fn legacy_runc_options_name_the_binary_and_root() {
    let bytes = encode(&[
        (1, Field::Bytes(b"crun".to_vec())),
        (2, Field::Bytes(b"/run/r".to_vec())),
        (3, Field::Bytes(b"/usr/sbin/criu".to_vec())),
        (4, Field::Varint(1)),
    ]);
    let got = RuntimeOptions::decode(&any("containerd.linux.runc.RuncOptions", bytes)).unwrap();
    assert_eq!(got.runc_binary(), "crun");
    assert_eq!(got.runc_root("k8s.io"), Path::new("/run/r/k8s.io"));
    assert!(got.systemd_cgroup);
}

#[test]
fn cri_options_read_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runc.toml");
    let mut file = std::fs::File::create(&path).unwrap();
    writeln!(
        file,
        "BinaryName = \"/usr/bin/runc\"\nRoot = \"/run/x\"\nSystemdCgroup = false\nCriuPath = \"\""
    )
    .unwrap();
    let bytes = encode(&[
        (1, Field::Bytes(b"runtimeoptions.v1.Options".to_vec())),
        (2, Field::Bytes(path.to_str().unwrap().as_bytes().to_vec())),
    ]);
    let got = RuntimeOptions::decode(&any("runtimeoptions.v1.Options", bytes)).unwrap();
    assert_eq!(got.binary_name, "/usr/bin/runc");
    assert_eq!(got.root, "/run/x");

    let empty = encode(&[(2, Field::Bytes(Vec::new()))]);
    let got = RuntimeOptions::decode(&any("runtimeoptions.v1.Options", empty)).unwrap();
    assert_eq!(got, RuntimeOptions::default());
}

#[test]
fn defaults_match_containerds_runc_shim() {
    let got = RuntimeOptions::decode(&Any::default()).unwrap();
    assert_eq!(got.runc_binary(), "runc");
    assert_eq!(
        got.runc_root("default"),
        Path::new("/run/containerd/runc/default")
    );
}

#[test]
fn refusals_name_what_is_wrong() {
    let unknown = RuntimeOptions::decode(&any("example.com/Other", vec![])).unwrap_err();
    assert!(unknown.to_string().contains("\"Other\""), "{unknown}");
    assert!(
        unknown.to_string().contains("containerd.runc.v1.Options"),
        "{unknown}"
    );

    let torn = RuntimeOptions::decode(&any("containerd.linux.runc.CreateOptions", vec![0x4a, 9]));
    let torn = torn.unwrap_err().to_string();
    assert!(
        torn.starts_with(
            "runtime options of type containerd.linux.runc.CreateOptions do not decode"
        ),
        "{torn}"
    );

    let dir = tempfile::tempdir().unwrap();
    for (content, why) in [
        ("Root = 3", "Root must be a string"),
        ("Nope = true", "unknown key Nope"),
        ("IoUid = -1", "IoUid must be a user or group id"),
        ("= broken", ""),
    ] {
        let path = dir.path().join("o.toml");
        std::fs::write(&path, content).unwrap();
        let bytes = encode(&[(2, Field::Bytes(path.to_str().unwrap().as_bytes().to_vec()))]);
        let e = RuntimeOptions::decode(&any("runtimeoptions.v1.Options", bytes)).unwrap_err();
        let e = e.to_string();
        assert!(
            e.starts_with(&format!("runtime options file {}: ", path.display())),
            "{e}"
        );
        assert!(e.contains(why), "{e}");
    }
    let bytes = encode(&[(2, Field::Bytes(b"/nonexistent/o.toml".to_vec()))]);
    let e = RuntimeOptions::decode(&any("runtimeoptions.v1.Options", bytes)).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/o.toml"), "{e}");
}

#[test]
fn a_cgroups_path_in_the_systemd_form_is_told_from_a_cgroupfs_one() {
    for systemd in [
        "kubepods-besteffort-pod0a1b.slice:cri-containerd:4f3e",
        "system.slice:gpuplex:c1",
        ":cri-containerd:c1",
        "kubepods.slice::c1",
    ] {
        assert!(is_systemd_cgroups_path(systemd), "{systemd}");
    }
    for cgroupfs in [
        "/default/c1",
        "/kubepods/besteffort/pod0a1b/4f3e",
        "kubepods/c1",
        "a:b:c",
        ".slice:p:c",
        "kubepods.slice:cri-containerd:",
        "kubepods.slice:cri/containerd:c1",
        "/kubepods.slice:cri-containerd:c1",
        "kubepods.slice:cri-containerd:c1:extra",
        "",
    ] {
        assert!(!is_systemd_cgroups_path(cgroupfs), "{cgroupfs}");
    }
}

#[test]
fn the_systemd_driver_follows_a_systemd_cgroups_path_and_never_turns_off() {
    let slice = Some("kubepods-besteffort-pod0a1b.slice:cri-containerd:4f3e");
    assert!(
        RuntimeOptions::default()
            .for_cgroups_path(slice)
            .systemd_cgroup
    );
    assert!(
        !RuntimeOptions::default()
            .for_cgroups_path(Some("/default/c1"))
            .systemd_cgroup
    );
    assert!(
        !RuntimeOptions::default()
            .for_cgroups_path(None)
            .systemd_cgroup
    );
    let told = RuntimeOptions {
        systemd_cgroup: true,
        ..RuntimeOptions::default()
    };
    assert!(
        told.clone()
            .for_cgroups_path(Some("/default/c1"))
            .systemd_cgroup
    );
    assert!(told.for_cgroups_path(None).systemd_cgroup);
}
