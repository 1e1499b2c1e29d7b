//! What the CLI prints: [`Failure`] (the error a verb ends with), error keys for the JSON
//! summaries, plain-text tables, byte sizes, and the progress bar.
//!
//! Owns the formats shared by every verb; the fields of each verb's summary belong to the verb.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use keratin_client::ClientError;
use serde_json::{json, Value};

/// Why a verb failed: a message for stderr (with the broker's text when it sent one) and the
/// broker's code, if any, for the `--json` error object.
#[derive(Debug)]
pub struct Failure {
    /// What happened and, when the broker said so, what to do.
    pub message: String,
    /// The wire code (404, 429, 503, ...) when the broker sent one.
    pub code: Option<u16>,
}

impl Failure {
    /// A failure found by the CLI itself.
    pub fn new(message: impl Into<String>) -> Failure {
        Failure {
            message: message.into(),
            code: None,
        }
    }

    /// A client error while doing `context`; the client's `Display` carries the broker's text.
    pub fn client(context: impl std::fmt::Display, error: &ClientError) -> Failure {
        Failure {
            message: format!("{context}: {error}"),
            code: error.code(),
        }
    }

    /// `{"error": message, "code": code}`, printed on stdout with `--json`.
    pub fn to_json(&self) -> Value {
        json!({ "error": self.message, "code": self.code })
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::new(message)
    }
}

/// Prints one JSON object on one line of stdout.
pub fn print_json(value: &Value) {
    write_stdout(format_args!("{value}\n"));
}

/// Exit status of a CLI whose reader closed stdout: what a shell reports for a process ended by
/// SIGPIPE (128 + 13), as `cat` or `git log` piped into `head` end.
pub const CLOSED_PIPE_EXIT: i32 = 141;

/// Writes `text` to stdout. A closed pipe (`keratin stream read ... | head -3`) ends the process
/// quietly with [`CLOSED_PIPE_EXIT`], as Unix tools do: whoever read stdout has what it wanted,
/// and what was not printed was not acknowledged either (a consumer's deliveries go back to
/// ready). Any other failure to write (a full disk under a redirect) ends it with a message.
pub fn write_stdout(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    end_unless_written(stdout.write_fmt(text).and_then(|()| stdout.flush()));
}

/// Writes `bytes` to stdout as they are, as [`write_stdout`] does text.
pub fn write_stdout_bytes(bytes: &[u8]) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    end_unless_written(stdout.write_all(bytes).and_then(|()| stdout.flush()));
}

/// Ends the process after a failed write to stdout (see [`write_stdout`]).
fn end_unless_written(written: std::io::Result<()>) {
    match written {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {
            std::process::exit(CLOSED_PIPE_EXIT)
        }
        Err(error) => {
            eprintln!("keratin: cannot write to stdout: {error}");
            std::process::exit(1)
        }
    }
}

/// `print!` through [`write_stdout`] (no panic on a closed pipe).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` through [`write_stdout`] (no panic on a closed pipe).
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// The key a failed publish is counted under in `errors`: `"<code>"` or `"<code>:<reason>"`
/// (`"429:disk"`, `"503"`) when the broker sent a code (a publish that timed out while retrying
/// a 429 keeps its 429 key). Errors the client found by itself have no code and get a name:
/// `outcome_unknown` (no answer within the publish timeout, or the connection dropped after
/// sending), `connection_lost`, `timeout`, `client` (anything else).
pub fn error_key(error: &ClientError) -> String {
    if let Some(key) = error.code_key() {
        return key;
    }
    match error {
        ClientError::OutcomeUnknown { .. } => "outcome_unknown",
        ClientError::ConnectionLost { .. } | ClientError::Io { .. } => "connection_lost",
        ClientError::Timeout { .. } => "timeout",
        _ => "client",
    }
    .to_owned()
}

/// Failure counts by [`error_key`], sorted by key so the JSON is stable.
#[derive(Debug, Default)]
pub struct ErrorCounts {
    counts: BTreeMap<String, u64>,
}

impl ErrorCounts {
    /// Counts one failure under `key`.
    pub fn add(&mut self, key: String) {
        *self.counts.entry(key).or_insert(0) += 1;
    }

    /// The counts as a JSON object.
    pub fn to_json(&self) -> Value {
        json!(self.counts)
    }

    /// `429:disk=120, 503=2`, for human output.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .counts
            .iter()
            .map(|(key, count)| format!("{key}={count}"))
            .collect();
        parts.join(", ")
    }
}

/// Writes `seqs` to `path`, one decimal number per line (what `--record-seqs` promises).
pub fn write_seqs(path: &std::path::Path, seqs: &[u64]) -> Result<(), Failure> {
    let mut text = String::with_capacity(seqs.len().saturating_mul(8));
    for seq in seqs {
        text.push_str(&seq.to_string());
        text.push('\n');
    }
    std::fs::write(path, text)
        .map_err(|error| Failure::new(format!("cannot write {}: {error}", path.display())))
}

/// Messages per second over `elapsed`, to one decimal.
pub fn rate_per_s(count: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return 0.0;
    }
    // Precision loss only above 2^53 messages.
    #[expect(clippy::cast_precision_loss, reason = "a rate for display")]
    let rate = count as f64 / seconds;
    (rate * 10.0).round() / 10.0
}

/// `1 message`, `2 messages`, `0 messages`.
pub fn count_of(count: u64, noun: &str) -> String {
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
}

/// ` (N msg/s)` for text output, or nothing when no message was counted (a rate of a run that
/// moved nothing says nothing).
pub fn rate_text(count: u64, elapsed: Duration) -> String {
    if count == 0 {
        String::new()
    } else {
        format!(" ({} msg/s)", rate_per_s(count, elapsed))
    }
}

/// Milliseconds of `elapsed`, saturating.
pub fn elapsed_ms(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

/// `1.5 GiB`, `512 B`: binary units, one decimal.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut scaled = bytes;
    while scaled >= 1024 * 1024 && unit + 2 < UNITS.len() {
        scaled /= 1024;
        unit += 1;
    }
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    // `scaled` is below 2^20 here, so the conversion is exact.
    #[expect(clippy::cast_precision_loss, reason = "below 2^20, exact")]
    let value = scaled as f64 / 1024.0;
    format!("{value:.1} {}", UNITS[unit + 1])
}

/// A plain-text table: the first column left-aligned, the others right-aligned (they hold
/// numbers and levels), two spaces between columns.
#[derive(Debug)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells print empty.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text, one line per row, with a trailing newline.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (index, cell) in row.iter().enumerate() {
                if index < widths.len() {
                    widths[index] = widths[index].max(cell.chars().count());
                }
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            let mut line = String::new();
            for (index, width) in widths.iter().enumerate() {
                let cell = row.get(index).map_or("", String::as_str);
                if index == 0 {
                    line.push_str(&format!("{cell:<width$}"));
                } else {
                    line.push_str(&format!("  {cell:>width$}"));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// A progress bar on stderr, or a hidden one when `--json` is given or stderr is not a
/// terminal (so scripts and tests never see control characters). `total` is `None` when the
/// run ends on idle rather than on a count.
pub fn progress(total: Option<u64>, json: bool, what: &'static str) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(total) => {
            let bar = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
            ) {
                bar.set_style(style);
            }
            bar
        }
        None => {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {spinner} {pos} ({per_sec})",
            ) {
                bar.set_style(style);
            }
            bar
        }
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_prefix(what);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }

    #[test]
    fn tables_align_columns() {
        let mut table = Table::new(&["QUEUE", "READY"]);
        table.row(vec!["orders".into(), "7".into()]);
        table.row(vec!["q".into(), "12345".into()]);
        assert_eq!(
            table.render(),
            "QUEUE   READY\norders      7\nq       12345\n"
        );
    }

    #[test]
    fn error_counts_are_keyed_and_sorted() {
        let mut counts = ErrorCounts::default();
        counts.add("503".into());
        counts.add("429:disk".into());
        counts.add("429:disk".into());
        assert_eq!(counts.to_json(), json!({"429:disk": 2, "503": 1}));
        assert_eq!(counts.summary(), "429:disk=2, 503=1");
    }
}
