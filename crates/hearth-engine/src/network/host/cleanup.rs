//! What to remove from the host: a pure plan from the desired state and what
//! was observed, and the shell that carries it out.
//!
//! Run at start-up (after a crash, in-memory state is gone and the host is
//! the only record) and after a network or tap is deleted. The rules:
//! - a link with hearth's prefix (`hth`, `htt`) that no desired network or
//!   tap names is deleted, taps before bridges;
//! - a dnsmasq whose `--conf-file` lies under the networks directory and
//!   whose network is not desired with DHCP is stopped;
//! - a directory of the networks directory with hearth's prefix that no
//!   such network needs is removed (after its dnsmasq is stopped);
//! - the `inet hearth` table is deleted when no desired network needs rules
//!   (otherwise the next apply replaces it whole, which drops every rule
//!   that is not desired).
//!
//! Nothing without the prefix, outside the networks directory or outside the
//! table is in the plan, whatever was observed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::dnsmasq::{self, FoundDnsmasq};
use super::link::{LinkKind, Netlink, ObservedLink, is_hearth_name};
use super::{HostDesired, HostError, NetworkMode, network_dir, nft};

/// What was found on the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    pub links: Vec<ObservedLink>,
    pub dnsmasq: Vec<FoundDnsmasq>,
    /// The directories of the networks directory with hearth's prefix.
    pub dirs: Vec<PathBuf>,
    pub nft_table: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CleanupAction {
    DeleteLink(String),
    StopDnsmasq(FoundDnsmasq),
    RemoveDir(PathBuf),
    DeleteNftTable,
}

/// The actions that bring `observed` down to what `desired` allows.
pub fn plan(desired: &HostDesired, observed: &Observed, networks_dir: &Path) -> Vec<CleanupAction> {
    let mut keep_links: BTreeSet<&str> = desired.taps.iter().map(|t| t.name.as_str()).collect();
    keep_links.extend(desired.networks.iter().filter_map(|n| n.managed_bridge()));
    let keep_dirs: BTreeSet<PathBuf> = desired
        .networks
        .iter()
        .filter(|n| n.runs_dnsmasq())
        .map(|n| network_dir(networks_dir, &n.bridge))
        .collect();
    let mut actions = Vec::new();
    let mut stale: Vec<&ObservedLink> = observed
        .links
        .iter()
        .filter(|l| is_hearth_name(&l.name) && !keep_links.contains(l.name.as_str()))
        .collect();
    // Taps (and anything else) first, bridges last: a bridge goes once its
    // ports are gone.
    stale.sort_by_key(|l| (l.kind == LinkKind::Bridge, l.name.clone()));
    actions.extend(
        stale
            .into_iter()
            .map(|l| CleanupAction::DeleteLink(l.name.clone())),
    );
    for d in &observed.dnsmasq {
        if d.dir.parent() == Some(networks_dir) && !keep_dirs.contains(&d.dir) {
            actions.push(CleanupAction::StopDnsmasq(d.clone()));
        }
    }
    for dir in &observed.dirs {
        let hearths = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_hearth_name);
        if dir.parent() == Some(networks_dir) && hearths && !keep_dirs.contains(dir) {
            actions.push(CleanupAction::RemoveDir(dir.clone()));
        }
    }
    let needs_table = desired
        .networks
        .iter()
        .any(|n| matches!(n.mode, NetworkMode::Nat | NetworkMode::Isolated));
    if observed.nft_table && !needs_table {
        actions.push(CleanupAction::DeleteNftTable);
    }
    actions
}

/// Observes the host: hearth's links, hearth's dnsmasqs, hearth's table.
pub async fn observe(nl: &Netlink, networks_dir: &Path) -> Result<Observed, HostError> {
    Ok(Observed {
        links: nl.observe().await?,
        dnsmasq: dnsmasq::find_all(networks_dir),
        dirs: hearth_dirs(networks_dir),
        nft_table: nft::observe().await?.is_some(),
    })
}

/// The directories in `networks_dir` named like hearth's bridges.
fn hearth_dirs(networks_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(networks_dir) else {
        return vec![];
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.file_name().to_str().is_some_and(is_hearth_name))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// Observes, plans and carries the plan out. Returns the actions taken.
pub async fn run(
    nl: &Netlink,
    desired: &HostDesired,
    networks_dir: &Path,
) -> Result<Vec<CleanupAction>, HostError> {
    let observed = observe(nl, networks_dir).await?;
    let actions = plan(desired, &observed, networks_dir);
    for a in &actions {
        match a {
            CleanupAction::DeleteLink(name) => {
                nl.remove(name).await?;
            }
            CleanupAction::StopDnsmasq(found) => {
                dnsmasq::stop_found(found)?;
            }
            CleanupAction::RemoveDir(dir) => match std::fs::remove_dir_all(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Files only hearth reads: a failure leaves them for the
                // next resync, and stops nothing.
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a network's run directory");
                }
            },
            CleanupAction::DeleteNftTable => {
                nft::remove().await?;
            }
        }
    }
    Ok(actions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::host::{DesiredTap, HostNetwork};
    use std::net::Ipv4Addr;

    fn link(name: &str, kind: LinkKind) -> ObservedLink {
        ObservedLink {
            index: 1,
            name: name.into(),
            kind,
            master: None,
            addresses: vec![],
            up: true,
            tun: None,
        }
    }

    fn net(bridge: &str, mode: NetworkMode, dhcp: bool) -> HostNetwork {
        HostNetwork {
            bridge: bridge.into(),
            gateway: Ipv4Addr::new(10, 1, 0, 1),
            prefix_len: 24,
            mode,
            dhcp,
            dns: crate::network::host::Dns::Off,
            static_leases: vec![],
            port_forwards: vec![],
        }
    }

    fn observed() -> Observed {
        Observed {
            links: vec![
                link("hth-0", LinkKind::Bridge),
                link("hth-1", LinkKind::Bridge),
                link("htt-0", LinkKind::Tun),
                link("htt-1", LinkKind::Tun),
                link("eth0", LinkKind::None),
                link("br0", LinkKind::Bridge),
                link("docker0", LinkKind::Bridge),
                // The host's own, only sharing the first letters.
                link("hthlan", LinkKind::Bridge),
                link("httpvpn0", LinkKind::Tun),
            ],
            dnsmasq: vec![
                FoundDnsmasq {
                    pid: 10,
                    dir: "/s/networks/hth-0".into(),
                },
                FoundDnsmasq {
                    pid: 11,
                    dir: "/s/networks/hth-1".into(),
                },
                FoundDnsmasq {
                    pid: 12,
                    dir: "/elsewhere/hth-1".into(),
                },
            ],
            dirs: vec![
                "/s/networks/hth-0".into(),
                "/s/networks/hth-1".into(),
                "/s/networks/mine".into(),
                "/s/networks/hthlan".into(),
            ],
            nft_table: true,
        }
    }

    #[test]
    fn empty_desired_state_removes_every_hearth_object_and_nothing_else() {
        let actions = plan(
            &HostDesired::default(),
            &observed(),
            Path::new("/s/networks"),
        );
        assert_eq!(
            actions,
            vec![
                CleanupAction::DeleteLink("htt-0".into()),
                CleanupAction::DeleteLink("htt-1".into()),
                CleanupAction::DeleteLink("hth-0".into()),
                CleanupAction::DeleteLink("hth-1".into()),
                CleanupAction::StopDnsmasq(FoundDnsmasq {
                    pid: 10,
                    dir: "/s/networks/hth-0".into()
                }),
                CleanupAction::StopDnsmasq(FoundDnsmasq {
                    pid: 11,
                    dir: "/s/networks/hth-1".into()
                }),
                CleanupAction::RemoveDir("/s/networks/hth-0".into()),
                CleanupAction::RemoveDir("/s/networks/hth-1".into()),
                CleanupAction::DeleteNftTable,
            ]
        );
    }

    #[test]
    fn desired_objects_are_kept() {
        let desired = HostDesired {
            networks: vec![
                net("hth-0", NetworkMode::Nat, true),
                net("hth-1", NetworkMode::Isolated, false),
            ],
            taps: vec![DesiredTap {
                name: "htt-1".into(),
                bridge: "hth-0".into(),
            }],
        };
        let actions = plan(&desired, &observed(), Path::new("/s/networks"));
        assert_eq!(
            actions,
            vec![
                CleanupAction::DeleteLink("htt-0".into()),
                // hth-1 has DHCP off: its dnsmasq and its files go, its
                // bridge stays.
                CleanupAction::StopDnsmasq(FoundDnsmasq {
                    pid: 11,
                    dir: "/s/networks/hth-1".into()
                }),
                CleanupAction::RemoveDir("/s/networks/hth-1".into()),
            ]
        );
    }

    #[test]
    fn a_bridge_mode_network_keeps_no_hearth_bridge_or_table() {
        let desired = HostDesired {
            networks: vec![net(
                "hth-0",
                NetworkMode::Bridge {
                    existing: "br0".into(),
                },
                true,
            )],
            taps: vec![],
        };
        let actions = plan(&desired, &observed(), Path::new("/s/networks"));
        assert!(actions.contains(&CleanupAction::DeleteLink("hth-0".into())));
        assert!(actions.contains(&CleanupAction::DeleteNftTable));
        assert!(!actions.contains(&CleanupAction::DeleteLink("br0".into())));
    }
}
