//! Backups end to end: a running test guest with a 4 GiB data disk,
//! backed up into a directory again and again while the guest writes known
//! data. Every point of the chain is compared byte for byte (by
//! `qemu-img compare` and by the SHA-256 of the raw disk) with the
//! checkpoint snapshot it was cut from, read through a disk restored from
//! that snapshot; the sizes of the files say what an incremental holds.
//! The cases that must not give a wrong incremental: QEMU SIGKILLed between
//! backups, the checkpoint snapshot deleted, hearthd SIGKILLed in the
//! middle of a copy; and a restore hearthd was SIGKILLed in is made again,
//! exact, with no copy outliving the daemon and no file left behind.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const BACKUP_TIMEOUT: Duration = Duration::from_secs(180);

/// `hearth backup vm app --to TO --name NAME EXTRA...`, as a user runs it.
fn backup_cmd(d: &Daemon, name: &str, to: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "backup",
        "vm",
        "app",
        "--to",
        to.to_str().unwrap(),
        "--name",
        name,
    ];
    args.extend_from_slice(extra);
    d.cli(&args)
}

/// A backup waited for (`--wait`), which must end Ready.
fn backup_with(d: &Daemon, name: &str, to: &Path, extra: &[&str]) -> Value {
    let out = backup_cmd(d, name, to, &[extra, &["--wait"]].concat());
    assert!(out.status.success(), "{out:?}");
    let b = d.wait_final("virtualmachinebackups", name, BACKUP_TIMEOUT);
    assert_eq!(b["status"]["phase"], "Ready", "{b:#}");
    b
}

fn backup(d: &Daemon, name: &str, to: &Path) -> Value {
    backup_with(d, name, to, &[])
}

fn backup_manifest(to: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(to.join("hearth-backup.json")).unwrap()).unwrap()
}

/// The points the manifest lists, oldest first.
fn listed_points(to: &Path) -> Vec<u64> {
    backup_manifest(to)["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["point"].as_u64().unwrap())
        .collect()
}

/// The file of `disk` at `point`, from the manifest, checked against the
/// SHA-256 the manifest gives.
fn point_file(to: &Path, point: u64, disk: &str) -> PathBuf {
    let m = backup_manifest(to);
    let p = m["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["point"] == point)
        .unwrap_or_else(|| panic!("no point {point}: {m:#}"));
    let f = p["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["disk"] == disk)
        .unwrap();
    let path = to.join(f["file"].as_str().unwrap());
    assert_eq!(
        sha256_file(&path),
        f["sha256"].as_str().unwrap(),
        "{}",
        path.display()
    );
    path
}

/// Whether two images hold the same bytes (qemu-img compare: 0 same, 1 not).
fn same_bytes(a: &Path, b: &Path) -> bool {
    let out = Command::new("qemu-img")
        .args(["compare", "-U", "-f", "qcow2", "-F", "qcow2"])
        .arg(a)
        .arg(b)
        .output()
        .expect("qemu-img");
    assert!(
        out.status.code() == Some(0) || out.status.code() == Some(1),
        "qemu-img compare: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.success()
}

/// A disk restored from the checkpoint of backup `b` (its data disk's
/// snapshot): the ground truth a point is compared with.
fn checkpoint_disk(d: &Daemon, b: &Value) -> PathBuf {
    let cp = b["status"]["checkpoint"].as_str().unwrap();
    let disk = format!("truth-{cp}");
    d.apply(vec![
        Disk::from_snapshot(&disk, &format!("{cp}-app-data")).json(),
    ]);
    d.wait_object(
        "virtualdisks",
        &disk,
        "Ready",
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "Ready",
    );
    d.disk_path(&disk)
}

/// The VM `app` running on one data disk `app-data` of `size` (the test
/// image's ext4, mounted at /data in the guest).
fn start_app(d: &Daemon, size: &str) {
    let m = manifest(
        d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            Disk::from_image("app-data", guest_dir().join("data.qcow2"))
                .size(size)
                .yaml(),
            vm_yaml("app", "AlwaysOn", &["app-data"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().unwrap()]);
    d.wait_agent("app");
}

/// Runs `start` with strace on hearthd, which SIGKILLs it as it enters
/// one of `syscalls` on `path` (before the call runs), and waits for it to
/// die so.
fn kill_at(d: &mut Daemon, path: &Path, syscalls: &str, start: impl FnOnce(&Daemon)) {
    let hearthd = d.child.as_ref().map(|c| c.id()).expect("hearthd");
    let strace_log = d.dir.path().join("strace.log");
    let mut strace = Command::new("strace")
        .args(["-f", "-qq", "-p", &hearthd.to_string(), "-P"])
        .arg(path)
        .args(["-e", &format!("trace={syscalls}")])
        .args(["-e", &format!("inject={syscalls}:signal=SIGKILL")])
        .arg("-o")
        .arg(&strace_log)
        .spawn()
        .expect("strace (apt-get install strace)");
    assert!(
        hearth_test_support::eventually(BACKUP_TIMEOUT, || {
            hearth_test_support::process::all_threads_traced(hearthd)
        }),
        "strace did not attach to every thread of hearthd"
    );
    start(d);
    let status = d.wait_exit(BACKUP_TIMEOUT);
    let _ = strace.wait();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "hearthd was not killed at {syscalls} on {}: {status}; strace:\n{}\n{}",
        path.display(),
        std::fs::read_to_string(&strace_log).unwrap_or_default(),
        d.log()
    );
}

/// A full backup whose `reasonFull` says `why`.
fn assert_full_because(b: &Value, why: &str) {
    assert_eq!(b["status"]["kind"], "Full", "{b:#}");
    assert!(
        b["status"]["reasonFull"]
            .as_str()
            .is_some_and(|r| r.contains(why)),
        "{b:#}"
    );
}

fn write_mib(d: &Daemon, file: &str, mib: u32) {
    d.agent_sh_ok(
        "app",
        &format!(
            "dd if=/dev/urandom of=/data/{file} bs=1M count={mib} conv=fsync 2>/dev/null; sync"
        ),
    );
}

#[test]
fn backups_are_full_then_incremental_byte_exact_and_never_a_wrong_incremental() {
    let _serial = serial();
    let mut d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let to = d.dir.path().join("backups").join("app");
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    start_app(&d, "4Gi");

    // A snapshot from before any backup, to roll the VM back to later.
    d.cli_ok(&["snapshot", "vm", "app", "--name", "early", "--wait"]);

    // 1. Full.
    write_mib(&d, "one", 2);
    let b1 = backup(&d, "b1", &to);
    assert_eq!(b1["status"]["kind"], "Full", "{b1:#}");
    assert_eq!(b1["status"]["point"], 1);
    let truth1 = checkpoint_disk(&d, &b1);
    let p1 = point_file(&to, 1, "app-data");
    assert!(
        same_bytes(&p1, &truth1),
        "point 1 differs from its checkpoint"
    );

    // 2. Incremental after 1 MiB written: about 1 MiB, not the disk.
    write_mib(&d, "two", 1);
    let two = d.agent_sh_ok("app", "sha256sum /data/two | cut -d' ' -f1");
    let b2 = backup(&d, "b2", &to);
    assert_eq!(b2["status"]["kind"], "Incremental", "{b2:#}");
    assert_eq!(b2["status"]["base"], "b1", "{b2:#}");
    // Read and written by hearth itself (QEMU's layers are plain qcow2):
    // hearthd logs each fall back to qemu-img, with its reason.
    for fallback in [
        "copying through qemu-img",
        "reading the chain with qemu-img",
    ] {
        assert!(!d.log().contains(fallback), "{fallback}:\n{}", d.log());
    }
    let p2 = point_file(&to, 2, "app-data");
    let size2 = std::fs::metadata(&p2).unwrap().len();
    assert!(
        (1 << 20..6 << 20).contains(&size2),
        "an incremental after 1 MiB of writes is {size2} bytes"
    );
    let truth2 = checkpoint_disk(&d, &b2);
    assert!(
        same_bytes(&p2, &truth2),
        "point 2 differs from its checkpoint"
    );
    assert!(same_bytes(&p1, &truth1), "point 1 changed");
    // The chain names its base by a relative name: the directory can move.
    let info = Command::new("qemu-img")
        .args(["info", "--output=json", "-U"])
        .arg(&p2)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["backing-filename"], "0001.qcow2", "{info:#}");
    // b1's checkpoint is gone now; b2's stays for the next incremental.
    d.wait_gone("virtualmachinesnapshots", "b1-cp", Duration::from_secs(60));
    assert!(d.get("virtualmachinesnapshots", "b2-cp").is_some());

    // A snapshot of the user's between two backups, deleted after the guest
    // wrote past it: its layer is merged away (the chain of files is
    // shorter), and the next incremental is still exact.
    d.cli_ok(&["snapshot", "vm", "app", "--name", "between", "--wait"]);
    write_mib(&d, "two-b", 1);
    let layers = backing_chain(&d.disk_path("app-data")).len();
    d.cli_ok(&["delete", "vmsnapshot", "between"]);
    let merged = hearth_test_support::eventually(Duration::from_secs(90), || {
        backing_chain(&d.disk_path("app-data")).len() < layers
    });
    assert!(merged, "the snapshot's layer was not merged away");

    // 3. QEMU SIGKILLed after a synced write: the VM comes back, the next
    // backup is still exact (the change is read off the layers, which the
    // crash cannot make lie).
    write_mib(&d, "three", 1);
    let pid = d.get_vm("app").unwrap()["status"]["pid"].as_u64().unwrap();
    assert!(
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    d.wait_vm("app", "running again", Duration::from_secs(120), |v| {
        v["status"]["pid"].as_u64().is_some_and(|p| p != pid)
            && v["status"]["agentConnected"] == true
    });
    let b3 = backup(&d, "b3", &to);
    assert_eq!(b3["status"]["kind"], "Incremental", "{b3:#}");
    let p3 = point_file(&to, 3, "app-data");
    let truth3 = checkpoint_disk(&d, &b3);
    assert!(
        same_bytes(&p3, &truth3),
        "point 3 (after a QEMU crash) differs"
    );

    // 4. The checkpoint deleted by hand: the next one is full, and says why.
    d.cli_ok(&["delete", "vmsnapshot", "b3-cp"]);
    d.wait_gone("virtualmachinesnapshots", "b3-cp", Duration::from_secs(60));
    write_mib(&d, "four", 1);
    let b4 = backup(&d, "b4", &to);
    assert_full_because(&b4, "b3-cp");
    let p4 = point_file(&to, 4, "app-data");
    let truth4 = checkpoint_disk(&d, &b4);
    assert!(same_bytes(&p4, &truth4), "point 4 differs");

    // 5. hearthd SIGKILLed once a copy is whole and synced, before the
    // manifest names it: strace kills it as it enters the rename of the
    // finished `.partial` (before the call runs). The point is not counted;
    // after the restart the backup is made again, and the leftover file is
    // gone.
    write_mib(&d, "five", 3);
    let partial = to.join("app-data").join("0005.qcow2.partial");
    kill_at(&mut d, &partial, "rename,renameat,renameat2", |d| {
        assert!(backup_cmd(d, "b5", &to, &[]).status.success())
    });
    assert!(partial.exists(), "the finished copy is not there");
    assert_eq!(
        listed_points(&to),
        [1, 2, 3, 4],
        "a point was committed half-written"
    );
    d.spawn();
    let b5 = d.wait_final("virtualmachinebackups", "b5", BACKUP_TIMEOUT);
    assert_eq!(b5["status"]["phase"], "Ready", "{b5:#}");
    assert_eq!(b5["status"]["kind"], "Incremental", "{b5:#}");
    assert!(!partial.exists());
    let p5 = point_file(&to, 5, "app-data");
    let truth5 = checkpoint_disk(&d, &b5);
    assert!(same_bytes(&p5, &truth5), "point 5 differs");

    // The newest point, whole, as a raw disk: the same SHA-256 as its
    // checkpoint's, and a clean ext4 that holds the guest's last file.
    let raw_point = scratch.join("p5.raw");
    let raw_truth = scratch.join("t5.raw");
    to_raw(&p5, &raw_point);
    to_raw(&truth5, &raw_truth);
    assert_eq!(sha256_file(&raw_point), sha256_file(&raw_truth));
    assert_clean_ext4(&raw_point, "point 5");
    let five = d.agent_sh_ok("app", "sha256sum /data/five | cut -d' ' -f1");
    let restored = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "debugfs -R 'cat /five' {} 2>/dev/null | sha256sum | cut -d' ' -f1",
            raw_point.display()
        ))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&restored.stdout).trim(),
        five.trim()
    );

    // 6. The VM rolled back to a snapshot from before every checkpoint: its
    // disk no longer reads through b5's checkpoint, so the next point is
    // full, says so, and is exact.
    // hearthd is SIGKILLed once the manifest naming point 6 is renamed in,
    // as it enters the fsync of the directory: after the restart the
    // backup is finished from the manifest, and its status still says why
    // it is full and what its copy read and wrote.
    d.cli_ok(&["restore", "vm", "app", "--from", "early"]);
    d.wait_agent("app");
    kill_at(&mut d, &to, "fsync,fdatasync", |d| {
        assert!(backup_cmd(d, "b6", &to, &[]).status.success())
    });
    assert_eq!(
        listed_points(&to),
        [1, 2, 3, 4, 5, 6],
        "point 6 was not committed before the kill"
    );
    d.spawn();
    let b6 = d.wait_final("virtualmachinebackups", "b6", BACKUP_TIMEOUT);
    assert_eq!(b6["status"]["phase"], "Ready", "{b6:#}");
    assert_full_because(&b6, "restored");
    for count in ["bytesRead", "bytesWritten", "durationMs"] {
        assert!(
            b6["status"][count].as_u64().is_some_and(|n| n > 0),
            "{count} lost in the crash: {b6:#}"
        );
    }
    let p6 = point_file(&to, 6, "app-data");
    let truth6 = checkpoint_disk(&d, &b6);
    assert!(same_bytes(&p6, &truth6), "point 6 differs");

    // Every point of the chain restored as a disk (`hearth restore backup
    // --at N`): each reads exactly what its checkpoint reads, whether it
    // is full or sits on up to four incrementals.
    let truths = [&truth1, &truth2, &truth3, &truth4, &truth5, &truth6];
    for (i, truth) in truths.iter().enumerate() {
        let n = (i + 1).to_string();
        let name = format!("at{n}");
        let dir = to.to_str().unwrap();
        d.cli_ok(&[
            "restore", "backup", dir, "--at", &n, "--as", &name, "--no-vm", "--wait",
        ]);
        let restored = d.disk_path(&format!("{name}-app-data"));
        assert!(same_bytes(&restored, truth), "point {n} restored differs");
    }

    // `hearth backup verify`: every file of the six points checked, the
    // directory left exactly as it was (names, lengths, times).
    let listing = |dir: &Path| -> Vec<(PathBuf, u64, std::time::SystemTime)> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    todo.push(e.path());
                } else {
                    out.push((e.path(), m.len(), m.modified().unwrap()));
                }
            }
        }
        out.sort();
        out
    };
    let before = listing(&to);
    let out = d.cli_ok(&["backup", "verify", to.to_str().unwrap()]);
    assert_eq!(out.matches("  ok").count(), 6, "{out}");
    assert!(out.contains("6 point(s), 6 file(s)"), "{out}");
    assert!(out.contains("every point can be restored"), "{out}");
    assert_eq!(listing(&to), before, "verify changed the target");

    // A restore from a copy of the directory elsewhere (the chain names
    // its files relatively): point 2 as a new VM, whose guest reads the
    // file written before point 2 and not the one written after it.
    let moved = d.dir.path().join("moved");
    let cp = Command::new("cp")
        .arg("-a")
        .arg(&to)
        .arg(&moved)
        .status()
        .unwrap();
    assert!(cp.success());
    let out = d.cli_ok(&[
        "restore",
        "backup",
        moved.to_str().unwrap(),
        "--at",
        "2",
        "--as",
        "again",
        "--wait",
    ]);
    assert!(out.contains("virtualmachine/again created"), "{out}");
    assert!(out.contains("disk/again-app-data: Ready"), "{out}");
    d.wait_agent("again");
    let read = d.agent_sh_ok("again", "sha256sum /data/two | cut -d' ' -f1");
    assert_eq!(read.trim(), two.trim());
    let three = d.agent_sh_ok("again", "test -e /data/three && echo yes || echo no");
    assert_eq!(three.trim(), "no");

    // A file of the chain changed on disk: the restore refuses it, naming
    // the checksum, and makes no disk content.
    let victim = moved.join("app-data").join("0001.qcow2");
    let mut bytes = std::fs::read(&victim).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    let out = d.cli(&[
        "restore",
        "backup",
        moved.to_str().unwrap(),
        "--at",
        "2",
        "--as",
        "bad",
        "--no-vm",
        "--wait",
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && said.contains("disk/bad-app-data failed")
            && said.contains("SHA-256"),
        "{out:?}"
    );
    let bad = d.get("virtualdisks", "bad-app-data").unwrap();
    assert_eq!(bad["status"]["phase"], "Failed", "{bad:#}");
    assert!(bad.to_string().contains("SHA-256"), "{bad:#}");

    // verify finds the changed file, and what it takes with it: points 2
    // and 3 are incrementals over it, point 4 is full again. A file no
    // point names is listed; a chain renamed under a point is named.
    std::fs::write(moved.join("app-data").join("0007.qcow2.partial"), b"x").unwrap();
    std::fs::rename(
        moved.join("app-data").join("0006.qcow2"),
        moved.join("app-data").join("0006.old"),
    )
    .unwrap();
    let out = d.cli(&["backup", "verify", moved.to_str().unwrap()]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let line_of = |file: &str| {
        stdout
            .lines()
            .find(|l| l.contains(file))
            .unwrap_or_else(|| panic!("no line for {file}:\n{stdout}"))
            .to_string()
    };
    assert!(
        line_of("0001.qcow2").contains("DAMAGED: SHA-256"),
        "{stdout}"
    );
    assert!(line_of("0002.qcow2").ends_with("ok"), "{stdout}");
    assert!(
        line_of("0006.qcow2").contains("DAMAGED: missing"),
        "{stdout}"
    );
    assert!(
        stdout.contains("not part of the backup: app-data/0007.qcow2.partial"),
        "{stdout}"
    );
    assert!(
        stdout.contains("not part of the backup: app-data/0006.old"),
        "{stdout}"
    );
    assert!(
        stderr.contains("2 damaged file(s) of 6; point(s) 1, 2, 3, 6 cannot be restored"),
        "{stderr}"
    );
    // Up to point 1 only: the one damaged file, and nothing of later points.
    let out = d.cli(&["backup", "verify", moved.to_str().unwrap(), "--at", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("1 damaged file(s) of 1; point(s) 1 cannot"),
        "{stderr}"
    );
    // Not a backup target: a clear error naming the manifest.
    let out = d.cli(&["backup", "verify", scratch.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("hearth-backup.json"),
        "{stderr}"
    );
}

/// Bytes hearthd has read through `read` and the like, from the kernel's
/// own count (`/proc/PID/io`, `rchar`).
fn bytes_read_by(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("/proc/PID/io");
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("rchar in /proc/PID/io")
}

#[test]
fn a_check_whose_client_hangs_up_stops_reading() {
    // A target of one 64 GiB file (a hole; hashing it takes most of a
    // minute), checked over the API, the client gone after the first
    // progress line. hearthd's own read count says whether it stopped.
    let d = Daemon::start_without_guest(&[], &[]);
    let pid = d.child.as_ref().expect("hearthd").id();
    let to = d.state_dir().with_file_name("big-target");
    std::fs::create_dir_all(to.join("d")).unwrap();
    let size: u64 = 64 << 30;
    std::fs::File::create(to.join("d/0001.qcow2"))
        .unwrap()
        .set_len(size)
        .unwrap();
    let manifest = serde_json::json!({
        "version": 1,
        "virtualMachineName": "big",
        "points": [{
            "point": 1, "backup": "big-1", "kind": "Full", "cutTime": null,
            "checkpoint": "big-1-cp",
            "files": [{"disk": "d", "file": "d/0001.qcow2", "sha256": "0".repeat(64),
                       "size": size, "virtualSize": size}],
        }],
    });
    std::fs::write(to.join("hearth-backup.json"), manifest.to_string()).unwrap();

    let mut stream = std::os::unix::net::UnixStream::connect(d.socket()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "GET /v1/backups/verify?dir={} HTTP/1.1\r\nHost: hearthd\r\n\r\n",
        to.display()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"bytesDone\"") {
        let n = stream.read(&mut buf).expect("the check's lines");
        assert!(
            n > 0,
            "the stream ended: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let (r0, t0) = (bytes_read_by(pid), std::time::Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let while_reading = bytes_read_by(pid) - r0;
    assert!(
        while_reading > 64 << 20,
        "hearthd read {while_reading} bytes in {:?} of the check: the measure cannot tell",
        t0.elapsed()
    );
    drop(stream);
    // The hang-up is seen at the next progress line (about a second), the
    // hash stops at its next chunk.
    std::thread::sleep(Duration::from_secs(3));
    let r1 = bytes_read_by(pid);
    std::thread::sleep(Duration::from_secs(3));
    let after = bytes_read_by(pid) - r1;
    eprintln!(
        "verify: {while_reading} bytes read in 2 s of the check, {after} in 3 s after the hang-up"
    );
    assert!(
        after < 8 << 20,
        "hearthd read {after} bytes in 3 s after its client hung up"
    );
    std::fs::remove_dir_all(&to).unwrap();
}

/// A small filesystem of its own, loop-mounted in a directory of its own
/// (not the daemon's, whose removal would meet the mount); unmounted, then
/// removed, when dropped.
struct SmallFs {
    mountpoint: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    fn new(mib: u32) -> SmallFs {
        let dir = tempfile::Builder::new()
            .prefix("hearth-e2e-small-")
            .tempdir()
            .unwrap();
        let image = dir.path().join("small.img");
        let mountpoint = dir.path().join("small");
        std::fs::create_dir_all(&mountpoint).unwrap();
        let f = std::fs::File::create(&image).unwrap();
        f.set_len(u64::from(mib) << 20).unwrap();
        let run = |cmd: &str, args: &[&str]| {
            let out = Command::new(cmd)
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("{cmd}: {e} (apt-get install e2fsprogs mount)"));
            assert!(
                out.status.success(),
                "{cmd} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()]);
        run(
            "mount",
            &[
                "-o",
                "loop",
                image.to_str().unwrap(),
                mountpoint.to_str().unwrap(),
            ],
        );
        SmallFs {
            mountpoint,
            _dir: dir,
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mountpoint).status();
    }
}

#[test]
fn a_full_target_fails_cleanly_keeping_the_earlier_points_and_a_grown_disk_makes_the_next_full() {
    let _serial = serial();
    let d = Daemon::start();
    let small = SmallFs::new(100);
    // Ballast the test takes away later, to give the target room again.
    let ballast = small.mountpoint.join("ballast");
    let fill = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "count=64", "conv=fsync"])
        .arg(format!("of={}", ballast.display()))
        .output()
        .unwrap();
    assert!(fill.status.success(), "{fill:?}");
    let to = small.mountpoint.join("app");
    start_app(&d, "1Gi");
    let b1 = backup(&d, "b1", &to);
    assert_eq!(b1["status"]["kind"], "Full");
    let p1 = point_file(&to, 1, "app-data");
    let before = backup_manifest(&to);

    // More than the target holds.
    write_mib(&d, "big", 48);
    let out = backup_cmd(&d, "b2", &to, &["--wait"]);
    assert!(!out.status.success());
    let b2 = d.wait_final("virtualmachinebackups", "b2", BACKUP_TIMEOUT);
    assert_eq!(b2["status"]["phase"], "Failed", "{b2:#}");
    assert!(
        b2["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("No space left")),
        "{b2:#}"
    );
    // The target as it was: the same manifest, point 1 whole, nothing half
    // written beside it; the failed backup's checkpoint gone.
    assert_eq!(backup_manifest(&to), before);
    point_file(&to, 1, "app-data");
    let left: Vec<String> = std::fs::read_dir(to.join("app-data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["0001.qcow2"]);
    d.wait_gone("virtualmachinesnapshots", "b2-cp", Duration::from_secs(60));
    assert!(same_bytes(&p1, &checkpoint_disk(&d, &b1)));

    // Room again (the ballast gone): the next backup is an incremental over
    // point 1, holding what b2 could not.
    std::fs::remove_file(&ballast).unwrap();
    write_mib(&d, "small", 1);
    let b3 = backup(&d, "b3", &to);
    assert_eq!(b3["status"]["kind"], "Incremental", "{b3:#}");
    assert_eq!(b3["status"]["point"], 2, "{b3:#}");
    let p2 = point_file(&to, 2, "app-data");
    assert!(same_bytes(&p2, &checkpoint_disk(&d, &b3)));

    // The disk replaced by a larger one of the same name (a disk's size is
    // fixed when it is made, so this is how one grows): b3's checkpoint is
    // still there, but the next point is full, says "resized", and is exact.
    d.cli_ok(&["delete", "vm", "app"]);
    d.wait_gone("virtualmachines", "app", Duration::from_secs(120));
    d.cli_ok(&["delete", "disk", "app-data"]);
    d.wait_gone("virtualdisks", "app-data", Duration::from_secs(60));
    start_app(&d, "2Gi");
    assert!(d.get("virtualmachinesnapshots", "b3-cp").is_some());
    let b4 = backup(&d, "b4", &to);
    assert_full_because(&b4, "resized");
    let p3 = point_file(&to, 3, "app-data");
    assert!(
        same_bytes(&p3, &checkpoint_disk(&d, &b4)),
        "point 3 differs"
    );
    drop(d);
    drop(small);
}

/// The SHA-256 of a point's disk as raw bytes (its whole chain flattened).
fn raw_sha(file: &Path, scratch: &Path) -> String {
    let raw = scratch.join("point.raw");
    let _ = std::fs::remove_file(&raw);
    to_raw(file, &raw);
    let sum = sha256_file(&raw);
    std::fs::remove_file(&raw).unwrap();
    sum
}

#[test]
fn keeping_n_points_merges_the_oldest_into_a_full_one_and_every_kept_point_reads_the_same() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let to = d.dir.path().join("kept");
    start_app(&d, "1Gi");
    let run = |name: &str, extra: &[&str]| {
        backup_with(&d, name, &to, &[&["--keep", "2"], extra].concat())
    };
    let points = || -> Vec<(u64, String)> {
        backup_manifest(&to)["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["point"].as_u64().unwrap(),
                    p["kind"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    // Each point's bytes, read right after it was made.
    let mut sums = std::collections::BTreeMap::new();
    for (i, name) in ["k1", "k2", "k3", "k4"].iter().enumerate() {
        write_mib(&d, name, 1);
        let b = run(name, &[]);
        let n = i as u64 + 1;
        assert_eq!(b["status"]["point"], n, "{b:#}");
        sums.insert(n, raw_sha(&point_file(&to, n, "app-data"), &scratch));
        // Every point kept still reads what it read when it was made.
        for (p, _) in points() {
            assert_eq!(
                raw_sha(&point_file(&to, p, "app-data"), &scratch),
                sums[&p],
                "point {p} after {name}"
            );
        }
    }
    assert_eq!(
        points(),
        [(3, "Full".to_string()), (4, "Incremental".to_string())]
    );
    let files: Vec<String> = std::fs::read_dir(to.join("app-data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(files, ["0003.qcow2", "0004.qcow2"]);
    // Point 3 holds its whole disk now, point 4 still only its change.
    let info = Command::new("qemu-img")
        .args(["info", "--output=json", "-U"])
        .arg(to.join("app-data/0003.qcow2"))
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert!(info.get("backing-filename").is_none(), "{info:#}");

    // fullEvery 2: point 4 is the one incremental after point 3, so the
    // next point is full, and says why.
    write_mib(&d, "k5", 1);
    let b5 = run("k5", &["--full-every", "2"]);
    assert_full_because(&b5, "fullEvery 2");
    assert_eq!(points(), [(4, "Full".to_string()), (5, "Full".to_string())]);
    assert_eq!(raw_sha(&point_file(&to, 4, "app-data"), &scratch), sums[&4]);

    // Two backups asked for at once, one through a link to the same
    // directory: they take turns, so each gets a point of its own over the
    // one before it, and both points are whole (two copies at once would
    // both take point 6 and one commit would drop the other's).
    let link = d.dir.path().join("kept-link");
    std::os::unix::fs::symlink(&to, &link).unwrap();
    write_mib(&d, "k6", 1);
    for (name, dir) in [("k6", &to), ("k7", &link)] {
        let out = backup_cmd(&d, name, dir, &[]);
        assert!(out.status.success(), "{out:?}");
    }
    let mut made = std::collections::BTreeMap::new();
    for name in ["k6", "k7"] {
        let b = d.wait_final("virtualmachinebackups", name, BACKUP_TIMEOUT);
        assert_eq!(b["status"]["phase"], "Ready", "{b:#}");
        made.insert(b["status"]["point"].as_u64().unwrap(), name);
    }
    assert_eq!(made.keys().copied().collect::<Vec<_>>(), [6, 7], "{made:?}");
    assert_eq!(
        points(),
        [
            (4, "Full".to_string()),
            (5, "Full".to_string()),
            (6, "Incremental".to_string()),
            (7, "Incremental".to_string())
        ]
    );
    assert_every_point_whole(&to, "after two backups at once", false);
    let second = d.get("virtualmachinebackups", made[&7]).unwrap();
    assert_eq!(second["status"]["base"], made[&6], "{second:#}");
}

/// A small generator for the kill moments (splitmix64): the seed is printed,
/// and HEARTH_TEST_SEED repeats a run.
struct Moments(u64);

impl Moments {
    fn from_env() -> Moments {
        let seed = std::env::var("HEARTH_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("kill moments from seed {seed} (HEARTH_TEST_SEED={seed} repeats them)");
        Moments(seed)
    }

    /// Uniform in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Every point the manifest lists has every file, with the SHA-256 it gives
/// and a clean `qemu-img check`. While hearthd is down (`down`), a merge's
/// commit may have landed before its rename: the bytes the manifest names
/// may then be in `FILE.merged` (whole, checked), which the next start
/// renames in; after a start, only `FILE` counts.
fn assert_every_point_whole(to: &Path, when: &str, down: bool) {
    let m = backup_manifest(to);
    for p in m["points"].as_array().unwrap() {
        let n = p["point"].as_u64().unwrap();
        let f = p["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["disk"] == "app-data")
            .unwrap_or_else(|| panic!("{when}: point {n} has no app-data: {m:#}"));
        let want = f["sha256"].as_str().unwrap();
        let file = to.join(f["file"].as_str().unwrap());
        let merged = PathBuf::from(format!("{}.merged", file.display()));
        let holder = if sha256_file(&file) == want {
            file
        } else if down && merged.exists() && sha256_file(&merged) == want {
            merged
        } else {
            panic!(
                "{when}: point {n}: no file with the SHA-256 {want} the manifest gives ({})",
                file.display()
            );
        };
        let check = Command::new("qemu-img")
            .args(["check", "-U"])
            .arg(&holder)
            .output()
            .unwrap();
        assert!(check.status.success(), "{when}: point {n}: {check:?}");
    }
}

#[test]
fn hearthd_killed_at_random_moments_of_backups_never_counts_a_half_point() {
    let _serial = serial();
    let mut d = Daemon::start();
    let to = d.dir.path().join("killed");
    start_app(&d, "1Gi");
    let mut moments = Moments::from_env();
    // How long one backup takes here (full, so longer than the next ones):
    // the kills fall anywhere in it, and some after it.
    write_mib(&d, "r0", 4);
    let started = std::time::Instant::now();
    backup_with(&d, "r0", &to, &["--keep", "2"]);
    let span = started.elapsed();
    for round in 1..=4 {
        let name = format!("r{round}");
        write_mib(&d, &name, 4);
        let at = span.mul_f64(moments.next() * 1.2);
        let out = backup_cmd(&d, &name, &to, &["--keep", "2"]);
        assert!(out.status.success(), "{out:?}");
        std::thread::sleep(at);
        d.kill();
        // While hearthd is down, from the bytes alone.
        assert_every_point_whole(&to, &format!("{name} killed after {at:?}"), true);
        d.spawn();
        let b = d.wait_final("virtualmachinebackups", &name, BACKUP_TIMEOUT);
        assert_eq!(
            b["status"]["phase"], "Ready",
            "{name} killed after {at:?}: {b:#}"
        );
        assert_every_point_whole(&to, &format!("{name} after the restart"), false);
        let n = b["status"]["point"].as_u64().unwrap();
        assert_eq!(n, round + 1, "{b:#}");
        assert_eq!(listed_points(&to), [n - 1, n], "{name}: keep 2");
        assert!(
            same_bytes(&point_file(&to, n, "app-data"), &checkpoint_disk(&d, &b)),
            "{name} (killed after {at:?}) differs from its checkpoint"
        );
    }
    // Nothing the manifest does not name is left in the target.
    let files: std::collections::BTreeSet<String> = std::fs::read_dir(to.join("app-data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, ["0004.qcow2", "0005.qcow2"].map(String::from).into());

    // Restores killed part way. A point large enough that its copy takes a
    // while: 128 MiB more.
    write_mib(&d, "big", 128);
    let b = backup_with(&d, "r5", &to, &["--keep", "2"]);
    let truth = checkpoint_disk(&d, &b);
    let dir = to.to_str().unwrap();
    let started = std::time::Instant::now();
    d.cli_ok(&["restore", "backup", dir, "--as", "k0", "--no-vm", "--wait"]);
    let span = started.elapsed();
    assert!(same_bytes(&d.disk_path("k0-app-data"), &truth), "k0");
    let layers = d.state_dir().join("layers");
    let listing = || -> std::collections::BTreeSet<PathBuf> {
        std::fs::read_dir(&layers)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    };
    let mut copies_killed = 0;
    for k in 1..=3 {
        let name = format!("k{k}");
        let disk = format!("{name}-app-data");
        let before = listing();
        let asked = std::time::Instant::now();
        d.cli_ok(&["restore", "backup", dir, "--as", &name, "--no-vm"]);
        let at = if k == 1 {
            // Once the copy runs: a qemu-img writing into hearthd's state
            // is in the process table (looked for without a pause: the
            // copy may take a tenth of a second).
            let deadline = std::time::Instant::now() + BACKUP_TIMEOUT;
            while qemu_img_pids_naming(&d.state_dir()).is_empty() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{disk}: no copy seen: {:#}",
                    d.get_disk(&disk).unwrap_or_default()
                );
            }
            asked.elapsed()
        } else {
            let at = span.mul_f64(moments.next() * 1.2);
            std::thread::sleep(at);
            at
        };
        // From the process table: the copies running into hearthd's state.
        let copying = qemu_img_pids_naming(&d.state_dir());
        d.kill();
        // None outlives the daemon: by the time hearthd is reaped, each is
        // gone, dead, or has SIGKILL pending (the kernel's own record; a
        // copy left running would finish on its own within the wait below).
        for pid in &copying {
            if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                assert!(
                    killed(&status),
                    "{name}: qemu-img {pid} runs on after hearthd's death:\n{status}"
                );
            }
        }
        copies_killed += usize::from(!copying.is_empty());
        let written: Vec<PathBuf> = listing().difference(&before).cloned().collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while copying
            .iter()
            .any(|p| Path::new(&format!("/proc/{p}")).exists())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: qemu-img {copying:?} outlived hearthd"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d.spawn();
        let v = d.wait_final("virtualdisks", &disk, BACKUP_TIMEOUT);
        assert_eq!(
            v["status"]["phase"], "Ready",
            "{name} killed at {at:?}: {v:#}"
        );
        let path = d.disk_path(&disk);
        assert!(
            same_bytes(&path, &truth),
            "{name} (killed at {at:?}) differs from the point"
        );
        // A file the killed copy wrote is the disk's own or gone.
        for f in &written {
            assert!(
                *f == path || !f.exists(),
                "{name} (killed at {at:?}): {} left behind",
                f.display()
            );
        }
    }
    assert!(copies_killed > 0, "no kill fell inside a restore's copy");
}

/// From `/proc/PID/status`: the process is a zombie or dead, or SIGKILL
/// is pending for it or its thread group.
fn killed(status: &str) -> bool {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or("")
    };
    let pending = |name: &str| u64::from_str_radix(field(name), 16).unwrap_or(0) & (1 << 8) != 0;
    field("State:").starts_with(['Z', 'X']) || pending("SigPnd:") || pending("ShdPnd:")
}

/// `qemu-img` processes whose command line names a path under `dir`.
fn qemu_img_pids_naming(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.first().is_some_and(|a| a.ends_with("qemu-img"))
                && args.iter().any(|a| a.contains(&needle))
        })
        .collect()
}
