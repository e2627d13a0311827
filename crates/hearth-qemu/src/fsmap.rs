//! Which guest filesystems live on which of hearth's disks.
//!
//! The guest agent's `guest-get-fsinfo` lists every mounted filesystem with the
//! disks under it: each disk by its serial (when the guest's udev knows it) and by
//! the PCI address of its controller. hearth gives every virtio-blk device a
//! serial naming its VirtualDisk ([`crate::cmdline::disk_serial`]) and can ask
//! QEMU (`query-pci`) where each of its disk devices sits on the PCI bus, so both
//! ways lead back to a device index. [`map_mount_points`] does the matching;
//! it is pure, so every case is a unit test.
//!
//! Everything here comes from the guest or QEMU and is treated as untrusted:
//! counts and string lengths are bounded, odd values are errors or "unknown",
//! never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;
#[cfg(test)]
use serde_json::json;

use crate::cmdline::disk_device_id;
use crate::lines::truncate;
use crate::qmp::QmpError;

/// At most this many filesystems in one `guest-get-fsinfo` reply.
pub const MAX_FILESYSTEMS: usize = 256;
/// At most this many disks under one filesystem.
pub const MAX_DISKS_PER_FS: usize = 64;
/// Longest string field accepted (a mount point is a path: `PATH_MAX`).
pub const MAX_FIELD_LEN: usize = 4096;
/// Deepest PCI bridge nesting followed in `query-pci`.
pub const MAX_PCI_DEPTH: usize = 8;
/// At most this many PCI devices looked at in one `query-pci` reply.
pub const MAX_PCI_DEVICES: usize = 4096;

/// A PCI function address as the guest numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u32,
    pub slot: u32,
    pub function: u32,
}

/// One disk under a guest filesystem (`GuestDiskAddress`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsDisk {
    /// The disk's serial as the guest's udev reports it; `None` when the guest
    /// does not know it (no udev database, for one).
    pub serial: Option<String>,
    /// The guest's device node, e.g. `/dev/vda`.
    pub dev: Option<String>,
    /// `virtio`, `scsi`, `ide`, ... as qemu-ga names the bus.
    pub bus_type: String,
    /// The PCI function of the disk's controller (for virtio-blk: the disk
    /// device itself). `None` when qemu-ga reports none (it uses -1 then).
    pub pci_controller: Option<PciAddress>,
}

/// One mounted guest filesystem (`GuestFilesystemInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsInfo {
    /// The block device name, e.g. `vda` or `dm-0`.
    pub name: String,
    pub mountpoint: String,
    /// Filesystem type, e.g. `ext4`.
    pub fs_type: String,
    /// Every disk the filesystem lies on (several for LVM or md).
    pub disks: Vec<FsDisk>,
}

/// Why a `guest-get-fsinfo` reply was refused. The texts reach a
/// snapshot's status (as the agent's protocol error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FsInfoError {
    /// The reply (truncated) is not a list.
    #[error("not a list: {0}")]
    NotAList(String),
    #[error("{0} filesystems (at most {MAX_FILESYSTEMS} accepted)")]
    TooManyFilesystems(usize),
    /// The `index`th filesystem of the list.
    #[error("filesystem [{index}]: {error}")]
    Filesystem { index: usize, error: EntryError },
}

/// What did not match in one filesystem of a `guest-get-fsinfo` reply, or
/// in one disk under it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// The entry (truncated) is not an object.
    #[error("not an object: {0}")]
    NotAnObject(String),
    #[error("no {0:?} string")]
    Missing(&'static str),
    #[error("{key:?} is {len} bytes (at most {MAX_FIELD_LEN} accepted)")]
    TooLong { key: &'static str, len: usize },
    /// `key` holds this (truncated) instead of a string.
    #[error("{key:?} is not a string: {found}")]
    NotAString { key: &'static str, found: String },
    #[error("{mountpoint:?} lies on {count} disks (at most {MAX_DISKS_PER_FS} accepted)")]
    TooManyDisks { mountpoint: String, count: usize },
    /// `"disk"` holds this (truncated) instead of a list.
    #[error("\"disk\" is not a list: {0}")]
    DisksNotAList(String),
    /// The `index`th disk under the filesystem at `mountpoint`.
    #[error("{mountpoint:?} disk [{index}]: {error}")]
    Disk {
        mountpoint: String,
        index: usize,
        error: Box<EntryError>,
    },
}

/// Parses the `return` value of `guest-get-fsinfo`. Unknown fields are ignored;
/// a reply that is not the documented shape, or exceeds the bounds above, is an
/// error naming what was wrong.
pub fn parse_fsinfo(value: &Value) -> Result<Vec<FsInfo>, FsInfoError> {
    let list = value
        .as_array()
        .ok_or_else(|| FsInfoError::NotAList(truncate(&value.to_string())))?;
    if list.len() > MAX_FILESYSTEMS {
        return Err(FsInfoError::TooManyFilesystems(list.len()));
    }
    list.iter()
        .enumerate()
        .map(|(index, fs)| {
            parse_filesystem(fs).map_err(|error| FsInfoError::Filesystem { index, error })
        })
        .collect()
}

fn parse_filesystem(fs: &Value) -> Result<FsInfo, EntryError> {
    if !fs.is_object() {
        return Err(EntryError::NotAnObject(truncate(&fs.to_string())));
    }
    let mountpoint = required_str(fs, "mountpoint")?;
    let name = required_str(fs, "name")?;
    let fs_type = required_str(fs, "type")?;
    let disks = match fs.get("disk") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(disks)) => {
            if disks.len() > MAX_DISKS_PER_FS {
                return Err(EntryError::TooManyDisks {
                    mountpoint,
                    count: disks.len(),
                });
            }
            disks
                .iter()
                .enumerate()
                .map(|(index, d)| {
                    parse_disk(d).map_err(|error| EntryError::Disk {
                        mountpoint: mountpoint.clone(),
                        index,
                        error: Box::new(error),
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(other) => return Err(EntryError::DisksNotAList(truncate(&other.to_string()))),
    };
    Ok(FsInfo {
        name,
        mountpoint,
        fs_type,
        disks,
    })
}

fn parse_disk(disk: &Value) -> Result<FsDisk, EntryError> {
    if !disk.is_object() {
        return Err(EntryError::NotAnObject(truncate(&disk.to_string())));
    }
    Ok(FsDisk {
        serial: optional_str(disk, "serial")?.filter(|s| !s.is_empty()),
        dev: optional_str(disk, "dev")?,
        bus_type: optional_str(disk, "bus-type")?.unwrap_or_else(|| "unknown".into()),
        pci_controller: disk.get("pci-controller").and_then(|pci| {
            // qemu-ga fills every field with -1 when the disk has no PCI controller.
            let field = |key: &str| pci.get(key)?.as_u64().and_then(|v| u32::try_from(v).ok());
            Some(PciAddress {
                domain: field("domain")?,
                bus: field("bus")?,
                slot: field("slot")?,
                function: field("function")?,
            })
        }),
    })
}

fn required_str(obj: &Value, key: &'static str) -> Result<String, EntryError> {
    optional_str(obj, key)?.ok_or(EntryError::Missing(key))
}

fn optional_str(obj: &Value, key: &'static str) -> Result<Option<String>, EntryError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.len() <= MAX_FIELD_LEN => Ok(Some(s.clone())),
        Some(Value::String(s)) => Err(EntryError::TooLong { key, len: s.len() }),
        Some(other) => Err(EntryError::NotAString {
            key,
            found: truncate(&other.to_string()),
        }),
    }
}

/// The PCI address of each of hearth's disk devices, by device index (the `i`
/// of [`disk_device_id`]), from QEMU's `query-pci`. Indexes with no such
/// device in the reply are absent. QEMU knows only PCI domain 0.
pub async fn disk_pci_addresses<M: crate::seam::Monitor + ?Sized>(
    qmp: &M,
    timeout: Duration,
) -> Result<BTreeMap<usize, PciAddress>, QmpError> {
    let reply = qmp.execute("query-pci", None, timeout).await?;
    parse_query_pci(&reply).map_err(|e| QmpError::Protocol(format!("query-pci: {e}")))
}

/// Why a `query-pci` reply was refused (QMP's protocol error then).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryPciError {
    /// The reply (truncated) is not a list of buses.
    #[error("not a list: {0}")]
    NotAList(String),
    #[error("bridges nested deeper than {MAX_PCI_DEPTH}")]
    TooDeep,
    #[error("more than {MAX_PCI_DEVICES} devices")]
    TooManyDevices,
    /// Disk device `index` has no `key` that fits a `u32`.
    #[error("{} has no valid {key:?}", disk_device_id(*index))]
    NoValidField { index: usize, key: &'static str },
    /// Disk device `index` is listed twice.
    #[error("{} appears twice", disk_device_id(*index))]
    Twice { index: usize },
}

/// The pure half of [`disk_pci_addresses`]: finds every device whose `qdev_id`
/// is `vdisk<i>`, following `pci_bridge.devices` into bridges.
pub fn parse_query_pci(reply: &Value) -> Result<BTreeMap<usize, PciAddress>, QueryPciError> {
    let buses = reply
        .as_array()
        .ok_or_else(|| QueryPciError::NotAList(truncate(&reply.to_string())))?;
    let mut found = BTreeMap::new();
    let mut budget = MAX_PCI_DEVICES;
    for bus in buses {
        let devices = bus.get("devices").unwrap_or(&Value::Null);
        collect_disks(devices, 0, &mut budget, &mut found)?;
    }
    Ok(found)
}

fn collect_disks(
    devices: &Value,
    depth: usize,
    budget: &mut usize,
    found: &mut BTreeMap<usize, PciAddress>,
) -> Result<(), QueryPciError> {
    let Some(devices) = devices.as_array() else {
        return Ok(());
    };
    if depth > MAX_PCI_DEPTH {
        return Err(QueryPciError::TooDeep);
    }
    for device in devices {
        *budget = budget.checked_sub(1).ok_or(QueryPciError::TooManyDevices)?;
        if let Some(index) = device
            .get("qdev_id")
            .and_then(Value::as_str)
            .and_then(disk_index_of)
        {
            let field = |key: &'static str| {
                device
                    .get(key)
                    .and_then(Value::as_u64)
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or(QueryPciError::NoValidField { index, key })
            };
            let address = PciAddress {
                domain: 0,
                bus: field("bus")?,
                slot: field("slot")?,
                function: field("function")?,
            };
            if found.insert(index, address).is_some() {
                return Err(QueryPciError::Twice { index });
            }
        }
        if let Some(inner) = device.get("pci_bridge").and_then(|b| b.get("devices")) {
            collect_disks(inner, depth + 1, budget, found)?;
        }
    }
    Ok(())
}

/// `vdisk<i>` -> `i`, only for ids [`disk_device_id`] can produce.
fn disk_index_of(qdev_id: &str) -> Option<usize> {
    let digits = qdev_id.strip_prefix("vdisk")?;
    let index: usize = digits.parse().ok()?;
    (disk_device_id(index) == qdev_id).then_some(index)
}

/// What [`map_mount_points`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountMap {
    /// For each device index, the sorted mount points of the filesystems that
    /// lie wholly or partly on that disk.
    pub by_disk: Vec<Vec<String>>,
    /// Sorted mount points the agent reported none of whose disks is one of
    /// hearth's (no serial match and no PCI match, or no disk at all).
    pub unmapped: Vec<String>,
}

/// Ties each guest filesystem to hearth's disks. `serials[i]` is the serial
/// device `i` was started with (empty: none); `pci[&i]` its PCI address.
///
/// A disk of a filesystem is matched by serial first (only a serial exactly
/// one device has counts), then by the PCI address of its controller (domain,
/// bus, slot, function). A filesystem on several disks (LVM, md) is listed
/// under each of them.
pub fn map_mount_points(
    fsinfo: &[FsInfo],
    serials: &[String],
    pci: &BTreeMap<usize, PciAddress>,
) -> MountMap {
    let mut by_serial: BTreeMap<&str, Option<usize>> = BTreeMap::new();
    for (i, serial) in serials.iter().enumerate() {
        if serial.is_empty() {
            continue;
        }
        by_serial
            .entry(serial.as_str())
            .and_modify(|e| *e = None) // two devices, one serial: ambiguous
            .or_insert(Some(i));
    }
    let mut by_pci: BTreeMap<PciAddress, Option<usize>> = BTreeMap::new();
    for (&i, &address) in pci.iter().filter(|(i, _)| **i < serials.len()) {
        by_pci
            .entry(address)
            .and_modify(|e| *e = None)
            .or_insert(Some(i));
    }
    let device_of = |disk: &FsDisk| -> Option<usize> {
        let by_serial = disk
            .serial
            .as_deref()
            .and_then(|s| by_serial.get(s).copied().flatten());
        by_serial.or_else(|| {
            disk.pci_controller
                .and_then(|a| by_pci.get(&a).copied().flatten())
        })
    };

    let mut by_disk: Vec<BTreeSet<&str>> = vec![BTreeSet::new(); serials.len()];
    let mut unmapped = BTreeSet::new();
    for fs in fsinfo {
        let mut mapped = false;
        for index in fs.disks.iter().filter_map(device_of) {
            by_disk[index].insert(fs.mountpoint.as_str());
            mapped = true;
        }
        if !mapped {
            unmapped.insert(fs.mountpoint.as_str());
        }
    }
    let owned = |set: BTreeSet<&str>| set.into_iter().map(str::to_owned).collect();
    MountMap {
        by_disk: by_disk.into_iter().map(owned).collect(),
        unmapped: owned(unmapped),
    }
}

/// One `guest-get-fsinfo` entry as qemu-ga writes it, for tests.
#[cfg(test)]
pub(crate) fn fsinfo_json(
    mountpoint: &str,
    name: &str,
    disks: &[(Option<&str>, PciAddress)],
) -> Value {
    json!({
        "name": name,
        "mountpoint": mountpoint,
        "type": "ext4",
        "disk": disks.iter().map(|(serial, pci)| {
            let mut disk = json!({
                "bus-type": "virtio",
                "bus": 0, "target": 0, "unit": 0,
                "pci-controller": {
                    "domain": pci.domain, "bus": pci.bus,
                    "slot": pci.slot, "function": pci.function,
                },
            });
            if let Some(serial) = serial {
                disk["serial"] = json!(serial);
            }
            disk
        }).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pci(bus: u32, slot: u32) -> PciAddress {
        PciAddress {
            domain: 0,
            bus,
            slot,
            function: 0,
        }
    }

    fn fs(mountpoint: &str, disks: &[(Option<&str>, PciAddress)]) -> FsInfo {
        let value = fsinfo_json(mountpoint, "vdx", disks);
        parse_filesystem(&value).expect("well-formed entry")
    }

    fn serials(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn strings(list: &[&str]) -> Vec<String> {
        serials(list)
    }

    /// What qemu-ga 10.0 answers on a q35 guest with two virtio disks.
    fn real_shaped_reply() -> Value {
        serde_json::from_str(
            r#"[{"name": "vdb", "total-bytes-privileged": 60268544, "type": "ext4",
                 "used-bytes": 24576, "total-bytes": 55025664, "mountpoint": "/mnt/vdb",
                 "disk": [{"serial": "data", "bus-type": "virtio", "bus": 0, "unit": 0,
                           "pci-controller": {"bus": 0, "slot": 3, "domain": 0, "function": 0},
                           "dev": "/dev/vdb", "target": 0, "future-field": [1, 2]}]},
                {"name": "vda", "type": "ext4", "mountpoint": "/data",
                 "disk": [{"bus-type": "virtio", "bus": 0, "unit": 0, "target": 0,
                           "pci-controller": {"bus": 0, "slot": 2, "domain": 0, "function": 0},
                           "dev": "/dev/vda"}]},
                {"name": "sda1", "type": "vfat", "mountpoint": "/boot/efi",
                 "disk": [{"bus-type": "usb", "bus": 0, "unit": 0, "target": 0,
                           "pci-controller": {"bus": -1, "slot": -1, "domain": -1, "function": -1}}]}]"#,
        )
        .expect("test JSON")
    }

    #[test]
    fn parses_the_fields_hearth_uses_and_ignores_the_rest() {
        let list = parse_fsinfo(&real_shaped_reply()).expect("parse");
        assert_eq!(list.len(), 3);
        assert_eq!(
            list[0],
            FsInfo {
                name: "vdb".into(),
                mountpoint: "/mnt/vdb".into(),
                fs_type: "ext4".into(),
                disks: vec![FsDisk {
                    serial: Some("data".into()),
                    dev: Some("/dev/vdb".into()),
                    bus_type: "virtio".into(),
                    pci_controller: Some(pci(0, 3)),
                }],
            }
        );
        assert_eq!(list[1].disks[0].serial, None);
        assert_eq!(list[1].disks[0].pci_controller, Some(pci(0, 2)));
        // -1 everywhere means "no PCI controller", not a huge bus number.
        assert_eq!(list[2].disks[0].pci_controller, None);
        assert_eq!(list[2].disks[0].dev, None);
        assert_eq!(list[2].disks[0].bus_type, "usb");
    }

    #[test]
    fn empty_serial_counts_as_none_and_missing_disk_list_as_empty() {
        let value = serde_json::json!([
            {"name": "vda", "type": "ext4", "mountpoint": "/",
             "disk": [{"serial": "", "bus-type": "virtio"}]},
            {"name": "dm-0", "type": "xfs", "mountpoint": "/srv"},
        ]);
        let list = parse_fsinfo(&value).expect("parse");
        assert_eq!(list[0].disks[0].serial, None);
        assert_eq!(list[0].disks[0].pci_controller, None);
        assert!(list[1].disks.is_empty());
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        let long = "x".repeat(MAX_FIELD_LEN + 1);
        let cases = [
            serde_json::json!({"not": "a list"}),
            serde_json::json!([1]),
            serde_json::json!([{"name": "vda", "type": "ext4"}]),
            serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": 7}]),
            serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": long}]),
            serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": "/", "disk": {}}]),
            serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": "/", "disk": ["x"]}]),
            serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": "/",
                                "disk": [{"serial": 12}]}]),
        ];
        for case in cases {
            assert!(parse_fsinfo(&case).is_err(), "accepted {case}");
        }
        // Odd PCI numbers are "unknown", not an error.
        let odd = serde_json::json!([{"name": "vda", "type": "ext4", "mountpoint": "/",
            "disk": [{"pci-controller": {"domain": 0, "bus": "0", "slot": 1.5,
                                         "function": 99999999999u64}}]}]);
        let list = parse_fsinfo(&odd).expect("parse");
        assert_eq!(list[0].disks[0].pci_controller, None);
    }

    #[test]
    fn counts_are_bounded() {
        let one = fsinfo_json("/m", "vda", &[(None, pci(0, 2))]);
        let many = Value::Array(vec![one.clone(); MAX_FILESYSTEMS + 1]);
        let err = parse_fsinfo(&many)
            .expect_err("too many filesystems")
            .to_string();
        assert!(err.contains("257 filesystems"), "{err}");
        assert_eq!(
            parse_fsinfo(&Value::Array(vec![one; MAX_FILESYSTEMS]))
                .expect("at the bound")
                .len(),
            MAX_FILESYSTEMS
        );
        let disks = vec![(None, pci(0, 2)); MAX_DISKS_PER_FS + 1];
        let wide = Value::Array(vec![fsinfo_json("/lvm", "dm-0", &disks)]);
        let err = parse_fsinfo(&wide).expect_err("too many disks").to_string();
        assert!(err.contains("65 disks"), "{err}");
    }

    #[test]
    fn serial_match_maps_each_filesystem_to_its_disk() {
        let list = vec![
            fs("/mnt/vdb", &[(Some("data"), pci(0, 9))]),
            fs("/", &[(Some("root"), pci(0, 8))]),
            fs("/data", &[(Some("root"), pci(0, 8))]),
        ];
        // PCI addresses that would say otherwise: the serial wins.
        let addresses = BTreeMap::from([(0, pci(0, 9)), (1, pci(0, 8))]);
        let map = map_mount_points(&list, &serials(&["root", "data"]), &addresses);
        assert_eq!(
            map.by_disk,
            vec![strings(&["/", "/data"]), strings(&["/mnt/vdb"])]
        );
        assert!(map.unmapped.is_empty());
    }

    #[test]
    fn without_serials_the_pci_address_decides() {
        let list = vec![
            fs("/mnt/vda", &[(None, pci(0, 2))]),
            fs("/data", &[(None, pci(0, 2))]),
            fs("/mnt/vdb", &[(None, pci(0, 3))]),
        ];
        let addresses = BTreeMap::from([(0, pci(0, 2)), (1, pci(0, 3))]);
        let map = map_mount_points(&list, &serials(&["root", "data"]), &addresses);
        assert_eq!(
            map.by_disk,
            vec![strings(&["/data", "/mnt/vda"]), strings(&["/mnt/vdb"])]
        );
        assert!(map.unmapped.is_empty());
    }

    #[test]
    fn an_unknown_serial_falls_back_to_the_pci_address() {
        let list = vec![fs("/", &[(Some("QM00001"), pci(0, 2))])];
        let addresses = BTreeMap::from([(0, pci(0, 2))]);
        let map = map_mount_points(&list, &serials(&["root"]), &addresses);
        assert_eq!(map.by_disk, vec![strings(&["/"])]);
    }

    #[test]
    fn pci_matching_needs_domain_bus_slot_and_function() {
        let addresses = BTreeMap::from([(0, pci(0, 2))]);
        for other in [
            PciAddress {
                domain: 1,
                ..pci(0, 2)
            },
            pci(1, 2),
            pci(0, 3),
            PciAddress {
                function: 1,
                ..pci(0, 2)
            },
        ] {
            let list = vec![fs("/m", &[(None, other)])];
            let map = map_mount_points(&list, &serials(&["root"]), &addresses);
            assert_eq!(map.by_disk, vec![Vec::<String>::new()], "{other:?}");
            assert_eq!(map.unmapped, strings(&["/m"]), "{other:?}");
        }
    }

    #[test]
    fn a_filesystem_on_several_disks_maps_to_each() {
        let list = vec![
            fs("/srv", &[(Some("a"), pci(0, 2)), (None, pci(0, 4))]),
            fs("/", &[(Some("b"), pci(0, 3))]),
        ];
        let addresses = BTreeMap::from([(0, pci(0, 2)), (1, pci(0, 3)), (2, pci(0, 4))]);
        let map = map_mount_points(&list, &serials(&["a", "b", "c"]), &addresses);
        assert_eq!(
            map.by_disk,
            vec![strings(&["/srv"]), strings(&["/"]), strings(&["/srv"])]
        );
        assert!(map.unmapped.is_empty());
    }

    #[test]
    fn filesystems_on_no_hearth_disk_are_listed_as_unmapped() {
        let list = vec![
            fs("/mnt/usb", &[(Some("USB123"), pci(0, 7))]),
            fs("/boot", &[]),
            fs("/", &[(None, pci(0, 2))]),
            // Partly on a hearth disk: mapped, not unmapped.
            fs(
                "/mixed",
                &[(Some("elsewhere"), pci(0, 7)), (Some("root"), pci(0, 2))],
            ),
        ];
        let addresses = BTreeMap::from([(0, pci(0, 2))]);
        let map = map_mount_points(&list, &serials(&["root"]), &addresses);
        assert_eq!(map.by_disk, vec![strings(&["/", "/mixed"])]);
        assert_eq!(map.unmapped, strings(&["/boot", "/mnt/usb"]));
    }

    #[test]
    fn ambiguous_serials_and_addresses_match_nothing() {
        // Two devices with one serial: the serial says nothing, PCI still does.
        let list = vec![
            fs("/a", &[(Some("same"), pci(0, 2))]),
            fs("/b", &[(Some("same"), pci(0, 9))]),
        ];
        let addresses = BTreeMap::from([(0, pci(0, 2)), (1, pci(0, 3))]);
        let map = map_mount_points(&list, &serials(&["same", "same"]), &addresses);
        assert_eq!(map.by_disk, vec![strings(&["/a"]), Vec::<String>::new()]);
        assert_eq!(map.unmapped, strings(&["/b"]));
        // Two devices at one address (a bad reply): nothing matches by PCI.
        let list = vec![fs("/a", &[(None, pci(0, 2))])];
        let addresses = BTreeMap::from([(0, pci(0, 2)), (1, pci(0, 2))]);
        let map = map_mount_points(&list, &serials(&["", ""]), &addresses);
        assert_eq!(map.by_disk, vec![Vec::<String>::new(), Vec::new()]);
        assert_eq!(map.unmapped, strings(&["/a"]));
        // An empty serial on a device never matches a disk without one.
        let list = vec![FsInfo {
            name: "vda".into(),
            mountpoint: "/".into(),
            fs_type: "ext4".into(),
            disks: vec![FsDisk {
                serial: Some(String::new()),
                dev: None,
                bus_type: "virtio".into(),
                pci_controller: None,
            }],
        }];
        let map = map_mount_points(&list, &serials(&[""]), &BTreeMap::new());
        assert_eq!(map.unmapped, strings(&["/"]));
    }

    #[test]
    fn pci_addresses_of_devices_past_the_disk_list_are_ignored() {
        let list = vec![fs("/x", &[(None, pci(0, 5))])];
        let addresses = BTreeMap::from([(3, pci(0, 5))]);
        let map = map_mount_points(&list, &serials(&["a"]), &addresses);
        assert_eq!(map.by_disk, vec![Vec::<String>::new()]);
        assert_eq!(map.unmapped, strings(&["/x"]));
    }

    #[test]
    fn query_pci_finds_disks_on_bus_zero_and_behind_bridges() {
        let reply: Value = serde_json::from_str(
            r#"[{"bus": 0, "devices": [
                 {"bus": 0, "slot": 0, "function": 0, "class_info": {"class": 1536},
                  "qdev_id": "", "id": {"device": 10688, "vendor": 32902}},
                 {"bus": 0, "slot": 2, "function": 0, "qdev_id": "vdisk0",
                  "regions": [], "irq": 10},
                 {"bus": 0, "slot": 3, "function": 0, "qdev_id": "vdisk01"},
                 {"bus": 0, "slot": 4, "function": 0, "qdev_id": "vser0"},
                 {"bus": 0, "slot": 30, "function": 0, "qdev_id": "br0",
                  "pci_bridge": {"bus": {"number": 1, "secondary": 1, "subordinate": 1},
                                 "devices": [
                     {"bus": 1, "slot": 1, "function": 0, "qdev_id": "vdisk1"},
                     {"bus": 1, "slot": 1, "function": 1, "qdev_id": "vdisk2"}]}}]}]"#,
        )
        .expect("test JSON");
        let found = parse_query_pci(&reply).expect("parse");
        assert_eq!(
            found,
            BTreeMap::from([
                (0, pci(0, 2)),
                (1, pci(1, 1)),
                (
                    2,
                    PciAddress {
                        function: 1,
                        ..pci(1, 1)
                    }
                ),
            ])
        );
    }

    #[test]
    fn query_pci_oddities_are_errors_or_skipped_never_panics() {
        assert!(parse_query_pci(&serde_json::json!({})).is_err());
        assert!(
            parse_query_pci(&serde_json::json!([{"bus": 0}]))
                .expect("no devices")
                .is_empty()
        );
        let bad_slot = serde_json::json!([{"devices": [
            {"bus": 0, "slot": -1, "function": 0, "qdev_id": "vdisk0"}]}]);
        assert!(parse_query_pci(&bad_slot).is_err());
        let twice = serde_json::json!([{"devices": [
            {"bus": 0, "slot": 2, "function": 0, "qdev_id": "vdisk0"},
            {"bus": 0, "slot": 3, "function": 0, "qdev_id": "vdisk0"}]}]);
        assert!(parse_query_pci(&twice).is_err());
        // A bridge chain deeper than the bound.
        let mut devices = serde_json::json!([{"bus": 9, "slot": 1, "function": 0,
                                               "qdev_id": "vdisk0"}]);
        for _ in 0..=MAX_PCI_DEPTH + 1 {
            devices = serde_json::json!([{"bus": 0, "slot": 1, "function": 0,
                                          "pci_bridge": {"devices": devices}}]);
        }
        let deep = serde_json::json!([{"devices": devices}]);
        assert!(parse_query_pci(&deep).is_err());
        // Too many devices.
        let one = serde_json::json!({"bus": 0, "slot": 1, "function": 0, "qdev_id": "x"});
        let many = serde_json::json!([{"devices": vec![one; MAX_PCI_DEVICES + 1]}]);
        assert!(parse_query_pci(&many).is_err());
    }

    /// The texts reach users (a snapshot's status, as the agent's or QMP's
    /// protocol error): each case reads as it always has.
    #[test]
    fn each_error_names_what_did_not_match() {
        let long = "x".repeat(MAX_FIELD_LEN + 1);
        let one = fsinfo_json("/m", "vda", &[(None, pci(0, 2))]);
        let fsinfo_cases = [
            (json!({"not": "a list"}), r#"not a list: {"not":"a list"}"#),
            (
                Value::Array(vec![one; MAX_FILESYSTEMS + 1]),
                "257 filesystems (at most 256 accepted)",
            ),
            (json!([1]), "filesystem [0]: not an object: 1"),
            (
                json!([{"name": "vda", "type": "ext4"}]),
                r#"filesystem [0]: no "mountpoint" string"#,
            ),
            (
                json!([{"name": "vda", "type": "ext4", "mountpoint": 7}]),
                r#"filesystem [0]: "mountpoint" is not a string: 7"#,
            ),
            (
                json!([{"name": "vda", "type": "ext4", "mountpoint": long}]),
                r#"filesystem [0]: "mountpoint" is 4097 bytes (at most 4096 accepted)"#,
            ),
            (
                json!([{"name": "vda", "type": "ext4", "mountpoint": "/", "disk": {}}]),
                r#"filesystem [0]: "disk" is not a list: {}"#,
            ),
            (
                Value::Array(vec![fsinfo_json(
                    "/lvm",
                    "dm-0",
                    &vec![(None, pci(0, 2)); MAX_DISKS_PER_FS + 1],
                )]),
                r#"filesystem [0]: "/lvm" lies on 65 disks (at most 64 accepted)"#,
            ),
            (
                json!([{"name": "vda", "type": "ext4", "mountpoint": "/", "disk": ["x"]}]),
                r#"filesystem [0]: "/" disk [0]: not an object: "x""#,
            ),
            (
                json!([{"name": "vda", "type": "ext4", "mountpoint": "/",
                        "disk": [{}, {"serial": 12}]}]),
                r#"filesystem [0]: "/" disk [1]: "serial" is not a string: 12"#,
            ),
        ];
        for (case, text) in fsinfo_cases {
            let err = parse_fsinfo(&case).expect_err("malformed");
            assert_eq!(err.to_string(), text);
        }

        let device =
            |slot: i64, id: &str| json!({"bus": 0, "slot": slot, "function": 0, "qdev_id": id});
        let mut deep = json!([device(1, "vdisk0")]);
        for _ in 0..=MAX_PCI_DEPTH + 1 {
            deep = json!([{"bus": 0, "slot": 1, "function": 0, "pci_bridge": {"devices": deep}}]);
        }
        let pci_cases = [
            (json!({}), "not a list: {}"),
            (
                json!([{"devices": [device(-1, "vdisk3")]}]),
                r#"vdisk3 has no valid "slot""#,
            ),
            (
                json!([{"devices": [device(2, "vdisk0"), device(3, "vdisk0")]}]),
                "vdisk0 appears twice",
            ),
            (json!([{"devices": deep}]), "bridges nested deeper than 8"),
            (
                json!([{"devices": vec![device(1, "x"); MAX_PCI_DEVICES + 1]}]),
                "more than 4096 devices",
            ),
        ];
        for (case, text) in pci_cases {
            let err = parse_query_pci(&case).expect_err("malformed");
            assert_eq!(err.to_string(), text);
        }
    }

    #[test]
    fn only_ids_hearth_makes_count_as_disk_devices() {
        assert_eq!(disk_index_of("vdisk0"), Some(0));
        assert_eq!(disk_index_of("vdisk12"), Some(12));
        for other in [
            "vdisk", "vdisk01", "vdisk-1", "vdisk+1", "xvdisk0", "vdisk0 ", "",
        ] {
            assert_eq!(disk_index_of(other), None, "{other:?}");
        }
    }

    #[test]
    fn the_seed_device_maps_to_no_disk_and_moves_none_of_them() {
        // query-pci of a VM with two disks and the cloud-init seed after them.
        let reply = serde_json::json!([{"bus": 0, "devices": [
            {"bus": 0, "slot": 1, "function": 0, "qdev_id": "vdisk0"},
            {"bus": 0, "slot": 2, "function": 0, "qdev_id": "vdisk1"},
            {"bus": 0, "slot": 3, "function": 0, "qdev_id": crate::cmdline::SEED_DEVICE_ID},
            {"bus": 0, "slot": 4, "function": 0, "qdev_id": "vser0"}]}]);
        let pci_map = parse_query_pci(&reply).expect("parse");
        assert_eq!(
            pci_map,
            BTreeMap::from([(0, pci(0, 1)), (1, pci(0, 2))]),
            "only the disks, at their own slots"
        );
        // A guest that still has the seed mounted (cloud-init unmounts it).
        let fsinfo = [
            fs("/", &[(Some("root"), pci(0, 1))]),
            fs("/data", &[(None, pci(0, 2))]),
            fs("/mnt/cidata", &[(None, pci(0, 3))]),
        ];
        let map = map_mount_points(&fsinfo, &serials(&["root", "data"]), &pci_map);
        assert_eq!(map.by_disk, vec![strings(&["/"]), strings(&["/data"])]);
        assert_eq!(map.unmapped, strings(&["/mnt/cidata"]));
    }
}
