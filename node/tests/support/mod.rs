//! What the node service's integration tests share: a service process with its own config,
//! socket and state in a temporary directory, fake GPU device nodes, cgroups with busy
//! processes in them, and the CPU time those processes got.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuplex_cgroup::{FreezerVersion, Hierarchies};
use serde_json::{json, Value};

/// Tests that measure CPU shares must not run at the same time on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

/// Takes the lock that keeps the timing-sensitive tests of this binary apart.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the tests can run: root, with a freezer. Says loudly why not.
pub fn can_run(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: {test} needs root (cgroups, mknod); run the tests as root, as CI does");
        return false;
    }
    true
}

/// The cgroup hierarchies of this machine.
pub fn hierarchies() -> Hierarchies {
    Hierarchies::of_this_machine().expect("cgroup hierarchies")
}

/// The root of the hierarchy whose freezer is `version` (the mount itself).
pub fn freezer_root(version: FreezerVersion) -> PathBuf {
    let h = hierarchies();
    match version {
        FreezerVersion::V1 => h.freezer,
        FreezerVersion::V2 => h.unified,
    }
    .expect("the hierarchy of a cgroup this test made")
}

/// A node service under test.
pub struct NodeService {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub log: PathBuf,
    pub child: Option<Child>,
    pub devices: Vec<PathBuf>,
}

/// The options a test sets in gpuplex.toml.
pub struct Setup {
    pub gpus: usize,
    pub memory: &'static str,
    pub slice: &'static str,
    pub sample_interval: &'static str,
    pub reservation_ttl: &'static str,
    pub activity: &'static str,
    pub extra_service: String,
    /// The `[policy]` table's lines.
    pub policy: &'static str,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            gpus: 1,
            memory: "16Gi",
            slice: "50ms",
            sample_interval: "25ms",
            reservation_ttl: "60s",
            activity: "cpu",
            extra_service: String::new(),
            policy: "",
        }
    }
}

static NEXT_MINOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl NodeService {
    /// Writes the config, makes the fake GPUs' nodes and starts the service.
    pub fn start(setup: Setup) -> NodeService {
        let dir = tempfile::tempdir().unwrap();
        let mut devices = Vec::new();
        let mut fake = String::new();
        for i in 0..setup.gpus {
            let path = dir.path().join(format!("fakegpu{i}"));
            let minor = 200 + NEXT_MINOR.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 50;
            nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(195, minor as u64),
            )
            .expect("mknod");
            fake.push_str(&format!(
                "[[fake_gpu]]\nuuid = \"GPU-fake-{i}\"\nmodel = \"Fake A100\"\nmemory = \"{}\"\ndevice = \"{}\"\n\n",
                setup.memory,
                path.display()
            ));
            devices.push(path);
        }
        let socket = dir.path().join("gpuplex.sock");
        let config = dir.path().join("gpuplex.toml");
        let text = format!(
            "[scheduler]\nslice = \"{}\"\nreservation_ttl = \"{}\"\n\n[policy]\n{}\n\n[service]\nsocket = \"{}\"\nstate_dir = \"{}\"\nactivity = \"{}\"\nsample_interval = \"{}\"\nnode_name = \"testnode\"\n{}\n\n{fake}",
            setup.slice,
            setup.reservation_ttl,
            setup.policy,
            socket.display(),
            dir.path().join("state").display(),
            setup.activity,
            setup.sample_interval,
            setup.extra_service,
        );
        std::fs::write(&config, text).unwrap();
        let log = dir.path().join("service.log");
        let mut service = NodeService {
            dir,
            config,
            socket,
            log,
            child: None,
            devices,
        };
        service.spawn();
        service
    }

    /// Starts (or starts again) the service process and waits for its socket.
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("GPUPLEX_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start the node service");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.as_mut().unwrap().try_wait() {
                panic!("the node service exited with {status}: {}", self.log_text());
            }
            if UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "the node service did not listen within 10 s: {}",
            self.log_text()
        );
    }

    /// Starts the service as systemd's socket activation does (`gpuplex.socket`): `listener`
    /// as fd 3, `LISTEN_FDS=1` and `LISTEN_PID` its own pid (a shell exports them and execs the
    /// service, keeping its pid). Does not wait: the listener answers connections already.
    /// (Any socket may be passed, to see the service refuse one.)
    pub fn spawn_activated(&mut self, listener: &impl std::os::unix::io::AsRawFd) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let fd = listener.as_raw_fd();
        let mut command = Command::new("sh");
        command
            .args(["-c", "export LISTEN_PID=$$ LISTEN_FDS=1; exec \"$@\"", "sh"])
            .arg(gpuplex_integration::bin("containerd-shim-gpuplex-v1"))
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("GPUPLEX_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: dup2 and fcntl are async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(move || {
                let ok = if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0) == 0
                } else {
                    libc::dup2(fd, 3) == 3
                };
                if ok {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        self.child = Some(command.spawn().expect("start the node service"));
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// The pid of the watchdog the running service started (from its log).
    pub fn watchdog_pid(&self) -> u32 {
        let log = self.log_text();
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains("watchdog: pid ") || l.contains("started again as pid "))
            .unwrap_or_else(|| panic!("no watchdog in the log: {log}"));
        let after = line.rsplit("pid ").next().unwrap();
        after
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One request, one reply.
    pub fn ask(&self, request: &Value) -> Value {
        self.ask_line(&request.to_string())
    }

    /// One raw line, one reply. A write error is not one: the service answers a line over
    /// the size bound and closes the connection before the client has written all of it.
    pub fn ask_line(&self, line: &str) -> Value {
        let mut stream = UnixStream::connect(&self.socket).expect("connect");
        let _ = stream
            .write_all(line.as_bytes())
            .and_then(|()| stream.write_all(b"\n"));
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("reply {reply:?}: {e}"))
    }

    pub fn status(&self) -> Value {
        let reply = self.ask(&json!({"op": "status"}));
        assert_eq!(reply["ok"], true, "{reply}");
        reply["status"].clone()
    }

    /// The status entry of a container.
    pub fn container(&self, id: &str) -> Option<Value> {
        self.status()["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["container"] == id || c["id"] == id)
            .cloned()
    }

    /// Registers a cgroup; panics with the reply when refused.
    /// Without a `gpuplex.io/gpu-memory` annotation, asks for 4Gi so that several fit.
    pub fn register(&self, id: &str, cgroup: &TestCgroup, mut annotations: Value) -> Value {
        if annotations.get("gpuplex.io/gpu-memory").is_none() {
            annotations["gpuplex.io/gpu-memory"] = json!("4Gi");
        }
        let reply = self.ask(&json!({
            "op": "register",
            "container": id,
            "cgroup": cgroup.path.to_str().unwrap(),
            "annotations": annotations,
        }));
        assert_eq!(reply["ok"], true, "register {id}: {reply}");
        reply
    }

    pub fn kill9(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        child.wait().unwrap()
    }
}

impl Drop for NodeService {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- node service log ---\n{}", self.log_text());
        }
    }
}

/// A cgroup the test made, with the processes it started in it.
pub struct TestCgroup {
    pub path: PathBuf,
    pub version: FreezerVersion,
    pub children: Vec<Child>,
}

impl TestCgroup {
    /// Makes a cgroup named after the test under the v1 freezer or the cgroup2 mount; on a
    /// machine with only one of them (a pure cgroup v2 host: `make test-hosts`), under that one,
    /// whatever `version` asks.
    pub fn new(version: FreezerVersion, name: &str) -> TestCgroup {
        let h = hierarchies();
        let (root, version) = match (version, h.freezer, h.unified) {
            (FreezerVersion::V1, Some(v1), _) | (FreezerVersion::V2, Some(v1), None) => {
                (v1, FreezerVersion::V1)
            }
            (_, _, Some(v2)) => (v2, FreezerVersion::V2),
            (_, None, None) => panic!("this machine has neither a v1 freezer nor a cgroup2 mount"),
        };
        let path = root.join(format!("gpuplex-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir(&path);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TestCgroup {
            path,
            version,
            children: Vec::new(),
        }
    }

    /// A cgroup inside `parent`.
    pub fn nested(parent: &TestCgroup, name: &str) -> TestCgroup {
        let path = parent.path.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TestCgroup {
            path,
            version: parent.version,
            children: Vec::new(),
        }
    }

    /// Moves a process into the cgroup.
    pub fn adopt(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("move {pid} into {}: {e}", self.path.display()));
    }

    /// Moves a process back to the hierarchy's root cgroup.
    pub fn release(&self, pid: u32) {
        let root = self.path.ancestors().find(|p| {
            p.parent()
                .is_some_and(|up| !up.join("cgroup.procs").exists())
        });
        if let Some(root) = root {
            let _ = std::fs::write(root.join("cgroup.procs"), pid.to_string());
        }
    }

    /// Starts `sh -c script` in the cgroup; returns its pid.
    pub fn spawn(&mut self, script: &str) -> u32 {
        let child = Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string()).unwrap();
        self.children.push(child);
        pid
    }

    /// Starts a busy loop in the cgroup.
    pub fn spawn_busy(&mut self) -> u32 {
        self.spawn("while :; do :; done")
    }

    /// Whether the kernel says it is frozen now.
    pub fn is_frozen(&self) -> bool {
        match self.version {
            FreezerVersion::V1 => std::fs::read_to_string(self.path.join("freezer.state"))
                .map(|s| s.trim() == "FROZEN")
                .unwrap_or(false),
            FreezerVersion::V2 => std::fs::read_to_string(self.path.join("cgroup.events"))
                .map(|s| s.lines().any(|l| l == "frozen 1"))
                .unwrap_or(false),
        }
    }

    /// CPU time of the processes it started.
    pub fn cpu(&self) -> Duration {
        self.children.iter().map(|c| process_cpu(c.id())).sum()
    }

    pub fn kill_all(&mut self) {
        self.thaw();
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Thaws it through its freezer, as `runc resume` does.
    pub fn thaw(&self) {
        let _ = match self.version {
            FreezerVersion::V1 => std::fs::write(self.path.join("freezer.state"), "THAWED"),
            FreezerVersion::V2 => std::fs::write(self.path.join("cgroup.freeze"), "0"),
        };
    }

    /// Freezes it through its freezer, as `runc pause` does, and waits until the kernel says
    /// it is frozen.
    pub fn freeze(&self) {
        match self.version {
            FreezerVersion::V1 => std::fs::write(self.path.join("freezer.state"), "FROZEN"),
            FreezerVersion::V2 => std::fs::write(self.path.join("cgroup.freeze"), "1"),
        }
        .unwrap_or_else(|e| panic!("freeze {}: {e}", self.path.display()));
        assert!(
            wait_until(Duration::from_secs(2), || self.is_frozen()).is_some(),
            "{} did not freeze",
            self.path.display()
        );
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A process's CPU time, all its threads together, from its CPU clock (zero once it is gone).
pub fn process_cpu(pid: u32) -> Duration {
    use nix::time::{clock_gettime, ClockId};
    ClockId::pid_cpu_clock_id(nix::unistd::Pid::from_raw(pid as i32))
        .and_then(clock_gettime)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Waits until `check` holds, up to `within`; returns how long it took.
pub fn wait_until(within: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if check() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// The path of a file under the service's directory.
pub fn under(service: &NodeService, name: &str) -> PathBuf {
    service.dir.path().join(name)
}

/// Whether a path is a socket with mode 0600.
pub fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}
