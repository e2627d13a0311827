//! Any object, parsed from YAML or JSON documents, and validated.

use std::collections::HashSet;
use std::fmt;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::kinds::{
    CloudInit, DiskSource, ImageSource, Kind, MAX_CLOUD_INIT_TEXT, MAX_DISK_BYTES, MAX_DISK_FILES,
    MAX_FREEZE_DEADLINE_SECONDS, MAX_INTERFACES, MIN_DISK_BYTES, MIN_FREEZE_DEADLINE_SECONDS,
    NetworkInterface, NetworkMode, OciSource, VirtualDisk, VirtualDiskSnapshot, VirtualDiskSpec,
    VirtualImage, VirtualMachine, VirtualMachineBackup, VirtualMachineSnapshot,
    VirtualMachineSnapshotGroup, VirtualMachineSnapshotSchedule, VirtualNetwork,
    VirtualNetworkSpec,
};
use crate::limits::{self, LimitError, MAX_APPLY_OBJECTS};
use crate::meta::API_VERSION;
use crate::net;

/// Every kind hearth knows, as one value. Read back by its `kind` field
/// (never by trying each kind in turn, which could take one for another).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Object {
    VirtualMachine(VirtualMachine),
    VirtualDisk(VirtualDisk),
    VirtualDiskSnapshot(VirtualDiskSnapshot),
    VirtualMachineSnapshot(VirtualMachineSnapshot),
    VirtualMachineSnapshotGroup(VirtualMachineSnapshotGroup),
    VirtualMachineSnapshotSchedule(VirtualMachineSnapshotSchedule),
    VirtualMachineBackup(VirtualMachineBackup),
    VirtualImage(VirtualImage),
    VirtualNetwork(VirtualNetwork),
}

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let value = Value::deserialize(d)?;
        let kind = value
            .get("kind")
            .and_then(Value::as_str)
            .and_then(|k| Kind::ALL.into_iter().find(|x| x.as_str() == k))
            .ok_or_else(|| D::Error::custom("missing or unknown `kind`"))?;
        let r = match kind {
            Kind::VirtualMachine => serde_json::from_value(value).map(Object::VirtualMachine),
            Kind::VirtualDisk => serde_json::from_value(value).map(Object::VirtualDisk),
            Kind::VirtualDiskSnapshot => {
                serde_json::from_value(value).map(Object::VirtualDiskSnapshot)
            }
            Kind::VirtualMachineSnapshot => {
                serde_json::from_value(value).map(Object::VirtualMachineSnapshot)
            }
            Kind::VirtualMachineSnapshotGroup => {
                serde_json::from_value(value).map(Object::VirtualMachineSnapshotGroup)
            }
            Kind::VirtualMachineSnapshotSchedule => {
                serde_json::from_value(value).map(Object::VirtualMachineSnapshotSchedule)
            }
            Kind::VirtualMachineBackup => {
                serde_json::from_value(value).map(Object::VirtualMachineBackup)
            }
            Kind::VirtualImage => serde_json::from_value(value).map(Object::VirtualImage),
            Kind::VirtualNetwork => serde_json::from_value(value).map(Object::VirtualNetwork),
        };
        r.map_err(D::Error::custom)
    }
}

/// A problem with one object, naming the field so a person can fix it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{object}: {field}: {message}")]
pub struct FieldError {
    /// `VirtualMachine "demo"`, or `document 2` when the name is not known yet.
    pub object: String,
    /// The field path, such as `spec.memory` or `spec.disks[1].virtualDiskName`.
    pub field: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("{origin}: line {line}, column {column}: {message}")]
    Syntax {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// Over one of the [`limits`](crate::limits): not parsed at all.
    #[error("{origin}: {error}")]
    Limit { origin: String, error: LimitError },
    #[error("{origin}: {error}")]
    Invalid { origin: String, error: FieldError },
}

impl ParseError {
    pub fn origin(&self) -> &str {
        match self {
            ParseError::Syntax { origin, .. }
            | ParseError::Limit { origin, .. }
            | ParseError::Invalid { origin, .. } => origin,
        }
    }
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::VirtualMachine(_) => Kind::VirtualMachine,
            Object::VirtualDisk(_) => Kind::VirtualDisk,
            Object::VirtualDiskSnapshot(_) => Kind::VirtualDiskSnapshot,
            Object::VirtualMachineSnapshot(_) => Kind::VirtualMachineSnapshot,
            Object::VirtualMachineSnapshotGroup(_) => Kind::VirtualMachineSnapshotGroup,
            Object::VirtualMachineSnapshotSchedule(_) => Kind::VirtualMachineSnapshotSchedule,
            Object::VirtualMachineBackup(_) => Kind::VirtualMachineBackup,
            Object::VirtualImage(_) => Kind::VirtualImage,
            Object::VirtualNetwork(_) => Kind::VirtualNetwork,
        }
    }

    pub fn name(&self) -> &str {
        &self.metadata().name
    }

    pub fn metadata(&self) -> &crate::ObjectMeta {
        match self {
            Object::VirtualMachine(o) => &o.metadata,
            Object::VirtualDisk(o) => &o.metadata,
            Object::VirtualDiskSnapshot(o) => &o.metadata,
            Object::VirtualMachineSnapshot(o) => &o.metadata,
            Object::VirtualMachineSnapshotGroup(o) => &o.metadata,
            Object::VirtualMachineSnapshotSchedule(o) => &o.metadata,
            Object::VirtualMachineBackup(o) => &o.metadata,
            Object::VirtualImage(o) => &o.metadata,
            Object::VirtualNetwork(o) => &o.metadata,
        }
    }

    pub fn metadata_mut(&mut self) -> &mut crate::ObjectMeta {
        match self {
            Object::VirtualMachine(o) => &mut o.metadata,
            Object::VirtualDisk(o) => &mut o.metadata,
            Object::VirtualDiskSnapshot(o) => &mut o.metadata,
            Object::VirtualMachineSnapshot(o) => &mut o.metadata,
            Object::VirtualMachineSnapshotGroup(o) => &mut o.metadata,
            Object::VirtualMachineSnapshotSchedule(o) => &mut o.metadata,
            Object::VirtualMachineBackup(o) => &mut o.metadata,
            Object::VirtualImage(o) => &mut o.metadata,
            Object::VirtualNetwork(o) => &mut o.metadata,
        }
    }

    /// `VirtualMachine "demo"`: how errors and events name an object.
    pub fn display_name(&self) -> String {
        format!("{} {:?}", self.kind(), self.name())
    }

    /// The spec alone as JSON, to tell a real change from a re-apply.
    pub fn spec_json(&self) -> Value {
        match self {
            Object::VirtualMachine(o) => serde_json::to_value(&o.spec),
            Object::VirtualDisk(o) => serde_json::to_value(&o.spec),
            Object::VirtualDiskSnapshot(o) => serde_json::to_value(&o.spec),
            Object::VirtualMachineSnapshot(o) => serde_json::to_value(&o.spec),
            Object::VirtualMachineSnapshotGroup(o) => serde_json::to_value(&o.spec),
            Object::VirtualMachineSnapshotSchedule(o) => serde_json::to_value(&o.spec),
            Object::VirtualMachineBackup(o) => serde_json::to_value(&o.spec),
            Object::VirtualImage(o) => serde_json::to_value(&o.spec),
            Object::VirtualNetwork(o) => serde_json::to_value(&o.spec),
        }
        .unwrap_or(Value::Null)
    }

    /// Drops what only hearthd may write, so user input never sets it.
    pub fn strip_server_fields(&mut self) {
        match self {
            Object::VirtualMachine(o) => o.status = None,
            Object::VirtualDisk(o) => o.status = None,
            Object::VirtualDiskSnapshot(o) => o.status = None,
            Object::VirtualMachineSnapshot(o) => o.status = None,
            Object::VirtualMachineSnapshotGroup(o) => o.status = None,
            Object::VirtualMachineSnapshotSchedule(o) => o.status = None,
            Object::VirtualMachineBackup(o) => o.status = None,
            Object::VirtualImage(o) => o.status = None,
            Object::VirtualNetwork(o) => o.status = None,
        }
        let m = self.metadata_mut();
        m.creation_timestamp = None;
        m.generation = 0;
        m.managed_by = None;
    }

    /// Checks everything that can be checked without looking at the host.
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = |field: &str, message: String| FieldError {
            object: self.display_name(),
            field: field.to_string(),
            message,
        };
        let meta = self.metadata();
        if let Err(why) = check_dns_label(&meta.name) {
            return Err(err("metadata.name", why));
        }
        if meta.labels.len() > crate::meta::MAX_LABELS {
            return Err(err(
                "metadata.labels",
                format!(
                    "{} labels; at most {}",
                    meta.labels.len(),
                    crate::meta::MAX_LABELS
                ),
            ));
        }
        for (k, v) in &meta.labels {
            crate::meta::check_label_key(k).map_err(|m| err("metadata.labels", m))?;
            crate::meta::check_label_value(v)
                .map_err(|m| err(&format!("metadata.labels.{k}"), m))?;
        }
        match self {
            Object::VirtualMachine(vm) => {
                check_header(&vm.api_version, &vm.kind, Kind::VirtualMachine)
                    .map_err(|(f, m)| err(f, m))?;
                let s = &vm.spec;
                if !(1..=64).contains(&s.cpus) {
                    return Err(err(
                        "spec.cpus",
                        format!("{} is out of range 1..64", s.cpus),
                    ));
                }
                let mem = s.memory.bytes();
                if !((32 << 20)..=(1 << 40)).contains(&mem) {
                    return Err(err(
                        "spec.memory",
                        format!("{} is out of range 32Mi..1Ti", s.memory),
                    ));
                }
                if mem % (1 << 20) != 0 {
                    return Err(err(
                        "spec.memory",
                        format!("{} is not a whole number of MiB", s.memory),
                    ));
                }
                match &s.boot {
                    Some(boot) => {
                        if let Some(kernel) = &boot.kernel {
                            check_host_path(kernel).map_err(|m| err("spec.boot.kernel", m))?;
                        }
                        if let Some(image) = &boot.kernel_image {
                            if boot.kernel.is_some() {
                                return Err(err(
                                    "spec.boot.kernelImage",
                                    "give spec.boot.kernel or spec.boot.kernelImage, not both"
                                        .into(),
                                ));
                            }
                            check_dns_label(image).map_err(|m| err("spec.boot.kernelImage", m))?;
                        }
                        if let Some(initrd) = &boot.initrd {
                            if boot.kernel.is_none() {
                                return Err(err(
                                    "spec.boot.initrd",
                                    "only with spec.boot.kernel (a kernel from an image brings its own initrd)".into(),
                                ));
                            }
                            check_host_path(initrd).map_err(|m| err("spec.boot.initrd", m))?;
                        }
                        if boot.kernel.is_none() && s.disks.is_empty() {
                            return Err(err(
                                "spec.disks",
                                "without spec.boot.kernel the VM boots a kernel from an image onto its first disk; list at least one disk".into(),
                            ));
                        }
                        if boot.cmdline.len() > 4096 {
                            return Err(err("spec.boot.cmdline", "longer than 4096 bytes".into()));
                        }
                        if boot.cmdline.contains('\0') {
                            return Err(err("spec.boot.cmdline", "contains a NUL byte".into()));
                        }
                    }
                    None if s.disks.is_empty() => {
                        return Err(err(
                            "spec.disks",
                            "a VM without spec.boot boots from its first disk through its firmware; list at least one disk (or give spec.boot.kernel)".into(),
                        ));
                    }
                    None => {}
                }
                if let Some(ci) = &s.cloud_init {
                    check_cloud_init(ci).map_err(|(f, m)| err(&f, m))?;
                }
                check_interfaces(&s.networks).map_err(|(f, m)| err(&f, m))?;
                if s.disks.len() > 16 {
                    return Err(err("spec.disks", "more than 16 disks".into()));
                }
                let mut seen = HashSet::new();
                for (i, d) in s.disks.iter().enumerate() {
                    let field = format!("spec.disks[{i}].virtualDiskName");
                    check_dns_label(&d.virtual_disk_name).map_err(|m| err(&field, m))?;
                    if !seen.insert(&d.virtual_disk_name) {
                        return Err(err(
                            &field,
                            format!("disk {:?} is listed twice", d.virtual_disk_name),
                        ));
                    }
                }
                if !(MIN_FREEZE_DEADLINE_SECONDS..=MAX_FREEZE_DEADLINE_SECONDS)
                    .contains(&s.freeze_deadline_seconds)
                {
                    return Err(err(
                        "spec.freezeDeadlineSeconds",
                        format!(
                            "{} is out of range {MIN_FREEZE_DEADLINE_SECONDS}..{MAX_FREEZE_DEADLINE_SECONDS} (seconds): the freeze, its status read and the 2 s disk switch must fit inside it",
                            s.freeze_deadline_seconds
                        ),
                    ));
                }
                if s.stop_timeout_seconds > 3600 {
                    return Err(err(
                        "spec.stopTimeoutSeconds",
                        "more than 3600 seconds".into(),
                    ));
                }
            }
            Object::VirtualDisk(d) => {
                check_header(&d.api_version, &d.kind, Kind::VirtualDisk)
                    .map_err(|(f, m)| err(f, m))?;
                match &d.spec.source {
                    DiskSource::Blank(_) => {
                        if d.spec.size.is_none() {
                            return Err(err(
                                "spec.size",
                                "a blank disk needs a size, for example `size: 1Gi`".into(),
                            ));
                        }
                    }
                    DiskSource::Image(p) => {
                        check_host_path(p).map_err(|m| err("spec.source.image", m))?
                    }
                    DiskSource::Snapshot(name) => {
                        check_dns_label(name).map_err(|m| err("spec.source.snapshot", m))?
                    }
                    DiskSource::VirtualImage(name) => {
                        check_dns_label(name).map_err(|m| err("spec.source.virtualImage", m))?
                    }
                    DiskSource::Backup(b) => {
                        check_host_path(&b.from).map_err(|m| err("spec.source.backup.from", m))?;
                        check_dns_label(&b.disk).map_err(|m| err("spec.source.backup.disk", m))?;
                        if b.point == Some(0) {
                            return Err(err(
                                "spec.source.backup.point",
                                "points count from 1".into(),
                            ));
                        }
                    }
                }
                check_disk_files(&d.spec).map_err(|(f, m)| err(&f, m))?;
                if let Some(size) = &d.spec.size {
                    if matches!(d.spec.source, DiskSource::Snapshot(_)) {
                        return Err(err(
                            "spec.size",
                            "a disk restored from a snapshot has the snapshot's size; leave size out".into(),
                        ));
                    }
                    if matches!(d.spec.source, DiskSource::Backup(_)) {
                        return Err(err(
                            "spec.size",
                            "a disk restored from a backup has the backup's size; leave size out"
                                .into(),
                        ));
                    }
                    let b = size.bytes();
                    if !(MIN_DISK_BYTES..=MAX_DISK_BYTES).contains(&b) {
                        return Err(err(
                            "spec.size",
                            format!("{size} is out of range 1Mi..16Ti"),
                        ));
                    }
                    if b % 512 != 0 {
                        return Err(err(
                            "spec.size",
                            format!("{size} is not a multiple of 512 bytes"),
                        ));
                    }
                }
            }
            Object::VirtualDiskSnapshot(snap) => {
                check_header(&snap.api_version, &snap.kind, Kind::VirtualDiskSnapshot)
                    .map_err(|(f, m)| err(f, m))?;
                check_dns_label(&snap.spec.virtual_disk_name)
                    .map_err(|m| err("spec.virtualDiskName", m))?;
            }
            Object::VirtualMachineSnapshot(snap) => {
                check_header(&snap.api_version, &snap.kind, Kind::VirtualMachineSnapshot)
                    .map_err(|(f, m)| err(f, m))?;
                check_dns_label(&snap.spec.virtual_machine_name)
                    .map_err(|m| err("spec.virtualMachineName", m))?;
            }
            Object::VirtualMachineSnapshotGroup(g) => {
                check_header(&g.api_version, &g.kind, Kind::VirtualMachineSnapshotGroup)
                    .map_err(|(f, m)| err(f, m))?;
                if g.spec.virtual_machine_names.is_empty() {
                    return Err(err(
                        "spec.virtualMachineNames",
                        "must name at least one VirtualMachine".into(),
                    ));
                }
                let mut seen = HashSet::new();
                for (i, vm) in g.spec.virtual_machine_names.iter().enumerate() {
                    let field = format!("spec.virtualMachineNames[{i}]");
                    check_dns_label(vm).map_err(|m| err(&field, m))?;
                    if !seen.insert(vm.as_str()) {
                        return Err(err(
                            &field,
                            format!("{vm:?} is named twice; each VM is a member once"),
                        ));
                    }
                }
            }
            Object::VirtualMachineSnapshotSchedule(sch) => {
                check_header(
                    &sch.api_version,
                    &sch.kind,
                    Kind::VirtualMachineSnapshotSchedule,
                )
                .map_err(|(f, m)| err(f, m))?;
                check_schedule_spec(&sch.spec).map_err(|(f, m)| err(&f, m))?;
            }
            Object::VirtualMachineBackup(b) => {
                check_header(&b.api_version, &b.kind, Kind::VirtualMachineBackup)
                    .map_err(|(f, m)| err(f, m))?;
                check_dns_label(&b.spec.virtual_machine_name)
                    .map_err(|m| err("spec.virtualMachineName", m))?;
                check_host_path(&b.spec.to).map_err(|m| err("spec.to", m))?;
                if b.spec.keep == Some(0) {
                    return Err(err("spec.keep", "at least 1 point is kept".into()));
                }
                if b.spec.full_every == Some(0) {
                    return Err(err(
                        "spec.fullEvery",
                        "1 makes every point full; 0 means nothing".into(),
                    ));
                }
            }
            Object::VirtualImage(image) => {
                check_header(&image.api_version, &image.kind, Kind::VirtualImage)
                    .map_err(|(f, m)| err(f, m))?;
                match &image.spec.source {
                    ImageSource::File(p) => {
                        check_host_path(p).map_err(|m| err("spec.source.file", m))?
                    }
                    ImageSource::Http(h) => {
                        check_http_url(&h.url).map_err(|m| err("spec.source.http.url", m))?;
                        check_sha256(&h.sha256).map_err(|m| err("spec.source.http.sha256", m))?;
                    }
                    ImageSource::Oci(o) => check_oci(o).map_err(|(f, m)| err(f, m))?,
                }
            }
            Object::VirtualNetwork(n) => {
                check_header(&n.api_version, &n.kind, Kind::VirtualNetwork)
                    .map_err(|(f, m)| err(f, m))?;
                check_network_spec(&n.spec).map_err(|(f, m)| err(f, m))?;
            }
        }
        Ok(())
    }
}

fn check_schedule_spec(
    spec: &crate::kinds::VirtualMachineSnapshotScheduleSpec,
) -> Result<(), (String, String)> {
    let f = |field: &str, m: String| (field.to_string(), m);
    crate::cron::Schedule::parse(&spec.schedule).map_err(|e| f("spec.schedule", e.to_string()))?;
    if let Some(tz) = &spec.time_zone {
        crate::cron::parse_time_zone(tz).map_err(|e| f("spec.timeZone", e.to_string()))?;
    }
    match (&spec.selector, spec.virtual_machine_names.is_empty()) {
        (Some(_), false) => {
            return Err(f(
                "spec.selector",
                "give either virtualMachineNames or selector, not both".into(),
            ));
        }
        (None, true) => {
            return Err(f(
                "spec.virtualMachineNames",
                "must name at least one VirtualMachine (or give a selector)".into(),
            ));
        }
        _ => {}
    }
    let mut seen = HashSet::new();
    for (i, vm) in spec.virtual_machine_names.iter().enumerate() {
        let field = format!("spec.virtualMachineNames[{i}]");
        check_dns_label(vm).map_err(|m| (field.clone(), m))?;
        if !seen.insert(vm.as_str()) {
            return Err((field, format!("{vm:?} is named twice")));
        }
    }
    if let Some(sel) = &spec.selector {
        if sel.match_labels.is_empty() {
            return Err(f(
                "spec.selector.matchLabels",
                "must hold at least one label (a schedule of every VM names them)".into(),
            ));
        }
        for (k, v) in &sel.match_labels {
            crate::meta::check_label_key(k).map_err(|m| f("spec.selector.matchLabels", m))?;
            crate::meta::check_label_value(v)
                .map_err(|m| (format!("spec.selector.matchLabels.{k}"), m))?;
        }
    }
    if let Some(r) = &spec.retention {
        if r.keep == Some(0) {
            return Err(f(
                "spec.retention.keep",
                "0 would delete every snapshot as it is taken; at least 1".into(),
            ));
        }
        if let Some(age) = &r.max_age {
            crate::kinds::parse_age(age).map_err(|m| f("spec.retention.maxAge", m))?;
        }
    }
    if let Some(b) = &spec.backup {
        check_host_path(&b.to).map_err(|m| f("spec.backup.to", m))?;
        if b.keep == Some(0) {
            return Err(f("spec.backup.keep", "at least 1 point is kept".into()));
        }
        if b.full_every == Some(0) {
            return Err(f(
                "spec.backup.fullEvery",
                "1 makes every point full; 0 means nothing".into(),
            ));
        }
        if spec.virtual_machine_snapshot_group_template.is_some() {
            return Err(f(
                "spec.backup",
                "backups are per VM: a schedule with a group template takes snapshots only".into(),
            ));
        }
    }
    if spec.starting_deadline_seconds == Some(0) {
        return Err(f(
            "spec.startingDeadlineSeconds",
            "0 would skip every run; at least 1, or leave it unset (a late run still runs once)"
                .into(),
        ));
    }
    Ok(())
}

fn check_network_spec(spec: &VirtualNetworkSpec) -> Result<(), (&'static str, String)> {
    if let Some(subnet) = &spec.subnet {
        net::check_subnet(subnet).map_err(|m| ("spec.subnet", m))?;
    }
    match (spec.mode, &spec.bridge) {
        (NetworkMode::Bridge, None) => {
            return Err((
                "spec.bridge",
                "a Bridge network names the existing host bridge to attach to, for example `bridge: br0`".into(),
            ));
        }
        (NetworkMode::Bridge, Some(b)) => {
            net::check_interface_name(b).map_err(|m| ("spec.bridge", m))?;
            // What hearth's host side takes, and writes into dnsmasq's and
            // nftables' files: a name it refuses there would stop every
            // network's host apply, not only this one's.
            if !b
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            {
                return Err((
                    "spec.bridge",
                    format!(
                        "{b:?}: hearth attaches only to bridges whose names hold ASCII letters, digits, '-', '_' and '.'"
                    ),
                ));
            }
            if b.starts_with("hth-") || b.starts_with("htt-") {
                return Err((
                    "spec.bridge",
                    format!(
                        "{b:?}: names starting with hth- and htt- are hearth's own bridges and taps (removed at start-up when no network has them); attach to a bridge of the host's"
                    ),
                ));
            }
        }
        (mode, Some(_)) => {
            return Err((
                "spec.bridge",
                format!(
                    "only for mode Bridge; a {mode} network gets a bridge of its own (status.bridge)"
                ),
            ));
        }
        (_, None) => {}
    }
    if spec.mode == NetworkMode::Bridge && spec.dhcp == Some(true) {
        return Err((
            "spec.dhcp",
            "hearth serves no DHCP on a host bridge it does not own (the bridge's network has its own); leave dhcp out or set it to false".into(),
        ));
    }
    if spec.dns == Some(true) && !spec.dhcp_enabled() {
        return Err((
            "spec.dns",
            "the DNS server is handed to guests by hearth's DHCP, which this network does not serve; leave dns out or set it to false".into(),
        ));
    }
    Ok(())
}

fn check_interfaces(list: &[NetworkInterface]) -> Result<(), (String, String)> {
    if list.len() > MAX_INTERFACES {
        return Err((
            "spec.networks".into(),
            format!(
                "{} interfaces is more than the {MAX_INTERFACES} allowed",
                list.len()
            ),
        ));
    }
    let mut forwards = std::collections::HashMap::new();
    let mut macs = std::collections::HashMap::new();
    for (i, nic) in list.iter().enumerate() {
        let f = |field: &str| format!("spec.networks[{i}].{field}");
        check_dns_label(&nic.virtual_network_name).map_err(|m| (f("virtualNetworkName"), m))?;
        if let Some(mac) = &nic.mac_address {
            let parsed = net::check_mac(mac).map_err(|m| (f("macAddress"), m))?;
            if let Some(j) = macs.insert(parsed, i) {
                return Err((
                    f("macAddress"),
                    format!("{mac:?} is also the MAC of spec.networks[{j}]"),
                ));
            }
        }
        if let Some(ip) = &nic.ip_address {
            net::parse_ipv4(ip).map_err(|m| (f("ipAddress"), m))?;
        }
        if nic.ports.len() > 64 {
            return Err((f("ports"), "more than 64 port forwards".into()));
        }
        for (k, p) in nic.ports.iter().enumerate() {
            let pf = |field: &str| f(&format!("ports[{k}].{field}"));
            for (field, port) in [("hostPort", p.host_port), ("guestPort", p.guest_port)] {
                if !(1..=65535).contains(&port) {
                    return Err((pf(field), format!("{port} is out of range 1..65535")));
                }
            }
            if let Some(addr) = &p.host_address {
                net::parse_ipv4(addr).map_err(|m| (pf("hostAddress"), m))?;
            }
            // One host port and protocol is one forward, whichever host
            // address it listens on: a wildcard and a specific address
            // would both take the same packets.
            if let Some((j, l)) = forwards.insert((p.host_port, p.protocol), (i, k)) {
                return Err((
                    pf("hostPort"),
                    format!(
                        "{} {} is already forwarded by spec.networks[{j}].ports[{l}]",
                        p.protocol, p.host_port
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn check_cloud_init(ci: &CloudInit) -> Result<(), (String, String)> {
    let f = |field: &str, m: String| (format!("spec.cloudInit.{field}"), m);
    for (field, text) in [
        ("userData", &ci.user_data),
        ("networkConfig", &ci.network_config),
    ] {
        let Some(text) = text else { continue };
        if text.len() > MAX_CLOUD_INIT_TEXT {
            return Err(f(
                field,
                format!(
                    "{} bytes is more than the {} KiB allowed",
                    text.len(),
                    MAX_CLOUD_INIT_TEXT >> 10
                ),
            ));
        }
        if text.contains('\0') {
            return Err(f(field, "contains a NUL byte".into()));
        }
    }
    // cloud-config and network config are YAML: a typo found here is found
    // before the guest boots and silently ignores the file.
    if let Some(ud) = &ci.user_data
        && ud.starts_with("#cloud-config")
    {
        check_yaml_mapping(ud, "#cloud-config YAML").map_err(|m| f("userData", m))?;
    }
    if let Some(nc) = &ci.network_config {
        check_yaml_mapping(nc, "YAML").map_err(|m| f("networkConfig", m))?;
    }
    if ci.ssh_authorized_keys.len() > 64 {
        return Err(f("sshAuthorizedKeys", "more than 64 keys".into()));
    }
    for (i, key) in ci.ssh_authorized_keys.iter().enumerate() {
        let field = format!("sshAuthorizedKeys[{i}]");
        check_ssh_key(key).map_err(|m| f(&field, m))?;
    }
    if let Some(h) = &ci.hostname {
        check_dns_label(h).map_err(|m| f("hostname", m))?;
    }
    Ok(())
}

/// A YAML text inside a spec (`what` says which kind) whose top level is a
/// mapping; within the [`limits`] first, as a manifest is.
fn check_yaml_mapping(text: &str, what: &str) -> Result<(), String> {
    limits::check_yaml(text).map_err(|e| e.to_string())?;
    match serde_yaml_ng::from_str::<Value>(text) {
        Ok(Value::Object(_)) => Ok(()),
        Ok(Value::Null) => Ok(()),
        Ok(_) => Err(format!("not valid {what}: the top level must be a mapping")),
        Err(e) => Err(format!("not valid {what}: {e}")),
    }
}

/// One public key line as in `authorized_keys`: `TYPE BASE64 [COMMENT]`.
fn check_ssh_key(key: &str) -> Result<(), String> {
    if key.contains(['\n', '\r', '\0']) {
        return Err("must be one line".into());
    }
    if key.len() > 16 << 10 {
        return Err("longer than 16 KiB".into());
    }
    let mut parts = key.split_whitespace();
    let (Some(type_), Some(body)) = (parts.next(), parts.next()) else {
        return Err(format!(
            "{key:?} is not a public key (expected `ssh-ed25519 AAAA... comment`)"
        ));
    };
    let known =
        type_.starts_with("ssh-") || type_.starts_with("ecdsa-sha2-") || type_.starts_with("sk-");
    let base64 = body
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=');
    if !known || !base64 {
        return Err(format!(
            "{type_:?} key is not a public key (expected `ssh-ed25519 AAAA... comment`, `ssh-rsa ...` or `ecdsa-sha2-... ...`)"
        ));
    }
    Ok(())
}

fn check_http_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| format!("{url:?} is not an http:// or https:// URL"))?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    if url.len() > 4096 {
        return Err("longer than 4096 bytes".into());
    }
    if url.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err("contains spaces or control characters".into());
    }
    Ok(())
}

fn check_sha256(hex: &str) -> Result<(), String> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "{hex:?} is not a SHA-256 (64 hex digits, as `sha256sum` prints)"
        ));
    }
    Ok(())
}

fn check_header(
    api_version: &str,
    kind: &str,
    expected: Kind,
) -> Result<(), (&'static str, String)> {
    if api_version != API_VERSION {
        return Err((
            "apiVersion",
            format!("{api_version:?} is not supported (use {API_VERSION:?})"),
        ));
    }
    if kind != expected.as_str() {
        return Err(("kind", format!("{kind:?} is not {:?}", expected.as_str())));
    }
    Ok(())
}

/// Names are DNS labels (RFC 1123): they become file names and QEMU ids.
pub fn check_dns_label(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > 63 {
        return Err(format!("{name:?} is longer than 63 characters"));
    }
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let ends_ok = !name.starts_with('-') && !name.ends_with('-');
    if !ok_chars || !ends_ok {
        return Err(format!(
            "{name:?} is not a DNS label (lowercase letters, digits and '-', starting and ending with a letter or digit)"
        ));
    }
    Ok(())
}

fn check_oci(o: &OciSource) -> Result<(), (&'static str, String)> {
    let given = [
        o.reference.is_some(),
        o.layout.is_some(),
        o.archive.is_some(),
    ];
    if given.iter().filter(|g| **g).count() != 1 {
        return Err((
            "spec.source.oci",
            "names exactly one of reference (a registry), layout (an OCI image layout directory) or archive (an image tar file)".into(),
        ));
    }
    if let Some(r) = &o.reference {
        check_oci_reference(r).map_err(|m| ("spec.source.oci.reference", m))?;
        if o.tag.is_some() {
            return Err((
                "spec.source.oci.tag",
                "is for a layout or an archive; a reference carries its own tag (HOST/REPO:TAG)"
                    .into(),
            ));
        }
    } else {
        for (field, given) in [
            ("spec.source.oci.caFile", o.ca_file.is_some()),
            (
                "spec.source.oci.credentialsFile",
                o.credentials_file.is_some(),
            ),
            ("spec.source.oci.insecure", o.insecure),
        ] {
            if given {
                return Err((
                    field,
                    "is for a registry (reference); a layout or archive is a local file".into(),
                ));
            }
        }
    }
    if let Some(p) = &o.layout {
        check_host_path(p).map_err(|m| ("spec.source.oci.layout", m))?;
    }
    if let Some(p) = &o.archive {
        check_host_path(p).map_err(|m| ("spec.source.oci.archive", m))?;
    }
    if let Some(p) = &o.ca_file {
        check_host_path(p).map_err(|m| ("spec.source.oci.caFile", m))?;
    }
    if let Some(p) = &o.credentials_file {
        check_host_path(p).map_err(|m| ("spec.source.oci.credentialsFile", m))?;
    }
    if let Some(t) = &o.tag
        && (t.is_empty() || t.len() > 128 || t.bytes().any(|b| b.is_ascii_control() || b == b' '))
    {
        return Err((
            "spec.source.oci.tag",
            format!("{t:?} is not a tag (1 to 128 printable characters)"),
        ));
    }
    Ok(())
}

/// `HOST[:PORT]/REPO(:TAG|@sha256:HEX)`: the registry must be named (hearth
/// has no default registry).
fn check_oci_reference(r: &str) -> Result<(), String> {
    if r.len() > 512 || r.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(format!("{r:?} is not an image reference"));
    }
    let Some((host, rest)) = r.split_once('/') else {
        return Err(format!(
            "{r:?} names no registry; write HOST[:PORT]/REPO:TAG, for example 127.0.0.1:5000/debian:12"
        ));
    };
    if !(host.contains('.') || host.contains(':') || host == "localhost") {
        return Err(format!(
            "{r:?} names no registry ({host:?} is not a host); write HOST[:PORT]/REPO:TAG"
        ));
    }
    if rest.is_empty() {
        return Err(format!("{r:?} names no repository"));
    }
    if let Some((_, digest)) = rest.split_once('@') {
        let hex = digest
            .strip_prefix("sha256:")
            .ok_or_else(|| format!("{r:?}: a pinned digest is sha256:<64 hex>"))?;
        check_sha256(hex).map_err(|m| format!("{r:?}: the digest: {m}"))?;
    }
    Ok(())
}

/// `spec.files` of a VirtualDisk: only over a VirtualImage, each path
/// absolute and plain, one source each, no path twice.
fn check_disk_files(spec: &VirtualDiskSpec) -> Result<(), (String, String)> {
    if spec.files.is_empty() {
        return Ok(());
    }
    if !matches!(spec.source, DiskSource::VirtualImage(_)) {
        return Err((
            "spec.files".into(),
            "files can be written only into a disk made from a VirtualImage (of shape rootfs)"
                .into(),
        ));
    }
    if spec.files.len() > MAX_DISK_FILES {
        return Err((
            "spec.files".into(),
            format!("more than {MAX_DISK_FILES} files"),
        ));
    }
    let mut seen = HashSet::new();
    for (i, f) in spec.files.iter().enumerate() {
        let field = |name: &str| format!("spec.files[{i}].{name}");
        let text = f.path.to_str().unwrap_or_default();
        if !f.path.is_absolute()
            || text.contains('\0')
            || text.split('/').any(|c| c == "." || c == "..")
            || f.path
                .components()
                .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
            || f.path.components().count() < 2
        {
            return Err((
                field("path"),
                format!(
                    "{:?} is not an absolute path to a file without `.` or `..`",
                    f.path
                ),
            ));
        }
        if !seen.insert(f.path.clone()) {
            return Err((field("path"), format!("{:?} is listed twice", f.path)));
        }
        match (&f.source, &f.content) {
            (Some(src), None) => check_host_path(src).map_err(|m| (field("source"), m))?,
            (None, Some(content)) => {
                if content.len() > 1 << 20 {
                    return Err((field("content"), "longer than 1 MiB".into()));
                }
            }
            _ => {
                return Err((
                    field("source"),
                    "give exactly one of source (a host file) and content (text)".into(),
                ));
            }
        }
        if let Some(mode) = &f.mode {
            parse_file_mode(mode).map_err(|m| (field("mode"), m))?;
        }
    }
    Ok(())
}

/// An octal mode such as `"0600"` or `"755"`, at most `07777`.
pub fn parse_file_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if !digits.is_empty() && digits.len() <= 4 && m <= 0o7777 => Ok(m),
        _ => Err(format!(
            "{text:?} is not an octal mode such as \"0644\" (at most 07777)"
        )),
    }
}

fn check_host_path(p: &Path) -> Result<(), String> {
    let s = p.to_string_lossy();
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if !p.is_absolute() {
        return Err(format!("{s:?} is not an absolute path"));
    }
    if s.contains('\0') {
        return Err("contains a NUL byte".into());
    }
    Ok(())
}

/// One object's raw value from a text, before validation.
#[derive(Clone, Debug, PartialEq)]
pub struct RawDocument {
    /// 0-based index of the YAML document it came from.
    pub document: usize,
    /// `document 2`, or `document 2, items[0]`: how errors name it.
    pub label: String,
    pub value: Value,
}

/// Splits a text of one or more YAML or JSON documents into raw objects.
/// Empty documents are skipped; a document `{"items": [...]}` (what `hearth
/// get -o json` prints) is expanded. A syntax error carries line and column.
/// A text over the [`limits`] (size, nesting, documents, values, objects) is
/// refused before it is parsed.
pub fn raw_documents(text: &str, origin: &str) -> Result<Vec<RawDocument>, ParseError> {
    let limit = |error: LimitError| ParseError::Limit {
        origin: origin.to_string(),
        error,
    };
    limits::check_manifest_size(text.len()).map_err(limit)?;
    limits::check_yaml(text).map_err(limit)?;
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc_index = i + 1;
        // After a syntax error the document iterator repeats it: stop at the first.
        let value = Value::deserialize(doc).map_err(|e| syntax_error(&e, origin))?;
        match value {
            Value::Null => continue, // an empty document, e.g. a trailing `---`
            Value::Object(ref map) if map.contains_key("items") && !map.contains_key("kind") => {
                let Some(Value::Array(items)) = map.get("items") else {
                    return Err(ParseError::Invalid {
                        origin: origin.to_string(),
                        error: FieldError {
                            object: format!("document {doc_index}"),
                            field: "items".into(),
                            message: "must be a list of objects".into(),
                        },
                    });
                };
                if out.len() + items.len() > MAX_APPLY_OBJECTS {
                    return Err(ParseError::Invalid {
                        origin: origin.to_string(),
                        error: FieldError {
                            object: format!("document {doc_index}"),
                            field: "items".into(),
                            message: format!(
                                "{} objects in this text, more than the {MAX_APPLY_OBJECTS} allowed in one apply",
                                out.len() + items.len()
                            ),
                        },
                    });
                }
                for (j, item) in items.iter().enumerate() {
                    out.push(RawDocument {
                        document: i,
                        label: format!("document {doc_index}, items[{j}]"),
                        value: item.clone(),
                    });
                }
            }
            // An Ignite VM is several hearth objects (docs/ignite.md).
            ref other if crate::ignite::is_ignite(other) => {
                let label = format!("document {doc_index}");
                let t = crate::ignite::translate(other, &label).map_err(|error| {
                    ParseError::Invalid {
                        origin: origin.to_string(),
                        error,
                    }
                })?;
                for value in t.objects {
                    out.push(RawDocument {
                        document: i,
                        label: label.clone(),
                        value,
                    });
                }
            }
            other => out.push(RawDocument {
                document: i,
                label: format!("document {doc_index}"),
                value: other,
            }),
        }
    }
    Ok(out)
}

fn syntax_error(e: &serde_yaml_ng::Error, origin: &str) -> ParseError {
    let (line, column) = e
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((0, 0));
    // The library puts the location in its text too; say it once.
    let message = e
        .to_string()
        .replace(&format!(" at line {line} column {column}"), "");
    ParseError::Syntax {
        origin: origin.to_string(),
        line,
        column,
        message,
    }
}

/// Makes the host paths of one raw object absolute against `base` (the
/// manifest's directory), so a manifest works from wherever it is applied:
/// `spec.boot.kernel` and `spec.boot.initrd` of a VirtualMachine,
/// `spec.source.image` and each `spec.files[].source` of a VirtualDisk, the
/// OCI layout or archive of a VirtualImage. On the raw value, before validation,
/// which insists on absolute paths; anything that is not a non-empty string
/// is left for validation to report.
pub fn resolve_relative_paths(value: &mut Value, base: &Path) {
    let fields: &[&[&str]] = match value.get("kind").and_then(Value::as_str) {
        Some("VirtualMachine") => &[&["spec", "boot", "kernel"], &["spec", "boot", "initrd"]],
        Some("VirtualDisk") => &[&["spec", "source", "image"]],
        Some("VirtualImage") => &[
            &["spec", "source", "file"],
            &["spec", "source", "oci", "layout"],
            &["spec", "source", "oci", "archive"],
        ],
        _ => &[],
    };
    let absolute = |slot: Option<&mut Value>| {
        if let Some(Value::String(s)) = slot {
            let p = Path::new(s.as_str());
            if !s.is_empty() && p.is_relative() {
                *s = base.join(p).to_string_lossy().into_owned();
            }
        }
    };
    for path in fields {
        let mut slot = Some(&mut *value);
        for key in *path {
            slot = slot.and_then(|v| v.get_mut(*key));
        }
        absolute(slot);
    }
    if value.get("kind").and_then(Value::as_str) == Some("VirtualDisk") {
        let files = value.get_mut("spec").and_then(|s| s.get_mut("files"));
        if let Some(Value::Array(files)) = files {
            for f in files {
                absolute(f.get_mut("source"));
            }
        }
    }
}

/// Parses one text holding one or more YAML or JSON documents. All or nothing:
/// one bad document fails the whole text, so a half-valid file changes nothing.
/// With `base`, relative host paths resolve against it first.
pub fn parse_documents_in(
    text: &str,
    origin: &str,
    base: Option<&Path>,
) -> Result<Vec<Object>, ParseError> {
    raw_documents(text, origin)?
        .into_iter()
        .map(|mut raw| {
            if let Some(base) = base {
                resolve_relative_paths(&mut raw.value, base);
            }
            object_from_value(raw.value, &raw.label).map_err(|error| ParseError::Invalid {
                origin: origin.to_string(),
                error,
            })
        })
        .collect()
}

/// [`parse_documents_in`] for texts whose paths are already absolute.
pub fn parse_documents(text: &str, origin: &str) -> Result<Vec<Object>, ParseError> {
    parse_documents_in(text, origin, None)
}

/// Why an apply request body (`POST /v1/apply`) cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ApplyRequestError {
    #[error("request body is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("request body must be {{\"items\": [objects]}}")]
    NoItems,
    #[error("{0}")]
    Invalid(FieldError),
}

/// The objects of an apply request body: JSON `{"items": [objects]}`, each
/// validated, all or nothing. The JSON's own nesting stops at serde_json's
/// recursion limit (128 levels); YAML inside a spec (cloud-init) is held to
/// the [`limits`].
pub fn apply_request(body: &[u8]) -> Result<Vec<Object>, ApplyRequestError> {
    let value: Value = serde_json::from_slice(body).map_err(ApplyRequestError::NotJson)?;
    let Value::Object(mut map) = value else {
        return Err(ApplyRequestError::NoItems);
    };
    let Some(Value::Array(items)) = map.remove("items") else {
        return Err(ApplyRequestError::NoItems);
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            object_from_value(item, &format!("items[{i}]")).map_err(ApplyRequestError::Invalid)
        })
        .collect()
}

/// Turns one JSON value into a validated object.
pub fn object_from_value(mut value: Value, label: &str) -> Result<Object, FieldError> {
    let fe = |object: String, field: &str, message: String| FieldError {
        object,
        field: field.to_string(),
        message,
    };
    let Value::Object(map) = &mut value else {
        return Err(fe(label.into(), "(document)", "is not a mapping".into()));
    };
    // Written by hearthd only: whatever a client sends as status, even of
    // the wrong shape, is dropped unread (an object read back from hearthd
    // and sent again carries one).
    map.remove("status");
    let map = &*map;
    let name = map
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(|n| n.as_str())
        .map(str::to_string);
    let kind_text = match map.get("kind") {
        Some(Value::String(k)) => k.clone(),
        Some(_) => return Err(fe(label.into(), "kind", "must be a string".into())),
        None => {
            return Err(fe(
                label.into(),
                "kind",
                "is missing (one of: VirtualMachine, VirtualDisk, VirtualImage, VirtualNetwork, VirtualDiskSnapshot, VirtualMachineSnapshot, VirtualMachineSnapshotGroup, VirtualMachineSnapshotSchedule, VirtualMachineBackup)".into(),
            ));
        }
    };
    let kind = Kind::ALL
        .into_iter()
        .find(|k| k.as_str() == kind_text)
        .ok_or_else(|| {
            fe(
                label.into(),
                "kind",
                format!(
                    "unknown kind {kind_text:?} (one of: VirtualMachine, VirtualDisk, VirtualImage, VirtualNetwork, VirtualDiskSnapshot, VirtualMachineSnapshot, VirtualMachineSnapshotGroup, VirtualMachineSnapshotSchedule, VirtualMachineBackup)"
                ),
            )
        })?;
    let who = match &name {
        Some(n) => format!("{kind} {n:?}"),
        None => format!("{kind} in {label}"),
    };
    if name.is_none() {
        return Err(fe(who, "metadata.name", "is missing".into()));
    }
    let typed = |r: Result<Object, serde_path_to_error::Error<serde_json::Error>>| {
        r.map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            let (field, message) = refine_unknown_field(&path, &inner);
            FieldError {
                object: who.clone(),
                field,
                message,
            }
        })
    };
    let obj = match kind {
        Kind::VirtualMachine => typed(
            serde_path_to_error::deserialize::<_, VirtualMachine>(value)
                .map(Object::VirtualMachine),
        )?,
        Kind::VirtualDisk => typed(
            serde_path_to_error::deserialize::<_, VirtualDisk>(value).map(Object::VirtualDisk),
        )?,
        Kind::VirtualDiskSnapshot => typed(
            serde_path_to_error::deserialize::<_, VirtualDiskSnapshot>(value)
                .map(Object::VirtualDiskSnapshot),
        )?,
        Kind::VirtualMachineSnapshot => typed(
            serde_path_to_error::deserialize::<_, VirtualMachineSnapshot>(value)
                .map(Object::VirtualMachineSnapshot),
        )?,
        Kind::VirtualMachineSnapshotGroup => typed(
            serde_path_to_error::deserialize::<_, VirtualMachineSnapshotGroup>(value)
                .map(Object::VirtualMachineSnapshotGroup),
        )?,
        Kind::VirtualMachineSnapshotSchedule => typed(
            serde_path_to_error::deserialize::<_, VirtualMachineSnapshotSchedule>(value)
                .map(Object::VirtualMachineSnapshotSchedule),
        )?,
        Kind::VirtualMachineBackup => typed(
            serde_path_to_error::deserialize::<_, VirtualMachineBackup>(value)
                .map(Object::VirtualMachineBackup),
        )?,
        Kind::VirtualImage => typed(
            serde_path_to_error::deserialize::<_, VirtualImage>(value).map(Object::VirtualImage),
        )?,
        Kind::VirtualNetwork => typed(
            serde_path_to_error::deserialize::<_, VirtualNetwork>(value)
                .map(Object::VirtualNetwork),
        )?,
    };
    obj.validate()?;
    Ok(obj)
}

/// path_to_error already ends the path with the unknown key; keep the
/// message short and point at the field a person has to remove.
fn refine_unknown_field(path: &str, message: &str) -> (String, String) {
    let field = if path == "." || path.is_empty() {
        "(document)".to_string()
    } else {
        path.to_string()
    };
    if let Some(rest) = message.strip_prefix("unknown field `")
        && let Some(end) = rest.find('`')
    {
        return (field, format!("unknown field{}", &rest[end + 1..]));
    }
    (field, message.to_string())
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display_name())
    }
}
