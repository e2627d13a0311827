//! VirtualNetworks: the pure core (names, MACs, subnet picking, IPAM, port
//! forwards) and the network reconcile. The core is plain functions over
//! plain data, so every rule is tested without a host network; the host
//! side (bridges, taps, dnsmasq, nftables) is a separate layer on top.
//! See docs/networking.md.

pub mod admission;
pub mod ipam;
pub mod names;
pub mod ports;
pub mod subnets;

use std::sync::Arc;

use hearth_api::{EventType, Kind, NetworkPhase, Object, VirtualNetworkStatus};

use crate::context::{Context, ReconcileError};

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
    let leases = ctx.store.leases_of_network(name)?.len();
    let generation = net.metadata.generation;
    let subnet = net.spec.subnet.clone();
    let update =
        ctx.store
            .update_status::<VirtualNetworkStatus, _>(Kind::VirtualNetwork, name, |s| {
                s.phase = NetworkPhase::Pending;
                s.message = Some(NOT_WIRED.to_string());
                s.leases = u32::try_from(leases).unwrap_or(u32::MAX);
                if s.subnet.is_none() {
                    s.subnet = subnet;
                }
                s.observed_generation = generation;
            });
    if let Err(e) = update {
        tracing::warn!(network = name, error = %e, "cannot write status");
    }
    Ok(())
}
