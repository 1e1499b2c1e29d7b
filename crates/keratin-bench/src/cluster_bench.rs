//! The `compare-cluster` benchmark (issue 14): three-node clusters on loopback, in one run, as
//! one table of figures and ratios between systems. The peer clusters (a RabbitMQ quorum queue
//! of 3 members, a NATS JetStream R3 file stream) are started by `bench/cluster.sh`
//! (`MODE=cluster bash bench/compare.sh`) and reached by address; the harness calls the script
//! back (`cluster_ctl::NodeCtl`) for the process ids it kills and to restart a killed node.
//!
//! Cases (1 KiB bodies, the client connected to the queue's leader):
//! - `publish`: 1 producer, `in_flight` confirmed publishes in flight (msg/s);
//! - `publish-3`: 3 producers (a connection each) on one queue, `in_flight` each (msg/s);
//! - `publish-3p` and `publish-3p-3` (Keratin only: a quorum queue or a NATS stream is one Raft
//!   group): 1 and 3 producers on a queue of 3 partitions whose leaders are on the three nodes,
//!   connected to node 1 (and 2, 3), the client sending each partition's messages to its
//!   leader; against `publish` and `publish-3` of the same run (goal >= 1.5x);
//! - `consume`: consume + ack a backlog of `backlog` (msg/s);
//! - `latency`: publish-to-confirm p50 / p99 at a paced `latency_rate`;
//! - `failover`: a producer publishes confirmed at a paced `failover_rate`; the leader's process
//!   is killed (SIGKILL, by pid); the figure is the time from the kill to the first confirm of a
//!   publish sent after it. The AMQP publisher reopens a connection to the next node on a nack,
//!   an error or a confirm timeout (lapin does not reconnect); async-nats is given every server
//!   and reconnects itself. Afterwards a consumer on a survivor counts what the queue holds
//!   against what was confirmed, and the killed node is restarted and waited for until the queue
//!   has every member online again, so that every round starts from 3 healthy nodes.
//!
//! Rounds interleave the systems (A B, then B A); figures are medians over rounds.
//!
//! # The Keratin contenders
//! - `keratin-cluster`: three `keratin serve` processes of `bench/cluster.sh` (client addresses
//!   `--keratin-nodes`), a queue declared with 3 replicas through `peers::Peer::Keratin`, its
//!   leader found by asking every node (`keratin_cluster_peer::keratin_health`), the failover
//!   producer and the counting consumer of `keratin_cluster_peer`;
//! - `keratin-single`: one Keratin node started by this harness (compare's `KeratinChild`, on
//!   `--dir`), for the goal "replicated publish >= 0.5x single node" in the same run; it has
//!   no failover round.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::broker_bench::runtime;
use crate::cluster_ctl::{alive, kill9, nats_node_number, rabbit_queue_status, NodeCtl};
use crate::cluster_failover::{
    count_messages, failover_publish, tally, FailoverOutcome, FailoverPublisher, FAILOVER_DEADLINE,
};
use crate::compare::{fixed_rate, publish_window, KeratinChild};
use crate::contender::{BenchError, BenchResult};
use crate::keratin_cluster_peer::{keratin_health, keratin_spread, node_addrs};
use crate::net_bench::latency_line;
use crate::peers::{Endpoints, Peer, System};
use crate::report::{median, percentile};

/// Confirmed publish: Keratin cluster / RabbitMQ quorum at least this (issue 14).
const GOAL_PUBLISH_VS_QUORUM: f64 = 3.0;
/// Confirmed publish: Keratin cluster / NATS R3 at least this.
const GOAL_PUBLISH_VS_NATS: f64 = 1.0;
/// Confirmed publish: Keratin cluster / Keratin single node (same run) at least this.
const GOAL_PUBLISH_VS_SINGLE: f64 = 0.5;
/// Failover: leader kill to the first confirm on the new leader at most this.
const GOAL_FAILOVER: Duration = Duration::from_secs(2);
/// Members of every replicated queue.
pub const REPLICAS: usize = 3;
/// Partitions of the queue of the partitioned cases, one led by each node.
const PARTITIONS: u32 = 3;
/// Producers of the cases with several, each its own connection.
const PRODUCERS: usize = 3;
/// A partitioned queue over three nodes against a queue of one partition (same producers,
/// same run) at least this.
const GOAL_PARTITIONED: f64 = 1.5;
/// A queue gets this long to have every member online and current (after a declare or a
/// restart).
const HEALTHY_DEADLINE: Duration = Duration::from_secs(90);

/// Why `keratin-single` has no failover figure.
const SINGLE_NO_FAILOVER: &str = "keratin-single: one node has no failover; its round is skipped";

/// A replicated broker under comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ClusterSystem {
    /// Three Keratin nodes, replicas 3.
    KeratinCluster,
    /// One Keratin node, started by the harness (the reference of the 0.5x goal).
    KeratinSingle,
    /// RabbitMQ, a quorum queue of 3 members on a 3-node cluster.
    RabbitQuorum,
    /// NATS JetStream, a file stream with 3 replicas on a 3-node cluster.
    NatsR3,
}

impl ClusterSystem {
    /// Every system, in the table's column order.
    pub const ALL: [ClusterSystem; 4] = [
        ClusterSystem::KeratinCluster,
        ClusterSystem::KeratinSingle,
        ClusterSystem::RabbitQuorum,
        ClusterSystem::NatsR3,
    ];

    /// The name on the command line, in `bench/cluster.sh ctl` and in the table.
    pub fn name(self) -> &'static str {
        match self {
            ClusterSystem::KeratinCluster => "keratin-cluster",
            ClusterSystem::KeratinSingle => "keratin-single",
            ClusterSystem::RabbitQuorum => "rabbitmq-quorum",
            ClusterSystem::NatsR3 => "nats-r3",
        }
    }

    /// Parses a name of [`ClusterSystem::name`].
    pub fn parse(text: &str) -> Result<ClusterSystem, String> {
        ClusterSystem::ALL
            .into_iter()
            .find(|s| s.name() == text.trim())
            .ok_or_else(|| {
                format!(
                    "unknown system {text:?}; use keratin-cluster, keratin-single, \
                     rabbitmq-quorum or nats-r3"
                )
            })
    }

    /// Who fsyncs before a confirm, as far as it can be checked here (docs/benchmarks.md).
    pub fn confirm_meaning(self) -> &'static str {
        match self {
            ClusterSystem::KeratinCluster => {
                "fsynced on a majority: a publish is confirmed once its Raft entry is committed, \
                 that is fdatasynced (group commit of the partition's segment log) on a majority \
                 of the 3 replicas, and applied on the leader (keratin-raft reports an append \
                 flushed to openraft only after the segment log's fdatasync: crates/keratin-raft \
                 lib.rs, \"Durability\")"
            }
            ClusterSystem::KeratinSingle => {
                "fsynced: fdatasync of the segment before the confirm (one node, no replica)"
            }
            ClusterSystem::RabbitQuorum => {
                "fsynced on a majority: a quorum queue confirms once the Raft entry is written on \
                 a majority of its members (the leader and at least 1 of the 2 followers), and Ra \
                 fsyncs an entry before it is actioned (Ra's log docs; the WAL fdatasyncs each \
                 batch: the installed Ra 2.2.0 carries wal_sync_method with datasync, its \
                 default); about 21,000 fdatasync calls in 11 s at 5,000/s across the 3 nodes \
                 were measured on this machine kind (docs/peers.md)"
            }
            ClusterSystem::NatsR3 => {
                "NOT fsynced: NATS 2.9 acks once a majority of the stream's replicas hold the \
                 message in their file store, written to the page cache; the store fsyncs every \
                 sync_interval (2 min by default, docs.nats.io), no peer fsyncs before the ack \
                 (0 fdatasync measured, docs/peers.md), and 2.9.10 refuses `sync_interval: always` \
                 (unknown field)"
            }
        }
    }

    /// The driver of `peers` that speaks this system's protocol.
    fn peer_system(self) -> BenchResult<System> {
        match self {
            ClusterSystem::KeratinCluster | ClusterSystem::KeratinSingle => Ok(System::Keratin),
            ClusterSystem::RabbitQuorum => Ok(System::RabbitQuorum),
            ClusterSystem::NatsR3 => Ok(System::Nats),
        }
    }
}

/// A case of `compare-cluster`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ClusterCase {
    /// 1 producer, `in_flight` confirmed publishes in flight.
    Publish,
    /// [`PRODUCERS`] producers on one queue, each with `in_flight` in flight: the reference of
    /// [`ClusterCase::PartitionedProducers`].
    Producers,
    /// 1 producer on a Keratin queue of [`PARTITIONS`] partitions whose leaders are on
    /// different nodes, connected to node 1 (its client sends each partition's messages to
    /// that partition's leader).
    Partitioned,
    /// [`PRODUCERS`] producers on that queue, connected to nodes 1, 2 and 3.
    PartitionedProducers,
    /// Consume + ack of a backlog.
    Consume,
    /// Publish-to-confirm latency at a paced rate.
    Latency,
    /// Kill -9 of the leader under a paced producer.
    Failover,
}

impl ClusterCase {
    /// Parses a case name.
    pub fn parse(text: &str) -> Result<ClusterCase, String> {
        Ok(match text.trim() {
            "publish" => ClusterCase::Publish,
            "publish-3" => ClusterCase::Producers,
            "publish-3p" => ClusterCase::Partitioned,
            "publish-3p-3" => ClusterCase::PartitionedProducers,
            "consume" => ClusterCase::Consume,
            "latency" => ClusterCase::Latency,
            "failover" => ClusterCase::Failover,
            other => {
                return Err(format!(
                    "unknown case {other:?}; use publish, publish-3, publish-3p, publish-3p-3, \
                     consume, latency, failover"
                ))
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            ClusterCase::Publish => "publish",
            ClusterCase::Producers => "publish-3",
            ClusterCase::Partitioned => "publish-3p",
            ClusterCase::PartitionedProducers => "publish-3p-3",
            ClusterCase::Consume => "consume",
            ClusterCase::Latency => "latency",
            ClusterCase::Failover => "failover",
        }
    }

    /// Whether the case measures publishing (msg/s of confirmed publishes).
    fn publishes(self) -> bool {
        matches!(
            self,
            ClusterCase::Publish
                | ClusterCase::Producers
                | ClusterCase::Partitioned
                | ClusterCase::PartitionedProducers
        )
    }

    /// The producers of a publish case.
    fn producers(self) -> usize {
        match self {
            ClusterCase::Producers | ClusterCase::PartitionedProducers => PRODUCERS,
            _ => 1,
        }
    }

    /// Whether the case's queue has [`PARTITIONS`] partitions.
    fn partitioned(self) -> bool {
        matches!(
            self,
            ClusterCase::Partitioned | ClusterCase::PartitionedProducers
        )
    }

    /// Why `system` does not run this case, if it does not.
    fn skipped_for(self, system: ClusterSystem) -> Option<&'static str> {
        match (self, system) {
            (ClusterCase::Failover, ClusterSystem::KeratinSingle) => Some(SINGLE_NO_FAILOVER),
            (ClusterCase::Partitioned | ClusterCase::PartitionedProducers, s)
                if !matches!(
                    s,
                    ClusterSystem::KeratinCluster | ClusterSystem::KeratinSingle
                ) =>
            {
                Some(
                    "publish-3p and publish-3p-3: a RabbitMQ quorum queue and a NATS stream have \
                     no partitions (one Raft group each); they run publish and publish-3 only",
                )
            }
            _ => None,
        }
    }
}

/// What `keratin-bench compare-cluster` runs.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The systems, in column order.
    pub systems: Vec<ClusterSystem>,
    /// The cases.
    pub cases: Vec<ClusterCase>,
    /// AMQP URI of each RabbitMQ node, node 1 first.
    pub amqp_nodes: Vec<String>,
    /// URL of each NATS server, `n1` first.
    pub nats_nodes: Vec<String>,
    /// Client address (`host:port`) of each Keratin node, node 1 first.
    pub keratin_nodes: Vec<String>,
    /// Where the single Keratin node keeps its data (a fresh directory under it).
    pub dir: PathBuf,
    /// The single Keratin node's address, once [`run`] started it.
    pub keratin_single: Option<SocketAddr>,
    /// The node control hook (`bench/cluster.sh ctl`); the failover case needs it.
    pub ctl: Option<NodeCtl>,
    /// Length of each publish and latency run.
    pub duration: Duration,
    /// Rounds.
    pub rounds: usize,
    /// Body bytes.
    pub body_bytes: usize,
    /// Most confirmed publishes in flight (publish, backlog fill).
    pub in_flight: usize,
    /// Messages queued before a consume run.
    pub backlog: u64,
    /// Unacked deliveries at most.
    pub prefetch: u32,
    /// Messages per second of the latency case.
    pub latency_rate: u32,
    /// Messages per second of the failover producer.
    pub failover_rate: u32,
    /// Where to write the markdown section, besides stdout.
    pub out: Option<PathBuf>,
}

impl ClusterConfig {
    pub(crate) fn nodes(&self, system: ClusterSystem) -> BenchResult<&[String]> {
        let nodes = match system {
            ClusterSystem::KeratinCluster => &self.keratin_nodes,
            ClusterSystem::KeratinSingle => {
                return Err("keratin-single is one node, not a cluster".into())
            }
            ClusterSystem::RabbitQuorum => &self.amqp_nodes,
            ClusterSystem::NatsR3 => &self.nats_nodes,
        };
        if nodes.len() != REPLICAS {
            return Err(format!(
                "{}: {} node addresses given, {REPLICAS} needed",
                system.name(),
                nodes.len()
            )
            .into());
        }
        Ok(nodes)
    }

    fn endpoints(&self, system: ClusterSystem, node: usize) -> BenchResult<Endpoints> {
        if system == ClusterSystem::KeratinSingle {
            return Ok(Endpoints {
                keratin: Some(
                    self.keratin_single
                        .ok_or("keratin-single: the node is not started")?,
                ),
                ..Endpoints::default()
            });
        }
        let url = self.nodes(system)?[node - 1].clone();
        Ok(match system {
            ClusterSystem::KeratinCluster => Endpoints {
                keratin: Some(node_addrs(std::slice::from_ref(&url))?[0]),
                ..Endpoints::default()
            },
            ClusterSystem::RabbitQuorum => Endpoints {
                amqp: Some(url),
                ..Endpoints::default()
            },
            _ => Endpoints {
                nats: Some(url),
                ..Endpoints::default()
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Leaders and health.

/// Where a queue stands: its leader's node number, and members online and current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Health {
    leader: Option<usize>,
    current: usize,
}

async fn nats_health(context: &async_nats::jetstream::Context, queue: &str) -> BenchResult<Health> {
    let mut stream = context
        .get_stream(queue)
        .await
        .map_err(|e| format!("stream {queue}: {e}"))?;
    let info = stream
        .info()
        .await
        .map_err(|e| format!("stream info {queue}: {e}"))?;
    let Some(cluster) = info.cluster.as_ref() else {
        return Ok(Health {
            leader: None,
            current: 0,
        });
    };
    let leader = cluster.leader.as_deref().and_then(nats_node_number);
    let followers = cluster
        .replicas
        .iter()
        .filter(|p| p.current && !p.offline)
        .count();
    Ok(Health {
        leader,
        current: followers + usize::from(leader.is_some()),
    })
}

fn rabbit_health(ctl: &NodeCtl, queue: &str) -> BenchResult<Health> {
    let text = ctl.leader_text(ClusterSystem::RabbitQuorum.name(), queue)?;
    Ok(rabbit_queue_status(&text, queue).map_or(
        Health {
            leader: None,
            current: 0,
        },
        |s| Health {
            leader: Some(s.leader),
            current: if s.members == REPLICAS { s.online } else { 0 },
        },
    ))
}

/// Waits until `queue` has a leader and every member online (RabbitMQ) or current (NATS);
/// returns its leader.
async fn wait_healthy(
    config: &ClusterConfig,
    system: ClusterSystem,
    queue: &str,
) -> BenchResult<usize> {
    let began = Instant::now();
    let mut last = None;
    while began.elapsed() < HEALTHY_DEADLINE {
        let health = match system {
            ClusterSystem::RabbitQuorum => {
                let ctl = config
                    .ctl
                    .as_ref()
                    .ok_or("rabbitmq-quorum: finding a leader needs --ctl")?;
                rabbit_health(ctl, queue)
            }
            ClusterSystem::NatsR3 => {
                let peer =
                    Peer::connect(System::Nats, &config.endpoints(system, 1)?, queue).await?;
                let health = match &peer {
                    Peer::Nats { context, .. } => nats_health(context, queue).await,
                    _ => Err("not a NATS connection".into()),
                };
                peer.close().await;
                health
            }
            ClusterSystem::KeratinCluster => {
                keratin_health(&node_addrs(config.nodes(system)?)?, queue)
                    .await
                    .map(|(leader, current)| Health { leader, current })
            }
            ClusterSystem::KeratinSingle => return Ok(1),
        };
        match health {
            Ok(Health {
                leader: Some(leader),
                current,
            }) if current == REPLICAS => return Ok(leader),
            other => last = Some(format!("{other:?}")),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "{} {queue}: not every member online within {} s (last seen: {})",
        system.name(),
        HEALTHY_DEADLINE.as_secs(),
        last.unwrap_or_default()
    )
    .into())
}

/// A fresh replicated queue with every member online, and a connection to its leader: (the
/// connection, the leader's node number).
async fn fresh_on_leader(
    config: &ClusterConfig,
    system: ClusterSystem,
    queue: &str,
) -> BenchResult<(Peer, usize)> {
    let driver = system.peer_system()?;
    // A quorum queue's leader is the node its declaring client is connected to; a NATS
    // stream's is chosen by the meta leader, and found in the stream's info; a Keratin
    // partition's by the cluster's placement, and found by asking every node.
    let first = Peer::connect(driver, &config.endpoints(system, 1)?, queue).await?;
    // A queue left by an earlier, interrupted run would hold its messages.
    let _ = first.delete().await;
    let replicas = (system != ClusterSystem::KeratinSingle).then_some(REPLICAS);
    first.declare_replicated(driver, None, replicas).await?;
    let leader = wait_healthy(config, system, queue).await?;
    if leader == 1 {
        return Ok((first, 1));
    }
    first.close().await;
    let peer = Peer::connect(driver, &config.endpoints(system, leader)?, queue).await?;
    Ok((peer, leader))
}

/// A fresh Keratin queue of [`PARTITIONS`] partitions (3 replicas each on the cluster) whose
/// leaders are on different nodes, and `producers` connections: the first to node 1, the next
/// to nodes 2 and 3 (all to the node of keratin-single); with the partitions' leaders.
async fn fresh_partitioned(
    config: &ClusterConfig,
    system: ClusterSystem,
    queue: &str,
    producers: usize,
) -> BenchResult<(Vec<Peer>, Vec<u64>)> {
    let driver = system.peer_system()?;
    let cluster = system == ClusterSystem::KeratinCluster;
    let first = Peer::connect(driver, &config.endpoints(system, 1)?, queue).await?;
    // A queue left by an earlier, interrupted run would hold its messages.
    let _ = first.delete().await;
    first
        .declare_partitioned(PARTITIONS, cluster.then_some(REPLICAS))
        .await?;
    let leaders = if cluster {
        wait_spread(config, queue).await?
    } else {
        vec![1; PARTITIONS as usize]
    };
    let mut peers = vec![first];
    for i in 1..producers {
        let node = if cluster { i % REPLICAS + 1 } else { 1 };
        peers.push(Peer::connect(driver, &config.endpoints(system, node)?, queue).await?);
    }
    Ok((peers, leaders))
}

/// Waits until every Keratin node names the same leaders for `queue`'s partitions, each on
/// another node (leader balancing hands each partition to its preferred leader, which
/// placement rotates over the nodes); returns them.
async fn wait_spread(config: &ClusterConfig, queue: &str) -> BenchResult<Vec<u64>> {
    let nodes = node_addrs(config.nodes(ClusterSystem::KeratinCluster)?)?;
    let began = Instant::now();
    while began.elapsed() < HEALTHY_DEADLINE {
        if let Some(leaders) = keratin_spread(&nodes, queue).await {
            return Ok(leaders);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "keratin-cluster {queue}: the leaders of its {PARTITIONS} partitions were not on \
         {PARTITIONS} different nodes within {} s (is leader balancing off? `keratin cluster \
         rebalance` moves them)",
        HEALTHY_DEADLINE.as_secs()
    )
    .into())
}

/// `peers` publishing at once, each with `in_flight` confirmed publishes in flight, for
/// `duration`: the publishes confirmed in all, and the longest producer's time.
async fn publish_together(
    peers: &[Peer],
    body: &Bytes,
    in_flight: usize,
    duration: Duration,
) -> BenchResult<(u64, Duration)> {
    let runs = peers
        .iter()
        .map(|peer| publish_window(peer, body, in_flight, duration, None));
    let (mut confirmed, mut longest) = (0, Duration::ZERO);
    for result in futures_util::future::join_all(runs).await {
        let (count, took) = result?;
        confirmed += count;
        longest = longest.max(took);
    }
    Ok((confirmed, longest))
}

// ---------------------------------------------------------------------------------------------
// The rounds.

/// Everything measured, by case and system.
#[derive(Debug, Default)]
struct Results {
    /// msg/s per round, by (case, system).
    rates: BTreeMap<(ClusterCase, String), Vec<f64>>,
    /// Latencies (µs) of every round, by system.
    latencies: BTreeMap<String, Vec<u64>>,
    /// Failover rounds, by system.
    failovers: BTreeMap<String, Vec<FailoverOutcome>>,
    /// Lines printed under the tables.
    notes: Vec<String>,
}

struct Harness<'a> {
    config: &'a ClusterConfig,
    body: Bytes,
    /// Makes queue names of this run unique: a quorum queue re-declared right after the
    /// deletion of one of the same name can come up with a member offline.
    nonce: u32,
    results: Results,
}

impl Harness<'_> {
    fn queue(&self, case: ClusterCase, round: usize) -> String {
        format!("kbench-{}-{round}-{}", case.name(), self.nonce)
    }

    fn throughput(
        &mut self,
        rt: &tokio::runtime::Runtime,
        case: ClusterCase,
        system: ClusterSystem,
        round: usize,
    ) -> BenchResult<()> {
        let (config, body, queue) = (self.config, self.body.clone(), self.queue(case, round));
        let rate = rt.block_on(async {
            let (peers, placed) = if case.partitioned() {
                let (peers, leaders) =
                    fresh_partitioned(config, system, &queue, case.producers()).await?;
                (peers, format!("leaders {leaders:?}"))
            } else {
                let (first, leader) = fresh_on_leader(config, system, &queue).await?;
                let mut peers = vec![first];
                for _ in 1..case.producers() {
                    let endpoints = config.endpoints(system, leader)?;
                    peers.push(Peer::connect(system.peer_system()?, &endpoints, &queue).await?);
                }
                (peers, format!("leader n{leader}"))
            };
            let rate = if case.publishes() {
                let warm = Duration::from_millis(200);
                publish_together(&peers, &body, config.in_flight, warm).await?;
                let (confirmed, elapsed) =
                    publish_together(&peers, &body, config.in_flight, config.duration).await?;
                confirmed as f64 / elapsed.as_secs_f64().max(1e-9)
            } else {
                let peer = &peers[0];
                let (queued, _) = publish_window(
                    peer,
                    &body,
                    config.in_flight,
                    Duration::from_secs(3600),
                    Some(config.backlog),
                )
                .await?;
                let began = Instant::now();
                let consumed = peer
                    .consume(queued, config.prefetch, Duration::from_secs(10))
                    .await?;
                let elapsed = began.elapsed();
                if consumed < queued {
                    return Err(format!(
                        "{}: consumed {consumed} of {queued} before 10 s without a delivery",
                        system.name()
                    )
                    .into());
                }
                consumed as f64 / elapsed.as_secs_f64().max(1e-9)
            };
            eprintln!(
                "  {} {}: {rate:.0} msg/s ({placed})",
                case.name(),
                system.name()
            );
            peers[0].delete().await?;
            for peer in peers {
                peer.close().await;
            }
            Ok::<_, BenchError>(rate)
        })?;
        self.results
            .rates
            .entry((case, system.name().to_string()))
            .or_default()
            .push(rate);
        Ok(())
    }

    fn latency(
        &mut self,
        rt: &tokio::runtime::Runtime,
        system: ClusterSystem,
        round: usize,
    ) -> BenchResult<()> {
        let (config, body, queue) = (
            self.config,
            self.body.clone(),
            self.queue(ClusterCase::Latency, round),
        );
        let latencies = rt.block_on(async {
            let (peer, _) = fresh_on_leader(config, system, &queue).await?;
            let warm = Duration::from_millis(300);
            fixed_rate(&peer, &body, config.latency_rate, warm).await?;
            let latencies = fixed_rate(&peer, &body, config.latency_rate, config.duration).await?;
            peer.delete().await?;
            peer.close().await;
            Ok::<_, BenchError>(latencies)
        })?;
        eprintln!("  latency {}: {}", system.name(), latency_line(&latencies));
        self.results
            .latencies
            .entry(system.name().into())
            .or_default()
            .extend(latencies);
        Ok(())
    }

    fn failover(
        &mut self,
        rt: &tokio::runtime::Runtime,
        system: ClusterSystem,
        round: usize,
    ) -> BenchResult<()> {
        let config = self.config;
        let ctl = config
            .ctl
            .as_ref()
            .ok_or("the failover case needs --ctl (bench/cluster.sh ctl)")?;
        let queue = self.queue(ClusterCase::Failover, round);
        let outcome = rt.block_on(async {
            let (peer, leader) = fresh_on_leader(config, system, &queue).await?;
            peer.close().await;
            let pid = ctl.pid(system.name(), leader)?;
            let survivor = leader % REPLICAS + 1;
            let mut killed = false;
            // Whatever happens after the kill, the node is started again below.
            let measured = async {
                let mut publisher =
                    FailoverPublisher::connect(config, system, leader, &queue).await?;
                let log = failover_publish(
                    &mut publisher,
                    config.body_bytes,
                    config.failover_rate,
                    || {
                        eprintln!(
                            "  failover {}: kill -9 {pid} (node {leader})",
                            system.name()
                        );
                        killed = true;
                        kill9(pid)
                    },
                )
                .await;
                let connections = publisher.connections();
                publisher.close().await;
                let log = log?;
                let delivered = count_messages(config, system, survivor, &queue).await?;
                let mut confirmed = log.confirmed.clone();
                confirmed.sort_unstable();
                confirmed.dedup();
                Ok::<_, BenchError>(FailoverOutcome {
                    leader,
                    recovery: log.recovery,
                    tally: tally(&confirmed, &delivered),
                    failures: log.failures,
                    first_failure: log.first_failure,
                    connections,
                    rejoin: None,
                })
            }
            .await;
            // Back to 3 healthy nodes for the next round.
            let began = Instant::now();
            let rejoin = if killed || !alive(pid) {
                ctl.restart(system.name(), leader)?;
                wait_healthy(config, system, &queue).await?;
                Some(began.elapsed())
            } else {
                None
            };
            let mut outcome = measured?;
            outcome.rejoin = rejoin;
            let cleanup = Peer::connect(
                system.peer_system()?,
                &config.endpoints(system, survivor)?,
                &queue,
            )
            .await?;
            cleanup.delete().await?;
            cleanup.close().await;
            Ok::<_, BenchError>(outcome)
        })?;
        eprintln!("  failover {}: {outcome:?}", system.name());
        self.results
            .failovers
            .entry(system.name().into())
            .or_default()
            .push(outcome);
        Ok(())
    }
}

/// The single Keratin node of a run and its data directory, removed when dropped.
struct SingleNode {
    child: Option<KeratinChild>,
    dir: PathBuf,
}

impl SingleNode {
    fn start(base: &std::path::Path) -> BenchResult<SingleNode> {
        let dir = base.join(format!("keratin-single-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let mut node = SingleNode { child: None, dir };
        node.child = Some(KeratinChild::start(&node.dir, None)?);
        Ok(node)
    }

    fn addr(&self) -> Option<SocketAddr> {
        self.child.as_ref().map(KeratinChild::addr)
    }
}

impl Drop for SingleNode {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            if let Err(error) = child.stop() {
                eprintln!("keratin-single: {error}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs every case and prints (and writes) the markdown section.
pub fn run(config: &ClusterConfig) -> BenchResult<()> {
    if config.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let mut config = config.clone();
    let single = if config.systems.contains(&ClusterSystem::KeratinSingle) {
        let node = SingleNode::start(&config.dir)?;
        config.keratin_single = node.addr();
        Some(node)
    } else {
        None
    };
    let config = &config;
    let mut harness = Harness {
        config,
        body: Bytes::from(vec![0x5a_u8; config.body_bytes]),
        nonce: std::process::id(),
        results: Results::default(),
    };
    for &case in &config.cases {
        for &system in &config.systems {
            if let Some(reason) = case.skipped_for(system) {
                if !harness.results.notes.iter().any(|n| n == reason) {
                    harness.results.notes.push(reason.into());
                }
            }
        }
    }
    let rt = runtime()?;
    for &case in &config.cases {
        eprintln!("{}:", case.name());
        for round in 0..config.rounds {
            let mut order = config.systems.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for system in order {
                if case.skipped_for(system).is_some() {
                    continue;
                }
                let result = match case {
                    ClusterCase::Publish
                    | ClusterCase::Producers
                    | ClusterCase::Partitioned
                    | ClusterCase::PartitionedProducers
                    | ClusterCase::Consume => harness.throughput(&rt, case, system, round),
                    ClusterCase::Latency => harness.latency(&rt, system, round),
                    ClusterCase::Failover => harness.failover(&rt, system, round),
                };
                // One failed round is reported, not the end of the run: the others still
                // measure, and the table says which figure misses a round.
                if let Err(error) = result {
                    let line = format!(
                        "FAILED: {} round {} of {}: {error}",
                        case.name(),
                        round + 1,
                        system.name()
                    );
                    eprintln!("  {line}");
                    harness.results.notes.push(line);
                }
            }
        }
    }
    drop(rt);
    drop(single);
    let text = markdown(config, &harness.results);
    print!("{text}");
    if let Some(out) = &config.out {
        std::fs::write(out, &text).map_err(|e| format!("write {}: {e}", out.display()))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The tables.

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn seconds(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Median failover time of a system's rounds; a round without a confirm counts as the deadline.
fn median_recovery(outcomes: &[FailoverOutcome]) -> Option<f64> {
    if outcomes.is_empty() {
        return None;
    }
    let values: Vec<f64> = outcomes
        .iter()
        .map(|o| o.recovery.unwrap_or(FAILOVER_DEADLINE).as_secs_f64())
        .collect();
    Some(median(&values))
}

/// The figure of `case` for `system`: msg/s, p99 µs or failover seconds (medians).
fn figure(results: &Results, case: ClusterCase, system: &str) -> Option<f64> {
    match case {
        ClusterCase::Publish
        | ClusterCase::Producers
        | ClusterCase::Partitioned
        | ClusterCase::PartitionedProducers
        | ClusterCase::Consume => results
            .rates
            .get(&(case, system.to_string()))
            .map(|v| median(v)),
        ClusterCase::Latency => results
            .latencies
            .get(system)
            .map(|l| percentile(l, 0.99) as f64),
        ClusterCase::Failover => results
            .failovers
            .get(system)
            .and_then(|o| median_recovery(o)),
    }
}

fn cell(results: &Results, case: ClusterCase, system: ClusterSystem) -> String {
    let name = system.name();
    match case {
        ClusterCase::Publish
        | ClusterCase::Producers
        | ClusterCase::Partitioned
        | ClusterCase::PartitionedProducers
        | ClusterCase::Consume => {
            figure(results, case, name).map_or("-".into(), |v| format!("{v:.0}"))
        }
        ClusterCase::Latency => results.latencies.get(name).map_or("-".into(), |l| {
            format!("{} / {}", ms(percentile(l, 0.5)), ms(percentile(l, 0.99)))
        }),
        ClusterCase::Failover => figure(results, case, name).map_or("-".into(), |v| {
            let rounds: Vec<String> = results.failovers[name]
                .iter()
                .map(|o| {
                    o.recovery
                        .map_or("none".into(), |d| format!("{:.2}", d.as_secs_f64()))
                })
                .collect();
            format!("{v:.2} s ({})", rounds.join(", "))
        }),
    }
}

fn markdown(config: &ClusterConfig, results: &Results) -> String {
    let systems = &config.systems;
    let mut pairs = Vec::new();
    for (i, a) in systems.iter().enumerate() {
        for b in &systems[i + 1..] {
            pairs.push((*a, *b));
        }
    }
    let mut header = vec!["case".to_string()];
    header.extend(systems.iter().map(|s| s.name().to_string()));
    header.extend(
        pairs
            .iter()
            .map(|(a, b)| format!("{} / {}", a.name(), b.name())),
    );
    let rule: Vec<&str> = header.iter().map(|_| "---").collect();
    let mut out = format!("| {} |\n| {} |\n", header.join(" | "), rule.join(" | "));
    let names = [
        (
            ClusterCase::Publish,
            format!(
                "1. confirmed publish, 1 producer, {} in flight, {} B (msg/s)",
                config.in_flight, config.body_bytes
            ),
        ),
        (
            ClusterCase::Producers,
            format!(
                "1b. confirmed publish, {PRODUCERS} producers, {} in flight each (msg/s)",
                config.in_flight
            ),
        ),
        (
            ClusterCase::Partitioned,
            format!(
                "1c. confirmed publish, 1 producer, {PARTITIONS} partitions led by {PARTITIONS} \
                 nodes, {} in flight (msg/s)",
                config.in_flight
            ),
        ),
        (
            ClusterCase::PartitionedProducers,
            format!(
                "1d. confirmed publish, {PRODUCERS} producers through nodes 1-{PRODUCERS}, \
                 {PARTITIONS} partitions led by {PARTITIONS} nodes, {} in flight each (msg/s)",
                config.in_flight
            ),
        ),
        (
            ClusterCase::Consume,
            format!(
                "2. consume + ack, backlog {}, prefetch {} (msg/s)",
                config.backlog, config.prefetch
            ),
        ),
        (
            ClusterCase::Latency,
            format!(
                "3. publish-to-confirm p50 / p99 at {} msg/s (ms)",
                config.latency_rate
            ),
        ),
        (
            ClusterCase::Failover,
            format!(
                "4. failover: leader kill -9 to the first confirm of a new publish, at {} msg/s (median; rounds)",
                config.failover_rate
            ),
        ),
    ];
    for (case, name) in names {
        if !config.cases.contains(&case) {
            continue;
        }
        let mut cells = vec![name];
        cells.extend(systems.iter().map(|s| cell(results, case, *s)));
        cells.extend(pairs.iter().map(|(a, b)| {
            match (
                figure(results, case, a.name()),
                figure(results, case, b.name()),
            ) {
                (Some(x), Some(y)) if y > 0.0 => format!("{:.2}", x / y),
                _ => "-".into(),
            }
        }));
        out += &format!("| {} |\n", cells.join(" | "));
    }
    out +=
        "\nRatios: throughput A / B above 1 means A is faster; latency (p99) and failover A / B \
            below 1 means A is quicker.\n";
    if config.cases.contains(&ClusterCase::Failover) && !results.failovers.is_empty() {
        out += &failover_table(config, results);
    }
    out += "\nWho fsyncs before a confirm:\n";
    for system in systems {
        out += &format!("- {}: {}\n", system.name(), system.confirm_meaning());
    }
    out += &goals(results);
    if config.rounds > 1 && !results.rates.is_empty() {
        out += "\nPer-round msg/s:\n";
        for ((case, system), v) in &results.rates {
            let v: Vec<String> = v.iter().map(|r| format!("{r:.0}")).collect();
            out += &format!("- {} {system}: {}\n", case.name(), v.join(" "));
        }
    }
    for note in &results.notes {
        out += &format!("- {note}\n");
    }
    out
}

fn failover_table(config: &ClusterConfig, results: &Results) -> String {
    let mut out = String::from(
        "\n| failover round | node killed | kill to first new confirm | confirmed | delivered once | \
         more than once | missing | delivered, not confirmed | failed publishes | connections | \
         node back, queue whole after |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    // In the table's column order.
    let ordered: Vec<(&str, &Vec<FailoverOutcome>)> = config
        .systems
        .iter()
        .filter_map(|s| results.failovers.get_key_value(s.name()))
        .map(|(name, outcomes)| (name.as_str(), outcomes))
        .collect();
    for &(system, outcomes) in &ordered {
        for (round, o) in outcomes.iter().enumerate() {
            let t = &o.tally;
            out += &format!(
                "| {system} {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                round + 1,
                o.leader,
                o.recovery.map_or(
                    format!("none in {} s", FAILOVER_DEADLINE.as_secs()),
                    seconds
                ),
                t.confirmed,
                t.once,
                t.repeated,
                t.missing,
                t.unconfirmed_present,
                o.failures,
                o.connections,
                o.rejoin.map_or("not within the deadline".into(), seconds),
            );
        }
    }
    out += "\nConnections: those the producer opened, the first included (lapin does not reconnect: the \
            harness opens the next node's on a nack, an error or a 1 s confirm timeout); async-nats \
            reconnects by itself inside its one client; the Keratin producer connects to the next \
            node on an error or a 1 s confirm timeout, and its client follows that node's 421 to \
            the new leader.\n";
    for &(system, outcomes) in &ordered {
        if let Some(first) = outcomes.iter().find_map(|o| o.first_failure.as_deref()) {
            out += &format!("\n{system}: the first failed publish said: {first}");
        }
    }
    out + "\n"
}

fn goals(results: &Results) -> String {
    let publish = |s: ClusterSystem| figure(results, ClusterCase::Publish, s.name());
    let reference = |value: Option<f64>, unit: &str| {
        value.map_or("not measured in this run".into(), |v| {
            format!("{v:.0}{unit}")
        })
    };
    let mut out = String::from("\nGoals (issue 14):\n");
    let k = publish(ClusterSystem::KeratinCluster);
    let mut goal = |what: String, have: Option<f64>, met: &dyn Fn(f64) -> bool| {
        let verdict = match have {
            Some(v) if met(v) => format!("{v:.2} met"),
            Some(v) => format!("{v:.2} MISSED"),
            None => "not measured in this run".into(),
        };
        out += &format!("- {what}: {verdict}\n");
    };
    let q = publish(ClusterSystem::RabbitQuorum);
    let n = publish(ClusterSystem::NatsR3);
    goal(
        format!(
            "publish keratin-cluster / rabbitmq-quorum >= {GOAL_PUBLISH_VS_QUORUM} (reference {})",
            reference(q, " msg/s")
        ),
        k.zip(q).map(|(k, q)| k / q.max(1e-9)),
        &|v| v >= GOAL_PUBLISH_VS_QUORUM,
    );
    goal(
        format!(
            "publish keratin-cluster / nats-r3 >= {GOAL_PUBLISH_VS_NATS} (reference {}; NATS does not fsync)",
            reference(n, " msg/s")
        ),
        k.zip(n).map(|(k, n)| k / n.max(1e-9)),
        &|v| v >= GOAL_PUBLISH_VS_NATS,
    );
    let single = publish(ClusterSystem::KeratinSingle);
    goal(
        format!(
            "publish keratin-cluster / keratin-single >= {GOAL_PUBLISH_VS_SINGLE} (reference {})",
            reference(single, " msg/s")
        ),
        k.zip(single).map(|(k, s)| k / s.max(1e-9)),
        &|v| v >= GOAL_PUBLISH_VS_SINGLE,
    );
    let cluster = |case: ClusterCase| figure(results, case, ClusterSystem::KeratinCluster.name());
    let three = cluster(ClusterCase::Producers);
    goal(
        format!(
            "publish-3p keratin-cluster / publish keratin-cluster >= {GOAL_PARTITIONED} \
             (reference {})",
            reference(k, " msg/s")
        ),
        cluster(ClusterCase::Partitioned)
            .zip(k)
            .map(|(p, k)| p / k.max(1e-9)),
        &|v| v >= GOAL_PARTITIONED,
    );
    goal(
        format!(
            "publish-3p-3 keratin-cluster / publish-3 keratin-cluster >= {GOAL_PARTITIONED} \
             (reference {})",
            reference(three, " msg/s")
        ),
        cluster(ClusterCase::PartitionedProducers)
            .zip(three)
            .map(|(p, t)| p / t.max(1e-9)),
        &|v| v >= GOAL_PARTITIONED,
    );
    goal(
        format!(
            "failover keratin-cluster <= {} s (rabbitmq-quorum {}, nats-r3 {})",
            GOAL_FAILOVER.as_secs(),
            reference(
                figure(results, ClusterCase::Failover, "rabbitmq-quorum").map(|v| v * 1e3),
                " ms"
            ),
            reference(
                figure(results, ClusterCase::Failover, "nats-r3").map(|v| v * 1e3),
                " ms"
            ),
        ),
        figure(results, ClusterCase::Failover, "keratin-cluster"),
        &|v| v <= GOAL_FAILOVER.as_secs_f64(),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster_failover::Tally;

    #[test]
    fn systems_and_cases_parse_and_refuse_unknown_names() {
        for system in ClusterSystem::ALL {
            assert_eq!(ClusterSystem::parse(system.name()), Ok(system));
        }
        assert!(ClusterSystem::parse("nats")
            .unwrap_err()
            .contains("nats-r3"));
        assert_eq!(ClusterCase::parse(" failover"), Ok(ClusterCase::Failover));
        for case in [
            ClusterCase::Publish,
            ClusterCase::Producers,
            ClusterCase::Partitioned,
            ClusterCase::PartitionedProducers,
        ] {
            assert_eq!(ClusterCase::parse(case.name()), Ok(case));
            assert!(case.publishes());
        }
        assert_eq!(ClusterCase::PartitionedProducers.producers(), PRODUCERS);
        assert!(ClusterCase::Partitioned
            .skipped_for(ClusterSystem::RabbitQuorum)
            .is_some());
        assert!(ClusterCase::Partitioned
            .skipped_for(ClusterSystem::KeratinSingle)
            .is_none());
        assert!(ClusterCase::Producers
            .skipped_for(ClusterSystem::NatsR3)
            .is_none());
        assert!(ClusterCase::parse("fill").is_err());
        assert_eq!(
            ClusterSystem::KeratinSingle.peer_system().ok(),
            Some(System::Keratin)
        );
    }

    fn config() -> ClusterConfig {
        ClusterConfig {
            systems: vec![
                ClusterSystem::KeratinCluster,
                ClusterSystem::RabbitQuorum,
                ClusterSystem::NatsR3,
            ],
            cases: vec![
                ClusterCase::Publish,
                ClusterCase::Latency,
                ClusterCase::Failover,
            ],
            amqp_nodes: vec!["a".into(); 3],
            nats_nodes: vec!["n".into(); 2],
            keratin_nodes: vec!["127.0.0.1:25721".into(); 3],
            dir: PathBuf::from("/var/tmp"),
            keratin_single: None,
            ctl: None,
            duration: Duration::from_secs(1),
            rounds: 2,
            body_bytes: 1024,
            in_flight: 1000,
            backlog: 10,
            prefetch: 10,
            latency_rate: 5000,
            failover_rate: 1000,
            out: None,
        }
    }

    #[test]
    fn the_table_has_ratios_between_peers_and_leaves_unmeasured_columns_empty() {
        let mut results = Results::default();
        results.rates.insert(
            (ClusterCase::Publish, "rabbitmq-quorum".into()),
            vec![10_000.0, 20_000.0],
        );
        results
            .rates
            .insert((ClusterCase::Publish, "nats-r3".into()), vec![30_000.0]);
        results
            .latencies
            .insert("rabbitmq-quorum".into(), vec![3_000, 8_000]);
        results.latencies.insert("nats-r3".into(), vec![500, 3_000]);
        let outcome = |recovery_ms: Option<u64>| FailoverOutcome {
            leader: 1,
            recovery: recovery_ms.map(Duration::from_millis),
            tally: Tally {
                confirmed: 10,
                once: 10,
                ..Tally::default()
            },
            ..FailoverOutcome::default()
        };
        results.failovers.insert(
            "rabbitmq-quorum".into(),
            vec![outcome(Some(300)), outcome(Some(500))],
        );
        results
            .failovers
            .insert("nats-r3".into(), vec![outcome(Some(4_000)), outcome(None)]);
        let text = markdown(&config(), &results);
        assert!(
            text.contains(
                "| case | keratin-cluster | rabbitmq-quorum | nats-r3 | keratin-cluster / rabbitmq-quorum | keratin-cluster / nats-r3 | rabbitmq-quorum / nats-r3 |"
            ),
            "{text}"
        );
        // Median of 10,000 and 20,000 against 30,000.
        assert!(
            text.contains("| - | 15000 | 30000 | - | - | 0.50 |"),
            "{text}"
        );
        // p50 / p99 in ms (within the histogram's 0.1 %), and the ratio of the p99s.
        assert!(
            text.contains("| - | 3.00 / 8.00 | 0.50 / 3.00 | - | - | 2.67 |"),
            "{text}"
        );
        // A round without a confirm counts as the deadline in the median: (4 + 60) / 2.
        assert!(
            text.contains("| 0.40 s (0.30, 0.50) | 32.00 s (4.00, none) | - | - | 0.01 |"),
            "{text}"
        );
        assert!(
            text.contains("| nats-r3 2 | 1 | none in 60 s | 10 | 10 | 0 | 0 |"),
            "{text}"
        );
        assert!(
            text.contains(
                "publish keratin-cluster / rabbitmq-quorum >= 3 (reference 15000 msg/s): not measured in this run"
            ),
            "{text}"
        );
        assert!(text.contains("nats-r3: NOT fsynced"), "{text}");
        assert!(
            text.contains("rabbitmq-quorum: fsynced on a majority"),
            "{text}"
        );
    }

    #[test]
    fn a_cluster_needs_three_addresses() {
        let config = config();
        assert!(config.nodes(ClusterSystem::RabbitQuorum).is_ok());
        let error = config.nodes(ClusterSystem::NatsR3).unwrap_err().to_string();
        assert!(error.contains("2 node addresses"), "{error}");
        assert!(config.endpoints(ClusterSystem::RabbitQuorum, 2).is_ok());
        assert!(config.nodes(ClusterSystem::KeratinCluster).is_ok());
        assert_eq!(
            config
                .endpoints(ClusterSystem::KeratinCluster, 3)
                .unwrap()
                .keratin
                .map(|a| a.port()),
            Some(25721)
        );
        assert!(config.nodes(ClusterSystem::KeratinSingle).is_err());
        // The single node has an address only once `run` started it.
        assert!(config.endpoints(ClusterSystem::KeratinSingle, 1).is_err());
    }

    #[test]
    fn the_goals_are_ratios_of_keratin_against_each_reference_of_the_run() {
        let mut config = config();
        config.systems.insert(1, ClusterSystem::KeratinSingle);
        let mut results = Results::default();
        for (system, rate) in [
            ("keratin-cluster", 30_000.0),
            ("keratin-single", 40_000.0),
            ("rabbitmq-quorum", 15_000.0),
            ("nats-r3", 20_000.0),
        ] {
            results
                .rates
                .insert((ClusterCase::Publish, system.into()), vec![rate]);
        }
        for (case, rate) in [
            (ClusterCase::Partitioned, 60_000.0),
            (ClusterCase::Producers, 50_000.0),
            (ClusterCase::PartitionedProducers, 70_000.0),
        ] {
            results
                .rates
                .insert((case, "keratin-cluster".into()), vec![rate]);
        }
        results.failovers.insert(
            "keratin-cluster".into(),
            vec![FailoverOutcome {
                leader: 2,
                recovery: Some(Duration::from_millis(1500)),
                ..FailoverOutcome::default()
            }],
        );
        let text = markdown(&config, &results);
        assert!(
            text.contains("publish keratin-cluster / rabbitmq-quorum >= 3 (reference 15000 msg/s): 2.00 MISSED"),
            "{text}"
        );
        assert!(
            text.contains("publish keratin-cluster / nats-r3 >= 1 (reference 20000 msg/s; NATS does not fsync): 1.50 met"),
            "{text}"
        );
        assert!(
            text.contains(
                "publish keratin-cluster / keratin-single >= 0.5 (reference 40000 msg/s): 0.75 met"
            ),
            "{text}"
        );
        assert!(text.contains("failover keratin-cluster <= 2 s"), "{text}");
        assert!(
            text.contains(
                "publish-3p keratin-cluster / publish keratin-cluster >= 1.5 (reference 30000 msg/s): 2.00 met"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "publish-3p-3 keratin-cluster / publish-3 keratin-cluster >= 1.5 (reference 50000 msg/s): 1.40 MISSED"
            ),
            "{text}"
        );
        assert!(text.contains(": 1.50 met\n"), "{text}");
        assert!(
            text.contains("keratin-cluster: fsynced on a majority"),
            "{text}"
        );
    }
}
