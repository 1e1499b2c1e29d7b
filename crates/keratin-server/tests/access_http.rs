//! Logins and permissions on the HTTP admin port (issue 16), on a node with the default
//! `server.auth = users`:
//! - the first start makes `admin` with a random password in `<data>/admin-password` (0600),
//!   which logs in; a restart keeps it;
//! - every route but `/health` and the dashboard's files answers 401 without a login, and a
//!   user without the permission a route needs gets 403 and changes nothing;
//! - the queue list shows a user the queues it has a permission on;
//! - API tokens and dashboard sessions log in as `Bearer`, and stop when deleted or logged out;
//! - the last admin cannot go.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;

use base64::Engine;
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

/// `method path` with an `Authorization` header (if any) and a JSON body (if any).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let header = authorization
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{header}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
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
}

fn admin_password(dir: &Path) -> String {
    let path = dir.join("data").join("admin-password");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_start_makes_an_admin_whose_password_file_logs_in() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    let file = dir.path().join("data").join("admin-password");
    let mode = std::fs::metadata(&file)
        .expect("the file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "readable by its owner only");
    let password = admin_password(dir.path());
    assert!(password.len() >= 16, "{password:?}");
    let http = node.http_addr();
    let auth = basic("admin", &password);
    let (code, me) =
        tokio::task::spawn_blocking(move || call(http, "GET", "/api/v1/whoami", Some(&auth), None))
            .await
            .expect("task");
    assert_eq!(code, 200, "{me}");
    assert_eq!(me, json!({ "user": "admin", "admin": true }));
    node.shutdown().await.expect("shutdown");

    // A restart keeps the users and does not make another admin.
    let node = Node::start(&config(dir.path())).await.expect("restart");
    assert_eq!(
        admin_password(dir.path()),
        password,
        "the file is not rewritten"
    );
    assert_eq!(node.access().table().len(), 1);
    let http = node.http_addr();
    let auth = basic("admin", &password);
    let (code, _) =
        tokio::task::spawn_blocking(move || call(http, "GET", "/api/v1/whoami", Some(&auth), None))
            .await
            .expect("task");
    assert_eq!(code, 200);
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_need_a_login_and_the_permission_they_name() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    for queue in ["orders.eu", "billing"] {
        node.broker()
            .declare(queue, keratin_broker::QueueSettings::default())
            .await
            .expect("declare");
    }
    let http = node.http_addr();
    let admin = basic("admin", &admin_password(dir.path()));
    let result = tokio::task::spawn_blocking(move || {
        // Open: the health check and the dashboard page (it asks for a login itself).
        assert_eq!(call(http, "GET", "/health", None, None).0, 200);
        assert_eq!(call(http, "GET", "/", None, None).0, 200);
        // Everything else needs a login, and a wrong one is refused the same way (twice
        // only: a third failure from this address would start slowing it).
        for path in [
            "/api/v1/status",
            "/api/v1/queues",
            "/metrics",
            "/api/v1/users",
        ] {
            let (code, body) = call(http, "GET", path, None, None);
            assert_eq!(code, 401, "{path}: {body}");
        }
        for path in ["/api/v1/status", "/api/v1/users"] {
            let (code, _) = call(
                http,
                "GET",
                path,
                Some(&basic("admin", "wrong-password")),
                None,
            );
            assert_eq!(code, 401, "{path} with a wrong password");
        }
        let (code, body) = call(http, "GET", "/api/v1/status", Some("Bearer nonsense"), None);
        assert_eq!(code, 401, "{body}");

        // A user who may publish and consume on orders.* and nothing else.
        let (code, body) = call(
            http,
            "POST",
            "/api/v1/users",
            Some(&admin),
            Some(&json!({ "name": "app", "password": "app-password-1" })),
        );
        assert_eq!(code, 201, "{body}");
        let (code, body) = call(
            http,
            "POST",
            "/api/v1/users/app/grant",
            Some(&admin),
            Some(&json!({ "pattern": "orders.*", "permissions": "publish,consume" })),
        );
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["grants"][0]["pattern"], "orders.*");
        let app = basic("app", "app-password-1");
        assert_eq!(call(http, "GET", "/api/v1/status", Some(&app), None).0, 200);
        assert_eq!(call(http, "GET", "/metrics", Some(&app), None).0, 200);
        let (code, body) = call(http, "GET", "/api/v1/queues", Some(&app), None);
        assert_eq!(code, 200);
        let names: Vec<&str> = body["queues"]
            .as_array()
            .expect("queues")
            .iter()
            .filter_map(|q| q["name"].as_str())
            .collect();
        assert_eq!(
            names,
            ["orders.eu"],
            "only the queues it has a permission on"
        );
        assert_eq!(
            call(http, "GET", "/api/v1/queues/orders.eu", Some(&app), None).0,
            200
        );
        let (code, body) = call(http, "GET", "/api/v1/queues/billing", Some(&app), None);
        assert_eq!(code, 403, "{body}");
        // Refused, and nothing changes: queue settings (manage), node settings and users
        // (admin).
        let (code, body) = call(
            http,
            "PUT",
            "/api/v1/queues/orders.eu/settings",
            Some(&app),
            Some(&json!({ "max_messages": 5 })),
        );
        assert_eq!(code, 403, "{body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap_or_default()
                .contains("manage"),
            "{body}"
        );
        let (code, body) = call(
            http,
            "PUT",
            "/api/v1/settings",
            Some(&app),
            Some(&json!({ "limits.disk.soft_fraction": 0.3 })),
        );
        assert_eq!(code, 403, "{body}");
        assert_eq!(call(http, "GET", "/api/v1/users", Some(&app), None).0, 403);
        let (code, _) = call(
            http,
            "POST",
            "/api/v1/users",
            Some(&app),
            Some(&json!({ "name": "mallory", "password": "mallory-password" })),
        );
        assert_eq!(code, 403);
        let (code, body) = call(http, "GET", "/api/v1/users", Some(&admin), None);
        assert_eq!(code, 200);
        assert_eq!(body["users"].as_array().expect("users").len(), 2, "{body}");
        let (_, settings) = call(http, "GET", "/api/v1/settings", Some(&admin), None);
        assert_eq!(settings["overrides"], json!({}), "nothing was set");
        let (_, queue) = call(http, "GET", "/api/v1/queues/orders.eu", Some(&admin), None);
        assert!(queue["settings"]["max_messages"].is_null(), "{queue}");

        // Its own password it may change; another's not.
        let (code, body) = call(
            http,
            "PUT",
            "/api/v1/users/app/password",
            Some(&app),
            Some(&json!({ "password": "app-password-2" })),
        );
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            call(http, "GET", "/api/v1/status", Some(&app), None).0,
            401,
            "old password"
        );
        let app = basic("app", "app-password-2");
        assert_eq!(call(http, "GET", "/api/v1/status", Some(&app), None).0, 200);
        let (code, _) = call(
            http,
            "PUT",
            "/api/v1/users/admin/password",
            Some(&app),
            Some(&json!({ "password": "taken-over-1" })),
        );
        assert_eq!(code, 403);

        // An API token logs in as Bearer until it is deleted.
        let (code, token) = call(
            http,
            "POST",
            "/api/v1/users/app/tokens",
            Some(&app),
            Some(&json!({ "token": "ci" })),
        );
        assert_eq!(code, 201, "{token}");
        let bearer = format!("Bearer {}", token["token"].as_str().expect("token"));
        let (code, me) = call(http, "GET", "/api/v1/whoami", Some(&bearer), None);
        assert_eq!((code, me["user"].clone()), (200, json!("app")));
        let (_, listed) = call(http, "GET", "/api/v1/users/app", Some(&admin), None);
        assert_eq!(listed["tokens"], json!(["ci"]), "names only: {listed}");
        assert!(
            !listed.to_string().contains("argon2"),
            "no hash shown: {listed}"
        );
        assert_eq!(
            call(
                http,
                "DELETE",
                "/api/v1/users/app/tokens/ci",
                Some(&app),
                None
            )
            .0,
            204
        );
        assert_eq!(
            call(http, "GET", "/api/v1/whoami", Some(&bearer), None).0,
            401
        );

        // A dashboard session: a Bearer token from a Basic login, ended by logout.
        let (code, session) = call(http, "POST", "/api/v1/login", Some(&app), None);
        assert_eq!(code, 200, "{session}");
        let bearer = format!("Bearer {}", session["token"].as_str().expect("token"));
        assert_eq!(
            call(http, "GET", "/api/v1/status", Some(&bearer), None).0,
            200
        );
        assert_eq!(
            call(http, "POST", "/api/v1/logout", Some(&bearer), None).0,
            204
        );
        assert_eq!(
            call(http, "GET", "/api/v1/status", Some(&bearer), None).0,
            401
        );

        // The last admin stays; a deleted user logs in no more.
        let (code, body) = call(http, "DELETE", "/api/v1/users/admin", Some(&admin), None);
        assert_eq!(code, 400, "{body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap_or_default()
                .contains("no admin"),
            "{body}"
        );
        assert_eq!(
            call(http, "DELETE", "/api/v1/users/app", Some(&admin), None).0,
            204
        );
        assert_eq!(call(http, "GET", "/api/v1/status", Some(&app), None).0, 401);
        assert_eq!(
            call(http, "DELETE", "/api/v1/users/app", Some(&admin), None).0,
            404
        );
    })
    .await;
    node.shutdown().await.expect("shutdown");
    result.expect("checks");
}

/// `GET path` with extra header lines; the response's status line and headers, lower-cased.
fn head_of(addr: SocketAddr, path: &str, headers: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
        .split_once("\r\n\r\n")
        .map_or(response.as_str(), |(head, _)| head)
        .to_ascii_lowercase()
}

/// What a scraper or `curl` meets: a 401 names both schemes the port takes (Basic and
/// Bearer), except to a page's script, where a Basic challenge would open the browser's login
/// box over the dashboard's; `/metrics` is sent under the OpenMetrics content type its text is
/// in (it ends with `# EOF`). Before: only `Bearer` was named, and the OpenMetrics text went
/// out as Prometheus' `text/plain; version=0.0.4`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_names_basic_and_bearer_and_metrics_say_they_are_openmetrics() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    let http = node.http_addr();
    let admin = basic("admin", &admin_password(dir.path()));
    let result = tokio::task::spawn_blocking(move || {
        let refused = head_of(http, "/metrics", "");
        assert!(refused.starts_with("http/1.1 401"), "{refused}");
        assert!(
            refused.contains("www-authenticate: basic realm=\"keratin\"")
                && refused.contains("www-authenticate: bearer realm=\"keratin\""),
            "{refused}"
        );
        let from_script = head_of(http, "/api/v1/status", "Sec-Fetch-Dest: empty\r\n");
        assert!(
            from_script.starts_with("http/1.1 401")
                && from_script.contains("www-authenticate: bearer")
                && !from_script.contains("basic"),
            "{from_script}"
        );
        let scraped = head_of(http, "/metrics", &format!("Authorization: {admin}\r\n"));
        assert!(
            scraped.starts_with("http/1.1 200")
                && scraped.contains("content-type: application/openmetrics-text; version=1.0.0"),
            "{scraped}"
        );
    })
    .await;
    node.shutdown().await.expect("shutdown");
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
}
