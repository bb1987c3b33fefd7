//! `gpuplex.toml`: the node's configuration, read once at start, and the one reader of it.
//!
//! Four sections: `[scheduler]` and `[policy]` (the scheduler core's, see
//! [`gpuplex_scheduler::config`] and [`gpuplex_scheduler::policy`]), `[service]` (the node
//! service's: socket, state, activity sampling, metrics, CDI) and any number of `[[fake_gpu]]`
//! entries. Every key has a default, an absent file at the default path means every default,
//! and an unknown section or key, or a bad value, is refused with one line naming the file, the
//! line and the key.
//!
//! The node service, the containerd shim, the hook and `gpuplexctl` all read the file with
//! [`NodeConfig::load`]: a file the service runs with never makes the hook refuse a container,
//! and a file the hook refuses, the service refuses too.
//!
//! `config/gpuplex.toml` documents every key at its default; a test holds it equal to
//! [`NodeConfig::default`].

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_scheduler::config::{ConfigError as CoreConfigError, SchedulerConfig};
use gpuplex_scheduler::policy::PolicyConfig;
use gpuplex_scheduler::quantity::parse_quantity;
use gpuplex_scheduler::time::format_duration;
use gpuplex_scheduler::toml_place::TomlPlace;
use serde::Deserialize;

use crate::socket::DEFAULT_SOCKET;

/// The configuration file read when none is named.
pub const DEFAULT_CONFIG: &str = "/etc/gpuplex/gpuplex.toml";
/// The environment variable that names another configuration file.
pub const CONFIG_ENV: &str = "GPUPLEX_CONFIG";
/// The CDI spec directories when none are configured, lowest precedence first.
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
/// The CDI kind of NVIDIA's GPUs.
pub const DEFAULT_KIND: &str = "nvidia.com/gpu";

/// The configuration file to read: `flag` (`--config`), else `env` (`$GPUPLEX_CONFIG`, when not
/// empty), else [`DEFAULT_CONFIG`]. The second value says whether it was named: a named file must
/// exist, the default one may be absent (see [`NodeConfig::load`]).
pub fn config_path(flag: Option<&Path>, env: Option<&OsStr>) -> (PathBuf, bool) {
    match (flag, env.filter(|e| !e.is_empty())) {
        (Some(p), _) => (p.to_path_buf(), true),
        (None, Some(e)) => (PathBuf::from(e), true),
        (None, None) => (PathBuf::from(DEFAULT_CONFIG), false),
    }
}

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeConfig {
    /// `[scheduler]`.
    pub scheduler: SchedulerConfig,
    /// `[policy]`.
    pub policy: PolicyConfig,
    /// `[service]`.
    pub service: ServiceConfig,
    /// `[[fake_gpu]]`, in order: the first is GPU 0.
    pub fake_gpus: Vec<FakeGpu>,
    /// `[kubernetes]`.
    pub kubernetes: KubernetesConfig,
}

/// Which activity source tells who has GPU work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivityChoice {
    /// `nvml` when NVML loads, else `cpu`.
    #[default]
    Auto,
    /// Per-process GPU utilization from NVML.
    Nvml,
    /// The container's CPU time grows (a stand-in for machines without a GPU).
    Cpu,
    /// Every running container has work.
    Always,
}

/// `[service]`: the node service itself.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceConfig {
    /// The node socket.
    pub socket: PathBuf,
    /// Where registrations are kept across restarts.
    pub state_dir: PathBuf,
    /// The activity source.
    pub activity: ActivityChoice,
    /// How often activity is sampled.
    #[serde(with = "gpuplex_scheduler::time::serde_duration")]
    pub sample_interval: Duration,
    /// How long a freeze may take before it is undone and reported.
    #[serde(with = "gpuplex_scheduler::time::serde_duration")]
    pub freeze_timeout: Duration,
    /// `host:port` of the Prometheus endpoint; empty: off.
    pub metrics_listen: String,
    /// The node's name in status and metrics; empty: the host name.
    pub node_name: String,
    /// Where CDI specs are looked for, later directories overriding earlier ones.
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// The CDI kind of the GPUs' spec.
    pub cdi_kind: String,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            socket: PathBuf::from(DEFAULT_SOCKET),
            state_dir: PathBuf::from("/run/gpuplex/state"),
            activity: ActivityChoice::Auto,
            sample_interval: Duration::from_millis(50),
            freeze_timeout: Duration::from_secs(1),
            metrics_listen: String::new(),
            node_name: String::new(),
            cdi_spec_dirs: DEFAULT_SPEC_DIRS.iter().map(PathBuf::from).collect(),
            cdi_kind: DEFAULT_KIND.to_owned(),
        }
    }
}

/// A `[[fake_gpu]]`: a GPU that is not there, for machines without one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeGpu {
    /// Its UUID (what `CUDA_VISIBLE_DEVICES` gets).
    pub uuid: String,
    /// Its model name.
    pub model: String,
    /// Its memory in bytes.
    pub memory: u64,
    /// The character device node that stands for it (made with `mknod`, major 195).
    pub device: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FakeGpuEntry {
    uuid: String,
    model: String,
    memory: String,
    device: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    #[serde(default)]
    scheduler: SchedulerConfig,
    #[serde(default)]
    policy: PolicyConfig,
    #[serde(default)]
    service: ServiceConfig,
    #[serde(default)]
    fake_gpu: Vec<FakeGpuEntry>,
    #[serde(default)]
    kubernetes: KubernetesEntry,
}

/// Why a configuration file cannot be used. One line, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the configuration {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid, or a value is not accepted.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line and key where known.
        #[source]
        source: InvalidConfig,
    },
}

/// What is wrong with a configuration's text. One line naming the key (and the line, where
/// TOML knows it), the value and what is accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidConfig {
    /// Not TOML, an unknown section or key, a value of the wrong type or form; or a
    /// `[scheduler]` or `[policy]` value the core does not accept.
    #[error(transparent)]
    Core(#[from] CoreConfigError),
    /// A `[service]` or `[[fake_gpu]]` value that is not accepted.
    #[error("{key} = {value} is not accepted: {accepted}")]
    Value {
        /// The key path, like `service.socket` or `fake_gpu[1].uuid`.
        key: String,
        /// The value, as TOML would write it.
        value: String,
        /// What the key accepts.
        accepted: String,
    },
}

/// An [`InvalidConfig::Value`].
fn refused(key: impl Into<String>, value: String, accepted: impl Into<String>) -> InvalidConfig {
    InvalidConfig::Value {
        key: key.into(),
        value,
        accepted: accepted.into(),
    }
}

impl NodeConfig {
    /// Reads the file. An absent file that was not `named` gives the defaults; a named one
    /// must exist.
    pub fn load(path: &Path, named: bool) -> Result<NodeConfig, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => NodeConfig::parse(&text).map_err(|source| ConfigError::Invalid {
                path: path.to_path_buf(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !named => {
                Ok(NodeConfig::default())
            }
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Reads a configuration's text and checks every value.
    pub fn parse(text: &str) -> Result<NodeConfig, InvalidConfig> {
        let document: Document = toml::from_str(text).map_err(|e| {
            let TomlPlace { line, key, message } = TomlPlace::of(text, &e);
            CoreConfigError::Toml { line, key, message }
        })?;
        document.scheduler.validate()?;
        document.policy.validate()?;
        document.service.validate()?;
        let mut fake_gpus: Vec<FakeGpu> = Vec::new();
        for (i, entry) in document.fake_gpu.into_iter().enumerate() {
            let fake_gpu = entry.check(i, &fake_gpus)?;
            fake_gpus.push(fake_gpu);
        }
        let kubernetes = document.kubernetes.check()?;
        Ok(NodeConfig {
            scheduler: document.scheduler,
            policy: document.policy,
            service: document.service,
            fake_gpus,
            kubernetes,
        })
    }
}

impl FakeGpuEntry {
    /// The `index`th `[[fake_gpu]]`, checked, after the `earlier` ones.
    fn check(self, index: usize, earlier: &[FakeGpu]) -> Result<FakeGpu, InvalidConfig> {
        let key = |name: &str| format!("fake_gpu[{index}].{name}");
        let memory = parse_quantity(&self.memory)
            .map_err(|e| refused(key("memory"), format!("{:?}", self.memory), e.to_string()))?;
        if memory == 0 {
            return Err(refused(key("memory"), "\"0\"".into(), "a GPU has memory"));
        }
        if self.uuid.trim().is_empty() || self.uuid.contains(char::is_whitespace) {
            return Err(refused(
                key("uuid"),
                format!("{:?}", self.uuid),
                "a UUID like \"GPU-fake-0\", without spaces",
            ));
        }
        if earlier.iter().any(|g| g.uuid == self.uuid) {
            return Err(refused(
                key("uuid"),
                format!("{:?}", self.uuid),
                "another fake GPU has it",
            ));
        }
        if self.model.trim().is_empty() {
            return Err(refused(key("model"), "\"\"".into(), "name a model"));
        }
        if !self.device.is_absolute() {
            return Err(refused(
                key("device"),
                format!("{:?}", self.device),
                "an absolute path like \"/dev/nvidia0\"",
            ));
        }
        Ok(FakeGpu {
            uuid: self.uuid,
            model: self.model,
            memory,
            device: self.device,
        })
    }
}

/// Where the GPUs' CDI spec is and which kind the GPUs are: `cdi_spec_dirs` and `cdi_kind` of
/// `[service]`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiSettings {
    /// The directories, later ones overriding earlier ones.
    pub spec_dirs: Vec<PathBuf>,
    /// The kind.
    pub kind: String,
}

impl Default for CdiSettings {
    fn default() -> Self {
        ServiceConfig::default().cdi()
    }
}

impl CdiSettings {
    /// The one check of `cdi_spec_dirs` and `cdi_kind`.
    fn validate(&self) -> Result<(), InvalidConfig> {
        if let Some(empty) = self.spec_dirs.iter().find(|d| d.as_os_str().is_empty()) {
            return Err(refused(
                "service.cdi_spec_dirs",
                format!("[{:?}]", empty),
                "a list of directories, like [\"/etc/cdi\", \"/var/run/cdi\"]",
            ));
        }
        if !self.kind.contains('/') {
            return Err(refused(
                "service.cdi_kind",
                format!("{:?}", self.kind),
                "a CDI kind like \"nvidia.com/gpu\"",
            ));
        }
        Ok(())
    }
}

impl ServiceConfig {
    /// Its CDI settings.
    pub fn cdi(&self) -> CdiSettings {
        CdiSettings {
            spec_dirs: self.cdi_spec_dirs.clone(),
            kind: self.cdi_kind.clone(),
        }
    }

    fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |key: &str, value: String, accepted: &str| {
            Err(refused(format!("service.{key}"), value, accepted))
        };
        let ms = Duration::from_millis;
        if self.sample_interval < ms(1) || self.sample_interval > ms(60_000) {
            return bad(
                "sample_interval",
                format!("\"{}\"", format_duration(self.sample_interval)),
                "a duration from 1ms to 1m, like \"50ms\"",
            );
        }
        if self.freeze_timeout < ms(1) || self.freeze_timeout > ms(60_000) {
            return bad(
                "freeze_timeout",
                format!("\"{}\"", format_duration(self.freeze_timeout)),
                "a duration from 1ms to 1m, like \"1s\"",
            );
        }
        for (key, path) in [("socket", &self.socket), ("state_dir", &self.state_dir)] {
            if !path.is_absolute() {
                return bad(key, format!("{path:?}"), "an absolute path");
            }
        }
        self.cdi().validate()?;
        if !self.metrics_listen.is_empty()
            && self.metrics_listen.parse::<std::net::SocketAddr>().is_err()
        {
            return bad(
                "metrics_listen",
                format!("{:?}", self.metrics_listen),
                "an address and port like \"127.0.0.1:9400\" or \"[::]:9400\", or \"\" for off",
            );
        }
        Ok(())
    }
}

mod kubernetes;
use kubernetes::KubernetesEntry;
pub use kubernetes::{DeviceDelivery, KubeletPlugin, KubernetesConfig};

#[cfg(test)]
mod tests;
