//! The HTTP admin port (axum): `/health` and the JSON queue API. The limits, settings, metrics
//! and dashboard issues add their routes here.

use std::future::Future;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use keratin_broker::{Broker, BrokerError, QueueInfo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// The admin router over a broker.
pub fn router(broker: Broker) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/api/v1/queues", get(queues))
        .route("/api/v1/queues/{name}", get(queue))
        .with_state(broker)
}

/// Serve the admin API until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    broker: Broker,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(broker))
        .with_graceful_shutdown(shutdown)
        .await
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
