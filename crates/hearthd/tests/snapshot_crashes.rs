//! hearthd SIGKILLed at random moments while snapshots of a busy VM are
//! taken, again and again. Every claim is checked from ground truth: the
//! guest's own console (its fsfreeze hook prints each freeze and thaw), the
//! process table, the qcow2 files (their backing chains, which of them QEMU
//! holds open for writing) and the restored filesystems read with e2fsprogs.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const ROUNDS: usize = 12;
const FINAL_TIMEOUT: Duration = Duration::from_secs(120);

/// A small xorshift: the test prints its seed; `HEARTH_CRASH_SEED=N`
/// replays a run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn get_snapshot(d: &Daemon, name: &str) -> Option<Value> {
    match d.try_request("GET", &format!("/v1/virtualdisksnapshots/{name}"), None) {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

/// Layer files QEMU holds open read-write (from /proc/PID/fdinfo flags):
/// the disk heads it really writes to.
fn written_by(pid: u32, dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    for fd in std::fs::read_dir(&fd_dir).into_iter().flatten().flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if !target.starts_with(dir) {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
            .unwrap_or(0);
        if flags & 0o3 != 0 {
            out.insert(target);
        }
    }
    out
}

/// Restores `snap` to a disk, converts it to raw and checks it on the host:
/// a clean ext4 (no journal to replay) whose /seq is a gapless prefix of
/// what the guest wrote. Returns the number of lines.
fn check_restored(d: &Daemon, snap: &str, scratch: &Path) -> usize {
    let disk = format!("chk-{snap}");
    let raw = restored_raw(d, snap, scratch);
    assert_clean_ext4(&raw, snap);
    let text = debugfs_cat(&raw, "/seq");
    let lines: Vec<&str> = text.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(
            *l,
            (i + 1).to_string(),
            "{snap}: /seq is not a prefix of what the guest wrote (line {})",
            i + 1
        );
    }
    let _ = std::fs::remove_file(&raw);
    d.cli_ok(&["delete", "disk", &disk]);
    d.wait_gone("virtualdisks", &disk, Duration::from_secs(60));
    lines.len()
}

#[test]
fn sigkill_at_random_moments_never_fails_a_snapshot_loses_a_write_or_leaves_a_frozen_guest() {
    let _serial = serial();
    let seed = std::env::var("HEARTH_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 | 1)
                .unwrap_or(0x9e37_79b9)
        });
    println!("seed {seed} (HEARTH_CRASH_SEED={seed} replays this run)");
    let mut rng = Rng(seed);
    let mut d = Daemon::start();

    let m = manifest(
        &d,
        "busy.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("busy-data"),
            // The freeze hook sleeps 1 s before each freeze: kills land
            // before, during and after the freeze, the transaction and the
            // commit.
            vm_yaml(
                "busy",
                "AlwaysOn",
                &["busy-data"],
                "hearth.freeze_hook_sleep=1"
            )
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("busy");
    let pids = d.qemu_pids();
    assert_eq!(pids.len(), 1, "{pids:?}");
    let qemu = pids[0];

    // The guest writes all the time: consecutive numbers, one per line.
    let (status, v) = d.request(
        "POST",
        "/v1/virtualmachines/busy/agent/exec",
        Some(&json!({"path": "/bin/sh", "args": ["-c",
            "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i >> /data/seq; usleep 20000; done' </dev/null >/dev/null 2>&1 &"]})),
    );
    assert_eq!(status, 200, "{v}");

    let mut names: Vec<String> = Vec::new();
    let mut kills_in_window = 0;
    for round in 0..ROUNDS {
        let batch = 1 + rng.below(2) as usize;
        let items: Vec<Value> = (0..batch)
            .map(|j| {
                let n = format!("crash-{round}-{j}");
                names.push(n.clone());
                DiskSnapshot::of(&n, "busy-data").json()
            })
            .collect();
        let (before, _) = hook_counts(&d, "busy");
        let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
        assert_eq!(status, 200, "{v}");
        if round % 2 == 0 {
            // Somewhere in the cut: from the guest's freeze hook on.
            wait_until(
                "the guest's freeze hook runs",
                Duration::from_secs(60),
                || hook_counts(&d, "busy").0 > before,
            );
            std::thread::sleep(Duration::from_millis(rng.below(1500)));
        } else {
            std::thread::sleep(Duration::from_millis(rng.below(1500)));
        }
        d.kill();
        let (f, t) = hook_counts(&d, "busy");
        if f > t {
            kills_in_window += 1;
        }
        // The VM survives its daemon.
        assert!(is_alive(qemu), "QEMU died with hearthd");
        std::thread::sleep(Duration::from_millis(rng.below(500)));
        d.spawn();
    }
    // Restarts between cuts: two cuts per daemon life, then a kill while
    // idle. Cut ids (and the QEMU node names made from them) must never
    // repeat in the adopted QEMU.
    for life in 0..3 {
        for k in 0..2 {
            let n = format!("idle-{life}-{k}");
            names.push(n.clone());
            let (status, v) = d.request(
                "POST",
                "/v1/apply",
                Some(&json!({"items": [DiskSnapshot::of(&n, "busy-data").json()]})),
            );
            assert_eq!(status, 200, "{v}");
            wait_until(&format!("{n} final"), FINAL_TIMEOUT, || {
                get_snapshot(&d, &n).is_some_and(|v| {
                    matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed"))
                })
            });
        }
        d.kill();
        d.spawn();
    }
    println!("{ROUNDS} kills, {kills_in_window} inside a freeze window (guest's console)");
    assert!(
        kills_in_window >= 2,
        "too few kills landed inside a freeze window ({kills_in_window}) to prove anything"
    );

    // Every snapshot ends Ready and consistent: none failed because of a crash.
    let deadline = Instant::now() + FINAL_TIMEOUT;
    for n in &names {
        let left = deadline.saturating_duration_since(Instant::now());
        let v = d.wait_final("virtualdisksnapshots", n, left);
        match v["status"]["phase"].as_str() {
            Some("Ready") => assert_eq!(v["status"]["consistent"], true, "{v:#}"),
            _ => panic!("{n} failed:\n{v:#}\n{}", d.log()),
        }
    }

    // The guest is thawed: its hook saw a thaw for every freeze.
    wait_until("every freeze thawed", Duration::from_secs(30), || {
        let (f, t) = hook_counts(&d, "busy");
        f == t
    });
    let (f, _) = hook_counts(&d, "busy");
    println!("{f} freezes, each thawed, for {} snapshots", names.len());

    // Exactly one QEMU for the VM: the first one, adopted every time.
    assert_eq!(d.qemu_pids(), vec![qemu]);
    // The overlay the last daemon made ahead (after its last cut) is
    // removed by the new one, its node too.
    wait_no_ahead(
        &d,
        "busy-data",
        Some(qemu),
        "the overlay made ahead removed after the restart",
    );

    // The newest layer QEMU holds open for writing (layer names carry a
    // never-repeating counter) is the disk's recorded head: a stale head
    // would lose every write made after a crashed cut. (QEMU keeps the
    // layer it was started with open read-write as well.) Every file in the
    // layer directory is in that head's backing chain: no overlay lost,
    // none left over.
    let layers = d.state_dir().join("layers");
    let head = PathBuf::from(
        d.get_disk("busy-data").expect("disk")["status"]["path"]
            .as_str()
            .expect("path"),
    );
    let written = written_by(qemu, &layers);
    assert_eq!(
        written.iter().next_back(),
        Some(&head),
        "QEMU writes {written:?}"
    );
    let in_chain: BTreeSet<PathBuf> = backing_chain(&head).into_iter().collect();
    let on_disk: BTreeSet<PathBuf> = std::fs::read_dir(&layers)
        .expect("layers")
        .flatten()
        .map(|e| e.path())
        .collect();
    let stray: Vec<_> = on_disk.difference(&in_chain).collect();
    assert!(
        stray.is_empty(),
        "layer files outside the disk's chain: {stray:?}"
    );

    // Every snapshot, restored, is a clean ext4 holding a prefix of the
    // guest's writes; later snapshots hold at least as much.
    let scratch = tempfile::tempdir().expect("tempdir");
    let mut last = 0;
    let mut by_cut: Vec<(u64, String)> = names
        .iter()
        .map(|n| {
            let v = get_snapshot(&d, n).expect("snapshot");
            (v["status"]["cutId"].as_u64().expect("cutId"), n.clone())
        })
        .collect();
    by_cut.sort();
    for (_, n) in &by_cut {
        let lines = check_restored(&d, n, scratch.path());
        assert!(
            lines >= last,
            "{n}: {lines} lines, fewer than an earlier cut's {last}"
        );
        last = lines;
    }
    assert!(last > 0, "the guest wrote nothing?");
    println!(
        "restored {} snapshots, the last with {last} lines",
        by_cut.len()
    );
}

/// Layer files outside the head's backing chain, each with the file it
/// names as its backing file (an overlay made ahead lies over the head).
fn outside_chain(d: &Daemon, disk: &str) -> Vec<(PathBuf, Option<PathBuf>)> {
    let layers = d.state_dir().join("layers");
    let chain: BTreeSet<PathBuf> = backing_chain(&d.disk_path(disk)).into_iter().collect();
    let mut out: Vec<(PathBuf, Option<PathBuf>)> = std::fs::read_dir(&layers)
        .expect("layers")
        .flatten()
        .map(|e| e.path())
        .filter(|p| !chain.contains(p))
        .map(|p| {
            let below = backing_chain(&p).get(1).cloned();
            (p, below)
        })
        .collect();
    out.sort();
    out
}

/// Waits until the disk has exactly one overlay made ahead: one layer
/// file outside its head's chain, lying over the head, open read-write by
/// QEMU `qemu` (its node). Returns its path.
fn wait_ahead(d: &Daemon, disk: &str, qemu: u32) -> PathBuf {
    let layers = d.state_dir().join("layers");
    let found = std::cell::RefCell::new(None);
    wait_until("an overlay made ahead", Duration::from_secs(30), || {
        let head = d.disk_path(disk);
        let out = outside_chain(d, disk);
        let one = match out.as_slice() {
            [(p, Some(below))] if *below == head && written_by(qemu, &layers).contains(p) => {
                Some(p.clone())
            }
            _ => None,
        };
        let ok = one.is_some();
        *found.borrow_mut() = one;
        ok
    });
    found.into_inner().expect("found")
}

/// Waits until every layer file is in the head's chain and QEMU `qemu`
/// holds none open but the head's chain: no file, no node left over.
fn wait_no_ahead(d: &Daemon, disk: &str, qemu: Option<u32>, what: &str) {
    let layers = d.state_dir().join("layers");
    wait_until(what, Duration::from_secs(30), || {
        let chain: BTreeSet<PathBuf> = backing_chain(&d.disk_path(disk)).into_iter().collect();
        outside_chain(d, disk).is_empty()
            && qemu.is_none_or(|q| written_by(q, &layers).is_subset(&chain))
    });
}

#[test]
fn an_overlay_made_ahead_is_used_by_the_next_cut_and_never_outlives_a_crash_or_its_qemu() {
    let _serial = serial();
    let mut d = Daemon::start();
    let m = manifest(
        &d,
        "ahead.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("ah-data"),
            vm_yaml("ah", "AlwaysOn", &["ah-data"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("ah");
    let qemu = d.qemu_pids()[0];
    let (status, v) = d.request(
        "POST",
        "/v1/virtualmachines/ah/agent/exec",
        Some(&json!({"path": "/bin/sh", "args": ["-c",
            "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i >> /data/seq; usleep 20000; done' </dev/null >/dev/null 2>&1 &"]})),
    );
    assert_eq!(status, 200, "{v}");
    let snap = |d: &Daemon, n: &str| {
        let (status, v) = d.request(
            "POST",
            "/v1/apply",
            Some(&json!({"items": [DiskSnapshot::of(n, "ah-data").json()]})),
        );
        assert_eq!(status, 200, "{v}");
        let v = snapshot_final(d, n, FINAL_TIMEOUT);
        assert_eq!(v["status"]["phase"], "Ready", "{v:#}\n{}", d.log());
        assert_eq!(v["status"]["consistent"], true, "{v:#}");
    };

    // 1. The VM's start made one ahead; the first cut takes it: the disk's
    // new head is that very file, and the next one is made ahead of it.
    let first = wait_ahead(&d, "ah-data", qemu);
    snap(&d, "ah-1");
    assert_eq!(
        d.disk_path("ah-data"),
        first,
        "the cut used the overlay made ahead"
    );
    let second = wait_ahead(&d, "ah-data", qemu);
    assert_ne!(second, first);

    // 2. SIGKILL with an ahead overlay present, QEMU still running: the new
    // daemon removes it (node and file), and the next cut is consistent.
    d.kill();
    d.spawn();
    wait_no_ahead(
        &d,
        "ah-data",
        Some(qemu),
        "the ahead overlay removed after the restart",
    );
    assert!(!second.exists());
    assert_eq!(d.disk_path("ah-data"), first, "never adopted");
    snap(&d, "ah-2");
    let head2 = d.disk_path("ah-data");
    assert_ne!(head2, second, "a fresh overlay, not the removed one");
    assert_eq!(backing_chain(&head2).get(1), Some(&first));
    let third = wait_ahead(&d, "ah-data", qemu);

    // 3. SIGKILL with an ahead overlay present and QEMU killed too: it is
    // removed, not adopted, when the VM starts again.
    d.kill();
    let _ = Command::new("kill")
        .args(["-9", &qemu.to_string()])
        .status();
    wait_until("QEMU gone", Duration::from_secs(10), || !is_alive(qemu));
    d.spawn();
    let vm = d.wait_agent("ah");
    let qemu2 = vm["status"]["pid"].as_u64().expect("pid") as u32;
    assert_ne!(qemu2, qemu);
    assert!(
        !third.exists(),
        "the ahead overlay of the killed QEMU is gone"
    );
    assert_eq!(d.disk_path("ah-data"), head2, "never adopted");
    // The new QEMU gets its own.
    let fourth = wait_ahead(&d, "ah-data", qemu2);

    // 4. A stop removes it; the start makes a new one for the new QEMU.
    d.cli_ok(&["stop", "ah"]);
    d.wait_phase("ah", "Stopped", Duration::from_secs(60));
    wait_no_ahead(&d, "ah-data", None, "the ahead overlay removed at the stop");
    assert!(!fourth.exists());
    d.cli_ok(&["start", "ah"]);
    let vm = d.wait_agent("ah");
    let qemu3 = vm["status"]["pid"].as_u64().expect("pid") as u32;
    wait_ahead(&d, "ah-data", qemu3);
    // Every snapshot holds a clean filesystem with the guest's writes.
    let scratch = tempfile::tempdir().expect("tempdir");
    for n in ["ah-1", "ah-2"] {
        check_restored(&d, n, scratch.path());
    }

    // 5. Deleting the VM and the disk leaves no file behind.
    d.cli_ok(&["delete", "vm", "ah"]);
    d.wait_gone("virtualmachines", "ah", Duration::from_secs(60));
    for n in ["ah-1", "ah-2"] {
        d.cli_ok(&["delete", "snapshot", n]);
    }
    d.cli_ok(&["delete", "disk", "ah-data"]);
    wait_until("all layers removed", Duration::from_secs(60), || {
        std::fs::read_dir(d.state_dir().join("layers"))
            .map(|r| r.count() == 0)
            .unwrap_or(true)
    });
}
