//! Running a merge: `compact_disk` walks the plan of a disk's chain and
//! merges each run of unneeded layers, offline with `qemu-img rebase` or
//! online with a QMP `block-stream` job, then settles what it started.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_api::{EventType, Kind};
use serde_json::{Value, json};

use super::super::overlays::{self, OverlayError};
use super::super::storage::{self, Layer};
use super::settle::{settle, still_open, writer_of};
use super::{
    CompactionError, Intent, Merge, QMP_TIMEOUT, Settle, Writer, chains, intents_of_disk, job_id,
    plan, record,
};
use crate::context::Context;
use crate::store::layers;
use crate::vm::live::LiveVm;

/// The longest one offline merge (`qemu-img rebase`) may take.
const REBASE_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// How often a running stream job's progress is read.
const POLL: Duration = Duration::from_millis(100);

impl From<CompactionError> for Skip {
    fn from(e: CompactionError) -> Skip {
        Skip::from(e.to_string())
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
/// (it writes the new backing name before the L2 tables, so the settle
/// undoes a killed one: `compaction::decide`) and the merge is done again
/// later, online.
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
