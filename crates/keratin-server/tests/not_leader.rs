//! The Rust client following `ERR_NOT_LEADER` (421) between nodes: a fake node written with
//! `keratin-proto`'s codec refuses declares, publishes, info and subscribes with 421 naming a
//! real single node (in process), and the caller sees plain success; a publish batch refused
//! for part of its messages resends only those; a consumer the fake ends with `ConsumerEnd`
//! continues at the real node; and a fake that names no leader makes calls fail within their
//! timeout with `ClientError::NotLeader`. Without the client's redirect handling every call
//! here returns the fake's 421 (or hangs and hits the test deadlines).

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use keratin_client::{Client, ClientError, ClientOptions, OutgoingMessage, QueueSettings};
use keratin_proto::codes::ERR_GATEWAY_TIMEOUT;
use keratin_proto::frame::*;
use keratin_proto::{ClientHello, ErrorBody, FrameCodec, NodeAddress, ServerHello, ServerInfo};
use keratin_server::Node;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, FramedParts};

/// Longest any single wait may take before the test fails instead of hanging.
const TEST_WAIT: Duration = Duration::from_secs(20);

async fn start_node(dir: &tempfile::TempDir) -> Node {
    let config = common::node_config(dir.path());
    Node::start(&config).await.expect("start node")
}

fn options(timeout: Duration) -> ClientOptions {
    ClientOptions {
        name: "test-client".into(),
        request_timeout: timeout,
        publish_timeout: timeout,
        ..ClientOptions::default()
    }
}

/// What a fake node does with the frames of every connection.
type Script = Arc<dyn Fn(Frame) -> Vec<Frame> + Send + Sync>;

/// A fake node: answers every handshake, then each frame with what `script` returns. Frames
/// it received are kept in the returned log.
async fn start_fake(script: Script) -> (SocketAddr, Arc<Mutex<Vec<Frame>>>) {
    start_fake_listing(script, Vec::new()).await
}

/// [`start_fake`], whose handshake lists itself and `others` as the cluster's nodes.
async fn start_fake_listing(
    script: Script,
    others: Vec<NodeAddress>,
) -> (SocketAddr, Arc<Mutex<Vec<Frame>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let info = if others.is_empty() {
        ServerInfo::default()
    } else {
        let mut nodes = vec![NodeAddress {
            node_id: "fake-node".into(),
            server: addr.to_string(),
            admin: None,
        }];
        nodes.extend(others);
        ServerInfo { admin: None, nodes }
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&log);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let script = Arc::clone(&script);
            let seen = Arc::clone(&seen);
            let info = info.clone();
            tokio::spawn(async move {
                let mut framed = fake_handshake(stream, info).await;
                while let Some(Ok(frame)) = framed.next().await {
                    if let Frame::Close(close) = frame {
                        let _ = framed.send(Frame::Close(close)).await;
                        break;
                    }
                    if frame == Frame::Heartbeat {
                        continue;
                    }
                    seen.lock().expect("fake node lock").push(frame.clone());
                    for answer in script(frame) {
                        if framed.send(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, log)
}

async fn fake_handshake(mut stream: TcpStream, info: ServerInfo) -> Framed<TcpStream, FrameCodec> {
    let mut buf = BytesMut::new();
    let hello = loop {
        if let Some(hello) = ClientHello::decode(&mut buf).expect("hello") {
            break hello;
        }
        assert_ne!(stream.read_buf(&mut buf).await.expect("read"), 0);
    };
    let mut answer = BytesMut::new();
    ServerHello::answer(&hello, "fake-node", info)
        .encode(&mut answer)
        .expect("answer");
    stream.write_all(&answer).await.expect("write");
    let mut parts = FramedParts::new::<Frame>(stream, FrameCodec::new());
    parts.read_buf = buf;
    Framed::from_parts(parts)
}

fn not_leader(leader: Option<&str>) -> ErrorBody {
    let body = ErrorBody::not_leader(leader.map(str::to_owned), "not the leader here");
    match leader {
        Some(_) => body,
        None => body.with_retry_after_ms(50),
    }
}

/// 421 for every request, and for every message of a publish, naming `leader`.
fn refuse_all(leader: Option<String>) -> Script {
    Arc::new(move |frame| {
        let error = not_leader(leader.as_deref());
        let request_id = match &frame {
            Frame::Declare(d) => d.request_id,
            Frame::Delete(q) | Frame::Purge(q) | Frame::QueueInfo(q) => q.request_id,
            Frame::SetQueueSettings(s) => s.request_id,
            Frame::Subscribe(s) => s.request_id,
            Frame::Publish(p) => {
                let ranges = p
                    .messages
                    .iter()
                    .map(|m| PublishIdRange::single(m.publish_id))
                    .collect();
                return vec![Frame::PublishError(PublishError { ranges, error })];
            }
            _ => return Vec::new(),
        };
        vec![Frame::Error(ErrorFrame {
            request_id: Some(request_id),
            fatal: false,
            error,
        })]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_refused_with_not_leader_succeed_at_the_named_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_node(&dir).await;
    let leader = node.protocol_addr().to_string();
    let (fake, seen) = start_fake(refuse_all(Some(leader.clone()))).await;
    let client = Client::connect(fake, options(Duration::from_secs(10)))
        .await
        .expect("connect to the fake");

    let work = async {
        client
            .declare("q", QueueSettings::default())
            .await
            .expect("declare follows the redirect");
        let confirmed = client
            .publish("q", OutgoingMessage::new("one"))
            .await
            .expect("publish follows the redirect");
        assert_eq!(confirmed.attempts, 2, "refused once, then confirmed");
        let batch = vec![OutgoingMessage::new("two"), OutgoingMessage::new("three")];
        for result in client.publish_batch("q", batch).await {
            result.expect("batch follows the redirect");
        }
        let info = client.info("q").await.expect("info follows the redirect");
        assert_eq!(info.partitions[0].ready, 3);
        assert!(
            info.partitions[0].leading,
            "the real node leads its partition"
        );
        let mut consumer = client.subscribe("q", 10).await.expect("subscribe follows");
        assert_ne!(consumer.node_id(), "fake-node", "consuming at the leader");
        let delivery = consumer.recv().await.expect("a delivery from the leader");
        assert_eq!(&delivery.body[..], b"one");
        delivery.ack().expect("ack");
        client.purge("q").await.expect("purge follows the redirect");
        drop(consumer);
        client
            .delete("q")
            .await
            .expect("delete follows the redirect");
    };
    tokio::time::timeout(TEST_WAIT, work)
        .await
        .expect("in time");
    assert!(node.broker().info("q").is_err(), "deleted at the leader");
    let asked: Vec<&str> = seen
        .lock()
        .expect("fake node lock")
        .iter()
        .map(|frame| frame.frame_type().name())
        .collect();
    for expected in [
        "Declare",
        "Publish",
        "QueueInfo",
        "Subscribe",
        "Purge",
        "Delete",
    ] {
        assert!(
            asked.contains(&expected),
            "the fake was asked first: {expected}"
        );
    }
    // After the first redirect the client remembers the queue's leader: the batch went there
    // directly.
    let publishes = asked.iter().filter(|name| **name == "Publish").count();
    assert_eq!(
        publishes, 1,
        "publishes after the first redirect skip the fake"
    );
    client.close().await;
    node.shutdown().await.expect("shutdown");
}

/// A batch whose messages went to two partitions, one led by the fake (confirmed there) and
/// one led elsewhere (421): only the refused messages are sent again, to the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_part_of_its_messages_resends_only_those() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_node(&dir).await;
    let leader = node.protocol_addr().to_string();
    let named = leader.clone();
    let script: Script = Arc::new(move |frame| match frame {
        Frame::Publish(publish) => {
            // The message with routing key "here" is led by the fake; the others are not.
            let (here, there): (Vec<_>, Vec<_>) = publish
                .messages
                .iter()
                .partition(|m| m.routing_key.as_deref() == Some("here"));
            let ids = |list: Vec<&Message>| {
                list.iter()
                    .map(|m| PublishIdRange::single(m.publish_id))
                    .collect::<Vec<_>>()
            };
            vec![
                Frame::Confirm(Confirm { ranges: ids(here) }),
                Frame::PublishError(PublishError {
                    ranges: ids(there),
                    error: not_leader(Some(&named)),
                }),
            ]
        }
        Frame::Declare(d) => vec![Frame::Ok(OkReply {
            request_id: d.request_id,
        })],
        _ => Vec::new(),
    });
    let (fake, seen) = start_fake(script).await;
    node.broker()
        .declare("q", Default::default())
        .await
        .expect("declare at the leader");
    let client = Client::connect(fake, options(Duration::from_secs(10)))
        .await
        .expect("connect");
    let batch = vec![
        OutgoingMessage::new("a").with_routing_key("there"),
        OutgoingMessage::new("b").with_routing_key("here"),
        OutgoingMessage::new("c").with_routing_key("there"),
    ];
    let results = tokio::time::timeout(TEST_WAIT, client.publish_batch("q", batch))
        .await
        .expect("in time");
    let attempts: Vec<u32> = results
        .into_iter()
        .map(|result| result.expect("every message confirmed").attempts)
        .collect();
    assert_eq!(attempts, vec![2, 1, 2]);
    let info = node.broker().info("q").expect("info");
    assert_eq!(
        info.ready(),
        2,
        "only the two refused messages reached the leader"
    );
    let publishes = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|frame| matches!(frame, Frame::Publish(_)))
        .count();
    assert_eq!(publishes, 1, "nothing was sent to the fake again");
    client.close().await;
    node.shutdown().await.expect("shutdown");
}

/// The fake accepts a subscription, delivers one message, then ends the consumer with
/// `ConsumerEnd` 421 naming the real node: the same `Consumer` goes on with the real node's
/// messages, and the ack of the fake's delivery went to the fake, not to the new node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_ended_with_not_leader_continues_at_the_leader() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_node(&dir).await;
    let leader = node.protocol_addr().to_string();
    node.broker()
        .declare("q", Default::default())
        .await
        .expect("declare at the leader");
    let publisher = Client::connect(node.protocol_addr(), options(Duration::from_secs(10)))
        .await
        .expect("connect to the node");
    for body in ["x", "y"] {
        publisher
            .publish("q", OutgoingMessage::new(body))
            .await
            .expect("publish at the leader");
    }
    publisher.close().await;

    let named = leader.clone();
    let subscribed = Arc::new(Mutex::new(String::new()));
    let script: Script = Arc::new(move |frame| match frame {
        Frame::Subscribe(subscribe) => {
            subscribed
                .lock()
                .unwrap()
                .clone_from(&subscribe.consumer_tag);
            vec![
                Frame::SubscribeOk(SubscribeOk {
                    request_id: subscribe.request_id,
                    consumer_tag: subscribe.consumer_tag.clone(),
                }),
                Frame::Deliver(Deliver {
                    consumer_tag: subscribe.consumer_tag.clone(),
                    delivery_id: 77,
                    partition: 0,
                    offset: 0,
                    redelivered: false,
                    delivery_count: 1,
                    routing_key: None,
                    headers: Vec::new(),
                    body: bytes::Bytes::from_static(b"from the old leader"),
                }),
            ]
        }
        Frame::Ack(_) => vec![Frame::ConsumerEnd(ConsumerEnd {
            consumer_tag: subscribed.lock().expect("fake node lock").clone(),
            error: not_leader(Some(&named)),
        })],
        _ => Vec::new(),
    });
    let (fake, seen) = start_fake(script).await;
    let client = Client::connect(fake, options(Duration::from_secs(10)))
        .await
        .expect("connect");
    let work = async {
        let mut consumer = client
            .subscribe("q", 10)
            .await
            .expect("subscribe at the fake");
        let tag = consumer.tag().to_owned();
        let first = consumer.recv().await.expect("the fake's delivery");
        assert_eq!(&first.body[..], b"from the old leader");
        assert_eq!(tag, first.consumer_tag);
        first.ack().expect("ack goes to the fake");
        let mut bodies = Vec::new();
        for _ in 0..2 {
            let delivery = consumer.recv().await.expect("deliveries from the leader");
            delivery.ack().expect("ack at the leader");
            bodies.push(String::from_utf8(delivery.body.to_vec()).expect("utf-8"));
        }
        assert_eq!(bodies, vec!["x", "y"]);
        assert_ne!(consumer.node_id(), "fake-node");
        assert!(consumer.end_error().is_none());
    };
    tokio::time::timeout(TEST_WAIT, work)
        .await
        .expect("in time");
    let acks: Vec<Vec<u64>> = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|frame| match frame {
            Frame::Ack(ack) => Some(ack.delivery_ids.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        acks,
        vec![vec![77]],
        "the old delivery's ack went to the old node only"
    );
    client.close().await;
    node.shutdown().await.expect("shutdown");
}

/// A fake that answers 421 without naming a leader, forever: declare and publish fail within
/// their timeout (plus one backoff step) with `ClientError::NotLeader`, after a bounded
/// number of attempts.
#[tokio::test]
async fn not_leader_without_a_leader_fails_within_the_timeout() {
    let (fake, seen) = start_fake(refuse_all(None)).await;
    let timeout = Duration::from_millis(1500);
    let client = Client::connect(fake, options(timeout))
        .await
        .expect("connect");
    let started = Instant::now();
    let error = client
        .declare("q", QueueSettings::default())
        .await
        .expect_err("no leader ever");
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(300),
        "it retried: {elapsed:?}"
    );
    assert!(
        elapsed < timeout + Duration::from_secs(1),
        "bounded: {elapsed:?}"
    );
    match &error {
        ClientError::NotLeader { attempts, last, .. } => {
            assert!(*attempts > 1 && *attempts <= keratin_client::NOT_LEADER_RETRIES_MAX + 1);
            assert_eq!(last.code(), keratin_proto::codes::ERR_NOT_LEADER);
        }
        other => panic!("expected NotLeader, got {other}"),
    }
    assert!(
        error.to_string().contains("no node accepted it as leader"),
        "{error}"
    );

    let started = Instant::now();
    let failed = client
        .publish("q", OutgoingMessage::new("m"))
        .await
        .expect_err("no leader ever");
    assert!(
        matches!(failed.error, ClientError::NotLeader { .. }),
        "{}",
        failed.error
    );
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
    let declares = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|frame| matches!(frame, Frame::Declare(_)))
        .count();
    assert!(declares > 1 && declares <= 33, "{declares} declares sent");
    client.close().await;
}

/// 504 for every message of every publish: a leader cut off from the others answers so once it
/// notices (`LeadershipLost`), its publishes' fate unknown.
fn unknown_outcome() -> Script {
    Arc::new(move |frame| match frame {
        Frame::Publish(p) => {
            let ranges = p
                .messages
                .iter()
                .map(|m| PublishIdRange::single(m.publish_id))
                .collect();
            let error = ErrorBody::new(
                ERR_GATEWAY_TIMEOUT,
                "this node stopped leading the partition while the publish was in flight",
            );
            vec![Frame::PublishError(PublishError { ranges, error })]
        }
        _ => Vec::new(),
    })
}

/// An idempotent producer's publish answered 504 (outcome unknown) by the node it is connected
/// to is sent again, with the same producer mark, to another node of the handshake's list, and
/// confirmed there; a client that is not an idempotent producer gets the 504. Fails if the
/// client gives up at the first 504, or if the retry drops the producer mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_published_again_elsewhere_by_an_idempotent_producer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_node(&dir).await;
    node.broker()
        .declare("q", keratin_broker::QueueSettings::default())
        .await
        .expect("declare at the real node");
    let real = NodeAddress {
        node_id: "real".into(),
        server: node.protocol_addr().to_string(),
        admin: None,
    };
    let (fake, seen) = start_fake_listing(unknown_outcome(), vec![real]).await;

    let client = Client::connect(fake, options(Duration::from_secs(10)))
        .await
        .expect("connect to the fake");
    let confirmed =
        tokio::time::timeout(TEST_WAIT, client.publish("q", OutgoingMessage::new("one")))
            .await
            .expect("in time")
            .expect("published again at the other node");
    assert_eq!(confirmed.attempts, 2, "unknown at the fake, then confirmed");
    let at_fake: Vec<Publish> = seen
        .lock()
        .expect("fake node lock")
        .iter()
        .filter_map(|frame| match frame {
            Frame::Publish(p) => Some(p.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(at_fake.len(), 1, "asked the fake once: {at_fake:?}");
    assert!(
        at_fake[0].producer_id.is_some() && at_fake[0].messages[0].sequence.is_some(),
        "an idempotent producer's publish carries its mark: {at_fake:?}"
    );
    assert_eq!(node.broker().info("q").expect("info").ready(), 1);
    client.close().await;

    let plain = Client::connect(
        fake,
        ClientOptions {
            idempotent: false,
            ..options(Duration::from_secs(10))
        },
    )
    .await
    .expect("connect to the fake");
    let failed = plain
        .publish("q", OutgoingMessage::new("two"))
        .await
        .expect_err("no producer mark: not published again");
    assert!(
        matches!(failed.error, ClientError::OutcomeUnknown { .. }),
        "{failed}"
    );
    assert_eq!(node.broker().info("q").expect("info").ready(), 1);
    plain.close().await;
    node.shutdown().await.expect("shutdown");
}
