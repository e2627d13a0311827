//! Networking end to end: real guests (the small test guest, whose udhcpc
//! asks for an address on every NIC) on the bridges, taps, dnsmasqs and
//! nftables rules hearthd makes, with hearthd inside a network namespace the
//! test creates. Every packet stays inside that namespace: guest to guest,
//! guest to the bridge, and the test's own connection to a forwarded port on
//! the namespace's bridge address.
//!
//! Ground truth throughout: addresses from the guests' own console lines
//! and `ping` run in the guests, links from the kernel, processes from
//! /proc, the table from `nft`.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const WAIT: Duration = Duration::from_secs(30);

fn network(name: &str, mode: &str, subnet: &str) -> String {
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: {name}}}\nspec: {{mode: {mode}, subnet: {subnet}}}\n"
    )
}

fn guest(name: &str, networks: &str, extra_cmdline: &str) -> String {
    format!(
        "---\n{}  networks: {networks}\n",
        vm_yaml(name, "AlwaysOn", &[], extra_cmdline)
    )
}

/// The addresses the guest's DHCP client reported on its console for `iface`
/// (`hearth-guest: eth0 lease 10.77.0.10/24 router 10.77.0.1 mac ...`), in
/// order. QEMU starts the console file afresh: this boot's only.
fn console_leases(d: &Daemon, vm: &str, iface: &str) -> Vec<String> {
    let text = std::fs::read_to_string(serial_log(d, vm)).unwrap_or_default();
    let marker = format!("hearth-guest: {iface} lease ");
    text.lines()
        .filter_map(|l| l.split_once(&marker))
        .filter_map(|(_, rest)| rest.split('/').next().map(str::to_string))
        .collect()
}

/// Waits for the `n`-th lease line of `iface` on `vm`'s console; its address.
fn wait_console_lease(d: &Daemon, vm: &str, iface: &str, n: usize) -> String {
    let mut leases = Vec::new();
    let found = eventually(BOOT_TIMEOUT, || {
        leases = console_leases(d, vm, iface);
        leases.len() >= n
    });
    assert!(
        found,
        "{vm} {iface}: lease {n} not on the console within {BOOT_TIMEOUT:?}; console:\n{}\nhearthd:\n{}",
        std::fs::read_to_string(serial_log(d, vm)).unwrap_or_default(),
        d.log()
    );
    leases[n - 1].clone()
}

/// Pids of this daemon's dnsmasqs serving `bridge`, from /proc.
fn dnsmasq_pids(d: &Daemon, bridge: &str) -> Vec<u32> {
    let conf_dir = format!("{}/networks/{bridge}/", d.run_dir().display());
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
        let dnsmasq = cmd.starts_with("dnsmasq") || cmd.contains("/dnsmasq ");
        if dnsmasq && cmd.contains(&conf_dir) && !is_zombie(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// status.interfaces[i].ipAddress of `vm`, once every interface is confirmed
/// by the guest agent.
fn wait_confirmed(d: &Daemon, vm: &str, count: usize) -> Vec<String> {
    let v = d.wait_object(
        "virtualmachines",
        vm,
        "every interface confirmed by the agent",
        BOOT_TIMEOUT,
        |v| {
            v["status"]["interfaces"]
                .as_array()
                .is_some_and(|a| a.len() == count && a.iter().all(|i| i["confirmed"] == true))
        },
    );
    v["status"]["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["ipAddress"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Restarts `vm` and waits until a new QEMU runs it (QEMU has opened, and
/// so emptied, its console file by the time hearthd says Running).
fn restart(d: &Daemon, vm: &str) {
    let old = d.get_vm(vm).expect("vm")["status"]["pid"].clone();
    assert!(old.is_u64(), "{vm} runs before the restart");
    d.cli_ok(&["restart", vm]);
    d.wait_vm(vm, "running a new QEMU", BOOT_TIMEOUT, |v| {
        v["status"]["phase"] == "Running" && v["status"]["pid"] != old
    });
    assert_eq!(d.qemu_pids_of(vm).len(), 1, "one QEMU for {vm}");
}

fn ping_ok(d: &Daemon, from: &str, to: &str) {
    let (code, out) = d.agent_sh(from, &format!("ping -c 1 -W 3 {to}"));
    assert_eq!(code, 0, "{from} cannot ping {to}: {out}");
}

fn ping_fails(d: &Daemon, from: &str, to: &str) {
    let (code, out) = d.agent_sh(from, &format!("ping -c 1 -W 2 {to}"));
    assert_ne!(code, 0, "{from} reached {to}, which it must not: {out}");
}

fn fetch_forwarded(d: &Daemon, url: &str) -> String {
    let out = d.in_netns("curl", &["-s", "--max-time", "5", url]);
    assert!(
        out.status.success(),
        "curl {url} inside the namespace: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The pid of the process listening on 127.0.0.1:`port` in the test's
/// namespace (`ss -ltnp`), if any.
fn loopback_listener(d: &Daemon, port: u16) -> Option<u32> {
    let out = d.in_netns("ss", &["-Hltnp", &format!("src 127.0.0.1:{port}")]);
    assert!(
        out.status.success(),
        "ss: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("pid=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|pid| pid.parse().ok())
}

/// A DNS server standing in for the host's resolver, inside the test's
/// namespace (10.99.0.53 on its loopback link): it knows `upstream.test` and
/// logs every query it gets. Killed with the returned child.
fn upstream_dns(d: &Daemon, log: &Path) -> std::process::Child {
    let ns = d.netns.as_ref().expect("netns");
    ns.exec_ok("ip", &["addr", "add", "10.99.0.53/32", "dev", "lo"]);
    let child = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "dnsmasq", "--keep-in-foreground"])
        .args([
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--listen-address=10.99.0.53",
            "--address=/upstream.test/10.99.0.7",
            "--log-queries",
            "--pid-file=",
            "--user=root",
        ])
        .arg(format!("--log-facility={}", log.display()))
        .spawn()
        .expect("dnsmasq (apt-get install dnsmasq-base)");
    wait_until("the upstream DNS server listens", WAIT, || {
        ns.exec("ss", &["-Hlun", "src 10.99.0.53:53"])
            .stdout
            .iter()
            .any(|b| !b.is_ascii_whitespace())
    });
    child
}

#[test]
fn vms_on_nat_and_isolated_networks_reach_each_other_keep_their_addresses_and_leave_nothing() {
    let _serial = serial();
    // The host's resolver, as hearthd sees it: a file naming the upstream
    // server in the namespace (readable by dnsmasq once it runs as nobody).
    let resolv_dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        resolv_dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let resolv = resolv_dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 10.99.0.53\n").expect("resolv.conf");
    std::fs::set_permissions(&resolv, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    let resolv_arg = resolv.to_string_lossy().into_owned();
    let mut d = Daemon::start_in_netns(&[], &["--dns-resolv-file", &resolv_arg]);
    let upstream_log = resolv_dir.path().join("upstream.log");
    let mut upstream = upstream_dns(&d, &upstream_log);
    let objects = network("lan", "NAT", "10.77.0.0/24")
        + &network("iso", "Isolated", "10.78.0.0/24")
        + &guest(
            "a",
            "[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}, {virtualNetworkName: iso}]",
            "hearth.httpd=80",
        )
        + &guest("b", "[{virtualNetworkName: lan}]", "")
        + &guest("c", "[{virtualNetworkName: iso}]", "");
    apply_manifest(&d, "net.yaml", &objects);

    // Every guest's DHCP client got the address hearth leased, and its agent
    // confirms it.
    let a = wait_confirmed(&d, "a", 2);
    let b = wait_confirmed(&d, "b", 1);
    let c = wait_confirmed(&d, "c", 1);
    assert_eq!(wait_console_lease(&d, "a", "eth0", 1), a[0]);
    assert_eq!(wait_console_lease(&d, "a", "eth1", 1), a[1]);
    assert_eq!(wait_console_lease(&d, "b", "eth0", 1), b[0]);
    assert_eq!(wait_console_lease(&d, "c", "eth0", 1), c[0]);
    assert!(a[0].starts_with("10.77.0.") && b[0].starts_with("10.77.0."));
    assert!(a[1].starts_with("10.78.0.") && c[0].starts_with("10.78.0."));
    let ns = d.netns.as_ref().expect("netns");
    assert_eq!(
        ns.hearth_links(),
        [
            "hth-iso", "hth-lan", "htt-a-0", "htt-a-1", "htt-b-0", "htt-c-0"
        ]
    );
    let vm_a = d.get_vm("a").expect("a");
    assert_eq!(vm_a["status"]["interfaces"][0]["hostInterface"], "htt-a-0");
    assert_eq!(vm_a["status"]["interfaces"][1]["network"], "iso");

    // Guests reach each other on both networks.
    ping_ok(&d, "a", &b[0]);
    ping_ok(&d, "b", &a[0]);
    ping_ok(&d, "a", &c[0]);
    ping_ok(&d, "c", &a[1]);

    // DNS: DHCP names the gateway as each guest's DNS server; it answers the
    // network's VMs by name and, on the NAT network only, forwards the rest
    // to the host's resolver (the upstream's own log shows what reached it).
    let resolv = d.agent_sh_ok("a", "cat /etc/resolv.conf");
    assert!(
        resolv.contains("nameserver 10.77.0.1") && resolv.contains("nameserver 10.78.0.1"),
        "a's resolvers are not both its networks' gateways:\n{resolv}"
    );
    let resolv = d.agent_sh_ok("c", "cat /etc/resolv.conf");
    assert!(
        resolv.contains("nameserver 10.78.0.1"),
        "c's resolver is not iso's gateway:\n{resolv}"
    );
    let lookup = |vm: &str, name: &str, server: &str| {
        d.agent_sh(vm, &format!("nslookup {name} {server} 2>&1")).1
    };
    let out = lookup("a", "upstream.test", "10.77.0.1");
    assert!(out.contains("10.99.0.7"), "upstream.test from a: {out}");
    let out = lookup("a", "b", "10.77.0.1");
    assert!(out.contains(&b[0]), "b by name from a: {out}");
    let out = lookup("c", "a", "10.78.0.1");
    assert!(out.contains(&a[1]), "a by name from c on iso: {out}");
    let out = lookup("c", "isolated-probe.test", "10.78.0.1");
    assert!(!out.contains("10.99.0.7"), "{out}");
    let queries = std::fs::read_to_string(&upstream_log).unwrap_or_default();
    assert!(queries.contains("upstream.test"), "{queries}");
    assert!(
        !queries.contains("isolated-probe.test"),
        "an Isolated network's query left it: {queries}"
    );

    // The forward reaches a's httpd from inside the namespace, through the
    // bridge's own address (the output hook's DNAT).
    assert_eq!(
        fetch_forwarded(&d, "http://10.77.0.1:8080/").trim(),
        "hello from hearth-guest"
    );
    // And on 127.0.0.1, which no DNAT can serve: hearthd listens there
    // itself (the namespace's socket table names it) and copies to a.
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    assert_eq!(loopback_listener(&d, 8080), Some(hearthd));
    assert_eq!(
        fetch_forwarded(&d, "http://127.0.0.1:8080/").trim(),
        "hello from hearth-guest"
    );

    // Isolated means isolated: even with a route through the host, c gets
    // nowhere outside its network, and nothing outside reaches c; both
    // reach their own gateways, so the path exists but for the rules.
    ping_ok(&d, "c", "10.78.0.1");
    d.agent_sh_ok("c", "ip route add 10.77.0.0/24 via 10.78.0.1");
    ping_fails(&d, "c", &b[0]);
    ping_ok(&d, "b", "10.77.0.1");
    ping_fails(&d, "b", &c[0]);

    // A VM restart: a new QEMU, the same address from DHCP.
    restart(&d, "b");
    assert_eq!(wait_console_lease(&d, "b", "eth0", 1), b[0]);
    assert_eq!(wait_confirmed(&d, "b", 1), b);

    // SIGKILL of hearthd and a restart: the VMs and the dnsmasq run on,
    // adopted; nothing on the host is rebuilt; addresses are unchanged.
    let dnsmasq = dnsmasq_pids(&d, "hth-lan");
    assert_eq!(dnsmasq.len(), 1, "one dnsmasq for lan: {dnsmasq:?}");
    let links = d.netns.as_ref().unwrap().hearth_links();
    d.kill();
    // What a crash could leave: a tap and a bridge with hearth's names that
    // nothing in the store asks for. The restarted daemon removes them
    // before it serves its API, and touches nothing else.
    {
        let ns = d.netns.as_ref().unwrap();
        ns.exec_ok("ip", &["tuntap", "add", "htt-stray-0", "mode", "tap"]);
        ns.exec_ok("ip", &["link", "add", "hth-stray", "type", "bridge"]);
        ns.exec_ok("ip", &["link", "add", "other0", "type", "bridge"]);
    }
    d.spawn();
    let ns = d.netns.as_ref().unwrap();
    assert_eq!(
        ns.hearth_links(),
        links,
        "the crash's leftovers are still there"
    );
    assert!(
        ns.exec("ip", &["link", "show", "other0"]).status.success(),
        "a bridge that is not hearth's was removed"
    );
    d.wait_object("virtualnetworks", "lan", "ready again", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    assert_eq!(dnsmasq_pids(&d, "hth-lan"), dnsmasq, "dnsmasq was replaced");
    assert_eq!(d.netns.as_ref().unwrap().hearth_links(), links);
    ping_ok(&d, "a", &b[0]);
    // The restarted daemon listens on the loopback port again.
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    assert_eq!(loopback_listener(&d, 8080), Some(hearthd));
    assert_eq!(
        fetch_forwarded(&d, "http://127.0.0.1:8080/").trim(),
        "hello from hearth-guest"
    );
    // ... and a VM started by the new daemon gets its old address too.
    restart(&d, "c");
    assert_eq!(wait_console_lease(&d, "c", "eth0", 1), c[0]);
    assert_eq!(wait_confirmed(&d, "c", 1), c);

    // A deleted VM's address goes to the next VM that asks, and its DHCP
    // server hands it out (it still remembers the old MAC's lease).
    d.cli_ok(&["delete", "vm", "b"]);
    d.wait_gone("virtualmachines", "b", BOOT_TIMEOUT);
    apply_manifest(&d, "d.yaml", &guest("e", "[{virtualNetworkName: lan}]", ""));
    let e = wait_confirmed(&d, "e", 1);
    assert_eq!(e, b, "the freed address is reused");
    assert_eq!(wait_console_lease(&d, "e", "eth0", 1), b[0]);
    // e speaks first: a still has b's MAC for that address in its neighbour
    // cache, as any host on a LAN would, until e's ARP request replaces it.
    ping_ok(&d, "e", &a[0]);
    ping_ok(&d, "a", &e[0]);

    // Deleting everything leaves no tap, bridge, rule or dnsmasq.
    for vm in ["a", "c", "e"] {
        d.cli_ok(&["delete", "vm", vm]);
    }
    for vm in ["a", "c", "e"] {
        d.wait_gone("virtualmachines", vm, BOOT_TIMEOUT);
    }
    for net in ["lan", "iso"] {
        d.cli_ok(&["delete", "network", net]);
    }
    for net in ["lan", "iso"] {
        d.wait_gone("virtualnetworks", net, WAIT);
    }
    let ns = d.netns.as_ref().unwrap();
    assert!(ns.hearth_links().is_empty(), "{:?}", ns.hearth_links());
    assert!(
        !ns.exec_ok("nft", &["list", "tables"]).contains("hearth"),
        "the nftables table is left"
    );
    // The test's own upstream goes first.
    let _ = upstream.kill();
    let _ = upstream.wait();
    let hearthd = d.child.as_ref().map(|c| c.id());
    let left: Vec<u32> = ns
        .pids()
        .into_iter()
        .filter(|p| Some(*p) != hearthd && !is_zombie(*p))
        .collect();
    assert!(left.is_empty(), "processes left in the namespace: {left:?}");
    assert_eq!(
        loopback_listener(&d, 8080),
        None,
        "the loopback forward is left"
    );
    assert!(dnsmasq_pids(&d, "hth-lan").is_empty() && dnsmasq_pids(&d, "hth-iso").is_empty());
}

/// The taps QEMU process `pid` holds open, by name: each descriptor on
/// `/dev/net/tun`, as the kernel names its interface in `fdinfo` (`iff:`).
/// The guest's DHCP hook (guest/udhcpc.script) run by busybox on the host, for
/// six NICs bound at once, as a guest's udhcpcs are at boot: every round
/// leaves every NIC's DNS server in resolv.conf. The hook before it checked
/// its rename lost one within the first dozen rounds here (and a guest with
/// two NICs failed the test above that way). The hook runs in namespaces of its own:
/// its `ip` commands in a network namespace without an ethN, and its files in
/// the test's directory, with empty /etc and /run over the host's, so even a
/// hook that ignored the test's paths writes nothing of the host.
#[test]
fn the_guests_dhcp_hook_keeps_every_nics_dns_server_when_nics_bind_at_once() {
    const NICS: usize = 6;
    const ROUNDS: usize = 150;
    let hook = repo_root().join("guest/udhcpc.script");
    let dir = tempfile::tempdir().expect("tempdir");
    let resolv = dir.path().join("resolv.conf");
    let binds: String = (0..NICS)
        .map(|k| {
            format!(
                "interface=eth{k} ip=10.7{k}.0.5 mask=24 router=10.7{k}.0.1 dns=10.7{k}.0.1 \
                 busybox sh {} bound & ",
                hook.display()
            )
        })
        .collect();
    for round in 0..ROUNDS {
        let state = dir.path().join(format!("state-{round}"));
        let _ = std::fs::remove_file(&resolv);
        let out = std::process::Command::new("unshare")
            .args([
                "-n",
                "-m",
                "--propagation",
                "private",
                "busybox",
                "sh",
                "-c",
            ])
            .arg(format!(
                "set -e; mount -t tmpfs none /etc; mount -t tmpfs none /run; {binds}wait"
            ))
            .env("HEARTH_NET_STATE", &state)
            .env("HEARTH_RESOLV", &resolv)
            .env("HEARTH_CONSOLE", dir.path().join("console"))
            .output()
            .expect("unshare (util-linux) and busybox (apt-get install busybox-static)");
        assert!(out.status.success(), "round {round}: {out:?}");
        let text = std::fs::read_to_string(&resolv).unwrap_or_default();
        for k in 0..NICS {
            assert!(
                text.contains(&format!("nameserver 10.7{k}.0.1\n")),
                "round {round}: eth{k}'s DNS server is missing from resolv.conf:\n{text}"
            );
        }
        // Every hook's own temporary file went with its rename.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("resolv.conf."))
            .collect();
        assert!(left.is_empty(), "round {round}: left behind: {left:?}");
    }
}

fn tap_fds(pid: u32) -> Vec<String> {
    let mut taps = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("QEMU's fds")
        .flatten()
    {
        if std::fs::read_link(e.path()).is_ok_and(|t| t == Path::new("/dev/net/tun")) {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .unwrap_or_default();
            taps.extend(
                info.lines()
                    .filter_map(|l| l.strip_prefix("iff:"))
                    .map(|n| n.trim().to_string()),
            );
        }
    }
    taps.sort();
    taps
}

/// The bridge `link` is enslaved to, from the kernel.
fn master_of(d: &Daemon, link: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(
        &d.netns
            .as_ref()
            .expect("netns")
            .exec_ok("ip", &["-j", "link", "show", "dev", link]),
    )
    .expect("ip -j");
    v[0]["master"].as_str().map(str::to_string)
}

/// The process state letter (`T` for stopped) from /proc/PID/stat.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

fn nft_table(d: &Daemon) -> String {
    let out = d.in_netns("nft", &["list", "table", "inet", "hearth"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn network_file(d: &Daemon, bridge: &str, file: &str) -> String {
    std::fs::read_to_string(d.run_dir().join("networks").join(bridge).join(file))
        .unwrap_or_default()
}

#[test]
fn a_running_vms_network_edit_keeps_what_its_qemu_uses_until_the_restart_applies_it() {
    let _serial = serial();
    let d = Daemon::start_in_netns(&[], &[]);
    // a's guest takes its time to power off (its QEMU is frozen below), so
    // the stop its edit starts waits with the old QEMU still there.
    let vm_a = |networks: &str| {
        format!(
            "---\n{}  networks: {networks}\n",
            vm_yaml("a", "AlwaysOn", &[], "hearth.httpd=80")
                .replace("stopTimeoutSeconds: 10", "stopTimeoutSeconds: 600")
        )
    };
    apply_manifest(
        &d,
        "nets.yaml",
        &(network("lan", "NAT", "10.77.0.0/24") + &network("iso", "Isolated", "10.78.0.0/24")),
    );
    apply_manifest(
        &d,
        "a.yaml",
        &vm_a("[{virtualNetworkName: lan, ports: [{hostPort: 8080, guestPort: 80}]}]"),
    );
    let a_lan = wait_confirmed(&d, "a", 1).remove(0);
    assert_eq!(wait_console_lease(&d, "a", "eth0", 1), a_lan);
    assert!(
        d.agent_sh_ok("a", "ip -4 -o addr show dev eth0")
            .contains(&format!("{a_lan}/24")),
        "a's guest does not have {a_lan}"
    );
    let a_mac = d.get_vm("a").expect("a")["status"]["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_string();
    let qemu = d.qemu_pids_of("a");
    assert_eq!(qemu.len(), 1, "{qemu:?}");
    let qemu = qemu[0];
    assert_eq!(tap_fds(qemu), ["htt-a-0"]);
    assert_eq!(master_of(&d, "htt-a-0").as_deref(), Some("hth-lan"));
    let dnat = format!("dnat ip to {a_lan}:80");
    assert!(nft_table(&d).contains(&dnat), "{}", nft_table(&d));
    assert_eq!(
        fetch_forwarded(&d, "http://10.77.0.1:8080/").trim(),
        "hello from hearth-guest"
    );

    // Frozen: the guest cannot power off, QEMU cannot exit.
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &qemu.to_string()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {qemu}");
    };
    signal("-STOP");
    // a moves from lan to iso while its QEMU runs on lan. Then b asks lan
    // for an address: the lowest free one, if a's were released.
    apply_manifest(&d, "a.yaml", &vm_a("[{virtualNetworkName: iso}]"));
    apply_manifest(&d, "b.yaml", &guest("b", "[{virtualNetworkName: lan}]", ""));
    let b_lan = wait_confirmed(&d, "b", 1).remove(0);
    let b_mac = d.get_vm("b").expect("b")["status"]["interfaces"][0]["mac"]
        .as_str()
        .expect("mac")
        .to_string();

    // Nothing a's running QEMU uses was taken away: its tap is still on lan
    // where its descriptor points, its forward still reaches its address,
    // and lan's dnsmasq still has a's host line and lease.
    assert_eq!(proc_state(qemu), Some('T'), "a's old QEMU is gone");
    assert_eq!(tap_fds(qemu), ["htt-a-0"]);
    assert_eq!(
        master_of(&d, "htt-a-0").as_deref(),
        Some("hth-lan"),
        "a's tap was taken off lan while its QEMU runs there"
    );
    assert!(
        nft_table(&d).contains(&dnat),
        "a's forward went: {}",
        nft_table(&d)
    );
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    assert_eq!(loopback_listener(&d, 8080), Some(hearthd));
    assert!(
        network_file(&d, "hth-lan", "hosts").contains(&format!("{a_mac},{a_lan},a")),
        "{}",
        network_file(&d, "hth-lan", "hosts")
    );
    assert!(
        network_file(&d, "hth-lan", "leases").contains(&format!("{a_mac} {a_lan} a")),
        "{}",
        network_file(&d, "hth-lan", "leases")
    );
    // ... and a's address was not given to b: b's own DHCP client and
    // dnsmasq's log say which address b got.
    assert_ne!(
        b_lan, a_lan,
        "a's address went to b while a's guest uses it"
    );
    assert_eq!(wait_console_lease(&d, "b", "eth0", 1), b_lan);
    let log = network_file(&d, "hth-lan", "dnsmasq.log");
    assert!(
        log.contains(&format!("DHCPACK(hth-lan) {b_lan} {b_mac}")),
        "{log}"
    );
    assert!(
        !log.contains(&format!("DHCPACK(hth-lan) {a_lan} {b_mac}")),
        "{log}"
    );
    // The user is told.
    let a = d.get_vm("a").expect("a");
    let condition = a["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "NetworksInEffect")
        .cloned()
        .unwrap_or_default();
    assert_eq!(condition["status"], "False", "{a}");
    assert_eq!(condition["reason"], "RestartPending", "{a}");
    assert!(
        d.event_reasons("VirtualMachine", "a")
            .contains(&"NetworksChanged".to_string()),
        "{:?}",
        d.event_reasons("VirtualMachine", "a")
    );

    // Thawed, the guest gets the power-off it was asked for; the restart
    // brings a up on iso.
    signal("-CONT");
    d.wait_vm("a", "running a new QEMU", BOOT_TIMEOUT, |v| {
        v["status"]["phase"] == "Running" && v["status"]["pid"] != qemu
    });
    let a_iso = wait_confirmed(&d, "a", 1).remove(0);
    assert!(a_iso.starts_with("10.78.0."), "{a_iso}");
    assert_eq!(wait_console_lease(&d, "a", "eth0", 1), a_iso);
    assert!(
        d.agent_sh_ok("a", "ip -4 -o addr show dev eth0")
            .contains(&format!("{a_iso}/24"))
    );
    assert!(proc_state(qemu).is_none(), "the old QEMU still runs");
    let new_qemu = d.qemu_pids_of("a");
    assert_eq!(new_qemu.len(), 1, "{new_qemu:?}");
    assert_eq!(tap_fds(new_qemu[0]), ["htt-a-0"]);
    assert_eq!(master_of(&d, "htt-a-0").as_deref(), Some("hth-iso"));
    assert!(!nft_table(&d).contains(&dnat), "{}", nft_table(&d));
    assert_eq!(loopback_listener(&d, 8080), None);
    assert!(
        !network_file(&d, "hth-lan", "hosts").contains(&a_mac),
        "{}",
        network_file(&d, "hth-lan", "hosts")
    );
    let a = d.get_vm("a").expect("a");
    assert!(
        !a["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "NetworksInEffect"),
        "{a}"
    );
    // Now a's old address is free: the next VM on lan gets it.
    apply_manifest(&d, "c.yaml", &guest("c", "[{virtualNetworkName: lan}]", ""));
    let c_lan = wait_confirmed(&d, "c", 1).remove(0);
    assert_eq!(c_lan, a_lan);
    assert_eq!(wait_console_lease(&d, "c", "eth0", 1), a_lan);
}

#[test]
fn a_hearthd_killed_between_writing_dnsmasqs_hosts_and_signalling_it_leaves_nothing_stale() {
    let _serial = serial();
    let mut d = Daemon::start_in_netns(&[], &[]);
    apply_manifest(&d, "lan.yaml", &network("lan", "NAT", "10.77.0.0/24"));
    d.wait_object("virtualnetworks", "lan", "ready", WAIT, |v| {
        v["status"]["phase"] == "Ready"
    });
    let dnsmasq = dnsmasq_pids(&d, "hth-lan");
    assert_eq!(dnsmasq.len(), 1, "{dnsmasq:?}");
    let dnsmasq = dnsmasq[0];
    let hosts = d.run_dir().join("networks/hth-lan/hosts");
    let read_line = format!("dnsmasq-dhcp[{dnsmasq}]: read {}", hosts.display());
    let log_file = d.run_dir().join("networks/hth-lan/dnsmasq.log");
    let reads = || {
        std::fs::read_to_string(&log_file)
            .unwrap_or_default()
            .matches(&read_line)
            .count()
    };
    let reads_before = reads();
    assert!(reads_before >= 1, "dnsmasq never read its hosts file");

    // hearthd is killed as it enters its next pidfd_send_signal, before the
    // call runs: the SIGHUP that follows a write of the hosts file.
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    let strace_log = d.dir.path().join("strace.log");
    let mut strace = std::process::Command::new("strace")
        .args(["-f", "-qq", "-p", &hearthd.to_string()])
        .args(["-e", "trace=pidfd_send_signal"])
        .args([
            "-e",
            "inject=pidfd_send_signal:error=EPERM:signal=SIGKILL:when=1",
        ])
        .arg("-o")
        .arg(&strace_log)
        .spawn()
        .expect("strace (apt-get install strace)");
    wait_until("strace traces every thread of hearthd", WAIT, || {
        hearth_test_support::process::all_threads_traced(hearthd)
    });
    apply_manifest(&d, "b.yaml", &guest("b", "[{virtualNetworkName: lan}]", ""));
    let status = d.wait_exit(WAIT);
    let _ = strace.wait();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "hearthd was not killed at its signal: {status}; strace:\n{}",
        std::fs::read_to_string(&strace_log).unwrap_or_default()
    );
    // The moment of the kill: b's host line is on disk, dnsmasq (the same
    // process) has not read it.
    let written = std::fs::read_to_string(&hosts).expect("hosts");
    let b_line = written
        .lines()
        .find(|l| l.ends_with(",b"))
        .unwrap_or_else(|| panic!("no host line for b: {written:?}"))
        .to_string();
    assert_eq!(dnsmasq_pids(&d, "hth-lan"), [dnsmasq]);
    assert_eq!(reads(), reads_before, "dnsmasq reread its hosts file");

    // The next hearthd: dnsmasq is made to read what it has not read, and
    // b's guest gets its address from it.
    d.spawn();
    let b_lan = wait_confirmed(&d, "b", 1).remove(0);
    assert!(b_line.contains(&format!(",{b_lan},")), "{b_line}");
    assert_eq!(wait_console_lease(&d, "b", "eth0", 1), b_lan);
    assert!(reads() > reads_before || dnsmasq_pids(&d, "hth-lan") != [dnsmasq]);
    let b_mac = b_line.split(',').next().expect("mac");
    let log = network_file(&d, "hth-lan", "dnsmasq.log");
    assert!(
        log.contains(&format!("DHCPACK(hth-lan) {b_lan} {b_mac}")),
        "{log}"
    );
}
