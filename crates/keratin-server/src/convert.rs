//! Conversions between wire types (`keratin-proto`) and broker types (`keratin-broker`).

use keratin_broker::{Message, Overflow, QueueSettings};
use keratin_proto::frame::{self, Update};

fn overflow_from_wire(o: frame::Overflow) -> Overflow {
    match o {
        frame::Overflow::Reject => Overflow::Reject,
        frame::Overflow::DropOldest => Overflow::DropOldest,
    }
}

fn overflow_to_wire(o: Overflow) -> frame::Overflow {
    match o {
        Overflow::Reject => frame::Overflow::Reject,
        Overflow::DropOldest => frame::Overflow::DropOldest,
    }
}

/// Broker settings from declared wire settings.
pub fn settings_from_wire(s: &frame::QueueSettings) -> QueueSettings {
    QueueSettings {
        partitions: s.partitions,
        dead_letter: s.dead_letter.clone(),
        max_deliveries: s.max_deliveries,
        max_messages: s.max_messages,
        max_bytes: s.max_bytes,
        overflow: s.overflow.map(overflow_from_wire),
        replicas: s.replicas,
    }
}

/// Wire settings from broker settings.
pub fn settings_to_wire(s: &QueueSettings) -> frame::QueueSettings {
    frame::QueueSettings {
        partitions: s.partitions,
        dead_letter: s.dead_letter.clone(),
        max_deliveries: s.max_deliveries,
        max_messages: s.max_messages,
        max_bytes: s.max_bytes,
        overflow: s.overflow.map(overflow_to_wire),
        replicas: s.replicas,
    }
}

fn update<T>(current: Option<T>, update: Update<T>) -> Option<T> {
    match update {
        Update::Keep => current,
        Update::Clear => None,
        Update::Set(value) => Some(value),
    }
}

/// The settings after a wire update of a live queue.
pub fn apply_update(current: &QueueSettings, u: frame::QueueSettingsUpdate) -> QueueSettings {
    QueueSettings {
        partitions: current.partitions,
        dead_letter: update(current.dead_letter.clone(), u.dead_letter),
        max_deliveries: update(current.max_deliveries, u.max_deliveries),
        max_messages: update(current.max_messages, u.max_messages),
        max_bytes: update(current.max_bytes, u.max_bytes),
        overflow: update(current.overflow, u.overflow.map_to(overflow_from_wire)),
        replicas: current.replicas,
    }
}

trait MapUpdate<T> {
    fn map_to<U>(self, f: impl FnOnce(T) -> U) -> Update<U>;
}

impl<T> MapUpdate<T> for Update<T> {
    fn map_to<U>(self, f: impl FnOnce(T) -> U) -> Update<U> {
        match self {
            Update::Keep => Update::Keep,
            Update::Clear => Update::Clear,
            Update::Set(v) => Update::Set(f(v)),
        }
    }
}

/// A wire partition info from the broker's: counts, and who leads it.
pub fn partition_info_to_wire(p: &keratin_broker::PartitionInfo) -> frame::PartitionInfo {
    frame::PartitionInfo {
        ready: p.ready,
        inflight: p.inflight,
        bytes: p.bytes,
        disk_bytes: p.disk_bytes,
        leading: p.leading,
        leader: p.leader,
        leader_addr: p.leader_addr.clone(),
    }
}

/// A broker message from a published wire message of `producer_id`'s frame: it carries the
/// producer's mark when the frame names a producer and the message a sequence.
pub fn message_from_wire(m: frame::Message, producer_id: Option<u64>) -> Message {
    let producer = match (producer_id, m.sequence) {
        (Some(producer), Some(sequence)) => {
            Some(keratin_broker::ProducerSeq { producer, sequence })
        }
        _ => None,
    };
    Message {
        routing_key: m.routing_key.unwrap_or_default(),
        headers: m.headers.into_iter().map(|h| (h.name, h.value)).collect(),
        body: m.body.to_vec(),
        producer,
    }
}
