//! Benchmark (not a test): how long a VM on a hearth network takes from its
//! start to holding its DHCP lease.
//!
//! A hearthd inside a network namespace of its own
//! ([`Daemon::start_in_netns`]) with one NAT network. Per guest, the first
//! run is timed from the `POST /v1/apply` of an AlwaysOn VM with a NIC on
//! the network, every later one from `hearth restart`; each run records,
//! polling every 20 ms:
//! - start → Running: the request until the VM's status shows Running with a
//!   new QEMU pid; and the request until the `Started` event of that pid
//!   (hearthd's own clock, so no polling in it);
//! - Started → lease on the console: until the guest prints its lease line
//!   (`hearth-guest: eth0 lease IP/PREFIX ...`, the small guest's udhcpc
//!   hook), with the leased address in it;
//! - Started → confirmed: until `status.interfaces[0].confirmed` is true
//!   (hearthd asks the agent every 2 s until it is).
//!
//! The small test guest (kernel boot) always; the Debian image
//! (cloud-init DHCP, its `ci-info` table on the console shows the address)
//! unless `HEARTH_BENCH_DEBIAN_RUNS=0`. `HEARTH_BENCH_RUNS` (small guest,
//! default 5) and `HEARTH_BENCH_DEBIAN_RUNS` (default 3) runs. Prints
//! markdown tables for docs/benchmarks.md. Every packet stays inside the
//! namespace (DHCP between the guest and hearth's dnsmasq).
//! Run: `cargo bench -p hearthd --bench network_lease`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{loadavg, stats};

use std::path::Path;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::debian::*;
use common::*;
use serde_json::{Value, json};

const SUBNET: &str = "10.79.0.0/24";
const DEBIAN_SUBNET: &str = "10.80.0.0/24";
const POLL: Duration = Duration::from_millis(20);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One run; every time in ms.
struct Sample {
    to_running: f64,
    to_started_event: f64,
    started_to_lease: Option<f64>,
    started_to_agent: Option<f64>,
    started_to_confirmed: f64,
    load: String,
}

/// Where the moment the guest got its lease is seen.
#[derive(Clone, Copy, PartialEq)]
enum LeaseSeen {
    /// `hearth-guest: eth0 lease IP/...` on the console (the small guest's
    /// udhcpc hook), found by polling the console file.
    Console,
    /// systemd-networkd's `DHCPv4 address IP/...` in the guest's journal,
    /// read through the agent once the address is confirmed: its monotonic
    /// time against the guest's uptime then gives the host time.
    Journal,
}

impl LeaseSeen {
    fn label(self) -> &'static str {
        match self {
            LeaseSeen::Console => "lease on the console",
            LeaseSeen::Journal => "lease in the journal",
        }
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "network_lease: a benchmark; run it with `cargo bench -p hearthd --bench network_lease`"
        );
        return;
    }
    let runs = env_or("HEARTH_BENCH_RUNS", 5).max(1);
    let debian_runs = env_or("HEARTH_BENCH_DEBIAN_RUNS", 3);
    let bench_t0 = Instant::now();
    let started = Utc::now();
    let guest = guest_dir();
    let d = Daemon::start_in_netns(&[&guest], &[]);
    let (s, v) = d.apply_json(vec![json!({"apiVersion": "hearth.dev/v1alpha1",
        "kind": "VirtualNetwork", "metadata": {"name": "lan"},
        "spec": {"mode": "NAT", "subnet": SUBNET}})]);
    assert_eq!(s, 200, "apply: {v}");
    d.wait_object(
        "virtualnetworks",
        "lan",
        "Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );

    let small_vm = json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
        "metadata": {"name": "small"},
        "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "256Mi",
                 "stopTimeoutSeconds": 10,
                 "boot": {"kernel": guest.join("vmlinuz"), "initrd": guest.join("initrd.img"),
                          "cmdline": "console=ttyS0 quiet panic=-1"},
                 "disks": [],
                 "networks": [{"virtualNetworkName": "lan"}]}});
    let small = measure(
        &d,
        "small",
        vec![small_vm],
        runs,
        LeaseSeen::Console,
        BOOT_TIMEOUT,
    );
    delete_vm(&d, "small");

    let mut debian = Vec::new();
    if debian_runs > 0 {
        let (image, _) = debian_image();
        // A network of its own: the small guest's address, freed by its
        // deletion, would be handed to this VM's MAC while dnsmasq still
        // holds the old lease for it (see docs/benchmarks.md).
        let items = [
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
                   "metadata": {"name": "debian-12"},
                   "spec": {"source": {"file": image.display().to_string()}}}),
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualNetwork",
                   "metadata": {"name": "deb-lan"},
                   "spec": {"mode": "NAT", "subnet": DEBIAN_SUBNET}}),
            image_disk("deb-root", "debian-12", None),
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
                   "metadata": {"name": "deb"},
                   "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "768Mi",
                            "stopTimeoutSeconds": 60,
                            "disks": [{"virtualDiskName": "deb-root"}],
                            "networks": [{"virtualNetworkName": "deb-lan"}],
                            "cloudInit": {"userData": "#cloud-config\n{}\n"}}}),
        ];
        // The image and the network are Ready before the clock starts: an
        // import is not part of a start.
        let (s, v) = d.apply_json(items[..2].to_vec());
        assert_eq!(s, 200, "apply: {v}");
        for (plural, name) in [
            ("virtualimages", "debian-12"),
            ("virtualnetworks", "deb-lan"),
        ] {
            d.wait_object(plural, name, "Ready", Duration::from_secs(120), |v| {
                v["status"]["phase"] == "Ready"
            });
        }
        debian = measure(
            &d,
            "deb",
            items[2..].to_vec(),
            debian_runs,
            LeaseSeen::Journal,
            DEBIAN_BOOT_TIMEOUT,
        );
        delete_vm(&d, "deb");
    }
    drop(d);
    let took = bench_t0.elapsed();

    println!();
    println!(
        "network_lease: {started}; the whole bench took {:.0} s",
        took.as_secs_f64()
    );
    print_table(
        "small test guest (kernel boot, busybox udhcpc)",
        LeaseSeen::Console,
        &small,
    );
    if !debian.is_empty() {
        print_table(
            "Debian 12 (cloud-init, systemd-networkd DHCP)",
            LeaseSeen::Journal,
            &debian,
        );
    }
}

/// Applies `items` (the VM last) and times the start; then `runs - 1`
/// restarts.
fn measure(
    d: &Daemon,
    vm: &str,
    items: Vec<Value>,
    runs: usize,
    lease: LeaseSeen,
    timeout: Duration,
) -> Vec<Sample> {
    let mut out = Vec::new();
    for i in 0..runs {
        let old_pid = d.get_vm(vm).and_then(|v| v["status"]["pid"].as_u64());
        let load = loadavg();
        let wall0 = Utc::now();
        let t0 = Instant::now();
        if i == 0 {
            let (s, v) = d.apply_json(items.clone());
            assert_eq!(s, 200, "apply: {v}");
        } else {
            d.cli_ok(&["restart", vm]);
        }
        let sample = observe(d, vm, old_pid, wall0, t0, lease, timeout, load);
        eprintln!(
            "network_lease: {vm} run {}: {} → Running {:.0} ms (Started event {:.0} ms), \
             Started → lease {}, → agent {}, → confirmed {:.0} ms",
            i + 1,
            if i == 0 { "apply" } else { "restart" },
            sample.to_running,
            sample.to_started_event,
            sample
                .started_to_lease
                .map_or("not seen".to_string(), |ms| format!("{ms:.0} ms")),
            sample
                .started_to_agent
                .map_or("not seen".to_string(), |ms| format!("{ms:.0} ms")),
            sample.started_to_confirmed
        );
        out.push(sample);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn observe(
    d: &Daemon,
    vm: &str,
    old_pid: Option<u64>,
    wall0: DateTime<Utc>,
    t0: Instant,
    lease: LeaseSeen,
    timeout: Duration,
    load: String,
) -> Sample {
    let deadline = t0 + timeout;
    let serial = serial_log(d, vm);
    let mut running: Option<(Duration, u64)> = None;
    let mut lease_at: Option<DateTime<Utc>> = None;
    let mut confirmed_at: Option<DateTime<Utc>> = None;
    let mut last = Value::Null;
    loop {
        if let Some(v) = d.get_vm(vm) {
            let pid = v["status"]["pid"].as_u64();
            if running.is_none() && v["status"]["phase"] == "Running" && pid != old_pid {
                running = Some((t0.elapsed(), pid.expect("a Running VM has a pid")));
            }
            if let Some((_, pid_now)) = running {
                assert_eq!(
                    pid,
                    Some(pid_now),
                    "{vm}: QEMU replaced during the run: {v:#}"
                );
                let ip = v["status"]["interfaces"][0]["ipAddress"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let marker = format!("hearth-guest: eth0 lease {ip}/");
                if lease == LeaseSeen::Console
                    && lease_at.is_none()
                    && !ip.is_empty()
                    && read_lossy(&serial).contains(&marker)
                {
                    lease_at = Some(Utc::now());
                }
                if confirmed_at.is_none() && v["status"]["interfaces"][0]["confirmed"] == true {
                    confirmed_at = Some(Utc::now());
                }
            }
            last = v;
        }
        if running.is_some() && confirmed_at.is_some() {
            if lease == LeaseSeen::Journal {
                let ip = last["status"]["interfaces"][0]["ipAddress"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                lease_at = journal_lease(d, vm, &ip);
                break;
            }
            // The console line comes before the agent's answer; a few
            // seconds more in case it did not.
            if lease_at.is_some()
                || confirmed_at.is_some_and(|c| (Utc::now() - c).num_seconds() >= 5)
            {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{vm}: not running with a confirmed lease after {timeout:?}; last: {last:#}\nconsole:\n{}\nlog:\n{}",
            read_lossy(&serial),
            d.log()
        );
        std::thread::sleep(POLL);
    }
    let (to_running, pid) = running.expect("running");
    let started_at = started_event(d, vm, pid);
    let agent_at = event_after(d, vm, "AgentConnected", started_at);
    let ms =
        |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_microseconds().unwrap_or(0) as f64 / 1e3;
    Sample {
        to_running: to_running.as_secs_f64() * 1e3,
        to_started_event: ms(wall0, started_at),
        started_to_lease: lease_at.map(|c| ms(started_at, c)),
        started_to_agent: agent_at.map(|a| ms(started_at, a)),
        started_to_confirmed: ms(started_at, confirmed_at.expect("confirmed")),
        load,
    }
}

/// When the guest's systemd-networkd got `ip`, in host time: its journal's
/// monotonic stamp of `DHCPv4 address IP/...` set against the guest's
/// uptime at the moment of asking (the middle of the agent call).
fn journal_lease(d: &Daemon, vm: &str, ip: &str) -> Option<DateTime<Utc>> {
    let before = Utc::now();
    let (code, out) = d.agent_sh(
        vm,
        &format!(
            "cut -d' ' -f1 /proc/uptime; journalctl -b -o short-monotonic --no-pager | grep -m1 -F 'DHCPv4 address {ip}/'"
        ),
    );
    let after = Utc::now();
    if code != 0 {
        eprintln!("network_lease: {vm}: no DHCPv4 line for {ip} in the journal: {out}");
        return None;
    }
    let mut lines = out.lines();
    let uptime: f64 = lines.next()?.trim().parse().ok()?;
    let line = lines.next()?;
    let stamp: f64 = line
        .trim_start()
        .strip_prefix('[')?
        .split(']')
        .next()?
        .trim()
        .parse()
        .ok()?;
    let asked = before + (after - before) / 2;
    let ago = chrono::Duration::microseconds(((uptime - stamp) * 1e6) as i64);
    Some(asked - ago)
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn event_time(e: &Value) -> Option<DateTime<Utc>> {
    e["time"]
        .as_str()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// The time of the `Started` event of QEMU `pid` (hearthd's clock).
fn started_event(d: &Daemon, vm: &str, pid: u64) -> DateTime<Utc> {
    let marker = format!("(pid {pid})");
    let events = d.events("VirtualMachine", vm);
    let e = events
        .iter()
        .find(|e| {
            e["reason"] == "Started" && e["message"].as_str().is_some_and(|m| m.contains(&marker))
        })
        .unwrap_or_else(|| panic!("{vm}: no Started event for pid {pid}: {events:#?}"));
    event_time(e).unwrap_or_else(|| panic!("{vm}: Started event without a time: {e}"))
}

/// The first `reason` event of `vm` at or after `after`.
fn event_after(d: &Daemon, vm: &str, reason: &str, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
    d.events("VirtualMachine", vm)
        .iter()
        .filter(|e| e["reason"] == reason)
        .filter_map(event_time)
        .filter(|t| *t >= after)
        .min()
}

fn delete_vm(d: &Daemon, vm: &str) {
    let (s, v) = d.request("DELETE", &format!("/v1/virtualmachines/{vm}"), None);
    assert_eq!(s, 200, "delete {vm}: {v}");
    d.wait_gone("virtualmachines", vm, Duration::from_secs(120));
    wait_until(
        &format!("{vm}'s QEMU gone"),
        Duration::from_secs(60),
        || d.qemu_pids_of(vm).is_empty(),
    );
}

fn print_table(what: &str, lease: LeaseSeen, samples: &[Sample]) {
    let col =
        |f: &dyn Fn(&Sample) -> Option<f64>| -> Vec<f64> { samples.iter().filter_map(f).collect() };
    let cell = |x: Option<f64>| x.map_or("not seen".to_string(), |v| format!("{v:.0}"));
    println!();
    println!("{what}:");
    println!();
    println!(
        "| run | start | start → Running, polled (ms) | start → Started event (ms) | Started → {} (ms) | Started → AgentConnected event (ms) | Started → confirmed by the agent (ms) | load |",
        lease.label()
    );
    println!("|---|---|---:|---:|---:|---:|---:|---|");
    for (i, s) in samples.iter().enumerate() {
        println!(
            "| {} | {} | {:.0} | {:.0} | {} | {} | {:.0} | {} |",
            i + 1,
            if i == 0 { "apply" } else { "restart" },
            s.to_running,
            s.to_started_event,
            cell(s.started_to_lease),
            cell(s.started_to_agent),
            s.started_to_confirmed,
            s.load
        );
    }
    println!();
    println!("| | median (ms) | min–max (ms) | runs |");
    println!("|---|---:|---:|---:|");
    for (name, xs) in [
        (
            "apply → Started event".to_string(),
            samples.iter().take(1).map(|s| s.to_started_event).collect(),
        ),
        (
            "restart → Started event (the stop included)".to_string(),
            samples.iter().skip(1).map(|s| s.to_started_event).collect(),
        ),
        (
            format!("Started → {}", lease.label()),
            col(&|s| s.started_to_lease),
        ),
        (
            "Started → AgentConnected event".to_string(),
            col(&|s| s.started_to_agent),
        ),
        (
            "Started → confirmed by the agent".to_string(),
            col(&|s| Some(s.started_to_confirmed)),
        ),
    ] {
        if xs.is_empty() {
            println!("| {name} | not seen | | 0 |");
            continue;
        }
        let (m, lo, hi) = stats(&xs);
        println!("| {name} | {m:.0} | {lo:.0}–{hi:.0} | {} |", xs.len());
    }
}
