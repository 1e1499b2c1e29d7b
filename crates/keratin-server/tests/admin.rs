//! The HTTP admin port of a node in process: `/health`, the queue JSON, `/api/v1/status` with
//! the fields operators' scripts rely on, and `/metrics` in the Prometheus text format with the
//! level, space, spare, pool and publish-limit figures. A failure means a documented field or
//! metric went missing or the text stopped parsing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use keratin_server::config::Config;
use keratin_server::Node;

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_queues_and_metrics() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    let node = Node::start(&config).await.expect("start");
    node.broker()
        .declare("q", keratin_broker::QueueSettings::default())
        .await
        .expect("declare");
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let (code, body) = get(http, "/health");
        assert_eq!(code, 200, "{body}");
        let (code, body) = get(http, "/api/v1/queues/missing");
        assert_eq!(code, 404, "{body}");
        let (code, body) = get(http, "/api/v1/queues/q");
        assert_eq!(code, 200);
        let q: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(q["name"], "q");
        let (_, body) = get(http, "/api/v1/status");
        let s: serde_json::Value = serde_json::from_str(&body).expect("json");
        for key in [
            "path",
            "device",
            "total_bytes",
            "free_bytes",
            "spare_bytes",
            "level",
        ] {
            assert!(
                !s["filesystems"][0][key].is_null(),
                "filesystems[0].{key}: {s}"
            );
        }
        for key in ["resident_bytes", "limit_bytes", "limit_source", "level"] {
            assert!(!s["memory"][key].is_null(), "memory.{key}: {s}");
        }
        assert!(s["node"].is_string());
        let (code, metrics) = get(http, "/metrics");
        assert_eq!(code, 200);
        for name in [
            "keratin_disk_level",
            "keratin_disk_free_bytes",
            "keratin_disk_spare_bytes",
            "keratin_memory_resident_bytes",
            "keratin_publishes_rejected_total",
            "keratin_publishes_delayed_total",
            "keratin_pool_takes_fresh_total",
            "keratin_queue_ready_messages",
        ] {
            assert!(metrics.contains(name), "{name} missing from /metrics");
        }
        // Every sample line is `name{labels} value` with a numeric value.
        for line in metrics
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let value = line.rsplit(' ').next().expect("value");
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
            assert!(line.starts_with("keratin_"), "{line}");
        }
    })
    .await;
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}
