//! `gpuplexctl`: the node service's command-line client.
//!
//! - [`args`]: the command line, read into an [`args::Cli`];
//! - [`table`]: `status` as text ([`render_status`]);
//! - [`top`]: `status`, refreshed;
//! - [`run`]: carries out a command against the socket found by [`resolve_socket`].
//!
//! Exit status: 0 done; 1 the service refused the request or could not be reached (one line on
//! stderr, prefixed `gpuplexctl: `); 2 a usage error (one line ending in a pointer to
//! `--help`). A closed standard output (`gpuplexctl status | head -1`) counts as done.

pub mod args;
pub mod table;
pub mod top;

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub use table::render_status;

use crate::client::{ClientError, NodeClient, DEFAULT_SOCKET};
use args::{Cli, Command, Format};
use gpuplex_scheduler::node::ReleaseKey;
use gpuplex_scheduler::VgpuId;

/// The config file read for `service.socket` when neither `--config` nor `$GPUPLEX_CONFIG`
/// names one. Unlike a named one, it may be absent.
pub use crate::client::DEFAULT_CONFIG;

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
/// file, else [`DEFAULT_SOCKET`]. The config file is `--config`, else `$GPUPLEX_CONFIG`, else
/// [`DEFAULT_CONFIG`]; only the default may be absent.
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
    let env_config = env(crate::client::CONFIG_ENV);
    let (config, named) = crate::client::config_path(cli.config.as_deref(), env_config.as_deref());
    Ok(socket_from_config(&config, named)?.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)))
}

/// `service.socket` from the config file at `path`, if it sets one. An absent file is an error
/// only when it was `named`.
pub fn socket_from_config(path: &Path, named: bool) -> Result<Option<PathBuf>, CtlError> {
    crate::client::socket_from_config(path, named).map_err(|e| {
        CtlError::Usage(format!(
            "{e}; fix it, or name the socket with --socket PATH"
        ))
    })
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
        assert_eq!(resolve(&flag, &no_env), Path::new(DEFAULT_SOCKET));
    }

    #[test]
    fn config_trouble_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent.toml");
        assert_eq!(socket_from_config(&absent, false).unwrap(), None);
        let err = socket_from_config(&absent, true).unwrap_err();
        assert!(matches!(err, CtlError::Usage(_)));
        assert!(err.to_string().contains("cannot read it"), "{err}");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[service\n").unwrap();
        let err = socket_from_config(&bad, false).unwrap_err().to_string();
        assert!(err.contains("not TOML") && !err.contains('\n'), "{err}");
        std::fs::write(&bad, "[service]\nsocket = 3\n").unwrap();
        let err = socket_from_config(&bad, false).unwrap_err().to_string();
        assert!(err.contains("service.socket is 3"), "{err}");
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
