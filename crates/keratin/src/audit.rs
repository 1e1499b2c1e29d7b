//! `keratin audit`: the node's audit trail from the HTTP admin port's `GET /api/v1/audit`
//! (admins only): who declared, deleted, purged, changed settings, users or the cluster, and
//! refused logins, newest first.
//!
//! Owns the query (`--limit`) and the human rendering; the records are the server's
//! (`keratin-server` `audit.rs`). `--json` prints the document as served.

use std::process::ExitCode;

use clap::Args;
use serde_json::Value;

use crate::admin;
use crate::connect::CommonArgs;
use crate::output::{print_json, Failure, Table};

const AUDIT_PATH: &str = "/api/v1/audit";

/// Flags of `keratin audit`: the records come from the HTTP admin port, found through
/// `--server` unless `--http` names it.
#[derive(Debug, Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The HTTP admin address (default: the one the node at --server names).
    #[arg(long, env = "KERATIN_HTTP", value_name = "ADDR")]
    http: Option<String>,
    /// How many records, newest first (the node keeps the last 1,000 in memory).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1000))]
    limit: u64,
}

/// Runs `keratin audit`.
pub async fn run(args: AuditArgs) -> Result<ExitCode, Failure> {
    let path = format!("{AUDIT_PATH}?limit={}", args.limit);
    let http = admin::address(&args.common, args.http.as_deref()).await?;
    let document = admin::request(&http, "GET", &path, None)?;
    let Some(entries) = document["entries"].as_array() else {
        return Err(Failure::new(format!(
            "GET http://{http}{path}: the document has no \"entries\" list: {document}"
        )));
    };
    if args.common.json {
        print_json(&document);
    } else {
        out!("{}", audit_text(entries, document["dropped"].as_u64()));
    }
    Ok(ExitCode::SUCCESS)
}

fn text(entry: &Value, field: &str) -> String {
    entry[field].as_str().unwrap_or("-").to_owned()
}

/// The human rendering: one row per record, as served (newest first).
fn audit_text(entries: &[Value], dropped: Option<u64>) -> String {
    if entries.is_empty() {
        return "no audit records\n".to_owned();
    }
    let mut table = Table::new(&["TIME", "USER", "FROM", "ACTION", "TARGET", "OUTCOME"]);
    for entry in entries {
        table.row(vec![
            entry["time_ms"]
                .as_u64()
                .map_or_else(|| "?".to_owned(), utc),
            text(entry, "user"),
            text(entry, "from"),
            text(entry, "action"),
            text(entry, "target"),
            text(entry, "outcome"),
        ]);
    }
    let mut out = table.render();
    if let Some(dropped @ 1..) = dropped {
        out.push_str(&format!(
            "\n{dropped} records could not be written to the node's audit file (in memory only)\n"
        ));
    }
    out
}

/// `2026-12-03 16:53:44Z` (UTC) from milliseconds since the epoch.
fn utc(time_ms: u64) -> String {
    let seconds = time_ms / 1000;
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (never negative here).
    let z = days as i64 + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn utc_renders_the_calendar() {
        assert_eq!(utc(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc(1_796_316_824_000), "2026-12-03 16:53:44Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00Z");
    }

    #[test]
    fn human_output_is_a_table_newest_first() {
        let entries = [
            json!({ "time_ms": 2_000, "user": "admin", "from": "127.0.0.1:5", "via": "http",
                    "action": "user.add", "target": "app", "detail": null, "outcome": "ok" }),
            json!({ "time_ms": 1_000, "user": null, "from": null, "via": "protocol",
                    "action": "login.refused", "target": null, "detail": {"folded": 0},
                    "outcome": "refused: bad password" }),
        ];
        let text = audit_text(&entries, Some(3));
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("TIME"), "{text}");
        assert!(
            lines[1].contains("user.add") && lines[1].contains("admin"),
            "{text}"
        );
        assert!(lines[2].contains("refused: bad password"), "{text}");
        assert!(text.contains("3 records could not be written"), "{text}");
        assert_eq!(audit_text(&[], None), "no audit records\n");
    }
}
