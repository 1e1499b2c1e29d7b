//! `GET /api/v1/cluster`: the cluster as this node sees it — its nodes (addresses, reachable,
//! which leads the metadata group), and every queue's partitions with their leader, whether
//! this node leads them, their replicas and leader changes, and where this node leads, the
//! in-sync set and each replica's lag (only the leader knows them: `null` elsewhere). A node
//! that runs alone answers 404 with what to do.
//!
//! `POST /api/v1/cluster/nodes` (`{"id", "cluster_addr", "rebalance"}`): add a node
//! (`ClusterNode::add_node`); the answer lists the replicas that move onto it.
//!
//! `POST /api/v1/cluster/nodes/{id}/remove`: remove a node (`ClusterNode::remove_node`); the
//! answer lists the partitions' moves, which the groups then carry out.
//!
//! `POST /api/v1/cluster/rebalance`: every partition to its preferred leader now, where that
//! one is caught up (`ClusterNode::rebalance`); the answer lists what moved (`moved`), what
//! stays and why (`kept`), and the nodes that could not be asked (`unreachable`).
//!
//! `POST /api/v1/queues/{name}/partitions/{index}/move` (`{"from", "to"}`): move one replica
//! (`ClusterNode::move_replica`); the answer is the planned move, which the partition's group
//! then carries out.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::audit::{recorded, Caller};
use super::Admin;

pub(super) async fn cluster(State(admin): State<Admin>) -> Response {
    let Some(cluster) = &admin.cluster else {
        return not_a_cluster();
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

/// Remove node `id` from the cluster (see the module docs).
pub(super) async fn remove_node(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<u64>,
) -> Response {
    let entry = caller.entry("cluster.remove_node", Some(&id.to_string()));
    recorded(&admin.audit, entry, node_removed(&admin, id).await).await
}

async fn node_removed(admin: &Admin, id: u64) -> Response {
    let Some(cluster) = &admin.cluster else {
        return not_a_cluster();
    };
    use keratin_cluster::RemoveNodeError as E;
    match cluster.remove_node(id).await {
        Ok(moves) => Json(json!({ "node": id, "moves": moves })).into_response(),
        Err(error) => {
            let (status, code) = match &error {
                E::Unknown { .. } => (StatusCode::NOT_FOUND, "unknown_node"),
                E::Last { .. } => (StatusCode::CONFLICT, "last_node"),
                E::NoRoom { .. } => (StatusCode::CONFLICT, "no_room"),
                E::HoldsStream { .. } => (StatusCode::CONFLICT, "holds_stream"),
                E::Metadata(_) => (StatusCode::SERVICE_UNAVAILABLE, "metadata_unavailable"),
            };
            refusal(status, code, &error)
        }
    }
}

/// Hand every partition to its preferred leader (see the module docs).
pub(super) async fn rebalance(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
) -> Response {
    let entry = caller.entry("cluster.rebalance", None);
    let response = match &admin.cluster {
        None => not_a_cluster(),
        Some(cluster) => Json(cluster.rebalance().await).into_response(),
    };
    recorded(&admin.audit, entry, response).await
}

/// What `POST /api/v1/queues/{name}/partitions/{index}/move` takes.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MoveReplica {
    from: u64,
    to: u64,
}

/// Move one replica of a partition (see the module docs).
pub(super) async fn move_replica(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path((name, index)): Path<(String, u32)>,
    Json(request): Json<MoveReplica>,
) -> Response {
    let entry = caller
        .entry("replica.move", Some(&name))
        .with_detail(json!({ "partition": index, "from": request.from, "to": request.to }));
    let response = replica_moved(&admin, &name, index, request).await;
    recorded(&admin.audit, entry, response).await
}

async fn replica_moved(admin: &Admin, name: &str, index: u32, request: MoveReplica) -> Response {
    let Some(cluster) = &admin.cluster else {
        return not_a_cluster();
    };
    // A queue declared through another node a moment ago is found, not 404 (docs/cluster.md).
    if let Err(error) = admin.broker.catch_up_for(name).await {
        return super::error_response(&error);
    }
    use keratin_cluster::MoveReplicaError as E;
    match cluster
        .move_replica(name, index, request.from, request.to)
        .await
    {
        Ok(planned) => Json(json!({ "move": planned })).into_response(),
        Err(error) => {
            let (status, code) = match &error {
                E::UnknownQueue(_) => (StatusCode::NOT_FOUND, "unknown_queue"),
                E::UnknownPartition { .. } => (StatusCode::NOT_FOUND, "unknown_partition"),
                E::UnknownNode { .. } => (StatusCode::NOT_FOUND, "unknown_node"),
                E::NotHeld { .. } => (StatusCode::CONFLICT, "not_held"),
                E::AlreadyHeld { .. } => (StatusCode::CONFLICT, "already_held"),
                E::TargetLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "target_limited"),
                E::Metadata(_) => (StatusCode::SERVICE_UNAVAILABLE, "metadata_unavailable"),
            };
            refusal(status, code, &error)
        }
    }
}

/// What `POST /api/v1/cluster/nodes` takes.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AddNode {
    id: u64,
    cluster_addr: String,
    #[serde(default = "yes")]
    rebalance: bool,
}

fn yes() -> bool {
    true
}

/// Add a node to the cluster (see the module docs).
pub(super) async fn add_node(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Json(request): Json<AddNode>,
) -> Response {
    let entry = caller
        .entry("cluster.add_node", Some(&request.id.to_string()))
        .with_detail(json!({
            "cluster_addr": request.cluster_addr,
            "rebalance": request.rebalance,
        }));
    recorded(&admin.audit, entry, node_added(&admin, request).await).await
}

async fn node_added(admin: &Admin, request: AddNode) -> Response {
    let Some(cluster) = &admin.cluster else {
        return not_a_cluster();
    };
    use keratin_cluster::AddNodeError as E;
    match cluster
        .add_node(request.id, &request.cluster_addr, request.rebalance)
        .await
    {
        Ok(moves) => Json(json!({ "node": request.id, "moves": moves })).into_response(),
        Err(error) => {
            let (status, code) = match &error {
                E::Taken { .. } => (StatusCode::CONFLICT, "id_taken"),
                E::AddressTaken { .. } => (StatusCode::CONFLICT, "address_taken"),
                E::Removed { .. } => (StatusCode::CONFLICT, "id_removed"),
                E::Full { .. } => (StatusCode::CONFLICT, "cluster_full"),
                E::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid"),
                E::Metadata(_) => (StatusCode::SERVICE_UNAVAILABLE, "metadata_unavailable"),
            };
            refusal(status, code, &error)
        }
    }
}

fn not_a_cluster() -> Response {
    refusal(
        StatusCode::NOT_FOUND,
        "not_a_cluster",
        &"this node runs alone: start it with --node-id and --peer (or [cluster]) to form a cluster",
    )
}

/// A refused cluster operation: the error body every endpoint uses, with a `reason` word.
fn refusal(status: StatusCode, reason: &str, message: &dyn std::fmt::Display) -> Response {
    let body = json!({
        "code": status.as_u16(),
        "message": message.to_string(),
        "reason": reason,
    });
    (status, Json(body)).into_response()
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
        "dead_letters_held": p.dead_letters_held,
        "replicas": p.replicas,
        "preferred_leader": p.preferred_leader,
        "in_sync": in_sync,
        "replica_lag": lag,
        "max_lag": max_lag,
        "leader_changes": p.leader_changes,
        "leaderless_ms": p.leaderless_ms,
        "committed_offset": p.committed_offset,
    })
}
