//! A stream's cursor log: the [`CursorTable`] and the partition log its records are kept in
//! (small size class, compacted; `docs/streams.md`, "Cursor log records"). One owner task per
//! stream writes it, over any [`PartitionLog`]: a single node's [`LocalLog`] or, in a cluster,
//! a replicated one (the cursor log is then a small group of its own).
//!
//! - Open: the table is applied from every record of the log from its start (a compacted log
//!   holds a snapshot at or near its start; what comes before it is replaced by it).
//! - Commit, delete and expiry: checked against the table, proposed one at a time, applied once
//!   the log reports them committed (durable on a single node, on a majority in a cluster);
//!   the answer comes after that, so a committed position survives a crash and a failover.
//! - Roles: only the leader's owner proposes; a follower's answers [`BrokerError::NotLeader`]
//!   naming the leader, and applies the leader's records as they commit. A new leader
//!   proposes nothing until it applied every record below its leadership's first offset.
//! - Compaction: once due ([`should_compact`]), the leader proposes a snapshot of the table;
//!   every replica that applies a snapshot record gives its copy's segments below it back
//!   ([`PartitionLog::remove_prefix`]). A crash before the removal leaves records before the
//!   snapshot, which it replaces: the same table. A replica that installs a snapshot of the
//!   group (its log restarted at a snapshot record) rebuilds its table from there.
//! - A failed write or sync stops the log (`keratin_log` semantics): the call fails, and the
//!   log is healed ([`PartitionLog::heal`]) before anything else is proposed, its table read
//!   again from what is durable; never written again in place.

mod owner;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use keratin_log::{Io, Log, LogOptions, SegmentPool, SizeClass};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::error::{BrokerError, BrokerResult};
use crate::partition::local_log::LocalLog;
use crate::partition::log::{LogEvents, PartitionLog, Role};
use crate::stream::cursors::{CursorState, CursorTable};

#[cfg(doc)]
use crate::stream::cursors::should_compact;

/// The partition number a cursor log's [`BrokerError::NotLeader`] and
/// [`BrokerError::LeadershipLost`] carry: no payload partition has it (a stream has at most
/// a few hundred), so a client can tell the cursor log's leader from a partition's.
pub const CURSOR_LOG_PARTITION: u32 = u32::MAX;

/// The index of a replicated stream's cursor log among its Raft groups (a group id holds
/// indexes below 256; a stream's payload partitions stay below 64, so none is 255).
pub const CURSOR_LOG_GROUP_INDEX: u32 = 255;

/// Requests waiting for the owner; more wait for room (commits are answered one at a time).
const REQUESTS_MAX: usize = 256;

/// What a stream's cursor log is asked to do.
enum Request {
    Commit {
        name: String,
        positions: Vec<(u32, u64)>,
        now_ms: u64,
        reply: oneshot::Sender<BrokerResult<()>>,
    },
    Delete {
        name: String,
        now_ms: u64,
        reply: oneshot::Sender<BrokerResult<bool>>,
    },
    Expire {
        now_ms: u64,
        expiry_ms: u64,
        reply: oneshot::Sender<BrokerResult<Vec<String>>>,
    },
}

/// What the owner shares with the handle: the table as applied, the role, counts.
#[derive(Debug, Default)]
struct Shared {
    table: RwLock<CursorTable>,
    role: Mutex<Role>,
    compactions: AtomicU64,
}

/// Figures of a cursor log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorLogFigures {
    /// Cursors in the table.
    pub cursors: u64,
    /// Snapshots this node's owner proposed since it started.
    pub compactions: u64,
    /// Bytes of this node's copy on disk.
    pub disk_bytes: u64,
    /// Who leads the cursor log.
    pub role: Role,
}

/// A stream's cursor log and the table it holds. See the module docs.
/// Closed in place (`close` takes `&self`): requests after it are answered "closed".
pub struct CursorLog {
    stream: String,
    requests: Mutex<Option<mpsc::Sender<Request>>>,
    shared: Arc<Shared>,
    log: Mutex<Option<Arc<dyn PartitionLog>>>,
    owner: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CursorLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CursorLog")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

/// Opens (or creates, at the first write) a single node's cursor log in `dir`, with the node's
/// `full_segment_size_bytes` (the log uses the small class, an eighth of it). Blocking.
pub fn open_local(
    io: Arc<dyn Io>,
    dir: &Path,
    full_segment_size_bytes: u64,
    pool: Option<SegmentPool>,
) -> BrokerResult<Arc<dyn PartitionLog>> {
    let options = LogOptions {
        full_segment_size_bytes,
        size_class: SizeClass::Small,
        ..LogOptions::default()
    };
    let log = Log::open(io.clone(), dir, options, pool)?;
    Ok(Arc::new(LocalLog::new(
        log,
        io,
        full_segment_size_bytes / 8,
    )))
}

impl CursorLog {
    /// Starts stream `stream`'s cursor log owner over `log`, whose segments are `segment_bytes`
    /// long (the small class): the table is read from the log first.
    pub async fn start(
        stream: &str,
        log: Arc<dyn PartitionLog>,
        segment_bytes: u64,
    ) -> BrokerResult<CursorLog> {
        let (requests, request_receiver) = mpsc::channel(REQUESTS_MAX);
        // Unbounded, as the partition owners' commands: the log sends without waiting, at most
        // one proposal's answer is outstanding, and `Committed` and `Role` events are reports
        // the owner folds into its state as they come.
        let (events, event_receiver) = mpsc::unbounded_channel();
        log.start(LogEvents::new(move |event| {
            let _ = events.send(event);
        }));
        let shared = Arc::new(Shared::default());
        let owner = owner::Owner::open(stream, log.clone(), segment_bytes, shared.clone()).await?;
        let owner = tokio::spawn(owner.run(request_receiver, event_receiver));
        Ok(CursorLog {
            stream: stream.to_string(),
            requests: Mutex::new(Some(requests)),
            shared,
            log: Mutex::new(Some(log)),
            owner: Mutex::new(Some(owner)),
        })
    }

    /// Cursor `name`'s positions, if it has any (as this node applied them).
    pub fn get(&self, name: &str) -> Option<CursorState> {
        self.table().get(name).cloned()
    }

    /// Every cursor with its positions.
    pub fn list(&self) -> Vec<(String, CursorState)> {
        self.table()
            .iter()
            .map(|(name, state)| (name.to_string(), state.clone()))
            .collect()
    }

    /// The table as this node applied it.
    pub fn table(&self) -> std::sync::RwLockReadGuard<'_, CursorTable> {
        self.shared.table.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Who leads the cursor log, as this node's copy knows (a short lock).
    pub fn role(&self) -> Role {
        lock(&self.shared.role).clone()
    }

    /// Its figures now.
    pub fn figures(&self) -> CursorLogFigures {
        CursorLogFigures {
            cursors: self.table().len() as u64,
            compactions: self.shared.compactions.load(Ordering::Relaxed),
            disk_bytes: lock(&self.log).as_ref().map_or(0, |log| log.disk_bytes()),
            role: lock(&self.shared.role).clone(),
        }
    }

    /// Sets cursor `name`'s `positions` (partition, next offset) at `now_ms`; answered once
    /// committed.
    pub async fn commit(
        &self,
        name: &str,
        positions: &[(u32, u64)],
        now_ms: u64,
    ) -> BrokerResult<()> {
        let (reply, answer) = oneshot::channel();
        self.ask(
            Request::Commit {
                name: name.to_string(),
                positions: positions.to_vec(),
                now_ms,
                reply,
            },
            answer,
        )
        .await
    }

    /// Removes cursor `name`; `false` (and nothing written) when it does not exist.
    pub async fn delete(&self, name: &str, now_ms: u64) -> BrokerResult<bool> {
        let (reply, answer) = oneshot::channel();
        self.ask(
            Request::Delete {
                name: name.to_string(),
                now_ms,
                reply,
            },
            answer,
        )
        .await
    }

    /// Deletes the cursors idle for `expiry_ms` at `now_ms` (one proposal); returns their
    /// names.
    pub async fn expire(&self, now_ms: u64, expiry_ms: u64) -> BrokerResult<Vec<String>> {
        let (reply, answer) = oneshot::channel();
        self.ask(
            Request::Expire {
                now_ms,
                expiry_ms,
                reply,
            },
            answer,
        )
        .await
    }

    async fn ask<T>(
        &self,
        request: Request,
        answer: oneshot::Receiver<BrokerResult<T>>,
    ) -> BrokerResult<T> {
        let closed = || BrokerError::Closed(format!("stream {:?}'s cursor log", self.stream));
        let requests = lock(&self.requests).clone().ok_or_else(closed)?;
        requests.send(request).await.map_err(|_| closed())?;
        drop(requests);
        answer.await.map_err(|_| closed())?
    }

    /// Stops the owner (a proposal in flight is answered first) and closes the log: what is
    /// queued is written and synced. Does nothing the second time.
    pub async fn close(&self) -> BrokerResult<()> {
        let Some(log) = self.stop().await? else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || log.close())
            .await
            .map_err(|e| BrokerError::Closed(format!("cursor log close: {e}")))?
    }

    /// Stops the owner and deletes this node's copy of the log (the stream is deleted).
    pub async fn delete_log(&self) -> BrokerResult<()> {
        let Some(log) = self.stop().await? else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || log.delete())
            .await
            .map_err(|e| BrokerError::Closed(format!("cursor log delete: {e}")))?
    }

    async fn stop(&self) -> BrokerResult<Option<Arc<dyn PartitionLog>>> {
        drop(lock(&self.requests).take());
        let owner = lock(&self.owner).take();
        if let Some(owner) = owner {
            owner
                .await
                .map_err(|e| BrokerError::Closed(format!("cursor log owner: {e}")))?;
        }
        Ok(lock(&self.log).take())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
