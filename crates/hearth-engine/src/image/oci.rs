//! OCI sources (`spec.source.oci`): a registry, an image layout or an
//! archive, read with `hearth-oci` into the blob store
//! (`IMAGES/.oci/blobs/`, shared by every OCI image, each blob once), then
//! made into the image's file in the import's temporary: a containerDisk's
//! disk file as it is, a rootfs as an ext4 image built from its layers in
//! `IMAGES/.oci/build/`. The file then takes the checks and the commit every
//! import takes (`import::verify`, `commit`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use hearth_api::{OciShape, OciSource};
use hearth_oci::blobs::BlobStore;
use hearth_oci::layout::{Image, Layout};
use hearth_oci::registry::{Credentials, Options, Registry};
use hearth_oci::shape::{self, Shape};
use hearth_oci::unpack::Unpacker;
use hearth_oci::{OciError, ext4};
use sha2::{Digest as _, Sha256};

use super::import::{Failure, Fetched, NO_SPACE, TempFile};
use super::progress::{Progress, Report};
use super::space::{NoRoom, Room};
use crate::context::Context;

/// What an OCI import adds to the status.
#[derive(Clone, Debug)]
pub struct OciDone {
    /// The manifest's digest.
    pub digest: String,
    pub shape: OciShape,
    pub layers: u32,
    /// A rootfs's own kernel and initrd, already in the image store.
    pub boot: Option<hearth_oci::kernel::Boot>,
}

/// The blob store's place in the image store.
pub fn blob_dir(images: &Path) -> PathBuf {
    images.join(".oci/blobs")
}

fn build_dir(images: &Path) -> PathBuf {
    images.join(".oci/build")
}

/// At start, before any import: what interrupted imports left in the blob
/// store's `tmp/` and in the build directory goes.
pub fn sweep(images: &Path) {
    // Made by the first OCI import, not before.
    if blob_dir(images).is_dir()
        && let Ok(store) = BlobStore::open(blob_dir(images))
    {
        let _ = store.sweep();
    }
    if let Ok(entries) = std::fs::read_dir(build_dir(images)) {
        for e in entries.flatten() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// OCI imports in flight, and whether a release of blobs waits for them.
struct Leases {
    running: usize,
    due: bool,
}

static LEASES: std::sync::Mutex<Leases> = std::sync::Mutex::new(Leases {
    running: 0,
    due: false,
});

fn leases() -> std::sync::MutexGuard<'static, Leases> {
    LEASES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Held by an OCI import from before it first looks at the blob store
/// until after its commit has written `status.digest` (which makes its
/// blobs the image's): while any is held, a release of unused blobs waits,
/// so it cannot remove a blob an import found stored and is about to read.
pub struct Lease(Arc<Context>);

impl Lease {
    pub fn take(ctx: &Arc<Context>) -> Lease {
        leases().running += 1;
        Lease(ctx.clone())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut l = leases();
        l.running -= 1;
        if l.running == 0 && l.due {
            l.due = false;
            // Under the lock: no import takes a lease until it is done.
            collect(&self.0);
        }
    }
}

/// Releases the blobs no OCI image uses any more (after an image's
/// delete): at once when no OCI import is in flight, else when the last
/// one ends.
pub fn release_blobs(ctx: &Arc<Context>) {
    let mut l = leases();
    if l.running > 0 {
        l.due = true;
        return;
    }
    collect(ctx);
}

/// Removes every blob not reachable from an OCI image's `status.digest`
/// (its manifest or index, then what those name). Logged, never failing
/// the caller: a blob kept too long only costs space. Returns how many
/// went.
fn collect(ctx: &Context) -> usize {
    collect_in(&ctx.store, &ctx.config.images_dir())
}

/// At start, after [`sweep`] and before any import: a release a crash put
/// off (its delete committed, its blobs not yet removed) is done now, but
/// only when every OCI image is Ready: an import a crash cut short has
/// blobs stored that nothing names yet, and its next attempt reuses them.
pub fn release_at_start(store: &crate::store::Store, images: &Path) {
    let all_ready = store.list(hearth_api::Kind::VirtualImage).is_ok_and(|v| {
        v.into_iter().all(|o| {
            let oci = matches!(&o.object, hearth_api::Object::VirtualImage(i)
                if matches!(i.spec.source, hearth_api::ImageSource::Oci(_)));
            let status: hearth_api::VirtualImageStatus =
                serde_json::from_value(o.status).unwrap_or_default();
            !oci || status.phase == hearth_api::ImagePhase::Ready
        })
    });
    if all_ready {
        collect_in(store, images);
    }
}

fn collect_in(store: &crate::store::Store, images: &Path) -> usize {
    match collect_inner(store, images) {
        Ok(n) => {
            if n > 0 {
                tracing::info!(blobs = n, "released the blobs no image uses");
            }
            n
        }
        Err(e) => {
            tracing::warn!(error = %e, "blobs not released");
            0
        }
    }
}

/// Why the blobs could not be released this time.
#[derive(Debug, thiserror::Error)]
enum CollectError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("{path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A root manifest that cannot be read or parsed.
    #[error("the manifest {path}: {why}")]
    Manifest { path: PathBuf, why: String },
}

fn collect_inner(store: &crate::store::Store, images: &Path) -> Result<usize, CollectError> {
    let dir = blob_dir(images).join("sha256");
    if !dir.is_dir() {
        return Ok(0);
    }
    let mut roots = Vec::new();
    for o in store.list(hearth_api::Kind::VirtualImage)? {
        let hearth_api::Object::VirtualImage(i) = &o.object else {
            continue;
        };
        if !matches!(i.spec.source, hearth_api::ImageSource::Oci(_)) {
            continue;
        }
        let status: hearth_api::VirtualImageStatus =
            serde_json::from_value(o.status).unwrap_or_default();
        if let Some(hex) = status
            .digest
            .as_deref()
            .and_then(|d| d.strip_prefix("sha256:"))
        {
            roots.push(hex.to_string());
        }
    }
    let keep = reachable(&dir, roots)?;
    let mut removed = 0;
    let entries = std::fs::read_dir(&dir).map_err(|source| CollectError::Dir {
        path: dir.clone(),
        source,
    })?;
    for e in entries {
        let Ok(e) = e else { continue };
        let name = e.file_name().to_string_lossy().into_owned();
        if !keep.contains(&name) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0
        && let Ok(d) = std::fs::File::open(&dir)
    {
        let _ = d.sync_all();
    }
    Ok(removed)
}

/// The blobs reachable from `roots` (manifests or indexes named by their
/// hex) in the store directory `dir`: each document's `manifests`,
/// `config` and `layers`, an index's manifests followed. A root that is
/// not stored, or does not parse, keeps everything (an error): its blobs
/// are not known, so none may go.
fn reachable(
    dir: &Path,
    roots: Vec<String>,
) -> Result<std::collections::HashSet<String>, CollectError> {
    let mut keep = std::collections::HashSet::new();
    let mut todo: Vec<(String, bool)> = roots.into_iter().map(|r| (r, true)).collect();
    while let Some((hex, root)) = todo.pop() {
        if !keep.insert(hex.clone()) {
            continue;
        }
        let path = dir.join(&hex);
        let read = std::fs::File::open(&path).and_then(|f| {
            let mut buf = Vec::new();
            f.take(hearth_oci::MAX_MANIFEST_BYTES + 1)
                .read_to_end(&mut buf)
                .map(|_| buf)
        });
        let doc = match read.map_err(|e| e.to_string()).and_then(|b| {
            serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string())
        }) {
            Ok(doc) => doc,
            // An index names every platform's manifest; only one is stored.
            Err(_) if !root => continue,
            Err(why) => return Err(CollectError::Manifest { path, why }),
        };
        let digest = |v: &serde_json::Value| {
            v["digest"]
                .as_str()
                .and_then(|d| d.strip_prefix("sha256:"))
                .map(str::to_string)
        };
        for m in doc["manifests"].as_array().into_iter().flatten() {
            if let Some(h) = digest(m) {
                todo.push((h, false));
            }
        }
        let leaves = doc["layers"].as_array().into_iter().flatten();
        for d in std::iter::once(&doc["config"]).chain(leaves) {
            if let Some(h) = digest(d) {
                keep.insert(h);
            }
        }
    }
    Ok(keep)
}

/// The field of `spec.source.oci` a source is given by.
fn field(src: &OciSource) -> &'static str {
    if src.reference.is_some() {
        "spec.source.oci.reference"
    } else if src.layout.is_some() {
        "spec.source.oci.layout"
    } else {
        "spec.source.oci.archive"
    }
}

impl From<NoRoom> for OciError {
    fn from(e: NoRoom) -> OciError {
        OciError::NoRoom {
            needs: e.needs,
            message: e.message,
        }
    }
}

/// The bytes of `image`'s layers the blob store does not hold yet: what
/// copying it in writes.
fn missing_bytes(store: &BlobStore, image: &Image) -> u64 {
    image
        .layers()
        .iter()
        .filter(|d| !store.contains(d.digest()))
        .map(|d| d.size())
        .sum()
}

/// The free-space reserve on the filesystem of `dir`.
fn room(dir: &Path, reserve: u64) -> Result<Room, OciError> {
    Room::new(dir, reserve).map_err(|e| OciError::io("statvfs", dir, e))
}

/// A failure of `hearth-oci`, with its reason and the field it is about.
fn failure(src: &OciSource, e: OciError) -> Failure {
    let needs_room = match &e {
        OciError::NoRoom { needs, .. } => Some(*needs),
        _ => None,
    };
    let reason = match &e {
        OciError::DigestMismatch { .. } => "DigestMismatch",
        OciError::SizeMismatch { .. } => "SizeMismatch",
        OciError::TooLarge { .. } => "TooLarge",
        OciError::UnsupportedDigest { .. } => "UnsupportedDigest",
        OciError::Json { .. } | OciError::NestedTooDeep { .. } => "BadManifest",
        OciError::NotALayout { .. } | OciError::MissingBlob { .. } | OciError::NotAFile { .. } => {
            "BadImage"
        }
        OciError::TagNotFound { .. } | OciError::TagNeeded { .. } => "TagNotFound",
        OciError::NoPlatform { .. } => "NoPlatform",
        OciError::MediaType { .. } => "UnsupportedMediaType",
        OciError::Layer { .. } => "BadLayer",
        OciError::Registry { .. } => "RegistryError",
        OciError::Timeout { .. } => "Timeout",
        OciError::Denied { .. } => "AuthFailed",
        OciError::Io { .. } => "ReadFailed",
        OciError::Build(_) => "BuildFailed",
        OciError::NoRoom { .. } => NO_SPACE,
    };
    Failure {
        needs_room,
        ..Failure::new(reason, format!("{}: {e}", field(src)))
    }
}

fn blocking_failed(e: tokio::task::JoinError) -> Failure {
    Failure::new("StoreFailed", format!("the import's worker failed: {e}"))
}

/// Reads the image `src` names into the blob store and makes its file in
/// `tmp`; returns what was read and the hash of the file.
pub async fn fetch(
    ctx: &Arc<Context>,
    src: &OciSource,
    tmp: &mut TempFile,
    mut report: impl FnMut(Report),
) -> Result<(Fetched, OciDone), Failure> {
    let images = ctx.config.images_dir();
    let cfg = ctx.config.images.clone();
    let store = BlobStore::open(blob_dir(&images)).map_err(|e| failure(src, e))?;
    let started = Instant::now();
    let image = read_image(ctx, src, &store, &mut report).await?;
    let layers = u32::try_from(image.layers().len()).unwrap_or(u32::MAX);
    let limit = cfg.max_bytes;

    // The shape, from the spec or from the content (a containerDisk's
    // disk file is found the same way).
    let found = if src.shape == Some(OciShape::Rootfs) {
        None
    } else {
        let (store, image) = (store.clone(), image.clone());
        let found = tokio::task::spawn_blocking(move || detect(&store, &image, limit))
            .await
            .map_err(blocking_failed)?
            .map_err(|e| failure(src, e))?;
        Some(found)
    };
    let shape = match (src.shape, &found) {
        (Some(s), _) => s,
        (None, Some(Shape::ContainerDisk { .. })) => OciShape::ContainerDisk,
        (None, _) => OciShape::Rootfs,
    };
    let out = tmp.path.clone();
    let mut boot = None;
    let (hex, bytes) = match shape {
        OciShape::ContainerDisk => {
            let Some(Shape::ContainerDisk { path, size, at }) = found else {
                return Err(Failure::new(
                    "NotAContainerDisk",
                    format!(
                        "{}: spec.source.oci.shape says containerDisk, but the image's only regular file is not one file under /disk/",
                        field(src)
                    ),
                ));
            };
            if size > limit {
                return Err(Failure::new(
                    "TooLarge",
                    format!(
                        "{}: the disk file /{path} is {size} bytes, more than the {limit} allowed (hearthd --image-max-bytes)",
                        field(src)
                    ),
                ));
            }
            tmp.ensure_room(size)?;
            let layer = image.layers()[at.layer].clone();
            tokio::task::spawn_blocking(move || -> Result<(String, u64), OciError> {
                let blob = store.open_blob(layer.digest())?;
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&out)
                    .map_err(|e| OciError::io("opening", &out, e))?;
                let mut w = Hashing::new(file);
                let n = shape::copy_file(&layer, blob, &at, limit, &mut w)?;
                w.inner
                    .sync_all()
                    .map_err(|e| OciError::io("flushing", &out, e))?;
                Ok((w.hex(), n))
            })
            .await
            .map_err(blocking_failed)?
            .map_err(|e| failure(src, e))?
        }
        OciShape::Rootfs => {
            let n = ctx
                .store
                .next_counter("image-import")
                .map_err(|e| Failure::new("StoreFailed", e.to_string()))?;
            let build = Build::make(build_dir(&images).join(format!("{n:08}")))?;
            let root = build.0.clone();
            let (store2, image2) = (store.clone(), image.clone());
            let reserve = cfg.free_space_reserve;
            tokio::task::spawn_blocking(move || unpack(&store2, &image2, &root, limit, reserve))
                .await
                .map_err(blocking_failed)?
                .map_err(|e| failure(src, e))?;
            boot = boot_files(src, &build.0, &images, &tmp.path, cfg.free_space_reserve).await?;
            let root = build.0.clone();
            let size = tokio::task::spawn_blocking(move || {
                ext4::measure(&root).map(|m| ext4::size_for(m, 0))
            })
            .await
            .map_err(blocking_failed)?
            .map_err(|e| failure(src, e))?;
            tmp.ensure_room(size)?;
            let root = build.0.clone();
            let done = tokio::task::spawn_blocking(move || -> Result<(String, u64), OciError> {
                ext4::build(&root, &out, 0)?;
                let mut f =
                    std::fs::File::open(&out).map_err(|e| OciError::io("reading", &out, e))?;
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                let mut n = 0u64;
                loop {
                    let got = f
                        .read(&mut buf)
                        .map_err(|e| OciError::io("reading", &out, e))?;
                    if got == 0 {
                        break;
                    }
                    h.update(&buf[..got]);
                    n += got as u64;
                }
                Ok((format!("{:x}", h.finalize()), n))
            })
            .await
            .map_err(blocking_failed)?
            .map_err(|e| failure(src, e))?;
            drop(build);
            done
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    Ok((
        Fetched {
            hex,
            bytes,
            seconds,
            bytes_per_second: (image.layer_bytes() as f64 / seconds.max(0.001)) as u64,
        },
        OciDone {
            digest: image.digest.to_string(),
            shape,
            layers,
            boot,
        },
    ))
}

/// The kernel and initrd under the tree's `/boot`, stored (durably) before
/// the image that names them is committed; a crash in between leaves
/// files the store's sweep removes at the next start. Their bytes are
/// admitted above the free-space reserve first.
async fn boot_files(
    src: &OciSource,
    root: &Path,
    images: &Path,
    tmp: &Path,
    reserve: u64,
) -> Result<Option<hearth_oci::kernel::Boot>, Failure> {
    let (root, images) = (root.to_path_buf(), images.to_path_buf());
    // `.import-<n>-<image>`: the sweep's temporaries.
    let base = tmp
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tmp"))
        .unwrap_or(".import-boot")
        .to_string();
    let admit = move |root: &Path, images: &Path| -> Result<(), OciError> {
        let Some(found) = hearth_oci::kernel::find(root) else {
            return Ok(());
        };
        let size = |rel: &Path| std::fs::metadata(root.join(rel)).map_or(0, |m| m.len());
        let bytes = size(&found.kernel) + found.initrd.as_deref().map_or(0, size);
        Ok(room(images, reserve)?.take(bytes, "the kernel and initrd under /boot")?)
    };
    let (room_root, room_images) = (root.clone(), images.clone());
    tokio::task::spawn_blocking(move || admit(&room_root, &room_images))
        .await
        .map_err(blocking_failed)?
        .map_err(|e| failure(src, e))?;
    tokio::task::spawn_blocking(move || hearth_oci::kernel::extract(&root, &images, &base))
        .await
        .map_err(blocking_failed)?
        .map_err(|e| Failure::new("StoreFailed", format!("the kernel under /boot: {e}")))
}

/// Resolves the image and puts its blobs into the store.
async fn read_image(
    ctx: &Arc<Context>,
    src: &OciSource,
    store: &BlobStore,
    report: &mut impl FnMut(Report),
) -> Result<Image, Failure> {
    let cfg = &ctx.config.images;
    if let Some(reference) = &src.reference {
        // The daemon's own trust for this host, where the image says nothing.
        let trust = cfg.registry_trust(reference);
        let credentials = match src
            .credentials_file
            .as_ref()
            .or(trust.credentials_file.as_ref())
        {
            Some(p) => Some(read_credentials(p)?),
            None => None,
        };
        let options = Options {
            ca_file: src.ca_file.clone().or(trust.ca_file),
            credentials,
            insecure: src.insecure || trust.insecure,
            timeout: Some(cfg.read_timeout),
        };
        let registry = Registry::new(reference, &options).map_err(|e| failure(src, e))?;
        let image = registry.image().await.map_err(|e| failure(src, e))?;
        room(&ctx.config.images_dir(), cfg.free_space_reserve)
            .and_then(|mut r| Ok(r.take(missing_bytes(store, &image), "the image's layers")?))
            .map_err(|e| failure(src, e))?;
        let mut progress = Progress::new(Some(image.layer_bytes()), Instant::now());
        report(progress.report());
        let mut last = 0u64;
        registry
            .copy_into(&image, store, |n| {
                if let Some(r) = progress.add(n.saturating_sub(last), Instant::now()) {
                    report(r);
                }
                last = n;
            })
            .await
            .map_err(|e| failure(src, e))?;
        return Ok(image);
    }
    let (store, src2, tag, limit) = (store.clone(), src.clone(), src.tag.clone(), cfg.max_bytes);
    let (images, reserve) = (ctx.config.images_dir(), cfg.free_space_reserve);
    let open_room = move || room(&images, reserve);
    let path = match (&src.layout, &src.archive) {
        (Some(p), _) => ctx.config.confine_dir(p),
        (_, Some(p)) => ctx.config.confine(p),
        _ => unreachable!("validated: one source"),
    }
    .map_err(|m| Failure::new("SourceNotAllowed", format!("{}: {m}", field(src))))?;
    report(Progress::new(None, Instant::now()).report());
    // The copy runs on a blocking thread; its progress (bytes done, and the
    // total once known) comes back over a watch channel to be reported here.
    let (tx, mut rx) = tokio::sync::watch::channel((0u64, None::<u64>));
    let job = tokio::task::spawn_blocking(move || -> Result<Image, OciError> {
        if src2.layout.is_some() {
            let layout = Layout::open(&path)?;
            let image = layout.image(tag.as_deref())?;
            open_room()?.take(missing_bytes(&store, &image), "the image's layers")?;
            let total = Some(image.layer_bytes());
            let _ = tx.send((0, total));
            layout.copy_into(&image, &store, |n| {
                let _ = tx.send((n, total));
            })?;
            Ok(image)
        } else {
            let total = std::fs::metadata(&path).ok().map(|m| m.len());
            // Which blobs are new is known only as the archive is read:
            // each is admitted as it comes.
            let mut room = open_room()?;
            hearth_oci::archive::import_checked(
                &path,
                &store,
                tag.as_deref(),
                limit,
                |n| {
                    let _ = tx.send((n, total));
                },
                |n| room.take(n, "a blob of the archive").map_err(|e| e.message),
            )
        }
    });
    tokio::pin!(job);
    // Made at the first message: each carries the same total.
    let mut progress: Option<(Progress, u64)> = None;
    let mut open = true;
    let done = loop {
        tokio::select! {
            r = &mut job => break r,
            changed = rx.changed(), if open => {
                if changed.is_err() {
                    open = false;
                    continue;
                }
                let (n, total) = *rx.borrow_and_update();
                let (p, last) =
                    progress.get_or_insert_with(|| (Progress::new(total, Instant::now()), 0));
                if let Some(r) = p.add(n.saturating_sub(*last), Instant::now()) {
                    report(r);
                }
                *last = n;
            }
        }
    };
    done.map_err(blocking_failed)?.map_err(|e| failure(src, e))
}

fn read_credentials(path: &Path) -> Result<Credentials, Failure> {
    let fail = |m: String| {
        Failure::new(
            "CredentialsUnreadable",
            format!("spec.source.oci.credentialsFile: {}: {m}", path.display()),
        )
    };
    let text = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    if text.len() > 64 << 10 {
        return Err(fail("larger than 64 KiB".into()));
    }
    // The parser's message names a position, never the file's content.
    serde_json::from_slice(&text).map_err(|e| {
        fail(format!(
            "not a JSON object {{\"username\": .., \"password\": ..}} (line {}, column {})",
            e.line(),
            e.column()
        ))
    })
}

fn detect(store: &BlobStore, image: &Image, limit: u64) -> Result<Shape, OciError> {
    let mut blobs = Vec::new();
    for d in image.layers() {
        blobs.push((d.clone(), store.open_blob(d.digest())?));
    }
    shape::detect(blobs, limit)
}

/// The layers applied into `root`, each file first admitted above the
/// free-space reserve `reserve` (a layer's unpacked size is known only as
/// it is read).
fn unpack(
    store: &BlobStore,
    image: &Image,
    root: &Path,
    limit: u64,
    reserve: u64,
) -> Result<(), OciError> {
    let mut room = room(root, reserve)?;
    let mut u = Unpacker::new(root)?.with_room_check(Box::new(move |n| {
        room.take(n, "a file of the image's tree")
            .map_err(|e| e.message)
    }));
    for d in image.layers() {
        u.layer(d, store.open_blob(d.digest())?, limit)?;
    }
    u.finish()?;
    Ok(())
}

/// A build directory, removed with all in it when dropped.
struct Build(PathBuf);

impl Build {
    fn make(path: PathBuf) -> Result<Build, Failure> {
        std::fs::create_dir_all(&path)
            .map_err(|e| Failure::new("StoreFailed", format!("{}: {e}", path.display())))?;
        Ok(Build(path))
    }
}

impl Drop for Build {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A writer that hashes what goes through it.
struct Hashing<W> {
    inner: W,
    hasher: Sha256,
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Hashing {
            inner,
            hasher: Sha256::new(),
        }
    }

    fn hex(&self) -> String {
        format!("{:x}", self.hasher.clone().finalize())
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn d(c: char) -> String {
        format!("sha256:{}", hex(c))
    }

    #[test]
    fn what_an_image_reaches_is_its_index_manifests_config_and_layers() {
        let dir = tempfile::tempdir().unwrap();
        let put = |c: char, v: serde_json::Value| {
            std::fs::write(dir.path().join(hex(c)), v.to_string()).unwrap()
        };
        // An index naming two platforms' manifests, one of them stored.
        put(
            'a',
            serde_json::json!({"manifests": [{"digest": d('b')}, {"digest": d('f')}]}),
        );
        put(
            'b',
            serde_json::json!({"config": {"digest": d('c')}, "layers": [{"digest": d('d')}]}),
        );
        let keep = reachable(dir.path(), vec![hex('a')]).unwrap();
        let mut got: Vec<String> = keep.into_iter().collect();
        got.sort();
        assert_eq!(got, vec![hex('a'), hex('b'), hex('c'), hex('d'), hex('f')]);
        // A root whose document is not stored keeps everything.
        let e = reachable(dir.path(), vec![hex('a'), hex('e')])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&hex('e')), "{e}");
        // No image: nothing is kept.
        assert!(reachable(dir.path(), vec![]).unwrap().is_empty());
    }
}
