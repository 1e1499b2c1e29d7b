//! `keratin attention`: what needs an operator, from the HTTP admin port's
//! `GET /api/v1/attention` (level changes, full queues, stopped and healed logs).
//!
//! Owns the selection (active items and the most recent cleared ones by default, everything
//! with `--all`, active only with `--active`) and the human rendering. The document is the
//! server's (`keratin-server` `attention.rs`); `--json` prints it as served.

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::Value;

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{print_json, Failure, Table};

const ATTENTION_PATH: &str = "/api/v1/attention";

/// Cleared items shown without `--all`: the recent history that explains the active ones.
const RECENT_CLEARED_SHOWN: usize = 10;

/// Flags of `keratin attention`: the items come from the HTTP admin port, found through
/// `--server` unless `--http` names it.
#[derive(Debug, Args)]
pub struct AttentionArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
    /// Show every item kept, cleared ones included (the server keeps at most 256).
    #[arg(long, conflicts_with = "active")]
    all: bool,
    /// Show only the active items.
    #[arg(long)]
    active: bool,
}

/// Runs `keratin attention`.
pub async fn run(args: AttentionArgs) -> Result<ExitCode, Failure> {
    let path = if args.active {
        format!("{ATTENTION_PATH}?active=true")
    } else {
        ATTENTION_PATH.to_owned()
    };
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let document = admin::request(&http, "GET", &path, None)?;
    let Some(items) = document["items"].as_array() else {
        return Err(Failure::new(format!(
            "GET http://{}{path}: the document has no \"items\" list: {document}",
            http
        )));
    };
    let shown = if args.all || args.active {
        items.iter().collect()
    } else {
        default_selection(items)
    };
    if args.common.json {
        print_json(&serde_json::json!({ "items": shown }));
    } else {
        out!("{}", attention_text(&shown, items.len(), now_ms()));
    }
    Ok(ExitCode::SUCCESS)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn active(item: &Value) -> bool {
    item["active"].as_bool().unwrap_or(false)
}

/// Every active item and the [`RECENT_CLEARED_SHOWN`] most recent cleared ones, oldest first.
fn default_selection(items: &[Value]) -> Vec<&Value> {
    let cleared = items.iter().filter(|item| !active(item)).count();
    let skip = cleared.saturating_sub(RECENT_CLEARED_SHOWN);
    let mut cleared_seen = 0;
    items
        .iter()
        .filter(|item| {
            if active(item) {
                return true;
            }
            cleared_seen += 1;
            cleared_seen > skip
        })
        .collect()
}

/// `42s ago`, `5m ago`, `3h ago`, `2d ago`.
fn age(at_ms: u64, now_ms: u64) -> String {
    let seconds = now_ms.saturating_sub(at_ms) / 1000;
    match seconds {
        0..60 => format!("{seconds}s ago"),
        60..3600 => format!("{}m ago", seconds / 60),
        3600..86_400 => format!("{}h ago", seconds / 3600),
        _ => format!("{}d ago", seconds / 86_400),
    }
}

fn text<'a>(item: &'a Value, field: &str) -> &'a str {
    item[field].as_str().unwrap_or("?")
}

/// The human rendering: a table of the items, then each item's message by id.
fn attention_text(shown: &[&Value], total: usize, now_ms: u64) -> String {
    let active_count = shown.iter().filter(|item| active(item)).count();
    if shown.is_empty() {
        return "nothing needs attention\n".to_owned();
    }
    let mut table = Table::new(&[
        "ID", "STATE", "SEVERITY", "KIND", "SUBJECT", "RAISED", "CLEARED",
    ]);
    for item in shown {
        table.row(vec![
            item["id"].to_string(),
            if active(item) { "active" } else { "cleared" }.to_owned(),
            text(item, "severity").to_owned(),
            text(item, "kind").to_owned(),
            text(item, "subject").to_owned(),
            item["raised_at_ms"]
                .as_u64()
                .map_or_else(|| "?".to_owned(), |at| age(at, now_ms)),
            item["cleared_at_ms"]
                .as_u64()
                .map_or_else(|| "-".to_owned(), |at| age(at, now_ms)),
        ]);
    }
    let mut out = format!(
        "{active_count} active, {} shown of {total} kept\n\n",
        shown.len()
    );
    out.push_str(&table.render());
    out.push('\n');
    for item in shown {
        out.push_str(&format!("#{}  {}\n", item["id"], text(item, "message")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn item(id: u64, active: bool) -> Value {
        json!({
            "id": id, "kind": "disk_level", "subject": "/data", "severity": "warning",
            "level": "soft", "message": format!("message {id}"),
            "raised_at_ms": 1_000_000, "cleared_at_ms": if active { None } else { Some(1_090_000) },
            "active": active,
        })
    }

    #[test]
    fn default_shows_active_and_the_recent_cleared() {
        let mut items: Vec<Value> = (1..=30).map(|id| item(id, false)).collect();
        items[2] = item(3, true);
        items[29] = item(30, true);
        let ids: Vec<u64> = default_selection(&items)
            .iter()
            .map(|i| i["id"].as_u64().unwrap())
            .collect();
        assert_eq!(ids, vec![3, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]);
    }

    #[test]
    fn human_output_names_state_age_and_message() {
        let items = [item(1, false), item(2, true)];
        let shown: Vec<&Value> = items.iter().collect();
        let text = attention_text(&shown, 5, 1_000_000 + 3_600_000 * 2 + 5);
        assert!(text.starts_with("1 active, 2 shown of 5 kept"), "{text}");
        assert!(text.contains("SEVERITY"), "{text}");
        assert!(
            text.contains("active") && text.contains("cleared"),
            "{text}"
        );
        assert!(text.contains("2h ago") && text.contains("1h ago"), "{text}");
        assert!(text.contains("#2  message 2"), "{text}");
        assert_eq!(attention_text(&[], 0, 0), "nothing needs attention\n");
    }
}
