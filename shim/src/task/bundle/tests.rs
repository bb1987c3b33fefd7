//! The bundle's config.json read as a hostile file, and what the shim reads of the spec.

use super::*;
use serde_json::json;

fn bundle_with(config: &[u8]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(CONFIG), config).unwrap();
    dir
}

#[test]
fn a_regular_config_is_read_and_parsed_once() {
    let dir = bundle_with(br#"{"ociVersion": "1.0.2", "annotations": {"a": "b"}}"#);
    let spec = BundleSpec::read(dir.path()).unwrap();
    assert_eq!(spec.value["annotations"]["a"], "b");
    assert_eq!(spec.bytes, std::fs::read(dir.path().join(CONFIG)).unwrap());
}

#[test]
fn a_fifo_a_link_a_directory_or_a_huge_file_is_refused_in_one_line_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join(CONFIG);
    let outside = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(outside.path(), b"{}").unwrap();
    let plant: [(&str, &dyn Fn()); 5] = [
        ("No such file", &|| {}),
        ("not a regular file", &|| {
            nix::unistd::mkfifo(&config, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
        }),
        ("symbolic links", &|| {
            std::os::unix::fs::symlink(outside.path(), &config).unwrap()
        }),
        ("not a regular file", &|| {
            std::fs::create_dir(&config).unwrap()
        }),
        ("larger than", &|| {
            let file = File::create(&config).unwrap();
            file.set_len(SPEC_LIMIT + 1).unwrap();
        }),
    ];
    for (said, plant) in plant {
        let _ = std::fs::remove_file(&config);
        let _ = std::fs::remove_dir(&config);
        plant();
        let line = BundleSpec::read(dir.path()).unwrap_err().to_string();
        assert!(
            line.contains(said) && line.contains("config.json") && !line.contains('\n'),
            "{said}: {line}"
        );
    }
}

#[test]
fn a_config_that_is_not_json_is_refused_in_one_line_however_deep() {
    let deep = "[".repeat(100_000);
    for config in [&b"not json"[..], b"", b"{\"a\": ", deep.as_bytes()] {
        let dir = bundle_with(config);
        let e = BundleSpec::read(dir.path()).unwrap_err();
        assert!(matches!(e, BundleError::NotJson { .. }), "{e}");
        let line = e.to_string();
        assert!(
            line.contains("is not JSON") && !line.contains('\n'),
            "{line}"
        );
    }
}

#[test]
fn the_edited_spec_replaces_config_json_and_follows_no_planted_link() {
    let dir = bundle_with(b"{}");
    let victim = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(victim.path(), b"keep").unwrap();
    std::os::unix::fs::symlink(victim.path(), dir.path().join(CONFIG_EDITED)).unwrap();
    write_spec(dir.path(), br#"{"edited": true}"#).unwrap();
    assert_eq!(std::fs::read(victim.path()).unwrap(), b"keep");
    let spec = BundleSpec::read(dir.path()).unwrap();
    assert_eq!(spec.value, json!({"edited": true}));
    assert!(!dir.path().join(CONFIG_EDITED).exists());

    let gone = dir.path().join("gone");
    let line = write_spec(&gone, b"{}").unwrap_err().to_string();
    assert!(line.starts_with("cannot write ") && line.contains("gone/config.json"));
}

#[test]
fn init_shares_a_pid_namespace_unless_it_has_one_of_its_own() {
    let spec = |namespaces: Value| json!({"linux": {"namespaces": namespaces}});
    let cases = [
        (spec(json!([{"type": "pid"}, {"type": "mount"}])), false),
        (spec(json!([{"type": "pid", "path": ""}])), false),
        (
            spec(json!([{"type": "pid", "path": "/proc/1/ns/pid"}])),
            true,
        ),
        (spec(json!([{"type": "mount"}])), true),
        (spec(json!("pid")), true),
        (json!({}), true),
        (json!([]), true),
        (Value::Null, true),
    ];
    for (spec, shares) in cases {
        assert_eq!(shares_pid_namespace(&spec), shares, "{spec}");
    }
}

#[test]
fn the_cgroups_path_and_visible_devices_are_read_only_when_they_are_strings() {
    let spec = json!({
        "linux": {"cgroupsPath": "/kubepods/pod1/c1"},
        "process": {"env": ["PATH=/bin", 7, "CUDA_VISIBLE_DEVICES=GPU-1,GPU-2"]},
    });
    assert_eq!(cgroups_path(&spec), Some("/kubepods/pod1/c1"));
    assert_eq!(
        visible_devices(&spec).as_deref(),
        Some("CUDA_VISIBLE_DEVICES=GPU-1,GPU-2")
    );
    let odd = json!({"linux": {"cgroupsPath": 7}, "process": {"env": "CUDA_VISIBLE_DEVICES=0"}});
    assert_eq!(cgroups_path(&odd), None);
    assert_eq!(visible_devices(&odd), None);
}
