//! gpuplex as a containerd runtime (`io.containerd.gpuplex.v1`), driven with `ctr` against a
//! private containerd (root): parity with containerd's own `io.containerd.runc.v2`. Each check
//! runs twice, under runc and under gpuplex (with the node service on a fake GPU), with the same
//! expectations: for a container that asks for no vGPU, the gpuplex shim must be
//! indistinguishable from runc's. What gpuplex adds is held in `containerd_vgpu.rs`.

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use gpuplex_integration::containerd::*;
use gpuplex_integration::parity;
use gpuplex_integration::*;

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn exit_code_comes_back(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("exit_code_comes_back", runtime, minor) else {
        return;
    };
    let out = rig
        .containerd
        .run(runtime, &[], "exit-code", &["sh", "-c", "exit 3"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
}

parity!(exit_code_comes_back, minor 240:
    exit_code_comes_back_under_runc, exit_code_comes_back_under_gpuplex);

fn stdout_and_stderr_arrive_apart(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("stdout_and_stderr_arrive_apart", runtime, minor) else {
        return;
    };
    let out = rig.containerd.run(
        runtime,
        &[],
        "streams",
        &["sh", "-c", "echo out; echo err >&2"],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(stdout(&out), "out\n", "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "err\n",
        "{}",
        text(&out)
    );
}

parity!(stdout_and_stderr_arrive_apart, minor 241:
    stdout_and_stderr_arrive_apart_under_runc, stdout_and_stderr_arrive_apart_under_gpuplex);

fn exec_runs_in_a_running_container(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("exec_runs_in_a_running_container", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "exec", &["sleep", "1000"]);
    let out = c.exec("exec", "e1", &["sh", "-c", "echo hi; exit 5"]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
    assert_eq!(stdout(&out), "hi\n", "{}", text(&out));
    // The exec id is free again once its process is gone.
    let out = c.exec("exec", "e1", &["true"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(c.task_status("exec").as_deref(), Some("RUNNING"));
}

parity!(exec_runs_in_a_running_container, minor 242:
    exec_runs_in_a_running_container_under_runc, exec_runs_in_a_running_container_under_gpuplex);

fn kill_stops_the_task(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("kill_stops_the_task", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "killed", &["sleep", "1000"]);
    assert_eq!(c.task_status("killed").as_deref(), Some("RUNNING"));
    let out = c.kill("killed", "SIGKILL");
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        c.wait_for_status("killed", "STOPPED", Duration::from_secs(5)),
        "{:?}",
        c.tasks()
    );
    let out = c.remove("killed");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(c.tasks(), []);
    assert_eq!(c.containers(), Vec::<String>::new());
}

parity!(kill_stops_the_task, minor 243:
    kill_stops_the_task_under_runc, kill_stops_the_task_under_gpuplex);

fn pause_and_resume(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("pause_and_resume", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "paused", &["sleep", "1000"]);
    let out = c.pause("paused");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(c.task_status("paused").as_deref(), Some("PAUSED"));
    let out = c.resume("paused");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(c.task_status("paused").as_deref(), Some("RUNNING"));
}

parity!(pause_and_resume, minor 244:
    pause_and_resume_under_runc, pause_and_resume_under_gpuplex);

fn stdin_reaches_the_container(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("stdin_reaches_the_container", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    let mut child = c
        .run_command(&["--rm"], runtime, &[], "stdin", &["cat"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr runs");
    // ctr closes the task's stdin at end of input only once it has created the task; input
    // that ends sooner leaves `cat` waiting for ever. Write once the task runs.
    assert!(
        c.wait_for_status("stdin", "RUNNING", Duration::from_secs(10)),
        "{:?}",
        c.tasks()
    );
    let mut stdin = child.stdin.take().expect("ctr's stdin");
    stdin.write_all(b"hello\n").expect("writing to ctr");
    drop(stdin);
    // At the end of its input ctr asks the shim to close the task's stdin (CloseIO); were it
    // not closed, `cat` would never end.
    let ended = wait_until(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !ended {
        let _ = c.kill("stdin", "SIGKILL");
    }
    let out = child.wait_with_output().expect("ctr exits");
    assert!(
        ended,
        "cat did not see the end of its input: {}",
        text(&out)
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(stdout(&out), "hello\n", "{}", text(&out));
}

parity!(stdin_reaches_the_container, minor 245:
    stdin_reaches_the_container_under_runc, stdin_reaches_the_container_under_gpuplex);

fn a_terminal_reaches_the_container(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("a_terminal_reaches_the_container", runtime, minor) else {
        return;
    };
    let (status, shown) =
        rig.containerd
            .run_in_terminal(runtime, "tty", &["sh", "-c", "tty; echo hi; exit 4"]);
    assert_eq!(status.code(), Some(4), "{status}: {shown:?}");
    // Line ends carry a `\r` from each terminal on the way; the text is what matters.
    let lines: Vec<&str> = shown.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert!(
        lines.iter().any(|l| l.starts_with("/dev/pts/")),
        "{shown:?}"
    );
    assert!(lines.contains(&"hi"), "{shown:?}");
}

parity!(a_terminal_reaches_the_container, minor 246:
    a_terminal_reaches_the_container_under_runc, a_terminal_reaches_the_container_under_gpuplex);

fn metrics_and_processes_are_reported(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig("metrics_and_processes_are_reported", runtime, minor) else {
        return;
    };
    let c = &rig.containerd;
    c.run_detached(runtime, &[], "measured", &["sleep", "1000"]);
    // containerd promises metrics for a running task, not at the instant it starts: runc's
    // shim may answer "no metrics received" until it has loaded the task's cgroups. Ask again
    // until the first answer with metrics, as a client polling a new task would.
    let mut shown = String::new();
    let answered = wait_until(Duration::from_secs(10), || {
        let out = c.ctr(&["task", "metrics", "measured"]);
        shown = format!("{}\n{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
        out.status.success() && metric_names(&shown).len() > 1
    });
    assert!(answered, "no metrics within 10 s: {shown}");
    // The same metrics as runc's shim, each with a value.
    let metrics = metric_names(&shown);
    let expected = [
        "memory.usage_in_bytes",
        "memory.limit_in_bytes",
        "memory.stat.cache",
        "cpuacct.usage",
        "cpuacct.usage_percpu",
        "pids.current",
        "pids.limit",
    ];
    assert_eq!(metrics, expected, "{shown}");
    let usage = shown
        .lines()
        .find(|l| l.starts_with("memory.usage_in_bytes"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(usage > Some(0), "{shown}");
    // `ctr task ps`: the container's one process, its init.
    let out = c.ctr(&["task", "ps", "measured"]);
    assert!(out.status.success(), "{}", text(&out));
    let pid = c
        .tasks()
        .into_iter()
        .find(|t| t.id == "measured")
        .map(|t| t.pid);
    let listed: Vec<u32> = stdout(&out)
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(
        listed,
        pid.into_iter().collect::<Vec<_>>(),
        "{}",
        stdout(&out)
    );
}

/// The metrics `ctr task metrics` lists, by name.
fn metric_names(shown: &str) -> Vec<&str> {
    shown
        .lines()
        .skip_while(|l| !l.starts_with("METRIC"))
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

parity!(metrics_and_processes_are_reported, minor 247:
    metrics_and_processes_are_reported_under_runc, metrics_and_processes_are_reported_under_gpuplex);

fn task_events_arrive_in_order_with_an_oom_kill(runtime: &str, minor: u32) {
    let Some(rig) = parity_rig(
        "task_events_arrive_in_order_with_an_oom_kill",
        runtime,
        minor,
    ) else {
        return;
    };
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
    let saw = |what: &str| seen.lock().expect("the events").contains(what);
    // `ctr events` subscribes a moment after it starts: a first container shows when it has.
    let subscribed = wait_until(Duration::from_secs(10), || {
        let _ = c.run(runtime, &[], "warmup", &["true"]);
        wait_until(Duration::from_millis(500), || saw("\"warmup\""))
    });
    assert!(subscribed, "ctr events shows nothing");
    // A string that doubles until the 32 MiB limit kills the shell, once the test says so: an
    // OOM is reported only once the shim watches the task's memory cgroup, which containerd's
    // runc shim starts at Start, just before it publishes /tasks/start. A kill before that
    // would go unreported by either shim.
    let go = format!("oom-go-{}", std::process::id());
    let script =
        format!("while [ ! -e /tmp/{go} ]; do sleep 0.05; done; a=x; while :; do a=$a$a; done");
    let mut run = c
        .run_command(
            &["--rm", "--memory-limit", "33554432"],
            runtime,
            &[],
            "oom",
            &["sh", "-c", &script],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr runs");
    let started = wait_until(Duration::from_secs(10), || {
        saw("/tasks/start {\"container_id\":\"oom\"")
    });
    let trigger = c.rootfs.join("tmp").join(&go);
    std::fs::create_dir_all(c.rootfs.join("tmp")).expect("the rootfs's /tmp");
    std::fs::write(&trigger, b"").expect("the trigger file");
    let ended = wait_until(Duration::from_secs(20), || {
        matches!(run.try_wait(), Ok(Some(_)))
    });
    if !ended {
        let _ = c.kill("oom", "SIGKILL");
    }
    let out = run.wait_with_output().expect("ctr exits");
    let _ = std::fs::remove_file(&trigger);
    assert!(started, "no /tasks/start for the container");
    assert!(
        ended,
        "the container was not killed within 20 s: {}",
        text(&out)
    );
    assert_eq!(out.status.code(), Some(137), "{}", text(&out));
    // The kernel may report one OOM more than once, and a shim publishes the OOM and the exit
    // from different watchers: wait for both the delete and at least one OOM.
    let reported = wait_until(Duration::from_secs(5), || {
        saw("/tasks/delete {\"container_id\":\"oom\"")
            && saw("/tasks/oom {\"container_id\":\"oom\"")
    });
    let _ = events.kill();
    let _ = events.wait();
    let _ = reader.join();
    let seen = seen.lock().expect("the events").clone();
    assert!(reported, "{seen}");
    let topics: Vec<String> = seen
        .lines()
        .filter(|l| l.contains("\"container_id\":\"oom\""))
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("/tasks/")))
        .map(str::to_owned)
        .collect();
    // What containerd promises, under both shims: every step of the task's life once and in
    // order, and its OOM (once or more, before or after the exit) after its start.
    let steps: Vec<&str> = topics
        .iter()
        .map(String::as_str)
        .filter(|t| *t != "/tasks/oom")
        .collect();
    assert_eq!(
        steps,
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exit",
            "/tasks/delete"
        ],
        "{seen}"
    );
    let start = topics.iter().position(|t| t == "/tasks/start");
    let first_oom = topics.iter().position(|t| t == "/tasks/oom");
    assert!(first_oom > start, "an OOM before the start: {seen}");
}

parity!(task_events_arrive_in_order_with_an_oom_kill, minor 248:
    task_events_arrive_in_order_with_an_oom_kill_under_runc,
    task_events_arrive_in_order_with_an_oom_kill_under_gpuplex);
