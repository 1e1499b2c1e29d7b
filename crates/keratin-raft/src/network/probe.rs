//! The storage probe: which copy of a group's storage a node holds, whether its log holds a
//! membership and how far it goes ([`probe_storage`], request kind [`rpc::KIND_STORAGE`]). A
//! group's leader asks its members when it records their copies or finds one replaced, and a
//! forming replica asks the other voters of its formation whether the group exists already
//! (`replica::membership`).

use std::time::Duration;

use bytes::Bytes;
use keratin_net::{GroupId, NetError, Transport};

use super::codes;
use super::rpc::{self, CopyStatus};

/// How long a probe waits for its answer: a node that answers nothing within a second is
/// treated as down for this round (every caller asks again later).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a probe got no status.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The node answered, and does not serve the group (it has not opened it yet, or is
    /// rebuilding its replica after a storage failure).
    #[error("node {node} does not serve group {group}: {reason}")]
    NoGroup {
        /// The node.
        node: u64,
        /// The group.
        group: u64,
        /// Its answer.
        reason: String,
    },
    /// No answer (down, unreachable, fenced, a reply that did not decode).
    #[error("node {node} gave no storage status for group {group}: {reason}")]
    NoAnswer {
        /// The node.
        node: u64,
        /// The group.
        group: u64,
        /// What happened.
        reason: String,
    },
}

/// Ask node `target` what it holds of `group`, for [`PROBE_TIMEOUT`] at most.
pub async fn probe_storage(
    transport: &Transport,
    target: u64,
    group: GroupId,
) -> Result<CopyStatus, ProbeError> {
    let body = Bytes::from(rpc::encode_storage_probe());
    let reply = transport
        .call(target, group, rpc::KIND_STORAGE, body, PROBE_TIMEOUT)
        .await;
    let no_answer = |reason: String| ProbeError::NoAnswer {
        node: target,
        group: group.0,
        reason,
    };
    match reply {
        Ok(reply) => rpc::decode_storage_reply(&reply).map_err(|e| no_answer(e.to_string())),
        Err(NetError::Refused { error, .. }) if error.code == codes::NO_GROUP => {
            Err(ProbeError::NoGroup {
                node: target,
                group: group.0,
                reason: error.message,
            })
        }
        Err(error) => Err(no_answer(error.to_string())),
    }
}
