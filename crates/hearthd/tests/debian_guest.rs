//! A real distribution end to end: the Debian 12 test image (guest/debian/)
//! imported over HTTP from a server on 127.0.0.1, disks made from it, one VM
//! booted through SeaBIOS and one through OVMF, cloud-init configuring both
//! from hearth's NoCloud seed, the real qemu-ga answering, and a consistent
//! snapshot under a write load restored and booted again.
//!
//! Everything is checked from the guest itself (through `guest-exec`) or
//! from the files on the host, never from what hearthd says about itself.
//! Three full-distribution boots in all: they take tens of seconds each
//! under TCG, so the checks share them.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::debian::*;
use common::http::{Behaviour, Server};
use common::*;
use serde_json::{Value, json};

const IMPORT_TIMEOUT: Duration = Duration::from_secs(300);
const TEST_KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHearthTestKeyHearthTestKeyHearthTestKey0 hearth-test@host";

fn sh(d: &Daemon, vm: &str, script: &str) -> (i64, String) {
    d.agent_sh(vm, script)
}

fn sh_ok(d: &Daemon, vm: &str, script: &str) -> String {
    d.agent_sh_ok(vm, script)
}

fn vm(name: &str, firmware: &str, disk: &str, cloud_init: Value) -> Value {
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
           "metadata": {"name": name},
           "spec": {"runPolicy": "AlwaysOn", "cpus": 1, "memory": "768Mi",
                    "firmware": firmware, "stopTimeoutSeconds": 60,
                    "disks": [{"virtualDiskName": disk}],
                    "cloudInit": cloud_init, "guestAgent": true}})
}

#[test]
fn debian_image_boots_with_bios_and_uefi_and_cloud_init_applies_and_snapshots_restore() {
    let _serial = serial();
    let (image, sha) = debian_image();
    let user = default_user();
    let server = Server::start();
    server.route("/debian-12.qcow2", Behaviour::File(image.clone()));
    let d = Daemon::start();
    let t0 = Instant::now();
    let mark = |what: &str| {
        eprintln!(
            "debian_guest: {:>6.1} s  {what}",
            t0.elapsed().as_secs_f64()
        )
    };

    // --- the image, over HTTP, checked against its sha256 -----------------
    d.apply(vec![
        Image::http("debian-12", &server.url("/debian-12.qcow2"), &sha).json(),
    ]);
    let img = d.wait_object("virtualimages", "debian-12", "Ready", IMPORT_TIMEOUT, |v| {
        let p = &v["status"]["phase"];
        assert_ne!(p, "Failed", "import failed: {v:#}");
        p == "Ready"
    });
    assert_eq!(img["status"]["format"], "qcow2", "{img:#}");
    assert_eq!(img["status"]["digest"], format!("sha256:{sha}"), "{img:#}");
    let virtual_size = img["status"]["virtualSize"].as_u64().expect("virtualSize");
    let stored = PathBuf::from(img["status"]["path"].as_str().expect("path"));
    assert_eq!(
        std::fs::metadata(&stored).expect("stored image").len(),
        std::fs::metadata(&image).expect("source image").len(),
        "the stored image is the served file"
    );

    // --- disks from it: one twice its size, one as large as it ------------
    d.apply(vec![
        image_disk("deb-bios-root", "debian-12", Some(virtual_size * 2)),
        image_disk("deb-uefi-root", "debian-12", None),
    ]);
    for disk in ["deb-bios-root", "deb-uefi-root"] {
        d.wait_object(
            "virtualdisks",
            disk,
            "Ready",
            Duration::from_secs(60),
            |v| v["status"]["phase"] == "Ready",
        );
    }
    let bios_disk = d.get_disk("deb-bios-root").expect("disk");
    let bios_file = PathBuf::from(bios_disk["status"]["path"].as_str().expect("path"));
    let chain = backing_chain(&bios_file);
    assert_eq!(
        chain.last(),
        Some(&stored),
        "the disk is a copy-on-write overlay over the stored image: {chain:?}"
    );
    assert_eq!(
        bios_disk["status"]["capacity"].as_u64(),
        Some(virtual_size * 2)
    );

    // --- two VMs, BIOS and UEFI, configured by cloud-init -----------------
    let user_data =
        "#cloud-config\nruncmd:\n  - [sh, -c, 'echo ran-by-cloud-init > /var/lib/hearth-runcmd']\n";
    d.apply(vec![
        vm(
            "deb-bios",
            "BIOS",
            "deb-bios-root",
            json!({"userData": user_data, "sshAuthorizedKeys": [TEST_KEY]}),
        ),
        vm(
            "deb-uefi",
            "UEFI",
            "deb-uefi-root",
            json!({"userData": user_data, "hostname": "uefi-host",
                       "sshAuthorizedKeys": [TEST_KEY]}),
        ),
    ]);
    mark("image Ready, disks Ready, VMs applied");
    for name in ["deb-bios", "deb-uefi"] {
        d.wait_vm(name, "agent connected", DEBIAN_BOOT_TIMEOUT, |v| {
            v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true
        });
        mark(&format!("{name}: guest agent connected"));
    }

    // The firmware really is what the spec says: only OVMF gives the guest EFI.
    let (efi_bios, _) = sh(&d, "deb-bios", "test -d /sys/firmware/efi");
    assert_ne!(efi_bios, 0, "the BIOS VM booted through UEFI");
    sh_ok(&d, "deb-uefi", "test -d /sys/firmware/efi");
    // Each UEFI VM has its own variables file, kept with the VM.
    let vars = d.state_dir().join("vms/deb-uefi/uefi-vars.fd");
    assert!(vars.is_file(), "{} missing", vars.display());
    assert!(
        !d.state_dir().join("vms/deb-bios/uefi-vars.fd").exists(),
        "a BIOS VM has no UEFI variables"
    );

    for (name, host) in [("deb-bios", "deb-bios"), ("deb-uefi", "uefi-host")] {
        let got = wait_guest(
            &d,
            name,
            "cloud-init's runcmd",
            "cat /var/lib/hearth-runcmd",
            Duration::from_secs(300),
        );
        assert_eq!(got.trim(), "ran-by-cloud-init", "{name}");
        let hostname = sh_ok(&d, name, "hostname");
        assert_eq!(hostname.trim(), host, "{name}: hostname");
        let keys = sh_ok(&d, name, &format!("cat ~{user}/.ssh/authorized_keys"));
        assert!(
            keys.lines().any(|l| l.trim() == TEST_KEY),
            "{name}: the key is not in ~{user}/.ssh/authorized_keys: {keys:?}"
        );
    }
    // The BIOS VM's root filesystem grew into its doubled disk.
    let root_size: u64 = wait_guest(
        &d,
        "deb-bios",
        "the root filesystem grown",
        &format!(
            "s=$(df -B1 --output=size / | tail -n1); [ \"$s\" -gt {virtual_size} ] && echo $s"
        ),
        Duration::from_secs(120),
    )
    .trim()
    .parse()
    .expect("df size");
    assert!(
        root_size > virtual_size,
        "root {root_size} <= image {virtual_size}"
    );

    // --- a consistent snapshot under a write load -------------------------
    // A writer appends numbered lines (each one written and fsynced by dd) for
    // the whole snapshot; the restored disk must hold a gapless prefix.
    sh_ok(
        &d,
        "deb-bios",
        "rm -f /var/lib/hearth-writer.log; nohup sh -c 'i=0; while [ $i -lt 100000 ]; do i=$((i+1)); echo $i | dd of=/var/lib/hearth-writer.log oflag=append conv=notrunc,fsync status=none; done' >/dev/null 2>&1 &",
    );
    wait_guest(
        &d,
        "deb-bios",
        "the writer writing",
        "[ $(wc -l < /var/lib/hearth-writer.log) -gt 20 ]",
        Duration::from_secs(60),
    );
    let snap = "deb-bios-1";
    d.apply(vec![VmSnapshot::of(snap, "deb-bios").json()]);
    let s = d.wait_object(
        "virtualmachinesnapshots",
        snap,
        "final",
        Duration::from_secs(120),
        |v| matches!(v["status"]["phase"].as_str(), Some("Ready" | "Failed")),
    );
    assert_eq!(s["status"]["phase"], "Ready", "{s:#}");
    assert_eq!(s["status"]["consistent"], true, "{s:#}");
    mark("VM snapshot Ready and consistent");
    let at_cut: u64 = sh_ok(&d, "deb-bios", "wc -l < /var/lib/hearth-writer.log")
        .trim()
        .parse()
        .expect("line count");

    // --- restore, and boot the restored disk ------------------------------
    let before = d.get_vm("deb-bios").expect("vm")["status"]["pid"].clone();
    d.cli_ok(&[
        "restore",
        "vm",
        "deb-bios",
        "--from",
        snap,
        "--timeout",
        "300s",
    ]);
    let after = d.wait_vm(
        "deb-bios",
        "agent connected after the restore",
        DEBIAN_BOOT_TIMEOUT,
        |v| {
            v["status"]["phase"] == "Running"
                && v["status"]["agentConnected"] == true
                && v["status"]["pid"] != before
        },
    );
    mark("restored VM's guest agent connected");
    let pid = after["status"]["pid"].as_u64().expect("pid") as u32;
    assert!(is_alive(pid), "the restored VM's QEMU {pid} runs");
    let log = sh_ok(&d, "deb-bios", "cat /var/lib/hearth-writer.log");
    let lines: Vec<u64> = log
        .lines()
        .map(|l| l.trim().parse().expect("a whole line"))
        .collect();
    assert!(!lines.is_empty(), "the writer's log is in the snapshot");
    for (i, n) in lines.iter().enumerate() {
        assert_eq!(*n, i as u64 + 1, "gapless prefix: line {i} is {n}");
    }
    assert!(
        (lines.len() as u64) <= at_cut,
        "the restored log ({}) is from the cut, before {at_cut} lines",
        lines.len()
    );
    // The restored guest still has what cloud-init did before the cut.
    let got = sh_ok(&d, "deb-bios", "cat /var/lib/hearth-runcmd");
    assert_eq!(got.trim(), "ran-by-cloud-init");

    // --- an image in use cannot be deleted --------------------------------
    let (status, v) = d.request("DELETE", "/v1/virtualimages/debian-12", None);
    assert_eq!(status, 409, "{v}");
    let msg = v.to_string();
    assert!(
        msg.contains("deb-bios-root") || msg.contains("deb-uefi-root"),
        "{msg}"
    );
}

/// `hearth restart` the moment the guest agent first answers, and then a
/// `hearth stop` with qemu-ga stopped in the guest: both end in the guest's
/// own orderly power-off, before the grace period, never in a forced stop.
///
/// The restart comes early in the boot, when systemd-logind (which qemu-ga's
/// `shutdown -h -P +0` goes through) does not run yet, so qemu-ga refuses
/// the shutdown and the ACPI power button has to do it. Two boots in all:
/// the second one serves both the first check's evidence (the first boot's
/// journal, its own fsck) and the second check.
///
/// Ground truth is the guest's: its persistent journal, its console (the
/// journal is forwarded to it for the second check) and the root
/// filesystem's state as the next boot's fsck finds it.
#[test]
fn a_restart_right_after_boot_and_a_stop_without_the_agent_power_the_guest_off_cleanly() {
    let _serial = serial();
    let (image, sha) = debian_image();
    let server = Server::start();
    server.route("/debian-12.qcow2", Behaviour::File(image));
    let d = Daemon::start();
    let t0 = Instant::now();
    let mark = |what: &str| {
        eprintln!(
            "debian_guest stop: {:>6.1} s  {what}",
            t0.elapsed().as_secs_f64()
        )
    };
    let name = "deb-stop";
    let grace = Duration::from_secs(60);
    d.apply(vec![
        Image::http("debian-12", &server.url("/debian-12.qcow2"), &sha).json(),
        image_disk("deb-stop-root", "debian-12", None),
        vm(
            name,
            "BIOS",
            "deb-stop-root",
            json!({"userData": "#cloud-config\n"}),
        ),
    ]);

    // --- restart right after the agent's first answer -----------------------
    let first = d.wait_vm(
        name,
        "agent connected",
        IMPORT_TIMEOUT + DEBIAN_BOOT_TIMEOUT,
        |v| v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true,
    );
    let pid1 = first["status"]["pid"].as_u64().expect("pid") as u32;
    mark("first boot: agent connected; restarting");
    let asked = Instant::now();
    d.cli_ok(&["restart", name]);
    let relaunched = std::cell::Cell::new(None);
    let second = d.wait_vm(
        name,
        "running again with a new QEMU and its agent",
        grace + DEBIAN_BOOT_TIMEOUT,
        |v| {
            let new_pid = v["status"]["pid"]
                .as_u64()
                .is_some_and(|p| p != u64::from(pid1));
            if new_pid && relaunched.get().is_none() {
                relaunched.set(Some(asked.elapsed()));
            }
            new_pid && v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true
        },
    );
    let took = relaunched.get().expect("seen relaunched");
    mark(&format!(
        "restarted: the new QEMU ran {took:.1?} after the request"
    ));
    assert!(!is_alive(pid1), "the first QEMU {pid1} still runs");
    let pid2 = second["status"]["pid"].as_u64().expect("pid") as u32;
    assert!(is_alive(pid2), "{second:#}");
    assert!(
        took < grace,
        "the restart took {took:?}: as long as a stop forced after its {grace:?} grace period"
    );
    let reasons = d.event_reasons("VirtualMachine", name);
    assert!(
        !reasons.iter().any(|r| r == "ForcedStop"),
        "{:#?}",
        d.events("VirtualMachine", name)
    );
    assert_eq!(forced_stops(&d, name), 0.0);
    // The first boot's journal ends in systemd's power-off, and the second
    // boot's fsck finds the root filesystem clean (after QEMU is made to quit
    // it says "recovering journal").
    let boots = sh_ok(
        &d,
        name,
        "journalctl --list-boots --no-pager | tail -n +2 | wc -l",
    );
    assert_eq!(boots.trim(), "2", "two boots in the journal");
    let journal = sh_ok(&d, name, "journalctl -b -1 -o short-monotonic --no-pager");
    let shutdown_lines: Vec<&str> = journal
        .lines()
        .filter(|l| {
            [
                "guest-shutdown called",
                "Power key",
                "power button",
                "powering",
                "logind",
                "poweroff.target",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect();
    eprintln!(
        "debian_guest stop: the first boot's shutdown, from its journal:\n{}",
        shutdown_lines.join("\n")
    );
    assert!(
        journal.contains("Reached target poweroff.target"),
        "the first boot did not power off through systemd:\n{}",
        journal
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let console = std::fs::read_to_string(serial_log(&d, name)).unwrap_or_default();
    let fsck: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("debian-root:"))
        .collect();
    assert!(
        fsck.iter().any(|l| l.contains("debian-root: clean"))
            && !console.contains("recovering journal"),
        "the second boot's fsck: {fsck:?}"
    );

    // --- a stop with the agent stopped in the guest: the power button -------
    // The journal goes to the console from here on, so the console shows who
    // acted on the stop.
    sh_ok(
        &d,
        name,
        "mkdir -p /etc/systemd/journald.conf.d && printf '[Journal]\\nForwardToConsole=yes\\nMaxLevelConsole=info\\n' > /etc/systemd/journald.conf.d/10-console.conf && systemctl restart systemd-journald",
    );
    // Started, not waited for: qemu-ga goes away before it could answer.
    let (status, v) = d.request(
        "POST",
        &format!("/v1/virtualmachines/{name}/agent/exec/start"),
        Some(&json!({"path": "/bin/systemctl", "args": ["--no-block", "stop", "qemu-guest-agent.service"]})),
    );
    assert_eq!(status, 200, "{v}");
    d.wait_vm(name, "the agent gone", Duration::from_secs(120), |v| {
        v["status"]["agentConnected"] == false
    });
    mark("second boot: qemu-ga stopped in the guest; stopping the VM");
    let asked = Instant::now();
    d.cli_ok(&["stop", name]);
    d.wait_phase(name, "Stopped", grace + Duration::from_secs(30));
    let took = asked.elapsed();
    mark(&format!("stopped {took:.1?} after the request"));
    wait_until("the second QEMU gone", Duration::from_secs(10), || {
        !is_alive(pid2)
    });
    assert!(
        took < grace,
        "the stop took {took:?}, its grace period is {grace:?}"
    );
    let reasons = d.event_reasons("VirtualMachine", name);
    assert!(
        !reasons.iter().any(|r| r == "ForcedStop"),
        "{:#?}",
        d.events("VirtualMachine", name)
    );
    assert_eq!(forced_stops(&d, name), 0.0);
    let console = std::fs::read_to_string(serial_log(&d, name)).unwrap_or_default();
    let tail: String = console
        .lines()
        .skip_while(|l| {
            !l.contains("Stopped qemu-guest-agent.service")
                && !l.contains("Stopped QEMU Guest Agent")
        })
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!("debian_guest stop: the second boot's console from qemu-ga's stop:\n{tail}");
    assert!(
        !tail.is_empty(),
        "the console does not show qemu-ga stopping:\n{console}"
    );
    assert!(
        !tail.contains("guest-shutdown called"),
        "qemu-ga shut the guest down after it was stopped?\n{tail}"
    );
    // The image's own handler saw the press (acpid's rule logs either way:
    // it powers off while systemd-logind does not run yet, else leaves the
    // press to logind).
    assert!(
        tail.contains("power button pressed: "),
        "the guest's acpid did not see the power button:\n{tail}"
    );
    assert!(
        tail.contains("Reached target poweroff.target") && tail.contains("reboot: Power down"),
        "the guest did not power off through systemd:\n{tail}"
    );
}
