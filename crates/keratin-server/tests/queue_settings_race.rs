//! Two concurrent changes of different settings of one queue both take effect: a change is a
//! read-modify-write of the queue's settings, and the node must not let one overwrite the
//! other with the value it read before. Sent over the HTTP admin port (`PUT
//! /api/v1/queues/{name}/settings`), two at a time from two threads, several rounds. A failure
//! means one of the two updates was lost.

mod common;

use common::http_text as request;

use std::sync::{Arc, Barrier};

use keratin_server::Node;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_updates_of_different_settings_both_survive() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = common::node_config(dir.path());
    let node = Node::start(&config).await.expect("start");
    node.broker()
        .declare("q", keratin_broker::QueueSettings::default())
        .await
        .expect("declare");
    let http = node.http_addr();
    let result = tokio::task::spawn_blocking(move || {
        let mut lost = Vec::new();
        for round in 1..=10u64 {
            let barrier = Arc::new(Barrier::new(2));
            let updates = [
                format!(r#"{{"max_messages": {}}}"#, 1000 + round),
                format!(r#"{{"max_bytes": {}}}"#, 100_000 + round),
            ];
            let threads: Vec<_> = updates
                .into_iter()
                .map(|body| {
                    let barrier = barrier.clone();
                    std::thread::spawn(move || {
                        barrier.wait();
                        request(http, "PUT", "/api/v1/queues/q/settings", &body)
                    })
                })
                .collect();
            for thread in threads {
                let (code, body) = thread.join().expect("thread");
                assert_eq!(code, 200, "{body}");
            }
            let (_, body) = request(http, "GET", "/api/v1/queues/q", "");
            let q: serde_json::Value = serde_json::from_str(&body).expect("json");
            let settings = &q["settings"];
            if settings["max_messages"] != 1000 + round || settings["max_bytes"] != 100_000 + round
            {
                lost.push(format!("round {round}: {settings}"));
            }
        }
        assert!(lost.is_empty(), "updates lost: {lost:#?}");
    })
    .await;
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}
