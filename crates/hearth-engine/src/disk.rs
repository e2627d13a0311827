//! VirtualDisk reconcile: make the qcow2 file exist (blank, or an overlay over
//! a read-only base image), report its size, remove it when deleted.

use std::sync::Arc;

use hearth_api::{DiskPhase, DiskSource, EventType, Kind, Object, VirtualDisk, VirtualDiskStatus};
use hearth_qemu::img;

use crate::engine::{Engine, ReconcileError};

pub async fn reconcile(engine: &Arc<Engine>, name: &str) -> Result<(), ReconcileError> {
    let Some(stored) = engine.store.get(Kind::VirtualDisk, name)? else {
        return Ok(());
    };
    let Object::VirtualDisk(disk) = &stored.object else {
        return Ok(());
    };
    let users = engine.vms_using_disk(name)?;
    let path = engine.config.disk_path(name);

    if stored.deleting {
        if let Some(vm) = users.first() {
            // Refused at the API; this only happens if a VM arrived since.
            return Err(ReconcileError::Failed(format!(
                "VirtualDisk {name:?} is still used by VirtualMachine {vm:?}"
            )));
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(ReconcileError::Failed(format!(
                    "cannot remove {}: {e}",
                    path.display()
                )));
            }
        }
        engine.store.remove(Kind::VirtualDisk, name)?;
        engine.event(
            Kind::VirtualDisk,
            name,
            EventType::Normal,
            "Deleted",
            &format!("removed {}", path.display()),
        );
        return Ok(());
    }

    let was_ready = serde_json::from_value::<VirtualDiskStatus>(stored.status.clone())
        .map(|s| s.phase == DiskPhase::Ready)
        .unwrap_or(false);
    if !path.exists() {
        if let Err(message) = create(engine, disk, &path).await {
            engine.set_disk_status(name, |s| {
                s.phase = DiskPhase::Failed;
                s.last_error = Some(message.clone());
            });
            engine.event(
                Kind::VirtualDisk,
                name,
                EventType::Warning,
                "CreateFailed",
                &message,
            );
            return Err(ReconcileError::Failed(message));
        }
        engine.event(
            Kind::VirtualDisk,
            name,
            EventType::Normal,
            "Created",
            &format!("created {}", path.display()),
        );
    }
    // `-U`: the image may be open by a running QEMU.
    let info = img::info(&path)
        .await
        .map_err(|e| ReconcileError::Failed(format!("qemu-img info {}: {e}", path.display())))?;
    let attached = users.first().cloned();
    engine.set_disk_status(name, |s| {
        s.phase = DiskPhase::Ready;
        s.path = Some(path.clone());
        s.capacity = Some(info.virtual_size);
        s.allocated = Some(info.actual_size);
        s.attached_to = attached;
        s.last_error = None;
        s.observed_generation = disk.metadata.generation;
    });
    if !was_ready {
        // VMs waiting for this disk can start now.
        for vm in users {
            engine.wake(Kind::VirtualMachine, &vm);
        }
    }
    Ok(())
}

async fn create(engine: &Engine, disk: &VirtualDisk, path: &std::path::Path) -> Result<(), String> {
    let dir = engine.config.disks_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Created under a temporary name and renamed, so a crash never leaves a
    // half-made image under the real name.
    let tmp = path.with_extension("qcow2.partial");
    let _ = std::fs::remove_file(&tmp);
    let size = disk.spec.size.as_ref().map(|q| q.bytes());
    match &disk.spec.source {
        DiskSource::Blank(_) => {
            let size = size.ok_or("spec.size: a blank disk needs a size")?;
            img::create_blank(&tmp, size)
                .await
                .map_err(|e| format!("cannot create blank disk: {e}"))?;
        }
        DiskSource::Image(base) => {
            let base = engine
                .config
                .confine(base)
                .map_err(|e| format!("spec.source.image: {e}"))?;
            let base_info = img::info(&base)
                .await
                .map_err(|e| format!("spec.source.image: {}: {e}", base.display()))?;
            if let Some(s) = size
                && s < base_info.virtual_size
            {
                return Err(format!(
                    "spec.size: {s} bytes is smaller than the base image ({} bytes)",
                    base_info.virtual_size
                ));
            }
            img::create_overlay(&tmp, &base, &base_info.format, size)
                .await
                .map_err(|e| format!("cannot create overlay: {e}"))?;
        }
        DiskSource::Snapshot(_) => return Err("restoring from a snapshot is not available".into()),
    }
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}
