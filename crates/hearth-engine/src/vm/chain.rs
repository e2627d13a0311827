//! The chain of a disk as QEMU is given it at each start: the layers the
//! store recorded when they were made, top first, down to the file at the
//! bottom (a VirtualImage's file, an administrator's `spec.source.image`,
//! or nothing). Never what the headers say now: a base image under an
//! image root may have been re-pointed (`qemu-img rebase -u -b /dev/sda`)
//! or swapped for a symbolic link since the disk was made. The headers are
//! then checked against this chain on the descriptors handed to QEMU
//! (`hearth_qemu::chain`). See docs/images.md, "Every start checks the
//! chain".

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hearth_qemu::cmdline::BackingLayer;
use rusqlite::OptionalExtension;

use crate::config::ConfigError;
use crate::context::Context;
use crate::image::names;
use crate::snapshot::storage::{self, Layer};
use crate::store::StoreError;

/// Why a disk's chain is not given to QEMU. Every message names the file
/// or the layer at fault.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("no head layer is recorded for the disk")]
    NoHead,
    #[error(
        "its file {} is not its recorded head layer {}",
        file.display(),
        head.display()
    )]
    NotTheHead { file: PathBuf, head: PathBuf },
    #[error("its recorded chain loops at layer {id}")]
    Loop { id: String },
    #[error("layer {id} below {above} is not recorded")]
    Unrecorded { id: String, above: String },
    #[error("the layer {}: {source}", path.display())]
    Layer {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the image file {} recorded below the disk is not a file of the image store {}",
        path.display(),
        dir.display()
    )]
    NotInImageStore { path: PathBuf, dir: PathBuf },
    #[error("the image store {}: {source}", dir.display())]
    ImageStore {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the base image {} was recorded as {format:?}, not qcow2 or raw",
        path.display()
    )]
    BaseFormat { path: PathBuf, format: String },
    #[error(
        "the base image {} is now a symbolic link (to {target}); the disk was made from the file itself, and is refused",
        path.display()
    )]
    BaseIsLink { path: PathBuf, target: String },
    #[error("the base image {} the disk was made from, refused: {source}", path.display())]
    BaseRefused {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error(
        "the base image {} now resolves to {}; the disk was made from {}, and is refused",
        path.display(),
        real.display(),
        path.display()
    )]
    BaseMoved { path: PathBuf, real: PathBuf },
    #[error("reading the header of {}: {source}", layer.display())]
    ReadHeader {
        layer: PathBuf,
        #[source]
        source: hearth_qemu::img::ImgError,
    },
    #[error(
        "the layer {} names the base {name:?} ({format:?}), which the store does not record",
        layer.display()
    )]
    UnrecordedBase {
        layer: PathBuf,
        name: String,
        format: String,
    },
    /// The headers on the descriptors contradict the chain.
    #[error(transparent)]
    Header(#[from] hearth_qemu::chain::LayerError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The file below a disk's bottom layer, as the store recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Bottom {
    /// A blank disk: the bottom layer names no backing file.
    Nothing,
    /// A VirtualImage's file in the image store.
    Image(PathBuf),
    /// An administrator's base image (canonical path when recorded) and the
    /// format it was opened with.
    SourceImage(PathBuf, String),
}

/// The layers below the disk's head `head_path`, top first, each with the
/// real path its descriptor must have. Errors name the file at fault.
pub async fn backing_layers(
    ctx: &Context,
    disk: &str,
    head_path: &Path,
) -> Result<Vec<BackingLayer>, ChainError> {
    let (layers, bottom) = recorded_chain(ctx, disk, head_path)?;
    let mut out = Vec::new();
    for layer in &layers {
        // hearthd's own files, in its private state directory: the name
        // they resolve to now is theirs.
        out.push(BackingLayer {
            path: layer.path.clone(),
            format: "qcow2".into(),
            real_path: std::fs::canonicalize(&layer.path).map_err(|source| ChainError::Layer {
                path: layer.path.clone(),
                source,
            })?,
        });
    }
    let bottom_path = layers.last().map_or(head_path, |l| l.path.as_path());
    let bottom = match bottom {
        Bottom::Nothing => legacy_source_image(ctx, bottom_path).await?,
        b => b,
    };
    match bottom {
        Bottom::Nothing => {}
        Bottom::Image(path) => out.push(image_store_file(ctx, &path)?),
        Bottom::SourceImage(path, format) => out.push(source_image(ctx, &path, &format)?),
    }
    Ok(out)
}

/// The store's chain from the head down, and what its bottom layer was
/// made over.
fn recorded_chain(
    ctx: &Context,
    disk: &str,
    head_path: &Path,
) -> Result<(Vec<Layer>, Bottom), ChainError> {
    ctx.store.with_tx(|tx| {
        let Some(head) = storage::head_tx(tx, disk)? else {
            return Ok(Err(ChainError::NoHead));
        };
        if head.path != head_path {
            return Ok(Err(ChainError::NotTheHead {
                file: head_path.to_path_buf(),
                head: head.path.clone(),
            }));
        }
        let mut below = Vec::new();
        let mut seen = BTreeSet::from([head.id.clone()]);
        let mut bottom_id = head.id.clone();
        let mut next = head.backing.clone();
        while let Some(id) = next {
            if !seen.insert(id.clone()) {
                return Ok(Err(ChainError::Loop { id }));
            }
            let Some(layer) = storage::layer_tx(tx, &id)? else {
                return Ok(Err(ChainError::Unrecorded {
                    id,
                    above: bottom_id,
                }));
            };
            bottom_id = layer.id.clone();
            next = layer.backing.clone();
            below.push(layer);
        }
        let bottom = if let Some(path) = storage::layer_base_tx(tx, &bottom_id)? {
            Bottom::Image(path)
        } else if let Some((path, format)) = storage::layer_source_image_tx(tx, &bottom_id)? {
            Bottom::SourceImage(path, format)
        } else {
            Bottom::Nothing
        };
        Ok(Ok((below, bottom)))
    })?
}

/// A VirtualImage's file: in the image store (hearthd's own directory),
/// named by its content and format.
fn image_store_file(ctx: &Context, path: &Path) -> Result<BackingLayer, ChainError> {
    let dir = ctx.config.images_dir();
    let format = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(names::parse_stored)
        .map(|(_, format)| format)
        .filter(|_| path.parent() == Some(dir.as_path()))
        .ok_or_else(|| ChainError::NotInImageStore {
            path: path.to_path_buf(),
            dir: dir.clone(),
        })?;
    let real_dir = std::fs::canonicalize(&dir).map_err(|source| ChainError::ImageStore {
        dir: dir.clone(),
        source,
    })?;
    let name = path.file_name().unwrap_or_default();
    Ok(BackingLayer {
        path: path.to_path_buf(),
        format: format.into(),
        real_path: real_dir.join(name),
    })
}

/// An administrator's base image: still inside an image root, still at
/// exactly the canonical path it had when the disk was made. Its real path
/// is that record, never what the name resolves to now (its directories
/// may belong to someone else).
fn source_image(ctx: &Context, path: &Path, format: &str) -> Result<BackingLayer, ChainError> {
    if !matches!(format, "qcow2" | "raw") {
        return Err(ChainError::BaseFormat {
            path: path.to_path_buf(),
            format: format.to_string(),
        });
    }
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_symlink()
    {
        let target = std::fs::read_link(path)
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        return Err(ChainError::BaseIsLink {
            path: path.to_path_buf(),
            target,
        });
    }
    let real = ctx
        .config
        .confine(path)
        .map_err(|source| ChainError::BaseRefused {
            path: path.to_path_buf(),
            source,
        })?;
    if real != path {
        return Err(ChainError::BaseMoved {
            path: path.to_path_buf(),
            real,
        });
    }
    Ok(BackingLayer {
        path: path.to_path_buf(),
        format: format.into(),
        real_path: path.to_path_buf(),
    })
}

/// A bottom layer with nothing recorded below it: a blank disk, or one made
/// from `spec.source.image` before the base was recorded. hearthd wrote the
/// layer's header itself (the layer is in its private state directory), so
/// the file it names is the base the disk was made from; from now on the
/// store records it.
async fn legacy_source_image(ctx: &Context, bottom_layer: &Path) -> Result<Bottom, ChainError> {
    // Read by hearthd itself first: a blank disk's layer names nothing,
    // and that needs no qemu-img.
    let names_nothing = std::fs::File::open(bottom_layer)
        .and_then(|f| hearth_qemu::chain::read_head(&f))
        .ok()
        .and_then(|head| match hearth_qemu::probe::sniff(&head) {
            Ok(hearth_qemu::probe::Sniffed::Qcow2(h)) => {
                h.backing_file_name(&head).ok().map(|n| n.is_none())
            }
            _ => None,
        })
        .unwrap_or(false);
    if names_nothing {
        return Ok(Bottom::Nothing);
    }
    let info = hearth_qemu::img::info(bottom_layer)
        .await
        .map_err(|source| ChainError::ReadHeader {
            layer: bottom_layer.to_path_buf(),
            source,
        })?;
    let Some(name) = info.backing_filename else {
        return Ok(Bottom::Nothing);
    };
    let path = PathBuf::from(&name);
    let format = info.backing_format.unwrap_or_default();
    if !path.is_absolute() || !matches!(format.as_str(), "qcow2" | "raw") {
        return Err(ChainError::UnrecordedBase {
            layer: bottom_layer.to_path_buf(),
            name,
            format,
        });
    }
    let checked = source_image(ctx, &path, &format)?;
    let layer_id = ctx.store.with_tx(|tx| {
        let id: Option<String> = tx
            .query_row(
                "SELECT id FROM layers WHERE path = ?1",
                rusqlite::params![bottom_layer.to_string_lossy()],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(id) = &id {
            storage::set_layer_source_image_tx(tx, id, &checked.path, &checked.format)?;
        }
        Ok(id)
    })?;
    tracing::info!(
        layer = ?layer_id,
        base = %checked.path.display(),
        "recorded the base image of a disk made before bases were recorded"
    );
    Ok(Bottom::SourceImage(checked.path, checked.format))
}
