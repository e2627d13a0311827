//! OCI images booted for real: the Debian 12 test guest (guest/debian/)
//! made into OCI images here with umoci (its root tree as a rootfs layer,
//! its qcow2 as a containerDisk), pushed with skopeo to a real registry on
//! 127.0.0.1, pulled by hearthd, and booted to the real qemu-ga:
//!
//! - a rootfs image with its own `/boot`: hearth's kernel boot of that
//!   kernel (no `spec.boot` at all);
//! - a rootfs image without `/boot` and without modules, given a kernel
//!   image (only `/boot/vmlinuz`, `/boot/initrd.img` and
//!   `/lib/modules/VERSION`) by `spec.boot.kernelImage`: the guest loads a
//!   module hearth copied into its root disk;
//! - a containerDisk image of the qcow2, booted through the firmware.
//!
//! Ground truth from the guest (`/proc/cmdline`, `uname -r`, `hostname`
//! set by cloud-init from the seed) and from the files (the stored kernel's
//! bytes against the tree's). The three VMs boot at once on one hearthd.

mod common;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::debian::*;
use common::debian_oci::{DebianOci, debian_oci};
use common::*;
use hearth_api::OciSource;
use hearth_test_support::oci::{TestRegistry, sha256sum};
use serde_json::{Value, json};

const PULL: Duration = Duration::from_secs(600);

fn oci(name: &str, reference: &str) -> Value {
    Image::oci(
        name,
        OciSource {
            reference: Some(reference.to_string()),
            insecure: true,
            ..Default::default()
        },
    )
    .json()
}

fn vm(name: &str, disk: &str, boot: Option<Value>) -> Value {
    let mut spec = json!({"runPolicy": "AlwaysOn", "cpus": 1, "memory": "768Mi",
                          "stopTimeoutSeconds": 30,
                          "disks": [{"virtualDiskName": disk}],
                          "cloudInit": {"hostname": format!("{name}-host")},
                          "guestAgent": true});
    if let Some(b) = boot {
        spec["boot"] = b;
    }
    json!({"apiVersion": "hearth.dev/v1alpha1", "kind": "VirtualMachine",
           "metadata": {"name": name}, "spec": spec})
}

#[test]
fn rootfs_kernel_image_and_container_disk_images_boot_to_the_agent() {
    let _serial = serial();
    let t0 = Instant::now();
    let mark = |what: &str| eprintln!("oci_boot: {:>6.1} s  {what}", t0.elapsed().as_secs_f64());
    let work = tempfile::Builder::new()
        .prefix("hearth-oci-boot-")
        .tempdir()
        .unwrap();
    let DebianOci {
        layout,
        version,
        kernel_sha,
        initrd_sha,
        module,
        module_sha,
    } = debian_oci(work.path(), true);
    let registry = TestRegistry::start(false);
    let refs: Vec<String> = ["rootfs", "noboot", "kernel", "disk"]
        .iter()
        .map(|t| registry.push(&layout, t, &format!("debian/{t}:12")))
        .collect();
    mark("images built and pushed");

    // --- pulled by hearthd -------------------------------------------------
    let d = Daemon::start();
    d.apply(vec![
        oci("deb-rootfs", &refs[0]),
        oci("deb-noboot", &refs[1]),
        oci("deb-kernel", &refs[2]),
        oci("deb-disk", &refs[3]),
        image_disk("root-a", "deb-rootfs", None),
        image_disk("root-b", "deb-noboot", None),
        image_disk("root-c", "deb-disk", None),
        // (b) applied before its kernel image is Ready: it waits, then boots.
        vm(
            "oci-b",
            "root-b",
            Some(json!({"kernelImage": "deb-kernel", "cmdline": "hearth.test=kernel-image"})),
        ),
    ]);
    let mut ready = Vec::new();
    for name in ["deb-rootfs", "deb-noboot", "deb-kernel", "deb-disk"] {
        let v = d.wait_object("virtualimages", name, "Ready", PULL, |v| {
            let p = &v["status"]["phase"];
            assert_ne!(p, "Failed", "{name}: {v:#}");
            p == "Ready"
        });
        mark(&format!("{name} Ready"));
        ready.push(v);
    }
    let status = |i: usize| ready[i]["status"].clone();
    // The rootfs's own kernel and initrd, stored byte for byte.
    let a = status(0);
    assert_eq!(a["shape"], "rootfs", "{a:#}");
    assert_eq!(a["kernelVersion"], version.as_str(), "{a:#}");
    let stored_kernel = PathBuf::from(a["kernel"].as_str().expect("status.kernel"));
    let stored_initrd = PathBuf::from(a["initrd"].as_str().expect("status.initrd"));
    assert_eq!(sha256sum(&stored_kernel), kernel_sha);
    assert_eq!(sha256sum(&stored_initrd), initrd_sha);
    assert_eq!(
        stored_kernel.file_name().unwrap().to_str().unwrap(),
        format!("sha256-{kernel_sha}.kernel")
    );
    // Without /boot: no kernel. The kernel image's: the same files, once.
    let b = status(1);
    assert!(b["kernel"].is_null(), "{b:#}");
    let k = status(2);
    assert_eq!(k["kernel"], a["kernel"], "{k:#}");
    assert_eq!(k["initrd"], a["initrd"], "{k:#}");
    assert!(k["kernelVersion"].is_null(), "{k:#}");
    let c = status(3);
    assert_eq!(c["shape"], "containerDisk", "{c:#}");
    assert!(c["kernel"].is_null(), "{c:#}");

    d.apply(vec![
        vm("oci-a", "root-a", None),
        vm("oci-c", "root-c", None),
    ]);
    mark("VMs applied");
    for name in ["oci-a", "oci-b", "oci-c"] {
        d.wait_vm(name, "agent connected", DEBIAN_BOOT_TIMEOUT, |v| {
            assert_ne!(v["status"]["phase"], "Failed", "{name}: {v:#}");
            v["status"]["phase"] == "Running" && v["status"]["agentConnected"] == true
        });
        mark(&format!("{name}: guest agent connected"));
    }

    // (a) the image's own kernel, root and console from hearth.
    let cmdline = d.agent_sh_ok("oci-a", "cat /proc/cmdline");
    assert!(
        cmdline.starts_with("root=/dev/vda rw console=ttyS0"),
        "{cmdline}"
    );
    assert_eq!(d.agent_sh_ok("oci-a", "uname -r").trim(), version);
    // The guest's root is the disk hearth made, an ext4 without partitions.
    assert_eq!(
        d.agent_sh_ok("oci-a", "findmnt -no SOURCE /").trim(),
        "/dev/vda"
    );
    // (b) the kernel image's kernel, the spec's cmdline after hearth's.
    let cmdline = d.agent_sh_ok("oci-b", "cat /proc/cmdline");
    assert!(
        cmdline.starts_with("root=/dev/vda rw console=ttyS0 hearth.test=kernel-image"),
        "{cmdline}"
    );
    assert_eq!(d.agent_sh_ok("oci-b", "uname -r").trim(), version);
    d.agent_sh_ok("oci-b", "test ! -e /boot/vmlinuz-$(uname -r)");
    // The kernel image's modules are in its root disk (the rootfs image has
    // none: its ext4 is read below), byte for byte, and load.
    let got = d.agent_sh_ok(
        "oci-b",
        &format!("sha256sum /lib/modules/$(uname -r)/{module}"),
    );
    assert!(got.starts_with(&module_sha), "{got} vs {module_sha}");
    d.agent_sh_ok("oci-b", "modprobe dummy && grep -q '^dummy ' /proc/modules");
    let noboot_file = b["path"].as_str().expect("status.path of deb-noboot");
    let stat = std::process::Command::new("debugfs")
        .args(["-R", "stat /usr/lib/modules", noboot_file])
        .output()
        .expect("debugfs (e2fsprogs)");
    assert!(
        String::from_utf8_lossy(&stat.stderr).contains("File not found"),
        "the noboot image has modules of its own: {stat:?}"
    );
    // (c) GRUB's command line: the firmware booted the disk.
    let cmdline = d.agent_sh_ok("oci-c", "cat /proc/cmdline");
    assert!(cmdline.contains("root=UUID="), "{cmdline}");
    assert!(!cmdline.contains("root=/dev/vda"), "{cmdline}");
    // Every one has its cloud-init seed: cloud-init set the hostname.
    for name in ["oci-a", "oci-b", "oci-c"] {
        wait_guest(
            &d,
            name,
            "the hostname from the seed",
            &format!("test \"$(hostname)\" = {name}-host"),
            Duration::from_secs(300),
        );
    }
    mark("checked in the guests");

    // QEMU read each image kernel through a link in run/boot; a deleted VM
    // leaves none (it would hold a released kernel's blocks).
    let boot = d.run_dir().join("boot");
    for name in ["oci-a", "oci-b"] {
        let link = boot.join(format!("{name}.kernel"));
        assert_eq!(sha256sum(&link), kernel_sha, "{}", link.display());
        d.request("DELETE", &format!("/v1/virtualmachines/{name}"), None);
    }
    wait_until("the VMs are gone", Duration::from_secs(120), || {
        d.get_vm("oci-a").is_none() && d.get_vm("oci-b").is_none()
    });
    let mut left: Vec<String> = fs::read_dir(&boot)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, Vec::<String>::new(), "run/boot after the deletes");
}
