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
