//! Time as a value: the core never reads a clock.
//!
//! Callers pass an [`Instant`] (nanoseconds since an origin they choose, usually the moment the node
//! service started) into every operation; spans are plain [`std::time::Duration`]s. Durations in
//! configuration and scenario files are written like `200ms`, `1.5s`, `2m` and parsed by
//! [`parse_duration`].

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time: nanoseconds since an origin chosen by the caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The origin.
    pub const ZERO: Instant = Instant(0);

    /// The instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    /// The instant `d` after the origin (saturating at the far future).
    pub fn from_duration(d: Duration) -> Instant {
        Instant(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time since the origin.
    pub const fn since_origin(self) -> Duration {
        Duration::from_nanos(self.0)
    }

    /// `self - earlier`, or zero when `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(d))
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    /// Saturating at the origin.
    fn sub(self, d: Duration) -> Instant {
        let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_sub(d))
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    /// Saturating: an earlier minus a later instant is zero.
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_since(earlier)
    }
}

impl fmt::Display for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3}s", self.since_origin().as_secs_f64())
    }
}

/// A duration string that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{}` is not a duration: write a number and a unit (ns, us, ms, s, m, h), like `200ms` or `1.5s`", crate::quantity::shown(.value))]
pub struct DurationError {
    /// The text as written.
    pub value: String,
}

/// Parses `200ms`, `1.5s`, `2m`, `1h`, `500us`, `10ns`. A unit is required (a bare number is
/// ambiguous); negative values and values past ~584 years are rejected.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let err = || DurationError {
        value: text.to_string(),
    };
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(err)?;
    let (number, unit) = s.split_at(split);
    let nanos_per_unit: u128 = match unit.trim() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(err()),
    };
    let (int, frac) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(err());
    }
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| err())?
    };
    let frac_nanos: u128 = if frac.is_empty() {
        0
    } else {
        let digits: u128 = frac.parse().map_err(|_| err())?;
        digits * nanos_per_unit / 10u128.pow(frac.len() as u32)
    };
    let nanos = int
        .checked_mul(nanos_per_unit)
        .and_then(|n| n.checked_add(frac_nanos))
        .filter(|&n| n <= u64::MAX as u128)
        .ok_or_else(err)?;
    Ok(Duration::from_nanos(nanos as u64))
}

/// Formats a duration the way [`parse_duration`] reads it, in the largest unit that keeps it
/// short: `200ms`, `1.5s`, `2m`.
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    let units: [(u128, &str); 6] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    if ns == 0 {
        return "0s".to_string();
    }
    for (per, unit) in units {
        if ns >= per {
            let value = ns as f64 / per as f64;
            let text = format!("{value:.3}");
            let text = text.trim_end_matches('0').trim_end_matches('.');
            return format!("{text}{unit}");
        }
    }
    unreachable!("ns >= 1 matches the last unit")
}

/// Serde adapter for duration fields written as strings (`slice = "200ms"`).
pub mod serde_duration {
    use super::{format_duration, parse_duration};
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    /// Reads a duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map_err(D::Error::custom)
    }

    /// Writes a duration string.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        let cases = [
            ("10ns", 10),
            ("500us", 500_000),
            ("500µs", 500_000),
            ("200ms", 200_000_000),
            ("1.5s", 1_500_000_000),
            ("2s", 2_000_000_000),
            (".5s", 500_000_000),
            ("2m", 120_000_000_000),
            ("1min", 60_000_000_000),
            ("1h", 3_600_000_000_000),
            (" 3 ms ", 3_000_000),
            ("0s", 0),
        ];
        for (text, nanos) in cases {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_nanos(nanos)),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for text in [
            "",
            "200",
            "ms",
            "-1s",
            "1.2.3s",
            "1 sec",
            "1e3ms",
            "s1",
            "1.s.",
            "99999999999h",
            "1..5s",
            ".s",
        ] {
            let e = parse_duration(text).unwrap_err();
            assert_eq!(e.value, text);
            assert!(e.to_string().contains("like `200ms`"), "{e}");
        }
    }

    #[test]
    fn format_reads_back() {
        for text in ["200ms", "1.5s", "2m", "1h", "10ns", "250us", "0s"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(format_duration(d), text);
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }

    #[test]
    fn instant_arithmetic_saturates() {
        let a = Instant::from_nanos(5);
        assert_eq!(
            a + Duration::from_nanos(u64::MAX),
            Instant::from_nanos(u64::MAX)
        );
        assert_eq!(Instant::ZERO - a, Duration::ZERO);
        assert_eq!(a - Duration::from_nanos(7), Instant::ZERO);
        assert_eq!(a - Duration::from_nanos(2), Instant::from_nanos(3));
        assert_eq!(a - Instant::ZERO, Duration::from_nanos(5));
        assert_eq!(Instant::from_duration(Duration::MAX).as_nanos(), u64::MAX);
    }
}
