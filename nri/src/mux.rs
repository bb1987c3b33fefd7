//! NRI's connection to a runtime: one unix socket carrying two ttrpc connections, told apart by
//! a connection id in front of every frame: [`PLUGIN_SERVICE`] (the runtime calls the plugin)
//! and [`RUNTIME_SERVICE`] (the plugin calls the runtime). A frame is the id and the payload's
//! length (each a big-endian `u32`), then the payload; the payloads of one id, in order, are
//! that connection's byte stream.
//!
//! Frames of any size up to [`MAX_PAYLOAD`] are read; frames are written at most
//! [`WRITE_CHUNK`] bytes long, because a Go runtime hands each frame whole to a reader that may
//! offer only its 4 KiB buffer.

use std::io::{self, Read, Write};

use crate::ttrpc;

/// The connection on which the runtime calls the plugin's service.
pub const PLUGIN_SERVICE: u32 = 1;
/// The connection on which the plugin calls the runtime's service.
pub const RUNTIME_SERVICE: u32 = 2;
/// A frame's header: the connection id and the payload's length.
const HEADER: usize = 8;
/// The largest payload a frame may carry: one whole ttrpc message.
pub const MAX_PAYLOAD: usize = ttrpc::HEADER + ttrpc::MAX_MESSAGE;
/// The largest payload gpuplex writes in one frame.
pub const WRITE_CHUNK: usize = 4096;

/// One frame read from the trunk.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    /// Its connection id.
    pub conn: u32,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Why the trunk cannot be read any further.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// The runtime closed the connection, or reading failed.
    #[error("reading from the runtime's NRI socket: {0}")]
    Io(#[from] io::Error),
    /// A frame longer than any the protocol makes: the peer is not an NRI runtime.
    #[error("the runtime sent a frame of {0} bytes, more than NRI's {MAX_PAYLOAD}; is this NRI's socket?")]
    Oversized(usize),
}

/// The next frame, or `None` when the runtime closed the connection between frames.
pub fn read_frame(trunk: &mut impl Read) -> Result<Option<Frame>, MuxError> {
    let mut header = [0u8; HEADER];
    if !read_exact_or_end(trunk, &mut header)? {
        return Ok(None);
    }
    let conn = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(MuxError::Oversized(len));
    }
    let mut payload = vec![0u8; len];
    trunk.read_exact(&mut payload)?;
    Ok(Some(Frame { conn, payload }))
}

/// Fills `buf`; false when the stream ends before its first byte.
fn read_exact_or_end(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `data` as the frames of connection `conn`, each at most [`WRITE_CHUNK`] long.
pub fn frames(conn: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + HEADER * (data.len() / WRITE_CHUNK + 1));
    for chunk in data.chunks(WRITE_CHUNK) {
        out.extend_from_slice(&conn.to_be_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// Writes `data` to connection `conn` of the trunk, whole (the caller keeps other writers out
/// until it returns).
pub fn write(trunk: &mut impl Write, conn: u32, data: &[u8]) -> io::Result<()> {
    trunk.write_all(&frames(conn, data))?;
    trunk.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_read_back_as_written_in_chunks() {
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let bytes = frames(RUNTIME_SERVICE, &data);
        let mut r = &bytes[..];
        let mut back = Vec::new();
        let mut sizes = Vec::new();
        while let Some(frame) = read_frame(&mut r).unwrap() {
            assert_eq!(frame.conn, RUNTIME_SERVICE);
            sizes.push(frame.payload.len());
            back.extend(frame.payload);
        }
        assert_eq!(back, data);
        assert_eq!(sizes, [4096, 4096, 1808]);
    }

    #[test]
    fn an_end_between_frames_is_the_end_and_within_one_an_error() {
        assert!(read_frame(&mut &[][..]).unwrap().is_none());
        let bytes = frames(PLUGIN_SERVICE, b"hello");
        for cut in 1..bytes.len() {
            assert!(read_frame(&mut &bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn a_frame_longer_than_the_protocol_allows_is_refused_before_it_is_read() {
        let mut header = 1u32.to_be_bytes().to_vec();
        header.extend_from_slice(&u32::MAX.to_be_bytes());
        let err = read_frame(&mut &header[..]).unwrap_err();
        assert!(matches!(err, MuxError::Oversized(n) if n == u32::MAX as usize));
        assert!(!err.to_string().contains('\n'));
    }
}
