//! Backups of a VM's disks into a directory (docs/backup.md): the cut is a
//! checkpoint VM snapshot, the change since the previous backup is read
//! off the layer chains (`choose`), the bytes come from the cut's own
//! layers (`copy`), and the target's manifest is the commit (`target`).

pub mod choose;
pub mod copy;
pub mod reconcile;
pub mod target;

pub use reconcile::reconcile;
