//! Benchmark (not a test): save in an editor → reconcile starts.
//!
//! A real hearthd (release build) watches a manifest directory outside /tmp;
//! real vim (default settings, driven through tmux) edits one VM manifest and
//! saves it SAVES times (default 100, `HEARTH_BENCH_SAVES`), each save changing
//! `spec.stopTimeoutSeconds` (an `AlwaysOff` VM: nothing boots, so only the
//! manifest path is timed).
//!
//! Latency of one save = time of the engine's `Updated` event for that
//! generation (recorded after the store write, right before the reconciler is
//! woken) − the mtime of the file vim wrote (when the new content landed).
//! Both are CLOCK_REALTIME; file timestamps are coarse (one kernel tick, a
//! few ms), which can only make a figure look larger. The debounce (quiet
//! period) is included.
//!
//! Prints a markdown table for docs/manifest-directory.md.
//! Run: `cargo bench -p hearthd --bench manifest_save_latency`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/manifest_support/mod.rs"]
mod manifest_support;

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use manifest_support::*;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "manifest_save_latency: a benchmark; run it with `cargo bench -p hearthd --bench manifest_save_latency`"
        );
        return;
    }
    let saves: u64 = std::env::var("HEARTH_BENCH_SAVES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);

    let env = Env::start();
    env.write("lat.yaml", &vm_text("lat", "AlwaysOff", "256Mi"));
    env.wait_generation("lat", 1);
    let vim = Vim::open(&env.dir, "lat.yaml");
    vim.assert_default_write_options();

    let mut latencies = Vec::new();
    let mut keypress_to_reconcile = Vec::new();
    for i in 0..saves {
        let generation = i + 2;
        let value = 100 + i;
        vim.tmux.ex(&format!(
            ":%s/stopTimeoutSeconds: [0-9]*/stopTimeoutSeconds: {value}/"
        ));
        let typed = SystemTime::now();
        vim.save();
        let mtime = std::fs::metadata(env.path("lat.yaml")).expect("stat");
        let written = UNIX_EPOCH + Duration::new(mtime.mtime() as u64, mtime.mtime_nsec() as u32);
        let deadline = Instant::now() + Duration::from_secs(10);
        let event_time = loop {
            let found = env
                .d
                .events("VirtualMachine", "lat")
                .into_iter()
                .rev()
                .find(|e| {
                    e["reason"] == "Updated"
                        && e["message"]
                            .as_str()
                            .is_some_and(|m| m.contains(&format!("(generation {generation})")))
                });
            if let Some(e) = found {
                let t = chrono::DateTime::parse_from_rfc3339(e["time"].as_str().expect("time"))
                    .expect("rfc3339");
                break UNIX_EPOCH + Duration::new(t.timestamp() as u64, t.timestamp_subsec_nanos());
            }
            assert!(Instant::now() < deadline, "save {i} never applied");
            std::thread::sleep(Duration::from_millis(5));
        };
        latencies.push(event_time.duration_since(written).unwrap_or_default());
        keypress_to_reconcile.push(event_time.duration_since(typed).unwrap_or_default());
        // A person does not save 10 times a second; let the racy window pass.
        std::thread::sleep(Duration::from_millis(150));
    }
    vim.quit();
    assert_eq!(env.count("lat", "Deleting"), 0);
    assert_eq!(env.count("lat", "Updated") as u64, saves);

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let s = env.sources();
    println!("\n## Save in vim → reconcile starts ({saves} saves)\n");
    println!("machine: {} cores, load average {}", cores(), load.trim());
    println!(
        "settings: quiet {} ms, max delay {} ms\n",
        s["settings"]["quietMs"], s["settings"]["maxDelayMs"]
    );
    println!("| measured from | median | p90 | p99 | max | min |");
    println!("|---|---|---|---|---|---|");
    row("file written (mtime)", &mut latencies);
    row("`:w` typed", &mut keypress_to_reconcile);
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

fn row(what: &str, v: &mut [Duration]) {
    v.sort();
    let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!(
        "| {what} | {} | {} | {} | {} | {} |",
        ms(pick(0.5)),
        ms(pick(0.9)),
        ms(pick(0.99)),
        ms(v[v.len() - 1]),
        ms(v[0])
    );
}
