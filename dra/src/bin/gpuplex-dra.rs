//! `gpuplex-dra`: gpuplex's kubelet plugin on one node (the DaemonSet runs it beside the node
//! service). With `[kubernetes] plugin = "dra"` (the default) it registers the DRA driver
//! `gpuplex.io` with the kubelet, prepares and unprepares the claims the kubelet hands it, and
//! keeps this node's ResourceSlice equal to its GPUs. With `plugin = "device-plugin"` it serves
//! the device plugin of `gpuplex.io/gpu-memory` instead, and needs no API server.
//!
//! Exit codes: 0 stopped by SIGTERM/SIGINT; 1 could not start (one line on stderr says why);
//! 2 usage.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use gpuplex_dra::apiserver::{self, keep_published, ApiClaims, SlicePublisher};
use gpuplex_dra::device_plugin::{
    self, DevicePlugin, DevicePluginPaths, PluginConfig, KUBELET_SOCKET,
};
use gpuplex_dra::driver::{Driver, DriverConfig};
use gpuplex_dra::kubelet::{self, Sockets, PLUGIN_DIR, REGISTRY_DIR};
use gpuplex_dra::slice::devices;
use gpuplex_scheduler::quantity::format_bytes;
use gpuplex_scheduler::time::parse_duration;
use gpuplex_scheduler::units::RESOURCE;
use gpuplex_wire::config::KubeletPlugin;
use gpuplex_wire::config::{config_path, NodeConfig, CONFIG_ENV};
use gpuplex_wire::NodeClient;

const USAGE: &str = "\
usage: gpuplex-dra [--config PATH] [--node NAME] [--cdi-dir DIR] [--hook PATH] [--registry-dir DIR] [--plugin-dir DIR] [--kubelet-socket PATH] [--poll DURATION]

Runs gpuplex's kubelet plugin on this node, the one gpuplex.toml's [kubernetes] plugin names:
  \"dra\"            the DRA driver gpuplex.io: registers with the kubelet, prepares the
                   ResourceClaims it is given as vGPUs pinned where kube-scheduler placed them,
                   and publishes this node's ResourceSlice;
  \"device-plugin\"  the device plugin of gpuplex.io/gpu-memory: lists each GPU's memory in
                   units, and pins the units the kubelet allocates as a vGPU on their GPU.
The node service must run on this node.

  --config PATH       gpuplex.toml (default: $GPUPLEX_CONFIG, else /etc/gpuplex/gpuplex.toml)
  --node NAME         this node's Kubernetes name (default: $NODE_NAME; the DaemonSet sets it)
  --cdi-dir DIR       where the container runtime reads CDI specs (default: /var/run/cdi)
  --hook PATH         gpuplex-hook on the host, the claims' attach step (default:
                      /usr/local/bin/gpuplex-hook, where the DaemonSet installs it)
  --registry-dir DIR  the kubelet's plugin registry (default: /var/lib/kubelet/plugins_registry)
  --plugin-dir DIR    this driver's socket directory (default: /var/lib/kubelet/plugins/gpuplex.io)
  --kubelet-socket PATH  the device plugin's: the kubelet's registration socket, beside which
                      its own goes (default: /var/lib/kubelet/device-plugins/kubelet.sock)
  --poll DURATION     the device plugin's: how often the kubelet's socket is looked at, and
                      the longest wait between tries to reach the node service again once its
                      watch is lost (the node's GPUs are not polled: the service sends each
                      change) (default: 2s)
  GPUPLEX_LOG         log filter (default: info)

The API server is found as kubectl finds it: in a pod, its service account; else $KUBECONFIG.
Exit codes: 0 stopped by a signal, 1 could not start, 2 usage.";

/// How often the node's GPUs are compared with the published slice.
const REPUBLISH: Duration = Duration::from_secs(30);

struct Args {
    config: Option<PathBuf>,
    node: Option<String>,
    cdi_dir: PathBuf,
    hook: PathBuf,
    registry_dir: PathBuf,
    plugin_dir: PathBuf,
    kubelet_socket: PathBuf,
    poll: Duration,
}

fn parse() -> Result<Option<Args>, String> {
    use lexopt::prelude::*;
    let mut args = Args {
        config: None,
        node: None,
        cdi_dir: PathBuf::from("/var/run/cdi"),
        hook: PathBuf::from("/usr/local/bin/gpuplex-hook"),
        registry_dir: PathBuf::from(REGISTRY_DIR),
        plugin_dir: PathBuf::from(PLUGIN_DIR),
        kubelet_socket: PathBuf::from(KUBELET_SOCKET),
        poll: Duration::from_secs(2),
    };
    let mut parser = lexopt::Parser::from_env();
    while let Some(arg) = parser.next().map_err(|e| e.to_string())? {
        let path = |parser: &mut lexopt::Parser| -> Result<PathBuf, String> {
            parser.value().map(PathBuf::from).map_err(|e| e.to_string())
        };
        match arg {
            Short('h') | Long("help") => return Ok(None),
            Long("config") => args.config = Some(path(&mut parser)?),
            Long("cdi-dir") => args.cdi_dir = path(&mut parser)?,
            Long("hook") => args.hook = path(&mut parser)?,
            Long("registry-dir") => args.registry_dir = path(&mut parser)?,
            Long("plugin-dir") => args.plugin_dir = path(&mut parser)?,
            Long("kubelet-socket") => args.kubelet_socket = path(&mut parser)?,
            Long("poll") => {
                let value = parser.value().map_err(|e| e.to_string())?;
                let value = value.into_string().map_err(|_| "--poll: not UTF-8")?;
                args.poll = parse_duration(&value)
                    .ok()
                    .filter(|d| !d.is_zero() && *d <= Duration::from_secs(3600))
                    .ok_or_else(|| {
                        format!("--poll {value:?}: expected a duration from 1ms to 1h, like \"2s\"")
                    })?;
            }
            Long("node") => {
                let value = parser.value().map_err(|e| e.to_string())?;
                args.node = Some(value.into_string().map_err(|_| "--node: not UTF-8")?);
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(why) => {
            eprintln!("gpuplex-dra: {why}; try --help");
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
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("gpuplex-dra: {why}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let env = std::env::var_os(CONFIG_ENV);
    let (path, named) = config_path(args.config.as_deref(), env.as_deref());
    let config = NodeConfig::load(&path, named).map_err(|e| e.to_string())?;
    let node = match args.node.or_else(|| std::env::var("NODE_NAME").ok()) {
        Some(node) if !node.is_empty() => node,
        _ => return Err("no node name: give --node NAME or set NODE_NAME (the DaemonSet sets it from spec.nodeName)".into()),
    };
    let socket = config.service.socket.clone();
    let runtime = tokio::runtime::Runtime::new().map_err(|e| format!("cannot start: {e}"))?;
    if config.kubernetes.plugin == KubeletPlugin::DevicePlugin {
        let plugin = DevicePlugin::new(PluginConfig {
            node: node.clone(),
            socket,
            unit: config.kubernetes.gpu_memory_unit,
            delivery: config.kubernetes.device_plugin_devices,
            policy: config.scheduler.policy,
            cdi_dir: args.cdi_dir,
            hook: args.hook,
            control_nodes: gpuplex_wire::vgpu_edits::control_nodes(),
            poll: args.poll,
        });
        let paths = DevicePluginPaths {
            kubelet: args.kubelet_socket,
        };
        tracing::info!(
            "{RESOURCE} on node {node}: units of {}, serving {} beside the kubelet's {}",
            format_bytes(config.kubernetes.gpu_memory_unit),
            paths.plugin().display(),
            paths.kubelet.display()
        );
        return runtime.block_on(async move {
            tokio::spawn(plugin.clone().keep_fresh());
            device_plugin::serve(plugin, &paths, args.poll, stopped())
                .await
                .map_err(|e| format!("cannot serve the device plugin's socket: {e}"))
        });
    }
    runtime.block_on(async move {
        let kube_config = kube::Config::infer()
            .await
            .map_err(|e| format!("cannot find the API server: {e}"))?;
        let client = apiserver::client(kube_config)?;
        let driver = Driver::new(
            ApiClaims::new(client.clone()),
            DriverConfig {
                node: node.clone(),
                socket: socket.clone(),
                cdi_dir: args.cdi_dir,
                control_nodes: gpuplex_wire::vgpu_edits::control_nodes(),
                hook: args.hook,
            },
        );
        let publisher = SlicePublisher::new(client, &node);
        let status_socket = socket.clone();
        tokio::spawn(keep_published(publisher, REPUBLISH, move || {
            let status = tokio::task::block_in_place(|| {
                NodeClient::connect(&status_socket).and_then(|mut c| c.status())
            });
            match status {
                Ok(status) => Some(devices(&status.gpus)),
                Err(e) => {
                    tracing::warn!("the node's GPUs are not known: {e}");
                    None
                }
            }
        }));
        let sockets = Sockets::under(&args.registry_dir, &args.plugin_dir);
        tracing::info!(
            "gpuplex.io on node {node}: registration {}, service {}",
            sockets.registration.display(),
            sockets.dra.display()
        );
        kubelet::serve(driver, &sockets, stopped())
            .await
            .map_err(|e| format!("cannot serve the kubelet's sockets: {e}"))
    })
}

/// Completes at SIGTERM or SIGINT.
async fn stopped() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM can be watched");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping on a signal");
}
