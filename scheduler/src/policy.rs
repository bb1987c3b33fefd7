//! What a container owner may ask for: the `[policy]` section of `gpuplex.toml`, the operator's
//! bound on the annotations that let one tenant take time from the others.
//!
//! | key | default | accepted |
//! |---|---|---|
//! | `max_weight` | `10` | 1 to 100: the highest `gpuplex.io/weight` |
//! | `high_priority_namespaces` | `[]` | Kubernetes namespaces whose pods may ask for `gpuplex.io/priority=high` (`"*"`: every one) |
//! | `high_priority_outside_kubernetes` | `false` | whether containers outside Kubernetes (podman, plain runc, `ctr`) may |
//!
//! By default nobody starves the others by annotation: a `high` vGPU freezes every other with
//! work on its GPUs for as long as it works, so nobody gets it unless the operator says so, and
//! a weight of at most 10 leaves any other at least a 1/11 share. `low` hurts nobody but its
//! asker and is always allowed.
//!
//! A request's Kubernetes namespace is the one its annotations name
//! ([`crate::request::POD_NAMESPACE_KEYS`]). Only the containerd shim passes them on, from CRI,
//! which writes them from the pod's namespace (a pod's own annotations reach a container only
//! under `gpuplex.io/`); the hook, which sees what a podman or runc user wrote, never does, so a
//! container outside Kubernetes cannot claim a namespace.

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use crate::request::{Priority, VgpuRequest, MAX_WEIGHT, PRIORITY, WEIGHT};
use crate::toml_place::TomlPlace;

/// `[policy]` of `gpuplex.toml`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// The highest weight a container may ask for.
    pub max_weight: u32,
    /// Kubernetes namespaces whose pods may ask for `high` priority (`*`: every namespace).
    pub high_priority_namespaces: Vec<String>,
    /// Whether containers outside Kubernetes may ask for `high` priority.
    pub high_priority_outside_kubernetes: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            max_weight: 10,
            high_priority_namespaces: Vec::new(),
            high_priority_outside_kubernetes: false,
        }
    }
}

/// A request the policy refuses. One line: the annotation, its value, the limit and the key
/// that sets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A weight over `max_weight`.
    #[error("annotation {WEIGHT}=`{weight}` is over this node's limit of {max} (the operator's [policy] max_weight in gpuplex.toml)")]
    Weight {
        /// What was asked.
        weight: u32,
        /// The limit.
        max: u32,
    },
    /// `high` from a namespace, or from outside Kubernetes, that may not ask for it.
    #[error("annotation {PRIORITY}=`high` is not allowed {who} on this node (the operator's [policy] {key} in gpuplex.toml says who may)")]
    High {
        /// `for namespace x` or `outside Kubernetes`.
        who: String,
        /// The key that would allow it.
        key: &'static str,
    },
}

impl PolicyConfig {
    /// Everything allowed (the simulator's, and a node built without one).
    pub fn unrestricted() -> PolicyConfig {
        PolicyConfig {
            max_weight: MAX_WEIGHT,
            high_priority_namespaces: vec!["*".into()],
            high_priority_outside_kubernetes: true,
        }
    }

    /// Whether a request from `namespace` (`None`: outside Kubernetes) is allowed.
    pub fn admit(&self, request: &VgpuRequest, namespace: Option<&str>) -> Result<(), PolicyError> {
        if request.weight > self.max_weight {
            return Err(PolicyError::Weight {
                weight: request.weight,
                max: self.max_weight,
            });
        }
        if request.priority != Priority::High {
            return Ok(());
        }
        let allowed = match namespace {
            Some(ns) => self
                .high_priority_namespaces
                .iter()
                .any(|allowed| allowed == "*" || allowed == ns),
            None => self.high_priority_outside_kubernetes,
        };
        if allowed {
            return Ok(());
        }
        Err(match namespace {
            Some(ns) => PolicyError::High {
                who: format!("for namespace `{}`", crate::quantity::shown(ns)),
                key: "high_priority_namespaces",
            },
            None => PolicyError::High {
                who: "outside Kubernetes".into(),
                key: "high_priority_outside_kubernetes",
            },
        })
    }

    /// Checks every value against what its key accepts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_WEIGHT).contains(&self.max_weight) {
            return Err(ConfigError::Invalid {
                key: "policy.max_weight",
                value: self.max_weight.to_string(),
                accepted: "a whole number from 1 to 100",
            });
        }
        if let Some(bad) = self
            .high_priority_namespaces
            .iter()
            .find(|ns| ns.as_str() != "*" && !is_namespace(ns))
        {
            return Err(ConfigError::Invalid {
                key: "policy.high_priority_namespaces",
                value: format!("{bad:?}"),
                accepted: "Kubernetes namespace names (lowercase letters, digits and `-`, at most 63) or \"*\"",
            });
        }
        Ok(())
    }

    /// Reads the `[policy]` table of a whole `gpuplex.toml` document and validates it; a missing
    /// table or key gives the defaults.
    pub fn from_toml(text: &str) -> Result<PolicyConfig, ConfigError> {
        #[derive(Deserialize)]
        struct Document {
            #[serde(default)]
            policy: PolicyConfig,
        }
        let document: Document = toml::from_str(text).map_err(|e| {
            let TomlPlace { line, key, message } = TomlPlace::of(text, &e);
            ConfigError::Toml { line, key, message }
        })?;
        document.policy.validate()?;
        Ok(document.policy)
    }
}

/// A Kubernetes namespace name (an RFC 1123 label).
fn is_namespace(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS_FILE: &str = include_str!("../../config/gpuplex.toml");

    fn request(weight: u32, priority: Priority) -> VgpuRequest {
        VgpuRequest {
            weight,
            priority,
            ..VgpuRequest::default()
        }
    }

    #[test]
    fn the_installed_file_documents_the_defaults() {
        assert_eq!(
            PolicyConfig::from_toml(DEFAULTS_FILE),
            Ok(PolicyConfig::default())
        );
    }

    #[test]
    fn by_default_nobody_starves_the_others_by_annotation() {
        let policy = PolicyConfig::default();
        for namespace in [None, Some("default"), Some("kube-system")] {
            assert_eq!(
                policy.admit(&request(10, Priority::Normal), namespace),
                Ok(())
            );
            assert_eq!(policy.admit(&request(1, Priority::Low), namespace), Ok(()));
            let line = policy
                .admit(&request(11, Priority::Normal), namespace)
                .unwrap_err()
                .to_string();
            assert_eq!(line, "annotation gpuplex.io/weight=`11` is over this node's limit of 10 (the operator's [policy] max_weight in gpuplex.toml)");
            let line = policy
                .admit(&request(1, Priority::High), namespace)
                .unwrap_err()
                .to_string();
            assert!(
                line.starts_with("annotation gpuplex.io/priority=`high` is not allowed"),
                "{line}"
            );
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn the_operator_says_who_may_ask_for_high() {
        let policy = PolicyConfig {
            max_weight: 100,
            high_priority_namespaces: vec!["inference".into()],
            high_priority_outside_kubernetes: false,
        };
        let high = request(1, Priority::High);
        assert_eq!(policy.admit(&high, Some("inference")), Ok(()));
        assert_eq!(
            policy.admit(&high, Some("training")),
            Err(PolicyError::High {
                who: "for namespace `training`".into(),
                key: "high_priority_namespaces"
            })
        );
        assert!(policy
            .admit(&high, None)
            .unwrap_err()
            .to_string()
            .contains("outside Kubernetes"));
        assert_eq!(policy.admit(&request(100, Priority::Normal), None), Ok(()));
        let everyone = PolicyConfig::unrestricted();
        assert_eq!(everyone.admit(&high, Some("training")), Ok(()));
        assert_eq!(everyone.admit(&high, None), Ok(()));
    }

    #[test]
    fn bad_values_are_refused_in_one_line() {
        let cases = [
            (
                "[policy]\nmax_weight = 0\n",
                "policy.max_weight = 0 is not accepted",
            ),
            (
                "[policy]\nmax_weight = 101\n",
                "policy.max_weight = 101 is not accepted",
            ),
            (
                "[policy]\nhigh_priority_namespaces = [\"Team A\"]\n",
                "policy.high_priority_namespaces = \"Team A\" is not accepted",
            ),
            (
                "[policy]\nhigh = true\n",
                "line 2 (policy.high): unknown field `high`",
            ),
            (
                "[policy]\nhigh_priority_outside_kubernetes = \"yes\"\n",
                "line 2 (policy.high_priority_outside_kubernetes): invalid type",
            ),
        ];
        for (text, expected) in cases {
            let line = PolicyConfig::from_toml(text).unwrap_err().to_string();
            assert!(line.starts_with(expected), "{text}: {line}");
            assert!(!line.contains('\n'));
        }
        let ok = "[policy]\nmax_weight = 100\nhigh_priority_namespaces = [\"*\", \"a-1\"]\n";
        assert!(PolicyConfig::from_toml(ok).is_ok());
    }
}
