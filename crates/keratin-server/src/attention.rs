//! `Attention`: the node's list of what needs an operator — level changes, full queues, stopped
//! and healed logs, and in a cluster partitions below a majority and unreachable nodes. Items
//! are raised and cleared by the sampler (`limits.rs`) and the cluster watch
//! (`cluster_watch.rs`), which know the causes; this module owns the list: ids, clearing, the
//! bound, and the file it survives restarts in.
//!
//! Persistence: `attention.json` in the node's first storage directory, rewritten whole on every
//! change (temporary file, fsync, rename, fsync of the directory), so a crash leaves either the
//! old list or the new one. The list is small (at most [`ATTENTION_ITEMS_MAX`] items of a few
//! hundred bytes), and it changes at most a few times per sampling interval. A failed write
//! (a full disk is the usual reason items are raised at all) never stops the node: the list
//! stays in memory and the write is tried again on the next change or sample round.

use std::collections::{BTreeSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Items kept: enough for every level change of a busy hour at one per 10 s. Cleared items go
/// first, oldest first; active ones only when more than this many are active.
pub const ATTENTION_ITEMS_MAX: usize = 256;

/// The file the list is kept in, in the node's first storage directory.
pub const ATTENTION_FILE_NAME: &str = "attention.json";

/// A file that could not be read is renamed to this (beside the list) and a new list starts.
pub const ATTENTION_CORRUPT_FILE_NAME: &str = "attention.json.corrupt";

/// Version of the file's layout.
const FILE_VERSION: u32 = 1;

/// What an item is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// A file system's disk level changed (subject: its path).
    DiskLevel,
    /// The memory level changed (subject: `memory`).
    MemoryLevel,
    /// A queue reached its `max_messages` / `max_bytes` (subject: the queue).
    QueueFull,
    /// A log stopped after a failed write or sync (subject: its directory).
    LogStopped,
    /// A stopped log was healed (subject: its directory); history only.
    LogHealed,
    /// Dead-letter copies of a queue's messages failed (the messages wait in the queue and are
    /// tried again; subject: the queue).
    DeadLetterFailed,
    /// A replicated partition on this node cannot confirm publishes safely: its leader (this
    /// node) sees fewer replicas in sync than a majority, or this replica has known no leader
    /// for a while (subject: `queue/partition`). Raised by `cluster_watch.rs`.
    PartitionBelowMajority,
    /// A cluster peer's transport connection has been down for a while (subject:
    /// `node-ID`). Raised by `cluster_watch.rs`.
    NodeUnreachable,
    /// A file system is projected to reach its hard level within the hour at its recent fill
    /// rate (subject: its path); cleared beyond an hour and a quarter. `time_to_full.rs`.
    DiskFilling,
    /// A cluster peer reports a file system or its memory at soft or worse (subject:
    /// `node-ID:PATH` or `node-ID:memory`): the partitions with an in-sync copy there are
    /// slowed or refused. Raised by `cluster_watch.rs` from the peer's label.
    NodeLimited,
    /// A stream's named cursor points below a partition's start: retention removed messages it
    /// had not read (subject: `stream/cursor`). Cleared once the cursor is committed at or past
    /// the start, or goes. Raised by the sampler (`limits/cursors.rs`).
    CursorBehindRetention,
    /// Copies (of partitions, of the cluster metadata) found damaged at start were moved
    /// aside under a storage directory's `damaged/` and rebuilt from their other replicas
    /// (subject: that `damaged/` directory). Cleared once the operator emptied it. Raised by
    /// the sampler (`limits/damaged.rs`).
    DamagedCopies,
}

impl AttentionKind {
    /// The name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionKind::DiskLevel => "disk_level",
            AttentionKind::MemoryLevel => "memory_level",
            AttentionKind::QueueFull => "queue_full",
            AttentionKind::LogStopped => "log_stopped",
            AttentionKind::LogHealed => "log_healed",
            AttentionKind::DeadLetterFailed => "dead_letter_failed",
            AttentionKind::PartitionBelowMajority => "partition_below_majority",
            AttentionKind::NodeUnreachable => "node_unreachable",
            AttentionKind::NodeLimited => "node_limited",
            AttentionKind::DiskFilling => "disk_filling",
            AttentionKind::CursorBehindRetention => "cursor_behind_retention",
            AttentionKind::DamagedCopies => "damaged_copies",
        }
    }
}

/// How urgent an item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth knowing; nothing to do.
    Info,
    /// Publishers are slowed or refused somewhere; act soon.
    Warning,
    /// Publishing is refused node-wide or a log is stopped; act now.
    Critical,
}

/// One thing an operator should know about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionItem {
    /// Increasing over the node's life (kept across restarts).
    pub id: u64,
    /// What it is about.
    pub kind: AttentionKind,
    /// The file system path, `memory`, the queue name or the log directory.
    pub subject: String,
    /// How urgent.
    pub severity: Severity,
    /// For level items: the level raised (`soft`, `hard`, `reserve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
    /// What happened and what to do.
    pub message: String,
    /// When it was raised (ms since the epoch).
    pub raised_at_ms: u64,
    /// When its cause went away (ms since the epoch); `None` while active.
    pub cleared_at_ms: Option<u64>,
    /// True until its cause goes away.
    pub active: bool,
}

/// What a new item says.
#[derive(Debug, Clone)]
pub struct Raise {
    /// What it is about.
    pub kind: AttentionKind,
    /// The file system path, `memory`, the queue name or the log directory.
    pub subject: String,
    /// How urgent.
    pub severity: Severity,
    /// For level items: the level.
    pub level: Option<String>,
    /// What happened and what to do.
    pub message: String,
}

/// The file's layout.
#[derive(Debug, Serialize, Deserialize)]
struct AttentionFile {
    version: u32,
    next_id: u64,
    items: Vec<AttentionItem>,
}

#[derive(Debug)]
struct State {
    /// Oldest first.
    items: VecDeque<AttentionItem>,
    next_id: u64,
    /// The last write failed: try again at the next change or [`Attention::retry_save`].
    unsaved: bool,
    /// Items active when the node last stopped that no sample has confirmed yet.
    carried: BTreeSet<u64>,
}

/// The node's attention list.
#[derive(Debug)]
pub struct Attention {
    path: PathBuf,
    state: Mutex<State>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Attention {
    /// The list kept in `dir`/`attention.json`, loaded from there if it exists. A file that
    /// cannot be read or parsed is logged and renamed to `attention.json.corrupt`; the list then
    /// starts empty. Never fails: attention is for the operator, not a reason to stay down.
    pub fn open(dir: &Path) -> Attention {
        let path = dir.join(ATTENTION_FILE_NAME);
        let (items, next_id) = match load(&path) {
            Ok(Some(file)) => {
                let next_id = file
                    .items
                    .iter()
                    .map(|item| item.id.saturating_add(1))
                    .max()
                    .unwrap_or(1)
                    .max(file.next_id);
                (VecDeque::from(file.items), next_id)
            }
            Ok(None) => (VecDeque::new(), 1),
            Err(error) => {
                let aside = dir.join(ATTENTION_CORRUPT_FILE_NAME);
                match std::fs::rename(&path, &aside) {
                    Ok(()) => {
                        tracing::warn!(path = %path.display(), %error, aside = %aside.display(),
                        "the attention list cannot be read; set it aside and starting a new one")
                    }
                    Err(rename_error) => {
                        tracing::warn!(path = %path.display(), %error, %rename_error,
                        "the attention list cannot be read nor set aside; starting a new one")
                    }
                }
                (VecDeque::new(), 1)
            }
        };
        let carried = items
            .iter()
            .filter(|item| item.active)
            .map(|item| item.id)
            .collect();
        let mut state = State {
            items,
            next_id,
            unsaved: false,
            carried,
        };
        bound(&mut state.items);
        Attention {
            path,
            state: Mutex::new(state),
        }
    }

    /// The file the list is kept in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every item kept, oldest first.
    pub fn items(&self) -> Vec<AttentionItem> {
        self.lock().items.iter().cloned().collect()
    }

    /// The active items, oldest first.
    pub fn active(&self) -> Vec<AttentionItem> {
        self.lock()
            .items
            .iter()
            .filter(|item| item.active)
            .cloned()
            .collect()
    }

    /// Raise an item: any active item of the same kind and subject is cleared first (a level
    /// that changes replaces the item of the level before). An item carried over a restart
    /// with the same kind, subject and level stays as it is: the cause it names is still there.
    /// Returns the id of the active item.
    pub fn raise(&self, raise: Raise) -> u64 {
        let now = now_ms();
        let mut state = self.lock();
        let carried = state.items.iter().find(|item| {
            item.active
                && state.carried.contains(&item.id)
                && item.kind == raise.kind
                && item.subject == raise.subject
                && item.level == raise.level
        });
        if let Some(id) = carried.map(|item| item.id) {
            state.carried.remove(&id);
            return id;
        }
        clear_matching(&mut state, raise.kind, &raise.subject, now);
        let id = push(&mut state, raise, now, true);
        self.save(&mut state);
        id
    }

    /// Keep an item in history only (raised and cleared at once), e.g. a healed log.
    pub fn note(&self, raise: Raise) -> u64 {
        let mut state = self.lock();
        let id = push(&mut state, raise, now_ms(), false);
        self.save(&mut state);
        id
    }

    /// The cause of the active items of `kind` about `subject` went away: clear them. Returns
    /// how many were cleared.
    pub fn clear(&self, kind: AttentionKind, subject: &str) -> usize {
        let mut state = self.lock();
        let cleared = clear_matching(&mut state, kind, subject, now_ms());
        if cleared > 0 {
            self.save(&mut state);
        }
        cleared
    }

    /// After the first sample round since start: clear the items carried over the restart
    /// that the round did not raise again (their cause went away while the node was down).
    pub fn settle(&self) {
        let now = now_ms();
        let mut state = self.lock();
        let carried = std::mem::take(&mut state.carried);
        let mut cleared = 0;
        for item in state.items.iter_mut() {
            if item.active && carried.contains(&item.id) {
                item.active = false;
                item.cleared_at_ms = Some(now);
                cleared += 1;
            }
        }
        if cleared > 0 {
            self.save(&mut state);
        }
    }

    /// Write the list again if the last write failed.
    pub fn retry_save(&self) {
        let mut state = self.lock();
        if state.unsaved {
            self.save(&mut state);
        }
    }

    /// True if the last write failed and no write succeeded since.
    pub fn unsaved(&self) -> bool {
        self.lock().unsaved
    }

    /// Write the list (called with the lock held, so writes happen in the order of changes).
    fn save(&self, state: &mut State) {
        let file = AttentionFile {
            version: FILE_VERSION,
            next_id: state.next_id,
            items: state.items.iter().cloned().collect(),
        };
        let result = serde_json::to_vec_pretty(&file)
            .map_err(std::io::Error::other)
            .and_then(|bytes| write_atomically(&self.path, &bytes));
        match result {
            Ok(()) => state.unsaved = false,
            Err(error) => {
                if !state.unsaved {
                    tracing::warn!(path = %self.path.display(), %error,
                        "cannot write the attention list; keeping it in memory and trying again at the next change");
                }
                state.unsaved = true;
            }
        }
    }
}

fn clear_matching(state: &mut State, kind: AttentionKind, subject: &str, now: u64) -> usize {
    let mut cleared = 0;
    for item in state.items.iter_mut() {
        if item.active && item.kind == kind && item.subject == subject {
            item.active = false;
            item.cleared_at_ms = Some(now);
            state.carried.remove(&item.id);
            cleared += 1;
        }
    }
    cleared
}

fn push(state: &mut State, raise: Raise, now: u64, active: bool) -> u64 {
    let id = state.next_id;
    state.next_id += 1;
    state.items.push_back(AttentionItem {
        id,
        kind: raise.kind,
        subject: raise.subject,
        severity: raise.severity,
        level: raise.level,
        message: raise.message,
        raised_at_ms: now,
        cleared_at_ms: (!active).then_some(now),
        active,
    });
    bound(&mut state.items);
    id
}

/// Keep at most [`ATTENTION_ITEMS_MAX`] items: drop the oldest cleared ones, then (only when
/// more are active than that) the oldest active ones.
fn bound(items: &mut VecDeque<AttentionItem>) {
    while items.len() > ATTENTION_ITEMS_MAX {
        let victim = items.iter().position(|item| !item.active).unwrap_or(0);
        items.remove(victim);
    }
}

/// The list in `path`: `None` if there is no file.
fn load(path: &Path) -> Result<Option<AttentionFile>, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error.to_string()),
    };
    let file: AttentionFile = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    if file.version != FILE_VERSION {
        return Err(format!(
            "version {} is not the {FILE_VERSION} this broker writes",
            file.version
        ));
    }
    Ok(Some(file))
}

/// Replace `path` with `bytes` so that a crash leaves the old content or the new one: write a
/// temporary file, fsync it, rename it over, fsync the directory.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = path.with_extension("json.tmp");
    let written = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if let Err(error) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(error);
    }
    // IMPORTANT: fsync the directory, or the rename may not survive a power loss.
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(subject: &str, level: &str) -> Raise {
        Raise {
            kind: AttentionKind::DiskLevel,
            subject: subject.into(),
            severity: if level == "soft" {
                Severity::Warning
            } else {
                Severity::Critical
            },
            level: Some(level.into()),
            message: format!("disk at {level} on {subject}"),
        }
    }

    fn queue_full(name: &str) -> Raise {
        Raise {
            kind: AttentionKind::QueueFull,
            subject: name.into(),
            severity: Severity::Warning,
            level: None,
            message: format!("queue {name} is full"),
        }
    }

    fn summary(attention: &Attention) -> Vec<(u64, String, Option<String>, bool)> {
        attention
            .items()
            .into_iter()
            .map(|i| (i.id, i.subject, i.level, i.active))
            .collect()
    }

    #[test]
    fn a_new_level_replaces_the_old_and_normal_clears_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        attention.raise(disk("/a", "soft"));
        attention.raise(disk("/a", "hard"));
        attention.raise(disk("/b", "soft"));
        attention.raise(disk("/a", "soft"));
        assert_eq!(
            summary(&attention),
            vec![
                (1, "/a".into(), Some("soft".into()), false),
                (2, "/a".into(), Some("hard".into()), false),
                (3, "/b".into(), Some("soft".into()), true),
                (4, "/a".into(), Some("soft".into()), true),
            ]
        );
        assert_eq!(attention.clear(AttentionKind::DiskLevel, "/a"), 1);
        assert_eq!(attention.clear(AttentionKind::DiskLevel, "/a"), 0);
        let items = attention.items();
        assert!(items[3].cleared_at_ms.is_some() && !items[3].active);
        assert!(items[2].active && items[2].cleared_at_ms.is_none());
        let healed = attention.note(Raise {
            kind: AttentionKind::LogHealed,
            subject: "/a/q/0".into(),
            severity: Severity::Info,
            level: None,
            message: "healed".into(),
        });
        let note = attention.items().into_iter().find(|i| i.id == healed);
        assert!(note.is_some_and(|n| !n.active && n.cleared_at_ms == Some(n.raised_at_ms)));
        assert_eq!(attention.active().len(), 1);
    }

    #[test]
    fn the_bound_drops_cleared_items_first_and_active_ones_last() {
        let dir = tempfile::tempdir().expect("tempdir");
        let attention = Attention::open(dir.path());
        attention.raise(queue_full("kept-active"));
        for n in 0..ATTENTION_ITEMS_MAX + 10 {
            let name = format!("q{n}");
            attention.raise(queue_full(&name));
            attention.clear(AttentionKind::QueueFull, &name);
        }
        let items = attention.items();
        assert_eq!(items.len(), ATTENTION_ITEMS_MAX);
        assert_eq!(
            items[0].subject, "kept-active",
            "the oldest item is active: kept"
        );
        assert_eq!(items[1].subject, "q11", "the 11 oldest cleared ones went");
        for n in 0..ATTENTION_ITEMS_MAX + 5 {
            attention.raise(queue_full(&format!("active{n}")));
        }
        let items = attention.items();
        assert_eq!(items.len(), ATTENTION_ITEMS_MAX);
        assert!(
            items.iter().all(|i| i.active),
            "cleared ones go before any active one"
        );
        assert_eq!(items[0].subject, "active5", "then the oldest active ones");
        assert_eq!(
            items.last().map(|i| i.id),
            Some(2 * ATTENTION_ITEMS_MAX as u64 + 16)
        );
    }

    #[test]
    fn the_list_survives_a_restart_and_carried_items_settle() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let attention = Attention::open(dir.path());
            attention.raise(disk("/a", "soft"));
            attention.raise(queue_full("orders"));
            attention.raise(queue_full("gone"));
            attention.clear(AttentionKind::QueueFull, "gone");
            attention.raise(disk("/b", "hard"));
            assert!(!attention.unsaved());
        }
        let before = {
            let attention = Attention::open(dir.path());
            attention.items()
        };
        assert_eq!(before.len(), 4);
        let attention = Attention::open(dir.path());
        assert_eq!(attention.items(), before, "the file round-trips exactly");
        // The first round after start finds /a still at soft and orders still full, /b
        // back at normal: /a and orders stay as they were, /b clears at settle.
        assert_eq!(attention.raise(disk("/a", "soft")), 1);
        assert_eq!(attention.raise(queue_full("orders")), 2);
        attention.settle();
        assert_eq!(
            summary(&attention),
            vec![
                (1, "/a".into(), Some("soft".into()), true),
                (2, "orders".into(), None, true),
                (3, "gone".into(), None, false),
                (4, "/b".into(), Some("hard".into()), false),
            ]
        );
        // After settling, a raise is a change again and ids continue.
        assert_eq!(attention.raise(disk("/a", "hard")), 5);
        let reopened = Attention::open(dir.path());
        assert_eq!(reopened.items(), attention.items());
        assert_eq!(reopened.raise(queue_full("new")), 6);
    }

    #[test]
    fn a_corrupt_file_is_set_aside_and_a_new_list_starts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(ATTENTION_FILE_NAME);
        std::fs::write(&path, b"{\"version\": 1, \"items\": [tor").expect("write");
        let attention = Attention::open(dir.path());
        assert!(attention.items().is_empty());
        let aside = dir.path().join(ATTENTION_CORRUPT_FILE_NAME);
        assert_eq!(
            std::fs::read(&aside).expect("set aside"),
            b"{\"version\": 1, \"items\": [tor"
        );
        assert!(!path.exists());
        assert_eq!(attention.raise(queue_full("q")), 1);
        assert!(path.exists(), "the new list is written");
    }

    #[test]
    fn a_failed_write_keeps_the_list_in_memory_and_is_retried() {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = dir.path().join("storage");
        let attention = Attention::open(&storage);
        attention.raise(queue_full("q1"));
        assert!(attention.unsaved(), "the directory does not exist yet");
        attention.raise(queue_full("q2"));
        assert_eq!(
            attention.active().len(),
            2,
            "the list works without its file"
        );
        std::fs::create_dir(&storage).expect("mkdir");
        attention.retry_save();
        assert!(!attention.unsaved());
        assert_eq!(Attention::open(&storage).items(), attention.items());
    }
}
