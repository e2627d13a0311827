//! VirtualDisk reconcile: make the disk's first layer exist (blank, an
//! overlay over a read-only base image, or an overlay over a snapshot's
//! layer), report its size, and let its layers go when it is deleted.

use std::sync::Arc;

use hearth_api::{
    DiskPhase, DiskSource, EventType, Kind, Object, SnapshotPhase, SnapshotStatus, VirtualDisk,
    VirtualDiskStatus,
};
use hearth_qemu::img;

use crate::context::{Context, ReconcileError};
use crate::snapshot::storage;

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<(), ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualDisk, name)? else {
        return Ok(());
    };
    let Object::VirtualDisk(disk) = &stored.object else {
        return Ok(());
    };
    let users = ctx.vms_using_disk(name)?;

    if stored.deleting {
        // Never while a snapshot cut of the disk runs, or its VM starts: both
        // hold this lock until they are done.
        let _ops = ctx.ops_lock(&format!("disk/{name}")).lock_owned().await;
        if let Some(vm) = ctx.vms_using_disk(name)?.first() {
            // Refused at the API; this only happens if a VM arrived since.
            return Err(ReconcileError::Failed(format!(
                "VirtualDisk {name:?} is still used by VirtualMachine {vm:?}"
            )));
        }
        crate::snapshot::overlays::settle_offline(&ctx.store, &[name.to_string()])
            .await
            .map_err(ReconcileError::Failed)?;
        crate::snapshot::compaction::settle_offline(ctx, &[name.to_string()])
            .await
            .map_err(ReconcileError::Failed)?;
        // Snapshots of the disk keep the layers they need.
        storage::drop_head(&ctx.store, name)?;
        let freed = storage::collect_garbage(&ctx.store)?;
        ctx.store.remove(Kind::VirtualDisk, name)?;
        if let DiskSource::VirtualImage(image) = &disk.spec.source {
            // Its usedBy changes, and it may be deleted now.
            ctx.wake(Kind::VirtualImage, image);
        }
        ctx.event(
            Kind::VirtualDisk,
            name,
            EventType::Normal,
            "Deleted",
            &format!(
                "{} layer file(s) no longer needed were removed",
                freed.len()
            ),
        );
        return Ok(());
    }

    let was_ready = serde_json::from_value::<VirtualDiskStatus>(stored.status.clone())
        .map(|s| s.phase == DiskPhase::Ready)
        .unwrap_or(false);
    let head = match storage::head(&ctx.store, name)? {
        Some(h) => h,
        None => {
            if let DiskSource::Snapshot(snap) = &disk.spec.source {
                // A restore waits for its snapshot to be Ready.
                if let Some(why) = snapshot_not_ready(ctx, snap)? {
                    ctx.set_disk_status(name, |s| {
                        s.phase = if why.1 {
                            DiskPhase::Failed
                        } else {
                            DiskPhase::Pending
                        };
                        s.last_error = Some(why.0.clone());
                    });
                    return Ok(());
                }
            }
            if let DiskSource::VirtualImage(image) = &disk.spec.source {
                // A disk from an image waits for the image to be Ready.
                let size = disk.spec.size.as_ref().map(|q| q.bytes());
                if let Err(why) = crate::image::ready_for_disk(&ctx.store, image, size)? {
                    let never = why.is_permanent();
                    let message = why.message();
                    let old: VirtualDiskStatus =
                        serde_json::from_value(stored.status.clone()).unwrap_or_default();
                    if never && old.last_error.as_deref() != Some(message.as_str()) {
                        ctx.event(
                            Kind::VirtualDisk,
                            name,
                            EventType::Warning,
                            "CreateFailed",
                            &message,
                        );
                    }
                    ctx.set_disk_status(name, |s| {
                        s.phase = if never {
                            DiskPhase::Failed
                        } else {
                            DiskPhase::Pending
                        };
                        s.last_error = Some(message.clone());
                    });
                    // The image lists the disks waiting for it too.
                    ctx.wake(Kind::VirtualImage, image);
                    return Ok(());
                }
            }
            if let Err(message) = create(ctx, name, disk).await {
                ctx.set_disk_status(name, |s| {
                    s.phase = DiskPhase::Failed;
                    s.last_error = Some(message.clone());
                });
                ctx.event(
                    Kind::VirtualDisk,
                    name,
                    EventType::Warning,
                    "CreateFailed",
                    &message,
                );
                return Err(ReconcileError::Failed(message));
            }
            let head = storage::head(&ctx.store, name)?.ok_or_else(|| {
                ReconcileError::Failed("the new disk image was not recorded".into())
            })?;
            ctx.event(
                Kind::VirtualDisk,
                name,
                EventType::Normal,
                "Created",
                &format!("created {}", head.path.display()),
            );
            if let DiskSource::VirtualImage(image) = &disk.spec.source {
                ctx.wake(Kind::VirtualImage, image);
            }
            head
        }
    };
    // `-U`: the image may be open by a running QEMU.
    let info = img::info(&head.path).await.map_err(|e| {
        ReconcileError::Failed(format!("qemu-img info {}: {e}", head.path.display()))
    })?;
    let attached = users.first().cloned();
    let chains = crate::snapshot::compaction::chains(&ctx.store)?;
    let chain_length = chains.chain(&head.id).len() as u32;
    if !crate::snapshot::compaction::plan(&chains, &head.id).is_empty()
        || !crate::snapshot::compaction::intents_of_disk(&ctx.store, name)?.is_empty()
    {
        // Layers nobody needs (a snapshot deleted while the VM ran, merged
        // once it stopped; a merge a restart interrupted): the actor that
        // serves the disk merges them, and says why when it cannot yet.
        ctx.snapshots.compact(ctx, name);
    }
    ctx.set_disk_status(name, |s| {
        s.phase = DiskPhase::Ready;
        s.path = Some(head.path.clone());
        s.capacity = Some(info.virtual_size);
        s.allocated = Some(info.actual_size);
        s.chain_length = Some(chain_length);
        s.attached_to = attached;
        s.last_error = None;
        s.observed_generation = disk.metadata.generation;
    });
    if !was_ready {
        // VMs and snapshots waiting for this disk can go on now.
        for vm in users {
            ctx.wake(Kind::VirtualMachine, &vm);
        }
        if let Ok(snaps) = ctx.store.list(Kind::VirtualDiskSnapshot) {
            for s in snaps {
                if let Object::VirtualDiskSnapshot(snap) = &s.object
                    && snap.spec.virtual_disk_name == name
                {
                    ctx.wake(Kind::VirtualDiskSnapshot, &snap.metadata.name);
                }
            }
        }
    }
    Ok(())
}

/// Why a snapshot cannot be restored yet; `true` when it never will be.
fn snapshot_not_ready(ctx: &Context, snap: &str) -> Result<Option<(String, bool)>, ReconcileError> {
    let Some(s) = ctx.store.get(Kind::VirtualDiskSnapshot, snap)? else {
        return Ok(Some((
            format!("spec.source.snapshot: VirtualDiskSnapshot {snap:?} does not exist"),
            true,
        )));
    };
    if s.deleting {
        return Ok(Some((
            format!("spec.source.snapshot: VirtualDiskSnapshot {snap:?} is being deleted"),
            true,
        )));
    }
    let status: SnapshotStatus = serde_json::from_value(s.status).unwrap_or_default();
    Ok(match status.phase {
        SnapshotPhase::Ready => None,
        SnapshotPhase::Failed => Some((
            format!("spec.source.snapshot: VirtualDiskSnapshot {snap:?} failed"),
            true,
        )),
        p => Some((
            format!("spec.source.snapshot: waiting for VirtualDiskSnapshot {snap:?} ({p})"),
            false,
        )),
    })
}

async fn create(ctx: &Context, name: &str, disk: &VirtualDisk) -> Result<(), String> {
    let state_dir = ctx.config.state_dir.clone();
    let dir = storage::layers_dir(&state_dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let new = storage::allocate(&ctx.store, &state_dir, name).map_err(|e| e.to_string())?;
    let size = disk.spec.size.as_ref().map(|q| q.bytes());
    let mut backing_layer = None;
    let mut base_image = None;
    let mut source_image = None;
    // A restore holds its snapshot's pin from reading the snapshot's layer
    // until the new layer over it is recorded (from then on the store
    // itself keeps the layer): the snapshot's delete waits for it, and so
    // does a merge into the layer.
    let mut _pin = None;
    match &disk.spec.source {
        DiskSource::Blank(_) => {
            let size = size.ok_or("spec.size: a blank disk needs a size")?;
            img::create_blank(&new.path, size)
                .await
                .map_err(|e| format!("cannot create blank disk: {e}"))?;
        }
        DiskSource::Image(base) => {
            let base = ctx
                .config
                .confine(base)
                .map_err(|e| format!("spec.source.image: {e}"))?;
            check_base_header(&base).map_err(|e| format!("spec.source.image: {e}"))?;
            let base_info = img::info(&base)
                .await
                .map_err(|e| format!("spec.source.image: {}: {e}", base.display()))?;
            match size {
                Some(s) if s < base_info.virtual_size => {
                    return Err(format!(
                        "spec.size: {s} bytes is smaller than the base image ({} bytes)",
                        base_info.virtual_size
                    ));
                }
                None if base_info.virtual_size > hearth_api::MAX_DISK_BYTES => {
                    return Err(format!(
                        "spec.source.image: {}",
                        crate::image::too_large(
                            &format!("the base image {}", base.display()),
                            base_info.virtual_size
                        )
                    ));
                }
                _ => {}
            }
            img::create_overlay(&new.path, &base, &base_info.format, size)
                .await
                .map_err(|e| format!("cannot create overlay: {e}"))?;
            // The chain every start checks ends in exactly this file.
            source_image = Some((base, base_info.format));
        }
        DiskSource::Snapshot(snap) => {
            _pin = Some(ctx.exports.of(snap).read_owned().await);
            // Read again under the pin: a delete that got it first is done.
            if let Some((why, _)) = snapshot_not_ready(ctx, snap).map_err(|e| e.to_string())? {
                return Err(why);
            }
            let layer = storage::snapshot_layer(&ctx.store, snap)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| {
                    format!("spec.source.snapshot: VirtualDiskSnapshot {snap:?} has no layer")
                })?;
            let info = img::info(&layer.path).await.map_err(|e| e.to_string())?;
            // Only a new overlay: the restore costs the same for any disk size.
            img::create_overlay_unopened(&new.path, &layer.path, "qcow2", info.virtual_size)
                .await
                .map_err(|e| format!("cannot create overlay: {e}"))?;
            backing_layer = Some(layer.id);
        }
        DiskSource::VirtualImage(image) => {
            let ready = crate::image::ready_for_disk(&ctx.store, image, size)
                .map_err(|e| e.to_string())?
                .map_err(|why| why.message())?;
            // The image file is the overlay's backing file, opened read-only;
            // a larger size grows the disk.
            img::create_overlay(&new.path, &ready.path, &ready.format, size)
                .await
                .map_err(|e| format!("cannot create overlay: {e}"))?;
            base_image = Some(ready.path);
        }
    }
    // Recorded once the file is complete: a crash before this leaves only an
    // unreferenced file, never a disk pointing at a half-made image. The
    // image file below it is recorded with it, so the image store keeps it
    // while this layer (or a snapshot or restored disk above it) exists.
    ctx.store
        .with_tx(|tx| {
            storage::set_head_tx(tx, name, &new, backing_layer.as_deref())?;
            if let Some(base) = &base_image {
                storage::set_layer_base_tx(tx, &new.id, base)?;
            }
            if let Some((base, format)) = &source_image {
                storage::set_layer_source_image_tx(tx, &new.id, base, format)?;
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A base image is read by QEMU with whatever it references: like an
/// imported image, it may name no other file (a qcow2 backing or data file,
/// a VMDK extent). Read here, before `qemu-img` or QEMU opens it.
fn check_base_header(base: &std::path::Path) -> Result<(), String> {
    use hearth_qemu::probe::{self, Sniffed};
    use std::io::Read;
    let mut head = Vec::with_capacity(probe::HEAD_BYTES);
    std::fs::File::open(base)
        .and_then(|f| f.take(probe::HEAD_BYTES as u64).read_to_end(&mut head))
        .map_err(|e| format!("{}: {e}", base.display()))?;
    match probe::sniff(&head) {
        Ok(Sniffed::Qcow2(header)) => header
            .check()
            .map_err(|r| format!("{}: refused: {r}", base.display())),
        Ok(Sniffed::Raw(_)) => Ok(()),
        Ok(Sniffed::Other(format)) => Err(format!(
            "{}: a {format} image is refused ({format} images can name other files); convert it: qemu-img convert -O qcow2 IN OUT",
            base.display()
        )),
        Err(r) => Err(format!("{}: refused: {r}", base.display())),
    }
}
