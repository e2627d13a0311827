//! Chain compaction end to end: real QEMU (a `block-stream` job under a
//! running guest), real `qemu-img rebase` for a stopped VM, real qcow2
//! files. Every claim is checked from ground truth: each remaining
//! snapshot's bytes (`qemu-img convert` of its layer, hashed), the live
//! disk's bytes, the guest's own `sha256sum` of its files (page cache
//! dropped first), the layer headers, the layers directory, and which files
//! QEMU holds open (`/proc/PID/fd`).

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);

fn delete_snapshot(d: &Daemon, name: &str) {
    d.cli_ok(&["delete", "snapshot", name]);
    d.wait_gone("virtualdisksnapshots", name, Duration::from_secs(60));
}

fn layers_dir(d: &Daemon) -> PathBuf {
    d.state_dir().join("layers")
}

fn layer_files(d: &Daemon) -> BTreeSet<PathBuf> {
    std::fs::read_dir(layers_dir(d))
        .expect("layers dir")
        .flatten()
        .map(|e| e.path())
        .collect()
}

/// What a qcow2 file's header names as its backing file.
fn header_backing(image: &Path) -> Option<PathBuf> {
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(image)
        .output()
        .expect("qemu-img");
    assert!(out.status.success(), "qemu-img info {}", image.display());
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    v["backing-filename"].as_str().map(PathBuf::from)
}

/// The layer files that lie over `head` (an overlay made ahead for the next
/// cut while the VM runs).
fn over(d: &Daemon, head: &Path) -> BTreeSet<PathBuf> {
    layer_files(d)
        .into_iter()
        .filter(|f| header_backing(f).as_deref() == Some(head))
        .collect()
}

/// The sha256 of an image read through its whole chain (raw).
fn chain_sha(image: &Path, scratch: &Path) -> String {
    let raw = scratch.join("chain.raw");
    let _ = std::fs::remove_file(&raw);
    let st = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(image)
        .arg(&raw)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert {}", image.display());
    let sum = sha256_file(&raw);
    std::fs::remove_file(&raw).expect("remove raw");
    sum
}

fn wait_chain_length(d: &Daemon, disk: &str, n: u64, timeout: Duration) {
    d.wait_object(
        "virtualdisks",
        disk,
        &format!("chain length {n}"),
        timeout,
        |v| v["status"]["chainLength"].as_u64() == Some(n),
    );
}

/// Files QEMU process `pid` has open.
fn open_by(pid: u32) -> BTreeSet<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .collect()
}

/// `qemu-img check` of `image` passes.
fn qemu_img_check(image: &Path) {
    let out = Command::new("qemu-img")
        .args(["check", "-U"])
        .arg(image)
        .output()
        .expect("qemu-img check");
    assert!(
        out.status.success(),
        "qemu-img check {}: {}",
        image.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

const O_ACCMODE: i32 = 0o3;
const O_RDONLY: i32 = 0o0;

/// The access mode (`O_RDONLY`, `O_RDWR`) of each descriptor process `pid`
/// holds of `file`, from `/proc/PID/fdinfo`.
fn access_modes(pid: u32, file: &Path) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .flatten()
        .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == file))
        .map(|fd| {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .expect("fdinfo");
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .expect("flags line");
            i32::from_str_radix(flags.trim(), 8).expect("octal flags") & O_ACCMODE
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The guest's own checksums of its files, read from the disk (the page
/// cache dropped first).
fn guest_sums(d: &Daemon, vm: &str) -> String {
    d.agent_sh_ok(
        vm,
        "sync; echo 3 > /proc/sys/vm/drop_caches; cd /data && for f in f* big; do [ ! -e $f ] || sha256sum $f; done",
    )
}

fn write_file(d: &Daemon, vm: &str, name: &str, kib: u32) {
    d.agent_sh_ok(
        vm,
        &format!(
            "dd if=/dev/urandom of=/data/{name} bs=64k count={} 2>/dev/null && sync",
            kib / 64
        ),
    );
}

/// Snapshots k1..k6 of `data-a`, each after a new file; returns each
/// snapshot's layer (the head at its cut).
fn six_snapshots(d: &Daemon) -> Vec<PathBuf> {
    let mut layers = Vec::new();
    for i in 1..=6 {
        write_file(d, "app", &format!("f{i}"), 256);
        let was = d.disk_path("data-a");
        snapshot_ready(d, &format!("k{i}"), "data-a", SNAP_TIMEOUT);
        assert_eq!(
            header_backing(&d.disk_path("data-a")).as_deref(),
            Some(was.as_path())
        );
        layers.push(was);
    }
    layers
}

#[test]
fn compaction_keeps_every_snapshot_and_the_live_disk_byte_identical() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    wait_chain_length(&d, "data-a", 1, Duration::from_secs(30));
    // L0(k1) <- L1(k2) <- ... <- L5(k6) <- head
    let layers = six_snapshots(&d);
    write_file(&d, "app", "f7", 256);
    wait_chain_length(&d, "data-a", 7, Duration::from_secs(30));
    let describe = d.cli_ok(&["describe", "disk", "data-a"]);
    assert!(
        describe.contains("chainLength:") && describe.contains('7'),
        "{describe}"
    );
    let sums = guest_sums(&d, "app");
    assert_eq!(sums.lines().count(), 7, "{sums}");
    let snap_sha = |i: usize| chain_sha(&layers[i - 1], &scratch);
    let before: Vec<String> = (1..=6).map(snap_sha).collect();
    assert_eq!(
        before.iter().collect::<BTreeSet<_>>().len(),
        6,
        "every snapshot differs"
    );
    let qemu = d.qemu_pids_of("app");
    assert_eq!(qemu.len(), 1);
    let live_head = d.disk_path("data-a");

    // 1. Online: k5 and k6 go while the guest runs. Their layers lie right
    // below the head: a block-stream job merges them into it, with k4's
    // layer as its base.
    delete_snapshot(&d, "k6");
    delete_snapshot(&d, "k5");
    wait_chain_length(&d, "data-a", 5, Duration::from_secs(60));
    let events = d.event_reasons("VirtualDisk", "data-a");
    assert!(
        events.iter().any(|r| r == "CompactionStarted"),
        "{events:?}"
    );
    assert!(events.iter().any(|r| r == "Compacted"), "{events:?}");
    assert_eq!(
        d.disk_path("data-a"),
        live_head,
        "the guest writes the same head"
    );
    assert_eq!(
        header_backing(&live_head).as_deref(),
        Some(layers[3].as_path()),
        "the head is backed by k4's layer now"
    );
    assert_eq!(backing_chain(&live_head).len(), 6, "5 layers and the image");
    let files = layer_files(&d);
    for gone in [&layers[4], &layers[5]] {
        assert!(!files.contains(gone), "{} is still there", gone.display());
    }
    // QEMU let go of the merged layers (their nodes and fd sets removed).
    let open = open_by(qemu[0]);
    assert!(
        open.contains(&live_head) && open.contains(&layers[3]),
        "{open:?}"
    );
    for gone in [&layers[4], &layers[5]] {
        assert!(
            !open.iter().any(|p| p.starts_with(gone)),
            "QEMU still holds {}: {open:?}",
            gone.display()
        );
    }
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest reads its files unchanged"
    );
    for i in 1..=4 {
        assert_eq!(snap_sha(i), before[i - 1], "k{i} changed");
    }
    // The guest keeps writing to the merged head.
    write_file(&d, "app", "f8", 128);
    let sums = guest_sums(&d, "app");

    // 2. Online, under a kept snapshot (rolling retention): k2 goes while
    // the guest runs. Its layer lies below k3's, which QEMU holds
    // read-only: the job writes into k3's layer, with k1's as its base.
    // First another process reads k3's layer (as a VM restored from it
    // would): the merge waits, and nothing is written under that reader.
    let reader = std::fs::File::open(&layers[2]).expect("open k3's layer");
    delete_snapshot(&d, "k2");
    wait_until(
        "the merge into k3's layer is left for later",
        Duration::from_secs(60),
        || {
            d.log()
                .contains("is open by a process other than the VM's QEMU")
        },
    );
    assert_eq!(
        header_backing(&layers[2]).as_deref(),
        Some(layers[1].as_path()),
        "k3's layer was written while another process read it"
    );
    assert!(layers[1].exists());
    drop(reader);
    // The next chance: a snapshot taken and deleted again. Its layer (the
    // old head) goes into the new head, k2's into k3's, in one pass.
    snapshot_ready(&d, "k7", "data-a", SNAP_TIMEOUT);
    delete_snapshot(&d, "k7");
    wait_chain_length(&d, "data-a", 4, Duration::from_secs(60));
    assert_eq!(
        header_backing(&layers[2]).as_deref(),
        Some(layers[0].as_path()),
        "k3's layer is backed by k1's now"
    );
    assert!(!layers[1].exists(), "k2's layer is removed");
    let live_head = d.disk_path("data-a");
    assert_eq!(
        header_backing(&live_head).as_deref(),
        Some(layers[3].as_path()),
        "the new head is backed by k4's layer"
    );
    assert_eq!(
        d.qemu_pids_of("app"),
        qemu,
        "the same QEMU runs\n{}",
        d.log()
    );
    let open = open_by(qemu[0]);
    assert!(
        !open.iter().any(|p| p.starts_with(&layers[1])),
        "QEMU still holds k2's layer: {open:?}"
    );
    // QEMU got k3's layer read-write for the job only.
    assert_eq!(
        access_modes(qemu[0], &layers[2]),
        vec![O_RDONLY],
        "QEMU's descriptors of k3's layer after the merge"
    );
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest reads its files unchanged"
    );
    for i in [1, 3, 4] {
        assert_eq!(snap_sha(i), before[i - 1], "k{i} changed");
    }
    qemu_img_check(&layers[2]);

    // 3. Online into a layer QEMU opened read-only at its launch: after a
    // restart of the VM every layer under the head is a read-only node over
    // a read-only descriptor. k3 goes; its layer lies below k4's.
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    d.cli_ok(&["start", "app"]);
    d.wait_agent("app");
    assert_eq!(guest_sums(&d, "app"), sums);
    let qemu = d.qemu_pids_of("app");
    assert_eq!(qemu.len(), 1);
    assert_eq!(
        access_modes(qemu[0], &layers[3]),
        vec![O_RDONLY],
        "QEMU opened k4's layer read-only at its launch"
    );
    delete_snapshot(&d, "k3");
    wait_chain_length(&d, "data-a", 3, Duration::from_secs(60));
    assert_eq!(
        header_backing(&layers[3]).as_deref(),
        Some(layers[0].as_path()),
        "k4's layer is backed by k1's now"
    );
    assert_eq!(backing_chain(&live_head).len(), 4);
    assert_eq!(d.qemu_pids_of("app"), qemu, "the same QEMU runs");
    assert_eq!(
        access_modes(qemu[0], &layers[3]),
        vec![O_RDONLY],
        "QEMU's descriptors of k4's layer after the merge"
    );
    assert!(!layers[2].exists(), "k3's layer is removed");
    assert_eq!(guest_sums(&d, "app"), sums);
    assert_eq!(snap_sha(1), before[0], "k1 changed");
    assert_eq!(snap_sha(4), before[3], "k4 changed");
    qemu_img_check(&layers[3]);

    // 4. Offline: with the VM stopped, k4 goes. Its layer lies right below
    // the head: qemu-img rebases the head onto k1's layer, copying up what
    // the head read through k4's; nothing else is written.
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    let live_before = chain_sha(&live_head, &scratch);
    delete_snapshot(&d, "k4");
    wait_chain_length(&d, "data-a", 2, Duration::from_secs(60));
    assert_eq!(
        header_backing(&live_head).as_deref(),
        Some(layers[0].as_path()),
        "the head is backed by k1's layer now"
    );
    assert_eq!(backing_chain(&live_head).len(), 3);
    assert_eq!(
        layer_files(&d),
        [live_head.clone(), layers[0].clone()]
            .into_iter()
            .collect::<BTreeSet<_>>(),
        "only the head and k1's layer are left"
    );
    assert_eq!(
        chain_sha(&live_head, &scratch),
        live_before,
        "the live disk changed"
    );
    assert_eq!(snap_sha(1), before[0], "k1 changed");
    qemu_img_check(&live_head);

    // 5. The VM boots from the compacted chain and reads the same files.
    d.cli_ok(&["start", "app"]);
    d.wait_agent("app");
    assert_eq!(guest_sums(&d, "app"), sums);
    // Cuts go on on the compacted chain.
    snapshot_ready(&d, "k9", "data-a", SNAP_TIMEOUT);
    wait_chain_length(&d, "data-a", 3, Duration::from_secs(30));
}

/// A minimal QMP client on the VM's socket, for when no hearthd runs.
fn qmp(socket: &Path, command: &str) -> Value {
    let s = std::os::unix::net::UnixStream::connect(socket).expect("qmp socket");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("greeting");
    let mut ask = |cmd: &str| -> Value {
        writeln!(w, "{{\"execute\":\"{cmd}\"}}").expect("write");
        loop {
            line.clear();
            r.read_line(&mut line).expect("reply");
            let v: Value = serde_json::from_str(line.trim()).expect("json");
            if v.get("return").is_some() || v.get("error").is_some() {
                return v;
            }
        }
    };
    ask("qmp_capabilities");
    ask(command)
}

fn stream_job(socket: &Path) -> Option<Value> {
    qmp(socket, "query-jobs")["return"]
        .as_array()?
        .iter()
        .find(|j| j["type"] == "stream")
        .cloned()
}

#[test]
fn a_compaction_survives_hearthd_being_killed_mid_job() {
    let _serial = serial();
    // 2 MiB/s: a 32 MiB layer takes the stream job ~16 s.
    let mut d = Daemon::start_with(&["--compaction-bytes-per-second", "2097152"]);
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    wait_chain_length(&d, "data-a", 1, Duration::from_secs(30));
    // L0(k1) <- L1(k2: 32 MiB of the guest's data) <- head
    write_file(&d, "app", "f1", 256);
    let l0 = d.disk_path("data-a");
    snapshot_ready(&d, "k1", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "big", 32 * 1024);
    let l1 = d.disk_path("data-a");
    snapshot_ready(&d, "k2", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "f2", 256);
    let live_head = d.disk_path("data-a");
    let sums = guest_sums(&d, "app");
    let k1 = chain_sha(&l0, &scratch);
    let qemu = d.qemu_pids_of("app");
    let qmp_sock = d.run_dir().join("vms/app/qmp.sock");

    delete_snapshot(&d, "k2");
    // The job's progress shows in the disk's status.
    d.wait_object(
        "virtualdisks",
        "data-a",
        "compaction progress",
        Duration::from_secs(60),
        |v| v["status"]["compaction"]["bytesDone"].as_u64() > Some(0),
    );
    // Killed mid-job: QEMU goes on with the job on its own.
    d.kill();
    let job = stream_job(&qmp_sock).expect("the stream job runs in QEMU with no daemon");
    assert_eq!(job["status"], "running", "{job:#}");
    // Back at once: the restarted daemon follows the job it finds running.
    d.spawn();
    d.wait_object(
        "virtualdisks",
        "data-a",
        "compaction progress after the restart",
        Duration::from_secs(60),
        |v| v["status"]["compaction"]["bytesDone"].as_u64() > job["current-progress"].as_u64(),
    );
    // The restarted daemon found the job running and followed it.
    assert!(
        d.log()
            .contains("following a compaction job started before a restart"),
        "{}",
        d.log()
    );
    // Killed again, and this time the job ends while no daemon runs.
    d.kill();
    let again = stream_job(&qmp_sock).expect("the stream job still runs");
    eprintln!(
        "killed at {} and at {} of {} bytes",
        job["current-progress"], again["current-progress"], again["total-progress"]
    );
    // The job dismisses itself when it ends (a concluded job left waiting
    // makes QEMU 10.0.2 crash on `query-named-block-nodes`).
    wait_until(
        "the stream job ends in QEMU",
        Duration::from_secs(120),
        || stream_job(&qmp_sock).is_none(),
    );
    assert_eq!(
        header_backing(&live_head).as_deref(),
        Some(l0.as_path()),
        "QEMU switched the head's backing itself"
    );
    assert!(l1.exists(), "nothing deleted while no daemon ran");
    d.spawn();
    wait_chain_length(&d, "data-a", 2, Duration::from_secs(60));
    let events = d.event_reasons("VirtualDisk", "data-a");
    assert_eq!(
        events.iter().filter(|r| *r == "Compacted").count(),
        1,
        "{events:?}"
    );
    assert!(!l1.exists(), "the merged layer is removed once settled");
    let open = open_by(qemu[0]);
    assert!(!open.iter().any(|p| p.starts_with(&l1)), "{open:?}");
    assert_eq!(d.qemu_pids_of("app"), qemu, "the same QEMU runs");
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest reads its files unchanged"
    );
    assert_eq!(chain_sha(&l0, &scratch), k1, "k1 changed");
}

#[test]
fn fifty_snapshots_of_a_running_guest_are_cut_and_compacted_back_to_two_layers() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    let bottom = d.disk_path("data-a");
    // Past ~45 layers QEMU's json: name of the chain is cut off at 4 KiB:
    // every cut must still find the head's file, and the merge its nodes.
    for i in 1..=50 {
        d.agent_sh_ok(
            "app",
            &format!("dd if=/dev/urandom of=/data/f{i} bs=4k count=1 2>/dev/null && sync"),
        );
        snapshot_ready(&d, &format!("s{i}"), "data-a", SNAP_TIMEOUT);
    }
    wait_chain_length(&d, "data-a", 51, Duration::from_secs(30));
    let sums = guest_sums(&d, "app");
    assert_eq!(sums.lines().count(), 50, "{sums}");
    let live_head = d.disk_path("data-a");
    let s1 = chain_sha(&bottom, &scratch);
    // All but the first go: everything between the head and s1's layer
    // is merged into the head.
    for i in (2..=50).rev() {
        d.cli_ok(&["delete", "snapshot", &format!("s{i}")]);
    }
    wait_chain_length(&d, "data-a", 2, Duration::from_secs(120));
    assert_eq!(d.disk_path("data-a"), live_head);
    assert_eq!(
        header_backing(&live_head).as_deref(),
        Some(bottom.as_path())
    );
    // Besides the chain, at most the overlay made ahead for the next cut.
    let ahead = over(&d, &live_head);
    assert!(ahead.len() <= 1, "{ahead:?}");
    let chain: BTreeSet<PathBuf> = [live_head.clone(), bottom.clone()].into_iter().collect();
    assert_eq!(
        layer_files(&d),
        chain.union(&ahead).cloned().collect::<BTreeSet<_>>()
    );
    let qemu = d.qemu_pids_of("app");
    let open: BTreeSet<PathBuf> = open_by(qemu[0])
        .into_iter()
        .filter(|p| p.starts_with(layers_dir(&d)))
        .collect();
    assert!(
        open.is_subset(&chain.union(&ahead).cloned().collect()),
        "QEMU holds the head, the bottom and at most the overlay made ahead: {open:?}"
    );
    assert!(
        open.contains(&live_head) && open.contains(&bottom),
        "{open:?}"
    );
    assert_eq!(guest_sums(&d, "app"), sums);
    assert_eq!(chain_sha(&bottom, &scratch), s1, "s1 changed");
    // And cuts go on on the compacted chain.
    snapshot_ready(&d, "after", "data-a", SNAP_TIMEOUT);
    wait_chain_length(&d, "data-a", 3, Duration::from_secs(30));
}

/// A `qemu-img rebase` of this daemon's layers, from the process table.
fn rebase_pid(d: &Daemon) -> Option<u32> {
    let marker = d.dir.path().to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<String> = c
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                args.first().is_some_and(|a| a.ends_with("qemu-img"))
                    && args.iter().any(|a| a == "rebase")
                    && args.iter().any(|a| a.contains(&marker))
            })
        })
}

/// A VM `app` with an unformatted disk `raw-a` written raw by the guest:
/// L0(k1) <- L1(k2: 384 MiB) <- L2(k3) <- head, then stopped. Returns the
/// three layers and the hashes of k1, k3 and the live disk.
struct RawChain {
    l0: PathBuf,
    l1: PathBuf,
    l2: PathBuf,
    live_head: PathBuf,
    k1: String,
    k3: String,
    live: String,
}

fn raw_chain_of_a_stopped_vm(d: &Daemon, scratch: &Path) -> RawChain {
    apply_manifest(
        d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            Disk::blank("raw-a", "512Mi").yaml(),
            vm_yaml("app", "AlwaysOn", &["raw-a"], "")
        ),
    );
    d.wait_agent("app");
    d.agent_sh_ok(
        "app",
        "dd if=/dev/urandom of=/dev/vda bs=1M count=4 conv=fsync 2>/dev/null",
    );
    let l0 = d.disk_path("raw-a");
    snapshot_ready(d, "k1", "raw-a", SNAP_TIMEOUT);
    d.agent_sh_ok(
        "app",
        "dd if=/dev/urandom of=/tmp/r bs=1M count=4 2>/dev/null && i=0; \
         while [ $i -lt 96 ]; do cat /tmp/r; i=$((i+1)); done | dd of=/dev/vda bs=1M seek=8 conv=fsync 2>/dev/null; rm /tmp/r",
    );
    let l1 = d.disk_path("raw-a");
    snapshot_ready(d, "k2", "raw-a", SNAP_TIMEOUT);
    d.agent_sh_ok(
        "app",
        "dd if=/dev/urandom of=/dev/vda bs=1M seek=4 count=1 conv=fsync 2>/dev/null",
    );
    let l2 = d.disk_path("raw-a");
    snapshot_ready(d, "k3", "raw-a", SNAP_TIMEOUT);
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    let live_head = d.disk_path("raw-a");
    RawChain {
        k1: chain_sha(&l0, scratch),
        k3: chain_sha(&l2, scratch),
        live: chain_sha(&live_head, scratch),
        l0,
        l1,
        l2,
        live_head,
    }
}

/// Deletes k2 and returns the pid of the `qemu-img rebase` hearthd starts.
fn delete_k2_and_find_the_rebase(d: &Daemon) -> u32 {
    d.cli_ok(&["delete", "snapshot", "k2"]);
    let mut pid = None;
    // Every 2 ms: the rebase may not run for long.
    let found = eventually_every(Duration::from_millis(2), Duration::from_secs(60), || {
        pid = rebase_pid(d);
        pid.is_some()
    });
    assert!(found, "no qemu-img rebase\n{}", d.log());
    pid.expect("found")
}

#[test]
fn a_start_kills_an_offline_rebase_and_the_merge_is_then_done_online() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let c = raw_chain_of_a_stopped_vm(&d, &scratch);
    // k2 goes while the VM is stopped: qemu-img rebases k3's layer. It is
    // held still (SIGSTOP) so that it is surely running when the start
    // comes, as a long copy would be.
    let pid = delete_k2_and_find_the_rebase(&d);
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill")
            .success()
    );
    let asked = std::time::Instant::now();
    d.cli_ok(&["start", "app"]);
    d.wait_phase("app", "Running", Duration::from_secs(60));
    eprintln!(
        "running {:.1} s after the start was asked",
        asked.elapsed().as_secs_f64()
    );
    assert!(!is_alive(pid), "the rebase still runs after the start");
    assert!(d.log().contains("killing a qemu-img rebase"), "{}", d.log());
    // Killed before its switch: and then merged online, into the kept
    // layer of the running VM.
    wait_chain_length(&d, "raw-a", 3, Duration::from_secs(120));
    let started: Vec<String> = d
        .events("VirtualDisk", "raw-a")
        .into_iter()
        .filter(|e| e["reason"] == "CompactionStarted")
        .filter_map(|e| e["message"].as_str().map(str::to_owned))
        .collect();
    assert!(
        started.last().is_some_and(|m| m.contains("block-stream")),
        "{started:?}"
    );
    assert_eq!(header_backing(&c.l2).as_deref(), Some(c.l0.as_path()));
    assert!(!c.l1.exists(), "the merged layer is removed");
    let qemu = d.qemu_pids_of("app");
    assert_eq!(qemu.len(), 1);
    assert_eq!(access_modes(qemu[0], &c.l2), vec![O_RDONLY]);
    assert_eq!(chain_sha(&c.l0, &scratch), c.k1, "k1 changed");
    assert_eq!(chain_sha(&c.l2, &scratch), c.k3, "k3 changed");
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    assert_eq!(
        chain_sha(&c.live_head, &scratch),
        c.live,
        "the live disk changed"
    );
    qemu_img_check(&c.l2);
}

#[test]
fn an_offline_compaction_killed_with_its_qemu_img_is_done_again_and_changes_nothing() {
    let _serial = serial();
    let mut d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let RawChain {
        l0,
        l1,
        l2,
        live_head,
        k1,
        k3,
        live,
    } = raw_chain_of_a_stopped_vm(&d, &scratch);

    // k2 goes: hearthd rebases k3's layer onto k1's. Both hearthd and its
    // qemu-img are killed in the middle of the copy.
    let pid = delete_k2_and_find_the_rebase(&d);
    d.kill();
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    wait_until("qemu-img gone", Duration::from_secs(10), || {
        !Path::new(&format!("/proc/{pid}")).exists() || !is_alive(pid)
    });
    assert_eq!(
        header_backing(&l2).as_deref(),
        Some(l1.as_path()),
        "killed before the switch"
    );
    assert!(l1.exists());
    // Half-copied: k3 still reads exactly as before.
    assert_eq!(
        chain_sha(&l2, &scratch),
        k3,
        "a half-done rebase changed k3"
    );

    d.spawn();
    wait_chain_length(&d, "raw-a", 3, Duration::from_secs(120));
    let events = d.event_reasons("VirtualDisk", "raw-a");
    assert!(
        events.iter().any(|r| r == "CompactionAbandoned"),
        "{events:?}"
    );
    assert!(events.iter().any(|r| r == "Compacted"), "{events:?}");
    assert_eq!(header_backing(&l2).as_deref(), Some(l0.as_path()));
    assert!(!l1.exists(), "the merged layer is removed");
    assert_eq!(chain_sha(&l0, &scratch), k1, "k1 changed");
    assert_eq!(chain_sha(&l2, &scratch), k3, "k3 changed");
    assert_eq!(
        chain_sha(&live_head, &scratch),
        live,
        "the live disk changed"
    );
    qemu_img_check(&l2);
}

#[test]
fn a_stop_cancels_a_throttled_merge_which_is_then_done_offline() {
    let _serial = serial();
    // 1 MiB/s: the 32 MiB layer would take the job half a minute.
    let d = Daemon::start_with(&["--compaction-bytes-per-second", "1048576"]);
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    write_file(&d, "app", "f1", 256);
    let l0 = d.disk_path("data-a");
    snapshot_ready(&d, "k1", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "big", 32 * 1024);
    let l1 = d.disk_path("data-a");
    snapshot_ready(&d, "k2", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "f2", 256);
    let live_head = d.disk_path("data-a");
    let sums = guest_sums(&d, "app");
    let k1 = chain_sha(&l0, &scratch);

    delete_snapshot(&d, "k2");
    d.wait_object(
        "virtualdisks",
        "data-a",
        "compaction progress",
        Duration::from_secs(60),
        |v| v["status"]["compaction"]["bytesDone"].as_u64() > Some(0),
    );
    let asked = std::time::Instant::now();
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    let stop_s = asked.elapsed().as_secs_f64();
    eprintln!("stopped {stop_s:.1} s after the stop was asked");
    assert!(
        stop_s < 20.0,
        "the stop waited for the merge: {stop_s:.1} s"
    );
    assert!(
        d.log().contains("cancelling a compaction job"),
        "{}",
        d.log()
    );
    // With no QEMU left, the merge is done offline at once.
    wait_chain_length(&d, "data-a", 2, Duration::from_secs(60));
    assert_eq!(header_backing(&live_head).as_deref(), Some(l0.as_path()));
    assert!(!l1.exists());
    assert_eq!(chain_sha(&l0, &scratch), k1, "k1 changed");
    d.cli_ok(&["start", "app"]);
    d.wait_agent("app");
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest reads its files unchanged"
    );
}

/// hearthd's PATH with a `qemu-img` in `dir` that runs the real one,
/// except for the first safe `qemu-img rebase` (not `-u`), which it runs
/// under strace's fault injection: killed by SIGKILL at its first
/// `fdatasync`. qemu-img 10.0.2 has written the copied clusters, the header
/// naming the new base and the refcounts by then, but not the L2 tables
/// that point at the copies.
fn qemu_img_killed_at_fdatasync(dir: &Path) -> String {
    let strace = Command::new("sh")
        .args(["-c", "command -v strace"])
        .output()
        .expect("sh");
    assert!(
        strace.status.success(),
        "strace is missing: apt-get install strace (.ci/install-deps.sh)"
    );
    let once = dir.join("killed-once");
    common::qemu_img_log::wrapped_qemu_img(
        dir,
        &format!(
            "case \" $* \" in\n\
             *\" rebase \"*\" -u \"*) ;;\n\
             *\" rebase \"*) if [ ! -e {once} ]; then : > {once}; \
             exec strace -f -o /dev/null -e inject=fdatasync:signal=KILL:when=1 \"$REAL\" \"$@\"; fi ;;\n\
             esac",
            once = once.display(),
        ),
    )
}

#[test]
fn an_offline_merge_killed_after_its_header_switch_is_set_back_and_loses_nothing() {
    let _serial = serial();
    let tools = tempfile::tempdir().expect("tempdir");
    let path = qemu_img_killed_at_fdatasync(tools.path());
    let d = Daemon::start_env(&[("PATH", &path)]);
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let c = raw_chain_of_a_stopped_vm(&d, &scratch);

    // k2 goes while the VM is stopped: qemu-img rebases k3's layer onto
    // k1's and is killed at its first fdatasync, with the header switched.
    d.cli_ok(&["delete", "snapshot", "k2"]);
    wait_until(
        "the merge is settled after the kill",
        Duration::from_secs(60),
        || {
            d.event_reasons("VirtualDisk", "raw-a")
                .iter()
                .any(|r| r == "CompactionAbandoned")
        },
    );
    assert!(tools.path().join("killed-once").exists(), "the kill ran");
    // Nothing proved the merged data referenced: the header is set back,
    // the merged layer is still there, and every view reads as before.
    assert_eq!(
        header_backing(&c.l2).as_deref(),
        Some(c.l1.as_path()),
        "{:?}",
        d.events("VirtualDisk", "raw-a")
    );
    assert!(c.l1.exists(), "the merged layer must stay");
    assert_eq!(chain_sha(&c.l2, &scratch), c.k3, "k3 changed");
    assert_eq!(
        chain_sha(&c.live_head, &scratch),
        c.live,
        "the live disk changed"
    );
    assert_eq!(chain_sha(&c.l0, &scratch), c.k1, "k1 changed");
    qemu_img_check(&c.l2);

    // After the pause for a failed merge, the merge is done again (the
    // wrapper kills only once) and changes nothing either.
    wait_chain_length(&d, "raw-a", 3, Duration::from_secs(150));
    assert_eq!(header_backing(&c.l2).as_deref(), Some(c.l0.as_path()));
    assert!(!c.l1.exists(), "the merged layer is removed");
    assert_eq!(chain_sha(&c.l2, &scratch), c.k3, "k3 changed");
    assert_eq!(
        chain_sha(&c.live_head, &scratch),
        c.live,
        "the live disk changed"
    );
    qemu_img_check(&c.l2);
}

#[test]
fn a_guest_keeps_its_synced_file_when_qemu_is_killed_right_after_a_merge_into_the_head() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    write_file(&d, "app", "f1", 256);
    let l0 = d.disk_path("data-a");
    snapshot_ready(&d, "k1", "data-a", SNAP_TIMEOUT);
    // The second file lands in the layer that k2's cut closes.
    write_file(&d, "app", "f2", 2048);
    let l1 = d.disk_path("data-a");
    snapshot_ready(&d, "k2", "data-a", SNAP_TIMEOUT);
    let sums = guest_sums(&d, "app");
    assert!(sums.contains("f2"), "{sums}");
    let k1 = chain_sha(&l0, &scratch);
    let qemu = d.qemu_pids_of("app");
    assert_eq!(qemu.len(), 1);
    // An idle guest: nothing flushes QEMU's cache from here on.
    std::thread::sleep(Duration::from_secs(3));
    delete_snapshot(&d, "k2");
    wait_until("the merge into the head", Duration::from_secs(60), || {
        d.event_reasons("VirtualDisk", "data-a")
            .iter()
            .any(|r| r == "Compacted")
    });
    assert!(!l1.exists(), "the merged layer is removed once settled");
    // The moment the merged layer is gone: QEMU dies uncleanly.
    assert!(
        Command::new("kill")
            .args(["-KILL", &qemu[0].to_string()])
            .status()
            .expect("kill")
            .success()
    );
    wait_until("the old QEMU is gone", Duration::from_secs(10), || {
        !is_alive(qemu[0])
    });
    // hearthd starts the VM again (AlwaysOn): ext4 replays its journal, and
    // every file the guest had synced reads as it did.
    wait_until("a new QEMU", Duration::from_secs(60), || {
        d.qemu_pids_of("app").first().is_some_and(|p| *p != qemu[0])
    });
    d.wait_agent("app");
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest lost data it had synced"
    );
    assert_eq!(chain_sha(&l0, &scratch), k1, "k1 changed");
}

#[test]
fn a_kept_layer_is_read_only_again_when_its_merge_ended_while_hearthd_was_down() {
    let _serial = serial();
    // 2 MiB/s: a 32 MiB layer takes the stream job ~16 s.
    let mut d = Daemon::start_with(&["--compaction-bytes-per-second", "2097152"]);
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data-a"),
            vm_yaml("app", "AlwaysOn", &["data-a"], "")
        ),
    );
    d.wait_agent("app");
    // L0(k1) <- L1(k2: 32 MiB) <- L2(k3) <- head: k2 goes, L1 is merged
    // into k3's layer, which QEMU holds read-only but for the job.
    write_file(&d, "app", "f1", 256);
    let l0 = d.disk_path("data-a");
    snapshot_ready(&d, "k1", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "big", 32 * 1024);
    let l1 = d.disk_path("data-a");
    snapshot_ready(&d, "k2", "data-a", SNAP_TIMEOUT);
    write_file(&d, "app", "f2", 256);
    let l2 = d.disk_path("data-a");
    snapshot_ready(&d, "k3", "data-a", SNAP_TIMEOUT);
    let sums = guest_sums(&d, "app");
    let k1 = chain_sha(&l0, &scratch);
    let k3 = chain_sha(&l2, &scratch);
    let qemu = d.qemu_pids_of("app");
    let qmp_sock = d.run_dir().join("vms/app/qmp.sock");

    delete_snapshot(&d, "k2");
    d.wait_object(
        "virtualdisks",
        "data-a",
        "compaction progress",
        Duration::from_secs(60),
        |v| v["status"]["compaction"]["bytesDone"].as_u64() > Some(0),
    );
    // While the job runs QEMU writes k3's layer; hearthd dies, and the job
    // ends with no daemon.
    assert!(
        access_modes(qemu[0], &l2).contains(&0o2),
        "O_RDWR for the job"
    );
    d.kill();
    wait_until(
        "the stream job ends in QEMU",
        Duration::from_secs(120),
        || stream_job(&qmp_sock).is_none(),
    );
    assert_eq!(header_backing(&l2).as_deref(), Some(l0.as_path()));
    assert!(
        access_modes(qemu[0], &l2).contains(&0o2),
        "QEMU still holds the layer read-write with no daemon"
    );
    d.spawn();
    wait_until("the merge is settled", Duration::from_secs(60), || {
        d.event_reasons("VirtualDisk", "data-a")
            .iter()
            .any(|r| r == "Compacted")
    });
    assert_eq!(
        access_modes(qemu[0], &l2),
        vec![O_RDONLY],
        "k3's layer is read-only again"
    );
    assert!(!l1.exists(), "the merged layer is removed once settled");
    assert_eq!(d.qemu_pids_of("app"), qemu, "the same QEMU runs");
    assert_eq!(chain_sha(&l0, &scratch), k1, "k1 changed");
    assert_eq!(chain_sha(&l2, &scratch), k3, "k3 changed");
    assert_eq!(
        guest_sums(&d, "app"),
        sums,
        "the guest reads its files unchanged"
    );
}
