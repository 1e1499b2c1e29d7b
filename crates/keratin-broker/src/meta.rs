//! The node metadata log: queue declarations (with the placement of their partitions) and
//! deletions, and the node's runtime setting overrides, as JSON records in a small-class log,
//! replayed at start. JSON because these records
//! are rare, small and read by people debugging a node; the hot path never touches them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use keratin_log::{Io, Log, LogOptions, Record, SegmentPool, SizeClass};
use serde::{Deserialize, Serialize};

use crate::error::{BrokerError, BrokerResult};
use crate::gate::PublishGate;
use crate::queue::QueueSettings;

/// Record type of a JSON metadata record, format 1.
const META_JSON_V1: u8 = 1;

/// A declared queue as the metadata log knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct QueueDecl {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) settings: QueueSettings,
    /// The storage directory of each partition, by index.
    pub(crate) placement: Vec<PathBuf>,
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
    /// The node's runtime setting overrides, whole (dotted key to value). The broker stores
    /// them without interpreting them: the server owns their meaning and validation.
    NodeSettingsChanged {
        overrides: BTreeMap<String, serde_json::Value>,
    },
}

/// The metadata log and what it says.
#[derive(Debug)]
pub(crate) struct Meta {
    log: Log,
    /// The file system holding the log, as the gate knows it.
    device: u64,
    gate: Arc<dyn PublishGate>,
    /// Stop and heal figures, read without the metadata lock (metrics, attention items).
    pub(crate) figures: Arc<MetaFigures>,
    pub(crate) queues: BTreeMap<u64, QueueDecl>,
    pub(crate) next_id: u64,
    pub(crate) node_settings: BTreeMap<String, serde_json::Value>,
}

impl Meta {
    pub(crate) fn open(
        io: Arc<dyn Io>,
        dir: &Path,
        full_segment_size_bytes: u64,
        pool: SegmentPool,
        gate: Arc<dyn PublishGate>,
    ) -> BrokerResult<Meta> {
        let options = LogOptions {
            full_segment_size_bytes,
            size_class: SizeClass::Small,
            ..LogOptions::default()
        };
        let log = Log::open(io.clone(), dir, options, Some(pool))?;
        // The parent's: a log creates its own directory at its first append.
        let device = io
            .device_id(dir.parent().unwrap_or(dir))
            .map_err(|e| keratin_log::LogError::Invalid(format!("{}: {e}", dir.display())))?;
        let mut meta = Meta {
            log,
            device,
            gate,
            figures: Arc::new(MetaFigures {
                dir: dir.to_path_buf(),
                ..MetaFigures::default()
            }),
            queues: BTreeMap::new(),
            next_id: 1,
            node_settings: BTreeMap::new(),
        };
        let records: Vec<_> = meta.log.reader(meta.log.start_offset()).collect();
        for record in records {
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
            meta.apply(decoded);
        }
        Ok(meta)
    }

    fn apply(&mut self, record: MetaRecord) {
        match record {
            MetaRecord::QueueDeclared(decl) => {
                self.next_id = self.next_id.max(decl.id + 1);
                self.queues.insert(decl.id, decl);
            }
            MetaRecord::QueueDeleted { id } => {
                self.queues.remove(&id);
            }
            MetaRecord::QueueSettingsChanged { id, settings } => {
                if let Some(decl) = self.queues.get_mut(&id) {
                    decl.settings = settings;
                }
            }
            MetaRecord::NodeSettingsChanged { overrides } => {
                self.node_settings = overrides;
            }
        }
    }

    /// Append a record, wait until it is durable, then apply it. A log stopped by an earlier
    /// write error is healed first (see [`Meta::heal_for`]).
    pub(crate) async fn write(
        &mut self,
        record: MetaRecord,
        timestamp_ms: u64,
    ) -> BrokerResult<()> {
        self.heal_for(&record)?;
        let payload = serde_json::to_vec(&record)
            .map_err(|e| BrokerError::Invalid(format!("metadata encoding: {e}")))?;
        let result = self.append(&payload, timestamp_ms).await;
        if result.is_err() && self.log.stopped().is_some() {
            self.figures.stopped(true);
        }
        result?;
        self.apply(record);
        Ok(())
    }

    async fn append(&self, payload: &[u8], timestamp_ms: u64) -> BrokerResult<()> {
        let ticket = self.log.append(&[Record {
            record_type: META_JSON_V1,
            flags: 0,
            timestamp_ms,
            payload,
        }])?;
        ticket.await?;
        Ok(())
    }

    /// Heal a stopped log if the gate says its file system is back above reserve (called
    /// every `METADATA_HEAL_INTERVAL`, so that the log heals like a partition's even when no
    /// metadata write comes).
    pub(crate) fn maybe_heal(&mut self) {
        if self.log.stopped().is_none() || !self.gate.may_heal(self.device) {
            return;
        }
        if let Err(error) = self.heal() {
            tracing::warn!(%error, "healing the metadata log failed; will retry");
        }
    }

    fn heal(&mut self) -> BrokerResult<()> {
        self.log.heal()?;
        self.figures.stopped(false);
        tracing::info!("metadata log healed; metadata writes resume");
        Ok(())
    }

    /// Heal the log if a write error stopped it, before writing `record`. Like a partition's
    /// log, it heals once the gate says its file system is back above reserve; a queue deletion
    /// heals it at every level, reserve included, because deleting frees space and must never
    /// wait for it. Healing itself needs no free space: recovery only reads, renames and
    /// removes, and the cut of the unsynced tail writes inside the tail segment, which was
    /// preallocated when it was created. The deletion record then fits in that same segment
    /// unless the segment is full (a metadata segment holds thousands of such records).
    fn heal_for(&mut self, record: &MetaRecord) -> BrokerResult<()> {
        let Some(stopped) = self.log.stopped() else {
            return Ok(());
        };
        let frees_space = matches!(record, MetaRecord::QueueDeleted { .. });
        if !frees_space && !self.gate.may_heal(self.device) {
            return Err(BrokerError::Log(stopped));
        }
        self.heal()
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&QueueDecl> {
        self.queues.values().find(|d| d.name == name)
    }

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
