//! Forming a group: initializing its first membership. openraft accepts `initialize` on every
//! member at once when all name the same voters (its docs: "Calling `initialize()` on multiple
//! nodes with identical configuration is also acceptable"), so a group whose members are
//! decided elsewhere (the cluster's metadata, the `[cluster]` settings) is formed by each
//! member initializing it with that same set: no member has to be up first.

use std::collections::BTreeMap;

use openraft::errors::{InitializeError, RaftError as OpenRaftError};

use super::Replica;
use crate::error::RaftError;
use crate::types::NodeAddr;

impl Replica {
    /// Whether the group's log holds a membership already (formed here before, or joined).
    pub async fn is_initialized(&self) -> Result<bool, RaftError> {
        self.raft
            .is_initialized()
            .await
            .map_err(|e| RaftError::Invalid(format!("group {}: {e}", self.group.0)))
    }

    /// Form the group with `voters` (node id to cluster address) unless its log holds a
    /// membership already. Every voter may call it at the same time with the same `voters`.
    pub async fn initialize_voters(&self, voters: &BTreeMap<u64, String>) -> Result<(), RaftError> {
        if self.is_initialized().await? {
            return Ok(());
        }
        let members: BTreeMap<u64, NodeAddr> = voters
            .iter()
            .map(|(id, addr)| (*id, NodeAddr { addr: addr.clone() }))
            .collect();
        match self.raft.initialize(members).await {
            Ok(()) => Ok(()),
            // Another member's membership arrived first: formed.
            Err(OpenRaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(error) => Err(RaftError::Invalid(format!(
                "form group {} with voters {:?}: {error}",
                self.group.0,
                voters.keys().collect::<Vec<_>>()
            ))),
        }
    }
}
