//! Tables and the small humanisers that fill them.
//!
//! Objects from hearthd are read as JSON values, not as the typed structs:
//! a newer daemon may add fields, and an older CLI should still print what
//! it knows instead of refusing the whole answer.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use serde_json::Value;

/// The value at `path` (object keys), if every step exists.
pub fn at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, key| v.get(*key))
}

pub fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(v, path).and_then(Value::as_str)
}

pub fn u64_at(v: &Value, path: &[&str]) -> Option<u64> {
    at(v, path).and_then(Value::as_u64)
}

pub fn time_at(v: &Value, path: &[&str]) -> Option<DateTime<Utc>> {
    str_at(v, path)
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// A scalar as a table cell; `-` when absent.
pub fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Time since `then`, kubectl style: `42s`, `3m`, `2h`, `4d`, `1y`.
pub fn human_age(then: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (now - then).num_seconds();
    if secs < -1 {
        // The daemon's clock is ahead of ours; say so rather than lie.
        return "<invalid>".to_string();
    }
    let secs = secs.max(0);
    let (mins, hours, days) = (secs / 60, secs / 3600, secs / 86_400);
    if secs < 60 {
        format!("{secs}s")
    } else if mins < 60 {
        format!("{mins}m")
    } else if hours < 24 {
        format!("{hours}h")
    } else if days < 365 {
        format!("{days}d")
    } else {
        format!("{}y", days / 365)
    }
}

/// The AGE cell of an object: time since `metadata.creationTimestamp`.
pub fn age_of(obj: &Value, now: DateTime<Utc>) -> String {
    time_at(obj, &["metadata", "creationTimestamp"])
        .map(|t| human_age(t, now))
        .unwrap_or_else(|| "-".to_string())
}

/// Bytes in binary units with one decimal: `512B`, `4.0Ki`, `12.3Mi`, `1.0Gi`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Round first so 1023.96Ki prints as 1.0Mi, not 1024.0Ki.
    while (value * 10.0).round() / 10.0 >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1}{}", UNITS[unit])
}

/// A plain-text table: left-aligned columns, three spaces apart, no
/// trailing whitespace.
#[derive(Clone, Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; line breaks in a cell become spaces so rows stay rows.
    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(
            row.into_iter()
                .map(|c| c.replace(['\n', '\r', '\t'], " "))
                .collect(),
        );
    }

    /// Each column's width: its widest cell, the header's included.
    pub fn widths(&self) -> Vec<usize> {
        let columns = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.header.len()])
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in row.iter().enumerate() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        widths
    }

    /// Adds a column at `at` (clamped to the end): its header and one cell
    /// per row (missing cells are `-`).
    pub fn insert_column(&mut self, at: usize, header: &str, cells: Vec<String>) {
        let at = at.min(self.header.len());
        self.header.insert(at, header.to_string());
        let mut cells = cells.into_iter();
        for row in &mut self.rows {
            let cell = cells.next().unwrap_or_else(|| "-".to_string());
            row.insert(at.min(row.len()), cell);
        }
    }

    fn line(row: &[String], widths: &[usize], pad: &str) -> String {
        let mut line = pad.to_string();
        for (i, c) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                let w = widths.get(i).copied().unwrap_or(0);
                let _ = write!(line, "{c:<w$}   ");
            }
        }
        let mut line = line.trim_end().to_string();
        line.push('\n');
        line
    }

    /// The table with every line indented by `indent` spaces.
    pub fn render_indented(&self, indent: usize) -> String {
        let widths = self.widths();
        let pad = " ".repeat(indent);
        std::iter::once(&self.header)
            .chain(&self.rows)
            .map(|row| Self::line(row, &widths, &pad))
            .collect()
    }

    /// The header and the rows, padded to `widths` (at least).
    pub fn render_with(&self, widths: &[usize]) -> String {
        let widths: Vec<usize> = self
            .widths()
            .iter()
            .enumerate()
            .map(|(i, w)| (*w).max(widths.get(i).copied().unwrap_or(0)))
            .collect();
        std::iter::once(&self.header)
            .chain(&self.rows)
            .map(|row| Self::line(row, &widths, ""))
            .collect()
    }

    /// Only the rows, padded to `widths` (those of a table printed before):
    /// what `get -w` prints under a header already on the screen. A wider
    /// cell pushes the rest of its own row only.
    pub fn render_rows(&self, widths: &[usize]) -> String {
        self.rows
            .iter()
            .map(|row| Self::line(row, widths, ""))
            .collect()
    }

    pub fn render(&self) -> String {
        self.render_indented(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + secs, 0)
            .single()
            .expect("valid time")
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now = t(0);
        assert_eq!(human_age(t(0), now), "0s");
        assert_eq!(human_age(t(-5), now), "5s");
        assert_eq!(human_age(t(-59), now), "59s");
        assert_eq!(human_age(t(-180), now), "3m");
        assert_eq!(human_age(t(-3599), now), "59m");
        assert_eq!(human_age(t(-2 * 3600 - 70), now), "2h");
        assert_eq!(human_age(t(-4 * 86_400 - 10), now), "4d");
        assert_eq!(human_age(t(-400 * 86_400), now), "1y");
        // A second of clock skew reads as now; more is flagged.
        assert_eq!(human_age(t(1), now), "0s");
        assert_eq!(human_age(t(30), now), "<invalid>");
    }

    #[test]
    fn age_of_reads_the_creation_timestamp() {
        let now = Utc
            .with_ymd_and_hms(2025, 1, 1, 12, 5, 0)
            .single()
            .expect("time");
        let obj = json!({"metadata": {"name": "a", "creationTimestamp": "2025-01-01T12:00:00Z"}});
        assert_eq!(age_of(&obj, now), "5m");
        assert_eq!(age_of(&json!({"metadata": {"name": "a"}}), now), "-");
    }

    #[test]
    fn sizes_are_humanised_in_binary_units() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(512), "512B");
        assert_eq!(human_bytes(4096), "4.0Ki");
        assert_eq!(human_bytes(1 << 30), "1.0Gi");
        assert_eq!(human_bytes(12_897_485), "12.3Mi");
        assert_eq!(human_bytes((1 << 20) - 1), "1.0Mi");
        assert_eq!(human_bytes(3 << 40), "3.0Ti");
        assert_eq!(human_bytes(u64::MAX), "16.0Ei");
    }

    #[test]
    fn rows_printed_later_line_up_under_the_first_header() {
        let mut first = Table::new(&["NAME", "PHASE", "AGE"]);
        first.push(vec!["data".into(), "Pending".into(), "1s".into()]);
        first.insert_column(0, "EVENT", vec!["ADDED".into()]);
        let widths = first.widths();
        assert_eq!(
            first.render(),
            "EVENT   NAME   PHASE     AGE\nADDED   data   Pending   1s\n"
        );
        let mut later = Table::new(&["NAME", "PHASE", "AGE"]);
        later.push(vec!["data".into(), "Ready".into(), "2s".into()]);
        later.push(vec!["a-longer-name".into(), "-".into(), "0s".into()]);
        later.insert_column(0, "EVENT", vec!["MODIFIED".into()]);
        assert_eq!(
            later.render_rows(&widths),
            "MODIFIED   data   Ready     2s\n-       a-longer-name   -         0s\n"
        );
    }

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let mut table = Table::new(&["NAME", "PHASE", "AGE"]);
        table.push(vec!["demo".into(), "Running".into(), "5s".into()]);
        table.push(vec!["a-longer-name".into(), "-".into(), "3m".into()]);
        assert_eq!(
            table.render(),
            "\
NAME            PHASE     AGE
demo            Running   5s
a-longer-name   -         3m
"
        );
    }

    #[test]
    fn table_cells_stay_on_one_line_and_indent_applies() {
        let mut table = Table::new(&["TYPE", "MESSAGE"]);
        table.push(vec!["Ready".into(), "two\nlines".into()]);
        assert_eq!(
            table.render_indented(2),
            "  TYPE    MESSAGE\n  Ready   two lines\n"
        );
    }

    #[test]
    fn cells_and_lookups() {
        let v = json!({"status": {"pid": 42, "phase": "Running", "gone": null}});
        assert_eq!(cell(at(&v, &["status", "pid"])), "42");
        assert_eq!(cell(at(&v, &["status", "phase"])), "Running");
        assert_eq!(cell(at(&v, &["status", "gone"])), "-");
        assert_eq!(cell(at(&v, &["status", "missing", "deeper"])), "-");
        assert_eq!(u64_at(&v, &["status", "pid"]), Some(42));
    }
}
