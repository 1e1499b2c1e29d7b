//! A scripted fake broker for the client's tests: it accepts one connection, answers the
//! handshake, then runs a test's script against the framed socket. Built on `keratin-proto`
//! only, so the client is tested against the protocol, not against a particular server.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the fake"
)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use keratin_client::{Client, ClientOptions, PROTOCOL_VERSION_OFFERED};
use keratin_proto::codes::ERR_BAD_REQUEST;
use keratin_proto::{
    ClientHello, ErrorBody, Frame, FrameCodec, PublishIdRange, ServerHello, ServerInfo,
    PROTOCOL_VERSION, PROTOCOL_VERSION_MIN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::codec::{Framed, FramedParts};

/// Longest any single wait in a test may take before the test fails instead of hanging.
pub const TEST_WAIT: Duration = Duration::from_secs(10);

/// The broker's side of one connection.
pub struct FakeConn {
    framed: Framed<TcpStream, FrameCodec>,
    /// Heartbeats received (and skipped) by [`FakeConn::recv`].
    pub heartbeats: usize,
}

/// Starts a fake broker that runs `script` on its first connection; returns its address and
/// the script's task (join it to see the script's assertions fail).
pub async fn start<F, Fut>(script: F) -> (SocketAddr, JoinHandle<()>)
where
    F: FnOnce(FakeConn) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("fake broker I/O");
    let addr = listener.local_addr().expect("fake broker I/O");
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("fake broker I/O");
        let hello = read_client_hello(&mut stream).await;
        assert_eq!(hello.client_name, "test-client");
        let mut answer = BytesMut::new();
        let accepted = accept(&hello);
        accepted.encode(&mut answer).expect("fake broker I/O");
        stream.write_all(&answer).await.expect("fake broker I/O");
        let ServerHello::Accepted { version, .. } = accepted else {
            panic!(
                "the client offered protocol version {}, which the fake refuses",
                hello.version
            );
        };
        let codec = FrameCodec::new().with_version(version);
        let parts = FramedParts::new::<Frame>(stream, codec);
        let conn = FakeConn {
            framed: Framed::from_parts(parts),
            heartbeats: 0,
        };
        script(conn).await;
    });
    (addr, task)
}

/// The fake's answer to `hello`: accepted in the client's version when it is one the client
/// offers (up to [`keratin_client::PROTOCOL_VERSION_OFFERED`], streams' version 7 included,
/// which `ServerHello::answer` refuses while `keratin-proto` names 6), else refused as
/// `ServerHello::answer` does.
pub fn accept(hello: &ClientHello) -> ServerHello {
    if (PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION_OFFERED).contains(&hello.version) {
        let lowered = ClientHello {
            version: hello.version.min(PROTOCOL_VERSION),
            ..hello.clone()
        };
        if let ServerHello::Accepted {
            node_id,
            info,
            user,
            ..
        } = ServerHello::answer(&lowered, "fake-node", ServerInfo::default())
        {
            return ServerHello::Accepted {
                version: hello.version,
                node_id,
                info,
                user,
            };
        }
    }
    ServerHello::answer(hello, "fake-node", ServerInfo::default())
}

/// A fake broker speaking protocol `version` only, as a node older than this client would:
/// it refuses any other version with a 400 naming its own, and accepts `version`, answering
/// `Heartbeat` and `Close` in kind. Returns its address and how many connections it accepted.
pub async fn start_old(version: u16) -> (SocketAddr, Arc<AtomicUsize>) {
    let (addr, accepted, _) = start_old_counting(version).await;
    (addr, accepted)
}

/// [`start_old`], also counting the frames its connections received other than `Heartbeat`
/// and `Close` (the third value).
pub async fn start_old_counting(version: u16) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("fake broker I/O");
    let addr = listener.local_addr().expect("fake broker I/O");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    let frames = Arc::new(AtomicUsize::new(0));
    let frames_seen = Arc::clone(&frames);
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.expect("fake broker I/O");
            count.fetch_add(1, Ordering::SeqCst);
            let hello = read_client_hello(&mut stream).await;
            let mut answer = BytesMut::new();
            if hello.version != version {
                let error = ErrorBody::new(
                    ERR_BAD_REQUEST,
                    format!("protocol version {} is not supported", hello.version),
                );
                ServerHello::Refused { version, error }
                    .encode(&mut answer)
                    .expect("fake broker I/O");
                stream.write_all(&answer).await.expect("fake broker I/O");
                continue;
            }
            ServerHello::answer(&hello, "old-node", ServerInfo::default())
                .encode(&mut answer)
                .expect("fake broker I/O");
            stream.write_all(&answer).await.expect("fake broker I/O");
            let codec = FrameCodec::new().with_version(version);
            let mut framed = Framed::from_parts(FramedParts::new::<Frame>(stream, codec));
            let frames_seen = Arc::clone(&frames_seen);
            tokio::spawn(async move {
                while let Some(Ok(frame)) = framed.next().await {
                    match frame {
                        Frame::Heartbeat => {
                            let _ = framed.send(Frame::Heartbeat).await;
                        }
                        Frame::Close(close) => {
                            let _ = framed.send(Frame::Close(close)).await;
                            break;
                        }
                        _ => {
                            frames_seen.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    (addr, accepted, frames)
}

/// A fake broker that refuses the handshake with `error`, naming a protocol version newer
/// than this client's (so the client has no older version to fall back to).
pub async fn start_refusing(error: ErrorBody) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("fake broker I/O");
    let addr = listener.local_addr().expect("fake broker I/O");
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("fake broker I/O");
        let _ = read_client_hello(&mut stream).await;
        let mut answer = BytesMut::new();
        ServerHello::Refused {
            version: PROTOCOL_VERSION_OFFERED + 1,
            error,
        }
        .encode(&mut answer)
        .expect("fake broker I/O");
        stream.write_all(&answer).await.expect("fake broker I/O");
    });
    addr
}

/// A fake broker that checks logins: it reads the hello of its first connection, answers it
/// with `answer(&hello)` and, if that accepted, runs `script`. The task returns the hello.
pub async fn start_login<A, F, Fut>(answer: A, script: F) -> (SocketAddr, JoinHandle<ClientHello>)
where
    A: FnOnce(&ClientHello) -> ServerHello + Send + 'static,
    F: FnOnce(FakeConn) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("fake broker I/O");
    let addr = listener.local_addr().expect("fake broker I/O");
    let task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("fake broker I/O");
        let hello = read_client_hello(&mut stream).await;
        let answer = answer(&hello);
        let mut bytes = BytesMut::new();
        answer.encode(&mut bytes).expect("fake broker I/O");
        stream.write_all(&bytes).await.expect("fake broker I/O");
        if let ServerHello::Accepted { version, .. } = answer {
            let codec = FrameCodec::new().with_version(version);
            let parts = FramedParts::new::<Frame>(stream, codec);
            let conn = FakeConn {
                framed: Framed::from_parts(parts),
                heartbeats: 0,
            };
            script(conn).await;
        }
        hello
    });
    (addr, task)
}

/// An accepted answer to `hello` that names `user` as the logged-in user.
pub fn accepted_as(hello: &ClientHello, user: &str) -> ServerHello {
    ServerHello::Accepted {
        version: hello.version,
        node_id: "fake-node".into(),
        info: ServerInfo::default(),
        user: Some(user.into()),
    }
}

async fn read_client_hello(stream: &mut TcpStream) -> ClientHello {
    let mut buf = BytesMut::new();
    loop {
        if let Some(hello) = ClientHello::decode(&mut buf).expect("fake broker I/O") {
            return hello;
        }
        assert_ne!(
            stream.read_buf(&mut buf).await.expect("fake broker I/O"),
            0,
            "eof in hello"
        );
    }
}

/// Options for tests: the fake's expected name, short timeouts.
pub fn options() -> ClientOptions {
    ClientOptions {
        name: "test-client".into(),
        request_timeout: Duration::from_secs(5),
        publish_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    }
}

/// Connects a client with `options` to `addr`.
pub async fn connect(addr: SocketAddr, options: ClientOptions) -> Client {
    tokio::time::timeout(TEST_WAIT, Client::connect(addr, options))
        .await
        .expect("connect timed out")
        .expect("connect failed")
}

impl FakeConn {
    /// The next frame other than `Heartbeat`, or `None` at end of stream.
    pub async fn recv(&mut self) -> Option<Frame> {
        loop {
            match self.recv_any().await? {
                Frame::Heartbeat => self.heartbeats += 1,
                frame => return Some(frame),
            }
        }
    }

    /// The next frame of any type, or `None` at end of stream.
    pub async fn recv_any(&mut self) -> Option<Frame> {
        let next = tokio::time::timeout(TEST_WAIT, self.framed.next())
            .await
            .expect("the fake broker waited too long for a frame");
        next.map(|frame| frame.expect("the client sent a malformed frame"))
    }

    /// The next non-heartbeat frame, if one arrives within `wait`.
    pub async fn recv_within(&mut self, wait: Duration) -> Option<Frame> {
        tokio::time::timeout(wait, self.recv()).await.ok().flatten()
    }

    /// Sends a frame to the client.
    pub async fn send(&mut self, frame: Frame) {
        self.framed.send(frame).await.expect("fake broker I/O");
    }

    /// Receives the next frame, which must be a `Publish`.
    pub async fn expect_publish(&mut self) -> keratin_proto::Publish {
        match self.recv().await {
            Some(Frame::Publish(publish)) => publish,
            other => panic!("expected Publish, got {other:?}"),
        }
    }

    /// Answers a `Confirm` for one publish id.
    pub async fn confirm(&mut self, publish_id: u64) {
        let ranges = vec![PublishIdRange::single(publish_id)];
        self.send(Frame::Confirm(keratin_proto::Confirm { ranges }))
            .await;
    }

    /// Answers a `PublishError` for one publish id.
    pub async fn publish_error(&mut self, publish_id: u64, error: ErrorBody) {
        let ranges = vec![PublishIdRange::single(publish_id)];
        self.send(Frame::PublishError(keratin_proto::PublishError {
            ranges,
            error,
        }))
        .await;
    }

    /// Reads until the client's `Close` (answering it in kind) or the end of the stream.
    pub async fn until_close(&mut self) {
        while let Some(frame) = self.recv().await {
            if let Frame::Close(close) = frame {
                self.send(Frame::Close(close)).await;
                return;
            }
        }
    }

    /// Answers `Ok` to a request.
    pub async fn ok(&mut self, request_id: u64) {
        self.send(Frame::Ok(keratin_proto::OkReply { request_id }))
            .await;
    }
}
