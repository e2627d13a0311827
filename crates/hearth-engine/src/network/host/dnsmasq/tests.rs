use super::*;

#[test]
fn a_released_or_moved_host_line_is_told_from_an_added_one() {
    let old = "02:00:00:00:00:01,10.77.0.10,a\n02:00:00:00:00:02,10.77.0.11,b\n";
    let added = format!("{old}02:00:00:00:00:03,10.77.0.12,c\n");
    assert!(!released_hosts(old, &added));
    assert!(!released_hosts("", old));
    assert!(released_hosts(old, "02:00:00:00:00:01,10.77.0.10,a\n"));
    // b's address now belongs to d's MAC.
    assert!(released_hosts(
        old,
        "02:00:00:00:00:01,10.77.0.10,a\n02:00:00:00:00:04,10.77.0.11,d\n"
    ));
}
use crate::network::host::{Mac, StaticLease};
use std::net::Ipv4Addr;

fn loaded(conf: &str, hosts: &str) -> Loaded {
    Loaded {
        conf: conf.into(),
        hosts: hosts.into(),
    }
}

#[test]
fn the_decision_comes_from_what_this_process_read_not_from_the_files() {
    let p = ProcId {
        pid: 10,
        start_ticks: 500,
    };
    let a = "02:00:00:00:00:01,10.77.0.10,a\n";
    let ab = "02:00:00:00:00:01,10.77.0.10,a\n02:00:00:00:00:02,10.77.0.11,b\n";
    let record = |hosts: &str, offered: &str| LoadedRecord {
        process: p,
        loaded: loaded("c", hosts),
        offered: offered.into(),
    };
    assert_eq!(decide(None, None, &loaded("c", a)), Action::Start);
    assert_eq!(
        decide(None, Some(&record(a, a)), &loaded("c", a)),
        Action::Start
    );
    // No record, or one of another process (the pid reused): unknown.
    assert_eq!(decide(Some(p), None, &loaded("c", a)), Action::Restart);
    let reused = ProcId {
        start_ticks: 900,
        ..p
    };
    assert_eq!(
        decide(Some(reused), Some(&record(a, a)), &loaded("c", a)),
        Action::Restart
    );
    assert_eq!(
        decide(Some(p), Some(&record(a, a)), &loaded("c", a)),
        Action::Keep
    );
    assert_eq!(
        decide(Some(p), Some(&record(a, a)), &loaded("c", ab)),
        Action::Reload,
        "a line added"
    );
    assert_eq!(
        decide(Some(p), Some(&record(ab, ab)), &loaded("c", a)),
        Action::Restart,
        "a line released"
    );
    assert_eq!(
        decide(Some(p), Some(&record(a, a)), &loaded("other", a)),
        Action::Restart,
        "the config changed"
    );
    // b's line was offered to it by a SIGHUP whose reread was never
    // confirmed: it may have handed b's address out.
    assert_eq!(
        decide(Some(p), Some(&record(a, ab)), &loaded("c", a)),
        Action::Restart
    );
}

#[test]
fn the_record_offers_before_the_signal_and_loads_after_the_reread() {
    let p = ProcId {
        pid: 10,
        start_ticks: 500,
    };
    let before = LoadedRecord {
        process: p,
        loaded: loaded("c", "x\n"),
        offered: "w\nx\n".into(),
    };
    let want = loaded("c", "x\ny\n");
    let offered = record_after(Step::Offer, Some(&before), p, &want).unwrap();
    assert_eq!(offered.loaded, before.loaded, "not read yet");
    assert_eq!(offered.offered, "w\nx\ny\n");
    let read = record_after(Step::Record, Some(&offered), p, &want).unwrap();
    assert_eq!(read.loaded, want);
    assert_eq!(read.offered, "w\nx\ny\n");
    // A new process has read only what it was started on.
    let fresh = ProcId {
        pid: 11,
        start_ticks: 600,
    };
    let started = record_after(Step::Record, Some(&read), fresh, &want).unwrap();
    assert_eq!(started.process, fresh);
    assert_eq!(started.offered, "x\ny\n");
    assert_eq!(record_after(Step::Offer, Some(&read), fresh, &want), None);
    assert_eq!(record_after(Step::Signal, Some(&read), p, &want), None);
}

#[test]
fn a_reread_is_the_process_own_read_line() {
    let hosts = Path::new("/run/hearth/networks/hth-lan/hosts");
    let log = "Dec  2 04:50:31 dnsmasq-dhcp[11847]: DHCP, sockets bound exclusively to interface br-t\n\
                   Dec  2 04:50:32 dnsmasq-dhcp[11847]: read /run/hearth/networks/hth-lan/hosts\n";
    assert!(logged_reread(log, 11847, hosts));
    assert!(!logged_reread(log, 11848, hosts), "another process");
    let failed = "Dec  2 04:50:32 dnsmasq-dhcp[11847]: cannot read /run/hearth/networks/hth-lan/hosts: Permission denied\n";
    assert!(!logged_reread(failed, 11847, hosts));
}

fn net() -> HostNetwork {
    HostNetwork {
        bridge: "hth-0".into(),
        gateway: Ipv4Addr::new(10, 77, 0, 1),
        prefix_len: 24,
        mode: NetworkMode::Nat,
        dhcp: true,
        dns: Dns::Off,
        static_leases: vec![
            StaticLease {
                mac: Mac([0x52, 0x54, 0, 0, 0, 2]),
                ip: Ipv4Addr::new(10, 77, 0, 11),
                hostname: "b".into(),
            },
            StaticLease {
                mac: Mac([0x52, 0x54, 0, 0, 0, 1]),
                ip: Ipv4Addr::new(10, 77, 0, 10),
                hostname: "a".into(),
            },
        ],
        port_forwards: vec![],
    }
}

#[test]
fn config_is_static_only_on_the_bridge_without_dns() {
    let files = DnsmasqFiles::new("/var/lib/hearth/networks/hth-0");
    assert_eq!(
        render_config(&net(), &files),
        "# hearth: dnsmasq of network bridge hth-0 (generated, rewritten on every resync)\n\
             no-resolv\nno-hosts\nport=0\nbind-interfaces\ninterface=hth-0\nexcept-interface=lo\n\
             dhcp-range=10.77.0.0,static,255.255.255.0,1h\n\
             dhcp-hostsfile=/var/lib/hearth/networks/hth-0/hosts\n\
             dhcp-leasefile=/var/lib/hearth/networks/hth-0/leases\n\
             pid-file=/var/lib/hearth/networks/hth-0/dnsmasq.pid\n\
             log-facility=/var/lib/hearth/networks/hth-0/dnsmasq.log\n\
             dhcp-authoritative\n\
             dhcp-option=option:router,10.77.0.1\n"
    );
    let mut iso = net();
    iso.mode = NetworkMode::Isolated;
    assert!(render_config(&iso, &files).ends_with("dhcp-option=3\n"));
}

#[test]
fn dns_answers_the_vms_and_forwards_only_on_nat() {
    let files = DnsmasqFiles::new("/var/lib/hearth/networks/hth-0");
    let lines = |dns: Dns| {
        let mut n = net();
        n.dns = dns;
        render_config(&n, &files)
            .lines()
            .skip(1)
            .take(4)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        lines(Dns::Forward("/etc/resolv.conf".into())),
        "resolv-file=/etc/resolv.conf no-hosts domain-needed bogus-priv"
    );
    assert_eq!(
        lines(Dns::Local),
        "no-resolv no-hosts domain-needed bogus-priv"
    );
    for dns in [Dns::Local, Dns::Forward("/r".into())] {
        let mut n = net();
        n.dns = dns;
        let text = render_config(&n, &files);
        assert!(!text.contains("port="), "{text}");
        assert!(
            text.contains("interface=hth-0\nexcept-interface=lo\n"),
            "{text}"
        );
    }
}

#[test]
fn hosts_are_sorted_mac_ip_name_lines() {
    assert_eq!(
        render_hosts(&net().static_leases),
        "52:54:00:00:00:01,10.77.0.10,a\n52:54:00:00:00:02,10.77.0.11,b\n"
    );
    assert_eq!(render_hosts(&[]), "");
}

#[test]
fn write_if_changed_writes_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("hosts");
    assert!(write_if_changed(&p, "x\n").unwrap());
    assert!(!write_if_changed(&p, "x\n").unwrap());
    assert!(write_if_changed(&p, "y\n").unwrap());
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "y\n");
    let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644);
}

#[test]
fn a_directory_closed_to_others_is_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("networks").join("hth-0");
    std::fs::create_dir_all(&net_dir).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let e = check_reachable(&net_dir).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{} has mode 0700", dir.path().display())),
        "{e}"
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    check_reachable(&net_dir).unwrap();
}

#[test]
fn a_pid_file_naming_another_process_is_not_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let files = DnsmasqFiles::new(dir.path());
    // This test process is alive but is not dnsmasq.
    std::fs::write(files.pid(), format!("{}\n", std::process::id())).unwrap();
    assert!(observe(&files).is_none());
    std::fs::write(files.pid(), "not a pid\n").unwrap();
    assert!(observe(&files).is_none());
}
