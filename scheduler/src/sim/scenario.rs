//! Scenario files: what the simulator replays.
//!
//! ```toml
//! duration = "60s"          # required
//! seed = 7                  # optional, default 0
//! sample_interval = "50ms"  # optional, default 50ms
//! [scheduler]               # optional: gpuplex.toml's [scheduler] section
//! slice = "200ms"
//! [[gpu]]                   # one or more; index = position in the file
//! model = "NVIDIA A100-SXM4-40GB"
//! memory = "40Gi"
//! [[container]]             # one or more
//! name = "train-a"
//! annotations = { "gpuplex.io/weight" = "2", "gpuplex.io/gpu-memory" = "8Gi" }
//! start = "0s"              # optional, default 0s
//! stop = "60s"              # optional, default: the duration
//! demand = "busy"           # "busy" | "idle" | { on, off } | { on_mean, off_mean }
//!                           # | { work_mean, gap_mean }: bursts of work, closed loop
//! ```
//!
//! Every key is checked; a mistake is reported as one line that names the key and says what is
//! accepted.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use toml::Value;

use super::demand::Demand;
use crate::config::SchedulerConfig;
use crate::quantity::parse_quantity;
use crate::request::VgpuRequest;
use crate::time::{format_duration, parse_duration};
use crate::toml_place::TomlPlace;
use crate::Instant;

/// How often the node service samples activity unless told otherwise.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(50);

/// A scenario, read and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// Where it was read from (a file name), for messages.
    pub origin: String,
    /// How much virtual time to replay.
    pub duration: Duration,
    /// Seed of the exponential demand draws.
    pub seed: u64,
    /// How often activity is sampled.
    pub sample_interval: Duration,
    /// The scheduler's settings.
    pub scheduler: SchedulerConfig,
    /// The node's GPUs; GPU `i` is the `i`-th.
    pub gpus: Vec<GpuSpec>,
    /// The containers, in file order.
    pub containers: Vec<ContainerSpec>,
}

/// One simulated GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSpec {
    /// Model name, as NVML would report it.
    pub model: String,
    /// Memory in bytes.
    pub memory: u64,
}

/// One simulated container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerSpec {
    /// Its name, unique in the scenario.
    pub name: String,
    /// Its annotations, as written.
    pub annotations: BTreeMap<String, String>,
    /// Its vGPU request, parsed from its annotations.
    pub request: VgpuRequest,
    /// When it is created.
    pub start: Instant,
    /// When it exits.
    pub stop: Instant,
    /// When it wants the GPU.
    pub demand: Demand,
}

/// A scenario that could not be read: one line, naming the file, the key and what is accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScenarioError {
    /// Where the scenario came from.
    pub origin: String,
    /// The line, when the TOML reader knows it.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}: line {line}: {}", self.origin, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for ScenarioError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    duration: Option<Value>,
    seed: Option<Value>,
    sample_interval: Option<Value>,
    scheduler: Option<SchedulerConfig>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
    #[serde(default)]
    container: Vec<RawContainer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    model: Option<Value>,
    memory: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawContainer {
    name: Option<Value>,
    annotations: Option<Value>,
    start: Option<Value>,
    stop: Option<Value>,
    demand: Option<Value>,
}

const DEMAND_FORMS: &str = r#"write "busy", "idle", { on = "2s", off = "3s" }, { on_mean = "2s", off_mean = "3s" } or { work_mean = "200ms", gap_mean = "2s" }"#;

impl Scenario {
    /// Reads a scenario from TOML text; `origin` (a file name) starts every error message.
    pub fn parse(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
        let fail = |message: String| ScenarioError {
            origin: origin.to_string(),
            line: None,
            message,
        };
        let raw: RawScenario = toml::from_str(text).map_err(|e| {
            let TomlPlace { line, key, message } = TomlPlace::of(text, &e);
            ScenarioError {
                origin: origin.to_string(),
                line,
                message: match key {
                    Some(key) if !message.contains(&format!("`{}`", last_segment(&key))) => {
                        format!("{key}: {message}")
                    }
                    _ => message,
                },
            }
        })?;

        let duration = match raw.duration {
            Some(value) => duration_of("duration", &value).map_err(fail)?,
            None => {
                return Err(fail(
                    r#"duration: required, like `duration = "60s"`"#.into(),
                ))
            }
        };
        if duration.is_zero() {
            return Err(fail("duration: must be longer than zero".into()));
        }
        let seed = match raw.seed {
            None => 0,
            Some(Value::Integer(n)) if n >= 0 => n as u64,
            Some(other) => {
                return Err(fail(format!(
                    "seed: `{other}` is not a seed: write a whole number from 0 up, like `seed = 7`"
                )))
            }
        };
        let sample_interval = match raw.sample_interval {
            Some(value) => duration_of("sample_interval", &value).map_err(fail)?,
            None => DEFAULT_SAMPLE_INTERVAL,
        };
        if sample_interval.is_zero() {
            return Err(fail("sample_interval: must be longer than zero".into()));
        }
        let scheduler = raw.scheduler.unwrap_or_default();
        // Its messages name the key already (`scheduler.slice = "0s" is not accepted: ...`).
        scheduler.validate().map_err(|e| fail(e.to_string()))?;

        if raw.gpu.is_empty() {
            return Err(fail(
                r#"no [[gpu]]: declare one or more, like `[[gpu]]` with `model = "NVIDIA A100-SXM4-40GB"` and `memory = "40Gi"`"#.into(),
            ));
        }
        let gpus = raw
            .gpu
            .iter()
            .enumerate()
            .map(|(index, gpu)| gpu_of(index, gpu).map_err(fail))
            .collect::<Result<Vec<_>, _>>()?;

        if raw.container.is_empty() {
            return Err(fail(
                r#"no [[container]]: declare one or more, like `[[container]]` with `name = "train-a"` and `annotations = { "gpuplex.io/weight" = "1" }`"#.into(),
            ));
        }
        let end = Instant::from_duration(duration);
        let mut names = HashSet::new();
        let mut containers = Vec::with_capacity(raw.container.len());
        for (position, container) in raw.container.iter().enumerate() {
            let spec = container_of(position, container, end).map_err(fail)?;
            if !names.insert(spec.name.clone()) {
                return Err(fail(format!(
                    "container `{}`: name: used twice; give each container its own name",
                    spec.name
                )));
            }
            containers.push(spec);
        }

        Ok(Scenario {
            origin: origin.to_string(),
            duration,
            seed,
            sample_interval,
            scheduler,
            gpus,
            containers,
        })
    }
}

fn last_segment(key: &str) -> &str {
    key.rsplit('.').next().unwrap_or(key)
}

/// A duration for messages: seconds from 1 s up (`61s`, `1.5s`), else the short form (`200ms`).
fn show(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format_duration(d);
    }
    let text = format!("{:.3}", d.as_secs_f64());
    format!("{}s", text.trim_end_matches('0').trim_end_matches('.'))
}

fn duration_of(key: &str, value: &Value) -> Result<Duration, String> {
    match value {
        Value::String(text) => parse_duration(text).map_err(|e| format!("{key}: {e}")),
        other => Err(format!(
            r#"{key}: `{other}` is not a duration: write it as a string with a unit, like `{key} = "2s"`"#
        )),
    }
}

fn gpu_of(index: usize, raw: &RawGpu) -> Result<GpuSpec, String> {
    let model = match &raw.model {
        Some(Value::String(model)) if !model.trim().is_empty() => model.clone(),
        Some(other) => {
            return Err(format!(
                r#"gpu {index}: model: `{other}` is not a model name: write a string, like `model = "NVIDIA A100-SXM4-40GB"`"#
            ))
        }
        None => {
            return Err(format!(
                r#"gpu {index}: model: required, like `model = "NVIDIA A100-SXM4-40GB"`"#
            ))
        }
    };
    let memory = match &raw.memory {
        Some(Value::String(text)) => {
            parse_quantity(text).map_err(|e| format!("gpu {index}: memory: {e}"))?
        }
        Some(other) => {
            return Err(format!(
                r#"gpu {index}: memory: `{other}` is not a quantity: write a string, like `memory = "40Gi"`"#
            ))
        }
        None => {
            return Err(format!(
                r#"gpu {index}: memory: required, like `memory = "40Gi"`"#
            ))
        }
    };
    if memory == 0 {
        return Err(format!("gpu {index}: memory: must be more than zero bytes"));
    }
    Ok(GpuSpec { model, memory })
}

fn container_of(
    position: usize,
    raw: &RawContainer,
    end: Instant,
) -> Result<ContainerSpec, String> {
    let name = match &raw.name {
        Some(Value::String(name)) if !name.trim().is_empty() => name.clone(),
        Some(other) => {
            return Err(format!(
                r#"container {}: name: `{other}` is not a name: write a non-empty string, like `name = "train-a"`"#,
                position + 1
            ))
        }
        None => {
            return Err(format!(
                r#"container {}: name: required, like `name = "train-a"`"#,
                position + 1
            ))
        }
    };
    let instant = |key: &str, value: &Option<Value>| -> Result<Option<Instant>, String> {
        value
            .as_ref()
            .map(|v| duration_of(key, v).map(Instant::from_duration))
            .transpose()
            .map_err(|e| format!("container `{name}`: {e}"))
    };
    let start = instant("start", &raw.start)?.unwrap_or(Instant::ZERO);
    let stop = instant("stop", &raw.stop)?.unwrap_or(end);
    let show = |t: Instant| show(t.since_origin());
    if stop > end {
        return Err(format!(
            "container `{name}`: stop: {} is after the scenario's end ({}); stop at or before the duration",
            show(stop),
            show(end)
        ));
    }
    if start >= stop {
        return Err(format!(
            "container `{name}`: start: {} is not before stop ({}); start earlier or stop later",
            show(start),
            show(stop)
        ));
    }
    let annotations = annotations_of(raw.annotations.as_ref())
        .map_err(|e| format!("container `{name}`: annotations: {e}"))?;
    let request = VgpuRequest::from_annotations(
        annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
    )
    .map_err(|e| format!("container `{name}`: {e}"))?
    .ok_or_else(|| {
        format!(
            r#"container `{name}`: annotations: ask for a vGPU with at least one `gpuplex.io/` annotation, like `annotations = {{ "gpuplex.io/weight" = "1" }}`"#
        )
    })?;
    let demand = match &raw.demand {
        Some(value) => demand_of(value).map_err(|e| format!("container `{name}`: demand: {e}"))?,
        None => {
            return Err(format!(
                r#"container `{name}`: demand: required; {DEMAND_FORMS}"#
            ))
        }
    };
    Ok(ContainerSpec {
        name,
        annotations: annotations.into_iter().collect(),
        request,
        start,
        stop,
        demand,
    })
}

fn annotations_of(value: Option<&Value>) -> Result<Vec<(String, String)>, String> {
    let table = match value {
        None => return Ok(Vec::new()),
        Some(Value::Table(table)) => table,
        Some(other) => {
            return Err(format!(
                r#"`{other}` is not a table: write `annotations = {{ "gpuplex.io/weight" = "2" }}`"#
            ))
        }
    };
    table
        .iter()
        .map(|(key, value)| match value {
            Value::String(text) => Ok((key.clone(), text.clone())),
            other => Err(format!(
                r#"`{key}` = {other} is not a string: annotation values are strings, like `"{key}" = "{}"`"#,
                bare(other)
            )),
        })
        .collect()
}

/// A value without its TOML quoting, for suggesting the quoted form.
fn bare(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

fn demand_of(value: &Value) -> Result<Demand, String> {
    let table = match value {
        Value::String(text) if text == "busy" => return Ok(Demand::Busy),
        Value::String(text) if text == "idle" => return Ok(Demand::Idle),
        Value::Table(table) => table,
        other => return Err(format!("`{other}` is not a demand: {DEMAND_FORMS}")),
    };
    if let Some(key) = table.keys().find(|k| {
        !["on", "off", "on_mean", "off_mean", "work_mean", "gap_mean"].contains(&k.as_str())
    }) {
        return Err(format!("unknown key `{key}` in `{value}`: {DEMAND_FORMS}"));
    }
    let get = |key: &str| -> Result<Option<Duration>, String> {
        let Some(v) = table.get(key) else {
            return Ok(None);
        };
        let d = duration_of(key, v)?;
        if d.is_zero() {
            return Err(format!("{key}: must be longer than zero"));
        }
        Ok(Some(d))
    };
    let pairs = [
        (get("on")?, get("off")?),
        (get("on_mean")?, get("off_mean")?),
        (get("work_mean")?, get("gap_mean")?),
    ];
    match pairs {
        [(Some(on), Some(off)), (None, None), (None, None)] => Ok(Demand::Periodic { on, off }),
        [(None, None), (Some(on_mean), Some(off_mean)), (None, None)] => {
            Ok(Demand::Exponential { on_mean, off_mean })
        }
        [(None, None), (None, None), (Some(work_mean), Some(gap_mean))] => Ok(Demand::Work {
            work_mean,
            gap_mean,
        }),
        _ => Err(format!(
            "`{value}` needs both `on` and `off`, `on_mean` and `off_mean`, or `work_mean` and `gap_mean`"
        )),
    }
}

#[cfg(test)]
#[path = "scenario_tests.rs"]
mod tests;
