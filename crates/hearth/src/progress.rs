//! Showing objects settle while `wait` and `apply --wait` poll them: a live
//! progress bar per object on a terminal, plain lines anywhere else.
//!
//! This module knows nothing about the API's JSON: the poll loop hands it a
//! [`View`] of each object (the text of its line, what counts as a change, and
//! the bytes of an import in progress) and it decides what to draw or print.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, IsTerminal, Write};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::Instant;

use crate::output::human_bytes;

/// Plain output: while only the percentage moves, a new line at most when it
/// enters the next tenth, or after this long (so a slow import still shows
/// it is alive, with its rate).
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// One object as the last poll saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The line after `image/debian-12: `, e.g. `Importing 42% (12.0Mi of 28.6Mi, 3.1Mi/s)`.
    pub text: String,
    /// A change of this starts a new line (the phase, a failure reason);
    /// progress alone does not.
    pub key: String,
    /// 0..=100, while an import runs and its size is known.
    pub percent: Option<u64>,
    /// An import in progress.
    pub transfer: Option<Transfer>,
}

impl View {
    /// A view that is only a state: `Running`, `deleted`, `not found`.
    pub fn state(text: impl Into<String>) -> View {
        let text = text.into();
        View {
            key: text.clone(),
            text,
            percent: None,
            transfer: None,
        }
    }
}

/// Bytes of an import, from `status.bytesDone`, `bytesTotal`, `bytesPerSecond`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub done: u64,
    pub total: Option<u64>,
    pub rate: Option<u64>,
}

impl Transfer {
    pub fn percent(&self) -> Option<u64> {
        let total = self.total.filter(|t| *t > 0)?;
        Some((u128::from(self.done) * 100 / u128::from(total)).min(100) as u64)
    }

    /// `12.0Mi of 28.6Mi, 3.1Mi/s`; `12.0Mi` alone when nothing else is known.
    pub fn describe(&self) -> String {
        let mut text = human_bytes(self.done);
        if let Some(total) = self.total {
            text.push_str(&format!(" of {}", human_bytes(total)));
        }
        if let Some(rate) = self.rate {
            text.push_str(&format!(", {}/s", human_bytes(rate)));
        }
        text
    }
}

/// Where progress goes. `who` is `image/debian-12`, `vm/web`, ...
pub trait Reporter {
    /// The object as one poll saw it.
    fn observe(&mut self, who: &str, view: &View, now: Instant) -> io::Result<()>;
    /// It reached what was waited for; `note` is an extra word (`agent connected`).
    fn done(&mut self, who: &str, note: Option<&str>) -> io::Result<()>;
    /// It will not get there; the error itself is reported by the caller.
    fn failed(&mut self, who: &str) -> io::Result<()>;
    /// The wait ended (a timeout) with these still going.
    fn abandon(&mut self) -> io::Result<()>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Live bars on stderr.
    Bars,
    /// `who: text` lines on stdout.
    Lines,
}

/// Bars only when a person watches: stdout and stderr both terminals (so
/// `hearth apply --wait > log` or `2> log` gets lines) and `TERM` not `dumb`.
pub fn choose(stdout_is_terminal: bool, stderr_is_terminal: bool, term: Option<&OsStr>) -> Mode {
    let dumb = term.is_some_and(|t| t == "dumb");
    if stdout_is_terminal && stderr_is_terminal && !dumb {
        Mode::Bars
    } else {
        Mode::Lines
    }
}

/// The reporter for this process's stdout and stderr.
pub fn for_this_process() -> Box<dyn Reporter> {
    let term = std::env::var_os("TERM");
    match choose(
        io::stdout().is_terminal(),
        io::stderr().is_terminal(),
        term.as_deref(),
    ) {
        Mode::Bars => Box::new(Bars::new(ProgressDrawTarget::stderr())),
        Mode::Lines => Box::new(Lines::new(io::stdout())),
    }
}

// ---------------------------------------------------------------- plain lines

/// `who: text` lines for logs, CI and scripts: one per change of state, and
/// a few while an import runs (see [`HEARTBEAT`]).
pub struct Lines<W: Write> {
    out: W,
    printed: HashMap<String, Printed>,
}

struct Printed {
    key: String,
    text: String,
    tenth: Option<u64>,
    at: Instant,
}

impl<W: Write> Lines<W> {
    pub fn new(out: W) -> Self {
        Lines {
            out,
            printed: HashMap::new(),
        }
    }

    #[cfg(test)]
    pub fn into_inner(self) -> W {
        self.out
    }

    fn due(&self, who: &str, view: &View, now: Instant) -> bool {
        let Some(last) = self.printed.get(who) else {
            return true;
        };
        if last.key != view.key {
            return true;
        }
        if last.text == view.text {
            return false;
        }
        let tenth = view.percent.map(|p| p / 10);
        tenth > last.tenth || now.saturating_duration_since(last.at) >= HEARTBEAT
    }
}

impl<W: Write> Reporter for Lines<W> {
    fn observe(&mut self, who: &str, view: &View, now: Instant) -> io::Result<()> {
        if !self.due(who, view, now) {
            return Ok(());
        }
        writeln!(self.out, "{who}: {}", view.text)?;
        self.out.flush()?;
        self.printed.insert(
            who.to_string(),
            Printed {
                key: view.key.clone(),
                text: view.text.clone(),
                tenth: view.percent.map(|p| p / 10),
                at: now,
            },
        );
        Ok(())
    }

    fn done(&mut self, who: &str, note: Option<&str>) -> io::Result<()> {
        if let Some(note) = note {
            writeln!(self.out, "{who}: {note}")?;
            self.out.flush()?;
        }
        Ok(())
    }

    fn failed(&mut self, _who: &str) -> io::Result<()> {
        Ok(())
    }

    fn abandon(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------- bars

/// One line per object on stderr, redrawn in place: a bar with bytes, percent
/// and rate while an image imports, a spinner with the state otherwise.
pub struct Bars {
    multi: MultiProgress,
    bars: Vec<(String, ProgressBar, View)>,
}

const SPINNER_TEMPLATE: &str = "{prefix}  {spinner} {wide_msg}";
const BAR_TEMPLATE: &str = "{prefix}  [{bar:30}] {percent:>3}%  {wide_msg}";
const DONE_TEMPLATE: &str = "{prefix}  {wide_msg}";

fn style(template: &str) -> ProgressStyle {
    // The templates are constants; a mistake in one would show in every test.
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
        .progress_chars("=> ")
}

impl Bars {
    pub fn new(target: ProgressDrawTarget) -> Self {
        Bars {
            multi: MultiProgress::with_draw_target(target),
            bars: Vec::new(),
        }
    }

    fn bar(&mut self, who: &str) -> (&ProgressBar, &mut View) {
        let index = match self.bars.iter().position(|(w, _, _)| w == who) {
            Some(i) => i,
            None => {
                let width = self
                    .bars
                    .iter()
                    .map(|(w, _, _)| w.chars().count())
                    .chain([who.chars().count()])
                    .max()
                    .unwrap_or(0);
                let bar = self.multi.add(
                    ProgressBar::no_length()
                        .with_style(style(SPINNER_TEMPLATE))
                        .with_prefix(who.to_string()),
                );
                bar.enable_steady_tick(Duration::from_millis(120));
                self.bars.push((who.to_string(), bar, View::default()));
                // Keep the names in one column.
                for (w, b, _) in &self.bars {
                    b.set_prefix(format!("{w:<width$}"));
                }
                self.bars.len() - 1
            }
        };
        let (_, bar, view) = &mut self.bars[index];
        (bar, view)
    }

    /// The bar's state, for tests: (length, position, message).
    #[cfg(test)]
    pub fn state_of(&self, who: &str) -> Option<(Option<u64>, u64, String, bool)> {
        self.bars
            .iter()
            .find(|(w, _, _)| w == who)
            .map(|(_, b, _)| (b.length(), b.position(), b.message(), b.is_finished()))
    }
}

impl Reporter for Bars {
    fn observe(&mut self, who: &str, view: &View, _now: Instant) -> io::Result<()> {
        let (bar, last) = self.bar(who);
        match view.transfer {
            Some(
                t @ Transfer {
                    total: Some(total), ..
                },
            ) if total > 0 => {
                if bar.length() != Some(total) {
                    bar.set_style(style(BAR_TEMPLATE));
                    bar.set_length(total);
                }
                bar.set_position(t.done.min(total));
                bar.set_message(t.describe());
            }
            _ => {
                if bar.length().is_some() {
                    bar.unset_length();
                    bar.set_style(style(SPINNER_TEMPLATE));
                }
                bar.set_message(view.text.clone());
            }
        }
        *last = view.clone();
        Ok(())
    }

    fn done(&mut self, who: &str, note: Option<&str>) -> io::Result<()> {
        let (bar, last) = self.bar(who);
        let text = match note {
            Some(note) => format!("{}, {note}", last.text),
            None => last.text.clone(),
        };
        bar.set_style(style(DONE_TEMPLATE));
        bar.finish_with_message(text);
        Ok(())
    }

    fn failed(&mut self, who: &str) -> io::Result<()> {
        let (bar, last) = self.bar(who);
        let text = last.text.clone();
        bar.set_style(style(DONE_TEMPLATE));
        bar.abandon_with_message(text);
        Ok(())
    }

    fn abandon(&mut self) -> io::Result<()> {
        for (_, bar, last) in &self.bars {
            if !bar.is_finished() {
                bar.set_style(style(DONE_TEMPLATE));
                bar.abandon_with_message(last.text.clone());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn importing(done: u64, total: u64, rate: u64) -> View {
        let t = Transfer {
            done,
            total: Some(total),
            rate: Some(rate),
        };
        View {
            text: format!("Importing {}% ({})", t.percent().unwrap_or(0), t.describe()),
            key: "Importing".into(),
            percent: t.percent(),
            transfer: Some(t),
        }
    }

    #[test]
    fn bars_only_when_both_streams_are_terminals_that_can_draw() {
        let xterm = Some(OsStr::new("xterm-256color"));
        assert_eq!(choose(true, true, xterm), Mode::Bars);
        assert_eq!(choose(true, true, None), Mode::Bars);
        // Piped, redirected, or in CI: plain lines.
        assert_eq!(choose(false, true, xterm), Mode::Lines);
        assert_eq!(choose(true, false, xterm), Mode::Lines);
        assert_eq!(choose(false, false, None), Mode::Lines);
        assert_eq!(choose(true, true, Some(OsStr::new("dumb"))), Mode::Lines);
    }

    #[test]
    fn transfers_describe_themselves_in_binary_units() {
        let t = Transfer {
            done: 12 << 20,
            total: Some(30 << 20),
            rate: Some(3 << 20),
        };
        assert_eq!(t.describe(), "12.0Mi of 30.0Mi, 3.0Mi/s");
        assert_eq!(t.percent(), Some(40));
        let unknown = Transfer {
            done: 5 << 10,
            total: None,
            rate: None,
        };
        assert_eq!(unknown.describe(), "5.0Ki");
        assert_eq!(unknown.percent(), None);
        // A server that overshoots its own total never shows more than 100%.
        let over = Transfer {
            done: 11,
            total: Some(10),
            rate: None,
        };
        assert_eq!(over.percent(), Some(100));
        let empty = Transfer {
            done: 0,
            total: Some(0),
            rate: None,
        };
        assert_eq!(empty.percent(), None);
    }

    #[test]
    fn plain_lines_follow_state_changes_and_each_tenth_of_an_import() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut lines = Lines::new(Vec::new());
        let who = "image/debian-12";
        lines
            .observe(who, &View::state("Pending"), ms(0))
            .expect("w");
        lines
            .observe(who, &View::state("Pending"), ms(250))
            .expect("w");
        lines
            .observe(who, &importing(1 << 20, 100 << 20, 1 << 20), ms(500))
            .expect("w");
        // Same tenth, moments later: no line.
        lines
            .observe(who, &importing(5 << 20, 100 << 20, 1 << 20), ms(750))
            .expect("w");
        lines
            .observe(who, &importing(9 << 20, 100 << 20, 1 << 20), ms(1000))
            .expect("w");
        // The next tenth: a line.
        lines
            .observe(who, &importing(10 << 20, 100 << 20, 1 << 20), ms(1250))
            .expect("w");
        // Stuck in one tenth: a line once HEARTBEAT has passed.
        lines
            .observe(who, &importing(11 << 20, 100 << 20, 10), ms(5000))
            .expect("w");
        lines
            .observe(who, &importing(12 << 20, 100 << 20, 10), ms(11_250))
            .expect("w");
        lines
            .observe(who, &View::state("Ready"), ms(11_500))
            .expect("w");
        lines.done(who, None).expect("w");
        let text = String::from_utf8(lines.into_inner()).expect("utf-8");
        assert_eq!(
            text,
            "\
image/debian-12: Pending
image/debian-12: Importing 1% (1.0Mi of 100.0Mi, 1.0Mi/s)
image/debian-12: Importing 10% (10.0Mi of 100.0Mi, 1.0Mi/s)
image/debian-12: Importing 12% (12.0Mi of 100.0Mi, 10B/s)
image/debian-12: Ready
"
        );
    }

    #[test]
    fn plain_lines_are_kept_per_object_and_notes_follow() {
        let now = Instant::now();
        let mut lines = Lines::new(Vec::new());
        lines
            .observe("vm/a", &View::state("Starting"), now)
            .expect("w");
        lines
            .observe("disk/b", &View::state("Pending"), now)
            .expect("w");
        lines
            .observe("vm/a", &View::state("Starting"), now)
            .expect("w");
        lines
            .observe("vm/a", &View::state("Running"), now)
            .expect("w");
        lines.done("vm/a", Some("agent connected")).expect("w");
        assert_eq!(
            String::from_utf8(lines.into_inner()).expect("utf-8"),
            "vm/a: Starting\ndisk/b: Pending\nvm/a: Running\nvm/a: agent connected\n"
        );
    }

    #[test]
    fn bars_carry_the_bytes_and_the_rate_then_finish_with_the_state() {
        let mut bars = Bars::new(ProgressDrawTarget::hidden());
        let now = Instant::now();
        let who = "image/debian-12";
        bars.observe(who, &View::state("Pending"), now)
            .expect("draw");
        assert_eq!(
            bars.state_of(who),
            Some((None, 0, "Pending".to_string(), false))
        );
        bars.observe(who, &importing(10 << 20, 100 << 20, 2 << 20), now)
            .expect("draw");
        assert_eq!(
            bars.state_of(who),
            Some((
                Some(100 << 20),
                10 << 20,
                "10.0Mi of 100.0Mi, 2.0Mi/s".to_string(),
                false
            ))
        );
        // A failed attempt goes back to a spinner with the reason.
        let failed = View::state("Failed (attempt 1): HttpError: 503; still waiting");
        bars.observe(who, &failed, now).expect("draw");
        let (len, _, msg, _) = bars.state_of(who).expect("bar");
        assert_eq!(len, None);
        assert_eq!(msg, failed.text);
        bars.observe(who, &View::state("Ready"), now).expect("draw");
        bars.done(who, None).expect("draw");
        assert_eq!(
            bars.state_of(who).map(|(_, _, m, f)| (m, f)),
            Some(("Ready".to_string(), true))
        );
        bars.observe("vm/web", &View::state("Starting"), now)
            .expect("draw");
        bars.abandon().expect("draw");
        assert_eq!(
            bars.state_of("vm/web").map(|(_, _, m, f)| (m, f)),
            Some(("Starting".to_string(), true))
        );
    }
}
