//! gpuplex's reader of CDI specs against the reference crate's (`container-device-interface`
//! 1.1: `parse_spec`, then `new_spec`), over a corpus of valid and invalid specs: both accept or
//! both refuse each, and that verdict is the one the corpus expects. The corpus is in
//! `agreement_corpus.rs`; where gpuplex is stricter on purpose, the last test here shows the
//! reference accepting what gpuplex refuses.

use std::fs;
use std::path::Path;

use container_device_interface::spec::{new_spec, parse_spec};
use serde_json::{json, Value};

use super::agreement_corpus::{corpus, Case, Text};
use super::spec;
use super::validate::{validate, EditFault, InvalidSpec};

/// gpuplex's verdict: parsed, then valid.
fn ours(text: &str) -> Result<(), String> {
    let parsed = spec::parse(text.as_bytes()).map_err(|err| err.to_string())?;
    validate(&parsed).map_err(|err| format!("not a valid CDI spec: {err}"))
}

/// The reference crate's verdict on the same text, written to `dir/spec.yaml`.
fn reference(dir: &Path, text: &str) -> Result<(), String> {
    let path = dir.join("spec.yaml");
    fs::write(&path, text).expect("write the spec");
    let raw = parse_spec(&path).map_err(|err| format!("{err:#}"))?;
    new_spec(&raw, &path, 0)
        .map(|_| ())
        .map_err(|err| format!("{err:#}"))
}

/// The corpus, each case built from JSON run twice: as JSON and as YAML.
fn texts() -> Vec<(String, String, bool)> {
    let mut texts = Vec::new();
    for Case { name, text, valid } in corpus() {
        match text {
            Text::Raw(raw) => texts.push((name, raw, valid)),
            Text::Built(value) => {
                let yaml = serde_norway::to_string(&value).expect("YAML of the case");
                texts.push((format!("{name} (JSON)"), value.to_string(), valid));
                texts.push((format!("{name} (YAML)"), yaml, valid));
            }
        }
    }
    texts
}

#[test]
fn gpuplex_and_the_reference_crate_accept_and_refuse_the_same_specs() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut failures = Vec::new();
    let texts = texts();
    for (name, text, valid) in &texts {
        let (ours, theirs) = (ours(text), reference(dir.path(), text));
        if ours.is_ok() != theirs.is_ok() || ours.is_ok() != *valid {
            failures.push(format!(
                "{name}: expected {}, gpuplex {ours:?}, reference {theirs:?}",
                if *valid { "valid" } else { "invalid" }
            ));
        }
        if let Err(message) = &ours {
            if message.contains('\n') || message.is_empty() {
                failures.push(format!(
                    "{name}: gpuplex's message is not one line: {message:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // the corpus has both kinds, in numbers
    let valid = texts.iter().filter(|(_, _, valid)| *valid).count();
    assert!(
        valid >= 100 && texts.len() - valid >= 200,
        "{valid} of {}",
        texts.len()
    );
}

/// A spec with one device `gpu0` whose edits are `edits`.
fn one_device(version: &str, edits: Value) -> String {
    json!({
        "cdiVersion": version,
        "kind": "vendor.com/device",
        "devices": [{"name": "gpu0", "containerEdits": edits}],
    })
    .to_string()
}

#[test]
fn where_gpuplex_is_stricter_than_the_reference_crate() {
    // The reference crate accepts each of these; gpuplex refuses them on purpose (see
    // validate.rs): relative device node and hook paths, and a version with two `v`s.
    let hook = |path: &str| json!({"hooks": [{"hookName": "createContainer", "path": path}]});
    let cases: Vec<(String, InvalidSpec)> = vec![
        (
            one_device("0.5.0", json!({"deviceNodes": [{"path": "dev/nvidia0"}]})),
            InvalidSpec::Edits {
                device: Some("gpu0".to_owned()),
                fault: EditFault::RelativeNodePath("dev/nvidia0".to_owned()),
            },
        ),
        (
            one_device(
                "0.5.0",
                json!({"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "nvidia0"}]}),
            ),
            InvalidSpec::Edits {
                device: Some("gpu0".to_owned()),
                fault: EditFault::RelativeHostPath {
                    path: "/dev/nvidia0".to_owned(),
                    host_path: "nvidia0".to_owned(),
                },
            },
        ),
        (
            one_device("0.5.0", hook("nvidia-cdi-hook")),
            InvalidSpec::Edits {
                device: Some("gpu0".to_owned()),
                fault: EditFault::RelativeHookPath {
                    hook_name: "createContainer".to_owned(),
                    path: "nvidia-cdi-hook".to_owned(),
                },
            },
        ),
        (
            one_device("vv1.0.0", json!({"env": ["A=1"]})),
            InvalidSpec::UnknownVersion("vv1.0.0".to_owned()),
        ),
    ];
    let dir = tempfile::tempdir().expect("temporary directory");
    for (text, expected) in cases {
        assert_eq!(reference(dir.path(), &text), Ok(()), "{text}");
        let parsed = spec::parse(text.as_bytes()).expect("parses");
        assert_eq!(validate(&parsed), Err(expected), "{text}");
    }
    // the same specs with absolute paths and one `v` pass both
    for text in [
        one_device("0.5.0", json!({"deviceNodes": [{"path": "/dev/nvidia0"}]})),
        one_device(
            "0.5.0",
            json!({"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}),
        ),
        one_device("0.5.0", hook("/usr/bin/nvidia-cdi-hook")),
        one_device("v1.0.0", json!({"env": ["A=1"]})),
    ] {
        assert_eq!(reference(dir.path(), &text), Ok(()), "{text}");
        assert_eq!(ours(&text), Ok(()), "{text}");
    }
}
