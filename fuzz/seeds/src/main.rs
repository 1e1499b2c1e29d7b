//! Writes the seed corpus of the fuzz targets: `cargo run --manifest-path fuzz/Cargo.toml -p
//! keratin-fuzz-seeds -- fuzz/corpus` (from the repository root; see fuzz/README.md).
//!
//! Each seed is a valid input that a target would otherwise have to discover: one frame of
//! every type and a stream of several (the shapes `keratin-proto`'s round-trip tests use), the
//! hellos of both sides, segment files written by a real log on the simulated disk (sealed,
//! rolled, cut short by a crash, with a removed prefix), and configuration files (the defaults
//! as `--print-config` prints them and the examples of docs/configuration.md). Mutating valid
//! inputs reaches much deeper than starting from nothing, above all past checksums.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use keratin_log::{Io, Log, LogOptions, Record, SimIo, SizeClass};
use keratin_proto::codes::{ERR_NOT_FOUND, ERR_TOO_LARGE};
use keratin_proto::*;

/// The same options as the `log_recovery` target.
fn log_options() -> LogOptions {
    LogOptions {
        full_segment_size_bytes: 256 << 10,
        size_class: SizeClass::Small,
        ..LogOptions::default()
    }
}

/// The `log_recovery` target's flag bits.
const FLAG_PAD: u8 = 1;
const FLAG_FIX_CHECKSUMS: u8 = 2;

fn write(out: &Path, target: &str, name: &str, bytes: &[u8]) {
    let dir = out.join(target);
    std::fs::create_dir_all(&dir).expect("create the corpus directory");
    std::fs::write(dir.join(name), bytes).expect("write a seed");
}

fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = BytesMut::new();
    frame
        .encode(&mut out, FRAME_SIZE_BYTES_MAX)
        .expect("a seed frame encodes");
    out.to_vec()
}

fn message(publish_id: u64, routing_key: Option<&str>, body: &'static [u8]) -> Message {
    Message {
        publish_id,
        routing_key: routing_key.map(str::to_owned),
        headers: vec![Header {
            name: "trace".into(),
            value: "abc".into(),
        }],
        body: Bytes::from_static(body),
        sequence: Some(publish_id),
    }
}

fn frames() -> Vec<(&'static str, Frame)> {
    let settings = QueueSettings {
        partitions: 4,
        dead_letter: Some("dead".into()),
        max_deliveries: Some(5),
        max_messages: Some(1000),
        max_bytes: Some(1 << 20),
        overflow: Some(Overflow::DropOldest),
        replicas: Some(3),
    };
    let queue = |request_id| QueueRequest {
        request_id,
        queue: "orders".into(),
    };
    let ranges = vec![
        PublishIdRange { first: 1, last: 3 },
        PublishIdRange::single(7),
    ];
    vec![
        (
            "declare",
            Frame::Declare(Declare {
                request_id: 1,
                queue: "orders".into(),
                settings: settings.clone(),
                nodes: Vec::new(),
            }),
        ),
        ("delete", Frame::Delete(queue(2))),
        ("purge", Frame::Purge(queue(3))),
        ("queue_info", Frame::QueueInfo(queue(4))),
        ("queue_list", Frame::QueueList(QueueList { request_id: 5 })),
        (
            "set_queue_settings",
            Frame::SetQueueSettings(SetQueueSettings {
                request_id: 6,
                queue: "orders".into(),
                update: QueueSettingsUpdate {
                    dead_letter: Update::Clear,
                    max_deliveries: Update::Set(3),
                    max_messages: Update::Keep,
                    max_bytes: Update::Set(4096),
                    overflow: Update::Set(Overflow::Reject),
                },
            }),
        ),
        (
            "publish_confirmed",
            Frame::Publish(Publish {
                queue: "orders".into(),
                mode: PublishMode::Confirmed,
                messages: vec![message(1, Some("key"), b"hello"), message(2, None, b"")],
                joinable: false,
                producer_id: Some(77),
            }),
        ),
        (
            "publish_buffered_joinable",
            Frame::Publish(Publish {
                queue: "orders".into(),
                mode: PublishMode::Buffered,
                messages: vec![message(3, None, b"one"), message(4, None, b"two")],
                joinable: true,
                producer_id: None,
            }),
        ),
        (
            "cancel",
            Frame::Cancel(Cancel {
                request_id: 8,
                consumer_tag: "c1".into(),
            }),
        ),
        (
            "ack",
            Frame::Ack(Ack {
                delivery_ids: vec![1, 2, 9],
            }),
        ),
        (
            "reject",
            Frame::Reject(Reject {
                delivery_ids: vec![4],
                requeue: true,
            }),
        ),
        ("ok", Frame::Ok(OkReply { request_id: 1 })),
        (
            "queue_info_reply",
            Frame::QueueInfoReply(QueueInfoReply {
                request_id: 4,
                queue: "orders".into(),
                settings,
                partitions: vec![PartitionInfo {
                    ready: 10,
                    inflight: 2,
                    bytes: 1200,
                    disk_bytes: 1 << 20,
                    leading: false,
                    leader: Some(2),
                    leader_addr: Some("10.0.0.2:5680".into()),
                }],
            }),
        ),
        (
            "queue_list_reply",
            Frame::QueueListReply(QueueListReply {
                request_id: 5,
                queues: vec![QueueSummary {
                    queue: "orders".into(),
                    partitions: 1,
                    ready: 10,
                    inflight: 2,
                    bytes: 1200,
                }],
            }),
        ),
        (
            "subscribe_ok",
            Frame::SubscribeOk(SubscribeOk {
                request_id: 7,
                consumer_tag: "c1".into(),
            }),
        ),
        (
            "confirm",
            Frame::Confirm(Confirm {
                ranges: ranges.clone(),
            }),
        ),
        (
            "publish_error",
            Frame::PublishError(PublishError {
                ranges,
                error: ErrorBody::limited(LimitReason::QueueFull, 250, "queue orders is full"),
            }),
        ),
        (
            "deliver",
            Frame::Deliver(Deliver {
                consumer_tag: "c1".into(),
                delivery_id: 1,
                partition: 0,
                offset: 42,
                redelivered: true,
                delivery_count: 2,
                routing_key: None,
                headers: vec![Header {
                    name: "trace".into(),
                    value: "abc".into(),
                }],
                body: Bytes::from_static(b"hello"),
            }),
        ),
        (
            "consumer_end",
            Frame::ConsumerEnd(ConsumerEnd {
                consumer_tag: "c1".into(),
                error: ErrorBody::not_leader(Some("10.0.0.2:5680".into()), "partition 0 moved"),
            }),
        ),
        ("heartbeat", Frame::Heartbeat),
        (
            "error_request",
            Frame::Error(ErrorFrame {
                request_id: Some(2),
                fatal: false,
                error: ErrorBody::new(ERR_NOT_FOUND, "queue \"orders\" does not exist"),
            }),
        ),
        (
            "error_fatal",
            Frame::Error(ErrorFrame {
                request_id: None,
                fatal: true,
                error: ErrorBody::new(ERR_TOO_LARGE, "too big"),
            }),
        ),
        (
            "close",
            Frame::Close(Close {
                message: "bye".into(),
            }),
        ),
    ]
}

/// `Subscribe` is written field by field (docs/protocol.md, "Subscribe") rather than built from
/// its struct, so that this tool keeps compiling when the frame gains a field.
fn subscribe_bytes() -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_u8(FrameType::Subscribe as u8);
    body.put_u64_le(7);
    body.put_u16_le(6);
    body.put_slice(b"orders");
    body.put_u32_le(100);
    body.put_u16_le(2);
    body.put_slice(b"c1");
    body.put_u64_le(0); // prefetch_bytes (protocol version 2 on): no byte bound
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&body);
    if Frame::decode(Bytes::from(out.clone())).is_err() {
        // Still a useful seed: the fuzzer mutates it towards the current layout.
        eprintln!("note: the Subscribe seed no longer decodes; update subscribe_bytes()");
    }
    out
}

fn frame_seeds(out: &Path) {
    let mut stream = Vec::new();
    for (name, frame) in frames() {
        let bytes = encode(&frame);
        stream.extend_from_slice(&bytes);
        write(out, "frame", name, &bytes);
    }
    let subscribe = subscribe_bytes();
    write(out, "frame", "subscribe", &subscribe);
    stream.extend_from_slice(&subscribe);
    write(out, "frame", "stream_of_every_type", &stream);
}

fn handshake_seeds(out: &Path) {
    let mut bytes = BytesMut::new();
    let hello = ClientHello::new("keratin-cli 0.1.0");
    hello.encode(&mut bytes).expect("encode");
    write(out, "handshake", "client_hello", &bytes);
    // A client that pipelines its first frame behind the hello.
    bytes.extend_from_slice(&encode(&Frame::Heartbeat));
    write(out, "handshake", "client_hello_and_frame", &bytes);
    let info = ServerInfo {
        admin: Some("127.0.0.1:5681".into()),
        nodes: vec![NodeAddress {
            node_id: "node-1".into(),
            server: "127.0.0.1:5680".into(),
            admin: Some("127.0.0.1:5681".into()),
        }],
    };
    let other = ClientHello {
        version: 9,
        client_name: "future".into(),
        auth: Auth::None,
    };
    // Version 6 logins, one per mechanism with fields, and an answer naming the user.
    let logins = [
        (
            "client_hello_plain",
            Auth::Plain {
                user: "bob".into(),
                password: "pw".into(),
            },
        ),
        ("client_hello_external", Auth::External),
        (
            "client_hello_token",
            Auth::Token(format!("kt_{}", "0f".repeat(32))),
        ),
    ];
    for (name, auth) in logins {
        let mut bytes = BytesMut::new();
        ClientHello::new("cli")
            .with_auth(auth)
            .encode(&mut bytes)
            .expect("encode");
        write(out, "handshake", name, &bytes);
    }
    let mut bytes = BytesMut::new();
    ServerHello::Accepted {
        version: keratin_proto::AUTH_VERSION,
        node_id: "node-1".into(),
        info: ServerInfo::default(),
        user: Some("bob".into()),
    }
    .encode(&mut bytes)
    .expect("encode");
    write(out, "handshake", "server_accepted_user", &bytes);
    for (name, answer) in [
        (
            "server_accepted",
            ServerHello::answer(&hello, "node-1", info),
        ),
        (
            "server_refused",
            ServerHello::answer(&other, "node-1", ServerInfo::default()),
        ),
    ] {
        let mut bytes = BytesMut::new();
        answer.encode(&mut bytes).expect("encode");
        write(out, "handshake", name, &bytes);
    }
}

/// One cluster frame of every type, a stream of them, and both hellos (`keratin-net`).
fn cluster_seeds(out: &Path) {
    use keratin_net::frame::Frame as ClusterFrame;
    use keratin_net::handshake::{Hello, HelloReply};
    use keratin_net::{GroupId, RemoteError};
    let error = RemoteError::new(1000, "no room: disk at reserve");
    let frames = [
        (
            "request",
            ClusterFrame::Request {
                request_id: 1,
                group: GroupId(7),
                kind: 2,
                body: Bytes::from_static(b"append"),
            },
        ),
        (
            "response",
            ClusterFrame::Response {
                request_id: 1,
                body: Bytes::from_static(b"ok"),
            },
        ),
        (
            "refusal",
            ClusterFrame::Refusal {
                request_id: 2,
                error: error.clone(),
            },
        ),
        (
            "heartbeat_batch",
            ClusterFrame::HeartbeatBatch {
                batch_id: 3,
                entries: vec![
                    (GroupId(1), Bytes::from_static(b"term 4")),
                    (GroupId(2), Bytes::new()),
                ],
            },
        ),
        (
            "heartbeat_replies",
            ClusterFrame::HeartbeatReplies {
                batch_id: 3,
                replies: vec![
                    (GroupId(1), Ok(Bytes::from_static(b"ok"))),
                    (GroupId(2), Err(error.clone())),
                ],
            },
        ),
        ("ping", ClusterFrame::Ping { nonce: 12345 }),
        ("pong", ClusterFrame::Pong { nonce: 12345 }),
        ("error", ClusterFrame::Error(error.clone())),
    ];
    let mut stream = Vec::new();
    for (name, frame) in frames {
        let encoded = frame.encode();
        let mut bytes = encoded.head.to_vec();
        bytes.extend_from_slice(&encoded.tail);
        write(out, "cluster_frame", name, &bytes);
        stream.extend_from_slice(&bytes);
    }
    write(out, "cluster_frame", "stream_of_every_type", &stream);
    let hello = Hello {
        version: 1,
        from: 1,
        to: 2,
        cluster: "prod".into(),
    };
    write(out, "cluster_frame", "hello", &hello.encode());
    for (name, outcome) in [("hello_accepted", Ok(())), ("hello_refused", Err(error))] {
        let reply = HelloReply {
            version: 1,
            node_id: 2,
            outcome,
        };
        write(out, "cluster_frame", name, &reply.encode());
    }
}

fn record(payload: &[u8]) -> Record<'_> {
    Record {
        record_type: 1,
        flags: 0,
        timestamp_ms: 1_700_000_000_000,
        payload,
    }
}

/// The log directory's segment files as the `log_recovery` target reads them: each file with
/// its trailing zeros cut (the target pads them back), in name order, concatenated.
fn segment_files(io: &SimIo, dir: &Path) -> Vec<u8> {
    let mut names = io.read_dir(dir).expect("list the log directory");
    names.retain(|name| name.ends_with(".seg"));
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let mut bytes = io.read_file(&dir.join(name)).expect("read a segment");
        let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1);
        bytes.truncate(end);
        out.extend_from_slice(&bytes);
    }
    out
}

fn log_seed(out: &Path, name: &str, build: impl FnOnce(&Arc<SimIo>, &Path) -> Arc<SimIo>) {
    let io = Arc::new(SimIo::new(1));
    let dir = PathBuf::from("/seed/log");
    let io = build(&io, &dir);
    let files = segment_files(&io, &dir);
    for (suffix, flags) in [("", FLAG_PAD), ("_fixed", FLAG_PAD | FLAG_FIX_CHECKSUMS)] {
        let mut seed = vec![flags];
        seed.extend_from_slice(&files);
        write(out, "log_recovery", &format!("{name}{suffix}"), &seed);
    }
}

fn open(io: &Arc<SimIo>, dir: &Path) -> Log {
    let dyn_io: Arc<dyn Io> = io.clone();
    Log::open(dyn_io, dir, log_options(), None).expect("open the seed log")
}

fn log_seeds(out: &Path) {
    let payloads: Vec<Vec<u8>> = (0..6u8)
        .map(|i| vec![b'a' + i; 10 + usize::from(i)])
        .collect();
    let records: Vec<Record<'_>> = payloads.iter().map(|p| record(p)).collect();
    log_seed(out, "sealed", |io, dir| {
        let log = open(io, dir);
        log.append_sync(&records[..3]).expect("append");
        log.append_sync(&records[3..]).expect("append");
        log.close().expect("close");
        io.clone()
    });
    log_seed(out, "rolled", |io, dir| {
        let log = open(io, dir);
        for chunk in records.chunks(2) {
            log.append_sync(chunk).expect("append");
            wait(log.roll().expect("roll"));
        }
        log.close().expect("close");
        io.clone()
    });
    log_seed(out, "crashed_unsealed", |io, dir| {
        let log = open(io, dir);
        log.append_sync(&records).expect("append");
        io.crash_now();
        drop(log);
        Arc::new(io.restart())
    });
    log_seed(out, "prefix_removed", |io, dir| {
        let log = open(io, dir);
        for chunk in records.chunks(2) {
            log.append_sync(chunk).expect("append");
            wait(log.roll().expect("roll"));
        }
        wait(log.remove_prefix(4).expect("remove prefix"));
        log.close().expect("close");
        io.clone()
    });
}

/// Waits for a log ticket without an async runtime.
fn wait<T>(ticket: keratin_log::Ticket<T>) -> T {
    ticket.wait().expect("the log operation succeeds")
}

fn config_seeds(out: &Path, repo: &Path) {
    let defaults = keratin_server::config::load(
        &keratin_server::config::CliOverrides::default(),
        Vec::<(String, String)>::new(),
    )
    .expect("the defaults load");
    write(
        out,
        "config",
        "print_config_defaults",
        defaults.print().as_bytes(),
    );
    let docs = std::fs::read_to_string(repo.join("docs/configuration.md"))
        .expect("read docs/configuration.md");
    for (index, block) in docs.split("```toml\n").skip(1).enumerate() {
        let block = block.split("```").next().unwrap_or_default();
        write(
            out,
            "config",
            &format!("docs_example_{index}"),
            block.as_bytes(),
        );
    }
    write(
        out,
        "config",
        "small",
        b"[node]\nid = \"n1\"\n\n[storage]\nsegment_bytes = 4194304\n\n[limits.disk]\nsoft_fraction = 0.5\n",
    );
}

fn main() {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    let repo = out
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    frame_seeds(&out);
    handshake_seeds(&out);
    log_seeds(&out);
    config_seeds(&out, &repo);
    cluster_seeds(&out);
    println!("seeds written under {}", out.display());
}
