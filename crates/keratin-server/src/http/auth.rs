//! Who an HTTP request is (issue 16): every route but `/health` and the dashboard's own files
//! needs `Authorization: Basic` (a user and password) or `Authorization: Bearer` (an API token
//! or a dashboard session from `POST /api/v1/login`). The request then carries its [`Grant`];
//! what each route lets a user do:
//! - reading the node (`GET` of status, cluster, attention, settings, `/metrics`): any user;
//! - a queue (`/api/v1/queues/{name}`): reading it needs any permission on it, its settings
//!   and its purge `manage`; the queue list shows the queues the user has a permission on; streams
//!   (`/api/v1/streams[/{name}]`, read-only) the same, queues and streams sharing one name space;
//! - changing the node or cluster (settings, nodes, replica moves) and users: admins (a user
//!   may change its own password and tokens).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use keratin_auth::Permission;
use keratin_proto::codes::ERR_UNAUTHENTICATED;
use keratin_proto::ErrorBody;
use serde_json::json;

use super::audit::Caller;
use super::Admin;
use crate::access::{Grant, Login, SESSION_TTL};
use crate::audit::Via;

/// The JSON error response of an error body (its code as the HTTP status).
pub(crate) fn body_response(body: &ErrorBody) -> Response {
    let status = StatusCode::from_u16(body.code().0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut document = json!({ "code": body.code().0, "message": body.message() });
    if let Some(retry) = body.retry_after_ms() {
        document["retry_after_ms"] = json!(retry);
    }
    let mut response = (status, Json(document)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static(BEARER_CHALLENGE),
        );
    }
    response
}

/// The challenge of every 401: a token (`Authorization: Bearer TOKEN`).
const BEARER_CHALLENGE: &str = "Bearer realm=\"keratin\"";
/// The challenge of a 401 to a client that is not a page's script: a password works too
/// (`curl -u`, Prometheus' `basic_auth`, a browser's own login box).
const BASIC_CHALLENGE: &str = "Basic realm=\"keratin\", charset=\"UTF-8\"";

/// `response` (a 401 of the login check) naming Basic as well as Bearer, unless `request` is a
/// page's script (`Sec-Fetch-Dest: empty`, as browsers mark `fetch`): a Basic challenge there
/// would open the browser's own login box over the dashboard's form.
fn challenge(request: &Request, mut response: Response) -> Response {
    let from_script = request
        .headers()
        .get("sec-fetch-dest")
        .is_some_and(|dest| dest.as_bytes().eq_ignore_ascii_case(b"empty"));
    if response.status() == StatusCode::UNAUTHORIZED && !from_script {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static(BASIC_CHALLENGE),
        );
        response.headers_mut().append(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static(BEARER_CHALLENGE),
        );
    }
    response
}

/// Routes that need no login: the health check and the dashboard's own files (its page asks
/// for a login itself).
fn is_open(path: &str) -> bool {
    path == "/health" || path == "/" || path.starts_with("/dashboard/")
}

/// The middleware: log the request in, check what its route needs, and hand its [`Grant`] on.
pub(crate) async fn authenticate(
    State(admin): State<Admin>,
    mut request: Request,
    next: Next,
) -> Response {
    if is_open(request.uri().path()) {
        return next.run(request).await;
    }
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0);
    let from = peer.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |peer| peer.ip());
    let login = match presented(&request) {
        Ok(login) => login,
        Err(error) => return challenge(&request, refused_login(&admin, peer, None, &error)),
    };
    let grant = match admin.access.login(&login, from).await {
        Ok(identity) => admin.access.grant(identity),
        Err(error) if matches!(login, Login::Nothing) => {
            return challenge(&request, body_response(&error))
        }
        Err(error) => {
            let refused = refused_login(&admin, peer, login_user(&login), &error);
            return challenge(&request, refused);
        }
    };
    if let Err(error) = route_check(request.method(), request.uri().path(), &grant) {
        return body_response(&error);
    }
    let caller = Caller {
        user: grant.identity().user().map(str::to_string),
        from: peer,
    };
    request.extensions_mut().insert(grant);
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The 401 of a login that presented something wrong, recorded in the audit trail (a
/// request presenting nothing is not a failed login: the dashboard asks that way first).
fn refused_login(
    admin: &Admin,
    peer: Option<SocketAddr>,
    user: Option<&str>,
    error: &ErrorBody,
) -> Response {
    admin
        .audit
        .login_refused(Via::Http, peer, user, error.message());
    body_response(error)
}

/// The user name a login presents, if any.
fn login_user(login: &Login) -> Option<&str> {
    match login {
        Login::Password { user, .. } => Some(user),
        _ => None,
    }
}

/// What the request's `Authorization` header presents.
fn presented(request: &Request) -> Result<Login, ErrorBody> {
    let Some(value) = request.headers().get(header::AUTHORIZATION) else {
        return Ok(Login::Nothing);
    };
    let bad = || {
        ErrorBody::new(
            ERR_UNAUTHENTICATED,
            "the Authorization header is neither `Basic base64(user:password)` nor `Bearer \
             TOKEN`",
        )
    };
    let value = value.to_str().map_err(|_| bad())?;
    let (scheme, rest) = value.split_once(' ').ok_or_else(bad)?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Ok(Login::Token(rest.trim().to_string()));
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(bad());
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(decoded).map_err(|_| bad())?;
    let (user, password) = text.split_once(':').ok_or_else(bad)?;
    Ok(Login::Password {
        user: user.to_string(),
        password: password.to_string(),
    })
}

/// What a route needs beyond a login (handlers that filter or check their own, like the queue
/// list and a user's own password, pass here).
fn route_check(method: &Method, path: &str, grant: &Grant) -> Result<(), ErrorBody> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "v1", "login" | "logout" | "whoami"] => Ok(()),
        ["api", "v1", "users", _, "password" | "tokens", ..] => Ok(()),
        ["api", "v1", "users", ..] => grant.check_admin("manage users"),
        ["api", "v1", "queues" | "streams"] => Ok(()),
        ["api", "v1", "queues" | "streams", name] if method == Method::GET => {
            if grant.sees(name) {
                Ok(())
            } else {
                grant.check(name, Permission::Consume)
            }
        }
        ["api", "v1", "queues", name, "settings" | "purge"] => {
            grant.check(name, Permission::Manage)
        }
        ["api", "v1", "audit"] => grant.check_admin("read the audit trail"),
        _ if method == Method::GET || method == Method::HEAD => Ok(()),
        _ => grant.check_admin(&format!("{method} {path}")),
    }
}

/// `POST /api/v1/login` (with Basic): a dashboard session token, to send as `Bearer`.
pub(crate) async fn login(
    State(admin): State<Admin>,
    Extension(grant): Extension<Grant>,
) -> Response {
    let Some(user) = grant.identity().user() else {
        return Json(json!({ "user": null, "token": null })).into_response();
    };
    match admin.access.open_session(user) {
        Ok(token) => Json(json!({
            "user": user,
            "admin": grant.is_admin(),
            "token": token.reveal(),
            "expires_in_s": SESSION_TTL.as_secs(),
        }))
        .into_response(),
        Err(error) => body_response(&error),
    }
}

/// `POST /api/v1/logout` (with the session's Bearer): the session ends.
pub(crate) async fn logout(State(admin): State<Admin>, request: Request) -> Response {
    if let Some(Ok(Login::Token(token))) = Some(presented(&request)) {
        admin.access.close_session(&token);
    }
    StatusCode::NO_CONTENT.into_response()
}

/// `GET /api/v1/whoami`: the request's user and whether it is an admin (`null` user: the node
/// runs with `server.auth = none`).
pub(crate) async fn whoami(Extension(grant): Extension<Grant>) -> Json<serde_json::Value> {
    Json(json!({ "user": grant.identity().user(), "admin": grant.is_admin() }))
}
