//! The fuzz targets' bodies, one function per target ([`bodies`]). The targets in
//! `fuzz_targets/` call them; `tests/tests/fuzz_regressions.rs` in the main workspace includes
//! the same file to replay `regressions/<target>/` on stable Rust.

pub mod bodies;
