//! `Stats`: a container's cgroup statistics in containerd's types, read from the cgroup files
//! as runc's shim reports them (`ctr task metrics`): v1 as `io.containerd.cgroups.v1.Metrics`
//! (memory, CPU, pids), v2 through `containerd_shim`'s collector.

use std::collections::HashMap;
use std::path::PathBuf;

use containerd_shim::protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat, Throttle,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::MessageField;
use gpuplex_cgroup::{CgroupMounts, ProcCgroup};

/// The v1 controllers of a process and their directories, from its `/proc/PID/cgroup` and where
/// this mount namespace mounts each hierarchy (`mounts`); empty on a v2-only host.
pub(crate) fn v1_directories(proc_cgroup: &str, mounts: &CgroupMounts) -> HashMap<String, PathBuf> {
    let mut dirs = HashMap::new();
    for (controllers, path) in ProcCgroup::parse(proc_cgroup).v1 {
        for controller in controllers {
            if let Some(dir) = mounts.v1_dir(&controller, &path) {
                dirs.insert(controller, dir);
            }
        }
    }
    dirs
}

/// [`v1_directories`] through the mounts of `/proc/self/mountinfo` (none when it cannot be read).
pub(crate) fn v1_directories_here(proc_cgroup: &str) -> HashMap<String, PathBuf> {
    let mounts = CgroupMounts::of_this_process().unwrap_or_default();
    v1_directories(proc_cgroup, &mounts)
}

/// `key value` lines (memory.stat, cpu.stat, cpuacct.stat) as a map.
fn flat_keyed(text: &str) -> HashMap<&str, u64> {
    text.lines()
        .filter_map(|line| {
            let (key, value) = line.split_once(' ')?;
            Some((key, value.trim().parse().ok()?))
        })
        .collect()
}

/// A cgroup v1 container's metrics from its cgroup files (`read` reads one file of a
/// controller's directory; missing files read as zero, as runc's shim leaves them).
fn v1_metrics(read: impl Fn(&str, &str) -> Option<String>) -> Metrics {
    let number = |controller: &str, file: &str| -> u64 {
        read(controller, file)
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    };
    let entry = |prefix: &str| MemoryEntry {
        usage: number("memory", &format!("{prefix}usage_in_bytes")),
        limit: number("memory", &format!("{prefix}limit_in_bytes")),
        max: number("memory", &format!("{prefix}max_usage_in_bytes")),
        failcnt: number("memory", &format!("{prefix}failcnt")),
        ..Default::default()
    };
    let stat_text = read("memory", "memory.stat").unwrap_or_default();
    let stat = flat_keyed(&stat_text);
    let s = |key: &str| stat.get(key).copied().unwrap_or(0);
    let memory = MemoryStat {
        cache: s("cache"),
        rss: s("rss"),
        rss_huge: s("rss_huge"),
        mapped_file: s("mapped_file"),
        dirty: s("dirty"),
        writeback: s("writeback"),
        pg_pg_in: s("pgpgin"),
        pg_pg_out: s("pgpgout"),
        pg_fault: s("pgfault"),
        pg_maj_fault: s("pgmajfault"),
        inactive_anon: s("inactive_anon"),
        active_anon: s("active_anon"),
        inactive_file: s("inactive_file"),
        active_file: s("active_file"),
        unevictable: s("unevictable"),
        hierarchical_memory_limit: s("hierarchical_memory_limit"),
        hierarchical_swap_limit: s("hierarchical_memsw_limit"),
        total_cache: s("total_cache"),
        total_rss: s("total_rss"),
        total_rss_huge: s("total_rss_huge"),
        total_mapped_file: s("total_mapped_file"),
        total_dirty: s("total_dirty"),
        total_writeback: s("total_writeback"),
        total_pg_pg_in: s("total_pgpgin"),
        total_pg_pg_out: s("total_pgpgout"),
        total_pg_fault: s("total_pgfault"),
        total_pg_maj_fault: s("total_pgmajfault"),
        total_inactive_anon: s("total_inactive_anon"),
        total_active_anon: s("total_active_anon"),
        total_inactive_file: s("total_inactive_file"),
        total_active_file: s("total_active_file"),
        total_unevictable: s("total_unevictable"),
        usage: MessageField::some(entry("memory.")),
        swap: MessageField::some(entry("memory.memsw.")),
        kernel: MessageField::some(entry("memory.kmem.")),
        kernel_tcp: MessageField::some(entry("memory.kmem.tcp.")),
        ..Default::default()
    };
    // cpuacct.stat counts USER_HZ ticks (100 a second); containerd reports nanoseconds.
    let ticks_text = read("cpuacct", "cpuacct.stat").unwrap_or_default();
    let ticks = flat_keyed(&ticks_text);
    let tick_ns = |key: &str| ticks.get(key).copied().unwrap_or(0) * 10_000_000;
    let per_cpu = read("cpuacct", "cpuacct.usage_percpu")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    let throttle_text = read("cpu", "cpu.stat").unwrap_or_default();
    let throttle = flat_keyed(&throttle_text);
    let t = |key: &str| throttle.get(key).copied().unwrap_or(0);
    let cpu = CPUStat {
        usage: MessageField::some(CPUUsage {
            total: number("cpuacct", "cpuacct.usage"),
            kernel: tick_ns("system"),
            user: tick_ns("user"),
            per_cpu,
            ..Default::default()
        }),
        throttling: MessageField::some(Throttle {
            periods: t("nr_periods"),
            throttled_periods: t("nr_throttled"),
            throttled_time: t("throttled_time"),
            ..Default::default()
        }),
        ..Default::default()
    };
    // pids.max reads "max" when unlimited: 0, as runc's shim reports it.
    let pids = PidsStat {
        current: number("pids", "pids.current"),
        limit: number("pids", "pids.max"),
        ..Default::default()
    };
    Metrics {
        memory: MessageField::some(memory),
        cpu: MessageField::some(cpu),
        pids: MessageField::some(pids),
        ..Default::default()
    }
}

/// The metrics of the container whose init is `pid` and whose cgroups were `proc_cgroup`
/// (`/proc/PID/cgroup`, read at create: a v1 container's cgroups are read after its init has
/// exited too, as runc's shim reads them until `Delete`), packed for `StatsResponse`.
pub fn of_container(proc_cgroup: &str, pid: u32) -> containerd_shim::Result<Any> {
    let dirs = v1_directories_here(proc_cgroup);
    if dirs.contains_key("memory") || dirs.contains_key("cpuacct") {
        let metrics = v1_metrics(|controller, file| {
            std::fs::read_to_string(dirs.get(controller)?.join(file)).ok()
        });
        return containerd_shim::util::convert_to_any(Box::new(metrics));
    }
    let cgroup = containerd_shim::cgroup::get_cgroup(pid)?;
    let metrics = containerd_shim::cgroup::collect_metrics_v2(&cgroup)?;
    containerd_shim::util::convert_to_any(Box::new(metrics))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controllers_are_found_per_hierarchy() {
        let mounts = CgroupMounts::from_mountinfo(
            "\
33 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw shared:15 - cgroup cgroup rw,cpu,cpuacct
34 25 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
35 25 0:32 / /run/my\\040pids rw - cgroup cgroup rw,pids
36 25 0:33 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
",
        );
        let text = "12:pids:/default/c1\n4:cpu,cpuacct:/default/c1\n3:memory:/default/c1\n2:blkio:/default/c1\n0::/default/c1\n";
        let dirs = v1_directories(text, &mounts);
        assert_eq!(
            dirs["cpuacct"],
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/default/c1")
        );
        assert_eq!(dirs["cpu"], dirs["cpuacct"]);
        assert_eq!(
            dirs["memory"],
            PathBuf::from("/sys/fs/cgroup/memory/default/c1")
        );
        // Where the hierarchy is mounted, not where it usually is.
        assert_eq!(dirs["pids"], PathBuf::from("/run/my pids/default/c1"));
        assert!(!dirs.contains_key("blkio"), "not mounted here");
        assert!(!dirs.contains_key(""));
        assert!(v1_directories("0::/user.slice\n", &mounts).is_empty());
        assert!(v1_directories(text, &CgroupMounts::default()).is_empty());
    }

    #[test]
    fn v1_files_become_containerds_fields() {
        let files: HashMap<(&str, &str), &str> = [
            (("memory", "memory.usage_in_bytes"), "4096\n"),
            (("memory", "memory.limit_in_bytes"), "67108864\n"),
            (
                ("memory", "memory.stat"),
                "cache 8192\nrss 4096\ntotal_cache 8192\npgfault 7\n",
            ),
            (("cpuacct", "cpuacct.usage"), "123456\n"),
            (("cpuacct", "cpuacct.usage_percpu"), "100000 23456 \n"),
            (("cpuacct", "cpuacct.stat"), "user 3\nsystem 2\n"),
            (
                ("cpu", "cpu.stat"),
                "nr_periods 5\nnr_throttled 1\nthrottled_time 99\n",
            ),
            (("pids", "pids.current"), "2\n"),
            (("pids", "pids.max"), "max\n"),
        ]
        .into_iter()
        .collect();
        let m = v1_metrics(|c, f| files.get(&(c, f)).map(|s| s.to_string()));
        let memory = m.memory.as_ref().unwrap();
        assert_eq!(memory.usage.usage, 4096);
        assert_eq!(memory.usage.limit, 67108864);
        assert_eq!(
            (
                memory.cache,
                memory.rss,
                memory.total_cache,
                memory.pg_fault
            ),
            (8192, 4096, 8192, 7)
        );
        assert_eq!(memory.swap.usage, 0);
        let cpu = m.cpu.as_ref().unwrap();
        assert_eq!(cpu.usage.total, 123456);
        assert_eq!(cpu.usage.per_cpu, vec![100000, 23456]);
        assert_eq!((cpu.usage.user, cpu.usage.kernel), (30_000_000, 20_000_000));
        assert_eq!(cpu.throttling.throttled_time, 99);
        assert_eq!((m.pids.current, m.pids.limit), (2, 0));
    }
}
