//! The step before a freeze that makes the guest's own freeze cheaper.
//!
//! A Linux guest's `FIFREEZE` (`freeze_super`) takes the superblock's three
//! freeze locks one after another, and each waits for an RCU grace period
//! (`percpu_down_write` → `rcu_sync_enter` → `synchronize_rcu`). Under TCG
//! those three grace periods were 29 of the 37 ms one filesystem's freeze
//! took (ftrace in the test guest; docs/benchmarks.md, "Where a freeze's time
//! goes"), and qemu-ga freezes filesystems one after another, so they add up
//! per filesystem. With `/sys/kernel/rcu_expedited` set, each grace period is
//! expedited (~0.1 ms there).
//!
//! So while a cut is prepared, hearthd runs [`SCRIPT`] in the guest through
//! the agent's `guest-exec`: it sets `rcu_expedited` for a few seconds and
//! leaves a watcher in the guest that puts it back by itself. Nothing on the
//! host has to remember the change: if hearthd dies, the guest still undoes
//! it [`HOLD_SECONDS`] later. A guest whose administrator set
//! `rcu_expedited` is left alone. The step is bounded and optional: the cut
//! never waits for it longer than [`BUDGET`], and when the agent refuses
//! `guest-exec` (blocked with `--block-rpcs`), the guest has no `/bin/sh` or
//! no such file, the cut freezes as before; the `Freezing` event says which.

use std::time::Duration;

/// The longest a cut waits for the step; it runs beside the overlays'
/// preparation, so it costs wall time only when it takes longer than that.
pub const BUDGET: Duration = Duration::from_millis(300);

/// How long the guest keeps `rcu_expedited` set before its watcher puts it
/// back: longer than a freeze and thaw of many filesystems under TCG
/// (~0.3 s for four), short enough that the guest's expedited grace periods
/// (an IPI to every vCPU each) stay a brief exception.
pub const HOLD_SECONDS: u32 = 5;

/// The guest's marker of a change hearthd made: the pid of the script that
/// made it. A watcher resets `rcu_expedited` only while the marker is still
/// its own, so a later cut's change is not undone by an earlier watcher.
/// (`SCRIPT` spells it out; its test checks the two agree.)
#[cfg(test)]
pub const MARKER: &str = "/run/hearth-rcu-expedited";

/// The shell script `guest-exec` runs (`/bin/sh -c SCRIPT`). Prints one
/// word: `raised` (set now; the watcher resets it), `kept` (the guest had
/// it set itself: nothing changed) or fails with a message on stderr.
pub const SCRIPT: &str = "F=/sys/kernel/rcu_expedited; M=/run/hearth-rcu-expedited
read v < $F || exit 2
if [ \"$v\" != 0 ] && [ ! -e $M ]; then echo kept; exit 0; fi
echo $$ > $M || exit 3
echo 1 > $F || { rm -f $M; exit 4; }
( sleep 5; [ \"$(cat $M 2>/dev/null)\" = $$ ] && { echo 0 > $F; rm -f $M; } ) </dev/null >/dev/null 2>&1 &
echo raised";

/// What the step did, for the `Freezing` event and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `rcu_expedited` is set for this freeze; the guest resets it.
    Raised,
    /// The guest had it set already.
    Kept,
    /// The step did not run or did not finish in time; the freeze goes on
    /// without it.
    Skipped(String),
}

impl Outcome {
    /// From the script's exit code and output.
    pub fn from_exit(code: Option<i32>, stdout: &[u8], stderr: &[u8]) -> Outcome {
        let out = String::from_utf8_lossy(stdout);
        match (code, out.trim()) {
            (Some(0), "raised") => Outcome::Raised,
            (Some(0), "kept") => Outcome::Kept,
            (code, out) => {
                let err = String::from_utf8_lossy(stderr);
                let err = err.trim();
                let said = if err.is_empty() { out } else { err };
                Outcome::Skipped(format!(
                    "the guest's script {} ({})",
                    match code {
                        Some(c) => format!("exited {c}"),
                        None => "was killed".to_string(),
                    },
                    if said.is_empty() { "no output" } else { said }
                ))
            }
        }
    }

    /// Words for the `Freezing` event.
    pub fn describe(&self) -> String {
        match self {
            Outcome::Raised => format!(
                "guest RCU grace periods expedited for the freeze (the guest resets them within {HOLD_SECONDS} s)"
            ),
            Outcome::Kept => "the guest already expedites RCU grace periods".to_string(),
            Outcome::Skipped(why) => format!("freeze not expedited: {why}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_and_its_constants_agree() {
        assert!(SCRIPT.contains(&format!("M={MARKER}")));
        assert!(SCRIPT.contains(&format!("sleep {HOLD_SECONDS};")));
    }

    #[test]
    fn outcomes_from_the_scripts_exit() {
        assert_eq!(
            Outcome::from_exit(Some(0), b"raised\n", b""),
            Outcome::Raised
        );
        assert_eq!(Outcome::from_exit(Some(0), b"kept\n", b""), Outcome::Kept);
        let Outcome::Skipped(why) =
            Outcome::from_exit(Some(2), b"", b"sh: can't open /sys/kernel/rcu_expedited\n")
        else {
            panic!("a failed script is a skip");
        };
        assert!(
            why.contains("exited 2") && why.contains("rcu_expedited"),
            "{why}"
        );
        assert!(matches!(
            Outcome::from_exit(None, b"", b""),
            Outcome::Skipped(w) if w.contains("killed") && w.contains("no output")
        ));
        // Anything but the two words is not trusted as a change.
        assert!(matches!(
            Outcome::from_exit(Some(0), b"raised twice", b""),
            Outcome::Skipped(_)
        ));
    }

    #[test]
    fn the_event_says_what_happened() {
        assert!(Outcome::Raised.describe().contains("expedited"));
        assert!(
            Outcome::Skipped("guest-exec is disabled".into())
                .describe()
                .contains("not expedited: guest-exec is disabled")
        );
    }
}
