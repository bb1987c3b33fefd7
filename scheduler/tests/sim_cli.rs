//! The `gpuplex-sim` binary, run for real: every showcase scenario, the weights demo's shares,
//! determinism, the timeline, and the error contract (one line on stderr, exit code 2).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const SCENARIOS: [&str; 6] = [
    "weights.toml",
    "bursty.toml",
    "priorities.toml",
    "multi-gpu.toml",
    "fleet.toml",
    "inference-beside-training.toml",
];

fn scenario(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(name)
}

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuplex-sim"))
        .args(args)
        .output()
        .expect("gpuplex-sim runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8 output")
}

/// Runs a scenario and returns its report, parsed and as printed, after checking it succeeded
/// quietly.
fn report_and_text(name: &str) -> (Value, String) {
    let path = scenario(name);
    let output = sim(&[path.to_str().unwrap()]);
    assert!(output.status.success(), "{name}: {output:?}");
    assert!(
        output.stderr.is_empty(),
        "{name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = stdout(&output);
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
    (value, text)
}

fn report(name: &str) -> Value {
    report_and_text(name).0
}

/// The keys of the pretty-printed JSON at this indentation, in printed order.
fn keys_at_indent(text: &str, indent: usize) -> Vec<String> {
    text.lines()
        .filter(|l| l.len() > indent && l[..indent].bytes().all(|b| b == b' '))
        .filter_map(|l| l[indent..].strip_prefix('"'))
        .filter_map(|l| l.split_once("\":").map(|(key, _)| key.to_string()))
        .collect()
}

fn number(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

#[test]
fn every_showcase_scenario_reports_the_expected_shape() {
    const CONTAINER_KEYS: [&str; 20] = [
        "name",
        "gpus",
        "weight",
        "priority",
        "gpu_seconds",
        "demand_seconds",
        "share",
        "wait_seconds",
        "wait_p50",
        "wait_p95",
        "wait_p99",
        "max_wait",
        "windows",
        "bursts",
        "burst_wait_p50",
        "burst_wait_p99",
        "bursts_begun_frozen",
        "running_burst_wait_p99",
        "bursts_unwindowed",
        "rejected",
    ];
    for name in SCENARIOS {
        let text = std::fs::read_to_string(scenario(name)).unwrap();
        assert!(
            text.starts_with("# "),
            "{name} must start with a comment saying what it shows"
        );
        let (r, printed) = report_and_text(name);
        let top = keys_at_indent(&printed, 2);
        assert_eq!(
            top,
            ["duration", "seed", "containers", "gpus"],
            "{name}: key order"
        );
        // Containers and GPUs are the objects at indentation 6: each container's keys in order.
        let nested = keys_at_indent(&printed, 6);
        let first_gpu = nested.iter().position(|k| k == "index").unwrap();
        for keys in
            nested[..first_gpu].split_inclusive(|k| k == "bursts_unwindowed" || k == "rejected")
        {
            if keys != ["rejected"] {
                assert_eq!(keys, &CONTAINER_KEYS[..19], "{name}: container key order");
            }
        }
        for keys in nested[first_gpu..].chunks(5) {
            assert_eq!(
                keys,
                [
                    "index",
                    "model",
                    "busy_fraction",
                    "busy_while_wanted",
                    "switches"
                ],
                "{name}"
            );
        }
        let duration = number(&r, "duration");
        assert!(duration > 0.0);
        let gpus = r["gpus"].as_array().unwrap();
        assert!(!gpus.is_empty());
        for (i, gpu) in gpus.iter().enumerate() {
            assert_eq!(gpu["index"], i, "{name}");
            assert!(gpu["model"].is_string());
            assert!(
                (0.0..=1.0).contains(&number(gpu, "busy_fraction")),
                "{name}: {gpu}"
            );
            assert!(gpu["switches"].is_u64());
        }
        let containers = r["containers"].as_array().unwrap();
        assert!(!containers.is_empty());
        for c in containers {
            let mut keys: Vec<&str> = c.as_object().unwrap().keys().map(String::as_str).collect();
            let mut expected = CONTAINER_KEYS[..19].to_vec();
            keys.sort_unstable();
            expected.sort_unstable();
            assert_eq!(keys, expected, "{name}: {c}");
            assert!(c.get("rejected").is_none(), "{name}: {c} fits its GPUs");
            let assigned = c["gpus"].as_array().unwrap();
            assert!(
                !assigned.is_empty()
                    && assigned
                        .iter()
                        .all(|g| g.as_u64() < Some(gpus.len() as u64))
            );
            let demand = number(c, "demand_seconds");
            assert!((0.0..=duration).contains(&demand), "{name}: {c}");
            assert!(number(c, "gpu_seconds") <= demand * assigned.len() as f64 + 1e-6);
            match c["share"].as_f64() {
                Some(share) => assert!((0.0..=1.0).contains(&share), "{name}: {c}"),
                None => assert_eq!(demand, 0.0, "{name}: share is null only without demand"),
            }
            let waits = ["wait_p50", "wait_p95", "wait_p99", "max_wait"].map(|k| number(c, k));
            assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{name}: {c}");
            assert!(number(c, "wait_seconds") >= waits[3]);
            assert!(c["windows"].is_u64());
        }
    }
}

#[test]
fn weights_give_shares_of_one_two_and_three_sixths() {
    let r = report("weights.toml");
    let containers = r["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 3);
    for c in containers {
        let expected = c["weight"].as_f64().unwrap() / 6.0;
        let share = number(c, "share");
        assert!(
            (share - expected).abs() <= 0.03,
            "{}: share {share}, expected {expected}",
            c["name"]
        );
        assert_eq!(c["gpus"], serde_json::json!([0]));
    }
    assert!(number(&r["gpus"][0], "busy_fraction") > 0.99);
}

#[test]
fn idle_containers_are_never_frozen() {
    let r = report("bursty.toml");
    let idle = r["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "idle-server")
        .expect("bursty.toml has idle-server");
    assert_eq!(number(idle, "wait_seconds"), 0.0);
    assert_eq!(number(idle, "gpu_seconds"), 0.0);
    assert!(idle["share"].is_null());
}

#[test]
fn high_priority_is_never_frozen_and_low_only_backfills() {
    let r = report("priorities.toml");
    let find = |name: &str| {
        r["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap()
    };
    let urgent = find("urgent");
    assert_eq!(urgent["priority"], "high");
    assert_eq!(number(&urgent, "wait_seconds"), 0.0);
    assert!(number(&urgent, "share") > 0.9);
    let backfill = find("backfill");
    assert!(number(&backfill, "wait_seconds") > number(&find("steady"), "wait_seconds"));
}

#[test]
fn the_same_seed_gives_identical_output() {
    for name in ["bursty.toml", "fleet.toml"] {
        let path = scenario(name);
        let first = sim(&[path.to_str().unwrap()]);
        let second = sim(&[path.to_str().unwrap()]);
        assert!(first.status.success());
        assert_eq!(first.stdout, second.stdout, "{name}: two runs differ");
    }
    // And the seed matters: the same scenario with another seed draws other bursts.
    let text = std::fs::read_to_string(scenario("bursty.toml")).unwrap();
    let reseeded = text.replace("seed = 7", "seed = 8");
    assert_ne!(text, reseeded);
    let path = temp_file("bursty-seed-8.toml", &reseeded);
    let other = sim(&[path.to_str().unwrap()]);
    assert!(other.status.success());
    let first = sim(&[scenario("bursty.toml").to_str().unwrap()]);
    assert_ne!(first.stdout, other.stdout);
}

#[test]
fn the_timeline_draws_every_gpu_and_container() {
    let path = scenario("weights.toml");
    let output = sim(&["--timeline", path.to_str().unwrap()]);
    assert!(output.status.success(), "{output:?}");
    let text = stdout(&output);
    assert!(text.contains("one column = 200ms"), "{text}");
    assert!(text.contains("GPU 0  NVIDIA A100-SXM4-40GB"), "{text}");
    for name in ["light", "medium", "heavy"] {
        let row = text
            .lines()
            .find(|l| l.trim_start().starts_with(name) && l.contains('│'))
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"));
        let cells: String = row.split('│').nth(1).unwrap().chars().collect();
        assert_eq!(cells.chars().count(), 100, "{row}");
        assert!(cells.contains('█') && cells.contains('·'), "{row}");
    }
    assert!(
        text.contains("0s") && text.contains("20s"),
        "time axis: {text}"
    );
    assert!(
        text.contains("container") && text.contains("p95 wait"),
        "table: {text}"
    );

    let coarse = sim(&["--timeline", "--resolution", "1s", path.to_str().unwrap()]);
    let text = stdout(&coarse);
    let row = text
        .lines()
        .find(|l| l.contains("heavy") && l.contains('│'))
        .unwrap();
    assert_eq!(row.split('│').nth(1).unwrap().chars().count(), 20, "{row}");
}

#[test]
fn help_prints_usage() {
    let output = sim(&["--help"]);
    assert!(output.status.success());
    assert!(stdout(&output).contains("--timeline"));
}

fn temp_file(name: &str, text: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs the binary expecting failure: returns (exit code, the one stderr line).
fn failure(args: &[&str]) -> (i32, String) {
    let output = sim(args);
    assert!(output.stdout.is_empty(), "{args:?}: {output:?}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?}: not one line: {stderr}"
    );
    assert!(stderr.starts_with("gpuplex-sim: "), "{stderr}");
    (output.status.code().unwrap(), stderr.trim_end().to_string())
}

#[test]
fn a_bad_scenario_exits_2_with_one_line_naming_the_key() {
    let good = std::fs::read_to_string(scenario("weights.toml")).unwrap();
    let cases = [
        (
            "demand = \"busy\"",
            "deman = \"busy\"",
            "unknown field `deman`",
        ),
        (
            "demand = \"busy\"",
            "demand = { on = \"2s\" }",
            "container `light`: demand:",
        ),
        (
            "\"gpuplex.io/weight\" = \"1\"",
            "\"gpuplex.io/weight\" = \"0\"",
            "container `light`: annotation gpuplex.io/weight=`0`",
        ),
        (
            "duration = \"20s\"",
            "duration = \"twenty\"",
            "duration: `twenty`",
        ),
        (
            "memory = \"40Gi\"",
            "memory = \"40GB\"",
            "gpu 0: memory: `40GB`",
        ),
    ];
    for (i, (from, to, expected)) in cases.iter().enumerate() {
        assert!(good.contains(from), "{from}");
        let path = temp_file(&format!("bad-{i}.toml"), &good.replacen(from, to, 1));
        let (code, line) = failure(&[path.to_str().unwrap()]);
        assert_eq!(code, 2, "{line}");
        assert!(
            line.contains(path.to_str().unwrap()),
            "names the file: {line}"
        );
        assert!(line.contains(expected), "{line}\nlacks {expected}");
    }
}

#[test]
fn usage_errors_exit_2_and_io_errors_exit_1() {
    let (code, line) = failure(&["--bogus"]);
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("unknown option `--bogus`"), "{line}");
    let (code, line) = failure(&[]);
    assert_eq!(code, 2, "{line}");
    let weights = scenario("weights.toml");
    let (code, line) = failure(&[
        "--timeline",
        "--resolution",
        "1us",
        weights.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("--resolution 1us"), "{line}");
    let (code, line) = failure(&["/nonexistent/scenario.toml"]);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("/nonexistent/scenario.toml"), "{line}");
}
