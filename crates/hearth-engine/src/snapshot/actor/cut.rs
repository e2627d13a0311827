//! The cut's work on the running QEMU and its guest agent: how a target is
//! reached, its overlays made ready and added as nodes, the transaction, the
//! observation of whether it ran, and the discard. Apart from the loop, which
//! only orders these steps, and from the store commit.

use std::collections::HashMap;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use hearth_api::{EventType, Kind, Object};
use hearth_qemu::fsmap::MountMap;
use hearth_qemu::seam::Monitor;
use serde_json::{Value, json};

use super::errors::{MountsError, NodeError, PrepareError};
use super::steps::{self, with_agent};
use super::target::{lock_target, vm_event};
use crate::context::Context;
use crate::snapshot::coordinator::{Access, AgentFault, CutId, Mounts, TxResult};
use crate::snapshot::expedite;
use crate::snapshot::overlays::{self, Ahead, Graph, Overlay, Settled};
use crate::snapshot::storage::{self, Layer};
use crate::store::Store;
use crate::vm::live::LiveVm;

/// How long a cut waits for a just-started guest's agent before giving up.
pub(super) const AGENT_WAIT: Duration = Duration::from_secs(20);
pub(super) const QMP_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything a cut in progress holds in memory.
#[derive(Default)]
pub(super) struct CutContext {
    pub(super) live: Option<Arc<LiveVm>>,
    pub(super) prepared: Vec<Prepared>,
    pub(super) guards: Vec<tokio::sync::OwnedMutexGuard<()>>,
    pub(super) freeze_started: Option<chrono::DateTime<Utc>>,
    /// Which of the guest's filesystems lie on which disk (live cuts with an
    /// agent), read before the freeze; the error when the agent could not say.
    pub(super) mounts: Option<Result<MountMap, MountsError>>,
    /// What the step before the freeze did (live cuts with an agent).
    pub(super) expedited: Option<expedite::Outcome>,
    /// The cut's snapshots show InProgress.
    pub(super) in_progress: bool,
    /// The `Thawed` event, written with the commit: when, and its message.
    pub(super) thawed: Option<(chrono::DateTime<Utc>, String)>,
}

pub(super) struct Prepared {
    pub(super) disk: String,
    pub(super) overlay: Overlay,
    pub(super) old_head: Layer,
    /// The node the overlay goes on top of (live cuts).
    pub(super) top_node: Option<String>,
    /// The overlay's device index in the running QEMU (live cuts).
    pub(super) device: Option<usize>,
    pub(super) capacity: u64,
    /// The overlay was made ahead and this cut has not claimed it in the
    /// store yet: until then its record is the ahead one.
    pub(super) ahead: Option<overlays::Ahead>,
}

/// Waits, holding no lock, until the VM's guest agent answers, the VM does
/// not run (or has no agent), or `deadline`.
pub(super) async fn wait_for_agent(
    ctx: &Arc<Context>,
    target: &str,
    deadline: tokio::time::Instant,
) {
    let Some(vm) = target.strip_prefix("vm/") else {
        return;
    };
    while tokio::time::Instant::now() < deadline {
        let wants_agent = matches!(
            ctx.store.get(Kind::VirtualMachine, vm),
            Ok(Some(s)) if matches!(&s.object, Object::VirtualMachine(v) if v.spec.guest_agent)
        );
        let running = matches!(
            ctx.store.runtime(vm),
            Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process)
        );
        if !wants_agent || !running || ctx.live_agent_connected(vm) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How the target can be reached right now, waiting for the guest agent
/// until `agent_deadline`. Called with the target's operations lock held, so
/// the VM cannot start or stop meanwhile.
pub(super) async fn access(
    ctx: &Arc<Context>,
    target: &str,
    agent_deadline: tokio::time::Instant,
) -> (Access, Option<Arc<LiveVm>>) {
    let Some(vm) = target.strip_prefix("vm/") else {
        return (Access::Offline, None);
    };
    let Ok(Some(stored)) = ctx.store.get(Kind::VirtualMachine, vm) else {
        return (Access::Offline, None);
    };
    let Object::VirtualMachine(spec) = &stored.object else {
        return (Access::Offline, None);
    };
    let record = match ctx.store.runtime(vm) {
        Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process) => r,
        _ => return (Access::Offline, None),
    };
    let live = ctx.ensure_live(&record).await;
    if !spec.spec.guest_agent {
        return (
            Access::NoAgent("spec.guestAgent is false".into()),
            Some(live),
        );
    }
    if let Some(qmp) = &live.qmp
        && let Ok(status) = qmp.query_status(QMP_TIMEOUT).await
        && status != "running"
    {
        return (
            Access::NoAgent(format!(
                "the VM is not running its vCPUs (QEMU status {status})"
            )),
            Some(live),
        );
    }
    if !steps::await_agent(&live.agent_connected, agent_deadline).await {
        return (
            Access::NoAgent(format!(
                "the guest agent does not answer (waited {} s)",
                AGENT_WAIT.as_secs()
            )),
            Some(live),
        );
    }
    (Access::Agent, Some(live))
}

/// The live VM of a target, if its process runs.
pub(super) async fn live_of(ctx: &Arc<Context>, target: &str) -> Option<Arc<LiveVm>> {
    let vm = target.strip_prefix("vm/")?;
    match ctx.store.runtime(vm) {
        Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process) => {
            Some(ctx.ensure_live(&r).await)
        }
        _ => None,
    }
}

/// Makes every disk's overlay ready before any freeze: recorded in the
/// store first, then the file, then (live) its QEMU node. Returns the disks
/// that could not be prepared, with why; the others go on.
pub(super) async fn prepare(
    ctx: &Arc<Context>,
    target: &str,
    held: &mut CutContext,
    cut: CutId,
    disks: &[String],
) -> Vec<(String, String)> {
    let state_dir = ctx.config.state_dir.clone();
    if let Err(e) = std::fs::create_dir_all(storage::layers_dir(&state_dir)) {
        return disks.iter().map(|d| (d.clone(), e.to_string())).collect();
    }
    // Overlays an earlier cut left unsettled are settled first: a disk's
    // head must be known before another layer goes on top of it.
    let Some(live) = held.live.clone() else {
        if let Err(e) = overlays::settle_offline(&ctx.store, disks).await {
            return disks.iter().map(|d| (d.clone(), e.to_string())).collect();
        }
        let mut failed = Vec::new();
        for disk in disks {
            match prepare_disk(ctx, target, None, None, None, cut, disk).await {
                Ok(p) => held.prepared.push(p),
                Err(why) => failed.push((disk.clone(), why.to_string())),
            }
        }
        return failed;
    };
    if let Ok(left) = overlays::of_target(&ctx.store, target)
        && !left.is_empty()
    {
        overlays::settle(&ctx.store, Some(&live), &left).await;
    }
    // The guest's filesystems are asked for while the overlays are made,
    // and the disks' overlays are made side by side: the agent, QMP and the
    // overlay files do not wait for one another.
    let agent = live
        .agent_connected
        .load(std::sync::atomic::Ordering::SeqCst);
    let mounts = async {
        if agent {
            Some(filesystems_by_disk(&live).await)
        } else {
            None
        }
    };
    // The step that makes the guest's freeze cheaper, beside the rest.
    let expedite = expedite_wanted(ctx, target);
    let expedited = async {
        match (agent, expedite) {
            (false, _) => None,
            (true, true) => Some(expedite_freeze(&live).await),
            (true, false) => Some(expedite::Outcome::Skipped(
                "spec.expediteFreeze is false".to_string(),
            )),
        }
    };
    let overlays = async {
        let graph = Graph::read(&live).await.map_err(PrepareError::Overlays)?;
        // Only needed to check overlays made ahead.
        let named = if disks
            .iter()
            .any(|d| overlays::of_disk::<Ahead>(&ctx.store, d).is_ok_and(|a| !a.is_empty()))
        {
            Some(named_nodes(&live).await?)
        } else {
            None
        };
        let each = disks.iter().map(|disk| {
            prepare_disk(
                ctx,
                target,
                Some(&live),
                Some(&graph),
                named.as_ref(),
                cut,
                disk,
            )
        });
        Ok::<_, PrepareError>(futures_util::future::join_all(each).await)
    };
    let (mounts, made, expedited) = tokio::join!(mounts, overlays, expedited);
    held.mounts = mounts;
    if let Some(o) = &expedited {
        tracing::info!(target, cut, outcome = ?o, "before the freeze");
    }
    held.expedited = expedited;
    let made = match made {
        Ok(m) => m,
        Err(e) => return disks.iter().map(|d| (d.clone(), e.to_string())).collect(),
    };
    let mut failed = Vec::new();
    for (disk, m) in disks.iter().zip(made) {
        match m {
            Ok(p) => held.prepared.push(p),
            Err(why) => failed.push((disk.clone(), why.to_string())),
        }
    }
    failed
}

/// Runs [`expedite::SCRIPT`] in the guest, bounded by [`expedite::BUDGET`]
/// in all: the agent's calls get what is left of it, and the channel is let
/// go between the status polls, so `guest-get-fsinfo` goes on meanwhile.
async fn expedite_freeze(live: &LiveVm) -> expedite::Outcome {
    const POLL: Duration = Duration::from_millis(5);
    let deadline = Instant::now() + expedite::BUDGET;
    let left = || deadline.saturating_duration_since(Instant::now());
    let why = |f: AgentFault| match f {
        AgentFault::DisabledWhileFrozen => {
            "the guest agent refuses guest-exec (disabled, e.g. --block-rpcs)".to_string()
        }
        f => format!("guest-exec: {f}"),
    };
    let pid = match with_agent(&live.agent, left(), async |c, t| {
        c.exec_start("/bin/sh", &["-c", expedite::SCRIPT], t).await
    })
    .await
    {
        Ok(pid) => pid,
        Err(f) => return expedite::Outcome::Skipped(why(f)),
    };
    loop {
        if left().is_zero() {
            break;
        }
        match with_agent(&live.agent, left(), async |c, t| {
            c.exec_status(pid, t).await
        })
        .await
        {
            Ok(Some(out)) => {
                return expedite::Outcome::from_exit(out.exit_code, &out.stdout, &out.stderr);
            }
            Ok(None) => tokio::time::sleep(POLL.min(left())).await,
            Err(AgentFault::Timeout) => break,
            Err(f) => return expedite::Outcome::Skipped(why(f)),
        }
    }
    expedite::Outcome::Skipped(format!(
        "the guest's script did not finish within {} ms",
        expedite::BUDGET.as_millis()
    ))
}

/// The guest's filesystems by disk, from `guest-get-fsinfo`, matched to
/// the running QEMU's devices by serial, else by PCI address.
async fn filesystems_by_disk(live: &LiveVm) -> Result<MountMap, MountsError> {
    let fsinfo = with_agent(&live.agent, QMP_TIMEOUT, async |c, t| c.get_fsinfo(t).await)
        .await
        .map_err(MountsError::Agent)?;
    let qmp = live.qmp.as_ref().ok_or(MountsError::NoQmp)?;
    let pci = hearth_qemu::fsmap::disk_pci_addresses(qmp, QMP_TIMEOUT)
        .await
        .map_err(|e| MountsError::Pci(Arc::new(e)))?;
    let serials: Vec<String> = live
        .record
        .disk_names
        .iter()
        .map(|d| hearth_qemu::cmdline::disk_serial(d))
        .collect();
    Ok(hearth_qemu::fsmap::map_mount_points(
        &fsinfo, &serials, &pci,
    ))
}

async fn prepare_disk(
    ctx: &Arc<Context>,
    target: &str,
    live: Option<&Arc<LiveVm>>,
    graph: Option<&Graph>,
    named: Option<&HashMap<String, u64>>,
    cut: CutId,
    disk: &str,
) -> Result<Prepared, PrepareError> {
    let state_dir = &ctx.config.state_dir;
    if overlays::of_disk::<Overlay>(&ctx.store, disk)?
        .iter()
        .any(|o| o.cut != cut)
    {
        return Err(PrepareError::Unsettled(disk.to_string()));
    }
    let head =
        storage::head(&ctx.store, disk)?.ok_or_else(|| PrepareError::NoImage(disk.to_string()))?;
    // The overlay's layer id and its journal row, in one store write.
    let journal = |node: Option<String>| {
        ctx.store
            .with_tx(|tx| {
                let new = storage::allocate_tx(tx, state_dir, disk)?;
                let overlay = Overlay {
                    cut,
                    target: target.to_string(),
                    disk: disk.to_string(),
                    layer: new.id,
                    path: new.path,
                    node,
                    base: head.id.clone(),
                };
                overlays::record_tx(tx, &overlay)?;
                Ok(overlay)
            })
            .map_err(PrepareError::Store)
    };
    let (Some(graph), Some(live)) = (graph, live) else {
        // Offline: the overlay is recorded, then created; the store switches
        // the head at commit.
        let overlay = journal(None)?;
        let info = hearth_qemu::img::info(&head.path)
            .await
            .map_err(PrepareError::Info)?;
        hearth_qemu::img::create_overlay(&overlay.path, &head.path, "qcow2", None)
            .await
            .map_err(|source| PrepareError::CreateOverlay {
                disk: disk.to_string(),
                source,
            })?;
        return Ok(Prepared {
            disk: disk.to_string(),
            overlay,
            old_head: head,
            top_node: None,
            device: None,
            capacity: info.virtual_size,
            ahead: None,
        });
    };
    // The device is the one the running QEMU was started with for this disk.
    let index = overlays::device_index(live, disk)
        .ok_or_else(|| PrepareError::NotAttached(disk.to_string()))?;
    let inserted = graph
        .device(index)
        .ok_or_else(|| PrepareError::NoDevice(disk.to_string()))?;
    let top_node = inserted
        .get("node-name")
        .and_then(Value::as_str)
        .ok_or(PrepareError::NoNodeName)?
        .to_string();
    let capacity = inserted
        .pointer("/image/virtual-size")
        .and_then(Value::as_u64)
        .ok_or(PrepareError::NoVirtualSize)?;
    // The top layer is open through an fd set: its label is the path.
    let qmp = live.qmp.clone().ok_or(PrepareError::NoQmp)?;
    let top_file = overlays::node_file(&qmp, &top_node)
        .await
        .map_err(PrepareError::Overlays)?;
    if !top_file.is_empty() && std::path::Path::new(&top_file) != head.path {
        // QEMU writes to a layer the store does not know as the head. The
        // journal makes this impossible for hearth's own overlays; refuse
        // rather than put a layer over a file of unknown origin.
        return Err(PrepareError::ForeignTop {
            disk: disk.to_string(),
            file: top_file,
            head: head.path.clone(),
        });
    }
    // An overlay made ahead serves when it still fits: over the disk's
    // head, in this QEMU, of the device's size. Else it goes, and one is
    // made now.
    if let Some(a) = overlays::of_disk::<Ahead>(&ctx.store, disk)?.pop() {
        let size = named.and_then(|n| n.get(&a.node).copied());
        match overlays::unusable(&a, &head.id, size, capacity) {
            None => {
                return Ok(Prepared {
                    disk: disk.to_string(),
                    overlay: Overlay {
                        cut,
                        target: target.to_string(),
                        disk: disk.to_string(),
                        layer: a.layer.clone(),
                        path: a.path.clone(),
                        node: Some(a.node.clone()),
                        base: a.base.clone(),
                    },
                    old_head: head,
                    top_node: Some(top_node),
                    device: Some(index),
                    capacity,
                    ahead: Some(a),
                });
            }
            Some(why) => {
                tracing::info!(target, cut, disk, node = %a.node, why, "the overlay made ahead does not fit; replacing it");
                overlays::remove_ahead(&ctx.store, Some(live), &a)
                    .await
                    .map_err(|why| PrepareError::RemoveAhead {
                        disk: disk.to_string(),
                        why,
                    })?;
            }
        }
    }
    let node = format!("h{cut}d{index}");
    let overlay = journal(Some(node.clone()))?;
    add_overlay_node(
        live.qmp.as_ref(),
        &overlay.path,
        &head.path,
        capacity,
        &node,
    )
    .await
    .map_err(|source| PrepareError::Node {
        disk: disk.to_string(),
        source: Box::new(source),
    })?;
    Ok(Prepared {
        disk: disk.to_string(),
        overlay,
        old_head: head,
        top_node: Some(top_node),
        device: Some(index),
        capacity,
        ahead: None,
    })
}

/// The virtual size of every named block node of the running QEMU
/// ([`overlays::named_nodes`]), by node name.
async fn named_nodes(live: &LiveVm) -> Result<HashMap<String, u64>, PrepareError> {
    let qmp = live.qmp.as_ref().ok_or(PrepareError::NoQmp)?;
    Ok(overlays::named_nodes(qmp)
        .await
        .map_err(PrepareError::Overlays)?
        .into_iter()
        .filter_map(|n| Some((n.node, n.size?)))
        .collect())
}

/// Makes the next overlay of every disk of the target's running QEMU ready
/// ahead of the cut that will use it: recorded in `ahead_overlays` (one
/// store write: its id from the durable counter `ahead`, its layer id),
/// then the file, formatted over the disk's head, added to QEMU as an
/// unattached node named after the id (`a{id}d{index}`). A disk that has one
/// already, or an unsettled cut overlay, is left alone; whether an ahead
/// overlay still fits is checked when a cut takes it. Holds the target's
/// locks, so the VM cannot stop or be restored meanwhile.
pub(super) async fn prepare_ahead(ctx: &Arc<Context>, target: &str) {
    if !target.starts_with("vm/") {
        return;
    }
    let _guards = lock_target(ctx, target).await;
    let Some(live) = live_of(ctx, target).await else {
        return;
    };
    let state_dir = ctx.config.state_dir.clone();
    if std::fs::create_dir_all(storage::layers_dir(&state_dir)).is_err() {
        return;
    }
    let graph = match Graph::read(&live).await {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!(target, error = %e, "cannot make overlays ahead");
            return;
        }
    };
    let started = Instant::now();
    let each = live
        .record
        .disk_names
        .iter()
        .enumerate()
        .map(|(index, disk)| ahead_disk(ctx, target, &live, &graph, index, disk));
    let made = futures_util::future::join_all(each)
        .await
        .into_iter()
        .filter(|m| *m)
        .count();
    if made > 0 {
        tracing::info!(
            target,
            made,
            ms = started.elapsed().as_millis() as u64,
            "overlays made ahead"
        );
    }
}

/// [`prepare_ahead`] for one disk; true when an overlay was made.
async fn ahead_disk(
    ctx: &Arc<Context>,
    target: &str,
    live: &Arc<LiveVm>,
    graph: &Graph,
    index: usize,
    disk: &str,
) -> bool {
    match overlays::of_disk::<Ahead>(&ctx.store, disk).map(|mut a| a.pop()) {
        Ok(None) => {}
        _ => return false,
    }
    if !overlays::of_disk::<Overlay>(&ctx.store, disk).is_ok_and(|o| o.is_empty()) {
        return false;
    }
    let Ok(Some(head)) = storage::head(&ctx.store, disk) else {
        return false;
    };
    let Some(capacity) = graph
        .device(index)
        .and_then(|i| i.pointer("/image/virtual-size"))
        .and_then(Value::as_u64)
    else {
        return false;
    };
    let state_dir = &ctx.config.state_dir;
    let recorded = ctx.store.with_tx(|tx| {
        let id = Store::next_counter_tx(tx, "ahead")?;
        let new = storage::allocate_tx(tx, state_dir, disk)?;
        let a = Ahead {
            id,
            target: target.to_string(),
            disk: disk.to_string(),
            layer: new.id,
            path: new.path,
            node: overlays::ahead_node(id, index),
            base: head.id.clone(),
        };
        overlays::record_tx(tx, &a)?;
        Ok(a)
    });
    let a = match recorded {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(target, disk, error = %e, "cannot record an overlay made ahead");
            return false;
        }
    };
    match add_overlay_node(live.qmp.as_ref(), &a.path, &head.path, capacity, &a.node).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(target, disk, node = %a.node, error = %e, "cannot make an overlay ahead");
            if let Err(why) = overlays::remove_ahead(&ctx.store, Some(live), &a).await {
                tracing::warn!(target, disk, node = %a.node, error = %why, "an ahead overlay is left for later");
            }
            false
        }
    }
}

/// Creates a cut overlay's file at `path` over `base` (the disk's head, as
/// the overlay's recorded backing file) and adds it to the running QEMU as
/// node `node`, unattached (`"backing": null`; the cut's transaction puts
/// it on top of the device). The one place where a file is made for QEMU
/// and handed to it; the caller has journalled the overlay already.
///
/// No process is started: hearthd creates the empty file, QEMU opens it as
/// a `file` node ([`overlays::file_node`]), formats it as qcow2 with a
/// `blockdev-create` job on that node, and the qcow2 node is added over it.
/// QEMU never opens the file by path: hearthd hands it over by descriptor
/// (`qmp::add_protocol_node`), as QEMU runs as an unprivileged user.
pub(super) async fn add_overlay_node<M: Monitor>(
    qmp: Option<&M>,
    path: &std::path::Path,
    base: &std::path::Path,
    capacity: u64,
    node: &str,
) -> Result<(), NodeError> {
    let qmp = qmp.ok_or(NodeError::NoQmp)?;
    // Private to hearthd, as every layer: QEMU gets it by descriptor.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| NodeError::Create {
            path: path.to_path_buf(),
            source,
        })?;
    let file_node = overlays::file_node(node);
    let run = async |command: &str, args: Value| {
        qmp.execute(command, Some(args), QMP_TIMEOUT)
            .await
            .map_err(|source| NodeError::Qmp {
                command: command.to_string(),
                node: node.to_string(),
                source,
            })
    };
    // QEMU runs unprivileged and cannot open the file by path: hearthd
    // hands it over (an fd set), and QEMU formats it through that node.
    qmp.add_protocol_node(&file_node, path, false, QMP_TIMEOUT)
        .await
        .map_err(|source| NodeError::HandOver {
            path: path.to_path_buf(),
            source,
        })?;
    let job = overlays::create_job(node);
    run(
        "blockdev-create",
        json!({"job-id": job, "options": {
            "driver": "qcow2",
            "file": file_node,
            "size": capacity,
            "backing-file": base.to_string_lossy(),
            "backing-fmt": "qcow2",
        }}),
    )
    .await?;
    // The job formats a few clusters; its end is read from QEMU.
    let deadline = Instant::now() + QMP_TIMEOUT;
    loop {
        let jobs = run("query-jobs", json!({})).await?;
        let mine = jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j["id"] == job.as_str()))
            .cloned()
            .ok_or_else(|| NodeError::LostJob(job.clone()))?;
        if mine["status"] == "concluded" {
            run("job-dismiss", json!({"id": job})).await?;
            if let Some(e) = mine.get("error").and_then(Value::as_str) {
                return Err(NodeError::Format {
                    path: path.to_path_buf(),
                    error: e.to_string(),
                });
            }
            break;
        }
        if Instant::now() >= deadline {
            return Err(NodeError::JobTimeout {
                job,
                timeout: QMP_TIMEOUT,
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    run(
        "blockdev-add",
        json!({"driver": "qcow2", "node-name": node, "file": file_node, "backing": null}),
    )
    .await?;
    Ok(())
}

/// One atomic QMP transaction over every disk of the cut. Offline, the
/// switch happens in the store at commit. An error QEMU answered means it
/// did not run; no answer means nobody knows yet.
pub(super) async fn transact(held: &CutContext, timeout: Duration) -> TxResult {
    let Some(live) = &held.live else {
        return TxResult::Applied;
    };
    let actions: Vec<Value> = held
        .prepared
        .iter()
        .filter_map(|p| match (&p.top_node, &p.overlay.node) {
            (Some(top), Some(new)) => Some(json!({
                "type": "blockdev-snapshot",
                "data": {"node": top, "overlay": new},
            })),
            _ => None,
        })
        .collect();
    if actions.is_empty() {
        return TxResult::Applied;
    }
    steps::transaction(live.qmp.as_ref(), actions, timeout).await
}

/// Did the transaction run? Read from QEMU's block graph: each device's top
/// node is the overlay (ran) or not (did not). A transaction is atomic, so
/// a mix, or no answer within `timeout`, is unknown. The read goes to the
/// monitor connection the transaction went to, whose commands QEMU runs
/// in order: its answer comes only once the transaction has ended.
pub(super) async fn observe(held: &CutContext, timeout: Duration) -> Option<bool> {
    let live = held.live.as_ref()?;
    let switches: Vec<(usize, &str)> = held
        .prepared
        .iter()
        .filter_map(|p| Some((p.device?, p.overlay.node.as_deref()?)))
        .collect();
    steps::observe(live.qmp.as_ref()?, &switches, timeout).await
}

/// The cut did not happen (as far as hearth could prove): settle its
/// overlays by what QEMU really uses.
pub(super) async fn discard(ctx: &Arc<Context>, target: &str, held: &mut CutContext, cut: CutId) {
    // A QEMU that exited during the cut uses nothing any more.
    let alive = held
        .live
        .as_deref()
        .filter(|l| hearth_qemu::process::is_alive(&l.record.process));
    // Overlays made ahead that this cut never claimed were never switched
    // to: removed, never adopted.
    let mut overlays: Vec<Overlay> = Vec::new();
    for p in held.prepared.drain(..) {
        match &p.ahead {
            Some(a) => {
                if let Err(why) = overlays::remove_ahead(&ctx.store, alive, a).await {
                    tracing::warn!(target, cut, node = %a.node, error = %why, "an ahead overlay is left for later");
                }
            }
            None => overlays.push(p.overlay),
        }
    }
    // Also those recorded before a failure stopped `prepare`.
    let recorded = overlays::of_target::<Overlay>(&ctx.store, target).unwrap_or_default();
    let mut all = overlays;
    for o in recorded {
        if o.cut == cut && !all.iter().any(|a| a.disk == o.disk) {
            all.push(o);
        }
    }
    let settled = overlays::settle(&ctx.store, alive, &all).await;
    for (o, s) in settled {
        if s == Settled::Adopted {
            vm_event(
                ctx,
                target,
                EventType::Warning,
                "OverlayAdopted",
                &format!(
                    "cut {cut}: QEMU writes VirtualDisk {:?} to the cut's overlay; it is the disk's head now",
                    o.disk
                ),
            );
        }
    }
}

/// The guest's filesystems by VirtualDisk name, for the coordinator to
/// choose what to freeze; `names[i]` is device `i` of the running QEMU.
pub(super) fn mounts_by_name(m: &MountMap, names: &[String]) -> Mounts {
    Mounts {
        by_disk: names
            .iter()
            .enumerate()
            .map(|(i, d)| (d.clone(), m.by_disk.get(i).cloned().unwrap_or_default()))
            .collect(),
        unmapped: m.unmapped.clone(),
    }
}

/// The mount points frozen on a cut disk, and a reason when the freeze
/// cannot be shown to cover it. The freeze covered every filesystem on the
/// cut's disks (a list freeze) or every filesystem of the guest; this says
/// which of them lie on the disk. (A cut whose disks carry no filesystem
/// froze nothing: the list is empty, with `NoFilesystemFrozen`.)
pub(super) fn frozen_on(
    held: &CutContext,
    prepared: Option<&&Prepared>,
) -> (Option<Vec<String>>, Option<(&'static str, String)>) {
    let (Some(p), Some(mounts)) = (prepared, &held.mounts) else {
        return (None, None);
    };
    let Some(index) = p.device else {
        return (None, None);
    };
    match mounts {
        Err(e) => (
            None,
            Some((
                "FilesystemsUnknown",
                format!(
                    "every filesystem of the guest was frozen, but the guest agent could not say which lie on this disk ({e})"
                ),
            )),
        ),
        Ok(m) => {
            let on_disk = m.by_disk.get(index).cloned().unwrap_or_default();
            let why = on_disk.is_empty().then(|| {
                (
                    "NoFilesystemFrozen",
                    "no mounted filesystem of the guest lies on this disk, so no freeze covered it: it holds what the guest had written to the device at the cut".to_string(),
                )
            });
            (Some(on_disk), why)
        }
    }
}

/// The VM's `spec.expediteFreeze` (true when there is no VM to ask).
fn expedite_wanted(ctx: &Context, target: &str) -> bool {
    let Some(vm) = target.strip_prefix("vm/") else {
        return true;
    };
    match ctx.store.get(Kind::VirtualMachine, vm) {
        Ok(Some(s)) => match &s.object {
            Object::VirtualMachine(v) => v.spec.expedite_freeze,
            _ => true,
        },
        _ => true,
    }
}
