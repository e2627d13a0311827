//! The cross-object checks of an apply that involve networks, over the state
//! the apply would leave: the stored objects with the batch's on top. Each
//! refusal names the object, the field and the other holder; the engine
//! refuses the whole apply, so nothing changes.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use hearth_api::net::{Ipv4Cidr, MacAddr};
use hearth_api::{FieldError, NetworkMode, VirtualMachine, VirtualNetwork, VirtualNetworkStatus};

use super::ipam::{self, Holder, IpamError};
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
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Bad input against this host's objects (HTTP 422).
    #[error("{0}")]
    Invalid(FieldError),
    /// Held by another object (HTTP 409).
    #[error("{0}")]
    Conflict(String),
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
        return Err(Refusal::Conflict(format!(
            "{who}: spec.subnet: cannot move from {old_subnet} to {new_subnet} while {leases} VM interface(s) hold addresses in it; remove them from the network first"
        )));
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
    check_addresses(networks, vms, leases)?;
    check_forwards_only_to_nat(networks, vms)?;
    check_ports(vms)?;
    check_interface_names(vms, networks)?;
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
            return Err(Refusal::Conflict(format!(
                "VirtualNetwork {name:?}: spec.subnet: {e}"
            )));
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
        return Err(Refusal::Conflict(format!(
            "VirtualNetwork {b:?}: metadata.name: its bridge name {bridge:?} is the one of VirtualNetwork {a:?}; choose another name"
        )));
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
            return Err(Refusal::Conflict(format!(
                "VirtualMachine {:?}: spec.networks[{i}].virtualNetworkName: VirtualNetwork {:?} is being deleted",
                vm.metadata.name, nic.virtual_network_name
            )));
        }
    }
    Ok(())
}

/// Port forwards exist only on NAT networks: an Isolated network is
/// reachable from nothing outside it, and a Bridge network's addresses are
/// someone else's. Checked whichever of the two comes in the batch.
fn check_forwards_only_to_nat(
    networks: &BTreeMap<String, NetworkView>,
    vms: &BTreeMap<String, VmView>,
) -> Result<(), Refusal> {
    for v in vms.values() {
        for (i, nic) in v.vm.spec.networks.iter().enumerate() {
            let Some(n) = networks.get(&nic.virtual_network_name) else {
                continue;
            };
            let mode = n.network.spec.mode;
            if nic.ports.is_empty() || mode == NetworkMode::Nat || !(v.in_batch || n.in_batch) {
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
    vms: &BTreeMap<String, VmView>,
    leases: &[StoredLease],
) -> Result<(), Refusal> {
    for (net_name, n) in networks {
        let Some(subnet) = n.subnet() else {
            // No subnet yet: only the address syntax could be checked (done).
            continue;
        };
        // The VMs this apply does not touch claimed first: a clash is the
        // applied VM's.
        let wants: Vec<_> = vms
            .values()
            .filter(|v| !v.in_batch)
            .chain(vms.values().filter(|v| v.in_batch))
            .flat_map(|v| wants_on(net_name, &v.vm))
            // hearth hands out no addresses on a Bridge network.
            .filter(|(_, wanted)| n.network.spec.mode != NetworkMode::Bridge || wanted.is_some())
            .collect();
        let plan = ipam::plan(subnet, stored_on(net_name, leases), &wants);
        let batch_problem = plan
            .problems
            .into_iter()
            .find(|(h, _)| vms.get(&h.vm).is_some_and(|v| v.in_batch));
        if let Some((holder, e)) = batch_problem {
            let object = format!("VirtualMachine {:?}", holder.vm);
            let field = format!("spec.networks[{}].ipAddress", holder.interface);
            let message = format!("{e} (VirtualNetwork {net_name:?})");
            return Err(match e {
                IpamError::Taken { .. } | IpamError::Exhausted { .. } => {
                    Refusal::Conflict(format!("{object}: {field}: {message}"))
                }
                _ => invalid(object, field, message),
            });
        }
    }
    Ok(())
}

fn check_ports(vms: &BTreeMap<String, VmView>) -> Result<(), Refusal> {
    let all: Vec<ports::Forward> = vms
        .values()
        .flat_map(|v| ports::forwards_of(&v.vm))
        .collect();
    for v in vms.values().filter(|v| v.in_batch) {
        let mine = ports::forwards_of(&v.vm);
        if let Err(e) = ports::check(&mine, &all) {
            return Err(Refusal::Conflict(format!(
                "VirtualMachine {:?}: {e}",
                v.vm.metadata.name
            )));
        }
    }
    Ok(())
}

/// The MAC of interface `i`: the one given, else the derived one.
pub fn mac_of(vm: &VirtualMachine, i: usize) -> Option<MacAddr> {
    match &vm.spec.networks.get(i)?.mac_address {
        Some(m) => m.parse().ok(),
        None => Some(names::derived_mac(&vm.metadata.name, i as u32)),
    }
}

fn check_interface_names(
    vms: &BTreeMap<String, VmView>,
    networks: &BTreeMap<String, NetworkView>,
) -> Result<(), Refusal> {
    let taps = vms.values().flat_map(|v| {
        (0..v.vm.spec.networks.len()).map(move |i| {
            (
                (v.vm.metadata.name.clone(), i),
                names::tap_name(&v.vm.metadata.name, i as u32),
            )
        })
    });
    if let Some(((a, ai), (b, bi), tap)) = names::collisions(taps) {
        return Err(Refusal::Conflict(format!(
            "VirtualMachine {b:?}: spec.networks[{bi}]: its tap name {tap:?} is the one of VirtualMachine {a:?} spec.networks[{ai}]; choose another VM name"
        )));
    }
    for net_name in networks.keys() {
        let macs = vms.values().flat_map(|v| {
            v.vm.spec
                .networks
                .iter()
                .enumerate()
                .filter(|(_, nic)| &nic.virtual_network_name == net_name)
                .filter_map(|(i, _)| {
                    mac_of(&v.vm, i).map(|m| ((v.vm.metadata.name.clone(), i), m.to_string()))
                })
                .collect::<Vec<_>>()
        });
        if let Some(((a, ai), (b, bi), mac)) = names::collisions(macs) {
            return Err(Refusal::Conflict(format!(
                "VirtualMachine {b:?}: spec.networks[{bi}].macAddress: {mac} is also the MAC of VirtualMachine {a:?} spec.networks[{ai}] on VirtualNetwork {net_name:?}"
            )));
        }
    }
    Ok(())
}
