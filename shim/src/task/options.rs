//! The runtime options containerd's clients send a shim, decoded into one [`RuntimeOptions`].
//!
//! Three message types arrive, as a protobuf `Any`, at `start` (stdin) and in `Create`:
//! - `containerd.runc.v1.Options`: runc's options, from CRI and from `ctr`;
//! - `containerd.linux.runc.CreateOptions` (with `RuncOptions` beside it): what containerd
//!   1.6 clients send when the runtime's name does not start with `io.containerd.runc`, for
//!   example with `ctr run --runtime io.containerd.gpuplex.v1 --runc-binary ...`;
//! - `runtimeoptions.v1.Options`: CRI's generic options, whose `config_path` names a TOML
//!   file holding runc's options by their Go names (`BinaryName`, `Root`, `SystemdCgroup`...).
//!
//! Anything else is refused with its type named.

use std::path::Path;

use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::{CodedInputStream, Message};
use containerd_shim::protos::shim::oci::Options as RuncV1Options;

/// What the shim takes from the runtime options: how to run runc, and where to put the shim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeOptions {
    /// The runc binary (`runc` on `PATH` when empty).
    pub binary_name: String,
    /// runc's state root (`/run/containerd/runc` when empty); the namespace is appended.
    pub root: String,
    /// The cgroup the shim process moves itself into (empty: stay).
    pub shim_cgroup: String,
    /// runc's `--systemd-cgroup`.
    pub systemd_cgroup: bool,
    /// runc create's `--no-pivot`.
    pub no_pivot_root: bool,
    /// runc create's `--no-new-keyring`.
    pub no_new_keyring: bool,
    /// The owner of the container's stdio pipes.
    pub io_uid: u32,
    /// The group of the container's stdio pipes.
    pub io_gid: u32,
}

/// Why runtime options were refused.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    /// A type this shim does not know.
    #[error("runtime options of type {0:?} are not supported by containerd-shim-gpuplex-v1; it accepts containerd.runc.v1.Options, containerd.linux.runc.CreateOptions, containerd.linux.runc.RuncOptions and runtimeoptions.v1.Options")]
    Unknown(String),
    /// The bytes do not decode as the type they claim.
    #[error("runtime options of type {kind} do not decode: {why}")]
    Malformed {
        /// The type URL.
        kind: String,
        /// The decoder's complaint.
        why: String,
    },
    /// CRI's `config_path` file.
    #[error("runtime options file {path}: {why}")]
    ConfigFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        why: String,
    },
}

/// Whether `path` is a cgroups path in the form of runc's systemd driver, `slice:prefix:name`:
/// three fields, none with a `/`, the first a systemd slice (or empty: `system.slice`), the last
/// not empty.
pub fn is_systemd_cgroups_path(path: &str) -> bool {
    let fields: Vec<&str> = path.split(':').collect();
    match fields.as_slice() {
        [slice, _prefix, name] => {
            !fields.iter().any(|f| f.contains('/'))
                && (slice.is_empty() || (slice.ends_with(".slice") && slice.len() > 6))
                && !name.is_empty()
        }
        _ => false,
    }
}

const RUNC_V1: &str = "containerd.runc.v1.Options";
const LEGACY_CREATE: &str = "containerd.linux.runc.CreateOptions";
const LEGACY_RUNC: &str = "containerd.linux.runc.RuncOptions";
const CRI_OPTIONS: &str = "runtimeoptions.v1.Options";

/// The message name of a type URL (`type.googleapis.com/x.Y` and `x.Y` alike).
fn message_name(type_url: &str) -> &str {
    type_url.rsplit('/').next().unwrap_or(type_url)
}

impl RuntimeOptions {
    /// These options for a container whose spec's `linux.cgroupsPath` is `cgroups_path`: runc's
    /// systemd driver where the path is in its form (`slice:prefix:name`) although the options
    /// do not say so. containerd's CRI writes that form whenever the kubelet's cgroup parent is a
    /// systemd slice (the kubelet's systemd cgroup driver, kubeadm's default), but for a runtime
    /// whose type is not runc's it passes no `SystemdCgroup`, only CRI's generic options; runc's
    /// cgroupfs driver would make a cgroup of that name in the shim's own, outside the pod's
    /// slice and systemd's view.
    pub fn for_cgroups_path(mut self, cgroups_path: Option<&str>) -> RuntimeOptions {
        if !self.systemd_cgroup && cgroups_path.is_some_and(is_systemd_cgroups_path) {
            self.systemd_cgroup = true;
        }
        self
    }

    /// Decodes `any`; an empty `Any` (no type) is the defaults.
    pub fn decode(any: &Any) -> Result<RuntimeOptions, OptionsError> {
        let kind = message_name(&any.type_url);
        let malformed = |why: String| OptionsError::Malformed {
            kind: kind.to_owned(),
            why,
        };
        match kind {
            "" => Ok(RuntimeOptions::default()),
            RUNC_V1 => {
                let o = RuncV1Options::parse_from_bytes(&any.value)
                    .map_err(|e| malformed(e.to_string()))?;
                Ok(RuntimeOptions {
                    binary_name: o.binary_name,
                    root: o.root,
                    shim_cgroup: o.shim_cgroup,
                    systemd_cgroup: o.systemd_cgroup,
                    no_pivot_root: o.no_pivot_root,
                    no_new_keyring: o.no_new_keyring,
                    io_uid: o.io_uid,
                    io_gid: o.io_gid,
                })
            }
            LEGACY_CREATE => legacy_create(&any.value).map_err(malformed),
            LEGACY_RUNC => legacy_runc(&any.value).map_err(malformed),
            CRI_OPTIONS => {
                let path = cri_config_path(&any.value).map_err(malformed)?;
                if path.is_empty() {
                    return Ok(RuntimeOptions::default());
                }
                let text =
                    std::fs::read_to_string(&path).map_err(|e| OptionsError::ConfigFile {
                        path: path.clone(),
                        why: e.to_string(),
                    })?;
                from_toml(&text).map_err(|why| OptionsError::ConfigFile { path, why })
            }
            other => Err(OptionsError::Unknown(other.to_owned())),
        }
    }

    /// The runc state root for `namespace`, as containerd's runc shim chooses it.
    pub fn runc_root(&self, namespace: &str) -> std::path::PathBuf {
        let base = if self.root.is_empty() {
            "/run/containerd/runc"
        } else {
            &self.root
        };
        Path::new(base).join(namespace)
    }

    /// The runc binary.
    pub fn runc_binary(&self) -> &str {
        if self.binary_name.is_empty() {
            "runc"
        } else {
            &self.binary_name
        }
    }
}

/// One field of a protobuf message: its number and its value, as this decoder needs them.
enum Field {
    Varint(u64),
    Bytes(Vec<u8>),
}

/// The fields of a message, in order; only varints and length-delimited fields (what these
/// messages use), anything else is an error.
fn fields(bytes: &[u8]) -> Result<Vec<(u32, Field)>, String> {
    let mut input = CodedInputStream::from_bytes(bytes);
    let mut out = Vec::new();
    while let Some(tag) = input.read_raw_tag_or_eof().map_err(|e| e.to_string())? {
        let (number, wire) = (tag >> 3, tag & 7);
        let field = match wire {
            0 => Field::Varint(input.read_uint64().map_err(|e| e.to_string())?),
            2 => Field::Bytes(input.read_bytes().map_err(|e| e.to_string())?),
            other => return Err(format!("field {number} has wire type {other}")),
        };
        out.push((number, field));
    }
    Ok(out)
}

fn text(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|_| "a string field is not UTF-8".to_owned())
}

/// `containerd.linux.runc.CreateOptions`: no_pivot_root 1, no_new_keyring 8, shim_cgroup 9,
/// io_uid 10, io_gid 11 (the checkpoint fields are not used by this shim).
fn legacy_create(bytes: &[u8]) -> Result<RuntimeOptions, String> {
    let mut o = RuntimeOptions::default();
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Varint(v)) => o.no_pivot_root = v != 0,
            (8, Field::Varint(v)) => o.no_new_keyring = v != 0,
            (9, Field::Bytes(b)) => o.shim_cgroup = text(b)?,
            (10, Field::Varint(v)) => o.io_uid = v as u32,
            (11, Field::Varint(v)) => o.io_gid = v as u32,
            _ => {}
        }
    }
    Ok(o)
}

/// `containerd.linux.runc.RuncOptions`: runtime 1, runtime_root 2, systemd_cgroup 4.
fn legacy_runc(bytes: &[u8]) -> Result<RuntimeOptions, String> {
    let mut o = RuntimeOptions::default();
    for (number, field) in fields(bytes)? {
        match (number, field) {
            (1, Field::Bytes(b)) => o.binary_name = text(b)?,
            (2, Field::Bytes(b)) => o.root = text(b)?,
            (4, Field::Varint(v)) => o.systemd_cgroup = v != 0,
            _ => {}
        }
    }
    Ok(o)
}

/// `runtimeoptions.v1.Options`: type_url 1, config_path 2.
fn cri_config_path(bytes: &[u8]) -> Result<String, String> {
    let mut path = String::new();
    for (number, field) in fields(bytes)? {
        if let (2, Field::Bytes(b)) = (number, field) {
            path = text(b)?;
        }
    }
    Ok(path)
}

/// runc's options from a TOML file, keyed by their Go names as CRI writes them.
fn from_toml(text: &str) -> Result<RuntimeOptions, String> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| e.message().to_owned())?;
    let mut o = RuntimeOptions::default();
    for (key, value) in &table {
        let string = || {
            value
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("{key} must be a string"))
        };
        let boolean = || {
            value
                .as_bool()
                .ok_or_else(|| format!("{key} must be true or false"))
        };
        let id = || {
            value
                .as_integer()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| format!("{key} must be a user or group id"))
        };
        match key.as_str() {
            "BinaryName" => o.binary_name = string()?,
            "Root" => o.root = string()?,
            "ShimCgroup" => o.shim_cgroup = string()?,
            "SystemdCgroup" => o.systemd_cgroup = boolean()?,
            "NoPivotRoot" => o.no_pivot_root = boolean()?,
            "NoNewKeyring" => o.no_new_keyring = boolean()?,
            "IoUid" => o.io_uid = id()?,
            "IoGid" => o.io_gid = id()?,
            // Known to runc's shim, not used by this one.
            "CriuPath" | "CriuImagePath" | "CriuWorkPath" | "TaskAPIAddress" | "TaskAPIVersion" => {
            }
            other => return Err(format!("unknown key {other}")),
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests;
