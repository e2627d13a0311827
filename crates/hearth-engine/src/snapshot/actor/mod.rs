//! The async shell of the freeze coordinator: one actor task per target (a
//! VM, or a disk no VM uses). It owns all freeze/thaw traffic of its VM and
//! performs the coordinator's commands one at a time, in order, each bounded
//! by the timeout the coordinator gave.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;
use hearth_api::{EventType, Kind, Object, SnapshotPhase, SnapshotStatus, VirtualDiskSnapshot};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::coordinator::{
    Access, AgentFault, Command, Coordinator, CutId, Input, IntentNotRecorded, Millis, Mounts,
    MountsUnknown, Outcome, Request, Scope, TxResult,
};
use super::expedite;
use super::overlays::{self, Ahead, Graph, Overlay, Settled};
use super::registry::{Actors, MemberMsg, Msg};
use super::storage::{self, Layer};
use crate::context::Context;
use crate::store::{Store, StoreError, journals};
use crate::vm::live::LiveVm;
use commit::{commit, mark_in_progress_tx, recover};
use errors::{MountsError, NodeError, PrepareError};
use hearth_qemu::fsmap::MountMap;
use hearth_qemu::seam::Monitor;
use steps::with_agent;

mod commit;
mod errors;
mod steps;
#[cfg(test)]
mod tests;

/// How long a cut waits for a just-started guest's agent before giving up.
const AGENT_WAIT: Duration = Duration::from_secs(20);
const QMP_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before a disk whose merge failed is compacted again.
const COMPACTION_RETRY: Duration = Duration::from_secs(60);
/// Pause before writing a cut's results again after the store refused.
const COMMIT_RETRY: Duration = Duration::from_secs(1);

pub(crate) use super::group::Report as GroupMemberReport;

/// Starting actors needs the context they run with, so it is here, not in
/// the registry.
impl Actors {
    /// Hands requests to the target's actor, starting it if needed. Requests
    /// sent together are always served by the same cut.
    pub fn request(&self, ctx: &Arc<Context>, target: &str, requests: Vec<Request>) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(target)
            && tx.send(Msg::Requests(requests.clone())).is_ok()
        {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Msg::Requests(requests));
        map.insert(target.to_string(), tx);
        let weak = Arc::downgrade(ctx);
        let target = target.to_string();
        tokio::spawn(async move { run(weak, target, rx).await });
    }

    /// Asks the actor serving `disk` to compact its chain once it is idle
    /// (no cut running or pending): merges of a running VM's chain are
    /// block-graph changes of that VM, so they go through its actor, in
    /// order with its cuts.
    pub fn compact(&self, ctx: &Arc<Context>, disk: &str) {
        let Ok(target) = target_of(ctx, disk) else {
            return;
        };
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(&target)
            && tx.send(Msg::Compact(disk.to_string())).is_ok()
        {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Msg::Compact(disk.to_string()));
        map.insert(target.clone(), tx);
        let weak = Arc::downgrade(ctx);
        tokio::spawn(async move { run(weak, target, rx).await });
    }

    /// Asks the target's actor to make the next overlay of every disk of its
    /// running QEMU ready, once it is idle (docs/snapshots.md, "Overlays
    /// made ahead").
    pub fn prepare_ahead(&self, ctx: &Arc<Context>, target: &str) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = map.get(target)
            && tx.send(Msg::Ahead).is_ok()
        {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Msg::Ahead);
        map.insert(target.to_string(), tx);
        let weak = Arc::downgrade(ctx);
        let target = target.to_string();
        tokio::spawn(async move { run(weak, target, rx).await });
    }

    /// Starts the actor of every target that has unsettled work in the store
    /// (after a daemon restart), so frozen guests are thawed and journalled
    /// overlays settled right away.
    pub fn resume_all(&self, ctx: &Arc<Context>) {
        // Frozen guests, and overlays a cut left to settle.
        let mut targets: Vec<String> = journals::unsettled_targets(&ctx.store).unwrap_or_default();
        if let Ok(snaps) = ctx.store.list(Kind::VirtualDiskSnapshot) {
            for s in snaps {
                if let Object::VirtualDiskSnapshot(snap) = &s.object {
                    let status: SnapshotStatus =
                        serde_json::from_value(s.status.clone()).unwrap_or_default();
                    if matches!(
                        status.phase,
                        SnapshotPhase::Pending | SnapshotPhase::InProgress
                    ) && let Ok(t) = target_of(ctx, &snap.spec.virtual_disk_name)
                    {
                        targets.push(t);
                    }
                }
            }
        }
        // Merges a dead daemon started: settled (and adopted) by their actor.
        let mut compacting: Vec<(String, String)> = Vec::new();
        for t in super::compaction::targets(&ctx.store).unwrap_or_default() {
            if let Ok(intents) = super::compaction::intents_of_target(&ctx.store, &t) {
                compacting.extend(intents.into_iter().map(|i| (t.clone(), i.disk)));
            }
        }
        targets.sort();
        targets.dedup();
        for t in targets {
            self.request(ctx, &t, Vec::new());
        }
        for (_, disk) in compacting {
            self.compact(ctx, &disk);
        }
    }
}

/// The actor that serves snapshots of `disk`: the VM whose running QEMU has
/// it (what the process was started with, whatever the spec says now), else
/// the VM whose spec lists it, else its own when no VM uses it.
pub fn target_of(ctx: &Context, disk: &str) -> Result<String, StoreError> {
    Ok(match ctx.vms_using_disk(disk)?.first() {
        Some(vm) => format!("vm/{vm}"),
        None => format!("disk/{disk}"),
    })
}

/// Everything a cut in progress holds in memory.
#[derive(Default)]
struct CutContext {
    live: Option<Arc<LiveVm>>,
    prepared: Vec<Prepared>,
    guards: Vec<tokio::sync::OwnedMutexGuard<()>>,
    freeze_started: Option<chrono::DateTime<Utc>>,
    /// Which of the guest's filesystems lie on which disk (live cuts with an
    /// agent), read before the freeze; the error when the agent could not say.
    mounts: Option<Result<MountMap, MountsError>>,
    /// What the step before the freeze did (live cuts with an agent).
    expedited: Option<expedite::Outcome>,
    /// The cut's snapshots show InProgress.
    in_progress: bool,
    /// The `Thawed` event, written with the commit: when, and its message.
    thawed: Option<(chrono::DateTime<Utc>, String)>,
}

/// The object a target's events are about.
fn event_subject(target: &str) -> (Kind, &str) {
    match target.strip_prefix("vm/") {
        Some(vm) => (Kind::VirtualMachine, vm),
        None => (Kind::VirtualDisk, target.trim_start_matches("disk/")),
    }
}

struct Prepared {
    disk: String,
    overlay: Overlay,
    old_head: Layer,
    /// The node the overlay goes on top of (live cuts).
    top_node: Option<String>,
    /// The overlay's device index in the running QEMU (live cuts).
    device: Option<usize>,
    capacity: u64,
    /// The overlay was made ahead and this cut has not claimed it in the
    /// store yet: until then its record is the ahead one.
    ahead: Option<overlays::Ahead>,
}

/// Takes the operations locks of a target and of every disk it may cut, in
/// the same order as a VM start or stop (VM first, disks sorted), so a VM
/// cannot start, stop or be restored, and a disk cannot be deleted or cut by
/// another actor, while a cut runs.
async fn lock_target(ctx: &Context, target: &str) -> Vec<tokio::sync::OwnedMutexGuard<()>> {
    let mut guards = vec![ctx.ops_lock(target).lock_owned().await];
    if let Some(vm) = target.strip_prefix("vm/") {
        let mut disks: Vec<String> = Vec::new();
        if let Ok(Some(s)) = ctx.store.get(Kind::VirtualMachine, vm)
            && let Object::VirtualMachine(v) = &s.object
        {
            disks.extend(v.spec.disks.iter().map(|d| d.virtual_disk_name.clone()));
        }
        if let Ok(Some(r)) = ctx.store.runtime(vm) {
            disks.extend(r.disk_names);
        }
        disks.sort();
        disks.dedup();
        for d in disks {
            guards.push(ctx.ops_lock(&format!("disk/{d}")).lock_owned().await);
        }
    }
    guards
}

async fn run(ctx: Weak<Context>, target: String, mut rx: mpsc::UnboundedReceiver<Msg>) {
    let now = super::clock_ms;
    let Some(e) = ctx.upgrade() else { return };
    let (mut core, first) = {
        let _guards = lock_target(&e, &target).await;
        match recover(&e, &target).await {
            Ok(x) => x,
            Err(err) => {
                tracing::error!(target, error = %err, "cannot load snapshot state");
                return;
            }
        }
    };
    drop(e);
    let mut queue: VecDeque<Command> = first.into();
    let mut held = CutContext::default();
    let mut closed = false;
    let mut compact: BTreeSet<String> = BTreeSet::new();
    // Disks whose last merge failed, and until when they are not tried again.
    let mut retry_after: HashMap<String, Instant> = HashMap::new();
    // The next overlays are to be made ahead once the actor is idle: after
    // a live cut, or when the VM started.
    let mut ahead_due = false;
    loop {
        while let Some(cmd) = queue.pop_front() {
            let Some(e) = ctx.upgrade() else { return };
            let input = execute(&e, &target, &mut held, &core, cmd, now).await;
            if let Some(input) = input {
                // Requests that came meanwhile are the coordinator's to
                // place: into this cut while it is being prepared, else
                // into the next.
                closed |=
                    take_waiting(&mut rx, &mut core, &mut queue, &mut ahead_due, &mut compact);
                let committed = matches!(input, Input::Committed { ok: true, .. });
                ahead_due |= committed && held.live.is_some();
                queue.extend(core.handle(input));
                if committed && core.is_idle() {
                    held = CutContext::default();
                }
            }
        }
        // Take every message already waiting, so simultaneous requests share a cut.
        closed |= take_waiting(&mut rx, &mut core, &mut queue, &mut ahead_due, &mut compact);
        if !queue.is_empty() {
            continue;
        }
        if core.is_idle() && core.gather_first(now()) && !closed {
            // Requests came while the last cut ran (one apply, a VM
            // snapshot and its siblings, parallel clients): a burst is under
            // way, so gather its stragglers briefly to share one cut and one
            // freeze. A request that found the actor idle skips this.
            closed = steps::gather(&mut rx, &mut core, &mut compact, &mut ahead_due).await;
        }
        if core.is_idle() && (core.has_pending() || core.needs_thaw()) {
            let Some(e) = ctx.upgrade() else { return };
            // A thaw retry holds no lock: stop, start and restore never wait
            // behind a guest agent that does not answer.
            let agent_deadline = tokio::time::Instant::now() + AGENT_WAIT;
            let guards = if core.has_pending() {
                // A just-started guest's agent is awaited before the locks are
                // taken, so a stop or restore asked meanwhile goes first.
                wait_for_agent(&e, &target, agent_deadline).await;
                lock_target(&e, &target).await
            } else {
                Vec::new()
            };
            forward_elsewhere(&e, &target, &mut core);
            let (access, live) = access(&e, &target, agent_deadline).await;
            if core.is_due(&access) {
                // A cut id is taken from the durable counter only for a cut
                // that starts, so ids never repeat and are not burnt by idle
                // thaw retries.
                match e.store.next_counter("cut") {
                    Ok(cut) => {
                        core.set_deadline(deadline_of(&e, &target));
                        // The start of a cut, in the log only (no store
                        // write in the request's path); the latency
                        // benchmark reads it.
                        tracing::info!(target, cut, requests = core.pending().len(), "cut starts");
                        let out = core.handle(Input::Start {
                            access,
                            cut,
                            now: now(),
                        });
                        held = CutContext {
                            live,
                            guards,
                            ..CutContext::default()
                        };
                        queue.extend(out);
                        continue;
                    }
                    Err(err) => {
                        // Without a durable id no cut starts; try again shortly.
                        tracing::error!(target, error = %err, "cannot allocate a cut id");
                        drop(guards);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
        }
        if core.is_idle() && !core.has_pending() && !core.needs_thaw() && !compact.is_empty() {
            // Never during a cut: the coordinator is idle and nothing waits.
            let Some(e) = ctx.upgrade() else { return };
            // Read before the locks: a stop that asks while this waits for
            // them, or while the merge runs, is seen.
            let epoch = e.snapshots.yield_epoch(&target);
            let yield_to = super::compaction::Yield {
                seen: epoch.load(std::sync::atomic::Ordering::SeqCst),
                epoch,
            };
            let guards = lock_target(&e, &target).await;
            let live = live_of(&e, &target).await;
            for disk in std::mem::take(&mut compact) {
                if yield_to.asked() {
                    // A stop, start or restore waits for the locks; the
                    // disks' next resync asks again.
                    break;
                }
                if retry_after.get(&disk).is_some_and(|t| Instant::now() < *t) {
                    // A failed merge is not tried again at once; a resync
                    // after the pause asks again.
                    continue;
                }
                if run_compaction(&e, &target, live.as_deref(), &disk, &yield_to).await {
                    retry_after.insert(disk, Instant::now() + COMPACTION_RETRY);
                } else {
                    retry_after.remove(&disk);
                }
            }
            drop(guards);
            continue;
        }
        if ahead_due && core.is_idle() && !core.has_pending() && !core.needs_thaw() {
            // Nothing waits: make the next cut's overlays now, so that cut
            // only has to freeze. A request that comes meanwhile waits for
            // this and then uses them.
            ahead_due = false;
            let Some(e) = ctx.upgrade() else { return };
            prepare_ahead(&e, &target).await;
            continue;
        }
        if closed {
            return;
        }
        // Idle, or held by a group: wait for work; retry a pending thaw
        // every second; a member held frozen wakes at its deadline.
        let mut wait = if core.needs_thaw() {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(3600)
        };
        if let Some(at) = core.wake_at() {
            wait = wait.min(Duration::from_millis(at.saturating_sub(now())));
        }
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(Msg::Requests(rs))) => {
                for r in rs {
                    core.handle(Input::Requested(r));
                }
            }
            Ok(Some(Msg::Group(input))) => queue.extend(core.handle(stamp(input, now()))),
            Ok(Some(Msg::Compact(d))) => {
                compact.insert(d);
            }
            Ok(Some(Msg::Ahead)) => ahead_due = true,
            Ok(None) => return,
            Err(_) => queue.extend(core.handle(Input::Tick { now: now() })),
        }
    }
}

/// A group's message, with the time the actor took it.
fn stamp(mut input: Input, at: Millis) -> Input {
    match &mut input {
        Input::GroupGoFreeze { now, .. }
        | Input::GroupGoCut { now, .. }
        | Input::GroupAbort { now, .. } => *now = at,
        _ => {}
    }
    input
}

/// Compacts one disk's chain in the actor, with its locks held; what was
/// merged and what was left goes to the disk's events. True when a merge
/// was started and failed.
async fn run_compaction(
    ctx: &Arc<Context>,
    target: &str,
    live: Option<&LiveVm>,
    disk: &str,
    yield_to: &super::compaction::Yield,
) -> bool {
    // A disk this actor no longer serves (a VM started with it meanwhile)
    // is compacted by the actor that does.
    match target_of(ctx, disk) {
        Ok(t) if t != target => {
            ctx.snapshots.compact(ctx, disk);
            return false;
        }
        Err(_) => return false,
        Ok(_) => {}
    }
    let speed = ctx.config.compaction_speed;
    match super::compaction::compact_disk(ctx, target, live, disk, speed, yield_to).await {
        Ok(r) => {
            if !r.skipped.is_empty() {
                tracing::info!(disk, skipped = ?r.skipped, "compaction left layers for later");
            }
            if r.merged_layers > 0 {
                ctx.wake(Kind::VirtualDisk, disk);
            }
            r.failed > 0
        }
        Err(e) => {
            tracing::warn!(disk, error = %e, "compaction failed");
            ctx.event(
                Kind::VirtualDisk,
                disk,
                EventType::Warning,
                "CompactionFailed",
                &e.to_string(),
            );
            true
        }
    }
}

/// Hands every message already waiting to the coordinator (what a group's
/// message makes it do goes into `queue`); true when the channel is closed.
fn take_waiting(
    rx: &mut mpsc::UnboundedReceiver<Msg>,
    core: &mut Coordinator,
    queue: &mut VecDeque<Command>,
    ahead_due: &mut bool,
    compact: &mut BTreeSet<String>,
) -> bool {
    loop {
        match rx.try_recv() {
            Ok(Msg::Requests(rs)) => {
                for r in rs {
                    core.handle(Input::Requested(r));
                }
            }
            Ok(Msg::Group(input)) => queue.extend(core.handle(stamp(input, super::clock_ms()))),
            Ok(Msg::Compact(d)) => {
                compact.insert(d);
            }
            Ok(Msg::Ahead) => *ahead_due = true,
            Err(mpsc::error::TryRecvError::Empty) => return false,
            Err(mpsc::error::TryRecvError::Disconnected) => return true,
        }
    }
}

/// Hands pending requests whose disk is now served by another actor (a VM
/// started with it, or stopped and no longer lists it) to that actor, so
/// online or offline is decided when the cut starts, by the one actor that
/// may cut the disk.
fn forward_elsewhere(ctx: &Arc<Context>, target: &str, core: &mut Coordinator) {
    let mut moved: HashMap<String, Vec<Request>> = HashMap::new();
    for r in core.take_pending() {
        match target_of(ctx, &r.disk) {
            Ok(t) if t != target => moved.entry(t).or_default().push(r),
            _ => {
                core.handle(Input::Requested(r));
            }
        }
    }
    for (t, rs) in moved {
        tracing::info!(from = target, to = %t, n = rs.len(), "snapshot requests move to the actor now serving their disk");
        ctx.snapshots.request(ctx, &t, rs);
    }
}

/// The VM's `spec.freezeDeadlineSeconds`, in ms (10 s when there is no VM).
fn deadline_of(ctx: &Context, target: &str) -> Millis {
    let default = 10_000;
    let Some(vm) = target.strip_prefix("vm/") else {
        return default;
    };
    match ctx.store.get(Kind::VirtualMachine, vm) {
        Ok(Some(s)) => match &s.object {
            Object::VirtualMachine(v) => u64::from(v.spec.freeze_deadline_seconds) * 1000,
            _ => default,
        },
        _ => default,
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

/// The request of a disk snapshot; a disk snapshot of a VM snapshot that
/// a VirtualMachineSnapshotGroup owns carries the group's name.
pub fn request_of(store: &Store, snap: &VirtualDiskSnapshot) -> Request {
    let group = snap
        .metadata
        .managed_by
        .as_deref()
        .and_then(|m| m.strip_prefix("VirtualMachineSnapshot/"))
        .and_then(|parent| {
            store
                .get(Kind::VirtualMachineSnapshot, parent)
                .ok()
                .flatten()
        })
        .and_then(|p| {
            p.object
                .metadata()
                .managed_by
                .as_deref()
                .and_then(|m| m.strip_prefix(super::group::MANAGED_BY_PREFIX))
                .map(str::to_string)
        });
    Request {
        group,
        snapshot: snap.metadata.name.clone(),
        disk: snap.spec.virtual_disk_name.clone(),
        required: snap.spec.required_consistency,
        whole_vm: snap
            .metadata
            .managed_by
            .as_deref()
            .is_some_and(|m| m.starts_with("VirtualMachineSnapshot/")),
    }
}

/// Waits, holding no lock, until the VM's guest agent answers, the VM does
/// not run (or has no agent), or `deadline`.
async fn wait_for_agent(ctx: &Arc<Context>, target: &str, deadline: tokio::time::Instant) {
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
async fn access(
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
async fn live_of(ctx: &Arc<Context>, target: &str) -> Option<Arc<LiveVm>> {
    let vm = target.strip_prefix("vm/")?;
    match ctx.store.runtime(vm) {
        Ok(Some(r)) if hearth_qemu::process::is_alive(&r.process) => {
            Some(ctx.ensure_live(&r).await)
        }
        _ => None,
    }
}

fn vm_event(ctx: &Context, target: &str, type_: EventType, reason: &str, message: &str) {
    match target.strip_prefix("vm/") {
        Some(vm) => ctx.event(Kind::VirtualMachine, vm, type_, reason, message),
        None => {
            let disk = target.trim_start_matches("disk/");
            ctx.event(Kind::VirtualDisk, disk, type_, reason, message)
        }
    }
}

async fn execute(
    ctx: &Arc<Context>,
    target: &str,
    held: &mut CutContext,
    core: &Coordinator,
    cmd: Command,
    now: impl Fn() -> Millis,
) -> Option<Input> {
    match cmd {
        Command::Prepare { cut, disks } => {
            // The snapshots show InProgress from the intent's write on (the
            // same store transaction), or, for a cut without a freeze, just
            // before its transaction.
            let failed = prepare(ctx, target, held, cut, &disks).await;
            tracing::info!(target, cut, failed = failed.len(), "cut prepared");
            let mounts = held.mounts.as_ref().map(|m| {
                let names = held
                    .live
                    .as_ref()
                    .map(|l| l.record.disk_names.as_slice())
                    .unwrap_or(&[]);
                m.clone()
                    .map(|m| mounts_by_name(&m, names))
                    .map_err(|e| MountsUnknown(e.to_string()))
            });
            Some(Input::Prepared {
                cut,
                failed,
                mounts,
                now: now(),
            })
        }
        Command::RecordIntent { cut, deadline } => {
            let names: Vec<String> = core
                .cut_requests()
                .iter()
                .map(|r| r.snapshot.clone())
                .collect();
            let what = match core.cut_scope() {
                Some(Scope::List(points)) => points.join(", "),
                _ => "every filesystem of the guest".to_string(),
            };
            let expedited = held
                .expedited
                .as_ref()
                .map(|o| format!("; {}", o.describe()))
                .unwrap_or_default();
            let left = deadline.saturating_sub(now());
            let wall = Utc::now() + chrono::Duration::milliseconds(left as i64);
            let prepared = &held.prepared;
            let result = ctx
                .store
                .with_tx(|tx| {
                    // Overlays made ahead become this cut's, in the intent's
                    // write: never switched to while still recorded ahead.
                    for p in prepared {
                        if let Some(a) = &p.ahead {
                            overlays::claim_tx(tx, a, cut)?;
                        }
                    }
                    journals::record_freeze_tx(tx, target, cut, wall, &names)?;
                    mark_in_progress_tx(tx, &names, cut)?;
                    // The event of the freeze that follows, in the same write.
                    let (kind, name) = event_subject(target);
                    Store::record_event_tx(
                        tx,
                        Utc::now(),
                        kind,
                        name,
                        EventType::Normal,
                        "Freezing",
                        &format!(
                            "cut {cut}: freezing {} for {} snapshot(s): {}{}",
                            what,
                            names.len(),
                            names.join(", "),
                            expedited
                        ),
                    )?;
                    Ok(())
                })
                .map_err(|e| IntentNotRecorded(e.to_string()));
            held.in_progress = result.is_ok();
            if result.is_ok() {
                for p in &mut held.prepared {
                    p.ahead = None;
                }
            }
            if let Err(e) = &result {
                tracing::error!(target, error = %e, "cannot record the freeze intent; not freezing");
            }
            Some(Input::IntentRecorded {
                cut,
                result,
                now: now(),
            })
        }
        Command::Freeze {
            cut,
            timeout,
            mountpoints,
        } => {
            // Its event went with the intent.
            held.freeze_started = Some(Utc::now());
            let result = match &held.live {
                Some(live) => {
                    steps::freeze(&live.agent, Duration::from_millis(timeout), &mountpoints).await
                }
                None => Err(AgentFault::Disconnected),
            };
            Some(Input::FreezeReplied {
                cut,
                result,
                now: now(),
            })
        }
        Command::QueryFreeze { cut, timeout } => {
            let result = match &held.live {
                Some(live) => steps::frozen(&live.agent, Duration::from_millis(timeout)).await,
                None => Err(AgentFault::Disconnected),
            };
            Some(Input::StatusReplied {
                cut,
                result,
                now: now(),
            })
        }
        Command::Transact { cut, timeout } => {
            if !held.in_progress {
                let names: Vec<String> = core
                    .cut_requests()
                    .iter()
                    .map(|r| r.snapshot.clone())
                    .collect();
                let prepared = &held.prepared;
                let claimed = ctx.store.with_tx(|tx| {
                    for p in prepared {
                        if let Some(a) = &p.ahead {
                            overlays::claim_tx(tx, a, cut)?;
                        }
                    }
                    Ok(())
                });
                if let Err(e) = claimed {
                    // An overlay still recorded ahead is never switched to.
                    return Some(Input::Transacted {
                        cut,
                        result: TxResult::Rejected(format!(
                            "cannot record the cut's overlays made ahead: {e}"
                        )),
                        now: now(),
                    });
                }
                for p in &mut held.prepared {
                    p.ahead = None;
                }
                if let Err(e) = ctx.store.with_tx(|tx| mark_in_progress_tx(tx, &names, cut)) {
                    tracing::warn!(target, cut, error = %e, "cannot write InProgress");
                }
                held.in_progress = true;
            }
            let result = transact(held, Duration::from_millis(timeout)).await;
            Some(Input::Transacted {
                cut,
                result,
                now: now(),
            })
        }
        Command::Observe {
            cut,
            timeout,
            while_frozen,
        } => {
            let applied = observe(held, Duration::from_millis(timeout)).await;
            vm_event(
                ctx,
                target,
                EventType::Warning,
                "TransactionObserved",
                &format!(
                    "cut {cut}: the transaction's reply did not come; QEMU's block graph, read {}, says it {}",
                    if while_frozen {
                        "while the guest is still frozen"
                    } else {
                        "after the thaw"
                    },
                    match applied {
                        Some(true) => "ran",
                        Some(false) => "did not run",
                        None => "cannot be read",
                    }
                ),
            );
            Some(Input::Observed {
                cut,
                applied,
                now: now(),
            })
        }
        Command::Thaw {
            cut,
            timeout,
            only_if_frozen,
        } => {
            // The QEMU the cut started with may have exited meanwhile: then
            // nothing is frozen, unless a new one runs.
            let live = match held
                .live
                .as_ref()
                .filter(|l| hearth_qemu::process::is_alive(&l.record.process))
            {
                Some(l) => Some(l.clone()),
                None => live_of(ctx, target).await,
            };
            let result = match live {
                Some(live) => {
                    steps::thaw(&live.agent, Duration::from_millis(timeout), only_if_frozen).await
                }
                // No process, nothing frozen.
                None => Ok(None),
            };
            match &result {
                // Recorded with the cut's commit (the next store write),
                // with the time of the thaw: no write of its own between
                // the thaw and Ready.
                Ok(Some(n)) => {
                    tracing::info!(target, cut, filesystems = n, "thawed");
                    held.thawed = Some((
                        Utc::now(),
                        format!("cut {cut}: the guest thawed {n} filesystem(s)"),
                    ));
                }
                Ok(None) => vm_event(
                    ctx,
                    target,
                    EventType::Normal,
                    "NotFrozen",
                    &format!("cut {cut}: the guest is not frozen; nothing to thaw"),
                ),
                Err(f) => vm_event(
                    ctx,
                    target,
                    EventType::Warning,
                    "ThawFailed",
                    &format!("cut {cut}: thaw failed: {f}; retrying"),
                ),
            }
            Some(Input::ThawReplied {
                cut,
                result: result.map(|n| n.unwrap_or(0)),
                now: now(),
            })
        }
        Command::Discard { cut } => {
            discard(ctx, target, held, cut).await;
            None
        }
        Command::GroupReport { cut, report } => {
            let group = core.cut_group().unwrap_or_default().to_string();
            let vm = target.trim_start_matches("vm/").to_string();
            let report = match report {
                super::coordinator::GroupReport::ReadyToFreeze => GroupMemberReport::ReadyToFreeze,
                super::coordinator::GroupReport::ReadyToCut { frozen } => {
                    GroupMemberReport::ReadyToCut { frozen }
                }
                super::coordinator::GroupReport::ReadyToThaw => GroupMemberReport::Cut,
            };
            tracing::info!(target, cut, group, ?report, "held for the group");
            if ctx
                .snapshots
                .report_to_group(&group, MemberMsg { vm, cut, report })
            {
                None
            } else {
                // No run of the group goes on (hearthd restarted since it
                // began): a group is taken whole or not at all.
                Some(Input::GroupAbort {
                    cut,
                    why: format!(
                        "the VirtualMachineSnapshotGroup {group:?} is no longer being taken (hearthd restarted during it)"
                    ),
                    now: now(),
                })
            }
        }
        Command::Commit {
            cut,
            outcomes,
            took_cut,
            freeze_window_ms,
            keep_intent,
            why_not_consistent,
            full_freeze,
        } => {
            let ok = commit(
                ctx,
                target,
                held,
                core,
                cut,
                &outcomes,
                took_cut,
                freeze_window_ms,
                keep_intent,
                why_not_consistent,
                full_freeze,
            )
            .await;
            if !ok {
                // The store refused: the overlays stay recorded, so nothing
                // is lost; write the results again shortly.
                tokio::time::sleep(COMMIT_RETRY).await;
            } else if let Some(group) = core.cut_group() {
                let ready = !outcomes.is_empty()
                    && outcomes
                        .iter()
                        .all(|(_, o)| matches!(o, Outcome::Ready { .. }));
                let consistent = outcomes
                    .iter()
                    .all(|(_, o)| matches!(o, Outcome::Ready { consistent: true }));
                let why = outcomes.iter().find_map(|(_, o)| match o {
                    Outcome::Failed(w) => Some(w.clone()),
                    _ => None,
                });
                let vm = target.trim_start_matches("vm/").to_string();
                ctx.snapshots.report_to_group(
                    group,
                    MemberMsg {
                        vm,
                        cut,
                        report: GroupMemberReport::Finished {
                            ready,
                            consistent,
                            why,
                            window_ms: freeze_window_ms,
                        },
                    },
                );
            }
            Some(Input::Committed { cut, ok })
        }
    }
}

/// Makes every disk's overlay ready before any freeze: recorded in the
/// store first, then the file, then (live) its QEMU node. Returns the disks
/// that could not be prepared, with why; the others go on.
async fn prepare(
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
async fn prepare_ahead(ctx: &Arc<Context>, target: &str) {
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
async fn add_overlay_node<M: Monitor>(
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
async fn transact(held: &CutContext, timeout: Duration) -> TxResult {
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
async fn observe(held: &CutContext, timeout: Duration) -> Option<bool> {
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
async fn discard(ctx: &Arc<Context>, target: &str, held: &mut CutContext, cut: CutId) {
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
fn mounts_by_name(m: &MountMap, names: &[String]) -> Mounts {
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
fn frozen_on(
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
