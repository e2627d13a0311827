//! Consistent snapshots end to end: real QEMU, the real qemu-ga in the test
//! guest, real qcow2 files checked on the host with e2fsprogs.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);

fn count_events(d: &Daemon, vm: &str, reason: &str) -> usize {
    d.event_reasons("VirtualMachine", vm)
        .iter()
        .filter(|r| *r == reason)
        .count()
}

fn wait_disk_ready(d: &Daemon, disk: &str) {
    d.wait_object(
        "virtualdisks",
        disk,
        &format!("disk {disk} Ready"),
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "Ready",
    );
}

/// A snapshot's content, read through a disk restored from it.
fn snapshot_checksum(d: &Daemon, snapshot: &str, scratch: &Path) -> String {
    let disk = format!("chk-{snapshot}");
    d.apply(vec![Disk::from_snapshot(&disk, snapshot).json()]);
    wait_disk_ready(d, &disk);
    let raw = scratch.join(format!("{disk}.raw"));
    to_raw(&d.disk_path(&disk), &raw);
    let sum = sha256_file(&raw);
    let _ = std::fs::remove_file(&raw);
    d.cli_ok(&["delete", "disk", &disk]);
    d.wait_gone("virtualdisks", &disk, Duration::from_secs(30));
    sum
}

#[test]
fn consistent_snapshots_batches_restores_and_chain_deletes() {
    let _serial = serial();
    let d = Daemon::start();
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}---\n{}---\n{}",
            overlay_disk_yaml("data-a"),
            overlay_disk_yaml("data-b"),
            Disk::blank("data-c", "16Mi").yaml(),
            vm_yaml("app", "AlwaysOn", &["data-a", "data-b", "data-c"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("app");

    // 1. A file written (not synced) in the guest is in a consistent snapshot.
    let token = format!("precious-{}", std::process::id());
    d.agent_sh_ok("app", &format!("echo {token} > /data/precious.txt"));
    d.apply(vec![DiskSnapshot::of("s-a", "data-a").json()]);
    let s = d.wait_final("virtualdisksnapshots", "s-a", SNAP_TIMEOUT);
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(s["status"]["consistent"], true, "{s:#}");
    assert!(s["status"]["freezeWindowMs"].as_u64().is_some(), "{s:#}");
    assert_eq!(freeze_status(&d, "app"), "thawed");
    // Which of the guest's filesystems were frozen on the disk: exactly
    // those the guest itself has mounted from its first disk.
    let mounts = d.agent_sh_ok("app", "cat /proc/mounts");
    let on = |dev: &str| -> Vec<Value> {
        let mut v: Vec<String> = mounts
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(dev)).then(|| f.next().unwrap_or_default().to_string())
            })
            .collect();
        v.sort();
        v.into_iter().map(Value::from).collect()
    };
    assert!(!on("/dev/vda").is_empty(), "{mounts}");
    assert_eq!(
        s["status"]["frozenMountPoints"],
        Value::Array(on("/dev/vda")),
        "{s:#}"
    );

    d.apply(vec![Disk::from_snapshot("restored-a", "s-a").json()]);
    wait_disk_ready(&d, "restored-a");
    let raw = scratch.join("restored-a.raw");
    to_raw(&d.disk_path("restored-a"), &raw);
    let header = assert_clean_ext4(&raw, "s-a restored");
    assert!(
        header.contains("Filesystem state:         clean"),
        "{header}"
    );
    assert_eq!(debugfs_cat(&raw, "/precious.txt").trim(), token);

    // 2. A batch made in parallel: 5 snapshots of each disk and a VM
    // snapshot. Requests arriving during a cut wait for the next one, so at
    // most two cuts, each one freeze, and every snapshot consistent.
    let (freezes_before, _) = hook_counts(&d, "app");
    let mut items: Vec<Value> = Vec::new();
    for i in 0..5 {
        items.push(DiskSnapshot::of(&format!("b-a{i}"), "data-a").json());
        items.push(DiskSnapshot::of(&format!("b-b{i}"), "data-b").json());
    }
    items.push(VmSnapshot::of("b-vm", "app").json());
    std::thread::scope(|scope| {
        for item in &items {
            let d = &d;
            scope.spawn(move || d.apply(vec![item.clone()]));
        }
    });
    let mut cuts = BTreeSet::new();
    for item in &items {
        let name = item["metadata"]["name"].as_str().expect("name");
        let plural = if item["kind"] == "VirtualMachineSnapshot" {
            "virtualmachinesnapshots"
        } else {
            "virtualdisksnapshots"
        };
        let s = d.wait_final(plural, name, SNAP_TIMEOUT);
        assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
        assert_eq!(s["status"]["consistent"], true, "{s:#}");
        cuts.insert(s["status"]["cutId"].as_u64().expect("cutId"));
    }
    let vm_snap = d
        .get("virtualmachinesnapshots", "b-vm")
        .expect("vm snapshot");
    let children = vm_snap["status"]["virtualDiskSnapshotNames"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(children.len(), 3, "{vm_snap:#}");
    // The second disk's filesystems; the blank third disk has none, and its
    // snapshot says that the freeze did not cover it.
    let b = d.get("virtualdisksnapshots", "b-b0").expect("b-b0");
    assert_eq!(
        b["status"]["frozenMountPoints"],
        Value::Array(on("/dev/vdb")),
        "{b:#}"
    );
    let c_name = children
        .iter()
        .filter_map(Value::as_str)
        .find(|c| {
            d.get("virtualdisksnapshots", c)
                .is_some_and(|v| v["spec"]["virtualDiskName"] == "data-c")
        })
        .expect("data-c's snapshot")
        .to_string();
    let c = d.get("virtualdisksnapshots", &c_name).expect("c");
    assert_eq!(c["status"]["consistent"], true, "{c:#}");
    assert_eq!(c["status"]["frozenMountPoints"], json!([]), "{c:#}");
    assert_eq!(c["status"]["reason"], "NoFilesystemFrozen", "{c:#}");
    let child_cuts: BTreeSet<u64> = children
        .iter()
        .map(|c| {
            d.get("virtualdisksnapshots", c.as_str().unwrap_or_default())
                .expect("child")["status"]["cutId"]
                .as_u64()
                .expect("cut")
        })
        .collect();
    assert_eq!(
        child_cuts.len(),
        1,
        "a VM snapshot's disks are cut together"
    );
    // Counted by the guest itself: its fsfreeze hook runs once per freeze.
    let freezes = hook_counts(&d, "app").0 - freezes_before;
    assert_eq!(freezes, cuts.len(), "one freeze per cut");
    assert!(cuts.len() <= 2, "11 requests took {} cuts", cuts.len());
    assert_eq!(freeze_status(&d, "app"), "thawed");

    // 3. A chain: c1, c2, c3 with different content; deleting the middle one
    // changes no other snapshot and not the live disk.
    for i in 1..=3 {
        d.agent_sh_ok("app", &format!("echo chain-{i} > /data/chain.txt"));
        d.apply(vec![DiskSnapshot::of(&format!("c{i}"), "data-a").json()]);
        assert_eq!(
            d.wait_final("virtualdisksnapshots", &format!("c{i}"), SNAP_TIMEOUT)["status"]["consistent"],
            true
        );
    }
    d.cli_ok(&["stop", "app"]);
    d.wait_phase("app", "Stopped", Duration::from_secs(60));
    let before: Vec<String> = (1..=3)
        .map(|i| snapshot_checksum(&d, &format!("c{i}"), &scratch))
        .collect();
    assert_ne!(before[0], before[2]);
    let live_raw = scratch.join("live.raw");
    to_raw(&d.disk_path("data-a"), &live_raw);
    let live_before = sha256_file(&live_raw);

    // A snapshot of a stopped VM: consistent, without a freeze.
    let freezes_before = count_events(&d, "app", "Freezing");
    d.apply(vec![DiskSnapshot::of("offline", "data-a").json()]);
    let s = d.wait_final("virtualdisksnapshots", "offline", SNAP_TIMEOUT);
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(s["status"]["consistent"], true);
    // No QEMU runs, so no freeze can have reached a guest; hearthd did not
    // even try.
    assert_eq!(count_events(&d, "app", "Freezing"), freezes_before);

    d.cli_ok(&["delete", "snapshot", "c2"]);
    d.wait_gone("virtualdisksnapshots", "c2", Duration::from_secs(30));
    assert_eq!(snapshot_checksum(&d, "c1", &scratch), before[0]);
    assert_eq!(snapshot_checksum(&d, "c3", &scratch), before[2]);
    to_raw(&d.disk_path("data-a"), &live_raw);
    assert_eq!(sha256_file(&live_raw), live_before, "the live disk changed");

    // 4. Restore the VM from its snapshot: the disks are as they were then.
    d.cli_ok(&["start", "app"]);
    d.wait_agent("app");
    let (status, v) = d.request(
        "POST",
        "/v1/virtualmachines/app/restore",
        Some(&json!({"from": "b-vm"})),
    );
    assert_eq!(status, 200, "{v}");
    d.wait_agent("app");
    let out = d.agent_sh_ok(
        "app",
        "cat /data/chain.txt 2>/dev/null || echo none; cat /data/precious.txt",
    );
    assert_eq!(out, format!("none\n{token}\n"));

    // 5. Everything deleted: every layer file is gone.
    d.cli_ok(&["delete", "vm", "app"]);
    d.wait_gone("virtualmachines", "app", Duration::from_secs(60));
    for s in ["s-a", "c1", "c3", "offline"].iter().chain(
        items
            .iter()
            .filter(|i| i["kind"] == "VirtualDiskSnapshot")
            .map(|i| i["metadata"]["name"].as_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .iter(),
    ) {
        d.cli_ok(&["delete", "snapshot", s]);
    }
    d.cli_ok(&["delete", "vmsnapshot", "b-vm"]);
    for disk in ["data-a", "data-b", "data-c", "restored-a"] {
        d.cli_ok(&["delete", "disk", disk]);
    }
    wait_until("all layers removed", Duration::from_secs(60), || {
        std::fs::read_dir(d.state_dir().join("layers"))
            .map(|r| r.count() == 0)
            .unwrap_or(true)
    });
}

#[test]
fn no_agent_deadline_and_daemon_crash_while_frozen_are_settled_honestly() {
    let _serial = serial();
    let mut d = Daemon::start();

    // No agent: required fails with a reason; not required is Ready but not consistent.
    let noagent = vm_yaml("blind", "AlwaysOn", &["blind-data"], "")
        .replace("memory: 256Mi", "memory: 256Mi\n  guestAgent: false");
    let m = manifest(
        &d,
        "blind.yaml",
        &format!("{}---\n{}", overlay_disk_yaml("blind-data"), noagent),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_phase("blind", "Running", Duration::from_secs(60));
    d.apply(vec![
        DiskSnapshot::of("blind-must", "blind-data").json(),
        DiskSnapshot::of("blind-may", "blind-data")
            .required_consistency(false)
            .json(),
    ]);
    let must = d.wait_final("virtualdisksnapshots", "blind-must", SNAP_TIMEOUT);
    assert_eq!(must["status"]["phase"], "Failed", "{must:#}");
    assert!(
        must["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("guestAgent"),
        "{must:#}"
    );
    let may = d.wait_final("virtualdisksnapshots", "blind-may", SNAP_TIMEOUT);
    assert_eq!(may["status"]["phase"], "Ready", "{may:#}");
    assert_eq!(may["status"]["consistent"], false, "{may:#}");
    assert!(
        may["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("guestAgent"),
        "says why: {may:#}"
    );
    let (status, v) = d.request(
        "POST",
        "/v1/apply",
        Some(&json!({"items": [DiskSnapshot::of("blind-may", "other-disk").required_consistency(false).json()]})),
    );
    assert_eq!(status, 400, "a snapshot's spec is immutable: {v}");
    d.cli_ok(&["delete", "vm", "blind"]);

    // A guest whose fsfreeze hook takes 4 s before each freeze.
    let hook = vm_yaml(
        "hook",
        "AlwaysOn",
        &["hook-data"],
        "hearth.freeze_hook_sleep=4",
    );
    let m = manifest(
        &d,
        "hook.yaml",
        &format!("{}---\n{}", overlay_disk_yaml("hook-data"), hook),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("hook");

    // hearthd is killed while the freeze is under way; the guest freezes
    // with nobody left to thaw it. The restarted daemon thaws it and takes
    // the snapshot again; it is never claimed consistent on the old cut.
    d.apply(vec![DiskSnapshot::of("crash", "hook-data").json()]);
    // Killed when the guest itself says the freeze has begun (its hook
    // runs, then sleeps 4 s, then qemu-ga freezes).
    wait_until(
        "the guest's freeze hook runs",
        Duration::from_secs(30),
        || hook_counts(&d, "hook").0 == 1,
    );
    let killed_cut = d
        .events("VirtualMachine", "hook")
        .iter()
        .filter(|e| e["reason"] == "Freezing")
        .filter_map(|e| {
            let m = e["message"].as_str()?;
            m.strip_prefix("cut ")?
                .split(':')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .next_back()
        .expect("the cut being frozen");
    d.kill();
    // The hook ends and the guest freezes while no daemon runs: asked of
    // the guest agent directly, on the socket hearthd used.
    let agent = d.run_dir().join("vms/hook/agent.sock");
    wait_until(
        "the guest frozen with no daemon",
        Duration::from_secs(30),
        || agent_freeze_status(&agent).as_deref() == Some("frozen"),
    );
    assert_eq!(hook_counts(&d, "hook"), (1, 0), "frozen, not thawed yet");
    d.spawn();
    let s = d.wait_final("virtualdisksnapshots", "crash", SNAP_TIMEOUT);
    let events = d.events("VirtualMachine", "hook");
    assert!(
        events.iter().any(|e| e["reason"] == "RecoveringCut"),
        "{events:#?}"
    );
    // The killed cut itself was thawed, by the restarted daemon, and the
    // guest saw that thaw.
    let thawed_killed_cut = events.iter().any(|e| {
        e["reason"] == "Thawed"
            && e["message"].as_str().unwrap_or_default()
                == format!("cut {killed_cut}: the guest thawed 1 filesystem(s)")
    });
    assert!(
        thawed_killed_cut,
        "the restarted daemon thawed cut {killed_cut}: {events:#?}"
    );
    assert!(hook_counts(&d, "hook").1 >= 1, "the guest saw the thaw");
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(
        s["status"]["consistent"], true,
        "a fresh cut after the restart: {s:#}"
    );
    assert!(s["status"]["cutId"].as_u64() > Some(1), "{s:#}");
    assert_eq!(freeze_status(&d, "hook"), "thawed");

    // Deleting a snapshot while its cut is in progress is safe: the cut
    // finishes, the snapshot goes, the guest is thawed.
    d.apply(vec![DiskSnapshot::of("doomed", "hook-data").json()]);
    d.wait_object(
        "virtualdisksnapshots",
        "doomed",
        "doomed in progress",
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "InProgress",
    );
    d.cli_ok(&["delete", "snapshot", "doomed"]);
    d.wait_gone("virtualdisksnapshots", "doomed", Duration::from_secs(60));
    assert_eq!(freeze_status(&d, "hook"), "thawed");
    assert_eq!(
        d.get("virtualdisksnapshots", "crash").expect("crash")["status"]["phase"],
        "Ready"
    );

    // A program run through the agent does not hold the agent channel while
    // it runs: a cut taken meanwhile freezes at once and is consistent,
    // instead of waiting behind it and failing at the deadline.
    let runner = std::thread::scope(|scope| {
        let d = &d;
        let long = scope.spawn(move || d.agent_sh_ok("hook", "sleep 12; echo slept"));
        // Deliberate: the program is running in the guest before the cut.
        std::thread::sleep(Duration::from_millis(500));
        d.apply(vec![DiskSnapshot::of("during-exec", "hook-data").json()]);
        let s = d.wait_final("virtualdisksnapshots", "during-exec", SNAP_TIMEOUT);
        let still_running = !long.is_finished();
        (s, still_running, long.join().expect("exec thread"))
    });
    let (s, still_running, out) = runner;
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(s["status"]["consistent"], true, "{s:#}");
    assert!(
        still_running,
        "the cut finished only after the program: it waited behind it"
    );
    assert_eq!(out, "slept\n", "{out}");

    // A freeze that cannot finish within the deadline: thawed, not consistent.
    let m = manifest(
        &d,
        "hook.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("hook-data"),
            hook.replace("memory: 256Mi", "memory: 256Mi\n  freezeDeadlineSeconds: 3")
        ),
    );
    let out = d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    assert!(out.contains("virtualmachine/hook configured"), "{out}");
    d.apply(vec![
        DiskSnapshot::of("late", "hook-data").json(),
        DiskSnapshot::of("late-ok", "hook-data")
            .required_consistency(false)
            .json(),
    ]);
    let late = d.wait_final("virtualdisksnapshots", "late", SNAP_TIMEOUT);
    assert_eq!(late["status"]["phase"], "Failed", "{late:#}");
    assert!(
        late["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("deadline"),
        "{late:#}"
    );
    let late_ok = d.wait_final("virtualdisksnapshots", "late-ok", SNAP_TIMEOUT);
    assert_eq!(late_ok["status"]["phase"], "Ready", "{late_ok:#}");
    assert_eq!(late_ok["status"]["consistent"], false, "{late_ok:#}");
    // The freeze happened after the deadline; its queued thaw undid it.
    wait_until("guest thawed", Duration::from_secs(20), || {
        freeze_status(&d, "hook") == "thawed"
    });
    d.agent_sh_ok("hook", "echo still-writable > /data/after.txt && sync");
}

/// hearthd's PATH with a `qemu-img` in `dir` that runs the real one, but
/// first sleeps 6 s in the next `create` of an overlay (`-b`) or the next
/// `convert` after the test touches `sleep-next-create` /
/// `sleep-next-convert` in `dir`, touching `sleeping` while it does.
fn slow_qemu_img(dir: &Path) -> String {
    let d = dir.display();
    common::qemu_img_log::wrapped_qemu_img(
        dir,
        &format!(
            "case \" $* \" in\n\
             *\" create \"*\" -b \"*) f={d}/sleep-next-create ;;\n\
             *\" convert \"*) f={d}/sleep-next-convert ;;\n\
             *) f= ;;\n\
             esac\n\
             if [ -n \"$f\" ] && rm \"$f\" 2>/dev/null; then : > {d}/sleeping; sleep 6; rm -f {d}/sleeping; fi"
        ),
    )
}

/// Writes `pattern` at `offset_mib` into a disk's head with qemu-io (no VM
/// runs it), so each layer of the chain holds bytes of its own.
fn write_pattern(head: &Path, pattern: u8, offset_mib: u32) {
    let st = Command::new("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            &format!("write -P {pattern} {offset_mib}M 1M"),
        ])
        .arg(head)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("qemu-io");
    assert!(st.success(), "qemu-io {}", head.display());
}

fn chain_sum(image: &Path, scratch: &Path) -> String {
    let raw = scratch.join("chain.raw");
    let _ = std::fs::remove_file(&raw);
    to_raw(image, &raw);
    let sum = sha256_file(&raw);
    std::fs::remove_file(&raw).expect("remove raw");
    sum
}

#[test]
fn a_restore_pins_its_snapshot_and_a_snapshot_being_deleted_is_not_restored() {
    let _serial = serial();
    let tools = tempfile::tempdir().expect("tempdir");
    let path = slow_qemu_img(tools.path());
    let flag = |name: &str| std::fs::write(tools.path().join(name), "").expect("flag");
    let sleeping = tools.path().join("sleeping");
    let d = Daemon::start_env(&[("PATH", &path)]);
    let scratch = d.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).expect("scratch");
    // A VM that never runs: every cut is offline, every write is qemu-io's.
    apply_manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("data"),
            vm_yaml("app", "AlwaysOff", &["data"], "")
        ),
    );
    wait_disk_ready(&d, "data");
    let cut = |name: &str, vm_level: bool| {
        d.apply(vec![if vm_level {
            VmSnapshot::of(name, "app").json()
        } else {
            DiskSnapshot::of(name, "data").json()
        }]);
        let plural = if vm_level {
            "virtualmachinesnapshots"
        } else {
            "virtualdisksnapshots"
        };
        let s = d.wait_final(plural, name, SNAP_TIMEOUT);
        assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    };
    // L0(s0) <- L1(vs1) <- L2(s2) <- head: once vs1 goes, nothing needs L1
    // and it is merged into L2 (offline) and unlinked.
    write_pattern(&d.disk_path("data"), 0x11, 0);
    cut("s0", false);
    write_pattern(&d.disk_path("data"), 0x22, 1);
    let l1 = d.disk_path("data");
    cut("vs1", true);
    write_pattern(&d.disk_path("data"), 0x33, 2);
    cut("s2", false);
    let vs1 = chain_sum(&l1, &scratch);

    // A disk restored from vs1's disk snapshot while vs1 is deleted: the
    // overlay over L1 is being made (qemu-img held in `create`) when the
    // delete comes.
    flag("sleep-next-create");
    d.apply(vec![Disk::from_snapshot("r", "vs1-data").json()]);
    wait_until("qemu-img sleeps in create", Duration::from_secs(30), || {
        sleeping.exists()
    });
    d.cli_ok(&["delete", "vmsnapshot", "vs1"]);
    d.wait_gone("virtualmachinesnapshots", "vs1", Duration::from_secs(60));
    wait_disk_ready(&d, "r");
    let r = d.disk_path("r");
    assert!(l1.exists(), "the layer a restored disk reads is kept");
    assert_eq!(
        backing_chain(&r).get(1).map(|p| p.as_path()),
        Some(l1.as_path()),
        "r is an overlay over vs1's layer"
    );
    assert_eq!(chain_sum(&r, &scratch), vs1, "r does not read vs1's bytes");
    let check = Command::new("qemu-img")
        .args(["check", "-U"])
        .arg(&l1)
        .output()
        .expect("qemu-img check");
    assert!(check.status.success(), "qemu-img check of vs1's layer");

    // A snapshot whose delete has begun (it waits for an export reading
    // it) is not restored, neither into a new disk nor into the VM.
    write_pattern(&d.disk_path("data"), 0x44, 3);
    cut("vs2", true);
    flag("sleep-next-convert");
    let out = scratch.join("vs2-data.qcow2");
    let mut export = d
        .cli_command(
            &[
                "export",
                "snapshot",
                "vs2-data",
                "-o",
                &out.to_string_lossy(),
            ],
            std::process::Stdio::null(),
        )
        .spawn()
        .expect("hearth export");
    wait_until("the export converts", Duration::from_secs(30), || {
        sleeping.exists()
    });
    d.cli_ok(&["delete", "vmsnapshot", "vs2"]);
    wait_until(
        "vs2's disk snapshot waits for the export",
        Duration::from_secs(30),
        || {
            d.event_reasons("VirtualDiskSnapshot", "vs2-data")
                .iter()
                .any(|r| r == "DeleteWaiting")
        },
    );
    let refused = d.cli_err(&["restore", "vm", "app", "--from", "vs2"]);
    assert!(refused.contains("being deleted"), "{refused}");
    d.apply(vec![Disk::from_snapshot("r2", "vs2-data").json()]);
    let r2 = d.wait_object(
        "virtualdisks",
        "r2",
        "r2 refused",
        Duration::from_secs(30),
        |v| v["status"]["phase"] == "Failed",
    );
    assert!(
        r2["status"]["lastError"]
            .as_str()
            .is_some_and(|e| e.contains("being deleted") && e.contains("spec.source.snapshot")),
        "{r2:#}"
    );
    assert!(export.wait().expect("export").success());
    d.wait_gone("virtualmachinesnapshots", "vs2", Duration::from_secs(60));
}
