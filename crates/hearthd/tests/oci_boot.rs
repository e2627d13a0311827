//! OCI images booted for real: the Debian 12 test guest (guest/debian/)
//! made into OCI images here with umoci (its root tree as a rootfs layer,
//! its qcow2 as a containerDisk), pushed with skopeo to a real registry on
//! 127.0.0.1, pulled by hearthd, and booted to the real qemu-ga:
//!
//! - a rootfs image with its own `/boot`: hearth's kernel boot of that
//!   kernel (no `spec.boot` at all);
//! - a rootfs image without `/boot`, given a kernel image (only
//!   `/boot/vmlinuz` and `/boot/initrd.img`) by `spec.boot.kernelImage`;
//! - a containerDisk image of the qcow2, booted through the firmware.
//!
//! Ground truth from the guest (`/proc/cmdline`, `uname -r`, `hostname`
//! set by cloud-init from the seed) and from the files (the stored kernel's
//! bytes against the tree's). The three VMs boot at once on one hearthd.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::debian::*;
use common::*;
use hearth_api::OciSource;
use hearth_test_support::oci::{TestRegistry, sha256sum, tool, umoci_tag};
use serde_json::{Value, json};

const PULL: Duration = Duration::from_secs(600);

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The Debian image's root filesystem, mounted read-only; unmounted (and
/// its raw copy removed) when dropped.
struct Mounted {
    dir: PathBuf,
}

impl Mounted {
    fn new(qcow2: &Path, work: &Path) -> Mounted {
        let raw = work.join("debian.raw");
        tool(
            "qemu-img",
            &["convert", "-q", "-O", "raw", s(qcow2), s(&raw)],
        );
        let dir = work.join("mnt");
        fs::create_dir_all(&dir).unwrap();
        // Partition 1 (the root) starts at sector 262144 (guest/debian/build.sh).
        tool(
            "mount",
            &[
                "-o",
                "ro,loop,offset=134217728",
                "-t",
                "ext4",
                s(&raw),
                s(&dir),
            ],
        );
        Mounted { dir }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// A tar of `dir`'s content (owners by number, xattrs), in `out`.
fn tar_dir(dir: &Path, out: &Path, exclude: &[&str]) {
    let mut args = vec![
        "--numeric-owner".to_string(),
        "--xattrs".into(),
        "--xattrs-include=*".into(),
        "-C".into(),
        s(dir).into(),
        "-cf".into(),
        s(out).into(),
    ];
    for e in exclude {
        args.insert(0, format!("--exclude={e}"));
    }
    args.push(".".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    tool("tar", &refs);
}

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
    let (qcow2, _) = debian_image();
    let info = fs::read_to_string(debian_out_dir().join("debian-12.info")).unwrap();
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("kernel="))
        .expect("debian-12.info names the kernel")
        .trim()
        .to_string();
    let t0 = Instant::now();
    let mark = |what: &str| eprintln!("oci_boot: {:>6.1} s  {what}", t0.elapsed().as_secs_f64());
    let work = tempfile::Builder::new()
        .prefix("hearth-oci-boot-")
        .tempdir()
        .unwrap();
    let w = work.path();

    // --- the layers, from the Debian image's own tree ---------------------
    let tree = Mounted::new(&qcow2, w);
    let root = &tree.dir;
    let kernel_file = root.join(format!("boot/vmlinuz-{version}"));
    let initrd_file = root.join(format!("boot/initrd.img-{version}"));
    assert!(kernel_file.is_file() && initrd_file.is_file(), "{version}");
    let kernel_sha = sha256sum(&kernel_file);
    let initrd_sha = sha256sum(&initrd_file);
    let base = w.join("base.tar");
    tar_dir(root, &base, &[]);
    // Without /boot (and the links to it).
    let noboot = w.join("noboot.tar");
    tar_dir(
        root,
        &noboot,
        &[
            "./boot",
            "./vmlinuz",
            "./vmlinuz.old",
            "./initrd.img",
            "./initrd.img.old",
        ],
    );
    // The partition's UUIDs mean nothing on hearth's disk.
    let fix = w.join("fix");
    fs::create_dir_all(fix.join("etc")).unwrap();
    fs::write(
        fix.join("etc/fstab"),
        "/dev/vda / ext4 defaults,errors=remount-ro 0 0\n",
    )
    .unwrap();
    let fstab = w.join("fstab.tar");
    tar_dir(&fix, &fstab, &[]);
    // A kernel image, as Ignite's are: the kernel and initrd, nothing else.
    let k = w.join("k");
    fs::create_dir_all(k.join("boot")).unwrap();
    fs::copy(&kernel_file, k.join("boot/vmlinuz")).unwrap();
    fs::copy(&initrd_file, k.join("boot/initrd.img")).unwrap();
    let kernel_tar = w.join("kernel.tar");
    tar_dir(&k, &kernel_tar, &[]);
    drop(tree);
    let _ = fs::remove_file(w.join("debian.raw"));
    // A containerDisk: the qcow2 under /disk/.
    let cd = w.join("cd");
    fs::create_dir_all(cd.join("disk")).unwrap();
    fs::copy(&qcow2, cd.join("disk/debian-12.qcow2")).unwrap();
    let disk_tar = w.join("disk.tar");
    tar_dir(&cd, &disk_tar, &[]);
    let layout = w.join("layout");
    umoci_tag(&layout, "rootfs", &[&base, &fstab]);
    umoci_tag(&layout, "noboot", &[&noboot, &fstab]);
    umoci_tag(&layout, "kernel", &[&kernel_tar]);
    umoci_tag(&layout, "disk", &[&disk_tar]);
    for f in [&base, &noboot, &disk_tar] {
        let _ = fs::remove_file(f);
    }
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
}
