//! How the node service reads a request line: every bad line a one-line error.

use std::collections::BTreeMap;

use gpuplex_scheduler::node::{Attachment, Placement, ReleaseKey, Target};
use gpuplex_scheduler::units::UnitId;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::GpuIndex;
use serde::Deserialize;
use serde_json::Value;

use super::request::{ProtocolError, Request, MAX_LINE, OPERATIONS, STOP_SIGNALS};

/// Reads one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, ProtocolError> {
    if line.len() > MAX_LINE {
        return Err(ProtocolError::TooLong {
            len: line.len(),
            max: MAX_LINE,
        });
    }
    let value: Value =
        serde_json::from_slice(line).map_err(|e| ProtocolError::Json(e.to_string()))?;
    let Value::Object(mut fields) = value else {
        return Err(ProtocolError::Json(format!("got {}", json_kind(&value))));
    };
    let op = match fields.remove("op") {
        Some(Value::String(op)) => OPERATIONS
            .into_iter()
            .find(|o| *o == op)
            .ok_or_else(|| ProtocolError::UnknownOp(format!("`{op}`")))?,
        Some(other) => return Err(ProtocolError::UnknownOp(other.to_string())),
        None => return Err(ProtocolError::UnknownOp("(no \"op\")".into())),
    };
    let field = |message: String| ProtocolError::Field { op, message };
    let rest = Value::Object(fields);
    let read = |value: Value| -> Result<Fields, ProtocolError> {
        serde_json::from_value(value).map_err(|e| field(e.to_string()))
    };
    match op {
        "reserve" => {
            let f: ReserveFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Reserve {
                annotations: f.annotations,
            })
        }
        "attach" => {
            let f = read(rest)?;
            let handle = f
                .handle
                .as_deref()
                .ok_or_else(|| field("missing field `handle`".into()))?;
            let handle = handle.parse().map_err(|e| field(format!("handle: {e}")))?;
            let attachment = f.attachment().map_err(field)?;
            Ok(Request::Attach {
                handle,
                attachment,
                unstarted: f.unstarted,
                asked: f.annotations.unwrap_or_default(),
            })
        }
        "register" => {
            let f = read(rest)?;
            if f.handle.is_some() {
                return Err(field(
                    "unknown field `handle`: register reserves one".into(),
                ));
            }
            let attachment = f.attachment().map_err(field)?;
            Ok(Request::Register {
                annotations: f.annotations.unwrap_or_default(),
                attachment,
                unstarted: f.unstarted,
            })
        }
        "release" | "hold" | "unhold" | "stopping" => {
            let mut rest = rest;
            let signal = match op {
                "stopping" => {
                    let signal = rest.as_object_mut().and_then(|o| o.remove("signal"));
                    Some(stop_signal(signal).map_err(field)?)
                }
                _ => None,
            };
            let f: ReleaseFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            let key = match (f.vgpu, f.container, f.handle, f.claim) {
                (Some(v), None, None, None) => {
                    ReleaseKey::Vgpu(v.parse().map_err(|e| field(format!("vgpu: {e}")))?)
                }
                (None, Some(c), None, None) => ReleaseKey::Container(c),
                (None, None, Some(h), None) => {
                    ReleaseKey::Handle(h.parse().map_err(|e| field(format!("handle: {e}")))?)
                }
                (None, None, None, Some(c)) => ReleaseKey::Claim(c),
                _ => {
                    return Err(field(
                        "give exactly one of `vgpu`, `container`, `handle` and `claim`".into(),
                    ))
                }
            };
            Ok(match (op, signal) {
                ("release", _) => Request::Release(key),
                (_, Some(signal)) => Request::Stopping { key, signal },
                _ => Request::Hold {
                    key,
                    held: op == "hold",
                },
            })
        }
        "pin" => {
            let f: PinFields = serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Pin {
                claim: f.claim,
                placement: Placement {
                    gpus: f.gpus.into_iter().map(GpuIndex).collect(),
                    memory: f.memory,
                },
                annotations: f.annotations,
            })
        }
        "allocate" => {
            let f: AllocateFields =
                serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            if f.units.len() > MAX_UNITS {
                return Err(field(format!(
                    "{} units; at most {MAX_UNITS} make one allocation",
                    f.units.len()
                )));
            }
            let units = (f.units.iter().map(|u| u.parse()))
                .collect::<Result<Vec<UnitId>, _>>()
                .map_err(|e: gpuplex_scheduler::units::UnitsError| field(e.to_string()))?;
            if f.unit == 0 {
                return Err(field("unit must be above 0 bytes".into()));
            }
            Ok(Request::Allocate {
                units,
                unit: f.unit,
            })
        }
        "events" => {
            let f: EventsFields = serde_json::from_value(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Events { since: f.since })
        }
        "watch" => {
            serde_json::from_value::<NoFields>(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Watch)
        }
        _ => {
            serde_json::from_value::<NoFields>(rest).map_err(|e| field(e.to_string()))?;
            Ok(Request::Status)
        }
    }
}

/// The `signal` of a `stopping` request.
fn stop_signal(value: Option<Value>) -> Result<StopSignal, String> {
    let name = value.as_ref().and_then(Value::as_str);
    let known = STOP_SIGNALS.iter().find(|(n, _)| Some(*n) == name);
    match (known, name) {
        (Some((_, signal)), _) => Ok(*signal),
        (None, Some(other)) => Err(format!(
            "signal `{other}` is not a stop signal: expected SIGTERM, SIGINT, SIGQUIT or SIGKILL"
        )),
        (None, None) => Err("missing field `signal` (SIGTERM, SIGINT, SIGQUIT or SIGKILL)".into()),
    }
}

/// How a JSON value reads in a one-line message: `a string`, `an array`, ... (also the hook's
/// spec editor's wording).
pub fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveFields {
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    #[serde(default)]
    handle: Option<String>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    container: String,
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    cgroup: Option<String>,
    #[serde(default)]
    unstarted: bool,
}

impl Fields {
    fn attachment(&self) -> Result<Attachment, String> {
        let target = match (self.pid, &self.cgroup) {
            (Some(pid), None) if pid > 0 => Target::Pid(pid),
            (None, Some(path)) if path.starts_with('/') => Target::Cgroup(path.clone()),
            (Some(_), None) => return Err("pid must be above 0".into()),
            (None, Some(path)) => return Err(format!("cgroup `{path}` is not an absolute path")),
            _ => return Err("give exactly one of `pid` and `cgroup`".into()),
        };
        Ok(Attachment {
            container: self.container.clone(),
            target,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseFields {
    #[serde(default)]
    vgpu: Option<String>,
    #[serde(default)]
    container: Option<String>,
    #[serde(default)]
    handle: Option<String>,
    #[serde(default)]
    claim: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PinFields {
    claim: String,
    gpus: Vec<u32>,
    memory: u64,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllocateFields {
    units: Vec<String>,
    unit: u64,
}

/// The most units one `allocate` names (a line holds about 6,000 at most anyway).
pub const MAX_UNITS: usize = 4096;

/// The fields of an operation that takes none (`status`, `watch`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoFields {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsFields {
    #[serde(default)]
    since: u64,
}
