//! The user table: users, their password hashes and grants, as a state machine of
//! [`UserChange`]s. The broker stores the changes (the node's metadata log on a single node,
//! the cluster log in a cluster) and applies them here in log order, so every node holds the
//! same table; a change that does not apply (an unknown user, a duplicate) is refused before it
//! is stored, and refused the same way if it is ever replayed.

use std::collections::BTreeMap;

use crate::error::{AuthError, AuthResult};
use crate::password::PasswordDigest;
use crate::rules::{Grants, Pattern, Permission, Permissions};
use crate::token::TokenDigest;

/// The most users a table holds.
pub const MAX_USERS: usize = 10_000;

/// The most API tokens one user holds.
pub const MAX_TOKENS_PER_USER: usize = 16;

/// One user.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct User {
    /// Its name.
    pub name: String,
    /// Its password's hash.
    pub password: PasswordDigest,
    /// What it may do.
    pub grants: Grants,
    /// Its API tokens by name, stored as digests.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tokens: BTreeMap<String, TokenDigest>,
    /// Its publish quota on each node (none: unlimited).
    #[serde(default, skip_serializing_if = "Quota::is_unlimited")]
    pub quota: Quota,
}

/// A user's publish quota, enforced on each node separately (Kafka's producer quotas are per
/// broker too): at most this many bytes (message bodies) and messages per second. A short
/// deficit delays the publish; a longer one refuses it with `ERR_LIMITED` reason `quota`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Quota {
    /// Bytes per second, if limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_s: Option<u64>,
    /// Messages per second, if limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_per_s: Option<u64>,
}

impl Quota {
    /// True when neither rate is limited.
    pub fn is_unlimited(&self) -> bool {
        self.bytes_per_s.is_none() && self.messages_per_s.is_none()
    }
}

/// A change to the user table, as stored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum UserChange {
    /// A new user (refused if the name is taken).
    Add {
        /// Its name.
        name: String,
        /// Its password's hash.
        password: PasswordDigest,
        /// Admin or not.
        admin: bool,
    },
    /// A new password for a user.
    Password {
        /// The user.
        name: String,
        /// The new hash.
        password: PasswordDigest,
    },
    /// Make a user an admin or not.
    Admin {
        /// The user.
        name: String,
        /// Admin or not.
        admin: bool,
    },
    /// Add permissions on a pattern.
    Grant {
        /// The user.
        name: String,
        /// The queues.
        pattern: Pattern,
        /// What is added.
        permissions: Permissions,
    },
    /// Take permissions on a pattern.
    Revoke {
        /// The user.
        name: String,
        /// The queues.
        pattern: Pattern,
        /// What is taken.
        permissions: Permissions,
    },
    /// Remove a user.
    Delete {
        /// The user.
        name: String,
    },
    /// Set a user's publish quota (a rate of 0 is refused: delete the user or revoke
    /// `publish` instead).
    Quota {
        /// The user.
        name: String,
        /// The quota from here on.
        quota: Quota,
    },
    /// Give a user an API token (refused if it has one of that name).
    TokenAdd {
        /// The user.
        name: String,
        /// The token's name, to list and delete it by.
        token: String,
        /// The token's digest.
        digest: TokenDigest,
    },
    /// Take a user's API token.
    TokenDelete {
        /// The user.
        name: String,
        /// The token's name.
        token: String,
    },
}

impl UserChange {
    /// The user it changes.
    pub fn user(&self) -> &str {
        match self {
            UserChange::Add { name, .. }
            | UserChange::Password { name, .. }
            | UserChange::Admin { name, .. }
            | UserChange::Grant { name, .. }
            | UserChange::Revoke { name, .. }
            | UserChange::Delete { name }
            | UserChange::Quota { name, .. }
            | UserChange::TokenAdd { name, .. }
            | UserChange::TokenDelete { name, .. } => name,
        }
    }
}

/// Check a user name: 1 to 64 letters, digits, `.`, `_`, `-` or `@`.
pub fn check_user_name(name: &str) -> AuthResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if ok {
        Ok(())
    } else {
        Err(AuthError::Invalid(format!(
            "user name {name:?}: expected 1 to 64 letters, digits, '.', '_', '-' or '@'"
        )))
    }
}

/// The users, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserTable {
    users: BTreeMap<String, User>,
}

impl UserTable {
    /// An empty table.
    pub fn new() -> UserTable {
        UserTable::default()
    }

    /// The user called `name`.
    pub fn get(&self, name: &str) -> Option<&User> {
        self.users.get(name)
    }

    /// Every user, by name.
    pub fn iter(&self) -> impl Iterator<Item = &User> {
        self.users.values()
    }

    /// How many users.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// True if there is none.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// True if `user` may do `permission` to `queue` (false for an unknown user).
    pub fn allows(&self, user: &str, queue: &str, permission: Permission) -> bool {
        self.users
            .get(user)
            .is_some_and(|u| u.grants.allows(queue, permission))
    }

    /// True if `user` is an admin.
    pub fn is_admin(&self, user: &str) -> bool {
        self.users.get(user).is_some_and(|u| u.grants.admin)
    }

    /// Check that `change` applies, without applying it: what the broker asks before it
    /// stores the change.
    pub fn check(&self, change: &UserChange) -> AuthResult<()> {
        self.clone().apply(change)
    }

    /// Apply a change. A refused change leaves the table as it was.
    pub fn apply(&mut self, change: &UserChange) -> AuthResult<()> {
        check_user_name(change.user())?;
        if let UserChange::Add {
            name,
            password,
            admin,
        } = change
        {
            if self.users.contains_key(name) {
                return Err(AuthError::Invalid(format!(
                    "user {name:?} exists: change its password with `keratin user passwd`"
                )));
            }
            if self.users.len() >= MAX_USERS {
                return Err(AuthError::Invalid(format!(
                    "the broker holds at most {MAX_USERS} users: delete some first"
                )));
            }
            self.users.insert(
                name.clone(),
                User {
                    name: name.clone(),
                    password: password.clone(),
                    grants: Grants {
                        admin: *admin,
                        rules: Vec::new(),
                    },
                    tokens: BTreeMap::new(),
                    quota: Quota::default(),
                },
            );
            return Ok(());
        }
        if let UserChange::Delete { name } = change {
            if self.users.remove(name).is_none() {
                return Err(unknown(name));
            }
            return Ok(());
        }
        let user = self
            .users
            .get_mut(change.user())
            .ok_or_else(|| unknown(change.user()))?;
        match change {
            UserChange::Password { password, .. } => user.password = password.clone(),
            UserChange::Admin { admin, .. } => user.grants.admin = *admin,
            UserChange::Grant {
                pattern,
                permissions,
                ..
            } => {
                let mut grants = user.grants.clone();
                grants.grant(pattern.clone(), *permissions)?;
                user.grants = grants;
            }
            UserChange::Revoke {
                pattern,
                permissions,
                ..
            } => {
                let mut grants = user.grants.clone();
                grants.revoke(pattern, *permissions)?;
                user.grants = grants;
            }
            UserChange::Quota { quota, .. } => {
                if quota.bytes_per_s == Some(0) || quota.messages_per_s == Some(0) {
                    return Err(AuthError::Invalid(
                        "a quota of 0 per second would refuse every publish: revoke `publish` \
                         instead"
                            .into(),
                    ));
                }
                user.quota = *quota;
            }
            UserChange::TokenAdd { token, digest, .. } => {
                check_token_name(token)?;
                if user.tokens.contains_key(token) {
                    return Err(AuthError::Invalid(format!(
                        "user {:?} has a token named {token:?}: delete it first or pick another name",
                        user.name
                    )));
                }
                if user.tokens.len() >= MAX_TOKENS_PER_USER {
                    return Err(AuthError::Invalid(format!(
                        "a user holds at most {MAX_TOKENS_PER_USER} tokens: delete one first"
                    )));
                }
                user.tokens.insert(token.clone(), *digest);
            }
            UserChange::TokenDelete { token, .. } => {
                if user.tokens.remove(token).is_none() {
                    return Err(AuthError::Invalid(format!(
                        "user {:?} has no token named {token:?}",
                        user.name
                    )));
                }
            }
            UserChange::Add { .. } | UserChange::Delete { .. } => {
                unreachable!("handled above")
            }
        }
        Ok(())
    }

    /// The table after `change`, or why it is refused: the change must apply, and must not
    /// leave a table that has an admin without one (no one could manage users again). What
    /// the broker checks before it stores a change, and again when it applies a stored one.
    pub fn changed(&self, change: &UserChange) -> AuthResult<UserTable> {
        let mut next = self.clone();
        next.apply(change)?;
        if self.admins() > 0 && next.admins() == 0 {
            return Err(AuthError::Invalid(format!(
                "this change leaves no admin (user {:?} is the last): make another user an \
                 admin first",
                change.user()
            )));
        }
        Ok(next)
    }

    /// The user holding the API token `presented`, if any. Every stored digest is compared
    /// in constant time.
    pub fn user_of_token(&self, presented: &str) -> Option<&User> {
        if !TokenDigest::looks_like_token(presented) {
            return None;
        }
        let digest = TokenDigest::of(presented);
        let mut found = None;
        for user in self.users.values() {
            for stored in user.tokens.values() {
                if stored.same_as(&digest) {
                    found = Some(user);
                }
            }
        }
        found
    }

    /// The number of admins: the broker refuses a change that would leave none (no one could
    /// manage users again).
    pub fn admins(&self) -> usize {
        self.users.values().filter(|u| u.grants.admin).count()
    }
}

/// Check a token name: the same characters as a user name.
fn check_token_name(token: &str) -> AuthResult<()> {
    check_user_name(token).map_err(|_| {
        AuthError::Invalid(format!(
            "token name {token:?}: expected 1 to 64 letters, digits, '.', '_', '-' or '@'"
        ))
    })
}

fn unknown(name: &str) -> AuthError {
    AuthError::Invalid(format!("no user {name:?} (`keratin user list` shows them)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest() -> PasswordDigest {
        // One hash for all: hashing is the slow part of these tests.
        static DIGEST: std::sync::OnceLock<PasswordDigest> = std::sync::OnceLock::new();
        DIGEST
            .get_or_init(|| PasswordDigest::hash("password1").expect("hashed"))
            .clone()
    }

    fn add(name: &str, admin: bool) -> UserChange {
        UserChange::Add {
            name: name.into(),
            password: digest(),
            admin,
        }
    }

    #[test]
    fn changes_apply_in_order_and_refusals_change_nothing() {
        let mut table = UserTable::new();
        table.apply(&add("alice", false)).expect("added");
        assert!(table.apply(&add("alice", false)).is_err(), "a duplicate");
        assert!(table.apply(&add("bad name", false)).is_err());
        let grant = UserChange::Grant {
            name: "alice".into(),
            pattern: Pattern::new("orders.*").expect("p"),
            permissions: Permissions::parse("publish").expect("p"),
        };
        table.apply(&grant).expect("granted");
        assert!(table.allows("alice", "orders.eu", Permission::Publish));
        assert!(!table.allows("alice", "orders.eu", Permission::Consume));
        assert!(!table.allows("bob", "orders.eu", Permission::Publish));
        let before = table.clone();
        let bad_revoke = UserChange::Revoke {
            name: "alice".into(),
            pattern: Pattern::new("billing").expect("p"),
            permissions: Permissions::ALL,
        };
        assert!(table.check(&bad_revoke).is_err());
        assert!(table.apply(&bad_revoke).is_err());
        assert_eq!(table, before, "a refused change leaves the table");
        table
            .apply(&UserChange::Admin {
                name: "alice".into(),
                admin: true,
            })
            .expect("admin");
        assert_eq!(table.admins(), 1);
        assert!(table.is_admin("alice"));
        table
            .apply(&UserChange::Delete {
                name: "alice".into(),
            })
            .expect("deleted");
        assert!(table.is_empty());
        assert!(table
            .apply(&UserChange::Delete {
                name: "alice".into()
            })
            .is_err());
    }

    #[test]
    fn changes_round_trip_through_json_and_replay_to_the_same_table() {
        let changes = vec![
            add("admin", true),
            add("app", false),
            UserChange::Grant {
                name: "app".into(),
                pattern: Pattern::new("*").expect("p"),
                permissions: Permissions::parse("publish,consume").expect("p"),
            },
            UserChange::Password {
                name: "app".into(),
                password: digest(),
            },
        ];
        let mut table = UserTable::new();
        let mut stored = Vec::new();
        for change in &changes {
            table.apply(change).expect("applied");
            stored.push(serde_json::to_string(change).expect("json"));
        }
        assert!(
            stored[2].starts_with(r#"{"change":"grant","name":"app""#),
            "{}",
            stored[2]
        );
        let mut replayed = UserTable::new();
        for text in &stored {
            let change: UserChange = serde_json::from_str(text).expect("parsed");
            replayed.apply(&change).expect("replayed");
        }
        assert_eq!(replayed, table);
        assert!(replayed
            .get("app")
            .expect("app")
            .password
            .verify("password1"));
    }

    #[test]
    fn tokens_are_found_by_their_text_and_go_with_their_user() {
        let mut table = UserTable::new();
        table.apply(&add("ci", false)).expect("added");
        let token = crate::ApiToken::generate().expect("token");
        let add_token = UserChange::TokenAdd {
            name: "ci".into(),
            token: "deploy".into(),
            digest: token.digest(),
        };
        table.apply(&add_token).expect("token added");
        assert!(
            table.apply(&add_token).is_err(),
            "a second token of that name"
        );
        assert_eq!(
            table.user_of_token(token.reveal()).map(|u| u.name.as_str()),
            Some("ci")
        );
        let other = crate::ApiToken::generate().expect("token");
        assert!(table.user_of_token(other.reveal()).is_none());
        assert!(table.user_of_token("not a token").is_none());
        let json = serde_json::to_string(&add_token).expect("json");
        let back: UserChange = serde_json::from_str(&json).expect("parsed");
        assert_eq!(back, add_token);
        table
            .apply(&UserChange::TokenDelete {
                name: "ci".into(),
                token: "deploy".into(),
            })
            .expect("deleted");
        assert!(table.user_of_token(token.reveal()).is_none());
        for i in 0..MAX_TOKENS_PER_USER {
            let t = crate::ApiToken::generate().expect("token");
            table
                .apply(&UserChange::TokenAdd {
                    name: "ci".into(),
                    token: format!("t{i}"),
                    digest: t.digest(),
                })
                .expect("under the bound");
        }
        let over = UserChange::TokenAdd {
            name: "ci".into(),
            token: "one-more".into(),
            digest: other.digest(),
        };
        assert!(table.apply(&over).is_err(), "over the bound");
        table
            .apply(&UserChange::Delete { name: "ci".into() })
            .expect("deleted");
        assert!(table.user_of_token(token.reveal()).is_none());
    }
}
