//! Benchmark (not a test): 1,000 manifests in the directory, one edited —
//! time and CPU of the re-list.
//!
//! A real hearthd (release build) watches a directory of FILES manifests
//! (default 1000, `HEARTH_BENCH_FILES`), one `AlwaysOff` VM each. Once all
//! are applied, one file is rewritten EDITS times (default 50,
//! `HEARTH_BENCH_EDITS`), a different one each time, and the daemon's own
//! account of each re-list is read from `GET /v1/sources` (`lastRelist`):
//! - `relistUs`/`relistCpuUs`: listing the directory, reading and parsing
//!   what changed, and the core's decision (wall and thread CPU time);
//! - `durationUs`/`cpuUs`: the same plus the engine apply of the one changed
//!   VM (an SQLite transaction with `synchronous=FULL`, so an fsync);
//! - `read`/`parsed`: files read and parsed (the point: 1, not 1,000).
//!
//! The start-up re-list, which reads and parses every file, is shown for
//! contrast. Prints markdown for docs/manifest-directory.md.
//! Run: `cargo bench -p hearthd --bench manifest_relist`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/manifest_support/mod.rs"]
mod manifest_support;
mod support;

use std::time::{Duration, Instant};

use manifest_support::*;
use serde_json::Value;

fn main() {
    if !support::asked_to_run("manifest_relist") {
        return;
    }
    use support::env_num;
    let files = env_num("HEARTH_BENCH_FILES", 1000);
    let edits = env_num("HEARTH_BENCH_EDITS", 50);

    let env = Env::start_with(&["--manifests-resync-seconds", "3600"]);
    // Written while hearthd watches: bursts, like a `git clone`.
    for i in 0..files {
        env.write(
            &format!("vm-{i:04}.yaml"),
            &vm_text(&format!("vm-{i:04}"), "AlwaysOff", "256Mi"),
        );
    }
    let started = Instant::now();
    env.until("every file applied", Duration::from_secs(600), || {
        let s = env.sources();
        let f = s["files"].as_array().cloned().unwrap_or_default();
        f.len() == files && f.iter().all(|f| f["objects"][0]["state"] == "Applied")
    });
    eprintln!(
        "manifest_relist: {files} files applied in {:?}",
        started.elapsed()
    );
    // Restart so the start-up re-list (nothing cached) can be shown.
    let mut env = env;
    env.d.kill();
    env.d.spawn();
    env.until("the start-up re-list", Duration::from_secs(60), || {
        env.sources()["lastRelist"]["reason"] == "start"
    });
    let cold = env.sources()["lastRelist"].clone();
    std::thread::sleep(Duration::from_millis(500));

    let mut runs: Vec<Value> = Vec::new();
    for i in 0..edits {
        let n = (i * 37) % files;
        let name = format!("vm-{n:04}");
        let before = env.sources()["lastRelist"]["at"].clone();
        env.write_atomic(
            &format!("{name}.yaml"),
            &vm_text(&name, "AlwaysOff", "256Mi").replace(
                "stopTimeoutSeconds: 10",
                &format!("stopTimeoutSeconds: {}", 20 + i),
            ),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let last = loop {
            let l = env.sources()["lastRelist"].clone();
            if l["at"] != before && l["applies"] == 1 {
                break l;
            }
            assert!(Instant::now() < deadline, "edit {i} not re-listed: {l}");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(last["reason"], "event", "{last}");
        runs.push(last);
        std::thread::sleep(Duration::from_millis(250));
    }

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\n## Re-list of {files} manifests, one edited ({edits} edits)\n");
    println!(
        "machine: {} cores, load average {}\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.trim()
    );
    println!("| | median | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    for (label, key) in [
        ("re-list wall (list + read + parse + decide)", "relistUs"),
        ("re-list CPU", "relistCpuUs"),
        ("with the engine apply, wall", "durationUs"),
        ("with the engine apply, CPU", "cpuUs"),
    ] {
        let mut v: Vec<u64> = runs.iter().map(|r| r[key].as_u64().unwrap_or(0)).collect();
        v.sort();
        let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
        let ms = |us: u64| format!("{:.2} ms", us as f64 / 1000.0);
        println!(
            "| {label} | {} | {} | {} | {} |",
            ms(pick(0.5)),
            ms(pick(0.9)),
            ms(pick(0.99)),
            ms(v[v.len() - 1])
        );
    }
    let max_read = runs
        .iter()
        .map(|r| r["read"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    let max_parsed = runs
        .iter()
        .map(|r| r["parsed"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    println!(
        "\nfiles read per re-list: at most {max_read}; parsed: at most {max_parsed} (of {files})"
    );
    println!(
        "start-up re-list (nothing cached: all {} files read and parsed, the store read, nothing to apply): wall {:.1} ms, CPU {:.1} ms",
        cold["files"],
        cold["relistUs"].as_u64().unwrap_or(0) as f64 / 1000.0,
        cold["relistCpuUs"].as_u64().unwrap_or(0) as f64 / 1000.0
    );
}
