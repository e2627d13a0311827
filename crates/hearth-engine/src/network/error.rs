//! Why a network cannot be put in place, or an interface start on it.

use super::{host, subnets};
use crate::store::StoreError;

/// Why a network cannot be put in place, or why an interface of a VM
/// cannot start on its network yet.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("spec.subnet: {0}")]
    SubnetSyntax(String),
    #[error("spec.subnet: {0}")]
    SubnetRefused(#[source] subnets::SubnetError),
    #[error(transparent)]
    NoSubnetLeft(#[from] subnets::SubnetError),
    #[error(transparent)]
    Host(#[from] host::HostError),
    #[error("cannot read the host's addresses and routes: {0}")]
    HostNetworks(#[source] host::HostError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "spec.networks[{index}]: its address on VirtualNetwork {network:?} is still leased to the MAC {mac} it had"
    )]
    LeasedToOldMac {
        index: usize,
        network: String,
        mac: String,
    },
    #[error(
        "spec.networks[{index}]: {reserved} is not leased to it on VirtualNetwork {network:?} yet{}",
        still.map(|ip| format!(" (it still has {ip})")).unwrap_or_default()
    )]
    ReservationNotLeased {
        index: usize,
        network: String,
        reserved: std::net::Ipv4Addr,
        still: Option<std::net::Ipv4Addr>,
    },
    #[error("spec.networks[{index}]: no address on VirtualNetwork {network:?} yet")]
    NoAddressYet { index: usize, network: String },
}
