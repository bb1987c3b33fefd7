//! Whether a [`CdiSpec`] is valid: the rules the reference crate (`container-device-interface`
//! 1.1) applies in `new_spec`, its JSON schema included, learnt from its source and written
//! anew, so that gpuplex accepts the specs it accepts and refuses the ones it refuses
//! (`agreement_tests.rs` runs both over a corpus). Where gpuplex is stricter, on purpose:
//!
//! - a device node's `path`, and its `hostPath` when given, must be absolute: OCI wants the
//!   full path of a device in the container, and a relative host path would be looked up from
//!   wherever the hook runs;
//! - a hook's `path` must be absolute, as OCI requires of hooks;
//! - `cdiVersion` may carry one leading `v`, not several (see [`version::known`]).
//!
//! Mount paths need only be non-empty, as in CDI and OCI (which reads a relative destination
//! from `/`).

use super::names::{self, AnnotationFault, NameFault};
use super::spec::{CdiSpec, ContainerEdits, Hook, Mount, NetDevice};
use super::version::{self, Version};
use gpuplex_wire::protocol::cdi::CdiDeviceNode;

/// Where in a spec some edits are: `spec-wide containerEdits` or `device "0"`.
fn edits_owner(device: &Option<String>) -> String {
    match device {
        Some(name) => format!("device {name:?}"),
        None => "spec-wide containerEdits".to_owned(),
    }
}

/// Whose annotations: `spec` or `device "0"`.
fn annotations_owner(device: &Option<String>) -> String {
    match device {
        Some(name) => format!("device {name:?}"),
        None => "spec".to_owned(),
    }
}

/// Why a spec is not valid. Each message is one line naming the field or device at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSpec {
    /// A spec without devices.
    #[error("invalid spec, no devices")]
    NoDevices,
    /// A `cdiVersion` that is not a released version.
    #[error("cdiVersion {0:?} is not a CDI version gpuplex reads (0.3.0 to 1.1.0)")]
    UnknownVersion(String),
    /// A malformed kind.
    #[error("kind {kind:?}: {fault}")]
    Kind {
        /// The kind.
        kind: String,
        /// What is wrong.
        fault: NameFault,
    },
    /// A malformed device name.
    #[error("device {name:?}: {fault}")]
    DeviceName {
        /// The name.
        name: String,
        /// What is wrong.
        fault: NameFault,
    },
    /// Two devices of one name.
    #[error("device {0:?} is defined twice")]
    DuplicateDevice(String),
    /// A `cdiVersion` older than a field used needs.
    #[error(
        "cdiVersion {declared} is too low for {needs}: the spec version must be at least v{least}"
    )]
    VersionTooLow {
        /// The version declared.
        declared: String,
        /// The least version the spec needs.
        least: Version,
        /// The field that needs it.
        needs: String,
    },
    /// A field a spec of version 1.1.0 or later may no longer have.
    #[error(
        "{}: {field} is not valid for CDI spec version {declared}",
        edits_owner(device)
    )]
    DroppedField {
        /// The device whose edits have it, `None` for the spec-wide edits.
        device: Option<String>,
        /// The field.
        field: &'static str,
        /// The version declared.
        declared: String,
    },
    /// Malformed annotations.
    #[error("{}: {fault}", annotations_owner(device))]
    Annotations {
        /// The device they are of, `None` for the spec's own.
        device: Option<String>,
        /// What is wrong.
        fault: AnnotationFault,
    },
    /// A device whose edits are all empty.
    #[error("device {0:?}: invalid device, empty containerEdits")]
    EmptyDevice(String),
    /// Malformed edits.
    #[error("{}: {fault}", edits_owner(device))]
    Edits {
        /// The device whose edits they are, `None` for the spec-wide edits.
        device: Option<String>,
        /// What is wrong.
        fault: EditFault,
    },
}

/// What is wrong with some container edits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EditFault {
    /// An `env` entry that is not `NAME=value` with a non-empty name.
    #[error("invalid environment variable {0:?}: not NAME=value with a non-empty NAME")]
    Env(String),
    /// A device node without a path.
    #[error("a device node has an empty path")]
    EmptyNodePath,
    /// A device node whose path is relative (gpuplex only).
    #[error("device {0:?}: path is not absolute")]
    RelativeNodePath(String),
    /// A device node whose host path is relative (gpuplex only).
    #[error("device {path:?}: hostPath {host_path:?} is not absolute")]
    RelativeHostPath {
        /// The node's path.
        path: String,
        /// Its host path.
        host_path: String,
    },
    /// A device node type other than `b`, `c`, `u`, `p`.
    #[error("device {path:?}: invalid type {node_type:?}: not b, c, u or p")]
    NodeType {
        /// The node's path.
        path: String,
        /// The type.
        node_type: String,
    },
    /// Device cgroup access other than letters of `rwm` or `none`.
    #[error(
        "device {path:?}: invalid permissions {permissions:?}: not made of r, w and m, nor none"
    )]
    Permissions {
        /// The node's path.
        path: String,
        /// The permissions.
        permissions: String,
    },
    /// A hook name that is no OCI stage.
    #[error("invalid hook name: {0:?}: not prestart, createRuntime, createContainer, startContainer, poststart or poststop")]
    HookName(String),
    /// A hook without a path.
    #[error("{0} hook with an empty path")]
    EmptyHookPath(String),
    /// A hook whose path is relative (gpuplex only).
    #[error("{hook_name} hook {path:?}: path is not absolute")]
    RelativeHookPath {
        /// The hook's stage.
        hook_name: String,
        /// Its path.
        path: String,
    },
    /// A hook `env` entry that is not `NAME=value` with a non-empty name.
    #[error("{hook_name} hook {path:?}: invalid environment variable {entry:?}: not NAME=value with a non-empty NAME")]
    HookEnv {
        /// The hook's stage.
        hook_name: String,
        /// Its path.
        path: String,
        /// The entry.
        entry: String,
    },
    /// A hook timeout outside `0..=u32::MAX` (the schema's `uint32`).
    #[error(
        "{hook_name} hook {path:?}: timeout {timeout} is not between 0 and {}",
        u32::MAX
    )]
    HookTimeout {
        /// The hook's stage.
        hook_name: String,
        /// Its path.
        path: String,
        /// The timeout.
        timeout: i64,
    },
    /// A mount with an empty host or container path.
    #[error("mount {host_path:?} -> {container_path:?}: a path is empty")]
    EmptyMountPath {
        /// Its host path.
        host_path: String,
        /// Its container path.
        container_path: String,
    },
    /// An Intel RDT class that is no directory name.
    #[error("intelRdt: invalid closID {0:?}: not a directory name")]
    ClosId(String),
    /// A net device with an empty field.
    #[error("netDevices: an entry has an empty {0}")]
    EmptyNetDeviceField(&'static str),
    /// A net device field with a value another entry has.
    #[error("netDevices: {field} {value:?} is given twice")]
    DuplicateNetDevice {
        /// `hostInterfaceName` or `name`.
        field: &'static str,
        /// The value.
        value: String,
    },
}

/// The OCI hook stages a CDI hook may name.
const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// Checks a spec: its version, kind, device names, annotations and edits. The first fault
/// found is the error.
pub fn validate(spec: &CdiSpec) -> Result<(), InvalidSpec> {
    if spec.devices.is_empty() {
        return Err(InvalidSpec::NoDevices);
    }
    let Some(declared) = version::known(&spec.cdi_version) else {
        return Err(InvalidSpec::UnknownVersion(spec.cdi_version.clone()));
    };
    names::check_kind(&spec.kind).map_err(|fault| InvalidSpec::Kind {
        kind: spec.kind.clone(),
        fault,
    })?;
    let mut seen = std::collections::BTreeSet::new();
    for device in &spec.devices {
        let name = &device.name;
        names::check_device_name(name).map_err(|fault| InvalidSpec::DeviceName {
            name: name.clone(),
            fault,
        })?;
        if !seen.insert(name.as_str()) {
            return Err(InvalidSpec::DuplicateDevice(name.clone()));
        }
    }
    check_version(spec, declared)?;
    check_annotations(spec)?;
    if let Some(edits) = &spec.container_edits {
        check_edits(edits).map_err(|fault| InvalidSpec::Edits {
            device: None,
            fault,
        })?;
    }
    for device in &spec.devices {
        let edits = &device.container_edits;
        if is_empty(edits) {
            return Err(InvalidSpec::EmptyDevice(device.name.clone()));
        }
        check_edits(edits).map_err(|fault| InvalidSpec::Edits {
            device: Some(device.name.clone()),
            fault,
        })?;
    }
    Ok(())
}

/// Checks that the declared version is at least what the fields used need, and that a 1.1.0
/// spec has none of the fields 1.1.0 dropped.
fn check_version(spec: &CdiSpec, declared: Version) -> Result<(), InvalidSpec> {
    let (least, needs) = version::minimum(spec);
    if declared < least {
        return Err(InvalidSpec::VersionTooLow {
            declared: spec.cdi_version.clone(),
            least,
            needs: needs.unwrap_or_else(|| "any spec".to_owned()),
        });
    }
    if declared < version::V1_1 {
        return Ok(());
    }
    let all_edits = spec
        .container_edits
        .iter()
        .map(|edits| (None, edits))
        .chain(
            spec.devices
                .iter()
                .map(|device| (Some(device.name.clone()), &device.container_edits)),
        );
    for (device, edits) in all_edits {
        if let Some(field) = version::dropped_field(edits) {
            return Err(InvalidSpec::DroppedField {
                device,
                field,
                declared: spec.cdi_version.clone(),
            });
        }
    }
    Ok(())
}

/// Checks the spec's annotations and each device's.
fn check_annotations(spec: &CdiSpec) -> Result<(), InvalidSpec> {
    let all = std::iter::once((None, &spec.annotations)).chain(
        spec.devices
            .iter()
            .map(|device| (Some(device.name.clone()), &device.annotations)),
    );
    for (device, annotations) in all {
        names::check_annotations(annotations)
            .map_err(|fault| InvalidSpec::Annotations { device, fault })?;
    }
    Ok(())
}

/// Whether some edits have nothing in them: no entry in any list, no `intelRdt`.
fn is_empty(edits: &ContainerEdits) -> bool {
    fn none<T>(list: &Option<Vec<T>>) -> bool {
        list.as_ref().is_none_or(Vec::is_empty)
    }
    none(&edits.env)
        && none(&edits.device_nodes)
        && none(&edits.mounts)
        && none(&edits.hooks)
        && none(&edits.additional_gids)
        && none(&edits.net_devices)
        && edits.intel_rdt.is_none()
}

/// Whether an `env` entry is `NAME=value` with a non-empty name.
fn is_env_entry(entry: &str) -> bool {
    entry
        .split_once('=')
        .is_some_and(|(name, _)| !name.is_empty())
}

/// Checks some edits, field by field.
fn check_edits(edits: &ContainerEdits) -> Result<(), EditFault> {
    if let Some(entry) = edits.env.iter().flatten().find(|e| !is_env_entry(e)) {
        return Err(EditFault::Env(entry.clone()));
    }
    edits
        .device_nodes
        .iter()
        .flatten()
        .try_for_each(check_node)?;
    edits.hooks.iter().flatten().try_for_each(check_hook)?;
    edits.mounts.iter().flatten().try_for_each(check_mount)?;
    if let Some(clos_id) = edits
        .intel_rdt
        .as_ref()
        .and_then(|rdt| rdt.clos_id.as_ref())
    {
        let directory_name = clos_id.len() < 4096
            && clos_id != "."
            && clos_id != ".."
            && !clos_id.contains(['/', '\n']);
        if !directory_name {
            return Err(EditFault::ClosId(clos_id.clone()));
        }
    }
    check_net_devices(edits.net_devices.as_deref().unwrap_or_default())
}

fn check_node(node: &CdiDeviceNode) -> Result<(), EditFault> {
    let path = &node.path;
    if path.is_empty() {
        return Err(EditFault::EmptyNodePath);
    }
    if !path.starts_with('/') {
        return Err(EditFault::RelativeNodePath(path.clone()));
    }
    if let Some(host_path) = node.host_path.as_ref().filter(|host| !host.is_empty()) {
        if !host_path.starts_with('/') {
            return Err(EditFault::RelativeHostPath {
                path: path.clone(),
                host_path: host_path.clone(),
            });
        }
    }
    if let Some(node_type) = &node.node_type {
        if !matches!(node_type.as_str(), "b" | "c" | "u" | "p" | "") {
            return Err(EditFault::NodeType {
                path: path.clone(),
                node_type: node_type.clone(),
            });
        }
    }
    if let Some(permissions) = &node.permissions {
        let valid = permissions == "none" || permissions.chars().all(|c| "rwm".contains(c));
        if !valid {
            return Err(EditFault::Permissions {
                path: path.clone(),
                permissions: permissions.clone(),
            });
        }
    }
    Ok(())
}

fn check_hook(hook: &Hook) -> Result<(), EditFault> {
    let (hook_name, path) = (&hook.hook_name, &hook.path);
    if !HOOK_NAMES.contains(&hook_name.as_str()) {
        return Err(EditFault::HookName(hook_name.clone()));
    }
    if path.is_empty() {
        return Err(EditFault::EmptyHookPath(hook_name.clone()));
    }
    if !path.starts_with('/') {
        return Err(EditFault::RelativeHookPath {
            hook_name: hook_name.clone(),
            path: path.clone(),
        });
    }
    if let Some(entry) = hook.env.iter().flatten().find(|e| !is_env_entry(e)) {
        return Err(EditFault::HookEnv {
            hook_name: hook_name.clone(),
            path: path.clone(),
            entry: entry.clone(),
        });
    }
    if let Some(timeout) = hook.timeout {
        if u32::try_from(timeout).is_err() {
            return Err(EditFault::HookTimeout {
                hook_name: hook_name.clone(),
                path: path.clone(),
                timeout,
            });
        }
    }
    Ok(())
}

fn check_mount(mount: &Mount) -> Result<(), EditFault> {
    if mount.host_path.is_empty() || mount.container_path.is_empty() {
        return Err(EditFault::EmptyMountPath {
            host_path: mount.host_path.clone(),
            container_path: mount.container_path.clone(),
        });
    }
    Ok(())
}

/// Checks net devices: both names given, and neither given twice.
fn check_net_devices(devices: &[NetDevice]) -> Result<(), EditFault> {
    let mut hosts = std::collections::BTreeSet::new();
    let mut names = std::collections::BTreeSet::new();
    for device in devices {
        if device.host_interface_name.is_empty() {
            return Err(EditFault::EmptyNetDeviceField("hostInterfaceName"));
        }
        if device.name.is_empty() {
            return Err(EditFault::EmptyNetDeviceField("name"));
        }
        if !hosts.insert(&device.host_interface_name) {
            return Err(EditFault::DuplicateNetDevice {
                field: "hostInterfaceName",
                value: device.host_interface_name.clone(),
            });
        }
        if !names.insert(&device.name) {
            return Err(EditFault::DuplicateNetDevice {
                field: "name",
                value: device.name.clone(),
            });
        }
    }
    Ok(())
}
