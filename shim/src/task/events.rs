//! Task events, published to containerd in the order they happen, off the request threads.

use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;

/// One event: its topic (`/tasks/exit`...) and the message.
type Event = (&'static str, Box<dyn MessageDyn>);

/// Where the service sends its events; a thread forwards them to containerd.
#[derive(Debug)]
pub struct EventSink {
    tx: Mutex<Sender<Event>>,
}

impl EventSink {
    /// Forwards to `publisher` under `namespace`, in a thread of its own.
    pub fn new(publisher: RemotePublisher, namespace: String) -> EventSink {
        let (tx, rx) = channel::<Event>();
        std::thread::spawn(move || {
            for (topic, event) in rx {
                if let Err(e) = publisher.publish(Context::default(), topic, &namespace, event) {
                    log::warn!("cannot publish {topic}: {e}");
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
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: since.as_secs() as i64,
        nanos: since.subsec_nanos() as i32,
        ..Default::default()
    }
}
