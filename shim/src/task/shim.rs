//! The shim's life as containerd drives it (`start`, the daemon, `delete`): the five methods of
//! `containerd_shim::Shim`.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, DeleteResponse, ExitSignal, Flags, Shim, StartOpts};

use super::bundle;
use super::events::timestamp;
use super::node_link::NodeLink;
use super::options::RuntimeOptions;
use super::runtime::{OciRuntime, Runc};
use super::service::TaskService;
use super::vgpu::Node;

/// The annotation by which CRI groups a pod's containers into one shim.
const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

/// `containerd-shim-gpuplex-v1` as containerd runs it.
pub struct GpuplexShim {
    id: String,
    namespace: String,
    exit: Arc<ExitSignal>,
}

/// Which shim serves container `id`: its pod's (the sandbox id) under CRI, else its own.
pub fn grouping(id: &str, config: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(config)
        .ok()
        .and_then(|c| c["annotations"][SANDBOX_ID].as_str().map(str::to_owned))
        .filter(|sandbox| !sandbox.is_empty())
        .unwrap_or_else(|| id.to_owned())
}

/// Whether a shim serves `address` (`unix:///run/containerd/s/...`) already.
fn serving(address: &str) -> bool {
    let path = address.strip_prefix("unix://").unwrap_or(address);
    UnixStream::connect(path).is_ok()
}

/// Answers `start` with the bare address and ends the process. `containerd_shim` answers in
/// the JSON of containerd 1.7 and later, which containerd 1.6 reads as an address and fails to
/// dial; every containerd from 1.6 to 2.x accepts the bare address.
fn reply_plain(address: &str) -> ! {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(address.as_bytes());
    let _ = stdout.flush();
    std::process::exit(0);
}

impl GpuplexShim {
    /// What ends the daemon (a Shutdown, SIGTERM).
    pub fn exit_signal(&self) -> Arc<ExitSignal> {
        Arc::clone(&self.exit)
    }
}

impl Shim for GpuplexShim {
    type T = TaskService;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        GpuplexShim {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        // The bundle is the working directory; its config.json read as a hostile file.
        let config = bundle::read_bounded(Path::new("config.json")).unwrap_or_default();
        let group = grouping(&opts.id, &config);
        let address = opts.socket_address(&group);
        if serving(&address) {
            containerd_shim::util::write_address(&address)?;
            reply_plain(&address);
        }
        let options = match opts.extensions.iter().find(|any| !any.type_url.is_empty()) {
            Some(any) => RuntimeOptions::decode(any)
                .map_err(|e| containerd_shim::Error::InvalidArgument(e.to_string()))?,
            None => RuntimeOptions::default(),
        };
        let (pid, address) = containerd_shim::spawn(opts, &group, Vec::new())?;
        containerd_shim::cgroup::set_cgroup_and_oom_score(pid, &options.shim_cgroup)?;
        containerd_shim::util::write_address(&address)?;
        reply_plain(&address);
    }

    fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        // After a crash of the daemon: what it would have cleaned up.
        let bundle = std::env::current_dir().unwrap_or_default();
        let options = containerd_shim::util::read_options(&bundle)
            .map(|o| RuntimeOptions {
                binary_name: o.binary_name,
                root: o.root,
                systemd_cgroup: o.systemd_cgroup,
                ..Default::default()
            })
            .unwrap_or_default();
        if let Ok(runc) = Runc::new(&options, &self.namespace, &bundle) {
            let _ = runc.delete(&self.id);
        }
        let rootfs = bundle.join("rootfs");
        if Path::new(&rootfs).exists() {
            let _ = containerd_shim::mount::umount_recursive(rootfs.to_str(), 0);
        }
        NodeLink::from_env().release_container(&self.id);
        Ok(DeleteResponse {
            pid: 0,
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(timestamp(SystemTime::now())),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        TaskService::new(publisher, &self.namespace, Arc::clone(&self.exit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_containers_share_the_sandboxs_shim() {
        let member =
            br#"{"annotations":{"io.kubernetes.cri.sandbox-id":"pod-1","gpuplex.io/gpus":"1"}}"#;
        assert_eq!(grouping("c1", member), "pod-1");
        assert_eq!(grouping("c1", br#"{"annotations":{}}"#), "c1");
        assert_eq!(
            grouping(
                "c1",
                br#"{"annotations":{"io.kubernetes.cri.sandbox-id":""}}"#
            ),
            "c1"
        );
        assert_eq!(grouping("c1", b"not json"), "c1");
    }
}
