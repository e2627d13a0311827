//! Benchmark (not a test): random 4 KiB reads in a running guest whose disk
//! reads through a 51-layer qcow2 chain, before and after hearth compacts
//! the chain (docs/snapshots.md, "Compaction").
//!
//! 1. One VM of the test guest, one disk (a 64 MiB overlay over the guest's
//!    ext4 base image). The guest fills 48 MiB of a file (random bytes), so
//!    most of the device lies in the disk's first layer.
//! 2. LAYERS (default 50, `HEARTH_BENCH_LAYERS`) consistent snapshots of the
//!    running VM, each after a 64 KiB write of its own: the disk now reads
//!    through LAYERS + 1 layers (`status.chainLength`).
//! 3. Before: REPS runs (default 5, `HEARTH_BENCH_REPS`) of
//!    `/bin/randread /dev/vda READS SEED` in the guest (READS default 4000,
//!    `HEARTH_BENCH_READS`; one seed for all runs): O_DIRECT preads of 4 KiB
//!    at random aligned offsets over the whole device, timed in the guest.
//! 4. Every snapshot is deleted; hearth merges the layers into the head
//!    online (one QMP block-stream job under the running guest). Timed from
//!    the first delete to `chainLength` 2.
//! 5. After: the same REPS runs. The checksum of the bytes read must be the
//!    same as before (the same blocks read the same).
//!
//! Prints markdown tables. Run: `cargo bench -p hearthd --bench
//! chain_compaction`. `cargo test` only builds it; without `--bench` (which
//! `cargo bench` passes) it does nothing.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{loadavg, stats};

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Run {
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    sum: String,
}

fn randread(d: &Daemon, reads: u32, seed: u32) -> Run {
    let out = d.agent_sh_ok("bench", &format!("/bin/randread /dev/vda {reads} {seed}"));
    let field = |k: &str| -> String {
        out.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("randread printed {out}"))
            .to_string()
    };
    Run {
        iops: field("iops").parse().expect("iops"),
        p50_us: field("p50_us").parse().expect("p50"),
        p99_us: field("p99_us").parse().expect("p99"),
        sum: field("sum"),
    }
}

fn chain_length(d: &Daemon) -> u64 {
    d.get_disk("bench-data").expect("disk")["status"]["chainLength"]
        .as_u64()
        .unwrap_or(0)
}

fn wait_chain(d: &Daemon, n: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while chain_length(d) != n {
        assert!(
            Instant::now() < deadline,
            "chain length {} not {n}\n{}",
            chain_length(d),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "chain_compaction: a benchmark; run it with `cargo bench -p hearthd --bench chain_compaction`"
        );
        return;
    }
    let layers: u64 = env_or("HEARTH_BENCH_LAYERS", 50);
    let reps: usize = env_or("HEARTH_BENCH_REPS", 5);
    let reads: u32 = env_or("HEARTH_BENCH_READS", 4000);
    let seed = 7;
    let d = Daemon::start();
    let m = manifest(
        &d,
        "bench.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("bench-data"),
            vm_yaml("bench", "AlwaysOn", &["bench-data"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("bench");
    d.agent_sh_ok(
        "bench",
        "dd if=/dev/urandom of=/data/fill bs=1M count=48 2>/dev/null && sync",
    );
    let made = Instant::now();
    for i in 1..=layers {
        d.agent_sh_ok(
            "bench",
            &format!("dd if=/dev/urandom of=/data/s{i} bs=64k count=1 2>/dev/null && sync"),
        );
        let (status, v) = d.request(
            "POST",
            "/v1/apply",
            Some(&json!({"items": [{"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDiskSnapshot",
                "metadata": {"name": format!("s{i}")},
                "spec": {"virtualDiskName": "bench-data"}}]})),
        );
        assert_eq!(status, 200, "{v}");
        let s = snapshot_final(&d, &format!("s{i}"), Duration::from_secs(120));
        assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    }
    let made_s = made.elapsed().as_secs_f64();
    wait_chain(&d, layers + 1, Duration::from_secs(60));
    let load_before = loadavg();
    let before: Vec<Run> = (0..reps).map(|_| randread(&d, reads, seed)).collect();

    let started = Instant::now();
    for i in (1..=layers).rev() {
        let (status, v) = d.request("DELETE", &format!("/v1/virtualdisksnapshots/s{i}"), None);
        assert!(status == 200 || status == 202, "delete s{i}: {status} {v}");
    }
    wait_chain(&d, 2, Duration::from_secs(600));
    let compact_s = started.elapsed().as_secs_f64();
    let compacted: Vec<String> = d
        .events("VirtualDisk", "bench-data")
        .iter()
        .filter(|e| e["reason"] == "Compacted")
        .filter_map(|e| e["message"].as_str().map(str::to_string))
        .collect();
    let load_after = loadavg();
    let after: Vec<Run> = (0..reps).map(|_| randread(&d, reads, seed)).collect();
    let sums: std::collections::BTreeSet<&str> = before
        .iter()
        .chain(after.iter())
        .map(|r| r.sum.as_str())
        .collect();
    assert_eq!(sums.len(), 1, "the same blocks read differently: {sums:?}");

    let col = |runs: &[Run], f: fn(&Run) -> f64| stats(&runs.iter().map(f).collect::<Vec<_>>());
    println!(
        "\n### Random 4 KiB reads in the guest, {} layers → 2 ({reps} runs of {reads} reads each)\n",
        layers + 1
    );
    println!("| chain | IOPS median (min–max) | p50 µs | p99 µs | load |");
    println!("|---|---|---|---|---|");
    for (label, runs, load) in [
        (format!("{} layers", layers + 1), &before, &load_before),
        ("2 layers (compacted)".to_string(), &after, &load_after),
    ] {
        let (m, lo, hi) = col(runs, |r| r.iops);
        let (p50, _, _) = col(runs, |r| r.p50_us);
        let (p99, _, _) = col(runs, |r| r.p99_us);
        println!("| {label} | {m:.0} ({lo:.0}–{hi:.0}) | {p50:.0} | {p99:.0} | {load} |");
    }
    let (b, _, _) = col(&before, |r| r.iops);
    let (a, _, _) = col(&after, |r| r.iops);
    println!(
        "\nafter / before: {:.2}× the IOPS; checksum of the bytes read {} in all {} runs",
        a / b,
        before[0].sum,
        2 * reps
    );
    println!(
        "making {layers} snapshots: {made_s:.1} s; deleting them to chain length 2: {compact_s:.1} s ({} merge(s))",
        compacted.len()
    );
    println!("\nevery run (IOPS):");
    for (i, (b, a)) in before.iter().zip(after.iter()).enumerate() {
        println!(
            "  {i}: before {:.0} (p50 {:.0} µs), after {:.0} (p50 {:.0} µs)",
            b.iops, b.p50_us, a.iops, a.p50_us
        );
    }
}
