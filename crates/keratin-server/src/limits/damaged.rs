//! The `damaged_copies` attention item and the `keratin_damaged_copies` gauge: copies a start
//! found damaged (data reported durable that does not read back) were moved under
//! `<storage>/damaged/` and rebuilt from the other replicas (partitions: `keratin-raft`,
//! `partition_log/provider.rs`; the cluster metadata: `keratin-cluster`, `meta.rs`). Nothing there is deleted by the node: the operator inspects the
//! copies and removes them. The directory is the record: an item per storage directory whose
//! `damaged/` holds entries, raised with their names, cleared once it is empty or gone, so the
//! item survives restarts without a state of its own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keratin_raft::partition_log::DAMAGED_DIR_NAME;

use crate::attention::{AttentionKind, Raise, Severity};

use super::*;

/// Names listed in an item's message at most (the count is always given).
const NAMES_SHOWN: usize = 8;

impl NodeLimits {
    /// Raise or update the item of each storage directory whose `damaged/` holds copies; clear
    /// the items of those emptied.
    pub(super) fn check_damaged_copies(&self) {
        let mut now: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
        for storage in &self.storage_dirs {
            let dir = storage.join(DAMAGED_DIR_NAME);
            let names = damaged_names(&dir);
            if !names.is_empty() {
                now.insert(dir, names);
            }
        }
        let mut before = lock(&self.damaged);
        for (dir, names) in &now {
            if before.get(dir) == Some(names) {
                continue;
            }
            let subject = dir.display().to_string();
            let mut shown: Vec<&str> = names.iter().take(NAMES_SHOWN).map(String::as_str).collect();
            if names.len() > NAMES_SHOWN {
                shown.push("...");
            }
            let message = format!(
                "{} damaged {} moved aside to {subject} ({}): data this node had reported \
                 durable did not read back at start, and each copy (of a partition, or of the \
                 cluster metadata) was rebuilt from its other replicas; inspect them (the \
                 storage under them may be failing), then remove them to free their space",
                names.len(),
                if names.len() == 1 {
                    "copy was"
                } else {
                    "copies were"
                },
                shown.join(", "),
            );
            tracing::warn!("{message}");
            self.attention.raise(Raise {
                kind: AttentionKind::DamagedCopies,
                subject,
                severity: Severity::Warning,
                level: None,
                message,
            });
        }
        for dir in before.keys().filter(|dir| !now.contains_key(*dir)) {
            tracing::info!(dir = %dir.display(), "the damaged copies were removed");
            self.attention
                .clear(AttentionKind::DamagedCopies, &dir.display().to_string());
        }
        *before = now;
    }

    /// The damaged copies of each storage directory's `damaged/` as last sampled (directories
    /// without any are left out), for `/metrics`.
    pub fn damaged_copies(&self) -> Vec<(PathBuf, usize)> {
        lock(&self.damaged)
            .iter()
            .map(|(dir, names)| (dir.clone(), names.len()))
            .collect()
    }
}

/// The entries of `dir`, sorted; none when it does not exist or cannot be read (a read error
/// is logged: the item is about what is known to be there).
fn damaged_names(dir: &Path) -> Vec<String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot list the damaged copies");
            return Vec::new();
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
