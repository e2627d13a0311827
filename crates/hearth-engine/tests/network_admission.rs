//! Network checks at apply and delete, and the network reconcile's host
//! side, through the engine and its real SQLite store. No VM boots (every
//! VM is AlwaysOff). Each test runs inside a network namespace of its own
//! (see `netns/`): the engine makes real bridges, taps, dnsmasqs and
//! nftables rules there, never in the host's namespace.

mod common;
mod netns;

use std::sync::Arc;
use std::time::Duration;

use common::engine_config;
use hearth_api::{Kind, NetworkMode, Object, parse_documents};
use hearth_engine::{ApplyConflict, Engine, Refusal, RequestError};
use hearth_test_support::{Network, ObjectBuilder};

struct Setup {
    dir: tempfile::TempDir,
    engine: Arc<Engine>,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    // dnsmasq, once it has dropped to `nobody`, must pass through to its
    // hosts file under the run directory.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .expect("chmod");
    std::fs::create_dir_all(dir.path().join("images")).expect("images dir");
    std::fs::write(dir.path().join("images/vmlinuz"), b"not booted").expect("kernel");
    let engine = Engine::start(engine_config(dir.path(), vec![dir.path().join("images")]))
        .await
        .expect("engine");
    Setup { dir, engine }
}

impl Setup {
    fn objects(&self, yaml: &str) -> Vec<Object> {
        let kernel = self.dir.path().join("images/vmlinuz");
        let text = yaml.replace("KERNEL", &kernel.display().to_string());
        parse_documents(&text, "test.yaml").expect("valid objects")
    }

    fn apply(&self, yaml: &str) -> Result<(), RequestError> {
        self.engine.apply(self.objects(yaml), "api").map(|_| ())
    }

    fn names(&self, kind: Kind) -> Vec<String> {
        let mut v: Vec<String> = self
            .engine
            .list(kind)
            .expect("list")
            .into_iter()
            .map(|s| s.object.name().to_string())
            .collect();
        v.sort();
        v
    }
}

fn network(name: &str, subnet: &str) -> String {
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: {name}}}\nspec: {{subnet: {subnet}}}\n"
    )
}

fn vm(name: &str, networks: &str) -> String {
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  runPolicy: AlwaysOff\n  boot: {{kernel: KERNEL}}\n  networks: {networks}\n"
    )
}

fn conflict(r: Result<(), RequestError>) -> String {
    match r {
        Err(e) if e.refusal() == Refusal::Conflict => e.to_string(),
        other => panic!("expected a conflict, got {other:?}"),
    }
}

fn invalid(r: Result<(), RequestError>) -> String {
    match r {
        Err(RequestError::Invalid(e)) => e.to_string(),
        other => panic!("expected an invalid field, got {other:?}"),
    }
}

#[tokio::test]
async fn overlapping_subnets_are_refused_naming_the_other_network() {
    if netns::inside_netns("overlapping_subnets_are_refused_naming_the_other_network").is_none() {
        return;
    }
    let s = setup().await;
    s.apply(&network("lan", "10.77.0.0/16"))
        .expect("first network");
    let e = conflict(s.apply(&(network("lab", "10.90.0.0/24") + &network("dmz", "10.77.8.0/24"))));
    assert_eq!(
        e,
        "VirtualNetwork \"dmz\": spec.subnet: 10.77.8.0/24 overlaps 10.77.0.0/16 of VirtualNetwork \"lan\""
    );
    // The whole apply was refused: "lab" was not stored either.
    assert_eq!(s.names(Kind::VirtualNetwork), vec!["lan"]);
    // Two overlapping networks in one apply are refused too.
    let e = conflict(s.apply(&(network("a", "10.91.0.0/24") + &network("b", "10.91.0.128/25"))));
    assert!(
        e.contains("VirtualNetwork \"a\"") && e.contains("\"b\""),
        "{e}"
    );
    assert_eq!(s.names(Kind::VirtualNetwork), vec!["lan"]);
}

#[tokio::test]
async fn addresses_outside_the_subnet_or_taken_are_refused_and_change_nothing() {
    if netns::inside_netns("addresses_outside_the_subnet_or_taken_are_refused_and_change_nothing")
        .is_none()
    {
        return;
    }
    let s = setup().await;
    s.apply(
        &(network("lan", "10.77.0.0/24")
            + &vm("web", "[{virtualNetworkName: lan, ipAddress: 10.77.0.50}]")),
    )
    .expect("web reserves .50");

    let e = invalid(s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ipAddress: 10.78.0.5}]",
    )));
    assert_eq!(
        e,
        "VirtualMachine \"db\": spec.networks[0].ipAddress: 10.78.0.5 is not in the network's subnet 10.77.0.0/24 (VirtualNetwork \"lan\")"
    );
    let e = invalid(s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ipAddress: 10.77.0.1}]",
    )));
    assert!(e.contains("gateway"), "{e}");

    let e = conflict(s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan}, {virtualNetworkName: lan, ipAddress: 10.77.0.50}]",
    )));
    assert_eq!(
        e,
        "VirtualMachine \"db\": spec.networks[1].ipAddress: 10.77.0.50 is already taken by VirtualMachine \"web\" (spec.networks[0]) (VirtualNetwork \"lan\")"
    );
    assert_eq!(s.names(Kind::VirtualMachine), vec!["web"]);

    // web itself may be applied again with its reservation.
    s.apply(&vm(
        "web",
        "[{virtualNetworkName: lan, ipAddress: 10.77.0.50}]",
    ))
    .expect("re-apply");
    // Once web lets the address go, db may have it.
    s.apply(&vm("web", "[{virtualNetworkName: lan}]"))
        .expect("web without reservation");
    s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ipAddress: 10.77.0.50}]",
    ))
    .expect("db takes .50");
}

#[tokio::test]
async fn a_stored_lease_is_held_against_reservations_of_other_vms() {
    if netns::inside_netns("a_stored_lease_is_held_against_reservations_of_other_vms").is_none() {
        return;
    }
    let s = setup().await;
    s.apply(&(network("lan", "10.77.0.0/24") + &vm("web", "[{virtualNetworkName: lan}]")))
        .expect("apply");
    // What IPAM would store for web (the store is the truth across restarts).
    let store = hearth_engine::store::Store::open(&s.dir.path().join("state/hearth.db"))
        .expect("second handle on the store");
    store
        .set_vm_leases(
            "web",
            &[hearth_engine::store::StoredLease {
                network: "lan".into(),
                vm: "web".into(),
                interface: 0,
                ip: "10.77.0.10".parse().expect("ip"),
                mac: "02:00:00:00:00:01".into(),
            }],
        )
        .expect("lease");
    let e = conflict(s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]",
    )));
    assert!(e.contains("already taken by VirtualMachine \"web\""), "{e}");
    // The network's subnet cannot move under a lease.
    let e = conflict(s.apply(&network("lan", "10.88.0.0/24")));
    assert!(
        e.contains("cannot move from 10.77.0.0/24 to 10.88.0.0/24"),
        "{e}"
    );
    // Deleting web releases its lease with it (one transaction).
    s.engine
        .delete(Kind::VirtualMachine, "web", "api")
        .expect("delete web");
    wait_until(|| store.leases().expect("leases").is_empty()).await;
    s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]",
    ))
    .expect("free now");
}

#[tokio::test]
async fn a_host_port_forwarded_by_another_vm_is_refused() {
    if netns::inside_netns("a_host_port_forwarded_by_another_vm_is_refused").is_none() {
        return;
    }
    let s = setup().await;
    let ports = "[{virtualNetworkName: lan, ports: [{hostPort: 2222, guestPort: 22}]}]";
    s.apply(&(network("lan", "10.77.0.0/24") + &vm("web", ports)))
        .expect("web forwards 2222");
    let e = conflict(s.apply(&vm("db", ports)));
    assert_eq!(
        e,
        "VirtualMachine \"db\": spec.networks[0].ports[0].hostPort: host TCP port 2222 is already forwarded to VirtualMachine \"web\" (spec.networks[0].ports[0].hostPort)"
    );
    assert_eq!(s.names(Kind::VirtualMachine), vec!["web"]);
    // UDP 2222 is another forward.
    s.apply(&vm(
        "db",
        "[{virtualNetworkName: lan, ports: [{hostPort: 2222, guestPort: 22, protocol: UDP}]}]",
    ))
    .expect("udp");
}

#[tokio::test]
async fn a_network_in_use_cannot_be_deleted_and_goes_once_unused() {
    if netns::inside_netns("a_network_in_use_cannot_be_deleted_and_goes_once_unused").is_none() {
        return;
    }
    let s = setup().await;
    s.apply(
        &(network("lan", "10.77.0.0/24")
            + &vm("web", "[{virtualNetworkName: lan}]")
            + &vm("db", "[{virtualNetworkName: lan}]")),
    )
    .expect("apply");
    let e = match s.engine.delete(Kind::VirtualNetwork, "lan", "api") {
        Err(RequestError::Apply(a)) if matches!(*a, ApplyConflict::NetworkInUse { .. }) => {
            a.to_string()
        }
        other => panic!("expected a conflict, got {other:?}"),
    };
    assert_eq!(
        e,
        "VirtualNetwork \"lan\" is in use by VirtualMachine \"db\", \"web\" (its spec.networks, or its running QEMU until it restarts); delete those VMs or remove the network from them first"
    );
    assert!(
        !s.engine
            .get(Kind::VirtualNetwork, "lan")
            .expect("still there")
            .deleting
    );

    // Without users it goes, and its reconcile removes it.
    s.apply(&(vm("web", "[]") + &vm("db", "[]")))
        .expect("detach");
    s.engine
        .delete(Kind::VirtualNetwork, "lan", "api")
        .expect("delete");
    wait_until(|| s.names(Kind::VirtualNetwork).is_empty()).await;
}

#[tokio::test]
async fn a_network_becomes_ready_once_its_bridge_and_dhcp_exist_and_leaves_nothing() {
    if netns::inside_netns(
        "a_network_becomes_ready_once_its_bridge_and_dhcp_exist_and_leaves_nothing",
    )
    .is_none()
    {
        return;
    }
    let s = setup().await;
    s.apply(&network("lan", "10.77.0.0/24")).expect("apply");
    wait_until(|| status(&s, "lan")["phase"] == "Ready").await;
    let st = status(&s, "lan");
    assert_eq!(st["subnet"], "10.77.0.0/24");
    assert_eq!(st["bridge"], "hth-lan", "{st}");
    assert_eq!(st["gateway"], "10.77.0.1", "{st}");
    // From the kernel, not from the status: the bridge has the gateway's
    // address, a dnsmasq serves it, and the table exists.
    assert_eq!(netns::ipv4_of("hth-lan"), ["10.77.0.1/24"]);
    assert_eq!(dnsmasq_on(&s, "hth-lan").len(), 1);
    assert!(
        netns::run("nft", &["list", "tables"]).contains("inet hearth"),
        "no nftables table"
    );
    // The mode of an existing network cannot change.
    let e = invalid(
        s.apply(
            &Network::new("lan")
                .mode(NetworkMode::Isolated)
                .subnet("10.77.0.0/24")
                .yaml(),
        ),
    );
    assert!(
        e.contains("spec.mode") && e.contains("cannot change from NAT to Isolated"),
        "{e}"
    );
    // Deleted: the bridge, its dnsmasq and the table go with it.
    s.engine
        .delete(Kind::VirtualNetwork, "lan", "api")
        .expect("delete");
    wait_until(|| s.names(Kind::VirtualNetwork).is_empty()).await;
    assert!(!link_exists("hth-lan"), "the bridge is still there");
    assert!(dnsmasq_on(&s, "hth-lan").is_empty(), "dnsmasq still runs");
    assert!(
        !netns::run("nft", &["list", "tables"]).contains("inet hearth"),
        "the table is still there"
    );
}

#[tokio::test]
async fn a_picked_subnet_avoids_the_hosts_addresses_and_routes_and_is_kept() {
    if netns::inside_netns("a_picked_subnet_avoids_the_hosts_addresses_and_routes_and_is_kept")
        .is_none()
    {
        return;
    }
    // The namespace's own interfaces: one takes 10.77.0.0/24 by address,
    // one 10.77.1.0/24 by a route.
    netns::run(
        "ip",
        &["link", "add", "up0", "type", "veth", "peer", "name", "up1"],
    );
    netns::run("ip", &["link", "set", "up0", "up"]);
    netns::run("ip", &["link", "set", "up1", "up"]);
    netns::run("ip", &["addr", "add", "10.77.0.5/24", "dev", "up0"]);
    netns::run("ip", &["route", "add", "10.77.1.0/24", "dev", "up0"]);
    let s = setup().await;
    s.apply(&Network::new("auto").mode(NetworkMode::Isolated).yaml())
        .expect("apply");
    wait_until(|| status(&s, "auto")["phase"] == "Ready").await;
    assert_eq!(status(&s, "auto")["subnet"], "10.77.2.0/24");
    assert_eq!(netns::ipv4_of("hth-auto"), ["10.77.2.1/24"]);
    // A given subnet that the host uses is refused by the reconcile,
    // naming what uses it.
    s.apply(&network("clash", "10.77.0.0/16"))
        .expect_err("overlaps auto");
    s.apply(&network("clash", "10.77.0.0/24")).expect("apply");
    wait_until(|| status(&s, "clash")["phase"] == "Failed").await;
    let msg = status(&s, "clash")["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(msg.contains("spec.subnet") && msg.contains("up0"), "{msg}");
    assert!(!link_exists("hth-clash"));
    // The picked subnet is kept, even once the host frees a lower one.
    netns::run("ip", &["route", "del", "10.77.1.0/24", "dev", "up0"]);
    s.engine
        .delete(Kind::VirtualNetwork, "clash", "api")
        .expect("delete");
    wait_until(|| s.names(Kind::VirtualNetwork) == ["auto"]).await;
    // A new generation is reconciled with the host's lower subnet free.
    s.apply(
        &Network::new("auto")
            .mode(NetworkMode::Isolated)
            .dhcp(false)
            .yaml(),
    )
    .expect("re-apply");
    wait_until(|| {
        let st = status(&s, "auto");
        st["observedGeneration"] == 2 && st["phase"] == "Ready"
    })
    .await;
    assert_eq!(status(&s, "auto")["subnet"], "10.77.2.0/24");
    assert_eq!(netns::ipv4_of("hth-auto"), ["10.77.2.1/24"]);
    assert!(
        dnsmasq_on(&s, "hth-auto").is_empty(),
        "dhcp: false still runs dnsmasq"
    );
}

fn status(s: &Setup, network: &str) -> serde_json::Value {
    s.engine
        .get(Kind::VirtualNetwork, network)
        .expect("get")
        .status
}

fn link_exists(name: &str) -> bool {
    std::process::Command::new("ip")
        .args(["link", "show", "dev", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Pids of this engine's dnsmasqs whose config names `bridge`, from /proc
/// (tests run in parallel, each with its own namespace and run directory).
fn dnsmasq_on(s: &Setup, bridge: &str) -> Vec<u32> {
    let run_dir = s.dir.path().join("run").display().to_string();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("dnsmasq") && cmd.contains(&format!("{run_dir}/networks/{bridge}/")) {
            pids.push(pid);
        }
    }
    pids
}

fn leases(s: &Setup) -> Vec<(String, u32, String, String)> {
    let store = hearth_engine::store::Store::open(&s.dir.path().join("state/hearth.db"))
        .expect("second handle on the store");
    store
        .leases()
        .expect("leases")
        .into_iter()
        .map(|l| (l.vm, l.interface, l.ip.to_string(), l.mac))
        .collect()
}

fn lease_count(s: &Setup, network: &str) -> Option<u64> {
    s.engine
        .get(Kind::VirtualNetwork, network)
        .ok()?
        .status
        .get("leases")?
        .as_u64()
}

#[tokio::test]
async fn the_network_stores_stable_leases_and_releases_them_with_the_interface() {
    if netns::inside_netns("the_network_stores_stable_leases_and_releases_them_with_the_interface")
        .is_none()
    {
        return;
    }
    let s = setup().await;
    s.apply(
        &(network("lan", "10.77.0.0/24")
            + &vm(
                "web",
                "[{virtualNetworkName: lan}, {virtualNetworkName: lan, macAddress: \"52:54:00:00:00:07\"}]",
            )
            + &vm("db", "[{virtualNetworkName: lan, ipAddress: 10.77.0.10}]")),
    )
    .expect("apply");
    wait_until(|| lease_count(&s, "lan") == Some(3)).await;
    let first = leases(&s);
    let web_mac = hearth_engine::network::names::derived_mac("web", 0).to_string();
    assert_eq!(
        first,
        vec![
            (
                "db".into(),
                0,
                "10.77.0.10".into(),
                hearth_engine::network::names::derived_mac("db", 0).to_string()
            ),
            // db reserved .10, so web's dynamic addresses start at .11.
            ("web".into(), 0, "10.77.0.11".into(), web_mac.clone()),
            (
                "web".into(),
                1,
                "10.77.0.12".into(),
                "52:54:00:00:00:07".into()
            ),
        ]
    );
    // Planned again from what is stored (a resync, a restarted daemon):
    // the same leases.
    let store = hearth_engine::store::Store::open(&s.dir.path().join("state/hearth.db"))
        .expect("second handle on the store");
    let vms: Vec<hearth_api::VirtualMachine> = s
        .engine
        .list(Kind::VirtualMachine)
        .expect("vms")
        .into_iter()
        .filter_map(|o| match o.object {
            Object::VirtualMachine(vm) => Some(vm),
            _ => None,
        })
        .collect();
    let stored = store.leases_of_network("lan").expect("leases");
    let (again, problems) = hearth_engine::network::plan_leases(
        "lan",
        "10.77.0.0/24".parse().expect("subnet"),
        false,
        &vms,
        &stored,
    );
    assert_eq!(again, stored);
    assert!(problems.is_empty(), "{problems:?}");

    // web's second interface leaves its spec: that address is released,
    // the first one is kept.
    s.apply(&vm("web", "[{virtualNetworkName: lan}]"))
        .expect("one nic");
    wait_until(|| lease_count(&s, "lan") == Some(2)).await;
    let now = leases(&s);
    assert_eq!(now[1], ("web".into(), 0, "10.77.0.11".into(), web_mac));
    // A new VM gets the lowest free address: .12 again.
    s.apply(&vm("mail", "[{virtualNetworkName: lan}]"))
        .expect("mail");
    wait_until(|| lease_count(&s, "lan") == Some(3)).await;
    assert!(
        leases(&s)
            .iter()
            .any(|l| l.0 == "mail" && l.2 == "10.77.0.12"),
        "{:?}",
        leases(&s)
    );
}

#[tokio::test]
async fn a_bridge_network_records_reservations_only() {
    if netns::inside_netns("a_bridge_network_records_reservations_only").is_none() {
        return;
    }
    let s = setup().await;
    s.apply(
        &("---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: lab}\nspec: {mode: Bridge, bridge: br0, subnet: 192.168.50.0/24}\n".to_string()
            + &vm("web", "[{virtualNetworkName: lab}]")
            + &vm("db", "[{virtualNetworkName: lab, ipAddress: 192.168.50.7}]")),
    )
    .expect("apply");
    wait_until(|| lease_count(&s, "lab") == Some(1)).await;
    let l = leases(&s);
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!((l[0].0.as_str(), l[0].2.as_str()), ("db", "192.168.50.7"));
}

/// Bounded: the engine's reconciles run on this runtime.
async fn wait_until(mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not met within 5 s");
}

#[tokio::test]
async fn ports_are_forwarded_only_to_nat_networks() {
    if netns::inside_netns("ports_are_forwarded_only_to_nat_networks").is_none() {
        return;
    }
    let s = setup().await;
    let iso = "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {name: iso}\nspec: {mode: Isolated, subnet: 10.78.0.0/24}\n";
    let web = vm(
        "web",
        "[{virtualNetworkName: iso, ports: [{hostPort: 8080, guestPort: 80}]}]",
    );
    // Together, and the VM after the network: refused, nothing stored.
    let e = invalid(s.apply(&format!("{iso}{web}")));
    assert!(
        e.contains("spec.networks[0].ports") && e.contains("Isolated"),
        "{e}"
    );
    assert!(s.names(Kind::VirtualNetwork).is_empty());
    s.apply(iso).expect("the network alone");
    let e = invalid(s.apply(&web));
    assert!(
        e.contains("ports are forwarded only to NAT networks"),
        "{e}"
    );
    assert!(s.names(Kind::VirtualMachine).is_empty());
}

#[tokio::test]
async fn a_bridge_network_waits_for_its_host_bridge_without_holding_up_the_others() {
    if netns::inside_netns(
        "a_bridge_network_waits_for_its_host_bridge_without_holding_up_the_others",
    )
    .is_none()
    {
        return;
    }
    let s = setup().await;
    s.apply(&format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: outside}}\nspec: {{mode: Bridge, bridge: br0}}\n{}{}{}",
        network("lan", "10.77.0.0/24"),
        vm("a", "[{virtualNetworkName: outside}]"),
        vm("b", "[{virtualNetworkName: lan}]"),
    ))
    .expect("apply");
    wait_until(|| status(&s, "outside")["phase"] == "Failed").await;
    let msg = status(&s, "outside")["message"].to_string();
    assert!(msg.contains("spec.bridge") && msg.contains("br0"), "{msg}");
    // The other network and its VM's tap are made all the same.
    wait_until(|| status(&s, "lan")["phase"] == "Ready").await;
    wait_until(|| link_exists("htt-b-0")).await;
    assert!(!link_exists("htt-a-0"));
    // Once the bridge exists, the network is Ready and the tap joins it.
    netns::run("ip", &["link", "add", "br0", "type", "bridge"]);
    s.engine.wake(Kind::VirtualNetwork, "outside");
    wait_until(|| status(&s, "outside")["phase"] == "Ready").await;
    assert_eq!(status(&s, "outside")["bridge"], "br0");
    wait_until(|| link_exists("htt-a-0")).await;
    let v: serde_json::Value =
        serde_json::from_str(&netns::run("ip", &["-j", "link", "show", "dev", "htt-a-0"]))
            .expect("ip -j");
    assert_eq!(v[0]["master"], "br0", "{v}");
}
