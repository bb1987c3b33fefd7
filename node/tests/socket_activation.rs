//! The node service under systemd's socket activation (`config/gpuplex.socket`), done here as
//! systemd does it: the test holds the listening socket, as systemd does, and passes it to each
//! service it starts as fd 3 with `LISTEN_FDS` and `LISTEN_PID`.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use serde_json::Value;
use support::*;

/// A service started normally, stopped, and its socket taken over by the test (systemd's part).
fn activated() -> (NodeService, UnixListener) {
    let mut service = NodeService::start(Setup::default());
    assert!(service.terminate().success());
    std::fs::remove_file(&service.socket).unwrap();
    let listener = UnixListener::bind(&service.socket).unwrap();
    std::fs::write(&service.log, "").unwrap();
    (service, listener)
}

/// Sends a status request now and reads its reply on another thread.
fn status_later(socket: &std::path::Path) -> std::thread::JoinHandle<Value> {
    let mut stream = UnixStream::connect(socket).expect("connect: the socket listens");
    stream.write_all(b"{\"op\":\"status\"}\n").unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    std::thread::spawn(move || {
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("reply {reply:?}: {e}"))
    })
}

#[test]
fn a_request_sent_while_the_service_restarts_waits_for_the_next_one() {
    if !can_run("a_request_sent_while_the_service_restarts_waits_for_the_next_one") {
        return;
    }
    let _serial = serial();
    let (mut service, listener) = activated();
    service.spawn_activated(&listener);
    let first = status_later(&service.socket).join().unwrap();
    assert_eq!(first["ok"], true, "{first}");
    assert!(
        service.log_text().contains("(passed by systemd)"),
        "{}",
        service.log_text()
    );
    // The watchdog does not keep the listening socket: it is close-on-exec.
    let socket_of = |pid: u32, fd: &str| std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok();
    let listening = socket_of(service.pid(), "3").expect("the service's fd 3");
    let watchdog = service.watchdog_pid();
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{watchdog}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .collect();
    assert!(
        !held.contains(&listening),
        "the watchdog holds {listening:?}"
    );

    // Stopped: the socket stays (the service does not remove what systemd made), and a
    // request sent now waits, unanswered, in the backlog.
    assert!(service.terminate().success());
    assert!(
        service.socket.exists(),
        "the service removed systemd's socket"
    );
    let waiting = status_later(&service.socket);
    std::thread::sleep(Duration::from_millis(500));
    assert!(!waiting.is_finished(), "answered with no service running");
    // The next service answers it.
    service.spawn_activated(&listener);
    let reply = waiting.join().unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["status"]["node"], "testnode", "{reply}");
}

/// A service started on what `passed` makes (given the service's directory) must exit with an
/// error: the service, and its log.
fn refused_on<S: std::os::unix::io::AsRawFd>(
    passed: impl FnOnce(&std::path::Path) -> S,
) -> (NodeService, String) {
    let (mut service, _listener) = activated();
    let socket = passed(service.dir.path());
    service.spawn_activated(&socket);
    let status = service.child.take().unwrap().wait().unwrap();
    assert!(!status.success(), "{status}");
    let log = service.log_text();
    (service, log)
}

#[test]
fn a_passed_socket_at_another_path_than_the_configured_one_is_refused_in_one_line() {
    if !can_run("a_passed_socket_at_another_path_than_the_configured_one_is_refused_in_one_line") {
        return;
    }
    let _serial = serial();
    let elsewhere = |dir: &std::path::Path| dir.join("other.sock");
    let (service, log) = refused_on(|dir| UnixListener::bind(elsewhere(dir)).unwrap());
    let line = log
        .lines()
        .find(|l| l.contains("passed"))
        .unwrap_or_else(|| panic!("no line about the passed socket: {log}"));
    assert!(
        line.contains(&elsewhere(service.dir.path()).display().to_string())
            && line.contains("gpuplex.socket")
            && line.contains(&service.socket.display().to_string()),
        "{line}"
    );
}

#[test]
fn a_passed_socket_that_is_not_listening_is_refused_in_one_line() {
    if !can_run("a_passed_socket_that_is_not_listening_is_refused_in_one_line") {
        return;
    }
    let _serial = serial();
    // What `Accept=yes` would pass: one connection (its peer is kept open by the test).
    let mut peer = None;
    let (_service, log) = refused_on(|_| {
        let (connection, other) = UnixStream::pair().unwrap();
        peer = Some(other);
        connection
    });
    assert!(
        log.lines()
            .any(|l| l.contains("not listening") && l.contains("Accept=yes")),
        "{log}"
    );
}
