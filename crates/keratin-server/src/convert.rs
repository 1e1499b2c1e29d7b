//! Conversions between wire types (`keratin-proto`) and broker types (`keratin-broker`).

use keratin_broker::{Message, QueueSettings};
use keratin_proto::codes::ERR_BAD_REQUEST;
use keratin_proto::frame;
use keratin_proto::ErrorBody;

/// Broker settings from declared wire settings. Per-queue limits are refused until the broker
/// enforces them, rather than accepted and ignored.
pub fn settings_from_wire(s: &frame::QueueSettings) -> Result<QueueSettings, ErrorBody> {
    if s.max_messages.is_some() || s.max_bytes.is_some() || s.overflow.is_some() {
        return Err(ErrorBody::new(
            ERR_BAD_REQUEST,
            "per-queue limits (max_messages, max_bytes, overflow) are not supported by this broker version",
        ));
    }
    Ok(QueueSettings {
        partitions: s.partitions,
        dead_letter: s.dead_letter.clone(),
        max_deliveries: s.max_deliveries,
    })
}

/// Wire settings from broker settings.
pub fn settings_to_wire(s: &QueueSettings) -> frame::QueueSettings {
    frame::QueueSettings {
        partitions: s.partitions,
        dead_letter: s.dead_letter.clone(),
        max_deliveries: s.max_deliveries,
        max_messages: None,
        max_bytes: None,
        overflow: None,
    }
}

/// A broker message from a published wire message.
pub fn message_from_wire(m: frame::Message) -> Message {
    Message {
        routing_key: m.routing_key.unwrap_or_default(),
        headers: m.headers.into_iter().map(|h| (h.name, h.value)).collect(),
        body: m.body.to_vec(),
    }
}
