//! The async shell of the freeze coordinator: one actor task per target (a
//! VM, or a disk no VM uses). It owns all freeze/thaw traffic of its VM and
//! performs the coordinator's commands one at a time, in order, each bounded
//! by the timeout the coordinator gave.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;
use hearth_api::{EventType, Kind, Object, SnapshotPhase, SnapshotStatus};
use tokio::sync::mpsc;

use super::coordinator::{
    AgentFault, Command, Coordinator, Input, IntentNotRecorded, Millis, MountsUnknown, Outcome,
    Request, Scope, TxResult,
};
use super::overlays;
use super::registry::{Actors, MemberMsg, Msg};
use crate::context::Context;
use crate::store::{Store, journals};
use crate::vm::live::LiveVm;
use commit::{commit, mark_in_progress_tx, recover};
use cut::{
    AGENT_WAIT, CutContext, access, discard, live_of, mounts_by_name, observe, prepare,
    prepare_ahead, transact, wait_for_agent,
};
use target::{deadline_of, event_subject, lock_target, vm_event};
pub use target::{request_of, target_of};

mod commit;
mod cut;
mod errors;
mod steps;
mod target;
#[cfg(test)]
mod tests;

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
