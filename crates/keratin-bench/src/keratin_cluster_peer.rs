//! The Keratin cluster as a contender of `compare-cluster` (issue 14): where a replicated
//! queue's leader is and whether every node knows it (`keratin_health`), the failover producer
//! that moves to a survivor (`KeratinPublisher`), and the counting consumer
//! (`count_keratin`). Declaring, publishing and consuming in the other cases go through
//! `peers::Peer::Keratin` like every other system; the nodes themselves belong to
//! `bench/cluster.sh`.
//!
//! A Keratin client connected to any node follows `ERR_NOT_LEADER` (421) to the leader, so the
//! failover producer only has to replace a connection whose node died: on an error or a confirm
//! timeout it drops its client and connects to the next node, which redirects it to the new
//! leader once one is elected (the client retries a 421 without a leader after a backoff,
//! inside the publish timeout).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use keratin_client::{Client, ClientOptions, OutgoingMessage};

use crate::cluster_failover::{Sent, CONFIRM_TIMEOUT, COUNT_IDLE, RECONNECT_PAUSE};
use crate::contender::BenchResult;

/// Health checks: a node that does not answer its connect and handshake within this counts as
/// down for that check (a live node on loopback answers in a millisecond).
const HEALTH_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Options of a failover connection: a publish (its 421 retries included) and a connect both
/// give up after [`CONFIRM_TIMEOUT`], like the other systems' failover producers.
fn failover_options() -> ClientOptions {
    ClientOptions {
        name: "keratin-bench failover".into(),
        connect_timeout: CONFIRM_TIMEOUT,
        publish_timeout: CONFIRM_TIMEOUT,
        ..ClientOptions::default()
    }
}

/// Parses the client address of each node (`host:port`).
pub(crate) fn node_addrs(nodes: &[String]) -> BenchResult<Vec<SocketAddr>> {
    nodes
        .iter()
        .map(|n| {
            n.trim()
                .parse()
                .map_err(|e| format!("keratin node address {n:?}: {e}").into())
        })
        .collect()
}

/// What one node says about the leaders of `queue`'s partitions (node ids, `None` for a
/// partition whose leader it does not know); `None` when the node is down or does not know
/// the queue yet.
async fn leaders_seen_by(addr: SocketAddr, queue: &str) -> Option<Vec<Option<u64>>> {
    let options = ClientOptions {
        connect_timeout: HEALTH_CONNECT_TIMEOUT,
        request_timeout: HEALTH_CONNECT_TIMEOUT,
        ..ClientOptions::default()
    };
    let client = Client::connect(addr, options).await.ok()?;
    // Queue info is answered by the node itself (no 421): its own view of the partitions.
    let leaders = client
        .info(queue)
        .await
        .ok()
        .map(|info| info.partitions.iter().map(|p| p.leader).collect());
    client.close().await;
    leaders
}

/// What one node says about `queue`'s first (only) partition: its leader's node id; `None`
/// when the node is down, does not know the queue yet or knows no leader.
async fn leader_seen_by(addr: SocketAddr, queue: &str) -> Option<u64> {
    leaders_seen_by(addr, queue)
        .await?
        .first()
        .copied()
        .flatten()
}

/// The leaders (node ids) of `queue`'s partitions when every node of `nodes` names the same
/// leader for each partition and no node leads two of them (leaders spread over the nodes);
/// `None` until then.
pub(crate) async fn keratin_spread(nodes: &[SocketAddr], queue: &str) -> Option<Vec<u64>> {
    let mut agreed: Option<Vec<Option<u64>>> = None;
    for addr in nodes {
        let seen = leaders_seen_by(*addr, queue).await?;
        match &agreed {
            Some(first) if *first != seen => return None,
            _ => agreed = Some(seen),
        }
    }
    let leaders: Vec<u64> = agreed?.into_iter().collect::<Option<_>>()?;
    let mut distinct = leaders.clone();
    distinct.sort_unstable();
    distinct.dedup();
    (distinct.len() == leaders.len()).then_some(leaders)
}

/// `queue`'s leader (node number, 1-based) as most nodes see it, and how many nodes answer
/// with that leader. Keratin names no in-sync set yet (docs/cluster.md, "What exists today"):
/// a node that knows the queue and its current leader is the closest check of "member online
/// and current" there is.
pub(crate) async fn keratin_health(
    nodes: &[SocketAddr],
    queue: &str,
) -> BenchResult<(Option<usize>, usize)> {
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for addr in nodes {
        if let Some(leader) = leader_seen_by(*addr, queue).await {
            *seen.entry(leader).or_default() += 1;
        }
    }
    let Some((leader, count)) = seen.into_iter().max_by_key(|(_, count)| *count) else {
        return Ok((None, 0));
    };
    let leader = usize::try_from(leader)
        .ok()
        .filter(|n| (1..=nodes.len()).contains(n));
    Ok((leader, count))
}

/// A Keratin producer that reconnects, node after node, after a failure.
pub(crate) struct KeratinPublisher {
    /// Every node's client address, the leader's first.
    addrs: Vec<SocketAddr>,
    queue: String,
    client: Option<Client>,
    /// Counts connections opened; a failure of an older one leaves the current one alone.
    generation: u64,
    /// The node tried next.
    next_node: usize,
    /// No new sweep before this.
    retry_at: Instant,
}

impl KeratinPublisher {
    /// Connects to the first node of `addrs` that answers (the leader's first).
    pub(crate) async fn connect(
        addrs: Vec<SocketAddr>,
        queue: &str,
    ) -> BenchResult<KeratinPublisher> {
        let mut publisher = KeratinPublisher {
            addrs,
            queue: queue.to_string(),
            client: None,
            generation: 0,
            next_node: 0,
            retry_at: Instant::now(),
        };
        publisher
            .client()
            .await
            .ok_or("keratin-cluster: no node accepted a connection")?;
        Ok(publisher)
    }

    /// The client, connecting to the next node that answers if there is none.
    async fn client(&mut self) -> Option<Client> {
        if let Some(client) = &self.client {
            return Some(client.clone());
        }
        if Instant::now() < self.retry_at {
            return None;
        }
        for _ in 0..self.addrs.len() {
            let addr = self.addrs[self.next_node % self.addrs.len()];
            self.next_node += 1;
            if let Ok(client) = Client::connect(addr, failover_options()).await {
                self.generation += 1;
                // The node that just answered is tried first again after a failure.
                self.next_node -= 1;
                self.client = Some(client.clone());
                return Some(client);
            }
        }
        self.retry_at = Instant::now() + RECONNECT_PAUSE;
        None
    }

    /// Starts a confirmed publish of `body` as `seq`, or `None` while no node answers.
    pub(crate) async fn send(&mut self, seq: u64, body: Bytes) -> Option<Sent> {
        let client = self.client().await?;
        let (generation, queue) = (self.generation, self.queue.clone());
        Some(
            async move {
                let publish = client.publish(&queue, OutgoingMessage::new(body));
                let outcome = match tokio::time::timeout(CONFIRM_TIMEOUT, publish).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err("no confirm within the timeout".into()),
                };
                (generation, seq, outcome)
            }
            .boxed(),
        )
    }

    /// A publish of connection `generation` failed: drop that client (and move to the next
    /// node) unless a newer one replaced it already.
    pub(crate) fn failed(&mut self, generation: u64) {
        if generation != self.generation {
            return;
        }
        if let Some(client) = self.client.take() {
            self.next_node += 1;
            tokio::spawn(async move {
                let _ = tokio::time::timeout(CONFIRM_TIMEOUT, client.close()).await;
            });
        }
    }

    /// Connections opened, the first included.
    pub(crate) fn connections(&self) -> u64 {
        self.generation
    }

    /// Closes the current connection.
    pub(crate) async fn close(self) {
        if let Some(client) = self.client {
            let _ = tokio::time::timeout(CONFIRM_TIMEOUT, client.close()).await;
        }
    }
}

/// Consumes and acks everything in `queue` through node `addr` (the client follows the
/// partition's leader), calling `count` with each body, until [`COUNT_IDLE`] passes without a
/// delivery or `deadline`.
pub(crate) async fn count_keratin(
    addr: SocketAddr,
    queue: &str,
    deadline: Instant,
    mut count: impl FnMut(&[u8]),
) -> BenchResult<()> {
    let client = Client::connect(addr, ClientOptions::default()).await?;
    let mut consumer = client.subscribe(queue, 1000).await?;
    while Instant::now() < deadline {
        match tokio::time::timeout(COUNT_IDLE, consumer.recv()).await {
            Ok(Some(delivery)) => {
                count(&delivery.body);
                delivery.ack()?;
            }
            Ok(None) | Err(_) => break,
        }
    }
    // The count is what matters; a cancel refused by a node going away changes nothing.
    let _ = consumer.cancel().await;
    client.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_parse_and_refuse_garbage() {
        let addrs = node_addrs(&["127.0.0.1:25721".into(), " 127.0.0.1:25722".into()]).unwrap();
        assert_eq!(addrs[1].port(), 25722);
        let error = node_addrs(&["localhost".into()]).unwrap_err().to_string();
        assert!(error.contains("localhost"), "{error}");
    }
}
