//! The node's metadata log is watched like a partition's: a failed write on it raises a
//! `log_stopped` attention item for its directory, counts in `keratin_log_stops_total`, and
//! once it heals by itself (the simulated disk works again) the item clears and the heal is
//! noted. A failure means a stopped metadata log, which holds back declares and settings
//! changes, went unseen or never healed.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use keratin_log::{SimFault, SimIo};
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
async fn a_stopped_metadata_log_raises_attention_and_heals_by_itself() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = common::node_config(dir.path());
    config.limits.sample_interval_ms = 20;
    let sim = SimIo::new(12);
    let node = Node::start_with_io(&config, std::sync::Arc::new(sim.clone()))
        .await
        .expect("start");
    let broker = node.broker().clone();
    // The node is idle: its next disk calls are the metadata record's write and sync.
    sim.fail_at(sim.steps(), SimFault::Eio);
    sim.fail_at(sim.steps() + 1, SimFault::Eio);
    let overrides = std::collections::BTreeMap::from([(
        "limits.sample_interval_ms".to_string(),
        serde_json::Value::from(20),
    )]);
    broker
        .set_node_settings(overrides)
        .await
        .expect_err("the failed disk call fails the metadata write");
    let meta_dir = broker.metadata_log().dir.display().to_string();
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let body = get(http, "/api/v1/attention");
            let doc: serde_json::Value = serde_json::from_str(&body).expect("json");
            let items = doc["items"].as_array().cloned().unwrap_or_default();
            let of_meta = |kind: &str| {
                items
                    .iter()
                    .find(|i| i["kind"] == kind && i["subject"] == meta_dir.as_str())
                    .cloned()
            };
            if let (Some(stopped), Some(_healed)) = (of_meta("log_stopped"), of_meta("log_healed"))
            {
                assert_eq!(stopped["active"], false, "cleared by the heal: {stopped}");
                let message = stopped["message"].as_str().unwrap_or_default();
                assert!(message.contains("metadata"), "{message}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no stop and heal within 30 s: {doc}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let metrics = get(http, "/metrics");
        assert!(
            metrics.lines().any(|l| l == "keratin_log_stops_total 1"),
            "{metrics}"
        );
    })
    .await;
    broker
        .declare("after", keratin_broker::QueueSettings::default())
        .await
        .expect("declare after the heal");
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}
