//! End to end with real QEMU and the real guest agent in the test guest.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The demo manifests from `examples/`: boot, talk to the agent, stop, start,
/// survive a SIGKILL of hearthd (adopted, not restarted), delete cleanly.
#[test]
fn demo_vm_boots_is_adopted_after_daemon_sigkill_and_is_deleted_cleanly() {
    let _serial = serial();
    let mut d = Daemon::start();

    // Applied with the real CLI from the repo root: relative paths in the
    // example resolve against the manifest's directory.
    let out = d.cli_ok(&["apply", "-f", "examples/demo.yaml"]);
    assert!(out.contains("virtualdisk/demo-data created"), "{out}");
    assert!(out.contains("virtualmachine/demo created"), "{out}");
    // Applying the same file again changes nothing.
    let out = d.cli_ok(&["apply", "-f", "examples/demo.yaml"]);
    assert!(out.contains("virtualmachine/demo unchanged"), "{out}");

    let vm = d.wait_agent("demo");
    let accel = vm["status"]["accelerator"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(accel == "kvm" || accel == "tcg", "{vm:#}");
    let started = d
        .events("VirtualMachine", "demo")
        .into_iter()
        .find(|e| e["reason"] == "Started")
        .expect("a Started event");
    assert!(
        started["message"]
            .as_str()
            .unwrap_or_default()
            .contains(&accel),
        "the Started event names the accelerator: {started}"
    );
    let disk = d.get_disk("demo-data").expect("disk");
    assert_eq!(disk["status"]["phase"], "Ready");
    assert_eq!(disk["status"]["attachedTo"], "demo");

    // The real guest agent answers through hearthd.
    let (status, ping) = d.request("POST", "/v1/virtualmachines/demo/agent/ping", None);
    assert_eq!(status, 200, "{ping}");
    let (status, exec) = d.request(
        "POST",
        "/v1/virtualmachines/demo/agent/exec",
        Some(&json!({"path": "/bin/cat", "args": ["/data/hello.txt"]})),
    );
    assert_eq!(status, 200, "{exec}");
    assert_eq!(exec["stdout"], "hello from hearth\n");

    // The serial console is captured.
    let logs = d.cli_ok(&["logs", "demo"]);
    assert!(logs.contains("hearth-guest: qemu-ga started"), "{logs}");

    // Graceful stop.
    let pid1 = vm["status"]["pid"].as_u64().expect("pid") as u32;
    d.cli_ok(&["stop", "demo"]);
    d.wait_phase("demo", "Stopped", Duration::from_secs(60));
    wait_until("first QEMU gone", Duration::from_secs(10), || {
        !is_alive(pid1)
    });
    assert!(
        d.event_reasons("VirtualMachine", "demo")
            .contains(&"Stopped".to_string())
    );
    assert!(d.qemu_pids().is_empty(), "{:?}", d.qemu_pids());

    // Start again, then SIGKILL hearthd: the VM keeps running.
    d.cli_ok(&["start", "demo"]);
    let vm = d.wait_agent("demo");
    let pid2 = vm["status"]["pid"].as_u64().expect("pid") as u32;
    assert_ne!(pid1, pid2);
    assert_eq!(
        d.qemu_pids(),
        vec![pid2],
        "the status names the QEMU that runs"
    );
    let ticks2 = start_ticks(pid2).expect("QEMU's start time");
    assert_eq!(
        d.event_reasons("VirtualMachine", "demo")
            .iter()
            .filter(|r| *r == "Adopted")
            .count(),
        0
    );
    d.kill();

    // The restarted daemon adopts the same process and starts no second one.
    // Its status is what this daemon read back, not the one stored before
    // the kill: read it once the adoption happened, and check it against
    // the process table.
    d.spawn();
    wait_until("the VM is adopted", Duration::from_secs(60), || {
        d.event_reasons("VirtualMachine", "demo")
            .contains(&"Adopted".to_string())
    });
    let vm = d.wait_agent("demo");
    let adopted = vm["status"]["pid"].as_u64().expect("pid") as u32;
    assert!(is_alive(adopted), "the adopted pid is not running: {vm:#}");
    assert_eq!(
        start_ticks(adopted),
        Some(ticks2),
        "the adopted pid is the QEMU that ran before the kill, not a new one"
    );
    assert_eq!(adopted, pid2, "{vm:#}");
    // Deliberate: a few resyncs later, still that one QEMU and no other.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        d.qemu_pids(),
        vec![adopted],
        "exactly the adopted QEMU runs"
    );
    assert_eq!(start_ticks(adopted), Some(ticks2));
    let (status, _) = d.request("POST", "/v1/virtualmachines/demo/agent/ping", None);
    assert_eq!(status, 200);

    // A disk in use cannot be deleted.
    let err = d.cli_err(&["delete", "disk", "demo-data"]);
    assert!(err.contains("in use by VirtualMachine \"demo\""), "{err}");

    // Delete while running: QEMU gone, runtime files cleaned.
    d.cli_ok(&["delete", "vm", "demo"]);
    d.wait_gone("virtualmachines", "demo", Duration::from_secs(60));
    assert!(!is_alive(pid2), "QEMU still runs after delete");
    assert!(!d.run_dir().join("vms/demo").exists());
    assert!(!d.state_dir().join("vms/demo").exists());
    // The disk is its own object: its file stays until it is deleted.
    let disk_file = std::path::PathBuf::from(
        d.get_disk("demo-data").expect("disk")["status"]["path"]
            .as_str()
            .expect("disk path"),
    );
    assert!(
        disk_file.starts_with(d.state_dir()),
        "{}",
        disk_file.display()
    );
    assert!(disk_file.exists());
    d.cli_ok(&["delete", "disk", "demo-data"]);
    d.wait_gone("virtualdisks", "demo-data", Duration::from_secs(30));
    assert!(!disk_file.exists());
}

/// A Manual VM whose guest powers itself off stays Stopped; a QEMU that
/// crashes is reported Failed with QEMU's last words.
#[test]
fn guest_poweroff_and_qemu_crash_are_observed() {
    let _serial = serial();
    let d = Daemon::start();
    let m = manifest(&d, "vm.yaml", &vm_yaml("solo", "Manual", &[], ""));
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    // Manual: nothing starts until asked.
    d.wait_phase("solo", "Stopped", Duration::from_secs(20));
    assert!(d.qemu_pids().is_empty());

    d.cli_ok(&["start", "solo"]);
    let vm = d.wait_agent("solo");
    let pid = vm["status"]["pid"].as_u64().expect("pid") as u32;
    let (status, _) = d.request(
        "POST",
        "/v1/virtualmachines/solo/agent/exec",
        Some(&json!({"path": "/sbin/poweroff", "timeoutSeconds": 5})),
    );
    // The agent goes away with the guest; either answer is fine.
    assert!(status == 200 || status == 409, "{status}");
    d.wait_phase("solo", "Stopped", Duration::from_secs(60));
    wait_until("QEMU gone", Duration::from_secs(10), || !is_alive(pid));
    // The event is written with the status, in one transaction: whoever
    // sees Stopped finds why at once.
    assert!(
        d.event_reasons("VirtualMachine", "solo")
            .contains(&"GuestPoweredOff".to_string()),
        "Stopped without its GuestPoweredOff event"
    );
    // And it stays stopped.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(d.get_vm("solo").expect("vm")["status"]["phase"], "Stopped");
    assert!(d.qemu_pids().is_empty());

    // QEMU killed from outside: Failed, with a reason.
    d.cli_ok(&["start", "solo"]);
    let vm = d.wait_phase("solo", "Running", Duration::from_secs(60));
    let pid = vm["status"]["pid"].as_u64().expect("pid") as u32;
    let _ = std::process::Command::new("kill")
        .arg("-9")
        .arg(pid.to_string())
        .status();
    let vm = d.wait_phase("solo", "Failed", Duration::from_secs(30));
    assert!(
        vm["status"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .contains("QEMU exited unexpectedly"),
        "{vm:#}"
    );
    assert!(
        d.event_reasons("VirtualMachine", "solo")
            .contains(&"Crashed".to_string())
    );
}

/// A guest that acts on no request (the small guest without its agent has
/// nothing that handles the ACPI power button) is stopped by force once its
/// grace period is over: the forced stop is counted in the VM's
/// `hearth_vm_forced_stops_total` and told in a ForcedStop event that says
/// what was asked; QEMU is gone, and the guest's console shows it never shut
/// down. A guest that powers off when asked is not counted.
#[test]
fn a_stop_the_guest_does_not_act_on_is_forced_counted_and_told() {
    let _serial = serial();
    let d = Daemon::start();
    let deaf = vm_yaml("deaf", "Manual", &[], "hearth.agent=0")
        .replace("stopTimeoutSeconds: 10", "stopTimeoutSeconds: 6");
    let polite = vm_yaml("polite", "Manual", &[], "");
    let m = manifest(&d, "vms.yaml", &format!("{deaf}---\n{polite}"));
    d.cli_ok(&["apply", "-f", m.to_str().expect("utf8")]);
    d.wait_phase("deaf", "Stopped", Duration::from_secs(20));
    assert_eq!(
        forced_stops(&d, "deaf"),
        0.0,
        "a VM's series exists from the start"
    );
    assert_eq!(forced_stops(&d, "polite"), 0.0);

    // Asked to power off, the guest with its agent does.
    d.cli_ok(&["start", "polite"]);
    let vm = d.wait_agent("polite");
    let polite_pid = vm["status"]["pid"].as_u64().expect("pid") as u32;
    d.cli_ok(&["stop", "polite"]);
    d.wait_phase("polite", "Stopped", Duration::from_secs(60));
    wait_until("polite's QEMU gone", Duration::from_secs(10), || {
        !is_alive(polite_pid)
    });
    let console = std::fs::read_to_string(serial_log(&d, "polite")).unwrap_or_default();
    assert!(
        console.contains("hearth-guest: poweroff"),
        "the guest shut itself down: {console}"
    );
    assert_eq!(forced_stops(&d, "polite"), 0.0);

    // The deaf one: running, then a stop nobody in the guest hears.
    d.cli_ok(&["start", "deaf"]);
    let vm = d.wait_phase("deaf", "Running", Duration::from_secs(60));
    let pid = vm["status"]["pid"].as_u64().expect("pid") as u32;
    wait_until("the guest's init runs", Duration::from_secs(60), || {
        std::fs::read_to_string(serial_log(&d, "deaf"))
            .unwrap_or_default()
            .contains("hearth-guest: kernel cmdline")
    });
    let asked = std::time::Instant::now();
    d.cli_ok(&["stop", "deaf"]);
    d.wait_phase("deaf", "Stopped", Duration::from_secs(60));
    let took = asked.elapsed();
    wait_until("deaf's QEMU gone", Duration::from_secs(10), || {
        !is_alive(pid)
    });
    assert!(
        took >= Duration::from_secs(6),
        "stopped after {took:?}, before its 6 s grace period was over"
    );
    let console = std::fs::read_to_string(serial_log(&d, "deaf")).unwrap_or_default();
    assert!(
        !console.contains("hearth-guest: poweroff"),
        "the guest was not supposed to shut down: {console}"
    );
    assert_eq!(forced_stops(&d, "deaf"), 1.0);
    assert_eq!(forced_stops(&d, "polite"), 0.0);
    let forced: Vec<Value> = d
        .events("VirtualMachine", "deaf")
        .into_iter()
        .filter(|e| e["reason"] == "ForcedStop")
        .collect();
    assert_eq!(forced.len(), 1, "{forced:?}");
    assert_eq!(forced[0]["type"], "Warning", "{forced:?}");
    let message = forced[0]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("within 6s") && message.contains("power button pressed"),
        "the event says how long and what was asked: {message}"
    );

    // Deleted, the VM's series goes with it.
    d.cli_ok(&["delete", "vm", "deaf"]);
    d.wait_gone("virtualmachines", "deaf", Duration::from_secs(30));
    let (_, body) = raw_request(&d.socket(), "GET", "/metrics", None).expect("scrape");
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("hearth_vm_forced_stops_total{vm=\"deaf\"}"),
        "{text}"
    );
}
