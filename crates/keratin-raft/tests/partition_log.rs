//! `ReplicatedLog` on its own, over a one-replica group on a real transport (127.0.0.1): the
//! role is sent at start and again once the node leads (its first offset past the adapter's
//! membership entry); many proposals handed over back to back are reported committed at
//! increasing, consecutive ranges in proposal order (the one ordered submitter); the owner's
//! reader returns every committed offset, the adapter's membership and blank entries as `NOOP`
//! records with an empty payload, the proposals' records at their reported offsets; the
//! committed offset covers them; a committed record cannot be truncated; the log closes and
//! reopens with the same records. On a simulated disk, a write that fails under a proposal
//! ends it with a storage error (outcome unknown) and the role with "not leading"; `heal`
//! rebuilds the replica, which leads again with every committed record and takes proposals
//! after them. It fails if a proposal is lost, reordered or reported at
//! offsets that do not hold its records, if the reader skips an offset, or if the role is
//! never reported leading.

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use keratin_broker::partition::log::{
    LogEvent, LogEvents, PartitionLog, PartitionLogs, PartitionPlace, Proposal, Role,
};
use keratin_broker::record::{ENQUEUE, NOOP};
use keratin_broker::BrokerError;
use keratin_log::{Io, PoolOptions, RealIo, SegmentPool, SimFault, SimIo, MIN_SEGMENT_SIZE_BYTES};
use keratin_net::ResolvedCluster;
use keratin_raft::partition_log::{partition_group, ReplicatedLogs};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);
/// Proposals handed over back to back.
const PROPOSALS: u64 = 300;

/// Partition 2 of queue 4 under `dir`, its segments from a pool of its own on `io`.
fn place(dir: &std::path::Path, io: Arc<dyn Io>) -> PartitionPlace {
    io.create_dir_all(dir).expect("storage directory");
    let pool = SegmentPool::new(
        io.clone(),
        PoolOptions {
            full_segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
            budget_bytes: Some(0),
            background: false,
            commit_workers_per_filesystem: 1,
        },
    );
    pool.add_storage_dir(dir).expect("pool directory");
    PartitionPlace {
        io,
        pool,
        segment_size_bytes: MIN_SEGMENT_SIZE_BYTES,
        size_class: keratin_log::SizeClass::Full,
        queue_id: 4,
        queue: "orders".into(),
        index: 2,
        dir: dir.join("partition"),
        replicas: vec![1],
        formation: None,
    }
}

async fn open(logs: &Arc<ReplicatedLogs>, place: &PartitionPlace) -> Arc<dyn PartitionLog> {
    let (logs, place) = (logs.clone(), place.clone());
    tokio::task::spawn_blocking(move || logs.open(&place))
        .await
        .expect("open task")
        .expect("opens")
}

async fn close(log: Arc<dyn PartitionLog>) {
    tokio::task::spawn_blocking(move || log.close())
        .await
        .expect("close task")
        .expect("closes");
}

fn start(log: &Arc<dyn PartitionLog>) -> mpsc::UnboundedReceiver<LogEvent> {
    let (sender, receiver) = mpsc::unbounded_channel();
    log.start(LogEvents::new(move |event| {
        let _ = sender.send(event);
    }));
    receiver
}

async fn next_event(events: &mut mpsc::UnboundedReceiver<LogEvent>) -> LogEvent {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("an event in time")
        .expect("the log keeps its sender")
}

/// Events until the role says leading; returns that role.
async fn wait_leading(events: &mut mpsc::UnboundedReceiver<LogEvent>) -> Role {
    loop {
        if let LogEvent::Role(role) = next_event(events).await {
            if role.leading {
                return role;
            }
        }
    }
}

fn payloads(sequence: u64) -> Vec<Vec<u8>> {
    (0..sequence % 3 + 1)
        .map(|n| format!("proposal {sequence} record {n}").into_bytes())
        .collect()
}

#[test]
fn group_ids_are_distinct_and_leave_group_zero_to_metadata() {
    let mut seen = BTreeMap::new();
    for queue_id in [0u64, 1, 2, 1_000] {
        for index in 0..64u32 {
            let group = partition_group(queue_id, index).expect("group id");
            assert_ne!(group.0, 0, "group 0 is the metadata group's");
            assert!(seen.insert(group.0, (queue_id, index)).is_none());
        }
    }
    assert!(partition_group(0, 256).is_err());
    assert!(partition_group(u64::MAX, 0).is_err());
}

/// Node 1 alone on loopback: its transport and its partition-log provider.
async fn one_node() -> (keratin_net::Transport, Arc<ReplicatedLogs>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let cluster = ResolvedCluster {
        node_id: 1,
        listen: addr,
        peers: [(1, addr)].into_iter().collect(),
        name: "test".into(),
    };
    let (transport, groups) = common::brokers::transport(listener, cluster.clone());
    let logs = Arc::new(common::brokers::replicated_logs(
        cluster,
        transport.clone(),
        groups,
        common::brokers::client_addrs(),
    ));
    (transport, logs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proposals_commit_in_order_and_the_reader_returns_every_offset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (transport, logs) = one_node().await;
    let place = place(dir.path(), Arc::new(RealIo::new()));
    let log = open(&logs, &place).await;
    let mut events = start(&log);
    match next_event(&mut events).await {
        LogEvent::Role(_) => {}
        other => panic!("the first event is the role, got {other:?}"),
    }
    let role = wait_leading(&mut events).await;
    assert_eq!(role.leader, Some(1));
    assert_eq!(role.addr, None, "no address while this node leads");
    assert!(
        role.from >= 1,
        "the membership entry precedes the leadership"
    );

    for sequence in 0..PROPOSALS {
        let payloads = payloads(sequence);
        let proposal = Proposal {
            sequence,
            types: vec![ENQUEUE; payloads.len()],
            payloads,
            timestamp_ms: 1_700_000_000_000 + sequence,
        };
        log.clone().propose(proposal).await.expect("taken");
    }
    let mut ranges: BTreeMap<u64, Range<u64>> = BTreeMap::new();
    let mut committed = 0;
    while ranges.len() < PROPOSALS as usize {
        match next_event(&mut events).await {
            LogEvent::Proposed { sequence, result } => {
                let range = result.unwrap_or_else(|e| panic!("proposal {sequence}: {e}"));
                assert!(ranges.insert(sequence, range).is_none(), "answered twice");
            }
            LogEvent::Committed { up_to } => committed = committed.max(up_to),
            LogEvent::Role(role) => panic!("leadership moved in a one-node group: {role:?}"),
            LogEvent::Stopped { error } => panic!("the log stopped: {error}"),
        }
    }
    let mut expected_start = ranges[&0].start;
    assert!(expected_start >= role.from);
    for (sequence, range) in &ranges {
        assert_eq!(
            range.start, expected_start,
            "proposal {sequence} follows the previous"
        );
        assert_eq!(range.end - range.start, payloads(*sequence).len() as u64);
        expected_start = range.end;
    }
    let end = expected_start;
    assert!(log.committed_offset() >= end);
    assert!(committed <= log.committed_offset());

    let reader_log = log.clone();
    let (records, next_offset) = tokio::task::spawn_blocking(move || {
        let mut reader = reader_log.reader(0);
        let records: Vec<_> = reader.by_ref().map(|r| r.expect("reads")).collect();
        (records, reader.next_offset())
    })
    .await
    .expect("read task");
    assert_eq!(next_offset, end, "read up to the committed end");
    assert_eq!(records.len() as u64, end, "one record per offset");
    let mut by_offset = BTreeMap::new();
    for (offset, record) in (0u64..).zip(&records) {
        assert_eq!(record.offset, offset, "consecutive offsets");
        by_offset.insert(offset, record);
    }
    // The adapter's entries: the membership at 0, the new leader's blank before its first
    // proposal.
    let first = ranges[&0].start;
    for offset in 0..first {
        assert_eq!(by_offset[&offset].record_type, NOOP, "offset {offset}");
        assert!(by_offset[&offset].payload.is_empty());
    }
    for (sequence, range) in &ranges {
        for (offset, payload) in range.clone().zip(payloads(*sequence)) {
            let record = by_offset[&offset];
            assert_eq!(record.record_type, ENQUEUE, "offset {offset}");
            assert_eq!(record.payload, payload, "offset {offset}");
            assert_eq!(record.timestamp_ms, 1_700_000_000_000 + sequence);
        }
    }
    assert!(log.truncate_suffix(end).is_ok());
    assert!(
        log.truncate_suffix(end - 1).is_err(),
        "a committed record stays"
    );
    assert!(log.start_offset() == 0 && log.disk_bytes() > 0);
    close(log).await;

    // Reopened from its directory: the same group (initialized before: no second
    // membership), the same records.
    let log = open(&logs, &place).await;
    let mut events = start(&log);
    wait_leading(&mut events).await;
    let reader_log = log.clone();
    let deadline = tokio::time::Instant::now() + WAIT;
    while log.committed_offset() < end {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reopened log not committed to {end}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reread = tokio::task::spawn_blocking(move || {
        reader_log
            .reader(0)
            .take(end as usize)
            .map(|r| r.expect("reads"))
            .collect::<Vec<_>>()
    })
    .await
    .expect("read task");
    assert_eq!(reread, records);
    close(log).await;
    transport.shutdown();
}

async fn propose_one(log: &Arc<dyn PartitionLog>, sequence: u64) -> Result<(), BrokerError> {
    let payloads = payloads(sequence);
    let proposal = Proposal {
        sequence,
        types: vec![ENQUEUE; payloads.len()],
        payloads,
        timestamp_ms: 1_700_000_000_000 + sequence,
    };
    log.clone().propose(proposal).await
}

/// The outcome of proposal `sequence`; the roles reported meanwhile go to `roles`.
async fn proposed(
    events: &mut mpsc::UnboundedReceiver<LogEvent>,
    sequence: u64,
    roles: &mut Vec<Role>,
) -> Result<Range<u64>, BrokerError> {
    loop {
        match next_event(events).await {
            LogEvent::Proposed {
                sequence: s,
                result,
            } => {
                assert_eq!(s, sequence, "outcomes in proposal order here");
                return result;
            }
            LogEvent::Role(role) => roles.push(role),
            // The fence tripped: the owner would heal; this test heals by hand below.
            LogEvent::Committed { .. } | LogEvent::Stopped { .. } => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_write_failed_is_rebuilt_by_heal() {
    let sim = SimIo::new(21);
    let (transport, logs) = one_node().await;
    let place = place(std::path::Path::new("/sim"), Arc::new(sim.clone()));
    let log = open(&logs, &place).await;
    let mut events = start(&log);
    wait_leading(&mut events).await;
    let mut committed = BTreeMap::new();
    for sequence in 0..5 {
        propose_one(&log, sequence).await.expect("taken");
        let range = proposed(&mut events, sequence, &mut Vec::new())
            .await
            .expect("committed");
        committed.insert(sequence, range);
    }

    // The next Io call fails: the proposal's append (or a write just before it) stops a log,
    // the fence trips, and the proposal ends with the storage error.
    sim.fail_at(sim.steps(), SimFault::Eio);
    let mut roles = Vec::new();
    let failed = match propose_one(&log, 5).await {
        Err(error) => error,
        Ok(()) => proposed(&mut events, 5, &mut roles)
            .await
            .expect_err("a proposal under a failed write is not committed"),
    };
    assert!(
        matches!(failed, BrokerError::Log(_)),
        "a storage failure, outcome unknown: {failed}"
    );
    // Not leading any more, until rebuilt.
    while !roles.iter().any(|role| !role.leading) {
        if let LogEvent::Role(role) = next_event(&mut events).await {
            roles.push(role);
        }
    }
    assert!(
        matches!(propose_one(&log, 6).await, Err(BrokerError::Log(_))),
        "a fenced replica takes no proposal"
    );

    let healing = log.clone();
    tokio::task::spawn_blocking(move || healing.heal())
        .await
        .expect("heal task")
        .expect("the replica is rebuilt and caught up");
    wait_leading(&mut events).await;
    let end = committed[&4].end;
    assert!(log.committed_offset() >= end);
    // Sequence 6 was refused before the log took it: the owner's next proposal is 7.
    propose_one(&log, 7).await.expect("taken after the heal");
    let after = proposed(&mut events, 7, &mut Vec::new())
        .await
        .expect("committed after the heal");
    assert!(
        after.start >= end,
        "after the records committed before: {after:?}"
    );
    committed.insert(7, after);

    let reader_log = log.clone();
    let records = tokio::task::spawn_blocking(move || {
        reader_log
            .reader(0)
            .map(|r| r.expect("reads"))
            .collect::<Vec<_>>()
    })
    .await
    .expect("read task");
    for (offset, record) in (0u64..).zip(&records) {
        assert_eq!(record.offset, offset, "consecutive offsets");
    }
    for (sequence, range) in &committed {
        for (offset, payload) in range.clone().zip(payloads(*sequence)) {
            let record = &records[offset as usize];
            assert_eq!((record.record_type, &record.payload), (ENQUEUE, &payload));
        }
    }
    close(log).await;
    transport.shutdown();
}
