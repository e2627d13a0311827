//! Chain compaction: merging the layers nobody needs any more into the
//! layer above them, so a disk with a long snapshot history reads through a
//! short chain again (`docs/snapshots.md`, "Compaction").
//!
//! The pure core decides *what* may be merged ([`plan`]) and how a merge a
//! crash interrupted is settled ([`decide`]); the async shell does the
//! I/O (`settle.rs` settles a recorded merge, `run.rs` runs one): `qemu-img rebase` for a disk no QEMU runs, a QMP `block-stream` job
//! for a running VM's disk, always through the VM's snapshot
//! actor (which performs every block-graph change of that VM in order).
//!
//! The direction is always *up*: the data of the unneeded layers goes into
//! the needed layer right above them (`top`), which is then rebased onto the
//! needed layer below them (`base`). `top` reads exactly as before (it gets
//! what it used to read through the merged layers), `base` and everything
//! below it are not written at all, so every snapshot, restore source and
//! disk that reads through `base` is untouched. (Committing down into
//! `base` would change what `base` reads, and `base` is needed by
//! definition.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::overlays::OverlayError;
use super::storage;
use hearth_qemu::img::ImgError;
use hearth_qemu::process::ProcessIdentity;
use hearth_qemu::qmp::QmpError;

use crate::store::journals::{self, Of};
use crate::store::layers::{self, Roots};
use crate::store::{Store, StoreError};

mod run;
mod settle;

pub use run::{Yield, compact_disk};
pub use settle::settle_offline;

const QMP_TIMEOUT: Duration = Duration::from_secs(5);

// ------------------------------------------------------------------ pure core

/// One merge: the layers `gone` (top-down, right below `top`) go into
/// `top`, which is then backed by `base`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Merge {
    pub top: String,
    pub base: String,
    pub gone: Vec<String>,
}

/// What the store says about layers: each layer's backing layer, and the
/// layers something refers to directly (a head, a snapshot, a journalled
/// overlay's base, a compaction in progress).
#[derive(Clone, Debug, Default)]
pub struct Chains {
    pub backing: BTreeMap<String, Option<String>>,
    pub roots: BTreeSet<String>,
}

impl Chains {
    fn children(&self) -> BTreeMap<&str, usize> {
        let mut out: BTreeMap<&str, usize> = BTreeMap::new();
        for b in self.backing.values().flatten() {
            *out.entry(b.as_str()).or_default() += 1;
        }
        out
    }

    /// A layer is needed — it stays — when something refers to it, when it
    /// is the bottom of its chain (its backing is an image file or nothing:
    /// merging it would copy the image up), when more or fewer than one
    /// layer lies on it (two readers above would each need its data), or
    /// when the store does not know its backing.
    fn needed(&self, id: &str, children: &BTreeMap<&str, usize>) -> bool {
        self.roots.contains(id)
            || !matches!(self.backing.get(id), Some(Some(b)) if self.backing.contains_key(b))
            || children.get(id).copied().unwrap_or(0) != 1
    }

    /// The chain from `head` down, `head` first.
    pub fn chain(&self, head: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        let mut cur = Some(head.to_string());
        while let Some(id) = cur {
            if !self.backing.contains_key(&id) || !seen.insert(id.clone()) {
                break;
            }
            out.push(id.clone());
            cur = self.backing.get(&id).cloned().flatten();
        }
        out
    }
}

/// The merges that make `head`'s chain as short as it can be without
/// changing what any needed layer reads: every run of unneeded layers goes
/// into the needed layer above it. Top-down; the runs do not overlap.
pub fn plan(chains: &Chains, head: &str) -> Vec<Merge> {
    let children = chains.children();
    let chain = chains.chain(head);
    let mut out = Vec::new();
    let mut top: Option<&String> = None;
    let mut run: Vec<String> = Vec::new();
    for id in &chain {
        // The head itself is always needed (it is a root).
        if id == head || chains.needed(id, &children) {
            if let Some(t) = top
                && !run.is_empty()
            {
                out.push(Merge {
                    top: t.clone(),
                    base: id.clone(),
                    gone: std::mem::take(&mut run),
                });
            }
            run.clear();
            top = Some(id);
        } else {
            run.push(id.clone());
        }
    }
    out
}

/// What the top layer's header names as its backing file. Both writers
/// change it, but neither last: `qemu-img rebase` writes it before the L2
/// tables that point at the clusters it copied (measured with strace on
/// qemu-img 10.0.2), and QEMU's stream job writes it at its end while the
/// new L2 entries may still sit in QEMU's metadata cache. So the header
/// alone never proves a merge: see [`Writer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Header {
    /// The merge's base: written, with the data perhaps not referenced yet.
    Base,
    /// The first merged layer: the top reads as before.
    FirstGone,
    /// Neither, or unreadable: why.
    Other(String),
}

impl Header {
    pub fn of(backing: Option<&Path>, base: &Path, first_gone: &Path) -> Header {
        match backing {
            Some(b) if b == base => Header::Base,
            Some(b) if b == first_gone => Header::FirstGone,
            Some(b) => Header::Other(format!(
                "the top layer's backing file is {}, neither {} nor {}",
                b.display(),
                base.display(),
                first_gone.display()
            )),
            None => Header::Other("the top layer names no backing file".into()),
        }
    }
}

/// What is known of the process that writes a merge: the only proof that
/// the merged data is durable and referenced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Writer {
    /// The `qemu-img rebase` this daemon ran, seen to exit: with status 0
    /// (it has written and synced everything: it closes the image, which
    /// flushes) or not (killed, failed, timed out).
    Exited { ok: bool },
    /// A process holds the top open that may still write it (a `qemu-img`
    /// a dead daemon started).
    Running,
    /// Nothing holds the top and nobody saw how its writer ended: a
    /// `qemu-img` of a dead daemon, or the VM's QEMU exited (cleanly or not).
    Gone,
    /// The QEMU that runs the job: whether the job still runs, and whether a
    /// flush of the top was asked and answered since the job ended.
    Qemu { job_running: bool, flushed: bool },
    /// Cannot be told (QMP does not answer, another QEMU runs): why.
    Unknown(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Durable and referenced: record it; then the merged layers may go.
    Done,
    /// Still being written: decide later.
    Wait,
    /// The header names the base and QEMU, which may hold the new L2
    /// entries in its cache only, still runs: ask it to flush the top and
    /// decide again.
    Flush,
    /// The header names the base, but nobody knows that the data is
    /// referenced: set the header back to the first merged layer (the top
    /// then reads as before: every cluster it references reads as it did
    /// through the merged layers), then forget the merge.
    Undo,
    /// It ended without switching: forget the intent. The top reads as
    /// before; whatever was copied up reads exactly as it did through the
    /// merged layers.
    Abandoned,
    /// Touch nothing; decide later.
    Unresolved(String),
}

/// Settles a recorded merge from the top's header and from what is known
/// of its writer. Done only with proof: a `qemu-img` seen to exit 0, or a
/// flush of the top that the same QEMU answered after its job ended.
pub fn decide(header: &Header, writer: &Writer) -> Settle {
    match (header, writer) {
        (_, Writer::Unknown(why)) => Settle::Unresolved(why.clone()),
        (
            _,
            Writer::Running
            | Writer::Qemu {
                job_running: true, ..
            },
        ) => Settle::Wait,
        (Header::Other(why), _) => Settle::Unresolved(why.clone()),
        (Header::Base, Writer::Exited { ok: true } | Writer::Qemu { flushed: true, .. }) => {
            Settle::Done
        }
        (Header::Base, Writer::Qemu { flushed: false, .. }) => Settle::Flush,
        (Header::Base, Writer::Exited { ok: false } | Writer::Gone) => Settle::Undo,
        (Header::FirstGone, Writer::Exited { .. } | Writer::Gone | Writer::Qemu { .. }) => {
            Settle::Abandoned
        }
    }
}

// ------------------------------------------------------------------ records

pub use crate::store::journals::{CompactionIntent as Intent, compaction_job as job_id};

/// The layers as the store has them, with every direct reference.
pub fn chains(store: &Store) -> Result<Chains, StoreError> {
    let g = layers::graph(store, Roots::Referenced)?;
    Ok(Chains {
        backing: g.backing,
        roots: g.roots.into_iter().collect(),
    })
}

/// The recorded merges of `disk`.
pub fn intents_of_disk(store: &Store, disk: &str) -> Result<Vec<Intent>, StoreError> {
    journals::compactions(store, Of::Disk(disk))
}

/// The recorded merges of a target's actor.
pub fn intents_of_target(store: &Store, target: &str) -> Result<Vec<Intent>, StoreError> {
    journals::compactions(store, Of::Target(target))
}

/// The targets with a recorded merge (after a restart their actors settle it).
pub fn targets(store: &Store) -> Result<Vec<String>, StoreError> {
    journals::compaction_targets(store)
}

/// Records a merge before anything starts, under a never-repeating id;
/// `qemu` is the process an online merge runs in (`None`: offline).
fn record(
    store: &Store,
    target: &str,
    disk: &str,
    m: &Merge,
    qemu: Option<&ProcessIdentity>,
) -> Result<i64, StoreError> {
    journals::record_compaction(store, target, disk, (&m.top, &m.base, &m.gone), qemu)
}

/// A finished merge: the top's backing is the base (one transaction with
/// the intent's removal); the merged layers are then unreachable and
/// collected, their files unlinked unless a process still holds one.
fn finish(store: &Store, i: &Intent) -> Result<Vec<PathBuf>, StoreError> {
    journals::finish_compaction(store, i)?;
    storage::collect_garbage_unless_open(store)
}

fn forget(store: &Store, id: i64) -> Result<(), StoreError> {
    journals::forget_compaction(store, id)
}

// ------------------------------------------------------------------ shell

/// Why a merge could not be read, settled, started or undone.
#[derive(Debug, thiserror::Error)]
pub enum CompactionError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Overlay(#[from] OverlayError),
    #[error(transparent)]
    Img(#[from] ImgError),
    #[error("no QMP connection to the VM")]
    NoQmp,
    #[error("qemu-img info {}: {source}", path.display())]
    Info { path: PathBuf, source: ImgError },
    #[error("QEMU has no node of layer {}", .0.display())]
    NoLayerNode(PathBuf),
    #[error("node {0} has no file node of hearth's naming")]
    NoFileNode(String),
    #[error("blockdev-reopen of {node}: {source}")]
    Reopen { node: String, source: QmpError },
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("compaction {0} names no merged layer")]
    NoMergedLayer(i64),
    #[error("{} is open by a process: its header is set back later", .0.display())]
    TopOpen(PathBuf),
    #[error("{}'s header was set back to {} but reads {read}", top.display(), first.display())]
    NotSetBack {
        top: PathBuf,
        first: PathBuf,
        read: String,
    },
    #[error("layer {0} is not recorded")]
    Unrecorded(String),
    /// A recorded merge that is not settled ([`still_open`]'s words).
    #[error("{0}")]
    Unsettled(String),
}

#[cfg(test)]
mod tests;
