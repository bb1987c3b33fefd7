//! The node socket: a unix socket, mode 0600, one JSON request per line, one reply line each.
//!
//! Each connection gets a thread that reads lines, parses them (pure: `parse_request`) and hands
//! them to the service's loop, one at a time, so that requests are serialized. A line over
//! [`MAX_LINE`] is answered with an error and the connection is closed (the rest of it cannot be
//! read as a request); malformed JSON and unknown operations get an error reply and the
//! connection stays usable. Nothing a client sends reaches the loop unparsed.
//!
//! No client can lock the others out (the hooks and the shim above all):
//!
//! - a request must arrive whole within [`REQUEST_DEADLINE`] of its first byte, however its
//!   bytes trickle in, and a connection waits at most [`IDLE_TIMEOUT`] for a request;
//! - at most [`MAX_CONNECTIONS`] connections are served; one more takes the slot of the
//!   connection that has waited longest for a request (one whose request the loop is carrying
//!   out is never cut); a peer process (`SO_PEERCRED`) holds at most [`MAX_PER_PEER`], and its
//!   own oldest gives way first. Giving way loses no request: only the connection's reading
//!   side is shut, so that its thread still reads, carries out and answers every request sent
//!   before, then sees the end; a client sending after that is refused by the kernel at once
//!   (`EPIPE`), before anything is delivered, and may send again on a new connection;
//! - a slot is given back however its connection ends, a failed thread start included.
//!
//! A connection that sends `watch` becomes a watcher for the rest of its life: it waits for
//! changes, not for a request, so it is never taken for an idle one and cut to make room. So
//! that watchers cannot take the slots request clients need, at most [`MAX_WATCHERS`] watch at
//! once and a peer process at most [`MAX_WATCHERS_PER_PEER`] (its own oldest watcher gives way
//! to its next; a watch over the total is refused and the connection takes requests as
//! before). Its thread writes each line the loop leaves it (see [`super::watch`]), giving up on
//! a client that reads none for [`REQUEST_DEADLINE`]; a second thread reads the connection
//! only to see it end (or carry anything, which ends it too).

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplex_wire::protocol::{parse_request, Reply, Request, MAX_LINE};

mod seats;

use seats::{seat, Pool, Slot};

use super::watch::Mailbox;
use super::{Event, ServiceError};

/// At most this many connections are served at once.
pub const MAX_CONNECTIONS: usize = 128;
/// At most this many of them from one peer process.
pub const MAX_PER_PEER: usize = 16;
/// A connection that sends no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A request must be whole (up to its newline) this long after its first byte; a watcher must
/// take a line written to it within as long.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// At most this many connections watch the node at once (`watch`).
pub const MAX_WATCHERS: usize = 16;
/// At most this many of them from one peer process.
pub const MAX_WATCHERS_PER_PEER: usize = 4;

/// The listening socket systemd passed (socket activation: `gpuplex.socket`), if it passed one:
/// the first of `LISTEN_FDS` when `LISTEN_PID` is this process. It must be a listening Unix
/// stream socket at `path`, the configured `service.socket`; else the service refuses to start
/// rather than serve a socket nobody will connect to. Marked close-on-exec, so that the
/// watchdog and anything else the service starts do not keep it open.
///
/// The socket outlives the service: systemd keeps listening while the service restarts, so a
/// connection made meanwhile waits in its backlog for the next service instead of finding no
/// socket (a shim would then start a service of its own, outside the unit).
pub(super) fn inherited(path: &Path) -> Result<Option<UnixListener>, ServiceError> {
    let fail = |message: String| ServiceError::Socket {
        path: path.to_path_buf(),
        message,
    };
    let ours = std::env::var("LISTEN_PID").is_ok_and(|p| p == std::process::id().to_string());
    if !ours {
        return Ok(None);
    }
    let listener = listenfd::ListenFd::from_env()
        .take_unix_listener(0)
        .map_err(|e| {
            fail(format!(
                "systemd passed a socket that is not a Unix stream socket: {e}"
            ))
        })?;
    let Some(listener) = listener else {
        return Ok(None);
    };
    nix::fcntl::fcntl(
        &listener,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| fail(format!("cannot mark systemd's socket close-on-exec: {e}")))?;
    // `Accept=yes` would pass one connection, not the listener.
    let listening = nix::sys::socket::getsockopt(&listener, nix::sys::socket::sockopt::AcceptConn);
    if !listening.unwrap_or(false) {
        return Err(fail(
            "systemd passed a socket that is not listening (gpuplex.socket must not say \
             Accept=yes)"
                .into(),
        ));
    }
    let local = listener.local_addr().ok();
    let at = local.as_ref().and_then(|a| a.as_pathname());
    if !at.is_some_and(|at| same_place(at, path)) {
        let at = at.map_or("an unnamed socket".to_string(), |p| p.display().to_string());
        return Err(fail(format!(
            "systemd passed {at} (gpuplex.socket's ListenStream), but service.socket is this \
             path; make them the same (systemctl edit gpuplex.socket)"
        )));
    }
    Ok(Some(listener))
}

/// Whether two socket paths name the same place: equal, or the same name in the same
/// directory reached by different routes (`/var/run` is a link to `/run`).
fn same_place(a: &Path, b: &Path) -> bool {
    let place = |p: &Path| Some((p.parent()?.canonicalize().ok()?, p.file_name()?.to_owned()));
    a == b || place(a).is_some_and(|x| place(b) == Some(x))
}

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
    let pool = Arc::new(Mutex::new(Pool::default()));
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
                let Some(slot) = seat(&pool, &stream) else {
                    let busy = Reply::refused(format!(
                        "the node service is carrying out {MAX_CONNECTIONS} requests already; retry"
                    ));
                    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                    let _ = stream.write_all(busy.to_line().as_bytes());
                    continue;
                };
                let thread = std::thread::Builder::new().name("connection".into());
                if let Err(e) = spawn_connection(thread, stream, events.clone(), slot) {
                    tracing::warn!("node socket: cannot start a connection thread: {e}");
                }
            }
        })
        .expect("a thread starts at startup");
}

/// Serves a connection on a thread of its own. The slot moves into the thread; if the thread
/// cannot start, the closure, and the slot with it, is dropped: the slot is given back.
fn spawn_connection(
    thread: std::thread::Builder,
    stream: UnixStream,
    events: Sender<Event>,
    slot: Slot,
) -> std::io::Result<()> {
    thread
        .spawn(move || serve_connection(stream, &events, &slot))
        .map(drop)
}

/// Reads one request line into `line` (without its newline) from `stream`, keeping what
/// follows it in `pending`. `Ok(false)`: the connection ended, idled out or was closed.
/// `Err(line)`: the request is refused, saying why, and the connection must close.
fn read_line(
    stream: &mut UnixStream,
    pending: &mut Vec<u8>,
    line: &mut Vec<u8>,
) -> Result<bool, String> {
    let mut started: Option<Instant> = (!pending.is_empty()).then(Instant::now);
    let mut buf = [0u8; 8192];
    loop {
        if let Some(end) = pending.iter().position(|&b| b == b'\n') {
            line.clear();
            line.extend(pending.drain(..=end));
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.len() > MAX_LINE {
                return Err(too_long());
            }
            return Ok(true);
        }
        if pending.len() > MAX_LINE + 1 {
            return Err(too_long());
        }
        let wait = match started {
            None => IDLE_TIMEOUT,
            Some(at) => match REQUEST_DEADLINE.checked_sub(at.elapsed()) {
                Some(left) if !left.is_zero() => left,
                _ => {
                    return Err(format!(
                        "the request did not arrive whole within {}s of its first byte; the connection is closed",
                        REQUEST_DEADLINE.as_secs()
                    ))
                }
            },
        };
        let _ = stream.set_read_timeout(Some(wait));
        match stream.read(&mut buf) {
            Ok(0) => {
                // The client closed its end: a last line without a newline is still a request.
                if pending.iter().all(u8::is_ascii_whitespace) {
                    return Ok(false);
                }
                pending.push(b'\n');
            }
            Ok(n) => {
                started.get_or_insert_with(Instant::now);
                pending.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if started.is_some()
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
            Err(_) => return Ok(false),
        }
    }
}

fn too_long() -> String {
    format!("request is over the limit of {MAX_LINE} bytes; the connection is closed")
}

/// Serves one connection until it closes, idles out, is closed to make room, or sends a
/// request that is over the limit or too slow; or, once it watches, until its watch is over.
fn serve_connection(mut stream: UnixStream, events: &Sender<Event>, slot: &Slot) {
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    let (mut pending, mut line) = (Vec::new(), Vec::new());
    loop {
        match read_line(&mut stream, &mut pending, &mut line) {
            Ok(true) => {}
            Ok(false) => return,
            Err(why) => {
                let _ = stream.write_all(Reply::refused(why).to_line().as_bytes());
                return;
            }
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        slot.waiting(false);
        let reply = match parse_request(&line) {
            Ok(Request::Watch) => match start_watch(slot, &pending) {
                Ok(mailbox) => return serve_watcher(stream, events, &mailbox),
                Err(why) => Reply::refused(why),
            },
            Ok(request) => ask(events, request),
            Err(e) => Reply::refused(e),
        };
        // Carried out: a client that does not read its reply holds no slot that others need.
        slot.waiting(true);
        if stream.write_all(reply.to_line().as_bytes()).is_err() {
            return;
        }
    }
}

/// Makes the connection of `slot` a watcher, unless the client sent more after `watch`
/// (`pending`) or there is no room; its mailbox.
fn start_watch(slot: &Slot, pending: &[u8]) -> Result<Arc<Mailbox>, String> {
    if !pending.iter().all(u8::is_ascii_whitespace) {
        return Err(
            "watch must be the connection's last request: it carries only views after it".into(),
        );
    }
    let mailbox = Arc::new(Mailbox::default());
    slot.watch(&mailbox)?;
    Ok(mailbox)
}

/// Serves a watcher until its watch is over: the loop's first view and each change after, as
/// the loop leaves them in `mailbox`, written with [`REQUEST_DEADLINE`] for each; a second
/// thread ends the watch when the client closes the connection or sends anything.
fn serve_watcher(mut stream: UnixStream, events: &Sender<Event>, mailbox: &Arc<Mailbox>) {
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    let hangup = stream.try_clone().and_then(|copy| {
        let mailbox = Arc::clone(mailbox);
        std::thread::Builder::new()
            .name("watch-hangup".into())
            .spawn(move || end_at_hangup(copy, &mailbox))
    });
    let hangup = match hangup {
        Ok(thread) => thread,
        Err(e) => {
            mailbox.close();
            let refused = Reply::refused(format!("cannot watch the connection: {e}"));
            let _ = stream.write_all(refused.to_line().as_bytes());
            return;
        }
    };
    if events.send(Event::Watch(Arc::clone(mailbox))).is_err() {
        mailbox.post(
            Reply::refused("the node service is stopping")
                .to_line()
                .into(),
        );
        mailbox.close();
    }
    while let Some(line) = mailbox.take() {
        if stream.write_all(line.as_bytes()).is_err() {
            break;
        }
    }
    mailbox.close();
    let _ = stream.shutdown(Shutdown::Both);
    let _ = hangup.join();
}

/// Reads a watcher's connection until it ends or carries anything, then ends the watch.
fn end_at_hangup(mut stream: UnixStream, mailbox: &Mailbox) {
    let _ = stream.set_read_timeout(None);
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    mailbox.close();
}

fn ask(events: &Sender<Event>, request: Request) -> Reply {
    let (tx, rx) = mpsc::channel();
    if events.send(Event::Request(request, tx)).is_err() {
        return Reply::refused("the node service is stopping");
    }
    rx.recv()
        .unwrap_or_else(|_| Reply::refused("the node service is stopping"))
}

#[cfg(test)]
mod tests;
