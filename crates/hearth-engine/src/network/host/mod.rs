//! The host side of hearth's networks: bridges and taps (netlink), one
//! dnsmasq per network (DHCP with hearth's leases as static hosts) and one
//! nftables table (`inet hearth`) for NAT, isolation and port forwards.
//!
//! This module takes plain data ([`HostDesired`]) and knows nothing of the
//! API kinds or the store. Every function observes the host before acting and
//! is idempotent: applying the same desired state twice changes nothing
//! (docs/networking.md).
//!
//! Names carry a prefix so that hearth's objects are recognisable after a
//! crash: bridges start with [`BRIDGE_PREFIX`], taps with [`TAP_PREFIX`].
//! Nothing without the prefix, and nothing outside the `inet hearth` table, is
//! ever changed or removed.

pub mod apply;
pub mod cleanup;
pub mod dnsmasq;
pub mod link;
pub mod lock;
pub mod loopback;
pub mod nft;

pub use apply::{ApplyReport, apply, resync};

use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// Prefix of every bridge hearth creates (`network::names` makes them):
/// what start-up cleanup may remove, so nothing of the host's that merely
/// starts with `hth` is taken for hearth's.
pub const BRIDGE_PREFIX: &str = "hth-";
/// Prefix of every tap hearth creates.
pub const TAP_PREFIX: &str = "htt-";
/// Linux's limit on an interface name (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// The whole desired host-side state: every network and every tap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostDesired {
    pub networks: Vec<HostNetwork>,
    pub taps: Vec<DesiredTap>,
}

/// One network as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNetwork {
    /// The bridge hearth owns (prefix `hth-`). Unused for [`NetworkMode::Bridge`].
    pub bridge: String,
    /// The gateway: the bridge's own address.
    pub gateway: Ipv4Addr,
    /// Prefix length of the subnet (the gateway's network).
    pub prefix_len: u8,
    pub mode: NetworkMode,
    /// Run dnsmasq for DHCP on the bridge (never in `Bridge` mode).
    pub dhcp: bool,
    /// What its dnsmasq answers on DNS (only with `dhcp`).
    pub dns: Dns,
    pub static_leases: Vec<StaticLease>,
    pub port_forwards: Vec<PortForward>,
}

/// A network's DNS server (its dnsmasq, on the gateway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dns {
    /// None (`port=0`); DHCP hands out no DNS server.
    Off,
    /// The network's VMs by name, nothing else: an Isolated network's
    /// guests reach nothing outside, their queries neither.
    Local,
    /// The VMs by name, every other name from the `nameserver`s of this
    /// resolver file.
    Forward(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetworkMode {
    /// Masqueraded to the outside; inbound only through port forwards.
    Nat,
    /// VMs reach each other and the gateway, nothing else.
    Isolated,
    /// Taps join an existing host bridge that hearth neither creates nor
    /// changes; no DHCP, no rules.
    Bridge { existing: String },
}

/// A MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// An address hearth's IPAM gave to a MAC; dnsmasq serves it as a static host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticLease {
    pub mac: Mac,
    pub ip: Ipv4Addr,
    pub hostname: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn as_nft(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// A forward from a host port to a guest port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortForward {
    pub protocol: Protocol,
    /// Only connections to this host address; `None`: any local address.
    pub host_addr: Option<Ipv4Addr>,
    pub host_port: u16,
    pub guest_ip: Ipv4Addr,
    pub guest_port: u16,
}

/// A persistent tap (prefix `htt-`) enslaved to a bridge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredTap {
    pub name: String,
    /// The bridge to join: a network's `hth-` bridge, or the existing bridge of
    /// a `Bridge` network.
    pub bridge: String,
}

/// Bad desired state: names the object and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{object}: {field}: {reason}")]
pub struct InvalidDesired {
    pub object: String,
    pub field: &'static str,
    pub reason: String,
}

/// Any failure on the host side.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Invalid(#[from] InvalidDesired),
    #[error("netlink: {what}")]
    Netlink {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {detail}")]
    Command { what: String, detail: String },
}

impl HostError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        HostError::Io {
            what: what.into(),
            source,
        }
    }
}

/// Checks an interface name: the prefix, the length, and characters that are
/// safe in a dnsmasq config line and an nft string.
pub fn check_ifname(
    object: &str,
    field: &'static str,
    name: &str,
    prefix: Option<&str>,
) -> Result<(), InvalidDesired> {
    let bad = |reason: String| InvalidDesired {
        object: object.to_string(),
        field,
        reason,
    };
    if name.is_empty() || name.len() > IFNAME_MAX {
        return Err(bad(format!(
            "interface name {name:?} must be 1 to {IFNAME_MAX} bytes"
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(bad(format!(
            "interface name {name:?} may hold only ASCII letters, digits, '-', '_' and '.'"
        )));
    }
    if let Some(p) = prefix
        && !name.starts_with(p)
    {
        return Err(bad(format!(
            "interface name {name:?} must start with {p:?}"
        )));
    }
    Ok(())
}

fn check_hostname(object: &str, name: &str) -> Result<(), InvalidDesired> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(InvalidDesired {
            object: object.to_string(),
            field: "staticLeases.hostname",
            reason: format!("{name:?} is not a DNS label (1 to 63 letters, digits and '-')"),
        })
    }
}

impl HostNetwork {
    /// The first address of the subnet.
    pub fn subnet_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.gateway) & prefix_mask(self.prefix_len))
    }

    /// `a.b.c.d/len`
    pub fn subnet_cidr(&self) -> String {
        format!("{}/{}", self.subnet_addr(), self.prefix_len)
    }

    /// The bridge hearth manages for this network, if any (not in `Bridge` mode).
    pub fn managed_bridge(&self) -> Option<&str> {
        match self.mode {
            NetworkMode::Bridge { .. } => None,
            _ => Some(&self.bridge),
        }
    }

    /// Whether a dnsmasq runs for this network.
    pub fn runs_dnsmasq(&self) -> bool {
        self.dhcp && self.managed_bridge().is_some()
    }

    /// Checks everything the host side relies on.
    pub fn validate(&self) -> Result<(), InvalidDesired> {
        let object = format!("network {:?}", self.bridge);
        if let NetworkMode::Bridge { existing } = &self.mode {
            check_ifname(&object, "mode.bridge", existing, None)?;
            if existing.starts_with(BRIDGE_PREFIX) || existing.starts_with(TAP_PREFIX) {
                return Err(InvalidDesired {
                    object,
                    field: "mode.bridge",
                    reason: format!(
                        "{existing:?} carries hearth's prefix; an existing bridge must not"
                    ),
                });
            }
            return Ok(());
        }
        check_ifname(&object, "bridge", &self.bridge, Some(BRIDGE_PREFIX))?;
        if !(8..=30).contains(&self.prefix_len) {
            return Err(InvalidDesired {
                object,
                field: "prefixLen",
                reason: format!("{} is not in 8..=30", self.prefix_len),
            });
        }
        let net = u32::from(self.subnet_addr());
        let mask = prefix_mask(self.prefix_len);
        let broadcast = net | !mask;
        let inside = |ip: Ipv4Addr| {
            let v = u32::from(ip);
            v & mask == net && v != net && v != broadcast
        };
        if !inside(self.gateway) {
            return Err(InvalidDesired {
                object,
                field: "gateway",
                reason: format!(
                    "{} is the subnet's network or broadcast address",
                    self.gateway
                ),
            });
        }
        let mut macs = std::collections::BTreeSet::new();
        let mut ips = std::collections::BTreeSet::new();
        for lease in &self.static_leases {
            check_hostname(&object, &lease.hostname)?;
            if lease.mac.0[0] & 1 != 0 || lease.mac.0 == [0; 6] {
                return Err(InvalidDesired {
                    object,
                    field: "staticLeases.mac",
                    reason: format!("{} is not a unicast address", lease.mac),
                });
            }
            if !macs.insert(lease.mac) {
                return Err(InvalidDesired {
                    object,
                    field: "staticLeases.mac",
                    reason: format!("{} has two leases", lease.mac),
                });
            }
            if !ips.insert(lease.ip) {
                return Err(InvalidDesired {
                    object,
                    field: "staticLeases.ip",
                    reason: format!("{} is leased twice", lease.ip),
                });
            }
            if !inside(lease.ip) || lease.ip == self.gateway {
                return Err(InvalidDesired {
                    object,
                    field: "staticLeases.ip",
                    reason: format!(
                        "{} is not a host address of {}",
                        lease.ip,
                        self.subnet_cidr()
                    ),
                });
            }
        }
        for fwd in &self.port_forwards {
            if !inside(fwd.guest_ip) {
                return Err(InvalidDesired {
                    object,
                    field: "portForwards.guestIp",
                    reason: format!("{} is not in {}", fwd.guest_ip, self.subnet_cidr()),
                });
            }
            if self.mode == NetworkMode::Isolated {
                return Err(InvalidDesired {
                    object,
                    field: "portForwards",
                    reason: "an Isolated network forwards no ports".to_string(),
                });
            }
        }
        Ok(())
    }
}

impl HostDesired {
    /// Checks every network and tap, and that names are unique.
    pub fn validate(&self) -> Result<(), InvalidDesired> {
        let mut bridges = std::collections::BTreeSet::new();
        for net in &self.networks {
            net.validate()?;
            if let Some(b) = net.managed_bridge()
                && !bridges.insert(b.to_string())
            {
                return Err(InvalidDesired {
                    object: format!("network {b:?}"),
                    field: "bridge",
                    reason: "two networks use this bridge".to_string(),
                });
            }
        }
        let managed: Vec<&HostNetwork> = self
            .networks
            .iter()
            .filter(|n| n.managed_bridge().is_some())
            .collect();
        for (i, a) in managed.iter().enumerate() {
            for b in &managed[i + 1..] {
                let len = a.prefix_len.min(b.prefix_len);
                let mask = prefix_mask(len);
                if u32::from(a.gateway) & mask == u32::from(b.gateway) & mask {
                    return Err(InvalidDesired {
                        object: format!("network {:?}", b.bridge),
                        field: "subnet",
                        reason: format!(
                            "{} overlaps {} of network {:?}",
                            b.subnet_cidr(),
                            a.subnet_cidr(),
                            a.bridge
                        ),
                    });
                }
            }
        }
        let forwards: Vec<(&HostNetwork, &PortForward)> = self
            .networks
            .iter()
            .flat_map(|n| n.port_forwards.iter().map(move |f| (n, f)))
            .collect();
        for (i, (net, a)) in forwards.iter().enumerate() {
            for (_, b) in &forwards[i + 1..] {
                let same_addr =
                    a.host_addr.is_none() || b.host_addr.is_none() || a.host_addr == b.host_addr;
                if a.protocol == b.protocol && a.host_port == b.host_port && same_addr {
                    return Err(InvalidDesired {
                        object: format!("network {:?}", net.bridge),
                        field: "portForwards.hostPort",
                        reason: format!(
                            "{} port {} is forwarded twice",
                            a.protocol.as_nft(),
                            a.host_port
                        ),
                    });
                }
            }
        }
        let mut taps = std::collections::BTreeSet::new();
        for tap in &self.taps {
            let object = format!("tap {:?}", tap.name);
            check_ifname(&object, "name", &tap.name, Some(TAP_PREFIX))?;
            check_ifname(&object, "bridge", &tap.bridge, None)?;
            if !taps.insert(tap.name.clone()) {
                return Err(InvalidDesired {
                    object,
                    field: "name",
                    reason: "listed twice".to_string(),
                });
            }
        }
        Ok(())
    }
}

/// The netmask of a prefix length, as a host-order integer.
pub fn prefix_mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len.min(32)))
    }
}

/// How QEMU drives a tap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TapBackend {
    /// In-kernel virtio-net data path through /dev/vhost-net.
    VhostNet,
    /// QEMU moves the packets itself (no /dev/vhost-net on this host).
    Userspace,
}

impl TapBackend {
    /// vhost-net when `/dev/vhost-net` exists, QEMU's own data path otherwise.
    pub fn detect() -> Self {
        Self::for_device(Path::new("/dev/vhost-net"))
    }

    pub fn for_device(dev: &Path) -> Self {
        if dev.exists() {
            TapBackend::VhostNet
        } else {
            TapBackend::Userspace
        }
    }
}

/// Where one network's dnsmasq files live: `NETWORKS_DIR/BRIDGE/`.
pub fn network_dir(networks_dir: &Path, bridge: &str) -> PathBuf {
    networks_dir.join(bridge)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn nat_net() -> HostNetwork {
        HostNetwork {
            bridge: "hth-0".into(),
            gateway: Ipv4Addr::new(10, 77, 0, 1),
            prefix_len: 24,
            mode: NetworkMode::Nat,
            dhcp: true,
            dns: Dns::Off,
            static_leases: vec![StaticLease {
                mac: Mac([0x52, 0x54, 0, 0xab, 0, 1]),
                ip: Ipv4Addr::new(10, 77, 0, 10),
                hostname: "web".into(),
            }],
            port_forwards: vec![],
        }
    }

    #[test]
    fn valid_network_passes_and_subnet_is_derived() {
        let n = nat_net();
        n.validate().unwrap();
        assert_eq!(n.subnet_cidr(), "10.77.0.0/24");
    }

    #[test]
    fn bad_names_and_addresses_name_the_field() {
        let mut n = nat_net();
        n.bridge = "br0".into();
        assert_eq!(n.validate().unwrap_err().field, "bridge");
        n.bridge = "hth-0123456789abcd".into();
        assert!(n.validate().unwrap_err().reason.contains("1 to 15 bytes"));
        n.bridge = "hth\"x".into();
        assert_eq!(n.validate().unwrap_err().field, "bridge");
        let mut n = nat_net();
        n.static_leases[0].ip = Ipv4Addr::new(10, 78, 0, 5);
        assert_eq!(n.validate().unwrap_err().field, "staticLeases.ip");
        let mut n = nat_net();
        n.static_leases[0].hostname = "a,b".into();
        assert_eq!(n.validate().unwrap_err().field, "staticLeases.hostname");
        let mut n = nat_net();
        n.gateway = Ipv4Addr::new(10, 77, 0, 255);
        assert_eq!(n.validate().unwrap_err().field, "gateway");
        let mut n = nat_net();
        n.mode = NetworkMode::Bridge {
            existing: "hth-9".into(),
        };
        assert_eq!(n.validate().unwrap_err().field, "mode.bridge");
    }

    #[test]
    fn multicast_and_duplicate_leases_are_refused() {
        let mut n = nat_net();
        n.static_leases[0].mac = Mac([0x01, 0, 0x5e, 0, 0, 1]);
        let e = n.validate().unwrap_err();
        assert_eq!(e.field, "staticLeases.mac");
        assert!(e.reason.contains("not a unicast"), "{e}");
        let mut n = nat_net();
        let mut again = n.static_leases[0].clone();
        again.ip = Ipv4Addr::new(10, 77, 0, 11);
        n.static_leases.push(again);
        assert!(n.validate().unwrap_err().reason.contains("two leases"));
        let mut n = nat_net();
        let mut again = n.static_leases[0].clone();
        again.mac = Mac([0x52, 0x54, 0, 0xab, 0, 2]);
        n.static_leases.push(again);
        assert!(n.validate().unwrap_err().reason.contains("leased twice"));
    }

    #[test]
    fn a_host_port_forwarded_twice_is_refused_across_networks() {
        let fwd = |host_addr, guest: u8| PortForward {
            protocol: Protocol::Tcp,
            host_addr,
            host_port: 2222,
            guest_ip: Ipv4Addr::new(10, 77, 0, guest),
            guest_port: 22,
        };
        let mut a = nat_net();
        a.port_forwards = vec![fwd(Some(Ipv4Addr::new(192, 0, 2, 1)), 10)];
        let mut b = nat_net();
        b.bridge = "hth-1".into();
        b.gateway = Ipv4Addr::new(10, 78, 0, 1);
        b.static_leases.clear();
        b.port_forwards = vec![fwd(Some(Ipv4Addr::new(192, 0, 2, 2)), 11)];
        b.port_forwards[0].guest_ip = Ipv4Addr::new(10, 78, 0, 11);
        let mut d = HostDesired {
            networks: vec![a, b],
            taps: vec![],
        };
        // Different host addresses: both fine.
        d.validate().unwrap();
        // "Any address" overlaps every address.
        d.networks[1].port_forwards[0].host_addr = None;
        let e = d.validate().unwrap_err();
        assert_eq!(e.field, "portForwards.hostPort");
        assert_eq!(e.reason, "tcp port 2222 is forwarded twice");
        // Another protocol does not.
        d.networks[1].port_forwards[0].protocol = Protocol::Udp;
        d.validate().unwrap();
    }

    #[test]
    fn overlapping_subnets_are_refused() {
        let mut b = nat_net();
        b.bridge = "hth-1".into();
        b.gateway = Ipv4Addr::new(10, 77, 0, 129);
        b.prefix_len = 25;
        b.static_leases.clear();
        let d = HostDesired {
            networks: vec![nat_net(), b],
            taps: vec![],
        };
        let e = d.validate().unwrap_err();
        assert_eq!(e.field, "subnet");
        assert_eq!(
            e.to_string(),
            "network \"hth-1\": subnet: 10.77.0.128/25 overlaps 10.77.0.0/24 of network \"hth-0\""
        );
    }

    #[test]
    fn duplicate_taps_and_bad_tap_prefix_are_refused() {
        let tap = DesiredTap {
            name: "htt-0".into(),
            bridge: "hth-0".into(),
        };
        let mut d = HostDesired {
            networks: vec![nat_net()],
            taps: vec![tap.clone(), tap],
        };
        assert_eq!(d.validate().unwrap_err().reason, "listed twice");
        d.taps[1].name = "tap1".into();
        assert_eq!(d.validate().unwrap_err().object, "tap \"tap1\"");
    }

    #[test]
    fn backend_follows_the_vhost_device() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("vhost-net");
        assert_eq!(TapBackend::for_device(&dev), TapBackend::Userspace);
        std::fs::write(&dev, b"").unwrap();
        assert_eq!(TapBackend::for_device(&dev), TapBackend::VhostNet);
    }

    #[test]
    fn mac_prints_lowercase_colon_separated() {
        assert_eq!(
            Mac([0x52, 0x54, 0, 0xAB, 0xcd, 1]).to_string(),
            "52:54:00:ab:cd:01"
        );
    }
}
