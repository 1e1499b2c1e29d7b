//! [`ElsewhereLog`]: the partition log of a replicated queue's partition that has no replica
//! on this node (the queue has fewer replicas than the cluster has nodes). It holds nothing
//! and never leads: the partition's owner here answers publishes and purges "not the leader"
//! with the address of the partition's first replica (its preferred leader), which redirects
//! again if another replica leads.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use keratin_broker::partition::log::{
    BoxReader, LogEvent, LogEvents, LogSpace, PartitionLog, PartitionReader, Proposal, Proposing,
    Removing, Role,
};
use keratin_broker::{BrokerError, BrokerResult};
use keratin_log::{LogError, LogResult, PrefixRemoval, ReadRecord};

use crate::directory::Directory;

/// Until its address is known, the role is looked up again this often.
const ADDRESS_POLL: Duration = Duration::from_millis(200);

/// See the module docs.
pub struct ElsewhereLog {
    queue: String,
    index: u32,
    replica: u64,
    directory: Directory,
    closed: Arc<OnceLock<()>>,
}

impl ElsewhereLog {
    /// The log of partition `index` of `queue`, held by `replica` (and others) elsewhere.
    pub fn new(queue: String, index: u32, replica: u64, directory: Directory) -> ElsewhereLog {
        ElsewhereLog {
            queue,
            index,
            replica,
            directory,
            closed: Arc::new(OnceLock::new()),
        }
    }

    fn role(&self) -> Role {
        Role {
            leading: false,
            leader: Some(self.replica),
            addr: self.directory.client_addr(self.replica),
            from: 0,
        }
    }
}

struct Empty;

impl Iterator for Empty {
    type Item = LogResult<ReadRecord>;
    fn next(&mut self) -> Option<Self::Item> {
        None
    }
}

impl PartitionReader for Empty {
    fn next_offset(&self) -> u64 {
        0
    }
}

fn nothing_removed() -> Removing {
    Box::pin(async {
        Ok(PrefixRemoval {
            segments: 0,
            bytes: 0,
        })
    })
}

impl PartitionLog for ElsewhereLog {
    fn start(&self, events: LogEvents) {
        let role = self.role();
        let known = role.addr.is_some();
        events.send(LogEvent::Role(role));
        if known {
            return;
        }
        // Tell the owner the address once the directory learns it.
        let directory = self.directory.clone();
        let replica = self.replica;
        let closed = self.closed.clone();
        tokio::spawn(async move {
            while closed.get().is_none() {
                tokio::time::sleep(ADDRESS_POLL).await;
                if let Some(addr) = directory.client_addr(replica) {
                    events.send(LogEvent::Role(Role {
                        leading: false,
                        leader: Some(replica),
                        addr: Some(addr),
                        from: 0,
                    }));
                    return;
                }
            }
        });
    }

    fn propose(self: Arc<Self>, _proposal: Proposal) -> Proposing {
        let refusal = self.role().not_leader(&self.queue, self.index);
        Box::pin(async move { Err(refusal) })
    }

    fn reader(&self, _offset: u64) -> BoxReader {
        Box::new(Empty)
    }

    fn committed_offset(&self) -> u64 {
        0
    }

    fn start_offset(&self) -> u64 {
        0
    }

    fn truncate_suffix(&self, _from: u64) -> LogResult<()> {
        Ok(())
    }

    fn heal(&self) -> LogResult<()> {
        Ok(())
    }

    fn remove_prefix(&self, _before: u64) -> LogResult<Removing> {
        Ok(nothing_removed())
    }

    fn hand_back(&self) -> LogResult<Removing> {
        Ok(nothing_removed())
    }

    fn disk_bytes(&self) -> u64 {
        0
    }

    fn tail_room_bytes(&self) -> u64 {
        0
    }

    fn space(&self) -> LogSpace {
        LogSpace {
            disk_bytes: 0,
            segment_bases: Vec::new(),
        }
    }

    fn close(self: Arc<Self>) -> BrokerResult<()> {
        let _ = self.closed.set(());
        Ok(())
    }

    fn delete(self: Arc<Self>) -> BrokerResult<()> {
        let _ = self.closed.set(());
        Ok(())
    }

    fn reset(self: Arc<Self>) -> (Option<Arc<dyn PartitionLog>>, BrokerResult<()>) {
        let error = BrokerError::Log(LogError::Invalid(
            "a partition held elsewhere has nothing to reset here".into(),
        ));
        (Some(self), Err(error))
    }
}
