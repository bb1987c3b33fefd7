//! `gpuplexctl`: the node service's command-line client.
//!
//! - [`args`]: the command line, read into an [`args::Cli`];
//! - [`table`]: `status` as text ([`render_status`]);
//! - [`top`]: `status`, refreshed;
//! - [`timeline`]: who held each GPU's window when, from the service's window events;
//! - [`install`]: `install` and `uninstall`, gpuplex wired into containerd's config or podman's
//!   hooks directory (no service needed);
//! - [`run`]: carries out a command against the socket found by [`resolve_socket`].
//!
//! Exit status: 0 done; 1 the service refused the request or could not be reached, or an
//! install was refused (one line on stderr, prefixed `gpuplexctl: `); 2 a usage error (one line
//! ending in a pointer to `--help`). A closed standard output (`gpuplexctl status | head -1`)
//! counts as done.
//!
//! It finds and talks to the service with `gpuplex-wire` only: no NVML, no containerd, no
//! runc in this binary (`install containerd` edits containerd's config as text and at most runs
//! `containerd --version`).
#![deny(missing_docs)]

pub mod args;
pub mod install;
pub mod table;
pub mod timeline;
pub mod top;

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub use table::render_status;

use args::{Cli, Command, Drawing, Format};
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::VgpuId;
use gpuplex_wire::config::{config_path, NodeConfig, CONFIG_ENV};
use gpuplex_wire::{ClientError, NodeClient};

/// The config file read for `service.socket` when neither `--config` nor `$GPUPLEX_CONFIG`
/// names one. Unlike a named one, it may be absent.
pub use gpuplex_wire::config::DEFAULT_CONFIG;

/// Why `gpuplexctl` stops early. Every message is one line.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// A bad command line or config file: exit 2.
    #[error("{0}")]
    Usage(String),
    /// The service refused or could not be reached, or nothing was done: exit 1.
    #[error("{0}")]
    Failed(String),
}

impl CtlError {
    /// The exit status it ends `gpuplexctl` with.
    pub fn exit_code(&self) -> u8 {
        match self {
            CtlError::Usage(_) => 2,
            CtlError::Failed(_) => 1,
        }
    }
}

impl From<ClientError> for CtlError {
    fn from(e: ClientError) -> CtlError {
        CtlError::Failed(e.to_string())
    }
}

impl From<args::UsageError> for CtlError {
    fn from(e: args::UsageError) -> CtlError {
        CtlError::Usage(e.0)
    }
}

/// `gpuplexctl`'s whole life: reads the process's arguments and environment, runs, prints an
/// error to stderr, and returns the exit status.
pub fn main() -> ExitCode {
    let env = |name: &str| std::env::var_os(name);
    let result = args::parse(std::env::args_os().skip(1))
        .map_err(CtlError::from)
        .and_then(|cli| run(&cli, &env, &mut io::stdout().lock()));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = e.to_string().replace('\n', " ");
            match e {
                CtlError::Usage(_) => {
                    eprintln!("gpuplexctl: {message}; try `gpuplexctl --help`")
                }
                CtlError::Failed(_) => eprintln!("gpuplexctl: {message}"),
            }
            ExitCode::from(e.exit_code())
        }
    }
}

/// Carries out `cli`, writing its output to `out`; `env` reads environment variables.
pub fn run(
    cli: &Cli,
    env: &dyn Fn(&str) -> Option<OsString>,
    out: &mut dyn Write,
) -> Result<(), CtlError> {
    let socket = || resolve_socket(cli, env);
    match &cli.command {
        Command::Help => write_out(out, args::HELP).map(drop),
        Command::Version => write_out(
            out,
            &format!("gpuplexctl {}\n", env!("CARGO_PKG_VERSION")),
        )
        .map(drop),
        Command::Status { format } => {
            let status = NodeClient::connect(&socket()?)?.status()?;
            let text = match format {
                Format::Table => render_status(&status),
                Format::Json => pretty(&status),
            };
            write_out(out, &text).map(drop)
        }
        Command::Top { interval, count } => top::top(&socket()?, *interval, *count, out),
        Command::Register {
            id,
            target,
            annotations,
        } => {
            // A process that runs already: windowed from its first sample.
            let vgpu =
                NodeClient::connect(&socket()?)?.register(id, target, annotations, false)?;
            write_out(out, &pretty(&vgpu)).map(drop)
        }
        Command::Install(request) => install::run(request, out),
        Command::Timeline { since, drawing } => {
            let events = NodeClient::connect(&socket()?)?.events(0)?;
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let from_ms = now_ms.saturating_sub(since.as_millis() as u64);
            // Events before the window matter only for who held a GPU at its start.
            let dropped = events.first > 1
                && events.events.first().is_none_or(|e| e.at_ms > from_ms);
            let held = timeline::spans(&events, from_ms, now_ms);
            let drawn = match drawing {
                Drawing::Svg => timeline::svg(&held, now_ms, *since),
                Drawing::Text => timeline::render(&held, now_ms, *since, dropped),
                Drawing::Json => pretty(&timeline::since(events, from_ms)),
            };
            write_out(out, &drawn).map(drop)
        }
        Command::Release { key } => match NodeClient::connect(&socket()?)?.release(&release_key(key))? {
            Some(vgpu) => write_out(out, &format!("{}\n", vgpu.id)).map(drop),
            None => Err(CtlError::Failed(format!(
                "nothing is registered under `{key}`: give a container id or a vGPU id (gpuplexctl status lists them)"
            ))),
        },
    }
}

/// What `gpuplexctl release KEY` releases: the vGPU when KEY reads like a vGPU id (`vgpu-3`),
/// else the vGPU of the container KEY (the operator's choice: both are listed by status).
fn release_key(key: &str) -> ReleaseKey {
    match key.parse::<VgpuId>() {
        Ok(vgpu) => ReleaseKey::Vgpu(vgpu),
        Err(_) => ReleaseKey::Container(key.to_owned()),
    }
}

/// The node socket: `--socket`, else `$GPUPLEX_SOCKET`, else `service.socket` in the config
/// file (its default when the file does not set it). The config file is `--config`, else
/// `$GPUPLEX_CONFIG`, else [`DEFAULT_CONFIG`]; only the default may be absent.
pub fn resolve_socket(
    cli: &Cli,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<PathBuf, CtlError> {
    if let Some(socket) = &cli.socket {
        return Ok(socket.clone());
    }
    if let Some(socket) = env("GPUPLEX_SOCKET").filter(|s| !s.is_empty()) {
        return Ok(PathBuf::from(socket));
    }
    let env_config = env(CONFIG_ENV);
    let (config, named) = config_path(cli.config.as_deref(), env_config.as_deref());
    socket_from_config(&config, named)
}

/// `service.socket` of the config file at `path` (read and checked as the node service reads
/// it). An absent file is an error only when it was `named`.
pub fn socket_from_config(path: &Path, named: bool) -> Result<PathBuf, CtlError> {
    match NodeConfig::load(path, named) {
        Ok(config) => Ok(config.service.socket),
        Err(e) => Err(CtlError::Usage(format!(
            "{e}; fix it, or name the socket with --socket PATH"
        ))),
    }
}

/// Writes `text` to `out` and flushes it. `Ok(false)` when `out` is a closed pipe: the reader
/// has seen enough, and `gpuplexctl` stops without an error.
pub fn write_out(out: &mut dyn Write, text: &str) -> Result<bool, CtlError> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(CtlError::Failed(format!(
            "cannot write to standard output: {e}"
        ))),
    }
}

fn pretty(value: &impl serde::Serialize) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("status and replies serialize");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(line: &str) -> Cli {
        args::parse(line.split_whitespace().map(OsString::from)).unwrap()
    }

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn socket_precedence() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("gpuplex.toml");
        std::fs::write(&config, "[service]\nsocket = \"/from/config.sock\"\n").unwrap();
        let env_config = |name: &str| match name {
            "GPUPLEX_CONFIG" => Some(config.clone().into_os_string()),
            _ => None,
        };
        let env_both = |name: &str| match name {
            "GPUPLEX_SOCKET" => Some(OsString::from("/from/env.sock")),
            _ => env_config(name),
        };
        let resolve = |line: &str, env: &dyn Fn(&str) -> Option<OsString>| {
            resolve_socket(&cli(line), env).unwrap()
        };
        assert_eq!(
            resolve("--socket /a.sock status", &env_both),
            Path::new("/a.sock")
        );
        assert_eq!(resolve("status", &env_both), Path::new("/from/env.sock"));
        assert_eq!(
            resolve("status", &env_config),
            Path::new("/from/config.sock")
        );
        let flag = format!("--config {} status", config.display());
        assert_eq!(resolve(&flag, &no_env), Path::new("/from/config.sock"));
        std::fs::write(&config, "[scheduler]\n").unwrap();
        assert_eq!(
            resolve(&flag, &no_env),
            Path::new(gpuplex_wire::DEFAULT_SOCKET)
        );
    }

    #[test]
    fn config_trouble_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent.toml");
        assert_eq!(
            socket_from_config(&absent, false).unwrap(),
            Path::new(gpuplex_wire::DEFAULT_SOCKET)
        );
        let err = socket_from_config(&absent, true).unwrap_err();
        assert!(matches!(err, CtlError::Usage(_)));
        assert!(
            err.to_string().starts_with("cannot read the configuration"),
            "{err}"
        );
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[service\n").unwrap();
        let err = socket_from_config(&bad, false).unwrap_err().to_string();
        assert!(err.contains("line 1") && !err.contains('\n'), "{err}");
        std::fs::write(&bad, "[service]\nsocket = 3\n").unwrap();
        let err = socket_from_config(&bad, false).unwrap_err().to_string();
        assert!(err.contains("line 2 (service.socket)"), "{err}");
        assert!(
            err.ends_with("fix it, or name the socket with --socket PATH"),
            "{err}"
        );
        // What the node service refuses, gpuplexctl refuses too.
        std::fs::write(&bad, "[scheduler]\nslice = \"0ms\"\n").unwrap();
        let err = socket_from_config(&bad, false).unwrap_err().to_string();
        assert!(err.contains("scheduler.slice"), "{err}");
    }

    #[test]
    fn help_and_version_need_no_service() {
        let mut out = Vec::new();
        run(&cli("--help"), &no_env, &mut out).unwrap();
        let help = String::from_utf8(out).unwrap();
        assert!(help.contains("Exit status:"));
        let mut out = Vec::new();
        run(&cli("--version"), &no_env, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("gpuplexctl {}\n", env!("CARGO_PKG_VERSION"))
        );
    }

    #[test]
    fn a_closed_pipe_is_not_an_error() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        assert!(!write_out(&mut Closed, "x").unwrap());
        run(&cli("--help"), &no_env, &mut Closed).unwrap();
    }
}
