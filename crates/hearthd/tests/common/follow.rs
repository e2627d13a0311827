//! The real CLI as a child that keeps printing (`-w`): its stdout read
//! line by line on a thread, waited for with a deadline.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::Daemon;

/// How long a line may take to come.
const LINE: Duration = Duration::from_secs(30);

/// The real CLI as a child, its stdout read line by line on a thread.
pub struct Cli {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Cli {
    pub fn spawn(d: &Daemon, args: &[&str]) -> Cli {
        let mut child = d
            .cli_command(args, Stdio::null())
            .spawn()
            .expect("run hearth");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Cli {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next stdout line that `pred` accepts (earlier ones are kept).
    pub fn line_with(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + LINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    let mut err = String::new();
                    if let Some(mut e) = self.child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    panic!(
                        "hearth printed no line with {what} within {LINE:?}; stdout: {:#?}\nstderr: {err}",
                        self.seen
                    );
                }
            }
        }
    }

    /// Ends it; its stderr.
    pub fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        err
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
