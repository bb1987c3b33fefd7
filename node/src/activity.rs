//! Which attached containers have GPU work now: the samples the scheduler's windows run on.
//!
//! - `nvml`: a container has work when one of its processes shows SM utilization on one of its
//!   GPUs since the previous sample (see [`crate::nvml::NvmlGpus::busy_pids`]).
//! - `cpu`: a container has work when its cgroup used at least a tenth of a CPU since the
//!   previous sample. A stand-in for machines without a GPU (tests, the demo): a busy loop has
//!   work, a sleeping process has none.
//! - `always`: every attached container has work.
//!
//! The decisions ([`cpu_has_work`], [`nvml_has_work`]) are pure; [`ActivitySampler`] reads the
//! counters around them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use gpuplex_scheduler::{GpuIndex, VgpuId};

use crate::nvml::NvmlGpus;
use gpuplex_cgroup::{CgroupReader, Hierarchies};
use gpuplex_wire::config::ActivityChoice;

/// The activity source in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivitySource {
    /// NVML per-process utilization.
    Nvml,
    /// CPU time.
    Cpu,
    /// Always work.
    Always,
}

impl ActivitySource {
    /// The source the configuration asks for, given whether NVML loaded (`auto` picks `nvml`
    /// when it did, else `cpu`).
    pub fn resolve(choice: ActivityChoice, nvml_loaded: bool) -> ActivitySource {
        match choice {
            ActivityChoice::Nvml => ActivitySource::Nvml,
            ActivityChoice::Cpu => ActivitySource::Cpu,
            ActivityChoice::Always => ActivitySource::Always,
            ActivityChoice::Auto if nvml_loaded => ActivitySource::Nvml,
            ActivityChoice::Auto => ActivitySource::Cpu,
        }
    }

    /// Its name in the configuration and in status.
    pub fn name(self) -> &'static str {
        match self {
            ActivitySource::Nvml => "nvml",
            ActivitySource::Cpu => "cpu",
            ActivitySource::Always => "always",
        }
    }
}

/// Whether a cgroup that used `used` CPU time over `elapsed` has work: at least a tenth of one
/// CPU. Below that it is taken to be waiting (a sleeping shell, an idle server).
pub fn cpu_has_work(used: Duration, elapsed: Duration) -> bool {
    !used.is_zero() && used * 10 >= elapsed
}

/// Whether a container whose processes are `pids`, bound to `gpus`, has work, given the busy
/// processes of each GPU.
pub fn nvml_has_work(
    pids: &[u32],
    gpus: &[GpuIndex],
    busy: &BTreeMap<GpuIndex, BTreeSet<u32>>,
) -> bool {
    gpus.iter()
        .filter_map(|g| busy.get(g))
        .any(|set| pids.iter().any(|p| set.contains(p)))
}

/// What a sample says of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// It has work.
    Work,
    /// It has none.
    NoWork,
    /// It was thawed too recently for the source to have seen it: the work it was thawed for
    /// is kept ([`gpuplex_scheduler::Node::observe_unseen`]).
    NotYet,
}

impl Observation {
    /// `Work` or `NoWork`.
    pub fn from_work(work: bool) -> Observation {
        if work {
            Observation::Work
        } else {
            Observation::NoWork
        }
    }
}

/// What an NVML sample says of a container: work, no work, not yet, or nothing (`None`).
///
/// - `busy`: one of its processes is among its GPUs' busy ones: work.
/// - NVML trails the GPU by `lag` (its samples come every 1/6 s to 1 s), so a container thawed
///   less than `lag` ago that is not named may simply not have been sampled since: not yet.
///   Its window must not end for want of a sample that could not have come (on an H200 the
///   driver samples every 200 ms, and a window's work lapsed `idle_grace`, 100 ms, after the
///   thaw: the holder stayed thawed as "idle" beside the next one).
/// - `others_busy`: another process is busy on one of its GPUs, and none of its own: nothing.
///   The driver names one process per sample (seen on an H200, driver 580: with three processes
///   running at once, each 200 ms sample named one of them), so not being named beside a busy
///   process says nothing about a container. Only a GPU whose samples name nobody busy shows
///   that its containers have no work.
pub fn nvml_observation(
    busy: bool,
    others_busy: bool,
    since_thaw: Option<Duration>,
    lag: Duration,
) -> Option<Observation> {
    match (busy, since_thaw) {
        (true, _) => Some(Observation::Work),
        (false, Some(since)) if since < lag => Some(Observation::NotYet),
        _ if others_busy => None,
        (false, _) => Some(Observation::NoWork),
    }
}

/// An attached vGPU, as the sampler sees it: it has work when any of its containers has.
#[derive(Debug)]
pub struct Watched<'a> {
    /// Its vGPU.
    pub vgpu: VgpuId,
    /// Its containers' freezer cgroups' files (one, or the containers sharing a claim's vGPU);
    /// never empty.
    pub readers: Vec<&'a mut CgroupReader>,
    /// Its GPUs.
    pub gpus: &'a [GpuIndex],
    /// When it was last thawed, if ever.
    pub thawed_at: Option<Instant>,
}

/// Reads the counters of one activity source.
#[derive(Debug)]
pub struct ActivitySampler {
    source: ActivitySource,
    last_cpu: HashMap<VgpuId, (Duration, Instant, usize)>,
    nvml_warned: bool,
}

impl ActivitySampler {
    /// A sampler for `source`.
    pub fn new(source: ActivitySource) -> ActivitySampler {
        ActivitySampler {
            source,
            last_cpu: HashMap::new(),
            nvml_warned: false,
        }
    }

    /// The source.
    pub fn source(&self) -> ActivitySource {
        self.source
    }

    /// Samples every watched container: whether it has work. A container left out of the
    /// result could not be read this time (its first CPU sample, a read error, a cgroup gone)
    /// and gets no observation. A reading is compared only with the previous sample's: a
    /// container left out of `watched` (frozen, say) starts over with its next sample.
    pub fn sample(
        &mut self,
        watched: &mut [Watched<'_>],
        hierarchies: &Hierarchies,
        nvml: Option<&mut NvmlGpus>,
        now: Instant,
    ) -> Vec<(VgpuId, Observation)> {
        let sampled: HashSet<VgpuId> = watched.iter().map(|w| w.vgpu).collect();
        self.last_cpu.retain(|v, _| sampled.contains(v));
        match self.source {
            ActivitySource::Always => (watched.iter())
                .map(|w| (w.vgpu, Observation::Work))
                .collect(),
            ActivitySource::Cpu => watched
                .iter_mut()
                .filter_map(|w| {
                    // The containers' CPU time together; a container joining or leaving starts
                    // the comparison over.
                    let mut used = Duration::ZERO;
                    for reader in &mut w.readers {
                        used += reader.cpu_time(hierarchies).ok()?;
                    }
                    let count = w.readers.len();
                    let previous = self.last_cpu.insert(w.vgpu, (used, now, count));
                    let (before, at, _) = previous.filter(|p| p.2 == count)?;
                    let work = cpu_has_work(used.saturating_sub(before), now.duration_since(at));
                    Some((w.vgpu, Observation::from_work(work)))
                })
                .collect(),
            ActivitySource::Nvml => {
                let Some(nvml) = nvml else {
                    return Vec::new();
                };
                let gpus: BTreeSet<GpuIndex> = watched
                    .iter()
                    .flat_map(|w| w.gpus.iter().copied())
                    .collect();
                let mut busy = BTreeMap::new();
                let mut lag = Duration::ZERO;
                for g in gpus {
                    match nvml.busy_pids(g.0) {
                        Ok(found) => {
                            lag = lag.max(found.lag);
                            busy.insert(g, found.pids);
                        }
                        Err(e) if !self.nvml_warned => {
                            self.nvml_warned = true;
                            tracing::warn!(
                                "activity: NVML cannot tell who is busy on GPU {}: {e}",
                                g.0
                            );
                        }
                        Err(_) => {}
                    }
                }
                watched
                    .iter_mut()
                    .filter_map(|w| {
                        // Its processes matter only when someone is busy on one of its GPUs;
                        // then they are read now, not as last read.
                        let contended = w
                            .gpus
                            .iter()
                            .any(|g| busy.get(g).is_some_and(|b| !b.is_empty()));
                        let mut pids = Vec::new();
                        if contended {
                            for reader in &mut w.readers {
                                pids.extend(reader.pids().ok()?);
                            }
                        }
                        let work = nvml_has_work(&pids, w.gpus, &busy);
                        let since_thaw = w.thawed_at.map(|t| now.saturating_duration_since(t));
                        let observed = nvml_observation(work, contended, since_thaw, lag)?;
                        Some((w.vgpu, observed))
                    })
                    .collect()
            }
        }
    }

    /// Forgets a container that left.
    pub fn forget(&mut self, vgpu: VgpuId) {
        self.last_cpu.remove(&vgpu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_nvml_only_when_it_loaded() {
        use ActivityChoice as C;
        use ActivitySource as S;
        for (choice, loaded, source) in [
            (C::Auto, true, S::Nvml),
            (C::Auto, false, S::Cpu),
            (C::Nvml, true, S::Nvml),
            (C::Cpu, true, S::Cpu),
            (C::Always, false, S::Always),
        ] {
            assert_eq!(
                ActivitySource::resolve(choice, loaded),
                source,
                "{choice:?}"
            );
        }
    }

    #[test]
    fn a_tenth_of_a_cpu_is_work() {
        let ms = Duration::from_millis;
        for (used, elapsed, work) in [
            (ms(50), ms(50), true),
            (ms(5), ms(50), true),
            (ms(4), ms(50), false),
            (ms(0), ms(50), false),
            (ms(0), ms(0), false),
            (ms(10), ms(0), true),
        ] {
            assert_eq!(
                cpu_has_work(used, elapsed),
                work,
                "{used:?} over {elapsed:?}"
            );
        }
    }

    #[test]
    fn nvml_work_is_a_busy_process_of_the_container_on_its_own_gpus() {
        let busy: BTreeMap<GpuIndex, BTreeSet<u32>> =
            [(GpuIndex(0), [10, 11].into()), (GpuIndex(1), [20].into())].into();
        assert!(nvml_has_work(&[1, 11], &[GpuIndex(0)], &busy));
        assert!(!nvml_has_work(&[20], &[GpuIndex(0)], &busy));
        assert!(nvml_has_work(&[20], &[GpuIndex(0), GpuIndex(1)], &busy));
        assert!(!nvml_has_work(&[], &[GpuIndex(0)], &busy));
        assert!(!nvml_has_work(&[10], &[GpuIndex(2)], &busy));
    }

    #[test]
    fn a_container_just_thawed_keeps_its_work_until_nvml_could_see_it() {
        use Observation::*;
        let ms = Duration::from_millis;
        for (busy, others_busy, since_thaw, lag, observation) in [
            (true, false, Some(ms(10)), ms(400), Some(Work)),
            // Not named yet, whoever else is: too soon to tell, so its work is kept.
            (false, false, Some(ms(10)), ms(400), Some(NotYet)),
            (false, true, Some(ms(10)), ms(400), Some(NotYet)),
            (false, true, Some(ms(399)), ms(400), Some(NotYet)),
            // Long enough: nobody busy is no work; another busy is nothing.
            (false, false, Some(ms(400)), ms(400), Some(NoWork)),
            (false, true, Some(ms(400)), ms(400), None),
            (false, false, None, ms(400), Some(NoWork)),
            (false, false, Some(ms(0)), ms(0), Some(NoWork)),
        ] {
            assert_eq!(
                nvml_observation(busy, others_busy, since_thaw, lag),
                observation,
                "busy {busy}, others busy {others_busy}, thawed {since_thaw:?} ago, lag {lag:?}"
            );
        }
    }

    #[test]
    fn not_being_named_beside_a_busy_process_says_nothing() {
        use Observation::*;
        let ms = Duration::from_millis;
        // Its own process busy: work, whoever else is.
        assert_eq!(nvml_observation(true, true, None, ms(400)), Some(Work));
        // Another container's process busy, none of its own: no observation once it could
        // have been seen.
        assert_eq!(nvml_observation(false, true, None, ms(400)), None);
        assert_eq!(nvml_observation(false, true, Some(ms(900)), ms(400)), None);
        // Nobody busy on its GPUs: no work.
        assert_eq!(nvml_observation(false, false, None, ms(400)), Some(NoWork));
    }

    #[test]
    fn always_means_every_container() {
        let cgroup = gpuplex_cgroup::FreezerCgroup::new(
            gpuplex_cgroup::FreezerVersion::V2,
            "/nonexistent".into(),
        );
        let mut reader = CgroupReader::new(cgroup);
        let gpus = [GpuIndex(0)];
        let mut watched = [Watched {
            vgpu: VgpuId(1),
            readers: vec![&mut reader],
            gpus: &gpus,
            thawed_at: None,
        }];
        let mut sampler = ActivitySampler::new(ActivitySource::Always);
        let h = Hierarchies::from_mountinfo("");
        assert_eq!(
            sampler.sample(&mut watched, &h, None, Instant::now()),
            vec![(VgpuId(1), Observation::Work)]
        );
        // The cpu source has nothing to compare the first reading with (and here nothing to
        // read): no observation rather than a guess.
        let mut sampler = ActivitySampler::new(ActivitySource::Cpu);
        assert!(sampler
            .sample(&mut watched, &h, None, Instant::now())
            .is_empty());
    }
}
