//! [`Freezer`]: what enforcement does to a cgroup, as a trait, so that the [`Enforcer`]'s rules
//! (freezes before thaws, the frozen list written before a freeze, a failed thaw tried again, a
//! vanished cgroup let go) are tested without root against a freezer that records what it is
//! asked and fails when told ([`Recorder`], in tests). In production it is the kernel's freezer
//! ([`Kernel`]: `gpuplex_cgroup`, v1 and v2).
//!
//! [`Enforcer`]: super::enforcer::Enforcer

use std::time::Duration;

use gpuplex_cgroup::{CgroupError, FreezerCgroup};

/// Freezes and thaws freezer cgroups.
pub(crate) trait Freezer: Send {
    /// Freezes every one of `cgroups` together and waits until each is frozen, up to
    /// `timeout`: one result per cgroup, in order. A freeze that fails or times out is undone
    /// ([`CgroupError::StillFrozen`] when even that fails); a vanished cgroup is
    /// [`CgroupError::Gone`] (see [`gpuplex_cgroup::freeze_all`]).
    fn freeze_all(
        &self,
        cgroups: &[&FreezerCgroup],
        timeout: Duration,
    ) -> Vec<Result<(), CgroupError>>;

    /// Thaws a cgroup and confirms it ([`FreezerCgroup::thaw`]).
    fn thaw(&self, cgroup: &FreezerCgroup) -> Result<(), CgroupError>;

    /// Whether a cgroup reads frozen ([`FreezerCgroup::is_frozen`]).
    fn is_frozen(&self, cgroup: &FreezerCgroup) -> Result<bool, CgroupError>;
}

/// The kernel's freezer: v1 `freezer.state`, v2 `cgroup.freeze`.
pub(crate) struct Kernel;

impl Freezer for Kernel {
    fn freeze_all(
        &self,
        cgroups: &[&FreezerCgroup],
        timeout: Duration,
    ) -> Vec<Result<(), CgroupError>> {
        gpuplex_cgroup::freeze_all(cgroups, timeout)
    }

    fn thaw(&self, cgroup: &FreezerCgroup) -> Result<(), CgroupError> {
        cgroup.thaw()
    }

    fn is_frozen(&self, cgroup: &FreezerCgroup) -> Result<bool, CgroupError> {
        cgroup.is_frozen()
    }
}

#[cfg(test)]
pub(crate) use recorder::Recorder;

#[cfg(test)]
mod recorder {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::time::Duration;

    use gpuplex_cgroup::{CgroupError, FreezerCgroup};

    use super::Freezer;
    use crate::state::{SavedFreezer, StateDir};

    /// A freezer in memory for tests: it records each call (`freeze NAME`, `thaw NAME`, by the
    /// cgroup directory's name), keeps which cgroups are frozen, fails as told, and checks at
    /// every freeze that the cgroup is already on the frozen list saved in `state` (the
    /// watchdog's way back). Clones share one record.
    #[derive(Clone, Default)]
    pub(crate) struct Recorder(Arc<Mutex<Recorded>>);

    #[derive(Default)]
    struct Recorded {
        calls: Vec<String>,
        frozen: BTreeSet<PathBuf>,
        fail_freeze: BTreeSet<PathBuf>,
        fail_thaw: BTreeSet<PathBuf>,
        gone: BTreeSet<PathBuf>,
        list: Option<StateDir>,
        unlisted: Vec<PathBuf>,
    }

    fn name(cgroup: &FreezerCgroup) -> String {
        let name = cgroup.path().file_name().unwrap_or_default();
        name.to_string_lossy().into_owned()
    }

    impl Recorder {
        /// A recorder that checks every freeze against the frozen list in `state`.
        pub fn checking(state: &StateDir) -> Recorder {
            let recorder = Recorder::default();
            recorder.lock().list = Some(state.clone());
            recorder
        }

        fn lock(&self) -> MutexGuard<'_, Recorded> {
            self.0.lock().unwrap()
        }

        /// The calls so far, and forgets them.
        pub fn take_calls(&self) -> Vec<String> {
            std::mem::take(&mut self.lock().calls)
        }

        /// The cgroups frozen now.
        pub fn frozen(&self) -> BTreeSet<PathBuf> {
            self.lock().frozen.clone()
        }

        /// Cgroups frozen while the saved frozen list did not have them.
        pub fn unlisted(&self) -> Vec<PathBuf> {
            self.lock().unlisted.clone()
        }

        /// Freezes of `path` fail (and are undone) from now on, or no longer.
        pub fn fail_freeze(&self, path: &Path, fail: bool) {
            set(&mut self.lock().fail_freeze, path, fail);
        }

        /// Thaws of `path` fail (it stays frozen) from now on, or no longer.
        pub fn fail_thaw(&self, path: &Path, fail: bool) {
            set(&mut self.lock().fail_thaw, path, fail);
        }

        /// The cgroup at `path` vanished (its container exited): whatever it was, it is not
        /// frozen now.
        pub fn vanish(&self, path: &Path) {
            let mut r = self.lock();
            r.gone.insert(path.to_path_buf());
            r.frozen.remove(path);
        }
    }

    fn set(paths: &mut BTreeSet<PathBuf>, path: &Path, on: bool) {
        if on {
            paths.insert(path.to_path_buf());
        } else {
            paths.remove(path);
        }
    }

    impl Freezer for Recorder {
        fn freeze_all(
            &self,
            cgroups: &[&FreezerCgroup],
            _timeout: Duration,
        ) -> Vec<Result<(), CgroupError>> {
            let mut r = self.lock();
            let listed: Vec<SavedFreezer> = match &r.list {
                Some(state) => state.load_frozen().map(|l| l.frozen).unwrap_or_default(),
                None => Vec::new(),
            };
            let checking = r.list.is_some();
            let mut results = Vec::new();
            for cgroup in cgroups {
                let path = cgroup.path().to_path_buf();
                r.calls.push(format!("freeze {}", name(cgroup)));
                if checking && !listed.contains(&SavedFreezer::of(cgroup)) {
                    r.unlisted.push(path.clone());
                }
                results.push(if r.gone.contains(&path) {
                    Err(CgroupError::Gone(path))
                } else if r.fail_freeze.contains(&path) {
                    Err(CgroupError::Timeout {
                        path,
                        waited: Duration::ZERO,
                    })
                } else {
                    r.frozen.insert(path);
                    Ok(())
                });
            }
            results
        }

        fn thaw(&self, cgroup: &FreezerCgroup) -> Result<(), CgroupError> {
            let mut r = self.lock();
            let path = cgroup.path().to_path_buf();
            r.calls.push(format!("thaw {}", name(cgroup)));
            if r.gone.contains(&path) {
                return Err(CgroupError::Gone(path));
            }
            if r.fail_thaw.contains(&path) {
                return Err(CgroupError::NotThawed {
                    path,
                    found: "FROZEN".into(),
                });
            }
            r.frozen.remove(&path);
            Ok(())
        }

        fn is_frozen(&self, cgroup: &FreezerCgroup) -> Result<bool, CgroupError> {
            let r = self.lock();
            let path = cgroup.path();
            if r.gone.contains(path) {
                return Err(CgroupError::Gone(path.to_path_buf()));
            }
            Ok(r.frozen.contains(path))
        }
    }
}
