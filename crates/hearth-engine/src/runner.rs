//! The reconcile runner: which function reconciles each kind, and the one
//! place that runs a reconcile. A reconciler only says what it wants next
//! (an [`Action`], or an error); the runner times the run, counts it in the
//! metrics, turns an error into a retry with backoff and schedules the
//! requeue. The engine's work queue decides when a key runs (never two runs
//! of one object at once) and calls [`Runner::run`]; it knows no kind.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hearth_api::Kind;

use crate::context::{Action, Context, Key, ReconcileError};

/// What one reconcile returns: what it wants next, or why it failed (it is
/// then retried with [`backoff`]).
pub type Outcome = Result<Action, ReconcileError>;

type Future_<'a> = Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>;
type ReconcileFn = for<'a> fn(&'a Arc<Context>, &'a str) -> Future_<'a>;

/// One kind's reconciler.
struct Reconciler {
    reconcile: ReconcileFn,
    /// Takes one of the disks' slots before it runs: a burst of thousands of
    /// new disks waits parked in the runner, not in the runtime's queue.
    takes_disk_slot: bool,
}

macro_rules! boxed {
    ($name:ident, $path:path) => {
        fn $name<'a>(ctx: &'a Arc<Context>, name: &'a str) -> Future_<'a> {
            Box::pin($path(ctx, name))
        }
    };
}

boxed!(vm, crate::vm::reconcile);
boxed!(disk, crate::disk::reconcile);
boxed!(disk_snapshot, crate::snapshot::reconcile_disk_snapshot);
boxed!(vm_snapshot, crate::snapshot::reconcile_vm_snapshot);
boxed!(group, crate::snapshot::reconcile_group);
boxed!(schedule, crate::schedule::reconcile);
boxed!(backup, crate::backup::reconcile);
boxed!(image, crate::image::reconcile);
boxed!(network, crate::network::reconcile);

/// The table: every kind has exactly one reconciler.
fn reconciler(kind: Kind) -> Reconciler {
    let (reconcile, takes_disk_slot): (ReconcileFn, bool) = match kind {
        Kind::VirtualMachine => (vm, false),
        Kind::VirtualDisk => (disk, true),
        Kind::VirtualDiskSnapshot => (disk_snapshot, false),
        Kind::VirtualMachineSnapshot => (vm_snapshot, false),
        Kind::VirtualMachineSnapshotGroup => (group, false),
        Kind::VirtualMachineSnapshotSchedule => (schedule, false),
        Kind::VirtualMachineBackup => (backup, false),
        Kind::VirtualImage => (image, false),
        Kind::VirtualNetwork => (network, false),
    };
    Reconciler {
        reconcile,
        takes_disk_slot,
    }
}

/// Runs reconciles and keeps, per object, how many failed in a row.
#[derive(Default)]
pub struct Runner {
    failures: Mutex<HashMap<Key, u32>>,
}

impl Runner {
    /// One reconcile of `key`; a requeue it asks for, or the retry of a
    /// failure, comes back as a wake through `ctx`.
    pub async fn run(&self, ctx: &Arc<Context>, key: &Key) {
        let r = reconciler(key.0);
        let _slot = if r.takes_disk_slot {
            Some(ctx.disks.slot().await)
        } else {
            None
        };
        let started = Instant::now();
        let result = (r.reconcile)(ctx, &key.1).await;
        ctx.metrics
            .reconcile_done(key.0, started.elapsed(), result.is_err());
        let again = match result {
            Ok(action) => {
                self.failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(key);
                match action {
                    Action::Done => None,
                    Action::RequeueAfter(delay) => Some(delay),
                }
            }
            Err(e) => {
                let n = {
                    let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
                    let n = f.entry(key.clone()).or_insert(0);
                    *n += 1;
                    *n
                };
                let delay = backoff(n);
                tracing::warn!(kind = key.0.as_str(), name = key.1, error = %e, retry_in = ?delay, "reconcile failed");
                Some(delay)
            }
        };
        if let Some(delay) = again {
            let weak = Arc::downgrade(ctx);
            let k = key.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Some(ctx) = weak.upgrade() {
                    ctx.wake(k.0, &k.1);
                }
            });
        }
    }
}

/// 1 s, 2 s, 4 s ... capped at 60 s.
fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(4), Duration::from_secs(8));
        assert_eq!(backoff(50), Duration::from_secs(60));
    }
}
