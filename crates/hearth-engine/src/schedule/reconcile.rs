//! The shell of a snapshot schedule: reads the schedule, its runs and the
//! clock, asks [`plan`](super::plan::plan) what to do, and does it. A run's
//! snapshots (or group) and the schedule's status are written in one
//! transaction; retention deletes through the same path as `hearth delete`,
//! so chains compact as for any delete.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use hearth_api::cron::{Schedule, parse_time_zone};
use hearth_api::{
    DiskSource, EventType, Kind, Object, ObjectMeta, RunResult, ScheduleStatus, SnapshotPhase,
    SnapshotStatus, VirtualMachineSnapshot, VirtualMachineSnapshotGroup,
    VirtualMachineSnapshotGroupSpec, VirtualMachineSnapshotSchedule, VirtualMachineSnapshotSpec,
    annotations, labels,
};

use super::plan::{self, Calendar, Inputs, Run, RunState, Slot};
use crate::context::{Action, Context, ReconcileError};
use crate::store::{Store, StoredObject};

/// `metadata.managedBy` of what a schedule makes.
pub const MANAGED_BY_PREFIX: &str = "VirtualMachineSnapshotSchedule/";

/// A cron expression read in one zone.
pub struct Zoned {
    pub schedule: Schedule,
    pub zone: chrono_tz::Tz,
}

impl Calendar for Zoned {
    fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.schedule.next_after(t, self.zone)
    }
    fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.schedule.previous_slot_at_or_before(t, self.zone)
    }
}

/// The slot as it appears in the names of a run's objects (UTC).
fn stamp(slot: DateTime<Utc>) -> String {
    slot.format("%Y%m%d%H%M").to_string()
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualMachineSnapshotSchedule, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualMachineSnapshotSchedule(sch) = &stored.object else {
        return Ok(Action::Done);
    };
    if stored.deleting {
        // Its snapshots are data: they stay, with their label.
        ctx.store
            .remove(Kind::VirtualMachineSnapshotSchedule, name)?;
        ctx.event(
            Kind::VirtualMachineSnapshotSchedule,
            name,
            EventType::Normal,
            "Deleted",
            "the schedule is gone; the snapshots it made are kept",
        );
        return Ok(Action::Done);
    }
    let status: ScheduleStatus = serde_json::from_value(stored.status.clone()).unwrap_or_default();
    let calendar = match calendar_of(sch) {
        Ok(c) => c,
        Err(why) => {
            set_status(ctx, name, |s| {
                s.message = Some(why.clone());
                s.next_run_time = None;
            });
            return Ok(Action::Done);
        }
    };
    let now = Utc::now();
    let created = sch.metadata.creation_timestamp.unwrap_or(now);
    let generation = sch.metadata.generation;

    // Nothing due, no run going, the spec as last seen, no retention timed:
    // only the clock is read (no list of snapshots), so an idle schedule
    // costs one row.
    let glance = plan::Glance {
        now,
        created,
        last_slot: status.last_schedule_time,
        running: !status.active.is_empty(),
        spec_seen: status.observed_generation == generation,
        retention_at: status.next_retention_time,
    };
    if let Some(idle) = plan::idle(&calendar, &glance) {
        if status.next_run_time != idle.next && !sch.spec.suspend {
            set_status(ctx, name, |s| s.next_run_time = idle.next);
        }
        return Ok(Action::RequeueAfter(idle.wake_in));
    }

    let group_mode = sch.spec.virtual_machine_snapshot_group_template.is_some();
    let runs = runs_of(ctx, name, run_kind(sch))?;
    let retention = sch.spec.retention.clone().unwrap_or_default();
    let inputs = Inputs {
        now,
        calendar: &calendar,
        created,
        last_slot: status.last_schedule_time,
        suspend: sch.spec.suspend,
        deadline: sch
            .spec
            .starting_deadline_seconds
            .map(std::time::Duration::from_secs),
        keep: retention.keep,
        max_age: retention
            .max_age
            .as_deref()
            .and_then(|a| hearth_api::parse_age(a).ok()),
        runs: &runs,
    };
    let p = plan::plan(&inputs);

    for victim in &p.delete {
        let kind = run_kind(sch);
        if ctx.store.mark_deleting(kind, victim)? {
            ctx.event(
                kind,
                victim,
                EventType::Normal,
                "Deleting",
                &format!("deletion requested by the retention of schedule {name:?}"),
            );
            ctx.wake(kind, victim);
        }
    }
    if !p.delete.is_empty() {
        ctx.event(
            Kind::VirtualMachineSnapshotSchedule,
            name,
            EventType::Normal,
            "Pruned",
            &format!("retention deletes {}", p.delete.join(", ")),
        );
    }

    let left: Vec<&Run> = runs
        .iter()
        .filter(|r| !p.delete.contains(&r.name))
        .collect();
    let ready = left
        .iter()
        .filter(|r| matches!(r.state, RunState::Ready { .. }))
        .count() as u32;
    let active: Vec<String> = left
        .iter()
        .filter(|r| r.state == RunState::Active)
        .map(|r| r.name.clone())
        .collect();
    // The newest finished run of the newest slot says how the last one went.
    let newest_slot = left
        .iter()
        .filter(|r| r.state != RunState::Active)
        .map(|r| r.slot)
        .max();
    let finished = newest_slot.map(|slot| {
        let failed = left
            .iter()
            .any(|r| r.slot == slot && r.state == RunState::Failed);
        if failed {
            RunResult::Failed
        } else {
            RunResult::Succeeded
        }
    });

    let after = After {
        next: p.next,
        retention_at: p.retention_at,
        ready,
        active: active.clone(),
        generation,
    };
    match p.slot {
        Some(Slot::Run(slot)) => {
            start_run(ctx, sch, slot, now, group_mode, &after)?;
        }
        Some(Slot::Skip(slot, why)) => {
            record_skip(ctx, name, slot, why, !sch.spec.suspend, &after);
        }
        Some(Slot::Wait(_)) | None => {
            set_status(ctx, name, |s| {
                s.next_run_time = if sch.spec.suspend { None } else { p.next };
                s.next_retention_time = p.retention_at;
                s.snapshots = ready;
                s.active = active.clone();
                if active.is_empty()
                    && finished.is_some()
                    && s.last_result != Some(RunResult::Skipped)
                {
                    if s.last_result == Some(RunResult::Running) {
                        s.message = None;
                    }
                    s.last_result = finished;
                }
                s.observed_generation = generation;
            });
        }
    }
    Ok(Action::RequeueAfter(p.wake_in))
}

/// The kind of a run's objects: a group, a VM snapshot per VM, or a
/// backup per VM.
fn run_kind(sch: &VirtualMachineSnapshotSchedule) -> Kind {
    if sch.spec.virtual_machine_snapshot_group_template.is_some() {
        Kind::VirtualMachineSnapshotGroup
    } else if sch.spec.backup.is_some() {
        Kind::VirtualMachineBackup
    } else {
        Kind::VirtualMachineSnapshot
    }
}

fn calendar_of(sch: &VirtualMachineSnapshotSchedule) -> Result<Zoned, String> {
    let schedule =
        Schedule::parse(&sch.spec.schedule).map_err(|e| format!("spec.schedule: {e}"))?;
    let zone = match &sch.spec.time_zone {
        Some(z) => parse_time_zone(z).map_err(|e| format!("spec.timeZone: {e}"))?,
        None => chrono_tz::UTC,
    };
    Ok(Zoned { schedule, zone })
}

fn set_status(ctx: &Context, name: &str, f: impl FnOnce(&mut ScheduleStatus)) {
    if let Err(e) = ctx
        .store
        .update_status(Kind::VirtualMachineSnapshotSchedule, name, f)
    {
        tracing::warn!(schedule = name, error = %e, "cannot write status");
    }
}

/// The schedule's runs (those being deleted left out), with whether each
/// is still used by a disk made from it or by an export or a restore.
fn runs_of(ctx: &Context, schedule: &str, kind: Kind) -> Result<Vec<Run>, ReconcileError> {
    let mine = |o: &StoredObject| {
        !o.deleting
            && o.object
                .metadata()
                .labels
                .get(labels::SCHEDULE)
                .map(String::as_str)
                == Some(schedule)
    };
    let disks_from: HashSet<String> = ctx
        .store
        .list(Kind::VirtualDisk)?
        .into_iter()
        .filter_map(|d| match d.object {
            Object::VirtualDisk(d) => match d.spec.source {
                DiskSource::Snapshot(s) => Some(s),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let vm_snapshots: BTreeMap<String, StoredObject> = ctx
        .store
        .list(Kind::VirtualMachineSnapshot)?
        .into_iter()
        .map(|o| (o.object.name().to_string(), o))
        .collect();
    let used = |vm_snapshot: &SnapshotStatus| {
        vm_snapshot
            .virtual_disk_snapshot_names
            .iter()
            .any(|d| disks_from.contains(d) || ctx.exports.busy(d))
    };
    let status_of = |o: &StoredObject| -> SnapshotStatus {
        serde_json::from_value(o.status.clone()).unwrap_or_default()
    };
    let run_of = |o: &StoredObject, bucket: String, in_use: bool| -> Option<Run> {
        let meta = o.object.metadata();
        let slot = meta
            .annotations
            .get(annotations::SCHEDULE_SLOT)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())?
            .with_timezone(&Utc);
        let st = status_of(o);
        let state = match st.phase {
            SnapshotPhase::Ready => RunState::Ready {
                cut: st.cut_time.or(meta.creation_timestamp).unwrap_or(slot),
            },
            SnapshotPhase::Failed => RunState::Failed,
            _ => RunState::Active,
        };
        Some(Run {
            name: meta.name.clone(),
            bucket,
            slot,
            state,
            pinned: meta.labels.get(labels::KEEP).map(String::as_str) == Some("true"),
            in_use,
        })
    };
    let mut runs = Vec::new();
    if kind == Kind::VirtualMachineBackup {
        for o in ctx.store.list(Kind::VirtualMachineBackup)? {
            let Object::VirtualMachineBackup(b) = &o.object else {
                continue;
            };
            if o.deleting
                || b.metadata.labels.get(labels::SCHEDULE).map(String::as_str) != Some(schedule)
            {
                continue;
            }
            let Some(slot) = b
                .metadata
                .annotations
                .get(annotations::SCHEDULE_SLOT)
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map(|t| t.with_timezone(&Utc))
            else {
                continue;
            };
            let st: hearth_api::BackupStatus =
                serde_json::from_value(o.status.clone()).unwrap_or_default();
            let state = match st.phase {
                hearth_api::BackupPhase::Ready => RunState::Ready {
                    cut: st
                        .cut_time
                        .or(b.metadata.creation_timestamp)
                        .unwrap_or(slot),
                },
                hearth_api::BackupPhase::Failed => RunState::Failed,
                _ => RunState::Active,
            };
            runs.push(Run {
                name: b.metadata.name.clone(),
                bucket: b.spec.virtual_machine_name.clone(),
                slot,
                state,
                pinned: b.metadata.labels.get(labels::KEEP).map(String::as_str) == Some("true"),
                // Deleting a backup object keeps its files and the
                // checkpoint the next incremental needs.
                in_use: false,
            });
        }
        return Ok(runs);
    }
    if kind == Kind::VirtualMachineSnapshotGroup {
        for g in ctx.store.list(Kind::VirtualMachineSnapshotGroup)? {
            if !mine(&g) {
                continue;
            }
            let st = status_of(&g);
            let in_use = st
                .virtual_machine_snapshot_names
                .iter()
                .any(|m| vm_snapshots.get(m).is_some_and(|o| used(&status_of(o))));
            runs.extend(run_of(&g, String::new(), in_use));
        }
    } else {
        for o in vm_snapshots.values().filter(|o| mine(o)) {
            let Object::VirtualMachineSnapshot(s) = &o.object else {
                continue;
            };
            let in_use = used(&status_of(o));
            runs.extend(run_of(o, s.spec.virtual_machine_name.clone(), in_use));
        }
    }
    Ok(runs)
}

/// The VMs the schedule covers now: its names, or those its selector matches.
fn covered(
    ctx: &Context,
    sch: &VirtualMachineSnapshotSchedule,
) -> Result<Vec<String>, ReconcileError> {
    let Some(sel) = &sch.spec.selector else {
        return Ok(sch.spec.virtual_machine_names.clone());
    };
    let mut names: Vec<String> = ctx
        .store
        .list(Kind::VirtualMachine)?
        .into_iter()
        .filter(|o| !o.deleting && sel.matches(&o.object.metadata().labels))
        .map(|o| o.object.name().to_string())
        .collect();
    names.sort();
    Ok(names)
}

/// The metadata of an object a schedule's run makes.
fn run_meta(sch: &str, name: String, slot: DateTime<Utc>, now: DateTime<Utc>) -> ObjectMeta {
    ObjectMeta {
        name,
        creation_timestamp: Some(now),
        generation: 1,
        managed_by: Some(format!("{MANAGED_BY_PREFIX}{sch}")),
        labels: BTreeMap::from([(labels::SCHEDULE.to_string(), sch.to_string())]),
        annotations: BTreeMap::from([(
            annotations::SCHEDULE_SLOT.to_string(),
            slot.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        )]),
    }
}

/// What the status says after this pass, whatever the slot did.
struct After {
    next: Option<DateTime<Utc>>,
    retention_at: Option<DateTime<Utc>>,
    ready: u32,
    active: Vec<String>,
    generation: u64,
}

/// A slot passed without a run: its time is handled, and why is said
/// (as a warning, unless the schedule is suspended).
fn record_skip(
    ctx: &Context,
    name: &str,
    slot: DateTime<Utc>,
    why: String,
    warn: bool,
    after: &After,
) {
    if warn {
        ctx.event(
            Kind::VirtualMachineSnapshotSchedule,
            name,
            EventType::Warning,
            "RunSkipped",
            &format!("the run of {} is skipped: {why}", slot.to_rfc3339()),
        );
    }
    set_status(ctx, name, |s| {
        s.last_schedule_time = Some(slot);
        s.last_result = Some(RunResult::Skipped);
        s.message = Some(why);
        s.next_run_time = after.next;
        s.next_retention_time = after.retention_at;
        s.snapshots = after.ready;
        s.active = after.active.clone();
        s.observed_generation = after.generation;
    });
}

fn start_run(
    ctx: &Arc<Context>,
    sch: &VirtualMachineSnapshotSchedule,
    slot: DateTime<Utc>,
    now: DateTime<Utc>,
    group_mode: bool,
    after: &After,
) -> Result<(), ReconcileError> {
    let name = sch.metadata.name.as_str();
    let vms = covered(ctx, sch)?;
    let skip = |why: String| record_skip(ctx, name, slot, why, true, after);
    if vms.is_empty() {
        skip("no VirtualMachine matches the selector".into());
        return Ok(());
    }
    let objects: Vec<Object> = if let Some(bk) = &sch.spec.backup {
        vms.iter()
            .map(|vm| {
                Object::VirtualMachineBackup(hearth_api::VirtualMachineBackup {
                    api_version: hearth_api::API_VERSION.into(),
                    kind: Kind::VirtualMachineBackup.as_str().into(),
                    metadata: run_meta(name, format!("{name}-{vm}-{}", stamp(slot)), slot, now),
                    spec: hearth_api::VirtualMachineBackupSpec {
                        virtual_machine_name: vm.clone(),
                        to: bk.to.join(vm),
                        mode: hearth_api::BackupMode::Auto,
                        required_consistency: sch.spec.required_consistency,
                        keep: bk.keep,
                        full_every: bk.full_every,
                    },
                    status: None,
                })
            })
            .collect()
    } else if group_mode {
        vec![Object::VirtualMachineSnapshotGroup(
            VirtualMachineSnapshotGroup {
                api_version: hearth_api::API_VERSION.into(),
                kind: Kind::VirtualMachineSnapshotGroup.as_str().into(),
                metadata: run_meta(name, format!("{name}-{}", stamp(slot)), slot, now),
                spec: VirtualMachineSnapshotGroupSpec {
                    virtual_machine_names: vms.clone(),
                    required_consistency: sch.spec.required_consistency,
                },
                status: None,
            },
        )]
    } else {
        vms.iter()
            .map(|vm| {
                Object::VirtualMachineSnapshot(VirtualMachineSnapshot {
                    api_version: hearth_api::API_VERSION.into(),
                    kind: Kind::VirtualMachineSnapshot.as_str().into(),
                    metadata: run_meta(name, format!("{name}-{vm}-{}", stamp(slot)), slot, now),
                    spec: VirtualMachineSnapshotSpec {
                        virtual_machine_name: vm.clone(),
                        required_consistency: sch.spec.required_consistency,
                    },
                    status: None,
                })
            })
            .collect()
    };
    for o in &objects {
        if let Err(why) = hearth_api::check_dns_label(o.name()) {
            skip(format!(
                "the snapshot name {why}; use a shorter schedule name"
            ));
            return Ok(());
        }
        if ctx.store.get(o.kind(), o.name())?.is_some() {
            skip(format!("{} already exists", o.display_name()));
            return Ok(());
        }
    }
    let names: Vec<String> = objects.iter().map(|o| o.name().to_string()).collect();
    // The run's objects and the status naming its slot in one transaction:
    // a crash leaves both or neither, and a run that exists marks its slot
    // done even if only the objects were read back.
    ctx.store.with_tx(|tx| {
        for o in &objects {
            // Every run kind's first status: Pending.
            Store::create_with_status_tx(tx, o, &serde_json::json!({"phase": "Pending"}))?;
        }
        Store::update_status_tx::<ScheduleStatus, _>(
            tx,
            Kind::VirtualMachineSnapshotSchedule,
            name,
            |s| {
                s.last_schedule_time = Some(slot);
                s.last_run_time = Some(now);
                s.last_result = Some(RunResult::Running);
                s.message = None;
                s.next_run_time = after.next;
                s.next_retention_time = after.retention_at;
                s.active = names.clone();
                s.snapshots = after.ready;
                s.observed_generation = after.generation;
            },
        )?;
        Ok(())
    })?;
    for o in &objects {
        ctx.wake(o.kind(), o.name());
    }
    ctx.event(
        Kind::VirtualMachineSnapshotSchedule,
        name,
        EventType::Normal,
        "RunStarted",
        &format!(
            "the run of {} requested {}",
            slot.to_rfc3339(),
            names.join(", ")
        ),
    );
    Ok(())
}
