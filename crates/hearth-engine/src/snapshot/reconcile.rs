//! Reconcile of the snapshot kinds. Level-triggered like the rest: a
//! snapshot is recorded durably as Pending before anything touches the
//! guest; its VM's actor takes it from there.

use std::sync::Arc;

use hearth_api::{
    API_VERSION, EventType, Kind, Object, ObjectMeta, SnapshotPhase, SnapshotStatus,
    VirtualDiskSnapshot, VirtualDiskSnapshotSpec, check_dns_label,
};

use super::actor::{request_of, target_of};
use super::storage;
use crate::context::{Action, Context, ReconcileError};
use crate::store::Store;

fn status_of(v: &serde_json::Value) -> SnapshotStatus {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

pub async fn reconcile_disk_snapshot(
    ctx: &Arc<Context>,
    name: &str,
) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualDiskSnapshot, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualDiskSnapshot(snap) = &stored.object else {
        return Ok(Action::Done);
    };
    let status = status_of(&stored.status);
    if stored.deleting {
        if status.phase == SnapshotPhase::InProgress {
            // Its cut is running: show it, and let the cut's commit wake us.
            // Deleting right away would be safe too (the commit skips objects
            // that are gone), this only keeps the story readable.
            ctx.set_snapshot_status(Kind::VirtualDiskSnapshot, name, |s| {
                s.phase = SnapshotPhase::Terminating
            });
            return Ok(Action::Done);
        }
        // An export reading the snapshot's layers, or a restore reading its
        // layer until the restored disk is recorded, holds its pin: wait
        // for it, so the layers are not collected or merged away under it.
        let pin = ctx.exports.of(name);
        let _pin = match pin.clone().try_write_owned() {
            Ok(held) => held,
            Err(_) => {
                ctx.event(
                    Kind::VirtualDiskSnapshot,
                    name,
                    EventType::Normal,
                    "DeleteWaiting",
                    "an export or a restore is reading the snapshot's layers; it is deleted when that read ends",
                );
                pin.write_owned().await
            }
        };
        // The object and its layer reference go together, so a cut committing
        // at the same moment either sees both or neither.
        ctx.store.with_tx(|tx| {
            storage::drop_snapshot_layer_tx(tx, name)?;
            Store::remove_tx(tx, Kind::VirtualDiskSnapshot, name)
        })?;
        let freed = storage::collect_garbage(&ctx.store)?;
        // Layers of the chain that nobody needs now are merged by the
        // actor serving the disk (docs/snapshots.md, "Compaction").
        ctx.snapshots.compact(ctx, &snap.spec.virtual_disk_name);
        ctx.event(
            Kind::VirtualDiskSnapshot,
            name,
            EventType::Normal,
            "Deleted",
            &format!(
                "{} layer file(s) no longer needed were removed",
                freed.len()
            ),
        );
        if let Some(parent) = &status.virtual_machine_snapshot_name {
            ctx.wake(Kind::VirtualMachineSnapshot, parent);
        }
        return Ok(Action::Done);
    }
    if status.phase != SnapshotPhase::Pending {
        return Ok(Action::Done);
    }
    let disk = &snap.spec.virtual_disk_name;
    let Some(disk_obj) = ctx.store.get(Kind::VirtualDisk, disk)? else {
        fail(
            ctx,
            Kind::VirtualDiskSnapshot,
            name,
            "DiskNotFound",
            &format!("VirtualDisk {disk:?} does not exist"),
        );
        return Ok(Action::Done);
    };
    if disk_obj.deleting {
        fail(
            ctx,
            Kind::VirtualDiskSnapshot,
            name,
            "DiskDeleting",
            &format!("VirtualDisk {disk:?} is being deleted"),
        );
        return Ok(Action::Done);
    }
    if storage::head(&ctx.store, disk)?.is_none() {
        // The disk's image is not made yet; its reconcile wakes us.
        return Ok(Action::Done);
    }
    if status.virtual_machine_snapshot_name.is_some() {
        // Requested together with its siblings by the VM snapshot.
        return Ok(Action::Done);
    }
    let target = target_of(ctx, disk)?;
    ctx.snapshots
        .request(ctx, &target, vec![request_of(&ctx.store, snap)]);
    Ok(Action::Done)
}

/// A snapshot of either kind that can never be taken, with the reason.
fn fail(ctx: &Context, kind: Kind, name: &str, reason: &str, message: &str) {
    ctx.set_snapshot_status(kind, name, |s| {
        s.phase = SnapshotPhase::Failed;
        s.reason = Some(reason.into());
        s.message = Some(message.into());
    });
    ctx.event(kind, name, EventType::Warning, reason, message);
}

pub async fn reconcile_vm_snapshot(
    ctx: &Arc<Context>,
    name: &str,
) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualMachineSnapshot, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualMachineSnapshot(vmsnap) = &stored.object else {
        return Ok(Action::Done);
    };
    let status = status_of(&stored.status);
    let fail_vm = |reason: &str, message: &str| {
        fail(ctx, Kind::VirtualMachineSnapshot, name, reason, message)
    };

    if stored.deleting {
        let mut left = 0;
        for child in &status.virtual_disk_snapshot_names {
            if ctx.store.get(Kind::VirtualDiskSnapshot, child)?.is_some() {
                left += 1;
                ctx.store.mark_deleting(Kind::VirtualDiskSnapshot, child)?;
                ctx.wake(Kind::VirtualDiskSnapshot, child);
            }
        }
        if left == 0 {
            ctx.store.remove(Kind::VirtualMachineSnapshot, name)?;
            ctx.event(
                Kind::VirtualMachineSnapshot,
                name,
                EventType::Normal,
                "Deleted",
                "the VM snapshot and its disk snapshots are gone",
            );
        }
        return Ok(Action::Done);
    }

    match status.phase {
        SnapshotPhase::Pending => {
            let vm_name = &vmsnap.spec.virtual_machine_name;
            let Some(vm) = ctx.store.get(Kind::VirtualMachine, vm_name)? else {
                fail_vm(
                    "VirtualMachineNotFound",
                    &format!("VirtualMachine {vm_name:?} does not exist"),
                );
                return Ok(Action::Done);
            };
            let Object::VirtualMachine(vm) = &vm.object else {
                return Ok(Action::Done);
            };
            if vm.spec.disks.is_empty() {
                fail_vm(
                    "NoDisks",
                    &format!("VirtualMachine {vm_name:?} has no disks"),
                );
                return Ok(Action::Done);
            }
            let mut children = Vec::new();
            for d in &vm.spec.disks {
                let child = format!("{name}-{}", d.virtual_disk_name);
                if let Err(why) = check_dns_label(&child) {
                    fail_vm(
                        "NameTooLong",
                        &format!("the disk snapshot name {why}; use a shorter VM snapshot name"),
                    );
                    return Ok(Action::Done);
                }
                if ctx.store.get(Kind::VirtualDiskSnapshot, &child)?.is_some() {
                    fail_vm(
                        "NameTaken",
                        &format!("a VirtualDiskSnapshot named {child:?} already exists"),
                    );
                    return Ok(Action::Done);
                }
                children.push(VirtualDiskSnapshot {
                    api_version: API_VERSION.into(),
                    kind: Kind::VirtualDiskSnapshot.as_str().into(),
                    metadata: ObjectMeta {
                        name: child,
                        creation_timestamp: Some(chrono::Utc::now()),
                        generation: 1,
                        managed_by: Some(format!("VirtualMachineSnapshot/{name}")),
                        ..ObjectMeta::default()
                    },
                    spec: VirtualDiskSnapshotSpec {
                        virtual_disk_name: d.virtual_disk_name.clone(),
                        required_consistency: vmsnap.spec.required_consistency,
                    },
                    status: None,
                });
            }
            let names: Vec<String> = children.iter().map(|c| c.metadata.name.clone()).collect();
            // Children and the parent's status in one transaction: a crash
            // leaves either no children or all of them, each Pending.
            ctx.store.with_tx(|tx| {
                for c in &children {
                    let status = SnapshotStatus {
                        virtual_machine_snapshot_name: Some(name.to_string()),
                        ..SnapshotStatus::default()
                    };
                    Store::create_with_status_tx(
                        tx,
                        &Object::VirtualDiskSnapshot(c.clone()),
                        &status,
                    )?;
                }
                Store::update_status_tx::<SnapshotStatus, _>(
                    tx,
                    Kind::VirtualMachineSnapshot,
                    name,
                    |s| {
                        s.phase = SnapshotPhase::InProgress;
                        s.virtual_disk_snapshot_names = names.clone();
                        s.virtual_machine_spec = Some(Box::new(vm.spec.clone()));
                    },
                )?;
                Ok(())
            })?;
            // The actor first: the event's store write is not in its way.
            let requests = children.iter().map(|c| request_of(&ctx.store, c)).collect();
            ctx.snapshots
                .request(ctx, &format!("vm/{vm_name}"), requests);
            ctx.event(
                Kind::VirtualMachineSnapshot,
                name,
                EventType::Normal,
                "Requested",
                &format!("disk snapshots {} requested in one cut", names.join(", ")),
            );
        }
        SnapshotPhase::InProgress => {
            let mut children = Vec::new();
            for c in &status.virtual_disk_snapshot_names {
                match ctx.store.get(Kind::VirtualDiskSnapshot, c)? {
                    Some(s) => {
                        if let Object::VirtualDiskSnapshot(snap) = &s.object {
                            children.push((request_of(&ctx.store, snap), status_of(&s.status)));
                        }
                    }
                    None => {
                        fail_vm(
                            "DiskSnapshotDeleted",
                            &format!("its disk snapshot {c:?} was deleted"),
                        );
                        return Ok(Action::Done);
                    }
                }
            }
            let open: Vec<_> = children
                .iter()
                .filter(|(_, s)| s.phase == SnapshotPhase::Pending)
                .map(|(r, _)| r.clone())
                .collect();
            if !open.is_empty() {
                // Idempotent: the actor ignores requests it already has.
                let target = format!("vm/{}", vmsnap.spec.virtual_machine_name);
                ctx.snapshots.request(ctx, &target, open);
                return Ok(Action::Done);
            }
            if children.iter().any(|(_, s)| !s.phase.is_final()) {
                return Ok(Action::Done);
            }
            let failed: Vec<String> = children
                .iter()
                .filter(|(_, s)| s.phase == SnapshotPhase::Failed)
                .map(|(r, s)| format!("{}: {}", r.snapshot, s.message.clone().unwrap_or_default()))
                .collect();
            let first = children.first().map(|(_, s)| s.clone()).unwrap_or_default();
            let consistent = children.iter().all(|(_, s)| s.consistent == Some(true));
            let size: u64 = children.iter().filter_map(|(_, s)| s.size).sum();
            ctx.set_snapshot_status(Kind::VirtualMachineSnapshot, name, |s| {
                if s.phase.is_final() {
                    // Settled already (its group failed it).
                    return;
                }
                if failed.is_empty() {
                    s.phase = SnapshotPhase::Ready;
                    s.consistent = Some(consistent);
                } else {
                    s.phase = SnapshotPhase::Failed;
                    s.reason = Some("DiskSnapshotFailed".into());
                    s.message = Some(failed.join("; "));
                }
                s.cut_id = first.cut_id;
                s.cut_time = first.cut_time;
                s.freeze_window_ms = first.freeze_window_ms;
                s.size = Some(size);
            });
            // What made it goes on now, not at its next look.
            let managed_by = stored.object.metadata().managed_by.as_deref();
            if let Some(group) =
                managed_by.and_then(|m| m.strip_prefix(super::group::MANAGED_BY_PREFIX))
            {
                ctx.wake(Kind::VirtualMachineSnapshotGroup, group);
            }
            if let Some(backup) =
                managed_by.and_then(|m| m.strip_prefix(crate::backup::reconcile::MANAGED_BY_PREFIX))
            {
                ctx.wake(Kind::VirtualMachineBackup, backup);
            }
            crate::schedule::run_settled(ctx, Kind::VirtualMachineSnapshot, name);
            crate::metrics::snapshot_settled(
                ctx,
                Kind::VirtualMachineSnapshot,
                name,
                failed.is_empty(),
                first.freeze_window_ms,
            );
            ctx.event(
                Kind::VirtualMachineSnapshot,
                name,
                if failed.is_empty() {
                    EventType::Normal
                } else {
                    EventType::Warning
                },
                if failed.is_empty() { "Ready" } else { "Failed" },
                &if failed.is_empty() {
                    format!(
                        "all disk snapshots taken in cut {}, consistent: {consistent}",
                        first.cut_id.unwrap_or(0)
                    )
                } else {
                    failed.join("; ")
                },
            );
        }
        _ => {}
    }
    Ok(Action::Done)
}
