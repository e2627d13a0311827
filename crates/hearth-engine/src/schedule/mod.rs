//! Snapshot schedules: at each slot of a cron expression (read in the wall
//! time of an IANA zone, `hearth_api::cron`), snapshots of the covered VMs,
//! and retention of what earlier runs made (docs/schedules.md).

pub mod plan;
pub mod reconcile;

pub use reconcile::reconcile;

use hearth_api::{Kind, labels};

use crate::context::Context;

/// A run's object (a VM snapshot, a group, a backup) reached Ready or
/// Failed: the schedule that made it (its `hearth.dev/schedule` label)
/// looks now, not at its next wake (retention, its status).
pub fn run_settled(ctx: &Context, kind: Kind, name: &str) {
    let Ok(Some(o)) = ctx.store.get(kind, name) else {
        return;
    };
    if let Some(schedule) = o.object.metadata().labels.get(labels::SCHEDULE) {
        ctx.wake(Kind::VirtualMachineSnapshotSchedule, schedule);
    }
}
