//! Streams on the HTTP admin port: `GET /api/v1/streams` lists a declared stream with its
//! settings and figures, `GET /api/v1/streams/{name}` adds its per-partition figures and its
//! cursors with their positions and lag, and a missing stream is 404. A failure means a
//! documented field went missing or a figure stopped matching what was published and committed.

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use keratin_broker::stream::StreamSettings;
use keratin_broker::Message;
use keratin_server::Node;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_their_cursors() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&common::node_config(dir.path()))
        .await
        .expect("start");
    let broker = node.broker();
    let settings = StreamSettings {
        partitions: 2,
        max_bytes: None,
        max_age_ms: Some(3_600_000),
        max_messages: None,
    };
    broker
        .declare_stream("clicks", settings, None, Vec::new())
        .await
        .expect("declare");
    let stream = broker.stream("clicks").expect("stream");
    let now_ms = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms");
    // Partition 0 holds 5, partition 1 holds 3.
    for (partition, count) in [(0, 5), (1, 3)] {
        let messages = (0..count).map(|i| Message::new(format!("m{i}"))).collect();
        stream
            .partition(partition)
            .expect("partition")
            .append(messages, now_ms)
            .await
            .expect("append");
    }
    // "reader" read 2 of partition 0 and nothing of partition 1: 3 + 3 behind.
    broker
        .commit_cursor("clicks", "reader", vec![(0, 2)])
        .await
        .expect("commit");

    // A group of one member that took partition 0 (partition 1 is assigned to it too, but
    // a member takes a partition only when its reader starts reading it).
    let member = stream.join_group("team").expect("join");
    assert!(member.acquire(0));
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let (code, list) = common::http(http, "GET", "/api/v1/streams");
        assert_eq!(code, 200, "{list}");
        let streams = list["streams"].as_array().expect("streams");
        assert_eq!(streams.len(), 1, "{list}");
        let s = &streams[0];
        assert_eq!(s["name"], "clicks");
        assert_eq!(s["settings"]["partitions"], 2);
        assert_eq!(s["settings"]["max_age_ms"], 3_600_000);
        assert_eq!(s["settings"]["max_bytes"], Value::Null);
        assert_eq!(s["messages"], 8, "{s}");
        assert_eq!(s["cursor_count"], 1, "{s}");
        assert!(s["disk_bytes"].as_u64().expect("disk_bytes") > 0, "{s}");
        assert_eq!(s["oldest_timestamp_ms"], now_ms, "{s}");
        assert!(
            s.get("cursors").is_none(),
            "the list leaves cursors out: {s}"
        );

        let (code, one) = common::http(http, "GET", "/api/v1/streams/clicks");
        assert_eq!(code, 200, "{one}");
        let partitions = one["partitions"].as_array().expect("partitions");
        assert_eq!(partitions.len(), 2, "{one}");
        assert_eq!(partitions[0]["index"], 0);
        assert_eq!(partitions[0]["start"], 0);
        assert_eq!(partitions[0]["end"], 5, "{one}");
        assert_eq!(partitions[1]["end"], 3, "{one}");
        assert_eq!(partitions[1]["stopped"], false);
        assert_eq!(
            (&partitions[1]["stops"], &partitions[1]["heals"]),
            (&0.into(), &0.into())
        );
        let groups = one["groups"].as_array().expect("groups");
        assert_eq!(groups.len(), 1, "{one}");
        assert_eq!(groups[0]["cursor"], "team");
        assert_eq!(
            groups[0]["members"][0]["partitions"],
            serde_json::json!([0]),
            "{one}"
        );
        let cursors = one["cursors"].as_array().expect("cursors");
        assert_eq!(cursors.len(), 1, "{one}");
        assert_eq!(cursors[0]["name"], "reader");
        assert_eq!(cursors[0]["positions"]["0"], 2, "{one}");
        assert_eq!(cursors[0]["lag"], 3 + 3, "{one}");

        let (code, missing) = common::http(http, "GET", "/api/v1/streams/missing");
        assert_eq!(code, 404, "{missing}");
        assert_eq!(missing["code"], 404);
    })
    .await;
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}

/// A failed disk call (on `SimIo`) stops a stream partition's log as it does a queue's: the
/// node raises `log_stopped` for the partition's directory, and once the log healed by itself
/// (the simulated disk works again) it clears the item and notes `log_healed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_stream_log_raises_attention_and_its_heal_clears_it() {
    use keratin_log::{SimFault, SimIo};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().expect("tmp");
    let mut config = common::node_config(dir.path());
    config.limits.sample_interval_ms = 20;
    let sim = SimIo::new(12);
    let node = Node::start_with_io(&config, std::sync::Arc::new(sim.clone()))
        .await
        .expect("start");
    let broker = node.broker().clone();
    broker
        .declare_stream("s", StreamSettings::default(), None, Vec::new())
        .await
        .expect("declare");
    let publish = |body: &'static [u8]| {
        let broker = broker.clone();
        async move {
            broker
                .publish("s", vec![Message::new(body.to_vec())])
                .await
                .remove(0)
        }
    };
    publish(b"first").await.expect("publish");
    sim.fail_at(sim.steps() + 1, SimFault::Eio);
    assert!(
        publish(b"lost").await.is_err(),
        "the failed disk call fails the append"
    );
    let partition_dir = broker.stream_info("s").expect("info").partition_dirs[0]
        .display()
        .to_string();
    let http = node.http_addr();
    let items = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, doc) = common::http(http, "GET", "/api/v1/attention");
            let items = doc["items"].as_array().cloned().unwrap_or_default();
            let of = |kind: &str| {
                items
                    .iter()
                    .find(|i| i["kind"] == kind && i["subject"] == partition_dir.as_str())
                    .cloned()
            };
            if let (Some(stopped), Some(healed)) = (of("log_stopped"), of("log_healed")) {
                if stopped["active"] == false {
                    return (stopped, healed);
                }
            }
            assert!(
                Instant::now() < deadline,
                "no stop and heal within 30 s: {doc}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .expect("checks");
    let (stopped, healed) = items;
    assert_eq!(stopped["severity"], "critical", "{stopped}");
    assert!(
        stopped["message"]
            .as_str()
            .is_some_and(|m| m.contains("stream s partition 0")),
        "{stopped}"
    );
    assert_eq!(healed["severity"], "info", "{healed}");
    publish(b"after")
        .await
        .expect("appends resume after the heal");
    node.shutdown().await.expect("shutdown");
}
