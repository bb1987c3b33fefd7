//! The pure core of gpuplex: everything gpuplex decides, and nothing it does.
//!
//! - [`request`]: a vGPU request parsed and validated from `gpuplex.io/*` annotations.
//! - [`inventory`]: the GPUs of a node, the memory bound on each, and GPU assignment.
//! - [`windows`]: the execution-window scheduler: who runs on each GPU, who is frozen, and when
//!   the next decision is due.
//! - [`accounting`]: GPU time, waits and windows per vGPU; busy time and switches per GPU.
//! - [`node`]: the node as one value: reservations, attachments, releases, lapses and status
//!   around the inventory and the windows.
//! - [`config`]: the `[scheduler]` section of `gpuplex.toml`.
//! - [`policy`]: the `[policy]` section: what a container owner may ask for.
//! - [`sim`]: a deterministic simulator that drives the scheduler through a scenario.
//!
//! The crate does no I/O, starts no thread and reads no clock: time is an [`Instant`] passed in,
//! state is a value the caller owns. The node service, the hook and the shim only call it.
//!
//! The whole path of one container, as the node service drives it:
//!
//! ```
//! use std::time::Duration;
//! use gpuplex_scheduler::config::SchedulerConfig;
//! use gpuplex_scheduler::inventory::{Gpu, Inventory};
//! use gpuplex_scheduler::request::VgpuRequest;
//! use gpuplex_scheduler::windows::{Action, Binding, WindowScheduler};
//! use gpuplex_scheduler::{GpuIndex, Instant, VgpuId};
//!
//! let config = SchedulerConfig::default();
//! let gpu = Gpu { index: GpuIndex(0), uuid: "GPU-0".into(), model: "NVIDIA A100-SXM4-40GB".into(), memory: 40 << 30 };
//! let mut inventory = Inventory::new(vec![gpu], config.memory_overcommit).unwrap();
//! let mut windows = WindowScheduler::new([GpuIndex(0)], &config);
//! let now = Instant::ZERO;
//!
//! // Two containers ask for 8 GiB each; the second weighs twice as much.
//! for (id, weight) in [(1, "1"), (2, "2")] {
//!     let annotations = [("gpuplex.io/gpu-memory", "8Gi"), ("gpuplex.io/weight", weight)];
//!     let request = VgpuRequest::from_annotations(annotations).unwrap().expect("asks for a vGPU");
//!     let assignment = inventory
//!         .assign(VgpuId(id), &request, config.policy, |g| windows.gpu_has_work(g))
//!         .unwrap();
//!     let binding = Binding { gpus: assignment.gpus, weight: request.weight, priority: request.priority };
//!     windows.bind(VgpuId(id), binding, now).unwrap();
//! }
//! assert_eq!(inventory.unreserved(GpuIndex(0)), 24 << 30);
//!
//! // Both show work: one runs, the other is frozen until the window ends.
//! let now = now + Duration::from_millis(50);
//! windows.observe(VgpuId(1), true, now);
//! windows.observe(VgpuId(2), true, now);
//! let decision = windows.decide(now);
//! assert_eq!(decision.actions, [Action::Freeze(VgpuId(2))]);
//! assert_eq!(decision.next_due, Some(now + Duration::from_millis(100)), "unless 1 shows work again");
//!
//! // A container without gpuplex annotations asks for nothing.
//! assert_eq!(VgpuRequest::from_annotations([("io.kubernetes.pod.name", "web")]), Ok(None));
//! ```

#![deny(missing_docs)]

pub mod accounting;
pub mod config;
pub mod inventory;
pub mod node;
pub mod policy;
pub mod quantity;
pub mod request;
pub mod sim;
pub mod time;
pub mod toml_place;
pub mod units;
pub mod windows;

use std::fmt;
use std::str::FromStr;

pub use time::Instant;

/// The identity of one vGPU: what is assigned GPUs, bound to a container and scheduled.
///
/// Written `vgpu-<n>` (the `gpuplex.io/vgpu-id` annotation); the node service allocates the
/// numbers, and never the same one twice on a node (see [`node::Node::start_ids_at`]). An id
/// names a vGPU; it grants nothing (see [`Handle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VgpuId(pub u64);

impl fmt::Display for VgpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vgpu-{}", self.0)
    }
}

/// A string that is not a vGPU id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{}` is not a vGPU id: expected `vgpu-` followed by a number, like `vgpu-7`", quantity::shown(.0))]
pub struct VgpuIdError(pub String);

impl FromStr for VgpuId {
    type Err = VgpuIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.strip_prefix("vgpu-")
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse().ok())
            .map(VgpuId)
            .ok_or_else(|| VgpuIdError(s.to_string()))
    }
}

/// The capability that carries a reservation from `reserve` to `attach`: 128 random bits,
/// written as 32 lowercase hexadecimal digits (the `gpuplex.io/vgpu-handle` annotation).
///
/// A vGPU id names a vGPU (in logs, status, the container's identity); only a handle attaches
/// a container to a reservation or releases it on the container's behalf, so that nothing a
/// container owner can write (another container's id, a guess) reaches a vGPU that is not
/// theirs. The node service draws handles from the kernel's random source; this crate, which
/// has none, only carries them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Handle([u8; 16]);

impl Handle {
    /// The handle made of these (random) bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Handle {
        Handle(bytes)
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Never shows the secret: a handle in a debug print or a log line would hand it out.
impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Handle(..)")
    }
}

/// A string that is not a handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a vGPU handle: expected 32 lowercase hexadecimal digits, as gpuplex writes them")]
pub struct HandleError;

impl FromStr for Handle {
    type Err = HandleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = s.as_bytes();
        if digits.len() != 32
            || !digits
                .iter()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(HandleError);
        }
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| HandleError)?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| HandleError)?;
        }
        Ok(Handle(bytes))
    }
}

/// The host index of a physical GPU (NVML's index, or the `[[fake_gpu]]` entry's position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuIndex(pub u32);

impl fmt::Display for GpuIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vgpu_id_round_trips() {
        let id = VgpuId(42);
        assert_eq!(id.to_string(), "vgpu-42");
        assert_eq!("vgpu-42".parse(), Ok(id));
        for bad in [
            "",
            "vgpu-",
            "vgpu-x",
            "42",
            "vgpu--1",
            "vgpu-+1",
            "vgpu-99999999999999999999",
        ] {
            assert!(bad.parse::<VgpuId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_handle_round_trips_and_never_shows_in_debug() {
        let handle = Handle::from_bytes([0xab; 16]);
        let text = handle.to_string();
        assert_eq!(text, "ab".repeat(16));
        assert_eq!(text.parse(), Ok(handle));
        assert_eq!(format!("{handle:?}"), "Handle(..)");
        for bad in [
            "",
            "vgpu-1",
            &"AB".repeat(16),
            &"ab".repeat(15),
            &"ab".repeat(17),
            &format!("{}g", "a".repeat(31)),
            &format!("../{}", "a".repeat(29)),
        ] {
            assert_eq!(bad.parse::<Handle>(), Err(HandleError), "{bad}");
        }
    }
}

/// Written as its text (`vgpu-7`, 32 hexadecimal digits) wherever serde writes one, and read
/// back through [`FromStr`], so that a file or a reply holding a malformed one is refused where
/// it is read.
macro_rules! serde_as_text {
    ($type:ty, $what:literal) => {
        impl serde::Serialize for $type {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $type {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                text.parse().map_err(|_| {
                    serde::de::Error::invalid_value(serde::de::Unexpected::Str(&text), &$what)
                })
            }
        }
    };
}

serde_as_text!(VgpuId, "a vGPU id such as `vgpu-7`");
serde_as_text!(Handle, "a vGPU handle of 32 lowercase hexadecimal digits");
