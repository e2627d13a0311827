//! Consistent snapshots: the pure freeze coordinator, its async shell (one
//! actor per VM), the pure core of VM snapshot groups and its shell, the
//! snapshot reconcilers, the layer storage and export.

mod actor;
pub mod compaction;
pub mod coordinator;
pub mod expedite;
pub mod export;
pub mod group;
mod group_run;
pub mod overlays;
mod reconcile;
pub mod registry;
pub mod storage;

pub use group_run::{member_name as group_member_name, reconcile_group};
pub use reconcile::{reconcile_disk_snapshot, reconcile_vm_snapshot};

/// Milliseconds on one monotonic clock shared by every snapshot actor and
/// group run of this daemon, so a group's deadline means the same instant
/// to each of its members.
pub(crate) fn clock_ms() -> coordinator::Millis {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as coordinator::Millis
}
