//! Demand models: when a simulated container has GPU work (ground truth, open loop).
//!
//! A container's demand is a function of time between its start and its stop, fixed by the
//! scenario and the seed, whatever the scheduler does: a frozen container does not fall behind
//! and catch up later, it simply wants the GPU during the same periods.

use std::fmt;
use std::time::Duration;

use crate::time::format_duration;
use crate::Instant;

/// When a container wants the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demand {
    /// Always, from start to stop.
    Busy,
    /// Never.
    Idle,
    /// `on`, then `off`, then `on` again, and so on, starting with `on` at the container's start.
    Periodic {
        /// Length of each busy period.
        on: Duration,
        /// Length of each idle period.
        off: Duration,
    },
    /// Busy and idle periods of exponentially distributed lengths with these means, starting
    /// with a busy period at the container's start; the lengths are drawn from the scenario's
    /// seed mixed with the container's position, so a scenario always replays the same way.
    Exponential {
        /// Mean length of a busy period.
        on_mean: Duration,
        /// Mean length of an idle period.
        off_mean: Duration,
    },
    /// Bursts of work, closed loop: an idle gap, then an amount of GPU work (the time it takes
    /// running alone on its GPUs), wanted until it is done however long the scheduler makes
    /// that, then the next gap; both exponentially distributed with these means, drawn as for
    /// [`Demand::Exponential`]. It starts with a gap.
    Work {
        /// Mean amount of work in a burst.
        work_mean: Duration,
        /// Mean idle gap before each burst.
        gap_mean: Duration,
    },
}

impl fmt::Display for Demand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Demand::Busy => f.write_str("busy"),
            Demand::Idle => f.write_str("idle"),
            Demand::Periodic { on, off } => write!(
                f,
                "{} on, {} off",
                format_duration(on),
                format_duration(off)
            ),
            Demand::Exponential { on_mean, off_mean } => write!(
                f,
                "~{} on, ~{} off",
                format_duration(on_mean),
                format_duration(off_mean)
            ),
            Demand::Work {
                work_mean,
                gap_mean,
            } => write!(
                f,
                "~{} of work every ~{}",
                format_duration(work_mean),
                format_duration(gap_mean)
            ),
        }
    }
}

/// SplitMix64: a tiny, fast, well-mixed deterministic generator (Steele, Lea and Flood, 2014).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// A generator for the container at `position` of a scenario run with `seed`: streams of
    /// different containers, and of the same container under different seeds, are unrelated.
    pub fn for_container(seed: u64, position: usize) -> Self {
        let mut mixer = SplitMix64(seed);
        let base = mixer.next_u64();
        SplitMix64(base ^ (position as u64).wrapping_add(1).wrapping_mul(Self::GAMMA))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in (0, 1].
    fn next_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// An exponentially distributed duration with this mean, at least one nanosecond (so that
    /// time always moves forward).
    pub fn exponential(&mut self, mean: Duration) -> Duration {
        let nanos = -(mean.as_nanos() as f64) * self.next_unit().ln();
        Duration::from_nanos((nanos.round() as u64).max(1))
    }
}

/// The demand of one running container: whether it wants the GPU now and when that changes.
#[derive(Clone, Debug)]
pub struct DemandCursor {
    demand: Demand,
    on: bool,
    next_change: Option<Instant>,
    /// [`Demand::Work`] in a burst: the work not done yet.
    work_left: Duration,
    rng: SplitMix64,
}

impl DemandCursor {
    /// The demand of a container that starts at `start`, drawing from `rng` if it needs to.
    pub fn new(demand: Demand, start: Instant, mut rng: SplitMix64) -> Self {
        let (on, next_change) = match demand {
            Demand::Busy => (true, None),
            Demand::Idle => (false, None),
            Demand::Periodic { on, .. } => (true, Some(start + on)),
            Demand::Exponential { on_mean, .. } => (true, Some(start + rng.exponential(on_mean))),
            Demand::Work { gap_mean, .. } => (false, Some(start + rng.exponential(gap_mean))),
        };
        DemandCursor {
            demand,
            on,
            next_change,
            work_left: Duration::ZERO,
            rng,
        }
    }

    /// Whether the container wants the GPU (as of the last [`advance`](Self::advance)).
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// When the demand changes next, if it ever does; for [`Demand::Work`] in a burst, `None`:
    /// when the burst ends depends on the GPU time it gets ([`DemandCursor::work_left`]).
    pub fn next_change(&self) -> Option<Instant> {
        self.next_change
    }

    /// For [`Demand::Work`] in a burst: the work not done yet.
    pub fn work_left(&self) -> Option<Duration> {
        (matches!(self.demand, Demand::Work { .. }) && self.on).then_some(self.work_left)
    }

    /// For [`Demand::Work`] in a burst: `done` more of its work was done by `now`; once all of
    /// it is, the burst ends and the next gap begins.
    pub fn work_done(&mut self, done: Duration, now: Instant) {
        let Demand::Work { gap_mean, .. } = self.demand else {
            return;
        };
        if !self.on {
            return;
        }
        self.work_left = self.work_left.saturating_sub(done);
        if self.work_left.is_zero() {
            self.on = false;
            self.next_change = Some(now + self.rng.exponential(gap_mean));
        }
    }

    /// Moves to `now`: applies every change due at or before it.
    pub fn advance(&mut self, now: Instant) {
        while let Some(at) = self.next_change.filter(|&at| at <= now) {
            self.on = !self.on;
            let period = match self.demand {
                Demand::Periodic { on, off } => {
                    if self.on {
                        on
                    } else {
                        off
                    }
                }
                Demand::Exponential { on_mean, off_mean } => {
                    let mean = if self.on { on_mean } else { off_mean };
                    self.rng.exponential(mean)
                }
                Demand::Work { work_mean, .. } => {
                    // A gap ended: the burst lasts until its work is done.
                    self.work_left = self.rng.exponential(work_mean);
                    self.next_change = None;
                    continue;
                }
                Demand::Busy | Demand::Idle => unreachable!("constant demand never changes"),
            };
            self.next_change = Some(at + period);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The demand at each of `times` (ms), advancing a fresh cursor through them in order.
    fn trace(demand: Demand, start_ms: u64, times: &[u64]) -> Vec<bool> {
        let mut cursor = DemandCursor::new(demand, at(start_ms), SplitMix64::for_container(0, 0));
        times
            .iter()
            .map(|&t| {
                cursor.advance(at(t));
                cursor.is_on()
            })
            .collect()
    }

    #[test]
    fn constant_demands_never_change() {
        assert_eq!(trace(Demand::Busy, 0, &[0, 1, 1_000_000]), [true; 3]);
        assert_eq!(trace(Demand::Idle, 0, &[0, 1, 1_000_000]), [false; 3]);
        let busy = DemandCursor::new(Demand::Busy, at(0), SplitMix64::for_container(0, 0));
        assert_eq!(busy.next_change(), None);
    }

    #[test]
    fn periodic_edges_are_exact() {
        let demand = Demand::Periodic {
            on: ms(200),
            off: ms(300),
        };
        // Starts on at 1000 ms: on [1000, 1200), off [1200, 1500), on [1500, 1700), ...
        let times = [1000, 1199, 1200, 1499, 1500, 1699, 1700, 2000, 2199, 2200];
        let expected = [
            true, true, false, false, true, true, false, true, true, false,
        ];
        assert_eq!(trace(demand, 1000, &times), expected);
    }

    #[test]
    fn periodic_skips_whole_periods_in_one_advance() {
        let demand = Demand::Periodic {
            on: ms(1),
            off: ms(1),
        };
        let mut cursor = DemandCursor::new(demand, at(0), SplitMix64::for_container(0, 0));
        cursor.advance(at(1001));
        assert!(!cursor.is_on());
        assert_eq!(cursor.next_change(), Some(at(1002)));
    }

    fn exponential_edges(seed: u64, position: usize) -> Vec<Instant> {
        let demand = Demand::Exponential {
            on_mean: ms(2000),
            off_mean: ms(3000),
        };
        let rng = SplitMix64::for_container(seed, position);
        let mut cursor = DemandCursor::new(demand, at(0), rng);
        let mut edges = Vec::new();
        while let Some(next) = cursor.next_change().filter(|&t| t < at(600_000)) {
            edges.push(next);
            cursor.advance(next);
        }
        edges
    }

    #[test]
    fn exponential_is_determined_by_seed_and_position() {
        let a = exponential_edges(7, 3);
        assert_eq!(a, exponential_edges(7, 3));
        assert_ne!(a, exponential_edges(8, 3));
        assert_ne!(a, exponential_edges(7, 4));
    }

    #[test]
    fn exponential_means_are_close() {
        let edges = exponential_edges(1, 0);
        let mut on = Duration::ZERO;
        let mut off = Duration::ZERO;
        let mut previous = at(0);
        for (i, &edge) in edges.iter().enumerate() {
            if i % 2 == 0 {
                on += edge - previous;
            } else {
                off += edge - previous;
            }
            previous = edge;
        }
        // ~120 periods over 10 minutes; the mean of each kind within 25%.
        let periods = edges.len() as f64 / 2.0;
        assert!(periods > 80.0, "{periods}");
        let on_mean = on.as_secs_f64() / periods;
        let off_mean = off.as_secs_f64() / periods;
        assert!((on_mean - 2.0).abs() < 0.5, "{on_mean}");
        assert!((off_mean - 3.0).abs() < 0.75, "{off_mean}");
    }

    #[test]
    fn splitmix_is_the_reference_sequence() {
        // The first outputs of SplitMix64 seeded with 0, as published with the algorithm.
        let mut rng = SplitMix64(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn a_burst_of_work_lasts_until_its_work_is_done() {
        let demand = Demand::Work {
            work_mean: ms(200),
            gap_mean: ms(1000),
        };
        let mut cursor = DemandCursor::new(demand, at(0), SplitMix64::for_container(3, 1));
        assert!(!cursor.is_on(), "it starts with a gap");
        assert_eq!(cursor.work_left(), None);
        let gap_end = cursor.next_change().unwrap();
        cursor.advance(gap_end);
        assert!(cursor.is_on());
        assert_eq!(cursor.next_change(), None, "no end until the work is done");
        let work = cursor.work_left().unwrap();
        assert!(!work.is_zero());
        // Frozen for a second: nothing done, still on.
        cursor.advance(gap_end + Duration::from_secs(1));
        assert!(cursor.is_on());
        cursor.work_done(work / 2, gap_end + Duration::from_secs(2));
        assert!(cursor.is_on());
        let end = gap_end + Duration::from_secs(3);
        cursor.work_done(work, end);
        assert!(!cursor.is_on());
        assert!(cursor.next_change().unwrap() > end, "the next gap begins");
        assert_eq!(cursor.work_left(), None);
    }
}
