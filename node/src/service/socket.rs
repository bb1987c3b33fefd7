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
//!   connection that has waited longest for a request or for its reply to be read (one whose
//!   request the loop is carrying out is never cut); a peer process (`SO_PEERCRED`) holds at most [`MAX_PER_PEER`], and its
//!   own oldest gives way first;
//! - a slot is given back however its connection ends, a failed thread start included.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuplex_wire::protocol::{parse_request, Reply, MAX_LINE};

use super::{Event, ServiceError};

/// At most this many connections are served at once.
pub const MAX_CONNECTIONS: usize = 128;
/// At most this many of them from one peer process.
pub const MAX_PER_PEER: usize = 16;
/// A connection that sends no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A request must be whole (up to its newline) this long after its first byte.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

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

/// One connection as the pool sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seat {
    id: u64,
    /// The peer's pid, when the kernel says.
    peer: Option<u32>,
    /// Since when it waits for (the rest of) a request; `None` while the loop carries one out.
    waiting_since: Option<Instant>,
}

/// Where a new connection from `peer` goes.
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// A free slot.
    Free,
    /// The slot of this waiting connection, which is closed.
    Evict(u64),
    /// None: every connection in the way has a request in flight.
    Full,
}

/// The room a new connection from `peer` gets among `seats`: the peer's own oldest waiting
/// connection when it holds `per_peer` already, else a free slot, else the oldest waiting one.
fn make_room(seats: &[Seat], peer: Option<u32>, max: usize, per_peer: usize) -> Room {
    let oldest_waiting = |of_peer: bool| {
        seats
            .iter()
            .filter(|s| !of_peer || s.peer == peer)
            .filter_map(|s| Some((s.waiting_since?, s.id)))
            .min()
            .map(|(_, id)| id)
    };
    if peer.is_some() && seats.iter().filter(|s| s.peer == peer).count() >= per_peer {
        return oldest_waiting(true).map_or(Room::Full, Room::Evict);
    }
    if seats.len() < max {
        return Room::Free;
    }
    oldest_waiting(false).map_or(Room::Full, Room::Evict)
}

/// The connections served now.
#[derive(Default)]
struct Pool {
    next: u64,
    seats: HashMap<u64, (Seat, UnixStream)>,
}

/// A connection's slot in the pool; given back when dropped.
struct Slot {
    pool: Arc<Mutex<Pool>>,
    id: u64,
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slot {
    /// Marks the connection waiting for a request (`true`) or carrying one out; false when it
    /// was closed to make room for another (its thread should end).
    fn waiting(&self, waiting: bool) -> bool {
        let mut pool = lock(&self.pool);
        let Some((seat, _)) = pool.seats.get_mut(&self.id) else {
            return false;
        };
        seat.waiting_since = waiting.then(Instant::now);
        true
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.pool).seats.remove(&self.id);
    }
}

/// Seats a new connection, making room for it; `None` when there is none.
fn seat(pool: &Arc<Mutex<Pool>>, stream: &UnixStream) -> Option<Slot> {
    let peer = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid() as u32);
    let copy = stream.try_clone().ok()?;
    let mut guard = lock(pool);
    let seats: Vec<Seat> = guard.seats.values().map(|(s, _)| *s).collect();
    match make_room(&seats, peer, MAX_CONNECTIONS, MAX_PER_PEER) {
        Room::Full => return None,
        Room::Free => {}
        Room::Evict(id) => {
            if let Some((_, evicted)) = guard.seats.remove(&id) {
                let _ = evicted.shutdown(std::net::Shutdown::Both);
            }
        }
    }
    guard.next += 1;
    let id = guard.next;
    let seat = Seat {
        id,
        peer,
        waiting_since: Some(Instant::now()),
    };
    guard.seats.insert(id, (seat, copy));
    Some(Slot {
        pool: Arc::clone(pool),
        id,
    })
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
/// request that is over the limit or too slow.
fn serve_connection(mut stream: UnixStream, events: &Sender<Event>, slot: &Slot) {
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    let (mut pending, mut line) = (Vec::new(), Vec::new());
    loop {
        if !slot.waiting(true) {
            return;
        }
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
        if !slot.waiting(false) {
            return;
        }
        let reply = match parse_request(&line) {
            Ok(request) => ask(events, request),
            Err(e) => Reply::refused(e),
        };
        // Carried out: a client that does not read its reply holds no slot that others need.
        if !slot.waiting(true) {
            return;
        }
        if stream.write_all(reply.to_line().as_bytes()).is_err() {
            return;
        }
    }
}

fn ask(events: &Sender<Event>, request: gpuplex_wire::protocol::Request) -> Reply {
    let (tx, rx) = mpsc::channel();
    if events.send(Event::Request(request, tx)).is_err() {
        return Reply::refused("the node service is stopping");
    }
    rx.recv()
        .unwrap_or_else(|_| Reply::refused("the node service is stopping"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(id: u64, peer: u32, waited_ms: Option<u64>, now: Instant) -> Seat {
        Seat {
            id,
            peer: Some(peer),
            waiting_since: waited_ms.map(|ms| now - Duration::from_millis(ms)),
        }
    }

    #[test]
    fn a_new_connection_takes_a_free_slot_else_the_longest_waiting_one() {
        let now = Instant::now();
        let seats = [
            seat(1, 10, Some(50), now),
            seat(2, 11, Some(500), now),
            seat(3, 12, None, now),
        ];
        assert_eq!(make_room(&seats, Some(13), 4, 16), Room::Free);
        assert_eq!(make_room(&seats, Some(13), 3, 16), Room::Evict(2));
        // A connection whose request is being carried out is never cut.
        let busy = [seat(1, 10, None, now), seat(2, 11, None, now)];
        assert_eq!(make_room(&busy, Some(13), 2, 16), Room::Full);
    }

    #[test]
    fn a_slot_is_given_back_however_its_connection_ends_a_failed_thread_start_included() {
        let pool = Arc::new(Mutex::new(Pool::default()));
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let slot = super::seat(&pool, &ours).expect("room");
        assert_eq!(lock(&pool).seats.len(), 1);
        drop(slot);
        assert!(lock(&pool).seats.is_empty());
        // A thread that cannot start (a stack no machine has) drops the slot it was given.
        let slot = super::seat(&pool, &ours).expect("room");
        let (events, _inbox) = mpsc::channel();
        let impossible = std::thread::Builder::new().stack_size(usize::MAX / 2);
        assert!(spawn_connection(impossible, ours.try_clone().unwrap(), events, slot).is_err());
        assert!(lock(&pool).seats.is_empty(), "a slot leaked");
    }

    #[test]
    fn a_request_trickled_byte_by_byte_is_cut_at_its_deadline_not_kept_alive() {
        // The deadline runs from the first byte: a read that times out does not restart it.
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(b"{\"op\":").unwrap();
        let (mut pending, mut line) = (Vec::new(), Vec::new());
        let started = Instant::now();
        let writer = std::thread::spawn(move || {
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(400));
                if theirs.write_all(b" ").is_err() {
                    return;
                }
            }
        });
        let why = read_line(&mut ours, &mut pending, &mut line).unwrap_err();
        assert!(started.elapsed() >= REQUEST_DEADLINE);
        assert!(why.contains("did not arrive whole within 10s"), "{why}");
        drop(ours);
        writer.join().unwrap();
    }

    #[test]
    fn lines_split_and_joined_by_reads_come_out_one_request_each() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        theirs
            .write_all(b"{\"op\":\"status\"}\r\n\n{\"op\":")
            .unwrap();
        let (mut pending, mut line) = (Vec::new(), Vec::new());
        assert_eq!(read_line(&mut ours, &mut pending, &mut line), Ok(true));
        assert_eq!(line, b"{\"op\":\"status\"}");
        assert_eq!(read_line(&mut ours, &mut pending, &mut line), Ok(true));
        assert_eq!(line, b"");
        theirs.write_all(b"\"status\"}").unwrap();
        drop(theirs);
        // The last line needs no newline; then the end.
        assert_eq!(read_line(&mut ours, &mut pending, &mut line), Ok(true));
        assert_eq!(line, b"{\"op\":\"status\"}");
        assert_eq!(read_line(&mut ours, &mut pending, &mut line), Ok(false));
    }

    #[test]
    fn a_peer_over_its_share_gives_up_its_own_oldest_first() {
        let now = Instant::now();
        let seats = [
            seat(1, 10, Some(900), now),
            seat(2, 66, Some(100), now),
            seat(3, 66, Some(300), now),
            seat(4, 66, None, now),
        ];
        // Peer 66 holds 3 of 3 allowed: its own oldest waiting one goes, not peer 10's older one.
        assert_eq!(make_room(&seats, Some(66), 128, 3), Room::Evict(3));
        assert_eq!(make_room(&seats, Some(10), 128, 3), Room::Free);
        let all_busy = [seat(4, 66, None, now), seat(5, 66, None, now)];
        assert_eq!(make_room(&all_busy, Some(66), 128, 2), Room::Full);
    }
}
