//! `containerd-shim-gpuplex-v1`: containerd's shim v2 for gpuplex when containerd runs it
//! (`-namespace NS -address A -id ID start|delete`, and the daemon it starts), the node
//! service (`serve`), and the service's watchdog (`watchdog`, which the service starts itself).
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT after thawing everything; 1 could not start (one line
//! on stderr says why); 2 usage.

use std::path::PathBuf;
use std::process::ExitCode;

use gpuplex_client::config::{config_path, NodeConfig, CONFIG_ENV};

const USAGE: &str = "\
usage: containerd-shim-gpuplex-v1 serve [--config PATH]

Runs the gpuplex node service in the foreground: it finds this machine's GPUs, serves the node
socket, samples activity and freezes and thaws containers in their execution windows.
It stops on SIGTERM or SIGINT, thawing every container it froze.

  --config PATH   the configuration (default: $GPUPLEX_CONFIG, else /etc/gpuplex/gpuplex.toml;
                  an absent default file means every default)
  GPUPLEX_LOG     log filter (default: info; e.g. debug, gpuplex_node=debug)

Exit codes: 0 stopped by a signal, 1 could not start, 2 usage.";

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
    let env = std::env::var_os(CONFIG_ENV);
    let (path, named) = config_path(flag.as_deref(), env.as_deref());
    let config = match NodeConfig::load(&path, named) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("containerd-shim-gpuplex-v1: {e}");
            return ExitCode::from(1);
        }
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
