//! The simulator's report: what each container received and waited, what each GPU did.
//!
//! Serialized as pretty JSON with a fixed key order (the fields' order below) and every float
//! rounded to the microsecond, so a scenario and seed always print byte-identical reports.

use serde::Serialize;

/// The outcome of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// Virtual time replayed, in seconds.
    pub duration: f64,
    /// The seed of the demand draws.
    pub seed: u64,
    /// One entry per container, in file order.
    pub containers: Vec<ContainerReport>,
    /// One entry per GPU, by index.
    pub gpus: Vec<GpuReport>,
}

/// What one container received and waited. Statistics are `None` (JSON `null`) for a container
/// that was rejected.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ContainerReport {
    /// Its name.
    pub name: String,
    /// The GPUs it was assigned (empty when rejected).
    pub gpus: Vec<u32>,
    /// Its weight.
    pub weight: u32,
    /// Its priority: `high`, `normal` or `low`.
    pub priority: &'static str,
    /// Ground truth: seconds it used its GPUs, summed over them (a GPU shared by k running
    /// containers gives each 1/k).
    pub gpu_seconds: Option<f64>,
    /// Seconds it wanted the GPU (frozen or not).
    pub demand_seconds: Option<f64>,
    /// Its GPU time divided by the busy time of its GPUs while it had demand; `None` when it
    /// never had demand.
    pub share: Option<f64>,
    /// Total seconds frozen waiting for a window.
    pub wait_seconds: Option<f64>,
    /// Median wait, seconds.
    pub wait_p50: Option<f64>,
    /// 95th percentile wait, seconds.
    pub wait_p95: Option<f64>,
    /// 99th percentile wait, seconds.
    pub wait_p99: Option<f64>,
    /// Longest wait, seconds.
    pub max_wait: Option<f64>,
    /// Execution windows granted.
    pub windows: Option<u64>,
    /// Bursts of demand (from idle to wanting the GPU) that were given a window.
    pub bursts: Option<u64>,
    /// Median wait of a burst from its start to its first window, seconds.
    pub burst_wait_p50: Option<f64>,
    /// 99th percentile of that wait, seconds.
    pub burst_wait_p99: Option<f64>,
    /// Bursts that began while the container was frozen: its previous burst ended in the last
    /// moments of a window, unseen before the window ended, and the new one waits for the
    /// container's next turn (the scheduler cannot see work begin in a frozen container).
    pub bursts_begun_frozen: Option<u64>,
    /// The 99th percentile wait of the bursts that began while the container ran, seconds.
    pub running_burst_wait_p99: Option<f64>,
    /// Bursts that ended before a window was given: short ones, run while not frozen.
    pub bursts_unwindowed: Option<u64>,
    /// Why it could not be assigned GPUs, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
    /// The share the scheduling rules promise it, averaged over the time it had demand: at each
    /// instant, `high` containers that want a GPU split it evenly; otherwise the highest class
    /// that wants it shares it by weight (weight / Σ weights), and lower classes get nothing.
    /// Shown by the timeline next to `share`; not part of the JSON report.
    #[serde(skip)]
    pub fair_share: Option<f64>,
}

/// What one GPU did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuReport {
    /// Its index.
    pub index: u32,
    /// Its model.
    pub model: String,
    /// Ground truth: the fraction of the run during which some container used it.
    pub busy_fraction: f64,
    /// Ground truth: the fraction of the time some container wanted it during which some
    /// container used it (1 when none ever wanted it).
    pub busy_while_wanted: f64,
    /// Windows that passed from one vGPU to another (the scheduler's count).
    pub switches: u64,
}

impl Report {
    /// Pretty JSON, keys in a fixed order, followed by a newline.
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self)
            .expect("a report holds only finite numbers and text");
        text.push('\n');
        text
    }
}

/// Rounds seconds to the microsecond.
pub(crate) fn micros(seconds: f64) -> f64 {
    (seconds * 1e6).round() / 1e6
}

/// The name of a priority, as written in annotations.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_keys_keep_their_order_and_rejections_show() {
        let report = Report {
            duration: 1.0,
            seed: 3,
            containers: vec![ContainerReport {
                name: "a".into(),
                gpus: vec![],
                weight: 2,
                priority: "low",
                gpu_seconds: None,
                demand_seconds: None,
                share: None,
                wait_seconds: None,
                wait_p50: None,
                wait_p95: None,
                wait_p99: None,
                max_wait: None,
                windows: None,
                bursts: None,
                burst_wait_p50: None,
                burst_wait_p99: None,
                bursts_begun_frozen: None,
                running_burst_wait_p99: None,
                bursts_unwindowed: None,
                rejected: Some("no GPU fits".into()),
                fair_share: Some(0.5),
            }],
            gpus: vec![GpuReport {
                index: 0,
                model: "m".into(),
                busy_fraction: micros(1.0 / 3.0),
                busy_while_wanted: 0.5,
                switches: 4,
            }],
        };
        let json = report.to_json();
        let keys = [
            "\"duration\"",
            "\"seed\"",
            "\"containers\"",
            "\"name\"",
            "\"gpus\"",
            "\"weight\"",
            "\"priority\"",
            "\"gpu_seconds\"",
            "\"demand_seconds\"",
            "\"share\"",
            "\"wait_seconds\"",
            "\"wait_p50\"",
            "\"wait_p95\"",
            "\"wait_p99\"",
            "\"max_wait\"",
            "\"windows\"",
            "\"bursts\"",
            "\"burst_wait_p50\"",
            "\"burst_wait_p99\"",
            "\"bursts_unwindowed\"",
            "\"rejected\"",
            "\"index\"",
            "\"model\"",
            "\"busy_fraction\"",
            "\"busy_while_wanted\"",
            "\"switches\"",
        ];
        let positions: Vec<usize> = keys.iter().map(|k| json.find(k).expect(k)).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{json}");
        assert!(json.contains("\"busy_fraction\": 0.333333"), "{json}");
        assert!(json.contains("\"share\": null"), "{json}");
        assert!(!json.contains("fair_share"), "{json}");
        assert!(json.ends_with("}\n"));
    }

    #[test]
    fn rounds_to_microseconds() {
        assert_eq!(micros(1.234_567_89), 1.234_568);
        assert_eq!(micros(0.000_000_4), 0.0);
    }
}
