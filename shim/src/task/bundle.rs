//! The bundle's `config.json`, read once per `Create` and written back once when the container's
//! vGPU edits it, and what the shim itself needs of it (its PID namespace, its cgroups path,
//! its `CUDA_VISIBLE_DEVICES`).
//!
//! The bundle is treated as hostile: config.json is read only as a regular file, without
//! following a link (O_NOFOLLOW), without waiting on a FIFO (O_NONBLOCK), and at most
//! [`SPEC_LIMIT`] bytes of it; the edited config is written through a fresh file
//! (O_EXCL, no link followed) renamed over it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The largest config.json the shim reads: far above any real spec (containerd's are a few
/// kilobytes; a Kubernetes object is at most about 1.5 MB), far below a memory problem.
pub const SPEC_LIMIT: u64 = 8 << 20;

/// The name of the bundle's OCI spec.
const CONFIG: &str = "config.json";

/// The file the edited spec is written to before it is renamed over config.json.
const CONFIG_EDITED: &str = ".config.json.gpuplex";

/// Why the bundle's config.json could not be read or written: one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// It could not be opened or read (absent, unreadable, a link: O_NOFOLLOW's `ELOOP`).
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// config.json.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// It is a FIFO, a socket, a device or a directory.
    #[error("cannot read {}: not a regular file", path.display())]
    NotRegular {
        /// config.json.
        path: PathBuf,
    },
    /// It is larger than [`SPEC_LIMIT`].
    #[error("cannot read {}: larger than {SPEC_LIMIT} bytes", path.display())]
    TooLarge {
        /// config.json.
        path: PathBuf,
    },
    /// It is not JSON.
    #[error("{} is not JSON: {why}", path.display())]
    NotJson {
        /// config.json.
        path: PathBuf,
        /// serde_json's reason, with its line and column.
        why: String,
    },
    /// The edited spec could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// config.json.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
}

/// The bundle's config.json as containerd wrote it: its bytes, and their one parse.
#[derive(Debug, Clone)]
pub struct BundleSpec {
    /// The file's bytes, for the hook library's functions that take a spec as bytes.
    pub bytes: Vec<u8>,
    /// The same, parsed: what everything else of `Create` reads.
    pub value: Value,
}

impl BundleSpec {
    /// Reads and parses `bundle`'s config.json (see the module's doc for what is refused).
    pub fn read(bundle: &Path) -> Result<BundleSpec, BundleError> {
        let path = bundle.join(CONFIG);
        let bytes = read_bounded(&path)?;
        BundleSpec::parse(&path, bytes)
    }

    /// Parses config.json's `bytes`, read from `path`.
    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<BundleSpec, BundleError> {
        match serde_json::from_slice(&bytes) {
            Ok(value) => Ok(BundleSpec { bytes, value }),
            Err(e) => Err(BundleError::NotJson {
                path: path.to_owned(),
                why: e.to_string(),
            }),
        }
    }
}

/// `path`'s bytes: a regular file only, no link followed, no FIFO waited on, at most
/// [`SPEC_LIMIT`] bytes.
pub fn read_bounded(path: &Path) -> Result<Vec<u8>, BundleError> {
    let read_error = |source| BundleError::Read {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() {
        return Err(BundleError::NotRegular {
            path: path.to_owned(),
        });
    }
    if meta.len() > SPEC_LIMIT {
        return Err(BundleError::TooLarge {
            path: path.to_owned(),
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow between the stat and the read.
    file.take(SPEC_LIMIT + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > SPEC_LIMIT {
        return Err(BundleError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// Writes `spec` as `bundle`'s config.json, by rename of a file of its own: a link or file
/// planted at the temporary name is removed, never followed.
pub fn write_spec(bundle: &Path, spec: &[u8]) -> Result<(), BundleError> {
    let path = bundle.join(CONFIG);
    let temp = bundle.join(CONFIG_EDITED);
    let written = create_new(&temp)
        .and_then(|mut file| file.write_all(spec))
        .and_then(|()| std::fs::rename(&temp, &path));
    written.map_err(|source| {
        let _ = std::fs::remove_file(&temp);
        BundleError::Write { path, source }
    })
}

/// A new file at `path`, whatever was there before (removed, not followed).
fn create_new(path: &Path) -> std::io::Result<File> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Whether `spec` puts init in a PID namespace it shares: false only for a `pid` namespace of
/// its own (no path); true for the host's (none listed), one joined by path, or a spec that is
/// no object (containerd's runc shim reads it the same way).
pub fn shares_pid_namespace(spec: &Value) -> bool {
    if spec.is_null() {
        return true;
    }
    let own = spec["linux"]["namespaces"].as_array().is_some_and(|list| {
        list.iter()
            .any(|ns| ns["type"] == "pid" && ns["path"].as_str().is_none_or(str::is_empty))
    });
    !own
}

/// The spec's `linux.cgroupsPath`, when it is a string.
pub fn cgroups_path(spec: &Value) -> Option<&str> {
    spec["linux"]["cgroupsPath"].as_str()
}

/// The spec's `CUDA_VISIBLE_DEVICES=...` entry of its process's environment.
pub fn visible_devices(spec: &Value) -> Option<String> {
    spec["process"]["env"]
        .as_array()?
        .iter()
        .filter_map(|e| e.as_str())
        .find(|e| e.starts_with("CUDA_VISIBLE_DEVICES="))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests;
