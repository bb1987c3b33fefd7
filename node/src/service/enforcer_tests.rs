//! The [`Enforcer`]'s rules, without root: over a [`Recorder`] freezer (in memory, failing when
//! told, checking each freeze against the frozen list saved at that moment) and a temporary
//! state directory.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use gpuplex_cgroup::{FreezerCgroup, FreezerVersion};
use gpuplex_scheduler::windows::Action::{Freeze, Thaw};
use gpuplex_scheduler::VgpuId;

use super::Enforcer;
use crate::service::enforced::Member;
use crate::service::freezer::{Freezer, Recorder};
use crate::state::StateDir;

const A: VgpuId = VgpuId(1);
const B: VgpuId = VgpuId(2);
const C: VgpuId = VgpuId(3);

struct Setup {
    dir: tempfile::TempDir,
    state: StateDir,
    freezer: Recorder,
    enforcer: Enforcer,
}

impl Setup {
    /// An enforcer with a watchdog, nothing enforced.
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(&dir.path().join("state")).unwrap();
        let freezer = Recorder::checking(&state);
        let mut enforcer = Enforcer::new(
            Box::new(freezer.clone()),
            state.clone(),
            Duration::from_millis(100),
        );
        enforcer.set_watched(true);
        Setup {
            dir,
            state,
            freezer,
            enforcer,
        }
    }

    fn cgroup(&self, name: &str) -> FreezerCgroup {
        let path = self.dir.path().join("freezer").join(name);
        FreezerCgroup::new(FreezerVersion::V1, path)
    }

    /// Enforces container `name` (in a cgroup of that name) as one of `vgpu`'s.
    fn add(&mut self, vgpu: VgpuId, name: &str) -> PathBuf {
        let cgroup = self.cgroup(name);
        let path = cgroup.path().to_path_buf();
        self.enforcer.add(vgpu, Member::new(name, cgroup));
        path
    }

    /// The frozen list as saved.
    fn listed(&self) -> BTreeSet<PathBuf> {
        let list = self.state.load_frozen().unwrap().frozen;
        list.into_iter().map(|f| f.path).collect()
    }

    fn frozen(&self, vgpu: VgpuId) -> bool {
        self.enforcer.get(vgpu).unwrap().frozen_since.is_some()
    }
}

fn set(paths: &[&PathBuf]) -> BTreeSet<PathBuf> {
    paths.iter().map(|p| p.to_path_buf()).collect()
}

#[test]
fn a_revoke_freezes_and_a_grant_thaws() {
    let mut s = Setup::new();
    let a = s.add(A, "a");
    s.add(B, "b");
    assert_eq!(s.enforcer.apply(&[Freeze(A)]), []);
    assert_eq!(s.freezer.take_calls(), ["freeze a"]);
    assert_eq!(s.freezer.frozen(), set(&[&a]));
    assert!(s.frozen(A) && !s.frozen(B));
    assert_eq!(s.listed(), set(&[&a]), "the list has what is frozen");
    assert_eq!(s.enforcer.apply(&[Thaw(A)]), []);
    assert_eq!(s.freezer.take_calls(), ["thaw a"]);
    assert!(s.freezer.frozen().is_empty() && !s.frozen(A));
    assert!(s.enforcer.get(A).unwrap().thawed_at.is_some());
    assert!(s.listed().is_empty(), "and no more");
    // A thaw order for what is not frozen, or not enforced, does nothing.
    assert_eq!(s.enforcer.apply(&[Thaw(B), Thaw(C), Freeze(C)]), []);
    assert_eq!(s.freezer.take_calls(), Vec::<String>::new());
    assert!(s.freezer.unlisted().is_empty());
}

#[test]
fn a_switch_freezes_before_it_thaws_and_freezes_a_vgpus_containers_together() {
    let mut s = Setup::new();
    s.add(A, "a");
    let b1 = s.add(B, "b1");
    let b2 = s.add(B, "b2");
    s.enforcer.apply(&[Freeze(A)]);
    s.freezer.take_calls();
    s.enforcer.apply(&[Thaw(A), Freeze(B)]);
    assert_eq!(s.freezer.take_calls(), ["freeze b1", "freeze b2", "thaw a"]);
    assert!(s.frozen(B) && !s.frozen(A));
    assert_eq!(s.listed(), set(&[&b1, &b2]));
    assert!(
        s.freezer.unlisted().is_empty(),
        "every freeze was listed first"
    );
}

#[test]
fn a_failed_thaw_stays_frozen_and_listed_and_is_tried_again() {
    let mut s = Setup::new();
    let a = s.add(A, "a");
    s.enforcer.apply(&[Freeze(A)]);
    s.freezer.fail_thaw(&a, true);
    assert_eq!(s.enforcer.apply(&[Thaw(A)]), [], "a failure is not an exit");
    assert!(s.frozen(A), "still counted frozen");
    assert_eq!(s.listed(), set(&[&a]), "still on the watchdog's list");
    // Tried again at the next thaw order, and at shutdown.
    s.enforcer.apply(&[Thaw(A)]);
    assert_eq!(s.enforcer.thaw_all(), 0);
    assert_eq!(
        s.freezer.take_calls(),
        ["freeze a", "thaw a", "thaw a", "thaw a"]
    );
    s.freezer.fail_thaw(&a, false);
    assert_eq!(s.enforcer.thaw_all(), 1);
    assert!(!s.frozen(A) && s.freezer.frozen().is_empty());
    assert!(s.listed().is_empty());
}

#[test]
fn a_vanished_cgroup_is_reported_to_be_let_go_of() {
    let mut s = Setup::new();
    let a = s.add(A, "a");
    let b = s.add(B, "b");
    s.freezer.vanish(&a);
    assert_eq!(s.enforcer.apply(&[Freeze(A)]), [A], "gone at its freeze");
    assert!(!s.frozen(A));
    s.enforcer.apply(&[Freeze(B)]);
    s.freezer.vanish(&b);
    assert_eq!(s.enforcer.apply(&[Thaw(B)]), [B], "gone at its thaw");
    assert!(!s.frozen(B), "a vanished cgroup is not frozen");
    assert!(s.listed().is_empty());
    // The service lets go of them: nothing is left to enforce, list or thaw.
    assert!(s.enforcer.forget(A) && s.enforcer.forget(B));
    assert!(!s.enforcer.forget(A));
    assert_eq!(s.enforcer.iter().count(), 0);
    assert_eq!(s.enforcer.thaw_all(), 0);
}

#[test]
fn a_failed_freeze_is_undone_for_the_whole_vgpu() {
    let mut s = Setup::new();
    s.add(A, "a1");
    let a2 = s.add(A, "a2");
    s.freezer.fail_freeze(&a2, true);
    assert_eq!(s.enforcer.apply(&[Freeze(A)]), []);
    assert_eq!(
        s.freezer.take_calls(),
        ["freeze a1", "freeze a2", "thaw a1", "thaw a2"]
    );
    assert!(!s.frozen(A) && s.freezer.frozen().is_empty());
    assert!(s.listed().is_empty());
}

#[test]
fn thaw_all_thaws_every_frozen_member_and_leaves_a_held_one_to_its_user() {
    let mut s = Setup::new();
    let a1 = s.add(A, "a1");
    s.add(A, "a2");
    s.add(B, "b");
    let c = s.add(C, "c");
    s.enforcer.apply(&[Freeze(A), Freeze(B), Freeze(C)]);
    assert_eq!(s.freezer.frozen().len(), 4);
    // C's user pauses it: the freeze becomes theirs, off the list the watchdog thaws.
    s.enforcer.set_held(C, true);
    assert!(!s.listed().contains(&c));
    s.freezer.take_calls();
    s.enforcer.apply(&[Thaw(C), Freeze(C)]);
    assert_eq!(
        s.freezer.take_calls(),
        Vec::<String>::new(),
        "held: no order"
    );
    // One of A's containers exits while frozen: it is thawed on its way out.
    assert!(!s.enforcer.let_go(A, "a1"));
    assert!(!s.freezer.frozen().contains(&a1));
    assert_eq!(s.enforcer.thaw_all(), 2);
    assert_eq!(
        s.freezer.frozen(),
        set(&[&c]),
        "only the held one is frozen"
    );
    assert!(s.listed().is_empty());
    assert!(s.freezer.unlisted().is_empty());
}

#[test]
fn nothing_is_frozen_without_a_watchdog_or_a_frozen_list() {
    let mut s = Setup::new();
    let a = s.add(A, "a");
    s.enforcer.set_watched(false);
    s.enforcer.apply(&[Freeze(A)]);
    assert_eq!(s.freezer.take_calls(), Vec::<String>::new());
    s.enforcer.set_watched(true);
    // A directory where the list goes: it cannot be written, even by root.
    let list = s.state.path().join("frozen.json");
    std::fs::remove_file(&list).unwrap();
    std::fs::create_dir_all(list.join("in-the-way")).unwrap();
    s.enforcer.apply(&[Freeze(A)]);
    assert_eq!(s.freezer.take_calls(), Vec::<String>::new());
    assert!(!s.frozen(A));
    std::fs::remove_dir_all(&list).unwrap();
    s.enforcer.apply(&[Freeze(A)]);
    assert_eq!(s.freezer.take_calls(), ["freeze a"]);
    assert_eq!(s.listed(), set(&[&a]));
}

/// One step of [`the_list_is_what_the_service_froze_and_every_freeze_was_listed_first`].
#[derive(Clone, Debug)]
enum Step {
    Freeze(usize),
    Thaw(usize),
    FailThaw(usize, bool),
    FailFreeze(usize, bool),
    Hold(usize),
    Unhold(usize),
    ThawAll,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let member = 0..4usize;
    prop_oneof![
        (0..3usize).prop_map(Step::Freeze),
        (0..3usize).prop_map(Step::Thaw),
        (member.clone(), any::<bool>()).prop_map(|(m, f)| Step::FailThaw(m, f)),
        (member, any::<bool>()).prop_map(|(m, f)| Step::FailFreeze(m, f)),
        (0..3usize).prop_map(Step::Hold),
        (0..3usize).prop_map(Step::Unhold),
        Just(Step::ThawAll),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Whatever orders come and whatever fails, after each step the saved frozen list is
    /// exactly the cgroups of the vGPUs the service counts frozen; every cgroup frozen is on
    /// it (or its user's); a vGPU counted running has no container frozen; and every freeze
    /// was on the list before it was made.
    #[test]
    fn the_list_is_what_the_service_froze_and_every_freeze_was_listed_first(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        let mut s = Setup::new();
        let vgpus = [A, B, C];
        // B has two containers.
        let members = [s.add(A, "a"), s.add(B, "b1"), s.add(B, "b2"), s.add(C, "c")];
        for step in steps {
            match step {
                Step::Freeze(v) => drop(s.enforcer.apply(&[Freeze(vgpus[v])])),
                Step::Thaw(v) => drop(s.enforcer.apply(&[Thaw(vgpus[v])])),
                Step::FailThaw(m, f) => s.freezer.fail_thaw(&members[m], f),
                Step::FailFreeze(m, f) => s.freezer.fail_freeze(&members[m], f),
                Step::Hold(v) => s.enforcer.set_held(vgpus[v], true),
                Step::Unhold(v) => {
                    // Its user resumes it first, as `podman unpause` does before the unhold.
                    if s.enforcer.get(vgpus[v]).unwrap().held {
                        for m in &s.enforcer.get(vgpus[v]).unwrap().members {
                            s.freezer.fail_thaw(m.cgroup.path(), false);
                            let _ = s.freezer.thaw(&m.cgroup);
                        }
                    }
                    s.enforcer.set_held(vgpus[v], false);
                }
                Step::ThawAll => drop(s.enforcer.thaw_all()),
            }
            let (counted, held): (BTreeSet<PathBuf>, BTreeSet<PathBuf>) = {
                let mut counted = BTreeSet::new();
                let mut held = BTreeSet::new();
                for (_, e) in s.enforcer.iter() {
                    let paths = e.members.iter().map(|m| m.cgroup.path().to_path_buf());
                    if e.held {
                        held.extend(paths);
                    } else if e.frozen_since.is_some() {
                        counted.extend(paths);
                    }
                }
                (counted, held)
            };
            proptest::prop_assert_eq!(s.listed(), counted.clone());
            for frozen in s.freezer.frozen() {
                proptest::prop_assert!(counted.contains(&frozen) || held.contains(&frozen));
            }
            proptest::prop_assert!(s.freezer.unlisted().is_empty());
        }
    }
}
