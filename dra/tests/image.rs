//! The node image of `config/kubernetes/gpuplex.yaml`, as `make image` builds it
//! (`config/image/stage.sh`, then `podman build` of `config/image/Containerfile`), from the debug
//! binaries (root, podman): the DaemonSet's init container, run with its exact command in the
//! image, installs the shim, the hook and gpuplexctl into the host directory it mounts, over a
//! running binary too; and each binary starts inside the image, so the libraries it links are
//! all there. The image is built in a podman store of the test's own and removed at the end.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use gpuplex_integration::{bin, text, Podman};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Container;
use serde::Deserialize;

/// The DaemonSet of `config/kubernetes/gpuplex.yaml`.
fn daemon_set() -> DaemonSet {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kubernetes/gpuplex.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let found = serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde_json::Value::deserialize(document).unwrap())
        .find(|document| document["kind"] == "DaemonSet")
        .expect("gpuplex.yaml has a DaemonSet");
    serde_json::from_value(found).unwrap()
}

/// Whether two files hold the same bytes.
fn same_bytes(a: &Path, b: &Path) -> bool {
    let (mut a, mut b) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    if a.metadata().unwrap().len() != b.metadata().unwrap().len() {
        return false;
    }
    let (mut x, mut y) = (vec![0; 1 << 20], vec![0; 1 << 20]);
    loop {
        let n = a.read(&mut x).unwrap();
        if n == 0 {
            return true;
        }
        b.read_exact(&mut y[..n]).unwrap();
        if x[..n] != y[..n] {
            return false;
        }
    }
}

/// `podman run` of `image` as Kubernetes runs `container`: its command as the entrypoint, its
/// args after it, `mounts` (host path, container path) bound.
fn run_as(podman: &Podman, image: &str, container: &Container, mounts: &[(&Path, &str)]) -> String {
    let mut command = podman.command();
    command.args([
        "run",
        "--rm",
        "--pull=never",
        "--runtime",
        "runc",
        "--network",
        "none",
    ]);
    for (host, inside) in mounts {
        command
            .arg("--volume")
            .arg(format!("{}:{inside}", host.display()));
    }
    let entrypoint = container.command.clone().unwrap_or_default();
    command
        .arg("--entrypoint")
        .arg(serde_json::to_string(&entrypoint).unwrap())
        .arg(image)
        .args(container.args.clone().unwrap_or_default());
    let out = command.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}: {}", container.name, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_image_installs_the_node_binaries_and_runs_each() {
    let test = "the_image_installs_the_node_binaries_and_runs_each";
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: {test} needs root (podman); CI runs it as root");
        return;
    }
    if Command::new("podman").arg("--version").output().is_err() {
        eprintln!("SKIPPED: {test}: podman is not installed (`make test` installs it)");
        return;
    }
    let started = Instant::now();
    let daemon_set = daemon_set();
    let pod = daemon_set.spec.unwrap().template.spec.unwrap();
    let init = pod.init_containers.unwrap();
    let [install] = init.as_slice() else {
        panic!("one init container: {init:?}")
    };
    let containers = pod.containers;
    // One image for all, the workspace's version.
    let image = format!("localhost/gpuplex:{}", env!("CARGO_PKG_VERSION"));
    for container in init.iter().chain(&containers) {
        assert_eq!(
            container.image.as_deref(),
            Some(image.as_str()),
            "{}",
            container.name
        );
    }
    // Where the init container mounts the host's /usr/local/bin.
    let host_bin = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "host-bin")
        .and_then(|v| v.host_path)
        .expect("the host-bin volume");
    assert_eq!(host_bin.path, "/usr/local/bin");
    let mount_path = install
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "host-bin")
        .expect("install mounts host-bin")
        .mount_path
        .clone();

    // The binaries `cargo test` built (gpuplex-dra for this package; bin() refuses the others
    // when older than their sources).
    let dra = PathBuf::from(env!("CARGO_BIN_EXE_gpuplex-dra"));
    let bin_dir = dra.parent().unwrap().to_path_buf();
    let installed = ["containerd-shim-gpuplex-v1", "gpuplex-hook", "gpuplexctl"];
    // The NRI plugin's DaemonSet (gpuplex-nri.yaml) runs it from the image; nothing installs it.
    for name in installed.iter().chain(&["gpuplex-nri"]) {
        assert_eq!(bin(name), bin_dir.join(name));
    }

    // Staged beside the build (hard links, not copies), built in a store of the test's own
    // (under /tmp: podman refuses a runroot path of over 50 characters).
    let staged = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let stage = staged.path().join("stage");
    let out = Command::new("bash")
        .arg(root.join("config/image/stage.sh"))
        .arg(&bin_dir)
        .arg(&stage)
        .output()
        .unwrap();
    assert!(out.status.success(), "stage.sh: {}", text(&out));
    let podman = Podman::new(&dir.path().join("podman"), None);
    let out = podman
        .command()
        .args(["build", "--quiet", "--tag", &image, "--file"])
        .arg(root.join("config/image/Containerfile"))
        .arg(&stage)
        .output()
        .unwrap();
    assert!(out.status.success(), "podman build: {}", text(&out));
    let built = started.elapsed();

    // The init container, into a host directory where gpuplexctl is a running program (a node
    // that runs gpuplex already): each binary lands whole, executable, and nothing else.
    let host = dir.path().join("host-bin");
    std::fs::create_dir(&host).unwrap();
    std::fs::copy("/bin/sleep", host.join("gpuplexctl")).unwrap();
    let mut running = Command::new(host.join("gpuplexctl"))
        .arg("60")
        .spawn()
        .unwrap();
    let ran = run_as(&podman, &image, install, &[(&host, &mount_path)]);
    let _ = running.kill();
    let _ = running.wait();
    let mut found: Vec<String> = std::fs::read_dir(&host)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    found.sort();
    assert_eq!(found, installed, "{ran}");
    for name in installed {
        use std::os::unix::fs::PermissionsExt;
        let path = host.join(name);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755, "{name}");
        assert!(same_bytes(&path, &bin_dir.join(name)), "{name} differs");
    }
    let installed_at = started.elapsed();

    // The DaemonSet's containers' programs, and the hook and gpuplexctl, start in the image:
    // the loader finds every library they link.
    let programs: Vec<String> = containers
        .iter()
        .map(|c| c.command.as_ref().expect("a command")[0].clone())
        .collect();
    assert_eq!(
        programs,
        [
            "/usr/local/bin/containerd-shim-gpuplex-v1",
            "/usr/local/bin/gpuplex-dra"
        ]
    );
    let version = env!("CARGO_PKG_VERSION");
    let check = Container {
        name: "check".into(),
        command: Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            "set -e; containerd-shim-gpuplex-v1 --version; gpuplex-dra --help; gpuplex-hook --version; gpuplexctl --version; gpuplex-nri --help".into(),
        ]),
        ..Container::default()
    };
    let said = run_as(&podman, &image, &check, &[]);
    for line in [
        format!("containerd-shim-gpuplex-v1 {version}"),
        "usage: gpuplex-dra".to_owned(),
        format!("gpuplex-hook {version}"),
        format!("gpuplexctl {version}"),
        "usage: gpuplex-nri".to_owned(),
    ] {
        assert!(said.contains(&line), "no {line:?} in:\n{said}");
    }

    let out = podman
        .command()
        .args(["rmi", "--force", &image])
        .output()
        .unwrap();
    assert!(out.status.success(), "podman rmi: {}", text(&out));
    eprintln!(
        "{test}: image built in {:.1} s, installed by {:.1} s, checked and removed by {:.1} s",
        built.as_secs_f64(),
        installed_at.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}
