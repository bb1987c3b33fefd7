//! Unit tests of [`FreezerCgroup`] and [`freeze_all`] on fixture directories (no root needed).

use super::*;
use std::fs;

fn proc_cgroup(freezer: Option<&str>, unified: Option<&str>) -> ProcCgroup {
    ProcCgroup {
        v1: freezer
            .map(|path| (vec!["freezer".to_string()], path.to_string()))
            .into_iter()
            .collect(),
        unified: unified.map(String::from),
    }
}

fn hybrid() -> Hierarchies {
    Hierarchies {
        freezer: Some(PathBuf::from("/sys/fs/cgroup/freezer")),
        cpuacct: Some(PathBuf::from("/sys/fs/cgroup/cpuacct")),
        unified: Some(PathBuf::from("/sys/fs/cgroup/unified")),
    }
}

fn pure_v2() -> Hierarchies {
    Hierarchies {
        unified: Some(PathBuf::from("/sys/fs/cgroup")),
        ..Hierarchies::default()
    }
}

fn v1_only() -> Hierarchies {
    Hierarchies {
        freezer: Some(PathBuf::from("/sys/fs/cgroup/freezer")),
        ..Hierarchies::default()
    }
}

#[test]
fn of_proc_cgroup_prefers_v1_and_refuses_roots() {
    use FreezerVersion::{V1, V2};
    let ok = |version, path: &str| Ok(FreezerCgroup::new(version, PathBuf::from(path)));
    let table = [
        (
            "hybrid, in both: v1",
            hybrid(),
            proc_cgroup(Some("/web"), Some("/web")),
            ok(V1, "/sys/fs/cgroup/freezer/web"),
        ),
        (
            "hybrid, v1 root: v2",
            hybrid(),
            proc_cgroup(Some("/"), Some("/libpod/abc")),
            ok(V2, "/sys/fs/cgroup/unified/libpod/abc"),
        ),
        (
            "hybrid, in both roots",
            hybrid(),
            proc_cgroup(Some("/"), Some("/")),
            Err("root"),
        ),
        (
            "pure v2",
            pure_v2(),
            proc_cgroup(None, Some("/system.slice/x.scope")),
            ok(V2, "/sys/fs/cgroup/system.slice/x.scope"),
        ),
        (
            "pure v2, root",
            pure_v2(),
            proc_cgroup(None, Some("/")),
            Err("root"),
        ),
        (
            "v1 only, cgroup2 line ignored without a cgroup2 mount",
            v1_only(),
            proc_cgroup(Some("/"), Some("/web")),
            Err("root"),
        ),
        (
            "freezer line missing",
            hybrid(),
            proc_cgroup(None, Some("/web")),
            ok(V2, "/sys/fs/cgroup/unified/web"),
        ),
        (
            "a path from another cgroup namespace is skipped",
            hybrid(),
            proc_cgroup(Some("/../other"), Some("/web")),
            ok(V2, "/sys/fs/cgroup/unified/web"),
        ),
        (
            "nothing mounted",
            Hierarchies::default(),
            proc_cgroup(Some("/web"), Some("/web")),
            Err("no freezer"),
        ),
    ];
    for (name, h, cgroups, expected) in table {
        let got = FreezerCgroup::of_proc_cgroup(42, &cgroups, &h);
        match (got, expected) {
            (Ok(got), Ok(expected)) => assert_eq!(got, expected, "{name}"),
            (Err(CgroupError::RootCgroup { pid: 42 }), Err("root")) => {}
            (Err(CgroupError::NoFreezer), Err("no freezer")) => {}
            (got, expected) => panic!("{name}: got {got:?}, expected {expected:?}"),
        }
    }
}

#[test]
fn of_pid_in_reads_the_fixture_proc() {
    let proc = tempfile::tempdir().unwrap();
    fs::create_dir(proc.path().join("7")).unwrap();
    fs::write(proc.path().join("7/cgroup"), "6:freezer:/web\n0::/web\n").unwrap();
    let got = FreezerCgroup::of_pid_in(proc.path(), 7, &hybrid()).unwrap();
    assert_eq!(got.version(), FreezerVersion::V1);
    assert_eq!(got.path(), Path::new("/sys/fs/cgroup/freezer/web"));
    assert!(matches!(
        FreezerCgroup::of_pid_in(proc.path(), 8, &hybrid()),
        Err(CgroupError::NoProcess { pid: 8 })
    ));
    assert!(matches!(
        FreezerCgroup::of_pid_in(proc.path(), 7, &Hierarchies::default()),
        Err(CgroupError::NoFreezer)
    ));
}

#[test]
fn of_pid_of_a_missing_process_says_so() {
    let error = FreezerCgroup::of_pid(999_999_999, &hybrid()).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no process 999999999: /proc/999999999 does not exist (the process exited, or the pid is wrong)"
    );
}

/// A fixture machine: `root/freezer` (v1 mount) and `root/unified` (cgroup2 mount), each with a
/// cgroup `web`, plus `root/outside` and a plain directory `root/unified/plain`.
struct Fixture {
    root: tempfile::TempDir,
    h: Hierarchies,
}

impl Fixture {
    fn new() -> Fixture {
        let root = tempfile::tempdir().unwrap();
        let p = root.path();
        for dir in ["freezer/web", "unified/web", "unified/plain", "outside"] {
            fs::create_dir_all(p.join(dir)).unwrap();
        }
        fs::write(p.join("freezer/web/freezer.state"), "THAWED\n").unwrap();
        fs::write(p.join("freezer/web/cgroup.procs"), "").unwrap();
        fs::write(p.join("unified/web/cgroup.freeze"), "0\n").unwrap();
        fs::write(
            p.join("unified/web/cgroup.events"),
            "populated 1\nfrozen 0\n",
        )
        .unwrap();
        fs::write(p.join("unified/web/cpu.stat"), "usage_usec 1234\n").unwrap();
        let h = Hierarchies {
            freezer: Some(p.join("freezer")),
            cpuacct: None,
            unified: Some(p.join("unified")),
        };
        Fixture { root, h }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.path().canonicalize().unwrap().join(rel)
    }

    fn v1(&self) -> FreezerCgroup {
        FreezerCgroup::new(FreezerVersion::V1, self.path("freezer/web"))
    }

    fn v2(&self) -> FreezerCgroup {
        FreezerCgroup::new(FreezerVersion::V2, self.path("unified/web"))
    }

    fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.path(rel)).unwrap()
    }
}

#[test]
fn at_tells_the_version_and_refuses_what_is_not_a_cgroup() {
    let f = Fixture::new();
    assert_eq!(
        FreezerCgroup::at(&f.path("freezer/web"), &f.h).unwrap(),
        f.v1()
    );
    assert_eq!(
        FreezerCgroup::at(&f.path("unified/web"), &f.h).unwrap(),
        f.v2()
    );
    assert_eq!(
        FreezerCgroup::at(&f.path("unified/plain/../web"), &f.h).unwrap(),
        f.v2(),
        "resolved first"
    );
    for rel in [
        "freezer",
        "unified",
        "outside",
        "unified/plain",
        "freezer/web/freezer.state",
    ] {
        match FreezerCgroup::at(&f.path(rel), &f.h) {
            Err(e @ CgroupError::NotACgroup(_)) => {
                assert!(
                    e.to_string().contains(&*f.path(rel).to_string_lossy()),
                    "{e}"
                );
            }
            other => panic!("{rel}: {other:?}"),
        }
    }
    match FreezerCgroup::at(&f.path("freezer/missing"), &f.h) {
        Err(e @ CgroupError::Io { .. }) => {
            assert!(e.to_string().contains("freezer/missing"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn at_picks_the_deeper_mount_when_one_holds_the_other() {
    let f = Fixture::new();
    // A pure-v2-like layout with a v1 freezer mounted inside the cgroup2 mount.
    let h = Hierarchies {
        freezer: Some(f.path("freezer")),
        cpuacct: None,
        unified: Some(f.root.path().to_path_buf()),
    };
    assert_eq!(
        FreezerCgroup::at(&f.path("freezer/web"), &h).unwrap(),
        f.v1()
    );
}

#[test]
fn freeze_and_thaw_v1() {
    let f = Fixture::new();
    let cgroup = f.v1();
    cgroup.freeze(Duration::from_millis(100)).unwrap();
    assert_eq!(f.read("freezer/web/freezer.state"), "FROZEN");
    assert!(cgroup.is_frozen().unwrap());
    cgroup.thaw().unwrap();
    assert_eq!(f.read("freezer/web/freezer.state"), "THAWED");
    assert!(!cgroup.is_frozen().unwrap());
}

#[test]
fn a_freeze_that_times_out_is_thawed_again() {
    let f = Fixture::new();
    // cgroup.events never says frozen: the fixture has no kernel behind it.
    let cgroup = f.v2();
    let timeout = Duration::from_millis(20);
    let start = Instant::now();
    match cgroup.freeze(timeout) {
        Err(CgroupError::Timeout { path, waited }) => {
            assert_eq!(path, f.path("unified/web"));
            assert!(waited >= timeout, "{waited:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(f.read("unified/web/cgroup.freeze"), "0", "thawed again");
}

#[test]
fn a_freeze_that_fails_and_cannot_thaw_says_it_may_be_left_frozen() {
    let f = Fixture::new();
    fs::write(f.path("unified/web/cgroup.events"), "populated 1\n").unwrap();
    match f.v2().freeze(Duration::from_millis(20)) {
        Err(e @ CgroupError::StillFrozen { .. }) => {
            let message = e.to_string();
            assert!(message.contains("may be left frozen"), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn freeze_all_reports_each_cgroup_in_order() {
    let f = Fixture::new();
    let gone = FreezerCgroup::new(FreezerVersion::V1, f.path("freezer/gone"));
    let (v1, v2) = (f.v1(), f.v2());
    let results = freeze_all(&[&v1, &v2, &gone], Duration::from_millis(20));
    assert_eq!(results.len(), 3);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(
        matches!(results[1], Err(CgroupError::Timeout { .. })),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(&results[2], Err(CgroupError::Gone(p)) if *p == gone.path()),
        "{:?}",
        results[2]
    );
    assert_eq!(
        f.read("freezer/web/freezer.state"),
        "FROZEN",
        "the one that froze stays frozen"
    );
    assert_eq!(f.read("unified/web/cgroup.freeze"), "0");
    assert!(freeze_all(&[], Duration::ZERO).is_empty());
}

#[test]
fn pids_and_populated() {
    let f = Fixture::new();
    let cgroup = f.v1();
    assert_eq!(cgroup.pids().unwrap(), Vec::<u32>::new());
    assert!(!cgroup.is_populated().unwrap());

    fs::create_dir(f.path("freezer/web/child")).unwrap();
    fs::write(f.path("freezer/web/child/cgroup.procs"), "77\n").unwrap();
    assert!(
        cgroup.is_populated().unwrap(),
        "a process in a child cgroup counts"
    );

    fs::write(f.path("freezer/web/cgroup.procs"), "12\n345\n").unwrap();
    assert_eq!(cgroup.pids().unwrap(), [12, 345]);
    assert!(cgroup.is_populated().unwrap());

    fs::write(f.path("freezer/web/cgroup.procs"), "12\nnot-a-pid\n").unwrap();
    assert!(matches!(cgroup.pids(), Err(CgroupError::Malformed { .. })));

    assert!(f.v2().is_populated().unwrap());

    fs::remove_dir_all(f.path("freezer/web")).unwrap();
    assert!(matches!(cgroup.pids(), Err(CgroupError::Gone(_))));
    assert!(!cgroup.is_populated().unwrap());
    assert!(matches!(cgroup.is_frozen(), Err(CgroupError::Gone(_))));
    assert!(matches!(
        cgroup.freeze(Duration::from_millis(5)),
        Err(CgroupError::Gone(_))
    ));
    assert!(matches!(cgroup.thaw(), Err(CgroupError::Gone(_))));
}

#[test]
fn cpu_time_of_v2_reads_cpu_stat() {
    let f = Fixture::new();
    let time = f.v2().cpu_time(&f.h).unwrap();
    assert_eq!(time, Duration::from_micros(1234));
}

#[test]
fn cpu_time_of_v1_sums_its_processes() {
    let f = Fixture::new();
    let proc = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("100")
        .spawn()
        .unwrap();
    let pid = child.id();
    fs::create_dir(proc.path().join(pid.to_string())).unwrap();
    fs::write(
        proc.path().join(format!("{pid}/cgroup")),
        "6:freezer:/web\n0::/\n",
    )
    .unwrap();
    // 4,000,000,000 is above the largest pid: it stands for one that exited meanwhile.
    fs::write(
        f.path("freezer/web/cgroup.procs"),
        format!("{pid}\n4000000000\n"),
    )
    .unwrap();
    let clock = nix::time::ClockId::pid_cpu_clock_id(nix::unistd::Pid::from_raw(pid as i32));
    let own = || Duration::from(nix::time::clock_gettime(clock.unwrap()).unwrap());
    let before = own();
    let time = f.v1().cpu_time_in(proc.path(), &f.h).unwrap();
    let after = own();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        before <= time && time <= after,
        "{before:?} <= {time:?} <= {after:?}"
    );
}

#[test]
fn join_cgroup_path_stays_inside_the_mount() {
    let mount = Path::new("/sys/fs/cgroup/freezer");
    let table = [
        ("/web", Some("/sys/fs/cgroup/freezer/web")),
        ("/default/abc", Some("/sys/fs/cgroup/freezer/default/abc")),
        ("/../x", None),
        ("/a/./b", Some("/sys/fs/cgroup/freezer/a/b")),
    ];
    for (path, expected) in table {
        assert_eq!(
            join_cgroup_path(mount, path),
            expected.map(PathBuf::from),
            "{path}"
        );
    }
}

#[test]
fn serializes_for_the_state_file() {
    let cgroup = FreezerCgroup::new(FreezerVersion::V2, PathBuf::from("/sys/fs/cgroup/web"));
    let json = serde_json::to_string(&cgroup).unwrap();
    assert_eq!(json, r#"{"version":"v2","path":"/sys/fs/cgroup/web"}"#);
    assert_eq!(
        serde_json::from_str::<FreezerCgroup>(&json).unwrap(),
        cgroup
    );
}
