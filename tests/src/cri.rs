//! The Kubernetes path's fixtures (root): one-layer OCI image tarballs made from `/bin/busybox`
//! and imported into containerd's `k8s.io` namespace (the CRI plugin's), and a CRI client that
//! acts as the kubelet over containerd's unix socket (../shared/notes/container-stack.md §9).
//!
//! The client is the `k8s-cri` crate's tonic client on a tokio runtime of its own; every call
//! blocks, is bounded by [`CALL_TIMEOUT`] and is timed, so tests stay plain `#[test]`s and a
//! guard ([`Pod`]) can stop and remove its pod in `Drop`, when an assertion failed too.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
pub use k8s_cri::v1::LinuxContainerResources;
use k8s_cri::v1::{
    ContainerConfig, ContainerStatusRequest, CreateContainerRequest, ExecSyncRequest,
    ExecSyncResponse, LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, PodSandboxStatusRequest, RemoveContainerRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
    UpdateContainerResourcesRequest, VersionRequest, VersionResponse,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::containerd::{table_at_mut, Containerd, Setup, CRI_PLUGIN_V2};

/// The CRI API crate, for tests that build what the kubelet sends.
pub use k8s_cri;

/// The containerd namespace the CRI plugin keeps its images, sandboxes and containers in.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// The image the fixtures' CRI plugin runs as its sandbox (`sandbox_image`), made of busybox.
pub const PAUSE_IMAGE: &str = "gpuplex.test/pause:1";

/// An image of busybox whose command is `sh`, for the pods' containers.
pub const BUSYBOX_IMAGE: &str = "gpuplex.test/busybox:1";

/// How long one CRI call may take before the test gives up on it.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The applets the images' `/bin` links to busybox.
const APPLETS: [&str; 21] = [
    "sh", "ls", "cat", "sleep", "echo", "stat", "id", "env", "test", "true", "false", "wc", "grep",
    "head", "date", "printf", "touch", "mkdir", "expr", "seq", "tr",
];

/// The command of a pause image made of busybox: it waits, and exits at once on TERM or INT.
pub const PAUSE_COMMAND: [&str; 3] = [
    "sh",
    "-c",
    "trap \"exit 0\" TERM INT; while :; do sleep 3600 & wait; done",
];

/// The OCI architecture of this machine.
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// `sha256:<hex>` of `bytes`.
fn digest(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A tar header for an entry owned by root with `mode`.
fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

/// Appends a regular file to `tar`.
fn add_file(tar: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) {
    let mut h = header(tar::EntryType::Regular, mode, data.len() as u64);
    tar.append_data(&mut h, path, data)
        .unwrap_or_else(|e| panic!("adding {path} to a tarball: {e}"));
}

/// Appends a directory to `tar`.
fn add_dir(tar: &mut tar::Builder<Vec<u8>>, path: &str) {
    let mut h = header(tar::EntryType::Directory, 0o755, 0);
    tar.append_data(&mut h, path, std::io::empty())
        .unwrap_or_else(|e| panic!("adding {path}/ to a tarball: {e}"));
}

/// The image's one layer: busybox, its applets, passwd and group, and the usual directories.
fn busybox_layer() -> Vec<u8> {
    let busybox = std::fs::read("/bin/busybox")
        .expect("/bin/busybox is missing: apt-get install busybox-static");
    let mut tar = tar::Builder::new(Vec::new());
    for dir in ["bin", "dev", "etc", "proc", "run", "sys", "tmp"] {
        add_dir(&mut tar, dir);
    }
    add_file(&mut tar, "bin/busybox", 0o755, &busybox);
    for applet in APPLETS {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        tar.append_link(&mut h, format!("bin/{applet}"), "busybox")
            .unwrap_or_else(|e| panic!("adding bin/{applet} to a tarball: {e}"));
    }
    add_file(
        &mut tar,
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/:/bin/sh\n",
    );
    add_file(&mut tar, "etc/group", 0o644, b"root:x:0:\n");
    tar.into_inner().expect("the layer's tarball")
}

/// Writes an OCI image layout tarball (`oci-layout`, `index.json`, `blobs/sha256/`) of a
/// one-layer busybox image named `name` (a full reference: `gpuplex.test/pause:1`) whose
/// command is `command`, for `ctr images import`. The index names the image with containerd's
/// `io.containerd.image.name` annotation, which `ctr` takes as it is.
pub fn busybox_image_tarball(path: &Path, name: &str, command: &[&str]) {
    let layer = busybox_layer();
    let layer_digest = digest(&layer);
    let config = serde_json::to_vec(&json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": command, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "gpuplex's tests: /bin/busybox"}],
    }))
    .expect("the image config serializes");
    let config_digest = digest(&config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    }))
    .expect("the manifest serializes");
    let manifest_digest = digest(&manifest);
    let tag = name.rsplit_once(':').map_or("latest", |(_, tag)| tag);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": {"architecture": oci_architecture(), "os": "linux"},
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    }))
    .expect("the index serializes");

    let mut tar = tar::Builder::new(Vec::new());
    add_file(
        &mut tar,
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    );
    add_dir(&mut tar, "blobs");
    add_dir(&mut tar, "blobs/sha256");
    for blob in [&layer, &config, &manifest] {
        let hex = digest(blob).trim_start_matches("sha256:").to_owned();
        add_file(&mut tar, &format!("blobs/sha256/{hex}"), 0o644, blob);
    }
    add_file(&mut tar, "index.json", 0o644, &index);
    let bytes = tar.into_inner().expect("the image's tarball");
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// `ctr -n k8s.io images import --snapshotter native <tarball>` into `containerd`, unpacked for
/// the snapshotter the CRI plugin uses there (`native`); how long it took.
pub fn import(containerd: &Containerd, tarball: &Path) -> Duration {
    let started = Instant::now();
    let out = containerd
        .ctr_command_in(CRI_NAMESPACE)
        .args(["images", "import", "--snapshotter", "native"])
        .arg(tarball)
        .stdin(Stdio::null())
        .output()
        .expect("ctr runs");
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "ctr images import {}: {}",
        tarball.display(),
        crate::text(&out)
    );
    took
}

/// A containerd with its CRI plugin, whose gpuplex shim reaches the node service of
/// `gpuplex_config`, with [`PAUSE_IMAGE`] as its sandbox image and [`BUSYBOX_IMAGE`], both built
/// under `dir` and imported (how long each took is printed).
pub fn cri_containerd(dir: &Path, gpuplex_config: &Path) -> Containerd {
    cri_containerd_with(dir, gpuplex_config, |_| {})
}

/// [`cri_containerd`], with `edit` given the CRI plugin's table of the config to change
/// (`enable_cdi`, say) before containerd starts.
pub fn cri_containerd_with(
    dir: &Path,
    gpuplex_config: &Path,
    edit: impl FnOnce(&mut toml::Table),
) -> Containerd {
    cri_containerd_configured(dir, gpuplex_config, |config| {
        edit(table_at_mut(config, &["plugins", CRI_PLUGIN_V2]))
    })
}

/// [`cri_containerd`], with `edit` given the whole config (another plugin's table, NRI's say)
/// before containerd starts.
pub fn cri_containerd_configured(
    dir: &Path,
    gpuplex_config: &Path,
    edit: impl FnOnce(&mut toml::Table),
) -> Containerd {
    let (pause, busybox) = (dir.join("pause.tar"), dir.join("busybox.tar"));
    busybox_image_tarball(&pause, PAUSE_IMAGE, &PAUSE_COMMAND);
    busybox_image_tarball(&busybox, BUSYBOX_IMAGE, &["sh"]);
    let started = Instant::now();
    let containerd = Containerd::start_with(
        Setup {
            gpuplex_config: Some(gpuplex_config.to_path_buf()),
            cri: true,
        },
        |config| {
            let cri = table_at_mut(config, &["plugins", CRI_PLUGIN_V2]);
            cri.insert("sandbox_image".into(), PAUSE_IMAGE.into());
            edit(config);
        },
    );
    eprintln!(
        "containerd with the CRI plugin answered after {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    for tarball in [&pause, &busybox] {
        let took = import(&containerd, tarball);
        eprintln!(
            "ctr -n k8s.io images import {}: {:.0} ms",
            tarball
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            took.as_secs_f64() * 1e3
        );
    }
    containerd
}

/// A pod's sandbox config as the kubelet sends it for a pod with host network (no CNI needed;
/// its hostname must then be empty), named `name` in namespace `namespace`, with `annotations`.
pub fn host_network_pod(
    name: &str,
    namespace: &str,
    annotations: &[(&str, &str)],
) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.to_owned(),
            uid: format!("uid-{name}-{}", std::process::id()),
            namespace: namespace.to_owned(),
            attempt: 0,
        }),
        annotations: pairs(annotations),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(host_network()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A container's config as the kubelet sends it for a container of a host-network pod: `image`
/// running `command`, with `annotations`.
pub fn host_network_container(
    name: &str,
    image: &str,
    command: &[&str],
    annotations: &[(&str, &str)],
) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(k8s_cri::v1::ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(k8s_cri::v1::ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        }),
        command: command.iter().map(|s| s.to_string()).collect(),
        annotations: pairs(annotations),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(host_network()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The node's network namespace, the pod's PID and IPC namespaces (the kubelet's defaults).
fn host_network() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

fn pairs(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The kubelet's end of the CRI: the runtime service over containerd's unix socket.
pub struct Cri {
    runtime: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
    timings: Mutex<Vec<(String, Duration)>>,
}

impl Cri {
    /// Connects to containerd's gRPC socket `socket` (the endpoint's URI is a dummy; the
    /// connector opens the socket).
    pub fn connect(socket: &Path) -> Cri {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let path: PathBuf = socket.to_path_buf();
        let channel = runtime
            .block_on(
                Endpoint::try_from("http://[::]:50051")
                    .expect("a dummy endpoint")
                    .connect_timeout(Duration::from_secs(10))
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(path).await?,
                            ))
                        }
                    })),
            )
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
        Cri {
            runtime,
            client: RuntimeServiceClient::new(channel),
            timings: Mutex::new(Vec::new()),
        }
    }

    /// Runs one call to completion, at most [`CALL_TIMEOUT`], and records how long it took.
    fn call<T>(
        &self,
        name: &str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        let started = Instant::now();
        // The timer is made inside the runtime, whose time driver it needs.
        let result = self
            .runtime
            .block_on(async { tokio::time::timeout(CALL_TIMEOUT, call).await });
        let took = started.elapsed();
        eprintln!("CRI {name}: {:.1} ms", took.as_secs_f64() * 1e3);
        self.timings
            .lock()
            .expect("the timings")
            .push((name.to_owned(), took));
        match result {
            Ok(answer) => answer.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "{name} took more than {CALL_TIMEOUT:?}"
            ))),
        }
    }

    /// Every call so far and how long each took, in order.
    pub fn timings(&self) -> Vec<(String, Duration)> {
        self.timings.lock().expect("the timings").clone()
    }

    /// `Version`.
    pub fn version(&self) -> Result<VersionResponse, tonic::Status> {
        let mut client = self.client.clone();
        self.call("Version", async move {
            client
                .version(VersionRequest {
                    version: "v1".into(),
                })
                .await
        })
    }

    /// `RunPodSandbox` of `config` under `handler`: the pod, removed when the guard is dropped.
    pub fn run_pod_sandbox(
        &self,
        config: &PodSandboxConfig,
        handler: &str,
    ) -> Result<Pod<'_>, tonic::Status> {
        let mut client = self.client.clone();
        let request = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.to_owned(),
        };
        let id = self.call("RunPodSandbox", async move {
            client.run_pod_sandbox(request).await
        })?;
        Ok(Pod {
            cri: self,
            id: id.pod_sandbox_id,
            config: config.clone(),
            removed: false,
        })
    }

    /// `StartContainer`.
    pub fn start_container(&self, id: &str) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        let request = StartContainerRequest {
            container_id: id.to_owned(),
        };
        self.call("StartContainer", async move {
            client.start_container(request).await
        })
        .map(drop)
    }

    /// `StopContainer` of `id`, allowing it `grace` for its stop signal, then
    /// `RemoveContainer`, as the kubelet removes a container.
    pub fn remove_container(&self, id: &str, grace: Duration) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        let request = StopContainerRequest {
            container_id: id.to_owned(),
            timeout: grace.as_secs() as i64,
        };
        self.call("StopContainer", async move {
            client.stop_container(request).await
        })?;
        let mut client = self.client.clone();
        let request = RemoveContainerRequest {
            container_id: id.to_owned(),
        };
        self.call("RemoveContainer", async move {
            client.remove_container(request).await
        })
        .map(drop)
    }

    /// `UpdateContainerResources` of container `id` to `linux`.
    pub fn update_container_resources(
        &self,
        id: &str,
        linux: LinuxContainerResources,
    ) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        let request = UpdateContainerResourcesRequest {
            container_id: id.to_owned(),
            linux: Some(linux),
            ..Default::default()
        };
        self.call("UpdateContainerResources", async move {
            client.update_container_resources(request).await
        })
        .map(drop)
    }

    /// `ExecSync` of `command` in container `id`, bounded by `timeout` on containerd's side.
    pub fn exec_sync(
        &self,
        id: &str,
        command: &[&str],
        timeout: Duration,
    ) -> Result<ExecSyncResponse, tonic::Status> {
        let mut client = self.client.clone();
        let request = ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: command.iter().map(|s| s.to_string()).collect(),
            timeout: timeout.as_secs() as i64,
        };
        self.call("ExecSync", async move { client.exec_sync(request).await })
    }

    /// `ContainerStatus` with `verbose`: containerd's extra information (`info["info"]`, JSON
    /// with `pid`, `runtimeSpec`, ...), with the state's name added as `"state"`.
    pub fn container_info(&self, id: &str) -> Result<Value, tonic::Status> {
        let mut client = self.client.clone();
        let request = ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: true,
        };
        let answer = self.call("ContainerStatus", async move {
            client.container_status(request).await
        })?;
        let mut info = verbose_info(&answer.info);
        if let Some(status) = answer.status {
            let state = k8s_cri::v1::ContainerState::try_from(status.state)
                .map_or("?", |s| s.as_str_name());
            info["state"] = json!(state);
        }
        Ok(info)
    }

    /// `PodSandboxStatus` with `verbose`: containerd's extra information, as for containers.
    pub fn sandbox_info(&self, id: &str) -> Result<Value, tonic::Status> {
        let mut client = self.client.clone();
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: true,
        };
        let answer = self.call("PodSandboxStatus", async move {
            client.pod_sandbox_status(request).await
        })?;
        Ok(verbose_info(&answer.info))
    }

    fn stop_pod_sandbox(&self, id: &str) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        let request = StopPodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        };
        self.call("StopPodSandbox", async move {
            client.stop_pod_sandbox(request).await
        })
        .map(drop)
    }

    fn remove_pod_sandbox(&self, id: &str) -> Result<(), tonic::Status> {
        let mut client = self.client.clone();
        let request = RemovePodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        };
        self.call("RemovePodSandbox", async move {
            client.remove_pod_sandbox(request).await
        })
        .map(drop)
    }
}

/// `info["info"]` of a verbose status, parsed (`null` when absent or not JSON).
fn verbose_info(info: &HashMap<String, String>) -> Value {
    info.get("info")
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or(Value::Null)
}

/// A pod sandbox the kubelet ran: stopped and removed (its containers with it) when dropped,
/// unless [`Pod::remove`] did it already.
pub struct Pod<'a> {
    cri: &'a Cri,
    /// The sandbox's id.
    pub id: String,
    config: PodSandboxConfig,
    removed: bool,
}

impl Pod<'_> {
    /// `CreateContainer` of `config` in this pod: the container's id.
    pub fn create_container(&self, config: &ContainerConfig) -> Result<String, tonic::Status> {
        let mut client = self.cri.client.clone();
        let request = CreateContainerRequest {
            pod_sandbox_id: self.id.clone(),
            config: Some(config.clone()),
            sandbox_config: Some(self.config.clone()),
        };
        self.cri
            .call("CreateContainer", async move {
                client.create_container(request).await
            })
            .map(|answer| answer.container_id)
    }

    /// `StopPodSandbox` then `RemovePodSandbox`, as the kubelet removes a pod.
    pub fn remove(&mut self) -> Result<(), tonic::Status> {
        self.cri.stop_pod_sandbox(&self.id)?;
        self.cri.remove_pod_sandbox(&self.id)?;
        self.removed = true;
        Ok(())
    }
}

impl Drop for Pod<'_> {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.remove() {
                eprintln!("removing pod sandbox {}: {e}", self.id);
            }
        }
    }
}
