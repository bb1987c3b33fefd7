//! A deterministic simulator: replays a scenario of GPUs and containers against the real node
//! (the same `Node` the node service holds: inventory, window scheduler, registrations), in virtual time, and reports who got how much of which GPU
//! and how long each waited.
//!
//! - [`scenario`]: the TOML scenario format, read and checked key by key.
//! - [`demand`]: when each container wants the GPU (busy, idle, periodic, exponential).
//! - [`run()`]: the event loop.
//! - [`report`]: the JSON report.
//! - [`timeline`]: the text timeline `gpuplex-sim --timeline` prints.
//!
//! Demand is ground truth and open loop: a container wants the GPU during the periods its demand
//! model says, frozen or not. The scheduler only sees what the node service would: an activity
//! sample every `sample_interval` saying whether each container worked (ran unfrozen with demand)
//! since the previous sample. The report compares the two: the GPU time each container really
//! got, against the waits and windows the scheduler accounted.
//!
//! Same scenario, same seed: byte-identical report. There is no clock, no thread and no I/O.

pub mod demand;
pub mod report;
mod run;
pub mod scenario;
pub mod timeline;

pub use demand::Demand;
pub use report::{ContainerReport, GpuReport, Report};
pub use run::{run, run_with_timeline};
pub use scenario::{ContainerSpec, GpuSpec, Scenario, ScenarioError};
pub use timeline::{default_resolution, ResolutionError, Timeline};
