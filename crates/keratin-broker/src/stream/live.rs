//! A declared stream on one node: its partitions' owners, its cursor log and what they count
//! (`docs/streams.md`). The broker keeps one [`Stream`] per declared stream; this file owns
//! routing a message to its partition, the calls to its cursor log's owner and the stream's
//! figures.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use crate::error::{BrokerError, BrokerResult};
use crate::queue::route;
use crate::record::Message;
use crate::stream::cursor_log::{CursorLog, CursorLogFigures};
use crate::stream::cursors::CursorState;
use crate::stream::groups::{GroupInfo, GroupMember, Groups};
use crate::stream::partition::{bound_index, StreamPartition, StreamPartitionFigures};
use crate::stream::records::StreamSettings;
use crate::stream::retention::{Bound, Removal};

/// Retention's removals since the node started, per bound (`size`, `age`, `count`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// Segments removed.
    pub segments: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// A stream's state as readers of the broker see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    /// Its name.
    pub name: String,
    /// Its settings now.
    pub settings: StreamSettings,
    /// Each partition's figures, by index.
    pub partitions: Vec<StreamPartitionFigures>,
    /// Each partition's log directory, by index.
    pub partition_dirs: Vec<std::path::PathBuf>,
    /// Retention's removals by bound since the node started.
    pub removed: BTreeMap<&'static str, Removed>,
    /// Readers moved to a partition's start because retention passed their position.
    pub cursors_moved: u64,
    /// Cursors kept in its cursor log.
    pub cursors: u64,
    /// Its consumer groups on this node, with their members.
    pub groups: Vec<GroupInfo>,
}

impl StreamInfo {
    /// Messages held over all partitions.
    pub fn messages(&self) -> u64 {
        self.partitions.iter().map(|p| p.messages).sum()
    }

    /// Bytes of its partitions' logs on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.partitions.iter().map(|p| p.disk_bytes).sum()
    }
}

/// One declared stream.
#[derive(Debug)]
pub struct Stream {
    pub(crate) id: u64,
    pub(crate) name: String,
    settings: RwLock<StreamSettings>,
    /// Taken out (empty) when the stream closes: a partition's log closes once its last
    /// handle goes, so nothing else keeps one for long.
    partitions: RwLock<Vec<StreamPartition>>,
    partition_count: usize,
    cursors: CursorLog,
    round_robin: AtomicU64,
    cursors_moved: AtomicU64,
    groups: Groups,
}

impl Stream {
    pub(crate) fn new(
        id: u64,
        name: String,
        settings: StreamSettings,
        partitions: Vec<StreamPartition>,
        cursors: CursorLog,
    ) -> Stream {
        assert_eq!(
            partitions.len(),
            settings.partitions as usize,
            "a stream opens every partition it declares"
        );
        Stream {
            id,
            name,
            settings: RwLock::new(settings),
            partition_count: partitions.len(),
            partitions: RwLock::new(partitions),
            cursors,
            round_robin: AtomicU64::new(0),
            cursors_moved: AtomicU64::new(0),
            groups: Groups::new(settings.partitions),
        }
    }

    /// Its id (names its directories).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its settings now.
    pub fn settings(&self) -> StreamSettings {
        *self.settings.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Its partition count.
    pub fn partition_count(&self) -> u32 {
        self.partition_count as u32
    }

    /// The partition `message` goes to: by its key's hash, else as a queue's (a message with
    /// neither key nor producer round robin over the partitions this node leads).
    pub(crate) fn route(&self, message: &Message) -> usize {
        let partitions = self.partitions.read().unwrap_or_else(|p| p.into_inner());
        route(message, self.partition_count, &self.round_robin, |p| {
            partitions.get(p).is_some_and(StreamPartition::is_leading)
        })
    }

    /// A handle on partition `index` (hold it only for one call: the log closes once its
    /// last handle goes), or the error naming the stream's partitions.
    pub fn partition(&self, index: u32) -> BrokerResult<StreamPartition> {
        if index as usize >= self.partition_count {
            return Err(BrokerError::Invalid(format!(
                "stream {:?} has partitions 0 to {}, not {index}",
                self.name,
                self.partition_count.saturating_sub(1)
            )));
        }
        self.partitions_now()
            .get(index as usize)
            .cloned()
            .ok_or_else(|| BrokerError::Closed(format!("stream {:?}", self.name)))
    }

    /// Handles on every partition (empty once closed).
    pub(crate) fn partitions_now(&self) -> Vec<StreamPartition> {
        self.partitions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Applies new retention (the partition count never changes).
    pub(crate) fn set_settings(&self, settings: StreamSettings) -> BrokerResult<()> {
        for partition in self.partitions_now() {
            partition.set_settings(settings)?;
        }
        *self.settings.write().unwrap_or_else(|p| p.into_inner()) = settings;
        Ok(())
    }

    /// One retention pass over every partition at `now_ms` (the partitions count what each
    /// removed, by bound).
    pub(crate) async fn retention(&self, now_ms: u64) -> BrokerResult<Vec<Removal>> {
        let mut removals = Vec::new();
        for partition in self.partitions_now() {
            if let Some(removal) = partition.retention(now_ms).await? {
                removals.push(removal);
            }
        }
        Ok(removals)
    }

    /// Counts a reader moved to a partition's start (retention passed its position).
    pub fn count_moved(&self) {
        self.cursors_moved.fetch_add(1, Ordering::Relaxed);
    }

    /// Its figures now.
    pub fn info(&self) -> StreamInfo {
        let cursors = self.cursors.table().len() as u64;
        let handles = self.partitions_now();
        let partitions: Vec<StreamPartitionFigures> = handles.iter().map(|p| p.figures()).collect();
        let partition_dirs = handles.iter().map(|p| p.dir().to_path_buf()).collect();
        let mut removed = BTreeMap::new();
        for bound in [Bound::Size, Bound::Age, Bound::Count] {
            let (segments, bytes) = partitions
                .iter()
                .map(|p| p.removed_by_bound[bound_index(bound)])
                .fold((0, 0), |(s, b), (ps, pb)| (s + ps, b + pb));
            if segments > 0 {
                removed.insert(bound.name(), Removed { segments, bytes });
            }
        }
        StreamInfo {
            name: self.name.clone(),
            settings: self.settings(),
            partitions,
            partition_dirs,
            removed,
            cursors_moved: self.cursors_moved.load(Ordering::Relaxed),
            cursors,
            groups: self.groups.info(),
        }
    }

    /// Joins the consumer group reading with cursor `cursor` (`docs/streams.md`, "Reading").
    pub fn join_group(&self, cursor: &str) -> BrokerResult<GroupMember> {
        self.groups.join(cursor)
    }

    /// The group member reading `partition` with cursor `cursor`, if a group does.
    pub fn group_holder(&self, cursor: &str, partition: u32) -> Option<u64> {
        self.groups.holder(cursor, partition)
    }

    /// Cursor `name`'s positions, if it has any.
    pub fn cursor(&self, name: &str) -> Option<CursorState> {
        self.cursors.get(name)
    }

    /// Every cursor with its positions.
    pub fn cursor_list(&self) -> Vec<(String, CursorState)> {
        self.cursors.list()
    }

    /// Who leads its cursor log, as this node knows.
    pub fn cursor_log_role(&self) -> crate::partition::log::Role {
        self.cursors.role()
    }

    /// Its cursor log's figures.
    pub fn cursor_log_figures(&self) -> CursorLogFigures {
        self.cursors.figures()
    }

    /// Sets cursor `name`'s positions (partition, next offset), answered once committed.
    pub(crate) async fn commit(
        &self,
        name: &str,
        positions: Vec<(u32, u64)>,
        now_ms: u64,
    ) -> BrokerResult<()> {
        for (partition, _) in &positions {
            self.partition(*partition)?;
        }
        self.cursors.commit(name, &positions, now_ms).await
    }

    /// Removes cursor `name`: whether it existed.
    pub(crate) async fn delete_cursor(&self, name: &str, now_ms: u64) -> BrokerResult<bool> {
        self.cursors.delete(name, now_ms).await
    }

    /// Removes cursors unused for `expiry_ms`: their names.
    pub(crate) async fn expire_cursors(
        &self,
        now_ms: u64,
        expiry_ms: u64,
    ) -> BrokerResult<Vec<String>> {
        self.cursors.expire(now_ms, expiry_ms).await
    }

    /// Closes its partitions and its cursor log.
    pub(crate) async fn close(&self) -> BrokerResult<()> {
        self.stop(false).await
    }

    /// Closes its partitions and cursor log and deletes this node's copies of their logs.
    pub(crate) async fn delete_logs(&self) -> BrokerResult<()> {
        self.stop(true).await
    }

    async fn stop(&self, delete: bool) -> BrokerResult<()> {
        let mut first_error = None;
        let partitions =
            std::mem::take(&mut *self.partitions.write().unwrap_or_else(|p| p.into_inner()));
        for partition in partitions {
            let stopped = if delete {
                partition.delete().await
            } else {
                partition.close().await
            };
            if let Err(error) = stopped {
                first_error.get_or_insert(error);
            }
        }
        let stopped = if delete {
            self.cursors.delete_log().await
        } else {
            self.cursors.close().await
        };
        if let Err(error) = stopped {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}
