//! A fixed amount of durable appends on the real file system: `LOGS` logs sharing one node pool,
//! `APPENDERS` threads per log, each appending `COUNT` records of `BYTES` bytes one at a time
//! and waiting for each to be durable. Prints the rate; time it as a whole process to compare
//! two builds (the work is the same, so the wall times compare).
//!
//! `cargo run --release -p keratin-log --example append_load -- DIR LOGS APPENDERS COUNT BYTES`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use keratin_log::{Io, Log, LogOptions, PoolOptions, RealIo, Record, SegmentPool};

fn arg(args: &[String], index: usize, default: usize) -> usize {
    args.get(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).map_or("/var/tmp/append-load", String::as_str));
    let (logs, appenders, count, bytes) = (
        arg(&args, 2, 1),
        arg(&args, 3, 8),
        arg(&args, 4, 1000),
        arg(&args, 5, 1024),
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let io: Arc<dyn Io> = Arc::new(RealIo::new());
    let pool = SegmentPool::new(io.clone(), PoolOptions::default());
    pool.add_storage_dir(&dir)?;
    let logs: Vec<Log> = (0..logs)
        .map(|i| {
            Log::open(
                io.clone(),
                &dir.join(format!("log-{i}")),
                LogOptions::default(),
                Some(pool.clone()),
            )
        })
        .collect::<Result<_, _>>()?;
    let payload = vec![0x5a_u8; bytes];
    let began = Instant::now();
    std::thread::scope(|scope| {
        for log in &logs {
            for _ in 0..appenders {
                let payload = &payload;
                scope.spawn(move || {
                    let record = Record {
                        record_type: 1,
                        flags: 0,
                        timestamp_ms: 0,
                        payload,
                    };
                    for _ in 0..count {
                        log.append(&[record])
                            .and_then(|ticket| ticket.wait())
                            .expect("durable append");
                    }
                });
            }
        }
    });
    let elapsed = began.elapsed();
    let total = logs.len() * appenders * count;
    eprintln!(
        "{total} appends ({} logs x {appenders} appenders) in {elapsed:?}: {:.0} appends/s",
        logs.len(),
        total as f64 / elapsed.as_secs_f64()
    );
    for log in logs {
        log.close()?;
    }
    drop(pool);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
