//! Logins and permissions on the protocol port (issue 16), on a node with the default
//! `server.auth = users`:
//! - a connection without a login, with a wrong password or an unknown token is refused in the
//!   handshake with 401;
//! - every verb a user lacks the permission for is answered 403 naming it, and nothing is
//!   applied (no queue made, deleted, purged or changed; no message stored);
//! - the queue list shows the queues the user has a permission on;
//! - a user deleted while connected loses its permissions at once;
//! - a login flood neither grows the node's memory without bound nor stops it serving a
//!   logged-in client.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use keratin_client::{Client, ClientError, ClientOptions, Credentials, OutgoingMessage};
use keratin_server::config::Config;
use keratin_server::Node;

fn config(dir: &Path) -> Config {
    let mut config = common::node_config(dir);
    config.server.auth = keratin_server::access::AuthMode::Users;
    config
}

fn admin_password(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("data").join("admin-password"))
        .expect("the admin password file")
        .trim()
        .to_string()
}

fn options(credentials: Option<Credentials>) -> ClientOptions {
    ClientOptions {
        name: "access-test".into(),
        credentials,
        request_timeout: Duration::from_secs(10),
        publish_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    }
}

fn password(user: &str, password: &str) -> Option<Credentials> {
    Some(Credentials::Password {
        user: user.into(),
        password: password.into(),
    })
}

fn code_of(result: Result<impl std::fmt::Debug, ClientError>) -> Option<u16> {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error.code(),
    }
}

async fn add_user(node: &Node, name: &str, secret: &str, grants: &[(&str, &str)]) {
    use keratin_auth::{PasswordDigest, Pattern, Permissions, UserChange};
    let access = node.access();
    let digest = PasswordDigest::hash(secret).expect("hashed");
    access
        .change(UserChange::Add {
            name: name.into(),
            password: digest,
            admin: false,
        })
        .await
        .expect("added");
    for (pattern, permissions) in grants {
        access
            .change(UserChange::Grant {
                name: name.into(),
                pattern: Pattern::new(pattern).expect("pattern"),
                permissions: Permissions::parse(permissions).expect("permissions"),
            })
            .await
            .expect("granted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verb_needs_a_login_and_the_permission_it_names() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    let addr = node.protocol_addr();

    // Refused in the handshake: no login, a wrong password, an unknown user, a bad token.
    for credentials in [
        None,
        password("admin", "not-the-password"),
        password("nobody", "whatever-password"),
        Some(Credentials::Token(format!("kt_{}", "0".repeat(64)))),
    ] {
        let refused = Client::connect(addr, options(credentials.clone())).await;
        assert_eq!(code_of(refused), Some(401), "{credentials:?}");
    }

    let admin = Client::connect(
        addr,
        options(password("admin", &admin_password(dir.path()))),
    )
    .await
    .expect("the admin logs in");
    assert_eq!(admin.user(), Some("admin"));
    for queue in ["orders.eu", "billing"] {
        admin
            .declare(queue, keratin_client::QueueSettings::default())
            .await
            .expect("declare");
    }
    admin
        .publish("billing", OutgoingMessage::new(&b"invoice"[..]))
        .await
        .expect("publish");
    add_user(
        &node,
        "app",
        "app-password-1",
        &[("orders.*", "publish,consume")],
    )
    .await;
    let app = Client::connect(addr, options(password("app", "app-password-1")))
        .await
        .expect("app logs in");
    assert_eq!(app.user(), Some("app"));

    // Manage verbs: 403, and nothing changes.
    let settings = keratin_client::QueueSettings::default();
    let refused = [
        (
            "declare",
            code_of(app.declare("orders.new", settings.clone()).await),
        ),
        ("delete", code_of(app.delete("orders.eu").await)),
        ("purge", code_of(app.purge("billing").await)),
        ("info", code_of(app.info("billing").await)),
        (
            "subscribe",
            code_of(app.subscribe("billing", 10).await.map(|_| ())),
        ),
    ];
    for (verb, code) in refused {
        assert_eq!(code, Some(403), "{verb}");
    }
    let publish = app
        .publish("billing", OutgoingMessage::new(&b"forged"[..]))
        .await;
    let Err(failed) = publish else {
        panic!("a publish without the permission was confirmed");
    };
    assert_eq!(failed.code(), Some(403), "{failed}");
    assert!(
        failed.to_string().contains("publish") && failed.to_string().contains("billing"),
        "the 403 names the permission and the queue: {failed}"
    );
    let names: Vec<String> = admin
        .list()
        .await
        .expect("list")
        .into_iter()
        .map(|q| q.queue)
        .collect();
    assert_eq!(
        names,
        ["billing", "orders.eu"],
        "nothing declared or deleted"
    );
    let billing = admin.info("billing").await.expect("info");
    let ready: u64 = billing.partitions.iter().map(|p| p.ready).sum();
    assert_eq!(ready, 1, "not purged, and the forged message not stored");

    // What it may do, it does; the list shows what it has a permission on.
    let seen: Vec<String> = app
        .list()
        .await
        .expect("list")
        .into_iter()
        .map(|q| q.queue)
        .collect();
    assert_eq!(seen, ["orders.eu"]);
    app.publish("orders.eu", OutgoingMessage::new(&b"order"[..]))
        .await
        .expect("publish where allowed");
    let mut consumer = app.subscribe("orders.eu", 10).await.expect("subscribe");
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.recv())
        .await
        .expect("a delivery in time")
        .expect("a delivery");
    assert_eq!(&delivery.body[..], b"order");
    delivery.ack().expect("ack");
    drop(consumer);

    // A user deleted while connected can do nothing more on its open connection.
    node.access()
        .change(keratin_auth::UserChange::Delete { name: "app".into() })
        .await
        .expect("deleted");
    let after = app
        .publish("orders.eu", OutgoingMessage::new(&b"late"[..]))
        .await;
    assert_eq!(after.err().and_then(|f| f.code()), Some(403));
    app.close().await;
    admin.close().await;
    node.shutdown().await.expect("shutdown");
}

/// Resident memory of this process (the node runs in it), from /proc.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

/// 300 connections log in at once with wrong passwords: at most 2 argon2 verifications run at
/// a time (~19 MiB each) and at most 64 wait, the rest are refused at once with 401 and a
/// retry hint; the node's memory grows by far less than 300 verifications would take, and a
/// client that logged in before keeps publishing meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_flood_keeps_memory_bounded_and_the_node_serving() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(&config(dir.path())).await.expect("start");
    let addr = node.protocol_addr();
    let admin = Client::connect(
        addr,
        options(password("admin", &admin_password(dir.path()))),
    )
    .await
    .expect("the admin logs in");
    admin
        .declare("q", keratin_client::QueueSettings::default())
        .await
        .expect("declare");
    let before = rss_bytes();
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..300 {
        flood.spawn(async move {
            let attempt = Client::connect(
                addr,
                options(password(&format!("guess{i}"), "wrong-password")),
            )
            .await;
            attempt.err().and_then(|e| e.code())
        });
    }
    // The logged-in client publishes throughout.
    let started = Instant::now();
    let mut published = 0u32;
    let mut slowest = Duration::ZERO;
    while !flood.is_empty() && started.elapsed() < Duration::from_secs(60) {
        let one = Instant::now();
        admin
            .publish("q", OutgoingMessage::new(&b"during the flood"[..]))
            .await
            .expect("publish during the flood");
        slowest = slowest.max(one.elapsed());
        published += 1;
        while let Some(done) = flood.try_join_next() {
            assert_eq!(done.expect("task"), Some(401), "every guess is refused");
        }
    }
    while let Some(done) = flood.join_next().await {
        assert_eq!(done.expect("task"), Some(401), "every guess is refused");
    }
    let grown = rss_bytes().saturating_sub(before);
    assert!(published > 0);
    assert!(
        slowest < Duration::from_secs(5),
        "a publish took {slowest:?} during the flood"
    );
    // 300 verifications at once would take ~5.7 GiB; the gate allows 2.
    assert!(
        grown < 256 << 20,
        "the node grew by {} MiB during the flood",
        grown >> 20
    );
    admin.close().await;
    node.shutdown().await.expect("shutdown");
}
