//! Benchmark (not a test): manifest applied → guest agent answering.
//!
//! Starts a real hearthd (the e2e harness), then RUNS times (default 5,
//! `HEARTH_BENCH_RUNS`): applies a VirtualDisk (overlay over the test guest's
//! data image) and an AlwaysOn VirtualMachine in one `/v1/apply`, and times
//! from just before that request until the VM's status shows
//! `phase: Running` and `agentConnected: true`; then deletes both and waits
//! until the QEMU process is gone. Prints a markdown table with every run, the
//! median, min and max, the accelerator each VM reported (`status.accelerator`)
//! and the host's load, so the figures can be pasted into docs/benchmarks.md.
//!
//! Run: `cargo bench -p hearthd --bench boot_to_agent` (needs root, QEMU and
//! the built test guest, like the e2e tests). `cargo test` only builds it;
//! without `--bench` (which `cargo bench` passes) it does nothing.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{all_qemus, loadavg, stats};

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// Status poll interval while timing: the resolution of the figures.
const POLL: Duration = Duration::from_millis(20);

struct Run {
    to_running: Duration,
    to_agent: Duration,
    accelerator: String,
    load_before: String,
    other_qemus: usize,
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "boot_to_agent: a benchmark; run it with `cargo bench -p hearthd --bench boot_to_agent`"
        );
        return;
    }
    let runs: usize = std::env::var("HEARTH_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);

    let d = Daemon::start();
    let (_, health) = d.request("GET", "/v1/health", None);
    eprintln!(
        "boot_to_agent: hearthd up; accelerator probe: {} ({})",
        health["accelerator"].as_str().unwrap_or("?"),
        health["acceleratorReason"].as_str().unwrap_or("?")
    );

    let mut results = Vec::with_capacity(runs);
    for i in 0..runs {
        let vm = format!("boot{i}");
        let disk = format!("boot{i}-data");
        let text = format!(
            "{}---\n{}",
            overlay_disk_yaml(&disk),
            vm_yaml(&vm, "AlwaysOn", &[&disk], "")
        );
        let items: Vec<Value> = hearth_api::parse_documents(&text, "boot_to_agent")
            .expect("bench manifest")
            .iter()
            .map(|o| serde_json::to_value(o).expect("object to JSON"))
            .collect();

        let load_before = loadavg();
        let other_qemus = all_qemus().saturating_sub(d.qemu_pids().len());
        let t0 = Instant::now();
        let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
        assert_eq!(status, 200, "apply: {v}");

        let mut to_running = None;
        let vm_obj = loop {
            let v = d.get_vm(&vm).expect("VM exists after apply");
            let st = &v["status"];
            if to_running.is_none() && st["phase"] == "Running" {
                to_running = Some(t0.elapsed());
            }
            if st["phase"] == "Running" && st["agentConnected"] == true {
                break v;
            }
            assert!(
                st["phase"] != "Failed",
                "VM {vm} failed: {v:#}\n{}",
                d.log()
            );
            assert!(
                t0.elapsed() < BOOT_TIMEOUT,
                "VM {vm}: agent not connected after {BOOT_TIMEOUT:?}: {v:#}"
            );
            std::thread::sleep(POLL);
        };
        let to_agent = t0.elapsed();
        let run = Run {
            to_running: to_running.unwrap_or(to_agent),
            to_agent,
            accelerator: vm_obj["status"]["accelerator"]
                .as_str()
                .unwrap_or("?")
                .to_string(),
            load_before,
            other_qemus,
        };
        eprintln!(
            "boot_to_agent: run {}: apply → Running {} ms, → agent connected {} ms ({}, load {}, other QEMUs {})",
            i + 1,
            run.to_running.as_millis(),
            run.to_agent.as_millis(),
            run.accelerator,
            run.load_before,
            run.other_qemus
        );
        results.push(run);

        // Tear down before the next run, so runs do not overlap.
        let (s, v) = d.request("DELETE", &format!("/v1/virtualmachines/{vm}"), None);
        assert_eq!(s, 200, "delete vm: {v}");
        wait_until(&format!("VM {vm} gone"), Duration::from_secs(120), || {
            d.get_vm(&vm).is_none() && d.qemu_pids().is_empty()
        });
        let (s, v) = d.request("DELETE", &format!("/v1/virtualdisks/{disk}"), None);
        assert_eq!(s, 200, "delete disk: {v}");
        // Let the host settle (page cache writeback of the old VM's files).
        std::thread::sleep(Duration::from_secs(2));
    }

    print_table(&results);
}

fn print_table(results: &[Run]) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!();
    println!(
        "| run | apply → Running (ms) | apply → agent connected (ms) | accelerator | load avg before | other QEMUs on host |"
    );
    println!("|---:|---:|---:|---|---|---:|");
    for (i, r) in results.iter().enumerate() {
        println!(
            "| {} | {:.0} | {:.0} | {} | {} | {} |",
            i + 1,
            ms(r.to_running),
            ms(r.to_agent),
            r.accelerator,
            r.load_before,
            r.other_qemus
        );
    }
    let agent: Vec<f64> = results.iter().map(|r| ms(r.to_agent)).collect();
    let running: Vec<f64> = results.iter().map(|r| ms(r.to_running)).collect();
    let mut accels: Vec<&str> = results.iter().map(|r| r.accelerator.as_str()).collect();
    accels.dedup();
    println!();
    println!(
        "| metric (n = {}) | median (ms) | min (ms) | max (ms) |",
        results.len()
    );
    println!("|---|---:|---:|---:|");
    for (name, xs) in [
        ("apply → agent connected", &agent),
        ("apply → Running", &running),
    ] {
        let (med, min, max) = stats(xs);
        println!("| {name} | {med:.0} | {min:.0} | {max:.0} |");
    }
    println!();
    println!(
        "accelerator: {}; host: {} CPUs",
        accels.join(", "),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}
