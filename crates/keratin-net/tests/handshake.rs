//! Refusals at the door and hostile bytes: a node of another cluster is refused with a clear
//! reason visible in the dialer's liveness view and its calls' `Unreachable` error; a raw socket
//! sending garbage, an unknown node id, an oversize length prefix or random bytes after a valid
//! hello gets a refusal or an `Error` frame naming the problem and a closed connection, and the
//! node keeps serving. Would fail on a panic, on a hang (the deadline), or on an unclear error.

mod common;

use std::net::SocketAddr;

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use keratin_net::codes;
use keratin_net::frame::Frame;
use keratin_net::handshake::{Hello, HelloReply, PROTOCOL_VERSION};
use keratin_net::{GroupId, NetError, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_cluster_is_refused() {
    within(20 * SECOND, async {
        let (l1, l2) = (bind().await, bind().await);
        let nodes = [
            (1, l1.local_addr().expect("raw socket step")),
            (2, l2.local_addr().expect("raw socket step")),
        ];
        let t1 = Transport::start_on(l1, cluster(1, &nodes, "blue"), fast_options(), Echo::new(1))
            .expect("raw socket step");
        let t2 = Transport::start_on(
            l2,
            cluster(2, &nodes, "green"),
            fast_options(),
            Echo::new(2),
        )
        .expect("raw socket step");
        assert!(eventually(5 * SECOND, || t2.stats().handshakes_refused > 0).await);
        assert!(
            eventually(5 * SECOND, || t1
                .peer_status(2)
                .expect("raw socket step")
                .last_error
                .is_some())
            .await
        );
        let error = t1
            .peer_status(2)
            .expect("raw socket step")
            .last_error
            .expect("raw socket step");
        assert!(
            error.contains("refused") && error.contains("'green', not 'blue'"),
            "{error}"
        );
        match t1.call(2, GroupId(1), 0, Bytes::new(), SECOND).await {
            Err(NetError::Unreachable { reason, .. }) => {
                assert!(reason.contains("green"), "{reason}")
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
        assert!(!t2.peer_status(1).expect("raw socket step").connected);
    })
    .await;
}

/// Node 2 of a pair whose node 1 is a raw socket of the test.
async fn lone_node() -> (Transport, SocketAddr) {
    let (l1, l2) = (bind().await, bind().await);
    let nodes = [
        (1, l1.local_addr().expect("raw socket step")),
        (2, l2.local_addr().expect("raw socket step")),
    ];
    let addr = nodes[1].1;
    let t2 = Transport::start_on(l2, cluster(2, &nodes, "test"), fast_options(), Echo::new(2))
        .expect("raw socket step");
    (t2, addr)
}

async fn hello_as(addr: SocketAddr, from: u64, cluster: &str) -> (TcpStream, HelloReply) {
    let mut stream = TcpStream::connect(addr).await.expect("raw socket step");
    let hello = Hello {
        version: PROTOCOL_VERSION,
        from,
        to: 2,
        cluster: cluster.to_string(),
    };
    stream
        .write_all(&hello.encode())
        .await
        .expect("raw socket step");
    let reply = HelloReply::read(&mut stream)
        .await
        .expect("raw socket step");
    (stream, reply)
}

/// Reads until the peer closes; returns the frames it sent (pings included).
async fn frames_until_close(stream: &mut TcpStream) -> Vec<Frame> {
    let mut bytes = Vec::new();
    stream
        .read_to_end(&mut bytes)
        .await
        .expect("raw socket step");
    let mut bytes = BytesMut::from(&bytes[..]);
    let mut frames = Vec::new();
    while let Ok(Some(size)) = Frame::check(&bytes, u32::MAX) {
        frames.push(Frame::decode(bytes.split_to(size).freeze()).expect("raw socket step"));
    }
    frames
}

fn error_frame(frames: &[Frame]) -> keratin_net::RemoteError {
    frames
        .iter()
        .find_map(|frame| match frame {
            Frame::Error(error) => Some(error.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Error frame in {frames:?}"))
}

async fn still_serves(addr: SocketAddr) {
    let (mut stream, reply) = hello_as(addr, 1, "test").await;
    assert_eq!(reply.outcome, Ok(()));
    let request = Frame::Request {
        request_id: 5,
        group: GroupId(3),
        kind: 1,
        body: Bytes::from_static(b"x"),
    };
    let encoded = request.encode();
    stream
        .write_all(&encoded.head)
        .await
        .expect("raw socket step");
    stream
        .write_all(&encoded.tail)
        .await
        .expect("raw socket step");
    let mut buffer = BytesMut::new();
    loop {
        stream.read_buf(&mut buffer).await.expect("raw socket step");
        if let Some(size) = Frame::check(&buffer, u32::MAX).expect("raw socket step") {
            match Frame::decode(buffer.split_to(size).freeze()).expect("raw socket step") {
                Frame::Response {
                    request_id: 5,
                    body,
                } => {
                    assert_eq!(&body[..], b"2<-1:3:1:x");
                    return;
                }
                Frame::Ping { .. } => continue,
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_hello_gets_a_clear_refusal() {
    within(20 * SECOND, async {
        let (t2, addr) = lone_node().await;
        let mut stream = TcpStream::connect(addr).await.expect("raw socket step");
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("raw socket step");
        let reply = HelloReply::read(&mut stream)
            .await
            .expect("raw socket step");
        let error = reply.outcome.unwrap_err();
        assert_eq!(error.code, codes::BAD_MAGIC);
        assert!(error.message.contains("KRCL"), "{}", error.message);

        let (_, reply) = hello_as(addr, 3, "test").await;
        assert_eq!(reply.outcome.unwrap_err().code, codes::UNKNOWN_NODE);
        let (_, reply) = hello_as(addr, 1, "other").await;
        assert_eq!(reply.outcome.unwrap_err().code, codes::CLUSTER);
        assert_eq!(t2.stats().handshakes_refused, 3);
        still_serves(addr).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_length_gets_an_error_frame_before_any_allocation() {
    within(20 * SECOND, async {
        let (t2, addr) = lone_node().await;
        let (mut stream, reply) = hello_as(addr, 1, "test").await;
        assert_eq!(reply.outcome, Ok(()));
        // 4 GiB - 1: would be an allocation of that size if the length were trusted.
        stream
            .write_all(&u32::MAX.to_le_bytes())
            .await
            .expect("raw socket step");
        let error = error_frame(&frames_until_close(&mut stream).await);
        assert_eq!(error.code, codes::FRAME_TOO_LARGE);
        assert!(
            error.message.contains("4294967295") && error.message.contains("16842752"),
            "{}",
            error.message
        );
        assert_eq!(t2.stats().protocol_errors, 1);
        let status = t2.peer_status(1).expect("raw socket step");
        assert!(
            !status.connected
                && status
                    .last_error
                    .expect("raw socket step")
                    .contains("exceeds")
        );
        still_serves(addr).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bytes_after_a_hello_never_panic_the_node() {
    within(30 * SECOND, async {
        let (t2, addr) = lone_node().await;
        let mut seed: u64 = std::env::var("KERATIN_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed);
        println!("KERATIN_SEED={seed}");
        for round in 0..20 {
            let (mut stream, reply) = hello_as(addr, 1, "test").await;
            assert_eq!(reply.outcome, Ok(()));
            let mut garbage = BytesMut::new();
            // A plausible small length first, half of the time, so the body decoders are reached.
            if round % 2 == 0 {
                garbage.put_u32_le(40);
                garbage.put_u8([0x01, 0x02, 0x03, 0x10, 0x11, 0x30][round % 6]);
            }
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                garbage.put_u8(seed as u8);
            }
            stream.write_all(&garbage).await.expect("raw socket step");
            let _ = stream.shutdown().await;
            // The node answers with an Error frame or just closes; either way the socket ends.
            let _ = frames_until_close(&mut stream).await;
        }
        assert!(t2.stats().protocol_errors > 0);
        still_serves(addr).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_direction_and_wrong_node_are_refused() {
    within(20 * SECOND, async {
        // Node 2 of three; node 3 must not dial it (only the lower id of a pair dials), and a
        // hello meant for node 5 reached the wrong address.
        let (l1, l2, l3) = (bind().await, bind().await, bind().await);
        let nodes = [
            (1, l1.local_addr().unwrap()),
            (2, l2.local_addr().unwrap()),
            (3, l3.local_addr().unwrap()),
        ];
        let addr = nodes[1].1;
        let t2 = Transport::start_on(l2, cluster(2, &nodes, "test"), fast_options(), Echo::new(2))
            .unwrap();
        let (_, reply) = hello_as(addr, 3, "test").await;
        let error = reply.outcome.unwrap_err();
        assert_eq!(error.code, codes::WRONG_DIRECTION);
        assert!(
            error.message.contains("only the lower id"),
            "{}",
            error.message
        );
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let hello = Hello {
            version: PROTOCOL_VERSION,
            from: 1,
            to: 5,
            cluster: "test".into(),
        };
        stream.write_all(&hello.encode()).await.unwrap();
        let error = HelloReply::read(&mut stream)
            .await
            .unwrap()
            .outcome
            .unwrap_err();
        assert_eq!(error.code, codes::WRONG_NODE);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let hello = Hello {
            version: 9,
            from: 1,
            to: 2,
            cluster: "test".into(),
        };
        stream.write_all(&hello.encode()).await.unwrap();
        let error = HelloReply::read(&mut stream)
            .await
            .unwrap()
            .outcome
            .unwrap_err();
        assert_eq!(error.code, codes::VERSION);
        assert!(
            error
                .message
                .contains(&format!("version {PROTOCOL_VERSION}"))
                && error.message.contains("speaks 9"),
            "{}",
            error.message
        );
        assert_eq!(t2.stats().handshakes_refused, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_dropped_after_the_idle_timeout() {
    within(20 * SECOND, async {
        let (l1, l2) = (bind().await, bind().await);
        let nodes = [(1, l1.local_addr().unwrap()), (2, l2.local_addr().unwrap())];
        let options = keratin_net::TransportOptions {
            ping_interval: std::time::Duration::from_millis(50),
            idle_timeout: std::time::Duration::from_millis(300),
            ..fast_options()
        };
        let t2 =
            Transport::start_on(l2, cluster(2, &nodes, "test"), options, Echo::new(2)).unwrap();
        // Node 1 is this socket: it handshakes, then never sends a byte (not even a pong).
        let (mut stream, reply) = hello_as(nodes[1].1, 1, "test").await;
        assert_eq!(reply.outcome, Ok(()));
        assert!(eventually(5 * SECOND, || t2.peer_status(1).unwrap().connected).await);
        let frames = frames_until_close(&mut stream).await;
        assert!(
            frames.iter().all(|f| matches!(f, Frame::Ping { .. })),
            "{frames:?}"
        );
        let status = t2.peer_status(1).unwrap();
        assert!(!status.connected, "{status:?}");
        assert!(status.last_error.unwrap().contains("idle timeout"));
    })
    .await;
}
