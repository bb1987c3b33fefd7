//! ttrpc's messages on one of the connections of [`crate::mux`]: a 10-byte header (the body's
//! length and the stream id, each a big-endian `u32`, then the message type and its flags),
//! then the body, a protobuf `Request` or `Response` ([`crate::proto::ttrpc`]). A client numbers
//! its calls with odd stream ids; the answer comes back on the call's stream.
//!
//! Why not the `ttrpc` crate: its clients and servers own a socket's file descriptor each,
//! and NRI carries two ttrpc connections over one socket.

use prost::Message as _;

use crate::proto::ttrpc::{Request, Response, Status};

/// A message's header.
pub const HEADER: usize = 10;
/// The longest body ttrpc allows.
pub const MAX_MESSAGE: usize = 4 << 20;
/// The type of a call.
pub const REQUEST: u8 = 1;
/// The type of an answer.
pub const RESPONSE: u8 = 2;

/// gRPC's status code for a method the server does not have.
pub const UNIMPLEMENTED: i32 = 12;
/// gRPC's status code for a request the server refuses as it is.
pub const INVALID_ARGUMENT: i32 = 3;
/// gRPC's status code for a failure that fits no other.
pub const UNKNOWN: i32 = 2;

/// One message: its stream, its type and its body.
#[derive(Debug, PartialEq, Eq)]
pub struct Message {
    /// The call it belongs to.
    pub stream: u32,
    /// [`REQUEST`], [`RESPONSE`] or another type (streams' data, which NRI does not use).
    pub kind: u8,
    /// The protobuf body.
    pub body: Vec<u8>,
}

/// A connection's bytes that break the protocol.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TtrpcError {
    /// A body longer than ttrpc allows.
    #[error("a ttrpc message of {0} bytes, more than ttrpc's {MAX_MESSAGE}")]
    Oversized(usize),
    /// A body that is not the protobuf message its type says.
    #[error("a ttrpc {what} that does not decode: {reason}")]
    Undecodable {
        /// `request` or `response`.
        what: &'static str,
        /// prost's reason.
        reason: String,
    },
}

/// A connection's byte stream cut into messages: bytes go in as frames bring them, whole
/// messages come out.
#[derive(Debug, Default)]
pub struct Assembler {
    buf: Vec<u8>,
}

impl Assembler {
    /// Adds `bytes` and returns the messages now complete, in order. A header announcing a body
    /// longer than [`MAX_MESSAGE`] is an error at once, before the body is waited for.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Message>, TtrpcError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            if self.buf.len() < HEADER {
                return Ok(out);
            }
            let len =
                u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
            if len > MAX_MESSAGE {
                return Err(TtrpcError::Oversized(len));
            }
            if self.buf.len() < HEADER + len {
                return Ok(out);
            }
            let stream = u32::from_be_bytes([self.buf[4], self.buf[5], self.buf[6], self.buf[7]]);
            let kind = self.buf[8];
            let body = self.buf[HEADER..HEADER + len].to_vec();
            self.buf.drain(..HEADER + len);
            out.push(Message { stream, kind, body });
        }
    }
}

/// A message's bytes: header and body.
pub fn encode(stream: u32, kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&stream.to_be_bytes());
    out.push(kind);
    out.push(0);
    out.extend_from_slice(body);
    out
}

/// A call of `method` of `service` with `payload`, on `stream`, as bytes.
pub fn request(stream: u32, service: &str, method: &str, payload: Vec<u8>) -> Vec<u8> {
    let body = Request {
        service: service.to_owned(),
        method: method.to_owned(),
        payload,
        ..Default::default()
    };
    encode(stream, REQUEST, &body.encode_to_vec())
}

/// The answer on `stream`: `Ok` with its payload, or a status code and its one-line message.
pub fn response(stream: u32, result: Result<Vec<u8>, (i32, String)>) -> Vec<u8> {
    let body = match result {
        Ok(payload) => Response {
            status: Some(Status {
                code: 0,
                message: String::new(),
            }),
            payload,
        },
        Err((code, message)) => Response {
            status: Some(Status { code, message }),
            payload: Vec::new(),
        },
    };
    encode(stream, RESPONSE, &body.encode_to_vec())
}

/// A call's body.
pub fn decode_request(body: &[u8]) -> Result<Request, TtrpcError> {
    Request::decode(body).map_err(|e| TtrpcError::Undecodable {
        what: "request",
        reason: e.to_string(),
    })
}

/// An answer's body: its payload, or its status code and message.
pub fn decode_response(body: &[u8]) -> Result<Result<Vec<u8>, (i32, String)>, TtrpcError> {
    let response = Response::decode(body).map_err(|e| TtrpcError::Undecodable {
        what: "response",
        reason: e.to_string(),
    })?;
    Ok(match response.status {
        Some(status) if status.code != 0 => Err((status.code, status.message)),
        _ => Ok(response.payload),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_come_out_whole_however_their_bytes_are_cut() {
        let mut bytes = request(1, "svc", "Method", b"abc".to_vec());
        bytes.extend(response(3, Ok(vec![7; 5000])));
        bytes.extend(response(5, Err((UNKNOWN, "no".into()))));
        for step in [1, 7, 10, 4096, bytes.len()] {
            let mut a = Assembler::default();
            let mut got = Vec::new();
            for chunk in bytes.chunks(step) {
                got.extend(a.push(chunk).unwrap());
            }
            assert_eq!(got.len(), 3, "step {step}");
            let call = decode_request(&got[0].body).unwrap();
            assert_eq!((got[0].stream, got[0].kind), (1, REQUEST));
            assert_eq!(
                (call.service.as_str(), call.method.as_str()),
                ("svc", "Method")
            );
            assert_eq!(call.payload, b"abc");
            assert_eq!(decode_response(&got[1].body).unwrap(), Ok(vec![7; 5000]));
            assert_eq!(
                decode_response(&got[2].body).unwrap(),
                Err((UNKNOWN, "no".to_string()))
            );
        }
    }

    #[test]
    fn an_oversized_header_is_refused_without_waiting_for_its_body() {
        let mut a = Assembler::default();
        let header = encode(1, REQUEST, &[]);
        let mut huge = header.clone();
        huge[..4].copy_from_slice(&((MAX_MESSAGE + 1) as u32).to_be_bytes());
        assert_eq!(a.push(&huge), Err(TtrpcError::Oversized(MAX_MESSAGE + 1)));
    }

    #[test]
    fn garbage_bodies_are_one_line_errors() {
        let err = decode_request(&[0xff, 0xff, 0xff]).unwrap_err();
        assert!(!err.to_string().contains('\n'));
        assert!(decode_response(&[0x0a, 0x05]).is_err());
    }
}
