//! Connection-level behaviour against a scripted fake broker: a refused handshake shows the
//! broker's message; losing the connection mid-publish settles everything as the crate docs
//! promise (confirmed publish → outcome unknown, request → connection lost, buffered → dropped
//! path, consumer stream → ends); an idle client sends heartbeats; a silent broker counts as
//! lost. Logins: the hello carries the credentials (on a redirect to a leader too), the
//! user the broker names is kept, a 401 refusal is an error with code 401 that says what to
//! check, and credentials are never sent to a node too old to check them. A client that hung,
//! lied about an outcome, never heartbeated or dropped its login fails these tests.

mod fake;

use std::time::Duration;

use futures_util::StreamExt;
use keratin_client::{
    BufferedOptions, Client, ClientError, ClientOptions, Credentials, OutgoingMessage,
};
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_UNAUTHENTICATED};
use keratin_proto::{Auth, ErrorBody, ErrorFrame, Frame, ServerHello, SubscribeOk};

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
        conn.until_close().await
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

fn with_credentials(credentials: Credentials) -> ClientOptions {
    ClientOptions {
        credentials: Some(credentials),
        ..fake::options()
    }
}

/// Each kind of credentials goes out as its mechanism in a version 6 hello, and the user the
/// broker names is what `Client::user` says.
#[tokio::test]
async fn the_hello_carries_the_credentials_and_the_user_is_kept() {
    let token = format!("kt_{}", "1f".repeat(32));
    let cases = [
        (
            Credentials::Password {
                user: "bob".into(),
                password: "secret".into(),
            },
            Auth::Plain {
                user: "bob".into(),
                password: "secret".into(),
            },
        ),
        (Credentials::Token(token.clone()), Auth::Token(token)),
    ];
    for (credentials, auth) in cases {
        let (addr, server) = fake::start_login(
            |hello| fake::accepted_as(hello, "bob"),
            |mut conn| async move { conn.until_close().await },
        )
        .await;
        let client = fake::connect(addr, with_credentials(credentials)).await;
        assert_eq!(client.user(), Some("bob"));
        assert_eq!(
            client.protocol_version(),
            keratin_client::PROTOCOL_VERSION_OFFERED
        );
        client.close().await;
        let hello = server.await.expect("fake broker");
        // A login needs version 6 or later; the client offers its newest (streams' 7).
        assert_eq!(hello.version, keratin_client::PROTOCOL_VERSION_OFFERED);
        assert!(hello.version >= keratin_proto::AUTH_VERSION);
        assert_eq!(hello.auth, auth);
    }

    // Without credentials: mechanism 0, and no user.
    let (addr, server) =
        fake::start_login(
            fake::accept,
            |mut conn| async move { conn.until_close().await },
        )
        .await;
    let client = fake::connect(addr, fake::options()).await;
    assert_eq!(client.user(), None);
    client.close().await;
    assert_eq!(server.await.expect("fake broker").auth, Auth::None);
}

/// A broker that refuses the login answers 401: the error keeps the code and the broker's
/// retry hint, says what to check, and the client does not try another version.
#[tokio::test]
async fn a_refused_login_is_an_error_with_code_401() {
    let (addr, server) = fake::start_login(
        |hello| ServerHello::Refused {
            version: hello.version,
            error: ErrorBody::new(ERR_UNAUTHENTICATED, "wrong user or password")
                .with_retry_after_ms(2000),
        },
        |_| async {},
    )
    .await;
    let credentials = Credentials::Password {
        user: "bob".into(),
        password: "wrong".into(),
    };
    let error = Client::connect(addr, with_credentials(credentials))
        .await
        .unwrap_err();
    assert!(matches!(error, ClientError::Refused { .. }), "{error:?}");
    assert_eq!(error.code(), Some(401));
    let shown = error.to_string();
    assert!(shown.contains("refused the login"), "{shown}");
    assert!(shown.contains("wrong user or password"), "{shown}");
    assert!(
        shown.contains("--user/--password (KERATIN_USER, KERATIN_PASSWORD)"),
        "{shown}"
    );
    assert!(shown.contains("[retry after 2000 ms]"), "{shown}");
    assert!(!shown.contains("wrong\""), "no password in {shown}");
    assert!(matches!(
        server.await.expect("fake broker").auth,
        Auth::Plain { .. }
    ));
}

/// A node that speaks only version 5 cannot check a login: the client refuses to connect
/// without it, after the one refused attempt, and says why.
#[tokio::test]
async fn credentials_are_not_dropped_for_an_older_node() {
    let (addr, accepted) = fake::start_old(5).await;
    let error = Client::connect(addr, with_credentials(Credentials::Token("kt_x".into())))
        .await
        .unwrap_err();
    assert!(
        matches!(error, ClientError::LoginUnsupported { server_version: 5 }),
        "{error:?}"
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);

    // And a certificate login without a certificate is refused before connecting.
    let error = Client::connect(addr, with_credentials(Credentials::Certificate))
        .await
        .unwrap_err();
    assert!(matches!(error, ClientError::InvalidArgument(_)), "{error}");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A node that is not the leader names another (421): the client's connection to that node
/// logs in with the same credentials.
#[tokio::test]
async fn following_a_leader_logs_in_again() {
    let (leader, leader_task) = fake::start_login(
        |hello| fake::accepted_as(hello, "bob"),
        |mut conn| async move {
            let Some(Frame::Declare(declare)) = conn.recv().await else {
                panic!("expected Declare at the leader");
            };
            conn.ok(declare.request_id).await;
            conn.until_close().await
        },
    )
    .await;
    let leader_addr = leader.to_string();
    let (follower, follower_task) = fake::start_login(
        |hello| fake::accepted_as(hello, "bob"),
        |mut conn| async move {
            let Some(Frame::Declare(declare)) = conn.recv().await else {
                panic!("expected Declare");
            };
            conn.send(Frame::Error(ErrorFrame {
                request_id: Some(declare.request_id),
                fatal: false,
                error: ErrorBody::not_leader(Some(leader_addr), "led elsewhere"),
            }))
            .await;
            conn.until_close().await
        },
    )
    .await;
    let credentials = Credentials::Password {
        user: "bob".into(),
        password: "secret".into(),
    };
    let client = fake::connect(follower, with_credentials(credentials)).await;
    tokio::time::timeout(
        fake::TEST_WAIT,
        client.declare("q", keratin_proto::QueueSettings::default()),
    )
    .await
    .expect("declare timed out")
    .expect("declare at the leader");
    client.close().await;
    drop(client);
    let expected = Auth::Plain {
        user: "bob".into(),
        password: "secret".into(),
    };
    let leader_hello = tokio::time::timeout(fake::TEST_WAIT, leader_task)
        .await
        .expect("the leader's connection ends")
        .expect("fake leader");
    assert_eq!(leader_hello.auth, expected);
    assert_eq!(follower_task.await.expect("fake node").auth, expected);
}
