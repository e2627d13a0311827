//! The manifest directory and running VMs: removing a file stops and removes
//! its VM (also one still starting); the directory vanishing, coming back and
//! losing inotify events; a daemon restart with edits made while it was down.

mod common;
mod manifest_support;

use std::time::Duration;

use common::*;
use manifest_support::*;

/// Issue #3, required behaviour 6. The delete grace period is shortened to
/// 300 ms so the second delete lands while that guest is still booting.
#[test]
fn rm_of_a_running_and_of_a_starting_vm_stops_and_removes_it() {
    let _serial = serial();
    let env = Env::start_with(&["--manifests-delete-grace-ms", "300"]);

    env.write("run.yaml", &vm_text("run", "AlwaysOn", "256Mi"));
    let pid = pid_of(&env.d.wait_agent("run"));
    std::fs::remove_file(env.path("run.yaml")).expect("rm");
    env.wait_gone("run", Duration::from_secs(60));
    wait_until("its QEMU is gone", Duration::from_secs(10), || {
        !is_alive(pid)
    });
    // The "Deleted" event is written just after the object goes: read
    // the events once it is there.
    let mut reasons = Vec::new();
    hearth_test_support::eventually(Duration::from_secs(10), || {
        reasons = env.d.event_reasons("VirtualMachine", "run");
        reasons.iter().any(|r| r == "Deleted")
    });
    for r in ["Deleting", "Stopping", "Stopped", "Deleted"] {
        assert!(reasons.contains(&r.to_string()), "{r} missing: {reasons:?}");
    }
    assert!(env.d.qemu_pids().is_empty());

    // Still starting: removed as soon as QEMU runs, long before the guest is up.
    env.write("boot.yaml", &vm_text("boot", "AlwaysOn", "256Mi"));
    env.until("QEMU started", Duration::from_secs(60), || {
        !env.d.qemu_pids().is_empty()
    });
    let pids = env.d.qemu_pids();
    std::fs::remove_file(env.path("boot.yaml")).expect("rm");
    let vm = env.vm("boot").expect("still there");
    assert_ne!(
        vm["status"]["agentConnected"], true,
        "the guest was still booting: {vm}"
    );
    env.wait_gone("boot", Duration::from_secs(60));
    for p in pids {
        wait_until(
            "QEMU of the starting VM is gone",
            Duration::from_secs(10),
            || !is_alive(p),
        );
    }
    assert!(env.d.qemu_pids().is_empty());
    let (status, _) = env.d.request("GET", "/v1/health", None);
    assert_eq!(status, 200, "the daemon survives both");
}

/// Issue #3, required behaviour 11. Periodic re-lists are turned off (once an
/// hour) so only the watch-loss and overflow handling can repair state.
#[test]
fn directory_removed_and_recreated_and_inotify_overflow_are_repaired_by_a_relist() {
    let _serial = serial();
    let env = Env::start_with(&["--manifests-resync-seconds", "3600"]);
    env.write("a.yaml", &vm_text("ra", "AlwaysOff", "256Mi"));
    env.write("b.yaml", &vm_text("rb", "AlwaysOff", "256Mi"));
    env.wait_generation("ra", 1);
    env.wait_generation("rb", 1);

    // Removed: the directory is unknown, not empty; nothing is deleted.
    env.relisted_after("the directory's removal", || {
        std::fs::remove_dir_all(&env.dir).expect("rm -rf")
    });
    assert_eq!(env.sources()["directoryPresent"], false);
    env.assert_settled();
    assert!(env.vm("ra").is_some() && env.vm("rb").is_some());
    assert_eq!(env.sources()["watching"], false);

    // Recreated with other content: the result is that content.
    std::fs::create_dir(&env.dir).expect("mkdir");
    env.write("a.yaml", &vm_text("ra", "AlwaysOff", "384Mi"));
    env.wait_generation("ra", 2);
    env.wait_gone("rb", Duration::from_secs(20));
    let v = env.sources();
    assert_eq!(v["watching"], true, "{v}");
    assert!(v["relists"]["watchLost"].as_u64().unwrap_or(0) >= 1, "{v}");

    // Overflow: hearthd is stopped while far more events than the inotify
    // queue holds happen; the real change comes last, so its events are
    // among the dropped ones. Only the overflow notice is left to go on.
    let max: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(16384);
    let daemon = env.d.child.as_ref().expect("daemon").id();
    signal(daemon, rustix::process::Signal::STOP);
    for i in 0..(max / 3 + 200) {
        let p = env.path(&format!("flood-{i}.tmp"));
        std::fs::write(&p, b"x").expect("w");
        std::fs::remove_file(&p).expect("rm");
    }
    env.write_atomic("a.yaml", &vm_text("ra", "AlwaysOff", "512Mi"));
    signal(daemon, rustix::process::Signal::CONT);
    env.until(
        "repaired after the overflow",
        Duration::from_secs(10),
        || env.memory("ra").as_deref() == Some("512Mi"),
    );
    let v = env.sources();
    assert!(v["relists"]["overflow"].as_u64().unwrap_or(0) >= 1, "{v}");
    assert_eq!(v["relists"]["periodic"].as_u64().unwrap_or(0), 0, "{v}");
    assert_eq!(env.count("ra", "Deleting"), 0);
}

/// Issue #3, required behaviour 12.
#[test]
fn restart_with_running_vms_and_offline_edits_applies_them_and_keeps_unchanged_pids() {
    let _serial = serial();
    let mut env = Env::start();
    env.write("keep.yaml", &vm_text("keep", "AlwaysOn", "256Mi"));
    env.write("edit.yaml", &vm_text("edit", "AlwaysOn", "256Mi"));
    env.write("gone.yaml", &vm_text("gone", "AlwaysOff", "256Mi"));
    let keep = pid_of(&env.d.wait_agent("keep"));
    let edit = pid_of(&env.d.wait_agent("edit"));
    env.wait_generation("gone", 1);

    env.d.kill();
    // While hearthd is down: an edit, a removal, a new file.
    env.write_atomic("edit.yaml", &vm_text("edit", "AlwaysOn", "384Mi"));
    std::fs::remove_file(env.path("gone.yaml")).expect("rm");
    env.write("new.yaml", &vm_text("new", "AlwaysOff", "256Mi"));
    let offline = env.snapshot();
    env.d.spawn();

    env.wait_generation("new", 1);
    env.wait_gone("gone", Duration::from_secs(20));
    env.wait_generation("edit", 2);
    let edited = env
        .d
        .wait_vm("edit", "restarted with the edit", BOOT_TIMEOUT, |v| {
            v["status"]["agentConnected"] == true
                && v["status"]["pid"]
                    .as_u64()
                    .is_some_and(|p| p as u32 != edit)
        });
    assert_eq!(edited["spec"]["memory"], "384Mi");
    let new_edit = pid_of(&edited);
    env.assert_settled();
    // The restarted daemon has reconciled the unchanged VM: it adopted it.
    env.until("keep adopted", Duration::from_secs(30), || {
        env.count("keep", "Adopted") == 1
    });

    // The unchanged VM kept its QEMU: adopted, not restarted, not re-applied.
    let k = env.vm("keep").expect("keep");
    assert_eq!(pid_of(&k), keep);
    assert!(is_alive(keep));
    assert_eq!(env.generation("keep"), 1);
    assert_eq!(env.count("keep", "Started"), 1);
    assert_eq!(env.count("keep", "Updated"), 0);
    // The edited one restarted exactly once.
    assert_eq!(env.count("edit", "Started"), 2);
    assert!(!is_alive(edit));
    let mut pids = env.d.qemu_pids();
    pids.sort();
    let mut want = vec![keep, new_edit];
    want.sort();
    assert_eq!(pids, want);
    assert_eq!(
        env.snapshot(),
        offline,
        "hearthd wrote nothing into the directory"
    );
}
