//! Memory that connections, large frames and consumers take is admitted against the memory
//! limit before it is taken: the real binary in a 512 MiB cgroup v1 memory group (root).
//!
//! - Many clients send 16 MiB frames slowly, together far past the limit: the broker reads
//!   only as many as fit below hard, holds the rest back, answers every one (a confirm, or 429
//!   reason `memory`), is not OOM-killed, and a consumer connected before keeps consuming.
//! - Many consumers at the largest prefetch, never reading: once their bookkeeping would pass
//!   hard, a subscribe and a new connection are refused with 429 `memory` and a retry hint, the
//!   node keeps serving the connections it has, and cancelling gives the memory back.
//! - Many partitions that each saw a burst: their logs' buffers do not stay behind, so memory
//!   falls back below hard and publishes go through again.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_client::proto::{
    ClientHello, ErrorFrame, Frame, FrameStatus, Message, Publish, PublishMode, ServerHello,
    FRAME_SIZE_BYTES_MAX,
};
use keratin_client::{Client, ClientOptions, OutgoingMessage, QueueSettings};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT_BYTES: u64 = 512 << 20;
/// Clients sending a large frame at once: together 1 GiB, twice the cgroup's limit.
const SENDERS: usize = 64;
/// Each sender's frame: a publish of one message of nearly the largest frame.
const FRAME_BODY_BYTES: usize = 16_000_000;
const _: () = assert!((SENDERS * FRAME_BODY_BYTES) as u64 > LIMIT_BYTES);
/// A sender writes its frame in pieces of this size with [`PIECE_PAUSE`] between them, so a
/// frame takes about a second to arrive.
const PIECE_BYTES: usize = 256 << 10;
const PIECE_PAUSE: Duration = Duration::from_millis(15);
/// The cgroup tests run one at a time: each broker gets the whole 512 MiB and both cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn write_config(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("keratin.toml");
    std::fs::write(
        &path,
        format!(
            "[storage]\ndirs = [{:?}]\n\n[limits]\nsample_interval_ms = 100\n",
            dir.join("data").display().to_string()
        ),
    )
    .expect("config");
    path
}

/// A node in a fresh cgroup of [`LIMIT_BYTES`], its data in a temporary directory (kept alive
/// by the caller).
fn start_in_cgroup() -> (MemoryCgroup, tempfile::TempDir, Server) {
    let cgroup = MemoryCgroup::create(LIMIT_BYTES);
    let tmp = tempfile::Builder::new()
        .prefix("keratin-claims")
        .tempdir_in("/var/tmp")
        .expect("tmp");
    let server = Server::start_in_cgroup(&cgroup, &write_config(tmp.path()));
    (cgroup, tmp, server)
}

/// A raw connection after the handshake; `None` if the broker refused it (its error).
async fn raw_connect(addr: std::net::SocketAddr) -> Result<TcpStream, String> {
    let mut stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let mut hello = Default::default();
    ClientHello::new("slow-sender")
        .encode(&mut hello)
        .expect("hello");
    stream.write_all(&hello).await.map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(4096);
    loop {
        let (answer, _rest) = with_buffer(&buf, ServerHello::decode);
        match answer.map_err(|e| e.to_string())? {
            Some(ServerHello::Accepted { .. }) => return Ok(stream),
            Some(refused) => return Err(format!("{refused:?}")),
            None => {}
        }
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read_buf(&mut buf))
            .await
            .map_err(|_| "no ServerHello in 10 s".to_string())?
            .map_err(|e| e.to_string())?;
        if read == 0 {
            return Err("closed during the handshake".into());
        }
    }
}

/// What a slow sender's frame came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Confirmed.
    Confirmed,
    /// Refused with 429 reason `memory` (the publish, or the frame and its connection).
    Memory,
    /// Anything else: the test fails on it.
    Other(String),
}

/// Sends `frame` in pieces, then reads until the answer: a confirm, a publish error or a fatal
/// error frame.
async fn send_slowly(addr: std::net::SocketAddr, frame: Arc<Vec<u8>>) -> Outcome {
    let mut stream = match raw_connect(addr).await {
        Ok(stream) => stream,
        Err(refused) if refused.contains("memory") => return Outcome::Memory,
        Err(other) => return Outcome::Other(other),
    };
    let (mut read, mut write) = stream.split();
    let sending = async {
        for piece in frame.chunks(PIECE_BYTES) {
            if write.write_all(piece).await.is_err() {
                // The broker refused the frame and closed: its answer is in the read half.
                return;
            }
            tokio::time::sleep(PIECE_PAUSE).await;
        }
    };
    let answering = async {
        let mut buf = Vec::new();
        loop {
            while let Ok(FrameStatus::Complete { size_bytes }) =
                Frame::check(&buf, FRAME_SIZE_BYTES_MAX)
            {
                let bytes: Vec<u8> = buf.drain(..size_bytes).collect();
                match Frame::decode(bytes.into()) {
                    Ok(Frame::Confirm(_)) => return Outcome::Confirmed,
                    Ok(Frame::PublishError(e)) if is_memory(&e.error) => return Outcome::Memory,
                    Ok(Frame::Error(ErrorFrame { error, .. })) if is_memory(&error) => {
                        return Outcome::Memory
                    }
                    Ok(Frame::Heartbeat) => {}
                    other => return Outcome::Other(format!("{other:?}")),
                }
            }
            match tokio::time::timeout(Duration::from_secs(60), read.read_buf(&mut buf)).await {
                Ok(Ok(0)) => return Outcome::Other("closed without an answer".into()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Outcome::Other(format!("read: {e}")),
                Err(_) => return Outcome::Other("no answer in 60 s".into()),
            }
        }
    };
    let (_, outcome) = tokio::join!(sending, answering);
    outcome
}

fn is_memory(error: &keratin_client::proto::ErrorBody) -> bool {
    error.reason().map(|r| r.name()) == Some("memory")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_large_frames_wait_for_memory_and_never_oom_the_broker() {
    let _serial = SERIAL.lock().await;
    if !memory_cgroups("slow_large_frames_wait_for_memory_and_never_oom_the_broker") {
        return;
    }
    let (cgroup, _tmp, mut server) = start_in_cgroup();
    let client = Client::connect(server.protocol, ClientOptions::default())
        .await
        .expect("connect");
    client
        .declare("big", QueueSettings::default())
        .await
        .expect("declare");
    client
        .declare("small", QueueSettings::default())
        .await
        .expect("declare");
    // A consumer connected before the flood, and messages for it published during it.
    let mut consumer = client.subscribe("small", 10).await.expect("subscribe");

    let mut frame = Default::default();
    Frame::Publish(Publish {
        queue: "big".into(),
        mode: PublishMode::Confirmed,
        messages: vec![Message {
            publish_id: 1,
            routing_key: None,
            headers: Vec::new(),
            body: vec![0x5a; FRAME_BODY_BYTES].into(),
            sequence: None,
        }],
        joinable: false,
        producer_id: None,
    })
    .encode(&mut frame, FRAME_SIZE_BYTES_MAX)
    .expect("encode");
    let frame: Arc<Vec<u8>> = Arc::new(frame.to_vec());

    let senders: Vec<_> = (0..SENDERS)
        .map(|_| tokio::spawn(send_slowly(server.protocol, frame.clone())))
        .collect();
    let consumed = Arc::new(AtomicU64::new(0));
    let small = {
        let client = client.clone();
        let consumed = consumed.clone();
        tokio::spawn(async move {
            for seq in 0..50u64 {
                // A publish may be refused at hard memory; the consumer must still get what
                // was confirmed.
                if client
                    .publish("small", OutgoingMessage::new(body(seq, 64)))
                    .await
                    .is_ok()
                {
                    let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                        .await
                        .expect("a delivery within 30 s while large frames wait")
                        .expect("the consumer is open");
                    delivery.ack().expect("ack");
                    consumed.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let mut peak = 0;
    while !senders.iter().all(|s| s.is_finished()) || !small.is_finished() {
        peak = peak.max(server.rss_bytes());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut outcomes = Vec::new();
    for sender in senders {
        outcomes.push(sender.await.expect("sender"));
    }
    small.await.expect("small publisher and consumer");
    let confirmed = outcomes
        .iter()
        .filter(|o| **o == Outcome::Confirmed)
        .count();
    let memory = outcomes.iter().filter(|o| **o == Outcome::Memory).count();
    eprintln!(
        "{SENDERS} slow 16 MB frames: {confirmed} confirmed, {memory} refused with memory; \
         peak RSS {} MiB of {} MiB; small messages consumed during the flood: {}; OOM kills {}",
        peak >> 20,
        LIMIT_BYTES >> 20,
        consumed.load(Ordering::Relaxed),
        cgroup.oom_kills()
    );
    assert!(server.alive(), "the broker was killed");
    assert_eq!(cgroup.oom_kills(), 0, "the kernel killed something");
    let others: Vec<_> = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Other(_)))
        .collect();
    assert!(
        others.is_empty(),
        "every frame gets a clear answer: {others:?}"
    );
    assert!(confirmed > 0, "some large frames went through");
    assert!(peak < LIMIT_BYTES, "resident memory stayed below the limit");
    assert!(
        consumed.load(Ordering::Relaxed) > 0,
        "the consumer connected before the flood kept consuming"
    );
    // Memory falls once the flood is over, and a new connection publishes again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let published = match Client::connect(server.protocol, ClientOptions::default()).await {
            Ok(after) => after
                .publish("small", OutgoingMessage::new(body(1, 64)))
                .await
                .is_ok(),
            Err(_) => false,
        };
        if published {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "publishes never resumed: {}",
            status(server.http)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
}

/// The bookkeeping the broker claims per unit of prefetch (100 bytes): 65,535 claims 6.5 MB.
const PREFETCH: u32 = 65_535;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_at_the_largest_prefetch_are_refused_with_memory_before_the_limit() {
    let _serial = SERIAL.lock().await;
    if !memory_cgroups("consumers_at_the_largest_prefetch_are_refused_with_memory_before_the_limit")
    {
        return;
    }
    let (cgroup, _tmp, mut server) = start_in_cgroup();
    let admin = Client::connect(server.protocol, ClientOptions::default())
        .await
        .expect("connect");
    admin
        .declare("work", QueueSettings::default())
        .await
        .expect("declare");
    for seq in 0..1000 {
        admin
            .publish("work", OutgoingMessage::new(body(seq, 32)))
            .await
            .expect("publish");
    }
    // Connections of four consumers each, none ever reading, until a subscribe is refused:
    // 512 MiB leaves room for about 27 such consumers beside the node's budgets.
    let mut connections = Vec::new();
    let mut consumers = Vec::new();
    let refused = 'open: loop {
        assert!(
            consumers.len() < 200,
            "200 consumers at prefetch {PREFETCH} (1.3 GB of bookkeeping) were all admitted"
        );
        let client = match Client::connect(server.protocol, ClientOptions::default()).await {
            Ok(client) => client,
            Err(error) => break 'open error,
        };
        for _ in 0..4 {
            match client.subscribe("work", PREFETCH).await {
                Ok(consumer) => consumers.push(consumer),
                Err(error) => break 'open error,
            }
        }
        connections.push(client);
    };
    eprintln!(
        "{} consumers at prefetch {PREFETCH} admitted on {} connections; then: {refused}",
        consumers.len(),
        connections.len()
    );
    assert_eq!(
        refused.reason(),
        Some("memory"),
        "refused for memory: {refused}"
    );
    assert!(
        refused.to_string().contains("retry"),
        "the refusal says when to retry: {refused}"
    );
    assert!(
        consumers.len() >= 20,
        "at least 20 such consumers fit in 512 MiB, got {}",
        consumers.len()
    );
    // New connections are refused the same way once the little left is claimed (each claims
    // 256 KiB; the last subscribe left less than 6.5 MB).
    let mut extra = Vec::new();
    let error = loop {
        assert!(
            extra.len() < 40,
            "40 more connections were admitted past the refused subscribe"
        );
        match Client::connect(server.protocol, ClientOptions::default()).await {
            Ok(client) => extra.push(client),
            Err(error) => break error,
        }
    };
    assert_eq!(error.reason(), Some("memory"), "{error}");
    drop(extra);
    // The connections the node has keep working.
    let info = admin.info("work").await.expect("queue info");
    let held: u64 = info.partitions.iter().map(|p| p.inflight).sum();
    assert!(held > 0, "the stalled consumers hold deliveries");
    assert!(server.alive(), "the broker was killed");
    assert_eq!(cgroup.oom_kills(), 0, "the kernel killed something");
    // Cancelling gives the memory back: a subscribe goes through again.
    for consumer in consumers.drain(..8) {
        consumer.cancel().await.expect("cancel");
    }
    let again = admin
        .subscribe("work", PREFETCH)
        .await
        .expect("a subscribe after cancels is admitted");
    drop(again);
    drop(consumers);
    drop(connections);
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
}

/// Queues of the partitions test: each gets one burst of [`BURST_BYTES`].
const BURST_QUEUES: usize = 300;
const BURST_BYTES: usize = 1 << 20;

/// Many partitions that each saw one burst: their logs keep round buffers between rounds only
/// within the file system's bound, so once the bursts are over memory falls back below hard and
/// publishes go through again. Kept whole (about 2 MiB per log after a 1 MiB burst), 300
/// partitions would hold about 600 MiB in this 512 MiB cgroup: the node would stay at hard,
/// refusing publishes, or be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_partitions_after_a_burst_each_leave_memory_below_hard() {
    let _serial = SERIAL.lock().await;
    if !memory_cgroups("many_partitions_after_a_burst_each_leave_memory_below_hard") {
        return;
    }
    let (cgroup, _tmp, mut server) = start_in_cgroup();
    let client = Client::connect(server.protocol, ClientOptions::default())
        .await
        .expect("connect");
    for i in 0..BURST_QUEUES {
        client
            .declare(&format!("burst-{i}"), QueueSettings::default())
            .await
            .expect("declare");
    }
    let mut peak = 0;
    let mut confirmed = 0;
    let mut refused = 0;
    for lane in (0..BURST_QUEUES).collect::<Vec<_>>().chunks(4) {
        let batches = lane.iter().map(|&i| {
            let client = client.clone();
            async move {
                let messages = (0..2)
                    .map(|half| OutgoingMessage::new(body(half, BURST_BYTES / 2)))
                    .collect();
                client.publish_batch(&format!("burst-{i}"), messages).await
            }
        });
        for results in futures_util::future::join_all(batches).await {
            for result in results {
                match result {
                    Ok(_) => confirmed += 1,
                    // Refused for memory: the publish, or its frame and connection.
                    Err(failed) => {
                        assert!(
                            failed.reason() == Some("memory")
                                || failed.error.to_string().contains("(memory)"),
                            "{}",
                            failed.error
                        );
                        refused += 1;
                    }
                }
            }
        }
        peak = peak.max(server.rss_bytes());
        assert!(server.alive(), "the broker was killed during the bursts");
    }
    // After the bursts, publishes go through again within 20 s.
    let deadline = Instant::now() + Duration::from_secs(20);
    while client
        .publish("burst-0", OutgoingMessage::new(body(7, 64)))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "publishes stayed refused after the bursts: RSS {} MiB; {}",
            server.rss_bytes() >> 20,
            status(server.http)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = server.rss_bytes();
    eprintln!(
        "{BURST_QUEUES} partitions, one 1 MiB burst each: {confirmed} messages confirmed, \
         {refused} refused with memory; peak RSS {} MiB, {} MiB after; OOM kills {}",
        peak >> 20,
        after >> 20,
        cgroup.oom_kills()
    );
    assert!(server.alive(), "the broker was killed");
    assert_eq!(cgroup.oom_kills(), 0, "the kernel killed something");
    assert!(confirmed > 0, "bursts were confirmed");
    assert!(server.terminate(Duration::from_secs(20)), "clean shutdown");
}
