//! The HTTP admin port (axum): `/health` and the JSON queue API. The limits, settings, metrics
//! and dashboard issues add their routes here; the dashboard's files are in [`dashboard`], the
//! stream routes in [`streams`].

mod audit;
mod auth;
mod cluster;
pub mod dashboard;
pub(crate) mod streams;
mod tls_listener;
mod users;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use axum::extract::{FromRef, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use keratin_broker::{Broker, BrokerError, QueueInfo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::limits::NodeLimits;
use crate::settings::NodeSettings;

/// What the admin routes read.
#[derive(Debug, Clone)]
pub struct Admin {
    /// The broker.
    pub broker: Broker,
    /// The node's resource limits.
    pub limits: Arc<NodeLimits>,
    /// The node's runtime settings.
    pub settings: Arc<NodeSettings>,
    /// The node's id.
    pub node_id: String,
    /// The node's cluster membership; `None` when it runs alone.
    pub cluster: Option<Arc<keratin_cluster::ClusterNode>>,
    /// Logins and permissions.
    pub access: Arc<crate::access::Access>,
    /// The audit trail.
    pub audit: crate::audit::AuditLog,
}

impl FromRef<Admin> for Broker {
    fn from_ref(admin: &Admin) -> Broker {
        admin.broker.clone()
    }
}

/// The admin router.
pub fn router(admin: Admin) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/api/v1/status", get(status))
        .route("/api/v1/cluster", get(cluster::cluster))
        .route(
            "/api/v1/cluster/nodes",
            axum::routing::post(cluster::add_node),
        )
        .route(
            "/api/v1/cluster/nodes/{id}/remove",
            axum::routing::post(cluster::remove_node),
        )
        .route(
            "/api/v1/cluster/rebalance",
            axum::routing::post(cluster::rebalance),
        )
        .route("/api/v1/attention", get(attention))
        .route("/api/v1/audit", get(audit::audit))
        .route(
            "/api/v1/settings",
            get(get_node_settings).put(put_node_settings),
        )
        .route("/api/v1/queues", get(queues))
        .route("/api/v1/queues/{name}", get(queue))
        .route("/api/v1/streams", get(streams::streams))
        .route("/api/v1/streams/{name}", get(streams::stream))
        .route(
            "/api/v1/queues/{name}/settings",
            axum::routing::put(put_settings),
        )
        .route(
            "/api/v1/queues/{name}/purge",
            axum::routing::post(purge_queue),
        )
        .route(
            "/api/v1/queues/{name}/partitions/{index}/move",
            axum::routing::post(cluster::move_replica),
        )
        .route("/api/v1/login", axum::routing::post(auth::login))
        .route("/api/v1/logout", axum::routing::post(auth::logout))
        .route("/api/v1/whoami", get(auth::whoami))
        .route("/api/v1/users", get(users::list).post(users::add))
        .route(
            "/api/v1/users/{user}",
            get(users::get).delete(users::delete),
        )
        .route(
            "/api/v1/users/{user}/password",
            axum::routing::put(users::password),
        )
        .route(
            "/api/v1/users/{user}/admin",
            axum::routing::put(users::set_admin),
        )
        .route(
            "/api/v1/users/{user}/grant",
            axum::routing::post(users::grant),
        )
        .route(
            "/api/v1/users/{user}/revoke",
            axum::routing::post(users::revoke),
        )
        .route(
            "/api/v1/users/{user}/quota",
            axum::routing::put(users::set_quota),
        )
        .route(
            "/api/v1/users/{user}/tokens",
            axum::routing::post(users::add_token),
        )
        .route(
            "/api/v1/users/{user}/tokens/{token}",
            axum::routing::delete(users::delete_token),
        )
        .merge(dashboard::routes())
        .layer(axum::middleware::from_fn_with_state(
            admin.clone(),
            auth::authenticate,
        ))
        .with_state(admin)
}

/// Serve the admin API until `shutdown` completes: HTTPS with `tls` (the protocol port's
/// certificate, see [`tls_listener`]), else plain HTTP. At shutdown both stop accepting, close
/// idle connections and let the requests in progress finish.
pub async fn serve(
    listener: TcpListener,
    admin: Admin,
    tls: Option<Arc<crate::tls::ServerTls>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Some(tls) = tls else {
        return axum::serve(
            listener,
            router(admin).into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown)
        .await;
    };
    // `tap_io` is a no-op here: it is what gives a custom listener's connections the
    // `ConnectInfo<SocketAddr>` (axum implements that for `TapIo` and plain `TcpListener` only).
    let listener =
        axum::serve::ListenerExt::tap_io(tls_listener::TlsListener::new(listener, tls), |_| {});
    axum::serve(
        listener,
        router(admin).into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// The query of `GET /api/v1/attention`.
#[derive(Debug, serde::Deserialize)]
struct AttentionQuery {
    /// Only the active items.
    #[serde(default)]
    active: bool,
}

/// `GET /api/v1/attention[?active=true]`: what needs an operator (level changes, full queues,
/// stopped and healed logs), oldest first, active and cleared (see `attention.rs`).
async fn attention(State(admin): State<Admin>, Query(query): Query<AttentionQuery>) -> Json<Value> {
    let attention = admin.limits.attention();
    let items = if query.active {
        attention.active()
    } else {
        attention.items()
    };
    Json(json!({ "items": items }))
}

/// `GET /api/v1/settings`: every configuration key with its value in force, where it came from
/// (`runtime` for an override set through this API) and whether it can change live.
async fn get_node_settings(State(admin): State<Admin>) -> Json<Value> {
    Json(admin.settings.document().await)
}

/// `PUT /api/v1/settings`: change runtime settings. The body maps dotted keys to values; `null`
/// removes a value. Checked whole: a refused change changes nothing (400 with the key, the
/// value and what it accepts). In a cluster the change is cluster-wide (every node, through
/// the metadata group) unless `?scope=node` (this node's own override); a node alone has only
/// its own (`?scope=cluster` is refused there).
async fn put_node_settings(
    State(admin): State<Admin>,
    axum::Extension(caller): axum::Extension<audit::Caller>,
    Query(query): Query<SettingsScope>,
    Json(body): Json<Value>,
) -> Response {
    let entry = caller
        .entry("settings.set", None)
        .with_detail(json!({ "scope": query.scope, "settings": body }));
    let response = node_settings_update(&admin, query, &body).await;
    audit::recorded(&admin.audit, entry, response).await
}

async fn node_settings_update(admin: &Admin, query: SettingsScope, body: &Value) -> Response {
    let result = match (query.scope.as_deref(), &admin.cluster) {
        (None | Some("cluster"), Some(cluster)) => {
            admin
                .settings
                .update_cluster(body, cluster, &admin.broker, &admin.limits)
                .await
        }
        (Some("cluster"), None) => Err(crate::settings::SettingsError::NotACluster),
        (None | Some("node"), _) => {
            admin
                .settings
                .update(body, &admin.broker, &admin.limits)
                .await
        }
        (Some(other), _) => Err(crate::settings::SettingsError::BadRequest(format!(
            "scope {other:?}: expected cluster (every node) or node (this node only)"
        ))),
    };
    match result {
        Ok(document) => Json(document).into_response(),
        Err(error) => {
            let code = error.http_status();
            let mut body = json!({ "code": code, "message": error.to_string() });
            if let crate::settings::SettingsError::Limited {
                reason,
                retry_after_ms,
                ..
            } = &error
            {
                body["reason"] = json!(reason);
                body["retry_after_ms"] = json!(retry_after_ms);
            }
            (
                StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                Json(body),
            )
                .into_response()
        }
    }
}

/// The query of `PUT /api/v1/settings`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsScope {
    scope: Option<String>,
}

async fn status(State(admin): State<Admin>) -> Json<Value> {
    let mut document = admin.limits.status(&admin.node_id);
    let bounds = admin.broker.bounds();
    let pair = |(count, max): (u64, u64)| json!({ "count": count, "max": max });
    document["bounds"] = json!({
        "queues": pair(bounds.queues),
        "partitions": pair(bounds.partitions),
        "consumers": pair(bounds.consumers),
    });
    // In a cluster: every node as this one sees it (reachable, the partitions it leads, its
    // file systems and memory as its label last reported them).
    if let Some(cluster) = &admin.cluster {
        document["cluster"] = cluster_overview(&admin, cluster).await;
    } else if let Some(levels) = admin.limits.cluster_levels() {
        let nodes: Vec<Value> = levels
            .all()
            .into_iter()
            .map(|(id, heard)| {
                json!({
                    "id": id,
                    "levels": heard.report,
                    "levels_age_ms": u64::try_from(heard.age.as_millis()).unwrap_or(u64::MAX),
                })
            })
            .collect();
        document["cluster"] = json!({ "nodes": nodes });
    }
    Json(document)
}

/// The cluster part of `GET /api/v1/status` (`docs/protocol.md`, "Status"): each node with its
/// addresses, whether it is reachable from here, removed or the metadata leader, its resource
/// report, and `leads` / `preferred`: how many of the partitions this node knows of (queue and
/// stream partitions) it leads, as this node last heard, and how many it is the preferred
/// leader of (queue partitions; a stream's are not placed by preference yet). `partitions` is
/// the number of partitions counted and `leaderless` those with no leader known here.
async fn cluster_overview(admin: &Admin, cluster: &keratin_cluster::ClusterNode) -> Value {
    let status = cluster.status().await;
    let here = status.node_id;
    let mut leads: BTreeMap<u64, u64> = BTreeMap::new();
    let mut preferred: BTreeMap<u64, u64> = BTreeMap::new();
    let mut partitions = 0u64;
    let mut leaderless = 0u64;
    let mut count = |leading: bool, leader: Option<u64>| {
        partitions += 1;
        match if leading { Some(here) } else { leader } {
            Some(id) => *leads.entry(id).or_default() += 1,
            None => leaderless += 1,
        }
    };
    for queue in admin.broker.list() {
        for p in &queue.partitions {
            count(p.leading, p.leader);
            if let Some(id) = p.preferred_leader {
                *preferred.entry(id).or_default() += 1;
            }
        }
    }
    for stream in admin.broker.list_streams() {
        for p in &stream.partitions {
            count(p.leading, p.leader);
        }
    }
    let nodes: Vec<Value> = status
        .nodes
        .iter()
        .map(|node| {
            json!({
                "id": node.id,
                "this_node": node.id == here,
                "cluster_addr": node.cluster_addr,
                "client_addr": node.info.as_ref().map(|info| &info.client),
                "admin_addr": node.info.as_ref().map(|info| &info.admin),
                "reachable": node.reachable,
                "removed": node.removed,
                "meta_leader": node.meta_leader,
                "leads": leads.get(&node.id).copied().unwrap_or(0),
                "preferred": preferred.get(&node.id).copied().unwrap_or(0),
                "levels": node.levels,
                "levels_age_ms": node.levels_age_ms,
            })
        })
        .collect();
    json!({
        "name": status.name,
        "node_id": here,
        "meta_leader": status.meta_leader,
        "partitions": partitions,
        "leaderless": leaderless,
        "nodes": nodes,
    })
}

async fn metrics(State(admin): State<Admin>) -> Response {
    let text = crate::metrics::render(&admin.broker, &admin.limits, &admin.access);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            // The text is OpenMetrics (it ends with `# EOF`), which Prometheus reads.
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /api/v1/queues`: the queues the user has a permission on.
async fn queues(
    State(broker): State<Broker>,
    axum::Extension(grant): axum::Extension<crate::access::Grant>,
) -> Json<Value> {
    let list: Vec<Value> = broker
        .list()
        .iter()
        .filter(|q| grant.sees(&q.name))
        .map(queue_json)
        .collect();
    Json(json!({ "queues": list }))
}

async fn queue(State(broker): State<Broker>, Path(name): Path<String>) -> Response {
    // A queue declared through another node a moment ago is found, not 404 (docs/cluster.md).
    if let Err(error) = broker.catch_up_for(&name).await {
        return error_response(&error);
    }
    match broker.info(&name) {
        Ok(info) => Json(queue_json(&info)).into_response(),
        Err(error) => error_response(&error),
    }
}

/// `PUT /api/v1/queues/{name}/settings`: change a live queue's settings. Keys present set a
/// value (`null` clears it), keys absent keep theirs: `max_messages`, `max_bytes`, `overflow`
/// (`reject` or `drop_oldest`), `dead_letter`, `max_deliveries`.
async fn put_settings(
    State(admin): State<Admin>,
    axum::Extension(caller): axum::Extension<audit::Caller>,
    Path(name): Path<String>,
    Json(body): Json<Value>,
) -> Response {
    let entry = caller
        .entry("queue.settings", Some(&name))
        .with_detail(body.clone());
    let response = queue_settings_update(&admin.broker, &name, &body).await;
    audit::recorded(&admin.audit, entry, response).await
}

/// `POST /api/v1/queues/{name}/purge`: every ready message of the queue goes, each partition
/// on its leader wherever it is (`Broker::purge`); answers `{"queue": ..., "purged": N}`.
async fn purge_queue(
    State(admin): State<Admin>,
    axum::Extension(caller): axum::Extension<audit::Caller>,
    Path(name): Path<String>,
) -> Response {
    let entry = caller.entry("queue.purge", Some(&name));
    // A queue declared through another node a moment ago is found, not 404 (docs/cluster.md).
    let response = match admin.broker.catch_up_for(&name).await {
        Err(error) => error_response(&error),
        Ok(()) => match admin.broker.purge(&name).await {
            Ok(purged) => Json(json!({ "queue": name, "purged": purged })).into_response(),
            Err(error) => error_response(&error),
        },
    };
    audit::recorded(&admin.audit, entry, response).await
}

async fn queue_settings_update(broker: &Broker, name: &str, body: &Value) -> Response {
    // The body is checked before the queue is looked at, then applied to the settings in force
    // under the broker's metadata lock (a concurrent change of another setting stays).
    if let Err(message) = settings_update(keratin_broker::QueueSettings::default(), body) {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({ "code": 400, "message": message })),
        )
            .into_response();
    }
    // A queue declared through another node a moment ago is found, not 404 (docs/cluster.md).
    if let Err(error) = broker.catch_up_for(name).await {
        return error_response(&error);
    }
    let update = |current: &keratin_broker::QueueSettings| {
        settings_update(current.clone(), body).map_err(keratin_broker::BrokerError::Invalid)
    };
    match broker.update_queue_settings(name, update).await {
        Ok(info) => Json(queue_json(&info)).into_response(),
        Err(error) => error_response(&error),
    }
}

fn settings_update(
    mut settings: keratin_broker::QueueSettings,
    body: &Value,
) -> Result<keratin_broker::QueueSettings, String> {
    let Some(object) = body.as_object() else {
        return Err("expected a JSON object of settings".into());
    };
    let number = |key: &str, value: &Value| -> Result<Option<u64>, String> {
        if value.is_null() {
            return Ok(None);
        }
        value
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{key}: expected a positive integer or null, got {value}"))
    };
    for (key, value) in object {
        match key.as_str() {
            "max_messages" => settings.max_messages = number(key, value)?,
            "max_bytes" => settings.max_bytes = number(key, value)?,
            "max_deliveries" => {
                settings.max_deliveries = number(key, value)?
                    .map(|n| u32::try_from(n).map_err(|_| format!("{key}: {n} is too large")))
                    .transpose()?
            }
            "dead_letter" => {
                settings.dead_letter = match value {
                    Value::Null => None,
                    Value::String(s) => Some(s.clone()),
                    other => return Err(format!("dead_letter: expected a queue name or null, got {other}")),
                }
            }
            "overflow" => {
                settings.overflow = match value.as_str() {
                    None if value.is_null() => None,
                    Some("reject") => Some(keratin_broker::Overflow::Reject),
                    Some("drop_oldest") => Some(keratin_broker::Overflow::DropOldest),
                    _ => return Err(format!("overflow: expected \"reject\", \"drop_oldest\" or null, got {value}")),
                }
            }
            other => {
                return Err(format!(
                    "unknown setting {other:?}; expected max_messages, max_bytes, overflow, dead_letter or max_deliveries"
                ))
            }
        }
    }
    Ok(settings)
}

/// A queue as JSON: settings, totals and per-partition figures.
pub fn queue_json(info: &QueueInfo) -> Value {
    json!({
        "name": info.name,
        "settings": {
            "partitions": info.settings.partitions,
            "dead_letter": info.settings.dead_letter,
            "max_deliveries": info.settings.max_deliveries,
            "max_messages": info.settings.max_messages,
            "max_bytes": info.settings.max_bytes,
            "overflow": info.settings.overflow.map(|o| o.as_str()),
            "replicas": info.settings.replicas,
        },
        "full": info.partitions.iter().any(|p| p.full),
        "ready": info.ready(),
        "inflight": info.inflight(),
        "bytes": info.bytes(),
        "disk_bytes": info.disk_bytes(),
        "partitions": info.partitions.iter().map(|p| json!({
            "index": p.index,
            "dir": p.dir,
            "ready": p.ready,
            "inflight": p.inflight,
            "bytes": p.bytes,
            "disk_bytes": p.disk_bytes,
            "stopped": p.stopped,
            "stops": p.stops,
            "heals": p.heals,
            "full": p.full,
            "leading": p.leading,
            "leader": p.leader,
            "leader_addr": p.leader_addr,
            "rejected_queue_full": p.rejected_full,
            "overflowed": p.overflowed,
            "dead_letters_held": p.dead_letters_held,
        })).collect::<Vec<_>>(),
    })
}

fn error_response(error: &BrokerError) -> Response {
    let body = crate::tcp::errors::error_body(error);
    let status = StatusCode::from_u16(body.code().0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut document = json!({ "code": body.code().0, "message": body.message() });
    if let Some(leader_addr) = body.leader_addr() {
        document["leader_addr"] = json!(leader_addr);
    }
    (status, Json(document)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn not_leader_is_421_with_the_leaders_address() {
        let error = BrokerError::NotLeader {
            queue: "orders".into(),
            partition: 1,
            leader: Some(2),
            addr: Some("10.0.0.2:5680".into()),
        };
        let response = error_response(&error);
        assert_eq!(response.status().as_u16(), 421);
        let bytes = axum::body::to_bytes(response.into_body(), 64 * 1024)
            .await
            .unwrap();
        let document: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(document["code"], 421);
        assert_eq!(document["leader_addr"], "10.0.0.2:5680");
    }
}
