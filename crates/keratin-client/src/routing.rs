//! Following `ERR_NOT_LEADER` (421) in a cluster: the connections to other nodes, opened
//! lazily with the same options, and the bounded loop that sends a refused request again to
//! the leader the answer names, or, when it names none, after a short backoff to the nodes the
//! handshake listed in turn.
//!
//! Owns the bounds of that loop ([`NOT_LEADER_RETRIES_MAX`], the backoff) and the peer
//! connections. Publishing uses the same pieces per message (`publisher.rs`), consumers per
//! subscription (`consumer.rs`).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use keratin_proto::codes::ERR_NOT_LEADER;
use keratin_proto::ErrorBody;
use tokio::time::Instant;

use crate::client::Client;
use crate::connection::duration_ms;
use crate::error::ClientError;

/// Most times one call follows a 421 before it fails with [`ClientError::NotLeader`]. A
/// leadership move needs one redirect; an election in progress a few backoffs (100 ms,
/// 200 ms, then 250 ms each); 128 attempts take about 32 s of backoff at most, just past the
/// default publish timeout (30 s), so the count bounds a ping-pong between two nodes that
/// disagree and the timeout bounds everything else.
pub const NOT_LEADER_RETRIES_MAX: u32 = 128;
/// First wait after a 421 that names no leader.
pub const NOT_LEADER_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts after 421s without a leader: a quarter of the shortest
/// election timeout (500 ms), so that a client notices a new leader within about a quarter
/// second of its election (with a 1 s ceiling, an election over at 1.6 s was noticed at
/// 2.5 s: the cluster test's failover figures sat at 2.56 s), at four cheap requests a second
/// per waiting call.
pub const NOT_LEADER_BACKOFF_MAX: Duration = Duration::from_millis(250);
/// Redirects of one call to a named leader made without waiting; later ones back off like a
/// 421 without a leader. A leadership move needs one redirect.
const NOT_LEADER_IMMEDIATE_MAX: u32 = 2;
/// Most peer connections one client keeps: a cluster lists at most 64 nodes in its handshake
/// (`keratin_proto::handshake::SERVER_INFO_NODES_MAX`).
const PEERS_MAX: usize = 64;

/// The connections a client opened to other nodes, by protocol address. Shared by every
/// call of one client; each node's connection is shared by all the partitions it leads.
#[derive(Default)]
pub(crate) struct Peers {
    nodes: tokio::sync::Mutex<HashMap<String, Client>>,
}

/// The wait before attempt `retry` (1 for the first retry) after a 421 without a leader:
/// doubling from [`NOT_LEADER_BACKOFF_MIN`], at least the server's hint, at most
/// [`NOT_LEADER_BACKOFF_MAX`].
pub(crate) fn not_leader_backoff(retry: u32, hint_ms: Option<u32>) -> Duration {
    let doublings = retry.saturating_sub(1).min(8);
    let backoff = NOT_LEADER_BACKOFF_MIN.saturating_mul(1 << doublings);
    let hint = Duration::from_millis(u64::from(hint_ms.unwrap_or(0)));
    backoff.max(hint).min(NOT_LEADER_BACKOFF_MAX)
}

/// The error of a call that followed 421s `attempts` times since `started` and gives up.
pub(crate) fn not_leader_error(
    operation: &str,
    last: &ErrorBody,
    attempts: u32,
    started: Instant,
) -> ClientError {
    ClientError::NotLeader {
        operation: operation.to_owned(),
        attempts,
        elapsed_ms: duration_ms(started.elapsed()),
        last: Box::new(last.clone()),
    }
}

/// Whether `error` is a 421 to follow, and its body.
pub(crate) fn as_not_leader(error: &ClientError) -> Option<&ErrorBody> {
    match error {
        ClientError::Server(body) if body.code() == ERR_NOT_LEADER => Some(body),
        _ => None,
    }
}

impl Client {
    /// The connection to the node at `addr` (`None`: this one), opened on first use with this
    /// client's options and kept for later redirects.
    pub(crate) async fn node(&self, addr: Option<&str>) -> Result<Client, ClientError> {
        let Some(addr) = addr else {
            return Ok(self.clone());
        };
        // This client's own node, once its connection is lost, is reached like any other: a
        // partition it leads again (after a restart) needs a live connection.
        if self.is_own_address(addr) && self.is_connected() {
            return Ok(self.clone());
        }
        let mut nodes = self.peers().nodes.lock().await;
        if let Some(node) = nodes.get(addr) {
            if node.is_connected() {
                return Ok(node.clone());
            }
        }
        nodes.retain(|_, node| node.is_connected());
        if nodes.len() >= PEERS_MAX {
            nodes.clear();
        }
        let node = Client::connect(addr, self.options().clone()).await?;
        tracing::debug!(%addr, node_id = %node.node_id(), "connected to another keratin node");
        nodes.insert(addr.to_owned(), node.clone());
        Ok(node)
    }

    /// This connection while it is up, else the first other node of the handshake's list that
    /// accepts a connection (the error of the last one tried when none does).
    pub(crate) async fn live_node(&self) -> Result<Client, ClientError> {
        if self.is_connected() {
            return Ok(self.clone());
        }
        let mut last = self.lost_error();
        for node in &self.server_info().nodes {
            match self.node(Some(&node.server)).await {
                Ok(node) => return Ok(node),
                Err(error) => last = error,
            }
        }
        Err(last)
    }

    /// This connection's own protocol address, as its handshake names it (`None` from a node
    /// older than version 3, or one that did not list itself).
    pub(crate) fn own_address(&self) -> Option<&str> {
        self.server_info()
            .nodes
            .iter()
            .find(|node| node.node_id == self.node_id())
            .map(|node| node.server.as_str())
    }

    /// Whether the handshake named `addr` as this connection's own node.
    pub(crate) fn is_own_address(&self, addr: &str) -> bool {
        self.server_info()
            .nodes
            .iter()
            .any(|node| node.node_id == self.node_id() && node.server == addr)
    }

    /// Where to go for attempt `retry` when no leader is named: this connection's node, then
    /// each node of the handshake's list, in turn.
    pub(crate) fn fallback_node(&self, retry: u32) -> Option<String> {
        let nodes = &self.server_info().nodes;
        let index = usize::try_from(retry).unwrap_or(0) % (nodes.len() + 1);
        index
            .checked_sub(1)
            .map(|index| nodes[index].server.clone())
    }

    /// After the 421 `body` for attempt `retry` of a call that started at `started`: the
    /// address to send it to next (`Some(None)`: this connection's node), after the backoff
    /// when no leader is named; `None` once the count or `deadline` is reached.
    pub(crate) async fn next_node(
        &self,
        body: &ErrorBody,
        retry: u32,
        deadline: Instant,
    ) -> Option<Option<String>> {
        if retry > NOT_LEADER_RETRIES_MAX || Instant::now() >= deadline {
            return None;
        }
        if let Some(addr) = body.leader_addr() {
            // Nodes that name each other while a leadership moves would otherwise spend every
            // retry in milliseconds: only the first redirects go at once.
            if retry > NOT_LEADER_IMMEDIATE_MAX {
                let delay =
                    not_leader_backoff(retry - NOT_LEADER_IMMEDIATE_MAX, body.retry_after_ms());
                tokio::time::sleep_until((Instant::now() + delay).min(deadline)).await;
            }
            return Some(Some(addr.to_owned()));
        }
        let delay = not_leader_backoff(retry, body.retry_after_ms());
        tokio::time::sleep_until((Instant::now() + delay).min(deadline)).await;
        if Instant::now() >= deadline {
            return None;
        }
        Some(self.fallback_node(retry))
    }

    /// The connection to `addr`, or, when it cannot be reached now, this one after a backoff
    /// (bounded by `deadline`): this node names the leader it knows then.
    pub(crate) async fn node_or_own(
        &self,
        addr: Option<&str>,
        retry: u32,
        deadline: Instant,
    ) -> Client {
        match self.node(addr).await {
            Ok(node) => node,
            Err(error) => {
                tracing::debug!(?addr, %error, "could not reach the named leader");
                let delay = not_leader_backoff(retry, None);
                tokio::time::sleep_until((Instant::now() + delay).min(deadline)).await;
                self.clone()
            }
        }
    }

    /// [`Client::next_node`] and [`Client::node_or_own`] together, or the error that ends
    /// the call.
    pub(crate) async fn follow_not_leader(
        &self,
        operation: &str,
        body: &ErrorBody,
        retry: u32,
        started: Instant,
        deadline: Instant,
    ) -> Result<Client, ClientError> {
        match self.next_node(body, retry, deadline).await {
            Some(addr) => Ok(self.node_or_own(addr.as_deref(), retry, deadline).await),
            None => Err(not_leader_error(operation, body, retry, started)),
        }
    }

    /// Runs `call` on this connection and, while it fails with 421, again on the node the
    /// answer names (or the known nodes), within `timeout` and [`NOT_LEADER_RETRIES_MAX`].
    pub(crate) async fn routed<T, F, Fut>(
        &self,
        operation: &str,
        timeout: Duration,
        mut call: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut target = self.clone();
        let mut retry = 0;
        loop {
            let error = match call(target.clone()).await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            let Some(body) = as_not_leader(&error) else {
                return Err(error);
            };
            retry += 1;
            target = self
                .follow_not_leader(operation, body, retry, started, deadline)
                .await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_minimum_and_stops_at_the_maximum() {
        assert_eq!(not_leader_backoff(1, None), Duration::from_millis(100));
        assert_eq!(not_leader_backoff(2, None), Duration::from_millis(200));
        assert_eq!(not_leader_backoff(3, None), NOT_LEADER_BACKOFF_MAX);
        assert_eq!(not_leader_backoff(4, None), NOT_LEADER_BACKOFF_MAX);
        assert_eq!(not_leader_backoff(u32::MAX, None), NOT_LEADER_BACKOFF_MAX);
        assert_eq!(not_leader_backoff(2, Some(220)), Duration::from_millis(220));
        assert_eq!(not_leader_backoff(1, Some(60_000)), NOT_LEADER_BACKOFF_MAX);
    }
}
