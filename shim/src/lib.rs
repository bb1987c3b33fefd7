//! gpuplex's containerd shim v2: containerd's task API over runc, with a vGPU for each container
//! that asks for one ([`task`]).
//!
//! Its binary, `containerd-shim-gpuplex-v1`, is also how the node service runs
//! (`serve`, `watchdog`: `gpuplex-node`), so that a node installs one program.
#![deny(missing_docs)]

pub mod task;
