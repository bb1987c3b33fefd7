//! Who is served: the node socket's slots ([`MAX_CONNECTIONS`], [`MAX_PER_PEER`] of them per
//! peer process, [`MAX_WATCHERS`] watchers), which connection gives way to a new one
//! ([`make_room`], [`watch_room`]: pure), and the pool that holds them.

use std::collections::HashMap;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::super::watch::Mailbox;
use super::{MAX_CONNECTIONS, MAX_PER_PEER, MAX_WATCHERS, MAX_WATCHERS_PER_PEER};

/// One connection as the pool sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Seat {
    pub(super) id: u64,
    /// The peer's pid, when the kernel says.
    pub(super) peer: Option<u32>,
    /// Since when it waits for (the rest of) a request; `None` while the loop carries one out,
    /// and once it watches.
    pub(super) waiting_since: Option<Instant>,
    /// Since when it watches the node's capacity; `None` for a connection of requests.
    pub(super) watching_since: Option<Instant>,
}

/// Where a new connection from `peer` goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// A free slot.
    Free,
    /// The slot of this waiting connection, which is closed.
    Evict(u64),
    /// None: every connection in the way has a request in flight.
    Full,
}

/// The room a new connection from `peer` gets among `seats`: the peer's own oldest waiting
/// connection when it holds `per_peer` already, else a free slot, else the oldest waiting one.
pub(super) fn make_room(seats: &[Seat], peer: Option<u32>, max: usize, per_peer: usize) -> Room {
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
pub(super) enum WatchRoom {
    /// Yes.
    Granted,
    /// Yes, once this watcher of the same peer, its oldest, is closed.
    Evict(u64),
    /// No: `max` connections watch already.
    Refused,
}

/// Whether a connection of `peer` may watch among `seats`: a peer that holds `per_peer`
/// watchers gives up its oldest; otherwise one more than `max` is refused.
pub(super) fn watch_room(
    seats: &[Seat],
    peer: Option<u32>,
    max: usize,
    per_peer: usize,
) -> WatchRoom {
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
pub(super) struct Pool {
    pub(super) next: u64,
    pub(super) seats: HashMap<u64, Seated>,
    /// Connections let go whose threads still run (answering what was sent before). Past
    /// [`MAX_CONNECTIONS`] of them, one more is cut outright, so that a client cannot keep
    /// threads running by having its connections let go.
    pub(super) leaving: usize,
}

impl Pool {
    /// Lets the connection `id` go to make room ([`Seated::let_go`]).
    fn let_go(&mut self, id: u64) {
        if let Some(seated) = self.seats.remove(&id) {
            self.leaving += 1;
            seated.let_go(self.leaving > MAX_CONNECTIONS);
        }
    }
}

/// A connection in the pool: a copy of its stream (to close it), and its mailbox once it
/// watches (to end its watch).
pub(super) struct Seated {
    pub(super) seat: Seat,
    pub(super) stream: UnixStream,
    pub(super) mailbox: Option<Arc<Mailbox>>,
}

impl Seated {
    /// Lets the connection go to make room. A watcher's watch is over and its connection
    /// closed. A connection of requests is shut for reading only: what its client sent before
    /// is still read and answered by its thread, which then sees the end and closes it; unless
    /// `cut`, when it is closed as a watcher is.
    fn let_go(self, cut: bool) {
        if let Some(mailbox) = &self.mailbox {
            mailbox.close();
        }
        let how = if cut || self.mailbox.is_some() {
            Shutdown::Both
        } else {
            Shutdown::Read
        };
        let _ = self.stream.shutdown(how);
    }
}

/// A connection's slot in the pool; given back when dropped.
pub(super) struct Slot {
    pub(super) pool: Arc<Mutex<Pool>>,
    pub(super) id: u64,
}

pub(super) fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slot {
    /// Marks the connection waiting for a request (`true`) or carrying one out. One let go
    /// to make room is no longer in the pool: its thread goes on until its reads end.
    pub(super) fn waiting(&self, waiting: bool) {
        let mut pool = lock(&self.pool);
        if let Some(seated) = pool.seats.get_mut(&self.id) {
            seated.seat.waiting_since = waiting.then(Instant::now);
        }
    }

    /// Makes the connection a watcher whose lines go through `mailbox`, if there is room (see
    /// [`watch_room`]); the refusal is one line.
    pub(super) fn watch(&self, mailbox: &Arc<Mailbox>) -> Result<(), String> {
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
                pool.let_go(id);
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
        let mut pool = lock(&self.pool);
        if pool.seats.remove(&self.id).is_none() {
            pool.leaving -= 1;
        }
    }
}

/// Seats a new connection, making room for it; `None` when there is none.
pub(super) fn seat(pool: &Arc<Mutex<Pool>>, stream: &UnixStream) -> Option<Slot> {
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
            guard.let_go(id);
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
