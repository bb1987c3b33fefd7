//! A real runc container held inside its `createRuntime` hook, for the injection tests.
//!
//! The bundle's rootfs is busybox; the hook is a shell script that saves the OCI state it gets
//! on stdin and then waits for a `go` file, so the test calls the injection functions while
//! runc is paused exactly where `gpuplex-hook` would run. Each container has its own tempdir
//! and its own runc `--root`, so tests run in parallel; dropping it deletes the container.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use gpuplex_wire::protocol::cdi::CdiDeviceNode;
use serde_json::{json, Value};

/// The runc binary the tests use.
pub const RUNC: &str = "/usr/sbin/runc";

const APPLETS: &[&str] = &[
    "sh", "ls", "cat", "stat", "sleep", "test", "echo", "mount", "grep",
];

/// True (after saying so on stderr) when the test cannot run: it needs root and runc.
pub fn skip(test: &str) -> bool {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("SKIPPED: {test} needs root");
        return true;
    }
    if !Path::new(RUNC).exists() || !Path::new("/bin/busybox").exists() {
        eprintln!("SKIPPED: {test} needs {RUNC} and /bin/busybox (busybox-static)");
        return true;
    }
    false
}

/// A container that runc is creating, paused in its `createRuntime` hook until [`Self::resume`].
pub struct Container {
    /// Everything of this container: rootfs, bundle, runc root, hook files.
    pub dir: tempfile::TempDir,
    /// The container id.
    pub id: String,
    /// The rootfs, as the host names it.
    pub rootfs: PathBuf,
    /// The container's init pid, from the state the hook got.
    pub pid: u32,
    create: Option<Child>,
}

impl Container {
    /// Builds a busybox bundle whose process is `sleep 1000`, lets `edit` change its
    /// config.json, and runs `runc create` until it is inside the `createRuntime` hook.
    pub fn paused(test: &str, edit: impl FnOnce(&mut Value)) -> Container {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = tempfile::Builder::new()
            .prefix("gpuplex-inject-")
            .tempdir()
            .unwrap();
        let id = format!(
            "gpuplex-{test}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let rootfs = dir.path().join("rootfs");
        for sub in ["bin", "dev", "proc", "sys", "tmp", "etc"] {
            fs::create_dir_all(rootfs.join(sub)).unwrap();
        }
        fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
        for applet in APPLETS {
            symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
        let hook = dir.path().join("hook.sh");
        let state = dir.path().join("state.json");
        fs::write(
            &hook,
            format!(
                "#!/bin/sh\ncat > '{state}.tmp' && mv '{state}.tmp' '{state}'\ni=0\n\
                 while [ ! -e '{go}' ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 1; sleep 0.05; done\n",
                state = state.display(),
                go = dir.path().join("go").display(),
            ),
        )
        .unwrap();
        fs::set_permissions(&hook, fs::Permissions::from_mode(0o755)).unwrap();
        let bundle = dir.path().join("bundle");
        fs::create_dir(&bundle).unwrap();
        run(Command::new(RUNC).arg("spec").arg("--bundle").arg(&bundle));
        let config_path = bundle.join("config.json");
        let mut config: Value = serde_json::from_slice(&fs::read(&config_path).unwrap()).unwrap();
        config["root"] = json!({ "path": rootfs, "readonly": false });
        config["process"]["terminal"] = json!(false);
        config["process"]["args"] = json!(["sleep", "1000"]);
        config["hooks"] = json!({ "createRuntime": [{ "path": hook, "timeout": 90 }] });
        edit(&mut config);
        fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        let log = fs::File::create(dir.path().join("create.log")).unwrap();
        let create = Command::new(RUNC)
            .arg("--root")
            .arg(dir.path().join("runc"))
            .args(["create", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut container = Container {
            dir,
            id,
            rootfs,
            pid: 0,
            create: Some(create),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !state.exists() {
            if let Some(status) = container.create.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "runc create ended ({status}) before the hook: {}",
                    container.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the hook never ran: {}",
                container.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let state: Value = serde_json::from_slice(&fs::read(&state).unwrap()).unwrap();
        container.pid = state["pid"].as_u64().expect("a pid in the hook's state") as u32;
        container
    }

    /// Lets the hook return and waits for `runc create` to succeed.
    pub fn resume(&mut self) {
        fs::write(self.dir.path().join("go"), "").unwrap();
        if let Some(mut create) = self.create.take() {
            let status = create.wait().unwrap();
            assert!(status.success(), "runc create failed: {}", self.log());
        }
    }

    /// Resumes (if paused) and starts the container's process.
    pub fn start(&mut self) {
        self.resume();
        run(self.runc().arg("start").arg(&self.id));
    }

    /// Runs `script` with the container's sh; its exit status and output (stdout and stderr).
    pub fn exec(&self, script: &str) -> (bool, String) {
        let output = self
            .runc()
            .args(["exec", &self.id, "sh", "-c"])
            .arg(format!("exec 2>&1; {script}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        (output.status.success(), text)
    }

    /// A fake GPU: a character device node with major 195 made in this container's tempdir,
    /// as CDI edits give it, to appear in the container at `container_path`.
    pub fn fake_gpu(&self, minor: u32, container_path: &str) -> CdiDeviceNode {
        let host_path = self.dir.path().join(format!("fakegpu{minor}"));
        if !host_path.exists() {
            nix::sys::stat::mknod(
                &host_path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(195, minor.into()),
            )
            .unwrap();
        }
        CdiDeviceNode {
            path: container_path.into(),
            host_path: Some(host_path.display().to_string()),
            node_type: Some("c".into()),
            major: Some(195),
            minor: Some(minor.into()),
            file_mode: Some(0o666),
            ..CdiDeviceNode::default()
        }
    }

    /// The lines of the host's /proc/self/mountinfo that mention this container's tempdir.
    pub fn host_mounts(&self) -> Vec<String> {
        let dir = self.dir.path().to_string_lossy().into_owned();
        fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|line| line.contains(&dir))
            .map(String::from)
            .collect()
    }

    fn runc(&self) -> Command {
        let mut command = Command::new(RUNC);
        command.arg("--root").arg(self.dir.path().join("runc"));
        command
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("create.log")).unwrap_or_default()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = fs::write(self.dir.path().join("go"), "");
        if let Some(mut create) = self.create.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(create.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = create.kill();
            let _ = create.wait();
        }
        let _ = self
            .runc()
            .args(["delete", "-f", &self.id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn run(command: &mut Command) {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
