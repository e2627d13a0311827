//! NAT, isolation and port forwards in one nftables table that hearth owns:
//! `table inet hearth`. Nothing outside it is ever read for decisions or
//! changed.
//!
//! The table is replaced as a whole, from the desired state of every
//! network, in one `nft -f -` transaction:
//!
//! ```text
//! table inet hearth          # create it if missing (no-op otherwise)
//! delete table inet hearth   # so this never fails
//! table inet hearth { ... }  # the full new content
//! ```
//!
//! nft applies a file as one netlink batch: other processes see the old
//! table or the new one, never a half. The same text applied twice leaves
//! the same rules (idempotent). With no NAT or Isolated network, only the
//! first two lines are sent: the table is removed.

use std::fmt::Write as _;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use super::{BRIDGE_PREFIX, HostError, HostNetwork, NetworkMode, PortForward};

pub const FAMILY: &str = "inet";
pub const TABLE: &str = "hearth";

/// Renders the transaction that makes `inet hearth` exactly what `networks`
/// need.
pub fn render(networks: &[HostNetwork]) -> String {
    let mut nets: Vec<&HostNetwork> = networks
        .iter()
        .filter(|n| matches!(n.mode, NetworkMode::Nat | NetworkMode::Isolated))
        .collect();
    nets.sort_by(|a, b| a.bridge.cmp(&b.bridge));
    let mut s = format!("table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n");
    if nets.is_empty() {
        return s;
    }
    let mut forwards: Vec<&PortForward> = nets
        .iter()
        .filter(|n| n.mode == NetworkMode::Nat)
        .flat_map(|n| n.port_forwards.iter())
        .collect();
    forwards.sort_by_key(|f| (f.protocol, f.host_addr, f.host_port));
    // Loopback is never DNATed: the packet would keep its source 127.0.0.1
    // and be dropped on the bridge. hearthd itself listens there
    // (`loopback.rs`); a forward bound to a loopback address has no rule.
    let dnat = |hook_output: bool| -> Vec<String> {
        forwards
            .iter()
            .filter(|f| !f.host_addr.is_some_and(|a| a.is_loopback()))
            .map(|f| {
                let dst = match f.host_addr {
                    Some(a) => format!("ip daddr {a}"),
                    None if hook_output => "fib daddr type local ip daddr != 127.0.0.0/8".into(),
                    None => "fib daddr type local".to_string(),
                };
                format!(
                    "{dst} {} dport {} dnat ip to {}:{}",
                    f.protocol.as_nft(),
                    f.host_port,
                    f.guest_ip,
                    f.guest_port
                )
            })
            .collect()
    };

    let _ = writeln!(s, "table {FAMILY} {TABLE} {{");
    let chain = |s: &mut String, name: &str, hook: &str, rules: &[String]| {
        let _ = writeln!(s, "\tchain {name} {{");
        let _ = writeln!(s, "\t\t{hook}; policy accept;");
        for r in rules {
            let _ = writeln!(s, "\t\t{r}");
        }
        let _ = writeln!(s, "\t}}");
    };
    chain(
        &mut s,
        "prerouting",
        "type nat hook prerouting priority dstnat",
        &dnat(false),
    );
    chain(
        &mut s,
        "output",
        "type nat hook output priority -100",
        &dnat(true),
    );

    let mut post = Vec::new();
    let mut fwd = Vec::new();
    // hearth's networks never route to one another.
    for n in &nets {
        let b = &n.bridge;
        fwd.push(format!(
            "iifname \"{b}\" oifname \"{BRIDGE_PREFIX}*\" oifname != \"{b}\" drop"
        ));
    }
    for n in &nets {
        let b = &n.bridge;
        let sub = n.subnet_cidr();
        fwd.push(format!("iifname \"{b}\" oifname \"{b}\" accept"));
        match n.mode {
            NetworkMode::Nat => {
                post.push(format!(
                    "ip saddr {sub} ip daddr != {sub} ip daddr != {{ 224.0.0.0/24, 255.255.255.255 }} oifname != \"{b}\" masquerade"
                ));
                fwd.push(format!("iifname \"{b}\" ip saddr {sub} accept"));
                fwd.push(format!(
                    "oifname \"{b}\" ip daddr {sub} ct state established,related accept"
                ));
                let mut fs: Vec<&PortForward> = n.port_forwards.iter().collect();
                fs.sort_by_key(|f| (f.guest_ip, f.protocol, f.guest_port));
                fs.dedup_by_key(|f| (f.guest_ip, f.protocol, f.guest_port));
                for f in fs {
                    fwd.push(format!(
                        "oifname \"{b}\" ip daddr {} {} dport {} ct status dnat accept",
                        f.guest_ip,
                        f.protocol.as_nft(),
                        f.guest_port
                    ));
                }
                fwd.push(format!("iifname \"{b}\" drop"));
                fwd.push(format!("oifname \"{b}\" drop"));
            }
            NetworkMode::Isolated => {
                fwd.push(format!("iifname \"{b}\" drop"));
                fwd.push(format!("oifname \"{b}\" drop"));
            }
            NetworkMode::Bridge { .. } => {}
        }
    }
    chain(
        &mut s,
        "postrouting",
        "type nat hook postrouting priority srcnat",
        &post,
    );
    chain(
        &mut s,
        "forward",
        "type filter hook forward priority filter",
        &fwd,
    );
    s.push_str("}\n");
    s
}

async fn nft(args: &[&str], stdin: Option<&str>) -> Result<String, HostError> {
    let what = format!("nft {}", args.join(" "));
    // In the program pool like qemu-img, for as long as nft runs.
    let _slot = hearth_qemu::programs::slot(hearth_qemu::programs::Class::Quick).await;
    let mut cmd = tokio::process::Command::new("nft");
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| HostError::io(format!("{what} (apt-get install nftables)"), e))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .await
            .map_err(|e| HostError::io(format!("{what}: writing the ruleset"), e))?;
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .map_err(|_| HostError::Command {
            what: what.clone(),
            detail: "no answer within 30 s".into(),
        })?
        .map_err(|e| HostError::io(what.clone(), e))?;
    if !out.status.success() {
        return Err(HostError::Command {
            what,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    String::from_utf8(out.stdout).map_err(|_| HostError::Command {
        what,
        detail: "output is not UTF-8".into(),
    })
}

/// hearth's table as nft reports it, handles removed so that two listings of
/// the same rules compare equal. `None`: no such table.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedTable {
    /// The `chain` and `rule` objects of `nft -j list table inet hearth`.
    pub objects: Vec<serde_json::Value>,
}

impl ObservedTable {
    pub fn chains(&self) -> Vec<String> {
        self.objects
            .iter()
            .filter_map(|o| o.get("chain")?.get("name")?.as_str().map(str::to_string))
            .collect()
    }
    pub fn rule_count(&self) -> usize {
        self.objects
            .iter()
            .filter(|o| o.get("rule").is_some())
            .count()
    }
}

fn strip_handles(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("handle");
            m.values_mut().for_each(strip_handles);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_handles),
        _ => {}
    }
}

fn parse_objects(json: &str) -> Result<Vec<serde_json::Value>, HostError> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| HostError::Command {
        what: "parsing nft -j output".into(),
        detail: e.to_string(),
    })?;
    Ok(v.get("nftables")
        .and_then(|a| a.as_array())
        .cloned()
        .unwrap_or_default())
}

/// Reads `inet hearth`, or `None` when it does not exist.
pub async fn observe() -> Result<Option<ObservedTable>, HostError> {
    let tables = parse_objects(&nft(&["-j", "list", "tables"], None).await?)?;
    let present = tables.iter().any(|o| {
        o.get("table").is_some_and(|t| {
            t.get("family").and_then(|f| f.as_str()) == Some(FAMILY)
                && t.get("name").and_then(|n| n.as_str()) == Some(TABLE)
        })
    });
    if !present {
        return Ok(None);
    }
    let mut objects = parse_objects(&nft(&["-j", "list", "table", FAMILY, TABLE], None).await?)?;
    objects.retain(|o| o.get("chain").is_some() || o.get("rule").is_some());
    objects.iter_mut().for_each(strip_handles);
    Ok(Some(ObservedTable { objects }))
}

/// Replaces the table with what `networks` need. `true` when what nft lists
/// afterwards differs from before.
pub async fn apply(networks: &[HostNetwork]) -> Result<bool, HostError> {
    let before = observe().await?;
    nft(&["-f", "-"], Some(&render(networks))).await?;
    let after = observe().await?;
    Ok(before != after)
}

/// Removes the table (a no-op when it is not there).
pub async fn remove() -> Result<bool, HostError> {
    let present = observe().await?.is_some();
    if present {
        nft(&["-f", "-"], Some(&render(&[]))).await?;
    }
    Ok(present)
}

/// Turns on IPv4 forwarding when a NAT network needs it. Never turns it off:
/// other software on the host may rely on it. `true` when it wrote.
pub fn ensure_ip_forward(networks: &[HostNetwork]) -> Result<bool, HostError> {
    const PATH: &str = "/proc/sys/net/ipv4/ip_forward";
    if !networks.iter().any(|n| n.mode == NetworkMode::Nat) {
        return Ok(false);
    }
    let cur =
        std::fs::read_to_string(PATH).map_err(|e| HostError::io(format!("reading {PATH}"), e))?;
    if cur.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(PATH, "1\n").map_err(|e| HostError::io(format!("writing {PATH}"), e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::host::Protocol;
    use std::net::Ipv4Addr;

    fn net(bridge: &str, third: u8, mode: NetworkMode) -> HostNetwork {
        HostNetwork {
            bridge: bridge.into(),
            gateway: Ipv4Addr::new(10, 77, third, 1),
            prefix_len: 24,
            mode,
            dhcp: true,
            dns: crate::network::host::Dns::Off,
            static_leases: vec![],
            port_forwards: vec![],
        }
    }

    #[test]
    fn no_managed_network_renders_only_the_removal() {
        let bridged = net(
            "hth-9",
            9,
            NetworkMode::Bridge {
                existing: "br0".into(),
            },
        );
        assert_eq!(render(&[]), "table inet hearth\ndelete table inet hearth\n");
        assert_eq!(render(&[bridged]), render(&[]));
    }

    #[test]
    fn nat_and_isolated_networks_render_golden() {
        let mut nat = net("hth-0", 0, NetworkMode::Nat);
        nat.port_forwards = vec![
            PortForward {
                protocol: Protocol::Tcp,
                host_addr: None,
                host_port: 2222,
                guest_ip: Ipv4Addr::new(10, 77, 0, 10),
                guest_port: 22,
            },
            PortForward {
                protocol: Protocol::Udp,
                host_addr: Some(Ipv4Addr::new(192, 0, 2, 7)),
                host_port: 5353,
                guest_ip: Ipv4Addr::new(10, 77, 0, 11),
                guest_port: 53,
            },
        ];
        let iso = net("hth-1", 1, NetworkMode::Isolated);
        // Input order does not matter: networks are sorted by bridge.
        let text = render(&[iso, nat]);
        let want = r#"table inet hearth
delete table inet hearth
table inet hearth {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		fib daddr type local tcp dport 2222 dnat ip to 10.77.0.10:22
		ip daddr 192.0.2.7 udp dport 5353 dnat ip to 10.77.0.11:53
	}
	chain output {
		type nat hook output priority -100; policy accept;
		fib daddr type local ip daddr != 127.0.0.0/8 tcp dport 2222 dnat ip to 10.77.0.10:22
		ip daddr 192.0.2.7 udp dport 5353 dnat ip to 10.77.0.11:53
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr 10.77.0.0/24 ip daddr != 10.77.0.0/24 ip daddr != { 224.0.0.0/24, 255.255.255.255 } oifname != "hth-0" masquerade
	}
	chain forward {
		type filter hook forward priority filter; policy accept;
		iifname "hth-0" oifname "hth-*" oifname != "hth-0" drop
		iifname "hth-1" oifname "hth-*" oifname != "hth-1" drop
		iifname "hth-0" oifname "hth-0" accept
		iifname "hth-0" ip saddr 10.77.0.0/24 accept
		oifname "hth-0" ip daddr 10.77.0.0/24 ct state established,related accept
		oifname "hth-0" ip daddr 10.77.0.10 tcp dport 22 ct status dnat accept
		oifname "hth-0" ip daddr 10.77.0.11 udp dport 53 ct status dnat accept
		iifname "hth-0" drop
		oifname "hth-0" drop
		iifname "hth-1" oifname "hth-1" accept
		iifname "hth-1" drop
		oifname "hth-1" drop
	}
}
"#;
        assert_eq!(text, want);
    }

    #[test]
    fn handles_are_ignored_when_comparing_listings() {
        let a = r#"{"nftables":[{"metainfo":{"version":"1.0.6"}},{"chain":{"family":"inet","table":"hearth","name":"forward","handle":1}},{"rule":{"chain":"forward","handle":5,"expr":[]}}]}"#;
        let b = a
            .replace("\"handle\":5", "\"handle\":9")
            .replace("\"handle\":1", "\"handle\":2");
        let mut x = parse_objects(a).unwrap();
        let mut y = parse_objects(&b).unwrap();
        x.iter_mut().for_each(strip_handles);
        y.iter_mut().for_each(strip_handles);
        assert_eq!(x, y);
        let t = ObservedTable { objects: x };
        assert_eq!(t.chains(), vec!["forward".to_string()]);
        assert_eq!(t.rule_count(), 1);
    }
}
