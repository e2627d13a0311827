//! Picking a subnet for a network that gives none, and refusing one that
//! overlaps another network or the host.
//!
//! The pool, in order: the /24s of 10.77.0.0–10.127.255.255, then the /24s
//! of 172.16.0.0/12. 10.77 and up is far from the 10.0.x and 10.1.x that
//! home routers, VPNs and other tools (Docker's 172.17, libvirt's
//! 192.168.122) take first. The first /24 that overlaps no host network and
//! no other VirtualNetwork is taken, so the same state always gives the
//! same answer; the network keeps it in its status from then on.

use std::net::Ipv4Addr;

use hearth_api::net::Ipv4Cidr;

/// A network the host uses: an address on an interface, or a route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostNet {
    pub cidr: Ipv4Cidr,
    /// `eth0` or `route via 192.168.1.1`: how an error names it.
    pub what: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubnetError {
    #[error("{subnet} overlaps {other_subnet} of VirtualNetwork {other:?}")]
    OverlapsNetwork {
        subnet: Ipv4Cidr,
        other: String,
        other_subnet: Ipv4Cidr,
    },
    #[error("{subnet} overlaps the host's {host} ({what})")]
    OverlapsHost {
        subnet: Ipv4Cidr,
        host: Ipv4Cidr,
        what: String,
    },
    #[error("no free /24 is left in 10.77.0.0-10.127.255.255 or 172.16.0.0/12; give spec.subnet")]
    PoolExhausted,
}

/// The candidate /24s, in the order they are tried.
fn pool() -> impl Iterator<Item = Ipv4Cidr> {
    let ten = (77u32..=127).flat_map(|b| (0u32..=255).map(move |c| (10u32, b, c)));
    let one72 = (16u32..=31).flat_map(|b| (0u32..=255).map(move |c| (172u32, b, c)));
    ten.chain(one72)
        .map(|(a, b, c)| Ipv4Cidr::new_truncating(Ipv4Addr::from(a << 24 | b << 16 | c << 8), 24))
}

/// Whether `subnet` may be used: it overlaps no other network and no host
/// network. Default routes (/0) are ignored: they cover every address, and
/// traffic to a local bridge never follows them.
pub fn check(
    subnet: Ipv4Cidr,
    others: &[(String, Ipv4Cidr)],
    host: &[HostNet],
) -> Result<(), SubnetError> {
    if let Some((other, other_subnet)) = others.iter().find(|(_, o)| o.overlaps(&subnet)) {
        return Err(SubnetError::OverlapsNetwork {
            subnet,
            other: other.clone(),
            other_subnet: *other_subnet,
        });
    }
    if let Some(h) = host
        .iter()
        .find(|h| h.cidr.prefix() > 0 && h.cidr.overlaps(&subnet))
    {
        return Err(SubnetError::OverlapsHost {
            subnet,
            host: h.cidr,
            what: h.what.clone(),
        });
    }
    Ok(())
}

/// The first /24 of the pool that [`check`] accepts.
pub fn pick(others: &[(String, Ipv4Cidr)], host: &[HostNet]) -> Result<Ipv4Cidr, SubnetError> {
    pool()
        .find(|c| check(*c, others, host).is_ok())
        .ok_or(SubnetError::PoolExhausted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Ipv4Cidr {
        s.parse().expect("test cidr")
    }

    fn host(s: &str, what: &str) -> HostNet {
        HostNet {
            cidr: cidr(s),
            what: what.into(),
        }
    }

    #[test]
    fn the_first_free_24_is_picked_and_the_pick_is_deterministic() {
        assert_eq!(pick(&[], &[]), Ok(cidr("10.77.0.0/24")));
        let others = vec![("lan".to_string(), cidr("10.77.0.0/24"))];
        let hosts = vec![
            host("10.77.1.0/24", "eth1"),
            host("0.0.0.0/0", "default route"),
        ];
        assert_eq!(pick(&others, &hosts), Ok(cidr("10.77.2.0/24")));
        assert_eq!(pick(&others, &hosts), pick(&others, &hosts));
        // A wide host route skips every /24 inside it.
        let wide = vec![host("10.77.0.0/16", "wg0")];
        assert_eq!(pick(&[], &wide), Ok(cidr("10.78.0.0/24")));
        // The 10.x pool used up: on to 172.16.
        let all_ten = vec![host("10.0.0.0/8", "vpn")];
        assert_eq!(pick(&[], &all_ten), Ok(cidr("172.16.0.0/24")));
        let everything = vec![host("10.0.0.0/8", "a"), host("172.16.0.0/12", "b")];
        assert_eq!(pick(&[], &everything), Err(SubnetError::PoolExhausted));
    }

    #[test]
    fn an_overlap_names_the_other_network_or_the_host_route() {
        let others = vec![("lan".to_string(), cidr("10.77.0.0/16"))];
        let e = check(cidr("10.77.5.0/24"), &others, &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "10.77.5.0/24 overlaps 10.77.0.0/16 of VirtualNetwork \"lan\""
        );
        let e = check(
            cidr("192.168.1.0/24"),
            &others,
            &[host("192.168.0.0/16", "eth0")],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "192.168.1.0/24 overlaps the host's 192.168.0.0/16 (eth0)"
        );
        assert!(
            check(
                cidr("10.78.0.0/24"),
                &others,
                &[host("0.0.0.0/0", "default")]
            )
            .is_ok()
        );
    }
}
