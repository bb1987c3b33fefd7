//! `gpuplex.toml`: the node's configuration, read once at start.
//!
//! Four sections: `[scheduler]` and `[policy]` (the scheduler core's, see
//! [`gpuplex_scheduler::config`] and [`gpuplex_scheduler::policy`]), `[service]` (this crate's:
//! socket, state, activity sampling, metrics) and any number of `[[fake_gpu]]` entries. Every key has a default, an
//! absent file at the default path means every default, and an unknown section or key, or a bad
//! value, is refused with one line naming the file, the line and the key.
//!
//! `config/gpuplex.toml` documents every key at its default; a test holds it equal to
//! [`NodeConfig::default`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuplex_scheduler::config::SchedulerConfig;
use gpuplex_scheduler::policy::PolicyConfig;
use gpuplex_scheduler::quantity::parse_quantity;
use gpuplex_scheduler::time::format_duration;
use gpuplex_scheduler::toml_place::TomlPlace;
use serde::Deserialize;

/// Where the configuration is found (`--config`, `$GPUPLEX_CONFIG`, the default path): one rule
/// for the service, gpuplexctl and the hook, kept with the hook's client.
pub use gpuplex_hook::client::{
    config_path, CONFIG_ENV as PATH_ENV, DEFAULT_CONFIG as DEFAULT_PATH,
};

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
            socket: PathBuf::from(gpuplex_hook::client::DEFAULT_SOCKET),
            state_dir: PathBuf::from("/run/gpuplex/state"),
            activity: ActivityChoice::Auto,
            sample_interval: Duration::from_millis(50),
            freeze_timeout: Duration::from_secs(1),
            metrics_listen: String::new(),
            node_name: String::new(),
            cdi_spec_dirs: gpuplex_hook::cdi::DEFAULT_SPEC_DIRS
                .iter()
                .map(PathBuf::from)
                .collect(),
            cdi_kind: gpuplex_hook::cdi::DEFAULT_KIND.to_owned(),
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
}

/// Why a configuration cannot be used. One line, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the configuration {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid, or a value is not accepted.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line and key where known.
        message: String,
    },
}

impl NodeConfig {
    /// Reads the file. An absent file that was not named gives the defaults.
    pub fn load(path: &Path, named: bool) -> Result<NodeConfig, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => NodeConfig::parse(&text).map_err(|message| ConfigError::Invalid {
                path: path.to_path_buf(),
                message,
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

    /// Reads a configuration's text; the error is one line.
    pub fn parse(text: &str) -> Result<NodeConfig, String> {
        let document: Document = toml::from_str(text).map_err(|e| {
            let TomlPlace { line, key, message } = TomlPlace::of(text, &e);
            match (line, key) {
                (Some(l), Some(k)) => format!("line {l} ({k}): {message}"),
                (Some(l), None) => format!("line {l}: {message}"),
                (None, _) => message,
            }
        })?;
        document.scheduler.validate().map_err(|e| e.to_string())?;
        document.policy.validate().map_err(|e| e.to_string())?;
        document.service.validate()?;
        let mut fake_gpus: Vec<FakeGpu> = Vec::new();
        for (i, entry) in document.fake_gpu.into_iter().enumerate() {
            let at = format!("fake_gpu[{i}]");
            let memory = parse_quantity(&entry.memory).map_err(|e| {
                format!(
                    "{at}.memory = {:?} is not accepted: {e}",
                    entry.memory.as_str()
                )
            })?;
            if memory == 0 {
                return Err(format!(
                    "{at}.memory = \"0\" is not accepted: a GPU has memory"
                ));
            }
            if entry.uuid.trim().is_empty() || entry.uuid.contains(char::is_whitespace) {
                return Err(format!(
                    "{at}.uuid = {:?} is not accepted: a UUID like \"GPU-fake-0\", without spaces",
                    entry.uuid
                ));
            }
            if fake_gpus.iter().any(|g| g.uuid == entry.uuid) {
                return Err(format!(
                    "{at}.uuid = {:?} is not accepted: another fake GPU has it",
                    entry.uuid
                ));
            }
            if entry.model.trim().is_empty() {
                return Err(format!("{at}.model = \"\" is not accepted: name a model"));
            }
            if !entry.device.is_absolute() {
                return Err(format!(
                    "{at}.device = {:?} is not accepted: an absolute path like \"/dev/nvidia0\"",
                    entry.device
                ));
            }
            fake_gpus.push(FakeGpu {
                uuid: entry.uuid,
                model: entry.model,
                memory,
                device: entry.device,
            });
        }
        Ok(NodeConfig {
            scheduler: document.scheduler,
            policy: document.policy,
            service: document.service,
            fake_gpus,
        })
    }
}

impl ServiceConfig {
    fn validate(&self) -> Result<(), String> {
        let bad = |key: &str, value: String, accepted: &str| {
            Err(format!(
                "service.{key} = {value} is not accepted: {accepted}"
            ))
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
        let cdi = gpuplex_hook::cdi::CdiSettings {
            spec_dirs: self.cdi_spec_dirs.clone(),
            kind: self.cdi_kind.clone(),
        };
        cdi.validate()?;
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

#[cfg(test)]
mod tests;
