//! Benchmark (not a test): a git source of 1,000 manifests, one file
//! changed per commit — how long from `git push` to the object changed,
//! after a refresh call and by polling, and what one commit costs hearthd.
//!
//! A real hearthd follows a `file://` repository of FILES manifests
//! (default 1000, `HEARTH_BENCH_FILES`), one `AlwaysOff` VM each, fetched
//! every INTERVAL seconds (default 2, `HEARTH_BENCH_INTERVAL`). Then:
//! - ROUNDS commits (default 30, `HEARTH_BENCH_ROUNDS`), each changing one
//!   VM, pushed and followed by `POST /v1/sources/git/refresh`: the time
//!   from the push to the refresh's answer (the VM is checked changed when
//!   it answers), and the daemon's own account of that sync
//!   (`lastSync` in `GET /v1/sources`: fetch, read, apply, blobs read);
//! - POLLS commits (default 10, `HEARTH_BENCH_POLLS`) with no refresh: the
//!   time from the push until `GET` shows the VM changed.
//!
//! Prints markdown for docs/benchmarks.md.
//! Run: `cargo bench -p hearthd --bench git_source`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/manifest_support/mod.rs"]
mod manifest_support;
mod support;

use std::time::{Duration, Instant};

use common::Daemon;
use common::git::git;
use manifest_support::vm_text;
use serde_json::Value;

fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (pick(0.5), pick(0.9), pick(0.99), v[v.len() - 1])
}

fn main() {
    if !support::asked_to_run("git_source") {
        return;
    }
    use support::env_num;
    let files = env_num("HEARTH_BENCH_FILES", 1000);
    let interval = env_num("HEARTH_BENCH_INTERVAL", 2);
    let rounds = env_num("HEARTH_BENCH_ROUNDS", 30);
    let polls = env_num("HEARTH_BENCH_POLLS", 10);

    let dir = tempfile::Builder::new()
        .prefix("hearth-bench-git-")
        .tempdir()
        .unwrap();
    let root = dir.path();
    let bare = root.join("remote.git");
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    git(
        root,
        &["init", "--quiet", "--bare", "-b", "main", "remote.git"],
    );
    git(&work, &["init", "--quiet", "-b", "main"]);
    git(&work, &["remote", "add", "origin", bare.to_str().unwrap()]);
    std::fs::create_dir_all(work.join("vms")).unwrap();
    let text = |i: usize, timeout: usize| {
        let name = format!("vm-{i:04}");
        vm_text(&name, "AlwaysOff", "256Mi").replace(
            "stopTimeoutSeconds: 10",
            &format!("stopTimeoutSeconds: {timeout}"),
        )
    };
    for i in 0..files {
        std::fs::write(work.join(format!("vms/vm-{i:04}.yaml")), text(i, 10)).unwrap();
    }
    let push = |message: &str| {
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "--quiet", "-m", message]);
        git(&work, &["push", "--quiet", "origin", "HEAD:main"]);
    };
    push("all");

    let url = format!("file://{}", bare.display());
    let d = Daemon::start_with(&[
        "--git",
        &url,
        "--git-ref",
        "main",
        "--git-interval-seconds",
        &interval.to_string(),
        "--manifests-resync-seconds",
        "3600",
    ]);
    let source = |d: &Daemon| -> Value {
        let (_, v) = d.request("GET", "/v1/sources", None);
        v["sources"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["name"] == "git").cloned())
            .unwrap_or(Value::Null)
    };
    let started = Instant::now();
    loop {
        let s = source(&d);
        if s["state"] == "Ready" && s["files"].as_array().is_some_and(|f| f.len() == files) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "not applied: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let first = source(&d)["lastSync"].clone();
    eprintln!(
        "git_source: {files} manifests applied in {:?}",
        started.elapsed()
    );

    let timeout_of = |d: &Daemon, i: usize| -> u64 {
        d.get_vm(&format!("vm-{i:04}")).unwrap()["spec"]["stopTimeoutSeconds"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut refresh_ms = Vec::new();
    let mut syncs: Vec<Value> = Vec::new();
    for r in 0..rounds {
        let i = (r * 37) % files;
        let want = 20 + r;
        std::fs::write(work.join(format!("vms/vm-{i:04}.yaml")), text(i, want)).unwrap();
        push(&format!("round {r}"));
        let t0 = Instant::now();
        let (status, v) = d.request("POST", "/v1/sources/git/refresh", None);
        let took = t0.elapsed();
        assert_eq!(status, 200, "{v}");
        assert_eq!(timeout_of(&d, i), want as u64, "round {r}: {v}");
        refresh_ms.push(took.as_secs_f64() * 1000.0);
        syncs.push(v["lastSync"].clone());
    }
    let mut poll_ms = Vec::new();
    for p in 0..polls {
        let i = (p * 53 + 11) % files;
        let want = 200 + p;
        std::fs::write(work.join(format!("vms/vm-{i:04}.yaml")), text(i, want)).unwrap();
        push(&format!("poll {p}"));
        let t0 = Instant::now();
        while timeout_of(&d, i) != want as u64 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "poll {p} not applied"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        poll_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
    }

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\n## Git source: {files} manifests, one changed per commit\n");
    println!(
        "machine: {} cores, load average {}; hearthd fetching a file:// remote every {interval} s\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.trim()
    );
    println!("| | median | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    let row = |label: &str, v: Vec<f64>| {
        let (m, p90, p99, max) = percentiles(v);
        println!("| {label} | {m:.1} ms | {p90:.1} ms | {p99:.1} ms | {max:.1} ms |");
    };
    row(
        &format!("push → VM changed, refresh call ({rounds} commits)"),
        refresh_ms,
    );
    row(
        &format!("push → VM changed, polling every {interval} s ({polls} commits)"),
        poll_ms,
    );
    for (label, key) in [
        ("one commit in hearthd: git fetch", "fetchUs"),
        (
            "one commit: tree listed, new blobs read and parsed",
            "readUs",
        ),
        ("one commit: core and engine apply", "applyUs"),
        ("one commit: all", "totalUs"),
    ] {
        row(
            label,
            syncs
                .iter()
                .map(|s| s[key].as_u64().unwrap_or(0) as f64 / 1000.0)
                .collect(),
        );
    }
    let max_blobs = syncs
        .iter()
        .map(|s| s["blobsRead"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    println!("\nblobs read per commit: at most {max_blobs} (of {files} manifests)");
    println!(
        "first commit (all {files} read and parsed, {files} VMs applied): fetch {:.1} ms, read {:.1} ms, apply {:.1} ms",
        first["fetchUs"].as_u64().unwrap_or(0) as f64 / 1000.0,
        first["readUs"].as_u64().unwrap_or(0) as f64 / 1000.0,
        first["applyUs"].as_u64().unwrap_or(0) as f64 / 1000.0,
    );
}
