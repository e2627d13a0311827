//! A hearthd killed between spawning QEMU and recording it: the next daemon
//! finds that QEMU from its launch marker and adopts it; no second QEMU is
//! ever started for the VM. The daemon dies in that window for real, through
//! the `HEARTH_TEST_CRASH_AFTER_SPAWN=1` fault-injection hook.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::*;

#[test]
fn a_daemon_dying_right_after_spawning_qemu_leaves_exactly_one_qemu_which_is_adopted() {
    let _serial = serial();
    let vm = "crash-launch";
    let mut d = Daemon::start_env(&[("HEARTH_TEST_CRASH_AFTER_SPAWN", "1")]);
    let path = manifest(&d, "vm.yaml", &vm_yaml(vm, "AlwaysOn", &[], ""));
    d.cli_ok(&["apply", "-f", path.to_str().expect("utf-8 path")]);

    // The launch spawns QEMU and the daemon aborts before recording it.
    let status = d.wait_exit(Duration::from_secs(120));
    assert_eq!(status.signal(), Some(6), "hearthd aborted: {status:?}");
    assert!(
        d.log()
            .contains("HEARTH_TEST_CRASH_AFTER_SPAWN: aborting after spawning QEMU"),
        "{}",
        d.log()
    );
    let first = d.qemu_pids_of(vm);
    assert_eq!(first.len(), 1, "the spawned QEMU outlives the daemon");
    let first = first[0];

    // A daemon without the hook: the VM runs again, on that same QEMU.
    d.spawn();
    let status = d.wait_agent(vm);
    assert_eq!(
        status["status"]["pid"].as_u64(),
        Some(u64::from(first)),
        "{status:#}"
    );
    assert_eq!(
        d.qemu_pids_of(vm),
        vec![first],
        "exactly one QEMU for the VM"
    );
    let reasons = d.event_reasons("VirtualMachine", vm);
    assert!(reasons.contains(&"Adopted".to_string()), "{reasons:?}");
    assert!(
        !reasons.iter().any(|r| r == "Started"),
        "no launch completed, so none may be reported: {reasons:?}"
    );
    // Later reconciles (resync, agent events) start nothing more.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(d.qemu_pids_of(vm), vec![first]);
    let (code, body) = d.request(
        "POST",
        &format!("/v1/virtualmachines/{vm}/agent/ping"),
        None,
    );
    assert_eq!(code, 200, "{body}");

    // The adopted process is a normal VM of this daemon: a restart of the
    // daemon adopts it again by its runtime record, and delete stops it.
    d.kill();
    d.spawn();
    let status = d.wait_agent(vm);
    assert_eq!(status["status"]["pid"].as_u64(), Some(u64::from(first)));
    assert_eq!(d.qemu_pids_of(vm), vec![first]);
    d.cli_ok(&["delete", "vm", vm]);
    d.wait_gone("virtualmachines", vm, Duration::from_secs(60));
    assert!(d.qemu_pids_of(vm).is_empty(), "QEMU stopped with the VM");
}
