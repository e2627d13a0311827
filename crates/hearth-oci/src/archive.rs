//! Image archives: one tar file holding an image, as `docker save`,
//! `podman save` and `skopeo copy docker-archive:`/`oci-archive:` write it.
//!
//! Two layouts exist inside such a tar, and newer `docker save` writes both:
//! an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/HEX`), read
//! as a layout is; or Docker's own (`manifest.json` naming a config file and
//! layer files by path). For the second, the layers are stored under the
//! digest their bytes hash to, and hearth writes the OCI manifest the
//! archive does not have; that manifest's digest is the image's digest.
//!
//! The archive is read once, as a stream: blobs go straight into the blob
//! store (an OCI blob checked against the name it has), documents stay in
//! memory, bounded. Links, directories and Docker's legacy per-layer
//! metadata are passed over.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use oci_spec::image::{Descriptor, Digest, ImageIndex};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::blobs::{BlobStore, Counting, read_bounded};
use crate::layout::{self, Image};
use crate::{MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, OciError};

/// One entry of Docker's `manifest.json`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// What the archive held, after one pass.
#[derive(Default)]
struct Read1 {
    oci_layout: bool,
    index: Option<Vec<u8>>,
    docker_manifest: Option<Vec<u8>>,
    /// Paths of the files stored, with their digest and size.
    files: HashMap<String, (Digest, u64)>,
    /// Symlinks: path -> target path, both from the archive's root.
    links: HashMap<String, String>,
}

fn not(path: &Path, why: impl Into<String>) -> OciError {
    OciError::NotALayout {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// Reads the archive at `path` into `store` and resolves its image (by
/// `tag`, or the only one) to linux/amd64. Each blob is at most `limit`
/// bytes.
pub fn import(
    path: &Path,
    store: &BlobStore,
    tag: Option<&str>,
    limit: u64,
) -> Result<Image, OciError> {
    import_with_progress(path, store, tag, limit, |_| {})
}

/// [`import`], telling `progress` how many bytes of the archive file were
/// read so far (every few MiB): the archive is read once, so its length is
/// the whole of the work.
pub fn import_with_progress(
    path: &Path,
    store: &BlobStore,
    tag: Option<&str>,
    limit: u64,
    progress: impl FnMut(u64),
) -> Result<Image, OciError> {
    import_checked(path, store, tag, limit, progress, |_| Ok(()))
}

/// [`import_with_progress`], each blob the store does not hold yet first
/// admitted by `room` with its size (the caller's free-space reserve), so
/// an archive whose blobs are mostly stored asks room only for the new
/// ones. A refusal stops the import before that blob's first byte
/// ([`OciError::NoRoom`], counting the bytes admitted before it).
pub fn import_checked(
    path: &Path,
    store: &BlobStore,
    tag: Option<&str>,
    limit: u64,
    progress: impl FnMut(u64),
    mut room: impl FnMut(u64) -> Result<(), String>,
) -> Result<Image, OciError> {
    let file =
        std::fs::File::open(path).map_err(|e| OciError::io("opening the archive", path, e))?;
    let got = read_once(path, Counting::new(file, progress), store, limit, &mut room)?;
    if got.oci_layout
        && let Some(index) = &got.index
    {
        return from_oci(path, index, store, tag);
    }
    if let Some(manifest) = &got.docker_manifest {
        return from_docker(path, &got, manifest, store, tag);
    }
    Err(not(
        path,
        "the archive has neither an OCI layout (oci-layout, index.json) nor a Docker manifest.json",
    ))
}

fn read_once(
    path: &Path,
    file: impl Read,
    store: &BlobStore,
    limit: u64,
    room: &mut dyn FnMut(u64) -> Result<(), String>,
) -> Result<Read1, OciError> {
    let mut got = Read1::default();
    let mut admitted = 0u64;
    let mut admit = |size: u64| {
        room(size).map_err(|message| OciError::NoRoom {
            needs: admitted + size,
            message,
        })?;
        admitted += size;
        Ok::<_, OciError>(())
    };
    let mut archive = tar::Archive::new(file);
    let bad = |e: std::io::Error| not(path, format!("reading the tar: {e}"));
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let name = crate::shape::entry_path(&entry.path_bytes()).map_err(|m| not(path, m))?;
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::Symlink {
            if let Some(target) = entry.link_name_bytes() {
                let dir = name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                let joined = if dir.is_empty() {
                    String::from_utf8_lossy(&target).into_owned()
                } else {
                    format!("{dir}/{}", String::from_utf8_lossy(&target))
                };
                if let Ok(t) = crate::shape::entry_path(joined.as_bytes()) {
                    got.links.insert(name, t);
                }
            }
            continue;
        }
        if !matches!(kind, tar::EntryType::Regular | tar::EntryType::Continuous) {
            continue;
        }
        match name.as_str() {
            "oci-layout" => {
                read_bounded("oci-layout", "in the archive", &mut entry, 4096)?;
                got.oci_layout = true;
            }
            "index.json" => {
                got.index = Some(read_bounded(
                    "index.json",
                    "in the archive",
                    &mut entry,
                    MAX_MANIFEST_BYTES,
                )?);
            }
            "manifest.json" => {
                got.docker_manifest = Some(read_bounded(
                    "manifest.json",
                    "in the archive",
                    &mut entry,
                    MAX_MANIFEST_BYTES,
                )?);
            }
            // Docker's legacy metadata, which manifest.json never names.
            "repositories" => {}
            n if n.ends_with("/json") || n.ends_with("/VERSION") => {}
            n => {
                let size = entry.header().size().map_err(bad)?;
                if let Some(hex) = n.strip_prefix("blobs/sha256/") {
                    let digest: Digest = format!("sha256:{hex}")
                        .parse()
                        .map_err(|e| not(path, format!("{n}: not a blob name: {e}")))?;
                    if size > limit {
                        return Err(OciError::TooLarge {
                            what: "blob",
                            name: digest.to_string(),
                            size,
                            limit,
                        });
                    }
                    if !store.contains(&digest) {
                        admit(size)?;
                    }
                    store.put(&digest, size, &mut entry)?;
                    got.files.insert(n.to_string(), (digest, size));
                } else {
                    // Its digest is known only once it is read.
                    admit(size)?;
                    let (digest, size) = store.put_hashed(&mut entry, limit)?;
                    got.files.insert(n.to_string(), (digest, size));
                }
            }
        }
    }
    Ok(got)
}

fn from_oci(
    path: &Path,
    index: &[u8],
    store: &BlobStore,
    tag: Option<&str>,
) -> Result<Image, OciError> {
    let index =
        ImageIndex::from_reader(index).map_err(|e| not(path, format!("index.json: {e}")))?;
    let top = layout::tagged(path, &index, tag)?;
    layout::resolve(top.clone(), |d, limit, what| {
        read_stored(path, store, d, limit, what)
    })
}

/// A document the archive held, read back from the store (the resolver
/// verifies it).
fn read_stored(
    path: &Path,
    store: &BlobStore,
    d: &Descriptor,
    limit: u64,
    what: &'static str,
) -> Result<Vec<u8>, OciError> {
    // Stored already (by another image) counts: the name is the content.
    if !store.contains(d.digest()) {
        return Err(OciError::MissingBlob {
            layout: path.to_path_buf(),
            digest: d.digest().to_string(),
        });
    }
    store.read_small(what, d.digest(), limit)
}

fn from_docker(
    path: &Path,
    got: &Read1,
    manifest: &[u8],
    store: &BlobStore,
    tag: Option<&str>,
) -> Result<Image, OciError> {
    let entries: Vec<DockerEntry> =
        serde_json::from_slice(manifest).map_err(|e| not(path, format!("manifest.json: {e}")))?;
    let tags: Vec<String> = entries
        .iter()
        .flat_map(|e| e.repo_tags.clone().unwrap_or_default())
        .collect();
    // A RepoTag matches whole, without `docker.io/`, or by its tag part.
    let entry = layout::choose(path, &entries, tag, tags, |e, t| {
        e.repo_tags.iter().flatten().any(|r| {
            r == t
                || r.strip_prefix("docker.io/") == Some(t)
                || r.rsplit_once(':').map(|(_, x)| x) == Some(t)
        })
    })?;
    let file = |p: &str| -> Result<(Digest, u64), OciError> {
        let mut at = crate::shape::entry_path(p.as_bytes()).map_err(|m| not(path, m))?;
        // Follow the archive's own links (`ID/layer.tar -> ../HEX.tar`).
        for _ in 0..8 {
            match got.links.get(&at) {
                Some(next) => at = next.clone(),
                None => break,
            }
        }
        got.files.get(&at).cloned().ok_or_else(|| {
            not(
                path,
                format!("manifest.json names {p:?}, which the archive does not hold"),
            )
        })
    };
    let (config_digest, config_size) = file(&entry.config)?;
    if config_size > MAX_CONFIG_BYTES {
        return Err(OciError::TooLarge {
            what: "image configuration",
            name: config_digest.to_string(),
            size: config_size,
            limit: MAX_CONFIG_BYTES,
        });
    }
    let mut layers = Vec::new();
    for p in &entry.layers {
        let (digest, size) = file(p)?;
        let media = match compression_of(store, &digest)? {
            Magic::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Magic::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
            Magic::Tar => "application/vnd.oci.image.layer.v1.tar",
        };
        layers.push(
            serde_json::json!({"mediaType": media, "digest": digest.to_string(), "size": size}),
        );
    }
    let doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest.to_string(),
            "size": config_size,
        },
        "layers": layers,
    });
    let bytes = serde_json::to_vec(&doc).expect("a manifest serialises");
    let digest: Digest = format!("sha256:{:x}", Sha256::digest(&bytes))
        .parse()
        .expect("a sha256 digest");
    store.put(&digest, bytes.len() as u64, &mut bytes.as_slice())?;
    let top: Descriptor = serde_json::from_value(serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": digest.to_string(),
        "size": bytes.len(),
    }))
    .expect("a descriptor");
    layout::resolve(top, |d, limit, what| {
        read_stored(path, store, d, limit, what)
    })
}

enum Magic {
    Gzip,
    Zstd,
    Tar,
}

/// A Docker archive's layer says its compression by its first bytes only.
fn compression_of(store: &BlobStore, digest: &Digest) -> Result<Magic, OciError> {
    let mut head = [0u8; 4];
    let mut f = store.open_blob(digest)?;
    let n = f
        .read(&mut head)
        .map_err(|e| OciError::io("reading", store.path(digest).unwrap_or_default(), e))?;
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => Magic::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Magic::Zstd,
        _ => Magic::Tar,
    })
}
