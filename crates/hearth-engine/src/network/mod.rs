//! VirtualNetworks: the pure core (names, MACs, subnet picking, IPAM, port
//! forwards) and the network reconcile. The core is plain functions over
//! plain data, so every rule is tested without a host network; the host
//! side (bridges, taps, dnsmasq, nftables: `host/`) is a separate layer on
//! top, not yet driven by the reconcile. See docs/networking.md and
//! docs/networking-host.md.

pub mod admission;
pub mod host;
pub mod ipam;
pub mod names;
pub mod ports;
pub mod subnets;

use std::sync::Arc;

use hearth_api::{EventType, Kind, NetworkPhase, Object, VirtualMachine, VirtualNetworkStatus};

use crate::context::{Context, ReconcileError};
use crate::store::{Store, StoredLease};

/// What the network reconcile says until the host side is built: the object
/// is accepted and its addresses are managed, but nothing exists on the
/// host, so the phase stays Pending (never Ready on an assumption).
pub const NOT_WIRED: &str = "host networking is not wired yet";

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<(), ReconcileError> {
    let Some(stored) = ctx.store.get(Kind::VirtualNetwork, name)? else {
        return Ok(());
    };
    let Object::VirtualNetwork(net) = stored.object else {
        return Ok(());
    };
    if stored.deleting {
        let users = ctx.vms_using_network(name)?;
        if !users.is_empty() {
            // Refused at the API; only if a VM arrived since.
            return Err(ReconcileError::Failed(format!(
                "VirtualNetwork {name:?} is still used by VirtualMachine {}",
                users.join(", ")
            )));
        }
        // Its leases go in the same transaction (Store::remove_tx).
        ctx.store.remove(Kind::VirtualNetwork, name)?;
        ctx.event(
            Kind::VirtualNetwork,
            name,
            EventType::Normal,
            "Deleted",
            "the network and its leases were removed",
        );
        return Ok(());
    }
    let generation = net.metadata.generation;
    let spec_subnet = net.spec.subnet.clone();
    let addresses = ctx.addresses.lock().unwrap_or_else(|p| p.into_inner());
    let problems = ctx.store.with_tx(|tx| {
        let status: VirtualNetworkStatus = Store::get_tx(tx, Kind::VirtualNetwork, name)?
            .and_then(|s| serde_json::from_value(s.status).ok())
            .unwrap_or_default();
        let subnet = spec_subnet.clone().or(status.subnet.clone());
        let mut problems = Vec::new();
        let mut count = 0;
        if let Some(subnet) = subnet.as_deref().and_then(|s| s.parse().ok()) {
            let vms: Vec<VirtualMachine> = Store::list_tx(tx, Kind::VirtualMachine)?
                .into_iter()
                .filter_map(|s| match s.object {
                    Object::VirtualMachine(vm) => Some(vm),
                    _ => None,
                })
                .collect();
            let stored = Store::leases_tx(tx, Some(name))?;
            let reservations_only = net.spec.mode == hearth_api::NetworkMode::Bridge;
            let (leases, p) = plan_leases(name, subnet, reservations_only, &vms, &stored);
            if leases != stored {
                Store::set_network_leases_tx(tx, name, &leases)?;
            }
            count = leases.len();
            problems = p;
        }
        Store::update_status_tx::<VirtualNetworkStatus, _>(tx, Kind::VirtualNetwork, name, |s| {
            s.phase = NetworkPhase::Pending;
            s.message = Some(if problems.is_empty() {
                NOT_WIRED.to_string()
            } else {
                format!("{NOT_WIRED}; {}", problems.join("; "))
            });
            s.leases = u32::try_from(count).unwrap_or(u32::MAX);
            if s.subnet.is_none() {
                s.subnet = spec_subnet.clone();
            }
            s.observed_generation = generation;
        })?;
        Ok(problems)
    })?;
    drop(addresses);
    if !problems.is_empty() {
        tracing::warn!(network = name, ?problems, "interfaces without an address");
    }
    Ok(())
}

/// The leases of network `name` for `vms` (all of them; those without an
/// interface on it hold nothing), given what is stored: the stored leases of
/// interfaces still asking are kept, the others released, new interfaces
/// placed. VMs are taken by name, so the result depends on the state only.
/// Also the interfaces that got nothing, as messages. With
/// `reservations_only` (a Bridge network: its addresses are handed out by
/// whoever runs that network) only given `ipAddress`es are recorded.
pub fn plan_leases(
    name: &str,
    subnet: hearth_api::net::Ipv4Cidr,
    reservations_only: bool,
    vms: &[VirtualMachine],
    stored: &[StoredLease],
) -> (Vec<StoredLease>, Vec<String>) {
    let mut vms: Vec<&VirtualMachine> = vms.iter().collect();
    vms.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let wants: Vec<_> = vms
        .iter()
        .flat_map(|vm| admission::wants_on(name, vm))
        .filter(|(_, wanted)| !reservations_only || wanted.is_some())
        .collect();
    let plan = ipam::plan(subnet, admission::stored_on(name, stored), &wants);
    let by_name: std::collections::HashMap<&str, &VirtualMachine> = vms
        .iter()
        .map(|vm| (vm.metadata.name.as_str(), *vm))
        .collect();
    let mut leases: Vec<StoredLease> = plan
        .leases
        .iter()
        .filter_map(|(ip, holder)| {
            let vm = by_name.get(holder.vm.as_str())?;
            let mac = admission::mac_of(vm, holder.interface as usize)?;
            Some(StoredLease {
                network: name.to_string(),
                vm: holder.vm.clone(),
                interface: holder.interface,
                ip,
                mac: mac.to_string(),
            })
        })
        .collect();
    leases.sort();
    let problems = plan
        .problems
        .iter()
        .map(|(h, e)| format!("{h}: {e}"))
        .collect();
    (leases, problems)
}
