//! Why a step of a cut failed. The texts go into the snapshots' status and
//! events as they are.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hearth_qemu::img::ImgError;
use hearth_qemu::qmp::QmpError;

use crate::snapshot::coordinator::AgentFault;
use crate::snapshot::overlays::OverlayError;
use crate::store::StoreError;

/// Why a cut overlay's node could not be added to the running QEMU.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeError {
    #[error("no QMP connection")]
    NoQmp,
    #[error("creating {}: {source}", path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("handing {} to QEMU: {source}", path.display())]
    HandOver { path: PathBuf, source: QmpError },
    #[error("{command} for {node}: {source}")]
    Qmp {
        command: String,
        node: String,
        source: QmpError,
    },
    #[error("QEMU lost the job {0}")]
    LostJob(String),
    #[error("formatting {} as qcow2: {error}", path.display())]
    Format { path: PathBuf, error: String },
    #[error("the job {job} did not end within {timeout:?}")]
    JobTimeout { job: String, timeout: Duration },
}

/// Why one disk's overlay could not be prepared.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrepareError {
    #[error("{0}")]
    Store(#[from] StoreError),
    /// What the overlay journal or QEMU's graph answered.
    #[error("{0}")]
    Overlays(#[from] OverlayError),
    #[error("an earlier cut's overlay of VirtualDisk {0:?} is not settled yet")]
    Unsettled(String),
    #[error("VirtualDisk {0:?} has no image yet")]
    NoImage(String),
    #[error("{0}")]
    Info(ImgError),
    #[error("creating the overlay for {disk:?}: {source}")]
    CreateOverlay { disk: String, source: ImgError },
    #[error(
        "VirtualDisk {0:?} is not attached to the running QEMU (the VM must restart to attach it)"
    )]
    NotAttached(String),
    #[error("QEMU has no device for VirtualDisk {0:?}")]
    NoDevice(String),
    #[error("query-block gave no node-name")]
    NoNodeName,
    #[error("query-block gave no virtual-size")]
    NoVirtualSize,
    #[error("no QMP connection")]
    NoQmp,
    #[error("QEMU writes VirtualDisk {disk:?} to {file}, not to its recorded head {}", head.display())]
    ForeignTop {
        disk: String,
        file: String,
        head: PathBuf,
    },
    #[error("removing the overlay made ahead for VirtualDisk {disk:?}: {why}")]
    RemoveAhead { disk: String, why: OverlayError },
    #[error("the overlay of VirtualDisk {disk:?}: {source}")]
    Node {
        disk: String,
        source: Box<NodeError>,
    },
}

/// Why the guest's filesystems could not be matched to its disks.
#[derive(Clone, Debug, thiserror::Error)]
pub(crate) enum MountsError {
    #[error("guest-get-fsinfo: {0}")]
    Agent(AgentFault),
    #[error("no QMP connection")]
    NoQmp,
    #[error("query-pci: {0}")]
    Pci(Arc<QmpError>),
}
