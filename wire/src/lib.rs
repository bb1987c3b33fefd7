//! Everything that crosses a process boundary between gpuplex's programs on a node, defined
//! once for both ends: the node protocol (typed requests and replies), the node socket's
//! client, `gpuplex.toml` (read and checked once, so that a file one program accepts, they all
//! accept, and read alike), the vGPU identity files a container sees, and what a container with
//! a vGPU gets.
//!
//! - [`protocol`]: the node socket's requests ([`protocol::Request`], written by clients with
//!   [`protocol::Request::to_line`] and read by the node service with
//!   [`protocol::parse_request`]) and replies ([`protocol::Reply`], [`protocol::VgpuReply`]),
//!   with the CDI edits a reservation carries ([`protocol::cdi`]);
//! - [`socket`]: [`NodeClient`], one request line and one reply line at a time, each answer
//!   read as the form its request is answered with; [`NodePool`], a few of them shared by the
//!   threads of a process that asks many things at once;
//! - [`config`]: `gpuplex.toml` ([`config::NodeConfig`]), where it is
//!   ([`config::config_path`]), every check of every key;
//! - [`identity`]: the vGPU identity files a container sees at `/run/gpuplex/vgpu.json`,
//!   written by the hook and the shim, removed by them or by the node service;
//! - [`stage`]: [`stage::Stage`], the step of a container's life the hook (or the shim's
//!   `Create`) acts at, named on the hook's command line and at the start of its errors;
//! - [`vgpu_edits`]: what a container with a vGPU gets (device nodes, `CUDA_VISIBLE_DEVICES`,
//!   the identity mounted), as CDI edits, defined once for the hook, the containerd shim and
//!   the DRA driver; the host's device nodes ([`protocol::DeviceNode`]) it is made of;
//! - [`attach_step`]: a Kubernetes claim's attach step, the `createRuntime` hook the DRA driver
//!   writes into a claim's CDI spec and the containerd shim takes out;
//! - [`annotations`]: the annotation keys gpuplex reads and writes on a container.
#![deny(missing_docs)]

pub mod annotations;
pub mod attach_step;
pub mod config;
pub mod identity;
pub mod protocol;
pub mod socket;
pub mod stage;
pub mod vgpu_edits;

pub use socket::pool::NodePool;
pub use socket::{ClientError, NodeClient, DEFAULT_SOCKET};
