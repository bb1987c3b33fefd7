//! `containerd-shim-gpuplex-v1`: containerd's shim v2 for gpuplex when containerd runs it
//! (`-namespace NS -address A -id ID start|delete`, and the daemon it starts), the node
//! service (`serve`), its stop from outside (`stop`), and the service's watchdog (`watchdog`,
//! which the service starts itself).
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT after thawing everything (`serve`), or stopped and
//! thawed (`stop`); 1 could not start, or something may stay frozen (one line on stderr says
//! why); 2 usage.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use gpuplex_scheduler::time::parse_duration;
use gpuplex_wire::config::{config_path, NodeConfig, CONFIG_ENV};

const USAGE: &str = "\
usage: containerd-shim-gpuplex-v1 serve [--config PATH]
       containerd-shim-gpuplex-v1 stop [--config PATH] [--timeout DURATION] [--after-exit]

serve  Runs the gpuplex node service in the foreground: it finds this machine's GPUs, serves
       the node socket, samples activity and freezes and thaws containers in their execution
       windows. It stops on SIGTERM or SIGINT, thawing every container it froze.
stop   Stops the node service of that configuration's state_dir however it was started
       (SIGTERM; SIGKILL after --timeout, default 15s), then thaws whatever it may have
       left frozen, and says so in one line. The Debian package runs it when removed.
       --after-exit: signals nobody; waits up to --timeout for the node lock (a watchdog
       thawing), then thaws what is left: the unit's ExecStopPost, so that a `systemctl kill`
       of the service and its watchdog together leaves nothing frozen.

  --config PATH   the configuration (default: $GPUPLEX_CONFIG, else /etc/gpuplex/gpuplex.toml;
                  an absent default file means every default)
  GPUPLEX_LOG     log filter (default: info; e.g. debug, gpuplex_node=debug)

Exit codes: 0 stopped by a signal (serve), or stopped and thawed (stop); 1 could not start
(serve), or something may stay frozen (stop); 2 usage.";

/// How long `stop` gives the service to stop on SIGTERM by default: the unit's `TimeoutStopSec`.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest `--timeout` of `stop`.
const MAX_STOP_TIMEOUT: Duration = Duration::from_secs(600);

fn main() -> ExitCode {
    use lexopt::prelude::*;
    let mut parser = lexopt::Parser::from_env();
    let command = match parser.next() {
        Ok(Some(Value(command))) => command.to_string_lossy().into_owned(),
        Ok(Some(Short('h') | Long("help"))) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Some(Short('v') | Long("version"))) => {
            println!("containerd-shim-gpuplex-v1 {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        // Anything else that starts with `-` is containerd's invocation of a shim
        // (`-namespace NS -address ... start`): containerd-shim reads it.
        Ok(Some(_)) | Err(_) => {
            gpuplex_shim::task::run();
            return ExitCode::SUCCESS;
        }
        Ok(None) => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let option = |parser: &mut lexopt::Parser, name: &str| -> Result<Option<PathBuf>, String> {
        match parser.next().map_err(|e| e.to_string())? {
            None => Ok(None),
            Some(Long(flag)) if flag == name => match parser.value() {
                Ok(path) => Ok(Some(PathBuf::from(path))),
                Err(_) => Err(format!("--{name} needs a path")),
            },
            Some(other) => Err(other.unexpected().to_string()),
        }
    };
    let flag = match command.as_str() {
        "stop" => return stop(&mut parser),
        "serve" => match option(&mut parser, "config") {
            Ok(flag) => flag,
            Err(why) => {
                eprintln!("containerd-shim-gpuplex-v1 serve: {why}; try --help");
                return ExitCode::from(2);
            }
        },
        "watchdog" => {
            return match option(&mut parser, "state-dir") {
                Ok(Some(dir)) if parser.next().ok().flatten().is_none() => {
                    gpuplex_node::service::watchdog::run(dir)
                }
                _ => {
                    eprintln!("containerd-shim-gpuplex-v1 watchdog: started by `serve`, as `watchdog --state-dir DIR`");
                    ExitCode::from(2)
                }
            };
        }
        "help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("containerd-shim-gpuplex-v1: unknown command {command:?}; try --help");
            return ExitCode::from(2);
        }
    };
    if let Ok(Some(extra)) = parser.next() {
        eprintln!(
            "containerd-shim-gpuplex-v1 serve: {}; try --help",
            extra.unexpected()
        );
        return ExitCode::from(2);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUPLEX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let Some((config, path)) = load_config("containerd-shim-gpuplex-v1", flag.as_deref()) else {
        return ExitCode::from(1);
    };
    if path.exists() {
        tracing::info!("configuration: {}", path.display());
    } else {
        tracing::info!(
            "configuration: {} is absent; every default applies",
            path.display()
        );
    }
    match gpuplex_node::service::serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("containerd-shim-gpuplex-v1: {e}");
            ExitCode::from(1)
        }
    }
}

/// `stop [--config PATH] [--timeout DURATION] [--after-exit]`: the service of the
/// configuration's `state_dir` stopped (or, after its exit, waited for), what it left frozen
/// thawed.
fn stop(parser: &mut lexopt::Parser) -> ExitCode {
    use lexopt::prelude::*;
    let mut flag = None;
    let mut timeout = STOP_TIMEOUT;
    let mut after_exit = false;
    let usage = |why: String| {
        eprintln!("containerd-shim-gpuplex-v1 stop: {why}; try --help");
        ExitCode::from(2)
    };
    loop {
        match parser.next() {
            Ok(None) => break,
            Ok(Some(Long("config"))) => match parser.value() {
                Ok(path) => flag = Some(PathBuf::from(path)),
                Err(_) => return usage("--config needs a path".into()),
            },
            Ok(Some(Long("timeout"))) => {
                let value = parser.value().ok().and_then(|v| v.into_string().ok());
                match value.as_deref().map(parse_duration) {
                    Some(Ok(d)) if !d.is_zero() && d <= MAX_STOP_TIMEOUT => timeout = d,
                    _ => {
                        return usage("--timeout needs a duration from 1ms to 10m, like 15s".into())
                    }
                }
            }
            Ok(Some(Long("after-exit"))) => after_exit = true,
            Ok(Some(other)) => return usage(other.unexpected().to_string()),
            Err(e) => return usage(e.to_string()),
        }
    }
    let Some((config, _)) = load_config("containerd-shim-gpuplex-v1 stop", flag.as_deref()) else {
        return ExitCode::from(1);
    };
    let state_dir = &config.service.state_dir;
    let stopped = if after_exit {
        gpuplex_node::service::stop::after_exit(state_dir, timeout)
    } else {
        gpuplex_node::service::stop::stop(state_dir, timeout)
    };
    match stopped {
        Ok(stopped) => {
            for why in &stopped.unread {
                eprintln!("containerd-shim-gpuplex-v1 stop: {why}");
            }
            println!("{}", stopped.summary(state_dir));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("containerd-shim-gpuplex-v1 stop: {e}");
            ExitCode::from(1)
        }
    }
}

/// The configuration (`--config`, else `$GPUPLEX_CONFIG`, else the default file) and its path;
/// `None` once `who` has said in one line why it cannot be read.
fn load_config(who: &str, flag: Option<&std::path::Path>) -> Option<(NodeConfig, PathBuf)> {
    let env = std::env::var_os(CONFIG_ENV);
    let (path, named) = config_path(flag, env.as_deref());
    match NodeConfig::load(&path, named) {
        Ok(config) => Some((config, path)),
        Err(e) => {
            eprintln!("{who}: {e}");
            None
        }
    }
}
