//! [`apply`]: CDI edits written into a `config.json` value, the way CDI (and the
//! `container-device-interface` crate's `ContainerEdits::apply`) writes them into an OCI spec,
//! but on a [`serde_json::Value`] so that fields oci-spec does not model are kept. The vGPU's
//! own edits ([`gpuplex_wire::vgpu_edits`]) are applied with it too ([`crate::spec::edit`]).

use std::path::Path;

use gpuplex_cgroup::{DeviceKind, DeviceNumbers};
use gpuplex_wire::protocol::cdi::{CdiDeviceNode, CdiEdits, CdiHook, CdiMount};
use gpuplex_wire::protocol::json_kind as kind;
use serde_json::{json, Map, Value};

use super::HOOK_NAMES;
use crate::spec::json::{
    all_objects, all_strings, array, object, push_new, replace_or_push, write_devices, FieldError,
};

/// Why CDI edits were not applied; `config.json` is then as it was. One line naming the
/// device node, hook, entry or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// An edit CDI does not allow (the line says which, and what is accepted).
    #[error("{0}")]
    Invalid(String),
    /// A device node's host node, where its type and numbers were to come from, cannot be read.
    #[error("CDI device node {node}: cannot read host node {host}: {source}")]
    HostNode {
        /// The node's path in the container.
        node: String,
        /// The host node.
        host: String,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The host node is no device node.
    #[error("CDI device node {node}: cannot read host node {host}: not a device node")]
    NotADevice {
        /// The node's path in the container.
        node: String,
        /// The host path.
        host: String,
    },
    /// `config.json` is no JSON object.
    #[error("config.json: not a JSON object (it is {0})")]
    NotAnObject(&'static str),
    /// A field the edits go into has the wrong type.
    #[error(transparent)]
    Config(#[from] FieldError),
}

/// What goes into the config, built and checked (host nodes read) before anything changes.
#[derive(Default)]
struct Plan {
    /// `process.env` entries, each with its name.
    env: Vec<(String, String)>,
    /// `linux.devices` entries, each with its container path.
    devices: Vec<(String, Value)>,
    /// `linux.resources.devices` allow rules.
    rules: Vec<Value>,
    /// `mounts` entries, each with its destination.
    mounts: Vec<(String, Value)>,
    /// `hooks.<stage>` entries.
    hooks: Vec<(String, Value)>,
    /// `process.user.additionalGids` entries.
    gids: Vec<u32>,
}

/// A host node's CDI type (`b`, `c`, `p`) and major and minor numbers (0 for a fifo), for
/// the device node at `node` in the container.
fn host_node(node: &str, host: &str) -> Result<(String, i64, i64), ApplyError> {
    let found = DeviceNumbers::of(Path::new(host)).map_err(|source| ApplyError::HostNode {
        node: node.to_owned(),
        host: host.to_owned(),
        source,
    })?;
    let node = found.ok_or_else(|| ApplyError::NotADevice {
        node: node.to_owned(),
        host: host.to_owned(),
    })?;
    let node_type = match node.kind {
        DeviceKind::Block => "b",
        DeviceKind::Char => "c",
        DeviceKind::Fifo => "p",
    };
    Ok((node_type.to_owned(), node.major.into(), node.minor.into()))
}

/// The device cgroup access of a node: `rwm` when unset, nothing for `none`.
fn access(node: &CdiDeviceNode) -> Result<String, ApplyError> {
    match node.permissions.as_deref() {
        None | Some("") => Ok("rwm".to_owned()),
        Some("none") => Ok(String::new()),
        Some(perms) if perms.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) => Ok(perms.to_owned()),
        Some(perms) => Err(ApplyError::Invalid(format!(
            "CDI device node {}: permissions {perms:?} are not made of r, w and m (or none)",
            node.path
        ))),
    }
}

/// A `KEY=value` entry's name, when it has a non-empty one.
fn env_name(entry: &str) -> Option<&str> {
    entry
        .split_once('=')
        .map(|(name, _)| name)
        .filter(|name| !name.is_empty())
}

/// The node's type, major and minor, read from the host node (`host_path`, else `path`) when
/// the spec leaves them out, as CDI's `fillMissingInfo` does: a node with a type and a major
/// number, or a fifo, is taken as written.
fn node_numbers(node: &CdiDeviceNode) -> Result<(String, Option<i64>, Option<i64>), ApplyError> {
    let mut node_type = node.node_type.clone().filter(|t| !t.is_empty());
    if let Some(t) = &node_type {
        if !matches!(t.as_str(), "b" | "c" | "u" | "p") {
            return Err(ApplyError::Invalid(format!(
                "CDI device node {}: type {t:?} is not b, c, u or p",
                node.path
            )));
        }
    }
    let (mut major, mut minor) = (node.major, node.minor);
    let known = node_type
        .as_deref()
        .is_some_and(|t| major.is_some() || t == "p");
    if !known {
        let host = node
            .host_path
            .as_deref()
            .filter(|host| !host.is_empty())
            .unwrap_or(&node.path);
        let (found, host_major, host_minor) = host_node(&node.path, host)?;
        match node_type.as_deref() {
            None => node_type = Some(found.clone()),
            Some(written) if written != found => {
                return Err(ApplyError::Invalid(format!(
                    "CDI device node {}: the spec says type {written} but host node {host} is of type {found}",
                    node.path
                )));
            }
            Some(_) => {}
        }
        if major.is_none() && found != "p" {
            major = Some(host_major);
            minor = Some(host_minor);
        }
    }
    let node_type = node_type.unwrap_or_default();
    if major.is_some() {
        minor = Some(minor.unwrap_or(0));
    }
    Ok((node_type, major, minor))
}

impl Plan {
    fn new(config: &Value, edits: &CdiEdits) -> Result<Plan, ApplyError> {
        let mut plan = Plan::default();
        for entry in &edits.env {
            let name = env_name(entry).ok_or_else(|| {
                ApplyError::Invalid(format!(
                    "CDI env entry {entry:?} is not NAME=value with a non-empty name"
                ))
            })?;
            plan.env.push((name.to_owned(), entry.clone()));
        }
        let user = &config["process"]["user"];
        let owner = |id: &str| user[id].as_u64().filter(|&id| id > 0);
        for node in &edits.device_nodes {
            plan.device(node, owner("uid"), owner("gid"))?;
        }
        for mount in &edits.mounts {
            plan.mount(mount)?;
        }
        for hook in &edits.hooks {
            plan.hook(hook)?;
        }
        plan.gids = edits.additional_gids.clone();
        Ok(plan)
    }

    fn device(
        &mut self,
        node: &CdiDeviceNode,
        uid: Option<u64>,
        gid: Option<u64>,
    ) -> Result<(), ApplyError> {
        if node.path.is_empty() {
            return Err(ApplyError::Invalid(
                "CDI device node with an empty path".to_owned(),
            ));
        }
        let access = access(node)?;
        let (node_type, major, minor) = node_numbers(node)?;
        let mut entry = Map::new();
        entry.insert("path".to_owned(), json!(node.path));
        entry.insert("type".to_owned(), json!(node_type));
        if let (Some(major), Some(minor)) = (major, minor) {
            entry.insert("major".to_owned(), json!(major));
            entry.insert("minor".to_owned(), json!(minor));
        }
        if let Some(mode) = node.file_mode {
            entry.insert("fileMode".to_owned(), json!(mode));
        }
        if let Some(uid) = node.uid.map(u64::from).or(uid) {
            entry.insert("uid".to_owned(), json!(uid));
        }
        if let Some(gid) = node.gid.map(u64::from).or(gid) {
            entry.insert("gid".to_owned(), json!(gid));
        }
        self.devices.push((node.path.clone(), Value::Object(entry)));
        if matches!(node_type.as_str(), "b" | "c") {
            self.rules.push(json!({
                "allow": true, "type": node_type, "major": major, "minor": minor,
                "access": access,
            }));
        }
        Ok(())
    }

    fn mount(&mut self, mount: &CdiMount) -> Result<(), ApplyError> {
        if mount.host_path.is_empty() || mount.container_path.is_empty() {
            return Err(ApplyError::Invalid(format!(
                "CDI mount {:?} -> {:?}: a path is empty",
                mount.host_path, mount.container_path
            )));
        }
        let mut entry = Map::new();
        entry.insert("destination".to_owned(), json!(mount.container_path));
        entry.insert("source".to_owned(), json!(mount.host_path));
        if let Some(mount_type) = &mount.mount_type {
            entry.insert("type".to_owned(), json!(mount_type));
        }
        if !mount.options.is_empty() {
            entry.insert("options".to_owned(), json!(mount.options));
        }
        self.mounts
            .push((mount.container_path.clone(), Value::Object(entry)));
        Ok(())
    }

    fn hook(&mut self, hook: &CdiHook) -> Result<(), ApplyError> {
        if !HOOK_NAMES.contains(&hook.hook_name.as_str()) {
            return Err(ApplyError::Invalid(format!(
                "CDI hook {}: hookName {:?} is not one of {}",
                hook.path,
                hook.hook_name,
                HOOK_NAMES.join(", ")
            )));
        }
        if hook.path.is_empty() {
            return Err(ApplyError::Invalid(format!(
                "CDI {} hook with an empty path",
                hook.hook_name
            )));
        }
        if let Some(entry) = hook.env.iter().find(|entry| env_name(entry).is_none()) {
            return Err(ApplyError::Invalid(format!(
                "CDI hook {}: env entry {entry:?} is not NAME=value with a non-empty name",
                hook.path
            )));
        }
        let mut entry = Map::new();
        entry.insert("path".to_owned(), json!(hook.path));
        if !hook.args.is_empty() {
            entry.insert("args".to_owned(), json!(hook.args));
        }
        if !hook.env.is_empty() {
            entry.insert("env".to_owned(), json!(hook.env));
        }
        if let Some(timeout) = hook.timeout {
            entry.insert("timeout".to_owned(), json!(timeout));
        }
        self.hooks
            .push((hook.hook_name.clone(), Value::Object(entry)));
        Ok(())
    }

    /// Writes the plan into `root`, the config's top-level object.
    fn write(self, root: &mut Map<String, Value>) -> Result<(), FieldError> {
        if !self.devices.is_empty() || !self.rules.is_empty() {
            write_devices(root, self.devices, self.rules)?;
        }
        if !self.env.is_empty() || !self.gids.is_empty() {
            let process = object(root, "process", "process")?;
            if !self.env.is_empty() {
                let env = array(process, "env", "process.env")?;
                all_strings(env, "process.env")?;
                for (name, entry) in self.env {
                    let same = |item: &Value| item.as_str().and_then(env_name) == Some(&name);
                    replace_or_push(env, Value::String(entry), same);
                }
            }
            if !self.gids.is_empty() {
                let user = object(process, "user", "process.user")?;
                let gids = array(user, "additionalGids", "process.user.additionalGids")?;
                for gid in self.gids.into_iter().filter(|&gid| gid > 0) {
                    if !gids
                        .iter()
                        .any(|item| item.as_u64() == Some(u64::from(gid)))
                    {
                        gids.push(json!(gid));
                    }
                }
            }
        }
        if !self.mounts.is_empty() {
            let mounts = array(root, "mounts", "mounts")?;
            all_objects(mounts, "mounts")?;
            for (destination, entry) in self.mounts {
                mounts.retain(|item| item["destination"] != destination.as_str());
                mounts.push(entry);
            }
        }
        if !self.hooks.is_empty() {
            let hooks = object(root, "hooks", "hooks")?;
            for (stage, entry) in self.hooks {
                let entries = array(hooks, &stage, &format!("hooks.{stage}"))?;
                push_new(entries, entry);
            }
        }
        Ok(())
    }
}

/// Writes `edits` into a `config.json` value:
///
/// | where | what |
/// |---|---|
/// | `linux.devices` | one `{"path","type","major","minor"[,"fileMode","uid","gid"]}` per node; an entry with the same path is replaced in place. A node without a type or major number gets them from its host node (`hostPath`, else `path`), as CDI does; an unset uid/gid is the process's when it is not root |
/// | `linux.resources.devices` | for `c` and `b` nodes, `{"allow":true,"type","major","minor","access"}` (`access` from `permissions`, `rwm` when unset), appended unless an identical rule is there |
/// | `process.env` | each `NAME=value`, replacing the entries of that name in place, else appended |
/// | `mounts` | each mount, appended after removing the mounts with its destination |
/// | `hooks.<hookName>` | each hook, appended unless an identical entry is there |
/// | `process.user.additionalGids` | each gid above 0 not there yet |
///
/// Absent (or `null`) objects and arrays are created only when something goes into them. The
/// edits are made on a copy that replaces `config` when all succeeded: on error (a bad field
/// type in the config, a host node that cannot be read, an edit CDI does not allow) `config`
/// is left as it was. Applying the same edits twice is applying them once.
pub fn apply(config: &mut Value, edits: &CdiEdits) -> Result<(), ApplyError> {
    let plan = Plan::new(config, edits)?;
    let mut edited = config.clone();
    let root = edited
        .as_object_mut()
        .ok_or_else(|| ApplyError::NotAnObject(kind(config)))?;
    plan.write(root)?;
    *config = edited;
    Ok(())
}
