//! Which actor cuts a disk, and whether online or offline, is decided when
//! the cut starts, not when the snapshot is requested: a disk that a VM
//! starts using in between is cut under a freeze, never "offline" while
//! QEMU writes to it. Checked from the guest's own fsfreeze hook and from
//! the process table.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

/// When the process started, as a wall-clock time (from `/proc/PID/stat`
/// and the boot time in `/proc/stat`).
fn process_start(pid: u32) -> chrono::DateTime<chrono::Utc> {
    let ticks = start_ticks(pid).expect("start ticks");
    // The boot time to 10 ms: now minus the uptime (`btime` in /proc/stat
    // is whole seconds, too coarse to order a cut and a process start).
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .expect("/proc/uptime")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("uptime");
    let boot = chrono::Utc::now() - chrono::Duration::milliseconds((uptime * 1000.0) as i64);
    // USER_HZ is 100 on Linux/x86_64.
    boot + chrono::Duration::milliseconds(ticks as i64 * 10)
}

#[test]
fn a_disk_a_vm_starts_using_meanwhile_is_cut_under_a_freeze_never_offline() {
    let _serial = serial();
    let d = Daemon::start();
    apply_manifest(&d, "disk.yaml", &overlay_disk_yaml("late-data"));
    d.wait_object(
        "virtualdisks",
        "late-data",
        "late-data Ready",
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "Ready",
    );

    // Requested while no VM uses the disk, then at once a VM that does.
    d.apply(vec![DiskSnapshot::of("s-late", "late-data").json()]);
    apply_manifest(
        &d,
        "late.yaml",
        &vm_yaml("late", "AlwaysOn", &["late-data"], ""),
    );

    let snap = snapshot_final(&d, "s-late", Duration::from_secs(120));
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    assert_eq!(snap["status"]["consistent"], true, "{snap:#}");

    // Consistent without a freeze is only true if no QEMU had the disk yet
    // when the cut was taken. (An offline cut starts at once, so it may be
    // Ready before the VM's QEMU is even started.)
    d.wait_phase("late", "Running", Duration::from_secs(120));
    let pids = d.qemu_pids();
    assert_eq!(pids.len(), 1, "{pids:?}");
    let (freezes, thaws) = hook_counts(&d, "late");
    if freezes == 0 {
        let cut: chrono::DateTime<chrono::Utc> = snap["status"]["cutTime"]
            .as_str()
            .expect("cutTime")
            .parse()
            .expect("time");
        let started = process_start(pids[0]);
        assert!(
            cut < started,
            "cut offline at {cut} while QEMU (started {started}) had the disk: {snap:#}"
        );
    } else {
        assert_eq!((freezes, thaws), (1, 1), "one freeze, thawed");
    }
    println!("cut with {freezes} freeze(s) in the guest");
}

/// A disk image's backing chain, as strings.
fn string_chain(image: &str) -> Vec<String> {
    backing_chain(std::path::Path::new(image))
        .into_iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_disk_list_edit_while_the_vm_runs_never_sends_a_cut_to_the_wrong_device() {
    let _serial = serial();
    let d = Daemon::start();
    // sw-a: the test guest's ext4 image; sw-b: blank. Two different chains.
    let disks = format!(
        "{}---\napiVersion: hearth.dev/v1alpha1\nkind: VirtualDisk\nmetadata:\n  name: sw-b\nspec:\n  size: 16Mi\n  source:\n    blank: {{}}\n",
        overlay_disk_yaml("sw-a")
    );
    apply_manifest(&d, "disks.yaml", &disks);
    apply_manifest(
        &d,
        "vm.yaml",
        &vm_yaml("swap", "AlwaysOn", &["sw-a", "sw-b"], ""),
    );
    d.wait_object(
        "virtualmachines",
        "swap",
        "QEMU runs",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Running",
    );
    // While the guest still boots (the cut waits for its agent), a snapshot
    // of the second disk, then the disk list reversed in the spec.
    d.apply(vec![
        DiskSnapshot::of("swap-b", "sw-b")
            .required_consistency(false)
            .json(),
    ]);
    std::thread::sleep(Duration::from_millis(300));
    apply_manifest(
        &d,
        "vm.yaml",
        &vm_yaml("swap", "AlwaysOn", &["sw-b", "sw-a"], ""),
    );

    let snap = snapshot_final(&d, "swap-b", Duration::from_secs(120));
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    d.wait_agent("swap");

    // The files tell: sw-b's chain never reaches sw-a's base image, sw-a's
    // always does, and QEMU runs one process with both.
    let base = guest_dir()
        .join("data.qcow2")
        .to_string_lossy()
        .into_owned();
    let path = |disk: &str| {
        d.get_disk(disk).expect("disk")["status"]["path"]
            .as_str()
            .expect("path")
            .to_string()
    };
    let b_chain = string_chain(&path("sw-b"));
    let a_chain = string_chain(&path("sw-a"));
    assert!(
        !b_chain.contains(&base),
        "sw-b now lies over sw-a's image: {b_chain:?}"
    );
    assert!(a_chain.contains(&base), "{a_chain:?}");
    assert!(
        a_chain.iter().all(|f| !b_chain.contains(f)),
        "the disks share a layer: {a_chain:?} / {b_chain:?}"
    );
    // The snapshot, restored, is the blank disk: no ext4 on it.
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [Disk::from_snapshot("chk-swap-b", "swap-b").json()]})),
    );
    assert_eq!(status, 200, "{v}");
    d.wait_object(
        "virtualdisks",
        "chk-swap-b",
        "chk-swap-b Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );
    let restored = string_chain(&path("chk-swap-b"));
    assert!(
        !restored.contains(&base),
        "the snapshot of sw-b holds sw-a: {restored:?}"
    );
    assert_eq!(d.qemu_pids().len(), 1);
}

#[test]
fn a_disk_removed_from_a_running_vms_spec_cannot_be_deleted_until_qemu_lets_go_nor_during_its_cut()
{
    let _serial = serial();
    let d = Daemon::start();
    apply_manifest(
        &d,
        "disks.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("ha"),
            overlay_disk_yaml("hb")
        ),
    );
    // The guest's freeze hook sleeps 4 s: the cut is held open that long.
    let vm = |disks: &[&str]| vm_yaml("hold", "AlwaysOn", disks, "hearth.freeze_hook_sleep=4");
    apply_manifest(&d, "vm.yaml", &vm(&["ha", "hb"]));
    d.wait_agent("hold");
    let first_qemu = d.qemu_pids();
    assert_eq!(first_qemu.len(), 1);

    d.apply(vec![DiskSnapshot::of("hold-b", "hb").json()]);
    wait_until(
        "the guest's freeze hook runs",
        Duration::from_secs(60),
        || hook_counts(&d, "hold").0 == 1,
    );
    // Mid-cut, the disk leaves the VM's spec, as the API's own error message
    // advises before a delete; QEMU still has it until the VM restarts.
    apply_manifest(&d, "vm.yaml", &vm(&["ha"]));
    let err = d.cli_err(&["delete", "disk", "hb"]);
    assert!(
        err.contains("in use by VirtualMachine \"hold\"") && err.contains("running QEMU"),
        "{err}"
    );
    assert!(d.get_disk("hb").is_some());

    let snap = snapshot_final(&d, "hold-b", Duration::from_secs(120));
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    assert_eq!(snap["status"]["consistent"], true, "{snap:#}");

    // Once the VM runs a QEMU without the disk, the delete goes through, and
    // the snapshot still restores to a clean filesystem.
    wait_until(
        "the VM restarted without hb",
        Duration::from_secs(120),
        || {
            let pids = d.qemu_pids();
            pids.len() == 1 && pids != first_qemu
        },
    );
    d.wait_agent("hold");
    d.cli_ok(&["delete", "disk", "hb"]);
    d.wait_gone("virtualdisks", "hb", Duration::from_secs(60));
    d.apply(vec![Disk::from_snapshot("chk-hold-b", "hold-b").json()]);
    d.wait_object(
        "virtualdisks",
        "chk-hold-b",
        "chk-hold-b Ready",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Ready",
    );
    let path = d.get_disk("chk-hold-b").expect("disk")["status"]["path"]
        .as_str()
        .expect("path")
        .to_string();
    let scratch = tempfile::tempdir().expect("tempdir");
    let raw = scratch.path().join("hold-b.raw");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw", &path])
        .arg(&raw)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    assert_clean_ext4(&raw, "hold-b restored");
    assert_eq!(debugfs_cat(&raw, "/hello.txt").trim(), "hello from hearth");
}

#[test]
fn a_stop_goes_before_a_cut_that_waits_for_a_booting_guests_agent() {
    let _serial = serial();
    let d = Daemon::start();
    apply_manifest(
        &d,
        "boot.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("boot-data"),
            vm_yaml("booting", "Manual", &["boot-data"], "")
        ),
    );
    d.cli_ok(&["start", "booting"]);
    d.wait_object(
        "virtualmachines",
        "booting",
        "QEMU runs",
        Duration::from_secs(60),
        |v| v["status"]["phase"] == "Running",
    );
    assert_ne!(
        d.get_vm("booting").expect("vm")["status"]["agentConnected"],
        true,
        "the guest is still booting"
    );
    // The cut must wait for the agent; the stop asked meanwhile must not
    // wait for the cut.
    d.apply(vec![DiskSnapshot::of("s-boot", "boot-data").json()]);
    std::thread::sleep(Duration::from_millis(400));
    d.cli_ok(&["stop", "booting"]);
    d.wait_phase("booting", "Stopped", Duration::from_secs(120));
    let snap = snapshot_final(&d, "s-boot", Duration::from_secs(60));
    // Cut after the stop, offline: consistent without any freeze in the
    // guest (its console shows none).
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    assert_eq!(snap["status"]["consistent"], true, "{snap:#}");
    assert_eq!(
        hook_counts(&d, "booting").0,
        0,
        "the stop waited for a freeze"
    );
    assert!(d.qemu_pids().is_empty());
}
