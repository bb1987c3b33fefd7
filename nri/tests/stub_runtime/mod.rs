//! The runtime's side of NRI, played by the tests over a real unix socket, with the plugin's
//! own framing and messages (`gpuplex_nri::{mux, ttrpc, proto}`, written from NRI's published
//! protocol): it listens where a runtime's NRI socket is, answers the plugin's registration and
//! calls the plugin's methods as containerd does.
#![allow(dead_code)]

use std::io::{BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuplex_nri::mux::{self, PLUGIN_SERVICE, RUNTIME_SERVICE};
use gpuplex_nri::proto::nri::{
    ConfigureRequest, ConfigureResponse, Container, ContainerAdjustment, ContainerState,
    CreateContainerRequest, CreateContainerResponse, Empty, Event, PodSandbox,
    RegisterPluginRequest, StateChangeEvent, SynchronizeRequest,
};
use gpuplex_nri::session::{PLUGIN, RUNTIME};
use gpuplex_nri::ttrpc::{self, Assembler, REQUEST, RESPONSE};
use prost::Message;

/// The request timeout the stub runtime tells the plugin (containerd's default is 2 s; more
/// here, so that a test of answering within it has a second of slack on a loaded machine).
pub const REQUEST_TIMEOUT_MS: i64 = 4000;

/// A runtime's NRI socket, listening.
pub struct StubRuntime {
    pub path: PathBuf,
    listener: UnixListener,
}

impl StubRuntime {
    /// Listens at `path`.
    pub fn listen(path: &Path) -> StubRuntime {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).unwrap();
        listener.set_nonblocking(true).unwrap();
        StubRuntime {
            path: path.to_path_buf(),
            listener,
        }
    }

    /// The next plugin that connects, within `within`.
    pub fn accept(&self, within: Duration) -> Option<Connection> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            match self.listener.accept() {
                Ok((trunk, _)) => {
                    trunk.set_nonblocking(false).unwrap();
                    trunk
                        .set_read_timeout(Some(Duration::from_secs(10)))
                        .unwrap();
                    return Some(Connection::new(trunk));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        None
    }

    /// The runtime going away: the socket closed and removed.
    pub fn stop(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One plugin's connection, from the runtime's side.
pub struct Connection {
    trunk: UnixStream,
    reader: BufReader<UnixStream>,
    /// The plugin's calls of the runtime (its registration).
    calls: Assembler,
    /// The plugin's answers.
    answers: Assembler,
    next_stream: u32,
}

impl Connection {
    fn new(trunk: UnixStream) -> Connection {
        Connection {
            reader: BufReader::new(trunk.try_clone().unwrap()),
            trunk,
            calls: Assembler::default(),
            answers: Assembler::default(),
            next_stream: 1,
        }
    }

    /// Reads the plugin's registration and accepts it, as containerd does.
    pub fn accept_registration(&mut self) -> RegisterPluginRequest {
        loop {
            let frame = mux::read_frame(&mut self.reader)
                .unwrap()
                .expect("the plugin closed the connection before registering");
            assert_eq!(frame.conn, RUNTIME_SERVICE, "a call before registration");
            if let Some(message) = self.calls.push(&frame.payload).unwrap().into_iter().next() {
                assert_eq!(message.kind, REQUEST);
                let call = ttrpc::decode_request(&message.body).unwrap();
                assert_eq!(
                    (call.service.as_str(), call.method.as_str()),
                    (RUNTIME, "RegisterPlugin")
                );
                let answer = ttrpc::response(message.stream, Ok(Empty {}.encode_to_vec()));
                mux::write(&mut self.trunk, RUNTIME_SERVICE, &answer).unwrap();
                return RegisterPluginRequest::decode(&call.payload[..]).unwrap();
            }
        }
    }

    /// Refuses the plugin's registration with `why`.
    pub fn refuse_registration(&mut self, why: &str) {
        loop {
            let frame = mux::read_frame(&mut self.reader).unwrap().unwrap();
            if let Some(message) = self.calls.push(&frame.payload).unwrap().into_iter().next() {
                let answer = ttrpc::response(message.stream, Err((3, why.to_owned())));
                mux::write(&mut self.trunk, RUNTIME_SERVICE, &answer).unwrap();
                return;
            }
        }
    }

    /// Calls the plugin's `method` with `request`: its answer's payload, or its status.
    pub fn call(&mut self, method: &str, request: &impl Message) -> Result<Vec<u8>, (i32, String)> {
        self.call_raw(PLUGIN, method, request.encode_to_vec())
    }

    /// The same with any service and payload bytes.
    pub fn call_raw(
        &mut self,
        service: &str,
        method: &str,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, (i32, String)> {
        let stream = self.next_stream;
        self.next_stream += 2;
        let bytes = ttrpc::request(stream, service, method, payload);
        mux::write(&mut self.trunk, PLUGIN_SERVICE, &bytes).unwrap();
        loop {
            let frame = mux::read_frame(&mut self.reader)
                .unwrap_or_else(|e| panic!("{method}: {e}"))
                .unwrap_or_else(|| panic!("{method}: the plugin closed the connection"));
            if frame.conn != PLUGIN_SERVICE {
                continue;
            }
            if let Some(message) = self
                .answers
                .push(&frame.payload)
                .unwrap()
                .into_iter()
                .next()
            {
                assert_eq!(message.kind, RESPONSE);
                assert_eq!(message.stream, stream, "an answer to another call");
                return ttrpc::decode_response(&message.body).unwrap();
            }
        }
    }

    /// `Configure`: the events the plugin subscribes to.
    pub fn configure(&mut self) -> i32 {
        let request = ConfigureRequest {
            runtime_name: "stub-runtime".into(),
            runtime_version: "1.7".into(),
            registration_timeout: 5000,
            request_timeout: REQUEST_TIMEOUT_MS,
            ..Default::default()
        };
        let answer = self.call("Configure", &request).unwrap();
        ConfigureResponse::decode(&answer[..]).unwrap().events
    }

    /// `Synchronize` with these pods and containers.
    pub fn synchronize(&mut self, pods: Vec<PodSandbox>, containers: Vec<Container>) {
        let request = SynchronizeRequest {
            pods,
            containers,
            more: false,
        };
        self.call("Synchronize", &request).unwrap();
    }

    /// Registration, `Configure` and an empty `Synchronize`: a plugin ready for events.
    pub fn ready(&mut self) -> RegisterPluginRequest {
        let registration = self.accept_registration();
        self.configure();
        self.synchronize(Vec::new(), Vec::new());
        registration
    }

    /// `CreateContainer`: the adjustment, or the plugin's refusal.
    pub fn create(
        &mut self,
        pod: &PodSandbox,
        container: &Container,
    ) -> Result<ContainerAdjustment, (i32, String)> {
        let request = CreateContainerRequest {
            pod: Some(pod.clone()),
            container: Some(container.clone()),
        };
        let answer = self.call("CreateContainer", &request)?;
        let answer = CreateContainerResponse::decode(&answer[..]).unwrap();
        Ok(answer.adjust.unwrap_or_default())
    }

    /// An event as containerd 1.7 (NRI 0.8) sends it: `StateChange`.
    pub fn state_change(
        &mut self,
        event: Event,
        pod: &PodSandbox,
        container: &Container,
    ) -> Result<(), (i32, String)> {
        let request = StateChangeEvent {
            event: event as i32,
            pod: Some(pod.clone()),
            container: Some(container.clone()),
        };
        self.call("StateChange", &request).map(|_| ())
    }

    /// Bytes written to the socket as they are.
    pub fn write_raw(&mut self, bytes: &[u8]) {
        self.trunk.write_all(bytes).unwrap();
    }

    /// Whether the plugin closed the connection within `within`.
    pub fn closed_within(&mut self, within: Duration) -> bool {
        self.trunk.set_read_timeout(Some(within)).unwrap();
        loop {
            match mux::read_frame(&mut self.reader) {
                Ok(None) => return true,
                Ok(Some(_)) => continue,
                Err(gpuplex_nri::mux::MuxError::Io(e))
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    return false
                }
                Err(_) => return true,
            }
        }
    }
}

/// A container of `pod` as NRI describes it, with `annotations`.
pub fn container(id: &str, pod: &PodSandbox, state: ContainerState) -> Container {
    let mut c = Container {
        id: id.into(),
        pod_sandbox_id: pod.id.clone(),
        name: id.into(),
        ..Default::default()
    };
    c.set_state(state);
    c
}

/// A pod with `annotations`, in namespace `ml`.
pub fn pod(id: &str, annotations: &[(&str, &str)]) -> PodSandbox {
    PodSandbox {
        id: id.into(),
        name: id.into(),
        uid: format!("uid-{id}"),
        namespace: "ml".into(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}
