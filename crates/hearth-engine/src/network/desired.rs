//! From the store's objects to the host's desired state: which bridges,
//! dnsmasq hosts, port forwards and taps must exist. A pure function of
//! what is stored (networks, VMs with the interfaces their QEMUs were
//! started with, leases), so the same store always asks the host for the
//! same things, and a daemon that restarts after a crash asks for exactly
//! what the one before it had made.
//!
//! A VM's networks **in effect** ([`in_effect`]) are those of its running
//! QEMU (or of the launch under way) while there is one, its spec's
//! otherwise: a QEMU keeps the taps, addresses and forwards it was started
//! with until it exits, whatever the spec says meanwhile.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::Path;

use hearth_api::net::Ipv4Cidr;
use hearth_api::{
    Kind, NetworkMode as ApiMode, Object, Protocol as ApiProtocol, VirtualMachine, VirtualNetwork,
};

use super::error::NetworkError;
use super::host::{
    DesiredTap, Dns, HostDesired, HostNetwork, Mac, NetworkMode, PortForward, Protocol, StaticLease,
};
use super::names::{self, mac_of};
use crate::runtime::{LaunchMarker, LaunchedInterface, RuntimeRecord};
use crate::store::{Store, StoreError, StoredLease};

/// The interfaces each VM's QEMU was started with, by VM: from its runtime
/// record, else from its newest launch marker (a launch under way, or one a
/// dead daemon left, whose QEMU may run). A record without interfaces (made
/// before they were recorded) counts as none: the spec stands in.
pub fn launched_by_vm(
    records: &[RuntimeRecord],
    markers: &[LaunchMarker],
) -> BTreeMap<String, Vec<LaunchedInterface>> {
    let mut out = BTreeMap::new();
    let mut markers: Vec<&LaunchMarker> = markers.iter().collect();
    markers.sort_by_key(|m| m.id);
    for m in markers {
        if let Some(n) = &m.record.networks {
            out.insert(m.vm.clone(), n.clone());
        }
    }
    for r in records {
        if let Some(n) = &r.networks {
            out.insert(r.vm.clone(), n.clone());
        }
    }
    out
}

/// The VMs whose spec, or whose QEMU, has an interface on `network`,
/// sorted: by the store's index of interfaces, not by reading every VM.
pub fn vms_using_network(store: &Store, network: &str) -> Result<Vec<String>, StoreError> {
    let mut vms = store.network_claimants(network)?;
    // A QEMU started with an interface on it holds its tap there until it
    // exits, whatever its spec says now.
    let launched = launched_by_vm(&store.runtimes()?, &store.launches(None)?);
    for (vm, nics) in launched {
        if nics.iter().any(|n| n.spec.virtual_network_name == network) && !vms.contains(&vm) {
            vms.push(vm);
        }
    }
    vms.sort();
    Ok(vms)
}

/// Every VM with an interface in its spec or in its running QEMU
/// (`launched`), by name: a VM with neither has no tap, address, MAC or
/// port anywhere, so what networks need is read from these alone.
pub fn networked_vms(
    store: &Store,
    launched: &BTreeMap<String, Vec<LaunchedInterface>>,
) -> Result<Vec<VirtualMachine>, StoreError> {
    let mut vms: BTreeMap<String, VirtualMachine> = BTreeMap::new();
    for s in store.networked_vms()? {
        if let Object::VirtualMachine(vm) = s.object {
            vms.insert(vm.metadata.name.clone(), vm);
        }
    }
    for (name, nics) in launched {
        if nics.is_empty() || vms.contains_key(name) {
            continue;
        }
        if let Some(s) = store.get(Kind::VirtualMachine, name)?
            && let Object::VirtualMachine(vm) = s.object
        {
            vms.insert(name.clone(), vm);
        }
    }
    Ok(vms.into_values().collect())
}

/// `vm` with the networks in effect: `launched` (each interface pinned to
/// the address it was started with, as a reservation, so that no plan can
/// move it or give it away) while a QEMU has them, else its spec's.
pub fn in_effect(vm: &VirtualMachine, launched: Option<&[LaunchedInterface]>) -> VirtualMachine {
    let Some(launched) = launched else {
        return vm.clone();
    };
    let mut out = vm.clone();
    out.spec.networks = launched
        .iter()
        .map(|l| {
            let mut nic = l.spec.clone();
            if let Some(ip) = l.ip {
                nic.ip_address = Some(ip.to_string());
            }
            nic
        })
        .collect();
    out
}

/// Every VM with its networks in effect, in the order given.
pub fn vms_in_effect(
    vms: &[VirtualMachine],
    launched: &BTreeMap<String, Vec<LaunchedInterface>>,
) -> Vec<VirtualMachine> {
    vms.iter()
        .map(|vm| in_effect(vm, launched.get(&vm.metadata.name).map(Vec::as_slice)))
        .collect()
}

/// `vms` with those whose QEMU has interfaces first (a stable sort: the
/// order is otherwise kept).
pub fn running_first(
    mut vms: Vec<VirtualMachine>,
    launched: &BTreeMap<String, Vec<LaunchedInterface>>,
) -> Vec<VirtualMachine> {
    vms.sort_by_key(|vm| !launched.contains_key(&vm.metadata.name));
    vms
}

/// Whether the spec's networks differ from those a QEMU was started with:
/// they take effect at its next start.
pub fn networks_changed(vm: &VirtualMachine, launched: &[LaunchedInterface]) -> bool {
    vm.spec.networks.len() != launched.len()
        || vm
            .spec
            .networks
            .iter()
            .zip(launched)
            .any(|(spec, l)| *spec != l.spec)
}

/// The interfaces a QEMU of `vm` gets if it starts now: its spec's, each
/// with its lease. The lease must be the one the interface asks for: on its
/// network, for its MAC, at its reservation if it has one (after an edit the
/// stored lease may still be the old one until its network plans again).
/// Every NAT or Isolated interface must have one (`hands_out_addresses` says
/// which networks are). The error names the first interface that is not
/// ready.
pub fn to_launch(
    vm: &VirtualMachine,
    leases: &[StoredLease],
    hands_out_addresses: impl Fn(&str) -> bool,
) -> Result<Vec<LaunchedInterface>, NetworkError> {
    vm.spec
        .networks
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let net = &spec.virtual_network_name;
            let lease = leases
                .iter()
                .find(|l| l.vm == vm.metadata.name && l.interface == i as u32 && l.network == *net);
            let mac = mac_of(vm, i).map(|m| m.to_string());
            let reserved: Option<Ipv4Addr> =
                spec.ip_address.as_deref().and_then(|a| a.parse().ok());
            let ip = match (lease, reserved) {
                (Some(l), _) if mac.as_ref() != Some(&l.mac) => {
                    return Err(NetworkError::LeasedToOldMac {
                        index: i,
                        network: net.clone(),
                        mac: l.mac.clone(),
                    });
                }
                (Some(l), Some(r)) if l.ip != r => {
                    return Err(NetworkError::ReservationNotLeased {
                        index: i,
                        network: net.clone(),
                        reserved: r,
                        still: Some(l.ip),
                    });
                }
                (Some(l), _) => Some(l.ip),
                (None, Some(r)) => {
                    return Err(NetworkError::ReservationNotLeased {
                        index: i,
                        network: net.clone(),
                        reserved: r,
                        still: None,
                    });
                }
                (None, None) if hands_out_addresses(net) => {
                    return Err(NetworkError::NoAddressYet {
                        index: i,
                        network: net.clone(),
                    });
                }
                (None, None) => None,
            };
            Ok(LaunchedInterface {
                spec: spec.clone(),
                ip,
            })
        })
        .collect()
}

/// A network as stored: its object, whether it is being deleted, and its
/// subnet (given or picked; `None` while none is known).
pub struct StoredNetwork<'a> {
    pub network: &'a VirtualNetwork,
    pub deleting: bool,
    pub subnet: Option<Ipv4Cidr>,
}

/// The host interface a network's taps join: hearth's bridge, or the
/// existing bridge of a `Bridge` network.
pub fn host_bridge(network: &VirtualNetwork) -> String {
    match network.spec.mode {
        ApiMode::Bridge => network.spec.bridge.clone().unwrap_or_default(),
        ApiMode::Nat | ApiMode::Isolated => names::bridge_name(&network.metadata.name),
    }
}

/// Everything the host must have for these objects; `vms` with their
/// networks in effect ([`vms_in_effect`]). A network being deleted, or one
/// without a subnet (a NAT or Isolated network whose subnet is not picked
/// yet), is left out, and so are the taps of its interfaces. A VM's taps
/// exist as long as the VM is stored, running or not, so a restart finds
/// them in place. A NAT network's DNS forwards to the `nameserver`s of
/// `dns_upstream`. A host port is forwarded once: should two VMs ask for it
/// (apply refuses that), the first in `vms` has it.
pub fn host_desired(
    networks: &[StoredNetwork<'_>],
    vms: &[VirtualMachine],
    leases: &[StoredLease],
    dns_upstream: &Path,
) -> HostDesired {
    let mut desired = HostDesired::default();
    // network name -> bridge its taps join
    let mut joined: BTreeMap<&str, String> = BTreeMap::new();
    let lease_of = |network: &str, vm: &str, interface: u32| {
        leases
            .iter()
            .find(|l| l.network == network && l.vm == vm && l.interface == interface)
    };
    // network name -> its forwards; VM by VM, so that a host port asked for
    // twice goes to the first VM.
    let mut forwards: BTreeMap<&str, Vec<PortForward>> = BTreeMap::new();
    let mut taken: Vec<PortForward> = Vec::new();
    for vm in vms {
        for (i, iface) in vm.spec.networks.iter().enumerate() {
            let name = iface.virtual_network_name.as_str();
            let Some(lease) = lease_of(name, &vm.metadata.name, i as u32) else {
                continue;
            };
            for p in &iface.ports {
                let (Ok(host_port), Ok(guest_port)) =
                    (u16::try_from(p.host_port), u16::try_from(p.guest_port))
                else {
                    continue;
                };
                let forward = PortForward {
                    protocol: match p.protocol {
                        ApiProtocol::Tcp => Protocol::Tcp,
                        ApiProtocol::Udp => Protocol::Udp,
                    },
                    host_addr: p.host_address.as_deref().and_then(|a| a.parse().ok()),
                    host_port,
                    guest_ip: lease.ip,
                    guest_port,
                };
                let clashes = taken.iter().any(|t| {
                    t.protocol == forward.protocol
                        && t.host_port == forward.host_port
                        && (t.host_addr.is_none()
                            || forward.host_addr.is_none()
                            || t.host_addr == forward.host_addr)
                });
                if !clashes {
                    taken.push(forward.clone());
                    forwards.entry(name).or_default().push(forward);
                }
            }
        }
    }
    for stored in networks.iter().filter(|n| !n.deleting) {
        let net = stored.network;
        let name = net.metadata.name.as_str();
        let (mode, gateway, prefix_len) = match (net.spec.mode, stored.subnet) {
            (ApiMode::Bridge, _) => (
                NetworkMode::Bridge {
                    existing: host_bridge(net),
                },
                Ipv4Addr::UNSPECIFIED,
                0,
            ),
            (ApiMode::Nat, Some(s)) => (NetworkMode::Nat, s.gateway(), s.prefix()),
            (ApiMode::Isolated, Some(s)) => (NetworkMode::Isolated, s.gateway(), s.prefix()),
            (ApiMode::Nat | ApiMode::Isolated, None) => continue,
        };
        let mut static_leases: Vec<StaticLease> = leases
            .iter()
            .filter(|l| l.network == name)
            .filter_map(|l| {
                Some(StaticLease {
                    mac: Mac(l.mac.parse::<hearth_api::net::MacAddr>().ok()?.0),
                    ip: l.ip,
                    hostname: l.vm.clone(),
                })
            })
            .collect();
        static_leases.sort_by_key(|l| l.ip);
        let mut port_forwards = if matches!(mode, NetworkMode::Bridge { .. }) {
            Vec::new()
        } else {
            forwards.remove(name).unwrap_or_default()
        };
        port_forwards.sort_by_key(|f| (f.protocol, f.host_port, f.host_addr));
        joined.insert(name, host_bridge(net));
        desired.networks.push(HostNetwork {
            bridge: names::bridge_name(name),
            gateway,
            prefix_len,
            dhcp: net.spec.dhcp_enabled(),
            dns: match (net.spec.dns_enabled(), &mode) {
                (false, _) => Dns::Off,
                (true, NetworkMode::Nat) => Dns::Forward(dns_upstream.to_path_buf()),
                (true, _) => Dns::Local,
            },
            mode,
            static_leases,
            port_forwards,
        });
    }
    for vm in vms {
        for (i, iface) in vm.spec.networks.iter().enumerate() {
            if let Some(bridge) = joined.get(iface.virtual_network_name.as_str()) {
                desired.taps.push(DesiredTap {
                    name: names::tap_name(&vm.metadata.name, i as u32),
                    bridge: bridge.clone(),
                });
            }
        }
    }
    desired.networks.sort_by(|a, b| a.bridge.cmp(&b.bridge));
    desired.taps.sort_by(|a, b| a.name.cmp(&b.name));
    desired
}

/// One NIC of a VM as QEMU gets it: the tap, the MAC and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub network: String,
    pub tap: String,
    pub mac: String,
    /// The address hearth leased to it (none on a `Bridge` network without
    /// a reservation).
    pub ip: Option<Ipv4Addr>,
}

/// The NICs of `vm`, in guest order.
pub fn nics_of(vm: &VirtualMachine, leases: &[StoredLease]) -> Vec<Nic> {
    vm.spec
        .networks
        .iter()
        .enumerate()
        .map(|(i, iface)| Nic {
            network: iface.virtual_network_name.clone(),
            tap: names::tap_name(&vm.metadata.name, i as u32),
            mac: mac_of(vm, i).map(|m| m.to_string()).unwrap_or_default(),
            ip: leases
                .iter()
                .find(|l| {
                    l.vm == vm.metadata.name
                        && l.interface == i as u32
                        && l.network == iface.virtual_network_name
                })
                .map(|l| l.ip),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPSTREAM: &str = "/etc/resolv.conf";

    fn network(yaml: &str) -> VirtualNetwork {
        match hearth_api::parse_documents(yaml, "test")
            .expect("parse")
            .remove(0)
        {
            hearth_api::Object::VirtualNetwork(n) => n,
            other => panic!("not a network: {other:?}"),
        }
    }

    fn vm(yaml_networks: &str, name: &str) -> VirtualMachine {
        let doc = format!(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  cpus: 1\n  memory: 128Mi\n  boot: {{kernel: /k}}\n  networks: {yaml_networks}\n"
        );
        match hearth_api::parse_documents(&doc, "test")
            .expect("parse")
            .remove(0)
        {
            hearth_api::Object::VirtualMachine(v) => v,
            other => panic!("not a vm: {other:?}"),
        }
    }

    fn lease(network: &str, vm: &VirtualMachine, i: u32, ip: &str) -> StoredLease {
        StoredLease {
            network: network.into(),
            vm: vm.metadata.name.clone(),
            interface: i,
            ip: ip.parse().unwrap(),
            mac: mac_of(vm, i as usize).unwrap().to_string(),
        }
    }

    fn subnet(s: &str) -> Option<Ipv4Cidr> {
        Some(s.parse().unwrap())
    }

    /// Read from a real store: the VMs with an interface in their spec,
    /// and those whose QEMU runs with one though their spec has none now;
    /// a VM with neither is not read, nor one whose QEMU has none.
    #[test]
    fn the_networked_vms_are_those_with_an_interface_in_their_spec_or_their_qemu() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).unwrap();
        let vms = [
            vm("[{virtualNetworkName: lan}]", "on-lan"),
            vm("[]", "moved-off"),
            vm("[]", "ran-without"),
            vm("[]", "plain"),
        ];
        store
            .put_objects(
                &vms.iter()
                    .cloned()
                    .map(hearth_api::Object::VirtualMachine)
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        let on_lan = LaunchedInterface {
            spec: vm("[{virtualNetworkName: lan}]", "x")
                .spec
                .networks
                .remove(0),
            ip: Some(Ipv4Addr::new(10, 0, 0, 5)),
        };
        let launched = BTreeMap::from([
            ("moved-off".to_string(), vec![on_lan.clone()]),
            ("ran-without".to_string(), vec![]),
            ("gone".to_string(), vec![on_lan]),
        ]);
        let names: Vec<String> = networked_vms(&store, &launched)
            .unwrap()
            .into_iter()
            .map(|v| v.metadata.name)
            .collect();
        assert_eq!(names, ["moved-off", "on-lan"]);
        assert_eq!(
            vms_using_network(&store, "lan").unwrap(),
            ["on-lan".to_string()]
        );
    }

    #[test]
    fn a_nat_network_gets_its_bridge_leases_forwards_and_taps() {
        let lan = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lan}\nspec: {}\n",
        );
        let web = vm(
            "[{virtualNetworkName: lan, ports: [{hostPort: 2222, guestPort: 22}, {hostPort: 5353, guestPort: 53, protocol: UDP, hostAddress: 10.9.9.9}]}]",
            "web",
        );
        let db = vm(
            "[{virtualNetworkName: lan}, {virtualNetworkName: lan}]",
            "db",
        );
        let leases = vec![
            lease("lan", &web, 0, "10.77.0.10"),
            lease("lan", &db, 0, "10.77.0.11"),
            lease("lan", &db, 1, "10.77.0.12"),
        ];
        let nets = [StoredNetwork {
            network: &lan,
            deleting: false,
            subnet: subnet("10.77.0.0/24"),
        }];
        let d = host_desired(
            &nets,
            &[web.clone(), db.clone()],
            &leases,
            Path::new(UPSTREAM),
        );
        assert_eq!(d.networks.len(), 1);
        let n = &d.networks[0];
        assert_eq!(n.bridge, "hth-lan");
        assert_eq!(n.gateway, "10.77.0.1".parse::<Ipv4Addr>().unwrap());
        assert_eq!(n.prefix_len, 24);
        assert_eq!(
            n.dns,
            Dns::Forward(UPSTREAM.into()),
            "a NAT network forwards"
        );
        assert!(n.dhcp);
        assert_eq!(n.mode, NetworkMode::Nat);
        assert_eq!(
            n.static_leases
                .iter()
                .map(|l| (l.ip.to_string(), l.hostname.as_str()))
                .collect::<Vec<_>>(),
            [
                ("10.77.0.10".to_string(), "web"),
                ("10.77.0.11".to_string(), "db"),
                ("10.77.0.12".to_string(), "db")
            ]
        );
        assert_eq!(n.port_forwards.len(), 2);
        assert_eq!(n.port_forwards[0].host_port, 2222);
        assert_eq!(n.port_forwards[0].guest_ip.to_string(), "10.77.0.10");
        assert_eq!(n.port_forwards[1].protocol, Protocol::Udp);
        assert_eq!(
            n.port_forwards[1].host_addr,
            Some("10.9.9.9".parse().unwrap())
        );
        assert_eq!(
            d.taps
                .iter()
                .map(|t| (t.name.as_str(), t.bridge.as_str()))
                .collect::<Vec<_>>(),
            [
                ("htt-db-0", "hth-lan"),
                ("htt-db-1", "hth-lan"),
                ("htt-web-0", "hth-lan")
            ]
        );
        d.validate().expect("valid desired state");
        let nics = nics_of(&db, &leases);
        assert_eq!(nics[1].tap, "htt-db-1");
        assert_eq!(nics[1].ip, Some("10.77.0.12".parse().unwrap()));
    }

    #[test]
    fn deleted_or_subnetless_networks_and_their_taps_are_left_out() {
        let gone = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: gone}\nspec: {}\n",
        );
        let new = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: new}\nspec: {mode: Isolated}\n",
        );
        let br = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: br}\nspec: {mode: Bridge, bridge: br0}\n",
        );
        let a = vm(
            "[{virtualNetworkName: gone}, {virtualNetworkName: new}, {virtualNetworkName: br, ports: [{hostPort: 80, guestPort: 80}]}]",
            "a",
        );
        let nets = [
            StoredNetwork {
                network: &gone,
                deleting: true,
                subnet: subnet("10.77.0.0/24"),
            },
            StoredNetwork {
                network: &new,
                deleting: false,
                subnet: None,
            },
            StoredNetwork {
                network: &br,
                deleting: false,
                subnet: None,
            },
        ];
        let d = host_desired(&nets, &[a], &[], Path::new(UPSTREAM));
        assert_eq!(d.networks.len(), 1, "{d:?}");
        assert_eq!(
            d.networks[0].mode,
            NetworkMode::Bridge {
                existing: "br0".into()
            }
        );
        assert!(!d.networks[0].dhcp);
        assert_eq!(d.networks[0].dns, Dns::Off, "no DNS where no DHCP");
        assert!(d.networks[0].port_forwards.is_empty());
        assert_eq!(d.taps.len(), 1);
        assert_eq!(d.taps[0].name, "htt-a-2");
        assert_eq!(d.taps[0].bridge, "br0");
        d.validate().expect("valid desired state");
    }

    #[test]
    fn the_same_store_always_asks_for_the_same_host() {
        let lan = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lan}\nspec: {}\n",
        );
        let a = vm("[{virtualNetworkName: lan}]", "a");
        let b = vm("[{virtualNetworkName: lan}]", "b");
        let leases = vec![
            lease("lan", &b, 0, "10.77.0.11"),
            lease("lan", &a, 0, "10.77.0.10"),
        ];
        let nets = [StoredNetwork {
            network: &lan,
            deleting: false,
            subnet: subnet("10.77.0.0/24"),
        }];
        let one = host_desired(&nets, &[a.clone(), b.clone()], &leases, Path::new(UPSTREAM));
        let mut reversed = leases.clone();
        reversed.reverse();
        let two = host_desired(&nets, &[b, a], &reversed, Path::new(UPSTREAM));
        assert_eq!(one, two);
    }

    #[test]
    fn a_running_qemu_keeps_its_tap_forward_and_host_line_after_its_spec_moves_on() {
        let lan = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lan}\nspec: {}\n",
        );
        let iso = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: iso}\nspec: {mode: Isolated}\n",
        );
        let started = vm(
            "[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}]",
            "a",
        );
        let moved = vm("[{virtualNetworkName: iso}]", "a");
        let leases = vec![lease("lan", &started, 0, "10.77.0.10")];
        let launched = to_launch(&started, &leases, |_| true).expect("leased");
        assert_eq!(launched[0].ip, Some("10.77.0.10".parse().unwrap()));
        assert!(networks_changed(&moved, &launched));
        assert!(!networks_changed(&started, &launched));
        assert_eq!(
            to_launch(&moved, &leases, |_| true)
                .unwrap_err()
                .to_string(),
            "spec.networks[0]: no address on VirtualNetwork \"iso\" yet"
        );
        let nets = [
            StoredNetwork {
                network: &lan,
                deleting: false,
                subnet: subnet("10.77.0.0/24"),
            },
            StoredNetwork {
                network: &iso,
                deleting: false,
                subnet: subnet("10.78.0.0/24"),
            },
        ];
        let by_vm: BTreeMap<String, Vec<LaunchedInterface>> =
            [("a".to_string(), launched)].into_iter().collect();
        let now = host_desired(
            &nets,
            &vms_in_effect(std::slice::from_ref(&moved), &by_vm),
            &leases,
            Path::new(UPSTREAM),
        );
        assert_eq!(now.taps.len(), 1);
        assert_eq!(now.taps[0].name, "htt-a-0");
        assert_eq!(now.taps[0].bridge, "hth-lan", "the tap its QEMU holds");
        let lan_now = now.networks.iter().find(|n| n.bridge == "hth-lan").unwrap();
        assert_eq!(lan_now.port_forwards.len(), 1);
        assert_eq!(lan_now.static_leases.len(), 1);
        // Without a QEMU, the spec is in effect.
        let later = host_desired(
            &nets,
            &vms_in_effect(&[moved], &BTreeMap::new()),
            &[],
            Path::new(UPSTREAM),
        );
        assert_eq!(later.taps[0].bridge, "hth-iso");
        assert!(later.networks.iter().all(|n| n.port_forwards.is_empty()));
    }

    #[test]
    fn a_host_port_asked_for_twice_goes_to_the_first_vm_only() {
        let lan = network(
            "apiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lan}\nspec: {}\n",
        );
        let ports = "[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}]";
        let (a, b) = (vm(ports, "a"), vm(ports, "b"));
        let leases = vec![
            lease("lan", &a, 0, "10.77.0.10"),
            lease("lan", &b, 0, "10.77.0.11"),
        ];
        let nets = [StoredNetwork {
            network: &lan,
            deleting: false,
            subnet: subnet("10.77.0.0/24"),
        }];
        let by_vm: BTreeMap<String, Vec<LaunchedInterface>> = [(
            "b".to_string(),
            to_launch(&b, &leases, |_| true).expect("leased"),
        )]
        .into_iter()
        .collect();
        let vms = running_first(vms_in_effect(&[a, b], &by_vm), &by_vm);
        let d = host_desired(&nets, &vms, &leases, Path::new(UPSTREAM));
        d.validate().expect("valid: one forward of 8080");
        let forwards = &d.networks[0].port_forwards;
        assert_eq!(forwards.len(), 1);
        assert_eq!(
            forwards[0].guest_ip.to_string(),
            "10.77.0.11",
            "the running VM keeps it"
        );
    }

    #[test]
    fn a_launch_waits_for_the_lease_its_interface_asks_for() {
        let a = vm("[{virtualNetworkName: lan}]", "a");
        let leases = vec![lease("lan", &a, 0, "10.77.0.10")];
        assert_eq!(
            to_launch(&a, &leases, |_| true).unwrap()[0].ip,
            Some("10.77.0.10".parse().unwrap())
        );
        // Edited, not planned again yet: the stored lease is the old one.
        let reserved = vm("[{virtualNetworkName: lan, ipAddress: 10.77.0.20}]", "a");
        assert_eq!(
            to_launch(&reserved, &leases, |_| true)
                .unwrap_err()
                .to_string(),
            "spec.networks[0]: 10.77.0.20 is not leased to it on VirtualNetwork \"lan\" yet (it still has 10.77.0.10)"
        );
        let new_mac = vm(
            "[{virtualNetworkName: lan, macAddress: \"02:00:00:00:00:99\"}]",
            "a",
        );
        assert!(
            to_launch(&new_mac, &leases, |_| true)
                .unwrap_err()
                .to_string()
                .contains("still leased to the MAC"),
        );
        // A network that hands out no addresses (Bridge) needs none.
        assert_eq!(to_launch(&a, &[], |_| false).unwrap()[0].ip, None);
        assert!(to_launch(&a, &[], |_| true).is_err());
    }
}
