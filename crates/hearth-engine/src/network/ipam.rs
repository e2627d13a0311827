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
#[derive(Clone, Debug)]
pub struct Leases {
    subnet: Ipv4Cidr,
    by_ip: BTreeMap<Ipv4Addr, Holder>,
    by_holder: HashMap<Holder, Ipv4Addr>,
    /// No dynamic address below this one is free: where the search for the
    /// lowest free address starts. A plan that hands out many addresses
    /// then walks the held ones once, not once per address it hands out.
    free_from: u32,
}

/// Equal when they hold the same leases (where a search starts is not
/// part of what they hold).
impl PartialEq for Leases {
    fn eq(&self, other: &Leases) -> bool {
        self.subnet == other.subnet && self.by_ip == other.by_ip
    }
}

impl Eq for Leases {}

impl Leases {
    pub fn new(subnet: Ipv4Cidr) -> Leases {
        Leases {
            subnet,
            by_ip: BTreeMap::new(),
            by_holder: HashMap::new(),
            free_from: u32::from(first_dynamic(subnet)),
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
                self.free_from = self.free_from.min(u32::from(ip));
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, holder: Holder, ip: Ipv4Addr) {
        self.by_ip.insert(ip, holder.clone());
        self.by_holder.insert(holder, ip);
    }

    fn lowest_free(&mut self) -> Result<Ipv4Addr, IpamError> {
        let last = u32::from(self.subnet.broadcast());
        let first = u32::from(first_dynamic(self.subnet)).max(self.free_from);
        let found = (first..last)
            .map(Ipv4Addr::from)
            .find(|ip| !self.by_ip.contains_key(ip) && check_reservable(self.subnet, *ip).is_ok())
            .ok_or(IpamError::Exhausted {
                subnet: self.subnet,
            })?;
        self.free_from = u32::from(found);
        Ok(found)
    }
}

/// The outcome of [`plan`]: the network's leases, and the interfaces that
/// could not get an address (with why).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub leases: Leases,
    pub problems: Vec<(Holder, IpamError)>,
}

/// The leases of one network given what is stored and what every interface
/// on it asks for (`None`: any address). Stored leases of holders no longer
/// asking are released; then reservations are placed, in the order given,
/// before any dynamic address, so a dynamic address never takes one that
/// is reserved; then the dynamic ones. An interface that cannot be placed
/// is a problem and gets nothing; the others are unaffected. Callers list
/// the holders whose claim is older first, so a clash is blamed on the
/// newer one.
pub fn plan(
    subnet: Ipv4Cidr,
    stored: impl IntoIterator<Item = (Holder, Ipv4Addr)>,
    wants: &[(Holder, Option<Ipv4Addr>)],
) -> Plan {
    let asking: HashMap<&Holder, Option<Ipv4Addr>> = wants.iter().map(|(h, w)| (h, *w)).collect();
    // A stored address the holder no longer reserves (it now asks for
    // another one) is released first, so two interfaces may swap.
    let kept = stored.into_iter().filter(|(h, ip)| match asking.get(h) {
        None => false,
        Some(None) => true,
        Some(Some(wanted)) => wanted == ip,
    });
    let (mut leases, _) = Leases::from_stored(subnet, kept);
    let mut problems = Vec::new();
    for (holder, wanted) in wants.iter().filter(|(_, w)| w.is_some()) {
        if let Err(e) = leases.allocate(holder, *wanted) {
            problems.push((holder.clone(), e));
        }
    }
    for (holder, _) in wants.iter().filter(|(_, w)| w.is_none()) {
        if let Err(e) = leases.allocate(holder, None) {
            problems.push((holder.clone(), e));
        }
    }
    Plan { leases, problems }
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
    fn plan_releases_removed_interfaces_and_places_reservations_first() {
        let s = cidr("10.77.0.0/24");
        let want = |vm: &str, i, w: Option<&str>| (h(vm, i), w.map(ip));
        // "a" comes first but asks for any address; "b" reserves .10, so
        // "a" gets .11 rather than taking .10 from it.
        let p = plan(
            s,
            vec![],
            &[want("a", 0, None), want("b", 0, Some("10.77.0.10"))],
        );
        assert!(p.problems.is_empty(), "{:?}", p.problems);
        assert_eq!(p.leases.get(&h("a", 0)), Some(ip("10.77.0.11")));
        assert_eq!(p.leases.get(&h("b", 0)), Some(ip("10.77.0.10")));
        let stored: Vec<(Holder, Ipv4Addr)> =
            p.leases.iter().map(|(ip, h)| (h.clone(), ip)).collect();

        // Same wants again: the same addresses (stable).
        let again = plan(
            s,
            stored.clone(),
            &[want("a", 0, None), want("b", 0, Some("10.77.0.10"))],
        );
        assert_eq!(again.leases, p.leases);
        // "b" leaves the network: its address is released.
        let gone = plan(s, stored.clone(), &[want("a", 0, None)]);
        assert_eq!(gone.leases.holder_of(ip("10.77.0.10")), None);
        assert_eq!(gone.leases.get(&h("a", 0)), Some(ip("10.77.0.11")));
        // "c" reserves a's address: c is the problem, a keeps it, b is fine.
        let clash = plan(
            s,
            stored,
            &[
                want("a", 0, None),
                want("b", 0, Some("10.77.0.10")),
                want("c", 0, Some("10.77.0.11")),
            ],
        );
        assert_eq!(clash.problems.len(), 1);
        assert_eq!(clash.problems[0].0, h("c", 0));
        assert!(
            matches!(&clash.problems[0].1, IpamError::Taken { holder, .. } if holder.vm == "a")
        );
        assert_eq!(clash.leases.get(&h("a", 0)), Some(ip("10.77.0.11")));
        assert_eq!(clash.leases.get(&h("c", 0)), None);
    }

    #[test]
    fn plan_lets_two_interfaces_swap_their_reservations() {
        let s = cidr("10.77.0.0/24");
        let stored = vec![
            (h("db", 0), ip("10.77.0.20")),
            (h("db", 1), ip("10.77.0.21")),
        ];
        let p = plan(
            s,
            stored,
            &[
                (h("db", 0), Some(ip("10.77.0.21"))),
                (h("db", 1), Some(ip("10.77.0.20"))),
            ],
        );
        assert!(p.problems.is_empty(), "{:?}", p.problems);
        assert_eq!(p.leases.get(&h("db", 0)), Some(ip("10.77.0.21")));
        assert_eq!(p.leases.get(&h("db", 1)), Some(ip("10.77.0.20")));
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
                                } else {
                                    // The lowest free address, found from
                                    // the first one every time.
                                    let lowest = (u32::from(first_dynamic(subnet))..u32::from(subnet.broadcast()))
                                        .map(Ipv4Addr::from)
                                        .find(|ip| snapshot.holder_of(*ip).is_none() && check_reservable(subnet, *ip).is_ok());
                                    prop_assert_eq!(Some(got), lowest);
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
