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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use hearth_api::{
    DiskPhase, DiskSource, EventType, Kind, Object, SnapshotPhase, SnapshotStatus, VirtualDisk,
    VirtualDiskStatus,
};
use hearth_qemu::img;
use rusqlite::params;

use crate::context::{Context, ReconcileError};
use crate::snapshot::compaction::{self, Chains};
use crate::snapshot::storage::{self, NewLayer};
use crate::store::{Store, StoreError};

/// Why a disk's first layer cannot be made, or its file not read. The
/// message is what the disk's status and its `CreateFailed` event say.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{}: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("spec.size: a blank disk needs a size")]
    NoSize,
    #[error("cannot create blank disk: {0}")]
    Blank(#[source] BlankError),
    #[error("spec.source.image: {0}")]
    BaseRefused(#[source] crate::config::ConfigError),
    #[error("spec.source.image: {0}")]
    BaseHeader(#[source] BaseHeaderError),
    #[error("spec.source.image: {}: {source}", path.display())]
    BaseInfo {
        path: PathBuf,
        #[source]
        source: img::ImgError,
    },
    #[error("spec.size: {size} bytes is smaller than the base image ({base} bytes)")]
    SmallerThanBase { size: u64, base: u64 },
    #[error(
        "spec.source.image: {}",
        crate::image::too_large(&format!("the base image {}", path.display()), *virtual_size)
    )]
    BaseTooLarge { path: PathBuf, virtual_size: u64 },
    #[error("cannot create overlay: {0}")]
    Overlay(#[source] img::ImgError),
    /// The snapshot to restore is not (or no longer) Ready.
    #[error("{0}")]
    SnapshotNotReady(String),
    #[error("spec.source.snapshot: VirtualDiskSnapshot {snapshot:?} has no layer")]
    SnapshotWithoutLayer { snapshot: String },
    #[error("{0}")]
    SnapshotLayer(#[source] img::ImgError),
    #[error("{}", .0.message())]
    ImageNotReady(crate::image::NotReady),
    #[error("reading {}: {source}", path.display())]
    Reader {
        path: PathBuf,
        #[source]
        source: tokio::task::JoinError,
    },
    #[error("qemu-img info {}: {source}", path.display())]
    Info {
        path: PathBuf,
        #[source]
        source: img::ImgError,
    },
    /// Reading the snapshot to restore from the store (as a reconcile
    /// reports a store error).
    #[error("store: {0}")]
    SnapshotStore(#[source] StoreError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a blank image of a size could not be made or copied.
#[derive(Debug, thiserror::Error)]
pub enum BlankError {
    #[error(transparent)]
    Img(#[from] img::ImgError),
    #[error(
        "qemu-img made {} as {format} of {virtual_size} bytes (backing {backing:?}), not a blank qcow2 of {size}",
        path.display()
    )]
    Unexpected {
        path: PathBuf,
        format: String,
        virtual_size: u64,
        backing: Option<String>,
        size: u64,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Writer {
        path: PathBuf,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Why a base image (`spec.source.image`) is refused by its header.
#[derive(Debug, thiserror::Error)]
pub enum BaseHeaderError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: refused: {source}", path.display())]
    Refused {
        path: PathBuf,
        #[source]
        source: hearth_qemu::probe::Qcow2Refusal,
    },
    #[error(
        "{}: a {format} image is refused ({format} images can name other files); convert it: qemu-img convert -O qcow2 IN OUT",
        path.display()
    )]
    NamesOtherFiles { path: PathBuf, format: String },
}

/// Why hearthd could not read a head's qcow2 header itself (then
/// `qemu-img info` is asked).
#[derive(Debug, thiserror::Error)]
enum HeaderError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Refused(#[from] hearth_qemu::probe::Qcow2Refusal),
}

/// A disk reconcile fails with the message of its error.
impl From<DiskError> for ReconcileError {
    fn from(e: DiskError) -> Self {
        ReconcileError::Failed(e.to_string())
    }
}

/// Disk reconciles that run at once. The others wait for a slot, parked:
/// a burst of thousands of new disks never fills the runtime's queue ahead
/// of the API's requests (docs/limits.md).
pub const RECONCILES_AT_ONCE: usize = 16;
/// Disks whose allocated bytes one resync reads from their files (`stat`),
/// round robin: with more disks, each is refreshed every few resyncs.
pub const REFRESHES_PER_RESYNC: usize = 128;
/// How long the planner waits after a batch, so that the hints arriving
/// meanwhile share the next one (and its one reading of the layer graph).
const PLAN_PAUSE: Duration = Duration::from_millis(200);
/// A pass over the disks that finds the store unwritten since the last one,
/// which found every disk at rest, reads nothing; every this many resyncs
/// one reads everything anyway.
const FULL_PASS_EVERY: u32 = 6;
/// Layer ids reserved in one commit, for new disks.
const IDS_PER_RESERVE: u64 = 64;
/// Blank images kept in memory, one per disk size.
const BLANKS_KEPT: usize = 8;
/// What is read of a head for its qcow2 header (its extensions end within
/// the first cluster; 64 KiB is qemu-img's default cluster).
const HEADER_BYTES: u64 = 64 << 10;

/// What disk reconciles and resyncs keep in memory (none of it is needed
/// after a restart: the first resync makes it again).
pub struct Disks {
    slots: tokio::sync::Semaphore,
    /// Per disk, the chain as its last compaction plan saw it, and whether
    /// that plan left merges to do.
    planned: Mutex<HashMap<String, (Shape, bool)>>,
    planner: Mutex<Planner>,
    /// The disk the last refresh ended at.
    refreshed_up_to: Mutex<Option<String>>,
    /// The last full pass, when it found every disk at rest.
    quiet: Mutex<Option<QuietPass>>,
    /// Reserved layer ids not handed out yet.
    ids: Mutex<std::ops::Range<u64>>,
    /// Blank qcow2 images by size, as `qemu-img create` made them.
    blanks: tokio::sync::Mutex<BTreeMap<u64, Arc<Vec<u8>>>>,
}

/// A disk at rest as a pass saw it: its name, its head's file, its
/// allocated bytes.
type AtRest = (String, PathBuf, Option<u64>);

/// A full pass that woke nothing and asked for no merge.
struct QuietPass {
    /// The store's count of writes before it read.
    writes: u64,
    at_rest: Vec<AtRest>,
    /// Passes since, that read nothing.
    skipped: u32,
}

#[derive(Default)]
struct Planner {
    waiting: BTreeSet<String>,
    running: bool,
}

impl Default for Disks {
    fn default() -> Self {
        Disks {
            slots: tokio::sync::Semaphore::new(RECONCILES_AT_ONCE),
            planned: Mutex::default(),
            planner: Mutex::default(),
            refreshed_up_to: Mutex::default(),
            quiet: Mutex::default(),
            ids: Mutex::new(0..0),
            blanks: tokio::sync::Mutex::default(),
        }
    }
}

impl Disks {
    /// A slot to run one disk reconcile in.
    pub async fn slot(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.slots
            .acquire()
            .await
            .expect("the disk slots are never closed")
    }

    fn forget(&self, disk: &str) {
        self.planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(disk);
    }

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

/// What a head's file says: its virtual size and the bytes it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Files {
    capacity: u64,
    allocated: u64,
}

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<(), ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualDisk, name)? else {
        ctx.disks.forget(name);
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
        return Ok(());
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
            let made = match create(ctx, name, disk).await {
                Ok(made) => made,
                Err(e) => {
                    let message = e.to_string();
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
    Ok(())
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

/// A head's capacity and allocated bytes, read by hearthd itself: the qcow2
/// header's size field (what `qemu-img info` reports as its virtual size)
/// and the blocks the file holds (its actual size). `qemu-img info` only
/// when the header is not one hearthd reads.
async fn file_status(path: &Path) -> Result<Files, DiskError> {
    let owned = path.to_path_buf();
    let read = tokio::task::spawn_blocking(move || read_files(&owned))
        .await
        .map_err(|source| DiskError::Reader {
            path: path.to_path_buf(),
            source,
        })?;
    match read {
        Ok(files) => Ok(files),
        Err(why) => {
            tracing::debug!(path = %path.display(), why = %why, "reading the qcow2 header failed; asking qemu-img");
            let info = img::info(path).await.map_err(|source| DiskError::Info {
                path: path.to_path_buf(),
                source,
            })?;
            Ok(Files {
                capacity: info.virtual_size,
                allocated: info.actual_size,
            })
        }
    }
}

fn read_files(path: &Path) -> Result<Files, HeaderError> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let mut head = Vec::new();
    file.take(HEADER_BYTES).read_to_end(&mut head)?;
    let header = hearth_qemu::probe::Qcow2Header::parse(&head)?;
    Ok(Files {
        capacity: header.size,
        allocated: allocated_bytes(&meta),
    })
}

/// What `qemu-img info` calls a file's actual size: its blocks, in bytes.
fn allocated_bytes(meta: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    meta.blocks().saturating_mul(512)
}

/// A new disk's first layer, made but not recorded yet.
struct Made {
    layer: NewLayer,
    backing_layer: Option<String>,
    base_image: Option<PathBuf>,
    /// An administrator's base image (`spec.source.image`) and its format:
    /// the chain every start checks ends in exactly this file.
    source_image: Option<(PathBuf, String)>,
    /// A restore holds its snapshot's pin from reading the snapshot's layer
    /// until the new layer over it is recorded (from then on the store
    /// itself keeps the layer): the snapshot's delete waits for it, and so
    /// does a merge into the layer.
    _pin: Option<tokio::sync::OwnedRwLockReadGuard<()>>,
}

/// Makes the file of `disk`'s first layer; the caller records it.
async fn create(ctx: &Context, name: &str, disk: &VirtualDisk) -> Result<Made, DiskError> {
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
        DiskSource::VirtualImage(image) => {
            let ready = crate::image::ready_for_disk(&ctx.store, image, size)?
                .map_err(DiskError::ImageNotReady)?;
            // The image file is the overlay's backing file, opened read-only;
            // a larger size grows the disk.
            img::create_overlay(&new.path, &ready.path, &ready.format, size)
                .await
                .map_err(DiskError::Overlay)?;
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

/// Writes `bytes` to the new file `path`, leaving holes where a 4 KiB block
/// is all zeros (qcow2 reads a hole as zeros, like the zeros qemu-img
/// wrote), then syncs it.
fn write_sparse(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const BLOCK: usize = 4096;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    for (i, block) in bytes.chunks(BLOCK).enumerate() {
        if block.iter().any(|&b| b != 0) {
            file.write_all_at(block, (i * BLOCK) as u64)?;
        }
    }
    file.set_len(bytes.len() as u64)?;
    file.sync_all()
}

/// Why a snapshot cannot be restored yet; `true` when it never will be.
fn snapshot_not_ready(ctx: &Context, snap: &str) -> Result<Option<(String, bool)>, StoreError> {
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

// ------------------------------------------------------------------ resync

/// A disk as one resync reads it from the store.
struct Row {
    name: String,
    deleting: bool,
    generation: u64,
    status: VirtualDiskStatus,
}

/// Everything one resync of the disks reads: a few queries, whatever the
/// number of disks.
struct View {
    disks: Vec<Row>,
    /// Each disk's head: its layer id and file.
    heads: HashMap<String, (String, PathBuf)>,
    /// The VM that uses each disk, as `Context::vms_using_disk` puts first.
    users: HashMap<String, String>,
    /// Disks with a recorded merge.
    compacting: HashSet<String>,
}

impl View {
    fn read(store: &Store) -> Result<View, StoreError> {
        let (disks, heads, running, listed, compacting) = store.with_tx(|tx| {
            let mut stmt = tx.prepare(
                "SELECT name, deleting, json_extract(body, '$.metadata.generation'), status
                 FROM objects WHERE kind = ?1 ORDER BY name",
            )?;
            let disks = stmt
                .query_map(params![Kind::VirtualDisk.as_str()], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, bool>(1)?,
                        r.get::<_, Option<i64>>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            let mut stmt = tx.prepare(
                "SELECT h.disk, l.id, l.path FROM heads h JOIN layers l ON l.id = h.layer",
            )?;
            let heads = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        (
                            r.get::<_, String>(1)?,
                            PathBuf::from(r.get::<_, String>(2)?),
                        ),
                    ))
                })?
                .collect::<Result<HashMap<_, _>, _>>()?;
            let mut stmt = tx.prepare("SELECT record FROM runtime ORDER BY vm")?;
            let running = stmt
                .query_map([], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            // Each VM's disks in spec order, VMs by name: read by SQLite,
            // not by parsing every VM here.
            let mut stmt = tx.prepare(
                "SELECT o.name, json_extract(d.value, '$.virtualDiskName')
                 FROM objects o, json_each(o.body, '$.spec.disks') d
                 WHERE o.kind = ?1 ORDER BY o.name, d.key",
            )?;
            let listed = stmt
                .query_map(params![Kind::VirtualMachine.as_str()], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            let mut stmt = tx.prepare("SELECT DISTINCT disk FROM compactions")?;
            let compacting = stmt
                .query_map([], |r| r.get::<_, String>(0))?
                .collect::<Result<HashSet<_>, _>>()?;
            Ok((disks, heads, running, listed, compacting))
        })?;
        let disks = disks
            .into_iter()
            .map(|(name, deleting, generation, status)| Row {
                name,
                deleting,
                generation: generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
                status: serde_json::from_str::<Option<VirtualDiskStatus>>(&status)
                    .ok()
                    .flatten()
                    .unwrap_or_default(),
            })
            .collect();
        // First the VMs whose running QEMU has the disk, then those whose
        // spec lists it.
        let mut users: HashMap<String, String> = HashMap::new();
        for text in running {
            let Ok(record) = serde_json::from_str::<crate::runtime::RuntimeRecord>(&text) else {
                continue;
            };
            if hearth_qemu::process::is_alive(&record.process) {
                for d in &record.disk_names {
                    users.entry(d.clone()).or_insert_with(|| record.vm.clone());
                }
            }
        }
        for (vm, disk) in listed {
            if let Some(disk) = disk {
                users.entry(disk).or_insert(vm);
            }
        }
        Ok(View {
            disks,
            heads,
            users,
            compacting,
        })
    }
}

/// One resync of every disk (docs/reconciler.md "Disks"): returns the disks
/// to reconcile, those whose status the store contradicts (or that are not
/// Ready, or being deleted). A disk at rest costs its share of a few
/// queries and nothing else: its compaction plan is made again only if its
/// chain changed since the last one (its actor is asked again while that
/// plan has merges left), and the files of at most
/// [`REFRESHES_PER_RESYNC`] disks are looked at (`stat`).
pub fn resync(ctx: &Arc<Context>) -> Result<Vec<String>, StoreError> {
    let started = std::time::Instant::now();
    // Every write goes through the store's writing connection, which
    // counts them: unwritten since a pass that found every disk at rest,
    // the store would say the same again. (A QEMU that dies unnoticed is
    // found by its VM's own resync, which writes.)
    let writes = ctx.store.writes();
    {
        let mut quiet = ctx.disks.quiet.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = quiet.as_mut()
            && q.writes == writes
            && q.skipped + 1 < FULL_PASS_EVERY
        {
            q.skipped += 1;
            refresh(ctx, &q.at_rest);
            return Ok(Vec::new());
        }
        *quiet = None;
    }
    let view = View::read(&ctx.store)?;
    let chains = compaction::chains(&ctx.store)?;
    let children = children_of(&chains);
    let mut wake = Vec::new();
    let mut at_rest: Vec<AtRest> = Vec::new();
    let mut to_compact = Vec::new();
    {
        let mut planned = ctx.disks.planned.lock().unwrap_or_else(|p| p.into_inner());
        let names: HashSet<&str> = view.disks.iter().map(|d| d.name.as_str()).collect();
        planned.retain(|d, _| names.contains(d.as_str()));
        for d in &view.disks {
            let Some((head, path)) = view.heads.get(&d.name) else {
                wake.push(d.name.clone());
                continue;
            };
            let sub = around(&chains, &children, head);
            let s = &d.status;
            let contradicted = d.deleting
                || s.phase != DiskPhase::Ready
                || s.path.as_deref() != Some(path.as_path())
                || s.observed_generation != d.generation
                || s.last_error.is_some()
                || s.attached_to.as_ref() != view.users.get(&d.name)
                || s.chain_length != u32::try_from(sub.chain(head).len()).ok();
            if contradicted {
                wake.push(d.name.clone());
                continue;
            }
            let shape = Shape::of(&sub, head);
            let work = match planned.get(&d.name) {
                Some((seen, work)) if *seen == shape => *work,
                _ => {
                    let work = !compaction::plan(&sub, head).is_empty()
                        || view.compacting.contains(&d.name);
                    planned.insert(d.name.clone(), (shape, work));
                    work
                }
            };
            // Merges left to do are asked for again each resync, as before
            // the plan was remembered: the actor may have yielded to a stop
            // or a start, or waits out a failed merge.
            if work {
                to_compact.push(d.name.clone());
            }
            at_rest.push((d.name.clone(), path.clone(), s.allocated));
        }
    }
    let compacting = to_compact.len();
    for d in to_compact {
        ctx.snapshots.compact(ctx, &d);
    }
    refresh(ctx, &at_rest);
    if wake.is_empty() && compacting == 0 {
        *ctx.disks.quiet.lock().unwrap_or_else(|p| p.into_inner()) = Some(QuietPass {
            writes,
            at_rest,
            skipped: 0,
        });
    }
    tracing::debug!(
        disks = view.disks.len(),
        woken = wake.len(),
        compacting,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "disks resynced"
    );
    Ok(wake)
}

/// Reads the allocated bytes of the next [`REFRESHES_PER_RESYNC`] disks at
/// rest (by name, after the last one read) from their heads' files, and
/// writes those that changed.
fn refresh(ctx: &Context, at_rest: &[AtRest]) {
    if at_rest.is_empty() {
        return;
    }
    let mut up_to = ctx
        .disks
        .refreshed_up_to
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let start = up_to.as_deref().map_or(0, |last| {
        at_rest.partition_point(|(n, _, _)| n.as_str() <= last)
    });
    for k in 0..at_rest.len().min(REFRESHES_PER_RESYNC) {
        let (name, path, allocated) = &at_rest[(start + k) % at_rest.len()];
        let allocated = *allocated;
        if let Ok(meta) = std::fs::metadata(path) {
            let now = allocated_bytes(&meta);
            if allocated != Some(now) {
                ctx.set_disk_status(name, |s| {
                    // Unless the head changed meanwhile.
                    if s.path.as_deref() == Some(path.as_path()) {
                        s.allocated = Some(now);
                    }
                });
            }
        }
        *up_to = Some(name.to_string());
    }
}

// ------------------------------------------------------------------ compaction planning

/// A disk's chain as its compaction plan reads it: each layer top-down,
/// with its backing, whether something refers to it, and how many layers
/// lie on it. The plan is made again only when this changes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shape(Vec<(String, Option<String>, bool, usize)>);

impl Shape {
    fn of(sub: &Chains, head: &str) -> Shape {
        let mut children: HashMap<&str, usize> = HashMap::new();
        for b in sub.backing.values().flatten() {
            *children.entry(b.as_str()).or_default() += 1;
        }
        Shape(
            sub.chain(head)
                .into_iter()
                .map(|id| {
                    let backing = sub.backing.get(&id).cloned().flatten();
                    let root = sub.roots.contains(&id);
                    let on_it = children.get(id.as_str()).copied().unwrap_or(0);
                    (id, backing, root, on_it)
                })
                .collect(),
        )
    }
}

/// For each layer, the layers that lie directly on it.
fn children_of(chains: &Chains) -> HashMap<&str, Vec<&str>> {
    let mut out: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, backing) in &chains.backing {
        if let Some(b) = backing {
            out.entry(b.as_str()).or_default().push(id.as_str());
        }
    }
    out
}

/// The part of the layer graph that `head`'s chain and its compaction plan
/// read: the chain's layers, every layer lying on one of them, and the
/// roots among those. `Chains::chain` and `compaction::plan` answer the
/// same for `head` on it as on the whole graph (a property tested below),
/// at the cost of the chain instead of the graph.
fn around(chains: &Chains, children: &HashMap<&str, Vec<&str>>, head: &str) -> Chains {
    let mut sub = Chains::default();
    for id in chains.chain(head) {
        for c in children.get(id.as_str()).into_iter().flatten() {
            sub.backing
                .insert(c.to_string(), chains.backing.get(*c).cloned().flatten());
        }
        sub.backing
            .insert(id.clone(), chains.backing.get(&id).cloned().flatten());
    }
    sub.roots = sub
        .backing
        .keys()
        .filter(|id| chains.roots.contains(*id))
        .cloned()
        .collect();
    sub
}

/// Plans `disk`'s chain soon, with the other disks hinted meanwhile: the
/// layer graph is read once per batch, however many disks it has.
fn plan_soon(ctx: &Arc<Context>, disk: &str) {
    let mut planner = ctx.disks.planner.lock().unwrap_or_else(|p| p.into_inner());
    planner.waiting.insert(disk.to_string());
    if planner.running {
        return;
    }
    planner.running = true;
    let weak = Arc::downgrade(ctx);
    tokio::spawn(async move {
        loop {
            let Some(ctx) = weak.upgrade() else { return };
            let batch = {
                let mut planner = ctx.disks.planner.lock().unwrap_or_else(|p| p.into_inner());
                if planner.waiting.is_empty() {
                    planner.running = false;
                    return;
                }
                std::mem::take(&mut planner.waiting)
            };
            if let Err(e) = plan_batch(&ctx, &batch) {
                tracing::warn!(error = %e, "cannot read the layer graph to plan compactions");
            }
            drop(ctx);
            tokio::time::sleep(PLAN_PAUSE).await;
        }
    });
}

/// Asks the actor serving each disk of `disks` to compact it when its chain
/// has layers nobody needs (a snapshot deleted while the VM ran, merged
/// once it stopped) or a merge a restart interrupted; the actor merges
/// them, or says why it cannot yet.
fn plan_batch(ctx: &Arc<Context>, disks: &BTreeSet<String>) -> Result<(), StoreError> {
    let chains = compaction::chains(&ctx.store)?;
    let children = children_of(&chains);
    let compacting: HashSet<String> = ctx.store.with_tx(|tx| {
        let mut stmt = tx.prepare("SELECT DISTINCT disk FROM compactions")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<HashSet<_>, _>>()?)
    })?;
    let mut to_compact = Vec::new();
    for d in disks {
        let Some(head) = storage::head(&ctx.store, d)? else {
            continue;
        };
        let sub = around(&chains, &children, &head.id);
        let work = !compaction::plan(&sub, &head.id).is_empty() || compacting.contains(d);
        if work {
            to_compact.push(d.clone());
        }
        ctx.disks
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(d.clone(), (Shape::of(&sub, &head.id), work));
    }
    for d in to_compact {
        ctx.snapshots.compact(ctx, &d);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn graph(backing: &[(&str, Option<&str>)], roots: &[&str]) -> Chains {
        Chains {
            backing: backing
                .iter()
                .map(|(id, b)| (id.to_string(), b.map(str::to_string)))
                .collect(),
            roots: roots.iter().map(|r| r.to_string()).collect(),
        }
    }

    #[test]
    fn the_part_around_a_head_is_its_chain_and_what_lies_on_it() {
        // h -> m -> b, with a restored disk r on m and an unrelated x.
        let g = graph(
            &[
                ("h", Some("m")),
                ("m", Some("b")),
                ("b", None),
                ("r", Some("m")),
                ("x", None),
            ],
            &["h", "r", "b"],
        );
        let sub = around(&g, &children_of(&g), "h");
        let ids: Vec<&String> = sub.backing.keys().collect();
        assert_eq!(ids, ["b", "h", "m", "r"]);
        assert_eq!(sub.roots.len(), 3);
        assert_eq!(sub.chain("h"), ["h", "m", "b"]);
    }

    /// A random layer graph: each layer's backing is nothing, another layer,
    /// itself, or a layer the store does not know; some layers are roots.
    fn any_graph() -> impl Strategy<Value = Chains> {
        (1usize..9).prop_flat_map(|n| {
            (
                proptest::collection::vec(proptest::option::of(0usize..n + 2), n),
                proptest::collection::vec(any::<bool>(), n),
            )
                .prop_map(move |(backing, roots)| {
                    let name = |i: usize| format!("l{i}");
                    Chains {
                        backing: backing
                            .iter()
                            .enumerate()
                            .map(|(i, b)| (name(i), b.map(name)))
                            .collect(),
                        roots: roots
                            .iter()
                            .enumerate()
                            .filter(|(_, r)| **r)
                            .map(|(i, _)| name(i))
                            .collect(),
                    }
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_part_around_a_head_plans_as_the_whole_graph_does(g in any_graph()) {
            let children = children_of(&g);
            for head in g.backing.keys() {
                let sub = around(&g, &children, head);
                prop_assert_eq!(sub.chain(head), g.chain(head));
                prop_assert_eq!(compaction::plan(&sub, head), compaction::plan(&g, head));
                // The shape the plan is remembered by is the same too.
                prop_assert_eq!(Shape::of(&sub, head), Shape::of(&g, head));
            }
        }
    }

    fn qemu_img(args: &[&str]) -> std::process::Output {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .expect("qemu-img (apt-get install qemu-utils)");
        assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
        out
    }

    fn info(path: &Path) -> serde_json::Value {
        let out = qemu_img(&["info", "--output=json", "-U", path.to_str().unwrap()]);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[test]
    fn a_blank_copy_is_what_qemu_img_makes_and_reads_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let (made, copy) = (dir.path().join("made.qcow2"), dir.path().join("copy.qcow2"));
        for size in ["64M", "3G", "1T"] {
            let _ = std::fs::remove_file(&made);
            let _ = std::fs::remove_file(&copy);
            qemu_img(&["create", "-q", "-f", "qcow2", made.to_str().unwrap(), size]);
            let bytes = std::fs::read(&made).unwrap();
            write_sparse(&copy, &bytes).unwrap();
            assert_eq!(std::fs::read(&copy).unwrap(), bytes, "{size}");
            // qemu-img finds nothing wrong with it and reads it as the same disk.
            qemu_img(&["check", "-f", "qcow2", copy.to_str().unwrap()]);
            assert_eq!(info(&copy)["virtual-size"], info(&made)["virtual-size"]);
            let holes = std::fs::metadata(&copy).unwrap();
            assert!(
                allocated_bytes(&holes) <= allocated_bytes(&std::fs::metadata(&made).unwrap()),
                "the copy is sparse"
            );
            assert!(
                write_sparse(&copy, &bytes).is_err(),
                "an existing file is never overwritten"
            );
        }
    }

    #[test]
    fn the_files_status_is_what_qemu_img_info_reports() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        let top = dir.path().join("top.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            base.to_str().unwrap(),
            "100M",
        ]);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            base.to_str().unwrap(),
            "-F",
            "qcow2",
            top.to_str().unwrap(),
            "200M",
        ]);
        let written = std::process::Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write -P 7 0 3M",
                top.to_str().unwrap(),
            ])
            .output()
            .expect("qemu-io (apt-get install qemu-utils)");
        assert!(written.status.success(), "{written:?}");
        for path in [&base, &top] {
            let files = read_files(path).unwrap();
            let i = info(path);
            assert_eq!(
                Some(files.capacity),
                i["virtual-size"].as_u64(),
                "{}",
                path.display()
            );
            assert_eq!(
                Some(files.allocated),
                i["actual-size"].as_u64(),
                "{}",
                path.display()
            );
        }
        assert!(read_files(&dir.path().join("missing.qcow2")).is_err());
        std::fs::write(dir.path().join("raw"), [0u8; 4096]).unwrap();
        assert!(
            read_files(&dir.path().join("raw")).is_err(),
            "not a qcow2: qemu-img is asked"
        );
    }

    fn context(dir: &Path) -> Arc<Context> {
        let config = crate::config::EngineConfig {
            state_dir: dir.join("state"),
            run_dir: dir.join("run"),
            image_roots: vec![],
            qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
            qemu_user: None,
            accel: hearth_qemu::accel::AccelDecision {
                accel: hearth_qemu::Accel::Tcg,
                reason: "test".into(),
            },
            resync_interval: Duration::from_secs(10),
            images: Default::default(),
            ovmf_code: dir.join("OVMF_CODE.fd"),
            ovmf_vars: dir.join("OVMF_VARS.fd"),
            compaction_speed: 0,
            dns_resolv_file: "/etc/resolv.conf".into(),
            forwards: Default::default(),
        };
        std::fs::create_dir_all(&config.state_dir).unwrap();
        let store = Store::open(&config.database_path()).unwrap();
        let (wakes, _) = tokio::sync::mpsc::unbounded_channel();
        Arc::new(Context::new(config, store, wakes))
    }

    fn disk_object(name: &str) -> Object {
        hearth_api::parse_documents(
            &format!("apiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata: {{name: {name}}}\nspec: {{size: 1Mi, source: {{blank: {{}}}}}}\n"),
            "t",
        )
        .unwrap()
        .remove(0)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resync_wakes_only_the_disks_the_store_contradicts() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        let names = ["at-rest", "moved", "new", "going", "vm-disk"];
        ctx.store
            .put_objects(&names.iter().map(|n| disk_object(n)).collect::<Vec<_>>())
            .unwrap();
        let vm = hearth_api::parse_documents(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {name: web}\nspec: {runPolicy: AlwaysOff, disks: [{virtualDiskName: vm-disk}]}\n",
            "t",
        )
        .unwrap();
        ctx.store.put_objects(&vm).unwrap();
        // Real reconciles make them Ready, except the one never made.
        for n in ["at-rest", "moved", "going", "vm-disk"] {
            reconcile(&ctx, n).await.unwrap();
        }
        let status = |n: &str| -> VirtualDiskStatus {
            serde_json::from_value(ctx.store.get(Kind::VirtualDisk, n).unwrap().unwrap().status)
                .unwrap()
        };
        assert_eq!(status("vm-disk").attached_to.as_deref(), Some("web"));
        // A head that moved behind the status's back (as a lost hint would
        // leave it), and a deletion.
        let elsewhere = storage::numbered(&ctx.config.state_dir, 999, "moved");
        ctx.store
            .with_tx(|tx| storage::set_head_tx(tx, "moved", &elsewhere, None))
            .unwrap();
        ctx.store.mark_deleting(Kind::VirtualDisk, "going").unwrap();
        let mut woken = resync(&ctx).unwrap();
        woken.sort();
        assert_eq!(woken, ["going", "moved", "new"]);
        // Put right, they are at rest; passes that find the store unwritten
        // since then say so without reading it.
        ctx.store.put_objects(&[disk_object("new2")]).unwrap();
        for n in ["going", "moved", "new"] {
            ctx.store
                .with_tx(|tx| {
                    tx.execute("DELETE FROM heads WHERE disk = ?1", [n])?;
                    tx.execute(
                        "DELETE FROM objects WHERE kind = 'VirtualDisk' AND name = ?1",
                        [n],
                    )?;
                    Ok(())
                })
                .unwrap();
        }
        reconcile(&ctx, "new2").await.unwrap();
        assert!(resync(&ctx).unwrap().is_empty());
        assert!(resync(&ctx).unwrap().is_empty());
        ctx.store.mark_deleting(Kind::VirtualDisk, "new2").unwrap();
        assert_eq!(
            resync(&ctx).unwrap(),
            ["new2"],
            "a write is seen at the next pass"
        );
        assert_eq!(status("at-rest").phase, DiskPhase::Ready);
        // The VM lets go of its disk: the status now contradicts the store.
        ctx.store.remove(Kind::VirtualMachine, "web").unwrap();
        assert!(resync(&ctx).unwrap().contains(&"vm-disk".to_string()));
    }
}
