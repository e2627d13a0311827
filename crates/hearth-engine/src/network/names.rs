//! Host interface names and MAC addresses, derived from object names.
//!
//! Linux interface names have at most 15 bytes. hearth's own bridges are
//! `hth-…` and its taps `htt-…`, so start-up cleanup finds every leftover by
//! its prefix alone. A name that fits is used as is; a longer one keeps its
//! first three characters and adds `_` and a 35-bit hash of the whole name.
//! Object names are DNS labels and never contain `_`, so a hashed name is
//! never equal to a plain one; two hashed names are equal only on a hash
//! collision, which apply refuses ([`collisions`]), so names never collide.

use std::collections::HashMap;

use hearth_api::net::MacAddr;
use sha2::{Digest, Sha256};

/// Prefix of every bridge hearth creates.
pub const BRIDGE_PREFIX: &str = "hth-";
/// Prefix of every tap hearth creates.
pub const TAP_PREFIX: &str = "htt-";
/// The kernel's limit (IFNAMSIZ less the NUL).
pub const MAX_IFNAME: usize = 15;

/// The MAC of interface `i`: the one given, else the derived one.
pub fn mac_of(vm: &hearth_api::VirtualMachine, i: usize) -> Option<MacAddr> {
    match &vm.spec.networks.get(i)?.mac_address {
        Some(m) => m.parse().ok(),
        None => Some(derived_mac(&vm.metadata.name, i as u32)),
    }
}

/// The bridge of a NAT or Isolated network.
pub fn bridge_name(network: &str) -> String {
    fit(BRIDGE_PREFIX, network)
}

/// The tap of interface `index` of `vm`. The index is always the last
/// `-digit`, so a plain tap name says which VM and interface it is.
pub fn tap_name(vm: &str, index: u32) -> String {
    fit(TAP_PREFIX, &format!("{vm}-{index}"))
}

/// True for a name hearth may have created: what start-up cleanup may remove.
pub fn is_hearth_interface(name: &str) -> bool {
    name.len() <= MAX_IFNAME && (name.starts_with(BRIDGE_PREFIX) || name.starts_with(TAP_PREFIX))
}

fn fit(prefix: &str, name: &str) -> String {
    let plain = format!("{prefix}{name}");
    if plain.len() <= MAX_IFNAME {
        return plain;
    }
    // 4 (prefix) + 3 + 1 (`_`) + 7 = 15.
    let head: String = name.chars().take(3).collect();
    format!("{prefix}{head}_{}", base32_hash(name, 7))
}

/// `len` lowercase base32 characters (5 bits each) of SHA-256(`text`).
fn base32_hash(text: &str, len: usize) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let digest = Sha256::digest(text.as_bytes());
    let mut bits: u64 = 0;
    for b in &digest[..8] {
        bits = bits << 8 | u64::from(*b);
    }
    (0..len.min(12))
        .map(|i| char::from(ALPHABET[((bits >> (59 - 5 * i)) & 31) as usize]))
        .collect()
}

/// The MAC of interface `index` of `vm` when its spec gives none:
/// `02:` and 40 bits of SHA-256 of the VM's name and the index. `02` sets
/// the locally administered bit and clears the multicast bit, so it never
/// takes a vendor's address; 40 bits (rather than the 24 after QEMU's
/// `52:54:00`) make a clash on one network unlikely, and apply refuses one.
pub fn derived_mac(vm: &str, index: u32) -> MacAddr {
    let digest = Sha256::digest(format!("hearth-mac/{vm}/{index}").as_bytes());
    let mut mac = [0x02, 0, 0, 0, 0, 0];
    mac[1..].copy_from_slice(&digest[..5]);
    MacAddr(mac)
}

/// The first pair of different owners that derive the same name, if any.
pub fn collisions<'a, O: Eq + Clone + 'a>(
    names: impl IntoIterator<Item = (O, String)>,
) -> Option<(O, O, String)> {
    let mut seen: HashMap<String, O> = HashMap::new();
    for (owner, name) in names {
        match seen.get(&name) {
            Some(first) if *first != owner => return Some((first.clone(), owner, name)),
            Some(_) => {}
            None => {
                seen.insert(name, owner);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn short_names_are_kept_whole() {
        assert_eq!(bridge_name("lan"), "hth-lan");
        assert_eq!(bridge_name("abcdefghijk"), "hth-abcdefghijk");
        assert_eq!(tap_name("web", 0), "htt-web-0");
        assert_eq!(tap_name("abcdefghi", 7), "htt-abcdefghi-7");
    }

    #[test]
    fn long_names_are_hashed_to_fit_and_stay_stable() {
        let long = "a-network-name-that-is-long";
        let b = bridge_name(long);
        assert_eq!(b.len(), MAX_IFNAME, "{b}");
        assert!(b.starts_with("hth-a-n_"), "{b}");
        assert_eq!(b, bridge_name(long), "stable");
        assert_ne!(b, bridge_name("a-network-name-that-is-lonG"));
        let t = tap_name("database-primary", 3);
        assert_eq!(t.len(), MAX_IFNAME, "{t}");
        assert!(t.starts_with("htt-dat_"), "{t}");
        assert_ne!(t, tap_name("database-primary", 4));
        // Pinned: a name must not change between releases, or cleanup and
        // running VMs would lose their interfaces.
        assert_eq!(bridge_name("production-network"), "hth-pro_ea7qrfu");
        assert_eq!(tap_name("database-primary", 3), "htt-dat_q2wvlyn");
        assert_eq!(derived_mac("web", 0).to_string(), "02:0d:21:13:9d:4f");
        assert!(is_hearth_interface(&b) && is_hearth_interface(&t));
        assert!(!is_hearth_interface("br0") && !is_hearth_interface("hth"));
    }

    #[test]
    fn hashed_names_never_equal_plain_ones() {
        // A plain name has no `_` (DNS labels cannot), a hashed one always has.
        let hashed = bridge_name("abcdefghijkl");
        assert!(hashed.contains('_'));
        let suffix = hashed.trim_start_matches(BRIDGE_PREFIX);
        assert!(hearth_api::check_dns_label(suffix).is_err());
        assert!(!bridge_name("abcdefghijk").contains('_'));
    }

    #[test]
    fn every_derived_name_is_a_valid_interface_name_and_distinct() {
        let mut bridges = HashSet::new();
        let mut taps = HashSet::new();
        for n in 0..3000 {
            let name = format!("net-{n}-{}", "x".repeat(n % 50));
            let b = bridge_name(&name);
            hearth_api::net::check_interface_name(&b).expect("valid");
            assert!(bridges.insert(b), "{name}");
            for i in 0..8 {
                let t = tap_name(&name, i);
                hearth_api::net::check_interface_name(&t).expect("valid");
                assert!(taps.insert(t), "{name} {i}");
            }
        }
    }

    #[test]
    fn derived_macs_are_local_unicast_and_stable() {
        let m = derived_mac("web", 0);
        assert_eq!(m.0[0], 0x02);
        assert_eq!(m, derived_mac("web", 0));
        assert_ne!(m, derived_mac("web", 1));
        assert_ne!(m, derived_mac("web2", 0));
        hearth_api::net::check_mac(&m.to_string()).expect("a valid unicast MAC");
    }

    #[test]
    fn collisions_name_both_owners() {
        let names = vec![
            ("a", "hth-x".to_string()),
            ("a", "hth-x".to_string()),
            ("b", "hth-y".to_string()),
            ("c", "hth-x".to_string()),
        ];
        assert_eq!(collisions(names), Some(("a", "c", "hth-x".to_string())));
        assert_eq!(collisions(vec![("a", "n".to_string())]), None);
    }
}
