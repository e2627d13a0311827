//! The one error of the engine's command surface: why a request was
//! refused. Each case names the object (and the field) it is about; the
//! HTTP API maps [`RequestError::refusal`] to one status.
//!
//! The refusals of one subsystem are its own enum, composed here:
//! [`ApplyConflict`], [`RestoreError`] and [`ExportError`] in
//! `engine/errors.rs`, [`NetworkConflict`] in `network/admission.rs`,
//! [`GuestAccessError`] in `guest/error.rs`.

use hearth_api::{FieldError, Kind};

pub use crate::engine::errors::{ApplyConflict, ExportError, RestoreError};
pub use crate::guest::error::GuestAccessError;
pub use crate::network::admission::NetworkConflict;
use crate::store::StoreError;

pub use hearth_api::limits::MAX_APPLY_OBJECTS;

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A field of an object is wrong (syntax, range, a host path outside
    /// the roots, an immutable spec changed).
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error(
        "{count} objects in one apply, more than the limit of {max} objects per apply; split them over several applies",
        max = MAX_APPLY_OBJECTS
    )]
    TooManyObjects { count: usize },
    /// The same kind and name twice in one apply.
    #[error("{object} appears twice in one apply")]
    Twice { object: String },
    /// What a guest program or copy was given is wrong, or the guest
    /// refused it.
    #[error("VirtualMachine {vm:?}: {message}")]
    Guest { vm: String, message: String },
    #[error("{kind} {name:?} not found")]
    NotFound { kind: Kind, name: String },
    /// Something inside a VM or hearthd's sessions that is not there.
    #[error("VirtualMachine {vm:?}: {what}")]
    NotInGuest { vm: String, what: String },
    /// An apply that only creates met an object that exists.
    #[error("{kind} {name:?} already exists; an apply with create=true only creates")]
    Exists { kind: Kind, name: String },
    /// `then` says what did not happen because of it (`; nothing was
    /// restored`), or is empty.
    #[error("{kind} {name:?} is being deleted{then}")]
    Deleting {
        kind: Kind,
        name: String,
        then: &'static str,
    },
    #[error("{object} is owned by the manifest file {file}; edit or remove that file instead")]
    OwnedByFile { object: String, file: String },
    /// A git source's object (`owner` is `git:NAME:PATH`).
    #[error("{object} is declared by the source {owner}; change it there instead")]
    OwnedBySource { object: String, owner: String },
    #[error("VirtualMachine {vm:?} is not running")]
    NotRunning { vm: String },
    // The subsystems' own refusals, boxed: their cases carry several names
    // each, and every command returns this type.
    /// A delete, VM action or apply that other objects refuse.
    #[error(transparent)]
    Apply(Box<ApplyConflict>),
    /// An apply that asks for what another network or VM holds.
    #[error(transparent)]
    Network(Box<NetworkConflict>),
    #[error(transparent)]
    Restore(Box<RestoreError>),
    #[error(transparent)]
    Export(Box<ExportError>),
    /// The guest agent cannot be reached, or a call through it failed.
    #[error(transparent)]
    GuestAccess(Box<GuestAccessError>),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// The classes of refusal, each one HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request itself is wrong (400).
    BadRequest,
    /// What it names does not exist (404).
    NotFound,
    /// It cannot be done in the present state (409).
    Conflict,
    /// hearthd failed (500).
    Internal,
}

/// `#[from]` for the boxed cases.
macro_rules! from_boxed {
    ($($error:ty => $case:ident),* $(,)?) => {
        $(impl From<$error> for RequestError {
            fn from(e: $error) -> Self {
                RequestError::$case(Box::new(e))
            }
        })*
    };
}

from_boxed! {
    ApplyConflict => Apply,
    NetworkConflict => Network,
    RestoreError => Restore,
    ExportError => Export,
    GuestAccessError => GuestAccess,
}

/// An apply's network refusal: a field against this host's objects, or
/// what another object holds.
impl From<crate::network::admission::Refusal> for RequestError {
    fn from(r: crate::network::admission::Refusal) -> Self {
        use crate::network::admission::Refusal as R;
        match r {
            R::Invalid(e) => RequestError::Invalid(e),
            R::Conflict(c) => RequestError::Network(c),
        }
    }
}

impl RequestError {
    pub fn refusal(&self) -> Refusal {
        match self {
            RequestError::Invalid(_)
            | RequestError::TooManyObjects { .. }
            | RequestError::Twice { .. }
            | RequestError::Guest { .. } => Refusal::BadRequest,
            RequestError::NotFound { .. } | RequestError::NotInGuest { .. } => Refusal::NotFound,
            RequestError::Exists { .. }
            | RequestError::Deleting { .. }
            | RequestError::OwnedByFile { .. }
            | RequestError::OwnedBySource { .. }
            | RequestError::NotRunning { .. }
            | RequestError::Apply(_)
            | RequestError::Network(_)
            | RequestError::Restore(_)
            | RequestError::Export(_)
            | RequestError::GuestAccess(_) => Refusal::Conflict,
            RequestError::Store(_) => Refusal::Internal,
        }
    }

    pub(crate) fn not_found(kind: Kind, name: &str) -> RequestError {
        RequestError::NotFound {
            kind,
            name: name.to_string(),
        }
    }

    pub(crate) fn deleting(kind: Kind, name: &str, then: &'static str) -> RequestError {
        RequestError::Deleting {
            kind,
            name: name.to_string(),
            then,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts clients and tests read stay what they were.
    #[test]
    fn typed_cases_read_as_before() {
        let cases = [
            (
                RequestError::not_found(Kind::VirtualMachine, "a"),
                r#"VirtualMachine "a" not found"#,
            ),
            (
                RequestError::deleting(Kind::VirtualDiskSnapshot, "s", "; nothing was exported"),
                r#"VirtualDiskSnapshot "s" is being deleted; nothing was exported"#,
            ),
            (
                RequestError::NotRunning { vm: "a".into() },
                r#"VirtualMachine "a" is not running"#,
            ),
            (
                RequestError::Guest {
                    vm: "a".into(),
                    message: "no program to run (path is empty)".into(),
                },
                r#"VirtualMachine "a": no program to run (path is empty)"#,
            ),
            (
                RequestError::Twice {
                    object: r#"VirtualDisk "d""#.into(),
                },
                r#"VirtualDisk "d" appears twice in one apply"#,
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
        assert_eq!(
            RequestError::TooManyObjects { count: 10_001 }.to_string(),
            format!(
                "10001 objects in one apply, more than the limit of {MAX_APPLY_OBJECTS} objects per apply; split them over several applies"
            )
        );
    }

    fn io(text: &str) -> std::io::Error {
        std::io::Error::other(text.to_string())
    }

    fn img() -> hearth_qemu::img::ImgError {
        hearth_qemu::img::ImgError::NotAbsolute {
            path: "rel.qcow2".into(),
        }
    }

    /// Each case against the text the `format!` it replaced produced (the
    /// old expression, copied), and its class: all were conflicts (409).
    fn pin(cases: Vec<(RequestError, String)>) {
        for (e, old) in cases {
            assert_eq!(e.to_string(), old, "{e:?}");
            assert_eq!(e.refusal(), Refusal::Conflict, "{e:?}");
        }
    }

    #[test]
    fn apply_conflicts_read_as_before() {
        let (name, vm, other, i) = ("d", "a", "b", 1usize);
        let list = |v: &[&str]| v.iter().map(|v| format!("{v:?}")).collect::<Vec<String>>();
        let names = |v: &[&str]| v.iter().map(|v| v.to_string()).collect::<Vec<_>>();
        // What `Object::display_name` gives.
        let disk_object = format!("{} {:?}", Kind::VirtualDisk, name);
        let vm_object = format!("{} {:?}", Kind::VirtualMachine, vm);
        pin(vec![
            (
                ApplyConflict::DiskInUse {
                    disk: name.into(),
                    vm: vm.into(),
                }
                .into(),
                format!(
                    "VirtualDisk {name:?} is in use by VirtualMachine {vm:?} (its spec.disks, or its running QEMU until it restarts); delete the VM or remove the disk from it first"
                ),
            ),
            (
                ApplyConflict::NetworkInUse {
                    network: "lan".into(),
                    vms: names(&["db", "web"]),
                }
                .into(),
                format!(
                    "VirtualNetwork {:?} is in use by VirtualMachine {} (its spec.networks, or its running QEMU until it restarts); delete those VMs or remove the network from them first",
                    "lan",
                    list(&["db", "web"]).join(", ")
                ),
            ),
            (
                ApplyConflict::ImageInUse {
                    image: "img".into(),
                    disks: names(&["d"]),
                }
                .into(),
                format!(
                    "VirtualImage {:?} is in use by VirtualDisk {} (made from it); delete those disks first",
                    "img",
                    list(&["d"]).join(", ")
                ),
            ),
            (
                ApplyConflict::AlwaysOff { vm: vm.into() }.into(),
                format!(
                    "VirtualMachine {vm:?} has spec.runPolicy AlwaysOff; set it to AlwaysOn or Manual to start it"
                ),
            ),
            (
                ApplyConflict::ImageDeleting {
                    disk: name.into(),
                    image: "img".into(),
                }
                .into(),
                format!(
                    "{}: spec.source.virtualImage: VirtualImage {:?} is being deleted",
                    disk_object, "img"
                ),
            ),
            (
                ApplyConflict::DiskTaken {
                    vm: vm.into(),
                    index: i,
                    disk: name.into(),
                    other: other.into(),
                }
                .into(),
                format!(
                    "{}: spec.disks[{i}].virtualDiskName: VirtualDisk {:?} is already used by VirtualMachine {other:?}",
                    vm_object, name
                ),
            ),
        ]);
    }

    #[test]
    fn network_conflicts_read_as_before() {
        use crate::network::{ipam, ports, subnets};
        let (name, b, a, bi, ai) = ("lan", "vb", "va", 1usize, 0usize);
        let cidr = |s: &str| -> hearth_api::net::Ipv4Cidr { s.parse().expect("cidr") };
        let (old_subnet, new_subnet, leases) = (cidr("10.77.0.0/24"), cidr("10.78.0.0/24"), 2);
        let subnet_e = subnets::SubnetError::OverlapsNetwork {
            subnet: cidr("10.77.0.0/24"),
            other: "iso".into(),
            other_subnet: cidr("10.77.0.0/16"),
        };
        let taken = ipam::IpamError::Taken {
            ip: "10.77.0.10".parse().expect("ip"),
            holder: ipam::Holder {
                vm: "z".into(),
                interface: 0,
            },
        };
        let port = ports::PortConflict {
            vm: b.into(),
            field: "spec.networks[0].ports[0].hostPort".into(),
            listen: "TCP port 8080".into(),
            other_vm: a.into(),
            other_field: "spec.networks[0].ports[0].hostPort".into(),
        };
        let who = format!("VirtualNetwork {name:?}");
        let (bridge, tap, mac) = ("hth-lan", "hth-vb-1", "52:54:00:00:00:01");
        let object = format!("VirtualMachine {b:?}");
        let field = format!("spec.networks[{}].ipAddress", 0);
        let message = format!("{taken} (VirtualNetwork {name:?})");
        let net_name = name;
        pin(vec![
            (
                NetworkConflict::SubnetHasLeases {
                    network: name.into(),
                    from: old_subnet,
                    to: new_subnet,
                    leases,
                }
                .into(),
                format!(
                    "{who}: spec.subnet: cannot move from {old_subnet} to {new_subnet} while {leases} VM interface(s) hold addresses in it; remove them from the network first"
                ),
            ),
            (
                NetworkConflict::Subnet {
                    network: name.into(),
                    reason: subnet_e.clone(),
                }
                .into(),
                format!("VirtualNetwork {name:?}: spec.subnet: {subnet_e}"),
            ),
            (
                NetworkConflict::BridgeName {
                    network: b.into(),
                    bridge: bridge.into(),
                    other: a.into(),
                }
                .into(),
                format!(
                    "VirtualNetwork {b:?}: metadata.name: its bridge name {bridge:?} is the one of VirtualNetwork {a:?}; choose another name"
                ),
            ),
            (
                NetworkConflict::NetworkDeleting {
                    vm: b.into(),
                    index: bi,
                    network: name.into(),
                }
                .into(),
                format!(
                    "VirtualMachine {:?}: spec.networks[{bi}].virtualNetworkName: VirtualNetwork {:?} is being deleted",
                    b, name
                ),
            ),
            (
                NetworkConflict::Address {
                    vm: b.into(),
                    index: 0,
                    network: name.into(),
                    reason: taken.clone(),
                }
                .into(),
                format!("{object}: {field}: {message}"),
            ),
            (
                NetworkConflict::Port {
                    vm: b.into(),
                    reason: port.clone(),
                }
                .into(),
                format!("VirtualMachine {:?}: {port}", b),
            ),
            (
                NetworkConflict::TapName {
                    vm: b.into(),
                    index: bi,
                    tap: tap.into(),
                    other: a.into(),
                    other_index: ai,
                }
                .into(),
                format!(
                    "VirtualMachine {b:?}: spec.networks[{bi}]: its tap name {tap:?} is the one of VirtualMachine {a:?} spec.networks[{ai}]; choose another VM name"
                ),
            ),
            (
                NetworkConflict::Mac {
                    vm: b.into(),
                    index: bi,
                    mac: mac.into(),
                    other: a.into(),
                    other_index: ai,
                    network: name.into(),
                }
                .into(),
                format!(
                    "VirtualMachine {b:?}: spec.networks[{bi}].macAddress: {mac} is also the MAC of VirtualMachine {a:?} spec.networks[{ai}] on VirtualNetwork {net_name:?}"
                ),
            ),
        ]);
        // The admission's own refusal goes to the same cases.
        let refused: RequestError =
            crate::network::admission::Refusal::from(NetworkConflict::Port {
                vm: b.into(),
                reason: port,
            })
            .into();
        assert!(matches!(refused, RequestError::Network(_)), "{refused:?}");
        let invalid: RequestError = crate::network::admission::Refusal::Invalid(FieldError {
            object: object.clone(),
            field: field.clone(),
            message: "m".into(),
        })
        .into();
        assert!(matches!(invalid, RequestError::Invalid(_)), "{invalid:?}");
    }

    #[test]
    fn restore_refusals_read_as_before() {
        use hearth_api::SnapshotPhase;
        let (name, from, vm_name, child, disk) = ("g", "s", "a", "s-d", "d");
        let phase = SnapshotPhase::Failed;
        let message = Some("it broke".to_string());
        let e = img();
        let overlay = crate::snapshot::overlays::OverlayError::NoQmp;
        let compaction = crate::snapshot::compaction::CompactionError::NoMergedLayer(3);
        let failed = [format!("{}: {}", "a", "x"), format!("{}: {}", "b", "y")];
        pin(vec![
            (
                RestoreError::GroupNotReady {
                    group: name.into(),
                    phase,
                    message: message.clone(),
                }
                .into(),
                format!(
                    "VirtualMachineSnapshotGroup {name:?} is {}, not Ready{}",
                    phase,
                    message
                        .as_ref()
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default()
                ),
            ),
            (
                RestoreError::GroupNotReady {
                    group: name.into(),
                    phase: SnapshotPhase::InProgress,
                    message: None,
                }
                .into(),
                format!(
                    "VirtualMachineSnapshotGroup {name:?} is {}, not Ready{}",
                    SnapshotPhase::InProgress,
                    ""
                ),
            ),
            (
                RestoreError::MemberNotReady {
                    member: child.into(),
                    phase,
                }
                .into(),
                format!(
                    "member VirtualMachineSnapshot {child:?} is {}, not Ready",
                    phase
                ),
            ),
            (
                RestoreError::MembersFailed {
                    group: name.into(),
                    members: 3,
                    failed: vec![("a".into(), "x".into()), ("b".into(), "y".into())],
                }
                .into(),
                format!(
                    "VirtualMachineSnapshotGroup {name:?}: {} of {} member(s) not restored: {}",
                    failed.len(),
                    3,
                    failed.join("; ")
                ),
            ),
            (
                RestoreError::OtherVm {
                    snapshot: from.into(),
                    of: "b".into(),
                    vm: vm_name.into(),
                }
                .into(),
                format!(
                    "VirtualMachineSnapshot {from:?} is of VirtualMachine {:?}, not {vm_name:?}",
                    "b"
                ),
            ),
            (
                RestoreError::NotReady {
                    snapshot: from.into(),
                    phase,
                }
                .into(),
                format!("VirtualMachineSnapshot {from:?} is {}, not Ready", phase),
            ),
            (
                RestoreError::DiskSnapshotDeleting {
                    disk_snapshot: child.into(),
                    snapshot: from.into(),
                }
                .into(),
                format!(
                    "VirtualDiskSnapshot {child:?} of VirtualMachineSnapshot {from:?} is being deleted; nothing was restored"
                ),
            ),
            (
                RestoreError::DiskGone {
                    disk: disk.into(),
                    vm: vm_name.into(),
                }
                .into(),
                format!(
                    "VirtualDisk {disk:?} of the snapshot is no longer in VirtualMachine {vm_name:?} (spec.disks)"
                ),
            ),
            (
                RestoreError::NoLayer {
                    disk_snapshot: child.into(),
                }
                .into(),
                format!("VirtualDiskSnapshot {child:?} has no stored layer"),
            ),
            (
                RestoreError::DidNotStop {
                    vm: vm_name.into(),
                    seconds: 90,
                }
                .into(),
                format!(
                    "VirtualMachine {vm_name:?} did not stop within {} s; nothing was restored",
                    90
                ),
            ),
            (
                RestoreError::Running { vm: vm_name.into() }.into(),
                format!(
                    "VirtualMachine {vm_name:?} is running; stop it first (nothing was restored)"
                ),
            ),
            (
                RestoreError::SettleOverlays(crate::snapshot::overlays::OverlayError::NoQmp).into(),
                format!("{overlay} (nothing was restored)"),
            ),
            (
                RestoreError::SettleCompaction(
                    crate::snapshot::compaction::CompactionError::NoMergedLayer(3),
                )
                .into(),
                format!("{compaction} (nothing was restored)"),
            ),
            (
                RestoreError::LayersDir(io("denied")).into(),
                io("denied").to_string(),
            ),
            (
                RestoreError::Overlay {
                    disk: disk.into(),
                    reason: img(),
                }
                .into(),
                format!("VirtualDisk {disk:?}: {e} (nothing was restored)"),
            ),
        ]);
    }

    #[test]
    fn export_refusals_read_as_before() {
        use crate::snapshot::export::ExportFormat;
        use hearth_api::SnapshotPhase;
        let name = "s";
        let phase = SnapshotPhase::Failed;
        let old_why = |reason: &Option<String>, message: &Option<String>| match (reason, message) {
            (Some(r), Some(m)) => format!(" ({r}: {m})"),
            (Some(r), None) => format!(" ({r})"),
            (None, Some(m)) => format!(" ({m})"),
            (None, None) => String::new(),
        };
        let mut cases = Vec::new();
        for (reason, message) in [
            (Some("R"), Some("m")),
            (Some("R"), None),
            (None, Some("m")),
            (None, None),
        ] {
            let (reason, message) = (reason.map(String::from), message.map(String::from));
            let why = old_why(&reason, &message);
            cases.push((
                ExportError::NotReady {
                    snapshot: name.into(),
                    phase,
                    reason,
                    message,
                }
                .into(),
                format!(
                    "VirtualDiskSnapshot {name:?} is {}{why}, not Ready: only a Ready snapshot can be exported",
                    phase
                ),
            ));
        }
        let dir = std::path::PathBuf::from("/var/lib/hearth/exports");
        let temp = std::path::PathBuf::from("/var/lib/hearth/exports/00000001-s.raw");
        let (e, format) = (img(), ExportFormat::Raw);
        cases.extend([
            (
                ExportError::NoLayer {
                    snapshot: name.into(),
                }
                .into(),
                format!("VirtualDiskSnapshot {name:?} is Ready but has no stored layer"),
            ),
            (
                ExportError::CreateDir {
                    dir: dir.clone(),
                    error: io("denied"),
                }
                .into(),
                format!("cannot create {}: {}", dir.display(), io("denied")),
            ),
            (
                ExportError::Convert {
                    snapshot: name.into(),
                    format,
                    reason: img(),
                }
                .into(),
                format!(
                    "VirtualDiskSnapshot {name:?}: the conversion to {} failed: {e}",
                    format.as_str()
                ),
            ),
            (
                ExportError::Inspect {
                    snapshot: name.into(),
                    reason: img(),
                }
                .into(),
                format!("VirtualDiskSnapshot {name:?}: {e}"),
            ),
            (
                ExportError::Open {
                    path: temp.clone(),
                    error: io("gone"),
                }
                .into(),
                format!("cannot open {}: {}", temp.display(), io("gone")),
            ),
            (
                ExportError::Stat(io("gone")).into(),
                format!("cannot stat the export: {}", io("gone")),
            ),
        ]);
        pin(cases);
    }
}
