//! The audit trail (issue 16) on a node with logins: a declare and a delete over the protocol,
//! a user added over HTTP, a purge refused with 403 and a refused login all show in
//! `GET /api/v1/audit` with who, from where, what, on what and how it ended; a user who is not
//! an admin gets 403 there; after a restart the records are read back from `audit.log`; and no
//! password or hash is ever written to the audit files. It fails if a hook is missing, if the
//! trail is not persisted, or if a secret leaks into it.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use keratin_client::{Client, ClientError, ClientOptions, Credentials};
use keratin_server::config::Config;
use keratin_server::Node;
use serde_json::{json, Value};

fn config(dir: &Path) -> Config {
    let mut config = common::node_config(dir);
    config.server.auth = keratin_server::access::AuthMode::Users;
    config
}

fn basic(user: &str, password: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

/// `method path` with an `Authorization` header and a JSON body (if any), off the runtime.
async fn call(
    addr: SocketAddr,
    method: &'static str,
    path: &str,
    authorization: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let (path, authorization) = (path.to_string(), authorization.to_string());
    tokio::task::spawn_blocking(move || {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut stream = TcpStream::connect(addr).expect("connect");
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Authorization: {authorization}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n\
             {body}",
            body.len()
        )
        .expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read");
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    })
    .await
    .expect("task")
}

fn admin_password(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("data").join("admin-password"))
        .expect("admin-password")
        .trim()
        .to_string()
}

fn options(user: &str, password: &str) -> ClientOptions {
    ClientOptions {
        name: "audit-test".into(),
        credentials: Some(Credentials::Password {
            user: user.into(),
            password: password.into(),
        }),
        request_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    }
}

fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> Option<u16> {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error.code(),
    }
}

/// The record of `action` on `target`, newest first.
fn find<'a>(entries: &'a [Value], action: &str, target: &str) -> &'a Value {
    entries
        .iter()
        .find(|e| e["action"] == action && e["target"] == target)
        .unwrap_or_else(|| panic!("no {action} on {target} in {entries:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_actions_and_refusals_are_recorded_persisted_and_hold_no_secret() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    let (addr, http) = (node.protocol_addr(), node.http_addr());
    let password = admin_password(dir.path());
    let admin_auth = basic("admin", &password);

    let admin = Client::connect(addr, options("admin", &password))
        .await
        .expect("the admin logs in");
    let settings = keratin_client::QueueSettings::default();
    for queue in ["orders", "gone"] {
        admin
            .declare(queue, settings.clone())
            .await
            .expect("declare");
    }
    admin.delete("gone").await.expect("delete");

    let app_password = "app-password-1";
    let (code, body) = call(
        http,
        "POST",
        "/api/v1/users",
        &admin_auth,
        Some(json!({ "name": "app", "password": app_password })),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    let app = Client::connect(addr, options("app", app_password))
        .await
        .expect("app logs in");
    assert_eq!(code_of(app.purge("orders").await), Some(403));
    let refused = Client::connect(addr, options("app", "wrong-password")).await;
    assert_eq!(code_of(refused), Some(401));

    let (code, _) = call(
        http,
        "GET",
        "/api/v1/audit",
        &basic("app", app_password),
        None,
    )
    .await;
    assert_eq!(code, 403, "only admins read the audit trail");

    let (code, body) = call(http, "GET", "/api/v1/audit?limit=50", &admin_auth, None).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["dropped"], 0);
    let entries = body["entries"].as_array().expect("entries").clone();
    let declare = find(&entries, "queue.declare", "orders");
    assert_eq!(declare["user"], "admin");
    assert_eq!(declare["via"], "protocol");
    assert_eq!(declare["outcome"], "ok");
    assert!(declare["from"]
        .as_str()
        .expect("from")
        .starts_with("127.0.0.1:"));
    assert_eq!(find(&entries, "queue.delete", "gone")["outcome"], "ok");
    let add = find(&entries, "user.add", "app");
    assert_eq!(
        (&add["user"], &add["via"]),
        (&json!("admin"), &json!("http"))
    );
    assert_eq!(add["outcome"], "ok");
    assert!(add["from"]
        .as_str()
        .expect("from")
        .starts_with("127.0.0.1:"));
    let purge = find(&entries, "queue.purge", "orders");
    assert_eq!(purge["user"], "app");
    assert!(
        purge["outcome"]
            .as_str()
            .expect("outcome")
            .starts_with("refused: "),
        "{purge}"
    );
    let login = find(&entries, "login.refused", "app");
    assert_eq!(login["user"], Value::Null);
    assert!(login["outcome"]
        .as_str()
        .expect("outcome")
        .starts_with("refused: "));
    let times: Vec<u64> = entries
        .iter()
        .map(|e| e["time_ms"].as_u64().expect("time"))
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {times:?}"
    );

    drop((admin, app));
    node.shutdown().await.expect("shutdown");

    // The files hold no secret: not the passwords, not a hash.
    let data = dir.path().join("data");
    let mut files = String::new();
    for name in ["audit.log", "audit.log.1"] {
        files.push_str(&std::fs::read_to_string(data.join(name)).unwrap_or_default());
    }
    assert!(files.contains("user.add"), "{files}");
    for secret in [password.as_str(), app_password, "wrong-password", "argon2"] {
        assert!(!files.contains(secret), "{secret:?} in the audit files");
    }

    // A restart reads the records back.
    let node = Node::start(&config(dir.path())).await.expect("restart");
    let (code, body) = call(node.http_addr(), "GET", "/api/v1/audit", &admin_auth, None).await;
    assert_eq!(code, 200, "{body}");
    let entries = body["entries"].as_array().expect("entries").clone();
    find(&entries, "queue.declare", "orders");
    find(&entries, "user.add", "app");
    find(&entries, "login.refused", "app");
    node.shutdown().await.expect("shutdown");
}
