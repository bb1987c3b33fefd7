//! `gpuplex.toml`, as every gpuplex program on the node reads it: the one reader is
//! `gpuplex-client`'s ([`gpuplex_client::config`]), re-exported here so that the node service
//! and the containerd shim name it `crate::config`.

pub use gpuplex_client::config::*;
