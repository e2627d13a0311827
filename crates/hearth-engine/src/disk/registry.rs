//! What disk reconciles and resyncs keep in memory between runs (none of it
//! is needed after a restart: the first resync makes it again). Plain data;
//! the reconcile, the planner and the resync that use it are in `disk`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Disk reconciles that run at once. The others wait for a slot, parked:
/// a burst of thousands of new disks never fills the runtime's queue ahead
/// of the API's requests (docs/limits.md).
pub const RECONCILES_AT_ONCE: usize = 16;
/// A disk's chain as its compaction plan reads it: each layer top-down,
/// with its backing, whether something refers to it, and how many layers
/// lie on it. The plan is made again only when this changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Shape(pub(super) Vec<(String, Option<String>, bool, usize)>);

/// What disk reconciles and resyncs keep in memory (none of it is needed
/// after a restart: the first resync makes it again).
pub struct Disks {
    slots: tokio::sync::Semaphore,
    /// Per disk, the chain as its last compaction plan saw it, and whether
    /// that plan left merges to do.
    pub(super) planned: Mutex<HashMap<String, (Shape, bool)>>,
    pub(super) planner: Mutex<Planner>,
    /// The disk the last refresh ended at.
    pub(super) refreshed_up_to: Mutex<Option<String>>,
    /// The last full pass, when it found every disk at rest.
    pub(super) quiet: Mutex<Option<QuietPass>>,
    /// Reserved layer ids not handed out yet.
    pub(super) ids: Mutex<std::ops::Range<u64>>,
    /// Blank qcow2 images by size, as `qemu-img create` made them.
    pub(super) blanks: tokio::sync::Mutex<BTreeMap<u64, Arc<Vec<u8>>>>,
}

/// A disk at rest as a pass saw it: its name, its head's file, its
/// allocated bytes.
pub(super) type AtRest = (String, PathBuf, Option<u64>);

/// A full pass that woke nothing and asked for no merge.
pub(super) struct QuietPass {
    /// The store's count of writes before it read.
    pub(super) writes: u64,
    pub(super) at_rest: Vec<AtRest>,
    /// Passes since, that read nothing.
    pub(super) skipped: u32,
}

#[derive(Default)]
pub(super) struct Planner {
    pub(super) waiting: BTreeSet<String>,
    pub(super) running: bool,
}

impl Default for Disks {
    fn default() -> Self {
        Disks {
            slots: tokio::sync::Semaphore::new(RECONCILES_AT_ONCE),
            planned: Mutex::default(),
            planner: Mutex::default(),
            refreshed_up_to: Mutex::default(),
            quiet: Mutex::default(),
            ids: Mutex::new(0..0),
            blanks: tokio::sync::Mutex::default(),
        }
    }
}

impl Disks {
    /// A slot to run one disk reconcile in.
    pub async fn slot(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.slots
            .acquire()
            .await
            .expect("the disk slots are never closed")
    }

    pub(super) fn forget(&self, disk: &str) {
        self.planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(disk);
    }
}
