//! The cluster service: node-to-node requests that are not Raft's, served as one more group
//! of the node's `keratin-net` handler ([`SERVICE_GROUP`]). Bodies are JSON
//! (`docs/cluster-protocol.md`, "Cluster service"):
//! - [`KIND_HELLO`]: empty request; the reply is this node's [`NodeInfo`], with its current
//!   resource level and free disk (`ClusterNode::set_levels`).
//! - [`KIND_PROPOSE`]: a metadata record ([`ClusterRecord`]) for the metadata group; a node
//!   that leads the group proposes it and replies with its offset (8 bytes, little-endian)
//!   once it is committed; any other node refuses with [`NOT_META_LEADER`], and the sender
//!   asks the leader.
//! - [`KIND_READ_INDEX`]: empty request; a node that leads the metadata group confirms it
//!   still leads (openraft's ReadIndex) and replies with one past its last committed record
//!   (8 bytes, little-endian); any other node refuses with [`NOT_META_LEADER`]. A node asked
//!   for a queue it does not know catches up to that offset before answering "not found".
//! - [`KIND_REBALANCE`]: empty request; the node hands the partitions it leads to their
//!   preferred leaders where they are caught up (`balance.rs`, `keratin cluster rebalance`),
//!   waits up to 5 s for the new leaders, and replies with what moved and what stays (a JSON
//!   `RebalanceReport`).
//! - [`KIND_DEAD_LETTER`]: dead-letter copies for a partition the receiver leads, stored
//!   before the reply; binary, not JSON (`dead_letters.rs`).
//! - [`KIND_PURGE`]: purge a partition the receiver leads (`purge.rs`).

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use keratin_net::codes::APP_CODE_MIN;
use keratin_net::{BoxFuture, GroupId, RemoteError};
use keratin_raft::network::GroupEndpoint;

use crate::balance::Balancer;
use crate::dead_letters::{ClusterDeadLetters, KIND_DEAD_LETTER};
use crate::directory::NodeInfo;
use crate::meta::MetaGroup;
use crate::purge::{ClusterPurge, KIND_PURGE};
use crate::records::{ClusterRecord, RECORD_JSON_V1};

/// The service's group id: the last one (partition groups count up from 1, the metadata group
/// is 0).
pub const SERVICE_GROUP: GroupId = GroupId(u64::MAX);
/// Who are you.
pub const KIND_HELLO: u8 = 1;
/// Propose a metadata record.
pub const KIND_PROPOSE: u8 = 2;
/// One past the metadata group's last committed record, confirmed by its leader.
pub const KIND_READ_INDEX: u8 = 3;
/// Hand the partitions led here to their preferred leaders now.
pub const KIND_REBALANCE: u8 = 4;
/// This node does not lead the metadata group (the message names the leader if known).
pub const NOT_META_LEADER: u16 = APP_CODE_MIN + 100;
/// The request did not decode.
pub const BAD_REQUEST: u16 = APP_CODE_MIN + 101;
/// The metadata group failed the proposal.
pub const PROPOSAL_FAILED: u16 = APP_CODE_MIN + 102;
/// The node is starting: it does not serve the metadata group yet.
pub const STARTING: u16 = APP_CODE_MIN + 103;

/// See the module docs.
pub(crate) struct ClusterService {
    pub(crate) own: Arc<OnceLock<NodeInfo>>,
    /// This node's entry there carries its current level and free space.
    pub(crate) directory: crate::directory::Directory,
    pub(crate) meta: Arc<OnceLock<Arc<MetaGroup>>>,
    pub(crate) balancer: Arc<OnceLock<Arc<Balancer>>>,
    /// Serves [`KIND_DEAD_LETTER`].
    pub(crate) dead_letters: Arc<ClusterDeadLetters>,
    /// Serves [`KIND_PURGE`] (set once the transport runs).
    pub(crate) purge: Arc<OnceLock<Arc<ClusterPurge>>>,
}

impl GroupEndpoint for ClusterService {
    fn serve(&self, kind: u8, body: Bytes) -> BoxFuture<Result<Bytes, RemoteError>> {
        let own = self
            .own
            .get()
            .map(|own| self.directory.get(own.id).unwrap_or_else(|| own.clone()));
        let meta = self.meta.get().cloned();
        let balancer = self.balancer.get().cloned();
        let dead_letters = self.dead_letters.clone();
        let purge = self.purge.get().cloned();
        Box::pin(async move {
            match kind {
                KIND_HELLO => {
                    let own = own.ok_or_else(|| {
                        RemoteError::new(STARTING, "the node is starting; ask again shortly")
                    })?;
                    let body = serde_json::to_vec(&own).unwrap_or_default();
                    Ok(Bytes::from(body))
                }
                KIND_PROPOSE => {
                    let meta = meta.ok_or_else(|| {
                        RemoteError::new(STARTING, "the node is starting; ask again shortly")
                    })?;
                    let record = ClusterRecord::decode(RECORD_JSON_V1, &body)
                        .map_err(|e| RemoteError::new(BAD_REQUEST, e))?;
                    let offset = meta.propose_here(&record).await?;
                    Ok(Bytes::copy_from_slice(&offset.to_le_bytes()))
                }
                KIND_READ_INDEX => {
                    let meta = meta.ok_or_else(|| {
                        RemoteError::new(STARTING, "the node is starting; ask again shortly")
                    })?;
                    let committed = meta.read_index_here().await?;
                    Ok(Bytes::copy_from_slice(&committed.to_le_bytes()))
                }
                KIND_REBALANCE => {
                    let balancer = balancer.ok_or_else(|| {
                        RemoteError::new(STARTING, "the node is starting; ask again shortly")
                    })?;
                    let report = balancer.rebalance_here().await;
                    Ok(Bytes::from(serde_json::to_vec(&report).unwrap_or_default()))
                }
                KIND_DEAD_LETTER => dead_letters.serve(body).await,
                KIND_PURGE => {
                    let purge = purge.ok_or_else(|| {
                        RemoteError::new(STARTING, "the node is starting; ask again shortly")
                    })?;
                    purge.serve(body).await
                }
                other => Err(RemoteError::new(
                    BAD_REQUEST,
                    format!("cluster service request kind {other} is unknown here"),
                )),
            }
        })
    }
}
