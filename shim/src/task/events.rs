//! Task events, published to containerd in the order they happen, off the request threads.
//!
//! Publishing survives containerd's restart, as containerd's runc shim's does: an event that
//! cannot be published is tried again on a new connection after 1, 2, 3, 4 and 5 s, then
//! dropped with a log line. Unlike the runc shim's, the events behind it wait: they leave in
//! the order they happened.

use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;

/// One event: its topic (`/tasks/exit`...) and the message.
type Event = (&'static str, Box<dyn MessageDyn>);

/// Why an event was not published (it is tried again, then dropped with a log line).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// containerd's events socket cannot be reached.
    #[error("cannot reach containerd at {address}: {source}")]
    Unreachable {
        /// `TTRPC_ADDRESS`.
        address: String,
        /// Why not.
        #[source]
        source: containerd_shim::Error,
    },
    /// containerd did not take the event.
    #[error(transparent)]
    Refused(#[from] containerd_shim::Error),
}

/// Where events go: containerd ([`Remote`]), or a channel in tests.
pub trait Publish: Send + 'static {
    /// Publishes one event under `namespace`.
    fn publish(
        &mut self,
        topic: &str,
        namespace: &str,
        event: &dyn MessageDyn,
    ) -> Result<(), PublishError>;
}

/// containerd's events service over its ttrpc socket, connected again after a failure.
pub struct Remote {
    address: String,
    client: Option<RemotePublisher>,
}

/// How long one publish may take.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

impl Remote {
    /// Publishes over `client` (already connected) to `address`.
    pub fn new(address: String, client: RemotePublisher) -> Remote {
        Remote {
            address,
            client: Some(client),
        }
    }
}

impl Publish for Remote {
    fn publish(
        &mut self,
        topic: &str,
        namespace: &str,
        event: &dyn MessageDyn,
    ) -> Result<(), PublishError> {
        let client = match self.client.take() {
            Some(client) => client,
            None => {
                RemotePublisher::new(&self.address).map_err(|source| PublishError::Unreachable {
                    address: self.address.clone(),
                    source,
                })?
            }
        };
        let ctx = Context {
            timeout_nano: PUBLISH_TIMEOUT.as_nanos() as i64,
            ..Context::default()
        };
        client.publish(ctx, topic, namespace, event.clone_box())?;
        // Kept only while it works: the next failure connects again.
        self.client = Some(client);
        Ok(())
    }
}

/// Where the service sends its events; a thread forwards them to containerd.
#[derive(Debug)]
pub struct EventSink {
    tx: Mutex<Sender<Event>>,
}

/// The waits before each new try of an event that could not be published.
pub const RETRY_AFTER: [Duration; 5] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(3),
    Duration::from_secs(4),
    Duration::from_secs(5),
];

impl EventSink {
    /// Forwards to `publisher` under `namespace`, in a thread of its own, trying an event
    /// again after each of `retry_after`.
    pub fn new(
        mut publisher: impl Publish,
        namespace: String,
        retry_after: &'static [Duration],
    ) -> EventSink {
        let (tx, rx) = channel::<Event>();
        std::thread::spawn(move || {
            for (topic, event) in rx {
                let mut waits = retry_after.iter();
                loop {
                    match publisher.publish(topic, &namespace, event.as_ref()) {
                        Ok(()) => break,
                        Err(e) => match waits.next() {
                            Some(wait) => {
                                tracing::warn!(
                                    "cannot publish {topic} ({e}); trying again in {wait:?}"
                                );
                                std::thread::sleep(*wait);
                            }
                            None => {
                                tracing::error!("dropped {topic}: {e}");
                                break;
                            }
                        },
                    }
                }
            }
        });
        EventSink { tx: Mutex::new(tx) }
    }

    /// Queues an event.
    pub fn send(&self, topic: &'static str, event: Box<dyn MessageDyn>) {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send((topic, event));
    }
}

/// A protobuf timestamp.
pub fn timestamp(at: SystemTime) -> Timestamp {
    let (seconds, nanos) = match at.duration_since(UNIX_EPOCH) {
        Ok(since) => (since.as_secs() as i64, since.subsec_nanos() as i32),
        // Before 1970 (Go's zero time, for a process that never ran).
        Err(before) => {
            let before = before.duration();
            let (secs, nanos) = (before.as_secs() as i64, before.subsec_nanos() as i32);
            if nanos == 0 {
                (-secs, 0)
            } else {
                (-secs - 1, 1_000_000_000 - nanos)
            }
        }
    };
    Timestamp {
        seconds,
        nanos,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim::protos::events::task::TaskExit;
    use std::sync::mpsc::Receiver;

    /// A containerd that is down for its first `down` tries, then takes everything.
    struct Flaky {
        down: usize,
        took: Sender<String>,
    }

    impl Publish for Flaky {
        fn publish(
            &mut self,
            topic: &str,
            _: &str,
            event: &dyn MessageDyn,
        ) -> Result<(), PublishError> {
            if self.down > 0 {
                self.down -= 1;
                return Err(PublishError::Unreachable {
                    address: "/run/containerd/containerd.sock.ttrpc".into(),
                    source: containerd_shim::Error::Other("connection refused".into()),
                });
            }
            let exit = event.downcast_ref::<TaskExit>().map(|e| e.id.clone());
            let _ = self
                .took
                .send(format!("{topic} {}", exit.unwrap_or_default()));
            Ok(())
        }
    }

    const QUICK: [Duration; 3] = [Duration::from_millis(1); 3];

    fn exit(id: &str) -> Box<dyn MessageDyn> {
        Box::new(TaskExit {
            id: id.into(),
            ..Default::default()
        })
    }

    fn sink(down: usize) -> (EventSink, Receiver<String>) {
        let (took, rx) = channel();
        let sink = EventSink::new(Flaky { down, took }, "default".into(), &QUICK);
        (sink, rx)
    }

    #[test]
    fn events_outlive_a_restart_of_containerd_and_keep_their_order() {
        let (sink, took) = sink(2);
        for id in ["a", "b", "c"] {
            sink.send("/tasks/exit", exit(id));
        }
        let got: Vec<String> = (0..3).map(|_| took.recv().unwrap()).collect();
        assert_eq!(got, ["/tasks/exit a", "/tasks/exit b", "/tasks/exit c"]);
    }

    #[test]
    fn an_event_containerd_never_takes_is_dropped_and_the_next_goes() {
        let (sink, took) = sink(4);
        sink.send("/tasks/exit", exit("lost"));
        sink.send("/tasks/exit", exit("kept"));
        assert_eq!(took.recv().unwrap(), "/tasks/exit kept");
    }

    #[test]
    fn go_zero_time_is_year_one() {
        let at = super::super::process::go_zero_time();
        assert_eq!(timestamp(at).seconds, -62_135_596_800);
        assert_eq!(timestamp(at).nanos, 0);
        let just_before = UNIX_EPOCH - Duration::from_millis(1500);
        let t = timestamp(just_before);
        assert_eq!((t.seconds, t.nanos), (-2, 500_000_000));
    }
}
