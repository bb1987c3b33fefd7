//! gpuplex's cgroup library: finding a process's cgroups and freezing, thawing and reading them,
//! v1 and v2 behind one type ([`FreezerCgroup`]).
//!
//! gpuplex revokes an execution window by freezing the container's whole cgroup and grants one by
//! thawing it. Two kernel interfaces do this, and a machine may have either or both:
//!
//! - **v1**: the `freezer` controller's hierarchy (usually `/sys/fs/cgroup/freezer`). Writing
//!   `FROZEN` to `freezer.state` starts freezing; the file reads `FREEZING` until every task has
//!   stopped, then `FROZEN`. Reading the file is what moves it on, so we poll it.
//! - **v2**: any cgroup2 directory (`/sys/fs/cgroup` on a pure v2 machine, `/sys/fs/cgroup/unified`
//!   on a hybrid one). Writing `1` to `cgroup.freeze` starts freezing; `cgroup.events` says
//!   `frozen 1` once it is done.
//!
//! Where things are mounted is read from `/proc/self/mountinfo` ([`Hierarchies`]), never assumed.
//! A process's cgroup comes from `/proc/PID/cgroup` ([`FreezerCgroup::of_pid`]); its v1 freezer
//! cgroup wins over its cgroup2 one, because runc on a hybrid machine puts containers in both and
//! freezes through v1.
//!
//! Guarantees the node service relies on:
//!
//! - [`FreezerCgroup::freeze`] and [`freeze_all`] never leave a cgroup frozen when they report a
//!   failure: they thaw it again, and if even that fails they say so
//!   ([`CgroupError::StillFrozen`]).
//! - A cgroup whose directory disappeared (its container exited) reports [`CgroupError::Gone`],
//!   never a bare I/O error, so the caller can drop it quietly.
//! - Every write is one `write(2)` of the whole value, and every state change is read back.
//!
//! Everything here blocks (it polls with sleeps of 50 µs to 1 ms while a freeze completes): call it
//! from a thread of its own or `spawn_blocking`, not from an async task.
//!
//! Which cgroups may be frozen at all (never a hierarchy's root, the service's own, or one nested
//! with another container's) is [`Admission`]'s one check.
//!
//! Layout: `mounts` parses mountinfo ([`CgroupMounts`], [`Hierarchies`]); `procfs` parses
//! `/proc/PID/cgroup` ([`ProcCgroup`]), `/proc/PID/stat` and `/proc/PID/status`; `device` stats
//! device nodes ([`DeviceNumbers`]); `reader` keeps the files read at every sample open
//! ([`CgroupReader`]); `v1` and `v2` hold each interface's file protocol; `freezer` ties them
//! together behind [`FreezerCgroup`]; `fsio` does the reads and writes and tells `Gone` from other
//! I/O errors.
#![deny(missing_docs)]

mod admission;
mod device;
mod error;
mod freezer;
mod fsio;
mod mounts;
mod procfs;
mod reader;
mod v1;
mod v2;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use admission::{Admission, Refusal};
pub use device::{DeviceKind, DeviceNumbers};
pub use error::CgroupError;
pub use freezer::{freeze_all, FreezerCgroup};
pub use mounts::{CgroupMount, CgroupMounts, Hierarchies};
pub use procfs::{PendingSignals, ProcCgroup, ProcStat};
pub use reader::{set_kept_budget, CgroupReader};

/// Which kernel interface freezes a cgroup. Displayed, and serialized, as `v1` or `v2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FreezerVersion {
    /// The cgroup v1 `freezer` controller (`freezer.state`).
    V1,
    /// The cgroup2 core freezer (`cgroup.freeze` and `cgroup.events`).
    V2,
}

impl fmt::Display for FreezerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FreezerVersion::V1 => "v1",
            FreezerVersion::V2 => "v2",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_displays_as_v1_and_v2() {
        assert_eq!(FreezerVersion::V1.to_string(), "v1");
        assert_eq!(FreezerVersion::V2.to_string(), "v2");
    }
}
