//! `gpuplexctl top`: the status table, refreshed.
//!
//! Each refresh opens its own connection, so `top` does not depend on how long the service
//! keeps one open; a refresh that cannot get the status ends `top` with that error.

use std::io::Write;
use std::path::Path;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::table::render_status;
use super::{write_out, CtlError};
use gpuplex_wire::NodeClient;

/// Moves the cursor home and clears the screen.
pub const CLEAR: &str = "\x1b[H\x1b[2J";

/// Prints the status every `interval`, `count` times (forever when `None`).
pub fn top(
    socket: &Path,
    interval: Duration,
    count: Option<u64>,
    out: &mut dyn Write,
) -> Result<(), CtlError> {
    let mut done = 0u64;
    loop {
        let status = NodeClient::connect(socket).and_then(|mut c| c.status())?;
        let frame = format!(
            "{CLEAR}gpuplexctl top  every {}  {}\n{}",
            interval_text(interval),
            utc_timestamp(SystemTime::now()),
            render_status(&status)
        );
        if !write_out(out, &frame)? {
            return Ok(());
        }
        done += 1;
        if count.is_some_and(|n| done >= n) {
            return Ok(());
        }
        thread::sleep(interval);
    }
}

fn interval_text(interval: Duration) -> String {
    if interval.subsec_nanos() == 0 {
        format!("{}s", interval.as_secs())
    } else if interval.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", interval.as_millis())
    } else {
        format!("{:?}", interval)
    }
}

/// `2024-05-01 12:00:00 UTC`.
pub fn utc_timestamp(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (year, month, day) = civil_date(secs / 86_400);
    let rest = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01, counted in 400-year eras of 146,097
/// days from 0000-03-01, so that the leap day ends a year.
fn civil_date(days: u64) -> (u64, u64, u64) {
    let shifted = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = era * 400 + year_of_era + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        let at = |secs| utc_timestamp(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(at(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(at(1_709_210_096), "2024-02-29 12:34:56 UTC");
        assert_eq!(at(1_735_689_599), "2024-12-31 23:59:59 UTC");
        assert_eq!(at(4_107_542_400), "2100-03-01 00:00:00 UTC");
    }

    #[test]
    fn intervals() {
        assert_eq!(interval_text(Duration::from_secs(2)), "2s");
        assert_eq!(interval_text(Duration::from_millis(1500)), "1500ms");
        assert_eq!(interval_text(Duration::from_micros(10)), "10µs");
    }

    #[test]
    fn an_unreachable_socket_ends_top() {
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        let err = top(
            &dir.path().join("none.sock"),
            Duration::ZERO,
            None,
            &mut out,
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("cannot reach"), "{err}");
        assert!(out.is_empty());
    }
}
