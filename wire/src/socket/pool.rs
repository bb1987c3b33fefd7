//! [`NodePool`]: a few connections to the node service, kept open and shared by the threads of
//! a process that asks many things at once (the DRA driver's prepares and unprepares, the
//! device plugin's allocations, the shim's attaches, holds and releases for a pod's
//! containers).
//!
//! The node socket serves a peer process at most 16 connections at once, and makes room for
//! its next by letting its oldest idle one go. A process that opened a connection per request
//! made a burst of them fail; through a pool it holds at most [`NodePool::size`] (fewer than
//! the socket's limit), and a request beyond them waits for one to be free.
//!
//! A connection that lay idle may have been let go by the service meanwhile (it closes one idle
//! for a minute, or one it made room with). Sending on it then fails before anything is
//! delivered ([`ClientError::NotSent`]), and the request is sent once more on a new connection;
//! connections idle for [`KEEP_IDLE`] are not reused at all. Any other failure closes the
//! connection and is returned: a request that may have been carried out is never sent twice.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{ClientError, NodeClient};

/// How many connections a pool holds by default: well under the node socket's 16 per process,
/// so that the process's other connections (a watch, a status) always have room.
pub const POOL_SIZE: usize = 4;

/// An idle connection older than this is closed rather than reused: the service lets one go
/// after a minute without a request.
pub const KEEP_IDLE: Duration = Duration::from_secs(20);

/// Connections to one node socket, shared by threads.
#[derive(Debug)]
pub struct NodePool {
    socket: PathBuf,
    size: usize,
    state: Mutex<Connections>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct Connections {
    /// Connections waiting to be used, with when each was last given back.
    idle: Vec<(NodeClient, Instant)>,
    /// Connections open, idle or in use.
    open: usize,
}

impl NodePool {
    /// A pool of at most `size` connections (at least one) to `socket`; none is opened yet.
    pub fn new(socket: impl Into<PathBuf>, size: usize) -> NodePool {
        NodePool {
            socket: socket.into(),
            size: size.max(1),
            state: Mutex::default(),
            freed: Condvar::new(),
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The most connections it holds at once.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs `ask`, which sends one request, on a connection of the pool: an idle one, a new
    /// one while fewer than [`NodePool::size`] are open, else the first given back. A reused
    /// connection the service had let go ([`ClientError::NotSent`]) is replaced by a new one
    /// and `ask` run again on it. The connection goes back to the pool after an answer (a
    /// refusal too); after any other error it is closed.
    pub fn ask<T>(
        &self,
        mut ask: impl FnMut(&mut NodeClient) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let (mut client, reused) = self.take()?;
        let mut result = ask(&mut client);
        if reused && matches!(result, Err(ClientError::NotSent { .. })) {
            drop(client);
            client = match NodeClient::connect(&self.socket) {
                Ok(client) => client,
                Err(e) => {
                    self.closed();
                    return Err(e);
                }
            };
            result = ask(&mut client);
        }
        match result {
            Ok(_) | Err(ClientError::Refused(_)) => self.give_back(client),
            Err(_) => self.closed(),
        }
        result
    }

    fn lock(&self) -> MutexGuard<'_, Connections> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection to use, and whether it was idle in the pool (rather than new).
    fn take(&self) -> Result<(NodeClient, bool), ClientError> {
        let mut state = self.lock();
        loop {
            while let Some((client, since)) = state.idle.pop() {
                if since.elapsed() < KEEP_IDLE {
                    return Ok((client, true));
                }
                state.open -= 1;
            }
            if state.open < self.size {
                state.open += 1;
                drop(state);
                return match NodeClient::connect(&self.socket) {
                    Ok(client) => Ok((client, false)),
                    Err(e) => {
                        self.closed();
                        Err(e)
                    }
                };
            }
            state = self.freed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn give_back(&self, client: NodeClient) {
        self.lock().idle.push((client, Instant::now()));
        self.freed.notify_one();
    }

    /// A connection taken from the pool was closed.
    fn closed(&self) {
        self.lock().open -= 1;
        self.freed.notify_one();
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
