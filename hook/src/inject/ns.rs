//! Entering a container's mount namespace from a thread of its own, finding the rootfs there,
//! and walking paths inside it without following symlinks.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{open, openat, OFlag};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::stat::{fstat, fstatat, mkdirat, umask, FileStat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

use super::InjectError;

/// Runs `work` on a thread of its own inside the mount namespace of process `pid`.
///
/// The thread first unshares its file-system attributes (`setns(CLONE_NEWNS)` refuses a thread
/// that shares them) and sets its umask to 0, so modes are exactly those asked for; it ends
/// when `work` returns, and the caller's namespace, root, cwd and umask never change.
pub(super) fn in_mount_namespace<T, F>(pid: u32, work: F) -> Result<T, InjectError>
where
    T: Send,
    F: FnOnce() -> Result<T, InjectError> + Send,
{
    let ns = File::open(format!("/proc/{pid}/ns/mnt")).map_err(|e| InjectError::Namespace {
        pid,
        step: "open the mount namespace (/proc/PID/ns/mnt)",
        source: errno(&e),
    })?;
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("gpuplex-mntns".into())
            .spawn_scoped(scope, move || {
                unshare(CloneFlags::CLONE_FS).map_err(|source| InjectError::Namespace {
                    pid,
                    step: "unshare the file-system attributes to enter the mount namespace",
                    source,
                })?;
                setns(ns.as_fd(), CloneFlags::CLONE_NEWNS).map_err(|source| {
                    InjectError::Namespace {
                        pid,
                        step: "enter the mount namespace",
                        source,
                    }
                })?;
                umask(Mode::empty());
                work()
            })
            .map_err(|source| InjectError::Thread { pid, source })?;
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The errno of an I/O error (EIO when it has none).
pub(super) fn errno(error: &io::Error) -> Errno {
    Errno::from_raw(error.raw_os_error().unwrap_or(libc::EIO))
}

/// The rootfs as the host sees it, taken before entering the namespace.
pub(super) struct HostRootfs {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl HostRootfs {
    /// Looks the rootfs up on the host (it must be an absolute path to a directory).
    pub(super) fn of(rootfs: &Path) -> Result<HostRootfs, InjectError> {
        if !rootfs.is_absolute() {
            return Err(InjectError::InvalidPath {
                path: rootfs.to_path_buf(),
                reason: "the container rootfs must be an absolute host path (resolve root.path against the bundle)",
            });
        }
        let st = nix::sys::stat::stat(rootfs).map_err(|source| InjectError::Rootfs {
            path: rootfs.to_path_buf(),
            place: "on the host".into(),
            source,
        })?;
        Ok(HostRootfs {
            path: rootfs.to_path_buf(),
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Opens the rootfs from inside the namespace: `/` itself once the container has pivoted
    /// into it, else its host path, which the namespace still shows before the pivot.
    pub(super) fn open_inside(&self, pid: u32) -> Result<Rootfs, InjectError> {
        let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let not_found = |source| InjectError::Rootfs {
            path: self.path.clone(),
            place: format!("in the mount namespace of container process {pid}"),
            source,
        };
        let slash = open("/", flags, Mode::empty()).map_err(not_found)?;
        if self.is(&fstat(&slash).map_err(not_found)?) {
            return Ok(Rootfs {
                fd: slash,
                host: self.path.clone(),
                inside: PathBuf::from("/"),
            });
        }
        let fd = open(&self.path, flags, Mode::empty()).map_err(not_found)?;
        if !self.is(&fstat(&fd).map_err(not_found)?) {
            return Err(InjectError::RootfsMismatch {
                pid,
                path: self.path.clone(),
            });
        }
        Ok(Rootfs {
            fd,
            host: self.path.clone(),
            inside: self.path.clone(),
        })
    }

    fn is(&self, st: &FileStat) -> bool {
        st.st_dev == self.dev && st.st_ino == self.ino
    }
}

/// The rootfs, opened inside the container's mount namespace.
pub(super) struct Rootfs {
    /// The rootfs directory.
    pub(super) fd: OwnedFd,
    /// Its host path: the paths reported to callers are under it.
    pub(super) host: PathBuf,
    /// Its path in the namespace: the host path before the pivot, `/` after.
    pub(super) inside: PathBuf,
}

impl Rootfs {
    /// The host's name for `names` under the rootfs.
    pub(super) fn host_path(&self, names: &[&OsStr]) -> PathBuf {
        names
            .iter()
            .fold(self.host.clone(), |path, name| path.join(name))
    }

    /// The namespace's name for `names` under the rootfs.
    pub(super) fn inside_path(&self, names: &[&OsStr]) -> PathBuf {
        names
            .iter()
            .fold(self.inside.clone(), |path, name| path.join(name))
    }

    /// The components of a host path under the rootfs.
    pub(super) fn names_of<'a>(&self, host_path: &'a Path) -> Result<Vec<&'a OsStr>, InjectError> {
        let relative =
            host_path
                .strip_prefix(&self.host)
                .map_err(|_| InjectError::InvalidPath {
                    path: host_path.to_path_buf(),
                    reason: "not under the container rootfs",
                })?;
        names(host_path, relative.components())
    }

    /// Opens the directory `names` under the rootfs one component at a time, never following
    /// a symlink. With `created`, a missing directory is made (mode 0755) and its host path
    /// recorded.
    pub(super) fn open_dir(
        &self,
        names: &[&OsStr],
        mut created: Option<&mut Vec<PathBuf>>,
    ) -> Result<OwnedFd, InjectError> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mut dir = self.fd.try_clone().map_err(|e| InjectError::Fs {
            step: "open the directory",
            path: self.host.clone(),
            source: errno(&e),
        })?;
        for (i, name) in names.iter().enumerate() {
            let path = || self.host_path(&names[..=i]);
            let opened = match openat(&dir, *name, flags, Mode::empty()) {
                Err(Errno::ENOENT) if created.is_some() => {
                    match mkdirat(&dir, *name, Mode::from_bits_truncate(0o755)) {
                        Ok(()) => {
                            if let Some(created) = created.as_deref_mut() {
                                created.push(path());
                            }
                        }
                        Err(Errno::EEXIST) => {}
                        Err(source) => {
                            return Err(InjectError::Fs {
                                step: "create the directory",
                                path: path(),
                                source,
                            })
                        }
                    }
                    openat(&dir, *name, flags, Mode::empty())
                }
                opened => opened,
            };
            dir = opened.map_err(|source| match source {
                Errno::ENOTDIR | Errno::ELOOP => match lstat_at(&dir, name) {
                    Ok(Some(st)) => InjectError::Occupied {
                        path: path(),
                        found: describe(&st),
                        wanted: "a directory (gpuplex follows no symlink inside the rootfs)".into(),
                    },
                    _ => InjectError::Fs {
                        step: "open the directory",
                        path: path(),
                        source,
                    },
                },
                source => InjectError::Fs {
                    step: "open the directory",
                    path: path(),
                    source,
                },
            })?;
        }
        Ok(dir)
    }

    /// Removes `host_path`, something an injection created under the rootfs: a directory only
    /// when empty (one that something else was put in stays), anything else unlinked. What is
    /// gone already is not an error.
    pub(super) fn remove(&self, host_path: &Path) -> Result<(), InjectError> {
        let names = self.names_of(host_path)?;
        let Some((leaf, parents)) = names.split_last() else {
            return Err(InjectError::InvalidPath {
                path: host_path.to_path_buf(),
                reason: "refusing to remove the container rootfs itself",
            });
        };
        let dir = match self.open_dir(parents, None) {
            Err(InjectError::Fs {
                source: Errno::ENOENT,
                ..
            }) => return Ok(()),
            dir => dir?,
        };
        let fail = |source| InjectError::Fs {
            step: "remove",
            path: host_path.to_path_buf(),
            source,
        };
        let st = match lstat_at(&dir, leaf) {
            Ok(None) => return Ok(()),
            Ok(Some(st)) => st,
            Err(source) => return Err(fail(source)),
        };
        let flag = if kind(&st) == SFlag::S_IFDIR {
            UnlinkatFlags::RemoveDir
        } else {
            UnlinkatFlags::NoRemoveDir
        };
        match unlinkat(&dir, *leaf, flag) {
            Ok(()) | Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST) => Ok(()),
            Err(source) => Err(fail(source)),
        }
    }
}

/// The names of an absolute path inside the container (`/dev/nvidia0` gives `dev`, `nvidia0`):
/// no `..`, at least one name.
pub(super) fn container_names(path: &Path) -> Result<Vec<&OsStr>, InjectError> {
    let mut components = path.components();
    if components.next() != Some(Component::RootDir) {
        return Err(InjectError::InvalidPath {
            path: path.to_path_buf(),
            reason: "a path inside the container must be absolute",
        });
    }
    names(path, components)
}

fn names<'a>(
    path: &Path,
    components: impl Iterator<Item = Component<'a>>,
) -> Result<Vec<&'a OsStr>, InjectError> {
    let mut names = Vec::new();
    for component in components {
        match component {
            Component::Normal(name) => names.push(name),
            Component::CurDir => {}
            _ => {
                return Err(InjectError::InvalidPath {
                    path: path.to_path_buf(),
                    reason: "a path inside the container may not contain `..`",
                })
            }
        }
    }
    if names.is_empty() {
        return Err(InjectError::InvalidPath {
            path: path.to_path_buf(),
            reason: "the path names no file",
        });
    }
    Ok(names)
}

/// `fstatat` without following a symlink; `None` when nothing is there.
pub(super) fn lstat_at(dir: &OwnedFd, name: &OsStr) -> Result<Option<FileStat>, Errno> {
    match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The file type bits of a stat.
pub(super) fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// What a stat describes, for messages: `a directory`, `the character device 1:3`, ...
pub(super) fn describe(st: &FileStat) -> String {
    let dev = || {
        let rdev = st.st_rdev;
        format!(
            "{}:{}",
            nix::sys::stat::major(rdev),
            nix::sys::stat::minor(rdev)
        )
    };
    match kind(st) {
        SFlag::S_IFDIR => "a directory".into(),
        SFlag::S_IFREG => "a regular file".into(),
        SFlag::S_IFLNK => "a symlink".into(),
        SFlag::S_IFCHR => format!("the character device {}", dev()),
        SFlag::S_IFBLK => format!("the block device {}", dev()),
        SFlag::S_IFIFO => "a fifo".into(),
        SFlag::S_IFSOCK => "a socket".into(),
        _ => "a file of unknown type".into(),
    }
}
