//! `GET /api/v1/audit` (admins only, `auth.rs` checks) and the helpers the HTTP handlers
//! record their changes with: [`Caller`] (who sent the request, set by `auth.rs`) and
//! [`recorded`] (the record of a handler's response). The trail itself is
//! [`crate::audit::AuditLog`].

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::response::Response;
use axum::Json;
use serde_json::{json, Value};

use super::Admin;
use crate::audit::{AuditEntry, AuditLog, Via};

/// Records served by default.
const AUDIT_PAGE_DEFAULT: usize = 100;

/// The most records served at once: all those kept in memory.
const AUDIT_PAGE_MAX: usize = crate::audit::AUDIT_MEMORY_MAX;

/// An error body read back to name a refusal: JSON errors are a few hundred bytes.
const ERROR_BODY_BYTES_MAX: usize = 64 << 10;

/// Who sent a request, for its audit record.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub(crate) user: Option<String>,
    pub(crate) from: Option<SocketAddr>,
}

impl Caller {
    /// A record of `action` on `target` by this caller.
    pub(crate) fn entry(&self, action: &str, target: Option<&str>) -> AuditEntry {
        self.stamp(AuditEntry::new(Via::Http, action, target))
    }

    /// `entry` as made by this caller.
    pub(crate) fn stamp(&self, entry: AuditEntry) -> AuditEntry {
        entry.by(self.user.as_deref(), self.from)
    }
}

/// Record `entry` with the outcome of `response` (its status, and the message of an error
/// body), and hand the response on.
pub(crate) async fn recorded(audit: &AuditLog, entry: AuditEntry, response: Response) -> Response {
    let status = response.status();
    if status.is_success() {
        audit.record(entry);
        return response;
    }
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, ERROR_BODY_BYTES_MAX)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|document| document["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| status.to_string());
    audit.record(entry.with_outcome(Err((status.as_u16(), &message))));
    Response::from_parts(parts, Body::from(bytes))
}

/// The query of `GET /api/v1/audit`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AuditQuery {
    limit: Option<usize>,
    before_ms: Option<u64>,
}

/// `GET /api/v1/audit?limit=N&before_ms=T`: the newest records first (at most `limit`,
/// 100 by default, 1,000 at most), older than `before_ms` if given, and how many records
/// could not be written to disk since the node started.
pub(super) async fn audit(
    State(admin): State<Admin>,
    Query(query): Query<AuditQuery>,
) -> Json<Value> {
    let limit = query
        .limit
        .unwrap_or(AUDIT_PAGE_DEFAULT)
        .min(AUDIT_PAGE_MAX);
    Json(json!({
        "entries": admin.audit.recent(limit, query.before_ms),
        "dropped": admin.audit.dropped(),
    }))
}
