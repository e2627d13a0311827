//! Making a new disk's first layer: a blank image, an overlay over an
//! administrator's base image or a VirtualImage's file, or an overlay over
//! a snapshot's layer. The caller records it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hearth_api::{DiskSource, Kind, SnapshotPhase, SnapshotStatus, VirtualDisk};
use hearth_qemu::img;

use super::error::{BaseHeaderError, BlankError, DiskError};
use super::files::write_sparse;
use crate::context::Context;
use crate::snapshot::storage::{self, NewLayer};
use crate::store::StoreError;

/// Blank images kept in memory, one per disk size.
const BLANKS_KEPT: usize = 8;

/// A new disk's first layer, made but not recorded yet.
pub(super) struct Made {
    pub(super) layer: NewLayer,
    pub(super) backing_layer: Option<String>,
    pub(super) base_image: Option<PathBuf>,
    /// An administrator's base image (`spec.source.image`) and its format:
    /// the chain every start checks ends in exactly this file.
    pub(super) source_image: Option<(PathBuf, String)>,
    /// A restore holds its snapshot's pin from reading the snapshot's layer
    /// until the new layer over it is recorded (from then on the store
    /// itself keeps the layer): the snapshot's delete waits for it, and so
    /// does a merge into the layer.
    _pin: Option<tokio::sync::OwnedRwLockReadGuard<()>>,
}

/// Makes the file of `disk`'s first layer; the caller records it.
pub(super) async fn create(
    ctx: &Context,
    name: &str,
    disk: &VirtualDisk,
) -> Result<Made, DiskError> {
    let state_dir = ctx.config.state_dir.clone();
    let dir = storage::layers_dir(&state_dir);
    std::fs::create_dir_all(&dir).map_err(|source| DiskError::Dir {
        path: dir.clone(),
        source,
    })?;
    let new = ctx.disks.new_layer(&ctx.store, &state_dir, name)?;
    let size = disk.spec.size.as_ref().map(|q| q.bytes());
    let mut backing_layer = None;
    let mut base_image = None;
    let mut source_image = None;
    let mut pin = None;
    match &disk.spec.source {
        DiskSource::Blank(_) => {
            let size = size.ok_or(DiskError::NoSize)?;
            write_blank(ctx, &new.path, size)
                .await
                .map_err(DiskError::Blank)?;
        }
        DiskSource::Image(base) => {
            let base = ctx.config.confine(base).map_err(DiskError::BaseRefused)?;
            check_base_header(&base).map_err(DiskError::BaseHeader)?;
            let base_info = img::info(&base)
                .await
                .map_err(|source| DiskError::BaseInfo {
                    path: base.clone(),
                    source,
                })?;
            match size {
                Some(s) if s < base_info.virtual_size => {
                    return Err(DiskError::SmallerThanBase {
                        size: s,
                        base: base_info.virtual_size,
                    });
                }
                None if base_info.virtual_size > hearth_api::MAX_DISK_BYTES => {
                    return Err(DiskError::BaseTooLarge {
                        path: base,
                        virtual_size: base_info.virtual_size,
                    });
                }
                _ => {}
            }
            img::create_overlay(&new.path, &base, &base_info.format, size)
                .await
                .map_err(DiskError::Overlay)?;
            source_image = Some((base, base_info.format));
        }
        DiskSource::Snapshot(snap) => {
            pin = Some(ctx.exports.of(snap).read_owned().await);
            // Read again under the pin: a delete that got it first is done.
            if let Some((why, _)) =
                snapshot_not_ready(ctx, snap).map_err(DiskError::SnapshotStore)?
            {
                return Err(DiskError::SnapshotNotReady(why));
            }
            let layer = storage::snapshot_layer(&ctx.store, snap)?.ok_or_else(|| {
                DiskError::SnapshotWithoutLayer {
                    snapshot: snap.clone(),
                }
            })?;
            let info = img::info(&layer.path)
                .await
                .map_err(DiskError::SnapshotLayer)?;
            // Only a new overlay: the restore costs the same for any disk size.
            img::create_overlay_unopened(&new.path, &layer.path, "qcow2", info.virtual_size)
                .await
                .map_err(DiskError::Overlay)?;
            backing_layer = Some(layer.id);
        }
        DiskSource::Backup(b) => {
            restore_backup(ctx, name, b, &new.path)
                .await
                .inspect_err(|_| {
                    let _ = std::fs::remove_file(&new.path);
                })
                .map_err(DiskError::Backup)?;
        }
        DiskSource::VirtualImage(image) => {
            let ready = crate::image::ready_for_disk(&ctx.store, image, size)?
                .map_err(DiskError::ImageNotReady)?;
            // The image file is the overlay's backing file, opened read-only;
            // a larger size grows the disk.
            let prepare =
                super::prepare::needed(disk, &ready).map_err(|error| DiskError::Prepare {
                    disk: name.to_string(),
                    error,
                })?;
            img::create_overlay(&new.path, &ready.path, &ready.format, size)
                .await
                .map_err(DiskError::Overlay)?;
            if prepare {
                // A rootfs grows with its disk, and gets its files, before
                // the layer is recorded: a failure leaves no file, a crash
                // an unrecorded one the start-up sweep removes.
                if let Err(error) =
                    super::prepare::prepare(ctx, disk, &new.id, &new.path, &ready).await
                {
                    let _ = std::fs::remove_file(&new.path);
                    return Err(DiskError::Prepare {
                        disk: name.to_string(),
                        error,
                    });
                }
            }
            base_image = Some(ready.path);
        }
    }
    Ok(Made {
        layer: new,
        backing_layer,
        base_image,
        source_image,
        _pin: pin,
    })
}

/// Writes a blank qcow2 image of `size` bytes at `path` (a new file, 0600):
/// a copy of the one `qemu-img create` made for that size. A blank image
/// holds nothing of its own (no identifier, no time), so every blank image
/// of one size is the same bytes, and thousands of new disks cost one
/// `qemu-img` per size instead of one each. The copy is synced before it
/// is recorded, as `qemu-img create` syncs its file.
async fn write_blank(ctx: &Context, path: &Path, size: u64) -> Result<(), BlankError> {
    let image = blank_image(ctx, size).await?;
    let target = path.to_path_buf();
    let written = tokio::task::spawn_blocking(move || write_sparse(&target, &image))
        .await
        .map_err(|source| BlankError::Writer {
            path: path.to_path_buf(),
            source,
        })?;
    written.map_err(|source| {
        // A new file of ours, incomplete: nobody refers to it.
        let _ = std::fs::remove_file(path);
        BlankError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// The blank image of `size` bytes: made once by `qemu-img create` (in the
/// layers directory under a name no layer has, so one a crash leaves is
/// swept at the next start), checked by `qemu-img info`, kept in memory.
async fn blank_image(ctx: &Context, size: u64) -> Result<Arc<Vec<u8>>, BlankError> {
    let mut kept = ctx.disks.blanks.lock().await;
    if let Some(image) = kept.get(&size) {
        return Ok(image.clone());
    }
    let path = storage::layers_dir(&ctx.config.state_dir).join(format!("blank-{size}.qcow2"));
    let _ = std::fs::remove_file(&path);
    img::create_blank(&path, size).await?;
    let read = async {
        let info = img::info(&path).await?;
        if info.format != "qcow2" || info.virtual_size != size || info.backing_filename.is_some() {
            return Err(BlankError::Unexpected {
                path: path.clone(),
                format: info.format,
                virtual_size: info.virtual_size,
                backing: info.backing_filename,
                size,
            });
        }
        std::fs::read(&path).map_err(|source| BlankError::Io {
            path: path.clone(),
            source,
        })
    }
    .await;
    let _ = std::fs::remove_file(&path);
    let image = Arc::new(read?);
    if kept.len() >= BLANKS_KEPT {
        kept.pop_first();
    }
    kept.insert(size, image.clone());
    Ok(image)
}

/// A base image is read by QEMU with whatever it references: like an
/// imported image, it may name no other file (a qcow2 backing or data file,
/// a VMDK extent). Read here, before `qemu-img` or QEMU opens it.
fn check_base_header(base: &Path) -> Result<(), BaseHeaderError> {
    use hearth_qemu::probe::{self, Sniffed};
    use std::io::Read;
    let path = || base.to_path_buf();
    let mut head = Vec::with_capacity(probe::HEAD_BYTES);
    std::fs::File::open(base)
        .and_then(|f| f.take(probe::HEAD_BYTES as u64).read_to_end(&mut head))
        .map_err(|source| BaseHeaderError::Read {
            path: path(),
            source,
        })?;
    let refused = |source| BaseHeaderError::Refused {
        path: path(),
        source,
    };
    match probe::sniff(&head) {
        Ok(Sniffed::Qcow2(header)) => header.check().map_err(refused),
        Ok(Sniffed::Raw(_)) => Ok(()),
        Ok(Sniffed::Other(format)) => Err(BaseHeaderError::NamesOtherFiles {
            path: path(),
            format: format.to_string(),
        }),
        Err(r) => Err(refused(r)),
    }
}

/// Why a snapshot cannot be restored yet; `true` when it never will be.
pub(super) fn snapshot_not_ready(
    ctx: &Context,
    snap: &str,
) -> Result<Option<(String, bool)>, StoreError> {
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

/// The point's whole chain copied into one standalone file (the disk never
/// reads the backup directory again), the bytes so far in
/// `status.restoreProgress` every second. The chain's files are hashed
/// against the manifest while they are copied (two cores at work, not one
/// after the other); the disk is made only when both succeed.
async fn restore_backup(
    ctx: &Context,
    name: &str,
    b: &hearth_api::BackupDiskSource,
    out: &Path,
) -> Result<(), String> {
    use crate::backup::copy;
    let files = crate::backup::target::point_files(&b.from, &b.disk, b.point).await?;
    let plan = copy::plan(&files.file, None)
        .await
        .map_err(|e| e.to_string())?;
    let total = plan.bytes;
    let done = copy::Progress::default();
    let show = |bytes_done| {
        ctx.set_disk_status(name, |s| {
            s.restore_progress = Some(hearth_api::BackupProgress {
                bytes_done,
                bytes_total: total,
            })
        })
    };
    show(0);
    let copying = async {
        copy::write(plan, out, done.clone(), false)
            .await
            .map_err(|e| e.to_string())
    };
    let both = async { tokio::try_join!(files.verify(), copying) };
    tokio::pin!(both);
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.tick().await;
    loop {
        tokio::select! {
            r = &mut both => return r.map(|_| ()),
            _ = tick.tick() => show(done.load(std::sync::atomic::Ordering::Relaxed)),
        }
    }
}
