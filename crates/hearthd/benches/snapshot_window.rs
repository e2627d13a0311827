//! Benchmark (not a test): the freeze window of a consistent snapshot as the
//! guest sees it, the host-side window, and request → Ready.
//!
//! Matrix: 1 and 4 disks × 64 MiB and 4 GiB disks, plus a snapshot of one
//! disk of a 4-disk VM (64 MiB; only that disk's filesystem is frozen). The base images are made
//! here (sparse raw file, `mkfs.ext4`, `qemu-img convert -O qcow2`) in a
//! directory handed to hearthd as an extra `--image-root`; every disk is a
//! copy-on-write overlay over its size's base image, and the guest mounts each
//! ext4 `/dev/vdX` at `/mnt/vdX`.
//!
//! One VM per configuration is booted, all five up at once, and the
//! configurations take turns (round r starts with configuration r mod 5), so
//! a change in the shared host's load during the run hits them alike. In each
//! of REPS rounds (default 5, `HEARTH_BENCH_REPS`), for each configuration:
//!   1. one `/bin/stallwatch /mnt/vdX/stall.dat SECONDS` (default 8 s,
//!      `HEARTH_BENCH_STALL_SECONDS`) per disk is started in the background
//!      through the guest agent (`/v1/.../agent/exec`): it appends small
//!      records with write(2) every ~1 ms and reports the longest gaps between
//!      consecutive completed writes (a write to a frozen ext4 blocks until
//!      the thaw) with their CLOCK_MONOTONIC times;
//!   2. guest and host clocks are related (`stallwatch -t` through the agent,
//!      bracketed by host timestamps), then a snapshot is applied (1 disk, or one
//!      disk of four: a VirtualDiskSnapshot; 4 disks: a VirtualMachineSnapshot) and timed from
//!      just before the HTTP apply until `status.phase` is Ready;
//!   3. after the writers end, their reports are read. Per disk, the stall of
//!      the cut is the longest gap overlapping the span request → Ready (the
//!      freeze cannot lie elsewhere); the guest-seen window of a repetition is
//!      the longest of those over its disks. The longest gap of the whole run
//!      is reported too, with whether it was the cut's.
//!
//! Before the repetitions, one control run of the same writers without a
//! snapshot shows the stalls the guest has anyway (TCG, a shared host). After
//! them, a diagnosis: the guest freezes and thaws its filesystems itself
//! (busybox `fsfreeze`, one after another as qemu-ga does) while the writers
//! run, timing each step, to show where the window goes.
//!
//! Prints markdown tables (summary, the targets of issue 4, every repetition).
//! Run: `cargo bench -p hearthd --bench snapshot_window`. `cargo test` only
//! builds it; without `--bench` (which `cargo bench` passes) it does nothing.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::{all_qemus, clock_offset, loadavg, stats};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// Status poll interval while timing request → Ready.
const POLL: Duration = Duration::from_millis(20);
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const SNAP_TIMEOUT: Duration = Duration::from_secs(120);
/// Rounds of the in-guest freeze diagnosis per configuration.
const DIAG_ROUNDS: usize = 3;

struct Config {
    disks: usize,
    size: u64,
    label: &'static str,
    /// A snapshot of the first disk only (a VirtualDiskSnapshot), however
    /// many disks the VM has: the guest freezes only that disk's filesystem.
    one_disk: bool,
}

impl Config {
    fn snapshot_label(&self) -> &'static str {
        match (self.disks, self.one_disk) {
            (1, _) => "disk",
            (_, true) => "one disk",
            _ => "VM",
        }
    }
}

#[derive(Default)]
struct Rep {
    /// The stall during the cut, longest over all disks, and each disk's
    /// (for the control run: the longest stall of the run).
    guest_ms: f64,
    per_disk_ms: Vec<f64>,
    /// The longest stall of the whole run, over all disks.
    largest_ms: f64,
    /// Width of the guest/host clock relation (ms).
    sync_ms: f64,
    /// The writers' normal pace: median gap, largest over disks.
    median_gap_ms: f64,
    writes: u64,
    host_window_ms: Option<u64>,
    request_to_ready_ms: f64,
    consistent: bool,
    /// On every disk, the run's longest stall was the one during the cut.
    stall_in_cut: bool,
    /// The writers were still writing after the snapshot was Ready.
    covered: bool,
}

/// The in-guest freeze diagnosis: medians over rounds, in ms.
#[derive(Default)]
struct Diag {
    /// FIFREEZE of each filesystem, in the order frozen.
    freeze_ms: Vec<f64>,
    /// FIFREEZE of all, then FITHAW of all: the first one's frozen span.
    all_frozen_ms: f64,
    /// The same with one filesystem only (the last one frozen above).
    one_frozen_ms: f64,
    /// What one process start costs in the guest (`busybox true` + the
    /// clock probe): every step above includes about that much.
    spawn_ms: f64,
    /// The guest's fsfreeze hook (`/etc/hearth/fsfreeze-hook thaw`), which
    /// qemu-ga runs before a freeze and after a thaw, outside the frozen span
    /// but inside the host-side window.
    hook_ms: f64,
}

struct Outcome {
    config: Config,
    vm: String,
    disks: Vec<String>,
    devs: Vec<String>,
    accelerator: String,
    baseline: Rep,
    reps: Vec<Rep>,
    diag: Diag,
    load: Vec<String>,
    other_qemus: usize,
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "snapshot_window: a benchmark; run it with `cargo bench -p hearthd --bench snapshot_window`"
        );
        return;
    }
    let reps: usize = env_or("HEARTH_BENCH_REPS", 5);
    let seconds: u64 = env_or("HEARTH_BENCH_STALL_SECONDS", 8);

    let images = tempfile::Builder::new()
        .prefix("hearth-bench-images-")
        .tempdir()
        .expect("tempdir");
    let mut bases = Vec::new();
    for (size, label) in [(64 * MIB, "64MiB"), (4 * GIB, "4GiB")] {
        bases.push((size, make_base(images.path(), size, label)));
    }
    let root = images.path().to_str().expect("utf-8 temp path").to_string();
    let d = Daemon::start_with(&["--image-root", &root]);

    let configs = [
        Config {
            disks: 1,
            size: 64 * MIB,
            label: "64MiB",
            one_disk: false,
        },
        Config {
            disks: 1,
            size: 4 * GIB,
            label: "4GiB",
            one_disk: false,
        },
        Config {
            disks: 4,
            size: 64 * MIB,
            label: "64MiB",
            one_disk: false,
        },
        Config {
            disks: 4,
            size: 4 * GIB,
            label: "4GiB",
            one_disk: false,
        },
        // One disk of the four: the window should be the 1-disk VM's.
        Config {
            disks: 4,
            size: 64 * MIB,
            label: "64MiB",
            one_disk: true,
        },
    ];
    let mut outcomes: Vec<Outcome> = configs
        .into_iter()
        .map(|config| {
            let base = &bases
                .iter()
                .find(|(s, _)| *s == config.size)
                .expect("base")
                .1;
            boot(&d, config, base)
        })
        .collect();

    for o in &mut outcomes {
        o.baseline = one_rep(&d, &o.vm, &o.devs, seconds, None);
        eprintln!(
            "snapshot_window: {}: control (no snapshot): longest stall {:.1} ms (per disk {:?}), median gap {:.2} ms",
            o.vm, o.baseline.guest_ms, o.baseline.per_disk_ms, o.baseline.median_gap_ms
        );
    }
    let n = outcomes.len();
    for round in 0..reps {
        for k in 0..n {
            let o = &mut outcomes[(round + k) % n];
            o.other_qemus = o
                .other_qemus
                .max(all_qemus().saturating_sub(d.qemu_pids().len()));
            let r = snapshot_rep(&d, o, round, seconds);
            eprintln!(
                "snapshot_window: {} round {}: guest {:.1} ms (per disk {:?}; longest of run {:.1}), host freezeWindowMs {:?}, request → Ready {:.0} ms, consistent {}, clock ±{:.0} ms",
                o.vm,
                round + 1,
                r.guest_ms,
                r.per_disk_ms,
                r.largest_ms,
                r.host_window_ms,
                r.request_to_ready_ms,
                r.consistent,
                r.sync_ms
            );
            o.reps.push(r);
            o.load.push(loadavg());
        }
    }
    // (The one-disk configuration's VM is like the other 4-disk 64 MiB one.)
    for o in outcomes.iter_mut().filter(|o| !o.config.one_disk) {
        o.diag = diagnose(&d, &o.vm, &o.devs, seconds);
        eprintln!(
            "snapshot_window: {}: in-guest fsfreeze: per fs {:?} ms; all frozen {:.1} ms; one frozen {:.1} ms; process start {:.1} ms; hook {:.1} ms",
            o.vm,
            o.diag
                .freeze_ms
                .iter()
                .map(|v| format!("{v:.1}"))
                .collect::<Vec<_>>(),
            o.diag.all_frozen_ms,
            o.diag.one_frozen_ms,
            o.diag.spawn_ms,
            o.diag.hook_ms
        );
    }
    for o in &outcomes {
        let (s, v) = d.request("DELETE", &format!("/v1/virtualmachines/{}", o.vm), None);
        assert_eq!(s, 200, "delete vm: {v}");
    }
    wait_until("VMs gone", Duration::from_secs(120), || {
        d.qemu_pids().is_empty()
    });
    print_tables(&outcomes, seconds);
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A base image: sparse raw file → ext4 → qcow2. Inode tables and journal
/// are initialised here (not lazily by the guest's ext4lazyinit thread, whose
/// background writes would scale with disk size and disturb the measurement).
fn make_base(dir: &Path, size: u64, label: &str) -> PathBuf {
    let started = Instant::now();
    let raw = dir.join(format!("base-{label}.raw"));
    let qcow = dir.join(format!("base-{label}.qcow2"));
    std::fs::File::create(&raw)
        .and_then(|f| f.set_len(size))
        .expect("sparse raw file");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&raw));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    std::fs::remove_file(&raw).expect("remove raw");
    let bytes = std::fs::metadata(&qcow).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "snapshot_window: base image {} ({:.1} MiB file) made in {} ms",
        qcow.display(),
        bytes as f64 / MIB as f64,
        started.elapsed().as_millis()
    );
    qcow
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn apply(d: &Daemon, items: Vec<Value>) {
    let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
    assert_eq!(status, 200, "apply: {v}");
}

fn get(d: &Daemon, plural: &str, name: &str) -> Option<Value> {
    match d.request("GET", &format!("/v1/{plural}/{name}"), None) {
        (200, v) => Some(v),
        (404, _) => None,
        (s, v) => panic!("GET {plural}/{name}: {s} {v}"),
    }
}

/// Runs a shell script in the guest; returns (exit code, stdout).
fn exec(d: &Daemon, vm: &str, script: &str) -> (i64, String) {
    let (status, v) = d.request(
        "POST",
        &format!("/v1/virtualmachines/{vm}/agent/exec"),
        Some(&json!({"path": "/bin/sh", "args": ["-c", script]})),
    );
    assert_eq!(status, 200, "exec {script}: {v}");
    (
        v["exitCode"].as_i64().unwrap_or(-1),
        v["stdout"].as_str().unwrap_or_default().to_string(),
    )
}

/// The guest's device names of the first `n` disks: vda, vdb, ...
fn devs(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("vd{}", char::from(b'a' + i as u8)))
        .collect()
}

/// Boots the configuration's VM (its disks: overlays over `base`) and checks
/// that the guest mounted every disk.
fn boot(d: &Daemon, config: Config, base: &Path) -> Outcome {
    let vm = format!(
        "w{}-{}{}",
        config.disks,
        config.label.to_ascii_lowercase(),
        if config.one_disk { "-one" } else { "" }
    );
    let disks: Vec<String> = (0..config.disks).map(|i| format!("{vm}-d{i}")).collect();
    eprintln!(
        "snapshot_window: {} disk(s) × {}: booting VM {vm}",
        config.disks, config.label
    );
    let mut items: Vec<Value> = disks
        .iter()
        .map(|n| {
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                   "metadata": {"name": n}, "spec": {"source": {"image": base}}})
        })
        .collect();
    let disk_refs: Vec<&str> = disks.iter().map(String::as_str).collect();
    let text = vm_yaml(&vm, "AlwaysOn", &disk_refs, "");
    items.extend(
        hearth_api::parse_documents(&text, "snapshot_window")
            .expect("bench manifest")
            .iter()
            .map(|o| serde_json::to_value(o).expect("object to JSON")),
    );
    apply(d, items);
    let v = d.wait_agent(&vm);
    let accelerator = v["status"]["accelerator"]
        .as_str()
        .unwrap_or("?")
        .to_string();
    let devs = devs(config.disks);
    let (_, mounts) = exec(d, &vm, "grep ' /mnt/vd' /proc/mounts | cut -d' ' -f1,2");
    for dev in &devs {
        assert!(
            mounts.contains(&format!("/mnt/{dev}")),
            "/mnt/{dev} not mounted in the guest: {mounts}"
        );
    }
    let (_, df) = exec(d, &vm, "df -m /mnt/vd? | tail -n +2");
    eprintln!("snapshot_window: {vm}: guest df -m:\n{df}");
    Outcome {
        config,
        vm,
        disks,
        devs,
        accelerator,
        baseline: Rep::default(),
        reps: Vec::new(),
        diag: Diag::default(),
        load: vec![loadavg()],
        other_qemus: 0,
    }
}

/// One repetition with a snapshot (1 disk: a VirtualDiskSnapshot; more: a
/// VirtualMachineSnapshot).
fn snapshot_rep(d: &Daemon, o: &Outcome, round: usize, seconds: u64) -> Rep {
    let snap = format!("{}-s{round}", o.vm);
    let (plural, item) = if o.disks.len() == 1 || o.config.one_disk {
        (
            "virtualdisksnapshots",
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDiskSnapshot",
                   "metadata": {"name": snap},
                   "spec": {"virtualDiskName": o.disks[0], "requiredConsistency": true}}),
        )
    } else {
        (
            "virtualmachinesnapshots",
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachineSnapshot",
                   "metadata": {"name": snap},
                   "spec": {"virtualMachineName": o.vm, "requiredConsistency": true}}),
        )
    };
    one_rep(d, &o.vm, &o.devs, seconds, Some((plural, &snap, item)))
}

/// Starts one writer per disk for `seconds` and waits until each has written.
fn start_writers(d: &Daemon, vm: &str, devs: &[String], seconds: u64) {
    let script: String = devs
        .iter()
        .map(|dev| {
            format!(
                "rm -f /mnt/{dev}/stall.dat /run/stall-{dev}.out; \
                 /bin/stallwatch /mnt/{dev}/stall.dat {seconds} > /run/stall-{dev}.out 2>&1 &\n"
            )
        })
        .collect();
    let (code, _) = exec(d, vm, &script);
    assert_eq!(code, 0, "starting the writers");
    let check: String = devs
        .iter()
        .map(|dev| format!("test -s /mnt/{dev}/stall.dat && "))
        .collect::<String>()
        + "true";
    wait_until("writers started", Duration::from_secs(20), || {
        exec(d, vm, &check).0 == 0
    });
}

/// Waits until every writer has reported and returns the reports.
fn collect_writers(d: &Daemon, vm: &str, devs: &[String]) -> Vec<Report> {
    let script: String = devs
        .iter()
        .map(|dev| format!("echo dev={dev} $(cat /run/stall-{dev}.out 2>/dev/null)\n"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, out) = exec(d, vm, &script);
        let lines: Vec<&str> = out.lines().collect();
        if lines.len() == devs.len() && lines.iter().all(|l| l.contains("top_gaps=")) {
            return lines.into_iter().map(parse_report).collect();
        }
        assert!(Instant::now() < deadline, "writers did not report: {out}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One writer's report.
struct Report {
    max_stall: f64,
    writes: u64,
    median_gap: f64,
    end: f64,
    /// (start, length) in guest ms, longest first.
    gaps: Vec<(f64, f64)>,
}

fn parse_report(line: &str) -> Report {
    let field = |key: &str| -> &str {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("no {key} in writer report: {line}"))
    };
    let num = |key: &str| -> f64 {
        field(key)
            .parse()
            .unwrap_or_else(|_| panic!("bad {key} in writer report: {line}"))
    };
    let gaps = field("top_gaps")
        .split(',')
        .filter_map(|g| {
            let (a, b) = g.split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    Report {
        max_stall: num("max_stall_ms"),
        writes: num("writes") as u64,
        median_gap: num("median_gap_ms"),
        end: num("end_ms"),
        gaps,
    }
}

/// Runs the writers once; with a snapshot, takes it while they write.
fn one_rep(
    d: &Daemon,
    vm: &str,
    devs: &[String],
    seconds: u64,
    snapshot: Option<(&str, &str, Value)>,
) -> Rep {
    let epoch = Instant::now();
    let host_ms = || epoch.elapsed().as_secs_f64() * 1e3;
    start_writers(d, vm, devs, seconds);

    let mut rep = Rep::default();
    // The span request → Ready in guest time, widened by the clock relation.
    let mut cut_span = None;
    if let Some((plural, name, item)) = snapshot {
        let (lo, hi) = clock_offset(epoch, |cmd| exec(d, vm, cmd));
        rep.sync_ms = hi - lo;
        std::thread::sleep(Duration::from_millis(200));
        let requested = host_ms();
        let t0 = Instant::now();
        apply(d, vec![item]);
        let s = loop {
            let s = get(d, plural, name).expect("snapshot exists after apply");
            let phase = s["status"]["phase"].as_str().unwrap_or_default();
            if phase == "Ready" || phase == "Failed" {
                break s;
            }
            assert!(
                t0.elapsed() < SNAP_TIMEOUT,
                "{plural}/{name} not final: {s:#}"
            );
            std::thread::sleep(POLL);
        };
        rep.request_to_ready_ms = t0.elapsed().as_secs_f64() * 1e3;
        let ready = host_ms();
        assert_eq!(s["status"]["phase"], "Ready", "{plural}/{name}: {s:#}");
        rep.consistent = s["status"]["consistent"] == true;
        rep.host_window_ms = s["status"]["freezeWindowMs"].as_u64();
        cut_span = Some((requested - hi, ready - lo));
    }

    let remaining = Duration::from_secs(seconds).saturating_sub(epoch.elapsed());
    std::thread::sleep(remaining + Duration::from_millis(300));
    let reports = collect_writers(d, vm, devs);
    rep.stall_in_cut = cut_span.is_some();
    rep.covered = cut_span.is_some();
    for r in &reports {
        rep.largest_ms = rep.largest_ms.max(r.max_stall);
        rep.median_gap_ms = rep.median_gap_ms.max(r.median_gap);
        rep.writes += r.writes;
        let stall = match cut_span {
            Some((from, to)) => {
                let in_cut = r
                    .gaps
                    .iter()
                    .filter(|(s, len)| *s <= to && s + len >= from)
                    .map(|g| g.1)
                    .fold(0.0, f64::max);
                if in_cut < r.max_stall {
                    rep.stall_in_cut = false;
                }
                if r.end <= to {
                    rep.covered = false;
                }
                in_cut
            }
            None => r.max_stall,
        };
        rep.per_disk_ms.push(stall);
        rep.guest_ms = rep.guest_ms.max(stall);
    }
    rep
}

/// Freezes the guest's filesystems from inside the guest, one after another
/// (as qemu-ga does), then thaws them, with the writers running; and the same
/// for one filesystem. Times every step with the guest's clock.
fn diagnose(d: &Daemon, vm: &str, devs: &[String], seconds: u64) -> Diag {
    // The guest freezes as it does on its own: the expedited RCU grace
    // periods of hearth's last cut (snapshots.md, step 4a) are over.
    wait_until("rcu_expedited reset", Duration::from_secs(20), || {
        d.agent_sh(vm, "cat /sys/kernel/rcu_expedited").1.trim() == "0"
    });
    // The order qemu-ga freezes in: the reverse of the mount order.
    let order: Vec<&String> = devs.iter().rev().collect();
    let mut script = String::from("t() { /bin/stallwatch -t; }\nt\nbusybox true; t\n");
    for dev in &order {
        script += &format!("fsfreeze --freeze /mnt/{dev}; t\n");
    }
    for dev in order.iter().rev() {
        script += &format!("fsfreeze --unfreeze /mnt/{dev}\n");
    }
    script += "t\nsleep 0.3\nt\n";
    let last = order.last().expect("a disk");
    script += &format!("fsfreeze --freeze /mnt/{last}; fsfreeze --unfreeze /mnt/{last}; t\n");
    // Never leave the guest frozen, whatever failed above.
    for dev in devs {
        script += &format!("fsfreeze --unfreeze /mnt/{dev} 2>/dev/null\n");
    }
    script += "t; /etc/hearth/fsfreeze-hook thaw; t\n";

    let mut per_fs: Vec<Vec<f64>> = vec![Vec::new(); devs.len()];
    let (mut all, mut one, mut spawn, mut hook) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..DIAG_ROUNDS {
        start_writers(d, vm, devs, seconds.min(4));
        std::thread::sleep(Duration::from_millis(300));
        let (_, out) = exec(d, vm, &script);
        let t: Vec<f64> = out.lines().map(guest_now).collect();
        let n = devs.len();
        assert_eq!(t.len(), n + 7, "diagnosis output: {out}");
        hook.push(t[n + 6] - t[n + 5]);
        spawn.push(t[1] - t[0]);
        for (i, v) in per_fs.iter_mut().enumerate() {
            v.push(t[i + 2] - t[i + 1]);
        }
        all.push(t[n + 2] - t[1]);
        one.push(t[n + 4] - t[n + 3]);
        collect_writers(d, vm, devs);
    }
    Diag {
        freeze_ms: per_fs.iter().map(|v| stats(v).0).collect(),
        all_frozen_ms: stats(&all).0,
        one_frozen_ms: stats(&one).0,
        spawn_ms: stats(&spawn).0,
        hook_ms: stats(&hook).0,
    }
}

fn print_tables(outcomes: &[Outcome], seconds: u64) {
    let mut accels: Vec<&str> = outcomes.iter().map(|r| r.accelerator.as_str()).collect();
    accels.sort();
    accels.dedup();
    let n = outcomes.first().map_or(0, |r| r.reps.len());

    println!();
    println!(
        "Medians of {n} repetitions (min–max in brackets); accelerator: {}; host: {} CPUs; writers: stallwatch, {seconds} s, one write(2) per ~1 ms per disk.",
        accels.join(", "),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!(
        "| disks | snapshot of | disk size | guest-seen window (ms) | per disk vda… (median ms) | host freezeWindowMs | request → Ready (ms) | control: longest stall, no snapshot (ms) | consistent | load avg (1 min) | other QEMUs on host |"
    );
    println!("|---:|---|---|---:|---|---:|---:|---:|---|---|---:|");
    for r in outcomes {
        let guest: Vec<f64> = r.reps.iter().map(|x| x.guest_ms).collect();
        let host: Vec<f64> = r
            .reps
            .iter()
            .filter_map(|x| x.host_window_ms.map(|v| v as f64))
            .collect();
        let ready: Vec<f64> = r.reps.iter().map(|x| x.request_to_ready_ms).collect();
        let consistent = r.reps.iter().filter(|x| x.consistent).count();
        let per_disk: Vec<String> = (0..r.config.disks)
            .map(|i| {
                let v: Vec<f64> = r
                    .reps
                    .iter()
                    .filter_map(|x| x.per_disk_ms.get(i).copied())
                    .collect();
                format!("{:.1}", stats(&v).0)
            })
            .collect();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {consistent}/{} | {} | {} |",
            r.config.disks,
            r.config.snapshot_label(),
            r.config.label,
            fmt_stats(&guest, 1),
            per_disk.join(" / "),
            fmt_stats(&host, 0),
            fmt_stats(&ready, 0),
            r.baseline.guest_ms,
            r.reps.len(),
            r.load.join(" "),
            r.other_qemus
        );
    }

    // The targets of issue 4, on the guest-seen medians.
    let med = |disks: usize, size: u64| -> f64 {
        outcomes
            .iter()
            .find(|r| r.config.disks == disks && r.config.size == size && !r.config.one_disk)
            .map(|r| stats(&r.reps.iter().map(|x| x.guest_ms).collect::<Vec<_>>()).0)
            .unwrap_or(f64::NAN)
    };
    // The window of a one-disk snapshot of the 4-disk VM: its disk's stall
    // (the other disks' writers are not frozen; their gaps are the guest's
    // usual ones).
    let one_of_four = outcomes.iter().find(|r| r.config.one_disk).map(|r| {
        (
            stats(
                &r.reps
                    .iter()
                    .filter_map(|x| x.per_disk_ms.first().copied())
                    .collect::<Vec<_>>(),
            )
            .0,
            stats(&r.reps.iter().map(|x| x.guest_ms).collect::<Vec<_>>()).0,
        )
    });
    println!();
    println!("| target | measured (guest-seen medians) | met |");
    println!("|---|---|---|");
    for disks in [1, 4] {
        let (small, big) = (med(disks, 64 * MIB), med(disks, 4 * GIB));
        let diff = (big - small) / small * 100.0;
        println!(
            "| window independent of disk size (within 10 %), {disks} disk(s) | 64 MiB {small:.1} ms, 4 GiB {big:.1} ms: {diff:+.0} % | {} |",
            yes(diff.abs() <= 10.0)
        );
    }
    for (size, label) in [(64 * MIB, "64 MiB"), (4 * GIB, "4 GiB")] {
        let (one, four) = (med(1, size), med(4, size));
        let ratio = four / one;
        println!(
            "| 4 disks under 2 × 1 disk, {label} | 1 disk {one:.1} ms, 4 disks {four:.1} ms: {ratio:.2}× | {} |",
            yes(ratio < 2.0)
        );
    }

    if let Some((disk, window)) = one_of_four {
        let one = med(1, 64 * MIB);
        println!(
            "| one-disk snapshot of the 4-disk VM equals the 1-disk VM's window (within 25 %), 64 MiB | 1-disk VM {one:.1} ms; one of four: its disk {disk:.1} ms ({:+.0} %), longest over all four disks {window:.1} ms | {} |",
            (disk - one) / one * 100.0,
            yes(((disk - one) / one).abs() <= 0.25)
        );
    }

    println!();
    println!(
        "In-guest diagnosis (busybox fsfreeze with the writers running, medians of {DIAG_ROUNDS}):"
    );
    println!();
    println!(
        "| disks | disk size | `fsfreeze --freeze` per filesystem, in qemu-ga's order (ms) | first freeze → all thawed (ms) | one filesystem: freeze → thawed (ms) | one process start (ms, included in each step) | fsfreeze hook, one run (ms) |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|");
    for r in outcomes.iter().filter(|r| !r.config.one_disk) {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.config.disks,
            r.config.label,
            r.diag
                .freeze_ms
                .iter()
                .map(|v| format!("{v:.1}"))
                .collect::<Vec<_>>()
                .join(" / "),
            r.diag.all_frozen_ms,
            r.diag.one_frozen_ms,
            r.diag.spawn_ms,
            r.diag.hook_ms
        );
    }

    println!();
    println!("Every repetition:");
    println!();
    println!(
        "| disks | size | rep | guest-seen window (ms) | per disk vda… (ms) | longest stall of the run (ms) | median write gap (ms) | writes | host freezeWindowMs | request → Ready (ms) | consistent | longest stall was the cut's | writers outlived the cut | clock relation width (ms) |"
    );
    println!("|---:|---|---|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|");
    for r in outcomes {
        let rows = std::iter::once(("control".to_string(), &r.baseline, false)).chain(
            r.reps
                .iter()
                .enumerate()
                .map(|(i, x)| ((i + 1).to_string(), x, true)),
        );
        for (rep, x, snap) in rows {
            let dash = || "–".to_string();
            println!(
                "| {} | {}{} | {rep} | {:.1} | {} | {:.1} | {:.2} | {} | {} | {} | {} | {} | {} | {} |",
                r.config.disks,
                r.config.label,
                if r.config.one_disk { ", one disk" } else { "" },
                x.guest_ms,
                x.per_disk_ms
                    .iter()
                    .map(|v| format!("{v:.1}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                x.largest_ms,
                x.median_gap_ms,
                x.writes,
                x.host_window_ms.map_or_else(dash, |v| v.to_string()),
                if snap {
                    format!("{:.0}", x.request_to_ready_ms)
                } else {
                    dash()
                },
                if snap { yes(x.consistent) } else { "–" },
                if snap { yes(x.stall_in_cut) } else { "–" },
                if snap { yes(x.covered) } else { "–" },
                if snap {
                    format!("{:.0}", x.sync_ms)
                } else {
                    dash()
                },
            );
        }
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// "median (min–max)".
fn fmt_stats(xs: &[f64], decimals: usize) -> String {
    if xs.is_empty() {
        return "–".into();
    }
    let (med, min, max) = stats(xs);
    format!("{med:.decimals$} ({min:.decimals$}–{max:.decimals$})")
}

/// The guest's CLOCK_MONOTONIC in ms, from a `stallwatch -t` line.
fn guest_now(line: &str) -> f64 {
    line.trim()
        .strip_prefix("now_ms=")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("stallwatch -t printed: {line}"))
}
