//! Runtime settings: the keys of the configuration that change without a restart (every
//! `limits.*` key but `limits.memory.limit_bytes`, plus `storage.max_bytes`,
//! `storage.spare_budget_bytes` and, on a cluster node, `cluster.leader_balance`), read and
//! changed through `GET/PUT /api/v1/settings` and `keratin settings`.
//!
//! A change is stored as an *override* in the node metadata log (so it survives restarts and can
//! later replicate with the rest of the metadata) and sits above the four configuration sources:
//! the value in force is the override if there is one, else the configured value. Removing an
//! override (a `null` value) goes back to the configured value. This is how Kafka's dynamic
//! broker configs relate to `server.properties`.
//!
//! In a cluster the same keys also have *cluster-wide* values: stored in the cluster's
//! metadata group (so every node, and every restart, sees the same), applied by every node
//! under its own overrides. The value in force on a node is its own override, else the
//! cluster-wide value, else the configured value. `keratin settings set` changes the
//! cluster-wide value in a cluster (`--node` changes only the node's override), the node's
//! override on a node that runs alone.
//!
//! A change is checked whole before anything happens: every key must be a runtime key, every
//! value must have the key's type, and the resulting configuration must pass the same checks as
//! a configuration file. A refused change stores and applies nothing. An accepted one is synced
//! in the metadata log first, then applied: the limits take the new thresholds and the sampler
//! is woken, so levels move within one sampling interval.

use std::collections::BTreeMap;

use keratin_broker::Broker;
use keratin_limits::LimitsError;
use serde_json::{json, Map, Value};
use tokio::sync::{watch, Mutex};

use keratin_cluster::ClusterNode;

use crate::config::{startup_fields, Config, Origin};
use crate::limits::NodeLimits;

/// The origin shown for a value that a runtime override of this node set.
pub const RUNTIME_ORIGIN: &str = "runtime";

/// The origin shown for a value that a cluster-wide runtime setting set.
pub const CLUSTER_ORIGIN: &str = "cluster";

/// The runtime key that turns automatic leader balancing on and off (`docs/cluster.md`,
/// "Leader balancing"); only on a cluster node.
pub const LEADER_BALANCE_KEY: &str = "cluster.leader_balance";

/// Why a settings change was refused or could not be applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The request is not an object of dotted keys to values.
    #[error("{0}")]
    BadRequest(String),
    /// A key that no configuration has.
    #[error("unknown setting {key:?}; runtime settings are: {known}")]
    UnknownKey {
        /// The key as given.
        key: String,
        /// The runtime keys, comma-separated.
        known: String,
    },
    /// A startup key: it changes only with a restart.
    #[error(
        "{key} takes effect only at startup; set it in the configuration file, its KERATIN_ \
         environment variable or its flag, and restart the node"
    )]
    StartupKey {
        /// The key.
        key: String,
    },
    /// A value of the wrong type or out of range; nothing was changed.
    #[error("invalid setting {key} = {value}: expected {expected}; nothing was changed")]
    Invalid {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What the key accepts.
        expected: String,
    },
    /// The metadata log could not store the change; nothing was applied.
    #[error("the change could not be stored in the node metadata, so nothing was changed: {0}")]
    Store(String),
    /// A resource limit refused the change (the disk holding the metadata is full); nothing
    /// was applied, and a retry after the hint may succeed.
    #[error("nothing was changed: {message}")]
    Limited {
        /// `disk` or `memory`.
        reason: String,
        /// When a retry may succeed.
        retry_after_ms: u32,
        /// What happened and what to do.
        message: String,
    },
    /// The cluster's metadata group did not take a cluster-wide change.
    #[error(
        "the cluster's metadata group did not take the change, so nothing was changed: {0}; \
         try again once the cluster has a leader (`keratin cluster status`)"
    )]
    Cluster(String),
    /// A cluster-wide change asked of a node that runs alone.
    #[error(
        "this node runs alone, so there are no cluster-wide settings; change its own settings \
         (without scope=cluster)"
    )]
    NotACluster,
    /// Stored, but applying part of it failed (it is retried at the next start).
    #[error("the change is stored but applying it failed: {0}")]
    Apply(String),
}

impl SettingsError {
    /// A failure to store a change: a limit's refusal as [`SettingsError::Limited`].
    fn stored(error: keratin_broker::BrokerError) -> SettingsError {
        match error {
            keratin_broker::BrokerError::Limited {
                reason,
                retry_after_ms,
                message,
            } => SettingsError::Limited {
                reason,
                retry_after_ms,
                message,
            },
            other => SettingsError::Store(other.to_string()),
        }
    }

    /// The retry hint of a refusal by a limit.
    pub fn retry_after_ms(&self) -> Option<u32> {
        match self {
            SettingsError::Limited { retry_after_ms, .. } => Some(*retry_after_ms),
            _ => None,
        }
    }

    /// The HTTP status this error is answered with.
    pub fn http_status(&self) -> u16 {
        match self {
            SettingsError::BadRequest(_)
            | SettingsError::UnknownKey { .. }
            | SettingsError::StartupKey { .. }
            | SettingsError::Invalid { .. }
            | SettingsError::NotACluster => 400,
            SettingsError::Store(_) | SettingsError::Cluster(_) => 503,
            SettingsError::Limited { .. } => 429,
            SettingsError::Apply(_) => 500,
        }
    }
}

/// What the runtime settings resolve to: the values the node applies.
#[derive(Debug, Clone, PartialEq)]
pub struct Effective {
    /// The whole configuration with the overrides applied.
    pub config: Config,
}

/// The node's settings: the configuration it started with, where each value came from, and
/// the overrides in force.
#[derive(Debug)]
pub struct NodeSettings {
    /// The configuration as the four sources gave it.
    configured: Config,
    /// The configured value of every leaf key, dotted.
    configured_values: BTreeMap<String, Value>,
    /// Where each configured value came from (keys no source set are defaults).
    origins: BTreeMap<String, Origin>,
    /// The overrides in force. The lock also serializes changes: each is stored and applied
    /// before the next one is checked.
    overrides: Mutex<Layers>,
    /// `cluster.leader_balance` in force, for the cluster layer's balancer.
    leader_balance: watch::Sender<bool>,
}

/// The two layers of runtime values above the configuration.
#[derive(Debug, Default)]
struct Layers {
    /// This node's own overrides (the node metadata log).
    node: BTreeMap<String, Value>,
    /// The cluster-wide values (the cluster's metadata group); empty on a node alone.
    cluster: BTreeMap<String, Value>,
}

impl Layers {
    /// Every value in force above the configuration: the node's over the cluster's.
    fn merged(
        cluster: &BTreeMap<String, Value>,
        node: &BTreeMap<String, Value>,
    ) -> BTreeMap<String, Value> {
        let mut merged = cluster.clone();
        merged.extend(node.iter().map(|(k, v)| (k.clone(), v.clone())));
        merged
    }
}

/// `base` with `changes` applied (`null` removes a key), and the map to check: the same, with
/// a removed key that is not a runtime key kept as `null` so that a typo is refused.
fn changed(
    base: &BTreeMap<String, Value>,
    changes: &Map<String, Value>,
) -> (BTreeMap<String, Value>, BTreeMap<String, Value>) {
    let mut next = base.clone();
    for (key, value) in changes {
        if value.is_null() {
            next.remove(key);
        } else {
            next.insert(key.clone(), value.clone());
        }
    }
    // Exactly the runtime keys: `is_runtime_key` answers by prefix, so a typo under
    // `limits.` would pass it.
    let known: Vec<String> = runtime_keys().into_iter().map(|(key, _)| key).collect();
    let mut checked = next.clone();
    for (key, value) in changes {
        if value.is_null() && !known.contains(key) {
            checked.insert(key.clone(), Value::Null);
        }
    }
    (next, checked)
}

/// The changes of a request body: a non-empty object.
fn changes_of(changes: &Value) -> Result<&Map<String, Value>, SettingsError> {
    let Some(changes) = changes.as_object() else {
        return Err(SettingsError::BadRequest(
            "expected a JSON object of dotted keys to values, such as \
             {\"limits.disk.soft_fraction\": 0.2}; null removes a runtime override"
                .into(),
        ));
    };
    if changes.is_empty() {
        return Err(SettingsError::BadRequest(
            "no settings given; expected at least one dotted key".into(),
        ));
    }
    Ok(changes)
}

/// Whether `key` (dotted) can change at run time.
pub fn is_runtime_key(key: &str) -> bool {
    key == LEADER_BALANCE_KEY
        || (!startup_fields().contains(&key)
            && (key.starts_with("limits.") || key.starts_with("storage.")))
}

/// The runtime keys with the kind of value each takes.
fn runtime_keys() -> Vec<(String, ValueKind)> {
    let mut keys = Vec::new();
    flatten(&config_json(&Config::default()), "", &mut |key, value| {
        if is_runtime_key(key) {
            keys.push((key.to_string(), ValueKind::of(key, value)));
        }
    });
    // Optional keys are absent from the JSON of a default configuration.
    keys.push((
        "storage.spare_budget_bytes".to_string(),
        ValueKind::Unsigned,
    ));
    // The `[cluster]` section is absent from a default configuration.
    keys.push((LEADER_BALANCE_KEY.to_string(), ValueKind::Bool));
    keys.sort();
    keys.dedup();
    keys
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum ValueKind {
    Unsigned,
    Fraction,
    Bool,
}

impl ValueKind {
    fn of(key: &str, value: &Value) -> ValueKind {
        if value.is_f64() || key.ends_with("_fraction") {
            ValueKind::Fraction
        } else {
            ValueKind::Unsigned
        }
    }

    fn check(self, key: &str, value: &Value) -> Result<(), SettingsError> {
        let ok = match self {
            ValueKind::Unsigned => value.is_u64(),
            ValueKind::Fraction => value.is_number(),
            ValueKind::Bool => value.is_boolean(),
        };
        if ok {
            Ok(())
        } else {
            Err(SettingsError::Invalid {
                key: key.to_string(),
                value: value.to_string(),
                expected: match self {
                    ValueKind::Unsigned => "a whole number (JSON number without quotes)".into(),
                    ValueKind::Fraction => {
                        "a number such as 0.1 (JSON number without quotes)".into()
                    }
                    ValueKind::Bool => "true or false (without quotes)".into(),
                },
            })
        }
    }
}

fn config_json(config: &Config) -> Value {
    serde_json::to_value(config).unwrap_or(Value::Null)
}

/// Calls `f` with every leaf of `value` and its dotted key.
fn flatten(value: &Value, prefix: &str, f: &mut dyn FnMut(&str, &Value)) {
    match value {
        Value::Object(map) => {
            for (name, inner) in map {
                let key = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}.{name}")
                };
                flatten(inner, &key, f);
            }
        }
        leaf => f(prefix, leaf),
    }
}

/// Sets the dotted `key` in `root` (an object tree) to `value`.
fn set_path(root: &mut Value, key: &str, value: Value) {
    let mut node = root;
    let mut parts = key.split('.').peekable();
    while let Some(part) = parts.next() {
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
        let Value::Object(map) = node else {
            return;
        };
        if parts.peek().is_none() {
            map.insert(part.to_string(), value);
            return;
        }
        node = map
            .entry(part.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
}

impl NodeSettings {
    /// Settings over `configured`, whose values came from `origins` (keys missing there are
    /// defaults), with no overrides yet.
    pub fn new(configured: Config, origins: BTreeMap<String, Origin>) -> NodeSettings {
        let mut configured_values = BTreeMap::new();
        flatten(&config_json(&configured), "", &mut |key, value| {
            configured_values.insert(key.to_string(), value.clone());
        });
        let leader_balance = configured
            .cluster
            .as_ref()
            .is_none_or(|cluster| cluster.leader_balance);
        NodeSettings {
            configured,
            configured_values,
            origins,
            overrides: Mutex::new(Layers::default()),
            leader_balance: watch::Sender::new(leader_balance),
        }
    }

    /// The configuration with `overrides` applied, after every check. The error names the first
    /// bad key, its value and what it accepts.
    pub fn resolve(&self, overrides: &BTreeMap<String, Value>) -> Result<Effective, SettingsError> {
        let kinds: BTreeMap<String, ValueKind> = runtime_keys().into_iter().collect();
        let mut tree = config_json(&self.configured);
        for (key, value) in overrides {
            let Some(kind) = kinds.get(key) else {
                if self.configured_values.contains_key(key)
                    || startup_fields().contains(&key.as_str())
                {
                    return Err(SettingsError::StartupKey { key: key.clone() });
                }
                return Err(SettingsError::UnknownKey {
                    key: key.clone(),
                    known: kinds.keys().cloned().collect::<Vec<_>>().join(", "),
                });
            };
            kind.check(key, value)?;
            if key.starts_with("cluster.") && self.configured.cluster.is_none() {
                return Err(SettingsError::Invalid {
                    key: key.clone(),
                    value: value.to_string(),
                    expected: "a setting of cluster nodes; this node runs alone (no [cluster] \
                               section)"
                        .into(),
                });
            }
            set_path(&mut tree, key, value.clone());
        }
        let config: Config =
            serde_json::from_value(tree).map_err(|e| SettingsError::BadRequest(e.to_string()))?;
        config
            .storage
            .validate()
            .map_err(|e| SettingsError::Invalid {
                key: e.key.to_string(),
                value: e.value,
                expected: e.expected.to_string(),
            })?;
        config.limits.validate().map_err(|error| match error {
            LimitsError::InvalidSetting {
                key,
                value,
                expected,
            } => SettingsError::Invalid {
                key: key.to_string(),
                value,
                expected: expected.to_string(),
            },
            other => SettingsError::BadRequest(other.to_string()),
        })?;
        Ok(Effective { config })
    }

    /// At start: read the overrides stored in the metadata log and apply them. Overrides that
    /// no longer fit the configuration (a key this version does not know, or a combination the
    /// new configuration makes invalid) are not applied: the node starts on its configuration,
    /// says why in the log, and keeps them stored for the operator to fix or reset.
    pub async fn load(&self, broker: &Broker, limits: &NodeLimits) -> Result<(), SettingsError> {
        let stored = broker
            .node_settings()
            .await
            .map_err(|e| SettingsError::Store(e.to_string()))?;
        if stored.is_empty() {
            return Ok(());
        }
        let mut layers = self.overrides.lock().await;
        match self.resolve(&Layers::merged(&layers.cluster, &stored)) {
            Ok(effective) => {
                tracing::info!(
                    overrides = stored.len(),
                    "runtime settings from the node metadata are in force"
                );
                self.apply(&effective, broker, limits)?;
                layers.node = stored;
            }
            Err(error) => tracing::error!(
                %error,
                "the runtime settings stored in the node metadata do not fit this configuration; \
                 starting without them (see them with `keratin settings get`, fix them with \
                 `keratin settings set` or drop them with `keratin settings reset`)"
            ),
        }
        Ok(())
    }

    /// Change runtime settings: `changes` maps dotted keys to values, `null` removing a key's
    /// override. Checked whole, stored durably, then applied; returns the new document.
    pub async fn update(
        &self,
        changes: &Value,
        broker: &Broker,
        limits: &NodeLimits,
    ) -> Result<Value, SettingsError> {
        let changes = changes_of(changes)?;
        let mut layers = self.overrides.lock().await;
        let (next, checked) = changed(&layers.node, changes);
        let effective = self.resolve(&Layers::merged(&layers.cluster, &checked))?;
        broker
            .set_node_settings(next.clone())
            .await
            .map_err(SettingsError::stored)?;
        layers.node = next;
        let document = self.render(&layers);
        drop(layers);
        let changed = Value::Object(changes.clone());
        tracing::info!(changes = %changed, "runtime settings of this node changed");
        self.apply(&effective, broker, limits)?;
        Ok(document)
    }

    /// Change cluster-wide runtime settings through `cluster` (its metadata group): checked
    /// whole here (under this node's own overrides) first, then proposed, then applied here
    /// at once (the other nodes apply it as their copies of the metadata reach it, through
    /// [`NodeSettings::set_cluster`]); returns this node's new document.
    pub async fn update_cluster(
        &self,
        changes: &Value,
        cluster: &ClusterNode,
        broker: &Broker,
        limits: &NodeLimits,
    ) -> Result<Value, SettingsError> {
        let changes = changes_of(changes)?;
        let mut layers = self.overrides.lock().await;
        let (_, checked) = changed(&layers.cluster, changes);
        self.resolve(&Layers::merged(&checked, &layers.node))?;
        let applied = cluster
            .change_runtime_settings(changes.clone().into_iter().collect())
            .await
            .map_err(SettingsError::Cluster)?;
        layers.cluster = applied;
        let effective = self.resolve(&Layers::merged(&layers.cluster, &layers.node))?;
        let document = self.render(&layers);
        drop(layers);
        let changed = Value::Object(changes.clone());
        tracing::info!(changes = %changed, "cluster-wide runtime settings changed");
        self.apply(&effective, broker, limits)?;
        Ok(document)
    }

    /// The cluster-wide values as this node's copy of the metadata group says (at start and
    /// after every change): applied under this node's overrides. Values this node's
    /// configuration does not accept are not applied (the node keeps what it had and says
    /// why in its log); they stay listed in the document.
    pub async fn set_cluster(
        &self,
        values: BTreeMap<String, Value>,
        broker: &Broker,
        limits: &NodeLimits,
    ) {
        let mut layers = self.overrides.lock().await;
        if layers.cluster == values {
            return;
        }
        layers.cluster = values;
        match self.resolve(&Layers::merged(&layers.cluster, &layers.node)) {
            Ok(effective) => {
                drop(layers);
                match self.apply(&effective, broker, limits) {
                    Ok(()) => tracing::info!("cluster-wide runtime settings are in force"),
                    Err(error) => {
                        tracing::error!(%error, "applying the cluster-wide runtime settings")
                    }
                }
            }
            Err(error) => tracing::error!(
                %error,
                "the cluster-wide runtime settings do not fit this node's configuration; it \
                 keeps its settings (fix them with `keratin settings set`, or set this node's \
                 own with `keratin settings set --node`)"
            ),
        }
    }

    /// `cluster.leader_balance` as in force on this node, as it changes (`true` on a node
    /// that runs alone, where nothing reads it).
    pub fn leader_balance(&self) -> watch::Receiver<bool> {
        self.leader_balance.subscribe()
    }

    /// Apply resolved settings to the running node (see [`apply`]), and the cluster layer's
    /// switches.
    fn apply(
        &self,
        effective: &Effective,
        broker: &Broker,
        limits: &NodeLimits,
    ) -> Result<(), SettingsError> {
        if let Some(cluster) = &effective.config.cluster {
            self.leader_balance.send_if_modified(|on| {
                let changed = *on != cluster.leader_balance;
                *on = cluster.leader_balance;
                changed
            });
        }
        apply(effective, broker, limits)
    }

    /// The settings document of `GET /api/v1/settings`.
    pub async fn document(&self) -> Value {
        let layers = self.overrides.lock().await;
        self.render(&layers)
    }

    fn render(&self, layers: &Layers) -> Value {
        let mut keys: BTreeMap<String, Value> = self.configured_values.clone();
        for (key, _) in runtime_keys() {
            if key.starts_with("cluster.") && self.configured.cluster.is_none() {
                continue;
            }
            keys.entry(key).or_insert(Value::Null);
        }
        let settings: Vec<Value> = keys
            .into_iter()
            .map(|(key, configured)| {
                let configured_origin = self
                    .origins
                    .get(&key)
                    .cloned()
                    .unwrap_or(Origin::Default)
                    .to_string();
                let live = is_runtime_key(&key);
                let (node, cluster) = (layers.node.get(&key), layers.cluster.get(&key));
                let mut entry = match node.or(cluster) {
                    Some(value) => json!({
                        "key": key,
                        "value": value,
                        "origin": if node.is_some() { RUNTIME_ORIGIN } else { CLUSTER_ORIGIN },
                        "live": live,
                        "configured_value": configured,
                        "configured_origin": configured_origin,
                    }),
                    None => json!({
                        "key": key,
                        "value": configured,
                        "origin": configured_origin,
                        "live": live,
                    }),
                };
                if let (Some(_), Some(cluster)) = (node, cluster) {
                    entry["cluster_value"] = cluster.clone();
                }
                entry
            })
            .collect();
        json!({
            "settings": settings,
            "overrides": layers.node,
            "cluster_overrides": layers.cluster,
        })
    }
}

/// Apply resolved settings to the running node: thresholds, the storage budget, the spare budget.
fn apply(effective: &Effective, broker: &Broker, limits: &NodeLimits) -> Result<(), SettingsError> {
    limits.set_max_bytes(effective.config.storage.max_bytes);
    limits
        .set_settings(effective.config.limits.clone())
        .map_err(SettingsError::Apply)?;
    broker
        .pool()
        .set_budget(effective.config.storage.spare_budget_bytes)
        .map_err(|e| SettingsError::Apply(format!("spare budget: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> NodeSettings {
        NodeSettings::new(Config::default(), BTreeMap::new())
    }

    fn overrides(pairs: &[(&str, Value)]) -> BTreeMap<String, Value> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn runtime_keys_are_the_limits_and_two_storage_budgets() {
        let keys: Vec<String> = runtime_keys().into_iter().map(|(k, _)| k).collect();
        assert!(keys.contains(&"limits.disk.soft_fraction".to_string()));
        assert!(keys.contains(&"limits.sample_interval_ms".to_string()));
        assert!(keys.contains(&"storage.max_bytes".to_string()));
        assert!(keys.contains(&"storage.spare_budget_bytes".to_string()));
        assert!(!keys.contains(&"limits.memory.limit_bytes".to_string()));
        assert!(!keys.contains(&"storage.dirs".to_string()));
        assert!(!keys.contains(&"server.listen".to_string()));
    }

    #[test]
    fn an_override_sets_the_value() {
        let effective = settings()
            .resolve(&overrides(&[
                ("limits.disk.soft_fraction", json!(0.3)),
                ("storage.spare_budget_bytes", json!(1024)),
            ]))
            .expect("valid");
        assert_eq!(effective.config.limits.disk.soft_fraction, 0.3);
        assert_eq!(effective.config.storage.spare_budget_bytes, Some(1024));
    }

    #[test]
    fn refusals_name_the_key_and_what_it_takes() {
        let s = settings();
        let cases = [
            ("limits.disk.soft_fraction", json!("abc"), "a number"),
            (
                "limits.disk.soft_fraction",
                json!(1.5),
                "a fraction from 0.0 to 1.0",
            ),
            // Harder than soft: the combination is refused, not just the value's type.
            (
                "limits.disk.hard_fraction",
                json!(0.5),
                "no larger than limits.disk.soft_fraction",
            ),
            ("limits.sample_interval_ms", json!(-1), "a whole number"),
            ("limits.sample_interval_ms", json!(0), "from 1 to 60000"),
        ];
        for (key, value, expected) in cases {
            let error = s
                .resolve(&overrides(&[(key, value.clone())]))
                .expect_err("refused")
                .to_string();
            assert!(error.contains(key), "{error}");
            assert!(error.contains(expected), "{key}={value}: {error}");
        }
        let error = s
            .resolve(&overrides(&[("storage.dirs", json!(["/x"]))]))
            .expect_err("startup");
        assert!(matches!(error, SettingsError::StartupKey { .. }), "{error}");
        let error = s
            .resolve(&overrides(&[("limits.memory.limit_bytes", json!(1))]))
            .expect_err("startup");
        assert!(matches!(error, SettingsError::StartupKey { .. }), "{error}");
        let error = s
            .resolve(&overrides(&[("limits.disk.sotf_fraction", json!(0.1))]))
            .expect_err("unknown");
        assert!(
            error.to_string().contains("limits.disk.soft_fraction"),
            "{error}"
        );
    }

    #[test]
    fn the_nodes_own_value_beats_the_clusters_which_beats_the_configured_one() {
        let s = settings();
        let cluster = overrides(&[
            ("limits.disk.soft_fraction", json!(0.3)),
            ("limits.sample_interval_ms", json!(250)),
        ]);
        let node = overrides(&[("limits.disk.soft_fraction", json!(0.4))]);
        let effective = s.resolve(&Layers::merged(&cluster, &node)).expect("valid");
        assert_eq!(effective.config.limits.disk.soft_fraction, 0.4);
        assert_eq!(effective.config.limits.sample_interval_ms, 250);
        assert_eq!(
            effective.config.limits.disk.hard_fraction,
            Config::default().limits.disk.hard_fraction
        );
        let removal: Map<String, Value> = [("limits.sample_interval_ms".to_string(), Value::Null)]
            .into_iter()
            .collect();
        let (next, _) = changed(&cluster, &removal);
        assert_eq!(
            next,
            overrides(&[("limits.disk.soft_fraction", json!(0.3))])
        );
        let typo: Map<String, Value> = [("limits.sample_intervl_ms".to_string(), Value::Null)]
            .into_iter()
            .collect();
        let (_, checked) = changed(&cluster, &typo);
        assert!(
            s.resolve(&checked).is_err(),
            "removing an unknown key is refused"
        );
    }

    #[test]
    fn leader_balance_is_a_runtime_setting_of_cluster_nodes_only() {
        let alone = settings();
        let error = alone
            .resolve(&overrides(&[(LEADER_BALANCE_KEY, json!(false))]))
            .expect_err("a node alone has no leaders to balance");
        assert!(
            error.to_string().contains("this node runs alone"),
            "{error}"
        );
        let document = alone.render(&Layers::default());
        assert!(
            !document.to_string().contains(LEADER_BALANCE_KEY),
            "not listed on a node alone: {document}"
        );
        let config = Config {
            cluster: Some(keratin_net::ClusterConfig {
                node_id: 1,
                listen: None,
                peers: vec!["1=127.0.0.1:5690".parse().expect("peer")],
                name: "keratin".to_string(),
                join: false,
                leader_balance: true,
                tls: keratin_net::ClusterTlsConfig::default(),
            }),
            ..Config::default()
        };
        let node = NodeSettings::new(config, BTreeMap::new());
        assert!(
            *node.leader_balance().borrow(),
            "the configured value first"
        );
        let effective = node
            .resolve(&overrides(&[(LEADER_BALANCE_KEY, json!(false))]))
            .expect("a cluster node takes it");
        assert_eq!(
            effective.config.cluster.map(|c| c.leader_balance),
            Some(false)
        );
        let error = node
            .resolve(&overrides(&[(LEADER_BALANCE_KEY, json!("no"))]))
            .expect_err("not a boolean");
        assert!(error.to_string().contains("true or false"), "{error}");
        let error = node
            .resolve(&overrides(&[("cluster.node_id", json!(2))]))
            .expect_err("the rest of [cluster] stays a startup field");
        assert!(matches!(error, SettingsError::StartupKey { .. }), "{error}");
        let document = node.render(&Layers::default());
        let entry = document["settings"]
            .as_array()
            .expect("list")
            .iter()
            .find(|e| e["key"] == LEADER_BALANCE_KEY)
            .cloned()
            .expect("listed on a cluster node");
        assert_eq!(entry["live"], true);
        assert_eq!(entry["value"], true);
    }

    #[test]
    fn the_document_names_origins_and_overrides() {
        let mut origins = BTreeMap::new();
        origins.insert(
            "limits.disk.hard_fraction".to_string(),
            Origin::Env("KERATIN_LIMITS__DISK__HARD_FRACTION".into()),
        );
        let s = NodeSettings::new(Config::default(), origins);
        let doc = s.render(&Layers {
            node: overrides(&[("limits.disk.soft_fraction", json!(0.3))]),
            cluster: overrides(&[
                ("limits.disk.soft_fraction", json!(0.25)),
                ("limits.disk.reserve_fraction", json!(0.01)),
            ]),
        });
        let find = |key: &str| {
            doc["settings"]
                .as_array()
                .expect("list")
                .iter()
                .find(|e| e["key"] == key)
                .cloned()
                .unwrap_or_else(|| panic!("{key} missing from {doc}"))
        };
        let soft = find("limits.disk.soft_fraction");
        assert_eq!(soft["value"], json!(0.3));
        assert_eq!(soft["origin"], RUNTIME_ORIGIN);
        assert_eq!(soft["configured_value"], json!(0.1));
        assert_eq!(
            soft["cluster_value"],
            json!(0.25),
            "hidden by the node's own"
        );
        let reserve = find("limits.disk.reserve_fraction");
        assert_eq!(reserve["value"], json!(0.01));
        assert_eq!(reserve["origin"], CLUSTER_ORIGIN);
        assert_eq!(
            doc["cluster_overrides"]["limits.disk.reserve_fraction"],
            json!(0.01)
        );
        let hard = find("limits.disk.hard_fraction");
        assert_eq!(hard["origin"], "env KERATIN_LIMITS__DISK__HARD_FRACTION");
        assert_eq!(hard["live"], true);
        assert_eq!(find("storage.dirs")["live"], false);
        assert_eq!(find("storage.spare_budget_bytes")["value"], Value::Null);
    }
}
