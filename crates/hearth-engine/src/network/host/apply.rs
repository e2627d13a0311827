//! Applying the whole desired state: bridges, taps, dnsmasq, forwarding and
//! the nftables table, in that order (dnsmasq binds to an existing, addressed
//! bridge; taps join existing bridges).

use std::path::Path;

use super::dnsmasq::{self, DnsmasqFiles, DnsmasqOutcome};
use super::link::{LinkChange, Netlink};
use super::{HostDesired, HostError, cleanup, network_dir, nft};

/// What one apply changed. Empty (see [`ApplyReport::changed`]) when the host
/// already matched.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub links: Vec<LinkChange>,
    /// Per bridge, what its dnsmasq needed.
    pub dnsmasq: Vec<(String, DnsmasqOutcome)>,
    pub nft_changed: bool,
    pub ip_forward_set: bool,
}

impl ApplyReport {
    pub fn changed(&self) -> bool {
        !self.links.is_empty()
            || self.nft_changed
            || self.ip_forward_set
            || self
                .dnsmasq
                .iter()
                .any(|(_, o)| !matches!(o, DnsmasqOutcome::Unchanged { .. }))
    }
}

/// Creates or corrects everything `desired` names. Removes nothing: see
/// [`resync`] and [`cleanup::run`].
pub async fn apply(
    nl: &Netlink,
    desired: &HostDesired,
    networks_dir: &Path,
) -> Result<ApplyReport, HostError> {
    desired.validate()?;
    let mut report = ApplyReport::default();
    for net in &desired.networks {
        if let Some(bridge) = net.managed_bridge() {
            report.links.extend(
                nl.ensure_bridge(bridge, net.gateway, net.prefix_len)
                    .await?,
            );
        }
    }
    for tap in &desired.taps {
        report
            .links
            .extend(nl.ensure_tap(&tap.name, &tap.bridge).await?);
    }
    for net in desired.networks.iter().filter(|n| n.runs_dnsmasq()) {
        let files = DnsmasqFiles::new(network_dir(networks_dir, &net.bridge));
        report
            .dnsmasq
            .push((net.bridge.clone(), dnsmasq::ensure(net, &files).await?));
    }
    report.ip_forward_set = nft::ensure_ip_forward(&desired.networks)?;
    // Without a NAT or Isolated network there is no table to write; one
    // left over goes in the clean-up. A host where hearth has no network
    // never sees the table appear.
    if desired
        .networks
        .iter()
        .any(|n| n.managed_bridge().is_some())
    {
        report.nft_changed = nft::apply(&desired.networks).await?;
    }
    Ok(report)
}

/// [`apply`], then [`cleanup::run`]: afterwards the host holds exactly the
/// desired hearth objects.
pub async fn resync(
    nl: &Netlink,
    desired: &HostDesired,
    networks_dir: &Path,
) -> Result<(ApplyReport, Vec<cleanup::CleanupAction>), HostError> {
    let report = apply(nl, desired, networks_dir).await?;
    let removed = cleanup::run(nl, desired, networks_dir).await?;
    Ok((report, removed))
}
