//! NVML, the NVIDIA management library: which GPUs this machine has and which processes use them.
//!
//! `nvml-wrapper` loads `libnvidia-ml.so.1` at run time, so the binaries start on machines without
//! it; [`NvmlGpus::load`] then says in one line why NVML is not usable.
//!
//! Activity ([`NvmlGpus::busy_pids`]) comes from per-process SM utilization samples
//! (`nvmlDeviceGetProcessUtilization`). The driver takes those samples at its own pace (from about
//! 1/6 s to 1 s depending on the GPU), usually slower than the service polls, so most polls see no
//! new sample. A pid seen busy is therefore held busy for about two driver sampling periods after
//! the poll that saw it (`hold`, estimated from the samples' timestamps); a newer sample that shows
//! the pid idle clears it at once. GPUs without per-process utilization fall back to the device's
//! utilization and its compute processes.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nvml_wrapper::error::NvmlError as RawError;
use nvml_wrapper::struct_wrappers::device::ProcessUtilizationSample as Sample;
use nvml_wrapper::{Device, Nvml};

/// How far back the first [`NvmlGpus::busy_pids`] call for a GPU looks, in microseconds.
const FIRST_LOOKBACK_US: u64 = 1_000_000;
/// How long a pid stays busy after the poll that saw it, until a sampling period is estimated.
const DEFAULT_HOLD_US: u64 = 1_000_000;
/// Bounds of the hold once estimated: twice the driver's sampling period, clamped.
const MIN_HOLD_US: u64 = 100_000;
const MAX_HOLD_US: u64 = 2_000_000;
/// Gaps between samples longer than this are idle stretches, not the sampling period.
const MAX_PERIOD_US: u64 = 2_000_000;
/// How many recent gaps the period estimate (their median) uses.
const GAPS_KEPT: usize = 9;
/// A newest sample this far ahead of the wall clock means the clock was stepped back (the
/// driver stamps its samples with the wall clock): what was seen is forgotten and the next query
/// looks back from the new time, else no sample would count until the clock caught up.
const CLOCK_STEP_US: u64 = 2_000_000;

/// NVML, loaded.
pub struct NvmlGpus {
    nvml: Nvml,
    trackers: HashMap<u32, Tracker>,
}

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML's index of the GPU.
    pub index: u32,
    /// Its UUID (`GPU-...`).
    pub uuid: String,
    /// Its model name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// Total memory in bytes.
    pub memory: u64,
    /// The minor number of its device node, `/dev/nvidia<minor>`.
    pub minor: u32,
}

/// How [`NvmlGpus::busy_pids`] decided which processes have GPU work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusyMethod {
    /// Per-process SM utilization samples (`nvmlDeviceGetProcessUtilization`).
    ProcessUtilization,
    /// The GPU does not report per-process utilization: every compute process counts as busy
    /// while the device's utilization is above 0.
    DeviceUtilization,
}

impl fmt::Display for BusyMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BusyMethod::ProcessUtilization => "per-process SM utilization samples",
            BusyMethod::DeviceUtilization => {
                "device utilization with its compute processes (this GPU does not report \
                 per-process utilization, so all its compute processes count as busy together)"
            }
        })
    }
}

/// The processes with GPU work on one GPU, and how that was decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusyPids {
    /// Host pids with GPU work.
    pub pids: BTreeSet<u32>,
    /// How they were found.
    pub method: BusyMethod,
    /// How far NVML lags the GPU here: work that started (or resumed after a thaw) less than this
    /// ago may not show yet, and work that stopped less than this ago may still show. About two
    /// of the driver's sampling periods (1 s until estimated). A container thawed less than this
    /// ago that shows no work has not been seen yet: it should not be read as idle.
    pub lag: Duration,
}

/// Why NVML is not usable, or a query failed: one line that says what the user can do.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    /// The library could not be loaded, or it loaded but could not be initialized.
    #[error(
        "NVML is not available: {reason}; install the NVIDIA driver or declare [[fake_gpu]] entries in gpuplex.toml"
    )]
    Unavailable {
        /// What went wrong, one line.
        reason: String,
    },
    /// There is no GPU with this index.
    #[error("NVML has no GPU {index}: this machine has {count} (see `nvidia-smi -L`)")]
    NoSuchGpu {
        /// The index asked for.
        index: u32,
        /// How many GPUs NVML sees.
        count: u32,
    },
    /// A query failed: what was asked, NVML's error, and what the user can do.
    #[error("{0}")]
    Query(String),
}

impl NvmlGpus {
    /// Loads `libnvidia-ml.so.1` and initializes NVML. Fails when the library is missing and when
    /// it loads but cannot be initialized (no driver, no permission, version mismatch).
    pub fn load() -> Result<NvmlGpus, NvmlError> {
        let nvml = Nvml::init().map_err(|e| NvmlError::Unavailable {
            reason: init_reason(&e),
        })?;
        Ok(NvmlGpus {
            nvml,
            trackers: HashMap::new(),
        })
    }

    /// Whether NVML still reports the GPU with `uuid` (a GPU that fell off the bus, or whose
    /// driver lost it, is not found).
    pub fn has(&self, uuid: &str) -> bool {
        self.nvml
            .device_by_uuid(uuid)
            .and_then(|d| d.uuid())
            .is_ok_and(|found| found == uuid)
    }

    /// The driver's version, when NVML tells it.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// Every GPU, by index.
    pub fn gpus(&self) -> Result<Vec<NvmlGpu>, NvmlError> {
        let count = count(&self.nvml)?;
        (0..count)
            .map(|index| {
                let device = device(&self.nvml, index)?;
                let q = |what| move |e| query_error(Some(index), what, &e);
                Ok(NvmlGpu {
                    index,
                    uuid: device.uuid().map_err(q("read the UUID"))?,
                    model: device.name().map_err(q("read the model name"))?,
                    memory: device
                        .memory_info()
                        .map_err(q("read the memory size"))?
                        .total,
                    minor: device
                        .minor_number()
                        .map_err(q("read the device minor number"))?,
                })
            })
            .collect()
    }

    /// The processes with GPU work on GPU `index` since the previous call for that GPU (the first
    /// call: since about a second ago): pids with an SM utilization sample above 0, each held busy
    /// for about two driver sampling periods after the call that saw it (see the module's notes).
    /// Where the GPU does not report per-process utilization, every pid with a compute context
    /// counts while the device's utilization is above 0; [`BusyPids::method`] says which.
    pub fn busy_pids(&mut self, index: u32) -> Result<BusyPids, NvmlError> {
        let device = device(&self.nvml, index)?;
        let tracker = self.trackers.entry(index).or_default();
        if !tracker.unsupported {
            let now = now_us();
            tracker.follow_clock(now);
            let since = tracker.since(now);
            match process_samples(&device, since) {
                Ok(samples) => {
                    let pids = tracker.update(now, since, &samples);
                    return Ok(BusyPids {
                        pids,
                        method: BusyMethod::ProcessUtilization,
                        lag: Duration::from_micros(tracker.hold_us()),
                    });
                }
                Err(RawError::NotSupported) => tracker.unsupported = true,
                Err(e) => return Err(query_error(Some(index), "read per-process utilization", &e)),
            }
        }
        let util = device
            .utilization_rates()
            .map_err(|e| query_error(Some(index), "read the utilization", &e))?;
        let compute = if util.gpu > 0 {
            compute_of(&device, index)?
        } else {
            BTreeSet::new()
        };
        Ok(BusyPids {
            pids: fallback_busy(util.gpu, compute),
            method: BusyMethod::DeviceUtilization,
            lag: Duration::from_micros(DEFAULT_HOLD_US),
        })
    }

    /// The pids that hold a compute context on GPU `index`.
    pub fn compute_pids(&self, index: u32) -> Result<BTreeSet<u32>, NvmlError> {
        compute_of(&device(&self.nvml, index)?, index)
    }

    /// The driver's per-process sampling period on GPU `index` as estimated so far by
    /// [`NvmlGpus::busy_pids`] (for logs); `None` before enough samples were seen.
    pub fn sample_period(&self, index: u32) -> Option<Duration> {
        self.trackers
            .get(&index)?
            .period_us()
            .map(Duration::from_micros)
    }
}

fn count(nvml: &Nvml) -> Result<u32, NvmlError> {
    nvml.device_count()
        .map_err(|e| query_error(None, "count the GPUs", &e))
}

fn device(nvml: &Nvml, index: u32) -> Result<Device<'_>, NvmlError> {
    nvml.device_by_index(index).map_err(|e| match e {
        RawError::InvalidArg | RawError::NotFound => match count(nvml) {
            Ok(count) => NvmlError::NoSuchGpu { index, count },
            Err(err) => err,
        },
        e => query_error(Some(index), "open the device", &e),
    })
}

impl fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlGpus")
            .field("driver", &self.driver_version())
            .finish_non_exhaustive()
    }
}

/// The samples newer than `since` (NVML answers `NotFound` when there are none). The count can
/// grow between NVML's two calls (`InsufficientSize`); that is retried once.
fn process_samples(device: &Device<'_>, since: u64) -> Result<Vec<Sample>, RawError> {
    match device.process_utilization_stats(since) {
        Err(RawError::InsufficientSize(_)) => device.process_utilization_stats(since),
        result => result,
    }
    .or_else(|e| match e {
        RawError::NotFound => Ok(Vec::new()),
        e => Err(e),
    })
}

fn compute_of(device: &Device<'_>, index: u32) -> Result<BTreeSet<u32>, NvmlError> {
    let processes = device
        .running_compute_processes()
        .map_err(|e| query_error(Some(index), "read the compute processes", &e))?;
    Ok(processes.into_iter().map(|p| p.pid).collect())
}

/// The fallback: every compute process is busy while the device's utilization is above 0.
fn fallback_busy(gpu_util: u32, compute: BTreeSet<u32>) -> BTreeSet<u32> {
    if gpu_util > 0 {
        compute
    } else {
        BTreeSet::new()
    }
}

/// What a pid's samples showed.
#[derive(Clone, Copy, Debug, Default)]
struct PidSeen {
    /// Timestamp of its newest sample (driver clock, µs).
    sample: u64,
    /// When (our clock, µs) a poll last saw it busy; `None` once a newer sample showed it idle.
    busy_at: Option<u64>,
}

/// What the previous calls for one GPU saw.
#[derive(Debug, Default)]
struct Tracker {
    /// The newest sample timestamp seen: the next query asks for samples after it.
    last_seen: Option<u64>,
    pids: BTreeMap<u32, PidSeen>,
    /// Recent gaps between successive newest sample timestamps, for the period estimate.
    gaps: VecDeque<u64>,
    /// The GPU answered `NotSupported`: use the fallback from now on.
    unsupported: bool,
}

impl Tracker {
    /// Forgets what was seen when the wall clock was stepped back below the newest sample.
    fn follow_clock(&mut self, now: u64) {
        if self
            .last_seen
            .is_some_and(|last| last > now.saturating_add(CLOCK_STEP_US))
        {
            *self = Tracker {
                unsupported: self.unsupported,
                ..Tracker::default()
            };
        }
    }

    /// The timestamp to ask NVML for samples after.
    fn since(&self, now: u64) -> u64 {
        self.last_seen
            .unwrap_or_else(|| now.saturating_sub(FIRST_LOOKBACK_US))
    }

    /// The driver's sampling period: the median of the recent gaps.
    fn period_us(&self) -> Option<u64> {
        if self.gaps.len() < 3 {
            return None;
        }
        let mut gaps: Vec<u64> = self.gaps.iter().copied().collect();
        gaps.sort_unstable();
        Some(gaps[gaps.len() / 2])
    }

    fn hold_us(&self) -> u64 {
        self.period_us()
            .map_or(DEFAULT_HOLD_US, |p| (2 * p).clamp(MIN_HOLD_US, MAX_HOLD_US))
    }

    /// Takes the samples newer than `since` that a poll at `now` got; returns the busy pids.
    fn update(&mut self, now: u64, since: u64, samples: &[Sample]) -> BTreeSet<u32> {
        let mut newest = None;
        for s in samples.iter().filter(|s| s.timestamp > since) {
            let seen = self.pids.entry(s.pid).or_default();
            if s.timestamp < seen.sample {
                continue;
            }
            seen.sample = s.timestamp;
            seen.busy_at = (s.sm_util > 0).then_some(now);
            newest = newest.max(Some(s.timestamp));
        }
        if let Some(newest) = newest {
            if let Some(gap) = self.last_seen.map(|last| newest.saturating_sub(last)) {
                if gap > 0 && gap <= MAX_PERIOD_US {
                    if self.gaps.len() == GAPS_KEPT {
                        self.gaps.pop_front();
                    }
                    self.gaps.push_back(gap);
                }
            }
            self.last_seen = Some(newest);
        }
        let hold = self.hold_us();
        // Seen at a later time than now: the clock went back since; no longer busy.
        let fresh = |seen: &PidSeen| seen.busy_at.is_some_and(|at| at <= now && now - at <= hold);
        // Forget pids neither busy nor sampled lately, so exited processes do not pile up.
        let floor = now.saturating_sub(10 * MAX_HOLD_US);
        self.pids
            .retain(|_, seen| fresh(seen) || seen.sample >= floor);
        self.pids
            .iter()
            .filter(|(_, seen)| fresh(seen))
            .map(|(pid, _)| *pid)
            .collect()
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// `text` on one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Why `Nvml::init` failed, for [`NvmlError::Unavailable`].
fn init_reason(e: &RawError) -> String {
    let lib = "libnvidia-ml.so.1";
    let detail = match e {
        RawError::LibloadingError(inner) => one_line(&inner.to_string()),
        e => one_line(&e.to_string()),
    };
    match e {
        RawError::LibloadingError(_) => format!("{lib} could not be loaded ({detail})"),
        RawError::DriverNotLoaded => {
            format!("{lib} loaded but the NVIDIA driver is not ({detail})")
        }
        RawError::NoPermission => {
            format!("no permission to use the NVIDIA driver ({detail}); run as root")
        }
        RawError::LibRmVersionMismatch => {
            format!("{lib} and the kernel driver differ ({detail}); reload the driver or reboot")
        }
        _ => format!("nvmlInit failed ({detail}); the driver may be too old or broken"),
    }
}

/// A failed query as one line, with what the user can do.
fn query_error(index: Option<u32>, what: &'static str, e: &RawError) -> NvmlError {
    let hint = match e {
        RawError::GpuLost => "the GPU fell off the bus; check `dmesg` and `nvidia-smi`",
        RawError::NoPermission => "run gpuplex as root or give it access to /dev/nvidia*",
        RawError::DriverNotLoaded | RawError::Uninitialized => {
            "check that the NVIDIA driver is loaded (`nvidia-smi`)"
        }
        RawError::NotSupported => "this GPU or driver does not support it",
        RawError::FailedToLoadSymbol(_) => "the NVIDIA driver may be too old; upgrade it",
        _ => "check the GPU with `nvidia-smi`",
    };
    let target = index.map_or_else(|| "this machine".to_string(), |i| format!("GPU {i}"));
    NvmlError::Query(format!(
        "NVML could not {what} for {target}: {}; {hint}",
        one_line(&e.to_string())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pid: u32, timestamp: u64, sm_util: u32) -> Sample {
        let (mem_util, enc_util, dec_util) = (0, 0, 0);
        #[rustfmt::skip]
        let sample = Sample { pid, timestamp, sm_util, mem_util, enc_util, dec_util };
        sample
    }

    fn set(pids: &[u32]) -> BTreeSet<u32> {
        pids.iter().copied().collect()
    }

    const T0: u64 = 1_700_000_000_000_000;
    const MS: u64 = 1_000;

    #[test]
    fn load_without_nvml_says_so_on_one_line() {
        // On a machine with a working driver this loads; there is nothing to check then.
        if let Err(e) = NvmlGpus::load() {
            let message = e.to_string();
            assert!(!message.contains('\n'), "{message}");
            assert!(message.starts_with("NVML is not available: "), "{message}");
            assert!(message.contains("[[fake_gpu]]"), "{message}");
        }
    }

    #[test]
    fn errors_are_one_line_and_say_what_to_do() {
        let m = query_error(Some(3), "read the compute processes", &RawError::GpuLost).to_string();
        assert!(m.starts_with("NVML could not read the compute processes for GPU 3: "));
        assert!(m.ends_with("check `dmesg` and `nvidia-smi`"), "{m}");
        let symbol = RawError::FailedToLoadSymbol("nvmlDeviceGetCount_v2:\nmissing".into());
        let m = query_error(None, "count the GPUs", &symbol).to_string();
        assert!(!m.contains('\n') && m.contains("for this machine"), "{m}");
        let reason = init_reason(&RawError::DriverNotLoaded);
        assert!(NvmlError::Unavailable { reason }
            .to_string()
            .contains("NVIDIA driver is not"));
        let m = NvmlError::NoSuchGpu { index: 4, count: 2 }.to_string();
        assert_eq!(
            m,
            "NVML has no GPU 4: this machine has 2 (see `nvidia-smi -L`)"
        );
    }

    #[test]
    fn first_call_looks_one_second_back_then_after_the_newest_sample() {
        let mut t = Tracker::default();
        let since = t.since(T0);
        assert_eq!(since, T0 - FIRST_LOOKBACK_US);
        // A sample older than asked for is ignored.
        assert_eq!(t.update(T0, since, &[s(9, since - 1, 80)]), set(&[]));
        assert_eq!(t.last_seen, None);
        t.update(T0, since, &[s(7, T0 - 300 * MS, 40)]);
        assert_eq!(t.since(T0 + 50 * MS), T0 - 300 * MS);
        // A poll with nothing new keeps asking from the same point.
        t.update(T0 + 50 * MS, T0 - 300 * MS, &[]);
        assert_eq!(t.since(T0 + 100 * MS), T0 - 300 * MS);
    }

    #[test]
    fn busy_pids_are_held_between_driver_samples_and_cleared_by_an_idle_sample() {
        let mut t = Tracker::default();
        let busy = t.update(T0, 0, &[s(1, T0 - 10 * MS, 50), s(2, T0 - 10 * MS, 0)]);
        assert_eq!(busy, set(&[1]));
        // Polls between driver samples see nothing new; pid 1 is still busy.
        assert_eq!(t.update(T0 + 50 * MS, t.since(0), &[]), set(&[1]));
        // A newer sample shows pid 1 idle and pid 2 busy.
        let since = t.since(0);
        let busy = t.update(
            T0 + 200 * MS,
            since,
            &[s(1, T0 + 150 * MS, 0), s(2, T0 + 150 * MS, 30)],
        );
        assert_eq!(busy, set(&[2]));
        // With no sample for longer than the hold, nothing is busy.
        let since = t.since(0);
        assert_eq!(
            t.update(T0 + 200 * MS + DEFAULT_HOLD_US + 1, since, &[]),
            set(&[])
        );
    }

    #[test]
    fn the_hold_follows_the_estimated_sampling_period() {
        let mut t = Tracker::default();
        assert_eq!(t.hold_us(), DEFAULT_HOLD_US);
        for i in 0..6 {
            let since = t.since(T0);
            t.update(T0 + i * 170 * MS, since, &[s(1, T0 + i * 167 * MS, 90)]);
        }
        assert_eq!(t.period_us(), Some(167 * MS));
        assert_eq!(t.hold_us(), 334 * MS);
        // An idle stretch longer than MAX_PERIOD_US does not count as a period.
        let since = t.since(T0);
        t.update(T0 + 9_000 * MS, since, &[s(1, T0 + 8_990 * MS, 90)]);
        assert_eq!(t.period_us(), Some(167 * MS));
    }

    #[test]
    fn a_wall_clock_stepped_back_is_followed_not_waited_for() {
        let mut t = Tracker::default();
        let since = t.since(T0);
        assert_eq!(t.update(T0, since, &[s(1, T0 - 10 * MS, 50)]), set(&[1]));
        // The clock goes back an hour: the old newest sample is far ahead of it.
        let back = T0 - 3_600_000 * MS;
        t.follow_clock(back);
        let since = t.since(back);
        assert_eq!(since, back - FIRST_LOOKBACK_US, "asks from the new time");
        assert_eq!(t.update(back, since, &[]), set(&[]), "nothing stays busy");
        let busy = t.update(back + 100 * MS, since, &[s(2, back + 50 * MS, 30)]);
        assert_eq!(busy, set(&[2]), "samples after the step count at once");
        // A step back within the margin keeps the tracker, but a pid seen busy "later" than
        // now is not held busy for the difference.
        let mut t = Tracker::default();
        t.update(T0, 0, &[s(1, T0 - 10 * MS, 50)]);
        t.follow_clock(T0 - 1_000 * MS);
        assert_eq!(t.last_seen, Some(T0 - 10 * MS));
        assert_eq!(t.update(T0 - 1_000 * MS, T0 - 10 * MS, &[]), set(&[]));
        // Forward steps change nothing but the hold running out.
        let mut t = Tracker::default();
        t.update(T0, 0, &[s(1, T0 - 10 * MS, 50)]);
        t.follow_clock(T0 + 3_600_000 * MS);
        assert_eq!(t.last_seen, Some(T0 - 10 * MS));
    }

    #[test]
    fn exited_pids_are_forgotten() {
        let mut t = Tracker::default();
        t.update(T0, 0, &[s(1, T0, 0), s(2, T0, 10)]);
        let later = T0 + 11 * MAX_HOLD_US;
        let since = t.since(0);
        t.update(later, since, &[s(3, later, 10)]);
        assert_eq!(t.pids.keys().copied().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn fallback_counts_compute_pids_only_while_the_device_is_busy() {
        assert_eq!(fallback_busy(0, set(&[1, 2])), set(&[]));
        assert_eq!(fallback_busy(37, set(&[1, 2])), set(&[1, 2]));
        fn send<T: Send>() {}
        send::<NvmlGpus>(); // it moves to the service's sampling thread
    }
}
