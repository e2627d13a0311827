//! Settling a recorded merge: reading the top's header and what is known
//! of its writer, flushing or undoing as [`decide`] says, then recording
//! the merge as done or forgetting it (after a crash too).

use std::path::{Path, PathBuf};

use hearth_api::{EventType, Kind};
use serde_json::json;

use super::super::overlays;
use super::super::storage::{self, Layer};
use super::{
    CompactionError, Header, Intent, QMP_TIMEOUT, Settle, Writer, decide, finish, forget,
    intents_of_disk,
};
use crate::context::Context;
use crate::store::Store;
use crate::vm::live::LiveVm;

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
pub(super) async fn writer_of(live: Option<&LiveVm>, i: &Intent, exited: Option<bool>) -> Writer {
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
pub(super) fn still_open(id: i64, disk: &str, s: &Settle) -> Option<String> {
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
