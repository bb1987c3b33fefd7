//! `gpuplex-nri`: gpuplex's NRI plugin. It connects to the runtime's NRI socket, registers,
//! and gives the containers that ask for a vGPU theirs (see `gpuplex_nri::plugin`); when the
//! runtime goes away (a restart, a stop), it connects again as soon as the socket answers.
//! Launched by the runtime itself (NRI's plugin directory), it serves the connection the
//! runtime passed and exits with it.
//!
//! Exit codes: 0 the runtime ended a connection it passed; 1 could not start (one line on
//! stderr says why); 2 usage.

use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use gpuplex_hook::stages::HookContext;
use gpuplex_nri::node::NodeSocket;
use gpuplex_nri::plugin::{Plugin, SHIM_HANDLER};
use gpuplex_nri::session::{self, Registration, SessionEnd};
use gpuplex_wire::config::{config_path, CONFIG_ENV};
use gpuplex_wire::stage::Stage;

const USAGE: &str = "\
usage: gpuplex-nri [--config PATH] [--nri-socket PATH] [--name NAME] [--index NN] [--shim-handler NAME]

Runs gpuplex's NRI plugin: containers of containerd (1.7 with NRI enabled, 2.x) or CRI-O that
ask for a vGPU (gpuplex.io/ pod annotations, or the device plugin's gpuplex.io/gpu-memory)
get it, and take turns on its GPUs, with the runtime's own shim (runc's) left in place.
The node service must run on this node.

  --config PATH      gpuplex.toml (default: $GPUPLEX_CONFIG, else /etc/gpuplex/gpuplex.toml)
  --nri-socket PATH  the runtime's NRI socket (default: /var/run/nri/nri.sock)
  --name NAME        the plugin's name (default: gpuplex)
  --index NN         its place among the runtime's plugins, two digits (default: 10)
  --shim-handler NAME  the runtime handler of gpuplex's own shim, whose pods the shim serves
                     and the plugin leaves alone (default: gpuplex)
  GPUPLEX_LOG        log filter (default: info)

Exit codes: 0 the runtime ended the connection it passed (NRI_PLUGIN_SOCKET), 1 could not
start, 2 usage.";

/// The longest wait between tries to reach the runtime's socket.
const RETRY_MAX: Duration = Duration::from_secs(2);
/// The first wait.
const RETRY_MIN: Duration = Duration::from_millis(100);

struct Args {
    config: Option<PathBuf>,
    socket: PathBuf,
    registration: Registration,
    shim_handler: String,
}

fn parse() -> Result<Option<Args>, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        config: None,
        socket: PathBuf::from("/var/run/nri/nri.sock"),
        registration: Registration {
            name: std::env::var("NRI_PLUGIN_NAME").unwrap_or_else(|_| "gpuplex".into()),
            index: std::env::var("NRI_PLUGIN_IDX").unwrap_or_else(|_| "10".into()),
        },
        shim_handler: SHIM_HANDLER.to_owned(),
    };
    let mut parser = lexopt::Parser::from_env();
    fn value(parser: &mut lexopt::Parser, flag: &str, what: &str) -> Result<String, String> {
        (parser.value().map_err(|_| format!("{flag} needs {what}"))?)
            .into_string()
            .map_err(|_| format!("{flag}: not UTF-8"))
    }
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        match arg {
            Short('h') | Long("help") => {
                println!("{USAGE}");
                return Ok(None);
            }
            Long("config") => args.config = Some(value(&mut parser, "--config", "a path")?.into()),
            Long("nri-socket") => {
                args.socket = value(&mut parser, "--nri-socket", "a path")?.into()
            }
            Long("name") => args.registration.name = value(&mut parser, "--name", "a name")?,
            Long("index") => args.registration.index = value(&mut parser, "--index", "two digits")?,
            Long("shim-handler") => {
                args.shim_handler = value(&mut parser, "--shim-handler", "a handler's name")?
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    let index = &args.registration.index;
    if index.len() != 2 || !index.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("--index {index:?}: NRI wants two digits, 00 to 99"));
    }
    let name = &args.registration.name;
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(format!(
            "--name {name:?}: letters, digits, '-', '_' and '.' only"
        ));
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(Some(args)) => args,
        Ok(None) => return ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("gpuplex-nri: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUPLEX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let env = std::env::var_os(CONFIG_ENV);
    let (path, named) = config_path(args.config.as_deref(), env.as_deref());
    let ctx = match HookContext::from_config(Stage::Precreate, named.then_some(path.as_path())) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("gpuplex-nri: {}", e.message);
            return ExitCode::FAILURE;
        }
    };
    tracing::info!("node service at {}", ctx.socket.display());
    let mut plugin = Plugin::new(NodeSocket::new(ctx)).with_shim_handler(&args.shim_handler);
    match passed_socket() {
        Ok(Some(trunk)) => {
            serve(trunk, &args.registration, &mut plugin);
            ExitCode::SUCCESS
        }
        Ok(None) => keep_connected(&args, &mut plugin),
        Err(why) => {
            eprintln!("gpuplex-nri: {why}");
            ExitCode::FAILURE
        }
    }
}

/// The connection the runtime passed (`NRI_PLUGIN_SOCKET`, a file descriptor), when it
/// launched the plugin itself.
fn passed_socket() -> Result<Option<UnixStream>, String> {
    let Ok(fd) = std::env::var("NRI_PLUGIN_SOCKET") else {
        return Ok(None);
    };
    let fd: i32 = fd
        .parse()
        .map_err(|_| format!("NRI_PLUGIN_SOCKET={fd:?} is not a file descriptor"))?;
    // SAFETY: the runtime that started this process passed this descriptor as the plugin's
    // connection; nothing else in the process owns it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    Ok(Some(stream))
}

/// Connects to the runtime's socket again and again, for ever.
fn keep_connected(args: &Args, plugin: &mut Plugin<NodeSocket>) -> ExitCode {
    let mut wait = RETRY_MIN;
    let mut said = false;
    loop {
        match UnixStream::connect(&args.socket) {
            Ok(trunk) => {
                said = false;
                wait = RETRY_MIN;
                serve(trunk, &args.registration, plugin);
            }
            Err(e) if !said => {
                tracing::warn!(
                    "cannot reach the runtime's NRI socket {} ({e}); trying again until it answers (is NRI enabled in containerd's config?)",
                    args.socket.display()
                );
                said = true;
            }
            Err(_) => {}
        }
        std::thread::sleep(wait);
        wait = (wait * 2).min(RETRY_MAX);
    }
}

/// One session, logged.
fn serve(trunk: UnixStream, registration: &Registration, plugin: &mut Plugin<NodeSocket>) {
    let registered = || {
        tracing::info!(
            "registered with the runtime as {}-{}",
            registration.index,
            registration.name
        )
    };
    match session::run(trunk, registration, plugin, registered) {
        Ok(SessionEnd::Closed) => tracing::info!("the runtime closed the NRI connection"),
        Ok(SessionEnd::Shutdown) => tracing::info!("the runtime shut the plugin down"),
        Err(e) => tracing::warn!("the NRI connection ended: {e}"),
    }
}
