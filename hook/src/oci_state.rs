//! The OCI state a runtime writes on a hook's stdin, and the bundle's `config.json`.
//!
//! runc and crun differ (../shared/notes/container-stack.md §3): runc says `"status":"creating"`
//! at `createRuntime`, crun `"created"` and adds a `root` field; at `poststop` runc gives no
//! `pid`, crun gives 0. Both are read here; unknown fields are ignored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// The OCI state of a container, as a hook reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OciState {
    /// The container's id.
    pub id: String,
    /// Its init process, when it has one (`None` at `poststop`).
    pub pid: Option<u32>,
    /// Its bundle directory.
    pub bundle: PathBuf,
    /// The annotations in the state (runc leaves them out when there are none).
    pub annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawState {
    id: String,
    #[serde(default)]
    pid: Option<i64>,
    bundle: PathBuf,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// Why the state or the config cannot be read. One line.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The state on stdin is not what the OCI runtime spec says.
    #[error("the OCI state on stdin is not valid: {0}; run gpuplex-hook as an OCI hook (createRuntime, prestart or poststop), which gets the state from the runtime")]
    State(String),
    /// `config.json` cannot be read.
    #[error("cannot read {path}: {why}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

impl OciState {
    /// Reads the state JSON.
    pub fn parse(bytes: &[u8]) -> Result<OciState, StateError> {
        let raw: RawState =
            serde_json::from_slice(bytes).map_err(|e| StateError::State(e.to_string()))?;
        if raw.id.is_empty() {
            return Err(StateError::State("\"id\" is empty".into()));
        }
        let pid = match raw.pid {
            None | Some(0) => None,
            Some(p) => Some(
                u32::try_from(p)
                    .map_err(|_| StateError::State(format!("\"pid\" {p} is not a process id")))?,
            ),
        };
        Ok(OciState {
            id: raw.id,
            pid,
            bundle: raw.bundle,
            annotations: raw.annotations,
        })
    }

    /// Reads `<bundle>/config.json`.
    pub fn config(&self) -> Result<BundleConfig, StateError> {
        BundleConfig::read(&self.bundle)
    }
}

/// A bundle's `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct BundleConfig {
    /// The config.
    pub config: Value,
    /// Its `root.path`, made absolute against the bundle.
    pub rootfs: PathBuf,
}

impl BundleConfig {
    /// Reads the config of the bundle at `bundle`.
    pub fn read(bundle: &Path) -> Result<BundleConfig, StateError> {
        let path = bundle.join("config.json");
        let fail = |why: String| StateError::Config {
            path: path.clone(),
            why,
        };
        let bytes = std::fs::read(&path).map_err(|e| fail(e.to_string()))?;
        let config: Value = serde_json::from_slice(&bytes).map_err(|e| fail(e.to_string()))?;
        let root = config
            .get("root")
            .and_then(|r| r.get("path"))
            .and_then(Value::as_str)
            .ok_or_else(|| fail("it has no root.path".into()))?;
        let rootfs = bundle.join(root);
        Ok(BundleConfig { config, rootfs })
    }

    /// Its annotations.
    pub fn annotations(&self) -> BTreeMap<String, String> {
        self.config
            .get("annotations")
            .and_then(Value::as_object)
            .map(|a| {
                a.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runc_and_crun_states_are_read() {
        let runc = br#"{"ociVersion":"1.0.2-dev","id":"t_runc2","status":"creating","pid":14822,"bundle":"/w/bundle_runc","annotations":{"gpuplex.io/weight":"2"}}"#;
        let s = OciState::parse(runc).unwrap();
        assert_eq!((s.id.as_str(), s.pid), ("t_runc2", Some(14822)));
        assert_eq!(s.annotations["gpuplex.io/weight"], "2");
        let crun = br#"{"ociVersion":"1.0","id":"t_crun2","pid":15078,"root":"/w/rootfs","bundle":"/w/b","status":"created","annotations":{"com.example.gpu":"0"}}"#;
        assert_eq!(OciState::parse(crun).unwrap().pid, Some(15078));
        let runc_poststop =
            br#"{"ociVersion":"1.0.2-dev","id":"x","status":"stopped","bundle":"/w/b"}"#;
        let s = OciState::parse(runc_poststop).unwrap();
        assert_eq!((s.pid, s.annotations.len()), (None, 0));
        let crun_poststop =
            br#"{"ociVersion":"1.0","id":"x","pid":0,"status":"stopped","bundle":"/w/b"}"#;
        assert_eq!(OciState::parse(crun_poststop).unwrap().pid, None);
    }

    #[test]
    fn bad_states_are_one_line() {
        for bad in [
            &b"not json"[..],
            b"{}",
            br#"{"id":"","bundle":"/b"}"#,
            br#"{"id":"x","bundle":"/b","pid":-4}"#,
            br#"{"id":"x","pid":1}"#,
        ] {
            let e = OciState::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("the OCI state on stdin is not valid"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn the_rootfs_is_resolved_against_the_bundle() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"root":{"path":"rootfs"},"annotations":{"gpuplex.io/gpus":"1","n":3}}"#,
        )
        .unwrap();
        let c = BundleConfig::read(dir.path()).unwrap();
        assert_eq!(c.rootfs, dir.path().join("rootfs"));
        assert_eq!(c.annotations().len(), 1);
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"root":{"path":"/abs"}}"#,
        )
        .unwrap();
        assert_eq!(
            BundleConfig::read(dir.path()).unwrap().rootfs,
            PathBuf::from("/abs")
        );
        std::fs::write(dir.path().join("config.json"), "{").unwrap();
        let e = BundleConfig::read(dir.path()).unwrap_err().to_string();
        assert!(e.starts_with(&format!(
            "cannot read {}",
            dir.path().join("config.json").display()
        )));
        let e = BundleConfig::read(&dir.path().join("nope"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("No such file"), "{e}");
    }
}
