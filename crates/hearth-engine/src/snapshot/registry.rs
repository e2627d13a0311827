//! What the snapshot subsystem keeps in memory between calls: the senders
//! of the running actors and group runs, the compaction yield counters and
//! the export pins. Plain data; the actors themselves are in `actor`, their
//! start in `Actors::request` and its siblings there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::coordinator::{CutId, Input, Request};
use super::group::Report as GroupReport;

/// What an actor is sent.
pub(super) enum Msg {
    Requests(Vec<Request>),
    /// A group's answer to one of its members (go on, or abort); its `now`
    /// is stamped when the actor takes it.
    Group(Input),
    /// Merge the layers of this disk's chain that nobody needs any more.
    Compact(String),
    /// Make the next overlay of every disk ready (a VM just started).
    Ahead,
}

/// What a member's actor tells its group's run.
pub(crate) struct MemberMsg {
    pub vm: String,
    pub cut: CutId,
    pub report: GroupReport,
}

/// The running actors, by target (`vm/NAME` or `disk/NAME`), and the
/// running group runs, by group name.
#[derive(Default)]
pub struct Actors {
    pub(super) map: Mutex<HashMap<String, mpsc::UnboundedSender<Msg>>>,
    groups: Mutex<HashMap<String, mpsc::UnboundedSender<MemberMsg>>>,
    /// Per target: bumped when a stop, start or restore wants the VM's locks,
    /// so a running compaction job is cancelled instead of making it wait.
    yields: Mutex<HashMap<String, Arc<std::sync::atomic::AtomicU64>>>,
}

impl Actors {
    pub(super) fn yield_epoch(&self, target: &str) -> Arc<std::sync::atomic::AtomicU64> {
        self.yields
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(target.to_string())
            .or_default()
            .clone()
    }

    /// Asks a compaction of `target` (`vm/NAME`) that holds its locks to
    /// give them back soon: its stream job is cancelled (and merged again
    /// later). Called before a stop, start or restore takes the locks.
    pub fn ask_to_yield(&self, target: &str) {
        self.yield_epoch(target)
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Registers a group's run; its members' reports go to `tx`.
    pub(crate) fn register_group(&self, group: &str, tx: mpsc::UnboundedSender<MemberMsg>) {
        let mut g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.insert(group.to_string(), tx);
    }

    pub(crate) fn unregister_group(&self, group: &str) {
        let mut g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.remove(group);
    }

    pub(crate) fn group_running(&self, group: &str) -> bool {
        let g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.get(group).is_some_and(|tx| !tx.is_closed())
    }

    /// Hands a member's report to its group's run; false when no run of
    /// that group is going on (the daemon restarted since it began).
    pub(super) fn report_to_group(&self, group: &str, msg: MemberMsg) -> bool {
        let g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.get(group).is_some_and(|tx| tx.send(msg).is_ok())
    }

    /// Hands a group's answer to a member's actor.
    pub(crate) fn signal(&self, target: &str, input: Input) {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(target) {
            let _ = tx.send(Msg::Group(input));
        }
    }
}

/// Per snapshot: read-held by each export while it converts, write-held by
/// the snapshot's delete.
#[derive(Default)]
pub struct Pins(Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>);

impl Pins {
    /// Whether an export or a restore holds `snapshot`'s pin now (without
    /// making an entry for it).
    pub fn busy(&self, snapshot: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(snapshot)
            .is_some_and(|pin| pin.try_write().is_err())
    }

    pub fn of(&self, snapshot: &str) -> Arc<tokio::sync::RwLock<()>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(snapshot.to_string())
            .or_default()
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_delete_waits_for_the_exports_that_hold_the_pin() {
        let pins = Pins::default();
        let read = pins.of("s").read_owned().await;
        assert!(pins.of("s").try_write_owned().is_err(), "pinned");
        assert!(pins.of("other").try_write_owned().is_ok());
        drop(read);
        assert!(pins.of("s").try_write_owned().is_ok());
    }
}
