//! The node service as a process: `containerd-shim-gpuplex-v1 serve`, its signals, its
//! descriptors, the socket and the metrics endpoint started around the loop.

use std::sync::mpsc::{self, Sender};
use std::time::Duration;

use gpuplex_wire::config::NodeConfig;

use super::{socket, Event, Service, ServiceError, EXIT_SWEEP};

/// Raises the soft limit on open files to the hard one (the soft default, 1024, dates from
/// `select(2)`, which the service does not use), and lets the cgroup readers keep half of it.
pub(super) fn keep_descriptors() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    };
    gpuplex_cgroup::set_kept_budget(usize::try_from(soft / 2).unwrap_or(usize::MAX));
}

/// Runs the node service in the foreground until SIGTERM or SIGINT: the whole of
/// `containerd-shim-gpuplex-v1 serve`.
pub fn serve(config: NodeConfig) -> Result<(), ServiceError> {
    // SIGTERM and SIGINT are caught before anything else: one that comes while the service
    // starts (systemd's stop right after its start) waits in the channel and ends the service
    // as any other does, once it can thaw, instead of killing it half-started.
    let (events, inbox) = mpsc::channel();
    spawn_signal_thread(events.clone())?;
    // Taken (and made close-on-exec) before anything is started: the watchdog must not
    // inherit systemd's socket.
    let passed = socket::inherited(&config.service.socket)?;
    let mut service = Service::start(config)?;
    if let Some(watch) = &service.exit_watch {
        if let Err(e) = watch.spawn(events.clone()) {
            tracing::warn!("cannot watch exits ({e}): they are seen every {EXIT_SWEEP:?}");
        }
    }
    let path = &service.config.service.socket;
    let socket = match passed {
        Some(passed) => {
            tracing::info!("listening on {} (passed by systemd)", path.display());
            passed
        }
        None => {
            let bound = socket::bind(path)?;
            tracing::info!("listening on {} (mode 0600)", path.display());
            bound
        }
    };
    if !service.config.service.metrics_listen.is_empty() {
        let address = service.config.service.metrics_listen.clone();
        let listener =
            std::net::TcpListener::bind(&address).map_err(|source| ServiceError::Metrics {
                address: address.clone(),
                source,
            })?;
        if let Ok(local) = listener.local_addr() {
            tracing::info!("metrics: http://{local}/metrics");
        }
        let asker: Sender<Event> = events.clone();
        crate::metrics::serve(listener, crate::metrics::Limits::default(), move || {
            let (tx, rx) = mpsc::channel();
            asker.send(Event::Status(tx)).ok()?;
            rx.recv_timeout(Duration::from_secs(5)).ok()
        })
        .map_err(|source| ServiceError::Metrics { address, source })?;
    }
    socket::spawn_accept_loop(socket, events);
    service.run(inbox);
    Ok(())
}

fn spawn_signal_thread(events: Sender<Event>) -> Result<(), ServiceError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).map_err(ServiceError::Signals)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let name = if signal == SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGINT"
                };
                let _ = events.send(Event::Shutdown(name));
            }
        })
        .map_err(ServiceError::Signals)?;
    Ok(())
}
