//! Confirmed publishing in a cluster: one task per queue (a *router*) sends each message to the
//! leader of its partition and keeps each partition's messages in order, through redirects,
//! backoffs and resends.
//!
//! Owns the per-partition *lanes* and their rules. The partition of a message is computed as the
//! broker computes it (`partitioning.rs`) from the queue's layout, asked once per router with
//! `QueueInfo` (or `StreamInfo`); a message whose partition the broker chooses (no routing key,
//! no producer mark) goes to each partition's lane in turn (its leader stores it in a partition
//! it leads); every message while the layout is not known goes to the lane of unknown
//! partition, which learns its node from the 421s. Connections are the client's, one
//! per node, shared by every partition it leads (`routing.rs`). What is not cluster-specific
//! (numbering, the frame limit, the answers of one connection) stays in `publisher.rs` and
//! `connection.rs`.
//!
//! # A lane
//! A lane sends its messages to one node, in the order they were submitted, without waiting
//! for answers (pipelined). A message refused with 421 (not the leader), 429 (limited; retry
//! after the hint), or whose outcome is unknown (504, the connection lost after sending; an
//! idempotent producer's only, which the partition stores once) or which was never written (the
//! connection was gone) is *not* sent again at once: the lane stops sending and waits until
//! every message it sent before has its answer, then sends the refused ones again, in their
//! original order, before anything submitted later. So within a partition no message overtakes
//! an earlier one that was refused. The wait before sending again: none after a 421 that names
//! a leader following a success; otherwise the 421 backoff of `routing.rs` (100 ms, 200 ms,
//! then 250 ms, at least the node's hint) for every later refusal in a row; the broker's hint
//! after a 429. A 421 naming a leader sets the lane's node; without one, or after a lost
//! connection, the lane asks the cluster's nodes in turn (never the one that just failed),
//! which answer with the leader they know. Each message keeps its deadline
//! (`publish_timeout` from its submission) and fails past it, and past
//! [`crate::NOT_LEADER_RETRIES_MAX`] redirects: with [`ClientError::NotLeader`] after 421s,
//! [`ClientError::Limited`] after 429s, its unknown outcome once it had one.
//!
//! What the order cannot cover: messages already in flight at a node that starts leading in
//! the middle of them (an election completing between two of them) are stored as that node
//! answers them; the lane sends the refused ones again after them.
//!
//! # Bounds
//! A router ends after [`ROUTER_IDLE`] without work (the next publish to its queue starts a new
//! one); its submission channel holds [`SUBMISSIONS_MAX`] submissions; its lanes are one per
//! partition plus one; the messages it holds are those the application's publish calls wait
//! for, so the application's concurrency bounds them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use keratin_proto::codes::{ERR_GATEWAY_TIMEOUT, ERR_LIMITED, ERR_NOT_FOUND, ERR_NOT_LEADER};
use keratin_proto::{ErrorBody, PROTOCOL_VERSION_STREAMS};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::client::{Client, WeakClient};
use crate::connection::{duration_ms, PublishOutcome};
use crate::error::{ClientError, PublishFailed};
use crate::partitioning::{partition_of, Layout};
use crate::publisher::{retry_delay, Confirmed, OutgoingMessage, ATTEMPT_ANSWER_GRACE};
use crate::routing::{not_leader_backoff, NOT_LEADER_RETRIES_MAX};

/// A router with no message to send or answer for this long ends (and leaves the client's
/// map); the next publish to its queue starts another, which asks for the layout again.
pub(crate) const ROUTER_IDLE: Duration = Duration::from_secs(30);
/// Submissions waiting for a router: each publish call submits one (a batch one per call), so
/// 1,024 cover as many single publishes in flight as a connection's command channel holds
/// (`connection.rs` `COMMAND_QUEUE_MAX`); past it, publish calls wait (backpressure).
pub(crate) const SUBMISSIONS_MAX: usize = 1024;
/// The longest a router holds its first messages back while it asks for the queue's layout:
/// a node answers `QueueInfo` from memory in well under a millisecond, so 2 s means it cannot
/// now, and the messages go out without it (to the lane of unknown partition).
const LAYOUT_WAIT_MAX: Duration = Duration::from_secs(2);
/// After asking for the layout failed, the next ask comes this much later.
const LAYOUT_RETRY: Duration = Duration::from_secs(5);
/// Answers or submissions taken in one turn of a router before it sends: as many as a
/// connection joins into one frame (`connection.rs` `COALESCED_PUBLISH_MESSAGES_MAX`), so a
/// frame's confirms are handled together and the next sends go out together.
const TURN_MAX: usize = 256;

/// The routers of one client, by queue, each with the id of the task behind it (a router that
/// ends removes its own entry only).
#[derive(Default)]
pub(crate) struct Routers {
    senders: std::sync::Mutex<HashMap<String, (u64, mpsc::Sender<Submission>)>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Messages of one publish call for one queue.
pub(crate) struct Submission {
    pub(crate) items: Vec<Pending>,
    /// Separate publishes the connection may join with others into a frame (a batch is not).
    pub(crate) joinable: bool,
}

/// A message that waits for its outcome, and where that outcome goes. One that is let go
/// without an answer (a router that stopped) answers as it is dropped: never lost silently.
pub(crate) struct Pending {
    message: OutgoingMessage,
    reply: Option<oneshot::Sender<Result<Confirmed, PublishFailed>>>,
    started: Instant,
    deadline: Instant,
    /// Times handed to a connection.
    attempts: u32,
    /// 421s followed and sends after an unknown outcome or a lost connection.
    redirects: u32,
    /// The error of the last attempt whose outcome was unknown: once set, the message may be
    /// stored, so it fails with this error whatever happens later.
    unknown: Option<ClientError>,
    /// The last refusal (421 or 429), for the error when the deadline passes.
    refusal: Option<ErrorBody>,
}

impl Pending {
    /// A message to publish within `deadline`, `attempts` already made (one by the direct
    /// path of `publisher.rs` before it handed the message over), `unknown` if one of them had
    /// an unknown outcome.
    pub(crate) fn new(
        message: OutgoingMessage,
        deadline: Instant,
        attempts: u32,
        unknown: Option<ClientError>,
        refusal: Option<ErrorBody>,
    ) -> (Pending, oneshot::Receiver<Result<Confirmed, PublishFailed>>) {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            message,
            reply: Some(reply),
            started: Instant::now(),
            deadline,
            attempts,
            redirects: u32::from(attempts > 0),
            unknown,
            refusal,
        };
        (pending, answer)
    }

    fn answer(mut self, result: Result<Confirmed, ClientError>) {
        let Some(reply) = self.reply.take() else {
            return;
        };
        let message = std::mem::take(&mut self.message);
        let result = result.map_err(|error| PublishFailed {
            message,
            error: self.unknown.take().unwrap_or(error),
        });
        let _ = reply.send(result);
    }

    /// The error of a message whose deadline passed while it waited to be sent (again).
    fn expired(&self, queue: &str, timeout: Duration) -> ClientError {
        let timeout_ms = duration_ms(timeout);
        match &self.refusal {
            Some(body) if body.code() == ERR_LIMITED => {
                let mut error = ClientError::from_body(body.clone());
                if let ClientError::Limited {
                    timed_out,
                    timeout_ms: limit_timeout_ms,
                    ..
                } = &mut error
                {
                    *timed_out = true;
                    *limit_timeout_ms = timeout_ms;
                }
                error
            }
            Some(body) => ClientError::NotLeader {
                operation: format!("publish to {queue}"),
                attempts: self.redirects,
                elapsed_ms: duration_ms(self.started.elapsed()),
                last: Box::new(body.clone()),
            },
            None => ClientError::Timeout {
                operation: format!("publish to {queue}"),
                timeout_ms,
            },
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let detail = "the client's publish router stopped before the message was answered";
            let error = match self.unknown.take() {
                Some(error) => error,
                None if self.attempts > 0 => ClientError::OutcomeUnknown {
                    error: None,
                    detail: detail.into(),
                },
                None => ClientError::ConnectionLost {
                    detail: detail.into(),
                },
            };
            let message = std::mem::take(&mut self.message);
            let _ = reply.send(Err(PublishFailed { message, error }));
        }
    }
}

impl Client {
    /// Hands `submission` to the router of `queue`, starting one if there is none (or the one
    /// there just ended).
    pub(crate) async fn submit(&self, queue: &str, mut submission: Submission) {
        // Two rounds at most: a router that ended between the lookup and the send drops out of
        // the map, and the second round starts a new one.
        for _ in 0..2 {
            let (id, sender) = self.router_for(queue);
            // Without waiting while there is room: a publish's order is the order in which the
            // application's calls were first polled, and `send` can yield to the runtime's
            // budget even with room, letting later calls overtake (seen: a key's message 127
            // stored after 999).
            let refused = match sender.try_send(submission) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full(back)) => match sender.send(back).await {
                    Ok(()) => return,
                    Err(mpsc::error::SendError(back)) => back,
                },
                Err(mpsc::error::TrySendError::Closed(back)) => back,
            };
            submission = refused;
            self.routers().forget(queue, id);
        }
        // Dropping the pending messages answers each of them (`Pending`'s drop).
        drop(submission);
    }

    fn router_for(&self, queue: &str) -> (u64, mpsc::Sender<Submission>) {
        let routers = self.routers();
        let mut senders = routers
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((id, sender)) = senders.get(queue) {
            if !sender.is_closed() {
                return (*id, sender.clone());
            }
        }
        let id = routers
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (sender, submissions) = mpsc::channel(SUBMISSIONS_MAX);
        senders.insert(queue.to_owned(), (id, sender.clone()));
        let router = Router::new(self, queue, id, submissions);
        tokio::spawn(router.run());
        (id, sender)
    }
}

impl Routers {
    /// Removes the router `id` of `queue`, if it is still the one registered.
    fn forget(&self, queue: &str, id: u64) {
        let mut senders = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if senders
            .get(queue)
            .is_some_and(|(current, _)| *current == id)
        {
            senders.remove(queue);
        }
    }
}

/// Where a lane sends: the client's own connection (when the handshake named no address for
/// it), or the node at a protocol address.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NodeRef {
    Base,
    At(String),
}

/// A lane's key: the partition, `None` for messages whose partition the client does not know.
type LaneKey = Option<u32>;

/// Messages sent, or to send, in one frame (a batch's share of one partition, or one publish).
struct Unit {
    items: Vec<Pending>,
    joinable: bool,
}

/// A unit handed to a connection, waiting for its answers.
struct SentUnit {
    items: Vec<Option<Pending>>,
    left: usize,
    node: NodeRef,
    joinable: bool,
}

/// Why a sent message is to be sent again.
enum Refusal {
    NotLeader(ErrorBody),
    Limited(ErrorBody),
    /// Outcome unknown (504, the connection lost after sending): the node is not asked again
    /// first when the connection was lost (`lost`).
    Unknown {
        lost: bool,
        error: ClientError,
    },
    /// Never written: the connection was gone.
    NotSent,
}

/// One partition's messages (see the module docs).
#[derive(Default)]
struct Lane {
    /// The node to send to; `None`: ask the cluster's nodes in turn.
    leader: Option<NodeRef>,
    /// Not to be asked first when the leader is unknown: its connection just failed.
    avoid: Option<NodeRef>,
    /// In order: refused messages to send again first, then those not sent yet.
    waiting: VecDeque<Unit>,
    /// Sent and not fully answered, by ticket (send order).
    sent: BTreeMap<u64, SentUnit>,
    /// Refused since the last release, by (ticket, index): sent again, in this order, once
    /// `sent` is empty.
    refused: BTreeMap<(u64, usize), (Pending, bool, Refusal)>,
    /// Nothing is sent before this.
    hold_until: Option<Instant>,
    /// Releases after 421s or lost outcomes since the last confirm: the backoff's step.
    streak: u32,
}

impl Lane {
    fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.sent.is_empty() && self.refused.is_empty()
    }

    /// The earliest time this lane needs the router to wake: when its hold ends, or when the
    /// first waiting message's deadline passes.
    fn wake(&self) -> Option<Instant> {
        if !self.refused.is_empty() {
            return None;
        }
        let first = self.waiting.front()?;
        let deadline = first.items.iter().map(|item| item.deadline).min();
        match (self.hold_until, deadline) {
            (Some(hold), Some(deadline)) => Some(hold.min(deadline)),
            (hold, deadline) => hold.or(deadline),
        }
    }
}

/// What the router knows of the queue's partitions.
enum LayoutState {
    /// Asked: submissions are parked until the answer (at most [`LAYOUT_WAIT_MAX`]).
    Asking,
    Known(Layout),
    /// Asking failed: messages go to the lane of unknown partition; asked again at `retry_at`.
    Unknown {
        retry_at: Instant,
    },
}

/// One message's answer from its connection.
struct Answer {
    key: LaneKey,
    ticket: u64,
    index: usize,
    publish_id: u64,
    /// `None`: no answer before the answer deadline.
    outcome: Option<PublishOutcome>,
}

type BoxedFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

struct Router {
    client: WeakClient,
    queue: String,
    id: u64,
    producer_id: Option<u64>,
    publish_timeout: Duration,
    submissions: mpsc::Receiver<Submission>,
    layout: LayoutState,
    fetch: Option<BoxedFuture<Result<Layout, ClientError>>>,
    /// Submissions that came while the layout was asked for.
    parked: Vec<Submission>,
    /// While set, every message goes to the lane of unknown partition, until it is empty: it
    /// still holds messages submitted before the layout was known, which later ones of the
    /// same partition must not overtake.
    drain_unknown: bool,
    lanes: BTreeMap<LaneKey, Lane>,
    answers: FuturesUnordered<BoxedFuture<Answer>>,
    next_ticket: u64,
    /// Turns of asking the cluster's nodes when a lane knows no leader.
    turn: usize,
    /// Messages without key or producer mark spread over the partitions' lanes so far.
    spread: u64,
}

impl Router {
    fn new(
        client: &Client,
        queue: &str,
        id: u64,
        submissions: mpsc::Receiver<Submission>,
    ) -> Router {
        let options = client.options();
        let mut router = Router {
            client: client.downgrade(),
            queue: queue.to_owned(),
            id,
            producer_id: options.producer_id.filter(|_| options.idempotent),
            publish_timeout: options.publish_timeout,
            submissions,
            layout: LayoutState::Asking,
            fetch: None,
            parked: Vec::new(),
            drain_unknown: false,
            lanes: BTreeMap::new(),
            answers: FuturesUnordered::new(),
            next_ticket: 0,
            turn: 0,
            spread: 0,
        };
        router.start_fetch(client);
        router
    }

    async fn run(mut self) {
        let mut open = true;
        let mut idle_since = Instant::now();
        loop {
            let wake = self.wake();
            let idle = open && self.is_idle();
            tokio::select! {
                biased;
                Some(answer) = self.answers.next(), if !self.answers.is_empty() => {
                    self.answered(answer);
                    // The answers already in take one turn: one frame's confirms arrive together.
                    for _ in 0..TURN_MAX {
                        match self.answers.next().now_or_never() {
                            Some(Some(answer)) => self.answered(answer),
                            _ => break,
                        }
                    }
                }
                layout = poll_fetch(&mut self.fetch), if self.fetch.is_some() => {
                    self.fetch = None;
                    self.layout_answered(layout);
                }
                submission = self.submissions.recv(), if open => match submission {
                    Some(submission) => {
                        self.submitted(submission);
                        for _ in 0..TURN_MAX {
                            match self.submissions.try_recv() {
                                Ok(submission) => self.submitted(submission),
                                Err(_) => break,
                            }
                        }
                    }
                    None => open = false,
                },
                () = sleep_until_some(wake) => {}
                () = tokio::time::sleep_until(idle_since + ROUTER_IDLE), if idle => {
                    // New publishes start another router; those already sent here are taken
                    // from the closed channel below.
                    if let Some(client) = self.client.upgrade() {
                        client.routers().forget(&self.queue, self.id);
                    }
                    self.submissions.close();
                }
            }
            self.pump().await;
            if !self.is_idle() {
                idle_since = Instant::now();
            } else if !open {
                return;
            }
        }
    }

    fn is_idle(&self) -> bool {
        self.parked.is_empty() && self.lanes.values().all(Lane::is_empty)
    }

    fn wake(&self) -> Option<Instant> {
        let lanes = self.lanes.values().filter_map(Lane::wake).min();
        let layout = match (&self.layout, self.fetch.is_some(), self.is_idle()) {
            (LayoutState::Unknown { retry_at }, false, false) => Some(*retry_at),
            _ => None,
        };
        match (lanes, layout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn start_fetch(&mut self, client: &Client) {
        let timeout = client.options().request_timeout.min(LAYOUT_WAIT_MAX);
        self.fetch = Some(Box::pin(fetch_layout(
            client.clone(),
            self.queue.clone(),
            timeout,
        )));
    }

    fn layout_answered(&mut self, layout: Result<Layout, ClientError>) {
        let was_asking = matches!(self.layout, LayoutState::Asking);
        match layout {
            Ok(layout) => {
                tracing::debug!(queue = %self.queue, leaders = ?layout.leaders, "queue layout");
                if !was_asking && self.lanes.get(&None).is_some_and(|lane| !lane.is_empty()) {
                    self.drain_unknown = true;
                }
                self.layout = LayoutState::Known(layout);
            }
            Err(error) => {
                tracing::debug!(queue = %self.queue, %error, "the queue's layout is not known; publishing without it");
                self.layout = LayoutState::Unknown {
                    retry_at: Instant::now() + LAYOUT_RETRY,
                };
            }
        }
        for submission in std::mem::take(&mut self.parked) {
            self.dispatch(submission);
        }
    }

    fn submitted(&mut self, submission: Submission) {
        if matches!(self.layout, LayoutState::Asking) {
            self.parked.push(submission);
        } else {
            self.dispatch(submission);
        }
    }

    /// The lane of `message`: its partition's; a message whose partition the broker chooses
    /// (no routing key, no producer mark) goes to the partitions' lanes in turn, so that one
    /// publisher's messages reach every partition's leader, each of which stores it in a
    /// partition it leads (Kafka's producer spreads keyless records over partitions too).
    fn key_of(&mut self, message: &OutgoingMessage) -> LaneKey {
        match &self.layout {
            LayoutState::Known(layout) if !self.drain_unknown => {
                let partitions = layout.partitions();
                partition_of(message, self.producer_id, partitions).or_else(|| {
                    let turn = self.spread;
                    self.spread = self.spread.wrapping_add(1);
                    u32::try_from(turn % u64::from(partitions.max(1))).ok()
                })
            }
            _ => None,
        }
    }

    /// Splits a submission by lane, keeping the order of its messages within each.
    fn dispatch(&mut self, submission: Submission) {
        let mut units: Vec<(LaneKey, Unit)> = Vec::new();
        for item in submission.items {
            let key = self.key_of(&item.message);
            match units.iter_mut().find(|(k, _)| *k == key) {
                Some((_, unit)) => unit.items.push(item),
                None => units.push((
                    key,
                    Unit {
                        items: vec![item],
                        joinable: submission.joinable,
                    },
                )),
            }
        }
        for (key, unit) in units {
            // A message handed over after a 421 brings the leader that 421 named.
            let named = unit
                .items
                .iter()
                .find_map(|item| item.refusal.as_ref()?.leader_addr().map(str::to_owned));
            let lane = self.lane(key);
            if lane.leader.is_none() {
                lane.leader = named.map(NodeRef::At);
            }
            lane.waiting.push_back(unit);
        }
    }

    /// The lane `key`, made with the leader the layout names for it.
    fn lane(&mut self, key: LaneKey) -> &mut Lane {
        let leader = match (&self.layout, key) {
            (LayoutState::Known(layout), Some(partition)) => layout
                .leaders
                .get(usize::try_from(partition).unwrap_or(usize::MAX))
                .cloned()
                .flatten()
                .map(NodeRef::At),
            _ => None,
        };
        self.lanes.entry(key).or_insert_with(|| Lane {
            leader,
            ..Lane::default()
        })
    }

    /// Sends what every lane may send now.
    async fn pump(&mut self) {
        if let LayoutState::Unknown { retry_at } = self.layout {
            if self.fetch.is_none() && !self.is_idle() && Instant::now() >= retry_at {
                if let Some(client) = self.client.upgrade() {
                    self.start_fetch(&client);
                }
            }
        }
        if self.drain_unknown && self.lanes.get(&None).is_none_or(Lane::is_empty) {
            self.drain_unknown = false;
        }
        let keys: Vec<LaneKey> = self.lanes.keys().copied().collect();
        for key in keys {
            self.pump_lane(key).await;
        }
    }

    async fn pump_lane(&mut self, key: LaneKey) {
        loop {
            let now = Instant::now();
            let queue = self.queue.clone();
            let timeout = self.publish_timeout;
            let Some(lane) = self.lanes.get_mut(&key) else {
                return;
            };
            if !lane.refused.is_empty() {
                return;
            }
            // Messages whose deadline passed fail here, before any hold is honoured.
            while let Some(unit) = lane.waiting.front_mut() {
                let (expired, live): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut unit.items)
                    .into_iter()
                    .partition(|item| item.deadline <= now);
                unit.items = live;
                for item in expired {
                    let error = item.expired(&queue, timeout);
                    item.answer(Err(error));
                }
                if unit.items.is_empty() {
                    lane.waiting.pop_front();
                } else {
                    break;
                }
            }
            if lane.waiting.is_empty() || lane.hold_until.is_some_and(|hold| hold > now) {
                return;
            }
            lane.hold_until = None;
            let target = self.target(key);
            // A lane's messages in flight are at one node at a time: without a known leader
            // the target turns from node to node, and a node that starts leading (or learns
            // the leader) in the middle would store later messages before an earlier one
            // another node refused. Messages the broker places itself may go anywhere.
            let ordered = key.is_some()
                || self.drain_unknown
                || !matches!(self.layout, LayoutState::Known(_));
            if ordered
                && self
                    .lanes
                    .get(&key)
                    .is_some_and(|lane| lane.sent.values().any(|sent| sent.node != target))
            {
                return;
            }
            let Some(client) = self.client.upgrade() else {
                // Every handle of the client is gone; nothing can be sent. The pending
                // messages answer as they are dropped.
                if let Some(lane) = self.lanes.get_mut(&key) {
                    lane.waiting.clear();
                }
                return;
            };
            let connection = match &target {
                NodeRef::Base if client.is_connected() => Ok(client.clone()),
                NodeRef::Base => Err(client.lost_error()),
                NodeRef::At(addr) => client.node(Some(addr)).await,
            };
            let Some(lane) = self.lanes.get_mut(&key) else {
                return;
            };
            match connection {
                Ok(node) => {
                    let Some(unit) = lane.waiting.pop_front() else {
                        return;
                    };
                    self.send_unit(key, unit, target, &node).await;
                }
                Err(error) => {
                    tracing::debug!(queue = %self.queue, ?target, %error, "cannot reach the node; asking another");
                    lane.leader = None;
                    lane.avoid = Some(target);
                    lane.streak = lane.streak.saturating_add(1);
                    lane.hold_until = Some(now + not_leader_backoff(lane.streak, None));
                }
            }
        }
    }

    /// Where lane `key` sends next: its leader, else for the lane of unknown partition a
    /// leader the layout names, else the cluster's nodes in turn (not the one to avoid).
    fn target(&mut self, key: LaneKey) -> NodeRef {
        if let Some(leader) = self.lanes.get(&key).and_then(|lane| lane.leader.clone()) {
            return leader;
        }
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        if key.is_none() {
            if let LayoutState::Known(layout) = &self.layout {
                let known: Vec<&String> = layout.leaders.iter().flatten().collect();
                if !known.is_empty() {
                    return NodeRef::At(known[turn % known.len()].clone());
                }
            }
        }
        let avoid = self.lanes.get(&key).and_then(|lane| lane.avoid.clone());
        let Some(client) = self.client.upgrade() else {
            return NodeRef::Base;
        };
        // This client's node first (the node it was given), then the others in turn.
        let own = client
            .own_address()
            .map(|addr| NodeRef::At(addr.to_owned()));
        let candidates: Vec<NodeRef> = own
            .iter()
            .cloned()
            .chain(
                client
                    .server_info()
                    .nodes
                    .iter()
                    .map(|node| NodeRef::At(node.server.clone()))
                    .filter(|node| Some(node) != own.as_ref()),
            )
            .filter(|node| Some(node) != avoid.as_ref())
            .collect();
        if candidates.is_empty() {
            return NodeRef::Base;
        }
        candidates[turn % candidates.len()].clone()
    }

    async fn send_unit(&mut self, key: LaneKey, mut unit: Unit, target: NodeRef, node: &Client) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let now = Instant::now();
        for item in &mut unit.items {
            item.attempts += 1;
        }
        let waits = node
            .publish_send_messages(
                &self.queue,
                unit.items.iter().map(|item| &item.message),
                unit.joinable,
            )
            .await;
        for (index, ((publish_id, answer), item)) in waits.into_iter().zip(&unit.items).enumerate()
        {
            let answer_deadline = item.deadline.max(now + ATTEMPT_ANSWER_GRACE);
            self.answers.push(Box::pin(async move {
                let outcome = match tokio::time::timeout_at(answer_deadline, answer).await {
                    Ok(Ok(outcome)) => Some(outcome),
                    // The connection task let the waiter go without an answer: it ended
                    // before writing the frame.
                    Ok(Err(_)) => Some(PublishOutcome::NotSent(ClientError::ConnectionLost {
                        detail: "the connection ended before the publish was written".into(),
                    })),
                    Err(_) => None,
                };
                Answer {
                    key,
                    ticket,
                    index,
                    publish_id,
                    outcome,
                }
            }));
        }
        let left = unit.items.len();
        let sent = SentUnit {
            items: unit.items.into_iter().map(Some).collect(),
            left,
            node: target,
            joinable: unit.joinable,
        };
        if let Some(lane) = self.lanes.get_mut(&key) {
            lane.sent.insert(ticket, sent);
        }
    }

    fn answered(&mut self, answer: Answer) {
        let timeout = self.publish_timeout;
        let Some(lane) = self.lanes.get_mut(&answer.key) else {
            return;
        };
        let Some(sent) = lane.sent.get_mut(&answer.ticket) else {
            return;
        };
        let Some(item) = sent.items.get_mut(answer.index).and_then(Option::take) else {
            return;
        };
        sent.left -= 1;
        let (node, joinable) = (sent.node.clone(), sent.joinable);
        if sent.left == 0 {
            lane.sent.remove(&answer.ticket);
        }
        match classify(answer.outcome, &item, timeout) {
            Ok(Ok(())) => {
                lane.streak = 0;
                let attempts = item.attempts;
                item.answer(Ok(Confirmed {
                    publish_id: answer.publish_id,
                    attempts,
                }));
            }
            Ok(Err(error)) => item.answer(Err(error)),
            Err(refusal) => {
                lane.follow(&refusal, &node);
                lane.refused
                    .insert((answer.ticket, answer.index), (item, joinable, refusal));
            }
        }
        if lane.sent.is_empty() && !lane.refused.is_empty() {
            lane.release(&self.queue);
        }
    }
}

impl Lane {
    /// What a refusal from `node` says about where to send next.
    fn follow(&mut self, refusal: &Refusal, node: &NodeRef) {
        match refusal {
            Refusal::NotLeader(body) => {
                let named = body.leader_addr().map(|addr| NodeRef::At(addr.to_owned()));
                // A node naming itself is in the middle of a leadership change: ask again
                // after the backoff, there or elsewhere.
                self.leader = named.filter(|named| named != node);
                self.avoid = None;
            }
            Refusal::Limited(_) => {}
            Refusal::Unknown { lost: false, .. } => {
                self.leader = None;
                self.avoid = None;
            }
            Refusal::Unknown { lost: true, .. } | Refusal::NotSent => {
                self.leader = None;
                self.avoid = Some(node.clone());
            }
        }
    }

    /// Every message sent before the refused ones has its answer: the refused go back to the
    /// front of the lane, in their order, after the wait the refusals ask for.
    fn release(&mut self, queue: &str) {
        let refused = std::mem::take(&mut self.refused);
        let mut limited_hint_ms: Option<u32> = None;
        let mut not_leader_hint_ms: Option<u32> = None;
        let mut redirected = false;
        let mut units: Vec<Unit> = Vec::new();
        let mut last_ticket = None;
        for ((ticket, _), (mut item, joinable, refusal)) in refused {
            match refusal {
                Refusal::Limited(body) => {
                    limited_hint_ms = limited_hint_ms.max(body.retry_after_ms());
                    item.refusal = Some(body);
                }
                Refusal::NotLeader(body) => {
                    redirected = true;
                    not_leader_hint_ms = not_leader_hint_ms.max(body.retry_after_ms());
                    item.redirects += 1;
                    item.refusal = Some(body);
                }
                Refusal::Unknown { error, .. } => {
                    redirected = true;
                    item.redirects += 1;
                    item.unknown = Some(error);
                }
                Refusal::NotSent => {
                    redirected = true;
                    item.redirects += 1;
                }
            }
            if item.redirects > NOT_LEADER_RETRIES_MAX {
                let error = item.expired(queue, Duration::ZERO);
                item.answer(Err(error));
                continue;
            }
            match units.last_mut() {
                Some(unit) if last_ticket == Some(ticket) => unit.items.push(item),
                _ => units.push(Unit {
                    items: vec![item],
                    joinable,
                }),
            }
            last_ticket = Some(ticket);
        }
        for unit in units.into_iter().rev() {
            self.waiting.push_front(unit);
        }
        let delay = if let Some(hint_ms) = limited_hint_ms {
            retry_delay(u64::from(hint_ms), jitter_seed())
        } else if redirected {
            self.streak = self.streak.saturating_add(1);
            if self.streak <= 1 && self.leader.is_some() {
                Duration::ZERO
            } else {
                not_leader_backoff(self.streak.saturating_sub(1).max(1), not_leader_hint_ms)
            }
        } else {
            Duration::ZERO
        };
        self.hold_until = Some(Instant::now() + delay);
    }
}

/// Settled (`Ok`: confirmed or failed for good) or to send again (`Err`).
fn classify(
    outcome: Option<PublishOutcome>,
    item: &Pending,
    timeout: Duration,
) -> Result<Result<(), ClientError>, Refusal> {
    // An idempotent producer's message is sent again after an unknown outcome (the partition
    // drops a second copy); others are not.
    let resendable = item.message.sequence.is_some();
    let Some(outcome) = outcome else {
        return Ok(Err(ClientError::OutcomeUnknown {
            error: None,
            detail: format!(
                "no Confirm within publish_timeout ({} ms)",
                duration_ms(timeout)
            ),
        }));
    };
    match outcome {
        PublishOutcome::Confirmed => Ok(Ok(())),
        PublishOutcome::Failed(body) if body.code() == ERR_LIMITED => Err(Refusal::Limited(body)),
        PublishOutcome::Failed(body) if body.code() == ERR_NOT_LEADER => {
            Err(Refusal::NotLeader(body))
        }
        PublishOutcome::Failed(body) if resendable && body.code() == ERR_GATEWAY_TIMEOUT => {
            Err(Refusal::Unknown {
                lost: false,
                error: ClientError::from_body(body),
            })
        }
        PublishOutcome::Failed(body) => Ok(Err(ClientError::from_body(body))),
        PublishOutcome::Lost(detail) if resendable => Err(Refusal::Unknown {
            lost: true,
            error: ClientError::OutcomeUnknown {
                error: None,
                detail,
            },
        }),
        PublishOutcome::Lost(detail) => Ok(Err(ClientError::OutcomeUnknown {
            error: None,
            detail,
        })),
        PublishOutcome::NotSent(ClientError::ConnectionLost { .. }) => Err(Refusal::NotSent),
        PublishOutcome::NotSent(error) => Ok(Err(error)),
    }
}

fn jitter_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
}

async fn poll_fetch(
    fetch: &mut Option<BoxedFuture<Result<Layout, ClientError>>>,
) -> Result<Layout, ClientError> {
    match fetch {
        Some(fetch) => fetch.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The layout of `queue` (a queue's, or a stream's when no queue has the name), from a live
/// node of the cluster, within `timeout`.
async fn fetch_layout(
    client: Client,
    queue: String,
    timeout: Duration,
) -> Result<Layout, ClientError> {
    let operation = format!("info {queue}");
    let work = async {
        let node = client.live_node().await?;
        match node.info_at(&queue).await {
            Ok((info, answered)) => Ok(Layout::of_queue(&info.partitions, answered.own_address())),
            Err(ClientError::Server(body))
                if body.code() == ERR_NOT_FOUND
                    && node.protocol_version() >= PROTOCOL_VERSION_STREAMS =>
            {
                let (info, answered) = node.stream_info_at(&queue).await?;
                Ok(Layout::of_stream(&info.partitions, answered.own_address()))
            }
            Err(error) => Err(error),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ClientError::Timeout {
            operation,
            timeout_ms: duration_ms(timeout),
        })?
}
