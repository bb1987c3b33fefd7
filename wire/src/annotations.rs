//! The annotation keys gpuplex's programs read and write on a container, as every program that
//! crosses a process boundary uses them (the hook, the containerd shim, the DRA driver).
//!
//! They are defined beside their parser, in [`gpuplex_scheduler::request`] (which reads a
//! container's request from them), and re-exported here, so that there is one definition and
//! every program names them through the wire crate. The scheduler cannot name the wire crate
//! (the wire crate depends on it), so the definitions cannot move here.

pub use gpuplex_scheduler::request::{
    ALLOCATION, GPUS, GPU_MEMORY, GPU_MODEL, POD_NAMESPACE_KEYS, POD_NAME_KEYS, PREFIX, PRIORITY,
    REQUEST_KEYS, SET_BY_GPUPLEX, VGPU_HANDLE, VGPU_ID, WEIGHT,
};
