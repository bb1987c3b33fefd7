//! `containerd-shim-gpuplex-v1`: containerd's shim v2 for gpuplex when containerd runs it
//! (`-namespace NS -address A -id ID start|delete`, and the daemon it starts), the node
//! service (`serve`), and the service's watchdog (`watchdog`, which the service starts itself).
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT after thawing everything; 1 could not start (one line
//! on stderr says why); 2 usage.

use std::path::PathBuf;
use std::process::ExitCode;

use gpuplex_shim::config::{config_path, NodeConfig, CONFIG_ENV};

const USAGE: &str = "\
usage: containerd-shim-gpuplex-v1 serve [--config PATH]

Runs the gpuplex node service in the foreground: it finds this machine's GPUs, serves the node
socket, samples activity and freezes and thaws containers in their execution windows.
It stops on SIGTERM or SIGINT, thawing every container it froze.

  --config PATH   the configuration (default: $GPUPLEX_CONFIG, else /etc/gpuplex/gpuplex.toml;
                  an absent default file means every default)
  GPUPLEX_LOG     log filter (default: info; e.g. debug, gpuplex_shim=debug)

Exit codes: 0 stopped by a signal, 1 could not start, 2 usage.";

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(command) = args.next() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match command.to_str() {
        Some("serve") => {}
        Some("watchdog") => {
            // Started by `serve` itself, with the pipe it watches on stdin.
            return match (args.next(), args.next(), args.next()) {
                (Some(flag), Some(dir), None) if flag == "--state-dir" => {
                    gpuplex_shim::service::watchdog::run(PathBuf::from(dir))
                }
                _ => {
                    eprintln!("containerd-shim-gpuplex-v1 watchdog: started by `serve`, as `watchdog --state-dir DIR`");
                    ExitCode::from(2)
                }
            };
        }
        Some("--help" | "-h" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("--version" | "-v") => {
            println!("containerd-shim-gpuplex-v1 {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(flag) if flag.starts_with('-') => {
            // containerd calls a shim as `-namespace NS -address A ... start|delete`.
            gpuplex_shim::task::run();
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("containerd-shim-gpuplex-v1: unknown command {command:?}; try --help");
            return ExitCode::from(2);
        }
    }
    let mut flag: Option<PathBuf> = None;
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--config") => match args.next() {
                Some(p) => flag = Some(PathBuf::from(p)),
                None => {
                    eprintln!(
                        "containerd-shim-gpuplex-v1 serve: --config needs a path; try --help"
                    );
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("containerd-shim-gpuplex-v1 serve: unknown argument {arg:?}; try --help");
                return ExitCode::from(2);
            }
        }
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
    match gpuplex_shim::service::serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("containerd-shim-gpuplex-v1: {e}");
            ExitCode::from(1)
        }
    }
}
