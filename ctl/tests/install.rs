//! `gpuplexctl install` and `uninstall` as an operator runs them: the binary on a config or
//! hooks directory of the test's own (exit status, one line out, the files byte for byte), and
//! a real containerd (root) started on the config it wrote, running a CRI pod under gpuplex's
//! runtime handler and a `ctr run` container with a vGPU.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use gpuplex_integration::containerd::*;
use gpuplex_integration::cri::*;
use gpuplex_integration::{text, wait_until, NodeService};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

/// Debian 12's `/etc/containerd/config.toml`: version 2, no runtime named.
const DEBIAN: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"#;

fn gpuplexctl(args: &[&str]) -> Output {
    gpuplexctl_with(args, &[])
}

/// The same with `env` set.
fn gpuplexctl_with(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuplexctl"));
    command
        .args(args)
        .env_remove("GPUPLEX_SOCKET")
        .env_remove("GPUPLEX_CONFIG");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("gpuplexctl runs")
}

/// Held by the tests that start a containerd: `install containerd` without `--config` looks
/// for the running containerds.
static ONE_CONTAINERD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_containerd() -> std::sync::MutexGuard<'static, ()> {
    ONE_CONTAINERD.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many containerds `install containerd` may ask here: processes named `containerd` that
/// `gpuplex_ctl::install::locate::trusted_containerd` accepts (a machine's own containerd; not
/// one in a container, nor a user's).
fn trusted_containerds() -> usize {
    use gpuplex_ctl::install::locate::trusted_containerd;
    let mnt = |dir: &Path| {
        std::fs::read_link(dir.join("ns/mnt"))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let own = mnt(Path::new("/proc/self"));
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            let dir = e.path();
            std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim_end() == "containerd")
                && trusted_containerd(
                    &std::fs::read_to_string(dir.join("status")).unwrap_or_default(),
                    &mnt(&dir),
                    &own,
                )
        })
        .count()
}

/// The one line on stdout of a run that succeeded; stderr empty.
fn ok_line(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout {stdout:?}, stderr {stderr:?}"
    );
    assert!(stderr.is_empty(), "{stderr:?}");
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
    stdout.trim_end().to_string()
}

/// The one line on stderr of a run that failed with `code`; stdout empty.
fn error_line(out: &Output, code: i32) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout {stdout:?}, stderr {stderr:?}"
    );
    assert!(stdout.is_empty(), "{stdout:?}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(stderr.starts_with("gpuplexctl: "), "{stderr:?}");
    stderr.trim_end().to_string()
}

fn config_args<'a>(command: &'a str, config: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![command, "containerd", "--config", config.to_str().unwrap()];
    args.extend_from_slice(extra);
    args
}

#[test]
fn install_twice_then_uninstall_gives_the_original_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let backup = dir.path().join("config.toml.gpuplex-orig");
    // No trailing newline, an operator's comment: the bytes still come back.
    let original = format!("# mine\n{}", DEBIAN.trim_end());
    std::fs::write(&config, &original).unwrap();

    let dry = gpuplexctl(&config_args("install", &config, &["--dry-run"]));
    assert_eq!(dry.status.code(), Some(0), "{}", text(&dry));
    let diff = String::from_utf8_lossy(&dry.stdout);
    assert!(
        diff.starts_with(&format!("--- {0}\n+++ {0}\n@@ ", config.display())),
        "{diff}"
    );
    assert!(
        diff.contains("+  runtime_type = \"io.containerd.gpuplex.v1\"\n"),
        "{diff}"
    );
    assert!(
        diff.lines()
            .last()
            .unwrap()
            .starts_with("dry run, nothing changed: it would add gpuplex's runtime gpuplex"),
        "{diff}"
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), original);
    assert!(!backup.exists());

    let line = ok_line(&gpuplexctl(&config_args("install", &config, &[])));
    assert!(
        line.starts_with(&format!(
            "added gpuplex's runtime gpuplex to {}",
            config.display()
        )),
        "{line}"
    );
    assert!(
        line.ends_with("; restart containerd: systemctl restart containerd"),
        "{line}"
    );
    let installed = std::fs::read(&config).unwrap();
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), original);
    let installed_text = String::from_utf8(installed.clone()).unwrap();
    assert!(
        installed_text
            .contains("\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]\n"),
        "{installed_text}"
    );

    let line = ok_line(&gpuplexctl(&config_args("install", &config, &[])));
    assert_eq!(
        line,
        format!("{} already has gpuplex's runtime gpuplex as shipped (config version 2); nothing changed", config.display())
    );
    assert_eq!(std::fs::read(&config).unwrap(), installed);
    // A dry run of what is done already prints that line only.
    let line = ok_line(&gpuplexctl(&config_args(
        "install",
        &config,
        &["--dry-run"],
    )));
    assert!(line.ends_with("nothing changed"), "{line}");

    let line = ok_line(&gpuplexctl(&config_args("uninstall", &config, &[])));
    assert!(
        line.starts_with(&format!("restored {} byte for byte", config.display())),
        "{line}"
    );
    assert_eq!(std::fs::read(&config).unwrap(), original.as_bytes());
    assert!(!backup.exists());
    let line = ok_line(&gpuplexctl(&config_args("uninstall", &config, &[])));
    assert!(
        line.ends_with("has no gpuplex runtime; nothing changed"),
        "{line}"
    );
}

#[test]
fn a_config_that_does_not_parse_is_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    // The snippet appended twice, as `cat config-v2.toml >> config.toml` twice left it.
    let snippet = include_str!("../../config/containerd/config-v2.toml");
    let twice = format!("{DEBIAN}\n{snippet}\n{snippet}");
    std::fs::write(&config, &twice).unwrap();
    let header = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]";
    let line_of_second = twice[..twice.rfind(header).unwrap()].matches('\n').count() + 1;
    for command in ["install", "uninstall"] {
        let line = error_line(&gpuplexctl(&config_args(command, &config, &[])), 1);
        assert!(
            line.starts_with(&format!(
                "gpuplexctl: {}: line {line_of_second}, column ",
                config.display()
            )),
            "{line}"
        );
        assert!(line.ends_with("; nothing changed"), "{line}");
        assert_eq!(std::fs::read_to_string(&config).unwrap(), twice);
    }
    let bad = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"\nsandbox_image = 3\n";
    std::fs::write(&config, bad).unwrap();
    let line = error_line(&gpuplexctl(&config_args("install", &config, &[])), 1);
    assert!(line.starts_with(&format!("gpuplexctl: {}: line 2, column 37: invalid table header; expected `.`, `]`; nothing changed", config.display())), "{line}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), bad);
    assert!(!dir.path().join("config.toml.gpuplex-orig").exists());
    // Usage errors: exit 2.
    let line = error_line(&gpuplexctl(&["install", "docker"]), 2);
    assert!(
        line.contains("unknown target `docker`: expected containerd or podman"),
        "{line}"
    );
    let line = error_line(&gpuplexctl(&["install", "podman", "--config", "/x"]), 2);
    assert!(line.contains("--config `/x` is containerd's"), "{line}");
}

#[test]
fn podman_hooks_are_installed_once_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let hooks = dir.path().join("hooks.d");
    let hooks_arg = hooks.to_str().unwrap();
    // The hook beside gpuplexctl (target/<profile>/gpuplex-hook) may not be built: name one.
    let hook = dir.path().join("gpuplex-hook");
    std::fs::write(&hook, "#!/bin/sh\n").unwrap();
    let hook_arg = hook.to_str().unwrap();
    let install = [
        "install",
        "podman",
        "--hooks-dir",
        hooks_arg,
        "--hook",
        hook_arg,
    ];
    let line = ok_line(&gpuplexctl(&install));
    assert!(line.starts_with("wrote gpuplex-precreate.json (new), gpuplex-createRuntime.json (new), gpuplex-poststop.json (new) in "), "{line}");
    assert!(
        line.ends_with("podman needs no restart: its next container reads them"),
        "{line}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&hooks)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "gpuplex-createRuntime.json",
            "gpuplex-poststop.json",
            "gpuplex-precreate.json"
        ]
    );
    for name in &names {
        let value: Value =
            serde_json::from_slice(&std::fs::read(hooks.join(name)).unwrap()).unwrap();
        let stage = name
            .trim_start_matches("gpuplex-")
            .trim_end_matches(".json");
        assert_eq!(value["hook"]["path"], json!(hook_arg));
        assert_eq!(value["hook"]["args"], json!(["gpuplex-hook", stage]));
        assert_eq!(value["stages"], json!([stage]));
        assert_eq!(
            value["when"]["annotations"],
            json!({"^gpuplex\\.io/": ".*"})
        );
    }
    let line = ok_line(&gpuplexctl(&install));
    assert!(line.contains("are installed already"), "{line}");
    let uninstall = ["uninstall", "podman", "--hooks-dir", hooks_arg];
    let line = ok_line(&gpuplexctl(&uninstall));
    assert!(line.starts_with("removed gpuplex-precreate.json, gpuplex-createRuntime.json, gpuplex-poststop.json from "), "{line}");
    assert_eq!(std::fs::read_dir(&hooks).unwrap().count(), 0);
    // A hook that is not there is refused before anything is written.
    let missing = dir.path().join("nowhere/gpuplex-hook");
    let out = gpuplexctl(&[
        "install",
        "podman",
        "--hooks-dir",
        hooks_arg,
        "--hook",
        missing.to_str().unwrap(),
    ]);
    let line = error_line(&out, 1);
    assert!(line.contains("there is no gpuplex-hook at"), "{line}");
    assert_eq!(std::fs::read_dir(&hooks).unwrap().count(), 0);
}

#[test]
fn podman_hooks_go_where_containers_conf_says() {
    let dir = tempfile::tempdir().unwrap();
    let hooks = dir.path().join("hooks-from-conf");
    let conf = dir.path().join("containers.conf");
    std::fs::write(
        &conf,
        format!(
            "[containers]\nlog_size_max = -1\n\n[engine]\nhooks_dir = [\"{}\", \"/nonexistent/hooks.d\"]\n",
            hooks.display()
        ),
    )
    .unwrap();
    let hook = dir.path().join("gpuplex-hook");
    std::fs::write(&hook, "#!/bin/sh\n").unwrap();
    let env = [("CONTAINERS_CONF", conf.as_path())];
    let line = ok_line(&gpuplexctl_with(
        &["install", "podman", "--hook", hook.to_str().unwrap()],
        &env,
    ));
    assert!(
        line.contains(&format!(" in {}, calling ", hooks.display())),
        "{line}"
    );
    assert_eq!(std::fs::read_dir(&hooks).unwrap().count(), 3);
    let line = ok_line(&gpuplexctl_with(&["uninstall", "podman"], &env));
    assert!(line.starts_with("removed "), "{line}");
    assert_eq!(std::fs::read_dir(&hooks).unwrap().count(), 0);
    // A containers.conf that does not parse: named, with its line and column; nothing written.
    std::fs::write(&conf, "[engine]\nhooks_dir = [\"/a\" \"/b\"]\n").unwrap();
    let line = error_line(
        &gpuplexctl_with(
            &["install", "podman", "--hook", hook.to_str().unwrap()],
            &env,
        ),
        1,
    );
    assert!(
        line.starts_with(&format!("gpuplexctl: {}: line 2, column ", conf.display())),
        "{line}"
    );
    assert!(line.ends_with("; nothing changed"), "{line}");
    assert_eq!(std::fs::read_dir(&hooks).unwrap().count(), 0);
}

#[test]
fn install_containerd_edits_the_config_the_running_containerd_reads() {
    let test = "install_containerd_edits_the_config_the_running_containerd_reads";
    if !can_run_containerd(test) {
        return;
    }
    let _one = one_containerd();
    let containerd = Containerd::start_with(Setup::default(), |config| {
        table_at_mut(config, &RUNTIMES_V2).remove("gpuplex");
    });
    let config = containerd.dir.join("config.toml");
    let original = std::fs::read(&config).unwrap();
    let out = gpuplexctl(&["install", "containerd"]);
    let running = trusted_containerds();
    if running > 1 {
        // Another containerd runs here (the machine's own): which config is meant is asked.
        eprintln!("NOTE: {running} containerds run here: only the refusal is checked");
        let line = error_line(&out, 1);
        assert!(
            line.contains("containerds run here with different configs (")
                && line.contains(&config.display().to_string()),
            "{line}"
        );
        assert_eq!(std::fs::read(&config).unwrap(), original);
        return;
    }
    let line = ok_line(&out);
    assert!(line.contains(&config.display().to_string()), "{line}");
    assert_ne!(std::fs::read(&config).unwrap(), original);
    let line = ok_line(&gpuplexctl(&["uninstall", "containerd"]));
    assert!(line.contains(&config.display().to_string()), "{line}");
    assert_eq!(std::fs::read(&config).unwrap(), original);
}

/// Processes killed (and reaped) on drop.
struct Impostors(Vec<std::process::Child>);

impl Drop for Impostors {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn install_containerd_asks_no_containerd_of_a_user_or_a_container() {
    let test = "install_containerd_asks_no_containerd_of_a_user_or_a_container";
    if !can_run_containerd(test) {
        return;
    }
    let _one = one_containerd();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // A script's process is named after the script: `containerd`, with the arguments given.
    let script = dir.path().join("containerd");
    std::fs::write(&script, "#!/bin/sh\nsleep 60\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let user = dir.path().join("user.toml");
    let contained = dir.path().join("contained.toml");
    let spawn = |program: &str, args: &[&str], config: &Path| {
        Command::new(program)
            .args(args)
            .arg(&script)
            .arg("--config")
            .arg(config)
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"))
    };
    let impostors = Impostors(vec![
        // A user's process, and root's in a mount namespace of its own (as in a container).
        spawn(
            "setpriv",
            &["--reuid=65534", "--regid=65534", "--clear-groups"],
            &user,
        ),
        spawn("unshare", &["--mount"], &contained),
    ]);
    let named = wait_until(Duration::from_secs(5), || {
        impostors.0.iter().all(|c| {
            std::fs::read_to_string(format!("/proc/{}/comm", c.id()))
                .is_ok_and(|n| n.trim_end() == "containerd")
        })
    });
    assert!(named, "the impostors did not start");
    let running = trusted_containerds();
    let out = gpuplexctl(&["install", "containerd", "--dry-run"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for path in [&user, &contained] {
        assert!(!said.contains(&path.display().to_string()), "{said}");
    }
    if running == 0 {
        // Only the impostors: containerd's default file, as when none runs.
        assert!(out.status.success(), "{said}");
        let line = said.lines().last().unwrap_or("");
        assert!(line.contains("/etc/containerd/config.toml"), "{said}");
    }
    assert!(!user.exists() && !contained.exists());
}

/// The table at `path` of a containerd config as `toml` reads it.
fn runtimes(config: &toml::Table) -> Option<&toml::Table> {
    table_at(config, &RUNTIMES_V2)
}

#[test]
fn containerd_runs_gpuplex_pods_from_the_config_install_wrote() {
    let test = "containerd_runs_gpuplex_pods_from_the_config_install_wrote";
    if !can_run_containerd(test) {
        return;
    }
    let _one = one_containerd();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let pause = dir.path().join("pause.tar");
    let busybox = dir.path().join("busybox.tar");
    busybox_image_tarball(&pause, PAUSE_IMAGE, &PAUSE_COMMAND);
    busybox_image_tarball(&busybox, BUSYBOX_IMAGE, &["sh"]);
    let service = NodeService::start(&dir.path().join("node"), 1, 275, "");
    // A config that names no runtime, as Debian's: the fixture's without gpuplex's and runc's.
    let mut containerd = Containerd::start_with(
        Setup {
            gpuplex_config: Some(service.config.clone()),
            cri: true,
        },
        |config| {
            table_at_mut(config, &["plugins", CRI_PLUGIN_V2])
                .insert("sandbox_image".into(), PAUSE_IMAGE.into());
            table_at_mut(config, &RUNTIMES_V2[..3]).remove("runtimes");
        },
    );
    let config = containerd.dir.join("config.toml");
    let original = std::fs::read(&config).expect("the config");
    assert!(
        runtimes(&String::from_utf8_lossy(&original).parse().unwrap()).is_none_or(|r| r.is_empty())
    );

    let line = ok_line(&gpuplexctl(&config_args("install", &config, &[])));
    assert!(line.contains("with runc named too"), "{line}");
    let installed = std::fs::read_to_string(&config).unwrap();

    // containerd's own reading of it: both runtimes, gpuplex's as shipped.
    let dump = Command::new("containerd")
        .arg("--config")
        .arg(&config)
        .args(["config", "dump"])
        .output()
        .expect("containerd config dump");
    assert!(dump.status.success(), "{}", text(&dump));
    let dumped: toml::Table = String::from_utf8_lossy(&dump.stdout)
        .parse()
        .expect("the dump is TOML");
    let named = runtimes(&dumped).expect("runtimes in the dump");
    assert_eq!(
        named["gpuplex"]["runtime_type"].as_str(),
        Some(GPUPLEX),
        "{named:?}"
    );
    assert_eq!(
        named["gpuplex"]["pod_annotations"],
        toml::Value::from(vec!["gpuplex.io/*"])
    );
    assert_eq!(
        named["runc"]["runtime_type"].as_str(),
        Some(RUNC),
        "{named:?}"
    );

    // Why runc is named too: with gpuplex's entry alone, containerd 1.6's CRI plugin does not load.
    let alone = installed.replace(
        "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n",
        "",
    );
    assert_ne!(alone, installed);
    std::fs::write(&config, &alone).unwrap();
    containerd.restart();
    let cri_state = |containerd: &Containerd| {
        let plugins = containerd.ctr(&["plugins", "ls"]);
        String::from_utf8_lossy(&plugins.stdout)
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some("cri"))
            .and_then(|l| l.split_whitespace().last().map(str::to_string))
    };
    assert_ne!(cri_state(&containerd).as_deref(), Some("ok"), "containerd 1.6 loaded its CRI plugin with gpuplex's runtime alone: naming runc is not needed");
    assert!(
        containerd
            .log()
            .contains("no corresponding runtime configured"),
        "{}",
        containerd.log_tail()
    );
    std::fs::write(&config, &installed).unwrap();
    containerd.restart();
    assert_eq!(
        cri_state(&containerd).as_deref(),
        Some("ok"),
        "{}",
        containerd.log_tail()
    );

    // A pod under the RuntimeClass handler the installed entry names, as the kubelet runs it.
    for tarball in [&pause, &busybox] {
        import(&containerd, tarball);
    }
    let cri = Cri::connect(&containerd.socket);
    let mut pod = cri
        .run_pod_sandbox(
            &host_network_pod("installed", "ml", &[("gpuplex.io/gpu-memory", "1Gi")]),
            "gpuplex",
        )
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", containerd.log_tail()));
    let sandbox = cri.sandbox_info(&pod.id).expect("PodSandboxStatus");
    assert_eq!(sandbox["runtimeType"], GPUPLEX, "{sandbox:#}");
    let container = pod
        .create_container(&host_network_container(
            "worker",
            BUSYBOX_IMAGE,
            &["sh", "-c", "sleep 1000"],
            &[],
        ))
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    cri.start_container(&container)
        .unwrap_or_else(|e| panic!("StartContainer: {e}"));
    let listed = |id: &str| {
        service.status()["containers"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["id"] == id).cloned())
    };
    assert!(
        wait_until(Duration::from_secs(5), || listed(&container).is_some()),
        "{}",
        service.status()
    );
    assert_eq!(listed(&container).unwrap()["memory"], json!([GIB]));
    pod.remove().expect("RemovePodSandbox");
    assert!(
        wait_until(Duration::from_secs(5), || service.held() == (0, 0)),
        "{}",
        service.status()
    );

    // `ctr run` names the runtime itself: a vGPU as well.
    let out = containerd.run(
        GPUPLEX,
        &["gpuplex.io/gpu-memory=1Gi"],
        "installed-ctr",
        &[
            "sh",
            "-c",
            "echo CUDA=$CUDA_VISIBLE_DEVICES; cat /run/gpuplex/vgpu.json",
        ],
    );
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out),
        containerd.log_tail()
    );
    let shown = String::from_utf8_lossy(&out.stdout);
    let uuid = service.status()["gpus"][0]["uuid"]
        .as_str()
        .expect("a UUID")
        .to_string();
    assert!(shown.contains(&format!("CUDA={uuid}\n")), "{shown}");
    let json = shown.split_once('\n').map_or("", |(_, rest)| rest.trim());
    let identity: Value = serde_json::from_str(json)
        .unwrap_or_else(|e| panic!("/run/gpuplex/vgpu.json: {e}: {shown}"));
    assert_eq!(identity["gpus"][0]["memory"], json!(GIB), "{identity}");
    assert!(
        wait_until(Duration::from_secs(2), || service.held() == (0, 0)),
        "{}",
        service.status()
    );

    // Uninstalled: the original, byte for byte, and containerd still takes it.
    let line = ok_line(&gpuplexctl(&config_args("uninstall", &config, &[])));
    assert!(line.starts_with("restored "), "{line}");
    assert_eq!(std::fs::read(&config).unwrap(), original);
    containerd.restart();
    assert_eq!(
        cri_state(&containerd).as_deref(),
        Some("ok"),
        "{}",
        containerd.log_tail()
    );
}
