//! `gpuplexctl`'s command line, read into a [`Cli`] without touching anything else.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use gpuplex_scheduler::node::Target;
use gpuplex_scheduler::time::parse_duration;
use lexopt::prelude::*;

use crate::install;

/// `gpuplexctl --help`: the commands, options and exit status.
pub const HELP: &str = include_str!("help.txt");

/// A command line, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cli {
    /// `--socket`.
    pub socket: Option<PathBuf>,
    /// `--config`: gpuplex's config file (for `install` and `uninstall`, containerd's, which
    /// goes into their [`install::Target`] instead).
    pub config: Option<PathBuf>,
    /// What to do.
    pub command: Command,
}

/// What `gpuplexctl` was asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// `--help`.
    Help,
    /// `--version`.
    Version,
    /// `status`.
    Status {
        /// `-o`.
        format: Format,
    },
    /// `top`.
    Top {
        /// Time between refreshes.
        interval: Duration,
        /// Refreshes before exiting; `None`: until interrupted.
        count: Option<u64>,
    },
    /// `register`.
    Register {
        /// The container's id.
        id: String,
        /// Its process or cgroup.
        target: Target,
        /// Its annotations.
        annotations: BTreeMap<String, String>,
    },
    /// `release`: a container id or a vGPU id.
    Release {
        /// The id.
        key: String,
    },
    /// `install` or `uninstall`: gpuplex wired into containerd or podman.
    Install(install::Request),
    /// `timeline`: who held each GPU's window over the last `since`.
    Timeline {
        /// How far back.
        since: Duration,
        /// How it is drawn.
        drawing: Drawing,
    },
}

/// How `timeline` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drawing {
    /// Rows of text (`-o text`, the default).
    Text,
    /// An SVG image (`-o svg`).
    Svg,
    /// The window events themselves, as the node service sent them (`-o json`): those of the
    /// interval, and before them each GPU's last one (who held it when the interval began).
    Json,
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// Aligned text.
    #[default]
    Table,
    /// The status object, pretty JSON.
    Json,
}

/// A command line that cannot be read, in one line naming the option and value at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

const COMMANDS: [&str; 7] = [
    "status",
    "top",
    "timeline",
    "register",
    "release",
    "install",
    "uninstall",
];

/// The commands, as usage errors list them.
const COMMAND_LIST: &str = "status, top, timeline, register, release, install or uninstall";

/// Reads `gpuplexctl`'s arguments (without the program name).
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli, UsageError> {
    let mut parser = lexopt::Parser::from_args(args);
    let mut socket = None;
    let mut config = None;
    let mut help = false;
    let mut version = false;
    let mut command: Option<&'static str> = None;
    let mut raw = Raw::default();
    while let Some(arg) = parser.next().map_err(lexopt_error)? {
        match arg {
            Long("socket") => socket = Some(PathBuf::from(parser.value().map_err(lexopt_error)?)),
            Long("config") => config = Some(PathBuf::from(parser.value().map_err(lexopt_error)?)),
            Short('h') | Long("help") => help = true,
            Short('V') | Long("version") => version = true,
            Value(value) if command.is_none() => {
                let name = value.to_string_lossy();
                command = Some(COMMANDS.into_iter().find(|c| *c == name).ok_or_else(|| {
                    UsageError(format!("unknown command `{name}`: expected {COMMAND_LIST}"))
                })?);
            }
            arg => {
                let arg = match arg {
                    Short(c) => Arg::Flag(format!("-{c}")),
                    Long(name) => Arg::Flag(format!("--{name}")),
                    Value(value) => Arg::Value(value),
                };
                raw.take(command.unwrap_or("gpuplexctl"), arg, &mut parser)?;
            }
        }
    }
    if matches!(command, Some("install" | "uninstall")) {
        // There, --config names containerd's config: gpuplex's is not read.
        raw.containerd_config = config.take();
    }
    let command = if help {
        Command::Help
    } else if version {
        Command::Version
    } else {
        match command {
            None => return Err(UsageError(format!("missing a command: {COMMAND_LIST}"))),
            Some(name) => raw.into_command(name)?,
        }
    };
    Ok(Cli {
        socket,
        config,
        command,
    })
}

/// An argument not taken by [`parse`] itself: a flag as written (`-o`, `--pid`), or a value.
enum Arg {
    Flag(String),
    Value(OsString),
}

/// The options of the subcommands, as written.
#[derive(Default)]
struct Raw {
    output: Option<String>,
    interval: Option<String>,
    count: Option<String>,
    id: Option<String>,
    pid: Option<String>,
    cgroup: Option<String>,
    annotations: Vec<String>,
    positional: Vec<String>,
    dry_run: bool,
    containerd_config: Option<PathBuf>,
    containerd: Option<PathBuf>,
    hooks_dir: Option<PathBuf>,
    hook: Option<PathBuf>,
}

impl Raw {
    fn take(
        &mut self,
        command: &str,
        arg: Arg,
        parser: &mut lexopt::Parser,
    ) -> Result<(), UsageError> {
        let flag = match arg {
            Arg::Flag(flag) => flag,
            Arg::Value(value) if matches!(command, "release" | "install" | "uninstall") => {
                self.positional.push(value.to_string_lossy().into_owned());
                return Ok(());
            }
            Arg::Value(value) => {
                let value = value.to_string_lossy();
                return Err(UsageError(format!(
                    "{command}: unexpected argument `{value}`"
                )));
            }
        };
        let installing = matches!(command, "install" | "uninstall");
        let path_slot = match (installing, flag.as_str()) {
            (true, "--dry-run") => {
                self.dry_run = true;
                return Ok(());
            }
            (true, "--containerd") => Some(&mut self.containerd),
            (true, "--hooks-dir") => Some(&mut self.hooks_dir),
            (true, "--hook") => Some(&mut self.hook),
            _ => None,
        };
        if let Some(slot) = path_slot {
            let value = parser.value().map_err(lexopt_error)?;
            if value.is_empty() {
                return Err(UsageError(format!("{command}: {flag}: give a path")));
            }
            *slot = Some(PathBuf::from(value));
            return Ok(());
        }
        let slot = match (command, flag.as_str()) {
            ("status", "-o" | "--output") => &mut self.output,
            ("top", "--interval") => &mut self.interval,
            ("top", "--count") => &mut self.count,
            ("timeline", "--since") => &mut self.interval,
            ("timeline", "-o" | "--output") => &mut self.output,
            ("register", "--id") => &mut self.id,
            ("register", "--pid") => &mut self.pid,
            ("register", "--cgroup") => &mut self.cgroup,
            ("register", "--annotation") => {
                self.annotations.push(string(parser, &flag)?);
                return Ok(());
            }
            _ => return Err(UsageError(format!("{command}: unknown option `{flag}`"))),
        };
        *slot = Some(string(parser, &flag)?);
        Ok(())
    }

    fn into_command(self, name: &str) -> Result<Command, UsageError> {
        let usage = |message: String| UsageError(format!("{name}: {message}"));
        match name {
            "status" => {
                let format = match self.output.as_deref() {
                    None | Some("table") => Format::Table,
                    Some("json") => Format::Json,
                    Some(other) => {
                        return Err(usage(format!("-o `{other}`: expected table or json")))
                    }
                };
                Ok(Command::Status { format })
            }
            "top" => {
                let interval = match self.interval {
                    None => Duration::from_secs(1),
                    Some(text) => match parse_duration(&text) {
                        Ok(d) if d.is_zero() => {
                            return Err(usage(format!("--interval `{text}`: must be above 0")))
                        }
                        Ok(d) => d,
                        Err(e) => return Err(usage(format!("--interval: {e}"))),
                    },
                };
                let count = match self.count {
                    None => None,
                    Some(text) => match text.parse::<u64>() {
                        Ok(n) if n > 0 => Some(n),
                        _ => {
                            return Err(usage(format!(
                                "--count `{text}`: expected a number of refreshes above 0"
                            )))
                        }
                    },
                };
                Ok(Command::Top { interval, count })
            }
            "register" => {
                let id = self
                    .id
                    .filter(|id| !id.is_empty())
                    .ok_or_else(|| usage("missing --id ID (the container's id)".into()))?;
                let target = match (self.pid, self.cgroup) {
                    (Some(pid), None) => match pid.parse::<u32>() {
                        Ok(n) if n > 0 => Target::Pid(n),
                        _ => {
                            return Err(usage(format!(
                                "--pid `{pid}`: expected a process id (a number above 0)"
                            )))
                        }
                    },
                    (None, Some(path)) if path.starts_with('/') => Target::Cgroup(path),
                    (None, Some(path)) => {
                        return Err(usage(format!(
                            "--cgroup `{path}`: expected an absolute path, like /sys/fs/cgroup/..."
                        )))
                    }
                    (Some(pid), Some(path)) => {
                        return Err(usage(format!(
                            "give one of --pid and --cgroup, not both (--pid `{pid}`, --cgroup `{path}`)"
                        )))
                    }
                    (None, None) => return Err(usage("missing --pid PID or --cgroup PATH".into())),
                };
                let mut annotations = BTreeMap::new();
                for pair in &self.annotations {
                    match pair.split_once('=') {
                        Some((key, value)) if !key.is_empty() => {
                            annotations.insert(key.to_string(), value.to_string());
                        }
                        _ => {
                            return Err(usage(format!(
                                "--annotation `{pair}`: expected KEY=VALUE, like gpuplex.io/gpu-memory=8Gi"
                            )))
                        }
                    }
                }
                if annotations.is_empty() {
                    annotations.insert("gpuplex.io/gpus".into(), "1".into());
                }
                Ok(Command::Register {
                    id,
                    target,
                    annotations,
                })
            }
            "timeline" => {
                let since = match self.interval {
                    None => Duration::from_secs(30),
                    Some(text) => match parse_duration(&text) {
                        Ok(d)
                            if d >= Duration::from_millis(100)
                                && d <= Duration::from_secs(3600) =>
                        {
                            d
                        }
                        _ => {
                            return Err(usage(format!(
                                "--since `{text}`: expected a duration from 100ms to 1h, like 30s"
                            )))
                        }
                    },
                };
                let drawing = match self.output.as_deref() {
                    None | Some("text") => Drawing::Text,
                    Some("svg") => Drawing::Svg,
                    Some("json") => Drawing::Json,
                    Some(other) => {
                        return Err(usage(format!("-o `{other}`: expected text, svg or json")))
                    }
                };
                Ok(Command::Timeline { since, drawing })
            }
            "install" | "uninstall" => self.into_install(name == "uninstall"),
            _ => {
                let mut positional = self.positional.into_iter();
                let key = positional
                    .next()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(|| usage("missing the id: a container id or a vGPU id".into()))?;
                if let Some(extra) = positional.next() {
                    return Err(usage(format!(
                        "unexpected argument `{extra}`: release takes one id"
                    )));
                }
                Ok(Command::Release { key })
            }
        }
    }
}

impl Raw {
    fn into_install(self, uninstall: bool) -> Result<Command, UsageError> {
        let name = if uninstall { "uninstall" } else { "install" };
        let usage = |message: String| UsageError(format!("{name}: {message}"));
        let mut positional = self.positional.into_iter();
        let what = positional
            .next()
            .ok_or_else(|| usage(format!("missing what to {name} into: containerd or podman")))?;
        if let Some(extra) = positional.next() {
            return Err(usage(format!(
                "unexpected argument `{extra}`: {name} takes containerd or podman"
            )));
        }
        let shown = |flag: &str, path: &Option<PathBuf>| {
            path.as_ref().map(|p| format!("{flag} `{}`", p.display()))
        };
        let target = match what.as_str() {
            "containerd" => {
                let podman_only =
                    shown("--hooks-dir", &self.hooks_dir).or_else(|| shown("--hook", &self.hook));
                if let Some(flag) = podman_only {
                    return Err(usage(format!(
                        "{flag} is podman's: containerd takes --config and --containerd"
                    )));
                }
                install::Target::Containerd {
                    config: self.containerd_config,
                    containerd: self
                        .containerd
                        .unwrap_or_else(|| PathBuf::from(install::DEFAULT_CONTAINERD)),
                }
            }
            "podman" => {
                let containerd_only = shown("--config", &self.containerd_config)
                    .or_else(|| shown("--containerd", &self.containerd));
                if let Some(flag) = containerd_only {
                    return Err(usage(format!(
                        "{flag} is containerd's: podman takes --hooks-dir and --hook"
                    )));
                }
                if uninstall {
                    if let Some(flag) = shown("--hook", &self.hook) {
                        return Err(usage(format!(
                            "{flag}: uninstall finds the files by their contents, whatever hook they call"
                        )));
                    }
                }
                if let Some(hook) = self.hook.as_ref().filter(|h| !h.is_absolute()) {
                    return Err(usage(format!(
                        "--hook `{}`: give an absolute path (podman runs it from anywhere)",
                        hook.display()
                    )));
                }
                install::Target::Podman {
                    hooks_dir: self.hooks_dir,
                    hook: self.hook,
                }
            }
            other => {
                return Err(usage(format!(
                    "unknown target `{other}`: expected containerd or podman"
                )))
            }
        };
        Ok(Command::Install(install::Request {
            uninstall,
            dry_run: self.dry_run,
            target,
        }))
    }
}

fn string(parser: &mut lexopt::Parser, flag: &str) -> Result<String, UsageError> {
    let value = parser.value().map_err(lexopt_error)?;
    value
        .into_string()
        .map_err(|v| UsageError(format!("{flag} `{}`: not UTF-8", v.to_string_lossy())))
}

fn lexopt_error(e: lexopt::Error) -> UsageError {
    UsageError(e.to_string().replace('\n', " "))
}

#[cfg(test)]
mod tests;
