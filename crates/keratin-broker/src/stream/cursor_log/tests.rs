//! The cursor log's owner on `MemLog`, a replicated log's stand-in: open, roles, a new leader's
//! catch-up, the step-down grace, a restart past the table, a storage failure, compaction.

use std::time::Duration;

use super::*;
use crate::partition::mem_log::MemLog;
use crate::stream::cursors::CursorRecord;

const SEGMENT: u64 = 8 << 10;

fn commit(name: &str, positions: &[(u32, u64)]) -> CursorRecord {
    CursorRecord::Commit {
        name: name.into(),
        positions: positions.to_vec(),
    }
}

fn encoded(records: &[CursorRecord]) -> Vec<(u8, Vec<u8>)> {
    records
        .iter()
        .map(|r| (r.record_type(), r.encode()))
        .collect()
}

fn follower(leader: u64) -> Role {
    Role {
        leading: false,
        leader: Some(leader),
        addr: Some(format!("127.0.0.{leader}:5672")),
        from: 0,
    }
}

fn leader(from: u64) -> Role {
    Role {
        leading: true,
        leader: Some(1),
        addr: Some("127.0.0.1:5672".into()),
        from,
    }
}

async fn start(log: &Arc<MemLog>) -> CursorLog {
    let log: Arc<dyn PartitionLog> = log.clone();
    CursorLog::start("events", log, SEGMENT)
        .await
        .expect("starts")
}

/// Waits (bounded) until `done` holds.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..200 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: not within 2 s");
}

fn offset_of(cursors: &CursorLog, name: &str, partition: u32) -> Option<u64> {
    cursors.get(name)?.positions.get(&partition).copied()
}

#[tokio::test]
async fn the_table_is_read_at_open_and_a_commit_is_applied_once_committed() {
    let log = Arc::new(MemLog::default());
    log.push(&encoded(&[
        commit("a", &[(0, 5)]),
        commit("b", &[(1, 7)]),
        CursorRecord::Delete { name: "b".into() },
    ]));
    let cursors = start(&log).await;
    assert_eq!(offset_of(&cursors, "a", 0), Some(5));
    assert!(cursors.get("b").is_none());
    cursors
        .commit("a", &[(0, 9)], 1_000)
        .await
        .expect("commits");
    assert_eq!(
        offset_of(&cursors, "a", 0),
        Some(9),
        "applied when answered"
    );
    assert_eq!(log.records().len(), 4);
    assert!(!cursors.delete("b", 1_000).await.expect("answers"));
    assert_eq!(
        log.records().len(),
        4,
        "deleting a missing cursor writes nothing"
    );
    cursors.close().await.expect("closes");
    let closed = cursors.commit("a", &[(0, 10)], 1_000).await;
    assert!(matches!(closed, Err(BrokerError::Closed(_))), "{closed:?}");
}

#[tokio::test]
async fn a_follower_refuses_commits_naming_the_leader_and_applies_the_leaders_records() {
    let log = Arc::new(MemLog::default());
    let cursors = start(&log).await;
    log.set_role(follower(2));
    let refused = cursors.commit("a", &[(0, 1)], 1_000).await;
    match refused {
        Err(BrokerError::NotLeader {
            partition, leader, ..
        }) => {
            assert_eq!(partition, CURSOR_LOG_PARTITION);
            assert_eq!(leader, Some(2));
        }
        other => panic!("a follower answered {other:?}"),
    }
    assert!(log.records().is_empty(), "a follower proposes nothing");
    // An election's blank entry of the replicated log reads as a `NOOP` between them.
    let mut records = encoded(&[commit("a", &[(0, 2)])]);
    records.push((crate::record::NOOP, Vec::new()));
    records.extend(encoded(&[commit("a", &[(0, 3)])]));
    log.commit_foreign_encoded(&records, 5_000);
    eventually("the leader's commit applied", || {
        offset_of(&cursors, "a", 0) == Some(3)
    })
    .await;
    assert_eq!(cursors.get("a").map(|c| c.last_used_ms), Some(5_000));
    assert!(!cursors.figures().role.leading);
}

#[tokio::test]
async fn a_new_leader_applies_its_predecessors_records_before_it_proposes() {
    let log = Arc::new(MemLog::default());
    let cursors = Arc::new(start(&log).await);
    log.set_role(follower(2));
    // The predecessor's records reach this copy, not yet reported committed.
    log.push(&encoded(&[
        commit("old", &[(0, 4)]),
        commit("old", &[(1, 6)]),
    ]));
    log.set_role(leader(3));
    let committing = {
        let cursors = cursors.clone();
        tokio::spawn(async move { cursors.commit("new", &[(0, 1)], 2_000).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        log.records().len(),
        2,
        "a leader that has not applied its predecessors' records proposes nothing"
    );
    log.commit_foreign_encoded(&encoded(&[commit("old", &[(0, 8)])]), 1_500);
    committing
        .await
        .expect("joins")
        .expect("commits once caught up");
    assert_eq!(log.records().len(), 4, "the commit lands after them");
    assert_eq!(offset_of(&cursors, "old", 0), Some(8));
    assert_eq!(offset_of(&cursors, "old", 1), Some(6));
    assert_eq!(offset_of(&cursors, "new", 0), Some(1));
}

#[tokio::test]
async fn a_commit_in_flight_at_a_step_down_is_answered_unknown_and_applied_if_committed() {
    let log = Arc::new(MemLog::default());
    let cursors = Arc::new(start(&log).await);
    log.set_role(leader(0));
    log.hold_proposals();
    let committing = {
        let cursors = cursors.clone();
        tokio::spawn(async move { cursors.commit("a", &[(0, 1)], 2_000).await })
    };
    eventually("the commit proposed", || log.held_count() == 1).await;
    let started = std::time::Instant::now();
    log.set_role(follower(2));
    let answer = committing.await.expect("joins");
    assert!(
        matches!(
            answer,
            Err(BrokerError::LeadershipLost {
                partition: CURSOR_LOG_PARTITION,
                ..
            })
        ),
        "{answer:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(450));
    // The successor committed it after all: every replica applies it.
    log.settle_held(None);
    eventually("the committed proposal applied", || {
        offset_of(&cursors, "a", 0) == Some(1)
    })
    .await;
}

#[tokio::test]
async fn a_log_restarted_past_the_table_is_read_from_its_new_start() {
    let log = Arc::new(MemLog::default());
    let cursors = start(&log).await;
    log.set_role(follower(2));
    log.commit_foreign_encoded(
        &encoded(&[commit("gone", &[(0, 1)]), commit("kept", &[(0, 2)])]),
        1_000,
    );
    eventually("applied", || cursors.table().len() == 2).await;
    // This copy lagged and installed the group's snapshot: its log continues at 5, where the
    // leader's compaction wrote a snapshot without "gone".
    log.restart(5);
    let mut table = CursorTable::new();
    table.apply(&commit("kept", &[(0, 9)]), 3_000);
    log.commit_foreign_encoded(
        &encoded(&[table.snapshot(), commit("later", &[(1, 1)])]),
        4_000,
    );
    eventually("read from the new start", || {
        offset_of(&cursors, "later", 1) == Some(1)
    })
    .await;
    assert!(
        cursors.get("gone").is_none(),
        "the snapshot replaced the table"
    );
    assert_eq!(offset_of(&cursors, "kept", 0), Some(9));
}

#[tokio::test]
async fn a_storage_failure_stops_the_log_and_a_heal_reads_the_table_again() {
    let log = Arc::new(MemLog::default());
    let cursors = start(&log).await;
    cursors
        .commit("a", &[(0, 1)], 1_000)
        .await
        .expect("commits");
    log.fail_storage();
    // Records that reached the copy before the failure are read back by the heal.
    log.push(&encoded(&[commit("b", &[(0, 2)])]));
    cursors
        .commit("a", &[(0, 3)], 2_000)
        .await
        .expect("commits after the heal");
    assert_eq!(offset_of(&cursors, "b", 0), Some(2));
    assert_eq!(offset_of(&cursors, "a", 0), Some(3));
}

#[tokio::test]
async fn compaction_writes_a_snapshot_that_rebuilds_the_same_table_and_removes_below_it() {
    let log = Arc::new(MemLog::default());
    let cursors = start(&log).await;
    let mut model = CursorTable::new();
    for i in 0..200u64 {
        let name = format!("{}-{}", "reader".repeat(10), i % 4);
        let positions = [((i % 3) as u32, i)];
        cursors
            .commit(&name, &positions, 1_000 + i)
            .await
            .expect("commits");
        model.apply(&commit(&name, &positions), 1_000 + i);
    }
    assert_eq!(*cursors.table(), model);
    let records = log.records();
    let snapshots: Vec<u64> = records
        .iter()
        .enumerate()
        .filter(|(_, (t, _))| *t == crate::stream::cursors::CURSOR_SNAPSHOT)
        .map(|(offset, _)| offset as u64)
        .collect();
    assert!(snapshots.len() >= 3, "{} snapshots", snapshots.len());
    assert!(
        snapshots.len() < 40,
        "{} snapshots: compaction runs far more often than the records warrant",
        snapshots.len()
    );
    assert_eq!(cursors.figures().compactions, snapshots.len() as u64);
    assert_eq!(
        log.removals(),
        snapshots,
        "each snapshot frees what lies below it"
    );
    // The records from the last snapshot on build the same table.
    let last = *snapshots.last().expect("one");
    let mut rebuilt = CursorTable::new();
    for (offset, (record_type, payload)) in records.iter().enumerate().skip(last as usize) {
        let record = CursorRecord::decode(*record_type, payload, offset as u64).expect("decodes");
        rebuilt.apply(&record, 1_000 + 199);
    }
    assert_eq!(
        rebuilt
            .iter()
            .map(|(n, c)| (n.to_string(), c.positions.clone()))
            .collect::<Vec<_>>(),
        model
            .iter()
            .map(|(n, c)| (n.to_string(), c.positions.clone()))
            .collect::<Vec<_>>()
    );
}
