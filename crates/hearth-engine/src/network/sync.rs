//! The thin shell that makes the host match the store: it reads every
//! network, VM and lease, asks [`desired::host_desired`] what the host must
//! have, and runs [`host::resync`] (apply, then clean up what nothing asks
//! for). Always the whole host, never a piece: after any resync the host has
//! exactly hearth's desired bridges, taps, dnsmasqs and table, whatever a
//! crash left behind.
//!
//! One resync runs at a time ([`HostNetworking::lock`]); network reconciles
//! hold the lock for their whole run, so two networks never pick the same
//! subnet, and a VM launch holds it while its taps are made.

use std::collections::BTreeMap;

use hearth_api::net::Ipv4Cidr;
use hearth_api::{Kind, Object, VirtualMachine, VirtualNetwork, VirtualNetworkStatus};

use super::desired::{self, StoredNetwork};
use super::host::cleanup::CleanupAction;
use super::host::lock::HostGuard;
use super::host::{self, ApplyReport, HostError};
use crate::context::Context;
use crate::store::{StoreError, StoredLease};

/// Store counter bumped once the host has had a hearth network: from then
/// on a start-up resync cleans up, even when no network is left.
const USED_COUNTER: &str = "host-networking-used";

/// Why a resync did not happen or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// What the store holds that the host side depends on.
pub struct StoreView {
    pub networks: Vec<(VirtualNetwork, bool, Option<Ipv4Cidr>)>,
    /// Every VM with its networks in effect ([`desired::in_effect`]): those
    /// whose QEMU was started with interfaces first, so that what a running
    /// QEMU has is never given to another VM.
    pub vms: Vec<VirtualMachine>,
    pub leases: Vec<StoredLease>,
}

impl StoreView {
    pub fn read(ctx: &Context) -> Result<StoreView, StoreError> {
        let mut networks = Vec::new();
        for s in ctx.store.list(Kind::VirtualNetwork)? {
            if let Object::VirtualNetwork(net) = s.object {
                let status: VirtualNetworkStatus =
                    serde_json::from_value(s.status).unwrap_or_default();
                let subnet = net
                    .spec
                    .subnet
                    .as_deref()
                    .or(status.subnet.as_deref())
                    .and_then(|s| s.parse().ok());
                networks.push((net, s.deleting, subnet));
            }
        }
        let launched = desired::launched_by_vm(&ctx.store.runtimes()?, &ctx.store.launches(None)?);
        let vms = desired::networked_vms(&ctx.store, &launched)?;
        Ok(StoreView {
            networks,
            vms: desired::running_first(desired::vms_in_effect(&vms, &launched), &launched),
            leases: ctx.store.leases()?,
        })
    }

    pub fn desired(&self, dns_upstream: &std::path::Path) -> host::HostDesired {
        let stored: Vec<StoredNetwork<'_>> = self
            .networks
            .iter()
            .map(|(network, deleting, subnet)| StoredNetwork {
                network,
                deleting: *deleting,
                subnet: *subnet,
            })
            .collect();
        desired::host_desired(&stored, &self.vms, &self.leases, dns_upstream)
    }
}

/// Makes the host match the store. The caller holds the guard.
pub async fn resync(
    ctx: &Context,
    guard: &mut HostGuard<'_>,
) -> Result<(ApplyReport, Vec<CleanupAction>), SyncError> {
    let view = StoreView::read(ctx)?;
    let want = view.desired(&ctx.config.dns_resolv_file);
    if !want.networks.is_empty() && ctx.store.counter(USED_COUNTER)? == 0 {
        ctx.store.next_counter(USED_COUNTER)?;
    }
    let dir = ctx.config.networks_dir();
    let nl = guard.netlink()?;
    // A Bridge network whose host bridge is missing (not made yet, or gone)
    // would fail every tap on it, and so the whole apply: its taps are not
    // made, and the rest of the host goes on. The network's own reconcile
    // says Failed, naming the bridge. Clean-up still counts them as wanted,
    // so a running VM's tap is never taken away.
    let links = nl.observe_all().await?;
    let mut apply_want = want.clone();
    let missing: Vec<String> = apply_want
        .networks
        .iter()
        .filter_map(|n| match &n.mode {
            host::NetworkMode::Bridge { existing }
                if !links
                    .iter()
                    .any(|l| l.name == *existing && l.kind == host::link::LinkKind::Bridge) =>
            {
                Some(existing.clone())
            }
            _ => None,
        })
        .collect();
    apply_want.taps.retain(|t| !missing.contains(&t.bridge));
    let report = host::apply(nl, &apply_want, &dir).await?;
    let removed = host::cleanup::run(nl, &want, &dir).await?;
    // A port taken on 127.0.0.1 by another program fails only that
    // listener, not the network; the next resync tries again.
    for (f, e) in guard
        .state
        .loopback
        .sync(&want.networks, &ctx.config.forwards)
    {
        tracing::warn!(
            listen = %f.listen,
            guest = %f.guest,
            error = %e,
            "cannot listen for a port forward on the loopback address; tried again at the next resync"
        );
    }
    if report.changed() {
        tracing::info!(?report, "host networking changed");
    }
    for action in &removed {
        tracing::info!(
            ?action,
            "removed from the host: nothing in the store asks for it"
        );
    }
    Ok((report, removed))
}

/// At start-up: if this store ever had a network, the host is brought to
/// what the store says now, so a crash's leftovers (taps of deleted VMs, a
/// bridge of a deleted network, a stray dnsmasq) go before anything starts.
/// A store that never had one touches nothing (the host may run another
/// hearthd's networks, or none).
pub async fn startup(ctx: &Context) {
    let needed = match (
        ctx.store.counter(USED_COUNTER),
        ctx.store.list(Kind::VirtualNetwork),
    ) {
        (Ok(n), Ok(nets)) => n > 0 || !nets.is_empty(),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "cannot read the store for the start-up network resync");
            return;
        }
    };
    if !needed {
        return;
    }
    let mut guard = ctx.networking.lock().await;
    match resync(ctx, &mut guard).await {
        Ok((_, removed)) => tracing::info!(
            removed = removed.len(),
            "start-up network resync: the host matches the store"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "start-up network resync failed; the network reconciles retry")
        }
    }
}

/// Every network's subnet, given or picked, by name: what a new one must
/// not overlap.
pub fn known_subnets(view: &StoreView) -> BTreeMap<String, Ipv4Cidr> {
    view.networks
        .iter()
        .filter_map(|(n, _, s)| Some((n.metadata.name.clone(), (*s)?)))
        .collect()
}
