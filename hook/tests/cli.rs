//! `gpuplex-hook` as a runtime calls it, for the cases that need no node service and no root:
//! untouched containers, usage, and every kind of bad input, each one line and exit 1.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn hook(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuplex-hook"))
        .args(args)
        // A socket nobody listens on: a stage that needs the service fails saying so.
        .env("GPUPLEX_CONFIG", "/nonexistent/gpuplex.toml")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn one_line_error(out: &Output, stage: &str, expected: &str) {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("gpuplex-hook {stage}: ")),
        "{stderr}"
    );
    assert!(stderr.contains(expected), "{stderr}");
}

#[test]
fn a_config_without_gpuplex_annotations_comes_back_byte_for_byte() {
    // Odd spacing and key order on purpose: nothing may be re-serialized.
    let config = b"{ \"ociVersion\":\"1.0.2\",  \"annotations\": {\"io.podman.x\": \"1\"},\n \"process\":{\"args\":[\"true\"]} }";
    let out = hook(&["precreate"], config);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout, config);
    // Even with gpuplex's configuration missing: an unrelated container is never failed.
    let out = hook(&["--config", "/nonexistent/x.toml", "precreate"], config);
    assert_eq!(out.stdout, config);
}

#[test]
fn a_container_without_gpuplex_annotations_is_left_alone_at_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"root":{"path":"rootfs"},"annotations":{"other":"1"}}"#,
    )
    .unwrap();
    let state = format!(
        r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1,"bundle":"{}"}}"#,
        dir.path().display()
    );
    for stage in ["createRuntime", "prestart", "poststop"] {
        let out = hook(&[stage], state.as_bytes());
        assert!(out.status.success(), "{stage}: {out:?}");
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "{stage}: {out:?}"
        );
    }
}

#[test]
fn bad_input_fails_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path();
    // A configuration naming a socket nobody listens on.
    let config = dir.path().join("gpuplex.toml");
    let socket = dir.path().join("none.sock");
    std::fs::write(
        &config,
        format!("[service]\nsocket = \"{}\"\n", socket.display()),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let state = |bundle: &std::path::Path| {
        format!(
            r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1,"bundle":"{}","annotations":{{"gpuplex.io/gpus":"1"}}}}"#,
            bundle.display()
        )
    };
    let run = |stage: &str, input: &[u8]| hook(&["--config", config, stage], input);
    // Malformed state JSON.
    let out = run("createRuntime", b"{not json");
    one_line_error(&out, "createRuntime", "the OCI state on stdin is not valid");
    // Malformed config JSON (precreate).
    let out = run(
        "precreate",
        b"{\"annotations\": {\"gpuplex.io/gpus\": \"1\"",
    );
    one_line_error(&out, "precreate", "the config on stdin is not JSON");
    // A missing bundle.
    let out = run("createRuntime", state(&bundle.join("missing")).as_bytes());
    one_line_error(&out, "createRuntime", "missing/config.json: No such file");
    // An unreadable config.json.
    std::fs::write(bundle.join("config.json"), "{\"root\":").unwrap();
    one_line_error(
        &run("prestart", state(bundle).as_bytes()),
        "prestart",
        "config.json",
    );
    // The service not running.
    std::fs::write(
        bundle.join("config.json"),
        r#"{"root":{"path":"rootfs"},"annotations":{"gpuplex.io/gpus":"1"}}"#,
    )
    .unwrap();
    let out = run("createRuntime", state(bundle).as_bytes());
    one_line_error(
        &out,
        "createRuntime",
        "cannot reach the gpuplex node service",
    );
    // gpuplex's own configuration missing, for a container that asks for a vGPU.
    let out = hook(
        &["--config", "/nonexistent/gpuplex.toml", "poststop"],
        state(bundle).as_bytes(),
    );
    one_line_error(
        &out,
        "poststop",
        "cannot read the configuration /nonexistent/gpuplex.toml: ",
    );
    // A claim's attach step: a handle gpuplex never wrote (a forged spec), a state without a
    // pid, a socket nobody listens on.
    let socket_arg = socket.to_str().unwrap();
    let attach = |handle: &str, input: &[u8]| {
        hook(
            &["--config", config, "--socket", socket_arg, "attach", handle],
            input,
        )
    };
    let handle = "0123456789abcdef0123456789abcdef";
    one_line_error(
        &attach("../../etc/passwd", state(bundle).as_bytes()),
        "attach",
        "is not a handle gpuplex wrote",
    );
    let no_pid = br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","bundle":"/x"}"#;
    one_line_error(&attach(handle, no_pid), "attach", "has no pid");
    one_line_error(
        &attach(handle, state(bundle).as_bytes()),
        "attach",
        "cannot reach the gpuplex node service",
    );
    // A configuration the node service refuses, the hook refuses too, saying why as it does.
    let refused = dir.path().join("refused.toml");
    std::fs::write(&refused, "[scheduler]\nslice = \"0ms\"\n").unwrap();
    let out = hook(
        &["--config", refused.to_str().unwrap(), "poststop"],
        state(bundle).as_bytes(),
    );
    one_line_error(
        &out,
        "poststop",
        &format!("{}: scheduler.slice = ", refused.display()),
    );
}

#[test]
fn usage_errors_exit_2() {
    let no_handle = ["attach"];
    let extra = ["attach", "h", "extra"];
    let no_socket = ["--socket"];
    for args in [
        &[][..],
        &["bogus"],
        &["--config"],
        &["precreate", "extra"],
        &no_handle,
        &extra,
        &no_socket,
    ] {
        let out = hook(args, b"");
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).lines().count(),
            1,
            "{args:?}"
        );
    }
    let out = hook(&["--help"], b"");
    assert!(out.status.success());
    // `fail` is what a failed precreate leaves in the spec: it prints its line and exits 1.
    let out = hook(
        &["fail", "gpuplex-hook precreate: no GPU can hold vgpu-1"],
        b"{}",
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "gpuplex-hook precreate: no GPU can hold vgpu-1\n"
    );
}
