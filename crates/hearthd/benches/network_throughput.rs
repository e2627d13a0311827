//! Benchmark (not a test): TCP throughput between two Debian guests on one
//! hearth network, against the same two guests on a bridge and taps made by
//! hand, in the same run on the same machine.
//!
//! - hearth: a hearthd inside a network namespace of its own
//!   ([`Daemon::start_in_netns`]), a NAT network, a VirtualImage from
//!   guest/out/debian-12.qcow2 and two AlwaysOn VMs (1 vCPU, 768 MiB) with a
//!   disk each from that image and a NIC on the network; once the agent has
//!   confirmed both addresses, `iperf3 -s -D` runs in one guest and
//!   `iperf3 -c IP -t SECONDS -J` in the other, both through hearth's
//!   agent exec.
//! - plain: a second namespace made here (`hth-bench-PID-N`, deleted on
//!   the way out, also on failure), a bridge with an address, two taps made
//!   with `ip tuntap add ... mode tap vnet_hdr` (the flags hearth's taps
//!   have) on it, a dnsmasq started by hand with a static lease for each
//!   MAC, and two QEMUs started by hand with the settings hearth's command
//!   line has (TCG, `-cpu max`, q35, the same vCPUs and memory, virtio-blk,
//!   a JSON tap netdev with `script=no` and the `vhost` value read back
//!   from hearth's own QEMU, virtio-net-pci with the same MAC and no option
//!   ROM): fresh qcow2 overlays over the stored image and the very seeds
//!   hearth wrote (DHCP matched by MAC). iperf3 runs the same way, through
//!   qemu-ga on each QEMU's agent socket (`hearth_qemu::agent`).
//!
//! Both pairs stay up and the iperf3 runs alternate between them (hearth
//! first in odd runs, plain first in even ones): the pair not measured is
//! idle. Measuring starts once systemd says every guest's boot is over and
//! each pair has had one unrecorded 3 s run.
//!
//! Every packet stays inside the two namespaces: guest to guest, and DHCP
//! between the guests and their namespace's dnsmasq.
//!
//! `HEARTH_BENCH_RUNS` (default 3) iperf3 runs each of `HEARTH_BENCH_SECONDS`
//! (default 10). Prints a markdown table for docs/benchmarks.md.
//! Run: `cargo bench -p hearthd --bench network_throughput`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{all_qemus, loadavg, stats};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::debian::*;
use common::netns::Netns;
use common::*;
use hearth_qemu::agent::AgentClient;
use serde_json::{Value, json};

const VMS: [&str; 2] = ["a", "b"];
const CPUS: u32 = 1;
const MEMORY_MIB: u32 = 768;
/// Each side's network; the plain one gets its own so no address is shared
/// even by accident.
const HEARTH_SUBNET: &str = "10.77.0.0/24";
const PLAIN_GATEWAY: &str = "10.88.0.1";
const PLAIN_IPS: [&str; 2] = ["10.88.0.10", "10.88.0.11"];
const PLAIN_BRIDGE: &str = "br-plain";
const PLAIN_TAPS: [&str; 2] = ["tap-plain-0", "tap-plain-1"];
const IPERF_PORT: &str = "5201";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "network_throughput: a benchmark; run it with `cargo bench -p hearthd --bench network_throughput`"
        );
        return;
    }
    let runs = env_or("HEARTH_BENCH_RUNS", 3).max(1) as usize;
    // hearth's agent exec runs for at most 120 s here (the harness's read
    // timeout): the client's run and a minute of margin fit.
    let seconds = env_or("HEARTH_BENCH_SECONDS", 10).clamp(1, 60);
    let started = chrono::Utc::now();
    let bench_t0 = Instant::now();
    // Other people's VMs on the machine when the bench starts.
    let other_qemus = all_qemus();
    let (image, _) = debian_image();
    let image_dir = image.parent().expect("guest/out").to_path_buf();
    let scratch = tempfile::Builder::new()
        .prefix("hearth-netbench-")
        .tempdir()
        .expect("scratch dir");

    // --- hearth ---
    let d = Daemon::start_in_netns(&[&image_dir], &[]);
    let mut items = vec![
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualNetwork",
               "metadata": {"name": "lan"}, "spec": {"mode": "NAT", "subnet": HEARTH_SUBNET}}),
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
               "metadata": {"name": "debian-12"},
               "spec": {"source": {"file": image.display().to_string()}}}),
    ];
    for vm in VMS {
        items.push(image_disk(&format!("{vm}-root"), "debian-12", None));
        items.push(
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
               "metadata": {"name": vm},
               "spec": {"runPolicy": "AlwaysOn", "cpus": CPUS,
                        "memory": format!("{MEMORY_MIB}Mi"), "stopTimeoutSeconds": 30,
                        "disks": [{"virtualDiskName": format!("{vm}-root")}],
                        "networks": [{"virtualNetworkName": "lan"}],
                        "cloudInit": {"userData": "#cloud-config\n{}\n"},
                        "guestAgent": true}}),
        );
    }
    let (status, v) = d.apply_json(items);
    assert_eq!(status, 200, "apply: {v}");
    let boot_t0 = Instant::now();
    let mut ips = Vec::new();
    let mut macs = Vec::new();
    for vm in VMS {
        let v = d.wait_object(
            "virtualmachines",
            vm,
            "its address confirmed by the agent",
            DEBIAN_BOOT_TIMEOUT,
            |v| v["status"]["interfaces"][0]["confirmed"] == true,
        );
        ips.push(str_at(&v, "/status/interfaces/0/ipAddress"));
        macs.push(str_at(&v, "/status/interfaces/0/mac"));
    }
    eprintln!(
        "network_throughput: hearth: both addresses confirmed after {:.0} s: {ips:?}",
        boot_t0.elapsed().as_secs_f64()
    );
    let img = d.get_image("debian-12").expect("image");
    let stored = PathBuf::from(str_at(&img, "/status/path"));
    // What hearth gave QEMU, read back from the process: the plain QEMUs
    // use the same data path.
    let netdev = hearth_netdev(&d, VMS[0]);
    let vhost = netdev["vhost"].as_bool().expect("netdev vhost");
    assert_eq!(netdev["script"], "no", "{netdev}");
    let seeds: Vec<PathBuf> = VMS
        .iter()
        .map(|vm| {
            let kept = scratch.path().join(format!("{vm}-seed.img"));
            std::fs::copy(d.state_dir().join("vms").join(vm).join("cidata.img"), &kept)
                .expect("copy hearth's seed");
            kept
        })
        .collect();
    let hearth_nf = bridge_nf(d.netns.as_ref().expect("netns"));

    start_iperf_server(|script| d.agent_sh(VMS[0], script));
    let ruleset = d.in_netns("nft", &["list", "ruleset"]);
    eprintln!(
        "network_throughput: hearth's nftables ruleset:\n{}",
        String::from_utf8_lossy(&ruleset.stdout)
    );

    // --- plain: a bridge, taps, dnsmasq and QEMU by hand ---
    let ns = Netns::create_prefixed("hth-bench");
    ns.exec_ok("ip", &["link", "add", PLAIN_BRIDGE, "type", "bridge"]);
    ns.exec_ok(
        "ip",
        &[
            "addr",
            "add",
            &format!("{PLAIN_GATEWAY}/24"),
            "dev",
            PLAIN_BRIDGE,
        ],
    );
    ns.exec_ok("ip", &["link", "set", PLAIN_BRIDGE, "up"]);
    for tap in PLAIN_TAPS {
        ns.exec_ok(
            "ip",
            &["tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr"],
        );
        ns.exec_ok("ip", &["link", "set", tap, "master", PLAIN_BRIDGE, "up"]);
    }
    let plain_nf = bridge_nf(&ns);
    let dnsmasq = Reaped(plain_dnsmasq(&ns, &macs, scratch.path()));
    let mut plain_vms = Vec::new();
    let boot_t0 = Instant::now();
    for (i, vm) in VMS.iter().enumerate() {
        let overlay = scratch.path().join(format!("plain-{vm}.qcow2"));
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(&stored)
            .arg(&overlay)
            .output()
            .expect("qemu-img");
        assert!(
            out.status.success(),
            "qemu-img create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let agent = scratch.path().join(format!("plain-{vm}.agent"));
        let serial = scratch.path().join(format!("plain-{vm}.serial"));
        let child = plain_qemu(
            &ns,
            vm,
            &overlay,
            &seeds[i],
            PLAIN_TAPS[i],
            &macs[i],
            vhost,
            &agent,
            &serial,
        );
        plain_vms.push(PlainVm {
            child: Reaped(child),
            agent: PlainAgent::new(agent),
            serial,
        });
    }
    for (i, vm) in plain_vms.iter_mut().enumerate() {
        let want = format!("inet {}/24", PLAIN_IPS[i]);
        vm.wait_sh(
            "its address from DHCP",
            "ip -4 -o addr show",
            |out| out.contains(&want),
            DEBIAN_BOOT_TIMEOUT,
        );
    }
    eprintln!(
        "network_throughput: plain: both addresses up after {:.0} s",
        boot_t0.elapsed().as_secs_f64()
    );
    {
        let server = &mut plain_vms[0];
        start_iperf_server(|script| server.sh(script, Duration::from_secs(120)));
    }
    // Only settled guests are measured: the boot's tail (cloud-init's final
    // stage, timers) would fall on the first runs, and on the pair that
    // booted last. Then one short unrecorded run each.
    for vm in VMS {
        wait_booted(&format!("hearth {vm}"), |script| d.agent_sh(vm, script));
    }
    for (i, vm) in plain_vms.iter_mut().enumerate() {
        wait_booted(&format!("plain {}", VMS[i]), |script| {
            vm.sh(script, Duration::from_secs(120))
        });
    }
    let (status, v) = d.request(
        "POST",
        &format!("/v1/virtualmachines/{}/agent/exec", VMS[1]),
        Some(&json!({"path": "/usr/bin/iperf3",
                      "args": ["-c", ips[0], "-p", IPERF_PORT, "-t", "3", "-J"],
                      "timeoutSeconds": 60})),
    );
    assert!(status == 200 && v["exitCode"] == 0, "warm-up iperf3: {v}");
    let (code, out) = plain_vms[1].exec(
        "/usr/bin/iperf3",
        &["-c", PLAIN_IPS[0], "-p", IPERF_PORT, "-t", "3", "-J"],
        Duration::from_secs(60),
    );
    assert_eq!(code, 0, "warm-up plain iperf3: {out}");

    // Both pairs stay up (an idle guest costs little CPU even under TCG),
    // and the runs alternate, hearth first, then plain first, and so on,
    // so that a change of the machine's load falls on both alike.
    let mut hearth = Vec::new();
    let mut plain = Vec::new();
    for i in 0..runs {
        let sides = if i % 2 == 0 {
            [Side::Hearth, Side::Plain]
        } else {
            [Side::Plain, Side::Hearth]
        };
        for side in sides {
            let load = loadavg();
            let gbps = match side {
                Side::Hearth => {
                    let (status, v) = d.request(
                        "POST",
                        &format!("/v1/virtualmachines/{}/agent/exec", VMS[1]),
                        Some(&json!({"path": "/usr/bin/iperf3",
                                      "args": ["-c", ips[0], "-p", IPERF_PORT,
                                               "-t", seconds.to_string(), "-J"],
                                      "timeoutSeconds": seconds + 60})),
                    );
                    assert_eq!(status, 200, "iperf3 -c in {}: {v}", VMS[1]);
                    assert_eq!(v["exitCode"], 0, "iperf3 -c in {}: {v}", VMS[1]);
                    iperf_gbps(v["stdout"].as_str().unwrap_or_default())
                }
                Side::Plain => {
                    let secs = seconds.to_string();
                    let (code, out) = plain_vms[1].exec(
                        "/usr/bin/iperf3",
                        &["-c", PLAIN_IPS[0], "-p", IPERF_PORT, "-t", &secs, "-J"],
                        Duration::from_secs(seconds + 60),
                    );
                    assert_eq!(code, 0, "plain iperf3 -c: {out}");
                    iperf_gbps(&out)
                }
            };
            let name = match side {
                Side::Hearth => "hearth",
                Side::Plain => "plain",
            };
            eprintln!(
                "network_throughput: run {}: {name} {gbps:.3} Gbit/s (load {load})",
                i + 1
            );
            match side {
                Side::Hearth => hearth.push((gbps, load)),
                Side::Plain => plain.push((gbps, load)),
            }
        }
    }
    drop(plain_vms);
    drop(dnsmasq);
    drop(ns);
    drop(d);
    let took = bench_t0.elapsed();

    println!();
    println!(
        "network_throughput: {started}, {runs} runs of {seconds} s each side, \
         {CPUS} vCPU / {MEMORY_MIB} MiB per guest, vhost {vhost}, bridge-nf-call-iptables: \
         hearth {hearth_nf}, plain {plain_nf}; other QEMUs at the start: {other_qemus}; \
         the whole bench took {:.0} s",
        took.as_secs_f64()
    );
    println!();
    println!("| run | hearth (Gbit/s) | load | plain bridge + taps (Gbit/s) | load |");
    println!("|---|---:|---|---:|---|");
    for i in 0..runs {
        println!(
            "| {} | {:.3} | {} | {:.3} | {} |",
            i + 1,
            hearth[i].0,
            hearth[i].1,
            plain[i].0,
            plain[i].1
        );
    }
    let h: Vec<f64> = hearth.iter().map(|r| r.0).collect();
    let p: Vec<f64> = plain.iter().map(|r| r.0).collect();
    let (hm, hmin, hmax) = stats(&h);
    let (pm, pmin, pmax) = stats(&p);
    println!();
    println!("| | median (Gbit/s) | min–max (Gbit/s) |");
    println!("|---|---:|---:|");
    println!("| hearth network | {hm:.3} | {hmin:.3}–{hmax:.3} |");
    println!("| plain bridge + taps | {pm:.3} | {pmin:.3}–{pmax:.3} |");
    println!("| ratio hearth / plain | {:.2} | |", hm / pm);
}

#[derive(Clone, Copy)]
enum Side {
    Hearth,
    Plain,
}

fn str_at(v: &Value, pointer: &str) -> String {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{pointer} missing in {v:#}"))
        .to_string()
}

/// The `-netdev` JSON of VM `vm`'s QEMU, from its command line in /proc.
fn hearth_netdev(d: &Daemon, vm: &str) -> Value {
    let pids = d.qemu_pids_of(vm);
    assert_eq!(pids.len(), 1, "one QEMU for {vm}: {pids:?}");
    let raw = std::fs::read(format!("/proc/{}/cmdline", pids[0])).expect("QEMU cmdline");
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let at = args
        .iter()
        .position(|a| a == "-netdev")
        .unwrap_or_else(|| panic!("no -netdev in {args:?}"));
    serde_json::from_str(&args[at + 1]).expect("JSON -netdev")
}

/// `net.bridge.bridge-nf-call-iptables` in a namespace ("absent" without
/// br_netfilter): whether bridged packets pass the netfilter hooks there.
fn bridge_nf(ns: &Netns) -> String {
    let out = ns.exec("cat", &["/proc/sys/net/bridge/bridge-nf-call-iptables"]);
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    } else {
        "absent".into()
    }
}

/// `iperf3 -s -D` in a guest, then waits until it listens. `sh` runs a
/// shell script in the guest: (exit code, stdout).
fn start_iperf_server(mut sh: impl FnMut(&str) -> (i64, String)) {
    let (code, out) = sh(&format!(
        "iperf3 -s -D -p {IPERF_PORT} </dev/null >/dev/null 2>&1"
    ));
    assert_eq!(code, 0, "iperf3 -s -D: {out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, _) = sh(&format!("ss -Htln | grep -q ':{IPERF_PORT} '"));
        if code == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "iperf3 -s not listening after 30 s"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Waits until systemd says the boot is over (`running`, or `degraded`
/// when a unit failed), at most 5 minutes.
fn wait_booted(what: &str, mut sh: impl FnMut(&str) -> (i64, String)) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (_, out) = sh("systemctl is-system-running || true");
        let state = out.trim().to_string();
        if state == "running" || state == "degraded" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: boot not finished after 5 minutes (systemd: {state})"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// What the receiver got, from `iperf3 -J`: end.sum_received.bits_per_second.
fn iperf_gbps(json: &str) -> f64 {
    let v: Value = serde_json::from_str(json)
        .unwrap_or_else(|e| panic!("iperf3 -J output is not JSON ({e}): {json}"));
    if let Some(err) = v["error"].as_str() {
        panic!("iperf3: {err}");
    }
    v.pointer("/end/sum_received/bits_per_second")
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no end.sum_received.bits_per_second in {v:#}"))
        / 1e9
}

/// A child process that is killed and reaped when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// dnsmasq in the plain namespace, in the foreground (so it is our child),
/// with a static lease per MAC; DHCP only (`--port=0`).
fn plain_dnsmasq(ns: &Netns, macs: &[String], dir: &Path) -> Child {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "dnsmasq"])
        .args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--port=0",
            "--user=root",
            "--bind-interfaces",
            "--except-interface=lo",
        ])
        .arg(format!("--interface={PLAIN_BRIDGE}"))
        .arg(format!("--listen-address={PLAIN_GATEWAY}"))
        .arg("--dhcp-range=10.88.0.10,10.88.0.99,255.255.255.0,1h")
        .arg(format!(
            "--dhcp-leasefile={}",
            dir.join("plain.leases").display()
        ))
        .arg("--pid-file=");
    for (mac, ip) in macs.iter().zip(PLAIN_IPS) {
        cmd.arg(format!("--dhcp-host={mac},{ip}"));
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("dnsmasq (apt-get install dnsmasq-base)");
    std::thread::sleep(Duration::from_millis(300));
    if let Ok(Some(status)) = child.try_wait() {
        panic!("dnsmasq exited at once: {status}");
    }
    child
}

/// QEMU started by hand with the settings of hearth's command line
/// (`crates/hearth-qemu/src/cmdline.rs`): its seccomp sandbox, TCG with
/// `-cpu max`, q35, `-boot strict=on`, the disk and the seed on virtio-blk,
/// the NIC a JSON tap netdev without scripts on a tap that exists,
/// virtio-net-pci without an option ROM, qemu-ga on a virtio-serial port.
/// Left out: the QMP socket (no packet passes through it; nothing talks to
/// it here) and the launch pid file.
#[allow(clippy::too_many_arguments)]
fn plain_qemu(
    ns: &Netns,
    vm: &str,
    disk: &Path,
    seed: &Path,
    tap: &str,
    mac: &str,
    vhost: bool,
    agent: &Path,
    serial: &Path,
) -> Child {
    let file = |node: &str, path: &Path, ro: bool| {
        json!({"driver": "file", "filename": path, "node-name": node, "read-only": ro}).to_string()
    };
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "qemu-system-x86_64"]);
    cmd.args(["-name", &format!("guest=plain-{vm}")]);
    cmd.args(["-no-user-config", "-nodefaults", "-nographic", "-no-reboot"]);
    // hearth's seccomp filter too: without vhost-net every packet is a
    // syscall of QEMU's, and the filter runs on each.
    cmd.args([
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]);
    cmd.args(["-machine", "q35", "-accel", "tcg", "-cpu", "max"]);
    cmd.args(["-smp", &CPUS.to_string(), "-m", &format!("{MEMORY_MIB}M")]);
    cmd.args(["-msg", "timestamp=on"]);
    cmd.args(["-boot", "strict=on"]);
    cmd.arg("-blockdev").arg(file("f0", disk, false));
    cmd.arg("-blockdev").arg(
        json!({"driver": "qcow2", "file": "f0", "node-name": "root", "read-only": false})
            .to_string(),
    );
    cmd.arg("-device").arg(
        json!({"driver": "virtio-blk-pci", "drive": "root", "id": "disk0", "bootindex": 0})
            .to_string(),
    );
    cmd.arg("-blockdev").arg(file("seedf", seed, true));
    cmd.arg("-blockdev").arg(
        json!({"driver": "raw", "file": "seedf", "node-name": "seed", "read-only": true})
            .to_string(),
    );
    cmd.arg("-device")
        .arg(json!({"driver": "virtio-blk-pci", "drive": "seed", "id": "seed0"}).to_string());
    cmd.arg("-netdev").arg(
        json!({"type": "tap", "id": "net0", "ifname": tap, "script": "no",
               "downscript": "no", "vhost": vhost})
        .to_string(),
    );
    cmd.arg("-device").arg(
        json!({"driver": "virtio-net-pci", "netdev": "net0", "id": "net0", "mac": mac,
               "romfile": ""})
        .to_string(),
    );
    cmd.arg("-device")
        .arg(json!({"driver": "virtio-serial-pci", "id": "vser0"}).to_string());
    cmd.arg("-chardev").arg(format!(
        "socket,id=qga0,path={},server=on,wait=off",
        agent.display()
    ));
    cmd.arg("-device").arg(
        json!({"driver": "virtserialport", "bus": "vser0.0", "chardev": "qga0",
               "name": "org.qemu.guest_agent.0"})
        .to_string(),
    );
    cmd.arg("-serial").arg(format!("file:{}", serial.display()));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("qemu-system-x86_64")
}

/// A plain QEMU and the one connection to its qemu-ga.
struct PlainVm {
    child: Reaped,
    agent: PlainAgent,
    serial: PathBuf,
}

impl PlainVm {
    fn alive(&mut self) {
        if let Ok(Some(status)) = self.child.0.try_wait() {
            panic!(
                "plain QEMU exited: {status}; console:\n{}",
                std::fs::read_to_string(&self.serial).unwrap_or_default()
            );
        }
    }

    fn exec(&mut self, path: &str, args: &[&str], timeout: Duration) -> (i64, String) {
        self.alive();
        match self.agent.exec(path, args, timeout) {
            Ok(r) => r,
            Err(e) => panic!("plain guest: {path} {args:?}: {e}"),
        }
    }

    fn sh(&mut self, script: &str, timeout: Duration) -> (i64, String) {
        self.exec("/bin/sh", &["-c", script], timeout)
    }

    /// Runs `script` until its stdout satisfies `ok` (the agent may not be
    /// up yet: errors are retried too).
    fn wait_sh(&mut self, what: &str, script: &str, ok: impl Fn(&str) -> bool, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            self.alive();
            let last = match self
                .agent
                .exec("/bin/sh", &["-c", script], Duration::from_secs(10))
            {
                Ok((0, out)) if ok(&out) => return,
                Ok((code, out)) => format!("exit {code}: {out}"),
                Err(e) => e,
            };
            assert!(
                Instant::now() < deadline,
                "plain guest: {what} not seen in {timeout:?} (last: {last}); console:\n{}",
                std::fs::read_to_string(&self.serial).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// qemu-ga over a plain QEMU's agent socket, through hearth's own client.
struct PlainAgent {
    rt: tokio::runtime::Runtime,
    socket: PathBuf,
    client: Option<AgentClient>,
}

impl PlainAgent {
    fn new(socket: PathBuf) -> PlainAgent {
        PlainAgent {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime"),
            socket,
            client: None,
        }
    }

    /// Runs a program in the guest: (exit code, -1 when killed; stdout).
    /// A failed call drops the connection; the next one makes a new one.
    fn exec(
        &mut self,
        path: &str,
        args: &[&str],
        timeout: Duration,
    ) -> Result<(i64, String), String> {
        let socket = self.socket.clone();
        let client = &mut self.client;
        let result = self.rt.block_on(async {
            if client.is_none() {
                let mut c = AgentClient::connect(&socket)
                    .await
                    .map_err(|e| e.to_string())?;
                c.sync(Duration::from_secs(3))
                    .await
                    .map_err(|e| e.to_string())?;
                *client = Some(c);
            }
            let c = client.as_mut().expect("connected");
            c.exec(path, args, timeout).await.map_err(|e| e.to_string())
        });
        match result {
            Ok(out) => Ok((
                out.exit_code.map(i64::from).unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )),
            Err(e) => {
                self.client = None;
                Err(e)
            }
        }
    }
}
