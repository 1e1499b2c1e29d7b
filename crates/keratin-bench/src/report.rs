//! `Report`: the table of figures and ratios (redb's `print_results_table`), its JSON form, and
//! the statistics behind them (medians, percentiles).

use hdrhistogram::Histogram;
use serde_json::json;

/// One line of the table: a case, both contenders' figures and their ratio.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub case: String,
    /// Keratin's figure (medians over rounds).
    pub keratin: String,
    /// The reference's figure (medians over rounds).
    pub reference: String,
    /// Median of the per-round ratios, Keratin / reference; above 1 means Keratin was faster.
    pub ratio: f64,
    /// The ratio of each round, in order.
    pub round_ratios: Vec<f64>,
    /// The ratio the issue asks for, if any.
    pub goal: Option<f64>,
    /// Batch sizes or what the reference did.
    pub note: String,
}

impl Row {
    fn verdict(&self) -> &'static str {
        match self.goal {
            Some(goal) if self.ratio >= goal => "met",
            Some(_) => "MISSED",
            None => "",
        }
    }
}

/// Everything one invocation measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Lines printed above the table: what, where, how.
    pub context: Vec<(String, String)>,
    /// The table.
    pub rows: Vec<Row>,
    /// One line per append case on where the time went.
    pub diagnostics: Vec<String>,
    /// Every per-round figure, for `--json`.
    pub json_cases: Vec<serde_json::Value>,
}

impl Report {
    /// The table as text.
    pub fn table(&self) -> String {
        let header = [
            "case",
            "keratin",
            "reference (raw)",
            "ratio",
            "goal",
            "",
            "rounds",
        ];
        let mut lines: Vec<[String; 7]> = vec![header.map(String::from)];
        for row in &self.rows {
            let rounds: Vec<String> = row.round_ratios.iter().map(|r| format!("{r:.2}")).collect();
            lines.push([
                row.case.clone(),
                row.keratin.clone(),
                row.reference.clone(),
                format!("{:.2}", row.ratio),
                row.goal.map_or("-".into(), |g| format!(">= {g:.2}")),
                row.verdict().into(),
                rounds.join(" "),
            ]);
        }
        let mut widths = [0usize; 7];
        for line in &lines {
            for (width, cell) in widths.iter_mut().zip(line) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for (key, value) in &self.context {
            out.push_str(&format!("{key}: {value}\n"));
        }
        out.push('\n');
        for (i, line) in lines.iter().enumerate() {
            let cells: Vec<String> = line
                .iter()
                .zip(widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            out.push_str(cells.join(" | ").trim_end());
            out.push('\n');
            if i == 0 {
                let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
                out.push_str(&rule.join("-|-"));
                out.push('\n');
            }
        }
        out.push('\n');
        for row in self.rows.iter().filter(|r| !r.note.is_empty()) {
            out.push_str(&format!("{}: {}\n", row.case, row.note));
        }
        out.push('\n');
        for line in &self.diagnostics {
            out.push_str(line);
            out.push('\n');
        }
        out
    }

    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        let context: serde_json::Map<String, serde_json::Value> = self
            .context
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "case": r.case,
                    "keratin": r.keratin,
                    "reference": r.reference,
                    "ratio": r.ratio,
                    "round_ratios": r.round_ratios,
                    "goal": r.goal,
                    "verdict": r.verdict(),
                    "note": r.note,
                })
            })
            .collect();
        json!({
            "context": context,
            "rows": rows,
            "diagnostics": self.diagnostics,
            "cases": self.json_cases,
        })
    }
}

/// The median; the mean of the middle two for an even count; 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The value at quantile `q` (0 to 1) within 0.1%; 0 for none.
pub fn percentile(values: &[u64], q: f64) -> u64 {
    // Three significant digits; the histogram grows to the largest value recorded (a
    // saturating record would clamp to the initial range instead of growing).
    let Ok(mut histogram) = Histogram::<u64>::new(3) else {
        return 0;
    };
    for value in values {
        if histogram.record(*value).is_err() {
            return 0;
        }
    }
    if histogram.is_empty() {
        return 0;
    }
    if q >= 1.0 {
        return histogram.max();
    }
    histogram.value_at_quantile(q)
}

/// A plain text table: the first row is the header, columns padded to their widest cell.
pub fn text_table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0usize; columns];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join(" | ").trim_end());
        out.push('\n');
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&rule.join("-|-"));
            out.push('\n');
        }
    }
    out
}

/// Latency percentiles p50 / p99 / p99.9 of nanosecond samples, as microseconds.
pub fn latency_us(nanos: &[u64]) -> (u64, u64, u64) {
    (
        percentile(nanos, 0.5) / 1000,
        percentile(nanos, 0.99) / 1000,
        percentile(nanos, 0.999) / 1000,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn percentile_of_a_few_values() {
        let values: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&values, 0.5), 50);
        assert_eq!(percentile(&values, 1.0), 100);
        let nanos = [200_000u64, 300_000, 5_000_000];
        assert!((299_000..=301_000).contains(&percentile(&nanos, 0.5)));
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
