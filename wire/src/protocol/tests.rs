//! Every request form, every malformed line, and replies read back; what the node service does
//! with each request is tested where it does it (`node/src/service/tests.rs`).

use std::collections::BTreeMap;

use gpuplex_scheduler::node::{Attachment, Placement, ReleaseKey, Target};
use gpuplex_scheduler::units::UnitId;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::{GpuIndex, Handle, VgpuId};

use super::*;

/// The handle the tests reserve with.
const HANDLE: &str = "0123456789abcdef0123456789abcdef";

fn fresh() -> Handle {
    HANDLE.parse().unwrap()
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn every_request_form_reads() {
    let cases: Vec<(&str, Request)> = vec![
        (
            r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"8Gi"}}"#,
            Request::Reserve {
                annotations: annotations(&[("gpuplex.io/gpu-memory", "8Gi")]),
            },
        ),
        (
            r#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c1","pid":42,"unstarted":true}"#,
            Request::Attach {
                handle: fresh(),
                attachment: Attachment {
                    container: "c1".into(),
                    target: Target::Pid(42),
                },
                unstarted: true,
                asked: BTreeMap::new(),
            },
        ),
        (
            r#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c1","pid":42,"annotations":{"gpuplex.io/weight":"2"}}"#,
            Request::Attach {
                handle: fresh(),
                attachment: Attachment {
                    container: "c1".into(),
                    target: Target::Pid(42),
                },
                unstarted: false,
                asked: annotations(&[("gpuplex.io/weight", "2")]),
            },
        ),
        (
            r#"{"op":"allocate","units":["gpu-1-0","gpu-1-1"],"unit":1073741824}"#,
            Request::Allocate {
                units: vec!["gpu-1-0".parse().unwrap(), "gpu-1-1".parse().unwrap()],
                unit: 1 << 30,
            },
        ),
        (
            r#"{"container":"job","cgroup":"/sys/fs/cgroup/freezer/job","op":"register","annotations":{"gpuplex.io/weight":"2"}}"#,
            Request::Register {
                annotations: annotations(&[("gpuplex.io/weight", "2")]),
                attachment: Attachment {
                    container: "job".into(),
                    target: Target::Cgroup("/sys/fs/cgroup/freezer/job".into()),
                },
                unstarted: false,
            },
        ),
        (
            r#"{"op":"register","container":"job","pid":1}"#,
            Request::Register {
                annotations: BTreeMap::new(),
                attachment: Attachment {
                    container: "job".into(),
                    target: Target::Pid(1),
                },
                unstarted: false,
            },
        ),
        (
            r#"{"op":"release","vgpu":"vgpu-1"}"#,
            Request::Release(ReleaseKey::Vgpu(VgpuId(1))),
        ),
        (
            r#"{"op":"release","container":"c1"}"#,
            Request::Release(ReleaseKey::Container("c1".into())),
        ),
        (
            r#"{"op":"release","handle":"0123456789abcdef0123456789abcdef"}"#,
            Request::Release(ReleaseKey::Handle(fresh())),
        ),
        (
            r#"{"op":"hold","container":"c1"}"#,
            Request::Hold {
                key: ReleaseKey::Container("c1".into()),
                held: true,
            },
        ),
        (
            r#"{"vgpu":"vgpu-2","op":"unhold"}"#,
            Request::Hold {
                key: ReleaseKey::Vgpu(VgpuId(2)),
                held: false,
            },
        ),
        (
            r#"{"op":"stopping","container":"c1","signal":"SIGTERM"}"#,
            Request::Stopping {
                key: ReleaseKey::Container("c1".into()),
                signal: StopSignal::Graceful,
            },
        ),
        (
            r#"{"op":"stopping","vgpu":"vgpu-2","signal":"SIGKILL"}"#,
            Request::Stopping {
                key: ReleaseKey::Vgpu(VgpuId(2)),
                signal: StopSignal::Kill,
            },
        ),
        (r#" {"op":"status"} "#, Request::Status),
        (r#"{"op":"watch"}"#, Request::Watch),
    ];
    for (line, expected) in cases {
        assert_eq!(
            parse_request(line.as_bytes()),
            Ok(expected.clone()),
            "{line}"
        );
        // What a client writes for it reads back as it.
        let written = expected.to_line();
        assert_eq!(
            parse_request(written.trim_end().as_bytes()),
            Ok(expected),
            "{written}"
        );
    }
}

#[test]
fn each_request_is_written_as_the_protocol_says() {
    let by_pid = Attachment {
        container: "c1".into(),
        target: Target::Pid(42),
    };
    let cases: Vec<(Request, &str)> = vec![
        (
            Request::Reserve {
                annotations: annotations(&[("gpuplex.io/gpu-memory", "8Gi")]),
            },
            r#"{"op":"reserve","annotations":{"gpuplex.io/gpu-memory":"8Gi"}}"#,
        ),
        (
            Request::Attach {
                handle: fresh(),
                attachment: by_pid.clone(),
                unstarted: true,
                asked: BTreeMap::new(),
            },
            r#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c1","pid":42,"unstarted":true}"#,
        ),
        (
            Request::Attach {
                handle: fresh(),
                attachment: by_pid.clone(),
                unstarted: true,
                asked: annotations(&[("gpuplex.io/priority", "low")]),
            },
            r#"{"op":"attach","annotations":{"gpuplex.io/priority":"low"},"handle":"0123456789abcdef0123456789abcdef","container":"c1","pid":42,"unstarted":true}"#,
        ),
        (
            Request::Allocate {
                units: vec!["gpu-0-3".parse().unwrap()],
                unit: 512 << 20,
            },
            r#"{"op":"allocate","units":["gpu-0-3"],"unit":536870912}"#,
        ),
        (
            Request::Register {
                annotations: BTreeMap::new(),
                attachment: Attachment {
                    container: "job".into(),
                    target: Target::Cgroup("/sys/fs/cgroup/job".into()),
                },
                unstarted: false,
            },
            r#"{"op":"register","annotations":{},"container":"job","cgroup":"/sys/fs/cgroup/job"}"#,
        ),
        (
            Request::Release(ReleaseKey::Vgpu(VgpuId(3))),
            r#"{"op":"release","vgpu":"vgpu-3"}"#,
        ),
        // A container whose id reads like a vGPU id is still a container.
        (
            Request::Release(ReleaseKey::Container("vgpu-3".into())),
            r#"{"op":"release","container":"vgpu-3"}"#,
        ),
        (
            Request::Release(ReleaseKey::Handle(fresh())),
            r#"{"op":"release","handle":"0123456789abcdef0123456789abcdef"}"#,
        ),
        (
            Request::Hold {
                key: ReleaseKey::Container("c1".into()),
                held: true,
            },
            r#"{"op":"hold","container":"c1"}"#,
        ),
        (
            Request::Hold {
                key: ReleaseKey::Vgpu(VgpuId(2)),
                held: false,
            },
            r#"{"op":"unhold","vgpu":"vgpu-2"}"#,
        ),
        (
            Request::Stopping {
                key: ReleaseKey::Container("c1".into()),
                signal: StopSignal::Graceful,
            },
            r#"{"op":"stopping","container":"c1","signal":"SIGTERM"}"#,
        ),
        (
            Request::Stopping {
                key: ReleaseKey::Container("c1".into()),
                signal: StopSignal::Kill,
            },
            r#"{"op":"stopping","container":"c1","signal":"SIGKILL"}"#,
        ),
        (
            Request::Pin {
                claim: "7f3c".into(),
                placement: Placement {
                    gpus: vec![GpuIndex(1), GpuIndex(0)],
                    memory: 8 << 30,
                },
                annotations: [("gpuplex.io/weight".to_string(), "2".to_string())].into(),
            },
            r#"{"op":"pin","annotations":{"gpuplex.io/weight":"2"},"claim":"7f3c","gpus":[1,0],"memory":8589934592}"#,
        ),
        (
            Request::Release(ReleaseKey::Claim("7f3c".into())),
            r#"{"op":"release","claim":"7f3c"}"#,
        ),
        (Request::Status, r#"{"op":"status"}"#),
        (
            Request::Events { since: 41 },
            r#"{"op":"events","since":41}"#,
        ),
        (Request::Watch, r#"{"op":"watch"}"#),
    ];
    for (request, line) in cases {
        assert_eq!(request.to_line(), format!("{line}\n"));
    }
}

/// Any request of any kind, as a client may build it.
fn any_request() -> impl proptest::strategy::Strategy<Value = Request> {
    use proptest::prelude::*;
    let text = || "\\PC{0,12}";
    let annotations = || proptest::collection::btree_map(text(), text(), 0..4);
    let handle = || any::<[u8; 16]>().prop_map(Handle::from_bytes);
    let target = prop_oneof![
        (1u32..).prop_map(Target::Pid),
        "/\\PC{0,20}".prop_map(Target::Cgroup),
    ];
    let attachment =
        (text(), target).prop_map(|(container, target)| Attachment { container, target });
    let key = || {
        prop_oneof![
            any::<u64>().prop_map(|n| ReleaseKey::Vgpu(VgpuId(n))),
            text().prop_map(ReleaseKey::Container),
            handle().prop_map(ReleaseKey::Handle),
            text().prop_map(ReleaseKey::Claim),
        ]
    };
    let placement =
        (proptest::collection::vec(any::<u32>(), 0..4), any::<u64>()).prop_map(|(gpus, memory)| {
            Placement {
                gpus: gpus.into_iter().map(GpuIndex).collect(),
                memory,
            }
        });
    let signal = prop_oneof![Just(StopSignal::Graceful), Just(StopSignal::Kill)];
    prop_oneof![
        annotations().prop_map(|annotations| Request::Reserve { annotations }),
        (handle(), attachment.clone(), any::<bool>(), annotations()).prop_map(
            |(handle, attachment, unstarted, asked)| {
                Request::Attach {
                    handle,
                    attachment,
                    unstarted,
                    asked,
                }
            }
        ),
        (
            proptest::collection::vec((any::<u32>(), any::<u32>()), 0..6),
            1u64..
        )
            .prop_map(|(units, unit)| Request::Allocate {
                units: units
                    .into_iter()
                    .map(|(gpu, n)| UnitId {
                        gpu: GpuIndex(gpu),
                        n
                    })
                    .collect(),
                unit,
            }),
        (annotations(), attachment, any::<bool>()).prop_map(
            |(annotations, attachment, unstarted)| Request::Register {
                annotations,
                attachment,
                unstarted,
            }
        ),
        key().prop_map(Request::Release),
        (key(), any::<bool>()).prop_map(|(key, held)| Request::Hold { key, held }),
        (key(), signal).prop_map(|(key, signal)| Request::Stopping { key, signal }),
        (text(), placement, annotations()).prop_map(|(claim, placement, annotations)| {
            Request::Pin {
                claim,
                placement,
                annotations,
            }
        }),
        Just(Request::Status),
        any::<u64>().prop_map(|since| Request::Events { since }),
        Just(Request::Watch),
    ]
}

#[test]
fn every_malformed_line_gets_its_own_one_line_error() {
    let cases: &[(&[u8], &str)] = &[
        (b"", "not a JSON object"),
        (b"{\"op\":", "not a JSON object"),
        (b"\xff\xfe", "not a JSON object"),
        (b"[1,2]", "not a JSON object: got an array"),
        (b"{}", "unknown operation (no \"op\")"),
        (br#"{"op":"frobnicate"}"#, "unknown operation `frobnicate`"),
        (br#"{"op":7}"#, "unknown operation 7"),
        (br#"{"op":"status","x":1}"#, "status: unknown field `x`"),
        (
            br#"{"op":"reserve"}"#,
            "reserve: missing field `annotations`",
        ),
        (br#"{"op":"pin","gpus":[0],"memory":1}"#, "pin: missing field `claim`"),
        (
            br#"{"op":"pin","claim":"c","gpus":[-1],"memory":1}"#,
            "pin: invalid value",
        ),
        (
            br#"{"op":"pin","claim":"c","gpus":[0],"memory":1,"container":"x"}"#,
            "pin: unknown field `container`",
        ),
        (
            br#"{"op":"release","claim":"c","container":"x"}"#,
            "give exactly one of `vgpu`, `container`, `handle` and `claim`",
        ),
        (
            br#"{"op":"reserve","annotations":{"a":1}}"#,
            "reserve: invalid type",
        ),
        (
            br#"{"op":"attach","container":"c","pid":1}"#,
            "attach: missing field `handle`",
        ),
        (
            br#"{"op":"attach","vgpu":"vgpu-1","container":"c","pid":1}"#,
            "attach: unknown field `vgpu`",
        ),
        (
            br#"{"op":"attach","handle":"../../tmp/x","container":"c","pid":1}"#,
            "attach: handle: not a vGPU handle",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":1,"unstarted":"yes"}"#,
            "attach: invalid type",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c"}"#,
            "exactly one of `pid` and `cgroup`",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":1,"cgroup":"/x"}"#,
            "exactly one of `pid` and `cgroup`",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":0}"#,
            "pid must be above 0",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":-1}"#,
            "attach: invalid value",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","cgroup":"x"}"#,
            "is not an absolute path",
        ),
        (
            br#"{"op":"attach","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":1,"annotations":{"a":1}}"#,
            "attach: invalid type: integer `1`, expected a string",
        ),
        (
            br#"{"op":"events","since":-1}"#,
            "events: invalid value: integer `-1`",
        ),
        (
            br#"{"op":"events","vgpu":"vgpu-1"}"#,
            "events: unknown field `vgpu`",
        ),
        (
            br#"{"op":"allocate","units":["gpu-1-0"]}"#,
            "allocate: missing field `unit`",
        ),
        (
            br#"{"op":"allocate","units":["gpu-1-0"],"unit":0}"#,
            "allocate: unit must be above 0 bytes",
        ),
        (
            br#"{"op":"allocate","units":["gpu-01-0"],"unit":1}"#,
            "is not a gpuplex.io/gpu-memory unit",
        ),
        (
            br#"{"op":"allocate","units":["gpu-1-0"],"unit":1,"claim":"x"}"#,
            "allocate: unknown field `claim`",
        ),
        (
            br#"{"op":"register","handle":"0123456789abcdef0123456789abcdef","container":"c","pid":1}"#,
            "register: unknown field `handle`",
        ),
        (
            br#"{"op":"register","pid":1}"#,
            "register: missing field `container`",
        ),
        (
            br#"{"op":"release"}"#,
            "exactly one of `vgpu`, `container`, `handle` and `claim`",
        ),
        (
            br#"{"op":"release","handle":"0123456789abcdef0123456789abcdef","container":"c"}"#,
            "exactly one of `vgpu`, `container`, `handle` and `claim`",
        ),
        (
            br#"{"op":"release","handle":"vgpu-1"}"#,
            "release: handle: not a vGPU handle",
        ),
        (
            br#"{"op":"hold"}"#,
            "hold: give exactly one of `vgpu`, `container`, `handle` and `claim`",
        ),
        (
            br#"{"op":"unhold","handle":"0123456789abcdef0123456789abcdef","container":"c"}"#,
            "unhold: give exactly one of `vgpu`, `container`, `handle` and `claim`",
        ),
        (
            br#"{"op":"hold","vgpu":"x"}"#,
            "hold: vgpu: `x` is not a vGPU id",
        ),
        (
            br#"{"op":"unhold","container":"c","held":true}"#,
            "unhold: unknown field `held`",
        ),
        (
            br#"{"op":"stopping","container":"c"}"#,
            "stopping: missing field `signal`",
        ),
        (
            br#"{"op":"stopping","container":"c","signal":"SIGHUP"}"#,
            "stopping: signal `SIGHUP` is not a stop signal",
        ),
        (
            br#"{"op":"release","container":"c","signal":"SIGKILL"}"#,
            "release: unknown field `signal`",
        ),
        (
            br#"{"op":"watch","since":1}"#,
            "watch: unknown field `since`",
        ),
        (br#"{"op":"watch","gpus":[0]}"#, "watch: unknown field `gpus`"),
        (
            br#"{"op":"pause","container":"c"}"#,
            "one of reserve, attach, register, release, hold, unhold, stopping, pin, allocate, status, events, watch",
        ),
    ];
    for (line, expected) in cases {
        let e = parse_request(line).unwrap_err().to_string();
        assert!(
            e.contains(expected),
            "{}: {e}",
            String::from_utf8_lossy(line)
        );
        assert!(!e.contains('\n'), "{e}");
    }
    let long = format!(r#"{{"op":"status","pad":"{}"}}"#, "x".repeat(MAX_LINE));
    assert_eq!(
        parse_request(long.as_bytes()),
        Err(ProtocolError::TooLong {
            len: long.len(),
            max: MAX_LINE
        })
    );
}

proptest::proptest! {
    /// Every request a client writes is one line, and the service reads it as that request.
    #[test]
    fn every_request_written_reads_back(request in any_request()) {
        let line = request.to_line();
        proptest::prop_assert_eq!(line.find('\n'), Some(line.len() - 1));
        proptest::prop_assert_eq!(parse_request(line.trim_end_matches('\n').as_bytes()), Ok(request));
    }

    /// Whatever arrives on the socket, reading it never panics and an error is one line (the
    /// node service's own tests carry out whatever parses: `node/src/service/tests.rs`).
    #[test]
    fn any_bytes_read_or_get_a_one_line_error(line in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
        if let Err(e) = parse_request(&line) {
            proptest::prop_assert!(!e.to_string().contains('\n'));
        }
    }
}

#[test]
fn a_reply_is_one_line_that_reads_back_as_itself() {
    assert_eq!(Reply::refused("a\nb ").refusal(), Some("a b"));
    assert_eq!(
        Reply::refused("  ").refusal(),
        Some("the gpuplex node service refused the request without saying why")
    );
    for (reply, line) in [
        (Reply::Done, r#"{"ok":true}"#),
        (Reply::refused("no"), r#"{"ok":false,"error":"no"}"#),
    ] {
        assert_eq!(reply.to_line(), format!("{line}\n"));
        assert_eq!(serde_json::from_str::<Reply>(line).unwrap(), reply);
    }
    let both = r#"{"ok":true,"events":{"first":1,"events":[]},"status":null,"vgpu":{"id":"vgpu-1","gpus":[],"weight":1,"priority":"normal"}}"#;
    let err = serde_json::from_str::<Reply>(both).unwrap_err().to_string();
    assert!(err.contains("at most one of"), "{err}");
    let both = r#"{"ok":true,"events":{"first":1,"events":[]},"capacity":{"gpus":[],"claims":[]}}"#;
    let err = serde_json::from_str::<Reply>(both).unwrap_err().to_string();
    assert!(err.contains("at most one of"), "{err}");
    let bad_id = r#"{"ok":true,"vgpu":{"id":"../etc","gpus":[],"weight":1,"priority":"normal"}}"#;
    let err = serde_json::from_str::<Reply>(bad_id)
        .unwrap_err()
        .to_string();
    assert!(err.contains("a vGPU id such as `vgpu-7`"), "{err}");
}

#[test]
fn a_capacity_view_is_written_as_the_protocol_says_and_reads_back() {
    let view = CapacityView {
        gpus: vec![
            GpuCapacity {
                index: 0,
                uuid: "GPU-a".into(),
                model: "H100".into(),
                memory: 80 << 30,
                capacity: 80 << 30,
                unreserved: 72 << 30,
                healthy: true,
                fake: false,
            },
            GpuCapacity {
                index: 1,
                uuid: "GPU-b".into(),
                model: "Fake GPU".into(),
                memory: 16 << 30,
                capacity: 24 << 30,
                unreserved: 24 << 30,
                healthy: false,
                fake: true,
            },
        ],
        claims: vec!["7f3c".into(), "units-gpu-0-0".into()],
    };
    let line = r#"{"ok":true,"capacity":{"gpus":[{"index":0,"uuid":"GPU-a","model":"H100","memory":85899345920,"capacity":85899345920,"unreserved":77309411328,"healthy":true},{"index":1,"uuid":"GPU-b","model":"Fake GPU","memory":17179869184,"capacity":25769803776,"unreserved":25769803776,"healthy":false,"fake":true}],"claims":["7f3c","units-gpu-0-0"]}}"#;
    let reply = Reply::Capacity(Box::new(view.clone()));
    assert_eq!(reply.to_line(), format!("{line}\n"));
    let back: Reply = serde_json::from_str(line).unwrap();
    assert_eq!(back.into_capacity(), Some(view));
    // A view missing what a watcher needs does not read as one.
    let partial = r#"{"ok":true,"capacity":{"gpus":[{"index":0,"uuid":"GPU-a"}],"claims":[]}}"#;
    assert!(serde_json::from_str::<Reply>(partial).is_err());
}
