//! Benchmark (not a test): what one apply of a VM on a network costs as the
//! network fills up, and what an edit costs that leaves the VM's interfaces
//! as they are.
//!
//! A real hearthd (release build) inside a network namespace of its own
//! ([`Daemon::start_in_netns`]), one Isolated network with a /20 subnet, and
//! VMS AlwaysOff VMs (default 1000, `HEARTH_BENCH_VMS`) with one interface on
//! it each (no guest boots; each VM still gets its lease and its tap). Every
//! apply is one `POST /v1/apply` of one VM, timed over the API:
//! - the VMs created one by one, reported by hundreds (the admission check
//!   reads every VM, and the network reconcile lists every link);
//! - EDITS CPU edits (default 200, `HEARTH_BENCH_EDITS`) of the first VMs:
//!   their interfaces are kept, so no network check or reconcile runs;
//! - EDITS interface edits of the same VMs (a reserved `ipAddress`), which
//!   take both.
//!
//! With `HEARTH_BENCH_PLAIN=N` (default 0), N AlwaysOff VMs without an
//! interface are created first (untimed): a host where most VMs have no
//! network, whose networked applies read only the networked VMs.
//!
//! Prints markdown for docs/networking.md. Run:
//! `cargo bench -p hearthd --bench network_apply`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{env_num, loadavg, stats};

use std::time::Instant;

use common::*;
use serde_json::{Value, json};

fn network() -> Value {
    json!({
        "apiVersion": "hearth.dev/v1alpha1",
        "kind": "VirtualNetwork",
        "metadata": {"name": "lan"},
        "spec": {"mode": "Isolated", "subnet": "10.81.0.0/20"},
    })
}

/// A VM with no interface.
fn plain_vm(kernel: &str, i: usize) -> Value {
    json!({
        "apiVersion": "hearth.dev/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": format!("plain-{i:04}")},
        "spec": {"runPolicy": "AlwaysOff", "cpus": 1, "boot": {"kernel": kernel}},
    })
}

fn vm(kernel: &str, i: usize, cpus: u32, ip: Option<String>) -> Value {
    let mut nic = json!({"virtualNetworkName": "lan"});
    if let Some(ip) = ip {
        nic["ipAddress"] = json!(ip);
    }
    json!({
        "apiVersion": "hearth.dev/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": format!("vm-{i:04}")},
        "spec": {
            "runPolicy": "AlwaysOff",
            "cpus": cpus,
            "boot": {"kernel": kernel},
            "networks": [nic],
        },
    })
}

/// One apply of `item`, in ms.
fn timed(d: &Daemon, item: Value) -> f64 {
    let started = Instant::now();
    let (status, answer) = d.apply_json(vec![item]);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(status, 200, "apply: {answer}");
    ms
}

fn row(label: &str, xs: &[f64]) {
    let (med, min, max) = stats(xs);
    println!(
        "| {label} | {} | {med:.1} | {min:.1} | {max:.1} |",
        xs.len()
    );
}

fn main() {
    if !support::asked_to_run("network_apply") {
        return;
    }
    let vms = env_num("HEARTH_BENCH_VMS", 1000).clamp(1, 4000);
    let edits = env_num("HEARTH_BENCH_EDITS", 200).clamp(1, vms);
    let plain = env_num("HEARTH_BENCH_PLAIN", 0).clamp(0, 4000);
    let images = tempfile::tempdir().expect("tempdir");
    let kernel = images.path().join("vmlinuz");
    std::fs::write(&kernel, b"never booted").expect("kernel");
    let kernel = kernel.to_str().expect("utf8").to_string();
    let d = Daemon::start_in_netns(
        &[images.path()],
        &["--accel", "tcg", "--resync-seconds", "3600"],
    );
    let load_before = loadavg();
    d.apply(vec![network()]);
    for chunk in (0..plain).collect::<Vec<_>>().chunks(100) {
        d.apply(chunk.iter().map(|&i| plain_vm(&kernel, i)).collect());
    }

    let mut created = Vec::new();
    for i in 0..vms {
        created.push(timed(&d, vm(&kernel, i, 1, None)));
    }
    let cpu_edits: Vec<f64> = (0..edits)
        .map(|i| timed(&d, vm(&kernel, i, 2, None)))
        .collect();
    // Addresses above the ones handed out so far (the /20 has 4094).
    let interface_edits: Vec<f64> = (0..edits)
        .map(|i| {
            let host = 3000 + i;
            let ip = format!("10.81.{}.{}", host / 256, host % 256);
            timed(&d, vm(&kernel, i, 2, Some(ip)))
        })
        .collect();

    println!(
        "network_apply: {vms} AlwaysOff VMs on one network ({plain} without an interface beside them), one apply each over the API (ms); load average {load_before} before, {} after\n",
        loadavg()
    );
    println!("| applies | count | median | min | max |");
    println!("|---|---:|---:|---:|---:|");
    let step = vms.div_ceil(10).max(1);
    for (n, chunk) in created.chunks(step).enumerate() {
        let first = n * step + 1;
        let last = first + chunk.len() - 1;
        row(&format!("VM {first}–{last} created"), chunk);
    }
    row("CPU edit (interfaces kept)", &cpu_edits);
    row("interface edit (an ipAddress)", &interface_edits);
}
