//! VirtualDisk reconcile: make the disk's first layer exist (blank, an
//! overlay over a read-only base image, or an overlay over a snapshot's
//! layer), report its size, and let its layers go when it is deleted.
//!
//! What a disk's status says about its files (capacity, allocated bytes) is
//! read from the files by hearthd itself, with no program: on every
//! reconcile (each comes from a hint: the disk was made, a cut, merge or
//! restore wrote its chain, its VM stopped) and, round robin, for a bounded
//! number of disks per resync. A resync does not reconcile every disk:
//! [`resync`] compares every disk's status with the store in one pass, the
//! layer graph built once, and wakes only the disks the store contradicts.
//! The compaction plan of a disk is made again only when its chain changed
//! (docs/reconciler.md "Disks").

mod create;
pub(crate) mod e2fs;
mod error;
mod files;
mod plan;
pub mod prepare;
pub mod registry;
mod resync;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use chrono::Utc;
use hearth_api::{DiskPhase, DiskSource, EventType, Kind, Object, VirtualDiskStatus};
use rusqlite::params;

use crate::context::{Action, Context, ReconcileError};
use crate::snapshot::storage::{self, NewLayer};
use crate::store::{Store, StoreError};
use create::{create, snapshot_not_ready};
use files::{Files, file_status};
use plan::plan_soon;
use registry::{AtRest, QuietPass};

pub use registry::Disks;
pub use resync::resync;

/// Disks whose allocated bytes one resync reads from their files (`stat`),
/// round robin: with more disks, each is refreshed every few resyncs.
pub const REFRESHES_PER_RESYNC: usize = 128;
/// Layer ids reserved in one commit, for new disks.
const IDS_PER_RESERVE: u64 = 64;

impl Disks {
    /// A new layer for `disk`, its id from a reserved block (one commit for
    /// many new disks).
    fn new_layer(
        &self,
        store: &Store,
        state_dir: &Path,
        disk: &str,
    ) -> Result<NewLayer, StoreError> {
        let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        if ids.is_empty() {
            let block = storage::reserve(store, IDS_PER_RESERVE)?;
            *ids = *block.start()..*block.end() + 1;
        }
        let n = ids.start;
        ids.start += 1;
        Ok(storage::numbered(state_dir, n, disk))
    }
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualDisk, name)? else {
        ctx.disks.forget(name);
        return Ok(Action::Done);
    };
    let Object::VirtualDisk(disk) = &stored.object else {
        return Ok(Action::Done);
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
            .map_err(|e| ReconcileError::Failed(e.to_string()))?;
        crate::snapshot::compaction::settle_offline(ctx, &[name.to_string()])
            .await
            .map_err(|e| ReconcileError::Failed(e.to_string()))?;
        // Snapshots of the disk keep the layers they need.
        storage::drop_head(&ctx.store, name)?;
        let freed = storage::collect_garbage(&ctx.store)?;
        ctx.store.remove(Kind::VirtualDisk, name)?;
        ctx.disks.forget(name);
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
        return Ok(Action::Done);
    }

    let was_ready = serde_json::from_value::<VirtualDiskStatus>(stored.status.clone())
        .map(|s| s.phase == DiskPhase::Ready)
        .unwrap_or(false);
    let attached = users.first().cloned();
    let generation = disk.metadata.generation;
    match storage::head(&ctx.store, name)? {
        Some(head) => {
            let files = file_status(&head.path).await?;
            let chain_length = chain_length(&ctx.store, &head.id)?;
            ctx.set_disk_status(name, |s| {
                set_ready(s, &head.path, files, chain_length, attached, generation)
            });
            // A hint came: the chain may have changed (a snapshot deleted,
            // a merge ended, the VM stopped): the planner looks at it.
            plan_soon(ctx, name);
        }
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
                    return Ok(Action::Done);
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
                    return Ok(Action::Done);
                }
            }
            let made = match create(ctx, name, disk).await {
                Ok(made) => made,
                Err(e) => {
                    let message = e.to_string();
                    ctx.set_disk_status(name, |s| {
                        s.phase = DiskPhase::Failed;
                        s.last_error = Some(message.clone());
                        s.restore_progress = None;
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
            };
            let path = made.layer.path.clone();
            let files = file_status(&path).await?;
            let chain_length = match &made.backing_layer {
                Some(below) => 1 + chain_length(&ctx.store, below)?,
                None => 1,
            };
            let message = format!("created {}", path.display());
            // Recorded once the file is complete: a crash before this leaves
            // only an unreferenced file, never a disk pointing at a half-made
            // image. The image file below it is recorded with it, so the
            // image store keeps it while this layer (or a snapshot or
            // restored disk above it) exists. Its event and Ready status go
            // in the same commit: one sync per new disk.
            ctx.store.with_tx(|tx| {
                storage::set_head_tx(tx, name, &made.layer, made.backing_layer.as_deref())?;
                if let Some(base) = &made.base_image {
                    storage::set_layer_base_tx(tx, &made.layer.id, base)?;
                }
                if let Some((base, format)) = &made.source_image {
                    storage::set_layer_source_image_tx(tx, &made.layer.id, base, format)?;
                }
                Store::record_event_tx(
                    tx,
                    Utc::now(),
                    Kind::VirtualDisk,
                    name,
                    EventType::Normal,
                    "Created",
                    &message,
                )?;
                Store::update_status_tx::<VirtualDiskStatus, _>(
                    tx,
                    Kind::VirtualDisk,
                    name,
                    |s| set_ready(s, &path, files, chain_length, attached, generation),
                )?;
                Ok(())
            })?;
            // The restore's pin on its snapshot goes once the layer over the
            // snapshot's layer is recorded.
            drop(made);
            tracing::info!(kind = "VirtualDisk", name, reason = "Created", "{message}");
            if let DiskSource::VirtualImage(image) = &disk.spec.source {
                ctx.wake(Kind::VirtualImage, image);
            }
        }
    }
    if !was_ready {
        // VMs and snapshots waiting for this disk can go on now.
        for vm in users {
            ctx.wake(Kind::VirtualMachine, &vm);
        }
        for snap in snapshots_of(&ctx.store, name)? {
            ctx.wake(Kind::VirtualDiskSnapshot, &snap);
        }
    }
    Ok(Action::Done)
}

fn set_ready(
    s: &mut VirtualDiskStatus,
    head: &Path,
    files: Files,
    chain_length: u32,
    attached: Option<String>,
    generation: u64,
) {
    s.phase = DiskPhase::Ready;
    s.path = Some(head.to_path_buf());
    s.capacity = Some(files.capacity);
    s.allocated = Some(files.allocated);
    s.chain_length = Some(chain_length);
    s.attached_to = attached;
    s.last_error = None;
    s.restore_progress = None;
    s.observed_generation = generation;
}

/// The VirtualDiskSnapshots of `disk`, found by the store (not by reading
/// every snapshot here).
fn snapshots_of(store: &Store, disk: &str) -> Result<Vec<String>, StoreError> {
    store.with_tx(|tx| {
        let mut stmt = tx.prepare(
            "SELECT name FROM objects
             WHERE kind = ?1 AND json_extract(body, '$.spec.virtualDiskName') = ?2
             ORDER BY name",
        )?;
        let rows = stmt.query_map(params![Kind::VirtualDiskSnapshot.as_str(), disk], |r| {
            r.get::<_, String>(0)
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    })
}

/// How many layers a disk reads through, walked down from `head` as
/// `Chains::chain` does.
fn chain_length(store: &Store, head: &str) -> Result<u32, StoreError> {
    store.with_tx(|tx| {
        let mut seen = HashSet::new();
        let mut at = Some(head.to_string());
        while let Some(id) = at {
            let Some(layer) = storage::layer_tx(tx, &id)? else {
                break;
            };
            if !seen.insert(id) {
                break;
            }
            at = layer.backing;
        }
        Ok(u32::try_from(seen.len()).unwrap_or(u32::MAX))
    })
}
