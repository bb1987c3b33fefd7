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
        ("", "missing a command: status, top, register or release"),
        ("frobnicate", "unknown command `frobnicate`: expected status, top, register or release"),
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
    ] {
        assert_eq!(error(line), expected, "{line}");
    }
}
