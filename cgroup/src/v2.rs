//! The cgroup2 freezer's file protocol (`cgroup.freeze`, `cgroup.events`) and `cpu.stat`.

use std::path::Path;
use std::time::Duration;

use super::{fsio, CgroupError};

/// The file that asks for a freeze (`1`) or a thaw (`0`).
pub(super) const FREEZE_FILE: &str = "cgroup.freeze";
/// The file that says whether the cgroup is populated and frozen.
pub(super) const EVENTS_FILE: &str = "cgroup.events";

/// What `cgroup.events` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Events {
    /// A process is in the cgroup or one of its descendants.
    pub(super) populated: bool,
    /// Every task of the cgroup and its descendants has stopped.
    pub(super) frozen: bool,
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines: `cgroup.events`,
/// `cpu.stat`).
pub(super) fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        if k == key {
            v.trim().parse().ok()
        } else {
            None
        }
    })
}

/// Parses `cgroup.events`; `None` when `populated` or `frozen` is missing (`frozen` needs
/// Linux 5.2).
pub(super) fn parse_events(text: &str) -> Option<Events> {
    Some(Events {
        populated: keyed_value(text, "populated")? != 0,
        frozen: keyed_value(text, "frozen")? != 0,
    })
}

/// Reads `cgroup.events`.
pub(super) fn events(dir: &Path) -> Result<Events, CgroupError> {
    let text = fsio::read(dir, EVENTS_FILE)?;
    parse_events(&text).ok_or_else(|| malformed_events(dir, &text))
}

/// The error for a `cgroup.events` of `dir` that reads `text`.
pub(super) fn malformed_events(dir: &Path, text: &str) -> CgroupError {
    CgroupError::Malformed {
        path: dir.join(EVENTS_FILE),
        what: format!(
            "{:?} lacks `populated` or `frozen` (the cgroup2 freezer needs Linux 5.2)",
            text.trim()
        ),
    }
}

/// Asks the kernel to freeze the cgroup (only the write).
pub(super) fn request_freeze(dir: &Path) -> Result<(), CgroupError> {
    fsio::write(dir, FREEZE_FILE, "1")
}

/// Whether every task of the cgroup has stopped.
pub(super) fn is_frozen(dir: &Path) -> Result<bool, CgroupError> {
    Ok(events(dir)?.frozen)
}

/// Thaws the cgroup and checks `cgroup.events` says `frozen 0` (the kernel thaws at once; a
/// frozen ancestor keeps it frozen).
pub(super) fn thaw(dir: &Path) -> Result<(), CgroupError> {
    fsio::write(dir, FREEZE_FILE, "0")?;
    if events(dir)?.frozen {
        return Err(CgroupError::NotThawed {
            path: dir.join(EVENTS_FILE),
            found: "frozen 1".into(),
        });
    }
    Ok(())
}

/// `usage_usec` of `cpu.stat`: CPU time of the cgroup and its descendants, also without the
/// `cpu` controller enabled.
pub(super) fn parse_cpu_stat(dir: &Path, text: &str) -> Result<Duration, CgroupError> {
    let micros = keyed_value(text, "usage_usec").ok_or_else(|| CgroupError::Malformed {
        path: dir.join("cpu.stat"),
        what: "no `usage_usec` line".into(),
    })?;
    Ok(Duration::from_micros(micros))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn parses_cgroup_events() {
        let table = [
            ("populated 1\nfrozen 0\n", Some((true, false))),
            ("populated 0\nfrozen 1\n", Some((false, true))),
            ("frozen 1\npopulated 1\n", Some((true, true))),
            ("populated 1\n", None),
            ("", None),
            ("populated x\nfrozen 0\n", None),
        ];
        for (text, expected) in table {
            let parsed = parse_events(text).map(|e| (e.populated, e.frozen));
            assert_eq!(parsed, expected, "{text:?}");
        }
    }

    #[test]
    fn reads_usage_usec_from_cpu_stat() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("cpu.stat"),
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\nnr_periods 0\n",
        )
        .unwrap();
        let cpu_time = |dir: &Path| parse_cpu_stat(dir, &fsio::read(dir, "cpu.stat")?);
        assert_eq!(cpu_time(dir.path()).unwrap(), Duration::from_micros(2500));
        fs::write(dir.path().join("cpu.stat"), "user_usec 2000\n").unwrap();
        assert!(matches!(
            cpu_time(dir.path()),
            Err(CgroupError::Malformed { .. })
        ));
    }

    #[test]
    fn keyed_value_matches_whole_keys() {
        assert_eq!(
            keyed_value("usage_usec_x 1\nusage_usec 2\n", "usage_usec"),
            Some(2)
        );
        assert_eq!(keyed_value("nr_throttled 1\n", "usage_usec"), None);
    }

    #[test]
    fn thaw_refuses_a_cgroup_that_stays_frozen() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(FREEZE_FILE), "1\n").unwrap();
        fs::write(dir.path().join(EVENTS_FILE), "populated 1\nfrozen 1\n").unwrap();
        match thaw(dir.path()) {
            Err(CgroupError::NotThawed { path, found }) => {
                assert_eq!(path, dir.path().join(EVENTS_FILE));
                assert_eq!(found, "frozen 1");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            fs::read_to_string(dir.path().join(FREEZE_FILE)).unwrap(),
            "0"
        );
    }

    #[test]
    fn a_removed_cgroup_is_not_populated() {
        let dir = tempfile::tempdir().unwrap();
        let gone = crate::FreezerCgroup::new(crate::FreezerVersion::V2, dir.path().join("gone"));
        assert!(!gone.is_populated().unwrap());
    }
}
