//! Chain compaction: merging the layers nobody needs any more into the
//! layer above them, so a disk with a long snapshot history reads through a
//! short chain again (`docs/snapshots.md`, "Compaction").
//!
//! The pure core decides *what* may be merged ([`plan`]) and how a merge a
//! crash interrupted is settled ([`decide`]); the async shell below does the
//! I/O: `qemu-img rebase` for a disk no QEMU runs, a QMP `block-stream` job
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
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_api::{EventType, Kind};
use serde_json::{Value, json};

use super::overlays::{self, OverlayError};
use super::storage::{self, Layer};
use hearth_qemu::img::ImgError;
use hearth_qemu::process::ProcessIdentity;
use hearth_qemu::qmp::QmpError;

use crate::context::Context;
use crate::store::journals::{self, Of};
use crate::store::layers::{self, Roots};
use crate::store::{Store, StoreError};
use crate::vm::live::LiveVm;

const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest one offline merge (`qemu-img rebase`) may take.
const REBASE_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// How often a running stream job's progress is read.
const POLL: Duration = Duration::from_millis(100);

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

impl From<CompactionError> for Skip {
    fn from(e: CompactionError) -> Skip {
        Skip::from(e.to_string())
    }
}

/// What the top layer's header names as its backing file.
async fn header_backing(path: &Path) -> Result<Option<PathBuf>, CompactionError> {
    let info = hearth_qemu::img::info(path)
        .await
        .map_err(|source| CompactionError::Info {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(info.backing_filename.map(|b| {
        let b = PathBuf::from(b);
        if b.is_relative() {
            path.parent().map(|d| d.join(&b)).unwrap_or(b)
        } else {
            b
        }
    }))
}

/// What the top's header names, as a [`Header`] of merge `i`.
async fn header_of(i: &Intent) -> Header {
    let first = i.gone.first().map(|l| l.path.clone()).unwrap_or_default();
    match header_backing(&i.top.path).await {
        Ok(b) => Header::of(b.as_deref(), &i.base.path, &first),
        Err(e) => Header::Other(e.to_string()),
    }
}

/// What is known of merge `i`'s writer: how the `qemu-img` this daemon ran
/// ended (`exited`, when it did), else QEMU's job when `live` runs it, else
/// whether a process still holds the top open.
async fn writer_of(live: Option<&LiveVm>, i: &Intent, exited: Option<bool>) -> Writer {
    if let Some(ok) = exited {
        return Writer::Exited { ok };
    }
    let (Some(job), Some(l)) = (&i.job, live) else {
        // Offline, or its QEMU is gone: a process holding the top (a
        // `qemu-img` a dead daemon started) may still write it.
        return if storage::open_files().contains(&i.top.path) {
            Writer::Running
        } else {
            Writer::Gone
        };
    };
    if let Some(q) = &i.qemu
        && *q != l.record.process
    {
        // Launches settle merges first, so this should not happen; the new
        // QEMU cannot be asked to flush what the old one cached.
        return Writer::Unknown(format!(
            "the merge ran in QEMU process {}, but process {} runs the VM now",
            q.pid, l.record.process.pid
        ));
    }
    let Some(qmp) = l.qmp.as_ref() else {
        return Writer::Unknown("no QMP connection to the VM".into());
    };
    match qmp.execute("query-jobs", None, QMP_TIMEOUT).await {
        Ok(jobs) => match jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j["id"] == job.as_str()))
        {
            Some(j) if j["status"] == "concluded" || j["status"] == "null" => {
                // A job of an older hearthd that did not dismiss itself:
                // QEMU 10.0.2 crashes on a graph query while it waits.
                let _ = qmp
                    .execute("job-dismiss", Some(json!({"id": job})), QMP_TIMEOUT)
                    .await;
                Writer::Qemu {
                    job_running: false,
                    flushed: false,
                }
            }
            Some(_) => Writer::Qemu {
                job_running: true,
                flushed: false,
            },
            None => Writer::Qemu {
                job_running: false,
                flushed: false,
            },
        },
        Err(e) => Writer::Unknown(format!("query-jobs: {e}")),
    }
}

/// Whether merge `i` writes into its disk's head (else into a kept layer,
/// which QEMU holds read-only but for the job).
fn into_head(store: &Store, i: &Intent) -> bool {
    storage::head(store, &i.disk)
        .ok()
        .flatten()
        .is_some_and(|h| h.id == i.top.id)
}

/// Asks QEMU to flush the top of merge `i` to its file and the disk: a
/// `blockdev-reopen` of its qcow2 node with the options it has (the same
/// file node, `backing` the base's node), which QEMU begins by flushing
/// the node — its metadata cache, where the job's new L2 entries may be,
/// then the file (`fdatasync`) — and refuses to do when that fails. So an
/// answer `{}` is a flush seen to complete. `read_only` reopens a kept
/// layer read-only in the same step.
async fn flush_top(live: &LiveVm, i: &Intent, read_only: bool) -> Result<(), CompactionError> {
    let qmp = live.qmp.as_ref().ok_or(CompactionError::NoQmp)?;
    let nodes = overlays::named_nodes(qmp).await?;
    let qcow2_of = |path: &Path| {
        let mut of: Vec<&overlays::NodeInfo> = nodes
            .iter()
            .filter(|n| n.driver == "qcow2" && n.file == path.to_string_lossy())
            .collect();
        // A writable node is the one a job wrote through.
        of.sort_by_key(|n| n.read_only);
        of.first().map(|n| n.node.clone())
    };
    let top =
        qcow2_of(&i.top.path).ok_or_else(|| CompactionError::NoLayerNode(i.top.path.clone()))?;
    let base =
        qcow2_of(&i.base.path).ok_or_else(|| CompactionError::NoLayerNode(i.base.path.clone()))?;
    let file =
        overlays::file_child(&top).ok_or_else(|| CompactionError::NoFileNode(top.clone()))?;
    qmp.execute(
        "blockdev-reopen",
        Some(json!({"options": [{
            "driver": "qcow2",
            "node-name": top,
            "file": file,
            "backing": base,
            "read-only": read_only,
        }]})),
        QMP_TIMEOUT,
    )
    .await
    .map(|_| ())
    .map_err(|source| CompactionError::Reopen { node: top, source })
}

/// Sets the top's header back to the first merged layer (`qemu-img rebase
/// -u`: the header alone), reads it back, then frees what a killed writer
/// allocated and never referenced (`qemu-img check -r leaks`). Only when no
/// process holds the top.
async fn undo(i: &Intent) -> Result<(), CompactionError> {
    let first = i.gone.first().ok_or(CompactionError::NoMergedLayer(i.id))?;
    if storage::open_files().contains(&i.top.path) {
        return Err(CompactionError::TopOpen(i.top.path.clone()));
    }
    hearth_qemu::img::set_backing(&i.top.path, &first.path, "qcow2").await?;
    match header_of(i).await {
        Header::FirstGone => {}
        other => {
            return Err(CompactionError::NotSetBack {
                top: i.top.path.clone(),
                first: first.path.clone(),
                read: format!("{other:?}"),
            });
        }
    }
    if let Err(e) = hearth_qemu::img::repair_leaks(&i.top.path).await {
        // Leaked clusters waste space; they never change what is read.
        tracing::warn!(id = i.id, error = %e, "cannot free the clusters a killed merge leaked");
    }
    Ok(())
}

/// Settles recorded merges: `live` is the running QEMU of their VM, or
/// `None` when none runs; `exited` how the `qemu-img` this daemon ran for
/// them ended, when it did. Returns each intent's outcome (a failure to
/// record one is `Unresolved`).
pub async fn settle(
    ctx: &Context,
    live: Option<&LiveVm>,
    intents: &[Intent],
    exited: Option<bool>,
) -> Vec<(i64, Settle)> {
    let mut out = Vec::new();
    for i in intents {
        let header = header_of(i).await;
        let mut writer = writer_of(live, i, exited).await;
        let kept = !into_head(&ctx.store, i);
        let mut settled = decide(&header, &writer);
        if let (Settle::Flush, Some(l)) = (&settled, live) {
            writer = match flush_top(l, i, kept).await {
                Ok(()) => Writer::Qemu {
                    job_running: false,
                    flushed: true,
                },
                Err(e) => Writer::Unknown(format!("flushing {}: {e}", i.top.path.display())),
            };
            settled = decide(&header, &writer);
        }
        if kept
            && let (
                Some(l),
                Writer::Qemu {
                    job_running: false, ..
                },
            ) = (live, &writer)
            && let Err(e) = back_to_read_only(l, &i.top).await
        {
            // QEMU may write a kept layer only while a merge into it runs:
            // the record stays until it holds the layer read-only again.
            settled = Settle::Unresolved(format!(
                "giving QEMU {} read-only again: {e}",
                i.top.path.display()
            ));
        }
        let mut undone = false;
        if settled == Settle::Undo {
            settled = match undo(i).await {
                Ok(()) => {
                    undone = true;
                    Settle::Abandoned
                }
                Err(e) => Settle::Unresolved(e.to_string()),
            };
        }
        tracing::info!(id = i.id, disk = %i.disk, ?header, ?writer, ?settled, "settling a compaction");
        if matches!(settled, Settle::Done | Settle::Abandoned) {
            // Progress a dead daemon showed is over.
            ctx.set_disk_status(&i.disk, |s| s.compaction = None);
        }
        match &settled {
            Settle::Done => {
                if let Some(l) = live {
                    drop_nodes(l, &i.gone).await;
                }
                match finish(&ctx.store, i) {
                    Ok(freed) => {
                        ctx.event(
                            Kind::VirtualDisk,
                            &i.disk,
                            EventType::Normal,
                            "Compacted",
                            &format!(
                                "compaction {}: {} layer(s) merged into {}, now backed by {}; {} file(s) removed",
                                i.id,
                                i.gone.len(),
                                i.top.id,
                                i.base.id,
                                freed.len()
                            ),
                        );
                        ctx.wake(Kind::VirtualDisk, &i.disk);
                    }
                    Err(e) => {
                        settled = Settle::Unresolved(format!("recording compaction {}: {e}", i.id))
                    }
                }
            }
            Settle::Abandoned => {
                let message = if undone {
                    format!(
                        "compaction {} switched {}'s header to {} but its writer ended without \
                         proof that the merged data is referenced; the header is set back to {}, \
                         the chain reads as before and is merged again later",
                        i.id,
                        i.top.id,
                        i.base.id,
                        i.gone.first().map(|l| l.id.as_str()).unwrap_or("?")
                    )
                } else {
                    format!(
                        "compaction {} ended without switching {} to {}; the chain is unchanged and is merged again later",
                        i.id, i.top.id, i.base.id
                    )
                };
                ctx.event(
                    Kind::VirtualDisk,
                    &i.disk,
                    EventType::Warning,
                    "CompactionAbandoned",
                    &message,
                );
                if let Err(e) = forget(&ctx.store, i.id) {
                    settled = Settle::Unresolved(format!("forgetting compaction {}: {e}", i.id));
                }
            }
            Settle::Wait | Settle::Unresolved(_) | Settle::Flush | Settle::Undo => {}
        }
        out.push((i.id, settled));
    }
    out
}

/// Why a settled merge is still open, if it is.
fn still_open(id: i64, disk: &str, s: &Settle) -> Option<String> {
    match s {
        Settle::Done | Settle::Abandoned => None,
        Settle::Wait => Some(format!(
            "compaction {id} of VirtualDisk {disk:?} is still running"
        )),
        Settle::Flush | Settle::Undo => Some(format!(
            "compaction {id} of VirtualDisk {disk:?} is not settled yet"
        )),
        Settle::Unresolved(why) => Some(format!("compaction {id} of VirtualDisk {disk:?}: {why}")),
    }
}

/// Settles the merges of `disks` when no QEMU of theirs runs (before a VM
/// is launched, so it boots from a header the store agrees with).
pub async fn settle_offline(ctx: &Context, disks: &[String]) -> Result<(), CompactionError> {
    for d in disks {
        let intents = intents_of_disk(&ctx.store, d)?;
        for (id, s) in settle(ctx, None, &intents, None).await {
            if let Some(why) = still_open(id, d, &s) {
                return Err(CompactionError::Unsettled(why));
            }
        }
    }
    Ok(())
}

/// Deletes QEMU's nodes of merged layers (format nodes first, then the
/// `file` nodes under them) and their fd sets. QEMU refuses to delete a
/// node in use; a failure only means the file stays open, and an open file
/// is never unlinked.
async fn drop_nodes(live: &LiveVm, gone: &[Layer]) {
    let Some(qmp) = live.qmp.as_ref() else { return };
    let Ok(nodes) = overlays::named_nodes(qmp).await else {
        return;
    };
    for layer in gone {
        let path = layer.path.to_string_lossy();
        let mut mine: Vec<&overlays::NodeInfo> = nodes.iter().filter(|n| n.file == path).collect();
        // Format nodes (qcow2) before the protocol nodes they sit on.
        mine.sort_by_key(|n| n.driver == "file");
        for n in mine {
            let file = (n.driver == "file").then_some(layer.path.as_path());
            let r = hearth_qemu::qmp::remove_node(qmp, &n.node, file, QMP_TIMEOUT).await;
            if let Err(e) = r {
                tracing::warn!(node = %n.node, error = %e, "cannot delete the node of a merged layer");
            }
        }
    }
}

/// A request to give the VM's locks back: a stop, start or restore of the
/// VM asks (`Actors::ask_to_yield`) by bumping its target's counter; a
/// merge that saw another value when it began cancels its job.
#[derive(Clone, Debug)]
pub struct Yield {
    pub epoch: Arc<std::sync::atomic::AtomicU64>,
    pub seen: u64,
}

impl Yield {
    pub fn asked(&self) -> bool {
        self.epoch.load(std::sync::atomic::Ordering::SeqCst) != self.seen
    }
}

/// What one compaction of a disk did.
#[derive(Debug, Default)]
pub struct Report {
    pub merged_layers: usize,
    /// Runs left for later, with the reason.
    pub skipped: Vec<String>,
    /// Merges that were started and ended without switching.
    pub failed: usize,
}

/// Why one merge did not happen: left for later before it started, or
/// started and ended without switching (`failed`).
#[derive(Debug)]
struct Skip {
    why: String,
    failed: bool,
}

impl From<String> for Skip {
    fn from(why: String) -> Skip {
        Skip { why, failed: false }
    }
}

impl From<OverlayError> for Skip {
    fn from(e: OverlayError) -> Skip {
        Skip::from(e.to_string())
    }
}

impl From<&str> for Skip {
    fn from(why: &str) -> Skip {
        Skip::from(why.to_string())
    }
}

/// Compacts `disk`'s chain. Runs in the snapshot actor of `target`, which
/// holds the operations locks of the VM and its disks (so no cut, start,
/// stop, restore or delete runs meanwhile); `live` is the VM's running QEMU.
pub async fn compact_disk(
    ctx: &Arc<Context>,
    target: &str,
    live: Option<&LiveVm>,
    disk: &str,
    speed: u64,
    yield_to: &Yield,
) -> Result<Report, CompactionError> {
    let mut report = Report::default();
    let intents = intents_of_disk(&ctx.store, disk)?;
    if let Some(l) = live {
        // A job a dead daemon started may still run in QEMU: follow it to
        // its end (it holds this actor, as it did the one that started it).
        for i in &intents {
            if i.job.is_some()
                && matches!(
                    writer_of(live, i, None).await,
                    Writer::Qemu {
                        job_running: true,
                        ..
                    }
                )
            {
                tracing::info!(
                    id = i.id,
                    disk,
                    "following a compaction job started before a restart"
                );
                follow_job(ctx, l, disk, i.id, i.gone.len(), yield_to).await;
            }
        }
    }
    // Then settled as any: flushed, a kept layer given back read-only.
    let settled = settle(ctx, live, &intents, None).await;
    if let Some(why) = settled.iter().find_map(|(id, s)| still_open(*id, disk, s)) {
        report.skipped.push(why);
        return Ok(report);
    }
    if !overlays::of_disk::<overlays::Overlay>(&ctx.store, disk)?.is_empty() {
        report
            .skipped
            .push("a snapshot cut's overlay is not settled yet".into());
        return Ok(report);
    }
    let Some(head) = storage::head(&ctx.store, disk)? else {
        return Ok(report);
    };
    let chains = chains(&ctx.store)?;
    let device = live.and_then(|l| overlays::device_index(l, disk).map(|i| (l, i)));
    for m in plan(&chains, &head.id) {
        if yield_to.asked() {
            report
                .skipped
                .push("a stop, start or restore of the VM asks for its locks".into());
            break;
        }
        let layer = |id: &str| -> Result<Layer, CompactionError> {
            ctx.store
                .with_tx(|tx| storage::layer_tx(tx, id))?
                .ok_or_else(|| CompactionError::Unrecorded(id.to_string()))
        };
        let top = layer(&m.top)?;
        let base = layer(&m.base)?;
        let outcome = match device {
            Some((l, index)) => {
                let into = if m.top == head.id {
                    MergeInto::Head(index)
                } else {
                    MergeInto::Layer
                };
                stream(ctx, target, l, into, disk, &m, &top, &base, speed, yield_to).await
            }
            None => rebase(ctx, target, disk, &m, &top, &base, yield_to).await,
        };
        match outcome {
            Ok(()) => report.merged_layers += m.gone.len(),
            Err(skip) => {
                report.failed += usize::from(skip.failed);
                report.skipped.push(skip.why);
            }
        }
    }
    Ok(report)
}

/// Offline: `qemu-img rebase` of the top onto the base. Only when nothing
/// has the top open (another VM restored from it, an export reading it).
/// A start or restore of the VM that asks for the locks kills the rebase
/// (safe mode writes the new backing name last: the top reads as before)
/// and the merge is done again later, online.
async fn rebase(
    ctx: &Arc<Context>,
    target: &str,
    disk: &str,
    m: &Merge,
    top: &Layer,
    base: &Layer,
    yield_to: &Yield,
) -> Result<(), Skip> {
    let pins = pin_readers(ctx, top)?;
    if storage::open_files().contains(&top.path) {
        return Err(format!(
            "{} is open by a process (a VM restored from it, or an export): left for later",
            top.path.display()
        )
        .into());
    }
    let id = record(&ctx.store, target, disk, m, None).map_err(|e| e.to_string())?;
    ctx.event(
        Kind::VirtualDisk,
        disk,
        EventType::Normal,
        "CompactionStarted",
        &format!(
            "compaction {id}: merging {} layer(s) into {} offline (qemu-img rebase onto {})",
            m.gone.len(),
            m.top,
            m.base
        ),
    );
    let started = Instant::now();
    let mut run = Box::pin(hearth_qemu::img::rebase(
        &top.path,
        &base.path,
        "qcow2",
        REBASE_TIMEOUT,
    ));
    let result = loop {
        tokio::select! {
            r = &mut run => break Some(r),
            () = tokio::time::sleep(POLL) => if yield_to.asked() { break None; },
        }
    };
    // Only an exit 0 proves the merge: qemu-img writes the new header
    // before the L2 tables that reference what it copied.
    let (cancelled, ok) = match result {
        Some(Err(e)) => {
            tracing::warn!(id, disk, error = %e, "qemu-img rebase failed");
            (false, false)
        }
        Some(Ok(())) => (false, true),
        None => {
            tracing::info!(
                id,
                disk,
                "killing a qemu-img rebase: the VM's locks are asked for"
            );
            // Dropping the run kills qemu-img; settled once it is gone (a
            // process still holding the top counts as a running merge).
            drop(run);
            let deadline = Instant::now() + Duration::from_secs(10);
            while storage::open_files().contains(&top.path) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (true, false)
        }
    };
    let settled = settle_one(ctx, None, disk, id, started, Some(ok)).await;
    drop(pins);
    match settled {
        Err(skip) if cancelled && skip.failed => Err(Skip::from(format!(
            "compaction {id} was cancelled for a start or restore of the VM; merged again later"
        ))),
        other => other,
    }
}

/// Takes the export pins of every snapshot whose chain holds `top`, for as
/// long as a merge writes into it. An export reads a snapshot's chain with
/// `qemu-img convert -U`, which takes no lock and must not see the top's
/// metadata change under it: an export running now holds its pin (the
/// merge waits for a later chance); one that starts meanwhile waits for
/// the merge.
fn pin_readers(
    ctx: &Context,
    top: &Layer,
) -> Result<Vec<tokio::sync::OwnedRwLockWriteGuard<()>>, Skip> {
    let chains = chains(&ctx.store).map_err(|e| e.to_string())?;
    let readers: Vec<String> = layers::snapshot_layers(&ctx.store)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|(_, layer)| chains.chain(layer).contains(&top.id))
        .map(|(s, _)| s)
        .collect();
    let mut pins = Vec::new();
    for s in &readers {
        match ctx.exports.of(s).try_write_owned() {
            Ok(p) => pins.push(p),
            Err(_) => {
                return Err(format!(
                    "an export of VirtualDiskSnapshot {s:?} reads {}: left for later",
                    top.path.display()
                )
                .into());
            }
        }
    }
    Ok(pins)
}

/// Where an online merge writes: into the head the guest writes (the
/// device's top node, at this device index), or into a kept layer under
/// it (a snapshot's), which QEMU holds read-only.
#[derive(Clone, Copy, Debug)]
enum MergeInto {
    Head(usize),
    Layer,
}

/// Online: a `block-stream` job on the device's top node with the base as
/// its base node; the job's progress goes to the disk's status.
#[allow(clippy::too_many_arguments)]
async fn stream(
    ctx: &Arc<Context>,
    target: &str,
    live: &LiveVm,
    into: MergeInto,
    disk: &str,
    m: &Merge,
    top: &Layer,
    base: &Layer,
    speed: u64,
    yield_to: &Yield,
) -> Result<(), Skip> {
    let qmp = live.qmp.as_ref().ok_or("no QMP connection to the VM")?;
    let nodes = overlays::named_nodes(qmp).await?;
    let node_of = |path: &Path| {
        nodes
            .iter()
            .find(|n| n.driver == "qcow2" && n.file == path.to_string_lossy())
            .map(|n| n.node.clone())
    };
    let top_node = node_of(&top.path)
        .ok_or_else(|| format!("QEMU has no node of layer {}", top.path.display()))?;
    if let MergeInto::Head(index) = into {
        let graph = overlays::Graph::read(live).await?;
        let device_top = graph
            .top_node(index)
            .ok_or_else(|| format!("QEMU has no device for VirtualDisk {disk:?}"))?;
        if device_top != top_node {
            return Err(format!(
                "QEMU's device of VirtualDisk {disk:?} does not write to its recorded head {}",
                top.path.display()
            )
            .into());
        }
    }
    let base_node = node_of(&base.path)
        .ok_or_else(|| format!("QEMU has no node of layer {}", base.path.display()))?;
    let pins = pin_readers(ctx, top)?;
    if let MergeInto::Layer = into {
        // A snapshot's layer may be read by others: a VM restored from it,
        // an export. QEMU's lock refuses the write while one with locking
        // reads it; this also covers readers without locks.
        let readers = nodes
            .iter()
            .filter(|n| n.driver == "qcow2" && n.file == top.path.to_string_lossy())
            .count();
        if readers > 1 {
            // Another disk of this VM reads the layer too (restored from
            // the same snapshot), through its own node.
            return Err(format!(
                "{} is read by {readers} nodes of the VM's QEMU (another disk reads it): left for later",
                top.path.display()
            )
            .into());
        }
        let pid = live.record.process.pid;
        if storage::open_files_except(Some(pid)).contains(&top.path) {
            return Err(format!(
                "{} is open by a process other than the VM's QEMU (a VM restored from it, \
                 or an export): left for later",
                top.path.display()
            )
            .into());
        }
    }
    // Recorded before QEMU may write anything (a kept layer reopened
    // read-write included): a settle after any crash gives the layer back
    // read-only and decides from the header and the job.
    let id = record(&ctx.store, target, disk, m, Some(&live.record.process))
        .map_err(|e| e.to_string())?;
    if let MergeInto::Layer = into {
        let reopened = match overlays::file_child(&top_node) {
            // QEMU reopens the format node read-write for the job (and back
            // at its end) by itself; its file node and descriptor are
            // hearth's to change.
            Some(file_node) => {
                hearth_qemu::qmp::reopen_file_node(qmp, &file_node, &top.path, false, QMP_TIMEOUT)
                    .await
                    .map_err(|e| e.to_string())
            }
            None => Err(format!(
                "node {top_node} has no file node of hearth's naming"
            )),
        };
        if let Err(e) = reopened {
            // It may have got half-way (reopened, an old descriptor left):
            // the settle gives it back read-only and forgets the record.
            let _ = settle_one(ctx, Some(live), disk, id, Instant::now(), None).await;
            return Err(Skip {
                why: format!(
                    "cannot open layer {} for writing in QEMU: {e}",
                    top.path.display()
                ),
                failed: true,
            });
        }
    }
    let job = job_id(id);
    ctx.event(
        Kind::VirtualDisk,
        disk,
        EventType::Normal,
        "CompactionStarted",
        &format!(
            "compaction {id}: merging {} layer(s) into {} {} (QMP block-stream job {job}, base {})",
            m.gone.len(),
            match into {
                MergeInto::Head(_) => "the running head",
                MergeInto::Layer => "the running VM's kept layer",
            },
            m.top,
            m.base
        ),
    );
    let started = Instant::now();
    let mut args = json!({
        "job-id": job,
        "device": top_node,
        "base-node": base_node,
        // QEMU knows the base by its fd set; the header gets its real path.
        "backing-file": base.path.to_string_lossy(),
        // Never left concluded: QEMU 10.0.2 segfaults on
        // `query-named-block-nodes` while a concluded stream job waits to be
        // dismissed (measured; the head's case too). Its end is settled from
        // the top's header anyway, so nothing needs the concluded job.
        "auto-dismiss": true,
    });
    if speed > 0 {
        args["speed"] = json!(speed);
    }
    if let Err(e) = qmp.execute("block-stream", Some(args), QMP_TIMEOUT).await {
        tracing::warn!(id, disk, error = %e, "block-stream refused");
    }
    let cancelled = follow_job(ctx, live, disk, id, m.gone.len(), yield_to).await;
    // Settling flushes the top (and gives a kept layer back read-only)
    // before anything is recorded or unlinked.
    let settled = settle_one(ctx, Some(live), disk, id, started, None).await;
    drop(pins);
    match settled {
        Err(skip) if cancelled && skip.failed => Err(Skip::from(format!(
            "compaction {id} was cancelled for a stop, start or restore of the VM; merged again later"
        ))),
        other => other,
    }
}

/// Gives QEMU `layer` read-only again after a merge into it: its file node
/// reopened over a read-only descriptor, the read-write one removed. Does
/// nothing when QEMU has no node of it (it never had one to write).
async fn back_to_read_only(live: &LiveVm, layer: &Layer) -> Result<(), CompactionError> {
    let qmp = live.qmp.as_ref().ok_or(CompactionError::NoQmp)?;
    let Some(node) = overlays::named_nodes(qmp)
        .await?
        .into_iter()
        .find(|n| n.driver == "qcow2" && n.file == layer.path.to_string_lossy())
    else {
        return Ok(());
    };
    let file = overlays::file_child(&node.node)
        .ok_or_else(|| CompactionError::NoFileNode(node.node.clone()))?;
    Ok(hearth_qemu::qmp::reopen_file_node(qmp, &file, &layer.path, true, QMP_TIMEOUT).await?)
}

/// Waits for merge `id`'s QMP job to end, showing its progress in the
/// disk's status (`compaction`), read from `query-jobs`.
/// Cancels the job (`block-job-cancel`) when a stop, start or restore of
/// the VM asks for its locks; true then.
async fn follow_job(
    ctx: &Context,
    live: &LiveVm,
    disk: &str,
    id: i64,
    layers: usize,
    yield_to: &Yield,
) -> bool {
    let Some(qmp) = live.qmp.as_ref() else {
        return false;
    };
    let job = job_id(id);
    let mut shown = None;
    let mut cancelled = false;
    loop {
        if !cancelled && yield_to.asked() {
            cancelled = true;
            tracing::info!(
                id,
                disk,
                "cancelling a compaction job: the VM's locks are asked for"
            );
            if let Err(e) = qmp
                .execute(
                    "block-job-cancel",
                    Some(json!({"device": job})),
                    QMP_TIMEOUT,
                )
                .await
            {
                tracing::warn!(id, error = %e, "block-job-cancel");
            }
        }
        let jobs = match qmp.execute("query-jobs", None, QMP_TIMEOUT).await {
            Ok(j) => j,
            Err(e) => {
                // Settled by observation below (or after a restart).
                tracing::warn!(id, error = %e, "query-jobs failed");
                break;
            }
        };
        let Some(j) = jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j["id"] == job.as_str()))
            .cloned()
        else {
            break;
        };
        if j["status"] == "concluded" || j["status"] == "null" {
            if let Some(e) = j.get("error").and_then(Value::as_str) {
                tracing::warn!(id, disk, error = e, "the stream job failed");
            }
            break;
        }
        let done = j["current-progress"].as_u64().unwrap_or(0);
        let total = j["total-progress"].as_u64().unwrap_or(0);
        if shown != Some((done, total)) {
            shown = Some((done, total));
            ctx.set_disk_status(disk, |s| {
                s.compaction = Some(hearth_api::CompactionProgress {
                    id: id as u64,
                    layers: layers as u32,
                    bytes_done: done,
                    bytes_total: total,
                });
            });
        }
        tokio::time::sleep(POLL).await;
    }
    ctx.set_disk_status(disk, |s| s.compaction = None);
    cancelled
}

/// Settles merge `id` of `disk` right after its job or qemu-img ended
/// (`exited`: how the qemu-img ended).
async fn settle_one(
    ctx: &Arc<Context>,
    live: Option<&LiveVm>,
    disk: &str,
    id: i64,
    started: Instant,
    exited: Option<bool>,
) -> Result<(), Skip> {
    let intents: Vec<Intent> = intents_of_disk(&ctx.store, disk)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|i| i.id == id)
        .collect();
    let settled = settle(ctx, live, &intents, exited).await;
    tracing::info!(
        id,
        elapsed_ms = started.elapsed().as_millis() as u64,
        ?settled,
        "compaction ended"
    );
    match settled.first() {
        Some((_, Settle::Done)) => Ok(()),
        Some((_, Settle::Abandoned)) => Err(Skip {
            why: format!("compaction {id} failed; nothing changed"),
            failed: true,
        }),
        Some((_, s)) => Err(still_open(id, disk, s).unwrap_or_default().into()),
        None => Err(format!("compaction {id} is not recorded").into()),
    }
}

#[cfg(test)]
mod tests;
