//! `gpuplexctl install` and `uninstall`: gpuplex wired into containerd's config
//! ([`containerd`]) or podman's hooks directory ([`podman`]), idempotently, with `--dry-run`
//! showing a unified diff ([`diff`]) instead.
//!
//! Each command is planned first, as pure work on the files' texts (a [`Plan`]: the changes
//! and the line that says what was done), then carried out, or only shown. Every outcome is
//! one line: what was done and what to restart, or why nothing was. Files are replaced by
//! rename, with the mode and owner of the file they replace, so that a reader never sees half a
//! config.

pub mod containerd;
pub mod diff;
pub mod locate;
pub mod podman;

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{write_out, CtlError};

/// containerd's config when `--config` does not name one.
pub const DEFAULT_CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";

/// The containerd binary asked for its version when the config does not say its own.
pub const DEFAULT_CONTAINERD: &str = "containerd";

/// podman's default hooks directory (containers-common's `hooks_dir`).
pub const DEFAULT_HOOKS_DIR: &str = "/usr/share/containers/oci/hooks.d";

/// What the original of a changed config is kept as: `<config>.gpuplex-orig`.
pub const BACKUP_SUFFIX: &str = ".gpuplex-orig";

/// What to install gpuplex into, with its options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// containerd's config.
    Containerd {
        /// The config file (`--config`); `None`: the running containerd's (its `--config`),
        /// else containerd's default.
        config: Option<PathBuf>,
        /// The binary asked for its version (`--containerd`).
        containerd: PathBuf,
    },
    /// podman's hooks directory.
    Podman {
        /// The directory (`--hooks-dir`); `None`: the first of `containers.conf`'s
        /// `hooks_dir`, else podman's default.
        hooks_dir: Option<PathBuf>,
        /// The hook the files call (`--hook`); `None`: the `gpuplex-hook` beside `gpuplexctl`.
        hook: Option<PathBuf>,
    },
}

/// `gpuplexctl install` or `uninstall`, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// `uninstall` rather than `install`.
    pub uninstall: bool,
    /// `--dry-run`: show the diff, change nothing.
    pub dry_run: bool,
    /// Where.
    pub target: Target,
}

/// Why an install or uninstall did nothing (or, for podman's uninstall, not everything). One
/// line each, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}; nothing changed")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: io::Error,
    },
    /// A file is not UTF-8 text.
    #[error("{path}: line {line}, column {column}: not UTF-8 text; nothing changed")]
    NotText {
        /// The file.
        path: String,
        /// From 1.
        line: usize,
        /// From 1, in characters.
        column: usize,
    },
    /// containerd's config cannot be edited.
    #[error("{path}: {error}; nothing changed")]
    Config {
        /// The file.
        path: String,
        /// Why.
        error: containerd::ConfigError,
    },
    /// The config does not say its version and containerd could not tell it.
    #[error("{config} does not say its config version and `{containerd} --version` cannot tell it ({reason}); write `version = 2` (containerd 1.x) or `version = 3` (containerd 2.x) into it, or name the binary with --containerd PATH; nothing changed")]
    ContainerdVersion {
        /// The config.
        config: String,
        /// The binary.
        containerd: String,
        /// Why.
        reason: String,
    },
    /// The hook the podman files would call is not there.
    #[error("{0}")]
    Hook(String),
    /// Where the runtime reads its configuration cannot be told.
    #[error("{0}")]
    Locate(String),
    /// A change could not be made; the line says what was done before it.
    #[error("cannot {what}: {source}{done}")]
    Write {
        /// What.
        what: String,
        /// Why.
        source: io::Error,
        /// What was done before, or "; nothing changed".
        done: String,
    },
    /// Some of the work was refused (the line says what was done).
    #[error("{0}")]
    Refused(String),
}

impl InstallError {
    fn config(path: &str, error: containerd::ConfigError) -> InstallError {
        InstallError::Config {
            path: path.to_string(),
            error,
        }
    }
}

impl From<InstallError> for CtlError {
    fn from(e: InstallError) -> CtlError {
        CtlError::Failed(e.to_string())
    }
}

/// One change to one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Copy `from` to `to` (the original, before the first change), mode and owner too.
    Backup {
        /// The config.
        from: PathBuf,
        /// Its backup.
        to: PathBuf,
    },
    /// Write `after` to `path` (made when `before` is `None`).
    Write {
        /// The file written.
        path: PathBuf,
        /// Its name as the operator gave it.
        shown: String,
        /// Its text now.
        before: Option<String>,
        /// Its text then.
        after: String,
    },
    /// Rename `backup` over `path`: the original back, byte for byte, and the backup gone.
    Restore {
        /// The backup.
        backup: PathBuf,
        /// The config.
        path: PathBuf,
        /// Its name as the operator gave it.
        shown: String,
        /// The config's text now.
        before: String,
        /// The backup's text.
        after: String,
    },
    /// Remove `path`.
    Remove {
        /// The file.
        path: PathBuf,
        /// Its name as the operator gave it.
        shown: String,
        /// Its text now.
        before: String,
    },
}

/// What a command will do: its changes, in order, and its line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The changes; none when everything is as it should be.
    pub changes: Vec<Change>,
    /// The line once they are made.
    pub done: String,
    /// What they are, for `--dry-run` ("would ...").
    pub would: String,
    /// Whether the command did all it was asked (exit 0); `false` makes the line an error.
    pub ok: bool,
}

impl Plan {
    /// Nothing to do, and `line` says why.
    pub fn nothing(line: String) -> Plan {
        Plan {
            changes: Vec::new(),
            would: line.clone(),
            done: line,
            ok: true,
        }
    }

    /// The unified diff of every change.
    pub fn diff(&self) -> String {
        let mut out = String::new();
        for change in &self.changes {
            let text = match change {
                Change::Backup { .. } => continue,
                Change::Write {
                    shown,
                    before,
                    after,
                    ..
                } => match before {
                    Some(before) => diff::unified(shown, before, shown, after),
                    None => diff::unified("/dev/null", "", shown, after),
                },
                Change::Restore {
                    shown,
                    before,
                    after,
                    ..
                } => diff::unified(shown, before, shown, after),
                Change::Remove { shown, before, .. } => {
                    diff::unified(shown, before, "/dev/null", "")
                }
            };
            out.push_str(&text);
        }
        out
    }

    /// Makes the changes, in order; the first that fails stops the rest, and the error says
    /// which were made.
    pub fn apply(&self) -> Result<(), InstallError> {
        let mut made: Vec<String> = Vec::new();
        for change in &self.changes {
            let (what, result) = match change {
                Change::Backup { from, to } => (
                    format!("keep the original {} as {}", from.display(), to.display()),
                    fs::read(from).and_then(|bytes| write_file(to, &bytes, Some(from))),
                ),
                Change::Write { path, after, .. } => (
                    format!("write {}", path.display()),
                    write_file(path, after.as_bytes(), Some(path)),
                ),
                Change::Restore { backup, path, .. } => (
                    format!("rename {} to {}", backup.display(), path.display()),
                    fs::rename(backup, path).and_then(|()| sync_parent(path)),
                ),
                Change::Remove { path, .. } => (
                    format!("remove {}", path.display()),
                    fs::remove_file(path).and_then(|()| sync_parent(path)),
                ),
            };
            if let Err(source) = result {
                let done = if made.is_empty() {
                    "; nothing changed".to_string()
                } else {
                    format!(" (done before: {})", made.join(", "))
                };
                return Err(InstallError::Write { what, source, done });
            }
            made.push(what);
        }
        Ok(())
    }
}

/// Carries out `request`, writing its line (after the diff, with `--dry-run`) to `out`.
pub fn run(request: &Request, out: &mut dyn io::Write) -> Result<(), CtlError> {
    let plan = match &request.target {
        Target::Containerd { config, containerd } => {
            let config = match config {
                Some(config) => config.clone(),
                None => locate::running_containerd_config()?,
            };
            if request.uninstall {
                containerd::plan_uninstall(&config)?
            } else {
                containerd::plan_install(&config, containerd)?
            }
        }
        Target::Podman { hooks_dir, hook } => {
            let hooks_dir = match hooks_dir {
                Some(dir) => dir.clone(),
                None => locate::podman_hooks_dir_here()?,
            };
            if request.uninstall {
                podman::plan_uninstall(&hooks_dir)?
            } else {
                let hook = podman::resolve_hook(hook.as_deref(), std::env::current_exe().ok())?;
                podman::plan_install(&hooks_dir, &hook)?
            }
        }
    };
    let line = if request.dry_run && !plan.changes.is_empty() {
        format!("dry run, nothing changed: it would {}", plan.would)
    } else {
        plan.done.clone()
    };
    if request.dry_run {
        write_out(out, &plan.diff())?;
    } else {
        plan.apply()?;
    }
    if plan.ok {
        write_out(out, &format!("{line}\n")).map(drop)
    } else {
        Err(CtlError::Failed(line))
    }
}

/// The line and column (from 1; the column in characters) of byte `offset` of `text`, as a
/// parse error names them.
fn position(text: &str, offset: usize) -> (usize, usize) {
    let mut start = offset.min(text.len());
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

/// A parser's message on one line: its lines trimmed, the empty ones dropped, joined by "; ".
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `<config>.gpuplex-orig`.
pub fn backup_path(config: &Path) -> PathBuf {
    let mut name = config.as_os_str().to_owned();
    name.push(BACKUP_SUFFIX);
    PathBuf::from(name)
}

/// Whether anything (a link too) is at `path`.
fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// A file's text; `None` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>, InstallError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(InstallError::Read {
                path: path.display().to_string(),
                source,
            })
        }
    };
    String::from_utf8(bytes).map(Some).map_err(|e| {
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let good = std::str::from_utf8(good).unwrap_or("");
        let (line, column) = position(good, good.len());
        InstallError::NotText {
            path: path.display().to_string(),
            line,
            column,
        }
    })
}

/// Writes `bytes` to `path` by rename from a temporary file beside it, with the mode and owner
/// of `like` when it exists (else 0644, root's), making the directory when missing.
fn write_file(path: &Path, bytes: &[u8], like: Option<&Path>) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.gpuplex-tmp"));
    let like = like.and_then(|p| fs::metadata(p).ok());
    let _ = fs::remove_file(&tmp);
    let result = write_new(&tmp, bytes, like.as_ref()).and_then(|()| fs::rename(&tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_parent(path)
}

/// Makes `path` (which must not exist) with `bytes`, the mode and owner of `like` (else 0644),
/// and syncs it.
fn write_new(path: &Path, bytes: &[u8], like: Option<&fs::Metadata>) -> io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    match like {
        Some(meta) => {
            std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()))?;
            file.set_permissions(meta.permissions())?;
        }
        None => file.set_permissions(fs::Permissions::from_mode(0o644))?,
    }
    file.sync_all()
}

/// Makes a rename or removal in `path`'s directory durable.
fn sync_parent(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backup_is_beside_the_config() {
        assert_eq!(
            backup_path(Path::new("/etc/containerd/config.toml")),
            Path::new("/etc/containerd/config.toml.gpuplex-orig")
        );
    }

    #[test]
    fn a_written_file_keeps_the_mode_of_the_one_it_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        fs::write(&path, "old\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        write_file(&path, b"new\n", Some(&path)).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\n");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let fresh = dir.path().join("sub/new.json");
        write_file(&fresh, b"{}\n", Some(&fresh)).unwrap();
        let mode = fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn text_that_is_not_utf8_is_placed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        fs::write(&path, b"a = 1\nb = \"\xff\"\n").unwrap();
        let err = read_text(&path).unwrap_err().to_string();
        assert!(
            err.ends_with("line 2, column 6: not UTF-8 text; nothing changed"),
            "{err}"
        );
        assert_eq!(read_text(&dir.path().join("absent")).unwrap(), None);
    }
}
