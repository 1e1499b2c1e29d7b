//! A stream's cursors: the records of its cursor log (`docs/streams.md`, "Cursor log
//! records"), the table they build when applied in order, and when the log is compacted.
//! Pure: the owner of the cursor log writes the records and applies them once durable.
//!
//! Rules: a commit sets the positions it names (others keep theirs) and stamps the cursor's
//! last use with the record's time; a delete removes the cursor; a snapshot replaces the whole
//! table, so a crash between writing a snapshot and removing the records before it leaves a
//! log that builds the same table. Every record is validated when decoded: a damaged log is
//! `Corrupt`, never a wrong position.

use std::collections::BTreeMap;

use crate::error::{BrokerError, BrokerResult};
use crate::queue::MAX_PARTITIONS;
use crate::record::Reader;

/// Log record type setting some partitions' positions of one cursor.
pub const CURSOR_COMMIT: u8 = 32;
/// Log record type removing one cursor.
pub const CURSOR_DELETE: u8 = 33;
/// Log record type replacing the whole table (compaction).
pub const CURSOR_SNAPSHOT: u8 = 34;

/// Longest cursor name, in bytes of UTF-8.
pub const CURSOR_NAME_MAX: usize = 255;
/// Most cursors a stream keeps; a commit creating one more is refused (409) until one is
/// deleted or expires.
pub const CURSORS_MAX: usize = 10_000;

/// One record of a cursor log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CursorRecord {
    /// Sets `positions` (partition, next offset to read) of cursor `name`.
    Commit {
        /// The cursor.
        name: String,
        /// Partitions ascending, each once.
        positions: Vec<(u32, u64)>,
    },
    /// Removes cursor `name`.
    Delete {
        /// The cursor.
        name: String,
    },
    /// The whole table: each cursor's name, last use and positions, by name.
    Snapshot(Vec<SnapshotEntry>),
}

/// One cursor in a snapshot: its name, last use (ms) and positions (partition, offset).
pub type SnapshotEntry = (String, u64, Vec<(u32, u64)>);

/// One cursor: its positions and when it was last committed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CursorState {
    /// Partition → the offset of the next message the cursor reads there.
    pub positions: BTreeMap<u32, u64>,
    /// Timestamp of its last commit (expiry counts from it).
    pub last_used_ms: u64,
}

/// The cursors of one stream, as its cursor log's records build them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CursorTable {
    cursors: BTreeMap<String, CursorState>,
}

impl CursorTable {
    /// No cursor.
    pub fn new() -> CursorTable {
        CursorTable::default()
    }

    /// Number of cursors.
    pub fn len(&self) -> usize {
        self.cursors.len()
    }

    /// True with no cursor.
    pub fn is_empty(&self) -> bool {
        self.cursors.is_empty()
    }

    /// Cursor `name`, if it exists.
    pub fn get(&self, name: &str) -> Option<&CursorState> {
        self.cursors.get(name)
    }

    /// Every cursor, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &CursorState)> {
        self.cursors.iter().map(|(n, c)| (n.as_str(), c))
    }

    /// Checks a commit before it is written: a valid name and positions, and room for a new
    /// cursor. Applying a record never fails; this is where a commit is refused.
    pub fn check_commit(&self, name: &str, positions: &[(u32, u64)]) -> BrokerResult<()> {
        check_name(name).map_err(BrokerError::Invalid)?;
        check_positions(positions).map_err(BrokerError::Invalid)?;
        if !self.cursors.contains_key(name) && self.cursors.len() >= CURSORS_MAX {
            return Err(BrokerError::NodeFull(format!(
                "the stream has {CURSORS_MAX} cursors, its most: delete one (or let an idle one \
                 expire) before committing a new one"
            )));
        }
        Ok(())
    }

    /// Applies one durable record written at `timestamp_ms`.
    pub fn apply(&mut self, record: &CursorRecord, timestamp_ms: u64) {
        match record {
            CursorRecord::Commit { name, positions } => {
                let cursor = self.cursors.entry(name.clone()).or_default();
                cursor.positions.extend(positions.iter().copied());
                cursor.last_used_ms = cursor.last_used_ms.max(timestamp_ms);
            }
            CursorRecord::Delete { name } => {
                self.cursors.remove(name);
            }
            CursorRecord::Snapshot(all) => {
                self.cursors = all
                    .iter()
                    .map(|(name, last_used_ms, positions)| {
                        let state = CursorState {
                            positions: positions.iter().copied().collect(),
                            last_used_ms: *last_used_ms,
                        };
                        (name.clone(), state)
                    })
                    .collect();
            }
        }
    }

    /// The snapshot record of the whole table (compaction writes it).
    pub fn snapshot(&self) -> CursorRecord {
        CursorRecord::Snapshot(
            self.cursors
                .iter()
                .map(|(name, c)| {
                    let positions = c.positions.iter().map(|(&p, &o)| (p, o)).collect();
                    (name.clone(), c.last_used_ms, positions)
                })
                .collect(),
        )
    }

    /// Cursors not committed for `expiry_ms` at `now_ms`, by name: the owner deletes them.
    pub fn expired(&self, now_ms: u64, expiry_ms: u64) -> Vec<String> {
        self.cursors
            .iter()
            .filter(|(_, c)| c.last_used_ms.saturating_add(expiry_ms) < now_ms)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// Whether a cursor log should be compacted now: `since_snapshot_bytes` of records were
/// written since its last snapshot, it spans `segments` segments of `segment_bytes`, and a
/// snapshot of its table would take `snapshot_bytes`. Once more than four snapshots' worth of
/// records were written since the last one (so a large table is not rewritten after every
/// commit), and the log spans more than two segments or those records fill more than an eighth
/// of one (so a small log is not rewritten for nothing).
pub fn should_compact(
    since_snapshot_bytes: u64,
    segments: usize,
    snapshot_bytes: u64,
    segment_bytes: u64,
) -> bool {
    since_snapshot_bytes > snapshot_bytes.saturating_mul(4)
        && (segments > 2 || since_snapshot_bytes > segment_bytes / 8)
}

impl CursorRecord {
    /// The log record type.
    pub fn record_type(&self) -> u8 {
        match self {
            CursorRecord::Commit { .. } => CURSOR_COMMIT,
            CursorRecord::Delete { .. } => CURSOR_DELETE,
            CursorRecord::Snapshot(_) => CURSOR_SNAPSHOT,
        }
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            CursorRecord::Commit { name, positions } => {
                put_name(&mut out, name);
                put_positions(&mut out, positions);
            }
            CursorRecord::Delete { name } => put_name(&mut out, name),
            CursorRecord::Snapshot(all) => {
                out.extend_from_slice(&len_u32(all.len()).to_le_bytes());
                for (name, last_used_ms, positions) in all {
                    put_name(&mut out, name);
                    out.extend_from_slice(&last_used_ms.to_le_bytes());
                    put_positions(&mut out, positions);
                }
            }
        }
        out
    }

    /// The record of `record_type` with `payload`, read at `offset` (named in errors).
    pub fn decode(record_type: u8, payload: &[u8], offset: u64) -> BrokerResult<CursorRecord> {
        let mut r = Reader::new(payload, "cursor record", offset);
        let record = match record_type {
            CURSOR_COMMIT => CursorRecord::Commit {
                name: read_name(&mut r)?,
                positions: read_positions(&mut r)?,
            },
            CURSOR_DELETE => CursorRecord::Delete {
                name: read_name(&mut r)?,
            },
            CURSOR_SNAPSHOT => {
                // Each cursor takes at least 2 + 1 + 8 + 4 bytes.
                let count = r.count(15)?;
                let mut all = Vec::with_capacity(count);
                let mut previous: Option<String> = None;
                for _ in 0..count {
                    let name = read_name(&mut r)?;
                    if previous.as_ref().is_some_and(|p| *p >= name) {
                        return Err(r.error(format!("cursor {name:?} out of order")));
                    }
                    let last_used_ms = r.u64()?;
                    let positions = read_positions(&mut r)?;
                    previous = Some(name.clone());
                    all.push((name, last_used_ms, positions));
                }
                if all.len() > CURSORS_MAX {
                    return Err(r.error(format!("{} cursors, most {CURSORS_MAX}", all.len())));
                }
                CursorRecord::Snapshot(all)
            }
            other => {
                return Err(BrokerError::Corrupt {
                    what: "cursor record",
                    offset,
                    reason: format!("record type {other} is not a cursor record"),
                })
            }
        };
        r.end()?;
        Ok(record)
    }
}

fn len_u32(n: usize) -> u32 {
    // Bounded by CURSORS_MAX and MAX_PARTITIONS (checked before anything is written).
    u32::try_from(n).expect("cursor record counts are bounded")
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    debug_assert!(
        check_name(name).is_ok(),
        "names are checked before records are made"
    );
    let len = u16::try_from(name.len()).expect("a checked name is at most 255 bytes");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
}

fn put_positions(out: &mut Vec<u8>, positions: &[(u32, u64)]) {
    out.extend_from_slice(&len_u32(positions.len()).to_le_bytes());
    for &(partition, offset) in positions {
        out.extend_from_slice(&partition.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
    }
}

fn read_name(r: &mut Reader<'_>) -> BrokerResult<String> {
    let name = r.str16()?;
    check_name(&name).map_err(|e| r.error(e))?;
    Ok(name)
}

fn read_positions(r: &mut Reader<'_>) -> BrokerResult<Vec<(u32, u64)>> {
    let count = r.count(12)?;
    let mut positions = Vec::with_capacity(count);
    for _ in 0..count {
        positions.push((r.u32()?, r.u64()?));
    }
    check_positions(&positions).map_err(|e| r.error(e))?;
    Ok(positions)
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > CURSOR_NAME_MAX {
        return Err(format!(
            "a cursor name is 1 to {CURSOR_NAME_MAX} bytes, not {}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("cursor name {name:?} holds a control character"));
    }
    Ok(())
}

fn check_positions(positions: &[(u32, u64)]) -> Result<(), String> {
    if positions.is_empty() {
        return Err("a commit names at least one partition".into());
    }
    let mut previous = None;
    for &(partition, _) in positions {
        if partition >= MAX_PARTITIONS {
            return Err(format!(
                "partition {partition} does not exist (a stream has at most {MAX_PARTITIONS})"
            ));
        }
        if previous.is_some_and(|p| p >= partition) {
            return Err(format!("partition {partition} out of order or named twice"));
        }
        previous = Some(partition);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn commit(name: &str, positions: &[(u32, u64)]) -> CursorRecord {
        CursorRecord::Commit {
            name: name.into(),
            positions: positions.to_vec(),
        }
    }

    fn roundtrip(record: &CursorRecord) -> CursorRecord {
        CursorRecord::decode(record.record_type(), &record.encode(), 0).expect("decodes")
    }

    #[test]
    fn commits_set_only_the_partitions_they_name_and_deletes_remove() {
        let mut table = CursorTable::new();
        table.apply(&commit("a", &[(0, 10), (1, 20)]), 100);
        table.apply(&commit("a", &[(1, 25)]), 200);
        table.apply(&commit("b", &[(0, 3)]), 150);
        let a = table.get("a").expect("a");
        assert_eq!(a.positions, BTreeMap::from([(0, 10), (1, 25)]));
        assert_eq!(a.last_used_ms, 200);
        table.apply(&CursorRecord::Delete { name: "b".into() }, 300);
        assert!(table.get("b").is_none());
        table.apply(&CursorRecord::Delete { name: "b".into() }, 300);
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn a_snapshot_replaces_the_table_so_a_crash_before_the_prefix_goes_changes_nothing() {
        let records = [
            commit("a", &[(0, 10)]),
            commit("b", &[(2, 5)]),
            CursorRecord::Delete { name: "a".into() },
            commit("c", &[(0, 1), (3, 9)]),
        ];
        let mut table = CursorTable::new();
        for (t, r) in records.iter().enumerate() {
            table.apply(r, t as u64);
        }
        let snapshot = roundtrip(&table.snapshot());
        // The log after compaction: the snapshot alone. After a crash before the removal:
        // every record, then the snapshot.
        let mut compacted = CursorTable::new();
        compacted.apply(&snapshot, 9);
        let mut crashed = CursorTable::new();
        for (t, r) in records.iter().enumerate() {
            crashed.apply(r, t as u64);
        }
        crashed.apply(&snapshot, 9);
        assert_eq!(compacted, table);
        assert_eq!(crashed, table);
    }

    #[test]
    fn bad_commits_are_refused_before_they_are_written() {
        let table = CursorTable::new();
        assert!(table.check_commit("ok", &[(0, 1)]).is_ok());
        for (name, positions) in [
            ("", vec![(0, 1)]),
            ("x\n", vec![(0, 1)]),
            ("ok", vec![]),
            ("ok", vec![(1, 1), (0, 1)]),
            ("ok", vec![(1, 1), (1, 2)]),
            ("ok", vec![(MAX_PARTITIONS, 1)]),
        ] {
            assert!(matches!(
                table.check_commit(name, &positions),
                Err(BrokerError::Invalid(_))
            ));
        }
        assert!(table
            .check_commit(&"n".repeat(CURSOR_NAME_MAX + 1), &[(0, 1)])
            .is_err());
    }

    #[test]
    fn the_table_is_bounded() {
        let mut table = CursorTable::new();
        for i in 0..CURSORS_MAX {
            table.apply(&commit(&format!("c{i}"), &[(0, 1)]), 0);
        }
        assert!(matches!(
            table.check_commit("one-more", &[(0, 1)]),
            Err(BrokerError::NodeFull(_))
        ));
        assert!(
            table.check_commit("c7", &[(0, 2)]).is_ok(),
            "an existing cursor commits"
        );
    }

    #[test]
    fn idle_cursors_expire() {
        let mut table = CursorTable::new();
        table.apply(&commit("old", &[(0, 1)]), 1_000);
        table.apply(&commit("new", &[(0, 1)]), 9_000);
        assert_eq!(table.expired(10_000, 5_000), vec!["old".to_string()]);
        assert!(table.expired(10_000, 9_000).is_empty());
    }

    #[test]
    fn compaction_waits_for_a_log_worth_compacting() {
        let seg = 8 << 20;
        assert!(!should_compact(1_000, 1, 100, seg), "a small log stays");
        assert!(
            should_compact(2 << 20, 1, 100, seg),
            "many records over a small table"
        );
        assert!(
            !should_compact(2 << 20, 1, 1 << 20, seg),
            "a large table: not yet"
        );
        assert!(should_compact(5_000, 3, 1_000, seg), "past two segments");
        assert!(
            !should_compact(seg * 2 + 1, 3, 7 << 20, seg),
            "a table larger than what was written since its snapshot is not rewritten after \
             every commit, however many segments it spans"
        );
    }

    #[test]
    fn damaged_records_are_corrupt() {
        let good = commit("a", &[(0, 1), (2, 3)]).encode();
        for len in 0..good.len() {
            assert!(CursorRecord::decode(CURSOR_COMMIT, &good[..len], 0).is_err());
        }
        let mut long = good.clone();
        long.push(1);
        assert!(CursorRecord::decode(CURSOR_COMMIT, &long, 0).is_err());
        assert!(
            CursorRecord::decode(16, &good, 0).is_err(),
            "a stream message type"
        );
        // A snapshot whose names are out of order.
        let mut out = Vec::new();
        out.extend_from_slice(&2u32.to_le_bytes());
        for name in ["b", "a"] {
            put_name(&mut out, name);
            out.extend_from_slice(&0u64.to_le_bytes());
            put_positions(&mut out, &[(0, 1)]);
        }
        assert!(CursorRecord::decode(CURSOR_SNAPSHOT, &out, 0).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_payloads_never_panic(record_type in 30u8..=36, payload in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = CursorRecord::decode(record_type, &payload, 0);
        }

        /// Any sequence of commits and deletes, compacted at any point, builds the table the
        /// whole sequence builds.
        #[test]
        fn compaction_anywhere_keeps_the_table(
            ops in proptest::collection::vec((0u8..4, 0u32..4, 0u64..1000, any::<bool>()), 1..60),
            at in 0usize..60,
        ) {
            let records: Vec<CursorRecord> = ops.iter().map(|&(c, p, o, delete)| {
                let name = format!("c{c}");
                if delete { CursorRecord::Delete { name } } else { commit(&name, &[(p, o)]) }
            }).collect();
            let mut whole = CursorTable::new();
            for (t, r) in records.iter().enumerate() {
                whole.apply(&roundtrip(r), t as u64);
            }
            let cut = at.min(records.len());
            let mut head = CursorTable::new();
            for (t, r) in records[..cut].iter().enumerate() {
                head.apply(r, t as u64);
            }
            let mut compacted = CursorTable::new();
            compacted.apply(&roundtrip(&head.snapshot()), 0);
            for (t, r) in records[cut..].iter().enumerate() {
                compacted.apply(r, (cut + t) as u64);
            }
            prop_assert_eq!(compacted, whole);
        }
    }
}
