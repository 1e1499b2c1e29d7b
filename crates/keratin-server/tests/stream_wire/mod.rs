//! Wire helpers of the stream tests (protocol version 7, raw frames): a node, a connection,
//! requests, publishes with keys, subscriptions and what readers receive.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use keratin_proto::frame::*;
use keratin_proto::stream::*;
use keratin_proto::{ClientHello, FrameCodec, ServerHello};
use keratin_server::config::Config;
use keratin_server::Node;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, FramedParts};

pub type Conn = Framed<TcpStream, FrameCodec>;

pub async fn start(dir: &tempfile::TempDir) -> Node {
    start_with(dir, |_| {}).await
}

/// [`start`], with `tweak` applied to the configuration last.
pub async fn start_with(dir: &tempfile::TempDir, tweak: impl FnOnce(&mut Config)) -> Node {
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    crate::common::host_disk_limits(&mut config);
    tweak(&mut config);
    Node::start(&config).await.expect("start node")
}

pub async fn connect(addr: SocketAddr, version: u16) -> Conn {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut out = BytesMut::new();
    let mut hello = ClientHello::new("stream-test");
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

pub async fn next(conn: &mut Conn) -> Frame {
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

/// Whether a frame other than a heartbeat comes within `wait`.
pub async fn quiet_for(conn: &mut Conn, wait: Duration) -> Option<Frame> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, conn.next()).await {
            Err(_) => return None,
            Ok(Some(Ok(Frame::Heartbeat))) => continue,
            Ok(other) => return Some(other.expect("open").expect("valid")),
        }
    }
}

pub async fn request(conn: &mut Conn, frame: Frame) -> Frame {
    conn.send(frame).await.expect("send");
    next(conn).await
}

pub fn error_code(frame: &Frame) -> u16 {
    match frame {
        Frame::Error(e) => e.error.code().0,
        other => panic!("expected an error, got {other:?}"),
    }
}

pub async fn declare(conn: &mut Conn, stream: &str, settings: StreamSettings) {
    let answer = request(
        conn,
        Frame::StreamDeclare(StreamDeclare {
            request_id: 1,
            stream: stream.into(),
            settings,
            nodes: Vec::new(),
        }),
    )
    .await;
    assert_eq!(answer, Frame::Ok(OkReply { request_id: 1 }));
}

/// Publishes `count` messages keyed `key-{i % keys}` with bodies `{i}`, all confirmed.
pub async fn publish(conn: &mut Conn, stream: &str, from: u64, count: u64, keys: u64) {
    let messages = (from..from + count)
        .map(|i| Message {
            publish_id: i + 1,
            routing_key: Some(format!("key-{}", i % keys)),
            headers: vec![Header {
                name: "n".into(),
                value: i.to_string(),
            }],
            body: Bytes::from(i.to_string()),
            sequence: None,
        })
        .collect();
    conn.send(Frame::Publish(Publish {
        queue: stream.into(),
        mode: PublishMode::Confirmed,
        messages,
        joinable: false,
        producer_id: None,
    }))
    .await
    .expect("publish");
    let mut confirmed = 0;
    while confirmed < count {
        match next(conn).await {
            Frame::Confirm(c) => {
                confirmed += c.ranges.iter().map(|r| r.last - r.first + 1).sum::<u64>()
            }
            other => panic!("expected confirms, got {other:?}"),
        }
    }
}

pub fn subscribe(
    tag: &str,
    stream: &str,
    cursor: Option<&str>,
    start: StreamStart,
    credit: u32,
    auto_commit: bool,
) -> Frame {
    Frame::StreamSubscribe(StreamSubscribe {
        request_id: 9,
        stream: stream.into(),
        consumer_tag: tag.into(),
        cursor: cursor.map(str::to_string),
        group: false,
        start,
        credit,
        auto_commit,
        partitions: Vec::new(),
    })
}

/// Receives `count` messages of reader `tag`: (partition, offset, body) in arrival order.
pub async fn receive(
    conn: &mut Conn,
    tag: &str,
    count: usize,
) -> Vec<(u32, u64, String, Option<String>)> {
    let mut out = Vec::new();
    while out.len() < count {
        match next(conn).await {
            Frame::StreamDeliver(d) => {
                assert_eq!(d.consumer_tag, tag);
                assert!(d.messages.len() <= STREAM_DELIVER_MESSAGES_MAX);
                for m in d.messages {
                    out.push((
                        d.partition,
                        m.offset,
                        String::from_utf8(m.body.to_vec()).expect("utf-8"),
                        m.routing_key,
                    ));
                }
            }
            other => panic!("expected StreamDeliver, got {other:?}"),
        }
    }
    out
}
