//! Consistent snapshots: the pure freeze coordinator, its async shell (one
//! actor per VM), the snapshot reconcilers, the layer storage and export.

mod actor;
pub mod compaction;
pub mod coordinator;
pub mod expedite;
pub mod export;
pub mod overlays;
mod reconcile;
pub mod storage;

pub use actor::{Actors, target_of};
pub use reconcile::{reconcile_disk_snapshot, reconcile_vm_snapshot};
