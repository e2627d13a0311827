//! Why a VM's QEMU cannot be started (or a leftover launch settled). The
//! message is what the VM's status and its `FailedToStart` event say, so
//! each names the field at fault first.

use std::path::PathBuf;

use hearth_qemu::process::LaunchError;

use super::chain::ChainError;
use super::firmware::FirmwareError;
use crate::config::ConfigError;
use crate::context::ReconcileError;
use crate::network::NetworkError;
use crate::network::sync::SyncError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// `spec.boot.kernel` or `spec.boot.initrd`.
    #[error("{field}: {source}")]
    BootFile {
        field: &'static str,
        #[source]
        source: ConfigError,
    },
    /// `spec.boot.kernelImage` names an image that has no kernel to give.
    #[error("spec.boot.kernelImage: VirtualImage {image:?} {why}")]
    KernelImage { image: String, why: String },
    /// `spec.boot` without a kernel field, and the first disk's image has
    /// no kernel either.
    #[error(
        "spec.boot: no kernel to boot: neither spec.boot.kernel nor spec.boot.kernelImage is given, and {why} (a containerDisk or qcow2 image boots through the firmware: leave spec.boot out)"
    )]
    NoKernel { why: String },
    /// No `spec.boot`, and the first disk is a root filesystem image with
    /// no kernel of its own: no firmware boots a bare filesystem.
    #[error(
        "spec.disks[0]: {why}; a root filesystem has no boot loader for the firmware: give spec.boot.kernelImage (an image with /boot/vmlinuz) or spec.boot.kernel"
    )]
    RootfsWithoutKernel { why: String },
    /// A snapshot cut or a chain merge its last QEMU left could not be
    /// settled before the start.
    #[error("{0}")]
    Unsettled(String),
    /// The kernel image's modules could not be put into the root disk.
    #[error("spec.boot.kernelImage: {0}")]
    KernelModules(#[from] super::modules::ModulesError),
    #[error("spec.disks[{index}]: VirtualDisk {disk:?} is gone")]
    DiskGone { index: usize, disk: String },
    #[error("spec.disks[{index}]: VirtualDisk {disk:?} has no file yet")]
    DiskWithoutFile { index: usize, disk: String },
    /// The disk's chain is refused (before the start, or by the handover
    /// on the descriptors given to QEMU).
    #[error("spec.disks[{index}]: VirtualDisk {disk:?}: {source}")]
    Disk {
        index: usize,
        disk: String,
        #[source]
        source: Box<ChainError>,
    },
    #[error("{}: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Firmware(#[from] FirmwareError),
    #[error("spec.cloudInit: the seed writer failed: {0}")]
    SeedWriter(#[source] tokio::task::JoinError),
    #[error("spec.cloudInit: cannot write the cloud-init seed {}: {source}", path.display())]
    Seed {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Network(#[from] NetworkError),
    #[error("spec.networks: cannot make the VM's taps: {0}")]
    Taps(#[source] SyncError),
    #[error("cannot record the launch: {0}")]
    RecordLaunch(#[source] StoreError),
    /// `hint` says what to check when the cause is a file QEMU's user
    /// may not read (empty otherwise).
    #[error("QEMU did not start: {source}{hint}")]
    DidNotStart {
        #[source]
        source: LaunchError,
        hint: String,
    },
    #[error("cannot record the started process: {0}")]
    RecordStarted(#[source] StoreError),
    #[error("QEMU pid {pid} survived SIGKILL")]
    SurvivedKill { pid: u32 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A failed start or settle fails the VM's reconcile with its message.
impl From<VmError> for ReconcileError {
    fn from(e: VmError) -> Self {
        ReconcileError::Failed(e.to_string())
    }
}
