//! The real `keratin serve` binary over TCP, driven by the Rust client and by raw bytes.
//!
//! `a_message_round_trip` walks a message's life: declare with a dead-letter queue, publish
//! confirmed and buffered, read the queue's figures, consume and ack, reject without requeue
//! (the message lands in the dead-letter queue with `x-death-reason: rejected`), reject with
//! requeue (redelivered with `redelivered` set), and delete. It fails if a body is lost, altered
//! or delivered to the wrong place, or if a figure disagrees with what the client holds.
//!
//! `bad_input_is_refused_and_others_keep_being_served` opens 200 connections that send garbage
//! before or after the handshake: random bytes, oversize and zero length prefixes, unknown frame
//! types, malformed bodies, truncated frames followed by a disconnect. Each must get the answer
//! `docs/protocol.md` ("Malformed input") gives it, decoded with `keratin_proto`: a fatal `Error`
//! with 413 or 400 and then the end of the stream, or a close without an answer. Meanwhile a
//! well-behaved client publishes confirmed messages without a single failure, and afterwards
//! the broker is alive and its resident memory has not grown by more than a bound.
//! Random choices come from a seed printed at the start; `KERATIN_SEED=<n>` replays it.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::proto::{
    ClientHello, ErrorFrame, Frame, FrameStatus, Publish, PublishMode, ServerHello,
    FRAME_SIZE_BYTES_MAX,
};
use keratin_client::{
    BufferedOptions, Client, ClientError, ClientOptions, Delivery, OutgoingMessage, QueueSettings,
};
use support::{body, seq_of, with_buffer, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY_BYTES: usize = 200;
/// Bad connections the broker must survive.
const BAD_CONNECTIONS: u64 = 200;
/// How far the broker's resident memory may grow over the bad connections: none of them may
/// make it buffer a claimed frame size (up to 4 GiB), so growth is allocator noise.
const RSS_GROWTH_BYTES_MAX: u64 = 32 << 20;
/// How long a raw connection waits for the broker's answer and close.
const RAW_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long random bytes wait for an answer: they may form a frame that is still incomplete,
/// which rightly gets none.
const RANDOM_READ_TIMEOUT: Duration = Duration::from_millis(500);
/// Most bytes read back from one raw connection: a few `Error` frames at most.
const RAW_READ_BYTES_MAX: usize = 64 * 1024;

fn seed() -> u64 {
    match std::env::var("KERATIN_SEED") {
        Ok(text) => text.trim().parse().expect("KERATIN_SEED is a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    }
}

/// splitmix64: a tiny, seedable generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Random bytes, `len_min` plus up to `len_spread - 1` of them.
    fn bytes(&mut self, len_min: usize, len_spread: u64) -> Vec<u8> {
        let len = len_min + (self.next() % len_spread) as usize;
        (0..len).map(|_| self.next() as u8).collect()
    }
}

fn start_server() -> (tempfile::TempDir, Server) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let server = Server::start(&[
        "serve",
        "--data-dir",
        data.to_str().expect("utf-8 path"),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
    ]);
    (tmp, server)
}

async fn connect(addr: SocketAddr, name: &str) -> Client {
    Client::connect(
        addr,
        ClientOptions {
            name: name.into(),
            publish_timeout: Duration::from_secs(10),
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name}: connect: {e}"))
}

async fn recv(consumer: &mut keratin_client::Consumer, what: &str) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), consumer.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: no delivery within 10 s"))
        .unwrap_or_else(|| panic!("{what}: the consumer ended"))
}

fn header<'a>(delivery: &'a Delivery, name: &str) -> Option<&'a str> {
    delivery
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_str())
}

/// Polls the queue's figures until they are (ready, inflight), or fails after 10 s.
async fn wait_figures(client: &Client, queue: &str, ready: u64, inflight: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = client.info(queue).await.expect("info");
        let got = (
            info.partitions.iter().map(|p| p.ready).sum::<u64>(),
            info.partitions.iter().map(|p| p.inflight).sum::<u64>(),
        );
        if got == (ready, inflight) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{queue}: (ready, inflight) is {got:?}, expected {:?}",
            (ready, inflight)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_round_trip() {
    let (_tmp, mut server) = start_server();
    let client = connect(server.protocol, "round-trip").await;
    client
        .declare("orders-dlq", QueueSettings::default())
        .await
        .expect("declare the dead-letter queue");
    let settings = QueueSettings {
        partitions: 2,
        dead_letter: Some("orders-dlq".into()),
        ..QueueSettings::default()
    };
    client
        .declare("orders", settings.clone())
        .await
        .expect("declare");
    client
        .declare("orders", settings.clone())
        .await
        .expect("declaring again with the same settings succeeds");
    let conflict = client
        .declare("orders", QueueSettings::default())
        .await
        .expect_err("declaring with other settings is a conflict");
    assert_eq!(conflict.code(), Some(409), "{conflict}");

    // Ten confirmed, ten buffered.
    for seq in 0..10 {
        let confirmed = client
            .publish("orders", OutgoingMessage::new(body(seq, BODY_BYTES)))
            .await
            .expect("confirmed publish");
        assert_eq!(confirmed.attempts, 1);
    }
    let (buffered, mut dropped) =
        client.buffered_publisher("orders", BufferedOptions { capacity: 4 });
    for seq in 10..20 {
        buffered
            .send(OutgoingMessage::new(body(seq, BODY_BYTES)).with_header("kind", "buffered"))
            .await
            .expect("buffered send");
    }
    buffered.flush().await.expect("flush");
    assert_eq!(buffered.dropped_count(), 0);
    assert!(dropped.try_recv().is_none(), "nothing dropped");
    wait_figures(&client, "orders", 20, 0).await;
    let info = client.info("orders").await.expect("info");
    assert_eq!(info.settings, settings);
    assert_eq!(info.partitions.len(), 2);

    // Take all twenty and hold them: they are inflight.
    let mut consumer = client.subscribe("orders", 100).await.expect("subscribe");
    let mut held = Vec::new();
    for _ in 0..20 {
        let delivery = recv(&mut consumer, "first delivery").await;
        assert!(!delivery.redelivered);
        assert_eq!(delivery.delivery_count, 1);
        let seq = seq_of(&delivery.body).expect("checksum holds");
        if seq >= 10 {
            assert_eq!(header(&delivery, "kind"), Some("buffered"));
        }
        held.push((seq, delivery));
    }
    held.sort_by_key(|(seq, _)| *seq);
    let seqs: Vec<u64> = held.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, (0..20).collect::<Vec<_>>(), "every message once");
    wait_figures(&client, "orders", 0, 20).await;

    // 0..16 acked, 16 and 17 dead-lettered, 18 and 19 requeued.
    for (seq, delivery) in &held {
        match seq {
            0..=15 => delivery.ack().expect("ack"),
            16 | 17 => delivery.reject(false).expect("reject"),
            _ => delivery.reject(true).expect("requeue"),
        }
    }
    let mut again = BTreeSet::new();
    for _ in 0..2 {
        let delivery = recv(&mut consumer, "redelivery").await;
        assert!(delivery.redelivered, "a requeued message is redelivered");
        assert_eq!(delivery.delivery_count, 2);
        again.insert(seq_of(&delivery.body).expect("checksum holds"));
        delivery.ack().expect("ack the redelivery");
    }
    assert_eq!(again, BTreeSet::from([18, 19]));
    wait_figures(&client, "orders", 0, 0).await;

    let mut dead = client
        .subscribe("orders-dlq", 10)
        .await
        .expect("subscribe dlq");
    let mut dead_seqs = BTreeSet::new();
    for _ in 0..2 {
        let delivery = recv(&mut dead, "dead letter").await;
        assert_eq!(header(&delivery, "x-death-reason"), Some("rejected"));
        assert_eq!(header(&delivery, "x-death-queue"), Some("orders"));
        dead_seqs.insert(seq_of(&delivery.body).expect("checksum holds"));
        delivery.ack().expect("ack dead letter");
    }
    assert_eq!(dead_seqs, BTreeSet::from([16, 17]));
    wait_figures(&client, "orders-dlq", 0, 0).await;

    drop(consumer);
    drop(dead);
    client.delete("orders").await.expect("delete");
    let gone = client
        .info("orders")
        .await
        .expect_err("a deleted queue is gone");
    assert_eq!(gone.code(), Some(404), "{gone}");
    assert!(
        !client
            .list()
            .await
            .expect("list")
            .iter()
            .any(|q| q.queue == "orders"),
        "the list no longer has it"
    );
    client.close().await;
    assert!(server.terminate(Duration::from_secs(20)), "clean stop");
}

/// A raw connection that completed the handshake, and the bytes read past the hello.
async fn raw_handshake(addr: SocketAddr) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.expect("connect raw");
    let mut hello = Default::default();
    ClientHello::new("bad-input")
        .encode(&mut hello)
        .expect("encode hello");
    stream.write_all(&hello).await.expect("send hello");
    let mut buf = Vec::with_capacity(4096);
    let deadline = Instant::now() + RAW_READ_TIMEOUT;
    loop {
        let (answer, rest) = with_buffer(&buf, ServerHello::decode);
        if let Some(answer) = answer.expect("a valid ServerHello") {
            assert!(
                matches!(answer, ServerHello::Accepted { .. }),
                "handshake refused: {answer:?}"
            );
            return (stream, rest);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let read = tokio::time::timeout(left, stream.read_buf(&mut buf))
            .await
            .expect("ServerHello in time")
            .expect("read ServerHello");
        assert!(read > 0, "closed during the handshake");
    }
}

/// How a raw connection ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// End of stream.
    Closed,
    /// Reset by the broker (it closed with our bytes unread).
    Reset,
    /// Still open after the timeout.
    Open,
}

/// Reads until the broker closes (or `timeout` passes) and decodes the frames it sent, leaving
/// out heartbeats (the broker may send one on any idle connection).
async fn read_answer(
    stream: &mut TcpStream,
    mut buf: Vec<u8>,
    timeout: Duration,
) -> (Vec<Frame>, End) {
    let deadline = Instant::now() + timeout;
    let end = loop {
        if buf.len() > RAW_READ_BYTES_MAX {
            panic!("the broker sent more than {RAW_READ_BYTES_MAX} bytes to a bad connection");
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read_buf(&mut buf)).await {
            Err(_) => break End::Open,
            Ok(Ok(0)) => break End::Closed,
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => break End::Reset,
            Ok(Err(e)) => panic!("reading the answer: {e}"),
        }
    };
    let mut frames = Vec::new();
    while let Ok(FrameStatus::Complete { size_bytes }) = Frame::check(&buf, FRAME_SIZE_BYTES_MAX) {
        let frame: Vec<u8> = buf.drain(..size_bytes).collect();
        let frame = Frame::decode(frame.into()).expect("the broker's frames decode");
        if frame != Frame::Heartbeat {
            frames.push(frame);
        }
    }
    assert!(buf.is_empty(), "the broker sent a partial frame: {buf:?}");
    (frames, end)
}

/// Asserts the answer is exactly one fatal `Error` with `code`, followed by the close.
fn expect_fatal(case: &str, frames: &[Frame], end: &End, code: u16) {
    match frames {
        [Frame::Error(ErrorFrame {
            request_id: None,
            fatal: true,
            error,
        })] => {
            assert_eq!(error.code().0, code, "{case}: {error}");
            assert!(!error.message().is_empty(), "{case}: the error says why");
        }
        other => panic!("{case}: expected one fatal Error {code}, got {other:?} then {end:?}"),
    }
    assert_ne!(
        *end,
        End::Open,
        "{case}: the broker closes after a fatal Error"
    );
}

/// What the bad connections saw, for the report.
#[derive(Debug, Default)]
struct BadTally {
    too_large: u64,
    bad_request: u64,
    closed_silently: u64,
    truncated: u64,
    random_undecided: u64,
}

/// One bad connection; `case` picks the kind of garbage.
async fn bad_connection(addr: SocketAddr, case: u64, rng: &mut Rng, tally: &mut BadTally) {
    if case == 0 {
        // Not this protocol at all: the first byte is already not `K`.
        let mut stream = TcpStream::connect(addr).await.expect("connect raw");
        let mut garbage = rng.bytes(1, 256);
        garbage[0] = b'G';
        // The broker may close on the first byte; a failed write is part of that.
        let _ = stream.write_all(&garbage).await;
        let (frames, end) = read_answer(&mut stream, Vec::new(), RAW_READ_TIMEOUT).await;
        assert!(frames.is_empty(), "no answer to a peer without the magic");
        assert_ne!(end, End::Open, "closed on a wrong magic");
        tally.closed_silently += 1;
        return;
    }
    let (mut stream, buf) = raw_handshake(addr).await;
    assert!(buf.is_empty(), "the broker speaks only when spoken to");
    match case {
        1 => {
            // A length prefix over 16 MiB, up to 4 GiB: refused on the 4 length bytes.
            let length =
                FRAME_SIZE_BYTES_MAX + 1 + (rng.next() as u32 % (u32::MAX - FRAME_SIZE_BYTES_MAX));
            stream
                .write_all(&length.to_le_bytes())
                .await
                .expect("send length");
            let (frames, end) = read_answer(&mut stream, buf, RAW_READ_TIMEOUT).await;
            expect_fatal("oversize length prefix", &frames, &end, 413);
            tally.too_large += 1;
        }
        2 => {
            stream.write_all(&[0, 0, 0, 0]).await.expect("send");
            let (frames, end) = read_answer(&mut stream, buf, RAW_READ_TIMEOUT).await;
            expect_fatal("zero length prefix", &frames, &end, 400);
            tally.bad_request += 1;
        }
        3 => {
            // Length 1, type 0x99: no such frame type in version 1.
            stream.write_all(&[1, 0, 0, 0, 0x99]).await.expect("send");
            let (frames, end) = read_answer(&mut stream, buf, RAW_READ_TIMEOUT).await;
            expect_fatal("unknown frame type", &frames, &end, 400);
            tally.bad_request += 1;
        }
        4 => {
            // A Declare (0x01) whose body is random garbage of the stated length.
            let garbage = rng.bytes(10, 64);
            let mut frame = (garbage.len() as u32 + 1).to_le_bytes().to_vec();
            frame.push(0x01);
            frame.extend_from_slice(&garbage);
            // A random body could decode by chance: after the u64 request id, a queue name
            // length of 65,535 runs past the end of the frame instead.
            frame[5 + 8] = 0xff;
            frame[5 + 9] = 0xff;
            stream.write_all(&frame).await.expect("send");
            let (frames, end) = read_answer(&mut stream, buf, RAW_READ_TIMEOUT).await;
            expect_fatal("malformed Declare body", &frames, &end, 400);
            tally.bad_request += 1;
        }
        5 => {
            // The first part of a valid Publish frame, then the client goes away.
            let frame = Frame::Publish(Publish {
                queue: "victim".into(),
                mode: PublishMode::Confirmed,
                messages: vec![keratin_client::proto::Message {
                    publish_id: 1,
                    routing_key: None,
                    headers: Vec::new(),
                    body: body(u64::MAX, 4096).into(),
                    sequence: None,
                }],
                joinable: false,
                producer_id: None,
            });
            let mut encoded = Default::default();
            frame
                .encode(&mut encoded, FRAME_SIZE_BYTES_MAX)
                .expect("encode publish");
            let cut = 1 + (rng.next() as usize % (encoded.len() - 1));
            stream.write_all(&encoded[..cut]).await.expect("send part");
            drop(stream);
            tally.truncated += 1;
        }
        _ => {
            // Pure random bytes after the handshake: almost always an oversize length (413),
            // else an unknown type or a malformed body (400), else a frame still incomplete.
            let garbage = rng.bytes(1, 512);
            let _ = stream.write_all(&garbage).await;
            let (frames, end) = read_answer(&mut stream, buf, RANDOM_READ_TIMEOUT).await;
            match frames.as_slice() {
                [] => tally.random_undecided += 1,
                [Frame::Error(ErrorFrame {
                    fatal: true, error, ..
                })] => {
                    assert!(matches!(error.code().0, 400 | 413), "random bytes: {error}");
                    assert_ne!(end, End::Open, "closed after the fatal Error");
                    if error.code().0 == 413 {
                        tally.too_large += 1;
                    } else {
                        tally.bad_request += 1;
                    }
                }
                // A well-formed frame by chance (a Heartbeat, an Ack of unknown ids): the
                // answers are non-fatal errors and the connection may stay.
                other => {
                    assert!(
                        other.iter().all(|f| matches!(f, Frame::Error(_))),
                        "random bytes got {other:?}"
                    );
                    tally.random_undecided += 1;
                }
            }
        }
    }
}

/// Publishes confirmed messages until `stop`; returns the confirmed seqs and any failures.
async fn good_publisher(client: Client, stop: Arc<AtomicBool>) -> (Vec<u64>, Vec<ClientError>) {
    let mut confirmed = Vec::new();
    let mut failures = Vec::new();
    // Bounded: one publish per loop, each within its publish timeout, at most 1,000,000.
    for seq in 0..1_000_000u64 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        match client
            .publish("good", OutgoingMessage::new(body(seq, BODY_BYTES)))
            .await
        {
            Ok(_) => confirmed.push(seq),
            Err(failed) => failures.push(failed.error),
        }
    }
    (confirmed, failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_and_others_keep_being_served() {
    let seed = seed();
    eprintln!("bad input seed {seed} (replay with KERATIN_SEED={seed})");
    let (_tmp, mut server) = start_server();
    let client = connect(server.protocol, "good-client").await;
    client
        .declare("good", QueueSettings::default())
        .await
        .expect("declare");
    // Warm up, so that the memory baseline includes a working connection and log.
    for seq in 0..200 {
        client
            .publish(
                "good",
                OutgoingMessage::new(body(u64::MAX - seq, BODY_BYTES)),
            )
            .await
            .expect("warm-up publish");
    }
    let rss_before = server.rss_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let publishing = tokio::spawn(good_publisher(client.clone(), stop.clone()));

    let started = Instant::now();
    let mut rng = Rng(seed);
    let mut tally = BadTally::default();
    for index in 0..BAD_CONNECTIONS {
        let case = index % 7;
        bad_connection(server.protocol, case, &mut rng, &mut tally).await;
        assert!(
            server.alive(),
            "the broker died on bad connection {index} (case {case})"
        );
    }
    let elapsed = started.elapsed();
    // Give the broker time to notice the truncated connections' ends.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (confirmed, failures) = tokio::time::timeout(Duration::from_secs(20), publishing)
        .await
        .expect("the good publisher stops")
        .expect("good publisher task");
    let rss_after = server.rss_bytes();
    eprintln!(
        "{BAD_CONNECTIONS} bad connections in {elapsed:?}: {tally:?}; the good client confirmed \
         {} meanwhile; rss {} -> {} KiB",
        confirmed.len(),
        rss_before >> 10,
        rss_after >> 10
    );
    assert!(
        failures.is_empty(),
        "the good client's publishes failed: {failures:?}"
    );
    assert!(confirmed.len() >= 10, "the good client kept publishing");
    assert!(
        tally.too_large >= 20 && tally.bad_request >= 60,
        "{tally:?}"
    );
    assert!(
        rss_after <= rss_before + RSS_GROWTH_BYTES_MAX,
        "resident memory grew from {} to {} KiB",
        rss_before >> 10,
        rss_after >> 10
    );

    // Everything the good client was told is durable is there, intact.
    let mut consumer = client.subscribe("good", 1000).await.expect("subscribe");
    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.len() < confirmed.len() + 200 && Instant::now() < deadline {
        let delivery = recv(&mut consumer, "good message").await;
        seen.insert(seq_of(&delivery.body).expect("checksum holds"));
        delivery.ack().expect("ack");
    }
    assert!(
        confirmed.iter().all(|seq| seen.contains(seq)),
        "every confirmed message of the good client is delivered"
    );
    drop(consumer);
    assert!(server.alive());
    client.close().await;
    assert!(server.terminate(Duration::from_secs(20)), "clean stop");
}
