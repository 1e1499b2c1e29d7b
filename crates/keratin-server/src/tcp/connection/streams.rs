//! The stream frames of protocol version 7 on one connection (`docs/streams.md`, "Reading";
//! `docs/protocol.md`, "Stream frames"): declare, set, info, list and delete; `CursorCommit`;
//! readers (`StreamSubscribe`), each a task that sends `StreamDeliver` batches as its credit
//! allows, waits at the end of its partitions for new messages, and commits its cursor every
//! second and when it ends when asked to (`auto_commit`). A reader in a consumer group reads
//! the partitions its group assigns it and hands them over as members join and leave
//! (`keratin_broker::stream::groups`): it commits what it sent, ends the partition with
//! `StreamPartitionEnd` 409, releases it; the new member starts at the cursor's commit.
//!
//! Bounds: a reader holds at most one log read (4,096 messages or 1 MiB, sent as frames of up
//! to 256 messages) besides what waits in the connection's outbound channel; what waits there takes bytes from the connection's outbound
//! budget (`server.outbound_bytes_max`) and the node's delivery budget
//! (`server.delivery_bytes_max`), shared with queue deliveries, until the socket takes it; it
//! sends no more messages than its credit; a connection has at most
//! `CONSUMERS_PER_CONNECTION_MAX` consumers and readers together. A reader's position moves
//! past a batch only once the batch is handed to the connection, so what it commits was sent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keratin_auth::Permission;
use keratin_broker::stream::partition::READ_MESSAGES_MAX;
use keratin_broker::stream::{GroupMember, StreamInfo, StreamSettings};
use keratin_broker::{Broker, BrokerError, ByteBudget, DeliveryPermit, ReadFrom, ReaderSlot};
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_CONFLICT, ERR_NOT_FOUND};
use keratin_proto::frame::{Frame, Header, SubscribeOk};
use keratin_proto::stream::{
    CursorCommit, StreamCredit, StreamDeclare, StreamDeliver, StreamInfoReply, StreamListReply,
    StreamMessage, StreamPartitionEnd, StreamPartitionInfo, StreamRequest, StreamSet, StreamStart,
    StreamSubscribe, StreamSummary, STREAM_DELIVER_MESSAGES_MAX,
};
use keratin_proto::{frame::Update, ErrorBody};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use super::{ok, Conn, Outbound, CONSUMERS_PER_CONNECTION_MAX};
use crate::tcp::errors::error_body;

/// Most payload bytes of one `StreamDeliver` (besides its last message).
const DELIVER_BYTES_MAX: usize = 1 << 20;
/// How often a reader with `auto_commit` commits the positions it delivered.
const AUTO_COMMIT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a reader with a cursor on a node that stopped leading the stream's cursor log
/// waits to learn the new leader before it ends naming none (an election takes 1-2 s).
const LEADER_UNKNOWN_PATIENCE: Duration = Duration::from_secs(3);
/// How long cancelling a reader waits for its last automatic commit.
const READER_STOP_WAIT: Duration = Duration::from_secs(5);
/// Most credit a reader may hold (messages sent and not yet topped up): far more than a
/// client needs, and it keeps the counter far from overflow.
const CREDIT_MAX: u64 = 1 << 20;

/// A reader of this connection.
pub(super) struct ReaderEntry {
    /// In a group: (stream, cursor, member id), to fence this connection's commits.
    member: Option<(String, String, u64)>,
    credit: Arc<Credit>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl ReaderEntry {
    /// Whether its task ended (its stream went, or a read failed).
    pub(super) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Asks the task to end (after its last automatic commit) and waits for it, bounded.
    pub(super) async fn stop(self) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(READER_STOP_WAIT, &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

/// The messages a reader may still send; topped up by `StreamCredit`.
struct Credit {
    available: AtomicU64,
    added: Notify,
}

impl Credit {
    fn add(&self, credit: u32) {
        let _ = self
            .available
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some((n + u64::from(credit)).min(CREDIT_MAX))
            });
        self.added.notify_one();
    }

    fn take(&self, n: u64) {
        let _ = self
            .available
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                Some(a.saturating_sub(n))
            });
    }

    fn available(&self) -> u64 {
        self.available.load(Ordering::Acquire)
    }
}

impl Conn {
    /// The 403 of a stream request this connection's user may not make (`None`: allowed, or
    /// not a stream request).
    pub(super) fn stream_refused(&self, frame: &Frame) -> Option<(u64, ErrorBody)> {
        let (request_id, stream, permission) = match frame {
            Frame::StreamDeclare(d) => (d.request_id, &d.stream, Permission::Manage),
            Frame::StreamSet(s) => (s.request_id, &s.stream, Permission::Manage),
            Frame::StreamDelete(r) => (r.request_id, &r.stream, Permission::Manage),
            Frame::StreamSubscribe(s) => (s.request_id, &s.stream, Permission::Consume),
            Frame::CursorCommit(c) => (c.request_id, &c.stream, Permission::Consume),
            Frame::StreamInfo(r) => {
                if self.grant.sees(&r.stream) {
                    return None;
                }
                (r.request_id, &r.stream, Permission::Consume)
            }
            _ => return None,
        };
        let refused = self.grant.check(stream, permission).err()?;
        Some((request_id, refused))
    }

    /// Handle one stream frame (`false`: not a stream frame).
    pub(super) async fn stream_frame(&mut self, frame: Frame) -> Result<(), Frame> {
        // A stream declared through another node a moment ago is found, not 404 (a map
        // lookup when it is known here; see `Broker::catch_up_for`).
        let named = match &frame {
            Frame::StreamSet(s) => Some((s.request_id, s.stream.clone())),
            Frame::StreamDelete(r) | Frame::StreamInfo(r) => Some((r.request_id, r.stream.clone())),
            Frame::StreamSubscribe(s) => Some((s.request_id, s.stream.clone())),
            Frame::CursorCommit(c) => Some((c.request_id, c.stream.clone())),
            _ => None,
        };
        if let Some((request_id, stream)) = named {
            if let Err(refused) = self.caught_up(&stream).await {
                self.reply(request_id, Err(refused)).await;
                return Ok(());
            }
        }
        match frame {
            Frame::StreamDeclare(d) => {
                let (request_id, stream) = (d.request_id, d.stream.clone());
                let result = ok(request_id, self.stream_declare(d).await);
                self.audited("stream.declare", &stream, &result);
                self.reply(request_id, result).await;
            }
            Frame::StreamSet(s) => {
                let (request_id, stream) = (s.request_id, s.stream.clone());
                let result = ok(request_id, self.stream_set(s).await);
                self.audited("stream.settings", &stream, &result);
                self.reply(request_id, result).await;
            }
            Frame::StreamDelete(StreamRequest { request_id, stream }) => {
                let result = ok(request_id, self.broker.delete_stream(&stream).await);
                self.audited("stream.delete", &stream, &result);
                self.reply(request_id, result).await;
            }
            Frame::StreamInfo(StreamRequest { request_id, stream }) => {
                let result = self
                    .broker
                    .stream_info(&stream)
                    .map(|info| Frame::StreamInfoReply(info_to_wire(request_id, &info)))
                    .map_err(|e| error_body(&e));
                self.reply(request_id, result).await;
            }
            Frame::StreamList(l) => {
                let streams = self
                    .broker
                    .list_streams()
                    .iter()
                    .filter(|s| self.grant.sees(&s.name))
                    .map(summary_to_wire)
                    .collect();
                self.send(Frame::StreamListReply(StreamListReply {
                    request_id: l.request_id,
                    streams,
                }))
                .await;
            }
            Frame::StreamSubscribe(s) => self.stream_subscribe(s).await,
            Frame::StreamCredit(c) => self.stream_credit(c).await,
            Frame::CursorCommit(c) => {
                let request_id = c.request_id;
                let result = ok(request_id, self.cursor_commit(c).await);
                self.reply(request_id, result).await;
            }
            other => return Err(other),
        }
        Ok(())
    }

    async fn stream_declare(&self, d: StreamDeclare) -> Result<(), BrokerError> {
        let settings = StreamSettings {
            partitions: d.settings.partitions,
            max_bytes: d.settings.max_bytes,
            max_age_ms: d.settings.max_age_ms,
            max_messages: d.settings.max_messages,
        };
        self.broker
            .declare_stream(&d.stream, settings, d.settings.replicas, d.nodes)
            .await
            .map(|_| ())
    }

    async fn stream_set(&self, s: StreamSet) -> Result<(), BrokerError> {
        let update = s.update;
        self.broker
            .update_stream_settings(&s.stream, move |current| {
                Ok(StreamSettings {
                    partitions: current.partitions,
                    max_bytes: apply(current.max_bytes, update.max_bytes),
                    max_age_ms: apply(current.max_age_ms, update.max_age_ms),
                    max_messages: apply(current.max_messages, update.max_messages),
                })
            })
            .await
            .map(|_| ())
    }

    async fn cursor_commit(&self, c: CursorCommit) -> Result<(), BrokerError> {
        self.check_group_commit(&c)?;
        let positions = c.entries.iter().map(|e| (e.partition, e.offset)).collect();
        self.broker
            .commit_cursor(&c.stream, &c.cursor, positions)
            .await
    }

    /// A commit of a partition a group member of another connection reads is refused (409):
    /// that member commits its own position, and an older one would send it back.
    fn check_group_commit(&self, c: &CursorCommit) -> Result<(), BrokerError> {
        let stream = self.broker.stream(&c.stream)?;
        let mine: BTreeSet<u64> = self
            .readers
            .values()
            .filter_map(|r| r.member.as_ref())
            .filter(|(s, cursor, _)| *s == c.stream && *cursor == c.cursor)
            .map(|(_, _, id)| *id)
            .collect();
        for entry in &c.entries {
            if let Some(holder) = stream.group_holder(&c.cursor, entry.partition) {
                if !mine.contains(&holder) {
                    return Err(BrokerError::HeldByGroupMember(format!(
                        "partition {} of stream {:?} is read by another member of cursor                          {:?}'s group, which commits it; commit only the partitions your                          readers hold",
                        entry.partition, c.stream, c.cursor
                    )));
                }
            }
        }
        Ok(())
    }

    async fn stream_credit(&self, c: StreamCredit) {
        match self.readers.get(&c.consumer_tag) {
            Some(reader) => reader.credit.add(c.credit),
            None => {
                let message = format!("no stream reader {:?} on this connection", c.consumer_tag);
                self.send(Frame::Error(keratin_proto::frame::ErrorFrame {
                    request_id: None,
                    fatal: false,
                    error: ErrorBody::new(ERR_NOT_FOUND, message),
                }))
                .await;
            }
        }
    }

    async fn stream_subscribe(&mut self, s: StreamSubscribe) {
        self.readers.retain(|_, reader| !reader.is_finished());
        match self.reader_start(&s).await {
            Ok((positions, group, slot)) => {
                self.send(Frame::SubscribeOk(SubscribeOk {
                    request_id: s.request_id,
                    consumer_tag: s.consumer_tag.clone(),
                }))
                .await;
                let credit = Arc::new(Credit {
                    available: AtomicU64::new(0),
                    added: Notify::new(),
                });
                credit.add(s.credit);
                let (stop, stopped) = watch::channel(false);
                let member = group
                    .as_ref()
                    .map(|g| (s.stream.clone(), g.cursor().to_string(), g.id()));
                let reader = Reader {
                    broker: self.broker.clone(),
                    stream: s.stream.clone(),
                    tag: s.consumer_tag.clone(),
                    cursor: s.cursor.clone(),
                    auto_commit: s.auto_commit,
                    positions,
                    from: read_from(s.start),
                    group,
                    _slot: slot,
                    committed: BTreeMap::new(),
                    moved: BTreeMap::new(),
                    credit: credit.clone(),
                    out: self.out.clone(),
                    outbound_bytes: self.outbound_bytes.clone(),
                    node_bytes: self.broker.delivery_budget(),
                    stop: stopped,
                };
                let task = tokio::spawn(reader.run());
                self.readers.insert(
                    s.consumer_tag,
                    ReaderEntry {
                        member,
                        credit,
                        stop,
                        task,
                    },
                );
            }
            Err(error) => self.reply(s.request_id, Err(error)).await,
        }
    }

    /// Checks a subscription and finds where it starts in each of its partitions (in a group:
    /// joins it, and the reader finds its partitions as the group assigns them).
    async fn reader_start(
        &self,
        s: &StreamSubscribe,
    ) -> Result<(BTreeMap<u32, u64>, Option<GroupMember>, ReaderSlot), ErrorBody> {
        if self.consumers.len() + self.readers.len() >= CONSUMERS_PER_CONNECTION_MAX {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                format!(
                    "this connection has {CONSUMERS_PER_CONNECTION_MAX} consumers and stream \
                     readers, the most allowed; cancel one or open another connection"
                ),
            ));
        }
        if self.consumers.contains_key(&s.consumer_tag)
            || self.readers.contains_key(&s.consumer_tag)
        {
            return Err(ErrorBody::new(
                ERR_CONFLICT,
                format!(
                    "consumer tag {:?} is in use on this connection",
                    s.consumer_tag
                ),
            ));
        }
        if s.group && s.cursor.is_none() {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                "a group needs a cursor name: its members share the cursor's partitions",
            ));
        }
        if s.group && !s.partitions.is_empty() {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                "a group member reads the partitions its group assigns: leave partitions empty",
            ));
        }
        if s.auto_commit && s.cursor.is_none() {
            return Err(ErrorBody::new(
                ERR_BAD_REQUEST,
                "auto_commit needs a cursor name: a reader without one keeps no position",
            ));
        }
        let stream = self.broker.stream(&s.stream).map_err(|e| error_body(&e))?;
        // In a cluster the node leading the stream's cursor log serves its readers (421
        // naming it elsewhere): it holds every partition, commits and coordinates groups.
        self.broker
            .stream_reader_home(&s.stream)
            .map_err(|e| error_body(&e))?;
        let slot = self
            .broker
            .stream_reader_slot()
            .map_err(|e| error_body(&e))?;
        if s.group {
            let cursor = s.cursor.as_deref().unwrap_or_default();
            let member = stream.join_group(cursor).map_err(|e| error_body(&e))?;
            return Ok((BTreeMap::new(), Some(member), slot));
        }
        let partitions: Vec<u32> = if s.partitions.is_empty() {
            (0..stream.partition_count()).collect()
        } else {
            s.partitions.clone()
        };
        let cursor = s.cursor.as_ref().and_then(|name| stream.cursor(name));
        drop(stream);
        let from = read_from(s.start);
        let mut positions = BTreeMap::new();
        for p in partitions {
            let position = match cursor.as_ref().and_then(|c| c.positions.get(&p)) {
                Some(&committed) => committed,
                None => self
                    .broker
                    .stream_position(&s.stream, p, from)
                    .await
                    .map_err(|e| error_body(&e))?,
            };
            if positions.insert(p, position).is_some() {
                return Err(ErrorBody::new(
                    ERR_BAD_REQUEST,
                    format!("partition {p} is named twice"),
                ));
            }
        }
        Ok((positions, None, slot))
    }

    /// Stops reader `tag` (after its last automatic commit): whether there was one.
    pub(super) async fn stop_reader(&mut self, tag: &str) -> bool {
        match self.readers.remove(tag) {
            Some(reader) => {
                reader.stop().await;
                true
            }
            None => false,
        }
    }

    /// Stops every reader of the connection.
    pub(super) async fn stop_readers(&mut self) {
        for (_, reader) in std::mem::take(&mut self.readers) {
            reader.stop().await;
        }
    }
}

/// One reader's task.
struct Reader {
    broker: Broker,
    stream: String,
    tag: String,
    cursor: Option<String>,
    auto_commit: bool,
    /// Per partition, the offset the next read starts at.
    positions: BTreeMap<u32, u64>,
    /// Where a partition without a committed cursor position starts (a group's partitions
    /// handed to this reader later).
    from: ReadFrom,
    /// Its membership when it reads in a group.
    group: Option<GroupMember>,
    /// Its place under the node's `consumers_max`, held while it reads.
    _slot: ReaderSlot,
    /// What was committed last, per partition (auto commit sends only what moved).
    committed: BTreeMap<u32, u64>,
    /// A partition's `moved_from` not yet told: it rides on the partition's next
    /// `StreamDeliver` (a `StreamDeliver` always holds at least one message).
    moved: BTreeMap<u32, u64>,
    credit: Arc<Credit>,
    out: Outbound,
    /// The connection's outbound budget and the node's delivery budget: a batch holds its
    /// bytes in both until the socket takes it.
    outbound_bytes: Arc<ByteBudget>,
    node_bytes: Arc<ByteBudget>,
    stop: watch::Receiver<bool>,
}

/// Why a reader's task ends.
enum End {
    /// Cancelled, or the connection ends.
    Stopped,
    /// Its stream went, or a partition failed: every partition is ended with this.
    Failed(BrokerError),
}

impl Reader {
    async fn run(mut self) {
        let end = self.read_until_end().await;
        if self.auto_commit {
            if let Err(error) = self.commit().await {
                tracing::warn!(stream = self.stream, cursor = ?self.cursor, %error, "a reader's last automatic commit failed");
            }
        }
        if let End::Failed(error) = end {
            let error = error_body(&error);
            for &partition in self.positions.keys() {
                let frame = Frame::StreamPartitionEnd(StreamPartitionEnd {
                    consumer_tag: self.tag.clone(),
                    partition,
                    error: error.clone(),
                });
                if self
                    .out
                    .send((frame, DeliveryPermit::default()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }

    async fn read_until_end(&mut self) -> End {
        if let Err(error) = self.rebalance().await {
            return End::Failed(error);
        }
        let mut ends = match self.watch_ends() {
            Ok(ends) => ends,
            Err(error) => return End::Failed(error),
        };
        let mut last_commit = tokio::time::Instant::now();
        let mut not_home_since: Option<tokio::time::Instant> = None;
        loop {
            if *self.stop.borrow() {
                return End::Stopped;
            }
            // A reader with a cursor reads where the cursor log is led (its commits and its
            // group live there): once this node no longer leads it, the reader ends with 421
            // naming the node that does, within a commit tick, and subscribes there again.
            // While an election runs no node is named: it waits for one, a while at most.
            if self.cursor.is_some() {
                match self.broker.stream_reader_home(&self.stream) {
                    Ok(()) => not_home_since = None,
                    Err(error) => {
                        let named = matches!(
                            &error,
                            BrokerError::NotLeader {
                                leader: Some(_),
                                ..
                            }
                        );
                        let since = *not_home_since.get_or_insert_with(tokio::time::Instant::now);
                        if named || since.elapsed() >= LEADER_UNKNOWN_PATIENCE {
                            return End::Failed(error);
                        }
                    }
                }
            }
            if self.group.as_ref().is_some_and(GroupMember::has_changed) {
                match self.rebalance().await {
                    Ok(()) => {}
                    Err(error) => return End::Failed(error),
                }
                ends = match self.watch_ends() {
                    Ok(ends) => ends,
                    Err(error) => return End::Failed(error),
                };
            }
            for end in ends.iter_mut() {
                end.borrow_and_update();
            }
            let progressed = match self.read_once().await {
                Ok(progressed) => progressed,
                Err(error) => return End::Failed(error),
            };
            if self.auto_commit && last_commit.elapsed() >= AUTO_COMMIT_INTERVAL {
                last_commit = tokio::time::Instant::now();
                if let Err(error) = self.commit().await {
                    tracing::warn!(stream = self.stream, cursor = ?self.cursor, %error, "a reader's automatic commit failed; the next one tries again");
                }
            }
            if progressed {
                continue;
            }
            // Nothing to send: wait for credit, new messages, a stop, the commit tick or a
            // change in the group.
            let stop = self.stop.changed();
            let credit = self.credit.added.notified();
            let tick = tokio::time::sleep(AUTO_COMMIT_INTERVAL);
            let regrouped = group_changed(self.group.as_ref());
            let mut owner_gone = false;
            if self.credit.available() == 0 || ends.is_empty() {
                tokio::select! {
                    _ = stop => {}
                    () = credit => {}
                    () = tick => {}
                    () = regrouped => {}
                }
            } else {
                let appended = futures_util::future::select_all(
                    ends.iter_mut().map(|end| Box::pin(end.changed())),
                );
                tokio::select! {
                    _ = stop => {}
                    () = credit => {}
                    () = tick => {}
                    () = regrouped => {}
                    (changed, _, _) = appended => owner_gone = changed.is_err(),
                }
            }
            if owner_gone {
                // A partition's owner went (its stream was deleted or closed): watch the
                // stream under that name now, or end when there is none.
                ends = match self.watch_ends() {
                    Ok(ends) => ends,
                    Err(error) => return End::Failed(error),
                };
            }
        }
    }

    /// Each partition's end, watched.
    fn watch_ends(&self) -> Result<Vec<watch::Receiver<u64>>, BrokerError> {
        let stream = self.broker.stream(&self.stream)?;
        self.positions
            .keys()
            .map(|&p| stream.partition(p).map(|partition| partition.watch_end()))
            .collect()
    }

    /// One pass over the partitions: a batch from each that has messages, as credit allows.
    /// Whether anything was sent.
    async fn read_once(&mut self) -> Result<bool, BrokerError> {
        let stream = self.broker.stream(&self.stream)?;
        let mut progressed = false;
        let partitions: Vec<u32> = self.positions.keys().copied().collect();
        for p in partitions {
            let available = self.credit.available();
            if available == 0 {
                break;
            }
            let partition = stream.partition(p)?;
            let from = self.positions[&p];
            // One log read of up to 1 MiB, sent as frames of up to 256 messages: a read per
            // frame would read the log's chunk again for each.
            let max = (available as usize).min(READ_MESSAGES_MAX);
            let read = partition.read(from, max, DELIVER_BYTES_MAX).await?;
            drop(partition);
            if let Some(moved_from) = read.moved_from {
                if self.cursor.is_some() && !self.moved.contains_key(&p) {
                    stream.count_moved();
                }
                // The first position asked for is the one the reader knew.
                self.moved.entry(p).or_insert(moved_from);
            }
            if read.messages.is_empty() {
                self.positions.insert(p, read.next);
                continue;
            }
            let read_next = read.next;
            let mut messages = read.messages.into_iter().peekable();
            while messages.peek().is_some() {
                let chunk: Vec<keratin_broker::stream::StreamMessage> = messages
                    .by_ref()
                    .take(STREAM_DELIVER_MESSAGES_MAX)
                    .collect();
                let next = match (messages.peek(), chunk.last()) {
                    (None, _) | (_, None) => read_next,
                    (Some(_), Some(last)) => last.offset + 1,
                };
                let count = chunk.len() as u64;
                let permit = tokio::select! {
                    permit = DeliveryPermit::take(&self.outbound_bytes, &self.node_bytes, payload_bytes(&chunk)) => permit,
                    _ = self.stop.changed() => return Ok(false),
                    () = group_changed(self.group.as_ref()) => return Ok(false),
                };
                let frame = Frame::StreamDeliver(StreamDeliver {
                    consumer_tag: self.tag.clone(),
                    partition: p,
                    moved_from: self.moved.get(&p).copied(),
                    messages: chunk.into_iter().map(to_wire).collect(),
                });
                tokio::select! {
                    sent = self.out.send((frame, permit)) => {
                        if sent.is_err() {
                            return Ok(false); // the connection is closing
                        }
                    }
                    _ = self.stop.changed() => return Ok(false),
                    () = group_changed(self.group.as_ref()) => return Ok(false),
                }
                // Handed to the connection: only now is the frame the reader's position
                // (what an automatic commit sends), and its `moved_from` told.
                self.positions.insert(p, next);
                self.credit.take(count);
                self.moved.remove(&p);
                progressed = true;
            }
        }
        Ok(progressed)
    }

    /// Commits the positions that moved since the last commit (a named cursor only).
    async fn commit(&mut self) -> Result<(), BrokerError> {
        self.commit_only(None).await
    }

    /// Commits the positions that moved since the last commit, of partition `only` or all.
    async fn commit_only(&mut self, only: Option<u32>) -> Result<(), BrokerError> {
        let Some(cursor) = &self.cursor else {
            return Ok(());
        };
        let moved: Vec<(u32, u64)> = self
            .positions
            .iter()
            .filter(|(p, _)| only.is_none_or(|only| only == **p))
            .filter(|(p, offset)| self.committed.get(p) != Some(offset))
            .map(|(&p, &offset)| (p, offset))
            .collect();
        if moved.is_empty() {
            return Ok(());
        }
        self.broker
            .commit_cursor(&self.stream, cursor, moved.clone())
            .await?;
        self.committed.extend(moved);
        Ok(())
    }
}

impl Reader {
    /// In a group: gives up the partitions no longer assigned to this reader (commit when
    /// automatic, `StreamPartitionEnd` 409, release) and takes those assigned and free,
    /// starting at the cursor's committed position or at `from`.
    async fn rebalance(&mut self) -> Result<(), BrokerError> {
        let Some(mut member) = self.group.take() else {
            return Ok(());
        };
        let result = self.rebalance_as(&mut member).await;
        self.group = Some(member);
        result
    }

    async fn rebalance_as(&mut self, member: &mut GroupMember) -> Result<(), BrokerError> {
        member.seen();
        let assigned: BTreeSet<u32> = member.assigned().into_iter().collect();
        let lost: Vec<u32> = self
            .positions
            .keys()
            .filter(|p| !assigned.contains(p))
            .copied()
            .collect();
        for p in lost {
            if self.auto_commit {
                if let Err(error) = self.commit_only(Some(p)).await {
                    tracing::warn!(stream = self.stream, cursor = member.cursor(), partition = p, %error, "the commit of a partition handed to another group member failed; it reads again from the last commit");
                }
            }
            self.positions.remove(&p);
            self.committed.remove(&p);
            self.moved.remove(&p);
            let end = Frame::StreamPartitionEnd(StreamPartitionEnd {
                consumer_tag: self.tag.clone(),
                partition: p,
                error: ErrorBody::new(
                    ERR_CONFLICT,
                    format!(
                        "partition {p} of stream {:?} is now read by another member of cursor \
                         {:?}'s group",
                        self.stream,
                        member.cursor()
                    ),
                ),
            });
            // The end is queued before the release, so this client learns of it before the
            // new member reads; a closing connection ends the reader anyway.
            let _ = self.out.send((end, DeliveryPermit::default())).await;
            member.release(p);
        }
        let taken: Vec<u32> = assigned
            .into_iter()
            .filter(|p| !self.positions.contains_key(p))
            .filter(|&p| member.acquire(p))
            .collect();
        if taken.is_empty() {
            return Ok(());
        }
        let committed = self.broker.cursor(&self.stream, member.cursor())?;
        for p in taken {
            let position = match committed.as_ref().and_then(|c| c.positions.get(&p)) {
                Some(&offset) => offset,
                None => {
                    self.broker
                        .stream_position(&self.stream, p, self.from)
                        .await?
                }
            };
            self.positions.insert(p, position);
            self.committed.insert(p, position);
        }
        Ok(())
    }
}

/// Payload bytes of `messages` (bodies, keys, headers): what they hold in the budgets.
fn payload_bytes(messages: &[keratin_broker::stream::StreamMessage]) -> u64 {
    messages
        .iter()
        .map(|m| {
            let message = &m.message;
            let headers: usize = message
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum();
            (message.body.len() + message.routing_key.len() + headers) as u64
        })
        .sum()
}

fn to_wire(m: keratin_broker::stream::StreamMessage) -> StreamMessage {
    StreamMessage {
        offset: m.offset,
        timestamp_ms: m.timestamp_ms,
        routing_key: (!m.message.routing_key.is_empty()).then_some(m.message.routing_key),
        headers: m
            .message
            .headers
            .into_iter()
            .map(|(name, value)| Header { name, value })
            .collect(),
        body: m.message.body.into(),
    }
}

/// Resolves when `group` changed since its last `seen` (never without a group).
async fn group_changed(group: Option<&GroupMember>) {
    match group {
        Some(member) => member.changed().await,
        None => std::future::pending().await,
    }
}

fn read_from(start: StreamStart) -> ReadFrom {
    match start {
        StreamStart::First => ReadFrom::First,
        StreamStart::Last => ReadFrom::Last,
        StreamStart::Next => ReadFrom::Next,
        StreamStart::Offset(offset) => ReadFrom::Offset(offset),
        StreamStart::Timestamp(at) => ReadFrom::Timestamp(at),
    }
}

fn apply(current: Option<u64>, update: Update<u64>) -> Option<u64> {
    match update {
        Update::Keep => current,
        Update::Clear => None,
        Update::Set(value) => Some(value),
    }
}

fn settings_to_wire(settings: &StreamSettings) -> keratin_proto::stream::StreamSettings {
    keratin_proto::stream::StreamSettings {
        partitions: settings.partitions,
        replicas: None,
        max_bytes: settings.max_bytes,
        max_age_ms: settings.max_age_ms,
        max_messages: settings.max_messages,
    }
}

fn info_to_wire(request_id: u64, info: &StreamInfo) -> StreamInfoReply {
    StreamInfoReply {
        request_id,
        stream: info.name.clone(),
        settings: settings_to_wire(&info.settings),
        partitions: info
            .partitions
            .iter()
            .map(|p| StreamPartitionInfo {
                start_offset: p.start,
                next_offset: p.end,
                messages: p.messages,
                bytes: p.bytes,
                disk_bytes: p.disk_bytes,
                oldest_timestamp_ms: p.oldest_timestamp_ms,
                // A single node's streams: this node leads every partition.
                leading: true,
                leader: None,
                leader_addr: None,
            })
            .collect(),
    }
}

fn summary_to_wire(info: &StreamInfo) -> StreamSummary {
    StreamSummary {
        stream: info.name.clone(),
        partitions: info.partitions.len() as u32,
        messages: info.partitions.iter().map(|p| p.messages).sum(),
        bytes: info.partitions.iter().map(|p| p.bytes).sum(),
    }
}
