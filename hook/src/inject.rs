//! Injection into a container that exists already: what `gpuplex-hook` does at `createRuntime`
//! (or `prestart`) for plain runc and crun users, whose spec nobody edited before create.
//!
//! - [`create_device_nodes`] / [`remove_device_nodes`]: character device nodes made inside the
//!   container's mount namespace;
//! - [`allow_devices`] / [`deny_devices`]: the cgroup v1 devices controller of the container;
//! - [`bind_identity`] / [`unbind_identity`]: the vGPU identity, bind-mounted read-only at
//!   `/run/gpuplex/vgpu.json`.
//!
//! Every function that adds something returns what it added, and its undo function removes
//! exactly that, so a stage that fails half-way can roll back.
//!
//! # Why the mount namespace
//! At `createRuntime` the container's `/dev` is a tmpfs mounted in the container's mount
//! namespace only: a node made at `<rootfs>/dev/X` from the host lands in the host directory
//! underneath it, which the container never sees. So the work is done inside that namespace,
//! where the rootfs has not been pivoted yet and is still at its host path. `setns(CLONE_NEWNS)`
//! is refused to a thread that shares its file-system attributes (root, cwd, umask) with others,
//! so a dedicated thread first calls `unshare(CLONE_FS)`, then enters the namespace, does the
//! work and ends: the caller's namespace never changes. The same code also works after the
//! pivot (the namespace's root is then the rootfs itself); both cases are told apart by the
//! rootfs's device and inode.
//!
//! # Paths inside the rootfs
//! The rootfs is the image's content. Paths inside it are walked one component at a time from
//! the rootfs, without following symlinks: a symlink planted in an image cannot redirect a node
//! or a mount point onto the host's own files (inside the namespace, before the pivot, an
//! absolute symlink would resolve against the host's tree).
//!
//! # Where things land
//! A node lands where the container's mount namespace puts its path: on the runtime's `/dev`
//! tmpfs normally (gone with the container); directly in the rootfs directory when the spec has
//! no `/dev` mount. The identity's mount point (`run/gpuplex/vgpu.json`) is made in the rootfs
//! directory unless `/run` is a mount of its own; a rootfs that is `root.readonly` is still
//! writable at `createRuntime` with runc (it is made read-only after the pivot).

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;

mod bind;
mod cgroup;
mod nodes;
mod ns;

pub use bind::{bind_identity, unbind_identity, IdentityMount};
pub use cgroup::{allow_devices, deny_devices, DeviceRule};
pub use nodes::{create_device_nodes, remove_device_nodes};

/// What can go wrong injecting into a container. Each message is one line that names the step,
/// the path and the cause, and what to do where there is something to do.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    /// A path handed to the injection cannot be used as given.
    #[error("cannot inject at {}: {reason}", path.display())]
    InvalidPath {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A device node of the edits that is no character device with its major and minor
    /// numbers: a running container gets only those.
    #[error(
        "cannot inject device node {path}: a running container is given character devices with their major and minor numbers only"
    )]
    NotACharNode {
        /// The node's path in the container.
        path: String,
    },
    /// The container process's mount namespace could not be opened or entered.
    #[error(
        "cannot {step} of container process {pid}: {source}; the container must be being created (run gpuplex-hook at createRuntime or prestart) and the hook must run as root"
    )]
    Namespace {
        /// The container's init pid.
        pid: u32,
        /// What was being done.
        step: &'static str,
        /// Why it failed.
        source: Errno,
    },
    /// The thread that enters the namespace could not be started.
    #[error(
        "cannot start a thread to enter the mount namespace of container process {pid}: {source}"
    )]
    Thread {
        /// The container's init pid.
        pid: u32,
        /// Why.
        source: io::Error,
    },
    /// The rootfs could not be found, on the host or in the container's mount namespace.
    #[error(
        "cannot find the container rootfs {} {place}: {source}; check root.path in the bundle's config.json",
        path.display()
    )]
    Rootfs {
        /// The rootfs, as a host path.
        path: PathBuf,
        /// Where it was looked for.
        place: String,
        /// Why it was not found.
        source: Errno,
    },
    /// The rootfs's path inside the namespace is not the rootfs the host has.
    #[error(
        "{} in the mount namespace of container process {pid} is not the directory it is on the host; was the rootfs mounted after the container was created? pre-edit the spec instead (podman's precreate hook or the gpuplex containerd shim)",
        path.display()
    )]
    RootfsMismatch {
        /// The container's init pid.
        pid: u32,
        /// The rootfs, as a host path.
        path: PathBuf,
    },
    /// A file-system operation inside the container's rootfs failed.
    #[error(
        "cannot {step} {} in the container's mount namespace: {source}{}",
        path.display(),
        fs_hint(*source)
    )]
    Fs {
        /// What was being done (`create the device node`, `create the directory`, ...).
        step: &'static str,
        /// The path, as the host names it (`<rootfs>/dev/nvidia0`).
        path: PathBuf,
        /// Why it failed.
        source: Errno,
    },
    /// Another kind of file is where a node or a mount point should be.
    #[error(
        "{} exists in the container but is {found}, not {wanted}; remove it from the image or choose another path",
        path.display()
    )]
    Occupied {
        /// The path, as the host names it.
        path: PathBuf,
        /// What is there.
        found: String,
        /// What should be there.
        wanted: String,
    },
    /// `/proc/PID/cgroup` or `/proc/self/mountinfo` could not be read.
    #[error("cannot find the devices cgroup of process {pid}: {source}")]
    CgroupRead {
        /// The container's init pid.
        pid: u32,
        /// Why (it names the file).
        #[source]
        source: gpuplex_cgroup::CgroupError,
    },
    /// The process has no cgroup v1 devices controller: on cgroup v2, device access is an eBPF
    /// program, which gpuplex-hook does not edit yet.
    #[error(
        "process {pid} has no cgroup v1 devices controller (cgroup v2: device rules are an eBPF program there); gpuplex-hook does not support v2 device rules yet: pre-edit the spec instead (podman's precreate hook or the gpuplex containerd shim), or add the allow rules to linux.resources.devices in config.json by hand"
    )]
    CgroupV2Devices {
        /// The container's init pid.
        pid: u32,
    },
    /// The process's devices cgroup is under no devices mount of this mount namespace.
    #[error(
        "the devices cgroup {cgroup} of process {pid} is under no cgroup v1 devices mount in /proc/self/mountinfo; mount the hierarchy (mount -t cgroup -o devices cgroup /sys/fs/cgroup/devices) or run gpuplex-hook in the host's mount namespace"
    )]
    CgroupNotMounted {
        /// The container's init pid.
        pid: u32,
        /// The cgroup, as /proc/PID/cgroup names it.
        cgroup: String,
    },
    /// A rule could not be written, or the list could not be read back.
    #[error("cannot {step} {}: {source}{}", path.display(), cgroup_hint(source))]
    Cgroup {
        /// What was being done (`write c 195:0 rwm to`, `read`).
        step: String,
        /// The cgroup file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A rule was written but `devices.list` does not show its effect.
    #[error(
        "wrote `{rule}` to {} but devices.list does not show it {expected} afterwards; another rule covers it or something rewrote the cgroup (runc update?)",
        path.display()
    )]
    CgroupNotApplied {
        /// The file written.
        path: PathBuf,
        /// The rule.
        rule: String,
        /// `allowed` or `denied`.
        expected: &'static str,
    },
    /// The host's identity file could not be opened.
    #[error("cannot open the vGPU identity {}: {source}", path.display())]
    Identity {
        /// The host path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The identity file is not reachable from the container's mount namespace and the kernel
    /// cannot carry a mount into it.
    #[error(
        "the vGPU identity {} is not visible in the mount namespace of container process {pid} and this kernel cannot carry a mount into it (open_tree: {source}); keep identity files in a directory that exists before containers are created (e.g. /run/gpuplex)",
        path.display()
    )]
    IdentityNotVisible {
        /// The container's init pid.
        pid: u32,
        /// The host path.
        path: PathBuf,
        /// Why open_tree failed.
        source: Errno,
    },
    /// A mount or unmount inside the container's mount namespace failed.
    #[error(
        "cannot {step} {} in the mount namespace of container process {pid}: {source}",
        path.display()
    )]
    Mount {
        /// The container's init pid.
        pid: u32,
        /// What was being done.
        step: &'static str,
        /// The mount point, as the host names it.
        path: PathBuf,
        /// Why.
        source: Errno,
    },
}

fn fs_hint(errno: Errno) -> &'static str {
    match errno {
        Errno::EROFS => "; the container's rootfs is read-only at this point: add the path to the image, or pre-edit the spec (podman's precreate hook or the gpuplex containerd shim)",
        Errno::ELOOP => "; a symlink in the container's rootfs is in the way and gpuplex does not follow symlinks there: remove it from the image",
        Errno::ENOTDIR => "; a component of the path is not a directory in the container: fix the image",
        Errno::EPERM | Errno::EACCES => "; gpuplex-hook must run as root (with CAP_MKNOD and CAP_SYS_ADMIN)",
        Errno::ENOSPC => "; the file system in the container is full",
        _ => "",
    }
}

fn cgroup_hint(error: &io::Error) -> &'static str {
    match error.raw_os_error() {
        Some(libc::EPERM) => "; the parent cgroup does not allow this device (see its devices.list) or the hook is not root",
        Some(libc::ENOENT) => "; the container's cgroup is gone: has it exited?",
        _ => "",
    }
}
