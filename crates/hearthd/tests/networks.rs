//! VirtualNetworks through the real daemon and CLI: tables, bad input, a
//! network in use, lease counts kept across a SIGKILL of hearthd, and the
//! host side appearing and going. No guest boots (VMs are AlwaysOff);
//! hearthd runs in a network namespace of the test's own.

mod common;

use std::time::Duration;

use common::*;

const WAIT: Duration = Duration::from_secs(20);

fn net(name: &str, subnet: &str) -> String {
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualNetwork\nmetadata: {{name: {name}}}\nspec: {{subnet: {subnet}}}\n"
    )
}

fn vm(kernel: &std::path::Path, name: &str, networks: &str) -> String {
    format!(
        "---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualMachine\nmetadata: {{name: {name}}}\nspec:\n  runPolicy: AlwaysOff\n  boot: {{kernel: {}}}\n  networks: {networks}\n",
        kernel.display()
    )
}

#[test]
fn networks_are_listed_refused_when_bad_and_keep_their_leases_across_a_crash() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let kernel = images.path().join("vmlinuz");
    std::fs::write(&kernel, b"never booted").expect("kernel");
    let mut d = Daemon::start_in_netns(&[images.path()], &["--accel", "tcg"]);

    let m = manifest(
        &d,
        "lan.yaml",
        &(net("lan", "10.77.0.0/24")
            + &vm(
                &kernel,
                "web",
                "[{virtualNetworkName: lan, ports: [{hostPort: 2222, guestPort: 22}]}]",
            )),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    let lan = d.wait_object(
        "virtualnetworks",
        "lan",
        "ready with one lease",
        WAIT,
        |v| v["status"]["leases"] == 1 && v["status"]["phase"] == "Ready",
    );
    assert_eq!(lan["status"]["bridge"], "hth-lan", "{lan}");
    assert_eq!(lan["status"]["gateway"], "10.77.0.1", "{lan}");
    // The kernel's word: the bridge, and the stopped VM's tap on it.
    assert_eq!(
        d.netns.as_ref().unwrap().hearth_links(),
        ["hth-lan", "htt-web-0"]
    );

    let table = d.cli_ok(&["get", "networks"]);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME", "MODE", "SUBNET", "GATEWAY", "BRIDGE", "LEASES", "PHASE", "AGE"
        ]
    );
    let row: Vec<&str> = lines.next().expect("row").split_whitespace().collect();
    assert_eq!(
        &row[..7],
        [
            "lan",
            "NAT",
            "10.77.0.0/24",
            "10.77.0.1",
            "hth-lan",
            "1",
            "Ready"
        ],
        "{table}"
    );

    // A stopped VM claims no interface: nothing is attached.
    let web = d.wait_object("virtualmachines", "web", "stopped", WAIT, |v| {
        v["status"]["phase"] == "Stopped"
    });
    assert!(web["status"].get("interfaces").is_none(), "{web}");

    // Bad input: refused with the field and the other holder; nothing changes.
    let overlap = manifest(&d, "dmz.yaml", &net("dmz", "10.77.0.128/25"));
    let e = d.cli_err(&["apply", "-f", overlap.to_str().expect("utf8")]);
    assert!(
        e.contains("VirtualNetwork \"dmz\": spec.subnet: 10.77.0.128/25 overlaps 10.77.0.0/24 of VirtualNetwork \"lan\""),
        "{e}"
    );
    let port = manifest(
        &d,
        "db.yaml",
        &vm(
            &kernel,
            "db",
            "[{virtualNetworkName: lan, ports: [{hostPort: 2222, guestPort: 22}]}]",
        ),
    );
    let e = d.cli_err(&["apply", "-f", port.to_str().expect("utf8")]);
    assert!(
        e.contains("host TCP port 2222 is already forwarded to VirtualMachine \"web\""),
        "{e}"
    );
    let mac = manifest(
        &d,
        "mc.yaml",
        &vm(
            &kernel,
            "mc",
            "[{virtualNetworkName: lan, macAddress: \"03:00:00:00:00:01\"}]",
        ),
    );
    let e = d.cli_err(&["apply", "-f", mac.to_str().expect("utf8")]);
    assert!(
        e.contains("spec.networks[0].macAddress") && e.contains("multicast"),
        "{e}"
    );
    let e = d.cli_err(&["delete", "network", "lan"]);
    assert!(e.contains("in use by VirtualMachine \"web\""), "{e}");
    let names = d.cli_ok(&["get", "networks", "-o", "json"]);
    assert!(!names.contains("\"dmz\""), "{names}");
    let vms = d.cli_ok(&["get", "vms", "-o", "json"]);
    assert!(!vms.contains("\"db\"") && !vms.contains("\"mc\""), "{vms}");

    // A crash and a restart: the lease is still there, and counted with a
    // new VM's once the restarted daemon reconciles the network.
    d.kill();
    d.spawn();
    let db = manifest(
        &d,
        "db2.yaml",
        &vm(&kernel, "db", "[{virtualNetworkName: lan}]"),
    );
    d.cli_ok(&["apply", "-f", db.to_str().expect("utf8")]);
    d.wait_object(
        "virtualnetworks",
        "lan",
        "two leases after the restart",
        WAIT,
        |v| v["status"]["leases"] == 2,
    );

    // Deleting the VMs frees the network, which then goes.
    d.cli_ok(&["delete", "vm", "web"]);
    d.cli_ok(&["delete", "vm", "db"]);
    d.wait_gone("virtualmachines", "web", WAIT);
    d.wait_gone("virtualmachines", "db", WAIT);
    d.cli_ok(&["delete", "network", "lan"]);
    d.wait_gone("virtualnetworks", "lan", WAIT);
    let ns = d.netns.as_ref().unwrap();
    assert!(ns.hearth_links().is_empty(), "{:?}", ns.hearth_links());
    assert!(
        !ns.exec_ok("nft", &["list", "tables"]).contains("hearth"),
        "the nftables table is left"
    );
    let pids = ns.pids();
    let hearthd = d.child.as_ref().map(|c| c.id());
    assert!(
        pids.iter().all(|p| Some(*p) == hearthd),
        "processes other than hearthd left in the namespace: {pids:?}"
    );
}

/// The netlink requests `pid`'s threads (and the children they start, such
/// as `nft`) make while `during` runs, as strace shows them: the kernel's
/// side of the host networking hearthd reads and changes. `None` when
/// `during` or strace's detach did not end within `STUCK`: `strace -f`
/// attached to a running process can leave a thread that vforks, and its
/// child, stopped for good (seen in CI: hearthd stopped 25 minutes, until
/// strace was killed; and here, once in four runs, in the detach). strace
/// is then killed, which frees hearthd, and the trace is void.
fn netlink_requests(pid: u32, during: impl FnOnce()) -> Option<String> {
    const STUCK: Duration = Duration::from_secs(8);
    let out = tempfile::NamedTempFile::new().expect("tempfile");
    let mut strace = std::process::Command::new("strace")
        .args(["-f", "-qq", "-e", "trace=sendto,sendmsg", "-o"])
        .arg(out.path())
        .args(["-p", &pid.to_string()])
        .spawn()
        .expect("strace (apt-get install strace)");
    // Attached once every thread of hearthd is traced.
    let traced = eventually(WAIT, || {
        hearth_test_support::process::all_threads_traced(pid)
    });
    assert!(traced, "strace did not attach to every thread of hearthd");
    let (done, ended) = std::sync::mpsc::channel::<()>();
    let tracer = strace.id().to_string();
    let watchdog = std::thread::spawn(move || {
        let stuck = ended.recv_timeout(STUCK).is_err();
        if stuck {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &tracer])
                .status();
        }
        stuck
    });
    during();
    let _ = done.send(());
    if watchdog.join().expect("the watchdog") {
        let _ = strace.wait();
        return None;
    }
    // SIGINT: strace detaches and leaves hearthd running. A strace caught
    // in the same deadlock never ends its detach: killed, which frees
    // hearthd, and the trace is void.
    let _ = std::process::Command::new("kill")
        .args(["-INT", &strace.id().to_string()])
        .status();
    let detached = eventually(STUCK, || matches!(strace.try_wait(), Ok(Some(_))));
    if !detached {
        let _ = strace.kill();
        let _ = strace.wait();
        return None;
    }
    let requests = std::fs::read_to_string(out.path())
        .expect("strace's output")
        .lines()
        .filter(|l| l.contains("nlmsg_type="))
        .collect::<Vec<_>>()
        .join("\n");
    Some(requests)
}

/// [`netlink_requests`] of a new `edit` each time, until a trace is whole
/// (three tries).
fn netlink_requests_of(pid: u32, mut edit: impl FnMut()) -> String {
    for _ in 0..3 {
        if let Some(requests) = netlink_requests(pid, &mut edit) {
            return requests;
        }
    }
    panic!("strace left hearthd stopped in three traces of three");
}

/// An edit of a VM that leaves its interfaces as they were (its CPUs) does no
/// network work: hearthd asks the kernel about no link while it applies and
/// reconciles it (a network reconcile lists every link on the host, so each
/// such edit cost more with every VM). An edit of its interfaces does.
#[test]
fn a_vm_edit_that_keeps_its_interfaces_asks_the_kernel_about_no_link() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let kernel = images.path().join("vmlinuz");
    std::fs::write(&kernel, b"never booted").expect("kernel");
    // No periodic resync inside the test's windows.
    let d = Daemon::start_in_netns(
        &[images.path()],
        &["--accel", "tcg", "--resync-seconds", "3600"],
    );
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    let lan = manifest(&d, "lan.yaml", &net("lan", "10.77.0.0/24"));
    d.cli_ok(&["apply", "-f", lan.to_str().expect("utf8")]);
    let apply = |cpus: u32, networks: &str| {
        let text = vm(&kernel, "web", networks).replace(
            "  runPolicy: AlwaysOff\n",
            &format!("  runPolicy: AlwaysOff\n  cpus: {cpus}\n"),
        );
        let m = manifest(&d, "web.yaml", &text);
        d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    };
    let reconciled = |generation: u64| {
        d.wait_object("virtualmachines", "web", "reconciled", WAIT, |v| {
            v["status"]["observedGeneration"] == generation
        });
    };
    apply(1, "[{virtualNetworkName: lan}]");
    d.wait_object("virtualnetworks", "lan", "one lease", WAIT, |v| {
        v["status"]["leases"] == 1 && v["status"]["phase"] == "Ready"
    });
    reconciled(1);
    let settle = || std::thread::sleep(Duration::from_millis(500));
    settle();

    // Each try is a new edit: its generation, its CPUs, its address.
    let generation = std::cell::Cell::new(1);
    let cpus = std::cell::Cell::new(1);
    let cpus_only = netlink_requests_of(hearthd, || {
        cpus.set(cpus.get() + 1);
        generation.set(generation.get() + 1);
        apply(cpus.get(), "[{virtualNetworkName: lan}]");
        reconciled(generation.get());
        settle();
    });
    assert!(
        cpus_only.is_empty(),
        "a CPU edit made netlink requests:\n{cpus_only}"
    );
    assert_eq!(d.get_vm("web").expect("web")["spec"]["cpus"], cpus.get());

    let address = std::cell::Cell::new(49);
    let interfaces = netlink_requests_of(hearthd, || {
        address.set(address.get() + 1);
        generation.set(generation.get() + 1);
        let networks = format!(
            "[{{virtualNetworkName: lan, ipAddress: 10.77.0.{}}}]",
            address.get()
        );
        apply(cpus.get(), &networks);
        reconciled(generation.get());
        d.wait_object(
            "virtualnetworks",
            "lan",
            "the reserved address",
            WAIT,
            |v| v["status"]["leases"] == 1,
        );
        settle();
    });
    // RTM_GETLINK (18), as this strace shows it or by number.
    assert!(
        interfaces.contains("RTM_GETLINK") || interfaces.contains("nlmsg_type=0x12 "),
        "an interface edit listed no link:\n{interfaces}"
    );
}
