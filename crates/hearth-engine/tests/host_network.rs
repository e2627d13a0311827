//! The host side of networking against the real kernel, nft and dnsmasq,
//! always inside a network namespace the test creates.
//!
//! How the namespace is entered: each test, run normally, creates
//! `hth-test-<random>` and re-runs itself (this test binary, `--exact` on its
//! own name) under `ip netns exec NS`, with `HEARTH_TEST_NETNS=NS` set. The
//! child, whole process with every thread (tokio's workers, dnsmasq and nft
//! children), lives in the namespace; setns on one thread would leave
//! tokio's other threads, and so some netlink sockets and children, in the
//! host's namespace. Before doing anything the child checks that its
//! `/proc/self/ns/net` is the namespace's (same device and inode). The parent
//! holds a guard that kills every process left in the namespace and deletes
//! it, also when the test fails. No packet leaves the test's namespaces: the
//! only traffic is a DHCP exchange over a veth on a bridge inside the
//! namespace, and a TCP connection to the namespace's own bridge address,
//! forwarded to a second namespace the parent test also created.

use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

mod netns;

use hearth_engine::network::host::cleanup::{self, CleanupAction};
use hearth_engine::network::host::dnsmasq::{self, DnsmasqFiles, DnsmasqOutcome};
use hearth_engine::network::host::link::{LinkChange, Netlink};
use hearth_engine::network::host::{
    self, DesiredTap, HostDesired, HostNetwork, Mac, NetworkMode, PortForward, Protocol,
    StaticLease, network_dir,
};
use netns::{inside_netns, inside_netns_with_guests, ipv4_of, run};

fn ip_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["-j"];
    all.extend_from_slice(args);
    serde_json::from_str(&run("ip", &all)).expect("ip -j output")
}

/// (name, ifindex) of every hth/htt link, from `ip -j link`.
fn hearth_links() -> Vec<(String, u64)> {
    let v = ip_json(&["link", "show"]);
    let mut out: Vec<(String, u64)> = v
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|l| {
            let name = l["ifname"].as_str()?.to_string();
            (name.starts_with("hth") || name.starts_with("htt"))
                .then(|| (name, l["ifindex"].as_u64().unwrap_or(0)))
        })
        .collect();
    out.sort();
    out
}

fn link_detail(name: &str) -> serde_json::Value {
    ip_json(&["-d", "link", "show", "dev", name])[0].clone()
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn lease(last: u8, name: &str) -> StaticLease {
    StaticLease {
        mac: Mac([0x52, 0x54, 0x00, 0x12, 0x34, last]),
        ip: Ipv4Addr::new(10, 77, 0, last),
        hostname: name.into(),
    }
}

fn desired() -> HostDesired {
    HostDesired {
        networks: vec![
            HostNetwork {
                bridge: "hth-0".into(),
                gateway: Ipv4Addr::new(10, 77, 0, 1),
                prefix_len: 24,
                mode: NetworkMode::Nat,
                dhcp: true,
                dns: hearth_engine::network::host::Dns::Off,
                static_leases: vec![lease(10, "web")],
                port_forwards: vec![PortForward {
                    protocol: Protocol::Tcp,
                    host_addr: None,
                    host_port: 2222,
                    guest_ip: Ipv4Addr::new(10, 77, 0, 10),
                    guest_port: 22,
                }],
            },
            HostNetwork {
                bridge: "hth-1".into(),
                gateway: Ipv4Addr::new(10, 78, 0, 1),
                prefix_len: 24,
                mode: NetworkMode::Isolated,
                dhcp: false,
                dns: hearth_engine::network::host::Dns::Off,
                static_leases: vec![],
                port_forwards: vec![],
            },
        ],
        taps: vec![
            DesiredTap {
                name: "htt-0".into(),
                bridge: "hth-0".into(),
            },
            DesiredTap {
                name: "htt-1".into(),
                bridge: "hth-0".into(),
            },
        ],
    }
}

/// A state dir dnsmasq's unprivileged user can traverse (it rereads the
/// hosts file as that user on SIGHUP).
fn state_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

#[tokio::test]
async fn network_apply_is_idempotent_reloads_leases_and_cleans_up_after_a_crash() {
    if inside_netns("network_apply_is_idempotent_reloads_leases_and_cleans_up_after_a_crash")
        .is_none()
    {
        return;
    }
    let state = state_dir();
    let networks = state.path().join("networks");
    let want = desired();

    // First apply: everything is created.
    let nl = Netlink::open().expect("netlink");
    let report = host::apply(&nl, &want, &networks).await.expect("apply");
    assert!(report.links.contains(&LinkChange::Created("hth-0".into())));
    assert!(report.links.contains(&LinkChange::Created("htt-1".into())));
    assert!(report.nft_changed);
    assert!(
        matches!(report.dnsmasq[..], [(ref b, DnsmasqOutcome::Started { .. })] if b == "hth-0")
    );

    // Ground truth: links.
    let links = hearth_links();
    let names: Vec<&str> = links.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["hth-0", "hth-1", "htt-0", "htt-1"]);
    let br = link_detail("hth-0");
    assert_eq!(br["linkinfo"]["info_kind"], "bridge");
    assert!(br["flags"].as_array().unwrap().iter().any(|f| f == "UP"));
    assert_eq!(ipv4_of("hth-0"), ["10.77.0.1/24"]);
    assert_eq!(ipv4_of("hth-1"), ["10.78.0.1/24"]);
    for tap in ["htt-0", "htt-1"] {
        let t = link_detail(tap);
        assert_eq!(t["master"], "hth-0", "{tap}: {t}");
        assert_eq!(t["linkinfo"]["info_kind"], "tun", "{tap}: {t}");
        let data = &t["linkinfo"]["info_data"];
        assert_eq!(data["type"], "tap", "{tap}: {data}");
        assert_eq!(data["pi"], false, "{tap}: {data}");
        assert_eq!(data["vnet_hdr"], true, "{tap}: {data}");
        assert_eq!(data["persist"], true, "{tap}: {data}");
        assert_eq!(data["user"], "root", "{tap}: {data}");
        assert!(
            t["flags"].as_array().unwrap().iter().any(|f| f == "UP"),
            "{tap}: {t}"
        );
    }

    // Ground truth: nftables and forwarding.
    let ruleset = run("nft", &["list", "ruleset"]);
    assert!(ruleset.contains("table inet hearth"), "{ruleset}");
    assert!(ruleset.contains("dnat ip to 10.77.0.10:22"), "{ruleset}");
    assert!(
        ruleset.contains("oifname != \"hth-0\" masquerade"),
        "{ruleset}"
    );
    assert!(ruleset.contains("iifname \"hth-1\" drop"), "{ruleset}");
    let tables = run("nft", &["-j", "list", "tables"]);
    assert_eq!(
        tables.matches("\"table\"").count(),
        1,
        "only hearth's table: {tables}"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        "1"
    );

    // Ground truth: dnsmasq, from its pid file and /proc.
    let files = DnsmasqFiles::new(network_dir(&networks, "hth-0"));
    let pid: u32 = std::fs::read_to_string(files.pid())
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    assert_eq!(report.dnsmasq[0].1.pid(), pid);
    let args = cmdline(pid);
    assert!(args[0].ends_with("dnsmasq"), "{args:?}");
    assert!(args.contains(&files.conf_arg()), "{args:?}");
    // Daemonised: neither our child nor in our session, so a SIGKILL of the
    // daemon (or of its process group) leaves it running.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ppid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("PPid");
    assert_ne!(ppid, std::process::id());
    // Both from /proc: a session led from outside our PID namespace reads as
    // 0 there, which rustix's getsid refuses to represent.
    assert_ne!(
        session_of(&pid.to_string()),
        session_of("self"),
        "dnsmasq is in our session"
    );
    assert_eq!(
        std::fs::read_to_string(files.hosts()).unwrap(),
        "52:54:00:12:34:0a,10.77.0.10,web\n"
    );
    assert!(
        !networks.join("hth-1").exists(),
        "no dnsmasq files for a network without DHCP"
    );

    // Second apply: nothing changes, same dnsmasq, same link indexes.
    let report = host::apply(&nl, &want, &networks)
        .await
        .expect("second apply");
    assert!(!report.changed(), "{report:?}");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Unchanged { pid });
    assert_eq!(hearth_links(), links);
    assert_eq!(run("nft", &["list", "ruleset"]), ruleset);

    // New leases: same process, SIGHUP, hosts file rewritten.
    let mut more = want.clone();
    more.networks[0].static_leases.push(lease(11, "db"));
    let log_before = std::fs::read_to_string(files.log()).unwrap_or_default();
    let report = host::apply(&nl, &more, &networks)
        .await
        .expect("apply leases");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Reloaded { pid });
    assert_eq!(
        std::fs::read_to_string(files.hosts()).unwrap(),
        "52:54:00:12:34:0a,10.77.0.10,web\n52:54:00:12:34:0b,10.77.0.11,db\n"
    );
    assert!(report.links.is_empty() && !report.nft_changed, "{report:?}");
    // dnsmasq logs ": read HOSTSFILE" at start and on every SIGHUP (and
    // ": cannot read HOSTSFILE" when it cannot).
    let read_line = format!(": read {}", files.hosts().display());
    assert!(!log_before.contains("cannot read"), "{log_before}");
    let reads_before = log_before.matches(&read_line).count();
    assert!(reads_before >= 1, "{log_before}");
    let reread = hearth_test_support::eventually_every(
        std::time::Duration::from_millis(20),
        std::time::Duration::from_secs(5),
        || {
            let log = std::fs::read_to_string(files.log()).unwrap_or_default();
            log.matches(&read_line).count() > reads_before
        },
    );
    assert!(reread, "dnsmasq did not reread its hosts file within 5 s");
    let log = std::fs::read_to_string(files.log()).unwrap_or_default();
    assert!(!log.contains("cannot read"), "{log}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    eprintln!("dnsmasq {pid}: {uid_line}");
    assert!(
        !uid_line.split_whitespace().skip(1).any(|u| u == "0"),
        "dnsmasq must drop root: {uid_line}"
    );

    // A changed address is corrected.
    let mut moved = more.clone();
    moved.networks[1].gateway = Ipv4Addr::new(10, 78, 0, 254);
    let report = host::apply(&nl, &moved, &networks)
        .await
        .expect("apply address");
    assert_eq!(
        report.links,
        [
            LinkChange::AddressRemoved {
                link: "hth-1".into(),
                addr: Ipv4Addr::new(10, 78, 0, 1),
                prefix_len: 24
            },
            LinkChange::AddressAdded {
                link: "hth-1".into(),
                addr: Ipv4Addr::new(10, 78, 0, 254),
                prefix_len: 24
            }
        ]
    );
    assert_eq!(ipv4_of("hth-1"), ["10.78.0.254/24"]);

    // A restarted daemon (new netlink socket, no memory) adopts dnsmasq.
    drop(nl);
    let nl = Netlink::open().expect("netlink again");
    let report = host::apply(&nl, &moved, &networks)
        .await
        .expect("apply after restart");
    assert!(!report.changed(), "{report:?}");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Unchanged { pid });
    assert_eq!(dnsmasq::find_all(&networks).len(), 1);

    // A lost pid file does not lead to a second dnsmasq: it is found by its
    // --conf-file in /proc.
    std::fs::remove_file(files.pid()).expect("remove pid file");
    let report = host::apply(&nl, &moved, &networks)
        .await
        .expect("apply without pid file");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Unchanged { pid });
    assert_eq!(dnsmasq::find_all(&networks).len(), 1);

    // Crash, then start-up with nothing desired: every hearth object goes.
    drop(nl);
    let nl = Netlink::open().expect("netlink after crash");
    let actions = cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup");
    assert!(
        actions.contains(&CleanupAction::DeleteNftTable),
        "{actions:?}"
    );
    assert!(
        actions.contains(&CleanupAction::DeleteLink("hth-0".into())),
        "{actions:?}"
    );
    assert_eq!(hearth_links(), Vec::<(String, u64)>::new());
    assert!(cmdline(pid).is_empty(), "dnsmasq {pid} still runs");
    assert!(dnsmasq::find_all(&networks).is_empty());
    let tables = run("nft", &["-j", "list", "tables"]);
    assert!(!tables.contains("hearth"), "{tables}");
    // Loopback is untouched.
    assert!(ip_json(&["link", "show", "dev", "lo"])[0]["ifname"] == "lo");

    // A second cleanup finds nothing to do.
    let again = cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup again");
    assert!(again.is_empty(), "{again:?}");
}

#[tokio::test]
async fn bridge_mode_joins_an_existing_bridge_and_cleanup_leaves_foreign_objects_alone() {
    if inside_netns("bridge_mode_joins_an_existing_bridge_and_cleanup_leaves_foreign_objects_alone")
        .is_none()
    {
        return;
    }
    // Objects hearth does not own: two bridges, one named like no
    // hearth object (htx is no hearth prefix), another nftables table.
    run("ip", &["link", "add", "br-ext", "type", "bridge"]);
    run("ip", &["link", "add", "htx0", "type", "bridge"]);
    run("nft", &["add", "table", "inet", "other"]);
    let state = state_dir();
    let networks = state.path().join("networks");
    let want = HostDesired {
        networks: vec![HostNetwork {
            bridge: "hth-5".into(),
            gateway: Ipv4Addr::new(10, 90, 0, 1),
            prefix_len: 24,
            mode: NetworkMode::Bridge {
                existing: "br-ext".into(),
            },
            dhcp: true,
            dns: hearth_engine::network::host::Dns::Off,
            static_leases: vec![],
            port_forwards: vec![],
        }],
        taps: vec![DesiredTap {
            name: "htt-5".into(),
            bridge: "br-ext".into(),
        }],
    };
    let nl = Netlink::open().expect("netlink");
    let report = host::apply(&nl, &want, &networks).await.expect("apply");
    assert_eq!(
        report.links,
        [
            LinkChange::Created("htt-5".into()),
            LinkChange::Enslaved {
                link: "htt-5".into(),
                master: "br-ext".into()
            },
            LinkChange::BroughtUp("htt-5".into())
        ]
    );
    assert!(report.dnsmasq.is_empty(), "no DHCP on an existing bridge");
    let observed = nl.observe().await.expect("observe");
    let tap = observed
        .iter()
        .find(|l| l.name == "htt-5")
        .expect("htt-5 observed");
    assert_eq!(tap.master.as_deref(), Some("br-ext"));
    assert!(tap.up);
    let info = tap.tun.expect("tun info");
    assert!(info.is_hearth_tap(), "{info:?}");
    assert_eq!(info.owner, Some(0));

    // A tap of hearth's name without vnet_hdr (made by hand) is made again.
    run("ip", &["tuntap", "add", "dev", "htt-6", "mode", "tap"]);
    assert_eq!(
        link_detail("htt-6")["linkinfo"]["info_data"]["vnet_hdr"],
        false
    );
    let mut with_six = want.clone();
    with_six.taps.push(DesiredTap {
        name: "htt-6".into(),
        bridge: "br-ext".into(),
    });
    let report = host::apply(&nl, &with_six, &networks)
        .await
        .expect("apply htt-6");
    assert_eq!(
        report.links[..2],
        [
            LinkChange::Deleted("htt-6".into()),
            LinkChange::Created("htt-6".into())
        ]
    );
    assert_eq!(
        link_detail("htt-6")["linkinfo"]["info_data"]["vnet_hdr"],
        true
    );
    assert!(
        !host::apply(&nl, &with_six, &networks)
            .await
            .expect("again")
            .changed()
    );
    assert_eq!(link_detail("htt-5")["master"], "br-ext");
    assert_eq!(
        ipv4_of("br-ext"),
        Vec::<String>::new(),
        "br-ext is not changed"
    );
    assert!(!run("nft", &["list", "tables"]).contains("hearth"));

    // A stale hearth bridge from a crash, and a refused removal of a foreign link.
    run("ip", &["link", "add", "hth-9", "type", "bridge"]);
    assert!(nl.remove("br-ext").await.is_err());
    let actions = cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup");
    assert_eq!(
        actions,
        [
            CleanupAction::DeleteLink("htt-5".into()),
            CleanupAction::DeleteLink("htt-6".into()),
            CleanupAction::DeleteLink("hth-9".into())
        ]
    );
    assert_eq!(hearth_links(), Vec::<(String, u64)>::new());
    for foreign in ["br-ext", "htx0"] {
        assert_eq!(link_detail(foreign)["ifname"], foreign);
    }
    assert!(run("nft", &["list", "tables"]).contains("table inet other"));
}

/// A veth pair inside the namespace: `bridge_end` joins `bridge`, the client
/// end gets `mac`. Names without hearth's prefix: they are the test's own.
fn dhcp_client_port(client: &str, bridge_end: &str, bridge: &str, mac: Mac) {
    run(
        "ip",
        &[
            "link", "add", client, "type", "veth", "peer", "name", bridge_end,
        ],
    );
    run("ip", &["link", "set", bridge_end, "master", bridge, "up"]);
    run(
        "ip",
        &["link", "set", client, "address", &mac.to_string(), "up"],
    );
}

/// One DHCP exchange with busybox udhcpc on `iface`, bounded (3 discovers, 1 s
/// apart). `Some("ip=… router=…")` when it got a lease.
fn udhcpc(iface: &str, dir: &Path) -> Option<String> {
    let out_file = dir.join(format!("{iface}.events"));
    let script = dir.join("udhcpc.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$1\" = bound ] && echo \"ip=$ip router=$router\" > {}\nexit 0\n",
            out_file.display()
        ),
    )
    .expect("write script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let status = Command::new("busybox")
        .args([
            "udhcpc", "-f", "-q", "-n", "-t", "3", "-T", "1", "-i", iface, "-s",
        ])
        .arg(&script)
        .output()
        .expect("busybox udhcpc (apt-get install busybox-static)")
        .status;
    status.success().then(|| {
        std::fs::read_to_string(&out_file)
            .unwrap_or_default()
            .trim()
            .to_string()
    })
}

#[tokio::test]
async fn dhcp_serves_exactly_the_stored_leases() {
    if inside_netns("dhcp_serves_exactly_the_stored_leases").is_none() {
        return;
    }
    let state = state_dir();
    let networks = state.path().join("networks");
    let mut iso = desired().networks[1].clone();
    iso.dhcp = true;
    iso.static_leases = vec![StaticLease {
        mac: Mac([0x52, 0x54, 0x00, 0x99, 0x00, 0x05]),
        ip: Ipv4Addr::new(10, 78, 0, 5),
        hostname: "iso".into(),
    }];
    let want = HostDesired {
        networks: vec![desired().networks[0].clone(), iso],
        taps: vec![],
    };
    let nl = Netlink::open().expect("netlink");
    host::apply(&nl, &want, &networks).await.expect("apply");

    dhcp_client_port("vcl0", "vbr0", "hth-0", lease(10, "web").mac);
    dhcp_client_port(
        "vcl1",
        "vbr1",
        "hth-1",
        Mac([0x52, 0x54, 0x00, 0x99, 0x00, 0x05]),
    );
    dhcp_client_port(
        "vcl2",
        "vbr2",
        "hth-0",
        Mac([0x52, 0x54, 0x00, 0x77, 0x77, 0x77]),
    );

    // The stored address, with the gateway as router on a NAT network...
    assert_eq!(
        udhcpc("vcl0", state.path()).as_deref(),
        Some("ip=10.77.0.10 router=10.77.0.1")
    );
    // ...and no router on an Isolated one.
    assert_eq!(
        udhcpc("vcl1", state.path()).as_deref(),
        Some("ip=10.78.0.5 router=")
    );
    // A MAC hearth gave no address gets none: dnsmasq allocates nothing itself.
    assert_eq!(udhcpc("vcl2", state.path()), None);
    let leases = std::fs::read_to_string(network_dir(&networks, "hth-0").join("leases"))
        .expect("lease file");
    assert!(
        leases.contains("52:54:00:12:34:0a 10.77.0.10 web"),
        "{leases}"
    );
    assert!(!leases.contains("77:77:77"), "{leases}");

    let actions = cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup");
    assert_eq!(
        actions
            .iter()
            .filter(|a| matches!(a, CleanupAction::StopDnsmasq(_)))
            .count(),
        2,
        "{actions:?}"
    );
    assert!(dnsmasq::find_all(&networks).is_empty());
}

#[tokio::test]
async fn a_port_forward_reaches_a_server_behind_the_bridge() {
    let Some(guests) =
        inside_netns_with_guests("a_port_forward_reaches_a_server_behind_the_bridge", 1)
    else {
        return;
    };
    let guest = &guests[0];
    let state = state_dir();
    let networks = state.path().join("networks");
    let mut net = desired().networks[0].clone();
    net.dhcp = false;
    let want = HostDesired {
        networks: vec![net],
        taps: vec![],
    };
    let nl = Netlink::open().expect("netlink");
    host::apply(&nl, &want, &networks).await.expect("apply");

    // The "guest": another namespace the parent test created, on the bridge
    // through a veth, at the forward's guest address.
    run(
        "ip",
        &[
            "link", "add", "vfw0", "type", "veth", "peer", "name", "vfw1", "netns", guest,
        ],
    );
    run("ip", &["link", "set", "vfw0", "master", "hth-0", "up"]);
    let in_guest = |args: &[&str]| {
        let mut all = vec!["netns", "exec", guest.as_str(), "ip"];
        all.extend_from_slice(args);
        run("ip", &all)
    };
    in_guest(&["addr", "add", "10.77.0.10/24", "dev", "vfw1"]);
    in_guest(&["link", "set", "vfw1", "up"]);
    in_guest(&["route", "add", "default", "via", "10.77.0.1"]);
    // A one-shot server on the guest's port 22: says where the connection
    // came from, then exits. It prints "ready" once it listens.
    let mut server = tokio::process::Command::new("ip")
        .args(["netns", "exec", guest, "python3", "-c"])
        .arg(
            "import socket,sys\n\
             s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('10.77.0.10', 22)); s.listen(1); print('ready', flush=True)\n\
             s.settimeout(20); c,a=s.accept(); c.sendall(('hello from guest, peer %s' % a[0]).encode()); c.close()\n",
        )
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 in the guest namespace");
    let mut lines = tokio::io::BufReader::new(server.stdout.take().expect("stdout"));
    let mut first = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut first),
    )
    .await
    .expect("server ready in time")
    .expect("read");
    assert_eq!(first.trim(), "ready");

    // From this namespace to its own bridge address, port 2222: the output
    // chain's DNAT sends it to 10.77.0.10:22.
    let got = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        let mut conn = tokio::net::TcpStream::connect("10.77.0.1:2222").await?;
        let mut buf = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut conn, &mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    })
    .await
    .expect("forwarded connection in time")
    .expect("forwarded connection");
    assert_eq!(got, "hello from guest, peer 10.77.0.1");
    let status = server.wait().await.expect("server exit");
    assert!(status.success(), "{status}");

    // Without the forward, the same connection is refused (by this
    // namespace's own stack, over its loopback: a new namespace starts with
    // lo down).
    run("ip", &["link", "set", "lo", "up"]);
    let mut unforwarded = want.clone();
    unforwarded.networks[0].port_forwards.clear();
    assert!(
        host::apply(&nl, &unforwarded, &networks)
            .await
            .expect("apply")
            .nft_changed
    );
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::TcpStream::connect("10.77.0.1:2222"),
    )
    .await
    .expect("an answer in time")
    .expect_err("nothing listens on 2222 itself");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);

    cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup");
}

#[tokio::test]
async fn resync_removes_a_deleted_network_and_restarts_dnsmasq_on_a_config_change() {
    if inside_netns("resync_removes_a_deleted_network_and_restarts_dnsmasq_on_a_config_change")
        .is_none()
    {
        return;
    }
    let state = state_dir();
    let networks = state.path().join("networks");
    let mut two = desired();
    two.networks[1].dhcp = true;
    two.taps.push(DesiredTap {
        name: "htt-9".into(),
        bridge: "hth-1".into(),
    });
    let nl = Netlink::open().expect("netlink");
    let (report, removed) = host::resync(&nl, &two, &networks).await.expect("resync");
    assert!(removed.is_empty(), "{removed:?}");
    let pid0 = report.dnsmasq[0].1.pid();
    let pid1 = report.dnsmasq[1].1.pid();
    assert_eq!(dnsmasq::find_all(&networks).len(), 2);

    // hth-1 is deleted: its tap, bridge, dnsmasq and rules go; hth-0 stays.
    let mut one = two.clone();
    one.networks.truncate(1);
    one.taps.retain(|t| t.bridge == "hth-0");
    let (report, removed) = host::resync(&nl, &one, &networks)
        .await
        .expect("resync one");
    assert!(report.links.is_empty(), "{report:?}");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Unchanged { pid: pid0 });
    assert!(report.nft_changed);
    assert_eq!(
        removed,
        [
            CleanupAction::DeleteLink("htt-9".into()),
            CleanupAction::DeleteLink("hth-1".into()),
            CleanupAction::StopDnsmasq(dnsmasq::FoundDnsmasq {
                pid: pid1,
                dir: network_dir(&networks, "hth-1")
            }),
            CleanupAction::RemoveDir(network_dir(&networks, "hth-1")),
        ]
    );
    assert!(!network_dir(&networks, "hth-1").exists());
    assert!(network_dir(&networks, "hth-0").is_dir());
    let names: Vec<String> = hearth_links().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["hth-0", "htt-0", "htt-1"]);
    assert!(cmdline(pid1).is_empty(), "dnsmasq {pid1} still runs");
    let ruleset = run("nft", &["list", "table", "inet", "hearth"]);
    assert!(!ruleset.contains("hth-1"), "{ruleset}");
    assert!(ruleset.contains("hth-0"), "{ruleset}");

    // A config change (the gateway moves) restarts dnsmasq: a new process,
    // the old one gone, still exactly one.
    let mut moved = one.clone();
    moved.networks[0].gateway = Ipv4Addr::new(10, 77, 0, 254);
    let (report, _) = host::resync(&nl, &moved, &networks)
        .await
        .expect("resync moved");
    let DnsmasqOutcome::Started { pid: new_pid } = report.dnsmasq[0].1 else {
        panic!("dnsmasq not restarted: {report:?}");
    };
    assert_ne!(new_pid, pid0);
    assert!(cmdline(pid0).is_empty(), "old dnsmasq {pid0} still runs");
    assert_eq!(dnsmasq::find_all(&networks).len(), 1);
    let conf = std::fs::read_to_string(DnsmasqFiles::new(network_dir(&networks, "hth-0")).conf())
        .expect("conf");
    assert!(
        conf.contains("dhcp-option=option:router,10.77.0.254"),
        "{conf}"
    );
    assert_eq!(ipv4_of("hth-0"), ["10.77.0.254/24"]);

    // Nothing desired: apply writes no table (a host without a hearth
    // network never sees one appear), cleanup drops the old one and the rest.
    let (report, removed) = host::resync(&nl, &HostDesired::default(), &networks)
        .await
        .expect("resync empty");
    assert!(!report.nft_changed);
    assert!(
        removed.contains(&CleanupAction::DeleteNftTable),
        "{removed:?}"
    );
    assert!(!run("nft", &["list", "tables"]).contains("hearth"));
    assert_eq!(hearth_links(), Vec::<(String, u64)>::new());
    assert!(dnsmasq::find_all(&networks).is_empty());
}

/// The session id (field 6) from /proc/PID/stat.
fn session_of(pid: &str) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    fields[3].parse().expect("session id")
}

/// What a daemon killed between writing the hosts file and signalling
/// dnsmasq leaves: the file already says the new thing, dnsmasq still
/// serves the old. The next apply decides from what dnsmasq has read (its
/// record), not from the file, so it signals; dnsmasq's own log shows the
/// reread and a client with the new MAC gets its address from it.
#[tokio::test]
async fn a_hosts_file_written_but_never_signalled_is_served_after_the_next_apply() {
    if inside_netns("a_hosts_file_written_but_never_signalled_is_served_after_the_next_apply")
        .is_none()
    {
        return;
    }
    let state = state_dir();
    let networks = state.path().join("networks");
    let want = desired();
    let nl = Netlink::open().expect("netlink");
    let report = host::apply(&nl, &want, &networks).await.expect("apply");
    let pid = report.dnsmasq[0].1.pid();
    let files = DnsmasqFiles::new(network_dir(&networks, "hth-0"));
    let read_line = format!("dnsmasq-dhcp[{pid}]: read {}", files.hosts().display());
    let reads = || {
        std::fs::read_to_string(files.log())
            .unwrap_or_default()
            .matches(&read_line)
            .count()
    };
    // Its start's read.
    assert_eq!(reads(), 1);

    // The dead daemon's write: exactly what an apply of `more` writes.
    let mut more = want.clone();
    more.networks[0].static_leases.push(lease(11, "db"));
    std::fs::write(
        files.hosts(),
        dnsmasq::render_hosts(&more.networks[0].static_leases),
    )
    .expect("hosts");
    // dnsmasq has not read it: nothing told it to.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(reads(), 1, "dnsmasq reread a file nobody signalled");

    let report = host::apply(&nl, &more, &networks)
        .await
        .expect("apply after the kill");
    dhcp_client_port("vcl0", "vbr0", "hth-0", lease(11, "db").mac);
    assert_eq!(
        udhcpc("vcl0", state.path()).as_deref(),
        Some("ip=10.77.0.11 router=10.77.0.1"),
        "dnsmasq does not serve the new host"
    );
    assert_eq!(reads(), 2, "dnsmasq's log shows no reread");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Reloaded { pid });
    // Once it has read it, the same desired state changes nothing.
    let report = host::apply(&nl, &more, &networks)
        .await
        .expect("apply again");
    assert_eq!(report.dnsmasq[0].1, DnsmasqOutcome::Unchanged { pid });
    assert_eq!(reads(), 2);
    cleanup::run(&nl, &HostDesired::default(), &networks)
        .await
        .expect("cleanup");
}
