//! Three nodes in one process, each a `Raft` over `LogStore` on its own temporary directory
//! (real files), joined by an in-memory network that honours the fences: elect a leader, commit
//! 1,000 writes, kill the leader (shut down and dropped, its logs closed), see a new leader
//! elected that commits more writes, check that every acknowledged write is on both survivors
//! (state machines and entry logs: index == offset, the record type and payload at the
//! offset), then restart the old leader from its directory and see it catch up to the same
//! records. It fails if a committed write is lost or moved, if no leader emerges, or if the
//! restarted node does not converge.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keratin_log::{LogOptions, RealIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::entry_format::decode_entry;
use keratin_raft::{
    Fence, GroupLogs, NodeAddr, PartitionRecord, Payload, RecordStateMachine, RecordsImage,
    TypeConfig,
};
use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{Config, OptionalSend};

type Raft = openraft::Raft<TypeConfig, RecordStateMachine>;
type Snapshot = openraft::storage::Snapshot<keratin_raft::LeaderId, u64, NodeAddr, RecordsImage>;

/// Every running node, by id: its `Raft` and its store's fence.
#[derive(Clone, Default)]
struct Router {
    nodes: Arc<Mutex<BTreeMap<u64, (Raft, Fence)>>>,
}

impl Router {
    fn get(&self, id: u64) -> Option<(Raft, Fence)> {
        self.nodes.lock().expect("router").get(&id).cloned()
    }
}

fn unreachable(why: impl ToString) -> Unreachable<TypeConfig> {
    Unreachable::new(&io::Error::other(why.to_string()))
}

struct NetFactory {
    fence: Fence,
    router: Router,
}

struct Net {
    fence: Fence,
    target: u64,
    router: Router,
}

impl RaftNetworkFactory<TypeConfig> for NetFactory {
    type Network = Net;

    async fn new_client(&mut self, target: u64, _node: &NodeAddr) -> Net {
        Net {
            fence: self.fence.clone(),
            target,
            router: self.router.clone(),
        }
    }
}

impl Net {
    /// The target, unless either side is fenced or the target is down.
    fn peer(&self) -> Result<(Raft, Fence), Unreachable<TypeConfig>> {
        if self.fence.is_tripped() {
            return Err(unreachable("this node's group is fenced"));
        }
        self.router
            .get(self.target)
            .ok_or_else(|| unreachable(format!("node {} is down", self.target)))
    }

    /// A reply leaves only if neither side was fenced meanwhile.
    fn reply<T>(&self, target_fence: &Fence, reply: T) -> Result<T, Unreachable<TypeConfig>> {
        if target_fence.is_tripped() || self.fence.is_tripped() {
            return Err(unreachable("fenced"));
        }
        Ok(reply)
    }
}

impl RaftNetworkV2<TypeConfig> for Net {
    type SnapshotData = RecordsImage;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        let (raft, fence) = self.peer()?;
        let reply = raft.append_entries(rpc).await.map_err(unreachable)?;
        Ok(self.reply(&fence, reply)?)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let (raft, fence) = self.peer()?;
        let reply = raft.vote(rpc).await.map_err(unreachable)?;
        Ok(self.reply(&fence, reply)?)
    }

    async fn full_snapshot(
        &mut self,
        vote: keratin_raft::Vote,
        snapshot: Snapshot,
        _cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let (raft, fence) = self.peer()?;
        let reply = raft
            .install_full_snapshot(vote, snapshot)
            .await
            .map_err(unreachable)?;
        Ok(self.reply(&fence, reply)?)
    }
}

struct Node {
    raft: Raft,
    machine: RecordStateMachine,
    logs: GroupLogs,
}

fn options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        ..LogOptions::default()
    }
}

fn config() -> Arc<Config> {
    let config = Config {
        heartbeat_interval: 50,
        election_timeout_min: 300,
        election_timeout_max: 600,
        ..Config::default()
    };
    Arc::new(config.validate().expect("config"))
}

async fn start(id: u64, dir: &Path, router: &Router) -> Node {
    let logs = GroupLogs::open(Arc::new(RealIo::new()), dir, options(), None).expect("open logs");
    let store = logs.store().expect("store");
    let fence = store.fence();
    let machine = RecordStateMachine::new();
    let network = NetFactory {
        fence: fence.clone(),
        router: router.clone(),
    };
    let raft = Raft::new(id, config(), network, store, machine.clone())
        .await
        .expect("raft");
    router
        .nodes
        .lock()
        .expect("router")
        .insert(id, (raft.clone(), fence));
    Node {
        raft,
        machine,
        logs,
    }
}

/// Shut the node down and close its logs (waiting for openraft's tasks to let go of them).
async fn kill(id: u64, node: Node, router: &Router) {
    router.nodes.lock().expect("router").remove(&id);
    node.raft.shutdown().await.expect("shutdown");
    drop(node.raft);
    let mut logs = node.logs;
    for _ in 0..500 {
        match logs.try_close() {
            Ok(closed) => return closed.expect("close logs"),
            Err(again) => logs = again,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("node {id}'s logs are still held 5 s after its shutdown");
}

async fn leader_among(nodes: &BTreeMap<u64, Node>) -> u64 {
    for _ in 0..200 {
        for (id, node) in nodes {
            if node.raft.current_leader().await == Some(*id) {
                return *id;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no leader among {:?} after 10 s", nodes.keys());
}

/// Write `count` records through `leader`, 100 at a time; returns offset -> payload.
async fn write(leader: &Raft, first: usize, count: usize) -> BTreeMap<u64, Vec<u8>> {
    let mut acked = BTreeMap::new();
    for chunk_start in (first..first + count).step_by(100) {
        let mut writes = Vec::new();
        for n in chunk_start..(chunk_start + 100).min(first + count) {
            let raft = leader.clone();
            let payload = format!("message {n}").into_bytes();
            writes.push(tokio::spawn(async move {
                let record = PartitionRecord::new(1, 1_700_000_000_000 + n as u64, payload.clone())
                    .expect("record");
                let response = raft.client_write(record).await.expect("client write");
                assert_eq!(
                    response.data.offsets,
                    response.log_id.index..response.log_id.index + 1
                );
                (response.log_id.index, payload)
            }));
        }
        for write in writes {
            let (offset, payload) = write.await.expect("write task");
            assert!(
                acked.insert(offset, payload).is_none(),
                "offset {offset} twice"
            );
        }
    }
    acked
}

/// Every acknowledged write is applied on `node` and in its entry log at its offset.
async fn check_has(id: u64, node: &Node, acked: &BTreeMap<u64, Vec<u8>>) {
    let last = *acked.keys().next_back().expect("writes");
    node.raft
        .wait(Some(Duration::from_secs(10)))
        .applied_index_at_least(Some(last), "applied the acknowledged writes")
        .await
        .unwrap_or_else(|e| panic!("node {id}: {e}"));
    let records = node.machine.records();
    for (offset, payload) in acked {
        let record = records
            .get(offset)
            .unwrap_or_else(|| panic!("node {id}: acknowledged write at {offset} not applied"));
        assert_eq!(
            record.payload(),
            payload.as_slice(),
            "node {id}, offset {offset}"
        );
        let stored = node
            .logs
            .entries()
            .read(*offset)
            .unwrap_or_else(|e| panic!("node {id}: read {offset}: {e}"));
        assert_eq!(stored.record_type, 1, "node {id}, offset {offset}");
        let entry = decode_entry(&stored)
            .expect("decode")
            .expect("an entry, not a gap");
        assert_eq!(entry.log_id.index, *offset);
        match entry.payload {
            Payload::Normal(record) => assert_eq!(record.payload(), payload.as_slice()),
            other => panic!("node {id}, offset {offset}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_survive_the_loss_of_the_leader() {
    let dirs: BTreeMap<u64, tempfile::TempDir> = (1..=3)
        .map(|id| (id, tempfile::tempdir().expect("temporary directory")))
        .collect();
    let router = Router::default();
    let mut nodes = BTreeMap::new();
    for (id, dir) in &dirs {
        nodes.insert(*id, start(*id, dir.path(), &router).await);
    }
    let members: BTreeMap<u64, NodeAddr> = (1..=3)
        .map(|id| {
            (
                id,
                NodeAddr {
                    addr: format!("node-{id}"),
                },
            )
        })
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");

    let leader = leader_among(&nodes).await;
    let mut acked = write(&nodes[&leader].raft, 0, 1_000).await;
    assert_eq!(acked.len(), 1_000);

    let old = nodes.remove(&leader).expect("leader");
    kill(leader, old, &router).await;
    let new_leader = leader_among(&nodes).await;
    assert_ne!(new_leader, leader);
    acked.extend(write(&nodes[&new_leader].raft, 1_000, 100).await);
    assert_eq!(acked.len(), 1_100);
    for (id, node) in &nodes {
        check_has(*id, node, &acked).await;
    }

    let restarted = start(leader, dirs[&leader].path(), &router).await;
    check_has(leader, &restarted, &acked).await;
    nodes.insert(leader, restarted);
    let reference = nodes[&new_leader].machine.records();
    for (id, node) in &nodes {
        assert_eq!(node.machine.records(), reference, "node {id} differs");
    }
    for (id, node) in nodes {
        kill(id, node, &router).await;
    }
}
