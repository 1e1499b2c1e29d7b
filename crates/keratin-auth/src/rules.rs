//! Permissions: what a user may do to the queues whose names match a pattern. Deny by default:
//! a user may do only what a rule grants, or everything when an admin.
//!
//! - `publish`: publish to the queue.
//! - `consume`: consume from it (and settle what it delivered: ack, nack, reject).
//! - `manage`: declare, delete, purge it and change its settings.
//! - `admin` (a user flag, not a rule): every permission on every queue, and the node and
//!   cluster operations (settings, users, membership, moves, heal).
//!
//! A pattern is a queue name in which `*` stands for any run of characters (none included):
//! `orders`, `orders.*`, `*.dlq`, `*`.

use crate::error::{AuthError, AuthResult};

/// The most rules one user may hold.
pub const MAX_RULES: usize = 256;

/// What a user may do to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Permission {
    /// Publish to it.
    Publish,
    /// Consume from it, and settle what it delivered.
    Consume,
    /// Declare, delete, purge it, change its settings.
    Manage,
}

impl Permission {
    /// Every permission, in order.
    pub const ALL: [Permission; 3] = [Permission::Publish, Permission::Consume, Permission::Manage];

    /// Its name: `publish`, `consume` or `manage`.
    pub fn name(self) -> &'static str {
        match self {
            Permission::Publish => "publish",
            Permission::Consume => "consume",
            Permission::Manage => "manage",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of permissions. Written as a comma-separated list (`publish,consume`), `all`, or
/// `none` when empty.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Permissions(u8);

impl Permissions {
    /// No permission.
    pub const NONE: Permissions = Permissions(0);
    /// Every permission.
    pub const ALL: Permissions = Permissions(0b111);

    /// True if `permission` is in the set.
    pub fn contains(self, permission: Permission) -> bool {
        self.0 & permission.bit() != 0
    }

    /// True if the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The set with `other`'s permissions added.
    pub fn union(self, other: Permissions) -> Permissions {
        Permissions(self.0 | other.0)
    }

    /// The set without `other`'s permissions.
    pub fn without(self, other: Permissions) -> Permissions {
        Permissions(self.0 & !other.0)
    }

    /// The permissions in the set, in order.
    pub fn iter(self) -> impl Iterator<Item = Permission> {
        Permission::ALL
            .into_iter()
            .filter(move |p| self.contains(*p))
    }

    /// Parse `publish,consume`, `all` or `none` (spaces around names allowed).
    pub fn parse(text: &str) -> AuthResult<Permissions> {
        let text = text.trim();
        match text {
            "all" => return Ok(Permissions::ALL),
            "none" => return Ok(Permissions::NONE),
            _ => {}
        }
        let mut set = Permissions::NONE;
        for name in text.split(',') {
            let permission = match name.trim() {
                "publish" => Permission::Publish,
                "consume" => Permission::Consume,
                "manage" => Permission::Manage,
                other => {
                    return Err(AuthError::Invalid(format!(
                        "unknown permission {other:?}: expected publish, consume, manage (comma-separated), all or none"
                    )))
                }
            };
            set = set.union(Permissions::from(permission));
        }
        Ok(set)
    }
}

impl From<Permission> for Permissions {
    fn from(permission: Permission) -> Permissions {
        Permissions(permission.bit())
    }
}

impl std::fmt::Display for Permissions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.iter().map(Permission::name).collect();
        f.write_str(&names.join(","))
    }
}

impl std::fmt::Debug for Permissions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permissions({self})")
    }
}

impl serde::Serialize for Permissions {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter().map(Permission::name))
    }
}

impl<'de> serde::Deserialize<'de> for Permissions {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let names: Vec<String> = serde::Deserialize::deserialize(deserializer)?;
        if names.is_empty() {
            return Ok(Permissions::NONE);
        }
        Permissions::parse(&names.join(",")).map_err(serde::de::Error::custom)
    }
}

/// A queue name pattern: 1 to 255 letters, digits, `.`, `_`, `-` or `*` (any run).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Pattern(String);

impl Pattern {
    /// A checked pattern.
    pub fn new(text: &str) -> AuthResult<Pattern> {
        let ok = !text.is_empty()
            && text.len() <= 255
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'*'));
        if ok {
            Ok(Pattern(text.to_owned()))
        } else {
            Err(AuthError::Invalid(format!(
                "queue pattern {text:?}: expected 1 to 255 letters, digits, '.', '_', '-', or '*' for any run of them"
            )))
        }
    }

    /// True if `queue` matches: `*` stands for any run of characters, everything else for
    /// itself. Linear in the lengths (the greedy glob match with one backtrack point).
    pub fn matches(&self, queue: &str) -> bool {
        let (p, q) = (self.0.as_bytes(), queue.as_bytes());
        let (mut pi, mut qi) = (0, 0);
        // The last star seen, and where the text stood when it was.
        let mut star: Option<(usize, usize)> = None;
        while qi < q.len() {
            if pi < p.len() && p[pi] == b'*' {
                star = Some((pi, qi));
                pi += 1;
            } else if pi < p.len() && p[pi] == q[qi] {
                pi += 1;
                qi += 1;
            } else if let Some((star_at, text_at)) = star {
                // The star takes one more character.
                pi = star_at + 1;
                qi = text_at + 1;
                star = Some((star_at, text_at + 1));
            } else {
                return false;
            }
        }
        p[pi..].iter().all(|&b| b == b'*')
    }

    /// The pattern's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Pattern {
    type Error = AuthError;

    fn try_from(text: String) -> AuthResult<Pattern> {
        Pattern::new(&text)
    }
}

impl From<Pattern> for String {
    fn from(pattern: Pattern) -> String {
        pattern.0
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Permissions on the queues a pattern matches.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rule {
    /// The queues.
    pub pattern: Pattern,
    /// What may be done to them.
    pub permissions: Permissions,
}

/// What one user may do: an admin flag and rules. Deny by default.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Grants {
    /// Every permission on every queue, and the node and cluster operations.
    #[serde(default)]
    pub admin: bool,
    /// The rules, one per pattern.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

impl Grants {
    /// True if `permission` on `queue` is granted.
    pub fn allows(&self, queue: &str, permission: Permission) -> bool {
        self.admin
            || self
                .rules
                .iter()
                .any(|rule| rule.permissions.contains(permission) && rule.pattern.matches(queue))
    }

    /// Add `permissions` on `pattern` (to its rule if it has one).
    pub fn grant(&mut self, pattern: Pattern, permissions: Permissions) -> AuthResult<()> {
        if permissions.is_empty() {
            return Err(AuthError::Invalid("grant names no permission".into()));
        }
        if let Some(rule) = self.rules.iter_mut().find(|r| r.pattern == pattern) {
            rule.permissions = rule.permissions.union(permissions);
            return Ok(());
        }
        if self.rules.len() >= MAX_RULES {
            return Err(AuthError::Invalid(format!(
                "a user holds at most {MAX_RULES} rules: revoke some, or use a wider pattern"
            )));
        }
        self.rules.push(Rule {
            pattern,
            permissions,
        });
        Ok(())
    }

    /// Take `permissions` from `pattern`'s rule (the rule goes once empty). Revoking from a
    /// pattern with no rule is an error: the user's rules name the patterns to revoke from.
    pub fn revoke(&mut self, pattern: &Pattern, permissions: Permissions) -> AuthResult<()> {
        let Some(at) = self.rules.iter().position(|r| &r.pattern == pattern) else {
            return Err(AuthError::Invalid(format!(
                "no rule on pattern {pattern}: revoke from a pattern the user's rules name (`keratin user list`)"
            )));
        };
        let left = self.rules[at].permissions.without(permissions);
        if left.is_empty() {
            self.rules.remove(at);
        } else {
            self.rules[at].permissions = left;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(text: &str) -> Pattern {
        Pattern::new(text).expect("pattern")
    }

    #[test]
    fn patterns_match_names_with_stars_for_runs() {
        let cases = [
            ("orders", "orders", true),
            ("orders", "orders2", false),
            ("orders.*", "orders.eu", true),
            ("orders.*", "orders.", true),
            ("orders.*", "orders", false),
            ("*.dlq", "a.b.dlq", true),
            ("*.dlq", "a.dlq.x", false),
            ("*", "anything", true),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXcYYb", false),
            ("**", "x", true),
            ("a*a", "a", false),
        ];
        for (p, name, expected) in cases {
            assert_eq!(pattern(p).matches(name), expected, "{p} against {name}");
        }
    }

    #[test]
    fn bad_patterns_and_permissions_are_refused() {
        assert!(Pattern::new("").is_err());
        assert!(Pattern::new("a b").is_err());
        assert!(Pattern::new("a/b").is_err());
        assert!(Pattern::new(&"a".repeat(256)).is_err());
        assert!(Permissions::parse("publish,read").is_err());
        assert!(Permissions::parse("").is_err());
        assert_eq!(
            Permissions::parse(" publish , manage")
                .expect("parsed")
                .to_string(),
            "publish,manage"
        );
        assert_eq!(Permissions::parse("all").expect("all"), Permissions::ALL);
    }

    #[test]
    fn deny_by_default_grant_and_revoke() {
        let mut grants = Grants::default();
        assert!(!grants.allows("orders", Permission::Publish));
        grants
            .grant(
                pattern("orders.*"),
                Permissions::parse("publish").expect("p"),
            )
            .expect("granted");
        grants
            .grant(
                pattern("orders.*"),
                Permissions::parse("consume").expect("p"),
            )
            .expect("granted");
        assert_eq!(grants.rules.len(), 1, "one rule per pattern");
        assert!(grants.allows("orders.eu", Permission::Publish));
        assert!(grants.allows("orders.eu", Permission::Consume));
        assert!(!grants.allows("orders.eu", Permission::Manage));
        assert!(!grants.allows("billing", Permission::Publish));
        grants
            .revoke(
                &pattern("orders.*"),
                Permissions::parse("publish").expect("p"),
            )
            .expect("revoked");
        assert!(!grants.allows("orders.eu", Permission::Publish));
        assert!(grants.allows("orders.eu", Permission::Consume));
        grants
            .revoke(&pattern("orders.*"), Permissions::ALL)
            .expect("revoked");
        assert!(grants.rules.is_empty(), "an emptied rule goes");
        assert!(grants
            .revoke(&pattern("orders.*"), Permissions::ALL)
            .is_err());
        let admin = Grants {
            admin: true,
            rules: Vec::new(),
        };
        assert!(admin.allows("anything", Permission::Manage));
    }

    #[test]
    fn grants_round_trip_through_json() {
        let mut grants = Grants::default();
        grants
            .grant(
                pattern("a.*"),
                Permissions::parse("publish,manage").expect("p"),
            )
            .expect("granted");
        let json = serde_json::to_string(&grants).expect("json");
        assert_eq!(
            json,
            r#"{"admin":false,"rules":[{"pattern":"a.*","permissions":["publish","manage"]}]}"#
        );
        let back: Grants = serde_json::from_str(&json).expect("parsed");
        assert_eq!(back, grants);
        assert!(serde_json::from_str::<Grants>(
            r#"{"rules":[{"pattern":"a b","permissions":[]}]}"#
        )
        .is_err());
    }

    /// The glob match agrees with a plain recursive definition.
    fn reference(p: &[u8], q: &[u8]) -> bool {
        match p.split_first() {
            None => q.is_empty(),
            Some((b'*', rest)) => (0..=q.len()).any(|i| reference(rest, &q[i..])),
            Some((c, rest)) => q.first() == Some(c) && reference(rest, &q[1..]),
        }
    }

    proptest! {
        #[test]
        fn the_glob_agrees_with_its_definition(p in "[ab*]{1,8}", q in "[ab]{0,10}") {
            prop_assert_eq!(pattern(&p).matches(&q), reference(p.as_bytes(), q.as_bytes()));
        }
    }
}
