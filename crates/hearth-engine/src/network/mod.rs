//! VirtualNetworks: the pure core (names, MACs, subnet picking, IPAM, port
//! forwards) and the network reconcile. The core is plain functions over
//! plain data, so every rule is tested without a host network; the host
//! side (bridges, taps, dnsmasq, nftables: `host/`) is a separate layer on
//! top, driven by the reconcile through `sync` (the whole host made to
//! match the store). See docs/networking.md.

pub mod admission;
pub mod desired;
mod error;
pub mod host;
pub mod ipam;
pub mod names;
pub mod ports;
pub mod subnets;
pub mod sync;

#[cfg(test)]
mod recovery_model;

use std::collections::BTreeSet;
use std::sync::Arc;

use hearth_api::{EventType, Kind, NetworkPhase, Object, VirtualMachine, VirtualNetworkStatus};

use crate::context::{Action, Context, ReconcileError};
use crate::store::{Store, StoredLease};
pub use error::NetworkError;

pub async fn reconcile(ctx: &Arc<Context>, name: &str) -> Result<Action, ReconcileError> {
    // The whole reconcile holds the host lock: two networks never pick the
    // same subnet, and the host is changed by one resync at a time.
    let mut host = ctx.networking.lock().await;
    let Some(stored) = ctx.store.get(Kind::VirtualNetwork, name)? else {
        return Ok(Action::Done);
    };
    let Object::VirtualNetwork(net) = stored.object else {
        return Ok(Action::Done);
    };
    if stored.deleting {
        let users = desired::vms_using_network(&ctx.store, name)?;
        if !users.is_empty() {
            // Refused at the API; only if a VM arrived since.
            return Err(ReconcileError::Failed(format!(
                "VirtualNetwork {name:?} is still used by VirtualMachine {}",
                users.join(", ")
            )));
        }
        // The host first (a network being deleted is left out of the
        // desired state): its bridge, dnsmasq and rules go, and only then
        // the object, so a failure leaves something that is retried.
        sync::resync(ctx, &mut host).await.map_err(|e| {
            ReconcileError::Failed(format!(
                "VirtualNetwork {name:?}: cannot remove it from the host: {e}"
            ))
        })?;
        // Its leases go in the same transaction (Store::remove_tx).
        ctx.store.remove(Kind::VirtualNetwork, name)?;
        ctx.event(
            Kind::VirtualNetwork,
            name,
            EventType::Normal,
            "Deleted",
            "its bridge, DHCP server and rules are gone from the host; the network and its leases were removed",
        );
        return Ok(Action::Done);
    }
    let generation = net.metadata.generation;
    let old: VirtualNetworkStatus = serde_json::from_value(stored.status).unwrap_or_default();
    let subnet = match subnet_of(ctx, &mut host, &net, &old).await {
        Ok(s) => s,
        Err(e) => {
            let message = e.to_string();
            fail(ctx, name, generation, &message);
            return Err(ReconcileError::Failed(message));
        }
    };
    let addresses = ctx.addresses.lock().unwrap_or_else(|p| p.into_inner());
    let problems = ctx.store.with_tx(|tx| {
        let mut problems = Vec::new();
        let mut count = 0;
        if let Some(subnet) = subnet {
            let vms: Vec<VirtualMachine> = Store::list_tx(tx, Kind::VirtualMachine)?
                .into_iter()
                .filter_map(|s| match s.object {
                    Object::VirtualMachine(vm) => Some(vm),
                    _ => None,
                })
                .collect();
            // A running QEMU keeps the addresses it was started with.
            let launched =
                desired::launched_by_vm(&Store::runtimes_tx(tx)?, &Store::launches_tx(tx, None)?);
            let vms = desired::vms_in_effect(&vms, &launched);
            let running: BTreeSet<String> = launched.keys().cloned().collect();
            let stored = Store::leases_tx(tx, Some(name))?;
            let reservations_only = net.spec.mode == hearth_api::NetworkMode::Bridge;
            let (leases, p) =
                plan_leases_in_effect(name, subnet, reservations_only, &vms, &running, &stored);
            if leases != stored {
                Store::set_network_leases_tx(tx, name, &leases)?;
            }
            count = leases.len();
            problems = p;
        }
        Store::update_status_tx::<VirtualNetworkStatus, _>(tx, Kind::VirtualNetwork, name, |s| {
            s.leases = u32::try_from(count).unwrap_or(u32::MAX);
            // Kept from now on: a picked subnet never changes.
            s.subnet = subnet.map(|s| s.to_string());
        })?;
        Ok(problems)
    })?;
    drop(addresses);
    if !problems.is_empty() {
        tracing::warn!(network = name, ?problems, "interfaces without an address");
    }
    if net.spec.mode == hearth_api::NetworkMode::Bridge {
        let bridge = net.spec.bridge.clone().unwrap_or_default();
        let found = match host.netlink() {
            Ok(nl) => nl.observe_all().await.map(|links| {
                links
                    .iter()
                    .any(|l| l.name == bridge && l.kind == host::link::LinkKind::Bridge)
            }),
            Err(e) => Err(e),
        };
        match found {
            Ok(true) => {}
            Ok(false) => {
                let message = format!(
                    "spec.bridge: the host has no bridge {bridge:?} (a Bridge network joins an existing one; hearth does not create it)"
                );
                fail(ctx, name, generation, &message);
                return Err(ReconcileError::Failed(message));
            }
            Err(e) => {
                let message = format!("cannot list the host's links: {e}");
                fail(ctx, name, generation, &message);
                return Err(ReconcileError::Failed(message));
            }
        }
    }
    if let Err(e) = sync::resync(ctx, &mut host).await {
        let message = format!("cannot set up the host side: {e}");
        fail(ctx, name, generation, &message);
        return Err(ReconcileError::Failed(message));
    }
    drop(host);
    let bridge = desired::host_bridge(&net);
    let gateway = match net.spec.mode {
        hearth_api::NetworkMode::Bridge => None,
        _ => subnet.map(|s| s.gateway().to_string()),
    };
    let now_ready = old.phase != NetworkPhase::Ready;
    ctx.store
        .update_status::<VirtualNetworkStatus, _>(Kind::VirtualNetwork, name, |s| {
            s.phase = NetworkPhase::Ready;
            s.bridge = Some(bridge.clone());
            s.gateway = gateway.clone();
            s.message = (!problems.is_empty()).then(|| problems.join("; "));
            s.observed_generation = generation;
        })?;
    if now_ready {
        ctx.event(
            Kind::VirtualNetwork,
            name,
            EventType::Normal,
            "Ready",
            &match &subnet {
                Some(s) => format!("bridge {bridge} is up with subnet {s}"),
                None => format!("VMs join the host's bridge {bridge}"),
            },
        );
    }
    // VMs waiting for this network start now; running ones update their
    // interfaces.
    for vm in desired::vms_using_network(&ctx.store, name)? {
        ctx.wake(Kind::VirtualMachine, &vm);
    }
    Ok(Action::Done)
}

fn fail(ctx: &Context, name: &str, generation: u64, message: &str) {
    if let Err(e) =
        ctx.store
            .update_status::<VirtualNetworkStatus, _>(Kind::VirtualNetwork, name, |s| {
                s.phase = NetworkPhase::Failed;
                s.message = Some(message.to_string());
                s.observed_generation = generation;
            })
    {
        tracing::warn!(network = name, error = %e, "cannot write status");
    }
    ctx.event(
        Kind::VirtualNetwork,
        name,
        EventType::Warning,
        "Failed",
        message,
    );
}

/// The network's subnet: given, or picked before and kept in its status,
/// or picked now from the pool (one that no other network and nothing on
/// the host uses). A NAT or Isolated subnet must not overlap the host's
/// addresses and routes (other networks are checked at apply). `None` only
/// for a Bridge network without `spec.subnet`.
async fn subnet_of(
    ctx: &Context,
    host: &mut host::lock::HostGuard<'_>,
    net: &hearth_api::VirtualNetwork,
    old: &VirtualNetworkStatus,
) -> Result<Option<hearth_api::net::Ipv4Cidr>, NetworkError> {
    let given = net.spec.subnet.as_deref().or(old.subnet.as_deref());
    let given = match given {
        Some(s) => Some(
            s.parse::<hearth_api::net::Ipv4Cidr>()
                .map_err(NetworkError::SubnetSyntax)?,
        ),
        None => None,
    };
    if net.spec.mode == hearth_api::NetworkMode::Bridge {
        return Ok(given);
    }
    let host_nets: Vec<subnets::HostNet> = host
        .netlink()?
        .host_networks()
        .await
        .map_err(NetworkError::HostNetworks)?
        .into_iter()
        .map(|(ip, len, what)| subnets::HostNet {
            cidr: hearth_api::net::Ipv4Cidr::new_truncating(ip, len),
            what,
        })
        .collect();
    match given {
        Some(s) => {
            subnets::check(s, &[], &host_nets).map_err(NetworkError::SubnetRefused)?;
            Ok(Some(s))
        }
        None => {
            let view = sync::StoreView::read(ctx)?;
            let others: Vec<(String, hearth_api::net::Ipv4Cidr)> = sync::known_subnets(&view)
                .into_iter()
                .filter(|(n, _)| *n != net.metadata.name)
                .collect();
            let picked = subnets::pick(&others, &host_nets)?;
            ctx.event(
                Kind::VirtualNetwork,
                &net.metadata.name,
                EventType::Normal,
                "SubnetPicked",
                &format!("picked {picked}: no other network and nothing on the host uses it"),
            );
            Ok(Some(picked))
        }
    }
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
    plan_leases_in_effect(
        name,
        subnet,
        reservations_only,
        vms,
        &BTreeSet::new(),
        stored,
    )
}

/// [`plan_leases`] over VMs with their networks in effect
/// ([`desired::in_effect`]): `running` names those whose QEMU was started
/// with interfaces. Their claims (each pinned to the address it was started
/// with) are placed before any other VM's, so an address a running guest
/// uses is never planned for another VM.
pub fn plan_leases_in_effect(
    name: &str,
    subnet: hearth_api::net::Ipv4Cidr,
    reservations_only: bool,
    vms: &[VirtualMachine],
    running: &BTreeSet<String>,
    stored: &[StoredLease],
) -> (Vec<StoredLease>, Vec<String>) {
    let mut vms: Vec<&VirtualMachine> = vms.iter().collect();
    vms.sort_by(|a, b| {
        let key = |vm: &VirtualMachine| {
            (
                !running.contains(&vm.metadata.name),
                vm.metadata.name.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(name: &str, networks: &str) -> VirtualMachine {
        let doc = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  boot: {{kernel: /k}}\n  networks: {networks}\n"
        );
        match hearth_api::parse_documents(&doc, "test")
            .expect("vm")
            .remove(0)
        {
            Object::VirtualMachine(v) => v,
            other => panic!("not a vm: {other:?}"),
        }
    }

    #[test]
    fn a_running_qemus_address_is_planned_before_any_reservation() {
        let subnet = "10.77.0.0/24".parse().unwrap();
        let z = vm("z", "[{virtualNetworkName: lan}]");
        let (stored, _) = plan_leases("lan", subnet, false, std::slice::from_ref(&z), &[]);
        assert_eq!(stored[0].ip.to_string(), "10.77.0.10");
        let launched: std::collections::BTreeMap<_, _> = [(
            "z".to_string(),
            desired::to_launch(&z, &stored, |_| true).unwrap(),
        )]
        .into_iter()
        .collect();
        // z's spec leaves lan while its QEMU runs; "a" (first by name)
        // reserves z's address.
        let a = vm("a", "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]");
        let vms = desired::vms_in_effect(&[a, vm("z", "[]")], &launched);
        let running: BTreeSet<String> = launched.keys().cloned().collect();
        let (leases, problems) =
            plan_leases_in_effect("lan", subnet, false, &vms, &running, &stored);
        assert_eq!(leases.len(), 1);
        assert_eq!(
            (leases[0].vm.as_str(), leases[0].ip.to_string().as_str()),
            ("z", "10.77.0.10")
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("taken by VirtualMachine \"z\""),
            "{problems:?}"
        );
        // Once z's QEMU is gone, its spec is in effect: the address moves to a.
        let vms = desired::vms_in_effect(
            &[
                vm("a", "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]"),
                vm("z", "[]"),
            ],
            &Default::default(),
        );
        let (leases, problems) =
            plan_leases_in_effect("lan", subnet, false, &vms, &BTreeSet::new(), &leases);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(leases[0].vm, "a");
    }
}
