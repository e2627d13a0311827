//! Firmware and cloud-init end to end: a real hearthd starts real QEMU with
//! SeaBIOS or OVMF, gives a UEFI VM its own variables file, and gives a VM
//! with `cloudInit` a NoCloud seed that the guest sees and no snapshot covers.
//!
//! The test guest does not run cloud-init; what the seed holds is read on
//! the host with the same FAT implementation hearthd writes it with, and with
//! `blkid` (what cloud-init's ds-identify looks for the label with).

mod common;

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
const SNAP_TIMEOUT: Duration = Duration::from_secs(90);

fn require_ovmf() {
    for f in [OVMF_CODE, OVMF_VARS] {
        assert!(
            Path::new(f).is_file(),
            "{f} is missing: install OVMF with `apt-get install ovmf` (or run .ci/install-deps.sh)"
        );
    }
}

fn overlay_disk(name: &str) -> Value {
    Disk::from_image(name, guest_dir().join("data.qcow2")).json()
}

/// A VM of the test guest with `spec` merged over the usual fields.
fn vm(name: &str, spec: Value) -> Value {
    let mut base = json!({"runPolicy": "AlwaysOn", "memory": "256Mi",
                          "stopTimeoutSeconds": 10});
    for (k, v) in spec.as_object().expect("spec object") {
        base[k] = v.clone();
    }
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
           "metadata": {"name": name}, "spec": base})
}

fn guest_kernel_boot() -> Value {
    let g = guest_dir();
    json!({"kernel": g.join("vmlinuz"), "initrd": g.join("initrd.img"),
           "cmdline": "console=ttyS0 quiet panic=-1"})
}

/// The argv of a running process, one element each.
fn argv_of(pid: u32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    raw.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

fn value_after(argv: &[String], flag: &str) -> Vec<String> {
    argv.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].clone())
        .collect()
}

/// Every file of the seed image, by name, read with the `fatfs` crate, and
/// its volume label.
fn read_seed(path: &Path) -> (String, Vec<(String, String)>) {
    let file = std::fs::File::open(path).expect("open seed");
    let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).expect("the seed is FAT");
    let label = fs.volume_label();
    let mut files = Vec::new();
    for entry in fs.root_dir().iter() {
        let entry = entry.expect("dir entry");
        if entry.is_file() {
            let mut text = String::new();
            entry
                .to_file()
                .read_to_string(&mut text)
                .expect("read file");
            files.push((entry.file_name(), text));
        }
    }
    files.sort();
    (label, files)
}

fn file<'a>(files: &'a [(String, String)], name: &str) -> &'a str {
    files
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.as_str())
        .unwrap_or_else(|| panic!("no {name} in the seed: {files:?}"))
}

fn blkid(path: &Path) -> String {
    let out = Command::new("blkid")
        .args(["-o", "export"])
        .arg(path)
        .output()
        .expect("run blkid (util-linux)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn uefi_vm_with_cloud_init_keeps_its_vars_gets_a_seed_and_snapshots_only_its_disk() {
    require_ovmf();
    let _serial = serial();
    let d = Daemon::start();
    let user_data = "#cloud-config\nruncmd: [[touch, /etc/hearth-was-here]]\n";
    let network_config =
        "version: 2\nethernets:\n  all:\n    match: {name: \"e*\"}\n    dhcp4: true\n";
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHearthTestKey me@laptop";
    let cloud_init = json!({"userData": user_data, "networkConfig": network_config,
                            "sshAuthorizedKeys": [key], "hostname": "web-1"});
    d.apply(vec![
        overlay_disk("ci-root"),
        vm(
            "ci",
            json!({"firmware": "UEFI", "boot": guest_kernel_boot(),
                       "disks": [{"virtualDiskName": "ci-root"}],
                       "cloudInit": cloud_init}),
        ),
    ]);
    let booting = std::time::Instant::now();
    let v = d.wait_agent("ci");
    eprintln!(
        "UEFI (OVMF) kernel boot, apply to agent connected: {:?}",
        booting.elapsed()
    );
    let pid1 = pid_of(&v);
    let state = d.state_dir().join("vms/ci");
    let vars = state.join("uefi-vars.fd");
    let seed = state.join("cidata.img");

    // The kernel ran under OVMF (the guest sees UEFI), from the flash images.
    let argv = argv_of(pid1);
    assert_eq!(
        value_after(&argv, "-machine"),
        vec!["q35,pflash0=ovmf-code,pflash1=ovmf-vars"],
        "{argv:?}"
    );
    assert!(argv.iter().any(|a| a == "-kernel"), "{argv:?}");
    assert_eq!(
        d.agent_sh_ok("ci", "test -d /sys/firmware/efi && echo uefi"),
        "uefi\n"
    );

    // Its own variables file, copied from the template on this first start.
    let meta = std::fs::metadata(&vars).expect("the VM's UEFI variables file");
    assert_eq!(
        meta.len(),
        std::fs::metadata(OVMF_VARS).expect("template").len()
    );
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let vars_inode = meta.ino();
    assert!(
        d.event_reasons("VirtualMachine", "ci")
            .contains(&"UefiVarsCreated".to_string())
    );

    // The seed: FAT labelled CIDATA with the spec's files.
    let instance_id = v["status"]["cloudInitInstanceId"]
        .as_str()
        .expect("cloudInitInstanceId")
        .to_string();
    assert!(instance_id.starts_with("hearth-ci-"), "{instance_id}");
    let (label, files) = read_seed(&seed);
    assert_eq!(label, "CIDATA");
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["meta-data", "network-config", "user-data"]);
    assert_eq!(file(&files, "user-data"), user_data);
    assert_eq!(file(&files, "network-config"), network_config);
    assert_eq!(
        file(&files, "meta-data"),
        format!("instance-id: {instance_id}\nlocal-hostname: web-1\npublic-keys:\n- {key}\n")
    );
    let ids = blkid(&seed);
    assert!(ids.contains("LABEL=CIDATA\n"), "{ids}");
    assert!(ids.contains("TYPE=vfat\n"), "{ids}");
    let seed_inode = std::fs::metadata(&seed).expect("seed").ino();

    // In the guest the VirtualDisk stays the first disk, and the seed comes
    // after it, read-only, with its label where FAT keeps it.
    assert_eq!(d.agent_sh_ok("ci", "cat /sys/block/vda/serial"), "ci-root");
    assert_eq!(d.agent_sh_ok("ci", "ls /sys/block | grep vd"), "vda\nvdb\n");
    assert_eq!(d.agent_sh_ok("ci", "cat /sys/block/vdb/ro"), "1\n");
    assert_eq!(
        d.agent_sh_ok("ci", "dd if=/dev/vdb bs=1 skip=43 count=11 2>/dev/null"),
        "CIDATA     "
    );
    assert_eq!(
        d.agent_sh_ok("ci", "cat /data/hello.txt"),
        "hello from hearth\n"
    );

    // A VM snapshot covers the VirtualDisk and nothing else.
    d.apply(vec![VmSnapshot::of("ci-snap", "ci").json()]);
    let snap = d.wait_final("virtualmachinesnapshots", "ci-snap", SNAP_TIMEOUT);
    assert_eq!(snap["status"]["phase"], "Ready", "{snap:#}");
    let children = snap["status"]["virtualDiskSnapshotNames"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(children.len(), 1, "{snap:#}");
    let child = children[0].as_str().expect("name");
    let (_, ds) = d.request("GET", &format!("/v1/virtualdisksnapshots/{child}"), None);
    assert_eq!(ds["spec"]["virtualDiskName"], "ci-root", "{ds:#}");
    assert_eq!(ds["status"]["consistent"], true, "{ds:#}");
    // The guest's filesystems on its first disk are found on the VirtualDisk
    // with the seed attached too (the test guest has no udev, so this goes by
    // the disk's PCI address, which the seed after it does not move).
    let mut on_vda: Vec<String> = d
        .agent_sh_ok("ci", "cat /proc/mounts")
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("/dev/vda")).then(|| f.next().unwrap_or_default().to_string())
        })
        .collect();
    on_vda.sort();
    assert!(!on_vda.is_empty());
    assert_eq!(ds["status"]["frozenMountPoints"], json!(on_vda), "{ds:#}");
    // No layer file, nor anything else hearthd keeps, was made from the seed,
    // and the seed itself was not touched.
    let layers = files_under(&d.state_dir().join("layers"));
    assert!(!layers.is_empty());
    for layer in &layers {
        let chain = backing_chain(layer);
        assert!(
            !chain.iter().any(|p| p.ends_with("cidata.img")),
            "{} stands on the seed: {chain:?}",
            layer.display()
        );
    }
    assert_eq!(std::fs::metadata(&seed).expect("seed").ino(), seed_inode);

    // A new userData restarts the VM: the seed is built again with a new
    // instance-id, and the variables file is the same file as before.
    let new_user_data = "#cloud-config\nruncmd: [[touch, /etc/hearth-was-here-again]]\n";
    let mut cloud_init = cloud_init.clone();
    cloud_init["userData"] = json!(new_user_data);
    d.apply(vec![vm(
        "ci",
        json!({"firmware": "UEFI", "boot": guest_kernel_boot(),
                   "disks": [{"virtualDiskName": "ci-root"}],
                   "cloudInit": cloud_init}),
    )]);
    let v = d.wait_vm("ci", "restarted with the new spec", BOOT_TIMEOUT, |v| {
        v["status"]["phase"] == "Running"
            && v["status"]["agentConnected"] == true
            && v["status"]["pid"]
                .as_u64()
                .is_some_and(|p| p as u32 != pid1)
    });
    assert!(!is_alive(pid1));
    let new_id = v["status"]["cloudInitInstanceId"]
        .as_str()
        .expect("cloudInitInstanceId");
    assert_ne!(new_id, instance_id, "the content changed, so the id did");
    let (_, files) = read_seed(&seed);
    assert_eq!(file(&files, "user-data"), new_user_data);
    assert!(
        file(&files, "meta-data").contains(&format!("instance-id: {new_id}\n")),
        "{files:?}"
    );
    assert_ne!(
        std::fs::metadata(&seed).expect("seed").ino(),
        seed_inode,
        "rebuilt and renamed into place"
    );
    let meta = std::fs::metadata(&vars).expect("vars");
    assert_eq!(meta.ino(), vars_inode, "the variables file was kept");
    assert_ne!(
        std::fs::read(&vars).expect("vars"),
        std::fs::read(OVMF_VARS).expect("template"),
        "it holds what OVMF wrote, not a fresh copy of the template"
    );
    assert_eq!(
        d.event_reasons("VirtualMachine", "ci")
            .iter()
            .filter(|r| *r == "UefiVarsCreated")
            .count(),
        1
    );

    // Deleting the VM takes its variables file and its seed along.
    let (status, v) = d.request("DELETE", "/v1/virtualmachines/ci", None);
    assert!(status == 200 || status == 202, "{status} {v}");
    d.wait_gone("virtualmachines", "ci", Duration::from_secs(60));
    assert!(!vars.exists());
    assert!(!seed.exists());
    assert!(!state.exists());
}

#[test]
fn a_vm_without_boot_starts_seabios_on_its_disk_and_uefi_without_ovmf_fails_naming_the_file() {
    let _serial = serial();
    let missing_code = "/nonexistent/hearth-test/OVMF_CODE_4M.fd";
    let d = Daemon::start_with(&["--ovmf-code", missing_code]);
    d.apply(vec![
        overlay_disk("bios-root"),
        vm(
            "bios",
            json!({"disks": [{"virtualDiskName": "bios-root"}], "guestAgent": false,
                       "cloudInit": {}}),
        ),
        overlay_disk("uefi-root"),
        vm(
            "uefi",
            json!({"firmware": "UEFI", "disks": [{"virtualDiskName": "uefi-root"}],
                       "guestAgent": false}),
        ),
    ]);

    // BIOS: SeaBIOS runs and tries the VirtualDisk (an ext4 image, nothing
    // to boot), never the seed; there is no kernel on the command line.
    let v = d.wait_phase("bios", "Running", Duration::from_secs(60));
    let log = serial_log(&d, "bios");
    wait_until(
        "SeaBIOS gives up on the disk",
        Duration::from_secs(60),
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("No bootable device")
        },
    );
    let console = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(console.contains("SeaBIOS"), "{console}");
    assert!(console.contains("Booting from Hard Disk"), "{console}");
    let argv = argv_of(pid_of(&v));
    assert!(!argv.iter().any(|a| a == "-kernel"), "{argv:?}");
    assert_eq!(value_after(&argv, "-boot"), vec!["strict=on"]);
    let devices: Vec<Value> = value_after(&argv, "-device")
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .filter(|d: &Value| d["driver"] == "virtio-blk-pci")
        .collect();
    assert_eq!(devices.len(), 2, "{devices:?}");
    assert_eq!(devices[0]["id"], "vdisk0");
    assert_eq!(devices[0]["bootindex"], 0);
    assert_eq!(devices[1]["id"], "cidata", "the seed comes last");
    assert!(devices[1].get("bootindex").is_none(), "{devices:?}");
    // An empty cloudInit still gets a seed: hostname and a minimal user-data.
    let (label, files) = read_seed(&d.state_dir().join("vms/bios/cidata.img"));
    assert_eq!(label, "CIDATA");
    assert_eq!(file(&files, "user-data"), "#cloud-config\n");
    assert!(file(&files, "meta-data").contains("local-hostname: bios\n"));

    // UEFI without OVMF's code image: Failed, saying which file and what to
    // install; nothing was started and no variables file was made.
    let v = d.wait_phase("uefi", "Failed", Duration::from_secs(60));
    let err = v["status"]["lastError"].as_str().unwrap_or_default();
    assert!(err.contains("spec.firmware"), "{err}");
    assert!(err.contains(missing_code), "{err}");
    assert!(err.contains("apt-get install ovmf"), "{err}");
    assert!(!d.state_dir().join("vms/uefi/uefi-vars.fd").exists());
    assert_eq!(d.qemu_pids_of("uefi"), Vec::<u32>::new());
    assert!(
        d.event_reasons("VirtualMachine", "uefi")
            .contains(&"FailedToStart".to_string())
    );

    for name in ["bios", "uefi"] {
        d.request("DELETE", &format!("/v1/virtualmachines/{name}"), None);
    }
    wait_until("VMs gone", Duration::from_secs(60), || {
        d.get_vm("bios").is_none() && d.get_vm("uefi").is_none()
    });
    assert!(!d.state_dir().join("vms/bios").exists());
}
