//! `/api/v1/users`: the users, their permissions and API tokens (issue 16). Admins only, but a
//! user may change its own password and tokens (`auth.rs` lets those routes through; they
//! check here). Passwords are hashed here, on the blocking pool, and only hashes are stored.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use keratin_auth::{
    check_password, ApiToken, PasswordDigest, Pattern, Permissions, Quota, User, UserChange,
};
use keratin_proto::codes::{ERR_BAD_REQUEST, ERR_INTERNAL, ERR_NOT_FOUND, ERR_UNAVAILABLE};
use keratin_proto::ErrorBody;
use serde::Deserialize;
use serde_json::{json, Value};

use super::audit::{recorded, Caller};
use super::auth::body_response;
use super::Admin;
use crate::access::{Grant, UserChangeError};
use crate::audit::AuditEntry;

/// One user as the API shows it: never its hash, only its tokens' names.
pub(crate) fn user_json(user: &User) -> Value {
    json!({
        "name": user.name,
        "admin": user.grants.admin,
        "grants": user.grants.rules.iter().map(|rule| json!({
            "pattern": rule.pattern.as_str(),
            "permissions": rule.permissions.iter().map(|p| p.name()).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "tokens": user.tokens.keys().collect::<Vec<_>>(),
        "quota": {
            "bytes_per_s": user.quota.bytes_per_s,
            "messages_per_s": user.quota.messages_per_s,
        },
    })
}

/// `GET /api/v1/users`.
pub(crate) async fn list(State(admin): State<Admin>) -> Json<Value> {
    let table = admin.access.table();
    Json(json!({ "users": table.iter().map(user_json).collect::<Vec<_>>() }))
}

/// The body of `POST /api/v1/users`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewUser {
    name: String,
    password: String,
    #[serde(default)]
    admin: bool,
}

/// `POST /api/v1/users`: a new user (201 with the user).
pub(crate) async fn add(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Json(new): Json<NewUser>,
) -> Response {
    let password = match hash(new.password).await {
        Ok(password) => password,
        Err(error) => return body_response(&error),
    };
    let change = UserChange::Add {
        name: new.name.clone(),
        password,
        admin: new.admin,
    };
    changed(&admin, &caller, change, &new.name, StatusCode::CREATED).await
}

/// `DELETE /api/v1/users/{name}`.
pub(crate) async fn delete(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Response {
    changed(
        &admin,
        &caller,
        UserChange::Delete { name: name.clone() },
        &name,
        StatusCode::NO_CONTENT,
    )
    .await
}

/// `GET /api/v1/users/{name}`.
pub(crate) async fn get(State(admin): State<Admin>, Path(name): Path<String>) -> Response {
    if let Err(missing) = exists(&admin, &name) {
        return missing;
    }
    match admin.access.table().get(&name) {
        Some(user) => Json(user_json(user)).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The body of `PUT /api/v1/users/{name}/password`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPassword {
    password: String,
}

/// `PUT /api/v1/users/{name}/password`: an admin's, or the user's own.
pub(crate) async fn password(
    State(admin): State<Admin>,
    Extension(grant): Extension<Grant>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(body): Json<NewPassword>,
) -> Response {
    if let Err(error) = self_or_admin(&grant, &name, "change another user's password") {
        return body_response(&error);
    }
    let password = match hash(body.password).await {
        Ok(password) => password,
        Err(error) => return body_response(&error),
    };
    let change = UserChange::Password {
        name: name.clone(),
        password,
    };
    changed(&admin, &caller, change, &name, StatusCode::OK).await
}

/// The body of `PUT /api/v1/users/{name}/admin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AdminFlag {
    admin: bool,
}

/// `PUT /api/v1/users/{name}/admin`.
pub(crate) async fn set_admin(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(body): Json<AdminFlag>,
) -> Response {
    let change = UserChange::Admin {
        name: name.clone(),
        admin: body.admin,
    };
    changed(&admin, &caller, change, &name, StatusCode::OK).await
}

/// The body of a grant or revoke.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Rule {
    pattern: String,
    /// `publish,consume,manage`, any of them.
    permissions: String,
}

/// `POST /api/v1/users/{name}/grant`.
pub(crate) async fn grant(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(rule): Json<Rule>,
) -> Response {
    let (pattern, permissions) = match parse_rule(&rule) {
        Ok(parsed) => parsed,
        Err(error) => return body_response(&error),
    };
    let change = UserChange::Grant {
        name: name.clone(),
        pattern,
        permissions,
    };
    changed(&admin, &caller, change, &name, StatusCode::OK).await
}

/// `POST /api/v1/users/{name}/revoke`.
pub(crate) async fn revoke(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(rule): Json<Rule>,
) -> Response {
    let (pattern, permissions) = match parse_rule(&rule) {
        Ok(parsed) => parsed,
        Err(error) => return body_response(&error),
    };
    let change = UserChange::Revoke {
        name: name.clone(),
        pattern,
        permissions,
    };
    changed(&admin, &caller, change, &name, StatusCode::OK).await
}

/// `PUT /api/v1/users/{name}/quota`: the user's publish quota on each node (`null` or absent:
/// that rate unlimited).
pub(crate) async fn set_quota(
    State(admin): State<Admin>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(quota): Json<Quota>,
) -> Response {
    let change = UserChange::Quota {
        name: name.clone(),
        quota,
    };
    changed(&admin, &caller, change, &name, StatusCode::OK).await
}

/// The body of `POST /api/v1/users/{name}/tokens`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewToken {
    token: String,
}

/// `POST /api/v1/users/{name}/tokens`: a new API token, shown once in the answer (only its
/// digest is stored).
pub(crate) async fn add_token(
    State(admin): State<Admin>,
    Extension(grant): Extension<Grant>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Json(body): Json<NewToken>,
) -> Response {
    if let Err(error) = self_or_admin(&grant, &name, "give another user a token") {
        return body_response(&error);
    }
    if let Err(missing) = exists(&admin, &name) {
        return missing;
    }
    let token = match ApiToken::generate() {
        Ok(token) => token,
        Err(error) => return body_response(&ErrorBody::new(ERR_INTERNAL, error.to_string())),
    };
    let change = UserChange::TokenAdd {
        name: name.clone(),
        token: body.token.clone(),
        digest: token.digest(),
    };
    let entry = caller.stamp(AuditEntry::user_change(&change));
    let response = match admin.access.change(change).await {
        Ok(_) => (
            StatusCode::CREATED,
            Json(json!({
                "user": name,
                "name": body.token,
                "token": token.reveal(),
                "note": "shown once: only its digest is stored",
            })),
        )
            .into_response(),
        Err(error) => change_error(&error),
    };
    recorded(&admin.audit, entry, response).await
}

/// `DELETE /api/v1/users/{name}/tokens/{token}`.
pub(crate) async fn delete_token(
    State(admin): State<Admin>,
    Extension(grant): Extension<Grant>,
    Extension(caller): Extension<Caller>,
    Path((name, token)): Path<(String, String)>,
) -> Response {
    if let Err(error) = self_or_admin(&grant, &name, "delete another user's token") {
        return body_response(&error);
    }
    if let Err(missing) = exists(&admin, &name) {
        return missing;
    }
    let change = UserChange::TokenDelete { name, token };
    let entry = caller.stamp(AuditEntry::user_change(&change));
    let response = match admin.access.change(change).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => change_error(&error),
    };
    recorded(&admin.audit, entry, response).await
}

fn self_or_admin(grant: &Grant, name: &str, what: &str) -> Result<(), ErrorBody> {
    if grant.identity().user() == Some(name) {
        return Ok(());
    }
    grant.check_admin(what)
}

fn parse_rule(rule: &Rule) -> Result<(Pattern, Permissions), ErrorBody> {
    let bad = |e: keratin_auth::AuthError| ErrorBody::new(ERR_BAD_REQUEST, e.to_string());
    Ok((
        Pattern::new(&rule.pattern).map_err(bad)?,
        Permissions::parse(&rule.permissions).map_err(bad)?,
    ))
}

/// Check and hash a password on the blocking pool (argon2id: tens of milliseconds, 19 MiB).
async fn hash(password: String) -> Result<PasswordDigest, ErrorBody> {
    check_password(&password).map_err(|e| ErrorBody::new(ERR_BAD_REQUEST, e.to_string()))?;
    tokio::task::spawn_blocking(move || PasswordDigest::hash(&password))
        .await
        .map_err(|e| ErrorBody::new(ERR_INTERNAL, e.to_string()))?
        .map_err(|e| ErrorBody::new(ERR_INTERNAL, e.to_string()))
}

/// Make `change`, record it in the audit trail, and answer with the user `name` as it is
/// after it.
async fn changed(
    admin: &Admin,
    caller: &Caller,
    change: UserChange,
    name: &str,
    status: StatusCode,
) -> Response {
    let entry = caller.stamp(AuditEntry::user_change(&change));
    let response = change_answer(admin, change, name, status).await;
    recorded(&admin.audit, entry, response).await
}

async fn change_answer(
    admin: &Admin,
    change: UserChange,
    name: &str,
    status: StatusCode,
) -> Response {
    if !matches!(change, UserChange::Add { .. }) {
        if let Err(missing) = exists(admin, name) {
            return missing;
        }
    }
    match admin.access.change(change).await {
        Ok(table) => match table.get(name) {
            Some(user) if status != StatusCode::NO_CONTENT => {
                (status, Json(user_json(user))).into_response()
            }
            _ => StatusCode::NO_CONTENT.into_response(),
        },
        Err(error) => change_error(&error),
    }
}

/// Ok, or the 404 of an unknown user.
#[expect(
    clippy::result_large_err,
    reason = "the 404 response itself, returned at once by the handler; not kept or passed on"
)]
fn exists(admin: &Admin, name: &str) -> Result<(), Response> {
    if admin.access.table().get(name).is_some() {
        return Ok(());
    }
    Err(body_response(&ErrorBody::new(
        ERR_NOT_FOUND,
        format!("no user {name:?} (`keratin user list` shows them)"),
    )))
}

fn change_error(error: &UserChangeError) -> Response {
    let code = match error {
        UserChangeError::Refused(_) => ERR_BAD_REQUEST,
        UserChangeError::Store(_) => ERR_UNAVAILABLE,
    };
    body_response(&ErrorBody::new(code, error.to_string()))
}
