//! Builds the QEMU argv for one VM.
//!
//! Injection safety is the point of this module. QEMU's legacy option syntax is
//! `key=value,key=value`, so a `,` in a user-controlled value could add options. We
//! avoid that syntax wherever QEMU offers JSON (`-blockdev`, `-device`), and where
//! it does not (`-chardev`, `-name`) values are either validated to a safe alphabet
//! or escaped the QEMU way (`,` doubled). `-kernel`, `-initrd` and `-append` are
//! stored by QEMU verbatim, so they only get their own argv element. The
//! firmware's flash images are `-blockdev` nodes too; `-machine` names them by
//! node name, never by path.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde_json::json;

/// Which accelerator QEMU should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One qcow2 image attached as a virtio-blk disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskAttachment {
    /// QMP node name of the qcow2 format node; snapshots address the disk by it.
    pub node_name: String,
    pub path: PathBuf,
    pub read_only: bool,
    /// virtio-blk serial the guest sees (`/sys/block/vdX/serial`); hearth sets
    /// it with [`disk_serial`] so the guest agent's filesystem report names the
    /// VirtualDisk. At most [`MAX_SERIAL_LEN`] bytes; empty means none.
    pub serial: String,
    /// The layers below `path`, top first (what its qcow2 header chains
    /// to). Each becomes a node of its own, linked by `backing`, so QEMU
    /// never opens a backing file by the name written in a header.
    pub backing: Vec<BackingLayer>,
}

/// One read-only layer below a disk's top layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackingLayer {
    /// The name the layer above's header gives it, and its fd set's label.
    pub path: PathBuf,
    /// `qcow2` (which may chain further) or `raw` (the bottom).
    pub format: String,
    /// Where the file opened for QEMU must really be (the kernel's name
    /// for the descriptor): `path` without symbolic links. The caller fixes
    /// it from what it recorded, not by resolving `path` now, for a file in
    /// a directory someone else may change ([`crate::chain`]).
    pub real_path: PathBuf,
}

/// The descriptor numbers QEMU inherits for one launch
/// ([`crate::handover::Handover`] opens them; unit tests make some up).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FdNumbers {
    /// Per disk, one per layer of its chain, top first.
    pub disk_layers: Vec<Vec<i32>>,
    pub seed: Option<i32>,
    pub ovmf_vars: Option<i32>,
    /// Opened for writing (and truncated) by hearthd.
    pub serial_log: i32,
    /// Listening sockets.
    pub qmp: i32,
    pub agent: Option<i32>,
    pub serial_socket: Option<i32>,
    /// Per NIC, in order.
    pub nics: Vec<NicFds>,
}

impl FdNumbers {
    /// Made-up numbers of the right shape for `spec` (from 100 up): enough
    /// to check a spec, and for tests.
    pub fn for_spec(spec: &LaunchSpec) -> FdNumbers {
        let mut n = 99;
        let mut next = || {
            n += 1;
            n
        };
        FdNumbers {
            disk_layers: spec
                .disks
                .iter()
                .map(|d| (0..=d.backing.len()).map(|_| next()).collect())
                .collect(),
            seed: spec.seed.as_ref().map(|_| next()),
            ovmf_vars: matches!(spec.firmware, Firmware::Uefi(_)).then(&mut next),
            serial_log: next(),
            qmp: next(),
            agent: spec.agent_socket.as_ref().map(|_| next()),
            serial_socket: spec.serial_socket.as_ref().map(|_| next()),
            nics: spec
                .nics
                .iter()
                .map(|nic| NicFds {
                    tap: next(),
                    vhost: nic.vhost.then(&mut next),
                })
                .collect(),
        }
    }
}

/// A tap hearthd attached to, and `/dev/vhost-net` when the NIC uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicFds {
    pub tap: i32,
    pub vhost: Option<i32>,
}

/// Direct kernel boot: QEMU loads the kernel itself (through the firmware's
/// loader with OVMF, through `linuxboot` with SeaBIOS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelBoot {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
}

/// The two flash images OVMF runs from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ovmf {
    /// The firmware code (`OVMF_CODE*.fd`): attached read-only as `pflash0`.
    pub code: PathBuf,
    /// This VM's own copy of the variables store (`OVMF_VARS*.fd`):
    /// attached writable as `pflash1`, so boot entries persist.
    pub vars: PathBuf,
}

/// The firmware QEMU runs first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Firmware {
    /// SeaBIOS, QEMU's default: nothing to add to the command line.
    Bios,
    /// OVMF (EDK II) from two pflash devices.
    Uefi(Ovmf),
}

/// Everything needed to start one VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Expected to be a validated DNS label already; checked again here anyway.
    pub vm_name: String,
    pub cpus: u32,
    pub memory_mib: u64,
    pub accel: Accel,
    pub firmware: Firmware,
    /// `None`: the firmware boots from `disks`, in their order (each disk
    /// device gets its place as `bootindex`, and only those are tried).
    pub kernel: Option<KernelBoot>,
    /// Order is device order: the first is `vda`, the second `vdb`, ...
    pub disks: Vec<DiskAttachment>,
    /// A raw image attached read-only after every disk (so the disks keep
    /// their names and PCI slots), never booted from: the cloud-init seed.
    /// Its nodes and device have fixed names of their own ([`SEED_NODE_NAME`],
    /// [`SEED_DEVICE_ID`]) that no disk can take.
    pub seed: Option<PathBuf>,
    /// virtio-net cards, in guest order (`eth0`, `eth1`, ...), each on a
    /// persistent tap that exists before QEMU starts.
    pub nics: Vec<NicAttachment>,
    /// `None` means no guest-agent channel at all.
    pub agent_socket: Option<PathBuf>,
    pub qmp_socket: PathBuf,
    pub serial_log: PathBuf,
    /// With a path, the serial port is a unix socket server there (one
    /// client at a time: `hearth console`), and `serial_log` is its logfile,
    /// which still gets every byte the guest writes, client or not. `None`:
    /// the serial port writes `serial_log` alone.
    pub serial_socket: Option<PathBuf>,
}

/// A virtio-net card on a tap the host made (QEMU opens it by name, and
/// never runs a script).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicAttachment {
    pub tap: String,
    /// `aa:bb:cc:dd:ee:ff`, unicast.
    pub mac: String,
    /// The in-kernel data path (`/dev/vhost-net`); QEMU's own otherwise.
    pub vhost: bool,
}

/// qdev id and netdev id of NIC `index`.
pub fn nic_device_id(index: usize) -> String {
    format!("nic{index}")
}

/// Node name of the seed's format node.
pub const SEED_NODE_NAME: &str = "cidata";
/// Node name of the seed's `file` node.
pub const SEED_FILE_NODE_NAME: &str = "cidata-file";
/// qdev id of the seed's virtio-blk device; not of the `vdisk<i>` form, so
/// nothing that looks for the VM's disks by device id finds it.
pub const SEED_DEVICE_ID: &str = "cidata";
/// Node names of OVMF's flash images.
pub const OVMF_CODE_NODE_NAME: &str = "ovmf-code";
pub const OVMF_VARS_NODE_NAME: &str = "ovmf-vars";

/// Guest-visible name of the agent port; qemu-ga looks for exactly this name.
pub const AGENT_PORT_NAME: &str = "org.qemu.guest_agent.0";

/// Upper bounds that keep a typo from asking QEMU for something absurd.
pub const MAX_CPUS: u32 = 255;
pub const MAX_MEMORY_MIB: u64 = 4 * 1024 * 1024;
/// virtio-blk reports at most this many bytes of serial to the guest
/// (`VIRTIO_BLK_ID_BYTES`); a longer one would be cut silently.
pub const MAX_SERIAL_LEN: usize = 20;
/// QEMU rejects node names longer than this (`BLOCK_NODE_NAME` is 32 bytes incl. NUL).
pub const MAX_NODE_NAME_LEN: usize = 31;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    #[error(
        "nics[{index}]: tap name {tap:?} must be 1 to 15 of ASCII letters, digits, '-', '_' and '.'"
    )]
    BadTapName { index: usize, tap: String },
    #[error("nics[{index}]: {mac:?} is not a unicast MAC address (six hex pairs separated by ':')")]
    BadMac { index: usize, mac: String },
    #[error(
        "VM name {0:?} is not a DNS label (1-63 of a-z, 0-9, '-', not starting or ending with '-')"
    )]
    InvalidVmName(String),
    #[error("cpus must be between 1 and {MAX_CPUS}, got {0}")]
    InvalidCpus(u32),
    #[error("memory must be between 1 and {MAX_MEMORY_MIB} MiB, got {0}")]
    InvalidMemory(u64),
    #[error("{field} path {path:?} is not usable on a QEMU command line: {reason}")]
    UnsafePath {
        field: String,
        path: PathBuf,
        reason: &'static str,
    },
    #[error(
        "disk node name {0:?} is invalid (1-31 of a-z, A-Z, 0-9, '-', '.', '_', starting with a letter)"
    )]
    InvalidNodeName(String),
    #[error("disk node name {0:?} is used twice (or clashes with an internal node name)")]
    DuplicateNodeName(String),
    #[error("disk serial {0:?} is invalid (at most 20 bytes of A-Z, a-z, 0-9, '-', '.', '_')")]
    InvalidSerial(String),
    #[error("disk serial {0:?} is used twice")]
    DuplicateSerial(String),
    #[error("kernel command line contains a NUL byte")]
    NulInCmdline,
    #[error("disks[{index}]: backing layer format {format:?} is not qcow2 or raw")]
    BadLayerFormat { index: usize, format: String },
    #[error("disks[{index}]: a raw layer can only be the bottom of a chain")]
    RawLayerNotAtBottom { index: usize },
    #[error("descriptors for {0} do not match the launch spec")]
    FdMismatch(&'static str),
}

/// Node names hearth uses for things that are not the VM's disks.
const RESERVED_NODE_NAMES: [&str; 4] = [
    SEED_NODE_NAME,
    SEED_FILE_NODE_NAME,
    OVMF_CODE_NODE_NAME,
    OVMF_VARS_NODE_NAME,
];

/// Node name of the `file` protocol node under disk number `index`.
pub fn file_node_name(index: usize) -> String {
    format!("file-{index}")
}

/// Node names of backing layer `depth` (1 is right below the top) of disk
/// `index`: its format node and its `file` node.
pub fn backing_node_names(index: usize, depth: usize) -> (String, String) {
    (
        format!("back-{index}-{depth}"),
        format!("file-{index}-{depth}"),
    )
}

/// The path QEMU opens for fd set `set`: it takes a descriptor of the set
/// whose access mode matches (`-add-fd`, QMP `add-fd`).
pub fn fdset_path(set: u64) -> String {
    format!("/dev/fdset/{set}")
}

/// qdev id of the virtio-blk device for disk number `index`.
pub fn disk_device_id(index: usize) -> String {
    format!("vdisk{index}")
}

/// The virtio-blk serial of the disk named `name`: the name itself when it fits
/// in [`MAX_SERIAL_LEN`] bytes, else its first 11 bytes, `-`, and 8 hex digits
/// of a hash of the whole name (FNV-1a, fixed here so the serial of a disk never
/// changes between builds). Names sharing a long prefix get different serials.
pub fn disk_serial(name: &str) -> String {
    if name.len() <= MAX_SERIAL_LEN {
        return name.to_owned();
    }
    let mut cut = 11;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{:08x}", &name[..cut], fnv1a_32(name.as_bytes()))
}

/// 32-bit FNV-1a: tiny, specified, and identical on every platform and build.
fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |hash, b| {
        (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// A serial QEMU passes to the guest unchanged: short, and of an alphabet no
/// guest tool (udev escapes others) rewrites.
pub fn validate_serial(serial: &str) -> Result<(), CmdlineError> {
    let ok = serial.len() <= MAX_SERIAL_LEN
        && serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(CmdlineError::InvalidSerial(serial.to_owned()))
    }
}

fn valid_tap_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn valid_unicast_mac(mac: &str) -> bool {
    let parts: Vec<&str> = mac.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
        && u8::from_str_radix(parts[0], 16).is_ok_and(|b| b & 1 == 0)
        && parts.iter().any(|p| *p != "00")
}

/// Builds the argv (without the binary itself) that starts `spec` with the
/// descriptors `fds`: every file and socket of the VM is one of them (disk
/// layers, seed, UEFI variables and serial log through fd sets, sockets and
/// taps as `fd=`), so no path of hearth's reaches QEMU to be opened; a
/// path is only the `opaque` label of its fd set (`query-fdsets` shows
/// it). Only the kernel, initrd and OVMF code (shared, read-only) go by path.
pub fn build_args(spec: &LaunchSpec, fds: &FdNumbers) -> Result<Vec<OsString>, CmdlineError> {
    if fds.disk_layers.len() != spec.disks.len()
        || spec
            .disks
            .iter()
            .zip(&fds.disk_layers)
            .any(|(d, l)| l.len() != 1 + d.backing.len())
    {
        return Err(CmdlineError::FdMismatch("disk layers"));
    }
    if fds.seed.is_some() != spec.seed.is_some() {
        return Err(CmdlineError::FdMismatch("the seed"));
    }
    if fds.ovmf_vars.is_some() != matches!(spec.firmware, Firmware::Uefi(_)) {
        return Err(CmdlineError::FdMismatch("the UEFI variables"));
    }
    if fds.agent.is_some() != spec.agent_socket.is_some() {
        return Err(CmdlineError::FdMismatch("the agent socket"));
    }
    if fds.serial_socket.is_some() != spec.serial_socket.is_some() {
        return Err(CmdlineError::FdMismatch("the serial socket"));
    }
    if fds.nics.len() != spec.nics.len() {
        return Err(CmdlineError::FdMismatch("the NICs"));
    }
    validate_vm_name(&spec.vm_name)?;
    if spec.cpus == 0 || spec.cpus > MAX_CPUS {
        return Err(CmdlineError::InvalidCpus(spec.cpus));
    }
    if spec.memory_mib == 0 || spec.memory_mib > MAX_MEMORY_MIB {
        return Err(CmdlineError::InvalidMemory(spec.memory_mib));
    }
    if spec
        .kernel
        .as_ref()
        .is_some_and(|k| k.cmdline.contains('\0'))
    {
        return Err(CmdlineError::NulInCmdline);
    }

    let mut args = Args::default();
    let mut next_set = 0u64;
    // `-add-fd fd=N,set=S,opaque=PATH`: the path only labels the set.
    let mut fdset = |args: &mut Args, field: &str, fd: i32, path: &Path| {
        next_set += 1;
        let label = legacy_opt_path(field, path)?;
        args.push("-add-fd");
        args.push(format!("fd={fd},set={next_set},opaque={label}"));
        Ok::<_, CmdlineError>(fdset_path(next_set))
    };
    args.push_all(["-name", &format!("guest={}", spec.vm_name)]);
    // Host-wide /etc/qemu config must not change what a manifest describes.
    args.push_all(["-no-user-config", "-nodefaults", "-nographic", "-no-reboot"]);
    // seccomp: a compromised QEMU may not exec, raise privileges, change
    // scheduling or use obsolete syscalls. Nothing hearth asks of QEMU needs them.
    args.push_all([
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]);
    match &spec.firmware {
        Firmware::Bios => args.push_all(["-machine", "q35"]),
        Firmware::Uefi(ovmf) => {
            // The flash images are block nodes: `-machine` only names them, so
            // no path ever reaches its comma syntax.
            // The code is a shared read-only file of the OVMF package
            // (world-readable): by path. The variables are the VM's own.
            let vars_fd = fds
                .ovmf_vars
                .ok_or(CmdlineError::FdMismatch("the UEFI variables"))?;
            let vars = fdset(&mut args, "ovmf_vars", vars_fd, &ovmf.vars)?;
            for (filename, node, read_only) in [
                (
                    plain_path("ovmf_code", &ovmf.code)?,
                    OVMF_CODE_NODE_NAME,
                    true,
                ),
                (vars, OVMF_VARS_NODE_NAME, false),
            ] {
                args.push("-blockdev");
                args.push(
                    json!({
                        "driver": "file",
                        "filename": filename,
                        "node-name": node,
                        "read-only": read_only,
                    })
                    .to_string(),
                );
            }
            args.push("-machine");
            args.push(format!(
                "q35,pflash0={OVMF_CODE_NODE_NAME},pflash1={OVMF_VARS_NODE_NAME}"
            ));
        }
    }
    match spec.accel {
        Accel::Kvm => args.push_all(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => args.push_all(["-accel", "tcg", "-cpu", "max"]),
    }
    args.push_all(["-smp", &spec.cpus.to_string()]);
    args.push_all(["-m", &format!("{}M", spec.memory_mib)]);
    args.push_all(["-msg", "timestamp=on"]);

    match &spec.kernel {
        Some(boot) => {
            // QEMU keeps these three values as whole strings (no comma parsing).
            args.push("-kernel");
            args.push(plain_path("kernel", &boot.kernel)?);
            if let Some(initrd) = &boot.initrd {
                // For multiboot kernels QEMU splits -initrd at ',' into a module list, which
                // would let a path smuggle in extra host files; refuse commas outright.
                let value = plain_path("initrd", initrd)?;
                if value.contains(',') {
                    return Err(unsafe_path(
                        "initrd",
                        initrd,
                        "',' is not allowed (QEMU splits multiboot module lists at commas)",
                    ));
                }
                args.push("-initrd");
                args.push(value);
            }
            args.push("-append");
            args.push(boot.cmdline.clone());
        }
        // Only the devices with a bootindex (the disks, in order) are tried:
        // never the seed, nor a network card's option ROM.
        None => args.push_all(["-boot", "strict=on"]),
    }

    let mut node_names: HashSet<String> =
        RESERVED_NODE_NAMES.iter().map(|n| n.to_string()).collect();
    for (index, disk) in spec.disks.iter().enumerate() {
        validate_node_name(&disk.node_name)?;
        node_names.insert(file_node_name(index));
        for depth in 1..=disk.backing.len() {
            let (format, file) = backing_node_names(index, depth);
            node_names.insert(format);
            node_names.insert(file);
        }
        for (j, layer) in disk.backing.iter().enumerate() {
            match layer.format.as_str() {
                "qcow2" => {}
                "raw" if j + 1 == disk.backing.len() => {}
                "raw" => return Err(CmdlineError::RawLayerNotAtBottom { index }),
                other => {
                    return Err(CmdlineError::BadLayerFormat {
                        index,
                        format: other.to_owned(),
                    });
                }
            }
        }
    }
    for disk in &spec.disks {
        if !node_names.insert(disk.node_name.clone()) {
            return Err(CmdlineError::DuplicateNodeName(disk.node_name.clone()));
        }
    }
    let mut serials = HashSet::new();
    for disk in &spec.disks {
        validate_serial(&disk.serial)?;
        if !disk.serial.is_empty() && !serials.insert(disk.serial.as_str()) {
            return Err(CmdlineError::DuplicateSerial(disk.serial.clone()));
        }
    }
    for (index, disk) in spec.disks.iter().enumerate() {
        // Bottom first, so each node's backing exists when it is added.
        // The top names the first backing node, the bottom `null`: QEMU
        // never follows a header's backing file name.
        let layer_fds = &fds.disk_layers[index];
        let mut below: Option<String> = None;
        for (j, layer) in disk.backing.iter().enumerate().rev() {
            let depth = j + 1;
            let field = format!("disks[{index}].backing[{j}]");
            let filename = fdset(&mut args, &field, layer_fds[depth], &layer.path)?;
            let (format_node, file_node) = backing_node_names(index, depth);
            args.push("-blockdev");
            args.push(
                json!({
                    "driver": "file",
                    "filename": filename,
                    "node-name": file_node,
                    "read-only": true,
                })
                .to_string(),
            );
            let mut node = json!({
                "driver": layer.format,
                "file": file_node,
                "node-name": format_node,
                "read-only": true,
            });
            if layer.format == "qcow2" {
                node["backing"] = json!(below);
            }
            args.push("-blockdev");
            args.push(node.to_string());
            below = Some(format_node);
        }
        let field = format!("disks[{index}]");
        let filename = fdset(&mut args, &field, layer_fds[0], &disk.path)?;
        let file_node = file_node_name(index);
        args.push("-blockdev");
        args.push(
            json!({
                "driver": "file",
                "filename": filename,
                "node-name": file_node,
                "read-only": disk.read_only,
            })
            .to_string(),
        );
        args.push("-blockdev");
        args.push(
            json!({
                "driver": "qcow2",
                "file": file_node,
                "node-name": disk.node_name,
                "read-only": disk.read_only,
                "backing": below,
            })
            .to_string(),
        );
        let mut device = json!({
            "driver": "virtio-blk-pci",
            "drive": disk.node_name,
            "id": disk_device_id(index),
        });
        if !disk.serial.is_empty() {
            // A JSON string: no byte of it can reach QEMU's option parser.
            device["serial"] = json!(disk.serial);
        }
        if spec.kernel.is_none() {
            // The disk order is the boot order.
            device["bootindex"] = json!(index);
        }
        args.push("-device");
        args.push(device.to_string());
    }

    if let Some(seed) = &spec.seed {
        let seed_fd = fds.seed.ok_or(CmdlineError::FdMismatch("the seed"))?;
        let filename = fdset(&mut args, "seed", seed_fd, seed)?;
        args.push("-blockdev");
        args.push(
            json!({
                "driver": "file",
                "filename": filename,
                "node-name": SEED_FILE_NODE_NAME,
                "read-only": true,
            })
            .to_string(),
        );
        args.push("-blockdev");
        args.push(
            json!({
                "driver": "raw",
                "file": SEED_FILE_NODE_NAME,
                "node-name": SEED_NODE_NAME,
                "read-only": true,
            })
            .to_string(),
        );
        // No bootindex and no serial: cloud-init finds it by its label.
        args.push("-device");
        args.push(
            json!({
                "driver": "virtio-blk-pci",
                "drive": SEED_NODE_NAME,
                "id": SEED_DEVICE_ID,
            })
            .to_string(),
        );
    }

    for (index, nic) in spec.nics.iter().enumerate() {
        if !valid_tap_name(&nic.tap) {
            return Err(CmdlineError::BadTapName {
                index,
                tap: nic.tap.clone(),
            });
        }
        if !valid_unicast_mac(&nic.mac) {
            return Err(CmdlineError::BadMac {
                index,
                mac: nic.mac.clone(),
            });
        }
        let id = nic_device_id(index);
        // The tap is made, enslaved and brought up by hearth, and attached
        // by hearthd: QEMU gets the descriptor (no name, no script, no
        // CAP_NET_ADMIN), and /dev/vhost-net's too when it is used.
        let nic_fds = fds.nics[index];
        let mut netdev = json!({
            "type": "tap",
            "id": id,
            "fd": nic_fds.tap.to_string(),
            "vhost": nic.vhost,
        });
        if nic.vhost {
            let vhost = nic_fds.vhost.ok_or(CmdlineError::FdMismatch("the NICs"))?;
            netdev["vhostfd"] = json!(vhost.to_string());
        }
        args.push("-netdev");
        args.push(netdev.to_string());
        // No option ROM: nothing boots from the network (`-boot strict=on`
        // tries only the disks), and it saves the firmware loading iPXE.
        args.push("-device");
        args.push(
            json!({
                "driver": "virtio-net-pci",
                "netdev": id,
                "id": id,
                "mac": nic.mac,
                "romfile": "",
            })
            .to_string(),
        );
    }

    // Every socket is one hearthd listens on and hands over (`fd=`): QEMU
    // creates nothing in the run directory.
    if let Some(agent_socket) = &spec.agent_socket {
        plain_path("agent_socket", agent_socket)?;
        let fd = fds
            .agent
            .ok_or(CmdlineError::FdMismatch("the agent socket"))?;
        args.push("-device");
        args.push(json!({"driver": "virtio-serial-pci", "id": "vser0"}).to_string());
        args.push("-chardev");
        args.push(format!("socket,id=qga0,fd={fd},server=on,wait=off"));
        args.push("-device");
        args.push(
            json!({
                "driver": "virtserialport",
                "bus": "vser0.0",
                "chardev": "qga0",
                "name": AGENT_PORT_NAME,
            })
            .to_string(),
        );
    }

    // `-qmp unix:PATH,...` would need its own escaping rules; a chardev plus `-mon`
    // is what `-qmp` expands to anyway.
    plain_path("qmp_socket", &spec.qmp_socket)?;
    args.push("-chardev");
    args.push(format!("socket,id=qmp0,fd={},server=on,wait=off", fds.qmp));
    args.push_all(["-mon", "chardev=qmp0,mode=control"]);

    // hearthd truncated the log when it opened it (a descriptor from an fd
    // set is dup'ed: QEMU's own O_TRUNC would not reach the file).
    let serial = fdset(&mut args, "serial_log", fds.serial_log, &spec.serial_log)?;
    args.push("-chardev");
    match &spec.serial_socket {
        // `wait=off` never holds the guest for a client, and output while
        // no client is attached still reaches the logfile.
        Some(sock) => {
            plain_path("serial_socket", sock)?;
            let fd = fds
                .serial_socket
                .ok_or(CmdlineError::FdMismatch("the serial socket"))?;
            args.push(format!(
                "socket,id=serial0,fd={fd},server=on,wait=off,logfile={serial},logappend=off"
            ));
        }
        None => args.push(format!("file,id=serial0,path={serial}")),
    }
    args.push_all(["-serial", "chardev:serial0"]);

    Ok(args.0)
}

#[derive(Default)]
struct Args(Vec<OsString>);

impl Args {
    fn push(&mut self, arg: impl Into<OsString>) {
        self.0.push(arg.into());
    }
    fn push_all<'a>(&mut self, items: impl IntoIterator<Item = &'a str>) {
        self.0.extend(items.into_iter().map(OsString::from));
    }
}

/// DNS label (RFC 1123): the only names that may reach `-name`.
pub fn validate_vm_name(name: &str) -> Result<(), CmdlineError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-');
    if ok {
        Ok(())
    } else {
        Err(CmdlineError::InvalidVmName(name.to_owned()))
    }
}

/// QEMU's own node-name rule (`id_wellformed`), checked here so a bad name fails
/// with our message instead of a QEMU start-up error.
pub fn validate_node_name(name: &str) -> Result<(), CmdlineError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= MAX_NODE_NAME_LEN
        && bytes[0].is_ascii_alphabetic()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(CmdlineError::InvalidNodeName(name.to_owned()))
    }
}

fn unsafe_path(field: &str, path: &Path, reason: &'static str) -> CmdlineError {
    CmdlineError::UnsafePath {
        field: field.to_owned(),
        path: path.to_owned(),
        reason,
    }
}

/// A path QEMU will take verbatim: absolute, UTF-8 (JSON needs it), no control
/// characters (they only ever garble logs and error messages).
fn plain_path(field: &str, path: &Path) -> Result<String, CmdlineError> {
    let Some(text) = path.to_str() else {
        return Err(unsafe_path(field, path, "not valid UTF-8"));
    };
    if !path.is_absolute() {
        // A relative path would resolve against QEMU's working directory and could
        // look like a protocol prefix (`nbd:...`) to some QEMU parsers.
        return Err(unsafe_path(field, path, "must be absolute"));
    }
    if text.chars().any(char::is_control) {
        return Err(unsafe_path(field, path, "contains a control character"));
    }
    Ok(text.to_owned())
}

/// A path for QEMU's `key=value,...` syntax: QEMU's escape for a literal comma in a
/// value is a doubled comma, so that is the only character needing treatment.
fn legacy_opt_path(field: &str, path: &Path) -> Result<String, CmdlineError> {
    Ok(plain_path(field, path)?.replace(',', ",,"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The argv with made-up descriptor numbers of the right shape.
    fn build_args(s: &LaunchSpec) -> Result<Vec<OsString>, CmdlineError> {
        super::build_args(s, &FdNumbers::for_spec(s))
    }

    fn spec() -> LaunchSpec {
        LaunchSpec {
            vm_name: "demo".into(),
            cpus: 2,
            memory_mib: 256,
            accel: Accel::Tcg,
            firmware: Firmware::Bios,
            kernel: Some(KernelBoot {
                kernel: "/var/lib/hearth/boot/vmlinuz".into(),
                initrd: Some("/var/lib/hearth/boot/initrd.img".into()),
                cmdline: "console=ttyS0 quiet".into(),
            }),
            disks: vec![
                DiskAttachment {
                    node_name: "disk-root".into(),
                    path: "/var/lib/hearth/disks/root.qcow2".into(),
                    read_only: false,
                    serial: "root".into(),
                    backing: vec![],
                },
                DiskAttachment {
                    node_name: "disk-data".into(),
                    path: "/var/lib/hearth/disks/data.qcow2".into(),
                    read_only: true,
                    serial: "data".into(),
                    backing: vec![],
                },
            ],
            seed: None,
            nics: vec![],
            agent_socket: Some("/run/hearth/demo/qga.sock".into()),
            qmp_socket: "/run/hearth/demo/qmp.sock".into(),
            serial_log: "/var/log/hearth/demo/serial.log".into(),
            serial_socket: None,
        }
    }

    fn kernel_of(s: &mut LaunchSpec) -> &mut KernelBoot {
        s.kernel.as_mut().expect("the test spec boots a kernel")
    }

    fn strings(args: &[OsString]) -> Vec<String> {
        args.iter()
            .map(|a| a.to_str().expect("utf-8 arg").to_owned())
            .collect()
    }

    /// The argument following each occurrence of `flag`.
    fn values_of(args: &[String], flag: &str) -> Vec<String> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].clone())
            .collect()
    }

    fn json_values_of(args: &[String], flag: &str) -> Vec<Value> {
        values_of(args, flag)
            .iter()
            .map(|v| serde_json::from_str(v).expect("JSON option value"))
            .collect()
    }

    /// The `-blockdev` values, each `/dev/fdset/S` filename replaced by the
    /// label (`opaque`) of its `-add-fd`: the file the set stands for.
    fn blockdevs(args: &[String]) -> Vec<Value> {
        let sets: Vec<(String, String)> = values_of(args, "-add-fd")
            .iter()
            .map(|v| {
                let keys = legacy_keys(v);
                let get = |k: &str| {
                    keys.iter()
                        .find(|(key, _)| key == k)
                        .map(|(_, v)| v.clone())
                        .expect("-add-fd key")
                };
                (fdset_path(get("set").parse().expect("set")), get("opaque"))
            })
            .collect();
        json_values_of(args, "-blockdev")
            .into_iter()
            .map(|mut b| {
                if let Some(f) = b["filename"].as_str()
                    && let Some((_, label)) = sets.iter().find(|(p, _)| p == f)
                {
                    b["filename"] = json!(label);
                }
                b
            })
            .collect()
    }

    /// Splits a legacy QEMU option string the way QEMU does (`,,` is a literal comma)
    /// and returns the keys. Used to prove no key can be injected.
    fn legacy_keys(value: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut current = String::new();
        let mut chars = value.chars().peekable();
        let mut parts = Vec::new();
        while let Some(c) = chars.next() {
            if c == ',' {
                if chars.peek() == Some(&',') {
                    chars.next();
                    current.push(',');
                } else {
                    parts.push(std::mem::take(&mut current));
                }
            } else {
                current.push(c);
            }
        }
        parts.push(current);
        for part in parts {
            match part.split_once('=') {
                Some((k, v)) => out.push((k.to_owned(), v.to_owned())),
                None => out.push((String::new(), part)),
            }
        }
        out
    }

    #[test]
    fn full_argv_for_a_two_disk_vm_with_agent() {
        let args = strings(&build_args(&spec()).expect("valid spec"));
        let expected_prefix = [
            "-name",
            "guest=demo",
            "-no-user-config",
            "-nodefaults",
            "-nographic",
            "-no-reboot",
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-machine",
            "q35",
            "-accel",
            "tcg",
            "-cpu",
            "max",
            "-smp",
            "2",
            "-m",
            "256M",
            "-msg",
            "timestamp=on",
            "-kernel",
            "/var/lib/hearth/boot/vmlinuz",
            "-initrd",
            "/var/lib/hearth/boot/initrd.img",
            "-append",
            "console=ttyS0 quiet",
        ];
        assert_eq!(&args[..expected_prefix.len()], &expected_prefix[..]);

        let blockdevs = blockdevs(&args);
        assert_eq!(
            blockdevs,
            vec![
                json!({"driver": "file", "filename": "/var/lib/hearth/disks/root.qcow2",
                       "node-name": "file-0", "read-only": false}),
                json!({"driver": "qcow2", "file": "file-0", "node-name": "disk-root",
                       "read-only": false, "backing": null}),
                json!({"driver": "file", "filename": "/var/lib/hearth/disks/data.qcow2",
                       "node-name": "file-1", "read-only": true}),
                json!({"driver": "qcow2", "file": "file-1", "node-name": "disk-data",
                       "read-only": true, "backing": null}),
            ]
        );
        // Every file by descriptor: the two layers and the serial log, each
        // in a set of its own labelled with its path.
        assert_eq!(
            values_of(&args, "-add-fd"),
            vec![
                "fd=100,set=1,opaque=/var/lib/hearth/disks/root.qcow2",
                "fd=101,set=2,opaque=/var/lib/hearth/disks/data.qcow2",
                "fd=102,set=3,opaque=/var/log/hearth/demo/serial.log",
            ]
        );
        let json_blockdevs = json_values_of(&args, "-blockdev");
        assert_eq!(json_blockdevs[0]["filename"], "/dev/fdset/1");
        assert_eq!(json_blockdevs[2]["filename"], "/dev/fdset/2");
        let devices = json_values_of(&args, "-device");
        assert_eq!(
            devices,
            vec![
                json!({"driver": "virtio-blk-pci", "drive": "disk-root", "id": "vdisk0",
                       "serial": "root"}),
                json!({"driver": "virtio-blk-pci", "drive": "disk-data", "id": "vdisk1",
                       "serial": "data"}),
                json!({"driver": "virtio-serial-pci", "id": "vser0"}),
                json!({"driver": "virtserialport", "bus": "vser0.0", "chardev": "qga0",
                       "name": "org.qemu.guest_agent.0"}),
            ]
        );
        assert_eq!(
            values_of(&args, "-chardev"),
            vec![
                "socket,id=qga0,fd=104,server=on,wait=off",
                "socket,id=qmp0,fd=103,server=on,wait=off",
                "file,id=serial0,path=/dev/fdset/3",
            ]
        );
        assert_eq!(values_of(&args, "-mon"), vec!["chardev=qmp0,mode=control"]);
        assert_eq!(values_of(&args, "-serial"), vec!["chardev:serial0"]);
    }

    #[test]
    fn serial_socket_serves_the_port_and_keeps_the_log_as_its_logfile() {
        let mut s = spec();
        s.serial_socket = Some("/run/hearth/demo/serial,x.sock".into());
        let args = strings(&build_args(&s).expect("valid"));
        let chardevs = values_of(&args, "-chardev");
        let serial = legacy_keys(chardevs.last().expect("serial chardev"));
        assert_eq!(
            serial,
            vec![
                (String::new(), "socket".into()),
                ("id".into(), "serial0".into()),
                ("fd".into(), "105".into()),
                ("server".into(), "on".into()),
                ("wait".into(), "off".into()),
                ("logfile".into(), "/dev/fdset/3".into()),
                ("logappend".into(), "off".into()),
            ]
        );
        assert_eq!(values_of(&args, "-serial"), vec!["chardev:serial0"]);
    }

    #[test]
    fn accel_serialises_in_lowercase_as_status_fields_expect() {
        assert_eq!(serde_json::to_string(&Accel::Kvm).expect("ser"), "\"kvm\"");
        assert_eq!(
            serde_json::from_str::<Accel>("\"tcg\"").expect("de"),
            Accel::Tcg
        );
        assert!(serde_json::from_str::<Accel>("\"TCG\"").is_err());
        assert_eq!(Accel::Tcg.to_string(), "tcg");
    }

    #[test]
    fn kvm_uses_the_host_cpu_model() {
        let mut s = spec();
        s.accel = Accel::Kvm;
        let args = strings(&build_args(&s).expect("valid"));
        assert_eq!(values_of(&args, "-accel"), vec!["kvm"]);
        assert_eq!(values_of(&args, "-cpu"), vec!["host"]);
    }

    #[test]
    fn without_agent_there_is_no_virtio_serial_at_all() {
        let mut s = spec();
        s.agent_socket = None;
        let args = strings(&build_args(&s).expect("valid"));
        assert!(!args.iter().any(|a| a.contains("virtio-serial")));
        assert!(!args.iter().any(|a| a.contains("guest_agent")));
        assert!(!args.iter().any(|a| a.contains("qga0")));
        assert_eq!(values_of(&args, "-chardev").len(), 2, "only qmp and serial");
    }

    #[test]
    fn no_initrd_means_no_initrd_flag() {
        let mut s = spec();
        kernel_of(&mut s).initrd = None;
        let args = strings(&build_args(&s).expect("valid"));
        assert!(!args.iter().any(|a| a == "-initrd"));
    }

    #[test]
    fn disk_path_with_option_syntax_stays_one_json_string() {
        let mut s = spec();
        let nasty = r#"/tmp/a,driver=x,file=/etc/shadow "quoted" = sp ace.qcow2"#;
        s.disks[0].path = nasty.into();
        let args = strings(&build_args(&s).expect("valid"));
        let file_node = &blockdevs(&args)[0];
        assert_eq!(file_node["filename"], nasty);
        assert_eq!(file_node["driver"], "file", "driver not overridden");
        let keys: Vec<_> = file_node
            .as_object()
            .expect("object")
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys, ["driver", "filename", "node-name", "read-only"]);
    }

    #[test]
    fn socket_and_log_paths_with_commas_are_escaped_not_split() {
        let mut s = spec();
        s.qmp_socket = "/tmp/a,server=off,path=/evil".into();
        s.agent_socket = Some("/tmp/q ga,id=x=y \"q\".sock".into());
        s.serial_log = "/tmp/log,append=on".into();
        let args = strings(&build_args(&s).expect("valid"));
        // Sockets go by descriptor: no socket path reaches the argv at all.
        assert!(
            !args
                .iter()
                .any(|a| a.contains("/tmp/a") || a.contains("q ga")),
            "{args:?}"
        );
        let chardevs = values_of(&args, "-chardev");
        assert_eq!(chardevs.len(), 3);
        let qmp = legacy_keys(&chardevs[1]);
        assert_eq!(qmp.len(), 5, "{qmp:?}");
        // The log's path is only a label, escaped, of its fd set.
        let sets = values_of(&args, "-add-fd");
        let log = legacy_keys(sets.last().expect("serial log set"));
        assert_eq!(
            log,
            vec![
                ("fd".into(), "102".into()),
                ("set".into(), "3".into()),
                ("opaque".into(), "/tmp/log,append=on".into()),
            ]
        );
    }

    #[test]
    fn kernel_path_and_cmdline_are_single_verbatim_arguments() {
        let mut s = spec();
        kernel_of(&mut s).kernel = "/boot/vm linuz,initrd=/etc/shadow".into();
        kernel_of(&mut s).cmdline = "console=ttyS0 root=/dev/vda,x \"quoted\" -device foo".into();
        let args = strings(&build_args(&s).expect("valid"));
        assert_eq!(
            values_of(&args, "-kernel"),
            vec!["/boot/vm linuz,initrd=/etc/shadow"]
        );
        assert_eq!(
            values_of(&args, "-append"),
            vec!["console=ttyS0 root=/dev/vda,x \"quoted\" -device foo"]
        );
        // The "-device foo" inside the cmdline is not a separate argv element.
        assert_eq!(json_values_of(&args, "-device").len(), 4);
    }

    #[test]
    fn initrd_with_comma_is_rejected_naming_the_field() {
        let mut s = spec();
        kernel_of(&mut s).initrd = Some("/boot/initrd,/etc/shadow".into());
        let err = build_args(&s).expect_err("comma in initrd");
        assert!(matches!(&err, CmdlineError::UnsafePath { field, .. } if field == "initrd"));
        assert!(err.to_string().contains("/boot/initrd,/etc/shadow"));
    }

    #[test]
    fn initrd_with_spaces_quotes_and_equals_is_fine() {
        let mut s = spec();
        kernel_of(&mut s).initrd = Some("/boot/my \"initrd\"=1.img".into());
        let args = strings(&build_args(&s).expect("valid"));
        assert_eq!(
            values_of(&args, "-initrd"),
            vec!["/boot/my \"initrd\"=1.img"]
        );
    }

    #[test]
    fn relative_and_control_character_paths_are_rejected() {
        let mut s = spec();
        kernel_of(&mut s).kernel = "vmlinuz".into();
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::UnsafePath {
                reason: "must be absolute",
                ..
            })
        ));
        let mut s = spec();
        s.qmp_socket = "/tmp/qmp\n.sock".into();
        let err = build_args(&s).expect_err("newline");
        assert!(
            matches!(&err, CmdlineError::UnsafePath { field, .. } if field == "qmp_socket"),
            "{err}"
        );
        let mut s = spec();
        s.disks[1].path = "nbd:evil:1234".into();
        let err = build_args(&s).expect_err("protocol-looking path");
        assert!(matches!(&err, CmdlineError::UnsafePath { field, .. } if field == "disks[1]"));
    }

    #[test]
    fn non_utf8_paths_are_rejected() {
        use std::os::unix::ffi::OsStrExt;
        let mut s = spec();
        s.serial_log = PathBuf::from(std::ffi::OsStr::from_bytes(b"/tmp/\xff.log"));
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::UnsafePath {
                reason: "not valid UTF-8",
                ..
            })
        ));
    }

    #[test]
    fn vm_names_that_are_not_dns_labels_never_reach_the_argv() {
        for bad in [
            "",
            "Demo",
            "a,process=evil",
            "a=b",
            "-x",
            "x-",
            "a b",
            "a.b",
            &"a".repeat(64),
        ] {
            let mut s = spec();
            s.vm_name = bad.to_owned();
            assert_eq!(
                build_args(&s),
                Err(CmdlineError::InvalidVmName(bad.to_owned())),
                "{bad:?}"
            );
        }
        for good in ["a", "demo-1", "0vm", &"a".repeat(63)] {
            let mut s = spec();
            s.vm_name = good.to_owned();
            assert!(build_args(&s).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn node_names_follow_qemu_rules_and_must_be_unique() {
        let mut s = spec();
        s.disks[0].node_name = "bad,name".into();
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::InvalidNodeName(_))
        ));
        let mut s = spec();
        s.disks[0].node_name = "0disk".into();
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::InvalidNodeName(_))
        ));
        let mut s = spec();
        s.disks[1].node_name = "disk-root".into();
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::DuplicateNodeName("disk-root".into()))
        );
        let mut s = spec();
        s.disks[0].node_name = "file-1".into();
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::DuplicateNodeName("file-1".into()))
        );
    }

    #[test]
    fn disk_serial_is_the_name_when_it_fits() {
        assert_eq!(disk_serial("data"), "data");
        let twenty = "a".repeat(20);
        assert_eq!(disk_serial(&twenty), twenty);
        assert_eq!(disk_serial(""), "");
    }

    #[test]
    fn long_disk_names_get_a_prefix_and_a_stable_hash() {
        let name = "postgres-primary-data-volume";
        let serial = disk_serial(name);
        assert_eq!(serial.len(), MAX_SERIAL_LEN);
        assert!(serial.starts_with("postgres-pr-"), "{serial}");
        // Fixed by the algorithm, not by the build: a serial already in a guest's
        // fstab or udev rules must not change when hearth is rebuilt.
        assert_eq!(
            serial,
            format!("postgres-pr-{:08x}", fnv1a_32(name.as_bytes()))
        );
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
        assert_eq!(disk_serial(name), serial, "same input, same serial");
        assert!(validate_serial(&serial).is_ok());
        // Exactly one byte too long still hashes.
        let twenty_one = "b".repeat(21);
        assert_eq!(disk_serial(&twenty_one).len(), MAX_SERIAL_LEN);
        assert_ne!(disk_serial(&twenty_one), twenty_one[..20]);
    }

    #[test]
    fn long_disk_names_sharing_a_prefix_get_distinct_serials() {
        let names: Vec<String> = (0..200)
            .map(|i| format!("shared-prefix-disk-number-{i}"))
            .collect();
        let serials: HashSet<String> = names.iter().map(|n| disk_serial(n)).collect();
        assert_eq!(serials.len(), names.len(), "a collision among {names:?}");
        for (name, serial) in names.iter().map(|n| (n, disk_serial(n))) {
            assert!(serial.len() <= MAX_SERIAL_LEN, "{name}: {serial}");
            assert!(serial.starts_with("shared-pref-"), "{serial}");
        }
    }

    #[test]
    fn disk_serial_never_splits_a_character_and_stays_short() {
        // Not a valid disk name, but the function must not panic on it.
        let name = "abcdefghij\u{e9}klmnopqrstuvwxyz";
        let serial = disk_serial(name);
        assert!(serial.len() <= MAX_SERIAL_LEN, "{serial}");
        assert!(serial.starts_with("abcdefghij-"), "{serial}");
    }

    #[test]
    fn serials_are_validated_and_unique() {
        let mut s = spec();
        s.disks[0].serial = "x\",id=evil".into();
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::InvalidSerial("x\",id=evil".into()))
        );
        let mut s = spec();
        s.disks[0].serial = "a".repeat(21);
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::InvalidSerial(_))
        ));
        let mut s = spec();
        s.disks[1].serial = "root".into();
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::DuplicateSerial("root".into()))
        );
        // No serial at all: the device gets no serial property.
        let mut s = spec();
        s.disks[0].serial = String::new();
        s.disks[1].serial = String::new();
        let args = strings(&build_args(&s).expect("valid"));
        let devices = json_values_of(&args, "-device");
        assert!(devices[0].get("serial").is_none(), "{}", devices[0]);
        assert!(devices[1].get("serial").is_none(), "{}", devices[1]);
    }

    #[test]
    fn cpu_and_memory_bounds() {
        let mut s = spec();
        s.cpus = 0;
        assert_eq!(build_args(&s), Err(CmdlineError::InvalidCpus(0)));
        let mut s = spec();
        s.memory_mib = 0;
        assert_eq!(build_args(&s), Err(CmdlineError::InvalidMemory(0)));
    }

    #[test]
    fn nul_in_cmdline_is_rejected() {
        let mut s = spec();
        kernel_of(&mut s).cmdline = "console=ttyS0\0evil".into();
        assert_eq!(build_args(&s), Err(CmdlineError::NulInCmdline));
    }

    fn ovmf() -> Firmware {
        Firmware::Uefi(Ovmf {
            code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            vars: "/var/lib/hearth/vms/demo/uefi-vars.fd".into(),
        })
    }

    /// The `-device` values that are virtio-blk disks, in argv order.
    fn block_devices(args: &[String]) -> Vec<Value> {
        json_values_of(args, "-device")
            .into_iter()
            .filter(|d| d["driver"] == "virtio-blk-pci")
            .collect()
    }

    #[test]
    fn bios_firmware_boot_has_no_kernel_and_boots_the_disks_in_their_order() {
        let mut s = spec();
        s.kernel = None;
        let args = strings(&build_args(&s).expect("valid"));
        for flag in ["-kernel", "-initrd", "-append"] {
            assert!(!args.iter().any(|a| a == flag), "{flag} in {args:?}");
        }
        // SeaBIOS is QEMU's default: no flash, no -bios.
        assert_eq!(values_of(&args, "-machine"), vec!["q35"]);
        assert!(!args.iter().any(|a| a == "-bios" || a.contains("pflash")));
        // Only bootindex'd devices are tried.
        assert_eq!(values_of(&args, "-boot"), vec!["strict=on"]);
        let disks = block_devices(&args);
        assert_eq!(
            disks,
            vec![
                json!({"driver": "virtio-blk-pci", "drive": "disk-root", "id": "vdisk0",
                       "serial": "root", "bootindex": 0}),
                json!({"driver": "virtio-blk-pci", "drive": "disk-data", "id": "vdisk1",
                       "serial": "data", "bootindex": 1}),
            ]
        );
        // The order follows the list, whatever the names.
        s.disks.swap(0, 1);
        let args = strings(&build_args(&s).expect("valid"));
        let disks = block_devices(&args);
        assert_eq!(disks[0]["drive"], "disk-data");
        assert_eq!(disks[0]["bootindex"], 0);
        assert_eq!(disks[1]["drive"], "disk-root");
        assert_eq!(disks[1]["bootindex"], 1);
    }

    #[test]
    fn direct_kernel_boot_gives_no_disk_a_bootindex() {
        let args = strings(&build_args(&spec()).expect("valid"));
        assert!(!args.iter().any(|a| a == "-boot"));
        for d in block_devices(&args) {
            assert!(d.get("bootindex").is_none(), "{d}");
        }
    }

    #[test]
    fn uefi_runs_ovmf_from_pflash_with_read_only_code_and_writable_vars() {
        let mut s = spec();
        s.kernel = None;
        s.firmware = ovmf();
        let args = strings(&build_args(&s).expect("valid"));
        let blockdevs = blockdevs(&args);
        assert_eq!(
            blockdevs[..2],
            [
                json!({"driver": "file", "filename": "/usr/share/OVMF/OVMF_CODE_4M.fd",
                       "node-name": "ovmf-code", "read-only": true}),
                json!({"driver": "file", "filename": "/var/lib/hearth/vms/demo/uefi-vars.fd",
                       "node-name": "ovmf-vars", "read-only": false}),
            ]
        );
        let machine = values_of(&args, "-machine");
        assert_eq!(machine, vec!["q35,pflash0=ovmf-code,pflash1=ovmf-vars"]);
        assert_eq!(
            legacy_keys(&machine[0]),
            vec![
                (String::new(), "q35".into()),
                ("pflash0".into(), "ovmf-code".into()),
                ("pflash1".into(), "ovmf-vars".into()),
            ]
        );
        // The nodes exist before -machine refers to them.
        let first_blockdev = args
            .iter()
            .position(|a| a == "-blockdev")
            .expect("blockdev");
        let machine_at = args.iter().position(|a| a == "-machine").expect("machine");
        assert!(first_blockdev < machine_at);
        assert!(!args.iter().any(|a| a == "-kernel"));
        assert_eq!(values_of(&args, "-boot"), vec!["strict=on"]);
        let disks = block_devices(&args);
        assert_eq!(disks[0]["bootindex"], 0);
        assert_eq!(disks[1]["bootindex"], 1);
    }

    #[test]
    fn a_kernel_under_uefi_gets_both_the_flash_and_the_kernel() {
        let mut s = spec();
        s.firmware = ovmf();
        let args = strings(&build_args(&s).expect("valid"));
        assert_eq!(
            values_of(&args, "-machine"),
            vec!["q35,pflash0=ovmf-code,pflash1=ovmf-vars"]
        );
        assert_eq!(
            values_of(&args, "-kernel"),
            vec!["/var/lib/hearth/boot/vmlinuz"]
        );
        assert_eq!(values_of(&args, "-append"), vec!["console=ttyS0 quiet"]);
        assert!(!args.iter().any(|a| a == "-boot"));
        for d in block_devices(&args) {
            assert!(d.get("bootindex").is_none(), "{d}");
        }
    }

    #[test]
    fn the_seed_is_read_only_after_every_disk_and_never_booted() {
        for kernel in [true, false] {
            let mut s = spec();
            if !kernel {
                s.kernel = None;
            }
            s.seed = Some("/var/lib/hearth/vms/demo/cidata.img".into());
            let args = strings(&build_args(&s).expect("valid"));
            let blockdevs = blockdevs(&args);
            assert_eq!(
                blockdevs[blockdevs.len() - 2..],
                [
                    json!({"driver": "file", "filename": "/var/lib/hearth/vms/demo/cidata.img",
                           "node-name": "cidata-file", "read-only": true}),
                    json!({"driver": "raw", "file": "cidata-file", "node-name": "cidata",
                           "read-only": true}),
                ]
            );
            let disks = block_devices(&args);
            assert_eq!(disks.len(), 3);
            assert_eq!(disks[0]["id"], "vdisk0", "the first user disk stays vda");
            assert_eq!(disks[1]["id"], "vdisk1");
            assert_eq!(
                disks[2],
                json!({"driver": "virtio-blk-pci", "drive": "cidata", "id": "cidata"}),
                "last, no bootindex, no serial"
            );
            // It is not one of the disks by device id either.
            assert_eq!(
                crate::fsmap::parse_query_pci(&json!([{"bus": 0, "devices": [
                {"bus": 0, "slot": 3, "function": 0, "qdev_id": "cidata"}]}])),
                Ok(Default::default())
            );
        }
    }

    #[test]
    fn no_disk_may_take_a_node_name_of_the_seed_or_the_flash() {
        for name in ["cidata", "cidata-file", "ovmf-code", "ovmf-vars"] {
            let mut s = spec();
            s.disks[1].node_name = name.into();
            assert_eq!(
                build_args(&s),
                Err(CmdlineError::DuplicateNodeName(name.into())),
                "{name}"
            );
        }
    }

    #[test]
    fn flash_and_seed_paths_with_option_syntax_stay_json_strings() {
        let code = "/srv/fw,readonly=off/OVMF CODE \"4M\".fd";
        let vars = "/var/lib/h,pflash1=x/vars=1,,.fd";
        let seed = "/var/lib/h/seed,driver=qcow2 \"x\".img";
        let mut s = spec();
        s.kernel = None;
        s.firmware = Firmware::Uefi(Ovmf {
            code: code.into(),
            vars: vars.into(),
        });
        s.seed = Some(seed.into());
        let args = strings(&build_args(&s).expect("valid"));
        let blockdevs = blockdevs(&args);
        assert_eq!(blockdevs[0]["filename"], code);
        assert_eq!(blockdevs[1]["filename"], vars);
        assert_eq!(blockdevs[blockdevs.len() - 2]["filename"], seed);
        assert_eq!(
            values_of(&args, "-machine"),
            vec!["q35,pflash0=ovmf-code,pflash1=ovmf-vars"]
        );
        for b in &blockdevs {
            let keys: Vec<_> = b.as_object().expect("object").keys().cloned().collect();
            assert!(
                keys == ["driver", "filename", "node-name", "read-only"]
                    || keys == ["driver", "file", "node-name", "read-only"]
                    || keys == ["backing", "driver", "file", "node-name", "read-only"],
                "{b}"
            );
        }
    }

    #[test]
    fn every_layer_of_a_chain_is_a_node_of_its_own_from_its_own_fd_set() {
        let mut s = spec();
        s.disks[0].backing = vec![
            BackingLayer {
                path: "/var/lib/hearth/layers/00000002-root.qcow2".into(),
                format: "qcow2".into(),
                real_path: "/var/lib/hearth/layers/00000002-root.qcow2".into(),
            },
            BackingLayer {
                path: "/var/lib/hearth/images/sha256-ab.raw".into(),
                format: "raw".into(),
                real_path: "/var/lib/hearth/images/sha256-ab.raw".into(),
            },
        ];
        let fds = FdNumbers::for_spec(&s);
        assert_eq!(fds.disk_layers, vec![vec![100, 101, 102], vec![103]]);
        let args = strings(&super::build_args(&s, &fds).expect("valid"));
        // Bottom first, so every node's backing exists when it is added;
        // the top names the next layer, the bottom has none.
        assert_eq!(
            json_values_of(&args, "-blockdev")[..6],
            [
                json!({"driver": "file", "filename": "/dev/fdset/1",
                       "node-name": "file-0-2", "read-only": true}),
                json!({"driver": "raw", "file": "file-0-2",
                       "node-name": "back-0-2", "read-only": true}),
                json!({"driver": "file", "filename": "/dev/fdset/2",
                       "node-name": "file-0-1", "read-only": true}),
                json!({"driver": "qcow2", "file": "file-0-1", "node-name": "back-0-1",
                       "read-only": true, "backing": "back-0-2"}),
                json!({"driver": "file", "filename": "/dev/fdset/3",
                       "node-name": "file-0", "read-only": false}),
                json!({"driver": "qcow2", "file": "file-0", "node-name": "disk-root",
                       "read-only": false, "backing": "back-0-1"}),
            ]
        );
        assert_eq!(
            values_of(&args, "-add-fd")[..3],
            [
                "fd=102,set=1,opaque=/var/lib/hearth/images/sha256-ab.raw",
                "fd=101,set=2,opaque=/var/lib/hearth/layers/00000002-root.qcow2",
                "fd=100,set=3,opaque=/var/lib/hearth/disks/root.qcow2",
            ]
        );
        // A chain's node names are taken: no disk may use them.
        s.disks[1].node_name = "back-0-1".into();
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::DuplicateNodeName("back-0-1".into()))
        );
        s.disks[1].node_name = "disk-data".into();
        // A raw layer has no backing: it can only be the bottom.
        s.disks[0].backing.swap(0, 1);
        assert_eq!(
            build_args(&s),
            Err(CmdlineError::RawLayerNotAtBottom { index: 0 })
        );
        s.disks[0].backing[0].format = "vmdk".into();
        assert!(matches!(
            build_args(&s),
            Err(CmdlineError::BadLayerFormat { index: 0, .. })
        ));
    }

    #[test]
    fn descriptors_must_match_the_spec() {
        let s = spec();
        let mut fds = FdNumbers::for_spec(&s);
        fds.disk_layers[0].push(7);
        assert_eq!(
            super::build_args(&s, &fds),
            Err(CmdlineError::FdMismatch("disk layers"))
        );
        let mut fds = FdNumbers::for_spec(&s);
        fds.agent = None;
        assert_eq!(
            super::build_args(&s, &fds),
            Err(CmdlineError::FdMismatch("the agent socket"))
        );
    }

    #[test]
    fn nics_are_json_netdevs_on_named_taps_without_option_roms() {
        let mut s = spec();
        s.nics = vec![
            NicAttachment {
                tap: "htt-web-0".into(),
                mac: "02:12:34:56:78:9a".into(),
                vhost: false,
            },
            NicAttachment {
                tap: "htt-web-1".into(),
                mac: "52:54:00:00:00:01".into(),
                vhost: true,
            },
        ];
        let args = strings(&build_args(&s).expect("valid"));
        let netdevs: Vec<serde_json::Value> = values_of(&args, "-netdev")
            .iter()
            .map(|v| serde_json::from_str(v).expect("json netdev"))
            .collect();
        // Attached by hearthd, handed over: QEMU gets descriptors, never a
        // name to open (nor a script to run).
        assert_eq!(
            netdevs,
            vec![
                json!({"type": "tap", "id": "nic0", "fd": "105", "vhost": false}),
                json!({"type": "tap", "id": "nic1", "fd": "106", "vhost": true,
                       "vhostfd": "107"}),
            ]
        );
        let nics: Vec<serde_json::Value> = values_of(&args, "-device")
            .iter()
            .filter_map(|v| serde_json::from_str::<serde_json::Value>(v).ok())
            .filter(|d| d["driver"] == "virtio-net-pci")
            .collect();
        assert_eq!(nics.len(), 2);
        assert_eq!(nics[1]["netdev"], netdevs[1]["id"]);
        assert_eq!(nics[1]["mac"], "52:54:00:00:00:01");
        assert_eq!(nics[0]["romfile"], "");
        assert!(nics[0].get("bootindex").is_none());

        for (tap, mac, want) in [
            ("htt-a,script=/x", "02:00:00:00:00:01", "tap name"),
            ("htt-much-too-long-name", "02:00:00:00:00:01", "tap name"),
            ("htt-a", "03:00:00:00:00:01", "not a unicast"),
            ("htt-a", "00:00:00:00:00:00", "not a unicast"),
            ("htt-a", "02:00:00:00:00", "not a unicast"),
        ] {
            s.nics = vec![NicAttachment {
                tap: tap.into(),
                mac: mac.into(),
                vhost: false,
            }];
            let e = build_args(&s).expect_err(tap).to_string();
            assert!(e.starts_with("nics[0]") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn relative_flash_and_seed_paths_are_rejected_naming_the_field() {
        let mut s = spec();
        s.firmware = Firmware::Uefi(Ovmf {
            code: "OVMF_CODE.fd".into(),
            vars: "/v.fd".into(),
        });
        let err = build_args(&s).expect_err("relative code");
        assert!(matches!(&err, CmdlineError::UnsafePath { field, .. } if field == "ovmf_code"));
        let mut s = spec();
        s.seed = Some("nbd:evil:1".into());
        let err = build_args(&s).expect_err("relative seed");
        assert!(matches!(&err, CmdlineError::UnsafePath { field, .. } if field == "seed"));
    }

    proptest::proptest! {
        /// Whatever printable path a user manages to get past the engine, the legacy
        /// option strings keep exactly their fixed keys and the path round-trips.
        #[test]
        fn no_path_can_add_a_legacy_option_key(tail in "[ -~]{0,40}") {
            let path = format!("/tmp/{tail}");
            let mut s = spec();
            s.serial_log = path.clone().into();
            let args = strings(&build_args(&s).expect("printable absolute path is accepted"));
            let set = values_of(&args, "-add-fd").last().expect("log set").clone();
            let keys = legacy_keys(&set);
            let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
            proptest::prop_assert_eq!(names, vec!["fd", "set", "opaque"]);
            proptest::prop_assert_eq!(&keys[2].1, &path);
        }

        /// Whatever printable paths the flash images, the seed and a disk
        /// have, `-machine` stays the fixed string, every path comes back as
        /// one JSON `filename`, and the seed stays last and read-only.
        #[test]
        fn no_flash_or_seed_path_changes_the_machine_or_the_devices(
            code in "[ -~]{0,40}",
            vars in "[ -~]{0,40}",
            seed in "[ -~]{0,40}",
            disk in "[ -~]{0,40}",
            kernel in proptest::bool::ANY,
        ) {
            let (code, vars, seed, disk) = (
                format!("/fw/{code}"),
                format!("/vars/{vars}"),
                format!("/seed/{seed}"),
                format!("/disk/{disk}"),
            );
            let mut s = spec();
            if !kernel {
                s.kernel = None;
            }
            s.firmware = Firmware::Uefi(Ovmf { code: code.clone().into(), vars: vars.clone().into() });
            s.seed = Some(seed.clone().into());
            s.disks[0].path = disk.clone().into();
            let args = strings(&build_args(&s).expect("printable absolute paths are accepted"));
            proptest::prop_assert_eq!(
                values_of(&args, "-machine"),
                vec!["q35,pflash0=ovmf-code,pflash1=ovmf-vars".to_string()]
            );
            let filenames: Vec<String> = blockdevs(&args)
                .iter()
                .filter_map(|b| b["filename"].as_str().map(str::to_owned))
                .collect();
            proptest::prop_assert_eq!(
                filenames,
                vec![code, vars, disk, "/var/lib/hearth/disks/data.qcow2".to_string(), seed]
            );
            let disks = block_devices(&args);
            proptest::prop_assert_eq!(disks.len(), 3);
            proptest::prop_assert_eq!(&disks[2]["id"], "cidata");
            proptest::prop_assert!(disks[2].get("bootindex").is_none());
            let seed_nodes: Vec<Value> = blockdevs(&args)
                .into_iter()
                .filter(|b| b["node-name"].as_str().is_some_and(|n| n.starts_with("cidata")))
                .collect();
            proptest::prop_assert_eq!(seed_nodes.len(), 2);
            proptest::prop_assert!(seed_nodes.iter().all(|b| b["read-only"] == true));
        }
    }
}
