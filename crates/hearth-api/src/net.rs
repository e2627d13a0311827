//! IPv4 subnets, MAC addresses and host interface names as the networking
//! fields spell them; parsing and the checks validation needs. No I/O.
//!
//! `std::net::Ipv4Addr` and `u32` arithmetic are all the subnet math needs
//! (one address family, prefixes /8../30): a CIDR crate would add a
//! dependency for a dozen lines.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// The shortest and longest prefixes a VirtualNetwork's subnet may have: /8
/// is already 16 million addresses; /30 leaves two host addresses (the
/// gateway and one guest), the fewest a network can be used with.
pub const MIN_PREFIX: u8 = 8;
pub const MAX_PREFIX: u8 = 30;

/// An IPv4 network: its network address and prefix length, host bits zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// A network from an address and a prefix; host bits are cleared.
    pub fn new_truncating(addr: Ipv4Addr, prefix: u8) -> Ipv4Cidr {
        let prefix = prefix.min(32);
        Ipv4Cidr {
            network: Ipv4Addr::from(u32::from(addr) & mask(prefix)),
            prefix,
        }
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(mask(self.prefix))
    }

    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) | !mask(self.prefix))
    }

    /// The first host address: hearth puts the gateway (the bridge) there.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network).wrapping_add(1))
    }

    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.network)
    }

    /// True when the two networks share any address.
    pub fn overlaps(&self, other: &Ipv4Cidr) -> bool {
        let p = self.prefix.min(other.prefix);
        u32::from(self.network) & mask(p) == u32::from(other.network) & mask(p)
    }

    /// Addresses in the network, network and broadcast included.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = String;

    /// Any syntactically valid `A.B.C.D/N` with N in 0..=32; the host bits
    /// must be zero. Range limits are [`check_subnet`]'s job.
    fn from_str(s: &str) -> Result<Ipv4Cidr, String> {
        let (addr, prefix) = s.split_once('/').ok_or_else(|| {
            format!("{s:?} is not an IPv4 subnet in CIDR form (for example 10.77.0.0/24)")
        })?;
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{s:?}: {addr:?} is not an IPv4 address"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32 && !prefix.starts_with('+'))
            .ok_or_else(|| format!("{s:?}: {prefix:?} is not a prefix length (0..32)"))?;
        let net = Ipv4Cidr::new_truncating(addr, prefix);
        if net.network != addr {
            return Err(format!(
                "{s:?} has host bits set; the network address is {net}"
            ));
        }
        Ok(net)
    }
}

/// A VirtualNetwork's `spec.subnet`: CIDR syntax, a network address, and a
/// prefix in [`MIN_PREFIX`]..[`MAX_PREFIX`].
pub fn check_subnet(s: &str) -> Result<Ipv4Cidr, String> {
    let net: Ipv4Cidr = s.parse()?;
    if !(MIN_PREFIX..=MAX_PREFIX).contains(&net.prefix) {
        return Err(format!(
            "{s:?}: prefix /{} is out of range /{MIN_PREFIX}../{MAX_PREFIX}",
            net.prefix
        ));
    }
    Ok(net)
}

/// An IPv4 address in dotted-quad form.
pub fn parse_ipv4(s: &str) -> Result<Ipv4Addr, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not an IPv4 address (for example 10.77.0.10)"))
}

/// A MAC address: six bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacAddr(pub [u8; 6]);

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl FromStr for MacAddr {
    type Err = String;

    /// Six pairs of hex digits separated by `:` (either case).
    fn from_str(s: &str) -> Result<MacAddr, String> {
        let bad = || format!("{s:?} is not a MAC address (for example 52:54:00:12:34:56)");
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *byte = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(out))
    }
}

/// A VM interface's `macAddress`: syntax, unicast, not all zero.
pub fn check_mac(s: &str) -> Result<MacAddr, String> {
    let mac: MacAddr = s.parse()?;
    if mac.0[0] & 1 != 0 {
        return Err(format!(
            "{s:?} is a multicast address (the low bit of the first byte is set); a NIC needs a unicast one, such as 52:54:00:..."
        ));
    }
    if mac.0 == [0; 6] {
        return Err(format!("{s:?} is all zero"));
    }
    Ok(mac)
}

/// A host network interface name as Linux accepts it: 1..15 bytes, no `/`,
/// no whitespace, no `:` (alias syntax), not `.` or `..`.
pub fn check_interface_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > 15 {
        return Err(format!(
            "{s:?} is longer than 15 bytes (the kernel's limit for interface names)"
        ));
    }
    if s == "." || s == ".." {
        return Err(format!("{s:?} is not an interface name"));
    }
    if s.chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "{s:?} is not an interface name (no '/', ':', spaces or control characters)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets_parse_and_refuse_host_bits_and_odd_prefixes() {
        let n = check_subnet("10.77.3.0/24").expect("valid");
        assert_eq!(n.network(), Ipv4Addr::new(10, 77, 3, 0));
        assert_eq!(n.gateway(), Ipv4Addr::new(10, 77, 3, 1));
        assert_eq!(n.broadcast(), Ipv4Addr::new(10, 77, 3, 255));
        assert_eq!(n.netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(n.to_string(), "10.77.3.0/24");
        assert_eq!(n.size(), 256);

        let e = check_subnet("10.77.3.5/24").unwrap_err();
        assert!(e.contains("host bits") && e.contains("10.77.3.0/24"), "{e}");
        let e = check_subnet("10.0.0.0/31").unwrap_err();
        assert!(e.contains("/8../30"), "{e}");
        let e = check_subnet("10.0.0.0/7").unwrap_err();
        assert!(e.contains("/7"), "{e}");
        for bad in [
            "10.0.0.0",
            "10.0.0/24",
            "10.0.0.0/33",
            "10.0.0.0/+8",
            "x/24",
            "",
        ] {
            assert!(check_subnet(bad).is_err(), "{bad}");
        }
        assert!(check_subnet("10.0.0.0/8").is_ok());
        assert!(check_subnet("192.168.7.252/30").is_ok());
    }

    #[test]
    fn overlap_is_symmetric_and_exact() {
        let a: Ipv4Cidr = "10.77.0.0/16".parse().unwrap();
        let b: Ipv4Cidr = "10.77.5.0/24".parse().unwrap();
        let c: Ipv4Cidr = "10.78.0.0/24".parse().unwrap();
        assert!(a.overlaps(&b) && b.overlaps(&a));
        assert!(!a.overlaps(&c) && !c.overlaps(&a));
        assert!(a.contains(Ipv4Addr::new(10, 77, 255, 255)));
        assert!(!a.contains(Ipv4Addr::new(10, 78, 0, 0)));
    }

    #[test]
    fn macs_must_be_unicast_and_not_zero() {
        assert_eq!(
            check_mac("52:54:00:AB:cd:01").unwrap().to_string(),
            "52:54:00:ab:cd:01"
        );
        assert!(
            check_mac("01:00:5e:00:00:01")
                .unwrap_err()
                .contains("multicast")
        );
        assert!(
            check_mac("ff:ff:ff:ff:ff:ff")
                .unwrap_err()
                .contains("multicast")
        );
        assert!(
            check_mac("00:00:00:00:00:00")
                .unwrap_err()
                .contains("all zero")
        );
        for bad in [
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:01:02",
            "5254.00ab.cd01",
            "52:54:00:ab:cd:0g",
            "52:54:00:ab:cd:1",
        ] {
            assert!(check_mac(bad).unwrap_err().contains("not a MAC"), "{bad}");
        }
    }

    #[test]
    fn interface_names_follow_the_kernel_rules() {
        assert!(check_interface_name("br0").is_ok());
        assert!(check_interface_name("virbr-lan.10").is_ok());
        assert!(check_interface_name("abcdefghijklmno").is_ok());
        assert!(
            check_interface_name("abcdefghijklmnop")
                .unwrap_err()
                .contains("15 bytes")
        );
        for bad in ["", "a/b", "a b", "a:1", ".", "..", "a\tb"] {
            assert!(check_interface_name(bad).is_err(), "{bad:?}");
        }
    }
}
