//! VirtualImage reconcile: import an image into the content-addressed image
//! store, verify it, and report it; let its file go when nothing needs it.
//!
//! An import runs as its own task (one per image at most), so a long
//! download never holds the image's reconcile worker: the reconcile starts
//! it, a delete cancels it, and the task writes the status as it goes. A
//! failed attempt is retried after a delay that doubles each time (up to
//! `--image-retry-max-seconds`). See docs/images.md.

pub mod import;
pub mod names;
pub mod oci;
pub mod progress;
pub mod registry;
pub mod space;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hearth_api::{
    DiskSource, EventType, ImagePhase, ImageSource, Kind, Object, VirtualImage, VirtualImageStatus,
};
use hearth_qemu::img::QemuImg;

use crate::context::{Action, Context, ReconcileError};
use crate::store::{Store, StoreError};
use import::{Failure, Fetched, TempFile};
use progress::{format_bytes, retry_delay};

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualImage, name)? else {
        ctx.imports.cancel(name).await;
        return Ok(Action::Done);
    };
    let Object::VirtualImage(image) = stored.object else {
        return Ok(Action::Done);
    };
    if stored.deleting {
        return delete(ctx, name).await.map(|()| Action::Done);
    }
    let status: VirtualImageStatus = serde_json::from_value(stored.status).unwrap_or_default();
    let used_by = disks_from(&ctx.store, name)?;
    if status.used_by != used_by {
        ctx.set_image_status(name, |s| s.used_by = used_by.clone());
    }
    if ctx.imports.is_running(name) {
        return Ok(Action::Done);
    }
    match status.phase {
        ImagePhase::Ready => {
            // Observed, not assumed: the file must still be there.
            if status.path.as_deref().is_some_and(Path::is_file) {
                return Ok(Action::Done);
            }
            ctx.event(
                Kind::VirtualImage,
                name,
                EventType::Warning,
                "ImageFileMissing",
                &format!(
                    "the image file {} is gone; importing the image again",
                    status
                        .path
                        .as_deref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                ),
            );
        }
        ImagePhase::Failed => {
            if let Some(at) = ctx.imports.failed_at(name) {
                let cfg = &ctx.config.images;
                let wait = retry_delay(status.attempts.unwrap_or(1), cfg.retry_base, cfg.retry_max);
                // Not yet: the retry is due `wait` after the failure.
                if let Some(left) = wait.checked_sub(at.elapsed())
                    && !left.is_zero()
                {
                    return Ok(Action::RequeueAfter(left));
                }
            }
            if let Some(needs) = ctx.imports.needs_room(name) {
                // It ran out of free space: the same attempt again would
                // only fill the filesystem up to the reserve again. The
                // periodic resync looks again.
                let room = space::available(&ctx.config.images_dir())
                    .unwrap_or(0)
                    .saturating_sub(ctx.config.images.free_space_reserve);
                if room < needs {
                    return Ok(Action::Done);
                }
            }
        }
        // Importing with no task: an attempt a restart cut short.
        ImagePhase::Pending | ImagePhase::Importing => {}
    }
    start(ctx, name, image);
    Ok(Action::Done)
}

fn start(ctx: &Arc<Context>, name: &str, image: VirtualImage) {
    let mut st = ctx.imports.lock();
    if st.running.get(name).is_some_and(|h| !h.is_finished()) {
        return;
    }
    // Spawned under the lock, so the task's own `finished` comes after
    // this insert.
    let task = tokio::spawn(attempt(ctx.clone(), name.to_string(), image));
    st.running.insert(name.to_string(), task);
}

/// One import attempt, from Importing to Ready or Failed.
async fn attempt(ctx: Arc<Context>, name: String, image: VirtualImage) {
    let generation = image.metadata.generation;
    let Ok(Some(status)) =
        ctx.store
            .update_status::<VirtualImageStatus, _>(Kind::VirtualImage, &name, |s| {
                s.phase = ImagePhase::Importing;
                s.attempts = Some(s.attempts.unwrap_or(0).saturating_add(1));
                s.progress = Some("0%".into());
                s.bytes_done = Some(0);
                s.bytes_total = None;
                s.bytes_per_second = None;
                s.reason = None;
                s.message = None;
            })
    else {
        ctx.imports.finished(&name, None);
        return;
    };
    let attempt = status.attempts.unwrap_or(1);
    let what = match &image.spec.source {
        ImageSource::Http(h) => format!("downloading {}", h.url),
        ImageSource::File(p) => format!("copying {}", p.display()),
        ImageSource::Oci(o) => match (&o.reference, &o.layout, &o.archive) {
            (Some(r), _, _) => format!("pulling {r}"),
            (_, Some(p), _) => format!("reading the image layout {}", p.display()),
            (_, _, Some(p)) => format!("reading the image archive {}", p.display()),
            _ => "reading an OCI image".to_string(),
        },
    };
    ctx.event(
        Kind::VirtualImage,
        &name,
        EventType::Normal,
        "ImportStarted",
        &format!("attempt {attempt}: {what}"),
    );
    let result = run(&ctx, &name, &image, generation).await;
    let failure = result.as_ref().err().cloned();
    match result {
        Ok(done) => {
            let read = format!(
                "{} read in {:.1} s ({}/s)",
                format_bytes(done.fetched_bytes),
                done.seconds,
                format_bytes(done.bytes_per_second)
            );
            let how = match (done.reused, done.fetched_bytes) {
                (true, 0) => "already in the image store: nothing downloaded".to_string(),
                (true, _) => format!("{read}; the same content was already stored"),
                (false, _) => read,
            };
            ctx.event(
                Kind::VirtualImage,
                &name,
                EventType::Normal,
                "Imported",
                &format!(
                    "{} {}: {} file, virtual size {} ({} bytes), {how}",
                    names::digest(&done.hex),
                    done.format,
                    format_bytes(done.size),
                    format_bytes(done.virtual_size),
                    done.virtual_size
                ),
            );
            // Disks waiting for this image can be made now.
            if let Ok(disks) = disks_from(&ctx.store, &name) {
                for d in disks {
                    ctx.wake(Kind::VirtualDisk, &d);
                }
            }
            // And VMs waiting for it as their spec.boot.kernelImage.
            if let Ok(vms) = ctx.store.list(Kind::VirtualMachine) {
                for o in vms {
                    if let Object::VirtualMachine(vm) = o.object
                        && vm
                            .spec
                            .boot
                            .as_ref()
                            .and_then(|b| b.kernel_image.as_deref())
                            == Some(name.as_str())
                    {
                        ctx.wake(Kind::VirtualMachine, &vm.metadata.name);
                    }
                }
            }
        }
        Err(f) => {
            let cfg = &ctx.config.images;
            let wait = retry_delay(attempt, cfg.retry_base, cfg.retry_max);
            let message = match f.needs_room {
                Some(needs) => format!(
                    "{} (attempt {attempt}; the next attempt waits until more than {} ({needs} bytes) are free above the reserve, and at least {:.0} s)",
                    f.message,
                    format_bytes(needs),
                    wait.as_secs_f64().ceil()
                ),
                None => format!(
                    "{} (attempt {attempt}; next attempt in {:.0} s)",
                    f.message,
                    wait.as_secs_f64().ceil()
                ),
            };
            // The event first: whoever sees Failed finds it.
            ctx.event(
                Kind::VirtualImage,
                &name,
                EventType::Warning,
                "ImportFailed",
                &format!("{}: {message}", f.reason),
            );
            ctx.set_image_status(&name, |s| {
                s.phase = ImagePhase::Failed;
                s.reason = Some(f.reason.to_string());
                s.message = Some(message.clone());
                // This spec was tried (and is retried): the failure is its own.
                s.observed_generation = generation;
                s.progress = None;
                s.bytes_done = None;
                s.bytes_total = None;
                s.bytes_per_second = None;
            });
        }
    }
    ctx.imports
        .finished(&name, failure.as_ref().map(|f| f.needs_room));
    // The image's reconcile asks to run again when the retry is due.
    if failure.is_some() {
        ctx.wake(Kind::VirtualImage, &name);
    }
}

/// What a successful attempt produced.
struct Done {
    hex: String,
    format: &'static str,
    size: u64,
    virtual_size: u64,
    fetched_bytes: u64,
    seconds: f64,
    bytes_per_second: u64,
    reused: bool,
}

async fn run(
    ctx: &Arc<Context>,
    name: &str,
    image: &VirtualImage,
    generation: u64,
) -> Result<Done, Failure> {
    let dir = ctx.config.images_dir();
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::new("StoreFailed", format!("{}: {e}", dir.display())))?;
    let cfg = ctx.config.images.clone();
    let report = |r: progress::Report| {
        ctx.set_image_status(name, |s| {
            s.progress = Some(r.progress.clone());
            s.bytes_done = Some(r.done);
            s.bytes_total = r.total;
            s.bytes_per_second = Some(r.bytes_per_second);
        });
    };
    let mut oci_done = None;
    // Kept to the end of the commit: until then no release takes the
    // blobs this import finds stored.
    let _lease = matches!(image.spec.source, ImageSource::Oci(_)).then(|| oci::Lease::take(ctx));
    let (mut tmp, fetched) = match &image.spec.source {
        ImageSource::Oci(o) => {
            let mut tmp = new_temp(ctx, &dir, name).await?;
            let r = oci::fetch(ctx, o, &mut tmp, report).await;
            let (fetched, done) = tmp.discard_on_error(r).await?;
            oci_done = Some(done);
            (tmp, fetched)
        }
        ImageSource::Http(h) => {
            let want = h.sha256.to_ascii_lowercase();
            if let Some((path, format)) = names::find_stored(&dir, &want)
                && let Some(done) = adopt(ctx, name, generation, &path, &want, format).await?
            {
                return Ok(done);
            }
            let mut tmp = new_temp(ctx, &dir, name).await?;
            let r = import::fetch_http(&cfg, &h.url, &mut tmp, report).await;
            let fetched = tmp.discard_on_error(r).await?;
            if fetched.hex != want {
                return Err(Failure::new(
                    "ChecksumMismatch",
                    format!(
                        "spec.source.http.sha256: the server sent {} bytes whose SHA-256 is {}, not {want}",
                        fetched.bytes, fetched.hex
                    ),
                ));
            }
            (tmp, fetched)
        }
        ImageSource::File(p) => {
            if std::fs::symlink_metadata(p).is_err() {
                return Err(Failure::new(
                    "SourceMissing",
                    format!("spec.source.file: {} does not exist", p.display()),
                ));
            }
            let real = ctx
                .config
                .confine(p)
                .map_err(|m| Failure::new("SourceNotAllowed", format!("spec.source.file: {m}")))?;
            let mut tmp = new_temp(ctx, &dir, name).await?;
            let r = import::fetch_file(&cfg, &real, &mut tmp, report).await;
            let fetched = tmp.discard_on_error(r).await?;
            (tmp, fetched)
        }
    };
    tmp.finish().await?;
    let verified = import::verify(&tmp.path, fetched.bytes).await?;
    commit(
        ctx,
        name,
        generation,
        &tmp,
        &fetched,
        &verified,
        oci_done.as_ref(),
    )
}

async fn new_temp(ctx: &Context, dir: &Path, name: &str) -> Result<TempFile, Failure> {
    let n = ctx
        .store
        .next_counter("image-import")
        .map_err(|e| Failure::new("StoreFailed", e.to_string()))?;
    TempFile::create(
        names::temp_path(dir, n, name),
        ctx.config.images.free_space_reserve,
    )
    .await
}

/// An http image whose content is already stored: no download. Its file
/// was verified when it was stored; qemu-img reads its size.
async fn adopt(
    ctx: &Context,
    name: &str,
    generation: u64,
    path: &Path,
    hex: &str,
    format: &'static str,
) -> Result<Option<Done>, Failure> {
    let img = QemuImg::locate().map_err(|e| Failure::new("ToolMissing", e.to_string()))?;
    let Ok(info) = img.info_as(path, format).await else {
        return Ok(None);
    };
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let path = path.to_path_buf();
    // In one transaction with the file's existence, so a concurrent release
    // of the file (which checks the store in its own transaction) either
    // sees this image or has already removed the file.
    let adopted = ctx
        .store
        .with_tx(|tx| {
            if !path.is_file() {
                return Ok(false);
            }
            Store::update_status_tx::<VirtualImageStatus, _>(tx, Kind::VirtualImage, name, |s| {
                ready(s, hex, format, size, info.virtual_size, &path, generation)
            })?;
            Ok(true)
        })
        .map_err(|e| Failure::new("StoreFailed", e.to_string()))?;
    Ok(adopted.then(|| Done {
        hex: hex.to_string(),
        format,
        size,
        virtual_size: info.virtual_size,
        fetched_bytes: 0,
        seconds: 0.0,
        bytes_per_second: 0,
        reused: true,
    }))
}

fn ready(
    s: &mut VirtualImageStatus,
    hex: &str,
    format: &str,
    size: u64,
    virtual_size: u64,
    path: &Path,
    generation: u64,
) {
    s.phase = ImagePhase::Ready;
    s.progress = Some("100%".into());
    s.bytes_done = None;
    s.bytes_total = None;
    s.bytes_per_second = None;
    s.format = Some(format.to_string());
    s.size = Some(size);
    s.virtual_size = Some(virtual_size);
    s.digest = Some(names::digest(hex));
    s.shape = None;
    s.layers = None;
    s.kernel = None;
    s.initrd = None;
    s.kernel_version = None;
    s.path = Some(path.to_path_buf());
    s.reason = None;
    s.message = None;
    s.observed_generation = generation;
}

/// Puts a verified temporary file into the store under its digest (or drops
/// it when that content is already there) and marks the image Ready, in one
/// store transaction with no await inside: a cancelled task either did all
/// of it or none.
fn commit(
    ctx: &Context,
    name: &str,
    generation: u64,
    tmp: &TempFile,
    fetched: &Fetched,
    verified: &import::Verified,
    oci: Option<&oci::OciDone>,
) -> Result<Done, Failure> {
    let dir = ctx.config.images_dir();
    let path = names::stored_path(&dir, &fetched.hex, verified.format);
    let store_failed = |e: String| Failure::new("StoreFailed", e);
    let boot = oci.and_then(|o| o.boot.as_ref());
    let mut replaced = Vec::new();
    let reused = ctx
        .store
        .with_tx(|tx| {
            // A boot file another image's deletion released since it was
            // stored: this attempt fails, and the next stores it again.
            if let Some(b) = boot {
                for p in std::iter::once(&b.kernel.path).chain(b.initrd.as_ref().map(|i| &i.path)) {
                    if !p.is_file() {
                        return Ok(Err(format!("{} vanished before the commit", p.display())));
                    }
                }
            }
            let reused = path.is_file();
            if reused {
                // Gone before the image shows Ready: nothing but the
                // image's own file is left once it is.
                let _ = std::fs::remove_file(&tmp.path);
            } else {
                use std::os::unix::fs::PermissionsExt;
                // Images are never written: QEMU opens them read-only below
                // each disk's own layer.
                let moved =
                    std::fs::set_permissions(&tmp.path, std::fs::Permissions::from_mode(0o444))
                        .and_then(|()| std::fs::rename(&tmp.path, &path));
                if let Err(e) = moved {
                    return Ok(Err(format!(
                        "{} -> {}: {e}",
                        tmp.path.display(),
                        path.display()
                    )));
                }
            }
            Store::update_status_tx::<VirtualImageStatus, _>(tx, Kind::VirtualImage, name, |s| {
                replaced = [s.kernel.take(), s.initrd.take()]
                    .into_iter()
                    .flatten()
                    .collect();
                ready(
                    s,
                    &fetched.hex,
                    verified.format,
                    fetched.bytes,
                    verified.virtual_size,
                    &path,
                    generation,
                );
                // An OCI image is named by the manifest it came from.
                if let Some(o) = oci {
                    s.digest = Some(o.digest.clone());
                    s.shape = Some(o.shape.to_string());
                    s.layers = Some(o.layers);
                    if let Some(b) = &o.boot {
                        s.kernel = Some(b.kernel.path.clone());
                        s.initrd = b.initrd.as_ref().map(|i| i.path.clone());
                        s.kernel_version = b.version.clone();
                    }
                }
            })?;
            Ok(Ok(reused))
        })
        .map_err(|e| store_failed(e.to_string()))?
        .map_err(store_failed)?;
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    // The boot files of the content this image had before, if nothing
    // else names them.
    for p in replaced {
        let _ = release_file(&ctx.store, &p);
    }
    Ok(Done {
        hex: fetched.hex.clone(),
        format: verified.format,
        size: fetched.bytes,
        virtual_size: verified.virtual_size,
        fetched_bytes: fetched.bytes,
        seconds: fetched.seconds,
        bytes_per_second: fetched.bytes_per_second,
        reused,
    })
}

/// Deletes the image object: its import stops, and its file goes unless
/// another image has the same content or a disk layer is still made from it.
async fn delete(ctx: &Arc<Context>, name: &str) -> Result<(), ReconcileError> {
    ctx.imports.cancel(name).await;
    let users = disks_blocking_delete(&ctx.store, name)?;
    if !users.is_empty() {
        // Refused at the API; only if a disk arrived since.
        return Err(ReconcileError::Failed(format!(
            "VirtualImage {name:?} is still used by VirtualDisk {}",
            quoted(&users)
        )));
    }
    let status: VirtualImageStatus = ctx
        .store
        .get(Kind::VirtualImage, name)?
        .and_then(|s| serde_json::from_value(s.status).ok())
        .unwrap_or_default();
    let oci = ctx
        .store
        .get(Kind::VirtualImage, name)?
        .is_some_and(|s| matches!(&s.object, Object::VirtualImage(i) if matches!(i.spec.source, ImageSource::Oci(_))));
    let removed = ctx.store.with_tx(|tx| {
        Store::remove_tx(tx, Kind::VirtualImage, name)?;
        // Its kernel and initrd go with the last image that names them.
        for p in status.kernel.iter().chain(status.initrd.iter()) {
            release_file_tx(tx, p)?;
        }
        match &status.path {
            Some(p) => release_file_tx(tx, p),
            None => Ok(false),
        }
    })?;
    let message = match (&status.path, removed) {
        (Some(p), true) => format!("the image file {} was removed", p.display()),
        (Some(p), false) => format!(
            "the image file {} is kept: another VirtualImage has the same content, or disk layers are made from it",
            p.display()
        ),
        (None, _) => "no image file had been stored".into(),
    };
    ctx.event(
        Kind::VirtualImage,
        name,
        EventType::Normal,
        "Deleted",
        &message,
    );
    if oci {
        // Its blobs go unless another image uses them.
        oci::release_blobs(ctx);
    }
    Ok(())
}

/// `"a", "b"`.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The disks whose spec names this image as their source (`status.usedBy`).
pub fn disks_from(store: &Store, image: &str) -> Result<Vec<String>, StoreError> {
    disks_naming(store, image, true)
}

/// The disks made from this image that keep it from being deleted: those
/// not being deleted themselves. (A disk on its way out that already has a
/// layer keeps the image's file through its layer's base, not through the
/// image object.)
pub fn disks_blocking_delete(store: &Store, image: &str) -> Result<Vec<String>, StoreError> {
    disks_naming(store, image, false)
}

fn disks_naming(
    store: &Store,
    image: &str,
    with_deleting: bool,
) -> Result<Vec<String>, StoreError> {
    Ok(store
        .list(Kind::VirtualDisk)?
        .into_iter()
        .filter(|s| with_deleting || !s.deleting)
        .filter_map(|s| match s.object {
            Object::VirtualDisk(d)
                if matches!(&d.spec.source, DiskSource::VirtualImage(i) if i == image) =>
            {
                Some(d.metadata.name)
            }
            _ => None,
        })
        .collect())
}

/// Removes the image-store file `path` if nothing needs it any more: no
/// VirtualImage shows it or has its digest (in its status or, for an http
/// source, its spec), and no disk layer is made from it. The check and the
/// removal are one store transaction, so an import adopting the same file
/// (also one transaction) cannot interleave. Only image-store file names are
/// ever removed. Returns whether the file was removed.
pub fn release_file(store: &Store, path: &Path) -> Result<bool, StoreError> {
    store.with_tx(|tx| release_file_tx(tx, path))
}

fn release_file_tx(tx: &rusqlite::Transaction<'_>, path: &Path) -> Result<bool, StoreError> {
    let file = path.file_name().and_then(|n| n.to_str());
    if file.and_then(names::parse_boot_file).is_some() {
        // A kernel or initrd: kept while an image's status names it.
        for o in Store::list_tx(tx, Kind::VirtualImage)? {
            let status: VirtualImageStatus = serde_json::from_value(o.status).unwrap_or_default();
            if status.kernel.as_deref() == Some(path) || status.initrd.as_deref() == Some(path) {
                return Ok(false);
            }
        }
        return remove_store_file(path);
    }
    let Some((hex, _)) = file.and_then(names::parse_stored) else {
        return Ok(false);
    };
    if crate::store::layers::base_in_use_tx(tx, path)? {
        return Ok(false);
    }
    for o in Store::list_tx(tx, Kind::VirtualImage)? {
        let status: VirtualImageStatus = serde_json::from_value(o.status).unwrap_or_default();
        let spec_hex = match &o.object {
            Object::VirtualImage(i) => match &i.spec.source {
                ImageSource::Http(h) => Some(h.sha256.to_ascii_lowercase()),
                ImageSource::File(_) | ImageSource::Oci(_) => None,
            },
            _ => None,
        };
        if status.path.as_deref() == Some(path)
            || status.digest.as_deref().and_then(names::hex_of) == Some(hex)
            || spec_hex.as_deref() == Some(hex)
        {
            return Ok(false);
        }
    }
    remove_store_file(path)
}

fn remove_store_file(path: &Path) -> Result<bool, StoreError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove the image file");
            Ok(false)
        }
    }
}

/// At start-up, before any import runs: removes the temporaries of imports
/// a crash cut short, and image-store files nothing in the store refers to
/// (a crash between a deletion's transaction and its file removal). A file
/// the store shows as an image, or that a layer is made from, is kept.
pub fn sweep(store: &Store, dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    oci::sweep(dir);
    oci::release_at_start(store, dir);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let Some(file) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if names::is_temp(file) {
            if std::fs::remove_file(&path).is_ok() {
                removed.push(path);
            }
        } else if (names::parse_stored(file).is_some() || names::parse_boot_file(file).is_some())
            && release_file(store, &path)?
        {
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A Ready image, as a disk made from it needs it.
pub struct ReadyImage {
    pub name: String,
    pub path: PathBuf,
    pub format: String,
    pub virtual_size: u64,
    /// An OCI image's shape (`rootfs`, `containerDisk`), as its status says.
    pub shape: Option<String>,
}

/// Why a disk cannot be made from its image now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotReady {
    /// The image is missing, importing, failed (and retried) or being
    /// deleted: the disk waits, Pending, with this message.
    Waiting(String),
    /// `spec.size` is below the image's virtual size: never.
    TooSmall {
        image: String,
        size: u64,
        virtual_size: u64,
    },
    /// The image's virtual size is more than any disk may have
    /// ([`hearth_api::MAX_DISK_BYTES`]): never.
    TooLarge { image: String, virtual_size: u64 },
}

impl NotReady {
    /// The field of the disk's spec at fault and what is wrong with it.
    pub fn field_and_message(&self) -> (&'static str, String) {
        match self {
            NotReady::Waiting(m) => ("spec.source.virtualImage", m.clone()),
            NotReady::TooSmall {
                image,
                size,
                virtual_size,
            } => (
                "spec.size",
                format!(
                    "{size} bytes is smaller than VirtualImage {image:?} (virtualSize {virtual_size} bytes); a disk can grow an image, not shrink it"
                ),
            ),
            NotReady::TooLarge {
                image,
                virtual_size,
            } => (
                "spec.source.virtualImage",
                too_large(&format!("VirtualImage {image:?}"), *virtual_size),
            ),
        }
    }

    /// Whether the disk can never be made from the image as its spec is.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, NotReady::Waiting(_))
    }

    pub fn message(&self) -> String {
        let (field, message) = self.field_and_message();
        format!("{field}: {message}")
    }
}

/// Why an image of `virtual_size` bytes cannot become a disk without a
/// `spec.size`: the disk would be larger than `spec.size` may ask for.
pub fn too_large(what: &str, virtual_size: u64) -> String {
    format!(
        "{what} has a virtual size of {virtual_size} bytes, more than the largest disk ({} bytes, the limit of spec.size): a disk made from it would have that size",
        hearth_api::MAX_DISK_BYTES
    )
}

/// Whether a disk of `size` (None: the image's own) can be made from
/// `image` now.
pub fn ready_for_disk(
    store: &Store,
    image: &str,
    size: Option<u64>,
) -> Result<Result<ReadyImage, NotReady>, StoreError> {
    let Some(s) = store.get(Kind::VirtualImage, image)? else {
        return Ok(Err(NotReady::Waiting(format!(
            "waiting for VirtualImage {image:?}, which does not exist"
        ))));
    };
    if s.deleting {
        return Ok(Err(NotReady::Waiting(format!(
            "VirtualImage {image:?} is being deleted"
        ))));
    }
    let st: VirtualImageStatus = serde_json::from_value(s.status).unwrap_or_default();
    Ok(match (st.phase, &st.path, &st.format, st.virtual_size) {
        (ImagePhase::Ready, Some(path), Some(format), Some(virtual_size)) => match size {
            Some(size) if size < virtual_size => Err(NotReady::TooSmall {
                image: image.to_string(),
                size,
                virtual_size,
            }),
            _ if virtual_size > hearth_api::MAX_DISK_BYTES => Err(NotReady::TooLarge {
                image: image.to_string(),
                virtual_size,
            }),
            _ => Ok(ReadyImage {
                name: image.to_string(),
                path: path.clone(),
                format: format.clone(),
                virtual_size,
                shape: st.shape.clone(),
            }),
        },
        (ImagePhase::Failed, ..) => Err(NotReady::Waiting(format!(
            "waiting for VirtualImage {image:?}: Failed ({}: {})",
            st.reason.as_deref().unwrap_or("unknown"),
            st.message.as_deref().unwrap_or("")
        ))),
        (phase, ..) => Err(NotReady::Waiting(format!(
            "waiting for VirtualImage {image:?} ({phase}{})",
            st.progress
                .as_deref()
                .map(|p| format!(", {p}"))
                .unwrap_or_default()
        ))),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_failed_import_asks_to_run_again_when_its_retry_is_due() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context::for_test(dir.path());
        let image = hearth_api::parse_documents(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualImage\nmetadata: {name: img}\nspec: {source: {file: /srv/x.qcow2}}\n",
            "t",
        )
        .unwrap();
        ctx.store.put_objects(&image).unwrap();
        ctx.set_image_status("img", |s| {
            s.phase = ImagePhase::Failed;
            s.attempts = Some(1);
        });
        ctx.imports.finished("img", Some(None));
        // The first retry is due `retry_base` after the failure.
        let wait = ctx.config.images.retry_base;
        match reconcile(&ctx, "img").await.unwrap() {
            Action::RequeueAfter(left) => {
                assert!(left > Duration::ZERO && left <= wait, "{left:?}")
            }
            Action::Done => panic!("a failed import must ask for its retry"),
        }
    }
}
