//! The node service's dispatcher, [`Service::handle`], driven as production drives it, without
//! root, over [`fixture`]s: a fake GPU, a temporary state directory and fixture cgroups. Each
//! request goes in as the line a client writes and its reply comes back as the line the socket
//! sends.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

use gpuplex_scheduler::node::{ContainerState, Placement};
use gpuplex_scheduler::{GpuIndex, VgpuId};
use std::sync::{mpsc, Arc};

use gpuplex_wire::protocol::{
    parse_request, AssignedGpu, CapacityView, DeviceNode, Reply, Request, OPERATIONS,
};

use super::fixture::{self, Fixture};
use super::watch::Mailbox;
use super::Event;

/// The handle of the first reservation of a [`Fixture`]; the n-th gets `n` in each byte.
const FIRST: &str = "01010101010101010101010101010101";

/// A service on one fake GPU of 16 GiB, over a temporary directory ([`fixture::service`]).
impl Fixture {
    /// Sends `line` as the socket does, through the loop's [`Service::serve_event`], so that the
    /// watchers are told of what it changed; its reply.
    fn carry(&mut self, line: &str) -> Reply {
        let request = parse_request(line.as_bytes()).unwrap();
        let (reply, answer) = mpsc::channel();
        assert_eq!(
            self.service.serve_event(Event::Request(request, reply)),
            None
        );
        answer.try_recv().expect("answered at once")
    }

    /// A watcher subscribed as the socket subscribes one; its mailbox.
    fn watch(&mut self) -> Arc<Mailbox> {
        let mailbox = Arc::new(Mailbox::default());
        assert_eq!(
            self.service.serve_event(Event::Watch(Arc::clone(&mailbox))),
            None
        );
        mailbox
    }

    /// The vGPU files in the state directory.
    fn saved(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.dir.path().join("state"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("vgpu-"))
            .collect();
        names.sort();
        names
    }
}

#[test]
fn a_session_of_requests_against_the_service() {
    let mut f = Fixture::new();
    let c1 = f.cgroup("c1");
    let c2 = f.cgroup("c2");
    let r = f.ask(
        r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"8Gi","gpuplex.io/weight":"2","other":"x"}}"#,
    );
    let v = r.into_vgpu().expect("reserved");
    let id = v.id;
    assert_eq!((v.weight, v.container), (2, None));
    assert_eq!(
        v.handle.map(|h| h.to_string()).as_deref(),
        Some(FIRST),
        "the reservation's reply has its handle"
    );
    assert_eq!(
        v.gpus,
        vec![AssignedGpu {
            index: 0,
            uuid: "GPU-fake-0".into(),
            model: "Fake GPU".into(),
            memory: 8 << 30,
            device: Some(DeviceNode {
                path: f.dir.path().join("nvidia0"),
                major: 195,
                minor: 0,
            }),
            fake: true,
        }]
    );
    assert_eq!(f.saved(), [format!("{id}.json")], "saved before the reply");

    // The vGPU's id attaches nothing; its handle does.
    let attach = |handle: &str, container: &str, cgroup: &PathBuf| {
        format!(
            r#"{{"op":"attach","handle":"{handle}","container":"{container}","cgroup":{cgroup:?}}}"#
        )
    };
    let r = f.ask(&attach("ffffffffffffffffffffffffffffffff", "c1", &c1));
    assert!(
        (r.refusal().unwrap()).contains("no reservation on this node has this handle"),
        "{r:?}"
    );
    let r = f.ask(&attach(FIRST, "c1", &c1));
    assert_eq!(r.into_vgpu().unwrap().container.as_deref(), Some("c1"));
    // Attaching again is the same answer, without the handle.
    let again = f.ask(&attach(FIRST, "c1", &c1));
    assert_eq!(
        again.into_vgpu().unwrap().handle,
        None,
        "an attach shows no handle"
    );
    // Another container's cgroup cannot be attached to it, nor its own to another vGPU.
    let r = f.ask(&format!(
        r#"{{"op":"register","container":"c3","cgroup":{c1:?},"annotations":{{"gpuplex.io/gpu-memory":"1Gi"}}}}"#
    ));
    assert!(r.refusal().is_some(), "{r:?}");

    let r = f.ask(&format!(
        r#"{{"op":"register","container":"c2","cgroup":{c2:?},"annotations":{{"gpuplex.io/gpu-memory":"9Gi"}}}}"#
    ));
    let e = r.refusal().unwrap();
    assert!(
        e.contains("GPU 0") && e.contains("8 GiB"),
        "lists free memory: {e}"
    );
    let r = f.ask(&format!(
        r#"{{"op":"register","container":"c2","cgroup":{c2:?},"annotations":{{"gpuplex.io/priority":"urgent"}}}}"#
    ));
    assert!(r
        .refusal()
        .unwrap()
        .contains("gpuplex.io/priority=`urgent`"));
    assert_eq!(f.saved().len(), 1, "a refusal leaves nothing behind");

    let status = f.ask(r#"{"op":"status"}"#).into_status().unwrap();
    assert_eq!(status.containers.len() + status.reservations.len(), 1);
    assert_eq!(status.gpus[0].unreserved, 8 << 30);

    // Holds: by container or vGPU, idempotent, the vGPU in the reply; paused in the status.
    let by_vgpu = format!(r#"{{"op":"hold","vgpu":"{id}"}}"#);
    for line in [r#"{"op":"hold","container":"c1"}"#, by_vgpu.as_str()] {
        let r = f.ask(line);
        assert_eq!(r.into_vgpu().unwrap().container.as_deref(), Some("c1"));
    }
    let status = f.ask(r#"{"op":"status"}"#).into_status().unwrap();
    assert_eq!(status.containers[0].state, ContainerState::Paused);
    let r = f.ask(r#"{"op":"hold","container":"c9"}"#);
    assert_eq!(
        r.refusal(),
        Some("container c9 is not attached to a vGPU on this node (it was never attached, or it was released)")
    );
    assert_eq!(
        f.ask(r#"{"op":"unhold","container":"c1"}"#)
            .into_vgpu()
            .unwrap()
            .id,
        id
    );
    let r = f.ask(r#"{"op":"unhold","container":"c1"}"#);
    assert!(r.is_ok(), "unholding twice is fine: {r:?}");
    let status = f.ask(r#"{"op":"status"}"#).into_status().unwrap();
    assert_eq!(status.containers[0].state, ContainerState::Idle);

    let r = f.ask(r#"{"op":"release","container":"c1"}"#);
    assert_eq!(r.into_vgpu().unwrap().id, id);
    assert!(f.saved().is_empty(), "its file is gone");
    let r = f.ask(r#"{"op":"release","container":"c1"}"#);
    assert_eq!(r, Reply::Done, "releasing twice is fine");
}

#[test]
fn a_registration_shows_its_handle_once_and_only_to_its_container() {
    let mut f = Fixture::new();
    let c1 = f.cgroup("c1");
    let register = |container: &str| {
        format!(
            r#"{{"op":"register","container":"{container}","cgroup":{c1:?},"annotations":{{"gpuplex.io/gpu-memory":"1Gi"}}}}"#
        )
    };
    let first = f.ask(&register("c1")).into_vgpu().unwrap();
    assert_eq!(first.handle.map(|h| h.to_string()).as_deref(), Some(FIRST));
    // A hook that runs at two stages registers twice: the same vGPU, no handle.
    let again = f.ask(&register("c1")).into_vgpu().unwrap();
    assert_eq!((again.id, again.handle), (first.id, None));
    // Another id with the same cgroup gets nothing of it.
    let other = f.ask(&register("c2"));
    assert!(other.refusal().is_some(), "{other:?}");
    assert_eq!(f.saved(), [format!("{}.json", first.id)]);
}

#[test]
fn a_cgroup_outside_the_freezer_hierarchy_is_refused_and_nothing_is_kept() {
    let mut f = Fixture::new();
    let outside = f.dir.path().join("elsewhere");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("freezer.state"), "THAWED\n").unwrap();
    for path in [
        outside,
        f.dir.path().join("freezer"),
        f.dir.path().join("freezer/../freezer"),
    ] {
        let r = f.ask(&format!(
            r#"{{"op":"register","container":"c1","cgroup":{path:?},"annotations":{{"gpuplex.io/gpu-memory":"1Gi"}}}}"#
        ));
        assert!(r.refusal().is_some(), "{path:?}: {r:?}");
    }
    assert!(f.saved().is_empty());
    let status = f.ask(r#"{"op":"status"}"#).into_status().unwrap();
    assert_eq!(status.gpus[0].unreserved, 16 << 30);
}

#[test]
fn pinning_again_answers_with_the_claims_own_handle() {
    let mut f = Fixture::new();
    let pin = || Request::Pin {
        claim: "claim-1".into(),
        placement: Placement {
            gpus: vec![GpuIndex(0)],
            memory: 4 << 30,
        },
        annotations: BTreeMap::new(),
    };
    let first = f.service.handle(pin()).into_vgpu().unwrap();
    // The retry's fresh draw (the second) is not the claim's: its CDI spec keeps attaching.
    let again = f.service.handle(pin()).into_vgpu().unwrap();
    assert_eq!(first.handle.map(|h| h.to_string()).as_deref(), Some(FIRST));
    assert_eq!((again.id, again.handle), (first.id, first.handle));
    assert_eq!(f.saved().len(), 1);
}

#[test]
fn events_tell_each_change_of_a_gpus_window_holder() {
    let mut f = Fixture::new();
    let c1 = f.cgroup("c1");
    let registered = f.ask(&format!(
        r#"{{"op":"register","container":"c1","cgroup":{c1:?},"annotations":{{"gpuplex.io/gpu-memory":"1Gi"}}}}"#
    ));
    let vgpu: VgpuId = registered.into_vgpu().unwrap().id;
    let before = crate::state::unix_ms(std::time::SystemTime::now());
    let now = f.service.now();
    f.service.registry.node_mut().observe(vgpu, true, now);
    f.service.registry.node_mut().decide(now);
    let events = f.ask(r#"{"op":"events","since":0}"#).into_events().unwrap();
    assert_eq!(events.first, 1);
    assert_eq!(events.events.len(), 1, "{events:?}");
    let e = &events.events[0];
    assert_eq!(
        (e.seq, e.gpu, e.vgpu, e.container.as_deref()),
        (1, 0, Some(vgpu), Some("c1"))
    );
    let after = crate::state::unix_ms(std::time::SystemTime::now());
    assert!(
        (before.saturating_sub(5)..=after).contains(&e.at_ms),
        "at {} ms, not within {before}..={after}",
        e.at_ms
    );
    let later = f.ask(r#"{"op":"events","since":1}"#).into_events().unwrap();
    assert!(later.events.is_empty());
}

/// The view in the line a watcher was left, if any.
fn view_in(mailbox: &Mailbox) -> Option<CapacityView> {
    let line = mailbox.try_take()?;
    assert!(
        line.ends_with('\n') && line.matches('\n').count() == 1,
        "{line}"
    );
    let reply: Reply = serde_json::from_str(&line).unwrap();
    Some(reply.into_capacity().expect("a capacity view"))
}

#[test]
fn a_watcher_gets_the_view_at_once_and_again_after_each_change_and_only_then() {
    let mut f = Fixture::new();
    let watcher = f.watch();
    let first = view_in(&watcher).expect("a view at once");
    assert_eq!(first.gpus.len(), 1);
    let gpu = &first.gpus[0];
    assert_eq!(
        (gpu.index, gpu.uuid.as_str(), gpu.memory, gpu.capacity),
        (0, fixture::GPU_UUID, 16 << 30, 16 << 30)
    );
    assert_eq!(gpu.unreserved, 16 << 30);
    assert!(gpu.fake);
    assert!(!gpu.healthy, "the fixture GPU's device node was never made");
    assert!(first.claims.is_empty());
    // The answer to `watch` through the dispatcher is the same view.
    let answer = f.ask(r#"{"op":"watch"}"#).into_capacity().unwrap();
    assert_eq!(answer, first);

    // Nothing changes: nothing is sent.
    for line in [
        r#"{"op":"status"}"#,
        r#"{"op":"events","since":0}"#,
        r#"{"op":"release","claim":"nobody"}"#,
        r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"99Gi"}}"#,
    ] {
        f.carry(line);
        assert_eq!(view_in(&watcher), None, "{line}");
    }

    // A reservation takes memory.
    let reserved = f.carry(r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"8Gi"}}"#);
    let reserved = reserved.into_vgpu().unwrap();
    let view = view_in(&watcher).expect("a reservation is news");
    assert_eq!(view.gpus[0].unreserved, 8 << 30);
    assert!(view.claims.is_empty());
    // A claim pinned: its key.
    f.carry(r#"{"op":"pin","claim":"claim-1","gpus":[0],"memory":2147483648}"#);
    let view = view_in(&watcher).expect("a pin is news");
    assert_eq!(
        (view.gpus[0].unreserved, &view.claims[..]),
        (6 << 30, &["claim-1".to_string()][..])
    );
    // Pinned again: the same, nothing sent.
    f.carry(r#"{"op":"pin","claim":"claim-1","gpus":[0],"memory":2147483648}"#);
    assert_eq!(view_in(&watcher), None);
    // The device plugin's units: their allocation's key.
    f.carry(r#"{"op":"allocate","units":["gpu-0-0","gpu-0-1"],"unit":1073741824}"#);
    let view = view_in(&watcher).expect("an allocation is news");
    assert_eq!(view.claims, ["claim-1", "units-gpu-0-0"]);
    // The kubelet gives unit 1 again: the first allocation ends, the new one's key comes.
    f.carry(r#"{"op":"allocate","units":["gpu-0-1"],"unit":1073741824}"#);
    let view = view_in(&watcher).expect("a reallocation is news");
    assert_eq!(view.claims, ["claim-1", "units-gpu-0-1"]);
    assert_eq!(view.gpus[0].unreserved, 5 << 30);
    // Releases.
    f.carry(r#"{"op":"release","claim":"claim-1"}"#);
    assert_eq!(view_in(&watcher).unwrap().claims, ["units-gpu-0-1"]);
    // The view a status shows is the one a watcher is sent.
    let status = f.ask(r#"{"op":"status"}"#).into_status().unwrap();
    assert_eq!(CapacityView::of_status(&status), f.service.fresh_view());
    assert_eq!(CapacityView::of_status(&status).claims, ["units-gpu-0-1"]);
    f.carry(&format!(r#"{{"op":"release","vgpu":"{}"}}"#, reserved.id));
    let view = view_in(&watcher).unwrap();
    assert_eq!(view.gpus[0].unreserved, 15 << 30);
    assert_eq!(view_in(&watcher), None, "one line per change");
}

#[test]
fn a_watcher_that_never_reads_holds_one_line_and_the_service_goes_on() {
    let mut f = Fixture::new();
    let slow = f.watch();
    let quick = f.watch();
    view_in(&quick).unwrap();
    // A hundred changes; the slow watcher takes none of them, and nothing waits for it.
    for n in 0..100 {
        let line = format!(r#"{{"op":"pin","claim":"c{n:03}","gpus":[0],"memory":1048576}}"#);
        assert!(f.carry(&line).is_ok());
        let view = view_in(&quick).expect("each change");
        assert_eq!(view.claims.len(), n + 1);
    }
    // All it holds is the latest view, whole.
    let latest = view_in(&slow).expect("the latest view");
    assert_eq!(latest.claims.len(), 100);
    assert_eq!(view_in(&slow), None);
    // A watcher whose connection closed is let go; the others go on.
    slow.close();
    f.carry(r#"{"op":"release","claim":"c000"}"#);
    assert_eq!(view_in(&slow), None);
    assert_eq!(view_in(&quick).unwrap().claims.len(), 99);
    assert_eq!(f.service.watchers.mailboxes_open(), 1);
}

#[test]
fn a_gpus_health_changing_is_news_at_the_sweep_while_someone_watches() {
    let mut f = Fixture::new();
    // The fixture GPU's node made a link to /dev/null, as the GPU's numbers say.
    let null = gpuplex_cgroup::DeviceNumbers::of(std::path::Path::new("/dev/null"))
        .unwrap()
        .unwrap();
    let node = f.dir.path().join("nvidia0");
    f.service.gpus[0].device = DeviceNode {
        path: node.clone(),
        major: null.major,
        minor: null.minor,
    };
    let watcher = f.watch();
    assert!(!view_in(&watcher).unwrap().gpus[0].healthy);
    std::os::unix::fs::symlink("/dev/null", &node).unwrap();
    // Not noticed until the sweep looks.
    f.service.publish();
    assert_eq!(view_in(&watcher), None);
    f.service.watch_health();
    f.service.publish();
    assert!(view_in(&watcher).expect("healthy again").gpus[0].healthy);
    f.service.watch_health();
    f.service.publish();
    assert_eq!(view_in(&watcher), None, "no change, no line");
    fs::remove_file(&node).unwrap();
    f.service.watch_health();
    f.service.publish();
    assert!(!view_in(&watcher).expect("gone").gpus[0].healthy);
}

#[test]
fn the_watchers_are_told_their_watch_is_over_at_shutdown() {
    let mut f = Fixture::new();
    let watcher = f.watch();
    view_in(&watcher).unwrap();
    f.service.shutdown("a test");
    assert!(watcher.is_closed());
    assert_eq!(watcher.take(), None);
}

proptest::proptest! {
    /// Whatever parses, the service carries out without panicking, and answers with one line
    /// that reads back as itself.
    #[test]
    fn any_request_gets_a_reply(line in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
        if let Ok(request) = parse_request(&line) {
            let reply = Fixture::new().service.handle(request);
            let text = reply.to_line();
            proptest::prop_assert!(text.ends_with('\n') && text.matches('\n').count() == 1);
        }
    }

    /// The same for JSON objects with a known operation and arbitrary fields.
    #[test]
    fn any_fields_get_a_reply(
        op in proptest::sample::select(OPERATIONS.to_vec()),
        fields in proptest::collection::btree_map("[a-z]{1,10}", "[a-z0-9/.-]{0,12}", 0..5),
    ) {
        let mut object = serde_json::Map::new();
        object.insert("op".into(), op.into());
        for (k, v) in fields {
            object.insert(k, v.into());
        }
        let line = serde_json::to_vec(&object).unwrap();
        if let Ok(request) = parse_request(&line) {
            let reply = Fixture::new().service.handle(request);
            let back: Reply = serde_json::from_str(&reply.to_line()).unwrap();
            proptest::prop_assert_eq!(back, reply);
        }
    }
}
