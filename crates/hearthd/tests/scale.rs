//! hearthd with many objects: a resync with nothing changed runs no
//! program and writes nothing, external programs run within a bounded pool
//! and are always reaped, and an apply has a size limit. A real hearthd and
//! the real `qemu-img`, behind a wrapper first in hearthd's PATH that logs
//! every run; real files. No guest boots.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::qemu_img_log::{QemuImgLog, real_qemu_img};
use common::*;
use serde_json::{Value, json};

/// A small qcow2 base image, made by the real qemu-img.
fn base_image(dir: &Path) -> PathBuf {
    let base = dir.join("base.qcow2");
    let out = Command::new(real_qemu_img())
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("32M")
        .output()
        .expect("qemu-img create");
    assert!(out.status.success(), "{out:?}");
    base
}

fn blank_disk(name: &str, size: &str) -> Value {
    Disk::blank(name, size).json()
}

fn items(d: &Daemon, plural: &str) -> Vec<Value> {
    let (status, v) = d.request("GET", &format!("/v1/{plural}"), None);
    assert_eq!(status, 200, "{v}");
    v["items"].as_array().cloned().unwrap_or_default()
}

fn wait_all_ready(d: &Daemon, plural: &str, count: usize, timeout: Duration) {
    let mut ready = 0;
    let all_ready = eventually_every(Duration::from_millis(200), timeout, || {
        let all = items(d, plural);
        ready = all
            .iter()
            .filter(|o| o["status"]["phase"] == "Ready")
            .count();
        if all.len() == count && ready == count {
            return true;
        }
        let failed: Vec<&Value> = all
            .iter()
            .filter(|o| o["status"]["phase"] == "Failed")
            .collect();
        assert!(failed.is_empty(), "{plural} failed: {failed:?}");
        false
    });
    assert!(
        all_ready,
        "{ready} of {count} {plural} Ready after {timeout:?}\n{}",
        d.log()
    );
}

/// `(len, mtime in ns)` of a file, or zeros when it does not exist.
fn size_and_mtime(path: &Path) -> (u64, i64) {
    std::fs::metadata(path)
        .map(|m| (m.len(), m.mtime() * 1_000_000_000 + m.mtime_nsec()))
        .unwrap_or((0, 0))
}

#[test]
fn a_resync_with_nothing_changed_runs_no_program_and_writes_nothing() {
    let _serial = serial();
    let wrapper = QemuImgLog::new("");
    let images = tempfile::tempdir().expect("tempdir");
    let base = base_image(images.path());
    let path_var = wrapper.path_var();
    let env = [("PATH", path_var.as_str())];
    let mut d = Daemon::start_without_guest_env(&[images.path()], &["--resync-seconds", "1"], &env);

    let mut objects: Vec<Value> = (0..40)
        .map(|i| blank_disk(&format!("b{i}"), "64Mi"))
        .collect();
    objects.extend((0..4).map(|i| Disk::from_image(&format!("o{i}"), &base).json()));
    // A stopped VM with a disk: its disk's status names it.
    objects.push(Vm::new("stopped").always_off().disk("b0").json());
    let (status, v) = d.apply_json(objects);
    assert_eq!(status, 200, "{v}");
    wait_all_ready(&d, "virtualdisks", 44, Duration::from_secs(120));
    // Snapshots of disks no QEMU runs: offline cuts, a new layer each.
    let snaps = (1..=4)
        .map(|i| DiskSnapshot::of(&format!("s{i}"), &format!("b{i}")).json())
        .collect();
    let (status, v) = d.apply_json(snaps);
    assert_eq!(status, 200, "{v}");
    wait_all_ready(&d, "virtualdisksnapshots", 4, Duration::from_secs(120));
    wait_until(
        "the snapshotted disks read through their new layers",
        Duration::from_secs(30),
        || {
            (1..=4).all(|i| {
                d.get_disk(&format!("b{i}"))
                    .is_some_and(|v| v["status"]["chainLength"] == 2)
            })
        },
    );
    let vm = d.get_disk("b0").expect("b0");
    assert_eq!(vm["status"]["attachedTo"], "stopped", "{vm}");
    wait_until(
        "every qemu-img hearthd started has ended",
        Duration::from_secs(30),
        || wrapper.starts().len() == wrapper.ends(),
    );
    let made = wrapper.starts().len();
    assert!(
        made > 0,
        "the wrapper saw no qemu-img at all: is it in PATH?"
    );
    // Two resyncs for whatever the applies left to settle.
    std::thread::sleep(Duration::from_secs(2));

    let before = wrapper.starts().len();
    let wal = d.state_dir().join("hearth.db-wal");
    let wal_before = size_and_mtime(&wal);
    assert!(wal_before.0 > 0, "no write-ahead log at {}", wal.display());
    // Five resyncs of 44 disks, 4 snapshots and a VM.
    std::thread::sleep(Duration::from_secs(5));
    let runs = wrapper.starts();
    assert_eq!(
        runs.len(),
        before,
        "qemu-img ran {} times during resyncs with nothing changed, first {:?}",
        runs.len() - before,
        runs.get(before)
    );
    assert_eq!(
        size_and_mtime(&wal),
        wal_before,
        "the store was written during resyncs with nothing changed"
    );

    // The resyncs did run: a disk's file grows behind hearthd's back (no
    // hint), and its status follows from the file itself, with no program.
    let disk = d.get_disk("b7").expect("b7");
    let head = PathBuf::from(disk["status"]["path"].as_str().expect("path"));
    let out = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0xab 0 4M"])
        .arg(&head)
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    assert!(out.status.success(), "{out:?}");
    let allocated = std::fs::metadata(&head).expect("head").blocks() * 512;
    wait_until(
        "b7's allocated bytes are the file's",
        Duration::from_secs(15),
        || {
            d.get_disk("b7")
                .is_some_and(|v| v["status"]["allocated"] == allocated)
        },
    );
    assert_eq!(
        wrapper.starts().len(),
        before,
        "qemu-img ran for the refresh"
    );
    // And the refresh was a write the log shows: the check above could fail.
    assert_ne!(size_and_mtime(&wal), wal_before);

    // A restart finds everything as it was: no program runs for it either.
    d.kill();
    d.spawn_env(&env);
    std::thread::sleep(Duration::from_secs(4));
    let runs = wrapper.starts();
    assert_eq!(
        runs.len(),
        before,
        "qemu-img ran {} times after a restart with nothing changed, first {:?}",
        runs.len() - before,
        runs.get(before)
    );
    wait_all_ready(&d, "virtualdisks", 44, Duration::from_secs(5));
}

/// The descriptors hearthd has open, and its children (any state).
fn fds_and_children(pid: u32) -> (usize, Vec<u32>) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let mut children = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(child) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            children.push(child);
        }
    }
    (fds, children)
}

#[test]
fn external_programs_run_at_most_the_pool_size_at_once_and_are_always_reaped() {
    let _serial = serial();
    let wrapper = QemuImgLog::new("sleep 0.1");
    let images = tempfile::tempdir().expect("tempdir");
    let base = base_image(images.path());
    let path_var = wrapper.path_var();
    let d = Daemon::start_without_guest_env(
        &[images.path()],
        &["--max-external-programs", "2"],
        &[("PATH", path_var.as_str())],
    );
    let pid = d.child.as_ref().expect("hearthd").id();
    let (idle_fds, idle_children) = fds_and_children(pid);
    assert!(idle_children.is_empty(), "{idle_children:?}");

    // Watch hearthd from outside for the whole burst.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut fds, mut children) = (0, 0);
            while !stop.load(Ordering::SeqCst) {
                let (f, c) = fds_and_children(pid);
                fds = fds.max(f);
                children = children.max(c.len());
                std::thread::sleep(Duration::from_millis(5));
            }
            (fds, children)
        })
    };
    // Each disk over an image runs qemu-img twice (the base's info, the
    // overlay's create); blank disks of sizes not seen before once or twice.
    let mut objects: Vec<Value> = (0..30)
        .map(|i| Disk::from_image(&format!("o{i}"), &base).json())
        .collect();
    objects.extend((0..6).map(|i| blank_disk(&format!("b{i}"), &format!("{}Mi", 16 + i))));
    let (status, v) = d.apply_json(objects);
    assert_eq!(status, 200, "{v}");
    wait_all_ready(&d, "virtualdisks", 36, Duration::from_secs(180));
    wait_until(
        "every qemu-img hearthd started has ended",
        Duration::from_secs(30),
        || wrapper.starts().len() == wrapper.ends(),
    );
    stop.store(true, Ordering::SeqCst);
    let (most_fds, most_children) = sampler.join().expect("sampler");

    let runs = wrapper.starts().len();
    assert!(
        runs >= 60,
        "only {runs} qemu-img runs: {:?}",
        wrapper.lines()
    );
    let at_once = wrapper.most_at_once();
    assert!(
        at_once <= 2,
        "{at_once} qemu-img ran at once with --max-external-programs 2"
    );
    assert!(
        most_children <= 2,
        "hearthd had {most_children} children at once with --max-external-programs 2"
    );
    // Each running program holds a few descriptors (its pipes, a pidfd);
    // the rest is hearthd's own work per disk, which is bounded too.
    assert!(
        most_fds <= idle_fds + 48,
        "hearthd held {most_fds} descriptors during the burst, {idle_fds} when idle"
    );
    // Every program ended was reaped: no child is left, not even a zombie.
    wait_until("hearthd has no child left", Duration::from_secs(10), || {
        fds_and_children(pid).1.is_empty()
    });
}

#[test]
fn an_apply_beyond_its_limits_is_refused_naming_the_limit() {
    let _serial = serial();
    let images = tempfile::tempdir().expect("tempdir");
    let d = Daemon::start_without_guest(&[images.path()], &[]);

    let too_many: Vec<Value> = (0..10_001)
        .map(|i| blank_disk(&format!("d{i}"), "1Mi"))
        .collect();
    let (status, v) = d.apply_json(too_many);
    let answer: String = v.to_string().chars().take(300).collect();
    assert_eq!(status, 400, "{answer}");
    let e = v["error"].as_str().unwrap_or_default();
    assert!(
        e.contains("10001") && e.contains("10000 objects"),
        "the error names the count and the limit: {e}"
    );
    assert!(items(&d, "virtualdisks").is_empty(), "nothing was stored");

    // A body larger than the limit is refused before it is read whole.
    let padding = "x".repeat(8 << 20);
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [], "padding": padding})),
    );
    assert_eq!(status, 413, "{v}");
    let e = v["error"].as_str().unwrap_or_default();
    assert!(
        e.contains("8 MiB") && e.contains("8388608 bytes"),
        "the error names the limit: {e}"
    );

    // A small one still goes through.
    let (status, v) = d.apply_json(vec![blank_disk("one", "1Mi")]);
    assert_eq!(status, 200, "{v}");
}
