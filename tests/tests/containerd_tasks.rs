//! More of containerd's task API, as a client sees it, under containerd's runc shim and under
//! gpuplex's alike (issue #13): the same test, two runtimes, with the same expectations.

use std::process::Stdio;
use std::time::{Duration, Instant};

use gpuplex_integration::containerd::*;
use gpuplex_integration::parity;
use gpuplex_integration::*;

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn a_terminal_exec_gets_its_size_and_carries_megabytes(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig(
        "a_terminal_exec_gets_its_size_and_carries_megabytes",
        runtime,
        minor,
    ) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "tty-exec", &["sleep", "1000"]);
    // ctr sizes the exec's terminal from its own (ResizePty, right after the start: the size
    // reads 0 0 until then), then copies its output.
    let script = "until busybox stty size >/dev/null 2>&1; do sleep 0.05; done; sleep 0.3; \
                  busybox stty size; seq 1 200000; exit 3";
    let (status, shown) = c.exec_in_terminal("tty-exec", "e1", &["sh", "-c", script], (37, 111));
    assert_eq!(
        status.code(),
        Some(3),
        "{}",
        &shown[..shown.len().min(2000)]
    );
    let lines: Vec<&str> = shown.lines().map(|l| l.trim_end_matches('\r')).collect();
    let head = &lines[..lines.len().min(5)];
    assert!(head.contains(&"37 111"), "the terminal's size: {head:?}");
    assert!(
        shown.len() > 1_000_000,
        "{} bytes from the terminal",
        shown.len()
    );
    assert_eq!(lines.last().copied(), Some("200000"));
    assert!(lines.len() >= 200_001, "{} lines", lines.len());
}

parity!(a_terminal_exec_gets_its_size_and_carries_megabytes, minor 180:
    a_terminal_exec_gets_its_size_and_carries_megabytes_under_runc,
    a_terminal_exec_gets_its_size_and_carries_megabytes_under_gpuplex);

fn an_exec_that_cannot_start_fails_in_runcs_words_and_leaves_no_shim(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig(
        "an_exec_that_cannot_start_fails_in_runcs_words_and_leaves_no_shim",
        runtime,
        minor,
    ) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "bad-exec", &["sleep", "1000"]);
    // An exec probe naming a program the image does not have.
    let out = c.exec("bad-exec", "probe", &["/no/such/program"]);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("OCI runtime exec failed"), "{stderr}");
    // The container runs on, and goes away whole: no shim is left behind.
    assert_eq!(c.task_status("bad-exec").as_deref(), Some("RUNNING"));
    let out = c.kill("bad-exec", "SIGKILL");
    assert!(out.status.success(), "{}", text(&out));
    assert!(c.wait_for_status("bad-exec", "STOPPED", Duration::from_secs(5)));
    let out = c.remove("bad-exec");
    assert!(out.status.success(), "{}", text(&out));
    let gone = wait_until(Duration::from_secs(5), || {
        shim_daemon(runtime, "bad-exec").is_none()
    });
    assert!(gone, "the shim of bad-exec outlives it");
}

parity!(an_exec_that_cannot_start_fails_in_runcs_words_and_leaves_no_shim, minor 181:
    an_exec_that_cannot_start_fails_in_runcs_words_and_leaves_no_shim_under_runc,
    an_exec_that_cannot_start_fails_in_runcs_words_and_leaves_no_shim_under_gpuplex);

fn sigterm_ends_the_shim_daemon(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("sigterm_ends_the_shim_daemon", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "termed", &["sleep", "1000"]);
    let shim = shim_daemon(runtime, "termed").expect("the shim daemon");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shim as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to the shim");
    let ended = wait_until(Duration::from_secs(5), || !alive(shim));
    assert!(ended, "the shim daemon ignored SIGTERM");
}

parity!(sigterm_ends_the_shim_daemon, minor 182:
    sigterm_ends_the_shim_daemon_under_runc, sigterm_ends_the_shim_daemon_under_gpuplex);

fn an_init_killed_in_a_shared_pid_namespace_takes_its_children(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig(
        "an_init_killed_in_a_shared_pid_namespace_takes_its_children",
        runtime,
        minor,
    ) else {
        return;
    };
    let c = &rig.containerd;
    // A pod's way: the second container joins the first one's PID namespace.
    c.run_detached(runtime, &[], "pod-pid", &["sleep", "1000"]);
    let first = c
        .tasks()
        .into_iter()
        .find(|t| t.id == "pod-pid")
        .map(|t| t.pid)
        .expect("the first container's init");
    let joined = format!("pid:/proc/{first}/ns/pid");
    let out = c
        .run_command(
            &["-d", "--with-ns", &joined],
            runtime,
            &[],
            "host-pid",
            &["sh", "-c", "sleep 1001 & sleep 1002 & wait"],
        )
        .stdin(Stdio::null())
        .output()
        .expect("ctr runs");
    assert!(out.status.success(), "{}", text(&out));
    let init = c
        .tasks()
        .into_iter()
        .find(|t| t.id == "host-pid")
        .map(|t| t.pid)
        .expect("its init");
    let children = || -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    assert!(wait_until(Duration::from_secs(5), || children().len() == 2));
    let sleeps = children();
    // SIGKILL to the init alone: its children would live on in the shared PID namespace.
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL to init");
    assert!(c.wait_for_status("host-pid", "STOPPED", Duration::from_secs(5)));
    eprintln!("STOPPED {:?} after the kill", killed.elapsed());
    assert!(
        wait_until(Duration::from_secs(2), || sleeps.iter().all(|&p| !alive(p))),
        "the init's children outlive it: {sleeps:?}"
    );
}

parity!(an_init_killed_in_a_shared_pid_namespace_takes_its_children, minor 183:
    an_init_killed_in_a_shared_pid_namespace_takes_its_children_under_runc,
    an_init_killed_in_a_shared_pid_namespace_takes_its_children_under_gpuplex);

fn an_exit_after_containerd_restarted_reaches_an_events_watcher(runtime: &str, minor: u32) {
    let Some(mut rig) = parity_rig(
        "an_exit_after_containerd_restarted_reaches_an_events_watcher",
        runtime,
        minor,
    ) else {
        return;
    };
    rig.containerd
        .run_detached(runtime, &[], "survivor", &["sleep", "1000"]);
    rig.containerd.restart();
    let c = &rig.containerd;
    let mut events = c
        .ctr_command()
        .arg("events")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ctr events");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let (seen, stream) = (std::sync::Arc::clone(&seen), events.stdout.take());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stream.expect("its stdout")).lines() {
                let Ok(line) = line else { break };
                let mut seen = seen.lock().expect("the events");
                seen.push_str(&line);
                seen.push('\n');
            }
        })
    };
    // `ctr events` subscribes a moment after it starts: a container's first events show when.
    let saw = |what: &str| seen.lock().expect("the events").contains(what);
    let subscribed = wait_until(Duration::from_secs(10), || {
        let _ = c.run(RUNC, &[], "marker", &["true"]);
        wait_until(Duration::from_millis(500), || saw("\"marker\""))
    });
    assert!(subscribed, "ctr events shows nothing");
    let out = c.kill("survivor", "SIGKILL");
    assert!(out.status.success(), "{}", text(&out));
    let exited = wait_until(Duration::from_secs(20), || {
        saw("/tasks/exit {\"container_id\":\"survivor\"")
    });
    let _ = events.kill();
    let _ = events.wait();
    let _ = reader.join();
    assert!(exited, "{}", seen.lock().expect("the events"));
}

parity!(an_exit_after_containerd_restarted_reaches_an_events_watcher, minor 184:
    an_exit_after_containerd_restarted_reaches_an_events_watcher_under_runc,
    an_exit_after_containerd_restarted_reaches_an_events_watcher_under_gpuplex);
