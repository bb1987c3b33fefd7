//! GPU memory as a Kubernetes extended resource, `gpuplex.io/gpu-memory`, for clusters without
//! DRA's consumable capacity: the kubelet's device plugin API counts only devices, so each GPU
//! offers its memory as units (1 GiB each by default), and the kubelet hands a container as
//! many units as it asks for.
//!
//! The decisions are here, pure:
//! - [`units_of`]: the units each GPU offers, with ids that name their GPU (`gpu-<index>-<n>`),
//!   so that the kubelet's accounting is per GPU;
//! - [`preferred`]: the kubelet's `GetPreferredAllocation`: a request's units on one GPU that
//!   has room for all of them (the node's assignment policy chooses which);
//! - [`placement`]: the kubelet's `Allocate`: the GPU and memory the units it chose stand for.
//!   Units on two GPUs cannot make one vGPU's memory: they are refused, in one line.
//!
//! The kubelet's `Allocate` does not say which pod it serves; the units say all there is to say
//! (which GPU, how much), and no decision here depends on guessing the pod.

use std::collections::BTreeMap;
use std::fmt;

use crate::inventory::AssignmentPolicy;
use crate::node::Placement;
use crate::quantity::format_bytes;
use crate::GpuIndex;

/// The extended resource's name.
pub const RESOURCE: &str = "gpuplex.io/gpu-memory";

/// The default size of a unit: 1 GiB.
pub const DEFAULT_UNIT: u64 = 1 << 30;

/// One unit of a GPU's memory, as the kubelet counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnitId {
    /// Its GPU.
    pub gpu: GpuIndex,
    /// Its number on that GPU, from 0.
    pub n: u32,
}

impl fmt::Display for UnitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpu-{}-{}", self.gpu.0, self.n)
    }
}

impl std::str::FromStr for UnitId {
    type Err = UnitsError;

    /// `gpu-<index>-<n>`, decimal digits without sign or leading zero.
    fn from_str(s: &str) -> Result<UnitId, UnitsError> {
        let bad = || UnitsError::BadId(s.chars().take(64).collect());
        let number = |t: &str| -> Option<u32> {
            let plain = !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
            let canonical = t == "0" || !t.starts_with('0');
            (plain && canonical).then(|| t.parse().ok()).flatten()
        };
        let rest = s.strip_prefix("gpu-").ok_or_else(bad)?;
        let (gpu, n) = rest.split_once('-').ok_or_else(bad)?;
        Ok(UnitId {
            gpu: GpuIndex(number(gpu).ok_or_else(bad)?),
            n: number(n).ok_or_else(bad)?,
        })
    }
}

/// Why units cannot be given or read. One line, for the pod's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitsError {
    /// A device id that is not a unit's.
    #[error("{0:?} is not a {RESOURCE} unit of gpuplex's (gpu-<index>-<n>)")]
    BadId(String),
    /// The same unit twice in one request.
    #[error("{RESOURCE} unit {0} was given twice")]
    Twice(UnitId),
    /// No unit at all.
    #[error("no {RESOURCE} unit was given")]
    None,
    /// A unit beyond those its GPU offers (or of a GPU the node does not have).
    #[error("{RESOURCE} unit {unit} is not one this node lists: GPU {} offers {}", unit.gpu.0, offered_range(*unit, *offered))]
    Unlisted {
        /// The unit.
        unit: UnitId,
        /// How many units its GPU offers.
        offered: u64,
    },
    /// The same unit given to two containers of one `Allocate` request.
    #[error("{RESOURCE} unit {0} was given to two containers of one Allocate request; the kubelet gives a unit to one container at a time")]
    Shared(UnitId),
    /// Units on more than one GPU: one vGPU's memory is on one GPU.
    #[error("the kubelet gave this container {RESOURCE} on GPUs {gpus} ({units} units of {unit}); a vGPU's memory is on one GPU: ask for at most {most} (the most one GPU of this node offers), on a node with a GPU that has them free, or use DRA")]
    Spread {
        /// The GPUs, as `0, 1`.
        gpus: String,
        /// How many units.
        units: usize,
        /// One unit's size, as text.
        unit: String,
        /// The most units one GPU offers.
        most: u64,
    },
}

/// `offered` units of `unit`'s GPU, as a refusal says them: `40 units (gpu-0-0 to gpu-0-39)`.
fn offered_range(unit: UnitId, offered: u64) -> String {
    match offered {
        0 => "no units".to_owned(),
        1 => format!("1 unit (gpu-{}-0)", unit.gpu.0),
        n => format!("{n} units (gpu-{0}-0 to gpu-{0}-{1})", unit.gpu.0, n - 1),
    }
}

/// Checks that every unit is one that its GPU offers: `offered(gpu)` units numbered from 0, as
/// [`units_of`] lists them (0 for a GPU the node does not have). A unit the kubelet was never
/// shown (`gpu-0-99999`) stands for memory no one counted.
pub fn check_offered(
    units: &[UnitId],
    offered: impl Fn(GpuIndex) -> u64,
) -> Result<(), UnitsError> {
    match units.iter().find(|u| u64::from(u.n) >= offered(u.gpu)) {
        Some(unit) => Err(UnitsError::Unlisted {
            unit: *unit,
            offered: offered(unit.gpu),
        }),
        None => Ok(()),
    }
}

/// Checks that no unit is given to two containers of one `Allocate` request (`containers`,
/// each container's units): allocated one after the other, the second would end the first's
/// allocation and leave it a handle already released.
pub fn check_disjoint(containers: &[Vec<UnitId>]) -> Result<(), UnitsError> {
    let mut owner = BTreeMap::new();
    for (i, units) in containers.iter().enumerate() {
        for unit in units {
            if owner.insert(*unit, i).is_some_and(|first| first != i) {
                return Err(UnitsError::Shared(*unit));
            }
        }
    }
    Ok(())
}

/// The units each GPU offers: `capacity` bytes (its memory × `memory_overcommit`) in units of
/// `unit` bytes, rounded down, numbered from 0 on each GPU.
pub fn units_of(gpus: &[(GpuIndex, u64)], unit: u64) -> Vec<UnitId> {
    let unit = unit.max(1);
    gpus.iter()
        .flat_map(|&(gpu, capacity)| {
            let count = u32::try_from(capacity / unit).unwrap_or(u32::MAX);
            (0..count).map(move |n| UnitId { gpu, n })
        })
        .collect()
}

/// The units to prefer for one container asking for `size` of `available` (the kubelet's free
/// units), with `must` among them: all on one GPU that has room for `size`, chosen by `policy`
/// among those that can take `must` too (the GPU with the most free units for `Spread`, the one
/// with the fewest that still fit for `Pack`; the lower index on a tie); the lowest-numbered free
/// units there. When no GPU has room, `must` and then the GPUs with the most free units first
/// (the kubelet may then give them, and [`placement`] refuses them). Never more than `size`
/// unless `must` is larger; never a unit outside `available` and `must`.
pub fn preferred(
    available: &[UnitId],
    must: &[UnitId],
    size: usize,
    policy: AssignmentPolicy,
) -> Vec<UnitId> {
    let mut free: BTreeMap<GpuIndex, Vec<UnitId>> = BTreeMap::new();
    for u in available.iter().chain(must) {
        let list = free.entry(u.gpu).or_default();
        if !list.contains(u) {
            list.push(*u);
        }
    }
    for list in free.values_mut() {
        list.sort();
    }
    let must_gpus: Vec<GpuIndex> = {
        let mut g: Vec<GpuIndex> = must.iter().map(|u| u.gpu).collect();
        g.sort();
        g.dedup();
        g
    };
    let fits = |gpu: &GpuIndex, list: &Vec<UnitId>| {
        list.len() >= size && must_gpus.iter().all(|g| g == gpu)
    };
    let chosen = free
        .iter()
        .filter(|(gpu, list)| fits(gpu, list))
        .min_by_key(|(gpu, list)| match policy {
            AssignmentPolicy::Spread => (usize::MAX - list.len(), **gpu),
            AssignmentPolicy::Pack => (list.len(), **gpu),
        })
        .map(|(gpu, _)| *gpu);
    let mut picked: Vec<UnitId> = must.to_vec();
    picked.sort();
    picked.dedup();
    let mut order: Vec<(GpuIndex, Vec<UnitId>)> = free.into_iter().collect();
    match chosen {
        Some(gpu) => order.retain(|(g, _)| *g == gpu),
        None => order.sort_by_key(|(g, list)| (usize::MAX - list.len(), *g)),
    }
    for (_, list) in order {
        for u in list {
            if picked.len() >= size {
                break;
            }
            if !picked.contains(&u) {
                picked.push(u);
            }
        }
    }
    picked
}

/// The GPU and memory that the units the kubelet gave one container stand for (`ids`, the
/// `Allocate` request's device ids); `most` is the most units one GPU of the node offers, for
/// the refusal's advice. Refused when an id is not a unit, a unit comes twice, or the units are
/// on more than one GPU.
pub fn placement(ids: &[String], unit: u64, most: u64) -> Result<Placement, UnitsError> {
    let units = ids
        .iter()
        .map(|id| id.parse())
        .collect::<Result<Vec<UnitId>, _>>()?;
    placement_of(&units, unit, most)
}

/// [`placement`] of units already read.
pub fn placement_of(units: &[UnitId], unit: u64, most: u64) -> Result<Placement, UnitsError> {
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = units.iter().find(|u| !seen.insert(**u)) {
        return Err(UnitsError::Twice(*twice));
    }
    let mut gpus: Vec<GpuIndex> = units.iter().map(|u| u.gpu).collect();
    gpus.sort();
    gpus.dedup();
    match gpus.as_slice() {
        [] => Err(UnitsError::None),
        [gpu] => Ok(Placement {
            gpus: vec![*gpu],
            memory: unit.saturating_mul(units.len() as u64),
        }),
        many => Err(UnitsError::Spread {
            gpus: many
                .iter()
                .map(|g| g.0.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            units: units.len(),
            unit: format_bytes(unit),
            most,
        }),
    }
}

#[cfg(test)]
mod tests;
