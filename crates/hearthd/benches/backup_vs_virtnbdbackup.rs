//! Benchmark (not a test): backups as a user takes them, `hearth backup`
//! against virtnbdbackup, side by side on the same guest image, with the
//! same writes between backups, in one run.
//!
//! The guest is the small test guest (guest/build.sh: kernel, initramfs with
//! qemu-ga and `/bin/stallwatch`), 256 MiB, 1 vCPU, q35, TCG on both sides,
//! with one virtio disk: a qcow2 overlay over one base image the bench makes
//! (a 4 GiB ext4, `HEARTH_BENCH_PREFILL_MIB` of random data in it, default
//! 1024), mounted by the guest at `/mnt/vda` and `/data`. hearth's VM `bk`
//! (disk `bk-data`) and libvirt's transient domain `hearth-bench-bk` (acpi,
//! a qemu-ga channel, no network) run at once. libvirt and virtnbdbackup
//! are for this benchmark only, never CI (Debian 12, keeps QEMU 10 from
//! bookworm-backports; check first with `apt-get -s` that nothing is
//! removed or downgraded):
//!
//!   apt-get install -y --no-install-recommends libvirt-daemon-system \
//!       libvirt-daemon-system-sysv libvirt-clients virtnbdbackup
//!
//! `support/libvirt-up.sh` starts libvirt. Each of REPS rounds (default 5,
//! `HEARTH_BENCH_REPS`), each step on both sides, which side goes first
//! alternating by round:
//! - full: into an empty directory, hearth `hearth backup vm bk --to DIR
//!   --wait` (the real CLI, a new process), virtnbdbackup `virtnbdbackup -d
//!   DOM -l full -o DIR` (it freezes the guest's filesystems through the
//!   agent by itself when there is one);
//! - for each size of `HEARTH_BENCH_SIZES` (MiB, default `1,16,64,256`): that
//!   much random data written in both guests (`dd if=/dev/urandom
//!   conv=fsync; sync`), then on hearth's side the changed clusters read
//!   alone (the data clusters of the disk's head layer, which holds exactly
//!   what the guest wrote since the previous backup's cut: their host
//!   offsets from `qemu-img map` of the layer without its backing file, then
//!   `pread` of those ranges from the file), then the incremental on both
//!   sides (`-l inc`);
//! - the window: one more incremental on each side and a plain `hearth
//!   snapshot vm bk --wait`, each while `stallwatch` appends ~1 record per
//!   ms to the disk; the window is the longest gap between its completed
//!   writes that overlaps the command (guest and host clocks related as in
//!   `snapshot_latency`), and for hearth also the checkpoint's (or the
//!   snapshot's) `status.freezeWindowMs`;
//! - restore of the newest point: hearth `hearth restore backup DIR --as
//!   NAME --no-vm` until the disk is Ready (the whole chain copied into the
//!   disk's own layer), virtnbdrestore `virtnbdrestore -i DIR -o OUTDIR`.
//!
//! Every hearth backup's `freezeWindowMs`, `bytesRead`, `bytesWritten` and
//! `durationMs` (copy started → commit) are recorded, and where its CLI
//! wall time goes, from hearthd's events on the host's wall clock (the
//! backup's `CutRequested` and `Ready`, the checkpoint snapshot's `Ready`);
//! after each hearth incremental, the steps of its copy are run again alone
//! with the same tools on the point just made ([`parts`]).
//!
//! At the end of a round its restored disk, plain snapshot, last checkpoint,
//! directories and the files written in the guests are removed.
//!
//! Run: `cargo build --release -p hearth && cargo bench -p hearthd --bench
//! backup_vs_virtnbdbackup` (root). Without `--bench` (as `cargo test`
//! builds it) it does nothing.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;
use support::libvirt::{self, URI as VIRSH_URI, run};
use support::{
    asked_to_run, chmod, clock_offset, env_num, fmt, loadavg, rfc3339_ms, stats, unix_ms,
};

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use serde_json::{Value, json};

/// How long a script in libvirt's guest may take.
const EXEC_TIMEOUT: Duration = Duration::from_secs(300);
/// The packages this benchmark needs besides libvirt's.
const ALSO_INSTALL: &str = " virtnbdbackup";
const VM: &str = "bk";
const DISK: &str = "bk-data";
const DOMAIN: &str = "hearth-bench-bk";
const OP_TIMEOUT: Duration = Duration::from_secs(1800);
/// The steps [`parts`] times.
const PARTS: usize = 6;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Hearth,
    Libvirt,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Hearth => "hearth",
            Side::Libvirt => "virtnbdbackup",
        }
    }
}

/// One timed operation.
#[derive(Clone, Debug, Default)]
struct Op {
    round: usize,
    /// `full`, `inc N MiB`, `window`, `snapshot`, `restore`.
    step: String,
    side: Option<Side>,
    wall_ms: f64,
    /// The files the operation wrote (the point's file; virtnbdbackup's
    /// data file; the restored image).
    bytes_written: u64,
    /// hearth: `status.bytesRead` (the extents copied).
    bytes_read: Option<u64>,
    /// hearth: `status.durationMs` (the copy's start → commit; the copy
    /// starts when the backup's reconcile sees its checkpoint Ready).
    duration_ms: Option<f64>,
    /// hearth: the checkpoint's (or snapshot's) `status.freezeWindowMs`.
    freeze_ms: Option<f64>,
    /// The window step: the longest gap stallwatch saw during the command.
    guest_ms: Option<f64>,
    /// hearth: ms after the CLI's spawn: the backup's `CutRequested`
    /// event, the checkpoint snapshot's `Ready` event (the cut done), the
    /// copy's start (the backup's `Ready` event less `durationMs`), the
    /// backup's `Ready` event.
    marks: Option<[f64; 4]>,
    /// hearth restores: the SHA-256 of every file of the chain, then the
    /// steps of the copy (see [`restore_parts`]), each run again alone
    /// after the restore (ms).
    restore_parts: Option<[f64; 1 + PARTS]>,
    /// hearth full and incremental backups: the steps of the copy, each
    /// run again alone on the point just made (see [`parts`]), ms.
    parts: Option<[f64; PARTS]>,
    /// hearth incrementals: the changed clusters (the head layer's data
    /// clusters before the backup), their bytes, and the time to read
    /// them alone, and `qemu-img map`'s time that found them.
    changed_bytes: Option<u64>,
    read_ms: Option<f64>,
    map_ms: Option<f64>,
    /// The same bytes written into a new file beside the target and
    /// fsynced, alone (ms): the floor of any copy that makes them durable.
    write_ms: Option<f64>,
    load: String,
}

/// The libvirt domain, destroyed when dropped (also on a panic).
struct Domain;

impl Drop for Domain {
    fn drop(&mut self) {
        let _ = Command::new("virsh")
            .args(["-c", VIRSH_URI, "destroy", DOMAIN])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn main() {
    if !asked_to_run("backup_vs_virtnbdbackup") {
        return;
    }
    let reps = env_num("HEARTH_BENCH_REPS", 5);
    let prefill = env_num("HEARTH_BENCH_PREFILL_MIB", 1024);
    let stall_s = env_num("HEARTH_BENCH_STALL_SECONDS", 8) as u64;
    let sizes: Vec<usize> = std::env::var("HEARTH_BENCH_SIZES")
        .unwrap_or_else(|_| "1,16,64,256".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    libvirt::up(&repo_root(), ALSO_INSTALL);
    for tool in ["virtnbdbackup", "virtnbdrestore"] {
        assert!(
            Command::new(tool)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
            "{tool} is missing: apt-get install -y --no-install-recommends virtnbdbackup"
        );
    }

    let work = tempfile::Builder::new()
        .prefix("hearth-bench-backup-")
        .tempdir()
        .expect("tempdir");
    // libvirt's QEMU runs as libvirt-qemu: it must reach the files.
    chmod(work.path(), 0o755);
    let t = Instant::now();
    let base = make_base(work.path(), prefill);
    eprintln!(
        "backup_vs_virtnbdbackup: base image with {prefill} MiB of data in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let root = work.path().to_str().expect("utf-8 temp path").to_string();
    let d = Daemon::start_with(&["--image-root", &root]);
    boot_hearth(&d, &base);
    let _domain = boot_libvirt(work.path(), &base);
    d.wait_agent(VM);
    libvirt::wait_agent(DOMAIN, Duration::from_secs(180));
    for side in [Side::Hearth, Side::Libvirt] {
        let (_, mounts) = exec(&d, side, "grep ' /data ' /proc/mounts");
        assert!(mounts.contains("/data"), "{side:?}: /data: {mounts}");
    }

    let mut ops: Vec<Op> = Vec::new();
    for round in 0..reps {
        let order = if round % 2 == 0 {
            [Side::Hearth, Side::Libvirt]
        } else {
            [Side::Libvirt, Side::Hearth]
        };
        let rdir = work.path().join(format!("r{round}"));
        std::fs::create_dir_all(&rdir).expect("round dir");
        chmod(&rdir, 0o755);
        let dir = |side: Side| rdir.join(side.label());
        let mut last_backup = String::new();

        // Full, into an empty directory. hearth's copy steps are run
        // again after both sides' backups, so they slow neither.
        for side in order {
            let name = format!("r{round}-full");
            let op = backup(&d, side, &dir(side), "full", &name, round);
            if side == Side::Hearth {
                last_backup = name;
            }
            push(op, &mut ops);
        }
        set_parts(&mut ops, parts(&d, &dir(Side::Hearth), None, &rdir));
        // Incrementals after known writes.
        for (i, mib) in sizes.iter().enumerate() {
            for side in order {
                write_random(&d, side, &format!("r{round}-w{i}"), *mib);
            }
            let (changed, map_ms, read_ms, write_ms) = read_changed(&d, &rdir);
            let previous = last_backup.clone();
            for side in order {
                let name = format!("r{round}-i{i}");
                let mut op = backup(
                    &d,
                    side,
                    &dir(side),
                    &format!("inc {mib} MiB"),
                    &name,
                    round,
                );
                if side == Side::Hearth {
                    op.changed_bytes = Some(changed);
                    op.map_ms = Some(map_ms);
                    op.read_ms = Some(read_ms);
                    op.write_ms = Some(write_ms);
                    last_backup = name;
                }
                push(op, &mut ops);
            }
            set_parts(
                &mut ops,
                parts(&d, &dir(Side::Hearth), Some(&previous), &rdir),
            );
        }
        // The freeze as the guest sees it: an incremental on each side and
        // a plain snapshot on hearth's, each under a writer.
        let mut steps: Vec<(Side, bool)> = order.iter().map(|s| (*s, false)).collect();
        steps.push((Side::Hearth, true));
        for (side, plain) in steps {
            let name = if plain {
                format!("r{round}-snap")
            } else {
                format!("r{round}-win")
            };
            let op = windowed(&d, side, plain, &dir(side), &name, round, stall_s);
            if side == Side::Hearth && !plain {
                last_backup = name;
            }
            push(op, &mut ops);
        }
        // Restore of the newest point; hearth's steps run again after both.
        for side in order {
            let op = restore(&d, side, &dir(side), &rdir, round);
            push(op, &mut ops);
        }
        let steps = restore_parts(&dir(Side::Hearth), &rdir);
        if let Some(op) = ops.iter_mut().rev().find(|o| o.side == Some(Side::Hearth)) {
            op.restore_parts = Some(steps);
        }
        // Nothing of the round stays: the restored disk, the snapshot, the
        // last checkpoint (it would pin its layer), the directories.
        let disk = format!("r{round}-rs-{DISK}");
        let _ = d.request("DELETE", &format!("/v1/virtualdisks/{disk}"), None);
        for snap in [format!("r{round}-snap"), format!("{last_backup}-cp")] {
            d.cli_ok(&["delete", "vmsnapshot", &snap]);
            d.wait_gone("virtualmachinesnapshots", &snap, Duration::from_secs(120));
        }
        d.wait_gone("virtualdisks", &disk, Duration::from_secs(120));
        std::fs::remove_dir_all(&rdir).expect("remove the round's directories");
        // The round's files go in the guests too (ext4 may use their
        // blocks again; the disk's allocated size still only grows).
        for side in order {
            let (code, out) = exec(&d, side, &format!("rm -f /data/r{round}-* && sync"));
            assert_eq!(code, 0, "{side:?}: removing the round's files: {out}");
        }
    }
    let load: Vec<String> = ops.iter().map(|o| o.load.clone()).collect();
    let _ = d.request("DELETE", &format!("/v1/virtualmachines/{VM}"), None);
    drop(_domain);
    wait_until("VMs gone", Duration::from_secs(120), || {
        d.qemu_pids().is_empty()
    });
    print_tables(&ops, &sizes, prefill, &load);
}

/// Gives hearth's newest operation its copy steps.
fn set_parts(ops: &mut [Op], parts: [f64; PARTS]) {
    if let Some(op) = ops.iter_mut().rev().find(|o| o.side == Some(Side::Hearth)) {
        op.parts = Some(parts);
    }
}

/// Records an operation (and says it on stderr).
fn push(op: Op, ops: &mut Vec<Op>) {
    eprintln!(
        "backup_vs_virtnbdbackup: round {} {} {}: {:.0} ms, written {} B, read {:?}, duration {:?}, freeze {:?}, guest-seen {:?}, marks {:?}, changed {:?} B read in {:?} ms (map {:?} ms), load {}",
        op.round + 1,
        op.step,
        op.side.map_or("–", Side::label),
        op.wall_ms,
        op.bytes_written,
        op.bytes_read,
        op.duration_ms,
        op.freeze_ms,
        op.guest_ms,
        op.marks,
        op.changed_bytes,
        op.read_ms,
        op.map_ms,
        op.load
    );
    ops.push(op);
}

/// A 4 GiB ext4 holding `prefill` MiB of random data in one file, as a
/// sparse qcow2.
fn make_base(dir: &Path, prefill: usize) -> PathBuf {
    let seed = dir.join("seed");
    std::fs::create_dir_all(&seed).expect("seed dir");
    if prefill > 0 {
        run(Command::new("dd")
            .args(["if=/dev/urandom", "bs=1M", "status=none"])
            .arg(format!("count={prefill}"))
            .arg(format!("of={}", seed.join("prefill.bin").display())));
    }
    let raw = dir.join("base.raw");
    let qcow = dir.join("base.qcow2");
    std::fs::File::create(&raw)
        .and_then(|f| f.set_len(4 << 30))
        .expect("sparse raw file");
    run(Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-L",
            "hearth-data",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
            "-d",
        ])
        .arg(&seed)
        .arg(&raw));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    std::fs::remove_file(&raw).expect("remove raw");
    std::fs::remove_dir_all(&seed).expect("remove seed");
    chmod(&qcow, 0o644);
    qcow
}

fn boot_hearth(d: &Daemon, base: &Path) {
    let mut items = vec![
        json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualDisk",
               "metadata": {"name": DISK}, "spec": {"source": {"image": base}}}),
    ];
    let text = vm_yaml(VM, "AlwaysOn", &[DISK], "");
    items.extend(
        hearth_api::parse_documents(&text, "backup_vs_virtnbdbackup")
            .expect("bench manifest")
            .iter()
            .map(|o| serde_json::to_value(o).expect("object to JSON")),
    );
    let (status, v) = d.request("POST", "/v1/apply", Some(&json!({"items": items})));
    assert_eq!(status, 200, "apply: {v}");
}

/// A transient libvirt domain with the same guest, memory, CPU, machine and
/// kernel command line as hearth's VM, its disk an overlay over the same
/// base image.
fn boot_libvirt(dir: &Path, base: &Path) -> Domain {
    drop(Domain); // one left by an interrupted run
    let ddir = dir.join(DOMAIN);
    std::fs::create_dir_all(&ddir).expect("domain dir");
    chmod(&ddir, 0o777);
    let g = guest_dir();
    let file = ddir.join("vda.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(&file));
    let disk = format!(
        "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='{}'/><target dev='vda' bus='virtio'/></disk>",
        file.display()
    );
    libvirt::create_domain(DOMAIN, &g, &ddir, &disk);
    Domain
}

/// Runs a shell script in a side's guest; (exit code, stdout).
fn exec(d: &Daemon, side: Side, script: &str) -> (i64, String) {
    match side {
        Side::Hearth => d.agent_sh(VM, script),
        Side::Libvirt => libvirt::agent_sh(DOMAIN, script, EXEC_TIMEOUT),
    }
}

fn write_random(d: &Daemon, side: Side, file: &str, mib: usize) {
    let (code, out) = exec(
        d,
        side,
        &format!("dd if=/dev/urandom of=/data/{file} bs=1M count={mib} conv=fsync 2>&1 && sync"),
    );
    assert_eq!(code, 0, "{side:?}: writing {mib} MiB: {out}");
}

/// The data clusters of hearth's disk's head layer (what the guest wrote
/// since the last cut), read alone, then the same bytes written into a new
/// file in `scratch` (the target's filesystem) and fsynced: (bytes, `qemu-img
/// map` ms, read ms, write + fsync ms).
fn read_changed(d: &Daemon, scratch: &Path) -> (u64, f64, f64, f64) {
    let head = d.disk_path(DISK);
    let spec = json!({"driver": "qcow2", "backing": null,
                      "file": {"driver": "file", "filename": head}});
    let t = Instant::now();
    let map = run(Command::new("qemu-img")
        .args(["map", "-U", "--output=json"])
        .arg(format!("json:{spec}")));
    let map_ms = t.elapsed().as_secs_f64() * 1e3;
    let extents: Vec<Value> = serde_json::from_str(&map).expect("qemu-img map JSON");
    let ranges: Vec<(u64, u64)> = extents
        .iter()
        .filter(|e| e["data"] == true)
        .filter_map(|e| Some((e["offset"].as_u64()?, e["length"].as_u64()?)))
        .collect();
    let f = std::fs::File::open(&head).expect("open the head layer");
    let mut buf = vec![0u8; 4 << 20];
    let mut bytes = 0u64;
    let t = Instant::now();
    for &(start, len) in &ranges {
        let mut off = start;
        while off < start + len {
            let n = (start + len - off).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..n], off)
                .expect("read the head layer");
            off += n as u64;
            bytes += n as u64;
        }
    }
    let read_ms = t.elapsed().as_secs_f64() * 1e3;
    let out = scratch.join("changed.bin");
    let _ = std::fs::remove_file(&out);
    let t = Instant::now();
    let w = std::fs::File::create(&out).expect("the yardstick's file");
    let mut at = 0u64;
    for (start, len) in ranges {
        let mut off = start;
        while off < start + len {
            let n = (start + len - off).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..n], off)
                .expect("read the head layer");
            w.write_all_at(&buf[..n], at).expect("write the yardstick");
            off += n as u64;
            at += n as u64;
        }
    }
    w.sync_all().expect("fsync the yardstick");
    let write_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(w);
    let _ = std::fs::remove_file(&out);
    (bytes, map_ms, read_ms, write_ms)
}

/// The steps of a hearth backup's copy through `qemu-img` (crates/
/// hearth-engine/src/backup/copy.rs and reconcile.rs: every full point, and
/// an incremental one whose layers hearth does not read itself), each run
/// again alone on the point just
/// made by [`copy_steps`], once the previous checkpoint (`previous`
/// backup's, for an incremental) is deleted and merged: from the
/// checkpoint's layer, over the previous point's file for an incremental
/// (whose copy itself is not run again: the layers that chose its extents
/// are merged by then), the new point's file hashed and checked.
fn parts(d: &Daemon, dir: &Path, previous: Option<&str>, scratch: &Path) -> [f64; PARTS] {
    if let Some(previous) = previous {
        d.wait_gone(
            "virtualmachinesnapshots",
            &format!("{previous}-cp"),
            Duration::from_secs(300),
        );
    }
    // The snapshot object goes before its layer's merge is over: wait
    // until nothing writes the chain (`qemu-img info` without `-U` takes
    // the shared locks), so the exports neither fail on a lock nor hold up
    // a merge.
    let head = d.disk_path(DISK);
    let layer = backing_chain(&head)
        .get(1)
        .cloned()
        .expect("the head has a backing file: the checkpoint's layer");
    wait_until(
        "the checkpoint's chain unlocked",
        Duration::from_secs(300),
        || {
            Command::new("qemu-img")
                .args(["info", "--backing-chain"])
                .arg(&layer)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        },
    );
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("hearth-backup.json")).expect("manifest"))
            .expect("manifest JSON");
    let points = manifest["points"].as_array().expect("points");
    let file_of = |p: &Value| dir.join(p["files"][0]["file"].as_str().expect("file"));
    let point = file_of(points.last().expect("a point"));
    let before = previous.map(|_| file_of(&points[points.len() - 2]));
    copy_steps(&layer, before.as_deref(), &point, scratch)
}

/// The steps of one copy as crates/hearth-engine/src/backup/copy.rs makes
/// it, each timed alone (ms): `qemu-img info --backing-chain` of `source`,
/// `qemu-img map` of its chain (the extents), the copy (without `before`
/// only: one `qemu-img convert` of the whole chain into a new qcow2, as
/// `CopyInto::Whole`; NaN with it), the fsync of the file, its SHA-256
/// ([`sha256_sha_ni`]) and `qemu-img check` (the new file when it was
/// copied, else `made`, the real one). hearthd runs the last two at once;
/// here they are timed one after the other. The data is in the page cache
/// by then, as it mostly is for the real copy.
fn copy_steps(source: &Path, before: Option<&Path>, made: &Path, scratch: &Path) -> [f64; PARTS] {
    let work = scratch.join("parts");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("parts dir");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let steps = rt.block_on(async {
        let t = Instant::now();
        hearth_qemu::img::backing_chain(source)
            .await
            .expect("backing chain");
        let chain = ms(t);
        let t = Instant::now();
        hearth_qemu::img::map(source, Duration::from_secs(600))
            .await
            .expect("map");
        let map = ms(t);
        let new = work.join("new.qcow2");
        let t = Instant::now();
        let copy = if before.is_none() {
            hearth_qemu::img::QemuImg::locate()
                .expect("qemu-img")
                .with_timeout(Duration::from_secs(3600))
                .copy_into(source, &new, hearth_qemu::img::CopyInto::Whole, &mut |_| {})
                .await
                .expect("convert");
            ms(t)
        } else {
            f64::NAN
        };
        let written = if before.is_none() {
            new.clone()
        } else {
            made.to_path_buf()
        };
        let t = Instant::now();
        std::fs::File::open(&written)
            .and_then(|f| f.sync_all())
            .expect("fsync");
        let fsync = ms(t);
        let t = Instant::now();
        sha256_sha_ni(&written);
        let sha = ms(t);
        let t = Instant::now();
        hearth_qemu::img::QemuImg::locate()
            .expect("qemu-img")
            .check(&written)
            .await
            .expect("check");
        let check = ms(t);
        [chain, map, copy, fsync, sha, check]
    });
    let _ = std::fs::remove_dir_all(&work);
    steps
}

/// The command that takes one backup (hearth's CLI or virtnbdbackup).
fn backup_command(d: &Daemon, side: Side, dir: &Path, level: &str, name: &str) -> Command {
    match side {
        Side::Hearth => {
            let to = dir.to_str().expect("utf-8");
            d.cli_command(
                &["backup", "vm", VM, "--to", to, "--name", name, "--wait"],
                Stdio::null(),
            )
        }
        Side::Libvirt => {
            let mut c = Command::new("virtnbdbackup");
            c.args(["-d", DOMAIN, "-l", level, "-n", "-o"])
                .arg(dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        }
    }
}

/// Runs a command to its end, timed from spawn to exit (ms); it must succeed.
fn timed(mut cmd: Command, what: &str) -> (f64, SystemTime) {
    let spawned = SystemTime::now();
    let t = Instant::now();
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: {cmd:?}: {e}"));
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        out.status.success(),
        "{what}: {cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(t.elapsed() < OP_TIMEOUT);
    (ms, spawned)
}

fn dir_bytes(dir: &Path, only: &dyn Fn(&str) -> bool) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            n += dir_bytes(&p, only);
        } else if only(&name) {
            n += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
    }
    n
}

/// virtnbdbackup's data files (`vda.full.data`, `vda.inc.virtnbdbackup.N.data`).
fn virtnbd_data(dir: &Path) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.ends_with(".data")
                .then(|| (name, e.metadata().map(|m| m.len()).unwrap_or(0)))
        })
        .collect();
    v.sort();
    v
}

fn backup(d: &Daemon, side: Side, dir: &Path, step: &str, name: &str, round: usize) -> Op {
    let level = if step == "full" { "full" } else { "inc" };
    let before = virtnbd_data(dir);
    let (wall_ms, spawned) = timed(backup_command(d, side, dir, level, name), step);
    let mut op = Op {
        round,
        step: step.to_string(),
        side: Some(side),
        wall_ms,
        load: loadavg(),
        ..Op::default()
    };
    match side {
        Side::Hearth => hearth_backup_facts(d, name, level, unix_ms(spawned), &mut op),
        Side::Libvirt => {
            let after = virtnbd_data(dir);
            op.bytes_written = after
                .iter()
                .filter(|f| !before.contains(f))
                .map(|f| f.1)
                .sum();
            assert!(
                after.len() == before.len() + 1,
                "virtnbdbackup {level}: one new data file expected: {before:?} → {after:?}"
            );
        }
    }
    op
}

fn hearth_backup_facts(d: &Daemon, name: &str, level: &str, spawned: f64, op: &mut Op) {
    let b = d
        .get("virtualmachinebackups", name)
        .unwrap_or_else(|| panic!("backup {name} is gone"));
    let st = &b["status"];
    assert_eq!(st["phase"], "Ready", "{b:#}");
    let kind = if level == "full" {
        "Full"
    } else {
        "Incremental"
    };
    assert_eq!(st["kind"], kind, "{b:#}");
    op.bytes_read = st["bytesRead"].as_u64();
    op.bytes_written = st["bytesWritten"].as_u64().unwrap_or(0);
    op.duration_ms = st["durationMs"].as_f64();
    let cp = st["checkpoint"].as_str().expect("checkpoint").to_string();
    op.freeze_ms = d
        .get("virtualmachinesnapshots", &cp)
        .and_then(|s| s["status"]["freezeWindowMs"].as_f64());
    let events = d.events("VirtualMachineBackup", name);
    let at = |reason: &str| {
        events
            .iter()
            .find(|e| e["reason"] == reason)
            .and_then(|e| rfc3339_ms(&e["time"]))
    };
    let cut = d
        .events("VirtualMachineSnapshot", &cp)
        .iter()
        .find(|e| e["reason"] == "Ready")
        .and_then(|e| rfc3339_ms(&e["time"]));
    if let (Some(req), Some(cut), Some(ready), Some(dur)) =
        (at("CutRequested"), cut, at("Ready"), op.duration_ms)
    {
        op.marks = Some([
            req - spawned,
            cut - spawned,
            ready - dur - spawned,
            ready - spawned,
        ]);
    }
}

/// A backup (or on hearth's side, `plain`: a plain VM snapshot) while
/// stallwatch writes in the guest: the longest gap it saw during the command.
fn windowed(
    d: &Daemon,
    side: Side,
    plain: bool,
    dir: &Path,
    name: &str,
    round: usize,
    seconds: u64,
) -> Op {
    let epoch = Instant::now();
    let host_ms = || epoch.elapsed().as_secs_f64() * 1e3;
    // A freeze expedited before (hearth's step) is undone by the guest first.
    wait_until("rcu_expedited reset", Duration::from_secs(30), || {
        exec(d, side, "cat /sys/kernel/rcu_expedited").1.trim() == "0"
    });
    let (code, _) = exec(
        d,
        side,
        &format!(
            "rm -f /mnt/vda/stall.dat /run/stall.out; \
             /bin/stallwatch /mnt/vda/stall.dat {seconds} > /run/stall.out 2>&1 &"
        ),
    );
    assert_eq!(code, 0, "starting the writer");
    wait_until("writer started", Duration::from_secs(20), || {
        exec(d, side, "test -s /mnt/vda/stall.dat").0 == 0
    });
    let (lo, hi) = clock_offset(epoch, |cmd| exec(d, side, cmd));
    std::thread::sleep(Duration::from_millis(200));
    let from = host_ms();
    let mut op = if plain {
        let cmd = d.cli_command(
            &["snapshot", "vm", VM, "--name", name, "--wait"],
            Stdio::null(),
        );
        let (wall_ms, _) = timed(cmd, "snapshot");
        let s = d
            .get("virtualmachinesnapshots", name)
            .expect("the snapshot");
        assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
        Op {
            round,
            step: "snapshot".into(),
            side: Some(side),
            wall_ms,
            freeze_ms: s["status"]["freezeWindowMs"].as_f64(),
            load: loadavg(),
            ..Op::default()
        }
    } else {
        let mut op = backup(d, side, dir, "window", name, round);
        op.step = "window".into();
        op
    };
    let to = host_ms();
    let remaining = Duration::from_secs(seconds).saturating_sub(epoch.elapsed());
    std::thread::sleep(remaining + Duration::from_millis(300));
    let deadline = Instant::now() + Duration::from_secs(120);
    let out = loop {
        let (_, out) = exec(d, side, "cat /run/stall.out");
        if out.contains("top_gaps=") {
            break out;
        }
        assert!(
            Instant::now() < deadline,
            "the writer did not report: {out}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    let gaps: Vec<(f64, f64)> = out
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("top_gaps="))
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| {
            let (a, b) = x.split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    let span = (from - hi, to - lo);
    op.guest_ms = Some(
        gaps.iter()
            .filter(|(s, len)| *s <= span.1 && s + len >= span.0)
            .map(|x| x.1)
            .fold(0.0, f64::max),
    );
    op
}

fn restore(d: &Daemon, side: Side, dir: &Path, rdir: &Path, round: usize) -> Op {
    let mut op = Op {
        round,
        step: "restore".into(),
        side: Some(side),
        ..Op::default()
    };
    match side {
        Side::Hearth => {
            let name = format!("r{round}-rs");
            let disk = format!("{name}-{DISK}");
            let cmd = d.cli_command(
                &[
                    "restore",
                    "backup",
                    dir.to_str().expect("utf-8"),
                    "--as",
                    &name,
                    "--no-vm",
                ],
                Stdio::null(),
            );
            let t = Instant::now();
            timed(cmd, "hearth restore backup");
            let v = d.wait_object("virtualdisks", &disk, "Ready", OP_TIMEOUT, |v| {
                matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed"))
            });
            op.wall_ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(v["status"]["phase"], "Ready", "{v:#}");
            op.bytes_written = std::fs::metadata(d.disk_path(&disk))
                .map(|m| m.len())
                .unwrap_or(0);
        }
        Side::Libvirt => {
            let out = rdir.join("virtnbdrestore-out");
            let mut cmd = Command::new("virtnbdrestore");
            cmd.args(["-n", "-i"])
                .arg(dir)
                .arg("-o")
                .arg(&out)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let (wall_ms, _) = timed(cmd, "virtnbdrestore");
            op.wall_ms = wall_ms;
            op.bytes_written = dir_bytes(&out, &|n| !n.ends_with(".xml") && !n.ends_with(".log"));
        }
    }
    op.load = loadavg();
    op
}

/// The steps of a hearth restore (crates/hearth-engine/src/backup/
/// target.rs `point_files`, disk/create.rs `restore_backup`), run again
/// alone on the same directory: the SHA-256 of every file of the newest
/// point's chain ([`sha256_sha_ni`], one file after another, as hearthd
/// does, though hearthd does it while it copies), then [`copy_steps`] from
/// the point's file into a new one.
fn restore_parts(dir: &Path, scratch: &Path) -> [f64; 1 + PARTS] {
    let files: Vec<PathBuf> = std::fs::read_dir(dir.join(DISK))
        .expect("the disk's folder")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
        .collect();
    let newest = files.iter().max().expect("a point").clone();
    let t = Instant::now();
    for f in &files {
        sha256_sha_ni(f);
    }
    let mut out = [0.0; 1 + PARTS];
    out[0] = t.elapsed().as_secs_f64() * 1e3;
    out[1..].copy_from_slice(&copy_steps(&newest, None, &newest, scratch));
    out
}

/// A file's SHA-256 by `openssl dgst`, which uses the CPU's SHA
/// instructions as hearthd's in-process hashing (the `sha2` crate) does
/// (`sha256sum` here does not, and is about 6 times slower).
fn sha256_sha_ni(path: &Path) {
    run(Command::new("openssl").args(["dgst", "-sha256"]).arg(path));
}

fn mib(b: f64) -> String {
    format!("{:.1}", b / (1u64 << 20) as f64)
}

fn print_tables(ops: &[Op], sizes: &[usize], prefill: usize, load: &[String]) {
    let of = |step: &str, side: Side| -> Vec<&Op> {
        ops.iter()
            .filter(|o| o.step == step && o.side == Some(side))
            .collect()
    };
    let walls = |v: &[&Op]| -> Vec<f64> { v.iter().map(|o| o.wall_ms).collect() };
    let n = of("full", Side::Hearth).len();
    println!();
    println!(
        "Medians of {n} rounds (min–max); TCG; host: {} CPUs; disk: 4 GiB virtual, ext4 with {prefill} MiB of random data before the first round; load avg (1 min) over the run: {}.",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        {
            let l: Vec<f64> = load.iter().filter_map(|s| s.parse().ok()).collect();
            let (_, lo, hi) = stats(&l);
            format!("{lo:.2}–{hi:.2}")
        }
    );
    println!();
    println!(
        "| step | hearth wall (ms) | virtnbdbackup wall (ms) | ratio hearth / virtnbdbackup (of medians) | ratio per round, median (min–max) | hearth written (MiB) | virtnbdbackup written (MiB) | hearth durationMs (copy start → commit) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut steps: Vec<String> = vec!["full".into()];
    steps.extend(sizes.iter().map(|m| format!("inc {m} MiB")));
    steps.push("window".into());
    steps.push("restore".into());
    for step in &steps {
        let h = of(step, Side::Hearth);
        let l = of(step, Side::Libvirt);
        let per_round: Vec<f64> = h
            .iter()
            .filter_map(|a| {
                l.iter()
                    .find(|b| b.round == a.round)
                    .map(|b| a.wall_ms / b.wall_ms)
            })
            .collect();
        let hb: Vec<f64> = h.iter().map(|o| o.bytes_written as f64).collect();
        let lb: Vec<f64> = l.iter().map(|o| o.bytes_written as f64).collect();
        let hd: Vec<f64> = h.iter().filter_map(|o| o.duration_ms).collect();
        println!(
            "| {step} | {} | {} | {:.2} | {} | {} | {} | {} |",
            fmt(&walls(&h), 0),
            fmt(&walls(&l), 0),
            stats(&walls(&h)).0 / stats(&walls(&l)).0,
            fmt(&per_round, 2),
            mib(stats(&hb).0),
            mib(stats(&lb).0),
            fmt(&hd, 0),
        );
    }
    println!();
    println!(
        "hearth incrementals against reading the changed clusters alone (the head layer's data clusters, pread from the file after `qemu-img map` found them):"
    );
    println!();
    println!(
        "| written in the guest | changed clusters (MiB) | read alone (ms) | qemu-img map (ms) | read + map (ms) | read + write + fsync alone (ms) | hearth incremental wall (ms) | wall / (read + map) | durationMs | durationMs / (read + map) | durationMs / (map + read + write + fsync) | bytesRead (MiB) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in sizes {
        let h = of(&format!("inc {m} MiB"), Side::Hearth);
        let changed: Vec<f64> = h
            .iter()
            .filter_map(|o| o.changed_bytes)
            .map(|b| b as f64)
            .collect();
        let read: Vec<f64> = h.iter().filter_map(|o| o.read_ms).collect();
        let map: Vec<f64> = h.iter().filter_map(|o| o.map_ms).collect();
        let both: Vec<f64> = h
            .iter()
            .filter_map(|o| Some(o.read_ms? + o.map_ms?))
            .collect();
        let ratio: Vec<f64> = h
            .iter()
            .filter_map(|o| Some(o.wall_ms / (o.read_ms? + o.map_ms?)))
            .collect();
        let dur: Vec<f64> = h.iter().filter_map(|o| o.duration_ms).collect();
        let written: Vec<f64> = h.iter().filter_map(|o| o.write_ms).collect();
        let dur_read: Vec<f64> = h
            .iter()
            .filter_map(|o| Some(o.duration_ms? / (o.read_ms? + o.map_ms?)))
            .collect();
        let dur_write: Vec<f64> = h
            .iter()
            .filter_map(|o| Some(o.duration_ms? / (o.write_ms? + o.map_ms?)))
            .collect();
        let br: Vec<f64> = h
            .iter()
            .filter_map(|o| o.bytes_read)
            .map(|b| b as f64)
            .collect();
        println!(
            "| {m} MiB | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            mib(stats(&changed).0),
            fmt(&read, 1),
            fmt(&map, 1),
            fmt(&both, 1),
            fmt(&written, 1),
            fmt(&walls(&h), 0),
            fmt(&ratio, 1),
            fmt(&dur, 0),
            fmt(&dur_read, 1),
            fmt(&dur_write, 1),
            mib(stats(&br).0),
        );
    }
    println!();
    println!(
        "Where a hearth backup's CLI wall goes (medians, ms after the CLI's spawn, from the backup's events):"
    );
    println!();
    println!(
        "| step | spawn → CutRequested | → checkpoint Ready (the cut done) | → copy starts (Ready − durationMs) | copy starts → Ready (durationMs) | Ready → CLI exits | wall |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for step in &steps[..steps.len() - 1] {
        let h: Vec<(&Op, [f64; 4])> = of(step, Side::Hearth)
            .into_iter()
            .filter_map(|o| o.marks.map(|m| (o, m)))
            .collect();
        type Marked<'a> = (&'a Op, [f64; 4]);
        let med = |f: &dyn Fn(&Marked) -> f64| stats(&h.iter().map(f).collect::<Vec<_>>()).0;
        println!(
            "| {step} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            med(&|x| x.1[0]),
            med(&|x| x.1[1] - x.1[0]),
            med(&|x| x.1[2] - x.1[1]),
            med(&|x| x.1[3] - x.1[2]),
            med(&|x| x.0.wall_ms - x.1[3]),
            med(&|x| x.0.wall_ms),
        );
    }
    println!();
    println!(
        "The steps of a copy through qemu-img, run again alone on each point just made (medians, ms; the copy itself only for the full). A full point is copied this way; an incremental one only when its layers are outside what hearth reads and writes itself (docs/backup.md), so for the incrementals these are what that path would cost:"
    );
    println!();
    println!(
        "| step | qemu-img info --backing-chain | qemu-img map of the chain | qemu-img convert | fsync | SHA-256 of the file | qemu-img check | sum | durationMs |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for step in &steps[..steps.len() - 2] {
        let h: Vec<(&Op, [f64; PARTS])> = of(step, Side::Hearth)
            .into_iter()
            .filter_map(|o| o.parts.map(|p| (o, p)))
            .collect();
        let col = |i: usize| stats(&h.iter().map(|x| x.1[i]).collect::<Vec<_>>()).0;
        let sum = stats(
            &h.iter()
                .map(|x| x.1.iter().filter(|v| !v.is_nan()).sum())
                .collect::<Vec<f64>>(),
        )
        .0;
        let dur = stats(&h.iter().filter_map(|x| x.0.duration_ms).collect::<Vec<_>>()).0;
        println!(
            "| {step} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {sum:.0} | {dur:.0} |",
            col(0),
            col(1),
            if col(2).is_nan() {
                "–".to_string()
            } else {
                format!("{:.0}", col(2))
            },
            col(3),
            col(4),
            col(5),
        );
    }
    println!();
    println!("A hearth restore's steps, run again alone after it (medians, ms):");
    println!();
    println!(
        "| restore wall | SHA-256 of the chain's files | qemu-img info --backing-chain + map | qemu-img convert | fsync | qemu-img check | sum | virtnbdrestore wall |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    {
        let h = of("restore", Side::Hearth);
        let l = of("restore", Side::Libvirt);
        let col = |i: usize| {
            stats(
                &h.iter()
                    .filter_map(|o| o.restore_parts.map(|p| p[i]))
                    .collect::<Vec<_>>(),
            )
            .0
        };
        // The restore hashes nothing it wrote (column 5 of the copy's steps).
        let sum: f64 = [0, 1, 2, 3, 4, 6].into_iter().map(col).sum();
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {sum:.0} | {} |",
            fmt(&walls(&h), 0),
            col(0),
            col(1) + col(2),
            col(3),
            col(4),
            col(6),
            fmt(&walls(&l), 0)
        );
    }
    println!();
    println!("The freeze (the window step: a writer in the guest during the command):");
    println!();
    println!("| | guest-seen window (ms) | freezeWindowMs | wall (ms) |");
    println!("|---|---:|---:|---:|");
    let all_cp: Vec<f64> = ops
        .iter()
        .filter(|o| o.side == Some(Side::Hearth) && o.step != "snapshot")
        .filter_map(|o| o.freeze_ms)
        .collect();
    for (label, step, side) in [
        ("hearth backup (incremental)", "window", Side::Hearth),
        ("hearth snapshot vm --wait", "snapshot", Side::Hearth),
        ("virtnbdbackup -l inc", "window", Side::Libvirt),
    ] {
        let v = of(step, side);
        let g: Vec<f64> = v.iter().filter_map(|o| o.guest_ms).collect();
        let f: Vec<f64> = v.iter().filter_map(|o| o.freeze_ms).collect();
        println!(
            "| {label} | {} | {} | {} |",
            fmt(&g, 1),
            if f.is_empty() {
                "not measured".into()
            } else {
                fmt(&f, 0)
            },
            fmt(&walls(&v), 0)
        );
    }
    println!(
        "| every hearth backup's checkpoint (all steps) | – | {} | – |",
        fmt(&all_cp, 0)
    );
    println!();
    println!("Every operation:");
    println!();
    println!(
        "| round | step | side | wall (ms) | written (B) | bytesRead | durationMs | freezeWindowMs | guest-seen (ms) | CutRequested / checkpoint Ready / copy starts / Ready (ms after spawn) | changed (B) / read ms / map ms / read + write + fsync ms | load |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---|");
    for o in ops {
        println!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.round + 1,
            o.step,
            o.side.map_or("–", Side::label),
            o.wall_ms,
            o.bytes_written,
            o.bytes_read.map_or("–".into(), |b| b.to_string()),
            o.duration_ms.map_or("–".into(), |v| format!("{v:.0}")),
            o.freeze_ms.map_or("–".into(), |v| format!("{v:.0}")),
            o.guest_ms.map_or("–".into(), |v| format!("{v:.1}")),
            o.marks.map_or("–".into(), |m| m
                .iter()
                .map(|v| format!("{v:.0}"))
                .collect::<Vec<_>>()
                .join(" / ")),
            match (o.changed_bytes, o.read_ms, o.map_ms, o.write_ms) {
                (Some(c), Some(r), Some(m), Some(w)) => {
                    format!("{c} / {r:.1} / {m:.1} / {w:.1}")
                }
                _ => "–".into(),
            },
            o.load
        );
    }
}
