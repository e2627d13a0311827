//! Why a disk's first layer cannot be made, or its files not read.

use std::path::PathBuf;

use hearth_qemu::img;

use crate::context::ReconcileError;
use crate::store::StoreError;

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
    #[error("the backup cannot be restored: {0}")]
    Backup(String),
    #[error("spec.source.snapshot: VirtualDiskSnapshot {snapshot:?} has no layer")]
    SnapshotWithoutLayer { snapshot: String },
    #[error("{0}")]
    SnapshotLayer(#[source] img::ImgError),
    #[error("{}", .0.message())]
    ImageNotReady(crate::image::NotReady),
    /// Growing a rootfs disk or writing its files failed.
    #[error("VirtualDisk {disk:?}: {error}")]
    Prepare {
        disk: String,
        #[source]
        error: super::prepare::PrepareError,
    },
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
pub(super) enum HeaderError {
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
