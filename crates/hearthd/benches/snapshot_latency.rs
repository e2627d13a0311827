//! Benchmark (not a test): a snapshot end to end, as a user takes it, under
//! hearth and under libvirt, side by side on the same guest in one run.
//!
//! The guest is the small test guest (guest/build.sh: kernel, initramfs with
//! qemu-ga and `/bin/stallwatch`), 256 MiB, 1 vCPU, q35, TCG on both sides,
//! with 1 or 4 virtio disks, each a qcow2 overlay over the same 64 MiB ext4
//! base image, mounted by the guest at `/mnt/vdX`. Four VMs run at once:
//! hearth's `l1` and `l4`, and libvirt's transient domains (`virsh create`)
//! `hearth-bench-l1` and `hearth-bench-l4` (acpi, a qemu-ga channel, no
//! network). libvirt is made ready by `support/libvirt-up.sh` (see
//! docs/benchmarks.md for installing it; benchmark only, never CI).
//!
//! Each of REPS rounds (default 10, `HEARTH_BENCH_REPS`), for each disk count
//! and each side (which side goes first alternates by round), one snapshot
//! while one `stallwatch` writer per disk appends ~1 record per ms:
//! - hearth: `hearth snapshot disk l1-d0 --wait` (1 disk) or `hearth
//!   snapshot vm l4 --wait` (4 disks), the real CLI as a new process;
//! - libvirt: `virsh snapshot-create-as DOM --disk-only --quiesce --atomic
//!   --no-metadata`, also a new process.
//!
//! - limit: on libvirt's guest, `guest-fsfreeze-freeze` then
//!   `guest-fsfreeze-thaw` through `virsh qemu-agent-command`, back to back
//!   in one virsh session (one process, one connection): the shortest
//!   window the agent itself allows, no snapshot at all;
//! - limit, expedited: the same, after the step hearth runs before every
//!   freeze (`hearth_engine::snapshot::expedite::SCRIPT` by `guest-exec`,
//!   waited for), so the two limits show what hearth adds to the same freeze.
//!
//! Every repetition first waits until the guest's `rcu_expedited` is back
//! to 0 (an earlier repetition's step has been undone by the guest).
//!
//! Measured: the command's wall time (spawn to exit); the guest-seen window
//! (the longest gap between the writer's completed writes that overlaps the
//! command, over the disks; the guest's clock is related to the host's as in
//! `snapshot_window`); for hearth also `status.freezeWindowMs` and where the
//! time went, from hearthd's own records on the host's wall clock: the
//! snapshot object's `creationTimestamp` (stored), the log lines `cut starts`
//! and `cut prepared`, the VM events `Freezing` and `Thawed` of the cut, the disk snapshot's
//! `Ready` event (the commit), and the CLI's exit.
//!
//! Run: `cargo bench -p hearthd --bench snapshot_latency` (root). Without
//! `--bench` (as `cargo test` builds it) it does nothing.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::libvirt::{self, URI as VIRSH_URI, run, virsh};
use support::{chmod, clock_offset, fmt, loadavg, rfc3339_ms, stats, unix_ms};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use serde_json::{Value, json};

/// How long a script in libvirt's guest may take.
const EXEC_TIMEOUT: Duration = Duration::from_secs(30);
/// The packages this benchmark needs besides libvirt's.
const ALSO_INSTALL: &str = "";
const SNAP_TIMEOUT: Duration = Duration::from_secs(60);

/// One side of the comparison.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Hearth,
    Libvirt,
    /// The floor: on libvirt's guest, the agent's own `guest-fsfreeze-freeze`
    /// then `guest-fsfreeze-thaw`, back to back in one virsh session.
    Limit,
    /// The same floor after the step hearth runs before a freeze
    /// (`hearth_engine::snapshot::expedite::SCRIPT` through `guest-exec`,
    /// waited for), so the tables show what hearth adds to the same freeze.
    LimitExpedited,
}

/// A running guest of either side.
#[derive(Clone)]
struct Guest {
    side: Side,
    /// hearth: the VM's name; libvirt: the domain's.
    name: String,
    disks: Vec<String>,
    devs: Vec<String>,
}

/// Per disk count: hearth's, libvirt's, the limit's and the expedited
/// limit's repetitions.
type Results = (usize, Vec<Rep>, Vec<Rep>, Vec<Rep>, Vec<Rep>);

#[derive(Default, Clone)]
struct Rep {
    wall_ms: f64,
    guest_ms: f64,
    host_window_ms: Option<f64>,
    consistent: bool,
    /// hearth only, ms from the CLI's spawn: stored, cut start, prepared,
    /// freeze sent, thaw replied, Ready committed.
    marks: Option<[f64; 6]>,
    /// hearth only: the cut's `Freezing` event says the freeze was expedited.
    expedited: bool,
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!(
            "snapshot_latency: a benchmark; run it with `cargo bench -p hearthd --bench snapshot_latency`"
        );
        return;
    }
    let reps: usize = env_or("HEARTH_BENCH_REPS", 10);
    let seconds: u64 = env_or("HEARTH_BENCH_STALL_SECONDS", 3);
    libvirt::up(&repo_root(), ALSO_INSTALL);

    let work = tempfile::Builder::new()
        .prefix("hearth-bench-latency-")
        .tempdir()
        .expect("tempdir");
    // libvirt's QEMU runs as libvirt-qemu: it must reach the files.
    chmod(work.path(), 0o755);
    let base = make_base(work.path());
    let root = work.path().to_str().expect("utf-8 temp path").to_string();
    let d = Daemon::start_with(&["--image-root", &root]);

    let mut pairs: Vec<(Guest, Guest)> = Vec::new();
    for n in [1usize, 4] {
        let h = boot_hearth(&d, n, &base);
        let l = boot_libvirt(work.path(), n, &base);
        pairs.push((h, l));
    }
    for (h, l) in &pairs {
        d.wait_agent(&h.name);
        libvirt::wait_agent(&l.name, Duration::from_secs(120));
        for g in [h, l] {
            let (_, mounts) = exec(&d, g, "grep ' /mnt/vd' /proc/mounts | cut -d' ' -f2");
            for dev in &g.devs {
                assert!(
                    mounts.contains(&format!("/mnt/{dev}")),
                    "{:?} {}: /mnt/{dev} not mounted: {mounts}",
                    g.side,
                    g.name
                );
            }
        }
    }

    let mut results: Vec<Results> = pairs
        .iter()
        .map(|(h, _)| {
            (
                h.disks.len(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
            )
        })
        .collect();
    let mut load = Vec::new();
    for round in 0..reps {
        for (k, (h, l)) in pairs.iter().enumerate() {
            let limit = Guest {
                side: Side::Limit,
                name: l.name.clone(),
                disks: l.disks.clone(),
                devs: l.devs.clone(),
            };
            let limit_exp = Guest {
                side: Side::LimitExpedited,
                ..limit.clone()
            };
            let order = if round % 2 == 0 {
                [h, l, &limit, &limit_exp]
            } else {
                [l, h, &limit_exp, &limit]
            };
            for g in order {
                let r = one_rep(&d, g, round, seconds);
                eprintln!(
                    "snapshot_latency: {:?} {} disk(s) round {}: wall {:.0} ms, guest-seen {:.1} ms, host window {:?}, marks {:?}",
                    g.side,
                    g.disks.len(),
                    round + 1,
                    r.wall_ms,
                    r.guest_ms,
                    r.host_window_ms,
                    r.marks
                );
                match g.side {
                    Side::Hearth => results[k].1.push(r),
                    Side::Libvirt => results[k].2.push(r),
                    Side::Limit => results[k].3.push(r),
                    Side::LimitExpedited => results[k].4.push(r),
                }
            }
        }
        load.push(loadavg());
    }
    for (h, l) in &pairs {
        let _ = d.request("DELETE", &format!("/v1/virtualmachines/{}", h.name), None);
        let _ = virsh(&["destroy", &l.name]);
    }
    wait_until("VMs gone", Duration::from_secs(120), || {
        d.qemu_pids().is_empty()
    });
    print_tables(&results, &load, seconds);
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The 64 MiB ext4 base image, as `snapshot_window` makes it.
fn make_base(dir: &Path) -> PathBuf {
    let raw = dir.join("base.raw");
    let qcow = dir.join("base.qcow2");
    std::fs::File::create(&raw)
        .and_then(|f| f.set_len(64 << 20))
        .expect("sparse raw file");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&raw));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    std::fs::remove_file(&raw).expect("remove raw");
    chmod(&qcow, 0o644);
    qcow
}

fn devs(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("vd{}", char::from(b'a' + i as u8)))
        .collect()
}

fn boot_hearth(d: &Daemon, n: usize, base: &Path) -> Guest {
    let vm = format!("l{n}");
    let disks: Vec<String> = (0..n).map(|i| format!("{vm}-d{i}")).collect();
    let mut items: Vec<Value> = disks
        .iter()
        .map(|name| {
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
                   "metadata": {"name": name}, "spec": {"source": {"image": base}}})
        })
        .collect();
    let refs: Vec<&str> = disks.iter().map(String::as_str).collect();
    let text = vm_yaml(&vm, "AlwaysOn", &refs, "");
    items.extend(
        hearth_api::parse_documents(&text, "snapshot_latency")
            .expect("bench manifest")
            .iter()
            .map(|o| serde_json::to_value(o).expect("object to JSON")),
    );
    let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
    assert_eq!(status, 200, "apply: {v}");
    Guest {
        side: Side::Hearth,
        name: vm,
        disks,
        devs: devs(n),
    }
}

/// A transient libvirt domain with the same guest, memory, CPU, machine and
/// kernel command line as hearth's VM (tests/common `vm_yaml`), its disks
/// overlays over the same base image.
fn boot_libvirt(dir: &Path, n: usize, base: &Path) -> Guest {
    let name = format!("hearth-bench-l{n}");
    // A domain left by an interrupted run.
    let _ = Command::new("virsh")
        .args(["-c", VIRSH_URI, "destroy", &name])
        .stderr(Stdio::null())
        .stdout(Stdio::null())
        .status();
    let ddir = dir.join(&name);
    std::fs::create_dir_all(&ddir).expect("domain dir");
    chmod(&ddir, 0o777);
    let g = guest_dir();
    let mut disks_xml = String::new();
    let mut disks = Vec::new();
    for (i, dev) in devs(n).iter().enumerate() {
        let file = ddir.join(format!("d{i}.qcow2"));
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(base)
            .arg(&file));
        disks_xml += &format!(
            "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='{}'/><target dev='{dev}' bus='virtio'/></disk>\n",
            file.display()
        );
        disks.push(dev.clone());
    }
    libvirt::create_domain(&name, &g, &ddir, &disks_xml);
    Guest {
        side: Side::Libvirt,
        name,
        disks,
        devs: devs(n),
    }
}

/// Runs a shell script in the guest; (exit code, stdout).
fn exec(d: &Daemon, g: &Guest, script: &str) -> (i64, String) {
    match g.side {
        Side::Limit | Side::LimitExpedited => exec(
            d,
            &Guest {
                side: Side::Libvirt,
                name: g.name.clone(),
                disks: Vec::new(),
                devs: Vec::new(),
            },
            script,
        ),
        Side::Hearth => {
            let (status, v) = d.request(
                "POST",
                &format!("/v1/virtualmachines/{}/agent/exec", g.name),
                Some(&json!({"path": "/bin/sh", "args": ["-c", script]})),
            );
            assert_eq!(status, 200, "exec {script}: {v}");
            (
                v["exitCode"].as_i64().unwrap_or(-1),
                v["stdout"].as_str().unwrap_or_default().to_string(),
            )
        }
        Side::Libvirt => libvirt::agent_sh(&g.name, script, EXEC_TIMEOUT),
    }
}

fn start_writers(d: &Daemon, g: &Guest, seconds: u64) {
    let script: String = g
        .devs
        .iter()
        .map(|dev| {
            format!(
                "rm -f /mnt/{dev}/stall.dat /run/stall-{dev}.out; \
                 /bin/stallwatch /mnt/{dev}/stall.dat {seconds} > /run/stall-{dev}.out 2>&1 &\n"
            )
        })
        .collect();
    let (code, _) = exec(d, g, &script);
    assert_eq!(code, 0, "starting the writers");
    let check: String = g
        .devs
        .iter()
        .map(|dev| format!("test -s /mnt/{dev}/stall.dat && "))
        .collect::<String>()
        + "true";
    wait_until("writers started", Duration::from_secs(20), || {
        exec(d, g, &check).0 == 0
    });
}

/// Every writer's gaps (start, length in guest ms) once all have reported.
fn collect_writers(d: &Daemon, g: &Guest) -> Vec<Vec<(f64, f64)>> {
    let script: String = g
        .devs
        .iter()
        .map(|dev| format!("echo dev={dev} $(cat /run/stall-{dev}.out 2>/dev/null)\n"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, out) = exec(d, g, &script);
        let lines: Vec<&str> = out.lines().collect();
        if lines.len() == g.devs.len() && lines.iter().all(|l| l.contains("top_gaps=")) {
            return lines
                .iter()
                .map(|l| {
                    let gaps = l
                        .split_whitespace()
                        .find_map(|kv| kv.strip_prefix("top_gaps="))
                        .unwrap_or_default();
                    gaps.split(',')
                        .filter_map(|x| {
                            let (a, b) = x.split_once(':')?;
                            Some((a.parse().ok()?, b.parse().ok()?))
                        })
                        .collect()
                })
                .collect();
        }
        assert!(Instant::now() < deadline, "writers did not report: {out}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn one_rep(d: &Daemon, g: &Guest, round: usize, seconds: u64) -> Rep {
    let epoch = Instant::now();
    let host_ms = || epoch.elapsed().as_secs_f64() * 1e3;
    start_writers(d, g, seconds);
    let (lo, hi) = clock_offset(epoch, |cmd| exec(d, g, cmd));
    std::thread::sleep(Duration::from_millis(200));
    // A freeze expedited by an earlier repetition (hearth's, or the
    // expedited limit's) is over before this one starts: the guest's
    // watcher has reset it.
    wait_until("rcu_expedited reset", Duration::from_secs(20), || {
        exec(d, g, "cat /sys/kernel/rcu_expedited").1.trim() == "0"
    });
    let snap = format!("{}-s{round}", g.name);
    let mut cmd = match g.side {
        Side::Hearth => {
            let args: Vec<String> = if g.disks.len() == 1 {
                vec!["snapshot".into(), "disk".into(), g.disks[0].clone()]
            } else {
                vec!["snapshot".into(), "vm".into(), g.name.clone()]
            };
            let mut args = args;
            args.extend(["--name".into(), snap.clone(), "--wait".into()]);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            d.cli_command(&refs, Stdio::null())
        }
        Side::Libvirt => {
            let mut c = Command::new("virsh");
            c.args([
                "-c",
                VIRSH_URI,
                "snapshot-create-as",
                &g.name,
                "--name",
                &snap,
                "--disk-only",
                "--quiesce",
                "--atomic",
                "--no-metadata",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            c
        }
        Side::Limit | Side::LimitExpedited => {
            let mut c = Command::new("virsh");
            c.args(["-c", VIRSH_URI])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        }
    };
    // The limit's two commands, read by virsh's shell from stdin.
    let session = format!(
        "qemu-agent-command {n} '{{\"execute\":\"guest-fsfreeze-freeze\"}}'\n\
         qemu-agent-command {n} '{{\"execute\":\"guest-fsfreeze-thaw\"}}'\n",
        n = g.name
    );
    if g.side == Side::LimitExpedited {
        let (code, out) = exec(d, g, hearth_engine::EXPEDITE_SCRIPT);
        assert!(
            code == 0 && out.trim() == "raised",
            "the step before the freeze: {code} {out}"
        );
    }
    let from = host_ms();
    let spawned = SystemTime::now();
    let t0 = Instant::now();
    let out = cmd
        .spawn()
        .and_then(|mut c| {
            if let Some(mut stdin) = c.stdin.take() {
                use std::io::Write as _;
                stdin.write_all(session.as_bytes())?;
            }
            c.wait_with_output()
        })
        .expect("snapshot command");
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    let to = host_ms();
    assert!(
        out.status.success(),
        "{:?} snapshot {snap}: {}{}",
        g.side,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(t0.elapsed() < SNAP_TIMEOUT);
    let mut rep = Rep {
        wall_ms,
        consistent: true,
        ..Rep::default()
    };
    if g.side == Side::Hearth {
        hearth_marks(d, g, &snap, unix_ms(spawned), &mut rep);
    }
    if matches!(g.side, Side::Limit | Side::LimitExpedited) {
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.matches("\"return\"").count(),
            2,
            "freeze and thaw both answered: {text}"
        );
    }
    let remaining = Duration::from_secs(seconds).saturating_sub(epoch.elapsed());
    std::thread::sleep(remaining + Duration::from_millis(300));
    let span = (from - hi, to - lo);
    for gaps in collect_writers(d, g) {
        let in_cut = gaps
            .iter()
            .filter(|(s, len)| *s <= span.1 && s + len >= span.0)
            .map(|x| x.1)
            .fold(0.0, f64::max);
        rep.guest_ms = rep.guest_ms.max(in_cut);
    }
    rep
}

/// Where hearth's time went, from its own records (host wall clock).
fn hearth_marks(d: &Daemon, g: &Guest, snap: &str, spawned: f64, rep: &mut Rep) {
    let (plural, object) = if g.disks.len() == 1 {
        ("virtualdisksnapshots", snap.to_string())
    } else {
        ("virtualmachinesnapshots", snap.to_string())
    };
    let (_, obj) = d.request("GET", &format!("/v1/{plural}/{object}"), None);
    assert_eq!(obj["status"]["phase"], "Ready", "{obj:#}");
    rep.consistent = obj["status"]["consistent"] == true;
    rep.host_window_ms = obj["status"]["freezeWindowMs"].as_f64();
    let stored = rfc3339_ms(&obj["metadata"]["creationTimestamp"]);
    let cut = obj["status"]["cutId"].as_u64().expect("cutId");
    let disk_snap = if g.disks.len() == 1 {
        snap.to_string()
    } else {
        obj["status"]["virtualDiskSnapshotNames"][0]
            .as_str()
            .expect("a disk snapshot")
            .to_string()
    };
    let prefix = format!("cut {cut}:");
    let vm_events = d.events("VirtualMachine", &g.name);
    let event_at = |events: &[Value], reason: &str, prefix: &str| {
        events
            .iter()
            .find(|e| {
                e["reason"] == reason
                    && e["message"].as_str().is_some_and(|m| m.starts_with(prefix))
            })
            .and_then(|e| rfc3339_ms(&e["time"]))
    };
    let freeze = event_at(&vm_events, "Freezing", &prefix);
    rep.expedited = vm_events.iter().any(|e| {
        e["reason"] == "Freezing"
            && e["message"].as_str().is_some_and(|m| {
                m.starts_with(&prefix) && m.contains("RCU grace periods expedited")
            })
    });
    let thaw = event_at(&vm_events, "Thawed", &prefix);
    let ready = event_at(&d.events("VirtualDiskSnapshot", &disk_snap), "Ready", "");
    let needle = format!("cut={cut} ");
    let log = d.log();
    let logged = |what: &str| {
        log.lines()
            .find(|l| l.contains(what) && l.contains(&needle))
            .and_then(|l| {
                l.split_whitespace()
                    .next()
                    .map(|t| Value::from(t.to_string()))
            })
            .and_then(|t| rfc3339_ms(&t))
    };
    let (start, prepared) = (logged("cut starts"), logged("cut prepared"));
    if let (Some(a), Some(b), Some(p), Some(c), Some(e), Some(f)) =
        (stored, start, prepared, freeze, thaw, ready)
    {
        rep.marks = Some([a, b, p, c, e, f].map(|t| t - spawned));
    }
}

fn med(xs: impl Iterator<Item = f64>) -> f64 {
    stats(&xs.collect::<Vec<_>>()).0
}

fn print_tables(results: &[Results], load: &[String], seconds: u64) {
    let n = results.first().map_or(0, |r| r.1.len());
    println!();
    println!(
        "Medians of {n} snapshots per side (min–max); TCG; host: {} CPUs; writers: stallwatch, {seconds} s, one write(2) per ~1 ms per disk; load avg (1 min) per round: {}.",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.join(" ")
    );
    println!();
    println!(
        "| disks | hearth CLI wall (ms) | virsh wall (ms) | wall ratio hearth/virsh | guest-seen window hearth (ms) | guest-seen window libvirt (ms) | window ratio | limit: agent freeze + thaw back to back, guest-seen (ms) | limit after the same expedite step, guest-seen (ms) | limit: its virsh session wall (ms) | hearth freezeWindowMs | hearth freezes expedited | hearth consistent |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|");
    for (disks, h, l, limit, limit_exp) in results {
        let me: Vec<f64> = limit_exp.iter().map(|r| r.guest_ms).collect();
        let mg: Vec<f64> = limit.iter().map(|r| r.guest_ms).collect();
        let mw: Vec<f64> = limit.iter().map(|r| r.wall_ms).collect();
        let hw: Vec<f64> = h.iter().map(|r| r.wall_ms).collect();
        let lw: Vec<f64> = l.iter().map(|r| r.wall_ms).collect();
        let hg: Vec<f64> = h.iter().map(|r| r.guest_ms).collect();
        let lg: Vec<f64> = l.iter().map(|r| r.guest_ms).collect();
        let hf: Vec<f64> = h.iter().filter_map(|r| r.host_window_ms).collect();
        println!(
            "| {disks} | {} | {} | {:.2} | {} | {} | {:.2} | {} | {} | {} | {} | {}/{} | {}/{} |",
            fmt(&hw, 0),
            fmt(&lw, 0),
            stats(&hw).0 / stats(&lw).0,
            fmt(&hg, 1),
            fmt(&lg, 1),
            stats(&hg).0 / stats(&lg).0,
            fmt(&mg, 1),
            fmt(&me, 1),
            fmt(&mw, 0),
            fmt(&hf, 0),
            h.iter().filter(|r| r.expedited).count(),
            h.len(),
            h.iter().filter(|r| r.consistent).count(),
            h.len()
        );
    }
    println!();
    println!(
        "Where hearth's time goes (medians, ms; each step from hearthd's own records on the host's wall clock):"
    );
    println!();
    println!(
        "| disks | CLI spawn → stored | stored → cut starts | cut starts → prepared | prepared → freeze sent | freeze sent → thaw replied | thaw → Ready (commit) | Ready → CLI exits | total (CLI wall) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (disks, h, _, _, _) in results {
        let with: Vec<(&Rep, [f64; 6])> =
            h.iter().filter_map(|r| r.marks.map(|m| (r, m))).collect();
        let step = |i: usize| -> f64 {
            med(with.iter().map(|(r, m)| match i {
                0 => m[0],
                6 => r.wall_ms - m[5],
                _ => m[i] - m[i - 1],
            }))
        };
        println!(
            "| {disks} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
            step(0),
            step(1),
            step(2),
            step(3),
            step(4),
            step(5),
            step(6),
            med(with.iter().map(|(r, _)| r.wall_ms))
        );
    }
    println!();
    println!("Every snapshot:");
    println!();
    println!(
        "| disks | side | rep | wall (ms) | guest-seen window (ms) | freezeWindowMs | stored / cut / prepared / freeze / thaw / Ready, ms after spawn |"
    );
    println!("|---:|---|---:|---:|---:|---:|---|");
    for (disks, h, l, limit, limit_exp) in results {
        for (side, reps) in [
            ("hearth", h),
            ("libvirt", l),
            ("limit", limit),
            ("limit, expedited", limit_exp),
        ] {
            for (i, r) in reps.iter().enumerate() {
                println!(
                    "| {disks} | {side} | {} | {:.0} | {:.1} | {} | {} |",
                    i + 1,
                    r.wall_ms,
                    r.guest_ms,
                    r.host_window_ms.map_or("–".into(), |v| format!("{v:.0}")),
                    r.marks.map_or("–".into(), |m| m
                        .iter()
                        .map(|v| format!("{v:.0}"))
                        .collect::<Vec<_>>()
                        .join(" / "))
                );
            }
        }
    }
}
