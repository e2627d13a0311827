//! The shell of a VirtualMachineSnapshotGroup: its reconcile, and the run
//! that feeds the pure group core (`group.rs`) with its members' reports
//! and passes its answers to the members' actors.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hearth_api::{
    API_VERSION, EventType, Kind, Object, ObjectMeta, SnapshotPhase, SnapshotStatus,
    VirtualMachineSnapshot, VirtualMachineSnapshotSpec, check_dns_label,
};
use tokio::sync::mpsc;

use super::clock_ms;
use super::coordinator::{CutId, Input, IntentNotRecorded};
use super::group::{Group, GroupCommand, GroupInput, GroupOutcome, MANAGED_BY_PREFIX, Report};
use super::registry::MemberMsg;
use crate::context::{Action, Context, ReconcileError};
use crate::store::Store;

fn status_of(v: &serde_json::Value) -> SnapshotStatus {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

/// The member VM snapshot of `vm` in group `group`.
pub fn member_name(group: &str, vm: &str) -> String {
    format!("{group}-{vm}")
}

fn fail_group(ctx: &Context, name: &str, reason: &str, message: &str) {
    ctx.set_snapshot_status(Kind::VirtualMachineSnapshotGroup, name, |s| {
        s.phase = SnapshotPhase::Failed;
        s.reason = Some(reason.into());
        s.message = Some(message.into());
    });
    ctx.event(
        Kind::VirtualMachineSnapshotGroup,
        name,
        EventType::Warning,
        reason,
        message,
    );
}

pub async fn reconcile_group(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualMachineSnapshotGroup, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualMachineSnapshotGroup(group) = &stored.object else {
        return Ok(Action::Done);
    };
    let status = status_of(&stored.status);

    if stored.deleting {
        if ctx.snapshots.group_running(name) {
            // Its run ends by itself (by the deadline at the latest) and
            // wakes the group; its members go with it then.
            ctx.set_snapshot_status(Kind::VirtualMachineSnapshotGroup, name, |s| {
                s.phase = SnapshotPhase::Terminating
            });
            return Ok(Action::Done);
        }
        let mut left = 0;
        for member in &status.virtual_machine_snapshot_names {
            if ctx
                .store
                .get(Kind::VirtualMachineSnapshot, member)?
                .is_some()
            {
                left += 1;
                ctx.store
                    .mark_deleting(Kind::VirtualMachineSnapshot, member)?;
                ctx.wake(Kind::VirtualMachineSnapshot, member);
            }
        }
        if left == 0 {
            ctx.store.remove(Kind::VirtualMachineSnapshotGroup, name)?;
            ctx.event(
                Kind::VirtualMachineSnapshotGroup,
                name,
                EventType::Normal,
                "Deleted",
                "the group and its member VM snapshots are gone",
            );
        }
        return Ok(Action::Done);
    }

    match status.phase {
        SnapshotPhase::Pending => {
            let mut members = Vec::new();
            let mut deadline_ms = u64::MAX;
            for vm_name in &group.spec.virtual_machine_names {
                let Some(vm) = ctx.store.get(Kind::VirtualMachine, vm_name)? else {
                    fail_group(
                        ctx,
                        name,
                        "VirtualMachineNotFound",
                        &format!(
                            "spec.virtualMachineNames: VirtualMachine {vm_name:?} does not exist"
                        ),
                    );
                    return Ok(Action::Done);
                };
                if let Object::VirtualMachine(v) = &vm.object {
                    deadline_ms = deadline_ms.min(u64::from(v.spec.freeze_deadline_seconds) * 1000);
                }
                let member = member_name(name, vm_name);
                if let Err(why) = check_dns_label(&member) {
                    fail_group(
                        ctx,
                        name,
                        "NameTooLong",
                        &format!("the member VM snapshot name {why}; use a shorter group name"),
                    );
                    return Ok(Action::Done);
                }
                if ctx
                    .store
                    .get(Kind::VirtualMachineSnapshot, &member)?
                    .is_some()
                {
                    fail_group(
                        ctx,
                        name,
                        "NameTaken",
                        &format!("a VirtualMachineSnapshot named {member:?} already exists"),
                    );
                    return Ok(Action::Done);
                }
                members.push(VirtualMachineSnapshot {
                    api_version: API_VERSION.into(),
                    kind: Kind::VirtualMachineSnapshot.as_str().into(),
                    metadata: ObjectMeta {
                        name: member,
                        creation_timestamp: Some(chrono::Utc::now()),
                        generation: 1,
                        managed_by: Some(format!("{MANAGED_BY_PREFIX}{name}")),
                        ..ObjectMeta::default()
                    },
                    spec: VirtualMachineSnapshotSpec {
                        virtual_machine_name: vm_name.clone(),
                        required_consistency: group.spec.required_consistency,
                    },
                    status: None,
                });
            }
            let names: Vec<String> = members.iter().map(|m| m.metadata.name.clone()).collect();
            // The run is registered before any member can report to it.
            let (tx, rx) = mpsc::unbounded_channel();
            ctx.snapshots.register_group(name, tx);
            // Members and the group's status in one transaction: a crash
            // leaves either no members or all of them, each Pending, under
            // a group shown InProgress.
            let written = ctx.store.with_tx(|tx| {
                for m in &members {
                    Store::create_with_status_tx(
                        tx,
                        &Object::VirtualMachineSnapshot(m.clone()),
                        &SnapshotStatus::default(),
                    )?;
                }
                Store::update_status_tx::<SnapshotStatus, _>(
                    tx,
                    Kind::VirtualMachineSnapshotGroup,
                    name,
                    |s| {
                        s.phase = SnapshotPhase::InProgress;
                        s.virtual_machine_snapshot_names = names.clone();
                    },
                )?;
                Ok(())
            });
            if let Err(e) = written {
                ctx.snapshots.unregister_group(name);
                return Err(e.into());
            }
            let core = Group::new(
                &group.spec.virtual_machine_names,
                group.spec.required_consistency,
                deadline_ms,
            );
            let ctx2 = ctx.clone();
            let name2 = name.to_string();
            let vms = group.spec.virtual_machine_names.clone();
            tokio::spawn(async move { run(ctx2, name2, vms, core, rx).await });
            for m in &names {
                ctx.wake(Kind::VirtualMachineSnapshot, m);
            }
            ctx.event(
                Kind::VirtualMachineSnapshotGroup,
                name,
                EventType::Normal,
                "Requested",
                &format!(
                    "member VM snapshots {} requested; one deadline of {} s for the group",
                    names.join(", "),
                    deadline_ms / 1000
                ),
            );
        }
        SnapshotPhase::InProgress if !ctx.snapshots.group_running(name) => {
            // hearthd restarted during the group. Its members' actors thaw
            // any member that may be frozen and fail the group's requests;
            // once every member is settled, the group fails as a whole.
            for m in &status.virtual_machine_snapshot_names {
                if let Some(s) = ctx.store.get(Kind::VirtualMachineSnapshot, m)?
                    && !status_of(&s.status).phase.is_final()
                {
                    return Ok(Action::Done);
                }
            }
            tracing::info!(group = name, members = ?status.virtual_machine_snapshot_names, "no run of the group goes on: failing it");
            // Only if it is still in progress: the status read above may
            // predate the outcome a run that just ended wrote.
            finish(
                ctx,
                name,
                &status.virtual_machine_snapshot_names,
                true,
                &GroupOutcome::Failed(
                    "hearthd restarted during the group's cut; every member was thawed, and the group is not retaken member by member".into(),
                ),
            )?;
        }
        _ => {}
    }
    Ok(Action::Done)
}

/// The run of one group: feeds the core, performs its commands.
async fn run(
    ctx: Arc<Context>,
    name: String,
    vms: Vec<String>,
    mut core: Group,
    mut rx: mpsc::UnboundedReceiver<MemberMsg>,
) {
    let members: Vec<String> = vms.iter().map(|vm| member_name(&name, vm)).collect();
    let mut cuts: HashMap<String, CutId> = HashMap::new();
    let mut queue: Vec<GroupCommand> = Vec::new();
    // The queue is always drained before the end is looked at: the
    // outcome is the last command.
    loop {
        // Commands a command's result makes (the freezes after the intent)
        // run at once, not after the next wait.
        while !queue.is_empty() {
            for cmd in std::mem::take(&mut queue) {
                match cmd {
                    GroupCommand::RecordIntent { deadline } => {
                        let left = deadline.saturating_sub(clock_ms());
                        let result = ctx
                        .store
                        .with_tx(|tx| {
                            Store::update_status_tx::<SnapshotStatus, _>(
                                tx,
                                Kind::VirtualMachineSnapshotGroup,
                                &name,
                                |s| s.cut_time = Some(chrono::Utc::now()),
                            )?;
                            Store::record_event_tx(
                                tx,
                                chrono::Utc::now(),
                                Kind::VirtualMachineSnapshotGroup,
                                &name,
                                EventType::Normal,
                                "Freezing",
                                &format!(
                                    "every member is prepared: freezing {} together, thawed within {left} ms",
                                    vms.join(", ")
                                ),
                            )?;
                            Ok(())
                        })
                        .map_err(|e| IntentNotRecorded(e.to_string()));
                        queue.extend(core.handle(GroupInput::IntentRecorded {
                            result,
                            now: clock_ms(),
                        }));
                    }
                    GroupCommand::GoFreeze { vm, deadline } => {
                        if let Some(cut) = cuts.get(&vm) {
                            let input = Input::GroupGoFreeze {
                                cut: *cut,
                                deadline,
                                now: 0,
                            };
                            ctx.snapshots.signal(&format!("vm/{vm}"), input);
                        }
                    }
                    GroupCommand::GoCut { vm } => {
                        if let Some(cut) = cuts.get(&vm) {
                            let input = Input::GroupGoCut { cut: *cut, now: 0 };
                            ctx.snapshots.signal(&format!("vm/{vm}"), input);
                        }
                    }
                    GroupCommand::GoThaw { vm } => {
                        if let Some(cut) = cuts.get(&vm) {
                            let input = Input::GroupGoThaw { cut: *cut };
                            ctx.snapshots.signal(&format!("vm/{vm}"), input);
                        }
                    }
                    GroupCommand::Abort { vm, why } => {
                        if let Some(cut) = cuts.get(&vm) {
                            let input = Input::GroupAbort {
                                cut: *cut,
                                why,
                                now: 0,
                            };
                            ctx.snapshots.signal(&format!("vm/{vm}"), input);
                        }
                    }
                    GroupCommand::Finish(outcome) => {
                        // Written again until it lands: the members are settled,
                        // nothing is frozen, only the record is missing.
                        while let Err(e) = finish(&ctx, &name, &members, false, &outcome) {
                            tracing::error!(group = name, error = %e, "cannot record the group's outcome; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            }
        }
        if core.is_done() {
            break;
        }
        // Wait for a member; wake at the group's deadline; look at the
        // members' snapshots every second (one that failed before its cut
        // started, e.g. a VM with no disks, reports nothing).
        let mut wait = Duration::from_secs(1);
        if let Some(at) = core.wake_at() {
            let now = clock_ms();
            if at <= now {
                // Due already (a report came in the meantime): now, not
                // after a wait; and no busy loop if it changes nothing.
                queue.extend(core.handle(GroupInput::Tick { now }));
                if !queue.is_empty() {
                    continue;
                }
            } else {
                wait = wait.min(Duration::from_millis(at - now));
            }
        }
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(msg)) => {
                cuts.insert(msg.vm.clone(), msg.cut);
                queue.extend(core.handle(GroupInput::Report {
                    vm: msg.vm,
                    report: msg.report,
                    now: clock_ms(),
                }));
            }
            Ok(None) => break,
            Err(_) => {
                queue.extend(core.handle(GroupInput::Tick { now: clock_ms() }));
                for (vm, member) in vms.iter().zip(&members) {
                    let failed = match ctx.store.get(Kind::VirtualMachineSnapshot, member) {
                        Ok(Some(s)) => {
                            let st = status_of(&s.status);
                            (st.phase == SnapshotPhase::Failed)
                                .then(|| st.message.unwrap_or_default())
                        }
                        Ok(None) => Some("its VM snapshot was deleted".into()),
                        Err(_) => None,
                    };
                    if let Some(why) = failed {
                        queue.extend(core.handle(GroupInput::Report {
                            vm: vm.clone(),
                            report: Report::Finished {
                                ready: false,
                                consistent: false,
                                why: Some(why),
                                window_ms: None,
                            },
                            now: clock_ms(),
                        }));
                    }
                }
            }
        }
    }
    tracing::info!(group = name, "the group's run ends");
    ctx.snapshots.unregister_group(&name);
    ctx.wake(Kind::VirtualMachineSnapshotGroup, &name);
}

/// Records the group's outcome. A failed group fails every member VM
/// snapshot and its disk snapshots with the group's reason, in the same
/// transaction: nothing of a failed group is shown as Ready. With
/// `only_in_progress`, nothing is written unless the group is still
/// InProgress when the transaction reads it.
fn finish(
    ctx: &Context,
    name: &str,
    members: &[String],
    only_in_progress: bool,
    outcome: &GroupOutcome,
) -> Result<(), crate::store::StoreError> {
    let mut cut_id = None;
    let mut size = 0u64;
    for m in members {
        if let Ok(Some(s)) = ctx.store.get(Kind::VirtualMachineSnapshot, m) {
            let st = status_of(&s.status);
            cut_id = cut_id.or(st.cut_id);
            size += st.size.unwrap_or(0);
        }
    }
    let written = ctx.store.with_tx(|tx| {
        if only_in_progress {
            let current = Store::status_tx(tx, Kind::VirtualMachineSnapshotGroup, name)?;
            let phase = current
                .and_then(|c| serde_json::from_value::<SnapshotStatus>(c).ok())
                .map(|s| s.phase);
            if phase != Some(SnapshotPhase::InProgress) {
                return Ok(false);
            }
        }
        if let GroupOutcome::Failed(why) = outcome {
            for m in members {
                let children = Store::update_status_tx::<SnapshotStatus, _>(
                    tx,
                    Kind::VirtualMachineSnapshot,
                    m,
                    |s| {
                        s.phase = SnapshotPhase::Failed;
                        s.consistent = None;
                        s.reason = Some("GroupFailed".into());
                        s.message = Some(format!("VirtualMachineSnapshotGroup {name:?} failed: {why}"));
                    },
                )?
                .map(|s| s.virtual_disk_snapshot_names)
                .unwrap_or_default();
                for c in children {
                    Store::update_status_tx::<SnapshotStatus, _>(
                        tx,
                        Kind::VirtualDiskSnapshot,
                        &c,
                        |s| {
                            if s.phase != SnapshotPhase::Failed {
                                s.phase = SnapshotPhase::Failed;
                                s.consistent = None;
                                s.reason = Some("GroupFailed".into());
                                s.message = Some(format!(
                                    "VirtualMachineSnapshotGroup {name:?} failed: {why}"
                                ));
                            }
                        },
                    )?;
                }
            }
        }
        Store::update_status_tx::<SnapshotStatus, _>(
            tx,
            Kind::VirtualMachineSnapshotGroup,
            name,
            |s| match outcome {
                GroupOutcome::Ready {
                    consistent,
                    window_ms,
                } => {
                    if s.phase != SnapshotPhase::Terminating {
                        s.phase = SnapshotPhase::Ready;
                    }
                    s.consistent = Some(*consistent);
                    s.freeze_window_ms = *window_ms;
                    s.cut_id = cut_id;
                    s.size = Some(size);
                    s.reason = None;
                    s.message = None;
                }
                GroupOutcome::Failed(why) => {
                    if s.phase != SnapshotPhase::Terminating {
                        s.phase = SnapshotPhase::Failed;
                    }
                    s.consistent = None;
                    s.reason = Some("GroupFailed".into());
                    s.message = Some(why.clone());
                }
            },
        )?;
        let (t, reason, message) = match outcome {
            GroupOutcome::Ready {
                consistent,
                window_ms,
            } => (
                EventType::Normal,
                "Ready",
                format!(
                    "every member cut at one frozen moment, consistent: {consistent}, longest frozen window {} ms",
                    window_ms.unwrap_or(0)
                ),
            ),
            GroupOutcome::Failed(why) => (EventType::Warning, "Failed", why.clone()),
        };
        Store::record_event_tx(
            tx,
            chrono::Utc::now(),
            Kind::VirtualMachineSnapshotGroup,
            name,
            t,
            reason,
            &message,
        )?;
        Ok(true)
    })?;
    if !written {
        return Ok(());
    }
    crate::schedule::run_settled(ctx, Kind::VirtualMachineSnapshotGroup, name);
    crate::metrics::snapshot_settled(
        ctx,
        Kind::VirtualMachineSnapshotGroup,
        name,
        matches!(outcome, GroupOutcome::Ready { .. }),
        match outcome {
            GroupOutcome::Ready { window_ms, .. } => *window_ms,
            _ => None,
        },
    );
    Ok(())
}
