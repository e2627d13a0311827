//! Benchmark (not a test): hearthd with thousands of disks and hundreds of
//! snapshots while nothing changes.
//!
//! For each size N (default 500, 1000, 2000, 5000; `HEARTH_BENCH_SIZES`,
//! comma-separated) a fresh real hearthd (release build, `--accel tcg`,
//! `--resync-seconds` `HEARTH_BENCH_RESYNC_SECONDS`, default 5) with a
//! `qemu-img` first in its PATH that logs every run:
//! - one `POST /v1/apply` of N blank 64 MiB disks, timed until every disk
//!   is Ready (the list polled every 500 ms);
//! - one apply of N/100 AlwaysOff VMs (one disk each) and N/10
//!   VirtualDiskSnapshots (of the VMs' disks and of disks no VM uses: all
//!   offline cuts, a new layer each), timed until every snapshot is Ready;
//! - an idle window (`HEARTH_BENCH_IDLE_SECONDS`, default 30): hearthd's
//!   CPU with its children's (utime + stime + cutime + cstime of
//!   /proc/PID/stat), the qemu-img runs the log shows, and whether the
//!   store's write-ahead log changed;
//! - a window as long of `GET /v1/virtualmachines/vm-0` every 50 ms (what
//!   `hearth get vm vm-0` asks) and `GET /v1/virtualdisks` every second,
//!   while the resyncs run: p50, p99 and max;
//! - a restart (SIGKILL, start again): time until the API answers, and the
//!   qemu-img runs during the three resyncs after it.
//!
//! `HEARTH_BENCH_STAMPEDE=20000` adds the stampede run: that many blank
//! disks in applies of at most 10 000 objects, back to back, while
//! `GET /v1/virtualmachines` is asked every 200 ms and hearthd's
//! descriptors and children are sampled; then a restart.
//! Prints markdown for docs/benchmarks.md. Run:
//! `cargo bench -p hearthd --bench scale`.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::qemu_img_log::QemuImgLog;
use common::*;
use serde_json::{Value, json};

fn env_num(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Clock ticks per second, for /proc/PID/stat.
fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime + cutime + cstime of a process, in ticks: its own CPU and
/// that of the children it waited for.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    // Fields after the name start at field 3 (state); 14..=17 are wanted.
    rest.split_whitespace()
        .skip(14 - 3)
        .take(4)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum()
}

fn fds_and_children(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let children = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_string_lossy().parse::<u32>().is_ok()
                && std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().nth(1))
                        .and_then(|p| p.parse::<u32>().ok())
                        == Some(pid)
                })
        })
        .count();
    (fds, children)
}

fn blank_disk(name: &str) -> Value {
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
           "metadata": {"name": name}, "spec": {"size": "64Mi", "source": {"blank": {}}}})
}

/// `(all, ready, failed)` of a kind, from one list.
fn phases(d: &Daemon, plural: &str) -> (usize, usize, usize) {
    match d.try_request("GET", &format!("/v1/{plural}"), None) {
        Ok((200, v)) => {
            let items = v["items"].as_array().cloned().unwrap_or_default();
            let of = |p: &str| items.iter().filter(|o| o["status"]["phase"] == p).count();
            (items.len(), of("Ready"), of("Failed"))
        }
        _ => (0, 0, 0),
    }
}

/// Polls until `count` objects of the kind are Ready; the time it took.
fn until_ready(d: &Daemon, plural: &str, count: usize, since: Instant, poll: Duration) -> f64 {
    let deadline = since + Duration::from_secs(60 + count as u64 / 20);
    loop {
        let (all, ready, failed) = phases(d, plural);
        if all == count && ready == count {
            return since.elapsed().as_secs_f64();
        }
        assert!(failed == 0, "{failed} {plural} Failed\n{}", tail(&d.log()));
        assert!(
            Instant::now() < deadline,
            "{ready}/{count} {plural} Ready after {:?}",
            since.elapsed()
        );
        std::thread::sleep(poll);
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// p50, p99, max of latencies in ms.
fn percentiles(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let at = |q: f64| xs[((xs.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), xs[xs.len() - 1])
}

fn timed_get(d: &Daemon, path: &str) -> f64 {
    let t = Instant::now();
    let (status, _) = raw_request(&d.socket(), "GET", path, None).expect("GET");
    assert_eq!(status, 200, "GET {path}");
    t.elapsed().as_secs_f64() * 1e3
}

fn wal_state(d: &Daemon) -> (u64, std::time::SystemTime) {
    let m = std::fs::metadata(d.state_dir().join("hearth.db-wal")).expect("wal");
    (m.len(), m.modified().expect("mtime"))
}

struct Row {
    n: usize,
    vms: usize,
    snapshots: usize,
    disks_ready_s: f64,
    apply_ms: f64,
    snapshots_ready_s: f64,
    runs_made: usize,
    idle_cpu_pct: f64,
    idle_runs: usize,
    idle_wal_written: bool,
    pass_ms: f64,
    get: (f64, f64, f64),
    list: (f64, f64, f64),
    restart_api_ms: f64,
    restart_runs: usize,
    restart_cpu_pct: f64,
}

fn run(n: usize, resync: u64, idle: u64) -> Row {
    let log = QemuImgLog::new("");
    let images = tempfile::tempdir().expect("tempdir");
    let path = log.path_var();
    let env = [("PATH", path.as_str())];
    let resync_arg = resync.to_string();
    let mut d =
        Daemon::start_without_guest_env(&[images.path()], &["--resync-seconds", &resync_arg], &env);
    let ticks = ticks_per_second();

    let disks: Vec<Value> = (0..n).map(|i| blank_disk(&format!("d-{i}"))).collect();
    let started = Instant::now();
    let (status, v) = d.apply_json(disks);
    assert_eq!(
        status,
        200,
        "{}",
        v.to_string().chars().take(300).collect::<String>()
    );
    let apply_ms = started.elapsed().as_secs_f64() * 1e3;
    let disks_ready_s = until_ready(&d, "virtualdisks", n, started, Duration::from_millis(500));
    eprintln!(
        "scale: {n} disks Ready in {disks_ready_s:.1} s (apply answered in {apply_ms:.0} ms)"
    );

    let (vms, snapshots) = ((n / 100).max(1), (n / 10).max(1));
    let mut objects: Vec<Value> = (0..vms)
        .map(|i| {
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
                   "metadata": {"name": format!("vm-{i}")},
                   "spec": {"runPolicy": "AlwaysOff", "disks": [{"virtualDiskName": format!("d-{i}")}]}})
        })
        .collect();
    objects.extend((0..snapshots).map(|i| {
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDiskSnapshot",
               "metadata": {"name": format!("s-{i}")}, "spec": {"virtualDiskName": format!("d-{i}")}})
    }));
    let started = Instant::now();
    let (status, v) = d.apply_json(objects);
    assert_eq!(
        status,
        200,
        "{}",
        v.to_string().chars().take(300).collect::<String>()
    );
    let snapshots_ready_s = until_ready(
        &d,
        "virtualdisksnapshots",
        snapshots,
        started,
        Duration::from_millis(500),
    );
    eprintln!("scale: {snapshots} snapshots Ready in {snapshots_ready_s:.1} s");
    // Everything made so far settles: its chains, its plans.
    std::thread::sleep(Duration::from_secs(2 * resync + 1));
    let runs_made = log.starts().len();

    let pid = d.child.as_ref().expect("hearthd").id();
    let (runs0, cpu0, wal0, t0) = (
        log.starts().len(),
        cpu_ticks(pid),
        wal_state(&d),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(idle));
    let (cpu1, secs) = (cpu_ticks(pid), t0.elapsed().as_secs_f64());
    let idle_cpu_pct = (cpu1 - cpu0) as f64 / ticks / secs * 100.0;
    let idle_runs = log.starts().len() - runs0;
    let idle_wal_written = wal_state(&d) != wal0;
    // hearthd's own account of its passes over the disks (a diagnosis, not
    // a measurement): the last few, in ms.
    let passes: Vec<f64> = d
        .log()
        .lines()
        .filter(|l| l.contains("disks resynced"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("ms=")))
        .filter_map(|v| v.parse().ok())
        .collect();
    let pass_ms = support::stats(&passes[passes.len().saturating_sub(6)..]).0;
    eprintln!("scale: idle {secs:.0} s: {idle_cpu_pct:.2} % of a core, {idle_runs} qemu-img runs");

    let (mut get, mut list) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    let mut i = 0u64;
    while t0.elapsed() < Duration::from_secs(idle) {
        get.push(timed_get(&d, "/v1/virtualmachines/vm-0"));
        if i.is_multiple_of(20) {
            list.push(timed_get(&d, "/v1/virtualdisks"));
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }

    d.kill();
    let t0 = Instant::now();
    d.spawn_env(&env);
    let restart_api_ms = t0.elapsed().as_secs_f64() * 1e3;
    let pid = d.child.as_ref().expect("hearthd").id();
    let runs0 = log.starts().len();
    let (cpu0, t1) = (cpu_ticks(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(3 * resync));
    let restart_cpu_pct =
        (cpu_ticks(pid) - cpu0) as f64 / ticks / t1.elapsed().as_secs_f64() * 100.0;
    let restart_runs = log.starts().len() - runs0;
    let (all, ready, _) = phases(&d, "virtualdisks");
    assert_eq!(
        (all, ready),
        (n, n),
        "every disk still Ready after the restart"
    );
    Row {
        n,
        vms,
        snapshots,
        disks_ready_s,
        apply_ms,
        snapshots_ready_s,
        runs_made,
        idle_cpu_pct,
        idle_runs,
        idle_wal_written,
        pass_ms,
        get: percentiles(get),
        list: percentiles(list),
        restart_api_ms,
        restart_runs,
        restart_cpu_pct,
    }
}

fn stampede(total: usize, resync: u64) {
    let log = QemuImgLog::new("");
    let images = tempfile::tempdir().expect("tempdir");
    let path = log.path_var();
    let env = [("PATH", path.as_str())];
    let resync_arg = resync.to_string();
    let mut d =
        Daemon::start_without_guest_env(&[images.path()], &["--resync-seconds", &resync_arg], &env);
    let pid = d.child.as_ref().expect("hearthd").id();
    let socket = d.socket();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut lat, mut fds, mut children, mut errors) = (Vec::new(), 0, 0, 0);
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                match raw_request(&socket, "GET", "/v1/virtualmachines", None) {
                    Ok((200, _)) => lat.push(t.elapsed().as_secs_f64() * 1e3),
                    _ => errors += 1,
                }
                let (f, c) = fds_and_children(pid);
                fds = fds.max(f);
                children = children.max(c);
                std::thread::sleep(Duration::from_millis(200));
            }
            (lat, fds, children, errors)
        })
    };
    let started = Instant::now();
    let mut applies = Vec::new();
    for chunk in (0..total)
        .collect::<Vec<_>>()
        .chunks(hearth_engine::MAX_APPLY_OBJECTS)
    {
        let t = Instant::now();
        let objects = chunk
            .iter()
            .map(|i| blank_disk(&format!("d-{i}")))
            .collect();
        let (status, v) = d.apply_json(objects);
        assert_eq!(
            status,
            200,
            "{}",
            v.to_string().chars().take(300).collect::<String>()
        );
        applies.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let ready_s = until_ready(&d, "virtualdisks", total, started, Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let (lat, fds, children, errors) = sampler.join().expect("sampler");
    let (p50, p99, max) = percentiles(lat);
    let (_, _, failed) = phases(&d, "virtualdisks");
    d.kill();
    let t0 = Instant::now();
    d.spawn_env(&env);
    let api_ms = t0.elapsed().as_secs_f64() * 1e3;
    let runs0 = log.starts().len();
    std::thread::sleep(Duration::from_secs(3 * resync));
    let after = log.starts().len() - runs0;
    println!(
        "\n| disks | applies (ms each) | all Ready (s) | GET /v1/virtualmachines p50 / p99 / max (ms), failed requests | hearthd's descriptors, most | its children, most | Failed disks | qemu-img runs | restart: API answers (ms) | qemu-img runs in 3 resyncs after |"
    );
    println!("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {total} | {} | {ready_s:.1} | {p50:.1} / {p99:.1} / {max:.1}, {errors} | {fds} | {children} | {failed} | {runs0} | {api_ms:.0} | {after} |",
        applies
            .iter()
            .map(|a| format!("{a:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("scale: a benchmark; run it with `cargo bench -p hearthd --bench scale`");
        return;
    }
    let sizes: Vec<usize> = std::env::var("HEARTH_BENCH_SIZES")
        .unwrap_or_else(|_| "500,1000,2000,5000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let resync = env_num("HEARTH_BENCH_RESYNC_SECONDS", 5).max(1);
    let idle = env_num("HEARTH_BENCH_IDLE_SECONDS", 30).max(1);
    let stampede_disks = env_num("HEARTH_BENCH_STAMPEDE", 0) as usize;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!(
        "scale: sizes {sizes:?}, resync every {resync} s, windows of {idle} s, {cpus} CPUs, load {}",
        support::loadavg()
    );
    let mut rows = Vec::new();
    for n in &sizes {
        rows.push(run(*n, resync, idle));
        eprintln!("scale: load {}", support::loadavg());
    }
    println!(
        "| disks | VMs (stopped) | snapshots | apply answered (ms) | disks all Ready (s) | snapshots all Ready (s) | qemu-img runs to get there | idle CPU, hearthd + children (% of a core) | qemu-img runs idle | store written idle | one pass over the disks (ms, hearthd's log) | GET one VM p50 / p99 / max (ms) | GET all disks p50 / p99 / max (ms) | restart: API answers (ms) | restart: CPU over 3 resyncs (%) | restart: qemu-img runs |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {} | {:.2} | {} | {} | {:.1} | {:.1} / {:.1} / {:.1} | {:.0} / {:.0} / {:.0} | {:.0} | {:.2} | {} |",
            r.n,
            r.vms,
            r.snapshots,
            r.apply_ms,
            r.disks_ready_s,
            r.snapshots_ready_s,
            r.runs_made,
            r.idle_cpu_pct,
            r.idle_runs,
            if r.idle_wal_written { "yes" } else { "no" },
            r.pass_ms,
            r.get.0,
            r.get.1,
            r.get.2,
            r.list.0,
            r.list.1,
            r.list.2,
            r.restart_api_ms,
            r.restart_cpu_pct,
            r.restart_runs,
        );
    }
    if stampede_disks > 0 {
        stampede(stampede_disks, resync);
    }
}
