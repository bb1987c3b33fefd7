//! One connection to the runtime's NRI socket, from registration to its end.
//!
//! The plugin registers first (a call of the runtime's `RegisterPlugin`, on
//! [`RUNTIME_SERVICE`]); the runtime then calls the plugin's `Configure`, `Synchronize` and,
//! from then on, the events it subscribed to, on [`PLUGIN_SERVICE`]. Each call is answered by
//! the [`Handler`] on the thread that reads the socket, one at a time, in the order they came:
//! so the handler never calls the runtime itself (nothing would read the answer).
//!
//! The session ends when the runtime closes the connection (it stopped or restarted, or it
//! gave up on the plugin), after `Shutdown`, or when the runtime's bytes break the protocol.
//! The caller connects again ([`crate::plugin`]'s loop).

use std::io;
use std::os::unix::net::UnixStream;

use prost::Message as _;

use crate::mux::{self, MuxError, PLUGIN_SERVICE, RUNTIME_SERVICE};
use crate::proto::nri::RegisterPluginRequest;
use crate::ttrpc::{self, Assembler, TtrpcError, REQUEST, RESPONSE, UNIMPLEMENTED};

/// The service plugins serve.
pub const PLUGIN: &str = "nri.pkg.api.v1alpha1.Plugin";
/// The service runtimes serve.
pub const RUNTIME: &str = "nri.pkg.api.v1alpha1.Runtime";
/// The NRI version gpuplex's plugin says it speaks.
pub const NRI_VERSION: &str = "v0.8.0";
/// The stream of the registration call.
const REGISTRATION: u32 = 1;

/// What answers the runtime's calls of the plugin's service.
pub trait Handler {
    /// Answers `method` called with `payload`: the answer's payload, or a gRPC status code and
    /// a one-line message.
    fn call(&mut self, method: &str, payload: &[u8]) -> Result<Vec<u8>, (i32, String)>;
}

/// How the plugin introduces itself.
#[derive(Clone, Debug)]
pub struct Registration {
    /// Its name.
    pub name: String,
    /// Its index among the runtime's plugins: two digits, lower first.
    pub index: String,
}

/// How a session ended, when it did not fail.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// The runtime closed the connection.
    Closed,
    /// The runtime called `Shutdown`.
    Shutdown,
}

/// Why a session failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Reading the socket failed, or its frames break NRI's framing.
    #[error(transparent)]
    Mux(#[from] MuxError),
    /// A connection's bytes break ttrpc.
    #[error("the runtime's NRI socket: {0}")]
    Ttrpc(#[from] TtrpcError),
    /// The runtime refused the registration.
    #[error("the runtime refused to register the plugin: {0}")]
    Refused(String),
    /// Writing to the socket failed.
    #[error("writing to the runtime's NRI socket: {0}")]
    Write(#[source] io::Error),
}

/// Runs one session on `trunk`, a connected NRI socket: registers as `registration`, answers
/// the runtime's calls with `handler`, and returns when the session ends. `registered` is
/// called once the runtime accepted the registration.
pub fn run(
    trunk: UnixStream,
    registration: &Registration,
    handler: &mut impl Handler,
    mut registered: impl FnMut(),
) -> Result<SessionEnd, SessionError> {
    let mut writer = trunk.try_clone().map_err(SessionError::Write)?;
    let mut reader = io::BufReader::new(trunk);
    let register = RegisterPluginRequest {
        plugin_name: registration.name.clone(),
        plugin_idx: registration.index.clone(),
        nri_version: NRI_VERSION.to_owned(),
    };
    let call = ttrpc::request(
        REGISTRATION,
        RUNTIME,
        "RegisterPlugin",
        register.encode_to_vec(),
    );
    mux::write(&mut writer, RUNTIME_SERVICE, &call).map_err(SessionError::Write)?;

    let mut calls = Assembler::default();
    let mut answers = Assembler::default();
    while let Some(frame) = mux::read_frame(&mut reader)? {
        match frame.conn {
            PLUGIN_SERVICE => {
                for message in calls.push(&frame.payload)? {
                    if message.kind != REQUEST {
                        continue;
                    }
                    let request = ttrpc::decode_request(&message.body)?;
                    let answer = if request.service == PLUGIN {
                        handler.call(&request.method, &request.payload)
                    } else {
                        Err((
                            UNIMPLEMENTED,
                            format!("service {} is not served here", request.service),
                        ))
                    };
                    let bytes = ttrpc::response(message.stream, answer);
                    mux::write(&mut writer, PLUGIN_SERVICE, &bytes).map_err(SessionError::Write)?;
                    if request.service == PLUGIN && request.method == "Shutdown" {
                        return Ok(SessionEnd::Shutdown);
                    }
                }
            }
            RUNTIME_SERVICE => {
                for message in answers.push(&frame.payload)? {
                    if message.kind != RESPONSE || message.stream != REGISTRATION {
                        continue;
                    }
                    match ttrpc::decode_response(&message.body)? {
                        Ok(_) => registered(),
                        Err((_, why)) => return Err(SessionError::Refused(why)),
                    }
                }
            }
            // Frames of other connections are dropped, as NRI's own multiplexer drops them.
            _ => {}
        }
    }
    Ok(SessionEnd::Closed)
}
