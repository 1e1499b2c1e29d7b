//! The log's API on both the simulated disk and the real file system: append and read back,
//! rolls, reopen, truncation, prefix removal, figures. A failure here means the log returns
//! something other than what was appended, or loses what it reported durable across a reopen.

mod common;

use common::{on_both, payload, record, small_options};
use keratin_log::LogError;

#[test]
fn append_read_and_reopen() {
    on_both(|env| {
        let options = small_options();
        let log = env.open(&options);
        let mut expected = Vec::new();
        for i in 0..300u64 {
            let body = payload(i, 0, 100 + (i as usize * 37) % 3000);
            let offsets = log.append_sync(&[record(&body)]).expect("append");
            assert_eq!(offsets, i..i + 1, "{}", env.name());
            expected.push(body);
        }
        let stats = log.stats();
        assert!(stats.segments.len() > 1, "small segments roll: {stats:?}");
        for (i, body) in expected.iter().enumerate() {
            assert_eq!(&log.read(i as u64).expect("read").payload, body);
        }
        let all: Vec<_> = log.reader(0).map(|r| r.expect("iterate").payload).collect();
        assert_eq!(all, expected);
        log.close().expect("close");

        let log = env.open(&options);
        assert_eq!(log.next_offset(), 300);
        let all: Vec<_> = log.reader(0).map(|r| r.expect("iterate").payload).collect();
        assert_eq!(all, expected, "{}: reopened log differs", env.name());
        assert_eq!(
            log.append_sync(&[record(b"more")]).expect("append"),
            300..301
        );
    });
}

#[test]
fn batches_and_concurrent_appenders_share_syncs() {
    on_both(|env| {
        let log = std::sync::Arc::new(env.open(&small_options()));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    for i in 0..50u64 {
                        let a = payload(t * 1000 + i, 1, 200);
                        let b = payload(t * 1000 + i, 2, 200);
                        let offsets = log.append_sync(&[record(&a), record(&b)]).expect("append");
                        assert_eq!(offsets.end - offsets.start, 2);
                        got.push((offsets.start, a));
                        got.push((offsets.start + 1, b));
                    }
                    got
                })
            })
            .collect();
        for thread in threads {
            for (offset, body) in thread.join().expect("appender") {
                assert_eq!(log.read(offset).expect("read").payload, body);
            }
        }
        assert_eq!(log.durable_offset(), 800);
    });
}

#[test]
fn truncate_suffix_inside_and_at_segment_boundaries() {
    on_both(|env| {
        let options = small_options();
        let log = env.open(&options);
        for i in 0..400u64 {
            log.append_sync(&[record(&payload(i, 0, 1500))])
                .expect("append");
        }
        let stats = log.stats();
        let boundary = stats.segments[2].base_offset;
        // Inside a segment.
        log.truncate_suffix(350)
            .expect("submit")
            .wait()
            .expect("truncate");
        assert_eq!(log.next_offset(), 350);
        assert!(matches!(log.read(350), Err(LogError::OutOfRange { .. })));
        // Exactly at a segment's base: that segment goes, the one before becomes active.
        log.truncate_suffix(boundary)
            .expect("submit")
            .wait()
            .expect("truncate");
        assert_eq!(log.stats().segments.len(), 2);
        for i in boundary..boundary + 20 {
            log.append_sync(&[record(&payload(i, 1, 700))])
                .expect("append");
        }
        log.close().expect("close");
        let log = env.open(&options);
        assert_eq!(log.next_offset(), boundary + 20);
        for (i, r) in log.reader(0).enumerate() {
            let r = r.expect("read");
            let version = if (i as u64) < boundary { 0 } else { 1 };
            let len = if version == 0 { 1500 } else { 700 };
            assert_eq!(r.payload, payload(i as u64, version, len), "offset {i}");
        }
        // Truncating everything keeps the log's place.
        log.truncate_suffix(0)
            .expect("submit")
            .wait()
            .expect("truncate");
        assert_eq!(log.next_offset(), 0);
        assert!(
            log.truncate_suffix(5).is_err(),
            "cannot truncate past the end"
        );
    });
}

#[test]
fn remove_prefix_frees_whole_segments_only() {
    on_both(|env| {
        let log = env.open(&small_options());
        for i in 0..1200u64 {
            log.append_sync(&[record(&payload(i, 0, 1000))])
                .expect("append");
        }
        let before = log.stats();
        let cut = before.segments[3].base_offset + 1;
        let removed = log
            .remove_prefix(cut)
            .expect("submit")
            .wait()
            .expect("remove");
        assert_eq!(removed.segments, 3);
        assert_eq!(removed.bytes, 3 * (256 << 10));
        assert_eq!(log.start_offset(), before.segments[3].base_offset);
        assert!(matches!(log.read(0), Err(LogError::OutOfRange { .. })));
        assert_eq!(log.read(cut).expect("read").payload, payload(cut, 0, 1000));
        // The active segment is never removed.
        let removed = log
            .remove_prefix(u64::MAX)
            .expect("submit")
            .wait()
            .expect("remove");
        assert_eq!(log.stats().segments.len(), 1, "{removed:?}");
        log.append_sync(&[record(b"after")]).expect("append");
    });
}

#[test]
fn explicit_roll_and_figures() {
    on_both(|env| {
        let log = env.open(&small_options());
        log.append_sync(&[record(b"a"), record(b"b")])
            .expect("append");
        log.roll().expect("submit").wait().expect("roll");
        log.roll()
            .expect("submit")
            .wait()
            .expect("roll of an empty segment");
        let stats = log.stats();
        assert_eq!(stats.segments.len(), 2);
        assert_eq!(stats.segments[1].base_offset, 2);
        assert_eq!(stats.segments[0].next_offset, 2);
        // Fresh files hold their first preallocation step, not the whole segment.
        assert_eq!(stats.disk_bytes, 2 * (64 << 10));
        assert_eq!(stats.segments[0].used_bytes, 64 + 2 * 33);
    });
}

#[test]
fn oversized_records_and_bad_flags_are_refused() {
    on_both(|env| {
        let log = env.open(&small_options());
        let big = vec![0u8; 256 << 10];
        assert!(matches!(
            log.append(&[record(&big)]),
            Err(LogError::RecordTooLarge { .. })
        ));
        let mut bad = record(b"x");
        bad.flags = 0x80;
        assert!(matches!(log.append(&[bad]), Err(LogError::Invalid(_))));
        assert!(log.append(&[]).is_err());
    });
}
