//! How a program on the node finds and talks to the gpuplex node service: `gpuplex.toml` read
//! and checked once, and the node socket's client. The node service, the containerd shim, the
//! hook and `gpuplexctl` all read the configuration here, so a file one of them accepts, they
//! all accept, and read alike.
//!
//! - [`config`]: `gpuplex.toml` ([`config::NodeConfig`]), where it is
//!   ([`config::config_path`]), every check of every key;
//! - [`socket`]: [`NodeClient`], one request line and one reply line at a time, each request
//!   the core's typed [`gpuplex_scheduler::protocol::Request`];
//! - [`identity`]: the vGPU identity files a container sees at `/run/gpuplex/vgpu.json`,
//!   written by the hook and the shim, removed by them or by the node service.
#![deny(missing_docs)]

pub mod config;
pub mod identity;
pub mod socket;

pub use socket::{ClientError, NodeClient, DEFAULT_SOCKET};
