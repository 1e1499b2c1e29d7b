//! `SegmentPool`: spare segment files, shared by the logs of one node.
//!
//! This first version keeps no spares: a log that rolls creates a fresh preallocated file and a
//! segment it no longer needs is deleted. The node-wide pool (size classes, budget, release,
//! generations) replaces the inside of this type without changing what logs call.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{LogError, LogResult};
use crate::format::SizeClass;
use crate::io::Io;

/// A spare taken from the pool: the file to rename into the log and its generation.
#[derive(Debug, Clone)]
pub(crate) struct Spare {
    pub(crate) path: PathBuf,
    pub(crate) generation: u16,
}

/// Spare segment files of one node. Cheap to clone: clones share the pool.
#[derive(Debug, Clone)]
pub struct SegmentPool {
    io: Arc<dyn Io>,
}

impl SegmentPool {
    /// A pool private to one log.
    pub fn private(io: Arc<dyn Io>) -> SegmentPool {
        SegmentPool { io }
    }

    /// A spare of `class` on the file system of `log_dir`, if the pool has one.
    pub(crate) fn take(&self, log_dir: &Path, class: SizeClass) -> LogResult<Option<Spare>> {
        let _ = (log_dir, class);
        Ok(None)
    }

    /// A segment a log no longer needs. The caller syncs the log directory afterwards.
    pub(crate) fn enter(&self, path: &Path, class: SizeClass, generation: u16) -> LogResult<()> {
        let _ = (class, generation);
        self.io
            .remove_file(path)
            .map_err(|e| LogError::io("remove segment", path, e))
    }

    /// A trailing segment recovery found with a header that is not the log's own.
    pub(crate) fn enter_foreign(&self, path: &Path, class: SizeClass) -> LogResult<()> {
        let _ = class;
        self.io
            .remove_file(path)
            .map_err(|e| LogError::io("remove foreign segment", path, e))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        self.io
            .sync_dir(dir)
            .map_err(|e| LogError::io("sync log directory", dir, e))
    }
}
