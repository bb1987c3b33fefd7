//! Which cgroups the node service may freeze as a container's: the one check made at register,
//! at attach and at recovery alike (ARCHITECTURE.md, trust boundary).
//!
//! A container's cgroup is found from a pid or a path that reaches the service from outside
//! (a hook, the shim, `gpuplexctl`, a state file). Freezing the wrong one is how a tenant, or a
//! damaged file, would stop what it does not own, so a cgroup is refused when it is:
//!
//! - the root of its hierarchy (every process on the machine);
//! - the cgroup of the service or of its watchdog, or one above either (the service would
//!   freeze itself, and with it every thaw it owes);
//! - already enforced as another vGPU's (two windows would freeze and thaw one cgroup);
//! - above or below an enforced one (freezing a parent freezes its children: one vGPU's window
//!   would freeze another's container).
//!
//! The decision is a pure function of paths ([`Admission::check`]); only
//! [`Admission::of_processes`] reads `/proc/PID/cgroup`, at each check, so that a service that
//! was moved (or whose watchdog was) is checked where it is now.

use std::path::{Path, PathBuf};

use super::mounts::join_cgroup_path;
use super::{CgroupError, FreezerCgroup, FreezerVersion, Hierarchies, ProcCgroup};

/// Why a cgroup cannot be frozen as a container's. One line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A hierarchy's root.
    #[error("{} is the root of the {version} freezer hierarchy: freezing it would freeze every process of the machine", path.display())]
    Root {
        /// The hierarchy.
        version: FreezerVersion,
        /// The cgroup.
        path: PathBuf,
    },
    /// The service's own cgroup (or its watchdog's), or one that contains it.
    #[error("{} holds the gpuplex node service or its watchdog (in {}): freezing it would freeze the service", path.display(), own.display())]
    HoldsService {
        /// The cgroup.
        path: PathBuf,
        /// The service's cgroup in that hierarchy.
        own: PathBuf,
    },
    /// Another vGPU's cgroup.
    #[error("{} is already the cgroup of {vgpu}: one cgroup is frozen as one container", path.display())]
    Enforced {
        /// The cgroup.
        path: PathBuf,
        /// The vGPU it is enforced as.
        vgpu: String,
    },
    /// The service cannot tell where it is itself in that hierarchy.
    #[error("{} cannot be checked: the node service cannot place its own cgroup in the {version} hierarchy (its /proc/self/cgroup names none there)", path.display())]
    UnknownOwn {
        /// The hierarchy.
        version: FreezerVersion,
        /// The cgroup.
        path: PathBuf,
    },
    /// Above or below another vGPU's cgroup.
    #[error("{} is {relation} {}, the cgroup of {vgpu}: a freeze of one would freeze the other", path.display(), other.display())]
    Nested {
        /// The cgroup.
        path: PathBuf,
        /// `inside` or `above`.
        relation: &'static str,
        /// The enforced cgroup it nests with.
        other: PathBuf,
        /// Its vGPU.
        vgpu: String,
    },
}

/// What a cgroup is checked against: the hierarchies' roots and the cgroups of the service's
/// processes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    roots: Vec<(FreezerVersion, PathBuf)>,
    /// The cgroups of the service's processes in each hierarchy; `None` where one cannot be
    /// placed.
    own: Vec<(FreezerVersion, Option<PathBuf>)>,
}

impl Admission {
    /// For the processes `pids` (the service and its watchdog), from their `/proc/PID/cgroup`;
    /// one that is gone is left out, this process never is.
    pub fn of_processes(h: &Hierarchies, pids: &[u32]) -> Result<Admission, CgroupError> {
        let mut own = vec![ProcCgroup::of_pid_in(
            Path::new("/proc"),
            std::process::id(),
        )?];
        own.extend(
            pids.iter()
                .filter_map(|&pid| ProcCgroup::of_pid_in(Path::new("/proc"), pid).ok()),
        );
        Ok(Admission::new(h, &own))
    }

    /// For processes in the cgroups `own` (their parsed `/proc/PID/cgroup`).
    pub fn new(h: &Hierarchies, own: &[ProcCgroup]) -> Admission {
        let mut admission = Admission::default();
        for (version, mount) in [
            (FreezerVersion::V1, &h.freezer),
            (FreezerVersion::V2, &h.unified),
        ] {
            let Some(mount) = mount else { continue };
            admission.roots.push((version, mount.clone()));
            for process in own {
                let path = match version {
                    FreezerVersion::V1 => process.freezer(),
                    FreezerVersion::V2 => process.unified.as_deref(),
                };
                // A path that climbs out (`/../x`) or none at all cannot be placed: nothing in
                // that hierarchy can then be told apart from the service's own.
                let place = path.and_then(|p| join_cgroup_path(mount, p));
                admission.own.push((version, place));
            }
        }
        admission
    }

    /// Whether `candidate` may be frozen as a container's, given the cgroups already enforced
    /// (each with the name of its vGPU).
    pub fn check<'a>(
        &self,
        candidate: &FreezerCgroup,
        enforced: impl IntoIterator<Item = (String, &'a FreezerCgroup)>,
    ) -> Result<(), Refusal> {
        let (version, path) = (candidate.version(), candidate.path());
        let same = |v: &FreezerVersion| *v == version;
        if self.roots.iter().any(|(v, root)| same(v) && root == path) {
            return Err(Refusal::Root {
                version,
                path: path.to_path_buf(),
            });
        }
        for (_, own) in self.own.iter().filter(|(v, _)| same(v)) {
            match own {
                None => {
                    return Err(Refusal::UnknownOwn {
                        version,
                        path: path.to_path_buf(),
                    })
                }
                Some(own) if own.starts_with(path) => {
                    return Err(Refusal::HoldsService {
                        path: path.to_path_buf(),
                        own: own.clone(),
                    })
                }
                Some(_) => {}
            }
        }
        for (vgpu, other) in enforced {
            if other.version() != version {
                continue;
            }
            let other = other.path();
            let relation = if other == path {
                return Err(Refusal::Enforced {
                    path: path.to_path_buf(),
                    vgpu,
                });
            } else if path.starts_with(other) {
                "inside"
            } else if other.starts_with(path) {
                "above"
            } else {
                continue;
            };
            return Err(Refusal::Nested {
                path: path.to_path_buf(),
                relation,
                other: other.to_path_buf(),
                vgpu,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hierarchies() -> Hierarchies {
        Hierarchies {
            freezer: Some("/sys/fs/cgroup/freezer".into()),
            cpuacct: None,
            unified: Some("/sys/fs/cgroup/unified".into()),
        }
    }

    fn v1(path: &str) -> FreezerCgroup {
        FreezerCgroup::new(FreezerVersion::V1, PathBuf::from(path))
    }

    fn v2(path: &str) -> FreezerCgroup {
        FreezerCgroup::new(FreezerVersion::V2, PathBuf::from(path))
    }

    /// The service in `/system.slice/gpuplex.service` of both hierarchies.
    fn admission() -> Admission {
        let own = ProcCgroup::parse(
            "7:freezer:/system.slice/gpuplex.service\n0::/system.slice/gpuplex.service\n",
        );
        let watchdog = ProcCgroup::parse("7:freezer:/watchdogs\n0::/watchdogs\n");
        Admission::new(&hierarchies(), &[own, watchdog])
    }

    #[test]
    fn a_container_cgroup_of_its_own_is_admitted() {
        let enforced = [(
            String::from("vgpu-1"),
            &v1("/sys/fs/cgroup/freezer/default/a"),
        )];
        for candidate in [
            v1("/sys/fs/cgroup/freezer/default/b"),
            v1("/sys/fs/cgroup/freezer/default/ab"),
            v1("/sys/fs/cgroup/freezer/system.slice/other.service"),
            // The same path in the other hierarchy is another cgroup.
            v2("/sys/fs/cgroup/unified/default/a"),
        ] {
            assert_eq!(
                admission().check(&candidate, enforced.iter().map(|(n, c)| (n.clone(), *c))),
                Ok(()),
                "{candidate:?}"
            );
        }
    }

    #[test]
    fn roots_the_services_cgroups_and_nested_ones_are_refused_each_with_one_line() {
        let a = v1("/sys/fs/cgroup/freezer/default/a");
        let enforced = || [(String::from("vgpu-1"), &a)];
        let cases: Vec<(FreezerCgroup, &str)> = vec![
            (
                v1("/sys/fs/cgroup/freezer"),
                "is the root of the v1 freezer hierarchy",
            ),
            (
                v2("/sys/fs/cgroup/unified"),
                "is the root of the v2 freezer hierarchy",
            ),
            (
                v1("/sys/fs/cgroup/freezer/system.slice"),
                "holds the gpuplex node service or its watchdog",
            ),
            (
                v2("/sys/fs/cgroup/unified/system.slice/gpuplex.service"),
                "holds the gpuplex node service or its watchdog",
            ),
            (
                v1("/sys/fs/cgroup/freezer/watchdogs"),
                "holds the gpuplex node service or its watchdog",
            ),
            (a.clone(), "is already the cgroup of vgpu-1"),
            (
                v1("/sys/fs/cgroup/freezer/default/a/inner"),
                "is inside /sys/fs/cgroup/freezer/default/a, the cgroup of vgpu-1",
            ),
            (
                v1("/sys/fs/cgroup/freezer/default"),
                "is above /sys/fs/cgroup/freezer/default/a, the cgroup of vgpu-1",
            ),
        ];
        for (candidate, expected) in cases {
            let refusal = admission()
                .check(&candidate, enforced())
                .expect_err(&format!("{candidate:?}"));
            let line = refusal.to_string();
            assert!(line.contains(expected), "{line}");
            assert!(!line.contains('\n'), "{line}");
        }
    }

    #[test]
    fn a_service_in_the_root_cgroup_refuses_only_the_root() {
        let own = ProcCgroup::parse("7:freezer:/\n0::/\n");
        let admission = Admission::new(&hierarchies(), &[own]);
        assert!(matches!(
            admission.check(&v1("/sys/fs/cgroup/freezer"), []),
            Err(Refusal::Root { .. })
        ));
        assert_eq!(admission.check(&v1("/sys/fs/cgroup/freezer/x"), []), Ok(()));
    }

    #[test]
    fn a_service_whose_cgroup_cannot_be_placed_refuses_the_whole_hierarchy() {
        let own = ProcCgroup::parse("7:freezer:/../elsewhere\n");
        let admission = Admission::new(&hierarchies(), &[own]);
        for candidate in [
            v1("/sys/fs/cgroup/freezer/x"),
            v2("/sys/fs/cgroup/unified/x"),
        ] {
            let refusal = admission.check(&candidate, []).unwrap_err();
            assert!(matches!(refusal, Refusal::UnknownOwn { .. }), "{refusal}");
        }
    }
}
