//! `GET /api/v1/cluster`: the cluster as this node sees it — its nodes (addresses, reachable,
//! which leads the metadata group), and every queue's partitions with their leader, whether
//! this node leads them, their replicas and leader changes, and where this node leads, the
//! in-sync set and each replica's lag (only the leader knows them: `null` elsewhere). A node
//! that runs alone answers 404 with what to do.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::Admin;

pub(super) async fn cluster(State(admin): State<Admin>) -> Response {
    let Some(cluster) = &admin.cluster else {
        let body = json!({
            "error": "this node runs alone: start it with --node-id and --peer (or [cluster]) to form a cluster",
            "code": "not_a_cluster",
        });
        return (StatusCode::NOT_FOUND, Json(body)).into_response();
    };
    let status = cluster.status().await;
    let mut document = serde_json::to_value(&status).unwrap_or(Value::Null);
    let queues: Vec<Value> = admin
        .broker
        .list()
        .iter()
        .map(|queue| {
            let partitions: Vec<Value> = queue.partitions.iter().map(partition_json).collect();
            json!({
                "name": queue.name,
                "replicas": queue.settings.replicas,
                "partitions": partitions,
            })
        })
        .collect();
    document["queues"] = Value::from(queues);
    Json(document).into_response()
}

/// One partition of the document (see the module docs).
fn partition_json(p: &keratin_broker::PartitionInfo) -> Value {
    let (in_sync, lag, max_lag) = if p.leading && !p.replicas.is_empty() {
        let lag: serde_json::Map<String, Value> = p
            .replica_lag
            .iter()
            .map(|(node, entries)| (node.to_string(), Value::from(*entries)))
            .collect();
        (
            Value::from(p.in_sync.clone()),
            Value::Object(lag),
            Value::from(p.replica_lag.values().copied().max().unwrap_or(0)),
        )
    } else {
        (Value::Null, Value::Null, Value::Null)
    };
    json!({
        "index": p.index,
        "leading": p.leading,
        "leader": p.leader,
        "leader_addr": p.leader_addr,
        "ready": p.ready,
        "inflight": p.inflight,
        "replicas": p.replicas,
        "in_sync": in_sync,
        "replica_lag": lag,
        "max_lag": max_lag,
        "leader_changes": p.leader_changes,
        "leaderless_ms": p.leaderless_ms,
        "committed_offset": p.committed_offset,
    })
}
