//! [`CgroupReader`]: the files the node service reads of one container at every sample, held
//! open.
//!
//! The service reads a few files of each container it samples, up to twenty times a second: its
//! processes, its CPU time, whether it still has processes, the signals pending in it while it is
//! frozen. Opening, reading and closing such a file costs about 9 µs; reading one that is already
//! open from offset 0 (`pread`) about 1 µs (3 µs for `/proc/PID/stat`), and the kernel generates
//! the content afresh for each read either way. A reader opens each file at its first read and
//! keeps it; a file that cannot be kept (the process is out of descriptors) is read the plain way.
//!
//! v1's `cgroup.procs` is the exception, opened at every read: the kernel keeps the pid list it
//! built for an open file and serves it again to a read from offset 0 for as long as the file is
//! read more often than once a second, so a kept one never changes.
//!
//! A kept file answers as a fresh open would: one of a process that exited reads `ESRCH`, one of
//! a removed cgroup `ENODEV`, and both come back as gone ([`CgroupError::NoProcess`],
//! [`CgroupError::Gone`]). A kept file that failed is dropped and opened again at the next read,
//! so a pid taken over by a new process is read as that process.
//!
//! v1 CPU time comes from the `cpuacct` cgroup all the processes share, found from their
//! `/proc/PID/cgroup` when the set of processes changes (not at every sample). Without one, it
//! is each process's own time from its CPU clock (`clock_gettime` of `clock_getcpuclockid`: its
//! threads' time together, in nanoseconds, 0.7 µs a read where `/proc/PID/stat` takes 3 µs), plus
//! the time of the children each waited for (`cutime + cstime` of `/proc/PID/stat`), which a
//! process that runs short-lived commands spends most of its work in. That is read when its
//! processes are read again, and at every sample while it grows.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::time::{clock_gettime, ClockId};
use nix::unistd::Pid;

use super::procfs::{PendingSignals, ProcStat};
use super::{fsio, v1, v2, CgroupError, FreezerCgroup, FreezerVersion, Hierarchies};

/// The longest file read through a kept descriptor: a `cgroup.procs` of 100,000 processes.
const MAX_READ: usize = 1 << 20;

/// How long [`CgroupReader::members`] trusts the processes it read: a little longer than the
/// node service takes between two looks at whether a container still has processes
/// (`EXIT_SWEEP`, 1 s), which read them, so that those looks are the only reads. A process that
/// joins a container is counted by the `cpu` activity source within that time.
pub const MEMBERS_FRESH: Duration = Duration::from_millis(1100);

/// Descriptors kept by every reader of this process together, and how many they may keep.
static KEPT: AtomicUsize = AtomicUsize::new(0);
static KEPT_BUDGET: AtomicUsize = AtomicUsize::new(256);

/// How many descriptors all readers together may keep open; beyond that a file is read the
/// plain way. The node service gives them half of its descriptor limit, so that holding files
/// never leaves its socket without a descriptor for a connection.
pub fn set_kept_budget(descriptors: usize) {
    KEPT_BUDGET.store(descriptors, Ordering::Relaxed);
}

/// One cgroup's control files and its processes' `/proc` files, kept open between reads.
#[derive(Debug)]
pub struct CgroupReader {
    cgroup: FreezerCgroup,
    proc: PathBuf,
    procs: Kept,
    events: Kept,
    cpu_stat: Kept,
    /// Its processes as last read, and when.
    members: Option<(Vec<u32>, Instant)>,
    /// v1: the `cpuacct.usage` of the processes last seen, and for which processes.
    cpuacct: Option<(Vec<u32>, Option<Kept>)>,
    clocks: HashMap<u32, ClockId>,
    /// How many times its processes were read (`members` changed).
    members_read: u64,
    /// v1 without a cpuacct cgroup: its processes' waited-for children's time.
    children: Option<Children>,
    stat: HashMap<u32, Kept>,
    status: HashMap<u32, Kept>,
}

impl CgroupReader {
    /// A reader of `cgroup`; nothing is opened yet.
    pub fn new(cgroup: FreezerCgroup) -> CgroupReader {
        CgroupReader::with_proc(cgroup, Path::new("/proc"))
    }

    /// A reader that takes `proc` for `/proc` (tests give a fixture).
    pub fn with_proc(cgroup: FreezerCgroup, proc: &Path) -> CgroupReader {
        let dir = cgroup.path();
        CgroupReader {
            // v1 keeps the pid list it built for an open file, and serves it again at offset 0
            // while it is read more often than once a second: never kept.
            procs: match cgroup.version() {
                FreezerVersion::V1 => Kept::never(dir.join("cgroup.procs")),
                FreezerVersion::V2 => Kept::new(dir.join("cgroup.procs")),
            },
            events: Kept::new(dir.join(v2::EVENTS_FILE)),
            cpu_stat: Kept::new(dir.join("cpu.stat")),
            cgroup,
            proc: proc.to_path_buf(),
            members: None,
            cpuacct: None,
            clocks: HashMap::new(),
            members_read: 0,
            children: None,
            stat: HashMap::new(),
            status: HashMap::new(),
        }
    }

    /// The cgroup.
    pub fn cgroup(&self) -> &FreezerCgroup {
        &self.cgroup
    }

    /// The processes directly in the cgroup (`cgroup.procs`), read now.
    pub fn pids(&mut self) -> Result<Vec<u32>, CgroupError> {
        let dir = self.cgroup.path();
        let text = self
            .procs
            .read()
            .map_err(|e| fsio::classify(dir, &self.procs.path, e))?;
        let pids = super::freezer::parse_pids(&text).map_err(|line| CgroupError::Malformed {
            path: self.procs.path.clone(),
            what: format!("line {line:?} is not a pid"),
        })?;
        self.members = Some((pids.clone(), Instant::now()));
        self.members_read += 1;
        Ok(pids)
    }

    /// Its processes as read at most [`MEMBERS_FRESH`] ago (by this call, [`CgroupReader::pids`]
    /// or [`CgroupReader::is_populated`]). v1's `cgroup.procs` is the dearest read of a sample
    /// (the kernel builds, sorts and later frees a pid list for each); a process that exited
    /// makes the next call read it again.
    pub fn members(&mut self) -> Result<Vec<u32>, CgroupError> {
        match &self.members {
            Some((pids, at)) if at.elapsed() < MEMBERS_FRESH => Ok(pids.clone()),
            _ => self.pids(),
        }
    }

    /// Whether a process is left in it or in a cgroup below it; `false` once it is gone. See
    /// [`FreezerCgroup::is_populated`].
    pub fn is_populated(&mut self) -> Result<bool, CgroupError> {
        match self.cgroup.version() {
            FreezerVersion::V2 => {
                let dir = self.cgroup.path();
                let text = match self.events.read() {
                    Ok(text) => text,
                    Err(e) => {
                        return match fsio::classify(dir, &self.events.path, e) {
                            CgroupError::Gone(_) => Ok(false),
                            other => Err(other),
                        }
                    }
                };
                v2::parse_events(&text)
                    .map(|events| events.populated)
                    .ok_or_else(|| v2::malformed_events(dir, &text))
            }
            FreezerVersion::V1 => match self.pids() {
                Ok(pids) if !pids.is_empty() => Ok(true),
                // Empty here: a process may still be in a cgroup below it (rare; read afresh).
                Ok(_) => super::freezer::v1_is_populated(self.cgroup.path()),
                Err(CgroupError::Gone(_)) => Ok(false),
                Err(e) => Err(e),
            },
        }
    }

    /// CPU time used so far by its processes. See [`FreezerCgroup::cpu_time`].
    pub fn cpu_time(&mut self, h: &Hierarchies) -> Result<Duration, CgroupError> {
        match self.cgroup.version() {
            FreezerVersion::V2 => {
                let dir = self.cgroup.path();
                let text = (self.cpu_stat.read())
                    .map_err(|e| fsio::classify(dir, &self.cpu_stat.path, e))?;
                v2::parse_cpu_stat(dir, &text)
            }
            FreezerVersion::V1 => {
                let pids = self.members()?;
                if let Some(time) = self.cpuacct_time(&pids, h)? {
                    return Ok(time);
                }
                self.clocks.retain(|pid, _| pids.contains(pid));
                let mut total = Duration::ZERO;
                for &pid in &pids {
                    match process_cpu(&mut self.clocks, pid) {
                        Ok(time) => total += time,
                        Err(CgroupError::NoProcess { .. }) => {
                            self.clocks.remove(&pid);
                            self.members = None;
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(total + self.children_time(&pids)?)
            }
        }
    }

    /// v1: `cpuacct.usage` of the cgroup `pids` share, when they share one that is not the
    /// root; `None` otherwise (the caller counts process by process).
    fn cpuacct_time(
        &mut self,
        pids: &[u32],
        h: &Hierarchies,
    ) -> Result<Option<Duration>, CgroupError> {
        if h.cpuacct.is_none() {
            return Ok(None);
        }
        if self.cpuacct.as_ref().is_none_or(|(seen, _)| seen != pids) {
            let dir = v1::cpuacct_dir(pids, h, &self.proc)?;
            let usage = dir.map(|d| Kept::new(d.join(v1::CPUACCT_USAGE)));
            self.cpuacct = Some((pids.to_vec(), usage));
        }
        let Some((_, Some(usage))) = &mut self.cpuacct else {
            return Ok(None);
        };
        let dir = usage.path.parent().unwrap_or(Path::new("/")).to_path_buf();
        match usage.read() {
            Ok(text) => v1::parse_cpuacct_usage(&usage.path, &text).map(Some),
            // Its cpuacct cgroup went away (processes moved out): count per process, and look
            // for their cgroup again next time.
            Err(e) => match fsio::classify(&dir, &usage.path, e) {
                CgroupError::Gone(_) => {
                    self.cpuacct = None;
                    Ok(None)
                }
                other => Err(other),
            },
        }
    }

    /// The CPU time of the children `pids` waited for: read again when `pids` were read again,
    /// or when it grew at the last read; else as last read.
    fn children_time(&mut self, pids: &[u32]) -> Result<Duration, CgroupError> {
        if let Some(c) = &self.children {
            if !c.growing && c.members_read == self.members_read {
                return Ok(c.total);
            }
        }
        self.stat.retain(|pid, _| pids.contains(pid));
        let mut total = Duration::ZERO;
        for &pid in pids {
            let kept = (self.stat)
                .entry(pid)
                .or_insert_with(|| Kept::new(proc_file(&self.proc, pid, "stat")));
            match read_proc(kept, pid).and_then(|t| ProcStat::parse_file(&kept.path, &t)) {
                Ok(stat) => total += stat.children_time(),
                Err(CgroupError::NoProcess { .. }) => {
                    self.stat.remove(&pid);
                }
                Err(e) => return Err(e),
            }
        }
        let growing = self.children.as_ref().is_some_and(|c| total > c.total);
        self.children = Some(Children {
            total,
            growing,
            members_read: self.members_read,
        });
        Ok(total)
    }

    /// The stop signals (and any other) pending in its processes: `SigPnd` and `ShdPnd` of
    /// each, together.
    pub fn pending_signals(&mut self) -> Result<PendingSignals, CgroupError> {
        let pids = self.members()?;
        self.status.retain(|pid, _| pids.contains(pid));
        let mut pending = PendingSignals::default();
        for &pid in &pids {
            let kept = (self.status)
                .entry(pid)
                .or_insert_with(|| Kept::new(proc_file(&self.proc, pid, "status")));
            match read_proc(kept, pid) {
                Ok(text) => pending.0 |= PendingSignals::parse(&text).0,
                Err(CgroupError::NoProcess { .. }) => {
                    self.status.remove(&pid);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(pending)
    }
}

/// What the processes of a v1 cgroup without a cpuacct cgroup of its own have waited for.
#[derive(Debug)]
struct Children {
    /// Their children's CPU time.
    total: Duration,
    /// It grew since the read before.
    growing: bool,
    /// [`CgroupReader::members_read`] when it was read.
    members_read: u64,
}

/// The CPU time of process `pid` so far, all its threads together, from its CPU clock.
fn process_cpu(clocks: &mut HashMap<u32, ClockId>, pid: u32) -> Result<Duration, CgroupError> {
    let gone = |e: Errno| match e {
        Errno::ESRCH | Errno::EINVAL => CgroupError::NoProcess { pid },
        other => CgroupError::Io {
            path: PathBuf::from(format!("/proc/{pid}")),
            source: io::Error::from(other),
        },
    };
    let clock = match clocks.get(&pid) {
        Some(clock) => *clock,
        None => {
            let raw = i32::try_from(pid).map_err(|_| CgroupError::NoProcess { pid })?;
            let clock = ClockId::pid_cpu_clock_id(Pid::from_raw(raw)).map_err(gone)?;
            *clocks.entry(pid).or_insert(clock)
        }
    };
    let time = clock_gettime(clock).map_err(gone)?;
    Ok(Duration::from(time))
}

/// `proc/PID/name`.
fn proc_file(proc: &Path, pid: u32, name: &str) -> PathBuf {
    proc.join(pid.to_string()).join(name)
}

/// Reads a `/proc/PID` file, its process gone read as [`CgroupError::NoProcess`].
fn read_proc(kept: &mut Kept, pid: u32) -> Result<String, CgroupError> {
    kept.read().map_err(|source| match source.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => CgroupError::NoProcess { pid },
        _ => CgroupError::Io {
            path: kept.path.clone(),
            source,
        },
    })
}

/// A file read from its start at each read, through a descriptor kept between reads.
#[derive(Debug)]
struct Kept {
    path: PathBuf,
    file: Option<File>,
    /// Whether to keep it at all.
    keep: bool,
}

impl Kept {
    fn new(path: PathBuf) -> Kept {
        Kept {
            path,
            file: None,
            keep: true,
        }
    }

    /// One opened at every read: its content belongs to the open file, not to the read.
    fn never(path: PathBuf) -> Kept {
        Kept {
            path,
            file: None,
            keep: false,
        }
    }

    /// The whole file, read from offset 0. A failed read drops the descriptor.
    fn read(&mut self) -> io::Result<String> {
        let result = self.read_kept();
        if result.is_err() {
            self.close();
        }
        result
    }

    fn close(&mut self) {
        if self.file.take().is_some() {
            KEPT.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn read_kept(&mut self) -> io::Result<String> {
        let file = match &self.file {
            Some(file) => file,
            // Not to be kept, or over the budget: read it the plain way.
            None if !self.keep
                || KEPT.load(Ordering::Relaxed) >= KEPT_BUDGET.load(Ordering::Relaxed) =>
            {
                return std::fs::read_to_string(&self.path);
            }
            None => {
                let file = File::open(&self.path)?;
                KEPT.fetch_add(1, Ordering::Relaxed);
                self.file.insert(file)
            }
        };
        let mut bytes = vec![0; 512];
        let mut len = 0;
        loop {
            if len == bytes.len() {
                if len >= MAX_READ {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("longer than {MAX_READ} bytes"),
                    ));
                }
                bytes.resize(len * 2, 0);
            }
            match file.read_at(&mut bytes[len..], len as u64) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        bytes.truncate(len);
        String::from_utf8(bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn v1_fixture() -> (tempfile::TempDir, CgroupReader) {
        let dir = tempfile::tempdir().unwrap();
        let cgroup = dir.path().join("cg");
        fs::create_dir(&cgroup).unwrap();
        fs::write(cgroup.join("cgroup.procs"), "7\n").unwrap();
        let proc = dir.path().join("proc");
        fs::create_dir_all(proc.join("7")).unwrap();
        fs::write(
            proc.join("7/status"),
            "Name:\tsh\nSigPnd:\t0000000000004000\n",
        )
        .unwrap();
        let reader = CgroupReader::with_proc(FreezerCgroup::new(FreezerVersion::V1, cgroup), &proc);
        (dir, reader)
    }

    #[test]
    fn a_kept_file_is_read_again_from_its_start() {
        let (dir, mut reader) = v1_fixture();
        assert_eq!(reader.pids().unwrap(), vec![7]);
        assert!(reader.pending_signals().unwrap().has(libc::SIGTERM));
        // A regular file rewritten in place stands for the kernel's fresh content.
        fs::write(
            dir.path().join("proc/7/status"),
            "SigPnd:\t0000000000000100\n",
        )
        .unwrap();
        let pending = reader.pending_signals().unwrap();
        assert!(pending.has(libc::SIGKILL) && !pending.has(libc::SIGTERM));
        fs::write(dir.path().join("cg/cgroup.procs"), "7\n8\n").unwrap();
        assert_eq!(reader.pids().unwrap(), vec![7, 8]);
    }

    #[test]
    fn a_process_gone_counts_nothing_and_an_empty_cgroup_is_not_populated() {
        let (dir, mut reader) = v1_fixture();
        let h = Hierarchies::from_mountinfo("");
        assert!(reader.is_populated().unwrap());
        // No process 7 runs here (pids in the fixture are made up), and 4,000,000,000 is above
        // the largest pid: neither counts. The members are trusted for a while: read them
        // again, as the exit sweep does.
        fs::write(dir.path().join("cg/cgroup.procs"), "4000000000\n").unwrap();
        assert_eq!(reader.members().unwrap(), vec![7]);
        assert_eq!(reader.pids().unwrap(), vec![4_000_000_000]);
        assert_eq!(reader.cpu_time(&h).unwrap(), Duration::ZERO);
        assert_eq!(reader.pending_signals().unwrap(), PendingSignals::default());
        assert!(reader.clocks.is_empty() && reader.status.is_empty());
        fs::write(dir.path().join("cg/cgroup.procs"), "").unwrap();
        assert!(!reader.is_populated().unwrap());
        // (A kept regular file would still read after its removal; /proc and cgroup files
        // do not, so the gone directory is read afresh here.)
        fs::remove_dir_all(dir.path().join("cg")).unwrap();
        let mut fresh = CgroupReader::new(reader.cgroup().clone());
        assert!(!fresh.is_populated().unwrap());
        assert!(matches!(fresh.pids(), Err(CgroupError::Gone(_))));
    }

    #[test]
    fn v1_cpu_time_adds_waited_for_children_read_again_while_they_grow() {
        let dir = tempfile::tempdir().unwrap();
        let cgroup = dir.path().join("cg");
        fs::create_dir(&cgroup).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let pid = child.id();
        fs::write(cgroup.join("cgroup.procs"), format!("{pid}\n")).unwrap();
        let proc = dir.path().join("proc");
        fs::create_dir_all(proc.join(pid.to_string())).unwrap();
        let children = |ticks: u64| {
            let stat = format!("{pid} (sh) S 1 1 1 0 -1 0 0 0 0 0 1 1 {ticks} 0 20 0 1 0 1 1 1");
            fs::write(proc.join(format!("{pid}/stat")), stat).unwrap();
            super::super::procfs::ticks_to_duration(
                ticks,
                super::super::procfs::clock_ticks_per_second(),
            )
        };
        let clock = ClockId::pid_cpu_clock_id(Pid::from_raw(pid as i32)).unwrap();
        let own = || Duration::from(clock_gettime(clock).unwrap());
        let mut reader =
            CgroupReader::with_proc(FreezerCgroup::new(FreezerVersion::V1, cgroup), &proc);
        let h = Hierarchies::from_mountinfo("");
        let check = |reader: &mut CgroupReader, expected_children: Duration, why: &str| {
            let before = own();
            let time = reader.cpu_time(&h).unwrap();
            let after = own();
            assert!(
                before + expected_children <= time && time <= after + expected_children,
                "{why}: {time:?} is not {expected_children:?} more than its own {before:?}"
            );
        };
        let first = children(30);
        check(&mut reader, first, "first read");
        children(50);
        check(
            &mut reader,
            first,
            "unchanged processes, not growing: as last read",
        );
        reader.members = None;
        let grown = children(70);
        check(&mut reader, grown, "its processes read again");
        let again = children(90);
        check(
            &mut reader,
            again,
            "it grew at the last read: read at every sample",
        );
        check(&mut reader, again, "it did not grow since");
        children(110);
        check(&mut reader, again, "not growing: as last read");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        let (dir, mut reader) = v1_fixture();
        fs::write(dir.path().join("cg/cgroup.procs"), "7\nseven\n").unwrap();
        assert!(matches!(reader.pids(), Err(CgroupError::Malformed { .. })));
        let v2 = tempfile::tempdir().unwrap();
        fs::write(v2.path().join("cpu.stat"), "usage_usec many\n").unwrap();
        fs::write(v2.path().join("cgroup.events"), "populated\n").unwrap();
        let cgroup = FreezerCgroup::new(FreezerVersion::V2, v2.path().to_path_buf());
        let mut reader = CgroupReader::new(cgroup);
        let h = Hierarchies::from_mountinfo("");
        assert!(matches!(
            reader.cpu_time(&h),
            Err(CgroupError::Malformed { .. })
        ));
        assert!(matches!(
            reader.is_populated(),
            Err(CgroupError::Malformed { .. })
        ));
    }
}
