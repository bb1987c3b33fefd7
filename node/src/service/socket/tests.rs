use super::seats::*;
use super::*;
use std::io::BufRead;

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

/// Seats `n` connections of this process in `pool`, kept open (no thread serves them).
fn seat_many(pool: &Arc<Mutex<Pool>>, n: usize) -> Vec<(UnixStream, UnixStream, Slot)> {
    (0..n)
        .map(|_| {
            let (ours, theirs) = UnixStream::pair().unwrap();
            let slot = super::seat(pool, &ours).expect("room");
            (ours, theirs, slot)
        })
        .collect()
}

/// Answers the next request the connection hands the loop with `{"ok":true}`.
fn answer_next(inbox: &mpsc::Receiver<Event>) {
    match inbox.recv_timeout(Duration::from_secs(10)) {
        Ok(Event::Request(_, reply)) => reply.send(Reply::Done).unwrap(),
        _ => panic!("no request reached the loop"),
    }
}

#[test]
fn a_connection_let_go_to_make_room_still_answers_the_request_sent_before() {
    let pool = Arc::new(Mutex::new(Pool::default()));
    // The oldest connection of this process has sent a request its thread has not read yet.
    let (ours, mut client, slot) = seat_many(&pool, 1).pop().unwrap();
    client.write_all(b"{\"op\":\"status\"}\n").unwrap();
    // The process's next connections take its place.
    let _others = seat_many(&pool, MAX_PER_PEER);
    assert_eq!(lock(&pool).seats.len(), MAX_PER_PEER);
    assert_eq!(lock(&pool).leaving, 1);
    let (events, inbox) = mpsc::channel();
    let served = std::thread::spawn(move || serve_connection(ours, &events, &slot));
    answer_next(&inbox);
    let mut reply = String::new();
    std::io::BufReader::new(client.try_clone().unwrap())
        .read_line(&mut reply)
        .unwrap();
    assert_eq!(reply, "{\"ok\":true}\n");
    served.join().unwrap();
    assert_eq!(lock(&pool).leaving, 0);
    // Anything sent after it was let go is refused at once, before it is delivered.
    let err = client.write_all(b"{\"op\":\"status\"}\n").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
}

#[test]
fn past_max_connections_let_go_a_connection_is_cut_outright() {
    let pool = Arc::new(Mutex::new(Pool::default()));
    let (ours, mut client, slot) = seat_many(&pool, 1).pop().unwrap();
    client.write_all(b"{\"op\":\"status\"}\n").unwrap();
    lock(&pool).leaving = MAX_CONNECTIONS;
    let _others = seat_many(&pool, MAX_PER_PEER);
    let (events, inbox) = mpsc::channel();
    let served = std::thread::spawn(move || serve_connection(ours, &events, &slot));
    // Its thread may read the request, but cannot answer it.
    if let Ok(Event::Request(_, reply)) = inbox.recv_timeout(Duration::from_secs(1)) {
        let _ = reply.send(Reply::Done);
    }
    // A request that reaches the loop later is dropped with it: the thread is not left waiting.
    drop(inbox);
    served.join().unwrap();
    let mut reply = String::new();
    let read = std::io::BufReader::new(client).read_line(&mut reply);
    assert!(matches!(read, Ok(0) | Err(_)), "{reply}");
    assert_eq!(lock(&pool).leaving, MAX_CONNECTIONS);
}
