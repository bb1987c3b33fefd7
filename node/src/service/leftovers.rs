//! What a node service may have left frozen, and thawing it: the cgroups of the frozen list and
//! of the saved containers their users have not paused. The watchdog (the list), a start (the
//! list, then the records) and `stop` (both) thaw through [`thaw`], each reporting as it does.

use gpuplex_cgroup::Hierarchies;

use crate::state::{SavedFreezer, SavedVgpu};

/// What [`thaw`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Thawed {
    /// Cgroups left thawed, whether or not they still were frozen.
    pub thawed: usize,
    /// Cgroups that could not be thawed, one line each.
    pub failed: Vec<String>,
    /// Saved cgroups that no longer resolve to a freezer cgroup (gone, moved, not one a state
    /// file may name), one line each.
    pub unresolved: Vec<String>,
}

/// The freezer cgroups of the saved containers whose user has not paused them (a held container
/// stays as its user left it).
pub fn saved_cgroups(saved: &[SavedVgpu]) -> impl Iterator<Item = &SavedFreezer> {
    saved
        .iter()
        .filter(|s| !s.held)
        .flat_map(|s| s.attachment.iter().chain(&s.shared))
        .map(|a| &a.freezer)
}

/// Thaws each of `cgroups`, resolved again first (a state file names no other directory); a
/// cgroup gone meanwhile is neither thawed nor failed.
pub fn thaw<'a>(cgroups: impl IntoIterator<Item = &'a SavedFreezer>, h: &Hierarchies) -> Thawed {
    let mut done = Thawed::default();
    for saved in cgroups {
        match saved.resolve(h).map(|c| c.thaw()) {
            Ok(Ok(())) => done.thawed += 1,
            Ok(Err(e)) if e.is_gone() => {}
            Ok(Err(e)) => done
                .failed
                .push(format!("cannot thaw {}: {e}", saved.path.display())),
            Err(why) => done.unresolved.push(why.to_string()),
        }
    }
    done
}
