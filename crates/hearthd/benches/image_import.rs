//! Benchmark (not a test): VirtualImage import over HTTP against `curl`
//! plus `qemu-img convert` of the same file from the same server, in the
//! same run.
//!
//! A file server on 127.0.0.1 (the e2e harness's) serves the image
//! (`HEARTH_BENCH_IMAGE`, default the Debian test image guest/out/debian-12.qcow2).
//! Each of RUNS rounds (default 3, `HEARTH_BENCH_RUNS`):
//! - hearth: apply a VirtualImage with the file's URL and sha256, time until
//!   `phase: Ready` (download, SHA-256, the safety checks, `qemu-img info`
//!   and `check`, the rename into the store); then delete it and wait until
//!   its stored file is gone, so the next round downloads again;
//! - baseline: `curl -o` of the same URL, then `qemu-img convert -O qcow2`
//!   of the download into a new file (what a person does by hand), timed
//!   separately and together.
//!
//! Prints a markdown table for docs/benchmarks.md.
//! Run: `cargo bench -p hearthd --bench image_import`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{loadavg, stats};

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{Behaviour, Server};
use common::*;
use serde_json::json;

struct Round {
    hearth: Duration,
    curl: Duration,
    convert: Duration,
    load: String,
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "image_import: a benchmark; run it with `cargo bench -p hearthd --bench image_import`"
        );
        return;
    }
    let runs: usize = std::env::var("HEARTH_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let file = std::env::var_os("HEARTH_BENCH_IMAGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("guest/out/debian-12.qcow2"));
    assert!(
        file.is_file(),
        "{} is missing: run `guest/debian/build.sh` or set HEARTH_BENCH_IMAGE",
        file.display()
    );
    for tool in ["curl", "qemu-img", "sha256sum"] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .status()
                .is_ok_and(|s| s.success()),
            "{tool} is missing: run `.ci/install-deps.sh`"
        );
    }
    let size = std::fs::metadata(&file).expect("image").len();
    let sha = sha256_file(&file);
    let server = Server::start();
    server.route("/bench.img", Behaviour::File(file.clone()));
    let url = server.url("/bench.img");
    let scratch = tempfile::tempdir().expect("scratch");
    let d = Daemon::start();
    eprintln!(
        "image_import: {} ({} MiB, sha256 {sha}), {runs} round(s)",
        file.display(),
        size >> 20
    );

    let mut rounds = Vec::new();
    for i in 0..runs {
        let load = loadavg();
        let name = format!("bench-{i}");
        let t0 = Instant::now();
        let (s, v) = d.request(
            "POST",
            "/v1/apply",
            Some(
                &json!({"items": [{"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
                "metadata": {"name": name},
                "spec": {"source": {"http": {"url": url, "sha256": sha}}}}]}),
            ),
        );
        assert_eq!(s, 200, "apply: {v}");
        let stored = loop {
            let (_, v) = d.request("GET", &format!("/v1/virtualimages/{name}"), None);
            match v["status"]["phase"].as_str() {
                Some("Ready") => break PathBuf::from(v["status"]["path"].as_str().expect("path")),
                Some("Failed") => panic!("import failed: {v:#}\n{}", d.log()),
                _ => {}
            }
            assert!(
                t0.elapsed() < Duration::from_secs(600),
                "import too slow: {v:#}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let hearth = t0.elapsed();
        let (s, v) = d.request("DELETE", &format!("/v1/virtualimages/{name}"), None);
        assert_eq!(s, 200, "delete: {v}");
        wait_until("the stored image removed", Duration::from_secs(60), || {
            !stored.exists()
        });

        let download = scratch.path().join("download.img");
        let converted = scratch.path().join("converted.qcow2");
        let t1 = Instant::now();
        run(Command::new("curl")
            .args(["-sS", "--fail", "-o"])
            .arg(&download)
            .arg(&url));
        let curl = t1.elapsed();
        let t2 = Instant::now();
        run(Command::new("qemu-img")
            .args(["convert", "-O", "qcow2"])
            .arg(&download)
            .arg(&converted));
        let convert = t2.elapsed();
        let _ = std::fs::remove_file(&download);
        let _ = std::fs::remove_file(&converted);
        eprintln!(
            "image_import: round {}: hearth {} ms; curl {} ms + qemu-img convert {} ms (load {load})",
            i + 1,
            hearth.as_millis(),
            curl.as_millis(),
            convert.as_millis()
        );
        rounds.push(Round {
            hearth,
            curl,
            convert,
            load,
        });
        std::thread::sleep(Duration::from_secs(1));
    }

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mibps = |d: Duration| (size as f64 / 1048576.0) / d.as_secs_f64();
    println!();
    println!(
        "| round | hearth import (ms) | MiB/s | curl (ms) | qemu-img convert (ms) | curl + convert (ms) | MiB/s | load avg |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (i, r) in rounds.iter().enumerate() {
        let both = r.curl + r.convert;
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
            i + 1,
            ms(r.hearth),
            mibps(r.hearth),
            ms(r.curl),
            ms(r.convert),
            ms(both),
            mibps(both),
            r.load
        );
    }
    let h: Vec<f64> = rounds.iter().map(|r| ms(r.hearth)).collect();
    let b: Vec<f64> = rounds.iter().map(|r| ms(r.curl + r.convert)).collect();
    let c: Vec<f64> = rounds.iter().map(|r| ms(r.curl)).collect();
    let (hm, hmin, hmax) = stats(&h);
    let (bm, bmin, bmax) = stats(&b);
    let (cm, _, _) = stats(&c);
    println!();
    println!(
        "median: hearth {hm:.0} ms ({hmin:.0}–{hmax:.0}); curl + qemu-img convert {bm:.0} ms ({bmin:.0}–{bmax:.0}); curl alone {cm:.0} ms; file {} MiB",
        size >> 20
    );
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
