//! The [`Registry`](super::registry::Registry)'s rule, through the one dispatcher
//! ([`Service::handle`]) over [`fixture`]s, without root: a request that changes a registration
//! is saved before it is answered; one whose record cannot be saved is refused and changes
//! nothing; a restart from what was saved has the same registrations.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use gpuplex_scheduler::node::VgpuRecord;
use gpuplex_scheduler::{GpuIndex, VgpuId};

use super::fixture::{self, Fixture};
use super::Service;
use crate::state::StateDir;

impl Fixture {
    /// A container's fixture cgroup, with a process in it (this test's) so that it still runs
    /// at a restart.
    fn running_cgroup(&self, name: &str) -> PathBuf {
        let path = self.cgroup(name);
        fs::write(
            path.join("cgroup.procs"),
            format!("{}\n", std::process::id()),
        )
        .unwrap();
        path
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The state directory cannot be written, even by root: a file stands where it was.
    fn break_state(&self) {
        fs::rename(self.state(), self.dir.path().join("state.aside")).unwrap();
        fs::write(self.state(), "").unwrap();
    }

    fn mend_state(&self) {
        fs::remove_file(self.state()).unwrap();
        fs::rename(self.dir.path().join("state.aside"), self.state()).unwrap();
    }

    /// The node's registrations, and which are held.
    fn registrations(&self) -> (Vec<VgpuRecord>, Vec<bool>) {
        let node = self.service.registry.node();
        let records: Vec<VgpuRecord> = node.records().cloned().collect();
        let held = records.iter().map(|r| node.is_held(r.id)).collect();
        (records, held)
    }
}

fn register(container: &str, cgroup: &Path) -> String {
    format!(
        r#"{{"op":"register","container":"{container}","cgroup":{cgroup:?},"annotations":{{"gpuplex.io/gpu-memory":"1Gi"}}}}"#
    )
}

fn attach(handle: &str, container: &str, cgroup: &Path) -> String {
    format!(
        r#"{{"op":"attach","handle":"{handle}","container":"{container}","cgroup":{cgroup:?}}}"#
    )
}

const RESERVE: &str = r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"2Gi"}}"#;
const PIN: &str = r#"{"op":"pin","claim":"claim-1","gpus":[0],"memory":1073741824}"#;
const ALLOCATE: &str = r#"{"op":"allocate","units":["gpu-0-0"],"unit":1073741824}"#;

#[test]
fn a_save_that_fails_is_refused_and_changes_nothing() {
    let mut f = Fixture::new();
    let (c1, c2) = (f.running_cgroup("c1"), f.running_cgroup("c2"));
    f.ask(RESERVE).into_vgpu().unwrap();
    f.ask(&register("c1", &c1)).into_vgpu().unwrap();
    let before = f.registrations();
    f.break_state();
    for (line, why) in [
        (RESERVE, "nothing was reserved"),
        (PIN, "nothing was reserved"),
        (ALLOCATE, "nothing was reserved"),
        (&register("c2", &c2), "c2 was not attached"),
        (r#"{"op":"hold","container":"c1"}"#, "is not held"),
    ] {
        let r = f.ask(line);
        let refusal = r.refusal().unwrap_or_else(|| panic!("{line}: {r:?}"));
        assert!(refusal.contains(why), "{line}: {refusal}");
        assert_eq!(f.registrations(), before, "{line} changed the node");
    }
    assert_eq!(f.service.enforcer.iter().count(), 1, "c2 is not enforced");
    // An attach that cannot be saved is refused; the reservation goes with it (as any
    // vGPU that is not a claim's), so that nothing runs unsaved.
    let r = f.ask(&attach(&"01".repeat(16), "c2", &c2));
    assert!(
        r.refusal().unwrap().contains("c2 was not attached"),
        "{r:?}"
    );
    assert_eq!(f.service.registry.node().vgpu_of("c2"), None);
    f.mend_state();
    // Held later, once it can be saved.
    f.ask(r#"{"op":"hold","container":"c1"}"#)
        .into_vgpu()
        .unwrap();
    let saved = StateDir::open(&f.state()).unwrap().load().unwrap().vgpus;
    assert!(saved.iter().any(|s| s.held), "{saved:?}");
}

/// One request of [`every_registration_answered_is_saved_as_answered`].
fn line(n: u8, cgroups: &[PathBuf]) -> String {
    let c = usize::from(n / 16) % cgroups.len();
    let container = format!("c{c}");
    match n % 8 {
        0 => RESERVE.to_owned(),
        1 => register(&container, &cgroups[c]),
        // The handles the fixture draws: the n-th is `n` in each byte.
        2 => attach(
            &format!("{:02x}", n / 16 % 4 + 1).repeat(16),
            &container,
            &cgroups[c],
        ),
        3 => format!(r#"{{"op":"hold","container":"{container}"}}"#),
        4 => format!(r#"{{"op":"unhold","container":"{container}"}}"#),
        5 => format!(r#"{{"op":"release","container":"{container}"}}"#),
        6 => format!(
            r#"{{"op":"pin","claim":"claim-{}","gpus":[0],"memory":1073741824}}"#,
            n / 16 % 2
        ),
        _ => format!(r#"{{"op":"release","claim":"claim-{}"}}"#, n / 16 % 2),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Whatever requests come and whichever saves fail, every registration the node has is
    /// saved as the node has it: its handle, its containers, its hold.
    #[test]
    fn every_registration_answered_is_saved_as_answered(
        steps in proptest::collection::vec((proptest::num::u8::ANY, proptest::bool::weighted(0.2)), 1..24)
    ) {
        let mut f = Fixture::new();
        let cgroups: Vec<PathBuf> = (0..3).map(|c| f.running_cgroup(&format!("c{c}"))).collect();
        for (n, broken) in steps {
            let request = line(n, &cgroups);
            if broken {
                f.break_state();
            }
            let reply = f.ask(&request);
            if broken {
                f.mend_state();
            }
            proptest::prop_assert!(!reply.to_line().is_empty());
            let saved: BTreeMap<String, _> = (StateDir::open(&f.state()).unwrap().load().unwrap().vgpus)
                .into_iter()
                .map(|s| (s.vgpu.clone(), s))
                .collect();
            let node = f.service.registry.node();
            for record in node.records() {
                let file = saved.get(&record.id.to_string());
                proptest::prop_assert!(file.is_some(), "{} is not saved ({request})", record.id);
                let file = file.unwrap();
                proptest::prop_assert_eq!(file.handle.clone(), Some(record.handle.to_string()));
                proptest::prop_assert_eq!(file.held, node.is_held(record.id));
                let containers: Vec<&str> = (file.attachment.iter().chain(&file.shared))
                    .map(|a| a.container.as_str())
                    .collect();
                proptest::prop_assert_eq!(containers, record.containers().collect::<Vec<_>>());
                proptest::prop_assert_eq!(&file.claim, &record.claim);
            }
        }
    }
}

#[test]
fn a_restart_from_the_saved_state_has_the_same_registrations() {
    let mut f = Fixture::new();
    let (c1, c2) = (f.running_cgroup("c1"), f.running_cgroup("c2"));
    f.ask(RESERVE).into_vgpu().unwrap();
    f.ask(&register("c1", &c1)).into_vgpu().unwrap();
    let pinned = f.ask(PIN).into_vgpu().unwrap();
    let handle = pinned.handle.unwrap().to_string();
    f.ask(&attach(&handle, "c2", &c2)).into_vgpu().unwrap();
    f.ask(r#"{"op":"hold","container":"c1"}"#)
        .into_vgpu()
        .unwrap();
    f.ask(ALLOCATE).into_vgpu().unwrap();

    // The first service keeps its node lock: the second starts over a copy of its state.
    let copy = f.dir.path().join("state-copy");
    fs::create_dir_all(&copy).unwrap();
    for entry in fs::read_dir(f.state()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut again = fixture::service_with_state(f.dir.path(), &copy).unwrap();
    again.recover().unwrap();

    type Seen = (VgpuId, String, Vec<String>, Option<String>, String, bool);
    let seen = |service: &Service| -> Vec<Seen> {
        let node = service.registry.node();
        let mut seen: Vec<Seen> = (node.records())
            .map(|r| {
                let containers = r.containers().map(str::to_owned).collect();
                let memory = format!("{:?}", r.assignment.memory);
                let held = node.is_held(r.id);
                (
                    r.id,
                    r.handle.to_string(),
                    containers,
                    r.claim.clone(),
                    memory,
                    held,
                )
            })
            .collect();
        seen.sort();
        seen
    };
    let before = seen(&f.service);
    assert_eq!(before.len(), 4, "{before:?}");
    assert_eq!(seen(&again), before);
    assert_eq!(
        again.enforcer.iter().count(),
        2,
        "both containers enforced again"
    );
}

#[test]
fn a_record_torn_while_the_service_was_down_comes_back_from_its_copy() {
    let mut f = Fixture::new();
    let c1 = f.running_cgroup("c1");
    let kept = f.ask(&register("c1", &c1)).into_vgpu().unwrap();
    f.ask(RESERVE).into_vgpu().unwrap();
    let unreserved = |s: &Service| s.registry.node().inventory().unreserved(GpuIndex(0));
    let before = unreserved(&f.service);

    // The second service starts over a copy of the state (the first keeps its node lock), in
    // which the container's record was cut short.
    let copy = f.dir.path().join("state-copy");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(f.state())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(status.success());
    let record = copy.join(format!("{}.json", kept.id));
    let whole = fs::read(&record).unwrap();
    fs::write(&record, &whole[..whole.len() / 3]).unwrap();
    let mut again = fixture::service_with_state(f.dir.path(), &copy).unwrap();
    again.recover().unwrap();

    let node = again.registry.node();
    let back = node.records().find(|r| r.id == kept.id).expect("recovered");
    assert_eq!(back.containers().collect::<Vec<_>>(), ["c1"]);
    assert_eq!(
        again.enforcer.iter().count(),
        1,
        "its container is enforced again"
    );
    assert_eq!(unreserved(&again), before, "its memory is still reserved");
    assert_eq!(
        fs::read(&record).unwrap(),
        whole,
        "the record is whole again"
    );
}
