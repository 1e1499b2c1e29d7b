//! `DeadLetterSink`: where a partition sends the messages it dead-letters (rejected, past
//! `max_deliveries`, dropped by `drop_oldest`). An interface because the dead-letter queue's
//! partitions may be led by another node once partitions replicate; the owner reads the
//! payloads, adds the `x-death-*` headers, hands them here, and settles the originals as
//! dead-lettered (all delivered) or dropped (any failed; each failure counted).
//!
//! `LocalDeadLetters` (in `broker.rs`, since it is the broker's own publish) is the single-node
//! path: an internal publish into the dead-letter queue through this node's broker (never held
//! back by the publish gate, bound by the queue limits).

use std::future::Future;
use std::pin::Pin;

use crate::error::BrokerResult;
use crate::record::Message;

/// The outcomes of a dead-lettering publish, one per message, in order.
pub type DeadLettering = Pin<Box<dyn Future<Output = Vec<BrokerResult<()>>> + Send>>;

/// Where dead-lettered messages go.
pub trait DeadLetterSink: Send + Sync + 'static {
    /// False once the node is going away: dead-lettering is not tried, the messages are
    /// dropped at once (and not counted as failures).
    fn is_open(&self) -> bool;

    /// Publish `messages` into dead-letter queue `queue`, with the internal publish's rules:
    /// not held back by the node's resource gate, refused when the queue is full (`reject`).
    /// Never blocks; the future may wait for the commit.
    fn publish(&self, queue: &str, messages: Vec<Message>) -> DeadLettering;
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::broker::LocalDeadLetters;
    use crate::error::BrokerError;

    /// Without a broker nothing is tried: the owner drops at once, and a publish already on its
    /// way fails message by message (each failure is counted).
    #[tokio::test]
    async fn a_sink_without_its_broker_is_closed_and_fails_each_message() {
        let sink = LocalDeadLetters::new(Weak::new());
        assert!(!sink.is_open());
        let results = sink
            .publish("dlq", vec![Message::new("a"), Message::new("b")])
            .await;
        assert_eq!(results.len(), 2);
        assert!(results
            .iter()
            .all(|r| matches!(r, Err(BrokerError::Closed(_)))));
    }
}
