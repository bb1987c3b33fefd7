//! Accounting: what each vGPU received and waited, what each GPU did.
//!
//! Waits are kept as a log-bucketed histogram (16 buckets per power of two, so a percentile is
//! within about 3% of the true value) in fixed memory, however long a vGPU lives.

use std::collections::BTreeMap;
use std::time::Duration;

/// What one vGPU received and waited, as the scheduler saw it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VgpuStats {
    /// GPU time: seconds on each GPU while running with work, summed over its GPUs (a 2-GPU vGPU
    /// running 1 s alone accrues 2 s); shared evenly while several run on one GPU.
    pub gpu_time: Duration,
    /// Execution windows granted (a window extended because nobody else waited is not a new one).
    pub windows: u64,
    /// Total time frozen waiting for a window.
    pub wait_time: Duration,
    /// The distribution of completed waits.
    pub waits: WaitHistogram,
}

/// What one GPU did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuStats {
    /// Time during which some vGPU ran on it with work.
    pub busy_time: Duration,
    /// Windows that passed from one vGPU to a different one.
    pub switches: u64,
}

const SUB_BUCKET_BITS: u32 = 4;
const SUB_BUCKETS: u64 = 1 << SUB_BUCKET_BITS;

/// A histogram of wait durations with microsecond resolution and ~3% relative error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WaitHistogram {
    buckets: BTreeMap<u16, u64>,
    count: u64,
    max: Duration,
}

impl WaitHistogram {
    /// Records one wait.
    pub fn record(&mut self, wait: Duration) {
        let micros = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
        *self.buckets.entry(bucket_of(micros)).or_insert(0) += 1;
        self.count += 1;
        self.max = self.max.max(wait);
    }

    /// Number of waits recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The longest wait recorded (exact).
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The `q`-quantile (0.0..=1.0) of the recorded waits, or zero when there are none. The
    /// result is the middle of the bucket holding it, capped at the exact maximum.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let q = if q.is_nan() { 1.0 } else { q.clamp(0.0, 1.0) };
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        if rank == self.count {
            return self.max;
        }
        let mut seen = 0;
        for (&bucket, &n) in &self.buckets {
            seen += n;
            if seen >= rank {
                let (lo, hi) = bounds_of(bucket);
                let mid = lo + (hi - lo) / 2;
                return Duration::from_micros(mid).min(self.max);
            }
        }
        self.max
    }
}

/// Values below `SUB_BUCKETS` get a bucket each; above, each power of two is split into
/// `SUB_BUCKETS` equal parts.
fn bucket_of(micros: u64) -> u16 {
    if micros < SUB_BUCKETS {
        return micros as u16;
    }
    let msb = 63 - micros.leading_zeros();
    let shift = msb - SUB_BUCKET_BITS;
    let sub = (micros >> shift) - SUB_BUCKETS;
    ((shift + 1) as u64 * SUB_BUCKETS + sub) as u16
}

/// The half-open range `[lo, hi)` of microseconds in a bucket.
fn bounds_of(bucket: u16) -> (u64, u64) {
    let bucket = u64::from(bucket);
    if bucket < SUB_BUCKETS {
        return (bucket, bucket + 1);
    }
    let shift = bucket / SUB_BUCKETS - 1;
    let sub = bucket % SUB_BUCKETS;
    let lo = (SUB_BUCKETS + sub) << shift;
    (lo, lo.saturating_add(1 << shift))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_tile_the_line() {
        let mut expected_lo = 0;
        for bucket in 0..=bucket_of(u64::MAX) {
            let (lo, hi) = bounds_of(bucket);
            assert_eq!(lo, expected_lo, "bucket {bucket}");
            assert!(hi > lo);
            assert_eq!(bucket_of(lo), bucket);
            assert_eq!(bucket_of(hi - 1), bucket);
            expected_lo = hi;
        }
    }

    #[test]
    fn quantiles_are_within_three_percent() {
        let mut h = WaitHistogram::default();
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        for (q, exact_ms) in [(0.5, 500.0), (0.95, 950.0), (0.99, 990.0)] {
            let got = h.quantile(q).as_secs_f64() * 1000.0;
            assert!(
                (got - exact_ms).abs() / exact_ms < 0.03,
                "q{q}: {got} vs {exact_ms}"
            );
        }
        assert_eq!(h.max(), Duration::from_millis(1000));
        assert_eq!(h.quantile(1.0), Duration::from_millis(1000));
        assert_eq!(h.count(), 1000);
    }

    #[test]
    fn empty_and_single() {
        let mut h = WaitHistogram::default();
        assert_eq!(h.quantile(0.5), Duration::ZERO);
        h.record(Duration::from_micros(7));
        assert_eq!(h.quantile(0.0), Duration::from_micros(7));
        assert_eq!(h.quantile(0.99), Duration::from_micros(7));
    }
}
