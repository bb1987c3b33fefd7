//! Which GPUs this machine has: `[[fake_gpu]]` entries when the configuration declares any,
//! else what NVML reports, else none (the service still starts, and refuses registrations
//! saying why).

use std::path::{Path, PathBuf};

use gpuplex_cgroup::DeviceNumbers;
use gpuplex_scheduler::inventory::Gpu;
use gpuplex_scheduler::GpuIndex;

use crate::nvml::NvmlGpus;
use gpuplex_wire::config::{ActivityChoice, NodeConfig};
pub use gpuplex_wire::protocol::DeviceNode;

/// The NVIDIA character device major number.
pub const NVIDIA_MAJOR: u32 = 195;

/// One GPU of this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeGpu {
    /// What the scheduler knows of it.
    pub gpu: Gpu,
    /// Its device node.
    pub device: DeviceNode,
    /// Declared in `[[fake_gpu]]`.
    pub fake: bool,
}

/// Where the GPUs came from.
pub enum GpuSource {
    /// `[[fake_gpu]]` entries.
    Fake,
    /// NVML, loaded.
    Nvml(Box<NvmlGpus>),
    /// Neither: why NVML is not usable, in one line.
    None(String),
}

/// The GPUs found, and NVML when it is what found them.
pub struct Discovery {
    /// Every GPU, by index.
    pub gpus: Vec<NodeGpu>,
    /// Where they came from.
    pub source: GpuSource,
}

/// Why the GPUs cannot be used. One line.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A fake GPU's device node is missing or is not a character device.
    #[error("fake_gpu[{index}].device {path}: {problem}; create it with `mknod -m 666 {path} c {NVIDIA_MAJOR} <minor>`")]
    FakeDevice {
        /// The entry.
        index: usize,
        /// The node.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// NVML loaded but could not list the GPUs.
    #[error("{0}")]
    Nvml(String),
    /// `activity = "nvml"` without NVML GPUs.
    #[error("activity = \"nvml\" needs NVML, but {0}; use activity = \"cpu\" or \"always\" (or \"auto\")")]
    NvmlActivity(String),
}

/// Whether `gpu` is still usable: its device node is still the character device it was, and NVML,
/// when it found the GPU, still reports it. What the device plugin reports to the kubelet as
/// the GPU's health.
pub fn healthy(gpu: &NodeGpu, source: &GpuSource) -> bool {
    let node = DeviceNumbers::of(&gpu.device.path).ok().flatten();
    let same_node = node.is_some_and(|n| {
        n.kind == gpuplex_cgroup::DeviceKind::Char
            && (n.major, n.minor) == (gpu.device.major, gpu.device.minor)
    });
    match source {
        GpuSource::Nvml(nvml) if !gpu.fake => same_node && nvml.has(&gpu.gpu.uuid),
        _ => same_node,
    }
}

/// Finds this machine's GPUs as the configuration says.
pub fn discover(config: &NodeConfig) -> Result<Discovery, GpuError> {
    if !config.fake_gpus.is_empty() {
        if config.service.activity == ActivityChoice::Nvml {
            return Err(GpuError::NvmlActivity(
                "the GPUs are [[fake_gpu]] entries".into(),
            ));
        }
        let mut gpus = Vec::new();
        for (i, fake) in config.fake_gpus.iter().enumerate() {
            let (major, minor) =
                char_device(&fake.device).map_err(|problem| GpuError::FakeDevice {
                    index: i,
                    path: fake.device.display().to_string(),
                    problem,
                })?;
            gpus.push(NodeGpu {
                gpu: Gpu {
                    index: GpuIndex(i as u32),
                    uuid: fake.uuid.clone(),
                    model: fake.model.clone(),
                    memory: fake.memory,
                },
                device: DeviceNode {
                    path: fake.device.clone(),
                    major,
                    minor,
                },
                fake: true,
            });
        }
        return Ok(Discovery {
            gpus,
            source: GpuSource::Fake,
        });
    }
    let nvml = match NvmlGpus::load() {
        Ok(nvml) => nvml,
        Err(e) => {
            if config.service.activity == ActivityChoice::Nvml {
                return Err(GpuError::NvmlActivity(e.to_string()));
            }
            return Ok(Discovery {
                gpus: Vec::new(),
                source: GpuSource::None(e.to_string()),
            });
        }
    };
    let listed = nvml.gpus().map_err(|e| GpuError::Nvml(e.to_string()))?;
    let gpus = listed
        .into_iter()
        .map(|g| {
            let path = PathBuf::from(format!("/dev/nvidia{}", g.minor));
            let (major, minor) = char_device(&path).unwrap_or((NVIDIA_MAJOR, g.minor));
            NodeGpu {
                gpu: Gpu {
                    index: GpuIndex(g.index),
                    uuid: g.uuid,
                    model: g.model,
                    memory: g.memory,
                },
                device: DeviceNode { path, major, minor },
                fake: false,
            }
        })
        .collect();
    Ok(Discovery {
        gpus,
        source: GpuSource::Nvml(Box::new(nvml)),
    })
}

/// The major and minor numbers of a character device node.
fn char_device(path: &Path) -> Result<(u32, u32), String> {
    let found = DeviceNumbers::char_device(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        _ => e.to_string(),
    })?;
    let numbers = found.ok_or("not a character device")?;
    Ok((numbers.major, numbers.minor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplex_wire::config::FakeGpu;

    fn with_fake(device: &Path) -> NodeConfig {
        let mut config = NodeConfig::default();
        config.fake_gpus.push(FakeGpu {
            uuid: "GPU-fake-0".into(),
            model: "Fake A100".into(),
            memory: 1 << 30,
            device: device.to_path_buf(),
        });
        config
    }

    #[test]
    fn a_fake_gpu_needs_a_character_device() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = discover(&with_fake(&missing)).err().unwrap().to_string();
        assert!(err.contains("no such file; create it with `mknod"), "{err}");
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = discover(&with_fake(&file)).err().unwrap().to_string();
        assert!(err.contains("not a character device"), "{err}");
        // /dev/null is a character device (1:3): good enough for a fake GPU's node.
        let found = discover(&with_fake(Path::new("/dev/null"))).unwrap();
        assert!(matches!(found.source, GpuSource::Fake));
        assert_eq!(found.gpus[0].device.major, 1);
        assert_eq!(found.gpus[0].device.minor, 3);
        assert!(found.gpus[0].fake);
    }

    #[test]
    fn nvml_activity_is_refused_on_fake_gpus() {
        let mut config = with_fake(Path::new("/dev/null"));
        config.service.activity = ActivityChoice::Nvml;
        let err = discover(&config).err().unwrap().to_string();
        assert!(err.starts_with("activity = \"nvml\" needs NVML"), "{err}");
    }

    #[test]
    fn without_nvml_or_fake_gpus_there_are_none_and_the_reason_is_kept() {
        // This machine has no NVIDIA driver; on one that has, NVML lists its GPUs instead.
        if NvmlGpus::load().is_ok() {
            eprintln!("NOTE: NVML loads here; the no-GPU case is not checked");
            return;
        }
        let found = discover(&NodeConfig::default()).unwrap();
        assert!(found.gpus.is_empty());
        let GpuSource::None(why) = found.source else {
            panic!("expected no GPU source")
        };
        assert!(why.contains("NVML"), "{why}");
    }
}
