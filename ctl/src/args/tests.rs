//! The command line, read.

use super::*;

fn parse_line(line: &str) -> Result<Cli, UsageError> {
    parse(line.split_whitespace().map(OsString::from))
}

fn command(line: &str) -> Command {
    parse_line(line).unwrap().command
}

fn error(line: &str) -> String {
    parse_line(line).unwrap_err().0
}

#[test]
fn commands_and_defaults() {
    assert_eq!(
        command("status"),
        Command::Status {
            format: Format::Table
        }
    );
    assert_eq!(
        command("status -o json"),
        Command::Status {
            format: Format::Json
        }
    );
    assert_eq!(
        command("top"),
        Command::Top {
            interval: Duration::from_secs(1),
            count: None
        }
    );
    assert_eq!(
        command("top --interval 500ms --count=3"),
        Command::Top {
            interval: Duration::from_millis(500),
            count: Some(3)
        }
    );
    assert_eq!(
        command("register --id c1 --pid 42"),
        Command::Register {
            id: "c1".into(),
            target: Target::Pid(42),
            annotations: BTreeMap::from([("gpuplex.io/gpus".into(), "1".into())]),
        }
    );
    assert_eq!(
        command("register --id c1 --cgroup /sys/fs/cgroup/x --annotation a=b=c --annotation k="),
        Command::Register {
            id: "c1".into(),
            target: Target::Cgroup("/sys/fs/cgroup/x".into()),
            annotations: BTreeMap::from([("a".into(), "b=c".into()), ("k".into(), String::new())]),
        }
    );
    assert_eq!(
        command("release vgpu-3"),
        Command::Release {
            key: "vgpu-3".into()
        }
    );
    assert_eq!(command("status --help"), Command::Help);
    assert_eq!(command("-V"), Command::Version);
}

#[test]
fn global_options_go_anywhere() {
    let cli = parse_line("--socket /a status --config /c").unwrap();
    assert_eq!(cli.socket, Some(PathBuf::from("/a")));
    assert_eq!(cli.config, Some(PathBuf::from("/c")));
    let cli = parse_line("release c1 --socket=/b").unwrap();
    assert_eq!(cli.socket, Some(PathBuf::from("/b")));
}

#[test]
fn errors_name_the_flag_and_value() {
    for (line, expected) in [
        ("", "missing a command: status, top, timeline, register, release, install or uninstall"),
        ("frobnicate", "unknown command `frobnicate`: expected status, top, timeline, register, release, install or uninstall"),
        ("status -o yaml", "status: -o `yaml`: expected table or json"),
        ("status --pid 3", "status: unknown option `--pid`"),
        ("status extra", "status: unexpected argument `extra`"),
        ("--pid 3 status", "gpuplexctl: unknown option `--pid`"),
        ("top --interval 10", "top: --interval: `10` is not a duration: write a number and a unit (ns, us, ms, s, m, h), like `200ms` or `1.5s`"),
        ("top --interval 0s", "top: --interval `0s`: must be above 0"),
        ("top --count x", "top: --count `x`: expected a number of refreshes above 0"),
        ("register --pid 3", "register: missing --id ID (the container's id)"),
        ("register --id c1", "register: missing --pid PID or --cgroup PATH"),
        ("register --id c1 --pid abc", "register: --pid `abc`: expected a process id (a number above 0)"),
        ("register --id c1 --pid 0", "register: --pid `0`: expected a process id (a number above 0)"),
        ("register --id c1 --cgroup rel", "register: --cgroup `rel`: expected an absolute path, like /sys/fs/cgroup/..."),
        ("register --id c1 --pid 3 --cgroup /x", "register: give one of --pid and --cgroup, not both (--pid `3`, --cgroup `/x`)"),
        ("register --id c1 --pid 3 --annotation novalue", "register: --annotation `novalue`: expected KEY=VALUE, like gpuplex.io/gpu-memory=8Gi"),
        ("register --id c1 --pid 3 --annotation =v", "register: --annotation `=v`: expected KEY=VALUE, like gpuplex.io/gpu-memory=8Gi"),
        ("release", "release: missing the id: a container id or a vGPU id"),
        ("release a b", "release: unexpected argument `b`: release takes one id"),
        ("status --socket", "missing argument for option '--socket'"),
        ("install", "install: missing what to install into: containerd or podman"),
        ("uninstall", "uninstall: missing what to uninstall into: containerd or podman"),
        ("install docker", "install: unknown target `docker`: expected containerd or podman"),
        ("install containerd podman", "install: unexpected argument `podman`: install takes containerd or podman"),
        ("install containerd --hooks-dir /h", "install: --hooks-dir `/h` is podman's: containerd takes --config and --containerd"),
        ("install podman --config /c", "install: --config `/c` is containerd's: podman takes --hooks-dir and --hook"),
        ("install podman --containerd /bin/containerd", "install: --containerd `/bin/containerd` is containerd's: podman takes --hooks-dir and --hook"),
        ("install podman --hook rel/gpuplex-hook", "install: --hook `rel/gpuplex-hook`: give an absolute path (podman runs it from anywhere)"),
        ("uninstall podman --hook /h", "uninstall: --hook `/h`: uninstall finds the files by their contents, whatever hook they call"),
        ("install containerd --pid 3", "install: unknown option `--pid`"),
        ("status --dry-run", "status: unknown option `--dry-run`"),
        ("install containerd --dry-run=yes", "unexpected argument for option '--dry-run': \"yes\""),
    ] {
        assert_eq!(error(line), expected, "{line}");
    }
}

#[test]
fn install_and_uninstall() {
    use crate::install::{Request, Target};
    let containerd = |config: Option<&str>, containerd: &str| Target::Containerd {
        config: config.map(Into::into),
        containerd: containerd.into(),
    };
    assert_eq!(
        command("install containerd"),
        Command::Install(Request {
            uninstall: false,
            dry_run: false,
            target: containerd(None, "containerd"),
        })
    );
    // --config names containerd's config here, wherever it is written.
    for line in [
        "install containerd --config /c.toml --dry-run --containerd /opt/containerd",
        "--config /c.toml install --dry-run containerd --containerd=/opt/containerd",
    ] {
        let cli = parse_line(line).unwrap();
        assert_eq!(cli.config, None, "{line}");
        assert_eq!(
            cli.command,
            Command::Install(Request {
                uninstall: false,
                dry_run: true,
                target: containerd(Some("/c.toml"), "/opt/containerd"),
            }),
            "{line}"
        );
    }
    assert_eq!(
        command("uninstall podman"),
        Command::Install(Request {
            uninstall: true,
            dry_run: false,
            target: Target::Podman {
                hooks_dir: None,
                hook: None,
            },
        })
    );
    assert_eq!(
        command(
            "install podman --hooks-dir /etc/containers/oci/hooks.d --hook /opt/bin/gpuplex-hook"
        ),
        Command::Install(Request {
            uninstall: false,
            dry_run: false,
            target: Target::Podman {
                hooks_dir: Some("/etc/containers/oci/hooks.d".into()),
                hook: Some("/opt/bin/gpuplex-hook".into()),
            },
        })
    );
    assert_eq!(command("install --help"), Command::Help);
}
