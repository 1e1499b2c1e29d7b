//! The protocol server in process, spoken to with raw frames: a round trip, and bad input
//! (random bytes, truncated and oversize frames, unknown types, a client that never reads).
//! Each bad client gets its error and its connection closed while another client keeps being
//! served; a failure means the server crashed, answered wrongly, or stopped serving others.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use keratin_proto::frame::*;
use keratin_proto::{ClientHello, FrameCodec, ServerHello};
use keratin_server::config::Config;
use keratin_server::Node;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, FramedParts};

async fn start(dir: &tempfile::TempDir) -> Node {
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    common::host_disk_limits(&mut config);
    Node::start(&config).await.expect("start node")
}

async fn connect(addr: SocketAddr) -> Framed<TcpStream, FrameCodec> {
    connect_version(addr, keratin_proto::PROTOCOL_VERSION).await
}

/// A raw connection that speaks protocol `version`.
async fn connect_version(addr: SocketAddr, version: u16) -> Framed<TcpStream, FrameCodec> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut out = BytesMut::new();
    let mut hello = ClientHello::new("test");
    hello.version = version;
    hello.encode(&mut out).expect("hello");
    stream.write_all(&out).await.expect("send hello");
    let mut buf = BytesMut::new();
    loop {
        if let Some(answer) = ServerHello::decode(&mut buf).expect("server hello") {
            assert!(
                matches!(answer, ServerHello::Accepted { version: v, .. } if v == version),
                "{answer:?}"
            );
            break;
        }
        let n = stream.read_buf(&mut buf).await.expect("read hello");
        assert!(n > 0, "server closed during the handshake");
    }
    let mut parts = FramedParts::new::<Frame>(stream, FrameCodec::new().with_version(version));
    parts.read_buf = buf;
    Framed::from_parts(parts)
}

/// The next frame that is not a heartbeat.
async fn next(conn: &mut Framed<TcpStream, FrameCodec>) -> Frame {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), conn.next())
            .await
            .expect("a frame within 10 s")
            .expect("connection open")
            .expect("valid frame");
        if frame != Frame::Heartbeat {
            return frame;
        }
    }
}

fn message(id: u64, body: &[u8]) -> Message {
    Message {
        publish_id: id,
        routing_key: None,
        headers: vec![],
        body: Bytes::copy_from_slice(body),
        sequence: None,
    }
}

async fn declare(conn: &mut Framed<TcpStream, FrameCodec>, queue: &str) {
    conn.send(Frame::Declare(Declare {
        request_id: 1,
        queue: queue.into(),
        settings: QueueSettings::default(),
        nodes: Vec::new(),
    }))
    .await
    .expect("send");
    assert_eq!(next(conn).await, Frame::Ok(OkReply { request_id: 1 }));
}

/// A good client still works: publish confirmed, receive, ack.
async fn assert_serves(addr: SocketAddr, queue: &str) {
    let mut conn = connect(addr).await;
    declare(&mut conn, queue).await;
    conn.send(Frame::Publish(Publish {
        queue: queue.into(),
        mode: PublishMode::Confirmed,
        messages: vec![message(7, b"still serving")],
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("publish");
    assert_eq!(
        next(&mut conn).await,
        Frame::Confirm(Confirm {
            ranges: vec![PublishIdRange::single(7)]
        })
    );
}

/// Read until the server closes; returns the frames it sent before.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return all,
            Ok(Ok(n)) => all.extend_from_slice(&buf[..n]),
            Err(_) => panic!("server did not close the connection"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_with_raw_frames() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let mut conn = connect(node.protocol_addr()).await;
    declare(&mut conn, "q").await;
    conn.send(Frame::Publish(Publish {
        queue: "q".into(),
        mode: PublishMode::Confirmed,
        messages: (1..=5)
            .map(|i| message(i, format!("m{i}").as_bytes()))
            .collect(),
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("publish");
    assert_eq!(
        next(&mut conn).await,
        Frame::Confirm(Confirm {
            ranges: vec![PublishIdRange { first: 1, last: 5 }]
        })
    );
    conn.send(Frame::Publish(Publish {
        queue: "missing".into(),
        mode: PublishMode::Buffered,
        messages: vec![message(9, b"x")],
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("publish");
    match next(&mut conn).await {
        Frame::PublishError(e) => {
            assert_eq!(e.error.code().0, 404);
            assert!(e.error.message().contains("missing"), "{}", e.error);
        }
        other => panic!("{other:?}"),
    }
    conn.send(Frame::Subscribe(Subscribe {
        request_id: 2,
        queue: "q".into(),
        prefetch: 10,
        consumer_tag: "c".into(),
        prefetch_bytes: 0,
    }))
    .await
    .expect("subscribe");
    assert!(matches!(next(&mut conn).await, Frame::SubscribeOk(_)));
    let mut ids = Vec::new();
    for i in 1..=5 {
        match next(&mut conn).await {
            Frame::Deliver(d) => {
                assert_eq!(d.body, Bytes::from(format!("m{i}")));
                ids.push(d.delivery_id);
            }
            other => panic!("{other:?}"),
        }
    }
    conn.send(Frame::Ack(Ack {
        delivery_ids: ids.clone(),
    }))
    .await
    .expect("ack");
    conn.send(Frame::Ack(Ack {
        delivery_ids: vec![ids[0]],
    }))
    .await
    .expect("ack again");
    match next(&mut conn).await {
        Frame::Error(e) => {
            assert!(!e.fatal);
            assert_eq!(e.error.code().0, 404);
        }
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let info = node.broker().info("q").expect("info");
    assert_eq!((info.ready(), info.inflight()), (0, 0));
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_error_and_others_are_served() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let addr = node.protocol_addr();

    // Random bytes instead of a handshake: closed without an answer.
    let mut raw = TcpStream::connect(addr).await.expect("connect");
    raw.write_all(b"GET / HTTP/1.1\r\n\r\nrandom garbage")
        .await
        .expect("write");
    assert!(read_until_closed(&mut raw).await.is_empty());
    assert_serves(addr, "a").await;

    // An oversize length prefix: 413, fatal, closed — before the body arrives.
    let mut conn = connect(addr).await;
    let stream = conn.get_mut();
    stream
        .write_all(&(64u32 << 20).to_le_bytes())
        .await
        .expect("write");
    stream.write_all(&[0x10]).await.expect("write");
    match next(&mut conn).await {
        Frame::Error(e) => {
            assert!(e.fatal);
            assert_eq!(e.error.code().0, 413);
        }
        other => panic!("{other:?}"),
    }
    assert!(conn.next().await.is_none(), "closed after a fatal error");
    assert_serves(addr, "b").await;

    // An unknown frame type: 400, fatal, closed.
    let mut conn = connect(addr).await;
    let stream = conn.get_mut();
    stream.write_all(&2u32.to_le_bytes()).await.expect("write");
    stream.write_all(&[0x7e, 0x00]).await.expect("write");
    match next(&mut conn).await {
        Frame::Error(e) => {
            assert!(e.fatal);
            assert_eq!(e.error.code().0, 400);
        }
        other => panic!("{other:?}"),
    }
    assert_serves(addr, "c").await;

    // A malformed body of a known type: 400, fatal.
    let mut conn = connect(addr).await;
    let stream = conn.get_mut();
    stream.write_all(&4u32.to_le_bytes()).await.expect("write");
    stream
        .write_all(&[0x01, 0xff, 0xff, 0xff])
        .await
        .expect("write");
    match next(&mut conn).await {
        Frame::Error(e) => assert!(e.fatal && e.error.code().0 == 400, "{e:?}"),
        other => panic!("{other:?}"),
    }

    // A truncated frame, then the client goes away: nothing breaks.
    let mut conn = connect(addr).await;
    conn.get_mut()
        .write_all(&100u32.to_le_bytes())
        .await
        .expect("write");
    drop(conn);

    // A server-to-client frame sent by a client: non-fatal 400, the connection stays.
    let mut conn = connect(addr).await;
    conn.send(Frame::Confirm(Confirm { ranges: vec![] }))
        .await
        .expect("send");
    match next(&mut conn).await {
        Frame::Error(e) => assert!(!e.fatal && e.error.code().0 == 400),
        other => panic!("{other:?}"),
    }
    declare(&mut conn, "d").await;
    assert_serves(addr, "e").await;
    node.shutdown().await.expect("shutdown");
}

/// Resident memory of this process, from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("resident pages");
    pages * 4096
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_held_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let addr = node.protocol_addr();
    let mut setup = connect(addr).await;
    declare(&mut setup, "flood").await;
    // A client that subscribes and publishes a lot, and never reads a byte.
    let mut conn = connect(addr).await;
    conn.send(Frame::Subscribe(Subscribe {
        request_id: 3,
        queue: "flood".into(),
        prefetch: 1000,
        consumer_tag: "never-reads".into(),
        prefetch_bytes: 0,
    }))
    .await
    .expect("subscribe");
    let before = rss_bytes();
    let body = vec![7u8; 4096];
    let mut sent_bytes = 0u64;
    let flood = async {
        for batch in 0..4000u64 {
            let frame = Frame::Publish(Publish {
                queue: "flood".into(),
                mode: PublishMode::Confirmed,
                messages: (0..16).map(|i| message(batch * 16 + i, &body)).collect(),
                joinable: false,
                producer_id: None,
            });
            if conn.send(frame).await.is_err() {
                break;
            }
            sent_bytes += 16 * 4096;
        }
    };
    // Publishes keep being confirmed (the confirms are small and fit the socket buffers);
    // deliveries are what a non-reading client cannot absorb.
    let _ = tokio::time::timeout(Duration::from_secs(8), flood).await;
    let grown = rss_bytes().saturating_sub(before);
    let info = node.broker().info("flood").expect("info");
    assert!(sent_bytes > 0);
    assert!(
        info.inflight() <= 1000,
        "deliveries beyond the prefetch: {}",
        info.inflight()
    );
    // More was published than the consumer's prefetch: the rest waits, ready. (How much is
    // published in 8 s depends on the disk and the load; 2,000 is far below any run seen.)
    assert!(
        info.ready() > 1_000,
        "the unread consumer holds the backlog back: {info:?}"
    );
    eprintln!(
        "accepted {} MiB from a client that never reads; RSS grew {} MiB",
        sent_bytes >> 20,
        grown >> 20
    );
    assert!(
        grown < 128 << 20,
        "memory grew by {} MiB for a client that never reads",
        grown >> 20
    );
    // Others are served meanwhile.
    assert_serves(addr, "other").await;
    drop(conn);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_one_process_stay_apart() {
    let dir_a = tempfile::tempdir().expect("tmp");
    let dir_b = tempfile::tempdir().expect("tmp");
    let a = start(&dir_a).await;
    let b = start(&dir_b).await;
    assert_serves(a.protocol_addr(), "only-on-a").await;
    let mut conn = connect(b.protocol_addr()).await;
    conn.send(Frame::QueueList(QueueList { request_id: 5 }))
        .await
        .expect("list");
    match next(&mut conn).await {
        Frame::QueueListReply(r) => assert!(r.queues.is_empty(), "{r:?}"),
        other => panic!("{other:?}"),
    }
    assert!(a.broker().info("only-on-a").is_ok());
    assert!(b.broker().info("only-on-a").is_err());
    assert!(a.broker().pool().filesystems()[0]
        .spares_dir
        .starts_with(dir_a.path()));
    assert!(b.broker().pool().filesystems()[0]
        .spares_dir
        .starts_with(dir_b.path()));
    a.shutdown().await.expect("shutdown a");
    b.shutdown().await.expect("shutdown b");
}

/// Publish ids answered by `Confirm` and by `PublishError` (with its error key), until `count`
/// ids have an answer.
async fn answers(
    conn: &mut Framed<TcpStream, FrameCodec>,
    count: usize,
) -> (Vec<u64>, Vec<(u64, String)>) {
    let (mut confirmed, mut failed) = (Vec::new(), Vec::new());
    while confirmed.len() + failed.len() < count {
        match next(conn).await {
            Frame::Confirm(c) => {
                for range in c.ranges {
                    confirmed.extend(range.first..=range.last);
                }
            }
            Frame::PublishError(e) => {
                for range in e.ranges {
                    for id in range.first..=range.last {
                        failed.push((id, format!("{}", e.error.code().0)));
                    }
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    confirmed.sort_unstable();
    (confirmed, failed)
}

/// A joinable frame (separate publishes the client joined) is admitted message by message under
/// a queue's limits; a plain batch stays all or nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joinable_publishes_are_admitted_one_by_one_under_queue_limits() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    for queue in ["joined", "batch"] {
        node.broker()
            .declare(
                queue,
                keratin_broker::QueueSettings {
                    max_messages: Some(3),
                    ..keratin_broker::QueueSettings::default()
                },
            )
            .await
            .expect("declare");
    }
    let mut conn = connect(node.protocol_addr()).await;
    let four = |first: u64| (first..first + 4).map(|id| message(id, b"m")).collect();
    conn.send(Frame::Publish(Publish {
        queue: "joined".into(),
        mode: PublishMode::Confirmed,
        messages: four(1),
        joinable: true,
        producer_id: None,
    }))
    .await
    .expect("send");
    let (confirmed, failed) = answers(&mut conn, 4).await;
    assert_eq!(confirmed, vec![1, 2, 3], "three fit, each on its own");
    assert_eq!(
        failed,
        vec![(4, "429".to_string())],
        "the fourth is refused"
    );

    conn.send(Frame::Publish(Publish {
        queue: "batch".into(),
        mode: PublishMode::Confirmed,
        messages: four(11),
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("send");
    let (confirmed, failed) = answers(&mut conn, 4).await;
    assert!(
        confirmed.is_empty(),
        "a batch that cannot fit is refused whole"
    );
    assert_eq!(failed.len(), 4);
    node.shutdown().await.expect("shutdown");
}

/// A version 1 client (no `Subscribe.prefetch_bytes`) is still accepted in version 1 and
/// consumes; a version 2 client's byte prefetch holds deliveries back until it acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_clients_keep_working_and_version_2_bounds_bytes() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let mut old = connect_version(node.protocol_addr(), 1).await;
    declare(&mut old, "q").await;
    old.send(Frame::Publish(Publish {
        queue: "q".into(),
        mode: PublishMode::Confirmed,
        messages: (1..=4).map(|i| message(i, &[b'x'; 1000])).collect(),
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("publish");
    assert!(matches!(next(&mut old).await, Frame::Confirm(_)));
    old.send(Frame::Subscribe(Subscribe {
        request_id: 2,
        queue: "q".into(),
        prefetch: 1,
        consumer_tag: "c".into(),
        prefetch_bytes: 0,
    }))
    .await
    .expect("subscribe");
    assert!(matches!(next(&mut old).await, Frame::SubscribeOk(_)));
    let Frame::Deliver(first) = next(&mut old).await else {
        panic!("a delivery");
    };
    old.send(Frame::Close(Close {
        message: "bye".into(),
    }))
    .await
    .expect("close");
    drop(old);

    let mut new = connect(node.protocol_addr()).await;
    new.send(Frame::Subscribe(Subscribe {
        request_id: 3,
        queue: "q".into(),
        prefetch: 100,
        consumer_tag: "c2".into(),
        prefetch_bytes: 2500,
    }))
    .await
    .expect("subscribe");
    assert!(matches!(next(&mut new).await, Frame::SubscribeOk(_)));
    let mut ids = Vec::new();
    for _ in 0..2 {
        match next(&mut new).await {
            Frame::Deliver(d) => ids.push(d.delivery_id),
            other => panic!("{other:?}"),
        }
    }
    // Two 1,000-byte bodies (plus their encoding) fill 2,500 bytes: the third waits for an ack.
    let third = tokio::time::timeout(Duration::from_millis(300), new.next()).await;
    assert!(
        !matches!(third, Ok(Some(Ok(Frame::Deliver(_))))),
        "a third delivery beyond prefetch_bytes: {third:?}"
    );
    new.send(Frame::Ack(Ack {
        delivery_ids: vec![ids[0]],
    }))
    .await
    .expect("ack");
    assert!(matches!(next(&mut new).await, Frame::Deliver(_)));
    let _ = first;
    node.shutdown().await.expect("shutdown");
}

/// What a client's behaviour can make the server hold is bounded per connection: at most
/// 1,024 consumers and 262,144 unacknowledged deliveries (summed prefetch) per connection, and
/// at most `server.connections_max` connections; a refused subscribe or connection leaves the
/// others served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_and_connections_are_bounded() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    config.server.connections_max = 2;
    common::host_disk_limits(&mut config);
    let node = Node::start(&config).await.expect("start node");
    let addr = node.protocol_addr();
    let mut conn = connect(addr).await;
    declare(&mut conn, "q").await;
    let subscribe = |request_id: u64, prefetch: u32| {
        Frame::Subscribe(Subscribe {
            request_id,
            queue: "q".into(),
            prefetch,
            consumer_tag: format!("c{request_id}"),
            prefetch_bytes: 0,
        })
    };
    // 4 consumers at 65,535 fill the 262,144 (4 x 65,535 = 262,140); a fifth at 5 does not fit.
    for id in 10..14 {
        conn.send(subscribe(id, 65_535)).await.expect("send");
        assert!(matches!(next(&mut conn).await, Frame::SubscribeOk(_)));
    }
    conn.send(subscribe(14, 5)).await.expect("send");
    match next(&mut conn).await {
        Frame::Error(e) => {
            assert_eq!(e.request_id, Some(14));
            assert_eq!(e.error.code().0, 400);
            assert!(e.error.message().contains("262144"), "{}", e.error);
        }
        other => panic!("{other:?}"),
    }
    conn.send(subscribe(15, 4)).await.expect("send");
    assert!(matches!(next(&mut conn).await, Frame::SubscribeOk(_)));
    // Up to 1,024 consumers, then refused.
    let mut small = connect(addr).await;
    for id in 0..1024u64 {
        small.send(subscribe(100 + id, 1)).await.expect("send");
    }
    for _ in 0..1024 {
        assert!(matches!(next(&mut small).await, Frame::SubscribeOk(_)));
    }
    small.send(subscribe(5000, 1)).await.expect("send");
    match next(&mut small).await {
        Frame::Error(e) => assert!(e.error.message().contains("1024 consumers"), "{}", e.error),
        other => panic!("{other:?}"),
    }
    // A third connection is refused in the handshake (429 `connections`) and closed; the first
    // two are still served.
    let mut third = TcpStream::connect(addr).await.expect("connect");
    let mut out = BytesMut::new();
    ClientHello::new("third").encode(&mut out).expect("hello");
    let _ = third.write_all(&out).await;
    let mut answer = BytesMut::from(&read_until_closed(&mut third).await[..]);
    match ServerHello::decode(&mut answer).expect("server hello") {
        Some(ServerHello::Refused { error, .. }) => {
            assert_eq!(error.code().0, 429, "{error}");
            assert_eq!(
                error.reason(),
                Some(&keratin_proto::LimitReason::Connections)
            );
            assert!(error.retry_after_ms().is_some_and(|ms| ms > 0), "{error}");
            assert!(
                error.message().contains("server.connections_max"),
                "{error}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    small
        .send(Frame::QueueList(QueueList { request_id: 9 }))
        .await
        .expect("send");
    assert!(matches!(next(&mut small).await, Frame::QueueListReply(_)));
    drop(small);
    // Once one closes, a new connection is accepted.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut out = BytesMut::new();
        ClientHello::new("again").encode(&mut out).expect("hello");
        let _ = stream.write_all(&out).await;
        let mut buf = [0u8; 4];
        if matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never accepted again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(conn);
    node.shutdown().await.expect("shutdown");
}

/// The largest prefetch the client lets through is one the server accepts, and one more is
/// refused by both: the client without a round trip, the server with a 400. A client whose
/// bound was above the server's failed the first subscribe with the server's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_and_the_server_agree_on_the_largest_prefetch() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let options = keratin_client::ClientOptions {
        name: "prefetch-bound".into(),
        ..keratin_client::ClientOptions::default()
    };
    let client = keratin_client::Client::connect(node.protocol_addr(), options)
        .await
        .expect("connect");
    client
        .declare("q", keratin_client::QueueSettings::default())
        .await
        .expect("declare");
    let largest = keratin_client::PREFETCH_MAX;
    let consumer = client
        .subscribe("q", largest)
        .await
        .expect("the server accepts the largest prefetch the client allows");
    drop(consumer);
    let above = client.subscribe("q", largest + 1).await;
    assert!(
        matches!(above, Err(keratin_client::ClientError::InvalidArgument(_))),
        "the client refuses a prefetch above its bound itself: {above:?}"
    );
    client.close().await;

    let mut conn = connect(node.protocol_addr()).await;
    conn.send(Frame::Subscribe(Subscribe {
        request_id: 5,
        queue: "q".into(),
        prefetch: largest + 1,
        consumer_tag: "above".into(),
        prefetch_bytes: 0,
    }))
    .await
    .expect("subscribe");
    match next(&mut conn).await {
        Frame::Error(e) => {
            assert_eq!((e.request_id, e.fatal), (Some(5), false));
            assert_eq!(e.error.code().0, 400, "{}", e.error);
        }
        other => panic!("a prefetch above the bound was not refused: {other:?}"),
    }
    node.shutdown().await.expect("shutdown");
}

/// A joinable frame whose middle message can never fit a segment (the test node's segments
/// are 1 MiB) fails that message alone, with 413; its neighbours are separate publishes and
/// are confirmed. A plain batch stays all or nothing per partition. Before, the too-large
/// record failed the joined batch's append, and every message in it got the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_too_large_for_a_segment_fails_alone_in_a_joinable_frame() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(&dir).await;
    let mut conn = connect(node.protocol_addr()).await;
    declare(&mut conn, "q").await;
    let too_large = vec![0u8; 3 << 19]; // 1.5 MiB: fits a frame, not a 1 MiB segment.
    let three = |first: u64| {
        vec![
            message(first, b"small"),
            message(first + 1, &too_large),
            message(first + 2, b"small too"),
        ]
    };
    conn.send(Frame::Publish(Publish {
        queue: "q".into(),
        mode: PublishMode::Confirmed,
        messages: three(1),
        joinable: true,
        producer_id: None,
    }))
    .await
    .expect("send");
    let (confirmed, failed) = answers(&mut conn, 3).await;
    assert_eq!(
        (confirmed, failed),
        (vec![1, 3], vec![(2, "413".to_string())]),
        "only the message too large for a segment fails"
    );

    conn.send(Frame::Publish(Publish {
        queue: "q".into(),
        mode: PublishMode::Confirmed,
        messages: three(11),
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("send");
    let (confirmed, failed) = answers(&mut conn, 3).await;
    assert!(confirmed.is_empty(), "a plain batch is all or nothing");
    let codes: Vec<&str> = failed.iter().map(|(_, code)| code.as_str()).collect();
    assert_eq!(codes, ["413"; 3], "failed whole, as too large");
    assert_eq!(node.broker().info("q").expect("info").ready(), 2);
    node.shutdown().await.expect("shutdown");
}
