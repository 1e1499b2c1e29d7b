//! The HTTP admin port of a node in process: `/health`, the queue JSON, `/api/v1/status` with
//! the fields operators' scripts rely on, and `/metrics` in the Prometheus text format with the
//! level, space, spare, pool and publish-limit figures. A failure means a documented field or
//! metric went missing or the text stopped parsing.

mod common;

use std::net::SocketAddr;

use keratin_server::config::Config;
use keratin_server::Node;

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    common::http_text(addr, "GET", path, "")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_queues_and_metrics() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    common::host_disk_limits(&mut config);
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

/// A failed disk call (on `SimIo`) stops a partition's log: the node counts the stop, raises a
/// `log_stopped` attention item, heals the log by itself (the simulated disk works again), then
/// clears the item and notes the heal; `/metrics` and the queue JSON show one stop and one heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_log_raises_attention_and_its_heal_clears_it() {
    use keratin_log::{SimFault, SimIo};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().expect("tmp");
    let mut config = Config::default();
    config.storage.dirs = vec![dir.path().join("data")];
    config.storage.segment_bytes = 1 << 20;
    config.server.listen = "127.0.0.1:0".parse().expect("addr");
    // Anyone may connect: these tests are not about logins (`access.rs` is).
    config.server.auth = keratin_server::access::AuthMode::None;
    config.server.http = "127.0.0.1:0".parse().expect("addr");
    common::host_disk_limits(&mut config);
    // The owner heals at once when the disk works again, usually before any sample: the
    // partition's stop and heal counts carry the event to the sampler.
    config.limits.sample_interval_ms = 20;
    let sim = SimIo::new(11);
    let node = Node::start_with_io(&config, std::sync::Arc::new(sim.clone()))
        .await
        .expect("start");
    let broker = node.broker().clone();
    broker
        .declare("q", keratin_broker::QueueSettings::default())
        .await
        .expect("declare");
    let publish = |body: &'static [u8]| {
        let broker = broker.clone();
        async move {
            broker
                .publish("q", vec![keratin_broker::Message::new(body.to_vec())])
                .await
                .remove(0)
        }
    };
    publish(b"first").await.expect("publish");
    // The node is idle: the next disk call, the publish's write or sync, fails.
    sim.fail_at(sim.steps() + 1, SimFault::Eio);
    let failed = publish(b"lost").await;
    assert!(failed.is_err(), "the failed disk call fails the publish");
    let dir_of_partition = broker.info("q").expect("info").partitions[0]
        .dir
        .display()
        .to_string();
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let items = loop {
            let (_, body) = get(http, "/api/v1/attention");
            let doc: serde_json::Value = serde_json::from_str(&body).expect("json");
            let items = doc["items"].as_array().cloned().unwrap_or_default();
            let healed = items.iter().any(|i| i["kind"] == "log_healed");
            let stopped_active = items
                .iter()
                .any(|i| i["kind"] == "log_stopped" && i["active"] == true);
            if healed && !stopped_active {
                break items;
            }
            assert!(Instant::now() < deadline, "no heal within 30 s: {doc}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let stopped = items
            .iter()
            .find(|i| i["kind"] == "log_stopped")
            .unwrap_or_else(|| panic!("the stop was raised: {items:?}"));
        assert_eq!(stopped["subject"], dir_of_partition.as_str(), "{stopped}");
        assert_eq!(stopped["severity"], "critical", "{stopped}");
        assert!(stopped["cleared_at_ms"].is_u64(), "{stopped}");
        let healed = items
            .iter()
            .find(|i| i["kind"] == "log_healed")
            .expect("healed");
        assert_eq!(healed["subject"], dir_of_partition.as_str(), "{healed}");
        assert_eq!(healed["severity"], "info", "{healed}");
        assert_eq!(healed["active"], false, "history only: {healed}");
        let (_, metrics) = get(http, "/metrics");
        let value = |name: &str| -> Option<String> {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ').map(str::to_string))
        };
        assert_eq!(value("keratin_log_stops_total").as_deref(), Some("1"));
        assert_eq!(value("keratin_log_heals_total").as_deref(), Some("1"));
        assert_eq!(value("keratin_partitions_stopped").as_deref(), Some("0"));
        let (_, body) = get(http, "/api/v1/queues/q");
        let q: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(q["partitions"][0]["stops"], 1, "{q}");
        assert_eq!(q["partitions"][0]["heals"], 1, "{q}");
        assert_eq!(q["partitions"][0]["stopped"], false, "{q}");
    })
    .await;
    publish(b"after")
        .await
        .expect("the healed log takes publishes");
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}

/// A partition copy found damaged at start is moved under `<storage>/damaged/` (`keratin-raft`,
/// tested there): the node raises `damaged_copies` naming the copy and what to do, and counts
/// it in `keratin_damaged_copies{path}`; once the operator removed it, the item clears and the
/// series goes. A node started with a copy already set aside (a restart after the move) raises
/// it too. Fails if the item or the series is missing, or stays after the removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_copy_set_aside_raises_attention_until_it_is_removed() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = common::node_config(dir.path());
    let damaged = config.storage.dirs[0].join("damaged");
    let copy = damaged.join("queues-7-0-1700000000000");
    std::fs::create_dir_all(&copy).expect("a damaged copy");
    std::fs::write(copy.join("00000000000000000000.log"), b"bytes").expect("its file");
    let node = Node::start(&config).await.expect("start");
    let http = node.http_addr();
    let subject = damaged.display().to_string();
    let active = || common::active_item(http, "damaged_copies", &subject);
    let item = common::until("damaged_copies is raised", &active).await;
    assert_eq!(item["severity"], "warning", "{item}");
    let message = item["message"].as_str().expect("a message");
    assert!(
        message.contains("queues-7-0-1700000000000") && message.contains("remove them"),
        "{message}"
    );
    let series = format!("keratin_damaged_copies{{path=\"{subject}\"}} 1");
    let (_, metrics) = get(http, "/metrics");
    assert!(metrics.contains(&series), "{series} in {metrics}");

    std::fs::remove_dir_all(&copy).expect("the operator removes the copy");
    common::until("damaged_copies clears", || active().is_none().then_some(())).await;
    let (_, metrics) = get(http, "/metrics");
    assert!(!metrics.contains("keratin_damaged_copies{"), "{metrics}");
    node.shutdown().await.expect("shutdown");
}
