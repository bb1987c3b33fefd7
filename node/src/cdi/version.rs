//! CDI's spec versions: which `cdiVersion` values are known, and the least version that the
//! fields a spec uses need (a spec may not declare less), as the reference crate decides them.

use std::fmt;

use super::spec::{CdiSpec, ContainerEdits};

/// A released version of CDI's specification.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(u8, u8, u8);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The versions released, oldest first.
pub const KNOWN: [Version; 10] = [
    Version(0, 1, 0),
    Version(0, 2, 0),
    Version(0, 3, 0),
    Version(0, 4, 0),
    Version(0, 5, 0),
    Version(0, 6, 0),
    Version(0, 7, 0),
    Version(0, 8, 0),
    Version(1, 0, 0),
    Version(1, 1, 0),
];

/// The oldest version a spec may declare: 0.1.0 and 0.2.0 are known but no longer read.
const EARLIEST: Version = Version(0, 3, 0);
/// The version that brought `netDevices`, `intelRdt.schemata` and `intelRdt.enableMonitoring`
/// and dropped `intelRdt.enableCMT` and `intelRdt.enableMBM`.
pub const V1_1: Version = Version(1, 1, 0);

/// The known version a `cdiVersion` names: `X.Y.Z` or `vX.Y.Z`.
///
/// The reference crate strips any number of leading `v`s (`vv1.0.0` passes there); gpuplex
/// takes one at most, as CDI's Go implementation does.
pub fn known(declared: &str) -> Option<Version> {
    let bare = declared.strip_prefix('v').unwrap_or(declared);
    KNOWN
        .into_iter()
        .find(|version| version.to_string() == bare)
}

/// The least version a spec's fields need, with the first field (in spec order) that needs it,
/// in words: `None` when nothing needs more than [`EARLIEST`].
pub fn minimum(spec: &CdiSpec) -> (Version, Option<String>) {
    let mut least = (EARLIEST, None);
    let mut need = |version: Version, why: String| {
        if version > least.0 {
            least = (version, Some(why));
        }
    };
    let (_, class) = spec.kind.split_once('/').unwrap_or_default();
    if class.contains('.') {
        need(
            Version(0, 6, 0),
            format!("kind {:?} (its class has a dot)", spec.kind),
        );
    }
    if !spec.annotations.is_empty() {
        need(Version(0, 6, 0), "the spec's annotations".to_owned());
    }
    if let Some(edits) = &spec.container_edits {
        for (version, field) in edit_needs(edits) {
            need(version, format!("{field} in the spec-wide containerEdits"));
        }
    }
    for device in &spec.devices {
        let name = &device.name;
        if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
            need(
                Version(0, 5, 0),
                format!("device {name:?} (its name does not start with a letter)"),
            );
        }
        if !device.annotations.is_empty() {
            need(
                Version(0, 6, 0),
                format!("the annotations of device {name:?}"),
            );
        }
        for (version, field) in edit_needs(&device.container_edits) {
            need(version, format!("{field} in device {name:?}"));
        }
    }
    least
}

/// The fields of some edits that need a version later than the earliest, each with the version.
fn edit_needs(edits: &ContainerEdits) -> Vec<(Version, &'static str)> {
    let mut needs = Vec::new();
    let mounts = edits.mounts.iter().flatten();
    if mounts.into_iter().any(|mount| {
        mount
            .mount_type
            .as_ref()
            .is_some_and(|kind| !kind.is_empty())
    }) {
        needs.push((Version(0, 4, 0), "a mount type"));
    }
    let nodes = edits.device_nodes.iter().flatten();
    if nodes
        .into_iter()
        .any(|node| node.host_path.as_ref().is_some_and(|path| !path.is_empty()))
    {
        needs.push((Version(0, 5, 0), "a device node hostPath"));
    }
    if edits.intel_rdt.is_some() {
        needs.push((Version(0, 7, 0), "intelRdt"));
    }
    if edits
        .additional_gids
        .as_ref()
        .is_some_and(|gids| !gids.is_empty())
    {
        needs.push((Version(0, 7, 0), "additionalGids"));
    }
    if let Some(rdt) = &edits.intel_rdt {
        if rdt.schemata.is_some() {
            needs.push((V1_1, "intelRdt.schemata"));
        }
        if rdt.enable_monitoring.is_some() {
            needs.push((V1_1, "intelRdt.enableMonitoring"));
        }
    }
    if edits
        .net_devices
        .as_ref()
        .is_some_and(|nets| !nets.is_empty())
    {
        needs.push((V1_1, "netDevices"));
    }
    needs
}

/// The first field of some edits that a spec of version 1.1.0 or later may no longer have.
pub fn dropped_field(edits: &ContainerEdits) -> Option<&'static str> {
    let rdt = edits.intel_rdt.as_ref()?;
    if rdt.enable_cmt.is_some() {
        Some("intelRdt.enableCMT")
    } else if rdt.enable_mbm.is_some() {
        Some("intelRdt.enableMBM")
    } else {
        None
    }
}
