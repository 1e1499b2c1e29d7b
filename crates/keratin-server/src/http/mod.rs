//! The HTTP admin port (axum): `/health` and the JSON queue API. The limits, settings, metrics
//! and dashboard issues add their routes here.

use std::future::Future;

use std::sync::Arc;

use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use keratin_broker::{Broker, BrokerError, QueueInfo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::limits::NodeLimits;

/// What the admin routes read.
#[derive(Debug, Clone)]
pub struct Admin {
    /// The broker.
    pub broker: Broker,
    /// The node's resource limits.
    pub limits: Arc<NodeLimits>,
    /// The node's id.
    pub node_id: String,
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
        .route("/api/v1/queues", get(queues))
        .route("/api/v1/queues/{name}", get(queue))
        .with_state(admin)
}

/// Serve the admin API until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    admin: Admin,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(admin))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn status(State(admin): State<Admin>) -> Json<Value> {
    Json(admin.limits.status(&admin.node_id))
}

async fn metrics(State(admin): State<Admin>) -> Response {
    let text = crate::metrics::render(&admin.broker, &admin.limits);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

async fn queues(State(broker): State<Broker>) -> Json<Value> {
    let list: Vec<Value> = broker.list().iter().map(queue_json).collect();
    Json(json!({ "queues": list }))
}

async fn queue(State(broker): State<Broker>, Path(name): Path<String>) -> Response {
    match broker.info(&name) {
        Ok(info) => Json(queue_json(&info)).into_response(),
        Err(error) => error_response(&error),
    }
}

/// A queue as JSON: settings, totals and per-partition figures.
pub fn queue_json(info: &QueueInfo) -> Value {
    json!({
        "name": info.name,
        "settings": {
            "partitions": info.settings.partitions,
            "dead_letter": info.settings.dead_letter,
            "max_deliveries": info.settings.max_deliveries,
        },
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
        })).collect::<Vec<_>>(),
    })
}

fn error_response(error: &BrokerError) -> Response {
    let body = crate::tcp::errors::error_body(error);
    let status = StatusCode::from_u16(body.code().0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({ "code": body.code().0, "message": body.message() })),
    )
        .into_response()
}
