//! A private containerd for gpuplex's end-to-end tests (root): its own root, state and sockets
//! under a temporary directory (../shared/notes/container-stack.md §7), gpuplex's runtime entry
//! as shipped in `config/containerd/config-v2.toml`, the built shim on its PATH, and `ctr` to
//! drive it. Each fixture uses a containerd namespace of its own, so runc's state
//! (`/run/containerd/runc/<namespace>`) and the containers' cgroups (`/<namespace>/<id>`) never
//! meet another test's.

mod cleanup;
mod config;
mod parity;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use config::{
    containerd_config, read_shipped_snippet, shipped_runtime_entry, shipped_snippet, table_at,
    table_at_mut, CRI_PLUGIN_V2, RUNTIMES_V2, RUNTIMES_V3,
};
pub use parity::{parity_rig, ParityRig};

use crate::{bin, busybox_rootfs, wait_until};

/// containerd's own runtime: runc through `containerd-shim-runc-v2`.
pub const RUNC: &str = "io.containerd.runc.v2";
/// gpuplex's runtime: `containerd-shim-gpuplex-v1`.
pub const GPUPLEX: &str = "io.containerd.gpuplex.v1";
/// The binary containerd looks up on its PATH for [`GPUPLEX`].
pub const GPUPLEX_SHIM: &str = "containerd-shim-gpuplex-v1";

/// Whether a containerd test can run (root), saying loudly why not.
pub fn can_run_containerd(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED: {test} needs root (containerd, runc, cgroups, mknod); CI runs it as root"
        );
        return false;
    }
    for tool in ["containerd", "ctr", "containerd-shim-runc-v2", "runc"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "{test}: {tool} is not installed; `make test` installs it (apt-get install containerd runc)"
        );
    }
    true
}

/// containerd's version as `containerd --version` says it (major, minor), if it says one.
pub fn containerd_version() -> Option<(u32, u32)> {
    let out = Command::new("containerd").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // `containerd github.com/containerd/containerd 1.7.24~ds1 <commit>` and the like.
    text.split_whitespace().find_map(|word| {
        let mut parts = word.trim_start_matches('v').split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        parts.next()?;
        Some((major, minor))
    })
}

/// Whether this machine's containerd applies CDI devices itself (1.7 and later, `enable_cdi`);
/// if not, says so loudly: `make test-hosts` runs such tests on Debian 13's containerd 1.7.
pub fn containerd_has_cdi(test: &str) -> bool {
    match containerd_version() {
        Some(version) if version >= (1, 7) => true,
        other => {
            eprintln!(
                "SKIPPED: {test} needs containerd 1.7 or later (CDI in its CRI plugin); this machine has {other:?}; make test-hosts runs it on Debian 13's containerd"
            );
            false
        }
    }
}

/// How to set a [`Containerd`] up.
#[derive(Clone, Debug, Default)]
pub struct Setup {
    /// gpuplex's configuration, for the shim (`$GPUPLEX_CONFIG` in containerd's environment,
    /// which containerd passes on to shims). `Some` also puts the built shim on containerd's
    /// PATH; `None` leaves it off, so tests of runc alone do not need it built.
    pub gpuplex_config: Option<PathBuf>,
    /// Load the CRI plugin (the Kubernetes path), with the settings these machines need
    /// (`config::cri_settings`); off, `ctr` is the only client.
    pub cri: bool,
}

/// One task as `ctr task ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    /// The container's id.
    pub id: String,
    /// Its init process on the host.
    pub pid: u32,
    /// `RUNNING`, `STOPPED`, `PAUSED`, `CREATED`, ...
    pub status: String,
}

/// A containerd of the test's own, stopped and cleaned up on drop.
pub struct Containerd {
    /// Its directory: config, sockets, root, state, opt, the shim's PATH entry, the rootfs, log.
    pub dir: PathBuf,
    /// A busybox rootfs for `ctr run --rootfs`.
    pub rootfs: PathBuf,
    /// The containerd namespace its `ctr` commands use.
    pub namespace: String,
    /// Its gRPC socket.
    pub socket: PathBuf,
    /// Whether its CRI plugin is loaded (its pods live in the `k8s.io` namespace).
    cri: bool,
    /// Its environment: PATH with the shim on it, and `$GPUPLEX_CONFIG` (`None`: removed).
    env: Vec<(String, Option<std::ffi::OsString>)>,
    child: Option<Child>,
}

static NEXT_NAMESPACE: AtomicU32 = AtomicU32::new(0);

impl Containerd {
    /// Starts one and waits until it answers `ctr version`.
    pub fn start(setup: Setup) -> Containerd {
        Containerd::start_with(setup, |_| {})
    }

    /// The same, with `edit` applied to the generated `config.toml` (for example the CRI
    /// plugin's `sandbox_image`) before containerd reads it.
    pub fn start_with(setup: Setup, edit: impl FnOnce(&mut toml::Table)) -> Containerd {
        // Found (and checked fresh) before anything is made that a failure would leave behind.
        let shim = setup.gpuplex_config.as_ref().map(|_| bin(GPUPLEX_SHIM));
        let dir = tempfile::Builder::new()
            .prefix("gpuplex-containerd-")
            .tempdir()
            .expect("a temporary directory")
            .keep();
        let path_dir = dir.join("bin");
        std::fs::create_dir_all(&path_dir).expect("the shim's PATH directory");
        if let Some(shim) = shim {
            std::os::unix::fs::symlink(shim, path_dir.join(GPUPLEX_SHIM))
                .expect("linking the gpuplex shim onto containerd's PATH");
        }
        let rootfs = busybox_rootfs(&dir);
        let config = dir.join("config.toml");
        let mut table = containerd_config(&dir, setup.cri);
        edit(&mut table);
        let text = toml::to_string(&table).expect("the containerd config serializes");
        std::fs::write(&config, text).expect("writing the containerd config");
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut env = vec![(
            "PATH".to_owned(),
            Some(
                std::env::join_paths(std::iter::once(path_dir).chain(std::env::split_paths(&path)))
                    .expect("a PATH"),
            ),
        )];
        env.push((
            "GPUPLEX_CONFIG".to_owned(),
            setup
                .gpuplex_config
                .as_ref()
                .map(|c| c.clone().into_os_string()),
        ));
        let mut containerd = Containerd {
            socket: dir.join("containerd.sock"),
            namespace: format!(
                "gpuplex-test-{}-{}",
                std::process::id(),
                NEXT_NAMESPACE.fetch_add(1, Ordering::SeqCst)
            ),
            rootfs,
            dir,
            cri: setup.cri,
            env,
            child: None,
        };
        containerd.spawn();
        if setup.cri {
            let plugins = containerd.ctr(&["plugins", "ls"]);
            let cri = String::from_utf8_lossy(&plugins.stdout)
                .lines()
                .find(|l| l.split_whitespace().nth(1) == Some("cri"))
                .map(str::to_string);
            assert!(
                cri.as_deref()
                    .is_some_and(|l| l.split_whitespace().last() == Some("ok")),
                "containerd's CRI plugin did not load: {cri:?}\n{}",
                containerd.log_tail()
            );
        }
        containerd
    }

    /// Starts the daemon (again: a restart keeps its root, state and containers) and waits
    /// until it answers.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("containerd.log"))
            .expect("containerd.log");
        let mut command = Command::new("containerd");
        command
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("containerd.log"))
            .stderr(log);
        for (key, value) in &self.env {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        self.child = Some(command.spawn().expect("containerd starts"));
        self.wait_ready();
    }

    /// Restarts containerd (SIGTERM, then a new daemon on the same root and state); the shims,
    /// and the containers they serve, live on.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            // ctr waits 10 s for a socket that is not there; ask once it is.
            if self.socket.exists() && self.ctr(&["version"]).status.success() {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "containerd did not answer within 10 s:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// containerd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// The last lines of its log, for messages.
    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// `ctr` with this containerd's socket and namespace; add the command and its arguments.
    pub fn ctr_command(&self) -> Command {
        self.ctr_command_in(&self.namespace)
    }

    /// `ctr` with this containerd's socket and `namespace` (the CRI plugin's is `k8s.io`).
    pub fn ctr_command_in(&self, namespace: &str) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.socket)
            .arg("--namespace")
            .arg(namespace);
        c
    }

    /// `ctr <args>` with no input.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("ctr runs")
    }

    /// `ctr run <flags>` of the busybox rootfs under `runtime`, with `annotations` (`key=value`)
    /// and `PATH=/bin`, as container `id` running `command`.
    pub fn run_command(
        &self,
        flags: &[&str],
        runtime: &str,
        annotations: &[&str],
        id: &str,
        command: &[&str],
    ) -> Command {
        let mut c = self.ctr_command();
        c.arg("run")
            .args(flags)
            .args(["--rootfs", "--env", "PATH=/bin", "--runtime", runtime]);
        for annotation in annotations {
            c.args(["--annotation", annotation]);
        }
        c.arg(&self.rootfs).arg(id).args(command);
        c
    }

    /// `ctr run --rm`, waiting for the container to exit; no input.
    pub fn run(&self, runtime: &str, annotations: &[&str], id: &str, command: &[&str]) -> Output {
        self.run_command(&["--rm"], runtime, annotations, id, command)
            .stdin(Stdio::null())
            .output()
            .expect("ctr runs")
    }

    /// `ctr run -d`: the container is left running.
    pub fn run_detached(&self, runtime: &str, annotations: &[&str], id: &str, command: &[&str]) {
        let out = self
            .run_command(&["-d"], runtime, annotations, id, command)
            .stdin(Stdio::null())
            .output()
            .expect("ctr runs");
        assert!(
            out.status.success(),
            "ctr run -d {id}: {}\n{}",
            crate::text(&out),
            self.log_tail()
        );
    }

    /// `ctr run --rm --tty` on a pseudo-terminal of its own (ctr needs its stdin to be a
    /// terminal): the exit status and everything the terminal showed.
    pub fn run_in_terminal(
        &self,
        runtime: &str,
        id: &str,
        command: &[&str],
    ) -> (ExitStatus, String) {
        let command = self.run_command(&["--rm", "--tty"], runtime, &[], id, command);
        in_terminal(command, None)
    }

    /// `ctr task exec --tty --exec-id <exec_id> <id> <command>` on a pseudo-terminal of
    /// `rows` × `cols`: the exit status and everything the terminal showed.
    pub fn exec_in_terminal(
        &self,
        id: &str,
        exec_id: &str,
        command: &[&str],
        (rows, cols): (u16, u16),
    ) -> (ExitStatus, String) {
        let mut ctr = self.ctr_command();
        ctr.args(["task", "exec", "--tty", "--exec-id", exec_id, id])
            .args(command);
        in_terminal(ctr, Some((rows, cols)))
    }

    /// `ctr task exec --exec-id <exec_id> <id> <command>`; no input.
    pub fn exec(&self, id: &str, exec_id: &str, command: &[&str]) -> Output {
        let mut args = vec!["task", "exec", "--exec-id", exec_id, id];
        args.extend_from_slice(command);
        self.ctr(&args)
    }

    /// `ctr task kill -s <signal> <id>`.
    pub fn kill(&self, id: &str, signal: &str) -> Output {
        self.ctr(&["task", "kill", "-s", signal, id])
    }

    /// `ctr task pause <id>`.
    pub fn pause(&self, id: &str) -> Output {
        self.ctr(&["task", "pause", id])
    }

    /// `ctr task resume <id>`.
    pub fn resume(&self, id: &str) -> Output {
        self.ctr(&["task", "resume", id])
    }

    /// The tasks `ctr task ls` shows.
    pub fn tasks(&self) -> Vec<Task> {
        let out = self.ctr(&["task", "ls"]);
        assert!(out.status.success(), "ctr task ls: {}", crate::text(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                Some(Task {
                    id: fields.next()?.to_string(),
                    pid: fields.next()?.parse().ok()?,
                    status: fields.next()?.to_string(),
                })
            })
            .collect()
    }

    /// The status `ctr task ls` shows for `id`'s task, if it has one.
    pub fn task_status(&self, id: &str) -> Option<String> {
        self.tasks()
            .into_iter()
            .find(|t| t.id == id)
            .map(|t| t.status)
    }

    /// Waits up to `within` for `id`'s task to show `status`; whether it did.
    pub fn wait_for_status(&self, id: &str, status: &str, within: Duration) -> bool {
        wait_until(within, || self.task_status(id).as_deref() == Some(status))
    }

    /// `ctr task rm <id>` (a stopped task) then `ctr container rm <id>`: the latter's output.
    pub fn remove(&self, id: &str) -> Output {
        let _ = self.ctr(&["task", "rm", id]);
        self.ctr(&["container", "rm", id])
    }

    /// The ids of its containers.
    pub fn containers(&self) -> Vec<String> {
        let out = self.ctr(&["container", "ls", "-q"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Kills and deletes every task and container.
    pub fn remove_all(&self) {
        for id in self.containers() {
            let _ = self.ctr(&["task", "rm", "--force", &id]);
            let _ = self.ctr(&["container", "rm", &id]);
        }
    }

    /// The same in the CRI plugin's namespace, behind the CRI's back: the last resort for pods a
    /// test did not remove through the CRI.
    fn remove_all_cri(&self) {
        let ctr = |args: &[&str]| {
            self.ctr_command_in(crate::cri::CRI_NAMESPACE)
                .args(args)
                .stdin(Stdio::null())
                .output()
        };
        let Ok(out) = ctr(&["container", "ls", "-q"]) else {
            return;
        };
        for id in String::from_utf8_lossy(&out.stdout).lines() {
            eprintln!("removing CRI container {id} left behind, with ctr");
            let _ = ctr(&["task", "rm", "--force", id]);
            let _ = ctr(&["container", "rm", id]);
        }
    }

    /// Stops containerd (SIGTERM, SIGKILL after 10 s). Shims outlive it: remove the tasks first.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let exited = wait_until(Duration::from_secs(10), || {
            child.try_wait().map_or(true, |s| s.is_some())
        });
        if !exited {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- containerd log (last lines) ---\n{}", self.log_tail());
        }
        self.remove_all();
        if self.cri {
            self.remove_all_cri();
        }
        self.stop();
        cleanup::remove_namespace_leftovers(&self.namespace);
        if self.cri {
            cleanup::remove_namespace_leftovers(crate::cri::CRI_NAMESPACE);
        }
        cleanup::unmount_and_remove(&self.dir);
    }
}

/// Runs `command` (ctr) on a pseudo-terminal of its own (ctr needs its stdin to be a terminal),
/// of `size` rows × columns if given: the exit status and everything the terminal showed.
fn in_terminal(mut command: Command, size: Option<(u16, u16)>) -> (ExitStatus, String) {
    let size = size.map(|(rows, cols)| nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    });
    let pty = nix::pty::openpty(size.as_ref(), None).expect("a pseudo-terminal");
    let slave = |what: &str| {
        Stdio::from(
            pty.slave
                .try_clone()
                .unwrap_or_else(|e| panic!("the terminal for ctr's {what}: {e}")),
        )
    };
    command
        .stdin(slave("stdin"))
        .stdout(slave("stdout"))
        .stderr(slave("stderr"));
    let mut child = command.spawn().expect("ctr runs");
    // Only ctr may hold the terminal, so that reading ends when it exits.
    drop(command);
    drop(pty.slave);
    let mut master = std::fs::File::from(pty.master);
    let mut shown = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match master.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => shown.extend_from_slice(&buf[..n]),
            // Linux answers EIO once the last holder of the other end closed it.
            Err(e) if e.raw_os_error() == Some(nix::libc::EIO) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("reading ctr's terminal: {e}"),
        }
    }
    let status = child.wait().expect("ctr exits");
    (status, String::from_utf8_lossy(&shown).into_owned())
}

/// The shim daemons of `binary` (a file name: `containerd-shim-gpuplex-v1`), not their `start`
/// or `delete` runs nor the node service, each with the container id it was started for.
pub fn shim_daemons(binary: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_shim = args
            .first()
            .is_some_and(|a| Path::new(a).file_name().is_some_and(|n| n == binary));
        let one_shot = args.last().is_some_and(|a| a == "start" || a == "delete");
        let service = args.get(1).is_some_and(|a| a == "serve" || a == "watchdog");
        if !is_shim || one_shot || service {
            continue;
        }
        if let Some(i) = args.iter().position(|a| a == "-id") {
            if let Some(id) = args.get(i + 1) {
                found.push((pid, id.clone()));
            }
        }
    }
    found
}

/// The shim daemon of `runtime` that serves container `id`.
pub fn shim_daemon(runtime: &str, id: &str) -> Option<u32> {
    let binary = if runtime == GPUPLEX {
        GPUPLEX_SHIM
    } else {
        "containerd-shim-runc-v2"
    };
    shim_daemons(binary)
        .into_iter()
        .find(|(_, served)| served == id)
        .map(|(pid, _)| pid)
}
