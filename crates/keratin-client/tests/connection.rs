//! Connection-level behaviour against a scripted fake broker: a refused handshake shows the
//! broker's message; losing the connection mid-publish settles everything as the crate docs
//! promise (confirmed publish → outcome unknown, request → connection lost, buffered → dropped
//! path, consumer stream → ends); an idle client sends heartbeats; a silent broker counts as
//! lost. A client that hung, lied about an outcome or never heartbeated fails these tests.

mod fake;

use std::time::Duration;

use futures_util::StreamExt;
use keratin_client::{BufferedOptions, Client, ClientError, ClientOptions, OutgoingMessage};
use keratin_proto::codes::ERR_BAD_REQUEST;
use keratin_proto::{ErrorBody, Frame, SubscribeOk};

#[tokio::test]
async fn a_refused_handshake_shows_the_brokers_message() {
    let error = ErrorBody::new(ERR_BAD_REQUEST, "protocol version 3 is not supported here");
    let addr = fake::start_refusing(error).await;
    let error = Client::connect(addr, fake::options()).await.unwrap_err();
    assert!(matches!(error, ClientError::Refused { .. }));
    assert_eq!(error.code(), Some(400));
    assert!(error
        .to_string()
        .contains("protocol version 3 is not supported here"));
}

/// A node of an older protocol version (a rolling upgrade) refuses our version naming its own;
/// the client connects again in that version and works.
#[tokio::test]
async fn a_node_of_an_older_version_is_spoken_to_in_its_version() {
    let (addr, accepted) = fake::start_old(2).await;
    let client = fake::connect(addr, fake::options()).await;
    assert_eq!(client.protocol_version(), 2);
    assert_eq!(client.node_id(), "old-node");
    assert_eq!(*client.server_info(), keratin_proto::ServerInfo::default());
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(client.is_connected());
    client.close().await;

    // Version 0 is older than any this client speaks: refused, no second attempt.
    let (addr, accepted) = fake::start_old(0).await;
    let error = Client::connect(addr, fake::options()).await.unwrap_err();
    assert!(
        matches!(
            error,
            ClientError::Refused {
                server_version: 0,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn losing_the_connection_settles_everything_as_documented() {
    let (addr, server) = fake::start(|mut conn| async move {
        let Some(Frame::Subscribe(subscribe)) = conn.recv().await else {
            panic!("expected Subscribe");
        };
        conn.send(Frame::SubscribeOk(SubscribeOk {
            request_id: subscribe.request_id,
            consumer_tag: subscribe.consumer_tag,
        }))
        .await;
        // A confirmed publish, a buffered one (and its barrier), and a declare: then drop.
        let mut seen = (false, false, false);
        while !(seen.0 && seen.1 && seen.2) {
            match conn.recv().await {
                Some(Frame::Publish(publish)) => match publish.mode {
                    keratin_proto::PublishMode::Confirmed => seen.0 = true,
                    keratin_proto::PublishMode::Buffered => seen.1 = true,
                },
                Some(Frame::Declare(_)) => seen.2 = true,
                Some(Frame::QueueList(_)) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        drop(conn);
    })
    .await;
    let client = fake::connect(addr, fake::options()).await;
    let mut consumer = client.subscribe("orders", 5).await.unwrap();
    let (publisher, mut dropped) = client.buffered_publisher("orders", BufferedOptions::default());
    publisher
        .send(OutgoingMessage::new("buffered"))
        .await
        .unwrap();
    let publishing = client.publish("orders", OutgoingMessage::new("confirmed"));
    let declaring = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.declare("other", Default::default()).await
    };
    let (published, declared) = tokio::join!(publishing, declaring);
    server.await.unwrap();

    let failed = published.unwrap_err();
    assert!(matches!(
        failed.error,
        ClientError::OutcomeUnknown { error: None, .. }
    ));
    assert!(failed.to_string().contains("may or may not be durable"));
    assert!(matches!(declared, Err(ClientError::ConnectionLost { .. })));
    let report = dropped.recv().await.expect("buffered message reported");
    assert_eq!(report.message.body.as_ref(), b"buffered");
    assert!(matches!(report.error, ClientError::OutcomeUnknown { .. }));
    assert!(
        consumer.next().await.is_none(),
        "the consumer's stream ends"
    );
    assert!(!client.is_connected());
    let later = client.list().await.unwrap_err();
    assert!(matches!(later, ClientError::ConnectionLost { .. }));
    assert!(
        later.to_string().contains("closed the connection"),
        "{later}"
    );
    assert!(publisher.send(OutgoingMessage::new("late")).await.is_err());
    assert!(publisher.flush().await.is_err());
}

#[tokio::test]
async fn an_idle_client_sends_heartbeats() {
    let (addr, server) = fake::start(|mut conn| async move {
        let mut heartbeats = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(600);
        while tokio::time::Instant::now() < deadline {
            match tokio::time::timeout_at(deadline, conn.recv_any()).await {
                Ok(Some(Frame::Heartbeat)) => heartbeats += 1,
                Ok(other) => panic!("unexpected {other:?}"),
                Err(_) => break,
            }
            // Keep the client from counting the broker as silent.
            conn.send(Frame::Heartbeat).await;
        }
        // 100 ms interval over 600 ms: about 5; scheduling may cost one or two.
        assert!((3..=7).contains(&heartbeats), "{heartbeats} heartbeats");
    })
    .await;
    let options = ClientOptions {
        heartbeat_interval: Duration::from_millis(100),
        ..fake::options()
    };
    let client = fake::connect(addr, options).await;
    server.await.unwrap();
    drop(client);
}

#[tokio::test]
async fn a_silent_broker_counts_as_lost() {
    let (addr, server) = fake::start(|mut conn| async move {
        // Read everything, answer nothing, until the client gives up and closes.
        while conn.recv().await.is_some() {}
    })
    .await;
    let options = ClientOptions {
        server_silence_timeout: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(100),
        ..fake::options()
    };
    let client = fake::connect(addr, options).await;
    let error = client.list().await.unwrap_err();
    assert!(
        matches!(error, ClientError::ConnectionLost { .. }),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("no frame from the broker for 300 ms"),
        "{error}"
    );
    drop(client);
    server.await.unwrap();
}
