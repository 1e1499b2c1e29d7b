//! The node metadata log: queue declarations (with the placement of their partitions) and
//! deletions, and the node's runtime setting overrides, as JSON records in a small-class log,
//! replayed at start. JSON because these records
//! are rare, small and read by people debugging a node; the hot path never touches them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use keratin_auth::{UserChange, UserTable};
use keratin_log::{Io, Log, LogOptions, Record, SegmentPool, SizeClass};
use serde::{Deserialize, Serialize};

use crate::error::{BrokerError, BrokerResult};
use crate::gate::PublishGate;
use crate::queue::QueueSettings;
use crate::stream::StreamSettings;

/// Record type of a JSON metadata record, format 1.
const META_JSON_V1: u8 = 1;

/// Room the metadata log's tail segment keeps for deletion records: a record that frees no
/// space and would leave less first rolls to a new segment, and is refused (429, reason disk)
/// when the file system has no room for one. A deletion record (about 100 bytes of JSON) takes
/// what is kept, so deleting a queue or a stream never needs space it cannot have: 8 KiB hold
/// dozens of deletions, and a new segment (its first preallocation step, 32 KiB at least) holds
/// this room and any other record several times over.
const DELETION_ROOM_BYTES: u64 = 8 << 10;

/// A record's header in a segment (`docs/storage-format.md`), rounded up.
const RECORD_FRAMING_BYTES: u64 = 64;

/// When a metadata change refused at a full disk may be tried again: about the limits
/// sampler's period, after which a freed disk shows.
const FULL_RETRY_AFTER_MS: u32 = 1_000;

/// A declared queue as the metadata log knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct QueueDecl {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) settings: QueueSettings,
    /// The storage directory of each partition, by index.
    pub(crate) placement: Vec<PathBuf>,
    /// A replicated queue: the nodes holding a replica of each partition, by index (empty on
    /// a single node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) replicas: Vec<Vec<u64>>,
    /// The voters each partition's group was formed with, by index, where this node joined a
    /// live group later (`PartitionPlace::formation`); empty: every group was formed with
    /// `replicas` (every queue declared with its groups).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) formation: Vec<Vec<u64>>,
    /// Per partition, the cluster's version of its replica set (the metadata group's offset of
    /// the change that set it; 0 or missing: as declared). A change of an older version is
    /// not applied again (the cluster's records are replayed at every start).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) replicas_version: Vec<u64>,
}

impl QueueDecl {
    /// Partition `index` is on `replicas` from cluster version `version` on; a non-empty
    /// `formation` replaces its group's formation. Out-of-range indexes change nothing.
    pub(crate) fn set_partition_replicas(
        &mut self,
        index: usize,
        replicas: Vec<u64>,
        formation: Vec<u64>,
        version: u64,
    ) {
        let partitions = self.replicas.len();
        if index >= partitions {
            return;
        }
        if self.formation.len() != partitions {
            // Every group was formed with its replicas (the empty default): keep that once
            // the replicas move.
            self.formation = self.replicas.clone();
        }
        if !formation.is_empty() {
            self.formation[index] = formation;
        }
        if self.replicas_version.len() != partitions {
            self.replicas_version = vec![0; partitions];
        }
        self.replicas_version[index] = version;
        self.replicas[index] = replicas;
    }

    /// The version of partition `index`'s replica set (see `replicas_version`).
    pub(crate) fn replicas_version(&self, index: usize) -> u64 {
        self.replicas_version.get(index).copied().unwrap_or(0)
    }
}

/// A declared stream as the metadata log knows it (`docs/streams.md`, "Files").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StreamDecl {
    /// Unique among queues and streams of the node (ids share one counter).
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) settings: StreamSettings,
    /// The storage directory of each partition's payload log, by index; the cursor log lives
    /// beside partition 0's.
    pub(crate) placement: Vec<PathBuf>,
    /// In a cluster: the nodes holding a replica of each partition, by index; the cursor log's
    /// group has partition 0's (empty on a single node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) replicas: Vec<Vec<u64>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum MetaRecord {
    QueueDeclared(QueueDecl),
    /// Written before the queue's files go: it frees space, so it never waits for space.
    QueueDeleted {
        id: u64,
    },
    QueueSettingsChanged {
        id: u64,
        settings: QueueSettings,
    },
    /// The nodes holding partition `index`'s replicas changed (the cluster moved it), as of
    /// the cluster's `version`; `formation` is the voters its group had when this node joined
    /// it (empty: unchanged).
    PartitionReplicasChanged {
        id: u64,
        index: u32,
        replicas: Vec<u64>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        formation: Vec<u64>,
        version: u64,
    },
    /// The node's runtime setting overrides, whole (dotted key to value). The broker stores
    /// them without interpreting them: the server owns their meaning and validation.
    NodeSettingsChanged {
        overrides: BTreeMap<String, serde_json::Value>,
    },
    /// A change to the node's users (issue 16), checked against the table before it was
    /// stored.
    UserChanged {
        change: UserChange,
    },
    /// A stream was declared (its name is then taken for queues too).
    StreamDeclared(StreamDecl),
    /// Written before the stream's files go, like `QueueDeleted`.
    StreamDeleted {
        id: u64,
    },
    /// A stream's retention changed (its partitions are fixed).
    StreamSettingsChanged {
        id: u64,
        settings: StreamSettings,
    },
}

/// What the metadata log says: the declared queues, the next queue id and the node's setting
/// overrides. Plain data, changed only by [`Catalog::apply`] of a record that is durable, in log
/// order for records of one queue (the broker orders operations per queue name).
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    pub(crate) queues: BTreeMap<u64, QueueDecl>,
    by_name: BTreeMap<String, u64>,
    pub(crate) streams: BTreeMap<u64, StreamDecl>,
    stream_by_name: BTreeMap<String, u64>,
    pub(crate) next_id: u64,
    /// Every queue and stream id a declaration record of the log names, deleted ones
    /// included (one per declaration: the log keeps every record). A data directory whose id
    /// is not among them means the log lost records: such a directory is never removed.
    pub(crate) declared_ever: BTreeSet<u64>,
    pub(crate) node_settings: BTreeMap<String, serde_json::Value>,
    /// The node's users (a single node's; a cluster keeps its users in its metadata group).
    pub(crate) users: Arc<UserTable>,
}

impl Catalog {
    pub(crate) fn apply(&mut self, record: MetaRecord) {
        match record {
            MetaRecord::QueueDeclared(decl) => {
                self.next_id = self.next_id.max(decl.id + 1);
                self.declared_ever.insert(decl.id);
                // A name declared again under a new id (a declare whose write failed after it
                // was durable, then declared again) keeps the newest declaration.
                if let Some(old) = self.by_name.insert(decl.name.clone(), decl.id) {
                    self.queues.remove(&old);
                }
                self.queues.insert(decl.id, decl);
            }
            MetaRecord::QueueDeleted { id } => {
                if let Some(decl) = self.queues.remove(&id) {
                    if self.by_name.get(&decl.name) == Some(&id) {
                        self.by_name.remove(&decl.name);
                    }
                }
            }
            MetaRecord::QueueSettingsChanged { id, settings } => {
                if let Some(decl) = self.queues.get_mut(&id) {
                    decl.settings = settings;
                }
            }
            MetaRecord::PartitionReplicasChanged {
                id,
                index,
                replicas,
                formation,
                version,
            } => {
                if let Some(decl) = self.queues.get_mut(&id) {
                    decl.set_partition_replicas(index as usize, replicas, formation, version);
                }
            }
            MetaRecord::StreamDeclared(decl) => {
                self.next_id = self.next_id.max(decl.id + 1);
                self.declared_ever.insert(decl.id);
                if let Some(old) = self.stream_by_name.insert(decl.name.clone(), decl.id) {
                    self.streams.remove(&old);
                }
                self.streams.insert(decl.id, decl);
            }
            MetaRecord::StreamDeleted { id } => {
                if let Some(decl) = self.streams.remove(&id) {
                    if self.stream_by_name.get(&decl.name) == Some(&id) {
                        self.stream_by_name.remove(&decl.name);
                    }
                }
            }
            MetaRecord::StreamSettingsChanged { id, settings } => {
                if let Some(decl) = self.streams.get_mut(&id) {
                    decl.settings = settings;
                }
            }
            MetaRecord::NodeSettingsChanged { overrides } => {
                self.node_settings = overrides;
            }
            MetaRecord::UserChanged { change } => {
                // Checked before it was stored, so it applies; a refusal here (a table a
                // newer version wrote) leaves the table as it was, and says so.
                match self.users.changed(&change) {
                    Ok(table) => self.users = Arc::new(table),
                    Err(error) => tracing::warn!(
                        %error,
                        user = change.user(),
                        "a stored user change does not apply; skipped"
                    ),
                }
            }
        }
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&QueueDecl> {
        self.by_name.get(name).and_then(|id| self.queues.get(id))
    }

    /// Stream `name`'s declaration.
    pub(crate) fn stream_by_name(&self, name: &str) -> Option<&StreamDecl> {
        self.stream_by_name
            .get(name)
            .and_then(|id| self.streams.get(id))
    }

    /// Partitions over every declared queue and stream (each is a log with an owner task).
    pub(crate) fn partitions(&self) -> u64 {
        let queues: u64 = self
            .queues
            .values()
            .map(|q| u64::from(q.settings.partitions))
            .sum();
        let streams: u64 = self
            .streams
            .values()
            .map(|s| u64::from(s.settings.partitions))
            .sum();
        queues + streams
    }
}

/// The metadata log. Its methods block on disk I/O or wait for it: the broker calls the blocking
/// ones (`open`, `heal`, `close`) off the async workers, and [`MetaLog::write`] moves its own
/// blocking part there. Holds no catalog: concurrent writes append side by side, so the log's
/// group commit covers them with one sync.
#[derive(Debug)]
pub(crate) struct MetaLog {
    log: Log,
    /// The file system holding the log, as the gate knows it.
    device: u64,
    gate: Arc<dyn PublishGate>,
    /// Held while healing: two writers that find the log stopped heal it once.
    healing: Mutex<()>,
    /// Bytes of records that free no space, appended and not yet durable: the tail's room as
    /// the log reports it (as of its last durable batch) leaves them out, so concurrent
    /// records cannot together take the room kept for deletions ([`DELETION_ROOM_BYTES`]).
    pending_bytes: Mutex<u64>,
    /// Held by the writer that rolls to a new segment to keep the deletions' room.
    rolling: Mutex<()>,
    /// The size of its segments.
    segment_size_bytes: u64,
    /// Stop and heal figures, read without any lock (metrics, attention items).
    pub(crate) figures: Arc<MetaFigures>,
}

impl MetaLog {
    /// Open the log and replay it (blocking).
    pub(crate) fn open(
        io: Arc<dyn Io>,
        dir: &Path,
        full_segment_size_bytes: u64,
        pool: SegmentPool,
        gate: Arc<dyn PublishGate>,
    ) -> BrokerResult<(MetaLog, Catalog)> {
        let options = LogOptions {
            full_segment_size_bytes,
            size_class: SizeClass::Small,
            ..LogOptions::default()
        };
        let log = Log::open(io.clone(), dir, options.clone(), Some(pool))?;
        // The parent's: a log creates its own directory at its first append.
        let device = io
            .device_id(dir.parent().unwrap_or(dir))
            .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
        let meta = MetaLog {
            log,
            device,
            gate,
            healing: Mutex::new(()),
            pending_bytes: Mutex::new(0),
            rolling: Mutex::new(()),
            segment_size_bytes: options.segment_size_bytes(),
            figures: Arc::new(MetaFigures {
                dir: dir.to_path_buf(),
                ..MetaFigures::default()
            }),
        };
        let mut catalog = Catalog {
            next_id: 1,
            ..Catalog::default()
        };
        for record in meta.log.reader(meta.log.start_offset()) {
            let record = record?;
            if record.record_type != META_JSON_V1 {
                return Err(BrokerError::Corrupt {
                    what: "metadata",
                    offset: record.offset,
                    reason: format!("record type {}", record.record_type),
                });
            }
            let decoded: MetaRecord =
                serde_json::from_slice(&record.payload).map_err(|e| BrokerError::Corrupt {
                    what: "metadata",
                    offset: record.offset,
                    reason: e.to_string(),
                })?;
            catalog.apply(decoded);
        }
        Ok((meta, catalog))
    }

    /// Append a record and wait until it is durable; the caller then applies it to the catalog.
    /// A log stopped by an earlier write error is healed first (see [`MetaLog::heal_for`]). The
    /// heal and the append (which may wait for room) run on the blocking pool; the sync is the
    /// log's commit worker's; this task only awaits the ticket.
    pub(crate) async fn write(
        self: &Arc<Self>,
        record: &MetaRecord,
        timestamp_ms: u64,
    ) -> BrokerResult<()> {
        let payload = serde_json::to_vec(record)
            .map_err(|e| BrokerError::Invalid(format!("metadata encoding: {e}")))?;
        let frees_space = matches!(
            record,
            MetaRecord::QueueDeleted { .. } | MetaRecord::StreamDeleted { .. }
        );
        // A record that frees no space keeps the deletions' room: counted as pending until it
        // is durable (or failed).
        let pending = if frees_space {
            0
        } else {
            payload.len() as u64 + RECORD_FRAMING_BYTES
        };
        let meta = self.clone();
        let ticket = tokio::task::spawn_blocking(move || {
            meta.heal_for(frees_space)?;
            if pending > 0 {
                meta.keep_deletion_room(pending)?;
            }
            let appended = meta.log.append(&[Record {
                record_type: META_JSON_V1,
                flags: 0,
                timestamp_ms,
                payload: &payload,
            }]);
            if appended.is_err() {
                meta.release_pending(pending);
            }
            Ok::<_, BrokerError>(appended?)
        })
        .await
        .map_err(|e| BrokerError::Closed(format!("metadata write: {e}")))?;
        let counted = ticket.is_ok();
        let result = match ticket {
            Ok(ticket) => ticket.await.map(|_| ()).map_err(BrokerError::from),
            Err(e) => Err(e),
        };
        if counted {
            self.release_pending(pending);
        }
        if result.is_err() && self.log.stopped().is_some() {
            self.figures.stopped(true);
        }
        result
    }

    /// A pending record of `record_bytes` is durable or failed (see `pending_bytes`).
    fn release_pending(&self, record_bytes: u64) {
        let mut pending = self.pending_bytes.lock().unwrap_or_else(|e| e.into_inner());
        *pending = pending.saturating_sub(record_bytes);
    }

    /// Before a record of `record_bytes` that frees no space: count it as pending if the tail
    /// keeps [`DELETION_ROOM_BYTES`] after it and the records pending before it; else roll to
    /// a new segment first, or refuse the record (429, reason disk) when the file system
    /// lacks room for that segment. Blocking (a roll waits for the appends before it and for
    /// its segment).
    fn keep_deletion_room(&self, record_bytes: u64) -> BrokerResult<()> {
        let needed = record_bytes + DELETION_ROOM_BYTES;
        // A new segment starts with one preallocation step: 64 KiB, or a small segment whole.
        let first_step = (64u64 << 10).min(self.segment_size_bytes);
        {
            let mut pending = self.pending_bytes.lock().unwrap_or_else(|e| e.into_inner());
            // A log without a segment (none written yet, or all handed back) makes one at its
            // next append: the room is that segment's first step, if the disk has it.
            let fresh = self.log.disk_bytes() == 0;
            let room = if fresh {
                first_step
            } else {
                self.log.tail_room_bytes()
            };
            if fresh {
                self.refuse_without(first_step + *pending + needed)?;
            }
            if room >= *pending + needed {
                *pending += record_bytes;
                return Ok(());
            }
        }
        // One writer rolls at a time; the next finds the new segment's room.
        let _rolling = self.rolling.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut pending = self.pending_bytes.lock().unwrap_or_else(|e| e.into_inner());
            if self.log.tail_room_bytes() >= *pending + needed {
                *pending += record_bytes;
                return Ok(());
            }
        }
        self.refuse_without(first_step + needed)?;
        self.log.roll()?.wait()?;
        *self.pending_bytes.lock().unwrap_or_else(|e| e.into_inner()) += record_bytes;
        Ok(())
    }

    /// `Limited` (reason disk) unless the disk holding the log has `bytes` free, as the gate
    /// last sampled it (unknown: no refusal).
    fn refuse_without(&self, bytes: u64) -> BrokerResult<()> {
        match self.gate.free_bytes(self.device) {
            Some(free) if free < bytes => Err(BrokerError::Limited {
                reason: "disk".into(),
                retry_after_ms: FULL_RETRY_AFTER_MS,
                message: format!(
                    "the disk holding the node metadata ({}) is full ({free} bytes free): \
                     declaring and changing settings wait until it has room, while deleting \
                     queues and streams still works; delete or purge queues or free space, \
                     then retry",
                    self.figures.dir.display()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Heal a stopped log if the gate says its file system is back above reserve (called
    /// every `METADATA_HEAL_INTERVAL`, so that the log heals like a partition's even when no
    /// metadata write comes). Blocking.
    pub(crate) fn maybe_heal(&self) {
        if self.log.stopped().is_none() || !self.gate.may_heal(self.device) {
            return;
        }
        if let Err(error) = self.heal() {
            tracing::warn!(%error, "healing the metadata log failed; will retry");
        }
    }

    fn heal(&self) -> BrokerResult<()> {
        let _healing = self.healing.lock().unwrap_or_else(|e| e.into_inner());
        if self.log.stopped().is_none() {
            return Ok(());
        }
        self.log.heal()?;
        self.figures.stopped(false);
        tracing::info!("metadata log healed; metadata writes resume");
        Ok(())
    }

    /// Heal the log if a write error stopped it, before writing a record. Like a partition's
    /// log, it heals once the gate says its file system is back above reserve; a queue deletion
    /// (`frees_space`) heals it at every level, reserve included, because deleting frees space
    /// and must never wait for it. Healing itself needs no free space: recovery only reads,
    /// renames and removes, and the cut of the unsynced tail writes inside the tail segment,
    /// which was allocated when it was created. The deletion record then fits in that same
    /// segment unless the segment is full (a metadata segment holds thousands of such records).
    fn heal_for(&self, frees_space: bool) -> BrokerResult<()> {
        let Some(stopped) = self.log.stopped() else {
            return Ok(());
        };
        if !frees_space && !self.gate.may_heal(self.device) {
            return Err(BrokerError::Log(stopped));
        }
        self.heal()
    }

    /// Close the log (blocking: the seal is synced).
    pub(crate) fn close(self) -> BrokerResult<()> {
        self.log.close()?;
        Ok(())
    }
}

/// The metadata log's stop and heal figures.
#[derive(Debug, Default)]
pub(crate) struct MetaFigures {
    pub(crate) dir: PathBuf,
    /// 1 while stopped.
    pub(crate) stopped: AtomicU64,
    pub(crate) stops: AtomicU64,
    pub(crate) heals: AtomicU64,
}

impl MetaFigures {
    fn stopped(&self, stopped: bool) {
        let was = self.stopped.swap(u64::from(stopped), Ordering::Relaxed) != 0;
        match (was, stopped) {
            (false, true) => self.stops.fetch_add(1, Ordering::Relaxed),
            (true, false) => self.heals.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
    }
}
