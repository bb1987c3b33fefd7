//! The freezer against the real kernel: v1 under the freezer mount, v2 under the cgroup2 mount.
//!
//! Needs root (it creates cgroups and moves processes into them); without root every test says
//! `SKIPPED` on stderr and passes. Each test makes its own cgroups (`gpuplex-test-<pid>-<name>`)
//! and busy children, and removes them again through [`TestCgroup`]'s `Drop`, also when an
//! assertion fails, so the tests are independent and may run in parallel.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use gpuplex_cgroup::{
    freeze_all, CgroupError, CgroupReader, FreezerCgroup, FreezerVersion, Hierarchies, ProcCgroup,
    ProcStat,
};

/// Long enough for any freeze on a loaded machine; the measured ones take a few ms.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long CPU time is watched to tell frozen from running.
const WATCH: Duration = Duration::from_millis(200);
/// Most CPU time a frozen cgroup may gain while watched (one clock tick of `/proc/PID/stat`).
const FROZEN_SLACK: Duration = Duration::from_millis(10);
/// Least CPU time a running busy loop gains while watched, even sharing 2 cores with 3 others.
const RUNNING_MIN: Duration = Duration::from_millis(20);

/// Prints a line to the real stderr, past libtest's capture, so that skips and measurements show
/// in every run, not only with `--nocapture`.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Whether this test can run; if not, says so loudly.
fn is_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    say!("SKIPPED: {test} needs root: it creates cgroups and moves processes into them");
    false
}

/// A cgroup made for one test, with the busy children moved into it. Dropping it thaws it, kills
/// the children and removes the directories, whatever happened in the test.
struct TestCgroup {
    version: FreezerVersion,
    dir: PathBuf,
    /// More directories to remove, deepest last (a cpuacct cgroup the children were moved to).
    extra_dirs: Vec<PathBuf>,
    children: Vec<Child>,
}

impl TestCgroup {
    /// Makes `gpuplex-test-<pid>-<name>` under the hierarchy of `version`, or says why the
    /// machine cannot run the test and returns `None`.
    fn create(version: FreezerVersion, h: &Hierarchies, name: &str) -> Option<TestCgroup> {
        let Some(mount) = h.mount_of(version) else {
            say!("SKIPPED: {name}: this machine has no {version} freezer mounted");
            return None;
        };
        let dir = mount.join(format!("gpuplex-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let cgroup = TestCgroup {
            version,
            dir,
            extra_dirs: Vec::new(),
            children: Vec::new(),
        };
        let control = match version {
            FreezerVersion::V1 => "freezer.state",
            FreezerVersion::V2 => "cgroup.freeze",
        };
        if !cgroup.dir.join(control).exists() {
            say!(
                "SKIPPED: {name}: {} has no {control} (the cgroup2 freezer needs Linux 5.2)",
                cgroup.dir.display()
            );
            return None;
        }
        Some(cgroup)
    }

    fn cgroup(&self) -> FreezerCgroup {
        FreezerCgroup::new(self.version, self.dir.clone())
    }

    /// Starts `sh -c 'while :; do :; done'` and moves it in; returns its pid.
    fn spawn_busy(&mut self) -> u32 {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        self.children.push(child);
        move_to(&self.dir, pid);
        pid
    }

    /// Kills the children and reaps them.
    fn kill_children(&mut self) {
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Thaw first: a v1-frozen process does not die until thawed.
        let _ = match self.version {
            FreezerVersion::V1 => fs::write(self.dir.join("freezer.state"), "THAWED"),
            FreezerVersion::V2 => fs::write(self.dir.join("cgroup.freeze"), "0"),
        };
        self.kill_children();
        for dir in std::iter::once(&self.dir).chain(&self.extra_dirs) {
            // A reaped process can linger in the cgroup for a moment: retry while it is busy.
            let deadline = Instant::now() + Duration::from_secs(5);
            while dir.exists() && fs::remove_dir(dir).is_err() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Moves process `pid` into the cgroup `dir`.
fn move_to(dir: &Path, pid: u32) {
    let procs = dir.join("cgroup.procs");
    fs::write(&procs, pid.to_string()).unwrap_or_else(|e| panic!("{}: {e}", procs.display()));
}

fn hierarchies() -> Hierarchies {
    Hierarchies::of_this_machine().expect("read /proc/self/mountinfo")
}

/// CPU time the cgroup gains over [`WATCH`].
fn cpu_growth(cgroup: &FreezerCgroup, h: &Hierarchies) -> Duration {
    let before = cgroup.cpu_time(h).expect("cpu_time");
    thread::sleep(WATCH);
    let after = cgroup.cpu_time(h).expect("cpu_time");
    after.saturating_sub(before)
}

/// Waits up to 2 s for `condition`.
fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        thread::sleep(Duration::from_millis(5));
    }
    condition()
}

fn freeze_stops_and_thaw_resumes(version: FreezerVersion, name: &str) {
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let Some(mut test) = TestCgroup::create(version, &h, name) else {
        return;
    };
    let pid = test.spawn_busy();
    if version == FreezerVersion::V2 {
        // of_pid prefers v1: keep the child in the v1 freezer root, as on a machine that
        // freezes through cgroup2 only.
        if let Some(freezer) = &h.freezer {
            if ProcCgroup::of_pid(pid).unwrap().freezer() != Some("/") {
                move_to(freezer, pid);
            }
        }
    }
    let cgroup = test.cgroup();

    assert_eq!(FreezerCgroup::of_pid(pid, &h).unwrap(), cgroup, "of_pid");
    assert_eq!(FreezerCgroup::at(&test.dir, &h).unwrap(), cgroup, "at");
    assert_eq!(cgroup.pids().unwrap(), [pid]);
    assert!(cgroup.is_populated().unwrap());
    assert!(!cgroup.is_frozen().unwrap());

    let running = cpu_growth(&cgroup, &h);
    assert!(
        running >= RUNNING_MIN,
        "a busy loop gained only {running:?} in {WATCH:?}"
    );

    cgroup.freeze(FREEZE_TIMEOUT).expect("freeze");
    assert!(cgroup.is_frozen().unwrap());
    let frozen = cpu_growth(&cgroup, &h);
    let state = ProcStat::of_pid(pid).unwrap().state;
    say!("{name}: while frozen, /proc/{pid}/stat state is {state:?}");
    assert!(
        frozen <= FROZEN_SLACK,
        "frozen, it still gained {frozen:?} in {WATCH:?}"
    );
    assert_ne!(state, 'R', "a frozen process must not be running");

    cgroup.thaw().expect("thaw");
    assert!(!cgroup.is_frozen().unwrap());
    let thawed = cpu_growth(&cgroup, &h);
    assert!(
        thawed >= RUNNING_MIN,
        "thawed, it gained only {thawed:?} in {WATCH:?}"
    );
    assert_eq!(ProcStat::of_pid(pid).unwrap().state, 'R');

    test.kill_children();
    assert!(
        eventually(|| !cgroup.is_populated().unwrap()),
        "still populated after its only process was killed"
    );
    assert_eq!(cgroup.pids().unwrap(), Vec::<u32>::new());
}

#[test]
fn v1_freeze_stops_and_thaw_resumes_a_busy_process() {
    freeze_stops_and_thaw_resumes(
        FreezerVersion::V1,
        "v1_freeze_stops_and_thaw_resumes_a_busy_process",
    );
}

#[test]
fn v2_freeze_stops_and_thaw_resumes_a_busy_process() {
    freeze_stops_and_thaw_resumes(
        FreezerVersion::V2,
        "v2_freeze_stops_and_thaw_resumes_a_busy_process",
    );
}

fn freeze_all_freezes_each(version: FreezerVersion, name: &str) {
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let (Some(mut a), Some(mut b), Some(gone)) = (
        TestCgroup::create(version, &h, &format!("{name}-a")),
        TestCgroup::create(version, &h, &format!("{name}-b")),
        TestCgroup::create(version, &h, &format!("{name}-gone")),
    ) else {
        return;
    };
    a.spawn_busy();
    b.spawn_busy();
    fs::remove_dir(&gone.dir).unwrap();
    let cgroups = [a.cgroup(), b.cgroup(), gone.cgroup()];

    let results = freeze_all(&[&cgroups[0], &cgroups[1], &cgroups[2]], FREEZE_TIMEOUT);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(results[1].is_ok(), "{:?}", results[1]);
    assert!(
        matches!(&results[2], Err(CgroupError::Gone(p)) if p == &gone.dir),
        "{:?}",
        results[2]
    );
    for cgroup in &cgroups[..2] {
        assert!(cgroup.is_frozen().unwrap());
        let frozen = cpu_growth(cgroup, &h);
        assert!(
            frozen <= FROZEN_SLACK,
            "{}: gained {frozen:?}",
            cgroup.path().display()
        );
    }
    for cgroup in &cgroups[..2] {
        cgroup.thaw().unwrap();
        let thawed = cpu_growth(cgroup, &h);
        assert!(
            thawed >= RUNNING_MIN,
            "{}: gained {thawed:?}",
            cgroup.path().display()
        );
    }
}

#[test]
fn v1_freeze_all_freezes_two_cgroups_and_reports_a_gone_one() {
    freeze_all_freezes_each(
        FreezerVersion::V1,
        "v1_freeze_all_freezes_two_cgroups_and_reports_a_gone_one",
    );
}

#[test]
fn v2_freeze_all_freezes_two_cgroups_and_reports_a_gone_one() {
    freeze_all_freezes_each(
        FreezerVersion::V2,
        "v2_freeze_all_freezes_two_cgroups_and_reports_a_gone_one",
    );
}

fn removed_cgroup_is_gone(version: FreezerVersion, name: &str) {
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let Some(test) = TestCgroup::create(version, &h, name) else {
        return;
    };
    let cgroup = FreezerCgroup::at(&test.dir, &h).unwrap();
    assert!(!cgroup.is_populated().unwrap());
    cgroup
        .freeze(FREEZE_TIMEOUT)
        .expect("an empty cgroup freezes at once");
    cgroup.thaw().unwrap();
    fs::remove_dir(&test.dir).unwrap();

    let is_gone =
        |r: Result<(), CgroupError>| matches!(r, Err(CgroupError::Gone(p)) if p == test.dir);
    assert!(is_gone(cgroup.pids().map(drop)));
    assert!(is_gone(cgroup.is_frozen().map(drop)));
    assert!(is_gone(cgroup.request_freeze()));
    assert!(is_gone(cgroup.freeze(FREEZE_TIMEOUT)));
    assert!(is_gone(cgroup.thaw()));
    assert!(is_gone(cgroup.cpu_time(&h).map(drop)));
    assert!(!cgroup.is_populated().unwrap());
    assert!(matches!(
        FreezerCgroup::at(&test.dir, &h),
        Err(CgroupError::Io { .. })
    ));
}

/// A reader that reads a container many times a second sees its processes come and go, and its
/// removal: what the node service's samples and exit sweeps rely on.
fn a_reader_follows_the_processes(version: FreezerVersion, name: &str) {
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let Some(mut test) = TestCgroup::create(version, &h, name) else {
        return;
    };
    let mut reader = CgroupReader::new(test.cgroup());
    for round in 0..3 {
        assert_eq!(reader.pids().unwrap(), Vec::<u32>::new(), "round {round}");
        assert!(!reader.is_populated().unwrap(), "round {round}");
        let pid = test.spawn_busy();
        assert_eq!(reader.pids().unwrap(), vec![pid], "round {round}");
        assert!(reader.is_populated().unwrap(), "round {round}");
        let busy = reader.cpu_time(&h).unwrap();
        assert!(
            eventually(|| reader.cpu_time(&h).unwrap() > busy),
            "round {round}: its CPU time grows"
        );
        test.kill_children();
        assert!(
            eventually(|| !reader.is_populated().unwrap()),
            "round {round}: emptied"
        );
    }
    fs::remove_dir(&test.dir).unwrap();
    assert!(!reader.is_populated().unwrap());
    assert!(matches!(reader.pids(), Err(CgroupError::Gone(_))));
}

#[test]
fn v1_a_reader_follows_the_processes() {
    a_reader_follows_the_processes(FreezerVersion::V1, "v1_a_reader_follows");
}

#[test]
fn v2_a_reader_follows_the_processes() {
    a_reader_follows_the_processes(FreezerVersion::V2, "v2_a_reader_follows");
}

#[test]
fn v1_removed_cgroup_is_gone() {
    removed_cgroup_is_gone(FreezerVersion::V1, "v1_removed_cgroup_is_gone");
}

#[test]
fn v2_removed_cgroup_is_gone() {
    removed_cgroup_is_gone(FreezerVersion::V2, "v2_removed_cgroup_is_gone");
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn measure_latency(version: FreezerVersion, name: &str) {
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let Some(mut test) = TestCgroup::create(version, &h, name) else {
        return;
    };
    test.spawn_busy();
    let cgroup = test.cgroup();
    let (mut freezes, mut thaws) = (Vec::new(), Vec::new());
    for _ in 0..50 {
        thread::sleep(Duration::from_millis(2));
        let start = Instant::now();
        cgroup.freeze(FREEZE_TIMEOUT).expect("freeze");
        freezes.push(start.elapsed());
        let start = Instant::now();
        cgroup.thaw().expect("thaw");
        thaws.push(start.elapsed());
    }
    let range = |s: &[Duration]| (*s.iter().min().unwrap(), *s.iter().max().unwrap());
    let ((fmin, fmax), (tmin, tmax)) = (range(&freezes), range(&thaws));
    say!(
        "{version} latency over 50 cycles of a busy process: freeze median {:?} ({fmin:?}-{fmax:?}), thaw median {:?} ({tmin:?}-{tmax:?})",
        median(freezes),
        median(thaws),
    );
}

#[test]
fn v1_freeze_and_thaw_latency() {
    measure_latency(FreezerVersion::V1, "v1_freeze_and_thaw_latency");
}

#[test]
fn v2_freeze_and_thaw_latency() {
    measure_latency(FreezerVersion::V2, "v2_freeze_and_thaw_latency");
}

#[test]
fn v1_cpu_time_reads_the_cpuacct_cgroup_of_its_processes() {
    let name = "v1_cpu_time_reads_the_cpuacct_cgroup_of_its_processes";
    if !is_root(name) {
        return;
    }
    let h = hierarchies();
    let Some(cpuacct) = h.cpuacct.clone() else {
        say!("SKIPPED: {name}: this machine has no v1 cpuacct hierarchy");
        return;
    };
    let Some(mut test) = TestCgroup::create(FreezerVersion::V1, &h, name) else {
        return;
    };
    let accounting = cpuacct.join(format!("gpuplex-test-{}-{name}", std::process::id()));
    let _ = fs::remove_dir(&accounting);
    fs::create_dir(&accounting).unwrap();
    test.extra_dirs.push(accounting.clone());
    let pid = test.spawn_busy();
    move_to(&accounting, pid);
    let cgroup = test.cgroup();

    // Frozen, nothing moves: cpu_time must be cpuacct.usage exactly.
    cgroup.freeze(FREEZE_TIMEOUT).unwrap();
    let usage: u64 = fs::read_to_string(accounting.join("cpuacct.usage"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(cgroup.cpu_time(&h).unwrap(), Duration::from_nanos(usage));
    cgroup.thaw().unwrap();
    assert!(cpu_growth(&cgroup, &h) >= RUNNING_MIN);
}

#[test]
fn refuses_hierarchy_roots_and_paths_outside() {
    let h = hierarchies();
    for mount in [&h.freezer, &h.unified].into_iter().flatten() {
        assert!(
            matches!(
                FreezerCgroup::at(mount, &h),
                Err(CgroupError::NotACgroup(_))
            ),
            "{}",
            mount.display()
        );
    }
    if h.has_freezer() {
        assert!(matches!(
            FreezerCgroup::at(Path::new("/tmp"), &h),
            Err(CgroupError::NotACgroup(_))
        ));
    }
}

#[test]
fn a_process_in_the_root_cgroups_is_refused() {
    let h = hierarchies();
    let me = std::process::id();
    let mine = ProcCgroup::of_pid(me).unwrap();
    let in_root = |mount: &Option<PathBuf>, path: Option<&str>| {
        mount.is_none() || path.is_none_or(|p| p == "/")
    };
    if !h.has_freezer()
        || !in_root(&h.freezer, mine.freezer())
        || !in_root(&h.unified, mine.unified.as_deref())
    {
        say!("SKIPPED: a_process_in_the_root_cgroups_is_refused: this test process is not in the root freezer cgroups");
        return;
    }
    let error = FreezerCgroup::of_pid(me, &h).unwrap_err();
    assert!(
        matches!(error, CgroupError::RootCgroup { pid } if pid == me),
        "{error}"
    );
}
