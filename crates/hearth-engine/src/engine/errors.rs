//! Why the engine's own commands refuse a request: delete and the VM
//! actions and apply's cross-object checks (`apply.rs`), restore
//! (`restore.rs`) and export (`export.rs`). A leaf: `crate::error` composes
//! these into `RequestError`, which the commands return, so they cannot
//! live in the command files without an import circle. Each case names the
//! object and what holds it or what it is missing; all are conflicts (409).

use std::io;
use std::path::PathBuf;

use hearth_api::SnapshotPhase;
use hearth_qemu::img::ImgError;

use crate::snapshot::compaction::CompactionError;
use crate::snapshot::export::ExportFormat;
use crate::snapshot::overlays::OverlayError;

/// A delete, a VM action or an apply that the other objects refuse.
#[derive(Debug, thiserror::Error)]
pub enum ApplyConflict {
    #[error(
        "VirtualDisk {disk:?} is in use by VirtualMachine {vm:?} (its spec.disks, or its running QEMU until it restarts); delete the VM or remove the disk from it first"
    )]
    DiskInUse { disk: String, vm: String },
    #[error(
        "VirtualNetwork {network:?} is in use by VirtualMachine {} (its spec.networks, or its running QEMU until it restarts); delete those VMs or remove the network from them first",
        quoted(vms)
    )]
    NetworkInUse { network: String, vms: Vec<String> },
    #[error(
        "VirtualImage {image:?} is in use by VirtualDisk {} (made from it); delete those disks first",
        quoted(disks)
    )]
    ImageInUse { image: String, disks: Vec<String> },
    #[error(
        "VirtualMachine {vm:?} has spec.runPolicy AlwaysOff; set it to AlwaysOn or Manual to start it"
    )]
    AlwaysOff { vm: String },
    /// A new disk from an image that is being deleted.
    #[error(
        "VirtualDisk {disk:?}: spec.source.virtualImage: VirtualImage {image:?} is being deleted"
    )]
    ImageDeleting { disk: String, image: String },
    /// A disk another VM already has.
    #[error(
        "VirtualMachine {vm:?}: spec.disks[{index}].virtualDiskName: VirtualDisk {disk:?} is already used by VirtualMachine {other:?}"
    )]
    DiskTaken {
        vm: String,
        index: usize,
        disk: String,
        other: String,
    },
}

/// `"a", "b"`: names as a refusal lists them.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a VM or a snapshot group was not restored.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(
        "VirtualMachineSnapshotGroup {group:?} is {phase}, not Ready{}",
        message.as_ref().map(|m| format!(" ({m})")).unwrap_or_default()
    )]
    GroupNotReady {
        group: String,
        phase: SnapshotPhase,
        message: Option<String>,
    },
    #[error("member VirtualMachineSnapshot {member:?} is {phase}, not Ready")]
    MemberNotReady {
        member: String,
        phase: SnapshotPhase,
    },
    /// `failed` holds each member VM that was not restored and why.
    #[error(
        "VirtualMachineSnapshotGroup {group:?}: {} of {members} member(s) not restored: {}",
        failed.len(),
        failed.iter().map(|(vm, why)| format!("{vm}: {why}")).collect::<Vec<_>>().join("; ")
    )]
    MembersFailed {
        group: String,
        members: usize,
        failed: Vec<(String, String)>,
    },
    #[error("VirtualMachineSnapshot {snapshot:?} is of VirtualMachine {of:?}, not {vm:?}")]
    OtherVm {
        snapshot: String,
        of: String,
        vm: String,
    },
    #[error("VirtualMachineSnapshot {snapshot:?} is {phase}, not Ready")]
    NotReady {
        snapshot: String,
        phase: SnapshotPhase,
    },
    #[error(
        "VirtualDiskSnapshot {disk_snapshot:?} of VirtualMachineSnapshot {snapshot:?} is being deleted; nothing was restored"
    )]
    DiskSnapshotDeleting {
        disk_snapshot: String,
        snapshot: String,
    },
    #[error(
        "VirtualDisk {disk:?} of the snapshot is no longer in VirtualMachine {vm:?} (spec.disks)"
    )]
    DiskGone { disk: String, vm: String },
    #[error("VirtualDiskSnapshot {disk_snapshot:?} has no stored layer")]
    NoLayer { disk_snapshot: String },
    #[error("VirtualMachine {vm:?} did not stop within {seconds} s; nothing was restored")]
    DidNotStop { vm: String, seconds: u64 },
    #[error("VirtualMachine {vm:?} is running; stop it first (nothing was restored)")]
    Running { vm: String },
    /// Settling what the last QEMU left of a cut.
    #[error("{0} (nothing was restored)")]
    SettleOverlays(OverlayError),
    /// Settling what the last QEMU left of a compaction.
    #[error("{0} (nothing was restored)")]
    SettleCompaction(CompactionError),
    /// Creating the layers directory.
    #[error("{0}")]
    LayersDir(io::Error),
    /// Creating a disk's new head over the snapshot's layer.
    #[error("VirtualDisk {disk:?}: {reason} (nothing was restored)")]
    Overlay { disk: String, reason: ImgError },
}

/// Why a disk snapshot was not exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(
        "VirtualDiskSnapshot {snapshot:?} is {phase}{}, not Ready: only a Ready snapshot can be exported",
        why(reason.as_deref(), message.as_deref())
    )]
    NotReady {
        snapshot: String,
        phase: SnapshotPhase,
        reason: Option<String>,
        message: Option<String>,
    },
    #[error("VirtualDiskSnapshot {snapshot:?} is Ready but has no stored layer")]
    NoLayer { snapshot: String },
    #[error("cannot create {}: {error}", dir.display())]
    CreateDir { dir: PathBuf, error: io::Error },
    #[error(
        "VirtualDiskSnapshot {snapshot:?}: the conversion to {} failed: {reason}",
        format.as_str()
    )]
    Convert {
        snapshot: String,
        format: ExportFormat,
        reason: ImgError,
    },
    /// Reading the converted image's size.
    #[error("VirtualDiskSnapshot {snapshot:?}: {reason}")]
    Inspect { snapshot: String, reason: ImgError },
    #[error("cannot open {}: {error}", path.display())]
    Open { path: PathBuf, error: io::Error },
    #[error("cannot stat the export: {0}")]
    Stat(io::Error),
}

/// ` (reason: message)`, ` (reason)`, ` (message)` or nothing.
fn why(reason: Option<&str>, message: Option<&str>) -> String {
    match (reason, message) {
        (Some(r), Some(m)) => format!(" ({r}: {m})"),
        (Some(r), None) => format!(" ({r})"),
        (None, Some(m)) => format!(" ({m})"),
        (None, None) => String::new(),
    }
}
