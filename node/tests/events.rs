//! The node socket's `events`: each change of a GPU's window holder, numbered, with the wall
//! clock's time, against the real service with real cgroups (root): two busy containers on one
//! GPU take turns, and a client polling with the last number it saw misses none.

mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use support::*;

use gpuplex_cgroup::FreezerVersion::V1;

#[test]
fn window_holders_are_told_in_order_with_their_time() {
    if !can_run("window_holders_are_told_in_order_with_their_time") {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    let mut a = TestCgroup::new(V1, "events-a");
    let mut b = TestCgroup::new(V1, "events-b");
    a.spawn_busy();
    b.spawn_busy();
    let start_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (id, group) in [("ev-a", &a), ("ev-b", &b)] {
        let r = service.register(id, group, json!({"gpuplex.io/gpu-memory": "1Gi"}));
        assert_eq!(r["ok"], true, "{r}");
    }
    // 50 ms slices: several turns each within a second or so (up to 10 s on a loaded machine).
    let turns = || service.ask(&json!({"op": "events", "since": 0}));
    wait_until(Duration::from_secs(10), || {
        turns()["events"]["events"]
            .as_array()
            .is_some_and(|e| e.len() >= 6)
    })
    .expect("six changes of holder");
    let first = turns();
    assert_eq!(first["ok"], true, "{first}");
    let events = first["events"]["events"].as_array().unwrap().clone();
    assert!(events.len() >= 6, "{first}");
    assert_eq!(first["events"]["first"], 1);
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut last = (0, start_ms.saturating_sub(50));
    for e in &events {
        let (seq, at) = (e["seq"].as_u64().unwrap(), e["at_ms"].as_u64().unwrap());
        assert_eq!(seq, last.0 + 1, "{first}");
        assert!(
            at >= last.1 && at <= now_ms + 5,
            "{e} after {last:?}, now {now_ms}"
        );
        assert_eq!(e["gpu"], 0);
        last = (seq, at);
    }
    let holders: Vec<&str> = events
        .iter()
        .filter_map(|e| e["container"].as_str())
        .collect();
    assert!(
        holders.contains(&"ev-a") && holders.contains(&"ev-b"),
        "{holders:?}"
    );
    // Polling from the last number seen gives only what came after.
    let after = || service.ask(&json!({"op": "events", "since": last.0}));
    wait_until(Duration::from_secs(10), || {
        after()["events"]["events"]
            .as_array()
            .is_some_and(|e| !e.is_empty())
    })
    .expect("a later change of holder");
    let next = after();
    let more = next["events"]["events"].as_array().unwrap();
    assert!(!more.is_empty(), "{next}");
    assert_eq!(more[0]["seq"].as_u64().unwrap(), last.0 + 1);
    let bad = service.ask(&json!({"op": "events", "since": "x"}));
    assert_eq!(bad["ok"], false, "{bad}");
    a.kill_all();
    b.kill_all();
}
