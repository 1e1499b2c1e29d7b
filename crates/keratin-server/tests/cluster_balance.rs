//! Leader balancing on three in-process cluster nodes (`Node` with `[cluster]`, real
//! transports on 127.0.0.1): a queue of one partition with three replicas.
//! - The partition comes to be led by its preferred leader (the first of its replicas as
//!   placed, `preferred_leader` in the queue's info), wherever the first election put it.
//! - That node is stopped: another leads, and publishes are confirmed there.
//! - It starts again: once caught up, the leadership comes back to it, publishes are
//!   confirmed there, and every confirmed message is delivered once.
//!
//! Fails without the balancing (`keratin-cluster` `balance.rs`): after the restart the
//! leadership stays where the failover put it.

mod common;

use std::collections::BTreeSet;

use common::{agreed_leader, node, publish, take, until};
use keratin_broker::QueueSettings;
use keratin_server::Node;

const QUEUE: &str = "balanced";

/// The preferred leader, as every running node's info names it.
fn preferred(nodes: &[Option<Node>]) -> Option<u64> {
    let named: BTreeSet<Option<u64>> = nodes
        .iter()
        .flatten()
        .map(|n| {
            n.broker()
                .info(QUEUE)
                .ok()
                .and_then(|info| info.partitions[0].preferred_leader)
        })
        .collect();
    match named.into_iter().collect::<Vec<_>>()[..] {
        [Some(id)] => Some(id),
        _ => None,
    }
}

/// `Some` once node `id` leads the partition and every running node says so.
fn led_by(nodes: &[Option<Node>], id: u64) -> Option<()> {
    nodes
        .iter()
        .flatten()
        .all(|n| {
            n.broker()
                .info(QUEUE)
                .is_ok_and(|info| info.partitions[0].leader == Some(id))
        })
        .then_some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leadership_comes_back_to_the_preferred_leader_after_a_failover() {
    let dirs = common::cluster_test_dirs(3);
    let mut configs = common::cluster_configs(&dirs, 3, "balance");
    for config in &mut configs {
        config.cluster.as_mut().expect("cluster").leader_balance = true;
    }
    let mut nodes = common::start_all(&configs).await;
    let settings = QueueSettings {
        replicas: Some(3),
        ..QueueSettings::default()
    };
    let deadline = tokio::time::Instant::now() + common::WAIT;
    while let Err(error) = node(&nodes, 1)
        .broker()
        .declare(QUEUE, settings.clone())
        .await
    {
        assert!(tokio::time::Instant::now() < deadline, "declare: {error}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let preferred = until("every node names the preferred leader", || {
        preferred(&nodes)
    })
    .await;
    until(&format!("node {preferred} (preferred) leads"), || {
        led_by(&nodes, preferred)
    })
    .await;

    let mut confirmed = BTreeSet::new();
    for n in 0..50 {
        if publish(&nodes, QUEUE, n).await.is_ok() {
            confirmed.insert(n);
        }
    }

    // The preferred leader stops: another node leads and confirms.
    let stopped = nodes[(preferred - 1) as usize].take().expect("running");
    let _ = stopped.shutdown().await;
    let failover = agreed_leader(&nodes, QUEUE).await;
    assert_ne!(failover, preferred);
    for n in 50..100 {
        if publish(&nodes, QUEUE, n).await.is_ok() {
            confirmed.insert(n);
        }
    }

    // Back: the leadership returns to it once it caught up.
    nodes[(preferred - 1) as usize] =
        Some(common::start_node(&configs[(preferred - 1) as usize]).await);
    until(
        &format!("node {preferred} leads again (node {failover} had it)"),
        || led_by(&nodes, preferred),
    )
    .await;
    for n in 100..150 {
        if publish(&nodes, QUEUE, n).await.is_ok() {
            confirmed.insert(n);
        }
    }
    assert!(
        confirmed.len() >= 140,
        "most publishes confirmed: {}",
        confirmed.len()
    );

    let leader = agreed_leader(&nodes, QUEUE).await;
    assert_eq!(leader, preferred);
    let delivered = take(node(&nodes, leader).broker(), QUEUE, 150, true).await;
    let distinct: BTreeSet<usize> = delivered.iter().copied().collect();
    assert_eq!(distinct.len(), delivered.len(), "a message delivered twice");
    let missing: Vec<&usize> = confirmed.difference(&distinct).collect();
    assert!(missing.is_empty(), "confirmed, not delivered: {missing:?}");

    for n in nodes.into_iter().flatten() {
        let _ = n.shutdown().await;
    }
}
