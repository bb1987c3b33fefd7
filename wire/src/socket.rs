//! [`NodeClient`]: one connection to the node service's socket.
//!
//! A request is one JSON object on one line, the core's [`Request`] as the service reads it
//! ([`Request::to_line`]); the service answers each with one line (see
//! [`crate::protocol`]). The client is blocking, with a timeout on every read and
//! write, so that a stuck service makes the hook or `gpuplexctl` fail with a message instead of
//! hanging.
//!
//! A process that asks many things at once shares a few connections through a
//! [`pool::NodePool`].
//!
//! [`NodeClient::request`] returns only replies with `"ok":true`: a refusal comes back as
//! [`ClientError::Refused`] carrying the service's own line.
//!
//! [`NodeClient::watch`] turns the connection into a subscription ([`CapacityWatch`]): the first
//! view within the timeout, then each change as it comes, waited for without a timeout (there
//! may be none for days); a service that dies closes the connection, and the wait ends with
//! [`ClientError::Closed`].

pub mod pool;

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::protocol::{CapacityView, EventsReply, Reply, Request, VgpuReply};
use gpuplex_scheduler::node::{Attachment, NodeStatus, Placement, ReleaseKey, Target};
use gpuplex_scheduler::units::UnitId;
use gpuplex_scheduler::windows::StopSignal;
use gpuplex_scheduler::Handle;

/// Where the node service listens unless `service.socket` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/gpuplex/gpuplex.sock";

/// How long one read or write on the socket may take.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// The longest reply line read, in bytes. Larger than the request limit
/// ([`crate::protocol::MAX_LINE`]): a busy node's status is long.
pub const MAX_REPLY: usize = 16 << 20;

/// What can go wrong talking to the node service. Every message is one line and says what to
/// check.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be connected to.
    #[error(
        "cannot reach the gpuplex node service at {}: {source}; is `containerd-shim-gpuplex-v1 serve` running (systemctl status gpuplex)?",
        path.display()
    )]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A read or write failed on an open connection.
    #[error(
        "lost the connection to the gpuplex node service at {}: {source}; check its log (journalctl -u gpuplex)",
        path.display()
    )]
    Io {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The request could not be sent at all: the service had let the connection go (it closes
    /// one idle for a minute, or one it made room with), so nothing of it was carried out and
    /// it may be sent again on a new connection.
    #[error(
        "the gpuplex node service at {} had closed the connection; the request was not sent: {source}",
        path.display()
    )]
    NotSent {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The service did not answer in time.
    #[error(
        "the gpuplex node service at {} did not answer within {}s; check its log (journalctl -u gpuplex)",
        path.display(),
        after.as_secs()
    )]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// How long the client waited.
        after: Duration,
    },
    /// The service closed the connection before replying (or before the request was sent).
    #[error(
        "the gpuplex node service at {} closed the connection without replying; check its log (journalctl -u gpuplex)",
        path.display()
    )]
    Closed {
        /// The socket.
        path: PathBuf,
    },
    /// The reply was not a reply line.
    #[error(
        "the gpuplex node service at {} sent a reply this program cannot read ({message}); are it and the service the same gpuplex version?",
        path.display()
    )]
    Malformed {
        /// The socket.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The service refused the request; its reason, as it wrote it.
    #[error("{0}")]
    Refused(String),
}

/// A connection to the node service.
#[derive(Debug)]
pub struct NodeClient {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl NodeClient {
    /// Connects to the service's socket, with [`TIMEOUT`] on reads and writes.
    pub fn connect(socket: &Path) -> Result<NodeClient, ClientError> {
        NodeClient::connect_with_timeout(socket, TIMEOUT)
    }

    /// Connects to the service's socket, with `timeout` on reads and writes.
    pub fn connect_with_timeout(
        socket: &Path,
        timeout: Duration,
    ) -> Result<NodeClient, ClientError> {
        let connect_error = |source| ClientError::Connect {
            path: socket.to_path_buf(),
            source,
        };
        let stream = UnixStream::connect(socket).map_err(connect_error)?;
        let timeout = Some(timeout.max(Duration::from_millis(1)));
        stream.set_read_timeout(timeout).map_err(connect_error)?;
        stream.set_write_timeout(timeout).map_err(connect_error)?;
        let writer = stream.try_clone().map_err(connect_error)?;
        Ok(NodeClient {
            path: socket.to_path_buf(),
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// The socket this client is connected to.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Sends one request and reads its reply. A reply with `"ok":false` is
    /// [`ClientError::Refused`].
    pub fn request(&mut self, request: &Request) -> Result<Reply, ClientError> {
        self.send(request.to_line().as_bytes())?;
        let reply = self.read_line()?;
        let reply: Reply = serde_json::from_slice(&reply).map_err(|e| ClientError::Malformed {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        match reply {
            Reply::Refused(why) => Err(ClientError::Refused(why)),
            reply => Ok(reply),
        }
    }

    /// [`NodeClient::request`] answered with a vGPU.
    fn vgpu(&mut self, request: &Request) -> Result<VgpuReply, ClientError> {
        match self.request(request)? {
            Reply::Vgpu(vgpu) => Ok(*vgpu),
            _ => Err(self.missing("vgpu")),
        }
    }

    /// [`NodeClient::request`] answered with a vGPU, or with nothing.
    fn maybe_vgpu(&mut self, request: &Request) -> Result<Option<VgpuReply>, ClientError> {
        match self.request(request)? {
            Reply::Vgpu(vgpu) => Ok(Some(*vgpu)),
            Reply::Done => Ok(None),
            _ => Err(self.missing("vgpu")),
        }
    }

    /// The node's status.
    pub fn status(&mut self) -> Result<NodeStatus, ClientError> {
        match self.request(&Request::Status)? {
            Reply::Status(status) => Ok(*status),
            _ => Err(self.missing("status")),
        }
    }

    /// Reserves a vGPU for a container that does not exist yet; the reply has its handle.
    pub fn reserve(
        &mut self,
        annotations: &BTreeMap<String, String>,
    ) -> Result<VgpuReply, ClientError> {
        self.vgpu(&Request::Reserve {
            annotations: annotations.clone(),
        })
    }

    /// Pins a vGPU for ResourceClaim `claim` (its uid) where kube-scheduler placed it; the
    /// reply has its handle and CDI edits, the same for the same claim pinned again.
    pub fn pin(
        &mut self,
        claim: &str,
        placement: &Placement,
        annotations: &BTreeMap<String, String>,
    ) -> Result<VgpuReply, ClientError> {
        self.vgpu(&Request::Pin {
            claim: claim.to_owned(),
            placement: placement.clone(),
            annotations: annotations.clone(),
        })
    }

    /// Attaches container `id`, whose init is `pid`, to the reservation made with `handle`;
    /// `unstarted`: its init has not started the container's program yet (a hook at
    /// `createRuntime`, the shim after `runc create`).
    pub fn attach(
        &mut self,
        handle: &Handle,
        id: &str,
        pid: u32,
        unstarted: bool,
    ) -> Result<VgpuReply, ClientError> {
        self.attach_asking(handle, id, pid, unstarted, &BTreeMap::new())
    }

    /// [`NodeClient::attach`] for a container of the device plugin's allocation, with the
    /// weight, priority and pod it asks for its vGPU (`asked`: its `gpuplex.io/weight`,
    /// `gpuplex.io/priority` and pod name and namespace annotations).
    pub fn attach_asking(
        &mut self,
        handle: &Handle,
        id: &str,
        pid: u32,
        unstarted: bool,
        asked: &BTreeMap<String, String>,
    ) -> Result<VgpuReply, ClientError> {
        self.vgpu(&Request::Attach {
            handle: *handle,
            attachment: Attachment {
                container: id.to_owned(),
                target: Target::Pid(pid),
            },
            unstarted,
            asked: asked.clone(),
        })
    }

    /// The changes of the GPUs' window holders numbered above `since` (0: every one kept).
    pub fn events(&mut self, since: u64) -> Result<EventsReply, ClientError> {
        match self.request(&Request::Events { since })? {
            Reply::Events(events) => Ok(events),
            _ => Err(self.missing("events")),
        }
    }

    /// Subscribes to the node's capacity (`watch`): the connection carries only views from
    /// now on. The first comes within the client's timeout (a refusal, such as too many
    /// watchers, is [`ClientError::Refused`]); the later ones are waited for without one.
    pub fn watch(mut self) -> Result<CapacityWatch, ClientError> {
        let first = match self.request(&Request::Watch)? {
            Reply::Capacity(view) => *view,
            _ => return Err(self.missing("capacity")),
        };
        (self.reader.get_ref())
            .set_read_timeout(None)
            .map_err(|e| self.io_error(e))?;
        Ok(CapacityWatch {
            client: self,
            first: Some(first),
            ended: false,
        })
    }

    /// Pins the vGPU of the device plugin's `units` (each `unit` bytes) that the kubelet gave
    /// one container; the reply has its handle and CDI edits, the same for the same units again.
    pub fn allocate(&mut self, units: &[UnitId], unit: u64) -> Result<VgpuReply, ClientError> {
        self.vgpu(&Request::Allocate {
            units: units.to_vec(),
            unit,
        })
    }

    /// Reserves a vGPU for the container `id` and attaches it at once (`unstarted` as for
    /// [`NodeClient::attach`]). The reply has a handle only when this call reserved the vGPU.
    pub fn register(
        &mut self,
        id: &str,
        target: &Target,
        annotations: &BTreeMap<String, String>,
        unstarted: bool,
    ) -> Result<VgpuReply, ClientError> {
        self.vgpu(&Request::Register {
            annotations: annotations.clone(),
            attachment: Attachment {
                container: id.to_owned(),
                target: target.clone(),
            },
            unstarted,
        })
    }

    /// Releases the vGPU `key` names. `None` when there is none.
    pub fn release(&mut self, key: &ReleaseKey) -> Result<Option<VgpuReply>, ClientError> {
        self.maybe_vgpu(&Request::Release(key.clone()))
    }

    /// Holds a container its user paused (`held`), or lets it go once its user resumed it
    /// (`unhold`): while held, the node service neither freezes nor thaws it. An unknown
    /// container is [`ClientError::Refused`].
    pub fn hold(&mut self, key: &ReleaseKey, held: bool) -> Result<Option<VgpuReply>, ClientError> {
        let request = Request::Hold {
            key: key.clone(),
            held,
        };
        self.maybe_vgpu(&request)
    }

    /// Says that the container of `key` is being sent a stop `signal`: the service thaws it
    /// and keeps it out of windows while it stops.
    pub fn stopping(
        &mut self,
        key: &ReleaseKey,
        signal: StopSignal,
    ) -> Result<Option<VgpuReply>, ClientError> {
        let request = Request::Stopping {
            key: key.clone(),
            signal,
        };
        self.maybe_vgpu(&request)
    }

    /// Writes `line`. A first write refused because the service closed its end
    /// ([`ClientError::NotSent`]) delivered nothing: the service reads every byte sent before it
    /// lets a connection go, and none after.
    fn send(&mut self, line: &[u8]) -> Result<(), ClientError> {
        let mut sent = 0;
        while sent < line.len() {
            match self.writer.write(&line[sent..]) {
                Ok(0) => return Err(self.io_error(io::ErrorKind::WriteZero.into())),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if sent == 0
                        && matches!(
                            e.kind(),
                            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                        ) =>
                {
                    return Err(ClientError::NotSent {
                        path: self.path.clone(),
                        source: e,
                    })
                }
                Err(e) => return Err(self.io_error(e)),
            }
        }
        Ok(())
    }

    fn read_line(&mut self) -> Result<Vec<u8>, ClientError> {
        let mut line = Vec::new();
        let limit = MAX_REPLY as u64 + 1;
        let read = (&mut self.reader)
            .take(limit)
            .read_until(b'\n', &mut line)
            .map_err(|e| self.io_error(e))?;
        if read == 0 {
            return Err(ClientError::Closed {
                path: self.path.clone(),
            });
        }
        if line.last() != Some(&b'\n') {
            let message = if line.len() > MAX_REPLY {
                format!("a reply line over {MAX_REPLY} bytes")
            } else {
                "the connection closed in the middle of a reply".into()
            };
            return Err(ClientError::Malformed {
                path: self.path.clone(),
                message,
            });
        }
        line.pop();
        Ok(line)
    }

    fn io_error(&self, source: io::Error) -> ClientError {
        let path = self.path.clone();
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout {
                path,
                after: self.writer.read_timeout().ok().flatten().unwrap_or(TIMEOUT),
            },
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                ClientError::Closed { path }
            }
            _ => ClientError::Io { path, source },
        }
    }

    fn missing(&self, field: &str) -> ClientError {
        ClientError::Malformed {
            path: self.path.clone(),
            message: format!("no `{field}` in its reply"),
        }
    }
}

/// A subscription to the node's capacity ([`NodeClient::watch`]): each view as it comes, the
/// first at once. As an iterator it ends after the first error.
#[derive(Debug)]
pub struct CapacityWatch {
    client: NodeClient,
    /// The answer to `watch`, not yet taken.
    first: Option<CapacityView>,
    /// An error was returned: the connection is of no more use.
    ended: bool,
}

impl CapacityWatch {
    /// The next view: the first at once, then the next change, however long it takes.
    /// [`ClientError::Closed`] when the service closed the connection (it stopped, or it
    /// let this watcher go); a refusal line (the service stopping) is [`ClientError::Refused`].
    pub fn next_view(&mut self) -> Result<CapacityView, ClientError> {
        if let Some(first) = self.first.take() {
            return Ok(first);
        }
        let line = self.client.read_line()?;
        let reply: Reply = serde_json::from_slice(&line).map_err(|e| ClientError::Malformed {
            path: self.client.path.clone(),
            message: e.to_string(),
        })?;
        match reply {
            Reply::Capacity(view) => Ok(*view),
            Reply::Refused(why) => Err(ClientError::Refused(why)),
            _ => Err(self.client.missing("capacity")),
        }
    }

    /// The socket watched.
    pub fn socket(&self) -> &Path {
        self.client.socket()
    }
}

impl Iterator for CapacityWatch {
    type Item = Result<CapacityView, ClientError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        let next = self.next_view();
        self.ended = next.is_err();
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_request;
    use std::os::unix::net::UnixListener;
    use std::thread;

    /// A service that answers each request line on one connection with the next of `replies`.
    fn serve(replies: Vec<&'static str>) -> (tempfile::TempDir, PathBuf, thread::JoinHandle<()>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut writer = stream;
            for reply in replies {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 {
                    return;
                }
                writer.write_all(reply.as_bytes()).unwrap();
            }
        });
        (dir, path, handle)
    }

    #[test]
    fn connect_error_says_where_and_what_to_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");
        let message = NodeClient::connect(&path).unwrap_err().to_string();
        assert!(message.starts_with(&format!(
            "cannot reach the gpuplex node service at {}: ",
            path.display()
        )));
        assert!(message.contains("systemctl status gpuplex"), "{message}");
        assert!(!message.contains('\n'));
    }

    #[test]
    fn refusal_carries_the_service_line() {
        let (_dir, path, handle) = serve(vec![
            "{\"ok\":false,\"error\":\"no GPU has 80Gi free\"}\n",
            "{\"ok\":true}\n",
            "{\"ok\":true,\"status\":{\"gpus\":[],\"containers\":[],\"reservations\":[]}}\n",
        ]);
        let mut client = NodeClient::connect(&path).unwrap();
        let err = client
            .register("c1", &Target::Pid(7), &BTreeMap::new(), true)
            .unwrap_err();
        assert_eq!(err.to_string(), "no GPU has 80Gi free");
        assert_eq!(
            client.release(&ReleaseKey::Container("c1".into())).unwrap(),
            None
        );
        assert_eq!(client.status().unwrap(), NodeStatus::default());
        handle.join().unwrap();
    }

    #[test]
    fn closed_and_garbage_replies_are_errors() {
        let (_dir, path, handle) = serve(vec!["not json\n"]);
        let mut client = NodeClient::connect(&path).unwrap();
        assert!(matches!(
            client.status(),
            Err(ClientError::Malformed { .. })
        ));
        handle.join().unwrap();
        // The service is gone: the next request is not even sent.
        let err = client.status().unwrap_err();
        assert!(matches!(err, ClientError::NotSent { .. }), "{err:?}");
        assert!(
            err.to_string().contains("the request was not sent"),
            "{err}"
        );
    }

    #[test]
    fn a_silent_service_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let mut client =
            NodeClient::connect_with_timeout(&path, Duration::from_millis(20)).unwrap();
        let err = client.status().unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    }

    #[test]
    fn each_method_sends_the_request_the_service_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let received = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut writer = stream;
            let mut requests = Vec::new();
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap() > 0 {
                requests.push(parse_request(line.trim_end().as_bytes()).unwrap());
                line.clear();
                writer
                    .write_all(b"{\"ok\":false,\"error\":\"no\"}\n")
                    .unwrap();
            }
            requests
        });
        let annotations = BTreeMap::from([("gpuplex.io/gpus".to_string(), "1".to_string())]);
        let handle = Handle::from_bytes([7; 16]);
        let attachment = |target| Attachment {
            container: "c1".into(),
            target,
        };
        let cgroup = Target::Cgroup("/sys/fs/cgroup/x".into());
        let vgpu = ReleaseKey::Vgpu(gpuplex_scheduler::VgpuId(3));
        let mut client = NodeClient::connect(&path).unwrap();
        assert!(client.status().is_err());
        assert!(client.reserve(&annotations).is_err());
        assert!(client.attach(&handle, "c1", 42, true).is_err());
        assert!(client.register("c1", &cgroup, &annotations, false).is_err());
        assert!(client.release(&vgpu).is_err());
        assert!(client.hold(&vgpu, true).is_err());
        assert!(client.hold(&vgpu, false).is_err());
        assert!(client.stopping(&vgpu, StopSignal::Kill).is_err());
        assert!(client.watch().is_err());
        let expected = vec![
            Request::Status,
            Request::Reserve {
                annotations: annotations.clone(),
            },
            Request::Attach {
                handle,
                attachment: attachment(Target::Pid(42)),
                unstarted: true,
                asked: BTreeMap::new(),
            },
            Request::Register {
                annotations,
                attachment: attachment(cgroup),
                unstarted: false,
            },
            Request::Release(vgpu.clone()),
            Request::Hold {
                key: vgpu.clone(),
                held: true,
            },
            Request::Hold {
                key: vgpu.clone(),
                held: false,
            },
            Request::Stopping {
                key: vgpu,
                signal: StopSignal::Kill,
            },
            Request::Watch,
        ];
        assert_eq!(received.join().unwrap(), expected);
    }

    #[test]
    fn hold_returns_the_vgpu_and_a_refusal_is_an_error() {
        let (_dir, path, handle) = serve(vec![
            "{\"ok\":true,\"vgpu\":{\"id\":\"vgpu-3\",\"container\":\"c1\",\"gpus\":[],\"weight\":1,\"priority\":\"normal\"}}\n",
            "{\"ok\":false,\"error\":\"container c9 is not attached to a vGPU on this node\"}\n",
        ]);
        let mut client = NodeClient::connect(&path).unwrap();
        let held = client
            .hold(&ReleaseKey::Container("c1".into()), true)
            .unwrap()
            .unwrap();
        assert_eq!(
            (held.id, held.container.as_deref()),
            (gpuplex_scheduler::VgpuId(3), Some("c1"))
        );
        let err = client
            .hold(&ReleaseKey::Container("c9".into()), false)
            .unwrap_err();
        assert!(matches!(err, ClientError::Refused(_)), "{err:?}");
        handle.join().unwrap();
    }

    /// A view line for GPU 0 with `unreserved` bytes free.
    fn view_line(unreserved: u64) -> String {
        format!(
            "{{\"ok\":true,\"capacity\":{{\"gpus\":[{{\"index\":0,\"uuid\":\"GPU-a\",\"model\":\"m\",\"memory\":16,\"capacity\":16,\"unreserved\":{unreserved},\"healthy\":true}}],\"claims\":[]}}}}\n"
        )
    }

    #[test]
    fn a_watch_yields_each_view_waits_past_the_timeout_and_ends_when_the_service_goes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let service = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut writer = stream;
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            assert_eq!(
                parse_request(line.trim_end().as_bytes()),
                Ok(Request::Watch)
            );
            writer.write_all(view_line(16).as_bytes()).unwrap();
            // Longer than the client's timeout: a watch waits for changes without one.
            thread::sleep(Duration::from_millis(150));
            writer.write_all(view_line(8).as_bytes()).unwrap();
            // The service goes: the connection closes.
        });
        let client = NodeClient::connect_with_timeout(&path, Duration::from_millis(50)).unwrap();
        let mut watch = client.watch().unwrap();
        let unreserved = |view: CapacityView| view.gpus[0].unreserved;
        assert_eq!(watch.next().unwrap().map(unreserved).unwrap(), 16);
        assert_eq!(watch.next().unwrap().map(unreserved).unwrap(), 8);
        let lost = watch.next().unwrap().unwrap_err();
        assert!(matches!(lost, ClientError::Closed { .. }), "{lost:?}");
        assert!(watch.next().is_none(), "it ends after an error");
        service.join().unwrap();
    }

    #[test]
    fn a_refused_watch_and_a_wrong_answer_are_errors() {
        let (_dir, path, handle) = serve(vec![
            "{\"ok\":false,\"error\":\"16 connections watch the node already\"}\n",
        ]);
        let err = NodeClient::connect(&path).unwrap().watch().unwrap_err();
        assert_eq!(err.to_string(), "16 connections watch the node already");
        handle.join().unwrap();
        let (_dir, path, handle) = serve(vec!["{\"ok\":true}\n"]);
        let err = NodeClient::connect(&path).unwrap().watch().unwrap_err();
        assert!(
            err.to_string().contains("no `capacity` in its reply"),
            "{err}"
        );
        handle.join().unwrap();
    }
}
