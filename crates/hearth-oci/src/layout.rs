//! An OCI image layout on the host: the directory `skopeo copy oci:DIR:TAG`
//! and `umoci` write (`oci-layout`, `index.json`, `blobs/sha256/HEX`).
//!
//! Nothing in it is trusted: every blob read is hashed and checked against
//! the digest and size that name it, a blob must be a regular file (not a
//! link out of the layout), and documents are bounded before they are
//! parsed.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use oci_spec::image::{Descriptor, Digest, ImageConfiguration, ImageIndex, ImageManifest};
use sha2::{Digest as _, Sha256};

use crate::blobs::{BlobStore, Counting, read_bounded, sha256_hex};
pub use crate::resolve::{Need, Resolver};
use crate::{MAX_MANIFEST_BYTES, OciError};

/// The annotation that names an image of a layout (its tag).
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// One image, resolved to its linux/amd64 manifest.
#[derive(Clone, Debug)]
pub struct Image {
    /// The manifest's digest: what `status.digest` shows, and what makes a
    /// tag reproducible.
    pub digest: Digest,
    pub manifest: ImageManifest,
    pub config: ImageConfiguration,
    /// The documents read on the way, each with its bytes as read (index
    /// or indexes, the manifest, the config), to be stored beside the layers.
    pub documents: Vec<(Descriptor, Vec<u8>)>,
}

impl Image {
    /// The layers, bottom first.
    pub fn layers(&self) -> &[Descriptor] {
        self.manifest.layers()
    }

    /// The bytes of the layers, compressed, as their descriptors say.
    pub fn layer_bytes(&self) -> u64 {
        self.layers().iter().map(|l| l.size()).sum()
    }
}

/// An image layout directory.
#[derive(Debug)]
pub struct Layout {
    dir: PathBuf,
    index: ImageIndex,
}

impl Layout {
    /// Opens the layout at `dir`: its `oci-layout` marks it, its
    /// `index.json` lists its images.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Layout, OciError> {
        let dir = dir.into();
        let not = |why: String| OciError::NotALayout {
            path: dir.clone(),
            why,
        };
        let marker = dir.join("oci-layout");
        let text = fs::read(&marker).map_err(|e| not(format!("oci-layout: {e}")))?;
        let version = serde_json::from_slice::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["imageLayoutVersion"].as_str().map(str::to_string));
        if version.as_deref() != Some("1.0.0") {
            return Err(not(format!(
                "oci-layout does not say imageLayoutVersion \"1.0.0\" (it says {})",
                version.as_deref().unwrap_or("nothing")
            )));
        }
        let path = dir.join("index.json");
        let file = File::open(&path).map_err(|e| not(format!("index.json: {e}")))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len > MAX_MANIFEST_BYTES {
            return Err(not(format!(
                "index.json is {len} bytes, more than the limit of {MAX_MANIFEST_BYTES}"
            )));
        }
        let index = ImageIndex::from_reader(file).map_err(|e| not(format!("index.json: {e}")))?;
        Ok(Layout { dir, index })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tags of the layout's images, as `index.json` lists them.
    pub fn tags(&self) -> Vec<String> {
        tags_of(&self.index)
    }

    /// The image tagged `tag`, or the layout's only image when `tag` is
    /// `None`, resolved to linux/amd64 and read whole except its layers.
    pub fn image(&self, tag: Option<&str>) -> Result<Image, OciError> {
        let top = tagged(&self.dir, &self.index, tag)?;
        resolve(top.clone(), |d, limit, what| {
            self.read_document(d, limit, what)
        })
    }

    /// Copies the image's documents and layers into `store`, each verified
    /// as it streams. `progress` hears the layer bytes copied so far (every few
    /// MiB and after each layer). Returns the
    /// bytes copied (blobs already stored are not copied again).
    pub fn copy_into(
        &self,
        image: &Image,
        store: &BlobStore,
        mut progress: impl FnMut(u64),
    ) -> Result<u64, OciError> {
        let mut copied = 0;
        for (d, bytes) in &image.documents {
            copied += store.put(d.digest(), d.size(), &mut bytes.as_slice())?;
        }
        // Progress counts layer bytes, as `layer_bytes` does.
        let mut layers_done = 0;
        for layer in image.layers() {
            if store.contains(layer.digest()) {
                continue;
            }
            let from = self.open_blob(layer.digest())?;
            let base = layers_done;
            let n = {
                let mut from = Counting::new(from, |n| progress(base + n));
                store.put(layer.digest(), layer.size(), &mut from)?
            };
            copied += n;
            layers_done += n;
            progress(layers_done);
        }
        Ok(copied)
    }

    /// Opens the blob `digest` of the layout; it must be a regular file.
    pub fn open_blob(&self, digest: &Digest) -> Result<File, OciError> {
        let path = self.dir.join("blobs/sha256").join(sha256_hex(digest)?);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OciError::MissingBlob {
                    layout: self.dir.clone(),
                    digest: digest.to_string(),
                });
            }
            Err(e) => return Err(OciError::io("reading", &path, e)),
        };
        if !meta.is_file() {
            return Err(OciError::NotAFile {
                layout: self.dir.clone(),
                digest: digest.to_string(),
            });
        }
        File::open(&path).map_err(|e| OciError::io("opening", &path, e))
    }

    fn read_document(
        &self,
        d: &Descriptor,
        limit: u64,
        what: &'static str,
    ) -> Result<Vec<u8>, OciError> {
        let file = self.open_blob(d.digest())?;
        read_bounded(what, d.digest().as_ref(), file, limit)
    }
}

/// The tags an index lists (`org.opencontainers.image.ref.name`).
pub(crate) fn tags_of(index: &ImageIndex) -> Vec<String> {
    index
        .manifests()
        .iter()
        .filter_map(|d| d.annotations().as_ref()?.get(REF_NAME).cloned())
        .collect()
}

/// The entry of `index` (of the layout or archive at `place`) tagged
/// `tag`, or its only entry when `tag` is `None`.
pub(crate) fn tagged<'a>(
    place: &Path,
    index: &'a ImageIndex,
    tag: Option<&str>,
) -> Result<&'a Descriptor, OciError> {
    choose(place, index.manifests(), tag, tags_of(index), |d, t| {
        d.annotations()
            .as_ref()
            .and_then(|a| a.get(REF_NAME))
            .is_some_and(|n| n == t)
    })
}

/// The one of `entries` that `matches` `tag`, or the only one when `tag`
/// is `None`; `tags` are named when none or several fit.
pub(crate) fn choose<'a, T>(
    place: &Path,
    entries: &'a [T],
    tag: Option<&str>,
    tags: Vec<String>,
    matches: impl Fn(&T, &str) -> bool,
) -> Result<&'a T, OciError> {
    match (tag, entries) {
        (Some(t), _) => {
            entries
                .iter()
                .find(|e| matches(e, t))
                .ok_or_else(|| OciError::TagNotFound {
                    layout: place.to_path_buf(),
                    tag: t.to_string(),
                    tags,
                })
        }
        (None, [only]) => Ok(only),
        (None, _) => Err(OciError::TagNeeded {
            layout: place.to_path_buf(),
            count: entries.len(),
            tags,
        }),
    }
}

/// Checks that `bytes` are what `d` names.
pub fn verify(d: &Descriptor, bytes: &[u8]) -> Result<(), OciError> {
    if bytes.len() as u64 != d.size() {
        return Err(OciError::SizeMismatch {
            digest: d.digest().to_string(),
            expected: d.size(),
            actual: bytes.len() as u64,
        });
    }
    let actual = format!("{:x}", Sha256::digest(bytes));
    if sha256_hex(d.digest())? != actual {
        return Err(OciError::DigestMismatch {
            expected: d.digest().to_string(),
            actual,
        });
    }
    Ok(())
}

/// Follows `top` to the linux/amd64 image, reading each document with
/// `read` (which bounds it by the limit given); [`Resolver`] verifies it.
/// The blocking sources (a layout, an archive) use this; a registry drives
/// the [`Resolver`] itself.
pub fn resolve(
    top: Descriptor,
    mut read: impl FnMut(&Descriptor, u64, &'static str) -> Result<Vec<u8>, OciError>,
) -> Result<Image, OciError> {
    let mut r = Resolver::new(top);
    loop {
        match r.need()? {
            Need::Read {
                descriptor,
                limit,
                what,
            } => {
                let bytes = read(&descriptor, limit, what)?;
                r.feed(bytes)?;
            }
            Need::Nothing(image) => return Ok(*image),
        }
    }
}
