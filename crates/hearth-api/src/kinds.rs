//! The object kinds: VirtualMachine and VirtualDisk.

use std::fmt;
use std::path::PathBuf;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::meta::{Condition, ObjectMeta};
use crate::quantity::Quantity;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    VirtualMachine,
    VirtualDisk,
    VirtualDiskSnapshot,
    VirtualMachineSnapshot,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::VirtualMachine,
        Kind::VirtualDisk,
        Kind::VirtualDiskSnapshot,
        Kind::VirtualMachineSnapshot,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "VirtualMachine",
            Kind::VirtualDisk => "VirtualDisk",
            Kind::VirtualDiskSnapshot => "VirtualDiskSnapshot",
            Kind::VirtualMachineSnapshot => "VirtualMachineSnapshot",
        }
    }

    /// The path segment of this kind in the HTTP API.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "virtualmachines",
            Kind::VirtualDisk => "virtualdisks",
            Kind::VirtualDiskSnapshot => "virtualdisksnapshots",
            Kind::VirtualMachineSnapshot => "virtualmachinesnapshots",
        }
    }

    /// For kinds whose spec cannot change once created: what to do instead.
    pub fn immutable_spec(self) -> Option<&'static str> {
        match self {
            Kind::VirtualMachine => None,
            Kind::VirtualDisk => Some(
                "a disk's size and source cannot change after it is created; delete it and create it again",
            ),
            Kind::VirtualDiskSnapshot | Kind::VirtualMachineSnapshot => Some(
                "a snapshot's spec cannot change after it is created; take a new snapshot instead",
            ),
        }
    }

    /// Accepts the names people type: `vm`, `vms`, `virtualmachine`, `VirtualMachine`, ...
    pub fn from_user(s: &str) -> Option<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "vm" | "vms" | "virtualmachine" | "virtualmachines" => Some(Kind::VirtualMachine),
            "disk" | "disks" | "vd" | "virtualdisk" | "virtualdisks" => Some(Kind::VirtualDisk),
            "snapshot"
            | "snapshots"
            | "snap"
            | "vdsnapshot"
            | "vdsnapshots"
            | "disksnapshot"
            | "disksnapshots"
            | "virtualdisksnapshot"
            | "virtualdisksnapshots" => Some(Kind::VirtualDiskSnapshot),
            "vmsnapshot"
            | "vmsnapshots"
            | "vmsnap"
            | "virtualmachinesnapshot"
            | "virtualmachinesnapshots" => Some(Kind::VirtualMachineSnapshot),
            _ => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------- VirtualMachine

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachine {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualMachineStatus>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunPolicy {
    /// Keep it running; start it again when it stops.
    #[default]
    AlwaysOn,
    /// Keep it stopped.
    AlwaysOff,
    /// Start and stop only on `hearth start|stop`.
    Manual,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSpec {
    #[serde(default)]
    pub run_policy: RunPolicy,
    #[serde(default = "default_cpus")]
    pub cpus: u32,
    #[serde(default = "default_memory")]
    pub memory: Quantity,
    pub boot: Boot,
    #[serde(default)]
    pub disks: Vec<DiskRef>,
    #[serde(default = "default_true")]
    pub guest_agent: bool,
    /// Grace period for a guest shutdown before QEMU is stopped by force.
    #[serde(default = "default_stop_timeout")]
    pub stop_timeout_seconds: u32,
    /// Longest time the guest may stay frozen for a snapshot; past it the
    /// guest is thawed and the cut is not consistent. Between
    /// [`MIN_FREEZE_DEADLINE_SECONDS`] and [`MAX_FREEZE_DEADLINE_SECONDS`].
    #[serde(default = "default_freeze_deadline")]
    pub freeze_deadline_seconds: u32,
}

/// The shortest `spec.freezeDeadlineSeconds` accepted. Inside the deadline
/// the snapshot needs the freeze, a read of the freeze status, and then the
/// disk switch, which is started only while its 2 s budget still fits before
/// the deadline; a deadline of 2 s or less could never be met, so every cut
/// would end not consistent.
pub const MIN_FREEZE_DEADLINE_SECONDS: u32 = 3;

/// The longest `spec.freezeDeadlineSeconds` accepted: a guest frozen for
/// minutes is an outage, not a snapshot.
pub const MAX_FREEZE_DEADLINE_SECONDS: u32 = 300;

fn default_freeze_deadline() -> u32 {
    10
}

fn default_cpus() -> u32 {
    1
}
fn default_memory() -> Quantity {
    Quantity::from_bytes(256 << 20)
}
fn default_true() -> bool {
    true
}
fn default_stop_timeout() -> u32 {
    30
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Boot {
    pub kernel: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiskRef {
    pub virtual_disk_name: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmPhase {
    #[default]
    Pending,
    Starting,
    Running,
    Stopping,
    Stopped,
    Failed,
}

impl fmt::Display for VmPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStatus {
    pub phase: VmPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// `kvm` or `tcg`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator_reason: Option<String>,
    #[serde(default)]
    pub agent_connected: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------- VirtualDisk

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDisk {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualDiskSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualDiskStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDiskSpec {
    /// Required for a blank disk; for an image it defaults to the image's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Quantity>,
    pub source: DiskSource,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum DiskSource {
    /// An empty disk.
    Blank(Empty),
    /// A copy-on-write overlay over this base image file, which is only read.
    Image(PathBuf),
    /// A copy-on-write overlay over a Ready VirtualDiskSnapshot.
    Snapshot(String),
}

/// `{}` in a manifest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum DiskPhase {
    #[default]
    Pending,
    Ready,
    Failed,
}

impl fmt::Display for DiskPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualDiskStatus {
    pub phase: DiskPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------- snapshots

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotPhase {
    #[default]
    Pending,
    InProgress,
    Ready,
    Failed,
    Terminating,
}

impl SnapshotPhase {
    pub fn is_final(self) -> bool {
        matches!(self, SnapshotPhase::Ready | SnapshotPhase::Failed)
    }
}

impl fmt::Display for SnapshotPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDiskSnapshot {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualDiskSnapshotSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SnapshotStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDiskSnapshotSpec {
    pub virtual_disk_name: String,
    /// Fail rather than take a snapshot that is not application-consistent.
    #[serde(default = "default_true")]
    pub required_consistency: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshot {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineSnapshotSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SnapshotStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotSpec {
    pub virtual_machine_name: String,
    #[serde(default = "default_true")]
    pub required_consistency: bool,
}

/// Status of both snapshot kinds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    pub phase: SnapshotPhase,
    /// Unset until the snapshot is taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistent: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_time: Option<DateTime<Utc>>,
    /// For a disk snapshot of a running VM: the guest mount points whose
    /// filesystems lie (wholly or partly) on this disk and were frozen for the
    /// cut, sorted; empty when none of the frozen filesystems is on this disk.
    /// Unset when nothing was frozen (offline cut, no freeze) or when the guest
    /// could not say which filesystems lie on which disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_mount_points: Option<Vec<String>>,
    /// Host-side time from the freeze request to the thaw reply: an upper
    /// bound on the guest's frozen time (it includes the guest's hooks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_window_ms: Option<u64>,
    /// The cut that took this snapshot; snapshots of one cut share a moment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_id: Option<u64>,
    /// Bytes held by this snapshot's own layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// For a disk snapshot: the disk's size at the cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// For a VM snapshot: its disk snapshots, in the VM's disk order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtual_disk_snapshot_names: Vec<String>,
    /// For a disk snapshot made by a VM snapshot: that VM snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_snapshot_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
mod snapshot_status_tests {
    use super::*;

    #[test]
    fn frozen_mount_points_are_camel_case_and_left_out_when_unset() {
        let unset = SnapshotStatus::default();
        let json = serde_json::to_value(&unset).expect("serialise");
        assert!(json.get("frozenMountPoints").is_none(), "{json}");

        // Frozen, but nothing on this disk: an empty list, not "unknown".
        let none_here = SnapshotStatus {
            frozen_mount_points: Some(Vec::new()),
            ..SnapshotStatus::default()
        };
        let json = serde_json::to_value(&none_here).expect("serialise");
        assert_eq!(json["frozenMountPoints"], serde_json::json!([]));

        let some = SnapshotStatus {
            frozen_mount_points: Some(vec!["/data".into(), "/mnt/vda".into()]),
            ..SnapshotStatus::default()
        };
        let json = serde_json::to_value(&some).expect("serialise");
        assert_eq!(
            json["frozenMountPoints"],
            serde_json::json!(["/data", "/mnt/vda"])
        );
        let back: SnapshotStatus = serde_json::from_value(json).expect("deserialise");
        assert_eq!(back, some);

        // Statuses stored before the field existed still read.
        let old: SnapshotStatus =
            serde_json::from_str(r#"{"phase": "Ready", "consistent": true}"#).expect("old");
        assert_eq!(old.frozen_mount_points, None);
    }
}
