//! A message whose dead-letter copy cannot be stored (its dead-letter queue is not declared)
//! waits in its queue, and the node says so: the `keratin_dead_letter_failures_total{queue,
//! reason}` counter and the `keratin_queue_dead_letters_held{queue}` gauge on `/metrics`, and
//! an active `dead_letter_failed` attention item for the queue naming the messages held. A
//! failure means the failure was silent, or the held messages were not counted.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use keratin_server::Node;

fn get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dead_letter_is_counted_and_raises_attention() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = common::node_config(dir.path());
    config.limits.sample_interval_ms = 20;
    let node = Node::start(&config).await.expect("start");
    let broker = node.broker().clone();
    let settings = keratin_broker::QueueSettings {
        dead_letter: Some("missing".into()),
        ..keratin_broker::QueueSettings::default()
    };
    broker.declare("orphan", settings).await.expect("declare");
    let messages = (0..2)
        .map(|i| keratin_broker::Message::new(vec![i; 10]))
        .collect();
    for result in broker.publish("orphan", messages).await {
        result.expect("publish");
    }
    let mut consumer = broker.subscribe("orphan", 10).expect("subscribe");
    for _ in 0..2 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.recv())
            .await
            .expect("a delivery")
            .expect("open");
        consumer.reject(&[d.tag], false);
    }
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let failures = r#"keratin_dead_letter_failures_total{queue="orphan",reason="not_found"} "#;
        let held = r#"keratin_queue_dead_letters_held{queue="orphan"} 2"#;
        loop {
            let metrics = get(http, "/metrics");
            let body = get(http, "/api/v1/attention?active=true");
            let doc: serde_json::Value = serde_json::from_str(&body).expect("json");
            let items = doc["items"].as_array().cloned().unwrap_or_default();
            let item = items
                .iter()
                .find(|i| i["kind"] == "dead_letter_failed" && i["subject"] == "orphan");
            // Each failed attempt of each message counts: at least the first two.
            let counted = metrics
                .lines()
                .find_map(|l| l.strip_prefix(failures)?.trim().parse::<u64>().ok())
                .is_some_and(|n| n >= 2);
            if counted && metrics.contains(held) {
                if let Some(item) = item {
                    assert_eq!(item["severity"], "warning", "{item}");
                    let message = item["message"].as_str().unwrap_or_default();
                    assert!(message.contains("missing"), "{message}");
                    assert!(message.contains("2 messages wait"), "{message}");
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no count or no item within 30 s:\n{metrics}\n{doc}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await;
    drop(consumer);
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}
