//! `Fence`: how a failed log is surfaced without a `StorageError` (crate docs, "Failures").
//!
//! A group's storage trips its fence at the first failure of either of its logs. From then on
//! the storage takes no more effect on disk and confirms no more flushes, and everything that
//! could carry the group's word to another node — the network's requests and the replies to
//! requests it received — must check [`Fence::is_tripped`] and refuse with a transient
//! (unreachable) error: openraft may have acted on a vote or an append that is not on disk,
//! and no other node may hear of it. The group's owner waits on [`Fence::tripped`], shuts the
//! `Raft` down, heals the logs and builds a new `Raft` on a new fence.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::error::RaftError;

/// The trip wire of one group's storage; cheap to clone (all clones are the same fence).
#[derive(Debug, Clone)]
pub struct Fence {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    reason: Mutex<Option<RaftError>>,
    tripped: watch::Sender<bool>,
}

impl Default for Fence {
    fn default() -> Self {
        Fence::new()
    }
}

impl Fence {
    /// A fence that has not tripped.
    pub fn new() -> Fence {
        Fence {
            shared: Arc::new(Shared {
                reason: Mutex::new(None),
                tripped: watch::Sender::new(false),
            }),
        }
    }

    /// Trip the fence; the first reason is kept.
    pub fn trip(&self, reason: RaftError) {
        {
            let mut slot = self.shared.reason.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_some() {
                return;
            }
            tracing::warn!(error = %reason, "raft storage fenced; the group must be rebuilt");
            *slot = Some(reason);
        }
        self.shared.tripped.send_replace(true);
    }

    /// True once tripped: refuse to carry this group's messages.
    pub fn is_tripped(&self) -> bool {
        *self.shared.tripped.borrow()
    }

    /// Why it tripped.
    pub fn reason(&self) -> Option<RaftError> {
        self.shared
            .reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Wait until the fence trips.
    pub async fn tripped(&self) {
        let mut receiver = self.shared.tripped.subscribe();
        // The sender lives as long as `self`, so `wait_for` cannot see it closed.
        let _ = receiver.wait_for(|tripped| *tripped).await;
    }
}
