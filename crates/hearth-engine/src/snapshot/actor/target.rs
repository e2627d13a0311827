//! What the actor's parts read about a target: which actor serves a disk,
//! the request of a snapshot, the target's VM settings, its locks and its
//! events. A leaf, so the loop, the cut and the commit share it without
//! importing each other in a circle.

use hearth_api::{EventType, Kind, Object, VirtualDiskSnapshot};

use crate::context::Context;
use crate::snapshot::coordinator::{Millis, Request};
use crate::store::{Store, StoreError};

/// The actor that serves snapshots of `disk`: the VM whose running QEMU has
/// it (what the process was started with, whatever the spec says now), else
/// the VM whose spec lists it, else its own when no VM uses it.
pub fn target_of(ctx: &Context, disk: &str) -> Result<String, StoreError> {
    Ok(match ctx.vms_using_disk(disk)?.first() {
        Some(vm) => format!("vm/{vm}"),
        None => format!("disk/{disk}"),
    })
}

/// The object a target's events are about.
pub(super) fn event_subject(target: &str) -> (Kind, &str) {
    match target.strip_prefix("vm/") {
        Some(vm) => (Kind::VirtualMachine, vm),
        None => (Kind::VirtualDisk, target.trim_start_matches("disk/")),
    }
}

/// Takes the operations locks of a target and of every disk it may cut, in
/// the same order as a VM start or stop (VM first, disks sorted), so a VM
/// cannot start, stop or be restored, and a disk cannot be deleted or cut by
/// another actor, while a cut runs.
pub(super) async fn lock_target(
    ctx: &Context,
    target: &str,
) -> Vec<tokio::sync::OwnedMutexGuard<()>> {
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

/// The VM's `spec.freezeDeadlineSeconds`, in ms (10 s when there is no VM).
pub(super) fn deadline_of(ctx: &Context, target: &str) -> Millis {
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
                .and_then(|m| m.strip_prefix(crate::snapshot::group::MANAGED_BY_PREFIX))
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

pub(super) fn vm_event(ctx: &Context, target: &str, type_: EventType, reason: &str, message: &str) {
    match target.strip_prefix("vm/") {
        Some(vm) => ctx.event(Kind::VirtualMachine, vm, type_, reason, message),
        None => {
            let disk = target.trim_start_matches("disk/");
            ctx.event(Kind::VirtualDisk, disk, type_, reason, message)
        }
    }
}
