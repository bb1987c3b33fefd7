//! vGPU ids never repeat on a node, across a kill -9 (found by `make soak`, issue #31): a
//! refusal's id is spent, and leaves no record; when the node's ids run ahead of the clock (a
//! service started while the wall clock was stepped forward), only what was saved before the
//! death keeps the next service from giving that id to another container.

mod support;

use serde_json::{json, Value};
use support::*;

/// The id a reply names: its vGPU's, or the one its refusal names.
fn id_of(reply: &Value) -> u64 {
    let text = match reply["ok"].as_bool() {
        Some(true) => reply["vgpu"]["id"].as_str().unwrap().to_string(),
        _ => reply["error"].as_str().unwrap().to_string(),
    };
    let at = text
        .find("vgpu-")
        .unwrap_or_else(|| panic!("no vGPU id in {reply}"))
        + 5;
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

#[test]
fn an_id_a_refusal_named_is_not_given_again_after_a_kill_9() {
    if !can_run("an_id_a_refusal_named_is_not_given_again_after_a_kill_9") {
        return;
    }
    let _serial = serial();
    let mut service = NodeService::start(Setup::default());
    assert!(service.terminate().success());
    // The node's ids an hour ahead of the clock, as after a start while the clock was stepped.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let ahead = now_ms + 3_600_000;
    let accounting = json!({"format": 1, "vgpus": {}, "gpus": {}, "next_vgpu": ahead});
    std::fs::write(
        service.dir.path().join("state/accounting.json"),
        accounting.to_string(),
    )
    .unwrap();
    service.spawn();

    let too_big = json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "64Gi"}});
    let refused = service.ask(&too_big);
    assert_eq!(refused["ok"], false, "{refused}");
    let spent = id_of(&refused);
    assert!(spent >= ahead, "{spent} < {ahead}");
    // Killed at once: no accounting checkpoint since the refusal.
    service.kill9();
    service.spawn();

    let fits = json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "1Gi"}});
    let given = service.ask(&fits);
    assert_eq!(given["ok"], true, "{given}");
    assert!(
        id_of(&given) > spent,
        "the refusal named vgpu-{spent}; after the restart a reservation got vgpu-{}",
        id_of(&given)
    );
    let again = service.ask(&too_big);
    assert!(id_of(&again) > id_of(&given), "{again}");
}

#[test]
fn a_state_dir_that_cannot_take_the_id_ceiling_refuses_in_one_line_and_gives_nothing() {
    if !can_run("a_state_dir_that_cannot_take_the_id_ceiling_refuses_in_one_line_and_gives_nothing")
    {
        return;
    }
    let _serial = serial();
    let service = NodeService::start(Setup::default());
    // The ceiling's file cannot be replaced: a directory of its name, with a file in it.
    let ids = service.dir.path().join("state/ids");
    let _ = std::fs::remove_file(&ids);
    std::fs::create_dir(&ids).unwrap();
    std::fs::write(ids.join("keep"), "").unwrap();
    // The first request that gives ids saves the ceiling; it cannot.
    let reply =
        service.ask(&json!({"op": "reserve", "annotations": {"gpuplex.io/gpu-memory": "1Gi"}}));
    assert_eq!(reply["ok"], false, "{reply}");
    let error = reply["error"].as_str().unwrap();
    assert!(
        error.contains("state/ids")
            && error.contains("nothing was reserved")
            && !error.contains('\n'),
        "{error}"
    );
    let status = service.status();
    assert_eq!(status["reservations"], json!([]), "{status}");
    assert_eq!(status["containers"], json!([]), "{status}");
}
