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
//!
//! A connection that sends `watch` becomes a watcher for the rest of its life: it waits for
//! changes, not for a request, so it is never taken for an idle one and cut to make room. So
//! that watchers cannot take the slots request clients need, at most [`MAX_WATCHERS`] watch at
//! once and a peer process at most [`MAX_WATCHERS_PER_PEER`] (its own oldest watcher gives way
//! to its next; a watch over the total is refused and the connection takes requests as
//! before). Its thread writes each line the loop leaves it (see [`super::watch`]), giving up on
//! a client that reads none for [`REQUEST_DEADLINE`]; a second thread reads the connection
//! only to see it end (or carry anything, which ends it too).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuplex_wire::protocol::{parse_request, Reply, Request, MAX_LINE};

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
    /// Since when it waits for (the rest of) a request; `None` while the loop carries one out,
    /// and once it watches.
    waiting_since: Option<Instant>,
    /// Since when it watches the node's capacity; `None` for a connection of requests.
    watching_since: Option<Instant>,
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

/// Whether a connection of `peer` may start to watch.
#[derive(Debug, PartialEq, Eq)]
enum WatchRoom {
    /// Yes.
    Granted,
    /// Yes, once this watcher of the same peer, its oldest, is closed.
    Evict(u64),
    /// No: `max` connections watch already.
    Refused,
}

/// Whether a connection of `peer` may watch among `seats`: a peer that holds `per_peer`
/// watchers gives up its oldest; otherwise one more than `max` is refused.
fn watch_room(seats: &[Seat], peer: Option<u32>, max: usize, per_peer: usize) -> WatchRoom {
    let watching = || seats.iter().filter(|s| s.watching_since.is_some());
    if peer.is_some() {
        let own = || watching().filter(|s| s.peer == peer);
        if own().count() >= per_peer {
            return (own().filter_map(|s| Some((s.watching_since?, s.id))).min())
                .map_or(WatchRoom::Refused, |(_, id)| WatchRoom::Evict(id));
        }
    }
    if watching().count() >= max {
        return WatchRoom::Refused;
    }
    WatchRoom::Granted
}

/// The connections served now.
#[derive(Default)]
struct Pool {
    next: u64,
    seats: HashMap<u64, Seated>,
}

/// A connection in the pool: a copy of its stream (to close it), and its mailbox once it
/// watches (to end its watch).
struct Seated {
    seat: Seat,
    stream: UnixStream,
    mailbox: Option<Arc<Mailbox>>,
}

impl Seated {
    /// Closes the connection to make room: its reads and writes fail, its watch is over.
    fn close(self) {
        if let Some(mailbox) = &self.mailbox {
            mailbox.close();
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
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
        let Some(seated) = pool.seats.get_mut(&self.id) else {
            return false;
        };
        seated.seat.waiting_since = waiting.then(Instant::now);
        true
    }

    /// Makes the connection a watcher whose lines go through `mailbox`, if there is room (see
    /// [`watch_room`]); the refusal is one line.
    fn watch(&self, mailbox: &Arc<Mailbox>) -> Result<(), String> {
        let mut pool = lock(&self.pool);
        let seats: Vec<Seat> = pool.seats.values().map(|s| s.seat).collect();
        let Some(peer) = pool.seats.get(&self.id).map(|s| s.seat.peer) else {
            return Err("the connection was closed".into());
        };
        match watch_room(&seats, peer, MAX_WATCHERS, MAX_WATCHERS_PER_PEER) {
            WatchRoom::Refused => {
                return Err(format!(
                    "{MAX_WATCHERS} connections watch the node already; retry when one is closed"
                ))
            }
            WatchRoom::Evict(id) => {
                if let Some(evicted) = pool.seats.remove(&id) {
                    evicted.close();
                }
            }
            WatchRoom::Granted => {}
        }
        let Some(seated) = pool.seats.get_mut(&self.id) else {
            return Err("the connection was closed".into());
        };
        seated.seat.waiting_since = None;
        seated.seat.watching_since = Some(Instant::now());
        seated.mailbox = Some(Arc::clone(mailbox));
        Ok(())
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
    let seats: Vec<Seat> = guard.seats.values().map(|s| s.seat).collect();
    match make_room(&seats, peer, MAX_CONNECTIONS, MAX_PER_PEER) {
        Room::Full => return None,
        Room::Free => {}
        Room::Evict(id) => {
            if let Some(evicted) = guard.seats.remove(&id) {
                evicted.close();
            }
        }
    }
    guard.next += 1;
    let id = guard.next;
    let seat = Seat {
        id,
        peer,
        waiting_since: Some(Instant::now()),
        watching_since: None,
    };
    let seated = Seated {
        seat,
        stream: copy,
        mailbox: None,
    };
    guard.seats.insert(id, seated);
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
/// request that is over the limit or too slow; or, once it watches, until its watch is over.
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
            Ok(Request::Watch) => match start_watch(slot, &pending) {
                Ok(mailbox) => return serve_watcher(stream, events, &mailbox),
                Err(why) => Reply::refused(why),
            },
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
mod tests {
    use super::*;

    fn seat(id: u64, peer: u32, waited_ms: Option<u64>, now: Instant) -> Seat {
        Seat {
            id,
            peer: Some(peer),
            waiting_since: waited_ms.map(|ms| now - Duration::from_millis(ms)),
            watching_since: None,
        }
    }

    fn watcher(id: u64, peer: u32, watched_ms: u64, now: Instant) -> Seat {
        Seat {
            watching_since: Some(now - Duration::from_millis(watched_ms)),
            ..seat(id, peer, None, now)
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

    #[test]
    fn a_watcher_is_never_cut_for_a_request_client_and_watchers_are_capped() {
        let now = Instant::now();
        // Watchers wait for changes, not requests: a new connection does not take their slots.
        let watchers = [watcher(1, 10, 900, now), watcher(2, 11, 500, now)];
        assert_eq!(make_room(&watchers, Some(12), 2, 16), Room::Full);
        let mixed = [watcher(1, 10, 900, now), seat(2, 11, Some(5), now)];
        assert_eq!(make_room(&mixed, Some(12), 2, 16), Room::Evict(2));
        // A peer's watchers count towards its share of connections.
        assert_eq!(make_room(&watchers, Some(10), 128, 1), Room::Full);

        // A peer holding its share of watchers gives up its own oldest to its next.
        let seats = [
            watcher(1, 10, 900, now),
            watcher(2, 66, 100, now),
            watcher(3, 66, 300, now),
            seat(4, 66, Some(1000), now),
        ];
        assert_eq!(watch_room(&seats, Some(66), 16, 2), WatchRoom::Evict(3));
        assert_eq!(watch_room(&seats, Some(66), 16, 3), WatchRoom::Granted);
        // Over the total, another peer's watchers are kept and the watch refused.
        assert_eq!(watch_room(&seats, Some(12), 3, 2), WatchRoom::Refused);
        assert_eq!(watch_room(&seats, None, 3, 2), WatchRoom::Refused);
        assert_eq!(watch_room(&seats, None, 4, 2), WatchRoom::Granted);
    }

    /// A connection seated in `pool` and served on a thread, as the accept loop does: the
    /// client's end, the events it sends the loop, and its thread.
    fn connected(
        pool: &Arc<Mutex<Pool>>,
    ) -> (
        UnixStream,
        mpsc::Receiver<Event>,
        std::thread::JoinHandle<()>,
    ) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let slot = super::seat(pool, &ours).expect("room");
        let (events, inbox) = mpsc::channel();
        let served = std::thread::spawn(move || serve_connection(ours, &events, &slot));
        (theirs, inbox, served)
    }

    fn watch_event(inbox: &mpsc::Receiver<Event>) -> Arc<Mailbox> {
        match inbox.recv_timeout(Duration::from_secs(10)) {
            Ok(Event::Watch(mailbox)) => mailbox,
            _ => panic!("no watch event"),
        }
    }

    #[test]
    fn a_watcher_that_never_reads_blocks_nobody_and_its_end_gives_its_slot_back() {
        let pool = Arc::new(Mutex::new(Pool::default()));
        let (mut client, inbox, served) = connected(&pool);
        client.write_all(b"{\"op\":\"watch\"}\n").unwrap();
        let mailbox = watch_event(&inbox);
        // The loop leaves 64 lines of 1 MiB for a client that reads none: each post returns
        // at once (its thread's write is stuck on the full socket, not the loop).
        let big: Arc<str> = format!("{}\n", "x".repeat(1 << 20)).into();
        for _ in 0..64 {
            mailbox.post(Arc::clone(&big));
        }
        {
            let pool = lock(&pool);
            let seat = pool.seats.values().next().expect("seated").seat;
            assert!(seat.watching_since.is_some() && seat.waiting_since.is_none());
        }
        // The client goes: the watch is over and the slot given back.
        drop(client);
        served.join().unwrap();
        assert!(mailbox.is_closed());
        assert!(lock(&pool).seats.is_empty(), "a slot leaked");
    }

    #[test]
    fn a_watcher_gets_each_line_and_its_watch_ends_when_it_sends_anything() {
        let pool = Arc::new(Mutex::new(Pool::default()));
        let (client, inbox, served) = connected(&pool);
        let mut reader = std::io::BufReader::new(client.try_clone().unwrap());
        let mut client = client;
        client.write_all(b"{\"op\":\"watch\"}\n").unwrap();
        let mailbox = watch_event(&inbox);
        let mut line = String::new();
        for n in 0..3 {
            mailbox.post(format!("view {n}\n").into());
            line.clear();
            std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
            assert_eq!(line, format!("view {n}\n"));
        }
        client.write_all(b"{\"op\":\"status\"}\n").unwrap();
        served.join().unwrap();
        assert!(mailbox.is_closed());
        // The connection is closed (reset, since the service left the request unread).
        line.clear();
        let end = std::io::BufRead::read_line(&mut reader, &mut line);
        assert!(matches!(end, Ok(0) | Err(_)), "{end:?} {line:?}");
    }

    #[test]
    fn a_watch_followed_by_more_requests_or_over_the_cap_is_refused_and_requests_go_on() {
        let pool = Arc::new(Mutex::new(Pool::default()));
        let (client, inbox, served) = connected(&pool);
        let mut reader = std::io::BufReader::new(client.try_clone().unwrap());
        let mut client = client;
        let answer = |reader: &mut std::io::BufReader<UnixStream>| {
            let mut line = String::new();
            std::io::BufRead::read_line(reader, &mut line).unwrap();
            line
        };
        client
            .write_all(b"{\"op\":\"watch\"}\n{\"op\":\"status\"}\n")
            .unwrap();
        let refused = answer(&mut reader);
        assert!(
            refused.contains("watch must be the connection's last request"),
            "{refused}"
        );
        // The status after it is carried out as any request.
        match inbox.recv_timeout(Duration::from_secs(10)) {
            Ok(Event::Request(Request::Status, reply)) => reply.send(Reply::Done).unwrap(),
            _ => panic!("no status request"),
        }
        assert_eq!(answer(&mut reader), "{\"ok\":true}\n");
        // Every watcher's place taken (by other peers): refused, and the connection still
        // takes requests.
        {
            let mut pool = lock(&pool);
            for id in 1000..1000 + MAX_WATCHERS as u64 {
                let (copy, _) = UnixStream::pair().unwrap();
                let seat = Seat {
                    id,
                    peer: Some(u32::MAX - id as u32),
                    waiting_since: None,
                    watching_since: Some(Instant::now()),
                };
                let seated = Seated {
                    seat,
                    stream: copy,
                    mailbox: None,
                };
                pool.seats.insert(id, seated);
            }
        }
        client.write_all(b"{\"op\":\"watch\"}\n").unwrap();
        let refused = answer(&mut reader);
        assert!(
            refused.contains("16 connections watch the node already"),
            "{refused}"
        );
        drop(client);
        drop(reader);
        served.join().unwrap();
    }
}
