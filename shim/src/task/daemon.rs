//! The shim's daemon: the process `start` spawns, serving the task API on its socket until
//! containerd shuts it down, or, when containerd asks it for no container within a minute
//! (containerd died between `start` and `Create`), until then.
//!
//! `containerd_shim::run` serves only `containerd.task.v3.Task` (containerd 2.x); containerd
//! 1.6 and 1.7 call `containerd.task.v2.Task`, whose messages are the same. So the daemon is
//! started here, serving the one task service under both names; `start` and `delete` stay
//! with `containerd_shim::run`.

use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::monitor::monitor_notify_by_pid;
use containerd_shim::protos::shim_sync::create_task;
use containerd_shim::protos::ttrpc::{self, Server};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, Flags, Shim};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use signal_hook::consts::{SIGCHLD, SIGINT, SIGPIPE, SIGTERM};
use signal_hook::iterator::Signals;

use super::shim::GpuplexShim;

/// The task API's service names: containerd 2.x's, and 1.6's and 1.7's.
const TASK_V3: &str = "/containerd.task.v3.Task/";
const TASK_V2: &str = "/containerd.task.v2.Task/";

/// How long a shim that containerd has asked for no container waits for one before it ends.
const NEVER_ASKED_EXIT: Duration = Duration::from_secs(60);

/// Why the daemon could not serve: one line, on its stderr (which containerd logs).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Its own set-up: signals, the subreaper, the socket.
    #[error("cannot {action}: {source}")]
    Io {
        /// What the daemon was doing.
        action: String,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// containerd did not say where its events go.
    #[error("TTRPC_ADDRESS is not set")]
    NoAddress,
    /// containerd's events socket cannot be reached.
    #[error("cannot reach containerd at {address}: {source}")]
    Containerd {
        /// `TTRPC_ADDRESS`.
        address: String,
        /// Why not.
        #[source]
        source: containerd_shim::Error,
    },
    /// The ttrpc server would not start.
    #[error("cannot serve {path}: {source}")]
    Serve {
        /// The task socket.
        path: String,
        /// Why not.
        #[source]
        source: ttrpc::Error,
    },
}

fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let action = action.into();
    move |source| DaemonError::Io { action, source }
}

/// Serves the task API on `flags.socket` until containerd shuts the shim down.
pub fn serve(flags: &Flags) -> Result<(), DaemonError> {
    // Before any child exists: every exit reaches the monitor.
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGPIPE, SIGCHLD]).map_err(io("watch signals"))?;
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| io("become a subreaper")(std::io::Error::from(e)))?;
    let _ = containerd_shim::logger::init(flags.debug, "info", &flags.namespace, &flags.id);

    let address = std::env::var("TTRPC_ADDRESS").map_err(|_| DaemonError::NoAddress)?;
    let publisher = RemotePublisher::new(&address).map_err(|source| DaemonError::Containerd {
        address: address.clone(),
        source,
    })?;
    let mut shim = GpuplexShim::new(super::RUNTIME_ID, flags, &mut Config::default());
    // SIGTERM or SIGINT ends the daemon as a Shutdown would, whatever containers remain (as
    // containerd's runc shim does; containerd cleans up after it with `delete`).
    let exit = shim.exit_signal();
    std::thread::spawn(move || {
        for signal in signals.forever() {
            match signal {
                SIGCHLD => reap(),
                SIGTERM | SIGINT => {
                    tracing::info!("stopping on signal {signal}");
                    exit.signal();
                }
                _ => {}
            }
        }
    });
    let service = shim.create_task_service(publisher);
    let task: Arc<dyn containerd_shim::Task + Send + Sync> = Arc::new(service.clone());
    let mut methods: HashMap<String, Box<dyn ttrpc::MethodHandler + Send + Sync>> = HashMap::new();
    for (name, handler) in create_task(Arc::clone(&task)) {
        methods.insert(name.replacen(TASK_V3, TASK_V2, 1), handler);
    }
    methods.extend(create_task(task));

    let path = flags
        .socket
        .strip_prefix("unix://")
        .unwrap_or(&flags.socket);
    let listener = match listen(path)? {
        Some(listener) => listener,
        // Another daemon of this group serves the socket already.
        None => {
            started();
            return Ok(());
        }
    };
    let serving = |source| DaemonError::Serve {
        path: path.to_owned(),
        source,
    };
    let mut server = Server::new()
        .add_listener(listener.into_raw_fd())
        .map_err(serving)?
        .register_service(methods);
    server.start().map_err(serving)?;
    started();
    service.exit_if_never_asked(NEVER_ASKED_EXIT);
    shim.wait();
    server.shutdown();
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// Binds the socket; `None` when a live server holds it, a stale socket file is replaced.
fn listen(path: &str) -> Result<Option<UnixListener>, DaemonError> {
    if let Some(parent) = Path::new(path).parent() {
        std::fs::create_dir_all(parent).map_err(io(format!("create {}", parent.display())))?;
    }
    match UnixListener::bind(path) {
        Ok(listener) => Ok(Some(listener)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Ok(None);
            }
            let _ = std::fs::remove_file(path);
            UnixListener::bind(path)
                .map(Some)
                .map_err(io(format!("listen on {path}")))
        }
        Err(e) => Err(io(format!("listen on {path}"))(e)),
    }
}

/// Tells `start` (which reads this process's stdout to its end) that the socket is served.
fn started() {
    let _ = nix::unistd::dup2_stdout(std::io::stderr());
}

/// Reaps every exited child and tells the exit monitor.
fn reap() {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => {
                let _ = monitor_notify_by_pid(pid.as_raw(), code);
            }
            Ok(WaitStatus::Signaled(pid, signal, _)) => {
                let _ = monitor_notify_by_pid(pid.as_raw(), 128 + signal as i32);
            }
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
