//! Scenario parsing: the happy path, and every bad key or value with its one-line message.

use super::*;

const GOOD: &str = r#"
duration = "60s"
seed = 7
sample_interval = "20ms"

[scheduler]
slice = "100ms"

[[gpu]]
model = "NVIDIA A100-SXM4-40GB"
memory = "40Gi"

[[gpu]]
model = "NVIDIA L4"
memory = "24Gi"

[[container]]
name = "train-a"
annotations = { "gpuplex.io/weight" = "2", "gpuplex.io/gpu-memory" = "8Gi", "other.io/x" = "y" }
start = "1s"
stop = "30s"
demand = "busy"

[[container]]
name = "idle"
annotations = { "gpuplex.io/priority" = "low" }
demand = "idle"

[[container]]
name = "periodic"
annotations = { "gpuplex.io/gpus" = "2" }
demand = { on = "2s", off = "3s" }

[[container]]
name = "bursty"
annotations = { "gpuplex.io/priority" = "high" }
demand = { on_mean = "500ms", off_mean = "1.5s" }
"#;

fn parse(text: &str) -> Result<Scenario, ScenarioError> {
    Scenario::parse(text, "s.toml")
}

/// The error message of `GOOD` with `from` replaced by `to`.
fn error_with(from: &str, to: &str) -> String {
    assert!(GOOD.contains(from), "{from}");
    let text = GOOD.replacen(from, to, 1);
    match parse(&text) {
        Ok(_) => panic!("accepted: {from} -> {to}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn reads_every_key() {
    let s = parse(GOOD).unwrap();
    assert_eq!(s.origin, "s.toml");
    assert_eq!(s.duration, Duration::from_secs(60));
    assert_eq!(s.seed, 7);
    assert_eq!(s.sample_interval, Duration::from_millis(20));
    assert_eq!(s.scheduler.slice, Duration::from_millis(100));
    assert_eq!(
        s.scheduler.idle_grace,
        SchedulerConfig::default().idle_grace
    );
    assert_eq!(s.gpus.len(), 2);
    assert_eq!(s.gpus[1].model, "NVIDIA L4");
    assert_eq!(s.gpus[1].memory, 24 << 30);
    let names: Vec<&str> = s.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["train-a", "idle", "periodic", "bursty"]);
    let a = &s.containers[0];
    assert_eq!(a.request.weight, 2);
    assert_eq!(a.request.memory, crate::request::GpuMemory::Bytes(8 << 30));
    assert_eq!(a.start, Instant::from_nanos(1_000_000_000));
    assert_eq!(a.stop, Instant::from_nanos(30_000_000_000));
    assert_eq!(a.demand, Demand::Busy);
    let idle = &s.containers[1];
    assert_eq!(
        (idle.start, idle.stop),
        (Instant::ZERO, Instant::from_nanos(60_000_000_000))
    );
    assert_eq!(idle.demand, Demand::Idle);
    assert_eq!(s.containers[2].request.gpus, 2);
    assert_eq!(
        s.containers[2].demand,
        Demand::Periodic {
            on: Duration::from_secs(2),
            off: Duration::from_secs(3)
        }
    );
    assert_eq!(
        s.containers[3].demand,
        Demand::Exponential {
            on_mean: Duration::from_millis(500),
            off_mean: Duration::from_millis(1500)
        }
    );
}

#[test]
fn defaults_apply() {
    let text = r#"
duration = "1s"
[[gpu]]
model = "m"
memory = "1Gi"
[[container]]
name = "a"
annotations = { "gpuplex.io/weight" = "1" }
demand = "busy"
"#;
    let s = parse(text).unwrap();
    assert_eq!(s.seed, 0);
    assert_eq!(s.sample_interval, DEFAULT_SAMPLE_INTERVAL);
    assert_eq!(s.scheduler, SchedulerConfig::default());
}

#[test]
fn every_mistake_is_one_line_naming_the_key() {
    // (replace this, with that, and the message must contain all of these)
    let cases: &[(&str, &str, &[&str])] = &[
        // The TOML reader's own errors, with a line number.
        ("seed = 7", "sed = 7", &["s.toml: line 3: unknown field `sed`", "`duration`"]),
        ("demand = \"busy\"", "deman = \"busy\"", &["line 22: unknown field `deman`", "`demand`"]),
        ("memory = \"24Gi\"", "memory = \"24Gi\"\nvram = 1", &["line 16: unknown field `vram`", "`model`"]),
        ("slice = \"100ms\"", "slise = \"100ms\"", &["line 7: unknown field `slise`"]),
        ("slice = \"100ms\"", "slice = \"fast\"", &["line 7: scheduler.slice: `fast` is not a duration"]),
        ("duration = \"60s\"", "duration = 60s", &["s.toml: line 2: duration: expected newline"]),
        ("[[gpu]]\nmodel = \"NVIDIA L4\"", "[gpu]\nmodel = \"NVIDIA L4\"", &["s.toml: line"]),
        // Top-level values.
        ("duration = \"60s\"", "", &["duration: required, like `duration = \"60s\"`"]),
        ("duration = \"60s\"", "duration = \"a minute\"", &["duration: `a minute` is not a duration"]),
        ("duration = \"60s\"", "duration = 60", &["duration: `60` is not a duration", "string with a unit"]),
        ("duration = \"60s\"", "duration = \"0s\"", &["duration: must be longer than zero"]),
        ("seed = 7", "seed = -1", &["seed: `-1` is not a seed", "whole number from 0"]),
        ("seed = 7", "seed = \"7\"", &["seed: `\"7\"` is not a seed"]),
        ("sample_interval = \"20ms\"", "sample_interval = \"0ms\"", &["sample_interval: must be longer than zero"]),
        ("sample_interval = \"20ms\"", "sample_interval = \"often\"", &["sample_interval: `often` is not a duration"]),
        ("slice = \"100ms\"", "slice = \"0s\"", &["scheduler.slice", "is not accepted"]),
        // GPUs.
        ("model = \"NVIDIA L4\"\n", "", &["gpu 1: model: required"]),
        ("model = \"NVIDIA L4\"", "model = 4", &["gpu 1: model: `4` is not a model name"]),
        ("model = \"NVIDIA L4\"", "model = \" \"", &["gpu 1: model:"]),
        ("memory = \"24Gi\"\n", "", &["gpu 1: memory: required, like `memory = \"40Gi\"`"]),
        ("memory = \"24Gi\"", "memory = \"24GB\"", &["gpu 1: memory: `24GB`", "Kubernetes unit"]),
        ("memory = \"24Gi\"", "memory = 24", &["gpu 1: memory: `24` is not a quantity"]),
        ("memory = \"24Gi\"", "memory = \"0\"", &["gpu 1: memory: `0`"]),
        // Containers.
        ("name = \"idle\"\n", "", &["container 2: name: required"]),
        ("name = \"idle\"", "name = \"\"", &["container 2: name: `\"\"` is not a name"]),
        ("name = \"idle\"", "name = \"train-a\"", &["container `train-a`: name: used twice"]),
        ("start = \"1s\"", "start = \"soon\"", &["container `train-a`: start: `soon` is not a duration"]),
        ("stop = \"30s\"", "stop = \"61s\"", &["container `train-a`: stop: 61s is after the scenario's end (60s)"]),
        ("stop = \"30s\"", "stop = \"1s\"", &["container `train-a`: start: 1s is not before stop (1s)"]),
        ("stop = \"30s\"", "stop = 30", &["container `train-a`: stop: `30` is not a duration"]),
        (
            "annotations = { \"gpuplex.io/priority\" = \"low\" }",
            "annotations = { \"other.io/x\" = \"1\" }",
            &["container `idle`: annotations: ask for a vGPU with at least one `gpuplex.io/` annotation"],
        ),
        (
            "annotations = { \"gpuplex.io/priority\" = \"low\" }\n",
            "",
            &["container `idle`: annotations: ask for a vGPU"],
        ),
        (
            "annotations = { \"gpuplex.io/priority\" = \"low\" }",
            "annotations = \"low\"",
            &["container `idle`: annotations: `\"low\"` is not a table"],
        ),
        (
            "\"gpuplex.io/weight\" = \"2\"",
            "\"gpuplex.io/weight\" = 2",
            &["container `train-a`: annotations: `gpuplex.io/weight` = 2 is not a string", "\"gpuplex.io/weight\" = \"2\""],
        ),
        (
            "\"gpuplex.io/weight\" = \"2\"",
            "\"gpuplex.io/weight\" = \"0\"",
            &["container `train-a`: annotation gpuplex.io/weight=`0` is invalid"],
        ),
        (
            "\"gpuplex.io/weight\" = \"2\"",
            "\"gpuplex.io/wieght\" = \"2\"",
            &["container `train-a`: annotation gpuplex.io/wieght=`2` is not a gpuplex annotation"],
        ),
        ("demand = \"idle\"\n", "", &["container `idle`: demand: required; write \"busy\", \"idle\""]),
        ("demand = \"idle\"", "demand = \"lazy\"", &["container `idle`: demand: `\"lazy\"` is not a demand", "on_mean"]),
        ("demand = \"idle\"", "demand = 3", &["container `idle`: demand: `3` is not a demand"]),
        (
            "demand = { on = \"2s\", off = \"3s\" }",
            "demand = { on = \"2s\" }",
            &["container `periodic`: demand: `{ on = \"2s\" }` needs both `on` and `off`, `on_mean` and `off_mean`, or `work_mean` and `gap_mean`"],
        ),
        (
            "demand = { on = \"2s\", off = \"3s\" }",
            "demand = { on = \"2s\", off_mean = \"3s\" }",
            &["container `periodic`: demand:", "needs both `on` and `off`"],
        ),
        (
            "demand = { on = \"2s\", off = \"3s\" }",
            "demand = { on = \"2s\", of = \"3s\" }",
            &["container `periodic`: demand: unknown key `of`", "on_mean"],
        ),
        (
            "demand = { on = \"2s\", off = \"3s\" }",
            "demand = { on = \"0s\", off = \"3s\" }",
            &["container `periodic`: demand: on: must be longer than zero"],
        ),
        (
            "demand = { on = \"2s\", off = \"3s\" }",
            "demand = { on = 2, off = \"3s\" }",
            &["container `periodic`: demand: on: `2` is not a duration"],
        ),
        (
            "demand = { on_mean = \"500ms\", off_mean = \"1.5s\" }",
            "demand = { on_mean = \"500ms\", off_mean = \"long\" }",
            &["container `bursty`: demand: off_mean: `long` is not a duration"],
        ),
    ];
    let mut wrong = Vec::new();
    for (from, to, expected) in cases {
        let message = error_with(from, to);
        eprintln!("{message}");
        let one_line = message.starts_with("s.toml: ") && !message.contains('\n');
        if !one_line || !expected.iter().all(|part| message.contains(part)) {
            wrong.push(format!(
                "{from} -> {to}:\n  got {message}\n  want {expected:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn needs_gpus_and_containers() {
    let no_gpu = "duration = \"1s\"\n[[container]]\nname = \"a\"\ndemand = \"busy\"\n";
    let e = parse(no_gpu).unwrap_err().to_string();
    assert!(
        e.starts_with("s.toml: no [[gpu]]: declare one or more"),
        "{e}"
    );
    let no_container = "duration = \"1s\"\n[[gpu]]\nmodel = \"m\"\nmemory = \"1Gi\"\n";
    let e = parse(no_container).unwrap_err().to_string();
    assert!(
        e.starts_with("s.toml: no [[container]]: declare one or more"),
        "{e}"
    );
}

#[test]
fn durations_show_in_seconds_from_one_second() {
    assert_eq!(show(Duration::from_millis(61_500)), "61.5s");
    assert_eq!(show(Duration::from_millis(200)), "200ms");
}
