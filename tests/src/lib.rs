//! Fixtures for gpuplex's end-to-end tests with real container runtimes (root): the built
//! binaries, a busybox rootfs made from Debian's busybox-static, the node service with fake
//! GPUs, and podman and runc set up as they work on these machines
//! (../shared/notes/container-stack.md: vfs storage, cgroupfs, lowered ulimits).
//!
//! The binaries are found beside the test executable's directory (`target/<profile>/`), where
//! `cargo test --workspace` builds them; a missing one fails the test with what to run.

pub mod containerd;
pub mod cri;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Whether the test can run (root), saying loudly why not.
pub fn can_run(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: {test} needs root (podman, runc, cgroups, mknod); CI runs it as root");
        return false;
    }
    for tool in ["podman", "runc"] {
        if Command::new(tool).arg("--version").output().is_err() {
            panic!(
                "{test}: {tool} is not installed; `make test` installs it (apt-get install {tool})"
            );
        }
    }
    true
}

/// A gpuplex binary built by cargo.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run `cargo build --workspace` (or `make test`) first",
        path.display()
    );
    // `cargo test -p gpuplex-integration` does not rebuild the other packages' binaries: refuse
    // to test a binary older than the sources it is built from.
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // The crates each binary is built from.
    let crates: &[&str] = match name {
        "gpuplex-hook" => &["scheduler", "wire", "cgroup", "hook"],
        "gpuplexctl" => &["scheduler", "wire", "ctl"],
        "gpuplex-dra" => &["scheduler", "wire", "dra"],
        "gpuplex-nri" => &["scheduler", "wire", "cgroup", "hook", "nri"],
        "gpuplex-sim" => &["scheduler"],
        _ => &["scheduler", "wire", "cgroup", "hook", "node", "shim"],
    };
    for krate in crates {
        if let Some(newer) = newer_than(&root.join(krate).join("src"), built) {
            panic!(
                "{} is older than {}; run `cargo build --workspace` (or `make test`) first",
                path.display(),
                newer.display()
            );
        }
    }
    path
}

/// A source file under `dir` changed after `time`. Unit tests (`tests.rs`, `tests/`) and
/// fixtures are not built into a binary: a change to them does not make cargo build it again.
fn newer_than(dir: &Path, time: std::time::SystemTime) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if ["tests.rs", "tests", "fixtures"].iter().any(|n| name == *n) {
            continue;
        }
        let meta = entry.metadata().ok()?;
        if meta.is_dir() {
            if let Some(found) = newer_than(&path, time) {
                return Some(found);
            }
        } else if meta.modified().ok()? > time {
            return Some(path);
        }
    }
    None
}

/// Makes a busybox rootfs under `dir` from /bin/busybox (Debian's busybox-static).
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "/bin/busybox is missing: apt-get install busybox-static"
    );
    let root = dir.join("rootfs");
    for d in ["bin", "dev", "proc", "sys", "tmp", "etc", "run", "data"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "ls", "cat", "sleep", "echo", "stat", "id", "env", "test", "true", "false", "wc",
        "grep", "head", "date", "printf", "touch", "mkdir", "expr", "seq", "tr",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    root
}

/// A node service with fake GPUs, in a directory of its own.
pub struct NodeService {
    /// Its directory: config, socket, state, fake device nodes, log.
    pub dir: PathBuf,
    /// gpuplex.toml.
    pub config: PathBuf,
    /// The node socket.
    pub socket: PathBuf,
    /// The fake GPUs' device nodes, by index.
    pub devices: Vec<PathBuf>,
    child: Option<Child>,
}

impl NodeService {
    /// Starts one with `gpus` fake GPUs of 16 GiB, the `cpu` activity source and 50 ms slices,
    /// under `dir`; `minor` is the first device minor (distinct per test).
    pub fn start(dir: &Path, gpus: usize, minor: u32, extra: &str) -> NodeService {
        NodeService::start_sampling("cpu", dir, gpus, minor, extra)
    }

    /// The same with the `activity` source (`cpu`, `always`).
    pub fn start_sampling(
        activity: &str,
        dir: &Path,
        gpus: usize,
        minor: u32,
        extra: &str,
    ) -> NodeService {
        std::fs::create_dir_all(dir).unwrap();
        let mut fake = String::new();
        let mut devices = Vec::new();
        for i in 0..gpus {
            let path = dir.join(format!("gpuplexfake{}", minor + i as u32));
            let _ = std::fs::remove_file(&path);
            nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(195, (minor + i as u32) as u64),
            )
            .expect("mknod");
            fake.push_str(&format!(
                "[[fake_gpu]]\nuuid = \"GPU-fake-{i}\"\nmodel = \"Fake A100\"\nmemory = \"16Gi\"\ndevice = \"{}\"\n",
                path.display()
            ));
            devices.push(path);
        }
        let socket = dir.join("gpuplex.sock");
        let config = dir.join("gpuplex.toml");
        std::fs::write(
            &config,
            format!(
                "[scheduler]\nslice = \"50ms\"\nreservation_ttl = \"3s\"\n[service]\nsocket = \"{}\"\nstate_dir = \"{}\"\nactivity = \"{activity}\"\nsample_interval = \"25ms\"\n{extra}\n{fake}",
                socket.display(),
                dir.join("state").display()
            ),
        )
        .unwrap();
        let _ = std::fs::remove_file(dir.join("service.log"));
        let mut service = NodeService {
            dir: dir.to_path_buf(),
            config,
            socket,
            devices,
            child: None,
        };
        service.restart();
        service
    }

    /// Starts its process (again, after [`NodeService::stop`] or [`NodeService::kill9`]), and
    /// waits until it listens.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the node service runs already");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("service.log"))
            .unwrap();
        let child = Command::new(bin("containerd-shim-gpuplex-v1"))
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let started = Instant::now();
        while UnixStream::connect(&self.socket).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the node service did not start: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills its process with SIGKILL (its watchdog lives on).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("service.log")).unwrap_or_default()
    }

    /// Its status.
    pub fn status(&self) -> Value {
        let mut stream = UnixStream::connect(&self.socket).unwrap();
        stream.write_all(b"{\"op\":\"status\"}\n").unwrap();
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        let reply: Value = serde_json::from_str(&line).unwrap();
        reply["status"].clone()
    }

    /// The containers and reservations it holds, as `(containers, reservations)` counts.
    pub fn held(&self) -> (usize, usize) {
        let s = self.status();
        let n = |k: &str| s[k].as_array().map_or(0, Vec::len);
        (n("containers"), n("reservations"))
    }

    /// Stops it (SIGTERM).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
    }
}

impl Drop for NodeService {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- node service log ---\n{}", self.log());
        }
    }
}

/// The freezer state of the cgroup of `pid` in v1's words (`THAWED`, `FROZEN`, `FREEZING`), if
/// it has one: see [`FreezerProbe`].
pub fn freezer_state(pid: u32) -> Option<String> {
    FreezerProbe::of_pid(pid)?.state()
}

/// Where the freezer state of a process's cgroup is read, found once so that samples of several
/// cgroups read only their files, close together in time: its v1 freezer's `freezer.state`, else
/// (a pure cgroup v2 host) its cgroup2 cgroup's `cgroup.events` and `cgroup.freeze`.
pub enum FreezerProbe {
    /// The v1 freezer cgroup's directory.
    V1(PathBuf),
    /// The cgroup2 cgroup's directory.
    V2(PathBuf),
}

impl FreezerProbe {
    /// The probe of `pid`'s cgroup, if it has a freezer.
    pub fn of_pid(pid: u32) -> Option<FreezerProbe> {
        let cgroup = gpuplex_cgroup::ProcCgroup::of_pid(pid).ok()?;
        let mounts = gpuplex_cgroup::CgroupMounts::of_this_process().ok()?;
        if let Some(dir) = cgroup.freezer().and_then(|c| mounts.v1_dir("freezer", c)) {
            return Some(FreezerProbe::V1(dir));
        }
        mounts
            .unified_dir(cgroup.unified.as_deref()?)
            .map(FreezerProbe::V2)
    }

    /// The state in v1's words: on v2, `frozen 1` is `FROZEN`, asked but not yet frozen is
    /// `FREEZING`.
    pub fn state(&self) -> Option<String> {
        match self {
            FreezerProbe::V1(dir) => std::fs::read_to_string(dir.join("freezer.state"))
                .ok()
                .map(|s| s.trim().to_owned()),
            FreezerProbe::V2(dir) => {
                let events = std::fs::read_to_string(dir.join("cgroup.events")).ok()?;
                let asked = std::fs::read_to_string(dir.join("cgroup.freeze")).ok()?;
                let state = match (events.lines().any(|l| l == "frozen 1"), asked.trim() == "1") {
                    (true, _) => "FROZEN",
                    (false, true) => "FREEZING",
                    (false, false) => "THAWED",
                };
                Some(state.to_owned())
            }
        }
    }
}

/// podman with its storage in a directory of its own and gpuplex's hooks.d files pointing at
/// the built hook.
pub struct Podman {
    /// Its directory.
    pub dir: PathBuf,
    /// The busybox rootfs.
    pub rootfs: PathBuf,
}

impl Podman {
    /// Sets podman up under `dir`, with the hooks of `config/hooks.d` calling the built
    /// `gpuplex-hook --config <config>` (`None`: no gpuplex hooks).
    pub fn new(dir: &Path, gpuplex_config: Option<&Path>) -> Podman {
        Podman::set_up(dir, gpuplex_config, true)
    }

    /// Sets podman up under `dir` reading the hooks directories it reads by default
    /// (`/usr/share/containers/oci/hooks.d`, `/etc/containers/oci/hooks.d`): those of an
    /// installed package.
    pub fn with_default_hooks(dir: &Path) -> Podman {
        Podman::set_up(dir, None, false)
    }

    fn set_up(dir: &Path, gpuplex_config: Option<&Path>, own_hooks: bool) -> Podman {
        std::fs::create_dir_all(dir).unwrap();
        let hooks = dir.join("hooks.d");
        std::fs::create_dir_all(&hooks).unwrap();
        if let Some(config) = gpuplex_config {
            let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/hooks.d");
            for entry in std::fs::read_dir(source).unwrap() {
                let path = entry.unwrap().path();
                let mut hook: Value =
                    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                let stage = hook["stages"][0].as_str().unwrap().to_string();
                hook["hook"]["path"] = json!(bin("gpuplex-hook"));
                hook["hook"]["args"] = json!(["gpuplex-hook", "--config", config, stage]);
                std::fs::write(hooks.join(path.file_name().unwrap()), hook.to_string()).unwrap();
            }
        }
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=4096:4096\"]\n[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n{}",
                if own_hooks {
                    format!("hooks_dir = [\"{}\"]\n", hooks.display())
                } else {
                    String::new()
                }
            ),
        )
        .unwrap();
        let rootfs = busybox_rootfs(dir);
        Podman {
            dir: dir.to_path_buf(),
            rootfs,
        }
    }

    /// `podman <args>` with this setup.
    pub fn command(&self) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .args(["--storage-driver", "vfs"]);
        c
    }

    /// `podman run <mode>` of the busybox rootfs with `extra` options and `sh -c script`.
    fn run_as(&self, mode: &str, extra: &[&str], script: &str) -> Output {
        self.command()
            .args(["run", mode, "--runtime", "runc", "--network", "none"])
            .args(extra)
            .arg("--rootfs")
            .arg(&self.rootfs)
            .args(["sh", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `podman run --rm` of the busybox rootfs with `extra` options and `sh -c script`.
    pub fn run(&self, extra: &[&str], script: &str) -> Output {
        self.run_as("--rm", extra, script)
    }

    /// The same, detached: returns the container's id.
    pub fn run_detached(&self, extra: &[&str], script: &str) -> String {
        let out = self.run_as("-d", extra, script);
        assert!(out.status.success(), "podman run -d: {}", text(&out));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// The host pid of a container's init.
    pub fn init_pid(&self, id: &str) -> u32 {
        let out = self
            .command()
            .args(["inspect", "--format", "{{.State.Pid}}", id])
            .output()
            .unwrap();
        assert!(out.status.success(), "podman inspect: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// `podman exec <id> sh -c script`.
    pub fn exec(&self, id: &str, script: &str) -> Output {
        self.command()
            .args(["exec", id, "sh", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Removes every container it has, forcibly.
    pub fn remove_all(&self) {
        let _ = self.command().args(["rm", "-a", "-f", "-t", "0"]).output();
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        self.remove_all();
    }
}

/// What a container of the node's `status` holds, without its accounting (GPU time, windows,
/// waits, state), which moves with its own activity: its id, vGPU, GPUs, memory, weight and
/// priority. What another tenant's attack must leave unchanged.
pub fn holdings(container: &Value) -> Value {
    json!({
        "id": container["id"],
        "vgpu": container["vgpu"],
        "gpus": container["gpus"],
        "memory": container["memory"],
        "weight": container["weight"],
        "priority": container["priority"],
    })
}

/// An output's stdout and stderr, for messages.
pub fn text(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A busy loop for share tests: it counts its iterations and writes the count to `file` (a
/// path in the container) every 500, through a rename, so that a read never sees half of it.
pub fn counting_loop(file: &str) -> String {
    format!(
        "i=0; while :; do i=$((i+1)); if [ $((i % 500)) -eq 0 ]; then echo $i > {file}.tmp; mv {file}.tmp {file}; fi; done"
    )
}

/// The share of the iterations that the `heavy` one of two [`counting_loop`]s (`light` and
/// `heavy`) made over 8 s, counted from a second after both have counted; `count(name)` reads
/// a loop's count (0 before it has one). `None` when one has not counted within 5 s.
pub fn heavy_share(count: impl Fn(&str) -> f64) -> Option<f64> {
    if !wait_until(Duration::from_secs(5), || {
        count("light") > 0.0 && count("heavy") > 0.0
    }) {
        return None;
    }
    std::thread::sleep(Duration::from_secs(1));
    let (l0, h0) = (count("light"), count("heavy"));
    std::thread::sleep(Duration::from_secs(8));
    let (l, h) = (count("light") - l0, count("heavy") - h0);
    let share = h / (l + h);
    eprintln!("heavy got {share:.3} of the loop iterations (light {l}, heavy {h})");
    Some(share)
}

/// Waits until `check` holds, up to `within`.
pub fn wait_until(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
