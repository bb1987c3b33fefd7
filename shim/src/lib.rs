//! gpuplex's node side: the service that holds this machine's scheduler and enforces it, and the
//! tools around it.
//!
//! The decisions live in `gpuplex-scheduler` (pure); this crate does the I/O around them:
//!
//! - [`config`]: `gpuplex.toml`, read and checked (by `gpuplex-client`, which `gpuplexctl` and
//!   the hook use too);
//! - [`gpus`]: which GPUs this machine has (NVML through [`nvml`], or `[[fake_gpu]]` entries);
//! - [`activity`]: which containers have GPU work now (`nvml`, `cpu`, `always`);
//! - [`state`]: the registrations on disk, written atomically, read back after a restart;
//! - [`service`]: the node service's loop, its socket and its signals;
//! - [`metrics`]: the Prometheus endpoint;
//! - [`cdi`]: the GPUs' CDI specs, read and checked, and each reservation's edits chosen;
//! - [`task`]: the containerd shim v2 (containerd's task API over runc).
#![deny(missing_docs)]

pub mod activity;
pub mod cdi;
pub mod config;
pub mod gpus;
pub mod metrics;
pub mod nvml;
pub mod service;
pub mod state;
pub mod task;
