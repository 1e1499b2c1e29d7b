//! `keratin stream declare|list|info|set|delete|read`: streams (issue 18, `docs/streams.md`).
//! The admin verbs are one request each, printed as a table or one JSON object, as `queue.rs`
//! does for queues; `read` prints each message as it arrives (a line, or a JSON object per
//! line) and a summary at the end.
//!
//! Owns the flags and the output of these verbs and `read`'s stop rule (count, idle time,
//! Ctrl-C). Credit and cursor commits belong to the client's `StreamConsumer`; spelling sizes,
//! durations and times to `units.rs`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use base64::Engine;
use clap::{Args, Subcommand};
use keratin_client::{
    Client, CursorEntry, StreamConsumer, StreamDelivery, StreamInfoReply, StreamPartitionInfo,
    StreamRetentionUpdate, StreamSettings, StreamStart, StreamSubscribeOptions, StreamSummary,
    Update, STREAM_CREDIT_DEFAULT, STREAM_CREDIT_MAX,
};
use serde_json::{json, Value};

use crate::body::{self, Checked};
use crate::connect::{connect, CommonArgs};
use crate::output::{elapsed_ms, format_bytes, print_json, Failure, Table};
use crate::units::{format_time_ms, parse_duration_ms, parse_rfc3339_ms, parse_size};

/// Bytes of a binary body shown (as hex) on a `read` line; the JSON carries it whole.
const BODY_HEX_SHOWN_BYTES: usize = 32;

/// `keratin stream ...`.
#[derive(Debug, Args)]
pub struct StreamArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(subcommand)]
    verb: StreamVerb,
}

#[derive(Debug, Subcommand)]
enum StreamVerb {
    /// Create a stream, or succeed if it exists with the same settings (409 otherwise, or if a
    /// queue has the name).
    Declare(DeclareArgs),
    /// Every stream with its message count and bytes.
    List,
    /// A stream's settings and, per partition, its offsets, messages, bytes and leader.
    Info { name: String },
    /// Change a live stream's retention; `none` removes a bound.
    Set(SetArgs),
    /// Delete a stream, its messages and its cursors.
    Delete { name: String },
    /// Print a stream's messages (partition, offset, time, key, body), like a Kafka console
    /// consumer: from --from (default: only new messages) until --count messages were read,
    /// Ctrl-C, or --idle-timeout passed without a message. With --json: one object per
    /// message, then a summary object. Exits 1 when --count was given and fewer were read.
    Read(ReadArgs),
}

#[derive(Debug, Args)]
struct DeclareArgs {
    name: String,
    /// Number of partitions (1 to 64); fixed at declaration. A message's routing key picks its
    /// partition (`keratin publish --routing-key`).
    #[arg(long, default_value_t = 1, value_name = "N")]
    partitions: u32,
    /// Nodes holding a copy of each partition (a cluster; default min(3, nodes)); fixed at
    /// declaration.
    #[arg(long, value_name = "R", value_parser = clap::value_parser!(u32).range(1..))]
    replicas: Option<u32>,
    /// Retention by size: the stream's bytes on disk over all partitions (bytes, or with KiB,
    /// MiB, GiB, TiB).
    #[arg(long = "max-bytes", value_name = "B", value_parser = parse_size)]
    max_bytes: Option<u64>,
    /// Retention by age: old segments go once their newest message is older (ms, s, m, h, d:
    /// for example 7d).
    #[arg(long = "max-age", value_name = "DUR", value_parser = parse_duration_ms)]
    max_age_ms: Option<u64>,
    /// Retention by count: the messages held over all partitions.
    #[arg(long = "max-messages", value_name = "N")]
    max_messages: Option<u64>,
    /// Pin the replicas to these cluster nodes (comma-separated ids, as for queues).
    #[arg(long, value_name = "ID,ID,...", value_delimiter = ',')]
    nodes: Vec<u64>,
}

#[derive(Debug, Args)]
struct SetArgs {
    name: String,
    /// Retention by size (bytes, or with KiB, MiB, GiB, TiB), or `none`.
    #[arg(long = "max-bytes", value_name = "B|none")]
    max_bytes: Option<String>,
    /// Retention by age (ms, s, m, h, d), or `none`.
    #[arg(long = "max-age", value_name = "DUR|none")]
    max_age: Option<String>,
    /// Retention by count, or `none`.
    #[arg(long = "max-messages", value_name = "N|none")]
    max_messages: Option<String>,
}

#[derive(Debug, Args)]
struct ReadArgs {
    name: String,
    /// Where to start in each partition the cursor has no position for: `first` (the oldest
    /// message held), `last` (the newest), `next` (only messages published from now on, the
    /// default, as a Kafka console consumer without --from-beginning), an OFFSET (a number),
    /// or a time: RFC 3339 (2026-12-04T14:00:00Z) or @MS (ms since the Unix epoch).
    #[arg(long, value_name = "WHERE", default_value = "next", value_parser = parse_start)]
    from: StreamStart,
    /// Stop after this many messages. Without it, read until Ctrl-C (or --idle-timeout).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Stop once no message came for this long (ms, s, m, h: for example 2s). Without it, wait
    /// for messages as long as it takes, as a Kafka console consumer without --timeout-ms.
    #[arg(long = "idle-timeout", value_name = "DUR", value_parser = parse_duration_ms)]
    idle_timeout_ms: Option<u64>,
    /// Read with this named cursor: resume where it was committed (--from applies only to
    /// partitions it has no position for).
    #[arg(long, value_name = "NAME")]
    cursor: Option<String>,
    /// At the end, commit the positions read to --cursor (the next read resumes after them).
    #[arg(long, requires = "cursor")]
    commit: bool,
    /// Read only this partition (repeat for more); default all.
    #[arg(long = "partition", value_name = "P")]
    partitions: Vec<u32>,
    /// Share the stream's partitions with the other readers of --cursor that pass --group
    /// (a consumer group: each partition is read by one of them at a time).
    #[arg(long, requires = "cursor", conflicts_with = "partitions")]
    group: bool,
    /// Messages the broker sends ahead of what was printed.
    #[arg(long, value_name = "N", default_value_t = STREAM_CREDIT_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(STREAM_CREDIT_MAX)))]
    credit: u32,
    /// Print each message's body as its bytes, one per line, and nothing else (no partition,
    /// offset, time or key; control characters not escaped): for piping bodies into another
    /// program. Without it, bodies are shown as text with control characters escaped.
    #[arg(long, conflicts_with = "json")]
    raw: bool,
}

/// `first`, `last`, `next`, an offset, an RFC 3339 time or `@` and ms since the epoch.
fn parse_start(text: &str) -> Result<StreamStart, String> {
    match text {
        "first" => return Ok(StreamStart::First),
        "last" => return Ok(StreamStart::Last),
        "next" => return Ok(StreamStart::Next),
        _ => {}
    }
    if let Some(ms) = text.strip_prefix('@') {
        return ms
            .parse()
            .map(StreamStart::Timestamp)
            .map_err(|_| format!("{text:?}: expected @ and milliseconds since the Unix epoch"));
    }
    if let Ok(offset) = text.parse() {
        return Ok(StreamStart::Offset(offset));
    }
    parse_rfc3339_ms(text)
        .map(StreamStart::Timestamp)
        .map_err(|error| {
            format!("expected first, last, next, an offset, @MS or an RFC 3339 time: {error}")
        })
}

/// A `set` flag: absent keeps the bound, `none` clears it, anything else is `parse`d.
fn parse_update(
    flag: &str,
    value: Option<&str>,
    parse: fn(&str) -> Result<u64, String>,
) -> Result<Update<u64>, Failure> {
    match value {
        None => Ok(Update::Keep),
        Some("none") => Ok(Update::Clear),
        Some(text) => parse(text)
            .map(Update::Set)
            .map_err(|error| Failure::new(format!("{flag}: {error}, or none"))),
    }
}

fn parse_count(text: &str) -> Result<u64, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not a whole number"))
}

/// Runs one stream verb.
pub async fn run(args: StreamArgs) -> Result<ExitCode, Failure> {
    let client = connect(&args.common, None).await?;
    let json = args.common.json;
    let result = match args.verb {
        StreamVerb::Declare(declare) => run_declare(&client, declare, json).await,
        StreamVerb::List => run_list(&client, json).await,
        StreamVerb::Info { name } => run_info(&client, &name, json).await,
        StreamVerb::Set(set) => run_set(&client, set, json).await,
        StreamVerb::Delete { name } => {
            let outcome = client.delete_stream(&name).await;
            outcome.map_err(|error| Failure::client(format!("delete stream {name}"), &error))?;
            done(
                json,
                json!({"stream": name, "deleted": true}),
                format!("deleted stream {name}"),
            );
            Ok(ExitCode::SUCCESS)
        }
        StreamVerb::Read(read) => run_read(&client, read, json).await,
    };
    client.close().await;
    result
}

fn done(json: bool, object: Value, text: String) {
    if json {
        print_json(&object);
    } else {
        outln!("{text}");
    }
}

async fn run_declare(client: &Client, args: DeclareArgs, json: bool) -> Result<ExitCode, Failure> {
    let settings = StreamSettings {
        partitions: args.partitions,
        replicas: args.replicas,
        max_bytes: args.max_bytes,
        max_age_ms: args.max_age_ms,
        max_messages: args.max_messages,
    };
    client
        .declare_stream_on(&args.name, settings.clone(), &args.nodes)
        .await
        .map_err(|error| Failure::client(format!("declare stream {}", args.name), &error))?;
    let mut object = json!({
        "stream": args.name,
        "declared": true,
        "settings": settings_json(&settings),
    });
    if !args.nodes.is_empty() {
        object["nodes"] = json!(args.nodes);
    }
    let text = format!(
        "declared stream {} ({} partition{}, retention {})",
        args.name,
        settings.partitions,
        if settings.partitions == 1 { "" } else { "s" },
        retention_text(&settings)
    );
    done(json, object, text);
    Ok(ExitCode::SUCCESS)
}

async fn run_set(client: &Client, args: SetArgs, json: bool) -> Result<ExitCode, Failure> {
    let update = StreamRetentionUpdate {
        max_bytes: parse_update("--max-bytes", args.max_bytes.as_deref(), parse_size)?,
        max_age_ms: parse_update("--max-age", args.max_age.as_deref(), parse_duration_ms)?,
        max_messages: parse_update("--max-messages", args.max_messages.as_deref(), parse_count)?,
    };
    let name = &args.name;
    client
        .set_stream(name, update)
        .await
        .map_err(|error| Failure::client(format!("set stream {name}"), &error))?;
    let info = client
        .stream_info(name)
        .await
        .map_err(|error| Failure::client(format!("info of stream {name}"), &error))?;
    done(
        json,
        json!({"stream": name, "settings": settings_json(&info.settings)}),
        format!(
            "stream {name} now has retention {}",
            retention_text(&info.settings)
        ),
    );
    Ok(ExitCode::SUCCESS)
}

async fn run_list(client: &Client, json: bool) -> Result<ExitCode, Failure> {
    let streams = client
        .list_streams()
        .await
        .map_err(|error| Failure::client("list streams", &error))?;
    if json {
        let streams: Vec<Value> = streams.iter().map(summary_json).collect();
        print_json(&json!({ "streams": streams }));
        return Ok(ExitCode::SUCCESS);
    }
    if streams.is_empty() {
        outln!("no streams");
        return Ok(ExitCode::SUCCESS);
    }
    let mut table = Table::new(&["STREAM", "PARTITIONS", "MESSAGES", "BYTES"]);
    for stream in &streams {
        table.row(vec![
            stream.stream.clone(),
            stream.partitions.to_string(),
            stream.messages.to_string(),
            format_bytes(stream.bytes),
        ]);
    }
    out!("{}", table.render());
    Ok(ExitCode::SUCCESS)
}

async fn run_info(client: &Client, name: &str, json: bool) -> Result<ExitCode, Failure> {
    let info = client
        .stream_info(name)
        .await
        .map_err(|error| Failure::client(format!("info of stream {name}"), &error))?;
    if json {
        print_json(&info_json(&info));
    } else {
        out!("{}", info_text(&info));
    }
    Ok(ExitCode::SUCCESS)
}

fn summary_json(stream: &StreamSummary) -> Value {
    json!({
        "stream": stream.stream,
        "partitions": stream.partitions,
        "messages": stream.messages,
        "bytes": stream.bytes,
    })
}

fn settings_json(settings: &StreamSettings) -> Value {
    json!({
        "partitions": settings.partitions,
        "replicas": settings.replicas,
        "max_bytes": settings.max_bytes,
        "max_age_ms": settings.max_age_ms,
        "max_messages": settings.max_messages,
    })
}

/// `max_bytes=1.0 GiB max_age=7d max_messages=none`.
fn retention_text(settings: &StreamSettings) -> String {
    let none = || "none".to_owned();
    format!(
        "max_bytes={} max_age={} max_messages={}",
        settings.max_bytes.map_or_else(none, format_bytes),
        settings.max_age_ms.map_or_else(none, duration_text),
        settings.max_messages.map_or_else(none, |n| n.to_string()),
    )
}

/// A duration in the largest unit that divides it: `7d`, `90m`, `1500ms`.
fn duration_text(ms: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ];
    UNITS
        .iter()
        .find(|(_, size)| ms != 0 && ms.is_multiple_of(*size))
        .map_or_else(
            || format!("{ms}ms"),
            |(unit, size)| format!("{}{unit}", ms / size),
        )
}

/// Who leads a partition: `this node`, `node 2 (10.0.0.2:5680)`, or `none known`.
fn leader_text(p: &StreamPartitionInfo) -> String {
    if p.leading {
        return "this node".to_owned();
    }
    match (p.leader, &p.leader_addr) {
        (Some(id), Some(addr)) => format!("node {id} ({addr})"),
        (Some(id), None) => format!("node {id}"),
        (None, Some(addr)) => addr.clone(),
        (None, None) => "none known".to_owned(),
    }
}

/// `{"stream", "settings", "messages", "bytes", "disk_bytes", "partitions": [...]}`, the
/// totals summed over partitions.
fn info_json(info: &StreamInfoReply) -> Value {
    let partitions: Vec<Value> = info
        .partitions
        .iter()
        .enumerate()
        .map(|(index, p)| {
            json!({
                "partition": index,
                "start_offset": p.start_offset,
                "next_offset": p.next_offset,
                "messages": p.messages,
                "bytes": p.bytes,
                "disk_bytes": p.disk_bytes,
                "oldest_timestamp_ms": p.oldest_timestamp_ms,
                "leading": p.leading,
                "leader": p.leader,
                "leader_addr": p.leader_addr,
            })
        })
        .collect();
    let sum = |field: fn(&StreamPartitionInfo) -> u64| -> u64 {
        info.partitions
            .iter()
            .map(field)
            .fold(0, u64::saturating_add)
    };
    json!({
        "stream": info.stream,
        "settings": settings_json(&info.settings),
        "messages": sum(|p| p.messages),
        "bytes": sum(|p| p.bytes),
        "disk_bytes": sum(|p| p.disk_bytes),
        "partitions": partitions,
    })
}

fn info_text(info: &StreamInfoReply) -> String {
    let settings = &info.settings;
    let mut out = format!("stream          {}\n", info.stream);
    out.push_str(&format!("partitions      {}\n", settings.partitions));
    let replicas = settings
        .replicas
        .map_or_else(|| "default".to_owned(), |r| r.to_string());
    out.push_str(&format!("replicas        {replicas}\n"));
    let unset = || "-".to_owned();
    let lines = [
        (
            "max-bytes",
            settings.max_bytes.map_or_else(unset, format_bytes),
        ),
        (
            "max-age",
            settings.max_age_ms.map_or_else(unset, duration_text),
        ),
        (
            "max-messages",
            settings.max_messages.map_or_else(unset, |n| n.to_string()),
        ),
    ];
    for (label, value) in lines {
        out.push_str(&format!("{label:<16}{value}\n"));
    }
    out.push('\n');
    let mut table = Table::new(&[
        "PARTITION",
        "START",
        "NEXT",
        "MESSAGES",
        "BYTES",
        "DISK",
        "OLDEST",
        "LEADER",
    ]);
    for (index, p) in info.partitions.iter().enumerate() {
        table.row(vec![
            index.to_string(),
            p.start_offset.to_string(),
            p.next_offset.to_string(),
            p.messages.to_string(),
            format_bytes(p.bytes),
            format_bytes(p.disk_bytes),
            p.oldest_timestamp_ms.map_or_else(unset, format_time_ms),
            leader_text(p),
        ]);
    }
    out.push_str(&table.render());
    out
}

/// Why `read` stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadEnd {
    CountReached,
    Idle,
    Interrupted,
    /// The consumer ended: the connection, or the stream was deleted.
    ConsumerEnded,
}

impl ReadEnd {
    fn name(self) -> &'static str {
        match self {
            ReadEnd::CountReached => "count reached",
            ReadEnd::Idle => "idle",
            ReadEnd::Interrupted => "interrupted",
            ReadEnd::ConsumerEnded => "consumer ended",
        }
    }
}

async fn run_read(client: &Client, args: ReadArgs, json: bool) -> Result<ExitCode, Failure> {
    let mut options = StreamSubscribeOptions::new(args.name.clone())
        .start(args.from)
        .credit(args.credit)
        .partitions(args.partitions.clone());
    options.cursor = args.cursor.clone();
    options.group = args.group;
    let mut consumer = client
        .stream_subscribe(options)
        .await
        .map_err(|error| Failure::client(format!("read stream {}", args.name), &error))?;
    let started = Instant::now();
    let idle = args.idle_timeout_ms.map(Duration::from_millis);
    let mut read: u64 = 0;
    let interrupt = tokio::signal::ctrl_c();
    tokio::pin!(interrupt);
    let end = loop {
        if args.count.is_some_and(|count| read >= count) {
            break ReadEnd::CountReached;
        }
        let next = tokio::select! {
            _ = &mut interrupt => break ReadEnd::Interrupted,
            next = next_message(&mut consumer, idle) => next,
        };
        match next {
            Next::Message(delivery) => {
                print_delivery(&args.name, &delivery, json, args.raw);
                read += 1;
            }
            Next::Idle => break ReadEnd::Idle,
            Next::Ended => break ReadEnd::ConsumerEnded,
        }
    };
    let ended_by = consumer.end_error().map(ToString::to_string);
    let committed = if args.commit {
        Some(commit(&mut consumer, &args).await?)
    } else {
        None
    };
    if end != ReadEnd::ConsumerEnded {
        if let Err(error) = consumer.cancel().await {
            eprintln!("keratin: cancelling the reader: {error}");
        }
    }
    report(
        &args,
        read,
        end,
        committed.as_deref(),
        started.elapsed(),
        json,
    );
    if let Some(why) = ended_by {
        return Err(Failure::new(format!(
            "reading stream {} ended after {read} messages: {why}",
            args.name
        )));
    }
    let complete = args.count.is_none_or(|count| read == count);
    Ok(if complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

enum Next {
    Message(StreamDelivery),
    Idle,
    Ended,
}

async fn next_message(consumer: &mut StreamConsumer, idle: Option<Duration>) -> Next {
    let received = match idle {
        Some(idle) => match tokio::time::timeout(idle, consumer.recv()).await {
            Ok(received) => received,
            Err(_) => return Next::Idle,
        },
        None => consumer.recv().await,
    };
    received.map_or(Next::Ended, Next::Message)
}

async fn commit(
    consumer: &mut StreamConsumer,
    args: &ReadArgs,
) -> Result<Vec<CursorEntry>, Failure> {
    consumer.commit().await.map_err(|error| {
        Failure::client(
            format!(
                "commit cursor {} of stream {}",
                args.cursor.as_deref().unwrap_or_default(),
                args.name
            ),
            &error,
        )
    })?;
    Ok(consumer.positions())
}

fn entries_json(entries: &[CursorEntry]) -> Value {
    entries
        .iter()
        .map(|e| json!({"partition": e.partition, "offset": e.offset}))
        .collect()
}

fn report(
    args: &ReadArgs,
    read: u64,
    end: ReadEnd,
    committed: Option<&[CursorEntry]>,
    elapsed: Duration,
    json: bool,
) {
    if json {
        print_json(&json!({
            "stream": args.name,
            "read": read,
            "ended": end.name(),
            "cursor": args.cursor,
            "committed": committed.map(entries_json),
            "elapsed_ms": elapsed_ms(elapsed),
        }));
        return;
    }
    // On stderr, so that stdout holds only the messages (as a Kafka console consumer).
    let mut line = format!(
        "read {} from {} ({})",
        crate::output::count_of(read, "message"),
        args.name,
        end.name()
    );
    if let (Some(entries), Some(cursor)) = (committed, &args.cursor) {
        let positions: Vec<String> = entries
            .iter()
            .map(|e| format!("{}:{}", e.partition, e.offset))
            .collect();
        line.push_str(&format!(
            "; committed cursor {cursor} at {}",
            if positions.is_empty() {
                "nothing (no message read)".to_owned()
            } else {
                positions.join(" ")
            }
        ));
    }
    eprintln!("{line}");
}

fn print_delivery(stream: &str, delivery: &StreamDelivery, json: bool, raw: bool) {
    if let Some(from) = delivery.moved_from {
        eprintln!(
            "keratin: stream {stream} partition {}: offset {from} was removed by retention; \
             reading from {}",
            delivery.partition, delivery.offset
        );
    }
    if json {
        print_json(&delivery_json(delivery));
    } else if raw {
        let mut line = Vec::with_capacity(delivery.body.len() + 1);
        line.extend_from_slice(&delivery.body);
        line.push(b'\n');
        crate::output::write_stdout_bytes(&line);
    } else {
        outln!("{}", delivery_text(delivery));
    }
}

/// The sequence number of a body `keratin publish` wrote, when its checksum holds.
fn publish_seq(body: &[u8]) -> Option<u64> {
    match body::check(body) {
        Checked::Intact { seq } => Some(seq),
        Checked::Corrupt { .. } => None,
    }
}

/// One JSON object per message: `body` is the text when the body is UTF-8, else `null` with
/// the bytes in `body_base64`; `seq` is the sequence number of a `keratin publish` body.
fn delivery_json(delivery: &StreamDelivery) -> Value {
    let text = std::str::from_utf8(&delivery.body).ok();
    let headers: Vec<Value> = delivery
        .headers
        .iter()
        .map(|h| json!({"name": h.name, "value": h.value}))
        .collect();
    json!({
        "partition": delivery.partition,
        "offset": delivery.offset,
        "timestamp_ms": delivery.timestamp_ms,
        "timestamp": format_time_ms(delivery.timestamp_ms),
        "key": delivery.routing_key,
        "headers": headers,
        "size": delivery.body.len(),
        "body": text,
        "body_base64": match text {
            Some(_) => None,
            None => Some(base64::engine::general_purpose::STANDARD.encode(&delivery.body)),
        },
        "seq": publish_seq(&delivery.body),
        "moved_from": delivery.moved_from,
    })
}

/// `partition=0 offset=12 timestamp=2026-12-04T14:00:00.123Z key=k1 body=hello`; a binary
/// body shows its size, its `keratin publish` sequence number or its first bytes in hex.
fn delivery_text(delivery: &StreamDelivery) -> String {
    // A body `keratin publish` wrote (sequence number and checksum) can be valid UTF-8 too.
    let body = match (
        publish_seq(&delivery.body),
        std::str::from_utf8(&delivery.body),
    ) {
        (Some(seq), _) => format!("<{} bytes, seq {seq}>", delivery.body.len()),
        (None, Ok(text)) => escape_controls(text),
        (None, Err(_)) => {
            let shown = &delivery.body[..delivery.body.len().min(BODY_HEX_SHOWN_BYTES)];
            let hex: String = shown.iter().map(|b| format!("{b:02x}")).collect();
            let more = if shown.len() < delivery.body.len() {
                "..."
            } else {
                ""
            };
            format!("<{} bytes: {hex}{more}>", delivery.body.len())
        }
    };
    format!(
        "partition={} offset={} timestamp={} key={} body={body}",
        delivery.partition,
        delivery.offset,
        format_time_ms(delivery.timestamp_ms),
        delivery
            .routing_key
            .as_deref()
            .map_or_else(|| "-".to_owned(), escape_controls),
    )
}

/// `text` with its control characters escaped (`\n`, `\t`, `\r`, others as `\x1b` or
/// `\u{9b}`), so that a message cannot move the cursor, recolour or retitle the terminal it is
/// printed on, and one message stays one line. Other characters, backslashes included, are
/// left as they are.
fn escape_controls(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => escaped.push_str("\\n"),
            '\t' => escaped.push_str("\\t"),
            '\r' => escaped.push_str("\\r"),
            c if c.is_control() && u32::from(c) < 0x80 => {
                escaped.push_str(&format!("\\x{:02x}", u32::from(c)))
            }
            c if c.is_control() => escaped.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: StreamArgs,
    }

    fn parse(args: &[&str]) -> Result<StreamVerb, clap::Error> {
        Cli::try_parse_from([&["keratin"], args].concat()).map(|cli| cli.args.verb)
    }

    #[test]
    fn starts_are_named_offsets_or_times() {
        assert_eq!(parse_start("first"), Ok(StreamStart::First));
        assert_eq!(parse_start("last"), Ok(StreamStart::Last));
        assert_eq!(parse_start("next"), Ok(StreamStart::Next));
        assert_eq!(parse_start("42"), Ok(StreamStart::Offset(42)));
        assert_eq!(
            parse_start("@1700000000000"),
            Ok(StreamStart::Timestamp(1_700_000_000_000))
        );
        assert_eq!(
            parse_start("2023-11-14T22:13:20Z"),
            Ok(StreamStart::Timestamp(1_700_000_000_000))
        );
        assert!(parse_start("yesterday").is_err());
        assert!(parse_start("@soon").is_err());
        assert!(parse_start("-1").is_err());
    }

    #[test]
    fn declare_parses_sizes_durations_and_nodes() {
        let verb = parse(&[
            "declare",
            "events",
            "--partitions",
            "4",
            "--max-bytes",
            "10GiB",
            "--max-age",
            "7d",
            "--max-messages",
            "1000000",
            "--nodes",
            "1,2,3",
        ])
        .unwrap();
        let StreamVerb::Declare(declare) = verb else {
            panic!("{verb:?}");
        };
        assert_eq!(declare.partitions, 4);
        assert_eq!(declare.max_bytes, Some(10 << 30));
        assert_eq!(declare.max_age_ms, Some(7 * 86_400_000));
        assert_eq!(declare.max_messages, Some(1_000_000));
        assert_eq!(declare.nodes, vec![1, 2, 3]);
        assert!(
            parse(&["declare", "e", "--max-age", "7"]).is_err(),
            "a unit is required"
        );
        assert!(parse(&["declare", "e", "--max-bytes", "lots"]).is_err());
    }

    #[test]
    fn set_keeps_clears_or_sets_each_bound() {
        let verb = parse(&["set", "events", "--max-bytes", "none", "--max-age", "12h"]).unwrap();
        let StreamVerb::Set(set) = verb else {
            panic!("{verb:?}");
        };
        let max_bytes = parse_update("--max-bytes", set.max_bytes.as_deref(), parse_size);
        assert_eq!(max_bytes.unwrap(), Update::Clear);
        let max_age = parse_update("--max-age", set.max_age.as_deref(), parse_duration_ms);
        assert_eq!(max_age.unwrap(), Update::Set(43_200_000));
        let max_messages = parse_update("--max-messages", set.max_messages.as_deref(), parse_count);
        assert_eq!(max_messages.unwrap(), Update::Keep);
        let error = parse_update("--max-age", Some("soon"), parse_duration_ms).unwrap_err();
        assert!(error.message.contains("--max-age") && error.message.contains("none"));
    }

    #[test]
    fn read_defaults_to_new_messages_and_commit_needs_a_cursor() {
        let StreamVerb::Read(read) = parse(&["read", "events"]).unwrap() else {
            panic!("not read");
        };
        assert_eq!(read.from, StreamStart::Next);
        assert_eq!((read.count, read.idle_timeout_ms), (None, None));
        assert_eq!(read.credit, STREAM_CREDIT_DEFAULT);
        let StreamVerb::Read(read) = parse(&[
            "read",
            "events",
            "--from",
            "first",
            "--count",
            "10",
            "--cursor",
            "billing",
            "--commit",
            "--partition",
            "0",
            "--partition",
            "3",
            "--idle-timeout",
            "2s",
        ])
        .unwrap() else {
            panic!("not read");
        };
        assert_eq!(read.from, StreamStart::First);
        assert_eq!(read.count, Some(10));
        assert_eq!(read.partitions, vec![0, 3]);
        assert_eq!(read.idle_timeout_ms, Some(2000));
        assert!(read.commit);
        assert!(parse(&["read", "events", "--commit"]).is_err());
        assert!(parse(&["read", "events", "--credit", "0"]).is_err());
    }

    #[test]
    fn a_message_prints_its_place_key_and_body() {
        let mut delivery = StreamDelivery {
            partition: 1,
            offset: 12,
            timestamp_ms: 1_700_000_000_500,
            routing_key: Some("k1".into()),
            headers: Vec::new(),
            body: "hello".into(),
            moved_from: None,
        };
        assert_eq!(
            delivery_text(&delivery),
            "partition=1 offset=12 timestamp=2023-11-14T22:13:20.500Z key=k1 body=hello"
        );
        let object = delivery_json(&delivery);
        assert_eq!(object["body"], "hello");
        assert_eq!(object["body_base64"], Value::Null);
        assert_eq!(object["key"], "k1");
        delivery.body = body::encode(7, 64).into();
        delivery.routing_key = None;
        let text = delivery_text(&delivery);
        assert!(text.ends_with("key=- body=<64 bytes, seq 7>"), "{text}");
        let object = delivery_json(&delivery);
        assert_eq!(
            (object["seq"].as_u64(), object["size"].as_u64()),
            (Some(7), Some(64))
        );
        assert!(object["body_base64"].is_string());
        delivery.body = vec![0xff; 40].into();
        let text = delivery_text(&delivery);
        assert!(
            text.ends_with(&format!("<40 bytes: {}...>", "ff".repeat(32))),
            "{text}"
        );
    }

    #[test]
    fn retention_prints_in_its_units() {
        let settings = StreamSettings {
            partitions: 2,
            replicas: None,
            max_bytes: Some(1 << 30),
            max_age_ms: Some(7 * 86_400_000),
            max_messages: None,
        };
        assert_eq!(
            retention_text(&settings),
            "max_bytes=1.0 GiB max_age=7d max_messages=none"
        );
        assert_eq!(duration_text(1500), "1500ms");
        assert_eq!(duration_text(90 * 60_000), "90m");
    }
}
