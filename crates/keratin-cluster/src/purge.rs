//! Purging a partition that another node leads: [`ClusterPurge`], which sends the cluster
//! service request [`KIND_PURGE`] to the partition's leader (for `Broker::purge`, through the
//! broker's `ClusterMetadata::purge_at`) and serves it on the leader. A purge is a partition
//! record like a publish (`docs/partition-records.md`, `PURGE`), so only the partition's leader
//! can write it; a purge asked of any node purges every partition on its leader this way
//! (`docs/cluster.md`, "Admin requests on any node").
//!
//! Bodies are JSON (`docs/cluster-protocol.md`, "Cluster service"): the request
//! `{"queue": "orders", "partition": 2}`, the reply one of `{"outcome": "purged", "count": 12}`,
//! `{"outcome": "not_leader", "leader": 3}` (`leader` absent or null while none is known),
//! `{"outcome": "not_found"}`, `{"outcome": "failed", "message": "..."}`. Owns that encoding and
//! its mapping to and from `BrokerError`; which partitions to purge, and how long to look for
//! their leaders, is the broker's (`Broker::purge`).

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use keratin_broker::{BrokerError, BrokerResult, WeakBroker};
use keratin_net::{RemoteError, Transport};
use serde::{Deserialize, Serialize};

use crate::directory::Directory;
use crate::service::{BAD_REQUEST, SERVICE_GROUP, STARTING};

/// Cluster service request kind: purge a partition the receiver leads.
pub const KIND_PURGE: u8 = 6;

/// A purge sent to another node waits this long for its answer: the leader answers once its
/// `PURGE` record is committed (milliseconds; a few hundred under a busy disk). Past it the
/// purge may or may not have happened; the caller's purge fails with 503 and may be repeated
/// (purging again removes what is ready then).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize, Deserialize)]
struct PurgeRequest {
    queue: String,
    partition: u32,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum PurgeReply {
    Purged { count: u64 },
    NotLeader { leader: Option<u64> },
    NotFound,
    Failed { message: String },
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct ClusterPurge {
    node_id: u64,
    transport: Transport,
    /// The leaders' client addresses, for the "not the leader" answers given to clients.
    directory: Directory,
    /// Set once the broker is open ([`ClusterPurge::attach`]); until then requests are refused
    /// as "starting".
    broker: OnceLock<WeakBroker>,
}

impl ClusterPurge {
    pub(crate) fn new(node_id: u64, transport: Transport, directory: Directory) -> ClusterPurge {
        ClusterPurge {
            node_id,
            transport,
            directory,
            broker: OnceLock::new(),
        }
    }

    /// The broker this node serves purges with.
    pub(crate) fn attach(&self, broker: WeakBroker) {
        let _ = self.broker.set(broker);
    }

    /// Serve a [`KIND_PURGE`] request: purge the partition if this node leads it.
    pub(crate) async fn serve(&self, body: Bytes) -> Result<Bytes, RemoteError> {
        let broker = self
            .broker
            .get()
            .and_then(WeakBroker::upgrade)
            .ok_or_else(|| RemoteError::new(STARTING, "the node is starting; ask again shortly"))?;
        let request: PurgeRequest = serde_json::from_slice(&body)
            .map_err(|e| RemoteError::new(BAD_REQUEST, format!("purge request: {e}")))?;
        let reply = match broker
            .purge_partition(&request.queue, request.partition)
            .await
        {
            Ok(count) => PurgeReply::Purged { count },
            Err(BrokerError::NotLeader { leader, .. }) => PurgeReply::NotLeader { leader },
            Err(BrokerError::NotFound(_)) => PurgeReply::NotFound,
            Err(error) => PurgeReply::Failed {
                message: error.to_string(),
            },
        };
        Ok(Bytes::from(serde_json::to_vec(&reply).unwrap_or_default()))
    }

    /// Purge partition `index` of `queue` on node `leader` (see the module docs).
    pub(crate) async fn purge_at(
        &self,
        queue: String,
        index: u32,
        leader: u64,
    ) -> BrokerResult<u64> {
        if leader == self.node_id {
            // This node was named while it takes over, or just lost the partition: the
            // broker asks its own copy again after a pause.
            return Err(self.not_leader(&queue, index, None));
        }
        let request = PurgeRequest {
            queue: queue.clone(),
            partition: index,
        };
        let body = Bytes::from(serde_json::to_vec(&request).unwrap_or_default());
        let reply = self
            .transport
            .call(leader, SERVICE_GROUP, KIND_PURGE, body, CALL_TIMEOUT)
            .await
            .map_err(|error| unavailable(&queue, index, format!("node {leader}: {error}")))?;
        match serde_json::from_slice::<PurgeReply>(&reply) {
            Ok(PurgeReply::Purged { count }) => Ok(count),
            Ok(PurgeReply::NotLeader { leader }) => Err(self.not_leader(&queue, index, leader)),
            Ok(PurgeReply::NotFound) => Err(BrokerError::NotFound(queue)),
            Ok(PurgeReply::Failed { message }) => Err(unavailable(
                &queue,
                index,
                format!("node {leader}: {message}"),
            )),
            Err(error) => Err(unavailable(
                &queue,
                index,
                format!(
                    "node {leader} answered a purge with {} bytes that do not decode: {error}",
                    reply.len()
                ),
            )),
        }
    }

    fn not_leader(&self, queue: &str, partition: u32, leader: Option<u64>) -> BrokerError {
        BrokerError::NotLeader {
            queue: queue.to_string(),
            partition,
            leader,
            addr: leader.and_then(|id| self.directory.client_addr(id)),
        }
    }
}

/// The purge of a partition on another node failed, or its outcome is not known (no answer):
/// not applied as far as this node knows; purging again is safe.
fn unavailable(queue: &str, partition: u32, why: String) -> BrokerError {
    BrokerError::Unavailable {
        queue: queue.to_string(),
        partition,
        source: keratin_log::LogError::Invalid(format!(
            "the purge on the partition's leader failed ({why}); purge again"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_as_the_module_docs_write_them() {
        let cases = [
            (
                r#"{"outcome":"purged","count":12}"#,
                PurgeReply::Purged { count: 12 },
            ),
            (
                r#"{"outcome":"not_leader","leader":3}"#,
                PurgeReply::NotLeader { leader: Some(3) },
            ),
            (
                r#"{"outcome":"not_leader","leader":null}"#,
                PurgeReply::NotLeader { leader: None },
            ),
            (r#"{"outcome":"not_found"}"#, PurgeReply::NotFound),
            (
                r#"{"outcome":"failed","message":"m"}"#,
                PurgeReply::Failed {
                    message: "m".into(),
                },
            ),
        ];
        for (text, reply) in cases {
            assert_eq!(
                serde_json::from_str::<PurgeReply>(text).unwrap(),
                reply,
                "{text}"
            );
        }
        assert_eq!(
            serde_json::to_string(&PurgeReply::Purged { count: 1 }).unwrap(),
            r#"{"outcome":"purged","count":1}"#
        );
    }
}
