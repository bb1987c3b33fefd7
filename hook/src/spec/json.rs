//! Typed steps into a `serde_json::Value` that name the field at fault.

use serde_json::{Map, Value};

/// How a JSON value reads in a message: `a string`, `an array`, ...
pub(super) use gpuplex_wire::protocol::json_kind as kind;

/// A field of `config.json` that an edit reads or writes has the wrong type. One line.
#[derive(Debug, thiserror::Error)]
#[error("config.json: {field} is not {expected} (it is {found})")]
pub struct FieldError {
    /// The field, such as `linux.devices` or `process.env[2]`.
    pub field: String,
    /// What it must be, such as `an array`.
    pub expected: &'static str,
    /// What it is, such as `a string`.
    pub found: &'static str,
}

fn wrong(field: &str, expected: &'static str, found: &Value) -> FieldError {
    FieldError {
        field: field.to_owned(),
        expected,
        found: kind(found),
    }
}

/// The object `parent[key]`, created empty when absent or `null`; `field` names it in errors.
pub(crate) fn object<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<&'a mut Map<String, Value>, FieldError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Object(Map::new());
    }
    match slot {
        Value::Object(map) => Ok(map),
        other => Err(wrong(field, "an object", other)),
    }
}

/// The array `parent[key]`, created empty when absent or `null`; `field` names it in errors.
pub(crate) fn array<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<&'a mut Vec<Value>, FieldError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    match slot {
        Value::Array(items) => Ok(items),
        other => Err(wrong(field, "an array", other)),
    }
}

/// Checks that every item of `items` (the array `field`) is an object.
pub(crate) fn all_objects(items: &[Value], field: &str) -> Result<(), FieldError> {
    match items.iter().position(|item| !item.is_object()) {
        Some(i) => Err(wrong(&format!("{field}[{i}]"), "an object", &items[i])),
        None => Ok(()),
    }
}

/// Checks that every item of `items` (the array `field`) is a string.
pub(crate) fn all_strings(items: &[Value], field: &str) -> Result<(), FieldError> {
    match items.iter().position(|item| !item.is_string()) {
        Some(i) => Err(wrong(&format!("{field}[{i}]"), "a string", &items[i])),
        None => Ok(()),
    }
}

/// Puts `entry` where the first item that `same` picks is, drops the other items it picks, and
/// appends `entry` when it picks none. The other items keep their order.
pub(crate) fn replace_or_push(items: &mut Vec<Value>, entry: Value, same: impl Fn(&Value) -> bool) {
    let mut entry = Some(entry);
    let mut kept = Vec::with_capacity(items.len() + 1);
    for item in items.drain(..) {
        if !same(&item) {
            kept.push(item);
        } else if let Some(entry) = entry.take() {
            kept.push(entry);
        }
    }
    kept.extend(entry);
    *items = kept;
}

/// Appends `entry` unless an equal item is there.
pub(crate) fn push_new(items: &mut Vec<Value>, entry: Value) {
    if !items.contains(&entry) {
        items.push(entry);
    }
}

/// Writes device nodes (`linux.devices` entries, each with its container path, replacing an
/// entry of the same path) and their allow rules (`linux.resources.devices`, each once) into
/// `root`, the config's top-level object.
pub(crate) fn write_devices(
    root: &mut Map<String, Value>,
    devices: Vec<(String, Value)>,
    rules: Vec<Value>,
) -> Result<(), FieldError> {
    let linux = object(root, "linux", "linux")?;
    let entries = array(linux, "devices", "linux.devices")?;
    all_objects(entries, "linux.devices")?;
    for (path, entry) in devices {
        replace_or_push(entries, entry, |item| item["path"] == path.as_str());
    }
    let resources = object(linux, "resources", "linux.resources")?;
    let allowed = array(resources, "devices", "linux.resources.devices")?;
    for rule in rules {
        push_new(allowed, rule);
    }
    Ok(())
}
