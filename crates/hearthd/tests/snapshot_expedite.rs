//! The step before a freeze (docs/snapshots.md, "Before the freeze: a
//! cheaper freeze"): while a cut is prepared, hearthd sets the guest's
//! `/sys/kernel/rcu_expedited` through `guest-exec`, and the guest resets it
//! by itself a few seconds later. Real QEMU, the real qemu-ga in the test
//! guest. Ground truth is the guest's: its fsfreeze hook, which qemu-ga runs
//! right before `FIFREEZE`, prints the value the freeze ran with on the
//! serial console; the guest's own files say when it was reset.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SNAP_TIMEOUT: Duration = Duration::from_secs(90);
/// `hearth_engine::snapshot::expedite::HOLD_SECONDS`, and some margin.
const RESET_WITHIN: Duration = Duration::from_secs(20);

fn consistent_snapshot(d: &Daemon, name: &str, disk: &str) -> Value {
    let v = snapshot_ready(d, name, disk, SNAP_TIMEOUT);
    assert_eq!(v["status"]["consistent"], true, "{v:#}");
    v
}

/// The `Freezing` event of the snapshot's cut.
fn freezing_event(d: &Daemon, vm: &str, snap: &Value) -> String {
    let cut = snap["status"]["cutId"].as_u64().expect("cutId");
    let prefix = format!("cut {cut}:");
    d.events("VirtualMachine", vm)
        .iter()
        .filter(|e| e["reason"] == "Freezing")
        .filter_map(|e| e["message"].as_str())
        .find(|m| m.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no Freezing event of cut {cut}"))
        .to_string()
}

/// What the guest's fsfreeze hook printed for its freezes, in order: the
/// value of `rcu_expedited` each freeze ran with.
fn hook_values(d: &Daemon, vm: &str) -> Vec<String> {
    let text = std::fs::read_to_string(serial_log(d, vm)).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split("fsfreeze hook: freeze (rcu_expedited=").nth(1))
        .map(|r| r.trim_end_matches([')', '\r']).to_string())
        .collect()
}

/// A cut that ran expedited: its `Freezing` event says so and the guest's
/// hook froze with `rcu_expedited=1`. The step has a budget
/// (`expedite::BUDGET`, 300 ms); on a loaded machine the guest's script
/// may miss it, and then the freeze goes on without waiting for it (the
/// event says why; the late script may still set the value before the
/// freeze, so the hook's value is not asserted) and the cut is taken
/// again, at most twice.
fn expedited_cut(d: &Daemon, vm: &str, name: &str, disk: &str) -> Value {
    for attempt in 0..3 {
        let before = hook_values(d, vm).len();
        let name = if attempt == 0 {
            name.to_string()
        } else {
            format!("{name}-again{attempt}")
        };
        let s = consistent_snapshot(d, &name, disk);
        let event = freezing_event(d, vm, &s);
        let values = hook_values(d, vm);
        assert_eq!(
            values.len(),
            before + 1,
            "one freeze for {name}: {values:?}"
        );
        if event.contains("did not finish within") {
            eprintln!("{name}: the guest's script missed the budget; cut again");
            continue;
        }
        assert!(event.contains("RCU grace periods expedited"), "{event}");
        assert_eq!(values[before], "1", "{name}: {}", d.log());
        return s;
    }
    panic!("{name}: three cuts in a row missed the expedite budget");
}

fn rcu_expedited(d: &Daemon, vm: &str) -> String {
    d.agent_sh_ok(
        vm,
        "cat /sys/kernel/rcu_expedited; cat /run/hearth-rcu-expedited 2>/dev/null || echo no-marker",
    )
}

#[test]
fn a_freeze_runs_expedited_and_the_guest_resets_it_by_itself() {
    let _serial = serial();
    let d = Daemon::start();
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("ex-data"),
            vm_yaml("ex", "AlwaysOn", &["ex-data"], "")
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("ex");
    assert_eq!(
        rcu_expedited(&d, "ex"),
        "0\nno-marker\n",
        "the guest starts unexpedited"
    );

    // 1. The freeze ran with rcu_expedited set (the guest's hook says so,
    // just before FIFREEZE); the event says the step ran.
    expedited_cut(&d, "ex", "ex-1", "ex-data");
    // Still set right after the cut, with hearthd's marker; then the guest's
    // own watcher resets it and removes the marker.
    let now = rcu_expedited(&d, "ex");
    let mut lines = now.lines();
    assert_eq!(lines.next(), Some("1"), "{now}");
    assert!(
        lines.next().is_some_and(|pid| pid.parse::<u32>().is_ok()),
        "the marker holds the script's pid: {now}"
    );
    wait_until("the guest reset rcu_expedited", RESET_WITHIN, || {
        rcu_expedited(&d, "ex") == "0\nno-marker\n"
    });

    // 2. Two cuts in a row: the first one's watcher does not undo the
    // second one's change (it resets only while the marker is its own).
    expedited_cut(&d, "ex", "ex-2", "ex-data");
    expedited_cut(&d, "ex", "ex-3", "ex-data");
    wait_until("the guest reset rcu_expedited", RESET_WITHIN, || {
        rcu_expedited(&d, "ex") == "0\nno-marker\n"
    });

    // 3. A guest that expedites by itself is left alone: nothing is reset
    // when the watcher's time would have passed.
    d.agent_sh_ok("ex", "echo 1 > /sys/kernel/rcu_expedited");
    let s = consistent_snapshot(&d, "ex-4", "ex-data");
    let event = freezing_event(&d, "ex", &s);
    assert!(
        event.contains("the guest already expedites RCU grace periods"),
        "{event}"
    );
    // A negative: only after the hold time (5 s) has passed can it show.
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(rcu_expedited(&d, "ex"), "1\nno-marker\n");
    d.agent_sh_ok("ex", "echo 0 > /sys/kernel/rcu_expedited");

    // 4. `spec.expediteFreeze: false` leaves the guest's kernel alone, and
    // takes effect without a restart of the VM.
    let before = d.qemu_pids_of("ex");
    assert_eq!(before.len(), 1, "one QEMU: {before:?}");
    let off = vm_yaml("ex", "AlwaysOn", &["ex-data"], "")
        .replace("spec:\n", "spec:\n  expediteFreeze: false\n");
    std::fs::write(&m, format!("{}---\n{off}", overlay_disk_yaml("ex-data")))
        .expect("write manifest");
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    let s = consistent_snapshot(&d, "ex-5", "ex-data");
    let event = freezing_event(&d, "ex", &s);
    assert!(
        event.contains("freeze not expedited: spec.expediteFreeze is false"),
        "{event}"
    );
    assert_eq!(
        hook_values(&d, "ex").last().map(String::as_str),
        Some("0"),
        "the guest froze unexpedited"
    );
    assert_eq!(rcu_expedited(&d, "ex"), "0\nno-marker\n");
    assert_eq!(d.qemu_pids_of("ex"), before, "the same QEMU kept running");
}

#[test]
fn an_agent_without_guest_exec_still_takes_a_consistent_snapshot() {
    let _serial = serial();
    let d = Daemon::start();
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("nx-data"),
            vm_yaml(
                "nx",
                "AlwaysOn",
                &["nx-data"],
                "hearth.agent_block=guest-exec"
            )
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("nx");
    let s = consistent_snapshot(&d, "nx-1", "nx-data");
    let event = freezing_event(&d, "nx", &s);
    assert!(
        event.contains("freeze not expedited: the guest agent refuses guest-exec"),
        "{event}"
    );
    // The guest froze as before, unexpedited.
    assert_eq!(hook_values(&d, "nx"), ["0"]);
    assert_eq!(hook_counts(&d, "nx"), (1, 1));
}

#[test]
fn a_guest_script_that_hangs_neither_delays_nor_breaks_the_snapshot() {
    let _serial = serial();
    let d = Daemon::start();
    let m = manifest(
        &d,
        "vm.yaml",
        &format!(
            "{}---\n{}",
            overlay_disk_yaml("hg-data"),
            vm_yaml(
                "hg",
                "AlwaysOn",
                &["hg-data"],
                "hearth.rcu_expedited_hangs=1"
            )
        ),
    );
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_agent("hg");
    let serial_text = std::fs::read_to_string(serial_log(&d, "hg")).unwrap_or_default();
    assert!(
        serial_text.contains("rcu_expedited is a FIFO"),
        "the guest did not set the trap up: {serial_text}"
    );
    for (i, n) in ["hg-1", "hg-2"].iter().enumerate() {
        let started = Instant::now();
        let s = consistent_snapshot(&d, n, "hg-data");
        let took = started.elapsed();
        let event = freezing_event(&d, "hg", &s);
        assert!(
            event.contains("freeze not expedited: the guest's script did not finish within 300 ms"),
            "{event}"
        );
        // The guest's script is still blocked on its open: it never ran.
        let (_, ps) = d.agent_sh("hg", "ps | grep -c '[r]ead v'");
        assert_eq!(ps.trim(), (i + 1).to_string(), "hung scripts: {ps}");
        // The wait for it is bounded: the whole snapshot took far less than
        // the freeze deadline (10 s) it would eat into otherwise.
        assert!(took < Duration::from_secs(5), "{n} took {took:?}");
        eprintln!("{n}: request → Ready {took:?}");
    }
    assert_eq!(hook_values(&d, "hg"), ["fifo", "fifo"]);
    assert_eq!(hook_counts(&d, "hg"), (2, 2));
}
