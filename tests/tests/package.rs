//! The Debian package (issue #18), installed on this machine (root): `cargo deb` packs the built
//! binaries (the debug ones: the package is the same but for them; `make deb` packs the release
//! ones), `apt-get install ./gpuplex_*.deb` installs it, and then only the installed files are
//! used. The node service is started as its unit says, with its conffile; containerd is wired in
//! by the installed `gpuplexctl install containerd` and restarted, and finds the installed shim
//! on its PATH; podman reads the installed hooks.d files from its default hooks directory.
//! Removing the package stops the service and thaws a container it held frozen; purging it
//! leaves nothing behind.
//!
//! The machine has no systemd running (a container's init): the package enables the unit but
//! cannot start it, and says so; the test starts the unit's `ExecStart` itself, as systemd would.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use gpuplex_integration::containerd::*;
use gpuplex_integration::*;

const PACKAGE: &str = "gpuplex";
const BINARIES: [&str; 6] = [
    "containerd-shim-gpuplex-v1",
    "gpuplex-hook",
    "gpuplexctl",
    "gpuplex-dra",
    "gpuplex-nri",
    "gpuplex-sim",
];
const CONFFILE: &str = "/etc/gpuplex/gpuplex.toml";
const HOOKS_DIR: &str = "/usr/share/containers/oci/hooks.d";
const UNIT: &str = "/usr/lib/systemd/system/gpuplex.service";
const ENABLED: &str = "/etc/systemd/system/multi-user.target.wants/gpuplex.service";
const SOCKET_UNIT: &str = "/usr/lib/systemd/system/gpuplex.socket";
const SOCKET_ENABLED: &str = "/etc/systemd/system/sockets.target.wants/gpuplex.socket";
const SOCKET: &str = "/run/gpuplex/gpuplex.sock";
const NRI_UNIT: &str = "/usr/lib/systemd/system/gpuplex-nri.service";
const NRI_ENABLED: &str = "/etc/systemd/system/multi-user.target.wants/gpuplex-nri.service";

/// Runs `command` with no input; its output.
fn output(command: &mut Command) -> Output {
    command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"))
}

/// Runs `command`, which must succeed; its stdout and stderr together.
fn ok(command: &mut Command) -> String {
    let out = output(command);
    assert!(out.status.success(), "{command:?}: {}", text(&out));
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn apt_get(args: &[&str]) -> Command {
    let mut c = Command::new("apt-get");
    c.args(["-y", "-q"])
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive");
    c
}

fn installed() -> bool {
    let out = output(Command::new("dpkg-query").args(["-W", "-f=${Status}", PACKAGE]));
    String::from_utf8_lossy(&out.stdout).contains("installed")
}

/// The package installed, and the node service this test started from its unit: on drop (a
/// failed assertion too) the service is stopped and the package purged.
struct Installed {
    service: Option<Child>,
    log: PathBuf,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(mut child) = self.service.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- node service log ---\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        let _ = output(Command::new("dpkg").args(["--purge", PACKAGE]));
    }
}

/// The `ExecStart` of the installed unit, split into words.
fn exec_start() -> Vec<String> {
    let unit = std::fs::read_to_string(UNIT).unwrap_or_else(|e| panic!("{UNIT}: {e}"));
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{UNIT} has no ExecStart: {unit}"));
    line.split_whitespace().map(str::to_string).collect()
}

/// Builds the package of the built binaries in `dir`; its path.
fn build_package(dir: &Path) -> PathBuf {
    for binary in BINARIES {
        bin(binary); // built, and not older than its sources
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let built = ok(Command::new(env!("CARGO"))
        .current_dir(&workspace)
        .args([
            "deb",
            "-p",
            "gpuplex-shim",
            "--no-build",
            "--profile",
            "dev",
        ])
        .args(["--fast", "--output"])
        .arg(dir));
    let debs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("gpuplex_") && name.ends_with(".deb")
        })
        .collect();
    assert_eq!(debs.len(), 1, "cargo deb made {debs:?}: {built}");
    debs.into_iter().next().unwrap()
}

/// The conffile an operator of a machine with one (fake) GPU writes: sockets and state where
/// the package's defaults put them; one window held for an hour, so that a second container
/// stays frozen.
fn write_config(dir: &Path) {
    let device = dir.join("fakegpu0");
    nix::sys::stat::mknod(
        &device,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(195, 236),
    )
    .expect("mknod");
    std::fs::write(
        CONFFILE,
        format!(
            "[scheduler]\nslice = \"1h\"\n\n[service]\nactivity = \"always\"\n\n[[fake_gpu]]\nuuid = \"GPU-fake-0\"\nmodel = \"Fake A100\"\nmemory = \"16Gi\"\ndevice = \"{}\"\n",
            device.display()
        ),
    )
    .unwrap();
}

/// Starts the unit's `ExecStart` as systemd would (no gpuplex variable in its environment), and
/// waits until it listens on the default socket.
fn start_service(log: &Path) -> Child {
    let words = exec_start();
    let log = std::fs::File::create(log).unwrap();
    let mut child = Command::new(&words[0])
        .args(&words[1..])
        .env_remove("GPUPLEX_CONFIG")
        .env_remove("GPUPLEX_SOCKET")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("the unit's ExecStart runs");
    let listening = wait_until(Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(SOCKET).is_ok()
    });
    if !listening {
        let _ = child.kill();
        panic!("the installed node service did not listen on {SOCKET} within 10 s");
    }
    child
}

#[test]
fn the_debian_package_installs_runs_containerd_and_podman_and_removes_cleanly() {
    let test = "the_debian_package_installs_runs_containerd_and_podman_and_removes_cleanly";
    if !can_run(test) || !can_run_containerd(test) {
        return;
    }
    assert!(
        output(Command::new("cargo-deb").arg("--version"))
            .status
            .success(),
        "cargo-deb is not installed; `make test` installs it (make cargo-deb)"
    );
    assert!(
        !installed(),
        "the gpuplex package is installed on this machine; this test installs its own build and purges it: remove it first (apt-get purge gpuplex)"
    );
    assert!(
        !Path::new("/etc/gpuplex").exists(),
        "/etc/gpuplex exists (make install?); this test installs the package's and purges it: move it away first"
    );
    let dir = tempfile::tempdir().unwrap();
    let deb = build_package(dir.path());

    // Installed with apt, as an operator does.
    let mut package = Installed {
        service: None,
        log: dir.path().join("service.log"),
    };
    let said = ok(apt_get(&["install"]).arg(&deb));
    if !Path::new("/run/systemd/system").exists() {
        assert!(said.contains("gpuplex: systemd is not running here: start the node service with /usr/bin/containerd-shim-gpuplex-v1 serve"), "{said}");
    }
    let files = ok(Command::new("dpkg").args(["-L", PACKAGE]));
    let listed: Vec<&str> = files.lines().collect();
    for binary in BINARIES {
        let path = format!("/usr/bin/{binary}");
        assert!(listed.contains(&path.as_str()), "{path} not in: {files}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755, "{path}");
    }
    for path in [
        CONFFILE,
        UNIT,
        SOCKET_UNIT,
        "/usr/share/gpuplex/containerd/config-v2.toml",
        "/usr/share/gpuplex/containerd/config-v3.toml",
        "/usr/share/gpuplex/runc-hooks.json",
        "/usr/share/gpuplex/kubernetes/gpuplex.yaml",
        "/usr/share/gpuplex/grafana/gpuplex-dashboard.json",
    ] {
        assert!(listed.contains(&path), "{path} not in: {files}");
    }
    let conffiles = ok(Command::new("dpkg-query").args(["-W", "-f=${Conffiles}", PACKAGE]));
    assert!(conffiles.contains(CONFFILE), "{conffiles}");
    // The unit runs the installed service, and is enabled (without systemd, by its links).
    assert_eq!(
        exec_start(),
        ["/usr/bin/containerd-shim-gpuplex-v1", "serve"]
    );
    for enabled in [ENABLED, SOCKET_ENABLED] {
        assert!(
            std::fs::symlink_metadata(enabled).is_ok(),
            "{enabled}: not enabled"
        );
    }
    // The NRI plugin's unit is there, and left for the operator to enable.
    assert!(Path::new(NRI_UNIT).exists(), "{NRI_UNIT} not installed");
    assert!(
        std::fs::symlink_metadata(NRI_ENABLED).is_err(),
        "{NRI_ENABLED}: enabled by the package"
    );
    // The socket unit listens where the service's default `service.socket` is.
    let socket_unit = std::fs::read_to_string(SOCKET_UNIT).unwrap();
    assert!(
        socket_unit.contains("ListenStream=/run/gpuplex/gpuplex.sock"),
        "{socket_unit}"
    );
    // podman's hooks call the installed hook, and gpuplexctl knows them as its own.
    for stage in ["precreate", "createRuntime", "poststop"] {
        let path = format!("{HOOKS_DIR}/gpuplex-{stage}.json");
        let hook: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(hook["hook"]["path"], "/usr/bin/gpuplex-hook", "{path}");
    }
    let podman_said = ok(Command::new("/usr/bin/gpuplexctl").args(["install", "podman"]));
    assert!(podman_said.contains("installed already"), "{podman_said}");

    // The operator describes the machine's GPU; the service starts as its unit says.
    write_config(dir.path());
    package.service = Some(start_service(&package.log));
    let service_pid = package.service.as_ref().unwrap().id();

    // containerd, wired in by the installed gpuplexctl, restarted, and finding the installed
    // shim on its PATH.
    let mut containerd = Containerd::start_with(Setup::default(), |config| {
        table_at_mut(config, &RUNTIMES_V2).remove("gpuplex");
    });
    let found = ok(Command::new("sh").args(["-c", "command -v containerd-shim-gpuplex-v1"]));
    assert_eq!(found.trim(), "/usr/bin/containerd-shim-gpuplex-v1");
    let config = containerd.dir.join("config.toml");
    let original = std::fs::read(&config).unwrap();
    let install = || {
        ok(Command::new("/usr/bin/gpuplexctl")
            .args(["install", "containerd", "--config"])
            .arg(&config))
    };
    let first = install();
    assert_eq!(first.lines().count(), 1, "{first}");
    assert!(first.contains("restart containerd"), "{first}");
    let wired = std::fs::read(&config).unwrap();
    assert_ne!(wired, original);
    let second = install();
    assert!(second.contains("nothing changed"), "{second}");
    assert_eq!(
        std::fs::read(&config).unwrap(),
        wired,
        "a second install changed it"
    );
    containerd.restart();
    let out = containerd.run(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=1Gi"],
        "from-the-package",
        &["cat", "/run/gpuplex/vgpu.json"],
    );
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out),
        containerd.log_tail()
    );
    let identity: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("the vGPU identity: {e}: {}", text(&out)));
    assert_eq!(identity["gpus"][0]["uuid"], "GPU-fake-0", "{identity}");
    assert_eq!(identity["gpus"][0]["memory"], 1u64 << 30, "{identity}");
    let uninstall = ok(Command::new("/usr/bin/gpuplexctl")
        .args(["uninstall", "containerd", "--config"])
        .arg(&config));
    assert_eq!(
        std::fs::read(&config).unwrap(),
        original,
        "uninstall did not restore the original byte for byte: {uninstall}"
    );
    drop(containerd);

    // podman, reading the installed hooks from where it reads hooks by default.
    let podman = Podman::with_default_hooks(&dir.path().join("podman"));
    let out = podman.run(
        &["--annotation", "gpuplex.io/gpu-memory=2Gi"],
        "cat /run/gpuplex/vgpu.json",
    );
    assert!(out.status.success(), "{}", text(&out));
    let identity: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("the vGPU identity: {e}: {}", text(&out)));
    assert_eq!(identity["gpus"][0]["memory"], 2u64 << 30, "{identity}");

    // Two containers on the one GPU: the second waits, frozen, for the hour-long window.
    let pids: Vec<u32> = ["first", "second"]
        .iter()
        .map(|name| {
            let id = podman.run_detached(
                &["--name", name, "--annotation", "gpuplex.io/gpu-memory=4Gi"],
                "sleep 600",
            );
            podman.init_pid(&id)
        })
        .collect();
    let one_frozen = wait_until(Duration::from_secs(5), || {
        pids.iter()
            .filter(|p| freezer_state(**p).as_deref() == Some("FROZEN"))
            .count()
            == 1
    });
    assert!(
        one_frozen,
        "{:?}",
        pids.iter().map(|p| freezer_state(*p)).collect::<Vec<_>>()
    );

    // Removal stops the service and leaves nothing frozen; the conffile stays.
    let removed = ok(&mut apt_get(&["remove", PACKAGE]));
    eprintln!("apt-get remove said:\n{removed}");
    assert!(
        removed.contains(&format!(
            "stopped the gpuplex node service (pid {service_pid})"
        )),
        "{removed}"
    );
    for pid in &pids {
        assert_eq!(freezer_state(*pid).as_deref(), Some("THAWED"), "{removed}");
    }
    let status = package.service.take().unwrap().wait().unwrap();
    assert!(status.success(), "the service stopped with {status}");
    assert!(!installed());
    assert!(!Path::new("/usr/bin/containerd-shim-gpuplex-v1").exists());
    assert!(Path::new(CONFFILE).exists(), "remove took the conffile");
    podman.remove_all();

    // Purge leaves nothing.
    ok(&mut apt_get(&["purge", PACKAGE]));
    for gone in [
        "/etc/gpuplex",
        "/run/gpuplex",
        UNIT,
        ENABLED,
        NRI_UNIT,
        SOCKET_UNIT,
        SOCKET_ENABLED,
        "/usr/share/gpuplex",
        HOOKS_DIR,
    ] {
        let left = std::fs::symlink_metadata(gone).is_ok()
            && (gone != HOOKS_DIR
                || std::fs::read_dir(gone).unwrap().any(|e| {
                    e.unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with("gpuplex-")
                }));
        assert!(!left, "{gone} is left after purge");
    }
}
