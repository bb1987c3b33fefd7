//! The `[scheduler]` section of gpuplex.toml (placeholder being written).
use std::time::Duration;
/// Scheduler settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Window length for weight 1.
    pub slice: Duration,
    /// No work for this long ends a window.
    pub idle_grace: Duration,
}
impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { slice: Duration::from_millis(200), idle_grace: Duration::from_millis(100) }
    }
}
