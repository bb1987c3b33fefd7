//! `containerd-shim-gpuplex-v1` as a containerd shim v2: containerd's task API over runc, with a
//! vGPU for the containers that ask for one.
//!
//! - [`shim`]: the shim's life (`start`, `delete`) behind `containerd_shim::Shim`, and
//!   [`daemon`]: the process that serves the task API (for containerd 1.6 to 2.x);
//! - [`service`]: the task API (`Create`, `Start`, `Exec`, `Kill`, `Wait`, ...) and its events;
//! - [`container`]: one container and what runc does to it; [`process`]: a process's lifecycle;
//! - [`stdio`]: the fifos containerd names, the pipes or terminal the process gets, the copying;
//! - [`options`]: the runtime options containerd's clients send, decoded;
//! - [`bundle`]: the bundle's config.json, read once per `Create` as a hostile file, whose
//!   vGPU `gpuplex_hook::classify` decides from that spec alone;
//! - [`vgpu`]: the node service, from the shim's side, behind one trait (reserve and edit,
//!   attach, hold, release); [`node_link`]: that trait over the real node socket;
//! - [`runtime`]: what the service has the OCI runtime do, one trait in front of runc;
//! - [`spawner`]: runc's invocations, waited for through the shim's reaper;
//! - [`metrics`]: `Stats`, from the container's cgroup files; [`oom`]: OOM kills as events;
//! - [`events`], [`error`].
//!
//! A container without a `gpuplex.io/` annotation is run exactly as containerd's runc shim
//! runs it; one with them gets the spec edit of podman's precreate hook
//! (`gpuplex_hook::stages::precreate`, without the hooks: the shim attaches and releases it).

mod bundle;
mod container;
mod daemon;
mod error;
mod events;
mod metrics;
mod node_link;
mod oom;
mod options;
mod process;
mod runtime;
mod service;
mod shim;
mod spawner;
mod stdio;
mod vgpu;

/// The runtime's name, as containerd's clients ask for it.
pub const RUNTIME_ID: &str = "io.containerd.gpuplex.v1";

/// Runs the shim as containerd invoked it (`-namespace ... -id ... start|delete`, or the daemon).
pub fn run() {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    match containerd_shim::parse(&args) {
        Ok(flags) if flags.action.is_empty() && !flags.info && !flags.version => {
            if let Err(why) = daemon::serve(&flags) {
                eprintln!("containerd-shim-gpuplex-v1: {why}");
                std::process::exit(1);
            }
        }
        _ => containerd_shim::run::<shim::GpuplexShim>(RUNTIME_ID, None),
    }
}
