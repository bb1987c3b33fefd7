//! The registrations on disk: one JSON file per vGPU under `state_dir`, so that a service killed
//! with SIGKILL and started again finds every live registration.
//!
//! Each write goes to a temporary file in the same directory, is flushed to disk, and is renamed
//! over the old file (then the directory is flushed): a reader sees the old record or the new one,
//! never a torn one. Each record is written twice, the second time to `copies/`: a record torn or
//! overwritten behind the service's back (a disk that lost a write, an operator's editor) is
//! restored from its copy, so that its live container keeps its vGPU and its memory stays
//! reserved. A file that cannot be read back, nor its copy, is set aside as `<name>.bad` and
//! reported, never silently dropped. A copy without its record is one whose removal was cut
//! short, and is removed.
//!
//! Beside the records:
//!
//! - `frozen.json`, the cgroups the service may have frozen ([`SavedFrozen`]), rewritten before
//!   every freeze and after thaws: the watchdog thaws them when the service dies, and a start
//!   thaws them before it reads anything else, so a record that cannot be read never leaves its
//!   container frozen;
//! - `accounting.json` (GPU time and the next vGPU number), rewritten every second;
//! - `lock`, which the running service (and its watchdog, until it has thawed what the service
//!   left frozen) holds: a second instance touches no cgroup ([`StateDir::lock`]).
//!
//! Reading never blocks and never follows a link: only regular files are read (a FIFO or a
//! device named like a record is set aside, not opened for reading), each at most
//! [`MAX_FILE`] bytes.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpuplex_scheduler::quantity::shown;
use gpuplex_scheduler::VgpuId;
use serde::{Deserialize, Serialize};

use gpuplex_cgroup::{CgroupError, FreezerCgroup, FreezerVersion, Hierarchies};

/// The format version written in each file.
pub const FORMAT: u32 = 1;

/// A vGPU as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedVgpu {
    /// [`FORMAT`].
    pub format: u32,
    /// Its id (`vgpu-3`).
    pub vgpu: String,
    /// Its handle (32 hex digits), what its container attaches with. Absent in files written
    /// before handles existed: such a vGPU gets a new one at recovery (a reservation of that
    /// age cannot be attached by its old annotation any more, and lapses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// The annotations it was reserved with (its request is read from them again).
    pub annotations: BTreeMap<String, String>,
    /// Its GPUs, by index, with the UUID each had (a GPU whose UUID changed is not the same).
    pub gpus: Vec<SavedGpu>,
    /// When it was reserved, in milliseconds since the Unix epoch.
    pub reserved_at_unix_ms: u64,
    /// Its container, once attached.
    pub attachment: Option<SavedAttachment>,
    /// The other containers of a claim's pod attached to it, which share it. Written only when
    /// there are any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<SavedAttachment>,
    /// Its container is held: its user paused it (`ctr task pause`), so a restart must not thaw
    /// it, and it rejoins the scheduler held. Absent (false) in files written before holds
    /// existed, and written only when true, so that files without a hold keep format 1 as it was.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
    /// The Kubernetes ResourceClaim (uid) it is pinned for: it never lapses, and a restart
    /// keeps it reserved, attached or not. Written only for a pinned vGPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// The device plugin's units it was allocated for (`gpu-<index>-<n>`), with `claim` its
    /// allocation's key. Written only for an allocation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub units: Vec<String>,
}

/// A GPU of a saved vGPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedGpu {
    /// Host index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
}

/// A saved vGPU's container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedAttachment {
    /// The container's id.
    pub container: String,
    /// The init pid it was attached with, if by pid.
    pub pid: Option<u32>,
    /// The cgroup path it was attached with, if by path.
    pub cgroup: Option<String>,
    /// The freezer cgroup found for it.
    pub freezer: SavedFreezer,
    /// The program (device, inode) its init ran when attached, while it has not started: a
    /// restarted service samples it only once its init runs another. Written only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<[u64; 2]>,
}

/// A freezer cgroup as saved.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedFreezer {
    /// `v1` or `v2`.
    pub version: String,
    /// The cgroup's directory.
    pub path: PathBuf,
}

impl SavedFreezer {
    /// Saves a freezer cgroup.
    pub fn of(cgroup: &FreezerCgroup) -> SavedFreezer {
        SavedFreezer {
            version: cgroup.version().to_string(),
            path: cgroup.path().to_path_buf(),
        }
    }

    /// The saved cgroup, resolved again as [`FreezerCgroup::at`] resolves a path (links and
    /// `..` followed, then it must be a freezer cgroup directory below its hierarchy's mount,
    /// not the mount itself), and of the saved version: a state file names no other directory.
    pub fn resolve(&self, h: &Hierarchies) -> Result<FreezerCgroup, SavedCgroupError> {
        let cgroup = FreezerCgroup::at(&self.path, h)?;
        if cgroup.version().to_string() != self.version {
            return Err(SavedCgroupError::Version {
                path: self.path.clone(),
                found: cgroup.version(),
                saved: self.version.clone(),
            });
        }
        Ok(cgroup)
    }

    /// The freezer cgroup saved; `None` for an unknown version.
    pub fn cgroup(&self) -> Option<FreezerCgroup> {
        let version = match self.version.as_str() {
            "v1" => FreezerVersion::V1,
            "v2" => FreezerVersion::V2,
            _ => return None,
        };
        Some(FreezerCgroup::new(version, self.path.clone()))
    }
}

/// The accounting of every vGPU and GPU, saved about once a second (`accounting.json`) so that
/// a restart carries GPU time, waits and switches over, losing at most the last second.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedAccounting {
    /// [`FORMAT`].
    pub format: u32,
    /// Per vGPU id.
    pub vgpus: BTreeMap<String, SavedVgpuAccounting>,
    /// Per GPU index.
    pub gpus: BTreeMap<u32, SavedGpuAccounting>,
    /// The number the next vGPU gets, so that a restart never gives an id twice. Absent in
    /// files written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_vgpu: Option<u64>,
}

/// One vGPU's accounting.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedVgpuAccounting {
    /// GPU seconds received.
    pub gpu_seconds: f64,
    /// Seconds waited for windows.
    pub wait_seconds: f64,
    /// Windows received.
    pub windows: u64,
    /// Seconds its cgroup was frozen.
    pub frozen_seconds: f64,
}

/// One GPU's accounting.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedGpuAccounting {
    /// Its UUID (accounting is carried over only to the same GPU).
    pub uuid: String,
    /// Seconds busy.
    pub busy_seconds: f64,
    /// Window switches.
    pub switches: u64,
}

const ACCOUNTING: &str = "accounting.json";
const FROZEN: &str = "frozen.json";
/// The id ceiling ([`StateDir::save_id_ceiling`]).
const IDS: &str = "ids";
const LOCK: &str = "lock";
/// The subdirectory of the records' second copies.
const COPIES: &str = "copies";

/// The largest state file read, in bytes: a record is about 1 KiB, the frozen list 100 bytes a
/// cgroup, the accounting 200 bytes a vGPU.
pub const MAX_FILE: u64 = 4 << 20;

/// The cgroups the service may have frozen, as saved in `frozen.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedFrozen {
    /// [`FORMAT`].
    pub format: u32,
    /// The cgroups.
    pub frozen: Vec<SavedFreezer>,
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// Why the state directory cannot be used. One line, with the path.
#[derive(Debug, thiserror::Error)]
#[error("state_dir: cannot {action} {path}: {source}")]
pub struct StateError {
    /// What was being done.
    pub action: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// Why it failed.
    pub source: std::io::Error,
}

/// Why a saved cgroup is not taken back.
#[derive(Debug, thiserror::Error)]
pub enum SavedCgroupError {
    /// It is no freezer cgroup below a hierarchy's mount (any more).
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// It is of the other freezer version.
    #[error("{} is a {found} freezer cgroup, not {} as saved", path.display(), shown(saved))]
    Version {
        /// The saved path.
        path: PathBuf,
        /// What it is.
        found: FreezerVersion,
        /// What the file said.
        saved: String,
    },
}

/// Why the frozen list cannot be read. One line, with the path.
#[derive(Debug, thiserror::Error)]
pub enum FrozenListError {
    /// Not a small regular file that can be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// `state_dir/frozen.json`.
        path: PathBuf,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// Not the JSON of a list.
    #[error("{}: {}", path.display(), shown(&source.to_string()))]
    Parse {
        /// `state_dir/frozen.json`.
        path: PathBuf,
        /// serde's line (field names quoted as written, so shown escaped).
        #[source]
        source: serde_json::Error,
    },
    /// A list of another format.
    #[error("{}: format {format} is not known (this gpuplex writes {FORMAT})", path.display())]
    Format {
        /// `state_dir/frozen.json`.
        path: PathBuf,
        /// Its format.
        format: u32,
    },
}

/// The state directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    dir: PathBuf,
}

/// What [`StateDir::load`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The records read.
    pub vgpus: Vec<SavedVgpu>,
    /// Files that could not be read, nor their copies, set aside as `.bad`, each with why
    /// (one line).
    pub unreadable: Vec<String>,
    /// Records that could not be read and were restored from their copies, each with why
    /// (one line).
    pub restored: Vec<String>,
}

impl StateDir {
    /// Opens (creating it, mode 0700) the state directory.
    pub fn open(dir: &Path) -> Result<StateDir, StateError> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| StateError {
                action: "create",
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(StateDir {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The node lock's file ([`StateDir::lock`]).
    pub fn lock_path(&self) -> PathBuf {
        self.dir.join(LOCK)
    }

    fn file_of(&self, vgpu: VgpuId) -> PathBuf {
        self.dir.join(format!("{vgpu}.json"))
    }

    /// The copies' directory, made (mode 0700) when absent. Written into, so it must be a
    /// directory of its own, not a link to one elsewhere: anything else there is refused. Only
    /// saves need it: opening the state directory does not, so that the watchdog and `stop`
    /// thaw whatever stands there.
    fn copies(&self) -> Result<PathBuf, StateError> {
        use std::os::unix::fs::DirBuilderExt;
        let copies = self.dir.join(COPIES);
        let made = match fs::DirBuilder::new().mode(0o700).create(&copies) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            other => other,
        };
        made.and_then(|()| match fs::symlink_metadata(&copies) {
            Ok(m) if m.is_dir() => Ok(()),
            Ok(_) => Err(std::io::Error::other(
                "not a directory (remove it: gpuplex keeps its records' copies there)",
            )),
            Err(e) => Err(e),
        })
        .map_err(|source| StateError {
            action: "create",
            path: copies.clone(),
            source,
        })?;
        Ok(copies)
    }

    /// Writes a record atomically (temporary file, flush, rename, flush the directory), then
    /// its copy the same way: at any moment at least one of the two is whole, and the record
    /// is never older than its copy.
    pub fn save(&self, saved: &SavedVgpu) -> Result<(), StateError> {
        let id: VgpuId = saved.vgpu.parse().map_err(|e| StateError {
            action: "save",
            path: self.dir.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?;
        let mut bytes = serde_json::to_vec_pretty(saved).expect("a record always serializes");
        bytes.push(b'\n');
        let copies = self.copies()?;
        write_durably(&self.file_of(id), &bytes)?;
        write_durably(&copies.join(format!("{id}.json")), &bytes)
    }

    /// Removes a record, then its copy; an absent one is not an error.
    pub fn remove(&self, vgpu: VgpuId) -> Result<(), StateError> {
        remove_durably(&self.file_of(vgpu))?;
        remove_durably(&self.copies()?.join(format!("{vgpu}.json")))
    }

    /// Writes the accounting: a temporary file renamed over the old one, not flushed to disk
    /// (it is rewritten every second; a power cut may lose it, a killed service does not).
    pub fn save_accounting(&self, accounting: &SavedAccounting) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(accounting).expect("accounting always serializes");
        self.replace(ACCOUNTING, &bytes)
    }

    /// Replaces the file `name` with `bytes`: a temporary file renamed over it, so that a reader
    /// sees the old file or the new one; not flushed to disk.
    fn replace(&self, name: &str, bytes: &[u8]) -> Result<(), StateError> {
        let path = self.dir.join(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, bytes)
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|source| StateError {
                action: "write",
                path,
                source,
            })
    }

    /// Reads the accounting; `None` when there is none or it cannot be read (it is only
    /// accounting: the registrations do not depend on it).
    pub fn load_accounting(&self) -> Option<SavedAccounting> {
        let bytes = read_file(&self.dir.join(ACCOUNTING)).ok()?;
        serde_json::from_slice::<SavedAccounting>(&bytes)
            .ok()
            .filter(|a| a.format == FORMAT)
    }

    /// Writes the vGPU id ceiling durably (temporary file, flush, rename, flush the directory):
    /// no id at or above it has been given. The service writes a ceiling before it gives the
    /// ids below it, a block at a time, so that after any death the next service starts at or
    /// above every id given before, a refusal's spent id and a released vGPU's included,
    /// which neither leaves a record.
    pub fn save_id_ceiling(&self, ceiling: u64) -> Result<(), StateError> {
        write_durably(&self.dir.join(IDS), format!("{ceiling}\n").as_bytes())
    }

    /// The id ceiling written last; `None` when there is none or it cannot be read.
    pub fn load_id_ceiling(&self) -> Option<u64> {
        let bytes = read_file(&self.dir.join(IDS)).ok()?;
        std::str::from_utf8(&bytes).ok()?.trim().parse().ok()
    }

    /// Writes the list of cgroups the service may have frozen: a temporary file renamed over
    /// the old one (a reader sees the old list or the new one), not flushed to disk (a killed
    /// service loses nothing written; a power cut loses the containers too).
    pub fn save_frozen(&self, frozen: &SavedFrozen) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(frozen).expect("a list of paths always serializes");
        self.replace(FROZEN, &bytes)
    }

    /// Reads the list of cgroups the service may have frozen: none when there is no list; an
    /// error (one line) when there is one that cannot be read.
    pub fn load_frozen(&self) -> Result<SavedFrozen, FrozenListError> {
        let path = self.dir.join(FROZEN);
        let bytes = match read_file(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SavedFrozen::default()),
            Err(source) => return Err(FrozenListError::Read { path, source }),
            Ok(bytes) => bytes,
        };
        match serde_json::from_slice::<SavedFrozen>(&bytes) {
            Err(source) => Err(FrozenListError::Parse { path, source }),
            Ok(f) if f.format != FORMAT => Err(FrozenListError::Format {
                path,
                format: f.format,
            }),
            Ok(f) => Ok(f),
        }
    }

    /// Takes the node: an exclusive lock on `state_dir/lock`, held until the process exits (and
    /// as long as a child holds a copy: [`NodeLock::inheritable`]). When another process holds
    /// it, waits up to `wait` (the watchdog of a service that just died holds it until it has
    /// thawed what that service left frozen), then refuses.
    pub fn lock(&self, wait: Duration) -> Result<NodeLock, StateError> {
        use nix::fcntl::{Flock, FlockArg};
        let path = self.lock_path();
        let fail = |source: std::io::Error| StateError {
            action: "lock",
            path: path.clone(),
            source,
        };
        let deadline = std::time::Instant::now() + wait;
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(fail)?;
        let mut said = false;
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                // Never unlocked by a drop: the lock goes when the last copy of the file closes,
                // so that a watchdog that inherited one keeps it after the service is gone.
                Ok(locked) => return Ok(NodeLock(std::mem::ManuallyDrop::new(locked))),
                Err((back, nix::errno::Errno::EWOULDBLOCK))
                    if std::time::Instant::now() < deadline =>
                {
                    if !said {
                        tracing::info!(
                            "{}: held by another process (a node service, or a watchdog thawing); waiting up to {wait:?}",
                            path.display()
                        );
                        said = true;
                    }
                    file = back;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Err(fail(std::io::Error::other(
                        "another gpuplex node service (or the watchdog of one that just stopped) owns this node; stop it first (systemctl stop gpuplex)",
                    )))
                }
                Err((_, e)) => return Err(fail(e.into())),
            }
        }
    }

    /// Reads every record. Leftover temporary files (a write cut short) are removed; a record
    /// that does not parse is restored from its copy, or, when the copy does not parse either,
    /// renamed to `.bad` and reported; a copy that differs from its record is rewritten, and
    /// one without a record removed.
    pub fn load(&self) -> Result<Loaded, StateError> {
        let mut loaded = Loaded::default();
        // Without a usable copies' directory the records are read alone.
        let copies = self
            .copies()
            .inspect_err(|e| tracing::warn!("{e}; records are read without their copies"))
            .ok();
        let copies_now = match &copies {
            Some(dir) => self.listing(dir)?,
            None => Vec::new(),
        };
        for path in copies_now {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let leftover = name.starts_with('.') && name.ends_with(".tmp");
            let orphan = fs::symlink_metadata(self.dir.join(name)).is_err();
            if leftover || (name.ends_with(".json") && orphan) {
                // A write or a removal cut short: the record says what is.
                let _ = fs::remove_file(&path);
            }
        }
        for path in self.listing(&self.dir)? {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".json") || name == ACCOUNTING || name == FROZEN {
                continue;
            }
            let copy = copies.as_ref().map(|dir| dir.join(name));
            let copied = match &copy {
                Some(copy) => record_at(copy, name),
                None => Err("no copies' directory".to_string()),
            };
            match (record_at(&path, name), copied) {
                (Ok((saved, bytes)), copied) => {
                    // Missing (a save cut short, a record of an older gpuplex) or stale.
                    let stale = copied.map(|(c, _)| c).ok() != Some(saved.clone());
                    if let (true, Some(copy)) = (stale, &copy) {
                        if let Err(e) = write_durably(copy, &bytes) {
                            tracing::warn!("{}: cannot write its copy: {e}", path.display());
                        }
                    }
                    loaded.vgpus.push(saved);
                }
                (Err(why), Ok((saved, bytes))) => {
                    let bad = path.with_extension("json.bad");
                    let _ = fs::rename(&path, &bad);
                    let what = match write_durably(&path, &bytes) {
                        Ok(()) => "restored it from its copy".to_string(),
                        Err(e) => format!("read its copy, but cannot write it back ({e})"),
                    };
                    let line = format!(
                        "{}: {why}; {what} (the unreadable file is kept as {})",
                        path.display(),
                        bad.display()
                    );
                    loaded.restored.push(shown(&line).into_owned());
                    loaded.vgpus.push(saved);
                }
                (Err(why), Err(copy_why)) => {
                    let bad = path.with_extension("json.bad");
                    let _ = fs::rename(&path, &bad);
                    if let Some(copy) = &copy {
                        let _ = fs::rename(copy, copy.with_extension("json.bad"));
                    }
                    // One line: serde's messages quote field names as written.
                    let line = format!(
                        "{}: {why}; its copy: {copy_why} (set aside as {})",
                        path.display(),
                        bad.display()
                    );
                    loaded.unreadable.push(shown(&line).into_owned());
                }
            }
        }
        Ok(loaded)
    }

    /// The entries of a directory, sorted.
    fn listing(&self, dir: &Path) -> Result<Vec<PathBuf>, StateError> {
        let entries = fs::read_dir(dir).map_err(|source| StateError {
            action: "read",
            path: dir.to_path_buf(),
            source,
        })?;
        let mut names: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        names.sort();
        Ok(names)
    }
}

/// The record in the file at `path`, which must be named `name` (`vgpu-<n>.json`) after the
/// vGPU it holds, and the file's bytes; why not, in one line.
fn record_at(path: &Path, name: &str) -> Result<(SavedVgpu, Vec<u8>), String> {
    let bytes = read_file(path).map_err(|e| e.to_string())?;
    serde_json::from_slice::<SavedVgpu>(&bytes)
        .map_err(|e| e.to_string())
        .and_then(|s| match s.format {
            FORMAT if s.vgpu.parse::<VgpuId>().is_err() => {
                Err(format!("{:?} is not a vGPU id", s.vgpu))
            }
            FORMAT if format!("{}.json", s.vgpu) == name => Ok((s, bytes)),
            FORMAT => Err(format!("it holds {}, not what its name says", s.vgpu)),
            other => Err(format!(
                "format {other} is not known (this gpuplex writes {FORMAT})"
            )),
        })
}

/// Writes `bytes` as the file `path` atomically: a temporary file beside it, flushed, renamed
/// over it, and the directory flushed.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("record");
    let tmp = dir.join(format!(".{name}.tmp"));
    let err = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError {
            action,
            path,
            source,
        }
    };
    let mut file = File::create(&tmp).map_err(err("create", &tmp))?;
    file.write_all(bytes).map_err(err("write", &tmp))?;
    file.sync_all().map_err(err("flush", &tmp))?;
    drop(file);
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err("rename into", path)(e)
    })?;
    sync_dir(dir)
}

/// Removes the file `path` and flushes its directory; an absent one is not an error.
fn remove_durably(path: &Path) -> Result<(), StateError> {
    match fs::remove_file(path) {
        Ok(()) => sync_dir(path.parent().unwrap_or(Path::new("/"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StateError {
            action: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn sync_dir(dir: &Path) -> Result<(), StateError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| StateError {
            action: "flush",
            path: dir.to_path_buf(),
            source,
        })
}

/// The node's lock ([`StateDir::lock`]).
#[derive(Debug)]
pub struct NodeLock(std::mem::ManuallyDrop<nix::fcntl::Flock<File>>);

impl NodeLock {
    /// A copy of the locked file that a child process inherits (no close-on-exec): the child
    /// holds the lock with it until it exits. Close it in the parent once the child is spawned.
    pub fn inheritable(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        let file: &File = &self.0;
        nix::unistd::dup(file).map_err(std::io::Error::from)
    }
}

/// A state file's bytes: a regular file only, no link followed, never blocking (a FIFO is
/// refused, not waited on), at most [`MAX_FILE`] bytes.
pub fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > MAX_FILE {
        return Err(std::io::Error::other(format!(
            "{} bytes, over the limit of {MAX_FILE}",
            meta.len()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(std::io::Error::other(format!(
            "over the limit of {MAX_FILE} bytes"
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(n: u32) -> SavedVgpu {
        SavedVgpu {
            format: FORMAT,
            vgpu: format!("vgpu-{n}"),
            handle: Some(format!("{n:032x}")),
            annotations: [("gpuplex.io/weight".to_string(), "2".to_string())].into(),
            gpus: vec![SavedGpu {
                index: 0,
                uuid: "GPU-fake-0".into(),
            }],
            reserved_at_unix_ms: 1_700_000_000_000,
            attachment: Some(SavedAttachment {
                container: format!("c{n}"),
                pid: Some(42),
                cgroup: None,
                freezer: SavedFreezer {
                    version: "v1".into(),
                    path: "/sys/fs/cgroup/freezer/c".into(),
                },
                program: None,
            }),
            shared: Vec::new(),
            held: false,
            claim: None,
            units: Vec::new(),
        }
    }

    #[test]
    fn records_round_trip_and_removal_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(&dir.path().join("state")).unwrap();
        state.save(&saved(1)).unwrap();
        state.save(&saved(2)).unwrap();
        let mut second = saved(2);
        second.attachment = None;
        state.save(&second).unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.vgpus, vec![saved(1), second]);
        assert!(loaded.unreadable.is_empty());
        state.remove(VgpuId(1)).unwrap();
        state.remove(VgpuId(1)).unwrap();
        assert_eq!(state.load().unwrap().vgpus.len(), 1);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &fs::metadata(state.path()).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn a_hold_is_saved_only_when_there_is_one_and_old_files_read_as_not_held() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let plain = serde_json::to_value(saved(1)).unwrap();
        assert!(plain.get("held").is_none(), "{plain}");
        let mut held = saved(2);
        held.held = true;
        assert_eq!(serde_json::to_value(&held).unwrap()["held"], true);
        state.save(&saved(1)).unwrap();
        state.save(&held).unwrap();
        assert_eq!(state.load().unwrap().vgpus, vec![saved(1), held]);
    }

    #[test]
    fn a_state_directory_without_copies_is_read_and_given_them() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert!(!dir.path().join(COPIES).exists(), "opening makes nothing");
        fs::write(
            dir.path().join("vgpu-1.json"),
            serde_json::to_vec(&saved(1)).unwrap(),
        )
        .unwrap();
        assert_eq!(state.load().unwrap().vgpus, vec![saved(1)]);
        let copy = dir.path().join(COPIES).join("vgpu-1.json");
        assert_eq!(record_at(&copy, "vgpu-1.json").unwrap().0, saved(1));
    }

    #[test]
    fn torn_and_foreign_files_are_set_aside_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        state.save(&saved(1)).unwrap();
        fs::write(dir.path().join(".vgpu-2.json.tmp"), "{\"format\":").unwrap();
        fs::write(dir.path().join("vgpu-3.json"), "{\"format\":1,").unwrap();
        let mut misnamed = saved(5);
        misnamed.vgpu = "vgpu-6".into();
        fs::write(
            dir.path().join("vgpu-5.json"),
            serde_json::to_vec(&misnamed).unwrap(),
        )
        .unwrap();
        fs::write(dir.path().join("README"), "not a record").unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.vgpus, vec![saved(1)]);
        assert_eq!(loaded.unreadable.len(), 2, "{:?}", loaded.unreadable);
        assert!(loaded.unreadable.iter().all(|u| !u.contains('\n')));
        assert!(dir.path().join("vgpu-3.json.bad").exists());
        assert!(!dir.path().join(".vgpu-2.json.tmp").exists());
        assert!(dir.path().join("README").exists());
    }

    #[test]
    fn a_torn_record_is_restored_from_its_copy_and_keeps_the_torn_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        state.save(&saved(1)).unwrap();
        state.save(&saved(2)).unwrap();
        let record = dir.path().join("vgpu-2.json");
        let whole = fs::read(&record).unwrap();
        for keep in [0, 1, whole.len() / 2, whole.len() - 2] {
            fs::write(&record, &whole[..keep]).unwrap();
            let loaded = state.load().unwrap();
            assert_eq!(loaded.vgpus, vec![saved(1), saved(2)], "torn at {keep}");
            assert!(loaded.unreadable.is_empty(), "{:?}", loaded.unreadable);
            assert_eq!(loaded.restored.len(), 1, "{:?}", loaded.restored);
            let line = &loaded.restored[0];
            assert!(
                line.contains("vgpu-2.json") && line.contains("restored") && !line.contains('\n')
            );
            assert_eq!(
                fs::read(&record).unwrap(),
                whole,
                "the record is whole again"
            );
            assert_eq!(
                fs::read(dir.path().join("vgpu-2.json.bad")).unwrap(),
                &whole[..keep]
            );
            // Read again, nothing is left to restore.
            let again = state.load().unwrap();
            assert!(again.restored.is_empty() && again.unreadable.is_empty());
        }
    }

    #[test]
    fn a_record_whose_copy_is_torn_too_is_set_aside_and_its_copy_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        state.save(&saved(1)).unwrap();
        fs::write(dir.path().join("vgpu-1.json"), "{").unwrap();
        fs::write(dir.path().join(COPIES).join("vgpu-1.json"), "").unwrap();
        let loaded = state.load().unwrap();
        assert!(loaded.vgpus.is_empty() && loaded.restored.is_empty());
        assert_eq!(loaded.unreadable.len(), 1, "{:?}", loaded.unreadable);
        assert!(
            loaded.unreadable[0].contains("its copy"),
            "{:?}",
            loaded.unreadable
        );
        assert!(dir.path().join("vgpu-1.json.bad").exists());
        assert!(dir.path().join(COPIES).join("vgpu-1.json.bad").exists());
        assert!(state.load().unwrap().unreadable.is_empty(), "reported once");
    }

    #[test]
    fn a_missing_or_stale_copy_is_rewritten_and_a_copy_without_its_record_removed() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let copy = |n: u32| dir.path().join(COPIES).join(format!("vgpu-{n}.json"));
        state.save(&saved(1)).unwrap();
        state.save(&saved(2)).unwrap();
        state.save(&saved(3)).unwrap();
        // A record of a gpuplex that kept no copies; a save cut short between the two writes;
        // a removal cut short between the two removals.
        fs::remove_file(copy(1)).unwrap();
        let mut newer = saved(2);
        newer.held = true;
        fs::write(
            dir.path().join("vgpu-2.json"),
            serde_json::to_vec(&newer).unwrap(),
        )
        .unwrap();
        fs::remove_file(dir.path().join("vgpu-3.json")).unwrap();
        fs::write(dir.path().join(COPIES).join(".vgpu-4.json.tmp"), "{").unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.vgpus, vec![saved(1), newer.clone()]);
        assert!(loaded.restored.is_empty() && loaded.unreadable.is_empty());
        assert_eq!(record_at(&copy(1), "vgpu-1.json").unwrap().0, saved(1));
        assert_eq!(record_at(&copy(2), "vgpu-2.json").unwrap().0, newer);
        assert!(
            !copy(3).exists(),
            "a released vGPU does not come back from its copy"
        );
        assert!(!dir.path().join(COPIES).join(".vgpu-4.json.tmp").exists());
        state.remove(VgpuId(1)).unwrap();
        assert!(!copy(1).exists());
    }

    #[test]
    fn a_link_in_place_of_the_copies_directory_is_refused_by_saves_only() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        fs::write(elsewhere.path().join("vgpu-1.json"), "{").unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join(COPIES)).unwrap();
        // Opened and read (the watchdog and `stop` thaw from here), nothing followed.
        let state = StateDir::open(dir.path()).unwrap();
        fs::write(dir.path().join("vgpu-1.json"), "{").unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.unreadable.len(), 1, "{:?}", loaded.unreadable);
        assert!(loaded.restored.is_empty());
        assert_eq!(
            fs::read(elsewhere.path().join("vgpu-1.json")).unwrap(),
            b"{"
        );
        // A save is refused in one line, naming the link.
        let line = state.save(&saved(2)).unwrap_err().to_string();
        assert!(line.contains("copies") && !line.contains('\n'), "{line}");
        assert!(!elsewhere.path().join("vgpu-2.json").exists());
        // A record named like one but a link: set aside with its copy missing, nothing followed.
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        state.save(&saved(1)).unwrap();
        fs::remove_file(dir.path().join("vgpu-1.json")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("vgpu-1.json")).unwrap();
        let loaded = state.load().unwrap();
        assert_eq!(loaded.vgpus, vec![saved(1)], "restored from its copy");
        assert_eq!(loaded.restored.len(), 1);
        assert!(fs::symlink_metadata(dir.path().join("vgpu-1.json"))
            .unwrap()
            .is_file());
    }

    #[test]
    fn accounting_round_trips_beside_the_records_without_being_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert_eq!(state.load_accounting(), None);
        let mut accounting = SavedAccounting {
            format: FORMAT,
            ..SavedAccounting::default()
        };
        accounting.vgpus.insert(
            "vgpu-1".into(),
            SavedVgpuAccounting {
                gpu_seconds: 1.5,
                wait_seconds: 0.5,
                windows: 3,
                frozen_seconds: 0.4,
            },
        );
        accounting.gpus.insert(
            0,
            SavedGpuAccounting {
                uuid: "GPU-0".into(),
                busy_seconds: 2.0,
                switches: 6,
            },
        );
        state.save_accounting(&accounting).unwrap();
        state.save(&saved(1)).unwrap();
        assert_eq!(state.load_accounting(), Some(accounting));
        let loaded = state.load().unwrap();
        assert_eq!(loaded.vgpus.len(), 1);
        assert!(loaded.unreadable.is_empty(), "{:?}", loaded.unreadable);
        fs::write(dir.path().join(ACCOUNTING), "{").unwrap();
        assert_eq!(state.load_accounting(), None);
    }

    #[test]
    fn the_frozen_list_round_trips_and_a_missing_one_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert_eq!(state.load_frozen().unwrap(), SavedFrozen::default());
        let frozen = SavedFrozen {
            format: FORMAT,
            frozen: vec![SavedFreezer {
                version: "v1".into(),
                path: "/sys/fs/cgroup/freezer/x".into(),
            }],
        };
        state.save_frozen(&frozen).unwrap();
        assert_eq!(state.load_frozen().unwrap(), frozen);
        assert!(state.load().unwrap().unreadable.is_empty(), "not a record");
        fs::write(dir.path().join(FROZEN), "[").unwrap();
        let line = state.load_frozen().unwrap_err().to_string();
        assert!(
            line.contains("frozen.json") && !line.contains('\n'),
            "{line}"
        );
    }

    #[test]
    fn a_state_file_is_read_only_when_regular_small_and_not_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Refused at once: a FIFO with no writer would block a plain read for ever.
        assert!(read_file(&fifo).is_err());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        assert!(read_file(&link).is_err());
        let huge = dir.path().join("huge");
        File::create(&huge).unwrap().set_len(MAX_FILE + 1).unwrap();
        assert!(read_file(&huge)
            .unwrap_err()
            .to_string()
            .contains("over the limit"));
        let fine = dir.path().join("fine");
        fs::write(&fine, b"{}").unwrap();
        assert_eq!(read_file(&fine).unwrap(), b"{}");
    }

    #[test]
    fn a_freezer_round_trips() {
        let f = SavedFreezer {
            version: "v2".into(),
            path: "/sys/fs/cgroup/unified/x".into(),
        };
        let cgroup = f.cgroup().unwrap();
        assert_eq!(cgroup.version(), FreezerVersion::V2);
        assert_eq!(SavedFreezer::of(&cgroup), f);
        let unknown = SavedFreezer {
            version: "v3".into(),
            ..f
        };
        assert!(unknown.cgroup().is_none());
    }
}
