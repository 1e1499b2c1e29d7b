//! `overflow`: publishing into a full `drop_oldest` queue (every publish drops the oldest ready
//! message) against publishing into an unlimited queue, in process, same publishers, same run,
//! alternating which goes first (issue 7's benchmark).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keratin_broker::{Broker, BrokerConfig, Overflow, QueueSettings};

use crate::broker_bench::{message_batch, publish_loop, remove_and_settle, runtime, QUEUE};
use crate::contender::BenchResult;

/// What one run of the benchmark does.
#[derive(Debug, Clone)]
pub struct OverflowBenchConfig {
    /// Work directory (a fresh broker per run below it).
    pub dir: std::path::PathBuf,
    /// Seconds of publishing per run.
    pub duration: Duration,
    /// Rounds; the two cases alternate within them.
    pub rounds: usize,
    /// Concurrent publishers.
    pub publishers: usize,
    /// Messages per publish batch.
    pub batch: usize,
    /// Body bytes of a message.
    pub body_bytes: usize,
    /// The full queue's `max_messages`.
    pub max_messages: u64,
}

/// Confirmed messages per second into a fresh queue with `settings`, pre-filled with
/// `prefill` messages.
fn run_case(config: &OverflowBenchConfig, dir: &Path, limited: bool) -> BenchResult<f64> {
    remove_and_settle(dir)?;
    let rt = runtime()?;
    let result = rt.block_on(async {
        let broker = Broker::open(BrokerConfig::new(vec![dir.to_path_buf()])).await?;
        let settings = if limited {
            QueueSettings {
                max_messages: Some(config.max_messages),
                overflow: Some(Overflow::DropOldest),
                ..QueueSettings::default()
            }
        } else {
            QueueSettings::default()
        };
        broker.declare(QUEUE, settings).await?;
        // Both queues start with the same backlog, so that only the overflow differs.
        let fill = message_batch(1000, config.body_bytes);
        for _ in 0..config.max_messages.div_ceil(1000) {
            for r in broker.publish(QUEUE, fill.clone()).await {
                r.map_err(|e| format!("prefill: {e}"))?;
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopper = {
            let stop = stop.clone();
            let duration = config.duration;
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                stop.store(true, Ordering::Relaxed);
            })
        };
        let started = Instant::now();
        let batch = message_batch(config.batch, config.body_bytes);
        let (confirmed, _) = publish_loop(&broker, config.publishers, batch, stop, None).await?;
        let elapsed = started.elapsed().as_secs_f64();
        let _ = stopper.await;
        if limited {
            let info = broker.info(QUEUE)?;
            if info.ready() + info.inflight() > config.max_messages {
                return Err(format!("the full queue held {} messages", info.ready()).into());
            }
        }
        broker.shutdown().await?;
        Ok::<f64, Box<dyn std::error::Error + Send + Sync>>(confirmed as f64 / elapsed)
    });
    remove_and_settle(dir)?;
    result
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Run the benchmark and print its table.
pub fn run(config: &OverflowBenchConfig) -> BenchResult<()> {
    let dir = config
        .dir
        .join(format!("keratin-bench-overflow-{}", std::process::id()));
    let mut unlimited = Vec::new();
    let mut full = Vec::new();
    let mut ratios = Vec::new();
    for round in 0..config.rounds {
        let (a, b) = if round % 2 == 0 {
            let a = run_case(config, &dir, false)?;
            (a, run_case(config, &dir, true)?)
        } else {
            let b = run_case(config, &dir, true)?;
            (run_case(config, &dir, false)?, b)
        };
        eprintln!(
            "  round {round}: unlimited {a:.0} msg/s, full drop_oldest {b:.0} msg/s, ratio {:.2}",
            b / a
        );
        unlimited.push(a);
        full.push(b);
        ratios.push(b / a);
    }
    println!(
        "case                                   | msg/s      \n\
         ---------------------------------------|------------\n\
         unlimited queue                        | {:>10.0}\n\
         full drop_oldest queue (max {:>7})   | {:>10.0}\n\
         ratio full / unlimited (median)        | {:>10.2}   rounds: {}",
        median(unlimited),
        config.max_messages,
        median(full),
        median(ratios.clone()),
        ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "method: {} publishers x {}-message batches of {} B, {:.1} s per run, fresh broker per run, \
         both queues pre-filled with {} messages",
        config.publishers,
        config.batch,
        config.body_bytes,
        config.duration.as_secs_f64(),
        config.max_messages
    );
    Ok(())
}
