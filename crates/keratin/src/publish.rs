//! `keratin publish`: publishes `--count` numbered, checksummed bodies (see `body.rs`), either
//! confirmed with at most `--in-flight` publishes waiting for their confirm, or buffered
//! through the client's bounded buffer; then prints one summary.
//!
//! Owns the bookkeeping of a run (sent, confirmed, failed, error keys, confirmed sequence
//! numbers) and the rule "stop at the first failure unless `--keep-going`". Retrying on
//! `ERR_LIMITED` belongs to the client (within `--timeout-ms`); a publish that timed out while
//! retrying a 429 is counted under its `429:<reason>` key.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use futures_util::stream::{FuturesUnordered, StreamExt};
use indicatif::ProgressBar;
use keratin_client::{BufferedOptions, Client, ClientError, DroppedPublishes, OutgoingMessage};
use serde_json::{json, Value};

use crate::body;
use crate::connect::{connect, CommonArgs};
use crate::output::{
    count_of, elapsed_ms, error_key, print_json, progress, rate_per_s, rate_text, write_seqs,
    ErrorCounts, Failure,
};

/// Default of `--in-flight`: 1,000 confirmed publishes waiting at once keep a broker's group
/// commit full (one fsync covers many) while holding at most ~1 MiB of 1 KiB bodies here.
const IN_FLIGHT_DEFAULT: u32 = 1000;
/// Default of `--size`: the 1 KiB message of the benchmarks.
const SIZE_BYTES_DEFAULT: usize = 1024;

/// Flags of `keratin publish`.
#[derive(Debug, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The queue or stream to publish to (it must exist).
    queue: String,
    /// How many messages to publish.
    #[arg(long, value_name = "N")]
    count: u64,
    /// Body size in bytes, at least 12 (sequence number 8 + CRC32C 4).
    #[arg(long, value_name = "BYTES", default_value_t = SIZE_BYTES_DEFAULT)]
    size: usize,
    /// Wait for each message to be durable (the default).
    #[arg(long, conflicts_with = "buffered")]
    confirm: bool,
    /// Publish without confirms through a bounded buffer; failures come back on the
    /// dropped-publish path and are counted.
    #[arg(long)]
    buffered: bool,
    /// Most messages waiting for their confirm (or, buffered, unsettled in the buffer).
    #[arg(long = "in-flight", value_name = "K", default_value_t = IN_FLIGHT_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..))]
    in_flight: u32,
    /// Time one confirmed publish may take, retries after 429 included (client default 30000).
    #[arg(long = "timeout-ms", value_name = "MS")]
    timeout_ms: Option<u64>,
    /// Go on after a failed publish instead of stopping at the first one.
    #[arg(long = "keep-going")]
    keep_going: bool,
    /// Give every message this routing key: a stream puts all messages of one key in one
    /// partition, in order (`keratin stream`). (`--key` is the client certificate's key.)
    #[arg(long = "routing-key", value_name = "KEY")]
    routing_key: Option<String>,
    /// Sequence number of the first message; the others follow one by one.
    #[arg(long = "start-seq", value_name = "SEQ", default_value_t = 0)]
    start_seq: u64,
    /// Write the sequence numbers of confirmed (buffered: accepted) messages to FILE, one per
    /// line, sorted.
    #[arg(long = "record-seqs", value_name = "FILE")]
    record_seqs: Option<PathBuf>,
}

/// What a run did. Every sent message ends confirmed or failed: `sent == confirmed + failed`.
#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    confirmed: u64,
    failed: u64,
    errors: ErrorCounts,
    first_error: Option<String>,
    confirmed_seqs: Vec<u64>,
}

impl Tally {
    fn fail(&mut self, error: &ClientError) {
        self.failed += 1;
        self.errors.add(error_key(error));
        if self.first_error.is_none() {
            self.first_error = Some(error.to_string());
        }
    }
}

/// Runs `keratin publish`.
pub async fn run(args: PublishArgs) -> Result<ExitCode, Failure> {
    if args.size < body::BODY_SIZE_BYTES_MIN {
        return Err(Failure::new(format!(
            "--size {} is too small: a body holds at least a sequence number and a CRC32C ({} bytes)",
            args.size,
            body::BODY_SIZE_BYTES_MIN
        )));
    }
    let timeout = args.timeout_ms.map(Duration::from_millis);
    let client = connect(&args.common, timeout).await?;
    let bar = progress(Some(args.count), args.common.json, "publish");
    let started = Instant::now();
    let mut tally = Tally::default();
    if args.buffered {
        publish_buffered(&client, &args, &mut tally, &bar).await;
    } else {
        publish_confirmed(&client, &args, &mut tally, &bar).await;
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    client.close().await;
    tally.confirmed_seqs.sort_unstable();
    if let Some(path) = &args.record_seqs {
        write_seqs(path, &tally.confirmed_seqs)?;
    }
    report(&args, &tally, elapsed);
    let complete = tally.failed == 0 && tally.sent == args.count;
    Ok(if complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Keeps up to `--in-flight` confirmed publishes waiting; each resolves on its own.
async fn publish_confirmed(
    client: &Client,
    args: &PublishArgs,
    tally: &mut Tally,
    bar: &ProgressBar,
) {
    let in_flight_max = usize::try_from(args.in_flight).unwrap_or(usize::MAX);
    let recording = args.record_seqs.is_some();
    let end_seq = args.start_seq.saturating_add(args.count);
    let mut next_seq = args.start_seq;
    let mut in_flight = FuturesUnordered::new();
    let mut stopping = false;
    loop {
        while !stopping && next_seq < end_seq && in_flight.len() < in_flight_max {
            let client = client.clone();
            let queue = args.queue.clone();
            let seq = next_seq;
            let message = outgoing(args, seq);
            in_flight.push(async move { (seq, client.publish(&queue, message).await) });
            next_seq += 1;
            tally.sent += 1;
        }
        // Publishes already sent are waited for even when stopping: their outcome is counted.
        let Some((seq, result)) = in_flight.next().await else {
            break;
        };
        bar.inc(1);
        match result {
            Ok(_) => {
                tally.confirmed += 1;
                if recording {
                    tally.confirmed_seqs.push(seq);
                }
            }
            Err(failed) => {
                tally.fail(&failed.error);
                stopping |= !args.keep_going;
            }
        }
    }
}

/// Message `seq` of this run: its self-checking body and the `--key`, if given.
fn outgoing(args: &PublishArgs, seq: u64) -> OutgoingMessage {
    let message = OutgoingMessage::new(body::encode(seq, args.size));
    match &args.routing_key {
        Some(key) => message.with_routing_key(key.clone()),
        None => message,
    }
}

/// Sends through a buffered publisher with `--in-flight` slots, then flushes. A message is
/// accepted when it was settled without being reported on the dropped-publish path.
async fn publish_buffered(
    client: &Client,
    args: &PublishArgs,
    tally: &mut Tally,
    bar: &ProgressBar,
) {
    let capacity = usize::try_from(args.in_flight).unwrap_or(usize::MAX);
    let (publisher, mut dropped) =
        client.buffered_publisher(&args.queue, BufferedOptions { capacity });
    let end_seq = args.start_seq.saturating_add(args.count);
    let mut dropped_seqs = Vec::new();
    let mut accepted_seqs = Vec::new();
    for seq in args.start_seq..end_seq {
        let message = outgoing(args, seq);
        tally.sent += 1;
        if let Err(failed) = publisher.send(message).await {
            // The connection is gone: nothing more can be sent.
            tally.fail(&failed.error);
            dropped_seqs.push(seq);
            break;
        }
        accepted_seqs.push(seq);
        bar.inc(1);
        let before = tally.failed;
        drain_dropped(&mut dropped, tally, &mut dropped_seqs);
        if tally.failed > before && !args.keep_going {
            break;
        }
    }
    // A failed flush means the connection ended; its unsettled messages are on the dropped path.
    let _ = publisher.flush().await;
    drain_dropped(&mut dropped, tally, &mut dropped_seqs);
    let unreported = dropped.unreported_count();
    for _ in 0..unreported {
        tally.failed += 1;
        tally.errors.add("unreported".to_owned());
    }
    tally.confirmed = tally.sent.saturating_sub(tally.failed);
    if args.record_seqs.is_some() {
        dropped_seqs.sort_unstable();
        accepted_seqs.retain(|seq| dropped_seqs.binary_search(seq).is_err());
        tally.confirmed_seqs = accepted_seqs;
    }
}

fn drain_dropped(dropped: &mut DroppedPublishes, tally: &mut Tally, dropped_seqs: &mut Vec<u64>) {
    while let Some(report) = dropped.try_recv() {
        tally.fail(&report.error);
        if let Some(seq) = body::seq(&report.message.body) {
            dropped_seqs.push(seq);
        }
    }
}

fn summary_json(args: &PublishArgs, tally: &Tally, elapsed: Duration) -> Value {
    let last_seq = (tally.sent > 0).then(|| args.start_seq + tally.sent - 1);
    let mut summary = json!({
        "queue": args.queue,
        "mode": if args.buffered { "buffered" } else { "confirmed" },
        "key": args.routing_key,
        "sent": tally.sent,
        "confirmed": tally.confirmed,
        "failed": tally.failed,
        "errors": tally.errors.to_json(),
        "elapsed_ms": elapsed_ms(elapsed),
        "first_seq": (tally.sent > 0).then_some(args.start_seq),
        "last_seq": last_seq,
        "rate_per_s": rate_per_s(tally.confirmed, elapsed),
    });
    if let (Some(path), Some(object)) = (&args.record_seqs, summary.as_object_mut()) {
        object.insert("confirmed_seqs".into(), json!(tally.confirmed_seqs.len()));
        object.insert("record_seqs".into(), json!(path.display().to_string()));
    }
    summary
}

/// The text summary: `published 10 messages to q (confirmed): all 10 confirmed in 12 ms (833
/// msg/s)`, or, short of that, what was sent, what came back and what failed.
fn summary_text(
    queue: &str,
    mode: &str,
    accepted: &str,
    (sent, asked): (u64, u64),
    (confirmed, failed): (u64, u64),
    elapsed: Duration,
) -> String {
    let took = format!(
        "in {} ms{}",
        elapsed_ms(elapsed),
        rate_text(confirmed, elapsed)
    );
    if sent == asked && confirmed == sent && failed == 0 {
        let all = if sent == 1 { "" } else { "all " };
        return format!(
            "published {} to {queue} ({mode}): {all}{confirmed} {accepted} {took}",
            count_of(sent, "message")
        );
    }
    format!(
        "published {sent} of {} to {queue} ({mode}): {confirmed} {accepted}, {failed} failed {took}",
        count_of(asked, "message")
    )
}

fn report(args: &PublishArgs, tally: &Tally, elapsed: Duration) {
    if let Some(first_error) = &tally.first_error {
        eprintln!("keratin: first failed publish: {first_error}");
    }
    if args.common.json {
        print_json(&summary_json(args, tally, elapsed));
        return;
    }
    let mode = if args.buffered {
        "buffered"
    } else {
        "confirmed"
    };
    let accepted = if args.buffered {
        "accepted"
    } else {
        "confirmed"
    };
    outln!(
        "{}",
        summary_text(
            &args.queue,
            mode,
            accepted,
            (tally.sent, args.count),
            (tally.confirmed, tally.failed),
            elapsed
        )
    );
    if tally.failed > 0 {
        outln!("errors: {}", tally.errors.summary());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_reads_as_english() {
        let ms = Duration::from_millis(10);
        assert_eq!(
            summary_text("q", "confirmed", "confirmed", (10, 10), (10, 0), ms),
            "published 10 messages to q (confirmed): all 10 confirmed in 10 ms (1000 msg/s)"
        );
        assert_eq!(
            summary_text("q", "confirmed", "confirmed", (1, 1), (1, 0), ms),
            "published 1 message to q (confirmed): 1 confirmed in 10 ms (100 msg/s)"
        );
        assert_eq!(
            summary_text("q", "confirmed", "confirmed", (10, 10), (0, 10), ms),
            "published 10 of 10 messages to q (confirmed): 0 confirmed, 10 failed in 10 ms"
        );
    }
}
