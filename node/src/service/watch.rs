//! Watchers of the node's capacity (`{"op":"watch"}`): each GPU's size, room and health, and
//! the claims pinned now, sent to each watcher at once and again whenever it changes.
//!
//! The loop never waits for a watcher and never holds more than one line for one: it leaves
//! the latest line in the watcher's [`Mailbox`], replacing any the watcher's connection thread
//! has not written yet (each line is the whole view, so nothing is lost but stale views), and
//! that thread writes it. What changes the view is told by the loop's own events (a request
//! carried out, an exit, a lapse: `Service::forget`) and, for health, which is the state of
//! devices outside the service, looked at only while someone watches, at the one-second exit
//! sweep. Deciding what to send is pure ([`capacity_view`], [`news`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use gpuplex_scheduler::node::Node;
use gpuplex_wire::protocol::{CapacityView, GpuCapacity, Reply};

use super::socket::MAX_WATCHERS;
use super::Service;
use crate::gpus::{self, NodeGpu};

/// Where the loop leaves a watcher's next line and its connection thread takes it: at most one
/// line, the latest; posting never waits for the watcher.
#[derive(Debug, Default)]
pub struct Mailbox {
    letter: Mutex<Letter>,
    posted: Condvar,
}

/// A mailbox's content.
#[derive(Debug, Default)]
struct Letter {
    /// The line not written yet, newline included.
    line: Option<Arc<str>>,
    /// The watch is over: no line will come after `line`.
    closed: bool,
}

impl Mailbox {
    fn letter(&self) -> MutexGuard<'_, Letter> {
        self.letter.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leaves `line` for the watcher, in place of any it has not taken yet.
    pub fn post(&self, line: Arc<str>) {
        let mut letter = self.letter();
        if !letter.closed {
            letter.line = Some(line);
            self.posted.notify_all();
        }
    }

    /// Ends the watch: the line left, if any, is still taken, then nothing.
    pub fn close(&self) {
        self.letter().closed = true;
        self.posted.notify_all();
    }

    /// Whether the watch is over.
    pub fn is_closed(&self) -> bool {
        self.letter().closed
    }

    /// The next line, waiting as long as it takes; `None` once the watch is over and its last
    /// line taken.
    pub fn take(&self) -> Option<Arc<str>> {
        let mut letter = self.letter();
        loop {
            if let Some(line) = letter.line.take() {
                return Some(line);
            }
            if letter.closed {
                return None;
            }
            letter = self.posted.wait(letter).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The line left, without waiting.
    pub fn try_take(&self) -> Option<Arc<str>> {
        self.letter().line.take()
    }
}

/// The watchers, as the loop keeps them.
#[derive(Debug, Default)]
pub(super) struct Watchers {
    mailboxes: Vec<Arc<Mailbox>>,
    /// The view every watcher has been sent (`None`: no watcher yet, or none since the last
    /// went).
    sent: Option<CapacityView>,
    /// Each GPU's health when last looked at, in the order of the service's GPUs.
    pub(super) health: Vec<bool>,
    /// Something may have changed the view since it was last sent.
    pub(super) stale: bool,
}

impl Watchers {
    /// Whether anyone watches (those whose watch is over are let go first).
    pub(super) fn any(&mut self) -> bool {
        self.mailboxes.retain(|m| !m.is_closed());
        if self.mailboxes.is_empty() {
            self.sent = None;
        }
        !self.mailboxes.is_empty()
    }

    /// A new watcher, sent `view` at once (and the others too, when it is news to them).
    /// Refused over [`MAX_WATCHERS`] (the socket keeps them below it).
    pub(super) fn add(&mut self, mailbox: Arc<Mailbox>, view: CapacityView) -> Result<(), String> {
        self.any();
        if self.mailboxes.len() >= MAX_WATCHERS {
            return Err(format!(
                "{MAX_WATCHERS} connections watch the node already; close one first"
            ));
        }
        let line = line_of(&view);
        if self.sent.as_ref() != Some(&view) {
            self.post(&line);
        }
        mailbox.post(line);
        self.mailboxes.push(mailbox);
        self.sent = Some(view);
        Ok(())
    }

    /// Sends `view` to every watcher, when it is not the one they have.
    pub(super) fn publish(&mut self, view: CapacityView) {
        if !self.any() {
            return;
        }
        if let Some(line) = news(self.sent.as_ref(), &view) {
            self.post(&line);
            self.sent = Some(view);
        }
    }

    fn post(&self, line: &Arc<str>) {
        for mailbox in &self.mailboxes {
            mailbox.post(Arc::clone(line));
        }
    }

    /// How many watch now.
    #[cfg(test)]
    pub(super) fn mailboxes_open(&mut self) -> usize {
        self.any();
        self.mailboxes.len()
    }

    /// Ends every watch (the service is stopping).
    pub(super) fn close_all(&mut self) {
        for mailbox in self.mailboxes.drain(..) {
            mailbox.close();
        }
        self.sent = None;
    }
}

/// The line watchers that have been sent `sent` are sent for `view`: none when it is the same.
pub(super) fn news(sent: Option<&CapacityView>, view: &CapacityView) -> Option<Arc<str>> {
    (sent != Some(view)).then(|| line_of(view))
}

fn line_of(view: &CapacityView) -> Arc<str> {
    Reply::Capacity(Box::new(view.clone())).to_line().into()
}

/// The node's capacity as a watcher sees it: each GPU of the node's inventory with its memory,
/// capacity, unreserved memory, whether it is fake (`gpus`) and `healthy` (in the order of
/// `gpus`; a GPU not there is not healthy), and the claim keys of every vGPU pinned, sorted.
pub(super) fn capacity_view(node: &Node, gpus: &[NodeGpu], healthy: &[bool]) -> CapacityView {
    let inventory = node.inventory();
    let gpus = (inventory.gpus().iter())
        .map(|gpu| {
            let at = gpus.iter().position(|g| g.gpu.index == gpu.index);
            GpuCapacity {
                index: gpu.index.0,
                uuid: gpu.uuid.clone(),
                model: gpu.model.clone(),
                memory: gpu.memory,
                capacity: inventory.limit(gpu.index),
                unreserved: inventory.unreserved(gpu.index),
                healthy: at.and_then(|i| healthy.get(i)).copied().unwrap_or(false),
                fake: at.is_some_and(|i| gpus[i].fake),
            }
        })
        .collect();
    let mut claims: Vec<String> = node.records().filter_map(|r| r.claim.clone()).collect();
    claims.sort();
    claims.dedup();
    CapacityView { gpus, claims }
}

impl Service {
    /// Each GPU's health now (a `stat` of its device node, and NVML's word when it found it).
    fn gpu_health(&self) -> Vec<bool> {
        (self.gpus.iter())
            .map(|g| gpus::healthy(g, &self.source))
            .collect()
    }

    /// The capacity view now, each GPU's health looked at afresh: the answer to `watch`.
    pub(super) fn fresh_view(&mut self) -> CapacityView {
        self.watchers.health = self.gpu_health();
        capacity_view(self.registry.node(), &self.gpus, &self.watchers.health)
    }

    /// A connection subscribed: it is sent the view at once, and each change after; when there
    /// are too many watchers, a refusal, and its watch is over.
    pub(super) fn watch(&mut self, mailbox: Arc<Mailbox>) {
        let view = self.fresh_view();
        if let Err(why) = self.watchers.add(Arc::clone(&mailbox), view) {
            mailbox.post(Reply::refused(why).to_line().into());
            mailbox.close();
        }
    }

    /// Sends the watchers the view, when something may have changed it and did.
    pub(super) fn publish(&mut self) {
        if !std::mem::take(&mut self.watchers.stale) || !self.watchers.any() {
            return;
        }
        let view = capacity_view(self.registry.node(), &self.gpus, &self.watchers.health);
        self.watchers.publish(view);
    }

    /// While anyone watches, looks at each GPU's health again (at the exit sweep): a change is
    /// news.
    pub(super) fn watch_health(&mut self) {
        if !self.watchers.any() {
            return;
        }
        let health = self.gpu_health();
        if health != self.watchers.health {
            self.watchers.health = health;
            self.watchers.stale = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(unreserved: u64, claims: &[&str]) -> CapacityView {
        CapacityView {
            gpus: vec![GpuCapacity {
                index: 0,
                uuid: "GPU-a".into(),
                model: "m".into(),
                memory: 16,
                capacity: 16,
                unreserved,
                healthy: true,
                fake: false,
            }],
            claims: claims.iter().map(|c| c.to_string()).collect(),
        }
    }

    fn read(line: &str) -> CapacityView {
        let reply: Reply = serde_json::from_str(line).unwrap();
        reply.into_capacity().unwrap()
    }

    #[test]
    fn news_is_a_whole_view_line_and_only_when_the_view_changed() {
        let first = view(16, &[]);
        let line = news(None, &first).expect("a first view is news");
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        assert_eq!(read(&line), first);
        assert_eq!(news(Some(&first), &first.clone()), None);
        let reserved = view(8, &[]);
        assert_eq!(read(&news(Some(&first), &reserved).unwrap()), reserved);
        let pinned = view(16, &["units-gpu-0-0"]);
        assert_eq!(read(&news(Some(&first), &pinned).unwrap()), pinned);
        let mut sick = first.clone();
        sick.gpus[0].healthy = false;
        assert!(news(Some(&first), &sick).is_some());
    }

    #[test]
    fn a_mailbox_keeps_only_the_latest_line_and_posting_never_waits() {
        let mailbox = Mailbox::default();
        // Nobody takes: a thousand posts hold one line.
        for n in 0..1000 {
            mailbox.post(format!("{n}\n").into());
        }
        assert_eq!(mailbox.try_take().as_deref(), Some("999\n"));
        assert_eq!(mailbox.try_take(), None);
        // Closing lets the last line be taken, then nothing; nothing is posted after.
        mailbox.post("last\n".into());
        mailbox.close();
        mailbox.post("after\n".into());
        assert_eq!(mailbox.take().as_deref(), Some("last\n"));
        assert_eq!(mailbox.take(), None);
    }

    #[test]
    fn a_waiting_taker_wakes_for_a_post_and_for_the_end() {
        let mailbox = Arc::new(Mailbox::default());
        let taker = {
            let mailbox = Arc::clone(&mailbox);
            std::thread::spawn(move || (mailbox.take(), mailbox.take()))
        };
        mailbox.post("one\n".into());
        // The taker may or may not have taken "one" before this: either way it then ends.
        std::thread::sleep(std::time::Duration::from_millis(20));
        mailbox.close();
        let (first, second) = taker.join().unwrap();
        assert_eq!(first.as_deref(), Some("one\n"));
        assert_eq!(second, None);
    }

    #[test]
    fn watchers_get_a_view_at_once_then_only_news_and_are_let_go_when_closed() {
        let mut watchers = Watchers::default();
        let a = Arc::new(Mailbox::default());
        watchers.add(Arc::clone(&a), view(16, &[])).unwrap();
        assert_eq!(read(&a.try_take().unwrap()), view(16, &[]));
        watchers.publish(view(16, &[]));
        assert_eq!(a.try_take(), None, "nothing changed, nothing sent");
        // A second watcher gets the view at once; the first has it already.
        let b = Arc::new(Mailbox::default());
        watchers.add(Arc::clone(&b), view(16, &[])).unwrap();
        assert_eq!(read(&b.try_take().unwrap()), view(16, &[]));
        assert_eq!(a.try_take(), None);
        // A change reaches both; a watcher that does not take keeps only the latest.
        watchers.publish(view(8, &["c"]));
        watchers.publish(view(4, &["c", "d"]));
        assert_eq!(read(&a.try_take().unwrap()), view(4, &["c", "d"]));
        assert_eq!(read(&b.try_take().unwrap()), view(4, &["c", "d"]));
        // A closed watch is let go.
        a.close();
        assert!(watchers.any());
        assert_eq!(watchers.mailboxes.len(), 1);
        b.close();
        assert!(!watchers.any());
        // Caps: over MAX_WATCHERS a new one is refused.
        let open: Vec<Arc<Mailbox>> = (0..MAX_WATCHERS)
            .map(|_| Arc::new(Mailbox::default()))
            .collect();
        for m in &open {
            watchers.add(Arc::clone(m), view(1, &[])).unwrap();
        }
        let why = (watchers.add(Arc::new(Mailbox::default()), view(1, &[]))).unwrap_err();
        assert!(why.contains("watch the node already"), "{why}");
        watchers.close_all();
        assert!(open.iter().all(|m| m.is_closed()));
    }
}
