//! Snapshot schedules: at each slot of a cron expression (read in the wall
//! time of an IANA zone, `hearth_api::cron`), snapshots of the covered VMs,
//! and retention of what earlier runs made (docs/schedules.md).

pub mod plan;
pub mod reconcile;

pub use reconcile::reconcile;
