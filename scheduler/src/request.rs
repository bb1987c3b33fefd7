//! vGPU requests: the `gpuplex.io/*` annotations of a container, parsed and validated.
//!
//! | annotation | accepted | default |
//! |---|---|---|
//! | `gpuplex.io/gpus` | a whole number, 1 or more | 1 |
//! | `gpuplex.io/gpu-memory` | per GPU, a Kubernetes quantity (`8Gi`, `8192Mi`, `8G`, `1.5Gi`, bytes) | the whole GPU |
//! | `gpuplex.io/gpu-model` | model names, alternatives separated by `|` | any model |
//! | `gpuplex.io/weight` | 1..=100 | 1 |
//! | `gpuplex.io/priority` | `high`, `normal`, `low` | `normal` |
//!
//! A container with no `gpuplex.io/` annotation asks for no vGPU. An unknown key under
//! `gpuplex.io/` is an error (a typo must not pass silently), except the keys gpuplex writes
//! itself (`gpuplex.io/vgpu-id`).

/// How important a vGPU's work is (DESIGN.md, scheduling rules).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Never frozen; while it has work, `normal` and `low` vGPUs on its GPUs are frozen.
    High,
    /// Takes turns with the other `normal` vGPUs on its GPUs.
    #[default]
    Normal,
    /// Gets windows only when no `normal` vGPU on its GPUs has work.
    Low,
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
            assert_eq!(wants(models).accepts_model(model), *expected, "{models:?} vs {model}");
        }
    }
}
