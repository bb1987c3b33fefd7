use super::*;
use gpuplex_scheduler::node::ReleaseKey;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

/// What the test's service saw.
#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    open: AtomicUsize,
    most_open: AtomicUsize,
    requests: AtomicUsize,
}

/// How the test's service answers a request line on a connection.
#[derive(Clone, Copy)]
enum Answer {
    /// `{"ok":true}`.
    Done,
    /// A refusal.
    Refuse,
    /// Closes the connection without a reply.
    Hang,
    /// Answers, then closes the connection (as the node service lets an idle one go).
    DoneThenClose,
}

/// A service on a socket in `dir` answering every line of every connection with `answer`.
fn serve(dir: &Path, answer: Answer) -> (PathBuf, Arc<Seen>) {
    let path = dir.join("node.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let seen = Arc::new(Seen::default());
    let counts = Arc::clone(&seen);
    thread::spawn(move || {
        for stream in listener.incoming() {
            let stream = stream.unwrap();
            let seen = Arc::clone(&counts);
            seen.connections.fetch_add(1, Ordering::SeqCst);
            let open = seen.open.fetch_add(1, Ordering::SeqCst) + 1;
            seen.most_open.fetch_max(open, Ordering::SeqCst);
            thread::spawn(move || {
                connection(stream, answer, &seen);
                seen.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (path, seen)
}

fn connection(stream: UnixStream, answer: Answer, seen: &Seen) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        seen.requests.fetch_add(1, Ordering::SeqCst);
        // A moment in the loop, so that the burst overlaps.
        thread::sleep(Duration::from_millis(2));
        let reply: &[u8] = match answer {
            Answer::Done | Answer::DoneThenClose => b"{\"ok\":true}\n",
            Answer::Refuse => b"{\"ok\":false,\"error\":\"no such claim\"}\n",
            Answer::Hang => return,
        };
        if writer.write_all(reply).is_err() {
            return;
        }
        if matches!(answer, Answer::DoneThenClose) {
            return;
        }
    }
}

fn release(pool: &NodePool, uid: &str) -> Result<(), ClientError> {
    pool.ask(|c| c.release(&ReleaseKey::Claim(uid.into())))
        .map(drop)
}

#[test]
fn a_burst_from_many_threads_is_answered_over_at_most_size_connections() {
    let dir = tempfile::tempdir().unwrap();
    let (path, seen) = serve(dir.path(), Answer::Done);
    let pool = Arc::new(NodePool::new(&path, POOL_SIZE));
    let threads: Vec<_> = (0..200)
        .map(|i| {
            let pool = Arc::clone(&pool);
            thread::spawn(move || release(&pool, &format!("claim-{i}")))
        })
        .collect();
    for thread in threads {
        thread.join().unwrap().unwrap();
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 200);
    assert!(seen.most_open.load(Ordering::SeqCst) <= POOL_SIZE);
    assert!(seen.connections.load(Ordering::SeqCst) <= POOL_SIZE);
}

#[test]
fn a_connection_the_service_let_go_is_replaced_and_the_request_sent_once() {
    let dir = tempfile::tempdir().unwrap();
    let (path, seen) = serve(dir.path(), Answer::DoneThenClose);
    let pool = NodePool::new(&path, 1);
    release(&pool, "a").unwrap();
    // The service has closed it by now: the next request finds it closed before sending.
    assert!(
        (0..5000).any(|_| {
            thread::sleep(Duration::from_millis(2));
            seen.open.load(Ordering::SeqCst) == 0
        }),
        "the test's service did not close the connection"
    );
    release(&pool, "b").unwrap();
    assert_eq!(seen.requests.load(Ordering::SeqCst), 2);
    assert_eq!(seen.connections.load(Ordering::SeqCst), 2);
}

#[test]
fn a_refusal_keeps_the_connection_and_says_the_services_line() {
    let dir = tempfile::tempdir().unwrap();
    let (path, seen) = serve(dir.path(), Answer::Refuse);
    let pool = NodePool::new(&path, 2);
    for _ in 0..3 {
        let err = release(&pool, "a").unwrap_err();
        assert_eq!(err.to_string(), "no such claim");
    }
    assert_eq!(seen.connections.load(Ordering::SeqCst), 1);
}

#[test]
fn a_request_left_unanswered_is_never_sent_again() {
    let dir = tempfile::tempdir().unwrap();
    let (path, seen) = serve(dir.path(), Answer::Hang);
    let pool = NodePool::new(&path, 1);
    let err = release(&pool, "a").unwrap_err();
    assert!(matches!(err, ClientError::Closed { .. }), "{err}");
    assert_eq!(seen.requests.load(Ordering::SeqCst), 1);
    // The pool's one connection was closed, not lost: the next request gets a new one.
    let _ = release(&pool, "b");
    assert_eq!(seen.connections.load(Ordering::SeqCst), 2);
}

#[test]
fn a_service_that_is_not_there_is_said_as_such_and_frees_the_place() {
    let dir = tempfile::tempdir().unwrap();
    let pool = NodePool::new(dir.path().join("absent.sock"), 1);
    for _ in 0..2 {
        let err = release(&pool, "a").unwrap_err();
        assert!(matches!(err, ClientError::Connect { .. }), "{err}");
    }
}
