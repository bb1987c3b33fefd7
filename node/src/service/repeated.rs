//! [`Repeated`]: a failure that recurs every tick (a full `state_dir` fails each write of the
//! frozen list, 20 times a second) is logged when it begins, then at most once per
//! [`Repeated::EVERY`] with how many times it recurred, and once when it ends.

use std::time::{Duration, Instant};

/// One kind of recurring failure, and when it was last logged.
#[derive(Debug, Default)]
pub(super) struct Repeated {
    /// When it was last logged, and how many failures since were not.
    failing: Option<(Instant, u64)>,
}

/// What to log of one more failure.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Say {
    /// Nothing: it was logged a short while ago.
    Nothing,
    /// It, for the first time since it last ended.
    First,
    /// It again, with how many failures were not logged since it last was.
    Again(u64),
}

impl Repeated {
    /// How often a failure that goes on is logged again.
    pub const EVERY: Duration = Duration::from_secs(10);

    /// One more failure at `now`: what to log of it.
    pub fn failed(&mut self, now: Instant) -> Say {
        match &mut self.failing {
            None => {
                self.failing = Some((now, 0));
                Say::First
            }
            Some((said, quiet)) if now.duration_since(*said) >= Self::EVERY => {
                let n = *quiet;
                *said = now;
                *quiet = 0;
                Say::Again(n)
            }
            Some((_, quiet)) => {
                *quiet += 1;
                Say::Nothing
            }
        }
    }

    /// A success: `true` when it ends a failure (to log that it did).
    pub fn succeeded(&mut self) -> bool {
        self.failing.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_said_at_once_then_every_ten_seconds_with_its_count_then_its_end() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut r = Repeated::default();
        assert!(!r.succeeded(), "nothing failed");
        assert_eq!(r.failed(at(0)), Say::First);
        let quiet = (1..200).map(|i| r.failed(at(i * 50)));
        assert!(quiet.into_iter().all(|s| s == Say::Nothing));
        assert_eq!(r.failed(at(10_000)), Say::Again(199));
        assert_eq!(r.failed(at(10_050)), Say::Nothing);
        assert_eq!(r.failed(at(20_000)), Say::Again(1));
        assert!(r.succeeded());
        assert!(!r.succeeded(), "its end is said once");
        assert_eq!(
            r.failed(at(20_050)),
            Say::First,
            "a new failure is said at once"
        );
    }
}
