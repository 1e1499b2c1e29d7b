//! A single node's users live in its metadata log: a change is checked before it is stored,
//! a refused one is not stored, the last admin cannot go, and a restart reads the same table.

mod common;

use common::*;
use keratin_auth::{PasswordDigest, Pattern, Permission, Permissions, UserChange};
use keratin_broker::{Broker, BrokerError};

fn digest() -> PasswordDigest {
    static DIGEST: std::sync::OnceLock<PasswordDigest> = std::sync::OnceLock::new();
    DIGEST
        .get_or_init(|| PasswordDigest::hash("correct horse").expect("hashed"))
        .clone()
}

fn add(name: &str, admin: bool) -> UserChange {
    UserChange::Add {
        name: name.into(),
        password: digest(),
        admin,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_are_stored_checked_and_read_back_after_a_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let broker = Broker::open(config(dir.path().join("data")))
        .await
        .expect("open");
    assert!(broker.users().is_empty(), "a new node has no users");
    broker
        .change_users(add("admin", true))
        .await
        .expect("admin");
    broker.change_users(add("app", false)).await.expect("app");
    let grant = UserChange::Grant {
        name: "app".into(),
        pattern: Pattern::new("orders.*").expect("pattern"),
        permissions: Permissions::parse("publish,consume").expect("permissions"),
    };
    let table = broker.change_users(grant).await.expect("granted");
    assert!(table.allows("app", "orders.eu", Permission::Publish));

    // Refused, and nothing stored: a duplicate, an unknown user, the last admin.
    let duplicate = broker.change_users(add("app", false)).await;
    assert!(
        matches!(duplicate, Err(BrokerError::Invalid(_))),
        "{duplicate:?}"
    );
    let unknown = broker
        .change_users(UserChange::Delete {
            name: "ghost".into(),
        })
        .await;
    assert!(
        matches!(unknown, Err(BrokerError::Invalid(_))),
        "{unknown:?}"
    );
    let last_admin = broker
        .change_users(UserChange::Admin {
            name: "admin".into(),
            admin: false,
        })
        .await;
    let Err(BrokerError::Invalid(message)) = last_admin else {
        panic!("the last admin went: {last_admin:?}");
    };
    assert!(message.contains("no admin"), "{message}");
    let before = broker.users();
    broker.shutdown().await.expect("shutdown");

    let broker = Broker::open(config(dir.path().join("data")))
        .await
        .expect("reopen");
    let after = broker.users();
    assert_eq!(*after, *before, "a restart reads the same users");
    assert!(after.is_admin("admin"));
    assert!(after.allows("app", "orders.eu", Permission::Consume));
    assert!(!after.allows("app", "billing", Permission::Consume));
    assert!(after
        .get("app")
        .expect("app")
        .password
        .verify("correct horse"));
    broker.shutdown().await.expect("shutdown");
}
