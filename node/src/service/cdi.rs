//! The GPUs' CDI spec as the node service keeps it: read at start and again whenever a spec
//! file changes, checked against the GPUs, and turned into each reservation's edits (the hook
//! applies them; it never reads a spec itself, which keeps the CDI crate out of its start-up).
//!
//! A spec that does not parse or validate, or whose GPUs disagree with the node's, is one line:
//! logged when it is read, shown by `gpuplexctl status`, and the refusal of every reservation
//! until it is fixed. No spec of the kind is no edits (device nodes only), logged once with the
//! command that writes one. A read is logged only when its outcome changed: the directories are
//! shared (the DRA driver writes a spec of its own kind per claim), so most changes are others'.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use gpuplex_wire::protocol::cdi::CdiEdits;

use crate::cdi::CdiRegistry;

/// A spec file's identity: its path, inode, size and modification time.
type Seen = (PathBuf, u64, u64, i64, i64);

/// The CDI specs of the configured kind, as last read.
#[derive(Debug)]
pub(super) struct CdiSpecs {
    dirs: Vec<PathBuf>,
    kind: String,
    /// The node's GPU UUIDs, which the spec must match.
    uuids: Vec<String>,
    /// The directories' files when last read.
    seen: Vec<Seen>,
    /// The registry, checked against the GPUs, or why it cannot be used.
    read: Result<CdiRegistry, String>,
    /// The state in words, for status: `none: …`, `error: …` or `<kind> from <files>`.
    state: String,
}

impl CdiSpecs {
    /// Reads the specs of `kind` in `dirs` for a node whose GPUs have these UUIDs, and logs
    /// what it found.
    pub fn load(dirs: &[PathBuf], kind: &str, uuids: Vec<String>) -> CdiSpecs {
        let mut specs = CdiSpecs {
            dirs: dirs.to_vec(),
            kind: kind.to_owned(),
            uuids,
            seen: Vec::new(),
            read: Err(String::new()),
            state: String::new(),
        };
        specs.read();
        specs
    }

    /// The state in words, for `gpuplexctl status`.
    pub fn state(&self) -> &str {
        &self.state
    }

    /// Reads the specs again when a file of the directories changed since the last read.
    pub fn refresh(&mut self) {
        if self.files() != self.seen {
            tracing::debug!("CDI: the spec directories changed; reading them again");
            self.read();
        }
    }

    /// The edits for the GPUs `(index, uuid)` of a new vGPU, for its reply; `None` when there
    /// is no spec of the kind. Reads changed specs first.
    pub fn edits_for(&mut self, gpus: &[(u32, &str)]) -> Result<Option<CdiEdits>, String> {
        self.refresh();
        let registry = self.read.as_ref().map_err(Clone::clone)?;
        if registry.is_empty() {
            return Ok(None);
        }
        registry
            .edits_for(gpus)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// Every file directly in the spec directories, as it is now.
    fn files(&self) -> Vec<Seen> {
        let mut seen = Vec::new();
        for dir in &self.dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if let Ok(meta) = entry.metadata() {
                    let changed = (meta.mtime(), meta.mtime_nsec());
                    seen.push((entry.path(), meta.ino(), meta.len(), changed.0, changed.1));
                }
            }
        }
        seen.sort();
        seen
    }

    /// Reads the specs, checks them against the GPUs and logs the outcome when it changed;
    /// whether it did.
    fn read(&mut self) -> bool {
        self.seen = self.files();
        let kind = &self.kind;
        let uuids: Vec<&str> = self.uuids.iter().map(String::as_str).collect();
        let read = CdiRegistry::load(&self.dirs, kind)
            .map_err(|e| e.to_string())
            .and_then(|r| {
                r.check_inventory(&uuids)
                    .map(|()| r)
                    .map_err(|e| e.to_string())
            });
        let state = match &read {
            Err(e) => format!("error: {e}"),
            Ok(registry) => match registry.why_empty() {
                Some(why) => format!("none: {why}"),
                None => {
                    let files: Vec<String> = registry
                        .spec_files()
                        .iter()
                        .map(|f| f.display().to_string())
                        .collect();
                    format!("{kind} from {}", files.join(", "))
                }
            },
        };
        self.read = read;
        if state == self.state {
            return false;
        }
        match &self.read {
            Err(e) => {
                tracing::error!("CDI: {e}; containers that ask for a vGPU fail until it is fixed")
            }
            Ok(_) if state.starts_with("none: ") => {
                tracing::warn!("CDI: {}; containers get device nodes only", &state[6..])
            }
            Ok(_) => tracing::info!("CDI: {state}"),
        }
        self.state = state;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(uuid: &str) -> String {
        format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  env:\n  - SPEC=wide\ndevices:\n- name: {uuid}\n  containerEdits:\n    env:\n    - GPU={uuid}\n"
        )
    }

    #[test]
    fn a_spec_written_after_start_is_read_at_the_next_reservation() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = [dir.path().to_path_buf()];
        let mut specs = CdiSpecs::load(&dirs, "nvidia.com/gpu", vec!["GPU-aa00".into()]);
        assert!(specs.state().starts_with("none: "), "{}", specs.state());
        assert_eq!(specs.edits_for(&[(0, "GPU-aa00")]), Ok(None));

        std::fs::write(dir.path().join("nvidia.yaml"), spec("GPU-aa00")).unwrap();
        let edits = specs.edits_for(&[(0, "GPU-aa00")]).unwrap().unwrap();
        assert_eq!(edits.env, ["SPEC=wide", "GPU=GPU-aa00"]);
        assert!(
            specs.state().starts_with("nvidia.com/gpu from "),
            "{}",
            specs.state()
        );

        // Regenerated for other GPUs: every reservation is refused, naming them.
        std::fs::write(dir.path().join("nvidia.yaml"), spec("GPU-bb000")).unwrap();
        let refused = specs.edits_for(&[(0, "GPU-aa00")]).unwrap_err();
        assert!(
            refused.contains("GPU-bb000") && refused.contains("GPU-aa00"),
            "{refused}"
        );
        assert!(specs.state().starts_with("error: "), "{}", specs.state());

        // Broken: the file and the fault, on one line.
        std::fs::write(dir.path().join("nvidia.yaml"), "kind: nvidia.com/gpu\n:\n").unwrap();
        let refused = specs.edits_for(&[(0, "GPU-aa00")]).unwrap_err();
        assert!(
            refused.contains("nvidia.yaml") && !refused.contains('\n'),
            "{refused}"
        );

        std::fs::remove_file(dir.path().join("nvidia.yaml")).unwrap();
        assert_eq!(specs.edits_for(&[(0, "GPU-aa00")]), Ok(None));
    }

    #[test]
    fn specs_of_other_kinds_coming_and_going_are_read_but_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = [dir.path().to_path_buf()];
        let mut specs = CdiSpecs::load(&dirs, "nvidia.com/gpu", vec!["GPU-aa00".into()]);
        let claim = |name: &str| {
            let path = dir.path().join(format!("gpuplex.io-vgpu-{name}.yaml"));
            let spec = format!("cdiVersion: 0.5.0\nkind: gpuplex.io/vgpu\ndevices:\n- name: {name}\n  containerEdits:\n    env:\n    - A=1\n");
            std::fs::write(&path, spec).unwrap();
            path
        };
        claim("c1");
        assert!(
            specs.read(),
            "the first spec of another kind is named in the state"
        );
        let none = specs.state().to_owned();
        assert!(none.contains("found only gpuplex.io/vgpu"), "{none}");
        // The driver's claims come and go: read, and nothing to say.
        let c2 = claim("c2");
        assert_ne!(specs.files(), specs.seen);
        assert!(!specs.read());
        std::fs::remove_file(c2).unwrap();
        assert!(!specs.read());
        assert_eq!(specs.state(), none);
        std::fs::write(dir.path().join("nvidia.yaml"), spec("GPU-aa00")).unwrap();
        assert!(specs.read(), "a spec of the kind: said");
        claim("c3");
        assert!(!specs.read());
        assert!(specs.state().starts_with("nvidia.com/gpu from "));
    }
}
