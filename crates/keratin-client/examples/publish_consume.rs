//! Connects to a broker on the default port, declares a queue, publishes one message with a
//! confirm, consumes it and acknowledges it.
//!
//! Start a broker first (`keratin serve`), then: `cargo run -p keratin-client --example
//! publish_consume`.

use futures_util::StreamExt;
use keratin_client::{Client, ClientError, ClientOptions, OutgoingMessage, QueueSettings};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), ClientError> {
    let options = ClientOptions {
        name: "publish_consume example".into(),
        ..ClientOptions::default()
    };
    let client = Client::connect("127.0.0.1:5680", options).await?;
    client.declare("example", QueueSettings::default()).await?;

    let message = OutgoingMessage::new("hello, keratin").with_header("sent-by", "example");
    match client.publish("example", message).await {
        Ok(confirmed) => println!(
            "confirmed: publish id {} after {} attempt(s); the message is on disk",
            confirmed.publish_id, confirmed.attempts
        ),
        Err(failed) => {
            // `code_key` is "429:disk", "503", ...; the message says what to do.
            eprintln!("publish failed ({:?}): {failed}", failed.error.code_key());
            return Err(failed.into());
        }
    }

    let mut consumer = client.subscribe("example", 10).await?;
    if let Some(delivery) = consumer.next().await {
        println!(
            "received {:?} (partition {}, offset {})",
            String::from_utf8_lossy(&delivery.body),
            delivery.partition,
            delivery.offset
        );
        delivery.ack()?;
    }
    consumer.cancel().await?;
    client.close().await;
    Ok(())
}
