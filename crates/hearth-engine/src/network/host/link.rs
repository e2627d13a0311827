//! Bridges and taps through rtnetlink, persistent taps through
//! `/dev/net/tun`.
//!
//! The kernel creates tun/tap devices only through the `TUNSETIFF` ioctl
//! (rtnetlink's "tun" kind refuses `RTM_NEWLINK`), so a tap is made with the
//! ioctl, made persistent, and then enslaved and brought up over netlink like
//! any other link. Everything else (bridges, addresses, masters, up state,
//! deletion, listing) is netlink.
//!
//! The netlink socket belongs to the network namespace of the thread that
//! opens it: [`Netlink::open`] is called in the namespace hearthd runs in.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;

use futures_util::TryStreamExt;
use rtnetlink::packet_core::Nla;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{
    InfoData, InfoKind, InfoTun, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::{Handle, LinkBridge, LinkUnspec, RouteMessageBuilder};

use super::{BRIDGE_PREFIX, HostError, TAP_PREFIX, check_ifname};

/// What a link is, from its `IFLA_INFO_KIND`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkKind {
    Bridge,
    /// A tun or tap device.
    Tun,
    Other(String),
    /// No kind reported (a physical device, loopback).
    None,
}

/// One link as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedLink {
    pub index: u32,
    pub name: String,
    pub kind: LinkKind,
    /// Name of the bridge it is enslaved to.
    pub master: Option<String>,
    /// IPv4 addresses with their prefix lengths.
    pub addresses: Vec<(Ipv4Addr, u8)>,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// For tun/tap devices: their settings.
    pub tun: Option<TunInfo>,
}

/// A tun/tap device's settings (`IFLA_TUN_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TunInfo {
    /// A tap (layer 2), not a tun.
    pub tap: bool,
    /// Packet information header on (hearth wants it off).
    pub pi: bool,
    pub vnet_hdr: bool,
    pub persist: bool,
    pub owner: Option<u32>,
}

impl TunInfo {
    /// What QEMU's `-netdev tap,ifname=` expects of a persistent tap.
    pub fn is_hearth_tap(&self) -> bool {
        self.tap && !self.pi && self.vnet_hdr && self.persist
    }

    fn parse(nlas: &[InfoTun]) -> Self {
        // <linux/if_link.h>: IFLA_TUN_OWNER 1, TYPE 3, PI 4, VNET_HDR 5, PERSIST 6.
        let mut info = TunInfo::default();
        for item in nlas {
            let nla = match item {
                InfoTun::Other(nla) => nla,
                #[allow(unreachable_patterns)]
                _ => continue,
            };
            let mut value = vec![0u8; nla.value_len()];
            nla.emit_value(&mut value);
            let byte = value.first().copied().unwrap_or(0);
            match nla.kind() {
                1 if value.len() >= 4 => {
                    let owner = u32::from_ne_bytes([value[0], value[1], value[2], value[3]]);
                    info.owner = (owner != u32::MAX).then_some(owner);
                }
                3 => info.tap = byte == 2,
                4 => info.pi = byte != 0,
                5 => info.vnet_hdr = byte != 0,
                6 => info.persist = byte != 0,
                _ => {}
            }
        }
        info
    }
}

impl ObservedLink {
    /// Whether the name carries one of hearth's prefixes.
    pub fn is_hearths(&self) -> bool {
        is_hearth_name(&self.name)
    }
}

pub fn is_hearth_name(name: &str) -> bool {
    name.starts_with(BRIDGE_PREFIX) || name.starts_with(TAP_PREFIX)
}

/// One change made on the host, for logs and for tests that check that a
/// second apply changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkChange {
    Created(String),
    AddressAdded {
        link: String,
        addr: Ipv4Addr,
        prefix_len: u8,
    },
    AddressRemoved {
        link: String,
        addr: Ipv4Addr,
        prefix_len: u8,
    },
    Enslaved {
        link: String,
        master: String,
    },
    BroughtUp(String),
    Deleted(String),
}

/// A netlink connection in the current thread's network namespace.
pub struct Netlink {
    handle: Handle,
}

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> HostError {
    let what = what.into();
    move |source| HostError::Netlink { what, source }
}

impl Netlink {
    /// Opens the socket and spawns its connection task on the current tokio
    /// runtime.
    pub fn open() -> Result<Self, HostError> {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|e| HostError::io("opening a netlink socket", e))?;
        tokio::spawn(conn);
        Ok(Netlink { handle })
    }

    async fn links(&self) -> Result<Vec<LinkMessage>, HostError> {
        self.handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(nl("listing links"))
    }

    /// Every link: the ground truth for reconcile and cleanup.
    pub async fn observe_all(&self) -> Result<Vec<ObservedLink>, HostError> {
        let msgs = self.links().await?;
        let mut by_index = std::collections::BTreeMap::new();
        for m in &msgs {
            if let Some(name) = link_name(m) {
                by_index.insert(m.header.index, name);
            }
        }
        let addrs: Vec<_> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(nl("listing addresses"))?;
        let mut out = Vec::new();
        for m in &msgs {
            let Some(name) = link_name(m) else { continue };
            let mut kind = LinkKind::None;
            let mut master = None;
            let mut tun = None;
            for attr in &m.attributes {
                match attr {
                    LinkAttribute::LinkInfo(infos) => {
                        for info in infos {
                            match info {
                                LinkInfo::Kind(k) => {
                                    kind = match k {
                                        InfoKind::Bridge => LinkKind::Bridge,
                                        InfoKind::Tun => LinkKind::Tun,
                                        other => LinkKind::Other(other.to_string()),
                                    };
                                }
                                LinkInfo::Data(InfoData::Tun(nlas)) => {
                                    tun = Some(TunInfo::parse(nlas));
                                }
                                _ => {}
                            }
                        }
                    }
                    LinkAttribute::Controller(idx) => master = by_index.get(idx).cloned(),
                    _ => {}
                }
            }
            let mut addresses = Vec::new();
            for a in addrs.iter().filter(|a| a.header.index == m.header.index) {
                for attr in &a.attributes {
                    if let AddressAttribute::Local(IpAddr::V4(ip)) = attr {
                        addresses.push((*ip, a.header.prefix_len));
                    }
                }
            }
            addresses.sort();
            out.push(ObservedLink {
                index: m.header.index,
                name,
                kind,
                master,
                addresses,
                up: m.header.flags.contains(LinkFlags::Up),
                tun,
            });
        }
        Ok(out)
    }

    /// Every link whose name starts with `hth` or `htt`.
    pub async fn observe(&self) -> Result<Vec<ObservedLink>, HostError> {
        Ok(self
            .observe_all()
            .await?
            .into_iter()
            .filter(ObservedLink::is_hearths)
            .collect())
    }

    async fn find(&self, name: &str) -> Result<Option<ObservedLink>, HostError> {
        Ok(self
            .observe_all()
            .await?
            .into_iter()
            .find(|l| l.name == name))
    }

    /// Makes `name` a bridge with exactly `addr/prefix_len` as its IPv4
    /// address, and up. Returns what it changed (nothing when it already was).
    pub async fn ensure_bridge(
        &self,
        name: &str,
        addr: Ipv4Addr,
        prefix_len: u8,
    ) -> Result<Vec<LinkChange>, HostError> {
        check_ifname("bridge", "name", name, Some(BRIDGE_PREFIX))?;
        let mut changes = Vec::new();
        let link = match self.find(name).await? {
            Some(l) => l,
            None => {
                self.handle
                    .link()
                    .add(LinkBridge::new(name).build())
                    .execute()
                    .await
                    .map_err(nl(format!("creating bridge {name}")))?;
                changes.push(LinkChange::Created(name.to_string()));
                self.find(name).await?.ok_or_else(|| HostError::Command {
                    what: format!("creating bridge {name}"),
                    detail: "the kernel accepted it but does not list it".into(),
                })?
            }
        };
        if link.kind != LinkKind::Bridge {
            return Err(HostError::Command {
                what: format!("bridge {name}"),
                detail: format!("a link of kind {:?} already has this name", link.kind),
            });
        }
        for &(a, p) in &link.addresses {
            if (a, p) != (addr, prefix_len) {
                let msg = self
                    .handle
                    .address()
                    .get()
                    .set_link_index_filter(link.index)
                    .execute()
                    .try_collect::<Vec<_>>()
                    .await
                    .map_err(nl(format!("listing addresses of {name}")))?;
                for m in msg.into_iter().filter(|m| {
                    m.header.prefix_len == p
                        && m.attributes
                            .contains(&AddressAttribute::Local(IpAddr::V4(a)))
                }) {
                    self.handle
                        .address()
                        .del(m)
                        .execute()
                        .await
                        .map_err(nl(format!("removing {a}/{p} from {name}")))?;
                }
                changes.push(LinkChange::AddressRemoved {
                    link: name.to_string(),
                    addr: a,
                    prefix_len: p,
                });
            }
        }
        if !link.addresses.contains(&(addr, prefix_len)) {
            self.handle
                .address()
                .add(link.index, IpAddr::V4(addr), prefix_len)
                .execute()
                .await
                .map_err(nl(format!("adding {addr}/{prefix_len} to {name}")))?;
            changes.push(LinkChange::AddressAdded {
                link: name.to_string(),
                addr,
                prefix_len,
            });
        }
        if !link.up {
            self.set_up(&link).await?;
            changes.push(LinkChange::BroughtUp(name.to_string()));
        }
        Ok(changes)
    }

    async fn set_up(&self, link: &ObservedLink) -> Result<(), HostError> {
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(link.index).up().build())
            .execute()
            .await
            .map_err(nl(format!("bringing {} up", link.name)))
    }

    /// Makes `name` a persistent tap owned by root, enslaved to `bridge`
    /// (which must exist), and up.
    pub async fn ensure_tap(&self, name: &str, bridge: &str) -> Result<Vec<LinkChange>, HostError> {
        check_ifname("tap", "name", name, Some(TAP_PREFIX))?;
        let mut changes = Vec::new();
        let all = self.observe_all().await?;
        let Some(master) = all.iter().find(|l| l.name == bridge) else {
            return Err(HostError::Command {
                what: format!("tap {name}"),
                detail: format!("bridge {bridge} does not exist"),
            });
        };
        if master.kind != LinkKind::Bridge {
            return Err(HostError::Command {
                what: format!("tap {name}"),
                detail: format!("{bridge} is not a bridge"),
            });
        }
        let master_index = master.index;
        let existing = all.iter().find(|l| l.name == name).cloned();
        // A tap of hearth's name with other settings (left by an older run or
        // made by hand) is made again: a tun would make QEMU's open fail, and
        // the rest must be what hearth made, not what an open happened to set.
        let existing = match existing {
            Some(l) if l.kind == LinkKind::Tun && !l.tun.is_some_and(|t| t.is_hearth_tap()) => {
                self.handle
                    .link()
                    .del(l.index)
                    .execute()
                    .await
                    .map_err(nl(format!("deleting mis-set tap {name}")))?;
                changes.push(LinkChange::Deleted(name.to_string()));
                None
            }
            other => other,
        };
        let link = match existing {
            Some(l) => l,
            None => {
                create_persistent_tap(name)?;
                changes.push(LinkChange::Created(name.to_string()));
                self.find(name).await?.ok_or_else(|| HostError::Command {
                    what: format!("creating tap {name}"),
                    detail: "the kernel accepted it but does not list it".into(),
                })?
            }
        };
        if link.kind != LinkKind::Tun {
            return Err(HostError::Command {
                what: format!("tap {name}"),
                detail: format!("a link of kind {:?} already has this name", link.kind),
            });
        }
        if link.master.as_deref() != Some(bridge) {
            self.handle
                .link()
                .set(
                    LinkUnspec::new_with_index(link.index)
                        .controller(master_index)
                        .build(),
                )
                .execute()
                .await
                .map_err(nl(format!("enslaving {name} to {bridge}")))?;
            changes.push(LinkChange::Enslaved {
                link: name.to_string(),
                master: bridge.to_string(),
            });
        }
        if !link.up {
            self.set_up(&link).await?;
            changes.push(LinkChange::BroughtUp(name.to_string()));
        }
        Ok(changes)
    }

    /// Deletes a link of hearth's by name. `false` when there was none.
    /// Refuses names without hearth's prefix.
    pub async fn remove(&self, name: &str) -> Result<bool, HostError> {
        if !is_hearth_name(name) {
            return Err(HostError::Command {
                what: format!("removing link {name}"),
                detail: "not one of hearth's (no hth/htt prefix)".into(),
            });
        }
        let Some(link) = self.find(name).await? else {
            return Ok(false);
        };
        self.handle
            .link()
            .del(link.index)
            .execute()
            .await
            .map_err(nl(format!("deleting {name}")))?;
        Ok(true)
    }

    /// The IPv4 networks the host uses outside hearth's own links: the
    /// addresses of every other interface and the routes of the main table
    /// (`cidr`, and how an error names it). What a new network's subnet must
    /// not overlap.
    pub async fn host_networks(&self) -> Result<Vec<(Ipv4Addr, u8, String)>, HostError> {
        let links = self.observe_all().await?;
        let hearths: std::collections::BTreeMap<u32, &str> = links
            .iter()
            .filter(|l| l.is_hearths())
            .map(|l| (l.index, l.name.as_str()))
            .collect();
        let mut out = Vec::new();
        for l in links.iter().filter(|l| !l.is_hearths()) {
            for (ip, len) in &l.addresses {
                out.push((*ip, *len, format!("address of {}", l.name)));
            }
        }
        let routes: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(nl("listing routes"))?;
        for r in &routes {
            let mut table = u32::from(r.header.table);
            let mut dest = Ipv4Addr::UNSPECIFIED;
            let mut oif = None;
            let mut via = None;
            for a in &r.attributes {
                match a {
                    RouteAttribute::Table(t) => table = *t,
                    RouteAttribute::Destination(RouteAddress::Inet(ip)) => dest = *ip,
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Gateway(RouteAddress::Inet(ip)) => via = Some(*ip),
                    _ => {}
                }
            }
            if table != u32::from(RouteHeader::RT_TABLE_MAIN)
                || oif.is_some_and(|i| hearths.contains_key(&i))
            {
                continue;
            }
            let dev = oif
                .and_then(|i| links.iter().find(|l| l.index == i))
                .map(|l| l.name.as_str())
                .unwrap_or("?");
            let what = match via {
                Some(gw) => format!("route via {gw} dev {dev}"),
                None => format!("route dev {dev}"),
            };
            out.push((dest, r.header.destination_prefix_length, what));
        }
        Ok(out)
    }
}

fn link_name(m: &LinkMessage) -> Option<String> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

// <linux/if_tun.h>
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;

/// Creates a persistent tap (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, owner
/// root) so that QEMU can open it by name later; the creating file
/// descriptor is closed again.
pub fn create_persistent_tap(name: &str) -> Result<(), HostError> {
    check_ifname("tap", "name", name, Some(TAP_PREFIX))?;
    // check_ifname bounds the name to 15 bytes.
    let tun = hearth_qemu::handover::tun_attach(name)
        .map_err(|e| HostError::io(format!("tap {name}: opening /dev/net/tun, TUNSETIFF"), e))?;
    let fd = tun.as_raw_fd();
    let ioctl = |op: libc::c_ulong, arg: libc::c_ulong, what: &str| -> Result<(), HostError> {
        // SAFETY: fd is an open /dev/net/tun descriptor owned by `tun`; the
        // argument is an integer, as each request expects.
        let rc = unsafe { libc::ioctl(fd, op, arg) };
        if rc < 0 {
            Err(HostError::io(
                format!("tap {name}: {what}"),
                std::io::Error::last_os_error(),
            ))
        } else {
            Ok(())
        }
    };
    ioctl(TUNSETOWNER, 0, "TUNSETOWNER")?;
    ioctl(TUNSETPERSIST, 1, "TUNSETPERSIST")?;
    Ok(())
}
