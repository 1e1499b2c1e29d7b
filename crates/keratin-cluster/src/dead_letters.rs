//! Dead-lettering across the nodes of a cluster: [`ClusterDeadLetters`], the broker's
//! `DeadLetterSink` on a cluster node, and the cluster service request that carries dead
//! letters to the node leading their partition ([`KIND_DEAD_LETTER`], byte by byte in
//! `docs/cluster-protocol.md`, "Dead-letter requests").
//!
//! The sink routes each copy to its partition of the dead-letter queue as a publish on this
//! node would (routing key, else the copy's dead-letter mark) and publishes each partition's
//! share on its leader: here when this node leads it, else on the node the "not the leader"
//! answer names, following at most [`HOPS_MAX`] such answers. The leader answers once the
//! copies are committed on its partition's replicas. Whatever goes wrong (no leader known, a
//! leader that moved, died or did not answer in time, a full or missing queue) fails the
//! share's copies for this attempt; the source partition holds their originals and tries
//! again later (`keratin-broker` `partition/dead_letter.rs`), and a retry of a copy that was
//! stored after all is dropped as a duplicate by its dead-letter mark.
//!
//! The served side bounds what it holds: the payloads of the dead-letter requests it is
//! serving at once stay under [`SERVED_BYTES_MAX`]; beyond, a request is answered "refused,
//! not stored" at once and its sender retries after its pause.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use keratin_broker::partition::dead_letter::{DeadLetterSink, DeadLettering, ATTEMPT_MESSAGES_MAX};
use keratin_broker::{Broker, BrokerError, BrokerResult, ByteBudget, Message, WeakBroker};
use keratin_net::{NetError, RemoteError, Transport};

use crate::service::{BAD_REQUEST, SERVICE_GROUP, STARTING};

/// Cluster service request kind: store dead-letter copies in a partition the receiver leads.
/// (Kind 4 is `REBALANCE`, leader balancing's.)
pub const KIND_DEAD_LETTER: u8 = 5;

/// The version byte that opens a dead-letter request and its reply.
pub const DEAD_LETTER_VERSION: u8 = 1;

/// Most copies one request carries: a source partition's attempt carries at most
/// `ATTEMPT_MESSAGES_MAX` (64), all of one dead-letter queue, so one partition's share never
/// holds more.
pub const REQUEST_MESSAGES_MAX: usize = ATTEMPT_MESSAGES_MAX;

/// A share follows at most this many "not the leader" answers in one attempt: one for the
/// leader this node knows, one more for a leadership that moved meanwhile, and one spare; a
/// leadership moving faster than that is tried again after the source partition's pause.
const HOPS_MAX: usize = 3;

/// A share sent to another node waits this long for its answer (the leader answers after the
/// commit, a few milliseconds; an election takes one or two seconds). Past it the outcome is
/// unknown: the attempt fails and is retried, stored once by its mark.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Payload bytes of the dead-letter requests a node serves at once: 64 MiB, the size of the
/// default delivery budget. Each sender has at most one attempt out per source partition, of
/// at most 1 MiB (or one larger message), so 64 busy source partitions fit.
const SERVED_BYTES_MAX: u64 = 64 << 20;

/// Reply outcomes (the byte after the version).
const OUTCOME_STORED: u8 = 0;
const OUTCOME_NOT_LEADER: u8 = 1;
const OUTCOME_REFUSED: u8 = 2;

/// Why a refused share was not stored (the byte after [`OUTCOME_REFUSED`]).
const REFUSED_NOT_FOUND: u8 = 0;
const REFUSED_QUEUE_FULL: u8 = 1;
const REFUSED_UNAVAILABLE: u8 = 2;
const REFUSED_UNKNOWN: u8 = 3;
const REFUSED_OTHER: u8 = 4;

/// A cluster node's dead-letter sink, and the server of [`KIND_DEAD_LETTER`] requests; see the
/// module docs.
#[derive(Debug)]
pub struct ClusterDeadLetters {
    node_id: u64,
    /// Set once the broker is open ([`ClusterDeadLetters::attach`]), with the transport to
    /// the other nodes; until then the sink is closed and requests are refused as "starting".
    attached: OnceLock<(WeakBroker, Transport)>,
    /// The payload bytes of the requests being served ([`SERVED_BYTES_MAX`]).
    served: Arc<ByteBudget>,
}

impl ClusterDeadLetters {
    pub(crate) fn new(node_id: u64) -> ClusterDeadLetters {
        ClusterDeadLetters {
            node_id,
            attached: OnceLock::new(),
            served: ByteBudget::new(SERVED_BYTES_MAX),
        }
    }

    /// The broker opened with this sink, and the transport to the other nodes.
    pub(crate) fn attach(&self, broker: &Broker, transport: Transport) {
        let _ = self.attached.set((broker.downgrade(), transport));
    }

    fn broker(&self) -> Option<Broker> {
        self.attached.get()?.0.upgrade()
    }

    /// Serve a [`KIND_DEAD_LETTER`] request: store the copies if this node leads the
    /// partition; the reply says what became of them.
    pub(crate) async fn serve(&self, body: Bytes) -> Result<Bytes, RemoteError> {
        let broker = self
            .broker()
            .ok_or_else(|| RemoteError::new(STARTING, "the node is starting; ask again shortly"))?;
        let request = decode_request(&body).map_err(|e| RemoteError::new(BAD_REQUEST, e))?;
        let Some(_permit) = self.served.try_take(body.len() as u64) else {
            let error = BrokerError::Unavailable {
                queue: request.queue.clone(),
                partition: request.partition,
                source: keratin_log::LogError::Invalid(format!(
                    "node {} serves {} MiB of dead-letter requests already; retry later",
                    self.node_id,
                    SERVED_BYTES_MAX >> 20
                )),
            };
            return Ok(encode_reply(&Err(error)));
        };
        let outcome = broker
            .publish_internal_to(&request.queue, request.partition, request.payloads)
            .await;
        Ok(encode_reply(&outcome.map(|range| range.start)))
    }
}

impl DeadLetterSink for ClusterDeadLetters {
    fn is_open(&self) -> bool {
        self.broker().is_some()
    }

    fn publish(&self, queue: &str, messages: Vec<Message>) -> DeadLettering {
        let attached = self
            .attached
            .get()
            .and_then(|(broker, transport)| Some((broker.upgrade()?, transport.clone())));
        let queue = queue.to_string();
        let node_id = self.node_id;
        Box::pin(async move {
            let Some((broker, transport)) = attached else {
                let error = BrokerError::Closed("the broker".into());
                return messages.iter().map(|_| Err(error.clone())).collect();
            };
            let mut results: Vec<Option<BrokerResult<()>>> = vec![None; messages.len()];
            // Partition to (message indexes, payloads).
            let mut shares: BTreeMap<u32, (Vec<usize>, Vec<Vec<u8>>)> = BTreeMap::new();
            for (i, message) in messages.iter().enumerate() {
                let routed = broker.route(&queue, message).and_then(|partition| {
                    let mut payload = Vec::with_capacity(message.body.len() + 64);
                    message.encode(&mut payload).map(|()| (partition, payload))
                });
                match routed {
                    Ok((partition, payload)) => {
                        let share = shares.entry(partition).or_default();
                        share.0.push(i);
                        share.1.push(payload);
                    }
                    Err(error) => results[i] = Some(Err(error)),
                }
            }
            // One task per partition with copies: at most REQUEST_MESSAGES_MAX (an attempt's
            // messages), and at most the queue's 64 partitions.
            let mut publishing = tokio::task::JoinSet::new();
            for (partition, (indexes, payloads)) in shares {
                let share = Share {
                    broker: broker.clone(),
                    transport: transport.clone(),
                    node_id,
                    queue: queue.clone(),
                    partition,
                };
                publishing.spawn(async move { (indexes, share.publish(payloads).await) });
            }
            while let Some(joined) = publishing.join_next().await {
                let Ok((indexes, outcome)) = joined else {
                    continue;
                };
                for i in indexes {
                    results[i] = Some(outcome.clone());
                }
            }
            // A share whose task ended without an answer (it panicked) is not known stored.
            results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(BrokerError::Closed("dead-lettering".into()))))
                .collect()
        })
    }
}

/// One partition's copies of an attempt, on their way to that partition's leader.
struct Share {
    broker: Broker,
    transport: Transport,
    node_id: u64,
    queue: String,
    partition: u32,
}

impl Share {
    /// Store `payloads` on the partition's leader: this node first, then the nodes the "not
    /// the leader" answers name.
    async fn publish(&self, payloads: Vec<Vec<u8>>) -> BrokerResult<()> {
        let mut body: Option<Bytes> = None;
        let mut at = self.node_id;
        let mut last = None;
        for _ in 0..HOPS_MAX {
            let outcome = if at == self.node_id {
                self.broker
                    .publish_internal_to(&self.queue, self.partition, payloads.clone())
                    .await
                    .map(|_| ())
            } else {
                let body = body
                    .get_or_insert_with(|| encode_request(&self.queue, self.partition, &payloads))
                    .clone();
                self.call(at, body).await
            };
            match outcome {
                Err(BrokerError::NotLeader {
                    leader: Some(leader),
                    ..
                }) if leader != at => {
                    last = Some(leader);
                    at = leader;
                }
                other => return other,
            }
        }
        Err(BrokerError::NotLeader {
            queue: self.queue.clone(),
            partition: self.partition,
            leader: last,
            addr: None,
        })
    }

    /// Send the share to node `to` and read its answer.
    async fn call(&self, to: u64, body: Bytes) -> BrokerResult<()> {
        let reply = self
            .transport
            .call(to, SERVICE_GROUP, KIND_DEAD_LETTER, body, CALL_TIMEOUT)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(NetError::Refused { error, .. }) => {
                return Err(self.unreachable(to, format!("it refused the request: {error}")))
            }
            Err(error) => return Err(self.unreachable(to, error.to_string())),
        };
        match decode_reply(&reply) {
            Ok(Reply::Stored { .. }) => Ok(()),
            Ok(Reply::NotLeader { leader }) => Err(BrokerError::NotLeader {
                queue: self.queue.clone(),
                partition: self.partition,
                leader,
                addr: None,
            }),
            Ok(Reply::Refused { reason, message }) => Err(self.refused(to, reason, message)),
            Err(error) => Err(self.unreachable(to, format!("its answer did not decode: {error}"))),
        }
    }

    fn unreachable(&self, node: u64, why: String) -> BrokerError {
        BrokerError::Unreachable {
            queue: self.queue.clone(),
            partition: self.partition,
            why: format!("dead letters sent to node {node}, its leader: {why}"),
        }
    }

    /// The error a refusal stands for, classed as the leader classed it.
    fn refused(&self, node: u64, reason: u8, message: String) -> BrokerError {
        match reason {
            REFUSED_NOT_FOUND => BrokerError::NotFound(self.queue.clone()),
            REFUSED_QUEUE_FULL => BrokerError::Limited {
                reason: "queue_full".into(),
                retry_after_ms: 0,
                message,
            },
            REFUSED_UNAVAILABLE | REFUSED_UNKNOWN => {
                self.unreachable(node, format!("it could not store them: {message}"))
            }
            _ => BrokerError::Invalid(format!("node {node} refused dead letters: {message}")),
        }
    }
}

/// A decoded [`KIND_DEAD_LETTER`] request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) queue: String,
    pub(crate) partition: u32,
    /// Encoded messages, each checked to decode.
    pub(crate) payloads: Vec<Vec<u8>>,
}

/// A decoded [`KIND_DEAD_LETTER`] reply.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Committed; the first copy's offset.
    Stored { first_offset: u64 },
    /// The receiver does not lead the partition; the leader it knows.
    NotLeader { leader: Option<u64> },
    /// Not stored (or the outcome is unknown), with the reason byte and what happened.
    Refused { reason: u8, message: String },
}

/// The request body (`docs/cluster-protocol.md`, "Dead-letter requests").
pub(crate) fn encode_request(queue: &str, partition: u32, payloads: &[Vec<u8>]) -> Bytes {
    let size = payloads.iter().map(|p| 4 + p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(1 + 2 + queue.len() + 4 + 4 + size);
    out.push(DEAD_LETTER_VERSION);
    put_string(&mut out, queue);
    out.extend_from_slice(&partition.to_le_bytes());
    out.extend_from_slice(&(payloads.len() as u32).to_le_bytes());
    for payload in payloads {
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(payload);
    }
    Bytes::from(out)
}

/// Decode a request body; `Err` names what is wrong. Every length is checked against the bytes
/// left before anything is allocated.
pub(crate) fn decode_request(body: &[u8]) -> Result<Request, String> {
    let mut r = Reader { bytes: body, at: 0 };
    let version = r.u8()?;
    if version != DEAD_LETTER_VERSION {
        return Err(format!(
            "dead-letter request version {version}; this node speaks {DEAD_LETTER_VERSION}"
        ));
    }
    let queue = r.string()?;
    let partition = r.u32()?;
    let count = r.u32()? as usize;
    if count == 0 || count > REQUEST_MESSAGES_MAX {
        return Err(format!(
            "{count} messages in a dead-letter request (1 to {REQUEST_MESSAGES_MAX})"
        ));
    }
    let mut payloads = Vec::with_capacity(count);
    for i in 0..count {
        let payload = r.bytes()?.to_vec();
        Message::decode(&payload, i as u64)
            .map_err(|e| format!("message {i} of the dead-letter request: {e}"))?;
        payloads.push(payload);
    }
    if r.at != body.len() {
        return Err(format!(
            "{} bytes after the dead-letter request's last message",
            body.len() - r.at
        ));
    }
    Ok(Request {
        queue,
        partition,
        payloads,
    })
}

/// The reply body for the outcome of the leader's publish (its first offset, or why not).
pub(crate) fn encode_reply(outcome: &BrokerResult<u64>) -> Bytes {
    let mut out = vec![DEAD_LETTER_VERSION];
    match outcome {
        Ok(first_offset) => {
            out.push(OUTCOME_STORED);
            out.extend_from_slice(&first_offset.to_le_bytes());
        }
        Err(BrokerError::NotLeader { leader, .. }) => {
            out.push(OUTCOME_NOT_LEADER);
            out.extend_from_slice(&leader.unwrap_or(0).to_le_bytes());
        }
        Err(error) => {
            let reason = match error {
                BrokerError::NotFound(_) => REFUSED_NOT_FOUND,
                BrokerError::Limited { .. } => REFUSED_QUEUE_FULL,
                BrokerError::Unavailable { .. }
                | BrokerError::Closed(_)
                | BrokerError::MetadataUnavailable { .. } => REFUSED_UNAVAILABLE,
                BrokerError::OutcomeUnknown { .. }
                | BrokerError::TimedOut { .. }
                | BrokerError::LeadershipLost { .. }
                | BrokerError::Unreachable { .. } => REFUSED_UNKNOWN,
                _ => REFUSED_OTHER,
            };
            out.push(OUTCOME_REFUSED);
            out.push(reason);
            put_string(&mut out, &error.to_string());
        }
    }
    Bytes::from(out)
}

pub(crate) fn decode_reply(body: &[u8]) -> Result<Reply, String> {
    let mut r = Reader { bytes: body, at: 0 };
    let version = r.u8()?;
    if version != DEAD_LETTER_VERSION {
        return Err(format!(
            "dead-letter reply version {version}; this node speaks {DEAD_LETTER_VERSION}"
        ));
    }
    let reply = match r.u8()? {
        OUTCOME_STORED => Reply::Stored {
            first_offset: r.u64()?,
        },
        OUTCOME_NOT_LEADER => Reply::NotLeader {
            leader: Some(r.u64()?).filter(|id| *id != 0),
        },
        OUTCOME_REFUSED => Reply::Refused {
            reason: r.u8()?,
            message: r.string()?,
        },
        other => return Err(format!("dead-letter reply outcome {other} is unknown")),
    };
    if r.at != body.len() {
        return Err(format!(
            "{} bytes after the dead-letter reply",
            body.len() - r.at
        ));
    }
    Ok(reply)
}

/// A `string` of the cluster protocol: `u16` length, then UTF-8; longer text is cut at a
/// character boundary to fit.
fn put_string(out: &mut Vec<u8>, text: &str) {
    let mut end = text.len().min(usize::from(u16::MAX));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..end]);
}

/// Reads the little-endian fields of a body; every read checks the bytes left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(count)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "{count} bytes wanted at offset {} of a {}-byte body",
                    self.at,
                    self.bytes.len()
                )
            })?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        let mut raw = [0u8; 2];
        raw.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(raw))
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(raw))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(raw))
    }

    fn string(&mut self) -> Result<String, String> {
        let len = usize::from(self.u16()?);
        let raw = self.take(len)?;
        String::from_utf8(raw.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let len = self.u32()? as usize;
        self.take(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(body: &str) -> Vec<u8> {
        let mut message = Message::new(body);
        // As a dead-letter copy carries it.
        message.producer = Some(keratin_broker::ProducerSeq {
            producer: 7,
            sequence: 5,
        });
        let mut out = Vec::new();
        message.encode(&mut out).expect("encodes");
        out
    }

    /// The example of `docs/cluster-protocol.md`, byte by byte: a request with one message
    /// (body `x`) for partition 1 of `dlq`, and the replies.
    #[test]
    fn the_documented_examples_encode_byte_for_byte() {
        let message = payload("x");
        let request = encode_request("dlq", 1, std::slice::from_ref(&message));
        let mut expected = vec![0x01, 0x03, 0x00, b'd', b'l', b'q'];
        expected.extend_from_slice(&[0x01, 0, 0, 0]);
        expected.extend_from_slice(&[0x01, 0, 0, 0]);
        expected.extend_from_slice(&(message.len() as u32).to_le_bytes());
        expected.extend_from_slice(&message);
        assert_eq!(request.as_ref(), expected.as_slice());
        assert_eq!(
            decode_request(&request),
            Ok(Request {
                queue: "dlq".into(),
                partition: 1,
                payloads: vec![message],
            })
        );
        let stored = encode_reply(&Ok(42));
        assert_eq!(stored.as_ref(), &[0x01, 0x00, 42, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            decode_reply(&stored),
            Ok(Reply::Stored { first_offset: 42 })
        );
        let moved = encode_reply(&Err(BrokerError::NotLeader {
            queue: "dlq".into(),
            partition: 1,
            leader: Some(3),
            addr: None,
        }));
        assert_eq!(moved.as_ref(), &[0x01, 0x01, 3, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            decode_reply(&moved),
            Ok(Reply::NotLeader { leader: Some(3) })
        );
        let missing = encode_reply(&Err(BrokerError::NotFound("dlq".into())));
        assert_eq!(&missing[..3], &[0x01, 0x02, REFUSED_NOT_FOUND]);
        match decode_reply(&missing) {
            Ok(Reply::Refused { reason, message }) => {
                assert_eq!(reason, REFUSED_NOT_FOUND);
                assert!(message.contains("dlq"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Bodies from the network never panic the decoder, and a request it accepts holds what
    /// was encoded: every prefix of a valid body is refused, as are a wrong version, a count
    /// beyond the bound, trailing bytes and a payload that is not a message.
    #[test]
    fn malformed_bodies_are_refused_never_panic() {
        let request = encode_request("dlq", 0, &[payload("a"), payload("bc")]);
        for end in 0..request.len() {
            assert!(decode_request(&request[..end]).is_err(), "prefix {end}");
        }
        let mut wrong_version = request.to_vec();
        wrong_version[0] = 2;
        assert!(decode_request(&wrong_version).is_err());
        let mut trailing = request.to_vec();
        trailing.push(0);
        assert!(decode_request(&trailing).is_err());
        let too_many = vec![payload("m"); REQUEST_MESSAGES_MAX + 1];
        let err = decode_request(&encode_request("dlq", 0, &too_many)).expect_err("over");
        assert!(err.contains("65 messages"), "{err}");
        let not_a_message = encode_request("dlq", 0, &[vec![0xff, 1, 2]]);
        assert!(decode_request(&not_a_message).is_err());
        // A count claiming more than the body holds allocates nothing.
        let mut huge = vec![1u8, 0, 0, 0, 0, 0, 0];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_request(&huge).is_err());
        for reply in [
            encode_reply(&Ok(7)),
            encode_reply(&Err(BrokerError::NotFound("q".into()))),
        ] {
            for end in 0..reply.len() {
                assert!(decode_reply(&reply[..end]).is_err(), "reply prefix {end}");
            }
        }
        // Arbitrary bytes: no panic.
        let mut seed = 0x1234_5678_u64;
        for len in 0..200 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    (seed >> 56) as u8
                })
                .collect();
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
        }
    }
}
