//! The object kinds: VirtualMachine, VirtualDisk, VirtualImage,
//! VirtualNetwork and the two snapshot kinds.

use std::fmt;
use std::path::PathBuf;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::meta::{Condition, ObjectMeta};
use crate::quantity::Quantity;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Kind {
    VirtualMachine,
    VirtualDisk,
    VirtualDiskSnapshot,
    VirtualMachineSnapshot,
    VirtualMachineSnapshotGroup,
    VirtualMachineSnapshotSchedule,
    VirtualMachineBackup,
    VirtualImage,
    VirtualNetwork,
}

impl Kind {
    /// In reconcile order at start-up: images before the disks made from
    /// them, networks before the VMs attached to them.
    pub const ALL: [Kind; 9] = [
        Kind::VirtualImage,
        Kind::VirtualNetwork,
        Kind::VirtualMachine,
        Kind::VirtualDisk,
        Kind::VirtualDiskSnapshot,
        Kind::VirtualMachineSnapshot,
        Kind::VirtualMachineSnapshotGroup,
        Kind::VirtualMachineSnapshotSchedule,
        Kind::VirtualMachineBackup,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "VirtualMachine",
            Kind::VirtualDisk => "VirtualDisk",
            Kind::VirtualDiskSnapshot => "VirtualDiskSnapshot",
            Kind::VirtualMachineSnapshot => "VirtualMachineSnapshot",
            Kind::VirtualMachineSnapshotGroup => "VirtualMachineSnapshotGroup",
            Kind::VirtualMachineSnapshotSchedule => "VirtualMachineSnapshotSchedule",
            Kind::VirtualMachineBackup => "VirtualMachineBackup",
            Kind::VirtualImage => "VirtualImage",
            Kind::VirtualNetwork => "VirtualNetwork",
        }
    }

    /// The path segment of this kind in the HTTP API.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "virtualmachines",
            Kind::VirtualDisk => "virtualdisks",
            Kind::VirtualDiskSnapshot => "virtualdisksnapshots",
            Kind::VirtualMachineSnapshot => "virtualmachinesnapshots",
            Kind::VirtualMachineSnapshotGroup => "virtualmachinesnapshotgroups",
            Kind::VirtualMachineSnapshotSchedule => "virtualmachinesnapshotschedules",
            Kind::VirtualMachineBackup => "virtualmachinebackups",
            Kind::VirtualImage => "virtualimages",
            Kind::VirtualNetwork => "virtualnetworks",
        }
    }

    /// For kinds whose spec cannot change once created: what to do instead.
    pub fn immutable_spec(self) -> Option<&'static str> {
        match self {
            // A network's mode, subnet and bridge are checked one by one
            // on update (a network with leases cannot move); dhcp can change.
            Kind::VirtualMachine | Kind::VirtualNetwork | Kind::VirtualMachineSnapshotSchedule => {
                None
            }
            Kind::VirtualDisk => Some(
                "a disk's size and source cannot change after it is created; delete it and create it again",
            ),
            Kind::VirtualDiskSnapshot
            | Kind::VirtualMachineSnapshot
            | Kind::VirtualMachineSnapshotGroup => Some(
                "a snapshot's spec cannot change after it is created; take a new snapshot instead",
            ),
            Kind::VirtualMachineBackup => {
                Some("a backup's spec cannot change after it is created; make a new backup instead")
            }
            Kind::VirtualImage => Some(
                "an image's source cannot change after it is created; create a new VirtualImage (disks made from this one keep using it)",
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
            "vmsnapshotgroup"
            | "vmsnapshotgroups"
            | "snapshotgroup"
            | "snapshotgroups"
            | "virtualmachinesnapshotgroup"
            | "virtualmachinesnapshotgroups" => Some(Kind::VirtualMachineSnapshotGroup),
            "schedule"
            | "schedules"
            | "vmsnapshotschedule"
            | "vmsnapshotschedules"
            | "snapshotschedule"
            | "snapshotschedules"
            | "virtualmachinesnapshotschedule"
            | "virtualmachinesnapshotschedules" => Some(Kind::VirtualMachineSnapshotSchedule),
            "backup"
            | "backups"
            | "vmbackup"
            | "vmbackups"
            | "virtualmachinebackup"
            | "virtualmachinebackups" => Some(Kind::VirtualMachineBackup),
            "image" | "images" | "vi" | "virtualimage" | "virtualimages" => {
                Some(Kind::VirtualImage)
            }
            "network" | "networks" | "net" | "vnet" | "virtualnetwork" | "virtualnetworks" => {
                Some(Kind::VirtualNetwork)
            }
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSpec {
    #[serde(default)]
    pub run_policy: RunPolicy,
    #[serde(default = "default_cpus")]
    pub cpus: u32,
    #[serde(default = "default_memory")]
    pub memory: Quantity,
    /// Direct kernel boot. Without it the VM boots from its disks through
    /// `firmware`, in disk order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<Boot>,
    /// The firmware: SeaBIOS or OVMF. Used for booting from the disks; with
    /// `boot.kernel`, UEFI also runs the kernel under OVMF.
    #[serde(default)]
    pub firmware: Firmware,
    #[serde(default)]
    pub disks: Vec<DiskRef>,
    /// Network interfaces, in guest order (at most [`MAX_INTERFACES`]).
    /// They take effect when QEMU starts: a change restarts a running VM,
    /// and until its QEMU exits that QEMU keeps the interfaces, addresses
    /// and port forwards it was started with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<NetworkInterface>,
    /// A NoCloud seed for cloud-init, attached read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,
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
    /// Before a snapshot's freeze, set the guest kernel's
    /// `/sys/kernel/rcu_expedited` for a few seconds through the agent's
    /// `guest-exec` (the guest resets it by itself): Linux's freeze waits for
    /// RCU grace periods, and expediting them makes the frozen window about
    /// 2.5 times shorter. `false` leaves the guest's kernel settings alone.
    #[serde(default = "default_true")]
    pub expedite_freeze: bool,
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Boot {
    /// A kernel file on the host. At most one of `kernel` and `kernelImage`;
    /// with neither, the VM boots the kernel its first disk's rootfs image
    /// holds under `/boot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub kernel: Option<PathBuf>,
    /// A Ready VirtualImage of shape rootfs whose content holds
    /// `/boot/vmlinux` or `/boot/vmlinuz` (and its initrd, if any), as
    /// Ignite's kernel images do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_image: Option<String>,
    /// An initrd file on the host; only with `kernel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub initrd: Option<PathBuf>,
    /// Added to the command line. With a kernel from an image, hearth gives
    /// `root=` and the console itself.
    #[serde(default)]
    pub cmdline: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Firmware {
    /// SeaBIOS, QEMU's own BIOS.
    #[default]
    #[serde(rename = "BIOS")]
    Bios,
    /// OVMF (EDK II); each VM keeps its own variables file.
    #[serde(rename = "UEFI")]
    Uefi,
}

impl fmt::Display for Firmware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Firmware::Bios => "BIOS",
            Firmware::Uefi => "UEFI",
        })
    }
}

/// What cloud-init's NoCloud seed (`cidata`) carries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CloudInit {
    /// The `user-data` file, as text (`#cloud-config ...`, or a script).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// The `network-config` file (cloud-init network config v1 or v2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_config: Option<String>,
    /// Public keys for the image's default user.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_authorized_keys: Vec<String>,
    /// The guest's hostname; the VM's name when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// Longest `userData` or `networkConfig` accepted (NoCloud reads them whole).
pub const MAX_CLOUD_INIT_TEXT: usize = 256 << 10;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiskRef {
    pub virtual_disk_name: String,
}

/// The most interfaces one VM may have.
pub const MAX_INTERFACES: usize = 8;

/// One VM interface on a VirtualNetwork.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkInterface {
    pub virtual_network_name: String,
    /// Derived from the VM's name and the interface's index when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<String>,
    /// Reserved for this interface; hearth's IPAM picks one when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    /// Forwards from the host to this interface's address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortForward>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortForward {
    /// 1..65535 (a wider type so that a bad value gets a clear message).
    pub host_port: u32,
    pub guest_port: u32,
    #[serde(default)]
    pub protocol: Protocol,
    /// The host address to listen on; every host address when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_address: Option<String>,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Protocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// The `instance-id` in the cloud-init seed the VM was last started with:
    /// it changes exactly when the seed's content does, and then cloud-init
    /// in the guest runs its first-boot steps again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_instance_id: Option<String>,
    /// The interfaces the running QEMU has, as the host attached them;
    /// empty until then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<InterfaceStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStatus {
    /// The VirtualNetwork.
    pub network: String,
    pub mac: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    /// The host side of the interface (the tap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_interface: Option<String>,
    /// The IPv4 addresses the guest agent reports on this MAC
    /// (`guest-network-get-interfaces`); empty without an agent answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guest_ip_addresses: Vec<String>,
    /// Whether the guest holds `ipAddress` on this MAC, as its agent says;
    /// unset until an agent has answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed: Option<bool>,
}

// ---------------------------------------------------------------- VirtualNetwork

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualNetwork {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: VirtualNetworkSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualNetworkStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualNetworkSpec {
    #[serde(default)]
    pub mode: NetworkMode,
    /// IPv4 CIDR, /8../30. When left out hearth picks a free /24 and keeps
    /// it (status.subnet). For `Bridge` it only names the addresses the
    /// VMs' `ipAddress` must lie in, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<String>,
    /// `Bridge` mode only: the existing host bridge to attach to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Serve DHCP on the network (hearth's leases, by dnsmasq). Defaults to true for NAT and
    /// Isolated; `Bridge` networks belong to someone else, so hearth never
    /// serves DHCP there and `dhcp: true` is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<bool>,
    /// Serve DNS on the gateway, handed to guests by DHCP: the network's VMs
    /// by name, and (NAT only) every other name from the host's resolvers
    /// (hearthd's `--dns-resolv-file`). Defaults to true wherever DHCP is
    /// served; `dns: true` without DHCP is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<bool>,
}

impl VirtualNetworkSpec {
    /// Whether hearth serves DHCP on this network.
    pub fn dhcp_enabled(&self) -> bool {
        self.mode != NetworkMode::Bridge && self.dhcp.unwrap_or(true)
    }

    /// Whether hearth serves DNS on this network (along with its DHCP).
    pub fn dns_enabled(&self) -> bool {
        self.dhcp_enabled() && self.dns.unwrap_or(true)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum NetworkMode {
    /// A hearth bridge, masqueraded out of the host's default route.
    #[default]
    #[serde(rename = "NAT")]
    Nat,
    /// A hearth bridge that reaches only the host and its own VMs.
    Isolated,
    /// Taps on an existing host bridge; hearth runs no DHCP or NAT there.
    Bridge,
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NetworkMode::Nat => "NAT",
            NetworkMode::Isolated => "Isolated",
            NetworkMode::Bridge => "Bridge",
        })
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum NetworkPhase {
    #[default]
    Pending,
    Ready,
    Failed,
}

impl fmt::Display for NetworkPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct VirtualNetworkStatus {
    pub phase: NetworkPhase,
    /// The host interface the VMs' taps are attached to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// spec.subnet, or the one hearth picked (and keeps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<String>,
    /// Addresses leased to VM interfaces.
    #[serde(default)]
    pub leases: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------- VirtualDisk

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDisk {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualDiskSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualDiskStatus>,
}

/// The smallest disk `spec.size` may ask for.
pub const MIN_DISK_BYTES: u64 = 1 << 20;

/// The largest disk: the limit of `spec.size`, and of the capacity a disk
/// made from an image gets from the image's virtual size when it has no
/// `spec.size`.
pub const MAX_DISK_BYTES: u64 = 16 << 40;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDiskSpec {
    /// Required for a blank disk; for an image it defaults to the image's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Quantity>,
    pub source: DiskSource,
    /// Files written into the disk's ext4 filesystem when the disk is made
    /// (only for a disk from a VirtualImage of shape rootfs), as Ignite's
    /// `copyFiles` and its ssh key do. At most [`MAX_DISK_FILES`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<DiskFile>,
}

/// The most entries of `VirtualDisk.spec.files`.
pub const MAX_DISK_FILES: usize = 64;

/// One file put into a rootfs disk: from a host file or from text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiskFile {
    /// Where in the guest's filesystem: absolute, no `..`. Missing parent
    /// directories are made (mode 0755, root's).
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub path: PathBuf,
    /// A host file to copy (inside the daemon's image roots). Exactly one of
    /// `source` and `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub source: Option<PathBuf>,
    /// The file's content as text (at most 1 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Octal permission bits as a string, `"0644"` by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum DiskSource {
    /// An empty disk.
    Blank(Empty),
    /// A copy-on-write overlay over this base image file, which is only read.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    Image(PathBuf),
    /// A copy-on-write overlay over a Ready VirtualDiskSnapshot.
    Snapshot(String),
    /// A copy-on-write overlay over a Ready VirtualImage.
    VirtualImage(String),
    /// One disk of a backup point (docs/backup.md), copied whole into the
    /// disk's first layer after every file it reads is checked against the
    /// manifest's SHA-256.
    Backup(BackupDiskSource),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackupDiskSource {
    /// The backup directory (its `hearth-backup.json`).
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub from: PathBuf,
    /// The disk's name in the backup.
    pub disk: String,
    /// The point (1 for the first); the newest when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<u32>,
}

/// `{}` in a manifest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct VirtualDiskStatus {
    pub phase: DiskPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub path: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_to: Option<String>,
    /// How many qcow2 layers the disk reads through: its head and every
    /// layer below it (docs/snapshots.md, "Compaction").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_length: Option<u32>,
    /// A merge of the disk's chain that is running now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compaction: Option<CompactionProgress>,
    /// A new disk from a backup (`spec.source.backup`): the bytes of the
    /// point's chain copied into it so far, while the copy runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_progress: Option<BackupProgress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A running merge of a disk's chain: its id, how many layers it merges,
/// and its job's progress in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CompactionProgress {
    pub id: u64,
    pub layers: u32,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

// ---------------------------------------------------------------- VirtualImage

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualImage {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualImageSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualImageStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualImageSpec {
    pub source: ImageSource,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum ImageSource {
    /// A file under an image root, copied into the image store.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    File(PathBuf),
    /// Downloaded, and verified against `sha256` before it is used.
    Http(HttpSource),
    /// An OCI image: from a registry, an image layout or an archive.
    Oci(OciSource),
}

/// Where an OCI image comes from (exactly one of `reference`, `layout`,
/// `archive`) and how to read it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OciSource {
    /// `HOST[:PORT]/REPO:TAG` or `HOST[:PORT]/REPO@sha256:HEX`, pulled from
    /// that registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// An OCI image layout directory on the host (what `skopeo copy oci:`
    /// writes), under an image root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub layout: Option<PathBuf>,
    /// The image of the layout or archive to take, by tag; may be left out
    /// when it holds one image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// An image archive on the host (`docker save`, `podman save`, `skopeo
    /// copy docker-archive:` or `oci-archive:`), under an image root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub archive: Option<PathBuf>,
    /// `rootfs` or `containerDisk`; told from the content when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<OciShape>,
    /// A PEM file of the CA certificates the registry's certificate
    /// chains to (added to the system's roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub ca_file: Option<PathBuf>,
    /// A JSON file `{"username": .., "password": ..}` hearthd reads for the
    /// registry (basic auth, or the credentials a token realm takes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub credentials_file: Option<PathBuf>,
    /// Plain http to the registry. Only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

/// What an OCI image holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub enum OciShape {
    /// A container filesystem, made into an ext4 disk image.
    Rootfs,
    /// One qcow2 or raw file under `/disk/` (KubeVirt's convention).
    ContainerDisk,
}

impl fmt::Display for OciShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OciShape::Rootfs => "rootfs",
            OciShape::ContainerDisk => "containerDisk",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpSource {
    pub url: String,
    /// The SHA-256 of the file the URL serves, 64 hex digits.
    pub sha256: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ImagePhase {
    #[default]
    Pending,
    Importing,
    Ready,
    Failed,
}

impl fmt::Display for ImagePhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct VirtualImageStatus {
    pub phase: ImagePhase,
    /// `42%` while importing (or bytes so far when the size is unknown), `100%` when Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// Bytes read from the source so far, while importing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_done: Option<u64>,
    /// The source's length, when it said (HTTP Content-Length, file size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Import rate over the last moments, bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_second: Option<u64>,
    /// `qcow2` or `raw`, as `qemu-img info` detects it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Bytes of the stored file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The disk size the image describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_size: Option<u64>,
    /// `sha256:<hex>` of the stored file, by which the store is addressed;
    /// for an OCI image, the digest of the manifest pulled (so a tag such as
    /// `:latest` says which image it was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// An OCI image's shape: `rootfs` or `containerDisk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
    /// An OCI image's layer count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// The kernel a rootfs image holds under `/boot`, copied into the
    /// image store (`sha256-<hex>.kernel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub kernel: Option<PathBuf>,
    /// Its initrd, likewise (`sha256-<hex>.initrd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub initrd: Option<PathBuf>,
    /// The kernel's version, as its file name says (`vmlinuz-<version>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub path: Option<PathBuf>,
    /// Failed imports: a short reason (`ChecksumMismatch`, `HttpError`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Import attempts made for this generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Disks made from this image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub used_by: Vec<String>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------------- snapshots

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualDiskSnapshotSpec {
    pub virtual_disk_name: String,
    /// Fail rather than take a snapshot that is not application-consistent.
    #[serde(default = "default_true")]
    pub required_consistency: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotSpec {
    pub virtual_machine_name: String,
    #[serde(default = "default_true")]
    pub required_consistency: bool,
}

/// Several VMs frozen together for one cut: every member's filesystems are
/// frozen at one common moment, under one deadline, then every member's
/// disks are cut, then all are thawed. Each member's snapshot is a
/// VirtualMachineSnapshot named `<group>-<vm>`, owned by the group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotGroup {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineSnapshotGroupSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<SnapshotStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotGroupSpec {
    /// The member VMs, each once (at least one).
    pub virtual_machine_names: Vec<String>,
    /// Fail the whole group (every member thawed at once) unless every member
    /// is frozen at the common moment.
    #[serde(default = "default_true")]
    pub required_consistency: bool,
}

// ------------------------------------------------ VirtualMachineSnapshotSchedule

/// Snapshots taken on a calendar, with retention: at each slot of
/// `schedule` (in `timeZone`) a VirtualMachineSnapshot of every covered VM
/// (or one VirtualMachineSnapshotGroup of them all), labelled
/// `hearth.dev/schedule: NAME`; retention deletes only such snapshots,
/// never a pinned one (`hearth.dev/keep: "true"`) or one still in use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotSchedule {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineSnapshotScheduleSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ScheduleStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineSnapshotScheduleSpec {
    /// Five cron fields (minute hour day-of-month month day-of-week) or
    /// `@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`.
    pub schedule: String,
    /// The IANA zone the schedule's wall times are in; UTC when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// The VMs covered, by name; or `selector`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtual_machine_names: Vec<String>,
    /// The VMs covered, by their labels (every label given must match).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// When set, the covered VMs are cut together, as one group, at each slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_snapshot_group_template: Option<SnapshotGroupTemplate>,
    #[serde(default = "default_true")]
    pub required_consistency: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,
    /// Backups instead of plain snapshots: at each slot a
    /// VirtualMachineBackup of every covered VM into `to/VM`, keeping
    /// `keep` points there, every `fullEvery`th one full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<ScheduleBackup>,
    /// A slot that could not start within this many seconds of its time
    /// (hearthd was down, the previous run still going) is skipped and
    /// said; unset: it runs once, however late.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting_deadline_seconds: Option<u64>,
    /// No new runs while set; retention still applies.
    #[serde(default)]
    pub suspend: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: std::collections::BTreeMap<String, String>,
}

impl LabelSelector {
    pub fn matches(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// `{}`: the group's fields come from the schedule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotGroupTemplate {}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Retention {
    /// Keep the newest N snapshots of each VM (of each group run, for a
    /// group schedule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u32>,
    /// Delete snapshots older than this (`90m`, `12h`, `7d`, `2w`); the
    /// newest good one of each VM is kept however old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScheduleBackup {
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub to: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_every: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum RunResult {
    Running,
    Succeeded,
    Failed,
    /// The slot passed without a run (past its starting deadline, or no VM
    /// matched); `message` says why.
    Skipped,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ScheduleStatus {
    /// The slot of the last run started or skipped: a slot at or before it
    /// never runs again (whatever the clock does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<DateTime<Utc>>,
    /// When the last run started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_run_time: Option<DateTime<Utc>>,
    /// When retention looks at the snapshots again between slots: one it
    /// keeps turns older than `maxAge`, or one in use kept it from a delete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retention_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_result: Option<RunResult>,
    /// Ready snapshots (or groups) this schedule holds, pinned ones included.
    #[serde(default)]
    pub snapshots: u32,
    /// The snapshots (or group) of the run in progress.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active: Vec<String>,
    /// The generation of the spec this status was made from.
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

// ---------------------------------------------------------- VirtualMachineBackup

/// A backup of every disk of a VM into a directory: a consistent cut, read
/// from the cut's own layers, written as qcow2 files (the first full, the
/// next ones holding only what changed since the previous backup's cut,
/// each backed by the one before) and a manifest (docs/backup.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineBackup {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineBackupSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<BackupStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualMachineBackupSpec {
    pub virtual_machine_name: String,
    /// The target directory (absolute; made when missing). One VM per
    /// directory: its manifest names the VM.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub to: PathBuf,
    #[serde(default)]
    pub mode: BackupMode,
    #[serde(default = "default_true")]
    pub required_consistency: bool,
    /// After this backup, keep the newest N points of the target: older
    /// ones are merged into the oldest kept point, in the target, without
    /// reading the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u32>,
    /// Make a full point when the previous N-1 points since the last full
    /// one are incremental, so restores read chains of at most N files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_every: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum BackupMode {
    /// Incremental when the previous backup's cut can be trusted, else full
    /// (`status.reasonFull` says why).
    #[default]
    Auto,
    Full,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum BackupPhase {
    #[default]
    Pending,
    InProgress,
    Ready,
    Failed,
    Terminating,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum BackupKind {
    Full,
    Incremental,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    pub phase: BackupPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<BackupKind>,
    /// Its place in the target's chain (1 for the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<u32>,
    /// The backup an incremental one is over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// Why this backup is full although an incremental was possible to ask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_full: Option<String>,
    /// The VM snapshot of its cut (kept until the next backup is done: the
    /// next incremental starts from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_read: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written: Option<u64>,
    /// From the start of the copy (right after the cut) to its last file
    /// in place, just before the commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<BackupFile>,
    /// While the copy runs: bytes copied of the bytes to copy, every disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<BackupProgress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BackupProgress {
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// One disk's file of a backup point.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BackupFile {
    pub disk: String,
    /// Relative to the target directory.
    pub file: String,
    pub sha256: String,
    /// The file's length.
    pub size: u64,
    /// The disk's size as the guest sees it.
    pub virtual_size: u64,
}

/// Labels hearth itself reads.
pub mod labels {
    /// On a snapshot (or group) a schedule made: the schedule's name.
    pub const SCHEDULE: &str = "hearth.dev/schedule";
    /// `"true"` on a snapshot: no retention ever deletes it.
    pub const KEEP: &str = "hearth.dev/keep";
    /// On a backup's checkpoint snapshot: the backup's name.
    pub const BACKUP: &str = "hearth.dev/backup";
}

/// Annotations hearth itself writes.
pub mod annotations {
    /// On a snapshot (or group) a schedule made: the slot it was made for
    /// (RFC 3339, UTC).
    pub const SCHEDULE_SLOT: &str = "hearth.dev/schedule-slot";
}

/// `90s`, `90m`, `12h`, `7d`, `2w`: a whole number and one unit.
pub fn parse_age(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 90m, 12h, 7d or 2w"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => {
            return Err(format!(
                "{text:?}: the unit must be one of s, m, h, d, w (as in 90m, 12h, 7d)"
            ));
        }
    };
    if n == 0 {
        return Err(format!("{text:?} is zero"));
    }
    n.checked_mul(secs)
        .filter(|s| *s <= 100 * 365 * 86_400)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("{text:?} is more than 100 years"))
}

/// Status of the snapshot kinds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// For a VM snapshot group: its members' VM snapshots, in the order of
    /// `spec.virtualMachineNames`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtual_machine_snapshot_names: Vec<String>,
    /// For a disk snapshot made by a VM snapshot: that VM snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_snapshot_name: Option<String>,
    /// For a VM snapshot: the VM's spec when its disk snapshots were
    /// requested (what `hearth export vmsnapshot` writes back out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_spec: Option<Box<VirtualMachineSpec>>,
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
