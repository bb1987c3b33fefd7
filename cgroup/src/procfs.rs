//! What `/proc/PID/cgroup`, `/proc/PID/stat` and `/proc/PID/status` say about a process.

use std::io;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use procfs_core::{FromBufRead, ProcessCGroups};

use super::CgroupError;

/// A process's cgroups, from `/proc/PID/cgroup` (the one parser of that file in gpuplex; its lines
/// are read by `procfs-core`): the paths are relative to each hierarchy's root and start with `/`
/// (`/` itself is the root cgroup).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcCgroup {
    /// Its cgroup in each v1 hierarchy: the hierarchy's controllers (and name, `name=systemd`)
    /// and the path, in the file's order.
    pub v1: Vec<(Vec<String>, String)>,
    /// Its cgroup2 cgroup (the `0::PATH` line).
    pub unified: Option<String>,
}

impl ProcCgroup {
    /// Parses the lines `ID:CONTROLLERS:PATH` of `/proc/PID/cgroup`. Lines that do not parse are
    /// skipped.
    pub fn parse(text: &str) -> ProcCgroup {
        let mut found = ProcCgroup::default();
        for line in text.lines() {
            let Ok(ProcessCGroups(parsed)) = ProcessCGroups::from_buf_read(line.as_bytes()) else {
                continue;
            };
            for cgroup in parsed {
                if cgroup.hierarchy == 0 && cgroup.controllers.is_empty() {
                    found.unified = Some(cgroup.pathname);
                } else {
                    found.v1.push((cgroup.controllers, cgroup.pathname));
                }
            }
        }
        found
    }

    /// Its cgroup in the v1 hierarchy with `controller` (`freezer`, or a name such as
    /// `name=systemd`).
    pub fn v1_path(&self, controller: &str) -> Option<&str> {
        let mut found = self.v1.iter();
        let (_, path) =
            found.find(|(controllers, _)| controllers.iter().any(|c| c == controller))?;
        Some(path)
    }

    /// Its cgroup in the v1 hierarchy that has the `freezer` controller.
    pub fn freezer(&self) -> Option<&str> {
        self.v1_path("freezer")
    }

    /// Its cgroup in the v1 hierarchy that has the `cpuacct` controller.
    pub fn cpuacct(&self) -> Option<&str> {
        self.v1_path("cpuacct")
    }

    /// Reads `/proc/PID/cgroup`.
    pub fn of_pid(pid: u32) -> Result<ProcCgroup, CgroupError> {
        ProcCgroup::of_pid_in(Path::new("/proc"), pid)
    }

    /// Reads `PROC/PID/cgroup`, with `proc` standing for `/proc` (tests give a fixture directory).
    pub fn of_pid_in(proc: &Path, pid: u32) -> Result<ProcCgroup, CgroupError> {
        read_proc_file(proc, pid, "cgroup").map(|text| ProcCgroup::parse(&text))
    }
}

/// The fields of `/proc/PID/stat` gpuplex uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// The state letter: `R` running, `S` sleeping, `D` uninterruptible (where v1-frozen tasks
    /// show), `Z` zombie, ...
    pub state: char,
    /// User-mode CPU time of all its threads, in clock ticks.
    pub utime_ticks: u64,
    /// Kernel-mode CPU time of all its threads, in clock ticks.
    pub stime_ticks: u64,
    /// CPU time of its children that it waited for (`cutime + cstime`), in clock ticks.
    pub children_ticks: u64,
}

impl ProcStat {
    /// Parses the text of `/proc/PID/stat`. The command name (field 2) is in parentheses and
    /// may hold spaces and parentheses itself, so fields are counted from the last `)`.
    pub fn parse(text: &str) -> Option<ProcStat> {
        let rest = &text[text.rfind(')')? + 1..];
        // After the name: state is field 3, utime field 14, stime 15, cutime 16 and cstime 17
        // (proc(5)).
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let utime_ticks = fields.nth(14 - 3 - 1)?.parse().ok()?;
        let mut ticks = || fields.next()?.parse::<u64>().ok();
        let stime_ticks = ticks()?;
        let children_ticks = ticks()?.saturating_add(ticks()?);
        Some(ProcStat {
            state,
            utime_ticks,
            stime_ticks,
            children_ticks,
        })
    }

    /// Reads `/proc/PID/stat`.
    pub fn of_pid(pid: u32) -> Result<ProcStat, CgroupError> {
        ProcStat::of_pid_in(Path::new("/proc"), pid)
    }

    /// Reads `PROC/PID/stat`, with `proc` standing for `/proc`.
    pub fn of_pid_in(proc: &Path, pid: u32) -> Result<ProcStat, CgroupError> {
        let text = read_proc_file(proc, pid, "stat")?;
        ProcStat::parse_file(&proc.join(pid.to_string()).join("stat"), &text)
    }

    /// The CPU time of its children that it waited for.
    pub fn children_time(&self) -> Duration {
        ticks_to_duration(self.children_ticks, clock_ticks_per_second())
    }

    /// [`ProcStat::parse`] of the file `path`, which read `text`; an error names it.
    pub fn parse_file(path: &Path, text: &str) -> Result<ProcStat, CgroupError> {
        ProcStat::parse(text).ok_or_else(|| CgroupError::Malformed {
            path: path.to_path_buf(),
            what: format!("{:?} does not have the fields of proc(5)", text.trim_end()),
        })
    }
}

/// The kernel's clock ticks per second for `/proc` times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
pub fn clock_ticks_per_second() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK);
        ticks
            .ok()
            .flatten()
            .and_then(|t| u64::try_from(t).ok())
            .filter(|t| *t > 0)
            .unwrap_or(100)
    })
}

/// `ticks` clock ticks at `per_second` ticks a second, exactly (no float rounding).
pub(super) fn ticks_to_duration(ticks: u64, per_second: u64) -> Duration {
    let per_second = per_second.max(1);
    let nanos = u128::from(ticks % per_second) * 1_000_000_000 / u128::from(per_second);
    Duration::new(ticks / per_second, nanos as u32)
}

/// The signals pending for a process, from `/proc/PID/status`: its main thread's (`SigPnd`) and
/// the whole process's (`ShdPnd`), as one set where signal `n` is bit `n - 1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingSignals(pub u64);

impl PendingSignals {
    /// Parses the `SigPnd` and `ShdPnd` lines of `/proc/PID/status`; a line that does not read
    /// as a hexadecimal mask counts as none.
    pub fn parse(text: &str) -> PendingSignals {
        // The node service reads this of every frozen process several times a second: look
        // for the two keys rather than split all fifty-odd lines.
        let mask = |key: &str| {
            let at = if text.starts_with(key) {
                0
            } else {
                text.find(&format!("\n{key}"))? + 1
            };
            let value = text[at + key.len()..].split('\n').next()?;
            u64::from_str_radix(value.trim(), 16).ok()
        };
        PendingSignals(mask("SigPnd:").unwrap_or(0) | mask("ShdPnd:").unwrap_or(0))
    }

    /// Reads `/proc/PID/status`.
    pub fn of_pid(pid: u32) -> Result<PendingSignals, CgroupError> {
        read_proc_file(Path::new("/proc"), pid, "status").map(|t| PendingSignals::parse(&t))
    }

    /// Whether `signal` (a number, like `libc::SIGTERM`) is pending.
    pub fn has(self, signal: i32) -> bool {
        (1..=64).contains(&signal) && self.0 & (1 << (signal - 1)) != 0
    }
}

/// Reads `PROC/PID/NAME`; a process that does not exist (or exited while we read) is
/// [`CgroupError::NoProcess`].
fn read_proc_file(proc: &Path, pid: u32, name: &str) -> Result<String, CgroupError> {
    let path = proc.join(pid.to_string()).join(name);
    std::fs::read_to_string(&path).map_err(|source| match source.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => CgroupError::NoProcess { pid },
        _ if source.kind() == io::ErrorKind::NotFound => CgroupError::NoProcess { pid },
        _ => CgroupError::Io { path, source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_signals_are_the_main_threads_and_the_processs() {
        let status = "Name:\tsh\nSigQ:\t1/96365\nSigPnd:\t0000000000000100\nShdPnd:\t0000000000004000\nSigBlk:\t0000000000000000\n";
        let pending = PendingSignals::parse(status);
        assert!(pending.has(libc::SIGKILL) && pending.has(libc::SIGTERM));
        assert!(!pending.has(libc::SIGINT) && !pending.has(0) && !pending.has(65));
        assert_eq!(PendingSignals::parse("SigPnd:\tzz\n"), PendingSignals(0));
        assert_eq!(PendingSignals::parse("SigPnd:\t4\n"), PendingSignals(4));
        assert_eq!(
            PendingSignals::parse("XSigPnd:\t1\nShdPnd:\t2"),
            PendingSignals(2)
        );
        assert_eq!(PendingSignals::parse(""), PendingSignals(0));
    }

    fn cg<'a>(
        freezer: Option<&'a str>,
        cpuacct: Option<&'a str>,
        unified: Option<&'a str>,
    ) -> (Option<&'a str>, Option<&'a str>, Option<&'a str>) {
        (freezer, cpuacct, unified)
    }

    #[test]
    fn parses_proc_pid_cgroup() {
        let table = [
            (
                "hybrid, runc container",
                "9:name=systemd:/\n6:freezer:/web\n4:memory:/process_api/647f/web\n2:cpuacct:/web\n1:cpu:/web\n0::/web\n",
                cg(Some("/web"), Some("/web"), Some("/web")),
            ),
            (
                "hybrid, shared cpu,cpuacct hierarchy, containerd path",
                "11:freezer:/default/abc\n3:cpu,cpuacct:/default/abc\n1:name=systemd:/default/abc\n0::/\n",
                cg(Some("/default/abc"), Some("/default/abc"), Some("/")),
            ),
            (
                "pure v2",
                "0::/system.slice/containerd.service\n",
                cg(None, None, Some("/system.slice/containerd.service")),
            ),
            (
                "name=freezer is a named hierarchy, not the controller",
                "5:name=freezer:/x\n",
                cg(None, None, None),
            ),
            (
                "a path with a colon is kept whole",
                "6:freezer:/a:b\n0::/c:d\n",
                cg(Some("/a:b"), None, Some("/c:d")),
            ),
            ("garbage", "nonsense\n\n", cg(None, None, None)),
        ];
        for (name, text, expected) in table {
            let parsed = ProcCgroup::parse(text);
            let found = (
                parsed.freezer(),
                parsed.cpuacct(),
                parsed.unified.as_deref(),
            );
            assert_eq!(found, expected, "{name}");
        }
    }

    #[test]
    fn parses_proc_pid_stat() {
        let tail = "3 4 5 6 7 8 9 10 11 12 250 75 30 12 20 0 1 0 100 1000 10";
        let table = [
            (format!("1234 (sh) R {tail}"), Some(('R', 250, 75, 42))),
            (
                format!("1234 (my (odd) name) D {tail}"),
                Some(('D', 250, 75, 42)),
            ),
            (format!("1234 (a b) S {tail}"), Some(('S', 250, 75, 42))),
            ("1234 (sh) R 3 4".to_string(), None),
            ("no parenthesis R 1 2 3".to_string(), None),
            (format!("1234 (sh) R {}", tail.replace("250", "x")), None),
            (
                format!("1234 (sh) R {}", tail.replace(" 12 20", " y 20")),
                None,
            ),
        ];
        for (text, expected) in table {
            let parsed = ProcStat::parse(&text)
                .map(|s| (s.state, s.utime_ticks, s.stime_ticks, s.children_ticks));
            assert_eq!(parsed, expected, "{text}");
        }
    }

    #[test]
    fn converts_ticks_exactly() {
        assert_eq!(ticks_to_duration(0, 100), Duration::ZERO);
        assert_eq!(ticks_to_duration(1, 100), Duration::from_millis(10));
        assert_eq!(ticks_to_duration(325, 100), Duration::from_millis(3250));
        assert_eq!(ticks_to_duration(1, 3), Duration::new(0, 333_333_333));
        assert!(clock_ticks_per_second() > 0);
    }

    #[test]
    fn a_missing_process_is_no_process() {
        let proc = tempfile::tempdir().unwrap();
        assert!(matches!(
            ProcCgroup::of_pid_in(proc.path(), 77),
            Err(CgroupError::NoProcess { pid: 77 })
        ));
        assert!(matches!(
            ProcStat::of_pid_in(proc.path(), 77),
            Err(CgroupError::NoProcess { pid: 77 })
        ));
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let stat = ProcStat::of_pid(me).unwrap();
        assert!("RSD".contains(stat.state), "{stat:?}");
        ProcCgroup::of_pid(me).unwrap();
    }
}
