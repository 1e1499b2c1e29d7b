//! `StateLog`: the group's vote, committed log id and purge point, kept in a small-class
//! keratin log beside the entries (`docs/storage-format.md`, "Raft state records"). Every record
//! holds the whole state, so the last durable record is the state and older segments can go.
//!
//! Durability: a vote and a purge point are durable (process crash and power loss) when
//! [`StateLog::write`] returns `Ok`; the committed log id is written without waiting, and on its
//! own only every [`COMMITTED_WRITE_EVERY_ENTRIES`] entries (it is a lower bound: openraft only
//! re-applies up to it at start, and [`crate::GroupLogs::store`] clamps it to the durable
//! entries).

use std::sync::Arc;

use keratin_log::{Log, LogError, LogResult, ReadRecord, Record};

use crate::error::RaftError;
use crate::types::{LeaderId, LogId, Vote};

/// The record type of a state record (in the adapter's reserved range).
pub const RECORD_TYPE_RAFT_STATE: u8 = 0xf8;
/// Version of the state record.
pub const STATE_FORMAT_VERSION: u8 = 1;

const VERSION_OFFSET: usize = 0;
const PRESENT_OFFSET: usize = VERSION_OFFSET + 1;
const RESERVED_OFFSET: usize = PRESENT_OFFSET + 1;
const VOTE_TERM_OFFSET: usize = RESERVED_OFFSET + 6;
const VOTE_NODE_OFFSET: usize = VOTE_TERM_OFFSET + 8;
const COMMITTED_OFFSET: usize = VOTE_NODE_OFFSET + 8;
const PURGED_OFFSET: usize = COMMITTED_OFFSET + LOG_ID_SIZE;
/// Size of a state record's payload.
pub const STATE_RECORD_SIZE: usize = PURGED_OFFSET + LOG_ID_SIZE;
/// A log id: term, node, index.
const LOG_ID_SIZE: usize = 24;
const _: () = assert!(STATE_RECORD_SIZE == 72);

const PRESENT_VOTE: u8 = 0x01;
const PRESENT_VOTE_COMMITTED: u8 = 0x02;
const PRESENT_COMMITTED: u8 = 0x04;
const PRESENT_PURGED: u8 = 0x08;
const PRESENT_ALL: u8 = PRESENT_VOTE | PRESENT_VOTE_COMMITTED | PRESENT_COMMITTED | PRESENT_PURGED;

/// After this many writes the state log hands back the segments below its last durable record.
/// A state record takes 104 bytes with the log's header, so a small segment (8 MiB by default,
/// 32 KiB at least) holds over 300 of them: 4,096 writes reclaim at most a few segments per pass.
const COMPACT_EVERY_WRITES: u64 = 4096;

/// The committed id alone is written once it has moved this many entries past the last one
/// written (votes and purges write it too, as every record holds the whole state). Writing it on
/// every commit would cost the state log one record and one `fdatasync` per commit, as many
/// syncs as the entry log itself; this way it costs one per 256 entries, and a restart re-applies
/// at most 256 entries fewer before it hears the cluster's commit (openraft needs only a lower
/// bound).
pub const COMMITTED_WRITE_EVERY_ENTRIES: u64 = 256;

/// What openraft persists besides the entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RaftState {
    /// The last vote.
    pub vote: Option<Vote>,
    /// The last committed log id saved (a lower bound of the cluster's).
    pub committed: Option<LogId>,
    /// Entries up to and including this one are purged.
    pub purged: Option<LogId>,
}

impl RaftState {
    fn encode(&self) -> [u8; STATE_RECORD_SIZE] {
        let mut bytes = [0u8; STATE_RECORD_SIZE];
        bytes[VERSION_OFFSET] = STATE_FORMAT_VERSION;
        let mut present = 0;
        if let Some(vote) = &self.vote {
            present |= PRESENT_VOTE;
            if vote.committed {
                present |= PRESENT_VOTE_COMMITTED;
            }
            put_u64(&mut bytes, VOTE_TERM_OFFSET, vote.leader_id.term);
            put_u64(&mut bytes, VOTE_NODE_OFFSET, vote.leader_id.node_id);
        }
        if let Some(committed) = &self.committed {
            present |= PRESENT_COMMITTED;
            put_log_id(&mut bytes, COMMITTED_OFFSET, committed);
        }
        if let Some(purged) = &self.purged {
            present |= PRESENT_PURGED;
            put_log_id(&mut bytes, PURGED_OFFSET, purged);
        }
        bytes[PRESENT_OFFSET] = present;
        bytes
    }

    fn decode(record: &ReadRecord) -> Result<RaftState, RaftError> {
        let bad = |reason: String| RaftError::Format {
            offset: record.offset,
            reason: format!("raft state record: {reason}"),
        };
        if record.record_type != RECORD_TYPE_RAFT_STATE {
            return Err(bad(format!("record type {:#04x}", record.record_type)));
        }
        let bytes = record.payload.as_slice();
        if bytes.len() != STATE_RECORD_SIZE {
            return Err(bad(format!("{} bytes", bytes.len())));
        }
        if bytes[VERSION_OFFSET] != STATE_FORMAT_VERSION {
            return Err(bad(format!("version {}", bytes[VERSION_OFFSET])));
        }
        let present = bytes[PRESENT_OFFSET];
        if present & !PRESENT_ALL != 0
            || (present & PRESENT_VOTE_COMMITTED != 0 && present & PRESENT_VOTE == 0)
        {
            return Err(bad(format!("presence bits {present:#04x}")));
        }
        if bytes[RESERVED_OFFSET..VOTE_TERM_OFFSET]
            .iter()
            .any(|b| *b != 0)
        {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let vote = (present & PRESENT_VOTE != 0).then(|| Vote {
            leader_id: LeaderId {
                term: get_u64(bytes, VOTE_TERM_OFFSET),
                node_id: get_u64(bytes, VOTE_NODE_OFFSET),
            },
            committed: present & PRESENT_VOTE_COMMITTED != 0,
        });
        Ok(RaftState {
            vote,
            committed: (present & PRESENT_COMMITTED != 0)
                .then(|| get_log_id(bytes, COMMITTED_OFFSET)),
            purged: (present & PRESENT_PURGED != 0).then(|| get_log_id(bytes, PURGED_OFFSET)),
        })
    }
}

fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

fn get_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

fn put_log_id(bytes: &mut [u8], at: usize, log_id: &LogId) {
    put_u64(bytes, at, log_id.leader_id.term);
    put_u64(bytes, at + 8, log_id.leader_id.node_id);
    put_u64(bytes, at + 16, log_id.index);
}

fn get_log_id(bytes: &[u8], at: usize) -> LogId {
    LogId::new(
        LeaderId {
            term: get_u64(bytes, at),
            node_id: get_u64(bytes, at + 8),
        },
        get_u64(bytes, at + 16),
    )
}

/// The writer of a group's state log (one per `LogStore`; openraft calls it sequentially).
#[derive(Debug)]
pub(crate) struct StateLog {
    log: Arc<Log>,
    writes: u64,
    /// The index of the committed id in the last record written.
    committed_written: Option<u64>,
}

impl StateLog {
    pub(crate) fn new(log: Arc<Log>, state: &RaftState) -> StateLog {
        StateLog {
            log,
            writes: 0,
            committed_written: state.committed.map(|c| c.index),
        }
    }

    /// Whether `committed` has moved far enough to be written on its own.
    pub(crate) fn committed_is_due(&self, committed: Option<&LogId>) -> bool {
        match (committed, self.committed_written) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(c), Some(written)) => {
                c.index >= written.saturating_add(COMMITTED_WRITE_EVERY_ENTRIES)
            }
        }
    }

    /// The state as the last durable record holds it.
    pub(crate) fn read(log: &Log) -> Result<RaftState, RaftError> {
        let end = log.durable_offset();
        if end <= log.start_offset() {
            return Ok(RaftState::default());
        }
        let record = log
            .read(end - 1)
            .map_err(|e| RaftError::log("read the raft state", e))?;
        RaftState::decode(&record)
    }

    /// Append `state`; with `wait`, return once it is durable.
    pub(crate) async fn write(&mut self, state: &RaftState, wait: bool) -> LogResult<()> {
        let bytes = state.encode();
        let record = Record {
            record_type: RECORD_TYPE_RAFT_STATE,
            flags: 0,
            timestamp_ms: 0,
            payload: &bytes,
        };
        let ticket = self.log.append_async(&[record]).await?;
        self.writes += 1;
        self.committed_written = state.committed.map(|c| c.index);
        if self.writes.is_multiple_of(COMPACT_EVERY_WRITES) {
            self.compact()?;
        }
        if wait {
            ticket.await?;
        }
        Ok(())
    }

    /// Hand back the segments below the last durable record (it holds the whole state, and every
    /// later record is newer). Not waited for: a failure stops the log and the next write says so.
    fn compact(&self) -> Result<(), LogError> {
        let durable = self.log.durable_offset();
        if durable > self.log.start_offset() + 1 {
            drop(self.log.remove_prefix(durable - 1)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_roundtrips() {
        let states = [
            RaftState::default(),
            RaftState {
                vote: Some(Vote::new(3, 2)),
                committed: None,
                purged: Some(LogId::new(
                    LeaderId {
                        term: 1,
                        node_id: 1,
                    },
                    9,
                )),
            },
            RaftState {
                vote: Some(Vote::new_committed(u64::MAX, 7)),
                committed: Some(LogId::new(
                    LeaderId {
                        term: 5,
                        node_id: 7,
                    },
                    1 << 40,
                )),
                purged: None,
            },
        ];
        for state in states {
            let record = ReadRecord {
                offset: 0,
                record_type: RECORD_TYPE_RAFT_STATE,
                flags: 0,
                timestamp_ms: 0,
                payload: state.encode().to_vec(),
            };
            assert_eq!(RaftState::decode(&record).expect("decode"), state);
        }
    }
}
