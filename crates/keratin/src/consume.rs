//! `keratin consume`: receives up to `--count` messages (or until the queue stays idle for
//! `--idle-timeout`), acknowledges or rejects each, optionally checks each body's CRC32C (see
//! `body.rs`), and prints one summary.
//!
//! Owns the stop rule (count reached, idle, or the stream ended) and the counting. Batching
//! acks into frames belongs to the client.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::ProgressBar;
use keratin_client::{Consumer, Delivery, PREFETCH_MAX};
use serde_json::{json, Value};

use crate::body::{self, Checked};
use crate::connect::{connect, CommonArgs};
use crate::output::{
    count_of, elapsed_ms, print_json, progress, rate_per_s, rate_text, write_seqs, Failure,
};
use crate::units::parse_duration_ms;

/// Default of `--prefetch`: enough deliveries on the way to hide a round trip at tens of
/// thousands of messages per second, at most ~1 MiB of 1 KiB bodies held here.
const PREFETCH_DEFAULT: u32 = 1000;
/// The idle wait of `--idle-timeout` is counted in slices this long (see `recv_unless_idle`):
/// short enough that a stopped and resumed process loses at most this much of its idle wait.
const IDLE_SLICE: Duration = Duration::from_millis(100);
/// Default of `--idle-timeout` when `--count` is not given: long enough to ride out a broker's
/// group commit and a slow publisher, short enough for a script.
const IDLE_EXIT_MS_DEFAULT: u64 = 2000;
/// A consume that waits for `--count` messages without an idle timeout says, once, after this
/// long without a message, what it waits for and how to stop it.
const WAITING_HINT_AFTER: Duration = Duration::from_secs(5);

/// Flags of `keratin consume`.
#[derive(Debug, Args)]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The queue to consume.
    queue: String,
    /// Stop after this many messages. Without it, stop when idle (see --idle-timeout).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Most unacknowledged deliveries the broker sends ahead.
    #[arg(long, value_name = "P", default_value_t = PREFETCH_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(PREFETCH_MAX)))]
    prefetch: u32,
    /// Most unacknowledged payload bytes the broker sends ahead (a larger message still comes,
    /// alone). Without it, only --prefetch bounds the deliveries on the way.
    #[arg(long = "prefetch-bytes", value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1..))]
    prefetch_bytes: Option<u64>,
    /// Reject each message without requeue (it goes to the dead-letter queue, if any).
    #[arg(long, conflicts_with = "requeue")]
    reject: bool,
    /// Reject each message with requeue (it returns to ready and is redelivered).
    #[arg(long)]
    requeue: bool,
    /// Stop once no message arrived for this long (ms, s, m, h: for example 5s; running time:
    /// a stopped and resumed process does not count the stop). Default 2s without --count;
    /// with --count, no idle exit unless given.
    #[arg(long = "idle-timeout", value_name = "DUR", value_parser = parse_duration_ms)]
    idle_timeout_ms: Option<u64>,
    /// --idle-timeout in milliseconds (the older spelling).
    #[arg(
        long = "idle-exit-ms",
        value_name = "MS",
        conflicts_with = "idle_timeout_ms"
    )]
    idle_exit_ms: Option<u64>,
    /// Check each body's CRC32C (bodies written by `keratin publish`); count the bad ones.
    #[arg(long)]
    verify: bool,
    /// Write the sequence number of every message received to FILE, one per line, in order.
    #[arg(long = "record-seqs", value_name = "FILE")]
    record_seqs: Option<PathBuf>,
}

/// What a run did.
#[derive(Debug, Default)]
struct Tally {
    received: u64,
    acked: u64,
    rejected: u64,
    requeued: u64,
    corrupt: u64,
    redelivered: u64,
    duplicates: u64,
    settle_failed: u64,
    seen: HashSet<u64>,
    seqs: Vec<u64>,
    ended: Option<&'static str>,
    /// The waiting hint was printed (once per run).
    hinted: bool,
    /// From subscribing to the last delivery: the rate leaves out the idle wait at the end.
    active: Duration,
}

/// Runs `keratin consume`.
pub async fn run(args: ConsumeArgs) -> Result<ExitCode, Failure> {
    let idle = args
        .idle_timeout_ms
        .or(args.idle_exit_ms)
        .or(if args.count.is_none() {
            Some(IDLE_EXIT_MS_DEFAULT)
        } else {
            None
        })
        .map(Duration::from_millis);
    let client = connect(&args.common, None).await?;
    let mut consumer = client
        .subscribe_with_bytes(&args.queue, args.prefetch, args.prefetch_bytes)
        .await
        .map_err(|error| Failure::client(format!("subscribe to {}", args.queue), &error))?;
    let bar = progress(args.count, args.common.json, "consume");
    let started = Instant::now();
    let mut tally = Tally::default();
    while args.count.is_none_or(|count| tally.received < count) {
        let waiting = Waiting {
            queue: &args.queue,
            count: args.count,
            bar: &bar,
        };
        let Some(delivery) = next_delivery(&mut consumer, idle, &mut tally, waiting).await else {
            break;
        };
        settle(&args, &delivery, &mut tally);
        tally.active = started.elapsed();
        bar.inc(1);
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    // Cancelling sends every ack queued above before the Cancel; deliveries still buffered
    // here return to ready on the broker.
    if let Err(error) = consumer.cancel().await {
        eprintln!("keratin: cancelling the consumer: {error}");
    }
    client.close().await;
    if let Some(path) = &args.record_seqs {
        write_seqs(path, &tally.seqs)?;
    }
    report(&args, &tally, elapsed);
    let complete = args.count.is_none_or(|count| tally.received == count)
        && tally.corrupt == 0
        && tally.settle_failed == 0;
    Ok(if complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What a consume without an idle timeout says when it waits long (see [`WAITING_HINT_AFTER`]).
struct Waiting<'a> {
    queue: &'a str,
    count: Option<u64>,
    bar: &'a ProgressBar,
}

async fn next_delivery(
    consumer: &mut Consumer,
    idle: Option<Duration>,
    tally: &mut Tally,
    waiting: Waiting<'_>,
) -> Option<Delivery> {
    let received = match idle {
        Some(idle) => match recv_unless_idle(consumer, idle).await {
            Some(received) => received,
            None => {
                tally.ended = Some("idle");
                return None;
            }
        },
        None => match tokio::time::timeout(WAITING_HINT_AFTER, consumer.recv()).await {
            Ok(received) => received,
            Err(_) => {
                if !tally.hinted {
                    tally.hinted = true;
                    let count = waiting
                        .count
                        .map_or_else(String::new, |count| format!(" of {count}"));
                    waiting.bar.suspend(|| {
                        eprintln!(
                            "keratin: waiting for messages on {}: {} received{count}, none for \
                             {}s; Ctrl-C stops (unsettled deliveries go back to the queue), \
                             --idle-timeout 5s stops after 5 s without one",
                            waiting.queue,
                            tally.received,
                            WAITING_HINT_AFTER.as_secs()
                        )
                    });
                }
                consumer.recv().await
            }
        },
    };
    if received.is_none() {
        tally.ended = Some("stream ended (consumer cancelled or connection lost)");
    }
    received
}

/// `consumer.recv()`, or `None` once no delivery came for `idle` of running time. The wait is
/// counted in slices of [`IDLE_SLICE`], each counting at most its own length: a process that
/// was stopped (SIGSTOP, a suspended machine) and resumed counts the stop as one slice, so it
/// does not give up while deliveries wait in its socket (a single timer would fire on resume).
async fn recv_unless_idle(consumer: &mut Consumer, idle: Duration) -> Option<Option<Delivery>> {
    let mut waited = Duration::ZERO;
    while waited < idle {
        let slice = IDLE_SLICE.min(idle - waited);
        if let Ok(received) = tokio::time::timeout(slice, consumer.recv()).await {
            return Some(received);
        }
        waited += slice;
    }
    None
}

fn settle(args: &ConsumeArgs, delivery: &Delivery, tally: &mut Tally) {
    tally.received += 1;
    if delivery.redelivered {
        tally.redelivered += 1;
    }
    let seq = if args.verify {
        match body::check(&delivery.body) {
            Checked::Intact { seq } => Some(seq),
            Checked::Corrupt { seq } => {
                tally.corrupt += 1;
                eprintln!(
                    "keratin: corrupt body (partition {}, offset {}, {} bytes, seq {seq:?})",
                    delivery.partition,
                    delivery.offset,
                    delivery.body.len()
                );
                seq
            }
        }
    } else {
        body::seq(&delivery.body)
    };
    if let Some(seq) = seq {
        if !tally.seen.insert(seq) {
            tally.duplicates += 1;
        }
        if args.record_seqs.is_some() {
            tally.seqs.push(seq);
        }
    }
    let settled = if args.reject || args.requeue {
        delivery.reject(args.requeue)
    } else {
        delivery.ack()
    };
    match settled {
        Ok(()) if args.reject || args.requeue => {
            tally.rejected += 1;
            tally.requeued += u64::from(args.requeue);
        }
        Ok(()) => tally.acked += 1,
        Err(error) => {
            if tally.settle_failed == 0 {
                eprintln!("keratin: settling a delivery failed: {error}");
            }
            tally.settle_failed += 1;
        }
    }
}

fn summary_json(args: &ConsumeArgs, tally: &Tally, elapsed: Duration) -> Value {
    json!({
        "queue": args.queue,
        "received": tally.received,
        "acked": tally.acked,
        "rejected": tally.rejected,
        "requeued": tally.requeued,
        "corrupt": tally.corrupt,
        "redelivered": tally.redelivered,
        "duplicates": tally.duplicates,
        "settle_failed": tally.settle_failed,
        "verified": args.verify,
        "elapsed_ms": elapsed_ms(elapsed),
        "rate_per_s": rate_per_s(tally.received, tally.active),
        "ended": tally.ended.unwrap_or("count reached"),
    })
}

fn report(args: &ConsumeArgs, tally: &Tally, elapsed: Duration) {
    if args.common.json {
        print_json(&summary_json(args, tally, elapsed));
        return;
    }
    outln!(
        "received {} from {} in {} ms{}: {} acked, {} rejected ({} requeued), \
         {} redelivered, {} duplicates{}",
        count_of(tally.received, "message"),
        args.queue,
        elapsed_ms(elapsed),
        rate_text(tally.received, tally.active),
        tally.acked,
        tally.rejected,
        tally.requeued,
        tally.redelivered,
        tally.duplicates,
        if args.verify {
            format!(", {} corrupt", tally.corrupt)
        } else {
            String::new()
        }
    );
    if let Some(ended) = tally.ended {
        outln!("stopped: {ended}");
    }
}
