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

fn apply(d: &Daemon, items: Vec<Value>) {
    let (status, v) = d.apply_json(items);
    assert_eq!(status, 200, "apply: {v}");
}

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
    apply(
        &d,
        vec![
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualImage",
                    "metadata": {"name": "debian-12"},
                    "spec": {"source": {"http": {"url": server.url("/debian-12.qcow2"), "sha256": sha}}}}),
        ],
    );
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
    apply(
        &d,
        vec![
            image_disk("deb-bios-root", "debian-12", Some(virtual_size * 2)),
            image_disk("deb-uefi-root", "debian-12", None),
        ],
    );
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
    apply(
        &d,
        vec![
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
        ],
    );
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
    apply(
        &d,
        vec![
            json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachineSnapshot",
                    "metadata": {"name": snap}, "spec": {"virtualMachineName": "deb-bios"}}),
        ],
    );
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
