//! Which partition of a queue (or stream) a message goes to, computed as the broker computes it
//! (`keratin-broker` `queue.rs`, `route`), so that the client can send each message to its
//! partition's leader and keep each partition's messages in order: by the CRC32C of its routing
//! key; without one, by its idempotent producer's id plus its sequence's block of
//! [`PRODUCER_SEQUENCE_BLOCK`] (64 consecutive sequences go to one partition, the next 64 to
//! the next); without either the broker chooses (`None` here).
//!
//! Owns only that function and a queue's [`Layout`] (its partition count and each partition's
//! leader, from `QueueInfo` or `StreamInfo`). Where messages are sent belongs to
//! `publish_router.rs`.

use keratin_proto::{PartitionInfo, StreamPartitionInfo};

use crate::publisher::OutgoingMessage;

/// Consecutive sequences of an idempotent producer that go to one partition when they have
/// no routing key: partition `(producer id + sequence / 64) mod partitions`, so that each
/// partition's window of the producer (64 runs of stored sequences) holds whole blocks, its
/// last 64 × 64 = 4,096 sequences there, and a message sent again after an unknown outcome is
/// recognised. The broker's `keratin_broker::PRODUCER_SEQUENCE_BLOCK`, which says why 64;
/// part of the routing contract (`docs/protocol.md`, "Publish").
pub const PRODUCER_SEQUENCE_BLOCK: u64 = 64;

/// The partition of `partitions` that `message` goes to when published by `producer_id` (an
/// idempotent producer's id, `None` for a client that is not one), or `None` when the broker
/// chooses (no routing key, no producer mark).
pub(crate) fn partition_of(
    message: &OutgoingMessage,
    producer_id: Option<u64>,
    partitions: u32,
) -> Option<u32> {
    let n = u64::from(partitions.max(1));
    let choice = match (&message.routing_key, producer_id.zip(message.sequence)) {
        // The broker treats an empty routing key as none.
        (Some(key), _) if !key.is_empty() => u64::from(crc32c::crc32c(key.as_bytes())),
        (_, Some((producer, sequence))) => {
            producer.wrapping_add(sequence / PRODUCER_SEQUENCE_BLOCK)
        }
        _ => return None,
    };
    u32::try_from(choice % n).ok()
}

/// A queue's partitions as one node described them: how many, and each one's leader's
/// protocol address (`None`: no leader known then).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) leaders: Vec<Option<String>>,
}

impl Layout {
    /// From a queue's partition infos, as answered by the node at `answered_by` (its protocol
    /// address; a partition it leads names no `leader_addr`).
    pub(crate) fn of_queue(partitions: &[PartitionInfo], answered_by: Option<&str>) -> Layout {
        Layout {
            leaders: partitions
                .iter()
                .map(|p| leader(p.leading, p.leader_addr.as_deref(), answered_by))
                .collect(),
        }
    }

    /// From a stream's partition infos, as [`Layout::of_queue`].
    pub(crate) fn of_stream(
        partitions: &[StreamPartitionInfo],
        answered_by: Option<&str>,
    ) -> Layout {
        Layout {
            leaders: partitions
                .iter()
                .map(|p| leader(p.leading, p.leader_addr.as_deref(), answered_by))
                .collect(),
        }
    }

    /// The number of partitions (at least 1: a queue has one or more).
    pub(crate) fn partitions(&self) -> u32 {
        u32::try_from(self.leaders.len()).unwrap_or(u32::MAX).max(1)
    }
}

fn leader(leading: bool, leader_addr: Option<&str>, answered_by: Option<&str>) -> Option<String> {
    if leading {
        answered_by.map(str::to_owned)
    } else {
        leader_addr.map(str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_pick_by_crc32c_producers_by_id_plus_sequence_block_else_the_broker() {
        // CRC32C("123456789") is the standard check value 0xE3069283.
        let keyed = OutgoingMessage::new("x").with_routing_key("123456789");
        assert_eq!(partition_of(&keyed, None, 7), Some(0xE306_9283 % 7));
        assert_eq!(
            partition_of(&keyed.clone().with_sequence(5), Some(1), 7),
            Some(0xE306_9283 % 7)
        );
        // Blocks of 64: sequences 0..=63 on (9 + 0) % 3, 64..=127 on (9 + 1) % 3, ...
        let at = |sequence: u64, producer: u64| {
            partition_of(
                &OutgoingMessage::new("x").with_sequence(sequence),
                Some(producer),
                3,
            )
        };
        let picks: Vec<Option<u32>> = [0, 63, 64, 127, 128, 130]
            .iter()
            .map(|&s| at(s, 9))
            .collect();
        assert_eq!(picks, [0, 0, 1, 1, 2, 2].map(Some));
        assert_eq!(at(64, u64::MAX), Some(0), "wraps: u64::MAX + 1 is 0");
        let numbered = OutgoingMessage::new("x").with_sequence(5);
        assert_eq!(
            partition_of(&numbered, None, 3),
            None,
            "no producer: no mark"
        );
        assert_eq!(partition_of(&OutgoingMessage::new("x"), Some(9), 3), None);
        let empty_key = OutgoingMessage::new("x")
            .with_routing_key("")
            .with_sequence(1);
        assert_eq!(
            partition_of(&empty_key.with_sequence(64), Some(1), 3),
            Some(2),
            "an empty key is none"
        );
        assert_eq!(
            partition_of(&numbered, Some(9), 0),
            Some(0),
            "a count of 0 is 1"
        );
    }

    #[test]
    fn a_layout_names_the_answering_node_for_what_it_leads() {
        let info = |leading: bool, addr: Option<&str>| PartitionInfo {
            ready: 0,
            inflight: 0,
            bytes: 0,
            disk_bytes: 0,
            leading,
            leader: None,
            leader_addr: addr.map(str::to_owned),
        };
        let layout = Layout::of_queue(
            &[
                info(true, None),
                info(false, Some("b:1")),
                info(false, None),
            ],
            Some("a:1"),
        );
        assert_eq!(
            layout.leaders,
            vec![Some("a:1".to_owned()), Some("b:1".to_owned()), None]
        );
        assert_eq!(layout.partitions(), 3);
    }
}
