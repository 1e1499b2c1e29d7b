//! The node's streams (issue 18, `docs/streams.md`): declaring, opening at start, changing
//! retention, deleting, publishing to them, reading and committing cursors, and the timer that
//! runs retention and expires cursors. A child of `broker` because streams share its metadata:
//! one name space with queues, one id counter, the node's bounds, the metadata log.
//!
//! In a cluster, declares, retention changes and deletes go through the cluster's metadata
//! group (`ClusterMetadata`), which applies them on every node through the `*_replicated`
//! calls; a stream's partitions and its cursor log are then replicated groups
//! (`PartitionLogs`), all on one set of nodes, and its readers are served by the node leading
//! its cursor log ([`Broker::stream_reader_home`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use keratin_log::{Log, LogOptions, SizeClass};

use super::{blocking, BrokerInner, PendingPublish, Reservation};
use crate::error::{BrokerError, BrokerResult};
use crate::meta::{MetaRecord, StreamDecl};
use crate::partition::local_log::{remove_if_no_segments, LocalLog};
use crate::partition::log::{PartitionLog, PartitionPlace};
use crate::queue::validate_queue_name;
use crate::record::Message;
use crate::stream::cursor_log;
use crate::stream::{
    CursorLog, CursorState, Stream, StreamInfo, StreamPartition, StreamPartitionConfig,
    StreamSettings,
};
use crate::Broker;

/// How often the timer runs retention over every stream with a bound.
pub const RETENTION_INTERVAL: Duration = Duration::from_secs(1);
/// How often the timer expires unused cursors.
const CURSOR_EXPIRY_INTERVAL: Duration = Duration::from_secs(60);
/// A cursor not committed for this long is removed (Kafka's `offsets.retention.minutes`
/// default: 7 days).
pub const CURSOR_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

/// Where a stream reader starts in a partition without a cursor position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// The oldest message held.
    First,
    /// The newest message.
    Last,
    /// Only messages appended from now on.
    Next,
    /// This offset (the start if below it).
    Offset(u64),
    /// The first message appended at or after this time (ms since the epoch).
    Timestamp(u64),
}

fn stream_dir(storage: &Path, id: u64) -> PathBuf {
    storage.join("streams").join(id.to_string())
}

/// The cursor log's directory, beside partition 0's payload log.
fn cursors_dir(decl: &StreamDecl) -> BrokerResult<PathBuf> {
    let storage = decl
        .placement
        .first()
        .ok_or_else(|| BrokerError::Invalid(format!("stream {:?} has no partition", decl.name)))?;
    Ok(stream_dir(storage, decl.id).join("cursors"))
}

/// `settings` keeps `current`'s partitions (fixed at the declaration).
fn check_partitions(
    name: &str,
    current: &StreamSettings,
    settings: &StreamSettings,
) -> BrokerResult<()> {
    if current.partitions != settings.partitions {
        return Err(BrokerError::Invalid(format!(
            "stream {name:?} has {} partitions, fixed at its declaration; delete and \
             declare it again for {}",
            current.partitions, settings.partitions
        )));
    }
    Ok(())
}

/// A stream's payload logs (with their file systems) and cursor log as opened (blocking)
/// before their owners start.
type OpenedStream = (Vec<(Arc<dyn PartitionLog>, u64)>, Arc<dyn PartitionLog>);

impl Broker {
    /// Declare a stream. Declaring it again with identical settings is a no-op; with other
    /// settings it is a conflict; a name a queue holds is refused (one name space); past the
    /// node's bounds it is refused like a queue ([`BrokerError::NodeFull`]). `replicas` above
    /// 1 and `nodes` need a cluster, where streams are not built yet: refused with the reason.
    pub async fn declare_stream(
        &self,
        name: &str,
        settings: StreamSettings,
        replicas: Option<u32>,
        nodes: Vec<u64>,
    ) -> BrokerResult<StreamInfo> {
        validate_queue_name(name)?;
        settings.validate()?;
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            if replicas == Some(0) {
                return Err(BrokerError::Invalid(format!(
                    "stream {name:?}: replicas must be at least 1"
                )));
            }
            cluster
                .declare_stream(name.to_string(), settings, replicas, nodes)
                .await?;
            return self.stream_info(name);
        }
        if replicas.is_some_and(|r| r > 1) || !nodes.is_empty() {
            return Err(BrokerError::Invalid(format!(
                "stream {name:?}: replicas and nodes need a cluster, and this node runs alone \
                 (one copy); declare it without --replicas and --nodes"
            )));
        }
        // On a task of its own: a caller that goes away does not cut the declare between its
        // durable record and the start of its logs.
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move { broker.declare_stream_here(&name, settings, None).await })
            .await
            .map_err(|e| BrokerError::Closed(format!("stream declare: {e}")))?
    }

    /// Declare stream `name` as the cluster's metadata group decided it: id `id`, partition
    /// `index`'s replicas on `replicas[index]` (the cursor log's on partition 0's). Declaring
    /// it again changes nothing; another stream of that name here is a conflict.
    pub async fn declare_stream_replicated(
        &self,
        id: u64,
        name: &str,
        settings: StreamSettings,
        replicas: Vec<Vec<u64>>,
    ) -> BrokerResult<StreamInfo> {
        validate_queue_name(name)?;
        settings.validate()?;
        if replicas.len() != settings.partitions as usize || replicas.iter().any(Vec::is_empty) {
            return Err(BrokerError::Invalid(format!(
                "stream {name:?}: {} partitions need one non-empty replica set each, got {}",
                settings.partitions,
                replicas.len()
            )));
        }
        if self.inner.config.partition_logs.is_none() {
            return Err(BrokerError::Invalid(format!(
                "stream {name:?} is replicated, and this node runs without a cluster"
            )));
        }
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            broker
                .declare_stream_here(&name, settings, Some((id, replicas)))
                .await
        })
        .await
        .map_err(|e| BrokerError::Closed(format!("stream declare: {e}")))?
    }

    /// Declares the stream on this node: `cluster` is the id and replica sets the cluster's
    /// metadata group gave it (`None`: a single node's, id from the node's counter).
    async fn declare_stream_here(
        &self,
        name: &str,
        settings: StreamSettings,
        cluster: Option<(u64, Vec<Vec<u64>>)>,
    ) -> BrokerResult<StreamInfo> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let (id, reservation) = {
            let mut state = inner.meta_state();
            if state.catalog.by_name(name).is_some() {
                return Err(BrokerError::NameTaken {
                    name: name.into(),
                    kind: "queue",
                });
            }
            if let Some(existing) = state.catalog.stream_by_name(name) {
                let other_id = cluster.as_ref().is_some_and(|(id, _)| *id != existing.id);
                if other_id {
                    return Err(BrokerError::Conflict {
                        name: name.into(),
                        existing: format!(
                            "a stream declared on this node outside the cluster (id {})",
                            existing.id
                        ),
                    });
                }
                if existing.settings != settings && cluster.is_none() {
                    return Err(BrokerError::Conflict {
                        name: name.into(),
                        existing: settings_text(&existing.settings),
                    });
                }
                drop(state);
                drop(claim);
                return self.stream_info(name);
            }
            inner.check_room(&state, "stream", name, settings.partitions)?;
            let id = match &cluster {
                Some((id, _)) => *id,
                None => state.catalog.next_id,
            };
            state.catalog.next_id = state.catalog.next_id.max(id) + 1;
            state.claims.reserve(settings.partitions);
            let reservation = Reservation {
                inner,
                partitions: settings.partitions,
                done: false,
            };
            (id, reservation)
        };
        let placer = inner.clone();
        let partitions = settings.partitions;
        let placement = blocking(move || placer.place(partitions)).await?;
        let decl = StreamDecl {
            id,
            name: name.into(),
            settings,
            placement,
            replicas: cluster.map(|(_, replicas)| replicas).unwrap_or_default(),
        };
        let record = MetaRecord::StreamDeclared(decl.clone());
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        reservation.applied(&mut inner.meta_state(), record);
        if let Err(error) = inner.start_stream(decl.clone()).await {
            tracing::warn!(stream = name, %error, "opening a declared stream's logs failed; undoing the declaration");
            inner.undo_stream_declare(&decl).await;
            return Err(error);
        }
        drop(claim);
        self.stream_info(name)
    }

    /// Change a stream's retention (its partitions are fixed: a different count is refused).
    /// Durable in the metadata before the partitions use it.
    pub async fn set_stream_settings(
        &self,
        name: &str,
        settings: StreamSettings,
    ) -> BrokerResult<StreamInfo> {
        self.update_stream_settings(name, |_| Ok(settings)).await
    }

    /// [`Broker::set_stream_settings`] to what `change` makes of the current settings, under
    /// the stream's claim (two updates of one stream apply one after the other).
    pub async fn update_stream_settings(
        &self,
        name: &str,
        change: impl FnOnce(StreamSettings) -> BrokerResult<StreamSettings>,
    ) -> BrokerResult<StreamInfo> {
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            let decl = self.inner.stream_declared(name)?;
            let settings = change(decl.settings)?;
            settings.validate()?;
            check_partitions(name, &decl.settings, &settings)?;
            cluster
                .set_stream_settings(name.to_string(), settings)
                .await?;
            return self.stream_info(name);
        }
        self.update_stream_settings_here(name, change).await
    }

    /// New retention of stream `name`, as the cluster's metadata group decided it.
    pub async fn set_stream_settings_replicated(
        &self,
        name: &str,
        settings: StreamSettings,
    ) -> BrokerResult<StreamInfo> {
        self.update_stream_settings_here(name, |_| Ok(settings))
            .await
    }

    async fn update_stream_settings_here(
        &self,
        name: &str,
        change: impl FnOnce(StreamSettings) -> BrokerResult<StreamSettings>,
    ) -> BrokerResult<StreamInfo> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let decl = inner.stream_declared(name)?;
        let settings = change(decl.settings)?;
        settings.validate()?;
        check_partitions(name, &decl.settings, &settings)?;
        if decl.settings != settings {
            let record = MetaRecord::StreamSettingsChanged {
                id: decl.id,
                settings,
            };
            inner
                .meta_log()?
                .write(&record, (inner.config.clock)())
                .await?;
            inner.meta_state().catalog.apply(record);
            inner.stream(name)?.set_settings(settings)?;
        }
        drop(claim);
        self.stream_info(name)
    }

    /// Delete a stream: its readers end, its logs and cursors go. The deletion is durable
    /// before any file goes (a crash in between removes the rest at the next start).
    pub async fn delete_stream(&self, name: &str) -> BrokerResult<()> {
        if let Some(cluster) = &self.inner.config.cluster_metadata {
            self.inner.stream_declared(name)?;
            return cluster.delete_stream(name.to_string()).await;
        }
        self.delete_stream_replicated(name).await
    }

    /// Delete stream `name` on this node, as the cluster's metadata group decided (and on a
    /// single node, as asked).
    pub async fn delete_stream_replicated(&self, name: &str) -> BrokerResult<()> {
        let broker = self.clone();
        let name = name.to_string();
        tokio::spawn(async move { broker.delete_stream_here(&name).await })
            .await
            .map_err(|e| BrokerError::Closed(format!("stream delete: {e}")))?
    }

    async fn delete_stream_here(&self, name: &str) -> BrokerResult<()> {
        let inner = &self.inner;
        let claim = inner.claim(name).await?;
        let decl = inner.stream_declared(name)?;
        let record = MetaRecord::StreamDeleted { id: decl.id };
        inner
            .meta_log()?
            .write(&record, (inner.config.clock)())
            .await?;
        inner.meta_state().catalog.apply(record);
        let stream = inner.streams_write().remove(name);
        if let Some(stream) = stream {
            if let Err(error) = stream.delete_logs().await {
                tracing::warn!(stream = name, %error, "deleting a deleted stream's logs failed; its files go anyway");
            }
        }
        let remover = inner.clone();
        let id = decl.id;
        blocking(move || remover.remove_stream_dirs(id)).await?;
        drop(claim);
        Ok(())
    }

    /// `Ok` when this node serves stream `name`'s readers: it leads the stream's cursor log
    /// (always, on a single node), so it holds a copy of every partition, commits cursors and
    /// coordinates groups. Else [`BrokerError::NotLeader`] naming the node that does
    /// (partition [`crate::stream::cursor_log::CURSOR_LOG_PARTITION`]).
    pub fn stream_reader_home(&self, name: &str) -> BrokerResult<()> {
        let role = self.inner.stream(name)?.cursor_log_role();
        if role.leading {
            return Ok(());
        }
        Err(role.not_leader(name, crate::stream::cursor_log::CURSOR_LOG_PARTITION))
    }

    /// Stream `name`, for reading.
    pub fn stream(&self, name: &str) -> BrokerResult<Arc<Stream>> {
        self.inner.stream(name)
    }

    /// Whether `name` is a declared stream.
    pub fn is_stream(&self, name: &str) -> bool {
        self.inner.stream(name).is_ok()
    }

    /// Stream `name`'s settings and figures.
    pub fn stream_info(&self, name: &str) -> BrokerResult<StreamInfo> {
        Ok(self.inner.stream(name)?.info())
    }

    /// Every stream's settings and figures, by name.
    pub fn list_streams(&self) -> Vec<StreamInfo> {
        let streams: Vec<Arc<Stream>> = self.inner.streams_read().values().cloned().collect();
        streams.iter().map(|s| s.info()).collect()
    }

    /// Where a reader of `partition` starts: `from`, resolved against what the partition
    /// holds now.
    pub async fn stream_position(
        &self,
        name: &str,
        partition: u32,
        from: ReadFrom,
    ) -> BrokerResult<u64> {
        let partition = self.inner.stream(name)?.partition(partition)?;
        let figures = partition.figures();
        Ok(match from {
            ReadFrom::First => figures.start,
            ReadFrom::Last => figures.end.saturating_sub(1).max(figures.start),
            ReadFrom::Next => figures.end,
            ReadFrom::Offset(offset) => offset,
            ReadFrom::Timestamp(at) => partition.offset_at(at).await?,
        })
    }

    /// Sets cursor `cursor` of stream `name` to `positions` (partition, offset of the next
    /// message to read), answered once durable. Works at every disk and memory level.
    pub async fn commit_cursor(
        &self,
        name: &str,
        cursor: &str,
        positions: Vec<(u32, u64)>,
    ) -> BrokerResult<()> {
        let stream = self.inner.stream(name)?;
        stream
            .commit(cursor, positions, (self.inner.config.clock)())
            .await
    }

    /// A stream reader's place under `consumers_max` (shared with queue consumers): refused
    /// with [`BrokerError::Limited`] (`consumers`) past it; given back when dropped.
    pub fn stream_reader_slot(&self) -> BrokerResult<crate::consumer::ReaderSlot> {
        self.inner
            .consumer_slot()
            .map(crate::consumer::ReaderSlot::new)
    }

    /// Cursor `cursor` of stream `name`, if it has positions.
    pub fn cursor(&self, name: &str, cursor: &str) -> BrokerResult<Option<CursorState>> {
        Ok(self.inner.stream(name)?.cursor(cursor))
    }

    /// Removes cursor `cursor` of stream `name`: whether it existed.
    pub async fn delete_cursor(&self, name: &str, cursor: &str) -> BrokerResult<bool> {
        let stream = self.inner.stream(name)?;
        stream
            .delete_cursor(cursor, (self.inner.config.clock)())
            .await
    }

    /// Runs one retention pass over every stream now (the timer runs one every
    /// [`RETENTION_INTERVAL`]).
    pub async fn run_stream_retention(&self) -> BrokerResult<()> {
        self.inner.run_retention().await
    }
}

impl BrokerInner {
    fn streams_read(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, std::collections::BTreeMap<String, Arc<Stream>>> {
        self.streams.read().unwrap_or_else(|e| e.into_inner())
    }

    fn streams_write(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, std::collections::BTreeMap<String, Arc<Stream>>> {
        self.streams.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn stream(&self, name: &str) -> BrokerResult<Arc<Stream>> {
        self.streams_read()
            .get(name)
            .cloned()
            .ok_or_else(|| BrokerError::StreamNotFound(name.into()))
    }

    fn stream_declared(&self, name: &str) -> BrokerResult<StreamDecl> {
        self.meta_state()
            .catalog
            .stream_by_name(name)
            .cloned()
            .ok_or_else(|| BrokerError::StreamNotFound(name.into()))
    }

    /// Route messages to the stream's partitions and hand them over now (see
    /// `BrokerInner::dispatch_with`).
    pub(super) fn dispatch_stream(
        &self,
        mut pending: PendingPublish,
        messages: Vec<Message>,
        joined: bool,
    ) -> PendingPublish {
        let stream = match self.stream(&pending.queue) {
            Ok(stream) => stream,
            Err(e) => {
                pending.results = messages.iter().map(|_| Some(Err(e.clone()))).collect();
                return pending;
            }
        };
        let n = stream.partition_count() as usize;
        let mut batches: Vec<(Vec<usize>, Vec<Message>)> = vec![(Vec::new(), Vec::new()); n];
        for (i, message) in messages.into_iter().enumerate() {
            if joined {
                let mut payload = Vec::with_capacity(message.body.len() + 16);
                let checked = message
                    .encode(&mut payload)
                    .and_then(|()| self.check_record_size(&payload));
                if let Err(e) = checked {
                    pending.results[i] = Some(Err(e));
                    continue;
                }
            }
            let p = stream.route(&message);
            batches[p].0.push(i);
            batches[p].1.push(message);
        }
        let timestamp_ms = (self.config.clock)();
        for (p, (indexes, batch)) in batches.into_iter().enumerate() {
            if indexes.is_empty() {
                continue;
            }
            let reply = match stream.partition(p as u32) {
                Ok(partition) => partition.dispatch(batch, timestamp_ms),
                Err(e) => {
                    for i in indexes {
                        pending.results[i] = Some(Err(e.clone()));
                    }
                    continue;
                }
            };
            pending.appends.push((p as u32, indexes, reply));
        }
        pending
    }

    /// Open every declared stream at start, one after another (their rebuilds read little:
    /// from the last checkpoint on).
    pub(super) async fn open_streams(self: &Arc<Self>, decls: Vec<StreamDecl>) -> BrokerResult<()> {
        for decl in decls {
            self.start_stream(decl).await?;
        }
        Ok(())
    }

    /// Open a declared stream's logs, start its partitions' owners and publish it.
    async fn start_stream(self: &Arc<Self>, decl: StreamDecl) -> BrokerResult<()> {
        let opener = self.clone();
        let owned = decl.clone();
        let (logs, cursors) = blocking(move || opener.open_stream_logs(&owned)).await?;
        let mut partitions = Vec::with_capacity(logs.len());
        for (index, ((log, device), storage)) in logs.into_iter().zip(&decl.placement).enumerate() {
            let config = StreamPartitionConfig {
                stream: decl.name.clone(),
                index: index as u32,
                dir: stream_dir(storage, decl.id).join(index.to_string()),
                device,
                segment_bytes: self.config.segment_size_bytes,
                settings: decl.settings,
                retention_as_written: true,
            };
            partitions.push(StreamPartition::open(log, self.config.gate.clone(), config).await?);
        }
        let cursors =
            CursorLog::start(&decl.name, cursors, self.config.segment_size_bytes / 8).await?;
        let stream = Arc::new(Stream::new(
            decl.id,
            decl.name.clone(),
            decl.settings,
            partitions,
            cursors,
        ));
        self.streams_write().insert(decl.name.clone(), stream);
        Ok(())
    }

    /// Open a stream's payload logs (with their file systems) and its cursor log (blocking).
    fn open_stream_logs(&self, decl: &StreamDecl) -> BrokerResult<OpenedStream> {
        let io = self.config.io.clone();
        let mut logs = Vec::with_capacity(decl.placement.len());
        for (index, storage) in decl.placement.iter().enumerate() {
            let dir = stream_dir(storage, decl.id).join(index.to_string());
            let log: Arc<dyn PartitionLog> = match decl.replicas.get(index) {
                Some(replicas) => self.open_replicated(
                    decl,
                    index as u32,
                    dir.clone(),
                    replicas,
                    SizeClass::Full,
                )?,
                None => {
                    let options = LogOptions {
                        full_segment_size_bytes: self.config.segment_size_bytes,
                        ..LogOptions::default()
                    };
                    let log = Log::open(io.clone(), &dir, options, Some(self.pool.clone()))?;
                    Arc::new(LocalLog::new(
                        log,
                        io.clone(),
                        self.config.segment_size_bytes,
                    ))
                }
            };
            let device = io
                .device_id(storage)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            logs.push((log, device));
        }
        let cursors = match decl.replicas.first() {
            Some(replicas) => self.open_replicated(
                decl,
                cursor_log::CURSOR_LOG_GROUP_INDEX,
                cursors_dir(decl)?,
                replicas,
                SizeClass::Small,
            )?,
            None => cursor_log::open_local(
                io,
                &cursors_dir(decl)?,
                self.config.segment_size_bytes,
                Some(self.pool.clone()),
            )?,
        };
        Ok((logs, cursors))
    }

    /// This node's copy of one of a replicated stream's groups (a partition's payload log, or
    /// the cursor log), or its stand-in where the node holds none (blocking).
    fn open_replicated(
        &self,
        decl: &StreamDecl,
        index: u32,
        dir: PathBuf,
        replicas: &[u64],
        size_class: SizeClass,
    ) -> BrokerResult<Arc<dyn PartitionLog>> {
        let logs = self.config.partition_logs.as_ref().ok_or_else(|| {
            BrokerError::Invalid(format!(
                "stream {:?} is replicated, and this node runs without a cluster; start it \
                 with its [cluster] settings",
                decl.name
            ))
        })?;
        logs.open(&PartitionPlace {
            io: self.config.io.clone(),
            pool: self.pool.clone(),
            segment_size_bytes: self.config.segment_size_bytes,
            size_class,
            queue_id: decl.id,
            queue: decl.name.clone(),
            index,
            dir,
            replicas: replicas.to_vec(),
            formation: None,
        })
    }

    /// A declared stream whose logs could not be opened: its deletion is written and what was
    /// created removed (best effort: else the next start does it).
    async fn undo_stream_declare(self: &Arc<Self>, decl: &StreamDecl) {
        let record = MetaRecord::StreamDeleted { id: decl.id };
        let written = match self.meta_log() {
            Ok(meta) => meta.write(&record, (self.config.clock)()).await,
            Err(e) => Err(e),
        };
        if let Err(error) = written {
            tracing::warn!(stream = decl.name, %error, "undoing a failed stream declare failed; the next start retries");
            return;
        }
        self.meta_state().catalog.apply(record);
        let remover = self.clone();
        let id = decl.id;
        if let Err(error) = blocking(move || remover.remove_stream_dirs(id)).await {
            tracing::warn!(stream = decl.name, %error, "removing a failed stream declare's files failed; the next start retries");
        }
    }

    /// Stream directories the metadata no longer names go back to the pool (blocking).
    pub(super) fn remove_stream_orphans(
        &self,
        declared: &std::collections::BTreeSet<u64>,
        declared_ever: &std::collections::BTreeSet<u64>,
    ) -> BrokerResult<()> {
        let io = self.config.io.as_ref();
        for storage in &self.config.dirs {
            let streams = storage.join("streams");
            if !io.exists(&streams).unwrap_or(false) {
                continue;
            }
            let names = io.read_dir(&streams).map_err(|e| {
                keratin_log::LogError::Invalid(format!("{}: {e}", streams.display()))
            })?;
            for name in names {
                let Ok(id) = name.parse::<u64>() else {
                    continue;
                };
                if !declared.contains(&id) && !declared_ever.contains(&id) {
                    return Err(self.metadata_lost("stream", id, &streams.join(&name)));
                }
                if !declared.contains(&id) {
                    tracing::info!(stream_id = id, "removing the files of a deleted stream");
                    self.remove_stream_dirs(id)?;
                }
            }
        }
        Ok(())
    }

    /// Remove stream `id`'s logs (their segments go back to the pool) and directories
    /// (blocking; its logs must be closed).
    fn remove_stream_dirs(&self, id: u64) -> BrokerResult<()> {
        let io = self.config.io.clone();
        for storage in &self.config.dirs {
            let dir = stream_dir(storage, id);
            if !io.exists(&dir).unwrap_or(false) {
                continue;
            }
            let names = io
                .read_dir(&dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
            for name in names {
                let log_dir = dir.join(&name);
                if remove_if_no_segments(io.as_ref(), &log_dir)? {
                    continue;
                }
                let size_class = if name == "cursors" {
                    SizeClass::Small
                } else {
                    SizeClass::Full
                };
                let options = LogOptions {
                    full_segment_size_bytes: self.config.segment_size_bytes,
                    size_class,
                    ..LogOptions::default()
                };
                Log::open(io.clone(), &log_dir, options, Some(self.pool.clone()))?.delete()?;
            }
            io.remove_dir(&dir)
                .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
        }
        Ok(())
    }

    /// One retention pass over every stream with a bound.
    async fn run_retention(&self) -> BrokerResult<()> {
        let now_ms = (self.config.clock)();
        let streams: Vec<Arc<Stream>> = self.streams_read().values().cloned().collect();
        for stream in streams {
            if !stream.settings().has_retention() {
                continue;
            }
            if let Err(error) = stream.retention(now_ms).await {
                tracing::warn!(stream = stream.name(), %error, "a retention pass failed; the next one tries again");
            }
        }
        Ok(())
    }

    async fn expire_cursors(&self) {
        let now_ms = (self.config.clock)();
        let expiry_ms = CURSOR_EXPIRY.as_millis() as u64;
        let streams: Vec<Arc<Stream>> = self.streams_read().values().cloned().collect();
        for stream in streams {
            match stream.expire_cursors(now_ms, expiry_ms).await {
                Ok(expired) if !expired.is_empty() => {
                    tracing::info!(stream = stream.name(), cursors = ?expired, "removed cursors unused for {} days", CURSOR_EXPIRY.as_secs() / 86_400);
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(stream = stream.name(), %error, "expiring cursors failed; the next pass tries again");
                }
            }
        }
    }

    /// Close every stream (shutdown).
    pub(super) async fn close_streams(&self) -> BrokerResult<()> {
        let streams: Vec<Arc<Stream>> = {
            let mut map = self.streams_write();
            std::mem::take(&mut *map).into_values().collect()
        };
        let mut first_error = None;
        for stream in streams {
            if let Err(error) = stream.close().await {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Runs retention every [`RETENTION_INTERVAL`] and expires cursors every
/// [`CURSOR_EXPIRY_INTERVAL`], until the broker goes.
pub(super) fn spawn_stream_timer(broker: Weak<BrokerInner>) {
    tokio::spawn(async move {
        let mut ticks: u64 = 0;
        let expiry_every = CURSOR_EXPIRY_INTERVAL.as_secs() / RETENTION_INTERVAL.as_secs();
        loop {
            tokio::time::sleep(RETENTION_INTERVAL).await;
            let Some(inner) = broker.upgrade() else {
                return;
            };
            if inner.meta_state().closed {
                return;
            }
            let _ = inner.run_retention().await;
            ticks += 1;
            if ticks.is_multiple_of(expiry_every) {
                inner.expire_cursors().await;
            }
        }
    });
}

/// A stream's settings as people read them (in a conflict's message).
fn settings_text(settings: &StreamSettings) -> String {
    let bound = |value: Option<u64>| value.map_or_else(|| "none".to_string(), |v| v.to_string());
    format!(
        "partitions = {}, max_bytes = {}, max_age_ms = {}, max_messages = {}",
        settings.partitions,
        bound(settings.max_bytes),
        bound(settings.max_age_ms),
        bound(settings.max_messages)
    )
}
