//! vGPU requests: the `gpuplex.io/*` annotations of a container, parsed and validated.
//!
//! | annotation | accepted | default |
//! |---|---|---|
//! | `gpuplex.io/gpus` | a whole number from 1 to 1024 | 1 |
//! | `gpuplex.io/gpu-memory` | per GPU, a Kubernetes quantity (`8Gi`, `8192Mi`, `8G`, `1.5Gi`, `1e9`, bytes) that comes to a whole number of bytes, at least 1 | the whole GPU |
//! | `gpuplex.io/gpu-model` | model names, alternatives separated by `\|` (blank ones ignored, at least one) | any model |
//! | `gpuplex.io/weight` | a whole number from 1 to 100 | 1 |
//! | `gpuplex.io/priority` | `high`, `normal`, `low` (any case) | `normal` |
//!
//! Values may have whitespace around them; `gpus` and `weight` take digits only (no sign, no
//! decimal point). When a key is given twice, the last value counts. A container with no
//! `gpuplex.io/` annotation asks for no vGPU. An unknown key under `gpuplex.io/` is an error (a
//! typo must not pass silently), except the keys gpuplex writes itself (`gpuplex.io/vgpu-id`):
//! those are skipped, and a container that has one still asks for a vGPU.
//! [`VgpuRequest::from_annotations`] checks the keys in sorted order, so the first error it
//! reports does not depend on the order of the annotations.

use std::collections::BTreeMap;
use std::fmt;

use crate::quantity::{parse_quantity, shown, QuantityErrorKind};

/// The prefix of every gpuplex annotation.
pub const PREFIX: &str = "gpuplex.io/";
/// Number of GPUs (`1` to [`MAX_GPUS`]).
pub const GPUS: &str = "gpuplex.io/gpus";
/// GPU memory per GPU, a Kubernetes quantity.
pub const GPU_MEMORY: &str = "gpuplex.io/gpu-memory";
/// Acceptable GPU models, alternatives separated by `|`.
pub const GPU_MODEL: &str = "gpuplex.io/gpu-model";
/// Share weight (`1` to [`MAX_WEIGHT`]).
pub const WEIGHT: &str = "gpuplex.io/weight";
/// Priority class: `high`, `normal` or `low`.
pub const PRIORITY: &str = "gpuplex.io/priority";
/// The vGPU id gpuplex writes on a container's spec. Not part of a request: a container that
/// sets it itself is refused ([`RequestErrorReason::SetByGpuplex`]).
pub const VGPU_ID: &str = "gpuplex.io/vgpu-id";
/// The handle of the reservation gpuplex writes on a container's spec (podman's precreate),
/// which its `createRuntime` hook attaches with ([`crate::Handle`]). Refused in a request, as
/// [`VGPU_ID`] is.
pub const VGPU_HANDLE: &str = "gpuplex.io/vgpu-handle";
/// The handle of the device plugin's allocation ([`crate::units`]): the plugin's `Allocate`
/// answer carries it, the kubelet writes it on the container, and the containerd shim attaches
/// the container with it. Refused in a request, as [`VGPU_ID`] is.
pub const ALLOCATION: &str = "gpuplex.io/allocation";
/// The annotations gpuplex writes and a container may not.
pub const SET_BY_GPUPLEX: [&str; 3] = [VGPU_ID, VGPU_HANDLE, ALLOCATION];
/// The keys a user writes to ask for a vGPU, in the order they are documented.
pub const REQUEST_KEYS: [&str; 5] = [GPUS, GPU_MEMORY, GPU_MODEL, WEIGHT, PRIORITY];
/// Annotations that name a container's Kubernetes pod (containerd's CRI plugin writes the
/// `sandbox` ones, kubelet's labels the others). Kept with a vGPU for metrics and status.
pub const POD_NAME_KEYS: [&str; 2] = ["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"];
/// Annotations that name a container's Kubernetes namespace.
pub const POD_NAMESPACE_KEYS: [&str; 2] = [
    "io.kubernetes.cri.sandbox-namespace",
    "io.kubernetes.pod.namespace",
];
/// The most GPUs one request may ask for.
pub const MAX_GPUS: u32 = 1024;
/// The largest share weight.
pub const MAX_WEIGHT: u32 = 100;

/// How important a vGPU's work is (DESIGN.md, scheduling rules). Written `high`, `normal`,
/// `low`.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Never frozen; while it has work, `normal` and `low` vGPUs on its GPUs are frozen.
    High,
    /// Takes turns with the other `normal` vGPUs on its GPUs.
    #[default]
    Normal,
    /// Gets windows only when no `normal` vGPU on its GPUs has work.
    Low,
}

impl Priority {
    /// Every priority, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// How it is written: `high`, `normal` or `low`.
    pub fn name(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// GPU memory asked for on each assigned GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuMemory {
    /// All of the GPU's memory (no `gpuplex.io/gpu-memory` annotation).
    #[default]
    WholeGpu,
    /// This many bytes on each GPU.
    Bytes(u64),
}

impl GpuMemory {
    /// The bytes this entitles a vGPU to on a GPU of `capacity` bytes.
    pub fn bytes_on(self, capacity: u64) -> u64 {
        match self {
            GpuMemory::WholeGpu => capacity,
            GpuMemory::Bytes(bytes) => bytes,
        }
    }
}

/// A validated vGPU request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VgpuRequest {
    /// Number of physical GPUs, at least 1.
    pub gpus: u32,
    /// Memory entitlement on each GPU.
    pub memory: GpuMemory,
    /// Acceptable models (any one of them); empty means any model.
    pub models: Vec<String>,
    /// Share weight, 1..=100.
    pub weight: u32,
    /// Priority class.
    pub priority: Priority,
}

impl Default for VgpuRequest {
    fn default() -> Self {
        VgpuRequest {
            gpus: 1,
            memory: GpuMemory::WholeGpu,
            models: Vec::new(),
            weight: 1,
            priority: Priority::Normal,
        }
    }
}

impl VgpuRequest {
    /// Whether a GPU of this model satisfies the request. An alternative matches when its words
    /// (split on spaces, `-` and `_`, case ignored) appear in order among the model name's words:
    /// `A100` and `a100 80gb` match `NVIDIA A100-SXM4-80GB`; `A100` does not match
    /// `NVIDIA RTX A1000`. No alternatives: every model matches.
    pub fn accepts_model(&self, model: &str) -> bool {
        if self.models.is_empty() {
            return true;
        }
        let have = words(model);
        self.models.iter().any(|alternative| {
            let want = words(alternative);
            let mut have = have.iter();
            !want.is_empty() && want.iter().all(|w| have.any(|h| h == w))
        })
    }
}

fn words(text: &str) -> Vec<String> {
    text.split([' ', '-', '_'])
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

impl VgpuRequest {
    /// The vGPU request a container's annotations make, following the table in the module doc.
    ///
    /// Keys outside `gpuplex.io/` are ignored; without any `gpuplex.io/` key the container asks
    /// for no vGPU (`Ok(None)`). A key given twice counts with its last value. The keys are
    /// checked in sorted order, and the first invalid one is the error: an unknown `gpuplex.io/`
    /// key (with a "did you mean" when one is close) or a value that is not accepted.
    pub fn from_annotations<'a>(
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Option<VgpuRequest>, RequestError> {
        let ours: BTreeMap<&str, &str> = annotations
            .into_iter()
            .filter(|(key, _)| key.starts_with(PREFIX))
            .collect();
        if ours.is_empty() {
            return Ok(None);
        }
        let mut request = VgpuRequest::default();
        for (&key, &value) in &ours {
            let invalid = |reason| RequestError {
                annotation: key.to_string(),
                value: value.to_string(),
                reason,
            };
            match key {
                GPUS => {
                    request.gpus = whole_number(value, MAX_GPUS)
                        .ok_or_else(|| invalid(RequestErrorReason::Gpus))?;
                }
                GPU_MEMORY => {
                    let bytes = parse_quantity(value.trim())
                        .map_err(|err| invalid(RequestErrorReason::Memory(err.kind)))?;
                    request.memory = GpuMemory::Bytes(bytes);
                }
                GPU_MODEL => {
                    let models: Vec<String> = value
                        .split('|')
                        .map(str::trim)
                        .filter(|model| !model.is_empty())
                        .map(str::to_string)
                        .collect();
                    if models.is_empty() {
                        return Err(invalid(RequestErrorReason::Model));
                    }
                    request.models = models;
                }
                WEIGHT => {
                    request.weight = whole_number(value, MAX_WEIGHT)
                        .ok_or_else(|| invalid(RequestErrorReason::Weight))?;
                }
                PRIORITY => {
                    request.priority =
                        priority(value).ok_or_else(|| invalid(RequestErrorReason::Priority))?;
                }
                VGPU_ID | VGPU_HANDLE | ALLOCATION => {
                    return Err(invalid(RequestErrorReason::SetByGpuplex))
                }
                _ => {
                    let suggestion = suggest(key);
                    return Err(invalid(RequestErrorReason::UnknownAnnotation {
                        suggestion,
                    }));
                }
            }
        }
        Ok(Some(request))
    }
}

/// An invalid `gpuplex.io/` annotation.
///
/// Its `Display` is one line, printable as it is (control characters in the key or the value
/// are escaped): "annotation gpuplex.io/weight=`0` is invalid: expected a whole number from 1
/// to 100".
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("annotation {}=`{}` {}", shown(.annotation), shown(.value), .reason)]
pub struct RequestError {
    /// The annotation's key, as written.
    pub annotation: String,
    /// The annotation's value, as written (not trimmed).
    pub value: String,
    /// What is wrong and what is accepted.
    pub reason: RequestErrorReason,
}

/// What is wrong with an annotation. `Display` says it as a predicate of the annotation,
/// followed by what is accepted ("is invalid: expected `high`, `normal` or `low`").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestErrorReason {
    /// A `gpuplex.io/` key gpuplex does not know, with the known key it is closest to, if any.
    UnknownAnnotation {
        /// The closest request key within edit distance 3 of the unknown one, or whose name
        /// contains the unknown name or is contained in it.
        suggestion: Option<&'static str>,
    },
    /// `gpuplex.io/gpus` is not a whole number from 1 to [`MAX_GPUS`].
    Gpus,
    /// `gpuplex.io/gpu-memory` is not a memory quantity gpuplex accepts.
    Memory(QuantityErrorKind),
    /// `gpuplex.io/gpu-model` names no model.
    Model,
    /// `gpuplex.io/weight` is not a whole number from 1 to [`MAX_WEIGHT`].
    Weight,
    /// `gpuplex.io/priority` is not `high`, `normal` or `low`.
    Priority,
    /// One of [`SET_BY_GPUPLEX`]: gpuplex writes it when it gives a container its vGPU; a
    /// container that brings its own would name another container's vGPU.
    SetByGpuplex,
}

impl fmt::Display for RequestErrorReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestErrorReason::UnknownAnnotation { suggestion } => {
                write!(f, "is not a gpuplex annotation: ")?;
                if let Some(key) = suggestion {
                    write!(f, "did you mean `{key}`? ")?;
                }
                write!(f, "gpuplex reads {}", REQUEST_KEYS.join(", "))
            }
            RequestErrorReason::Gpus => write!(
                f,
                "is invalid: expected a whole number of GPUs from 1 to {MAX_GPUS}, like `1` or `2`"
            ),
            RequestErrorReason::Memory(kind) => write!(f, "{kind}"),
            RequestErrorReason::Model => write!(
                f,
                "is invalid: expected one or more GPU model names separated by `|`, like `A100` \
                 or `A100|H100`"
            ),
            RequestErrorReason::Weight => write!(
                f,
                "is invalid: expected a whole number from 1 to {MAX_WEIGHT}"
            ),
            RequestErrorReason::Priority => {
                write!(f, "is invalid: expected `high`, `normal` or `low`")
            }
            RequestErrorReason::SetByGpuplex => write!(
                f,
                "is gpuplex's to write, not a container's: remove it and ask with {}",
                REQUEST_KEYS.join(", ")
            ),
        }
    }
}

/// `text` (trimmed) as a whole number from 1 to `max`: digits only, no sign, no decimal point.
fn whole_number(text: &str, max: u32) -> Option<u32> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().filter(|n| (1..=max).contains(n))
}

/// `text` (trimmed, any case) as a priority class.
fn priority(text: &str) -> Option<Priority> {
    let text = text.trim();
    Priority::ALL
        .into_iter()
        .find(|p| text.eq_ignore_ascii_case(p.name()))
}

/// The request key an unknown `gpuplex.io/` key was probably meant to be: the closest by edit
/// distance (case ignored) among those within distance 3 or whose name contains the unknown
/// name or is contained in it (`gpu-mem`, `memory`, `gpus-per-pod`). Ties go to a containing
/// match, then to the first in [`REQUEST_KEYS`].
fn suggest(key: &str) -> Option<&'static str> {
    let name = key.strip_prefix(PREFIX)?.to_lowercase();
    if name.is_empty() {
        return None;
    }
    REQUEST_KEYS
        .iter()
        .filter_map(|&known| {
            let known_name = &known[PREFIX.len()..];
            let distance = edit_distance(&name, known_name);
            let contains = known_name.contains(name.as_str()) || name.contains(known_name);
            (distance <= 3 || contains).then_some((distance, !contains, known))
        })
        .min_by_key(|&(distance, not_contains, _)| (distance, not_contains))
        .map(|(_, _, known)| known)
}

/// Levenshtein distance between two strings, counted in chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod model_tests {
    use super::*;

    fn wants(models: &[&str]) -> VgpuRequest {
        VgpuRequest {
            models: models.iter().map(|m| m.to_string()).collect(),
            ..VgpuRequest::default()
        }
    }

    #[test]
    fn model_alternatives_match_by_words_in_order() {
        let cases: &[(&[&str], &str, bool)] = &[
            (&[], "anything", true),
            (&["A100"], "NVIDIA A100-SXM4-80GB", true),
            (&["a100 80gb"], "NVIDIA A100-SXM4-80GB", true),
            (&["80GB A100"], "NVIDIA A100-SXM4-80GB", false),
            (&["A100"], "NVIDIA RTX A1000", false),
            (&["H100", "A100"], "NVIDIA A100-PCIE-40GB", true),
            (&["H100", "L4"], "NVIDIA A100-PCIE-40GB", false),
            (&["NVIDIA H200"], "NVIDIA H200", true),
            (&["fake-gpu"], "Fake GPU", true),
        ];
        for (models, model, expected) in cases {
            assert_eq!(
                wants(models).accepts_model(model),
                *expected,
                "{models:?} vs {model}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(annotations: &[(&str, &str)]) -> Result<Option<VgpuRequest>, RequestError> {
        VgpuRequest::from_annotations(annotations.iter().copied())
    }

    fn request(edit: impl FnOnce(&mut VgpuRequest)) -> VgpuRequest {
        let mut request = VgpuRequest::default();
        edit(&mut request);
        request
    }

    #[test]
    fn without_a_gpuplex_key_there_is_no_vgpu() {
        let cases: &[&[(&str, &str)]] = &[
            &[],
            &[("io.kubernetes.cri.container-type", "container")],
            &[("GPUPLEX.IO/gpus", "2"), ("gpuplex.io", "x")],
            &[
                ("example.com/gpuplex.io/gpus", "0"),
                ("gpuplex.iox/gpus", "1"),
            ],
            &[("gpuplex-io/gpus", "banana")],
        ];
        for annotations in cases {
            assert_eq!(parse(annotations), Ok(None), "{annotations:?}");
        }
    }

    #[test]
    fn accepted_annotations_give_the_exact_request() {
        const GI: u64 = 1 << 30;
        let cases: Vec<(&[(&str, &str)], VgpuRequest)> = vec![
            (&[(GPUS, "1"), ("other", "x")], VgpuRequest::default()),
            (&[(GPUS, "2")], request(|r| r.gpus = 2)),
            (&[(GPUS, " 4\n")], request(|r| r.gpus = 4)),
            (&[(GPUS, "1024")], request(|r| r.gpus = 1024)),
            (&[(GPUS, "08")], request(|r| r.gpus = 8)),
            (
                &[(GPU_MEMORY, "8Gi")],
                request(|r| r.memory = GpuMemory::Bytes(8 * GI)),
            ),
            (
                &[(GPU_MEMORY, "8192Mi")],
                request(|r| r.memory = GpuMemory::Bytes(8 * GI)),
            ),
            (
                &[(GPU_MEMORY, "8G")],
                request(|r| r.memory = GpuMemory::Bytes(8_000_000_000)),
            ),
            (
                &[(GPU_MEMORY, " 1.5Gi ")],
                request(|r| r.memory = GpuMemory::Bytes(1_610_612_736)),
            ),
            (
                &[(GPU_MEMORY, "1e9")],
                request(|r| r.memory = GpuMemory::Bytes(1_000_000_000)),
            ),
            (
                &[(GPU_MEMORY, "1073741824")],
                request(|r| r.memory = GpuMemory::Bytes(GI)),
            ),
            (
                &[(GPU_MODEL, "A100")],
                request(|r| r.models = vec!["A100".into()]),
            ),
            (
                &[(GPU_MODEL, " A100 80GB | |H100|")],
                request(|r| r.models = vec!["A100 80GB".into(), "H100".into()]),
            ),
            (&[(WEIGHT, "1")], VgpuRequest::default()),
            (&[(WEIGHT, "100")], request(|r| r.weight = 100)),
            (&[(WEIGHT, " 42 ")], request(|r| r.weight = 42)),
            (
                &[(PRIORITY, "high")],
                request(|r| r.priority = Priority::High),
            ),
            (
                &[(PRIORITY, "Normal")],
                request(|r| r.priority = Priority::Normal),
            ),
            (
                &[(PRIORITY, " LOW ")],
                request(|r| r.priority = Priority::Low),
            ),
            (&[(GPUS, "1"), (GPUS, "3")], request(|r| r.gpus = 3)),
            (
                &[
                    ("io.kubernetes.pod.name", "trainer"),
                    (PRIORITY, "low"),
                    (WEIGHT, "3"),
                    (GPU_MODEL, "H100|A100"),
                    (GPU_MEMORY, "20Gi"),
                    (GPUS, "2"),
                ],
                VgpuRequest {
                    gpus: 2,
                    memory: GpuMemory::Bytes(20 * GI),
                    models: vec!["H100".into(), "A100".into()],
                    weight: 3,
                    priority: Priority::Low,
                },
            ),
        ];
        for (annotations, expected) in cases {
            assert_eq!(parse(annotations), Ok(Some(expected)), "{annotations:?}");
        }
    }

    #[test]
    fn a_container_cannot_bring_the_annotations_gpuplex_writes() {
        for key in SET_BY_GPUPLEX {
            for value in ["vgpu-5", "../../../../tmp/x", &"ab".repeat(16)] {
                assert_refused(
                    &[(GPUS, "1"), (key, value)],
                    key,
                    value,
                    "gpuplex's to write",
                );
            }
        }
    }

    /// Asserts that `annotations` fail on `key`=`value` with a one-line message that names both
    /// and contains `accepted`.
    fn assert_refused(annotations: &[(&str, &str)], key: &str, value: &str, accepted: &str) {
        let err = parse(annotations).expect_err(&format!("{annotations:?}"));
        assert_eq!((err.annotation.as_str(), err.value.as_str()), (key, value));
        let message = err.to_string();
        assert!(!message.contains('\n'), "{message}");
        let named = format!("annotation {}=`{}` ", shown(key), shown(value));
        assert!(message.starts_with(&named), "{message}");
        assert!(message.contains(accepted), "{message} lacks {accepted}");
    }

    #[test]
    fn invalid_values_name_the_annotation_the_value_and_what_is_accepted() {
        let gpus = "expected a whole number of GPUs from 1 to 1024";
        let units = "(Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E), like `8Gi`";
        let model = "GPU model names separated by `|`";
        let weight = "is invalid: expected a whole number from 1 to 100";
        let priority = "is invalid: expected `high`, `normal` or `low`";
        let cases: &[(&str, &str, &str)] = &[
            (GPUS, "0", gpus),
            (GPUS, "-1", gpus),
            (GPUS, "+1", gpus),
            (GPUS, "1.0", gpus),
            (GPUS, "1025", gpus),
            (GPUS, "99999999999999999999", gpus),
            (GPUS, "", gpus),
            (GPUS, "two", gpus),
            (GPUS, "1 2", gpus),
            (GPU_MEMORY, "", "is empty"),
            (GPU_MEMORY, "8GB", "`GB` is not a Kubernetes unit"),
            (GPU_MEMORY, "8gi", "`gi` is not a Kubernetes unit"),
            (GPU_MEMORY, "1.2.3Gi", units),
            (GPU_MEMORY, "Gi", units),
            (GPU_MEMORY, "1 Gi", units),
            (GPU_MEMORY, "-8Gi", "is negative"),
            (GPU_MEMORY, "0", "is zero"),
            (GPU_MEMORY, "0.5", "is not a whole number of bytes"),
            (GPU_MEMORY, "1m", "is not a whole number of bytes"),
            (GPU_MEMORY, "0.1Gi", "is not a whole number of bytes"),
            (GPU_MEMORY, "20Ei", "is too large"),
            (GPU_MEMORY, "99999999999999999999", "is too large"),
            (GPU_MODEL, "", model),
            (GPU_MODEL, " | |", model),
            (WEIGHT, "0", weight),
            (WEIGHT, "101", weight),
            (WEIGHT, "1.5", weight),
            (WEIGHT, "-3", weight),
            (PRIORITY, "urgent", priority),
            (PRIORITY, "", priority),
            (PRIORITY, "high!", priority),
            (PRIORITY, "hi\ngh", priority),
        ];
        for &(key, value, accepted) in cases {
            assert_refused(&[("other", "1"), (key, value)], key, value, accepted);
        }
        let err = parse(&[(WEIGHT, "0")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "annotation gpuplex.io/weight=`0` is invalid: expected a whole number from 1 to 100"
        );
        assert_eq!(err.reason, RequestErrorReason::Weight);
    }

    #[test]
    fn unknown_keys_are_refused_with_a_suggestion_when_one_is_close() {
        let cases: &[(&str, Option<&str>)] = &[
            ("gpuplex.io/gpu-mem", Some(GPU_MEMORY)),
            ("gpuplex.io/gpu-memroy", Some(GPU_MEMORY)),
            ("gpuplex.io/memory", Some(GPU_MEMORY)),
            ("gpuplex.io/gpu", Some(GPUS)),
            ("gpuplex.io/gpus-per-pod", Some(GPUS)),
            ("gpuplex.io/gpu-count", None),
            ("gpuplex.io/GPUs", Some(GPUS)),
            ("gpuplex.io/gpumodel", Some(GPU_MODEL)),
            ("gpuplex.io/model", Some(GPU_MODEL)),
            ("gpuplex.io/weigth", Some(WEIGHT)),
            ("gpuplex.io/prio", Some(PRIORITY)),
            ("gpuplex.io/priority-class", Some(PRIORITY)),
            ("gpuplex.io/", None),
            ("gpuplex.io/runtime", None),
            ("gpuplex.io/vgpu-identity", None),
            ("gpuplex.io/zzzzzzzz", None),
        ];
        let accepted = "gpuplex reads gpuplex.io/gpus, gpuplex.io/gpu-memory, \
                        gpuplex.io/gpu-model, gpuplex.io/weight, gpuplex.io/priority";
        for &(key, suggestion) in cases {
            assert_refused(&[(GPUS, "2"), (key, "x")], key, "x", accepted);
            let err = parse(&[(key, "x")]).unwrap_err();
            assert_eq!(
                err.reason,
                RequestErrorReason::UnknownAnnotation { suggestion },
                "{key}"
            );
            let hint = suggestion.map(|s| format!("did you mean `{s}`?"));
            assert_eq!(
                hint.as_ref()
                    .is_some_and(|h| err.to_string().contains(h.as_str())),
                suggestion.is_some(),
                "{err}"
            );
        }
        assert_eq!(
            parse(&[("gpuplex.io/gpu-mem", "8Gi")])
                .unwrap_err()
                .to_string(),
            "annotation gpuplex.io/gpu-mem=`8Gi` is not a gpuplex annotation: did you mean \
             `gpuplex.io/gpu-memory`? gpuplex reads gpuplex.io/gpus, gpuplex.io/gpu-memory, \
             gpuplex.io/gpu-model, gpuplex.io/weight, gpuplex.io/priority"
        );
    }

    #[test]
    fn the_first_error_in_key_order_is_reported_whatever_the_input_order() {
        let bad = [
            (WEIGHT, "0"),
            ("gpuplex.io/zz", "1"),
            (GPUS, "0"),
            (GPU_MEMORY, "8GB"),
            (PRIORITY, "urgent"),
        ];
        let mut reversed = bad;
        reversed.reverse();
        for annotations in [&bad[..], &reversed[..], &bad[1..]] {
            let err = parse(annotations).unwrap_err();
            assert_eq!(err.annotation, GPU_MEMORY, "{annotations:?}");
        }
        assert_eq!(parse(&bad[4..]).unwrap_err().annotation, PRIORITY);
        // The last value of a repeated key is the one checked.
        assert!(parse(&[(GPUS, "0"), (GPUS, "2")]).is_ok());
        assert_eq!(parse(&[(GPUS, "2"), (GPUS, "0")]).unwrap_err().value, "0");
    }

    #[test]
    fn messages_stay_on_one_line() {
        let cases: &[(&str, &str)] = &[
            ("gpuplex.io/gpus\n", "1"),
            (GPUS, "1\n2"),
            (GPU_MEMORY, "8Gi\r\nx"),
            (GPU_MEMORY, "8G\nB"),
            (GPU_MODEL, "\n|\u{2028}"),
            (WEIGHT, "\u{85}"),
        ];
        for &(key, value) in cases {
            let message = parse(&[(key, value)]).unwrap_err().to_string();
            assert!(
                !message.contains(['\n', '\r', '\u{85}', '\u{2028}']),
                "{message}"
            );
            assert!(message.starts_with(&format!("annotation {}=`", shown(key))));
        }
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                GPUS,
                GPU_MEMORY,
                GPU_MODEL,
                WEIGHT,
                PRIORITY,
                VGPU_ID,
                VGPU_HANDLE,
                ALLOCATION
            ])
            .prop_map(str::to_string),
            "gpuplex\\.io/[a-z-]{0,12}",
            any::<String>(),
        ]
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            "[ 0-9]{0,4}",
            "[0-9.]{1,5}(Ki|Mi|Gi|G|m|e3|GB)?",
            "(high|normal|low|LOW|x)",
            "[A-Za-z0-9 |]{0,12}",
            any::<String>(),
        ]
    }

    proptest! {
        #[test]
        fn never_panics_and_errors_are_one_line(
            annotations in prop::collection::vec((key(), value()), 0..8),
        ) {
            let result = VgpuRequest::from_annotations(
                annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            );
            match result {
                Ok(Some(request)) => {
                    prop_assert!((1..=MAX_GPUS).contains(&request.gpus));
                    prop_assert!((1..=MAX_WEIGHT).contains(&request.weight));
                    prop_assert!(request.memory != GpuMemory::Bytes(0));
                }
                Ok(None) => prop_assert!(annotations.iter().all(|(k, _)| !k.starts_with(PREFIX))),
                Err(err) => {
                    prop_assert!(err.annotation.starts_with(PREFIX));
                    prop_assert!(!err.to_string().contains('\n'));
                }
            }
        }

        #[test]
        fn no_gpuplex_key_means_no_vgpu(
            annotations in prop::collection::vec(
                (any::<String>().prop_filter("not gpuplex", |k| !k.starts_with(PREFIX)),
                 any::<String>()),
                0..8,
            ),
        ) {
            let result = VgpuRequest::from_annotations(
                annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            );
            prop_assert_eq!(result, Ok(None));
        }

        #[test]
        fn valid_values_are_parsed_exactly(
            gpus in 1..=MAX_GPUS,
            weight in 1..=MAX_WEIGHT,
            mebibytes in 1u64..1 << 20,
            priority in prop::sample::select(vec![Priority::High, Priority::Normal, Priority::Low]),
        ) {
            let texts = [
                (GPUS, gpus.to_string()),
                (WEIGHT, weight.to_string()),
                (GPU_MEMORY, format!("{mebibytes}Mi")),
                (PRIORITY, format!("{priority:?}").to_uppercase()),
            ];
            let result = VgpuRequest::from_annotations(
                texts.iter().map(|(k, v)| (*k, v.as_str())),
            );
            let expected = VgpuRequest {
                gpus,
                weight,
                memory: GpuMemory::Bytes(mebibytes << 20),
                priority,
                models: Vec::new(),
            };
            prop_assert_eq!(result, Ok(Some(expected)));
        }
    }
}
