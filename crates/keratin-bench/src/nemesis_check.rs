//! The nemesis checker: what the producers published and what the consumers saw, in, and the
//! violations of Keratin's delivery promises, out. Pure (no I/O, no clock), so each rule has a
//! unit test that builds the history by hand.
//!
//! A message is named by its [`MsgKey`] (producer, sequence number), carried in its body with a
//! checksum ([`encode_body`], [`decode_body`]). A *stored copy* is named by its queue, partition
//! and offset: a non-idempotent publish retried after an unknown outcome may be stored twice,
//! at two offsets, and each copy is delivered on its own.
//!
//! The rules ([`check`]):
//! - **lost**: a confirmed message delivered neither from the main queue nor from the
//!   dead-letter queue;
//! - **phantom**: a delivery of a message never published, or a body whose checksum fails;
//! - **duplicate**: a message stored at more than one offset of the main queue when its
//!   producer is idempotent (or it was published in one attempt); a non-idempotent message
//!   published again after a failed attempt may be stored twice, which is counted apart
//!   (`unknown_outcome_duplicates`), not a violation. In the dead-letter queue: more copies of a
//!   message than it had in the main queue (each stored copy is dead-lettered at most once);
//! - **unflagged redelivery**: a stored copy delivered again with `redelivered == false` after
//!   an ack of it was sent;
//! - **order**: two guarantees, both checked. (1) *Stored order*: within a partition, the
//!   offsets of the idempotent producer's messages increase with their sequence numbers, among
//!   messages published in a single attempt (the producer sends its batches one after the
//!   other and a partition appends what one connection sends in the order sent; a message
//!   published again after a failure may land after later messages of its batch that succeeded
//!   the first time, so retried ones are left out). (2) *Delivery order*: within one
//!   subscription and one partition, first deliveries (`redelivered == false`) come in
//!   increasing offset order; requeued and redelivered messages may come back at any time, so
//!   only first deliveries are ordered, and only within a subscription (two consumers share a
//!   partition's messages, and a new subscription starts over);
//! - **dead letter missing**: a poison message (one every consumer rejects with requeue until
//!   `max_deliveries` sends it to the dead-letter queue) stored in the main queue but never
//!   delivered from the dead-letter queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Who published a message; the first byte of its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Producer {
    /// The idempotent producer (fixed producer id, sequence numbers of its own).
    Idempotent,
    /// The producer that is not idempotent: a retry after an unknown outcome may store twice.
    Plain,
    /// The after-healing probe (idempotent: one message per partition).
    Probe,
}

impl Producer {
    fn byte(self) -> u8 {
        match self {
            Producer::Idempotent => 1,
            Producer::Plain => 2,
            Producer::Probe => 3,
        }
    }

    fn from_byte(byte: u8) -> Option<Producer> {
        match byte {
            1 => Some(Producer::Idempotent),
            2 => Some(Producer::Plain),
            3 => Some(Producer::Probe),
            _ => None,
        }
    }

    /// Whether the broker must store each of its messages once whatever the retries.
    pub fn idempotent(self) -> bool {
        !matches!(self, Producer::Plain)
    }
}

/// A message: its producer and sequence number.
pub type MsgKey = (Producer, u64);

/// Bytes of a body: producer (1), sequence number (8), filler, checksum (8, last).
pub const BODY_BYTES: usize = 96;

/// FNV-1a over `bytes`: enough to tell a body damaged on its way from one written whole.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The body of message `key`: producer, sequence, a filler derived from both, and a checksum
/// of everything before it.
pub fn encode_body(key: MsgKey) -> Vec<u8> {
    let mut body = vec![0u8; BODY_BYTES];
    body[0] = key.0.byte();
    body[1..9].copy_from_slice(&key.1.to_le_bytes());
    let fill = key.1.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for (i, byte) in body[9..BODY_BYTES - 8].iter_mut().enumerate() {
        *byte = (fill >> ((i % 8) * 8)) as u8;
    }
    let sum = fnv1a(&body[..BODY_BYTES - 8]);
    body[BODY_BYTES - 8..].copy_from_slice(&sum.to_le_bytes());
    body
}

/// The message a body carries, or `None` when its length, producer or checksum is wrong.
pub fn decode_body(body: &[u8]) -> Option<MsgKey> {
    if body.len() != BODY_BYTES {
        return None;
    }
    let sum = u64::from_le_bytes(body[BODY_BYTES - 8..].try_into().ok()?);
    if fnv1a(&body[..BODY_BYTES - 8]) != sum {
        return None;
    }
    let producer = Producer::from_byte(body[0])?;
    let seq = u64::from_le_bytes(body[1..9].try_into().ok()?);
    Some((producer, seq))
}

/// Whether consumers reject message `seq` (with requeue, every time) so that it ends in the
/// dead-letter queue: one in 16 of each producer's messages.
pub fn poison(seq: u64) -> bool {
    seq % 16 == 5
}

/// What a producer knows of one message it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub key: MsgKey,
    /// A confirm came back for one of its attempts.
    pub confirmed: bool,
    /// Times it was sent (more than 1: an earlier attempt failed or timed out, its outcome
    /// unknown).
    pub attempts: u32,
}

/// The queue a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QueueKind {
    Main,
    DeadLetter,
}

/// How the consumer settled a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// An ack was sent (the client took it).
    Ack,
    /// Rejected with requeue.
    Requeue,
    /// Not settled (the connection was gone).
    None,
}

/// One delivery as a consumer saw it, in the order the consumers saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub queue: QueueKind,
    /// The subscription it came through (a number each new subscription takes).
    pub session: u64,
    /// The message its body carries; `None`: the body failed its checks.
    pub key: Option<MsgKey>,
    pub partition: u32,
    pub offset: u64,
    pub redelivered: bool,
    pub settle: Settle,
    /// Milliseconds since the run began, and the delivery count the broker gave: for the
    /// report of a violation, not used by the rules.
    pub at_ms: u64,
    pub delivery_count: u32,
}

/// Violations and counts found by [`check`]; a message appears in at most one list per rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub confirmed: u64,
    pub lost: Vec<MsgKey>,
    /// Messages never published (their key), and bodies that failed their checks (`None`).
    pub phantoms: Vec<Option<MsgKey>>,
    pub duplicates: Vec<MsgKey>,
    /// Non-idempotent messages published again after a failed attempt and stored twice:
    /// allowed (at least once), counted.
    pub unknown_outcome_duplicates: Vec<MsgKey>,
    pub unflagged_redeliveries: Vec<MsgKey>,
    /// Each violation: the message and which order rule it broke.
    pub order_violations: Vec<(MsgKey, &'static str)>,
    pub dead_letter_missing: Vec<MsgKey>,
}

impl Findings {
    /// Violations of every rule together (the unknown-outcome duplicates are not ones).
    pub fn violations(&self) -> usize {
        self.lost.len()
            + self.phantoms.len()
            + self.duplicates.len()
            + self.unflagged_redeliveries.len()
            + self.order_violations.len()
            + self.dead_letter_missing.len()
    }
}

/// Checks the history: see the module documentation for the rules.
pub fn check(published: &[Published], seen: &[Seen]) -> Findings {
    let mut findings = Findings::default();
    let by_key: HashMap<MsgKey, &Published> = published.iter().map(|p| (p.key, p)).collect();
    findings.confirmed = published.iter().filter(|p| p.confirmed).count() as u64;

    // Stored copies of each message, per queue: (partition, offset).
    let mut copies: BTreeMap<(QueueKind, MsgKey), BTreeSet<(u32, u64)>> = BTreeMap::new();
    let mut acked: BTreeSet<(QueueKind, u32, u64)> = BTreeSet::new();
    let mut unflagged: BTreeSet<MsgKey> = BTreeSet::new();
    let mut phantoms: BTreeSet<Option<MsgKey>> = BTreeSet::new();
    // Delivery order: the last first-delivery offset per (queue, session, partition).
    let mut last_first: HashMap<(QueueKind, u64, u32), u64> = HashMap::new();
    let mut delivery_order: BTreeSet<MsgKey> = BTreeSet::new();
    for s in seen {
        let Some(key) = s.key else {
            phantoms.insert(None);
            continue;
        };
        if !by_key.contains_key(&key) {
            phantoms.insert(Some(key));
            continue;
        }
        copies
            .entry((s.queue, key))
            .or_default()
            .insert((s.partition, s.offset));
        let copy = (s.queue, s.partition, s.offset);
        if !s.redelivered {
            if acked.contains(&copy) {
                unflagged.insert(key);
            }
            let slot = (s.queue, s.session, s.partition);
            if let Some(last) = last_first.get(&slot) {
                if s.offset <= *last {
                    delivery_order.insert(key);
                }
            }
            last_first.insert(slot, s.offset);
        }
        if s.settle == Settle::Ack {
            acked.insert(copy);
        }
    }
    findings.phantoms = phantoms.into_iter().collect();
    findings.unflagged_redeliveries = unflagged.into_iter().collect();

    for p in published {
        let main = copies.get(&(QueueKind::Main, p.key));
        let dead = copies.get(&(QueueKind::DeadLetter, p.key));
        if p.confirmed && main.is_none() && dead.is_none() {
            findings.lost.push(p.key);
        }
        let main_copies = main.map_or(0, BTreeSet::len);
        let dead_copies = dead.map_or(0, BTreeSet::len);
        if main_copies > 1 {
            if p.key.0.idempotent() || p.attempts <= 1 {
                findings.duplicates.push(p.key);
            } else {
                findings.unknown_outcome_duplicates.push(p.key);
            }
        } else if dead_copies > main_copies.max(1) {
            findings.duplicates.push(p.key);
        }
        if poison(p.key.1) && p.key.0 != Producer::Probe && main_copies > 0 && dead_copies == 0 {
            findings.dead_letter_missing.push(p.key);
        }
    }

    // Stored order of the idempotent producer's single-attempt messages, per partition.
    let mut stored: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
    for p in published {
        if p.key.0 != Producer::Idempotent || p.attempts != 1 {
            continue;
        }
        if let Some(main) = copies.get(&(QueueKind::Main, p.key)) {
            if let Some((partition, offset)) = main.iter().next() {
                stored
                    .entry(*partition)
                    .or_default()
                    .push((p.key.1, *offset));
            }
        }
    }
    for mut by_seq in stored.into_values() {
        by_seq.sort_unstable();
        for pair in by_seq.windows(2) {
            if pair[1].1 <= pair[0].1 {
                findings
                    .order_violations
                    .push(((Producer::Idempotent, pair[1].0), "stored order"));
            }
        }
    }
    findings.order_violations.extend(
        delivery_order
            .into_iter()
            .map(|key| (key, "delivery order")),
    );
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Producer = Producer::Idempotent;
    const B: Producer = Producer::Plain;

    fn published(key: MsgKey, attempts: u32) -> Published {
        Published {
            key,
            confirmed: true,
            attempts,
        }
    }

    fn seen(key: MsgKey, partition: u32, offset: u64) -> Seen {
        Seen {
            queue: QueueKind::Main,
            session: 1,
            key: Some(key),
            partition,
            offset,
            redelivered: false,
            settle: Settle::Ack,
            at_ms: 0,
            delivery_count: 1,
        }
    }

    #[test]
    fn bodies_round_trip_and_damage_is_caught() {
        let body = encode_body((B, 123_456));
        assert_eq!(decode_body(&body), Some((B, 123_456)));
        for at in [0, 4, 40, BODY_BYTES - 1] {
            let mut damaged = body.clone();
            damaged[at] ^= 0x10;
            assert_eq!(decode_body(&damaged), None, "flip at {at}");
        }
        assert_eq!(decode_body(&body[..BODY_BYTES - 1]), None);
    }

    #[test]
    fn a_clean_history_has_no_findings() {
        let pubs = vec![published((A, 1), 1), published((A, 2), 2)];
        let seen = vec![seen((A, 1), 0, 0), seen((A, 2), 0, 1)];
        let findings = check(&pubs, &seen);
        assert_eq!(findings.violations(), 0, "{findings:?}");
        assert_eq!(findings.confirmed, 2);
    }

    #[test]
    fn a_confirmed_message_never_delivered_is_lost_an_unconfirmed_one_is_not() {
        let mut unconfirmed = published((B, 2), 1);
        unconfirmed.confirmed = false;
        let findings = check(&[published((A, 1), 1), unconfirmed], &[]);
        assert_eq!(findings.lost, vec![(A, 1)]);
    }

    #[test]
    fn a_message_delivered_only_from_the_dead_letter_queue_is_not_lost() {
        let mut dead = seen((A, 1), 0, 9);
        dead.queue = QueueKind::DeadLetter;
        let findings = check(&[published((A, 1), 1)], &[dead]);
        assert!(findings.lost.is_empty(), "{findings:?}");
    }

    #[test]
    fn unknown_messages_and_bad_bodies_are_phantoms() {
        let mut bad = seen((A, 1), 0, 0);
        bad.key = None;
        let findings = check(&[published((A, 1), 1)], &[seen((A, 7), 0, 0), bad]);
        assert_eq!(findings.phantoms, vec![None, Some((A, 7))]);
    }

    #[test]
    fn stored_twice_is_a_duplicate_unless_a_plain_publish_was_retried() {
        let pubs = vec![
            published((A, 1), 2),
            published((B, 1), 2),
            published((B, 2), 1),
        ];
        let seen = vec![
            seen((A, 1), 0, 0),
            seen((A, 1), 0, 1),
            seen((B, 1), 1, 0),
            seen((B, 1), 1, 1),
            seen((B, 2), 2, 0),
            seen((B, 2), 2, 1),
        ];
        let findings = check(&pubs, &seen);
        assert_eq!(findings.duplicates, vec![(A, 1), (B, 2)]);
        assert_eq!(findings.unknown_outcome_duplicates, vec![(B, 1)]);
    }

    #[test]
    fn the_same_copy_delivered_twice_is_not_a_duplicate() {
        let mut again = seen((A, 1), 0, 0);
        again.redelivered = true;
        let findings = check(&[published((A, 1), 1)], &[seen((A, 1), 0, 0), again]);
        assert_eq!(findings.violations(), 0, "{findings:?}");
    }

    #[test]
    fn an_acked_copy_delivered_again_as_new_is_an_unflagged_redelivery() {
        let findings = check(
            &[published((A, 1), 1)],
            &[seen((A, 1), 0, 0), seen((A, 1), 0, 0)],
        );
        assert_eq!(findings.unflagged_redeliveries, vec![(A, 1)]);
        // Not acked the first time (connection gone): coming back unflagged is not this rule.
        let mut unsettled = seen((A, 1), 0, 0);
        unsettled.settle = Settle::None;
        let mut other_session = seen((A, 1), 0, 0);
        other_session.session = 2;
        let findings = check(&[published((A, 1), 1)], &[unsettled, other_session]);
        assert!(findings.unflagged_redeliveries.is_empty(), "{findings:?}");
    }

    #[test]
    fn stored_order_counts_only_single_attempt_idempotent_messages() {
        let pubs = vec![
            published((A, 1), 1),
            published((A, 2), 1),
            published((A, 3), 2),
        ];
        // 2 stored before 1: a violation; 3 (retried) stored before both: allowed. Each in
        // its own session so that delivery order does not apply.
        let mut history = vec![seen((A, 3), 0, 0), seen((A, 2), 0, 1), seen((A, 1), 0, 2)];
        for (session, s) in history.iter_mut().enumerate() {
            s.session = session as u64;
        }
        let findings = check(&pubs, &history);
        assert_eq!(findings.order_violations, vec![((A, 2), "stored order")]);
    }

    #[test]
    fn first_deliveries_of_a_partition_come_in_offset_order_within_a_session() {
        let pubs: Vec<Published> = (1..=3).map(|s| published((B, s), 1)).collect();
        let mut requeued = seen((B, 1), 0, 5);
        requeued.settle = Settle::Requeue;
        let mut back = seen((B, 1), 0, 5);
        back.redelivered = true;
        // A redelivery out of order is fine; a first delivery behind the last one is not.
        let history = vec![requeued, seen((B, 2), 0, 6), back, seen((B, 3), 0, 4)];
        let findings = check(&pubs, &history);
        assert_eq!(findings.order_violations, vec![((B, 3), "delivery order")]);
        // Other partitions and sessions have their own order.
        let mut other = seen((B, 3), 1, 1);
        other.session = 1;
        let findings = check(&pubs, &[seen((B, 2), 0, 6), other]);
        assert!(findings.order_violations.is_empty(), "{findings:?}");
    }

    #[test]
    fn a_poison_message_must_reach_the_dead_letter_queue_once() {
        let key = (A, 5);
        assert!(poison(key.1));
        let mut requeued = seen(key, 0, 0);
        requeued.settle = Settle::Requeue;
        let findings = check(&[published(key, 1)], std::slice::from_ref(&requeued));
        assert_eq!(findings.dead_letter_missing, vec![key]);
        let mut dead = seen(key, 0, 3);
        dead.queue = QueueKind::DeadLetter;
        let mut dead_again = dead.clone();
        dead_again.offset = 4;
        let findings = check(&[published(key, 1)], &[requeued.clone(), dead.clone()]);
        assert_eq!(findings.violations(), 0, "{findings:?}");
        let findings = check(&[published(key, 1)], &[requeued, dead, dead_again]);
        assert_eq!(findings.duplicates, vec![key]);
    }
}
