//! The node socket: a unix socket, mode 0600, one JSON request per line, one reply line each.
//!
//! Each connection gets a thread that reads lines, parses them (pure: `parse_request`) and hands
//! them to the service's loop, one at a time, so that requests are serialized. A line over
//! [`MAX_LINE`] is answered with an error and the connection is closed (the rest of it cannot be
//! read as a request); malformed JSON and unknown operations get an error reply and the
//! connection stays usable. Nothing a client sends reaches the loop unparsed.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::time::Duration;

use gpuplex_scheduler::protocol::{parse_request, Reply, MAX_LINE};

use super::{Event, ServiceError};

/// At most this many connections are served at once; more are answered with an error.
pub const MAX_CONNECTIONS: usize = 128;
/// A connection idle this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Binds the socket with mode 0600, replacing a stale socket file but never a live one.
pub(super) fn bind(path: &Path) -> Result<UnixListener, ServiceError> {
    let fail = |message: String| ServiceError::Socket {
        path: path.to_path_buf(),
        message,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(fail(
                "another gpuplex node service is listening there; stop it first".into(),
            ));
        }
        std::fs::remove_file(path)
            .map_err(|e| fail(format!("cannot remove the stale socket: {e}")))?;
    }
    // The umask makes the socket 0600 from its first instant; the chmod says so explicitly.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = bound.map_err(|e| fail(format!("cannot listen: {e}")))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| fail(format!("cannot set mode 0600: {e}")))?;
    Ok(listener)
}

/// Accepts connections for ever, a thread each.
pub(super) fn spawn_accept_loop(listener: UnixListener, events: Sender<Event>) {
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("socket".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let mut stream = match stream {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!("node socket: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                };
                if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                    open.fetch_sub(1, Ordering::SeqCst);
                    let busy = Reply::error(format!(
                        "the node service is serving {MAX_CONNECTIONS} connections already; retry"
                    ));
                    let _ = stream.write_all(busy.to_line().as_bytes());
                    continue;
                }
                let events = events.clone();
                let open = Arc::clone(&open);
                let spawned =
                    std::thread::Builder::new()
                        .name("connection".into())
                        .spawn(move || {
                            serve_connection(stream, &events);
                            open.fetch_sub(1, Ordering::SeqCst);
                        });
                if let Err(e) = spawned {
                    tracing::warn!("node socket: cannot start a connection thread: {e}");
                }
            }
        })
        .expect("a thread starts at startup");
}

/// Serves one connection until it closes, idles out, or sends an over-long line.
fn serve_connection(stream: UnixStream, events: &Sender<Event>) {
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IDLE_TIMEOUT));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        // One byte more than the limit, plus the newline: enough to tell "too long".
        let limit = (MAX_LINE + 2) as u64;
        match (&mut reader).take(limit).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let complete = line.last() == Some(&b'\n');
        if complete {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        }
        if line.len() > MAX_LINE || (!complete && line.len() as u64 >= limit) {
            let reply = Reply::error(format!(
                "request is over the limit of {MAX_LINE} bytes; the connection is closed"
            ));
            let _ = writer.write_all(reply.to_line().as_bytes());
            return;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            if complete {
                continue;
            }
            return;
        }
        let reply = match parse_request(&line) {
            Ok(request) => ask(events, request),
            Err(e) => Reply::error(e),
        };
        if writer.write_all(reply.to_line().as_bytes()).is_err() {
            return;
        }
        if !complete {
            return;
        }
    }
}

fn ask(events: &Sender<Event>, request: gpuplex_scheduler::protocol::Request) -> Reply {
    let (tx, rx) = mpsc::channel();
    if events.send(Event::Request(request, tx)).is_err() {
        return Reply::error("the node service is stopping");
    }
    rx.recv()
        .unwrap_or_else(|_| Reply::error("the node service is stopping"))
}
