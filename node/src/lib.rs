//! The gpuplex node service: it holds this machine's scheduler and enforces it.
//!
//! The decisions live in `gpuplex-scheduler` (pure); this crate does the I/O around them:
//!
//! - [`gpus`]: which GPUs this machine has (NVML through [`nvml`], or `[[fake_gpu]]` entries);
//! - [`activity`]: which containers have GPU work now (`nvml`, `cpu`, `always`);
//! - [`state`]: the registrations on disk, written atomically, read back after a restart;
//! - [`service`]: the node service's loop, its socket, its signals and its watchdog;
//! - [`metrics`]: the Prometheus endpoint;
//! - [`cdi`]: the GPUs' CDI specs, read and checked, and each reservation's edits chosen.
//!
//! `gpuplex.toml` is read by `gpuplex-wire`, as every gpuplex program on the node reads it.
//! The binary is `containerd-shim-gpuplex-v1 serve` (package `gpuplex-shim`), which calls
//! [`service::serve`].
#![deny(missing_docs)]

mod activity;
mod cdi;
mod gpus;
mod metrics;
pub mod nvml;
pub mod service;
pub mod state;
