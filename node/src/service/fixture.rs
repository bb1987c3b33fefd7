//! A node service made of fixtures, for the tests and the fuzz target that drive the
//! production dispatcher ([`Service::handle`]) without root: one fake GPU of 16 GiB, the state
//! directory, the socket's directory (the identity files), the CDI spec directory (empty) and a
//! cgroup v1 freezer hierarchy of plain directories, all under one directory. A fixture cgroup's `freezer.state` reads back what was
//! written, so a freeze is confirmed at once; it holds no process.

use std::fs;
use std::path::{Path, PathBuf};

use gpuplex_cgroup::Hierarchies;
use gpuplex_scheduler::inventory::Gpu;
use gpuplex_scheduler::{GpuIndex, Handle};
use gpuplex_wire::config::NodeConfig;
use gpuplex_wire::protocol::DeviceNode;

use super::{HandleSource, Parts, Service};
use crate::gpus::{Discovery, GpuSource, NodeGpu};
use crate::state::StateDir;

/// The fixture GPU's UUID.
pub const GPU_UUID: &str = "GPU-fake-0";

/// A service over fixtures under `dir` (which must exist), drawing handles `[n; 16]` for the
/// n-th reservation (n = 1, 2, ...) so that a test or a fuzz input can attach what it reserved.
/// Fails (one line) only when the directory cannot hold the fixtures.
pub fn service(dir: &Path) -> Result<Service, String> {
    service_with_state(dir, &dir.join("state"))
}

/// [`service`], with its state directory at `state_dir` (a test restarts a service over a copy
/// of another's state: the first keeps its node lock).
pub fn service_with_state(dir: &Path, state_dir: &Path) -> Result<Service, String> {
    let freezer = dir.join("freezer");
    let state_dir = state_dir.to_path_buf();
    let cdi = dir.join("cdi");
    fs::create_dir_all(&freezer).map_err(|e| format!("{}: {e}", freezer.display()))?;
    let mut config = NodeConfig::default();
    config.service.state_dir = state_dir.clone();
    // The identity files of released vGPUs are removed beside the socket: here, not /run.
    config.service.socket = dir.join("gpuplex.sock");
    config.service.cdi_spec_dirs = vec![cdi];
    let state = StateDir::open(&state_dir).map_err(|e| e.to_string())?;
    let lock = (state.lock(std::time::Duration::ZERO)).map_err(|e| e.to_string())?;
    let found = Discovery {
        gpus: vec![NodeGpu {
            gpu: Gpu {
                index: GpuIndex(0),
                uuid: GPU_UUID.into(),
                model: "Fake GPU".into(),
                memory: 16 << 30,
            },
            device: DeviceNode {
                path: dir.join("nvidia0"),
                major: 195,
                minor: 0,
            },
            fake: true,
        }],
        source: GpuSource::Fake,
    };
    let hierarchies = Hierarchies {
        freezer: Some(freezer),
        ..Hierarchies::default()
    };
    let mut service = Service::assemble(Parts {
        config,
        found,
        hierarchies,
        state,
        lock,
    })
    .map_err(|e| e.to_string())?;
    service.draw_handles_from(counting_handles());
    Ok(service)
}

/// Handles `[n; 16]` for n = 1, 2, ...
pub fn counting_handles() -> HandleSource {
    let mut n = 0u8;
    Box::new(move || {
        n = n.wrapping_add(1);
        Ok(Handle::from_bytes([n; 16]))
    })
}

/// A container's fixture cgroup under `dir`'s freezer hierarchy (thawed, no process), by a
/// plain name.
pub fn cgroup(dir: &Path, name: &str) -> std::io::Result<PathBuf> {
    let path = dir.join("freezer").join(name);
    fs::create_dir_all(&path)?;
    fs::write(path.join("freezer.state"), "THAWED\n")?;
    fs::write(path.join("cgroup.procs"), "")?;
    Ok(path)
}

/// A service of fixtures over a temporary directory, for the service's unit tests; each test
/// module adds the methods it needs.
#[cfg(test)]
pub(super) struct Fixture {
    pub dir: tempfile::TempDir,
    pub service: Service,
}

#[cfg(test)]
impl Fixture {
    pub fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let service = self::service(dir.path()).unwrap();
        Fixture { dir, service }
    }

    /// A container's fixture cgroup, by name.
    pub fn cgroup(&self, name: &str) -> PathBuf {
        self::cgroup(self.dir.path(), name).unwrap()
    }

    /// Sends `line` as a client would; the reply, checked to be one line that reads back as
    /// itself.
    pub fn ask(&mut self, line: &str) -> gpuplex_wire::protocol::Reply {
        use gpuplex_wire::protocol::{parse_request, Reply};
        let reply = self.service.handle(parse_request(line.as_bytes()).unwrap());
        let text = reply.to_line();
        assert!(
            text.ends_with('\n') && text.matches('\n').count() == 1,
            "{text}"
        );
        let back: Reply = serde_json::from_str(&text).unwrap();
        assert_eq!(back, reply);
        reply
    }
}
