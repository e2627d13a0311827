//! Address management for one network: who holds which address.
//!
//! - The gateway is the subnet's first host address (the bridge's).
//! - A holder is one VM interface: (VM name, index in `spec.networks`).
//! - A given `ipAddress` is a reservation: it must lie in the subnet, must
//!   not be the network, broadcast or gateway address, and must not be held
//!   by another holder.
//! - Otherwise a holder keeps the address it has (stable across VM and
//!   daemon restarts: the leases are stored), or gets the lowest free one
//!   from `.10` up. `.2`–`.9` are left for what people place by hand (a
//!   second router, a DNS server, a host-side service) without asking
//!   hearth; in subnets too small for that (/29, /30) the range starts
//!   right after the gateway.
//! - An address is released only when its holder is: the VM is deleted, or
//!   the interface leaves its spec.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::Ipv4Addr;

use hearth_api::net::Ipv4Cidr;

/// One VM interface.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub vm: String,
    pub interface: u32,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VirtualMachine {:?} (spec.networks[{}])",
            self.vm, self.interface
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IpamError {
    #[error("{ip} is not in the network's subnet {subnet}")]
    OutsideSubnet { ip: Ipv4Addr, subnet: Ipv4Cidr },
    #[error("{ip} is the network address of {subnet}")]
    NetworkAddress { ip: Ipv4Addr, subnet: Ipv4Cidr },
    #[error("{ip} is the broadcast address of {subnet}")]
    BroadcastAddress { ip: Ipv4Addr, subnet: Ipv4Cidr },
    #[error("{ip} is the gateway of {subnet} (the host's address on the network)")]
    GatewayAddress { ip: Ipv4Addr, subnet: Ipv4Cidr },
    #[error("{ip} is already taken by {holder}")]
    Taken { ip: Ipv4Addr, holder: Holder },
    #[error("no free address is left in {subnet}")]
    Exhausted { subnet: Ipv4Cidr },
}

/// Whether `ip` may be reserved in `subnet` at all, whoever holds what.
pub fn check_reservable(subnet: Ipv4Cidr, ip: Ipv4Addr) -> Result<(), IpamError> {
    if !subnet.contains(ip) {
        return Err(IpamError::OutsideSubnet { ip, subnet });
    }
    if ip == subnet.network() {
        return Err(IpamError::NetworkAddress { ip, subnet });
    }
    if ip == subnet.broadcast() {
        return Err(IpamError::BroadcastAddress { ip, subnet });
    }
    if ip == subnet.gateway() {
        return Err(IpamError::GatewayAddress { ip, subnet });
    }
    Ok(())
}

/// The first address handed out without a reservation.
pub fn first_dynamic(subnet: Ipv4Cidr) -> Ipv4Addr {
    let net = u32::from(subnet.network());
    if subnet.size() >= 16 {
        Ipv4Addr::from(net + 10)
    } else {
        Ipv4Addr::from(net + 2)
    }
}

/// The leases of one network, both ways round; never two holders for one
/// address, never two addresses for one holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leases {
    subnet: Ipv4Cidr,
    by_ip: BTreeMap<Ipv4Addr, Holder>,
    by_holder: HashMap<Holder, Ipv4Addr>,
}

impl Leases {
    pub fn new(subnet: Ipv4Cidr) -> Leases {
        Leases {
            subnet,
            by_ip: BTreeMap::new(),
            by_holder: HashMap::new(),
        }
    }

    /// From stored leases. A stored lease that is not valid any more (the
    /// subnet changed, or a second holder of one address) is dropped and
    /// its holder gets a fresh address: returned so the caller can say so.
    pub fn from_stored(
        subnet: Ipv4Cidr,
        stored: impl IntoIterator<Item = (Holder, Ipv4Addr)>,
    ) -> (Leases, Vec<(Holder, Ipv4Addr)>) {
        let mut leases = Leases::new(subnet);
        let mut dropped = Vec::new();
        for (holder, ip) in stored {
            let free = check_reservable(subnet, ip).is_ok()
                && !leases.by_ip.contains_key(&ip)
                && !leases.by_holder.contains_key(&holder);
            if free {
                leases.insert(holder, ip);
            } else {
                dropped.push((holder, ip));
            }
        }
        (leases, dropped)
    }

    pub fn subnet(&self) -> Ipv4Cidr {
        self.subnet
    }

    pub fn get(&self, holder: &Holder) -> Option<Ipv4Addr> {
        self.by_holder.get(holder).copied()
    }

    pub fn holder_of(&self, ip: Ipv4Addr) -> Option<&Holder> {
        self.by_ip.get(&ip)
    }

    pub fn len(&self) -> usize {
        self.by_ip.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// Every lease, by address.
    pub fn iter(&self) -> impl Iterator<Item = (Ipv4Addr, &Holder)> {
        self.by_ip.iter().map(|(ip, h)| (*ip, h))
    }

    /// The address of `holder`: `wanted` when given (a reservation, which
    /// replaces any other address the holder had), else the one it has,
    /// else the lowest free one. Changes nothing on error.
    pub fn allocate(
        &mut self,
        holder: &Holder,
        wanted: Option<Ipv4Addr>,
    ) -> Result<Ipv4Addr, IpamError> {
        let ip = match wanted {
            Some(ip) => {
                check_reservable(self.subnet, ip)?;
                match self.by_ip.get(&ip) {
                    Some(other) if other != holder => {
                        return Err(IpamError::Taken {
                            ip,
                            holder: other.clone(),
                        });
                    }
                    _ => ip,
                }
            }
            None => match self.get(holder) {
                Some(ip) => return Ok(ip),
                None => self.lowest_free()?,
            },
        };
        self.release(holder);
        self.insert(holder.clone(), ip);
        Ok(ip)
    }

    /// Frees the holder's address; true when it had one.
    pub fn release(&mut self, holder: &Holder) -> bool {
        match self.by_holder.remove(holder) {
            Some(ip) => {
                self.by_ip.remove(&ip);
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, holder: Holder, ip: Ipv4Addr) {
        self.by_ip.insert(ip, holder.clone());
        self.by_holder.insert(holder, ip);
    }

    fn lowest_free(&self) -> Result<Ipv4Addr, IpamError> {
        let last = u32::from(self.subnet.broadcast());
        (u32::from(first_dynamic(self.subnet))..last)
            .map(Ipv4Addr::from)
            .find(|ip| !self.by_ip.contains_key(ip) && check_reservable(self.subnet, *ip).is_ok())
            .ok_or(IpamError::Exhausted {
                subnet: self.subnet,
            })
    }
}

/// One VM's interfaces on one network: what it asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub interface: u32,
    pub wanted: Option<Ipv4Addr>,
}

/// The addresses of `vm`'s interfaces on this network, all or nothing:
/// its interfaces that are no longer asked for are released, reservations
/// are placed before dynamic addresses (so a dynamic one never takes an
/// address reserved in the same spec), and on error `leases` is unchanged.
pub fn assign_vm(
    leases: &mut Leases,
    vm: &str,
    requests: &[Request],
) -> Result<Vec<(u32, Ipv4Addr)>, (u32, IpamError)> {
    let mut next = leases.clone();
    let asked: Vec<u32> = requests.iter().map(|r| r.interface).collect();
    let stale: Vec<Holder> = next
        .by_holder
        .keys()
        .filter(|h| h.vm == vm && !asked.contains(&h.interface))
        .cloned()
        .collect();
    for h in &stale {
        next.release(h);
    }
    let holder = |interface| Holder {
        vm: vm.to_string(),
        interface,
    };
    // A holder whose reservation moves frees its old address first, so two
    // interfaces of one VM may swap addresses.
    for r in requests.iter().filter(|r| r.wanted.is_some()) {
        if next.get(&holder(r.interface)) != r.wanted {
            next.release(&holder(r.interface));
        }
    }
    let mut out = Vec::new();
    for r in requests
        .iter()
        .filter(|r| r.wanted.is_some())
        .chain(requests.iter().filter(|r| r.wanted.is_none()))
    {
        let ip = next
            .allocate(&holder(r.interface), r.wanted)
            .map_err(|e| (r.interface, e))?;
        out.push((r.interface, ip));
    }
    out.sort();
    *leases = next;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cidr(s: &str) -> Ipv4Cidr {
        s.parse().expect("test cidr")
    }

    fn h(vm: &str, interface: u32) -> Holder {
        Holder {
            vm: vm.into(),
            interface,
        }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().expect("test ip")
    }

    #[test]
    fn dynamic_addresses_start_at_ten_and_fill_gaps_lowest_first() {
        let mut l = Leases::new(cidr("10.77.0.0/24"));
        assert_eq!(l.allocate(&h("a", 0), None), Ok(ip("10.77.0.10")));
        assert_eq!(l.allocate(&h("b", 0), None), Ok(ip("10.77.0.11")));
        assert_eq!(l.allocate(&h("c", 0), None), Ok(ip("10.77.0.12")));
        assert!(l.release(&h("b", 0)));
        assert!(!l.release(&h("b", 0)));
        assert_eq!(l.allocate(&h("d", 0), None), Ok(ip("10.77.0.11")));
        // The same holder gets the same address back.
        assert_eq!(l.allocate(&h("a", 0), None), Ok(ip("10.77.0.10")));
        assert_eq!(l.len(), 3);
    }

    #[test]
    fn reservations_are_checked_and_name_the_holder() {
        let s = cidr("10.77.0.0/24");
        let mut l = Leases::new(s);
        assert_eq!(
            l.allocate(&h("a", 0), Some(ip("10.77.0.50"))),
            Ok(ip("10.77.0.50"))
        );
        let e = l.allocate(&h("b", 1), Some(ip("10.77.0.50"))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "10.77.0.50 is already taken by VirtualMachine \"a\" (spec.networks[0])"
        );
        for (bad, words) in [
            ("10.78.0.5", "not in the network's subnet 10.77.0.0/24"),
            ("10.77.0.0", "network address"),
            ("10.77.0.255", "broadcast address"),
            ("10.77.0.1", "gateway"),
        ] {
            let e = l.allocate(&h("b", 0), Some(ip(bad))).unwrap_err();
            assert!(e.to_string().contains(words), "{bad}: {e}");
        }
        assert_eq!(l.len(), 1, "errors change nothing");
        // A reservation may be in .2-.9, and moves the holder.
        assert_eq!(
            l.allocate(&h("a", 0), Some(ip("10.77.0.2"))),
            Ok(ip("10.77.0.2"))
        );
        assert_eq!(l.holder_of(ip("10.77.0.50")), None);
    }

    #[test]
    fn small_subnets_start_after_the_gateway_and_run_out_clearly() {
        let mut l = Leases::new(cidr("192.168.9.0/30"));
        assert_eq!(first_dynamic(l.subnet()), ip("192.168.9.2"));
        assert_eq!(l.allocate(&h("a", 0), None), Ok(ip("192.168.9.2")));
        assert_eq!(
            l.allocate(&h("b", 0), None).unwrap_err().to_string(),
            "no free address is left in 192.168.9.0/30"
        );
        assert_eq!(first_dynamic(cidr("10.0.0.0/28")), ip("10.0.0.10"));
        assert_eq!(first_dynamic(cidr("10.0.0.0/29")), ip("10.0.0.2"));
    }

    #[test]
    fn stored_leases_come_back_and_invalid_ones_are_dropped() {
        let s = cidr("10.77.0.0/24");
        let (l, dropped) = Leases::from_stored(
            s,
            vec![
                (h("a", 0), ip("10.77.0.10")),
                (h("b", 0), ip("10.77.0.10")), // a second holder
                (h("c", 0), ip("10.9.0.10")),  // outside
                (h("d", 0), ip("10.77.0.1")),  // the gateway
            ],
        );
        assert_eq!(l.get(&h("a", 0)), Some(ip("10.77.0.10")));
        assert_eq!(dropped.len(), 3);
    }

    #[test]
    fn assign_vm_releases_removed_interfaces_and_is_all_or_nothing() {
        let mut l = Leases::new(cidr("10.77.0.0/24"));
        let req = |interface, wanted: Option<&str>| Request {
            interface,
            wanted: wanted.map(ip),
        };
        let got = assign_vm(&mut l, "web", &[req(0, None), req(1, Some("10.77.0.10"))]).unwrap();
        // The reservation is placed first: the dynamic one skips .10.
        assert_eq!(got, vec![(0, ip("10.77.0.11")), (1, ip("10.77.0.10"))]);
        // Interface 1 leaves the spec: its address is released.
        assert_eq!(
            assign_vm(&mut l, "web", &[req(0, None)]).unwrap(),
            vec![(0, ip("10.77.0.11"))]
        );
        assert_eq!(l.holder_of(ip("10.77.0.10")), None);
        // Another VM asks for web's address: refused, and nothing changes.
        let before = l.clone();
        let e = assign_vm(&mut l, "db", &[req(0, None), req(1, Some("10.77.0.11"))]).unwrap_err();
        assert_eq!(e.0, 1);
        assert!(matches!(e.1, IpamError::Taken { ref holder, .. } if holder.vm == "web"));
        assert_eq!(l, before);
        // Two interfaces of one VM may swap their reservations.
        assign_vm(
            &mut l,
            "db",
            &[req(0, Some("10.77.0.20")), req(1, Some("10.77.0.21"))],
        )
        .unwrap();
        let swapped = assign_vm(
            &mut l,
            "db",
            &[req(0, Some("10.77.0.21")), req(1, Some("10.77.0.20"))],
        )
        .unwrap();
        assert_eq!(swapped, vec![(0, ip("10.77.0.21")), (1, ip("10.77.0.20"))]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Allocate {
            vm: u8,
            interface: u8,
            wanted: Option<u8>,
        },
        Release {
            vm: u8,
            interface: u8,
        },
        Restart,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..6, 0u8..3, proptest::option::of(any::<u8>()))
                .prop_map(|(vm, interface, wanted)| Op::Allocate { vm, interface, wanted }),
            2 => (0u8..6, 0u8..3).prop_map(|(vm, interface)| Op::Release { vm, interface }),
            1 => Just(Op::Restart),
        ]
    }

    proptest! {
        /// Random allocate / release / restart (rebuild from what would be
        /// stored): never two holders for one address, the same holder gets
        /// its address back, and the network, broadcast and gateway
        /// addresses are never handed out. A /27 so that it runs out too.
        #[test]
        fn leases_never_collide_and_stay_stable(ops in proptest::collection::vec(op(), 1..120)) {
            let subnet = cidr("10.77.0.32/27");
            let mut l = Leases::new(subnet);
            for op in ops {
                match op {
                    Op::Allocate { vm, interface, wanted } => {
                        let holder = h(&format!("vm{vm}"), u32::from(interface));
                        let before = l.get(&holder);
                        let wanted_ip = wanted.map(|w| Ipv4Addr::from(u32::from(subnet.network()) + u32::from(w % 40)));
                        let snapshot = l.clone();
                        match l.allocate(&holder, wanted_ip) {
                            Ok(got) => {
                                prop_assert!(check_reservable(subnet, got).is_ok(), "{got}");
                                if let Some(w) = wanted_ip {
                                    prop_assert_eq!(got, w);
                                } else if let Some(b) = before {
                                    prop_assert_eq!(got, b);
                                }
                                prop_assert_eq!(l.get(&holder), Some(got));
                                prop_assert_eq!(l.holder_of(got), Some(&holder));
                            }
                            Err(_) => prop_assert_eq!(&l, &snapshot, "an error changes nothing"),
                        }
                    }
                    Op::Release { vm, interface } => {
                        let holder = h(&format!("vm{vm}"), u32::from(interface));
                        l.release(&holder);
                        prop_assert_eq!(l.get(&holder), None);
                    }
                    Op::Restart => {
                        let stored: Vec<(Holder, Ipv4Addr)> =
                            l.iter().map(|(ip, h)| (h.clone(), ip)).collect();
                        let (back, dropped) = Leases::from_stored(subnet, stored);
                        prop_assert!(dropped.is_empty());
                        prop_assert_eq!(&back, &l);
                        l = back;
                    }
                }
                // Both maps agree, one to one.
                prop_assert_eq!(l.by_ip.len(), l.by_holder.len());
                for (ip, holder) in l.iter() {
                    prop_assert_eq!(l.get(holder), Some(ip));
                    prop_assert!(ip != subnet.network() && ip != subnet.broadcast() && ip != subnet.gateway());
                }
            }
        }
    }
}
