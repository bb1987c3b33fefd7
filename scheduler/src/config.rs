//! The `[scheduler]` section of `gpuplex.toml`: how GPUs are assigned and how long windows last.
//!
//! | key | default | accepted |
//! |---|---|---|
//! | `slice` | `"200ms"` | a duration from `1ms` to `1h` |
//! | `idle_grace` | `"100ms"` | a duration above 0, at most `1h` |
//! | `policy` | `"spread"` | `"spread"` or `"pack"` |
//! | `memory_overcommit` | `1.0` | a number above 0, at most 100 |
//! | `reservation_ttl` | `"60s"` | a duration above 0 |
//! | `stop_grace` | `"30s"` | a duration above 0, at most `1h` |
//!
//! The documented defaults live in `config/gpuplex.toml`; a test holds them equal to
//! [`SchedulerConfig::default`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::inventory::AssignmentPolicy;
use crate::time::format_duration;
use crate::toml_place::TomlPlace;

/// The scheduler's settings (`[scheduler]` in `gpuplex.toml`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Window length for weight 1 (a window lasts `slice` × weight).
    #[serde(with = "crate::time::serde_duration")]
    pub slice: Duration,
    /// A window whose holder shows no work for this long ends early.
    #[serde(with = "crate::time::serde_duration")]
    pub idle_grace: Duration,
    /// Which GPU a request gets among those that can hold it, once idle GPUs are preferred.
    pub policy: AssignmentPolicy,
    /// Factor on each GPU's memory for admission: the entitlements bound on a GPU never exceed
    /// its capacity × this (1.0: never beyond its memory).
    pub memory_overcommit: f64,
    /// An assignment made before its container exists lapses if no container attaches to it
    /// within this.
    #[serde(with = "crate::time::serde_duration")]
    pub reservation_ttl: Duration,
    /// A container with a pending SIGTERM, SIGINT or SIGQUIT is thawed and kept out of windows
    /// for this long, once (its graceful shutdown; Kubernetes' default grace is 30 s); one with
    /// a pending SIGKILL until it exits.
    #[serde(with = "crate::time::serde_duration")]
    pub stop_grace: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            slice: Duration::from_millis(200),
            idle_grace: Duration::from_millis(100),
            policy: AssignmentPolicy::Spread,
            memory_overcommit: 1.0,
            reservation_ttl: Duration::from_secs(60),
            stop_grace: Duration::from_secs(30),
        }
    }
}

/// A `[scheduler]` section that cannot be used. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The document is not TOML, or its `[scheduler]` table does not read as settings (an
    /// unknown key, a value of the wrong type or form).
    #[error("{}{message}", place(*.line, .key.as_deref()))]
    Toml {
        /// The line of the error, from 1, when known.
        line: Option<usize>,
        /// The key path at that place (`scheduler.slice`), when known.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A value outside what the key accepts.
    #[error("{key} = {value} is not accepted: {accepted}")]
    Invalid {
        /// The key path, like `scheduler.slice`.
        key: &'static str,
        /// The value, as TOML would write it.
        value: String,
        /// What the key accepts.
        accepted: &'static str,
    },
}

fn place(line: Option<usize>, key: Option<&str>) -> String {
    match (line, key) {
        (Some(line), Some(key)) => format!("line {line} ({key}): "),
        (Some(line), None) => format!("line {line}: "),
        (None, Some(key)) => format!("{key}: "),
        (None, None) => String::new(),
    }
}

const HOUR: Duration = Duration::from_secs(3600);

impl SchedulerConfig {
    /// Checks every value against what its key accepts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let duration = |key, d: Duration, accepted| ConfigError::Invalid {
            key,
            value: format!("\"{}\"", format_duration(d)),
            accepted,
        };
        if self.slice < Duration::from_millis(1) || self.slice > HOUR {
            return Err(duration(
                "scheduler.slice",
                self.slice,
                "a duration from 1ms to 1h, like \"200ms\"",
            ));
        }
        if self.idle_grace.is_zero() || self.idle_grace > HOUR {
            return Err(duration(
                "scheduler.idle_grace",
                self.idle_grace,
                "a duration above 0 and at most 1h, like \"100ms\"",
            ));
        }
        let overcommit = self.memory_overcommit;
        if !(overcommit.is_finite() && overcommit > 0.0 && overcommit <= 100.0) {
            return Err(ConfigError::Invalid {
                key: "scheduler.memory_overcommit",
                value: toml_float(overcommit),
                accepted: "a number above 0 and at most 100, like 1.0 (no overcommit) or 1.5",
            });
        }
        if self.reservation_ttl.is_zero() {
            return Err(duration(
                "scheduler.reservation_ttl",
                self.reservation_ttl,
                "a duration above 0, like \"60s\"",
            ));
        }
        if self.stop_grace.is_zero() || self.stop_grace > HOUR {
            return Err(duration(
                "scheduler.stop_grace",
                self.stop_grace,
                "a duration above 0 and at most 1h, like \"30s\"",
            ));
        }
        Ok(())
    }

    /// Reads the `[scheduler]` table of a whole `gpuplex.toml` document and validates it. Other
    /// tables are ignored (they belong to the node service); a missing `[scheduler]` table gives
    /// the defaults, and so does a missing key.
    pub fn from_toml(text: &str) -> Result<SchedulerConfig, ConfigError> {
        #[derive(Deserialize)]
        struct Document {
            #[serde(default)]
            scheduler: SchedulerConfig,
        }
        let document: Document = toml::from_str(text).map_err(|e| {
            let TomlPlace { line, key, message } = TomlPlace::of(text, &e);
            ConfigError::Toml { line, key, message }
        })?;
        document.scheduler.validate()?;
        Ok(document.scheduler)
    }
}

/// A float as TOML writes it: `1.0`, `nan`, `inf`.
fn toml_float(x: f64) -> String {
    if x.is_nan() {
        "nan".to_string()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.to_string()
    } else {
        format!("{x:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS_FILE: &str = include_str!("../../config/gpuplex.toml");

    #[test]
    fn the_installed_file_documents_the_defaults() {
        assert_eq!(
            SchedulerConfig::from_toml(DEFAULTS_FILE),
            Ok(SchedulerConfig::default())
        );
        // Every key is written out, not left to the defaults.
        for key in [
            "slice",
            "idle_grace",
            "policy",
            "memory_overcommit",
            "reservation_ttl",
        ] {
            let written = DEFAULTS_FILE
                .lines()
                .any(|l| l.split('=').next().map(str::trim) == Some(key));
            assert!(written, "config/gpuplex.toml does not set {key}");
        }
    }

    #[test]
    fn missing_table_or_keys_give_the_defaults_and_other_tables_are_ignored() {
        let cases = [
            "",
            "[scheduler]\n",
            "state_dir = \"/var/lib/gpuplex\"\n[[fake_gpu]]\nmodel = \"Fake GPU\"\nslice = 3\n",
            "[node]\nunknown = { deep = [1, 2] }\n[scheduler]\n[other]\nslice = \"0s\"\n",
        ];
        for text in cases {
            assert_eq!(
                SchedulerConfig::from_toml(text),
                Ok(SchedulerConfig::default()),
                "{text}"
            );
        }
    }

    #[test]
    fn every_key_is_read() {
        let text = "[scheduler]\nslice = \"50ms\"\nidle_grace = \"1s\"\npolicy = \"pack\"\n\
                    memory_overcommit = 2\nreservation_ttl = \"5m\"\nstop_grace = \"2m\"\n";
        let expected = SchedulerConfig {
            slice: Duration::from_millis(50),
            idle_grace: Duration::from_secs(1),
            policy: AssignmentPolicy::Pack,
            memory_overcommit: 2.0,
            reservation_ttl: Duration::from_secs(300),
            stop_grace: Duration::from_secs(120),
        };
        assert_eq!(SchedulerConfig::from_toml(text), Ok(expected.clone()));
        let dotted = "scheduler.policy = \"pack\"\nscheduler.slice = \"50ms\"\n";
        let config = SchedulerConfig::from_toml(dotted).unwrap();
        assert_eq!(
            (config.policy, config.slice),
            (expected.policy, expected.slice)
        );
    }

    #[test]
    fn written_config_reads_back() {
        let config = SchedulerConfig {
            slice: Duration::from_micros(1500),
            policy: AssignmentPolicy::Pack,
            memory_overcommit: 1.25,
            ..SchedulerConfig::default()
        };
        let text = format!("[scheduler]\n{}", toml::to_string(&config).unwrap());
        assert_eq!(SchedulerConfig::from_toml(&text), Ok(config));
    }

    #[test]
    fn bad_values_are_refused_naming_key_value_and_what_is_accepted() {
        let cases: &[(&str, &str)] = &[
            (r#"slice = "0s""#, r#"scheduler.slice = "0s" is not accepted: a duration from 1ms to 1h, like "200ms""#),
            (r#"slice = "999us""#, r#"scheduler.slice = "999us" is not accepted: a duration from 1ms to 1h"#),
            (r#"slice = "61m""#, r#"scheduler.slice = "1.017h" is not accepted: a duration from 1ms to 1h"#),
            (r#"idle_grace = "0ms""#, r#"scheduler.idle_grace = "0s" is not accepted: a duration above 0 and at most 1h, like "100ms""#),
            (r#"idle_grace = "2h""#, r#"scheduler.idle_grace = "2h" is not accepted"#),
            ("memory_overcommit = 0", "scheduler.memory_overcommit = 0.0 is not accepted: a number above 0 and at most 100, like 1.0 (no overcommit) or 1.5"),
            ("memory_overcommit = -1.5", "scheduler.memory_overcommit = -1.5 is not accepted"),
            ("memory_overcommit = 100.5", "scheduler.memory_overcommit = 100.5 is not accepted"),
            ("memory_overcommit = nan", "scheduler.memory_overcommit = nan is not accepted"),
            ("memory_overcommit = inf", "scheduler.memory_overcommit = inf is not accepted"),
            (r#"reservation_ttl = "0s""#, r#"scheduler.reservation_ttl = "0s" is not accepted: a duration above 0, like "60s""#),
            (r#"stop_grace = "0s""#, r#"scheduler.stop_grace = "0s" is not accepted: a duration above 0 and at most 1h, like "30s""#),
            (r#"stop_grace = "2h""#, r#"scheduler.stop_grace = "2h" is not accepted"#),
            // Values of the wrong form: where they are, which key, what is accepted.
            (r#"slice = "200""#, r#"line 3 (scheduler.slice): `200` is not a duration: write a number and a unit"#),
            ("slice = 200", "line 3 (scheduler.slice): invalid type: integer `200`, expected a string"),
            (r#"policy = "fair""#, "line 3 (scheduler.policy): unknown variant `fair`, expected `spread` or `pack`"),
            (r#"memory_overcommit = "1.5""#, "line 3 (scheduler.memory_overcommit): invalid type: string \"1.5\", expected f64"),
            (r#"reservation_ttl = "forever""#, "line 3 (scheduler.reservation_ttl): `forever` is not a duration"),
        ];
        for (line, message) in cases {
            let text = format!("# gpuplex\n[scheduler]\n{line}\n");
            let e = SchedulerConfig::from_toml(&text).unwrap_err().to_string();
            assert!(e.starts_with(message), "{line}: {e}");
            assert!(!e.contains('\n'), "{line}: {e}");
        }
    }

    #[test]
    fn the_limits_themselves_are_accepted() {
        let cases = [
            ("slice", "\"1ms\""),
            ("slice", "\"1h\""),
            ("idle_grace", "\"1ns\""),
            ("idle_grace", "\"1h\""),
            ("memory_overcommit", "100"),
            ("memory_overcommit", "0.01"),
            ("reservation_ttl", "\"1ns\""),
            ("stop_grace", "\"1ns\""),
            ("stop_grace", "\"1h\""),
        ];
        for (key, value) in cases {
            let text = format!("[scheduler]\n{key} = {value}\n");
            assert!(SchedulerConfig::from_toml(&text).is_ok(), "{text}");
        }
    }

    #[test]
    fn an_unknown_key_is_refused_naming_it() {
        let text = "[node]\nx = 1\n\n[scheduler]\nslice = \"200ms\"\nslise = \"100ms\"\n";
        let e = SchedulerConfig::from_toml(text).unwrap_err();
        let ConfigError::Toml { line, key, message } = &e else {
            panic!("{e:?}")
        };
        assert_eq!((*line, key.as_deref()), (Some(6), Some("scheduler.slise")));
        assert!(
            message.starts_with("unknown field `slise`, expected one of `slice`"),
            "{message}"
        );
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn broken_toml_is_one_line_with_its_place() {
        let cases = [
            ("[scheduler]\nslice = \n", 2),
            ("[scheduler\n", 1),
            ("a = 1\na = 2\n", 2),
            ("scheduler = 5\n", 1),
        ];
        for (text, expected) in cases {
            let e = SchedulerConfig::from_toml(text).unwrap_err();
            let ConfigError::Toml { line, .. } = &e else {
                panic!("{e:?}")
            };
            assert_eq!(*line, Some(expected), "{text:?}: {e}");
            let message = e.to_string();
            assert!(
                message.starts_with(&format!("line {expected}")),
                "{message}"
            );
            assert!(!message.contains('\n'), "{message}");
        }
    }
}
