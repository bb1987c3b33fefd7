//! A CDI spec file as written: the serde types of CDI's [SPEC.md], field for field, and how a
//! file's bytes become one. An unknown field anywhere is an error, as in the reference crate
//! (`container-device-interface`), whose types these follow in which fields are required and
//! which may be absent or `null`, so that both read the same files the same way.
//!
//! YAML (and JSON, read as YAML) is parsed by `serde_norway`, a maintained hard fork of
//! `serde_yaml` 0.9.34, which is the parser the reference crate uses and is deprecated and
//! archived. The fork keeps 0.9.34's code and behaviour (its changes are code style and its
//! own fork of the libyaml port), so both readers see the same document in a file, down to
//! YAML's edge cases (`null` and `~`, empty values, duplicate keys, several documents), which
//! another parser (`serde-saphyr`, `serde_yaml2`) would read its own way; `serde_yml`, another
//! fork, is unsound by RustSec's account.
//!
//! What the fields may hold is [`super::validate`]'s.
//!
//! [SPEC.md]: https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md

use std::collections::BTreeMap;

use gpuplex_wire::protocol::cdi::CdiDeviceNode;
use serde::Deserialize;

/// One CDI spec file: the devices of one kind and the edits that expose them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiSpec {
    /// The version of CDI's specification the file follows (`0.5.0`, `v1.0.0`, ...).
    pub cdi_version: String,
    /// `vendor/class`, such as `nvidia.com/gpu`.
    pub kind: String,
    /// Free-form metadata.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// The devices, by name.
    pub devices: Vec<CdiDevice>,
    /// The edits made for any device of the spec (spec-wide edits).
    pub container_edits: Option<ContainerEdits>,
}

/// One device of a spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDevice {
    /// The name, unique in the spec; `nvidia.com/gpu=<name>` when qualified.
    pub name: String,
    /// Free-form metadata.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// The edits that expose this device.
    pub container_edits: ContainerEdits,
}

/// Edits to a container's OCI spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=value` entries for the container's process.
    pub env: Option<Vec<String>>,
    /// Device nodes to create in the container (the protocol's own type: CDI's, field for
    /// field).
    pub device_nodes: Option<Vec<CdiDeviceNode>>,
    /// Mounts to add.
    pub mounts: Option<Vec<Mount>>,
    /// OCI hooks to add.
    pub hooks: Option<Vec<Hook>>,
    /// Supplementary groups for the container's process.
    pub additional_gids: Option<Vec<u32>>,
    /// Intel RDT settings (since 0.7.0).
    pub intel_rdt: Option<IntelRdt>,
    /// Host network interfaces to move into the container (since 1.1.0).
    pub net_devices: Option<Vec<NetDevice>>,
}

/// A mount to add to the container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// The source on the host.
    pub host_path: String,
    /// The destination in the container.
    pub container_path: String,
    /// The file system type (since 0.4.0).
    #[serde(rename = "type")]
    pub mount_type: Option<String>,
    /// The mount options.
    pub options: Option<Vec<String>>,
}

/// An OCI hook to add to the container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    /// The OCI stage it runs at (`createContainer`, ...).
    pub hook_name: String,
    /// The program on the host.
    pub path: String,
    /// `argv`, `argv[0]` included.
    pub args: Option<Vec<String>>,
    /// The hook's environment, `NAME=value` entries.
    pub env: Option<Vec<String>>,
    /// Seconds before the runtime gives up on the hook.
    pub timeout: Option<i64>,
}

/// Intel RDT settings of the container (gpuplex reads them only to refuse them).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IntelRdt {
    /// The resctrl class of service: a directory name.
    #[serde(rename = "closID")]
    pub clos_id: Option<String>,
    /// The L3 cache schema.
    pub l3_cache_schema: Option<String>,
    /// The memory bandwidth schema.
    pub mem_bw_schema: Option<String>,
    /// The schemata lines (since 1.1.0).
    pub schemata: Option<Vec<String>>,
    /// Whether to enable resctrl monitoring (since 1.1.0).
    pub enable_monitoring: Option<bool>,
    /// Cache monitoring (before 1.1.0 only).
    #[serde(rename = "enableCMT")]
    pub enable_cmt: Option<bool>,
    /// Memory bandwidth monitoring (before 1.1.0 only).
    #[serde(rename = "enableMBM")]
    pub enable_mbm: Option<bool>,
}

/// A host network interface to move into the container (gpuplex reads it only to refuse it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetDevice {
    /// The interface on the host.
    pub host_interface_name: String,
    /// Its name in the container.
    pub name: String,
}

/// Why a file's bytes are no [`CdiSpec`]. Each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// The bytes are no YAML (nor JSON) document.
    #[error("not YAML or JSON: {0}")]
    NotYaml(String),
    /// A document without a top-level `kind` string.
    #[error("not a CDI spec: it has no \"kind\" string")]
    NoKind,
    /// A YAML document that is no CDI spec: an unknown or missing field, a wrong type.
    #[error("does not parse: {0}")]
    Fields(String),
}

/// A serde_norway error on one line.
fn one_line(err: &serde_norway::Error) -> String {
    super::one_line(&err.to_string())
}

/// The `kind` of a spec file, read leniently: from any YAML document with a top-level `kind`
/// string, whatever its other fields, so that another vendor's spec is recognised as such
/// without being held to our reading of it.
pub fn kind_of(bytes: &[u8]) -> Result<String, ParseError> {
    let document: serde_norway::Value =
        serde_norway::from_slice(bytes).map_err(|err| ParseError::NotYaml(one_line(&err)))?;
    match document.get("kind").and_then(serde_norway::Value::as_str) {
        Some(kind) => Ok(kind.to_owned()),
        None => Err(ParseError::NoKind),
    }
}

/// A spec file's bytes (YAML or JSON) as a [`CdiSpec`], strictly: unknown fields refused.
/// Nothing is validated beyond the types: see [`super::validate::validate`].
pub fn parse(bytes: &[u8]) -> Result<CdiSpec, ParseError> {
    serde_norway::from_slice(bytes).map_err(|err| ParseError::Fields(one_line(&err)))
}

/// Whether a file is a spec file by its name: a `.yaml` or `.json` extension, in any case.
pub fn is_spec_file_name(path: &std::path::Path) -> bool {
    path.extension()
        .and_then(|ext| ext.to_str())
        .is_some_and(|ext| ext.eq_ignore_ascii_case("yaml") || ext.eq_ignore_ascii_case("json"))
}
