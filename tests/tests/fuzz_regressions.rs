//! Replays the fuzz targets' kept inputs (`fuzz/regressions/<target>/`: seeds, and every input a
//! fuzzer found something with, once fixed) through the targets' own bodies, on stable Rust and
//! without root. `make fuzz` looks for new ones (nightly, cargo-fuzz).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

#[path = "../../fuzz/src/bodies.rs"]
mod bodies;

fn regressions() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions")
}

/// The files of one target's directory, sorted.
fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = regressions().join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_kept_input_replays_without_a_finding() {
    let mut failed = Vec::new();
    for (target, body) in bodies::TARGETS {
        let files = inputs(target);
        assert!(
            files.len() >= 3,
            "fuzz/regressions/{target}/ has {} inputs; keep the seeds",
            files.len()
        );
        for file in files {
            let data = std::fs::read(&file).expect("read a kept input");
            if catch_unwind(AssertUnwindSafe(|| body(&data))).is_err() {
                failed.push(format!("{target}: {}", file.display()));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "inputs that fail their target again (the panic of each is above):\n{}",
        failed.join("\n")
    );
}

#[test]
fn every_target_has_a_directory_and_nothing_else_does() {
    let mut dirs: Vec<String> = std::fs::read_dir(regressions())
        .expect("fuzz/regressions/")
        .map(|entry| entry.expect("a directory entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut targets: Vec<String> = bodies::TARGETS.iter().map(|(t, _)| t.to_string()).collect();
    targets.sort();
    assert_eq!(dirs, targets);
}

#[test]
fn annotations_are_decoded_from_separated_records() {
    assert_eq!(
        bodies::decode_annotations(b"a\xfe1\xffb\xff\xfec\nd"),
        [("a", "1"), ("b", ""), ("", "c\nd")].map(|(k, v)| (k.to_string(), v.to_string()))
    );
}
