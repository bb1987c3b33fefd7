//! The GPUs' CDI spec as the node service reads it (issue #6): the NVIDIA Container Toolkit's
//! spec, from which each reservation gets the edits for its GPUs.
//!
//! On a real GPU host `nvidia-ctk cdi generate` writes a [CDI] spec (`/etc/cdi/nvidia.yaml` or
//! `/var/run/cdi/nvidia.yaml`) of kind `nvidia.com/gpu`: spec-wide `containerEdits` (control
//! nodes, the driver's libraries and binaries as bind mounts, `NVIDIA_VISIBLE_DEVICES=void`, the
//! `nvidia-cdi-hook` hooks such as `update-ldcache` and `create-symlinks`) and one device per GPU
//! index (`"0"`), per GPU UUID (`"GPU-…"`) and `all`. gpuplex applies the spec-wide edits and,
//! per assigned GPU, the device named by its UUID (else its index); never another GPU's entry,
//! never `all`.
//!
//! - [`CdiRegistry::load`] reads the `*.yaml`/`*.json` files of the spec directories (not their
//!   subdirectories), in directory order then file name order, and keeps the specs of one kind.
//!   Specs are read by gpuplex's own reader: `spec.rs` (serde types of CDI's spec, unknown
//!   fields refused, YAML or JSON) and `validate.rs` (versions, kind and device names,
//!   annotations, container edits: the rules of the reference `container-device-interface`
//!   crate, a little stricter on paths), which the tests run beside that crate over a corpus of
//!   specs (`agreement_tests.rs`); the node links none of the crate's dependencies (JSON
//!   schema, HTTP, TLS, CLI), only a YAML parser. A spec of another kind is skipped without
//!   validation (another vendor's broken spec is not gpuplex's business); a file whose kind
//!   cannot be read at all is an error, since it may be the one we need. CDI's precedence: for
//!   the same device name a later directory overrides an earlier one; two files of one
//!   directory defining the same name is an error naming both.
//! - [`CdiRegistry::edits_for`] picks the edits for an assignment, as the protocol's plain
//!   [`CdiEdits`]: the spec-wide edits of each spec that supplies one of the chosen devices
//!   (once, in order of first use), then each GPU's device edits in the order given.
//! - [`CdiRegistry::check_inventory`] compares the spec's `GPU-…` devices with the node's GPUs
//!   (a driver upgrade or a swapped card without regenerating the spec).
//!
//! The node service (`service/cdi.rs`) loads the registry and sends each reservation's
//! [`CdiEdits`] in its reply; the hook (`gpuplex_hook::cdi::apply`) only applies them, so only
//! this crate reads CDI specs and links a YAML parser. This directory depends on nothing else
//! of the node service's.
//!
//! Every error's `Display` is one line naming the file, device or GPU at fault.
//!
//! [CDI]: https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md

mod names;
mod spec;
mod validate;
mod version;

#[cfg(test)]
mod agreement_corpus;
#[cfg(test)]
mod agreement_tests;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use gpuplex_wire::config::DEFAULT_SPEC_DIRS;
use gpuplex_wire::protocol::cdi::{CdiEdits, CdiHook, CdiMount};

/// The device every NVIDIA spec has for all GPUs at once; gpuplex never applies it.
pub const ALL_DEVICE: &str = "all";
/// How a CDI spec is (re)generated, for messages.
const GENERATE: &str = "nvidia-ctk cdi generate --output=";

/// What can go wrong loading or using CDI specs. Every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// A spec directory that exists but cannot be listed, or is not a directory.
    #[error("cannot read CDI spec directory {}: {source}", dir.display())]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A spec file that cannot be read.
    #[error("cannot read CDI spec {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A spec file that does not parse, or that is not a valid CDI spec.
    #[error("CDI spec {}: {reason}", path.display())]
    Spec {
        /// The file.
        path: PathBuf,
        /// What is wrong, one line.
        reason: String,
    },
    /// Two spec files of one directory that define the same device.
    #[error("CDI specs {} and {} both define {device} and, being in the same directory, neither takes precedence: remove one", first.display(), second.display())]
    Conflict {
        /// The device, fully qualified.
        device: String,
        /// The file read first.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// Edits were asked of a registry without a spec of its kind.
    #[error("{why}")]
    NoSpec {
        /// [`CdiRegistry::why_empty`]'s line.
        why: String,
    },
    /// An assigned GPU that no device of the kind names.
    #[error("GPU {index} ({uuid}) has no device in the {kind} CDI spec {specs}: looked for {kind}={uuid} and {kind}={index}; if the GPUs changed, regenerate it: {GENERATE}{regenerate}")]
    UnknownGpu {
        /// The GPU's index.
        index: u32,
        /// The GPU's UUID.
        uuid: String,
        /// The CDI kind.
        kind: String,
        /// The spec files of the kind, joined by `, `.
        specs: String,
        /// The file to regenerate.
        regenerate: String,
    },
    /// Edits gpuplex does not apply (CDI's `netDevices`, `intelRdt`).
    #[error("CDI spec {}: {device} asks for {what}, which gpuplex does not apply", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The device (fully qualified) or `spec-wide containerEdits`.
        device: String,
        /// The edits' field.
        what: &'static str,
    },
    /// The spec's GPUs and the node's differ.
    #[error("the {kind} CDI spec {specs} does not match this node's GPUs ({}): regenerate it after a driver or GPU change: {GENERATE}{regenerate}", mismatch(spec_only, node_only))]
    Inventory {
        /// The CDI kind.
        kind: String,
        /// The spec files with GPU devices, joined by `, `.
        specs: String,
        /// UUIDs the spec has and the node lacks.
        spec_only: Vec<String>,
        /// UUIDs the node has and the spec lacks.
        node_only: Vec<String>,
        /// The file to regenerate.
        regenerate: String,
    },
}

/// The inventory mismatch in words.
fn mismatch(spec_only: &[String], node_only: &[String]) -> String {
    let mut parts = Vec::new();
    if !spec_only.is_empty() {
        parts.push(format!("in the spec only: {}", spec_only.join(", ")));
    }
    if !node_only.is_empty() {
        parts.push(format!("on the node only: {}", node_only.join(", ")));
    }
    parts.join("; ")
}

/// A message on one line: line breaks and runs of blanks become one space.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Edits as read from a spec, with the fields gpuplex refuses to apply noted.
#[derive(Clone, Debug, Default)]
struct SpecEdits {
    edits: CdiEdits,
    /// The non-empty edits fields gpuplex does not apply.
    unsupported: Vec<&'static str>,
}

impl SpecEdits {
    /// The edits of a validated spec, in the protocol's form.
    fn from_spec(edits: &spec::ContainerEdits) -> SpecEdits {
        let mut unsupported = Vec::new();
        if edits
            .net_devices
            .as_ref()
            .is_some_and(|nets| !nets.is_empty())
        {
            unsupported.push("netDevices");
        }
        if edits.intel_rdt.is_some() {
            unsupported.push("intelRdt");
        }
        let device_nodes = edits.device_nodes.iter().flatten().cloned();
        let mounts = edits.mounts.iter().flatten().map(|mount| CdiMount {
            host_path: mount.host_path.clone(),
            container_path: mount.container_path.clone(),
            mount_type: mount.mount_type.clone(),
            options: mount.options.clone().unwrap_or_default(),
        });
        let hooks = edits.hooks.iter().flatten().map(|hook| CdiHook {
            hook_name: hook.hook_name.clone(),
            path: hook.path.clone(),
            args: hook.args.clone().unwrap_or_default(),
            env: hook.env.clone().unwrap_or_default(),
            timeout: hook.timeout,
        });
        let edits = CdiEdits {
            env: edits.env.clone().unwrap_or_default(),
            device_nodes: device_nodes.collect(),
            mounts: mounts.collect(),
            hooks: hooks.collect(),
            additional_gids: edits.additional_gids.clone().unwrap_or_default(),
            ..CdiEdits::default()
        };
        SpecEdits { edits, unsupported }
    }
}

/// One spec file of the kind, validated.
#[derive(Clone, Debug)]
struct SpecFile {
    path: PathBuf,
    /// The index of its directory in the list: its precedence.
    dir: usize,
    /// The spec-wide edits.
    edits: SpecEdits,
    /// The device edits by device name.
    devices: BTreeMap<String, SpecEdits>,
}

/// What reading a spec file found.
enum Read {
    /// A spec of the kind.
    Ours(Box<SpecFile>),
    /// A spec of this other kind, not validated.
    Other(String),
}

/// The `*.yaml`/`*.json` files directly in `dir`, by file name; `None` when `dir` is absent.
fn spec_files(dir: &Path) -> Result<Option<Vec<PathBuf>>, CdiError> {
    let dir_error = |source| CdiError::Dir {
        dir: dir.to_path_buf(),
        source,
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(dir_error(err)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(dir_error)?.path();
        let is_dir = fs::metadata(&path).is_ok_and(|meta| meta.is_dir());
        if !is_dir && spec::is_spec_file_name(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(Some(files))
}

/// Reads one spec file: its kind first, leniently, then (when it is `kind`) strictly, and
/// validates it.
fn read_spec(path: &Path, dir: usize, kind: &str) -> Result<Read, CdiError> {
    let spec_error = |reason: String| CdiError::Spec {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = fs::read(path).map_err(|source| CdiError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let found = spec::kind_of(&bytes).map_err(|err| spec_error(err.to_string()))?;
    if found != kind {
        return Ok(Read::Other(found));
    }
    let parsed = spec::parse(&bytes).map_err(|err| spec_error(err.to_string()))?;
    validate::validate(&parsed)
        .map_err(|err| spec_error(format!("not a valid CDI spec: {err}")))?;
    let edits = match &parsed.container_edits {
        Some(edits) => SpecEdits::from_spec(edits),
        None => SpecEdits::default(),
    };
    let devices = parsed
        .devices
        .iter()
        .map(|device| {
            let edits = SpecEdits::from_spec(&device.container_edits);
            (device.name.clone(), edits)
        })
        .collect();
    Ok(Read::Ours(Box::new(SpecFile {
        path: path.to_path_buf(),
        dir,
        edits,
        devices,
    })))
}

/// The CDI specs of one kind, read from the spec directories, with CDI's precedence applied.
#[derive(Clone, Debug)]
pub struct CdiRegistry {
    kind: String,
    dirs: Vec<PathBuf>,
    /// The directories (indices into `dirs`) that do not exist.
    absent: Vec<usize>,
    /// The kinds of the other specs found, for [`CdiRegistry::why_empty`].
    other_kinds: BTreeSet<String>,
    /// The specs of the kind, in directory then file name order.
    specs: Vec<SpecFile>,
    /// Each device name and the spec (index into `specs`) whose entry wins.
    owners: BTreeMap<String, usize>,
}

impl CdiRegistry {
    /// Reads the specs of `kind` in `dirs` (lowest precedence first). No spec of the kind, or
    /// no directory at all, is an empty registry ([`CdiRegistry::is_empty`]); a file that cannot
    /// be read, parsed or validated is an error.
    pub fn load(dirs: &[PathBuf], kind: &str) -> Result<CdiRegistry, CdiError> {
        let mut absent = Vec::new();
        let mut other_kinds = BTreeSet::new();
        let mut specs = Vec::new();
        for (index, dir) in dirs.iter().enumerate() {
            let Some(files) = spec_files(dir)? else {
                absent.push(index);
                continue;
            };
            for path in files {
                match read_spec(&path, index, kind)? {
                    Read::Ours(spec) => specs.push(*spec),
                    Read::Other(other) => {
                        other_kinds.insert(other);
                    }
                }
            }
        }
        let owners = owners(kind, &specs)?;
        Ok(CdiRegistry {
            kind: kind.to_owned(),
            dirs: dirs.to_vec(),
            absent,
            other_kinds,
            specs,
            owners,
        })
    }

    /// The kind the registry holds.
    #[cfg(test)]
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Whether no spec of the kind was found.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// The spec files of the kind, in the order read.
    pub fn spec_files(&self) -> Vec<&Path> {
        self.specs.iter().map(|spec| spec.path.as_path()).collect()
    }

    /// The device names of the kind, after precedence, sorted.
    #[cfg(test)]
    pub fn device_names(&self) -> Vec<&str> {
        self.owners.keys().map(String::as_str).collect()
    }

    /// When the registry is empty, one line saying where it looked and how to make a spec.
    pub fn why_empty(&self) -> Option<String> {
        if !self.is_empty() {
            return None;
        }
        let dirs: Vec<String> = self
            .dirs
            .iter()
            .enumerate()
            .map(|(index, dir)| match self.absent.contains(&index) {
                true => format!("{} (absent)", dir.display()),
                false => dir.display().to_string(),
            })
            .collect();
        let searched = match dirs.is_empty() {
            true => "no CDI spec directory is configured".to_owned(),
            false => format!("searched {}", dirs.join(", ")),
        };
        let others = match self.other_kinds.is_empty() {
            true => String::new(),
            false => {
                let kinds: Vec<&str> = self.other_kinds.iter().map(String::as_str).collect();
                format!(", found only {}", kinds.join(", "))
            }
        };
        Some(format!(
            "no CDI spec of kind {} ({searched}{others}); generate one: {GENERATE}{}",
            self.kind,
            self.default_output().display()
        ))
    }

    /// Where a new spec would go: `nvidia.yaml` in the first directory.
    fn default_output(&self) -> PathBuf {
        let dir = self
            .dirs
            .first()
            .cloned()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SPEC_DIRS[0]));
        dir.join("nvidia.yaml")
    }

    /// The spec files of the kind, joined, and the one to regenerate, for messages.
    fn files_for_message(&self, specs: &[usize]) -> (String, String) {
        let paths: Vec<String> = specs
            .iter()
            .map(|&index| self.specs[index].path.display().to_string())
            .collect();
        let regenerate = paths
            .last()
            .cloned()
            .unwrap_or_else(|| self.default_output().display().to_string());
        (paths.join(", "), regenerate)
    }

    /// The device entry for one GPU: its UUID's, else its index's; never [`ALL_DEVICE`].
    fn device_for(&self, index: u32, uuid: &str) -> Option<(&str, usize)> {
        let by_index = index.to_string();
        let found = [uuid, by_index.as_str()]
            .into_iter()
            .filter(|name| !name.is_empty() && *name != ALL_DEVICE)
            .find_map(|name| self.owners.get_key_value(name));
        found.map(|(name, &spec)| (name.as_str(), spec))
    }

    /// The edits for the assigned GPUs `(index, uuid)`: the spec-wide edits of each spec that
    /// supplies one of their devices, then each GPU's device edits, in the order given (a GPU
    /// listed twice counts once). An empty list gives empty edits.
    pub fn edits_for(&self, gpus: &[(u32, &str)]) -> Result<CdiEdits, CdiError> {
        if gpus.is_empty() {
            return Ok(CdiEdits::default());
        }
        if let Some(why) = self.why_empty() {
            return Err(CdiError::NoSpec { why });
        }
        let mut chosen: Vec<(&str, usize)> = Vec::new();
        for &(index, uuid) in gpus {
            let Some(device) = self.device_for(index, uuid) else {
                let all: Vec<usize> = (0..self.specs.len()).collect();
                let (specs, regenerate) = self.files_for_message(&all);
                return Err(CdiError::UnknownGpu {
                    index,
                    uuid: uuid.to_owned(),
                    kind: self.kind.clone(),
                    specs,
                    regenerate,
                });
            };
            if !chosen.contains(&device) {
                chosen.push(device);
            }
        }
        let mut used: Vec<usize> = Vec::new();
        for &(_, spec) in &chosen {
            if !used.contains(&spec) {
                used.push(spec);
            }
        }
        let mut merged = CdiEdits::default();
        for &spec in &used {
            let file = &self.specs[spec];
            supported(file, "spec-wide containerEdits".to_owned(), &file.edits)?;
            merged.append(&file.edits.edits);
            merged.spec_files.push(file.path.clone());
        }
        for &(name, spec) in &chosen {
            let file = &self.specs[spec];
            let qualified = format!("{}={name}", self.kind);
            let edits = &file.devices[name];
            supported(file, qualified.clone(), edits)?;
            merged.append(&edits.edits);
            merged.cdi_devices.push(qualified);
        }
        Ok(merged)
    }

    /// Compares the spec's GPUs (devices named `GPU-…`) with the node's GPU UUIDs: one error
    /// naming the GPUs only one side has. A registry without any `GPU-…` device (empty, or
    /// generated with index names only) has nothing to compare and passes;
    /// [`CdiRegistry::edits_for`] still refuses a GPU it has no entry for.
    pub fn check_inventory(&self, uuids: &[&str]) -> Result<(), CdiError> {
        let in_spec: BTreeSet<&str> = self
            .owners
            .keys()
            .map(String::as_str)
            .filter(|name| looks_like_gpu_uuid(name))
            .collect();
        if in_spec.is_empty() {
            return Ok(());
        }
        let on_node: BTreeSet<&str> = uuids.iter().copied().collect();
        let spec_only: Vec<String> = in_spec
            .difference(&on_node)
            .map(|uuid| (*uuid).to_owned())
            .collect();
        let mut node_only: Vec<String> = Vec::new();
        for uuid in uuids {
            if !in_spec.contains(uuid) && !node_only.iter().any(|seen| seen == uuid) {
                node_only.push((*uuid).to_owned());
            }
        }
        if spec_only.is_empty() && node_only.is_empty() {
            return Ok(());
        }
        let mut with_gpus: Vec<usize> = Vec::new();
        for name in &in_spec {
            let spec = self.owners[*name];
            if !with_gpus.contains(&spec) {
                with_gpus.push(spec);
            }
        }
        with_gpus.sort_unstable();
        let (specs, regenerate) = self.files_for_message(&with_gpus);
        Err(CdiError::Inventory {
            kind: self.kind.clone(),
            specs,
            spec_only,
            node_only,
            regenerate,
        })
    }
}

/// Whether a device name is a GPU UUID, as NVIDIA names them (`GPU-` then hex and dashes).
fn looks_like_gpu_uuid(name: &str) -> bool {
    name.strip_prefix("GPU-").is_some_and(|rest| {
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
    })
}

/// Refuses edits that gpuplex does not apply.
fn supported(file: &SpecFile, device: String, edits: &SpecEdits) -> Result<(), CdiError> {
    match edits.unsupported.first() {
        Some(&what) => Err(CdiError::Unsupported {
            path: file.path.clone(),
            device,
            what,
        }),
        None => Ok(()),
    }
}

/// CDI's precedence: each device name belongs to the last spec that defines it, a later
/// directory overriding an earlier one; two specs of one directory defining it is an error.
fn owners(kind: &str, specs: &[SpecFile]) -> Result<BTreeMap<String, usize>, CdiError> {
    let mut owners: BTreeMap<String, usize> = BTreeMap::new();
    for (index, spec) in specs.iter().enumerate() {
        for name in spec.devices.keys() {
            if let Some(&earlier) = owners.get(name) {
                if specs[earlier].dir == spec.dir {
                    return Err(CdiError::Conflict {
                        device: format!("{kind}={name}"),
                        first: specs[earlier].path.clone(),
                        second: spec.path.clone(),
                    });
                }
            }
            owners.insert(name.clone(), index);
        }
    }
    Ok(owners)
}
