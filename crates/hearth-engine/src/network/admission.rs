//! The cross-object checks of an apply that involve networks, over the state
//! the apply would leave: the stored objects with the batch's on top. Each
//! refusal names the object, the field and the other holder; the engine
//! refuses the whole apply, so nothing changes.
//!
//! A running QEMU keeps the interfaces, addresses and forwards it was
//! started with until it exits (docs/networking.md), so addresses, ports
//! and MACs are checked in three states: every VM as its spec says (once
//! all have restarted); every VM with its networks in effect now; and, for
//! each applied VM whose QEMU runs with other networks, its new spec among
//! the others in effect now (its next start).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use hearth_api::net::Ipv4Cidr;
use hearth_api::{
    FieldError, NetworkInterface, NetworkMode, VirtualMachine, VirtualNetwork, VirtualNetworkStatus,
};

use super::ipam::{self, Holder, IpamError};
pub use super::names::mac_of;
use super::{names, ports, subnets};
use crate::store::StoredLease;

/// A network as the apply would leave it.
#[derive(Clone, Debug)]
pub struct NetworkView {
    pub network: VirtualNetwork,
    /// What the stored status says (the subnet picked for it, if any).
    pub status: VirtualNetworkStatus,
    pub deleting: bool,
    pub in_batch: bool,
}

impl NetworkView {
    /// spec.subnet, else the one picked and kept in status.
    pub fn subnet(&self) -> Option<Ipv4Cidr> {
        self.network
            .spec
            .subnet
            .as_deref()
            .or(self.status.subnet.as_deref())
            .and_then(|s| s.parse().ok())
    }
}

#[derive(Clone, Debug)]
pub struct VmView {
    pub vm: VirtualMachine,
    pub in_batch: bool,
    /// The VM with the networks its QEMU was started with
    /// (`desired::in_effect`), while a QEMU has them.
    pub running: Option<VirtualMachine>,
}

/// One VM in one of the states checked: its claims, whether the apply
/// brings them, and whether a running QEMU holds them.
#[derive(Clone, Copy, Debug)]
struct Claimant<'a> {
    vm: &'a VirtualMachine,
    in_batch: bool,
    held: bool,
}

/// The states an apply is checked in (see the module's doc), each a list of
/// claimants in the order they claim: held first, then the VMs the apply
/// does not touch, then the applied ones, by name within each.
fn states(vms: &BTreeMap<String, VmView>) -> Vec<Vec<Claimant<'_>>> {
    fn spec(v: &VmView) -> Claimant<'_> {
        Claimant {
            vm: &v.vm,
            in_batch: v.in_batch,
            held: false,
        }
    }
    fn now(v: &VmView) -> Claimant<'_> {
        match &v.running {
            Some(r) => Claimant {
                vm: r,
                in_batch: false,
                held: true,
            },
            None => spec(v),
        }
    }
    fn order(mut c: Vec<Claimant<'_>>) -> Vec<Claimant<'_>> {
        c.sort_by_key(|c| (!c.held, c.in_batch));
        c
    }
    let mut out = vec![
        order(vms.values().map(spec).collect()),
        order(vms.values().map(now).collect()),
    ];
    for (name, v) in vms
        .iter()
        .filter(|(_, v)| v.in_batch && v.running.is_some())
    {
        out.push(order(
            vms.iter()
                .map(|(n, o)| if n == name { spec(v) } else { now(o) })
                .collect(),
        ));
    }
    out
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Bad input against this host's objects (`RequestError::Invalid`).
    #[error("{0}")]
    Invalid(FieldError),
    /// Held by another object (`RequestError::Network`).
    #[error("{0}")]
    Conflict(Box<NetworkConflict>),
}

impl From<NetworkConflict> for Refusal {
    fn from(c: NetworkConflict) -> Self {
        Refusal::Conflict(Box::new(c))
    }
}

/// What another network or VM holds that an apply asks for: each case names
/// the object and field it refuses and the other holder.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NetworkConflict {
    #[error(
        "VirtualNetwork {network:?}: spec.subnet: cannot move from {from} to {to} while {leases} VM interface(s) hold addresses in it; remove them from the network first"
    )]
    SubnetHasLeases {
        network: String,
        from: Ipv4Cidr,
        to: Ipv4Cidr,
        leases: usize,
    },
    #[error("VirtualNetwork {network:?}: spec.subnet: {reason}")]
    Subnet {
        network: String,
        reason: subnets::SubnetError,
    },
    #[error(
        "VirtualNetwork {network:?}: metadata.name: its bridge name {bridge:?} is the one of VirtualNetwork {other:?}; choose another name"
    )]
    BridgeName {
        network: String,
        bridge: String,
        other: String,
    },
    #[error(
        "VirtualMachine {vm:?}: spec.networks[{index}].virtualNetworkName: VirtualNetwork {network:?} is being deleted"
    )]
    NetworkDeleting {
        vm: String,
        index: usize,
        network: String,
    },
    /// An address taken by another holder, or none left.
    #[error(
        "VirtualMachine {vm:?}: spec.networks[{index}].ipAddress: {reason} (VirtualNetwork {network:?})"
    )]
    Address {
        vm: String,
        index: u32,
        network: String,
        reason: IpamError,
    },
    #[error("VirtualMachine {vm:?}: {reason}")]
    Port {
        vm: String,
        reason: ports::PortConflict,
    },
    #[error(
        "VirtualMachine {vm:?}: spec.networks[{index}]: its tap name {tap:?} is the one of VirtualMachine {other:?} spec.networks[{other_index}]; choose another VM name"
    )]
    TapName {
        vm: String,
        index: usize,
        tap: String,
        other: String,
        other_index: usize,
    },
    #[error(
        "VirtualMachine {vm:?}: spec.networks[{index}].macAddress: {mac} is also the MAC of VirtualMachine {other:?} spec.networks[{other_index}] on VirtualNetwork {network:?}"
    )]
    Mac {
        vm: String,
        index: usize,
        mac: String,
        other: String,
        other_index: usize,
        network: String,
    },
}

fn invalid(object: String, field: String, message: String) -> Refusal {
    Refusal::Invalid(FieldError {
        object,
        field,
        message,
    })
}

/// Checks a VirtualNetwork update against the stored one: its mode and
/// bridge never change, and its subnet changes only while it has no leases.
pub fn check_network_update(
    old: &NetworkView,
    new: &VirtualNetwork,
    leases: usize,
) -> Result<(), Refusal> {
    let who = format!("VirtualNetwork {:?}", new.metadata.name);
    if old.network.spec.mode != new.spec.mode {
        return Err(invalid(
            who,
            "spec.mode".into(),
            format!(
                "cannot change from {} to {} (delete the network and create it again)",
                old.network.spec.mode, new.spec.mode
            ),
        ));
    }
    if old.network.spec.bridge != new.spec.bridge {
        return Err(invalid(
            who,
            "spec.bridge".into(),
            "cannot change after the network is created (delete it and create it again)".into(),
        ));
    }
    let new_subnet: Option<Ipv4Cidr> = new.spec.subnet.as_deref().and_then(|s| s.parse().ok());
    if let (Some(old_subnet), Some(new_subnet)) = (old.subnet(), new_subnet)
        && old_subnet != new_subnet
        && leases > 0
    {
        return Err(NetworkConflict::SubnetHasLeases {
            network: new.metadata.name.clone(),
            from: old_subnet,
            to: new_subnet,
            leases,
        }
        .into());
    }
    Ok(())
}

/// Every network check of one apply.
pub fn check(
    networks: &BTreeMap<String, NetworkView>,
    vms: &BTreeMap<String, VmView>,
    leases: &[StoredLease],
) -> Result<(), Refusal> {
    check_subnets(networks)?;
    check_bridge_names(networks)?;
    for v in vms.values().filter(|v| v.in_batch) {
        check_vm_networks(v, networks)?;
    }
    check_forwards_only_to_nat(networks, vms)?;
    check_bridge_reservations(networks, vms)?;
    for state in states(vms) {
        check_addresses(networks, &state, leases)?;
        check_ports(&state)?;
        check_interface_names(&state, networks)?;
    }
    Ok(())
}

fn check_subnets(networks: &BTreeMap<String, NetworkView>) -> Result<(), Refusal> {
    for (name, n) in networks.iter().filter(|(_, n)| n.in_batch) {
        let Some(subnet) = n.subnet() else { continue };
        let others: Vec<(String, Ipv4Cidr)> = networks
            .iter()
            .filter(|(o, _)| *o != name)
            .filter_map(|(o, v)| v.subnet().map(|s| (o.clone(), s)))
            .collect();
        if let Err(e) = subnets::check(subnet, &others, &[]) {
            return Err(NetworkConflict::Subnet {
                network: name.clone(),
                reason: e,
            }
            .into());
        }
    }
    Ok(())
}

fn check_bridge_names(networks: &BTreeMap<String, NetworkView>) -> Result<(), Refusal> {
    let own = networks
        .iter()
        .filter(|(_, n)| n.network.spec.mode != NetworkMode::Bridge)
        .map(|(name, _)| (name.clone(), names::bridge_name(name)));
    if let Some((a, b, bridge)) = names::collisions(own) {
        return Err(NetworkConflict::BridgeName {
            network: b,
            bridge,
            other: a,
        }
        .into());
    }
    Ok(())
}

fn check_vm_networks(v: &VmView, networks: &BTreeMap<String, NetworkView>) -> Result<(), Refusal> {
    let vm = &v.vm;
    for (i, nic) in vm.spec.networks.iter().enumerate() {
        // A network that does not exist yet is waited for, like a disk.
        let Some(n) = networks.get(&nic.virtual_network_name) else {
            continue;
        };
        if n.deleting {
            return Err(NetworkConflict::NetworkDeleting {
                vm: vm.metadata.name.clone(),
                index: i,
                network: nic.virtual_network_name.clone(),
            }
            .into());
        }
    }
    Ok(())
}

/// Every interface on a known network where the VM or the network comes in
/// the batch: what the per-interface rules below are checked on, so either
/// side's apply is refused.
fn touched_interfaces<'a>(
    networks: &'a BTreeMap<String, NetworkView>,
    vms: &'a BTreeMap<String, VmView>,
) -> impl Iterator<Item = (&'a VmView, usize, &'a NetworkInterface, &'a NetworkView)> {
    vms.values().flat_map(move |v| {
        v.vm.spec
            .networks
            .iter()
            .enumerate()
            .filter_map(move |(i, nic)| {
                let n = networks.get(&nic.virtual_network_name)?;
                (v.in_batch || n.in_batch).then_some((v, i, nic, n))
            })
    })
}

/// Port forwards exist only on NAT networks: an Isolated network is
/// reachable from nothing outside it, and a Bridge network's addresses are
/// someone else's.
fn check_forwards_only_to_nat(
    networks: &BTreeMap<String, NetworkView>,
    vms: &BTreeMap<String, VmView>,
) -> Result<(), Refusal> {
    for (v, i, nic, n) in touched_interfaces(networks, vms) {
        let mode = n.network.spec.mode;
        if nic.ports.is_empty() || mode == NetworkMode::Nat {
            continue;
        }
        return Err(invalid(
            format!("VirtualMachine {:?}", v.vm.metadata.name),
            format!("spec.networks[{i}].ports"),
            format!(
                "VirtualNetwork {:?} is {mode}: ports are forwarded only to NAT networks",
                nic.virtual_network_name
            ),
        ));
    }
    Ok(())
}

/// A reserved address on a Bridge network is recorded only within the
/// network's `spec.subnet` (hearth hands out none there, and knows the
/// network's addresses from nothing else): without one, the VM would wait
/// for a lease that is never written.
fn check_bridge_reservations(
    networks: &BTreeMap<String, NetworkView>,
    vms: &BTreeMap<String, VmView>,
) -> Result<(), Refusal> {
    for (v, i, nic, n) in touched_interfaces(networks, vms) {
        let unplaceable = n.network.spec.mode == NetworkMode::Bridge
            && n.subnet().is_none()
            && nic.ip_address.is_some();
        if !unplaceable {
            continue;
        }
        return Err(invalid(
            format!("VirtualMachine {:?}", v.vm.metadata.name),
            format!("spec.networks[{i}].ipAddress"),
            format!(
                "VirtualNetwork {:?} is Bridge with no spec.subnet: hearth keeps a reserved address on a Bridge network only within its subnet; give the network spec.subnet, or leave ipAddress out",
                nic.virtual_network_name
            ),
        ));
    }
    Ok(())
}

/// What each interface of `vm` on `network` asks IPAM for.
pub fn wants_on(network: &str, vm: &VirtualMachine) -> Vec<(Holder, Option<Ipv4Addr>)> {
    vm.spec
        .networks
        .iter()
        .enumerate()
        .filter(|(_, nic)| nic.virtual_network_name == network)
        .map(|(i, nic)| {
            (
                Holder {
                    vm: vm.metadata.name.clone(),
                    interface: i as u32,
                },
                nic.ip_address.as_deref().and_then(|a| a.parse().ok()),
            )
        })
        .collect()
}

/// The stored leases of `network` as IPAM holders.
pub fn stored_on(network: &str, leases: &[StoredLease]) -> Vec<(Holder, Ipv4Addr)> {
    leases
        .iter()
        .filter(|l| l.network == network)
        .map(|l| {
            (
                Holder {
                    vm: l.vm.clone(),
                    interface: l.interface,
                },
                l.ip,
            )
        })
        .collect()
}

fn check_addresses(
    networks: &BTreeMap<String, NetworkView>,
    state: &[Claimant<'_>],
    leases: &[StoredLease],
) -> Result<(), Refusal> {
    for (net_name, n) in networks {
        let Some(subnet) = n.subnet() else {
            // No subnet yet: only the address syntax could be checked (done).
            continue;
        };
        // Running QEMUs and the VMs this apply does not touch claimed
        // first: a clash is the applied VM's.
        let wants: Vec<_> = state
            .iter()
            .flat_map(|c| wants_on(net_name, c.vm))
            // hearth hands out no addresses on a Bridge network.
            .filter(|(_, wanted)| n.network.spec.mode != NetworkMode::Bridge || wanted.is_some())
            .collect();
        let plan = ipam::plan(subnet, stored_on(net_name, leases), &wants);
        let batch_problem = plan.problems.into_iter().find(|(h, _)| {
            state
                .iter()
                .any(|c| c.in_batch && c.vm.metadata.name == h.vm)
        });
        if let Some((holder, e)) = batch_problem {
            return Err(match e {
                IpamError::Taken { .. } | IpamError::Exhausted { .. } => NetworkConflict::Address {
                    vm: holder.vm,
                    index: holder.interface,
                    network: net_name.clone(),
                    reason: e,
                }
                .into(),
                _ => invalid(
                    format!("VirtualMachine {:?}", holder.vm),
                    format!("spec.networks[{}].ipAddress", holder.interface),
                    format!("{e} (VirtualNetwork {net_name:?})"),
                ),
            });
        }
    }
    Ok(())
}

fn check_ports(state: &[Claimant<'_>]) -> Result<(), Refusal> {
    let all: Vec<ports::Forward> = state
        .iter()
        .flat_map(|c| {
            let mut forwards = ports::forwards_of(c.vm);
            if c.held {
                for f in &mut forwards {
                    f.field
                        .push_str(", held by its running QEMU until it restarts");
                }
            }
            forwards
        })
        .collect();
    for c in state.iter().filter(|c| c.in_batch) {
        let mine = ports::forwards_of(c.vm);
        if let Err(e) = ports::check(&mine, &all) {
            return Err(NetworkConflict::Port {
                vm: c.vm.metadata.name.clone(),
                reason: e,
            }
            .into());
        }
    }
    Ok(())
}

fn check_interface_names(
    state: &[Claimant<'_>],
    networks: &BTreeMap<String, NetworkView>,
) -> Result<(), Refusal> {
    let taps = state.iter().flat_map(|c| {
        (0..c.vm.spec.networks.len()).map(move |i| {
            (
                (c.vm.metadata.name.clone(), i),
                names::tap_name(&c.vm.metadata.name, i as u32),
            )
        })
    });
    if let Some(((a, ai), (b, bi), tap)) = names::collisions(taps) {
        return Err(NetworkConflict::TapName {
            vm: b,
            index: bi,
            tap,
            other: a,
            other_index: ai,
        }
        .into());
    }
    for net_name in networks.keys() {
        let macs = state.iter().flat_map(|c| {
            c.vm.spec
                .networks
                .iter()
                .enumerate()
                .filter(|(_, nic)| &nic.virtual_network_name == net_name)
                .filter_map(|(i, _)| {
                    mac_of(c.vm, i).map(|m| ((c.vm.metadata.name.clone(), i), m.to_string()))
                })
                .collect::<Vec<_>>()
        });
        if let Some(((a, ai), (b, bi), mac)) = names::collisions(macs) {
            return Err(NetworkConflict::Mac {
                vm: b,
                index: bi,
                mac,
                other: a,
                other_index: ai,
                network: net_name.clone(),
            }
            .into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::desired::in_effect;
    use crate::runtime::LaunchedInterface;

    fn network(name: &str, subnet: &str) -> (String, NetworkView) {
        network_with(name, &format!("subnet: {subnet}"))
    }

    /// A stored network `name` whose spec is `{SPEC}`.
    fn network_with(name: &str, spec: &str) -> (String, NetworkView) {
        let doc = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: {name}}}\nspec: {{{spec}}}\n"
        );
        let network = match hearth_api::parse_documents(&doc, "test")
            .expect("network")
            .remove(0)
        {
            hearth_api::Object::VirtualNetwork(n) => n,
            other => panic!("not a network: {other:?}"),
        };
        (
            name.to_string(),
            NetworkView {
                network,
                status: Default::default(),
                deleting: false,
                in_batch: false,
            },
        )
    }

    fn bridge_network(name: &str, extra: &str) -> (String, NetworkView) {
        network_with(name, &format!("mode: Bridge, bridge: br0{extra}"))
    }

    #[test]
    fn a_reservation_on_a_bridge_network_needs_its_subnet() {
        let reserving = vm("a", "[{virtualNetworkName: br, ipAddress: 192.168.1.50}]");
        let plain = vm("b", "[{virtualNetworkName: br}]");
        let check_with = |net: (String, NetworkView), net_in_batch: bool, v: VmView| {
            let (name, mut view) = net;
            view.in_batch = net_in_batch;
            let networks = [(name, view)].into_iter().collect();
            let vms = [(v.vm.metadata.name.clone(), v)].into_iter().collect();
            check(&networks, &vms, &[])
        };
        // The VM applied onto a subnet-less Bridge network: refused, naming
        // the VM's field and the network.
        let e = check_with(bridge_network("br", ""), false, applied(reserving.clone()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("VirtualMachine \"a\"")
                && e.contains("spec.networks[0].ipAddress")
                && e.contains("VirtualNetwork \"br\" is Bridge with no spec.subnet"),
            "{e}"
        );
        // The network applied without a subnet under a stored reservation.
        let stored = VmView {
            vm: reserving.clone(),
            in_batch: false,
            running: None,
        };
        assert!(check_with(bridge_network("br", ""), true, stored.clone()).is_err());
        // Neither in the batch: not this apply's to refuse.
        assert!(check_with(bridge_network("br", ""), false, stored).is_ok());
        // With a subnet, or without a reservation: fine.
        let with_subnet = bridge_network("br", ", subnet: 192.168.1.0/24");
        assert_eq!(check_with(with_subnet, false, applied(reserving)), Ok(()));
        assert_eq!(
            check_with(bridge_network("br", ""), false, applied(plain)),
            Ok(())
        );
    }

    fn vm(name: &str, networks: &str) -> VirtualMachine {
        let doc = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  boot: {{kernel: /k}}\n  networks: {networks}\n"
        );
        match hearth_api::parse_documents(&doc, "test")
            .expect("vm")
            .remove(0)
        {
            hearth_api::Object::VirtualMachine(v) => v,
            other => panic!("not a vm: {other:?}"),
        }
    }

    /// `spec` as stored, and a QEMU started from `launched_from` with the
    /// address `ip` on its first interface.
    fn running(spec: VirtualMachine, launched_from: &VirtualMachine, ip: &str) -> VmView {
        let launched: Vec<LaunchedInterface> = launched_from
            .spec
            .networks
            .iter()
            .enumerate()
            .map(|(i, n)| LaunchedInterface {
                spec: n.clone(),
                ip: (i == 0).then(|| ip.parse().expect("ip")),
            })
            .collect();
        VmView {
            running: Some(in_effect(&spec, Some(&launched))),
            vm: spec,
            in_batch: false,
        }
    }

    fn applied(vm: VirtualMachine) -> VmView {
        VmView {
            vm,
            in_batch: true,
            running: None,
        }
    }

    fn lease(network: &str, vm: &VirtualMachine, ip: &str) -> StoredLease {
        StoredLease {
            network: network.into(),
            vm: vm.metadata.name.clone(),
            interface: 0,
            ip: ip.parse().expect("ip"),
            mac: mac_of(vm, 0).expect("mac").to_string(),
        }
    }

    fn networks() -> BTreeMap<String, NetworkView> {
        [
            network("lan", "10.77.0.0/24"),
            network("iso", "10.78.0.0/24"),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn a_running_qemus_address_and_port_are_held_after_its_spec_moves_on() {
        let on_lan = vm(
            "a",
            "[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}]",
        );
        let moved = vm("a", "[{virtualNetworkName: iso}]");
        let leases = [lease("lan", &on_lan, "10.77.0.10")];
        let with = |b: VirtualMachine, a: VmView| -> BTreeMap<String, VmView> {
            [("a".to_string(), a), ("b".to_string(), applied(b))]
                .into_iter()
                .collect()
        };
        // a's spec left lan, but its QEMU still has 10.77.0.10 and 8080.
        let b = vm("b", "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]");
        let held = with(b.clone(), running(moved.clone(), &on_lan, "10.77.0.10"));
        let e = check(&networks(), &held, &leases).unwrap_err().to_string();
        assert!(
            e.contains("10.77.0.10 is already taken by VirtualMachine \"a\""),
            "{e}"
        );
        let b_port = vm(
            "b",
            "[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}]",
        );
        let e = check(
            &networks(),
            &with(
                b_port.clone(),
                running(moved.clone(), &on_lan, "10.77.0.10"),
            ),
            &leases,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("already forwarded to VirtualMachine \"a\"")
                && e.contains("held by its running QEMU until it restarts"),
            "{e}"
        );
        // Once that QEMU is gone, both are free.
        let stopped = VmView {
            vm: moved,
            in_batch: false,
            running: None,
        };
        check(&networks(), &with(b, stopped.clone()), &[]).expect("free address");
        check(&networks(), &with(b_port, stopped), &[]).expect("free port");
    }

    #[test]
    fn a_running_vms_new_networks_are_checked_against_what_others_hold_now() {
        // z's QEMU holds 10.77.0.20, though z's spec now reserves nothing.
        let z_launched = vm("z", "[{virtualNetworkName: lan, ipAddress: 10.77.0.20}]");
        let z = running(
            vm("z", "[{virtualNetworkName: iso}]"),
            &z_launched,
            "10.77.0.20",
        );
        let a_launched = vm("a", "[{virtualNetworkName: lan}]");
        let leases = [
            lease("lan", &z_launched, "10.77.0.20"),
            lease("lan", &a_launched, "10.77.0.10"),
        ];
        // a runs on lan with .10 and is edited to reserve z's address.
        let a_new = vm("a", "[{virtualNetworkName: lan, ipAddress: 10.77.0.20}]");
        let mut a = running(a_new, &a_launched, "10.77.0.10");
        a.in_batch = true;
        let vms: BTreeMap<String, VmView> = [("a".to_string(), a.clone()), ("z".to_string(), z)]
            .into_iter()
            .collect();
        let e = check(&networks(), &vms, &leases).unwrap_err().to_string();
        assert!(
            e.contains("VirtualMachine \"a\": spec.networks[0].ipAddress: 10.77.0.20 is already taken by VirtualMachine \"z\""),
            "{e}"
        );
        // Its own address is no obstacle to its own edit.
        a.vm = vm(
            "a",
            "[{virtualNetworkName: lan, ipAddress: 10.77.0.10, ports: [{hostPort: 22, guestPort: 22}]}]",
        );
        let vms: BTreeMap<String, VmView> = [("a".to_string(), a)].into_iter().collect();
        check(&networks(), &vms, &leases[1..]).expect("a keeps its own address");
    }
}
