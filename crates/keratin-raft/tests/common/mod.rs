//! The in-process cluster the tests share: nodes of `Raft` over `LogStore` on any `Io`, joined
//! by an in-memory network that honours the fences (a fenced side neither sends nor replies:
//! the adapter's rule for surfacing a failed log, crate docs "Failures").
#![allow(dead_code, reason = "each test file uses a part")]

pub mod brokers;
pub mod faults;
pub mod tcp;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keratin_log::{Io, LogOptions, MIN_SEGMENT_SIZE_BYTES};
use keratin_raft::entry_format::decode_entry;
use keratin_raft::{
    Fence, GroupLogs, LogStore, NodeAddr, PartitionRecord, Payload, RecordStateMachine,
    RecordsImage, TypeConfig,
};
use openraft::async_runtime::watch::WatchReceiver;
use openraft::errors::{ClientWriteError, RaftError};
use openraft::errors::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::ClientWriteResponse;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{Config, OptionalSend};

pub type Raft = openraft::Raft<TypeConfig, RecordStateMachine>;
type Snapshot = openraft::storage::Snapshot<keratin_raft::LeaderId, u64, NodeAddr, RecordsImage>;

/// Every running node, by id: its `Raft` and its store's fence.
#[derive(Clone, Default)]
pub struct Router {
    nodes: Arc<Mutex<BTreeMap<u64, (Raft, Fence)>>>,
}

impl Router {
    pub fn get(&self, id: u64) -> Option<(Raft, Fence)> {
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

pub struct Node {
    pub raft: Raft,
    pub machine: RecordStateMachine,
    pub logs: GroupLogs,
    pub fence: Fence,
}

pub fn options() -> LogOptions {
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

/// Open the node's logs in `dir` and start it.
pub async fn start(id: u64, io: Arc<dyn Io>, dir: &Path, router: &Router) -> Node {
    let logs = GroupLogs::open(io, dir, options(), None).expect("open logs");
    run(id, logs, router).await
}

/// Start a `Raft` on `logs` (opened, or healed after a fence).
pub async fn run(id: u64, logs: GroupLogs, router: &Router) -> Node {
    let store = logs.store().expect("store");
    run_with(id, logs, store, router).await
}

/// Start a `Raft` on `store`, built from `logs`.
pub async fn run_with(id: u64, logs: GroupLogs, store: LogStore, router: &Router) -> Node {
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
        .insert(id, (raft.clone(), fence.clone()));
    Node {
        raft,
        machine,
        logs,
        fence,
    }
}

/// Take the node off the network and shut its `Raft` down; its logs stay open.
pub async fn stop(id: u64, node: Node, router: &Router) -> GroupLogs {
    router.nodes.lock().expect("router").remove(&id);
    node.raft.shutdown().await.expect("shutdown");
    node.logs
}

/// Shut the node down and close its logs (waiting for openraft's tasks to let go of them).
pub async fn kill(id: u64, node: Node, router: &Router) {
    let logs = stop(id, node, router).await;
    tcp::close_logs(&format!("node {id}"), logs).await;
}

/// Makes nodes 1 to 3 (in-memory addresses `node-N`) a cluster, initialized from node 1.
pub async fn initialize_three(nodes: &BTreeMap<u64, Node>) {
    let members: BTreeMap<u64, NodeAddr> = (1..=3)
        .map(|id| {
            let addr = format!("node-{id}");
            (id, NodeAddr::new(addr))
        })
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");
}

pub async fn leader_among(nodes: &BTreeMap<u64, Node>) -> u64 {
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

/// Write through `raft`, retrying while it is a leader without a lease yet (a leader just
/// elected, or one that has not heard from a quorum lately answers `ForwardToLeader` with no
/// other leader named): for 10 s at most.
async fn client_write(raft: &Raft, record: PartitionRecord) -> ClientWriteResponse<TypeConfig> {
    for _ in 0..200 {
        match raft.client_write(record.clone()).await {
            Ok(response) => return response,
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward)))
                if forward.leader_id.is_none() =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("client write: {e}"),
        }
    }
    panic!("client write: no lease for 10 s");
}

/// Write `count` records through `leader`, 100 at a time; returns offset -> payload.
pub async fn write(leader: &Raft, first: usize, count: usize) -> BTreeMap<u64, Vec<u8>> {
    let mut acked = BTreeMap::new();
    for chunk_start in (first..first + count).step_by(100) {
        let mut writes = Vec::new();
        for n in chunk_start..(chunk_start + 100).min(first + count) {
            let raft = leader.clone();
            // About 1 KiB, so that 256 KiB segments roll every ~250 entries.
            let mut payload = format!("message {n} ").into_bytes();
            payload.resize(1_000, b'.');
            writes.push(tokio::spawn(async move {
                let record = PartitionRecord::new(1, 1_700_000_000_000 + n as u64, payload.clone())
                    .expect("record");
                let response = client_write(&raft, record).await;
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
pub async fn check_has(id: u64, node: &Node, acked: &BTreeMap<u64, Vec<u8>>) {
    let last = *acked.keys().next_back().expect("writes");
    node.raft
        .wait(Some(Duration::from_secs(10)))
        .applied_index_at_least(Some(last), "applied the acknowledged writes")
        .await
        .unwrap_or_else(|e| panic!("node {id}: {e}"));
    // A follower may apply an entry that a majority made durable before its own sync covers
    // it (Raft allows it): wait for the local entry log too.
    for _ in 0..1000 {
        if node.logs.entries().durable_offset() > last {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let records = node.machine.records();
    // Entries up to the purge point may be gone from the entry log (or be gap records, on a
    // node that installed a snapshot): the state machine has them.
    let purged_next = node
        .raft
        .metrics()
        .borrow_watched()
        .purged
        .map_or(0, |p| p.index + 1);
    for (offset, payload) in acked {
        let record = records
            .get(offset)
            .unwrap_or_else(|| panic!("node {id}: acknowledged write at {offset} not applied"));
        assert_eq!(
            record.payload(),
            payload.as_slice(),
            "node {id}, offset {offset}"
        );
        if *offset < purged_next {
            continue;
        }
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

/// Every file under `dir`, at any depth (a test that damages a copy looks for its bytes).
pub fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}
