//! `keratin settings get|set|reset`: the node's runtime settings through the HTTP admin port
//! (`GET/PUT /api/v1/settings`). A set is checked whole by the node: when one value is refused,
//! nothing changes and the node's reason is printed. `reset` removes runtime overrides, going back
//! to the configured values. In a cluster, `set` and `reset` change the cluster-wide values
//! (every node applies them, and they survive restarts of every node); `--node` changes only
//! the node at `--server` (its own value wins over the cluster's). The settings document is
//! the server's (`keratin-server` `settings.rs`); `--json` prints it unchanged.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{Map, Value};

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{print_json, Failure, Table};
use crate::units::{parse_duration_ms, parse_size};

const SETTINGS_PATH: &str = "/api/v1/settings";

/// `keratin settings ...`.
#[derive(Debug, Args)]
pub struct SettingsArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR", global = true)]
    http: Option<String>,
    #[command(subcommand)]
    verb: SettingsVerb,
}

#[derive(Debug, Subcommand)]
enum SettingsVerb {
    /// The settings in force, with where each value came from. Without keys: every runtime
    /// setting (with --all: startup settings too).
    Get {
        /// Dotted keys to show, e.g. limits.disk.soft_fraction.
        keys: Vec<String>,
        /// Also show the settings that change only with a restart.
        #[arg(long)]
        all: bool,
    },
    /// Change runtime settings live, all or nothing: KEY=VALUE..., e.g.
    /// limits.disk.soft_fraction=0.2 limits.sample_interval_ms=500. Stored in the metadata
    /// (the cluster's in a cluster: every node takes them), so they survive restarts.
    Set {
        /// KEY=VALUE pairs; VALUE is a number (or `null` to remove the value). A key ending in
        /// `_bytes` also takes a size (512MiB, 10GiB), one ending in `_ms` a duration (500ms,
        /// 2s, 5m), as the flags do.
        #[arg(required = true, value_name = "KEY=VALUE")]
        pairs: Vec<String>,
        /// In a cluster: change only this node's own values, which win over the cluster's.
        #[arg(long)]
        node: bool,
    },
    /// Remove runtime values: the keys go back to the cluster-wide value (with --node) or to
    /// each node's configured value.
    Reset {
        /// Dotted keys.
        #[arg(required = true, value_name = "KEY")]
        keys: Vec<String>,
        /// In a cluster: remove only this node's own values.
        #[arg(long)]
        node: bool,
    },
}

/// Runs `keratin settings`.
pub async fn run(args: SettingsArgs) -> Result<ExitCode, Failure> {
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let (document, shown) = match args.verb {
        SettingsVerb::Get { keys, all } => {
            let document = admin::request(&http, "GET", SETTINGS_PATH, None)?;
            for key in &keys {
                if find(&document, key).is_none() {
                    return Err(Failure::new(format!(
                        "no setting {key:?}; `keratin settings get --all` lists every key"
                    )));
                }
            }
            (document, Shown { keys, all })
        }
        SettingsVerb::Set { pairs, node } => {
            let changes = parse_pairs(&pairs)?;
            let keys = changes.keys().cloned().collect();
            let document =
                admin::request(&http, "PUT", put_path(node), Some(&Value::Object(changes)))?;
            (document, Shown { keys, all: false })
        }
        SettingsVerb::Reset { keys, node } => {
            let changes: Map<String, Value> =
                keys.iter().map(|k| (k.clone(), Value::Null)).collect();
            let document =
                admin::request(&http, "PUT", put_path(node), Some(&Value::Object(changes)))?;
            (document, Shown { keys, all: false })
        }
    };
    if args.common.json {
        print_json(&document);
    } else {
        out!("{}", settings_text(&document, &shown));
    }
    Ok(ExitCode::SUCCESS)
}

/// Where a change goes: the node's own values (`--node`), else the default scope (the
/// cluster's in a cluster, the node's alone).
fn put_path(node: bool) -> &'static str {
    if node {
        "/api/v1/settings?scope=node"
    } else {
        SETTINGS_PATH
    }
}

/// Which entries to print: the named keys, else every live one (and the others with `all`).
struct Shown {
    keys: Vec<String>,
    all: bool,
}

fn find<'a>(document: &'a Value, key: &str) -> Option<&'a Value> {
    document["settings"]
        .as_array()?
        .iter()
        .find(|entry| entry["key"] == key)
}

/// `KEY=VALUE` pairs as a JSON object. Values are JSON (`0.2`, `1000`, `null`); anything else is
/// sent as a string, which the node refuses with the key's expected form.
fn parse_pairs(pairs: &[String]) -> Result<Map<String, Value>, Failure> {
    let mut changes = Map::new();
    for pair in pairs {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(Failure::new(format!(
                "{pair:?} is not KEY=VALUE, e.g. limits.disk.soft_fraction=0.2"
            )));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(Failure::new(format!("{pair:?} has no key before '='")));
        }
        let value = value.trim();
        let parsed = match serde_json::from_str(value) {
            Ok(parsed) => parsed,
            // A size or a duration spelt as the flags spell them (`--max-bytes 512MiB`): the
            // key's unit says which (names end in their unit).
            Err(_) if key.ends_with("_bytes") => {
                Value::from(parse_size(value).map_err(|e| Failure::new(format!("{key}: {e}")))?)
            }
            Err(_) if key.ends_with("_ms") => Value::from(
                parse_duration_ms(value).map_err(|e| Failure::new(format!("{key}: {e}")))?,
            ),
            Err(_) => Value::String(value.to_owned()),
        };
        if changes.insert(key.to_owned(), parsed).is_some() {
            return Err(Failure::new(format!("{key} is given twice")));
        }
    }
    Ok(changes)
}

fn value_text(value: &Value) -> String {
    match value {
        Value::Null => "(unset)".to_owned(),
        other => other.to_string(),
    }
}

/// A table of KEY, VALUE, ORIGIN (and the configured value under a runtime override).
fn settings_text(document: &Value, shown: &Shown) -> String {
    let mut table = Table::new(&["KEY", "VALUE", "ORIGIN", "CHANGE"]);
    let entries = document["settings"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    for entry in entries {
        let key = entry["key"].as_str().unwrap_or("?");
        let live = entry["live"].as_bool().unwrap_or(false);
        let wanted = if shown.keys.is_empty() {
            live || shown.all
        } else {
            shown.keys.iter().any(|k| k == key)
        };
        if !wanted {
            continue;
        }
        let mut origin = entry["origin"].as_str().unwrap_or("?").to_owned();
        if let Some(cluster) = entry.get("cluster_value") {
            origin = format!("{origin} over cluster {}", value_text(cluster));
        }
        if let Some(configured) = entry.get("configured_value") {
            origin = format!(
                "{origin} (configured {} from {})",
                value_text(configured),
                entry["configured_origin"].as_str().unwrap_or("?")
            );
        }
        table.row(vec![
            key.to_owned(),
            value_text(&entry["value"]),
            origin,
            if live { "live" } else { "restart" }.to_owned(),
        ]);
    }
    table.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pairs_parse_as_json_values() {
        let pairs = [
            "limits.disk.soft_fraction=0.2".to_owned(),
            "limits.sample_interval_ms = 500".to_owned(),
            "storage.spare_budget_bytes=null".to_owned(),
            "limits.max_delay_ms=2s".to_owned(),
            "storage.max_bytes=10GiB".to_owned(),
            "limits.disk.level=abc".to_owned(),
        ];
        let changes = parse_pairs(&pairs).expect("parsed");
        assert_eq!(changes["limits.disk.soft_fraction"], json!(0.2));
        assert_eq!(changes["limits.sample_interval_ms"], json!(500));
        assert_eq!(changes["storage.spare_budget_bytes"], Value::Null);
        assert_eq!(changes["limits.max_delay_ms"], json!(2000));
        assert_eq!(changes["storage.max_bytes"], json!(10u64 << 30));
        assert_eq!(changes["limits.disk.level"], json!("abc"));
        let refused = parse_pairs(&["storage.max_bytes=10 gigs".to_owned()]).expect_err("refused");
        assert!(
            refused.message.contains("storage.max_bytes") && refused.message.contains("512MiB"),
            "{}",
            refused.message
        );
        assert!(parse_pairs(&["limits.max_delay_ms=soon".to_owned()]).is_err());
        assert!(parse_pairs(&["nokey".to_owned()]).is_err());
        assert!(parse_pairs(&["=1".to_owned()]).is_err());
        assert!(parse_pairs(&["a=1".to_owned(), "a=2".to_owned()]).is_err());
    }

    #[test]
    fn the_table_shows_live_keys_and_overrides() {
        let document = json!({"settings": [
            {"key": "limits.disk.soft_fraction", "value": 0.2, "origin": "runtime", "live": true,
             "configured_value": 0.1, "configured_origin": "default"},
            {"key": "storage.dirs", "value": ["/d"], "origin": "flag --data-dir", "live": false},
        ]});
        let live = settings_text(
            &document,
            &Shown {
                keys: vec![],
                all: false,
            },
        );
        assert!(
            live.contains("runtime (configured 0.1 from default)"),
            "{live}"
        );
        assert!(!live.contains("storage.dirs"), "{live}");
        let all = settings_text(
            &document,
            &Shown {
                keys: vec![],
                all: true,
            },
        );
        assert!(all.contains("storage.dirs"), "{all}");
        assert!(all.contains("restart"), "{all}");
    }
}
